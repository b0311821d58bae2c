"""The trainer's half of the Atropos contract, for any trainer (TRL, Axolotl, verl, your loop).

One import gives what a trainer needs to consume environments through ``run-api``:

* :class:`TrainerClient`: register, pull ``GET /batch`` (acknowledged: at-least-once delivery).
* :func:`rows_from_batch` / :func:`rows_from_group`: every sequence of a batch as a
  :class:`TrainingRow` (prompt and completion ids, loss mask, per-token advantages, sampler
  log-probs, temperature, policy version), validated, torch-free. The rules:
  :mod:`atroposlib.trainer.rows`.
* :func:`pad_rows`, :func:`pack_rows`, :func:`token_logprobs`: rows as tensors, and
  :func:`sampled_logprobs`: log-probabilities of the distribution the sampler drew from
  (temperature and top-k/top-p/min-p truncation), which importance ratios need (needs torch,
  the ``trainer`` extra; imported on first use).
* :func:`weight_sync_client`, :func:`sync_weights`: new weights onto the running inference
  server the environments sample from (:mod:`atroposlib.backends`, re-exported here).

A complete loop is in ``docs/trainers.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from atroposlib.api.client import TrainerClient, TrajectoryAPIError
from atroposlib.backends import sync_weights, weight_sync_client
from atroposlib.trainer.rows import (
    MalformedGroupError,
    TrainingRow,
    group_advantages,
    rows_from_batch,
    rows_from_group,
    sample_temperature,
    sample_truncation,
    validate_group,
)

if TYPE_CHECKING:
    from atroposlib.trainer.tensors import (
        PackedBatch,
        PaddedBatch,
        pack_rows,
        pad_rows,
        sampled_logprobs,
        token_logprobs,
        truncate_logits,
    )

__all__ = [
    "MalformedGroupError",
    "PackedBatch",
    "PaddedBatch",
    "TrainerClient",
    "TrainingRow",
    "TrajectoryAPIError",
    "group_advantages",
    "pack_rows",
    "pad_rows",
    "rows_from_batch",
    "rows_from_group",
    "sample_temperature",
    "sample_truncation",
    "sampled_logprobs",
    "sync_weights",
    "token_logprobs",
    "truncate_logits",
    "validate_group",
    "weight_sync_client",
]

_TORCH_NAMES = {
    "PackedBatch",
    "PaddedBatch",
    "pack_rows",
    "pad_rows",
    "sampled_logprobs",
    "token_logprobs",
    "truncate_logits",
}


def __getattr__(name: str) -> Any:
    if name in _TORCH_NAMES:
        from atroposlib.trainer import tensors

        return getattr(tensors, name)
    raise AttributeError(f"module 'atroposlib.trainer' has no attribute {name!r}")
