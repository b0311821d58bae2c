"""Process memory settings for long-running servers that load and drop large tensors.

glibc's ``malloc`` serves a block larger than its *mmap threshold* with its own ``mmap``, which
``free`` hands straight back to the system. The threshold starts at 128 KiB but rises to the
size of each such block freed (up to 32 MiB), so once a process has dropped one model, the next
model's weights are carved out of the heap instead, where freed memory is kept for reuse and
fragments. For ``atropos-serve``, which loads a new copy of the weights on every
``/reload_weights``, that made the resident size climb by hundreds of MB per reload (measured:
1.7 GB to 5.7 GB over 20 reloads of SmolLM2-135M in float32). Pinning the threshold keeps it
flat (2.3-2.4 GB over the same 20 reloads).

Pinned, though, every temporary of 1 MiB or more (a decode step's logits, sampling buffers, a
growing key/value cache) is a fresh mapping too, faulted in page by page at every step. So a
server pins the threshold for loading, then calls :func:`use_heap_for_temporaries` once its
weights are in: temporaries come from the heap, and weights loaded or packed later go inside
:func:`mapped_allocations`, which applies the pinned threshold again while they are allocated.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import logging
import os
import sys
import threading
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


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """glibc with ``mallopt`` and ``malloc_trim`` typed; None off Linux or where the C library
    has no such functions (musl). Looked up once (``find_library`` runs ``ldconfig``)."""
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
#: Free memory at the top of the heap beyond this goes back to the system (glibc's default is
#: 128 KiB, which would hand back and fault in a decode step's temporaries every step).
_HEAP_TRIM_THRESHOLD = 4 * _MAX_MMAP_THRESHOLD

_state_lock = threading.RLock()
_heap_mode = False  # use_heap_for_temporaries() was called
_heap_depth = 0  # inside heap_for_temporaries()
_mapped_depth = 0  # inside mapped_allocations()


def _apply_locked() -> None:
    """Set the threshold the current state asks for (caller holds ``_state_lock``)."""
    libc = _libc() if _pinned_at is not None else None
    if libc is None:
        return
    heap = (_heap_mode or _heap_depth > 0) and _mapped_depth == 0
    if heap:
        libc.mallopt(_M_TRIM_THRESHOLD, _HEAP_TRIM_THRESHOLD)
        libc.mallopt(_M_MMAP_THRESHOLD, _MAX_MMAP_THRESHOLD)
    else:
        libc.mallopt(_M_MMAP_THRESHOLD, int(_pinned_at or DEFAULT_MMAP_THRESHOLD))
        libc.mallopt(_M_TRIM_THRESHOLD, 128 << 10)  # glibc's default


def use_heap_for_temporaries() -> bool:
    """From now on, blocks up to 32 MiB come from the heap and freed ones stay there for reuse,
    except inside :func:`mapped_allocations` (where a process that :func:`pin_mmap_threshold`
    pinned loads and packs its weights). Returns False (and does nothing) where the threshold
    was not pinned or there is no glibc.

    For a server whose every generation step allocates and frees the same temporaries
    (logits, sampling buffers, a growing key/value cache): with the pinned 1 MiB threshold each
    of them is a fresh ``mmap`` whose every 4 KiB page faults on first touch. Measured on the
    arithmetic recipe's load (32 groups of 16 samples, SmolLM2-135M in float32, 2 cores):
    13.5 s pinned, 7.6 s with the temporaries from the heap. Call :func:`release_free_memory`
    when idle to hand the heap's free pages back.
    """
    global _heap_mode
    if _pinned_at is None or _libc() is None:
        return False
    with _state_lock:
        _heap_mode = True
        _apply_locked()
    return True


@contextlib.contextmanager
def mapped_allocations() -> Iterator[None]:
    """While inside (from any thread), blocks of the pinned threshold and more are mapped on
    their own, as :func:`pin_mmap_threshold` set, even after :func:`use_heap_for_temporaries`:
    for memory that outlives the work (a model's weights, their packed copies), so that when it
    is freed it goes straight back to the system instead of fragmenting the heap. Nests;
    does nothing where the threshold was not pinned."""
    global _mapped_depth
    with _state_lock:
        _mapped_depth += 1
        _apply_locked()
        if _mapped_depth == 1 and _heap_mode:
            # free heap space (earlier temporaries) would otherwise serve these blocks
            release_free_memory()
    try:
        yield
    finally:
        with _state_lock:
            _mapped_depth -= 1
            _apply_locked()


@contextlib.contextmanager
def heap_for_temporaries() -> Iterator[None]:
    """While inside, blocks up to 32 MiB come from the heap and freed ones stay there for reuse,
    even in a process whose threshold :func:`pin_mmap_threshold` pinned; on leaving, the
    process's own setting is restored and the heap's free memory is handed back
    (``malloc_trim``), unless the process is in :func:`use_heap_for_temporaries` mode, whose
    next steps reuse those pages.

    For work that allocates and frees many same-sized temporaries in a row (re-packing each
    layer's weights after a weight update): with the pinned threshold each of them is a fresh
    ``mmap`` whose every 4 KiB page faults on first touch (~260,000 faults, about half the time
    of re-packing SmolLM2-135M in float32); from the heap they reuse the same pages. Does
    nothing where the threshold was not pinned or there is no glibc.
    """
    global _heap_depth
    libc = _libc() if _pinned_at is not None else None
    if libc is None:
        yield
        return
    with _state_lock:
        _heap_depth += 1
        _apply_locked()
    try:
        yield
    finally:
        with _state_lock:
            _heap_depth -= 1
            _apply_locked()
            trim = not _heap_mode  # a process in heap mode reuses those pages next step
        if trim:
            release_free_memory()


def release_free_memory() -> bool:
    """Hand the heap's free pages back to the system (``malloc_trim(0)``); False where there
    is no glibc. Cheap enough for an idle moment (a few milliseconds), not for every step."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
