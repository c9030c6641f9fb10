"""``get_module``: a drop-in ``nn.Module`` that dispatches each call to the tuned variant.

The module is an instance of a subclass of the problem's reference model, so its
parameters, buffers, ``state_dict`` keys and attributes are exactly the reference's (a
KernelBench ``Model``'s state_dict loads into it). Per call, (shape, dtype, device, grad
need, train/eval) is looked up in a dict of ready callables: no file I/O, no compilation.
A new key is resolved once from the dispatch table (read once per module): the tuned
entry, else the entry tuned at the nearest batch size, else the reference, each said once.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from autofuse import registry
from autofuse.errors import TableError
from autofuse.precision import check_dtype, check_precision, dtype_name
from autofuse.table import DispatchKey, DispatchTable, current_fingerprint, fingerprint_key, parse_shape_key, shape_key
from autofuse.variant import EagerVariant

log = logging.getLogger("autofuse")

_subclasses: dict[type, type] = {}


def get_module(problem: str, *init_args, table=None, precision: str = "fp32", **init_kwargs) -> nn.Module:
    """The reference model of ``problem`` built from ``init_args``, dispatching to tuned variants.

    ``problem`` is a name, an alias or the path of a KernelBench file; ``table`` is a path (or
    DispatchTable) to read instead of ``$AUTOFUSE_HOME/table.json``; ``precision`` ("fp32",
    "tf32", "bf16") is part of every lookup.
    """
    prob = registry.get_problem(problem)
    check_precision(precision)
    module = _dispatching_subclass(prob.model)(*init_args, **init_kwargs)
    _attach(module, prob, precision, table, init_args, init_kwargs)
    return module


def dispatching_class(problem, *, model: type | None = None, table=None, precision: str = "fp32") -> type:
    """A subclass of ``model`` (default: the problem's reference class) whose instances dispatch
    like ``get_module``'s: constructed from the reference's own init args, so it drops in
    wherever the reference class is named (KernelBench's ``ModelNew``). ``problem`` is a name,
    a path or a registered Problem; ``model`` must take the same init args as its reference."""
    prob = registry.get_problem(problem if isinstance(problem, str) else problem.name)
    check_precision(precision)
    base = _dispatching_subclass(model or prob.model)

    def __init__(self, *args, **kwargs):
        base.__init__(self, *args, **kwargs)
        _attach(self, prob, precision, table, args, kwargs)

    return type(base.__name__, (base,), {"__init__": __init__, "__module__": __name__, "__doc__": base.__doc__})


def _attach(module: nn.Module, prob, precision: str, table, args: tuple, kwargs: dict) -> None:
    table = table if isinstance(table, DispatchTable) else DispatchTable(table)
    module._autofuse = Dispatcher(prob, precision, table, (tuple(args), dict(kwargs)))


def _dispatching_subclass(model_cls: type) -> type:
    if model_cls not in _subclasses:
        _subclasses[model_cls] = type(
            f"Autofuse{model_cls.__name__}", (model_cls,),
            {"forward": _dispatch_forward, "_apply": _apply_and_forget, "dispatch_info": _dispatch_info,
             "_autofuse_reference_forward": model_cls.forward, "__module__": __name__,
             "__doc__": f"{model_cls.__doc__ or ''}\n\nDispatching to autofuse's tuned variants (see autofuse.get_module)."},
        )
    return _subclasses[model_cls]


def _dispatch_forward(self, x):
    dispatcher = self._autofuse
    key = dispatcher.call_key(self, x)
    call = dispatcher.ready.get(key)
    if call is None:
        call = dispatcher.resolve(self, x, key)
    return call(self, x)


def _apply_and_forget(self, fn, *args, **kwargs):
    # .to(), .cuda(), .half() move or convert the parameters: variants built for the old
    # device or dtype must be resolved again.
    self._autofuse.ready.clear()
    return nn.Module._apply(self, fn, *args, **kwargs)


def _dispatch_info(self, x) -> dict:
    """Which variant a call with ``x`` dispatches to, and why (resolving it if needed)."""
    dispatcher = self._autofuse
    key = dispatcher.call_key(self, x)
    if key not in dispatcher.ready:
        dispatcher.resolve(self, x, key)
    return dict(dispatcher.info[key])


class Dispatcher:
    """Per-module dispatch state: ready callables by call key, and what each one is, and the
    (args, kwargs) the module was built from (a KernelBench file problem reads its sizes there)."""

    def __init__(self, problem, precision: str, table: DispatchTable, init_args: tuple[tuple, dict] | None = None):
        self.problem, self.precision, self.table, self.init_args = problem, precision, table, init_args
        self.ready: dict[tuple, object] = {}
        self.info: dict[tuple, dict] = {}
        self._document: dict | None = None
        self._said: set[str] = set()

    def call_key(self, model, x) -> tuple:
        grad = torch.is_grad_enabled() and (
            getattr(x, "requires_grad", False) or any(p.requires_grad for p in model.parameters())
        )
        return (getattr(x, "shape", None), getattr(x, "dtype", None), getattr(x, "device", None), grad, model.training)

    def resolve(self, model, x, key) -> object:
        self.problem.check_input(model, x)
        check_dtype(x.dtype, self.precision)
        shape = self.problem.shape_of(model, x)
        dkey = DispatchKey(dtype_name(x.dtype), self.precision, self.problem.mode_of(model), autograd=key[3])
        fingerprint = fingerprint_key(current_fingerprint(x.device))
        if shape is None:
            self._say(f"no shape of {self.problem.name} describes a call with input {tuple(x.shape)} on a model "
                      f"built from {self.init_args}; running the reference")
            entry, how = None, "no shape: reference"
        else:
            entry, how = self._lookup(fingerprint, shape, dkey)
        call, info = self._callable(entry, how, x.device, dkey, shape)
        self.ready[key], self.info[key] = call, info
        return call

    def _lookup(self, fingerprint: str, shape: dict, dkey: DispatchKey) -> tuple[dict | None, str]:
        devices = self._load().get("devices", {})
        shapes = devices.get(fingerprint, {}).get("problems", {}).get(self.problem.name, {})
        exact = shapes.get(shape_key(shape), {}).get(dkey.to_str())
        if exact is not None:
            return exact, "tuned"
        nearest = _nearest_batch(shapes, shape, dkey.to_str(), self.problem.batch_dim)
        if nearest is not None:
            tuned_shape, entry = nearest
            self._say(f"no tuned entry for {self.problem.name} {shape_key(shape)} ({dkey.to_str()}); "
                      f"using the one tuned at {tuned_shape} ({entry.get('variant')})")
            return entry, f"nearest batch ({tuned_shape})"
        hint = f"autofuse tune {self.problem.command_name} --shape {shape_key(shape)} --precision {self.precision}"
        self._say(f"no tuned entry for {self.problem.name} {shape_key(shape)} ({dkey.to_str()}) on {fingerprint}; "
                  f"running the reference. To tune it: {hint}")
        return None, "no entry: reference"

    def _callable(self, entry, how, device, dkey, shape):
        if entry is not None:
            try:
                variant_cls = registry.get_variant(self.problem.name, entry["variant"])
                reason = variant_cls.admits(device.type, torch.bfloat16 if dkey.dtype == "bfloat16" else torch.float32,
                                            self.precision, dkey.autograd)
                if reason is not None:
                    raise ValueError(reason)
                variant = variant_cls(self.precision, **entry.get("params", {}))
                variant.build(str(device))
                return variant, {"variant": variant_cls.name, "params": entry.get("params", {}), "source": how, "entry": entry}
            except Exception as exc:  # noqa: BLE001 - automatic selection falls back and says why
                self._say(f"the tuned variant {entry.get('variant')!r} for {self.problem.name} {shape_key(shape)} "
                          f"cannot be used ({exc}); running the reference")
                how = "unusable entry: reference"
        return EagerVariant(self.precision), {"variant": "eager", "params": {}, "source": how, "entry": None}

    def _load(self) -> dict:
        if self._document is None:
            try:
                self._document = self.table.load()
            except TableError as exc:
                self._say(f"{exc}; every call runs the reference until it is fixed")
                self._document = {}
        return self._document

    def _say(self, message: str) -> None:
        if message not in self._said:
            self._said.add(message)
            log.warning("autofuse: %s", message)


def _nearest_batch(shapes: dict, shape: dict, dkey: str, batch_dim: str | None):
    """(shape key, entry) tuned at the batch size nearest (in ratio) to ``shape``'s, other dims equal."""
    if batch_dim is None or not shape.get(batch_dim):
        return None
    best = None
    for skey, by_key in shapes.items():
        try:
            tuned = parse_shape_key(skey)
        except ValueError:
            continue
        if dkey not in by_key or not tuned.get(batch_dim) or {k: v for k, v in tuned.items() if k != batch_dim} != {k: v for k, v in shape.items() if k != batch_dim}:
            continue
        distance = abs(math.log(tuned[batch_dim] / shape[batch_dim]))
        if best is None or distance < best[0]:
            best = (distance, skey, by_key[dkey])
    return None if best is None else best[1:]
