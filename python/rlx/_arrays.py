"""Array helpers shared by the Python layer: native dtypes, contiguous copies, and the checked
conversion of user arrays to an input spec (used by compiled functions and graphs alike)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .errors import DTypeError, InputError, ShapeError

_NP = {"float32": np.dtype(np.float32), "int32": np.dtype(np.int32)}


def contiguous(a: Any, dtype: Any = None) -> np.ndarray:
    """A C-contiguous, native-byte-order array of ``dtype`` (no copy when ``a`` already is one).
    Unlike ``np.ascontiguousarray`` it keeps 0-d arrays 0-d."""
    return np.require(np.asarray(a, dtype=dtype), requirements=["C"])


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
            how = ".astype(np.float32)" if isinstance(value, np.ndarray) else "np.asarray(value, np.float32)"
            raise DTypeError(f"[{name}] expected a float32 array, got {arr.dtype}; convert it with {how}")
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
