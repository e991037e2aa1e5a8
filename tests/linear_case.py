"""A tiny linear classifier and its batches, shared by the prefetch and resident-input tests."""

import numpy as np

import rlx
from models import LinearNet, ce_loss

N, D, C = 8, 5, 4


def Net():
    return LinearNet(D, C)


loss_fn = ce_loss


INPUTS = {"x": rlx.InputSpec((N, D)), "y": rlx.InputSpec((N,), dtype="int32")}


def batches(k, seed=0):
    rng = np.random.default_rng(seed)
    return [dict(x=rng.standard_normal((N, D)).astype(np.float32),
                 y=rng.integers(0, C, N).astype(np.int32)) for _ in range(k)]


def twin_steps():
    out = []
    for _ in range(2):
        rlx.seed(0)
        model = Net()
        opt = rlx.optim.SGD(lr=0.2, momentum=0.5)
        out.append((model, rlx.compile_train_step(loss_fn, model, opt, INPUTS)))
    return out


def assert_same_params(ma, mb):
    for k, p in ma.parameters().items():
        np.testing.assert_allclose(p.numpy(), mb.parameters()[k].numpy(), rtol=1e-6, atol=1e-7)
