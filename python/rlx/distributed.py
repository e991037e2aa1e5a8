"""Data-parallel training across processes: the process group and the communicator seam.

Launch N processes (``mpirun -n N python train.py``), call :func:`init` in each, and compile the
step with ``compile_train_step(..., distributed=True)``: parameters are broadcast from rank 0 at
compile, and every step averages the gradients across ranks (one in-place all-reduce over the
arena's contiguous gradient region) before the update. N ranks with batch B each end with the
same weights, within float32 tolerance, as one process with the concatenated batch N·B.

The exchange goes through a :class:`Communicator`. :class:`MPICommunicator` (mpi4py, installed
by ``pip install "rlx[mpi]"``) is the one for CPU processes. CUDA ranks use
:class:`NCCLCommunicator` (``init(backend="nccl")``, one process per GPU, rank r on
``cuda:<local rank>``): the gradients are averaged by an NCCL all-reduce over the arena's gradient
region and the weights broadcast over the weight store, both on the GPU, ordered on rlx's compute
stream; MPI only bootstraps the group (the NCCL id, the model check). A failure on one rank never
leaves the others hanging: an exception that reaches the top of a rank aborts the whole job, and
a collective that waits longer than ``RLX_DIST_TIMEOUT`` seconds (default 300) raises
:class:`DistributedError` (NCCL's is aborted and raises ``DeviceError``).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable, Protocol

import numpy as np

from .errors import DistributedError, InputError, RlxError, UnsupportedError

__all__ = ["Communicator", "DistributedError", "MPICommunicator", "NCCLCommunicator", "barrier", "communicator",
           "init", "is_initialized", "local_rank", "rank", "world_size"]


class Communicator(Protocol):
    """What a data-parallel step needs from a process group. Arrays are numpy views of device
    memory the host can see (the arena's gradient region, parameters); every call is collective:
    every rank makes it, in the same order.

    Example:
        >>> comm = rlx.distributed.init()          # under mpirun -n 2
        >>> comm.allreduce_mean_(grads)            # every rank now holds the mean
    """

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
    seconds instead of hanging the others forever.

    Example:
        >>> comm = rlx.distributed.init("mpi")     # mpirun -n 2 python train.py
        >>> comm.rank, comm.size
        (0, 2)
    """

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
        """Replaces ``array`` (float32, contiguous) in place by its mean over the ranks."""
        if array.dtype != np.float32 or not array.flags.c_contiguous:
            raise InputError(f"[allreduce] needs a contiguous float32 array, got {array.dtype}")
        if self.size == 1:
            return
        self._wait(self._comm.Iallreduce(self._mpi.IN_PLACE, array, op=self._mpi.SUM), "all-reduce")
        array *= np.float32(1.0 / self.size)

    def broadcast_(self, array: np.ndarray, root: int = 0) -> None:
        """Overwrites ``array`` in place with rank ``root``'s values."""
        if self.size == 1:
            return
        self._wait(self._comm.Ibcast(array, root=root), "broadcast")

    def barrier(self) -> None:
        """Returns once every rank has called it."""
        if self.size > 1:
            self._wait(self._comm.Ibarrier(), "barrier")

    def abort(self, code: int = 1) -> None:
        """Ends every rank of the job with exit ``code`` (after an error on one rank, so the others
        do not wait for it)."""
        self._comm.Abort(code)


class _SoloCommunicator:
    """A group of one process (no launcher): every collective is a no-op. Bootstraps a
    one-rank NCCL group where mpi4py is absent."""

    rank, size, local_rank, local_size = 0, 1, 0, 1

    def allreduce_mean_(self, array: np.ndarray) -> None:
        if array.dtype != np.float32 or not array.flags.c_contiguous:
            raise InputError(f"[allreduce] needs a contiguous float32 array, got {array.dtype}")

    def broadcast_(self, array: np.ndarray, root: int = 0) -> None:
        pass

    def barrier(self) -> None:
        pass

    def abort(self, code: int = 1) -> None:
        os._exit(code)


_LAUNCHER_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS", "WORLD_SIZE",
                       "SLURM_NTASKS", "SLURM_NPROCS")


def _host_group() -> Any:
    """The host-side group that bootstraps NCCL: MPI where mpi4py is installed, else (only for a
    single process, no launcher) a group of one."""
    try:
        return MPICommunicator()
    except UnsupportedError:
        launched = [v for v in _LAUNCHER_SIZE_VARS if os.environ.get(v, "1") not in ("", "1")]
        if launched:
            raise UnsupportedError(
                f"[distributed] backend='nccl' with several ranks ({launched[0]}={os.environ[launched[0]]}) "
                'bootstraps through MPI: pip install "rlx[mpi]" and launch with mpirun -n N') from None
        return _SoloCommunicator()


class NCCLCommunicator:
    """CUDA ranks, one process per GPU: rank r computes on ``cuda:<local rank>``
    (:attr:`device`), a step's gradients are averaged by an NCCL all-reduce in place over the
    arena's gradient region and rank 0's weights are broadcast over the weight store, both on
    the GPU, stream-ordered with the step (no copy through the host). The host group (MPI, or a
    group of one) makes the NCCL unique id known to every rank and carries the small host-side
    collectives (the model check at compile).

    Example:
        >>> comm = rlx.distributed.init("nccl")    # mpirun -n 2, one GPU per rank
        >>> comm.device
        'cuda:0'
    """

    def __init__(self, host: Any | None = None) -> None:
        from . import _rlx

        why = _rlx.nccl_unavailable()
        if why is not None:
            raise UnsupportedError(f"[distributed] the NCCL backend is not available here: {why}")
        self._host = host if host is not None else _host_group()
        self.rank, self.size = self._host.rank, self._host.size
        self.local_rank, self.local_size = self._host.local_rank, self._host.local_size
        self.device = f"cuda:{self.local_rank}"
        _rlx.check_device(self.device)
        uid = np.frombuffer(_rlx.nccl_unique_id(), dtype=np.uint8).copy() if self.rank == 0 \
            else np.zeros(128, np.uint8)
        self._host.broadcast_(uid)
        try:
            self._nccl = _rlx.NcclComm(uid.tobytes(), self.size, self.rank, self.local_rank, _timeout())
        except BaseException:
            # The other ranks wait inside NCCL's rendezvous, which has no timeout: end the job.
            if self.size > 1:
                self._host.abort(1)
            raise

    def allreduce_mean_(self, array: np.ndarray) -> None:
        """Replaces ``array`` (float32, contiguous) in place by its mean over the ranks (a host array, through
        the host group)."""
        self._host.allreduce_mean_(array)

    def broadcast_(self, array: np.ndarray, root: int = 0) -> None:
        """Overwrites ``array`` in place with rank ``root``'s values (a host array, through the
        host group)."""
        self._host.broadcast_(array, root)

    def barrier(self) -> None:
        """Returns once every rank has called it."""
        self._host.barrier()

    def abort(self, code: int = 1) -> None:
        """Ends every rank of the job with exit ``code`` (after an error on one rank, so the others
        do not wait for it)."""
        self._host.abort(code)

    def allreduce_grads_(self, exe: Any) -> None:
        """Averages the gradient region of a data-parallel executable over the ranks, on the GPU."""
        self._nccl.allreduce_grads(exe)

    def broadcast_store_(self, store: Any, root: int = 0) -> None:
        """Overwrites a weight store (every tensor) with rank ``root``'s, on the GPU."""
        self._nccl.broadcast_store(store, root)


_COMM: Communicator | None = None


def init(backend: str | None = None) -> Communicator:
    """Joins the process group the launcher set up and returns its communicator (calling it again
    returns the same one). ``backend``: ``"mpi"`` (the default for CPU processes); ``"nccl"`` for
    CUDA ranks (one process per GPU; compile with ``device=comm.device``; launched by mpirun, or a
    single process without a launcher).

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
    if _COMM is not None:
        nccl = isinstance(_COMM, NCCLCommunicator)
        if backend is not None and (backend == "nccl") != nccl:
            raise InputError(f"[distributed] init() already joined the {'NCCL' if nccl else 'MPI'} group; "
                             f"backend={backend!r} must be asked for in the first init")
        return _COMM
    comm: Any = NCCLCommunicator() if backend == "nccl" else MPICommunicator()
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
    """Whether :func:`init` has been called in this process.

    Example:
        >>> rlx.distributed.is_initialized()
        False
    """
    return _COMM is not None


def communicator() -> Communicator:
    """The communicator :func:`init` returned; raises ``RlxError`` before ``init``.

    Example:
        >>> rlx.distributed.communicator().barrier()
    """
    if _COMM is None:
        raise RlxError("[distributed] call rlx.distributed.init() first (and launch with mpirun -n N)")
    return _COMM


def rank() -> int:
    """This process's rank (0 when :func:`init` was not called).

    Example:
        >>> if rlx.distributed.rank() == 0:
        ...     print("loss", loss)
    """
    return _COMM.rank if _COMM is not None else 0


def world_size() -> int:
    """The number of ranks (1 when :func:`init` was not called).

    Example:
        >>> batch_per_rank = 256 // rlx.distributed.world_size()
    """
    return _COMM.size if _COMM is not None else 1


def local_rank() -> int:
    """This process's rank among the ranks on its host (0 when :func:`init` was not called).

    Example:
        >>> device = f"cuda:{rlx.distributed.local_rank()}"
    """
    return _COMM.local_rank if _COMM is not None else 0


def barrier() -> None:
    """Waits until every rank calls it (no-op before :func:`init`).

    Example:
        >>> rlx.distributed.barrier()              # e.g. before rank 0 reads a file others wrote
    """
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
