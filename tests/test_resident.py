"""Resident inputs: bind once, view, write rows in place, bounds-checked."""

import numpy as np
import pytest

import rlx
from conftest import Empty, assert_close
from linear_case import INPUTS, C, D, N, Net, assert_same_params, batches, loss_fn, twin_steps  # noqa: F401


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
