"""A running batch whose rows share their prompt's keys and values: the lean decode step's cache.

A request for ``n`` samples becomes ``n`` rows of the batch that differ only in what they
generate. The left-padded batch cache (:mod:`.attention`) holds the prompt's keys and values
once per row: copied ``n`` times when the request joins, copied again whenever the batch takes
new rows or drops finished ones, and read ``n`` times by every decode step. For an RL
environment's load (GRPO groups of 16, ~100-token prompts, replies of a few tokens) that
prompt part is nearly all of the cache. :class:`GroupedBatch` keeps two levels instead:

* the **prompts**, one entry per request (left-padded to the longest prompt), and
* each row's **own** keys and values: the tokens it generated (left-padded to the row that has
  generated the most).

Attention for one new token per row runs over both and joins them exactly: each part returns
its weighted sum of values with weights ``exp(s - m)`` relative to its largest score ``m``,
and the sum of those weights; rescaled to the larger of the two maxima, the two sums divided
by the two weight totals are the softmax over all keys (as flash attention joins blocks).
The query heads of the rows of one request (and of one key/value head) are the query rows of
one multiply with that request's prompt keys, so the prompt is read once per request, not
once per row.

Both parts are computed in float32 (scores, softmax and sums), as PyTorch's own CPU attention
kernel accumulates; the result differs from ``transformers``' single sdpa call only by that
kernel's rounding (in a bfloat16 model it rounds probabilities to bfloat16 before multiplying
with the values): float32 models agree to ~1e-6 in the logits, bfloat16 models as closely as
two bfloat16 batches of different composition do (measured against a float32 reference: the
same mean error). The prompts are stored in float32 (converted once, not at every step); the
rows' generated tokens in the model's dtype, converted while they are few and otherwise
attended by PyTorch's flash kernel. With two or more samples per request this takes no more
memory than the per-row layout it replaces (each prompt is held once instead of ``n`` times).

Measured on the 2-core development machine (SmolLM2-135M in bf16, 2 threads): one decode step
of 12 requests x 16 rows with 105-token prompts 277 -> 216 ms (1.28x), attention of one layer
~2.2 -> ~0.85 ms; the engine on arithmetic-learn's load 1.18x the groups/s; with one sample per
request the step is ~11% slower, so the engine keeps the per-row layout there
(``bench/README.md``, "Prompts once per request").
"""

from __future__ import annotations

import torch

from . import native as native_kernels
from .attention import gather_rows, stack_right_aligned

#: Spare generated positions each row's own keys and values are allocated with.
OWN_HEADROOM = 16

#: Rows' generated keys and values in a dtype other than float32 are converted for plain
#: float32 multiplies up to this many (rows x positions) per layer, and go through PyTorch's
#: flash attention kernel in their own dtype beyond (long replies), where converting them at
#: every step would cost more than the attention.
MANUAL_MAX_POSITIONS = 2048

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _part(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention of ``query`` ``(b, kv_heads, q, dim)`` (already scaled) over ``keys``/
    ``values`` ``(b, kv_heads, k, dim)`` with additive ``bias`` ``(b, 1, 1, k)`` (0 or -inf;
    None: nothing masked), float32 throughout and not yet normalised:
    ``(sum_j exp(s_j - m) v_j, m, sum_j exp(s_j - m))`` with ``m`` the largest score (the last
    two ``(b, kv_heads, q, 1)``)."""
    scores = torch.matmul(query, keys.transpose(-1, -2))
    if bias is not None:
        scores.add_(bias)
    top = scores.amax(dim=-1, keepdim=True)
    weights = scores.sub_(top).exp_()
    return torch.matmul(weights, values), top, weights.sum(dim=-1, keepdim=True)


def _own_part(
    query: torch.Tensor,
    native_query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_part` over the rows' generated keys and values, stored in the model's dtype:
    converted to float32 while they are few, else PyTorch's flash kernel on ``native_query``
    (unscaled, the model's dtype), whose normalised output and log-sum-exp are the same
    triple with a weight total of 1."""
    if keys.dtype == torch.float32 or keys.shape[0] * keys.shape[2] <= MANUAL_MAX_POSITIONS:
        return _part(query, keys.float(), values.float(), bias)
    mask = None
    if bias is not None:
        mask = bias.to(keys.dtype).expand(-1, -1, native_query.shape[2], -1)
    out, lse = _flash(native_query, keys, values, 0.0, False, attn_mask=mask, scale=scale)
    lse = lse.unsqueeze(-1)
    return out.float(), lse, torch.ones_like(lse)


class GroupedBatch:
    """The keys and values of the running batch, prompts stored once per request.

    Built from a prefill's cache with :meth:`from_prefill`, joined with :meth:`merge`, cut
    to the rows still running with :meth:`keep`; a decode step calls :meth:`positions`,
    :meth:`begin_step`, :meth:`attend` once per layer, then :meth:`end_step`.
    :meth:`to_padded` gives the left-padded per-row layout the model's own forward pass reads.
    """

    def __init__(
        self,
        prompt_keys: list[torch.Tensor],
        prompt_values: list[torch.Tensor],
        prompt_mask: torch.Tensor,
        group: torch.Tensor,
        sample: torch.Tensor,
        own_keys: list[torch.Tensor],
        own_values: list[torch.Tensor],
        own_mask: torch.Tensor,
    ) -> None:
        self.prompt_keys = prompt_keys
        """Per layer ``(requests, kv_heads, prompt_width, dim)`` float32, left-padded."""
        self.prompt_values = prompt_values
        self.prompt_mask = prompt_mask
        """``(requests, prompt_width)`` bool: True for a prompt's real positions."""
        self.group = group
        """``(rows,)``: the request (prompt entry) of each row."""
        self.sample = sample
        """``(rows,)``: each row's slot within its request (its sample index)."""
        self.own_keys = own_keys
        """Per layer ``(rows, kv_heads, capacity, dim)`` buffers in the model's dtype; the
        first ``own_width`` positions hold the generated tokens' keys, left-padded."""
        self.own_values = own_values
        self.own_mask = own_mask
        """``(rows, own_width)`` bool: True for a row's generated positions."""
        self._refresh()

    # ------------------------------------------------------------------ building

    @classmethod
    def from_prefill(
        cls,
        layers: list[tuple[torch.Tensor, torch.Tensor]],
        mask: torch.Tensor,
        rows_per_prompt: list[int],
    ) -> GroupedBatch:
        """Rows for the prompts a prefill just ran: ``layers`` holds per layer the keys and
        values ``(prompts, kv_heads, width, dim)`` of left-padded prompts whose real positions
        ``mask`` ``(prompts, width)`` marks; prompt ``i`` gets ``rows_per_prompt[i]`` rows."""
        counts = torch.tensor(rows_per_prompt, dtype=torch.long)
        group = torch.repeat_interleave(torch.arange(len(rows_per_prompt)), counts)
        starts = torch.cumsum(counts, 0) - counts
        sample = torch.arange(len(group)) - torch.repeat_interleave(starts, counts)
        # float32 copies (the views a prefill returns may point into larger buffers)
        keys = [
            k.to(torch.float32, copy=True, memory_format=torch.contiguous_format) for k, _ in layers
        ]
        values = [
            v.to(torch.float32, copy=True, memory_format=torch.contiguous_format) for _, v in layers
        ]
        rows = len(group)
        own_keys, own_values = [], []
        for k, _ in layers:
            shape = (rows, k.shape[1], OWN_HEADROOM, k.shape[3])
            own_keys.append(k.new_empty(shape))
            own_values.append(k.new_empty(shape))
        own_mask = torch.zeros((rows, 0), dtype=torch.bool)
        return cls(keys, values, mask.bool(), group, sample, own_keys, own_values, own_mask)

    def merge(self, other: GroupedBatch) -> None:
        """Append ``other``'s requests and rows after this batch's (one copy of each level,
        both left-padded to the wider side)."""
        requests = self.prompt_mask.shape[0]
        p_width = max(self.prompt_mask.shape[1], other.prompt_mask.shape[1])
        self.prompt_keys = [
            stack_right_aligned([a, b], p_width, spare=0)
            for a, b in zip(self.prompt_keys, other.prompt_keys, strict=True)
        ]
        self.prompt_values = [
            stack_right_aligned([a, b], p_width, spare=0)
            for a, b in zip(self.prompt_values, other.prompt_values, strict=True)
        ]
        self.prompt_mask = torch.cat(
            [_pad_mask(self.prompt_mask, p_width), _pad_mask(other.prompt_mask, p_width)]
        )
        o_width = max(self.own_width, other.own_width)
        for mine, theirs in ((self.own_keys, other.own_keys), (self.own_values, other.own_values)):
            for layer, (a, b) in enumerate(zip(mine, theirs, strict=True)):
                mine[layer] = stack_right_aligned(
                    [a[:, :, : self.own_width], b[:, :, : other.own_width]],
                    o_width,
                    spare=OWN_HEADROOM,
                )
        self.own_mask = torch.cat(
            [_pad_mask(self.own_mask, o_width), _pad_mask(other.own_mask, o_width)]
        )
        self.group = torch.cat([self.group, other.group + requests])
        self.sample = torch.cat([self.sample, other.sample])
        self._refresh()

    def keep(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` (in that order); drop generated positions no row needs and the
        prompts of requests with no row left."""
        mask = self.own_mask[index]
        leading = _leading_padding(mask)
        width = mask.shape[1] - leading
        for buffers in (self.own_keys, self.own_values):
            for layer, old in enumerate(buffers):
                buffers[layer] = gather_rows(old, index, leading, width, spare=OWN_HEADROOM)
        self.own_mask = mask[:, leading:]
        self.group = self.group[index]
        self.sample = self.sample[index]
        self._refresh()
        self._drop_finished_prompts()

    def _drop_finished_prompts(self) -> None:
        """Forget the prompts no row uses any more (and padding no prompt needs)."""
        used = torch.zeros(self.prompt_mask.shape[0], dtype=torch.bool)
        used[self.group] = True
        if bool(used.all()):
            return
        index = used.nonzero().squeeze(1)
        mask = self.prompt_mask[index]
        leading = _leading_padding(mask)
        self.prompt_keys = [k[index, :, leading:].contiguous() for k in self.prompt_keys]
        self.prompt_values = [v[index, :, leading:].contiguous() for v in self.prompt_values]
        self.prompt_mask = mask[:, leading:]
        remap = torch.full((len(used),), -1, dtype=torch.long)
        remap[index] = torch.arange(len(index))
        self.group = remap[self.group]
        self._refresh()

    def _refresh(self) -> None:
        """Recompute what the decode step derives from the layout."""
        self.own_width = int(self.own_mask.shape[1])
        self.slots = int(self.sample.max()) + 1 if len(self.sample) else 1
        self._prompt_bias = _bias(self.prompt_mask)
        self._prompt_bytes = None if self._prompt_bias is None else self.prompt_mask.to(torch.uint8)
        self._prompt_lengths = self.prompt_mask.sum(dim=1)

    # ------------------------------------------------------------------ decoding

    @property
    def rows(self) -> int:
        """Rows in the batch."""
        return int(self.group.shape[0])

    def positions(self) -> torch.Tensor:
        """``(rows, 1)``: the position of each row's next token."""
        return (self._prompt_lengths[self.group] + self.own_mask.sum(dim=1))[:, None]

    def begin_step(self) -> None:
        """Make room for one more generated position in every row (before the layers run)."""
        width = self.own_width
        if width + 1 > self.own_keys[0].shape[2]:
            for buffers in (self.own_keys, self.own_values):
                for layer, old in enumerate(buffers):
                    new = old.new_empty(old.shape[:2] + (width + 1 + OWN_HEADROOM, old.shape[3]))
                    new[:, :, :width] = old[:, :, :width]
                    buffers[layer] = new
        self.own_mask = torch.cat(
            [self.own_mask, torch.ones((self.rows, 1), dtype=torch.bool)], dim=1
        )
        self._own_bias = _bias(self.own_mask)
        self._own_bytes = self.own_mask.to(torch.uint8)

    def end_step(self) -> None:
        """The step's token is in every layer: count it."""
        self.own_width += 1

    def attend(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
        native: bool = False,
    ) -> torch.Tensor:
        """Store the new token's ``key``/``value`` ``(rows, kv_heads, 1, dim)`` in ``layer`` and
        return attention of ``query`` ``(rows, heads, 1, dim)`` over the row's prompt and
        generated tokens, ``(rows, heads, dim)`` in the query's dtype. ``native``: both parts
        in one call of the C kernel (:func:`.native.attend`, the prompt as a segment the
        request's rows share) instead of PyTorch's matrix products joined in Python."""
        width = self.own_width
        own_k, own_v = self.own_keys[layer], self.own_values[layer]
        own_k[:, :, width] = key[:, :, 0]
        own_v[:, :, width] = value[:, :, 0]
        rows, heads, _, dim = query.shape
        kv_heads = key.shape[1]
        per_kv = heads // kv_heads
        if native:
            # One C call per layer: each row against its request's prompt (shared, float32)
            # and its own generated tokens, one softmax over both.
            segments = [
                native_kernels.Segment(
                    self.prompt_keys[layer],
                    self.prompt_values[layer],
                    self._prompt_bytes,
                    self.group,
                ),
                native_kernels.Segment(
                    own_k[:, :, : width + 1],
                    own_v[:, :, : width + 1],
                    None if self._own_bias is None else self._own_bytes,
                ),
            ]
            out, _ = native_kernels.attend(
                query.reshape(rows, kv_heads, per_kv, dim), segments, scale
            )
            return out.reshape(rows, heads, dim).to(query.dtype)
        q = query.reshape(rows, kv_heads, per_kv, dim).float().mul_(scale)
        # The prompt part: one multiply per request and key/value head, its rows' query heads
        # side by side (a slot per sample; slots of finished rows are zeros, never read back).
        requests, slots = self.prompt_mask.shape[0], self.slots
        grouped = q.new_zeros((requests, kv_heads, slots, per_kv, dim))
        grouped.permute(0, 2, 1, 3, 4)[self.group, self.sample] = q
        out_p, top_p, sum_p = _part(
            grouped.view(requests, kv_heads, slots * per_kv, dim),
            self.prompt_keys[layer],
            self.prompt_values[layer],
            self._prompt_bias,
        )
        out_p, top_p, sum_p = (
            t.view(requests, kv_heads, slots, per_kv, t.shape[-1]).permute(0, 2, 1, 3, 4)[
                self.group, self.sample
            ]
            for t in (out_p, top_p, sum_p)
        )
        out_o, top_o, sum_o = _own_part(
            q,
            query.reshape(rows, kv_heads, per_kv, dim),
            own_k[:, :, : width + 1],
            own_v[:, :, : width + 1],
            self._own_bias,
            scale,
        )
        # Both parts rescaled to the larger of their two maxima, then normalised together.
        top = torch.maximum(top_p, top_o)
        scale_p, scale_o = top_p.sub_(top).exp_(), top_o.sub_(top).exp_()
        out = out_p.mul_(scale_p).add_(out_o.mul_(scale_o))
        out = out.div_(sum_p.mul_(scale_p).add_(sum_o.mul_(scale_o)))
        return out.reshape(rows, heads, dim).to(query.dtype)

    # ------------------------------------------------------------------ other layouts

    def to_padded(
        self, dtype: torch.dtype
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """Per layer ``(rows, kv_heads, width, dim)`` keys and values of every row (its
        prompt, then what it generated) in ``dtype``, left-padded with zeros, and the
        ``(rows, width)`` 0/1 attention mask: the layout of the engine's per-row cache."""
        p_width, o_width = self.prompt_mask.shape[1], self.own_width
        width = p_width + o_width
        layers = []
        for pk, pv, ok, ov in zip(
            self.prompt_keys, self.prompt_values, self.own_keys, self.own_values, strict=True
        ):
            keys = pk.new_zeros((self.rows, pk.shape[1], width, pk.shape[3]), dtype=dtype)
            values = torch.zeros_like(keys)
            keys[:, :, :p_width] = pk[self.group]
            values[:, :, :p_width] = pv[self.group]
            keys[:, :, p_width:] = ok[:, :, :o_width]
            values[:, :, p_width:] = ov[:, :, :o_width]
            layers.append((keys, values))
        mask = torch.cat([self.prompt_mask[self.group], self.own_mask[:, :o_width]], dim=1)
        return layers, mask.long()


def _bias(mask: torch.Tensor) -> torch.Tensor | None:
    """The additive float32 mask ``(rows, 1, 1, width)`` for a bool mask (0 where True,
    -inf where False); None when nothing is masked."""
    if bool(mask.all()):
        return None
    bias = torch.zeros(mask.shape, dtype=torch.float32)
    return bias.masked_fill_(~mask, float("-inf"))[:, None, None, :]


def _leading_padding(mask: torch.Tensor) -> int:
    """Columns on the left of ``mask`` ``(rows, width)`` that are padding in every row."""
    return int((~mask).all(dim=0).cumprod(dim=0).sum()) if mask.shape[1] else 0


def _pad_mask(mask: torch.Tensor, width: int) -> torch.Tensor:
    missing = width - mask.shape[1]
    if missing == 0:
        return mask
    return torch.cat([mask.new_zeros((mask.shape[0], missing)), mask], dim=1)
