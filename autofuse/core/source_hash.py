"""A variant's source hash: which code its table entries were measured with.

An entry records the hash of its variant's code; ``autofuse report`` and the shipped-table test
call it stale once that hash moves, and a study's name holds it, so a search never resumes on
results of other code. A variant's code is more than its module: its kernels live beside it
(``triton_kernels.py``, ``gradients.py``, ``cuda_fused.py``) and in the shared kernel library
(``autofuse.kernels``: the Triton main loop, the float16 parts, the nvcc flags). So the hash
follows the module's imports, at any depth (those inside functions too), within the kernel
library, the built-in variants and a plugin's own package, and digests each module's text with
its docstrings, comments and blank lines left out: editing a comment or a docstring leaves
entries fresh, and any change to code stales them. Non-Python sources (``Variant.sources``,
CUDA files and headers) are hashed as bytes by the variant classes that own them.

Until 2026-11-27 the hash read the variant's module file alone: the epilogue kernels of a triton
variant (``triton_kernels.py``) and the main loop they share could change under its entries
without one of them going stale.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import pathlib
import re
import sys
import tokenize

# Where a hash follows imports, besides a plugin's own top-level package: the shared kernel
# library and the built-in variants (51's gradients reuse 99's gelu_grad; a plugin may too).
BUILT_IN = ("autofuse.kernels", "autofuse.variants")
# A string that may name a module, absolute or relative ("autofuse.kernels.triton.gemm", ".triton_kernels").
_MODULE_NAME = re.compile(r"\.*[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def code_digest(module_name: str) -> str:
    """Hex digest of ``module_name``'s code and of every module it reaches (module docstring)."""
    digest = hashlib.sha256()
    for name in closure(module_name):
        digest.update(name.encode())
        digest.update(_module(name)[1])
    return digest.hexdigest()


def closure(module_name: str) -> list[str]:
    """``module_name`` and the modules it imports, at any depth, inside ``BUILT_IN`` or its own
    top-level package; sorted."""
    top = module_name.partition(".")[0]
    scopes = (*BUILT_IN, *([] if top == "autofuse" else [top]))

    def in_scope(name: str) -> bool:
        return any(name == s or name.startswith(s + ".") for s in scopes)

    seen, todo = set(), [module_name]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(n for n in _module(name)[0] if in_scope(n) and _origin_or_none(n))
    return sorted(seen)


@functools.cache
def _module(name: str) -> tuple[frozenset[str], bytes]:
    """(the names module ``name`` imports, the digest of its code), from one parse of its file:
    the variants of one process share most of their modules (31 classes reach 30 modules)."""
    path = _origin(name)
    source = path.read_bytes()
    tree = ast.parse(source, filename=str(path))
    return frozenset(_imports(tree, name, path)), _code_digest_of(source, tree)


def _imports(tree: ast.Module, name: str, path: pathlib.Path) -> set[str]:
    """The names ``name``'s source imports as modules (the caller keeps the modules among them):
    each ``import a.b``; each ``from a.b import c``'s ``a.b`` and ``a.b.c`` (``c`` may be a
    submodule); and each string that spells a module's name, absolute or relative to the
    module's package (``kernel_module(".triton_kernels", __package__)``): Triton kernel modules
    are imported by name, on first use, because they import triton."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve("." * node.level + (node.module or ""), package)
            if base is not None:
                found.add(base)
                found.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _MODULE_NAME.fullmatch(node.value):
            found.add(_resolve(node.value, package))
    found.discard(None)
    return found


def _resolve(name: str, package: str) -> str | None:
    try:
        return importlib.util.resolve_name(name, package) if name.startswith(".") else name
    except (ImportError, ValueError):  # more dots than the package has parents
        return None


@functools.cache
def _origin_or_none(name: str) -> pathlib.Path | None:
    """The .py file of module ``name``, or None (not a module, or not Python source)."""
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None) if module is not None else None
    if spec is None:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, AttributeError, ValueError):  # a name imported from a module, not a module
            return None
    origin = getattr(spec, "origin", None)
    return pathlib.Path(origin) if origin and origin.endswith(".py") else None


def _origin(name: str) -> pathlib.Path:
    origin = _origin_or_none(name)
    if origin is None:
        raise ValueError(f"{name} is not a Python source module: it has no source hash")
    return origin


def _code_digest_of(source: bytes, tree: ast.Module) -> bytes:
    """The module's text without docstrings, comments, trailing spaces and blank lines.

    Cut by position (the syntax tree's for docstrings, the tokenizer's for comments), not by
    re-serializing the tree: the table's hashes come from the GPU machine's Python and CI checks
    them under its own, and the tree's fields differ between Python versions (3.12 added
    ``type_params``) while positions in the same text do not.
    """
    lines = source.splitlines(keepends=True)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            doc = body[0]  # positions in bytes
            _blank(lines, doc.lineno, doc.col_offset, doc.end_lineno, doc.end_col_offset, b" ")
    text = [line.decode() for line in lines]
    comments = [t for t in tokenize.generate_tokens(iter(text).__next__) if t.type == tokenize.COMMENT]
    for comment in comments:  # positions in characters
        _blank(text, *comment.start, *comment.end, " ")
    kept = (line.rstrip() for line in text)
    return hashlib.sha256("\n".join(line for line in kept if line).encode()).digest()


def _blank(lines: list, line0: int, col0: int, line1: int, col1: int, space) -> None:
    """Overwrite lines[line0-1][col0:] ... lines[line1-1][:col1] (1-based lines) with spaces."""
    for i in range(line0 - 1, line1):
        line = lines[i]
        start = col0 if i == line0 - 1 else 0
        end = col1 if i == line1 - 1 else len(line.rstrip(b"\r\n" if isinstance(line, bytes) else "\r\n"))
        lines[i] = line[:start] + space * (end - start) + line[end:]
