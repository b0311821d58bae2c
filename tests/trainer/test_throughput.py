"""The trainer's throughput figures: what each token count means, FLOPs per position, and the
measured GEMM peak that mfu divides by."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from atroposlib.trainer.throughput import ModelFlops, gemm_peak, model_flops, step_throughput


def test_step_figures_count_what_they_say() -> None:
    flops = ModelFlops(body_params=1_000, head_params=200)
    out = step_throughput(
        seconds=2.0,
        batch_tokens=1_000,
        computed_tokens=300,
        trained_tokens=50,
        flops=flops,
        peak_flops=1e6,
    )
    assert out["batch_tokens_per_s"] == 500
    assert out["computed_tokens_per_s"] == 150
    assert out["trained_tokens_per_s"] == 25
    # 6 FLOPs per parameter per position: the body at every computed position, the head at
    # the trained ones
    assert out["model_flops_per_s"] == pytest.approx(6 * (1_000 * 300 + 200 * 50) / 2.0)
    assert out["mfu"] == pytest.approx(out["model_flops_per_s"] / 1e6)
    # a trainer that runs the head everywhere says so
    full = step_throughput(
        seconds=1.0, batch_tokens=1, computed_tokens=300, trained_tokens=50, flops=flops,
        head_tokens=300,
    )  # fmt: skip
    assert full["model_flops_per_s"] == pytest.approx(6 * (1_000 + 200) * 300)
    assert "mfu" not in full  # no peak, no mfu
    # a frozen head: forward and its input's gradient, no weight gradient
    frozen = ModelFlops(body_params=1_000, head_params=200, head_trained=False)
    assert frozen.training_flops(300, 50) == pytest.approx(6 * 1_000 * 300 + 4 * 200 * 50)


@pytest.mark.parametrize("tied", [False, True])
def test_model_flops_leave_the_embedding_out(tiny_model_dir: Path, tied: bool) -> None:
    """The embedding is a lookup, not a matrix product: it is not in the body; a head tied
    to it counts once, as the head."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    if tied:  # as SmolLM2 is: one matrix, listed once by parameters()
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    counts = model_flops(model)
    total = sum(p.numel() for p in model.parameters())  # a tied weight is listed once
    vocab, hidden = model.get_output_embeddings().weight.shape
    assert counts.head_params == vocab * hidden
    embedding = 0 if tied else model.get_input_embeddings().weight.numel()
    assert counts.body_params + counts.head_params + embedding == total


def test_gemm_peak_is_measured_once_and_cached(tmp_path: Path) -> None:
    cache = tmp_path / "peak.json"
    assert gemm_peak(threads=1, measure=False, cache_path=cache) is None
    peak = gemm_peak(threads=1, cache_path=cache)
    assert peak is not None and peak > 1e8  # any CPU does more than 0.1 GFLOP/s in fp32
    (entry,) = json.loads(cache.read_text()).values()
    assert entry["peak"] == peak and {"512", "1024", "2048"} <= set(entry)
    assert gemm_peak(threads=1, measure=False, cache_path=cache) == peak
