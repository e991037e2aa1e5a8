"""Optimizers with PyTorch's update rules. Their state lives on the device beside the weights and
is updated in place inside the training step. Every setting (``lr``, ``momentum``, ...; also in
parameter groups) may change between steps and takes effect on the next step: the settings are
written, one row per parameter, into the optimizer's state store whenever they change."""

from __future__ import annotations

import json
from fnmatch import fnmatchcase
from typing import Any, Mapping

import numpy as np

from .. import _check, _rlx
from .._dlpack import DeviceTensor
from ..errors import CheckpointError, InputError, RlxError

# Columns of the per-parameter settings table (rlx_runtime::hyper_col).
_COLUMNS = ("lr", "weight_decay", "momentum", "dampening", "nesterov", "beta1", "beta2", "eps", "alpha", "lr_decay",
            "1-alpha", "1-dampening", "1-beta1", "1-beta2")
_META_KEY = "rlx.optimizer"


def _freeze(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return (type(v), tuple(_freeze(x) for x in v))
    return (type(v), v)


class Optimizer:
    """Base class of rlx's optimizers.

    Settings are attributes (``opt.lr = 0.01`` between steps is fine). ``groups`` assigns other
    settings to parameters by dotted-name pattern (``fnmatch``; the first matching group wins;
    parameters no group matches use the optimizer's own settings)::

        rlx.optim.AdamW(lr=1e-3, weight_decay=0.1,
                        groups=[{"params": ["*.bias", "*norm*"], "weight_decay": 0.0}])

    Example:
        >>> opt = rlx.optim.AdamW(lr=1e-3, weight_decay=0.1,
        ...                       groups=[{"params": ["*.bias", "*norm*"], "weight_decay": 0.0}])
        >>> opt.lr = 5e-4                      # takes effect on the next step
    """

    _rule = ""
    #: The settings this optimizer has, with their defaults.
    _settings: dict[str, Any] = {}

    def __init__(self, groups: Any = None, **settings: Any) -> None:
        for k, v in settings.items():
            object.__setattr__(self, k, v)
        self.groups: list[dict[str, Any]] = [] if groups is None else groups
        self._states: dict[int, tuple[Any, Any]] = {}  # id(weight store) -> (weight store, state store)
        self._current: Any = None
        self._pending: dict[str, Any] | None = None  # loaded state waiting for a compile
        self._written: dict[int, Any] = {}  # id(state store) -> settings key last written there
        self._initial_lrs: dict[Any, float] = {}  # for schedulers: holder -> initial lr
        self._hyper()

    # --- settings ------------------------------------------------------------------------------

    def _key(self) -> Any:
        """Everything the settings table depends on, comparable with ``==`` (type for type)."""
        groups = self.groups
        if not groups:
            gkey: Any = ()
        elif isinstance(groups, list):
            gkey = tuple(tuple(sorted((k, _freeze(v)) for k, v in g.items())) if isinstance(g, dict) else _freeze(g)
                         for g in groups)
        else:
            gkey = _freeze(groups)
        return (tuple(_freeze(getattr(self, k)) for k in self._settings), gkey)

    def _check_setting(self, key: str, v: Any) -> Any:
        where = type(self).__name__
        if key == "betas":
            if not isinstance(v, (tuple, list)) or len(v) != 2:
                raise InputError(f"[{where}] betas must be a pair (beta1, beta2), got {v!r}")
            return (_check.number(where, "beta1", v[0], lo=0.0, hi=1.0, hi_open=True),
                    _check.number(where, "beta2", v[1], lo=0.0, hi=1.0, hi_open=True))
        if key == "nesterov":
            if not isinstance(v, (bool, np.bool_)):
                raise InputError(f"[{where}] nesterov must be True or False, got {v!r}")
            return bool(v)
        if key == "alpha":
            return _check.number(where, "alpha", v, lo=0.0, hi=1.0)
        return _check.number(where, key, v, lo=0.0)

    def _resolved(self, overrides: Mapping[str, Any]) -> dict[str, Any]:
        s = {k: self._check_setting(k, overrides.get(k, getattr(self, k))) for k in self._settings}
        if s.get("nesterov") and (s.get("momentum", 0.0) <= 0.0 or s.get("dampening", 0.0) != 0.0):
            raise InputError(f"[{type(self).__name__}] Nesterov momentum needs momentum > 0 and dampening 0")
        return s

    def _check_groups(self) -> list[tuple[list[str], dict[str, Any]]]:
        where = type(self).__name__
        if not isinstance(self.groups, list):
            raise InputError(f"[{where}] groups must be a list of dicts, got {type(self.groups).__name__}")
        out = []
        for i, g in enumerate(self.groups):
            if not isinstance(g, dict) or "params" not in g:
                raise InputError(f"[{where}] group {i} must be a dict with a 'params' list of name patterns, got {g!r}")
            pats = g["params"]
            pats = [pats] if isinstance(pats, str) else pats
            if not isinstance(pats, (list, tuple)) or not all(isinstance(p, str) for p in pats):
                raise InputError(f"[{where}] group {i}: 'params' must be a list of name patterns, got {g['params']!r}")
            unknown = sorted(set(g) - set(self._settings) - {"params"})
            if unknown:
                raise InputError(f"[{where}] group {i}: unknown settings {unknown}; {where} has {sorted(self._settings)}")
            out.append((list(pats), self._resolved(g)))
        return out

    def _hyper(self) -> tuple[float, float, float, float, float, float]:
        """Checks the settings (skipped while unchanged) and returns the default group's as
        ``(lr, momentum, weight_decay, beta1, beta2, eps)``."""
        key = self._key()
        cached = self.__dict__.get("_checked")
        if cached is not None and cached[0] == key:
            return cached[1]
        default = self._resolved({})
        groups = self._check_groups()
        b1, b2 = default.get("betas", (0.9, 0.999))
        hyper = (default["lr"], default.get("momentum", 0.0), default.get("weight_decay", 0.0), b1, b2,
                 default.get("eps", 1e-8))
        self._checked = (key, hyper, default, groups)
        return hyper

    def _row(self, s: dict[str, Any]) -> list[float]:
        b1, b2 = s.get("betas", (0.9, 0.999))
        vals = {"lr": s["lr"], "weight_decay": s.get("weight_decay", 0.0), "momentum": s.get("momentum", 0.0),
                "dampening": s.get("dampening", 0.0), "nesterov": 1.0 if s.get("nesterov") else 0.0,
                "beta1": b1, "beta2": b2, "eps": s.get("eps", 1e-8), "alpha": s.get("alpha", 0.99),
                "lr_decay": s.get("lr_decay", 0.0)}
        for k in ("alpha", "dampening", "beta1", "beta2"):
            vals["1-" + k] = 1.0 - vals[k]  # in double precision, rounded once (as PyTorch)
        return [float(vals[c]) for c in _COLUMNS]

    def _group_of(self, name: str) -> int:
        """Index of the group that owns parameter ``name`` (-1: the optimizer's own settings)."""
        for i, (pats, _) in enumerate(self._checked[3]):
            if any(fnmatchcase(name, p) for p in pats):
                return i
        return -1

    def _prepare(self, state: Any) -> tuple[float, float, float, float, float, float]:
        """Before a step on ``state``: checks the settings and writes the per-parameter table
        into the state store when they changed since it was last written there."""
        hyper = self._hyper()
        key = self._checked[0]
        if self._written.get(id(state)) != key:
            default, groups = self._checked[2], self._checked[3]
            entries = state.entries()
            names = [n for n, s, d in entries if n.endswith(".step")]
            # float64 where a float64 parameter is trained (its settings keep double precision).
            table = next((_STATE_NP[d] for n, s, d in entries if n == "hyper"), np.float32)
            rows = []
            for n in names:
                g = self._group_of(n[: -len(".step")])
                rows.append(self._row(default if g < 0 else groups[g][1]))
            state.write("hyper", np.asarray(rows, table).reshape(-1))
            self._written[id(state)] = key
        return hyper

    # --- state ---------------------------------------------------------------------------------

    def _state_for(self, params: Any) -> Any:
        """This optimizer's state store for the weight store ``params`` (made once, then shared)."""
        entry = self._states.get(id(params))
        if entry is None or entry[0] is not params:
            state = _rlx.Store.for_optimizer(self._rule, params)
            if self._pending is not None:
                state.write_many(self._plan_state(state, params, self._pending["state"], "[optimizer state] "))
                self._pending = None
            entry = (params, state)
            self._states[id(params)] = entry
        self._current = entry[1]
        self._param_names = {n for n, _, _ in params.entries()}
        return entry[1]

    def _slots(self) -> list[str]:
        """The state buffers kept per parameter: the native module's one list for this rule."""
        return list(_rlx.optimizer_slots(self._rule)) if self._rule else []

    def _extra(self) -> list[str]:
        """Per-parameter int32 scalars besides ``step``."""
        return []

    def state(self, name: str) -> dict[str, np.ndarray]:
        """The state buffers of parameter ``name`` (views where the host can see the memory,
        read-only copies on CUDA), with its update count as ``"step"``. ``state_tensors(name)``
        exports them by DLPack with no copy on every device.

        Example:
            >>> opt.state("fc1.weight")["exp_avg"].shape   # after compiling a step with Adam
            (256, 64)
        """
        if self._current is None:
            raise RlxError(f"[{type(self).__name__}] has no state until a training step is compiled with it")
        store = self._current
        entries = {n: (s, d) for n, s, d in store.entries()}
        if not isinstance(name, str) or name not in self._param_names:
            raise InputError(f"[{type(self).__name__}] no parameter named {name!r}")
        if f"{name}.step" not in entries:
            raise InputError(f"[{type(self).__name__}] {name!r} has no optimizer state (only float32 and float64 tensors are trained)")
        out = {key: _read(store, f"{name}.{key}", *entries[f"{name}.{key}"]) for key in self._slots()}
        out["step"] = _read(store, f"{name}.step", *entries[f"{name}.step"])
        return out

    def state_tensors(self, name: str) -> dict[str, DeviceTensor]:
        """The state buffers of parameter ``name`` (and ``"step"``, its int32 update count) as
        ``DeviceTensor`` objects: exported by DLPack with no copy on every device (on CUDA the
        state store's own GPU memory, where ``state`` returns copies), e.g.
        ``torch.from_dlpack(opt.state_tensors("fc1.weight")["exp_avg"])``. Each step updates
        them in place, and writes through them are what the next step reads. They belong to the
        state of the step compiled last: compiling for another device makes new state.

        Example:
            >>> m = torch.from_dlpack(opt.state_tensors("fc1.weight")["exp_avg"])
        """
        if self._current is None:
            raise RlxError(f"[{type(self).__name__}] has no state until a training step is compiled with it")
        store = self._current
        entries = {n: (s, d) for n, s, d in store.entries()}
        if not isinstance(name, str) or name not in self._param_names:
            raise InputError(f"[{type(self).__name__}] no parameter named {name!r}")
        if f"{name}.step" not in entries:
            raise InputError(f"[{type(self).__name__}] {name!r} has no optimizer state (only float32 and float64 tensors are trained)")
        device = store.dlpack_device()

        def tensor(key: str) -> DeviceTensor:
            full = f"{name}.{key}"
            shape, dtype = entries[full]
            return DeviceTensor(f"{full} (optimizer state)", shape, dtype, device, lambda: store.view(full),
                                lambda: store.read(full), lambda: store.dlpack(full))

        return {key: tensor(key) for key in [*self._slots(), "step"]}

    def _settings_dict(self) -> dict[str, Any]:
        out = {}
        for k in self._settings:
            v = getattr(self, k)
            out[k] = list(v) if isinstance(v, tuple) else v
        return out

    def state_dict(self) -> dict[str, Any]:
        """Settings, groups and every parameter's state (copies), to resume training exactly.

        Example:
            >>> sd = opt.state_dict()
            >>> opt2.load_state_dict(sd)
        """
        try:
            self._hyper()  # what is saved must load again, and loading checks the settings
        except RlxError as e:
            raise type(e)(f"{e}; the state is saved with the settings, so set a valid value first "
                          "(nothing was changed or written)") from None
        out: dict[str, Any] = {"type": type(self).__name__, "settings": self._settings_dict(),
                               "groups": [dict(g) for g in self.groups], "state": {}}
        if self._current is None:
            if self._pending is not None:
                out["state"] = {n: {k: np.array(v) for k, v in d.items()} for n, d in self._pending["state"].items()}
            return out
        store = self._current
        for n, shape, dtype in store.entries():
            if n == "hyper":
                continue
            pname, slot = n.rsplit(".", 1)
            arr = np.frombuffer(store.read(n), dtype=_STATE_NP[dtype]).reshape(shape)
            out["state"].setdefault(pname, {})[slot] = arr.copy()
        return out

    def _check_state(self, state: Any, where: str) -> dict[str, dict[str, np.ndarray]]:
        """Checks the structure and values of loaded ``state`` (shapes: against a store, in
        ``_plan_state``) and returns copies as arrays, the int32 counters already converted."""
        if not isinstance(state, Mapping):
            raise CheckpointError(f"{where}'state' must map parameter names to dicts, got {type(state).__name__}")
        known = [*self._slots(), "step", *self._extra()]
        ints = {"step", *self._extra()}
        out: dict[str, dict[str, np.ndarray]] = {}
        for pname, d in state.items():
            if not isinstance(pname, str) or not isinstance(d, Mapping):
                raise CheckpointError(f"{where}'state' must map parameter names to dicts of arrays, got "
                                      f"{pname!r}: {type(d).__name__}")
            extra = sorted(map(repr, set(d) - set(known)))
            if extra:
                raise CheckpointError(f"{where}'{pname}' has unknown state [{', '.join(extra)}] "
                                      f"(this optimizer keeps {known})")
            out[pname] = {slot: _state_array(where, f"{pname}.{slot}", v, np.int32 if slot in ints else None)
                          for slot, v in d.items()}
        return out

    def _plan_state(self, store: Any, params: Any, state: Mapping[str, Mapping[str, np.ndarray]],
                    where: str) -> list[tuple[str, Any]]:
        """Checks ``state`` (from ``_check_state``) against ``store`` and returns the writes that
        place it (parameters absent from ``state`` get fresh zero state); writes nothing."""
        entries = {n: (tuple(s), d) for n, s, d in store.entries() if n != "hyper"}
        names = {n for n, _, _ in params.entries()}
        unknown = sorted(set(state) - names)
        if unknown:
            raise CheckpointError(f"{where}has state for parameters the model does not have: {unknown}")
        writes = []
        for full, (shape, dtype) in entries.items():
            pname, slot = full.rsplit(".", 1)
            value = state.get(pname, {}).get(slot)
            want = _STATE_NP[dtype]
            if value is None:
                if pname in state:
                    raise CheckpointError(f"{where}'{pname}' has no '{slot}' (this optimizer keeps {self._slots() + ['step']})")
                arr = np.zeros(shape, want)
            else:
                if tuple(value.shape) != shape:
                    raise CheckpointError(f"{where}'{pname}.{slot}' has shape {tuple(value.shape)}; the model's is {shape}")
                arr = _state_array(where, full, value, want)
            writes.append((full, arr.reshape(-1)))
        for pname, d in state.items():
            extra = sorted(set(d) - {full.rsplit(".", 1)[1] for full in entries if full.startswith(pname + ".")})
            if extra:
                raise CheckpointError(f"{where}'{pname}' has unknown state {extra}")
        return writes

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restores settings, groups and state from ``state_dict()``. Everything is checked
        (for every model the optimizer trains) before anything changes (``CheckpointError``).
        Before a step is compiled, the state is kept and placed at the compile.

        Example:
            >>> opt.load_state_dict(saved)
        """
        where = "[optimizer state] "
        if not isinstance(state_dict, Mapping) or "state" not in state_dict:
            raise CheckpointError(f"{where}expects a dict from Optimizer.state_dict() (keys 'type', 'settings', "
                                  f"'groups', 'state'), got {type(state_dict).__name__}")
        if state_dict.get("type") != type(self).__name__:
            raise CheckpointError(f"{where}holds {state_dict.get('type')!r} state; this is {type(self).__name__}")
        settings = state_dict.get("settings", {})
        if not isinstance(settings, Mapping):
            raise CheckpointError(f"{where}'settings' must be a dict of setting names to values, got "
                                  f"{type(settings).__name__}")
        unknown = sorted(map(repr, set(settings) - set(self._settings)))
        if unknown:
            raise CheckpointError(f"{where}unknown settings [{', '.join(unknown)}]")
        groups = state_dict.get("groups", [])
        groups = [] if groups is None else groups  # None: no groups, as in the constructor
        if not isinstance(groups, (list, tuple)):
            raise CheckpointError(f"{where}'groups' must be a list of dicts, got {type(groups).__name__}")
        for i, g in enumerate(groups):
            if not isinstance(g, Mapping) or not all(isinstance(k, str) for k in g):
                raise CheckpointError(f"{where}group {i} must be a dict of setting names (and 'params') to values, "
                                      f"got {type(g).__name__} {g!r:.80}")
        # Check the settings on a scratch copy first.
        probe = object.__new__(type(self))
        probe.__dict__.update(self.__dict__)
        probe.__dict__.pop("_checked", None)
        for k, v in settings.items():
            object.__setattr__(probe, k, tuple(v) if isinstance(v, list) else v)
        probe.groups = [dict(g) for g in groups]
        try:
            probe._hyper()
        except RlxError as e:
            raise CheckpointError(f"{where}bad settings: {e}") from None
        state = self._check_state(state_dict["state"], where)
        # Every store is checked before any is written: an optimizer shared by several models
        # changes all of them or none.
        plans = [(store, self._plan_state(store, params, state, where)) for params, store in self._states.values()]
        for store, writes in plans:
            store.write_many(writes)
        for k, v in settings.items():
            object.__setattr__(self, k, tuple(v) if isinstance(v, list) else v)
        self.groups = probe.groups
        # Without a compiled step yet, the state waits for the first one.
        self._pending = None if self._states else {"state": state}

    def save(self, path: str) -> None:
        """Writes settings and state to a safetensors file, atomically (after
        ``rlx.distributed.init()``: rank 0 writes, the other ranks wait for it).

        Example:
            >>> opt.save("opt.safetensors")
        """
        path = _check.path("save", path)
        sd = self.state_dict()
        tensors = []
        for pname, d in sd["state"].items():
            for slot, arr in d.items():
                dtype = {np.dtype(np.float64): "float64", np.dtype(np.int32): "int32"}.get(arr.dtype, "float32")
                tensors.append((f"{pname}.{slot}", dtype, list(arr.shape), np.ascontiguousarray(arr).reshape(-1)))
        meta = {"type": sd["type"], "settings": sd["settings"], "groups": sd["groups"]}
        from .. import distributed

        distributed._on_rank0(lambda: _rlx.save_checkpoint(str(path), tensors, {_META_KEY: json.dumps(meta)}))

    def load(self, path: str) -> None:
        """Restores a file written by ``save``; checked before anything changes.

        Example:
            >>> opt.load("opt.safetensors")
        """
        path = _check.path("load", path)
        tensors, metadata = _rlx.load_checkpoint_raw(str(path), 1 << 40)
        if _META_KEY not in metadata:
            raise CheckpointError(f"{path}: not an rlx optimizer checkpoint (no '{_META_KEY}' metadata)")
        try:
            meta = json.loads(metadata[_META_KEY])
        except ValueError as e:
            raise CheckpointError(f"{path}: bad optimizer metadata: {e}") from None
        if not isinstance(meta, dict):
            raise CheckpointError(f"{path}: bad optimizer metadata")
        state: dict[str, dict[str, np.ndarray]] = {}
        for name, dtype, shape, data in tensors:
            if "." not in name or dtype not in _STATE_NP:
                raise CheckpointError(f"{path}: unexpected tensor '{name}' ({dtype})")
            pname, slot = name.rsplit(".", 1)
            state.setdefault(pname, {})[slot] = np.frombuffer(data, dtype=np.dtype(dtype).newbyteorder("<")).reshape(shape)
        self.load_state_dict({"type": meta.get("type"), "settings": meta.get("settings", {}),
                              "groups": meta.get("groups", []), "state": state})

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={getattr(self, k)!r}" for k in self._settings)
        return f"{type(self).__name__}({args})"


# The dtypes of optimizer state: a float32 or float64 parameter's buffers, int32 counters.
_STATE_NP = {"float32": np.float32, "float64": np.float64, "int32": np.int32}


_INT32_MAX = 2**31 - 1


def _state_array(where: str, name: str, value: Any, want: Any) -> np.ndarray:
    """``value`` as a contiguous array of ``want`` (None: its own real dtype), a copy; a
    CheckpointError naming ``name`` for anything that is not real numbers, a counter that is not
    a whole number in the int32 range, or a finite value that float32 cannot hold."""
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError, OverflowError) as e:
        raise CheckpointError(f"{where}'{name}' is not an array of numbers: {e}") from None
    if arr.dtype.kind not in "iuf":
        raise CheckpointError(f"{where}'{name}' must hold real numbers, got dtype {arr.dtype}")
    if want is None:
        return np.array(arr)
    if want is np.int32:
        ok = np.isfinite(arr) & (arr == np.trunc(arr)) & (arr >= 0) & (arr <= _INT32_MAX)
        if not ok.all():
            bad = arr.reshape(-1)[~ok.reshape(-1)][0].item()
            raise CheckpointError(f"{where}'{name}' must be a whole number in [0, {_INT32_MAX}], got {bad!r}")
        return np.array(arr, dtype=np.int32)
    with np.errstate(over="ignore"):
        out = np.array(arr, dtype=want)
    lost = np.isinf(out) & np.isfinite(arr)
    if lost.any():
        bad = arr.reshape(-1)[lost.reshape(-1)][0].item()
        raise CheckpointError(f"{where}'{name}' holds {bad!r}, beyond the range of {np.dtype(want).name}")
    return out


def _read(store: Any, name: str, shape: list[int], dtype: str) -> np.ndarray:
    np_dtype = _STATE_NP[dtype]
    raw = store.view(name)
    if raw is None:
        # Device memory (CUDA): a read-only copy, since writes to it could not reach the device.
        return np.frombuffer(store.read(name), dtype=np_dtype).reshape(shape)
    return np.frombuffer(raw, dtype=np_dtype).reshape(shape)


class SGD(Optimizer):
    """Stochastic gradient descent, PyTorch's rule: ``d = g + wd*p``; with momentum
    ``buf = d`` on the first step, then ``momentum*buf + (1-dampening)*d``; Nesterov uses
    ``d + momentum*buf``, else ``buf``; ``p -= lr*d``. Momentum may be switched on later.

    Example:
        >>> opt = rlx.optim.SGD(lr=0.1, momentum=0.9, nesterov=True)
    """

    _rule = "sgd"
    _settings = {"lr": None, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False}

    def __init__(self, lr: float, momentum: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False,
                 dampening: float = 0.0, groups: list[dict[str, Any]] | None = None) -> None:
        super().__init__(groups, lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                         nesterov=nesterov)

    def _extra(self) -> list[str]:
        return ["started"]  # whether the momentum buffer holds a value yet (its first step copies d)


class Adam(Optimizer):
    """Adam (PyTorch's rule, bias-corrected; ``weight_decay`` is L2 added to the gradient).

    Example:
        >>> opt = rlx.optim.Adam(lr=1e-3, betas=(0.9, 0.999))
    """

    _rule = "adam"
    _settings = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}

    def __init__(self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, groups: list[dict[str, Any]] | None = None) -> None:
        super().__init__(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


class AdamW(Adam):
    """Adam with decoupled weight decay: ``p *= 1 - lr*wd`` before the Adam update.

    Example:
        >>> opt = rlx.optim.AdamW(lr=1e-3, weight_decay=0.1,
        ...                       groups=[{"params": ["*.bias"], "weight_decay": 0.0}])
    """

    _rule = "adamw"

    def __init__(self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, groups: list[dict[str, Any]] | None = None) -> None:
        super().__init__(lr, betas=betas, eps=eps, weight_decay=weight_decay, groups=groups)


class RMSprop(Optimizer):
    """RMSprop, PyTorch's rule (not centred): ``v = alpha*v + (1-alpha)*g^2``; with momentum
    ``buf = momentum*buf + g/(sqrt(v)+eps)``, ``p -= lr*buf``; else ``p -= lr*g/(sqrt(v)+eps)``.

    Example:
        >>> opt = rlx.optim.RMSprop(lr=1e-2, alpha=0.99)
    """

    _rule = "rmsprop"
    _settings = {"lr": 1e-2, "alpha": 0.99, "eps": 1e-8, "weight_decay": 0.0, "momentum": 0.0}

    def __init__(self, lr: float = 1e-2, alpha: float = 0.99, eps: float = 1e-8, weight_decay: float = 0.0,
                 momentum: float = 0.0, groups: list[dict[str, Any]] | None = None) -> None:
        super().__init__(groups, lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum)


class Adagrad(Optimizer):
    """Adagrad, PyTorch's rule: ``sum += g^2``; ``p -= lr/(1+(t-1)*lr_decay) * g/(sqrt(sum)+eps)``.

    Example:
        >>> opt = rlx.optim.Adagrad(lr=1e-2)
    """

    _rule = "adagrad"
    _settings = {"lr": 1e-2, "lr_decay": 0.0, "weight_decay": 0.0, "eps": 1e-10}

    def __init__(self, lr: float = 1e-2, lr_decay: float = 0.0, weight_decay: float = 0.0, eps: float = 1e-10,
                 groups: list[dict[str, Any]] | None = None) -> None:
        super().__init__(groups, lr=lr, lr_decay=lr_decay, weight_decay=weight_decay, eps=eps)


from . import lr_scheduler  # noqa: E402  (schedulers refer to the classes above)

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "lr_scheduler"]
