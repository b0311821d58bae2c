"""Training precision (``--dtype``): float32, bf16-mixed (float32 weights, bfloat16 autocast)
and pure bfloat16, whose small updates round away.

Pure-bfloat16 AdamW was the trainer's GPU default: at the recipes' learning rates (2e-5) an
update is below half a bfloat16 step for almost every weight, so the model barely trains. On
a GPU the default is now bf16-mixed; these tests run the same code on the CPU, where autocast
to bfloat16 works too.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import httpx
import pytest
import torch

from example_trainer.config import load_config
from example_trainer.data import prepare_batch
from example_trainer.grpo import (
    compute_dtype,
    freeze_embeddings,
    is_grad_spike,
    load_policy,
    make_optimizer,
    resolve_dtype,
    resolve_precision,
    rounded_away_fraction,
    train_step,
    warn_if_updates_round_away,
)
from tests.trainer.test_loss_and_data import _sample_batch


def _config(model: Path, dtype: str, lr: float = 2e-5):
    return load_config(
        ["--model", str(model), "--device", "cpu", "--dtype", dtype, "--lr", str(lr)]
        + ["--warmup-steps", "0", "--inference", "none"]
    )


def _step(
    model: torch.nn.Module, config, *, optimizer=None, scheduler=None, recent=()
) -> dict[str, float]:
    batch = prepare_batch(_sample_batch(model.config.vocab_size, common=8), 3, pack_tokens=64)
    optimizer = optimizer or make_optimizer(model, config)
    scheduler = scheduler or torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return train_step(model, optimizer, scheduler, batch, config, recent_grad_norms=recent)


def _changed(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> float:
    changed = total = 0
    for name, param in model.named_parameters():
        changed += int((param.detach() != before[name]).sum())
        total += param.numel()
    return changed / total


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in model.named_parameters()}


@pytest.mark.parametrize(("speedup", "auto"), [(0.01, "float32"), (2.2, "bf16-mixed")])
def test_auto_follows_the_measured_bf16_speed_and_the_server_computes_alike(
    tiny_model_dir: Path,
    capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    speedup: float,
    auto: str,
) -> None:
    """auto: bf16-mixed where bfloat16 products are measured >= 1.5x faster (a CPU with
    AVX-512 BF16: 2.2x), float32 where they are emulated (an AVX2 CPU: ~0.01x)."""
    import example_trainer.grpo as grpo
    from example_trainer.grpo import compute_dtype_name
    from example_trainer.quickstart import _serve_dtype
    from example_trainer.weight_sync import make_weight_sync

    monkeypatch.setattr(grpo, "bf16_speedup", lambda device, threads: speedup)
    grpo._auto_precision.cache_clear()
    try:
        expected = {  # --dtype: (resolved, weights, arithmetic and server)
            "float32": ("float32", torch.float32, "float32"),
            "bf16-mixed": ("bf16-mixed", torch.float32, "bfloat16"),
            "bfloat16": ("bfloat16", torch.bfloat16, "bfloat16"),
        }
        expected["auto"] = expected[auto]
        for dtype, (precision, weights, arithmetic) in expected.items():
            config = _config(tiny_model_dir, dtype)
            assert resolve_precision(config) == precision
            assert resolve_dtype(config) == weights
            assert str(compute_dtype(config)) == f"torch.{arithmetic}"
            assert _serve_dtype(config) == arithmetic  # atropos-serve's --dtype
            assert compute_dtype_name(config) == arithmetic
            # a vLLM the trainer launches: the last --dtype of its command line wins
            vllm = make_weight_sync(config.model_copy(update={"inference": "vllm"}))
            argv = vllm.build_command("m")
            assert argv[len(argv) - 1 - argv[::-1].index("--dtype") + 1] == arithmetic
    finally:
        grpo._auto_precision.cache_clear()
    with pytest.raises(SystemExit):
        load_config(["--model", "m", "--dtype", "bf16"])
    assert "--dtype 'bf16'" in capsys.readouterr().err


def test_bf16_speedup_is_measured_once_per_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from atroposlib.trainer import throughput

    cache = tmp_path / "peaks.json"
    ratio = throughput.bf16_speedup("cpu", 1, cache_path=cache)
    assert 0 < ratio < 100
    recorded = json.loads(cache.read_text())
    (entry,) = recorded.values()
    assert entry["peak"] == pytest.approx(entry["bfloat16"] / entry["float32"])

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(throughput, "measure_gemm_peak", no_measuring)
    assert throughput.bf16_speedup("cpu", 1, cache_path=cache) == ratio


def test_pure_bfloat16_rounds_small_updates_away_and_says_so(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = _config(tiny_model_dir, "bfloat16")
    model, _ = load_policy(str(tiny_model_dir), config)
    assert next(model.parameters()).dtype == torch.bfloat16
    with caplog.at_level(logging.WARNING, logger="example_trainer"):
        lost = warn_if_updates_round_away(model, config)
    assert lost > 0.5
    assert "leaves" in caplog.text and "--dtype bf16-mixed" in caplog.text
    before = _snapshot(model)
    metrics = _step(model, config)
    assert metrics["optimizer_step"] == 1.0 and metrics["grad_norm"] > 0
    # the optimizer stepped with a real gradient, yet most weights did not move
    assert _changed(model, before) < 1 - lost + 0.05
    # a learning rate large enough for bfloat16's resolution: no warning
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="example_trainer"):
        assert warn_if_updates_round_away(model, _config(tiny_model_dir, "bfloat16", 1e-2)) < 0.1
    assert caplog.text == ""


def test_bf16_mixed_keeps_float32_weights_that_all_move(tiny_model_dir: Path) -> None:
    config = _config(tiny_model_dir, "bf16-mixed")
    model, _ = load_policy(str(tiny_model_dir), config)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert rounded_away_fraction(model, config.lr) == 0.0
    before = _snapshot(model)
    _step(model, config)
    assert _changed(model, before) > 0.99
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_bf16_mixed_gradient_is_the_float32_gradient_at_bfloat16_accuracy(
    tiny_model_dir: Path,
) -> None:
    """The same step in float32 and under bfloat16 autocast: same direction, not the same
    numbers (so the autocast really ran)."""
    grads = {}
    for dtype in ("float32", "bf16-mixed"):
        torch.manual_seed(0)
        config = _config(tiny_model_dir, dtype)
        model, _ = load_policy(str(tiny_model_dir), config)
        optimizer = make_optimizer(model, config)

        def capture(opt, args, kwargs, dtype=dtype) -> None:
            flat = [p.grad.flatten() for g in opt.param_groups for p in g["params"]]
            grads.setdefault(dtype, torch.cat(flat))

        optimizer.register_step_pre_hook(capture)
        _step(model, config, optimizer=optimizer)
    exact, mixed = grads["float32"], grads["bf16-mixed"]
    assert mixed.dtype == torch.float32
    assert not torch.equal(exact, mixed)
    cosine = torch.nn.functional.cosine_similarity(exact, mixed, dim=0)
    assert cosine > 0.99, cosine
    assert (mixed.norm() / exact.norm() - 1).abs() < 0.05


def test_a_server_computing_in_another_dtype_is_named_in_a_warning(
    tiny_model_dir: Path, tiny_serve, caplog: pytest.LogCaptureFixture
) -> None:
    """A float32 atropos-serve (its /health says so) fits float32 training; bf16-mixed
    training is warned that the samples come from another policy, with both remedies."""
    from example_trainer.grpo import check_server_precision

    health = httpx.get(tiny_serve.url + "/health").json()
    assert health["dtype"] == "float32"

    def checked(dtype: str) -> str | None:
        config = load_config(
            ["--model", str(tiny_model_dir), "--device", "cpu", "--dtype", dtype]
            + ["--inference", "atropos-serve", "--inference-url", tiny_serve.url]
        )
        return check_server_precision(config)

    with caplog.at_level(logging.WARNING, logger="example_trainer"):
        assert checked("float32") is None
        assert caplog.text == ""
        message = checked("bf16-mixed")
    assert message is not None and message in caplog.text
    assert "computes in float32, this trainer in bfloat16" in message
    assert "--dtype bfloat16" in message and "--dtype float32" in message


def test_a_gradient_spike_skips_the_optimizer_step(tiny_model_dir: Path) -> None:
    """skip_grad_spikes: a gradient norm more than that many times the median of the last
    steps' leaves the weights, AdamW's state and the schedule as they were; the step after a
    normal one moves them."""
    assert not is_grad_spike(50.0, [1.0, 1.0, 1.0], 4.0)  # too few earlier steps to judge
    assert is_grad_spike(5.0, [1.0, 1.2, 0.9, 1.1], 4.0)
    assert not is_grad_spike(4.0, [1.0, 1.2, 0.9, 1.1], 4.0)
    assert not is_grad_spike(50.0, [1.0, 1.2, 0.9, 1.1], None)
    assert is_grad_spike(float("nan"), [1.0, 1.2, 0.9, 1.1], 4.0)
    # only the last eight count
    assert not is_grad_spike(5.0, [0.1] * 8 + [2.0] * 8, 4.0)

    config = load_config(
        ["--model", str(tiny_model_dir), "--device", "cpu", "--dtype", "float32"]
        + ["--warmup-steps", "2", "--inference", "none", "--skip-grad-spikes", "4"]
    )
    model, _ = load_policy(str(tiny_model_dir), config)
    optimizer = make_optimizer(model, config)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 2))
    before = _snapshot(model)
    lr = scheduler.get_last_lr()[0]
    metrics = _step(model, config, optimizer=optimizer, scheduler=scheduler, recent=[1e-4] * 4)
    assert metrics["grad_spike_skipped"] == 1.0 and metrics["optimizer_step"] == 0.0
    assert metrics["grad_norm"] > 4e-4
    assert _changed(model, before) == 0.0
    assert not optimizer.state and scheduler.get_last_lr()[0] == lr
    assert all(p.grad is None for p in model.parameters())
    # the same batch against norms like its own is a normal step
    norm = metrics["grad_norm"]
    metrics = _step(model, config, optimizer=optimizer, scheduler=scheduler, recent=[norm] * 4)
    assert metrics["grad_spike_skipped"] == 0.0 and metrics["optimizer_step"] == 1.0
    assert _changed(model, before) > 0.5 and scheduler.get_last_lr()[0] > lr


@pytest.mark.parametrize("tied", [True, False])
def test_frozen_embeddings_stay_put_while_the_layers_train(
    tiny_model_dir: Path, tied: bool
) -> None:
    """freeze_embeddings: the token embeddings (and a head tied to them) are left out of AdamW
    and keep their values through a real step; every other weight moves, an untied head too;
    the FLOP count drops the frozen head's weight gradient."""
    from atroposlib.trainer.throughput import model_flops

    config = load_config(
        ["--model", str(tiny_model_dir), "--device", "cpu", "--dtype", "float32"]
        + ["--warmup-steps", "0", "--inference", "none", "--freeze-embeddings"]
    )
    assert config.freeze_embeddings
    model, _ = load_policy(str(tiny_model_dir), config)
    if tied:  # as SmolLM2 is
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    trained_flops = model_flops(model)
    frozen, was_tied = freeze_embeddings(model)
    embedding = model.get_input_embeddings().weight
    assert frozen == embedding.numel() and was_tied == tied
    optimizer = make_optimizer(model, config)
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert id(embedding) not in in_optimizer
    head = model.get_output_embeddings().weight
    assert (id(head) in in_optimizer) == (not tied)
    flops = model_flops(model)
    assert flops.head_trained == (not tied)
    if tied:  # the head's backward computes its input's gradient only: 4 FLOPs, not 6
        assert flops.training_flops(10, 10) == pytest.approx(
            trained_flops.training_flops(10, 10) - 2 * 10 * flops.head_params
        )
    before = _snapshot(model)
    metrics = _step(model, config, optimizer=optimizer)
    assert metrics["optimizer_step"] == 1.0
    for name, param in model.named_parameters():
        moved = bool((param.detach() != before[name]).any())
        assert moved == (param is not embedding), name
