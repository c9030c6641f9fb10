"""On the GPU: the shipped table serves this GPU, from its own section or a sibling's, with fused
variants whose answers are the float64 reference's within the precision's tolerance.

A sibling is a GPU of the same architecture and SM count (``autofuse.serve.table.serving_devices``):
the table tuned on an H100 serves an H200. Every tuned family (forward key) is called through
``get_module`` at batch 37, a batch no tune ran at, on fresh random parameters and input, and its
output is compared with the float64 reference by the gate's own comparison (``gate.compare``,
the eager model at that precision as the floor).
"""

import pathlib

import pytest
import torch

import autofuse
from autofuse.core import registry
from autofuse.serve.table import DispatchKey, DispatchTable, current_fingerprint, parse_shape_key, serving_devices
from autofuse.tuning.gate import CheckCase, compare, prepare_case

SHIPPED = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "table.json"
BATCH = 37
FAMILIES = sorted({(p, s, k) for _, p, s, k, e in DispatchTable(SHIPPED).entries()
                   if "rung_of" not in e and not DispatchKey.from_str(k).autograd})


@pytest.fixture(scope="module")
def sections():
    found = serving_devices(DispatchTable(SHIPPED).load()["devices"], current_fingerprint("cuda"))
    if not found:
        pytest.skip(f"the shipped table has no section for {torch.cuda.get_device_name()} or a GPU of its "
                    "architecture and SM count")
    return found


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("problem, shape, key", FAMILIES, ids=[f"{p}-{s.split(',')[0]}-{k}" for p, s, k in FAMILIES])
def test_a_tuned_family_is_served_fused_and_right_at_an_untuned_batch(sections, problem, shape, key):
    prob, dkey = registry.get_problem(problem), DispatchKey.from_str(key)
    shape = {**parse_shape_key(shape), prob.batch_dim: BATCH}
    dtype, mode = getattr(torch, dkey.dtype), "eval" if dkey.mode == "eval" else "train"
    case = prepare_case(prob, CheckCase(shape, "randn", 7, randomize=True), "cuda", dtype, mode, dkey.precision)
    args, kwargs = prob.check_init_args(shape, "randn")  # what the case's model was built from
    module = autofuse.get_module(problem, *args, table=SHIPPED, precision=dkey.precision, **kwargs)
    module.load_state_dict(case.model.state_dict())
    module = module.to(device="cuda", dtype=dtype).train(mode == "train")
    with torch.no_grad():
        out = module(case.x)
        info = module.dispatch_info(case.x)
    assert "reference" not in info["source"] and info["variant"] not in ("eager", "compiled"), info
    assert info["tuned_on"] in (None, *sections), info
    error, why = compare(out, case.ref, case.floor, prob.tolerance(dkey.precision))
    assert why is None, f"{info['variant']} {info['params']} ({info['source']}): {why}"
