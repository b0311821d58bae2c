"""How a trainer reads a scored group: the trainer's half of the Atropos contract, torch-free.

``GET /batch`` hands a trainer a list of *groups* (``atroposlib.schema.ScoredData`` as plain
dicts). Each group holds several sequences sampled for one prompt, with one score each. This
module turns every sequence into a :class:`TrainingRow`: the data a policy-gradient loss needs,
already split and aligned, so that no trainer has to re-derive the rules below.

Prompt and completion
    ``masks[i]`` is a labels array: the token id where the token is trained, ``-100`` where it
    is not (prompt, tool output, user turns). The *prompt* is everything before the first trained
    token; the *completion* is the rest. ``loss_mask`` has one entry per completion token: 1 where
    trained, 0 for tokens in the completion that the model did not produce (a multi-turn
    sequence's tool results and user turns). A sequence with no trained token has an empty
    completion (it teaches nothing; :func:`rows_from_group` keeps it so counts stay exact). The
    prompt is never empty: nothing predicts a sequence's first token, so a label there is not
    trained (upstream's trainer drops it in the shift too).

Advantages (one value per completion token)
    1. The group's explicit ``advantages[i]`` when the env sent them: per token (aligned with
       ``tokens``) or one value for the whole sequence.
    2. Otherwise from the scores: ``(score - mean) / max(std, 1e-8)`` over the group, with the
       sample (n-1) standard deviation as upstream's trainer; a group of one keeps its raw score.
       ``scale="none"`` leaves out the division (Dr. GRPO).
    3. ``overrides[i]["set_advantage_to_zero"]`` makes the sequence's advantage 0 everywhere,
       *after* normalisation: its score still counts in the group's baseline.

Sampler log-probs
    ``inference_logprobs[i]`` (aligned with ``tokens``) are the log-probabilities the inference
    server reported when it sampled each token. Envs put ``1.0`` at positions the server did not
    sample (a log-probability is never positive); those read as ``None``. A group without them
    gives ``sampler_logprobs=None``.

Temperature
    ``overrides[i]["temperature"]``, else ``generation_params["temperature"]``, else
    ``group_overrides["temperature"]``, else 1.0.

Truncated sampling
    ``top_k``, ``top_p`` and ``min_p`` are read the same way (defaults -1, 1.0, 0.0: none).
    When a server samples with them it draws from the truncated, renormalised distribution,
    and with ``--logprobs-mode processed_logprobs`` (vLLM, TRL's vllm-serve, atropos-serve)
    reports that distribution's log-probabilities. A trainer's importance ratio is only 1
    without a weight change when its own log-probabilities are of the same distribution: it
    applies the same truncation to its temperature-scaled logits
    (:func:`atroposlib.trainer.tensors.sampled_logprobs`). Values out of range
    (``top_p`` outside (0, 1], ``min_p`` outside [0, 1], ``top_k`` below -1) are a
    :class:`MalformedGroupError` naming the field.

Policy version
    ``policy_version`` is the trainer step whose weights generated the group (None when the env
    did not say; such a group counts as current).

Every group is validated first (``atroposlib.schema``): a malformed one raises
:class:`MalformedGroupError` naming the group and the field, e.g.
``group 2: masks[1] has 5 entries but tokens[1] has 6``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import ValidationError

from atroposlib.schema import GroupError, ScoredData, check_group

__all__ = [
    "MalformedGroupError",
    "TrainingRow",
    "group_advantages",
    "rows_from_batch",
    "rows_from_group",
    "sample_temperature",
    "sample_truncation",
    "validate_group",
]

IGNORE_INDEX = -100
"""The label of a position that is not trained (``masks``)."""

Scale = Literal["group", "none"]


class MalformedGroupError(ValueError):
    """A group a trainer cannot train on. ``field`` is the path of the offending field
    (e.g. ``"masks[1]"``), ``group`` the group's index in the batch (None for a lone group)."""

    def __init__(self, field: str, message: str, group: int | None = None) -> None:
        prefix = f"group {group}: " if group is not None else ""
        super().__init__(prefix + message)
        self.field = field
        self.group = group


@dataclass
class TrainingRow:
    """One sequence of a group, ready for a policy-gradient loss.

    Completion-aligned lists (``loss_mask``, ``advantages``, ``sampler_logprobs``) have one entry
    per token of ``completion_ids``; position ``j`` is the token the model predicts from
    ``prompt_ids + completion_ids[:j]``.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    loss_mask: list[int]
    """1 where the completion token is trained, 0 where the env wrote it (tool output, user turn)."""
    advantages: list[float]
    """Advantage of each completion token (explicit from the env, or from the group's scores)."""
    score: float
    sampler_logprobs: list[float | None] | None = None
    """Log-probability the sampler gave each completion token (None where it reported none)."""
    temperature: float = 1.0
    top_k: int = -1
    """Top-k the sequence was sampled with (-1 or 0: none)."""
    top_p: float = 1.0
    """Top-p (nucleus) it was sampled with (1.0: none)."""
    min_p: float = 0.0
    """Min-p it was sampled with (0.0: none)."""
    policy_version: int | None = None
    group: int = 0
    """Index of the row's group in the batch."""
    index: int = 0
    """Index of the row in its group."""
    group_size: int = 1
    env_id: int | None = None
    advantage_source: Literal["scores", "explicit", "zeroed"] = "scores"
    extra: dict[str, Any] = field(default_factory=dict)
    """``overrides[i]`` as sent (e.g. ``{"sft": True}``), for trainers that read more flags."""

    @property
    def tokens(self) -> list[int]:
        """The whole sequence: prompt then completion."""
        return self.prompt_ids + self.completion_ids

    @property
    def labels(self) -> list[int]:
        """Atropos's labels form over :attr:`tokens`: the token id where trained, else -100."""
        return [IGNORE_INDEX] * len(self.prompt_ids) + [
            t if m else IGNORE_INDEX
            for t, m in zip(self.completion_ids, self.loss_mask, strict=True)
        ]

    @property
    def num_trained(self) -> int:
        """Tokens the loss trains."""
        return sum(self.loss_mask)

    @property
    def advantage(self) -> float:
        """The sequence's advantage: the mean over its trained tokens (the common value when the
        advantage is per sequence, as it is unless the env sent per-token advantages)."""
        trained = [a for a, m in zip(self.advantages, self.loss_mask, strict=True) if m]
        return sum(trained) / len(trained) if trained else 0.0

    @property
    def has_signal(self) -> bool:
        """Whether some trained token has a non-zero advantage (a row without one adds nothing to
        a policy-gradient loss that has no KL or entropy term)."""
        return any(a != 0.0 for a, m in zip(self.advantages, self.loss_mask, strict=True) if m)


# ---------------------------------------------------------------------------------- validation


def _field_path(loc: Sequence[str | int]) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def validate_group(group: Mapping[str, Any], index: int | None = None) -> ScoredData:
    """``group`` as a :class:`~atroposlib.schema.ScoredData`, or :class:`MalformedGroupError`.

    Checks the schema (types, lengths, finite values) and what a trainer relies on beyond it:
    a mask is -100 or the token id at its position.
    """
    if not isinstance(group, Mapping):
        raise MalformedGroupError(
            "", f"expected a group (a JSON object), got {type(group).__name__}", index
        )
    overrides = group.get("overrides")
    if isinstance(overrides, list) and any(o is None for o in overrides):
        # a null entry means "no flags" to every trainer; the wire model wants an object
        group = {**group, "overrides": [{} if o is None else o for o in overrides]}
    try:
        data = ScoredData.model_validate(group)
    except ValidationError as exc:
        error = exc.errors()[0]
        path = _field_path(error["loc"])
        raise MalformedGroupError(path, f"{path}: {error['msg']}", index) from None
    try:
        check_group(data)
    except GroupError as exc:
        raise MalformedGroupError(_field_path(exc.loc), exc.msg, index) from None
    for i, (tokens, masks) in enumerate(zip(data.tokens, data.masks, strict=True)):
        for t, (token, label) in enumerate(zip(tokens, masks, strict=True)):
            if label != IGNORE_INDEX and label != token:
                raise MalformedGroupError(
                    f"masks[{i}][{t}]",
                    f"masks[{i}][{t}] is {label} but tokens[{i}][{t}] is {token}: a mask holds "
                    "the token id where the token is trained, -100 where it is not",
                    index,
                )
    return data


# ---------------------------------------------------------------------------------- advantages


def _normalised(scores: Sequence[float], scale: Scale) -> list[float]:
    n = len(scores)
    if n == 1:
        return [float(scores[0])]
    mean = math.fsum(scores) / n
    centred = [s - mean for s in scores]
    if scale == "none":
        return centred
    std = math.sqrt(math.fsum(c * c for c in centred) / (n - 1))
    return [c / max(std, 1e-8) for c in centred]


def group_advantages(
    group: Mapping[str, Any] | ScoredData, *, scale: Scale = "group"
) -> list[list[float] | float]:
    """Advantage of each sequence of ``group``: a float, or a per-token list (aligned with
    ``tokens``) when the env sent per-token advantages. Rules: the module docstring.

    Args:
        group: one group of a ``/batch`` reply (validated or not).
        scale: ``"group"`` divides by the group's standard deviation (GRPO, upstream);
            ``"none"`` only subtracts the mean (Dr. GRPO).
    """
    data = group if isinstance(group, ScoredData) else validate_group(group)
    result: list[list[float] | float]
    if data.advantages is not None:
        result = [float(a[0]) if len(a) == 1 else [float(x) for x in a] for a in data.advantages]
    else:
        result = list(_normalised([float(s) for s in data.scores], scale))
    for i, override in enumerate(data.overrides or ()):
        if override and override.get("set_advantage_to_zero"):
            result[i] = 0.0
    return result


def sample_temperature(group: Mapping[str, Any] | ScoredData, index: int) -> float:
    """Sampling temperature of sequence ``index`` (order: the module docstring)."""
    data = group if isinstance(group, ScoredData) else validate_group(group)
    overrides = data.overrides or []
    for source in (
        overrides[index] if index < len(overrides) else None,
        data.generation_params,
        data.group_overrides,
    ):
        if source and source.get("temperature") is not None:
            return float(source["temperature"])
    return 1.0


def _setting(data: ScoredData, index: int, name: str) -> tuple[Any, str] | None:
    """``(value, where)`` of a per-sequence sampling setting (order: the module docstring)."""
    overrides = data.overrides or []
    for source, where in (
        (overrides[index] if index < len(overrides) else None, f"overrides[{index}]"),
        (data.generation_params, "generation_params"),
        (data.group_overrides, "group_overrides"),
    ):
        if source and source.get(name) is not None:
            return source[name], f"{where}.{name}"
    return None


def sample_truncation(
    group: Mapping[str, Any] | ScoredData, index: int
) -> tuple[int, float, float]:
    """``(top_k, top_p, min_p)`` sequence ``index`` was sampled with (module docstring).

    Raises:
        MalformedGroupError: a value of the wrong type or out of range (the field is named).
    """
    data = group if isinstance(group, ScoredData) else validate_group(group)
    top_k, top_p, min_p = -1, 1.0, 0.0
    found = _setting(data, index, "top_k")
    if found is not None:
        value, where = found
        if isinstance(value, bool) or not isinstance(value, int) or value < -1:
            raise MalformedGroupError(where, f"{where} must be an integer >= -1, got {value!r}")
        top_k = value if value > 0 else -1
    found = _setting(data, index, "top_p")
    if found is not None:
        value, where = found
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise MalformedGroupError(where, f"{where} must be in (0, 1], got {value!r}")
        top_p = float(value)
    found = _setting(data, index, "min_p")
    if found is not None:
        value, where = found
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise MalformedGroupError(where, f"{where} must be in [0, 1], got {value!r}")
        min_p = float(value)
    return top_k, top_p, min_p


# ---------------------------------------------------------------------------------------- rows


def _first_trained(masks: Sequence[int]) -> int:
    """Where the completion starts: the first trained position, never 0 (nothing predicts the
    first token of a sequence, so a label there is dropped, as upstream's shift drops it)."""
    for t, label in enumerate(masks):
        if label != IGNORE_INDEX and t > 0:
            return t
    return len(masks)


def rows_from_group(
    group: Mapping[str, Any] | ScoredData, *, index: int | None = None, scale: Scale = "group"
) -> list[TrainingRow]:
    """The :class:`TrainingRow` of every sequence of one group (rules: module docstring).

    Args:
        group: one group of a ``/batch`` reply.
        index: the group's index in its batch (used in rows and error messages).
        scale: how scores become advantages (see :func:`group_advantages`).

    Raises:
        MalformedGroupError: the group breaks the schema; the message names the field.
    """
    data = group if isinstance(group, ScoredData) else validate_group(group, index)
    advantages = group_advantages(data, scale=scale)
    overrides = data.overrides or []
    rows = []
    for i, (tokens, masks) in enumerate(zip(data.tokens, data.masks, strict=True)):
        start = _first_trained(masks)
        width = len(tokens) - start
        advantage = advantages[i]
        per_token = (
            [float(a) for a in advantage[start:]]
            if isinstance(advantage, list)
            else [float(advantage)] * width
        )
        sampler: list[float | None] | None = None
        if data.inference_logprobs is not None:
            sampler = [v if v <= 0 else None for v in data.inference_logprobs[i][start:]]
        override = overrides[i] if i < len(overrides) and overrides[i] else {}
        if override.get("set_advantage_to_zero"):
            source = "zeroed"
        elif data.advantages is not None:
            source = "explicit"
        else:
            source = "scores"
        try:
            top_k, top_p, min_p = sample_truncation(data, i)
        except MalformedGroupError as exc:
            raise MalformedGroupError(exc.field, str(exc), index) from None
        rows.append(
            TrainingRow(
                prompt_ids=list(tokens[:start]),
                completion_ids=list(tokens[start:]),
                loss_mask=[0 if label == IGNORE_INDEX else 1 for label in masks[start:]],
                advantages=per_token,
                score=float(data.scores[i]),
                sampler_logprobs=sampler,
                temperature=sample_temperature(data, i),
                top_k=top_k,
                top_p=top_p,
                min_p=min_p,
                policy_version=data.policy_version,
                group=index or 0,
                index=i,
                group_size=len(data.tokens),
                env_id=data.env_id,
                advantage_source=source,
                extra=dict(override),
            )
        )
    return rows


def rows_from_batch(
    batch: Iterable[Mapping[str, Any]], *, scale: Scale = "group"
) -> list[TrainingRow]:
    """Every sequence of a ``/batch`` reply's groups as :class:`TrainingRow` s, in batch order.

    Raises:
        MalformedGroupError: a group breaks the schema; the message names the group and field.
    """
    rows: list[TrainingRow] = []
    for g, group in enumerate(batch):
        rows.extend(rows_from_group(group, index=g, scale=scale))
    return rows
