"""Decode-step kernels for the embedded engine: attention for one query token and an
append-in-place KV cache.

Measured on the 2-core development machine with SmolLM2-135M in bf16 (in one process,
alternating between variants; a batch of 32 rows, ~100 cached positions):

* For a single query token ``transformers``' sdpa attention folds the query heads of a
  grouped-query model onto their key/value heads when the batch has padding, but with no
  padding at all (every row the same length, e.g. the ``n`` samples of one prompt) it asks
  PyTorch for ``enable_gqa``, whose CPU kernel is slow: that made the whole decode step
  ~1.7× slower than the folded form. :func:`decode_attention` always folds.
* ``DynamicCache`` appends a token by concatenating the whole cache into a new tensor, every
  layer, every step; with a few hundred cached positions the copy and the page faults of
  allocating a fresh block each time were up to a third of the step. :class:`AppendLayer`
  keeps spare positions and writes new tokens into them in place.

Prefill (more than one query token) and anything unusual (sliding windows, soft-capping,
attention sinks) go to ``transformers``' own sdpa code unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

#: Name under which :func:`decode_attention` is registered with ``transformers``.
ATTENTION_NAME = "atropos_decode"

#: Spare positions an :class:`AppendLayer` allocates beyond what it holds.
HEADROOM = 64

# Arguments with which the plain formula below would not match what the model expects.
_SPECIAL_KWARGS = ("sliding_window", "softcap", "s_aux", "sinks", "position_bias")


def decode_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention with ``transformers``' signature: folded for one query token, else sdpa.

    ``query`` is ``(batch, heads, q_len, dim)``, ``key``/``value`` are
    ``(batch, kv_heads, kv_len, dim)``; the result is ``(batch, q_len, heads, dim)``.
    """
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    if (
        q_len != 1
        or module.training
        or heads % kv_heads
        or any(kwargs.get(name) is not None for name in _SPECIAL_KWARGS)
    ):
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    # The query heads that share a key/value head become the query rows of one attention
    # call on that head: keys and values are never repeated, and with no mask at all sdpa
    # is not asked for its slow ``enable_gqa`` path.
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim)
    mask = attention_mask
    if mask is not None:
        mask = mask[..., -key.shape[-2] :]
        if mask.shape[1] != 1:  # a mask per head: its rows follow the grouping
            mask = mask.reshape(mask.shape[0], kv_heads, heads // kv_heads, mask.shape[-1])
    out = torch.nn.functional.scaled_dot_product_attention(
        grouped, key, value, attn_mask=mask, scale=scaling
    )  # (batch, kv_heads, group, dim)
    return out.reshape(batch, heads, 1, dim).transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION_NAME, decode_attention)
# The same masks as sdpa: boolean, or none at all when nothing needs masking.
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def use_decode_attention(model: PreTrainedModel) -> bool:
    """Switch ``model`` to :func:`decode_attention` where it runs on ``sdpa``; True if it did.

    Models on another implementation (eager-only architectures, flash attention on a GPU)
    are left alone.
    """
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    try:
        model.set_attn_implementation(ATTENTION_NAME)
    except (ValueError, ImportError):
        return False
    return True


class AppendLayer(DynamicLayer):
    """A ``DynamicLayer`` that appends new tokens in place into spare columns.

    ``keys``/``values`` are views of the first ``length`` positions of a larger buffer. When
    the buffer is full, or when someone replaced ``keys`` (``batch_select_indices``, the
    engine trimming padding), the next update copies into a new buffer with
    :data:`HEADROOM` spare positions; every other update writes one column.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None
        self._key_view: torch.Tensor | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``key_states``/``value_states`` and return all keys and values."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, values = self.keys, self.values
        assert keys is not None and values is not None
        length = keys.shape[-2] if keys.dim() == 4 else 0
        new = key_states.shape[-2]
        buffer = self._key_buffer
        if (
            buffer is None
            or keys is not self._key_view
            or length + new > buffer.shape[-2]
            or buffer.shape[0] != key_states.shape[0]
        ):
            batch, kv_heads, _, dim = key_states.shape
            shape = (batch, kv_heads, length + new + HEADROOM, dim)
            key_buffer = key_states.new_empty(shape)
            value_buffer = value_states.new_empty(shape[:-1] + (value_states.shape[-1],))
            if length:
                key_buffer[:, :, :length] = keys
                value_buffer[:, :, :length] = values
            self._key_buffer, self._value_buffer = key_buffer, value_buffer
        assert self._key_buffer is not None and self._value_buffer is not None
        self._key_buffer[:, :, length : length + new] = key_states
        self._value_buffer[:, :, length : length + new] = value_states
        self.keys = self._key_view = self._key_buffer[:, :, : length + new]
        self.values = self._value_buffer[:, :, : length + new]
        return self.keys, self.values

    def reset(self) -> None:
        """Forget the cached positions and the buffers."""
        self._key_buffer = self._value_buffer = self._key_view = None
        super().reset()


def append_cache(layers: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> DynamicCache:
    """A ``DynamicCache`` of :class:`AppendLayer`\\ s: empty (filled by a forward pass), or
    holding the given ``(keys, values)`` of every layer."""
    cache = DynamicCache()
    if layers is None:
        cache.layer_class_to_replicate = AppendLayer
        return cache
    cache.layers = []
    for keys, values in layers:
        layer = AppendLayer()
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
        cache.layers.append(layer)
    return cache


def _buffered_layer(
    key_buffer: torch.Tensor, value_buffer: torch.Tensor, width: int
) -> AppendLayer:
    """An :class:`AppendLayer` over buffers whose first ``width`` positions are filled: the
    next token is written in place."""
    layer = AppendLayer()
    keys, values = key_buffer[:, :, :width], value_buffer[:, :, :width]
    layer.lazy_initialization(keys, values)
    layer._key_buffer, layer._value_buffer = key_buffer, value_buffer
    layer.keys = layer._key_view = keys
    layer.values = values
    return layer


def stack_right_aligned(
    tensors: list[torch.Tensor], width: int, spare: int = HEADROOM
) -> torch.Tensor:
    """The rows of ``tensors`` (each ``(rows, heads, length, dim)``), in order, in one new
    buffer of ``width + spare`` positions, each right-aligned to ``width`` with zeros on the
    left (masked padding must be finite); the ``spare`` positions are left unwritten."""
    first = tensors[0]
    rows = sum(t.shape[0] for t in tensors)
    buffer = first.new_empty((rows, first.shape[1], width + spare, first.shape[3]))
    row = 0
    for tensor in tensors:
        n, length = tensor.shape[0], tensor.shape[2]
        if length < width:
            buffer[row : row + n, :, : width - length].zero_()
        buffer[row : row + n, :, width - length : width].copy_(tensor)
        row += n
    return buffer


def gather_rows(
    tensor: torch.Tensor, index: torch.Tensor, leading: int, width: int, spare: int = HEADROOM
) -> torch.Tensor:
    """Rows ``index`` of ``tensor`` ``(rows, heads, positions, dim)``, positions ``leading`` to
    ``leading + width``, gathered straight into a new buffer of ``width + spare`` positions
    (one copy; the ``spare`` positions are left unwritten)."""
    shape = (len(index), tensor.shape[1], width + spare, tensor.shape[3])
    buffer = tensor.new_empty(shape)
    torch.index_select(tensor[:, :, leading : leading + width], 0, index, out=buffer[:, :, :width])
    return buffer


def stacked_append_cache(
    parts: list[list[tuple[torch.Tensor, torch.Tensor]]], width: int
) -> DynamicCache:
    """One append cache whose rows are those of ``parts`` (each a list of ``(keys, values)``
    per layer), in order, each right-aligned to ``width`` positions with zeros on the left
    (masked padding must be finite), with :data:`HEADROOM` spare positions: one copy of every
    row, where concatenating and re-buffering made two."""
    cache = DynamicCache()
    cache.layers = []
    for per_part in zip(*parts, strict=True):
        kbuf = stack_right_aligned([keys for keys, _ in per_part], width)
        vbuf = stack_right_aligned([values for _, values in per_part], width)
        cache.layers.append(_buffered_layer(kbuf, vbuf, width))
    return cache


def select_rows(cache: DynamicCache, index: torch.Tensor, leading: int) -> None:
    """Keep rows ``index`` of every layer of append cache ``cache`` and drop its first
    ``leading`` positions, gathered straight into new buffers with :data:`HEADROOM` spare
    positions (one copy; selecting, trimming and re-buffering made three)."""
    for i, layer in enumerate(cache.layers):
        width = layer.keys.shape[2] - leading
        kbuf = gather_rows(layer.keys, index, leading, width)
        vbuf = gather_rows(layer.values, index, leading, width)
        cache.layers[i] = _buffered_layer(kbuf, vbuf, width)
