"""Symbolic tensors and the op functions: every op call appends a node to the graph being traced."""

from __future__ import annotations

import math
import threading
from typing import Any, Sequence

import numpy as np

from . import _check, _rlx
from ._arrays import contiguous, parse_dtype
from .errors import DTypeError, InputError, RlxError, ShapeError, UnsupportedError

_local = threading.local()


def _current() -> "Trace | None":
    return getattr(_local, "trace", None)


class Trace:
    """A graph being built, plus the mapping from Parameters to their graph nodes."""

    def __init__(self, graph: Any | None = None, device: str = "cpu") -> None:
        self.graph = graph if graph is not None else _rlx.Graph()
        self.param_nodes: dict[int, int] = {}
        self._consts: dict[tuple, int] = {}
        #: The program computes integers in int32 (a GPU backend): int64 and bool values are
        #: computed as int32 there, and float64 is not available for exact integer means.
        self.int32_device = device.split(":")[0] != "cpu"

    def __enter__(self) -> "Trace":
        self._prev = _current()
        _local.trace = self
        return self

    def __exit__(self, *exc: object) -> None:
        _local.trace = self._prev

    def constant(self, value: Any, like: "Tensor | None" = None, dtype: str | None = None) -> "Tensor":
        """A constant node from a Python scalar or numpy array. A scalar's dtype is ``dtype`` when
        given, else int32 for an int next to an int32 ``like``, else float32; an array's follows
        its kind (floats become float32, integers int32, or int64 where a value needs it) unless
        ``dtype`` says otherwise. An integer ``dtype`` takes only values it holds exactly
        (DTypeError for 1.5, NaN, inf or a value out of its range); ragged lists are a ShapeError."""
        if isinstance(value, (bool, int, float, np.number)) and not isinstance(value, np.ndarray):
            if isinstance(value, np.complexfloating):
                raise DTypeError(f"[constant] cannot use the complex number {value!r} in rlx")
            if dtype is None:
                is_int = isinstance(value, (int, np.integer))
                dtype = "int32" if (like is not None and like.dtype == "int32" and is_int) else "float32"
            if dtype in _INTS:
                key: tuple = (dtype, _exact_int(value, dtype))
            else:
                try:
                    key = (dtype, float(value))
                except OverflowError:
                    raise DTypeError(f"[constant] {value} does not fit in {dtype}") from None
            if key not in self._consts:
                arr = np.asarray(key[1], dtype={"float32": np.float32, "float64": np.float64, "int32": np.int32,
                                                "int64": np.int64}[dtype])
                self._consts[key] = self.graph.constant(arr.reshape(-1), [], dtype)
            return Tensor(self, self._consts[key])
        arr = _array_of("constant", value)
        if arr.dtype.kind not in "iubf":
            raise DTypeError(f"[constant] cannot use an array of dtype {arr.dtype} in rlx (float32 or int32)")
        if dtype in _INTS:
            arr = _exact_ints(arr, dtype)
        elif dtype in ("float32", "float64"):
            arr = arr.astype(dtype)
        elif arr.dtype.kind == "f":
            arr, dtype = arr.astype(np.float32), "float32"
        else:
            wide = arr.size and (int(arr.min()) < -(2**31) or int(arr.max()) >= 2**31)
            dtype = "int64" if wide else "int32"
            arr = _exact_ints(arr, dtype)
        arr = contiguous(arr)
        return Tensor(self, self.graph.constant(arr.reshape(-1), list(arr.shape), dtype))


def _exact_int(value: Any, dtype: str) -> int:
    """A scalar as the int an ``dtype`` (int32 / int64) constant holds; DTypeError where it has
    none (NaN, inf, a fraction) or it is out of range."""
    if not isinstance(value, (bool, int, np.integer, np.bool_)):
        f = float(value)
        if not np.isfinite(f) or f != np.floor(f):
            what = "NaN and infinities are not integers" if not np.isfinite(f) else "it is not a whole number"
            raise DTypeError(f"[constant] {f!r} has no exact {dtype} value ({what}); round it first "
                             "or use a float dtype")
        value = f
    v = int(value)
    if not -_INT_BOUND[dtype] <= v < _INT_BOUND[dtype]:
        hint = "; cast the tensor with .astype('int64')" if dtype == "int32" else ""
        raise DTypeError(f"[constant] {value} does not fit in {dtype}{hint}")
    return v


def _exact_ints(arr: np.ndarray, dtype: str) -> np.ndarray:
    """An array as ``dtype`` (int32 / int64), refusing values that type does not hold exactly
    (NaN, inf, fractions, values out of range) with a DTypeError naming the first one."""
    if arr.dtype.kind == "f":
        with np.errstate(invalid="ignore"):
            bad = ~np.isfinite(arr) | (arr != np.floor(arr))
        if bad.any():
            v = arr[bad].flat[0].item()
            what = "NaN and infinities are not integers" if not np.isfinite(v) else "it is not a whole number"
            raise DTypeError(f"[constant] the value {v!r} at index {np.argwhere(bad)[0].tolist()} has no exact {dtype} "
                             f"value ({what}); round the array first or use a float dtype")
    lo, hi = (arr.min(), arr.max()) if arr.size else (0, 0)
    # Floats compare as floats (2**63 is one), integers as Python ints (exact for uint64 too).
    lo, hi = (float(lo), float(hi)) if arr.dtype.kind == "f" else (int(lo), int(hi))
    if lo < -_INT_BOUND[dtype] or hi >= _INT_BOUND[dtype]:
        raise DTypeError(f"[constant] integer values do not fit in {dtype} (range {arr.min()}..{arr.max()})")
    return arr.astype(dtype)


def _array_of(op: str, value: Any) -> np.ndarray:
    """``np.asarray(value)``, with ragged nested lists a ShapeError naming ``op``."""
    try:
        return np.asarray(value)
    except ValueError:
        text = repr(value)
        text = text if len(text) <= 60 else text[:57] + "..."
        raise ShapeError(f"[{op}] {text} is ragged (nested sequences of different lengths); "
                         "an rlx constant needs a rectangular array") from None


def _trace_of(*xs: Any) -> Trace:
    for x in xs:
        if isinstance(x, Tensor):
            return x._trace
    t = _current()
    if t is None:
        raise RlxError("rlx ops need a traced function (rlx.compile / rlx.compile_train_step) or an rlx.Graph")
    return t


def _as_tensor(x: Any, trace: Trace, like: "Tensor | None" = None, dtype: str | None = None) -> "Tensor":
    if isinstance(x, Tensor):
        if x._trace is not trace:
            raise RlxError("cannot mix tensors from two different graphs")
        return x
    # A Parameter (rlx.nn owns it) knows its node in a trace; anything else is a constant.
    in_trace = getattr(type(x), "_in_trace", None)
    if in_trace is not None:
        return in_trace(x, trace)
    return trace.constant(x, like, dtype)


def _kind(x: Any) -> str:
    """``"int"`` or ``"float"``: the kind an operand brings to numpy's promotion rules."""
    if isinstance(x, Tensor):
        return "int" if x.dtype in _INTS + ("bool",) else "float"
    if isinstance(x, (bool, int, np.integer, np.bool_)):
        return "int"
    if isinstance(x, np.ndarray) and x.dtype.kind in "iub":
        return "int"
    if isinstance(x, (list, tuple)):
        try:
            return "int" if np.asarray(x).dtype.kind in "iub" else "float"
        except ValueError:
            return "float"  # ragged: making the constant raises the error
    return "float"  # Python/numpy floats, float arrays, Parameters


def _not_supported(op: str, dtypes: Sequence[str]) -> DTypeError:
    """The error for an op whose kernels do not exist for these dtypes yet, naming the op and
    the dtypes and saying how to cast."""
    return DTypeError(f"[{op}] {' x '.join(dtypes)} is not supported yet; cast to float32 with .astype('float32')")


_FLOATS = ("float32", "float16", "bfloat16", "float64")
_INTS = ("int32", "int64")
_INT_BOUND = {"int32": 2**31, "int64": 2**63}


def _dtype_of(x: Any) -> str | None:
    """The dtype of a Tensor or Parameter; None for Python numbers and arrays (constants)."""
    if isinstance(x, Tensor) or getattr(type(x), "_in_trace", None) is not None:
        return str(x.dtype)
    return None


_LOW = ("bfloat16", "float16")


def _low_target(xs: Sequence[Any]) -> str | None:
    """The low dtype (bfloat16 / float16) an arithmetic op of ``xs`` returns: the one low dtype
    among its tensors when no float32 tensor is there (numbers and int32 do not promote it)."""
    held = {_dtype_of(x) for x in xs} - {None, "int32", "int64", "bool"}
    return next(iter(held)) if len(held) == 1 and next(iter(held)) in _LOW else None


def _promoted(t: Trace, *xs: Any, op: str = "binary", moves: bool = False,
              exact_numbers: bool = False) -> list["Tensor"]:
    """The operands as tensors of one dtype, by PyTorch's rules with float32 as the float type
    and int32 as the type of integer numbers: bool operands only -> bool; else integers only ->
    int64 if an int64 tensor is there, else int32 (bool tensors and Python ints follow); any
    float (a Python float scalar included) -> float32, casting integer and bool tensors and
    integer constants up. bfloat16 and float16 tensors follow PyTorch: with integer or bool
    tensors and Python numbers they keep their dtype (the op computes in float32 and rounds
    back); beside a float32 tensor or the other low dtype they are cast to float32. A float64
    tensor makes everything float64 (the CPU computes in float64; numbers become float64
    constants). ``moves`` ops (data movement: concat, where) take tensors of any one dtype as
    they are. With ``exact_numbers`` a Python number beside a low dtype stays a float32
    constant (arithmetic uses it unrounded, as PyTorch's kernels do; the caller rounds the
    result, see ``_low_target``)."""
    held = [_dtype_of(x) for x in xs]
    if moves and held and held[0] is not None and len(set(held)) == 1:
        return [_as_tensor(x, t) for x in xs]
    if "float64" in held:
        # float64 wins over every other dtype (numbers become float64 constants, unrounded).
        out = []
        for x in xs:
            x = _as_tensor(x, t, dtype="float64")
            out.append(x if x.dtype == "float64" else x.astype("float64"))
        return out
    lows = {d for d in held if d in _LOW}
    if lows:
        dtype = next(iter(lows)) if len(lows) == 1 and "float32" not in held else "float32"
        out = []
        for x in xs:
            # Numbers become float32 constants first (bfloat16 constants are made by a cast).
            number = _dtype_of(x) is None
            x = _as_tensor(x, t, dtype="float32" if number else None)
            out.append(x if x.dtype == dtype or (number and exact_numbers) else x.astype(dtype))
        return out
    if all(_kind(x) == "int" for x in xs):
        bools = all(d == "bool" or (d is None and _is_bool_value(x)) for d, x in zip(held, xs))
        dtype = "bool" if bools else "int64" if "int64" in held else "int32"
    else:
        dtype = "float32"
    out = []
    for x in xs:
        x = _as_tensor(x, t, dtype="int32" if dtype == "bool" else dtype)
        if x.dtype != dtype:
            x = x.astype(dtype)
        out.append(x)
    return out


#: The op names errors use (rlx's, as the native side names them) for the binary kinds.
_BINARY_NAMES = {"floordiv": "floor_divide", "mod": "remainder", "lt": "less", "le": "less_equal",
                 "gt": "greater", "ge": "greater_equal", "eq": "equal", "ne": "not_equal"}


def _binary(kind: str, a: Any, b: Any) -> "Tensor":
    t = _trace_of(a, b)
    low = _low_target((a, b))
    name = _BINARY_NAMES.get(kind, kind)
    a, b = _promoted(t, a, b, op=name, exact_numbers=True)
    if a.dtype == "bool":
        # bool arithmetic as PyTorch's: + is or, * is and, - is refused; the others compute on
        # the 0/1 values as int32 (comparisons give float32 masks as usual).
        if kind == "add":
            return logical_or(a, b)
        if kind == "mul":
            return logical_and(a, b)
        if kind == "sub":
            raise DTypeError(f"[{name}] bool - bool is not supported (as in PyTorch); use rlx.logical_xor, or cast "
                             "with .astype('int32')")
        a, b = a.astype("int32"), b.astype("int32")
    out = Tensor(t, t.graph.binary(kind, a._id, b._id))
    # A low-precision operand beside an unrounded number computed in float32: round the result
    # (comparisons give float32 masks, as for float32 operands).
    if low is not None and out.dtype == "float32" and kind not in _COMPARISONS:
        out = out.astype(low)
    return out


_COMPARISONS = ("lt", "le", "gt", "ge", "eq", "ne")


# Unary functions with float values: int32 arguments are cast to float32 first (numpy and
# PyTorch give a float for exp/log/... of integers).
_FLOAT_VALUED = {"tanh", "sigmoid", "exp", "log", "sqrt", "gelu", "gelu_tanh", "log1p"}


def _unary(kind: str, x: Any) -> "Tensor":
    t = _trace_of(x)
    x = _as_tensor(x, t)
    if x.dtype == "bool":
        if kind == "neg":
            raise DTypeError("[neg] negating a bool tensor is not supported (as in PyTorch); use ~ or rlx.logical_not")
        x = x.astype("int32") if kind == "relu" else x.astype("float32")
    if x.dtype in _INTS:
        if kind in _FLOAT_VALUED:
            x = x.astype("float32")
        elif kind == "relu":
            return where(x < 0, 0, x)  # stays int32, as PyTorch's relu of an int tensor
        elif kind == "neg":
            return _binary("sub", 0, x)  # wraps at INT_MIN, as numpy's
    return Tensor(t, t.graph.unary(kind, x._id))


def _axes(axis: int | Sequence[int] | None, where: str = "reduce") -> list[int] | None:
    if axis is None:
        return None
    if isinstance(axis, (int, np.integer)) and not isinstance(axis, bool):
        return [int(axis)]
    if isinstance(axis, (str, bytes)) or not isinstance(axis, Sequence):
        raise ShapeError(f"[{where}] axis must be an int or a sequence of ints, got {axis!r}")
    return [_check.integer(where, "axis", a, lo=-(2**62), hi=2**62) for a in axis]


class Tensor:
    """A symbolic value in a traced function. Operators and methods add ops to the graph.

    Example:
        >>> def forward(model, x):                 # x is an rlx.Tensor
        ...     h = (x @ x.T).reshape(-1)
        ...     return h.sum() / h.shape[0]
    """

    __array_priority__ = 1000
    __array_ufunc__ = None  # numpy operands defer to Tensor's reflected operators

    def __init__(self, trace: Trace, node: int) -> None:
        self._trace = trace
        self._id = node

    @property
    def shape(self) -> tuple[int, ...]:
        """The static shape, a tuple of ints."""
        return tuple(self._trace.graph.shape(self._id))

    @property
    def dtype(self) -> str:
        """The element type: ``"float32"``, ``"int32"``, or one of rlx's other dtypes
        (``"float16"``, ``"bfloat16"``, ``"float64"``, ``"int64"``, ``"bool"``)."""
        return self._trace.graph.dtype(self._id)

    @property
    def ndim(self) -> int:
        """The number of dimensions."""
        return len(self.shape)

    def __repr__(self) -> str:
        return f"rlx.Tensor(shape={self.shape}, dtype={self.dtype})"

    def __add__(self, o: Any) -> "Tensor":
        return _binary("add", self, o)

    def __radd__(self, o: Any) -> "Tensor":
        return _binary("add", o, self)

    def __sub__(self, o: Any) -> "Tensor":
        return _binary("sub", self, o)

    def __rsub__(self, o: Any) -> "Tensor":
        return _binary("sub", o, self)

    def __mul__(self, o: Any) -> "Tensor":
        return _binary("mul", self, o)

    def __rmul__(self, o: Any) -> "Tensor":
        return _binary("mul", o, self)

    def __truediv__(self, o: Any) -> "Tensor":
        """True division; integer operands give a float32 quotient (as numpy/PyTorch give a float)."""
        return _binary("div", self, o)

    def __rtruediv__(self, o: Any) -> "Tensor":
        return _binary("div", o, self)

    def __floordiv__(self, o: Any) -> "Tensor":
        """Floor division (rounds toward -inf). On int32 / int64, division by zero raises
        ``RlxError`` when the function runs and ``INT_MIN // -1`` wraps to ``INT_MIN``; on floats,
        x // 0 is +-inf or NaN. Gradient zero (piecewise constant)."""
        return _binary("floordiv", self, o)

    def __rfloordiv__(self, o: Any) -> "Tensor":
        return _binary("floordiv", o, self)

    def __mod__(self, o: Any) -> "Tensor":
        """Remainder with the divisor's sign (Python's rule, PyTorch's ``remainder``). On int32 /
        int64, modulo zero raises ``RlxError`` when the function runs; on floats, x % 0 is NaN."""
        return _binary("mod", self, o)

    def __rmod__(self, o: Any) -> "Tensor":
        return _binary("mod", o, self)

    def __matmul__(self, o: Any) -> "Tensor":
        return matmul(self, o)

    def __rmatmul__(self, o: Any) -> "Tensor":
        return matmul(o, self)

    def __neg__(self) -> "Tensor":
        return _unary("neg", self)

    def __pow__(self, p: float) -> "Tensor":
        """``x ** p`` for a Python scalar ``p`` (C's ``pow``: ``(-inf) ** -0.5`` is 0, as numpy).
        An int32 / int64 tensor to a non-negative int power keeps its dtype (wrapping, as numpy);
        to a float power it is cast to float32 first."""
        if not isinstance(p, (int, float, np.number)):
            raise DTypeError(f"[pow] the exponent must be a Python scalar, got {type(p).__name__}")
        x = self
        if x.dtype == "bool":
            x = x.astype("int32")
        if x.dtype in _INTS:
            if isinstance(p, (int, np.integer)):
                return _int_pow(x, int(p))
            x = x.astype("float32")
        return Tensor(x._trace, x._trace.graph.pow(x._id, float(p)))

    def __rpow__(self, b: Any) -> "Tensor":
        """``b ** x`` for a Python / numpy scalar base ``b``: ``exp(x * log(b))``, with C's
        ``pow`` at the edges (``b ** 0`` is 1, ``1 ** x`` is 1, ``0 ** -1`` is inf; a negative
        ``b`` to a non-integer power is NaN). A float (integer and bool tensors give float32);
        the gradient is ``b ** x * log(b)``."""
        if isinstance(b, np.ndarray) and b.ndim == 0:
            b = b[()]
        if isinstance(b, (bool, np.bool_)) or not isinstance(b, (int, float, np.integer, np.floating)):
            raise DTypeError(f"[pow] the base of b ** tensor must be a Python or numpy scalar, got {type(b).__name__}")
        x = self
        if x.dtype in _INTS + ("bool",):
            if isinstance(b, (int, np.integer)):
                raise DTypeError(f"[pow] an int to the power of an {x.dtype} tensor is not supported (its dtype would "
                                 f"depend on the signs of the values); use a float base ({float(b)!r} ** x)")
            x = x.astype("float32")
        b = float(b)
        if b != b:
            return where(x == 0, 1.0, float("nan")).astype(x.dtype)
        if b == 1.0:
            return where(x == 0, 1.0, 1.0).astype(x.dtype)
        if b == 0.0:
            return where(x > 0, 0.0, where(x < 0, float("inf"), where(x == 0, 1.0, float("nan")))).astype(x.dtype)
        mag = exp(x * float(np.log(abs(b))))
        if np.isinf(b):
            mag = where(x == 0, 1.0, mag)  # inf * 0 is NaN inside exp; C's pow gives 1
        if b > 0:
            return mag
        odd = (x % 2.0) == 1.0
        if np.isinf(b):
            return where(odd, -mag, mag)  # C's pow: (-inf) ** 2.5 is inf
        # Whole numbers, and +-inf as C's pow takes them ((-2) ** inf is inf); inf // 1 is NaN.
        whole = ((x // 1.0) == x) + (x == float("inf")) + (x == float("-inf"))
        return where(whole, where(odd, -mag, mag), float("nan"))

    def __lt__(self, o: Any) -> "Tensor":
        return _binary("lt", self, o)

    def __le__(self, o: Any) -> "Tensor":
        return _binary("le", self, o)

    def __gt__(self, o: Any) -> "Tensor":
        return _binary("gt", self, o)

    def __ge__(self, o: Any) -> "Tensor":
        return _binary("ge", self, o)

    def __eq__(self, o: Any) -> "Tensor":  # type: ignore[override]
        return _binary("eq", self, o)

    def __ne__(self, o: Any) -> "Tensor":  # type: ignore[override]
        return _binary("ne", self, o)

    def __and__(self, o: Any) -> "Tensor":
        """``&`` of masks (bool tensors, or the float32 0/1 masks comparisons give):
        ``rlx.logical_and``, a bool tensor. Integer tensors raise DTypeError (rlx has no
        bitwise integer ops)."""
        return _logical("and", self, o)

    def __rand__(self, o: Any) -> "Tensor":
        return _logical("and", o, self)

    def __or__(self, o: Any) -> "Tensor":
        """``|`` of bool tensors: ``rlx.logical_or``."""
        return _logical("or", self, o)

    def __ror__(self, o: Any) -> "Tensor":
        return _logical("or", o, self)

    def __xor__(self, o: Any) -> "Tensor":
        """``^`` of bool tensors: ``rlx.logical_xor``."""
        return _logical("xor", self, o)

    def __rxor__(self, o: Any) -> "Tensor":
        return _logical("xor", o, self)

    def __invert__(self) -> "Tensor":
        """``~`` of a mask (bool, or a comparison's float32 0/1 mask): ``rlx.logical_not``."""
        if self.dtype not in ("bool", "float32"):
            raise DTypeError(f"[bitwise_not] ~ takes a bool tensor or a comparison mask, got {self.dtype}; "
                             "use rlx.logical_not for truth values")
        return logical_not(self)

    __hash__ = object.__hash__

    def __bool__(self) -> bool:
        raise RlxError("a symbolic rlx.Tensor has no truth value while tracing; use rlx.where for choices")

    def reshape(self, *shape: int | Sequence[int]) -> "Tensor":
        """The same values in a new shape (one ``-1`` is inferred); an alias, not a copy."""
        if len(shape) == 1 and not isinstance(shape[0], (int, np.integer)):
            if isinstance(shape[0], (str, bytes)) or not isinstance(shape[0], Sequence):
                raise ShapeError(f"[reshape] expected ints or a sequence of ints, got {shape[0]!r}")
            shape = tuple(shape[0])  # type: ignore[assignment]
        dims = [_check.integer("reshape", "dimension", d, lo=-1, hi=2**62) for d in shape]
        return Tensor(self._trace, self._trace.graph.reshape(self._id, dims))

    def transpose(self, *axes: int | Sequence[int]) -> "Tensor":
        """Permutes the axes (reverses them when none are given), as numpy."""
        if len(axes) == 1 and not isinstance(axes[0], (int, np.integer)):
            if isinstance(axes[0], (str, bytes)) or not isinstance(axes[0], Sequence):
                raise ShapeError(f"[transpose] expected axes as ints, got {axes[0]!r}")
            axes = tuple(axes[0])  # type: ignore[assignment]
        perm = [_check.integer("transpose", "axis", a, lo=-(2**62), hi=2**62) for a in axes] if axes else None
        return Tensor(self._trace, self._trace.graph.transpose(self._id, perm))

    @property
    def T(self) -> "Tensor":
        """The axes reversed (``transpose()``)."""
        return self.transpose()

    def _reduce(self, kind: str, axis: Any, keepdims: bool) -> "Tensor":
        """Integer and bool tensors as PyTorch reduces them: sums are int64, means float32,
        maxima keep the dtype (of bools: whether any is true)."""
        x = self
        if x.dtype in _INTS + ("bool",):
            if kind == "mean":
                return _int_mean(x, axis, keepdims)
            if kind == "sum" and x.dtype != "int64":
                x = x.astype("int64")
            elif kind == "max" and x.dtype == "bool":
                return x.astype("int32")._reduce(kind, axis, keepdims).astype("bool")
        return Tensor(x._trace, x._trace.graph.reduce(kind, x._id, _axes(axis, kind), bool(keepdims)))

    def sum(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> "Tensor":
        """Sum over ``axis`` (all axes when None)."""
        return self._reduce("sum", axis, keepdims)

    def mean(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> "Tensor":
        """Mean over ``axis`` (all axes when None)."""
        return self._reduce("mean", axis, keepdims)

    def max(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> "Tensor":
        """Maximum over ``axis`` (all axes when None)."""
        return self._reduce("max", axis, keepdims)

    def min(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> "Tensor":
        """Minimum over ``axis`` (all axes when None)."""
        try:
            return self._min(axis, keepdims)
        except ShapeError as e:  # the max it is made of names itself: name the min instead
            raise ShapeError(str(e).replace("[max] cannot take the max", "[min] cannot take the min")) from None

    def _min(self, axis: Any, keepdims: bool) -> "Tensor":
        if self.dtype == "bool":
            return self.astype("int32")._min(axis, keepdims).astype("bool")
        if self.dtype in _INTS:
            # -1 - x reverses the order of integers without overflow (unlike -x at INT_MIN).
            return -1 - (-1 - self)._reduce("max", axis, keepdims)
        return -((-self)._reduce("max", axis, keepdims))

    def var(self, axis: int | Sequence[int] | None = None, keepdims: bool = False, ddof: int = 0) -> "Tensor":
        """Variance over ``axis`` (all axes when None): ``mean((x - mean)**2)`` divided by
        ``count - ddof`` instead of ``count`` (numpy's ``ddof``; PyTorch's default is ``ddof=1``;
        ``count <= ddof`` gives inf, or NaN where all values are equal, as both). Integers and
        bools give float32 (see ``_int_var``).

        Example:
            >>> def forward(model, x):
            ...     return x.var(axis=0)
        """
        dims, count = _reduced(self, axis, "var")
        ddof = _check.integer("var", "ddof", ddof, lo=0)
        if self.dtype in _INTS + ("bool",):
            return _int_var(self, dims, count, keepdims, ddof)
        x = self
        d = x - x.mean(axis=dims, keepdims=True)
        ss = (d * d).sum(axis=dims, keepdims=keepdims)
        return ss / float(max(count - ddof, 0))

    def argmax(self, axis: int | None = None) -> "Tensor":
        """Index of the first maximum along ``axis`` (of the flattened tensor when None), int32."""
        return argmax(self, axis)

    def flatten(self) -> "Tensor":
        """The values as one dimension."""
        return self.reshape(-1)

    def exp(self) -> "Tensor":
        """``e**x`` (``rlx.exp``)."""
        return exp(self)

    def log(self) -> "Tensor":
        """Natural logarithm (``rlx.log``)."""
        return log(self)

    def abs(self) -> "Tensor":
        """``|x|`` (``rlx.abs``)."""
        return abs_(self)

    def __abs__(self) -> "Tensor":
        return abs_(self)

    def __getitem__(self, key: Any) -> "Tensor":
        """Basic indexing: ints, slices with step 1, ``...``, ``None`` and ``True`` / ``False``
        (numpy's: a new axis of length 1 / 0); an int32 tensor (or constant integer array) as the
        only index picks rows of a float32 tensor (gather along axis 0). Constant indices may be
        negative and are checked against the axis when tracing; a tensor's when the function
        runs. Boolean masks are refused: the result's shape would depend on the values."""
        _refuse_mask(key)
        if isinstance(key, Tensor) or (isinstance(key, (np.ndarray, list)) and np.ndim(key) > 0
                                       and np.asarray(key).dtype.kind in "iu"):
            if self.ndim == 0:
                raise ShapeError("[getitem] cannot index a 0-d tensor with a tensor")
            if not isinstance(key, Tensor):
                key = _row_ids(np.asarray(key), self.shape[0])
            ids = _as_tensor(key, self._trace)
            if ids.dtype == "int64":
                ids = ids.astype("int32")
            if ids.dtype != "int32":
                raise DTypeError(f"[getitem] tensor indices must be int32, got {ids.dtype} (boolean masks are not "
                                 "supported: use rlx.where(mask, x, 0))")
            if self.dtype not in ("float32",) + _LOW:
                raise UnsupportedError(f"[getitem] indexing with a tensor needs a float32, bfloat16 or float16 tensor, "
                                       f"got {self.dtype}")
            return Tensor(self._trace, self._trace.graph.gather(self._id, ids._id))
        if not isinstance(key, tuple):
            key = (key,)
        ellipses = [i for i, k in enumerate(key) if k is Ellipsis]  # by identity: arrays have no ==
        if len(ellipses) > 1:
            raise ShapeError("[getitem] only one ... is allowed")
        consumed = sum(1 for k in key if k is not None and k is not Ellipsis and not _is_bool_scalar(k))
        if consumed > self.ndim:
            raise ShapeError(f"[getitem] too many indices ({consumed}) for a tensor of shape {self.shape}")
        if ellipses:
            i = ellipses[0]
            key = key[:i] + (slice(None),) * (self.ndim - consumed) + key[i + 1 :]
        else:
            key = key + (slice(None),) * (self.ndim - consumed)
        out, axis, final, empty = self, 0, [], []
        for k in key:
            if k is None or _is_bool_scalar(k):
                if k is not None and not bool(k):
                    empty.append(len(final))  # numpy's x[False]: a new axis of length 0
                final.append(1)
                continue
            dim = self.shape[axis]
            if isinstance(k, slice):
                start, stop, step = k.indices(dim)
                if step != 1:
                    raise UnsupportedError(f"[getitem] slices with a step other than 1 are not supported (axis {axis})")
                stop = max(stop, start)
                if (start, stop) != (0, dim):
                    out = Tensor(self._trace, self._trace.graph.slice(out._id, axis, start, stop))
                final.append(stop - start)
            elif isinstance(k, (int, np.integer)) or (isinstance(k, np.ndarray) and k.ndim == 0 and k.dtype.kind in "iu"):
                idx = int(k) + dim if int(k) < 0 else int(k)
                if not 0 <= idx < dim:
                    raise ShapeError(f"[getitem] index {int(k)} is out of range for axis {axis} of size {dim}")
                out = Tensor(self._trace, self._trace.graph.slice(out._id, axis, idx, idx + 1))
            else:
                raise UnsupportedError(f"[getitem] unsupported index {k!r}; use ints, slices, ... or None")
            axis += 1
        out = out.reshape(*final) if tuple(final) != out.shape else out
        for a in empty:
            out = Tensor(self._trace, self._trace.graph.slice(out._id, a, 0, 0))
        return out

    def __iter__(self) -> Any:
        """The sub-tensors ``x[0], x[1], ...`` along axis 0 (``for row in x``, ``a, b = x``).
        (No ``len()``: numpy would then unpack a tensor element by element.)"""
        if self.ndim == 0:
            raise ShapeError("[iter] cannot iterate over a 0-d tensor (shape ())")
        return (self[i] for i in range(self.shape[0]))

    def astype(self, dtype: Any) -> "Tensor":
        """The values converted to ``dtype``: ``"float32"``, ``"float16"``, ``"bfloat16"``,
        ``"float64"``, ``"int32"``, ``"int64"``, ``"bool"`` (or the numpy dtype). Narrowing
        floats round to nearest even (overflow gives inf, NaN stays NaN); float -> int truncates
        toward zero and saturates (NaN gives 0); int64 -> int32 wraps, except that int64 ids and
        labels fed to a compiled function are checked against their range before the cast;
        anything -> bool is ``x != 0``. Gradients flow back through casts between float dtypes
        (cast back to the input's dtype), never into integers or bools.

        Example:
            >>> def forward(model, x):                 # x: a float16 input
            ...     return model(x.astype("float32"))
        """
        to = parse_dtype("astype", dtype)
        if to == self.dtype:
            return self
        return Tensor(self._trace, self._trace.graph.cast(self._id, to))


def _int_pow(x: Tensor, p: int) -> Tensor:
    """``x ** p`` on int32 / int64 by repeated squaring (products wrap, as numpy's)."""
    if p < 0:
        raise DTypeError(f"[pow] an {x.dtype} tensor to a negative int power ({p}) is not an integer; use a float exponent")
    result: Tensor | None = None
    square = x
    while True:
        if p & 1:
            result = square if result is None else result * square
        p >>= 1
        if not p:
            break
        square = square * square
    return result if result is not None else x * 0 + 1


def _reduced(x: Tensor, axis: Any, op: str) -> tuple[list[int], int]:
    """The axes a reduction of ``x`` over ``axis`` takes (non-negative) and how many values each
    result reduces."""
    axes = _axes(axis, op)
    dims = list(range(x.ndim)) if axes is None else [a + x.ndim if a < 0 else a for a in axes]
    count = 1
    for a in dims:
        if not 0 <= a < x.ndim:
            raise ShapeError(f"[{op}] axis {a} is out of range for a tensor of shape {x.shape}")
        count *= x.shape[a]
    return dims, count


def _int32_halves(x: Tensor) -> tuple[Tensor, Tensor]:
    """int32 ``x`` as float32 ``hi * 65536 + lo`` (both exact, ``|lo| <= 32768``): sums of the
    halves are exact for up to 256 values, where ``x.astype('float32')`` rounds values above 2**24.
    int32 and float32 ops only, so the GPU backends run it too."""
    hi = x // 65536
    lo = (x - hi * 65536).astype("float32")  # in [0, 65536)
    up = lo >= 32768.0  # centre lo on 0: small values of either sign have hi == 0
    return hi.astype("float32") + up, lo - up * 65536.0


def _int_mean(x: Tensor, axis: Any, keepdims: bool) -> Tensor:
    """The float32 mean of integers or bools, without rounding each value to float32 first:
    int64 and bools through float64 on the CPU, as numpy; int32 (and, on a GPU, int64 and bools,
    which compute as int32 there) as its exact sum (in halves, see ``_int32_halves``) rounded
    once, divided by the count."""
    if x.dtype != "int32" and x._trace.int32_device:
        x = x.astype("int32")
    if x.dtype != "int32":
        return x.astype("float64")._reduce("mean", axis, keepdims).astype("float32")
    dims, count = _reduced(x, axis, "mean")
    hi, lo = _int32_halves(x)
    total = hi._reduce("sum", dims, keepdims) * 65536.0 + lo._reduce("sum", dims, keepdims)
    return total / float(count)  # 0 / 0: an empty mean is NaN, as numpy's


def _int_var(x: Tensor, dims: list[int], count: int, keepdims: bool, ddof: int) -> Tensor:
    """The float32 variance of integers or bools. int64 and bools go through float64 (numpy's
    precision). int32 subtracts an integer ``shift`` near the mean first, so the deviations are
    exact and small: ``(sum(d**2) - sum(d)**2 / n) / (n - ddof)`` with ``d = x - shift``. On a
    GPU int64 and bools take the int32 path (they compute as int32 there)."""
    if x.dtype != "int32" and x._trace.int32_device:
        x = x.astype("int32")
    if x.dtype != "int32":
        return x.astype("float64").var(dims, keepdims, ddof).astype("float32")
    n = float(max(count, 1))
    hi, lo = _int32_halves(x)
    shi, slo = hi._reduce("sum", dims, True), lo._reduce("sum", dims, True)
    shift_hi = (shi / n + 0.5) // 1.0  # round(mean of hi), then floor(the rest of the mean)
    shift_lo = (((shi - shift_hi * n) * 65536.0 + slo) / n) // 1.0
    d = (hi - shift_hi) * 65536.0 + (lo - shift_lo)
    sd = d._reduce("sum", dims, keepdims)
    ss = (d * d)._reduce("sum", dims, keepdims) - sd * sd / n
    ss = where(ss < 0, 0.0, ss)  # rounding can leave -0.x where all values are equal
    return ss / float(max(count - ddof, 0))


def _is_bool_scalar(k: Any) -> bool:
    """A Python / numpy bool (or 0-d bool array) index: numpy's new axis of length 1 or 0."""
    return isinstance(k, (bool, np.bool_)) or (isinstance(k, np.ndarray) and k.ndim == 0 and k.dtype == np.bool_)


def _refuse_mask(key: Any) -> None:
    """UnsupportedError for boolean-mask indices (a bool tensor, array or list, alone or in a
    tuple): the number of elements they pick, so the result's shape, is known only from values."""
    for k in key if isinstance(key, tuple) else (key,):
        if isinstance(k, Tensor):
            shape, mask = k.shape, k.dtype == "bool"
        elif isinstance(k, (np.ndarray, list)) and not _is_bool_scalar(k):
            arr = _array_of("getitem", k)
            shape, mask = arr.shape, arr.dtype == np.bool_
        else:
            continue
        if mask:
            raise UnsupportedError(f"[getitem] boolean mask indices (a bool mask of shape {shape}) are not supported: "
                                   "the result's shape would depend on the mask's values; use rlx.where(mask, x, 0) "
                                   "to zero the other elements, or int indices")


def _row_ids(ids: np.ndarray, dim: int) -> np.ndarray:
    """Constant integer indices of rows of an axis of size ``dim``: negative ones counted from
    the end (numpy's), out-of-range ones a ShapeError now rather than when the function runs."""
    bad = (ids < -dim) | (ids >= dim) if ids.dtype.kind == "i" else ids >= dim
    if bad.any():
        raise ShapeError(f"[getitem] index {ids[bad].flat[0].item()} is out of range for axis 0 of size {dim}")
    ids = ids.astype(np.int64)
    return np.where(ids < 0, ids + dim, ids).astype(np.int32)


def matmul(a: Any, b: Any) -> Tensor:
    """Matrix product over the last two dims; leading (batch) dims broadcast like numpy.

    Example:
        >>> def forward(model, x):          # inside a traced function
        ...     return rlx.matmul(x, x.T)
    """
    t = _trace_of(a, b)
    # A constant beside a float64 tensor is made in float64 (never rounded to float32 first).
    wide = "float64" if "float64" in (_dtype_of(a), _dtype_of(b)) else None
    a, b = _wide_pair(_as_tensor(a, t, dtype=wide), _as_tensor(b, t, dtype=wide))
    return Tensor(t, t.graph.matmul(a._id, b._id))


def _wide_pair(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """Two operands (of a matmul, a loss), both float64 where either is (float64 wins, as in
    elementwise ops)."""
    if (a.dtype == "float64") != (b.dtype == "float64"):
        a, b = a.astype("float64"), b.astype("float64")
    return a, b


def relu(x: Any) -> Tensor:
    """``max(x, 0)`` elementwise.

    Example:
        >>> def forward(model, x):
        ...     return rlx.relu(model.fc(x))
    """
    return _unary("relu", x)


def tanh(x: Any) -> Tensor:
    """Hyperbolic tangent, elementwise.

    Example:
        >>> def forward(model, x):
        ...     return rlx.tanh(model.fc(x))
    """
    return _unary("tanh", x)


def sigmoid(x: Any) -> Tensor:
    """``1 / (1 + exp(-x))``, elementwise.

    Example:
        >>> def forward(model, x):
        ...     return rlx.sigmoid(model.fc(x))
    """
    return _unary("sigmoid", x)


def exp(x: Any) -> Tensor:
    """``e**x``, elementwise.

    Example:
        >>> def forward(model, x):
        ...     return rlx.exp(-x * x)
    """
    return _unary("exp", x)


def log(x: Any) -> Tensor:
    """Natural logarithm, elementwise.

    Example:
        >>> def forward(model, x):
        ...     return rlx.log(rlx.sigmoid(x))
    """
    return _unary("log", x)


def sqrt(x: Any) -> Tensor:
    """Square root, elementwise.

    Example:
        >>> def forward(model, x):
        ...     return rlx.sqrt((x * x).mean(axis=-1))
    """
    return _unary("sqrt", x)


def softmax(x: Any, axis: int = -1) -> Tensor:
    """Softmax along ``axis`` (numerically stable).

    Example:
        >>> def forward(model, x):
        ...     return rlx.softmax(model.fc(x), axis=-1)
    """
    t = _trace_of(x)
    x = _as_tensor(x, t)
    return Tensor(t, t.graph.softmax(x._id, _check.integer("softmax", "axis", axis, lo=-(2**62), hi=2**62), False))


def log_softmax(x: Any, axis: int = -1) -> Tensor:
    """Log-softmax along ``axis`` (numerically stable).

    Example:
        >>> def forward(model, x):
        ...     return rlx.log_softmax(model.fc(x), axis=-1)
    """
    t = _trace_of(x)
    x = _as_tensor(x, t)
    return Tensor(t, t.graph.softmax(x._id, _check.integer("log_softmax", "axis", axis, lo=-(2**62), hi=2**62), True))


def where(cond: Any, a: Any, b: Any) -> Tensor:
    """``a`` where ``cond`` is non-zero, else ``b`` (all broadcast; ``a`` and ``b`` promoted to
    one dtype as binary ops are).

    Example:
        >>> def forward(model, x):
        ...     return rlx.where(x > 0, x, 0.01 * x)       # leaky ReLU
    """
    t = _trace_of(cond, a, b)
    c = _as_tensor(cond, t)
    a, b = _promoted(t, a, b, op="where", moves=True)
    return Tensor(t, t.graph.where_(c._id, a._id, b._id))


def mse_loss(pred: Any, target: Any, reduction: str = "mean") -> Tensor:
    """Squared error of two tensors of the same shape, averaged (``reduction="mean"``) or summed
    (``"sum"``).

    Example:
        >>> def loss_fn(model, x, y):
        ...     return rlx.mse_loss(model(x), y)
    """
    if reduction not in ("mean", "sum"):
        raise InputError(f"[mse_loss] reduction must be 'mean' or 'sum', got {reduction!r}")
    t = _trace_of(pred, target)
    wide = "float64" if "float64" in (_dtype_of(pred), _dtype_of(target)) else None
    p, q = _wide_pair(_as_tensor(pred, t, dtype=wide), _as_tensor(target, t, dtype=wide))
    if reduction == "sum":
        if p.shape != q.shape:
            raise ShapeError(f"[mse_loss] pred and target must have the same shape, got {p.shape} and {q.shape}")
        d = p - q
        return (d * d).sum()
    return Tensor(t, t.graph.mse(p._id, q._id))


def gelu(x: Any, approximate: bool | str = False) -> Tensor:
    """GELU. Exact ``x * Phi(x)`` (erf) by default, as PyTorch; ``approximate=True`` (or
    ``"tanh"``) uses the tanh approximation.

    Example:
        >>> def forward(model, x):
        ...     return rlx.gelu(model.fc(x))
    """
    if approximate in (True, "tanh"):
        return _unary("gelu_tanh", x)
    if approximate in (False, "none", None):
        return _unary("gelu", x)
    raise InputError(f"[gelu] approximate must be True/False or 'tanh'/'none', got {approximate!r}")


def layer_norm(x: Any, weight: Any = None, bias: Any = None, eps: float = 1e-5) -> Tensor:
    """Normalises over the last axis, then scales by ``weight`` and shifts by ``bias``.

    Example:
        >>> def forward(model, x):
        ...     return rlx.layer_norm(x, model.ln.weight, model.ln.bias)
    """
    t = _trace_of(x, weight, bias)
    x = _as_tensor(x, t)
    for what, v in (("weight", weight), ("bias", bias)):
        shape = getattr(v, "shape", None) if v is not None else None
        if shape is not None and tuple(shape) not in ((), (x.shape[-1],)) and x.ndim:
            raise ShapeError(f"[layer_norm] {what} must have shape ({x.shape[-1]},) (the normalised last axis of "
                             f"{x.shape}), got {tuple(shape)}")
    y = Tensor(t, t.graph.normalize(x._id, _check.number("layer_norm", "eps", eps, lo=0.0)))
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y


def embedding(table: Any, ids: Any) -> Tensor:
    """Rows of ``table`` (num, dim) picked by int32 (or int64) ``ids`` of any shape: ``ids.shape + (dim,)``.

    Example:
        >>> def forward(model, ids):
        ...     return rlx.embedding(model.tok.weight, ids)   # (B, T) -> (B, T, dim)
    """
    t = _trace_of(table, ids)
    tb, ix = _as_tensor(table, t), _as_tensor(ids, t)
    if ix.dtype == "int64":
        ix = ix.astype("int32")  # fed ids are range-checked before the cast; see Tensor.astype
    return Tensor(t, t.graph.gather(tb._id, ix._id))


def concat(tensors: Sequence[Any], axis: int = 0) -> Tensor:
    """Joins tensors along ``axis`` (int32 and float32 parts give float32, as numpy's rules).

    Example:
        >>> def forward(model, a, b):
        ...     return rlx.concat([a, b], axis=-1)
    """
    if not tensors:
        raise ShapeError("[concat] needs at least one tensor")
    t = _trace_of(*tensors)
    ts = _promoted(t, *tensors, op="concat", moves=True)
    return Tensor(t, t.graph.concat([x._id for x in ts], int(axis)))


def split(x: Any, sections: int | Sequence[int], axis: int = -1) -> list[Tensor]:
    """Splits ``x`` along ``axis`` into ``sections`` equal parts, or parts of the given sizes.

    Example:
        >>> def forward(model, x):
        ...     q, k, v = rlx.split(x, 3, axis=-1)
        ...     return q + k + v
    """
    t = _trace_of(x)
    x = _as_tensor(x, t)
    axis = _check.integer("split", "axis", axis, lo=-x.ndim, hi=x.ndim - 1) if x.ndim else 0
    if not x.ndim:
        raise ShapeError("[split] cannot split a 0-d tensor")
    dim = x.shape[axis]
    if isinstance(sections, bool) or not isinstance(sections, (int, np.integer, Sequence)) or isinstance(sections, str):
        raise ShapeError(f"[split] sections must be an int or a list of sizes, got {sections!r}")
    if isinstance(sections, (int, np.integer)):
        if sections <= 0 or dim % sections:
            raise ShapeError(f"[split] axis {axis} of size {dim} does not split into {sections} equal parts")
        sizes = [dim // int(sections)] * int(sections)
    else:
        sizes = [_check.integer("split", "size", s, lo=0) for s in sections]
        if sum(sizes) != dim or any(s < 0 for s in sizes):
            raise ShapeError(f"[split] sizes {sizes} do not add up to {dim} (axis {axis} of {x.shape})")
    out, start = [], 0
    for n in sizes:
        out.append(Tensor(t, t.graph.slice(x._id, int(axis), start, start + n)))
        start += n
    return out


def _matmul_nt(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b^T`` over the last two dims, without materialising the transpose."""
    a, b = _wide_pair(a, b)
    return Tensor(a._trace, a._trace.graph.matmul(a._id, b._id, False, True))


def scaled_dot_product_attention(
    q: Any, k: Any, v: Any, causal: bool = False, *, causal_align: str = "top_left"
) -> Tensor:
    """``softmax(q @ k^T / sqrt(d) [+ causal mask]) @ v`` over (..., Tq, d) queries and
    (..., Tk, d) keys/values (``v`` may have its own last dim).

    float32 q, k, v with the same leading dims run as one fused ``attention`` instruction (and
    one ``attention_grad`` in the backward pass): the scores of one (batch, head) block at a
    time, never the whole (..., Tq, Tk) tensor. Other inputs (broadcast leading dims, empty
    axes) are computed from primitive ops.

    ``causal=True`` lets query ``i`` see keys ``j`` with ``j <= i + offset``. With the default
    ``causal_align="top_left"`` the offset is 0, as PyTorch's ``is_causal=True`` (query 0 sees
    key 0 only, whatever Tq and Tk are). ``causal_align="bottom_right"`` aligns the last query
    with the last key (offset ``Tk - Tq``), the convention for decoding Tq new tokens after
    ``Tk - Tq`` cached ones (PyTorch's ``causal_lower_right``). The two agree when Tq == Tk. A
    query that sees no key (bottom-right with Tq > Tk) gives NaN, as a softmax over no values.

    Example:
        >>> def forward(model, q, k, v):
        ...     return rlx.scaled_dot_product_attention(q, k, v, causal=True)
    """
    if causal_align not in ("top_left", "bottom_right"):
        raise InputError(
            f"[scaled_dot_product_attention] causal_align must be 'top_left' or 'bottom_right', got {causal_align!r}"
        )
    if not isinstance(causal, (bool, np.bool_)):
        raise InputError(f"[scaled_dot_product_attention] causal must be True or False, got {causal!r}")
    t = _trace_of(q, k, v)
    q, k, v = _as_tensor(q, t), _as_tensor(k, t), _as_tensor(v, t)
    _check_attention(q, k, v)
    tq, tk = q.shape[-2], k.shape[-2]
    offset = (tk - tq if causal_align == "bottom_right" else 0) if causal else None
    fits = (q.ndim >= 2 and k.ndim == q.ndim and v.ndim == q.ndim and q.shape[:-2] == k.shape[:-2] == v.shape[:-2]
            and q.shape[-1] == k.shape[-1] and k.shape[-2] == v.shape[-2] and min(q.shape[-2:] + k.shape[-2:] + v.shape[-1:]) > 0
            and q.dtype == k.dtype == v.dtype == "float32")
    if fits:  # one fused op: the scores of one (batch, head) block at a time, never all of them
        return Tensor(t, t.graph.attention([q._id, k._id, v._id], float(1.0 / np.sqrt(q.shape[-1])), offset))
    return _sdpa_composed(q, k, v, offset)


def _check_attention(q: Tensor, k: Tensor, v: Tensor) -> None:
    """Shape and dtype errors in attention's own terms (not those of the ops it is built from)."""
    what = f"q {q.shape}, k {k.shape}, v {v.shape}"
    if min(q.ndim, k.ndim, v.ndim) < 2:
        raise ShapeError(f"[scaled_dot_product_attention] q, k and v need at least 2 dims (..., T, d): {what}")
    if q.shape[-1] != k.shape[-1]:
        raise ShapeError(f"[scaled_dot_product_attention] q and k need the same last dim (d): {what}")
    if k.shape[-2] != v.shape[-2]:
        raise ShapeError(f"[scaled_dot_product_attention] k and v need the same number of keys (dim -2): {what}")
    try:
        np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    except ValueError:
        raise ShapeError(f"[scaled_dot_product_attention] the leading (batch, head) dims do not broadcast: {what}") from None
    if not q.dtype == k.dtype == v.dtype or not q.dtype.startswith("float"):
        raise DTypeError(f"[scaled_dot_product_attention] q, k and v need one float dtype: "
                         f"q {q.dtype}, k {k.dtype}, v {v.dtype}")


def _sdpa_composed(q: Tensor, k: Tensor, v: Tensor, offset: int | None) -> Tensor:
    """Attention from primitive ops (broadcast batch dims, empty axes; and the reference the
    fused op is tested against)."""
    # Head dim 0: every score is 0 (PyTorch's result: uniform attention), whatever the scale.
    scale = 1.0 / float(np.sqrt(q.shape[-1])) if q.shape[-1] else 1.0
    scores = _matmul_nt(q * scale, k)
    if offset is not None:
        tq, tk = scores.shape[-2], scores.shape[-1]
        mask = np.tril(np.ones((tq, tk), dtype=np.float32), k=offset)
        scores = where(mask, scores, float("-inf"))
    return matmul(softmax(scores, axis=-1), v)


def _is_bool_value(x: Any) -> bool:
    """A Python / numpy bool or a bool array (constants that promote as bools)."""
    return isinstance(x, (bool, np.bool_)) or (isinstance(x, np.ndarray) and x.dtype == np.bool_)


def _truth(x: Any, t: Trace) -> Tensor:
    """``x != 0`` as a float32 0/1 mask (a bool tensor's values as they are)."""
    x = _as_tensor(x, t, dtype="int32" if _is_bool_value(x) else None)
    return x.astype("float32") if x.dtype == "bool" else (x != 0)


def _logical(kind: str, a: Any, b: Any) -> Tensor:
    """The operator form (``&``, ``|``, ``^``): bool masks, and the float32 0/1 masks that
    comparisons give (Python and numpy bools included); integers are refused (rlx has no
    bitwise integer ops)."""
    for x in (a, b):
        d = _dtype_of(x) or ("bool" if _is_bool_value(x) else getattr(x, "dtype", type(x).__name__))
        if d not in ("bool", "float32"):
            raise DTypeError(f"[bitwise_{kind}] & | ^ take bool tensors or comparison masks, got {d}; "
                             f"use rlx.logical_{kind} for truth values")
    return {"and": logical_and, "or": logical_or, "xor": logical_xor}[kind](a, b)


def logical_and(a: Any, b: Any) -> Tensor:
    """Elementwise ``a and b`` of truth values (non-zero is true), broadcast; a bool tensor.

    Example:
        >>> def forward(model, x, valid):
        ...     return rlx.where(rlx.logical_and(x > 0, valid), x, 0.0)
    """
    t = _trace_of(a, b)
    return (_truth(a, t) * _truth(b, t)).astype("bool")


def logical_or(a: Any, b: Any) -> Tensor:
    """Elementwise ``a or b`` of truth values (non-zero is true), broadcast; a bool tensor.

    Example:
        >>> def forward(model, x, mask):
        ...     return rlx.where(rlx.logical_or(x > 1, x < -1), x, 0.0)
    """
    t = _trace_of(a, b)
    return (_truth(a, t) + _truth(b, t)).astype("bool")


def logical_xor(a: Any, b: Any) -> Tensor:
    """Elementwise ``a != b`` of truth values (non-zero is true), broadcast; a bool tensor.

    Example:
        >>> def forward(model, x, mask):
        ...     return rlx.where(rlx.logical_xor(x > 0, mask), x, 0.0)
    """
    t = _trace_of(a, b)
    return (_truth(a, t) != _truth(b, t)).astype("bool")


def logical_not(x: Any) -> Tensor:
    """Elementwise ``not x`` (zero is false); a bool tensor.

    Example:
        >>> def forward(model, x, mask):
        ...     return rlx.where(rlx.logical_not(mask), x, 0.0)
    """
    t = _trace_of(x)
    return (_truth(x, t) == 0).astype("bool")


def abs_(x: Any) -> Tensor:
    """``|x|`` elementwise (gradient ``sign(x)``, 0 at 0, as PyTorch's).

    Example:
        >>> def forward(model, x):
        ...     return rlx.abs(x - 1.0)
    """
    t = _trace_of(x)
    x = _as_tensor(x, t)
    if x.dtype == "bool":
        return x
    if x.dtype in _INTS:
        return where(x < 0, 0 - x, x)
    sign = (x > 0) - (x < 0)  # comparisons carry no gradient
    if x.dtype in _LOW:
        sign = sign.astype(x.dtype)  # -1, 0, 1 exactly; |x| keeps x's dtype
    return x * sign


def maximum(a: Any, b: Any) -> Tensor:
    """Elementwise maximum (NaN propagates; ties share the gradient equally, as PyTorch's).

    Example:
        >>> def forward(model, x):
        ...     return rlx.maximum(x, 0.0)
    """
    return _extremum(a, b, True)


def minimum(a: Any, b: Any) -> Tensor:
    """Elementwise minimum (NaN propagates; ties share the gradient equally).

    Example:
        >>> def forward(model, x):
        ...     return rlx.minimum(x, 1.0)
    """
    return _extremum(a, b, False)


def _extremum(a: Any, b: Any, is_max: bool) -> Tensor:
    t = _trace_of(a, b)
    a, b = _promoted(t, a, b, op="maximum" if is_max else "minimum")
    first, second = (a > b, a < b) if is_max else (a < b, a > b)
    if a.dtype in _INTS + ("bool",):
        return where(first, a, b)
    # Ties (and NaN, where no comparison holds) take the mean: the value is unchanged for ties,
    # NaN stays NaN, and each side gets half the gradient.
    return where(first, a, where(second, b, a * 0.5 + b * 0.5))


def clip(x: Any, lo: Any = None, hi: Any = None) -> Tensor:
    """``x`` limited to ``[lo, hi]`` (either may be None); NaN stays NaN. Gradients as PyTorch's
    ``clamp``: x's passes where ``lo < x < hi``; at a bound given as a number it is 0, at a bound
    given as a tensor x and the bound share it.

    Example:
        >>> def forward(model, x):
        ...     return rlx.clip(x, -1.0, 1.0)
    """
    t = _trace_of(x, lo, hi)
    x = _as_tensor(x, t)
    if lo is None and hi is None:
        raise InputError("[clip] give lo, hi or both")
    for what, v in (("lo", lo), ("hi", hi)):
        if isinstance(v, (float, np.floating)) and math.isnan(v):
            raise InputError(f"[clip] {what} is NaN (no value is below or above it); give a number or None")
    # PyTorch's clamp: a number as the bound passes no gradient to x at the bound itself, a
    # tensor bound shares it half and half with x there (as maximum / minimum do).
    number = (int, float, np.number)
    if lo is not None:
        x = where(x <= lo, lo, x) if isinstance(lo, number) else maximum(x, lo)
    if hi is not None:
        x = where(x >= hi, hi, x) if isinstance(hi, number) else minimum(x, hi)
    return x


def argmax(x: Any, axis: int | None = None) -> Tensor:
    """Index (int32) of the first maximum along ``axis``; of the flattened tensor when None.

    Example:
        >>> def forward(model, x):
        ...     return rlx.argmax(model(x), axis=-1)      # predicted classes
    """
    t = _trace_of(x)
    x = _as_tensor(x, t)
    if axis is None:
        x, axis = x.reshape(-1), 0
    axis = _check.integer("argmax", "axis", axis, lo=-x.ndim, hi=x.ndim - 1) if x.ndim else 0
    if x.ndim == 0 or x.shape[axis] == 0:
        raise ShapeError(f"[argmax] needs a non-empty axis, got shape {x.shape}")
    axis %= x.ndim
    xf = stop_gradient(x.astype("float32") if x.dtype == "int32" else x)
    n = x.shape[axis]
    # Score n-1-i where x is maximal (or NaN, which numpy's argmax picks first), else -1.
    rev = np.arange(n - 1, -1, -1, dtype=np.float32).reshape((n,) + (1,) * (x.ndim - 1 - axis))
    m = xf.max(axis=axis, keepdims=True)
    hit = (xf == m) + (xf != xf)
    score = where(hit, rev, -1.0).max(axis=axis)
    return (float(n - 1) - score).astype("int32")


def softplus(x: Any, beta: float = 1.0, threshold: float = 20.0) -> Tensor:
    """``log(1 + exp(beta * x)) / beta``, linear (``x``) where ``beta * x > threshold`` (PyTorch's).

    Example:
        >>> def forward(model, x):
        ...     return rlx.softplus(x)
    """
    beta = _check.number("softplus", "beta", beta)
    threshold = _check.number("softplus", "threshold", threshold)
    t = _trace_of(x)
    x = _as_tensor(x, t)
    bx = x * beta if beta != 1.0 else x
    soft = log1p(exp(where(bx > threshold, 0.0, bx)))
    if beta != 1.0:
        soft = soft / beta
    return where(bx > threshold, x, soft)


def log1p(x: Any) -> Tensor:
    """``log(1 + x)``, accurate for small ``x``.

    Example:
        >>> def forward(model, x):
        ...     return rlx.log1p(x * x)
    """
    return _unary("log1p", x)


def silu(x: Any) -> Tensor:
    """``x * sigmoid(x)`` (swish).

    Example:
        >>> def forward(model, x):
        ...     return rlx.silu(model.fc(x))
    """
    return x * sigmoid(x)


def leaky_relu(x: Any, negative_slope: float = 0.01) -> Tensor:
    """``x`` where ``x > 0``, else ``negative_slope * x``.

    Example:
        >>> def forward(model, x):
        ...     return rlx.leaky_relu(x, 0.2)
    """
    slope = _check.number("leaky_relu", "negative_slope", negative_slope)
    t = _trace_of(x)
    x = _as_tensor(x, t)
    return where(x > 0, x, x * slope)


def stop_gradient(x: Any) -> Tensor:
    """``x`` itself, through which no gradient flows back.

    Example:
        >>> def loss_fn(model, x):
        ...     target = rlx.stop_gradient(model(x))
        ...     return rlx.mse_loss(model(x + 0.1), target)
    """
    t = _trace_of(x)
    x = _as_tensor(x, t)
    if x.dtype not in ("float32", "float64") + _LOW:
        return x  # integer and bool tensors carry no gradient anyway
    return Tensor(t, t.graph.unary("stop_gradient", x._id))
