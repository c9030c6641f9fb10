"""``get_module``: a drop-in ``nn.Module`` that dispatches each call to the tuned variant.

The module is an instance of a subclass of the problem's reference model, so its
parameters, buffers, ``state_dict`` keys and attributes are exactly the reference's (a
KernelBench ``Model``'s state_dict loads into it). Per call, its ``CallKey`` (shape, dtype,
device, grad need, train/eval: ``autofuse.serve.dispatch``) is looked up in a dict of ready
callables: no file I/O, no compilation.
A new key is resolved once from the dispatch table (read once per module, and again when the
file changes: ``autofuse.serve.table_watch``): the entry tuned at the requested precision, else
one tuned at a stricter precision or the nearest batch size (``autofuse.serve.dispatch``), else
the reference, each said once. With tune-on-miss
(``autofuse.serve.tune_on_miss``) a miss also queues a background tune whose winner is swapped in.

Grad need is ``torch.is_grad_enabled() and (x.requires_grad or a parameter requires grad)``:
under ``no_grad()`` or ``inference_mode()`` the key is the no-grad one. A call in grad mode
gets the autograd entry (a variant whose forward saves what its backward needs) until
``grad_mode.SWITCH_AFTER`` calls in a row have had no backward; then the no-grad entry, with a
node that recomputes if a backward comes after all (``autofuse.serve.grad_mode``). The parameters
are not walked per call: their tuple is cached and taken again after ``_apply`` (``.to()``,
``.cuda()``) or after any parameter or submodule is assigned anywhere (torch's global
registration hooks bump a counter); only their ``requires_grad`` flags are read, and only in
grad mode.
"""

from __future__ import annotations

import logging
import threading

import torch
from torch import nn

from autofuse.core import registry
from autofuse.core.precision import check_dtype, check_precision
from autofuse.core.variant import EagerVariant
from autofuse.errors import TableError
from autofuse.serve import graph_memory, graphs
from autofuse.serve import tune_on_miss as background
from autofuse.serve.dispatch import CallKey, Found, candidates, configuration, passed_over_before, rows_per_tile
from autofuse.serve.grad_mode import SWITCH_AFTER, GradModeCall
from autofuse.serve.table import (DispatchKey, DispatchTable, current_fingerprint, fingerprint_key, serving_devices,
                                  shape_key)
from autofuse.serve.table_watch import WATCH

log = logging.getLogger("autofuse")

_subclasses: dict[type, type] = {}
_is_grad_enabled = torch.is_grad_enabled
# Bumped by torch's global hooks whenever any module registers a parameter or a submodule.
_registrations = [0]
_hooks_installed = False
_KEPT_ON_COPY = ("problem", "precision", "table", "init_args", "budget", "_document", "_said")


def get_module(problem: str, *init_args, table=None, precision: str = "fp32", tune_on_miss=None,
               **init_kwargs) -> nn.Module:
    """The reference model of ``problem`` built from ``init_args``, dispatching to tuned variants.

    ``problem`` is a name, an alias or the path of a KernelBench file; ``table`` is a path (or
    DispatchTable) to read instead of ``$AUTOFUSE_HOME/table.json``; ``precision`` ("ieee",
    "fp32", "tf32", "bf16") is part of every lookup. ``tune_on_miss`` (True, a
    ``autofuse.serve.tune_on_miss.TuneOnMiss`` budget, or None: ``$AUTOFUSE_TUNE_ON_MISS``) tunes untuned keys
    in a background process.
    """
    prob = registry.get_problem(problem)
    check_precision(precision)
    budget = background.budget(tune_on_miss)
    module = _dispatching_subclass(prob.model)(*init_args, **init_kwargs)
    _attach(module, prob, precision, table, init_args, init_kwargs, budget)
    return module


def dispatching_class(problem, *, model: type | None = None, table=None, precision: str = "fp32",
                      tune_on_miss=None) -> type:
    """A subclass of ``model`` (default: the problem's reference class) whose instances dispatch
    like ``get_module``'s: constructed from the reference's own init args, so it drops in
    wherever the reference class is named (KernelBench's ``ModelNew``). ``problem`` is a name,
    a path or a registered Problem; ``model`` must take the same init args as its reference."""
    prob = registry.get_problem(problem if isinstance(problem, str) else problem.name)
    check_precision(precision)
    budget = background.budget(tune_on_miss)
    base = _dispatching_subclass(model or prob.model)

    def __init__(self, *args, **kwargs):
        base.__init__(self, *args, **kwargs)
        _attach(self, prob, precision, table, args, kwargs, budget)

    return type(base.__name__, (base,), {"__init__": __init__, "__module__": __name__, "__doc__": base.__doc__})


def _attach(module: nn.Module, prob, precision: str, table, args: tuple, kwargs: dict, budget=None) -> None:
    if graphs.enabled():
        graph_memory.budget()  # a malformed AUTOFUSE_CUDA_GRAPH_MEMORY fails here, not at a later call's capture
    table = table if isinstance(table, DispatchTable) else DispatchTable(table)
    module._autofuse = Dispatcher(prob, precision, table, (tuple(args), dict(kwargs)), budget)


def _dispatching_subclass(model_cls: type) -> type:
    if model_cls not in _subclasses:
        _subclasses[model_cls] = type(
            f"Autofuse{model_cls.__name__}", (model_cls,),
            {"forward": _dispatch_forward, "_apply": _apply_and_forget, "dispatch_info": _dispatch_info,
             "_autofuse_reference_forward": model_cls.forward, "__module__": __name__,
             "__doc__": f"{model_cls.__doc__ or ''}\n\nDispatching to autofuse's tuned variants (see autofuse.get_module)."},
        )
    return _subclasses[model_cls]


def call_key_parts(dispatcher: Dispatcher, model: nn.Module, x: torch.Tensor) -> tuple:
    """The parts of the ``CallKey`` of a call with ``x``, in its field order: the one place a call
    key is made (AttributeError for an ``x`` that is not a tensor). Grad need is read without
    walking the parameters (module docstring).

    A plain tuple, which the hot path looks up as it is: it equals and hashes as the CallKey of
    the same parts that ``resolve`` stores. Building the CallKey itself cost 0.10 µs more per
    call (1.09 → 1.19 µs with a stub variant, CPU), the tuple subclass's allocation."""
    grad = _is_grad_enabled() and (x.requires_grad or dispatcher.parameters_need_grad(model))
    return (x.shape, x.dtype, x.device, grad, model.training)


def _dispatch_forward(self, x):
    # The hot path: one attribute read, the key, one dict lookup. With a stub variant it cost
    # 2.4 µs per call, of which nn.Module.__call__ 1.35 and the stub 0.3 (min of 15, loaded 2-core
    # CPU); the key's old model.parameters() walk alone cost 5.6 µs in grad mode. On the GPU:
    # benchmarks/gpu/hot_path.py.
    dispatcher = self._autofuse
    try:
        key = call_key_parts(dispatcher, self, x)
    except AttributeError:  # not a tensor: resolve raises the InputError naming it
        key = None
    call = dispatcher.ready.get(key)
    if call is None:
        call = dispatcher.resolve(self, x, key)
    return call(self, x)


def _apply_and_forget(self, fn, *args, **kwargs):
    # .to(), .cuda(), .half() move or convert the parameters (and may replace them): variants
    # built for the old device or dtype must be resolved again.
    self._autofuse.forget()
    return nn.Module._apply(self, fn, *args, **kwargs)


def _dispatch_info(self, x) -> dict:
    """Which variant a call with ``x`` dispatches to, and why (resolving it if needed): ``variant``,
    ``params``, ``source`` ("tuned", "tuned at fp32", "nearest batch (...)", "no entry: reference",
    ...), ``precision`` (the one it runs at), ``entry``, and with tune-on-miss ``tune_on_miss``.
    Where an entry serves: ``served_from`` (its shape), ``rung_of`` (the tune's shape whose batch
    classes it was chosen for, or None) and ``passed_over`` (why each entry ranked before it did not).
    In grad mode these describe the autograd entry, and ``without_backward`` says what serves
    once ``grad_mode.SWITCH_AFTER`` calls in a row had no backward: ``since_backward`` (calls
    so far), ``switch_after``, ``switched`` (whether the next call runs the no-grad entry), and
    the no-grad entry's ``variant`` and ``source``."""
    dispatcher = self._autofuse
    key = dispatcher.call_key(self, x)
    call = dispatcher.call_for(self, x, key)
    info = dict(dispatcher.info[key])
    if key in dispatcher.tunes:
        info["tune_on_miss"] = dispatcher.tunes[key].status
    if isinstance(call, GradModeCall):
        call.no_grad_call(self, x)
        free = dispatcher.info[call.no_grad_key]
        info["without_backward"] = {"since_backward": call.since_backward, "switch_after": SWITCH_AFTER,
                                    "switched": call.since_backward >= SWITCH_AFTER,
                                    "variant": free["variant"], "source": free["source"]}
    return info


def _count_registration(*_args) -> None:
    _registrations[0] += 1


def _install_registration_hooks() -> None:
    global _hooks_installed
    if not _hooks_installed:
        nn.modules.module.register_module_parameter_registration_hook(_count_registration)
        nn.modules.module.register_module_module_registration_hook(_count_registration)
        nn.modules.module.register_module_buffer_registration_hook(_count_registration)
        _hooks_installed = True


class Dispatcher:
    """Per-module dispatch state: ready callables by call key, and what each one is, and the
    (args, kwargs) the module was built from (a KernelBench file problem reads its sizes there)."""

    def __init__(self, problem, precision: str, table: DispatchTable, init_args: tuple[tuple, dict] | None = None,
                 budget: background.TuneOnMiss | None = None):
        self.problem, self.precision, self.table, self.init_args = problem, precision, table, init_args
        self.budget = budget
        self._document: dict | None = None
        self._said: set[str] = set()
        self._reset()
        _install_registration_hooks()
        WATCH.add(self)

    def _reset(self) -> None:
        self.ready: dict[CallKey, object] = {}
        self.info: dict[CallKey, dict] = {}
        self.resolved: dict[CallKey, tuple] = {}  # call key -> (shape, dispatch key, device), for reload
        self.tunes: dict[CallKey, object] = {}  # call key -> its background tune
        # One built variant per (class, precision, configuration, device), shared by the keys it
        # serves: each instance caches its own copies of the weight (bfloat16, the float16
        # parts), so an instance per key held one 8192² copy per batch size a caller sent
        # (H200, 22 under bf16, batches 1-256: 32 GiB).
        self.built: dict[tuple, object] = {}
        self.epoch = 0  # bumped by forget(): a background swap resolved before it is dropped
        self._params: tuple = ()
        self._params_seen = -1
        self._slots: tuple = ()
        self._slots_seen = -1
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        # A copy (copy.deepcopy of the module) resolves its keys afresh: the built variants,
        # the parameter cache, the lock and the background tunes are this module's.
        return {k: v for k, v in self.__dict__.items() if k in _KEPT_ON_COPY}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._reset()
        WATCH.add(self)

    # -- the call key -----------------------------------------------------------
    def parameters_need_grad(self, model) -> bool:
        for p in self._parameters(model):
            if p.requires_grad:
                return True
        return False

    def _parameters(self, model) -> tuple:
        if self._params_seen != _registrations[0]:
            self._params_seen, self._params = _registrations[0], tuple(model.parameters())
        return self._params

    def state_slots(self, model) -> tuple[tuple, slice]:
        """Where ``model`` holds its state, and which of those slots hold its parameters:
        ``(dict, name)`` for each submodule, parameter and buffer (``module._modules``,
        ``._parameters``, ``._buffers``), in that order. Read at a call, they give what the model
        holds then, a tensor swapped into those dicts directly (``torch.func.functional_call``)
        included; cached like the parameters."""
        if self._slots_seen != _registrations[0]:
            self._slots_seen, self._slots = _registrations[0], graphs.model_slots(model)
        return self._slots

    def call_key(self, model, x) -> CallKey | None:
        """The hot path's key, for any ``x`` (a non-tensor gives None, which never matches)."""
        return CallKey._make(call_key_parts(self, model, x)) if isinstance(x, torch.Tensor) else None

    def forget(self) -> None:
        with self._lock:
            self.epoch += 1
            self.ready.clear()
            self.resolved.clear()
            self.built.clear()  # their cached weight copies are of the old tensors
            self._params_seen = self._slots_seen = -1

    # -- resolving a key -----------------------------------------------------------
    def call_for(self, model, x, key) -> object:
        """The callable ready for ``key``, resolved first if it is not (the hot path,
        ``_dispatch_forward``, does the same inline)."""
        call = self.ready.get(key)
        return call if call is not None else self.resolve(model, x, key)

    def resolve(self, model, x, key) -> object:
        """Resolve and store the callable of ``key`` (a CallKey, or the hot path's tuple of its parts)."""
        self.problem.check_input(model, x)
        key = CallKey._make(key) if key is not None else self.call_key(model, x)
        check_dtype(x.dtype, self.precision)
        shape = self.problem.shape_of(model, x)
        dkey = key.dispatch_key(self.precision, self.problem.mode_of(model))
        if shape is None:
            self._say(f"no shape of {self.problem.name} describes a call with input {tuple(x.shape)} on a model "
                      f"built from {self.init_args}; running the reference")
        call, info = self.choose(self._load(), shape, dkey, x.device)
        call = self._bound(key, call, dkey, shape)
        self.info[key], self.ready[key] = info, call
        self.resolved[key] = (shape, dkey, x.device)
        if self.budget is not None and shape is not None and not background.tuned_here(info) and key not in self.tunes:
            self.tunes[key] = tune = background.request(self, key, shape, dkey, x.device)
            self._say(f"tune on miss: {self.problem.name} {shape_key(shape)} at {self.precision} is tuned in the "
                      f"background (log {tune.log_path}); its winner replaces {info['variant']} once written")
        return call

    def choose(self, document: dict, shape: dict | None, dkey: DispatchKey, device: torch.device) -> tuple:
        """(callable, info) for a call at ``shape`` and ``dkey`` on ``device``, from ``document``."""
        if shape is None:  # resolve said so, naming the input
            return self._reference("no shape: reference")
        here = current_fingerprint(device)
        fingerprint = fingerprint_key(here)
        devices, found, passed_over, tuned_on = document.get("devices", {}), [], [], None
        for section in serving_devices(devices, here):  # this GPU's section, then its siblings'
            shapes = devices[section].get("problems", {}).get(self.problem.name, {})
            found, passed_over = candidates(shapes, shape, dkey, self.problem.batch_dim, device.type,
                                            lambda entry: rows_per_tile(self.problem, entry))
            if found:
                tuned_on = section if section != fingerprint else None
                break
        where = f"{self.problem.name} {shape_key(shape)} ({dkey.to_str()})"
        unusable = []  # why each entry tried before the one that serves could not
        for served, candidate in enumerate(found):
            variant, why = self._instantiate(candidate, shape, dkey, device, where)
            if variant is not None:
                for reason in passed_over_before(passed_over, served):
                    self._say(f"{where}: passing over {reason}")
                if candidate.source != "tuned":
                    # A batch class at the key's own precision is how a family serves its other batches
                    # (gated there): said at INFO, where one line per new batch size is not a warning.
                    by_design = candidate.entry.get("rung_of") and candidate.precision == candidate.requested
                    self._say(f"no tuned entry for {where}; using the entry {candidate.source}: "
                              f"{variant.name}, run at {candidate.runs_at}",
                              logging.INFO if by_design else logging.WARNING)
                if tuned_on is not None:
                    self._say(f"no entries tuned on {fingerprint}: serving those tuned on {tuned_on} (the same "
                              f"architecture and SM count: their kernels compute the same, the timings that chose "
                              f"them are that device's); `autofuse tune {self.problem.command_name}` tunes them here")
                return variant, {"variant": variant.name, "params": variant.params, "source": candidate.source,
                                 "precision": candidate.runs_at, "entry": candidate.entry, "served_from": candidate.shape,
                                 "rung_of": candidate.entry.get("rung_of"), "tuned_on": tuned_on,
                                 "passed_over": passed_over_before(passed_over, served) + unusable}
            unusable.append(why)
        for reason in passed_over_before(passed_over, None):
            self._say(f"{where}: passing over {reason}")
        if found:
            call, info = self._reference("unusable entry: reference")
            return call, {**info, "passed_over": passed_over_before(passed_over, None) + unusable}
        self._say(f"no tuned entry for {where} on {fingerprint}; running the reference. To tune it: "
                  f"{self._hint(shape, dkey)}")
        return self._reference("no entry: reference")

    def _hint(self, shape: dict, dkey: DispatchKey) -> str:
        """The command that tunes ``shape`` at ``dkey`` on this machine."""
        mode = f" --mode {dkey.mode}" if dkey.mode != "any" else ""
        dtype = f" --dtype {dkey.dtype}" if dkey.dtype != "float32" else ""
        return (f"autofuse tune {self.problem.command_name} --shape {shape_key(shape)}{dtype} --precision "
                f"{self.precision}{mode}")

    def _instantiate(self, candidate: Found, shape: dict, dkey: DispatchKey, device, where: str) -> tuple:
        """(the entry's variant built at the precision it runs at, None), or (None, why not: also said)."""
        entry = candidate.entry
        try:
            variant_cls, params = configuration(self.problem, candidate, shape, dkey, device.type)
            built = (variant_cls, candidate.runs_at, repr(sorted(params.items())), str(device))
            if getattr(variant_cls, "instance_per_key", False):  # ``compiled``: its recompile limit is per instance
                built += (shape_key(shape), dkey.to_str())
            variant = self.built.get(built)
            if variant is None:
                variant = variant_cls(candidate.runs_at, **params)
                variant.build(str(device))
                self.built[built] = variant
            return variant, None
        except Exception as exc:  # noqa: BLE001 - automatic selection falls back and says why
            self._say(f"the tuned variant {entry.get('variant')!r} ({candidate.source}) for {where} "
                      f"cannot be used ({exc}); trying the next entry or the reference")
            return None, f"the entry {candidate.source} ({entry.get('variant')}): {exc}"

    def _bound(self, key: CallKey, call, dkey: DispatchKey, shape: dict | None):
        """What a call with ``key`` runs: ``call``; for a grad-mode key a ``GradModeCall`` around it
        (the no-grad entry once backwards stop coming); for a small-batch no-grad key on CUDA a
        ``GraphedCall`` (``autofuse.serve.graphs``)."""
        if key.autograd:
            return GradModeCall(self, call, key)
        batch = key.shape[0] if len(key.shape) else 0
        updates = self.problem.training_updates
        if graphs.graphable(call, batch, key.device, key.autograd, dkey.mode, updates):
            where = f"{self.problem.name} {shape_key(shape) if shape else tuple(key.shape)} ({dkey.to_str()})"
            return graphs.GraphedCall(self, call, where, updates if dkey.mode == "train" else ())
        return call

    def _reference(self, how: str) -> tuple:
        return EagerVariant(self.precision), {"variant": "eager", "params": {}, "source": how,
                                              "precision": self.precision, "entry": None}

    def refresh(self, waiting: list) -> None:
        """Re-resolve keys waiting on background tunes against the table as it is now (the
        watcher thread calls this, off the call path) and swap in what changed."""
        document = self._reread()
        if document is not None:
            for item in waiting:
                self._swap(document, item.key, item.shape, item.dkey, item.device, item.epoch, "tuned in the background")

    def reload(self) -> None:
        """Re-resolve every key served so far against the table as it is now (``table_watch``
        calls this when the file changed, off the call path) and swap in what changed."""
        document = self._reread()
        if document is not None:
            epoch = self.epoch
            for key, (shape, dkey, device) in list(self.resolved.items()):
                if shape is not None:
                    self._swap(document, key, shape, dkey, device, epoch, "the table changed")

    def _reread(self) -> dict | None:
        try:
            self._document = self.table.load()
        except TableError:
            return None  # what the module serves stays; the next resolve says why the table is unread
        return self._document

    def _swap(self, document: dict, key, shape: dict, dkey: DispatchKey, device, epoch: int, why: str) -> None:
        call, info = self.choose(document, shape, dkey, device)
        with self._lock:
            old = self.info.get(key)
            if epoch != self.epoch or old is None:
                return
            if _same(old, info):  # the same kernel: keep it, but report the entry as it is now (final, say)
                self.info[key] = {**old, "entry": info["entry"]}
                return
            self.info[key], self.ready[key] = info, self._bound(key, call, dkey, shape)
        self._say(f"{self.problem.name} {shape_key(shape)} ({dkey.to_str()}) now runs "
                  f"{info['variant']} ({info['source']}): {why}")

    def _load(self) -> dict:
        if self._document is None:
            try:
                self._document = self.table.load()
            except TableError as exc:
                self._say(f"{exc}; every call runs the reference until it is fixed")
                self._document = {}
        return self._document

    def _say(self, message: str, level: int = logging.WARNING) -> None:
        if message not in self._said:
            self._said.add(message)
            log.log(level, "autofuse: %s", message)


def _same(a: dict, b: dict) -> bool:
    return all(a.get(k) == b.get(k) for k in ("variant", "params", "source", "precision", "tuned_on"))
