"""``atropos-launch RUN.yaml``: start a whole run (API, inference, environments, trainer) from
one run description, on this machine (``--backend local``), on a Ray cluster (``ray``) or as a
Slurm job (``slurm``); show its status; stop everything on exit, Ctrl-C or the trainer's end.

The run description's fields are in CONFIG.md ("Run description"); an example is
``example_trainer/configs/quickstart-run.yaml``.
"""

from __future__ import annotations

import logging
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from atroposlib.utils.cli import ModelArgumentParser, ModelFlags, parse_model

BACKENDS = ("local", "ray", "slurm")


class LaunchOptions(BaseModel):
    """The options of ``atropos-launch`` (besides the run description's path)."""

    model_config = ConfigDict(extra="forbid")

    backend: Literal["local", "ray", "slurm"] = Field(
        "local",
        description="Where the components run: local (processes on this machine), ray (actors "
        "on a Ray cluster), slurm (a batch job with one srun step per component).",
    )
    output: str | None = Field(
        None, description="Output folder (overrides the run description's output)."
    )
    dry_run: bool = Field(
        False,
        description="Check the run description and print each component's command (and, for "
        "slurm, the batch script) without starting anything. Every environment's settings "
        "(env, openai, args) are resolved by importing its file as the launch would, and the "
        "GRPO trainer's config is built into its TrainingConfig; a bad or unknown setting is "
        "a one-line error naming it (exit 2).",
    )
    status: Literal["auto", "live", "lines", "off"] = Field(
        "auto",
        description="Status view: live (a table redrawn in place), lines (one line every "
        "--status-every seconds, for logs), off; auto: live on a terminal, else lines.",
    )
    status_every: float = Field(
        30.0, gt=0, description="Seconds between status lines (--status lines)."
    )


FLAGS = ModelFlags(LaunchOptions)


def build_parser() -> ModelArgumentParser:
    """``atropos-launch``'s parser: the run description, then one flag per option."""
    parser = ModelArgumentParser(
        prog="atropos-launch",
        description="Start run-api, inference servers, environments and a trainer from one run "
        "description (YAML; fields in CONFIG.md), watch them, stop them all at the end.",
    )
    parser.add_argument("run", metavar="RUN.yaml", help="The run description.")
    FLAGS.add_to(parser)
    return parser


def make_backend(name: str, spec: Any) -> Any:
    """The backend called ``name`` (local, ray) for ``spec``."""
    if name == "local":
        from atroposlib.launch.local import LocalBackend

        return LocalBackend()
    if name == "ray":
        from atroposlib.launch.ray_backend import RayBackend

        return RayBackend(spec)
    raise ValueError(f"unknown backend {name!r}")


def _print_plan(spec: Any) -> None:
    from atroposlib.launch.plan import describe, plan_run

    plan = plan_run(spec)
    print(f"run {plan.name}: output {plan.output}, components bind {plan.bind_host}")
    for c in plan.components:
        where = c.external_url or describe(c)
        resources = f"cpus {c.cpus:g}" + (f", gpus {c.gpus:g}" if c.gpus else "")
        print(f"  {c.name:<20} [{c.role}; {resources}] {where}")


def run_launch(spec: Any, options: LaunchOptions, backend: Any = None) -> int:
    """Run ``spec`` on ``options.backend`` (or on ``backend``, a
    :class:`~atroposlib.launch.orchestrator.Backend` already made) until it ends; returns the
    exit status."""
    from atroposlib.launch.orchestrator import Run, RunFailed
    from atroposlib.launch.status import status_line, status_table
    from atroposlib.utils.processes import ProcessLaunchError

    if options.backend == "slurm" and backend is None:
        from atroposlib.launch.slurm import launch_slurm

        return launch_slurm(spec, options)
    log = logging.getLogger("atropos-launch")
    try:
        backend = backend or make_backend(options.backend, spec)
    except ImportError as exc:
        print(f"atropos-launch: --backend {options.backend}: {exc}", file=sys.stderr)
        return 2
    except RunFailed as exc:  # e.g. no Ray cluster at ray.address
        print(f"atropos-launch: --backend {options.backend}: {exc}", file=sys.stderr)
        return 1
    live_mode = options.status
    if live_mode == "auto":
        live_mode = "live" if sys.stdout.isatty() else "lines"
    run = Run(spec, backend)
    log.info("run %s: output in %s", run.plan.name, run.output)
    live = None
    last_line = [0.0]

    def tick() -> None:
        numbers = run.api_numbers()
        if live is not None:
            live.update(status_table(run, numbers))
        elif live_mode == "lines" and time.monotonic() - last_line[0] >= options.status_every:
            last_line[0] = time.monotonic()
            log.info("status: %s", status_line(run, numbers))

    code = 0
    try:
        if live_mode == "live":
            from rich.live import Live

            live = Live(status_table(run), refresh_per_second=1, transient=False)
            live.start()
        run.start()
        log.info("every component started; API at %s", run.ctx.get("api_url"))
        run.wait(interval=1.0, on_tick=tick)
        log.info("run finished")
    except KeyboardInterrupt:
        log.info("interrupted: stopping every component")
        code = 130
    except (RunFailed, ProcessLaunchError) as exc:
        print(f"atropos-launch: {exc}", file=sys.stderr)
        code = 1
    finally:
        summary = run.stop()
        if live is not None:
            live.update(status_table(run))
            live.stop()
        if summary is not None:
            api = summary.get("api") or {}
            log.info(
                "stopped. accepted %s groups, served %s batches, queued %s, dropped %s; summary: "
                "%s",
                api.get("accepted_groups"),
                api.get("batches_served"),
                api.get("queue_groups"),
                api.get("dropped"),
                run.output / "run_summary.json",
            )
    return code


def _check_settings(spec: Any, local: bool) -> None:
    """Every environment's and the GRPO trainer's settings, resolved as the real launch
    resolves them (:mod:`atroposlib.launch.check`); a problem is a :class:`RunSpecError`."""
    from atroposlib.launch.check import check_settings
    from atroposlib.launch.plan import plan_run

    check_settings(plan_run(spec), local=local)
    print("settings: every environment's and the trainer's settings check out")


def _check_output(folder: Any) -> None:
    """The output folder can be made and written to, else :class:`RunSpecError` naming it."""
    import tempfile

    from atroposlib.launch.spec import RunSpecError

    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise RunSpecError(
            f"output: cannot write to {folder}: {exc.strerror or exc} (set output, or "
            "--output, to a folder you can write)"
        ) from None


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``atropos-launch``."""
    from atroposlib.launch.spec import RunSpecError, load_run_spec

    parser = build_parser()
    options, namespace = parse_model(FLAGS, parser, argv)
    assert isinstance(options, LaunchOptions)
    overrides = {"output": options.output} if options.output else None
    try:
        spec = load_run_spec(namespace.run, overrides)
        spec.resolved_api_key()  # api_key: ${VAR} with VAR unset is an error naming the field
        if not options.dry_run:
            _check_output(spec.output_dir)
        if options.dry_run:
            _print_plan(spec)
            _check_settings(spec, local=options.backend == "local")
            if options.backend == "slurm":
                from atroposlib.launch.slurm import batch_script

                print(batch_script(spec))
            raise SystemExit(0)
        from atroposlib.launch.plan import plan_run

        plan_run(spec)  # file checks before anything starts
    except RunSpecError as exc:
        parser.exit(2, f"atropos-launch: {exc}\n")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    raise SystemExit(run_launch(spec, options))


if __name__ == "__main__":
    main()
