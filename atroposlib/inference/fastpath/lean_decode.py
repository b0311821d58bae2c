"""A lean decode step for Llama-architecture models on the CPU.

One decode step of a small model is dozens of tiny operations per layer, and on the CPU the
Python around them (``nn.Module`` calls, ``transformers``' output capturing, mask building,
keyword plumbing) costs about as much as the arithmetic. :class:`LeanDecoder` runs the same
step as ``LlamaForCausalLM`` for one new token per row with that overhead stripped: a plain
loop over the layers, the mask built once per step instead of per call, and the query/key/
value projections and the gate/up projections each fused into one prepacked multiply (five
multiplies per layer become two). The arithmetic is the model's own, in the same order, so
the logits are bit-identical to the ``transformers`` forward pass, except for the attention
when it runs on the C kernel (:mod:`.native`, the default where it builds): that attention is
computed in float32 and returned in float32, within float32 rounding of the model's.

Measured on the 2-core development machine with SmolLM2-135M in bf16, one decode step
alternating between the two paths in one process: 1.35x faster at batch 1 (27.0 -> 19.9
ms), 1.27x at 8, 1.13x at 32.

It applies only where it is exactly the model's computation: the Llama architecture and its
close relatives (``llama``, ``mistral``, ``qwen2``, ``qwen3``) with SiLU MLPs, full attention
(no sliding window) and the engine's single-token attention, on the CPU in a dtype with prepacked
kernels (:mod:`atroposlib.inference.fastpath.packed_linear`); :func:`LeanDecoder.build` returns None
for anything else, and the engine keeps the ``transformers`` forward pass. Prefill (many
tokens per row) always uses the ``transformers`` forward pass.

The fused matrices are the model's own packed ones (:class:`~.packed_linear.FusedLinears`,
which prefill multiplies with too); a model whose weights are changed in place afterwards is
noticed (:meth:`LeanDecoder.current`) and the engine falls back to the ``transformers`` path
for it until they are re-packed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache

from . import native
from .attention import ATTENTION_NAME
from .grouped import GroupedBatch
from .packed_linear import fused_group, is_packed, packing_supported

# Architectures whose decoder layer is Llama's (Qwen2 adds biases to q/k/v, Qwen3 normalises
# q and k per head); all with full attention only.
_SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# torch's module and transformers' (``ACT2FN["silu"]``), both ``F.silu``.
_SILU_CLASSES = ("SiLU", "SiLUActivation")


def _linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class _Unsupported(Exception):
    pass


@dataclass
class _Layer:
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    qk_eps: float
    input_norm: torch.Tensor
    input_eps: float
    post_norm: torch.Tensor
    post_eps: float
    scaling: float


def _rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``LlamaRMSNorm.forward``, operation for operation."""
    x = hidden.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(hidden.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LeanDecoder:
    """The decode step of one Llama-architecture model, without ``transformers``' overhead.

    Build it with :meth:`build` (None when the model is not supported) and call it with one
    token per row; see the module docstring for what it does and where it applies.
    """

    def __init__(self, model: PreTrainedModel, layers: list[_Layer]) -> None:
        config = model.config
        self.model = model
        self.layers = layers
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.intermediate = config.intermediate_size
        inner = model.model  # type: ignore[attr-defined]
        self._embed = inner.embed_tokens
        self._rotary = inner.rotary_emb
        self._final_norm = inner.norm.weight
        self._final_eps = float(inner.norm.variance_epsilon)
        self._lm_head = model.lm_head  # type: ignore[attr-defined]
        self.native_attention = False
        """Attend with the C kernel (:func:`.native.decode_attention`) instead of PyTorch's
        sdpa: set by :func:`~atroposlib.inference.fastpath.prepare` where it applies. The
        logits are then no longer bit-identical to the ``transformers`` forward pass, only as
        close as float32 attention is (closer to a float32 reference than bfloat16 sdpa)."""
        # Every weight the fused copies were made from, with its version at build time.
        self._sources = [(p, None if p.is_inference() else p._version) for p in model.parameters()]

    @classmethod
    def build(cls, model: PreTrainedModel) -> LeanDecoder | None:
        """A decoder for ``model``, or None where it would not be exactly the model's step."""
        return cls.try_build(model)[0]

    @classmethod
    def try_build(cls, model: PreTrainedModel) -> tuple[LeanDecoder | None, str]:
        """:meth:`build`, with why not: ``(decoder, "")`` or ``(None, reason)``."""
        try:
            return cls(model, cls._fuse(model)), ""
        except _Unsupported as exc:
            return None, str(exc)

    @staticmethod
    def _fuse(model: PreTrainedModel) -> list[_Layer]:
        config = model.config
        if getattr(config, "model_type", None) not in _SUPPORTED_MODEL_TYPES:
            raise _Unsupported(f"model type {getattr(config, 'model_type', None)!r}")
        if getattr(config, "_attn_implementation", None) != ATTENTION_NAME:
            raise _Unsupported("the model does not run on the engine's decode attention")
        if getattr(config, "hidden_act", None) != "silu":
            raise _Unsupported("only SiLU MLPs")
        if getattr(config, "pretraining_tp", 1) not in (None, 1):
            raise _Unsupported("pretraining_tp > 1")
        if config.model_type == "mistral" and getattr(config, "sliding_window", None) is not None:
            raise _Unsupported("sliding-window attention")
        inner = getattr(model, "model", None)
        lm_head = getattr(model, "lm_head", None)
        if inner is None or not is_packed(lm_head) or not hasattr(inner, "rotary_emb"):
            raise _Unsupported("unexpected module layout, or weights not packed")
        dtype = lm_head.weight.dtype  # type: ignore[union-attr]
        if not packing_supported(dtype):
            raise _Unsupported(f"no packed kernels for {dtype}")
        layers = []
        with torch.no_grad():
            for layer in inner.layers:
                attn, mlp = layer.self_attn, layer.mlp
                projections = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)
                projections += (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
                if not all(is_packed(p) and p.weight.device.type == "cpu" for p in projections):
                    raise _Unsupported("a projection is not a packed CPU linear layer")
                if type(mlp.act_fn).__name__ not in _SILU_CLASSES:
                    raise _Unsupported("only SiLU MLPs")
                if getattr(attn, "sliding_window", None) is not None:
                    raise _Unsupported("sliding-window attention")
                q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
                if (q_norm is None) != (k_norm is None):
                    raise _Unsupported("a norm on queries or keys only")
                qkv = fused_group(attn.q_proj, attn.k_proj, attn.v_proj)
                gate_up = fused_group(mlp.gate_proj, mlp.up_proj)
                if qkv is None or gate_up is None:
                    raise _Unsupported("the q/k/v or gate/up projections are not packed fused")
                layers.append(
                    _Layer(
                        qkv=qkv.packed,
                        qkv_bias=qkv.bias,
                        o=attn.o_proj._atropos_packed,
                        o_bias=attn.o_proj.bias,
                        gate_up=gate_up.packed,
                        gate_up_bias=gate_up.bias,
                        down=mlp.down_proj._atropos_packed,
                        down_bias=mlp.down_proj.bias,
                        q_norm=None if q_norm is None else q_norm.weight,
                        k_norm=None if k_norm is None else k_norm.weight,
                        qk_eps=float(q_norm.variance_epsilon) if q_norm is not None else 0.0,
                        input_norm=layer.input_layernorm.weight,
                        input_eps=float(layer.input_layernorm.variance_epsilon),
                        post_norm=layer.post_attention_layernorm.weight,
                        post_eps=float(layer.post_attention_layernorm.variance_epsilon),
                        scaling=float(attn.scaling),
                    )
                )
        return layers

    def refresh_in_place(self) -> bool:
        """After the model's weights were changed in place (same shapes and dtype) and its
        packed copies rewritten where they are (:func:`~.packed_linear.repack_in_place`, which
        refreshes every matrix this step multiplies with: the fused query/key/value and
        gate/up ones and the output, down and LM-head projections), count the new weights as
        current. False (nothing changed) when the model's layout no longer fits: build a new
        decoder."""
        inner = self.model.model  # type: ignore[attr-defined]
        if len(inner.layers) != len(self.layers):
            return False
        for layer, fused in zip(inner.layers, self.layers, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            qkv = fused_group(attn.q_proj, attn.k_proj, attn.v_proj)
            gate_up = fused_group(mlp.gate_proj, mlp.up_proj)
            if (
                qkv is None
                or gate_up is None
                or qkv.packed is not fused.qkv
                or gate_up.packed is not fused.gate_up
                or not (qkv.current() and gate_up.current())
                or getattr(attn.o_proj, "_atropos_packed", None) is not fused.o
                or getattr(mlp.down_proj, "_atropos_packed", None) is not fused.down
            ):
                return False
        self._sources = [
            (p, None if p.is_inference() else p._version) for p in self.model.parameters()
        ]
        return True

    def native_attention_applies(self) -> tuple[bool, str]:
        """Whether :func:`.native.decode_attention` can attend for this model: ``(True, "")``
        or ``(False, why not)``."""
        return native.supports(self._final_norm.dtype, self.head_dim, self.heads // self.kv_heads)

    def current(self) -> bool:
        """False once any of the model's weights was changed in place after :meth:`build`."""
        return all(version is None or p._version == version for p, version in self._sources)

    def __call__(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: DynamicCache,
    ) -> torch.Tensor:
        """Logits ``(batch, vocab)`` for ``input_ids`` ``(batch, 1)``, appending to ``cache``.

        ``attention_mask`` is the engine's ``(batch, cached + 1)`` 0/1 mask (0 for padding);
        ``position_ids`` is ``(batch, 1)``.
        """
        batch = input_ids.shape[0]
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        everywhere = bool(attention_mask.all())
        if self.native_attention:
            # the mask as bytes once per step, not once per layer
            rows = None if everywhere else attention_mask.to(torch.uint8).contiguous()

            def attend(
                index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
            ) -> torch.Tensor:
                keys, values = cache.layers[index].update(k, v)
                grouped = q.reshape(batch, kv_heads, heads // kv_heads, dim)
                out, _ = native.decode_attention(grouped, keys, values, rows, scale)
                return out.to(q.dtype)

            return self._step(input_ids, position_ids, attend)

        # As transformers' sdpa mask: none at all when nothing is padding.
        mask = None if everywhere else attention_mask.bool()[:, None, None, :]
        sdpa = nn.functional.scaled_dot_product_attention

        def attend(
            index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
        ) -> torch.Tensor:
            keys, values = cache.layers[index].update(k, v)
            # One query token: the query heads sharing a key/value head are the query rows of
            # one attention call on it (as :func:`~.attention.decode_attention`).
            grouped = q.reshape(batch, kv_heads, heads // kv_heads, dim)
            return sdpa(grouped, keys, values, attn_mask=mask, scale=scale)

        return self._step(input_ids, position_ids, attend)

    def decode_grouped(self, input_ids: torch.Tensor, batch: GroupedBatch) -> torch.Tensor:
        """Logits ``(rows, vocab)`` for ``input_ids`` ``(rows, 1)``, the rows of ``batch``
        (prompts stored once per request, :mod:`.grouped`), appending the new token to it.

        The same step as :meth:`__call__` but for the attention, which joins the prompt and
        generated parts exactly (not bit for bit: see :mod:`.grouped`)."""
        positions = batch.positions()
        batch.begin_step()
        native_attention = self.native_attention

        def attend(
            index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
        ) -> torch.Tensor:
            return batch.attend(index, q, k, v, scale, native=native_attention)

        logits = self._step(input_ids, positions, attend)
        batch.end_step()
        return logits

    def _step(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor],
    ) -> torch.Tensor:
        """The decode step around ``attend(layer, q, k, v, scale)``, which stores the new
        keys and values and returns the attention output (any shape holding
        ``(batch, heads, dim)`` in that order)."""
        batch = input_ids.shape[0]
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        q_end, k_end, inter = heads * dim, (heads + kv_heads) * dim, self.intermediate
        hidden = self._embed(input_ids)
        cos, sin = self._rotary(hidden, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        for index, layer in enumerate(self.layers):
            residual = hidden
            x = _rms_norm(hidden, layer.input_norm, layer.input_eps)
            qkv = _linear(x, layer.qkv, layer.qkv_bias)
            q = qkv[..., :q_end].view(batch, 1, heads, dim)
            k = qkv[..., q_end:k_end].view(batch, 1, kv_heads, dim)
            if layer.q_norm is not None and layer.k_norm is not None:  # Qwen3
                q = _rms_norm(q, layer.q_norm, layer.qk_eps)
                k = _rms_norm(k, layer.k_norm, layer.qk_eps)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            v = qkv[..., k_end:].view(batch, 1, kv_heads, dim).transpose(1, 2)
            q = (q * cos) + (_rotate_half(q) * sin)
            k = (k * cos) + (_rotate_half(k) * sin)
            out = attend(index, q, k, v, layer.scaling).reshape(batch, 1, heads * dim)
            hidden = residual + _linear(out, layer.o, layer.o_bias)
            residual = hidden
            x = _rms_norm(hidden, layer.post_norm, layer.post_eps)
            gate_up = _linear(x, layer.gate_up, layer.gate_up_bias)
            x = nn.functional.silu(gate_up[..., :inter]) * gate_up[..., inter:]
            hidden = residual + _linear(x, layer.down, layer.down_bias)
        hidden = _rms_norm(hidden, self._final_norm, self._final_eps)
        return self._lm_head(hidden)[:, -1, :]
