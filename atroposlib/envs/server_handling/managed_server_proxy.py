"""An OpenAI-compatible HTTP front end over ``ManagedServer`` sessions.

External programs (agents, tool harnesses, other languages) talk plain OpenAI chat
completions to ``/{uuid}/v1``; every request of a session goes through one
``ManagedServer``, so the environment can read the exact tokens and logprobs afterwards
(``GET /{uuid}/nodes``).

Routes: ``GET /health``, ``GET /v1/models``, ``POST /setup``, ``GET /servers``,
``POST /sessions/create``, ``GET /sessions``, ``POST /{uuid}/v1/chat/completions``,
``POST /{uuid}/v1/chat/completions/render``, ``GET /{uuid}/nodes``, ``DELETE /{uuid}``.
Errors use OpenAI's shape ``{"error": {"message", "type", "code"}}``.

Standalone::

    python -m atroposlib.envs.server_handling.managed_server_proxy --config servers.json

with ``servers.json`` like ``{"model_name": "...", "servers": [{"base_url":
"http://gpu1:8000/v1", "server_type": "vllm"}]}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
import uuid as uuid_lib
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from atroposlib.envs.server_handling.managed_server import DummyManagedServer, ManagedServer
from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from atroposlib.envs.server_handling.server_manager import ServerManager

logger = logging.getLogger(__name__)


class ChatMessage(BaseModel):
    """One OpenAI chat message (extra fields are kept for the chat template)."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class ChatCompletionProxyRequest(BaseModel):
    """The OpenAI chat-completion fields the proxy forwards."""

    messages: list[ChatMessage]
    max_tokens: int | None = 1024
    max_completion_tokens: int | None = None
    temperature: float = 1.0
    top_p: float | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    tools: list[dict] | None = None
    tool_choice: Any = None
    model: str | None = None


class SessionCreateRequest(BaseModel):
    """``POST /sessions/create`` body; ``base_url`` pins the session to one backend."""

    tool_parser: str = "hermes"
    track_tree: bool = False
    base_url: str | None = None


class SessionCreateResponse(BaseModel):
    """A created session."""

    uuid: str
    model_name: str
    tool_parser: str
    base_url: str | None = None
    created_at: float


class RenderResponse(BaseModel):
    """The prompt a chat request would send, and its token ids."""

    prompt_text: str
    token_ids: list[int]
    num_tokens: int


@dataclass
class SessionState:
    """One session: its managed server and bookkeeping."""

    uuid: str
    managed_server: ManagedServer | DummyManagedServer
    model_name: str
    tool_parser: str
    base_url: str | None = None
    created_at: float = field(default_factory=time.time)
    last_accessed: float = field(default_factory=time.time)
    # Node extension assumes one conversation step at a time per session.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def openai_error(
    status_code: int, message: str, error_type: str = "invalid_request_error"
) -> JSONResponse:
    """An error response in OpenAI's shape."""
    return JSONResponse(
        status_code=status_code,
        content={"error": {"message": message, "type": error_type, "code": status_code}},
    )


def _base_url(server: Any) -> str | None:
    return getattr(getattr(server, "config", None), "base_url", None)


def _message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    return [m.model_dump(exclude_none=True) for m in messages]


def create_app(
    server_manager: ServerManager, tokenizer: Any, model_name: str = "unknown"
) -> FastAPI:
    """The proxy app over ``server_manager``'s servers.

    Args:
        server_manager: Backends; sessions are placed on the most available one unless
            pinned by ``base_url``.
        tokenizer: The model's HuggingFace tokenizer (chat template and token ids).
        model_name: Reported in responses and ``/v1/models``.
    """
    app = FastAPI(title="ManagedServer OpenAI Proxy")
    sessions: dict[str, SessionState] = {}
    current = {"model_name": model_name}

    def get_session(session_uuid: str) -> SessionState:
        session = sessions.get(session_uuid)
        if session is None:
            raise HTTPException(status_code=404, detail=f"Session {session_uuid} not found")
        session.last_accessed = time.time()
        return session

    def select_server(base_url: str | None) -> Any:
        if base_url is None:
            return server_manager.servers[server_manager._most_available_index(True)]
        for server in server_manager.servers:
            url = _base_url(server)
            if url and url.rstrip("/") == base_url.rstrip("/"):
                return server
        available = [u for u in map(_base_url, server_manager.servers) if u]
        raise HTTPException(
            status_code=404, detail=f"No server with base_url '{base_url}'. Available: {available}"
        )

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return openai_error(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return openai_error(400, f"Invalid request: {exc.errors()}")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        servers = server_manager.servers
        return {
            "status": "ok",
            "model": current["model_name"],
            "sessions": len(sessions),
            "servers": len(servers),
            "healthy_servers": sum(1 for s in servers if getattr(s, "server_healthy", True)),
        }

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": current["model_name"],
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "atropos",
                }
            ],
        }

    @app.post("/setup")
    async def setup(request: Request) -> dict[str, Any]:
        """Replace the backends: ``{"model_name", "tokenizer_name"?, "servers": [...]}``."""
        config = await request.json()
        new_model = config.get("model_name", current["model_name"])
        configs = [
            APIServerConfig(
                model_name=new_model,
                base_url=srv["base_url"],
                api_key=srv.get("api_key", ""),
                server_type=srv.get("server_type", "vllm"),
                num_max_requests_at_once=srv.get("num_max_requests_at_once", 512),
                num_requests_for_eval=srv.get("num_requests_for_eval", 64),
                timeout=srv.get("timeout", 1200),
                tokenizer_name=config.get("tokenizer_name", "none"),
            )
            for srv in config.get("servers", [])
        ]
        if configs:
            new_servers = ServerManager(configs=configs).servers
            old_servers, server_manager.servers = server_manager.servers, new_servers
            for server in old_servers:
                if hasattr(server, "close"):
                    await server.close()
        current["model_name"] = new_model
        return {"status": "ok", "servers": len(server_manager.servers), "model_name": new_model}

    @app.get("/servers")
    async def list_servers() -> dict[str, Any]:
        return {
            "servers": [
                {
                    "index": i,
                    "base_url": _base_url(server),
                    "healthy": getattr(server, "server_healthy", True),
                    "model_name": getattr(
                        getattr(server, "config", None), "model_name", current["model_name"]
                    ),
                    "server_type": getattr(
                        getattr(server, "config", None), "server_type", "unknown"
                    ),
                }
                for i, server in enumerate(server_manager.servers)
            ]
        }

    @app.post("/sessions/create", response_model=SessionCreateResponse)
    async def create_session(request: SessionCreateRequest) -> SessionCreateResponse:
        server = select_server(request.base_url)
        managed: ManagedServer | DummyManagedServer
        if getattr(server, "provides_token_logprobs", True):
            managed = ManagedServer(
                server=server,
                tokenizer=tokenizer,
                track_tree=request.track_tree,
                tool_parser=request.tool_parser,
            )
        else:
            logger.info("Session on an OpenAI endpoint: placeholder tokens (not for training)")
            managed = DummyManagedServer(server, tokenizer, track_tree=request.track_tree)
        session = SessionState(
            uuid=str(uuid_lib.uuid4()),
            managed_server=managed,
            model_name=current["model_name"],
            tool_parser=request.tool_parser,
            base_url=_base_url(server),
        )
        sessions[session.uuid] = session
        return SessionCreateResponse(
            uuid=session.uuid,
            model_name=session.model_name,
            tool_parser=session.tool_parser,
            base_url=session.base_url,
            created_at=session.created_at,
        )

    @app.get("/sessions")
    async def list_sessions() -> dict[str, Any]:
        def count(s: SessionState) -> int:
            state = s.managed_server.get_state()
            return len(state.get("nodes", state.get("sequences", [])))

        return {
            "sessions": [
                {
                    "uuid": s.uuid,
                    "model_name": s.model_name,
                    "base_url": s.base_url,
                    "created_at": s.created_at,
                    "last_accessed": s.last_accessed,
                    "num_nodes": count(s),
                }
                for s in sessions.values()
            ]
        }

    @app.post("/{session_uuid}/v1/chat/completions")
    async def chat_completions(
        session_uuid: str, request: ChatCompletionProxyRequest
    ) -> JSONResponse:
        session = get_session(session_uuid)
        if not request.messages:
            return openai_error(400, "messages must not be empty")
        kwargs: dict[str, Any] = {
            "messages": _message_dicts(request.messages),
            "n": request.n,
            "temperature": request.temperature,
        }
        max_tokens = request.max_completion_tokens or request.max_tokens
        if max_tokens:
            kwargs["max_tokens"] = max_tokens
        for key in ("top_p", "seed", "stop", "tools", "tool_choice"):
            value = getattr(request, key)
            if value is not None:
                kwargs[key] = value
        try:
            async with session.lock:
                result = await session.managed_server.chat_completion(**kwargs)
        except Exception as exc:
            logger.exception("Completion failed")
            return openai_error(500, f"Completion failed: {exc}", error_type="server_error")
        body = result.model_dump(exclude_none=True)
        body["model"] = session.model_name
        if not str(body.get("id", "")).startswith("chatcmpl-"):
            body["id"] = f"chatcmpl-{uuid_lib.uuid4().hex}"
        return JSONResponse(body)

    @app.post("/{session_uuid}/v1/chat/completions/render", response_model=None)
    async def render_prompt(
        session_uuid: str, request: ChatCompletionProxyRequest
    ) -> RenderResponse | JSONResponse:
        """The prompt text and token ids a chat request would send now (extension
        included)."""
        session = get_session(session_uuid)
        managed = session.managed_server
        messages = _message_dicts(request.messages)
        try:
            if isinstance(managed, ManagedServer):
                tools = request.tools if managed._get_translator() is not None else None
                prompt = managed._convert_messages_to_prompt(messages, tools=tools)
                token_ids = managed._compute_input_ids(prompt, managed._find_extending_node(prompt))
            else:
                kwargs = {"tools": request.tools} if request.tools else {}
                prompt = tokenizer.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=True, **kwargs
                )
                token_ids = tokenizer.encode(prompt, add_special_tokens=False)
        except Exception as exc:
            return openai_error(400, f"Failed to render prompt: {exc}")
        return RenderResponse(prompt_text=prompt, token_ids=token_ids, num_tokens=len(token_ids))

    @app.get("/{session_uuid}/nodes")
    async def get_nodes(session_uuid: str) -> dict[str, Any]:
        session = get_session(session_uuid)
        state = session.managed_server.get_state()
        nodes = list(state["sequences"].values()) if "sequences" in state else state["nodes"]
        return {"nodes": [node.model_dump() for node in nodes]}

    @app.delete("/{session_uuid}")
    async def delete_session(session_uuid: str) -> dict[str, Any]:
        session = sessions.pop(session_uuid, None)
        if session is None:
            raise HTTPException(status_code=404, detail=f"Session {session_uuid} not found")
        session.managed_server.reset()
        return {"status": "deleted", "uuid": session_uuid}

    return app


def main(argv: list[str] | None = None) -> None:
    """Run the proxy from a JSON server config."""
    import uvicorn
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description="ManagedServer OpenAI Proxy")
    parser.add_argument("--config", required=True, help="JSON file with server definitions")
    parser.add_argument("--port", type=int, default=9100, help="Proxy port")
    parser.add_argument("--host", default="127.0.0.1", help="Address to bind")
    args = parser.parse_args(argv)
    with open(args.config) as f:
        config = json.load(f)
    model_name = config["model_name"]
    tokenizer_name = config.get("tokenizer_name", "none")
    tokenizer = AutoTokenizer.from_pretrained(
        model_name if tokenizer_name == "none" else tokenizer_name
    )
    configs = [
        APIServerConfig(
            model_name=model_name,
            base_url=srv["base_url"],
            api_key=srv.get("api_key", ""),
            server_type=srv.get("server_type", "vllm"),
            num_max_requests_at_once=srv.get("num_max_requests_at_once", 512),
            num_requests_for_eval=srv.get("num_requests_for_eval", 64),
            timeout=srv.get("timeout", 1200),
            tokenizer_name=tokenizer_name,
        )
        for srv in config["servers"]
    ]
    app = create_app(ServerManager(configs=configs), tokenizer, model_name)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
