"""An output file whose every line is complete JSON, also after Ctrl-C."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from atroposlib.datagen.options import DatagenError


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
