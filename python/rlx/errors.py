"""The rlx exception classes. Every error rlx raises is an ``RlxError``."""


class RlxError(Exception):
    """Base class of every rlx exception."""


class ShapeError(RlxError, ValueError):
    """Shapes that do not fit together; the message names the op and the shapes."""


class DTypeError(RlxError, TypeError):
    """Element types that do not fit together; the message names the op and the dtypes."""


class InputError(RlxError, ValueError):
    """A bad input at call time: an unknown or missing name, or a value out of range."""


class DeviceError(RlxError, RuntimeError):
    """A device that is unknown, not compiled in, or absent."""


class UnsupportedError(RlxError, NotImplementedError):
    """A feature this build or backend does not have."""


class CheckpointError(RlxError):
    """A checkpoint that cannot be written, read, or does not match the model."""


__all__ = ["RlxError", "ShapeError", "DTypeError", "InputError", "DeviceError", "UnsupportedError", "CheckpointError"]
