"""Request bodies of the OpenAI-compatible endpoints, with vLLM's extra sampling fields.

Only fields the server implements are declared. Unknown fields are ignored (as vLLM and OpenAI
do), except the features we do not serve (OpenAI's and vLLM's request fields this server cannot
honour, :data:`VLLM_ONLY_DEFAULTS`), which are rejected with a 400 naming the field unless they
hold their no-op default, so a client never silently gets something other than it asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from atroposlib.inference.sampling import SamplingParams


def _unset(value: Any) -> bool:
    return value in (None, False, {}, [], "")


#: vLLM request fields (vLLM 0.32's completion and chat requests) that atropos-serve does not
#: implement, each with the test of its no-op value: any other value is refused with a 400.
#: Fields that only label a request (``request_id``, ``session_id``, ``cache_salt``) or only
#: matter to other endpoints (``return_token_offsets``, ``mm_payload``) are accepted.
VLLM_ONLY_DEFAULTS: dict[str, Callable[[Any], bool]] = {
    "use_beam_search": _unset,
    "watermarking": _unset,
    "length_penalty": lambda v: v in (None, 1, 1.0),
    "spaces_between_special_tokens": lambda v: v in (None, True),
    "truncate_prompt_tokens": lambda v: v is None,
    "allowed_token_ids": _unset,
    "prompt_logprobs": lambda v: v is None,
    "logprob_token_ids": _unset,
    "bad_words": _unset,
    "prompt_embeds": _unset,
    "structured_outputs": _unset,
    "priority": lambda v: v in (None, 0),
    "kv_transfer_params": _unset,
    "ec_transfer_params": _unset,
    "vllm_xargs": _unset,
    "repetition_detection": _unset,
    "thinking_token_budget": lambda v: v in (None, -1),
    "logits_processors": _unset,
    "routed_experts_prompt_start": lambda v: v in (None, 0),
    "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
    "guided_json": _unset,
    "guided_regex": _unset,
    "guided_choice": _unset,
    "guided_grammar": _unset,
}
#: More of them that only chat requests have, with the OpenAI chat fields that change the
#: output (vLLM ignores the last four; a client sending them expects what they ask for).
VLLM_CHAT_ONLY_DEFAULTS: dict[str, Callable[[Any], bool]] = {
    "echo": _unset,
    "documents": _unset,
    "chat_template": lambda v: v is None,
    "mm_processor_kwargs": _unset,
    "media_io_kwargs": _unset,
    "reasoning_effort": lambda v: v is None,
    "return_prompt_text": _unset,
    # Only a reasoning parser (which atropos-serve does not have) drops the reasoning.
    "include_reasoning": lambda v: v in (None, True),
    # Without tools: "none" and "auto" both mean plain text; "required" or a named function
    # would force a tool call.
    "tool_choice": lambda v: v in (None, "none", "auto"),
    "function_call": lambda v: v in (None, "none", "auto"),
    "verbosity": lambda v: v is None,
    "web_search_options": _unset,
    "audio": _unset,
    "modalities": lambda v: v in (None, [], ["text"]),
}

#: Request fields accepted and ignored because they do not change what is generated: labels,
#: billing/storage options of OpenAI, and vLLM options of other endpoints or of features that
#: are refused when asked for (``truncation_side`` only acts with ``truncate_prompt_tokens``,
#: ``parallel_tool_calls`` only with ``tools``). ``stream_interval`` only groups tokens into
#: fewer chunks. Listed for the documentation (docs/compat.md) and the tests; any other
#: unknown field is ignored too (as vLLM does), so this list is what was checked.
IGNORED_FIELDS: tuple[str, ...] = (
    "user",
    "metadata",
    "store",
    "service_tier",
    "prediction",
    "prompt_cache_key",
    "safety_identifier",
    "request_id",
    "session_id",
    "cache_salt",
    "parallel_tool_calls",
    "truncation_side",
    "stream_interval",
    "return_token_offsets",
    "return_mm_kwargs",
)


class UnsupportedFieldError(ValueError):
    """A request field this server cannot honour (``field`` names it)."""

    def __init__(self, field: str, message: str | None = None) -> None:
        super().__init__(message or f"'{field}' is not supported by atropos-serve")
        self.field = field


class StreamOptions(BaseModel):
    """``stream_options`` of OpenAI: whether the last chunk carries ``usage``. vLLM's
    ``continuous_usage_stats`` (usage in every chunk) is refused."""

    model_config = ConfigDict(extra="allow")

    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """Fields shared by chat and text completions."""

    # NaN and Infinity (which Python's JSON parser accepts) are refused for every float field.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str = Field(description="Served model name (see GET /v1/models).")
    n: int = Field(1, description="Samples per prompt.")
    max_tokens: int | None = Field(None, description="Max generated tokens per sample.")
    temperature: float | None = Field(None, description="0 means greedy. Default 1.")
    top_p: float | None = None
    top_k: int | None = Field(None, description="vLLM extra; -1 or 0 disables it.")
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None
    return_token_ids: bool | None = Field(
        None,
        description="vLLM extra: choices carry token_ids (the sampled ids) and the prompt's "
        "prompt_token_ids (per choice for completions, on the response for chat).",
    )
    return_tokens_as_token_ids: bool | None = Field(
        None,
        description="vLLM extra: with logprobs, every token is spelled 'token_id:N'.",
    )

    unsupported: ClassVar[tuple[str, ...]] = ("logit_bias", "best_of", "suffix")
    vllm_only: ClassVar[dict[str, Callable[[Any], bool]]] = VLLM_ONLY_DEFAULTS

    def check_unsupported(self) -> None:
        """Raise :class:`UnsupportedFieldError` for requested features this server does not
        implement (OpenAI's, and vLLM's extras unless they hold their no-op value)."""
        extra = self.model_extra or {}
        for name in self.unsupported:
            value = extra.get(name)
            if value in (None, False, {}, []) or (name == "best_of" and value == self.n):
                continue
            raise UnsupportedFieldError(name)
        for name, is_default in self.vllm_only.items():
            if name in extra and not is_default(extra[name]):
                raise UnsupportedFieldError(
                    name,
                    f"'{name}' with the value {extra[name]!r} is not supported by atropos-serve",
                )
        stream_extra = (self.stream_options.model_extra or {}) if self.stream_options else {}
        if stream_extra.get("continuous_usage_stats"):
            name = "stream_options.continuous_usage_stats"
            raise UnsupportedFieldError(
                name, f"'{name}' (usage in every chunk) is not supported by atropos-serve"
            )

    def sampling_params(
        self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        """Build the engine's :class:`SamplingParams` (defaults as in vLLM)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        top_k = -1 if self.top_k in (None, 0) else self.top_k
        return SamplingParams(
            max_tokens=max_tokens,
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=top_k,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )


#: Arguments of ``apply_chat_template`` the server sets from the request itself.
_TEMPLATE_ARGUMENTS = frozenset(
    {"conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message",
     "chat_template", "tools", "documents", "return_dict", "return_assistant_tokens_mask"}
)  # fmt: skip


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``."""

    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    add_special_tokens: bool = Field(
        False, description="vLLM extra: add the tokenizer's special tokens (BOS) to the template."
    )

    unsupported: ClassVar[tuple[str, ...]] = _SamplingRequest.unsupported + (
        "tools",
        "functions",
        "response_format",
    )
    vllm_only: ClassVar[dict[str, Callable[[Any], bool]]] = {
        **VLLM_ONLY_DEFAULTS,
        **VLLM_CHAT_ONLY_DEFAULTS,
    }

    def check_unsupported(self) -> None:  # noqa: D102 - see base class
        extra = self.model_extra or {}
        response_format = extra.get("response_format")
        if isinstance(response_format, dict) and response_format.get("type") == "text":
            extra.pop("response_format")
        if extra.get("tool_choice") == "none":
            extra.pop("tools", None)
        super().check_unsupported()
        for key in self.chat_template_kwargs or {}:
            if key in _TEMPLATE_ARGUMENTS:
                name = f"chat_template_kwargs.{key}"
                raise UnsupportedFieldError(
                    name, f"'{name}' would override the request's own '{key}'; set that instead"
                )
        if (
            self.continue_final_message
            and self.add_generation_prompt
            and "add_generation_prompt" in self.model_fields_set
        ):  # vLLM refuses the pair; left at its default, add_generation_prompt yields
            raise UnsupportedFieldError(
                "continue_final_message",
                "'continue_final_message' and 'add_generation_prompt' cannot both be true",
            )


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    add_special_tokens: bool = True


class _VLLMSampling(BaseModel):
    """The vLLM ``SamplingParams`` fields the token-level endpoints take (``/generate``'s body,
    ``/inference/v1/generate``'s ``sampling_params``), with vLLM's defaults."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


def _vllm_sampling(
    body: _VLLMSampling, max_tokens: int, prompt_logprobs: int | None
) -> SamplingParams:
    """The engine's :class:`SamplingParams` from vLLM ``SamplingParams`` fields (the token-level
    endpoints' bodies)."""
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return SamplingParams(
        max_tokens=max_tokens,
        n=body.n,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=-1 if body.top_k == 0 else body.top_k,
        min_p=body.min_p,
        seed=body.seed,
        stop=stop,
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        logprobs=body.logprobs,
        prompt_logprobs=prompt_logprobs,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        skip_special_tokens=body.skip_special_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
    )


class GenerateRequest(_VLLMSampling):
    """``POST /generate``: vLLM's token-level endpoint as upstream's ``VLLMServer`` calls it.

    ``prompt`` is ``{"prompt_token_ids": [...]}`` (or plain text); the other fields are vLLM
    ``SamplingParams`` keyword arguments.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    prompt: dict[str, list[int]] | str
    stream: Literal[False] = False
    max_tokens: int = 16
    prompt_logprobs: int | None = None

    def sampling_params(self) -> SamplingParams:
        """The engine's :class:`SamplingParams` for this request."""
        return _vllm_sampling(self, self.max_tokens, self.prompt_logprobs)


class TokenSamplingParams(_VLLMSampling):
    """``sampling_params`` of ``POST /inference/v1/generate``: vLLM ``SamplingParams`` fields.

    ``max_tokens`` left out means whatever context is left after the prompt (vLLM's default).
    Keys this server does not implement are refused with a 400 naming them, except the few that
    only steer other engines' extras (:attr:`IGNORED`).
    """

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    #: Keys sent by verifiers' renderer client and prime-rl's vLLM build that change nothing
    #: about sampling here: a chat-template knob, and where MoE routing replay starts.
    IGNORED: ClassVar[frozenset[str]] = frozenset(
        {"reasoning_effort", "routed_experts_prompt_start", "extra_args", "output_kind"}
    )

    max_tokens: int | None = None

    def unsupported(self) -> list[str]:
        """The keys given that this server neither implements nor may ignore."""
        return sorted(k for k in (self.model_extra or {}) if k not in self.IGNORED)

    def to_params(self, max_tokens: int) -> SamplingParams:
        """The engine's :class:`SamplingParams`, with ``max_tokens`` resolved by the caller."""
        return _vllm_sampling(self, max_tokens, None)


class TokenGenerateRequest(BaseModel):
    """``POST /inference/v1/generate``: vLLM's tokens-in, tokens-out endpoint.

    The client renders the prompt itself (``token_ids``) and gets the sampled token ids and
    their log-probs back, so nothing is re-tokenized on either side. verifiers' training client
    (``TrainClientConfig``, through the ``renderers`` package) and prime-rl call it. Multimodal
    ``features`` and ``content_parts`` are not served (400).
    """

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    request_id: str | None = None
    token_ids: list[int] = Field(min_length=1)
    sampling_params: TokenSamplingParams = Field(default_factory=TokenSamplingParams)
    stream: Literal[False] = False
    cache_salt: str | None = None
    priority: int | None = None
    features: Any = None
    content_parts: Any = None


class ReloadRequest(BaseModel):
    """``POST /reload_weights``: a checkpoint folder written by ``save_pretrained``."""

    path: str = Field(
        description="Folder with config.json and safetensors weights of the same architecture.",
        validation_alias=AliasChoices("path", "model_path", "checkpoint_path"),
    )
