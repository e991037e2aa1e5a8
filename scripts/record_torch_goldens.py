"""Records PyTorch golden cases for rlx's ops from PyTorch's own OpInfo samples.

Run where PyTorch (and its test helper dependency ``expecttest``) is installed::

    python scripts/record_torch_goldens.py            # writes tests/goldens/*.npz

For every OpInfo entry that rlx has an equivalent of (``TRANSLATE`` below), the float32 CPU
reference inputs (``reference_inputs(..., requires_grad=True)``: the samples plus extremal
values) are turned into an rlx call spec, or skipped with a counted reason when rlx cannot
express the arguments (a tensor exponent, truncating division, advanced indexing...); integer
arithmetic, comparisons and layout entries are recorded again with int32 inputs (forward only).
At most ``MAX_SAMPLES`` per entry are kept, spread evenly over the list. Each recorded sample
holds the inputs, PyTorch's outputs, a fixed random cotangent per output, and the gradients
of ``sum(out * cotangent)`` w.r.t. every float input. ``tests/test_torch_goldens.py`` replays
them through rlx without PyTorch. Re-record when ops are added (add a translator here and the
matching spec in the test).

Last recording (PyTorch 2.15.0, CPU): 6,176 samples, 1,779 recorded (880 with gradients), 2.8 MB;
every count and skip reason is in ``tests/goldens/SUMMARY.txt`` (written by this script).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import zlib
from typing import Any, Callable

import numpy as np

MAX_SAMPLES = 24  # per op, to keep the fixtures small
MAX_ELEMENTS = 2500  # per sample (all tensors together)


class Skip(Exception):
    """A sample rlx cannot express; the message is the counted reason."""


class Call:
    """Collects a sample's tensors (rlx inputs) while a translator builds the call spec. Each
    becomes a fresh leaf (float ones requiring grad), and PyTorch runs on those leaves, so the
    gradients are exactly those of the recorded inputs (OpInfo's generators may hand out views
    made under ``no_grad``). A tensor used twice is one rlx input used twice."""

    def __init__(self) -> None:
        self.tensors: list[Any] = []
        self.leaves: dict[int, int] = {}  # id(sample tensor) -> index in self.tensors

    def swap(self, obj: Any) -> Any:
        """``obj`` (a sample's input/args/kwargs) with its recorded tensors replaced by the leaves."""
        import torch

        if isinstance(obj, torch.Tensor):
            i = self.leaves.get(id(obj))
            return self.tensors[i][0] if i is not None else obj.detach().clone()
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.swap(o) for o in obj)
        if isinstance(obj, dict):
            return {k: self.swap(v) for k, v in obj.items()}
        return obj

    def t(self, x: Any, kind: str = "float") -> dict:
        import torch

        if not isinstance(x, torch.Tensor):
            raise Skip(f"expected a tensor, got {type(x).__name__}")
        if id(x) in self.leaves:
            return {"t": self.leaves[id(x)]}
        if kind == "float" and x.dtype == torch.int32:
            kind = "int"  # the int32 pass: value operands are int32 tensors
        elif kind == "float":
            if x.dtype != torch.float32:
                raise Skip(f"tensor of dtype {x.dtype}")
        elif kind == "int":
            if x.dtype not in (torch.int64, torch.int32):
                raise Skip(f"index tensor of dtype {x.dtype}")
            if x.numel() and (int(x.min()) < -(2**31) or int(x.max()) >= 2**31):
                raise Skip("int64 values outside int32")
        elif kind == "mask":
            if x.dtype != torch.bool:
                raise Skip(f"condition of dtype {x.dtype}")
        leaf = x.detach().clone()
        if kind == "float" and leaf.is_floating_point():
            leaf.requires_grad_(True)
        self.tensors.append((leaf, kind))
        self.leaves[id(x)] = len(self.tensors) - 1
        return {"t": len(self.tensors) - 1}


def operand(c: Call, x: Any) -> Any:
    """A tensor operand, or a Python scalar kept as a scalar (int or float)."""
    import torch

    if isinstance(x, torch.Tensor):
        return c.t(x)
    if isinstance(x, bool):
        raise Skip("bool scalar operand")
    if isinstance(x, (int, float)):
        return x
    raise Skip(f"operand of type {type(x).__name__}")


def no_kwargs(kw: dict, allowed: dict | None = None) -> None:
    """Refuses keyword arguments other than ``allowed`` (name -> accepted default-like values)."""
    import torch

    for k, v in kw.items():
        if allowed is not None and k in allowed and allowed[k](v):
            continue
        raise Skip(f"keyword {k}={'<tensor>' if isinstance(v, torch.Tensor) else repr(v)}")


def dims_of(dim: Any, ndim: int) -> list[int] | None:
    if dim is None:
        return None
    dims = [dim] if isinstance(dim, int) else list(dim)
    if not dims:
        return None  # PyTorch reduces everything for dim=[]
    if ndim == 0:
        raise Skip("reduction axis on a 0-d tensor")
    return sorted(d % ndim for d in dims)


# ------------------------------------------------------------------------------------------------
# translators: (call, input, args, kwargs) -> spec dict
# ------------------------------------------------------------------------------------------------
def binary(op: str, reflected: bool = False) -> Callable:
    def tr(c: Call, x: Any, args: tuple, kw: dict) -> dict:
        no_kwargs(kw)
        if len(args) != 1:
            raise Skip("extra positional arguments")
        a, b = operand(c, x), operand(c, args[0])
        if reflected:
            a, b = b, a
        return {"op": op, "a": a, "b": b}

    return tr


def add_sub(op: str) -> Callable:
    def tr(c: Call, x: Any, args: tuple, kw: dict) -> dict:
        if kw.get("alpha", 1) != 1:
            raise Skip("alpha argument")
        no_kwargs(kw, {"alpha": lambda v: v == 1})
        if len(args) != 1:
            raise Skip("extra positional arguments")
        a, b = operand(c, x), operand(c, args[0])
        if op == "rsub":
            return {"op": "sub", "a": b, "b": a}
        return {"op": op, "a": a, "b": b}

    return tr


def div(mode: str | None) -> Callable:
    def tr(c: Call, x: Any, args: tuple, kw: dict) -> dict:
        if kw.get("rounding_mode") != mode:
            raise Skip("rounding mode")
        no_kwargs(kw, {"rounding_mode": lambda v: v == mode})
        if mode == "trunc":
            raise Skip("truncating division (rlx has / and //)")
        return {"op": "floordiv" if mode == "floor" else "div", "a": operand(c, x), "b": operand(c, args[0])}

    return tr


def unary(op: str) -> Callable:
    def tr(c: Call, x: Any, args: tuple, kw: dict) -> dict:
        no_kwargs(kw, {"inplace": lambda v: v is False})
        if args:
            raise Skip("extra positional arguments")
        return {"op": op, "x": c.t(x)}

    return tr


def tr_pow(c: Call, x: Any, args: tuple, kw: dict) -> dict:
    import torch

    no_kwargs(kw)
    if isinstance(args[0], torch.Tensor) and args[0].ndim == 0 and isinstance(x, torch.Tensor):
        # A 0-d exponent is a number to rlx: compared are the values and the base's gradient.
        return {"op": "pow", "x": c.t(x), "p": float(args[0].detach())}
    if isinstance(args[0], torch.Tensor):
        raise Skip("tensor exponent")
    if isinstance(x, torch.Tensor) and isinstance(args[0], (int, float)) and not isinstance(args[0], bool):
        return {"op": "pow", "x": c.t(x), "p": args[0]}  # an int stays an int (int32 ** int is int32)
    raise Skip("scalar base")


def tr_gelu(c: Call, x: Any, args: tuple, kw: dict) -> dict:
    no_kwargs(kw, {"approximate": lambda v: v in ("none", "tanh")})
    return {"op": "gelu", "x": c.t(x), "approximate": kw.get("approximate", "none")}


def tr_matmul(c: Call, x: Any, args: tuple, kw: dict) -> dict:
    no_kwargs(kw)
    if x.ndim < 2 or args[0].ndim < 2:
        raise Skip("matmul with a 1-d operand")
    return {"op": "matmul", "a": c.t(x), "b": c.t(args[0])}


def tr_rmatmul(c: Call, x: Any, args: tuple, kw: dict) -> dict:
    no_kwargs(kw)
    if x.ndim < 2 or args[0].ndim < 2:
        raise Skip("matmul with a 1-d operand")
    b = c.t(x)
    return {"op": "matmul", "a": c.t(args[0]), "b": b}


def tr_linear(c: Call, x: Any, args: tuple, kw: dict) -> dict:
    no_kwargs(kw)
    w = args[0]
    bias = args[1] if len(args) > 1 else kw.get("bias")
    if x.ndim < 2 or w.ndim != 2:
        raise Skip("matmul with a 1-d operand")
    spec = {"op": "linear", "x": c.t(x), "w": c.t(w), "b": None}
    if bias is not None:
        spec["b"] = c.t(bias)
    return spec


def reduction(op: str) -> Callable:
    def tr(c: Call, x: Any, args: tuple, kw: dict) -> dict:
        kw = dict(kw)
        dim = args[0] if args else kw.pop("dim", None)
        keep = args[1] if len(args) > 1 else kw.pop("keepdim", False)
        no_kwargs(kw)
        return {"op": op, "x": c.t(x), "axis": dims_of(dim, x.ndim), "keepdims": bool(keep)}

    return tr


def tr_max_all(c: Call, x: Any, args: tuple, kw: dict) -> dict:
    no_kwargs(kw)
    if args:
        raise Skip("max with arguments")
    return {"op": "max", "x": c.t(x), "axis": None, "keepdims": False}


def tr_reshape(c: Call, x: Any, args: tuple, kw: dict) -> dict:
    no_kwargs(kw)
    shape = args[0] if len(args) == 1 and isinstance(args[0], (list, tuple)) else args
    return {"op": "reshape", "x": c.t(x), "shape": [int(s) for s in shape]}


def tr_transpose(c: Call, x: Any, args: tuple, kw: dict) -> dict:
    no_kwargs(kw)
    n = max(x.ndim, 1)
    perm = list(range(x.ndim))
    if x.ndim:
        a, b = args[0] % n, args[1] % n
        perm[a], perm[b] = perm[b], perm[a]
    return {"op": "transpose", "x": c.t(x), "perm": perm}


def tr_permute(c: Call, x: Any, args: tuple, kw: dict) -> dict:
    no_kwargs(kw)
    dims = args[0] if len(args) == 1 and isinstance(args[0], (list, tuple)) else args
    return {"op": "transpose", "x": c.t(x), "perm": [d % max(x.ndim, 1) for d in dims]}


def tr_t(c: Call, x: Any, args: tuple, kw: dict) -> dict:
    no_kwargs(kw)
    return {"op": "transpose", "x": c.t(x), "perm": list(range(x.ndim))[::-1]}


def tr_mT(c: Call, x: Any, args: tuple, kw: dict) -> dict:
    no_kwargs(kw)
    perm = list(range(x.ndim))
    perm[-2], perm[-1] = perm[-1], perm[-2]
    return {"op": "transpose", "x": c.t(x), "perm": perm}


def softmax_like(op: str) -> Callable:
    def tr(c: Call, x: Any, args: tuple, kw: dict) -> dict:
        kw = dict(kw)
        dim = args[0] if args else kw.pop("dim", None)
        no_kwargs(kw)
        if len(args) > 1:
            raise Skip("dtype argument")
        if dim is None:
            raise Skip("implicit dim")
        if x.ndim == 0:
            raise Skip("softmax of a 0-d tensor")
        return {"op": op, "x": c.t(x), "axis": int(dim) % x.ndim}

    return tr


def tr_cross_entropy(c: Call, x: Any, args: tuple, kw: dict) -> dict:
    import torch

    no_kwargs(kw, {"reduction": lambda v: v == "mean"})
    target = args[0]
    if x.ndim != 2:
        raise Skip("cross_entropy input not (N, C)")
    if target.dtype == torch.float32:
        raise Skip("cross_entropy with probability targets")
    return {"op": "cross_entropy", "x": c.t(x), "y": c.t(target, "int")}


def tr_mse(c: Call, x: Any, args: tuple, kw: dict) -> dict:
    no_kwargs(kw, {"reduction": lambda v: v == "mean"})
    if x.shape != args[0].shape:
        raise Skip("mse_loss of differently shaped tensors")
    return {"op": "mse_loss", "x": c.t(x), "y": c.t(args[0])}


def tr_where(c: Call, x: Any, args: tuple, kw: dict) -> dict:
    no_kwargs(kw)
    cond, other = args
    return {"op": "where", "c": c.t(cond, "mask"), "a": operand(c, x), "b": operand(c, other)}


def tr_embedding(c: Call, x: Any, args: tuple, kw: dict) -> dict:
    no_kwargs(kw)
    if len(args) != 1:
        raise Skip("embedding options")
    table, ids = args[0], x
    if table.ndim != 2 or table.dtype != ids.dtype and ids.dtype.is_floating_point:
        raise Skip("embedding shapes")
    idx = c.t(ids, "int")
    return {"op": "embedding", "table": c.t(table), "ids": idx}


def tr_embedding_swapped(c: Call, x: Any, args: tuple, kw: dict) -> dict:
    import torch

    # OpInfo's embedding samples are (weight, idx) or (idx, weight); accept both.
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        no_kwargs(kw)
        if len(args) != 1:
            raise Skip("embedding options")
        idx = c.t(args[0], "int")
        return {"op": "embedding", "table": c.t(x), "ids": idx}
    return tr_embedding(c, x, args, kw)


def tr_layer_norm(c: Call, x: Any, args: tuple, kw: dict) -> dict:
    kw = dict(kw)
    shape = args[0]
    w = args[1] if len(args) > 1 else kw.pop("weight", None)
    b = args[2] if len(args) > 2 else kw.pop("bias", None)
    eps = kw.pop("eps", 1e-5)
    no_kwargs(kw)
    if len(shape) != 1:
        raise Skip("layer_norm over more than the last axis")
    if eps < 0:
        raise Skip("negative eps")
    spec = {"op": "layer_norm", "x": c.t(x), "w": None, "b": None, "eps": float(eps)}
    if w is not None:
        spec["w"] = c.t(w)
    if b is not None:
        spec["b"] = c.t(b)
    return spec


def tr_cat(c: Call, x: Any, args: tuple, kw: dict) -> dict:
    kw = dict(kw)
    dim = args[0] if args else kw.pop("dim", 0)
    no_kwargs(kw)
    xs = list(x)
    if any(t.ndim == 1 and t.shape[0] == 0 for t in xs) and any(t.ndim != 1 for t in xs):
        raise Skip("cat with legacy empty (0,) tensors")
    nd = xs[0].ndim
    if nd == 0:
        raise Skip("cat of 0-d tensors")
    return {"op": "concat", "xs": [c.t(t) for t in xs], "axis": int(dim) % nd}


def split_sizes(n: int, size: int) -> list[int]:
    if size <= 0:
        raise Skip("split size 0")
    return [min(size, n - i) for i in range(0, n, size)] or [0]


def tr_split(c: Call, x: Any, args: tuple, kw: dict) -> dict:
    kw = dict(kw)
    sec = args[0]
    dim = args[1] if len(args) > 1 else kw.pop("dim", 0)
    no_kwargs(kw)
    if x.ndim == 0:
        raise Skip("split of a 0-d tensor")
    dim = int(dim) % x.ndim
    sizes = split_sizes(x.shape[dim], int(sec)) if isinstance(sec, int) else [int(s) for s in sec]
    return {"op": "split", "x": c.t(x), "sizes": sizes, "axis": dim}


def tr_chunk(c: Call, x: Any, args: tuple, kw: dict) -> dict:
    kw = dict(kw)
    chunks = args[0]
    dim = args[1] if len(args) > 1 else kw.pop("dim", 0)
    no_kwargs(kw)
    if x.ndim == 0:
        raise Skip("split of a 0-d tensor")
    dim = int(dim) % x.ndim
    n = x.shape[dim]
    size = -(-n // chunks) if n else 1
    return {"op": "split", "x": c.t(x), "sizes": split_sizes(n, size) if n else [0], "axis": dim}


def tr_narrow(c: Call, x: Any, args: tuple, kw: dict) -> dict:
    import torch

    no_kwargs(kw)
    dim, start, length = args
    if isinstance(start, torch.Tensor):
        start = int(start)
    dim = int(dim) % x.ndim
    start = int(start) % x.shape[dim] if start < 0 else int(start)
    return {"op": "slice", "x": c.t(x), "axis": dim, "start": start, "stop": start + int(length)}


def tr_getitem(c: Call, x: Any, args: tuple, kw: dict) -> dict:
    no_kwargs(kw)
    key = args[0]
    items = key if isinstance(key, tuple) else (key,)
    if isinstance(key, list):
        raise Skip("advanced indexing (lists or tensors)")
    out: list[Any] = []
    for k in items:
        if k is None:
            out.append(None)
        elif k is Ellipsis:
            out.append("...")
        elif isinstance(k, bool):
            raise Skip("bool index")
        elif isinstance(k, int):
            out.append(k)
        elif isinstance(k, slice):
            if k.step not in (None, 1):
                raise Skip("slice with a step")
            out.append({"slice": [k.start, k.stop]})
        else:
            raise Skip("advanced indexing (lists or tensors)")
    return {"op": "getitem", "x": c.t(x), "key": out}


def tr_sdpa(c: Call, q: Any, args: tuple, kw: dict) -> dict:
    kw = dict(kw)
    k, v = args[0], args[1]
    if len(args) > 2 or kw.get("attn_mask") is not None:
        raise Skip("attention mask")
    if kw.get("dropout_p", 0.0) != 0.0:
        raise Skip("dropout")
    if kw.get("scale") is not None:
        raise Skip("explicit scale")
    if kw.get("enable_gqa") and q.ndim >= 3 and q.shape[-3] != k.shape[-3]:
        raise Skip("grouped-query attention")
    causal = bool(kw.get("is_causal", False))
    for name in ("attn_mask", "dropout_p", "scale", "enable_gqa", "is_causal"):
        kw.pop(name, None)
    no_kwargs(kw)
    return {"op": "sdpa", "q": c.t(q), "k": c.t(k), "v": c.t(v), "causal": causal}


# Entries also replayed with int32 samples (forward only): integer arithmetic, true and floor
# division, remainder, comparisons and layout ops.
INT_OPS = {"add", "sub", "rsub", "mul", "div", "true_divide", "floor_divide", "remainder", "__radd__",
           "__rsub__", "__rmul__", "__rdiv__", "__rmod__", "lt", "le", "gt", "ge", "eq", "ne", "neg",
           "where", "reshape", "view", "transpose", "permute", "t", "mT", "cat", "split", "chunk", "narrow",
           "__getitem__", "square", "squeeze", "unsqueeze", "flatten", "select"}

def power(p: int | float) -> Callable:
    """An entry that is ``x ** p`` in rlx (square). Not rsqrt: PyTorch's pow and rsqrt give NaN
    for ``(-inf) ** -0.5`` where rlx's ``**`` gives 0, as numpy and C's ``pow`` (IEEE 754)."""

    def tr(c: Call, x: Any, args: tuple, kw: dict) -> dict:
        no_kwargs(kw)
        if args:
            raise Skip("extra positional arguments")
        return {"op": "pow", "x": c.t(x), "p": p}

    return tr


def tr_reciprocal(c: Call, x: Any, args: tuple, kw: dict) -> dict:
    no_kwargs(kw)
    return {"op": "div", "a": 1.0, "b": c.t(x)}


def reshaped(shape_of: Callable) -> Callable:
    """An entry that is a reshape to the shape of PyTorch's result (squeeze, unsqueeze, flatten)."""

    def tr(c: Call, x: Any, args: tuple, kw: dict) -> dict:
        import torch

        with torch.no_grad():
            shape = list(shape_of(x, *args, **kw).shape)
        return {"op": "reshape", "x": c.t(x), "shape": shape}

    return tr


def tr_select(c: Call, x: Any, args: tuple, kw: dict) -> dict:
    no_kwargs(kw)
    dim, index = int(args[0]) % x.ndim, int(args[1])
    return {"op": "getitem", "x": c.t(x), "key": [{"slice": [None, None]}] * dim + [index]}


TRANSLATE: dict[tuple[str, str], Callable] = {
    ("add", ""): add_sub("add"),
    ("sub", ""): add_sub("sub"),
    ("rsub", ""): add_sub("rsub"),
    ("mul", ""): binary("mul"),
    ("div", "no_rounding_mode"): div(None),
    ("div", "floor_rounding"): div("floor"),
    ("div", "trunc_rounding"): div("trunc"),
    ("true_divide", ""): binary("div"),
    ("floor_divide", ""): binary("floordiv"),
    ("remainder", ""): binary("mod"),
    ("__radd__", ""): binary("add", reflected=True),
    ("__rsub__", ""): binary("sub", reflected=True),
    ("__rmul__", ""): binary("mul", reflected=True),
    ("__rdiv__", ""): binary("div", reflected=True),
    ("__rmod__", ""): binary("mod", reflected=True),
    ("__rmatmul__", ""): tr_rmatmul,
    ("lt", ""): binary("lt"),
    ("le", ""): binary("le"),
    ("gt", ""): binary("gt"),
    ("ge", ""): binary("ge"),
    ("eq", ""): binary("eq"),
    ("ne", ""): binary("ne"),
    ("neg", ""): unary("neg"),
    ("nn.functional.relu", ""): unary("relu"),
    ("tanh", ""): unary("tanh"),
    ("sigmoid", ""): unary("sigmoid"),
    ("exp", ""): unary("exp"),
    ("log", ""): unary("log"),
    ("sqrt", ""): unary("sqrt"),
    ("pow", ""): tr_pow,
    ("nn.functional.gelu", ""): tr_gelu,
    ("matmul", ""): tr_matmul,
    ("mm", ""): tr_matmul,
    ("bmm", ""): tr_matmul,
    ("nn.functional.linear", ""): tr_linear,
    ("sum", ""): reduction("sum"),
    ("mean", ""): reduction("mean"),
    ("amax", ""): reduction("max"),
    ("max", "reduction_no_dim"): tr_max_all,
    ("reshape", ""): tr_reshape,
    ("view", ""): tr_reshape,
    ("transpose", ""): tr_transpose,
    ("permute", ""): tr_permute,
    ("t", ""): tr_t,
    ("mT", ""): tr_mT,
    ("softmax", ""): softmax_like("softmax"),
    ("log_softmax", ""): softmax_like("log_softmax"),
    ("nn.functional.cross_entropy", ""): tr_cross_entropy,
    ("nn.functional.mse_loss", ""): tr_mse,
    ("where", ""): tr_where,
    ("nn.functional.embedding", ""): tr_embedding_swapped,
    ("nn.functional.layer_norm", ""): tr_layer_norm,
    ("cat", ""): tr_cat,
    ("split", ""): tr_split,
    ("split", "list_args"): tr_split,
    ("chunk", ""): tr_chunk,
    ("narrow", ""): tr_narrow,
    ("__getitem__", ""): tr_getitem,
    ("nn.functional.scaled_dot_product_attention", ""): tr_sdpa,
    ("square", ""): power(2),
    ("reciprocal", ""): tr_reciprocal,
    ("squeeze", ""): reshaped(lambda x, *a, **k: x.squeeze(*a, **k)),
    ("unsqueeze", ""): reshaped(lambda x, *a, **k: x.unsqueeze(*a, **k)),
    ("flatten", ""): reshaped(lambda x, *a, **k: x.flatten(*a, **k)),
    ("select", ""): tr_select,
}


def to_numpy(x: Any, kind: str) -> np.ndarray:
    a = x.detach().cpu().numpy()
    if kind == "int":
        return a.astype(np.int32)
    return a.astype(np.float32)


def record(out_dir: str, seed: int = 0) -> dict:
    import torch
    from torch.testing._internal.common_methods_invocations import op_db

    torch.manual_seed(seed)
    ops = {(o.name, o.variant_test_name): o for o in op_db}
    os.makedirs(out_dir, exist_ok=True)
    totals: collections.Counter = collections.Counter()
    reasons: collections.Counter = collections.Counter()
    per_op: dict[str, collections.Counter] = {}
    jobs = [(nv, tr, torch.float32) for nv, tr in TRANSLATE.items()]
    jobs += [(nv, tr, torch.int32) for nv, tr in TRANSLATE.items() if nv[0] in INT_OPS]
    for (name, variant), tr, dtype in jobs:
        info = ops.get((name, variant))
        if info is None:
            print(f"  {name}.{variant}: not in this PyTorch's op_db", file=sys.stderr)
            continue
        if dtype not in info.supported_dtypes("cpu"):
            continue
        key = name + (f".{variant}" if variant else "") + (".int32" if dtype == torch.int32 else "")
        counts: collections.Counter = collections.Counter()
        arrays: dict[str, np.ndarray] = {}
        specs: list[dict] = []
        rng = np.random.default_rng(zlib.crc32(key.encode()))  # the cotangents, stable per op
        try:  # OpInfo's reference inputs: the samples plus extremal values (NaN, inf, edges)
            batch = list(info.reference_inputs("cpu", dtype, requires_grad=dtype.is_floating_point))
        except Exception:  # a PyTorch-side generator bug: fall back to the plain samples
            counts["reference inputs unavailable, plain samples used"] += 1
            batch = list(info.sample_inputs("cpu", dtype, requires_grad=dtype.is_floating_point))
        # Translate every sample first, then keep at most MAX_SAMPLES spread evenly over the
        # list (the extremal reference inputs come last).
        expressible = []
        for sample in batch:
            counts["samples"] += 1
            c = Call()
            try:
                spec = tr(c, sample.input, tuple(sample.args), dict(sample.kwargs))
                if sum(t.numel() for t, _ in c.tensors) > MAX_ELEMENTS:
                    raise Skip("over the fixture size budget")
            except Skip as e:
                counts[f"not expressible: {e}"] += 1
                continue
            expressible.append((sample, c, spec))
        if len(expressible) > MAX_SAMPLES:
            keep = sorted(set(np.linspace(0, len(expressible) - 1, MAX_SAMPLES).round().astype(int)))
            counts["skipped: over the per-op cap"] += len(expressible) - len(keep)
            expressible = [expressible[k] for k in keep]
        for sample, c, spec in expressible:
            try:
                out = info(c.swap(sample.input), *c.swap(tuple(sample.args)), **c.swap(dict(sample.kwargs)))
            except Exception as e:  # PyTorch itself refuses the sample
                counts[f"PyTorch raised {type(e).__name__}"] += 1
                continue
            outs = list(out) if isinstance(out, (tuple, list)) else [out]
            if any(not isinstance(o, torch.Tensor) for o in outs):
                counts["not expressible: non-tensor output"] += 1
                continue
            if any(o.dtype not in (torch.float32, torch.bool, torch.int32) for o in outs):
                counts["not expressible: output dtype"] += 1
                continue
            i = len(specs)
            for j, (t, kind) in enumerate(c.tensors):
                arrays[f"s{i}_in{j}"] = to_numpy(t, kind)
            for k, o in enumerate(outs):
                o = o.detach().numpy()
                arrays[f"s{i}_out{k}"] = o if o.dtype == np.int32 else o.astype(np.float32)
            spec["kinds"] = [kind for _, kind in c.tensors]
            spec["n_out"] = len(outs)
            # Gradients of sum(out * cotangent) w.r.t. the float inputs that require grad.
            wrt = [j for j, (t, kind) in enumerate(c.tensors) if kind == "float" and t.requires_grad]
            diff = [k for k, o in enumerate(outs) if o.requires_grad and o.dtype == torch.float32]
            spec["grads"] = []
            if info.supports_autograd and wrt and diff:
                cots = [torch.from_numpy(rng.standard_normal(tuple(outs[k].shape)).astype(np.float32)) for k in diff]
                try:
                    gs = torch.autograd.grad([outs[k] for k in diff], [c.tensors[j][0] for j in wrt], cots,
                                             allow_unused=True)
                except RuntimeError as e:
                    counts[f"no gradient: {str(e).splitlines()[0][:60]}"] += 1
                else:
                    for k, cot in zip(diff, cots):
                        arrays[f"s{i}_cot{k}"] = cot.numpy()
                    for j, g in zip(wrt, gs):
                        t = c.tensors[j][0]
                        arrays[f"s{i}_grad{j}"] = (torch.zeros_like(t) if g is None else g).detach().numpy().astype(np.float32)
                    spec["grads"] = wrt
                    spec["cots"] = diff
                    counts["with gradients"] += 1
            specs.append(spec)
            counts["recorded"] += 1
        if specs:
            arrays["meta"] = np.array(json.dumps({"op": key, "samples": specs}))
            np.savez_compressed(os.path.join(out_dir, key.replace("/", "_") + ".npz"), **arrays)
        per_op[key] = counts
        for k, v in counts.items():
            (reasons if k.startswith(("not expressible", "PyTorch raised", "no gradient", "skipped")) else totals)[k] += v
    lines = [f"PyTorch {torch.__version__}, {len(per_op)} (OpInfo entry, dtype) pairs: float32 CPU samples with "
             "gradients, int32 samples (forward) for integer arithmetic, comparisons and layout ops",
             f"samples: {totals['samples']}, recorded: {totals['recorded']}, with gradients: {totals['with gradients']}"]
    lines += [f"  {k}: {v}" for k, v in sorted(reasons.items(), key=lambda kv: -kv[1])]
    lines.append("per op (samples / recorded / with gradients):")
    lines += [f"  {k}: {c['samples']} / {c['recorded']} / {c['with gradients']}" for k, c in per_op.items()]
    with open(os.path.join(out_dir, "SUMMARY.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return {"totals": totals, "reasons": reasons}


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(here, "..", "tests", "goldens"))
    args = p.parse_args()
    try:
        import torch.testing._internal.common_methods_invocations  # noqa: F401
    except ImportError as e:
        sys.exit(f"record_torch_goldens: needs PyTorch and expecttest ({e}); pip install torch expecttest")
    record(os.path.normpath(args.out))


if __name__ == "__main__":
    main()
