"""The scored-group schema, defined once: the keys, the ``TypedDict``s environments build and
the wire model the trajectory API validates.

This is the lowest floor of the package (it imports only ``type_definitions``): ``envs``,
``api``, ``utils`` and the trainer import the schema from here. Field names, types and defaults
are upstream Atropos's, so existing environments and trainers keep working. On top of
upstream's per-field type checks, :func:`check_group` verifies what upstream never did: that the
per-sequence lists of a group agree in length, that a group is not empty, and that values are
finite. Every problem is reported with the path of the field.

Adding a field to the wire: add it to :class:`ScoredData` (optional, default None, so upstream
clients that omit it keep working), to :data:`GROUP_KEYS` (and :data:`PER_SEQUENCE_KEYS` when it
has one entry per sequence), and to :class:`ScoredDataGroup`/:class:`ScoredDataItem`. A field
upstream does not have goes to :data:`EXTENSION_KEYS` instead of :data:`GROUP_KEYS`: it is
stored and handed out in ``/batch`` only when a group sets it (:func:`wire_dict`), so groups
from upstream clients keep upstream's exact shape; say in :func:`merge_extensions` how partial
groups combine it.

``policy_version`` (not in upstream) is the first such field: the trainer step whose weights
generated the group (see ``docs/compat.md``, "Policy versions"). A group without one is treated
as current: it is never too stale.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator
from typing_extensions import TypedDict

from atroposlib.type_definitions import Message

__all__ = [
    "EMPTY_EXAMPLE",
    "EXTENSION_KEYS",
    "GROUP_KEYS",
    "ITEM_KEYS",
    "PER_SEQUENCE_KEYS",
    "POLICY_VERSION_HEADER",
    "POLICY_VERSION_MAX",
    "PolicyVersion",
    "REQUIRED_KEYS",
    "GroupError",
    "ScoredData",
    "ScoredDataGroup",
    "ScoredDataItem",
    "check_group",
    "merge_extensions",
    "wire_dict",
]

#: Keys every stored group carries (upstream's 14), in upstream's order.
GROUP_KEYS: tuple[str, ...] = (
    "tokens",
    "masks",
    "scores",
    "advantages",
    "ref_logprobs",
    "messages",
    "generation_params",
    "inference_logprobs",
    "overrides",
    "group_overrides",
    "images",
    "env_id",
    "distill_token_ids",
    "distill_logprobs",
)

#: Keys upstream does not have (all optional, one value per group): a group carries them only
#: when set, so groups from upstream clients keep upstream's exact shape.
EXTENSION_KEYS: tuple[str, ...] = ("policy_version",)

#: Largest ``policy_version`` accepted (a signed 64-bit integer, what every JSON stack holds).
POLICY_VERSION_MAX = (1 << 63) - 1

#: Per-sequence fields: a list with one entry per sequence of the group.
PER_SEQUENCE_KEYS: tuple[str, ...] = (
    "tokens",
    "masks",
    "scores",
    "advantages",
    "ref_logprobs",
    "messages",
    "inference_logprobs",
    "overrides",
    "distill_token_ids",
    "distill_logprobs",
)

#: Keys a group must carry (the rest may be missing or None).
REQUIRED_KEYS: tuple[str, ...] = ("tokens", "masks", "scores")

#: Optional keys of a :class:`ScoredDataItem` that ``collect_trajectories`` gathers into a
#: group's per-sequence lists (kept only when every trajectory of the group has them).
ITEM_KEYS: tuple[str, ...] = (
    "advantages",
    "ref_logprobs",
    "messages",
    "overrides",
    "images",
    "inference_logprobs",
    "distill_token_ids",
    "distill_logprobs",
)

#: What ``GET /latest_example`` answers before any group arrived (upstream's exact shape).
EMPTY_EXAMPLE: dict[str, list[Any]] = {
    key: []
    for key in (
        "tokens",
        "masks",
        "scores",
        "advantages",
        "ref_logprobs",
        "generation_params",
        "inference_logprobs",
        "messages",
        "images",
    )
}


class ScoredDataGroup(TypedDict, total=False):
    """One scored group (every key may be missing; the API requires tokens, masks, scores).

    ``masks`` are labels: -100 where not trained on, the token id where trained.
    ``inference_logprobs`` carry 1.0 at masked positions.
    """

    tokens: list[list[int]]
    masks: list[list[int]]
    scores: list[float]
    advantages: list[list[float]] | None
    ref_logprobs: list[list[float]] | None
    messages: list[list[Message]] | None
    generation_params: dict[str, Any] | None
    inference_logprobs: list[list[float]] | None
    group_overrides: dict | None
    overrides: list[dict] | None
    images: Any | None
    distill_token_ids: list[list[list[int]]] | None
    distill_logprobs: list[list[list[float]]] | None
    #: The trainer step whose weights generated the group (stamped by the runtime when unset).
    policy_version: int | None


class ScoredDataItem(TypedDict, total=False):
    """One scored trajectory, as ``collect_trajectory`` returns it."""

    tokens: list[int]
    masks: list[int]
    scores: float
    advantages: list[float] | None
    ref_logprobs: list[float] | None
    messages: list[Message] | None
    group_overrides: dict | None
    overrides: dict | None
    images: Any | None
    inference_logprobs: list[float] | None
    distill_token_ids: list[list[int]] | None
    distill_logprobs: list[list[float]] | None
    #: The trainer step whose weights generated it; a group gets the lowest of its items'.
    policy_version: int | None


#: A policy version: a JSON integer (not a float or a string), 0 .. 2**63-1.
PolicyVersion = Annotated[int, Field(ge=0, le=POLICY_VERSION_MAX, strict=True)]

#: Response header of an inference server naming the policy version of the weights that
#: generated the response (``atropos-serve`` sends it on non-streamed generations).
POLICY_VERSION_HEADER = "X-Policy-Version"


class ScoredData(BaseModel):
    """One scored group, as environments POST it to ``/scored_data``."""

    model_config = ConfigDict(extra="ignore")

    tokens: list[list[int]] = Field(description="Token ids of each sequence (prompt+completion).")
    masks: list[list[int]] = Field(
        description="Per-token labels: -100 where not trained, else the token id."
    )
    scores: list[float] = Field(description="One reward per sequence.")
    advantages: list[list[float]] | None = Field(
        default=None, description="Optional per-token advantages (or one value per sequence)."
    )
    ref_logprobs: list[list[float]] | None = None
    messages: list[list[dict[str, Any]]] | None = Field(
        default=None, description="Chat messages per sequence (each needs role and content)."
    )
    generation_params: dict[str, Any] | None = None
    inference_logprobs: list[list[float]] | None = Field(
        default=None, description="Sampler log-probs aligned with tokens (1.0 where masked)."
    )
    overrides: list[dict[str, Any]] | None = Field(
        default=None, description="Per-sequence flags, e.g. set_advantage_to_zero."
    )
    group_overrides: dict[str, Any] | None = None
    images: Any | None = None
    env_id: int | None = Field(default=None, description="Id returned by /register-env.")
    distill_token_ids: list[list[list[int]]] | None = None
    distill_logprobs: list[list[list[float]]] | None = None
    policy_version: PolicyVersion | None = Field(
        default=None,
        description="Trainer step whose weights generated the group (not in upstream). Omitted: "
        "treated as current (never dropped by run-api --max-staleness).",
    )

    @field_validator("messages", mode="before")
    @classmethod
    def _messages_have_role_and_content(cls, value: Any) -> Any:
        if value is None or not isinstance(value, list):
            return value
        for i, conversation in enumerate(value):
            if not isinstance(conversation, list):
                continue  # the type check reports it with its position
            for j, message in enumerate(conversation):
                if isinstance(message, dict) and (
                    "role" not in message or "content" not in message
                ):
                    raise ValueError(
                        f"messages[{i}][{j}]: Message must have 'role' and 'content' fields"
                    )
        return value


def wire_dict(group: ScoredData) -> dict[str, Any]:
    """The fields of ``group`` as stored and handed out in ``/batch``: upstream's 14 keys in
    upstream's order, then each of :data:`EXTENSION_KEYS` the group sets."""
    data = group.__dict__
    if all(data[key] is not None for key in EXTENSION_KEYS):
        return data
    return {k: v for k, v in data.items() if v is not None or k not in EXTENSION_KEYS}


def merge_extensions(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The :data:`EXTENSION_KEYS` of a group merged from partial groups ``parts``: its
    ``policy_version`` is the oldest of the parts' (parts without one are current); keys no
    part sets are left out."""
    versions = [p["policy_version"] for p in parts if p.get("policy_version") is not None]
    return {"policy_version": min(versions)} if versions else {}


class GroupError(ValueError):
    """A group that type-checks but is inconsistent. ``loc`` is the offending field's path."""

    def __init__(self, loc: tuple[str | int, ...], msg: str, kind: str = "invalid") -> None:
        super().__init__(msg)
        self.loc = loc
        self.msg = msg
        self.kind = kind


def _all_finite(values: list[float]) -> int | None:
    """Index of the first non-finite value, or None."""
    for i, v in enumerate(values):
        if not math.isfinite(v):
            return i
    return None


def check_group(group: ScoredData) -> None:
    """Raise :class:`GroupError` if the lists of ``group`` disagree in length or hold NaN/inf.

    Accepted shapes: ``masks``, ``inference_logprobs`` and (when per-token) ``advantages`` have
    exactly ``len(tokens[i])`` entries for sequence ``i``; ``advantages[i]`` may also be a
    single per-sequence value. Every other per-sequence field needs one entry per sequence.
    """
    n = len(group.tokens)
    if n == 0:
        raise GroupError(("tokens",), "group is empty: tokens must hold at least one sequence")
    for key in PER_SEQUENCE_KEYS:
        value = getattr(group, key)
        if value is not None and len(value) != n and key != "messages":
            raise GroupError((key,), f"{key} has {len(value)} entries but tokens has {n} sequences")
    if group.messages is not None and len(group.messages) not in (0, n):
        raise GroupError(
            ("messages",), f"messages has {len(group.messages)} entries but tokens has {n}"
        )

    for i, seq in enumerate(group.tokens):
        if not seq:
            raise GroupError(("tokens", i), f"tokens[{i}] is empty")
        if len(group.masks[i]) != len(seq):
            raise GroupError(
                ("masks", i),
                f"masks[{i}] has {len(group.masks[i])} entries but tokens[{i}] has {len(seq)}",
            )
        if group.inference_logprobs is not None and len(group.inference_logprobs[i]) != len(seq):
            raise GroupError(
                ("inference_logprobs", i),
                f"inference_logprobs[{i}] has {len(group.inference_logprobs[i])} entries "
                f"but tokens[{i}] has {len(seq)}",
            )
        if group.advantages is not None and len(group.advantages[i]) not in (1, len(seq)):
            raise GroupError(
                ("advantages", i),
                f"advantages[{i}] has {len(group.advantages[i])} entries; expected "
                f"{len(seq)} (per token) or 1 (per sequence)",
            )

    bad = _all_finite(group.scores)
    if bad is not None:
        raise GroupError(("scores", bad), f"scores[{bad}] is not a finite number")
    for key in ("advantages", "ref_logprobs", "inference_logprobs"):
        rows = getattr(group, key)
        for i, row in enumerate(rows or ()):
            bad = _all_finite(row)
            if bad is not None:
                raise GroupError((key, i, bad), f"{key}[{i}][{bad}] is not a finite number")
    for i, positions in enumerate(group.distill_logprobs or ()):
        for j, row in enumerate(positions):
            bad = _all_finite(row)
            if bad is not None:
                raise GroupError(
                    ("distill_logprobs", i, j, bad),
                    f"distill_logprobs[{i}][{j}][{bad}] is not a finite number",
                )

    if group.distill_token_ids is not None and group.distill_logprobs is not None:
        for i, (ids, lps) in enumerate(
            zip(group.distill_token_ids, group.distill_logprobs, strict=True)
        ):
            if len(ids) != len(lps):
                raise GroupError(
                    ("distill_logprobs", i),
                    f"distill_logprobs[{i}] has {len(lps)} positions but "
                    f"distill_token_ids[{i}] has {len(ids)}",
                )
