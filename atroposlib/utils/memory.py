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

import ctypes
import ctypes.util
import logging
import os
import sys

logger = logging.getLogger(__name__)

_M_MMAP_THRESHOLD = -3  # mallopt parameter number, from glibc's malloc.h

DEFAULT_MMAP_THRESHOLD = 1 << 20
"""Blocks of 1 MiB and more are mapped and unmapped on their own (weights, KV caches)."""


def pin_mmap_threshold(nbytes: int = DEFAULT_MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at ``nbytes`` (which also stops it adapting upwards).

    Returns True when it was set. Does nothing (False) off Linux/glibc, or when the user chose
    a value with the ``MALLOC_MMAP_THRESHOLD_`` environment variable, which glibc already
    applied.
    """
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other C libraries have no mallopt
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = bool(mallopt(_M_MMAP_THRESHOLD, int(nbytes)))
    if not ok:
        logger.debug("mallopt(M_MMAP_THRESHOLD, %d) was refused", nbytes)
    return ok
