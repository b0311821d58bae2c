"""The ``slurm`` backend: a run as one batch job, each component one ``srun`` step.

``atropos-launch RUN.yaml --backend slurm`` (:func:`launch_slurm`):

1. writes ``OUTPUT/slurm/run.json`` (the run description, resolved: absolute paths, the
   ``--output`` override) and ``OUTPUT/slurm/run.sbatch`` (:func:`batch_script`: the
   ``#SBATCH`` lines, the ``slurm.setup`` lines, then the orchestrator);
2. submits it with ``sbatch --parsable``;
3. follows the job: its state (``scontrol show job``, then ``sacct`` once Slurm forgot it) and
   the job's output file (``OUTPUT/slurm/job-ID.out``: the orchestrator's events and status
   lines) on this terminal; on Ctrl-C or SIGTERM it asks the orchestrator to stop (SIGTERM to
   the batch step, so the run's final counts are written), then ``scancel``\\ s the job;
4. returns the job's exit status.

Inside the allocation the batch script ``exec``\\ s ``python -m atroposlib.launch.slurm inner
OUTPUT/slurm/run.json`` on the first node: the same orchestrator as every backend
(:class:`~atroposlib.launch.orchestrator.Run`) with :class:`SrunBackend`, which starts each
component as ``srun --nodes=1 --ntasks=1 --nodelist=NODE --cpus-per-task=C --exact ...
python -m atroposlib.launch.runner ...``. The node is chosen when the component starts, from
the job's nodes (``scontrol show hostnames $SLURM_JOB_NODELIST``) and what is already placed on
each (GPUs first fit, CPUs least loaded); the runner picks a free port on that node and writes
``{url, host, port, pid, node}`` to ``OUTPUT/slurm/reports/NAME.json``, which is how the
orchestrator learns the URL. Nothing about nodes or ports is in the batch script.

Assumption: the output folder, the Python interpreter that ran ``atropos-launch`` and the
run's files are at the same paths on every node (a shared filesystem), as is usual on Slurm
clusters. Components get the job's environment (``srun`` exports it), plus
``ATROPOS_API_KEY`` when the run has a key.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from atroposlib.launch.orchestrator import Backend, RunFailed
from atroposlib.launch.plan import Component, plan_run
from atroposlib.launch.spec import LOOPBACK, RunSpec, RunSpecError
from atroposlib.utils.processes import ChildProcess

__all__ = [
    "SrunBackend",
    "SrunHandle",
    "batch_script",
    "job_resources",
    "time_limit_seconds",
    "launch_slurm",
    "parse_cpus_per_node",
]

logger = logging.getLogger("atropos-launch")

#: Seconds before the time limit at which Slurm sends SIGTERM to the orchestrator, so it stops
#: the components itself and writes ``run_summary.json`` (``#SBATCH --signal=B:TERM@...``).
STOP_GRACE_S = 90
#: Job states after which a job does not run again.
FINAL_STATES = {
    "BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
    "PREEMPTED", "TIMEOUT", "SPECIAL_EXIT", "REVOKED",
}  # fmt: skip


# ------------------------------------------------------------------------------ batch script


def job_resources(spec: RunSpec) -> tuple[int, int]:
    """``(cpus per node, gpus per node)`` the job asks for.

    CPUs: ``slurm.cpus_per_node``, else the components' CPUs (each rounded up) spread over the
    nodes, at least the largest single component's.

    Raises:
        RunSpecError: GPUs asked for without ``slurm.gpus_per_node``, a component that needs
            more GPUs than a node has, or several nodes with components bound to loopback.
    """
    plan = plan_run(spec)
    slurm = spec.slurm
    started = [c for c in plan.components if not c.external_url]
    if slurm.nodes > 1 and spec.bind_host in LOOPBACK:
        raise RunSpecError(
            f"slurm.nodes is {slurm.nodes} but bind_host is {spec.bind_host}: components on "
            "other nodes could not reach each other; set bind_host: 0.0.0.0 (and an api_key)"
        )
    for c in started:
        if c.gpus and math.ceil(c.gpus) > slurm.gpus_per_node:
            raise RunSpecError(
                f"{c.name} asks for {c.gpus:g} GPU(s) but slurm.gpus_per_node is "
                f"{slurm.gpus_per_node}: raise slurm.gpus_per_node"
            )
    biggest = max((math.ceil(c.cpus) for c in started), default=1)
    if slurm.cpus_per_node is not None:
        if slurm.cpus_per_node < biggest:
            raise RunSpecError(
                f"slurm.cpus_per_node is {slurm.cpus_per_node} but a component asks for "
                f"{biggest} CPUs"
            )
        return slurm.cpus_per_node, slurm.gpus_per_node
    total = math.ceil(sum(c.cpus for c in started))
    return max(biggest, math.ceil(total / slurm.nodes)), slurm.gpus_per_node


def time_limit_seconds(value: str) -> int | None:
    """A Slurm time limit (``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``, ``D-H:M:S``) in
    seconds; None for ``infinite``/``unlimited`` or what does not parse."""
    days, _, rest = value.strip().rpartition("-")
    try:
        parts = [int(p) for p in rest.split(":")]
        day_s = int(days) * 86400 if days else 0
    except ValueError:
        return None
    if days:  # D-H, D-H:M, D-H:M:S
        parts += [0] * (3 - len(parts))
        h, m, sec = parts[:3]
    elif len(parts) == 1:
        h, m, sec = 0, parts[0], 0
    elif len(parts) == 2:
        h, m, sec = 0, parts[0], parts[1]
    else:
        h, m, sec = parts[:3]
    return day_s + h * 3600 + m * 60 + sec


def _paths(spec: RunSpec) -> tuple[Path, Path, Path]:
    """``(OUTPUT/slurm, run.json, run.sbatch)``."""
    folder = spec.output_dir / "slurm"
    return folder, folder / "run.json", folder / "run.sbatch"


def batch_script(spec: RunSpec) -> str:
    """The batch script ``atropos-launch --backend slurm`` submits for ``spec``.

    It asks for ``slurm.nodes`` nodes with one task of the run's CPUs each (see
    :func:`job_resources`), runs the ``slurm.setup`` lines, then replaces itself with the
    orchestrator, which reads ``OUTPUT/slurm/run.json`` (written by :func:`launch_slurm`).

    Raises:
        RunSpecError: resources that cannot work (see :func:`job_resources`).
    """
    slurm = spec.slurm
    cpus, gpus = job_resources(spec)
    folder, run_json, _ = _paths(spec)
    q = shlex.quote
    sbatch = [
        f"--job-name={q(spec.name)}",
        f"--nodes={slurm.nodes}",
        "--ntasks-per-node=1",
        f"--cpus-per-task={cpus}",
        f"--time={q(slurm.time)}",
    ]
    if slurm.partition:
        sbatch.append(f"--partition={q(slurm.partition)}")
    if slurm.account:
        sbatch.append(f"--account={q(slurm.account)}")
    if gpus:
        sbatch.append(f"--gpus-per-node={gpus}")
    sbatch += [
        f"--output={q(str(folder / 'job-%j.out'))}",
        "--open-mode=append",
    ]
    limit = time_limit_seconds(slurm.time)
    if limit:  # a warning before the time limit: the orchestrator stops the run itself
        sbatch.append(f"--signal=B:TERM@{min(STOP_GRACE_S, max(limit // 4, 1))}")
    sbatch += [line.strip().removeprefix("#SBATCH").strip() for line in slurm.extra]
    lines = [
        "#!/bin/bash",
        f"# atropos-launch --backend slurm: run {spec.name!r} (output {spec.output_dir}).",
        "# One srun step per component; nodes and ports are chosen when each one starts.",
        *[f"#SBATCH {option}" for option in sbatch],
        "",
        "set -e",
        f"cd {q(str(spec.base_dir))}",
    ]
    if slurm.setup:
        lines += ["# slurm.setup", *slurm.setup]
    lines += [
        "",
        "# The orchestrator replaces this shell, so a SIGTERM to the batch step reaches it.",
        f"exec {q(sys.executable)} -m atroposlib.launch.slurm inner {q(str(run_json))}",
        "",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------------ inside the job


def parse_cpus_per_node(value: str, nodes: int) -> list[int]:
    """``SLURM_JOB_CPUS_PER_NODE`` (``"4(x2),2"``) as one count per node."""
    counts: list[int] = []
    for part in value.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not match:
            continue
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    if not counts:
        counts = [1]
    while len(counts) < nodes:
        counts.append(counts[-1])
    return counts[:nodes]


def _job_nodes() -> list[str]:
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodelist:
        raise RunFailed("SLURM_JOB_NODELIST is not set: the srun backend runs inside a Slurm job")
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                         text=True)  # fmt: skip
    names = out.stdout.split()
    if out.returncode != 0 or not names:
        raise RunFailed(f"scontrol show hostnames {nodelist}: {out.stderr.strip()}")
    return names


class _Node:
    def __init__(self, name: str, cpus: int, gpus: int) -> None:
        self.name, self.cpus, self.gpus = name, cpus, gpus
        self.used_cpus = 0.0
        self.used_gpus = 0


class SrunHandle:
    """A component running as an ``srun`` step on one node of the job.

    The ``srun`` process (a :class:`~atroposlib.utils.processes.ChildProcess` of the
    orchestrator, its output in ``OUTPUT/slurm/steps/NAME.log``) lives as long as the step;
    :meth:`stop` sends it SIGTERM, which srun forwards to the runner, which stops the
    component.
    """

    def __init__(
        self, component: Component, node: str, child: ChildProcess, report: Path, log: Path
    ) -> None:
        self.component = component
        self._node = node
        self.child = child
        self.report_path = report
        self.log_path = log
        self._report: dict[str, Any] | None = None
        self._released = False
        self.on_release: Any = None
        self.job_id = os.environ.get("SLURM_JOB_ID")

    def report(self, timeout: float | None = None) -> dict[str, Any] | None:
        """The runner's report (``{url, host, port, pid, node}``); waits up to ``timeout``
        seconds for it (None: the component's startup timeout), None if srun ended first.

        Raises:
            RunFailed: no report within the timeout (srun's output says why, e.g. the step
                waits for resources).
        """
        if self._report is not None:
            return self._report
        limit = self.component.startup_timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while True:
            if self._read_report() is not None:
                return self._report
            if self.poll() is not None:
                return None
            if time.monotonic() > deadline:
                raise RunFailed(
                    f"{self.component.name}: the srun step did not start within {limit:.0f} s. "
                    f"srun's output ({self.child.log_path}):\n{self.child.log_tail()}"
                )
            time.sleep(0.1)

    def _read_report(self) -> dict[str, Any] | None:
        if self._report is None:
            try:
                self._report = json.loads(self.report_path.read_text())
            except (OSError, ValueError):  # not written yet (it is replaced in one go)
                pass
        return self._report

    @property
    def url(self) -> str | None:
        """``http://host:port`` the component listens on (read from the runner's report)."""
        if self.component.external_url:
            return self.component.external_url
        if self.component.port is None:
            return None
        report = self.report()
        return None if report is None else report.get("url")

    @property
    def node(self) -> str:
        """The node the step runs on."""
        return self._node

    @property
    def log_location(self) -> str:
        """The component's log file (on the shared output folder)."""
        return str(self.log_path)

    def poll(self) -> int | None:
        """srun's exit status (the component's), or None while the step runs."""
        proc = self.child.proc
        code = None if proc is None else proc.poll()
        if code is not None:
            self._release()
        return code

    def stop(self, timeout: float = 40.0) -> None:
        """SIGTERM to the step's task (``scancel --signal=TERM JOB.STEP``: the runner stops
        the component and exits), then, after ``timeout`` s, to srun itself, which kills
        the step."""
        proc = self.child.proc
        step = (self._read_report() or {}).get("slurm_step")
        if proc is not None and proc.poll() is None and step is not None and self.job_id:
            subprocess.run(["scancel", "--signal=TERM", f"{self.job_id}.{step}"],
                           capture_output=True)  # fmt: skip
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                logger.warning("%s: step %s.%s still runs %.0f s after SIGTERM; ending it",
                               self.component.name, self.job_id, step, timeout)  # fmt: skip
        self.child.stop(timeout=15.0)  # srun on SIGTERM aborts the step (SIGKILL to tasks)
        self._release()

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the component's log, and of srun's output when it has something."""
        try:
            text = self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            text = "(no log yet)"
        srun = self.child.log_tail(chars).strip()
        srun_lines = [line for line in srun.splitlines() if not line.startswith("$ ")]
        if srun_lines:
            text += f"\n--- srun ({self.child.log_path}):\n" + "\n".join(srun_lines)[-chars:]
        return text

    def _release(self) -> None:
        if not self._released:
            self._released = True
            if self.on_release is not None:
                self.on_release()


class SrunBackend(Backend):
    """Components as ``srun`` steps of the Slurm job this orchestrator runs in.

    Args:
        spec: the run description (``slurm.gpus_per_node`` says how many GPUs each node has).
        nodes: the job's node names (default: ``scontrol show hostnames
            $SLURM_JOB_NODELIST``).
        cpus_per_node: CPUs the job has on each node (default: from
            ``SLURM_JOB_CPUS_PER_NODE``).
        srun: the srun program.
    """

    name = "slurm"

    def __init__(
        self,
        spec: RunSpec,
        nodes: list[str] | None = None,
        cpus_per_node: list[int] | None = None,
        srun: str = "srun",
    ) -> None:
        self.spec = spec
        names = nodes or _job_nodes()
        cpus = cpus_per_node or parse_cpus_per_node(
            os.environ.get("SLURM_JOB_CPUS_PER_NODE", "1"), len(names)
        )
        gpus = spec.slurm.gpus_per_node
        self.nodes = [_Node(n, c, gpus) for n, c in zip(names, cpus, strict=True)]
        here = os.environ.get("SLURMD_NODENAME")
        if here in names:  # the batch node first: loopback runs and run-api live there
            self.nodes.sort(key=lambda n: n.name != here)
        self.srun = srun
        self.folder = spec.output_dir / "slurm"

    def place(self, component: Component) -> _Node:
        """The node ``component`` runs on: run-api and loopback runs on the first node; GPU
        components on the first node with enough free GPUs; others on the node with the most
        free CPUs.

        Raises:
            RunFailed: no node has the GPUs it needs.
        """
        if self.spec.bind_host in LOOPBACK or component.role == "api":
            node = self.nodes[0]
            if component.gpus and node.gpus - node.used_gpus < math.ceil(component.gpus):
                raise RunFailed(self._no_gpus(component))
            return node
        if component.gpus:
            need = math.ceil(component.gpus)
            for node in self.nodes:
                if node.gpus - node.used_gpus >= need:
                    return node
            raise RunFailed(self._no_gpus(component))
        return max(self.nodes, key=lambda n: n.cpus - n.used_cpus)

    def _no_gpus(self, component: Component) -> str:
        free = ", ".join(f"{n.name}: {n.gpus - n.used_gpus}" for n in self.nodes)
        return (
            f"{component.name} needs {math.ceil(component.gpus)} GPU(s) and no node of the job "
            f"has that many free ({free}); raise slurm.gpus_per_node or slurm.nodes"
        )

    def command(
        self, component: Component, node: str, ctx: dict[str, Any], report: Path
    ) -> list[str]:
        """The ``srun`` command line of one component's step.

        CPU-only steps overlap the others (``--overlap``: the orchestrator already spreads
        them over the nodes, and a step never waits for another to end); steps with GPUs do
        not, so Slurm gives each its own GPUs (and sets ``CUDA_VISIBLE_DEVICES``), and CPUs
        of their own: the job's CPUs per node must cover them (:func:`job_resources`).
        """
        argv = [
            self.srun,
            "--nodes=1",
            "--ntasks=1",
            f"--nodelist={node}",
            f"--cpus-per-task={max(1, math.ceil(component.cpus))}",
            "--exact",
            f"--job-name={component.name}",
            "--kill-on-bad-exit=1",
        ]
        if component.gpus:
            # --mem=0: the job's memory, without taking it from the other steps
            argv += [f"--gpus={math.ceil(component.gpus)}", "--mem=0"]
        else:
            argv.append("--overlap")
        return [
            *argv,
            sys.executable,
            "-m",
            "atroposlib.launch.runner",
            "--component",
            component.model_dump_json(),
            "--ctx",
            json.dumps(ctx),
            "--report",
            str(report),
        ]

    def start(
        self, component: Component, ctx: dict[str, Any], extra_env: dict[str, str]
    ) -> SrunHandle:
        """Place ``component`` on a node and start its ``srun`` step (returns at once)."""
        node = self.place(component)
        report = self.folder / "reports" / f"{component.name}.json"
        report.parent.mkdir(parents=True, exist_ok=True)
        report.unlink(missing_ok=True)
        argv = self.command(component, node.name, ctx, report)
        child = ChildProcess(
            f"srun {component.name}",
            argv,
            self.folder / "steps" / f"{component.name}.log",
            env=extra_env,
        ).start()
        cpus, gpus = component.cpus, math.ceil(component.gpus)
        node.used_cpus += cpus
        node.used_gpus += gpus
        if node.used_cpus > node.cpus + 1e-9:
            logger.warning(
                "%s: node %s now runs components asking for %.1f CPUs of its %d",
                component.name,
                node.name,
                node.used_cpus,
                node.cpus,
            )
        handle = SrunHandle(
            component,
            node.name,
            child,
            report,
            Path(ctx["output"]) / "logs" / f"{component.name}.log",
        )

        def release() -> None:
            node.used_cpus -= cpus
            node.used_gpus -= gpus

        handle.on_release = release
        return handle


def inner_main(run_json: str) -> int:
    """The orchestrator inside the job: the run in ``run_json`` on :class:`SrunBackend`."""
    from atroposlib.cli.launch import LaunchOptions, run_launch

    spec = RunSpec.model_validate_json(Path(run_json).read_text())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    logger.info(
        "job %s on %s: orchestrator on %s",
        os.environ.get("SLURM_JOB_ID"),
        os.environ.get("SLURM_JOB_NODELIST"),
        os.environ.get("SLURMD_NODENAME"),
    )
    try:
        backend = SrunBackend(spec)
    except RunFailed as exc:
        print(f"atropos-launch: {exc}", file=sys.stderr)
        return 1
    options = LaunchOptions(backend="slurm", status="lines", status_every=15.0)
    return run_launch(spec, options, backend=backend)


# ----------------------------------------------------------------------- the submitting side


def _job_info(job_id: str) -> dict[str, str] | None:
    """``JobState``, ``Reason``, ``ExitCode``, ``NodeList`` of a job from scontrol (Slurm keeps
    finished jobs for MinJobAge, 300 s by default), else from sacct; None if neither knows."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True,
                         text=True)  # fmt: skip
    if out.returncode == 0 and out.stdout.strip():
        fields = dict(re.findall(r"(\w+)=(\S*)", out.stdout))
        return {
            "state": fields.get("JobState", ""),
            "reason": fields.get("Reason", ""),
            "exit": fields.get("ExitCode", ""),
            "nodes": fields.get("NodeList", ""),
        }
    if shutil.which("sacct"):
        out = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o",
                              "State,ExitCode,NodeList"], capture_output=True, text=True)  # fmt: skip
        line = out.stdout.strip().splitlines()[:1]
        if out.returncode == 0 and line:
            state, exit_code, nodes = (line[0].split("|") + ["", "", ""])[:3]
            return {"state": state.split()[0] if state else "", "reason": "", "exit": exit_code,
                    "nodes": nodes}  # fmt: skip
    return None


def _exit_status(info: dict[str, str]) -> int:
    """The job's ``ExitCode`` (``status:signal``) as a shell exit status."""
    status, _, sig = info.get("exit", "").partition(":")
    try:
        if sig and int(sig):
            return 128 + int(sig)
        code = int(status)
    except ValueError:
        code = 1
    if code == 0 and info.get("state") not in ("COMPLETED", ""):
        return 1
    return code


class _Follower:
    """Copies new text of the job's output file to stdout."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def pump(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return
        if data:
            self.offset += len(data)
            sys.stdout.write(data.decode(errors="replace"))
            sys.stdout.flush()


def launch_slurm(spec: RunSpec, options: Any) -> int:
    """``atropos-launch RUN.yaml --backend slurm``: write the batch script, submit it, follow
    the job until it ends (Ctrl-C / SIGTERM cancel it); returns its exit status (130 when
    cancelled from here)."""
    missing = [t for t in ("sbatch", "scontrol", "scancel") if shutil.which(t) is None]
    if missing:
        print(f"atropos-launch: --backend slurm: {', '.join(missing)} not found (run it where "
              "Slurm's client commands are, e.g. a login node)", file=sys.stderr)  # fmt: skip
        return 2
    try:
        script = batch_script(spec)
    except RunSpecError as exc:
        print(f"atropos-launch: {exc}", file=sys.stderr)
        return 2
    folder, run_json, sbatch_path = _paths(spec)
    folder.mkdir(parents=True, exist_ok=True)
    run_json.write_text(spec.model_dump_json(indent=2))
    sbatch_path.write_text(script)
    out = subprocess.run(["sbatch", "--parsable", str(sbatch_path)], capture_output=True,
                         text=True, cwd=spec.base_dir)  # fmt: skip
    if out.returncode != 0:
        print(f"atropos-launch: sbatch {sbatch_path} failed: {out.stderr.strip()}",
              file=sys.stderr)  # fmt: skip
        return 1
    job_id = out.stdout.strip().split(";")[0]
    job_out = folder / f"job-{job_id}.out"
    logger.info("submitted job %s (%s); its output: %s; Ctrl-C cancels it", job_id,
                sbatch_path, job_out)  # fmt: skip
    follower = _Follower(job_out)
    last = ""
    try:
        while True:
            follower.pump()
            info = _job_info(job_id)
            if info is None:
                logger.warning("Slurm no longer knows job %s; its output: %s", job_id, job_out)
                return 1
            seen = f"{info['state']} {info['reason']}"
            if seen != last:
                last = seen
                where = f" on {info['nodes']}" if info["state"] == "RUNNING" else ""
                why = f" ({info['reason']})" if info["reason"] not in ("", "None") else ""
                logger.info("job %s: %s%s%s", job_id, info["state"], where, why)
            if info["state"] in FINAL_STATES:
                time.sleep(0.5)  # the last lines may lag behind on a shared filesystem
                follower.pump()
                code = _exit_status(info)
                logger.info("job %s ended: %s, exit status %d; summary: %s", job_id,
                            info["state"], code, spec.output_dir / "run_summary.json")  # fmt: skip
                return code
            time.sleep(1.0)
    except KeyboardInterrupt:
        _cancel(job_id, follower)
        return 130


def _cancel(job_id: str, follower: _Follower, grace: float = 60.0) -> None:
    """Ask the orchestrator to stop the run (SIGTERM to the batch step: it stops every step and
    writes run_summary.json); ``scancel`` the job after ``grace`` s, or at once if it has not
    started or on a second Ctrl-C; wait until Slurm lists it no more."""
    info = _job_info(job_id) or {"state": ""}
    try:
        if info["state"] == "RUNNING":
            logger.info("stopping job %s (its orchestrator stops the run; Ctrl-C again to "
                        "cancel at once)", job_id)  # fmt: skip
            subprocess.run(["scancel", "--batch", "--signal=TERM", job_id], capture_output=True)
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline:
                follower.pump()
                info = _job_info(job_id) or {"state": "COMPLETED"}
                if info["state"] in FINAL_STATES:
                    break
                time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    subprocess.run(["scancel", job_id], capture_output=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True,
                             text=True)  # fmt: skip
        if not out.stdout.strip():
            break
        time.sleep(0.5)
    follower.pump()
    logger.info("job %s cancelled", job_id)


def main(argv: list[str] | None = None) -> None:
    """``python -m atroposlib.launch.slurm inner RUN.json``: the batch script's last line."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or args[0] != "inner":
        print("usage: python -m atroposlib.launch.slurm inner OUTPUT/slurm/run.json "
              "(run by the batch script atropos-launch --backend slurm writes)",
              file=sys.stderr)  # fmt: skip
        raise SystemExit(2)
    raise SystemExit(inner_main(args[1]))


if __name__ == "__main__":
    main()
