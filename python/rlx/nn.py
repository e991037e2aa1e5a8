"""Modules and parameters. Weights live in host arrays until a model is compiled; from then on in
the device's weight store, which every executable compiled from the model shares."""

from __future__ import annotations

import math
import sys
import threading
from typing import Any, Iterable, Iterator, Mapping, NamedTuple

import numpy as np

from . import _check, _rlx
from ._arrays import _NP, DTYPES, FLOATS, contiguous, from_bytes, parse_dtype, raw
from ._dlpack import export
from ._random import rng
from ._tensor import (
    Tensor,
    _as_tensor,
    _current,
    _matmul_nt,
    _trace_of,
    concat,
    embedding,
    gelu,
    layer_norm,
    leaky_relu,
    matmul,
    relu,
    scaled_dot_product_attention,
    sigmoid,
    silu,
    softmax,
    tanh,
    where,
)
from ._vision import avg_pool2d, batch_norm, conv2d, dropout, max_pool2d
from .errors import CheckpointError, DTypeError, InputError, RlxError, ShapeError

#: Bumped whenever a Parameter, buffer or sub-module is assigned, replaced or removed anywhere;
#: compiled executables re-check their model's structure only when it moved.
_STRUCTURE = [0]
#: Serialises weight-store creation (two threads compiling one fresh model share one store).
_STORE_LOCK = threading.RLock()
#: Metadata key rlx writes into checkpoints: the Linear weight layout.
LAYOUT_KEY = "rlx.layout"
LAYOUT = "out_in"


def _bump() -> None:
    _STRUCTURE[0] += 1


class Parameter:
    """A trainable tensor: float32 unless ``dtype`` says otherwise (``"float16"``,
    ``"bfloat16"``, ``"float64"`` hold and checkpoint values; models of them compile for
    inference, float64 ones computing in float64 on the CPU, where float64 weights also train;
    training low-precision weights raises ``DTypeError``; see ``Module.to``).

    Before compiling, ``numpy()`` returns the parameter's own host array. After compiling on a
    host-visible device it is a zero-copy view into the weight store: writing to it changes what
    the next step computes. ``requires_grad=False`` freezes it (no gradient, no update, no decay).

    Example:
        >>> p = rlx.nn.Parameter(np.zeros((2, 3)))
        >>> p.shape, np.asarray(p).dtype
        ((2, 3), dtype('float32'))
    """

    _is_buffer = False

    #: The dtypes this kind of tensor may hold.
    _allowed = FLOATS

    def __init__(self, data: Any, requires_grad: bool = True, dtype: Any = None) -> None:
        try:
            arr = np.asarray(data)
        except (TypeError, ValueError) as e:
            raise DTypeError(f"[Parameter] cannot make an array of {type(data).__name__}: {e}") from None
        kind = type(self).__name__
        if dtype is None:
            if arr.dtype.kind != "f" and arr.dtype.name != "bfloat16" and not self._is_buffer:
                raise DTypeError(f"[{kind}] parameters are float32; got an array of dtype {arr.dtype}")
            dtype = "float32"  # as before: float arrays of any width become float32
            if self._is_buffer and arr.dtype.kind in "iub":
                dtype = parse_dtype(kind, arr.dtype)  # int32, int64 and bool buffers keep their dtype
        self._dtype = parse_dtype(kind, dtype)
        if self._dtype not in self._allowed:
            raise DTypeError(f"[{kind}] a {kind.lower()} holds one of {list(self._allowed)}, got {self._dtype}")
        if arr.dtype.kind not in "biuf" and arr.dtype.name != "bfloat16":
            raise DTypeError(f"[{kind}] cannot make a {self._dtype} tensor of an array of dtype {arr.dtype}")
        self._host: np.ndarray | None = contiguous(to_dtype(arr, self._dtype)).copy()
        self._store: Any = None
        self._name: str | None = None
        self._view: np.ndarray | None = None
        if not isinstance(requires_grad, (bool, np.bool_)):
            raise InputError(f"[Parameter] requires_grad must be True or False, got {requires_grad!r}")
        self._requires_grad = bool(requires_grad)  # a new parameter is in no compiled model yet

    @property
    def requires_grad(self) -> bool:
        """Whether training updates this tensor (False freezes it; buffers are always False)."""
        return self._requires_grad

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        if not isinstance(value, (bool, np.bool_)):
            raise InputError(f"[Parameter] requires_grad must be True or False, got {value!r}")
        if value and self._is_buffer:
            raise InputError("[buffer] buffers are not trained; requires_grad stays False")
        self._requires_grad = bool(value)
        _bump()  # compiled steps train a fixed set of parameters: they must be compiled again

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape, a tuple of ints."""
        return tuple(self.numpy().shape) if self._host is None else self._host.shape

    @property
    def dtype(self) -> str:
        """The element type: ``"float32"`` unless made or converted (``Module.to``) otherwise."""
        return self._dtype

    @property
    def ndim(self) -> int:
        """The number of dimensions."""
        return len(self.shape)

    def numpy(self) -> np.ndarray:
        """The values: a zero-copy view of the weight store where the host can see it, else a
        read-only copy (CUDA: assign to the parameter to change it).

        Example:
            >>> lin = rlx.nn.Linear(3, 2)
            >>> lin.weight.numpy().shape
            (2, 3)
        """
        if self._store is None:
            assert self._host is not None
            return self._host
        if self._view is not None:
            return self._view
        shape = self._store_shape
        raw = self._store.view(self._name)
        if raw is None:
            # Device memory (CUDA): a read-only copy; writes go through assignment, not the array.
            return from_bytes(self._store.read(self._name), self._dtype, shape)
        self._view = from_bytes(raw, self._dtype, shape)
        return self._view

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        # Before compiling, a copy: a live reference to the host array would be left behind when
        # the values move into the weight store.
        values = self.numpy()
        if self._store is None or copy:
            values = values.copy()
        return values if dtype is None else values.astype(dtype, copy=False)

    def __dlpack__(self, *, stream: Any = None, max_version: Any = None, dl_device: Any = None, copy: Any = None) -> Any:
        """DLPack export: ``torch.from_dlpack(param)`` (or CuPy's, JAX's, numpy's) reads and writes
        the parameter's memory itself, with no copy, on the CPU and on CUDA alike.

        rlx's runs are complete when they return, so the memory is ready on any ``stream``. The
        consumer must not use the tensor while a step of this model runs (as with numpy views),
        and work it queues on the GPU must be finished before the next rlx call (PyTorch:
        ``torch.cuda.synchronize()`` after writing through the tensor). numpy has no bfloat16, so a
        bfloat16 parameter in host memory raises ``BufferError`` (take ``numpy()`` instead).

        Example:
            >>> w = torch.from_dlpack(model.fc1.weight)   # same memory, on rlx's device
        """
        return export(self._name or "parameter", self.__dlpack_device__(), self._dtype, self.numpy,
                      lambda: self._store.dlpack(self._name),
                      "parameter in host memory has no DLPack export (numpy, which provides it, has no bfloat16): "
                      "use numpy() (an ml_dtypes.bfloat16 array) or .to('float32')",
                      stream=stream, max_version=max_version, dl_device=dl_device, copy=copy)

    def __dlpack_device__(self) -> tuple[int, int]:
        """``(DLPack device type, ordinal)``: ``(1, 0)`` for host memory, ``(2, n)`` for ``cuda:n``."""
        dev = None if self._store is None else self._store.dlpack_device()
        return (1, 0) if dev is None else (int(dev[0]), int(dev[1]))

    def _assign(self, values: np.ndarray) -> None:
        """Overwrites the values in place (shape and dtype already checked)."""
        values = contiguous(values, _NP[self._dtype])
        if self._store is None:
            assert self._host is not None
            self._host[...] = values
        else:
            self._store.write(self._name, raw(values.reshape(-1)))

    def _convert(self, dtype: str) -> None:
        """Holds its values as ``dtype`` from now on, on the host until the next compile (a
        weight store has a fixed layout: the model's next compile makes a new one)."""
        self._host = contiguous(to_dtype(np.array(self.numpy()), dtype)).copy()
        self._store, self._name, self._view = None, None, None
        self._dtype = dtype

    def _bind(self, store: Any, name: str) -> None:
        self._store_shape = self.shape
        self._store, self._name, self._view, self._host = store, name, None, None

    def _detach_check(self, name: str) -> None:
        """Refuses to move the values into a store while a ``numpy()`` array taken before
        compiling is still referenced (it would silently stop following the weights)."""
        if self._host is not None and sys.getrefcount(self._host) > 2:
            raise RlxError(
                f"[compile] '{name}'.numpy() (or a DLPack export of it) was taken before compiling and is still referenced; once "
                "compiled, the weights live in the device's weight store and that array would no longer "
                "follow them. Drop it (or keep a copy: np.array(p)) and call numpy() after compiling"
            )

    def __getstate__(self) -> dict[str, Any]:
        return {"data": np.array(self.numpy()), "requires_grad": self._requires_grad, "dtype": self._dtype}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._dtype = state.get("dtype", "float32")
        self._host = np.array(state["data"], dtype=_NP[self._dtype])
        self._store, self._name, self._view = None, None, None
        self._requires_grad = bool(state.get("requires_grad", True))

    def __repr__(self) -> str:
        frozen = "" if self._requires_grad or self._is_buffer else ", requires_grad=False"
        return f"{type(self).__name__}(shape={self.shape}, dtype={self._dtype}{frozen})"

    # Parameters take part in traced arithmetic like tensors.
    def _t(self) -> Tensor:
        return self._in_trace(_trace_of())

    def _in_trace(self, trace: Any) -> Tensor:
        """This parameter as a tensor of ``trace`` (the graph being traced)."""
        node = trace.param_nodes.get(id(self))
        if node is None:
            raise RlxError(
                f"a Parameter of shape {self.shape} was used in a traced function but does not belong to the "
                "model being compiled"
            )
        return Tensor(trace, node)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._t(), name)


class Buffer(Parameter):
    """Non-trainable state saved in checkpoints (e.g. running statistics); made by
    ``Module.register_buffer``. It lives in the weight store beside the parameters.

    Example:
        >>> m = rlx.nn.Module()
        >>> m.register_buffer("running_mean", np.zeros(4, np.float32))
        >>> list(m.buffers())
        ['running_mean']
    """

    _is_buffer = True
    _allowed = DTYPES

    def __init__(self, data: Any, dtype: Any = None) -> None:
        super().__init__(data, requires_grad=False, dtype=dtype)

    def update(self, value: Any) -> None:
        """Inside a traced training step: after each call of the compiled step (one that is not
        skipped), this buffer holds ``value`` — written in place inside the same native call.
        Used by layers that keep running statistics; ignored by ``rlx.compile`` functions.

        Example:
            >>> def __call__(self, x):                       # in a layer, in train mode
            ...     mean = x.mean(axis=0)
            ...     self.running_mean.update(0.9 * self.running_mean + 0.1 * mean)
            ...     return x - mean
        """
        trace = _current()
        if trace is None:
            raise RlxError("[Buffer.update] only inside a traced function (a layer's __call__ during compile)")
        if not isinstance(value, Tensor):
            value = trace.constant(np.broadcast_to(np.asarray(value, np.float32), self.shape))
        if tuple(value.shape) != self.shape or value.dtype != self.dtype:
            raise ShapeError(f"[Buffer.update] the buffer is {self.dtype} {self.shape}, the update {value.dtype} {tuple(value.shape)}")
        updates = trace.__dict__.setdefault("buffer_updates", {})
        updates[id(self)] = (self, value)


# The Python operator dunders (arithmetic and reflected, unary, comparisons, indexing): those
# Tensor defines, Parameter forwards. Others (hashing, truth value, numpy hooks, pickling) are
# not operators and keep Parameter's own behaviour: identity hashing (usable as a dict key or set
# member), truthiness as any object, ``np.asarray(parameter)``.
_BINARY_OPS = ["add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "divmod", "pow", "lshift", "rshift",
               "and", "xor", "or"]
OPERATOR_DUNDERS = frozenset(
    [f"__{op}__" for op in _BINARY_OPS] + [f"__r{op}__" for op in _BINARY_OPS]
    + [f"__{op}__" for op in ["neg", "pos", "abs", "invert", "lt", "le", "eq", "ne", "gt", "ge", "getitem", "iter"]]
)


def _forward_ops() -> None:
    """Every operator of ``Tensor`` (``==``/``!=`` included) behaves the same on a Parameter
    inside a traced function. ``==`` and ``!=`` outside a trace compare identity (Python's
    default), so Parameters in lists and dicts work as before."""
    own = set(vars(Parameter))
    for name in sorted(OPERATOR_DUNDERS & set(vars(Tensor)) - own):

        def method(self: Parameter, *args: Any, _name: str = name) -> Any:
            return getattr(self._t(), _name)(*args)

        if name in ("__eq__", "__ne__"):

            def method(self: Parameter, other: Any, _name: str = name) -> Any:  # noqa: F811
                if _current() is None and not isinstance(other, Tensor):
                    return NotImplemented  # identity comparison outside a trace
                return getattr(self._t(), _name)(other)

        method.__name__ = name
        setattr(Parameter, name, method)
    Parameter.__hash__ = object.__hash__  # type: ignore[method-assign]  # defining __eq__ would drop it
    Parameter.__array_priority__ = 1000  # type: ignore[attr-defined]
    Parameter.__array_ufunc__ = None  # type: ignore[attr-defined]  # numpy operands defer to us


_forward_ops()


class IncompatibleKeys(NamedTuple):
    """What ``load_state_dict(..., strict=False)`` returns: names the model has that the dict
    lacks, and names the dict has that the model lacks.

    Example:
        >>> missing, unexpected = model.load_state_dict(partial, strict=False)
    """

    missing_keys: list[str]
    unexpected_keys: list[str]


def _holds_modules(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return any(isinstance(v, (Module, Parameter)) for v in value)
    if isinstance(value, dict):
        return any(isinstance(v, (Module, Parameter)) for v in value.values())
    return False


def _to_array(name: str, value: Any) -> np.ndarray:
    """``value`` (numpy, PyTorch tensor, anything with ``__array__`` / ``__dlpack__``) as numpy."""
    mod = type(value).__module__ or ""
    if mod.startswith("torch") and hasattr(value, "detach"):
        t = value.detach().cpu()
        if str(t.dtype) in ("torch.bfloat16", "torch.float16"):
            t = t.float()
        return t.numpy()
    try:
        if not hasattr(value, "__array__") and hasattr(value, "__dlpack__"):
            return np.from_dlpack(value)
        arr = np.asarray(value)
    except (TypeError, ValueError, RuntimeError, BufferError) as e:
        raise CheckpointError(f"'{name}': cannot read a {type(value).__name__} as an array: {e}") from None
    if arr.dtype == object:
        raise CheckpointError(f"'{name}': cannot read a {type(value).__name__} as an array of numbers")
    return arr


def _cast(name: str, arr: np.ndarray, dtype: str = "float32") -> np.ndarray:
    """Casts to the tensor's ``dtype`` as PyTorch's ``copy_`` does: into a float tensor from any
    number (floats round to nearest even: float64 / float32 -> float16 / bfloat16 included);
    into an integer tensor from integers whose values fit (out of range: ``CheckpointError``
    naming the tensor; floats are refused rather than truncated); into bool from bools."""
    if not (arr.dtype.kind in "biuf" or arr.dtype.name == "bfloat16"):
        raise CheckpointError(f"'{name}': cannot load a {arr.dtype} array into a {dtype} tensor")
    if dtype in ("int32", "int64"):
        if arr.dtype.kind not in "biu":
            raise CheckpointError(f"'{name}': cannot load {arr.dtype} values into an {dtype} tensor")
        info = np.iinfo(dtype)
        if arr.size and arr.dtype.kind != "b" and (int(arr.min()) < info.min or int(arr.max()) > info.max):
            raise CheckpointError(f"'{name}': values {arr.min()}..{arr.max()} do not fit in the model's {dtype}")
    elif dtype == "bool" and arr.dtype.kind != "b":
        raise CheckpointError(f"'{name}': cannot load {arr.dtype} values into a bool tensor")
    return to_dtype(arr, dtype)


def _round_odd_f32(x: np.ndarray) -> np.ndarray:
    """float64 values as float32 rounded to odd (an inexact result steps toward zero and gets
    its last bit set), so that rounding them again to bfloat16 rounds correctly once."""
    f = x.astype(np.float32)
    back = f.astype(np.float64)
    inexact = (back != x) & np.isfinite(x)
    bits = f.view(np.uint32).copy()
    bits[inexact & (np.abs(back) > np.abs(x))] -= 1
    bits[inexact] |= 1
    return bits.view(np.float32)


def to_dtype(arr: np.ndarray, dtype: str) -> np.ndarray:
    """A C-contiguous copy (or ``arr`` itself) in rlx ``dtype``, rounding to nearest even once:
    float64 -> bfloat16 through a float32 rounded to odd (``ml_dtypes`` goes through a plain
    float32, which can round twice); numpy's own conversions are correct for the others."""
    if dtype == "bfloat16" and arr.dtype == np.float64:
        arr = _round_odd_f32(arr)
    return contiguous(arr, _NP[dtype])


#: safetensors dtype names -> rlx's, and the bytes per element of each.
_FILE_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64", "I32": "int32",
               "I64": "int64", "BOOL": "bool"}
_FILE_SIZES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I32": 4, "I64": 8, "BOOL": 1}


def _loads_into(file_dtype: str, dtype: str) -> bool:
    """Whether a checkpoint tensor of ``file_dtype`` (rlx name) loads into a ``dtype`` tensor."""
    if dtype in FLOATS:
        return file_dtype in FLOATS
    if dtype in ("int32", "int64"):
        return file_dtype in ("int32", "int64")
    return file_dtype == dtype


def _from_file(dtype: str, shape: list[int], data: bytes) -> np.ndarray:
    if dtype in DTYPES:
        return from_bytes(data, dtype, shape)
    return np.frombuffer(data, dtype=np.dtype(dtype).newbyteorder("<")).reshape(shape)


class Module:
    """Base class of models: assign Parameters and sub-Modules as attributes, define ``__call__``
    (or ``forward``).

    Example:
        >>> class MLP(rlx.nn.Module):
        ...     def __init__(self):
        ...         self.fc1, self.fc2 = rlx.nn.Linear(4, 8), rlx.nn.Linear(8, 2)
        ...     def __call__(self, x):
        ...         return self.fc2(rlx.relu(self.fc1(x)))
        >>> list(MLP().parameters())
        ['fc1.weight', 'fc1.bias', 'fc2.weight', 'fc2.bias']
    """

    #: True in training mode (the default), False after ``eval()``.
    training = True
    _children: dict[str, Any]
    _stores: dict[str, Any]

    def _init_registry(self) -> None:
        if "_children" not in self.__dict__:
            object.__setattr__(self, "_children", {})
            object.__setattr__(self, "_stores", {})

    def __setattr__(self, name: str, value: Any) -> None:
        self._init_registry()
        if _holds_modules(value):
            kind = "dict" if isinstance(value, dict) else type(value).__name__
            holder = "rlx.nn.ModuleDict" if isinstance(value, dict) else "rlx.nn.ModuleList"
            raise RlxError(
                f"[{type(self).__name__}.{name}] a plain {kind} of modules or parameters is not registered "
                f"(its parameters would not be trained or saved); use {holder}(...)"
            )
        old = self._children.get(name)
        if isinstance(old, Parameter) and isinstance(value, np.ndarray):
            kind = "buffer" if old._is_buffer else "parameter"
            raise RlxError(
                f"[{type(self).__name__}.{name}] assigning a numpy array would unregister the {kind} (it would no "
                f"longer be {'saved' if old._is_buffer else 'trained or saved'}); wrap it, "
                f"rlx.nn.{'Buffer' if old._is_buffer else 'Parameter'}(array), or load values with load_state_dict")
        if isinstance(value, (Parameter, Module)):
            self._children[name] = value
            if old is not value:
                _bump()
        elif old is not None:
            del self._children[name]
            _bump()
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if name in self.__dict__.get("_children", {}):
            del self._children[name]
            _bump()
        object.__delattr__(self, name)

    def register_buffer(self, name: str, value: Any) -> None:
        """Adds non-trainable state ``name`` (saved in checkpoints, listed by ``buffers()``).
        Float arrays become float32 (``Buffer(value, dtype=...)`` keeps another float dtype);
        int32, int64 and bool arrays keep their dtype.

        Example:
            >>> m = rlx.nn.Module()
            >>> m.register_buffer("count", np.zeros(1, np.float32))
        """
        setattr(self, name, value if isinstance(value, Buffer) else Buffer(value))

    def _walk(self, prefix: str) -> Iterator[tuple[str, Parameter]]:
        for name, child in self.__dict__.get("_children", {}).items():
            if isinstance(child, Parameter):
                yield prefix + name, child
            else:
                yield from child._walk(prefix + name + ".")

    def _tensors(self) -> dict[str, Parameter]:
        """Parameters and buffers by dotted name, each once, in assignment order."""
        out: dict[str, Parameter] = {}
        seen: set[int] = set()
        for name, p in self._walk(""):
            if id(p) not in seen:
                seen.add(id(p))
                out[name] = p
        return out

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Parameter]]:
        """``(dotted name, Parameter)`` pairs, each parameter once (buffers left out).

        Example:
            >>> [n for n, _ in rlx.nn.Linear(3, 2).named_parameters()]
            ['weight', 'bias']
        """
        for name, p in self._tensors().items():
            if not p._is_buffer:
                yield prefix + name, p

    def parameters(self) -> dict[str, Parameter]:
        """Every parameter by dotted name (``"fc1.weight"``), in assignment order.

        Example:
            >>> list(rlx.nn.Linear(3, 2).parameters())
            ['weight', 'bias']
        """
        return dict(self.named_parameters())

    def buffers(self) -> dict[str, Parameter]:
        """Every buffer (non-trainable saved state) by dotted name.

        Example:
            >>> rlx.nn.Linear(3, 2).buffers()
            {}
        """
        return {n: p for n, p in self._tensors().items() if p._is_buffer}

    def modules(self) -> Iterator[tuple[str, "Module"]]:
        """``(dotted name, Module)`` for this module (name ``""``) and every sub-module.

        Example:
            >>> [n for n, _ in rlx.nn.Sequential(rlx.nn.Linear(2, 2)).modules()]
            ['', '0']
        """
        yield "", self
        for name, child in self.__dict__.get("_children", {}).items():
            if isinstance(child, Module):
                for sub, m in child.modules():
                    yield (name + "." + sub if sub else name), m

    def train(self, mode: bool = True) -> "Module":
        """Sets training mode on this module and every sub-module; returns ``self``.

        Example:
            >>> m = rlx.nn.Linear(2, 2).eval()
            >>> m.training
            False
        """
        for _, m in self.modules():
            object.__setattr__(m, "training", bool(mode))
        return self

    def eval(self) -> "Module":
        """Sets evaluation mode (``train(False)``); returns ``self``.

        Example:
            >>> model.eval().training
            False
        """
        return self.train(False)

    def to(self, dtype: Any) -> "Module":
        """Converts every floating-point parameter and buffer to ``dtype`` (``"float32"``,
        ``"float16"``, ``"bfloat16"``, ``"float64"``), rounding to nearest even, as PyTorch's
        ``module.to(dtype)``; integer and bool buffers are kept. Returns the module. A model
        in another dtype is stored, saved and loaded as such and compiles for inference
        (float64 computes in float64 on the CPU; bfloat16/float16 in float32, rounded back);
        training one raises ``DTypeError`` naming the parameter (train float32 weights, with
        ``precision=`` for low-precision compute).

        Example:
            >>> m = rlx.nn.Linear(3, 2).to("bfloat16")
            >>> m.weight.dtype
            'bfloat16'
        """
        to = parse_dtype("Module.to", dtype)
        if to not in FLOATS:
            raise DTypeError(f"[Module.to] parameters are floating point; {to} is not one of {list(FLOATS)}")
        for name, p in self._tensors().items():
            if p.dtype in FLOATS and p.dtype != to:
                p._convert(to)
        _bump()
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = getattr(self, "forward", None)
        if forward is None:
            raise RlxError(f"{type(self).__name__} defines neither __call__ nor forward")
        return forward(*args, **kwargs)

    # --- weight stores -------------------------------------------------------------------------

    def _store_for(self, device: str) -> Any:
        """The weight store of this model on ``device``, created (with the current values) once;
        made again (values carried over) when parameters were added or replaced since."""
        with _STORE_LOCK:
            self._init_registry()
            params = self._tensors()
            layout = [(n, list(p.shape), p.dtype) for n, p in params.items()]
            store = self._stores.get(device)
            if store is not None and store.entries() == [(n, s, d) for n, s, d in layout] and all(
                p._store is store and p._name == n for n, p in params.items()
            ):
                return store
            for n, p in params.items():
                p._detach_check(n)
            store = _rlx.Store(device, layout)
            for n, p in params.items():
                store.write(n, raw(contiguous(p.numpy(), _NP[p.dtype]).reshape(-1)))
            # A parameter held by another model's store (this is a sub-module of a compiled model,
            # or shares layers with one) moves to this one: the executables of the other store
            # would go on updating weights nothing reads, so they must see the move and refuse
            # to run (their signature holds the stores; see `_signature`).
            moved = any(p._store is not None and p._store is not self._stores.get(device) for p in params.values())
            for n, p in params.items():
                p._bind(store, n)
            self._stores[device] = store
            if moved:
                _bump()
            return store

    def _signature(self) -> tuple[Any, ...]:
        """What compiled executables depend on: every tensor's name, identity, trainability,
        dtype and the weight store holding it."""
        return tuple((n, id(p), p._requires_grad, p._dtype, id(p._store)) for n, p in self._tensors().items())

    # --- copies --------------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_stores"] = {}  # the copy is uncompiled; its parameters carry the current values
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            object.__setattr__(self, k, v)

    # --- state dicts and checkpoints -----------------------------------------------------------

    def _snapshot(self) -> dict[str, np.ndarray]:
        """Copies of every parameter and buffer, each weight store read under its lock: the
        values of one step, never half of one update and half of the next."""
        params = self._tensors()
        stores = {id(p._store): p._store for p in params.values() if p._store is not None}
        read = {sid: dict(store.read_all()) for sid, store in stores.items()}
        out = {}
        for n, p in params.items():
            if p._store is None:
                assert p._host is not None
                out[n] = p._host.copy()
            else:
                raw = read[id(p._store)][p._name]
                out[n] = from_bytes(raw, p.dtype, p._store_shape).copy()
        return out

    def state_dict(self) -> dict[str, np.ndarray]:
        """Copies of every parameter and buffer by dotted name (PyTorch's names and layouts), each
        in its dtype (bfloat16 as ``ml_dtypes.bfloat16`` arrays).

        Example:
            >>> sd = rlx.nn.Linear(3, 2).state_dict()
            >>> {k: v.shape for k, v in sd.items()}
            {'weight': (2, 3), 'bias': (2,)}
        """
        return self._snapshot()

    def _linear_weights(self) -> dict[str, tuple[int, int]]:
        """Dotted names of every Linear weight with its (out_features, in_features)."""
        out = {}
        for prefix, m in self.modules():
            if isinstance(m, Linear) and isinstance(m.__dict__.get("weight"), Parameter):
                out[(prefix + "." if prefix else "") + "weight"] = (m.out_features, m.in_features)
        return out

    def _check_and_assign(self, arrays: dict[str, np.ndarray], strict: bool, where: str,
                          marked_new_layout: bool, legacy_layout: bool = False,
                          from_file: bool = False) -> IncompatibleKeys:
        """Validates every name and shape first, then assigns (all or nothing)."""
        params = self._tensors()
        missing = [n for n in params if n not in arrays]
        unexpected = [n for n in arrays if n not in params]
        if strict and (missing or unexpected):
            raise CheckpointError(f"{where}does not match the model: missing {missing}, unexpected {unexpected}")
        linear = self._linear_weights()
        ready: dict[str, np.ndarray] = {}
        for name, p in params.items():
            if name not in arrays:
                continue
            arr = arrays[name]
            shape = tuple(arr.shape)
            if legacy_layout and name in linear and arr.ndim == 2:
                arr, shape = arr.T, shape[::-1]
            if shape != p.shape:
                if name in linear and shape == p.shape[::-1] and not marked_new_layout and from_file:
                    raise CheckpointError(
                        f"{where}'{name}' is {shape}: the older rlx (in_features, out_features) Linear layout. "
                        f"rlx now stores Linear weights as PyTorch does, (out_features, in_features) = {p.shape}; "
                        "load files saved by rlx before 0.2 with load(path, legacy_layout=True) and save them again"
                    )
                hint = " (PyTorch's Linear layout is (out_features, in_features))" if name in linear else ""
                raise CheckpointError(f"{where}'{name}' has shape {shape} but the model's is {p.shape}{hint}")
            ready[name] = _cast(name, arr, p.dtype)
        # One write per weight store: a function running in another thread sees all old values
        # or all new ones.
        by_store: dict[int, tuple[Any, list[tuple[str, np.ndarray]]]] = {}
        for name, arr in ready.items():
            p = params[name]
            if p._store is None:
                p._assign(arr)
            else:
                by_store.setdefault(id(p._store), (p._store, []))[1].append((p._name, raw(arr.reshape(-1))))
        for store, writes in by_store.values():
            store.write_many(writes)
        return IncompatibleKeys(missing, unexpected)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> IncompatibleKeys:
        """Loads values by dotted name, cast to each tensor's dtype as PyTorch's ``copy_`` does
        (integer tensors take integers that fit, else ``CheckpointError``).

        ``state_dict`` may hold numpy arrays, PyTorch tensors or anything with ``__array__`` /
        ``__dlpack__``. With ``strict=True`` (default) a missing or unexpected name raises
        ``CheckpointError``; with ``strict=False`` they are returned as
        ``(missing_keys, unexpected_keys)``. A wrong shape always raises; nothing changes then.

        Example:
            >>> a, b = rlx.nn.Linear(3, 2), rlx.nn.Linear(3, 2)
            >>> b.load_state_dict(a.state_dict())
            IncompatibleKeys(missing_keys=[], unexpected_keys=[])
        """
        if not isinstance(state_dict, Mapping):
            raise CheckpointError(f"[load_state_dict] expects a mapping of names to arrays, got {type(state_dict).__name__}")
        if not isinstance(strict, (bool, np.bool_)):
            raise InputError(f"[load_state_dict] strict must be True or False, got {strict!r}")
        arrays = {}
        for k, v in state_dict.items():
            if not isinstance(k, str):
                raise CheckpointError(f"[load_state_dict] names must be strings, got {k!r}")
            arrays[k] = _to_array(k, v)
        return self._check_and_assign(arrays, bool(strict), "[load_state_dict] ", marked_new_layout=False)

    def save(self, path: str) -> None:
        """Writes every parameter and buffer to a safetensors file, atomically (PyTorch's names
        and layouts: ``safetensors.torch.load_file`` reads it). After ``rlx.distributed.init()``
        rank 0 writes and the other ranks wait for it.

        Example:
            >>> rlx.nn.Linear(3, 2).save("lin.safetensors")
        """
        path = _check.path("save", path)
        params = self._tensors()
        tensors = [(n, params[n].dtype, list(v.shape), raw(v.reshape(-1))) for n, v in self._snapshot().items()]
        from . import distributed

        distributed._on_rank0(lambda: _rlx.save_checkpoint(str(path), tensors, {LAYOUT_KEY: LAYOUT}))

    def load(self, path: str, legacy_layout: bool = False) -> None:
        """Loads a safetensors checkpoint: rlx's own, or one written by
        ``safetensors.torch.save_file(model.state_dict(), path)``. Each tensor is cast to the
        model's dtype for it: float16 / bfloat16 / float32 / float64 into any float tensor,
        int32 / int64 into integer tensors when the values fit (else ``CheckpointError`` naming
        the tensor). Every name and shape is checked before any weight changes;
        on a mismatch ``CheckpointError`` is raised and nothing changes. Files from rlx before
        0.2 stored Linear weights transposed: they are refused unless ``legacy_layout=True``.

        Example:
            >>> lin = rlx.nn.Linear(3, 2)
            >>> lin.save("lin.safetensors"); lin.load("lin.safetensors")
        """
        path = _check.path("load", path)
        params = self._tensors()
        # Names, dtypes and shapes first, from the header alone (before any data is read).
        header = {name: (dtype, tuple(shape)) for name, dtype, shape in _rlx.checkpoint_header(str(path))}
        missing = sorted(set(params) - set(header))
        unexpected = sorted(set(header) - set(params))
        if missing or unexpected:
            raise CheckpointError(f"{path}: checkpoint does not match the model: missing {missing}, unexpected {unexpected}")
        linear = self._linear_weights()
        for name, p in params.items():
            dtype, shape = header[name]
            shown = _FILE_NAMES.get(dtype, dtype)
            if not _loads_into(shown, p.dtype):
                how = ("float32/float16/bfloat16/float64 tensors load by casting" if p.dtype in FLOATS else
                       "int32/int64 tensors load when the values fit" if p.dtype != "bool" else "bool loads from bool only")
                raise CheckpointError(f"{path}: '{name}' is {shown} {shape} in the checkpoint but {p.dtype} {p.shape} in "
                                      f"the model ({how})")
            transposed = name in linear and shape == p.shape[::-1]
            if shape != p.shape and not transposed:
                raise CheckpointError(f"{path}: '{name}' is {shown} {shape} in the checkpoint but {p.dtype} {p.shape} in the model")
        expected = sum(_FILE_SIZES[header[n][0]] * int(np.prod(p.shape)) for n, p in params.items())
        tensors, metadata = _rlx.load_checkpoint_raw(str(path), expected)
        if legacy_layout and metadata.get(LAYOUT_KEY) == LAYOUT:
            # A square weight would transpose silently: the file says it is in today's layout.
            raise CheckpointError(
                f"{path}: legacy_layout=True is for files saved by rlx before 0.2, but this file was written in "
                f"today's (out_features, in_features) layout (its '{LAYOUT_KEY}' metadata is '{LAYOUT}'); load it "
                "without legacy_layout")
        arrays = {}
        for name, file_dtype, file_shape, data in tensors:
            if not _loads_into(file_dtype, params[name].dtype):
                raise CheckpointError(f"{path}: '{name}' is {file_dtype}; the model's tensor is {params[name].dtype}")
            arrays[name] = _from_file(file_dtype, file_shape, data)
        self._check_and_assign(arrays, True, f"{path}: ", marked_new_layout=metadata.get(LAYOUT_KEY) == LAYOUT, from_file=True,
                               legacy_layout=bool(legacy_layout))

    # --- printing ------------------------------------------------------------------------------

    def extra_repr(self) -> str:
        """The text inside this module's parentheses in ``repr`` (override in layers).

        Example:
            >>> class Scale(rlx.nn.Module):
            ...     def extra_repr(self):
            ...         return "factor=2"
        """
        return ""

    def __repr__(self) -> str:
        children = self.__dict__.get("_children", {})
        name = type(self).__name__
        if not children or (self.extra_repr() and all(isinstance(c, Parameter) for c in children.values())):
            return f"{name}({self.extra_repr()})"
        lines = [f"{name}(" + self.extra_repr()]
        for key, child in children.items():
            text = repr(child).replace("\n", "\n  ")
            lines.append(f"  ({key}): {text}")
        return "\n".join(lines) + "\n)"


class ModuleList(Module):
    """A list of sub-modules, registered as ``"0"``, ``"1"``, ... (plain lists are not).

    Example:
        >>> layers = rlx.nn.ModuleList([rlx.nn.Linear(4, 4) for _ in range(2)])
        >>> list(layers.parameters())
        ['0.weight', '0.bias', '1.weight', '1.bias']
    """

    _items: list[Module]

    def __init__(self, modules: Iterable[Module] = ()) -> None:
        object.__setattr__(self, "_items", [])
        self.extend(modules)

    def _register(self) -> None:
        self._init_registry()
        self._children.clear()
        for i, m in enumerate(self._items):
            self._children[str(i)] = m
        _bump()

    @staticmethod
    def _checked(m: Any, i: int) -> Module:
        if not isinstance(m, Module):
            raise RlxError(f"[ModuleList] item {i} is a {type(m).__name__}, not an rlx.nn.Module")
        return m

    def append(self, module: Module) -> "ModuleList":
        """Adds ``module`` at the end.

        Example:
            >>> layers.append(rlx.nn.Linear(4, 4))
        """
        self._items.append(self._checked(module, len(self._items)))
        self._register()
        return self

    def extend(self, modules: Iterable[Module]) -> "ModuleList":
        """Adds every module of ``modules`` at the end.

        Example:
            >>> layers.extend([rlx.nn.Linear(4, 4), rlx.nn.Linear(4, 4)])
        """
        for m in modules:
            self._items.append(self._checked(m, len(self._items)))
        self._register()
        return self

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return ModuleList(self._items[i])
        return self._items[i]

    def __setitem__(self, i: int, module: Module) -> None:
        self._items[i] = self._checked(module, i)
        self._register()

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Module]:
        return iter(list(self._items))


class ModuleDict(Module):
    """A dict of sub-modules by name (plain dicts are not registered).

    Example:
        >>> heads = rlx.nn.ModuleDict({"cls": rlx.nn.Linear(4, 3)})
        >>> list(heads.parameters())
        ['cls.weight', 'cls.bias']
    """

    def __init__(self, modules: Mapping[str, Module] | None = None) -> None:
        self._init_registry()
        for k, v in (modules or {}).items():
            self[k] = v

    def __setitem__(self, key: str, module: Module) -> None:
        if not isinstance(key, str) or not key or "." in key:
            raise RlxError(f"[ModuleDict] keys must be non-empty strings without '.', got {key!r}")
        if not isinstance(module, Module):
            raise RlxError(f"[ModuleDict] '{key}' is a {type(module).__name__}, not an rlx.nn.Module")
        self._init_registry()
        if self._children.get(key) is not module:
            self._children[key] = module
            _bump()

    def __getitem__(self, key: str) -> Module:
        return self._children[key]

    def __delitem__(self, key: str) -> None:
        del self._children[key]
        _bump()

    def __contains__(self, key: object) -> bool:
        return key in self._children

    def __len__(self) -> int:
        return len(self._children)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._children))

    def keys(self) -> list[str]:
        """The names, in insertion order.

        Example:
            >>> heads.keys()
            ['cls']
        """
        return list(self._children)

    def values(self) -> list[Module]:
        """The modules, in insertion order.

        Example:
            >>> len(heads.values())
            1
        """
        return list(self._children.values())

    def items(self) -> list[tuple[str, Module]]:
        """``(name, module)`` pairs, in insertion order.

        Example:
            >>> [k for k, _ in heads.items()]
            ['cls']
        """
        return list(self._children.items())


class Linear(Module):
    """``y = x @ weight.T + bias`` with ``weight`` of shape (out_features, in_features), PyTorch's
    layout. Initialised as PyTorch's default: U(-1/sqrt(in), 1/sqrt(in)) for weight and bias.

    Example:
        >>> rlx.nn.Linear(64, 10)
        Linear(in_features=64, out_features=10, bias=True)
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, dtype: Any = None) -> None:
        in_features = _check.integer("Linear", "in_features", in_features, lo=1)
        out_features = _check.integer("Linear", "out_features", out_features, lo=1)
        _check.fits_in_memory("Linear", (in_features, out_features))
        bound = 1.0 / math.sqrt(in_features)
        self.in_features, self.out_features = in_features, out_features
        self.weight = Parameter(rng().uniform(-bound, bound, (out_features, in_features)), dtype=dtype)
        self.bias = Parameter(rng().uniform(-bound, bound, (out_features,)), dtype=dtype) if bias else None

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"

    def __call__(self, x: Any) -> Tensor:
        shape = x.shape
        if len(shape) < 1 or shape[-1] != self.in_features:
            raise ShapeError(f"[Linear] expects inputs (..., {self.in_features}), got {tuple(shape)}")
        flat = x.reshape(-1, self.in_features) if len(shape) != 2 else x
        t = _trace_of(flat, self.weight)
        y = _matmul_nt(_as_tensor(flat, t), _as_tensor(self.weight, t))
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features) if len(shape) != 2 else y


class ReLU(Module):
    """``max(x, 0)`` as a module.

    Example:
        >>> rlx.nn.Sequential(rlx.nn.Linear(4, 8), rlx.nn.ReLU(), rlx.nn.Linear(8, 2))
    """
    def __call__(self, x: Any) -> Tensor:
        return relu(x)


class Conv2d(Module):
    """2-D convolution over (N, C, H, W) inputs, PyTorch's signature, layout
    (``weight`` (out_channels, in_channels, kh, kw)) and initialisation (U(-1/sqrt(fan_in),
    1/sqrt(fan_in)) for weight and bias, fan_in = in_channels * kh * kw).

    Example:
        >>> rlx.nn.Conv2d(1, 16, 3, padding=1)
        Conv2d(1, 16, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1), bias=True)
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int | tuple[int, int],
                 stride: int | tuple[int, int] = 1, padding: int | tuple[int, int] = 0, bias: bool = True, *,
                 dtype: Any = None) -> None:
        from ._vision import _pair

        cin = _check.integer("Conv2d", "in_channels", in_channels, lo=1)
        cout = _check.integer("Conv2d", "out_channels", out_channels, lo=1)
        self.kernel_size = _pair("Conv2d", "kernel_size", kernel_size, 1)
        self.stride = _pair("Conv2d", "stride", stride, 1)
        self.padding = _pair("Conv2d", "padding", padding, 0)
        self.in_channels, self.out_channels = cin, cout
        kh, kw = self.kernel_size
        _check.fits_in_memory("Conv2d", (cout, cin, kh, kw))
        bound = 1.0 / math.sqrt(cin * kh * kw)
        self.weight = Parameter(rng().uniform(-bound, bound, (cout, cin, kh, kw)), dtype=dtype)
        self.bias = Parameter(rng().uniform(-bound, bound, (cout,)), dtype=dtype) if bias else None

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, bias={self.bias is not None}")

    def __call__(self, x: Any) -> Tensor:
        return conv2d(x, self.weight, self.bias, self.stride, self.padding)


class MaxPool2d(Module):
    """Max pooling over (N, C, H, W) inputs (``stride`` defaults to ``kernel_size``).

    Example:
        >>> rlx.nn.MaxPool2d(2)
        MaxPool2d(kernel_size=2, stride=2, padding=0)
    """

    def __init__(self, kernel_size: int | tuple[int, int], stride: int | tuple[int, int] | None = None,
                 padding: int | tuple[int, int] = 0) -> None:
        from ._vision import _pair

        self.kernel_size, self.stride, self.padding = kernel_size, kernel_size if stride is None else stride, padding
        op = type(self).__name__  # checked now, not at the first call
        _pair(op, "kernel_size", self.kernel_size, 1)
        _pair(op, "stride", self.stride, 1)
        _pair(op, "padding", self.padding, 0)

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"

    def __call__(self, x: Any) -> Tensor:
        return max_pool2d(x, self.kernel_size, self.stride, self.padding)


class AvgPool2d(MaxPool2d):
    """Average pooling over (N, C, H, W) inputs (padding counts as zeros in the mean).

    Example:
        >>> rlx.nn.AvgPool2d(2)
        AvgPool2d(kernel_size=2, stride=2, padding=0)
    """

    def __call__(self, x: Any) -> Tensor:
        return avg_pool2d(x, self.kernel_size, self.stride, self.padding)


class _BatchNorm(Module):
    _rank: tuple[int, ...] = ()

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1, affine: bool = True) -> None:
        name = type(self).__name__
        n = _check.integer(name, "num_features", num_features, lo=1)
        self.num_features = n
        self.eps = _check.number(name, "eps", eps, lo=0.0)
        self.momentum = _check.number(name, "momentum", momentum, lo=0.0, hi=1.0)
        self.weight = Parameter(np.ones(n, np.float32)) if affine else None
        self.bias = Parameter(np.zeros(n, np.float32)) if affine else None
        self.register_buffer("running_mean", np.zeros(n, np.float32))
        self.register_buffer("running_var", np.ones(n, np.float32))
        self.register_buffer("num_batches_tracked", np.zeros((), np.float32))

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.weight is not None}"

    def __call__(self, x: Any) -> Tensor:
        name = type(self).__name__
        shape = tuple(x.shape)
        if len(shape) not in self._rank or shape[1] != self.num_features:
            want = " or ".join(f"rank {r}" for r in self._rank)
            raise ShapeError(f"[{name}] expects inputs of {want} with {self.num_features} channels in axis 1, got {shape}")
        if self.training:
            self.num_batches_tracked.update(self.num_batches_tracked + 1.0)
        return batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, self.training,
                          self.momentum, self.eps)


class BatchNorm1d(_BatchNorm):
    """Batch normalisation of (N, C) or (N, C, L) inputs, as PyTorch's: batch statistics in
    train mode (the running mean and unbiased variance updated in place in the step, buffers
    ``running_mean`` / ``running_var`` / ``num_batches_tracked``), running ones in eval mode.

    Example:
        >>> rlx.nn.BatchNorm1d(64)
        BatchNorm1d(64, eps=1e-05, momentum=0.1, affine=True)
    """

    _rank = (2, 3)


class BatchNorm2d(_BatchNorm):
    """Batch normalisation of (N, C, H, W) inputs (see ``BatchNorm1d``).

    Example:
        >>> rlx.nn.BatchNorm2d(16)
        BatchNorm2d(16, eps=1e-05, momentum=0.1, affine=True)
    """

    _rank = (4,)


class Dropout(Module):
    """Zeroes each element with probability ``p`` and scales the rest by ``1/(1-p)`` in train
    mode; the identity in eval mode. Masks come from an in-graph generator seeded by
    ``rlx.seed``: reproducible per step, different at each step.

    Example:
        >>> rlx.nn.Dropout(0.1)
        Dropout(p=0.1)
    """

    def __init__(self, p: float = 0.5) -> None:
        p = _check.number("Dropout", "p", p)
        if not 0.0 <= p < 1.0:
            raise InputError(f"[Dropout] p must be in [0, 1), got {p}")
        self.p = p

    def extra_repr(self) -> str:
        return f"p={self.p}"

    def __call__(self, x: Any) -> Tensor:
        return dropout(x, self.p, self.training)


class Flatten(Module):
    """Flattens dims ``start_dim..end_dim`` (default: all but the batch dim) into one.

    Example:
        >>> rlx.nn.Flatten()                 # (N, C, H, W) -> (N, C*H*W)
        Flatten()
    """

    def __init__(self, start_dim: int = 1, end_dim: int = -1) -> None:
        self.start_dim = _check.integer("Flatten", "start_dim", start_dim)
        self.end_dim = _check.integer("Flatten", "end_dim", end_dim)

    def __call__(self, x: Any) -> Tensor:
        shape = tuple(x.shape)
        n = len(shape)
        a = self.start_dim + n if self.start_dim < 0 else self.start_dim
        b = self.end_dim + n if self.end_dim < 0 else self.end_dim
        if not (0 <= a <= b < n):
            raise ShapeError(f"[Flatten] dims {self.start_dim}..{self.end_dim} are invalid for shape {shape}")
        return x.reshape(*shape[:a], math.prod(shape[a : b + 1]), *shape[b + 1 :])


class Identity(Module):
    """Returns its input.

    Example:
        >>> rlx.nn.Identity()
        Identity()
    """

    def __call__(self, x: Any) -> Any:
        return x


class SiLU(Module):
    """``x * sigmoid(x)`` as a module.

    Example:
        >>> rlx.nn.SiLU()
        SiLU()
    """

    def __call__(self, x: Any) -> Tensor:
        return silu(x)


class Tanh(Module):
    """``tanh(x)`` as a module.

    Example:
        >>> rlx.nn.Tanh()
        Tanh()
    """

    def __call__(self, x: Any) -> Tensor:
        return tanh(x)


class Sigmoid(Module):
    """``sigmoid(x)`` as a module.

    Example:
        >>> rlx.nn.Sigmoid()
        Sigmoid()
    """

    def __call__(self, x: Any) -> Tensor:
        return sigmoid(x)


class LeakyReLU(Module):
    """``x`` for positive x, ``negative_slope * x`` otherwise.

    Example:
        >>> rlx.nn.LeakyReLU(0.1)
        LeakyReLU(negative_slope=0.1)
    """

    def __init__(self, negative_slope: float = 0.01) -> None:
        self.negative_slope = _check.number("LeakyReLU", "negative_slope", negative_slope)

    def extra_repr(self) -> str:
        return f"negative_slope={self.negative_slope}"

    def __call__(self, x: Any) -> Tensor:
        return leaky_relu(x, self.negative_slope)


class Sequential(Module):
    """Applies its modules in order; they are named ``"0"``, ``"1"``, ...

    Example:
        >>> net = rlx.nn.Sequential(rlx.nn.Linear(4, 8), rlx.nn.ReLU(), rlx.nn.Linear(8, 2))
        >>> list(net.parameters())
        ['0.weight', '0.bias', '2.weight', '2.bias']
    """

    _layers: list[Module]

    def __init__(self, *modules: Module) -> None:
        for i, m in enumerate(modules):
            if not isinstance(m, Module):
                raise RlxError(f"[Sequential] item {i} is a {type(m).__name__}, not an rlx.nn.Module")
            setattr(self, str(i), m)
        object.__setattr__(self, "_layers", list(modules))

    def __call__(self, x: Any) -> Any:
        for m in self._layers:
            x = m(x)
        return x

    def __getitem__(self, i: int) -> Module:
        return self._layers[i]

    def __len__(self) -> int:
        return len(self._layers)


class GELU(Module):
    """GELU activation; exact (erf) by default, ``approximate=True`` for the tanh form.

    Example:
        >>> rlx.nn.Sequential(rlx.nn.Linear(4, 16), rlx.nn.GELU(), rlx.nn.Linear(16, 4))
    """

    def __init__(self, approximate: bool | str = False) -> None:
        self.approximate = approximate

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}" if self.approximate else ""

    def __call__(self, x: Any) -> Tensor:
        return gelu(x, self.approximate)


class Embedding(Module):
    """A lookup table of ``num`` vectors of size ``dim``; initialised N(0, 1) as PyTorch.

    Example:
        >>> tok = rlx.nn.Embedding(256, 64)          # ids (B, T) -> (B, T, 64)
    """

    def __init__(self, num: int, dim: int, *, dtype: Any = None) -> None:
        num = _check.integer("Embedding", "num", num, lo=1)
        dim = _check.integer("Embedding", "dim", dim, lo=1)
        _check.fits_in_memory("Embedding", (num, dim))
        self.num, self.dim = num, dim
        self.weight = Parameter(rng().standard_normal((num, dim)), dtype=dtype)

    def extra_repr(self) -> str:
        return f"{self.num}, {self.dim}"

    def __call__(self, ids: Any) -> Tensor:
        return embedding(self.weight, ids)


class LayerNorm(Module):
    """Layer normalisation over the last axis with a learned scale (ones) and shift (zeros).

    Example:
        >>> ln = rlx.nn.LayerNorm(64)
    """

    def __init__(self, dim: int, eps: float = 1e-5, *, dtype: Any = None) -> None:
        dim = _check.integer("LayerNorm", "dim", dim, lo=1)
        eps = _check.number("LayerNorm", "eps", eps, lo=0.0)
        _check.fits_in_memory("LayerNorm", (dim,))
        self.dim, self.eps = dim, eps
        self.weight = Parameter(np.ones(dim, np.float32), dtype=dtype)
        self.bias = Parameter(np.zeros(dim, np.float32), dtype=dtype)

    def extra_repr(self) -> str:
        return f"({self.dim},), eps={self.eps}"

    def __call__(self, x: Any) -> Tensor:
        if x.shape[-1] != self.dim:
            raise ShapeError(f"[LayerNorm] expects inputs (..., {self.dim}), got {tuple(x.shape)}")
        return layer_norm(x, self.weight, self.bias, self.eps)


class MultiHeadAttention(Module):
    """Multi-head self-attention over (B, T, dim) inputs.

    ``qkv`` projects to queries, keys and values at once (weight (3*dim, dim), q|k|v
    stacked as PyTorch's ``in_proj_weight``); ``proj`` maps the merged heads back. Initialised as PyTorch's
    ``nn.MultiheadAttention``: Xavier-uniform input projection, zero biases.
    ``decode`` runs one new token against a resident key/value cache.

    Example:
        >>> attn = rlx.nn.MultiHeadAttention(64, num_heads=4, causal=True)   # (B, T, 64) -> (B, T, 64)
    """

    def __init__(self, dim: int, num_heads: int, causal: bool = False) -> None:
        dim = _check.integer("MultiHeadAttention", "dim", dim, lo=1)
        num_heads = _check.integer("MultiHeadAttention", "num_heads", num_heads, lo=1)
        if dim % num_heads:
            raise ShapeError(f"[MultiHeadAttention] dim {dim} is not divisible by num_heads {num_heads}")
        self.dim, self.num_heads, self.head_dim, self.causal = dim, num_heads, dim // num_heads, causal
        self.qkv = Linear(dim, 3 * dim)
        bound = math.sqrt(6.0 / (dim + 3 * dim))
        self.qkv.weight = Parameter(rng().uniform(-bound, bound, (3 * dim, dim)))
        self.qkv.bias = Parameter(np.zeros(3 * dim, np.float32))
        self.proj = Linear(dim, dim)
        self.proj.bias = Parameter(np.zeros(dim, np.float32))

    def _heads(self, x: Any) -> tuple[Tensor, Tensor, Tensor]:
        b, t, _ = x.shape
        qkv = self.qkv(x).reshape(b, t, 3, self.num_heads, self.head_dim).transpose(2, 0, 3, 1, 4)
        return qkv[0], qkv[1], qkv[2]  # each (B, H, T, head_dim)

    def _merge(self, y: Tensor) -> Tensor:
        b, _, t, _ = y.shape
        return self.proj(y.transpose(0, 2, 1, 3).reshape(b, t, self.dim))

    def __call__(self, x: Any) -> Tensor:
        if len(x.shape) != 3 or x.shape[-1] != self.dim:
            raise ShapeError(f"[MultiHeadAttention] expects inputs (B, T, {self.dim}), got {tuple(x.shape)}")
        # One fused op over the packed q|k|v projection: no head transposes or splits, and the
        # scores of one (batch, head) block at a time.
        qkv = self.qkv(x)
        if qkv.dtype != "float32":  # float64 models: attention built from ops (the fused op is float32)
            b, n, _ = qkv.shape
            h = qkv.reshape(b, n, 3, self.num_heads, self.head_dim).transpose(2, 0, 3, 1, 4)
            return self._merge(scaled_dot_product_attention(h[0], h[1], h[2], causal=self.causal))
        t = qkv._trace
        y = Tensor(t, t.graph.attention([qkv._id], 1.0 / math.sqrt(self.head_dim), 0 if self.causal else None,
                                        self.num_heads))
        return self.proj(y)

    def decode(self, x: Any, k_cache: Any, v_cache: Any, pos: Any) -> tuple[Tensor, Tensor, Tensor]:
        """One step of cached decoding.

        Args:
            x: the new token's activations, (B, 1, dim).
            k_cache, v_cache: resident caches (B, H, T_max, head_dim) whose rows ``0..pos`` hold
                the keys and values of earlier tokens (later rows are ignored).
            pos: int32 (1,) — the new token's position.

        Returns:
            ``(y, k_new, v_new)``: the output (B, 1, dim) and the new token's key and value rows
            (B, H, 1, head_dim), to be written into the caches at row ``pos``.

        Example:
            >>> y, k_new, v_new = attn.decode(x, k_cache, v_cache, pos)
        """
        q, k, v = self._heads(x)
        t_max = k_cache.shape[2]
        qs = q * (1.0 / math.sqrt(self.head_dim))
        past = _matmul_nt(qs, k_cache)  # (B, H, 1, T_max)
        filled = np.arange(t_max, dtype=np.int32) < pos  # rows already written
        past = where(filled, past, float("-inf"))
        now = (qs * k).sum(axis=-1, keepdims=True)  # (B, H, 1, 1)
        p = softmax(concat([past, now], axis=-1), axis=-1)
        y = matmul(p[..., :t_max], v_cache) + p[..., t_max:] * v
        return self._merge(y), k, v


class TransformerBlock(Module):
    """Pre-norm block: ``x + attn(ln1(x))``, then ``x + fc2(gelu(fc1(ln2(x))))``.

    Example:
        >>> block = rlx.nn.TransformerBlock(64, num_heads=4)          # (B, T, 64) -> (B, T, 64)
    """

    def __init__(self, dim: int, num_heads: int, mlp_ratio: int = 4, causal: bool = True) -> None:
        _check.integer("TransformerBlock", "mlp_ratio", mlp_ratio, lo=1)
        self.ln1 = LayerNorm(dim)
        self.attn = MultiHeadAttention(dim, num_heads, causal=causal)
        self.ln2 = LayerNorm(dim)
        self.fc1 = Linear(dim, mlp_ratio * dim)
        self.fc2 = Linear(mlp_ratio * dim, dim)

    def _mlp(self, x: Tensor) -> Tensor:
        return x + self.fc2(gelu(self.fc1(self.ln2(x))))

    def __call__(self, x: Any) -> Tensor:
        return self._mlp(x + self.attn(self.ln1(x)))

    def decode(self, x: Any, k_cache: Any, v_cache: Any, pos: Any) -> tuple[Tensor, Tensor, Tensor]:
        """One cached decoding step; see ``MultiHeadAttention.decode``."""
        a, k, v = self.attn.decode(self.ln1(x), k_cache, v_cache, pos)
        return self._mlp(x + a), k, v


__all__ = ["Module", "Parameter", "Buffer", "ModuleList", "ModuleDict", "IncompatibleKeys", "Linear", "ReLU", "GELU",
           "SiLU", "Tanh", "Sigmoid", "LeakyReLU", "Identity", "Flatten", "Dropout", "Sequential", "Embedding",
           "LayerNorm", "BatchNorm1d", "BatchNorm2d", "Conv2d", "MaxPool2d", "AvgPool2d", "MultiHeadAttention",
           "TransformerBlock"]
