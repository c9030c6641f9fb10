"""The tf32 gate with gradients, at the default shapes, for each way of rounding x (three seeds).

    python3 tests/device/round_kernel_grad_gate.py

A tune (twelfth session, command 13) found 22's triton variant with round_kernel, W by TMA,
failing the gradient gate at 1024×8192² (x's gradient 0.368 off) while round_kernel_sweep.py,
which runs the forward under no_grad, had passed every configuration. This runs the gate with
gradients for round_host (TMA), round_kernel with W by TMA and round_kernel by pointers, at the
tuned tiles, three seeds each, and prints the outcome per case. Found (log 2026-11-24b-14):
W by TMA failed wherever the kernel also stores a tile (22's logits for the backward: x's
gradient 0.8 off; gemm_bn training's z: the output 0.19 off), on every seed; 99 passed, and so did
round_kernel by pointers and round_host everywhere. W by TMA was taken back out (commit cb43249):
the tuple ``(operands, tma)`` below still names it, and now builds round_kernel with x through
TMA, the racy path, which this gate is expected to fail too.
"""

import json

import torch

from autofuse.core import registry
from autofuse.tuning.gate import CheckCase, check_variant

TILES = {"block_m": 128, "block_n": 256, "block_k": 32, "stages": 3, "warps": 8, "group_m": 8, "persistent": True}

for problem, mode in (("matmul_clamp_lse_mish", "train"), ("matmul_gelu_softmax", "train"), ("gemm_bn", "train")):
    prob = registry.get_problem(problem)
    shape = dict(prob.default_shapes[0])
    for operands, tma in (("round_host", True), ("round_kernel", True), ("round_kernel", False)):
        variant = registry.get_variant(problem, "triton")("tf32", **TILES, tma=tma, operands=operands)
        for seed in (1, 2, 3):
            result = check_variant(variant, prob, [CheckCase(shape, "rand", seed, True)], "cuda", autograd=True, mode=mode)
            print(json.dumps({"problem": problem, "operands": operands, "tma": tma, "seed": seed, "ok": result.ok,
                              "error": result.error, "reason": result.reason}), flush=True)
