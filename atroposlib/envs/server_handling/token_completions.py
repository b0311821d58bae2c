"""Token-exact generation through vLLM's ``POST /v1/completions``, as TRL's ``VLLMClient`` does.

vLLM's OpenAI server (and ``trl vllm-serve``, which is that server since TRL 1.x, and
``atropos-serve``) takes a prompt of token ids and, with ``"return_token_ids": true``, answers
each choice's sampled ``token_ids`` and the prompt's ``prompt_token_ids``; with ``"logprobs": 0``
and ``"return_tokens_as_token_ids": true`` its ``logprobs.tokens`` are ``token_id:N`` and
``logprobs.token_logprobs`` the sampler's log-probability of each. :func:`completions_payload`
builds that request and :func:`read_token_choices` reads the answer (checking the ids of both
agree). Older TRL servers answer ``POST /generate/`` with ``{"prompt_ids", "completion_ids",
"logprobs", "logprob_token_ids"}`` (TRL 1.0) or only ``{"completion_ids"}`` (before);
:func:`read_token_choices` reads those shapes too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "NON_SAMPLING_KEYS",
    "TokenChoices",
    "completions_payload",
    "sampling_kwargs",
    "read_prompt_logprobs",
    "read_token_choices",
    "route_missing",
]

#: Request keys that are not vLLM sampling parameters (never forwarded as such).
NON_SAMPLING_KEYS = frozenset(
    {"model", "prompt", "input_ids", "split", "skip_reasoning", "messages", "extra_body"}
)


@dataclass
class TokenChoices:
    """What one generation request produced, one entry per choice in the last four lists."""

    prompt_ids: list[int] | None
    """The prompt's token ids as the server saw them (None: it did not say)."""
    token_ids: list[list[int]]
    logprobs: list[list[float]] | None
    """The sampler's log-probability of each sampled token (None: the server gave none)."""
    finish_reasons: list[str | None]
    texts: list[str] | None
    """The decoded completions, when the server sent text (vLLM does, TRL's /generate/ not)."""


def sampling_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The vLLM sampling parameters among an ``APIServer`` call's ``kwargs`` (OpenAI's
    ``max_completion_tokens`` and HF's ``max_new_tokens`` become ``max_tokens``; an
    ``extra_body`` is merged in, as the OpenAI SDK does)."""
    out = {k: v for k, v in kwargs.items() if k not in NON_SAMPLING_KEYS}
    for alias in ("max_new_tokens", "max_completion_tokens"):
        if alias in out:
            value = out.pop(alias)
            out.setdefault("max_tokens", value)
    out.update(kwargs.get("extra_body") or {})
    return out


def completions_payload(
    model: str, prompt: list[int] | str, sampling: dict[str, Any], *, logprobs: bool = True
) -> dict[str, Any]:
    """The ``POST /v1/completions`` body that returns token ids (and, with ``logprobs``, the
    sampled tokens' log-probs spelled by id), as TRL's ``VLLMClient.generate`` sends it."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "return_token_ids": True}
    body.update(sampling)
    if logprobs:
        body["logprobs"] = 0
        body["return_tokens_as_token_ids"] = True
    return body


def route_missing(status: int, body: Any) -> bool:
    """Whether an answer means "no such route" (404/405 without an OpenAI error object: a vLLM
    that does not know the *model* also answers 404, with ``{"error": ...}``)."""
    return status in (404, 405) and not (isinstance(body, dict) and "error" in body)


def _token_id(label: str) -> int | None:
    if isinstance(label, str) and label.startswith("token_id:"):
        try:
            return int(label.removeprefix("token_id:"))
        except ValueError:
            return None
    return None


def read_token_choices(body: Any, *, eos_token_id: int | None = None) -> TokenChoices:
    """Token ids, log-probs and finish reasons from a ``/v1/completions`` answer (vLLM's
    ``choices``) or a TRL ``/generate/`` answer (``completion_ids``).

    Raises:
        ValueError: an answer of neither shape, or one whose ids disagree with its logprobs.
    """
    if isinstance(body, dict) and isinstance(body.get("choices"), list):
        return _read_choices(body["choices"])
    if isinstance(body, dict) and "completion_ids" in body:
        return _read_trl_generate(body, eos_token_id)
    raise ValueError(f"not a completions answer: {str(body)[:300]}")


def _read_choices(choices: list[dict[str, Any]]) -> TokenChoices:
    choices = sorted(choices, key=lambda c: c.get("index", 0))
    prompt_ids = choices[0].get("prompt_token_ids") if choices else None
    token_ids: list[list[int]] = []
    logprobs: list[list[float]] | None = []
    for choice in choices:
        ids = choice.get("token_ids")
        entry = choice.get("logprobs") or {}
        labels = entry.get("tokens") or []
        values = entry.get("token_logprobs") or []
        if ids is None:
            # no return_token_ids: the ids are only in the token_id:N labels, if there
            ids = [_token_id(label) for label in labels]
            if not labels or any(i is None for i in ids):
                raise ValueError(
                    "the server returned no token ids (it ignores return_token_ids and "
                    "return_tokens_as_token_ids: not vLLM >= 0.10, trl vllm-serve or "
                    "atropos-serve?)"
                )
        ids = [int(i) for i in ids]
        if labels:
            spelled = [_token_id(label) for label in labels]
            if all(s is not None for s in spelled) and spelled != ids:
                raise ValueError(f"token_ids {ids} disagree with the logprobs' tokens {labels}")
        token_ids.append(ids)
        if logprobs is not None and len(values) == len(ids) and all(v is not None for v in values):
            logprobs.append([float(v) for v in values])
        else:
            logprobs = None
    return TokenChoices(
        prompt_ids=list(prompt_ids) if prompt_ids is not None else None,
        token_ids=token_ids,
        logprobs=logprobs,
        finish_reasons=[c.get("finish_reason") for c in choices],
        texts=[c.get("text", "") for c in choices],
    )


def _read_trl_generate(body: dict[str, Any], eos_token_id: int | None) -> TokenChoices:
    token_ids = [[int(t) for t in ids] for ids in body["completion_ids"]]
    prompt_ids = (body.get("prompt_ids") or [None])[0]
    raw = body.get("logprobs")
    logprobs: list[list[float]] | None = None
    if raw is not None:
        # TRL 1.0: (sequences, tokens, k) sorted by probability; the sampled token's entry is
        # the one whose logprob_token_ids is the token (the first one when k is 1)
        alternatives = body.get("logprob_token_ids")
        logprobs = []
        for s, ids in enumerate(token_ids):
            row = []
            for t, token in enumerate(ids):
                values = raw[s][t]
                j = 0
                if alternatives is not None and token in alternatives[s][t]:
                    j = alternatives[s][t].index(token)
                row.append(float(values[j] if isinstance(values, list) else values))
            logprobs.append(row)
    reasons = [
        "stop" if eos_token_id is not None and eos_token_id in ids else "length"
        for ids in token_ids
    ]
    return TokenChoices(
        prompt_ids=list(prompt_ids) if prompt_ids is not None else None,
        token_ids=token_ids,
        logprobs=logprobs,
        finish_reasons=list(reasons),
        texts=None,
    )


def read_prompt_logprobs(body: Any) -> list[dict[int, float] | None]:
    """``choices[0].prompt_logprobs`` of a vLLM ``/v1/completions`` answer (``prompt_logprobs:
    k``): per prompt position None (the first) or ``{token_id: logprob}`` in the server's order
    (vLLM's: the prompt's own token first, then the top k)."""
    choices = body.get("choices") if isinstance(body, dict) else None
    raw = choices[0].get("prompt_logprobs") if choices else None
    if raw is None:
        raise ValueError("the answer has no prompt_logprobs")
    return [
        None
        if entry is None
        else {int(k): float(v["logprob"] if isinstance(v, dict) else v) for k, v in entry.items()}
        for entry in raw
    ]
