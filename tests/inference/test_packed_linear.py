"""Linear layers on prepacked oneDNN weights must compute what ``F.linear`` computes, and never
serve stale weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from atroposlib.inference.fastpath.packed_linear import (
    is_packed,
    pack_linear_weights,
    packing_supported,
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
    # The parameters themselves are untouched: state dicts, tied embeddings and weight
    # loading see the same tensors as before.
    after = dict(model.named_parameters())
    assert after.keys() == params.keys()
    assert all(after[name] is params[name] for name in params)
    assert unpack_linear_weights(model) == (linears if supported else 0)
    assert not any(is_packed(m) for m in model.modules())
