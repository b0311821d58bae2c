"""The GRPO loss, padding/advantages, and the trainer's config loading."""

from __future__ import annotations

import json
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
from example_trainer.metrics import TrainingLogger, staleness_metrics

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


def test_clip_delta_caps_the_ratio_of_negative_advantage_tokens_only() -> None:
    """Dual clipping (TRL's delta, verl's clip_ratio_c): a token whose probability grew more
    than delta-fold since sampling and whose advantage is negative costs delta*|A| and adds no
    gradient; below delta, or with a positive advantage, the loss is the standard one."""
    logp = torch.tensor([[-1.0, -1.0, -1.0]], requires_grad=True)
    mask = torch.ones(1, 3)
    # ratios e^2 (7.39, above delta 3), e^0.5 (1.65, below it) and 1
    old = torch.tensor([[-3.0, -1.5, -1.0]])
    standard, plain = grpo_loss(logp, -torch.ones(1, 3), mask, old, clip_eps=0.2)
    assert standard.item() == pytest.approx((math.exp(2) + math.exp(0.5) + 1) / 3, rel=1e-5)
    assert plain["ratio_max"] == pytest.approx(math.exp(2), rel=1e-5)
    assert plain["delta_clipped_fraction"] == 0.0
    loss, metrics = grpo_loss(logp, -torch.ones(1, 3), mask, old, clip_eps=0.2, clip_delta=3.0)
    loss.backward()
    assert loss.item() == pytest.approx((3.0 + math.exp(0.5) + 1) / 3, rel=1e-5)
    assert logp.grad[0, 0].item() == 0.0
    assert logp.grad[0, 1].item() == pytest.approx(math.exp(0.5) / 3, rel=1e-5)
    assert metrics["delta_clipped_fraction"] == pytest.approx(1 / 3)
    # a positive advantage is clipped at 1 + eps as before: delta changes nothing
    a, _ = grpo_loss(logp, torch.ones(1, 3), mask, old, clip_eps=0.2, clip_delta=3.0)
    b, _ = grpo_loss(logp, torch.ones(1, 3), mask, old, clip_eps=0.2)
    assert a.item() == pytest.approx(b.item())
    with pytest.raises(ValueError, match="clip_delta must be greater than 1 \\+ clip_eps"):
        grpo_loss(logp, torch.ones(1, 3), mask, old, clip_eps=0.2, clip_delta=1.1)


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


def test_upstream_padding_shifts_pads_and_keeps_the_remainder() -> None:
    with_lp = _group(inference_logprobs=[[1.0, 1.0, 1.0] + [-0.5] * (i + 1) for i in range(4)])
    batch = prepare_batch([_group(), with_lp], micro_batch_size=3, upstream_padding=True)
    assert [mb.input_ids.shape[0] for mb in batch.micro_batches] == [3, 3, 2]
    mb = batch.micro_batches[0]
    assert mb.input_ids.shape == (3, 64)  # longest 7 -> 65, minus the shift
    assert mb.prefix_ids is None
    assert mb.input_ids[1, :5].tolist() == [1, 2, 3, 11, 0]  # the last token predicts nothing
    assert mb.labels[1, :5].tolist() == [-100, -100, 11, 11, -100]
    assert batch.num_tokens == 2 * (1 + 2 + 3 + 4)
    assert batch.num_sequences == 8 and batch.reward_mean == pytest.approx(1.5)
    # null inference_logprobs -> NaN; present ones shifted like the labels, 1.0 -> NaN
    assert torch.isnan(batch.micro_batches[0].old_logprobs).all()
    last = batch.micro_batches[2]  # sequences 2 and 3 of the second group
    assert last.old_logprobs[0, 2].item() == -0.5 and torch.isnan(last.old_logprobs[0, 0])
    with pytest.raises(ValueError, match="empty batch"):
        prepare_batch([], 2)


def test_default_layout_shares_prompts_and_pads_each_micro_batch_to_its_own_length() -> None:
    prompt = list(range(100, 120))  # 20 untrained prompt tokens shared by the group
    tokens = [prompt + [7] * (i + 1) for i in range(4)]
    group = _group(
        tokens=tokens,
        masks=[[-100] * 20 + t[20:] for t in tokens],
        inference_logprobs=[[1.0] * 20 + [-0.25] * (i + 1) for i in range(4)],
    )
    lone = _group(n=1, scores=[0.5])  # a group of one cannot share its prompt
    batch = prepare_batch([group, lone], micro_batch_size=2, pad_multiple=1)
    shared = [mb for mb in batch.micro_batches if mb.prefix_ids is not None]
    assert [tuple(mb.input_ids.shape) for mb in shared] == [(2, 2), (2, 4)]
    # the prompt minus its last token is shared; each row starts with that last token
    assert shared[0].prefix_ids.tolist() == prompt[:-1]
    assert shared[0].input_ids[:, 0].tolist() == [119, 119]
    assert shared[0].labels.tolist() == [[7, -100], [7, 7]]
    assert shared[1].labels[1].tolist() == [7, 7, 7, 7]
    assert shared[1].old_logprobs[1, :4].tolist() == [-0.25] * 4
    loose = [mb for mb in batch.micro_batches if mb.prefix_ids is None]
    assert [tuple(mb.input_ids.shape) for mb in loose] == [(1, 3)]
    assert batch.num_sequences == 5 and batch.total_tokens == 20 * 4 + 10 + 4
    assert batch.computed_tokens == 2 * 19 + 2 * 2 + 2 * 4 + 3
    assert batch.flat_groups == 0


def test_zero_advantage_rows_are_skipped_but_still_counted() -> None:
    flat = _group(scores=[1.0] * 4)
    batch = prepare_batch([_group(), flat], micro_batch_size=8, skip_zero_advantage=True)
    assert batch.skipped_sequences == 4 and batch.flat_groups == 1
    assert sum(mb.input_ids.shape[0] for mb in batch.micro_batches) == 4
    assert batch.num_sequences == 8 and batch.num_tokens == 2 * (1 + 2 + 3 + 4)
    nothing = prepare_batch([flat], micro_batch_size=8, skip_zero_advantage=True)
    assert nothing.micro_batches == [] and nothing.flat_groups == 1


@pytest.mark.parametrize("upstream_padding", [False, True])
def test_batch_keeps_each_groups_policy_version(upstream_padding: bool) -> None:
    groups = [_group(policy_version=3), _group(), _group(policy_version=5)]
    batch = prepare_batch(groups, micro_batch_size=4, upstream_padding=upstream_padding)
    assert batch.policy_versions == [3, None, 5]


def test_staleness_is_versions_behind_the_weights_trained(tmp_path: Path) -> None:
    # the batch of step 6 is trained on version 5: TRL's count, 0 is on-policy
    assert staleness_metrics([3, None, 5], step=6) == {
        "versioned_group_fraction": pytest.approx(2 / 3),
        "staleness_mean": 1.0,
        "staleness_max": 2.0,
    }
    assert staleness_metrics([5, 5], step=6)["staleness_max"] == 0.0  # on-policy: 0
    assert staleness_metrics([None, None], step=6) == {"versioned_group_fraction": 0.0}
    # logged with the step's other metrics
    log = TrainingLogger(10, 0, tmp_path / "metrics.jsonl", progress=False)
    log.log(
        6,
        {"loss": 0.1, "reward_mean": 0.5, "sync_seconds": 0.0, **staleness_metrics([4, 5], 6)},
    )
    log.close()
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert (record["step"], record["staleness_mean"], record["staleness_max"]) == (6, 0.5, 1.0)


def _sample_batch(vocab: int, common: int = 0) -> list[dict]:
    """Groups like an env's: shared chat prompts, replies of several lengths, one flat group,
    per-sample temperatures and sampler log-probabilities; ``common``: the first tokens of
    every prompt are the same (a system prompt)."""
    g = torch.Generator().manual_seed(5)
    system = torch.randint(5, vocab, (common,), generator=g).tolist()
    groups = []
    for prompt_len, n, flat in [(23, 4, False), (31, 3, False), (17, 4, True), (12, 1, False)]:
        prompt = system + torch.randint(5, vocab, (prompt_len - common,), generator=g).tolist()
        tokens, masks, old = [], [], []
        for i in range(n):
            reply = torch.randint(5, vocab, (2 + 3 * i,), generator=g).tolist()
            tokens.append(prompt + reply)
            masks.append([-100] * prompt_len + reply)
            # near the tiny model's own log-probabilities (~ -log(vocab)), so ratios are ~1
            near = -math.log(vocab) + 0.3 * torch.randn(len(reply), generator=g)
            old.append([1.0] * prompt_len + near.tolist())
        scores = [1.0] * n if flat else torch.rand(n, generator=g).tolist()
        groups.append(
            _group(
                n=n,
                tokens=tokens,
                masks=masks,
                scores=scores,
                inference_logprobs=old,
                overrides=[{"temperature": 0.5 + 0.25 * i} for i in range(n)],
            )
        )
    return groups


def test_packing_runs_each_common_beginning_once(tiny_model_dir: Path) -> None:
    """Rows packed into one sequence: a system prompt shared by two groups, a group's prompt,
    identical replies and a reply that is the beginning of another each run once, and every
    row gets the log-probabilities it gets run on its own."""
    from transformers import AutoModelForCausalLM

    from example_trainer.forward import policy_logprobs

    system, q1, q2 = [11, 12, 13, 14, 15], [21, 22], [31, 32, 33]
    replies = [[41, 42, 43], [41, 42, 43], [41, 42], [44, 45]]
    groups = [
        _group(
            n=4,
            tokens=[system + q + r for r in replies],
            masks=[[-100] * (len(system) + len(q)) + r for r in replies],
            scores=[1.0, 0.0, 0.5, 0.25],
        )
        for q in (q1, q2)
    ]
    packed = prepare_batch(groups, 2, pack_tokens=1024)
    (mb,) = packed.micro_batches
    # per group: 5 system (shared by both groups) + its question + [41, 42] + [44]
    assert packed.computed_tokens == 5 + (2 + 2 + 1) + (3 + 2 + 1)
    assert mb.packed is not None and mb.packed.ids.numel() == packed.computed_tokens
    # positions are each token's place in its own row (the longest row has 10 inputs)
    assert sorted(set(mb.packed.positions.tolist())) == list(range(10))

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        got = policy_logprobs(model, mb, "cpu")
        for i in range(mb.labels.shape[0]):  # each row on its own, unpacked
            length = int((mb.packed.index[i] != 0).sum()) + 1
            alone = model(input_ids=mb.input_ids[i : i + 1, :length]).logits[0].log_softmax(-1)
            labels = mb.labels[i, :length]
            trained = labels != -100
            want = alone[trained].gather(1, labels[trained].unsqueeze(1)).squeeze(1)
            assert torch.allclose(got[i, :length][trained], want, atol=1e-5), i


@pytest.mark.parametrize(
    ("normalization", "packed"), [("sequence", False), ("token", False), ("sequence", True)]
)
def test_fast_layout_gives_the_same_loss_and_gradient_as_upstream_padding(
    tiny_model_dir: Path, normalization: str, packed: bool
) -> None:
    """Prompt sharing, length buckets, packing, trained-position logits and zero-advantage
    skipping change the work done, never the gradient: both layouts train the same step."""
    from transformers import AutoModelForCausalLM

    from example_trainer.forward import check_fast_path, check_packed_path, policy_logprobs

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert check_fast_path(model, "cpu")
    assert check_packed_path(model, "cpu")
    groups = _sample_batch(model.config.vocab_size, common=8 if packed else 0)

    def loss_and_grads(batch, fast: bool):
        model.zero_grad()
        total = 0.0
        for mb in batch.micro_batches:
            logp = policy_logprobs(model, mb, "cpu", fast=fast)
            loss, _ = grpo_loss(
                logp,
                mb.advantages,
                mb.mask,
                mb.old_logprobs,
                normalization=normalization,
                num_sequences=batch.num_sequences,
                num_tokens=batch.num_tokens,
            )
            loss.backward()
            total += loss.item()
        return total, {n: p.grad.clone() for n, p in model.named_parameters()}

    reference = prepare_batch(groups, 3, upstream_padding=True)
    fast = prepare_batch(groups, 3, skip_zero_advantage=True, pack_tokens=40 if packed else 0)
    assert fast.skipped_sequences == 4
    if packed:  # a budget of 40 tokens: several passes, each without padding
        assert len(fast.micro_batches) > 1
        assert all(mb.packed is not None for mb in fast.micro_batches)
        shared = prepare_batch(groups, 3, skip_zero_advantage=True)
        assert fast.computed_tokens < shared.computed_tokens
    else:
        assert any(mb.prefix_ids is not None for mb in fast.micro_batches)
    assert fast.computed_tokens < reference.computed_tokens / 2
    ref_loss, ref_grads = loss_and_grads(reference, fast=False)
    new_loss, new_grads = loss_and_grads(fast, fast=True)
    assert new_loss == pytest.approx(ref_loss, rel=1e-4, abs=1e-6)
    for name, grad in ref_grads.items():
        assert torch.allclose(new_grads[name], grad, atol=1e-5, rtol=1e-3), name
    assert max(g.abs().max().item() for g in ref_grads.values()) > 1e-4  # a real gradient


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
        (["--model", "x", "--lr", "0"], "--lr '0': Input should be greater than 0"),
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


def test_pack_tokens_default_depends_on_the_device() -> None:
    """Unset, ``pack_tokens`` is 1024 on a CPU and 8192 on a GPU (larger passes are 2-4x
    faster there, bench/README.md); a value given, 0 included, is kept on either."""
    from example_trainer.config import TrainingConfig

    def packs(**fields) -> int:
        return TrainingConfig(model_name="m", **fields).resolved_pack_tokens()

    assert packs(device="cpu") == 1024
    assert packs(device="cuda") == packs(device="cuda:1") == 8192
    assert packs(device="cuda", pack_tokens=0) == packs(device="cpu", pack_tokens=0) == 0
    assert packs(device="cpu", pack_tokens=2048) == 2048


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("warmup", [0, 3])
def test_lr_schedules_match_transformers_schedules_of_the_same_name(kind: str, warmup: int):
    """lr_scheduler_type means what it means in transformers (and TRL): the trainer's factor
    on lr equals transformers' schedule at every step."""
    import torch
    from transformers import get_scheduler

    from example_trainer.config import lr_multiplier

    total = 20
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    name = "constant_with_warmup" if kind == "constant" else kind
    theirs = get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total)
    for step in range(total):
        # after warm-up the same factor at the same step; during warm-up ours is one step
        # ahead (the full rate at the last warm-up step, where transformers' starts at 0)
        if step < warmup:
            expected = theirs.lr_lambdas[0](step + 1)
        else:
            expected = theirs.get_last_lr()[0]
        assert lr_multiplier(step, warmup, total, kind) == pytest.approx(expected, abs=1e-9), step
        optimizer.step()
        theirs.step()
