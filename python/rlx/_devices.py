"""Which devices this build of rlx can run on."""

from __future__ import annotations

from . import _rlx


def devices() -> list[str]:
    """The devices that can run here: always ``"cpu"``; ``"cuda"`` / ``"metal"`` when that
    backend is compiled in and a device is present. Any ``device=`` argument takes one of these
    (``"cuda:N"`` for the N-th GPU).

    Example:
        >>> rlx.devices()
        ['cpu']
    """
    return list(_rlx.devices())
