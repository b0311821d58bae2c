"""Torch helpers: :class:`~atroposlib.trainer.rows.TrainingRow` s as padded or packed tensors.

Needs torch (``pip install "atroposlib[trainer]"``); the rest of :mod:`atroposlib.trainer` does
not. Every tensor here is aligned with the tokens: position ``t`` describes token ``t`` of the
sequence (its id, whether it is trained, its advantage, the sampler's log-probability of it).
A causal LM predicts token ``t`` from the logits at position ``t - 1``;
:func:`token_logprobs` does that shift, so a loss reads, for every position::

    logp = token_logprobs(model(input_ids=..., attention_mask=...).logits, batch)
    loss = -(batch.advantages * logp * batch.loss_mask).sum() / batch.loss_mask.sum()

Two layouts:

* :func:`pad_rows`: one row per sequence, right-padded to the longest (``pad_to_multiple_of``
  rounds the width up). Simple; padding costs compute when lengths differ.
* :func:`pack_rows`: sequences laid end to end in as few rows of at most ``max_tokens`` as
  first-fit gives, with ``position_ids`` restarting at 0 for each sequence and a block-causal
  attention mask (:meth:`PackedBatch.attention_mask_4d`) so no sequence attends to another.
  No padding inside a row.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from atroposlib.trainer.rows import TrainingRow

__all__ = [
    "PackedBatch",
    "PaddedBatch",
    "pack_rows",
    "pad_rows",
    "sampled_logprobs",
    "token_logprobs",
    "truncate_logits",
]


def _per_token(row: TrainingRow) -> tuple[list[float], list[float], list[float]]:
    """``(loss_mask, advantages, sampler_logprobs)`` over the whole sequence of ``row``."""
    prompt = len(row.prompt_ids)
    mask = [0.0] * prompt + [float(m) for m in row.loss_mask]
    adv = [0.0] * prompt + [
        a if m else 0.0 for a, m in zip(row.advantages, row.loss_mask, strict=True)
    ]
    sampler = [math.nan] * prompt + [
        math.nan if v is None else float(v)
        for v in (row.sampler_logprobs or [None] * len(row.completion_ids))
    ]
    return mask, adv, sampler


@dataclass
class PaddedBatch:
    """Rows as ``[B, T]`` tensors, right-padded (see the module docstring)."""

    input_ids: torch.Tensor
    """``[B, T]`` long: prompt + completion, then ``pad_id``."""
    attention_mask: torch.Tensor
    """``[B, T]`` long: 1 on the sequence's tokens, 0 on padding."""
    loss_mask: torch.Tensor
    """``[B, T]`` float: 1 where the token is trained."""
    advantages: torch.Tensor
    """``[B, T]`` float: the token's advantage where trained, else 0."""
    sampler_logprobs: torch.Tensor
    """``[B, T]`` float: the sampler's log-probability of the token, NaN where unknown."""
    temperatures: torch.Tensor
    """``[B]`` float: each sequence's sampling temperature."""
    policy_versions: list[int | None]
    top_k: torch.Tensor | None = None
    """``[B]`` long: each sequence's sampling top-k (-1: none)."""
    top_p: torch.Tensor | None = None
    """``[B]`` float: its top-p (1.0: none)."""
    min_p: torch.Tensor | None = None
    """``[B]`` float: its min-p (0.0: none)."""

    @property
    def labels(self) -> torch.Tensor:
        """``[B, T]`` Hugging Face labels (the token id where trained, else -100)."""
        return torch.where(
            self.loss_mask > 0, self.input_ids, torch.full_like(self.input_ids, -100)
        )

    def to(self, device: torch.device | str) -> PaddedBatch:
        """The same batch on ``device``."""
        return PaddedBatch(
            *(t.to(device) for t in (self.input_ids, self.attention_mask, self.loss_mask,
                                     self.advantages, self.sampler_logprobs, self.temperatures)),
            policy_versions=self.policy_versions,
            **{name: None if t is None else t.to(device)
               for name, t in (("top_k", self.top_k), ("top_p", self.top_p),
                               ("min_p", self.min_p))},
        )  # fmt: skip


def pad_rows(
    rows: Sequence[TrainingRow], *, pad_id: int = 0, pad_to_multiple_of: int = 1
) -> PaddedBatch:
    """``rows`` as one right-padded :class:`PaddedBatch`."""
    if not rows:
        raise ValueError("pad_rows: no rows")
    longest = max(len(r.prompt_ids) + len(r.completion_ids) for r in rows)
    width = math.ceil(longest / pad_to_multiple_of) * pad_to_multiple_of
    n = len(rows)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    mask = torch.zeros((n, width))
    adv = torch.zeros((n, width))
    sampler = torch.full((n, width), math.nan)
    for i, row in enumerate(rows):
        tokens = row.tokens
        size = len(tokens)
        row_mask, row_adv, row_sampler = _per_token(row)
        input_ids[i, :size] = torch.tensor(tokens, dtype=torch.long)
        attention[i, :size] = 1
        mask[i, :size] = torch.tensor(row_mask)
        adv[i, :size] = torch.tensor(row_adv)
        sampler[i, :size] = torch.tensor(row_sampler)
    return PaddedBatch(
        input_ids=input_ids,
        attention_mask=attention,
        loss_mask=mask,
        advantages=adv,
        sampler_logprobs=sampler,
        temperatures=torch.tensor([r.temperature for r in rows], dtype=torch.float32),
        policy_versions=[r.policy_version for r in rows],
        top_k=torch.tensor([r.top_k for r in rows], dtype=torch.long),
        top_p=torch.tensor([r.top_p for r in rows], dtype=torch.float32),
        min_p=torch.tensor([r.min_p for r in rows], dtype=torch.float32),
    )


@dataclass
class PackedBatch:
    """Sequences laid end to end in ``R`` rows of ``N`` tokens (see the module docstring)."""

    input_ids: torch.Tensor
    """``[R, N]`` long (rows shorter than ``N`` end in padding that no sequence attends to)."""
    position_ids: torch.Tensor
    """``[R, N]`` long: each sequence's positions restart at 0."""
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    sampler_logprobs: torch.Tensor
    temperatures: torch.Tensor
    """``[R, N]`` float: the temperature of the sequence each token belongs to."""
    seq_lens: list[list[int]]
    """The lengths of the sequences in each row, in order."""
    row_index: list[list[int]]
    """For each row, the index (in the ``rows`` given to :func:`pack_rows`) of each sequence."""
    top_k: torch.Tensor | None = None
    """``[R, N]`` long: the sampling top-k of each token's sequence (-1: none)."""
    top_p: torch.Tensor | None = None
    """``[R, N]`` float: its top-p (1.0: none)."""
    min_p: torch.Tensor | None = None
    """``[R, N]`` float: its min-p (0.0: none)."""

    def attention_mask_4d(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``[R, 1, N, N]`` additive mask: 0 where a token may attend (earlier tokens of its own
        sequence, itself), the dtype's lowest value elsewhere. For eager and SDPA attention."""
        rows, width = self.input_ids.shape
        allowed = torch.zeros((rows, width, width), dtype=torch.bool)
        for r, lens in enumerate(self.seq_lens):
            start = 0
            for length in lens:
                block = torch.ones((length, length), dtype=torch.bool).tril()
                allowed[r, start : start + length, start : start + length] = block
                start += length
            # padding attends to itself only, so no row of the softmax is empty
            for t in range(start, width):
                allowed[r, t, t] = True
        mask = torch.zeros((rows, 1, width, width), dtype=dtype)
        return mask.masked_fill(~allowed.unsqueeze(1), torch.finfo(dtype).min)

    def cu_seqlens(self, row: int = 0) -> torch.Tensor:
        """Cumulative sequence starts of ``row`` (int32), as varlen attention kernels take."""
        return torch.tensor(
            [0, *torch.tensor(self.seq_lens[row]).cumsum(0).tolist()], dtype=torch.int32
        )


def pack_rows(
    rows: Sequence[TrainingRow], *, max_tokens: int | None = None, pad_id: int = 0
) -> PackedBatch:
    """``rows`` packed end to end into rows of at most ``max_tokens`` tokens (first fit, in the
    given order; default: one row holding everything). A sequence longer than ``max_tokens``
    raises ``ValueError``."""
    if not rows:
        raise ValueError("pack_rows: no rows")
    lengths = [len(r.prompt_ids) + len(r.completion_ids) for r in rows]
    limit = max_tokens or sum(lengths)
    if max(lengths) > limit:
        raise ValueError(
            f"pack_rows: a sequence of {max(lengths)} tokens exceeds max_tokens={limit}"
        )
    bins: list[list[int]] = []
    room: list[int] = []
    for i, length in enumerate(lengths):
        for b, free in enumerate(room):
            if free >= length:
                bins[b].append(i)
                room[b] -= length
                break
        else:
            bins.append([i])
            room.append(limit - length)
    width = max(sum(lengths[i] for i in b) for b in bins)
    shape = (len(bins), width)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    positions = torch.zeros(shape, dtype=torch.long)
    mask = torch.zeros(shape)
    adv = torch.zeros(shape)
    sampler = torch.full(shape, math.nan)
    temps = torch.ones(shape)
    top_k = torch.full(shape, -1, dtype=torch.long)
    top_p = torch.ones(shape)
    min_p = torch.zeros(shape)
    for r, members in enumerate(bins):
        start = 0
        for i in members:
            row = rows[i]
            size = lengths[i]
            span = slice(start, start + size)
            row_mask, row_adv, row_sampler = _per_token(row)
            input_ids[r, span] = torch.tensor(row.tokens, dtype=torch.long)
            positions[r, span] = torch.arange(size)
            mask[r, span] = torch.tensor(row_mask)
            adv[r, span] = torch.tensor(row_adv)
            sampler[r, span] = torch.tensor(row_sampler)
            temps[r, span] = row.temperature
            top_k[r, span] = row.top_k
            top_p[r, span] = row.top_p
            min_p[r, span] = row.min_p
            start += size
    return PackedBatch(
        input_ids=input_ids,
        position_ids=positions,
        loss_mask=mask,
        advantages=adv,
        sampler_logprobs=sampler,
        temperatures=temps,
        seq_lens=[[lengths[i] for i in b] for b in bins],
        row_index=bins,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
    )


def token_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    temperatures: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[B, T]`` float32 log-probability of each token given the ones before it.

    Position ``t`` holds ``log p(input_ids[:, t] | input_ids[:, :t])`` from ``logits[:, t - 1]``;
    position 0 (nothing predicts it) is 0. ``temperatures`` (``[B]`` per sequence or ``[B, T]``
    per token, as :class:`PackedBatch` has them) divides the logits first, as the sampler did;
    ``top_k``/``top_p``/``min_p`` (same shapes; the batches' fields of those names) truncate
    and renormalise the distribution as the sampler did (:func:`sampled_logprobs`), so the
    values compare with the log-probabilities a server reports with
    ``--logprobs-mode processed_logprobs``. In a packed row the first token of each sequence
    reads the previous sequence's last logits: its value is meaningless, and :func:`pack_rows`
    never marks it trained (a prompt is never empty).
    """
    scaled = logits[:, :-1].float()
    batch, width, vocab = scaled.shape

    def per_token(values: torch.Tensor | None, default: float) -> torch.Tensor:
        if values is None:
            return torch.full((batch, width), default, device=scaled.device)
        values = values.to(scaled.device)
        return values[:, 1:] if values.dim() == 2 else values.unsqueeze(1).expand(batch, width)

    targets = input_ids[:, 1:].to(scaled.device)
    logp = sampled_logprobs(
        scaled.reshape(-1, vocab),
        targets.reshape(-1),
        per_token(temperatures, 1.0).reshape(-1),
        None if top_k is None else per_token(top_k, -1).reshape(-1),
        None if top_p is None else per_token(top_p, 1.0).reshape(-1),
        None if min_p is None else per_token(min_p, 0.0).reshape(-1),
    ).reshape(batch, width)
    return torch.nn.functional.pad(logp, (1, 0))


#: Rows whose masks are computed at once (a sort of ``[rows, vocab]`` floats and their int64
#: indices: about 600 MB for 1024 rows of a 49k vocabulary).
_MASK_CHUNK = 1024


def _dropped(
    work: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """``[N, V]`` bool, True where vLLM's sampler masks a token of ``work`` (scaled logits, no
    grad), in its order: min-p, top-k, then top-p of what is left.

    min-p keeps ``p >= min_p * p_max``, i.e. a logit ``>= max + log(min_p)``; top-k keeps the
    k-th largest logit and everything tied with it: both are a cut-off per row, one comparison.
    top-p keeps, in descending order, each token whose renormalised mass strictly before it is
    below ``top_p``: a count of positions, so among tokens tied at its edge some stay and some
    go as the sort orders them, and the kept mass (the normaliser) is the sampler's whatever
    the order.
    """
    vocab = work.shape[-1]
    cutoff = torch.full((work.shape[0], 1), float("-inf"), device=work.device)
    use_min_p = min_p > 0
    if bool(use_min_p.any()):
        floor = work.amax(dim=-1, keepdim=True) + torch.log(min_p.clamp(min=1e-38))[:, None]
        cutoff = torch.where(use_min_p[:, None], torch.maximum(cutoff, floor), cutoff)
    use_k = (top_k > 0) & (top_k < vocab)
    if bool(use_k.any()):
        k = torch.where(use_k, top_k, torch.ones_like(top_k))
        kth = work.topk(int(k.max()), dim=-1).values.gather(1, k[:, None] - 1)
        cutoff = torch.where(use_k[:, None], torch.maximum(cutoff, kth), cutoff)
    dropped = work < cutoff
    use_p = top_p < 1
    if bool(use_p.any()):
        rows = slice(None) if bool(use_p.all()) else use_p.nonzero(as_tuple=True)[0]
        if bool(use_k[rows].all()):  # only top-k's survivors (ties included) need ranking
            width = int((~dropped[rows]).sum(dim=-1).max())
            ordered, order = work[rows].topk(width, dim=-1)
        else:
            ordered, order = work[rows].sort(dim=-1, descending=True)
        ordered = ordered.masked_fill(ordered < cutoff[rows], float("-inf"))
        probs = ordered.softmax(dim=-1)
        cut = (probs.cumsum(dim=-1) - probs) >= top_p[rows, None]
        dropped[rows] |= torch.zeros_like(dropped[rows]).scatter(-1, order, cut)
    return dropped


def truncate_logits(
    scaled: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """``scaled`` (``[N, V]`` temperature-scaled logits) with every token outside the support
    a truncating sampler keeps set to -inf, as vLLM (and atropos-serve) truncate: min-p, then
    top-k (ties with the k-th logit kept), then top-p (a token stays while the mass strictly
    before it is below ``top_p``).

    Args:
        top_k, top_p, min_p: ``[N]`` per row (-1/0, 1.0 and 0.0 switch each off); None: off.
        keep: ``[N]`` token ids never masked (the sampled tokens: the sampler kept them, and a
            rounding difference at the edge of the support must not make them impossible).

    The mask is computed without gradient; the kept logits keep theirs, so
    ``log_softmax(truncate_logits(...))`` differentiates as the truncated policy's
    log-probability (the support held fixed).
    """
    rows, vocab = scaled.shape
    none = torch.zeros(rows, device=scaled.device)
    k = top_k.to(scaled.device).long() if top_k is not None else none.long() - 1
    p = top_p.to(scaled.device).float() if top_p is not None else none + 1
    m = min_p.to(scaled.device).float() if min_p is not None else none
    active = ((k > 0) & (k < vocab)) | (p < 1) | (m > 0)
    if not bool(active.any()):
        return scaled
    with torch.no_grad():
        work = scaled.detach().float()
        if bool(active.all()):  # slices, not copies
            spans = [slice(i, i + _MASK_CHUNK) for i in range(0, rows, _MASK_CHUNK)]
            dropped = torch.cat([_dropped(work[s], k[s], p[s], m[s]) for s in spans])
        else:
            dropped = torch.zeros(work.shape, dtype=torch.bool, device=work.device)
            index = active.nonzero(as_tuple=True)[0]
            for start in range(0, int(index.numel()), _MASK_CHUNK):
                part = index[start : start + _MASK_CHUNK]
                dropped[part] = _dropped(work[part], k[part], p[part], m[part])
        if keep is not None:
            dropped.scatter_(1, keep.to(scaled.device).long()[:, None], False)
    return scaled.masked_fill(dropped, float("-inf"))


def sampled_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperatures: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[N]`` float32 log-probability of ``targets`` under the distribution a sampler drew
    them from: ``logits`` (``[N, V]``) divided by ``temperatures`` (values <= 0 count as 1),
    truncated by ``top_k``/``top_p``/``min_p`` (:func:`truncate_logits`, the target always kept)
    and renormalised. This is what ``--logprobs-mode processed_logprobs`` reports for a sampled
    token, so ``exp(sampled_logprobs(...) - sampler_logprob)`` is 1 when the weights did not
    change. Without truncation it is the plain temperature-scaled log-softmax.

    Sampling penalties (repetition, presence, frequency) are not replayed: a server that
    applied them reports log-probabilities no trainer recomputes (``docs/compat.md``).
    """
    scaled = logits.float()
    if temperatures is not None:
        temps = temperatures.to(scaled.device).float()
        temps = torch.where(temps > 0, temps, torch.ones_like(temps))
        scaled = scaled / temps[:, None]
    targets = targets.to(scaled.device)
    scaled = truncate_logits(scaled, top_k, top_p, min_p, keep=targets)
    return -torch.nn.functional.cross_entropy(scaled, targets, reduction="none")
