"""On the GPU: small-batch calls replayed as CUDA graphs (``autofuse.serve.graphs``) return what
the plain call returns, bit for bit, a fresh tensor each call, and follow every change of the model.

Each case writes a table entry at an odd small shape (batch 5, 1000 → 777: no tile divides it)
for one capturable variant, so ``get_module``'s module binds the key to a ``GraphedCall``; the
plain call is that call's variant, run directly on the same model."""

import pytest
import torch
from helpers import kernelbench_model, module_for, record, sizes

from autofuse.core import registry
from autofuse.serve import graphs, repoint

pytestmark = pytest.mark.gpu

BATCH, N_IN, N_OUT = 5, 1000, 777
CASES = [  # problem, variant, precision, mode, dtype
    ("matmul_gelu_softmax", "triton", "fp32", "any", "float32"),
    ("matmul_gelu_softmax", "triton", "bf16", "any", "float32"),
    ("matmul_gelu_softmax", "triton", "bf16", "any", "bfloat16"),
    ("matmul_clamp_lse_mish", "triton", "tf32", "any", "float32"),
    ("gemm_bn", "triton", "fp32", "eval", "float32"),
    ("gemm_bn", "cublas_epilogue", "bf16", "eval", "float32"),
    ("gemm_avgpool_gelu_residual", "single_pass", "fp32", "any", "float32"),
    ("matmul_gelu_softmax", "simplified", "tf32", "any", "float32"),
    ("matmul_gelu_softmax", "eager", "bf16", "any", "float32"),  # the reference under autocast
    ("gemm_bn", "eager", "bf16", "eval", "bfloat16"),
]
TRAINING = [  # gemm_bn in training mode: the replay writes the running statistics
    ("gemm_bn", "triton", "fp32", "train", "float32"),
    ("gemm_bn", "triton", "bf16", "train", "bfloat16"),
    ("gemm_bn", "cublas_epilogue", "bf16", "train", "float32"),
    ("gemm_bn", "cublas_epilogue", "bf16", "train", "bfloat16"),
    ("gemm_bn", "cuda_tiled", "fp32", "train", "float32"),
    ("gemm_bn", "simplified", "tf32", "train", "float32"),
]
CASES += TRAINING
STATS = ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked")


def _served(problem, variant, precision, mode, dtype, batch=BATCH):
    """(the module, its graphed call) with ``variant``'s first configuration tabled at the shape."""
    cls = registry.get_variant(problem, variant)
    params = cls.configs_for(sizes(problem, batch, N_IN, N_OUT), "cuda", precision)[0]
    record(problem, batch, N_IN, N_OUT, mode=mode, variant=variant, params=params, precision=precision,
           dtype=dtype, device="cuda")
    model = kernelbench_model(problem, batch, N_IN, N_OUT, mode="train" if mode == "train" else "eval")
    module = module_for(problem, batch, N_IN, N_OUT, precision=precision)
    module.load_state_dict(model.state_dict())
    module = module.to("cuda", getattr(torch, dtype)).train(model.training)
    x = torch.randn(batch, N_IN, device="cuda", dtype=getattr(torch, dtype))
    with torch.no_grad():
        module(x)
        call = module._autofuse.ready[module._autofuse.call_key(module, x)]
    assert isinstance(call, graphs.GraphedCall) and call.name == variant, call
    return module, call


def _inputs(n, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(BATCH, N_IN, device="cuda", generator=g).mul(1 + i).to(dtype) for i in range(n)]


@pytest.mark.parametrize("problem,variant,precision,mode,dtype", CASES)
def test_a_replay_is_the_plain_call_bit_for_bit_and_each_output_is_the_callers(problem, variant, precision, mode, dtype):
    module, call = _served(problem, variant, precision, mode, dtype)
    xs = _inputs(6, getattr(torch, dtype))
    with torch.no_grad():
        outs = [module(x) for x in xs]  # replays from the WARM_CALLS-th on
        assert call.graph is not None and call.failed is None
        want = [call.call(module, x) for x in xs]  # after every replay: an earlier output kept its value
    for got, expected in zip(outs, want):
        assert got.dtype == expected.dtype and torch.equal(got, expected)
    assert len({out.data_ptr() for out in outs}) == len(outs)


@pytest.mark.parametrize("problem,variant,precision,mode,dtype", CASES[:1] + CASES[4:5] + TRAINING[:1])
def test_a_changed_parameter_buffer_or_attribute_is_what_the_next_call_reads(problem, variant, precision, mode, dtype):
    module, call = _served(problem, variant, precision, mode, dtype)
    x = _inputs(1, getattr(torch, dtype))[0]
    weight = next(module.parameters())
    changes = [lambda: weight.mul_(0.5), lambda: setattr(weight, "data", weight.detach() * 2.0),
               lambda: module.load_state_dict({k: v * 0.9 if v.is_floating_point() else v
                                               for k, v in module.state_dict().items()})]
    if problem == "gemm_bn" and mode == "eval":
        changes += [lambda: module.bn.running_var.mul_(3.0), lambda: setattr(module.bn, "eps", 0.5)]
    if mode == "train":
        changes += [lambda: setattr(module.bn, "eps", 0.5), lambda: module.bn.weight.mul_(2.0)]
    with torch.no_grad():
        for change in changes:
            for _ in range(graphs.WARM_CALLS + 1):
                module(x)
            assert call.graph is not None
            before = module(x)
            change()
            after = module(x)
            assert not torch.equal(after, before) and torch.equal(after, call.call(module, x))
            for _ in range(graphs.WARM_CALLS + 1):  # captured again, on the new state
                assert torch.equal(module(x), after)
            assert call.graph is not None


# Graphs of our own kernels (Triton's, the CUDA extension's) take their arguments flat: re-pointed.
REPOINTED = [case for case in CASES if case[1] in ("triton", "cuda_tiled", "single_pass")]


@pytest.mark.parametrize("problem,variant,precision,mode,dtype", [c for c in REPOINTED if c[3] != "train"])
def test_our_kernels_graphs_are_re_pointed_and_an_x_off_the_alignment_is_copied_in(problem, variant, precision, mode,
                                                                                   dtype):
    module, call = _served(problem, variant, precision, mode, dtype)
    xs = _inputs(4, getattr(torch, dtype))
    buffer = torch.empty(xs[0].numel() + 1024, device="cuda", dtype=xs[0].dtype)
    step = repoint.ALIGNMENT // buffer.element_size()
    inside = buffer[step:step + xs[0].numel()].view_as(xs[0])  # aligned, but not its storage's start
    off = buffer[8:8 + xs[0].numel()].view_as(xs[0])  # 16 or 32 bytes past an allocator block's start
    with torch.no_grad():
        for x in xs[:graphs.WARM_CALLS + 1]:
            module(x)
        assert call.graph is not None and call._repoint is not None and call._reads_x, call.failed
        for x in xs + xs[:1]:  # re-pointed, copied in, re-pointed again...
            want = call.call(module, x)
            assert torch.equal(module(x), want)
            for view in (inside, off):
                view.copy_(x)
                assert torch.equal(module(view), want)
        assert call._repoint is not None and call.failed is None


def _statistics(model):
    return [model.state_dict()[name].clone() for name in STATS]


@pytest.mark.parametrize("problem,variant,precision,mode,dtype", TRAINING)
def test_training_replays_write_the_statistics_as_plain_calls_do_and_eval_then_reads_them(problem, variant, precision,
                                                                                          mode, dtype):
    module, call = _served(problem, variant, precision, mode, dtype)
    twin = kernelbench_model(problem, BATCH, N_IN, N_OUT).to("cuda", getattr(torch, dtype))
    twin.load_state_dict(module.state_dict())  # after _served's first call: the two agree from here
    # The twin's own instance: the graph reads its variant's cached weight copies where they are,
    # and the graph's variant called on another model would replace (and free) them.
    plain = type(call.call)(precision, **call.call.params)
    plain.build("cuda")
    xs = _inputs(6, getattr(torch, dtype))
    with torch.no_grad():
        first_eval = call.call(module.eval(), xs[0])  # the variant's eval coefficients, cached
        module.train()
        for x in xs:
            got, want = module(x), plain(twin, x)  # the graph (from the WARM_CALLS-th), the variant plain
            assert torch.equal(got, want)
            for mine, theirs in zip(_statistics(module), _statistics(twin)):
                assert torch.equal(mine, theirs)  # one update per call, bit for bit
        assert call.graph is not None and call.failed is None
        # Eval reads the statistics the replays wrote (their versions moved), not the cached ones.
        got = call.call(module.eval(), xs[0])
        reference = kernelbench_model(problem, BATCH, N_IN, N_OUT).double().cuda()
        reference.load_state_dict(twin.state_dict())
        want = reference.eval()(xs[0].double())
    error = ((got.double() - want).norm() / want.norm()).item()
    moved = ((first_eval.double() - want).norm() / want.norm()).item()
    bound = registry.get_problem(problem).tolerance(precision).rel_l2
    assert moved > 10 * bound, "the statistics barely moved: this check could not fail"
    assert error < bound, (error, moved)


def test_momentum_none_reads_the_batch_count_on_the_host_so_training_stays_plain(caplog):
    module, call = _served(*TRAINING[0])
    module.bn.momentum = None
    twin = kernelbench_model("gemm_bn", BATCH, N_IN, N_OUT).cuda()
    twin.load_state_dict(module.state_dict())
    twin.bn.momentum = None
    plain = type(call.call)("fp32", **call.call.params)
    plain.build("cuda")
    with torch.no_grad():
        for x in _inputs(4, torch.float32):
            assert torch.equal(module(x), plain(twin, x))
            assert all(torch.equal(a, b) for a, b in zip(_statistics(module), _statistics(twin)))
    assert call.graph is None and call.failed is not None


def test_inference_mode_no_grad_other_layouts_streams_and_autocast_all_get_the_plain_answer():
    module, call = _served("matmul_gelu_softmax", "triton", "bf16", "any", "float32")
    x = _inputs(1, torch.float32)[0]
    with torch.no_grad():
        want = call.call(module, x)
    with torch.inference_mode():
        assert torch.equal(module(x), want) and torch.equal(module(x), want) and torch.equal(module(x), want)
        assert call.graph is not None
    with torch.no_grad():
        assert torch.equal(module(x), want)  # the graph captured in inference mode, replayed out of it
        strided = x.t().contiguous().t()  # the same values in column-major layout
        assert not strided.is_contiguous() and torch.equal(module(strided), want)
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            got = module(x)  # another stream: plain
        torch.cuda.current_stream().wait_stream(side)
        assert torch.equal(got, want)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            assert torch.equal(module(x), want)
    out = module(x.requires_grad_(True))  # grad mode: the autograd key, never a graph
    assert out.requires_grad


class Syncing:
    """A variant that claims to be capturable but reads a value on the host: CUDA invalidates its capture."""

    capturable, name = True, "syncing"

    def __call__(self, model, x):
        return x * float(x.abs().max())


class RaisingInCapture:
    """A variant whose call raises only while it is being captured."""

    capturable, name = True, "raising"

    def __call__(self, model, x):
        if torch.cuda.is_current_stream_capturing():
            raise ValueError("not under capture")
        return x * 3.0


class LaunchingNothing:
    """A variant whose call launches no kernel: a replay could not depend on x."""

    capturable, name = True, "nothing"

    def __init__(self):
        self.kept = torch.ones(BATCH, N_IN, device="cuda")

    def __call__(self, model, x):
        return self.kept


@pytest.mark.parametrize("variant", [Syncing, RaisingInCapture, LaunchingNothing])
def test_a_call_that_cannot_be_captured_runs_plain_and_leaves_cuda_usable(variant, caplog):
    module, _ = _served("matmul_gelu_softmax", "triton", "fp32", "any", "float32")
    plain = variant()
    call = graphs.GraphedCall(module._autofuse, plain, plain.name)
    x = _inputs(1, torch.float32)[0]
    with torch.no_grad():
        outs = [call(module, x) for _ in range(4)]
        assert call.failed is not None and call.graph is None
        assert all(torch.equal(out, plain(module, x)) for out in outs)
    # The failed capture left no stream capturing and the generator usable; a new graph captures.
    assert not torch.cuda.is_current_stream_capturing()
    torch.randn(8, device="cuda").sum().item()
    torch.cuda.synchronize()
    fresh = graphs.GraphedCall(module._autofuse, Capturable3(), "fresh")
    with torch.no_grad():
        for _ in range(graphs.WARM_CALLS + 1):
            assert torch.equal(fresh(module, x), x * 3.0)
    assert fresh.graph is not None and fresh.failed is None


def test_after_a_capture_cuda_invalidated_the_allocator_can_empty_its_cache():
    """torch's ``capture_end`` raises on an invalidated capture before it ends the allocator's routing
    to the capture's pool; the next ``empty_cache`` (a caller's, or the allocator's own when memory
    runs out) then aborted the process ("captures_underway.empty() INTERNAL ASSERT FAILED", H100,
    torch 2.11), as it aborted this file's run at a test that frees a MemPool. In a child process,
    so that the abort fails this test only."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import torch
        from autofuse.serve import graphs

        class Syncing:
            capturable, name = True, "syncing"

            def __call__(self, model, x):
                return x * float(x.abs().max())

        model, x = torch.nn.Linear(4, 4).cuda(), torch.randn(8, device="cuda")
        call = graphs.GraphedCall.standalone(Syncing(), model)
        with torch.no_grad():
            for _ in range(graphs.WARM_CALLS + 1):
                call(model, x)
        assert call.failed is not None and call.graph is None, call.failed
        torch.cuda.empty_cache()
        pool = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(pool):
            kept = torch.ones(1024, device="cuda")
        del kept, pool
        print("alive")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "alive" in done.stdout, (done.returncode, done.stderr[-3000:])


class Capturable3:
    capturable, name = True, "times3"

    def __call__(self, model, x):
        return x * 3.0


class ScratchFirst:
    """A (B, 1) output allocated, in the graph's pool, where the call's (B, N_IN) scratch was: it
    is freed first, and its block is the best fit. Its elementwise kernel takes plain pointers."""

    capturable, name = True, "scratch_first"

    def __call__(self, model, x):
        scratch = x * 2.0
        row = scratch.sum(1, keepdim=True)
        del scratch
        return row + 1.0


def _simplified_22(dtype):
    """22's ``simplified`` on a model of ``dtype``: its logsumexp's (B, N) scratch goes before its
    (B, 1) output (re-pointed, an H200 tune's kept models were written over, and at this shape
    under bf16 the replay's own output was wrong)."""
    problem = registry.get_problem("matmul_clamp_lse_mish")
    args, kwargs = problem.check_init_args({"batch_size": BATCH, "input_size": N_IN, "hidden_size": N_IN}, "randn")
    variant = registry.get_variant("matmul_clamp_lse_mish", "simplified")("bf16")
    variant.build("cuda")
    return variant, problem.model(*args, **kwargs).to("cuda", dtype)


@pytest.mark.parametrize("call", ["scratch_first", "simplified_22"])
def test_a_graph_whose_output_took_a_scratchs_addresses_writes_nothing_past_a_callers_output(call):
    """Re-pointed at the caller's output, the scratch's kernel wrote B×N_IN values from it on,
    over the allocator's next blocks. Here the caller's output is the first block of a pool's
    segment and the block after it is read back unwritten: it must still hold what was there."""
    dtype = torch.float32 if call == "scratch_first" else torch.bfloat16
    run, model = (ScratchFirst(), torch.nn.Linear(4, 4).cuda()) if call == "scratch_first" else _simplified_22(dtype)
    graphed, x = graphs.GraphedCall.standalone(run, model), _inputs(1, dtype)[0]
    with torch.no_grad():
        for _ in range(graphs.WARM_CALLS + 1):
            graphed(model, x)
        assert graphed.graph is not None and graphed.failed is None, graphed.failed
        pool = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(pool):
            filled = torch.full((2**17,), 7.0, device="cuda")  # 512 KB: a small-block segment of its own
            del filled
            out = graphed(model, x)
            after = torch.empty(2**17 - 512 // 4, device="cuda")  # the rest of what ``filled`` was
        try:
            assert out.data_ptr() + 512 == after.data_ptr()  # as laid out above, or the check means nothing
            assert torch.equal(out, run(model, x))
            assert bool((after == 7.0).all()), "a replay wrote past the caller's output"
        finally:
            del out, after  # the pool's blocks free before the pool goes
    assert graphed._repoint is None  # the guards showed it: x copied in, the output cloned


@pytest.mark.parametrize("problem,variant,precision,mode,dtype", [CASES[0], CASES[5]])
def test_at_the_largest_replayed_batch_a_replay_is_right_and_its_memory_counts(problem, variant, precision, mode, dtype,
                                                                              monkeypatch):
    """At ``MAX_BATCH - 1`` rows (odd: no tile divides it) the replay is the plain call bit for bit;
    the ledger holds its pool and input (more than its input alone); with that graph held, a
    budget below it leaves the next key plain without capturing it, and with the ledger empty,
    the next key's graph is captured, found larger than the budget and not kept: plain and right."""
    import gc

    from autofuse.serve import graph_memory

    monkeypatch.setattr(graph_memory, "LEDGER", graph_memory.Ledger())
    batch, dt = graphs.MAX_BATCH - 1, getattr(torch, dtype)
    module, call = _served(problem, variant, precision, mode, dtype, batch=batch)
    xs = [torch.randn(batch, N_IN, device="cuda", dtype=dt) * (1 + i) for i in range(4)]
    held = graph_memory.LEDGER.held(torch.device("cuda", torch.cuda.current_device()))
    with torch.no_grad():
        outs = [module(x) for x in xs]
        assert call.graph is not None and call.failed is None
        assert all(torch.equal(out, call.call(module, x)) for out, x in zip(outs, xs))
    mine = graph_memory.LEDGER.held(xs[0].device) - held
    assert mine > xs[0].untyped_storage().nbytes(), mine
    monkeypatch.setenv("AUTOFUSE_CUDA_GRAPH_MEMORY", str(mine / 2 / graph_memory.MIB))
    x = torch.randn(batch - 2, N_IN, device="cuda", dtype=dt)
    for held in (True, False):
        if not held:
            del module, call, outs
            gc.collect()
            assert graph_memory.LEDGER.held(x.device) == 0
        other, other_call = _served(problem, variant, precision, mode, dtype, batch=batch - 2)
        with torch.no_grad():
            for _ in range(graphs.WARM_CALLS + 2):
                assert torch.equal(other(x), other_call.call(other, x))
        assert other_call.graph is None
        assert (other_call.failed is None) if held else ("AUTOFUSE_CUDA_GRAPH_MEMORY" in other_call.failed)
