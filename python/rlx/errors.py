"""The rlx exception classes. Every error rlx raises is an ``RlxError``; the classes are defined by
the native module (so its errors need no Python import to raise) and re-exported here.

- ``RlxError(Exception)``: base class of every rlx exception.
- ``ShapeError(RlxError, ValueError)``: shapes that do not fit together.
- ``DTypeError(RlxError, TypeError)``: element types that do not fit together.
- ``InputError(RlxError, ValueError)``: a bad input at call time (unknown or missing name, value out of range).
- ``DeviceError(RlxError, RuntimeError)``: a device that is unknown, not compiled in, or absent.
- ``UnsupportedError(RlxError, NotImplementedError)``: a feature this build or backend does not have.
- ``CheckpointError(RlxError)``: a checkpoint that cannot be written, read, or does not match the model.
"""

from ._rlx import CheckpointError, DeviceError, DTypeError, InputError, RlxError, ShapeError, UnsupportedError

__all__ = ["RlxError", "ShapeError", "DTypeError", "InputError", "DeviceError", "UnsupportedError", "CheckpointError"]
