"""Small-batch calls replayed as CUDA graphs: the host's share of a call cut to one launch.

At a small batch a fused call's GPU work is reading the weight (bfloat16 8192², batch 1: 47 µs
at an H100's copy bandwidth), and the host's work is the rest: a triton variant under fp32 makes about ten
torch and Triton calls (the float16 parts of x, the output and its scratch, the GEMM, the
epilogue's second pass), and on the lent H100's host each costs 20-30 µs, so the call took 3.4x
cuBLAS's GEMM alone (issue 34). A CUDA graph replays every launch of the call as one. Its kernels
are re-pointed at each call's x and a fresh output (``autofuse.serve.repoint``: a host-side update
of their arguments), so a call is an allocation and one launch; where that cannot be trusted, or
x is not laid out as the graph's input, x is copied into the graph's input (and, where the
output cannot be re-pointed, the output cloned: a caller owns each output, as from the plain
call): three launches at most, whatever the variant does.

``GraphedCall`` is what the dispatcher binds to a call key that qualifies (``graphable``): no
gradient needed, on CUDA, a batch of at most ``MAX_BATCH``, outside training mode or for a problem
that declares what its training-mode forward writes (``Problem.training_updates``: BatchNorm's
running statistics), and a variant that declares itself ``capturable`` (its call makes no host
synchronization and reads the model only through its tensors and plain attributes). A key is
captured after ``WARM_CALLS`` plain calls in a row that saw the same model state, then replayed
while that state holds:

- *the model's state*: every parameter and buffer, by data pointer and version counter (an
  optimizer step, ``load_state_dict``, ``p.add_`` or ``p.data = ...`` changes one), and every
  plain attribute of its submodules (``scale_factor``, BatchNorm's ``eps``, a tuple such as a
  pooling layer's ``kernel_size``). The graph reads the tensors it was captured with where they
  were, the variant's cached weight copies among them (it does not hold them: the variant must
  not be called on another model meanwhile, which would replace and free its copies; only the
  dispatcher calls it); any change drops the graph before a replay, the call runs plain,
  and a new graph is captured once the state is steady again (a loop that steps the optimizer between calls never captures, and pays nothing but
  the check);
- *the stream*: a graph replays on the stream it was captured on; a call on another runs plain;
- a call under a functorch transform or autocast runs plain (the plain call decides what they
  mean there).

A capture is checked once, against a plain call on the same input: unless the replay's output
equals it bit for bit (NaN where it has NaN), or if the capture raises (a variant that
synchronizes the host, say), the key runs plain from then on, said once in the log. Re-pointing
is checked too, by a second replay at the caller's x and a NaN-filled output set between guards,
with the graph's own input filled with NaN: anything the graph still read or wrote at the old
addresses shows, and so does a scratch tensor that had the output's addresses. A graph
that reads x where no argument shows it (cuBLAS's Hopper kernels take their arguments packed, x's
address not among them as such: inside TMA descriptors, it seems) may still write a fresh output,
x copied in: two launches.

*Training mode.* The buffers the forward writes (``training_updates``) are its output as much as
the returned tensor: a replay writes them where they are, as the plain call does. So their data
pointers are part of the state but not their versions (every call moves those), and each replay
bumps their versions as the plain call would (eval mode's cached coefficients key on them).
Capturing runs the call three times (the plain call, the warm-up, the check replay) where the
caller made one: the written buffers are saved before and restored after the warm-up, and the
replay must leave them bit for bit as the plain call did. BatchNorm with ``momentum=None`` reads
its batch count on the host, which no capture allows: such a key stays plain.

*Memory.* Each graph keeps its own memory pool (the call's output and scratch) and its input,
one graph per batch size a caller sends: ``autofuse.serve.graph_memory`` holds them all to
``AUTOFUSE_CUDA_GRAPH_MEMORY`` MiB a device. Past it a key is not captured (``_room``): it runs
plain, and asks again after ``graph_memory.idle_calls`` calls that read nothing but the count.
``AUTOFUSE_CUDA_GRAPHS=0`` turns graphs off, ``AUTOFUSE_CUDA_GRAPHS=copy`` re-pointing (each
replay copies x in and clones the output).
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
import weakref
from typing import NamedTuple

import torch

from autofuse.core import capture
from autofuse.serve import graph_memory, repoint

log = logging.getLogger("autofuse")

# Up to here the host, not the GPU, sets a call's time (issue 34; H200, 22 under bf16 at 100-256
# rows: a plain call of the triton entry 223-229 µs, its replay 108-121, its kernels about 50).
MAX_BATCH = 256
WARM_CALLS = 2  # plain calls in a row with the same model state before a key is captured
_PLAIN_ATTRS = (bool, int, float, str, type(None))


def enabled() -> bool:
    """Whether graphs may serve at all: ``AUTOFUSE_CUDA_GRAPHS`` is not "0"."""
    return os.environ.get("AUTOFUSE_CUDA_GRAPHS", "1") != "0"


def repointing() -> bool:
    """Whether a new graph may be re-pointed: ``AUTOFUSE_CUDA_GRAPHS`` is not "copy"."""
    return os.environ.get("AUTOFUSE_CUDA_GRAPHS", "1") != "copy"


def graphable(call, batch: int, device: torch.device, autograd: bool, mode: str,
              training_updates: tuple[str, ...] | None = None) -> bool:
    """Whether a call key bound to ``call`` (a variant) qualifies for a ``GraphedCall`` (module
    docstring); ``training_updates``: the problem's, which a training-mode key needs declared."""
    return (replayed_key(batch, device, autograd, mode, training_updates)
            and getattr(call, "capturable", False) and enabled())


def replayed_key(batch: int, device: torch.device, autograd: bool, mode: str,
                 training_updates: tuple[str, ...] | None = None) -> bool:
    """Whether a key's calls are replayed as graphs when its variant is ``capturable`` (and graphs
    are on): what the tuner's small batch classes must know (``batch_classes.rung_candidates``)."""
    return (not autograd and device.type == "cuda" and 1 <= batch <= MAX_BATCH
            and (mode != "train" or training_updates is not None))


class GraphedCall:
    """The callable bound to one qualifying no-grad call key: ``call`` (the variant) run plain until
    the model's state has held for ``WARM_CALLS`` calls, then captured and replayed (module docstring)."""

    def __init__(self, dispatcher, call, where: str, writes: tuple[str, ...] = (), accounted: bool = True):
        self._dispatcher = weakref.ref(dispatcher)  # the dispatcher holds this call: no cycle
        self.accounted = accounted  # its graphs count against ``graph_memory.budget()``
        self._drops = 0  # times its graph was dropped for the memory budget
        self._bytes = 0  # what its last graph held (``graph_memory.graph_bytes``)
        self._idle = 0  # plain calls left before it asks the ledger for room again
        self._refusals = 0  # times in a row the ledger had no room for it
        self.call, self.where = call, where
        self.writes = writes  # the buffers the call writes, by state_dict name (training mode)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.failed: str | None = None  # why this key runs plain for good
        self._x = self._out = self._state = self._seen = None
        self._repoint: repoint.Repointer | None = None  # None: x copied in, the output cloned
        self._reads_x = False  # whether the re-pointed graph may read a caller's x where it is
        self._written: list[torch.Tensor] = []  # the buffers a replay writes (``writes``'s tensors)
        self._stream = None
        self._watched: _Watched | None = None
        self._steady = 0
        self._lock = threading.Lock()  # one caller at a time may use the graph's input and output

    @classmethod
    def standalone(cls, call, model, writes: tuple[str, ...] = ()) -> GraphedCall:
        """A GraphedCall of ``call`` on ``model`` outside any dispatcher: what the tuner times at
        a batch the runtime replays (``autofuse.tuning.timed_call.replayed_call``)."""
        owner = _Standalone(model)
        # Not accounted: a graph dropped for the budget in the middle of a timing would time the plain call.
        graphed = cls(owner, call, f"{getattr(call, 'name', type(call).__name__)} timed", writes, accounted=False)
        graphed._owner = owner  # the weak reference's target lives as long as the call
        return graphed

    def __getattr__(self, name):
        if name == "call":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.call, name)  # name, params, precision...: the variant's

    def __call__(self, model, x):
        if self.accounted:
            graph_memory.LEDGER.tick(x.device)
        if self._idle:  # the ledger had no room for its graph: plain, unwatched, until it asks again
            self._idle -= 1  # unlocked: a count lost to a race only moves the next ask by a call
            return self.call(model, x)
        if self.failed is not None or _plain_only() or not self._lock.acquire(blocking=False):
            return self.call(model, x)
        try:
            state = self._model_state(model)
            if self.graph is not None and state == self._state and _stream(x.device) == self._stream:
                try:
                    out = self._replay(x)
                except repoint.RepointError as exc:  # before the replay: nothing was written
                    self._give_up(f"re-pointing it failed ({exc})")
                    return self.call(model, x)
                if self._written:
                    torch.autograd.graph.increment_version(self._written)  # as the plain call's writes do
                if self.accounted:
                    graph_memory.LEDGER.touch(self)
                return out
            return self._warm(model, x, state)
        finally:
            self._lock.release()

    def _replay(self, x):
        """One replay, into a fresh output where the graph is re-pointed (reading ``x`` where it
        is, if the graph can and x fits, else a copy in its own input), else through its own
        input and output."""
        if self._repoint is None:
            self._x.copy_(x)
            self.graph.replay()
            return self._out.clone()
        if not (self._reads_x and repoint.fits(x)):
            self._x.copy_(x)
            x = self._x
        out = torch.empty_like(self._out)
        self._repoint.point((x, out))
        self.graph.replay()
        return out

    def _warm(self, model, x, state):
        """A plain call, counted towards a capture while the model's state holds (capturing at the last)."""
        if state != self._seen:  # drop a graph of another state: its memory goes too
            self._let_go()
            self._seen, self._steady = state, 0
        self._steady += 1
        if self._steady < graph_memory.warm_calls(self._drops, WARM_CALLS):
            return self.call(model, x)
        if self.accounted and not self._room(x.device):
            self._idle, self._refusals = graph_memory.idle_calls(self._refusals), self._refusals + 1
            self._steady = 0
            return self.call(model, x)
        self._refusals = 0
        written = [t for d, name in self._watched.written if (t := d[name]) is not None]  # as __call__'s state saw
        before = [t.clone() for t in written]
        expected = self.call(model, x)  # the caller's call, which the replay must equal
        after = [t.clone() for t in written]
        try:
            why, out = self._capture(model, x, state, expected, written, before, after)
        except Exception as exc:  # noqa: BLE001 - any failure leaves the key on the plain call
            why = f"capturing it failed ({type(exc).__name__}: {exc})"
        if why is not None:
            _restore(written, after)  # the model as the caller's one call left it
            self._give_up(why)
            return expected
        return out

    def _capture(self, model, x, state, expected, written, before, after) -> tuple[str | None, object]:
        """Record ``call`` on a copy of ``x`` and replay it once: (None, the replay's output) if it
        did what the plain call did (``expected``, and the written buffers ``after``), else (why not, None)."""
        with torch.inference_mode(False):  # the input is written in place later, in or out of inference mode
            static_x = torch.empty_like(x, memory_format=torch.contiguous_format)
        static_x.copy_(x)
        graph, static_out = self._record(model, static_x, written, before)
        if not isinstance(static_out, torch.Tensor):
            return f"the call returned {type(static_out).__name__}, not a tensor", None
        graph.replay()  # the caller's call's update of ``written``: the warm-up's was undone
        out = static_out.clone()
        if not same_values(out, expected):
            return "its replay differed from the plain call on the same input", None
        if not all(same_values(t, a) for t, a in zip(written, after)):
            return "its replay wrote the model's buffers differently from the plain call", None
        if self._model_state(model) != state:
            return "the call changes the model's tensors", None
        self._repoint, self._reads_x = _repointed(graph, static_x, static_out, x, expected, written, after)
        if written:
            torch.autograd.graph.increment_version(written)
        self.graph, self._x, self._out, self._state, self._written = graph, static_x, static_out, state, written
        self._stream = _stream(x.device)
        if self.accounted:
            return self._account(graph, static_x, x.device), out
        return None, out

    def _room(self, device) -> bool:
        """Whether the ledger has room for this key's graph (``graph_memory.Ledger.room``),
        dropping stale graphs where that makes it."""
        fits, stale = graph_memory.LEDGER.room(self, device, self._bytes)
        for other in stale:
            other.drop()
        return fits

    def _account(self, graph, static_x, device) -> str | None:
        """Enter the new graph in the ledger and drop the graphs it puts over the budget; why not
        where it alone is larger than the budget (the key then runs plain for good)."""
        nbytes = self._bytes = graph_memory.graph_bytes(graph, static_x)
        over = graph_memory.LEDGER.add(self, device, nbytes)
        if self in over:
            return (f"its graph would hold {nbytes / graph_memory.MIB:.0f} MiB, more than all graphs may "
                    f"({graph_memory.budget() / graph_memory.MIB:.0f} MiB, AUTOFUSE_CUDA_GRAPH_MEMORY)")
        for other in over:
            other.drop()
        return None

    def drop(self) -> bool:
        """Let the graph go for the memory budget (the key runs plain, and is captured again after
        more warm calls); False, keeping it, if a call is using it right now."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            if self.graph is not None:
                self._let_go()
                self._steady, self._drops = 0, self._drops + 1
            return True
        finally:
            self._lock.release()

    def _let_go(self) -> None:
        self.graph = self._x = self._out = self._repoint = None
        graph_memory.LEDGER.forget(self)

    def _record(self, model, static_x, written, before) -> tuple[torch.cuda.CUDAGraph, object]:
        """The call warmed up on a side stream, as torch.cuda.graphs asks (lazy inits stay out of
        the capture), ``written`` put back to ``before``, then captured: (the graph, its output)."""
        side = _warm_up_stream(static_x.device)
        side.wait_stream(torch.cuda.current_stream(static_x.device))
        with torch.cuda.stream(side):
            self.call(model, static_x)
        torch.cuda.current_stream(static_x.device).wait_stream(side)
        _restore(written, before)
        graph = _new_graph()
        with capture.replays_on(_stream(static_x.device)):  # a replay runs on this stream only (__call__)
            return graph, _captured(self.call, model, static_x, graph)

    def _give_up(self, why: str) -> None:
        self.failed = why
        self._let_go()
        dispatcher = self._dispatcher()
        if dispatcher is not None:
            dispatcher._say(f"{self.where}: not replayed as a CUDA graph, {why}; its calls run as they are")

    def _model_state(self, model) -> tuple:
        """Every parameter's and buffer's (data pointer, version; a written buffer's pointer alone),
        and the modules' plain attributes."""
        dispatcher = self._dispatcher()
        slots, params = dispatcher.state_slots(model)
        if self._watched is None or self._watched.slots is not slots:
            self._watched = _Watched.of(model, slots, params, self.writes)
        # Lists, not tuples of generators: this runs on every call (about half of its host time on a CPU).
        tensors = [None if (t := d[name]) is None else (t.data_ptr(), t._version if versioned else None)
                   for d, name, versioned in self._watched.tensor_slots]
        return tensors, [d.get(k) for d, k in self._watched.attrs]


def model_slots(model) -> tuple[tuple, slice]:
    """``(dict, name)`` of each submodule, parameter and buffer of ``model`` (``module._modules``,
    ``._parameters``, ``._buffers``), in that order, and the slice of them that holds parameters."""
    modules = tuple(model.modules())
    groups = [[(getattr(m, where), name) for m in modules for name in getattr(m, where)]
              for where in ("_modules", "_parameters", "_buffers")]
    first = len(groups[0])
    return tuple(groups[0] + groups[1] + groups[2]), slice(first, first + len(groups[1]))


class _Standalone:
    """What a GraphedCall asks of its dispatcher, for one model it alone serves."""

    def __init__(self, model):
        self._slots = model_slots(model)

    def state_slots(self, model) -> tuple[tuple, slice]:
        return self._slots

    def _say(self, message: str) -> None:
        log.info(message)


class _Watched(NamedTuple):
    """What ``GraphedCall._model_state`` reads, worked out once per set of submodules: a call
    compares values, not whole ``__dict__``s."""

    slots: tuple  # the dispatcher's (``state_slots``)
    attrs: list  # (a module's __dict__, name) of each plain attribute
    written: list  # (dict, name) of each slot the call writes (``GraphedCall.writes``)
    tensor_slots: list  # (dict, name, versioned: its version counter is part of the state) per tensor slot

    @classmethod
    def of(cls, model, slots: tuple, params: slice, writes: tuple[str, ...]) -> _Watched:
        modules = [model] + [d[name] for d, name in slots[:params.start] if d[name] is not None]
        attrs = [(m.__dict__, k) for m in modules for k, v in m.__dict__.items() if not k.startswith("_") and _plain(v)]
        owners = dict(model.named_modules())
        written = {(id(owners[path]._buffers), name) for path, _, name in (w.rpartition(".") for w in writes)
                   if path in owners}
        tensor_slots = [(d, name, (id(d), name) not in written) for d, name in slots[params.start:]]
        return cls(slots, attrs, [(d, name) for d, name, versioned in tensor_slots if not versioned], tensor_slots)


def _repointed(graph, static_x, static_out, x, expected, written, after) -> tuple[repoint.Repointer | None, bool]:
    """(a Repointer for ``graph``, whether it may read x where it is), or (None, False).

    Re-pointed at ``x`` and a NaN-filled fresh output, with the graph's own input filled with
    NaN, a replay must give the plain call's output bit for bit and write nothing outside it
    (``repoint.Guarded``); failing that, at its own input (x copied in) and a fresh output. Each
    check's update of the ``written`` buffers is undone."""
    if not repointing():
        return None, False
    if not (static_out.is_floating_point() and _whole_storage(static_out)) or bool(expected.isnan().any()):
        return None, False
    repointer = repoint.Repointer.of(graph, (static_x, static_out))
    reach = repoint.segment_reach(static_out) if repointer is not None else None
    if reach is None or sum(reach) > repoint.GUARD_LIMIT:
        return None, False
    for reads_x in (True, False):
        if reads_x and not (static_x.is_floating_point() and repoint.fits(x)):
            continue
        fresh = repoint.Guarded(static_out, *reach)  # a scratch sharing the output's addresses writes a guard
        if reads_x:
            static_x.fill_(float("nan"))
        try:
            repointer.point((x if reads_x else static_x, fresh.tensor))
            graph.replay()
            same = same_values(fresh.tensor, expected) and fresh.intact()
        finally:
            static_x.copy_(x)
            _restore(written, after)
        if same:
            return repointer, reads_x
    repointer.point((static_x, static_out))  # back at the graph's own input and output
    return None, False


def _whole_storage(t: torch.Tensor) -> bool:
    """``t`` is the whole of its storage, laid out as ``empty_like`` lays out a fresh one."""
    return (t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())


def _plain(value) -> bool:
    """A value a forward may read as a constant: a number, string or None, or a tuple of them
    (a pooling layer's ``kernel_size``, a convolution's ``stride``)."""
    if isinstance(value, tuple):
        return all(isinstance(v, _PLAIN_ATTRS) for v in value)
    return isinstance(value, _PLAIN_ATTRS)


_warm_up_streams: dict[torch.device, torch.cuda.Stream] = {}
_warm_up_lock = threading.Lock()


def _warm_up_stream(device: torch.device) -> torch.cuda.Stream:
    """The device's one side stream for every capture's warm-up call: a stream made for each
    capture took a finish counter of its own each time (``triton.host.Arrivals``, which keeps a
    stream's counter for good). Warm-ups from two threads then run in order on it."""
    with _warm_up_lock:
        stream = _warm_up_streams.get(device)
        if stream is None:
            stream = _warm_up_streams[device] = torch.cuda.Stream(device)
        return stream


def _new_graph() -> torch.cuda.CUDAGraph:
    """A graph whose nodes stay readable after instantiation (``repoint`` reads them; torch 2.8+)."""
    try:
        return torch.cuda.CUDAGraph(keep_graph=True)
    except TypeError:
        return torch.cuda.CUDAGraph()


def _captured(call, model, x, graph):
    """``call(model, x)`` captured into ``graph`` on a stream of its own. The capture always ends,
    whatever the call raised, and only this thread's CUDA calls are held to the capture's rules
    ("thread_local"): another thread allocating meanwhile is not this capture's failure. A capture
    that CUDA invalidated (a synchronizing call) cannot end cleanly: an empty capture after it
    leaves the stream and the random-number generator usable (an H100 run of
    tests/test_graphs_gpu.py checks both after each kind of failure).

    Such a capture also leaves the caching allocator routing to its pool: torch's ``capture_end``
    raises before it ends that, and the graph never releases a pool whose capture did not end. The
    allocator then aborts the process at its next ``empty_cache`` (a caller's, or its own when an
    allocation runs out of memory): "captures_underway.empty() INTERNAL ASSERT FAILED" (H100,
    torch 2.11). So the pool is named here, and ended and released here where the capture fails."""
    pool = torch.cuda.graph_pool_handle()
    with (torch.cuda.device(x.device), torch.cuda.stream(torch.cuda.Stream(x.device)),
          warnings.catch_warnings(record=True) as said):
        warnings.simplefilter("always")
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            out = call(model, x)
        finally:
            try:
                graph.capture_end()
            except Exception:
                try:
                    _release_pool(x.device, pool)
                finally:
                    _end_capture_state(x.device)
                raise
    if any("CUDA Graph is empty" in str(w.message) for w in said):
        # Nothing was launched: a replay would hand back the same tensor whatever x is.
        raise RuntimeError("the call launched nothing on the GPU")
    for w in said:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return out


def _release_pool(device, pool) -> None:
    """End the allocator's routing to ``pool`` and drop the reference its capture took (what a
    capture that ends does: ``capture_end``, then the graph's ``reset``)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch._C._cuda_endAllocateToPool(index, pool)
    torch._C._cuda_releasePool(index, pool)


def _end_capture_state(device) -> None:
    empty = torch.cuda.CUDAGraph()
    with (torch.cuda.device(device), torch.cuda.stream(torch.cuda.Stream(device)), warnings.catch_warnings()):
        warnings.filterwarnings("ignore", "The CUDA Graph is empty")  # it is meant to be
        empty.capture_begin(capture_error_mode="thread_local")
        empty.capture_end()


def _plain_only() -> bool:
    """A functorch transform or autocast is active: the plain call decides what a call means there."""
    return torch._C._are_functorch_transforms_active() or torch.is_autocast_enabled("cuda")


def _stream(device: torch.device) -> int:
    # Raw, as the launchers read it (``build.stream_handle``): no Stream object per call.
    return torch._C._cuda_getCurrentRawStream(device.index if device.index is not None else torch.cuda.current_device())


def _restore(tensors: list[torch.Tensor], saved: list[torch.Tensor]) -> None:
    for t, value in zip(tensors, saved):
        t.copy_(value)


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same shape, dtype and values, NaN where NaN (``torch.equal`` finds NaN unequal)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(((a == b) | (a.isnan() & b.isnan())).all())
