"""The rlx exception classes. Every error rlx raises is an ``RlxError``."""


class RlxError(Exception):
    """Base class of every rlx exception.

    Example:
        >>> try:
        ...     step(x=bad_batch)
        ... except rlx.RlxError as e:
        ...     print(e)
    """


class ShapeError(RlxError, ValueError):
    """Shapes that do not fit together; the message names the op and the shapes.

    Example:
        >>> try:
        ...     step(x=np.zeros((3, 5), np.float32))   # expected (64, 64)
        ... except rlx.ShapeError as e:
        ...     print(e)
    """


class DTypeError(RlxError, TypeError):
    """Element types that do not fit together; the message names the op and the dtypes.

    Example:
        >>> try:
        ...     step(x=np.zeros((64, 64)))             # float64, not float32
        ... except rlx.DTypeError as e:
        ...     print(e)
    """


class InputError(RlxError, ValueError):
    """A bad input at call time: an unknown or missing name, or a value out of range.

    Example:
        >>> try:
        ...     step(z=x)                              # unknown input name
        ... except rlx.InputError as e:
        ...     print(e)
    """


class DeviceError(RlxError, RuntimeError):
    """A device that is unknown, not compiled in, or absent.

    Example:
        >>> try:
        ...     rlx.compile(f, model, specs, device="cuda:7")
        ... except rlx.DeviceError as e:
        ...     print(e)
    """


class UnsupportedError(RlxError, NotImplementedError):
    """A feature this build or backend does not have.

    Example:
        >>> try:
        ...     rlx.compile_train_step(f, model, opt, {"x": rlx.InputSpec((None, 4))}, accumulate=2)
        ... except rlx.UnsupportedError as e:
        ...     print(e)
    """


class CheckpointError(RlxError):
    """A checkpoint that cannot be written, read, or does not match the model.

    Example:
        >>> try:
        ...     model.load("other_model.safetensors")
        ... except rlx.CheckpointError as e:
        ...     print(e)
    """


__all__ = ["RlxError", "ShapeError", "DTypeError", "InputError", "DeviceError", "UnsupportedError", "CheckpointError"]
