"""Vision and regularisation ops inside traced functions: conv2d (lowered to im2col + GEMM),
max / average pooling, batch normalisation and seeded dropout."""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _check
from ._random import rng
from ._tensor import Tensor, Trace, _as_tensor, _matmul_nt, _trace_of
from .errors import DTypeError, InputError, ShapeError

#: The name of the hidden int32 (2,) input holding the dropout seed of a call: (key, call count).
RNG_INPUT = "rlx.rng"
#: Output positions per image from which conv2d runs one GEMM per image instead of one tall GEMM
#: plus a transpose.
_DIRECT_MIN = 256


def _pair(op: str, name: str, v: Any, lo: int) -> tuple[int, int]:
    if isinstance(v, (tuple, list)):
        if len(v) != 2:
            raise InputError(f"[{op}] {name} must be an int or a pair of ints, got {v!r}")
        return (_check.integer(op, name, v[0], lo=lo), _check.integer(op, name, v[1], lo=lo))
    n = _check.integer(op, name, v, lo=lo)
    return (n, n)


def _nchw(op: str, x: Tensor, what: str = "x", layout: str = "(N, C, H, W)") -> None:
    if x.ndim != 4:
        raise ShapeError(f"[{op}] {what} must have rank 4 {layout}, got shape {x.shape}")
    if x.dtype not in ("float32", "float64", "bfloat16", "float16"):
        raise DTypeError(f"[{op}] {what} must be float32, float64, bfloat16 or float16, got {x.dtype}")


def _out_size(op: str, x: Tensor, k: tuple[int, int], s: tuple[int, int], p: tuple[int, int], what: str) -> tuple[int, int]:
    h, w = x.shape[2] + 2 * p[0], x.shape[3] + 2 * p[1]
    if k[0] > h or k[1] > w:
        raise ShapeError(
            f"[{op}] {what} {k} is larger than the padded input ({h}, {w}) (x {x.shape}, padding {p})"
        )
    return (h - k[0]) // s[0] + 1, (w - k[1]) // s[1] + 1


def conv2d(x: Any, weight: Any, bias: Any = None, stride: int | tuple[int, int] = 1,
           padding: int | tuple[int, int] = 0) -> Tensor:
    """2-D convolution (cross-correlation, as PyTorch's) of ``x`` (N, C, H, W) with ``weight``
    (O, C, kh, kw), plus ``bias`` (O,) when given: (N, O, Ho, Wo). Lowered to a GEMM over
    im2col patches planned in the arena.

    Example:
        >>> def forward(model, x):
        ...     return rlx.conv2d(x, model.w, model.b, stride=1, padding=1)
    """
    t = _trace_of(x, weight, bias)
    x, w = _as_tensor(x, t), _as_tensor(weight, t)
    s = _pair("conv2d", "stride", stride, 1)
    p = _pair("conv2d", "padding", padding, 0)
    _nchw("conv2d", x)
    _nchw("conv2d", w, "weight", "(out_channels, in_channels, kh, kw)")
    if "float64" in (x.dtype, w.dtype) and x.dtype != w.dtype:
        # float64 beside another float computes in float64 (rlx's promotion, as for matmul).
        x, w = x.astype("float64"), w.astype("float64")
    n, c, h, wd = x.shape
    o, cw, kh, kw = w.shape
    if cw != c:
        raise ShapeError(f"[conv2d] x has {c} channels but weight {w.shape} expects {cw} (x {x.shape})")
    if kh == 0 or kw == 0:
        raise ShapeError(f"[conv2d] weight {w.shape} has an empty kernel")
    ho, wo = _out_size("conv2d", x, (kh, kw), s, p, "kernel")
    w2 = w.reshape(o, c * kh * kw)
    b = None
    if bias is not None:
        # A float64 convolution keeps a numpy bias in float64.
        b = _as_tensor(bias, t, None, "float64" if x.dtype == "float64" else None)
        if b.shape != (o,):
            raise ShapeError(f"[conv2d] bias must have shape ({o},), got {b.shape}")
    if ho * wo >= _DIRECT_MIN:
        # Large images: tap-major patches (N, K, Ho*Wo), whose rows are shifted copies of input
        # rows, and one GEMM per image, weight (O, K) @ patches, straight into NCHW; the
        # gradients are per-image GEMMs too (the weight's summed over the batch). The bias is
        # added in NCHW shape, so an activation after the conv joins the same matmul epilogue
        # (a reshape between them would end the fused expression).
        cols = Tensor(t, t.graph.window("im2col_k", x._id, (kh, kw), s, p))
        y = Tensor(t, t.graph.matmul(w2._id, cols._id, False, False)).reshape(n, o, ho, wo)
        if b is not None:
            y = y + b.reshape(o, 1, 1)
        return y
    # Small images: all patches of the batch as one 2-D (N*Ho*Wo, K) matrix times the weight:
    # one tall GEMM forward, one for the patch gradient and one (K = N*Ho*Wo) for the weight
    # gradient (a batched product would make that a GEMM per image plus a sum over the batch);
    # then one transpose to NCHW.
    k = c * kh * kw
    cols = Tensor(t, t.graph.window("im2col", x._id, (kh, kw), s, p))  # (N, Ho*Wo, K)
    y = _matmul_nt(cols.reshape(n * ho * wo, k), w2)
    if b is not None:
        y = y + b
    return y.reshape(n, ho * wo, o).transpose(0, 2, 1).reshape(n, o, ho, wo)


def _pool(op: str, x: Any, kernel_size: Any, stride: Any, padding: Any) -> Tensor:
    t = _trace_of(x)
    x = _as_tensor(x, t)
    _nchw(op, x)
    k = _pair(op, "kernel_size", kernel_size, 1)
    s = k if stride is None else _pair(op, "stride", stride, 1)
    p = _pair(op, "padding", padding, 0)
    if p[0] > k[0] // 2 or p[1] > k[1] // 2:
        raise ShapeError(f"[{op}] padding {p} must be at most half the kernel size {k}")
    _out_size(op, x, k, s, p, "kernel_size")
    return Tensor(t, t.graph.window(op, x._id, k, s, p))


def max_pool2d(x: Any, kernel_size: int | tuple[int, int], stride: int | tuple[int, int] | None = None,
               padding: int | tuple[int, int] = 0) -> Tensor:
    """Max over ``kernel_size`` windows of x (N, C, H, W), every ``stride`` (default: the kernel
    size) with ``padding`` (-inf) on each side; the output size rounds down (PyTorch's
    defaults). The gradient goes to the first maximum of each window.

    Example:
        >>> def forward(model, x):
        ...     return rlx.max_pool2d(x, 2)          # (N, C, 8, 8) -> (N, C, 4, 4)
    """
    return _pool("max_pool2d", x, kernel_size, stride, padding)


def avg_pool2d(x: Any, kernel_size: int | tuple[int, int], stride: int | tuple[int, int] | None = None,
               padding: int | tuple[int, int] = 0) -> Tensor:
    """Mean over ``kernel_size`` windows of x (N, C, H, W); padding counts as zeros in the
    mean (PyTorch's ``count_include_pad=True``).

    Example:
        >>> def forward(model, x):
        ...     return rlx.avg_pool2d(x, 2)
    """
    return _pool("avg_pool2d", x, kernel_size, stride, padding)


def _rng_input(t: Trace) -> Tensor:
    """The trace's hidden seed input (made at its first dropout); each later dropout of the
    trace gets its own key by adding its index to the first word."""
    node = t.__dict__.get("rng_node")
    if node is None:
        node = t.rng_node = t.graph.input(RNG_INPUT, [2], "int32")
        t.rng_calls = 0
    t.rng_calls += 1
    seed = Tensor(t, node)
    return seed + t.constant(np.array([t.rng_calls - 1, 0], np.int32))


def dropout(x: Any, p: float = 0.5, training: bool = True) -> Tensor:
    """Inverted dropout: in training, each element is zeroed with probability ``p`` and the
    rest scaled by ``1 / (1 - p)``; otherwise ``x`` unchanged. The mask is drawn in the graph
    from a seed that ``rlx.seed`` makes reproducible: the same for a given step number, new at
    every call of a compiled step. (In a graph built by hand with ``rlx.Graph``, the seed is an
    int32 (2,) input named ``"rlx.rng"`` that the caller feeds: a key and a call counter.)

    Example:
        >>> def forward(model, x):
        ...     return rlx.dropout(x, 0.1, training=True)
    """
    p = _check.number("dropout", "p", p)
    if not 0.0 <= p < 1.0:
        raise InputError(f"[dropout] p must be in [0, 1), got {p}")
    t = _trace_of(x)
    x = _as_tensor(x, t)
    if not training or p == 0.0:
        return x  # the identity for every dtype
    if x.dtype not in ("float32", "float64", "bfloat16", "float16"):
        raise DTypeError(f"[dropout] x must be float32, float64, bfloat16 or float16, got {x.dtype}")
    seed = _rng_input(t)
    return Tensor(t, t.graph.dropout(x._id, seed._id, float(p)))


def new_rng_key() -> int:
    """A dropout key drawn from rlx's generator (``rlx.seed`` makes it reproducible)."""
    return int(rng().integers(0, 2**31 - 1 - 4096))


def batch_norm(x: Any, running_mean: Any, running_var: Any, weight: Any = None, bias: Any = None,
               training: bool = False, momentum: float = 0.1, eps: float = 1e-5) -> Tensor:
    """Batch normalisation over every axis but 1 (the channels) of x (N, C) or (N, C, ...).

    In training, the batch's mean and (biased) variance normalise ``x``; when the running
    statistics are buffers they are updated in place at the end of the step
    (``(1 - momentum) * running + momentum * batch``, the variance unbiased), as PyTorch's.
    Otherwise the running statistics normalise ``x``.

    Example:
        >>> def forward(model, x):
        ...     return rlx.batch_norm(x, model.bn.running_mean, model.bn.running_var,
        ...                           model.bn.weight, model.bn.bias, training=True)
    """
    t = _trace_of(x, running_mean, running_var, weight, bias)
    x = _as_tensor(x, t)
    if x.ndim < 2:
        raise ShapeError(f"[batch_norm] x must have shape (N, C) or (N, C, ...), got {x.shape}")
    c = x.shape[1]
    stats_shape = (1, c) + (1,) * (x.ndim - 2)
    axes = [0] + list(range(2, x.ndim))

    def per_channel(v: Any, what: str) -> Tensor:
        tv = _as_tensor(v, t)
        if tv.shape != (c,):
            raise ShapeError(f"[batch_norm] {what} must have shape ({c},) for x {x.shape}, got {tv.shape}")
        return tv.reshape(*stats_shape)

    rm, rv = per_channel(running_mean, "running_mean"), per_channel(running_var, "running_var")
    if training:
        count = x.shape[0] * int(np.prod(x.shape[2:], dtype=np.int64))
        if count <= 1:
            raise ShapeError(f"[batch_norm] expected more than 1 value per channel when training, got x {x.shape}")
        mean = x.mean(axis=axes, keepdims=True)
        centred = x - mean
        var = (centred * centred).mean(axis=axes, keepdims=True)
        y = centred * (var + eps) ** -0.5
        m = _check.number("batch_norm", "momentum", momentum)
        for buf, batch in ((running_mean, mean), (running_var, var * (count / (count - 1)))):
            update = getattr(buf, "update", None)
            if update is not None:
                update(buf * (1.0 - m) + batch.reshape(c) * m)
    else:
        y = (x - rm) * (rv + eps) ** -0.5
    if weight is not None:
        y = y * per_channel(weight, "weight")
    if bias is not None:
        y = y + per_channel(bias, "bias")
    return y
