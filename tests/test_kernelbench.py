"""KernelBench files in and out: a file in KernelBench's format is a problem (tuned in a worker,
dispatched, listed by path or name), and `autofuse export --kernelbench` writes a ModelNew
file that KernelBench's own harness procedure accepts next to the reference."""

import json
import os
import pathlib
import textwrap

import pytest
import torch
from helpers import assert_close, record, use_test_plugins

import autofuse
from autofuse.cli import main
from autofuse.core import registry
from autofuse.kernelbench import problem as kernelbench
from autofuse.kernelbench.export import export_kernelbench
from autofuse.testing import assert_variant_conforms

FILES = pathlib.Path(__file__).parent / "kernelbench"
CONV = FILES / "conv2d_relu_biasadd.py"  # KernelBench level 2, problem 1, small sizes
GEMM = FILES / "gemm_sigmoid_sum.py"  # KernelBench level 2, problem 56, small sizes

PLUGIN = '''
import torch
import torch.nn.functional as F
import autofuse
from autofuse.core.variant import Variant


class Functional(Variant):
    name = "functional"
    problem = "kb_conv2d_relu_biasadd"
    kind = "simplified"
    description = "F.conv2d, relu and the bias in one expression"
    supports_autograd = True

    def forward(self, model, x):
        return torch.relu(F.conv2d(x, model.conv.weight, model.conv.bias)) + model.bias


class NoRelu(Variant):
    name = "no_relu"
    problem = "kb_conv2d_relu_biasadd"
    kind = "simplified"
    description = "wrong: forgets the relu"

    def forward(self, model, x):
        return F.conv2d(x, model.conv.weight, model.conv.bias) + model.bias


@autofuse.hookimpl
def autofuse_register_variants():
    return [Functional, NoRelu]
'''


pytestmark = pytest.mark.usefixtures("no_file_problems")  # each test starts and ends with none registered


@pytest.fixture
def conv_plugin(tmp_path, monkeypatch):
    """A plugin adding a correct and a wrong variant for the conv file, also for worker subprocesses."""
    (tmp_path / "kb_conv_plugin.py").write_text(PLUGIN)
    use_test_plugins(monkeypatch, "kb_conv_plugin", str(tmp_path))


def write(tmp_path, name, source):
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


def kernelbench_eval(reference_path, new_path, seed=42):
    """KernelBench's procedure: exec the reference, seed, build Model; exec the new file into the
    same namespace, seed, build ModelNew; seed, draw the inputs; run both without grad."""
    context = {}
    exec(compile(pathlib.Path(reference_path).read_text(), "<reference>", "exec"), context)
    Model, get_inputs, get_init_inputs = context["Model"], context["get_inputs"], context["get_init_inputs"]
    init_inputs = get_init_inputs()
    with torch.no_grad():
        torch.manual_seed(seed)
        model = Model(*init_inputs)
    exec(compile(pathlib.Path(new_path).read_text(), "<custom>", "exec"), context)
    with torch.no_grad():
        torch.manual_seed(seed)
        model_new = context["ModelNew"](*init_inputs)
    torch.manual_seed(seed + 1)
    inputs = get_inputs()
    with torch.no_grad():
        return model, model_new, inputs, model(*inputs), model_new(*inputs)


# -- a file is a problem -----------------------------------------------------------

def test_a_file_is_a_problem_by_path_and_then_by_name():
    problem = registry.get_problem(str(CONV))
    assert problem.name == "kb_conv2d_relu_biasadd"
    assert registry.get_problem("kb_conv2d_relu_biasadd") is problem
    assert problem.dims == ("batch_size", "in_channels", "out_channels", "height", "width", "kernel_size")
    assert dict(problem.default_shapes[0]) == {"batch_size": 16, "in_channels": 3, "out_channels": 8,
                                               "height": 12, "width": 12, "kernel_size": 3}
    assert problem.batch_dim == "batch_size"
    assert [v["name"] for v in autofuse.list_variants(str(CONV))] == ["eager"]
    # A size given alone keeps the others; a derived global (bias_shape) follows its size.
    assert problem.normalize_shape({"out_channels": 5})["height"] == 12
    assert problem.init_args({"out_channels": 5}) == ((3, 5, 3, (5, 1, 1)), {})
    x = problem.make_input({"batch_size": 2, "height": 9}, "rand", torch.Generator().manual_seed(0))
    assert tuple(x.shape) == (2, 3, 9, 12)
    assert os.environ[kernelbench.ENV] == str(CONV.resolve())  # what worker subprocesses read


def test_the_cli_lists_a_file_by_path(capsys):
    assert main(["list", str(GEMM)]) == 0
    out = capsys.readouterr().out
    assert "kb_gemm_sigmoid_sum" in out and "batch_size=32,input_size=24,hidden_size=20" in out and "eager" in out


def test_missing_names_are_named(tmp_path, capsys):
    path = write(tmp_path, "half.py", """
        import torch
        batch_size = 4
        def get_inputs():
            return [torch.rand(batch_size, 3)]
    """)
    with pytest.raises(autofuse.InputError, match="defines no Model and no get_init_inputs"):
        registry.get_problem(str(path))
    assert main(["tune", str(path), "--device", "cpu"]) == 2
    assert "defines no Model and no get_init_inputs" in capsys.readouterr().err


def test_a_file_with_two_inputs_is_refused(tmp_path):
    path = write(tmp_path, "two_inputs.py", """
        import torch
        from torch import nn
        class Model(nn.Module):
            def forward(self, a, b):
                return a @ b
        n = 4
        def get_inputs():
            return [torch.rand(n, n), torch.rand(n, n)]
        def get_init_inputs():
            return []
    """)
    with pytest.raises(autofuse.InputError, match=r"returns \['Tensor', 'Tensor'\].*exactly one tensor"):
        registry.get_problem(str(path))


def test_a_missing_file_is_an_unknown_name(tmp_path):
    with pytest.raises(autofuse.UnknownNameError, match="is not a file"):
        registry.get_problem(str(tmp_path / "nowhere.py"))


def test_two_different_files_under_one_name_fail_naming_both(tmp_path):
    registry.get_problem(str(CONV))
    (tmp_path / "conv2d_relu_biasadd.py").write_text(CONV.read_text().replace("batch_size = 16", "batch_size = 15"))
    with pytest.raises(autofuse.PluginError, match="both problem 'kb_conv2d_relu_biasadd'.*rename"):
        registry.get_problem(str(tmp_path / "conv2d_relu_biasadd.py"))


def test_get_module_reads_the_sizes_of_each_call():
    module = autofuse.get_module(str(CONV), 3, 5, 3, (5, 1, 1))
    x = torch.rand(2, 3, 9, 10)
    shape = registry.get_problem(str(CONV)).shape_of(module, x)
    assert shape == {"batch_size": 2, "in_channels": 3, "out_channels": 5, "height": 9, "width": 10, "kernel_size": 3}
    with pytest.raises(autofuse.InputError, match=r"expected a 4-D input \(batch_size, in_channels, height, width\)"):
        module(torch.rand(3, 9, 10))
    # bias_shape (1, 1, 1) is no setting of the file's sizes (it is (out_channels, 1, 1)): the reference runs.
    odd = autofuse.get_module(str(CONV), 3, 5, 3, (1, 1, 1))
    with torch.no_grad():
        assert odd.dispatch_info(x)["source"] == "no shape: reference"
        assert_close(odd(x), odd._autofuse_reference_forward(x), atol=0, rtol=0)


def test_a_plugin_variant_for_a_file_waits_for_the_file(conv_plugin):
    assert "kb_conv2d_relu_biasadd" not in registry.problems()  # no error: the variant waits
    assert set(registry.variants(str(CONV))) == {"eager", "functional", "no_relu"}


def test_the_conformance_kit_runs_a_file_problems_variants(conv_plugin):
    assert_variant_conforms(str(CONV), "functional")  # batch 1, 2, 7 and the file's own sizes
    with pytest.raises(AssertionError, match="no_relu"):
        assert_variant_conforms(str(CONV), "no_relu")


def test_bench_takes_a_file(tmp_path, capsys):
    assert main(["bench", str(GEMM), "--device", "cpu", "--no-compile", "--rounds", "2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "kb_gemm_sigmoid_sum" in out and "autofuse dispatch" in out and "floor" in out


# -- tune, dispatch, export ------------------------------------------------------------

def test_tune_a_file_then_dispatch_and_export_to_kernelbench(conv_plugin, tmp_path, capsys):
    table = tmp_path / "table.json"
    assert main(["tune", str(CONV), "--device", "cpu", "--trials", "2", "--variants", "functional,no_relu",
                 "--table", str(table), "--no-progress", "--seed", "3", "--no-autograd-entry",
                 "--budget", "full", "--no-batch-classes"]) == 0  # full: no_relu meets the gate whatever its time
    out = capsys.readouterr().out
    assert "winner: functional" in out and "incorrect" in out  # no_relu failed the gate
    [(shape, entries)] = json.loads(table.read_text())["devices"].popitem()[1]["problems"]["kb_conv2d_relu_biasadd"].items()
    assert shape == "batch_size=16,in_channels=3,out_channels=8,height=12,width=12,kernel_size=3"

    module = autofuse.get_module(str(CONV), 3, 8, 3, (8, 1, 1), table=table)
    with torch.no_grad():
        assert module.dispatch_info(torch.rand(16, 3, 12, 12))["variant"] == "functional"

    out_file = tmp_path / "conv_new.py"
    assert main(["export", "kb_conv2d_relu_biasadd", "--kernelbench", str(out_file), "--table", str(table)]) == 0
    assert "functional" in capsys.readouterr().out
    model, model_new, inputs, want, got = kernelbench_eval(CONV, out_file)
    assert_close(got, want, atol=1e-2, rtol=1e-2)  # KernelBench's own tolerance
    assert_close(got, want, registry.get_problem(str(CONV)).tolerances["fp32"])
    assert list(model_new.state_dict()) == list(model.state_dict())
    for name, tensor in model.state_dict().items():  # the same seed drew the same parameters
        assert torch.equal(model_new.state_dict()[name], tensor), name
    with torch.no_grad():
        info = model_new.dispatch_info(inputs[0])
    assert (info["variant"], info["source"]) == ("functional", "tuned")


@pytest.mark.parametrize("path", [CONV, GEMM], ids=lambda p: p.stem)
def test_an_untuned_export_runs_the_reference_in_kernelbench(path, tmp_path):
    out_file = tmp_path / "new.py"
    lines = export_kernelbench(str(path), out_file, table=tmp_path / "empty.json")
    assert any("holds no fp32 entry" in line for line in lines)
    _, model_new, inputs, want, got = kernelbench_eval(path, out_file)
    assert_close(got, want, atol=0, rtol=0)
    with torch.no_grad():
        assert model_new.dispatch_info(inputs[0])["variant"] == "eager"


def test_a_builtin_problem_exports_in_kernelbench_format(tmp_path):
    """gemm_bn's export is a KernelBench file itself: run at small sizes, ModelNew dispatches to
    the tuned entry and matches Model, BatchNorm's running statistics included."""
    table = tmp_path / "table.json"
    record("gemm_bn", 8, 12, 10, mode="train", variant="simplified", path=table)
    out_file = tmp_path / "gemm_bn_new.py"
    export_kernelbench("kb2-39", out_file, table=table)
    text = out_file.read_text()
    assert "def get_init_inputs():\n    return [in_features, out_features, (out_features,)]" in text
    small = tmp_path / "gemm_bn_small.py"
    small.write_text(text.replace("batch_size = 16384", "batch_size = 8").replace("in_features = 4096", "in_features = 12")
                     .replace("out_features = 4096", "out_features = 10"))
    model, model_new, inputs, want, got = kernelbench_eval(small, small)
    with torch.no_grad():
        assert model_new.dispatch_info(inputs[0])["variant"] == "simplified"
    assert_close(got, want, registry.get_problem("gemm_bn").tolerances["fp32"])
    assert_close(model_new.bn.running_var, model.bn.running_var, atol=1e-6, rtol=1e-5, what="running_var")


def test_the_device_harness_script_runs_kernelbenchs_procedure_on_the_cpu(tmp_path):
    """benchmarks/gpu/kernelbench_harness.py at --small on the CPU: export, 5 correctness trials,
    timed trials with grad mode on and off, the table and the JSON."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("kernelbench_harness", FILES.parents[1] / "benchmarks" / "gpu" / "kernelbench_harness.py")
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    table = tmp_path / "table.json"
    for autograd in (False, True):  # at the sizes --small writes into the export
        record("matmul_gelu_softmax", *harness.SMALL, autograd=autograd, variant="simplified", path=table)
    out = tmp_path / "out"
    assert harness.main(["--device", "cpu", "--small", "--problems", "kb2-99,kb2-51", "--table", str(table),
                         "--out", str(out), "--trials", "3"]) == 0
    [ours, untuned] = json.loads((out / "harness-fp32.json").read_text())["results"]
    assert ours["check"]["passed"] == 5 and ours["check"]["passed_current_tolerance"] == 5
    assert {ours["timing"][mode]["dispatch"] for mode in ("grad", "no_grad")} == {"simplified (tuned)"}
    assert ours["timing"]["grad"]["model_new_ms"]["num_trials"] == 3 and ours["target"].startswith(">= no-grad")
    assert untuned["timing"]["grad"]["dispatch"] == "eager (no entry: reference)" and untuned["target"] == ">= 50x"
    assert (out / "matmul_gelu_softmax-fp32-new.py").read_text().count("batch_size = 16\n") == 1
    assert "| matmul_gelu_softmax | fp32 | 5/5 (5 at 0.0001) |" in (out / "harness-fp32.md").read_text()
    # A bfloat16 model's run at the same precisions writes files of its own beside the float32 model's.
    assert harness.main(["--device", "cpu", "--small", "--problems", "kb2-99", "--table", str(table), "--out", str(out),
                         "--trials", "3", "--dtype", "bfloat16", "--precision", "bf16"]) == 0
    assert "a bfloat16 model" in (out / "harness-bf16-bfloat16.md").read_text()
    assert "a bfloat16 model" not in (out / "harness-fp32.md").read_text()
    # Grad mode's timed calls: the autograd entry, then the no-grad one once no backward came.
    switched = {"since_backward": 3, "switch_after": 3, "switched": True, "variant": "cublas_epilogue",
                "source": "tuned"}
    info = {"variant": "eager", "source": "tuned", "without_backward": switched}
    assert harness.served_by(info) == "eager (tuned), then cublas_epilogue (tuned)"
    not_yet = {**switched, "since_backward": 2, "switched": False}
    assert harness.served_by({**info, "without_backward": not_yet}) == "eager (tuned)"


def test_the_host_before_gemm_script_stamps_each_models_gemm_on_the_cpu(tmp_path, capsys):
    """benchmarks/gpu/host_before_gemm.py at a tiny shape on the CPU: both models' rows, each with
    its GEMM stamped (the reference's F.linear, the tabled variant's), grad mode on, the dispatch
    named by the no-grad entry its timed calls ran (no backward came after the warm-up)."""
    import importlib.util

    path = FILES.parents[1] / "benchmarks" / "gpu" / "host_before_gemm.py"
    spec = importlib.util.spec_from_file_location("host_before_gemm", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    table = tmp_path / "table.json"
    record("matmul_gelu_softmax", 8, 32, 24, autograd=True, variant="eager", path=table)
    record("matmul_gelu_softmax", 8, 32, 24, autograd=False, variant="simplified", path=table)
    args = script.parse(["matmul_gelu_softmax", "--device", "cpu", "--shape", "8,32,24", "--dtype", "float32",
                         "--precision", "fp32", "--table", str(table), "--grad", "--rounds", "4"])
    reference, dispatch = script.measure(args)
    assert reference[0] == "reference" and dispatch[0] == "dispatch (simplified, tuned)"
    for row in (reference, dispatch):
        assert len(row) == 1 + len(script.PIECES) and "-" not in row, row  # every piece, the GEMM's too
    # The wrappers are gone after the run: torch's own functions again.
    assert torch.nn.functional.linear is torch._C._nn.linear and torch.addmm is torch._C._VariableFunctions.addmm


def test_the_device_harness_script_judges_a_bfloat16_model_by_its_own_targets():
    """Issue 34's speedups for a bfloat16 model (22 1.35x, ...), issue 13's for a float32 one."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("kernelbench_harness", FILES.parents[1] / "benchmarks" / "gpu" / "kernelbench_harness.py")
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    timing = {"timing": {"grad": {"speedup": 1.33}, "no_grad": {"speedup": 1.30}}}
    assert harness.verdict("matmul_clamp_lse_mish", {**timing, "dtype": "bfloat16"}) == (">= 1.35x", "missed by 1.5%")
    assert harness.verdict("matmul_clamp_lse_mish", {**timing, "dtype": "float32"}) == (">= no-grad 1.30x", "met")
    assert harness.verdict("matmul_gelu_softmax", {**timing, "dtype": "bfloat16"}) == (">= 1.1x", "met")
