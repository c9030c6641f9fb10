"""A variant's source hash covers the code its entries were measured with, and nothing else."""

import sys
import textwrap

import pytest

from autofuse.core import registry, source_hash

FUSED_PROBLEMS = ("gemm_bn", "gemm_avgpool_gelu_residual", "matmul_gelu_softmax", "matmul_clamp_lse_mish")


@pytest.mark.parametrize("problem", FUSED_PROBLEMS)
def test_a_fused_variants_hash_follows_its_kernels_wherever_they_live(problem):
    """Triton kernel modules are imported by name on first use; the hash follows them too."""
    package = f"autofuse.variants.{problem}"
    for name, cls in registry.variants(problem).items():
        if name in ("eager", "compiled", "simplified"):
            continue
        reached = source_hash.closure(cls.__module__)
        wanted = {cls.__module__, f"{package}.gradients", f"{package}.triton_kernels", "autofuse.kernels.triton.gemm"}
        assert wanted <= set(reached), (name, sorted(wanted - set(reached)))
        assert not [m for m in reached if m.startswith(("torch", "autofuse.core", "autofuse.serve"))], reached


def test_a_hash_follows_imports_into_another_built_in_problem():
    reached = source_hash.closure("autofuse.variants.gemm_avgpool_gelu_residual.cuda_fused")
    assert "autofuse.variants.matmul_gelu_softmax.gradients" in reached  # 51's backward reuses 99's gelu_grad


def _module(tmp_path, monkeypatch, files: dict) -> None:
    for relative, text in files.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [n for n in sys.modules if n.startswith("hashplug")]:
        del sys.modules[name]
    source_hash._origin_or_none.cache_clear()
    source_hash._module.cache_clear()


KERNELS = '''
    """Kernels · ≤ (non-ASCII in a docstring)."""
    def scale(x):
        return 2 * x  # doubling is exact
'''
VARIANT = '''
    """The variant."""
    import torch  # not followed: outside the plugin's package


    def forward(x):
        """Lazily, as triton kernels are."""
        from autofuse.kernels.triton.host import kernel_module
        return kernel_module(".kernels", __package__).scale(x)
'''


def test_comments_and_docstrings_leave_a_hash_and_code_moves_it(tmp_path, monkeypatch):
    files = {"hashplug/__init__.py": "", "hashplug/kernels.py": KERNELS, "hashplug/variant.py": VARIANT}
    _module(tmp_path, monkeypatch, files)
    reached = source_hash.closure("hashplug.variant")
    assert "hashplug.kernels" in reached and "autofuse.kernels.triton.host" in reached and "torch" not in reached
    base = source_hash.code_digest("hashplug.variant")

    def digest_with(kernels: str) -> str:
        _module(tmp_path, monkeypatch, {**files, "hashplug/kernels.py": kernels})
        return source_hash.code_digest("hashplug.variant")

    assert digest_with(KERNELS.replace("# doubling is exact", "# a new comment")) == base
    assert digest_with(KERNELS.replace("Kernels ·", "The kernels,")) == base
    assert digest_with(KERNELS.replace("    def scale", "\n\n    def scale")) == base
    assert digest_with(KERNELS.replace("2 * x", "x + x")) != base  # the kernel a lazy import reaches
    assert digest_with(KERNELS.replace("2 * x", "2 * x + len('# not a comment')")) != base
