"""Where the host's time goes in one call of a tuned variant (issue 13: grad mode vs no_grad).

    python3 benchmarks/gpu/launch_overhead.py --table benchmarks/table.json [--precision fp32] [--json out.json]

For each GEMM-bound problem at its default shape, the module from ``get_module`` with the table's
entry, and each piece of its call timed on the host alone: ``--calls`` calls in a row with no
synchronize between them (the GPU is slower, so this is the launch cost, not the kernels'),
rounds interleaved, median and p20-p80 µs per call. Pieces: the module under no_grad and with
grad (FusedFunction, logits stored), the variant called directly, and every Triton launch the call
makes, replayed: through ``JITFunction`` (``kernel[grid](...)``), through autofuse's ``Launcher``
(what the variants do: the kept ``CompiledKernel`` under its own key), through that
``CompiledKernel`` alone, and its TMA descriptors built alone. Every launch of a CUDA variant (``CudaVariant.launch``), replayed
as the variant makes it and as a bare ctypes call; beside them torch's pieces of any call: the
current stream as a ``Stream`` object and as a raw handle, ``empty_like`` of the input, and the
variant's cached folded weights where it keeps them (51).

    python3 benchmarks/gpu/launch_overhead.py --problems gemm_avgpool_gelu_residual   # 51: CUDA launches
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import triton
from triton.runtime.jit import JITFunction

import autofuse
from autofuse.kernels import build
from autofuse.core import registry
from autofuse.kernels.cuda_variant import CudaVariant
from autofuse.kernels.triton.launch import Launcher

PROBLEMS = ("matmul_clamp_lse_mish", "matmul_gelu_softmax", "gemm_bn", "gemm_avgpool_gelu_residual")


def host_us(fn, calls: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def record_launches(fn) -> list[tuple]:
    """Every (JITFunction, args, kwargs, grid, Launcher or None) that ``fn()`` launches, whether
    through autofuse's ``Launcher`` or a ``JITFunction`` directly."""
    launches, original_jit, original_launcher = [], JITFunction.run, Launcher.run
    inside = []

    def spy_launcher(self, grid, args, kwargs):
        launches.append((self.fn, args, dict(kwargs), grid, self))
        inside.append(True)
        try:
            return original_launcher(self, grid, args, kwargs)
        finally:
            inside.pop()

    def spy_jit(self, *args, grid, warmup, **kwargs):
        if not inside:
            launches.append((self, args, dict(kwargs), grid, None))
        return original_jit(self, *args, grid=grid, warmup=warmup, **kwargs)

    JITFunction.run, Launcher.run = spy_jit, spy_launcher
    try:
        fn()
    finally:
        JITFunction.run, Launcher.run = original_jit, original_launcher
    torch.cuda.synchronize()
    return launches


def record_cuda_launches(fn) -> list[tuple]:
    """Every (variant, launcher name, args, device) that ``fn()`` launches through ``CudaVariant.launch``."""
    launches, original = [], CudaVariant.launch

    def spy(self, name, *args, device):
        launches.append((self, name, args, device))
        return original(self, name, *args, device=device)

    CudaVariant.launch = spy
    try:
        fn()
    finally:
        CudaVariant.launch = original
    torch.cuda.synchronize()
    return launches


def cuda_replays(launch) -> dict:
    """``launch`` again through ``CudaVariant.launch``, and as the bare ctypes call it makes."""
    variant, name, args, device = launch
    function = getattr(variant.library(device), name)
    converted = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]
    stream = build.stream_handle(device)
    return {"CudaVariant.launch": lambda: variant.launch(name, *args, device=device),
            "ctypes alone": lambda: function(*converted, stream)}


def replays(launch) -> dict:
    """Ways to make ``launch`` again, callables by name: through ``JITFunction``, through autofuse's
    ``Launcher`` (what the variants do), through the ``CompiledKernel`` alone, and its descriptors."""
    jit, args, kwargs, grid, launcher = launch
    compiled = jit[grid](*args, **kwargs)
    device = torch.cuda.current_device()
    binder = jit.device_caches[device][4]
    bound, _, _ = binder(*args, **kwargs)
    values = tuple(bound.values())
    stream = torch.cuda.current_stream().cuda_stream
    g = tuple(grid) + (1,) * (3 - len(grid))

    def direct():
        compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata, None, None, None, *values)

    descs = [(k, v) for k, v in kwargs.items() if type(v).__name__ == "TensorDescriptor"]

    def rebuild_descriptors():
        from triton.tools.tensor_descriptor import TensorDescriptor

        for _, d in descs:
            TensorDescriptor.from_tensor(d.base, d.block_shape)

    ways = {"jit": lambda: jit[grid](*args, **kwargs), "compiled.run": direct, "descriptors": rebuild_descriptors}
    if launcher is not None:
        ways["launcher"] = lambda: launcher[grid](*args, **kwargs)
    return ways


def summary(samples: list[float]) -> dict:
    q = statistics.quantiles(samples, n=5) if len(samples) > 1 else samples * 4
    return {"median_us": round(statistics.median(samples), 2), "p20_us": round(q[0], 2), "p80_us": round(q[3], 2)}


def measure(problem: str, precision: str, table: str, rounds: int, calls: int) -> dict:
    prob = registry.get_problem(problem)
    shape = dict(prob.default_shapes[0])
    args, kwargs = prob.init_args(shape)
    module = autofuse.get_module(problem, *args, table=table, precision=precision, tune_on_miss=False, **kwargs).cuda()
    x = prob.make_input(shape, "rand", torch.Generator().manual_seed(0), "cuda")
    with torch.no_grad():
        info = module.dispatch_info(x)
        module(x)
    with torch.enable_grad():
        module(x)
    variant = module._autofuse.ready[module._autofuse.call_key(module, x)]
    pieces = {}
    with torch.no_grad():
        pieces["module no_grad"] = lambda: module(x)
        pieces["variant no_grad"] = lambda: variant(module, x)
        pieces["variant.forward no_grad (no math_mode)"] = lambda: variant.forward(module, x)
        launches = record_launches(lambda: variant(module, x))
        for i, launch in enumerate(launches):
            for how, fn in replays(launch).items():
                pieces[f"launch {i} {launch[0].fn.__name__}: {how}"] = fn
        for i, launch in enumerate(record_cuda_launches(lambda: variant(module, x))):
            for how, fn in cuda_replays(launch).items():
                pieces[f"cuda launch {i} {launch[1]}: {how}"] = fn
        if hasattr(variant, "folded"):
            pieces["variant.folded (cached)"] = lambda: variant.folded(module, x.device)
        pieces["torch.cuda.current_stream().cuda_stream"] = lambda: torch.cuda.current_stream(x.device).cuda_stream
        pieces["raw stream handle"] = lambda: build.stream_handle(x.device)
        pieces["torch.empty_like(x)"] = lambda: torch.empty_like(x)

    def grad_call():
        with torch.enable_grad():
            module(x)

    pieces["module grad"] = grad_call
    samples = {name: [] for name in pieces}
    for r in range(rounds):
        names = list(pieces)
        names = names[r % len(names):] + names[: r % len(names)]
        for name in names:
            with torch.no_grad():
                samples[name].append(host_us(pieces[name], calls))
    return {"problem": problem, "precision": precision, "shape": shape, "dispatch": info["variant"],
            "params": info.get("params"), "source": info["source"],
            "pieces": {name: summary(s) for name, s in samples.items()}}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--table", default="benchmarks/table.json")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--problems", default=",".join(PROBLEMS))
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--json")
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    results = []
    for problem in args.problems.split(","):
        try:
            result = measure(problem, args.precision, args.table, args.rounds, args.calls)
        except Exception as exc:  # noqa: BLE001 - one problem's failure is reported, the rest still run
            result = {"problem": problem, "error": f"{type(exc).__name__}: {exc}"[:400]}
        print(json.dumps(result), flush=True)
        for name, s in result.get("pieces", {}).items():
            print(f"  {name:58s} {s['median_us']:8.1f} µs  [{s['p20_us']:.1f}-{s['p80_us']:.1f}]", flush=True)
        results.append(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
