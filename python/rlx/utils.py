"""Small helpers for scripts: a dependency-free progress bar."""

from __future__ import annotations

import sys
import time
from typing import Iterable, Iterator, TypeVar

T = TypeVar("T")


class progress:
    """Wraps an iterable and draws ``desc [####----] k/n  key=value  it/s`` on stderr (nothing with
    ``disable=True``, e.g. on every rank but 0 of a distributed run). Where stderr is not a
    terminal (a log file, CI) only the final line of each pass is written."""

    def __init__(self, iterable: Iterable[T], total: int | None = None, desc: str = "", width: int = 30,
                 disable: bool = False) -> None:
        self._it = iterable
        self.total = total if total is not None else (len(iterable) if hasattr(iterable, "__len__") else None)  # type: ignore[arg-type]
        self.desc, self.width, self.n = desc, width, 0
        self._post = ""
        self._t0 = time.perf_counter()
        self._last = 0.0
        self.disable = disable
        self._tty = hasattr(sys.stderr, "isatty") and sys.stderr.isatty()

    def set_postfix(self, **values: float) -> None:
        self._post = "  ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items())

    def _draw(self, final: bool = False) -> None:
        if self.disable:
            return
        now = time.perf_counter()
        if not final and (not self._tty or now - self._last < 0.1):
            return
        self._last = now
        rate = self.n / max(now - self._t0, 1e-9)
        if self.total:
            filled = int(self.width * self.n / self.total)
            bar = f"[{'#' * filled}{'-' * (self.width - filled)}] {self.n}/{self.total}"
        else:
            bar = f"{self.n}"
        back = "\r" if self._tty else ""  # redraw in place on a terminal
        sys.stderr.write(f"{back}{self.desc} {bar}  {self._post}  {rate:,.0f} it/s ")
        if final:
            sys.stderr.write("\n")
        sys.stderr.flush()

    def __iter__(self) -> Iterator[T]:
        for item in self._it:  # type: ignore[attr-defined]
            yield item
            self.n += 1
            self._draw()
        self._draw(final=True)
