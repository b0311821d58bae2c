"""Turning a batch from ``GET /batch`` into padded training tensors.

Padding follows upstream's ``pad_data_to_good_offset``:

- Let ``L`` be the longest sequence. If ``L - 1`` is not a multiple of 64, ``L`` becomes
  ``ceil((L - 1) / 64) * 64 + 1``, so the shifted inputs (``L - 1`` long) have a length that is a
  multiple of 64 (friendly to GPU kernels, and few distinct shapes).
- Tokens are right-padded with 0 and masks with -100; ``input_ids = tokens[:-1]`` and
  ``labels = masks[1:]`` (a mask holds the token id where it is trained, -100 elsewhere).
  Right-padding needs no attention mask: causal attention never looks forward.

Differences from upstream, on purpose: the last partial micro-batch is kept (upstream's classic
trainer dropped it); per-token ``inference_logprobs`` are shifted like the labels (NaN where
missing, and where the value is positive: a real log-probability never is, and envs put 1.0 on
prompt positions); env-provided ``advantages`` are used instead of scores when present.

Advantages, per group: the env's ``advantages`` (one per token, or one per sequence) when sent;
else ``(score - mean) / max(std, 1e-8)`` over the group (a group of one keeps its raw score);
``overrides[i]["set_advantage_to_zero"]`` makes it 0. Sampling temperature per sequence:
``overrides[i]["temperature"]``, else ``generation_params["temperature"]``, else
``group_overrides["temperature"]``, else 1.0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

PAD_MULTIPLE = 64


@dataclass
class MicroBatch:
    """One forward/backward pass worth of sequences, padded to a common length."""

    input_ids: torch.Tensor  # [B, L-1]
    labels: torch.Tensor  # [B, L-1], -100 where not trained
    advantages: torch.Tensor  # [B, L-1]
    old_logprobs: torch.Tensor  # [B, L-1], NaN where unknown
    temperatures: torch.Tensor  # [B]

    @property
    def mask(self) -> torch.Tensor:
        """1.0 where a token is trained."""
        return (self.labels != -100).float()


@dataclass
class TrainingBatch:
    """A whole optimizer step: micro-batches plus the numbers the loss normalises by."""

    micro_batches: list[MicroBatch]
    num_sequences: int
    num_tokens: int  # trained tokens
    total_tokens: int  # all tokens (prompt + completion), for throughput
    reward_mean: float


def padded_length(longest: int) -> int:
    """Upstream's "good offset": the smallest L >= longest with (L - 1) % 64 == 0 (or longest)."""
    if (longest - 1) % PAD_MULTIPLE == 0:
        return longest
    return math.ceil((longest - 1) / PAD_MULTIPLE) * PAD_MULTIPLE + 1


def group_advantages(group: dict[str, Any]) -> list[list[float] | float]:
    """Advantage of each sequence of one group: a float, or a per-token list from the env."""
    scores = [float(s) for s in group["scores"]]
    env_advantages = group.get("advantages")
    result: list[list[float] | float] = []
    if env_advantages is not None:
        for adv in env_advantages:
            result.append(float(adv[0]) if len(adv) == 1 else [float(a) for a in adv])
    elif len(scores) > 1:
        t = torch.tensor(scores, dtype=torch.float64)
        # torch's unbiased std, as upstream
        normalised = (t - t.mean()) / max(float(t.std()), 1e-8)
        result = [float(a) for a in normalised]
    else:
        result = list(scores)
    overrides = group.get("overrides") or []
    for i, override in enumerate(overrides):
        if override and override.get("set_advantage_to_zero"):
            result[i] = 0.0
    return result


def sample_temperature(group: dict[str, Any], index: int) -> float:
    """Sampling temperature of sequence ``index`` (see the module docstring for the order)."""
    overrides = group.get("overrides") or []
    candidates = [
        overrides[index] if index < len(overrides) else None,
        group.get("generation_params"),
        group.get("group_overrides"),
    ]
    for source in candidates:
        if source and source.get("temperature") is not None:
            return float(source["temperature"])
    return 1.0


def prepare_batch(batch: list[dict[str, Any]], micro_batch_size: int) -> TrainingBatch:
    """Flatten the groups of one ``/batch`` reply into padded micro-batches."""
    rows: list[tuple[list[int], list[int], list[float] | float, list[float] | None, float]] = []
    scores: list[float] = []
    for group in batch:
        advantages = group_advantages(group)
        inference = group.get("inference_logprobs")
        scores.extend(float(s) for s in group["scores"])
        for i, tokens in enumerate(group["tokens"]):
            old = inference[i] if inference is not None and i < len(inference) else None
            rows.append(
                (tokens, group["masks"][i], advantages[i], old, sample_temperature(group, i))
            )
    if not rows:
        raise ValueError("empty batch: no sequences to train on")
    length = padded_length(max(len(tokens) for tokens, *_ in rows))

    micro_batches = []
    for start in range(0, len(rows), micro_batch_size):
        chunk = rows[start : start + micro_batch_size]
        n = len(chunk)
        tokens_t = torch.zeros(n, length, dtype=torch.long)
        masks_t = torch.full((n, length), -100, dtype=torch.long)
        adv_t = torch.zeros(n, length, dtype=torch.float32)
        old_t = torch.full((n, length), float("nan"), dtype=torch.float32)
        temps = torch.ones(n, dtype=torch.float32)
        for row, (tokens, mask, adv, old, temp) in enumerate(chunk):
            size = len(tokens)
            tokens_t[row, :size] = torch.tensor(tokens, dtype=torch.long)
            masks_t[row, :size] = torch.tensor(mask, dtype=torch.long)
            if isinstance(adv, list):
                adv_t[row, : len(adv)] = torch.tensor(adv, dtype=torch.float32)
            else:
                adv_t[row, :size] = adv
            if old is not None:
                values = torch.tensor([math.nan if v is None else v for v in old])
                values[values > 0] = math.nan
                old_t[row, : len(values)] = values
            temps[row] = temp
        micro_batches.append(
            MicroBatch(
                input_ids=tokens_t[:, :-1],
                labels=masks_t[:, 1:],
                advantages=adv_t[:, 1:],
                old_logprobs=old_t[:, 1:],
                temperatures=temps,
            )
        )
    num_tokens = int(sum(int((mb.labels != -100).sum()) for mb in micro_batches))
    return TrainingBatch(
        micro_batches=micro_batches,
        num_sequences=len(rows),
        num_tokens=num_tokens,
        total_tokens=sum(len(tokens) for tokens, *_ in rows),
        reward_mean=sum(scores) / len(scores),
    )
