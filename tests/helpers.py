"""The one assert helper the runtime and semantics tests share, their model/table builders,
and the way tests register plugins of their own."""

import copy
import os
import pathlib

import torch

import autofuse
from autofuse.core import plugins, registry
from autofuse.serve.table import DispatchKey, DispatchTable, current_fingerprint, shape_key

# (batch, in, out) small enough that a whole file runs in seconds on two CPU cores.
SMALL = (8, 12, 10)
PROBLEMS = ["gemm_bn", "gemm_avgpool_gelu_residual", "matmul_gelu_softmax", "matmul_clamp_lse_mish"]
PLUGIN_DIR = str(pathlib.Path(__file__).parent / "plugins")


def use_test_plugins(monkeypatch, modules: str, folder: str = PLUGIN_DIR) -> None:
    """Register the plugin modules ``modules`` (comma-separated, in ``folder``) through
    AUTOFUSE_PLUGINS, in this process and in the worker subprocesses it starts (PYTHONPATH).
    The caller resets the plugin manager again once ``monkeypatch`` has undone this."""
    monkeypatch.syspath_prepend(folder)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([folder, os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("AUTOFUSE_PLUGINS", modules)
    plugins.reset_plugin_manager()


def assert_close(got, want, tol=None, *, atol=0.0, rtol=0.0, what="output", shown=5):
    """Compare in float64: |got−want| ≤ atol + rtol·|want| everywhere (and the relative L2 error
    ≤ tol.rel_l2 when a Tolerance is given); on failure name the count and the first indices."""
    assert isinstance(got, torch.Tensor), f"{what}: got {type(got).__name__}, not a tensor"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if tol is not None:
        atol, rtol = tol.atol, tol.rtol
    g, w = got.detach().cpu().to(torch.float64), want.detach().cpu().to(torch.float64)
    bad = ~((g - w).abs() <= atol + rtol * w.abs()) & ~((g == w) | (g.isnan() & w.isnan()))
    if bad.any():
        idx = bad.nonzero()[:shown]
        first = "; ".join(f"{tuple(i.tolist())}: got {g[tuple(i)].item():.8g}, expected {w[tuple(i)].item():.8g}" for i in idx)
        raise AssertionError(f"{what}: {int(bad.sum())}/{bad.numel()} elements off by more than "
                             f"atol={atol:g} + rtol={rtol:g}·|expected|; first: {first}")
    if tol is not None and w.norm() > 0:
        rel = ((g - w).norm() / w.norm()).item()
        assert rel <= tol.rel_l2, f"{what}: relative L2 error {rel:.3g} > {tol.rel_l2:g}"


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """‖got − want‖ / ‖want‖ in float64 (a zero ``want`` counts as a tiny one, not a division by zero)."""
    want = want.double()
    return ((got.double() - want).norm() / want.norm().clamp_min(1e-30)).item()


def sizes(problem, batch, n_in, n_out):
    return dict(zip(registry.get_problem(problem).dims, (batch, n_in, n_out)))


def init_args(problem, batch, n_in, n_out):
    args, kwargs = registry.get_problem(problem).init_args(sizes(problem, batch, n_in, n_out))
    return args, kwargs


def module_for(problem, batch=SMALL[0], n_in=SMALL[1], n_out=SMALL[2], **kwargs):
    """``autofuse.get_module`` of ``problem`` at (batch, n_in, n_out), ``kwargs`` passed on."""
    args, init_kwargs = init_args(problem, batch, n_in, n_out)
    return autofuse.get_module(problem, *args, **init_kwargs, **kwargs)


def kernelbench_model(problem, batch, n_in, n_out, seed=0, mode="train"):
    """The problem's plain ``Model`` with every parameter and buffer redrawn."""
    prob = registry.get_problem(problem)
    args, kwargs = init_args(problem, batch, n_in, n_out)
    model = prob.model(*args, **kwargs)
    prob.randomize_parameters(model, torch.Generator().manual_seed(seed))
    return model.train(mode == "train")


def twin(model):
    """A deep copy, so two variants run from identical state."""
    return copy.deepcopy(model)


def record(problem, batch, n_in, n_out, *, mode="any", autograd=False, variant="simplified",
           dtype="float32", precision="fp32", path=None, device="cpu", **entry_fields):
    """Write one dispatch-table entry for ``device`` as if the tuner had chosen ``variant``."""
    entry = {"variant": variant, "params": {}, "median_ms": 1.0, "p20_ms": 1.0, "p80_ms": 1.0,
             "eager_ms": 2.0, "speedup": 2.0, "error": 1e-7, **entry_fields}
    key = DispatchKey(dtype, precision, mode, autograd).to_str()
    DispatchTable(path).record(current_fingerprint(device), registry.get_problem(problem).name,
                               shape_key(sizes(problem, batch, n_in, n_out)), key, entry)
