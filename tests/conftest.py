"""Capability markers (defined once, each skip naming what is missing) and seeding."""

import os
import shutil

import pytest
import torch

# `compiled` (torch.compile of every problem's reference) takes seconds to a minute per
# configuration on a 2-core CPU, and every tune of a whole problem would compile each of its
# configurations: tests leave it out, as a user can, unless they ask for it (the `compiled`
# fixture of test_compiled.py). Set here, before any registry is built or worker started.
os.environ.setdefault("AUTOFUSE_BLOCK_PLUGINS", "compiled")

HAS_CUDA = torch.cuda.is_available()
HAS_NVCC = shutil.which("nvcc") is not None or os.path.exists("/usr/local/cuda/bin/nvcc")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False on this machine")
    skip_nvcc = pytest.mark.skip(reason="needs nvcc (the CUDA compiler) on PATH or in /usr/local/cuda/bin")
    skip_chromium = pytest.mark.skip(reason="needs the chromium browser on PATH (apt-get install chromium; .ci/run installs it)")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "nvcc" in item.keywords and not HAS_NVCC:
            item.add_marker(skip_nvcc)
        if "chromium" in item.keywords and not CHROMIUM:
            item.add_marker(skip_chromium)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path, monkeypatch):
    """Every test gets its own AUTOFUSE_HOME, so no test reads or writes the user's cache."""
    monkeypatch.setenv("AUTOFUSE_HOME", str(tmp_path / "autofuse-home"))


# Parametrize over these: the CUDA case carries the gpu marker, so CPU-only runs list it as skipped.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture
def no_file_problems(monkeypatch):
    """The test starts and ends with no KernelBench file registered in this process."""
    from autofuse.core import plugins
    from autofuse.kernelbench import problem as kernelbench

    monkeypatch.setenv(kernelbench.ENV, "")
    kernelbench.forget()
    plugins.reset_plugin_manager()
    yield
    kernelbench.forget()
    plugins.reset_plugin_manager()


@pytest.fixture
def with_compiled(monkeypatch):
    """`compiled` registered: the default above leaves it out (each compile takes seconds on a CPU)."""
    from autofuse.core import plugins

    monkeypatch.delenv("AUTOFUSE_BLOCK_PLUGINS", raising=False)
    plugins.reset_plugin_manager()
    yield
    monkeypatch.undo()
    plugins.reset_plugin_manager()
