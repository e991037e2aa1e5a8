"""rlx: a small ML compiler and runtime. Trace a Python training step once; run it as one native
call over one planned memory arena."""

import os as _os
import threading as _threading

from . import _compile as _compile_module
from . import _random as _random_module
from . import _rlx as _rlx_native
from . import distributed, models, nn, optim
from ._compile import Function, InputSpec, TrainStep, compile, compile_train_step
from ._devices import devices
from ._dlpack import DeviceTensor
from ._graph import Executable, Graph, grad
from ._losses import binary_cross_entropy_with_logits, cross_entropy, l1_loss, nll_loss, smooth_l1_loss
from ._random import seed
from ._tensor import (
    Tensor,
    argmax,
    clip,
    concat,
    embedding,
    exp,
    gelu,
    layer_norm,
    leaky_relu,
    log,
    log1p,
    log_softmax,
    logical_and,
    logical_not,
    logical_or,
    logical_xor,
    matmul,
    maximum,
    minimum,
    mse_loss,
    relu,
    scaled_dot_product_attention,
    sigmoid,
    silu,
    softmax,
    softplus,
    split,
    sqrt,
    stop_gradient,
    tanh,
    where,
)
from ._tensor import (
    abs_ as abs,  # noqa: A004  (rlx.abs, as numpy's and PyTorch's)
)
from ._vision import avg_pool2d, batch_norm, conv2d, dropout, max_pool2d
from .errors import CheckpointError, DeviceError, DistributedError, DTypeError, InputError, RlxError, ShapeError, UnsupportedError

__version__ = "0.2.0"

# fork(): rlx's Python locks are taken and every call inside native code has returned before the
# fork, so a child never inherits a lock held by a thread it does not have (worker pools and copy
# engines are re-made in the child; the child gets fresh Python locks).


_held_at_fork: list = []


def _fork_prepare() -> None:
    _compile_module._BUILD_LOCK.acquire()
    nn._STORE_LOCK.acquire()
    # The generator behind parameter initialisation draws under its own lock.
    rng_lock = _random_module.rng().bit_generator.lock
    rng_lock.acquire()
    _held_at_fork.append(rng_lock)
    _rlx_native._before_fork()


def _fork_parent() -> None:
    _rlx_native._after_fork()
    _held_at_fork.pop().release()
    nn._STORE_LOCK.release()
    _compile_module._BUILD_LOCK.release()


def _fork_child() -> None:
    _rlx_native._after_fork()
    _held_at_fork.pop().release()
    nn._STORE_LOCK = _threading.RLock()
    _compile_module._BUILD_LOCK = _threading.Lock()


_os.register_at_fork(before=_fork_prepare, after_in_parent=_fork_parent, after_in_child=_fork_child)

__all__ = [
    "abs",
    "argmax",
    "avg_pool2d",
    "batch_norm",
    "binary_cross_entropy_with_logits",
    "clip",
    "conv2d",
    "dropout",
    "l1_loss",
    "leaky_relu",
    "log1p",
    "max_pool2d",
    "maximum",
    "minimum",
    "nll_loss",
    "silu",
    "smooth_l1_loss",
    "softplus",
    "stop_gradient",
    "CheckpointError",
    "DTypeError",
    "DeviceError",
    "DeviceTensor",
    "DistributedError",
    "Executable",
    "Function",
    "Graph",
    "InputError",
    "InputSpec",
    "RlxError",
    "ShapeError",
    "Tensor",
    "TrainStep",
    "UnsupportedError",
    "compile",
    "compile_train_step",
    "concat",
    "cross_entropy",
    "embedding",
    "gelu",
    "layer_norm",
    "scaled_dot_product_attention",
    "split",
    "devices",
    "exp",
    "grad",
    "log",
    "log_softmax",
    "logical_and",
    "logical_not",
    "logical_or",
    "logical_xor",
    "matmul",
    "mse_loss",
    "distributed",
    "models",
    "nn",
    "optim",
    "relu",
    "seed",
    "sigmoid",
    "softmax",
    "sqrt",
    "tanh",
    "where",
]
