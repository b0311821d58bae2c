"""Shared machinery of ``atropos-sft-gen`` and ``atropos-dpo-gen``.

Both tools stand in for a trainer: they reset the trajectory API, register with a batch size,
read batches with ``GET /batch`` and turn each scored group into JSONL lines. This module holds
what they share: the checks done before touching the server (output file, tokenizer), the
trainer session, splitting a sequence into prompt and completion, the per-group selection rules,
an output file whose every line is complete JSON (also after Ctrl-C), and the run loop.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

log = logging.getLogger("atroposlib.datagen")

DEFAULT_API_URL = "http://localhost:8000"
DEFAULT_TOKENIZER = "NousResearch/DeepHermes-3-Llama-3-8B-Preview"
#: Keys a chat message keeps in the TRL output (others, such as ``reward``, are env bookkeeping).
CHAT_KEYS = ("role", "content", "tool_calls", "tool_call_id", "name")
FORMATS = ("atropos", "trl")


class DatagenError(Exception):
    """A problem the user can fix (bad flag, unreachable server, file in the way)."""


# ----------------------------------------------------------------------------- checks


class JsonlOutput:
    """An output file that only ever holds complete JSON lines.

    Created (mode ``x``) unless ``append`` is set, so an existing file is never overwritten. Each
    line goes out in one unbuffered write and is fsync-free but flushed, so an interrupted run
    leaves every line that was counted complete.
    """

    def __init__(self, path: str | Path, append: bool) -> None:
        self.path = Path(path)
        if self.path.is_dir():
            raise DatagenError(f"output file {self.path} is a directory")
        if not self.path.parent.is_dir():
            raise DatagenError(f"output file {self.path}: folder {self.path.parent} does not exist")
        if self.path.exists() and not append:
            raise DatagenError(
                f"output file {self.path} already exists; pass --append-to-previous to add to "
                "it, or choose another path"
            )
        self.created = not self.path.exists()
        prefix = b""
        if append and self.path.exists() and self.path.stat().st_size > 0:
            prefix = self._repair_tail()
        self.lines_before = _count_lines(self.path) if append and self.path.exists() else 0
        flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_EXCL)
        try:
            self._fd: int | None = os.open(self.path, flags, 0o644)
        except OSError as exc:
            raise DatagenError(f"cannot open output file {self.path}: {exc.strerror}") from None
        self.written = 0
        if prefix:
            self._write_all(prefix)

    def _repair_tail(self) -> bytes:
        """A newline to add before appending when the file's last line lacks one (and is
        complete JSON); refuses a file whose last line is cut off."""
        with open(self.path, "rb") as f:
            f.seek(max(0, self.path.stat().st_size - 1_000_000))
            tail = f.read()
        if tail.endswith(b"\n"):
            return b""
        last = tail.rsplit(b"\n", 1)[-1]
        try:
            json.loads(last)
        except ValueError:
            raise DatagenError(
                f"output file {self.path} ends with an incomplete line; fix or remove that line "
                "before appending"
            ) from None
        return b"\n"

    def _write_all(self, data: bytes) -> None:
        assert self._fd is not None
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]

    def write(self, obj: Mapping[str, Any]) -> None:
        """Write one object as one line."""
        if self._fd is None:
            raise ValueError("output file is closed")
        self._write_all(json.dumps(obj, ensure_ascii=False).encode("utf-8") + b"\n")
        self.written += 1

    def close(self) -> None:
        """Close the file (idempotent). A file this run created and wrote nothing to is removed,
        so that a failed start leaves nothing in the way of the next try."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            if self.created and self.written == 0:
                self.path.unlink(missing_ok=True)


def _count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def load_tokenizer(name_or_path: str) -> Any:
    """A Hugging Face tokenizer from a local folder or a hub name, without network if possible.

    A local folder is loaded with ``local_files_only``. A hub name is first looked up in the local
    cache and only then downloaded (unless ``HF_HUB_OFFLINE=1``).
    """
    from transformers import AutoTokenizer

    path = Path(name_or_path).expanduser()
    if path.is_dir():
        try:
            return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - transformers raises many kinds
            raise DatagenError(f"--tokenizer {name_or_path}: cannot load it: {exc}") from None
    if path.exists():
        raise DatagenError(f"--tokenizer {name_or_path}: a file, expected a tokenizer folder")
    try:
        return AutoTokenizer.from_pretrained(name_or_path, local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached: try the hub below
        pass
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    if offline:
        raise DatagenError(
            f"--tokenizer {name_or_path}: not a local folder and not in the Hugging Face cache "
            "(HF_HUB_OFFLINE is set); pass the folder of the tokenizer your environment uses"
        )
    try:
        return AutoTokenizer.from_pretrained(name_or_path)
    except Exception as exc:  # noqa: BLE001
        raise DatagenError(
            f"--tokenizer {name_or_path}: cannot load it ({exc}); pass a local folder or a "
            "Hugging Face model name"
        ) from None


# ----------------------------------------------------------------------------- server


class TrainerSession:
    """Talks to the trajectory API the way a trainer does (sync httpx)."""

    def __init__(self, api_url: str, timeout: float = 30.0) -> None:
        self.api_url = api_url.rstrip("/")
        self._client = httpx.Client(base_url=self.api_url, timeout=timeout)

    def _get(self, path: str) -> httpx.Response:
        try:
            resp = self._client.get(path)
        except httpx.TransportError as exc:
            raise DatagenError(f"--api-url {self.api_url}: cannot reach the API ({exc})") from None
        if resp.status_code >= 400:
            raise DatagenError(f"GET {path} answered {resp.status_code}: {resp.text[:300]}")
        return resp

    def reset_and_register(self, batch_size: int, max_token_len: int, num_steps: int) -> int:
        """``GET /reset_data`` then ``POST /register``; returns the trainer uuid."""
        self._get("/reset_data")
        body = {
            "wandb_group": "test",
            "wandb_project": "test",
            "batch_size": batch_size,
            "max_token_len": max_token_len,
            "checkpoint_dir": "checkpoints",
            "save_checkpoint_interval": 10,
            "starting_step": 0,
            "num_steps": num_steps,
        }
        try:
            resp = self._client.post("/register", json=body)
        except httpx.TransportError as exc:
            raise DatagenError(f"--api-url {self.api_url}: cannot reach the API ({exc})") from None
        if resp.status_code >= 400:
            raise DatagenError(f"POST /register answered {resp.status_code}: {resp.text[:300]}")
        return int(resp.json()["uuid"])

    def try_batch(self) -> list[dict[str, Any]] | None:
        """One ``GET /batch``: the groups of the next batch, or None when none is ready."""
        data = self._get("/batch").json()
        if data.get("status") == "error":
            raise DatagenError(f"GET /batch: {data.get('message')}")
        return data.get("batch") or None

    def status(self) -> dict[str, Any]:
        """``GET /status``: ``{"current_step", "queue_size"}``."""
        return self._get("/status").json()

    def close(self) -> None:
        """Close the HTTP client."""
        self._client.close()


# ----------------------------------------------------------------------------- groups


def common_prefix(texts: Sequence[str]) -> str:
    """The longest common character prefix of ``texts`` (``""`` for none)."""
    return os.path.commonprefix(list(texts)) if texts else ""


def split_group(tokenizer: Any, group: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(prompt, completion)`` text for every sequence of a group.

    The boundary is the first trained token (first mask that is not -100): the completion is
    exactly what a trainer learns. A sequence trained from its first token or not at all falls
    back to upstream's rule, the group's longest common character prefix (which may be empty: then
    the prompt is ``""`` and the completion is the whole text).
    """
    tokens: list[list[int]] = group["tokens"]
    masks: list[list[int]] | None = group.get("masks")
    fulls = [tokenizer.decode(t) for t in tokens]
    shared = common_prefix(fulls) if len(fulls) > 1 else ""
    out = []
    for i, full in enumerate(fulls):
        boundary = None
        if masks is not None and i < len(masks):
            trained = [j for j, m in enumerate(masks[i]) if m != -100]
            if trained and trained[0] > 0:
                boundary = trained[0]
        if boundary is None:
            out.append((shared, full[len(shared) :]))
            continue
        prompt = tokenizer.decode(tokens[i][:boundary])
        if full.startswith(prompt):
            out.append((prompt, full[len(prompt) :]))
        else:
            out.append((prompt, tokenizer.decode(tokens[i][boundary:])))
    return out


def select_sft(
    scores: Sequence[float], top_n: int, allow_negative: bool, min_diff: float
) -> list[int]:
    """Indices of the sequences to keep from one group, best first (upstream's rules).

    Sort by score, highest first; unless ``allow_negative``, keep only scores **> 0** (zero is
    dropped too); when ``min_diff > 0`` keep only scores more than ``min_diff`` above the group's
    lowest; keep the first ``top_n``.
    """
    order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
    if not allow_negative:
        order = [i for i in order if scores[i] > 0]
    if min_diff > 0 and scores:
        low = min(scores)
        order = [i for i in order if scores[i] - low > min_diff]
    return order[:top_n]


def select_dpo_pairs(
    scores: Sequence[float],
    n_pairs: int,
    allow_negative: bool,
    min_diff: float,
    rng: random.Random,
) -> list[tuple[int, int]]:
    """``(chosen, rejected)`` index pairs from one group (upstream's rules).

    Chosen candidates are the sequences sorted high to low (only scores > 0 unless
    ``allow_negative``); the rejected pool is the ``n_pairs`` lowest-scoring sequences. For each
    of the first ``n_pairs`` chosen, a rejected one with ``score < chosen - min_diff`` is drawn at
    random and taken out of the pool; a chosen with no such partner is skipped. So every pair's
    chosen score exceeds its rejected score by more than ``min_diff``.
    """
    order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
    positives = order if allow_negative else [i for i in order if scores[i] > 0]
    pool = sorted(range(len(scores)), key=lambda i: scores[i])[:n_pairs]
    pairs = []
    for pos in positives[:n_pairs]:
        candidates = [j for j in pool if scores[pos] - scores[j] > min_diff]
        if not candidates:
            continue
        neg = rng.choice(candidates)
        pool.remove(neg)
        pairs.append((pos, neg))
    return pairs


def chat_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as TRL reads them: role, content and tool-call keys; nulls and env keys dropped."""
    return [{k: m[k] for k in CHAT_KEYS if m.get(k) is not None} for m in messages]


def group_messages(group: Mapping[str, Any], index: int) -> list[dict[str, Any]] | None:
    """The message list of sequence ``index``, or None when the group carries none."""
    messages = group.get("messages")
    if not messages or index >= len(messages) or not isinstance(messages[index], list):
        return None
    return messages[index]


# ----------------------------------------------------------------------------- CLI


def add_common_arguments(parser: argparse.ArgumentParser, min_diff_default: float) -> None:
    """The options both tools share (upstream's names and defaults)."""
    parser.add_argument(
        "filepath", help="JSONL file to write (refused if it exists, see --append-to-previous)."
    )
    parser.add_argument(
        "--api-url",
        default=DEFAULT_API_URL,
        help="Trajectory API (run-api) address. Its data is reset at start.",
    )
    parser.add_argument(
        "--group-size", type=int, default=2, help="Sequences per group the environments send."
    )
    parser.add_argument(
        "--max-token-len",
        type=int,
        default=2048,
        help="Longest sequence (tokens) accepted; registered with the API.",
    )
    parser.add_argument(
        "--tokenizer",
        default=DEFAULT_TOKENIZER,
        help="Tokenizer to decode tokens with: a local folder or a Hugging Face "
        "name (the cache is tried first, so it works offline once cached). Use "
        "the tokenizer of the model your environments sample from.",
    )
    parser.add_argument(
        "--save-messages",
        action="store_true",
        help="Write each sequence's message list instead of prefix/completion "
        "text (environments must send messages: include_messages).",
    )
    parser.add_argument(
        "--num-seqs-to-save", type=int, default=100, help="Stop after writing this many lines."
    )
    parser.add_argument(
        "--allow-negative-scores",
        action="store_true",
        help="Keep sequences of any score. Without it only scores > 0 are kept "
        "(a score of exactly 0 is dropped too).",
    )
    parser.add_argument(
        "--minimum-score-diff-max-min",
        type=float,
        default=min_diff_default,
        help="Minimum score margin (see each tool's description).",
    )
    parser.add_argument(
        "--append-to-previous",
        action="store_true",
        help="Append to FILEPATH if it exists instead of refusing to start.",
    )
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="atropos",
        help="atropos: upstream's line shapes; trl: shapes TRL trainers read "
        "directly (conversational when the groups carry messages).",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="Logging level.",
    )


def check_positive(
    parser: argparse.ArgumentParser, args: argparse.Namespace, names: Sequence[str]
) -> None:
    """Exit with a usage error naming the flag when one of ``names`` is below 1."""
    for name in names:
        if getattr(args, name) < 1:
            parser.error(
                f"--{name.replace('_', '-')} must be at least 1 (got {getattr(args, name)})"
            )
    if args.minimum_score_diff_max_min < 0 or math.isnan(args.minimum_score_diff_max_min):
        parser.error("--minimum-score-diff-max-min must be >= 0")


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
    session: TrainerSession, stop: StopFlag, poll_interval: float = 1.0
) -> Iterator[list[dict[str, Any]]]:
    """Batches from the API, polling every ``poll_interval`` seconds, until ``stop`` is set."""
    while not stop.event.is_set():
        batch = session.try_batch()
        if batch is None:
            stop.sleep(poll_interval)
            continue
        yield batch


def run(
    args: argparse.Namespace,
    *,
    batch_size: int,
    num_steps: int,
    lines_for_group: Callable[[Any, Mapping[str, Any]], list[dict[str, Any]]],
    prog: str,
) -> int:
    """Check, register, read batches and write lines until ``args.num_seqs_to_save`` are written.

    ``lines_for_group(tokenizer, group)`` turns one scored group into output lines. Returns the
    process exit code (0 done, 130 interrupted).
    """
    from tqdm import tqdm

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # one INFO line per /batch poll would drown the progress bar
    logging.getLogger("httpx").setLevel(max(logging.WARNING, log.getEffectiveLevel()))
    # Everything that can be refused is checked before the server is touched.
    output = JsonlOutput(args.filepath, append=args.append_to_previous)
    try:
        tokenizer = load_tokenizer(args.tokenizer)
        session = TrainerSession(args.api_url)
    except BaseException:
        output.close()
        raise
    steps_taken = 0
    warned = False
    target = args.num_seqs_to_save
    bar = tqdm(total=target, desc=prog, unit="line", file=sys.stderr, dynamic_ncols=True)
    interrupted = False
    try:
        with StopFlag() as stop:
            session.reset_and_register(batch_size, args.max_token_len, num_steps)
            log.info(
                "registered with %s: batch_size=%d num_steps=%d; waiting for batches",
                args.api_url,
                batch_size,
                num_steps,
            )
            for batch in wait_for_batch(session, stop):
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
    finally:
        bar.close()
        output.close()
        session.close()
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
