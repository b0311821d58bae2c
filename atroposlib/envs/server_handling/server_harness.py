"""``ServerHarness``: a scripted stand-in for an inference server, for tests and ``--testing``.

Responses are registered ahead of time, keyed by the request: chat by message roles and
contents, completions and token calls by the prompt text. An unregistered request raises
``KeyError`` naming the missing key.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from openai.types.chat.chat_completion import ChatCompletion, ChatCompletionMessage, Choice
from openai.types.completion import Completion, CompletionChoice

from atroposlib.envs.server_handling.server_baseline import (
    APIServerConfig,
    AsyncSemWithAdaptiveWeight,
)

FinishReason = Literal["stop", "length", "tool_calls", "content_filter", "function_call"]


def create_chat_completion(
    resp: str | list[str],
    n: int = 1,
    finish_reason: FinishReason | list[FinishReason] = "stop",
) -> ChatCompletion:
    """A ``ChatCompletion`` with ``n`` assistant choices (``resp`` may be one text or one per
    choice)."""
    choices = [
        Choice(
            finish_reason=finish_reason if isinstance(finish_reason, str) else finish_reason[i],
            index=i,
            message=ChatCompletionMessage(
                content=resp if isinstance(resp, str) else resp[i], role="assistant"
            ),
        )
        for i in range(n)
    ]
    return ChatCompletion(
        id="test_id", created=0, model="test_model", object="chat.completion", choices=choices
    )


def create_completion(
    resp: str | list[str],
    n: int = 1,
    finish_reason: FinishReason | list[FinishReason] = "stop",
) -> Completion:
    """A ``Completion`` with ``n`` choices (``resp`` may be one text or one per choice)."""
    choices = [
        CompletionChoice(
            finish_reason=finish_reason if isinstance(finish_reason, str) else finish_reason[i],
            index=i,
            text=resp if isinstance(resp, str) else resp[i],
        )
        for i in range(n)
    ]
    return Completion(
        id="test_id", created=0, model="test_model", object="text_completion", choices=choices
    )


class ServerHarness:
    """Scripted server with the ``APIServer`` call surface.

    It has the attributes ``ServerManager`` routes on (``sem``, ``eval_sem``,
    ``server_healthy``, ``config``, ``tokenizer``) and records every request in ``calls`` as
    ``(method, kwargs)``.
    """

    provides_token_logprobs: ClassVar[bool] = True

    def __init__(
        self,
        config: APIServerConfig | None = None,
        concurrency: int = 1,
        tokenizer: Any = None,
    ) -> None:
        """
        Args:
            config: Reported as ``config`` (default: model ``test_model``, no health check).
            concurrency: Size of ``sem`` and ``eval_sem``.
            tokenizer: Handed to ``ManagedServer`` sessions (None: they run without one).
        """
        self.tokenizer = tokenizer
        self.config = config or APIServerConfig(
            model_name="test_model", base_url="", health_check=False
        )
        self.response_map: dict[str, Any] = {}
        self.tokens_and_logprobs_map: dict[str, tuple[list, list, list, list]] = {}
        self.logprobs_map: dict[str, dict[str, Any]] = {}
        self.sem = AsyncSemWithAdaptiveWeight(concurrency)
        self.eval_sem = AsyncSemWithAdaptiveWeight(concurrency)
        self.server_healthy = True
        self.calls: list[tuple[str, dict[str, Any]]] = []

    @staticmethod
    def conv_to_dictkey(input_message: list[dict[str, Any]]) -> str:
        """The lookup key of a message list: its roles and contents, one per line."""
        parts = []
        for item in input_message:
            parts.append(f"role:{item['role']}")
            parts.append(f"content:{item.get('content')}")
        return "\n".join(parts)

    async def update_weight(self, weight: float) -> None:
        """Set the share of both semaphores (as ``APIServer.update_weight``)."""
        self.sem.update_weight(weight)
        self.eval_sem.update_weight(weight)

    async def wandb_metrics(
        self, metrics_dict: dict[str, Any] | None, server_name: str | None
    ) -> dict[str, Any]:
        """No timings to report; returns ``metrics_dict`` (a new dict when None)."""
        return {} if metrics_dict is None else metrics_dict

    # ------------------------------------------------------------------ scripting

    def set_desired_response(
        self, input_message: list[dict[str, Any]], desired_response: ChatCompletion
    ) -> None:
        """Answer ``chat_completion(messages=input_message)`` with ``desired_response``."""
        self.response_map[self.conv_to_dictkey(input_message)] = desired_response

    def set_desired_completion(self, input_message: str, completion: Completion) -> None:
        """Answer ``completion(prompt=input_message)`` with ``completion``."""
        self.response_map[input_message] = completion

    def set_tokens_and_logprobs_response(
        self,
        prompt: str,
        prompt_tokens: list[int] | None,
        output_tokens_list: list[list[int]],
        output_logprobs_list: list[list[float]],
        finish_reasons: list[Any],
    ) -> None:
        """Answer ``tokens_and_logprobs_completion(prompt=prompt)`` with the given lists (one
        entry per completion in the last three). ``prompt_tokens=None`` echoes the request's
        ``input_ids``, as a real backend does."""
        self.tokens_and_logprobs_map[prompt] = (
            prompt_tokens,
            output_tokens_list,
            output_logprobs_list,
            finish_reasons,
        )

    def set_logprobs_response(self, prompt: str, payload: dict[str, Any]) -> None:
        """Answer ``get_logprobs(prompt=prompt)`` with ``payload``."""
        self.logprobs_map[prompt] = payload

    # ------------------------------------------------------------------ calls

    @staticmethod
    def _lookup(table: dict[str, Any], key: str) -> Any:
        if key not in table:
            raise KeyError(f"ServerHarness has no response scripted for key:\n{key}")
        return table[key]

    async def chat_completion(self, **kwargs: Any) -> ChatCompletion:
        """The scripted response for ``messages``."""
        self.calls.append(("chat_completion", kwargs))
        return self._lookup(self.response_map, self.conv_to_dictkey(kwargs.get("messages") or []))

    async def completion(self, **kwargs: Any) -> Completion:
        """The scripted response for ``prompt``."""
        self.calls.append(("completion", kwargs))
        return self._lookup(self.response_map, kwargs.get("prompt"))

    async def tokens_and_logprobs_completion(self, **kwargs: Any) -> tuple[list, list, list, list]:
        """The scripted ``(prompt_tokens, output_tokens, output_logprobs, finish_reasons)``
        for ``prompt``."""
        self.calls.append(("tokens_and_logprobs_completion", kwargs))
        prompt_tokens, *rest = self._lookup(self.tokens_and_logprobs_map, kwargs.get("prompt"))
        if prompt_tokens is None:
            prompt_tokens = list(kwargs.get("input_ids") or [])
        return (prompt_tokens, *rest)

    async def get_logprobs(self, **kwargs: Any) -> dict[str, Any]:
        """The scripted prompt-logprob payload for ``prompt``.

        Raises ``NotImplementedError`` when none was scripted for it: upstream's harness had
        no ``get_logprobs`` at all, and callers test for that error.
        """
        self.calls.append(("get_logprobs", kwargs))
        if kwargs.get("prompt") not in self.logprobs_map:
            raise NotImplementedError(
                "ServerHarness does not implement get_logprobs for this prompt: script it "
                f"with set_logprobs_response() first:\n{kwargs.get('prompt')}"
            )
        return self.logprobs_map[kwargs.get("prompt")]
