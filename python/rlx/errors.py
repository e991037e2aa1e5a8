"""The rlx exception classes. Every error rlx raises is an ``RlxError``; the classes are defined by
the native module (so its errors need no Python import to raise) and re-exported here.

- ``RlxError(Exception)``: base class of every rlx exception.
- ``ShapeError(RlxError, ValueError)``: shapes that do not fit together.
- ``DTypeError(RlxError, TypeError)``: element types that do not fit together.
- ``InputError(RlxError, ValueError)``: a bad input at call time (unknown or missing name, value out of range).
- ``DeviceError(RlxError, RuntimeError)``: a device that is unknown, not compiled in, or absent.
- ``UnsupportedError(RlxError, NotImplementedError)``: a feature this build or backend does not have.
- ``CheckpointError(RlxError)``: a checkpoint that cannot be written, read, or does not match the model.
- ``DistributedError(RlxError)``: a collective across ranks failed, timed out, or the ranks disagree.
"""

from ._rlx import CheckpointError, DeviceError, DTypeError, InputError, RlxError, ShapeError, UnsupportedError

# The native classes get their documentation (with examples) here.
RlxError.__doc__ = """Base class of every rlx exception.

    Example:
        >>> try:
        ...     step(x=bad_batch)
        ... except rlx.RlxError as e:
        ...     print(e)
    """
ShapeError.__doc__ = """Shapes that do not fit together; the message names the op and the shapes.

    Example:
        >>> try:
        ...     step(x=np.zeros((3, 5), np.float32), y=y)   # expected (64, 64)
        ... except rlx.ShapeError as e:
        ...     print(e)
    """
DTypeError.__doc__ = """Element types that do not fit together; the message names the op and the dtypes.

    Example:
        >>> try:
        ...     step(x=np.zeros((64, 64)), y=y)             # float64, not float32
        ... except rlx.DTypeError as e:
        ...     print(e)
    """
InputError.__doc__ = """A bad input at call time: an unknown or missing name, or a value out of range.

    Example:
        >>> try:
        ...     step(z=x)                              # unknown input name
        ... except rlx.InputError as e:
        ...     print(e)
    """
DeviceError.__doc__ = """A device that is unknown, not compiled in, or absent.

    Example:
        >>> try:
        ...     rlx.compile(f, model, specs, device="cuda:7")
        ... except rlx.DeviceError as e:
        ...     print(e)
    """
UnsupportedError.__doc__ = """A feature this build or backend does not have.

    Example:
        >>> try:
        ...     rlx.compile_train_step(f, model, opt, {"x": rlx.InputSpec((None, 4))}, accumulate=2)
        ... except rlx.UnsupportedError as e:
        ...     print(e)
    """
CheckpointError.__doc__ = """A checkpoint that cannot be written, read, or does not match the model.

    Example:
        >>> try:
        ...     model.load("other_model.safetensors")
        ... except rlx.CheckpointError as e:
        ...     print(e)
    """



class DistributedError(RlxError):
    """A collective across ranks failed or timed out (another rank died, raised, or stopped
    calling), or the ranks disagree (a different model on one rank).

    Example:
        >>> try:
        ...     step = rlx.compile_train_step(f, model, opt, specs, distributed=True)
        ... except rlx.DistributedError as e:
        ...     print(e)
    """


__all__ = ["RlxError", "ShapeError", "DTypeError", "InputError", "DeviceError", "UnsupportedError", "CheckpointError",
           "DistributedError"]
