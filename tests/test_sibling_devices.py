"""A GPU the table has no section for is served from a sibling's: same architecture and SM count.

The shipped table was tuned on an H100; the same kernels, compiled for an H200 (sm_90, 132 SMs
too), compute the same there, so an H200 caller gets them rather than the reference. These run
on the CPU with the device's fingerprint replaced.
"""

import logging

import pytest
import torch
from helpers import SMALL, module_for, sizes

from autofuse.serve import runtime
from autofuse.serve.table import DispatchKey, DispatchTable, fingerprint_key, serving_devices, shape_key

B, IN, OUT = SMALL


def gpu(name, capability="9.0", sm_count=132, cuda="13.0", torch_version="2.11.0+cu130"):
    return {"kind": "cuda", "name": name, "capability": capability, "sm_count": sm_count, "cuda": cuda,
            "torch": torch_version}


H100, H200 = gpu("NVIDIA H100 80GB HBM3"), gpu("NVIDIA H200")


def sections(*fingerprints):
    return {fingerprint_key(fp): {"fingerprint": fp, "problems": {}} for fp in fingerprints}


def test_own_section_first_then_siblings():
    assert serving_devices(sections(H100, H200), H200) == [fingerprint_key(H200), fingerprint_key(H100)]


def test_same_architecture_and_sm_count_serves():
    assert serving_devices(sections(H100), H200) == [fingerprint_key(H100)]


@pytest.mark.parametrize("other", [gpu("NVIDIA H100 PCIe", sm_count=114), gpu("NVIDIA A100", capability="8.0",
                                                                           sm_count=108)])
def test_another_architecture_or_sm_count_does_not(other):
    assert serving_devices(sections(other), H200) == []


def test_a_cpu_is_served_only_by_its_own_section():
    cpu = {"kind": "cpu", "name": "x86_64", "cores": 2, "torch": "2.13.0"}
    other = {**cpu, "cores": 4}
    assert serving_devices(sections(other), cpu) == []
    assert serving_devices(sections(cpu, other), cpu) == [fingerprint_key(cpu)]


def test_the_same_torch_and_cuda_are_preferred_then_the_key_order():
    older = gpu("NVIDIA H100 80GB HBM3", torch_version="2.10.0+cu128", cuda="12.8")
    same = gpu("NVIDIA GH200 480GB")
    assert serving_devices(sections(older, same), H200) == [fingerprint_key(same), fingerprint_key(older)]
    twins = [gpu("NVIDIA H100 80GB HBM3", torch_version="2.9.0"), gpu("NVIDIA GH200", torch_version="2.9.0")]
    assert serving_devices(sections(*twins), H200) == sorted(fingerprint_key(fp) for fp in twins)


def test_a_section_without_a_fingerprint_is_skipped():
    devices = {"hand|edited": {"problems": {}}, "odd": [], **sections(H100)}
    assert serving_devices(devices, H200) == [fingerprint_key(H100)]


def record(fingerprint, variant="simplified", n_in=IN):
    entry = {"variant": variant, "params": {}, "median_ms": 1.0, "p20_ms": 1.0, "p80_ms": 1.0, "eager_ms": 2.0,
             "speedup": 2.0, "error": 1e-7}
    DispatchTable().record(fingerprint, "matmul_gelu_softmax", shape_key(sizes("matmul_gelu_softmax", B, n_in, OUT)),
                           DispatchKey("float32", "fp32", "any", False).to_str(), entry)


@pytest.fixture
def on_h200(monkeypatch):
    """The runtime believes the CPU is an H200 (kernels still run on the CPU)."""
    monkeypatch.setattr(runtime, "current_fingerprint", lambda device: H200)


def served(caplog):
    module = module_for("matmul_gelu_softmax")
    x = torch.randn(B, IN)
    with caplog.at_level(logging.WARNING, logger="autofuse"), torch.no_grad():
        module(x)
        module(x)
        info = module.dispatch_info(x)
    return info, [r.getMessage() for r in caplog.records]


def test_a_sibling_section_serves_and_says_so_once(on_h200, caplog):
    record(H100)
    info, said = served(caplog)
    assert (info["variant"], info["source"], info["tuned_on"]) == ("simplified", "tuned", fingerprint_key(H100))
    borrowed = [m for m in said if "no entries tuned on" in m]
    assert len(borrowed) == 1 and fingerprint_key(H100) in borrowed[0] and "autofuse tune" in borrowed[0], said


def test_the_own_section_wins_over_a_sibling(on_h200, caplog):
    record(H100, variant="eager")
    record(H200)
    info, said = served(caplog)
    assert (info["variant"], info["tuned_on"]) == ("simplified", None)
    assert not [m for m in said if "no entries tuned on" in m]


def test_a_sibling_serves_a_shape_family_the_own_section_lacks(on_h200, caplog):
    record(H100)
    record(H200, variant="eager", n_in=IN + 1)  # the H200 tuned another family only
    info, _ = served(caplog)
    assert (info["variant"], info["tuned_on"]) == ("simplified", fingerprint_key(H100))


def test_no_sibling_runs_the_reference(on_h200, caplog):
    record(gpu("NVIDIA H100 PCIe", sm_count=114))
    info, said = served(caplog)
    assert (info["variant"], info["source"]) == ("eager", "no entry: reference")
    assert any("running the reference" in m for m in said), said


def test_with_tune_on_miss_a_borrowed_entry_is_tuned_here(on_h200, monkeypatch):
    record(H100)
    asked = []

    class Tune:
        log_path, status = "log", "queued"

    def request(dispatcher, key, shape, dkey, device):
        asked.append(dkey.to_str())
        return Tune()
    monkeypatch.setattr(runtime.background, "request", request)
    module = module_for("matmul_gelu_softmax", tune_on_miss=runtime.background.TuneOnMiss(trials=1))
    with torch.no_grad():
        module(torch.randn(B, IN))
        info = module.dispatch_info(torch.randn(B, IN))
    assert asked == ["dtype=float32,precision=fp32,mode=any,autograd=false"]
    assert (info["variant"], info["tuned_on"]) == ("simplified", fingerprint_key(H100))  # served meanwhile
