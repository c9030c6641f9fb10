"""The example plugin package, installed for real into a fresh virtualenv: listed, checked, tuned, dispatched.

examples/autofuse-plugin-example is a separate distribution that registers the problem
``matmul_sigmoid_sum`` and the variant ``matmul_gelu_softmax/row_chunked`` through the
``autofuse`` entry-point group. The virtualenv sees the environment running these tests (its
autofuse, torch and pytest) through a ``.pth`` file, whether that is a virtualenv or the system
interpreter, and gets the plugin by ``pip install``, as a user would; every step runs in it.
(``system_site_packages`` would not do: from a virtualenv it exposes the *base* interpreter's
site-packages, with another autofuse or none, no torch, and perhaps a setuptools that cannot
build the plugin.)
"""

import importlib.metadata
import importlib.util
import json
import os
import pathlib
import shutil
import site
import subprocess
import venv

import pytest
import torch

import autofuse

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "autofuse-plugin-example"


def running_site_dirs() -> list[str]:
    """The site directories of the interpreter running the tests, in the order it searches them:
    the user's (where enabled), then its environment's (a virtualenv's, or the system's)."""
    user = [site.getusersitepackages()] if site.ENABLE_USER_SITE else []
    return [d for d in user + site.getsitepackages() if os.path.isdir(d)]


def can_build_without_isolation() -> bool:
    """Whether the running environment's setuptools builds a wheel by itself (70.1 and later, or
    with ``wheel`` installed); then pip builds the example there and downloads nothing."""
    try:
        version = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        return False
    major_minor = tuple(int(part) for part in version.split(".")[:2] if part.isdigit())
    return major_minor >= (70, 1) or importlib.util.find_spec("wheel") is not None


def _see_the_running_environment(python: str) -> None:
    """A .pth in the virtualenv's site-packages that adds the running one's site directories,
    each through site.addsitedir, so their own .pth files (editable installs) apply too."""
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    calls = "; ".join(f"site.addsitedir({d!r})" for d in running_site_dirs())
    pathlib.Path(purelib, "autofuse_test_running_env.pth").write_text(f"import site; {calls}\n")


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory):
    """(python of a virtualenv with the example installed, environment for its commands, the example's source)."""
    root = tmp_path_factory.mktemp("plugin-env")
    source = shutil.copytree(EXAMPLE, root / "src", ignore=shutil.ignore_patterns("build", "*.egg-info"))
    try:
        venv.EnvBuilder(with_pip=False).create(root / "venv")
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"cannot create a virtualenv here: {exc}")
    python = str(root / "venv" / "bin" / "python")
    _see_the_running_environment(python)
    env = {**os.environ, "AUTOFUSE_HOME": str(root / "home")}
    # The running environment's pip, installing into the virtualenv (its sys.prefix).
    isolation = ["--no-build-isolation"] if can_build_without_isolation() else []
    done = subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", *isolation, str(source)],
                          env=env, capture_output=True, text=True)
    assert done.returncode == 0, f"pip install of the example failed:\n{done.stdout}\n{done.stderr}"
    return python, env, source


def _run(plugin_env, *args):
    python, env, _ = plugin_env
    done = subprocess.run([python, *args], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{args}: {done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    return done.stdout


def test_the_environment_runs_this_autofuse_and_torch_with_the_plugin(plugin_env):
    out = _run(plugin_env, "-c", "import autofuse, torch, autofuse_plugin_example as p\n"
                                 "print(autofuse.__file__); print(torch.__file__); print(p.__file__)")
    ours, their_torch, plugin = out.splitlines()
    assert pathlib.Path(ours) == pathlib.Path(autofuse.__file__)  # the autofuse under test, not another copy
    assert pathlib.Path(their_torch) == pathlib.Path(torch.__file__)  # the running environment's torch
    assert pathlib.Path(plugin).is_relative_to(pathlib.Path(plugin_env[0]).parent.parent)  # installed, not the source


def test_the_plugin_is_listed_with_its_name(plugin_env):
    out = _run(plugin_env, "-m", "autofuse.cli", "list", "kb2-56")
    assert "matmul_sigmoid_sum (kb2-56" in out and "[plugin example.matmul_sigmoid_sum]" in out
    assert "fused_bias" in out
    out = _run(plugin_env, "-m", "autofuse.cli", "list", "matmul_gelu_softmax")
    assert "row_chunked" in out and "example.row_chunked" in out


def test_the_plugins_own_tests_pass(plugin_env):
    _, _, source = plugin_env
    out = _run(plugin_env, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(source / "tests"))
    assert " passed" in out and "failed" not in out


@pytest.mark.parametrize("problem,variants,shape,init", [
    ("kb2-56", "eager,fused_bias", "batch_size=24,input_size=40,hidden_size=24", "40, 24"),
    ("matmul_gelu_softmax", "eager,row_chunked", "batch_size=96,in_features=40,out_features=24", "40, 24"),
])
def test_the_plugin_is_tuned_and_dispatched(plugin_env, tmp_path, problem, variants, shape, init):
    table = tmp_path / "table.json"
    out = _run(plugin_env, "-m", "autofuse.cli", "tune", problem, "--shape", shape, "--device", "cpu",
               "--variants", variants, "--trials", "4", "--seed", "0", "--table", str(table), "--no-progress")
    assert "winner:" in out
    batch = shape.split(",")[0].split("=")[1]
    info = json.loads(_run(plugin_env, "-c", (
        "import json, torch, autofuse\n"
        f"m = autofuse.get_module({problem!r}, {init}, table={str(table)!r})\n"
        # no_grad: the inference entry, the one compared below (with grad on the parameters'
        # requires_grad makes it the autograd entry, whose winner the tune may choose differently)
        "with torch.no_grad():\n"
        f"    info = m.dispatch_info(torch.rand({batch}, {init.split(',')[0]}))\n"
        "print(json.dumps({'variant': info['variant'], 'source': info['source']}))")).splitlines()[-1])
    # The tuned shape's entry: the table also holds its batch classes' entries at other batches.
    entries = [e for d in json.loads(table.read_text())["devices"].values() for p in d["problems"].values()
               for skey, s in p.items() for k, e in s.items() if "autograd=false" in k and skey == shape]
    assert info == {"variant": entries[0]["variant"], "source": "tuned"}
    assert {c for c in entries[0]["candidates"]} == set(variants.split(","))  # the plugin's variant was measured
