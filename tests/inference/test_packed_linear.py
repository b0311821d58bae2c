"""Linear layers on prepacked oneDNN weights must compute what ``F.linear`` computes, and never
serve stale weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from atroposlib.inference.fastpath.packed_linear import (
    fused_group,
    fused_groups,
    is_packed,
    pack_linear_weights,
    packing_supported,
    repack_in_place,
    unpack_linear_weights,
)
from atroposlib.inference.models import load_model
from tests.inference.conftest import PACKED_DTYPES as DTYPES


def _tolerances(dtype: torch.dtype) -> dict[str, float]:
    return {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {}


@pytest.mark.skipif(not packing_supported(torch.float32), reason="oneDNN is not available")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 48), (32, 48), (3, 7, 48)])
def test_packed_linear_computes_what_f_linear_computes(
    dtype: torch.dtype, bias: bool, shape: tuple[int, ...]
) -> None:
    gen = torch.Generator().manual_seed(0)
    layer = nn.Linear(48, 80, bias=bias).to(dtype)
    x = torch.randn(shape, generator=gen).to(dtype)
    with torch.no_grad():
        expected = nn.functional.linear(x, layer.weight, layer.bias)
        if packing_supported(dtype):
            assert pack_linear_weights(layer) == 1
            assert is_packed(layer)
        else:  # no kernels for this dtype on this CPU: left on the stock path
            assert pack_linear_weights(layer) == 0
            assert not is_packed(layer)
        got = layer(x)
    assert got.shape == expected.shape == (*shape[:-1], 80)
    torch.testing.assert_close(got, expected, **_tolerances(dtype))


@pytest.mark.skipif(not packing_supported(torch.float32), reason="oneDNN is not available")
def test_weights_changed_in_place_are_never_served_stale() -> None:
    layer = nn.Linear(16, 8)
    x = torch.randn(4, 16)
    with torch.no_grad():
        pack_linear_weights(layer)
        layer.weight.mul_(-2.0)  # e.g. load_state_dict into the packed model
        torch.testing.assert_close(layer(x), nn.functional.linear(x, layer.weight, layer.bias))
        pack_linear_weights(layer)  # packed again from the new weights
        torch.testing.assert_close(
            layer(x), nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-4, atol=1e-4
        )


@pytest.mark.skipif(not packing_supported(torch.float32), reason="oneDNN is not available")
def test_gradients_still_flow_through_a_packed_layer() -> None:
    layer = nn.Linear(16, 8)
    pack_linear_weights(layer)
    layer(torch.randn(4, 16)).sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0


@pytest.mark.skipif(not packing_supported(torch.float32), reason="oneDNN is not available")
@pytest.mark.parametrize("dtype", DTYPES)
def test_packing_a_model_keeps_its_outputs_and_state_dict(
    tiny_model_dir: Path, dtype: torch.dtype
) -> None:
    model = load_model(str(tiny_model_dir), "float32").model.to(dtype)
    ids = torch.tensor([[1, 5, 9, 200, 33, 7]])
    params = dict(model.named_parameters())
    linears = sum(1 for m in model.modules() if type(m) is nn.Linear)
    supported = packing_supported(dtype)
    with torch.inference_mode():
        stock = model(ids).logits.float()
        # where this CPU has no kernels for the dtype, nothing is packed and nothing changes
        assert pack_linear_weights(model) == (linears if supported else 0)
        assert linears > 0
        packed = model(ids).logits.float()
    torch.testing.assert_close(packed, stock, **_tolerances(dtype))
    # The parameters are the same objects (fused layers' ones now views of their fused
    # matrix): state dicts, tied embeddings and weight loading see the same tensors.
    after = dict(model.named_parameters())
    assert after.keys() == params.keys()
    assert all(after[name] is params[name] for name in params)
    assert unpack_linear_weights(model) == (linears if supported else 0)
    assert not any(is_packed(m) for m in model.modules())


class _Block(nn.Module):
    """Llama's projection layout: q/k/v and gate/up share their input, o/down do not."""

    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.q_proj = nn.Linear(32, 48, bias=bias)
        self.k_proj = nn.Linear(32, 16, bias=bias)
        self.v_proj = nn.Linear(32, 16, bias=bias)
        self.o_proj = nn.Linear(48, 32, bias=bias)
        self.gate_proj = nn.Linear(32, 64, bias=bias)
        self.up_proj = nn.Linear(32, 64, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        mixed = q + torch.cat([k, v, k], dim=-1)
        return self.o_proj(mixed) + (self.gate_proj(x) * self.up_proj(x))[..., :32]


def _reference(block: _Block, x: torch.Tensor) -> torch.Tensor:
    def lin(layer: nn.Linear, t: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(t, layer.weight, layer.bias)

    q, k, v = lin(block.q_proj, x), lin(block.k_proj, x), lin(block.v_proj, x)
    mixed = q + torch.cat([k, v, k], dim=-1)
    return lin(block.o_proj, mixed) + (lin(block.gate_proj, x) * lin(block.up_proj, x))[..., :32]


@pytest.mark.skipif(not packing_supported(torch.float32), reason="oneDNN is not available")
@pytest.mark.parametrize("bias", [False, True])
def test_siblings_sharing_an_input_multiply_as_one_fused_matrix(bias: bool) -> None:
    """q/k/v and gate/up become one packed matrix each (no packed copy per layer), their
    parameters row views of one plain tensor (the same Parameter objects and values), and the
    block computes what it computed before."""
    torch.manual_seed(0)
    block = _Block(bias)
    x = torch.randn(3, 5, 32)
    before = {name: p.detach().clone() for name, p in block.named_parameters()}
    params = dict(block.named_parameters())
    with torch.no_grad():
        expected = _reference(block, x)
        assert pack_linear_weights(block) == 6
    qkv = fused_group(block.q_proj, block.k_proj, block.v_proj)
    gate_up = fused_group(block.gate_proj, block.up_proj)
    assert qkv is not None and gate_up is not None
    assert list(fused_groups(block)) == [qkv, gate_up]
    assert tuple(qkv.weight.shape) == (80, 32) and tuple(gate_up.weight.shape) == (128, 32)
    assert not hasattr(block.q_proj, "_atropos_packed")  # no second packed copy
    assert is_packed(block.o_proj) and hasattr(block.o_proj, "_atropos_packed")
    assert all(params[name] is p for name, p in block.named_parameters())
    for name, p in block.named_parameters():
        torch.testing.assert_close(p.detach(), before[name], rtol=0, atol=0)
    assert block.k_proj.weight.untyped_storage().data_ptr() == qkv.weight.data_ptr()
    with torch.no_grad():
        torch.testing.assert_close(block(x), expected, rtol=1e-4, atol=1e-4)
        # a sibling called alone, or with another input, multiplies on its own
        other = torch.randn(2, 32)
        torch.testing.assert_close(
            block.v_proj(other),
            nn.functional.linear(other, before["v_proj.weight"], before.get("v_proj.bias")),
            rtol=1e-4,
            atol=1e-4,
        )
    assert unpack_linear_weights(block) == 6
    assert not any(is_packed(m) for m in block.modules())
    with torch.no_grad():
        torch.testing.assert_close(block(x), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not packing_supported(torch.float32), reason="oneDNN is not available")
def test_fused_layers_never_serve_stale_weights_and_repack_in_place() -> None:
    torch.manual_seed(0)
    block = _Block(bias=True)
    x = torch.randn(4, 32)
    with torch.no_grad():
        pack_linear_weights(block)
        qkv = fused_group(block.q_proj, block.k_proj, block.v_proj)
        assert qkv is not None
        packed = qkv.packed
        block.k_proj.weight.mul_(-2.0)  # an in-place update (a shared-memory sync)
        block.up_proj.bias.add_(1.0)
        assert not qkv.current()
        torch.testing.assert_close(block(x), _reference(block, x))  # F.linear meanwhile
        assert repack_in_place(block) == 6
        assert qkv.current() and qkv.packed is packed  # rewritten where it is
        torch.testing.assert_close(block(x), _reference(block, x), rtol=1e-4, atol=1e-4)
        # a parameter whose data was replaced is no longer part of the fused matrix
        block.v_proj.weight.data = block.v_proj.weight.detach().clone()
        assert repack_in_place(block) is None
        torch.testing.assert_close(block(x), _reference(block, x), rtol=1e-4, atol=1e-4)
        assert pack_linear_weights(block) == 6  # packing again fuses the new layout
        torch.testing.assert_close(block(x), _reference(block, x), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not packing_supported(torch.float32), reason="oneDNN is not available")
def test_gradients_flow_through_fused_layers() -> None:
    torch.manual_seed(0)
    block = _Block(bias=False)
    pack_linear_weights(block)
    block(torch.randn(4, 32)).sum().backward()
    for layer in (block.q_proj, block.k_proj, block.v_proj, block.gate_proj, block.up_proj):
        assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0


@pytest.mark.skipif(not packing_supported(torch.float32), reason="oneDNN is not available")
def test_inference_tensor_siblings_are_packed_one_by_one() -> None:
    """Parameters made under ``torch.inference_mode`` cannot be re-pointed at a fused matrix:
    such layers keep per-layer packed copies and still compute what F.linear computes."""
    torch.manual_seed(0)
    with torch.inference_mode():
        block = _Block(bias=True)
        x = torch.randn(3, 32)
        expected = _reference(block, x)
    assert block.q_proj.weight.is_inference()
    assert pack_linear_weights(block) == 6
    assert fused_group(block.q_proj, block.k_proj, block.v_proj) is None
    assert all(hasattr(m, "_atropos_packed") for m in (block.q_proj, block.k_proj))
    with torch.inference_mode():
        torch.testing.assert_close(block(x), expected, rtol=1e-4, atol=1e-4)
