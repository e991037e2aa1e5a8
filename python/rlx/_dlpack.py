"""DLPack export of tensors in rlx's own memory: the ``__dlpack__`` request rules every exporter
shares (parameters, gradients, optimizer state, resident inputs) and ``DeviceTensor``, the object
``step.grad_tensor``, ``optimizer.state_tensors`` and ``fn.view_tensor`` return."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from ._arrays import from_bytes

#: DLPack device types rlx exports from.
KDL_CPU, KDL_CUDA = 1, 2
#: ``__dlpack_device__`` of host memory (the CPU backend; Metal's shared storage).
HOST = (KDL_CPU, 0)


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def check_request(label: str, device: tuple[int, int], stream: Any, max_version: Any, dl_device: Any,
                  copy: Any) -> None:
    """Raises ``BufferError`` naming ``label`` for a ``__dlpack__`` request rlx cannot serve:
    another device than the tensor's, a copy of GPU memory, or a ``stream`` the standard does not
    allow for the tensor's device (host memory: only ``None``; CUDA: ``None``, ``-1``, ``1``, ``2``
    or a stream handle, never ``0``)."""
    if max_version is not None and not (
            isinstance(max_version, tuple) and len(max_version) == 2 and all(_is_int(v) for v in max_version)):
        raise BufferError(f"[{label}] max_version must be a (major, minor) tuple of ints, got {max_version!r}")
    if copy is not None and not isinstance(copy, (bool, np.bool_)):
        raise BufferError(f"[{label}] copy must be None, True or False, got {copy!r}")
    if dl_device is not None:
        try:
            want = (int(dl_device[0]), int(dl_device[1]))
        except (TypeError, ValueError, IndexError):
            raise BufferError(f"[{label}] dl_device must be a (device type, ordinal) pair, got {dl_device!r}") from None
        if want != device:
            raise BufferError(f"[{label}] the tensor is on {device}, not {want}: rlx exports its memory where it is "
                              "(copy the consumer's tensor to the other device instead)")
    if device[0] == KDL_CUDA:
        if copy:
            raise BufferError(f"[{label}] rlx exports GPU memory without copying; copy=True is not supported")
        if stream is not None and (not _is_int(stream) or int(stream) == 0 or int(stream) < -1):
            raise BufferError(f"[{label}] stream must be None, -1, 1, 2 or a CUDA stream handle (a positive int), "
                              f"got {stream!r} (DLPack forbids 0 for CUDA)")
    elif stream is not None:
        raise BufferError(f"[{label}] the tensor is in host memory: stream must be None, got {stream!r}")


def export(label: str, device: tuple[int, int], dtype: str, host_array: Callable[[], np.ndarray],
           capsule: Callable[[], Any], bf16_hint: str, stream: Any = None, max_version: Any = None,
           dl_device: Any = None, copy: Any = None) -> Any:
    """The capsule for a ``__dlpack__`` request: GPU memory as rlx's own ``"dltensor"`` capsule
    over it (no copy; the capsule holds the memory), host memory through its numpy view
    (``host_array()``, writable and zero-copy unless ``copy=True``).

    Every rlx call finishes its GPU work before it returns, so the memory is ready on any
    consumer stream and no event is needed: ``stream`` is checked, not waited on."""
    check_request(label, device, stream, max_version, dl_device, copy)
    if device[0] == KDL_CUDA:
        out = capsule()
        if out is None:
            raise BufferError(f"[{label}] the memory is not GPU memory rlx can export")
        return out
    if dtype == "bfloat16":
        raise BufferError(f"[{label}] a bfloat16 {bf16_hint}")
    kw: dict[str, Any] = {}
    for k, v in (("max_version", max_version), ("dl_device", dl_device), ("copy", copy)):
        if v is not None:
            kw[k] = v
    return host_array().__dlpack__(**kw)


class DeviceTensor:
    """One tensor in rlx's own memory — a gradient, an optimizer state buffer or a resident
    input — that PyTorch, CuPy, JAX or numpy read **without a copy** through DLPack, on the CPU
    and on CUDA alike: ``torch.from_dlpack(step.grad_tensor("fc1.weight"))``. The consumer's
    tensor is that memory: writes through it reach the memory rlx computes with.

    It keeps the memory alive: a consumer's tensor stays valid after the step, function or
    model is dropped. Made by ``TrainStep.grad_tensor``, ``Optimizer.state_tensors`` and
    ``Function.view_tensor``, whose docs say when rlx overwrites the values. Use the consumer's
    tensor only between rlx calls (never while a step runs); on a GPU, finish the work queued on
    it (PyTorch: ``torch.cuda.synchronize()``) before the next rlx call.

    Example:
        >>> g = torch.from_dlpack(step.grad_tensor("fc1.weight"))   # no copy, rlx's device
    """

    __slots__ = ("_label", "_shape", "_dtype", "_device", "_view", "_read", "_capsule")

    def __init__(self, label: str, shape: Sequence[int], dtype: str, device: Any,
                 view: Callable[[], Any], read: Callable[[], bytes], capsule: Callable[[], Any]) -> None:
        self._label, self._shape, self._dtype = label, tuple(int(d) for d in shape), dtype
        self._device = HOST if device is None else (int(device[0]), int(device[1]))
        self._view, self._read, self._capsule = view, read, capsule

    @property
    def name(self) -> str:
        """What the tensor is, e.g. ``"fc1.weight (gradient)"``."""
        return self._label

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape."""
        return self._shape

    @property
    def dtype(self) -> str:
        """The rlx dtype name, e.g. ``"float32"``."""
        return self._dtype

    @property
    def ndim(self) -> int:
        """The number of dimensions."""
        return len(self._shape)

    def numpy(self) -> np.ndarray:
        """The values: a writable zero-copy view where the host can see the memory, else (CUDA) a
        read-only copy of the current values.

        Example:
            >>> step.grad_tensor("fc1.weight").numpy().shape
            (256, 64)
        """
        raw = self._view()
        if raw is None:
            arr = from_bytes(self._read(), self._dtype, self._shape)
            arr.flags.writeable = False
            return arr
        return from_bytes(raw, self._dtype, self._shape)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        if copy is False and self._view() is None:
            # numpy 2's protocol: copy=False must not copy, and device memory cannot be viewed.
            raise ValueError(f"[{self._label}] is GPU memory: numpy can only copy it (np.asarray(t) or t.numpy())")
        values = self.numpy()
        if copy:
            values = values.copy()
        return values if dtype is None else values.astype(dtype, copy=False)

    def __dlpack__(self, *, stream: Any = None, max_version: Any = None, dl_device: Any = None,
                   copy: Any = None) -> Any:
        """DLPack export of the memory itself (the array API standard's arguments; a request rlx
        cannot serve raises ``BufferError`` naming the tensor)."""
        def host() -> np.ndarray:
            raw = self._view()
            if raw is None:
                raise BufferError(f"[{self._label}] the memory is not host-visible")
            return from_bytes(raw, self._dtype, self._shape)

        return export(self._label, self._device, self._dtype, host, self._capsule,
                      "tensor in host memory has no DLPack export (numpy, which provides it, has no bfloat16): "
                      "use numpy() (an ml_dtypes.bfloat16 array)",
                      stream=stream, max_version=max_version, dl_device=dl_device, copy=copy)

    def __dlpack_device__(self) -> tuple[int, int]:
        """``(DLPack device type, ordinal)``: ``(1, 0)`` for host memory, ``(2, n)`` for ``cuda:n``."""
        return self._device

    def __repr__(self) -> str:
        dev = "host" if self._device == HOST else f"cuda:{self._device[1]}"
        return f"DeviceTensor({self._label!r}, shape={self._shape}, dtype={self._dtype!r}, memory={dev!r})"
