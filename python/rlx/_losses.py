"""Loss functions inside traced functions: cross-entropy (ignored rows, label smoothing),
negative log-likelihood, binary cross-entropy with logits, L1 and smooth L1, each with
``reduction="mean" | "sum"``."""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _check
from ._tensor import Tensor, _as_tensor, _trace_of, abs_, exp, log1p, log_softmax, where
from .errors import DTypeError, InputError, ShapeError

_IGNORE = -100  # PyTorch's default ignore_index, built into the fused cross-entropy kernel


def _reduction(op: str, reduction: str) -> str:
    if reduction not in ("mean", "sum"):
        raise InputError(f"[{op}] reduction must be 'mean' or 'sum', got {reduction!r}")
    return reduction


def _reduce(x: Tensor, reduction: str) -> Tensor:
    return x.mean() if reduction == "mean" else x.sum()


def _class_inputs(op: str, logits: Any, labels: Any) -> tuple[Tensor, Tensor]:
    t = _trace_of(logits, labels)
    lg, lb = _as_tensor(logits, t), _as_tensor(labels, t)
    if lb.dtype == "int64":
        lb = lb.astype("int32")  # fed labels are range-checked before the cast
    if lb.dtype != "int32":
        raise DTypeError(f"[{op}] labels must be int32 or int64 class ids, got {lb.dtype}")
    if lg.dtype in ("bfloat16", "float16"):
        lg = lg.astype("float32")  # losses compute and return float32, as under autocast
    if lg.dtype not in ("float32", "float64"):
        raise DTypeError(f"[{op}] expects float32, float64, bfloat16 or float16 scores, got {lg.dtype}")
    if lg.ndim != 2 or lb.ndim != 1 or lg.shape[0] != lb.shape[0]:
        raise ShapeError(f"[{op}] expects scores (N, C) and labels (N,), got scores {lg.shape} and labels {lb.shape}")
    return lg, lb


def _labels_in_range(labels: Tensor, classes: int, ignore_index: int) -> Tensor:
    """A float32 0.0 that depends on ``labels`` through an embedding lookup of ``classes`` rows, so
    a label outside ``[0, classes)`` that is not ``ignore_index`` stops the run with an
    ``InputError`` (the lookup's range check) instead of picking nothing. Adding it to a loss
    changes no value or gradient."""
    t = labels._trace
    kept = where(labels == ignore_index, 0, labels).astype("int32")
    table = _as_tensor(np.zeros((classes, 1), dtype=np.float32), t)
    return Tensor(t, t.graph.gather(table._id, kept._id)).sum()


def _picked_nll(op: str, logp: Tensor, labels: Tensor, ignore_index: int, smoothing: float,
                reduction: str) -> Tensor:
    """``-logp[i, labels[i]]`` (mixed with the mean over classes by ``smoothing``), reduced over
    the rows whose label is not ``ignore_index``. A label out of ``[0, C)`` that is not
    ``ignore_index`` is an ``InputError`` when the step runs (as on the fused path)."""
    c = logp.shape[1]
    onehot = labels.reshape(-1, 1) == np.arange(c, dtype=np.int32).reshape(1, c)  # float32 (N, C)
    nll = -(logp * onehot).sum(axis=1)
    if smoothing:
        nll = nll * (1.0 - smoothing) - logp.mean(axis=1) * smoothing
    valid = labels != ignore_index
    total = (nll * valid).sum() + _labels_in_range(labels, c, ignore_index)
    return total / valid.sum() if reduction == "mean" else total


def cross_entropy(logits: Any, labels: Any, ignore_index: int = _IGNORE, label_smoothing: float = 0.0,
                  reduction: str = "mean") -> Tensor:
    """Softmax cross-entropy of ``logits`` (N, C) against int32 (or int64) class ids ``labels`` (N,), as
    PyTorch's: rows labelled ``ignore_index`` are left out (the mean is over the other rows),
    ``label_smoothing`` mixes the target with the uniform distribution.

    Example:
        >>> def loss_fn(model, x, y):
        ...     return rlx.cross_entropy(model(x), y)   # y: int32 (N,)
    """
    lg, lb = _class_inputs("cross_entropy", logits, labels)
    ignore_index = _check.integer("cross_entropy", "ignore_index", ignore_index, lo=-(2**31), hi=2**31 - 1)
    smoothing = _check.number("cross_entropy", "label_smoothing", label_smoothing, lo=0.0, hi=1.0)
    reduction = _reduction("cross_entropy", reduction)
    if ignore_index == _IGNORE and not smoothing and reduction == "mean":
        t = lg._trace
        return Tensor(t, t.graph.cross_entropy(lg._id, lb._id))  # one fused kernel
    return _picked_nll("cross_entropy", log_softmax(lg, axis=1), lb, ignore_index, smoothing, reduction)


def nll_loss(log_probs: Any, labels: Any, ignore_index: int = _IGNORE, reduction: str = "mean") -> Tensor:
    """Negative log-likelihood of ``log_probs`` (N, C) (e.g. ``log_softmax`` outputs) at the int32
    ``labels`` (N,); rows labelled ``ignore_index`` are left out.

    Example:
        >>> def loss_fn(model, x, y):
        ...     return rlx.nll_loss(rlx.log_softmax(model(x), axis=-1), y)
    """
    lp, lb = _class_inputs("nll_loss", log_probs, labels)
    ignore_index = _check.integer("nll_loss", "ignore_index", ignore_index, lo=-(2**31), hi=2**31 - 1)
    return _picked_nll("nll_loss", lp, lb, ignore_index, 0.0, _reduction("nll_loss", reduction))


def _pair(op: str, a: Any, b: Any) -> tuple[Tensor, Tensor]:
    t = _trace_of(a, b)
    x, y = _as_tensor(a, t), _as_tensor(b, t)
    if x.dtype in ("bfloat16", "float16"):
        x = x.astype("float32")  # losses compute and return float32, as under autocast
    if y.dtype == "float64" and x.dtype == "float32":
        x = x.astype("float64")  # float64 wins, as in elementwise ops
    if x.dtype not in ("float32", "float64"):
        raise DTypeError(f"[{op}] expects float32, float64, bfloat16 or float16 input, got {x.dtype}")
    if y.dtype != x.dtype:
        y = y.astype(x.dtype)
    if x.shape != y.shape:
        raise ShapeError(f"[{op}] input {x.shape} and target {y.shape} must have the same shape")
    return x, y


def binary_cross_entropy_with_logits(logits: Any, target: Any, reduction: str = "mean") -> Tensor:
    """``-(t * log(sigmoid(x)) + (1 - t) * log(1 - sigmoid(x)))``, computed stably as
    ``max(x, 0) - x * t + log1p(exp(-|x|))``.

    Example:
        >>> def loss_fn(model, x, y):
        ...     return rlx.binary_cross_entropy_with_logits(model(x), y)   # y in [0, 1]
    """
    x, t = _pair("binary_cross_entropy_with_logits", logits, target)
    reduction = _reduction("binary_cross_entropy_with_logits", reduction)
    loss = where(x > 0, x, 0.0) - x * t + log1p(exp(-abs_(x)))
    return _reduce(loss, reduction)


def l1_loss(pred: Any, target: Any, reduction: str = "mean") -> Tensor:
    """``|pred - target|``, reduced.

    Example:
        >>> def loss_fn(model, x, y):
        ...     return rlx.l1_loss(model(x), y)
    """
    x, y = _pair("l1_loss", pred, target)
    return _reduce(abs_(x - y), _reduction("l1_loss", reduction))


def smooth_l1_loss(pred: Any, target: Any, reduction: str = "mean", beta: float = 1.0) -> Tensor:
    """Huber-like loss: ``0.5 * d**2 / beta`` where ``|d| < beta``, else ``|d| - 0.5 * beta``
    (``d = pred - target``; PyTorch's ``smooth_l1_loss``; ``beta=0`` is the L1 loss).

    Example:
        >>> def loss_fn(model, x, y):
        ...     return rlx.smooth_l1_loss(model(x), y, beta=1.0)
    """
    x, y = _pair("smooth_l1_loss", pred, target)
    beta = _check.number("smooth_l1_loss", "beta", beta, lo=0.0)
    reduction = _reduction("smooth_l1_loss", reduction)
    d = abs_(x - y)
    if beta == 0.0:
        return _reduce(d, reduction)
    return _reduce(where(d < beta, d * d * (0.5 / beta), d - 0.5 * beta), reduction)
