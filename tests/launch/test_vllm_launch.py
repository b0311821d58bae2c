"""``atropos-launch`` with ``inference.kind: vllm`` closes the loop, for real, on this machine:
run-api, "vLLM" (the stand-in ``tests/trainer/fake_vllm.py``, found as the ``vllm`` package on
the entry's ``PYTHONPATH``, speaking vLLM 0.32's OpenAI, RL and dev routes), an environment
and the GRPO trainer. The launcher starts vLLM in dev mode with the policy-version middleware
and processed log-probs; the environment gets ``server_type: vllm`` and its samples' token ids
and sampler log-probs from ``/v1/completions``; the trainer syncs the running vLLM in place
after every step and the groups carry policy versions. And the run descriptions whose trainer
cannot reach its server's weights are refused before anything starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from atroposlib.backends import PLUGIN_DIR, POLICY_VERSION_MIDDLEWARE

ROOT = Path(__file__).resolve().parents[2]
FAKE = ROOT / "tests" / "trainer" / "fake_vllm.py"
TOKEN_ENV = ROOT / "tests" / "trainer" / "token_env.py"


def _fake_vllm_package(folder: Path) -> Path:
    """A ``vllm`` package whose ``python -m vllm.entrypoints.openai.api_server`` is the
    stand-in."""
    package = folder / "vllm" / "entrypoints" / "openai"
    package.mkdir(parents=True)
    for path in (package, package.parent, package.parent.parent):
        (path / "__init__.py").write_text("")
    (package / "api_server.py").write_text(
        f"import runpy\nrunpy.run_path({str(FAKE)!r}, run_name='__main__')\n"
    )
    return folder


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _launch(spec: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "atroposlib.cli.launch", str(spec), "--status", "lines", *args],
        capture_output=True,
        text=True,
        env={
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "HF_HUB_OFFLINE": "1",
            "WANDB_MODE": "disabled",
        },  # fmt: skip
        cwd=ROOT,
        timeout=timeout,
    )


def test_a_vllm_run_syncs_weights_and_carries_tokens_logprobs_and_versions(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    fakepkg = _fake_vllm_package(tmp_path / "fakepkg")
    out = tmp_path / "out"
    spec = {
        "name": "vllm-loop",
        "output": str(out),
        "inference": [
            {
                "name": "policy",
                "kind": "vllm",
                "model": str(tiny_model_dir),
                "served_model_name": "policy",
                "startup_timeout": 60,
                "env": {
                    "PYTHONPATH": str(fakepkg),
                    "FAKE_VLLM_RECORD": str(tmp_path / "launches.jsonl"),
                    "FAKE_VLLM_CALLS": str(tmp_path / "calls.jsonl"),
                },
            }
        ],
        "environments": [
            {
                "file": str(TOKEN_ENV),
                "env": {
                    "group_size": 4,
                    "batch_size": 8,
                    "total_steps": 3,
                    "max_token_length": 256,
                    "max_answer_tokens": 8,
                    "tokenizer_name": str(tiny_model_dir),
                    "use_wandb": False,
                    "steps_per_eval": 0,
                    "data_path_to_save_groups": "{output}/rollouts.jsonl",
                },
                "max_restarts": 0,
            }
        ],
        "trainer": {
            "config": {
                "training_steps": 3,
                "batch_size": 4,
                "gradient_accumulation_steps": 2,
                "seq_len": 256,
                "lr": 1e-4,
                "weight_sync_interval": 1,
                "use_wandb": False,
                "progress": False,
                "batch_timeout": 300,
            }
        },
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(spec))
    result = _launch(path)
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]

    # vLLM was started once, with what the loop needs
    (launch,) = _lines(tmp_path / "launches.jsonl")
    argv = launch["argv"]
    assert argv[argv.index("--middleware") + 1] == POLICY_VERSION_MIDDLEWARE
    assert argv[argv.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert launch["env"]["VLLM_SERVER_DEV_MODE"] == "1"
    assert launch["env"]["ATROPOS_POLICY_VERSION"] == "0"
    assert launch["env"]["PYTHONPATH"].split(os.pathsep)[:2] == [str(PLUGIN_DIR), str(fakepkg)]

    # the environment asked for token ids and sampler log-probs
    env_config = yaml.safe_load((out / "configs" / "token_env.yaml").read_text())
    assert [s["server_type"] for s in env_config["openai"]] == ["vllm"]
    calls = _lines(tmp_path / "calls.jsonl")
    generations = [c["body"] for c in calls if c["path"] == "/v1/completions"]
    assert generations and all(
        g["return_token_ids"] and g["return_tokens_as_token_ids"] and g["logprobs"] == 0
        for g in generations
    )
    groups = _lines(out / "rollouts.jsonl")
    assert groups
    for group in groups:
        assert group["inference_logprobs"] is not None
        for tokens, masks, lps in zip(
            group["tokens"], group["masks"], group["inference_logprobs"], strict=True
        ):
            reply = [t for t, m in zip(tokens, masks, strict=True) if m != -100]
            assert reply and all(200 <= t < 264 or t == 2 for t in reply)  # the toy model's
            assert all(lp <= 0 for lp, m in zip(lps, masks, strict=True) if m != -100)

    # the trainer synced the running vLLM in place after every step, its step as the version
    trainer = yaml.safe_load((out / "configs" / "trainer.yaml").read_text())
    assert (trainer["inference"], trainer["launch_vllm"], trainer["weight_sync"]) == (
        "vllm",
        False,
        "reload",
    )
    reloads = [
        Path(c["body"]["kwargs"]["weights_path"]).name
        for c in calls
        if c["path"] == "/collective_rpc"
    ]
    versions = [c["body"]["new_version"] for c in calls if c["path"] == "/update_weight_version"]
    assert reloads == ["step_1", "step_2", "step_3"] and versions == ["1", "2", "3"]
    metrics = _lines(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(m["reload_seconds"] > 0 for m in metrics)
    # every group of every batch carried the policy version it was sampled at
    assert all(m["versioned_group_fraction"] == 1.0 for m in metrics)
    assert {g["policy_version"] for g in groups} <= {0, 1, 2, 3}
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["components"]["trainer"]["state"] == "done"


@pytest.mark.parametrize(
    ("inference", "message"),
    [
        (
            {"kind": "external", "url": "http://127.0.0.1:9/v1"},
            "inference[0] (policy, kind external): the trainer cannot reach this server's "
            "weights: openai: an OpenAI-compatible endpoint has no way to load new weights",
        ),
        (
            {"kind": "sglang", "model": "m", "weight_sync": "nccl"},
            "weight_sync nccl: sglang takes new weights by reload, not 'nccl'",
        ),
        (
            {"kind": "external", "url": "http://127.0.0.1:9/v1", "weight_sync": "reload"},
            "weight_sync reload: openai: an OpenAI-compatible endpoint",
        ),
    ],
)
def test_a_trainer_that_cannot_reach_its_servers_weights_is_refused(
    tmp_path: Path, inference: dict, message: str
) -> None:
    spec = {
        "output": str(tmp_path / "out"),
        "inference": [inference],
        "environments": [{"file": str(TOKEN_ENV)}],
        "trainer": {"config": {"training_steps": 1}},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(spec))
    result = _launch(path, "--dry-run", timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out" / "logs").exists()


def test_weight_sync_none_trains_against_an_openai_endpoint(tmp_path: Path) -> None:
    """The user's explicit ``weight_sync: none``: the run plans, the trainer syncs nothing."""
    from atroposlib.launch.plan import plan_run
    from atroposlib.launch.spec import load_run_spec

    spec = {
        "output": str(tmp_path / "out"),
        "inference": [
            {"kind": "external", "url": "http://gpu:8000/v1", "weight_sync": "none"},
        ],
        "environments": [{"file": str(TOKEN_ENV)}],
        "trainer": {"config": {"training_steps": 1}},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(spec))
    plan = plan_run(load_run_spec(path))
    assert plan.trainer is not None
    assert plan.trainer.files["configs/trainer.yaml"]["inference"] == "none"
    assert "ATROPOS_WEIGHT_SYNC" not in plan.trainer.env
    assert plan.inference[0].synced is False


def test_each_kind_is_planned_from_its_backend(tmp_path: Path) -> None:
    """What the launcher starts and gives the trainer, per kind: several copies of a vLLM are
    all synced; an external vLLM (server: vllm) is synced like a started one; NCCL adds vLLM's
    weight-transfer flag; a run without a trainer keeps the flags for one you start."""
    from atroposlib.launch.plan import plan_run, render
    from atroposlib.launch.spec import load_run_spec

    def plan(inference: list[dict], trainer: dict | None = None):
        spec = {"output": str(tmp_path / "out"), "inference": inference,
                "environments": [{"file": str(TOKEN_ENV)}]}  # fmt: skip
        if trainer is not None:
            spec["trainer"] = trainer
        path = tmp_path / "run.yaml"
        path.write_text(yaml.safe_dump(spec))
        return plan_run(load_run_spec(path))

    two = plan([{"kind": "vllm", "model": "m", "count": 2, "weight_sync": "nccl"}],
               {"config": {"training_steps": 1}})  # fmt: skip
    assert [c.name for c in two.inference] == ["policy-0", "policy-1"]
    assert all(c.synced and "--weight-transfer-config" in c.argv for c in two.inference)
    assert two.inference[0].env["VLLM_SERVER_DEV_MODE"] == "1"
    trainer = render(two.trainer.files["configs/trainer.yaml"],
                     {"synced_inference_urls": "http://a:1,http://b:2", "api_url": "x",
                      "output": "o"})  # fmt: skip
    assert (trainer["inference"], trainer["inference_url"], trainer["weight_sync"]) == (
        "vllm",
        "http://a:1,http://b:2",
        "nccl",
    )

    external = plan([{"kind": "external", "url": "http://gpu:8000/v1", "server": "vllm"}],
                    {"command": ["my-trainer"]})  # fmt: skip
    (server,) = external.inference
    assert (server.backend, server.synced, server.argv) == ("vllm", True, [])
    assert external.trainer.env["ATROPOS_WEIGHT_SYNC_BACKEND"] == "vllm"
    assert external.trainer.env["ATROPOS_WEIGHT_SYNC"] == "reload"

    trl = plan([{"kind": "trl-vllm-serve", "model": "m"}], {"config": {"training_steps": 1}})
    assert trl.inference[0].argv[1:3] == ["-m", "trl.scripts.vllm_serve"]
    assert trl.trainer.files["configs/trainer.yaml"]["inference"] == "trl-vllm-serve"

    mixed = [{"kind": "vllm", "model": "m"}, {"name": "b", "kind": "atropos-serve", "model": "m"}]
    with pytest.raises(Exception, match="syncs one kind"):
        plan(mixed, {"config": {"training_steps": 1}})
    alone = plan([{"kind": "vllm", "model": "m", "weight_sync": "nccl"}])
    assert "--weight-transfer-config" in alone.inference[0].argv
