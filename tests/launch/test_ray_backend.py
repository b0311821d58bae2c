"""The Ray backend of ``atropos-launch`` against a real two-node Ray cluster on this machine.

The cluster (``tests/launch/ray_cluster.py``) is a head node and a second node with a custom
resource ``node2``, each its own raylet on its own loopback address. A run of run-api,
atropos-serve (a tiny random model), the arithmetic environment with two workers placed on node
2, and a trainer stand-in (``batch_puller.py``) runs through the library API; mid-run one
worker's process is SIGKILLed and the other worker's Ray actor is SIGKILLed; both are
restarted and the run completes with every group run-api accepted accounted for.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

pytest.importorskip("ray", reason="the ray extra is not installed")

from atroposlib.launch.orchestrator import Run, RunFailed  # noqa: E402
from atroposlib.launch.ray_backend import ACTOR_LOST, RayBackend  # noqa: E402
from atroposlib.launch.spec import RunSpec  # noqa: E402
from atroposlib.utils.processes import ProcessLaunchError  # noqa: E402
from tests.launch.ray_cluster import RayCluster  # noqa: E402

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[RayCluster]:
    """A head (3 CPUs) and a second node (4 CPUs, resource node2), stopped afterwards."""
    cluster = RayCluster(head_cpus=3, node2_cpus=4).start()
    saved = {k: os.environ.get(k) for k in cluster.auth_env}
    os.environ.update(cluster.auth_env)  # this process is the driver of the tests' runs
    try:
        yield cluster
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        cluster.stop()


def _spec(cluster: RayCluster, out: Path, model: Path, **trainer_args: str) -> RunSpec:
    release, report = out / "release", out / "trainer-report.json"
    return RunSpec.model_validate(
        {
            "name": "ray-test",
            "output": str(out),
            "base_dir": str(REPO),
            "ray": {"address": cluster.address, "namespace": "atropos-test"},
            "inference": [
                {
                    "name": "policy",
                    "kind": "atropos-serve",
                    "model": str(model),
                    "served_model_name": "tiny",
                    "args": ["--dtype", "float32"],
                    "startup_timeout": 180,
                },
            ],
            "environments": [
                {
                    "file": "environments/arithmetic_server.py",
                    "workers": 2,
                    "resources": {"node2": 1},
                    "max_restarts": 2,
                    "env": {
                        "group_size": 2,
                        "max_token_length": 256,
                        "max_answer_tokens": 6,
                        "tokenizer_name": str(model),
                        "use_wandb": False,
                        "steps_per_eval": 0,
                        "total_steps": 1000,
                    },
                }
            ],
            "trainer": {
                "command": [
                    sys.executable,
                    str(HERE / "batch_puller.py"),
                    "--batches",
                    trainer_args.get("batches", "2"),
                    "--batch-size",
                    "4",
                    "--release",
                    str(release),
                    "--report",
                    str(report),
                ],
            },
        }
    )


@pytest.mark.nightly  # out of per-commit CI (time budget): .ci/nightly runs it
def test_two_node_run_restarts_killed_workers_and_accounts_for_every_group(
    ray_cluster: RayCluster, tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    spec = _spec(ray_cluster, out, tiny_model_dir)
    backend = RayBackend(spec)
    events: list[str] = []
    run = Run(spec, backend, on_event=events.append)
    workers = ["arithmetic-0", "arithmetic-1"]
    phase, deadline = "warm-up", time.monotonic() + 300
    killed_env_ids: set[int] = set()
    last_envs: list[dict] = []
    with run:
        run.start()
        handles = {name: run.states[name].handle for name in workers}
        # placed by their resource on the second node; the rest wherever Ray put them
        for name, handle in handles.items():
            assert handle is not None and handle.node.startswith(ray_cluster.node2_ip), name
            assert ray_cluster.node2_ip in handle.log_location
        while not run.check():
            assert time.monotonic() < deadline, f"{phase}: {events}\n{run.api_numbers()}"
            numbers = run.api_numbers() or {}
            envs = numbers.get("envs") or []
            last_envs = envs or last_envs
            if (
                phase == "warm-up"
                and numbers.get("batches_served", 0) >= 1
                and sum(1 for e in envs if e["accepted_groups"] > 0) >= 2
            ):
                killed_env_ids = {e["env_id"] for e in envs}
                # the process of worker 0, and the Ray actor (worker process) of worker 1
                os.kill(handles["arithmetic-0"].pid, signal.SIGKILL)
                os.kill(handles["arithmetic-1"].actor_pid, signal.SIGKILL)
                phase = "killed"
            elif phase == "killed" and all(run.states[w].restarts == 1 for w in workers):
                fresh = [e for e in envs if e["env_id"] not in killed_env_ids]
                if sum(1 for e in fresh if e["accepted_groups"] > 0) >= 2:
                    (out / "release").touch()  # the trainer may finish now
                    phase = "released"
            time.sleep(0.5)
        assert phase == "released", events
        restarted = {w: run.states[w].handle for w in workers}
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["finished"] is True and summary["backend"] == "ray"
    components = summary["components"]
    assert components["trainer"]["state"] == "done"
    for name in workers:
        assert components[name]["restarts"] == 1, components
        assert components[name]["node"].startswith(ray_cluster.node2_ip)
    assert components["run-api"]["restarts"] == 0
    # the killed process reports its signal; the lost actor, ACTOR_LOST
    assert any(f"arithmetic-0: exited with status {-signal.SIGKILL}" in e for e in events)
    assert any(f"arithmetic-1: exited with status {ACTOR_LOST}" in e for e in events)
    # new actors (Ray placed them again on node 2), new processes
    assert restarted["arithmetic-0"].pid != handles["arithmetic-0"].pid
    assert restarted["arithmetic-1"].actor_pid != handles["arithmetic-1"].actor_pid

    api = summary["api"]
    report = json.loads((out / "trainer-report.json").read_text())
    dropped = sum(api["dropped"].values())
    assert report["groups"] == api["groups_served"] > 0
    assert api["accepted_groups"] == (
        api["groups_served"] + api["queue_groups"] + api["buffered_groups"] + dropped
    ), api
    # every worker instance (two first ones, two restarted) registered with run-api under the
    # id it logged, and the API counted groups from each
    logged = set()
    for name in workers:
        for line in (out / "logs" / f"{name}.log").read_text().splitlines():
            if "Registered env arithmetic as id" in line:
                logged.add(int(line.split(" as id ")[1].split()[0]))
    assert logged == {e["env_id"] for e in last_envs} and len(logged) == 4, last_envs
    assert all(e["accepted_groups"] > 0 for e in last_envs), last_envs
    assert sum(e["accepted_groups"] for e in last_envs) <= api["accepted_groups"]
    # every actor is gone: the processes they started are too
    for handle in [*handles.values(), *restarted.values()]:
        assert handle is not None and not Path(f"/proc/{handle.pid}").exists()


def test_a_component_that_cannot_start_fails_with_why_and_where(
    ray_cluster: RayCluster, tmp_path: Path
) -> None:
    """A Python missing on the node, and resources no node has: clear errors, nothing left."""
    counting = "tests/envs/counting_env.py"
    spec = RunSpec.model_validate(
        {
            "output": str(tmp_path / "run"),
            "base_dir": str(REPO),
            "ray": {"address": ray_cluster.address, "placement_timeout": 3},
            "environments": [
                {"name": "nopython", "file": counting, "python": "/nonexistent/python"},
                {"name": "noroom", "file": counting, "resources": {"gpu_pool": 1}},
            ],
        }
    )
    run = Run(spec, RayBackend(spec))
    with run:
        run.start_api()
        run.ctx["openai_servers"] = []
        nopython, noroom = run.plan.environments
        with pytest.raises(
            ProcessLaunchError,
            match=r"^nopython: cannot run '/nonexistent/python'.* \(on the Ray node at 127\.0\.0\.[23]\)$",
        ):
            run.backend.start(nopython, dict(run.ctx), run.extra_env)
        with pytest.raises(
            RunFailed,
            match=r"noroom: the Ray cluster has no room for 1 x \{'CPU': 1.0, 'gpu_pool': 1.0\}.*"
            r"in all: \{'CPU': 7.0, 'node2': 100.0\}",
        ):
            run.backend.start(noroom, dict(run.ctx), run.extra_env)
    summary = json.loads((tmp_path / "run" / "run_summary.json").read_text())
    assert summary["components"]["run-api"]["state"] == "stopped"


def _cli(spec: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "atroposlib.cli.launch", str(spec), "--status", "lines", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", **(env or {})},
    )


def test_cli_runs_on_the_cluster_in_ray_address(
    ray_cluster: RayCluster, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """``atropos-launch RUN.yaml --backend ray`` joins the cluster named by RAY_ADDRESS."""
    out = tmp_path / "out"
    spec = tmp_path / "run.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "name": "cli-ray",
                "output": str(out),
                "environments": [
                    {
                        "file": str(REPO / "tests/envs/counting_env.py"),
                        "resources": {"node2": 1},
                        "env": {
                            "tokenizer_name": str(tiny_model_dir),
                            "use_wandb": False,
                            "total_steps": 1000,
                        },
                    }
                ],
                "trainer": {
                    "command": [
                        sys.executable,
                        str(HERE / "pull_batches.py"),
                        "{api_url}",
                        "{output}/pulled.json",
                        "3",
                        "4",
                    ],
                },
            }
        )
    )
    done = _cli(spec, "--backend", "ray", env={"RAY_ADDRESS": ray_cluster.address})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["backend"] == "ray" and summary["finished"] is True
    assert summary["components"]["counting_env"]["node"].startswith(ray_cluster.node2_ip)
    api, pulled = summary["api"], json.loads((out / "pulled.json").read_text())
    assert pulled["groups"] == api["groups_served"] >= 6
    assert api["accepted_groups"] == api["groups_served"] + api["queue_groups"] + sum(
        api["dropped"].values()
    )
    assert (out / "logs" / "counting_env.log").is_file()


def test_cli_names_a_bad_resources_field(tmp_path: Path) -> None:
    spec = tmp_path / "run.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "environments": [
                    {"file": str(REPO / "tests/envs/counting_env.py"), "resources": {"CPU": 2}}
                ]
            }
        )
    )
    done = _cli(spec, "--backend", "ray", "--dry-run")
    assert done.returncode == 2
    assert "environments[0].resources: CPU: use cpus / gpus, not resources" in done.stderr


@pytest.mark.nightly  # out of per-commit CI (time budget): .ci/nightly runs it
@pytest.mark.slow
def test_the_shipped_quickstart_run_description_trains_on_ray(
    ray_cluster: RayCluster, tmp_path: Path
) -> None:
    """example_trainer/configs/quickstart-run.yaml, unchanged but for the output folder, on the
    two-node cluster: run-api, atropos-serve with SmolLM2, the arithmetic env, 3 GRPO steps."""
    out = tmp_path / "q"
    spec = REPO / "example_trainer" / "configs" / "quickstart-run.yaml"
    done = _cli(
        spec, "--backend", "ray", "--output", str(out), env={"RAY_ADDRESS": ray_cluster.address}
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["finished"] is True and summary["backend"] == "ray"
    assert {n: c["state"] for n, c in summary["components"].items()} == {
        "run-api": "stopped",
        "policy": "stopped",
        "arithmetic": "done",
        "trainer": "done",
    }
    nodes = {c["node"].split()[0] for c in summary["components"].values()}
    assert nodes <= {ray_cluster.head_ip, ray_cluster.node2_ip}
    api = summary["api"]
    assert api["batches_served"] == 3 and api["step"] == 3
    assert api["accepted_groups"] == (
        api["groups_served"]
        + api["queue_groups"]
        + api["buffered_groups"]
        + sum(api["dropped"].values())
    ), summary
    # atropos-serve on the trainer's machine is synced through shared memory: no step_N per
    # sync; the end writes final_model
    assert (out / "checkpoints" / "final_model" / "config.json").is_file()


def test_cli_says_when_no_ray_cluster_answers_at_the_address(tmp_path: Path) -> None:
    spec = tmp_path / "run.yaml"
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    spec.write_text(
        yaml.safe_dump(
            {
                "output": str(tmp_path / "out"),
                "ray": {"address": f"127.0.0.1:{port}"},
                "environments": [{"file": str(REPO / "tests/envs/counting_env.py")}],
            }
        )
    )
    done = _cli(spec, "--backend", "ray")
    assert done.returncode == 1, done.stderr
    assert f"ray.address 127.0.0.1:{port}: no Ray cluster answers there" in done.stderr
