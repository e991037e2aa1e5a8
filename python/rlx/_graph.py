"""The low-level API: build a graph by hand, differentiate it, compile and run it."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from . import _check, _rlx
from ._arrays import _NP, convert, parse_dtype
from ._tensor import Tensor, Trace
from .errors import DTypeError, InputError, RlxError


class Graph:
    """A graph built op by op: ``input``/``param`` give Tensors, rlx ops on them add nodes,
    ``output`` marks results, ``compile(device)`` gives an ``Executable``.

    Example:
        >>> g = rlx.Graph()
        >>> x, w = g.input("x", (4, 3)), g.param("w", (3, 2))
        >>> g.output(rlx.relu(x @ w))
        >>> exe = g.compile("cpu")
        >>> exe.set_param("w", np.ones((3, 2), np.float32))
        >>> (y,) = exe.run(x=np.ones((4, 3), np.float32))
    """

    def __init__(self, _native: Any | None = None) -> None:
        self._trace = Trace(_native)

    def input(self, name: str, shape: Sequence[int], dtype: str = "float32") -> Tensor:
        """A named runtime input of ``shape`` and ``dtype``; returns its Tensor.

        Example:
            >>> x = g.input("x", (4, 3))
        """
        return Tensor(self._trace, self._trace.graph.input(*self._leaf("input", name, shape, dtype)))

    def param(self, name: str, shape: Sequence[int], dtype: str = "float32") -> Tensor:
        """A named parameter (weights set with ``Executable.set_param``); returns its Tensor.

        Example:
            >>> w = g.param("w", (3, 2))
        """
        return Tensor(self._trace, self._trace.graph.param(*self._leaf("param", name, shape, dtype)))

    @staticmethod
    def _leaf(kind: str, name: Any, shape: Any, dtype: Any) -> tuple[str, list[int], str]:
        return _check.name(kind, name), list(_check.shape(kind, shape)), parse_dtype(kind, dtype)

    def constant(self, value: Any, dtype: str | None = None) -> Tensor:
        """A constant (numpy array, nested list or Python number) in the graph: float values
        become float32 and integers int32 (int64 where a value needs it) unless ``dtype``
        (``"float32"``, ``"float64"``, ``"int32"``, ``"int64"``) says otherwise. An integer
        ``dtype`` takes only values it holds exactly: a fraction, NaN, inf or a value out of its
        range is a DTypeError (round first); ragged nested lists are a ShapeError.

        Example:
            >>> c = g.constant(np.eye(3, dtype=np.float32))
            >>> d = g.constant(np.array([0.1, 0.2]), dtype="float64")   # kept exact
        """
        if dtype is not None and dtype not in ("float32", "float64", "int32", "int64"):
            raise DTypeError(f"[constant] dtype must be float32, float64, int32 or int64, got {dtype!r}")
        return self._trace.constant(value, dtype=dtype)

    def output(self, *tensors: Tensor) -> None:
        """

        Example:
            >>> g.output(loss, logits)
        """
        if not tensors:
            raise RlxError("output() needs at least one tensor")
        for t in tensors:
            if not isinstance(t, Tensor) or t._trace is not self._trace:
                raise RlxError("outputs must be tensors of this graph")
        self._trace.graph.set_outputs([t._id for t in tensors])

    @property
    def outputs(self) -> list[Tensor]:
        """

        Example:
            >>> [t.shape for t in g.outputs()]
        """
        return [Tensor(self._trace, i) for i in self._trace.graph.outputs()]

    def __len__(self) -> int:
        return len(self._trace.graph)

    def compile(self, device: str = "cpu") -> "Executable":
        """

        Example:
            >>> exe = g.compile("cpu")
        """
        if not self._trace.graph.outputs():
            raise RlxError("the graph has no outputs; call graph.output(...) first")
        device = _rlx.check_device(_check.device(device))
        params = self._trace.graph.params()
        store = _rlx.Store(device, [tuple(p) for p in params])
        declared = self._trace.graph.inputs()
        return Executable(_rlx.Executable(self._trace.graph, store, device, None), store, params, declared)


def grad(graph: Graph, wrt: Sequence[str | Tensor]) -> Graph:
    """The backward graph of ``graph``'s single scalar output: outputs ``[loss, *grads]``.

    Example:
        >>> g = rlx.Graph()
        >>> x, w = g.input("x", (4, 3)), g.param("w", (3,))
        >>> g.output(((x * w).sum(axis=1) ** 2).mean())
        >>> bw = rlx.grad(g, ["w"])            # outputs [loss, d loss / d w]
    """
    if not isinstance(graph, Graph):
        raise RlxError(f"grad needs an rlx.Graph, got {type(graph).__name__}")
    if isinstance(wrt, (str, Tensor)) or not isinstance(wrt, Sequence):
        raise InputError(f"[grad] wrt must be a list of names or tensors, got {type(wrt).__name__}")
    outs = graph._trace.graph.outputs()
    if len(outs) != 1:
        raise RlxError(f"grad needs a graph with exactly one (scalar loss) output, got {len(outs)}")
    ids = []
    for w in wrt:
        if isinstance(w, Tensor):
            if w._trace is not graph._trace:
                raise RlxError("[grad] a wrt tensor belongs to another graph")
            ids.append(w._id)
        else:
            node = graph._trace.graph.find(w) if isinstance(w, str) else None
            if node is None:
                raise InputError(f"[{w}] no input or param of that name")
            ids.append(node)
    return Graph(graph._trace.graph.grad(outs[0], ids))


class Executable:
    """A hand-built graph compiled for a device. Params start at zero; set them with ``set_param``.

    Every input declared with ``graph.input`` is accepted by ``run`` (its shape and dtype checked),
    also one the outputs do not read, which is then ignored: the rule ``rlx.compile`` follows.

    Example:
        >>> exe = g.compile("cpu")
        >>> exe.set_param("w", w0)
        >>> loss, dw = exe.run(x=x)
    """

    def __init__(
        self,
        exe: Any,
        store: Any,
        params: list[tuple[str, list[int], str]],
        declared: list[tuple[str, list[int], str]] | None = None,
    ) -> None:
        self._exe, self._store = exe, store
        self._params = {n: (s, d) for n, s, d in params}
        self._inputs = {n: (s, d) for n, s, d, _ in exe.input_slots()}  # the ones the outputs read
        self._declared = {n: (s, d) for n, s, d in declared} if declared is not None else dict(self._inputs)
        self._bound: set[str] = set()

    def set_param(self, name: str, array: Any) -> None:
        """Writes the values of parameter ``name``.

        Example:
            >>> exe.set_param("w", np.ones((3, 2), np.float32))
        """
        if not isinstance(name, str) or name not in self._params:
            raise InputError(f"[{name}] unknown param; expected {sorted(self._params)}")
        shape, dtype = self._params[name]
        self._store.write(name, convert(name, shape, dtype, array))

    def bind(self, name: str, array: Any) -> None:
        """Places a resident input once; later runs omit it.

        Example:
            >>> exe.bind("table", table)
        """
        if not isinstance(name, str) or name not in self._declared:
            raise InputError(f"[{name}] unknown input; expected {sorted(self._declared)}")
        if name not in self._inputs:
            raise InputError(f"[{name}] this input is not used by the graph's outputs")
        shape, dtype = self._inputs[name]
        self._exe.bind(name, convert(name, shape, dtype, array))
        self._bound.add(name)

    def run(self, **arrays: Any) -> list[np.ndarray]:
        """Runs once on the given inputs; returns every output as a fresh array.

        Example:
            >>> outs = exe.run(x=np.ones((4, 3), np.float32))
        """
        unknown = sorted(set(arrays) - set(self._declared))
        if unknown:
            raise InputError(f"[{unknown[0]}] unknown input; expected {sorted(self._declared)}")
        missing = [n for n in self._inputs if n not in arrays and n not in self._bound]
        if missing:
            raise InputError(f"[{missing[0]}] missing input")
        # Every array is checked (as the slot's dtype where the program reads it: a GPU program
        # reads int64 inputs as int32, range-checked); only those the outputs read are fed.
        checked = {n: convert(n, *self._inputs.get(n, self._declared[n]), v) for n, v in arrays.items()}
        feeds = {n: v for n, v in checked.items() if n in self._inputs}
        outs = self._exe.outputs()
        raw = self._exe.run(feeds, None, list(range(len(outs))))
        return [np.frombuffer(b, dtype=_NP[d]).reshape(s) for b, (s, d) in zip(raw, outs)]

    def memory(self) -> dict[str, int]:
        """Planned sizes in bytes (``arena_bytes``, ``naive_bytes``, ...).

        Example:
            >>> exe.memory()["arena_bytes"]
        """
        return dict(self._exe.memory())
