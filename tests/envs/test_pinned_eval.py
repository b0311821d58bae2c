"""Evaluations pinned to a policy version, through HTTP with real processes: run-api,
``atropos-serve`` (tiny model, hot-reloaded to change its version) and two environments.

A trainer asks (``POST /eval-request``) for the weights of version v; each env evaluates only
once its server serves v (waiting while it is behind), refuses when it is ahead or when the
weights change during the evaluation, and reports; run-api records each result with its
version (``GET /eval-results``, ``/metrics``); the example trainer's barrier logs them with
their step.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from atroposlib.api.client import TrainerClient
from tests.conftest import ApiProcess, ServeProcess
from tests.envs.helpers import REPO, start_env, stop

VERSION_ENV = Path(__file__).with_name("version_eval_env.py")


def _env_flags(api: ApiProcess, server: ServeProcess, tokenizer: Path, name: str, *extra: str,
               delay: float = 0.05):  # fmt: skip
    return (
        "--env.rollout_server_url", api.url, "--env.group_size", "2",
        "--env.tokenizer_name", str(tokenizer), "--env.use_wandb", "false",
        "--env.steps_per_eval", "0", "--env.wandb_name", name, "--env.rollout_delay", str(delay),
        "--openai.base_url", f"{server.url}/v1", "--openai.model_name", "tiny",
        "--openai.server_type", "atropos-serve", "--openai.tokenizer_name", str(tokenizer),
        "--openai.api_key", "x", *extra,
    )  # fmt: skip


def _start(api: ApiProcess, server: ServeProcess, tokenizer: Path, tmp_path: Path, name: str,
           *extra: str, delay: float = 0.05):  # fmt: skip
    """One ``version_eval_env.py serve`` process named ``name``, logging to tmp_path."""
    return start_env(
        VERSION_ENV,
        "serve",
        *_env_flags(api, server, tokenizer, name, *extra, delay=delay),
        log=tmp_path / f"{name}.log",
        cwd=REPO,
    )


def _reload(server: ServeProcess, model: Path, version: int) -> None:
    reply = httpx.post(
        server.url + "/reload_weights",
        json={"path": str(model), "policy_version": version},
        timeout=120,
    )
    assert reply.status_code == 200, reply.text


def _wait_envs(api: ApiProcess, count: int, procs: list, names: set[str] | None = None) -> None:
    # generous: on a loaded 2-core machine an env process takes tens of seconds to start
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        for proc in procs:
            assert proc.poll() is None, f"an env exited with {proc.returncode}"
        envs = httpx.get(api.url + "/metrics", params={"format": "json"}).json().get("envs", [])
        connected = [e for e in envs if e.get("connected")]
        if names is not None:
            connected = [e for e in connected if e["name"].rsplit("_", 1)[0] in names]
        if len(connected) >= count:
            return
        time.sleep(0.2)
    raise AssertionError("the envs did not register")


@pytest.mark.timeout(300)
def test_two_envs_evaluate_the_requested_version(tmp_path: Path, tiny_model_dir: Path) -> None:
    api = ApiProcess(log_path=tmp_path / "run-api.log").start()
    server = ServeProcess(
        tiny_model_dir, "--served-model-name", "tiny", log_path=tmp_path / "serve.log"
    ).start()
    envs = []
    client = TrainerClient(api.url)
    try:
        client.register(batch_size=4, max_token_len=64, num_steps=100)
        client.try_batch()  # opens env registration
        for name in ("alpha", "beta"):
            envs.append(
                _start(
                    api,
                    server,
                    tiny_model_dir,
                    tmp_path,
                    name,
                    "--env.eval_marker",
                    str(tmp_path / f"{name}.evals"),
                )  # fmt: skip
            )
        _wait_envs(api, 2, envs)

        # 1. the server serves version 0: both envs evaluate it
        first = client.request_eval(0, step=0)
        assert len(first["expected"]) == 2
        done = client.eval_results(first["request_id"], wait=True, timeout=60)
        assert done["complete"] and done["policy_version"] == 0
        assert [r["status"] for r in done["reports"]] == ["done", "done"], done
        assert {r["env_name"] for r in done["reports"]} == {"alpha_0", "beta_0"}
        assert all(r["metrics"]["eval/served_version"] == 0 for r in done["reports"])

        # 2. version 1 is asked before the server has it: the envs wait, then evaluate it
        ahead = client.request_eval(1, step=1)
        time.sleep(2)
        assert client.eval_results(ahead["request_id"])["reports"] == []
        _reload(server, tiny_model_dir, 1)
        done = client.eval_results(ahead["request_id"], wait=True, timeout=60)
        assert [r["status"] for r in done["reports"]] == ["done", "done"], done
        assert all(r["metrics"]["eval/served_version"] == 1 for r in done["reports"])

        # 3. version 0 again, now that the server serves 1: refused, with the reason
        late = client.request_eval(0, step=0)
        done = client.eval_results(late["request_id"], wait=True, timeout=60)
        assert [r["status"] for r in done["reports"]] == ["refused", "refused"], done
        assert all("already serves policy version 1" in r["reason"] for r in done["reports"])

        # 4. a sync during the evaluation: the result would mix versions, so it is refused
        for proc in envs:  # from now on each evaluation lasts until the server's version moves
            stop(proc)
        envs.clear()
        for env_id in (0, 1):  # as an operator would for envs that were killed
            httpx.post(api.url + "/disconnect-env", json={"env_id": env_id})
        marker = tmp_path / "slow.evals"
        for name in ("gamma", "delta"):
            envs.append(
                _start(
                    api,
                    server,
                    tiny_model_dir,
                    tmp_path,
                    name,
                    "--env.eval_marker",
                    str(marker),
                    "--env.eval_until_change",
                    "120",
                )  # fmt: skip
            )
        _wait_envs(api, 2, envs, names={"gamma", "delta"})
        slow = client.request_eval(1, step=1)
        assert len(slow["expected"]) == 2, slow
        deadline = time.monotonic() + 120
        while len(marker.read_text().splitlines() if marker.exists() else []) < 2:
            assert time.monotonic() < deadline, "the envs did not start evaluating"
            time.sleep(0.1)
        _reload(server, tiny_model_dir, 2)
        done = client.eval_results(slow["request_id"], wait=True, timeout=60)
        assert {r["status"] for r in done["reports"]} <= {"refused"}, done
        assert all("changed during the evaluation" in r["reason"] for r in done["reports"])

        # 5. /metrics: the latest result of each env, labelled with its version
        text = httpx.get(api.url + "/metrics").text
        lines = [line for line in text.splitlines() if line.startswith("atropos_eval_metric")]
        assert any('metric="eval/served_version"' in line and 'policy_version="1"' in line
                   for line in lines), lines  # fmt: skip
        # an unknown request, a wrong version: 4xx naming the field
        bad = httpx.post(
            api.url + "/eval-result",
            json={"request_id": 999, "env_id": 0, "policy_version": 0, "status": "done"},
        )
        assert bad.status_code == 404 and "request_id" in bad.text
    finally:
        client.close()
        for proc in envs:
            stop(proc)
        server.stop()
        api.stop()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_example_trainer_barrier_logs_each_env_s_result_with_its_step(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """``eval_every 2`` with the barrier: after the syncs of steps 2 and 4 both envs evaluate
    exactly those weights, and metrics.jsonl has their results under those steps."""
    api = ApiProcess(log_path=tmp_path / "run-api.log").start()
    server = ServeProcess(
        tiny_model_dir, "--served-model-name", "tiny", "--dtype", "float32",
        log_path=tmp_path / "serve.log",
    ).start()  # fmt: skip
    # Each env owns half of every batch and a rollout takes 1 s: both must have registered
    # (they poll run-api once a second after the trainer's first /batch) before step 2's
    # evaluation is requested. With fast rollouts, one env alone could feed steps 1-2 before the
    # other's next poll, and the request rightly did not expect an env that was not connected.
    envs = [
        _start(api, server, tiny_model_dir, tmp_path, name, "--env.min_batch_allocation", "0.5",
               delay=1.0)
        for name in ("alpha", "beta")
    ]  # fmt: skip
    try:
        # Both envs up and polling run-api before the trainer starts: an eval request expects
        # the envs connected when it is made, and envs register only once a trainer has; under
        # load a late-starting env missed step 2's request while the other fed the trainer.
        deadline = time.monotonic() + 300
        for name, proc in zip(("alpha", "beta"), envs, strict=True):
            log = tmp_path / f"{name}.log"
            while "Waiting to register the env" not in (log.read_text() if log.exists() else ""):
                assert proc.poll() is None, f"env {name} exited with {proc.returncode}"
                assert time.monotonic() < deadline, f"env {name} did not start"
                time.sleep(0.2)
        trainer = subprocess.run(
            [
                sys.executable,
                "-m",
                "example_trainer.grpo",
                "--model",
                str(tiny_model_dir),
                "--atropos-url",
                api.url,
                "--inference",
                "atropos-serve",
                "--inference-url",
                server.url,
                "--save-path",
                str(tmp_path / "ckpt"),
                "--training-steps",
                "4",
                "--batch-size",
                "4",
                "--gradient-accumulation-steps",
                "1",
                "--seq-len",
                "64",
                "--dtype",
                "float32",
                "--weight-sync-interval",
                "1",
                "--eval-every",
                "2",
                "--batch-timeout",
                "120",
                "--no-progress",
            ],  # fmt: skip
            capture_output=True,
            text=True,
            timeout=500,
            cwd=tmp_path,
        )
        assert trainer.returncode == 0, trainer.stderr[-4000:]
        records = [json.loads(line) for line in (tmp_path / "ckpt" / "metrics.jsonl").open()]
        evals = [r for r in records if "eval_policy_version" in r]
        assert [(r["step"], r["eval_policy_version"]) for r in evals] == [(2, 2), (4, 4)]
        for record in evals:
            assert record["eval/alpha_0/served_version"] == record["step"]
            assert record["eval/beta_0/served_version"] == record["step"]
    finally:
        for proc in envs:
            stop(proc)
        server.stop()
        api.stop()
