"""rlx: a small ML compiler and runtime. Trace a Python training step once; run it as one native
call over one planned memory arena."""

import os as _os

from . import _rlx as _rlx_native
from . import models, nn, optim
from ._compile import Function, InputSpec, TrainStep, compile, compile_train_step
from ._devices import devices
from ._graph import Executable, Graph, grad
from ._random import seed
from ._tensor import (
    Tensor,
    concat,
    cross_entropy,
    embedding,
    exp,
    gelu,
    layer_norm,
    log,
    log_softmax,
    matmul,
    mse_loss,
    relu,
    scaled_dot_product_attention,
    sigmoid,
    softmax,
    split,
    sqrt,
    tanh,
    where,
)
from .errors import CheckpointError, DeviceError, DTypeError, InputError, RlxError, ShapeError, UnsupportedError

__version__ = "0.1.0"

# fork(): wait for every call inside native code to return first, so a child never inherits a
# lock held by a thread it does not have (worker pools and copy engines are re-made in the child).
_os.register_at_fork(before=_rlx_native._before_fork, after_in_parent=_rlx_native._after_fork,
                     after_in_child=_rlx_native._after_fork)

__all__ = [
    "CheckpointError",
    "DTypeError",
    "DeviceError",
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
    "matmul",
    "mse_loss",
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
