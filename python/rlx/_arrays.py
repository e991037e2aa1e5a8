"""Array helpers shared by the Python layer."""

from __future__ import annotations

from typing import Any

import numpy as np


def contiguous(a: Any, dtype: Any = None) -> np.ndarray:
    """A C-contiguous, native-byte-order array of ``dtype`` (no copy when ``a`` already is one).
    Unlike ``np.ascontiguousarray`` it keeps 0-d arrays 0-d."""
    return np.require(np.asarray(a, dtype=dtype), requirements=["C"])
