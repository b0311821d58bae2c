"""``ProxyManagedServer``: a ``ManagedServer`` whose session lives on the proxy
(``managed_server_proxy``); ``ServerManager.managed_server()`` returns one when a proxy URL
is configured."""

from __future__ import annotations

import logging
from typing import Any

import httpx
from openai.types.chat.chat_completion import ChatCompletion
from openai.types.completion import Completion

from atroposlib.envs.server_handling.managed_server import SequenceNode

logger = logging.getLogger(__name__)


class ProxyError(RuntimeError):
    """The proxy answered with an error."""


async def _request(method: str, url: str, timeout: float, json: Any = None) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=timeout) as client:
        response = await client.request(method, url, json=json)
    try:
        data = response.json()
    except ValueError:
        data = {"error": {"message": response.text}}
    if response.status_code != 200:
        message = (
            data.get("error", {}).get("message", str(data)) if isinstance(data, dict) else data
        )
        raise ProxyError(f"Proxy request failed ({response.status_code}): {message}")
    return data


class ProxyManagedServer:
    """The ``ManagedServer`` interface over one proxy session.

    ``chat_completion`` goes through the proxy and refreshes the node cache, so
    ``get_state()`` reflects the latest completion. ``get_url()`` gives the session's OpenAI
    base URL for external programs (then call ``fetch_state()`` to see their nodes).
    """

    def __init__(
        self,
        proxy_url: str,
        session_uuid: str,
        model_name: str = "unknown",
        base_url: str | None = None,
        timeout: float = 1200.0,
    ) -> None:
        self.proxy_url = proxy_url.rstrip("/")
        self.session_uuid = session_uuid
        self.model_name = model_name
        self.base_url = base_url
        self.timeout = timeout
        self._cached_nodes: list[SequenceNode] | None = None

    def get_url(self) -> str:
        """The session's OpenAI-compatible base URL (``{proxy}/{uuid}/v1``)."""
        return f"{self.proxy_url}/{self.session_uuid}/v1"

    async def chat_completion(self, **kwargs: Any) -> ChatCompletion:
        """A tracked chat completion on the proxy (``messages``, ``n``, ``max_tokens``,
        ``temperature``, ``top_p``, ``seed``, ``stop``, ``tools``, ``tool_choice``)."""
        body: dict[str, Any] = {
            "messages": [dict(m) for m in kwargs.get("messages", [])],
            "n": kwargs.get("n", 1),
            "temperature": kwargs.get("temperature", 1.0),
            "max_tokens": kwargs.get("max_tokens") or kwargs.get("max_completion_tokens") or 1024,
        }
        for key in ("top_p", "seed", "stop", "tools", "tool_choice"):
            if kwargs.get(key) is not None:
                body[key] = kwargs[key]
        data = await _request("POST", f"{self.get_url()}/chat/completions", self.timeout, json=body)
        await self.fetch_state()
        return ChatCompletion.model_validate(data)

    async def completion(self, **kwargs: Any) -> Completion:
        """Not available: the proxy serves chat completions only."""
        raise NotImplementedError(
            "ProxyManagedServer.completion() is not supported; use chat_completion()."
        )

    def get_state(self) -> dict[str, Any]:
        """``{"nodes": [...]}`` as of the last completion or ``fetch_state()``."""
        return {"nodes": list(self._cached_nodes or [])}

    async def fetch_state(self) -> dict[str, Any]:
        """Read the session's nodes from the proxy."""
        data = await _request("GET", f"{self.proxy_url}/{self.session_uuid}/nodes", 30)
        self._cached_nodes = [SequenceNode(**node) for node in data.get("nodes", [])]
        return {"nodes": list(self._cached_nodes)}

    def reset(self) -> None:
        """Forget the cached nodes (the session itself ends with ``cleanup()``)."""
        self._cached_nodes = None

    async def cleanup(self) -> None:
        """Delete the session on the proxy (failures are logged, not raised)."""
        try:
            await _request("DELETE", f"{self.proxy_url}/{self.session_uuid}", 30)
        except Exception as exc:
            logger.warning("Failed to clean up proxy session %s: %s", self.session_uuid, exc)

    async def __aenter__(self) -> ProxyManagedServer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.fetch_state()
        except Exception as exc:
            logger.debug("could not fetch final state: %r", exc)
        await self.cleanup()


async def create_proxy_session(
    proxy_url: str,
    base_url: str | None = None,
    tool_parser: str = "hermes",
    track_tree: bool = False,
    model_name: str = "unknown",
) -> ProxyManagedServer:
    """Create a session on the proxy (pinned to ``base_url`` when given)."""
    body: dict[str, Any] = {"tool_parser": tool_parser, "track_tree": track_tree}
    if base_url:
        body["base_url"] = base_url
    data = await _request("POST", f"{proxy_url.rstrip('/')}/sessions/create", 30, json=body)
    return ProxyManagedServer(
        proxy_url=proxy_url,
        session_uuid=data["uuid"],
        model_name=data.get("model_name", model_name),
        base_url=data.get("base_url"),
    )
