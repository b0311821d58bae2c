"""Process memory settings for long-running servers that load and drop large tensors.

glibc's ``malloc`` serves a block larger than its *mmap threshold* with its own ``mmap``, which
``free`` hands straight back to the system. The threshold starts at 128 KiB but rises to the
size of each such block freed (up to 32 MiB), so once a process has dropped one model, the next
model's weights are carved out of the heap instead, where freed memory is kept for reuse and
fragments. For ``atropos-serve``, which loads a new copy of the weights on every
``/reload_weights``, that made the resident size climb by hundreds of MB per reload (measured:
1.7 GB to 5.7 GB over 20 reloads of SmolLM2-135M in float32). Pinning the threshold keeps it
flat (2.3-2.4 GB over the same 20 reloads).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import sys
from collections.abc import Iterator

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # mallopt parameter numbers, from glibc's malloc.h
_M_MMAP_THRESHOLD = -3
_pinned_at: int | None = None

DEFAULT_MMAP_THRESHOLD = 1 << 20
"""Blocks of 1 MiB and more are mapped and unmapped on their own (weights, KV caches)."""


def pin_mmap_threshold(nbytes: int = DEFAULT_MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at ``nbytes`` (which also stops it adapting upwards).

    Returns True when it was set. Does nothing (False) off Linux/glibc, or when the user chose
    a value with the ``MALLOC_MMAP_THRESHOLD_`` environment variable, which glibc already
    applied.
    """
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    libc = _libc()
    if libc is None:
        return False
    ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, int(nbytes)))
    if not ok:
        logger.debug("mallopt(M_MMAP_THRESHOLD, %d) was refused", nbytes)
    global _pinned_at
    _pinned_at = int(nbytes) if ok else _pinned_at
    return ok


def _libc() -> ctypes.CDLL | None:
    """glibc with ``mallopt`` and ``malloc_trim`` typed; None off Linux or where the C library
    has no such functions (musl)."""
    name = ctypes.util.find_library("c") if sys.platform.startswith("linux") else None
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallopt.restype = ctypes.c_int
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.malloc_trim.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


#: glibc's largest mmap threshold on 64-bit systems (DEFAULT_MMAP_THRESHOLD_MAX).
_MAX_MMAP_THRESHOLD = 32 << 20


@contextlib.contextmanager
def heap_for_temporaries() -> Iterator[None]:
    """While inside, blocks up to 32 MiB come from the heap and freed ones stay there for reuse,
    even in a process whose threshold :func:`pin_mmap_threshold` pinned; on leaving, the pinned
    threshold is restored and the heap's free memory is handed back (``malloc_trim``).

    For work that allocates and frees many same-sized temporaries in a row (re-packing each
    layer's weights after a weight update): with the pinned threshold each of them is a fresh
    ``mmap`` whose every 4 KiB page faults on first touch (~260,000 faults, about half the time
    of re-packing SmolLM2-135M in float32); from the heap they reuse the same pages. Does
    nothing where the threshold was not pinned or there is no glibc.
    """
    libc = _libc() if _pinned_at is not None else None
    if libc is None:
        yield
        return
    libc.mallopt(_M_TRIM_THRESHOLD, _MAX_MMAP_THRESHOLD * 4)
    libc.mallopt(_M_MMAP_THRESHOLD, _MAX_MMAP_THRESHOLD)
    try:
        yield
    finally:
        libc.mallopt(_M_MMAP_THRESHOLD, int(_pinned_at or DEFAULT_MMAP_THRESHOLD))
        libc.mallopt(_M_TRIM_THRESHOLD, 128 << 10)  # glibc's default
        libc.malloc_trim(0)
