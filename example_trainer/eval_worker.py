"""A held-out evaluator that stays up for a whole run.

``python ENV_FILE evaluate`` per evaluation starts a Python process, imports the env and its
libraries, builds it and runs its ``setup()`` (tokenizer, dataset) every time: 11-13.5 s of
each of arithmetic-learn's five evaluations on a 2-core CPU, as long as the evaluation itself
(14-26 s). :class:`EvalWorker` starts one process per run that does that once and then runs
``evaluate()`` each time it is asked, with what ``evaluate`` writes (``metrics.json``,
``samples.jsonl``, ``evaluate_config.yaml``, the log with its progress bar) in the folder of
each evaluation, as before. It stays a separate process: an env that crashes or hangs is
stopped without taking the trainer down.

The worker side is ``python -m example_trainer.eval_worker ENV_FILE [--env.* / --openai.*
flags]``. It reads one JSON line per request on stdin, ``{"out_dir": PATH}``, and answers each
with one JSON line on the stdout it started with: ``{"ok": true}`` or ``{"ok": false, "error":
...}``; once set up it says ``{"ready": true}``. While an evaluation runs its stdout and stderr
go to ``PATH/evaluate.log``, between evaluations to the worker's own log.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

from example_trainer.report import EvaluationError

logger = logging.getLogger(__name__)


def load_env_class(env_file: Path) -> type:
    """The environment class of ``env_file``: the one its ``if __name__ == "__main__":`` block
    runs (``X.cli()``), else its only ``BaseEnv`` subclass. The file is imported under its own
    module name with its folder first on ``sys.path``, as ``python ENV_FILE`` would have it."""
    from atroposlib.envs.base import BaseEnv

    env_file = env_file.resolve()
    folder = str(env_file.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    name = env_file.stem
    spec = importlib.util.spec_from_file_location(name, env_file)
    if spec is None or spec.loader is None:
        raise EvaluationError(f"cannot import {env_file}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    chosen = _main_block_class(env_file)
    if chosen is not None and isinstance(getattr(module, chosen, None), type):
        return getattr(module, chosen)
    own = [
        value
        for value in vars(module).values()
        if isinstance(value, type)
        and issubclass(value, BaseEnv)
        and value is not BaseEnv
        and value.__module__ == name
    ]
    if len(own) != 1:
        raise EvaluationError(
            f"{env_file.name}: cannot tell which environment to evaluate "
            f"({', '.join(c.__name__ for c in own) or 'no BaseEnv subclass'})"
        )
    return own[0]


def _main_block_class(env_file: Path) -> str | None:
    """``X`` of the ``X.cli()`` call under the file's ``if __name__ == "__main__":``."""
    try:
        tree = ast.parse(env_file.read_text())
    except (OSError, SyntaxError):
        return None
    for node in tree.body:
        if not isinstance(node, ast.If) or "__main__" not in ast.unparse(node.test):
            continue
        for sub in ast.walk(node):
            if (
                isinstance(sub, ast.Call)
                and isinstance(sub.func, ast.Attribute)
                and sub.func.attr == "cli"
                and isinstance(sub.func.value, ast.Name)
            ):
                return sub.func.value.id
    return None


@contextlib.contextmanager
def _output_to(path: Path) -> Iterator[None]:
    """The process's stdout and stderr (file descriptors 1 and 2, so child libraries' output
    too) appended to ``path`` for the block."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for handle in (fd, *saved):
            os.close(handle)


def worker_main(argv: Sequence[str]) -> int:
    """The worker process (see the module docstring); returns its exit code."""
    import asyncio

    from atroposlib.envs.cli import _dump_evaluate_config, build_env, resolve_config
    from atroposlib.envs.runtime import shutdown_env

    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # env output never mixes with the answers
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    env_file, flags = Path(argv[0]), list(argv[1:])
    env_cls = load_env_class(env_file)
    resolved = resolve_config(env_cls, ["evaluate", *flags])
    env = build_env(env_cls, resolved)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(env.setup())
    protocol.write(json.dumps({"ready": True}) + "\n")
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            out = Path(json.loads(line)["out_dir"])
            out.mkdir(parents=True, exist_ok=True)
            with _output_to(out / "evaluate.log"):
                try:
                    env.config.data_dir_to_save_evals = str(out)
                    _dump_evaluate_config(resolved, str(out))
                    env._evaluate_logged = False
                    started = time.time()
                    result = loop.run_until_complete(env.evaluate())
                    if isinstance(result, dict) and result and not env._evaluate_logged:
                        loop.run_until_complete(
                            env.evaluate_log(result, start_time=started, end_time=time.time())
                        )
                    reply: dict[str, Any] = {"ok": True}
                except Exception as exc:  # noqa: BLE001 - reported to the parent
                    traceback.print_exc()
                    reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            protocol.write(json.dumps(reply) + "\n")
    finally:
        loop.run_until_complete(shutdown_env(env))
        loop.close()
    return 0


class EvalWorker:
    """The parent's handle on one worker process: :meth:`evaluate` as many times as needed,
    then :meth:`close`. Started lazily by the first :meth:`evaluate` unless :meth:`start` was
    called (e.g. while the inference server loads)."""

    def __init__(
        self,
        env_file: Path,
        flags: Sequence[str],
        log: Path,
        *,
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.env_file, self.flags, self.log = env_file, list(flags), log
        self.cwd, self.env = cwd, env
        self.proc: subprocess.Popen[bytes] | None = None
        self._replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._ready = False
        self._busy = False

    def start(self) -> None:
        """Start the worker process (it imports the env and runs its ``setup()``)."""
        if self.proc is not None:
            return
        from example_trainer.inference_process import watch_process_group

        self.log.parent.mkdir(parents=True, exist_ok=True)
        # a new process (the first, or one after a worker died): its own answers and start-up
        self._replies, self._ready = queue.Queue(), False
        with open(self.log, "ab") as handle:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "example_trainer.eval_worker", str(self.env_file)]
                + self.flags,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=handle,
                cwd=self.cwd,
                env=self.env,
                start_new_session=True,
            )
        watch_process_group(self.proc.pid)  # stopped with us even if we are SIGKILLed
        threading.Thread(
            target=self._read, args=(self.proc.stdout, self._replies), daemon=True
        ).start()

    @staticmethod
    def _read(stream: IO[bytes] | None, replies: queue.Queue[dict[str, Any] | None]) -> None:
        assert stream is not None
        for line in stream:
            try:
                replies.put(json.loads(line))
            except ValueError:
                continue
        replies.put(None)  # the worker exited

    def _wait_reply(
        self, timeout: float, progress: Path | None, progress_every: float
    ) -> dict[str, Any]:
        from example_trainer.report import eval_progress

        started = last = time.monotonic()
        while True:
            try:
                reply = self._replies.get(timeout=0.5)
            except queue.Empty:
                now = time.monotonic()
                if now - started > timeout:
                    self.close()
                    raise EvaluationError(
                        f"{self.env_file.name} evaluation still running after {timeout:.0f} s "
                        f"(log: {progress or self.log})"
                    ) from None
                if progress is not None and progress_every and now - last >= progress_every:
                    last = now
                    logger.info(
                        "held-out evaluation: %s (%.0f s so far; log: %s)",
                        eval_progress(progress) or "starting",
                        now - started,
                        progress,
                    )
                continue
            if reply is None:
                code = self.proc.wait() if self.proc is not None else None
                self.proc = None
                tail = self.log.read_text(errors="replace")[-2000:] if self.log.is_file() else ""
                if progress is not None and progress.is_file():
                    tail += progress.read_text(errors="replace")[-2000:]
                raise EvaluationError(
                    f"{self.env_file.name} evaluation worker exited with {code}:\n{tail}"
                )
            return reply

    def evaluate(
        self, out_dir: Path, *, timeout: float = 1800.0, progress_every: float = 30.0
    ) -> dict[str, float]:
        """Evaluate into ``out_dir``; returns the numeric metrics of its ``metrics.json`` and
        ``eval_seconds`` (this call's wall time, the worker's start-up included the first
        time)."""
        from example_trainer.report import read_eval_metrics

        started = time.monotonic()
        out_dir.mkdir(parents=True, exist_ok=True)
        self.start()
        assert self.proc is not None and self.proc.stdin is not None
        if not self._ready:
            reply = self._wait_reply(timeout, None, 0)
            if not reply.get("ready"):
                raise EvaluationError(f"unexpected answer from the evaluation worker: {reply}")
            self._ready = True
        self._busy = True
        try:
            self.proc.stdin.write((json.dumps({"out_dir": str(out_dir)}) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self._wait_reply(timeout, out_dir / "evaluate.log", 0)  # raises with the log
        reply = self._wait_reply(timeout, out_dir / "evaluate.log", progress_every)
        self._busy = False
        if not reply.get("ok"):
            tail = (out_dir / "evaluate.log").read_text(errors="replace")[-2000:]
            raise EvaluationError(f"{self.env_file.name} evaluation failed: {reply}\n{tail}")
        metrics_file = out_dir / "metrics.json"
        if not metrics_file.is_file():
            raise EvaluationError(f"{self.env_file.name} evaluation wrote no {metrics_file}")
        metrics = read_eval_metrics(metrics_file)
        metrics["eval_seconds"] = time.monotonic() - started
        return metrics

    def close(self) -> None:
        """Stop the worker: between evaluations, end of input (it shuts the env down) and
        SIGKILL of its process group after 10 s; during one (interrupted, timed out), at once."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        from example_trainer.inference_process import unwatch_process_group

        with contextlib.suppress(OSError):
            if proc.stdin is not None:
                proc.stdin.close()
        if not self._busy:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._busy = False
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        unwatch_process_group(proc.pid)


if __name__ == "__main__":
    raise SystemExit(worker_main(sys.argv[1:]))
