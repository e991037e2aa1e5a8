"""Optimizers with PyTorch's update rules. Their state lives on the device beside the weights and
is updated in place inside the training step; ``lr`` (and the other settings) may change between
steps."""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _check, _rlx
from .errors import InputError, RlxError


class Optimizer:
    _rule = ""

    def __init__(self, lr: float, momentum: float = 0.0, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
        self.lr, self.momentum, self.weight_decay, self.betas, self.eps = lr, momentum, weight_decay, betas, eps
        self._hyper()
        self._states: dict[int, tuple[Any, Any]] = {}  # id(weight store) -> (weight store, state store)
        self._current: Any = None

    def _rule_name(self) -> str:
        return self._rule

    def _hyper(self) -> tuple[float, float, float, float, float, float]:
        """The settings, checked (they may have been changed since construction); the check is
        skipped while they equal, type for type, the settings last checked."""
        b = self.betas
        raw = (self.lr, self.momentum, self.weight_decay, self.eps, *(b if isinstance(b, (tuple, list)) else (b,)))
        cached = self.__dict__.get("_checked")
        if cached is not None and len(cached[0]) == len(raw) and all(
            type(x) is type(y) and x == y for x, y in zip(cached[0], raw)
        ):
            return cached[1]
        where = type(self).__name__
        betas = self.betas
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise InputError(f"[{where}] betas must be a pair (beta1, beta2), got {betas!r}")
        hyper = (
            _check.number(where, "lr", self.lr, lo=0.0),
            _check.number(where, "momentum", self.momentum, lo=0.0),
            _check.number(where, "weight_decay", self.weight_decay, lo=0.0),
            _check.number(where, "beta1", betas[0], lo=0.0, hi=1.0, hi_open=True),
            _check.number(where, "beta2", betas[1], lo=0.0, hi=1.0, hi_open=True),
            _check.number(where, "eps", self.eps, lo=0.0),
        )
        self._checked = (raw, hyper)
        return hyper

    def _state_for(self, params: Any) -> Any:
        """This optimizer's state store for the weight store ``params`` (made once, then shared)."""
        entry = self._states.get(id(params))
        if entry is None or entry[0] is not params:
            entry = (params, _rlx.Store.for_optimizer(self._rule_name(), params))
            self._states[id(params)] = entry
        self._current = entry[1]
        self._param_names = {n for n, _, _ in params.entries()}
        return entry[1]

    def state(self, name: str) -> dict[str, np.ndarray]:
        """The state buffers of parameter ``name`` (views where the host can see the memory)."""
        if self._current is None:
            raise RlxError(f"[{type(self).__name__}] has no state until a training step is compiled with it")
        store = self._current
        entries = {n: (s, d) for n, s, d in store.entries()}
        if not isinstance(name, str) or name not in self._param_names:
            raise InputError(f"[{type(self).__name__}] no parameter named {name!r}")
        out = {key: _read(store, f"{name}.{key}", *entries[f"{name}.{key}"]) for key in self._slots()}
        if self._slots():
            out["step"] = _read(store, "step", *entries["step"])
        return out

    def _slots(self) -> list[str]:
        return _rlx.optimizer_slots(self._rule_name()) if self._rule else []

    def __repr__(self) -> str:
        return f"{type(self).__name__}(lr={self.lr})"


def _read(store: Any, name: str, shape: list[int], dtype: str) -> np.ndarray:
    np_dtype = np.float32 if dtype == "float32" else np.int32
    raw = store.view(name)
    if raw is None:
        return np.frombuffer(store.read(name), dtype=np_dtype).reshape(shape).copy()
    return np.frombuffer(raw, dtype=np_dtype).reshape(shape)


class SGD(Optimizer):
    """Stochastic gradient descent with optional momentum and L2 weight decay (PyTorch's rule:
    ``d = g + wd*p``; ``buf = d`` on the first step, then ``momentum*buf + d``; ``p -= lr*buf``)."""

    def __init__(self, lr: float, momentum: float = 0.0, weight_decay: float = 0.0) -> None:
        super().__init__(lr, momentum=momentum, weight_decay=weight_decay)
        self._rule = "sgd_momentum" if momentum else "sgd"

    def _rule_name(self) -> str:
        if (self.momentum != 0.0) != (self._rule == "sgd_momentum"):
            raise RlxError("[SGD] momentum cannot be switched on or off after construction")
        return self._rule


class Adam(Optimizer):
    """Adam (PyTorch's rule, bias-corrected)."""

    _rule = "adam"

    def __init__(self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0) -> None:
        super().__init__(lr, betas=betas, eps=eps, weight_decay=weight_decay)


class AdamW(Adam):
    """Adam with decoupled weight decay: ``p *= 1 - lr*wd`` before the Adam update."""

    _rule = "adamw"

    def __init__(self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01) -> None:
        super().__init__(lr, betas=betas, eps=eps, weight_decay=weight_decay)


__all__ = ["Optimizer", "SGD", "Adam", "AdamW"]
