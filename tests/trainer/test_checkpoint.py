"""Checkpoints on a full disk: one clear error naming what to change, nothing half-written.

A full file system cannot be made without privileges, so the write fails the way the kernel
and safetensors report it (``OSError`` ENOSPC; safetensors' Rust ``StorageFull``); the model,
tokenizer and folders are real.
"""

from __future__ import annotations

import errno
import re
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from transformers import AutoTokenizer, LlamaForCausalLM

from example_trainer.checkpoint import (
    TRAINER_STATE,
    CheckpointSpaceError,
    save_checkpoint,
    save_trainer_state,
    step_dir,
)
from tests.conftest import private_mounts


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir: Path) -> tuple[LlamaForCausalLM, object]:
    """The suite's tiny random Llama (tests/conftest.py) with the real SmolLM2 tokenizer."""
    return (
        LlamaForCausalLM.from_pretrained(tiny_model_dir),
        AutoTokenizer.from_pretrained(tiny_model_dir),
    )


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_checkpoint_round_trip_writes_a_loadable_folder(model_and_tokenizer, tmp_path) -> None:
    model, tokenizer = model_and_tokenizer
    folder = save_checkpoint(step_dir(tmp_path, 2), model, tokenizer, step=2)
    assert folder == tmp_path / "step_2"
    again = LlamaForCausalLM.from_pretrained(folder)
    saved = again.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, saved[name]), name
    assert _leftovers(tmp_path) == []


def test_full_disk_while_writing_the_tokenizer(model_and_tokenizer, tmp_path, monkeypatch) -> None:
    model, tokenizer = model_and_tokenizer
    old = save_checkpoint(step_dir(tmp_path, 3), model, tokenizer, step=3)
    before = sorted(p.name for p in old.iterdir())

    def full(folder, *args, **kwargs):
        (Path(folder) / "tokenizer.json").write_text("{")  # a partial file, then the device fills
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tokenizer, "save_pretrained", full)
    with pytest.raises(CheckpointSpaceError) as caught:
        save_checkpoint(step_dir(tmp_path, 3), model, tokenizer, step=3)
    message = caught.value.strerror
    assert message.startswith("no space left on the device for the checkpoint ")
    assert str(tmp_path / "step_3") in message
    size_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6
    assert f"({size_mb:,.0f} MB;" in message
    for hint in ("--save-path", "--checkpoint-interval", "--keep-checkpoints", "--output"):
        assert hint in message
    assert caught.value.errno == errno.ENOSPC
    # nothing half-written; the previous folder of that step is untouched
    assert _leftovers(tmp_path) == []
    assert sorted(p.name for p in old.iterdir()) == before


def test_full_disk_as_safetensors_reports_it(model_and_tokenizer, tmp_path, monkeypatch) -> None:
    model, tokenizer = model_and_tokenizer

    def full(*args, **kwargs):
        raise SafetensorError(
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No '
            'space left on device" })'
        )

    monkeypatch.setattr(model, "save_pretrained", full)
    with pytest.raises(CheckpointSpaceError, match="no space left on the device"):
        save_checkpoint(tmp_path / "final_model", model, tokenizer, step=5)
    assert list(tmp_path.iterdir()) == []


def test_other_write_errors_pass_through(model_and_tokenizer, tmp_path, monkeypatch) -> None:
    model, tokenizer = model_and_tokenizer

    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(model, "save_pretrained", denied)
    with pytest.raises(PermissionError) as caught:
        save_checkpoint(tmp_path / "step_1", model, tokenizer, step=1)
    assert not isinstance(caught.value, CheckpointSpaceError)
    assert list(tmp_path.iterdir()) == []


def test_full_disk_while_writing_the_optimizer_state(
    model_and_tokenizer, tmp_path, monkeypatch
) -> None:
    model, tokenizer = model_and_tokenizer
    folder = save_checkpoint(step_dir(tmp_path, 4), model, tokenizer, step=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    optimizer.step()
    real_save = torch.save

    def full(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)  # the file exists, then the close fails
        raise RuntimeError(
            "[enforce fail at inline_container.cc:664] . unexpected pos 320 vs 256"
        ) from OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(CheckpointSpaceError) as caught:
        save_trainer_state(folder, step=4, optimizer=optimizer)
    assert "the optimizer state" in caught.value.strerror
    assert str(folder / TRAINER_STATE) in caught.value.strerror
    assert not (folder / TRAINER_STATE).exists()
    assert _leftovers(folder) == []


_FULL_TMPFS_SAVE = """
import sys
from transformers import AutoModelForCausalLM
from example_trainer.checkpoint import CheckpointSpaceError, space_errors

folder, model_dir = sys.argv[1], sys.argv[2]
model = AutoModelForCausalLM.from_pretrained(model_dir)
size = lambda: sum(p.numel() * p.element_size() for p in model.parameters())
try:
    with space_errors(folder, "the final model", size):
        model.save_pretrained(folder + "/final_model")
except CheckpointSpaceError as exc:
    print("space:", exc.errno, exc.strerror)
try:  # the disk is still full: an error that is not about it stays what it is
    with space_errors(folder, "the final model", size):
        raise ValueError("not about space")
except ValueError as exc:
    print("other:", exc)
"""


def test_space_errors_turns_a_real_full_tmpfs_into_one_line(tiny_model_dir, tmp_path) -> None:
    """What the TRL path wraps TRL's own saving in: safetensors writing into a file system
    that really is full (a 1 MiB tmpfs in a mount namespace)."""
    import subprocess
    import sys

    script = tmp_path / "save.py"
    script.write_text(_FULL_TMPFS_SAVE)
    small = tmp_path / "small"
    small.mkdir()
    result = subprocess.run(
        [
            *private_mounts(),
            "sh",
            "-c",
            'mount -t tmpfs -o size=1m tmpfs "$1" && shift && exec "$@"',
            "sh",
            str(small),
            sys.executable,
            str(script),
            str(small),
            str(tiny_model_dir),
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"space: {errno.ENOSPC} no space left on the device for the final model" in result.stdout
    # the free space of the full file system, not of the one above its mount point
    assert re.search(r"\(26 MB; [01] MB free there\)", result.stdout), result.stdout
    assert "--save-path" in result.stdout
    assert "other: not about space" in result.stdout
