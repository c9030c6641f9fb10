"""The correctness gate: a variant against the float64 reference on fresh inputs.

Each check case builds a fresh model (default init or randomized parameters), draws an
input from one distribution, and compares the variant's output, and the state it leaves
(BatchNorm running statistics), with a float64 copy of the reference. An output must first
be what the reference returns (``check_contract``: its shape, dtype and device, contiguous),
then finite where the reference is, fully written (outputs are allocated over NaN-poisoned
memory on CUDA), within the problem's tolerance for the precision, and must not alias
an earlier output; the input must come back unmodified.

Ill-conditioned cases (softmax of logits in the hundreds) lose digits in any float32
computation. So each case also measures two floors, and a bound is never tighter than 4x either's
error: the reference model itself run at the checked precision (plain PyTorch's error), and the
float64 reference at inputs and parameters perturbed by float32's unit roundoff (how far the
inputs' own last bit moves the answer; ``perturbed_reference``). One error of plain PyTorch can
land lucky: 22's x-gradient at batch 1 on large inputs (K = 40) has a logit of 228 scaled by 4
inside exp, so one float32 ulp of it or of z moves the answer 5e-5 relative; eager's errors
cancelled to 2.0e-5, and every split tensor-core path, within 1.2 ulp of y, measured 1.0e-4.
On well-conditioned inputs both floors are far below the tolerance, which then decides.
"""

from __future__ import annotations

import collections
import concurrent.futures
import copy
import dataclasses
import itertools
from collections.abc import Mapping

import torch
from torch import nn

from autofuse.core.precision import dtype_name, math_mode
from autofuse.core.problem import Problem, Tolerance
from autofuse.core.variant import Variant
from autofuse.serve.graphs import same_values
from autofuse.tuning import timeline

FLOOR_FACTOR = 4.0
# The relative size of ``perturbed_reference``'s perturbation: float32's unit roundoff. Its floor
# is measured where float32 arithmetic sets the floor (fp32, ieee): under tf32 and bf16 plain
# PyTorch's own error is thousands of times the perturbation's.
PERTURBATION = 2.0 ** -24
PERTURBED_PRECISIONS = ("fp32", "ieee")


@dataclasses.dataclass(frozen=True)
class CheckCase:
    shape: Mapping[str, int]
    distribution: str
    seed: int
    randomize: bool

    def describe(self) -> str:
        params = "randomized" if self.randomize else "default-init"
        return f"{','.join(f'{k}={v}' for k, v in self.shape.items())} {self.distribution} {params} seed={self.seed}"


@dataclasses.dataclass
class CheckResult:
    ok: bool
    error: float  # worst relative L2 error over the cases
    reason: str | None = None


def check_cases(problem: Problem, shape: Mapping[str, int], seed: int, odd: bool = True) -> list[CheckCase]:
    """The tuned shape under every distribution (default and randomized parameters) plus, with
    ``odd``, an odd small shape. "wide" randomizes W too: its rows are wide where x's columns are
    zero; its gradients are checked on a cotangent zero where outliers would hide the backward's
    losses (``Problem.quiet_wide_cotangent``)."""
    cases = [
        CheckCase(dict(shape), "rand", seed, randomize=False),
        CheckCase(dict(shape), "randn", seed + 1, randomize=True),
        CheckCase(dict(shape), "large", seed + 2, randomize=True),
    ]
    small = problem.odd_shape(shape) if odd else None
    cases = cases if small is None else cases + [CheckCase(small, "randn", seed + 3, randomize=True)]
    return cases + [CheckCase(dict(shape), "wide", seed + 4, randomize=True)]


# Pristine models of recent cases, by what draws them (``_model_key``), with the generators' states
# after the draw. A batch class's cases differ from the tuned shape's in the batch alone, and the
# weights do not depend on it: drawing an 8192² weight took 0.2-0.5 s on the CPU of an H100 host,
# half of a key's batch classes (87 of 175 s for 99 at fp32, its rungs profiled in-process). A hit
# deep-copies the model and restores the states, so the case is the one a miss would build, bit
# for bit (tests/test_gate_cases.py). Each holds its tensors' ``_fingerprint`` too: a candidate
# that writes memory it does not own can write into a kept model (``damaged_models``).
_MODELS: collections.OrderedDict = collections.OrderedDict()
MODELS_KEPT = 6
# Randomized cases' models being redrawn on the drawing threads (``draw_ahead``), by ``_model_key``,
# and the gradient check's cotangents (``_cotangents_ahead``), by (seed, shape).
_DRAWING: dict[tuple, concurrent.futures.Future] = {}
_COTANGENTS: dict[tuple, concurrent.futures.Future] = {}
_INPUTS: dict[tuple, concurrent.futures.Future] = {}  # inputs drawn ahead, by (``_model_key``, shape)
_drawer: list[concurrent.futures.ThreadPoolExecutor] = []
DRAW_THREADS = 4



def tuner_cases(problem: Problem, cls: type[Variant], params: Mapping, shape: Mapping[str, int],
                seed: int) -> list[CheckCase]:
    """The cases a tune gates configuration ``params`` of ``cls`` on: ``check_cases``, less the odd
    small shape where the configuration compiles per shape (``Variant.compiles_per_shape``)."""
    return check_cases(problem, shape, seed, odd=not cls.compiles_per_shape(params))

def _draw(fn, *args) -> concurrent.futures.Future:
    """``fn(*args)`` on a drawing thread: CPU draws from their own generators (torch releases the
    GIL while it draws), so the caller compiles, times or checks meanwhile."""
    if not _drawer:
        _drawer.append(concurrent.futures.ThreadPoolExecutor(DRAW_THREADS, thread_name_prefix="autofuse-draw"))
    return _drawer[0].submit(fn, *args)


def build_case(problem: Problem, case: CheckCase, device, dtype, mode: str) -> tuple[nn.Module, torch.Tensor]:
    """The model and input of a case, identical for every variant checked on it."""
    generator = torch.Generator().manual_seed(case.seed)
    args, kwargs = problem.check_init_args(case.shape, case.distribution)
    key = _model_key(problem, args, kwargs, case, device, dtype, mode)
    held = _MODELS.get(key) if key is not None else None
    drawn = _DRAWING.pop(key, None) if key is not None and held is None else None
    if held is not None:
        _MODELS.move_to_end(key)
        pristine, generator_state, global_state, _ = held
        model = copy.deepcopy(pristine)
        generator.set_state(generator_state)
        torch.set_rng_state(global_state)
    else:
        if drawn is not None:  # drawn ahead: the same draws, made on ``draw_ahead``'s thread
            model, generator_state, global_state = drawn.result()
            generator.set_state(generator_state)
            torch.set_rng_state(global_state)
        else:
            torch.manual_seed(case.seed)  # default init draws from the global generator
            model = problem.model(*args, **kwargs)
            if case.randomize:
                problem.randomize_parameters(model, generator, case.distribution)
        model.train(mode != "eval")
        model = model.to(device=device, dtype=dtype)
        if key is not None:
            _MODELS[key] = (copy.deepcopy(model), generator.get_state(), torch.get_rng_state(), _fingerprint(model))
            while len(_MODELS) > MODELS_KEPT:
                _MODELS.popitem(last=False)
    drawn_x = _INPUTS.pop((key, _shape(case)), None) if key is not None else None
    if drawn_x is not None:  # drawn ahead from the same generator state, on the CPU as make_input draws
        return model, drawn_x.result().to(device=device, dtype=dtype)
    x = problem.make_input(case.shape, case.distribution, generator, device=device, dtype=dtype)
    return model, x


def damaged_models() -> list[str]:
    """The kept models (``_MODELS``) whose tensors changed since they were drawn, described, and
    forgotten (the next case draws them again). Nothing but a write into memory its writer does
    not own changes one: a CUDA graph re-pointed past its output wrote over three, on an H200,
    and every later candidate failed the gate ("parameter matmul.bias was modified")."""
    damaged = [key for key, held in _MODELS.items() if not same_values(_fingerprint(held[0]), held[3])]
    for key in damaged:
        del _MODELS[key]
    return [f"the kept model of the {key[4]} seed={key[5]} cases" for key in damaged]


def damaged_cases(cache: dict) -> list[str]:
    """``damaged_models`` for the prepared cases of ``check_variant``'s ``cache`` (their model,
    input, reference and floor), forgetting those that changed."""
    damaged = [key for key, prepared in cache.items() if prepared.fingerprint is not None
               and not same_values(_case_fingerprint(prepared), prepared.fingerprint)]
    return [f"the prepared case {cache.pop(key).case.describe()}" for key in damaged]


def _fingerprint(model: nn.Module, *more: torch.Tensor) -> torch.Tensor:
    """Each floating tensor's float64 sum and 2-norm (the model's, then ``more``), on the CPU:
    one transfer."""
    with torch.no_grad():
        sums = [torch.stack((t.sum(dtype=torch.float64), torch.linalg.vector_norm(t, dtype=torch.float64)))
                for t in itertools.chain(model.parameters(), model.buffers(), more) if t.is_floating_point()]
    return torch.stack(sums).cpu() if sums else torch.empty(0, 2, dtype=torch.float64)


def _case_fingerprint(prepared: PreparedCase) -> torch.Tensor:
    return _fingerprint(prepared.model, prepared.x, prepared.ref, prepared.floor)


def _shape(case: CheckCase) -> tuple:
    return tuple(sorted(case.shape.items()))


def draw_ahead(problem: Problem, cases: list[CheckCase], device, dtype, mode: str) -> None:
    """Start redrawing the randomized parameters of ``cases`` on the drawing threads, for
    ``build_case`` to take (bit for bit the draws it would make itself), so the worker compiles
    and times a job's first candidate meanwhile: the redraws took 7-9 s of kb2-99's first
    candidate (three 8192² weights, torch.randn in float64 on the CPU, 2.2-3 s each, H200 host).
    Each model is built here, since default init draws from the global generator, which this
    restores afterwards; the threads draw from the case's own generator only (the contract of
    ``Problem.randomize_parameters`` and ``Problem.make_input``: they draw from the one given).

    Where a case's model is drawn already (a batch class's: ``_MODELS``), or drawn from no
    generator of the case's (default init), its input is drawn ahead instead, from the state the
    case's generator would have: gemm_bn's gate at 32768 rows spent 10.9 s preparing cases, most
    of it drawing 134M-element inputs on the CPU."""
    state, models, inputs = torch.get_rng_state(), set(), set()
    try:
        for case in cases:
            args, kwargs = problem.check_init_args(case.shape, case.distribution)
            key = _model_key(problem, args, kwargs, case, device, dtype, mode)
            if key is None:
                continue
            if key in _DRAWING:
                models.add(key)
                continue
            if key in _MODELS or not case.randomize:
                inputs.add((key, _shape(case)))
                if (key, _shape(case)) not in _INPUTS:
                    generator = torch.Generator().manual_seed(case.seed)
                    if key in _MODELS:
                        generator.set_state(_MODELS[key][1])
                    _INPUTS[(key, _shape(case))] = _draw(problem.make_input, case.shape, case.distribution, generator)
                continue
            models.add(key)
            torch.default_generator.manual_seed(case.seed)  # as ``build_case``'s torch.manual_seed, CPU's part
            model = problem.model(*args, **kwargs)
            _DRAWING[key] = _draw(_redraw, problem, model, torch.Generator().manual_seed(case.seed),
                                  case.distribution, torch.get_rng_state())
    finally:
        torch.set_rng_state(state)
    # What an earlier job drew and never gated (1 GB a model at 8192², 512 MB an input at gemm_bn's 2B).
    _drop_unwanted(_DRAWING, models)
    _drop_unwanted(_INPUTS, inputs)


def _drop_unwanted(drawing: dict[tuple, concurrent.futures.Future], wanted: set) -> None:
    """Forget the draws in ``drawing`` not ``wanted`` (cancelled if not started yet)."""
    for stale in drawing.keys() - wanted:
        drawing.pop(stale).cancel()


def _redraw(problem: Problem, model: nn.Module, generator: torch.Generator, distribution: str,
            global_state: torch.Tensor) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    problem.randomize_parameters(model, generator, distribution)
    return model, generator.get_state(), global_state


def _model_key(problem, args, kwargs, case, device, dtype, mode) -> tuple | None:
    """What a case's model is drawn from (the init arguments, not the batch), or None where that
    cannot be a key (an unhashable init argument)."""
    key = (problem.name, id(type(problem)), args, tuple(sorted(kwargs.items())), case.distribution, case.seed,
           case.randomize, str(torch.device(device)), dtype, mode)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def floor_output(model: nn.Module, x: torch.Tensor, precision: str) -> torch.Tensor:
    """The reference model run at ``precision`` on a copy: what plain PyTorch achieves."""
    return floor_run(model, x, precision)[0]


def floor_run(model: nn.Module, x: torch.Tensor, precision: str) -> tuple[torch.Tensor, nn.Module]:
    """``floor_output`` and the copy it ran, whose running statistics are plain PyTorch's too."""
    from autofuse.core.variant import EagerVariant

    floor_model = copy.deepcopy(model)
    with torch.no_grad():
        return EagerVariant(precision)(floor_model, x), floor_model


def poison_allocator(device: torch.device, nbytes: int) -> None:
    """Fill freed CUDA cache memory with NaN so an output element nobody writes reads NaN."""
    if device.type != "cuda":
        return
    block = torch.empty(max(nbytes, 1) // 4 + 1024, dtype=torch.float32, device=device)
    block.fill_(float("nan"))
    del block


def check_contract(out, expected: torch.Tensor) -> str | None:
    """Why ``out`` cannot stand in for ``expected`` (the reference's output at the checked dtype
    and device), or None. A drop-in module returns what the reference returns: the same shape,
    dtype and device, and a contiguous (dense, row-major) tensor, as every reference here
    returns. Right values as float64 would turn the caller's next ops float64; in transposed
    storage they make the caller's ``.view()`` raise and a kernel that reads ``data_ptr()`` row
    by row read columns. Where a reference's own output is not contiguous, its strides are the
    contract instead."""
    if not isinstance(out, torch.Tensor):
        return f"returned {type(out).__name__}, not a tensor"
    for what, got, want in (("shape", tuple(out.shape), tuple(expected.shape)),
                            ("dtype", dtype_name(out.dtype), dtype_name(expected.dtype)),
                            ("device", str(out.device), str(expected.device))):
        if got != want:
            return f"the output's {what} must be the reference's {want}, got {got}"
    if expected.is_contiguous() and not out.is_contiguous():
        return f"the output must be contiguous as the reference's is (strides {expected.stride()}), got strides {out.stride()}"
    if not expected.is_contiguous() and out.stride() != expected.stride():
        return f"the output's strides must be the reference's {expected.stride()}, got {out.stride()}"
    return None


def compare(out, ref: torch.Tensor, floor: torch.Tensor | None, tol: Tolerance,
            perturbed: torch.Tensor | None = None) -> tuple[float, str | None]:
    """(relative L2 error, reason it fails or None). The bounds are the tolerance's, or FLOOR_FACTOR
    times the error of ``floor`` (plain PyTorch's output) or of ``perturbed`` (the reference at
    perturbed inputs) where larger."""
    if not isinstance(out, torch.Tensor):
        return float("inf"), f"returned {type(out).__name__}, not a tensor"
    if tuple(out.shape) != tuple(ref.shape):
        return float("inf"), f"shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    got = out.detach().to(device=ref.device, dtype=torch.float64)
    finite = torch.isfinite(ref)
    bad_nonfinite = ~torch.isfinite(got) & finite
    if bad_nonfinite.any():
        return float("inf"), f"{int(bad_nonfinite.sum())} NaN/inf elements where the reference is finite{_first(bad_nonfinite, got, ref)}"
    diff = (got - ref).where(finite, torch.zeros_like(got))
    ref_norm = ref.where(finite, torch.zeros_like(ref)).norm().item()
    error = diff.norm().item() / ref_norm if ref_norm > 0 else diff.norm().item()
    rel_bound, atol = tol.rel_l2, tol.atol
    for other in (floor, perturbed):
        if other is not None and other.numel():
            # Where the other result is not finite but the reference is, it widens nothing: a
            # floor that overflowed must not lift the bound to infinity.
            other = other.detach().to(ref.device, torch.float64)
            other_diff = (other - ref).where(finite & torch.isfinite(other), torch.zeros_like(ref))
            other_norm = other_diff.norm().item()
            rel_bound = max(rel_bound, FLOOR_FACTOR * (other_norm / ref_norm if ref_norm > 0 else other_norm))
            atol = max(atol, FLOOR_FACTOR * other_diff.abs().max().item())
    if not error <= rel_bound:
        return error, f"relative L2 error {error:.3g} > {rel_bound:.3g}"
    outside = diff.abs() > atol + tol.rtol * ref.abs()
    if outside.any():
        return error, f"{int(outside.sum())}/{outside.numel()} elements off by more than atol={atol:.3g} + rtol={tol.rtol:g}·|ref|{_first(outside, got, ref)}"
    return error, None


def _first(mask: torch.Tensor, got: torch.Tensor, ref: torch.Tensor, count: int = 3) -> str:
    idx = mask.nonzero()[:count]
    shown = ", ".join(f"{tuple(i.tolist())}: got {got[tuple(i)].item():.6g} expected {ref[tuple(i)].item():.6g}" for i in idx)
    return f"; first: {shown}"


@dataclasses.dataclass
class PreparedCase:
    """A case's pristine model and input with their float64 reference and floor, computed once.

    Tuning checks many candidates on the same cases, so these are cached (``cache=`` below):
    each run gets a deep copy of the pristine model, never the original.
    """

    case: CheckCase
    model: nn.Module
    x: torch.Tensor
    ref: torch.Tensor
    ref_model: nn.Module
    floor: torch.Tensor
    # The float64 reference at perturbed inputs and parameters (``perturbed_reference``).
    perturbed: torch.Tensor | None = None
    # The floor's running statistics (``Problem.state_to_compare``): a bfloat16 model's own
    # arithmetic puts them ~13% from float64 at batch 2 on large inputs (var of two close values).
    floor_state: dict = dataclasses.field(default_factory=dict)
    # Per (precision, mode): the cotangent and the float64 and floor gradients (``check_gradients``),
    # the same for every candidate checked on the case.
    gradients: dict = dataclasses.field(default_factory=dict)
    fingerprint: torch.Tensor | None = None  # of what the candidates must not change (``damaged_cases``)


def prepare_case(problem: Problem, case: CheckCase, device, dtype, mode: str, precision: str) -> PreparedCase:
    model, x = build_case(problem, case, device, dtype, mode)
    ref, ref_model = problem.reference(model, x)
    floor, floor_model = floor_run(model, x, precision)
    perturbed = None
    if precision in PERTURBED_PRECISIONS:
        with torch.no_grad():
            perturbed_model, perturbed_x = perturbed_reference(problem, model, x, case.seed)
            perturbed = perturbed_model(perturbed_x)
    prepared = PreparedCase(case, model, x, ref, ref_model, floor, perturbed, problem.state_to_compare(floor_model))
    prepared.fingerprint = _case_fingerprint(prepared)
    return prepared


def perturbed_reference(problem: Problem, model: nn.Module, x: torch.Tensor, seed: int) -> tuple[nn.Module, torch.Tensor]:
    """A float64 copy of ``model`` and of ``x`` with every floating tensor (parameters, buffers,
    input) multiplied element-wise by 1 + u·2⁻²⁴, u uniform in [−1, 1], drawn on their device.

    The reference at these inputs is as far from the reference at the exact ones as the inputs'
    float32 rounding alone can move the answer: a float32 computation backward-stable to a few
    roundings of its inputs lands within a few times that, however the case is conditioned."""
    generator = torch.Generator(x.device).manual_seed(seed + 13)

    def perturb(t: torch.Tensor) -> torch.Tensor:
        noise = torch.rand(t.shape, generator=generator, device=t.device, dtype=torch.float64)
        return t * (1.0 + (2.0 * noise - 1.0) * PERTURBATION)

    ref_model = problem.reference_model(model)
    with torch.no_grad():
        for t in itertools.chain(ref_model.parameters(), ref_model.buffers()):
            if t.is_floating_point():
                t.copy_(perturb(t))
    return ref_model, perturb(x.detach().to(torch.float64))


def check_variant(variant: Variant, problem: Problem, cases: list[CheckCase], device, *,
                  dtype=torch.float32, mode: str = "train", autograd: bool = False,
                  cache: dict | None = None) -> CheckResult:
    """Run ``variant`` on every case; the first failure ends the check.

    With ``autograd`` (a candidate for an autograd entry) every call runs with gradients on, the
    input requiring grad, and the gradients are checked too: that entry serves grad-mode calls
    alone (a key's grad-mode calls that no backward follows switch to the inference entry, run
    under no_grad: ``autofuse.serve.grad_mode``), and its no-grad path is gated where it serves,
    in the inference entry's race. Checked without gradients as well, it compiled that path again
    for nothing where a variant compiles per graph (``compiled``: gemm_bn training's bfloat16-model
    batch classes spent 10.1 s in the gate on an H100, 4.0 s since)."""
    device = torch.device(device)
    tol = problem.tolerance(variant.precision)
    cache = {} if cache is None else cache
    worst = 0.0
    for i, case in enumerate(cases):
        batch = case.shape.get(problem.batch_dim, problem.min_train_batch)
        if mode == "train" and problem.mode_sensitive and batch < problem.min_train_batch:
            continue
        if not runs_at(type(variant), variant.params, case.shape, device.type):
            continue  # a configuration made for other sizes (a row held in registers) is not run here
        key = _case_key(problem, case, device, dtype, mode, variant.precision)
        if key not in cache:
            with timeline.span(lambda: f"  gate: prepare case {case.describe()}"):
                cache[key] = prepare_case(problem, case, device, dtype, mode, variant.precision)
        if autograd and i == 0:
            _cotangents_ahead(problem, cases, cache[key].ref.shape, device, dtype, mode, variant.precision, cache)
        with timeline.span(lambda: f"  gate: check {variant.name} on {case.describe()}"):
            error, reason = _check_case(variant, problem, cache[key], tol, check_update=(i == 0), grad=autograd)
        if reason is None and autograd and problem.gradient_check_applies(case, mode, variant.precision):
            # Gradient errors are not folded into the reported error: some reference gradients
            # are exactly zero (the bias under training-mode BN), where a ratio means nothing.
            with timeline.span(lambda: f"  gate: gradients of {variant.name} on {case.describe()}"):
                _, reason = check_gradients(variant, problem, cache[key], mode)
        worst = max(worst, error)
        if reason is not None:
            return CheckResult(False, error, f"{reason} [case {case.describe()}]")
    return CheckResult(True, worst)


def _case_key(problem: Problem, case: CheckCase, device, dtype, mode: str, precision: str) -> tuple:
    """A prepared case's key in ``check_variant``'s cache."""
    return problem.name, case.describe(), str(torch.device(device)), dtype, mode, precision


def runs_at(cls, params: Mapping, shape: Mapping[str, int], device_type: str) -> bool:
    """Whether the gate runs configuration ``params`` of variant class ``cls`` on a case of ``shape``:
    one made for other sizes is not run there."""
    return params in cls.configs(shape, device_type)


def _check_case(variant, problem, prepared: PreparedCase, tol, check_update, grad: bool = False) -> tuple[float, str | None]:
    """The case's call (with gradients on and the input requiring grad where ``grad``): its output,
    what it must leave untouched and, with ``check_update``, a second call and one after an update."""
    model, x = copy.deepcopy(prepared.model), prepared.x.clone().requires_grad_(grad)  # a clone: a leaf
    params_before = {n: p.detach().clone() for n, p in model.named_parameters()}
    poison_allocator(x.device, prepared.ref.numel() * 4 * 2)
    with torch.set_grad_enabled(grad):
        out = variant(model, x)
    if grad and not (isinstance(out, torch.Tensor) and out.requires_grad):
        return float("inf"), "the output does not require grad: autograd cannot reach the inputs"
    out = out.detach() if isinstance(out, torch.Tensor) else out
    reason = check_contract(out, prepared.floor)
    error, reason = (float("inf"), reason) if reason else compare(out, prepared.ref, prepared.floor, tol, prepared.perturbed)
    if reason is not None:
        return error, f"output with gradients on: {reason}" if grad else reason
    reason = _check_side_effects(problem, model, prepared, x.detach(), params_before, tol)
    if reason is None and check_update:
        reason = _check_no_alias(variant, model, x, out, grad) or _check_after_update(variant, problem, model, x, tol, grad)
    return error, reason if reason is None or not grad else f"with gradients on: {reason}"


def _check_side_effects(problem, model, prepared: PreparedCase, x, params_before, tol) -> str | None:
    """Input and parameters untouched; running statistics within the tolerance of float64's, or
    of FLOOR_FACTOR times plain PyTorch's error at the precision, as outputs are."""
    ref_model, x_before = prepared.ref_model, prepared.x
    if not torch.equal(x, x_before):
        return "the input was modified"
    for name, param in model.named_parameters():
        before = params_before[name]
        if not torch.equal(param.detach(), before):
            if before.is_floating_point() and before.isnan().any():  # NaN equals nothing, itself included
                return (f"parameter {name} held NaN before the call: the case is broken, not the candidate "
                        "(no distribution draws NaN)")
            return f"parameter {name} was modified"
    expected = problem.state_to_compare(ref_model)
    for name, buf in problem.state_to_compare(model).items():
        want = expected[name]
        if not buf.is_floating_point():
            if not torch.equal(buf.cpu(), want.cpu().to(buf.dtype)):
                return f"buffer {name} is {buf.tolist()}, expected {want.tolist()}"
            continue
        _, reason = compare(buf, want, prepared.floor_state.get(name), tol)
        if reason is not None:
            return f"buffer {name} (running statistic) wrong: {reason}"
    return None


def _check_after_update(variant, problem, model, x, tol, grad: bool = False) -> str | None:
    """After an in-place parameter update (an optimizer step), the output must follow it:
    weights a variant folded and cached must be recomputed."""
    generators = {}  # drawn where the parameter lives: an 8192² draw took 0.3 s on an H100 host's CPU
    with torch.no_grad():
        for param in model.parameters():
            generator = generators.get(param.device) or generators.setdefault(
                param.device, torch.Generator(param.device).manual_seed(0))
            noise = torch.randn(param.shape, generator=generator, device=param.device).to(param.dtype)
            spread = param.detach().float().std() if param.numel() > 1 else torch.ones(())
            param.add_(noise * (spread.nan_to_num(1.0) + 0.1).to(param.device, param.dtype))
    ref, _ = problem.reference(model, x.detach())
    floor = floor_output(model, x.detach(), variant.precision)
    with torch.set_grad_enabled(grad):
        out = variant(model, x)
    out = out.detach() if isinstance(out, torch.Tensor) else out
    reason = check_contract(out, floor) or compare(out, ref, floor, tol)[1]
    return None if reason is None else f"after an in-place parameter update: {reason}"


def _check_no_alias(variant, model, x, out, grad: bool = False) -> str | None:
    """A second call must not write into, or return, the first call's output."""
    first = out.detach().clone()
    with torch.set_grad_enabled(grad):
        again = variant(copy.deepcopy(model), x)
    if isinstance(again, torch.Tensor) and again.data_ptr() == out.data_ptr():
        return "a second call returned the same storage as the first (outputs alias)"
    if not torch.equal(out, first):
        return "a second call overwrote the first call's output"
    return None


def check_gradients(variant: Variant, problem: Problem, prepared: PreparedCase, mode: str) -> tuple[float, str | None]:
    """Gradients of a random cotangent w.r.t. the input and every parameter, against float64,
    with the floors of the outputs' check (``compare``): plain PyTorch's gradients at the
    precision and the float64 ones at perturbed inputs. The output of a call with gradients on
    is checked before (``_check_case`` under ``check_variant(autograd=True)``): a variant's path
    with gradients (saving what its backward needs) is other code than its no-grad one, and the
    gradients need not reveal a wrong output."""
    tol = problem.tolerance(variant.precision)
    held = prepared.gradients.get((variant.precision, mode))
    cotangent = held[0] if held is not None else _cotangent(problem, prepared, variant.precision)

    def grads(run, model, x, dtype):
        # The backward under the precision's math mode too, as a user training at that precision
        # runs it: eager's floor at tf32 is then a TF32 backward, not an fp32 one.
        with math_mode(variant.precision):
            x = x.detach().to(dtype).requires_grad_(True)
            out = run(model, x)
            if not isinstance(out, torch.Tensor) or not out.requires_grad:
                return None
            out.backward(cotangent.to(out.dtype))
        return {"input": x.grad, **{n: p.grad for n, p in model.named_parameters()}}

    from autofuse.core.variant import EagerVariant

    def reference(m, x):
        return m(x)

    got = grads(variant, copy.deepcopy(prepared.model), prepared.x, prepared.x.dtype)
    if got is None:
        return float("inf"), "the output does not require grad: autograd cannot reach the inputs"
    if held is None:  # the float64 and floor backwards, once per case: a tune checks many candidates on it
        x = prepared.x
        held = (cotangent, grads(reference, problem.reference_model(prepared.model), x, torch.float64),
                grads(EagerVariant(variant.precision), copy.deepcopy(prepared.model), x, x.dtype),
                grads(reference, *perturbed_reference(problem, prepared.model, x, prepared.case.seed), torch.float64)
                if variant.precision in PERTURBED_PRECISIONS else None)
        prepared.gradients[(variant.precision, mode)] = held
    _, want, floor, perturbed = held
    worst = 0.0
    invariant = problem.invariant_parameters(mode)
    for name, expected in want.items():
        if got[name] is None and expected is not None:  # an optimizer would skip it, weight decay too
            return worst, f"gradient of {name} is None where PyTorch's is a tensor"
        expected = torch.zeros_like(prepared.x, dtype=torch.float64) if expected is None else expected
        actual = got[name] if got[name] is not None else torch.zeros_like(expected)
        if name in invariant:
            if not torch.isfinite(actual).all():
                return worst, f"gradient of {name} is not finite"
            continue
        error, reason = compare(actual, expected, floor[name] if floor[name] is not None else torch.zeros_like(expected),
                                tol, perturbed[name] if perturbed is not None else None)
        worst = max(worst, error)
        if reason is not None:
            return worst, f"gradient of {name}: {reason}"
    return worst, None


def _cotangents_ahead(problem: Problem, cases: list[CheckCase], out_shape, device, dtype, mode: str,
                      precision: str, cache: dict) -> None:
    """Start drawing, in parallel, the cotangents the gradient check will need on every case of
    the first case's shape (its outputs are ``out_shape``) whose gradients are not held yet: each
    is a float64 torch.randn on the CPU, 134M normals at gemm_bn's batch class of 32768 rows, 5-6
    s a case one after another (H200 host: 22 of the 38 s that rung's gate took)."""
    wanted = set()
    for case in cases:
        held = cache.get(_case_key(problem, case, device, dtype, mode, precision))
        if (case.shape == cases[0].shape and problem.gradient_check_applies(case, mode, precision)
                and (held is None or (precision, mode) not in held.gradients)):
            wanted.add(_cotangent_key(case, out_shape))
    _drop_unwanted(_COTANGENTS, wanted)  # a gate that stopped early left them: 1 GB each at that rung
    for key in wanted - _COTANGENTS.keys():
        _COTANGENTS[key] = _draw(_raw_cotangent, *key)


def _cotangent_key(case: CheckCase, out_shape) -> tuple[int, tuple]:
    """The seed and shape a case's cotangent is drawn with."""
    return case.seed + 7, tuple(out_shape)


def _raw_cotangent(seed: int, shape: tuple) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _cotangent(problem: Problem, prepared: PreparedCase, precision: str) -> torch.Tensor:
    """The case's random cotangent (drawn ahead where ``_cotangents_ahead`` started it), zero on rows
    at a kink and, on the wide case, where outliers would hide the backward's losses; in float64,
    holding values of the model's dtype.

    A candidate receives the cotangent in its output's dtype, so the float64 reference takes those
    very values: it judges the backward, not the rounding of its input. A bfloat16 model's 51 put
    single_pass 1.53% from a reference fed the unrounded cotangent (tolerance 1.5%), where the
    gradient of subtract, −Σ dr / out_features, cancels ~200-fold over 4096 rows; the exact result
    for the rounded cotangent was 0.12% from single_pass's (randn, randomized, seed 2; H100 and the
    CPU alike)."""
    key = _cotangent_key(prepared.case, prepared.ref.shape)
    drawn = _COTANGENTS.pop(key, None)
    raw = drawn.result() if drawn is not None else _raw_cotangent(*key)
    cotangent = raw.to(prepared.x.device)
    kinked = problem.rows_on_a_kink(prepared.model, prepared.x, precision)
    if kinked is not None:
        cotangent[kinked.to(cotangent.device)] = 0.0  # their gradient is either side's (``rows_on_a_kink``)
    if prepared.case.distribution == "wide":  # the backward's split columns: see ``quiet_wide_cotangent``
        problem.quiet_wide_cotangent(cotangent)
    return cotangent.to(prepared.x.dtype).to(cotangent.dtype)
