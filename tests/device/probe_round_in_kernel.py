"""Can a tf32 GEMM round x to TF32 inside the kernel, instead of the pass over x (round_host)?

    python3 tests/device/probe_round_in_kernel.py [--shapes 1024,8192,8192 16384,4096,4096]

The triton variants' tf32 mode multiplies x and W rounded to TF32 to nearest: W once (cached),
x by a pass per call, 6% of the GEMM at 1024×8192² (letting the tensor cores truncate x failed
the tf32 gate: truncation is biased). The first session found rounding x in registers gave wrong
sums; Triton's own tf32x3 rounds in registers with ``cvt.rna.tf32.f32`` and was right. This
probe asks again on a persistent TMA kernel (the variants' tuned tf32 configuration), with x's
tile rounded after its load three ways (ROUND): 0 none (x pre-rounded by the pass, or raw x left
to the tensor cores' truncation), 1 ``cvt.rna.tf32.f32`` by inline assembly, 2 the pass's own
bit arithmetic. Each result against the same kernel on pre-rounded x (bitwise: the products
are the same) and against float64; then every way timed interleaved beside the pass and cuBLAS.

Found (H100, logs 2026-11-24b-1): the bit arithmetic matched the pass bit for bit at both tiles;
cvt.rna was 2e-2 to 5e-2 off at 128×256 and exact at 128×128. The variants' own kernels then
showed that it is the TMA path, not the instruction, that goes wrong, and not on every run
(round_kernel_sweep.py). In-kernel rounding cost the loop 5.7% (1024×8192²) and 3.5% (16384×4096²)
where the pass cost 7.8% and 13%.
"""

import argparse
import json

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from autofuse.kernels.triton.gemm import round_tf32 as round_bits  # the variants' own, in bits
from autofuse.kernels.triton.gemm import tile_coords
from autofuse.kernels.triton.variant import input_operands, round_tf32
from autofuse.tuning import timing


@triton.jit
def round_rna(v):
    return tl.inline_asm_elementwise("cvt.rna.tf32.f32 $0, $1;", "=r,r", [v], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def gemm(x_desc, w_desc, c_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
         GROUP_M: tl.constexpr, ROUND: tl.constexpr):
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    for tile in range(tl.program_id(0), num_m * num_n, tl.num_programs(0)):
        pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kt in range(tl.cdiv(K, BLOCK_K)):
            a = x_desc.load([pid_m * BLOCK_M, kt * BLOCK_K])
            b = w_desc.load([pid_n * BLOCK_N, kt * BLOCK_K])
            if ROUND == 1:
                a = round_rna(a)
            elif ROUND == 2:
                a = round_bits(a)
            acc = tl.dot(a, b.T, acc, input_precision="tf32")
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        tl.store(c_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], acc, mask=mask)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


def probe(shape: str, config: dict, rounds: int) -> None:
    m, n, k = map(int, shape.split(","))
    bm, bn, bk = config["block_m"], config["block_n"], config["block_k"]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid = (min(sms, triton.cdiv(m, bm) * triton.cdiv(n, bn)),)
    torch.manual_seed(0)
    for dist in ("randn", "rand"):  # rand: KernelBench's positive inputs, where truncation's bias adds up
        x = torch.randn(m, k, device="cuda") if dist == "randn" else torch.rand(m, k, device="cuda")
        w = round_tf32(torch.randn(n, k, device="cuda") / k ** 0.5)
        xr = input_operands(x, "round_host")[0]
        exact_rounded = xr.double() @ w.double().t()  # what a tf32 product of rounded operands approximates
        exact = x.double() @ w.double().t()
        w_desc = TensorDescriptor.from_tensor(w, [bn, bk])
        outs, fns = {}, {}
        for name, src, rnd in (("pre-rounded", xr, 0), ("truncated", x, 0), ("cvt.rna", x, 1), ("bits", x, 2)):
            out = torch.full((m, n), float("nan"), device="cuda")
            x_desc = TensorDescriptor.from_tensor(src, [bm, bk])

            def run(x_desc=x_desc, out=out, rnd=rnd):
                return gemm[grid](x_desc, w_desc, out, m, n, k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                                  ROUND=rnd, num_stages=config["stages"], num_warps=config["warps"])
            try:
                compiled = run()
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - a probe records what fails and goes on
                print(json.dumps({"shape": shape, "way": name, "error": f"{type(e).__name__}: {e}"[:300]}), flush=True)
                continue
            outs[name], fns[name] = out, run
            print(json.dumps({"shape": shape, "dist": dist, "config": config, "way": name,
                              "shared": compiled.metadata.shared, "regs": getattr(compiled, "n_regs", None),
                              "spills": getattr(compiled, "n_spills", None),
                              "rel_err_vs_rounded_exact": rel(out, exact_rounded), "rel_err_vs_exact": rel(out, exact),
                              "max_diff_vs_pre_rounded": ((out - outs["pre-rounded"]).abs().max().item()
                                                          if "pre-rounded" in outs else None)}), flush=True)
        if dist != "randn" or not fns:
            continue
        fns_timed = {"pass + pre-rounded": lambda: (input_operands(x, "round_host"), fns["pre-rounded"]()),
                     "round pass alone": lambda: input_operands(x, "round_host"),
                     "cublas tf32": lambda: torch.mm(x, w.t())}
        fns_timed.update(fns)
        prev = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            times = timing.time_interleaved(fns_timed, "cuda", rounds=rounds)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = prev
        print(json.dumps({"shape": shape, "config": config, "ms": {
            name: [round(t.median_ms, 4), round(t.p20_ms, 4), round(t.p80_ms, 4)] for name, t in times.items()}}),
              flush=True)


def main():
    ap = argparse.ArgumentParser()
    # M,N,K with K a multiple of 4 (TMA's 16-byte rows); odd shapes are round_kernel_sweep.py's
    ap.add_argument("--shapes", nargs="+", default=["1024,8192,8192", "16384,4096,4096"])
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), "triton", triton.__version__, flush=True)
    configs = [{"block_m": 128, "block_n": 256, "block_k": 32, "stages": 3, "warps": 8},
               {"block_m": 128, "block_n": 128, "block_k": 32, "stages": 4, "warps": 8}]
    for shape in args.shapes:
        for config in configs:
            probe(shape, config, args.rounds)


if __name__ == "__main__":
    main()
