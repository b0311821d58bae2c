"""The run loop of the data tools: stand in for a trainer, read batches, write lines.

Both tools reset the trajectory API, register with a batch size, read batches with
``GET /batch`` (:class:`atroposlib.api.client.TrainerClient`, acknowledging each) and turn every
scored group into JSONL lines until enough are written. Everything that can be refused (output
file, tokenizer) is checked before the server is touched; Ctrl-C stops between two lines.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from atroposlib.api.client import TrainerClient, TrajectoryAPIError
from atroposlib.datagen.options import DatagenError, DatagenOptions
from atroposlib.datagen.output import JsonlOutput
from atroposlib.datagen.tokenizer import load_tokenizer

log = logging.getLogger("atroposlib.datagen")


class StopFlag:
    """Set by the first Ctrl-C (SIGINT) or SIGTERM; the run loop stops between two lines.

    A second Ctrl-C while waiting for data raises KeyboardInterrupt; lines are never cut since
    the handler never raises while a line is being written.
    """

    def __init__(self) -> None:
        self.event = threading.Event()
        self.writing = False
        self._old: dict[int, Any] = {}

    def __enter__(self) -> StopFlag:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.event.is_set() and not self.writing and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.event.set()

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def sleep(self, seconds: float) -> None:
        """Sleep, waking early when stopped."""
        self.event.wait(seconds)


def wait_for_batch(
    client: TrainerClient, stop: StopFlag, poll_interval: float = 1.0
) -> Iterator[list[dict[str, Any]]]:
    """Batches from the API, polling every ``poll_interval`` seconds, until ``stop`` is set."""
    while not stop.event.is_set():
        batch = client.try_batch()
        if batch is None:
            stop.sleep(poll_interval)
            continue
        yield batch


def register(client: TrainerClient, batch_size: int, max_token_len: int, num_steps: int) -> int:
    """Reset the API (one try: a wrong address fails at once) and register as its trainer;
    the trainer uuid."""
    client.reset(timeout=0)
    return client.register(
        batch_size=batch_size,
        max_token_len=max_token_len,
        checkpoint_dir="checkpoints",
        save_checkpoint_interval=10,
        starting_step=0,
        num_steps=num_steps,
        wandb_group="test",
        wandb_project="test",
        timeout=10,
    )


def run(
    options: DatagenOptions,
    *,
    batch_size: int,
    num_steps: int,
    lines_for_group: Callable[[Any, Mapping[str, Any]], list[dict[str, Any]]],
    prog: str,
) -> int:
    """Check, register, read batches and write lines until ``options.num_seqs_to_save`` are
    written.

    ``lines_for_group(tokenizer, group)`` turns one scored group into output lines. Returns the
    process exit code (0 done, 130 interrupted).

    Raises:
        DatagenError: The output file, the tokenizer or the API is unusable.
    """
    from tqdm import tqdm

    logging.basicConfig(
        level=options.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # one INFO line per /batch poll would drown the progress bar
    logging.getLogger("httpx").setLevel(max(logging.WARNING, log.getEffectiveLevel()))
    # Everything that can be refused is checked before the server is touched.
    output = JsonlOutput(options.filepath, append=options.append_to_previous)
    try:
        tokenizer = load_tokenizer(options.tokenizer)
        client = TrainerClient(options.api_url)
    except BaseException:
        output.close()
        raise
    steps_taken = 0
    warned = False
    target = options.num_seqs_to_save
    bar = tqdm(total=target, desc=prog, unit="line", file=sys.stderr, dynamic_ncols=True)
    interrupted = False
    try:
        with StopFlag() as stop:
            register(client, batch_size, options.max_token_len, num_steps)
            log.info(
                "registered with %s: batch_size=%d num_steps=%d; waiting for batches",
                options.api_url,
                batch_size,
                num_steps,
            )
            for batch in wait_for_batch(client, stop):
                steps_taken += 1
                for group in batch:
                    for line in lines_for_group(tokenizer, group):
                        if output.written >= target or stop.event.is_set():
                            break
                        stop.writing = True
                        output.write(line)
                        stop.writing = False
                        bar.update(1)
                if output.written >= target:
                    break
                if steps_taken >= num_steps and not warned:
                    warned = True
                    log.warning(
                        "%d batches read (the num_steps announced to environments) but only "
                        "%d of %d lines written: the filters dropped more than expected, and "
                        "environments that stop after num_steps send nothing more. Still "
                        "waiting; Ctrl-C keeps what was written.",
                        steps_taken,
                        output.written,
                        target,
                    )
            interrupted = stop.event.is_set() and output.written < target
    except KeyboardInterrupt:
        interrupted = True
    except TrajectoryAPIError as exc:
        raise DatagenError(f"--api-url {options.api_url}: {exc}") from None
    finally:
        bar.close()
        output.close()
        client.close()
    verb = "interrupted" if interrupted else "done"
    print(
        f"{prog}: {verb}: wrote {output.written} lines to {output.path} "
        f"({steps_taken} batches read)",
        file=sys.stderr,
    )
    return 130 if interrupted else 0


def main_guard(fn: Callable[[], int]) -> None:
    """Run ``fn`` and exit with its code; a :class:`DatagenError` exits 1 with its message."""
    try:
        code = fn()
    except DatagenError as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = 1
    sys.exit(code)
