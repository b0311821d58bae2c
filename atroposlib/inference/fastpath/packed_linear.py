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
SmolLM2-135M in bf16); the parameters stay the model's own, so state dicts, tied embeddings
and anything else that reads them keep working.

Linear layers that always multiply the same input, a decoder layer's query/key/value
projections and its gate/up projections (``q_proj``/``k_proj``/``v_proj``,
``gate_proj``/``up_proj``, as Llama, Mistral, Qwen and most Hugging Face decoders name them),
are packed as one :class:`FusedLinears`: one matrix, one multiply, each layer handed its slice
of the product. Their parameters become row views of one plain tensor (the same ``Parameter``
objects, same values), so a weight update copied into them lands in the fused matrix and
re-packing it needs no concatenation and no second packed copy per layer. The
lean decode step multiplies with the same packed matrices.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
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


#: Sibling linear layers of one module that multiply the same input, fused where all exist.
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _version(tensor: torch.Tensor | None) -> int | None:
    # Inference tensors have no version counter (nothing can change them in place outside
    # inference mode anyway).
    return None if tensor is None or tensor.is_inference() else tensor._version


class FusedLinears:
    """Linear layers that multiply the same input, packed as one matrix.

    The layers' weights (and biases) become row views of :attr:`weight` (:attr:`bias`), one
    plain tensor, and :attr:`packed` is its prepacked copy. The first layer called with an
    input computes every layer's product in one multiply and keeps the others' slices for
    them; a layer called with another input, after its weights changed in place (until
    :func:`repack_in_place`), or with gradients wanted multiplies on its own with ``F.linear``,
    so results are never stale or wrong, only slower.
    """

    def __init__(self, members: list[nn.Linear], batch_hint: int = BATCH_HINT) -> None:
        self.members = members
        self.sizes = [member.out_features for member in members]
        with torch.no_grad(), torch.inference_mode(False):
            self.weight = torch.cat([member.weight.detach() for member in members])
            has_bias = members[0].bias is not None
            self.bias = (
                torch.cat([member.bias.detach() for member in members])  # type: ignore[union-attr]
                if has_bias
                else None
            )
            offset = 0
            for member, size in zip(members, self.sizes, strict=True):
                member.weight.data = self.weight[offset : offset + size]
                if self.bias is not None:
                    member.bias.data = self.bias[offset : offset + size]  # type: ignore[union-attr]
                offset += size
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, batch_hint)
        self._versions = self._current_versions()
        # (input, {member index: its slice of the fused product not yet handed out})
        self._pending: tuple[torch.Tensor, dict[int, torch.Tensor]] | None = None

    @staticmethod
    def fusable(members: list[Any]) -> bool:
        """Whether ``members`` can be one :class:`FusedLinears`: plain CPU ``nn.Linear``
        layers of one input size and dtype with packed kernels, all with or all without bias,
        none already packed, none an inference tensor (their data cannot be re-pointed)."""
        if not all(type(m) is nn.Linear and not is_packed(m) for m in members):
            return False
        if any(t is not None and t.is_inference() for m in members for t in (m.weight, m.bias)):
            return False
        first = members[0].weight
        return (
            first.device.type == "cpu"
            and packing_supported(first.dtype)
            and all(
                m.in_features == members[0].in_features
                and m.weight.dtype == first.dtype
                and m.weight.device == first.device
                and (m.bias is None) == (members[0].bias is None)
                for m in members
            )
        )

    def _current_versions(self) -> list[int | None]:
        return [_version(t) for m in self.members for t in (m.weight, m.bias)]

    def current(self) -> bool:
        """Whether :attr:`packed` holds the layers' weights (none changed since packing)."""
        return self._current_versions() == self._versions

    def intact(self) -> bool:
        """Whether every layer's weight and bias are still the views of the fused tensors
        (nobody replaced a parameter's data), so re-packing the fused tensors updates them."""
        offset = 0
        for member, size in zip(self.members, self.sizes, strict=True):
            pairs = [(member.weight, self.weight)]
            if self.bias is not None:
                pairs.append((member.bias, self.bias))  # type: ignore[arg-type]
            elif member.bias is not None:
                return False
            for tensor, fused in pairs:
                start = offset * fused.stride(0)
                if (
                    tensor.dtype != fused.dtype
                    or tensor.device != fused.device
                    or tensor.untyped_storage().data_ptr() != fused.untyped_storage().data_ptr()
                    or tensor.storage_offset() != start
                    or tuple(tensor.shape) != (size, *fused.shape[1:])
                ):
                    return False
            offset += size
        return True

    def repack(self) -> None:
        """Rewrite :attr:`packed` from the current weights, where it is (no new copy)."""
        with torch.no_grad():
            self.packed.copy_(self.weight.to_mkldnn())
        self._versions = self._current_versions()
        self._pending = None  # slices of a product of the old weights

    def forward(self, index: int, input: torch.Tensor) -> torch.Tensor:
        """Member ``index``'s output for ``input``."""
        member = self.members[index]
        pending = self._pending
        if pending is not None and pending[0] is input and index in pending[1]:
            out = pending[1].pop(index)
            if not pending[1]:
                self._pending = None
            return out
        if (
            input.dtype != self.weight.dtype
            or input.device.type != "cpu"
            or (torch.is_grad_enabled() and member.weight.requires_grad)
            or not self.current()
        ):
            self._pending = None
            return nn.functional.linear(input, member.weight, member.bias)
        product = torch.ops.mkldnn._linear_pointwise(input, self.packed, self.bias, "none", [], "")
        parts = product.split(self.sizes, dim=-1)
        others = {i: part for i, part in enumerate(parts) if i != index}
        self._pending = (input, others) if others else None
        return parts[index]


def _fused_member_forward(self: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    return self._atropos_fused.forward(self._atropos_fused_index, input)  # type: ignore[attr-defined]


def _fuse(members: list[nn.Linear], batch_hint: int) -> FusedLinears:
    group = FusedLinears(members, batch_hint)
    for index, member in enumerate(members):
        member._atropos_fused = group  # type: ignore[assignment]
        member._atropos_fused_index = index  # type: ignore[assignment]
        member.forward = types.MethodType(_fused_member_forward, member)  # type: ignore[method-assign]
    return group


def fused_groups(model: nn.Module) -> Iterator[FusedLinears]:
    """The :class:`FusedLinears` of ``model``, each once, in module order."""
    seen: set[int] = set()
    for module in model.modules():
        group = getattr(module, "_atropos_fused", None)
        if group is not None and id(group) not in seen:
            seen.add(id(group))
            yield group


def fused_group(*members: nn.Module) -> FusedLinears | None:
    """The one :class:`FusedLinears` that ``members`` form, in that order, or None."""
    group = getattr(members[0], "_atropos_fused", None)
    if group is None or len(group.members) != len(members):
        return None
    if not all(a is b for a, b in zip(group.members, members, strict=True)):
        return None
    return group


def pack_linear_weights(model: nn.Module, batch_hint: int = BATCH_HINT) -> int:
    """Make every CPU ``nn.Linear`` of ``model`` multiply with a prepacked oneDNN weight, the
    sibling layers that share their input (:data:`FUSED_GROUPS`) as one fused matrix
    (:class:`FusedLinears`).

    Returns how many layers were packed, fused ones included (0 when the model is not on the
    CPU, its dtype has no packed kernel here, or oneDNN is missing). Layers already packed are
    packed again, from their current weights. Call again after changing weights in place (or
    :func:`repack_in_place`); until then such layers fall back to ``F.linear`` (they notice
    the change), so results never go stale.
    """
    unpack_linear_weights(model)
    packed = 0
    with torch.no_grad():
        for module in list(model.modules()):
            for names in FUSED_GROUPS:
                members = [getattr(module, name, None) for name in names]
                if all(m is not None for m in members) and FusedLinears.fusable(members):
                    _fuse(members, batch_hint)  # type: ignore[arg-type]
                    packed += len(members)
        for module in model.modules():
            if type(module) is not nn.Linear or is_packed(module):
                continue
            weight = module.weight
            if weight.device.type != "cpu" or not packing_supported(weight.dtype):
                continue
            module._atropos_packed = torch.ops.mkldnn._reorder_linear_weight(  # type: ignore[assignment]
                weight.detach().contiguous(), batch_hint
            )
            module._atropos_packed_version = _version(weight)  # type: ignore[assignment]
            module.forward = types.MethodType(_packed_forward, module)  # type: ignore[method-assign]
            packed += 1
    return packed


def repack_in_place(model: nn.Module) -> int | None:
    """Bring every packed layer of ``model`` up to date with its weights, writing the new values
    into the packed copies it already has (oneDNN reorders into them) instead of allocating new
    ones. Returns how many layers were refreshed, or None (nothing changed) when some packed
    layer's weight no longer fits its packed copy (other shape, dtype or device, or a fused
    layer's parameter no longer a view of its fused matrix): then :func:`pack_linear_weights`
    is the way.

    After an in-place weight update this does the same work as packing again minus the
    allocations and concatenations: every new copy of a 538 MB model's weights in fresh memory
    is one page fault per 4 KiB, which made re-packing SmolLM2-135M (float32) take ~0.65 s
    instead of ~0.3 s.
    """
    layers = [m for m in model.modules() if getattr(m, "_atropos_packed", None) is not None]
    groups = list(fused_groups(model))
    for module in layers:
        packed, weight = module._atropos_packed, module.weight
        if (
            tuple(packed.shape) != tuple(weight.shape)
            or packed.dtype != weight.dtype
            or weight.device.type != "cpu"
        ):
            return None
    if not all(group.intact() for group in groups):
        return None
    with torch.no_grad():
        for module in layers:
            weight = module.weight
            module._atropos_packed.copy_(weight.detach().contiguous().to_mkldnn())
            module._atropos_packed_version = _version(weight)
        for group in groups:
            group.repack()
    return len(layers) + sum(len(group.members) for group in groups)


def unpack_linear_weights(model: nn.Module) -> int:
    """Undo :func:`pack_linear_weights`: drop the packed copies; returns how many layers had
    one. Fused layers' parameters stay views of their fused matrix (same values)."""
    count = 0
    for module in model.modules():
        if getattr(module, "_atropos_packed", None) is not None:
            del module._atropos_packed, module._atropos_packed_version
        elif getattr(module, "_atropos_fused", None) is not None:
            del module._atropos_fused, module._atropos_fused_index
        else:
            continue
        module.__dict__.pop("forward", None)
        count += 1
    return count


def is_packed(module: Any) -> bool:
    """Whether ``module`` is a linear layer running on a packed weight (its own, or a fused
    one it shares with its siblings)."""
    return (
        getattr(module, "_atropos_packed", None) is not None
        or getattr(module, "_atropos_fused", None) is not None
    )
