"""Linear layers on prepacked oneDNN weights, for the embedded engine on the CPU.

``torch.nn.functional.linear`` on the CPU hands each call's weight to oneDNN (bf16) or MKL
(float32) in its plain layout, and the library re-blocks it for its kernels on every call. For
the small matrices of a model like SmolLM2-135M that re-blocking is a large part of the
multiply: prepacking each weight once into oneDNN's blocked layout (what ``torch.compile``'s
CPU backend does when it freezes weights, and what vLLM's CPU build does) and calling
``torch.ops.mkldnn._linear_pointwise`` measured, on the 2-core development machine in bf16:

* a decode step's projections (batch 1 to 32 rows): 1.1-2.0x faster;
* the output projection over the 49k vocabulary: 1.5x at 32 rows, 1.9x at one row;
* prefill: 1.0-1.5x; never slower. The results are bit-identical to ``F.linear`` in bf16.

The packed copy is extra memory (one more copy of every linear weight, 270 MB for
SmolLM2-135M in bf16); the original parameters stay in place so state dicts, tied
embeddings and anything else that reads them keep working.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

#: The batch size oneDNN is told to expect when it chooses the packed layout.
BATCH_HINT = 32

_PACKABLE_DTYPES = (torch.bfloat16, torch.float32)


def packing_supported(dtype: torch.dtype) -> bool:
    """Whether weights of ``dtype`` can be prepacked on this CPU and PyTorch build."""
    if dtype not in _PACKABLE_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    if not hasattr(ops, "_reorder_linear_weight") or not hasattr(ops, "_linear_pointwise"):
        return False
    if dtype == torch.bfloat16:
        return bool(ops._is_mkldnn_bf16_supported())
    return True


def _packed_forward(self: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` on the prepacked weight, or the stock path when it cannot apply."""
    weight = self.weight
    version = self._atropos_packed_version  # type: ignore[attr-defined]
    if (
        (version is not None and weight._version != version)
        or input.dtype != weight.dtype
        or input.device.type != "cpu"
        or (torch.is_grad_enabled() and weight.requires_grad)
    ):
        # Weights changed in place since packing, or a caller wants gradients (the packed op
        # has none): the stock path is always right.
        return nn.functional.linear(input, weight, self.bias)
    packed = self._atropos_packed  # type: ignore[attr-defined]
    return torch.ops.mkldnn._linear_pointwise(input, packed, self.bias, "none", [], "")


def pack_linear_weights(model: nn.Module, batch_hint: int = BATCH_HINT) -> int:
    """Make every CPU ``nn.Linear`` of ``model`` multiply with a prepacked oneDNN weight.

    Returns how many layers were packed (0 when the model is not on the CPU, its dtype has no
    packed kernel here, or oneDNN is missing). Layers already packed are packed again, from
    their current weights. Call again after changing weights in place; until then such layers
    fall back to ``F.linear`` (they notice the change), so results never go stale.
    """
    packed = 0
    with torch.no_grad():
        for module in model.modules():
            if type(module) is not nn.Linear:
                continue
            weight = module.weight
            if weight.device.type != "cpu" or not packing_supported(weight.dtype):
                continue
            module._atropos_packed = torch.ops.mkldnn._reorder_linear_weight(  # type: ignore[assignment]
                weight.detach().contiguous(), batch_hint
            )
            # Inference tensors have no version counter (nothing can change them in place
            # outside inference mode anyway).
            version = None if weight.is_inference() else weight._version
            module._atropos_packed_version = version  # type: ignore[assignment]
            module.forward = types.MethodType(_packed_forward, module)  # type: ignore[method-assign]
            packed += 1
    return packed


def repack_in_place(model: nn.Module) -> int | None:
    """Bring every packed layer of ``model`` up to date with its weights, writing the new values
    into the packed copies it already has (oneDNN reorders into them) instead of allocating new
    ones. Returns how many layers were refreshed, or None (nothing changed) when some packed
    layer's weight no longer fits its packed copy (other shape, dtype or device): then
    :func:`pack_linear_weights` is the way.

    After an in-place weight update this does the same work as packing again minus the
    allocations: every new copy of a 538 MB model's weights in fresh memory is one page fault
    per 4 KiB, which made re-packing SmolLM2-135M (float32) take ~0.65 s instead of ~0.3 s.
    """
    layers = [m for m in model.modules() if getattr(m, "_atropos_packed", None) is not None]
    for module in layers:
        packed, weight = module._atropos_packed, module.weight
        if (
            tuple(packed.shape) != tuple(weight.shape)
            or packed.dtype != weight.dtype
            or weight.device.type != "cpu"
        ):
            return None
    with torch.no_grad():
        for module in layers:
            weight = module.weight
            module._atropos_packed.copy_(weight.detach().contiguous().to_mkldnn())
            module._atropos_packed_version = None if weight.is_inference() else weight._version
    return len(layers)


def unpack_linear_weights(model: nn.Module) -> int:
    """Undo :func:`pack_linear_weights`: drop the packed copies; returns how many."""
    count = 0
    for module in model.modules():
        if getattr(module, "_atropos_packed", None) is None:
            continue
        del module._atropos_packed, module._atropos_packed_version
        module.__dict__.pop("forward", None)
        count += 1
    return count


def is_packed(module: Any) -> bool:
    """Whether ``module`` is a linear layer running on a packed weight."""
    return getattr(module, "_atropos_packed", None) is not None
