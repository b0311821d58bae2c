"""Honest throughput figures for a trainer: what was computed, against what the machine can do.

Three token counts describe one optimizer step, and they differ by large factors:

- **batch tokens**: every token of every sequence in the batch, prompts included (what a
  ``/batch`` reply holds). With groups of 16 sharing one prompt, most of it is the prompt
  counted 16 times; it is not work done.
- **computed tokens**: positions actually run through forward and backward (padding included,
  shared beginnings once). This is the work.
- **trained tokens**: positions whose log-probability enters the loss.

Model FLOPs use the usual estimate of 6 FLOPs per parameter per token for forward plus backward
(2 forward, 4 backward), applied to the transformer body (every parameter but the embeddings) at
each computed position, and to the output head only where it runs (trained positions, for a
trainer that computes logits there only; 4 for a frozen head, whose weights get no gradient).
Attention score FLOPs (a few percent at short contexts) are left out, so MFU is slightly
understated.

MFU is that FLOP rate divided by a *measured* peak: the best rate of large dense matrix
products on the same device, dtype and thread count (:func:`measure_gemm_peak`,
``bench/gemm_peak.py``), not a datasheet number. The measurement is cached per machine in
``~/.cache/atroposlib/gemm_peak.json``.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ModelFlops",
    "BF16_SPEEDUP_FOR_MIXED",
    "bf16_speedup",
    "gemm_peak",
    "measure_gemm_peak",
    "model_flops",
    "record_gemm_peak",
    "step_throughput",
]

CACHE_PATH = (
    Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    / "atroposlib"
    / ("gemm_peak.json")
)


@dataclass(frozen=True)
class ModelFlops:
    """Parameter counts that set the FLOPs of one training position."""

    body_params: int
    """Every parameter but the input embedding and the output head."""
    head_params: int
    """The output projection (vocabulary x hidden), tied to the embedding or not."""
    head_trained: bool = True
    """False when the head is frozen: its backward computes the gradient of its input only
    (4 FLOPs per parameter per token instead of 6)."""

    def training_flops(self, computed_tokens: int, head_tokens: int) -> float:
        """Forward + backward FLOPs: the body at ``computed_tokens`` positions, the head at
        ``head_tokens`` positions (all computed positions for a plain ``model(...).logits``)."""
        head = 6.0 if self.head_trained else 4.0
        return 6.0 * self.body_params * computed_tokens + head * self.head_params * head_tokens


def model_flops(model: Any) -> ModelFlops:
    """Parameter counts of a Hugging Face causal LM (``get_input_embeddings`` /
    ``get_output_embeddings``); a tied head counts once, as the head, and a frozen one
    (``requires_grad`` off) as not trained."""
    embedding = model.get_input_embeddings()
    head = model.get_output_embeddings()
    ids = set()
    for module in (embedding, head):
        if module is not None:
            ids.update(id(p) for p in module.parameters())
    body = sum(p.numel() for p in model.parameters() if id(p) not in ids)
    head_params = 0 if head is None else int(head.weight.numel())
    trained = head is None or bool(head.weight.requires_grad)
    return ModelFlops(body_params=int(body), head_params=head_params, head_trained=trained)


def _key(device: str, dtype: str, threads: int) -> str:
    cpu = platform.processor() or platform.machine()
    return f"{platform.node()}|{cpu}|{device}|{dtype}|threads={threads}"


def measure_gemm_peak(
    device: str = "cpu",
    dtype: str = "float32",
    threads: int | None = None,
    sizes: tuple[int, ...] | None = None,
    seconds: float = 0.5,
) -> dict[str, float]:
    """FLOP/s of square matrix products ``n x n @ n x n`` on ``device`` for each ``n``, each
    timed for about ``seconds`` after a warm-up; ``peak`` is the best. ``threads`` sets
    torch's CPU threads for the measurement (default: torch's current setting). ``sizes``
    default: 512-2048 on a CPU, 2048-8192 on a GPU (smaller products leave a GPU idle)."""
    import torch

    if sizes is None:
        sizes = (2048, 4096, 8192) if str(device).startswith("cuda") else (512, 1024, 2048)
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        torch_dtype = getattr(torch, dtype)
        rates: dict[str, float] = {}
        for n in sizes:
            a = torch.randn(n, n, device=device, dtype=torch_dtype)
            b = torch.randn(n, n, device=device, dtype=torch_dtype)
            for _ in range(2):
                a @ b
            _sync(device)
            count, started = 0, time.perf_counter()
            while True:
                a @ b
                count += 1
                if count % 4 == 0:
                    _sync(device)
                    if time.perf_counter() - started >= seconds:
                        break
            _sync(device)
            elapsed = time.perf_counter() - started
            rates[str(n)] = 2.0 * n**3 * count / elapsed
        rates["peak"] = max(rates.values())
        return rates
    finally:
        torch.set_num_threads(previous)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def record_gemm_peak(
    device: str,
    dtype: str,
    threads: int,
    rates: dict[str, float],
    cache_path: Path | None = None,
) -> None:
    """Cache ``rates`` (from :func:`measure_gemm_peak`) as this machine's peak for ``device``,
    ``dtype`` and ``threads``; a cache that cannot be written is left as it is."""
    import torch

    path = cache_path or CACHE_PATH
    cached = _read_cache(path)
    cached[_key(device, dtype, threads)] = {
        **rates,
        "measured_at": time.time(),
        "torch": torch.__version__,
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cached, indent=1))
    except OSError:
        pass


def gemm_peak(
    device: str = "cpu",
    dtype: str = "float32",
    threads: int | None = None,
    *,
    measure: bool = True,
    cache_path: Path | None = None,
) -> float | None:
    """The cached GEMM peak (FLOP/s) for this machine, device, dtype and thread count; when
    none is cached and ``measure``, measure it now (about 2 s) and cache it."""
    import torch

    threads = threads or torch.get_num_threads()
    path = cache_path or CACHE_PATH
    entry = _read_cache(path).get(_key(device, dtype, threads))
    if entry is not None:
        return float(entry["peak"])
    if not measure:
        return None
    rates = measure_gemm_peak(device, dtype, threads)
    record_gemm_peak(device, dtype, threads, rates, path)
    return rates["peak"]


#: ``auto`` precision trains in bf16-mixed where bfloat16 matrix products are at least this many
#: times faster than float32 ones (:func:`bf16_speedup`); below it, the casts autocast adds are
#: not paid back.
BF16_SPEEDUP_FOR_MIXED = 1.5


def bf16_speedup(
    device: str = "cpu", threads: int | None = None, *, cache_path: Path | None = None
) -> float:
    """How many times faster bfloat16 matrix products run than float32 ones on ``device`` at
    ``threads``: over 2 where the hardware has bfloat16 units (AVX-512 BF16 or AMX CPUs, GPUs),
    ~0.01 where a CPU emulates them. Measured once on a small product (512, or 4096 on a GPU;
    about a second, bounded even where bfloat16 is emulated) and cached per machine with the
    GEMM peaks."""
    import torch

    threads = threads or torch.get_num_threads()
    path = cache_path or CACHE_PATH
    key = _key(device, "bfloat16/float32", threads)
    entry = _read_cache(path).get(key)
    if entry is not None:
        return float(entry["peak"])
    size = 4096 if str(device).startswith("cuda") else 512
    rates = {
        dtype: measure_gemm_peak(device, dtype, threads, sizes=(size,), seconds=0.2)["peak"]
        for dtype in ("float32", "bfloat16")
    }
    ratio = rates["bfloat16"] / rates["float32"]
    record_gemm_peak(device, "bfloat16/float32", threads, {"peak": ratio, **rates}, path)
    return ratio


def step_throughput(
    *,
    seconds: float,
    batch_tokens: int,
    computed_tokens: int,
    trained_tokens: int,
    flops: ModelFlops | None = None,
    head_tokens: int | None = None,
    peak_flops: float | None = None,
) -> dict[str, float]:
    """The figures of one step: ``batch_tokens_per_s``, ``computed_tokens_per_s``,
    ``trained_tokens_per_s`` and, given the model's ``flops`` and a ``peak_flops``,
    ``model_flops_per_s`` and ``mfu``. ``head_tokens``: positions the output head ran at
    (default: ``trained_tokens``)."""
    seconds = max(seconds, 1e-9)
    out = {
        "batch_tokens_per_s": batch_tokens / seconds,
        "computed_tokens_per_s": computed_tokens / seconds,
        "trained_tokens_per_s": trained_tokens / seconds,
    }
    if flops is not None:
        rate = (
            flops.training_flops(
                computed_tokens, trained_tokens if head_tokens is None else head_tokens
            )
            / seconds
        )
        out["model_flops_per_s"] = rate
        if peak_flops:
            out["mfu"] = rate / peak_flops
    return out
