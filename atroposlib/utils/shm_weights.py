"""Model weights handed between processes of one machine through shared memory.

The trainer writes its parameters into one file in ``/dev/shm`` (a tmpfs: RAM, never a disk)
laid out as a safetensors file (8-byte header length, JSON header of names, dtypes, shapes and
offsets, then the raw tensors), and tells ``atropos-serve`` its path
(``POST /load_weights_from_shm``). The server maps the file and copies each tensor straight
into its model's parameters: one copy on each side, no serialisation, no ``from_pretrained``.
The file is reused from one sync to the next (its pages stay allocated) and removed by
:meth:`SharedWeightsWriter.close`.

Tied parameters (an LM head sharing the input embeddings) are written once, under the first
name ``named_parameters()`` gives them; the reader's model ties them the same way.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import mmap
import os
import struct
import uuid
import warnings
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
"""Where segments are created (Linux's shared-memory tmpfs)."""

_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_NAMES = {v: k for k, v in _DTYPES.items()}
_ALIGN = 64


class SegmentSpaceError(OSError):
    """The segment does not fit into the shared-memory file system (``errno.ENOSPC``); writing
    it anyway would kill the writer with SIGBUS (a mapped tmpfs page that cannot be
    allocated), so it is refused before any byte is written."""


def free_bytes(directory: str | os.PathLike[str] = SHM_DIR) -> int:
    """Bytes an unprivileged process may still allocate in ``directory``'s file system."""
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize


def segment_bytes(
    tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None
) -> int:
    """Size of the segment :meth:`SharedWeightsWriter.write` lays out for the same arguments
    (header included)."""
    layout = [(name, _stored_dtype(t, dtype), tuple(t.shape)) for name, t in tensors]
    return _plan(layout)[2]


def space_message(needed: int, directory: str | os.PathLike[str] = SHM_DIR) -> str:
    """One line saying that ``needed`` bytes do not fit into ``directory`` and what to do."""
    return (
        f"the weights need {needed / 2**20:,.0f} MiB of shared memory but {directory} has "
        f"{free_bytes(directory) / 2**20:,.0f} MiB free (a container's default is 64 MiB): "
        "give it more (docker run --shm-size=2g; Kubernetes: an emptyDir with medium Memory "
        "mounted at /dev/shm) or sync through checkpoints on disk (the trainer's "
        "--weight-sync-transport disk; atropos-quickstart --trainer-arg "
        "weight_sync_transport=disk)"
    )


class SegmentError(ValueError):
    """The segment is missing, unreadable or not a weights segment."""


def unique_parameters(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of each parameter once (tied ones under their first name)."""
    return [(name, p.detach()) for name, p in model.named_parameters()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def reap_stale_segments(
    directory: str | os.PathLike[str] = SHM_DIR, prefix: str = "atropos"
) -> list[Path]:
    """Delete the segments of writers whose process is gone (killed before it could delete its
    own: a segment is a model's worth of RAM until the machine restarts); returns them.
    Segments are named ``PREFIX-weights-PID-RANDOM``; others are left alone."""
    reaped = []
    try:
        candidates = list(Path(directory).glob(f"{prefix}-weights-*-*"))
    except OSError:
        return reaped
    for path in candidates:
        pid = path.name[len(f"{prefix}-weights-") :].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or _pid_alive(int(pid)):
            continue
        try:
            path.unlink()
            reaped.append(path)
        except OSError:
            pass
    return reaped


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def _stored_dtype(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype


def _plan(
    layout: list[tuple[str, torch.dtype, tuple[int, ...]]],
) -> tuple[dict[str, Any], bytes, int]:
    """The segment's header (as a dict and as the padded bytes written) and its total size."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape in layout:
        if dtype not in _DTYPES:
            raise TypeError(f"{name}: dtype {dtype} cannot be written to a segment")
        size = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": _DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += -(-size // _ALIGN) * _ALIGN if size else 0
    raw = json.dumps(header).encode()
    # pad so that the data starts aligned (spaces are valid JSON padding)
    raw += b" " * (-(8 + len(raw)) % _ALIGN)
    return header, raw, 8 + len(raw) + offset


def _allocate(fd: int, total: int, path: Path) -> None:
    """Reserve the segment's pages now, so that a full tmpfs is an error here rather than a
    SIGBUS at the first write into the mapping. Where the file system cannot reserve
    (no ``fallocate``), its free space is checked instead."""
    try:
        os.posix_fallocate(fd, 0, total)
        return
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.ENOMEM):
            raise SegmentSpaceError(errno.ENOSPC, space_message(total, path.parent)) from exc
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
    if free_bytes(path.parent) < total - os.fstat(fd).st_blocks * 512:
        raise SegmentSpaceError(errno.ENOSPC, space_message(total, path.parent))


class SharedWeightsWriter:
    """Writes a model's parameters into a shared-memory segment, reused across writes.

    The segment is deleted by :meth:`close`, when the writer is garbage-collected and at
    interpreter exit; segments left by writers that were killed are deleted when the next
    writer on the machine starts (:func:`reap_stale_segments`).
    """

    def __init__(
        self, directory: str | os.PathLike[str] = SHM_DIR, prefix: str = "atropos"
    ) -> None:
        for path in reap_stale_segments(directory, prefix):
            logger.info("deleted %s, left by a process that no longer runs", path)
        self.path = Path(directory) / f"{prefix}-weights-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._map: mmap.mmap | None = None
        self._views: list[torch.Tensor] = []
        self._layout: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        self._finalizer = weakref.finalize(self, _unlink, self.path)

    def write(
        self, tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None
    ) -> Path:
        """Copy ``tensors`` (``(name, tensor)`` pairs) into the segment; returns its path.

        ``dtype``: floating-point tensors are stored converted to it (the dtype the reader
        serves in: a float32 trainer feeding a bfloat16 server writes half the bytes, and the
        reader copies without converting; the rounding is the same either side). None keeps
        each tensor's own dtype. The first write (or one whose names, shapes or dtypes
        changed) lays the file out; later writes only copy.
        """
        items = [(name, t.detach()) for name, t in tensors]
        layout = [(name, _stored_dtype(t, dtype), tuple(t.shape)) for name, t in items]
        if layout != self._layout or self._map is None:
            self._lay_out(layout)
            self._layout = layout
        with torch.no_grad():
            for view, (_, tensor) in zip(self._views, items, strict=True):
                view.copy_(tensor.reshape(view.shape))
        return self.path

    def _lay_out(self, layout: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:
        self._release()
        header, raw, total = _plan(layout)
        start = 8 + len(raw)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, total)
            _allocate(fd, total, self.path)
            self._map = mmap.mmap(fd, total)
        except SegmentSpaceError:
            _unlink(self.path)
            raise
        finally:
            os.close(fd)
        self._map[:8] = struct.pack("<Q", len(raw))
        self._map[8:start] = raw
        buffer = torch.frombuffer(self._map, dtype=torch.uint8)
        self._views = []
        for name, dtype, shape in layout:
            begin, end = header[name]["data_offsets"]  # type: ignore[index]
            self._views.append(buffer[start + begin : start + end].view(dtype).view(shape))

    def _release(self) -> None:
        self._views = []
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view still alive elsewhere: the mapping goes with it
                pass
            self._map = None

    def close(self) -> None:
        """Unmap and delete the segment."""
        self._release()
        self._layout = []
        self._finalizer()  # deletes the file, once


def read_segment(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The tensors of segment ``path``, as views of the mapped file (no copy). They stay valid
    while referenced (the mapping lives as long as they do)."""
    path = Path(path)
    mapped, key = _map(path)
    return _tensors(path, mapped, key[2])


class SegmentReader:
    """Reads segments like :func:`read_segment`, keeping the last file's mapping for the next
    read of the same file.

    A trainer rewrites one segment in place at every sync; mapping it afresh each time
    (``MAP_POPULATE``: one page-table entry per 4 KiB, 131,000 for a 538 MB model) took
    ~0.04 s of each sync. The mapping is reused while the path names the same file (device,
    inode and size); the header is parsed again at every read (the writer may have laid the
    file out anew at the same size). :meth:`release_if_gone` drops it once the file was
    deleted or replaced (the server calls it every few seconds), so a trainer's segment does
    not stay in memory after the trainer closed it or died.
    """

    def __init__(self) -> None:
        self._path: Path | None = None
        self._key: tuple[int, int, int] | None = None
        self._mapped: mmap.mmap | None = None

    def read(self, path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
        """The tensors of segment ``path`` (views of the mapping, valid while referenced)."""
        path = Path(path)
        key = _file_key(path)
        if self._mapped is None or key is None or key != self._key or path != self._path:
            self.release()
            self._mapped, self._key = _map(path)
            self._path = path
        assert self._mapped is not None and self._key is not None
        return _tensors(path, self._mapped, self._key[2])

    def release_if_gone(self) -> bool:
        """Drop the kept mapping when its file was deleted or replaced; whether it did."""
        if self._mapped is None or self._path is None:
            return False
        if _file_key(self._path) == self._key:
            return False
        self.release()
        return True

    def release(self) -> None:
        """Drop the kept mapping (it closes when the last tensor read from it is gone)."""
        self._path = self._key = self._mapped = None


def _file_key(path: Path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size)


def _map(path: Path) -> tuple[mmap.mmap, tuple[int, int, int]]:
    """``path`` mapped read-only, and its (device, inode, size)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise SegmentError(
            f"no shared-memory segment {path} on this host (the trainer must run on the same "
            "machine; otherwise sync through a checkpoint folder, POST /reload_weights)"
        ) from None
    except OSError as exc:
        raise SegmentError(f"cannot open segment {path}: {exc}") from exc
    try:
        st = os.fstat(fd)
        size = st.st_size
        if size < 8:
            raise SegmentError(f"{path} is not a weights segment ({size} bytes)")
        # MAP_POPULATE: the kernel maps every page now, in one call, instead of one page fault
        # per 4 KiB on first read (131,000 faults for a 538 MB model, taken by the copying
        # threads at once: most of a sync's time)
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mapped = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    return mapped, (st.st_dev, st.st_ino, size)


def _tensors(path: Path, mapped: mmap.mmap, size: int) -> dict[str, torch.Tensor]:
    (length,) = struct.unpack("<Q", mapped[:8])
    if 8 + length > size:
        raise SegmentError(f"{path} is not a weights segment (header past the end)")
    try:
        header = json.loads(mapped[8 : 8 + length])
    except ValueError as exc:
        raise SegmentError(f"{path} is not a weights segment (header: {exc})") from None
    start = 8 + length
    # a read-only mapping: torch warns that the buffer is not writable; the views are only read
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        data = torch.frombuffer(mapped, dtype=torch.uint8)
    tensors: dict[str, torch.Tensor] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _NAMES[entry["dtype"]]
            begin, end = entry["data_offsets"]
            shape = tuple(int(s) for s in entry["shape"])
        except (KeyError, TypeError, ValueError) as exc:
            raise SegmentError(f"{path}: bad entry for {name}: {exc}") from None
        if start + end > size or begin > end:
            raise SegmentError(f"{path}: {name} lies past the end of the segment")
        try:
            tensors[name] = data[start + begin : start + end].view(dtype).view(shape)
        except RuntimeError as exc:
            raise SegmentError(f"{path}: {name}: its bytes do not fit its shape: {exc}") from None
    return tensors
