"""Can gemm_bn's training statistics read z from L2 instead of HBM, by running the GEMM in row chunks?

    python3 tests/device/probe_l2_stats.py [--shape 16384,4096,4096] [--precision tf32]

cublas_epilogue's two-kernel path (and torch.compile) write z = x·Wᵀ from cuBLAS, read it back
for the column statistics, then read it again and write the output: at 16384×4096 each pass over
z is 256 MB from HBM. An H100 has 50 MB of L2. If the GEMM runs in chunks of rows and each
chunk's statistics are taken right after it, while the chunk is (mostly) still in L2, the
statistics' read leaves HBM. This times, interleaved (L2 flushed before each call): the GEMM
alone; the GEMM then torch.var_mean over z (one HBM read); and the chunked version at several
chunk heights (per-chunk var_mean, merged on the host side of the arithmetic, not timed
separately). torch's reduction stands in for the variant's own statistics kernel.

Found (H100, log 2026-11-24b-6): chunked lost at every height (16384×4096² tf32: GEMM + one pass
1.50 ms, chunks of 2048 rows 1.76), but torch's column reduction over a short chunk is slow in
itself, so this does not isolate L2 residency; the variant's own kernel per chunk would.
"""

import argparse
import json

import torch

from autofuse.core.precision import math_mode
from autofuse.tuning import timing


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="16384,4096,4096")
    ap.add_argument("--precision", default="tf32")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    m, k, n = map(int, args.shape.split(","))
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda").to(dtype)
    w = torch.randn(n, k, device="cuda").to(dtype)
    z = torch.empty(m, n, device="cuda", dtype=dtype)

    def gemm():
        torch.mm(x, w.t(), out=z)

    def gemm_then_stats():
        torch.mm(x, w.t(), out=z)
        return torch.var_mean(z, dim=0)

    def chunked(rows):
        def run():
            out = []
            for r in range(0, m, rows):
                torch.mm(x[r:r + rows], w.t(), out=z[r:r + rows])
                out.append(torch.var_mean(z[r:r + rows], dim=0))
            return out
        return run

    def stats_alone():
        return torch.var_mean(z, dim=0)

    fns = {"gemm": gemm, "stats alone (HBM)": stats_alone, "gemm + stats": gemm_then_stats}
    for rows in (512, 1024, 2048, 4096):
        if rows < m:
            fns[f"chunks of {rows}"] = chunked(rows)
    with math_mode(args.precision):
        times = timing.time_interleaved(fns, "cuda", rounds=args.rounds)
    print(json.dumps({"device": torch.cuda.get_device_name(), "shape": args.shape, "precision": args.precision,
                      "ms": {k: [round(t.median_ms, 4), round(t.p20_ms, 4), round(t.p80_ms, 4)]
                             for k, t in times.items()}}), flush=True)


if __name__ == "__main__":
    main()
