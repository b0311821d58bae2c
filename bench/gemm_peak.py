"""The machine's dense matrix-product peak: what the trainer's ``mfu`` is a fraction of.

Times ``n x n @ n x n`` products (n = 512, 1024, 2048) for each dtype and thread count asked,
prints GFLOP/s per size and the best, and caches the best per machine, device, dtype and thread
count in ``~/.cache/atroposlib/gemm_peak.json``, where the trainer reads it (it measures on its
own at start when nothing is cached).

    python bench/gemm_peak.py                       # float32, torch's thread count
    python bench/gemm_peak.py --dtype float32 bfloat16 --threads 1 2 --sizes 256 512

On a CPU without bf16 instructions (this project's 2-core AMD EPYC reports AVX2 only, no
AVX-512) torch emulates bfloat16 products at ~1 GFLOP/s: keep --sizes small for it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    import torch

    from atroposlib.trainer.throughput import CACHE_PATH, measure_gemm_peak, record_gemm_peak

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", nargs="+", default=["float32"])
    parser.add_argument("--threads", nargs="+", type=int, default=[torch.get_num_threads()])
    parser.add_argument("--sizes", nargs="+", type=int, default=[512, 1024, 2048])
    parser.add_argument("--seconds", type=float, default=1.0, help="time per size")
    parser.add_argument("--no-cache", action="store_true", help="do not write the cache")
    args = parser.parse_args()

    columns = "".join(f" {'n=' + str(n):>9s}" for n in args.sizes)
    print(f"{'dtype':9s} {'threads':>7s}{columns} {'peak':>9s}")
    for dtype in args.dtype:
        for threads in args.threads:
            rates = measure_gemm_peak(
                args.device, dtype, threads, sizes=tuple(args.sizes), seconds=args.seconds
            )
            cells = " ".join(f"{rates[str(n)] / 1e9:9.1f}" for n in args.sizes)
            print(f"{dtype:9s} {threads:7d} {cells} {rates['peak'] / 1e9:9.1f}  GFLOP/s")
            if not args.no_cache:
                record_gemm_peak(args.device, dtype, threads, rates)
    if not args.no_cache:
        print(f"cached in {CACHE_PATH}")


if __name__ == "__main__":
    main()
