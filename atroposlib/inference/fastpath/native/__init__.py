"""Small C kernels for the engine's decode step, compiled on first use and loaded with ctypes.

The one kernel so far is single-token attention (:func:`attend`, :func:`decode_attention`;
``decode_attention.c``): each row's query heads against one or more segments of keys and
values, one softmax over all of them, a segment either the row's own or shared by several rows
(the grouped layout's prompt, once per request). PyTorch's CPU attention runs one flash-attention block per row and
key/value head; with the handful of query rows of a grouped-query decode step and a few
hundred cached keys, setting each block up costs more than its arithmetic. At 64 rows of
SmolLM2-135M (bfloat16, ~250 cached positions, 2 threads) that attention was a third of a decode
step (``bench/README.md``, "Decode attention in C").

The source is compiled with the system's C compiler (``$CC`` or ``cc``) for this CPU
(``-O3 -march=native -fopenmp``) into ``$XDG_CACHE_HOME/atroposlib/native`` (default
``~/.cache``), keyed by the source, the flags, the compiler's version and the CPU's feature
flags, so a cache shared between machines never hands one CPU another's build. Compiling takes
about a second; later starts load the cached build. The library is linked against the OpenMP
runtime PyTorch has already loaded (the same ``libgomp.so.1``), so its parallel loops run on
PyTorch's threads and honour ``torch.set_num_threads``.

Where no compiler is found, the build fails, or ``ATROPOS_NATIVE_KERNELS=0`` is set,
:func:`available` is False, the reason is logged once, and callers keep PyTorch's kernels.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "Segment",
    "attend",
    "available",
    "decode_attention",
    "supports",
    "unavailable_reason",
]

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("decode_attention.c")
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
_DISABLE = "ATROPOS_NATIVE_KERNELS"
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}

_reason: str | None = None


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "atroposlib" / "native"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(compiler: str) -> Path:
    """The compiled library for this source, compiler and CPU (built if not cached)."""
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(
        b"\0".join([source, " ".join(_FLAGS).encode(), version.encode(), _cpu_flags().encode()])
    ).hexdigest()[:16]
    target = _cache_dir() / f"decode_attention-{platform.machine()}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # built beside the target and renamed into place: processes starting together never
    # load a half-written file
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run(
            [compiler, *_FLAGS, "-o", str(built), str(_SOURCE), "-lm"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"{compiler} failed ({result.returncode}): {result.stderr.strip()[-2000:]}"
            )
        os.replace(built, target)
    logger.info("native kernels: built %s", target)
    return target


class _Segment(ctypes.Structure):
    # segment_t in decode_attention.c
    _fields_ = [
        ("keys", ctypes.c_void_p),
        ("values", ctypes.c_void_p),
        ("dtype", ctypes.c_int64),
        ("k_strides", ctypes.c_int64 * 4),
        ("v_strides", ctypes.c_int64 * 4),
        ("rowmap", ctypes.c_void_p),
        ("mask", ctypes.c_void_p),
        ("length", ctypes.c_int64),
    ]


@functools.cache
def _library() -> ctypes.CDLL | None:
    global _reason
    if os.environ.get(_DISABLE, "").strip().lower() in {"0", "false", "no", "off"}:
        _reason = f"{_DISABLE}={os.environ[_DISABLE]}"
        return None
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        _reason = f"no C compiler ({compiler!r} not found; set CC)"
        logger.info("native kernels: off, %s: PyTorch's attention is used", _reason)
        return None
    try:
        path = _build(compiler)
        # torch is imported first, so libgomp.so.1 resolves to the runtime it already loaded
        library = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        _reason = f"build or load failed: {exc}"
        logger.warning("native kernels: off, %s; PyTorch's attention is used", _reason)
        return None
    function = library.atropos_attend_segments
    function.restype = ctypes.c_int
    function.argtypes = [
        ctypes.c_void_p,  # query
        ctypes.c_int64,  # batch
        ctypes.c_int64,  # heads
        ctypes.c_int64,  # group
        ctypes.c_int64,  # dim
        ctypes.POINTER(_Segment),
        ctypes.c_int64,  # segments
        ctypes.c_void_p,  # out
        ctypes.c_void_p,  # lse
    ]
    return library


def available() -> bool:
    """Whether the native kernels are built and loaded (building them on the first call)."""
    return _library() is not None


def unavailable_reason() -> str | None:
    """Why :func:`available` is False (None when it is True or was not asked yet)."""
    _library()
    return _reason


def supports(dtype: torch.dtype, head_dim: int, group: int) -> tuple[bool, str]:
    """Whether :func:`decode_attention` takes CPU keys of ``dtype`` with heads of ``head_dim``
    and ``group`` query heads per key/value head: ``(True, "")`` or ``(False, why not)``."""
    if dtype not in _DTYPES:
        return False, f"{dtype} (the C kernel reads float32 and bfloat16)"
    if head_dim % 16 or not 16 <= head_dim <= 256 or not 1 <= group <= 16:
        return False, f"head size {head_dim}, {group} query heads per key/value head"
    if not available():
        return False, unavailable_reason() or "not built"
    return True, ""


@dataclass(frozen=True)
class Segment:
    """Keys and values rows attend to, for :func:`attend`.

    ``keys``/``values`` are ``(entries, kv_heads, length, dim)`` (float32 or bfloat16, any
    strides but a contiguous last dimension); ``mask`` ``(entries, length)`` is True (or 1)
    where a row attends (None: everywhere). Without ``rows`` entry ``i`` belongs to row
    ``i``; with ``rows`` ``(batch,)`` (int64) row ``b`` reads entry ``rows[b]``, so several
    rows can share one entry (a request's prompt, read by each of its samples)."""

    keys: torch.Tensor
    values: torch.Tensor
    mask: torch.Tensor | None = None
    rows: torch.Tensor | None = None


def attend(
    query: torch.Tensor, segments: list[Segment], scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``query`` ``(batch, kv_heads, group, dim)`` (the query heads sharing a
    key/value head, any float dtype, not yet scaled) over the keys of all ``segments`` in
    order, one softmax over them all.

    Returns the output ``(batch, kv_heads, group, dim)`` and the log-sum-exp of the scores
    ``(batch, kv_heads, group)``, both float32; a row with nothing to attend gets zeros and
    -inf. :func:`supports` says which dtypes and head shapes it takes."""
    library = _library()
    if library is None:
        raise RuntimeError(f"native kernels unavailable: {_reason}")
    batch, heads, group, dim = query.shape
    if not 1 <= len(segments) <= 4:
        raise ValueError(f"1 to 4 segments, not {len(segments)}")
    if scale == 1.0:
        q = query.to(torch.float32).contiguous()
    else:
        q = query.to(torch.float32, copy=True, memory_format=torch.contiguous_format).mul_(scale)
    keep = []  # what the C structures point into, alive until the call returns
    structs = (_Segment * len(segments))()
    for index, segment in enumerate(segments):
        keys, values = segment.keys, segment.values
        entries, length = keys.shape[0], keys.shape[2]
        if keys.dim() != 4 or keys.shape[1] != heads or keys.shape[3] != dim:
            raise ValueError(
                f"segment {index}: keys {tuple(keys.shape)} do not match the query "
                f"{tuple(query.shape)}"
            )
        if values.shape != keys.shape:
            raise ValueError(
                f"segment {index}: values {tuple(values.shape)} are not keys' {tuple(keys.shape)}"
            )
        if keys.dtype not in _DTYPES or values.dtype != keys.dtype:
            raise ValueError(
                f"segment {index}: keys and values must both be float32 or bfloat16, not "
                f"{keys.dtype} and {values.dtype}"
            )
        if keys.stride(-1) != 1 or values.stride(-1) != 1:
            keys, values = keys.contiguous(), values.contiguous()
        rows = segment.rows
        if rows is None:
            if entries != batch:
                raise ValueError(f"segment {index}: {entries} entries for {batch} rows")
        else:
            rows = rows.to(torch.int64).contiguous()
            if rows.shape != (batch,):
                raise ValueError(f"segment {index}: rows {tuple(rows.shape)} is not ({batch},)")
            if batch and (int(rows.min()) < 0 or int(rows.max()) >= entries):
                raise ValueError(f"segment {index}: rows must index its {entries} entries")
        mask = segment.mask
        if mask is not None:
            if mask.shape != (entries, length):
                raise ValueError(
                    f"segment {index}: mask {tuple(mask.shape)} is not (entries, length) "
                    f"{(entries, length)}"
                )
            mask = mask.to(torch.uint8).contiguous()  # no copy when it already is
        keep.extend((keys, values, rows, mask))
        struct = structs[index]
        struct.keys, struct.values = keys.data_ptr(), values.data_ptr()
        struct.dtype = _DTYPES[keys.dtype]
        struct.k_strides[:] = keys.stride()
        struct.v_strides[:] = values.stride()
        struct.rowmap = rows.data_ptr() if rows is not None else None
        struct.mask = mask.data_ptr() if mask is not None else None
        struct.length = length
    out = torch.empty((batch, heads, group, dim), dtype=torch.float32)
    lse = torch.empty((batch, heads, group), dtype=torch.float32)
    status = library.atropos_attend_segments(
        q.data_ptr(),
        batch,
        heads,
        group,
        dim,
        structs,
        len(segments),
        out.data_ptr(),
        lse.data_ptr(),
    )
    if status != 0:
        raise RuntimeError(f"native decode attention failed ({status})")
    return out, lse


def decode_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attend` over one segment: each row's own ``keys``/``values``
    ``(batch, kv_heads, length, dim)``, attending where ``mask`` ``(batch, length)`` is True
    (None: everywhere)."""
    return attend(query, [Segment(keys, values, mask)], scale)
