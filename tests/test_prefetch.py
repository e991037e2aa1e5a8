"""Prefetch double-buffering: async input copies consumed in order by calls without arrays."""

import numpy as np
import pytest

import rlx
from conftest import Empty
from linear_case import INPUTS, C, D, N, Net, assert_same_params, batches, loss_fn, twin_steps  # noqa: F401


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




def make_affine():
    """fn(x, bias) = 2 * x + bias, with `bias` bound as a resident input."""
    fn = rlx.compile(lambda m, x, bias: x * 2.0 + bias, Empty(),
                     {"x": rlx.InputSpec((64, 32)), "bias": rlx.InputSpec((32,))})
    return fn


def test_each_call_sees_exactly_its_prefetched_batch():
    fn = make_affine()
    rng = np.random.default_rng(0)
    bias = rng.standard_normal(32).astype(np.float32)
    fn.bind("bias", bias)
    batches = [rng.standard_normal((64, 32)).astype(np.float32) for _ in range(40)]
    fn.prefetch(x=batches[0])
    for k in range(len(batches)):
        if k + 1 < len(batches):
            fn.prefetch(x=batches[k + 1])
        if k % 7 == 3:  # explicit arrays bypass the queue and leave it as it was
            np.testing.assert_array_equal(fn(x=batches[0]), batches[0] * 2 + bias)
            assert fn.prefetched == (2 if k + 1 < len(batches) else 1)
        if k == 20:  # re-binding a resident input between steps is seen by the next step
            bias = bias + 1
            fn.view("bias")[:] = bias
        np.testing.assert_array_equal(fn(), batches[k] * 2 + bias, err_msg=f"batch {k}")
    assert fn.prefetched == 0
    with pytest.raises(rlx.InputError, match="prefetched"):
        fn()


def test_source_arrays_stay_alive_until_consumed():
    import gc

    fn = make_affine()
    fn.bind("bias", np.zeros(32, np.float32))
    want = []
    for seed in (1, 2):
        x = np.random.default_rng(seed).standard_normal((64, 32)).astype(np.float32)
        want.append(x * 2)
        fn.prefetch(x=x)
        del x
    gc.collect()
    np.testing.assert_array_equal(fn(), want[0])
    np.testing.assert_array_equal(fn(), want[1])


def test_prefetch_refuses_bound_inputs_and_bind_while_queued():
    fn = make_affine()
    fn.bind("bias", np.zeros(32, np.float32))
    with pytest.raises(rlx.InputError, match="bound"):
        fn.prefetch(x=np.zeros((64, 32), np.float32), bias=np.zeros(32, np.float32))
    fn2 = make_affine()
    fn2.prefetch(x=np.ones((64, 32), np.float32), bias=np.ones(32, np.float32))
    with pytest.raises(rlx.InputError, match="prefetched"):
        fn2.bind("bias", np.zeros(32, np.float32))
    np.testing.assert_array_equal(fn2(), np.full((64, 32), 3.0, np.float32))


def test_dropping_a_step_with_pending_prefetches_is_safe():
    import gc

    fn = make_affine()
    for _ in range(2):
        fn.prefetch(x=np.ones((64, 32), np.float32), bias=np.ones(32, np.float32))
    del fn
    gc.collect()


def test_an_output_that_is_an_input_comes_from_the_prefetched_batch():
    """A program whose output is an input itself (or a reshape of one: the same bytes) returns
    the prefetched batch's values, not the previous call's."""
    for f in (lambda m, x: x, lambda m, x: x.reshape(6), lambda m, x: (x.reshape(3, 2), x * 2.0)):
        fn = rlx.compile(f, rlx.nn.Module(), {"x": rlx.InputSpec((2, 3))})
        a, b, c = (np.full((2, 3), v, np.float32) for v in (0.0, 1.0, 2.0))
        fn(x=a)
        fn.prefetch(x=b)
        fn.prefetch(x=c)
        for want in (b, c):
            got = fn()
            got = got if isinstance(got, tuple) else (got,)
            np.testing.assert_array_equal(got[0].reshape(-1), want.reshape(-1))
            if len(got) > 1:
                np.testing.assert_array_equal(got[1], want * 2.0)
