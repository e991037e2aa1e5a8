"""Compiling: tracing Python functions into graphs, and the callable step / function objects."""

from __future__ import annotations

import inspect
import json
import struct
import threading
from collections import deque
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from . import _check, _rlx
from ._arrays import _NP, convert, dtype_name, parse_dtype
from ._arrays import raw as bits
from ._dlpack import DeviceTensor
from ._tensor import Tensor, Trace
from ._vision import RNG_INPUT, new_rng_key
from .errors import DTypeError, InputError, RlxError, ShapeError, UnsupportedError
from .nn import _STRUCTURE, Module
from .optim import Optimizer

# Serialises building executables (rare: a first call with a new size). Module-level so that
# rlx's fork hooks (rlx/__init__.py) can hold it across a fork().
_BUILD_LOCK = threading.Lock()
#: The hidden scalar input that carries the fp16 loss scale into a train step.
LOSS_SCALE_INPUT = "rlx.loss_scale"
#: Inputs the caller never gives: the dropout seed and the loss scale, set by the step itself.
_HIDDEN = frozenset({RNG_INPUT, LOSS_SCALE_INPUT})

class InputSpec:
    """The shape and dtype of one named input of a compiled function. A dimension given as
    ``None`` accepts any size: one executable per distinct size is compiled on first use and
    cached, all sharing the model's weights (and the optimizer's state). ``dtype`` is one of
    ``"float32"``, ``"float16"``, ``"bfloat16"``, ``"float64"``, ``"int32"``, ``"int64"``,
    ``"bool"`` (or the numpy dtype; ``ml_dtypes.bfloat16`` for bfloat16).

    Example:
        >>> rlx.InputSpec((None, 64))          # any batch size
        InputSpec(shape=(None, 64), dtype='float32')
    """

    def __init__(self, shape: Sequence[int | None], dtype: Any = "float32") -> None:
        if isinstance(shape, (list, tuple)) and any(d is None for d in shape):
            fixed = _check.shape("InputSpec", [0 if d is None else d for d in shape])
            self.shape: tuple[Any, ...] = tuple(None if d is None else f for d, f in zip(shape, fixed))
        else:
            self.shape = _check.shape("InputSpec", shape)
        self.dtype = parse_dtype("InputSpec", dtype)

    @property
    def dynamic(self) -> bool:
        """Whether some dimension is ``None``."""
        return any(d is None for d in self.shape)

    def __repr__(self) -> str:
        return f"InputSpec(shape={self.shape}, dtype={self.dtype!r})"


def _device_specs(specs: dict[str, InputSpec], device: str) -> dict[str, InputSpec]:
    """The specs a device compiles. The CPU and CUDA trace int64 inputs as int64 (CUDA computes
    them in int32 inside the program and gives int64 results back, see ``rlx_ir::narrow``; its
    input slot is int32, into which fed arrays are range-checked). Metal has no int64 outputs
    yet, so there an int64 input is declared int32 (its results are int32)."""
    if device.split(":")[0] != "metal":
        return specs
    return {n: InputSpec(s.shape, "int32") if s.dtype == "int64" else s for n, s in specs.items()}


def _specs(inputs: Mapping[str, Any]) -> dict[str, InputSpec]:
    if not isinstance(inputs, Mapping):
        raise InputError(f"[inputs] must map input names to rlx.InputSpec, got {type(inputs).__name__}")
    out = {}
    for name, spec in dict(inputs).items():
        _check.name("inputs", name)
        if isinstance(spec, InputSpec):
            out[name] = spec
        elif isinstance(spec, tuple) and len(spec) == 2 and (
                isinstance(spec[1], str)
                or (not isinstance(spec[1], (int, np.integer, type(None))) and dtype_name(spec[1]) is not None)):
            out[name] = InputSpec(*spec)
        else:
            out[name] = InputSpec(spec)
    return out


def _check_compute_dtypes(where: str, model: Module, device: str = "cpu", precision: str = "fp32") -> None:
    """Refuses a model rlx cannot compute with: bfloat16 or float16 parameters in training (the
    optimizers update float32 and float64 weights; inference computes with low-precision weights
    in float32, rounding back as PyTorch's CPU kernels do), and float64 parameters off the CPU or
    under mixed precision. Storing, loading and saving every dtype works."""
    for name, p in model._tensors().items():
        if p.dtype == "float64" and where == "compile_train_step":
            if device.split(":")[0] != "cpu":
                raise DTypeError(
                    f"[{where}] parameter '{name}' is float64: float64 weights train on the cpu only "
                    f"(device {device!r} computes in float32 and low precision); convert the model with "
                    "model.to('float32') or train on device='cpu'")
            if precision != "fp32":
                raise DTypeError(
                    f"[{where}] parameter '{name}' is float64: precision={precision!r} (mixed precision) keeps "
                    "float32 master weights; convert the model with model.to('float32') for it, or train the "
                    "float64 model with precision='fp32'")
        if p.dtype in ("float16", "bfloat16") and where == "compile_train_step":
            raise DTypeError(
                f"[{where}] parameter '{name}' is {p.dtype}: training {p.dtype} weights is not supported yet; "
                f"train a float32 model (model.to('float32')) with precision='{'bf16' if p.dtype == 'bfloat16' else 'fp16'}' "
                "for low-precision compute with float32 master weights")


def _trace(fn: Callable[..., Any], model: Module, specs: dict[str, InputSpec], store: Any,
           training: bool, device: str) -> tuple[Trace, Any, dict[str, int]]:
    """Traces ``fn(model, **tensors)`` for ``device`` with the model in train or eval mode
    (restored after)."""
    t = Trace(device=device)
    nodes: dict[str, int] = {}
    tensors = model._tensors()
    for name, shape, dtype in store.entries():
        node = t.graph.param(name, shape, dtype)
        t.param_nodes[id(tensors[name])] = node
        nodes[name] = node
    inputs = {n: Tensor(t, t.graph.input(n, list(s.shape), s.dtype)) for n, s in specs.items()}
    modes = [(m, m.__dict__.get("training")) for _, m in model.modules()]
    _check_signature(fn, model, inputs)
    model.train(training)
    try:
        with t:
            out = fn(model, **inputs)
    finally:
        for m, mode in modes:
            if mode is None:
                m.__dict__.pop("training", None)
            else:
                object.__setattr__(m, "training", mode)
    return t, out, nodes


def _check_signature(fn: Callable[..., Any], model: Module, inputs: dict[str, Any]) -> None:
    """An ``InputError`` when ``fn`` cannot be called as ``fn(model, **inputs)`` (Python's own
    ``TypeError`` names neither rlx's calling convention nor the input names)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C callable: let the call speak for itself
        return
    try:
        sig.bind(model, **inputs)
    except TypeError as e:
        raise InputError(
            f"[compile] the function is called as fn(model, **inputs) with inputs {sorted(inputs)}, but its "
            f"signature is {getattr(fn, '__name__', 'fn')}{sig}: {e}. Name its parameters after the input "
            "specs, after a first parameter for the model") from None


#: ``compile_train_step(precision=...)`` / ``compile(precision=...)`` values.
PRECISIONS = ("fp32", "bf16", "fp16")
#: The dtype matmuls (and so convolutions) compute in under each mixed precision.
_LOW = {"bf16": "bfloat16", "fp16": "float16"}


def _check_precision(where: str, precision: Any, device: str) -> str:
    """Checks ``precision=``; mixed precision runs on the CPU and CUDA so far (checked before
    the device is looked up, so the error is the same with or without the GPU)."""
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise InputError(f"[{where}] precision must be one of {list(PRECISIONS)}, got {precision!r}")
    # Only known GPU kinds here: a malformed name is the device check's to report.
    if precision != "fp32" and device.split(":")[0] == "metal":
        raise UnsupportedError(
            f"[{where}] precision={precision!r} (mixed precision) runs on the CPU and CUDA only so far; "
            f"device {device!r} computes in float32: use precision='fp32' there")
    return precision


def _keywords_only(what: str, args: tuple[Any, ...], specs: Mapping[str, Any]) -> None:
    if args:
        names = list(specs)
        example = ", ".join(f"{n}=..." for n in names) or "..."
        raise InputError(f"[{what}] inputs are passed by name: {what}({example}) (got {len(args)} positional "
                         f"argument(s); the inputs are {names})")


def _check_feeds(names: Sequence[str], arrays: Mapping[str, Any], specs: dict[str, InputSpec], bound: set[str]) -> dict[str, np.ndarray]:
    if not arrays:
        return {}  # the native side consumes a prefetched batch, or reports what is missing
    unknown = sorted(set(arrays) - set(specs))
    if unknown:
        raise InputError(f"[{unknown[0]}] unknown input; expected {sorted(specs)}")
    missing = [n for n in names if n not in arrays and n not in bound]
    if missing:
        raise InputError(f"[{missing[0]}] missing input; expected {sorted(specs)}")
    # Every declared input is checked, even one the traced function does not read.
    converted = {n: convert(n, specs[n].shape, specs[n].dtype, v) for n, v in arrays.items()}
    return {n: v for n, v in converted.items() if n in names}


class _Variant:
    """One executable of a compiled function, for one set of concrete input shapes."""

    def __init__(self, exe: Any, specs: dict[str, InputSpec]) -> None:
        self.exe = exe
        # Arrays are converted to the dtype of the slot the program reads (on a GPU an int64
        # input's slot is int32: fed int64 arrays are range-checked into it).
        slots = {n: d for n, _, d, _ in exe.input_slots()}
        self.specs = {n: InputSpec(s.shape, slots.get(n, s.dtype)) for n, s in specs.items()}
        self.names = list(slots)
        self.outs = exe.outputs()
        self.skipped = 0.0
        # Train steps: the optimizer state store, the trained parameters' names, the aux output
        # names and the outputs each call reads back. Functions: whether a tuple is returned.
        self.state: Any = None
        self.trainable: list[str] = []
        self.aux: list[str] = []
        self.read: list[int] = []
        self.tuple = False
        # Data-parallel train steps: a float32 view of the arena's gradient region.
        self.region: np.ndarray | None = None


class _Compiled:
    """What train steps and inference functions share: the model-structure check, executables
    per input size (for ``None`` dimensions), prefetching and the program listing."""

    _model: Module
    _specs: dict[str, InputSpec]
    _variants: dict[Any, _Variant]
    _last: _Variant | None
    _queue: deque[_Variant]

    def _init_compiled(self, model: Module, specs: dict[str, InputSpec]) -> None:
        self._model, self._specs = model, specs
        self._variants, self._last, self._queue = {}, None, deque()
        self._dynamic = any(s.dynamic for s in specs.values())
        model._store_for(self._device)  # the signature names the store this compile uses
        self._signature = model._signature()
        self._generation = _STRUCTURE[0]
        # Dropout: a key drawn from rlx's generator at the first build that needs one, and the
        # number of calls so far; each call's masks come from (key, calls).
        self._rng_key: int | None = None
        self._rng_calls = 0

    def _with_rng(self, var: _Variant) -> _Variant:
        """Gives a fresh executable whose trace drew dropout masks its seed input."""
        if RNG_INPUT in var.names:
            if self._rng_key is None:
                self._rng_key = new_rng_key()
            self._bind_rng(var)
        return var

    def _bind_rng(self, var: _Variant) -> None:
        """Sets the seed input for the next call: (key, calls so far)."""
        if RNG_INPUT in var.names:
            var.exe.bind(RNG_INPUT, np.array([self._rng_key, self._rng_calls % 2**31], np.int32))

    def _check_model(self) -> None:
        """Raises when a parameter or sub-module was added, replaced or removed since compile."""
        if _STRUCTURE[0] != self._generation:
            now = self._model._signature()
            if now != self._signature:
                if [s[:4] for s in now] == [s[:4] for s in self._signature]:
                    raise RlxError(
                        "model changed since compile: its weights moved to the store of a model compiled "
                        "since (a sub-module of it, or a model sharing its layers); compile again, or compile "
                        "the sub-module's function as a function of the whole model")
                raise RlxError("model changed since compile; compile again")
            self._generation = _STRUCTURE[0]

    def _build(self, specs: dict[str, InputSpec]) -> _Variant:
        raise NotImplementedError

    def _variant(self, arrays: Mapping[str, Any]) -> _Variant:
        if not self._dynamic:
            return self._variants[None]
        concrete = {}
        for name, spec in self._specs.items():
            if not spec.dynamic:
                concrete[name] = spec
                continue
            if name not in arrays:
                raise InputError(f"[{name}] missing input; expected {sorted(self._specs)}")
            shape = tuple(np.shape(arrays[name]))
            if len(shape) != len(spec.shape) or any(d is not None and d != g for d, g in zip(spec.shape, shape)):
                raise ShapeError(f"[{name}] expected shape {spec.shape} (None: any size), got {shape}")
            concrete[name] = InputSpec(shape, spec.dtype)
        key = tuple((n, concrete[n].shape) for n in sorted(concrete) if self._specs[n].dynamic)
        var = self._variants.get(key)
        if var is None:
            with _BUILD_LOCK:  # one compile per new size, even from two threads
                var = self._variants.get(key)
                if var is None:
                    var = self._variants[key] = self._build(concrete)
        return var

    def _pick(self, arrays: Mapping[str, Any]) -> _Variant:
        """The executable for this call: by the arrays' sizes, or the next prefetched batch's."""
        self._check_model()
        if not arrays and self._dynamic:
            if not self._queue:
                raise InputError("missing inputs: none given and no batch prefetched")
            return self._queue.popleft()
        var = self._variant(arrays)
        if not arrays and self._queue:
            self._queue.popleft()
        return var

    def prefetch(self, **arrays: Any) -> None:
        """Takes a snapshot of the batch (a copy of each array, made now) for a later call made
        without arrays. On the CPU the snapshot is written straight into a free input buffer; on
        a GPU it is copied to the device on the copy engine, and this returns without waiting
        for that copy. Calls made without arrays consume prefetched batches in order, each waiting only for
        its own copy. Two batches may wait; a third prefetch raises ``RlxError``. Because the
        batch is copied at the call, the arrays may be changed or reused right away: the step
        sees the values they had when ``prefetch`` was called.

        Example::

            step.prefetch(x=xs[0], y=ys[0])
            for i in range(1, n):
                step.prefetch(x=xs[i], y=ys[i])   # on a GPU, copied while the step below runs
                loss = step()                      # consumes batch i - 1
            loss = step()
        """
        self._check_model()
        unknown = sorted(set(arrays) - set(self._specs))
        if unknown:
            raise InputError(f"[{unknown[0]}] unknown input; expected {sorted(self._specs)}")
        var = self._variant(arrays)
        if self._dynamic and len(self._queue) >= 2:
            raise RlxError("[prefetch] 2 prefetched batches are already waiting; run a step first")
        feeds = {n: convert(n, var.specs[n].shape, var.specs[n].dtype, v) for n, v in arrays.items()}
        var.exe.prefetch({n: v for n, v in feeds.items() if n in var.names})
        self._queue.append(var)

    @property
    def prefetched(self) -> int:
        """Batches waiting to be consumed."""
        return sum(v.exe.prefetched() for v in self._variants.values())

    def graph(self) -> str:
        """A readable listing of the lowered program: each instruction with its operands'
        buffer, byte offset, shape and dtype, then the outputs and the memory summary. With
        ``None`` dimensions, the executable of the last call.

        Example:
            >>> print(step.graph())
        """
        var = self._last or next(iter(self._variants.values()), None)
        if var is None:
            raise RlxError("nothing compiled yet: with None dimensions, each size compiles at its first call")
        return str(var.exe.listing())

    def memory(self) -> dict[str, int]:
        """Planned bytes: ``arena_bytes`` vs ``naive_bytes`` (no reuse), ``param_bytes``, ...

        Example:
            >>> step.memory()["arena_bytes"] <= step.memory()["naive_bytes"]
            True
        """
        var = self._last or next(iter(self._variants.values()), None)
        if var is None:
            raise RlxError("nothing compiled yet: with None dimensions, each size compiles at its first call")
        return dict(var.exe.memory())


class TrainStep(_Compiled):
    """A compiled training step: ``step(**arrays) -> float`` runs forward, backward and the
    optimizer update as one native call over the arena; ``step()`` without arrays consumes
    the next prefetched batch. When ``loss_fn`` returns ``(loss, aux)``, calls return
    ``(loss, {name: array})``.

    Example:
        >>> step = rlx.compile_train_step(lambda m, x, y: rlx.cross_entropy(m(x), y), model, opt,
        ...                               {"x": rlx.InputSpec((None, 64)), "y": rlx.InputSpec((None,), "int32")})
        >>> loss = step(x=x, y=y)
    """

    def __init__(self, loss_fn: Callable[..., Any], model: Module, optimizer: Optimizer, specs: dict[str, InputSpec],
                 device: str, options: dict[str, Any]) -> None:
        self._loss_fn, self._optimizer, self._device = loss_fn, optimizer, device
        # Python-side settings (mixed precision, the fp16 loss scaler); the rest goes native.
        self._precision = options.pop("precision", "fp32")
        scaler = options.pop("scaler", None)
        self._options = options
        self._scale, self._growth = (scaler if scaler is not None else (1.0, 0))
        self._good = 0
        self._init_compiled(model, specs)
        self._grads: dict[str, np.ndarray] | None = None
        self._grad_norm = float("nan")
        self._comm = _join_ranks(model, device) if options.get("distributed") else None
        if not self._dynamic:
            self._variants[None] = self._build(specs)

    def _build(self, specs: dict[str, InputSpec]) -> _Variant:
        model = self._model
        store = model._store_for(self._device)
        if not store.entries():
            raise RlxError("the model has no parameters to train")
        t, out, nodes = _trace(self._loss_fn, model, specs, store, training=True, device=self._device)
        aux: dict[str, Any] = {}
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping):
            out, aux = out
        if not isinstance(out, Tensor):
            raise RlxError(f"loss_fn must return an rlx.Tensor (or (loss, aux dict)), got {type(out).__name__}")
        if out.shape != ():
            raise ShapeError(f"[loss] loss_fn must return a float32 (or float64) scalar, got {out.dtype} {out.shape}")
        if out.dtype not in ("float32", "float64"):
            raise DTypeError(f"[loss] loss_fn must return a float32 (or float64) scalar, got {out.dtype}: cast it "
                             "with .astype('float32')")
        for k, v in aux.items():
            if not isinstance(k, str) or not isinstance(v, Tensor):
                raise RlxError(f"aux must map names to rlx Tensors; '{k}' is a {type(v).__name__}")
        tensors = model._tensors()
        trainable = [n for n, _, _ in store.entries() if tensors[n].requires_grad and not tensors[n]._is_buffer]
        if not trainable:
            raise RlxError("every parameter is frozen (requires_grad=False): nothing to train")
        aux_names = list(aux)
        names_of = {id(p): n for n, p in tensors.items()}
        updates = [(names_of[i], v) for i, (b, v) in t.__dict__.get("buffer_updates", {}).items() if i in names_of]
        extra = [aux[n]._id for n in aux_names] + [v._id for _, v in updates]
        graph, loss, wrt = t.graph, out._id, [nodes[n] for n in trainable]
        if self._precision != "fp32":
            # Matmuls read low-precision casts of their operands; autodiff then makes the
            # backward products low precision too, and float32 gradients reach the masters.
            graph, where = graph.autocast(_LOW[self._precision])
            loss, wrt, extra = where[loss], [where[i] for i in wrt], [where[i] for i in extra]
        if self._precision == "fp16":
            # Dynamic loss scaling: differentiate loss * scale, divide the gradients by the
            # scale (so the update, the norm and the non-finite check see true gradients) and
            # report the unscaled loss.
            scale = graph.reshape(graph.input(LOSS_SCALE_INPUT, [1], "float32"), [])
            # A float64 loss (a float64 input to the model) is scaled in float64.
            wide = graph.cast(scale, "float64") if out.dtype == "float64" else scale
            backward = graph.grad(graph.binary("mul", loss, wide), wrt)
            grads = [backward.binary("div", g, scale) for g in backward.outputs()[1:]]
            backward.set_outputs([loss, *grads])
        else:
            backward = graph.grad(loss, wrt)
        n_before = len(backward.outputs())
        if extra:
            backward.set_outputs(list(backward.outputs()) + extra)
        buffer_updates = [[n_before + len(aux_names) + k, name] for k, (name, _) in enumerate(updates)]
        state = self._optimizer._state_for(store)
        spec = json.dumps({"rule": self._optimizer._rule, "trainable": trainable, "buffer_updates": buffer_updates,
                           **self._options})
        exe = _rlx.Executable(backward, store, self._device, (spec, state))
        var = _Variant(exe, specs)
        var.state = state
        var.trainable = trainable
        var.aux = aux_names
        n = len(var.outs)
        # loss, the aux outputs, and the statistics (last); buffer updates stay in the arena.
        var.read = [0, *range(1 + len(trainable), 1 + len(trainable) + len(aux_names)), n - 1]
        if self._comm is not None:
            region = exe.grad_region()
            if region is None:
                raise RlxError("[compile_train_step] a data-parallel step has no gradient region (a bug in rlx)")
            if hasattr(self._comm, "allreduce_grads_"):
                var.region = None  # NCCL: averaged on the GPU
            elif region[0] is None:
                raise UnsupportedError(f"[compile_train_step] distributed=True on '{self._device}' needs the NCCL "
                                       f"backend: rlx.distributed.init(backend='nccl')")
            else:
                var.region = np.frombuffer(region[0], dtype=np.float32)
        return self._with_rng(var)

    def __call__(self, *args: Any, **arrays: Any) -> Any:
        _keywords_only("step", args, self._specs)
        var = self._pick(arrays)
        feeds = _check_feeds(var.names, arrays, var.specs, _HIDDEN)
        hyper = self._optimizer._prepare(var.state)
        self._bind_rng(var)
        if LOSS_SCALE_INPUT in var.names:
            var.exe.bind(LOSS_SCALE_INPUT, np.array([self._scale], np.float32))
        skipped_before = var.skipped
        if self._comm is None:
            out = var.exe.run(feeds, hyper, var.read)
        else:
            # Gradients, their mean over the ranks (in place over the arena's gradient region),
            # then the update: every rank updates with the same gradients.
            out = var.exe.run(feeds, hyper, var.read[:-1], "gradients")
            if var.region is None:
                self._comm.allreduce_grads_(var.exe)
            else:
                self._comm.allreduce_mean_(var.region)
            out += var.exe.run({}, hyper, var.read[-1:], "update")
        self._rng_calls += 1
        # Views (host-visible memory) stay current; copies (device memory) are taken again.
        self._last, self._grads = var, None
        stats = np.frombuffer(out[-1], dtype=np.float32)
        self._grad_norm = float(stats[0])
        var.skipped = float(stats[1])
        if self._precision == "fp16":
            self._rescale(var.skipped > skipped_before)
        loss = struct.unpack("<d" if var.outs[0][1] == "float64" else "<f", out[0])[0]
        if not var.aux:
            return loss
        aux = {}
        for name, raw, i in zip(var.aux, out[1:-1], range(1 + len(var.trainable), len(var.outs))):
            shape, dtype = var.outs[i]
            aux[name] = np.frombuffer(raw, dtype=_NP[dtype]).reshape(shape)
        return loss, aux

    def _rescale(self, skipped: bool) -> None:
        """The fp16 loss scaler after a call: a skipped (overflowing) step halves the scale, and
        ``growth_interval`` good steps in a row double it (PyTorch's ``GradScaler`` rule)."""
        if skipped:
            self._scale, self._good = max(self._scale / 2.0, 2.0 ** -24), 0
            return
        self._good += 1
        if self._good >= self._growth:
            self._scale, self._good = min(self._scale * 2.0, 2.0 ** 64), 0

    @property
    def loss_scale(self) -> float:
        """The loss scale the next call multiplies the loss by (``precision="fp16"``: dynamic,
        halved after a step whose gradients overflow, doubled after ``growth_interval`` good
        steps); 1.0 for the other precisions, which do not scale.

        Example:
            >>> step.loss_scale
            65536.0
        """
        return float(self._scale)

    @property
    def precision(self) -> str:
        """``"fp32"``, ``"bf16"`` or ``"fp16"``, as compiled.

        Example:
            >>> step.precision
            'bf16'
        """
        return self._precision

    @property
    def grads(self) -> dict[str, np.ndarray]:
        """The last call's gradients by parameter name (read-only views where the host can see
        the memory, copies on CUDA; frozen parameters have none). ``grad_tensor(name)`` exports
        one by DLPack with no copy on every device.

        Example:
            >>> step.grads["fc1.weight"].shape
            (256, 64)
        """
        var = self._last or next(iter(self._variants.values()), None)
        if var is None:
            return {}
        if self._grads is None:
            self._grads = {n: _output(var.exe, i + 1) for i, n in enumerate(var.trainable)}
        return dict(self._grads)

    def grad_tensor(self, name: str) -> DeviceTensor:
        """The last call's gradient of parameter ``name`` as a ``DeviceTensor``: exported by
        DLPack with no copy on every device (on CUDA the arena's own GPU memory, where
        ``grads`` returns copies), e.g. ``torch.from_dlpack(step.grad_tensor("fc1.weight"))``.

        The memory is the step's gradient slot: it holds the last call's gradient between calls
        and is overwritten by the next call of the same input sizes (during a call it holds
        other intermediate values). Writes through it change nothing the step already did
        (the update has run). With ``None`` dimensions, each input size has its own slots:
        this is the slot of the last call's size.

        Example:
            >>> g = torch.from_dlpack(step.grad_tensor("fc1.weight"))
        """
        var = self._last or next(iter(self._variants.values()), None)
        if var is None:
            raise RlxError("nothing compiled yet: with None dimensions, each size compiles at its first call")
        if not isinstance(name, str) or name not in var.trainable:
            raise InputError(f"[{name!r}] has no gradient: it is not a trained parameter of this step "
                             f"(trained: {var.trainable})")
        i = var.trainable.index(name) + 1
        shape, dtype = var.outs[i]
        exe = var.exe
        return DeviceTensor(f"{name} (gradient)", shape, dtype, exe.dlpack_device(), lambda: exe.output_view(i),
                            lambda: exe.output_read(i), lambda: exe.output_dlpack(i))

    @property
    def grad_norm(self) -> float:
        """The global L2 norm of the gradient of the last update, before clipping. Computed when
        the step clips (``clip_grad_norm``) or skips non-finite steps; NaN otherwise and before
        the first update (the norm costs a pass over every gradient).

        Example:
            >>> step = rlx.compile_train_step(loss_fn, model, opt, specs, clip_grad_norm=1.0)
            >>> step(x=x, y=y); step.grad_norm > 0
            True
        """
        return self._grad_norm

    @property
    def skipped(self) -> int:
        """Calls that changed nothing because the loss or gradient was not finite
        (``skip_nonfinite=True``).

        Example:
            >>> step.skipped
            0
        """
        return int(sum(v.skipped for v in self._variants.values()))


def _join_ranks(model: Module, device: str) -> Any:
    """A data-parallel step's communicator, after rank 0's parameters and buffers have been
    broadcast to every rank (in place, over the weight store)."""
    from . import distributed

    comm = distributed.communicator()
    nccl = hasattr(comm, "broadcast_store_")
    if nccl and _rlx.check_device(device) != _rlx.check_device(comm.device):
        raise InputError(f"[compile_train_step] distributed=True with the NCCL backend computes on this rank's GPU "
                         f"'{comm.device}' (its local rank); got device={device!r}")
    if not nccl and device.split(":")[0] == "cuda":
        raise UnsupportedError(f"[compile_train_step] distributed=True on '{device}' needs the NCCL backend: "
                               f"rlx.distributed.init(backend='nccl')")
    store = model._store_for(device)
    _check_same_model(comm, [(name, tuple(shape), dtype) for name, shape, dtype in store.entries()])
    if nccl:
        comm.broadcast_store_(store)  # every tensor, on the GPU
        return comm
    for name, _shape, dtype in store.entries():
        raw = store.view(name)
        if raw is None:
            raise UnsupportedError(f"[compile_train_step] distributed=True needs weights the host can see (the CPU); "
                                   f"'{device}' is not supported yet")
        comm.broadcast_(bits(np.frombuffer(raw, dtype=_NP[dtype])))  # bool / bfloat16 as plain bits
    return comm


def _check_same_model(comm: Any, entries: list[tuple[str, tuple[int, ...], str]]) -> None:
    """Raises ``DistributedError`` on every rank unless every rank's parameters and buffers have
    rank 0's names, shapes and dtypes (a mismatch would otherwise broadcast into the wrong
    tensors or fail deep inside MPI). Collective: every rank calls it at compile."""
    from .distributed import DistributedError

    mine = json.dumps(entries).encode()
    size = np.array([len(mine)], dtype=np.int64)
    comm.broadcast_(size)
    theirs = np.frombuffer(mine, dtype=np.uint8).copy() if comm.rank == 0 else np.zeros(int(size[0]), np.uint8)
    comm.broadcast_(theirs)
    rank0 = [(n, tuple(s), d) for n, s, d in json.loads(theirs.tobytes())]
    differs = np.array([0.0 if rank0 == entries else 1.0], dtype=np.float32)
    comm.allreduce_mean_(differs)  # every rank learns whether any rank differs
    if differs[0] == 0:
        return
    if rank0 == entries:
        raise DistributedError("[compile_train_step] distributed=True: another rank's model differs from rank 0's "
                               "(parameter names, shapes or dtypes); that rank's error names the tensor")

    def show(e: tuple[tuple[int, ...], str] | None) -> str:
        return "absent" if e is None else f"{e[1]}{list(e[0])}"

    theirs_by_name, mine_by_name = {n: (s, d) for n, s, d in rank0}, {n: (s, d) for n, s, d in entries}
    for name in sorted(set(theirs_by_name) | set(mine_by_name)):
        a, b = theirs_by_name.get(name), mine_by_name.get(name)
        if a != b:
            raise DistributedError(f"[compile_train_step] distributed=True: every rank must build the same model; "
                                   f"'{name}' is {show(b)} on rank {comm.rank} but {show(a)} on rank 0")
    raise DistributedError(f"[compile_train_step] distributed=True: rank {comm.rank} lists its parameters in "
                           f"another order than rank 0")


def _output(exe: Any, i: int) -> np.ndarray:
    shape, dtype = exe.outputs()[i]
    raw = exe.output_view(i)
    if raw is None:
        # Device memory the host cannot see (CUDA): a read-only copy of the last call's values.
        raw = exe.output_read(i)
    arr = np.frombuffer(raw, dtype=_NP[dtype]).reshape(shape)
    arr.flags.writeable = False
    return arr


class Function(_Compiled):
    """A compiled inference function: ``fn(**arrays)`` returns fresh numpy arrays (copies that the
    next call does not touch) — one array, or a tuple when the traced function returned one.
    ``fn()`` without arrays consumes the next prefetched batch (or runs on bound inputs).

    Example:
        >>> predict = rlx.compile(lambda m, x: m(x), model, {"x": rlx.InputSpec((None, 64))})
        >>> predict(x=np.zeros((5, 64), np.float32)).shape
        (5, 10)
    """

    def __init__(self, forward_fn: Callable[..., Any], model: Module, specs: dict[str, InputSpec], device: str,
                 training: bool, precision: str = "fp32") -> None:
        self._forward_fn, self._device, self._training = forward_fn, device, training
        self._precision = precision
        self._bound: set[str] = set()
        self._init_compiled(model, specs)
        if not self._dynamic:
            self._variants[None] = self._build(specs)
            self._exe = self._variants[None].exe

    def _build(self, specs: dict[str, InputSpec]) -> _Variant:
        store = self._model._store_for(self._device)
        t, out, _ = _trace(self._forward_fn, self._model, specs, store, training=self._training,
                          device=self._device)
        outs = out if isinstance(out, tuple) else (out,)
        ids = []
        for o in outs:
            if not isinstance(o, Tensor):
                o = t.constant(o) if isinstance(o, (np.ndarray, np.generic, float, int)) else o
            if not isinstance(o, Tensor):
                raise RlxError(f"forward_fn must return rlx.Tensor(s), got {type(o).__name__}")
            ids.append(o._id)
        t.graph.set_outputs(ids)
        graph = t.graph
        if self._precision != "fp32":
            graph, _ = graph.autocast(_LOW[self._precision])
        exe = _rlx.Executable(graph, store, self._device, None)
        var = _Variant(exe, specs)
        var.tuple = isinstance(out, tuple)
        return self._with_rng(var)

    def __call__(self, *args: Any, **arrays: Any) -> Any:
        _keywords_only("fn", args, self._specs)
        var = self._pick(arrays)
        self._last = var
        feeds = _check_feeds(var.names, arrays, var.specs, self._bound | _HIDDEN)
        self._bind_rng(var)
        raw = var.exe.run(feeds, None, list(range(len(var.outs))))
        self._rng_calls += 1
        outs = [np.frombuffer(b, dtype=_NP[d]).reshape(s) for b, (s, d) in zip(raw, var.outs)]
        return tuple(outs) if var.tuple else outs[0]

    def _spec(self, name: str) -> InputSpec:
        self._check_model()
        if self._dynamic:
            raise UnsupportedError("resident inputs (bind, view, write_rows) need fixed shapes; this function has None dimensions")
        if not isinstance(name, str) or name not in self._specs:
            raise InputError(f"[{name}] unknown input; expected {sorted(self._specs)}")
        if name not in self._variants[None].names:
            raise InputError(f"[{name}] this input is not used by the function")
        return self._variants[None].specs[name]

    def bind(self, name: str, array: Any) -> None:
        """Places a resident input (e.g. a KV cache) in the arena once; later calls omit it.

        Example:
            >>> fn.bind("k_cache", np.zeros((1, 4, 64, 16), np.float32))
        """
        spec = self._spec(name)
        self._exe.bind(name, convert(name, spec.shape, spec.dtype, array))
        self._bound.add(name)

    def view(self, name: str) -> np.ndarray:
        """The arena view of input ``name`` (writable) where the host can see the memory; on CUDA a
        read-only copy of its current values (change it with ``bind`` or ``write_rows``, or write
        through the DLPack export of ``view_tensor(name)``).

        Example:
            >>> fn.view("k_cache")[:, :, 0] = 0.0
        """
        spec = self._spec(name)
        raw = self._exe.input_view(name)
        if raw is None:
            # Device memory (CUDA): a read-only copy of the slot; write with bind / write_rows.
            return np.frombuffer(self._exe.input_read(name), dtype=_NP[spec.dtype]).reshape(spec.shape)
        return np.frombuffer(raw, dtype=_NP[spec.dtype]).reshape(spec.shape)

    def view_tensor(self, name: str) -> DeviceTensor:
        """Input ``name``'s arena slot as a ``DeviceTensor``: exported by DLPack with no copy on
        every device (on CUDA the arena's own GPU memory, where ``view`` returns a copy), e.g.
        ``torch.from_dlpack(fn.view_tensor("k_cache"))``. Writes through it are what the next
        call reads, as ``bind`` and ``write_rows`` writes are. A bound input keeps its values
        between calls; an input passed to a call is overwritten by the next call that passes it.

        Example:
            >>> k = torch.from_dlpack(fn.view_tensor("k_cache"))
        """
        spec = self._spec(name)
        exe = self._exe
        return DeviceTensor(f"{name} (input)", spec.shape, spec.dtype, exe.dlpack_device(),
                            lambda: exe.input_view(name), lambda: exe.input_read(name),
                            lambda: exe.input_dlpack(name))

    def write_rows(self, name: str, start: int, rows: Any, axis: int = 0) -> None:
        """Writes ``rows`` into input ``name`` in place from index ``start`` along ``axis``
        (bounds-checked: rows past the end raise ``InputError`` and nothing is written).

        Example:
            >>> fn.write_rows("k_cache", pos, k_new, axis=2)   # append one token's keys
        """
        spec = self._spec(name)
        start = _check.integer("write_rows", "start", start)
        axis = _check.integer("write_rows", "axis", axis)
        if not -len(spec.shape) <= axis < len(spec.shape):
            raise ShapeError(f"[{name}] axis {axis} is out of range for shape {spec.shape}")
        axis %= len(spec.shape)
        if not 0 <= start <= spec.shape[axis]:
            raise InputError(f"[{name}] start {start} is out of range [0, {spec.shape[axis]}] along axis {axis}")
        try:
            rows = np.asarray(rows)
        except (TypeError, ValueError) as e:
            raise DTypeError(f"[{name}] rows must be an array: {e}") from None
        expect = list(spec.shape)
        expect[axis] = rows.shape[axis] if rows.ndim == len(spec.shape) else -1
        if rows.ndim != len(spec.shape) or list(rows.shape) != expect:
            raise ShapeError(f"[{name}] rows of shape {rows.shape} do not match {spec.shape} outside axis {axis}")
        self._exe.write_rows(name, axis, start, convert(name, rows.shape, spec.dtype, rows))


def compile_train_step(loss_fn: Callable[..., Any], model: Module, optimizer: Optimizer,
                       inputs: Mapping[str, Any], device: str = "cpu", *, clip_grad_norm: float | None = None,
                       accumulate: int = 1, skip_nonfinite: bool = False, distributed: bool = False,
                       precision: str = "fp32", loss_scale: float = 65536.0,
                       growth_interval: int = 2000) -> TrainStep:
    """Traces ``loss_fn(model, **tensors)`` (in train mode), differentiates it w.r.t. every
    trainable parameter and compiles forward, backward and the optimizer update into one
    executable on ``device``.

    Args:
        loss_fn: ``loss_fn(model, **tensors)`` returning a float32 (or float64) scalar Tensor, or
            ``(loss, aux)`` with ``aux`` a dict of Tensors returned by every call.
        clip_grad_norm: scale gradients so their global L2 norm is at most this (PyTorch's
            ``clip_grad_norm_``), inside the same native call; ``step.grad_norm`` is the norm
            before clipping.
        accumulate: each call adds its gradients; the update, with their mean, runs on every
            ``accumulate``-th call.
        skip_nonfinite: a call whose loss or gradient norm is not finite changes nothing;
            ``step.skipped`` counts them.
        distributed: data parallel across the ranks of ``rlx.distributed.init()``: rank 0's
            parameters are broadcast at compile, and each call averages the gradients over the
            ranks (one in-place all-reduce of the arena's gradient region) before the update.
            Every rank must call the step the same number of times.
        precision: ``"fp32"`` (the default): everything in float32. ``"bf16"``: mixed precision
            as PyTorch's autocast: matmuls (so linear layers, convolutions and the attention
            projections) multiply bfloat16 operands and sum in float32; reductions, softmax,
            norms, attention scores, losses and the update stay float32, and the weights and
            optimizer state stay float32 masters. ``"fp16"``: the same in float16, with dynamic
            loss scaling (``step.loss_scale``): a step whose gradients overflow changes nothing
            (counted in ``step.skipped``) and halves the scale, so ``"fp16"`` always skips
            non-finite steps (``skip_nonfinite`` is on whatever it is given). CPU and CUDA (not
            Metal);
            ``step.precision`` says which one a step computes in. The loss scale is not saved in
            checkpoints (a resumed run starts again from ``loss_scale``).
        loss_scale: the first loss scale of ``precision="fp16"`` (PyTorch's default, 2**16);
            not used by the other precisions.
        growth_interval: ``precision="fp16"`` doubles the scale after this many good steps in a
            row (PyTorch's default, 2000); not used by the other precisions.

    Example:
        >>> step = rlx.compile_train_step(lambda m, x, y: rlx.cross_entropy(m(x), y), model,
        ...                               rlx.optim.Adam(1e-3), {"x": rlx.InputSpec((64, 64)),
        ...                               "y": rlx.InputSpec((64,), "int32")}, clip_grad_norm=1.0)
    """
    if not isinstance(model, Module):
        raise RlxError(f"compile_train_step needs an rlx.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, Optimizer):
        raise RlxError(f"compile_train_step needs an rlx.optim optimizer, got {type(optimizer).__name__}")
    _check.function("compile_train_step", "loss_fn", loss_fn)
    precision = _check_precision("compile_train_step", precision, _check.device(device))
    if (isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float, np.integer, np.floating))
            or not (np.isfinite(loss_scale) and loss_scale > 0.0)):
        raise InputError(f"[compile_train_step] loss_scale must be a positive finite number, got {loss_scale!r}")
    scale = float(loss_scale)
    if (isinstance(growth_interval, bool) or not isinstance(growth_interval, (int, np.integer))
            or growth_interval < 1):
        raise InputError(f"[compile_train_step] growth_interval must be an int >= 1, got {growth_interval!r}")
    growth = int(growth_interval)
    device = _rlx.check_device(_check.device(device))
    _check_compute_dtypes("compile_train_step", model, device, precision)
    specs = _device_specs(_specs(inputs), device)
    options: dict[str, Any] = {}
    if clip_grad_norm is not None:
        c = _check.number("compile_train_step", "clip_grad_norm", clip_grad_norm, lo=0.0)
        if c <= 0.0:
            raise InputError(f"[compile_train_step] clip_grad_norm must be > 0, got {c}")
        options["clip"] = c
    options["accumulate"] = _check.integer("compile_train_step", "accumulate", accumulate, lo=1)
    if not isinstance(skip_nonfinite, (bool, np.bool_)):
        raise InputError(f"[compile_train_step] skip_nonfinite must be True or False, got {skip_nonfinite!r}")
    options["skip_nonfinite"] = bool(skip_nonfinite)
    if not isinstance(distributed, (bool, np.bool_)):
        raise InputError(f"[compile_train_step] distributed must be True or False, got {distributed!r}")
    if distributed:
        from . import distributed as dist

        wide = [n for n, p in model._tensors().items() if p.dtype == "float64"]
        if wide:
            raise DTypeError(f"[compile_train_step] distributed=True averages float32 gradients; parameter "
                             f"'{wide[0]}' is float64: convert the model with model.to('float32')")
        dist.communicator()  # raises before init()
        options["distributed"] = True
    if options["accumulate"] > 1 and any(s.dynamic for s in specs.values()):
        raise UnsupportedError("[compile_train_step] accumulate > 1 needs fixed input shapes (no None dimensions)")
    options["precision"] = precision
    if precision == "fp16":
        if options["accumulate"] > 1:
            raise UnsupportedError("[compile_train_step] precision='fp16' with accumulate > 1 is not supported yet "
                                   "(the loss scale would change between the accumulated calls)")
        # Loss scaling needs the step to skip overflowing gradients.
        options["skip_nonfinite"] = True
        options["scaler"] = (scale, growth)
    return TrainStep(loss_fn, model, optimizer, specs, device, options)


def compile(forward_fn: Callable[..., Any], model: Module, inputs: Mapping[str, Any], device: str = "cpu",
            training: bool = False, *, precision: str = "fp32") -> Function:
    """Traces ``forward_fn(model, **tensors)`` into an inference executable on ``device``, in
    eval mode unless ``training=True``. ``precision="bf16"`` / ``"fp16"`` runs the matmuls with
    low-precision operands and float32 sums, the rest in float32 (as ``compile_train_step``);
    CPU and CUDA (not Metal).

    Example:
        >>> predict = rlx.compile(lambda m, x: m(x), model, {"x": rlx.InputSpec((10, 64))})
        >>> logits = predict(x=np.zeros((10, 64), np.float32))
    """
    if not isinstance(model, Module):
        raise RlxError(f"compile needs an rlx.nn.Module, got {type(model).__name__}")
    _check.function("compile", "forward_fn", forward_fn)
    precision = _check_precision("compile", precision, _check.device(device))
    device = _rlx.check_device(_check.device(device))
    _check_compute_dtypes("compile", model)
    specs = _device_specs(_specs(inputs), device)
    if not isinstance(training, (bool, np.bool_)):
        raise InputError(f"[compile] training must be True or False, got {training!r}")
    return Function(forward_fn, model, specs, device, bool(training), precision)
