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


def test_step_without_arrays_and_empty_queue_raises():
    (ma, sa), _ = twin_steps()
    before = {k: p.numpy().copy() for k, p in ma.parameters().items()}
    with pytest.raises(rlx.RlxError):
        sa()
    for k, p in ma.parameters().items():
        np.testing.assert_array_equal(p.numpy(), before[k])


# ----------------------------------------------------------------------------------------------
# resident inputs
# ----------------------------------------------------------------------------------------------
def make_fn():
    return rlx.compile(lambda m, x, cache: x @ cache.T, Empty(),
                       {"x": rlx.InputSpec((2, 3)), "cache": rlx.InputSpec((5, 3))})


def test_bind_view_write_rows():
    rng = np.random.default_rng(4)
    fn = make_fn()
    cache = rng.standard_normal((5, 3)).astype(np.float32)
    x = rng.standard_normal((2, 3)).astype(np.float32)
    fn.bind("cache", cache)
    ref = cache.astype(np.float64).copy()
    cache[...] = 0.0  # bind copied the data; the caller's array is free again
    assert_close(fn(x=x), x @ ref.T, rtol=1e-5, atol=1e-6)

    view = fn.view("cache")
    assert view.shape == (5, 3)
    np.testing.assert_array_equal(view, ref.astype(np.float32))
    assert np.shares_memory(view, fn.view("cache"))

    rows = rng.standard_normal((2, 3)).astype(np.float32)
    fn.write_rows("cache", 3, rows)
    ref[3:5] = rows
    np.testing.assert_array_equal(view, ref.astype(np.float32))
    assert_close(fn(x=x), x @ ref.T, rtol=1e-5, atol=1e-6)

    view[0] = 1.0  # host-visible: writing the view changes the next call
    ref[0] = 1.0
    assert_close(fn(x=x), x @ ref.T, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("start,nrows", [(4, 2), (5, 1), (-1, 1)])
def test_write_rows_is_bounds_checked(start, nrows):
    fn = make_fn()
    cache = np.arange(15, dtype=np.float32).reshape(5, 3)
    fn.bind("cache", cache)
    with pytest.raises((rlx.RlxError, OverflowError)):
        fn.write_rows("cache", start, np.ones((nrows, 3), np.float32))
    np.testing.assert_array_equal(fn.view("cache"), cache)


def test_write_rows_wrong_row_width():
    fn = make_fn()
    fn.bind("cache", np.zeros((5, 3), np.float32))
    with pytest.raises(rlx.ShapeError):
        fn.write_rows("cache", 0, np.ones((1, 4), np.float32))
    np.testing.assert_array_equal(fn.view("cache"), np.zeros((5, 3), np.float32))


def test_bind_wrong_shape_or_name():
    fn = make_fn()
    with pytest.raises(rlx.ShapeError):
        fn.bind("cache", np.zeros((4, 3), np.float32))
    with pytest.raises(rlx.InputError):
        fn.bind("nope", np.zeros((5, 3), np.float32))


def test_unbound_resident_input_is_missing():
    fn = make_fn()
    with pytest.raises(rlx.InputError, match=r"\bcache\b"):
        fn(x=np.zeros((2, 3), np.float32))
