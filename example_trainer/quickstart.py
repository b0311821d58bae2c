"""``atropos-quickstart``: the whole RL loop with one command, on a laptop CPU.

It starts, as child processes it owns: ``run-api``, an inference server (``atropos-serve`` with
SmolLM2-135M-Instruct by default; ``--inference vllm`` lets the trainer launch and restart vLLM
instead, for GPU machines), and one environment in ``serve`` mode (``environments/
arithmetic_server.py`` by default, offline). Then it trains with the GRPO trainer in this
process for a few steps, reloading the server's weights after every step, and writes into the
output folder:

    OUTPUT/rollouts.jsonl, rollouts.html   what the environment generated and how it scored
    OUTPUT/checkpoints/step_N, final_model  checkpoints (loadable by atropos-serve and vLLM)
    OUTPUT/checkpoints/metrics.jsonl        loss, reward, tokens/s, sync time per step
    OUTPUT/logs/*.log                       each child's log

Every child is stopped on exit, on Ctrl-C and on SIGTERM.
"""

from __future__ import annotations

import _thread
import argparse
import logging
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from example_trainer.api import TrajectoryAPIError
from example_trainer.inference_process import ChildProcess, InferenceLaunchError

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = "SmolLM2-135M-Instruct"


def build_parser() -> argparse.ArgumentParser:
    """The flags of ``atropos-quickstart``."""
    parser = argparse.ArgumentParser(
        prog="atropos-quickstart",
        description="Run run-api, an inference server, one environment and the GRPO trainer "
        "together for a few steps (CPU-friendly defaults).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--env",
        default="arithmetic",
        help="Environment: a name NAME for environments/NAME_server.py (or NAME.py), or a path "
        "to an environment file.",
    )
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="Policy model: a local folder, or SmolLM2-135M-Instruct (packaged, no download).",
    )
    parser.add_argument("--steps", type=int, default=3, help="Trainer steps.")
    parser.add_argument(
        "--output", default="atropos-quickstart", help="Output folder (created if missing)."
    )
    parser.add_argument(
        "--inference",
        choices=["atropos-serve", "vllm"],
        default="atropos-serve",
        help="atropos-serve: embedded CPU server, hot weight reload. vllm: the trainer launches "
        "vLLM and restarts it on each checkpoint (GPU).",
    )
    parser.add_argument("--group-size", type=int, default=4, help="Completions per prompt.")
    parser.add_argument(
        "--batch-size", type=int, default=8, help="Sequences per trainer step (whole groups)."
    )
    parser.add_argument(
        "--micro-batch-size", type=int, default=4, help="Sequences per forward/backward pass."
    )
    parser.add_argument("--lr", type=float, default=2e-6, help="Learning rate.")
    parser.add_argument(
        "--seq-len", type=int, default=256, help="Longest sequence the trainer accepts."
    )
    parser.add_argument(
        "--device", default=None, help="Trainer device (default: cuda if available, else cpu)."
    )
    parser.add_argument("--api-port", type=int, default=0, help="run-api port (0: a free port).")
    parser.add_argument(
        "--inference-port", type=int, default=0, help="Inference server port (0: a free port)."
    )
    parser.add_argument(
        "--vllm-python",
        default=sys.executable,
        help="Python that runs vLLM (--inference vllm), e.g. a separate virtualenv's.",
    )
    parser.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="Extra vLLM argument, repeatable (--vllm-arg=--max-model-len --vllm-arg=2048).",
    )
    parser.add_argument(
        "--batch-timeout",
        type=float,
        default=600.0,
        help="Seconds to wait for one batch before stopping with an error.",
    )
    parser.add_argument(
        "--wandb",
        choices=["off", "offline", "online"],
        default="off",
        help="Weights & Biases logging of the trainer.",
    )
    parser.add_argument(
        "--env-arg",
        action="append",
        default=[],
        metavar="FLAG=VALUE",
        help="Extra environment flag, repeatable, e.g. --env-arg env.max_operand=10.",
    )
    return parser


def find_env_file(env: str) -> Path:
    """The environment file for ``--env`` (a path, or a name under ``environments/``)."""
    path = Path(env).expanduser()
    if path.suffix == ".py":
        if not path.is_file():
            raise SystemExit(f"atropos-quickstart: --env {env}: no such file")
        return path.resolve()
    folder = REPO_ROOT / "environments"
    for candidate in (folder / f"{env}_server.py", folder / f"{env}.py"):
        if candidate.is_file():
            return candidate
    known = sorted(p.stem.removesuffix("_server") for p in folder.glob("*.py"))
    raise SystemExit(
        f"atropos-quickstart: --env {env}: not found in {folder} (known: {', '.join(known)})"
    )


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _watch(children: list[ChildProcess], stop: threading.Event, failed: list[str]) -> None:
    """Interrupt the main thread if a child dies while training runs."""
    while not stop.wait(1.0):
        for child in children:
            code = None if child.proc is None else child.proc.poll()
            # An environment exits 0 by itself once it has sent enough data for the run.
            if code is not None and not (child.name == "env" and code == 0):
                failed.append(
                    f"{child.name} exited with status {child.proc.returncode}. "
                    f"Log ({child.log_path}):\n{child.log_tail(2000)}"
                )
                _thread.interrupt_main()
                return


def run(args: argparse.Namespace) -> int:
    """Start everything, train, stop everything; returns the exit status."""
    if args.batch_size % args.group_size:
        raise SystemExit("atropos-quickstart: --batch-size must be a multiple of --group-size")
    if args.batch_size % args.micro_batch_size:
        raise SystemExit(
            "atropos-quickstart: --batch-size must be a multiple of --micro-batch-size"
        )
    env_file = find_env_file(args.env)
    # torch and transformers load only once the flags are known to be good
    from atroposlib.inference.models import resolve_model_source
    from example_trainer.config import TrainingConfig
    from example_trainer.grpo import train

    out = Path(args.output).expanduser().resolve()
    logs, checkpoints = out / "logs", out / "checkpoints"
    logs.mkdir(parents=True, exist_ok=True)
    rollouts = out / "rollouts.jsonl"
    console = logging.getLogger("atropos-quickstart")

    console.info("model: %s", args.model)
    model_dir = resolve_model_source(args.model)  # converts the packaged SmolLM2 once
    served_name = Path(args.model).name if Path(args.model).is_dir() else args.model
    api_port = args.api_port or _free_port()
    inference_port = args.inference_port or _free_port()
    api_url = f"http://127.0.0.1:{api_port}"
    inference_url = f"http://127.0.0.1:{inference_port}"
    python = sys.executable

    children: list[ChildProcess] = []
    stop_watch = threading.Event()
    failed: list[str] = []
    started = time.monotonic()
    final = None
    env: ChildProcess | None = None
    try:
        api = ChildProcess(
            "run-api",
            [python, "-m", "atroposlib.cli.run_api", "--host", "127.0.0.1", "--port", api_port],
            logs / "run-api.log",
        ).start()
        children.append(api)
        api.wait_ready(api_url + "/info", 60)
        console.info("run-api ready at %s", api_url)

        if args.inference == "atropos-serve":
            server = ChildProcess(
                "atropos-serve",
                [
                    python,
                    "-m",
                    "atroposlib.inference.cli",
                    "--model",
                    model_dir,
                    "--port",
                    inference_port,
                    "--served-model-name",
                    served_name,
                    "--log-level",
                    "warning",
                ],
                logs / "atropos-serve.log",
                env={"HF_HUB_OFFLINE": "1"},
            ).start()
            children.append(server)
            waited = server.wait_ready(inference_url + "/health", 300)
            console.info("atropos-serve ready at %s (%.0f s)", inference_url, waited)

        env_command = [
            python,
            env_file,
            "serve",
            "--env.rollout_server_url",
            api_url,
            "--env.group_size",
            args.group_size,
            "--env.batch_size",
            args.batch_size,
            "--env.total_steps",
            args.steps,
            "--env.max_token_length",
            args.seq_len,
            "--env.tokenizer_name",
            model_dir,
            "--env.use_wandb",
            "false",
            "--env.steps_per_eval",
            "0",
            "--env.data_path_to_save_groups",
            rollouts,
            "--openai.base_url",
            f"{inference_url}/v1",
            "--openai.model_name",
            served_name,
        ]
        if args.inference == "vllm":
            # vLLM's OpenAI server has no /generate (token ids + logprobs): use plain chat
            # completions; the env re-tokenizes and sends no inference_logprobs.
            env_command += ["--openai.server_type", "openai"]
        for extra in args.env_arg:
            flag, _, value = extra.partition("=")
            env_command += [f"--{flag.lstrip('-')}", value]
        env = ChildProcess("env", env_command, logs / "env.log", cwd=REPO_ROOT).start()
        children.append(env)
        console.info("environment %s started (log: %s)", env_file.name, env.log_path)

        config = TrainingConfig(
            model_name=model_dir,
            served_model_name=served_name,
            atropos_url=api_url,
            inference=args.inference,
            inference_url=inference_url,
            vllm_port=inference_port,
            vllm_python=args.vllm_python,
            vllm_extra_args=args.vllm_arg,
            vllm_log=str(logs / "vllm.log"),
            training_steps=args.steps,
            batch_size=args.micro_batch_size,
            gradient_accumulation_steps=args.batch_size // args.micro_batch_size,
            seq_len=args.seq_len,
            lr=args.lr,
            save_path=str(checkpoints),
            weight_sync_interval=1,
            keep_checkpoints=2,
            batch_timeout=args.batch_timeout,
            use_wandb=args.wandb != "off",
            wandb_mode=None if args.wandb == "off" else args.wandb,
            wandb_project="atropos-quickstart",
            **({"device": args.device} if args.device else {}),
        )
        threading.Thread(target=_watch, args=(children, stop_watch, failed), daemon=True).start()
        final = train(config)
    except KeyboardInterrupt:
        if failed:
            print(f"\natropos-quickstart: stopped: {failed[0]}", file=sys.stderr)
            return 1
        print("\natropos-quickstart: interrupted; stopping every process", file=sys.stderr)
        return 130
    except InferenceLaunchError as exc:
        print(f"atropos-quickstart: {exc}", file=sys.stderr)
        return 1
    except TrajectoryAPIError as exc:
        tail = env.log_tail(2000) if env is not None else ""
        print(
            f"atropos-quickstart: {exc}\nenvironment log ({logs / 'env.log'}):\n{tail}",
            file=sys.stderr,
        )
        return 1
    finally:
        stop_watch.set()
        for child in reversed(children):
            child.stop()
        _summary(out, rollouts, checkpoints, final, logs, time.monotonic() - started)
    return 0


def _summary(
    out: Path, rollouts: Path, checkpoints: Path, final: Path | None, logs: Path, seconds: float
) -> None:
    """Render the rollouts as HTML and print where everything is."""
    lines = [f"\natropos-quickstart finished in {seconds:.0f} s. Everything is in {out}:"]
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
    lines.append(f"  checkpoints   {checkpoints}  ({', '.join(steps) or 'none'})")
    if final is not None:
        lines.append(f"  final model   {final}")
    if (checkpoints / "metrics.jsonl").is_file():
        lines.append(f"  metrics       {checkpoints / 'metrics.jsonl'}")
    lines.append(f"  logs          {logs}")
    print("\n".join(lines), file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``atropos-quickstart``."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # SIGTERM behaves like Ctrl-C, so the finally block stops every child.
    signal.signal(signal.SIGTERM, lambda *_: _thread.interrupt_main())
    raise SystemExit(run(args))


if __name__ == "__main__":
    main()
