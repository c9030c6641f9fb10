"""Where the simplified 51 spends its time on the GPU (kernel time vs launch overhead)."""
import torch
import torch.nn.functional as F

from autofuse.core import registry
from autofuse.tuning.gate import CheckCase, build_case
from autofuse.tuning.timing import time_callable

prob = registry.get_problem("gemm_avgpool_gelu_residual")
shape = dict(prob.default_shapes[0])
model, x = build_case(prob, CheckCase(shape, "rand", 0, False), "cuda", torch.float32, "train")
variant = registry.get_variant(prob.name, "simplified")("fp32")
w = model.gemm.weight.mean(0); c = (model.gemm.bias - model.subtract).mean()

def raw():
    z = torch.addmv(c, x, w)
    return x + F.gelu(z)[:, None]

def raw_mm():
    z = x @ w
    return x + F.gelu(z + c)[:, None]

g = torch.cuda.CUDAGraph()
with torch.no_grad():
    variant(model, x)
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        raw()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        raw()
    for name, fn in [("variant", lambda: variant(model, x)), ("raw addmv", raw), ("raw mm", raw_mm),
                     ("graph", g.replay), ("copy x", lambda: x.clone())]:
        for flush in (True, False):
            t = time_callable(fn, "cuda", flush=flush)
            print(f"{name:10s} flush={flush}: {t.median_ms*1000:.1f} us  (p20 {t.p20_ms*1000:.1f}, p80 {t.p80_ms*1000:.1f})")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            variant(model, x)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8))
