"""The example plugin package, installed for real into a fresh virtualenv: listed, checked, tuned, dispatched.

examples/autofuse-plugin-example is a separate distribution that registers the problem
``matmul_sigmoid_sum`` and the variant ``matmul_gelu_softmax/row_chunked`` through the
``autofuse`` entry-point group. The virtualenv sees this autofuse (system site-packages) and
gets the plugin by ``pip install``, as a user would; every step runs in that environment.
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import venv

import pytest

import autofuse

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "autofuse-plugin-example"


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory):
    """(python of a virtualenv with the example installed, environment for its commands)."""
    root = tmp_path_factory.mktemp("plugin-env")
    source = shutil.copytree(EXAMPLE, root / "src", ignore=shutil.ignore_patterns("build", "*.egg-info"))
    try:
        venv.EnvBuilder(system_site_packages=True, with_pip=False).create(root / "venv")
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"cannot create a virtualenv here: {exc}")
    python = str(root / "venv" / "bin" / "python")
    env = {**os.environ, "AUTOFUSE_HOME": str(root / "home")}
    # pip of the running interpreter, installing into the virtualenv; no build isolation, so no download.
    done = subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps",
                           "--no-build-isolation", str(source)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, f"pip install of the example failed:\n{done.stdout}\n{done.stderr}"
    return python, env, source


def _run(plugin_env, *args):
    python, env, _ = plugin_env
    done = subprocess.run([python, *args], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{args}: {done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    return done.stdout


def test_the_environment_runs_this_autofuse_with_the_plugin(plugin_env):
    out = _run(plugin_env, "-c", "import autofuse, autofuse_plugin_example as p; print(autofuse.__file__); print(p.__file__)")
    ours, plugin = out.split()
    assert pathlib.Path(ours) == pathlib.Path(autofuse.__file__)  # the autofuse under test, not another copy
    assert "venv" in plugin  # the plugin as installed, not the source tree


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
        f"info = m.dispatch_info(torch.rand({batch}, {init.split(',')[0]}))\n"
        "print(json.dumps({'variant': info['variant'], 'source': info['source']}))")).splitlines()[-1])
    entries = [e for d in json.loads(table.read_text())["devices"].values() for p in d["problems"].values()
               for s in p.values() for k, e in s.items() if "autograd=false" in k]
    assert info == {"variant": entries[0]["variant"], "source": "tuned"}
    assert {c for c in entries[0]["candidates"]} == set(variants.split(","))  # the plugin's variant was measured
