"""Does Triton 3.6 warp-specialize a bf16 GEMM on Hopper, and is it faster? A standalone probe.

    python3 tests/device/probe_warp_specialize.py [--shapes 1024,8192,8192 16384,4096,4096]

The compiler's sm_90 pipeline runs a Hopper warp-specialization pass on loops marked
``tl.range(..., warp_specialize=True)`` (``backends/nvidia/compiler.py``, ``add_hopper_warpspec``).
For a plain bf16 GEMM (host tensor descriptors for the operands, a pointer store, float32 accumulation, a float32 result, as the
triton variants' main loop) this compiles the persistent and the one-program-per-tile kernel
with and without the mark, reports whether the TTGIR holds a ``ttg.warp_specialize`` op and
how many warps the kernel really runs, checks the product against cuBLAS's and times each
interleaved (``autofuse.tuning.timing``, L2 flushed) beside cuBLAS on the same bf16 operands.
Prints one JSON line per configuration, then the fastest of each kind.
"""

import argparse
import itertools
import json
import re
import subprocess
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from autofuse.kernels.triton.gemm import tile_coords
from autofuse.tuning import timing


@triton.jit
def store_tile(c_ptr, acc, pid_m, pid_n, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(c_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], acc,
             mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def gemm_persistent(x_desc, w_desc, c_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, WS: tl.constexpr):
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_m * num_n, NUM_SMS, warp_specialize=WS):
        pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kt in range(k_tiles):
            a = x_desc.load([pid_m * BLOCK_M, kt * BLOCK_K])
            b = w_desc.load([pid_n * BLOCK_N, kt * BLOCK_K])
            acc = tl.dot(a, b.T, acc)
        store_tile(c_ptr, acc, pid_m, pid_n, M, N, BLOCK_M, BLOCK_N)


@triton.jit
def gemm_tiles(x_desc, w_desc, c_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, WS: tl.constexpr):
    pid_m, pid_n = tile_coords(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in tl.range(tl.cdiv(K, BLOCK_K), warp_specialize=WS):
        a = x_desc.load([pid_m * BLOCK_M, kt * BLOCK_K])
        b = w_desc.load([pid_n * BLOCK_N, kt * BLOCK_K])
        acc = tl.dot(a, b.T, acc)
    store_tile(c_ptr, acc, pid_m, pid_n, M, N, BLOCK_M, BLOCK_N)


def launcher(kernel, xb, wb, out, bm, bn, bk, stages, warps, ws):
    (m, k), n = xb.shape, wb.shape[0]
    sms = torch.cuda.get_device_properties(xb.device).multi_processor_count
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    grid = (min(sms, tiles),) if kernel is gemm_persistent else (tiles,)
    descs = (TensorDescriptor.from_tensor(xb, [bm, bk]), TensorDescriptor.from_tensor(wb, [bn, bk]), out)

    def run():
        return kernel[grid](*descs, m, n, k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, NUM_SMS=sms,
                            WS=ws, num_stages=stages, num_warps=warps)
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["1024,8192,8192", "16384,4096,4096"])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--isolate", action="store_true",
                    help="each warp-specialized configuration in a subprocess of its own: a crash there "
                         "(an illegal address poisons the CUDA context) does not end the probe")
    ap.add_argument("--only", help="(internal) the one configuration name to run, beside cuBLAS")
    args = ap.parse_args()
    if args.isolate:
        return isolate(args)
    print(torch.cuda.get_device_name(), "triton", triton.__version__, flush=True)
    for shape in args.shapes:
        m, n, k = map(int, shape.split(","))
        torch.manual_seed(0)
        xb = torch.randn(m, k, device="cuda").bfloat16()
        wb = torch.randn(n, k, device="cuda").bfloat16()
        ref = torch.mm(xb, wb.t(), out_dtype=torch.float32)
        fns = {"cublas": lambda: torch.mm(xb, wb.t(), out_dtype=torch.float32)}
        for kernel, (bm, bn), bk, stages, warps, ws in itertools.product(
                (gemm_persistent, gemm_tiles), ((128, 128), (128, 256)), (64,), (3, 4), (4, 8), (False, True)):
            if bn == 256 and warps == 4 and not ws:
                continue  # a 128x256 float32 accumulator in one warp group: 256 registers a thread
            name = f"{kernel.__name__} {bm}x{bn}x{bk} s{stages} w{warps} ws={ws}"
            if args.only and name != args.only:
                continue
            out = torch.empty(m, n, device="cuda")
            run = launcher(kernel, xb, wb, out, bm, bn, bk, stages, warps, ws)
            try:
                compiled = run()
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - a probe records what fails and goes on
                print(json.dumps({"shape": shape, "config": name, "error": f"{type(e).__name__}: {e}"[:300]}),
                      flush=True)
                continue
            ttgir = compiled.asm.get("ttgir", "")
            err = ((out - ref).norm() / ref.norm()).item()
            info = {"shape": shape, "config": name, "specialized": "ttg.warp_specialize" in ttgir,
                    "num_warps": compiled.metadata.num_warps, "shared": compiled.metadata.shared,
                    "total_warps": (re.findall(r'ttg.total-num-warps"? = (\d+)', ttgir) or [None])[0],
                    "rel_err": err}
            print(json.dumps(info), flush=True)
            if err < 1e-3:
                fns[name] = run
        times = timing.time_interleaved(fns, "cuda", rounds=args.rounds)
        ranked = sorted(times.items(), key=lambda kv: kv[1].median_ms)
        print(json.dumps({"shape": shape, "ms": {k: [round(t.median_ms, 4), round(t.p20_ms, 4), round(t.p80_ms, 4)]
                                                 for k, t in ranked}}), flush=True)


def isolate(args):
    for kernel, (bm, bn), stages in itertools.product(("gemm_persistent", "gemm_tiles"), ((128, 128), (128, 256)), (3, 4)):
        for shape in args.shapes:
            name = f"{kernel} {bm}x{bn}x64 s{stages} w4 ws=True"
            run = subprocess.run([sys.executable, __file__, "--shapes", shape, "--rounds", str(args.rounds),
                                  "--only", name], capture_output=True, text=True, timeout=120)
            lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
            print(json.dumps({"shape": shape, "config": name, "rc": run.returncode, "out": lines,
                              "stderr_tail": run.stderr[-300:] if run.returncode else ""}), flush=True)


if __name__ == "__main__":
    main()
