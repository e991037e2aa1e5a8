"""Compiling: tracing Python functions into graphs, and the callable step / function objects."""

from __future__ import annotations

import struct
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from . import _check, _rlx
from ._arrays import contiguous
from ._tensor import Tensor, Trace
from .errors import DTypeError, InputError, RlxError, ShapeError
from .nn import Module
from .optim import Optimizer

_NP = {"float32": np.dtype(np.float32), "int32": np.dtype(np.int32)}


class InputSpec:
    """The shape and dtype of one named input of a compiled function."""

    def __init__(self, shape: Sequence[int], dtype: str = "float32") -> None:
        self.shape = _check.shape("InputSpec", shape)
        if not isinstance(dtype, str) or dtype not in _NP:
            raise DTypeError(f"[InputSpec] unsupported dtype {dtype!r} (use 'float32' or 'int32')")
        self.dtype = str(dtype)

    def __repr__(self) -> str:
        return f"InputSpec(shape={self.shape}, dtype={self.dtype!r})"


def _specs(inputs: Mapping[str, Any]) -> dict[str, InputSpec]:
    if not isinstance(inputs, Mapping):
        raise InputError(f"[inputs] must map input names to rlx.InputSpec, got {type(inputs).__name__}")
    out = {}
    for name, spec in dict(inputs).items():
        _check.name("inputs", name)
        if isinstance(spec, InputSpec):
            out[name] = spec
        elif isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[1], str):
            out[name] = InputSpec(*spec)
        else:
            out[name] = InputSpec(spec)
    return out


def convert(name: str, spec_shape: Sequence[int], spec_dtype: str, value: Any) -> np.ndarray:
    """Checks ``value`` against a spec and returns a C-contiguous native array of the spec's dtype.
    Non-contiguous, Fortran-ordered and byte-swapped arrays are converted; integer arrays are
    accepted for int32 inputs when their values fit; anything else raises before any work."""
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError) as e:
        raise DTypeError(f"[{name}] cannot use {type(value).__name__} as an array: {e}") from None
    want = _NP[spec_dtype]
    kind = arr.dtype.kind
    if spec_dtype == "float32":
        if not (kind == "f" and arr.dtype.itemsize == 4):
            raise DTypeError(f"[{name}] expected a float32 array, got {arr.dtype}; cast it with .astype(np.float32)")
    else:
        if kind not in "iu":
            raise DTypeError(f"[{name}] expected an int32 array of ids, got {arr.dtype}")
        if arr.dtype.itemsize > 4 or kind == "u":
            if arr.size and (arr.min() < -(2**31) or arr.max() > 2**31 - 1):
                raise InputError(f"[{name}] values {arr.min()}..{arr.max()} do not fit in int32")
    if tuple(arr.shape) != tuple(spec_shape):
        raise ShapeError(f"[{name}] expected shape {tuple(spec_shape)}, got {tuple(arr.shape)}")
    # Flat: the native side takes raw bytes (and 0-d arrays export no buffer shape).
    return contiguous(arr, want).reshape(-1)


def _trace(fn: Callable[..., Any], model: Module, specs: dict[str, InputSpec], store: Any) -> tuple[Trace, Any, list[int]]:
    t = Trace()
    param_ids = []
    params = model.parameters()
    for name, shape, dtype in store.entries():
        node = t.graph.param(name, shape, dtype)
        t.param_nodes[id(params[name])] = node
        param_ids.append(node)
    tensors = {n: Tensor(t, t.graph.input(n, list(s.shape), s.dtype)) for n, s in specs.items()}
    with t:
        out = fn(model, **tensors)
    return t, out, param_ids


def _check_feeds(names: Sequence[str], arrays: Mapping[str, Any], specs: dict[str, InputSpec], bound: set[str]) -> dict[str, np.ndarray]:
    if not arrays:
        return {}  # the native side consumes a prefetched batch, or reports what is missing
    unknown = sorted(set(arrays) - set(specs))
    if unknown:
        raise InputError(f"[{unknown[0]}] unknown input; expected {sorted(specs)}")
    missing = [n for n in names if n not in arrays and n not in bound]
    if missing:
        raise InputError(f"[{missing[0]}] missing input; expected {sorted(specs)}")
    # Every declared input is checked, even one the traced function does not read.
    converted = {n: convert(n, specs[n].shape, specs[n].dtype, v) for n, v in arrays.items()}
    return {n: v for n, v in converted.items() if n in names}


class _Prefetching:
    """``prefetch(**arrays)``: asynchronous input copies into a free staging buffer."""

    _exe: Any
    _specs: dict[str, InputSpec]
    _names: list[str]

    def prefetch(self, **arrays: Any) -> None:
        """Takes a snapshot of the batch (a copy of each array, made now) and queues its copy
        into a free input buffer on the copy engine, then returns without waiting for that copy.
        Calls made without arrays consume prefetched batches in order, each waiting only for
        its own copy. Two batches may wait; a third prefetch raises ``RlxError``. Because the
        batch is copied at the call, the arrays may be changed or reused right away: the step
        sees the values they had when ``prefetch`` was called.

        Example::

            step.prefetch(x=xs[0], y=ys[0])
            for i in range(1, n):
                step.prefetch(x=xs[i], y=ys[i])   # copied while the step below runs
                loss = step()                      # consumes batch i - 1
            loss = step()
        """
        unknown = sorted(set(arrays) - set(self._specs))
        if unknown:
            raise InputError(f"[{unknown[0]}] unknown input; expected {sorted(self._specs)}")
        feeds = {n: convert(n, self._specs[n].shape, self._specs[n].dtype, v) for n, v in arrays.items()}
        self._exe.prefetch({n: v for n, v in feeds.items() if n in self._names})

    @property
    def prefetched(self) -> int:
        """Batches waiting to be consumed."""
        return self._exe.prefetched()


class TrainStep(_Prefetching):
    """A compiled training step: ``step(**arrays) -> float`` runs forward, backward and the
    optimizer update as one native call over the arena; ``step()`` without arrays consumes
    the next prefetched batch."""

    def __init__(self, exe: Any, model: Module, optimizer: Optimizer, specs: dict[str, InputSpec], grad_names: list[str]) -> None:
        self._exe = exe
        self._model = model
        self._optimizer = optimizer
        self._specs = specs
        self._names = [n for n, *_ in exe.input_slots()]
        self._grad_names = grad_names
        self._grads: dict[str, np.ndarray] | None = None

    def __call__(self, **arrays: Any) -> float:
        feeds = _check_feeds(self._names, arrays, self._specs, set())
        hyper = self._optimizer._hyper()  # checks settings changed since construction
        out = self._exe.run(feeds, hyper, [0])
        return struct.unpack("<f", out[0])[0]

    @property
    def grads(self) -> dict[str, np.ndarray]:
        """The last step's gradients by parameter name (views where the host can see memory)."""
        if self._grads is None:
            self._grads = {n: _output(self._exe, i + 1) for i, n in enumerate(self._grad_names)}
        return dict(self._grads)

    def memory(self) -> dict[str, int]:
        """Planned bytes: ``arena_bytes`` vs ``naive_bytes`` (no reuse), ``param_bytes``,
        ``optimizer_state_bytes``."""
        return dict(self._exe.memory())


def _output(exe: Any, i: int) -> np.ndarray:
    shape, dtype = exe.outputs()[i]
    raw = exe.output_view(i)
    if raw is None:
        raise RlxError("this device's memory is not host-visible; read outputs from the call's result")
    arr = np.frombuffer(raw, dtype=_NP[dtype]).reshape(shape)
    arr.flags.writeable = False
    return arr


class Function(_Prefetching):
    """A compiled inference function: ``fn(**arrays)`` returns fresh numpy arrays (copies that the
    next call does not touch) — one array, or a tuple when the traced function returned one.
    ``fn()`` without arrays consumes the next prefetched batch (or runs on bound inputs)."""

    def __init__(self, exe: Any, specs: dict[str, InputSpec], tuple_out: bool) -> None:
        self._exe = exe
        self._specs = specs
        self._names = [n for n, *_ in exe.input_slots()]
        self._outs = exe.outputs()
        self._tuple = tuple_out
        self._bound: set[str] = set()

    def __call__(self, **arrays: Any) -> Any:
        feeds = _check_feeds(self._names, arrays, self._specs, self._bound)
        raw = self._exe.run(feeds, None, list(range(len(self._outs))))
        outs = [np.frombuffer(b, dtype=_NP[d]).reshape(s) for b, (s, d) in zip(raw, self._outs)]
        return tuple(outs) if self._tuple else outs[0]

    def _spec(self, name: str) -> InputSpec:
        if not isinstance(name, str) or name not in self._specs:
            raise InputError(f"[{name}] unknown input; expected {sorted(self._specs)}")
        if name not in self._names:
            raise InputError(f"[{name}] this input is not used by the function")
        return self._specs[name]

    def bind(self, name: str, array: Any) -> None:
        """Places a resident input (e.g. a KV cache) in the arena once; later calls omit it."""
        spec = self._spec(name)
        self._exe.bind(name, convert(name, spec.shape, spec.dtype, array))
        self._bound.add(name)

    def view(self, name: str) -> np.ndarray:
        """The arena view of input ``name`` (writable; host-visible devices only)."""
        spec = self._spec(name)
        raw = self._exe.input_view(name)
        if raw is None:
            raise RlxError(f"[{name}] this device's memory is not host-visible")
        return np.frombuffer(raw, dtype=_NP[spec.dtype]).reshape(spec.shape)

    def write_rows(self, name: str, start: int, rows: Any, axis: int = 0) -> None:
        """Writes ``rows`` into input ``name`` in place from index ``start`` along ``axis``
        (bounds-checked: rows past the end raise ``InputError`` and nothing is written)."""
        spec = self._spec(name)
        start = _check.integer("write_rows", "start", start)
        axis = _check.integer("write_rows", "axis", axis)
        if not -len(spec.shape) <= axis < len(spec.shape):
            raise ShapeError(f"[{name}] axis {axis} is out of range for shape {spec.shape}")
        axis %= len(spec.shape)
        if not 0 <= start <= spec.shape[axis]:
            raise InputError(f"[{name}] start {start} is out of range [0, {spec.shape[axis]}] along axis {axis}")
        try:
            rows = np.asarray(rows)
        except (TypeError, ValueError) as e:
            raise DTypeError(f"[{name}] rows must be an array: {e}") from None
        expect = list(spec.shape)
        expect[axis] = rows.shape[axis] if rows.ndim == len(spec.shape) else -1
        if rows.ndim != len(spec.shape) or list(rows.shape) != expect:
            raise ShapeError(f"[{name}] rows of shape {rows.shape} do not match {spec.shape} outside axis {axis}")
        self._exe.write_rows(name, axis, start, convert(name, rows.shape, spec.dtype, rows))

    def memory(self) -> dict[str, int]:
        return dict(self._exe.memory())


def compile_train_step(loss_fn: Callable[..., Tensor], model: Module, optimizer: Optimizer,
                       inputs: Mapping[str, Any], device: str = "cpu") -> TrainStep:
    """Traces ``loss_fn(model, **tensors)``, differentiates it w.r.t. every parameter and compiles
    forward, backward and the optimizer update into one executable on ``device``."""
    if not isinstance(model, Module):
        raise RlxError(f"compile_train_step needs an rlx.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, Optimizer):
        raise RlxError(f"compile_train_step needs an rlx.optim optimizer, got {type(optimizer).__name__}")
    _check.function("compile_train_step", "loss_fn", loss_fn)
    device = _rlx.check_device(_check.device(device))
    specs = _specs(inputs)
    store = model._store_for(device)
    if not store.entries():
        raise RlxError("the model has no parameters to train")
    t, loss, param_ids = _trace(loss_fn, model, specs, store)
    if not isinstance(loss, Tensor):
        raise RlxError(f"loss_fn must return an rlx.Tensor, got {type(loss).__name__}")
    if loss.shape != () or loss.dtype != "float32":
        raise ShapeError(f"[loss] loss_fn must return a float32 scalar, got {loss.dtype} {loss.shape}")
    backward = t.graph.grad(loss._id, param_ids)
    state = optimizer._state_for(store)
    exe = _rlx.Executable(backward, store, device, (optimizer._rule_name(), state))
    return TrainStep(exe, model, optimizer, specs, [n for n, _, _ in store.entries()])


def compile(forward_fn: Callable[..., Any], model: Module, inputs: Mapping[str, Any], device: str = "cpu") -> Function:
    """Traces ``forward_fn(model, **tensors)`` into an inference executable on ``device``."""
    if not isinstance(model, Module):
        raise RlxError(f"compile needs an rlx.nn.Module, got {type(model).__name__}")
    _check.function("compile", "forward_fn", forward_fn)
    device = _rlx.check_device(_check.device(device))
    specs = _specs(inputs)
    store = model._store_for(device)
    t, out, _ = _trace(forward_fn, model, specs, store)
    outs = out if isinstance(out, tuple) else (out,)
    ids = []
    for o in outs:
        if not isinstance(o, Tensor):
            o = t.constant(o) if isinstance(o, (np.ndarray, float, int)) else o
        if not isinstance(o, Tensor):
            raise RlxError(f"forward_fn must return rlx.Tensor(s), got {type(o).__name__}")
        ids.append(o._id)
    t.graph.set_outputs(ids)
    exe = _rlx.Executable(t.graph, store, device, None)
    return Function(exe, specs, isinstance(out, tuple))
