"""rlx's random number source: ``rlx.seed(n)`` makes initialisation deterministic."""

from __future__ import annotations

import numpy as np

from ._check import integer

_rng = np.random.default_rng()


def seed(n: int) -> None:
    """Seeds every random choice rlx makes (parameter initialisation).

    Example:
        >>> rlx.seed(0)
        >>> a = rlx.nn.Linear(4, 2).state_dict()
        >>> rlx.seed(0)
        >>> b = rlx.nn.Linear(4, 2).state_dict()   # the same values as a
    """
    global _rng
    _rng = np.random.default_rng(integer("seed", "n", n, lo=0))


def rng() -> np.random.Generator:
    return _rng
