"""Checkpoints: ``save_path/step_N`` folders that inference servers load and the trainer resumes.

A folder always holds the model (safetensors) and tokenizer as written by ``save_pretrained``,
so vLLM and ``atropos-serve`` load it directly. A resumable checkpoint also holds
``trainer_state.pt``: optimizer and scheduler state, the step, and the RNG state. Folders are
written under a temporary name and renamed, so a crash never leaves a half-written ``step_N``.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

TRAINER_STATE = "trainer_state.pt"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointSpaceError(OSError):
    """A checkpoint could not be written because its file system is full."""


_NEARLY_FULL = 1 << 20  # bytes: a failed write with less than this free failed for want of it


def _out_of_space(exc: BaseException, folder: Path, *, nearly_full: bool = True) -> bool:
    """Whether a write into ``folder`` failed with ``exc`` because the device is full: an
    ``OSError`` with ``ENOSPC``/``EDQUOT``, safetensors' Rust I/O error ("StorageFull"), or
    (``nearly_full``) any failure while (nearly) nothing is free there (torch.save says only
    "file write failed"). Call it before removing what the write left."""
    try:
        if nearly_full and shutil.disk_usage(folder).free < _NEARLY_FULL:
            return True
    except OSError:
        pass
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(seen)
        if "No space left on device" in text or "StorageFull" in text:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _space_error(what: str, path: Path, nbytes: int) -> CheckpointSpaceError:
    """The one-line explanation of a checkpoint part that did not fit on its disk."""
    existing = next(p for p in (path, *path.parents) if p.exists())  # a mount point counts
    free = shutil.disk_usage(existing).free
    return CheckpointSpaceError(
        errno.ENOSPC,
        f"no space left on the device for {what} {path} ({nbytes / 1e6:,.0f} MB; "
        f"{free / 1e6:,.0f} MB free there): free some space, or write checkpoints to another "
        "disk or less often (the trainer's --save-path, --checkpoint-interval, "
        "--keep-checkpoints; atropos-quickstart's --output, --trainer-arg checkpoint_interval=N)",
    )


def tensor_bytes(tensors: Any) -> int:
    """Bytes held by the tensors among ``tensors`` (anything else is skipped)."""
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


@contextmanager
def _writing(scratch: Path, what: str, target: Path, nbytes: Callable[[], int]) -> Iterator[None]:
    """Around a write into ``scratch`` (the temporary file or folder of ``target``): on any
    failure ``scratch`` is removed; a full disk becomes one :class:`CheckpointSpaceError`
    naming ``what``, ``target`` and its size ``nbytes()``."""
    try:
        yield
    except BaseException as exc:
        full = isinstance(exc, Exception) and _out_of_space(exc, scratch.parent)
        if scratch.is_dir():
            shutil.rmtree(scratch, ignore_errors=True)
        else:
            scratch.unlink(missing_ok=True)
        if full:
            raise _space_error(what, target, nbytes()) from exc
        raise


@contextmanager
def space_errors(folder: Path, what: str, nbytes: Callable[[], int]) -> Iterator[None]:
    """Around code that writes under ``folder`` through someone else's saving code (TRL's
    ``save_model``, the TRL integration's weight folder): a full disk becomes one
    :class:`CheckpointSpaceError` naming ``what``, ``folder`` and the size ``nbytes()``, instead
    of a library traceback; anything else passes through unchanged, even on a full disk (the
    block may do more than write)."""
    try:
        yield
    except Exception as exc:
        if _out_of_space(exc, Path(folder), nearly_full=False):
            raise _space_error(what, Path(folder), nbytes()) from exc
        raise


def step_dir(save_path: Path, step: int) -> Path:
    """``save_path/step_{step}``."""
    return save_path / f"step_{step}"


def save_checkpoint(path: Path, model: torch.nn.Module, tokenizer: Any, *, step: int) -> Path:
    """Write ``model`` + ``tokenizer`` to ``path`` (replacing an existing folder); returns it.

    This is what inference servers load. ``save_trainer_state`` adds what resuming needs.
    A full disk raises ``CheckpointSpaceError`` (an ``OSError``) saying so, with nothing
    half-written left behind.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{time.monotonic_ns()}")
    tmp.mkdir(parents=True)
    with _writing(tmp, "the checkpoint", path, lambda: tensor_bytes(model.parameters())):
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "atropos_step.json").write_text(json.dumps({"step": step}))
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
    return path


def save_trainer_state(
    path: Path,
    *,
    step: int,
    optimizer: torch.optim.Optimizer,
    scheduler: Any | None = None,
    config: dict[str, Any] | None = None,
) -> None:
    """Add ``trainer_state.pt`` (optimizer, scheduler, step, RNG) to checkpoint ``path``.

    Written to a temporary file and renamed, so the folder is either resumable or not, never
    half-written.
    """
    tmp = Path(path) / f".{TRAINER_STATE}.tmp"

    def state_bytes() -> int:
        return tensor_bytes(t for group in optimizer.state.values() for t in group.values())

    with _writing(tmp, "the optimizer state", Path(path) / TRAINER_STATE, state_bytes):
        torch.save(
            {
                "step": step,
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict() if scheduler is not None else None,
                "rng": torch.get_rng_state(),
                "config": config,
            },
            tmp,
        )
    os.replace(tmp, Path(path) / TRAINER_STATE)


def load_trainer_state(path: Path) -> dict[str, Any]:
    """The trainer state saved in checkpoint ``path``; a clear error if it has none."""
    state_file = Path(path) / TRAINER_STATE
    if not state_file.is_file():
        raise FileNotFoundError(
            f"--resume {path}: no {TRAINER_STATE} there (only checkpoints written with "
            "trainer state can be resumed; see --checkpoint-interval)"
        )
    return torch.load(state_file, map_location="cpu", weights_only=False)


def list_checkpoints(save_path: Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every ``step_N`` folder under ``save_path``, oldest first."""
    if not save_path.is_dir():
        return []
    found = []
    for child in save_path.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and child.is_dir():
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_resumable(save_path: Path) -> Path | None:
    """The newest ``step_N`` under ``save_path`` that has trainer state, if any."""
    for _, folder in reversed(list_checkpoints(save_path)):
        if (folder / TRAINER_STATE).is_file():
            return folder
    return None


def prune_checkpoints(save_path: Path, keep: int, protect: set[Path] | None = None) -> None:
    """Delete the oldest ``step_N`` folders beyond ``keep``, except those in ``protect``.

    The newest resumable checkpoint is always kept, so pruning never removes the only
    checkpoint a run could resume from.
    """
    protect = {p.resolve() for p in (protect or set())}
    newest_resumable = latest_resumable(save_path)
    if newest_resumable is not None:
        protect.add(newest_resumable.resolve())
    checkpoints = list_checkpoints(save_path)
    for _, folder in checkpoints[: max(0, len(checkpoints) - keep)]:
        if folder.resolve() not in protect:
            shutil.rmtree(folder, ignore_errors=True)
