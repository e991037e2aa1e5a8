"""Argument checks for the public API: every bad argument becomes an rlx exception that names
the function and the argument, before any work is done."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .errors import CheckpointError, DeviceError, DTypeError, InputError, RlxError, ShapeError


def integer(where: str, what: str, v: Any, lo: int | None = None, hi: int | None = None) -> int:
    """An int (not a bool or a float) within [lo, hi]; ShapeError when out of range."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise DTypeError(f"[{where}] {what} must be an int, got {type(v).__name__} {v!r}")
    v = int(v)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ShapeError(f"[{where}] {what} must be {bounds}, got {v}")
    return v


def number(where: str, what: str, v: Any, lo: float | None = None, hi: float | None = None,
           hi_open: bool = False) -> float:
    """A finite real number within [lo, hi] (or [lo, hi) with ``hi_open``); InputError otherwise."""
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise DTypeError(f"[{where}] {what} must be a number, got {type(v).__name__} {v!r}")
    v = float(v)
    bad = not math.isfinite(v) or (lo is not None and v < lo) or (hi is not None and (v >= hi if hi_open else v > hi))
    if bad:
        if hi is not None:
            rng = f" in [{'-inf' if lo is None else lo}, {hi}{')' if hi_open else ']'}"
        else:
            rng = f" >= {lo}" if lo is not None else ""
        raise InputError(f"[{where}] {what} must be a finite number{rng}, got {v}")
    return v


def shape(where: str, v: Any) -> tuple[int, ...]:
    """A tuple of non-negative ints."""
    if isinstance(v, (str, bytes, Mapping)) or not isinstance(v, (Sequence, np.ndarray)):
        raise ShapeError(f"[{where}] a shape must be a sequence of ints, got {type(v).__name__} {v!r}")
    out = []
    for d in v:
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)):
            raise ShapeError(f"[{where}] shape {tuple(v)!r} has a non-integer dimension {d!r}")
        if d < 0:
            raise ShapeError(f"[{where}] shape {tuple(v)!r} has a negative dimension")
        if d >= 2**62:
            raise ShapeError(f"[{where}] shape {tuple(v)!r} is too large")
        out.append(int(d))
    return tuple(out)


def name(where: str, v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise InputError(f"[{where}] a name must be a non-empty str, got {type(v).__name__} {v!r}")
    return v


def device(v: Any) -> str:
    if not isinstance(v, str):
        raise DeviceError(f"[device] a device is a str such as 'cpu' or 'cuda:0', got {type(v).__name__} {v!r}")
    cpu_environment()
    return v


#: The CPU backend's settings and the values each takes (lower case; unset or empty: the default).
_CPU_SETTINGS = {
    "RLX_CPU_ISA": ("auto", "portable", "avx2", "avx512"),
    "RLX_CPU_GEMM": ("auto", "crate", "avx2", "avx512"),
    "RLX_CPU_BF16": ("auto", "avx512bf16", "portable"),
}


def cpu_environment() -> None:
    """InputError for a CPU setting with a value the kernels would ignore (a typo used to fall
    back to the default silently). Every run reads them once per process, so this checks the
    environment each compile sees."""
    for var, allowed in _CPU_SETTINGS.items():
        value = os.environ.get(var, "").strip().lower()
        if value and value not in allowed:
            raise InputError(f"[cpu] {var} must be one of {', '.join(allowed)} (or unset), got {os.environ[var]!r}")
    for var in ("RLX_NUM_THREADS",):
        value = os.environ.get(var, "").strip()
        if value and not (value.isdigit() and int(value) > 0):
            raise InputError(f"[cpu] {var} must be a positive number of threads (or unset), got {value!r}")


def function(where: str, what: str, f: Any) -> Any:
    if not callable(f):
        raise RlxError(f"[{where}] {what} must be callable, got {type(f).__name__}")
    return f


def path(where: str, p: Any) -> str:
    if not isinstance(p, (str, os.PathLike)):
        raise CheckpointError(f"[{where}] a path must be a str or os.PathLike, got {type(p).__name__} {p!r}")
    return os.fspath(p)


def fits_in_memory(where: str, shape: Sequence[int], itemsize: int = 4) -> None:
    """Refuses a tensor larger than this machine's physical memory (before numpy tries)."""
    n = itemsize
    for d in shape:
        n *= int(d)
    try:
        limit = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        limit = 2**48
    if n > limit:
        raise ShapeError(f"[{where}] a tensor of shape {tuple(shape)} needs {n:,} bytes, more than this machine has")
