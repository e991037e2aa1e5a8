"""Specs for issue 6 (async prefetch); moved into tests/ when step.prefetch lands."""
"""Prefetch double-buffering of train-step inputs, and resident inputs (bind / view / write_rows)."""

import numpy as np
import pytest

import rlx
from conftest import Empty, assert_close

N, D, C = 8, 5, 4


class Net(rlx.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = rlx.nn.Linear(D, C)

    def __call__(self, x):
        return self.fc(x)


def loss_fn(m, x, y):
    return rlx.cross_entropy(m(x), y)


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


def test_prefetch_pipeline_matches_direct_calls():
    (ma, sa), (mb, sb) = twin_steps()
    bs = batches(6)
    sa.prefetch(**bs[0])
    got = []
    for k in range(len(bs)):
        if k + 1 < len(bs):
            sa.prefetch(**bs[k + 1])
        got.append(sa())
    want = [sb(**b) for b in bs]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert_same_params(ma, mb)


def test_prefetch_queue_holds_two_batches():
    (ma, sa), (mb, sb) = twin_steps()
    bs = batches(3, seed=1)
    sa.prefetch(**bs[0])
    sa.prefetch(**bs[1])
    with pytest.raises(rlx.RlxError):
        sa.prefetch(**bs[2])
    l0, l1 = sa(), sa()
    assert l0 == pytest.approx(sb(**bs[0]), rel=1e-6)
    assert l1 == pytest.approx(sb(**bs[1]), rel=1e-6)
    assert_same_params(ma, mb)


def test_explicit_arrays_bypass_the_queue():
    (ma, sa), (mb, sb) = twin_steps()
    b0, b1 = batches(2, seed=2)
    sa.prefetch(**b0)
    la1 = sa(**b1)  # explicit: runs b1, leaves b0 queued
    la0 = sa()
    assert la1 == pytest.approx(sb(**b1), rel=1e-6)
    assert la0 == pytest.approx(sb(**b0), rel=1e-6)
    assert_same_params(ma, mb)


def test_prefetch_validates_input():
    _, (mb, sb) = twin_steps()
    b = batches(1, seed=3)[0]
    with pytest.raises(rlx.ShapeError):
        sb.prefetch(x=b["x"][:3], y=b["y"])
    with pytest.raises(rlx.DTypeError):
        sb.prefetch(x=b["x"].astype(np.float64), y=b["y"])
    # nothing was queued by the refused calls: a prefetch+step now runs exactly b
    (ma, sa), _ = twin_steps()
    sb.prefetch(**b)
    assert sb() == pytest.approx(sa(**b), rel=1e-6)


