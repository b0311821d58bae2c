"""``atropos-launch`` with the local backend, for real: run-api, environment workers and a
trainer as processes on this machine (the counting env needs no inference server)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COUNTING_ENV = ROOT / "tests" / "envs" / "counting_env.py"
PULLER = Path(__file__).with_name("pull_batches.py")


def _spec(tmp_path: Path, tokenizer: Path, **over) -> Path:
    spec = {
        "name": "t",
        "output": str(tmp_path / "out"),
        "environments": [
            {
                "name": "counting",
                "file": str(COUNTING_ENV),
                "workers": 2,
                # one rollout at a time, 0.5 s each: about 4 groups/s from two workers, so
                # the run lasts long enough to kill a worker in the middle of it
                "env": {
                    "tokenizer_name": str(tokenizer),
                    "rollout_delay": 0.5,
                    "max_num_workers": 1,
                    "total_steps": 1000,
                    "use_wandb": False,
                },  # fmt: skip
                "max_restarts": 2,
            }
        ],
        "trainer": {
            "command": [
                sys.executable,
                str(PULLER),
                "{api_url}",
                "{output}/pulled.json",
                "16",
                "4",
            ],  # fmt: skip
        },
    }
    for key, value in over.items():
        spec[key] = value
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _launch(spec: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "atroposlib.cli.launch",
            str(spec),
            "--status",
            "lines",
            "--status-every",
            "2",
            *args,
        ],  # fmt: skip
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=ROOT,
    )


def _read_until(proc: subprocess.Popen, pattern: str, timeout: float, seen: list[str]) -> str:
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if re.search(pattern, line):
            return line
    raise AssertionError(f"{pattern!r} not seen. Output:\n{''.join(seen)[-4000:]}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_killed_worker_is_restarted_and_every_group_is_accounted_for(
    tmp_path: Path, tiny_model_dir: Path
):
    spec = _spec(tmp_path, tiny_model_dir)
    proc = _launch(spec)
    seen: list[str] = []
    try:
        line = _read_until(proc, r"started counting-1 \(pid \d+\)", 60, seen)
        pid = int(re.search(r"pid (\d+)", line).group(1))
        _read_until(proc, r"accepted [1-9]", 60, seen)
        os.kill(pid, signal.SIGKILL)  # mid-run, as the OOM killer would
        _read_until(proc, r"counting-1: exited with status -9; restarting \(1/2\)", 30, seen)
        out, _ = proc.communicate(timeout=180)
        seen.append(out)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = "".join(seen)
    assert proc.returncode == 0, log[-4000:]
    summary = json.loads((tmp_path / "out" / "run_summary.json").read_text())
    assert summary["finished"] is True
    assert summary["components"]["counting-1"]["restarts"] == 1
    assert summary["components"]["counting-0"]["restarts"] == 0
    assert summary["components"]["trainer"]["state"] == "done"
    pulled = json.loads((tmp_path / "out" / "pulled.json").read_text())
    # 16 batches, and one more if it was ready when the last one was acknowledged
    assert pulled["batches"] in (16, 17) and pulled["sequences"] == 4 * pulled["batches"]
    assert summary["api"]["batches_served"] == pulled["batches"]
    api = summary["api"]
    # every group the API acknowledged reached the trainer, is still queued, or was dropped
    # with a counted reason
    accounted = (
        pulled["groups"] + api["queue_groups"] + api["buffered_groups"]
        + sum(api["dropped"].values())
    )  # fmt: skip
    assert api["accepted_groups"] == accounted, summary
    # every process is gone
    for name in ("counting-0", "counting-1", "run-api"):
        assert f"{name}: started" in log
    for pid_text in re.findall(r"started \S+ \(pid (\d+)\)", log):
        assert not _alive(int(pid_text)), f"pid {pid_text} outlived the run"


@pytest.mark.nightly  # out of per-commit CI (time budget): .ci/nightly runs it
def test_a_worker_failing_past_its_budget_stops_the_run_with_its_log(
    tmp_path: Path, tiny_model_dir: Path
):
    spec = _spec(tmp_path, tiny_model_dir)
    data = yaml.safe_load(spec.read_text())
    data["environments"][0].update(workers=1, max_restarts=1, args=["--env.no_such_flag", "1"])
    spec.write_text(yaml.safe_dump(data))
    proc = _launch(spec)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, out[-3000:]
    assert "restarting (1/1)" in out
    assert "counting exited with status 2 after 1 restart(s)" in out
    assert "no_such_flag" in out  # the worker's log tail is in the message
    summary = json.loads((tmp_path / "out" / "run_summary.json").read_text())
    assert summary["components"]["counting"]["state"] == "failed"
    assert summary["components"]["run-api"]["state"] == "stopped"


def test_ctrl_c_stops_every_component(tmp_path: Path, tiny_model_dir: Path):
    spec = _spec(tmp_path, tiny_model_dir)
    proc = _launch(spec)
    seen: list[str] = []
    try:
        _read_until(proc, r"every component started", 60, seen)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        seen.append(out)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = "".join(seen)
    assert proc.returncode == 130, log[-3000:]
    pids = [int(p) for p in re.findall(r"started \S+ \(pid (\d+)\)", log)]
    assert len(pids) == 4  # run-api, two workers, the trainer
    for pid in pids:
        assert not _alive(pid), log[-3000:]


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"environments": [{"file": "x.py", "workerz": 2}]},
            "environments[0].workerz: unknown field",
        ),
        ({"environments": [{"file": "no/such/env.py"}]}, "no such file 'no/such/env.py'"),
        ({"api": {"settings": {"max_stalenes": 2}}}, "unknown run-api setting(s) max_stalenes"),
        ({"api": {"settings": {"port": 1}}}, "port: set by the run description"),
        ({"inference": [{"kind": "external"}]}, "kind external needs url"),
        ({"trainer": {"config": {"learning_rate": 1}}}, "unknown trainer setting(s) learning_rate"),
        ({"environments": []}, "environments: List should have at least 1 item"),
    ],
)
def test_a_bad_run_description_is_a_usage_error_naming_the_field(
    tmp_path: Path, change: dict, message: str
):
    spec = {"environments": [{"file": str(COUNTING_ENV)}], **change}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(spec))
    result = subprocess.run(
        [sys.executable, "-m", "atroposlib.cli.launch", str(path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert message in result.stderr, result.stderr


def test_dry_run_prints_every_command_without_starting_anything(tmp_path: Path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "atroposlib.cli.launch",
            str(ROOT / "example_trainer" / "configs" / "quickstart-run.yaml"),
            "--dry-run",
            "--output",
            str(tmp_path / "q"),
        ],  # fmt: skip
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split()[0] for line in lines[1:-1]] == ["run-api", "policy", "arithmetic",
                                                         "trainer"]  # fmt: skip
    assert lines[-1] == "settings: every environment's and the trainer's settings check out"
    assert "atroposlib.inference.cli --model SmolLM2-135M-Instruct" in result.stdout
    assert "environments/arithmetic_server.py serve --config" in result.stdout
    assert not (tmp_path / "q" / "logs").exists()


@pytest.mark.nightly  # out of per-commit CI (time budget): .ci/nightly runs it
@pytest.mark.slow
def test_the_shipped_quickstart_run_description_trains_locally(tmp_path: Path):
    """example_trainer/configs/quickstart-run.yaml, unchanged but for the output folder:
    run-api, atropos-serve with SmolLM2, the arithmetic env and the GRPO trainer for 3 steps."""
    spec = ROOT / "example_trainer" / "configs" / "quickstart-run.yaml"
    out = tmp_path / "q"
    proc = _launch(spec, "--output", str(out))
    stdout, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, stdout[-4000:]
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["finished"] is True
    assert {n: c["state"] for n, c in summary["components"].items()} == {
        "run-api": "stopped",
        "policy": "stopped",
        "arithmetic": "done",
        "trainer": "done",
    }
    api = summary["api"]
    assert api["batches_served"] == 3 and api["step"] == 3
    served_groups = api["sequences_served"] // 4  # group_size 4
    assert api["accepted_groups"] == (
        served_groups + api["queue_groups"] + api["buffered_groups"]
        + sum(api["dropped"].values())
    ), summary  # fmt: skip
    # atropos-serve on the trainer's machine is synced through shared memory: no step_N per
    # sync; the end writes final_model
    assert (out / "checkpoints" / "final_model" / "config.json").is_file()
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert max(m.get("step", 0) for m in metrics) == 3
    for name in ("run-api", "policy", "arithmetic", "trainer"):
        assert (out / "logs" / f"{name}.log").stat().st_size > 0


def test_a_run_bound_beyond_loopback_gets_a_key_every_component_uses(
    tmp_path: Path, tiny_model_dir: Path
):
    """bind_host 0.0.0.0 implies api_key auto: run-api requires the key, and the env worker,
    the trainer and the launcher's own status requests all send it (ATROPOS_API_KEY)."""
    spec = _spec(tmp_path, tiny_model_dir, bind_host="0.0.0.0")
    data = yaml.safe_load(spec.read_text())
    data["environments"][0]["workers"] = 1
    data["trainer"]["command"][4:6] = ["2", "4"]
    spec.write_text(yaml.safe_dump(data))
    env = {k: v for k, v in os.environ.items() if k != "ATROPOS_API_KEY"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "atroposlib.cli.launch", str(spec), "--status", "lines"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**env, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
    )
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out[-4000:]
    api_log = (tmp_path / "out" / "logs" / "run-api.log").read_text()
    assert "API key required" in api_log
    # nobody was refused: every component had the key (match the status column of uvicorn's
    # access log, not any "401" inside a consumer id)
    assert not re.search(r'HTTP/1\.1" 401\b', api_log), api_log[-2000:]
    summary = json.loads((tmp_path / "out" / "run_summary.json").read_text())
    pulled = json.loads((tmp_path / "out" / "pulled.json").read_text())
    assert pulled["api_key_set"] is True
    # the launcher read /metrics with the key
    assert summary["api"]["batches_served"] == pulled["batches"] >= 2
    key_lines = [line for line in out.splitlines() if "ATROPOS_API_KEY=" in line]
    assert not key_lines  # the key itself is never printed


KEY_PROBE = Path(__file__).with_name("key_probe.py")
TOKEN_ENV = ROOT / "tests" / "trainer" / "token_env.py"


@pytest.mark.nightly  # out of per-commit CI (time budget): .ci/nightly runs it
@pytest.mark.slow  # ~45 s: run-api, atropos-serve, an env generating and a trainer
def test_inference_servers_of_a_run_bound_beyond_loopback_require_the_runs_key(
    tmp_path: Path, tiny_model_dir: Path
):
    """bind_host 0.0.0.0 with an atropos-serve: the server requires the run's key on every
    route but /health (generation, /pause, /reload_weights, /policy_version), and every
    client of the run sends it: the environment's inference client, the trainer's weight-sync
    client, the launcher's health checks. Nothing is refused but the probes sent without it."""
    out = tmp_path / "out"
    spec = {
        "name": "keyed",
        "output": str(out),
        "bind_host": "0.0.0.0",
        "inference": [
            {
                "name": "policy",
                "model": str(tiny_model_dir),
                "served_model_name": "policy",
                "args": ["--dtype", "float32"],
                "startup_timeout": 120,
            }
        ],
        "environments": [
            {
                "file": str(TOKEN_ENV),
                "env": {
                    "group_size": 4,
                    "batch_size": 8,
                    "total_steps": 100,
                    "max_token_length": 256,
                    "max_answer_tokens": 8,
                    "tokenizer_name": str(tiny_model_dir),
                    "use_wandb": False,
                    "steps_per_eval": 0,
                },
                "max_restarts": 0,
            }
        ],
        "trainer": {"command": [sys.executable, str(KEY_PROBE), "{output}/probe.json", "2"]},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(spec))
    env = {k: v for k, v in os.environ.items() if k != "ATROPOS_API_KEY"}
    result = subprocess.run(
        [sys.executable, "-m", "atroposlib.cli.launch", str(path), "--status", "lines"],
        capture_output=True,
        text=True,
        env={**env, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"},
        cwd=ROOT,
        timeout=300,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
    probe = json.loads((out / "probe.json").read_text())
    assert probe["no_key"] == {
        "completions": 401,
        "generate": 401,
        "pause": 401,
        "reload_weights": 401,
        "policy_version": 401,
        "wrong_key": 401,
        "health": 200,
    }
    assert probe["with_key"] == 200 and probe["env_client_has_key"] is True
    assert probe["policy_version"] == 0 and probe["batches"] == 2
    serve_log = (out / "logs" / "policy.log").read_text()
    # the six probes without a (right) key were the only requests refused
    assert serve_log.count(" 401") == 6, serve_log[-3000:]
    assert serve_log.count('"POST /generate HTTP/1.1" 200') >= 2  # the env generated with it
    assert '"GET /policy_version HTTP/1.1" 200' in serve_log  # and read the version with it
    assert "without an API key" not in serve_log


def test_a_run_bound_beyond_loopback_with_an_empty_key_is_refused(tmp_path: Path):
    spec = _spec(tmp_path, tmp_path, bind_host="0.0.0.0", api_key="")
    result = subprocess.run(
        [sys.executable, "-m", "atroposlib.cli.launch", str(spec), "--dry-run"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        timeout=60,
    )
    assert result.returncode == 2
    assert "api_key: empty, with bind_host 0.0.0.0" in result.stderr


def test_the_shipped_quickstart_keeps_its_queue_in_a_store_under_the_output(tmp_path: Path):
    """quickstart-run.yaml gives run-api a --store in the run's output folder (durable across a
    SIGKILL of the launcher): what the launcher would start says so."""
    from atroposlib.launch.plan import plan_run, render
    from atroposlib.launch.spec import load_run_spec

    spec = load_run_spec(
        ROOT / "example_trainer" / "configs" / "quickstart-run.yaml", {"output": str(tmp_path)}
    )
    env = render(plan_run(spec).api.env, {"output": str(tmp_path)})
    assert env["ATROPOS_STORE"] == str(tmp_path / "run-api.sqlite3")


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"api_key": "${ATROPOS_TEST_UNSET_KEY}"},
         "api_key: environment variable ATROPOS_TEST_UNSET_KEY is not set"),
        ({"output": "/proc/atropos-cannot-write"}, "output: cannot write to /proc/atropos-cannot-write"),
    ],
)  # fmt: skip
def test_an_unset_key_variable_or_an_unwritable_output_is_a_one_line_error(
    tmp_path: Path, over: dict, message: str
):
    spec = _spec(tmp_path, tmp_path, **over)
    env = {k: v for k, v in os.environ.items() if k != "ATROPOS_TEST_UNSET_KEY"}
    result = subprocess.run(
        [sys.executable, "-m", "atroposlib.cli.launch", str(spec)],
        capture_output=True,
        text=True,
        env={**env, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def _dry_run(spec: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "atroposlib.cli.launch", str(spec), "--dry-run"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"},
        cwd=ROOT,
        timeout=300,
    )


@pytest.mark.parametrize(
    ("environment", "trainer", "message"),
    [
        ({"env": {"group_size": "abc"}}, None,
         "environments: counting: env.group_size in the run description: Input should be a valid integer"),
        ({"env": {"no_such_setting": 1}}, None,
         "environments: counting: the run description: unknown key 'env.no_such_setting'"),
        ({"args": ["--env.total_steps", "x"]}, None,
         "environments: counting: --env.total_steps 'x': Input should be a valid integer"),
        ({"args": ["--env.bogus", "1"]}, None, "environments: counting: unknown flag --env.bogus"),
        ({"openai": {"timeout": "soon"}}, None,
         "environments: counting: openai.timeout in the run description: Input should be a valid integer"),
        ({}, {"config": {"model_name": "m", "lr": "fast"}},
         "lr in trainer.config: Input should be a valid number"),
        ({}, {"config": {"model_name": "m", "training_steps": 0}},
         "training_steps in trainer.config: Input should be greater than or equal to 1"),
        ({}, {"config": {"model_name": "m", "no_such_setting": 1}},
         "unknown trainer setting(s) no_such_setting"),
    ],
    ids=["env-type", "env-unknown", "env-flag-value", "env-unknown-flag", "openai-type",
         "trainer-type", "trainer-range", "trainer-unknown"],
)  # fmt: skip
def test_dry_run_catches_bad_env_and_trainer_settings(
    tmp_path: Path, environment: dict, trainer: dict | None, message: str
):
    """As the real launch would resolve them, without starting anything: a one-line error
    naming the spec field and the setting, exit status 2."""
    spec = yaml.safe_load(_spec(tmp_path, tmp_path).read_text())
    env = spec["environments"][0]
    env["env"].update(environment.get("env", {}))
    env["openai"] = environment.get("openai", {})
    env["args"] = environment.get("args", [])
    if trainer is not None:
        spec["trainer"] = trainer
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(spec))
    result = _dry_run(path)
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("atropos-launch: ") and message in line, line
    assert not (tmp_path / "out" / "logs").exists()


def test_dry_run_passes_good_env_and_trainer_settings(tmp_path: Path):
    spec = yaml.safe_load(_spec(tmp_path, tmp_path).read_text())
    spec["environments"][0]["args"] = ["--env.group_size", "4"]
    spec["trainer"] = {"config": {"model_name": "m", "lr": 1e-5, "training_steps": 2}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(spec))
    result = _dry_run(path)
    assert result.returncode == 0, result.stderr
    assert "settings: every environment's and the trainer's settings check out" in result.stdout
