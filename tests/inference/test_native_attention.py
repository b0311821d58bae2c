"""The C decode-attention kernel (atroposlib.inference.fastpath.native): its results against a
float64 reference, the lean step and the engine on it, and how it stands aside (no compiler, a
failed build, ``ATROPOS_NATIVE_KERNELS=0``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from atroposlib.inference import fastpath
from atroposlib.inference.fastpath import native
from atroposlib.inference.fastpath.lean_decode import LeanDecoder
from atroposlib.inference.fastpath.packed_linear import packing_supported
from tests.inference.test_lean_decode import (
    _assert_lean_steps_equal_the_model_forward,
    _prepared,
    _random_model,
)

REPO = Path(__file__).resolve().parents[2]


def _reference(query, keys, values, mask, scale):
    """Attention in float64: output and log-sum-exp (rows with nothing to attend: 0, -inf)."""
    q, k, v = (t.double() for t in (query, keys, values))
    scores = (q @ k.transpose(-1, -2)) * scale  # (b, h, g, l)
    if mask is not None:
        scores = scores.masked_fill(~mask.bool()[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    return weights @ v, lse


def test_the_kernel_builds_here() -> None:
    """CI installs a C compiler, so here the kernel must build and load (not fall back)."""
    assert native.available(), native.unavailable_reason()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("group", "dim"), [(1, 64), (3, 64), (7, 64), (4, 128), (2, 16)])
def test_kernel_matches_float64_attention(dtype: torch.dtype, group: int, dim: int) -> None:
    """Strided views of a cache with spare positions, left padding of different widths, one
    row fully masked: output and log-sum-exp as float64 attention computes them (to float32
    rounding of the same inputs)."""
    gen = torch.Generator().manual_seed(group * dim)
    batch, heads, length, spare = 5, 2, 37, 11
    keys = torch.randn(batch, heads, length + spare, dim, generator=gen).to(dtype)[:, :, :length]
    values = torch.randn(batch, heads, length + spare, dim, generator=gen).to(dtype)[:, :, :length]
    query = torch.randn(batch, heads, group, dim, generator=gen).to(dtype)
    starts = torch.tensor([0, 5, 20, 36, length])  # the last row attends to nothing
    mask = torch.arange(length)[None, :] >= starts[:, None]
    out, lse = native.decode_attention(query, keys, values, mask, 0.125)
    want, want_lse = _reference(query, keys, values, mask, 0.125)
    assert out.dtype == torch.float32 and out.shape == (batch, heads, group, dim)
    assert torch.allclose(out.double(), want, atol=2e-6, rtol=1e-5)
    assert torch.allclose(lse[:4].double(), want_lse[:4], atol=2e-6, rtol=1e-6)
    assert bool((out[4] == 0).all()) and bool(torch.isneginf(lse[4]).all())
    # no mask: every position
    out, lse = native.decode_attention(query, keys, values, None, 0.3)
    want, want_lse = _reference(query, keys, values, None, 0.3)
    assert torch.allclose(out.double(), want, atol=2e-6, rtol=1e-5)
    assert torch.allclose(lse.double(), want_lse, atol=2e-6, rtol=1e-6)


def test_kernel_is_closer_to_float64_than_bfloat16_sdpa() -> None:
    """In bfloat16 it accumulates in float32 and returns float32: never further from the exact
    result than PyTorch's bfloat16 sdpa, whose output is bfloat16."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(16, 3, 3, 64, generator=gen).to(torch.bfloat16)
    k = torch.randn(16, 3, 200, 64, generator=gen).to(torch.bfloat16)
    v = torch.randn(16, 3, 200, 64, generator=gen).to(torch.bfloat16)
    want, _ = _reference(q, k, v, None, 0.125)
    ours, _ = native.decode_attention(q, k, v, None, 0.125)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.125)
    assert (ours.double() - want).abs().max() < (sdpa.double() - want).abs().max()


def test_shapes_it_does_not_take_are_named() -> None:
    assert native.supports(torch.float32, 64, 3) == (True, "")
    ok, why = native.supports(torch.float16, 64, 3)
    assert not ok and "float16" in why
    ok, why = native.supports(torch.bfloat16, 72, 3)
    assert not ok and "head size 72" in why
    ok, why = native.supports(torch.float32, 64, 17)
    assert not ok and "17 query heads" in why
    with pytest.raises(ValueError, match="are not keys'"):
        native.decode_attention(
            torch.zeros(2, 1, 1, 16), torch.zeros(2, 1, 5, 16), torch.zeros(2, 1, 4, 16), None, 1.0
        )
    with pytest.raises(ValueError, match="do not match the query"):
        native.decode_attention(
            torch.zeros(2, 1, 1, 16), torch.zeros(2, 2, 5, 16), torch.zeros(2, 2, 5, 16), None, 1.0
        )
    with pytest.raises(ValueError, match="mask"):
        native.decode_attention(
            torch.zeros(2, 1, 1, 16),
            torch.zeros(2, 1, 5, 16),
            torch.zeros(2, 1, 5, 16),
            torch.ones(2, 4, dtype=torch.bool),
            1.0,
        )


@pytest.mark.skipif(not packing_supported(torch.float32), reason="oneDNN is not available")
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_lean_step_on_the_kernel_follows_the_model_forward(
    tiny_model_dir: Path, model_type: str
) -> None:
    """float32: six greedy steps of padded rows, logits and cache within float32 rounding of
    the ``transformers`` forward pass, and the same tokens."""
    if model_type == "llama":
        model, _ = _prepared(tiny_model_dir, torch.float32)
    else:
        model = _random_model(model_type)
        prepared = fastpath.prepare(model, fastpath.FastPathOptions(native_attention=False))
        assert prepared.lean is not None
    lean = LeanDecoder.build(model)
    assert lean is not None
    lean.native_attention = True
    _assert_lean_steps_equal_the_model_forward(model, padded=True, lean=lean, tolerance=1e-4)


def test_prepare_says_which_attention_the_lean_step_uses(tiny_model_dir: Path) -> None:
    model, _ = _prepared(tiny_model_dir, torch.float32)
    if not packing_supported(torch.float32):
        pytest.skip("no lean step without oneDNN")
    on = fastpath.prepare(model)
    assert on.lean is not None and on.lean.native_attention
    assert "C attention kernel" in on.reason
    fastpath.release(model)
    model, _ = _prepared(tiny_model_dir, torch.float32)
    off = fastpath.prepare(model, fastpath.FastPathOptions(native_attention=False))
    assert off.lean is not None and not off.lean.native_attention
    assert "PyTorch's attention (native_attention is off)" in off.reason


_PROBE = """
import json, logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from atroposlib.inference.fastpath import native
print(json.dumps({"available": native.available(), "reason": native.unavailable_reason()}))
"""


def _probe(tmp_path: Path, **env: str) -> tuple[dict, str]:
    environment = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), **env}
    result = subprocess.run(
        [sys.executable, "-c", _PROBE],
        capture_output=True,
        text=True,
        env=environment,
        cwd=REPO,
        timeout=120,
        check=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


def test_build_is_cached_per_machine_and_reused(tmp_path: Path) -> None:
    first, log = _probe(tmp_path)
    assert first == {"available": True, "reason": None}
    assert "native kernels: built" in log
    built = list((tmp_path / "cache" / "atroposlib" / "native").glob("decode_attention-*.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    second, log = _probe(tmp_path)
    assert second["available"] and "native kernels: built" not in log
    assert built[0].stat().st_mtime_ns == mtime


def test_it_stands_aside_with_a_reason(tmp_path: Path) -> None:
    """Turned off, no compiler, or a compiler that fails: PyTorch's attention, said once."""
    off, _ = _probe(tmp_path, ATROPOS_NATIVE_KERNELS="0")
    assert off == {"available": False, "reason": "ATROPOS_NATIVE_KERNELS=0"}
    missing, log = _probe(tmp_path, CC="no-such-compiler-here")
    assert not missing["available"] and "no C compiler" in missing["reason"]
    assert "PyTorch's attention is used" in log
    failing, log = _probe(tmp_path, CC="false")
    assert not failing["available"] and "build or load failed" in failing["reason"]
    assert "WARNING" in log or "native kernels: off" in log


@pytest.mark.parametrize("own_dtype", [torch.float32, torch.bfloat16])
def test_a_shared_segment_and_the_rows_own_are_one_softmax(own_dtype: torch.dtype) -> None:
    """The grouped layout's call: each row reads its request's prompt (shared by the
    request's rows, float32, left-padded per request) and then its own generated tokens (left-
    padded per row): the same as attention over the two laid end to end, per row."""
    gen = torch.Generator().manual_seed(7)
    requests, heads, group, dim, prompt, own = 3, 2, 3, 64, 20, 9
    rows = torch.tensor([0, 0, 1, 2, 2, 2, 1, 0])
    batch = len(rows)
    prompt_keys = torch.randn(requests, heads, prompt, dim, generator=gen)
    prompt_values = torch.randn(requests, heads, prompt, dim, generator=gen)
    prompt_mask = torch.arange(prompt)[None, :] >= torch.tensor([0, 6, 13])[:, None]
    own_keys = torch.randn(batch, heads, own + 4, dim, generator=gen).to(own_dtype)[:, :, :own]
    own_values = torch.randn(batch, heads, own + 4, dim, generator=gen).to(own_dtype)[:, :, :own]
    own_mask = torch.arange(own)[None, :] >= torch.randint(0, own, (batch,), generator=gen)[:, None]
    query = torch.randn(batch, heads, group, dim, generator=gen)
    out, lse = native.attend(
        query,
        [
            native.Segment(prompt_keys, prompt_values, prompt_mask, rows),
            native.Segment(own_keys, own_values, own_mask),
        ],
        0.125,
    )
    keys = torch.cat([prompt_keys[rows], own_keys.float()], dim=2)
    values = torch.cat([prompt_values[rows], own_values.float()], dim=2)
    mask = torch.cat([prompt_mask[rows], own_mask], dim=1)
    want, want_lse = _reference(query, keys, values, mask, 0.125)
    assert torch.allclose(out.double(), want, atol=2e-6, rtol=1e-5)
    assert torch.allclose(lse.double(), want_lse, atol=2e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="rows must index"):
        native.attend(
            query, [native.Segment(prompt_keys, prompt_values, prompt_mask, rows + 1)], 1.0
        )
