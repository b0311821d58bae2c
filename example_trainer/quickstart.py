"""``atropos-quickstart``: the whole RL loop with one command, on a laptop CPU.

It starts, as child processes it owns: ``run-api``, an inference server (``atropos-serve`` with
SmolLM2-135M-Instruct by default; ``--inference vllm`` lets the trainer launch vLLM and reload
each checkpoint into it in place instead, for GPU machines), and one environment in ``serve`` mode (``environments/
arithmetic_server.py`` by default, offline). Then it trains with the GRPO trainer in this
process, reloading the server's weights after every step, and writes into the output folder:

    OUTPUT/rollouts.jsonl, rollouts.html   what the environment generated and how it scored
    OUTPUT/checkpoints/step_N               the newest resumable checkpoints, with
                                            --trainer-arg checkpoint_interval=N (recipes set it)
    OUTPUT/final_model                      the trained model
    OUTPUT/metrics.jsonl                    every number: per step loss, reward, entropy,
                                            tokens/s, sync time; held-out evaluations
    OUTPUT/logs/*.log                       each child's log
    OUTPUT/run-api-metrics.json             what became of every group the environment sent
                                            (served, queued, dropped by reason), at the end

With ``--eval`` (on in every recipe) it also runs the environment's own ``evaluate`` on its
held-out split, greedily, against the served weights: before training (``eval_before.json``),
every ``--eval-every`` steps, and after the last step (``eval_after.json``); prints a
before/after table and draws ``training_curves.png``. The evaluations run in one process for
the whole run (``example_trainer.eval_worker``: the env is imported and set up once), each
into ``OUTPUT/evals/LABEL``.

``--recipe NAME`` picks a tested set of settings (see ``example_trainer/recipes.py``); any flag
given on the command line still wins. ``--resume`` continues an interrupted run in the same
output folder; without it, what an earlier run wrote there is first moved to
``OUTPUT/previous/<time>``. Every child is stopped on exit, on Ctrl-C and on SIGTERM.
"""

from __future__ import annotations

import _thread
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from atroposlib.utils.cli import REPEATABLE, FlagError, ModelArgumentParser, ModelFlags, parse_model
from example_trainer.recipes import RECIPES

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = "SmolLM2-135M-Instruct"


class QuickstartOptions(BaseModel):
    """The options of ``atropos-quickstart`` (one flag per field, through
    :class:`~atroposlib.utils.cli.ModelFlags`)."""

    model_config = ConfigDict(extra="forbid")

    recipe: Literal[tuple(sorted(RECIPES))] | None = Field(  # type: ignore[valid-type]
        None,
        description="A named set of settings that is known to learn: "
        + "; ".join(f"{name}: {r.summary}" for name, r in sorted(RECIPES.items()))
        + ". Flags given on the command line override the recipe's.",
    )
    env: str = Field(
        "arithmetic",
        description="Environment: a name NAME for environments/NAME_server.py (or NAME.py), or a "
        "path to an environment file.",
    )
    model: str = Field(
        DEFAULT_MODEL,
        description="Policy model: a local folder, or SmolLM2-135M-Instruct (packaged, no "
        "download).",
    )
    steps: int = Field(3, ge=1, description="Trainer steps (with --max-time: at most this many).")
    max_time: float | None = Field(
        None,
        description="Wall-clock budget of the whole run from its start (seconds, or 12m, "
        "11m30s, HH:MM:SS): from --min-steps on, the trainer stops when one more step and the "
        "final held-out evaluation (as long as the first one took) would not end within it. "
        "The step in progress finishes, so the run can end a little past it. Default: no "
        "budget, --steps steps (--max-time none turns a recipe's off).",
    )
    min_steps: int = Field(
        0,
        ge=0,
        description="Steps taken whatever --max-time says (more than --steps counts as --steps, "
        "so that --steps 5 with a recipe's --min-steps runs 5), as long as batches come: a "
        "batch that has not come when the budget is spent (and after at least 2 min) ends the "
        "run short of them, with a warning.",
    )
    trainer: Literal["grpo", "trl"] = Field(
        "grpo",
        description="grpo: the example GRPO trainer (example_trainer/grpo.py). trl: TRL's "
        "GRPOTrainer through atroposlib.integrations.trl (pip install -e '.[trl]'), same loop, "
        "same evaluations.",
    )
    output: str = Field("atropos-quickstart", description="Output folder (created if missing).")
    inference: Literal["atropos-serve", "vllm"] = Field(
        "atropos-serve",
        description="atropos-serve: embedded CPU server, hot weight reload. vllm: the trainer "
        "launches vLLM and reloads each checkpoint into it in place (GPU).",
    )
    group_size: int = Field(4, ge=1, description="Completions per prompt.")
    batch_size: int = Field(8, ge=1, description="Sequences per trainer step (whole groups).")
    micro_batch_size: int = Field(4, ge=1, description="Sequences per forward/backward pass.")
    lr: float = Field(2e-6, gt=0, description="Learning rate.")
    seq_len: int = Field(256, ge=1, description="Longest sequence the trainer accepts.")
    seed: int = Field(
        0,
        description="Seed of the trainer and of the environment's training problems (env.seed); "
        "the held-out evaluation set does not depend on it.",
    )
    eval: bool = Field(
        False,
        description="Evaluate on the env's held-out split (its evaluate command, greedy) before "
        "training, every --eval-every steps and after; write eval_before.json, "
        "eval_after.json and training_curves.png.",
    )
    eval_every: int = Field(
        0,
        ge=0,
        description="Steps between held-out evaluations during training (0: only before and "
        "after).",
    )
    resume: bool = Field(
        False, description="Continue the run in --output from its newest resumable checkpoint."
    )
    device: str | None = Field(
        None, description="Trainer device (default: cuda if available, else cpu)."
    )
    api_port: int = Field(0, description="run-api port (0: a free port).")
    inference_port: int = Field(0, description="Inference server port (0: a free port).")
    vllm_python: str = Field(
        default_factory=lambda: sys.executable,
        description="Python that runs vLLM (--inference vllm), e.g. a separate virtualenv's.",
    )
    vllm_arg: list[str] = Field(
        default_factory=list,
        json_schema_extra=REPEATABLE,
        description="Extra vLLM argument (--vllm-arg=--max-model-len --vllm-arg=2048).",
    )
    serve_arg: list[str] = Field(
        default_factory=list,
        json_schema_extra=REPEATABLE,
        description="Extra atropos-serve argument (--serve-arg=--dtype --serve-arg=float32).",
    )
    batch_timeout: float = Field(
        600.0, description="Seconds to wait for one batch before stopping with an error."
    )
    wandb: Literal["off", "offline", "online"] = Field(
        "off", description="Weights & Biases logging of the trainer."
    )
    env_arg: list[str] = Field(
        default_factory=list,
        json_schema_extra=REPEATABLE,
        description="Extra environment flag as FLAG=VALUE, e.g. --env-arg env.max_operand=10 "
        "(after the recipe's; the last one of a flag wins).",
    )
    trainer_arg: list[str] = Field(
        default_factory=list,
        json_schema_extra=REPEATABLE,
        description="Any GRPO trainer setting (atropos-grpo --help) as FIELD=VALUE, e.g. "
        "--trainer-arg clip_eps=0.3 --trainer-arg kl_coef=0.01 (after the recipe's; the last "
        "one of a field wins).",
    )

    @field_validator("max_time", mode="before")
    @classmethod
    def _duration(cls, value: Any) -> float | None:
        from example_trainer.budget import parse_duration

        if value is None or str(value).strip().lower() in ("", "none", "off"):
            return None
        return parse_duration(value)


FLAGS = ModelFlags(QuickstartOptions)


def build_parser() -> ModelArgumentParser:
    """The flags of ``atropos-quickstart``: one per :class:`QuickstartOptions` field."""
    parser = ModelArgumentParser(
        prog="atropos-quickstart",
        description="Run run-api, an inference server, one environment and the GRPO trainer "
        "together (CPU-friendly defaults). --recipe NAME picks a tested learning setup.",
    )
    FLAGS.add_to(parser)
    return parser


FIRST_RUN_ENV_ARGS = [
    "env.max_operand=9",
    "env.operators=+",
    "env.few_shot=3",
    "env.max_answer_tokens=6",
    "env.num_eval_problems=40",  # held out of the 100 problems these settings allow
    # a group the model answers all right or all wrong teaches nothing: send only mixed ones
    "env.ensure_scores_are_not_same=true",
]
"""The arithmetic settings of a run without ``--recipe`` (the first one a user makes): easy
enough that groups of 4 often score differently, so each step trains."""


def _recipe_defaults(given: dict[str, Any]) -> dict[str, Any]:
    """The values of the recipe ``--recipe`` names, under the flags given; without one, the
    first-run arithmetic settings (``FIRST_RUN_ENV_ARGS``) when the env is the default."""
    recipe = RECIPES.get(str(given.get("recipe")))
    if recipe is not None:
        return recipe.options(str(given.get("trainer") or "grpo"))
    if given.get("env", "arithmetic") == "arithmetic":
        return {"env_arg": list(FIRST_RUN_ENV_ARGS)}
    return {}


def _check(options: BaseModel) -> None:
    """What one flag's value cannot say alone, as usage errors naming the flags."""
    assert isinstance(options, QuickstartOptions)
    batch, group, micro = options.batch_size, options.group_size, options.micro_batch_size
    if batch % group:
        raise FlagError(f"--batch-size '{batch}': must be a multiple of --group-size ({group})")
    if batch % micro:
        raise FlagError(
            f"--batch-size '{batch}': must be a multiple of --micro-batch-size ({micro})"
        )
    find_env_file(options.env)
    _flag_list(options.env_arg, "--env-arg")
    _trainer_overrides(options.trainer_arg)
    checkpoints = Path(options.output).expanduser().resolve() / "checkpoints"
    if options.trainer == "trl":
        if options.inference != "atropos-serve":
            raise FlagError("--trainer trl: only with --inference atropos-serve")
        if options.resume:
            raise FlagError("--trainer trl: --resume is not supported")
        if options.max_time is not None:
            raise FlagError("--max-time: only with --trainer grpo (TRL runs --steps steps)")
        try:
            import trl  # noqa: F401
        except ImportError:
            raise FlagError(
                "--trainer trl: TRL is not installed: pip install -e '.[trl]'"
            ) from None
    if options.resume and not checkpoints.is_dir():
        raise FlagError(f"--resume: no run to resume in {checkpoints.parent}")


def parse_args(argv: Sequence[str] | None = None) -> QuickstartOptions:
    """The options: a recipe's values under the flags given (flags on the command line win;
    ``--env-arg``/``--trainer-arg`` add to the recipe's). A bad value exits with code 2, naming
    the flag."""
    options, _ = parse_model(FLAGS, build_parser(), argv, base=_recipe_defaults, check=_check)
    assert isinstance(options, QuickstartOptions)
    return options


def find_env_file(env: str) -> Path:
    """The environment file for ``--env`` (a path, or a name under ``environments/``).

    Raises:
        FlagError: No such file, or no such environment (the message lists the known ones).
    """
    path = Path(env).expanduser()
    if path.suffix == ".py":
        if not path.is_file():
            raise FlagError(f"--env {env!r}: no such file")
        return path.resolve()
    folder = REPO_ROOT / "environments"
    for candidate in (folder / f"{env}_server.py", folder / f"{env}.py"):
        if candidate.is_file():
            return candidate
    known = sorted(p.stem.removesuffix("_server") for p in folder.glob("*.py"))
    raise FlagError(f"--env {env!r}: not found in {folder} (known: {', '.join(known)})")


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _watch(run: Any, stop: threading.Event, failed: list[str]) -> None:
    """Interrupt the main thread if a child fails while training runs (an environment that
    exits 0 by itself has sent enough data for the run)."""
    from atroposlib.launch import RunFailed

    while not stop.wait(1.0):
        try:
            run.check()
        except RunFailed as exc:
            failed.append(str(exc))
            _thread.interrupt_main()
            return


def _flag_list(pairs: Sequence[str], what: str) -> list[str]:
    """``["env.x=1", ...]`` as argv ``["--env.x", "1", ...]`` (a pair without ``=`` is a
    ``FlagError`` naming the flag ``what``)."""
    argv: list[str] = []
    for pair in pairs:
        flag, sep, value = pair.partition("=")
        if not sep or not flag.strip("-"):
            raise FlagError(f"{what} {pair!r}: expected FLAG=VALUE")
        argv += [f"--{flag.lstrip('-')}", value]
    return argv


def _trainer_overrides(pairs: Sequence[str]) -> dict[str, Any]:
    """``--trainer-arg FIELD=VALUE`` pairs as TrainingConfig fields (values parsed as YAML)."""
    import yaml

    from example_trainer.config import TrainingConfig

    fields = TrainingConfig.model_fields
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip().lstrip("-").replace("-", "_")
        if not sep or key not in fields:
            known = ", ".join(sorted(fields))
            raise FlagError(
                f"--trainer-arg {pair!r}: expected FIELD=VALUE with FIELD one of: {known}"
            )
        out[key] = yaml.safe_load(value) if value else None
    return out


class _Evaluator:
    """Held-out evaluations of the served weights: files, metrics records, the final table."""

    def __init__(self, args: QuickstartOptions, env_file: Path, out: Path, **where: str) -> None:
        self.args, self.env_file, self.out, self.where = args, env_file, out, where
        self.env_argv = _flag_list(args.env_arg, "--env-arg")
        self.console = logging.getLogger("atropos-quickstart")
        #: each evaluation's metrics by step, its wall time (``eval_seconds``) included
        self.results: dict[int, dict[str, float]] = {}
        self._worker: Any = None

    def worker(self) -> Any:
        """The run's evaluation process (:class:`~example_trainer.eval_worker.EvalWorker`):
        the env is imported, built and set up once for all of the run's evaluations."""
        if self._worker is None:
            from example_trainer.eval_worker import EvalWorker
            from example_trainer.report import eval_flags, eval_process_env

            flags = eval_flags(
                inference_url=self.where["inference_url"],
                model_name=self.where["served_name"],
                tokenizer=self.where["tokenizer"],
                env_args=self.env_argv,
                server_type="openai" if self.args.inference == "vllm" else None,
            )
            self._worker = EvalWorker(
                self.env_file,
                flags,
                self.out / "logs" / "evaluator.log",
                cwd=REPO_ROOT,
                env=eval_process_env(),
            )
        return self._worker

    def close(self) -> None:
        """Stop the evaluation process, if one was started."""
        if self._worker is not None:
            self._worker.close()

    def run(self, step: int, label: str) -> dict[str, float]:
        folder = self.out / "evals" / label
        self.console.info("held-out evaluation (%s): %s evaluate()", label, self.env_file.name)
        metrics = self.worker().evaluate(folder)
        if label in ("before", "after"):
            shutil.copyfile(folder / "metrics.json", self.out / f"eval_{label}.json")
        self.results[step] = metrics
        shown = ", ".join(f"{k} {v:.3f}" for k, v in metrics.items() if k.startswith("eval/"))
        self.console.info("held-out evaluation (%s, step %d): %s", label, step, shown)
        return metrics


def run(args: QuickstartOptions) -> int:
    """Start everything, train, stop everything; returns the exit status.

    ``args`` comes from :func:`parse_args`, which has checked it.
    """
    env_file = find_env_file(args.env)
    trainer_overrides = _trainer_overrides(args.trainer_arg)
    env_argv = _flag_list(args.env_arg, "--env-arg")
    # torch, transformers and the API's modules load only once the flags are known to be
    # good: a mistyped flag is reported at once, not after seconds of imports
    from pydantic import ValidationError

    from atroposlib.inference.models import resolve_model_source
    from atroposlib.utils.shm_weights import SegmentSpaceError
    from example_trainer.api import TrajectoryAPIError
    from example_trainer.checkpoint import CheckpointSpaceError
    from example_trainer.config import TrainingConfig
    from example_trainer.grpo import train
    from example_trainer.inference_process import InferenceLaunchError

    out = Path(args.output).expanduser().resolve()
    logs, checkpoints = out / "logs", out / "checkpoints"
    console = logging.getLogger("atropos-quickstart")
    if not args.resume:
        moved = set_aside_previous_run(out)
        if moved is not None:
            console.info(
                "%s held an earlier run: moved to %s (--resume continues a run instead)",
                out,
                moved,
            )
    logs.mkdir(parents=True, exist_ok=True)
    rollouts = out / "rollouts.jsonl"
    metrics_file = out / "metrics.jsonl"
    if args.recipe:
        console.info("recipe %s: %s", args.recipe, RECIPES[args.recipe].summary)
    (out / "quickstart_args.json").write_text(json.dumps(args.model_dump(), indent=2))

    console.info("model: %s", args.model)
    model_dir = resolve_model_source(args.model)  # converts the packaged SmolLM2 once
    served_name = Path(args.model).name if Path(args.model).is_dir() else args.model
    api_port = args.api_port or _free_port()
    inference_port = args.inference_port or _free_port()
    api_url = f"http://127.0.0.1:{api_port}"
    inference_url = f"http://127.0.0.1:{inference_port}"
    evaluator = _Evaluator(
        args, env_file, out, inference_url=inference_url, served_name=served_name,
        tokenizer=model_dir,
    )  # fmt: skip

    try:
        config = TrainingConfig(
            **{
                "model_name": model_dir,
                "served_model_name": served_name,
                "atropos_url": api_url,
                "inference": args.inference,
                "inference_url": inference_url,
                "vllm_port": inference_port,
                "vllm_python": args.vllm_python,
                "vllm_extra_args": args.vllm_arg,
                "vllm_log": str(logs / "vllm.log"),
                "training_steps": args.steps,
                "batch_size": args.micro_batch_size,
                "gradient_accumulation_steps": args.batch_size // args.micro_batch_size,
                "seq_len": args.seq_len,
                "lr": args.lr,
                "seed": args.seed,
                "save_path": str(checkpoints),
                "metrics_file": str(metrics_file),
                "weight_sync_interval": 1,
                # only final_model stays unless checkpoints are asked for
                # (--trainer-arg checkpoint_interval=N; every recipe asks)
                "keep_checkpoints": 2 if trainer_overrides.get("checkpoint_interval") else 0,
                "batch_timeout": args.batch_timeout,
                "use_wandb": args.wandb != "off",
                "wandb_mode": None if args.wandb == "off" else args.wandb,
                "wandb_project": "atropos-quickstart",
                "resume": "latest" if args.resume else None,
                **({"device": args.device} if args.device else {}),
                **trainer_overrides,
            }
        )
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'trainer'}: {e['msg']}" for e in exc.errors()
        )
        raise SystemExit(f"atropos-quickstart: trainer settings: {problems}") from None
    # resolved once, here: the server is started in the precision the trainer computes in
    from example_trainer.grpo import resolve_precision

    config = config.model_copy(update={"dtype": resolve_precision(config)})
    console.info("precision: %s (atropos-serve --dtype %s)", config.dtype, _serve_dtype(config))

    run_spec = _run_spec(args, env_file, out, model_dir, served_name, config, env_argv, rollouts)
    run_spec = run_spec.model_copy(
        update={"api": run_spec.api.model_copy(update={"port": api_port})}
    )
    from atroposlib.launch import Run, RunFailed
    from atroposlib.launch.local import LocalBackend

    launched = Run(run_spec, LocalBackend(), on_event=lambda line: console.info("%s", line))
    stop_watch = threading.Event()
    failed: list[str] = []
    started = time.monotonic()
    final = None
    budget = None
    evaluated_after: list[int] = []
    env_started = False
    completed = False
    try:
        launched.start_services()  # run-api and atropos-serve, each answering /health

        def on_ready() -> None:
            """The server serves the starting weights: start the env, evaluate them."""
            nonlocal env_started
            # The env starts first: its start-up (imports, tokenizer, config) overlaps the
            # evaluation. It registers, and starts its rollouts, once the trainer asks for
            # its first batch (run-api opens /register-env then), i.e. after the evaluation:
            # on 2 cores, rollouts during the evaluation made the two together slower (~150 s
            # against ~115 s one after the other: the env generated ahead of need, and the
            # engine lost its grouped layout to the evaluation's single-sample requests).
            launched.start_environments()
            env_started = True
            if args.eval and not (args.resume and (out / "eval_before.json").is_file()):
                before = evaluator.run(0, "before")
                _append(metrics_file, {"step": 0, "time": time.time(), **before})
            elif args.eval:  # resumed: the first evaluation's record, for the time budget
                from example_trainer.report import read_metrics

                records = read_metrics(metrics_file)
                first = [r for r in records if r["step"] == 0 and "eval_seconds" in r]
                if first:
                    evaluator.results[0] = first[0]

        def _stop_rollouts() -> None:
            """Training is over: the env's rollouts would only compete with the "after"
            evaluation for the cores (a gsm8k-format evaluation took 92-140 s beside them,
            82-93 s without)."""
            for name in launched.stop_environments():
                console.info("%s: stopped (training is over; its rollouts are not needed)", name)

        def on_step(step: int, synced: Path | None) -> dict[str, float] | None:
            if not args.eval or synced is None:
                return None
            if step == args.steps or (budget is not None and budget.stopped_at == step):
                evaluated_after.append(step)
                _stop_rollouts()
                return evaluator.run(step, "after")
            if args.eval_every and step % args.eval_every == 0:
                return evaluator.run(step, f"step_{step}")
            return None

        if args.max_time is not None:
            from example_trainer.budget import TimeBudget

            # counted from the command's start; the end keeps room for the "after" evaluation
            # (as long as the "before" one took: the base model's replies run longest)
            budget = TimeBudget(
                args.max_time,
                min_steps=min(args.min_steps, args.steps),
                started=started,
                reserve=lambda: (
                    float(evaluator.results.get(0, {}).get("eval_seconds", 0.0))
                    if args.eval
                    else 0.0
                ),
            )
        threading.Thread(target=_watch, args=(launched, stop_watch, failed), daemon=True).start()
        if args.trainer == "trl":
            from example_trainer.trl_train import train_trl

            final = train_trl(
                config,
                on_step,
                on_ready=on_ready,
                sync_at_end=args.eval,
                num_generations=args.group_size,
                temperature=_env_temperature(env_argv),
            )
        else:
            final = train(config, on_step, on_ready=on_ready, sync_at_end=args.eval, budget=budget)
            if args.eval and budget is not None and budget.stopped_at and not evaluated_after:
                # the budget ended training while the trainer waited for a batch: the server
                # serves the last step's weights, evaluated here as after any last step
                step = budget.stopped_at
                _stop_rollouts()
                after = evaluator.run(step, "after")
                _append(metrics_file, {"step": step, "time": time.time(), **after})
        final = _publish_final(final, out)
        completed = True
    except KeyboardInterrupt:
        if failed:
            print(f"\natropos-quickstart: stopped: {failed[0]}", file=sys.stderr)
            return 1
        print("\natropos-quickstart: interrupted; stopping every process", file=sys.stderr)
        print(f"  continue with: atropos-quickstart ... --output {out} --resume", file=sys.stderr)
        return 130
    except (InferenceLaunchError, RunFailed) as exc:
        print(f"atropos-quickstart: {exc}", file=sys.stderr)
        return 1
    except (CheckpointSpaceError, SegmentSpaceError) as exc:
        print(f"atropos-quickstart: {exc.strerror}", file=sys.stderr)
        return 1
    except TrajectoryAPIError as exc:
        env_state = launched.states.get("env")
        handle = env_state.handle if env_state is not None else None
        tail = handle.log_tail(2000) if handle is not None and env_started else ""
        print(
            f"atropos-quickstart: {exc}\nenvironment log ({logs / 'env.log'}):\n{tail}",
            file=sys.stderr,
        )
        return 1
    except Exception as exc:
        from example_trainer.report import EvaluationError

        if not isinstance(exc, EvaluationError):
            raise
        print(f"atropos-quickstart: held-out evaluation failed: {exc}", file=sys.stderr)
        return 1
    finally:
        stop_watch.set()
        queue_line = _queue_report(api_url, out)
        evaluator.close()
        launched.stop()
        _summary(
            out, rollouts, checkpoints, final, logs, time.monotonic() - started, args, completed,
            budget,
        )  # fmt: skip
        if queue_line:
            print(queue_line)
    return 0


def _queue_report(api_url: str, out: Path) -> str:
    """What became of every group the environment sent, from run-api's ``/metrics`` before it
    stops: saved as ``run-api-metrics.json`` in the output folder; returns a one-line summary
    ("" when run-api no longer answers)."""
    import httpx

    try:
        reply = httpx.get(f"{api_url}/metrics", params={"format": "json"}, timeout=5.0)
        reply.raise_for_status()
        m = reply.json()
    except (httpx.HTTPError, ValueError):
        return ""
    (out / "run-api-metrics.json").write_text(json.dumps(m, indent=2) + "\n")
    dropped = ", ".join(f"{k} {v}" for k, v in sorted(m.get("dropped", {}).items())) or "none"
    partial = ", ".join(f"{k} {v}" for k, v in sorted(m.get("partial_groups", {}).items()))
    before = ", ".join(f"{k} {v}" for k, v in sorted(m.get("env_dropped", {}).items()))
    return (
        f"run-api: {m.get('accepted_groups', 0)} groups accepted, "
        f"{m.get('groups_served', 0)} served in {m.get('batches_served', 0)} batches, "
        f"{m.get('queue_groups', 0)} still queued, {m.get('buffered_groups', 0)} held as parts "
        f"of a group ({m.get('buffered_sequences', 0)} sequences), dropped: {dropped}"
        + (f"; parts of one prompt's group: {partial}" if partial else "")
        + (f"; dropped by the env before sending: {before}" if before else "")
        + f" ({out / 'run-api-metrics.json'})"
    )


def _run_spec(
    args: QuickstartOptions,
    env_file: Path,
    out: Path,
    model_dir: str,
    served_name: str,
    config: Any,
    env_argv: list[str],
    rollouts: Path,
) -> Any:
    """The quick-start loop as a run description for ``atropos-launch``'s local backend:
    run-api, atropos-serve (unless the trainer launches vLLM) and the environment; the trainer
    runs in this process."""
    from atroposlib.launch.spec import RunSpec

    checkpoints = out / "checkpoints"
    inference_port = int(config.inference_url.rsplit(":", 1)[1])
    if args.inference == "atropos-serve":
        inference = [
            {
                "name": "atropos-serve",
                "kind": "atropos-serve",
                "model": model_dir if not args.resume else _resume_weights(checkpoints, model_dir),
                "served_model_name": served_name,
                "port": inference_port,
                "startup_timeout": 300,
                "env": {"HF_HUB_OFFLINE": "1"},  # the packaged model: nothing to download
                "args": [
                    "--log-level",
                    "warning",
                    # serve the precision the trainer computes in: a bfloat16 copy of
                    # float32 training weights rounds small updates away, and a float32
                    # server for bf16-mixed training sees updates the trainer's bfloat16
                    # arithmetic does not yet: either way the samples come from another
                    # policy (measured: a fifth to two thirds of tokens clipped, no learning)
                    "--dtype",
                    _serve_dtype(config),
                    *args.serve_arg,
                ],
            }
        ]
    else:
        # the trainer launches vLLM (no /generate: plain chat completions; the env
        # re-tokenizes and sends no inference_logprobs)
        inference = [
            {
                "name": "vllm",
                "kind": "external",
                "url": f"{config.inference_url}/v1",
                "served_model_name": served_name,
            }  # fmt: skip
        ]
    env_values = {
        "group_size": args.group_size,
        "batch_size": args.batch_size,
        "total_steps": args.steps,
        "max_token_length": args.seq_len,
        "tokenizer_name": model_dir,
        "use_wandb": False,
        "steps_per_eval": 0,
        "data_path_to_save_groups": str(rollouts),
        "seed": args.seed,
    }
    return RunSpec.model_validate(
        {
            "name": "quickstart",
            "output": str(out),
            "inference": inference,
            "environments": [
                {
                    "name": "env",
                    "file": str(env_file),
                    "env": env_values,
                    "args": env_argv,
                    "max_restarts": 0,
                }  # fmt: skip
            ],
            "base_dir": str(REPO_ROOT),
        }
    )


def _env_temperature(env_argv: list[str]) -> float:
    """The sampling temperature the environment is given (``--env.temperature``), else 1.0."""
    temperature = 1.0
    for flag, value in zip(env_argv[::2], env_argv[1::2], strict=True):
        if flag == "--env.temperature":
            temperature = float(value)
    return temperature


def _serve_dtype(config: Any) -> str:
    """atropos-serve's ``--dtype``: the dtype the trainer computes in (``bfloat16`` for
    ``bf16-mixed``: its float32 weights are rounded to bfloat16 on the server as autocast
    rounds them in the trainer)."""
    from example_trainer.grpo import compute_dtype_name

    return compute_dtype_name(config)


def _append(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a") as handle:
        handle.write(json.dumps(record) + "\n")


#: a run's records: an --output holding one of them holds an earlier run
RUN_RECORDS = ("metrics.jsonl", "rollouts*.jsonl", "eval_before.json", "eval_after.json")
#: what a run writes into its --output folder (what :func:`set_aside_previous_run` moves)
RUN_FILES = (
    *RUN_RECORDS,
    "rollouts*.html",
    "evals",
    "logs",
    "checkpoints",
    "final_model",
    "configs",
    "quickstart_args.json",
    "run-api-metrics.json",
    "run_summary.json",
    "training_curves.png",
)


def set_aside_previous_run(out: Path) -> Path | None:
    """Move what an earlier run wrote into ``out`` to ``out/previous/<time>``, so that a new run
    starts with its own metrics, rollouts and evaluations (appended to the earlier run's, its
    curves, table and time budget would mix both). Only a run's own files move (:data:`RUN_FILES`;
    nothing else in ``out`` is touched), and only when there is a run's record
    (:data:`RUN_RECORDS`). Returns the new folder, or None when there was nothing to move."""
    if not any(any(out.glob(pattern)) for pattern in RUN_RECORDS):
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = out / "previous" / stamp
    n = 1
    while target.exists():
        n += 1
        target = out / "previous" / f"{stamp}-{n}"
    target.mkdir(parents=True)
    for pattern in RUN_FILES:
        for path in sorted(out.glob(pattern)):
            path.rename(target / path.name)
    return target


def _resume_weights(checkpoints: Path, model_dir: str) -> str:
    """The weights a resumed run's server starts on: the newest resumable checkpoint."""
    from example_trainer.checkpoint import latest_resumable

    folder = latest_resumable(checkpoints)
    return str(folder) if folder is not None else model_dir


def _publish_final(final: Path, out: Path) -> Path:
    """Move the trainer's final model to ``OUTPUT/final_model``."""
    target = out / "final_model"
    if final.resolve() == target.resolve():
        return final
    if target.exists():
        shutil.rmtree(target)
    shutil.move(str(final), target)
    return target


def _summary(
    out: Path,
    rollouts: Path,
    checkpoints: Path,
    final: Path | None,
    logs: Path,
    seconds: float,
    args: QuickstartOptions,
    completed: bool = True,
    budget: Any = None,
) -> None:
    """Render the rollouts as HTML, the curves and the table, and print where everything is
    (``completed`` False: the run stopped early, on the error printed above; ``budget``: the
    run's :class:`~example_trainer.budget.TimeBudget`, if it had one)."""
    if completed:
        lines = [f"\natropos-quickstart finished in {seconds:.0f} s. Everything is in {out}:"]
    else:
        lines = [
            f"\natropos-quickstart stopped after {seconds:.0f} s (see the error above). What "
            f"it wrote is in {out}:"
        ]
    for jsonl in sorted(out.glob("rollouts*.jsonl")):
        try:
            from atroposlib.frontend.jsonl2html import generate_html

            html = generate_html(jsonl)
            lines.append(f"  rollouts      {jsonl}  (view: {html})")
        except Exception as exc:  # noqa: BLE001 - the summary must always print
            lines.append(f"  rollouts      {jsonl}  (HTML failed: {exc})")
    if not list(out.glob("rollouts*.jsonl")):
        lines.append("  rollouts      (none written)")
    steps = sorted(p.name for p in checkpoints.glob("step_*"))
    if steps:
        lines.append(f"  checkpoints   {checkpoints}  ({', '.join(steps)})")
    else:
        lines.append("  checkpoints   none kept (--trainer-arg checkpoint_interval=N keeps some)")
    if final is not None:
        lines.append(f"  final model   {final}")
    metrics = out / "metrics.jsonl"
    if metrics.is_file():
        lines.append(f"  metrics       {metrics}")
        try:
            from example_trainer.report import plot_training_curves

            title = f"{args.recipe or args.env} · seed {args.seed}"
            png = plot_training_curves(metrics, out / "training_curves.png", title=title)
            if png is not None:
                lines.append(f"  curves        {png}")
        except Exception as exc:  # noqa: BLE001 - the summary must always print
            lines.append(f"  curves        (failed: {exc})")
    lines.append(f"  logs          {logs}")
    if budget is not None and budget.stopped_at is not None:
        lines.append(f"  steps         {budget.stopped_at} of up to {args.steps} ({budget.reason})")
    elif budget is not None and completed:
        lines.append(f"  steps         all {args.steps} within the time budget")
    spikes = _spike_steps(metrics)
    if spikes:
        lines.append(
            f"  skipped       {len(spikes)} optimizer step(s) for a gradient spike (step "
            f"{', '.join(map(str, spikes))}; skip_grad_spikes)"
        )
    before, after = out / "eval_before.json", out / "eval_after.json"
    if before.is_file() and after.is_file():
        from example_trainer.report import before_after_table, read_eval_metrics

        lines.append(f"  evaluations   {before}, {after}")
        table = before_after_table(
            read_eval_metrics(before), read_eval_metrics(after), "held-out (greedy)"
        )
        lines.append("\n" + table)
    print("\n".join(lines), file=sys.stderr)


def _spike_steps(metrics: Path) -> list[int]:
    """The steps of ``metrics.jsonl`` whose optimizer step was skipped for a gradient spike."""
    from example_trainer.report import read_metrics

    return [int(r["step"]) for r in read_metrics(metrics) if r.get("grad_spike_skipped")]


_interrupted = False


def _interrupt(*_: object) -> None:
    """First Ctrl-C/SIGTERM: stop cleanly (the ``finally`` of :func:`run`). Another one while
    that runs: one line and exit now, no traceback; the children's reaper
    (``example_trainer.inference_process``) stops whatever is still running."""
    global _interrupted
    if _interrupted:
        sys.stdout.flush()
        print(
            "\natropos-quickstart: interrupted again; exiting now (the children are stopped "
            "in the background)",
            file=sys.stderr,
            flush=True,
        )
        os._exit(130)
    _interrupted = True
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``atropos-quickstart``."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # Ctrl-C and SIGTERM both end in the finally block that stops every child. Installed
    # explicitly: a shell starts background jobs with SIGINT ignored, and Python then keeps
    # it ignored (so neither Ctrl-C nor interrupt_main would stop the run).
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    raise SystemExit(run(args))


if __name__ == "__main__":
    main()
