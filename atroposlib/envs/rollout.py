"""The rollout toolkit: sample completions and play conversations with exact training data.

Every helper here works the same against a token server (``server_type`` vllm/sglang/trl,
atropos-serve included: ``ManagedServer`` records the exact tokens, masks and sampler
logprobs) and a plain OpenAI endpoint (the chat is re-tokenized locally with
``tokenize_for_trainer``, no logprobs): the choice is made once, inside the server layer
(``ServerManager.managed_server(tokens="auto")``), so environments never branch on it.

* ``Sample`` and ``sample_chat_group``: ``n`` completions of one chat, ready to score.
* ``group_from_samples``: the ``ScoredDataGroup`` of scored samples (tokens, masks, messages,
  sampler logprobs when every sample has them, the group size when it differs).
* ``eval_completion``: one evaluation completion (``split="eval"``), text and finish reason.
* ``ChatSession``: one multi-turn conversation (observations, tool calls and results) and
  its training trajectory, every assistant turn trained on.
* ``group_from_trajectories``: the ``ScoredDataGroup`` of scored ``ChatSession`` trajectories.

A single-turn environment::

    samples = await sample_chat_group(self, messages, n=self.config.group_size,
                                      max_tokens=256, temperature=1.0)
    group = group_from_samples(samples, [score(s.text) for s in samples],
                               group_size=self.config.group_size)
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from atroposlib.envs.server_handling.managed_server import reply_message
from atroposlib.schema import ScoredDataGroup
from atroposlib.utils.tokenize_for_trainer import MASK_VALUE, chat_for_template

logger = logging.getLogger(__name__)

__all__ = [
    "ChatSession",
    "Sample",
    "apply_length_penalty",
    "eval_completion",
    "log_reward_terms",
    "reward_term_values",
    "weighted_reward",
    "group_from_samples",
    "group_from_trajectories",
    "node_logprobs",
    "sample_chat_group",
    "uses_token_server",
]


def uses_token_server(env: Any) -> bool:
    """True when ``env``'s first server returns token ids and logprobs (``ManagedServer``
    works on it); False for plain OpenAI endpoints."""
    servers = getattr(env.server, "servers", None) or []
    return bool(servers) and bool(getattr(servers[0], "provides_token_logprobs", False))


#: Request arguments that shape the distribution a token is drawn from and that a trainer
#: replays (``atroposlib.trainer.rows``): sent to it in ``generation_params``.
SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p")


def sampling_params(request: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``request`` (``chat_completion`` arguments) a trainer needs to score
    samples as they were drawn: :data:`SAMPLING_KEYS` that are set."""
    return {key: request[key] for key in SAMPLING_KEYS if request.get(key) is not None}


def node_logprobs(managed: Any, node: Any) -> list[float] | None:
    """A session node's sampler logprobs, or None when the session re-tokenized the chat
    (a server without token logprobs)."""
    if not getattr(managed, "provides_logprobs", True):
        return None
    return list(node.logprobs)


@dataclass
class Sample:
    """One sampled completion, ready to score: its text, and the trainer's view of it.

    Attributes:
        text: The completion's text.
        finish_reason: ``stop``, ``length``... ("" when the server gave none).
        tokens: Prompt and completion token ids.
        masks: ``tokens`` with -100 on the positions not trained on (the prompt).
        logprobs: Sampler logprobs per token (1.0 on prompt positions); None when the
            server gives none (plain OpenAI endpoints).
        messages: The chat with the completion as the last assistant message.
        generation_params: How it was sampled (``temperature``, and ``top_k``/``top_p``/
            ``min_p`` when set): the trainer scales and truncates its logits the same way, so
            its importance ratio to ``logprobs`` is 1 for unchanged weights.
    """

    text: str
    finish_reason: str
    tokens: list[int]
    masks: list[int]
    logprobs: list[float] | None
    messages: list[dict[str, Any]]
    generation_params: dict[str, Any] = field(default_factory=dict)

    @property
    def trainable_tokens(self) -> int:
        """Number of positions the trainer learns from."""
        return sum(1 for m in self.masks if m != MASK_VALUE)


async def sample_chat_group(
    env: Any,
    messages: list[dict[str, Any]],
    *,
    n: int,
    max_tokens: int,
    temperature: float,
    retokenize: bool = False,
    **kwargs: Any,
) -> list[Sample]:
    """``n`` completions of ``messages`` as ``Sample``s (in the order of the reply).

    Tokens, masks and logprobs are exact from a token server; for a plain OpenAI endpoint
    (or with ``retokenize=True``, for prompts a text chat template cannot render exactly,
    such as image content parts) the chat is re-tokenized locally and ``logprobs`` is None.

    Args:
        env: The ``BaseEnv`` (its ``server`` and ``tokenizer`` are used).
        messages: The prompt chat.
        n: Completions to sample.
        max_tokens: Generation budget of each.
        temperature: Sampling temperature.
        retokenize: Re-tokenize locally even on a token server.
        **kwargs: Further sampling arguments for ``chat_completion`` (``top_p``, ``stop``...).
    """
    request = {
        "messages": messages,
        "n": n,
        "max_tokens": max_tokens,
        "temperature": temperature,
        **kwargs,
    }
    async with env.server.managed_server(
        tokenizer=env.tokenizer, tokens="local" if retokenize else "auto"
    ) as managed:
        reply = await managed.chat_completion(**request)
        nodes = managed.get_state()["nodes"]
        samples = []
        for choice, node in zip(reply.choices, nodes, strict=True):
            text = choice.message.content or ""
            samples.append(
                Sample(
                    text=text,
                    finish_reason=choice.finish_reason or "",
                    tokens=list(node.tokens),
                    masks=list(node.masked_tokens),
                    logprobs=node_logprobs(managed, node),
                    messages=[*messages, {"role": "assistant", "content": text}],
                    generation_params=sampling_params(request),
                )
            )
    return samples


def group_from_samples(
    samples: Sequence[Sample],
    scores: Sequence[float],
    *,
    group_size: int | None = None,
    messages: list[list[dict[str, Any]]] | None = None,
) -> ScoredDataGroup:
    """The ``ScoredDataGroup`` of ``samples`` scored ``scores`` (one score a sample, in order).

    It holds ``tokens``, ``masks``, ``scores`` and ``messages`` (each sample's own chat, or
    ``messages`` when given); ``inference_logprobs`` only when every sample has sampler logprobs
    (a token server; a partial list would misalign the trainer); and
    ``group_overrides = {"group_size": len(samples)}`` when ``group_size`` is given and the
    group has another size (samples filtered out), so the API packs it as what it is.
    Add any further keys (``overrides``, ``generation_params``, ``images``...) to the result.

    Raises:
        ValueError: ``scores`` (or ``messages``) and ``samples`` differ in length.
    """
    if len(scores) != len(samples):
        raise ValueError(f"{len(samples)} samples but {len(scores)} scores")
    if messages is not None and len(messages) != len(samples):
        raise ValueError(f"{len(samples)} samples but {len(messages)} message lists")
    group = ScoredDataGroup(
        tokens=[s.tokens for s in samples],
        masks=[s.masks for s in samples],
        scores=[float(score) for score in scores],
        messages=messages if messages is not None else [s.messages for s in samples],
    )
    if samples and all(s.logprobs is not None for s in samples):
        group["inference_logprobs"] = [s.logprobs for s in samples]  # type: ignore[misc]
    params = [s.generation_params for s in samples]
    if params and all(p == params[0] for p in params):
        if params[0]:
            group["generation_params"] = dict(params[0])
    elif params:
        group["overrides"] = [dict(p) for p in params]
    if group_size is not None and len(samples) != group_size:
        group["group_overrides"] = {"group_size": len(samples)}
    return group


def group_from_trajectories(
    trajectories: Sequence[dict[str, Any] | None],
    scores: Sequence[float | None],
    *,
    group_size: int | None = None,
) -> ScoredDataGroup | None:
    """The ``ScoredDataGroup`` of multi-turn episodes: ``ChatSession.trajectory()`` results
    and one score each (in order).

    An episode whose trajectory is None (the model never spoke) is left out. A score of None
    (nothing could score the episode) is sent as 0.0 with
    ``overrides[i].set_advantage_to_zero``, so it teaches nothing. ``inference_logprobs`` is
    set only when every kept trajectory has them; ``generation_params`` once when the episodes
    were sampled alike (else per sequence in ``overrides``); ``group_overrides.group_size`` when
    ``group_size`` is given and fewer episodes are kept. None when no episode is kept.

    Raises:
        ValueError: ``scores`` and ``trajectories`` differ in length.
    """
    if len(scores) != len(trajectories):
        raise ValueError(f"{len(trajectories)} trajectories but {len(scores)} scores")
    kept = [(t, s) for t, s in zip(trajectories, scores, strict=True) if t is not None]
    if not kept:
        return None
    group = ScoredDataGroup(
        tokens=[t["tokens"] for t, _ in kept],
        masks=[t["masks"] for t, _ in kept],
        scores=[0.0 if s is None else float(s) for _, s in kept],
        messages=[t["messages"] for t, _ in kept],
    )
    logprobs = [t.get("inference_logprobs") for t, _ in kept]
    if all(lp is not None for lp in logprobs):
        group["inference_logprobs"] = logprobs  # type: ignore[misc]
    params = [t.get("generation_params") or {} for t, _ in kept]
    same = all(p == params[0] for p in params)
    if same and params[0]:
        group["generation_params"] = dict(params[0])
    overrides = [
        ({} if same else dict(p)) | ({"set_advantage_to_zero": True} if s is None else {})
        for p, (_, s) in zip(params, kept, strict=True)
    ]
    if any(overrides):
        group["overrides"] = overrides
    if group_size is not None and len(kept) != group_size:
        group["group_overrides"] = {"group_size": len(kept)}
    return group


def weighted_reward(
    terms: Mapping[str, float | None], weights: Mapping[str, float] | None = None
) -> float | None:
    """A sample's reward from its named reward terms: the weighted sum (weight 1 for a term
    ``weights`` does not name) of the terms that scored it; a term that is None or NaN did not
    score it (TRL's rule). None when no term did: send the sample with
    ``set_advantage_to_zero`` (``group_from_trajectories`` does so for a None score)."""
    weights = weights or {}
    parts = [
        weights.get(name, 1.0) * value
        for name, value in terms.items()
        if value is not None and not math.isnan(value)
    ]
    return sum(parts) if parts else None


def reward_term_values(
    per_sample: Sequence[Mapping[str, float | None]],
) -> dict[str, list[float]]:
    """Each reward term's values over the samples it scored (None and NaN left out), terms in
    the order they first appear; a term no sample scored is absent."""
    values: dict[str, list[float]] = {}
    for terms in per_sample:
        for name, value in terms.items():
            bucket = values.setdefault(name, [])
            if value is not None and not math.isnan(float(value)):
                bucket.append(float(value))
    return {name: v for name, v in values.items() if v}


def log_reward_terms(
    env: Any, prefix: str, per_sample: Sequence[Mapping[str, float | None]]
) -> None:
    """One metric per reward term, ``<prefix>/<term>``: the mean (unweighted) of the samples
    the term scored, through ``env.log_train_metric``."""
    for name, values in reward_term_values(per_sample).items():
        env.log_train_metric(f"{prefix}/{name}", values)


def apply_length_penalty(
    env: Any, group: ScoredDataGroup, *, full_score: float, threshold: float = 0.5
) -> bool:
    """Upstream's length penalty, in one place for every env: when every sequence of
    ``group`` scored at least ``full_score`` (all right: no signal left), scale each score by
    its sequence's factor (:func:`atroposlib.scoring.rewards.length_penalty_scores`: 1.0 up to
    ``threshold * max_token_length`` tokens, falling linearly to 0.0 at ``max_token_length``),
    so shorter right answers are preferred. Logs ``train/length_penalty_applied`` (1 or 0 per
    group). Returns whether it applied.
    """
    from atroposlib.scoring.rewards import length_penalty_scores

    scores = group["scores"]
    applies = bool(scores) and all(s >= full_score for s in scores)
    env.log_train_metric("train/length_penalty_applied", 1.0 if applies else 0.0)
    if applies:
        factors = length_penalty_scores(
            [len(t) for t in group["tokens"]], env.config.max_token_length, threshold
        )
        group["scores"] = [s * f for s, f in zip(scores, factors, strict=True)]
    return applies


async def eval_completion(
    env: Any,
    messages: list[dict[str, Any]],
    max_tokens: int,
    temperature: float,
    **kwargs: Any,
) -> tuple[str, str]:
    """One evaluation completion of ``messages`` (``split="eval"``, so it uses the eval
    slots): ``(text, finish_reason)``."""
    reply = await env.server.chat_completion(
        messages=messages,
        n=1,
        max_tokens=max_tokens,
        temperature=temperature,
        split="eval",
        **kwargs,
    )
    choice = reply.choices[0]
    return choice.message.content or "", choice.finish_reason or ""


class ChatSession:
    """One multi-turn conversation and its trajectory (use as ``async with``).

    The env appends user/tool messages (observations, tool results) with ``add``,
    ``await session.generate()`` asks the model for the next assistant turn, and
    ``session.trajectory()`` returns the training sequence. Every turn goes through one
    managed session (``ServerManager.managed_server(tokens="auto")``): each prompt extends
    the previous turn's node, so the final node holds the whole conversation with **every
    assistant turn trained on** and observations/prompts masked, plus the sampler's logprobs
    on token servers (a plain OpenAI endpoint re-tokenizes the chat, without logprobs).

    The conversation stays under ``max_token_length``: each turn's ``max_tokens`` is capped
    by the room left, and ``generate()`` returns None when there is no room for another turn
    (``truncated`` is then set; the env ends the episode).

    Args:
        env: The ``BaseEnv`` (its ``server`` and ``tokenizer`` are used).
        messages: The opening messages (system, first observation...).
        max_tokens_per_turn: Generation budget of one assistant turn.
        max_token_length: Budget of the whole conversation (prompt + all turns).
        temperature: Sampling temperature.
        tools: OpenAI ``tools`` sent with every request; on token servers this session's
            replies are parsed for ``tool_calls`` with ``tool_parser``. None for plain text.
        tool_parser: Parser of this session's tool calls (default: the server manager's,
            else ``"hermes"``); the shared server manager is not changed.
        min_turn_tokens: ``generate()`` returns None when fewer tokens than this are left.
    """

    def __init__(
        self,
        env: Any,
        messages: list[dict[str, Any]],
        *,
        max_tokens_per_turn: int,
        max_token_length: int,
        temperature: float = 1.0,
        tools: list[dict[str, Any]] | None = None,
        tool_parser: str | None = None,
        min_turn_tokens: int = 4,
    ) -> None:
        self.env = env
        self.messages: list[dict[str, Any]] = [dict(m) for m in messages]
        self.max_tokens_per_turn = max_tokens_per_turn
        self.max_token_length = max_token_length
        self.temperature = temperature
        self.tools = tools
        if tools and tool_parser is None:
            tool_parser = getattr(env.server, "tool_parser", None) or "hermes"
        self.tool_parser = tool_parser
        self.min_turn_tokens = min_turn_tokens
        self.finish_reasons: list[str] = []
        self.generation_params: dict[str, Any] = {}
        """How the turns were sampled (temperature, top-k/top-p/min-p), for the trainer."""
        self.turns = 0
        self.truncated = False
        self._cm: Any = None
        self.managed: Any = None

    async def __aenter__(self) -> ChatSession:
        self._cm = self.env.server.managed_server(
            tokenizer=self.env.tokenizer, tool_parser=self.tool_parser, tokens="auto"
        )
        self.managed = await self._cm.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._cm is not None:
            await self._cm.__aexit__(*exc)

    def add(self, role: str, content: Any, **extra: Any) -> None:
        """Append a message (an observation, a tool result...)."""
        self.messages.append({"role": role, "content": content, **extra})

    def prompt_length(self) -> int:
        """Tokens of the conversation so far plus the generation prompt."""
        ids = self.env.tokenizer.apply_chat_template(
            chat_for_template(self.messages), add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return len(ids)

    async def generate(self, **kwargs: Any) -> Any | None:
        """The model's next turn (an OpenAI ``Choice``), appended to ``messages``; None when
        the conversation has no room left (``truncated`` is then set). ``kwargs`` go to
        ``chat_completion`` (``split="eval"`` for evaluation episodes)."""
        if self.managed is None:
            raise RuntimeError("use ChatSession as 'async with ChatSession(...) as session'")
        room = self.max_token_length - self.prompt_length() - 1
        if room < self.min_turn_tokens:
            self.truncated = True
            return None
        request: dict[str, Any] = {
            "messages": self.messages,
            "n": 1,
            "max_tokens": min(self.max_tokens_per_turn, room),
            "temperature": self.temperature,
            **kwargs,
        }
        if self.tools:
            request["tools"] = self.tools
        reply = await self.managed.chat_completion(**request)
        if kwargs.get("split") != "eval":
            # the last training turn's settings: turns of one episode are sampled alike
            self.generation_params = sampling_params(request)
        choice = reply.choices[0]
        self.messages.append(reply_message(choice))
        self.finish_reasons.append(choice.finish_reason or "")
        self.turns += 1
        return choice

    def trajectory(self) -> dict[str, Any] | None:
        """``{"tokens", "masks", "inference_logprobs" (token servers only), "messages",
        "generation_params"}`` for the conversation up to the model's last turn; None when
        the model never spoke."""
        if self.turns == 0 or self.managed is None:
            return None
        nodes = self.managed.get_state()["nodes"]
        if not nodes:
            return None
        if len(nodes) > 1:
            # a prompt did not extend the previous node (the template rewrote history);
            # the last node still masks its prompt, so earlier turns are not trained on
            logger.warning("multi-turn conversation split into %d nodes", len(nodes))
        node = nodes[-1]
        out: dict[str, Any] = {"tokens": list(node.tokens), "masks": list(node.masked_tokens)}
        logprobs = node_logprobs(self.managed, node)
        if logprobs is not None:
            out["inference_logprobs"] = logprobs
        out["messages"] = [dict(m) for m in self.messages]
        if self.generation_params:
            out["generation_params"] = dict(self.generation_params)
        return out
