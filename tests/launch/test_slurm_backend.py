"""``atropos-launch --backend slurm`` against a real single-node Slurm (slurmctld + slurmd from
Debian's slurm-wlm, started here: tests/launch/slurm_cluster.py).

The run: run-api, one counting environment worker (no inference server) and a stand-in trainer
(tests/launch/pull_batches.py) that pulls batches with TrainerClient, each an srun step of one
batch job, with an API key taken from the environment.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from atroposlib.launch.slurm import batch_script, parse_cpus_per_node, time_limit_seconds
from atroposlib.launch.spec import load_run_spec
from tests.launch.slurm_cluster import SlurmCluster, missing_tools

REPO = Path(__file__).resolve().parents[2]
COUNTING_ENV = REPO / "tests" / "envs" / "counting_env.py"
PULL = REPO / "tests" / "launch" / "pull_batches.py"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    missing = missing_tools()
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)}; apt-get install slurm-wlm)")
    c = SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    try:
        yield c
    finally:
        c.stop()


def write_run(folder: Path, batches: int, **slurm: object) -> Path:
    """A run description: run-api, one counting worker, the stand-in trainer."""
    run = {
        "name": "slurm-test",
        "output": str(folder / "out"),
        "api_key": "${SLURM_TEST_KEY}",
        "api": {"cpus": 0.5},
        "environments": [
            {
                "file": str(COUNTING_ENV),
                "name": "counting",
                "cpus": 0.5,
                "env": {
                    "tokenizer_name": "SmolLM2-135M-Instruct",
                    "group_size": 2,
                    "max_token_length": 64,
                    "use_wandb": False,
                },  # fmt: skip
            }
        ],
        "trainer": {
            "cpus": 0.5,
            "command": [
                sys.executable,
                str(PULL),
                "{api_url}",
                "{output}/trainer.json",
                str(batches),
                "4",
            ],  # fmt: skip
        },
        "slurm": {"time": "00:10:00", **slurm},
    }
    path = folder / "run.yaml"
    path.write_text(json.dumps(run))  # JSON is YAML
    return path


def launcher_env(cluster: SlurmCluster) -> dict[str, str]:
    return {**cluster.environ(), "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1", "SLURM_TEST_KEY": "slurm-test-key"}  # fmt: skip


def launch(run: Path, cluster: SlurmCluster, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "atroposlib.cli.launch", str(run), "--backend", "slurm"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=launcher_env(cluster),
        )


def test_slurm_value_parsing() -> None:
    assert parse_cpus_per_node("4(x2),2", 3) == [4, 4, 2]
    assert parse_cpus_per_node("8", 2) == [8, 8]
    assert time_limit_seconds("30") == 1800
    assert time_limit_seconds("10:00") == 600
    assert time_limit_seconds("01:00:00") == 3600
    assert time_limit_seconds("1-02") == 93600
    assert time_limit_seconds("2-00:00:30") == 172830
    assert time_limit_seconds("infinite") is None


def test_resources_that_cannot_work_are_refused_by_field(tmp_path: Path) -> None:
    run = write_run(tmp_path, 1, nodes=2)
    out = subprocess.run(
        [sys.executable, "-m", "atroposlib.cli.launch", str(run), "--backend", "slurm",
         "--dry-run"], capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), "SLURM_TEST_KEY": "slurm-test-key"},
    )  # fmt: skip
    assert out.returncode == 2
    assert "slurm.nodes is 2 but bind_host is 127.0.0.1" in out.stderr


def test_batch_script_passes_sbatch_test_only(cluster: SlurmCluster, tmp_path: Path) -> None:
    run = write_run(tmp_path, 1, partition=cluster.partition, extra=["--comment=atropos"])
    dry = subprocess.run(
        [sys.executable, "-m", "atroposlib.cli.launch", str(run), "--backend", "slurm",
         "--dry-run"], capture_output=True, text=True, env=launcher_env(cluster),
    )  # fmt: skip
    assert dry.returncode == 0, dry.stderr
    script = batch_script(load_run_spec(run))
    assert script in dry.stdout
    assert "#SBATCH --cpus-per-task=2" in script  # three components of 0.5 CPU, rounded up
    assert "#SBATCH --comment=atropos" in script
    assert "#SBATCH --signal=B:TERM@90" in script  # the orchestrator's warning before 10 min
    path = tmp_path / "run.sbatch"
    path.write_text(script)
    ok = subprocess.run(["sbatch", "--test-only", str(path)], capture_output=True, text=True,
                        env=cluster.environ())  # fmt: skip
    assert ok.returncode == 0 and "to start at" in ok.stderr, ok.stderr
    # the same check refuses a script the cluster cannot run
    path.write_text(batch_script(load_run_spec(write_run(tmp_path, 1, partition="nosuch"))))
    bad = subprocess.run(["sbatch", "--test-only", str(path)], capture_output=True, text=True,
                         env=cluster.environ())  # fmt: skip
    assert bad.returncode != 0 and "partition" in bad.stderr.lower()


def test_job_runs_to_completion(cluster: SlurmCluster, tmp_path: Path) -> None:
    run = write_run(tmp_path, 3)
    proc = launch(run, cluster, tmp_path / "launcher.log")
    try:
        code = proc.wait(240)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = (tmp_path / "launcher.log").read_text()
    assert code == 0, log + cluster.logs()
    out = tmp_path / "out"
    summary = json.loads((out / "run_summary.json").read_text())
    trainer = json.loads((out / "trainer.json").read_text())
    assert summary["backend"] == "slurm" and summary["finished"] is True
    assert summary["components"]["trainer"]["state"] == "done"
    assert {c["node"] for c in summary["components"].values()} == {cluster.node}
    api = summary["api"]
    assert api["batches_served"] == trainer["batches"] >= 3
    assert api["sequences_served"] == trainer["sequences"]
    # every accepted group was served to the trainer, is still queued, or dropped with a reason
    waiting = api["queue_groups"] + api["buffered_groups"] + sum(api["dropped"].values())
    assert api["accepted_groups"] == trainer["groups"] + waiting
    assert trainer["api_key_set"] is True  # ATROPOS_API_KEY reached the srun step
    assert "COMPLETED, exit status 0" in log
    assert "every component started" in log  # the job's output, followed by the launcher
    assert (out / "slurm" / "run.sbatch").is_file()
    assert not cluster.jobs()


def test_interrupt_cancels_the_job(cluster: SlurmCluster, tmp_path: Path) -> None:
    run = write_run(tmp_path, 10**6)  # the trainer would pull forever
    log = tmp_path / "launcher.log"
    proc = launch(run, cluster, log)
    try:
        deadline = time.monotonic() + 120
        while "every component started" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        assert cluster.jobs(), "no job in squeue while the run is up"
        reports = tmp_path / "out" / "slurm" / "reports"
        while len(list(reports.glob("*.json"))) < 3:  # each step reports once it started
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        pids = [json.loads(p.read_text())["pid"] for p in reports.glob("*.json")]
        proc.send_signal(signal.SIGINT)
        code = proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert code == 130, text
    assert "cancelled" in text
    assert not cluster.jobs(), text
    summary = json.loads((tmp_path / "out" / "run_summary.json").read_text())
    assert summary["finished"] is False
    assert all(c["state"] == "stopped" for c in summary["components"].values())
    for pid in pids:  # every component process is gone (one node: same pid namespace)
        status = Path(f"/proc/{pid}/status")
        assert not status.exists() or "zombie" in status.read_text(), (pid, status.read_text())
