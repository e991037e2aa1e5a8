"""rlx: a small ML compiler and runtime. Trace a Python training step once; run it as one native
call over one planned memory arena."""

from . import nn, optim
from ._compile import Function, InputSpec, TrainStep, compile, compile_train_step
from ._graph import Executable, Graph, grad
from ._random import seed
from ._rlx import devices
from ._tensor import (
    Tensor,
    cross_entropy,
    exp,
    log,
    log_softmax,
    matmul,
    mse_loss,
    relu,
    sigmoid,
    softmax,
    sqrt,
    tanh,
    where,
)
from .errors import CheckpointError, DeviceError, DTypeError, InputError, RlxError, ShapeError, UnsupportedError

__version__ = "0.1.0"

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
    "cross_entropy",
    "devices",
    "exp",
    "grad",
    "log",
    "log_softmax",
    "matmul",
    "mse_loss",
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
