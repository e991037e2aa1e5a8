"""Data-parallel training across processes: the process group and the communicator seam.

Launch N processes (``mpirun -n N python train.py``), call :func:`init` in each, and compile the
step with ``compile_train_step(..., distributed=True)``: parameters are broadcast from rank 0 at
compile, and every step averages the gradients across ranks (one in-place all-reduce over the
arena's contiguous gradient region) before the update. N ranks with batch B each end with the
same weights, within float32 tolerance, as one process with the concatenated batch N·B.

The exchange goes through a :class:`Communicator`. :class:`MPICommunicator` (mpi4py, installed
by ``pip install "rlx[mpi]"``) is the one for CPU processes; an NCCL one for CUDA ranks is not
built yet (``init(backend="nccl")`` says so). A failure on one rank never leaves the others
hanging: an exception that reaches the top of a rank aborts the whole job, and a collective that
waits longer than ``RLX_DIST_TIMEOUT`` seconds (default 300) raises :class:`DistributedError`.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable, Protocol

import numpy as np

from .errors import DistributedError, InputError, RlxError, UnsupportedError

__all__ = ["Communicator", "DistributedError", "MPICommunicator", "barrier", "communicator", "init",
           "is_initialized", "local_rank", "rank", "world_size"]


class Communicator(Protocol):
    """What a data-parallel step needs from a process group. Arrays are numpy views of device
    memory the host can see (the arena's gradient region, parameters); every call is collective:
    every rank makes it, in the same order."""

    rank: int
    size: int
    local_rank: int
    local_size: int

    def allreduce_mean_(self, array: np.ndarray) -> None:
        """Replaces ``array`` (float32, contiguous) in place by its mean over the ranks."""

    def broadcast_(self, array: np.ndarray, root: int = 0) -> None:
        """Overwrites ``array`` in place with rank ``root``'s values."""

    def barrier(self) -> None:
        """Returns once every rank has called it."""


def _timeout() -> float:
    raw = os.environ.get("RLX_DIST_TIMEOUT", "300")
    try:
        t = float(raw)
    except ValueError:
        raise InputError(f"[distributed] RLX_DIST_TIMEOUT must be a number of seconds, got {raw!r}") from None
    if not t > 0:
        raise InputError(f"[distributed] RLX_DIST_TIMEOUT must be > 0, got {raw!r}")
    return t


class MPICommunicator:
    """The MPI process group (mpi4py's ``COMM_WORLD``). Collectives are non-blocking requests
    polled until done, so a rank that stopped calling is reported after ``RLX_DIST_TIMEOUT``
    seconds instead of hanging the others forever."""

    def __init__(self) -> None:
        try:
            from mpi4py import MPI
        except ImportError as e:
            raise UnsupportedError(
                '[distributed] the MPI backend needs mpi4py and an MPI library: pip install "rlx[mpi]" '
                f"({e})") from None
        self._mpi = MPI
        self._comm = MPI.COMM_WORLD
        self.rank = self._comm.Get_rank()
        self.size = self._comm.Get_size()
        node = self._comm.Split_type(MPI.COMM_TYPE_SHARED)
        self.local_rank, self.local_size = node.Get_rank(), node.Get_size()
        node.Free()

    def _wait(self, req: Any, what: str) -> None:
        deadline = time.monotonic() + _timeout()
        pause = 0.0
        while not req.Test():
            if time.monotonic() > deadline:
                raise DistributedError(
                    f"[distributed] {what} on rank {self.rank} of {self.size} did not complete within "
                    f"{_timeout():g} s (RLX_DIST_TIMEOUT): another rank died, raised or stopped calling")
            time.sleep(pause)
            pause = min(1e-3, pause + 2e-5)

    def allreduce_mean_(self, array: np.ndarray) -> None:
        if array.dtype != np.float32 or not array.flags.c_contiguous:
            raise InputError(f"[allreduce] needs a contiguous float32 array, got {array.dtype}")
        if self.size == 1:
            return
        self._wait(self._comm.Iallreduce(self._mpi.IN_PLACE, array, op=self._mpi.SUM), "all-reduce")
        array *= np.float32(1.0 / self.size)

    def broadcast_(self, array: np.ndarray, root: int = 0) -> None:
        if self.size == 1:
            return
        self._wait(self._comm.Ibcast(array, root=root), "broadcast")

    def barrier(self) -> None:
        if self.size > 1:
            self._wait(self._comm.Ibarrier(), "barrier")

    def abort(self, code: int = 1) -> None:
        self._comm.Abort(code)


_COMM: Communicator | None = None


def init(backend: str | None = None) -> Communicator:
    """Joins the process group the launcher set up and returns its communicator (calling it again
    returns the same one). ``backend``: ``"mpi"`` (the default for CPU processes); ``"nccl"`` is
    for CUDA ranks and not built yet.

    Also: unless ``RLX_NUM_THREADS`` is set, each rank's kernels use the cores available divided
    by the ranks on this host (call ``init`` before the first step for this to apply); and an
    exception that reaches the top of any rank aborts every rank (``MPI_Abort``) rather than leave
    them waiting.

    Example:
        >>> import rlx.distributed as dist
        >>> comm = dist.init()              # under: mpirun -n 2 python train.py
        >>> dist.rank(), dist.world_size()
        (0, 2)
    """
    global _COMM
    if backend not in (None, "mpi", "nccl"):
        raise InputError(f"[distributed] unknown backend {backend!r}; use 'mpi' (CPU) or 'nccl' (CUDA)")
    if backend == "nccl":
        raise UnsupportedError("[distributed] the NCCL backend (CUDA ranks) is not built yet; use backend='mpi'")
    if _COMM is not None:
        return _COMM
    comm = MPICommunicator()
    if "RLX_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        os.environ["RLX_NUM_THREADS"] = str(max(1, cores // max(1, comm.local_size)))
    if comm.size > 1:
        previous = sys.excepthook

        def abort_all(kind: Any, value: Any, tb: Any) -> None:
            previous(kind, value, tb)
            sys.stderr.write(f"rlx.distributed: rank {comm.rank} raised {kind.__name__}; aborting every rank\n")
            sys.stderr.flush()
            comm.abort(1)

        sys.excepthook = abort_all
    _COMM = comm
    return comm


def is_initialized() -> bool:
    """Whether :func:`init` has been called in this process."""
    return _COMM is not None


def communicator() -> Communicator:
    """The communicator :func:`init` returned; raises ``RlxError`` before ``init``."""
    if _COMM is None:
        raise RlxError("[distributed] call rlx.distributed.init() first (and launch with mpirun -n N)")
    return _COMM


def rank() -> int:
    """This process's rank (0 when :func:`init` was not called)."""
    return _COMM.rank if _COMM is not None else 0


def world_size() -> int:
    """The number of ranks (1 when :func:`init` was not called)."""
    return _COMM.size if _COMM is not None else 1


def local_rank() -> int:
    """This process's rank among the ranks on its host (0 when :func:`init` was not called)."""
    return _COMM.local_rank if _COMM is not None else 0


def barrier() -> None:
    """Waits until every rank calls it (no-op before :func:`init`)."""
    if _COMM is not None:
        _COMM.barrier()



def _on_rank0(write: Callable[[], None]) -> None:
    """Calls ``write`` (a file write) on rank 0 only; every rank returns once it is done."""
    if _COMM is None or _COMM.size == 1:
        write()
        return
    try:
        if _COMM.rank == 0:
            write()
    finally:
        _COMM.barrier()
