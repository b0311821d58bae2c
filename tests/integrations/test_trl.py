"""TRL's GRPOTrainer on atroposlib environments (``atroposlib.integrations.trl``), for real.

Against a real ``run-api`` (and, for learning, a real ``atropos-serve`` and environment), with
TRL 1.16 and the tiny random model:

* what TRL trains on is exactly the contract: completion ids, the env mask of a multi-turn
  sequence, the contract's advantages (explicit ones, ``set_advantage_to_zero`` with the score in
  the baseline), the sampler's log-probs in TRL's importance-sampling correction;
* a group whose size is not ``num_generations`` stops training with a message naming both;
* ``atropos-quickstart --trainer trl`` raises the token-share reward within a few steps and
  pushes every step's weights to the server;
* under ``accelerate launch --num_processes 2`` each sequence is trained by exactly one rank,
  and an error on rank 0 ends both ranks.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("trl")  # the trl extra; .ci/run installs it (a skip fails CI)

from atroposlib.trainer import rows_from_group  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "PYTHONUNBUFFERED": "1",
    "WANDB_MODE": "disabled",
    "TRL_EXPERIMENTAL_SILENCE": "1",
}
os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"


def _post_when_registered(url: str, groups: list[dict[str, Any]], errors: list[str]) -> None:
    """Wait for the trainer's /register, then post ``groups`` as one environment."""
    with httpx.Client(base_url=url, timeout=10) as client:
        deadline = time.monotonic() + 120
        while client.get("/info").json().get("batch_size", -1) == -1:
            if time.monotonic() > deadline:
                errors.append("the trainer never registered")
                return
            time.sleep(0.2)
        for group in groups:
            reply = client.post("/scored_data", json=group)
            if reply.status_code != 200:
                errors.append(f"{reply.status_code} {reply.text}")


def _poster(url: str, groups: list[dict[str, Any]]) -> tuple[threading.Thread, list[str]]:
    errors: list[str] = []
    thread = threading.Thread(target=_post_when_registered, args=(url, groups, errors), daemon=True)
    thread.start()
    return thread, errors


def _config(tmp_path: Path, **extra: Any) -> Any:
    from trl import GRPOConfig

    values = {
        "output_dir": str(tmp_path / "trl"),
        "max_steps": 1,
        "per_device_train_batch_size": 8,
        "num_generations": 4,
        "gradient_accumulation_steps": 1,
        "learning_rate": 1e-3,
        "use_cpu": True,
        "bf16": False,  # TRL's default autocasts to bfloat16, on a CPU too
        "report_to": [],
        "save_strategy": "no",
        "activation_checkpointing": False,
        "logging_steps": 1,
        "disable_tqdm": True,
    }
    values.update(extra)
    return GRPOConfig(**values)


# prompt [1, 20, 21]; completions of 2-6 tokens
SINGLE_TURN = {
    "tokens": [[1, 20, 21, 30, 31], [1, 20, 21, 32, 33, 34], [1, 20, 21, 35], [1, 20, 21, 36, 37]],
    "masks": [
        [-100, -100, -100, 30, 31],
        [-100, -100, -100, 32, 33, 34],
        [-100, -100, -100, 35],
        [-100, -100, -100, 36, 37],
    ],
    "scores": [1.0, 0.0, 0.0, 0.5],
    # the 0.5 sequence is zeroed: its score stays in the baseline, its advantage is 0
    "overrides": [{}, {}, {}, {"set_advantage_to_zero": True}],
    "inference_logprobs": [
        [1.0, 1.0, 1.0, -2.0, -3.0],
        [1.0, 1.0, 1.0, -1.0, -2.5, -0.5],
        [1.0, 1.0, 1.0, -4.0],
        [1.0, 1.0, 1.0, -1.5, -2.0],
    ],
    "policy_version": 0,
}
# user [1, 40, 41] | assistant [50, 51] | tool [90, 91] (not trained) | assistant [52]
MULTI_TURN = {
    "tokens": [[1, 40, 41, 50 + i, 51, 90, 91, 52 + i] for i in range(4)],
    "masks": [[-100, -100, -100, 50 + i, 51, -100, -100, 52 + i] for i in range(4)],
    "scores": [0.0, 0.0, 0.0, 0.0],
    # explicit per-token advantages, against what the (flat) scores would give
    "advantages": [[0.0, 0.0, 0.0, 1.0 + i, 2.0, 0.0, 0.0, -1.0] for i in range(4)],
}


def _recording(base: type, seen: list[dict[str, Any]]) -> type:
    """``base`` keeping a copy of every tensor its loss is given, in ``seen``."""

    class Recording(base):
        def _compute_loss(self, model, inputs):
            seen.append({k: v.detach().clone() for k, v in inputs.items() if hasattr(v, "detach")})
            return super()._compute_loss(model, inputs)

    return Recording


def test_trl_trains_on_exactly_the_contract(tmp_path: Path, tiny_model_dir: Path, start_api):
    from atroposlib.integrations.trl import AtroposGRPOTrainer, AtroposRollout

    api = start_api()
    seen: list[dict[str, Any]] = []
    Recording = _recording(AtroposGRPOTrainer, seen)
    thread, errors = _poster(api.url, [SINGLE_TURN, MULTI_TURN])
    trainer = Recording(
        str(tiny_model_dir),
        _config(tmp_path),
        rollout=AtroposRollout(api.url, max_token_len=64, batch_timeout=60),
    )
    trainer.train()
    thread.join(5)
    assert not errors
    (inputs,) = seen
    expected = {
        tuple(r.completion_ids): r for g in (SINGLE_TURN, MULTI_TURN) for r in rows_from_group(g)
    }
    assert len(inputs["completion_ids"]) == 8
    advantages = inputs["advantages"]
    assert advantages.dim() == 2  # per-token: the multi-turn group sent per-token advantages
    for i, (ids, mask) in enumerate(
        zip(inputs["completion_ids"], inputs["completion_mask"], strict=True)
    ):
        n = int(mask.sum())
        row = expected[tuple(ids[:n].tolist())]
        assert inputs["tool_mask"][i, :n].tolist() == row.loss_mask
        assert advantages[i, :n].tolist() == pytest.approx(row.advantages, abs=1e-6)
        # TRL's importance-sampling correction ran with the sampler's log-probs: a ratio per
        # sequence, finite, positive
        ratio = inputs["importance_sampling_ratio"][i]
        assert bool((ratio >= 0).all())
    zeroed = expected[(36, 37)]
    assert zeroed.advantages == [0.0, 0.0]
    # the zeroed score (0.5) stays in the baseline: mean 0.375, sample std of [1, 0, 0, 0.5]
    std = statistics.stdev([1.0, 0.0, 0.0, 0.5])
    assert expected[(30, 31)].advantage == pytest.approx((1.0 - 0.375) / std)
    assert expected[(50, 51, 90, 91, 52)].loss_mask == [1, 1, 0, 0, 1]
    # the batch was taken from run-api as step 1
    assert httpx.get(api.url + "/status").json()["current_step"] == 1


def test_sampler_log_probs_are_the_old_policy_and_match_the_model(
    tmp_path: Path, tiny_model_dir: Path, start_api
):
    """``importance_sampling="sampler"``: the clipped ratio's old policy is what the sampler
    reported; ``"trl"``: TRL's own pre-step log-probs, which (with the head scoring only the
    completion positions, ``score_trained_positions_only``) are the model's own."""
    import torch
    from transformers import AutoModelForCausalLM

    from atroposlib.integrations.trl import AtroposGRPOTrainer, AtroposRollout

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    expected = {tuple(r.completion_ids): r for r in rows_from_group(SINGLE_TURN)}
    for mode in ("sampler", "trl"):
        api = start_api()
        seen: list[dict[str, Any]] = []
        Recording = _recording(AtroposGRPOTrainer, seen)
        other = {
            **SINGLE_TURN,
            "tokens": [t[:3] + [t[3] + 100] + t[4:] for t in SINGLE_TURN["tokens"]],
        }
        other["masks"] = [[-100, -100, -100, *t[3:]] for t in other["tokens"]]
        thread, errors = _poster(api.url, [SINGLE_TURN, other])
        trainer = Recording(
            str(tiny_model_dir),
            _config(tmp_path / mode),
            rollout=AtroposRollout(api.url, max_token_len=64, batch_timeout=60),
            importance_sampling=mode,
        )
        trainer.train()
        thread.join(5)
        assert not errors
        (inputs,) = seen
        old = inputs["old_per_token_logps"]
        for i, (ids, mask) in enumerate(
            zip(inputs["completion_ids"], inputs["completion_mask"], strict=True)
        ):
            n = int(mask.sum())
            row = expected.get(tuple(ids[:n].tolist()))
            if mode == "sampler" and row is not None:
                assert old[i, :n].tolist() == pytest.approx(row.sampler_logprobs)
            if mode == "trl":
                full = torch.tensor([[1, 20, 21, *ids[:n].tolist()]])
                with torch.no_grad():
                    logp = torch.log_softmax(model(input_ids=full).logits[0, 2:-1], -1)
                mine = logp.gather(-1, full[0, 3:, None]).squeeze(-1)
                assert torch.allclose(old[i, :n], mine, atol=1e-4)
        logged = [h for h in trainer.state.log_history if "loss" in h]
        if mode == "trl":
            assert "importance_sampling_ratio" in inputs
        else:
            assert "importance_sampling_ratio" not in inputs
            # the quickstart's mean_ratio: exp(policy - sampler) over trained tokens
            assert logged and logged[0]["atropos/mean_ratio"] > 0
        api.stop()


def test_group_of_the_wrong_size_is_refused(tmp_path: Path, tiny_model_dir: Path, start_api):
    from atroposlib.integrations.trl import AtroposGRPOTrainer, AtroposRollout, GroupSizeError

    api = start_api()
    three = {k: v[:3] for k, v in SINGLE_TURN.items() if isinstance(v, list)}
    five = {
        "tokens": [[1, 2, 3, 4]] * 5,
        "masks": [[-100, -100, 3, 4]] * 5,
        "scores": [0.0, 1.0, 0.0, 1.0, 0.0],
    }
    thread, errors = _poster(api.url, [three, five])
    trainer = AtroposGRPOTrainer(
        str(tiny_model_dir),
        _config(tmp_path),
        rollout=AtroposRollout(api.url, max_token_len=64, batch_timeout=60),
    )
    with pytest.raises(GroupSizeError) as info:
        trainer.train()
    thread.join(5)
    assert not errors
    message = str(info.value)
    assert "has 3 sequences but GRPOConfig.num_generations is 4" in message
    assert "--env.group_size 4" in message


@pytest.mark.slow
@pytest.mark.nightly  # ~4 min on 2 cores; the adapter's contract tests run per commit
def test_quickstart_with_trl_raises_the_reward(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The same loop as tests/trainer/test_learning.py, with TRL as the trainer."""
    out = tmp_path / "run"
    steps = 12
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "example_trainer.quickstart",
            "--trainer",
            "trl",
            "--model",
            str(tiny_model_dir),
            "--env",
            str(REPO / "tests" / "trainer" / "token_env.py"),
            "--steps",
            str(steps),
            "--seed",
            "0",
            "--group-size",
            "8",
            "--batch-size",
            "32",
            "--micro-batch-size",
            "8",
            "--lr",
            "1e-2",
            "--output",
            str(out),
            "--batch-timeout",
            "180",
            "--env-arg",
            "env.max_answer_tokens=12",
            "--env-arg",
            "env.max_batches_offpolicy=1",
            "--trainer-arg",
            "pause_generation=true",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        env=ENV,
        cwd=tmp_path,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps_seen = [r for r in records if "reward_mean" in r]
    assert [r["step"] for r in steps_seen] == list(range(1, steps + 1))
    rewards = [r["reward_mean"] for r in steps_seen]
    first, last = statistics.mean(rewards[:2]), statistics.mean(rewards[-3:])
    # a random model puts ~1/8 of its reply tokens in the target set; TRL must raise it
    assert 0.03 < first < 0.3, rewards
    assert last > first + 0.3, rewards
    assert steps_seen[0]["mean_ratio"] == pytest.approx(1.0, abs=0.05)
    assert all(r["sync_seconds"] > 0 for r in steps_seen)
    assert (out / "final_model" / "config.json").is_file()


def _tagged(tag: int) -> dict[str, Any]:
    """A group of 4 whose completions all carry ``tag`` (so a rank's report names the group)."""
    return {
        "tokens": [[1, 2, tag, tag + i] for i in range(4)],
        "masks": [[-100, -100, tag, tag + i] for i in range(4)],
        "scores": [0.0, 1.0, 0.0, 1.0],
    }


@pytest.mark.nightly  # out of per-commit CI (time budget): .ci/nightly runs it
@pytest.mark.slow
def test_two_ranks_train_each_sequence_once(tmp_path: Path, tiny_model_dir: Path, start_api):
    """``accelerate launch --multi_gpu --num_processes 2`` (no GPU here: gloo on the CPU): rank 0 pulls each batch and
    every rank trains its own whole groups; an error on rank 0 ends both ranks."""
    api = start_api()
    steps = 3
    tags = [100 + 10 * i for i in range(2 * steps)]
    thread, errors = _poster(api.url, [_tagged(t) for t in tags])
    out = tmp_path / "ranks"
    out.mkdir()
    launch = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(_free_port()),
        str(Path(__file__).with_name("trl_ranks.py")), api.url, str(tiny_model_dir), str(out),
    ]  # fmt: skip
    proc = subprocess.run(
        [*launch, str(steps)], capture_output=True, text=True, env=ENV, timeout=600
    )
    thread.join(5)
    assert not errors
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    trained = {}
    for rank in (0, 1):
        for line in (out / f"rank{rank}.jsonl").read_text().splitlines():
            ids = json.loads(line)
            trained.setdefault(ids[0], set()).add(rank)
    # each group (its tag) trained on one rank only, every group trained, both ranks worked
    assert sorted(trained) == tags, trained
    assert all(len(ranks) == 1 for ranks in trained.values()), trained
    assert {r for ranks in trained.values() for r in ranks} == {0, 1}
    counts = {rank: len((out / f"rank{rank}.jsonl").read_text().splitlines()) for rank in (0, 1)}
    assert counts == {0: 4 * steps, 1: 4 * steps}

    # a group of the wrong size: both ranks stop with the message, neither waits forever
    api.stop()
    api2 = start_api()
    three = {k: v[:3] for k, v in _tagged(7).items()}
    five = {
        "tokens": [[1, 2, 9, 9]] * 5,
        "masks": [[-100, -100, 9, 9]] * 5,
        "scores": [0.0, 1.0, 0.0, 1.0, 0.0],
    }
    thread, errors = _poster(api2.url, [three, five])
    launch[launch.index(api.url)] = api2.url
    launch[launch.index("--main_process_port") + 1] = str(_free_port())
    started = time.monotonic()
    failed = subprocess.run([*launch, "1"], capture_output=True, text=True, env=ENV, timeout=300)
    assert failed.returncode != 0
    assert "GRPOConfig.num_generations is 4" in failed.stderr
    assert time.monotonic() - started < 300


def _free_port() -> int:
    from tests.conftest import free_port

    return free_port()


def test_trl_adapter_passes_the_trainer_conformance_check(tmp_path: Path, tiny_model_dir: Path):
    """``atropos-check-trainer --group-size 4 -- python trl_conformance.py``: every rule of the
    contract holds for TRL through the adapter (advantage values included: the adapter trains on
    the contract's advantages)."""
    from atroposlib.testing import check_trainer

    result = check_trainer(
        [sys.executable, str(Path(__file__).with_name("trl_conformance.py"))],
        model=str(tiny_model_dir),
        group_size=4,
        workdir=str(tmp_path / "check"),
        timeout=300,
    )
    print(result.render())
    assert result.passed, result.render()
    checked = {r.name for r in result.rules if r.status != "skip"}
    assert {"advantage_value", "explicit_advantages", "set_advantage_to_zero"} <= checked
    assert {"multi_turn_masks", "redelivery", "ack", "weights"} <= checked


def test_the_quick_starts_trl_config_carries_the_loss_settings(tmp_path: Path) -> None:
    """``--trainer trl`` maps the GRPO trainer's loss settings onto TRL's own: ``clip_eps`` to
    ``epsilon``, ``clip_delta`` (dual clipping, on by default) to ``delta``, whose loss is the
    one ``example_trainer.loss.grpo_loss`` computes (``coef_1`` capped at delta)."""
    from example_trainer.config import TrainingConfig
    from example_trainer.trl_train import grpo_config

    base = {"model_name": "m", "device": "cpu", "save_path": str(tmp_path), "dtype": "float32"}
    config = grpo_config(TrainingConfig(**base), num_generations=4, temperature=0.7)
    assert (config.epsilon, config.delta, config.beta) == (0.2, 3.0, 0.0)
    config = grpo_config(
        TrainingConfig(**base, clip_eps=0.3, clip_delta=None, kl_coef=0.01),
        num_generations=4,
        temperature=0.7,
    )
    assert (config.epsilon, config.delta, config.beta) == (0.3, None, 0.01)
