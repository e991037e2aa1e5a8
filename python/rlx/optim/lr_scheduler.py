"""Learning-rate schedulers with PyTorch's formulas (the same recursive updates, so the values
match ``torch.optim.lr_scheduler`` to the last bit in float64). ``.step()`` after each training
step sets ``optimizer.lr`` (and the ``lr`` of parameter groups that set their own)."""

from __future__ import annotations

import math
from bisect import bisect_right
from typing import Any, Mapping, Sequence

import numpy as np

from .. import _check
from ..errors import CheckpointError, InputError


class _Holder:
    """One place a learning rate lives: the optimizer's own settings, or a group that overrides."""

    def __init__(self, opt: Any, group: dict[str, Any] | None, key: Any) -> None:
        self.opt, self.group, self.key = opt, group, key

    def get(self, name: str) -> Any:
        if self.group is not None and name in self.group:
            return self.group[name]
        return getattr(self.opt, name)

    def set(self, name: str, value: Any) -> None:
        if self.group is None:
            setattr(self.opt, name, value)
        else:
            self.group[name] = value


def _holders(opt: Any) -> list[_Holder]:
    from . import Optimizer

    if not isinstance(opt, Optimizer):
        raise InputError(f"[lr_scheduler] needs an rlx.optim optimizer, got {type(opt).__name__}")
    out = [_Holder(opt, None, None)]
    for i, g in enumerate(opt.groups):
        if isinstance(g, dict) and "lr" in g:
            out.append(_Holder(opt, g, i))
    return out


class LRScheduler:
    """Base class: ``step()`` advances ``last_epoch`` and sets the learning rates.

    Example:
        >>> sched = rlx.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
        >>> for epoch in range(3):
        ...     sched.step()
    """

    def __init__(self, optimizer: Any, last_epoch: int = -1) -> None:
        self.optimizer = optimizer
        holders = _holders(optimizer)
        if last_epoch == -1:
            for h in holders:
                optimizer._initial_lrs.setdefault(h.key, h.get("lr"))
        self.base_lrs = [optimizer._initial_lrs.get(h.key, h.get("lr")) for h in holders]
        self.last_epoch = last_epoch
        self._is_initial = False
        self._initial_step()

    def _holders(self) -> list[_Holder]:
        return _holders(self.optimizer)

    def _lrs(self) -> list[float]:
        return [h.get("lr") for h in self._holders()]

    def _initial_step(self) -> None:
        self._step_count = 0
        self._is_initial = True
        try:
            self.step()
        finally:
            self._is_initial = False

    def get_lr(self) -> list[float]:
        """The learning rates for the current ``last_epoch`` (PyTorch's recursive form).

        Example:
            >>> sched.get_lr()
        """
        raise NotImplementedError

    def step(self) -> None:
        """Advances one step and sets the optimizer's learning rates.

        Example:
            >>> for epoch in range(10):
            ...     train_one_epoch()
            ...     sched.step()
        """
        self._step_count += 1
        self._update_lr(None)

    def _update_lr(self, epoch: int | None) -> None:
        if epoch is None:
            self.last_epoch += 1
            values = self.get_lr()
        else:
            self.last_epoch = epoch
            closed = getattr(self, "_get_closed_form_lr", None)
            values = closed() if closed is not None else self.get_lr()
        for h, lr in zip(self._holders(), values):
            h.set("lr", lr)
        self._last_lr = self._lrs()

    def get_last_lr(self) -> list[float]:
        """The learning rates set by the last ``step()``, one per holder (the optimizer's own
        first, then each group that sets ``lr``).

        Example:
            >>> sched.get_last_lr()[0] == opt.lr
            True
        """
        return list(self._last_lr)

    def state_dict(self) -> dict[str, Any]:
        """Everything but the optimizer, to resume the schedule.

        Example:
            >>> saved = sched.state_dict()
        """
        return {k: v for k, v in self.__dict__.items() if k != "optimizer"}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores ``state_dict()`` (of a scheduler of this kind on this optimizer). Everything is
        checked before anything changes (``CheckpointError``).

        Example:
            >>> sched.load_state_dict(saved)
        """
        self._restore(self._checked_state(state_dict))

    def _checked_state(self, state_dict: Any) -> dict[str, Any]:
        """A checked copy of ``state_dict``: the keys of this scheduler's ``state_dict()``, each
        value shaped like the current one."""
        where = f"[{type(self).__name__} state] "
        if not isinstance(state_dict, Mapping):
            raise CheckpointError(f"{where}expects a dict from {type(self).__name__}.state_dict(), "
                                  f"got {type(state_dict).__name__}")
        mine = self.state_dict()
        unknown = sorted(map(repr, set(state_dict) - set(mine)))
        missing = sorted(set(mine) - set(state_dict))
        if unknown or missing:
            parts = ([f"unknown keys [{', '.join(unknown)}]"] if unknown else []) + (
                [f"missing keys {missing}"] if missing else [])
            raise CheckpointError(f"{where}does not match {type(self).__name__}.state_dict(): {'; '.join(parts)}")
        return {k: self._check_value(where, k, mine[k], state_dict[k]) for k in mine}

    def _check_value(self, where: str, key: str, cur: Any, new: Any) -> Any:
        return _like(where, key, cur, new)

    def _restore(self, checked: dict[str, Any]) -> None:
        self.__dict__.update(checked)


class StepLR(LRScheduler):
    """Multiplies the learning rate by ``gamma`` every ``step_size`` steps.

    Example:
        >>> sched = rlx.optim.lr_scheduler.StepLR(opt, step_size=30, gamma=0.1)
    """

    def __init__(self, optimizer: Any, step_size: int, gamma: float = 0.1, last_epoch: int = -1) -> None:
        self.step_size = _check.integer("StepLR", "step_size", step_size, lo=1)
        self.gamma = _check.number("StepLR", "gamma", gamma, lo=0.0)
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        if self.last_epoch == 0 or self.last_epoch % self.step_size != 0:
            return self._lrs()
        return [lr * self.gamma for lr in self._lrs()]

    def _get_closed_form_lr(self) -> list[float]:
        return [b * self.gamma ** (self.last_epoch // self.step_size) for b in self.base_lrs]


class CosineAnnealingLR(LRScheduler):
    """Cosine annealing from the initial learning rate to ``eta_min`` over ``T_max`` steps.

    Example:
        >>> sched = rlx.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)
    """

    def __init__(self, optimizer: Any, T_max: int, eta_min: float = 0.0, last_epoch: int = -1) -> None:
        self.T_max = _check.integer("CosineAnnealingLR", "T_max", T_max, lo=1)
        self.eta_min = _check.number("CosineAnnealingLR", "eta_min", eta_min, lo=0.0)
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        e, t, lo = self.last_epoch, self.T_max, self.eta_min
        if self._is_initial:
            return self._lrs()
        if self._step_count == 1 and e > 0:
            return [lo + (b - lo) * (1 + math.cos(e * math.pi / t)) / 2 for b in self.base_lrs]
        if (e - 1 - t) % (2 * t) == 0:
            return [lr + (b - lo) * (1 - math.cos(math.pi / t)) / 2 for b, lr in zip(self.base_lrs, self._lrs())]
        return [(1 + math.cos(math.pi * e / t)) / (1 + math.cos(math.pi * (e - 1) / t)) * (lr - lo) + lo
                for lr in self._lrs()]

    def _get_closed_form_lr(self) -> list[float]:
        lo = self.eta_min
        return [lo + (b - lo) * (1 + math.cos(math.pi * self.last_epoch / self.T_max)) / 2 for b in self.base_lrs]


class LinearLR(LRScheduler):
    """Scales the learning rate linearly from ``start_factor`` to ``end_factor`` over
    ``total_iters`` steps, then keeps it.

    Example:
        >>> sched = rlx.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=10)
    """

    def __init__(self, optimizer: Any, start_factor: float = 1.0 / 3, end_factor: float = 1.0, total_iters: int = 5,
                 last_epoch: int = -1) -> None:
        self.start_factor = _check.number("LinearLR", "start_factor", start_factor, lo=0.0, hi=1.0)
        if self.start_factor == 0.0:
            raise InputError("[LinearLR] start_factor must be in (0, 1], got 0.0")
        self.end_factor = _check.number("LinearLR", "end_factor", end_factor, lo=0.0, hi=1.0)
        self.total_iters = _check.integer("LinearLR", "total_iters", total_iters, lo=1)
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        if self.last_epoch == 0:
            return [lr * self.start_factor for lr in self._lrs()]
        if self._is_initial or self.last_epoch > self.total_iters:
            return self._lrs()
        s, e, n = self.start_factor, self.end_factor, self.total_iters
        return [lr * (1.0 + (e - s) / (n * s + (self.last_epoch - 1) * (e - s))) for lr in self._lrs()]

    def _get_closed_form_lr(self) -> list[float]:
        s, e, n = self.start_factor, self.end_factor, self.total_iters
        return [b * (s + (e - s) * min(n, self.last_epoch) / n) for b in self.base_lrs]


class OneCycleLR(LRScheduler):
    """The 1cycle policy (PyTorch's ``OneCycleLR``): warm up from ``max_lr/div_factor`` to
    ``max_lr`` over ``pct_start`` of ``total_steps``, then anneal to
    ``initial/final_div_factor``; momentum (or Adam's beta1) cycles inversely.

    Example:
        >>> sched = rlx.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=1000)
    """

    def __init__(self, optimizer: Any, max_lr: float | Sequence[float], total_steps: int | None = None,
                 epochs: int | None = None, steps_per_epoch: int | None = None, pct_start: float = 0.3,
                 anneal_strategy: str = "cos", cycle_momentum: bool = True, base_momentum: float = 0.85,
                 max_momentum: float = 0.95, div_factor: float = 25.0, final_div_factor: float = 1e4,
                 three_phase: bool = False, last_epoch: int = -1) -> None:
        w = "OneCycleLR"
        if total_steps is not None:
            self.total_steps = _check.integer(w, "total_steps", total_steps, lo=1)
        elif epochs is not None and steps_per_epoch is not None:
            self.total_steps = _check.integer(w, "epochs", epochs, lo=1) * _check.integer(
                w, "steps_per_epoch", steps_per_epoch, lo=1)
        else:
            raise InputError("[OneCycleLR] give total_steps, or epochs and steps_per_epoch")
        pct_start = _check.number(w, "pct_start", pct_start, lo=0.0, hi=1.0)
        if anneal_strategy not in ("cos", "linear"):
            raise InputError(f"[OneCycleLR] anneal_strategy must be 'cos' or 'linear', got {anneal_strategy!r}")
        self._anneal = self._cos if anneal_strategy == "cos" else self._linear
        n = self.total_steps
        if three_phase:
            self._phases = [
                (float(pct_start * n) - 1, "initial_lr", "max_lr", "max_momentum", "base_momentum"),
                (float(2 * pct_start * n) - 2, "max_lr", "initial_lr", "base_momentum", "max_momentum"),
                (n - 1, "initial_lr", "min_lr", "max_momentum", "max_momentum"),
            ]
        else:
            self._phases = [
                (float(pct_start * n) - 1, "initial_lr", "max_lr", "max_momentum", "base_momentum"),
                (n - 1, "max_lr", "min_lr", "base_momentum", "max_momentum"),
            ]
        holders = _holders(optimizer)
        max_lrs = list(max_lr) if isinstance(max_lr, (list, tuple)) else [max_lr] * len(holders)
        if len(max_lrs) != len(holders):
            raise InputError(f"[OneCycleLR] expected {len(holders)} max_lr values, got {len(max_lrs)}")
        self._values = []
        for h, m in zip(holders, max_lrs):
            m = _check.number(w, "max_lr", m, lo=0.0)
            initial = m / _check.number(w, "div_factor", div_factor, lo=0.0)
            vals = {"initial_lr": initial, "max_lr": m, "min_lr": initial / _check.number(
                w, "final_div_factor", final_div_factor, lo=0.0)}
            if last_epoch == -1:
                optimizer._initial_lrs[h.key] = initial
            self._values.append(vals)
        self.cycle_momentum = bool(cycle_momentum)
        if self.cycle_momentum:
            self._use_beta1 = "betas" in type(optimizer)._settings
            if not self._use_beta1 and "momentum" not in type(optimizer)._settings:
                raise InputError("[OneCycleLR] optimizer must support momentum or beta1 with `cycle_momentum` option enabled")
            for h, vals in zip(holders, self._values):
                vals["max_momentum"], vals["base_momentum"] = max_momentum, base_momentum
                if last_epoch == -1:
                    self._set_momentum(h, max_momentum)
        super().__init__(optimizer, last_epoch)

    @staticmethod
    def _cos(start: float, end: float, pct: float) -> float:
        return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)

    @staticmethod
    def _linear(start: float, end: float, pct: float) -> float:
        return (end - start) * pct + start

    def _set_momentum(self, h: _Holder, m: float) -> None:
        if self._use_beta1:
            h.set("betas", (m, *h.get("betas")[1:]))
        else:
            h.set("momentum", m)

    def get_lr(self) -> list[float]:
        step = self.last_epoch
        if step > self.total_steps:
            raise InputError(f"[OneCycleLR] tried to step {step} times; total_steps is {self.total_steps}")
        lrs = []
        for h, vals in zip(self._holders(), self._values):
            start = 0.0
            for i, (end, lr0, lr1, m0, m1) in enumerate(self._phases):
                if step <= end or i == len(self._phases) - 1:
                    pct = (step - start) / (end - start)
                    lr = self._anneal(vals[lr0], vals[lr1], pct)
                    if self.cycle_momentum:
                        self._set_momentum(h, self._anneal(vals[m0], vals[m1], pct))
                    break
                start = end
            lrs.append(lr)
        return lrs


class SequentialLR(LRScheduler):
    """Runs ``schedulers`` one after another, switching at the ``milestones`` steps.

    Example:
        >>> warm = rlx.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=5)
        >>> cos = rlx.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=95)
        >>> sched = rlx.optim.lr_scheduler.SequentialLR(opt, [warm, cos], milestones=[5])
    """

    def __init__(self, optimizer: Any, schedulers: Sequence[LRScheduler], milestones: Sequence[int],
                 last_epoch: int = -1) -> None:
        schedulers = list(schedulers)
        if not schedulers:
            raise InputError("[SequentialLR] needs at least one scheduler")
        for i, s in enumerate(schedulers):
            if not isinstance(s, LRScheduler) or s.optimizer is not optimizer:
                raise InputError(f"[SequentialLR] scheduler {i} does not belong to this optimizer")
        milestones = [_check.integer("SequentialLR", "milestone", m, lo=0) for m in milestones]
        if len(milestones) != len(schedulers) - 1:
            raise InputError(f"[SequentialLR] needs one milestone fewer than schedulers: {len(schedulers)} schedulers, "
                             f"{len(milestones)} milestones")
        self._schedulers, self._milestones = schedulers, milestones
        self.last_epoch = last_epoch + 1
        self.optimizer = optimizer
        for h in _holders(optimizer):
            h.set("lr", optimizer._initial_lrs.get(h.key, h.get("lr")))
        for s in schedulers:
            _undo(s)
        idx = bisect_right(milestones, 0)
        schedulers[idx]._initial_step()
        self._last_lr = schedulers[idx].get_last_lr()

    def step(self) -> None:
        self.last_epoch += 1
        idx = bisect_right(self._milestones, self.last_epoch)
        s = self._schedulers[idx]
        if idx > 0 and self._milestones[idx - 1] == self.last_epoch:
            s._update_lr(0)
        else:
            s.step()
        self._last_lr = s.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k not in ("optimizer", "_schedulers")}
        d["_schedulers"] = [s.state_dict() for s in self._schedulers]
        return d

    def _check_value(self, where: str, key: str, cur: Any, new: Any) -> Any:
        if key != "_schedulers":
            return super()._check_value(where, key, cur, new)
        if not isinstance(new, (list, tuple)) or len(new) != len(self._schedulers):
            raise CheckpointError(f"{where}'_schedulers' must be a list of {len(self._schedulers)} scheduler states, "
                                  f"got {type(new).__name__} {new!r:.80}")
        return [s._checked_state(sd) for s, sd in zip(self._schedulers, new)]

    def _restore(self, checked: dict[str, Any]) -> None:
        d = dict(checked)
        subs = d.pop("_schedulers")
        self.__dict__.update(d)
        for s, sd in zip(self._schedulers, subs):
            s._restore(sd)


# Counters and step numbers in schedulers' state, with their least value (the rest are real numbers).
_INT_MIN = {"last_epoch": -1, "_step_count": 0, "step_size": 1, "T_max": 1, "total_iters": 1, "total_steps": 1,
            "_milestones": 0}


def _like(where: str, key: str, cur: Any, new: Any) -> Any:
    """A copy of loaded value ``new`` of state ``key``, checked to be shaped like ``cur``."""
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{where}'{key}' must be {what}, got {type(new).__name__} {new!r:.80}")

    is_bool = isinstance(new, (bool, np.bool_))
    if isinstance(cur, bool):
        if not is_bool:
            raise bad("True or False")
        return bool(new)
    if isinstance(cur, (int, float)):
        if key in _INT_MIN:
            if is_bool or not isinstance(new, (int, np.integer)) or new < _INT_MIN[key]:
                raise bad(f"an int >= {_INT_MIN[key]}")
            return int(new)
        if is_bool or not isinstance(new, (int, float, np.integer, np.floating)) or not math.isfinite(new):
            raise bad("a finite number")
        return float(new) if isinstance(new, (float, np.floating)) else int(new)
    if isinstance(cur, (list, tuple)):
        if not isinstance(new, (list, tuple)) or len(new) != len(cur):
            raise bad(f"a list of {len(cur)}")
        return type(cur)(_like(where, key, c, n) for c, n in zip(cur, new))
    if isinstance(cur, dict):
        if not isinstance(new, Mapping) or set(new) != set(cur):
            raise bad(f"a dict with keys {sorted(cur)}")
        return {k: _like(where, key, cur[k], new[k]) for k in cur}
    if isinstance(cur, str) and not isinstance(new, str):
        raise bad("a str")
    if callable(cur) and not callable(new):
        raise bad("a function")
    return new


def _undo(s: LRScheduler) -> None:
    if isinstance(s, SequentialLR):
        for sub in s._schedulers:
            _undo(sub)
    else:
        s.last_epoch -= 1


__all__ = ["LRScheduler", "StepLR", "CosineAnnealingLR", "LinearLR", "OneCycleLR", "SequentialLR"]
