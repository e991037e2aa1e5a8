"""Modules and parameters. Weights live in host arrays until a model is compiled; from then on in
the device's weight store, which every executable compiled from the model shares."""

from __future__ import annotations

import math
from typing import Any, Iterator

import numpy as np

from . import _check, _rlx
from ._arrays import contiguous
from ._random import rng
from ._tensor import Tensor, _matmul_nt, concat, embedding, gelu, layer_norm, matmul, relu, softmax, where
from .errors import CheckpointError, DTypeError, RlxError, ShapeError

_DTYPES = {"float32": np.float32, "int32": np.int32}


class Parameter:
    """A trainable tensor. After compiling on a host-visible device, ``numpy()`` is a zero-copy
    view into the weight store: writing to it changes what the next step computes."""

    def __init__(self, data: Any) -> None:
        try:
            arr = np.asarray(data)
        except (TypeError, ValueError) as e:
            raise DTypeError(f"[Parameter] cannot make an array of {type(data).__name__}: {e}") from None
        if arr.dtype.kind != "f":
            raise DTypeError(f"[Parameter] parameters are float32; got an array of dtype {arr.dtype}")
        self._host: np.ndarray | None = contiguous(arr, np.float32).copy()
        self._store: Any = None
        self._name: str | None = None
        self._view: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.numpy().shape) if self._host is None else self._host.shape

    @property
    def dtype(self) -> str:
        return "float32"

    def numpy(self) -> np.ndarray:
        """The values: a zero-copy view of the weight store where the host can see it, else a copy."""
        if self._store is None:
            assert self._host is not None
            return self._host
        if self._view is not None:
            return self._view
        shape = self._store_shape
        raw = self._store.view(self._name)
        if raw is None:
            return np.frombuffer(self._store.read(self._name), dtype=np.float32).reshape(shape).copy()
        self._view = np.frombuffer(raw, dtype=np.float32).reshape(shape)
        return self._view

    def _assign(self, values: np.ndarray) -> None:
        """Overwrites the values in place (shape already checked)."""
        values = contiguous(values, np.float32)
        if self._store is None:
            assert self._host is not None
            self._host[...] = values
        else:
            self._store.write(self._name, values.reshape(-1))

    def _bind(self, store: Any, name: str) -> None:
        self._store_shape = self.shape
        self._store, self._name, self._view, self._host = store, name, None, None

    def __repr__(self) -> str:
        return f"Parameter(shape={self.shape}, dtype=float32)"

    # Parameters take part in traced arithmetic like tensors.
    def _t(self) -> Tensor:
        from ._tensor import _as_tensor, _trace_of

        return _as_tensor(self, _trace_of())

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._t(), name)


# The Python operator dunders (arithmetic and reflected, unary, comparisons, indexing): those
# Tensor defines, Parameter forwards. Others (hashing, truth value, numpy hooks, pickling) are
# not operators and keep Parameter's own behaviour: identity hashing (usable as a dict key or set
# member), truthiness as any object, ``np.asarray(parameter)``.
_BINARY_OPS = ["add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "divmod", "pow", "lshift", "rshift",
               "and", "xor", "or"]
OPERATOR_DUNDERS = frozenset(
    [f"__{op}__" for op in _BINARY_OPS] + [f"__r{op}__" for op in _BINARY_OPS]
    + [f"__{op}__" for op in ["neg", "pos", "abs", "invert", "lt", "le", "eq", "ne", "gt", "ge", "getitem"]]
)


def _forward_ops() -> None:
    """Every operator of ``Tensor`` (``==``/``!=`` included) behaves the same on a Parameter
    inside a traced function. ``==`` and ``!=`` outside a trace compare identity (Python's
    default), so Parameters in lists and dicts work as before."""
    from ._tensor import _current

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


_forward_ops()


class Module:
    """Base class of models: assign Parameters and sub-Modules as attributes, define ``__call__``."""

    def __setattr__(self, name: str, value: Any) -> None:
        if "_children" not in self.__dict__:
            object.__setattr__(self, "_children", {})
            object.__setattr__(self, "_stores", {})
        if isinstance(value, (Parameter, Module)):
            self._children[name] = value
        else:
            self._children.pop(name, None)
        object.__setattr__(self, name, value)

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Parameter]]:
        seen: set[int] = set()
        for name, p in self._walk(prefix):
            if id(p) not in seen:
                seen.add(id(p))
                yield name, p

    def _walk(self, prefix: str) -> Iterator[tuple[str, Parameter]]:
        for name, child in self.__dict__.get("_children", {}).items():
            if isinstance(child, Parameter):
                yield prefix + name, child
            else:
                yield from child._walk(prefix + name + ".")

    def parameters(self) -> dict[str, Parameter]:
        """Every parameter by dotted name (``"fc1.weight"``), in assignment order."""
        return dict(self.named_parameters())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = getattr(self, "forward", None)
        if forward is None:
            raise RlxError(f"{type(self).__name__} defines neither __call__ nor forward")
        return forward(*args, **kwargs)

    def _store_for(self, device: str) -> Any:
        """The weight store of this model on ``device``, created (with the current values) once."""
        if "_stores" not in self.__dict__:
            object.__setattr__(self, "_children", {})
            object.__setattr__(self, "_stores", {})
        params = self.parameters()
        layout = [(n, list(p.shape), "float32") for n, p in params.items()]
        store = self._stores.get(device)
        if store is not None and store.entries() == [(n, s, d) for n, s, d in layout] and all(
            p._store is store and p._name == n for n, p in params.items()
        ):
            return store
        store = _rlx.Store(device, layout)
        for n, p in params.items():
            store.write(n, contiguous(p.numpy(), np.float32).reshape(-1))
        for n, p in params.items():
            p._bind(store, n)
        self._stores[device] = store
        return store

    def _snapshot(self) -> dict[str, np.ndarray]:
        """Copies of every parameter, each weight store read under its lock: the values of one
        step, never half of one update and half of the next."""
        params = self.parameters()
        stores = {id(p._store): p._store for p in params.values() if p._store is not None}
        read = {sid: dict(store.read_all()) for sid, store in stores.items()}
        out = {}
        for n, p in params.items():
            if p._store is None:
                assert p._host is not None
                out[n] = p._host.copy()
            else:
                raw = read[id(p._store)][p._name]
                out[n] = np.frombuffer(raw, dtype=np.float32).reshape(p._store_shape)
        return out

    def save(self, path: str) -> None:
        """Writes every parameter to a safetensors file, atomically (a temporary file renamed
        over ``path``; through a symbolic link, its target is replaced). The values saved are one
        consistent snapshot even while another thread trains the model.

        Example::

            model.save("mlp.safetensors")
        """
        path = _check.path("save", path)
        tensors = [(n, "float32", list(v.shape), v.reshape(-1)) for n, v in self._snapshot().items()]
        _rlx.save_checkpoint(str(path), tensors)

    def load(self, path: str) -> None:
        """Loads a safetensors checkpoint. Every name, shape and dtype is checked against the
        model (from the file's header, before its data is read) and a mismatch raises
        ``CheckpointError`` naming the tensor, changing nothing. The new values replace the old
        ones as one change: a function running in another thread sees all old or all new.

        Example::

            model.load("mlp.safetensors")
        """
        path = _check.path("load", path)
        params = self.parameters()
        header = {name: (dtype, tuple(shape)) for name, dtype, shape in _rlx.checkpoint_header(str(path))}
        missing = sorted(set(params) - set(header))
        unexpected = sorted(set(header) - set(params))
        if missing or unexpected:
            raise CheckpointError(
                f"{path}: checkpoint does not match the model: missing {missing}, unexpected {unexpected}"
            )
        for name, p in params.items():
            dtype, shape = header[name]
            if dtype != "F32" or shape != p.shape:
                shown = "float32" if dtype == "F32" else dtype
                raise CheckpointError(
                    f"{path}: '{name}' is {shown} {shape} in the checkpoint but float32 {p.shape} in the model"
                )
        expected = sum(4 * int(np.prod(p.shape)) for p in params.values())
        tensors = _rlx.load_checkpoint(str(path), expected)
        found = {name: (dtype, tuple(shape), data) for name, dtype, shape, data in tensors}
        if set(found) != set(params) or any(found[n][:2] != ("float32", p.shape) for n, p in params.items()):
            raise CheckpointError(f"{path}: the file changed while it was loaded")
        by_store: dict[int, tuple[Any, list[tuple[str, np.ndarray]]]] = {}
        for name, p in params.items():
            values = np.frombuffer(found[name][2], dtype=np.float32)
            if p._store is None:
                p._assign(values.reshape(p.shape))
            else:
                by_store.setdefault(id(p._store), (p._store, []))[1].append((p._name, values))
        for store, writes in by_store.values():
            store.write_many(writes)


class Linear(Module):
    """``y = x @ weight + bias`` with ``weight`` of shape (in_features, out_features).
    Initialised as PyTorch's default: U(-1/sqrt(in), 1/sqrt(in)) for weight and bias."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        in_features = _check.integer("Linear", "in_features", in_features, lo=1)
        out_features = _check.integer("Linear", "out_features", out_features, lo=1)
        _check.fits_in_memory("Linear", (in_features, out_features))
        bound = 1.0 / math.sqrt(in_features)
        self.in_features, self.out_features = in_features, out_features
        self.weight = Parameter(rng().uniform(-bound, bound, (in_features, out_features)))
        self.bias = Parameter(rng().uniform(-bound, bound, (out_features,))) if bias else None

    def __call__(self, x: Any) -> Tensor:
        shape = x.shape
        if len(shape) < 1 or shape[-1] != self.in_features:
            raise ShapeError(f"[Linear] expects inputs (..., {self.in_features}), got {tuple(shape)}")
        flat = x.reshape(-1, self.in_features) if len(shape) != 2 else x
        y = flat @ self.weight
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features) if len(shape) != 2 else y


class ReLU(Module):
    def __call__(self, x: Any) -> Tensor:
        return relu(x)


class Sequential(Module):
    """Applies its modules in order; they are named ``"0"``, ``"1"``, ..."""

    def __init__(self, *modules: Module) -> None:
        for i, m in enumerate(modules):
            if not isinstance(m, Module):
                raise RlxError(f"[Sequential] item {i} is a {type(m).__name__}, not an rlx.nn.Module")
            setattr(self, str(i), m)
        self._layers = list(modules)

    def __call__(self, x: Any) -> Any:
        for m in self._layers:
            x = m(x)
        return x

    def __getitem__(self, i: int) -> Module:
        return self._layers[i]

    def __len__(self) -> int:
        return len(self._layers)


class GELU(Module):
    """GELU activation; exact (erf) by default, ``approximate=True`` for the tanh form."""

    def __init__(self, approximate: bool | str = False) -> None:
        self.approximate = approximate

    def __call__(self, x: Any) -> Tensor:
        return gelu(x, self.approximate)


class Embedding(Module):
    """A lookup table of ``num`` vectors of size ``dim``; initialised N(0, 1) as PyTorch."""

    def __init__(self, num: int, dim: int) -> None:
        num = _check.integer("Embedding", "num", num, lo=1)
        dim = _check.integer("Embedding", "dim", dim, lo=1)
        _check.fits_in_memory("Embedding", (num, dim))
        self.num, self.dim = num, dim
        self.weight = Parameter(rng().standard_normal((num, dim)))

    def __call__(self, ids: Any) -> Tensor:
        return embedding(self.weight, ids)


class LayerNorm(Module):
    """Layer normalisation over the last axis with a learned scale (ones) and shift (zeros)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        dim = _check.integer("LayerNorm", "dim", dim, lo=1)
        eps = _check.number("LayerNorm", "eps", eps, lo=0.0)
        _check.fits_in_memory("LayerNorm", (dim,))
        self.dim, self.eps = dim, eps
        self.weight = Parameter(np.ones(dim, np.float32))
        self.bias = Parameter(np.zeros(dim, np.float32))

    def __call__(self, x: Any) -> Tensor:
        if x.shape[-1] != self.dim:
            raise ShapeError(f"[LayerNorm] expects inputs (..., {self.dim}), got {tuple(x.shape)}")
        return layer_norm(x, self.weight, self.bias, self.eps)


class MultiHeadAttention(Module):
    """Multi-head self-attention over (B, T, dim) inputs.

    ``qkv`` projects to queries, keys and values at once (weight (dim, 3*dim), q|k|v
    concatenated); ``proj`` maps the merged heads back. Initialised as PyTorch's
    ``nn.MultiheadAttention``: Xavier-uniform input projection, zero biases.
    ``decode`` runs one new token against a resident key/value cache.
    """

    def __init__(self, dim: int, num_heads: int, causal: bool = False) -> None:
        dim = _check.integer("MultiHeadAttention", "dim", dim, lo=1)
        num_heads = _check.integer("MultiHeadAttention", "num_heads", num_heads, lo=1)
        if dim % num_heads:
            raise ShapeError(f"[MultiHeadAttention] dim {dim} is not divisible by num_heads {num_heads}")
        self.dim, self.num_heads, self.head_dim, self.causal = dim, num_heads, dim // num_heads, causal
        self.qkv = Linear(dim, 3 * dim)
        bound = math.sqrt(6.0 / (dim + 3 * dim))
        self.qkv.weight = Parameter(rng().uniform(-bound, bound, (dim, 3 * dim)))
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
        q, k, v = self._heads(x)
        scores = _matmul_nt(q * (1.0 / math.sqrt(self.head_dim)), k)
        if self.causal:
            t = x.shape[1]
            scores = where(np.tril(np.ones((t, t), np.float32)), scores, float("-inf"))
        return self._merge(matmul(softmax(scores, axis=-1), v))

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
    """Pre-norm block: ``x + attn(ln1(x))``, then ``x + fc2(gelu(fc1(ln2(x))))``."""

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


__all__ = ["Module", "Parameter", "Linear", "ReLU", "GELU", "Sequential", "Embedding", "LayerNorm",
           "MultiHeadAttention", "TransformerBlock"]
