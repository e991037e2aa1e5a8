"""rlx: a small ML compiler and runtime. Trace a Python training step once; run it as one native
call over one planned memory arena."""

from . import models, nn, optim
from ._compile import Function, InputSpec, TrainStep, compile, compile_train_step
from ._graph import Executable, Graph, grad
from ._random import seed
from ._rlx import devices
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
