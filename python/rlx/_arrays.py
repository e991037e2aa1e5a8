"""Array helpers shared by the Python layer: rlx's dtypes as numpy dtypes (bfloat16 through
``ml_dtypes``, imported only when a bfloat16 array is needed), contiguous copies, and the checked
conversion of user arrays to an input spec (used by compiled functions and graphs alike)."""

from __future__ import annotations

from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from .errors import DTypeError, InputError, ShapeError

#: Every dtype rlx tensors can hold, by rlx's (numpy's) name.
DTYPES = ("float32", "float16", "bfloat16", "float64", "int32", "int64", "bool")
#: The floating-point ones (parameters may hold these; gradients flow through them).
FLOATS = ("float32", "float16", "bfloat16", "float64")

_PLAIN = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "float64": np.dtype(np.float64),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "bool": np.dtype(np.bool_),
}


def bfloat16() -> np.dtype:
    """numpy's dtype for bfloat16 (numpy has none of its own): ``ml_dtypes.bfloat16``."""
    try:
        import ml_dtypes
    except ImportError:
        raise DTypeError("[bfloat16] bfloat16 arrays need the ml_dtypes package (pip install ml_dtypes)") from None
    return np.dtype(ml_dtypes.bfloat16)


class _NumpyDtypes(Mapping[str, np.dtype]):
    """rlx dtype name -> numpy dtype; bfloat16 resolved (and ml_dtypes imported) on first use."""

    def __getitem__(self, name: str) -> np.dtype:
        if name == "bfloat16":
            return bfloat16()
        return _PLAIN[name]

    def __contains__(self, name: object) -> bool:
        return name in DTYPES

    def __iter__(self) -> Iterator[str]:
        return iter(DTYPES)

    def __len__(self) -> int:
        return len(DTYPES)


_NP = _NumpyDtypes()


def dtype_name(d: Any) -> str | None:
    """The rlx name of a numpy dtype (or anything ``np.dtype`` takes, or an rlx name), or None."""
    if isinstance(d, str) and d in DTYPES:
        return d
    if d is None:
        return None  # np.dtype(None) would be float64
    try:
        nd = np.dtype(d)
    except (TypeError, ValueError, KeyError, SyntaxError):
        return None
    if nd.name == "bfloat16":
        return "bfloat16"
    for name, plain in _PLAIN.items():
        if nd == plain:
            return name
    return None


def parse_dtype(where: str, d: Any) -> str:
    """``d`` (an rlx name, a numpy dtype or type, ``ml_dtypes.bfloat16``) as an rlx name."""
    name = dtype_name(d)
    if name is None:
        raise DTypeError(f"[{where}] unsupported dtype {d!r}; rlx has {', '.join(DTYPES)}")
    return name


def raw(arr: np.ndarray) -> np.ndarray:
    """A flat byte-compatible view for the native side: bfloat16 (a numpy user dtype, which the
    buffer protocol cannot describe) as uint16, bool as uint8; others unchanged."""
    if arr.dtype.name == "bfloat16":
        return arr.view(np.uint16)
    if arr.dtype == np.bool_:
        return arr.view(np.uint8)
    return arr


def from_bytes(data: Any, dtype: str, shape: Sequence[int]) -> np.ndarray:
    """An array of rlx ``dtype`` and ``shape`` over ``data`` (bytes or a buffer; no copy)."""
    return np.frombuffer(data, dtype=_NP[dtype]).reshape(shape)


def contiguous(a: Any, dtype: Any = None) -> np.ndarray:
    """A C-contiguous, native-byte-order array of ``dtype`` (no copy when ``a`` already is one).
    Unlike ``np.ascontiguousarray`` it keeps 0-d arrays 0-d."""
    return np.require(np.asarray(a, dtype=dtype), requirements=["C"])


def _how(value: Any, spec_dtype: str) -> str:
    target = "ml_dtypes.bfloat16" if spec_dtype == "bfloat16" else f"np.{spec_dtype}"
    return f".astype({target})" if isinstance(value, np.ndarray) else f"np.asarray(value, {target})"


#: The canonical numpy dtype objects of the dtypes whose arrays go to the native side as they are.
_FAST = {n: np.dtype(n) for n in ("float32", "float64", "float16", "int32", "int64")}


def convert(name: str, spec_shape: Sequence[int], spec_dtype: str, value: Any) -> np.ndarray:
    """Checks ``value`` against a spec and returns a flat C-contiguous native array of the spec's
    dtype (bfloat16 and bool as their raw bits, see ``raw``). Float inputs take arrays of exactly
    their dtype; integer inputs take any integer array whose values fit; bool inputs take bool
    arrays. Non-contiguous, Fortran-ordered and byte-swapped arrays are converted; anything else
    raises before any work."""
    # The common case, checked first (this runs for every input of every step): a C-contiguous,
    # native-order numpy array of exactly the spec's (plain) dtype and shape.
    fast = _FAST.get(spec_dtype)
    if type(value) is np.ndarray and value.dtype is fast and value.flags.c_contiguous and \
            value.shape == tuple(spec_shape):
        return value.reshape(-1)
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError) as e:
        raise DTypeError(f"[{name}] cannot use {type(value).__name__} as an array: {e}") from None
    want = _NP[spec_dtype]
    kind = arr.dtype.kind
    if spec_dtype in FLOATS:
        if dtype_name(arr.dtype.newbyteorder("=")) != spec_dtype:
            raise DTypeError(f"[{name}] expected a {spec_dtype} array, got {arr.dtype}; convert it with "
                             f"{_how(value, spec_dtype)}")
    elif spec_dtype == "bool":
        if kind != "b":
            raise DTypeError(f"[{name}] expected a bool array, got {arr.dtype}; convert it with {_how(value, 'bool_')}")
    else:
        bits = 32 if spec_dtype == "int32" else 64
        if kind not in "iu":
            raise DTypeError(f"[{name}] expected an {spec_dtype} array of ids, got {arr.dtype}")
        if arr.dtype.itemsize * 8 > bits or (kind == "u" and arr.dtype.itemsize * 8 >= bits):
            lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
            if arr.size and (int(arr.min()) < lo or int(arr.max()) > hi):
                raise InputError(f"[{name}] values {arr.min()}..{arr.max()} do not fit in {spec_dtype}")
    if tuple(arr.shape) != tuple(spec_shape):
        raise ShapeError(f"[{name}] expected shape {tuple(spec_shape)}, got {tuple(arr.shape)}")
    # Flat: the native side takes raw bytes (and 0-d arrays export no buffer shape).
    return raw(contiguous(arr, want).reshape(-1))
