"""The GRPO loss, padding/advantages, and the trainer's config loading."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from example_trainer.config import load_config
from example_trainer.data import (
    group_advantages,
    padded_length,
    prepare_batch,
    sample_temperature,
)
from example_trainer.loss import grpo_loss, token_logprobs

# ------------------------------------------------------------------------------------ loss


def _inputs(seed: int = 0, b: int = 4, t: int = 6):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(b, t, generator=g) * 3).requires_grad_(True)
    adv = torch.randn(b, 1, generator=g).expand(b, t).clone()
    mask = torch.ones(b, t)
    mask[:, :2] = 0  # prompt
    mask[0, -1] = 0  # shorter sequence
    return logp, adv, mask


def test_on_policy_when_inference_logprobs_are_null_is_reinforce() -> None:
    logp, adv, mask = _inputs()
    loss, metrics = grpo_loss(logp, adv, mask, None)
    loss.backward()
    n = mask.sum(1, keepdim=True)
    expected = -(adv * mask / n) / logp.shape[0]
    assert torch.allclose(logp.grad, expected, atol=1e-6)
    assert metrics["mean_ratio"] == pytest.approx(1.0)
    assert metrics["offpolicy_fraction"] == 0.0


def test_nan_old_logprobs_fall_back_per_token() -> None:
    logp, adv, mask = _inputs()
    all_nan = torch.full_like(logp, float("nan"))
    a, _ = grpo_loss(logp, adv, mask, all_nan)
    b, _ = grpo_loss(logp, adv, mask, None)
    assert torch.allclose(a, b)


def test_ratio_is_clipped_against_inference_logprobs() -> None:
    logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    mask = torch.ones(1, 2)
    adv = torch.ones(1, 2)
    # token 0: ratio e^1 (clipped at 1.2 for A>0, no gradient); token 1: ratio 1
    old = torch.tensor([[-2.0, -1.0]])
    loss, metrics = grpo_loss(logp, adv, mask, old, clip_eps=0.2)
    loss.backward()
    assert loss.item() == pytest.approx(-(1.2 + 1.0) / 2)
    assert logp.grad[0, 0].item() == 0.0
    assert logp.grad[0, 1].item() == pytest.approx(-0.5)
    assert metrics["clipped_fraction"] == pytest.approx(0.5)
    # with a negative advantage the unclipped (more pessimistic) term is kept
    logp.grad = None
    loss, _ = grpo_loss(logp, -adv, mask, old, clip_eps=0.2)
    assert loss.item() == pytest.approx((math.e + 1.0) / 2, rel=1e-5)


def test_token_and_sequence_normalisation_differ_as_documented() -> None:
    logp = torch.zeros(2, 4, requires_grad=True)
    adv = torch.tensor([[1.0] * 4, [2.0] * 4])
    mask = torch.tensor([[1.0, 0, 0, 0], [1.0, 1, 1, 1]])
    seq, _ = grpo_loss(logp, adv, mask, normalization="sequence")
    tok, _ = grpo_loss(logp, adv, mask, normalization="token")
    assert seq.item() == pytest.approx(-(1.0 + 2.0) / 2)
    assert tok.item() == pytest.approx(-(1.0 + 4 * 2.0) / 5)


@pytest.mark.parametrize("normalization", ["sequence", "token"])
def test_micro_batches_add_up_to_the_full_batch(normalization: str) -> None:
    logp, adv, mask = _inputs(seed=3, b=6)
    old = logp.detach() + 0.05 * torch.randn_like(logp)
    full, _ = grpo_loss(logp, adv, mask, old, normalization=normalization)
    (full_grad,) = torch.autograd.grad(full, logp)
    parts = [
        grpo_loss(
            logp[i : i + 2],
            adv[i : i + 2],
            mask[i : i + 2],
            old[i : i + 2],
            normalization=normalization,
            num_sequences=6,
            num_tokens=int(mask.sum()),
        )[0]
        for i in range(0, 6, 2)
    ]
    (split_grad,) = torch.autograd.grad(sum(parts), logp)
    assert torch.allclose(sum(parts), full, atol=1e-6)
    assert torch.allclose(split_grad, full_grad, atol=1e-6)


def test_kl_term_is_zero_at_the_reference_and_positive_away_from_it() -> None:
    logp, adv, mask = _inputs()
    base, _ = grpo_loss(logp, adv, mask)
    same, metrics = grpo_loss(logp, adv, mask, ref_logprobs=logp.detach(), kl_coef=0.5)
    assert same.item() == pytest.approx(base.item())
    assert metrics["kl"] == pytest.approx(0.0, abs=1e-7)
    away, metrics = grpo_loss(logp, adv, mask, ref_logprobs=logp.detach() - 1, kl_coef=0.5)
    assert metrics["kl"] > 0 and away.item() > base.item()
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(logp, adv, mask, kl_coef=0.1)


def test_token_logprobs_apply_per_sample_temperature() -> None:
    logits = torch.randn(2, 3, 11)
    labels = torch.tensor([[-100, 4, 5], [-100, 4, 5]])
    logits[1] = logits[0]
    out = token_logprobs(logits, labels, torch.tensor([1.0, 2.0]))
    ref = torch.log_softmax(logits[0] / 2.0, -1)
    assert out[0, 0] == 0 and out[1, 0] == 0
    assert out[1, 1].item() == pytest.approx(ref[1, 4].item(), abs=1e-5)
    assert out[0, 1].item() != pytest.approx(out[1, 1].item())
    # temperature 0 (greedy) counts as 1
    zero = token_logprobs(logits, labels, torch.tensor([0.0, 0.0]))
    assert torch.allclose(zero[0], out[0])


# ------------------------------------------------------------------------ padding/advantages


def _group(n: int = 4, **extra) -> dict:
    tokens = [[1, 2, 3] + [10 + i] * (i + 1) for i in range(n)]
    masks = [[-100, -100, -100] + t[3:] for t in tokens]
    group = {
        "tokens": tokens,
        "masks": masks,
        "scores": [float(i) for i in range(n)],
        "advantages": None,
        "inference_logprobs": None,
        "overrides": None,
        "generation_params": None,
        "group_overrides": None,
    }
    group.update(extra)
    return group


def test_padded_length_matches_upstream() -> None:
    assert padded_length(65) == 65
    assert padded_length(66) == 129
    assert padded_length(10) == 65
    assert padded_length(1) == 1


def test_group_advantages_normalise_and_honour_overrides() -> None:
    adv = group_advantages(_group())
    t = torch.tensor([0.0, 1, 2, 3])
    assert adv == pytest.approx(((t - t.mean()) / t.std()).tolist())
    assert group_advantages(_group(1)) == [0.0]  # a single item keeps its raw score
    same = group_advantages(_group(scores=[1.0] * 4))
    assert same == [0.0] * 4
    zeroed = group_advantages(_group(overrides=[{}, {"set_advantage_to_zero": True}, None, {}]))
    assert zeroed[1] == 0.0 and zeroed[0] != 0.0
    env = group_advantages(_group(advantages=[[0.5], [1, 2, 3, 4, 5], [2.0], [3.0]]))
    assert env[0] == 0.5 and env[1] == [1.0, 2.0, 3.0, 4.0, 5.0]


def test_temperature_precedence() -> None:
    g = _group(
        overrides=[{"temperature": 0.3}, {}, {}, {}],
        generation_params={"temperature": 0.7},
        group_overrides={"temperature": 0.9},
    )
    assert sample_temperature(g, 0) == 0.3
    assert sample_temperature(g, 1) == 0.7
    assert sample_temperature(_group(group_overrides={"temperature": 0.9}), 1) == 0.9
    assert sample_temperature(_group(), 2) == 1.0


def test_prepare_batch_shifts_pads_and_keeps_the_remainder() -> None:
    with_lp = _group(inference_logprobs=[[1.0, 1.0, 1.0] + [-0.5] * (i + 1) for i in range(4)])
    batch = prepare_batch([_group(), with_lp], micro_batch_size=3)
    assert [mb.input_ids.shape[0] for mb in batch.micro_batches] == [3, 3, 2]
    mb = batch.micro_batches[0]
    assert mb.input_ids.shape == (3, 64)  # longest 7 -> 65, minus the shift
    assert mb.input_ids[1, :5].tolist() == [1, 2, 3, 11, 11]
    assert mb.labels[1, :5].tolist() == [-100, -100, 11, 11, -100]
    assert batch.num_tokens == 2 * (1 + 2 + 3 + 4)
    assert batch.num_sequences == 8 and batch.reward_mean == pytest.approx(1.5)
    # null inference_logprobs -> NaN; present ones shifted like the labels, 1.0 -> NaN
    assert torch.isnan(batch.micro_batches[0].old_logprobs).all()
    last = batch.micro_batches[2]  # sequences 2 and 3 of the second group
    assert last.old_logprobs[0, 2].item() == -0.5 and torch.isnan(last.old_logprobs[0, 0])
    with pytest.raises(ValueError, match="empty batch"):
        prepare_batch([], 2)


# ----------------------------------------------------------------------------- config


def test_config_yaml_then_flags(tmp_path: Path) -> None:
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("model: m\nlr: 3.0e-6\nvllm_restart_interval: 5\ntraining-steps: 7\n")
    config = load_config(["--config", str(yaml_file), "--lr", "1e-4"])
    assert config.model_name == "m"
    assert config.lr == 1e-4  # flag wins
    assert config.weight_sync_interval == 5  # upstream's name accepted
    assert config.training_steps == 7
    config = load_config(["--model", "x", "--vllm-restart-interval", "2", "--no-progress"])
    assert config.weight_sync_interval == 2 and config.progress is False
    assert load_config(["--model-name", "x", "--api-url", "http://h:1"]).atropos_url == "http://h:1"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "x", "--lr", "0"], "--lr: Input should be greater than 0"),
        (["--model", "x", "--loss-normalization", "mean"], "--loss-normalization"),
        ([], "--model-name: Field required"),
        (["--model", "x", "--reference-model", "y"], "kl_coef"),
    ],
)
def test_bad_config_names_the_flag(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        load_config(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_unknown_yaml_key_is_refused(tmp_path: Path, capsys) -> None:
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("model: m\nlearning_rate: 1\n")
    with pytest.raises(SystemExit):
        load_config(["--config", str(yaml_file)])
    assert "unknown field(s) learning_rate" in capsys.readouterr().err
