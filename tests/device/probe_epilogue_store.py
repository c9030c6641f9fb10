"""What does storing the output tile cost a persistent bf16 GEMM's epilogue, by pointers or by TMA?

    python3 tests/device/probe_epilogue_store.py [--shape 1024,8192,8192]

The triton variants store a (batch × out) matrix from their epilogue when the next step needs it:
22's softmax factors under grad (bfloat16), 99's GELU logits (float32), gemm_bn's z. A store by
pointers (``tl.store``) holds the program until it is issued, between its tile's main loop and
the next's; a tensor-descriptor store goes through shared memory and the copy engine. This times
one persistent kernel (the variants' tuned bf16 configuration: 128×256×64, 3 stages, 8 warps,
operands through descriptors) with each epilogue, interleaved (``autofuse.tuning.timing``), beside
cuBLAS: ``none`` (a row sum per tile: what a no-grad 22 stores), pointer stores of float32 and
bfloat16 tiles, and descriptor stores of bfloat16 (whole tile, or two halves) and float32 (four
quarters: a whole float32 tile does not fit beside the stages). Checks each stored matrix.
"""

import argparse
import json

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from autofuse.kernels.triton.gemm import tile_coords
from autofuse.tuning import timing

STORES = {"none": 0, "pointers f32": 1, "pointers bf16": 2, "tma bf16": 3, "tma bf16 halves": 4, "tma f32 quarters": 5}


@triton.jit
def gemm(x_desc, w_desc, c_ptr, c_desc, sums_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
         BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, STORE: tl.constexpr):
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    for tile in range(tl.program_id(0), num_m * num_n, tl.num_programs(0)):
        pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kt in range(tl.cdiv(K, BLOCK_K)):
            a = x_desc.load([pid_m * BLOCK_M, kt * BLOCK_K])
            b = w_desc.load([pid_n * BLOCK_N, kt * BLOCK_K])
            acc = tl.dot(a, b.T, acc)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        offsets = rows[:, None].to(tl.int64) * N + cols[None, :]
        if STORE == 0:
            tl.store(sums_ptr + rows * num_n + pid_n, tl.sum(acc, axis=1), mask=rows < M)
        elif STORE == 1:
            tl.store(c_ptr + offsets, acc, mask=mask)
        elif STORE == 2:
            tl.store(c_ptr + offsets, acc.to(tl.bfloat16), mask=mask)
        elif STORE == 3:
            c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(tl.bfloat16))
        elif STORE == 4:
            halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
            h0, h1 = tl.split(halves)
            c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], h0.to(tl.bfloat16))
            c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N + BLOCK_N // 2], h1.to(tl.bfloat16))
        else:
            halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
            h0, h1 = tl.split(halves)
            q0, q1 = tl.split(tl.permute(tl.reshape(h0, (BLOCK_M, 2, BLOCK_N // 4)), (0, 2, 1)))
            q2, q3 = tl.split(tl.permute(tl.reshape(h1, (BLOCK_M, 2, BLOCK_N // 4)), (0, 2, 1)))
            c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], q0)
            c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N + BLOCK_N // 4], q1)
            c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N + BLOCK_N // 2], q2)
            c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N + 3 * (BLOCK_N // 4)], q3)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="1024,8192,8192")
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    m, n, k = map(int, args.shape.split(","))
    bm, bn, bk = 128, 256, 64
    torch.manual_seed(0)
    xb, wb = torch.randn(m, k, device="cuda").bfloat16(), torch.randn(n, k, device="cuda").bfloat16()
    ref = torch.mm(xb, wb.t(), out_dtype=torch.float32)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid = (min(sms, triton.cdiv(m, bm) * triton.cdiv(n, bn)),)
    x_desc, w_desc = TensorDescriptor.from_tensor(xb, [bm, bk]), TensorDescriptor.from_tensor(wb, [bn, bk])
    sums = torch.empty(m, triton.cdiv(n, bn), device="cuda")
    print(torch.cuda.get_device_name(), "triton", triton.__version__, args.shape, flush=True)
    fns = {"cublas bf16 out": lambda: torch.mm(xb, wb.t()), "cublas f32 out": lambda: torch.mm(xb, wb.t(), out_dtype=torch.float32)}
    for name, store in STORES.items():
        f32 = store in (1, 5)
        out = torch.zeros(m, n, device="cuda", dtype=torch.float32 if f32 else torch.bfloat16)
        block = {3: [bm, bn], 4: [bm, bn // 2], 5: [bm, bn // 4]}.get(store, [bm, bn])
        c_desc = TensorDescriptor.from_tensor(out, block)

        def run(out=out, c_desc=c_desc, store=store):
            return gemm[grid](x_desc, w_desc, out, c_desc, sums, m, n, k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                              GROUP_M=8, STORE=store, num_stages=3, num_warps=8)
        try:
            compiled = run()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - a probe records what fails and goes on
            print(json.dumps({"store": name, "error": f"{type(e).__name__}: {e}"[:300]}), flush=True)
            continue
        err = None
        if store:
            err = ((out.float() - ref).norm() / ref.norm()).item()
        print(json.dumps({"store": name, "shared": compiled.metadata.shared, "rel_err": err}), flush=True)
        fns[name] = run
    times = timing.time_interleaved(fns, "cuda", rounds=args.rounds)
    print(json.dumps({"ms": {k: [round(t.median_ms, 4), round(t.p20_ms, 4), round(t.p80_ms, 4)]
                             for k, t in times.items()}}), flush=True)


if __name__ == "__main__":
    main()
