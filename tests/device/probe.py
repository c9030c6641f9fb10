"""Probes answered on the device before changing timing and bf16 paths (results in NOTES.md).

1. Does torch's bf16 GEMM take out_dtype=float32 (mm, addmm)? What does it cost against
   bf16 output, and against the cast of x and W?
2. Small-kernel timing: events around each call with the L2 flushed, with and without the
   stream primed by a sleep kernel so that the host's launch cost is not in the interval.
3. mm against addmm (bias in the GEMM) at fp32.
"""
import statistics
import torch
import torch.nn.functional as F

dev = torch.device("cuda")
print(torch.cuda.get_device_name(), torch.__version__, torch.version.cuda)
flush = torch.empty(2 * 50 * 2**20 // 4, device=dev)

def bench(fn, reps=50, prime_ms=0.0, cyc_per_ms=None):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    ev = []
    if prime_ms:
        torch.cuda._sleep(int(prime_ms * cyc_per_ms))
    for _ in range(reps):
        flush.zero_()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); ev.append((s, e))
    torch.cuda.synchronize()
    t = sorted(s.elapsed_time(e) for s, e in ev)
    return statistics.median(t), t[len(t) // 5], t[4 * len(t) // 5]

# calibrate the sleep kernel
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
torch.cuda._sleep(1000); s.record(); torch.cuda._sleep(2_000_000); e.record(); torch.cuda.synchronize()
cyc = 2_000_000 / s.elapsed_time(e)
print(f"sleep calibration: {cyc:.3g} cycles/ms")

M, K, N = 1024, 8192, 8192
x = torch.rand(M, K, device=dev); w = torch.randn(N, K, device=dev) / 90; b = torch.randn(N, device=dev)
xb, wb = x.bfloat16(), w.bfloat16()
for name, fn in [
    ("fp32 mm", lambda: x @ w.t()),
    ("fp32 addmm", lambda: torch.addmm(b, x, w.t())),
    ("bf16 mm bf16-out (floor)", lambda: xb @ wb.t()),
    ("bf16 linear bf16-out +bias", lambda: F.linear(xb, wb, b.bfloat16())),
    ("cast x to bf16", lambda: x.bfloat16()),
    ("cast W to bf16", lambda: w.bfloat16()),
]:
    print(f"{name:32s} {bench(fn)}")
for name, fn in [
    ("bf16 mm out_dtype=fp32", lambda: torch.mm(xb, wb.t(), out_dtype=torch.float32)),
    ("bf16 addmm out_dtype=fp32", lambda: torch.addmm(b, xb, wb.t(), out_dtype=torch.float32)),
]:
    try:
        out = fn(); ref = (x.double() @ w.double().t() + (b.double() if 'addmm' in name else 0))
        print(f"{name:32s} {bench(fn)} dtype={out.dtype} relerr={((out.double()-ref).norm()/ref.norm()).item():.2e}")
    except Exception as exc:
        print(f"{name:32s} FAILED {type(exc).__name__}: {str(exc)[:200]}")
with torch.autocast("cuda", dtype=torch.bfloat16):
    print("autocast linear out dtype:", F.linear(x, w, b).dtype)

# small kernels: 51-like (2048 x 8192) simplified chain
X = torch.rand(2048, 8192, device=dev); v = torch.randn(8192, device=dev)
def small():
    g = F.gelu(X @ v + 0.1)
    return X + g[:, None]
copy_src = torch.empty(2048 * 8192 * 2, device=dev)
for name, fn in [("51-like chain", small), ("copy 134MB", copy_src.clone)]:
    print(f"{name:20s} unprimed {bench(fn, 200)}  primed {bench(fn, 200, prime_ms=60, cyc_per_ms=cyc)}")
