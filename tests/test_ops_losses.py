"""The API contract's extra ops (abs, maximum, minimum, clip, argmax, min, var, softplus, log1p,
silu, leaky_relu, stop_gradient, flatten, exp/log methods, int-tensor indexing) and losses
(cross_entropy with ignore_index / label_smoothing, nll_loss, binary_cross_entropy_with_logits,
l1_loss, smooth_l1_loss) against numpy, finite differences and PyTorch (when installed)."""

import numpy as np
import pytest

import rlx
from conftest import assert_close, check_op_grads, run_forward, run_grads

try:
    import torch
except ImportError:  # pragma: no cover - torch is optional
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="PyTorch is not installed")


def _x(shape=(3, 5), seed=0, lo=-2.0, hi=2.0):
    return np.random.default_rng(seed).uniform(lo, hi, shape).astype(np.float32)


def np_softplus(a, beta=1.0, threshold=20.0):
    return np.where(a * beta > threshold, a, np.log1p(np.exp(np.minimum(a * beta, threshold))) / beta)


UNARY = {
    "abs": (rlx.abs, np.abs),
    "softplus": (rlx.softplus, np_softplus),
    "silu": (rlx.silu, lambda a: a / (1 + np.exp(-a))),
    "leaky_relu": (lambda x: rlx.leaky_relu(x, 0.2), lambda a: np.where(a > 0, a, 0.2 * a)),
    "clip": (lambda x: rlx.clip(x, -0.5, 1.0), lambda a: np.clip(a, -0.5, 1.0)),
    "exp_method": (lambda x: x.exp(), np.exp),
    "min_axis": (lambda x: x.min(axis=1), lambda a: a.min(axis=1)),
    "var_axis": (lambda x: x.var(axis=0, keepdims=True), lambda a: a.var(axis=0, keepdims=True)),
    "var_all_ddof1": (lambda x: x.var(ddof=1), lambda a: a.var(ddof=1)),
    "flatten": (lambda x: x.flatten(), lambda a: a.reshape(-1)),
}


@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary_forward_and_gradient(name):
    op, ref = UNARY[name]
    x = _x(seed=len(name))
    x[np.abs(x) < 0.05] = 0.3  # away from kinks, where finite differences are not the derivative
    x[np.abs(x - 1.0) < 0.05] = 0.7
    x[np.abs(x + 0.5) < 0.05] = 0.2
    assert_close(run_forward(op, {"x": x}), ref(x.astype(np.float64)), rtol=1e-5, atol=1e-6)
    check_op_grads(op, ref, {"x": x})


def test_log1p_and_log_method_are_accurate():
    x = np.array([1e-8, 1e-4, 0.5, 3.0, -0.5], np.float32)
    assert_close(run_forward(rlx.log1p, {"x": x}), np.log1p(x.astype(np.float64)), rtol=1e-6, atol=0)
    check_op_grads(rlx.log1p, np.log1p, {"x": x})
    check_op_grads(lambda x: (x + 2.0).log(), lambda a: np.log(a + 2.0), {"x": x})


def test_softplus_large_inputs_are_linear_and_beta_scales():
    x = np.array([-30.0, -1.0, 0.0, 5.0, 19.0, 21.0, 80.0], np.float32)
    assert_close(run_forward(rlx.softplus, {"x": x}), np_softplus(x.astype(np.float64)), rtol=1e-6, atol=1e-7)
    out = run_forward(lambda x: rlx.softplus(x, beta=2.0, threshold=5.0), {"x": x})
    assert_close(out, np_softplus(x.astype(np.float64), 2.0, 5.0), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("fn,ref", [(rlx.maximum, np.maximum), (rlx.minimum, np.minimum)], ids=["maximum", "minimum"])
def test_maximum_minimum_broadcast_and_share_ties(fn, ref):
    a, b = _x((3, 4), 1), _x((4,), 2)
    assert_close(run_forward(fn, {"a": a, "b": b}), ref(a, b), rtol=0, atol=0)
    check_op_grads(fn, ref, {"a": a, "b": b})
    # Ties: each side gets half the gradient, as PyTorch's.
    _, g = run_grads(lambda m: fn(m.a * 1.0, m.b * 1.0).sum(), {"a": np.ones(3, np.float32), "b": np.ones(3, np.float32)})
    np.testing.assert_array_equal(g["a"], [0.5] * 3)
    np.testing.assert_array_equal(g["b"], [0.5] * 3)
    nan = run_forward(fn, {"a": np.array([np.nan, 1.0], np.float32), "b": np.array([0.0, np.nan], np.float32)})
    assert np.isnan(nan).all()


def test_abs_gradient_is_zero_at_zero_and_int_abs_stays_int():
    _, g = run_grads(lambda m: rlx.abs(m.x * 1.0).sum(), {"x": np.array([-2.0, 0.0, 3.0], np.float32)})
    np.testing.assert_array_equal(g["x"], [-1.0, 0.0, 1.0])
    out = run_forward(lambda t: abs(t), {"t": np.array([-3, 0, 4], np.int32)})
    assert out.dtype == np.int32 and out.tolist() == [3, 0, 4]


def test_argmax_picks_the_first_maximum_as_numpy():
    x = np.array([[1.0, 5.0, 5.0, 2.0], [7.0, 0.0, 7.0, 7.0], [-1.0, -2.0, -3.0, -0.5]], np.float32)
    assert run_forward(lambda t: rlx.argmax(t, axis=1), {"t": x}).tolist() == np.argmax(x, axis=1).tolist()
    assert run_forward(lambda t: t.argmax(axis=0), {"t": x}).tolist() == np.argmax(x, axis=0).tolist()
    assert int(run_forward(lambda t: rlx.argmax(t), {"t": x})) == int(np.argmax(x))
    out = run_forward(lambda t: rlx.argmax(t, -1), {"t": np.array([[3, 9, 9]], np.int32)})
    assert out.dtype == np.int32 and out.tolist() == [1]


def test_stop_gradient_blocks_the_gradient():
    _, g = run_grads(lambda m: (m.x * rlx.stop_gradient(m.x * 3.0)).sum(), {"x": np.array([1.0, 2.0], np.float32)})
    np.testing.assert_allclose(g["x"], [3.0, 6.0])  # d/dx x * c = c, c not differentiated


def test_int_tensor_indexing_gathers_rows_with_gradient():
    table = _x((5, 3), 4)
    ids = np.array([[4, 0], [2, 2]], np.int32)
    assert_close(run_forward(lambda t, i: t[i], {"t": table, "i": ids}), table[ids], rtol=0, atol=0)
    check_op_grads(lambda t, i: t[i], lambda t, i: t[i], {"t": table}, arrays={"i": ids})
    assert_close(run_forward(lambda t: t[np.array([1, 1, 3])], {"t": table}), table[[1, 1, 3]], rtol=0, atol=0)
    with pytest.raises(rlx.DTypeError, match=r"\[getitem\] tensor indices must be int32"):
        run_forward(lambda t, i: t[i.astype("float32")], {"t": table, "i": ids})


def test_int_floor_division_and_remainder():
    a = np.array([7, -7, 9, 0], np.int32)
    b = np.array([2, 2, -4, 3], np.int32)
    assert run_forward(lambda a, b: a // b, {"a": a, "b": b}).tolist() == (a // b).tolist()
    assert run_forward(lambda a, b: a % b, {"a": a, "b": b}).tolist() == (a % b).tolist()


# --- losses ---------------------------------------------------------------------------------------
def _np_log_softmax(z):
    z = z - z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def np_ce(z, y, ignore=-100, smoothing=0.0, reduction="mean"):
    lp = _np_log_softmax(np.asarray(z, np.float64))
    keep = y != ignore
    rows = np.nonzero(keep)[0]
    nll = -lp[rows, y[rows]] * (1 - smoothing) - lp[rows].mean(axis=1) * smoothing
    return nll.sum() / (keep.sum() if reduction == "mean" else 1)


@pytest.mark.parametrize("ignore,smoothing,reduction", [(-100, 0.0, "mean"), (-100, 0.0, "sum"), (2, 0.0, "mean"),
                                                        (-100, 0.1, "mean"), (1, 0.2, "sum")], ids=str)
def test_cross_entropy_options(ignore, smoothing, reduction):
    z = _x((6, 4), 7)
    y = np.array([0, 2, -100, 1, 3, 2], np.int32)
    if ignore != -100:
        y[2] = 0
    fn = lambda z, y: rlx.cross_entropy(z, y, ignore_index=ignore, label_smoothing=smoothing, reduction=reduction)  # noqa: E731
    assert_close(run_forward(fn, {"z": z, "y": y}), np_ce(z, y, ignore, smoothing, reduction), rtol=1e-5, atol=1e-6)
    check_op_grads(fn, lambda z, y: np_ce(z, y, ignore, smoothing, reduction), {"z": z}, arrays={"y": y})
    if torch is not None:
        want = torch.nn.functional.cross_entropy(torch.tensor(z), torch.tensor(y, dtype=torch.long), ignore_index=ignore,
                                                 label_smoothing=smoothing, reduction=reduction)
        assert abs(float(run_forward(fn, {"z": z, "y": y})) - want.item()) < 1e-5


def test_cross_entropy_default_path_ignores_minus_100_and_checks_other_labels():
    z = _x((3, 4), 8)
    out = run_forward(lambda z, y: rlx.cross_entropy(z, y), {"z": z, "y": np.array([-100, 1, -100], np.int32)})
    assert_close(out, np_ce(z, np.array([-100, 1, -100])), rtol=1e-6, atol=1e-7)
    assert np.isnan(run_forward(lambda z, y: rlx.cross_entropy(z, y), {"z": z, "y": np.full(3, -100, np.int32)}))
    with pytest.raises(rlx.InputError, match=r"label -3 is out of range \[0, 4\)"):
        run_forward(lambda z, y: rlx.cross_entropy(z, y), {"z": z, "y": np.array([0, -3, 1], np.int32)})


@pytest.mark.parametrize("call", [
    lambda z, y: rlx.cross_entropy(z, y, label_smoothing=0.1),
    lambda z, y: rlx.cross_entropy(z, y, reduction="sum"),
    lambda z, y: rlx.cross_entropy(z, y, ignore_index=2),
    lambda z, y: rlx.nll_loss(rlx.log_softmax(z, axis=1), y),
], ids=["smoothing", "sum", "ignore_index", "nll_loss"])
@pytest.mark.parametrize("bad", [4, 99, -5])
def test_every_class_loss_path_refuses_labels_out_of_range(call, bad):
    """Not only the fused default: each path's labels are range-checked (they used to pick nothing
    and give a wrong loss silently)."""
    z = _x((3, 4), 11)
    with pytest.raises(rlx.InputError, match=rf"id {bad} is out of range \[0, 4\)"):
        run_forward(call, {"z": z, "y": np.array([0, bad, 1], np.int32)})


def test_minus_100_is_out_of_range_when_another_label_is_ignored():
    """PyTorch refuses -100 when ignore_index is something else; rlx used to add 0 for the row but
    count it in the mean's denominator."""
    z = _x((5, 4), 12)
    fn = lambda z, y: rlx.cross_entropy(z, y, ignore_index=3)  # noqa: E731
    with pytest.raises(rlx.InputError, match=r"id -100 is out of range \[0, 4\)"):
        run_forward(fn, {"z": z, "y": np.array([0, 3, -100, 1, 2], np.int32)})
    y = np.array([0, 3, 3, 1, 2], np.int32)
    assert_close(run_forward(fn, {"z": z, "y": y}), np_ce(z, y, ignore=3), rtol=1e-5, atol=1e-6)


def test_a_bad_label_stops_a_smoothed_training_step_before_the_update():
    model = rlx.nn.Linear(4, 3)
    step = rlx.compile_train_step(lambda m, x, y: rlx.cross_entropy(m(x), y, label_smoothing=0.1), model,
                                  rlx.optim.Adam(1e-2), {"x": rlx.InputSpec((2, 4)), "y": rlx.InputSpec((2,), "int32")})
    x = _x((2, 4), 13)
    step(x=x, y=np.array([0, 2], np.int32))
    before = model.state_dict()
    with pytest.raises(rlx.InputError, match=r"id 3 is out of range \[0, 3\)"):
        step(x=x, y=np.array([0, 3], np.int32))
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)


def test_nll_loss():
    lp = _np_log_softmax(_x((5, 3), 9).astype(np.float64)).astype(np.float32)
    y = np.array([0, 2, 1, 1, 0], np.int32)
    ref = lambda a, y: -a[np.arange(5), y].mean()  # noqa: E731
    assert_close(run_forward(lambda lp, y: rlx.nll_loss(lp, y), {"lp": lp, "y": y}), ref(lp, y), rtol=1e-6, atol=1e-7)
    check_op_grads(lambda lp, y: rlx.nll_loss(lp, y), ref, {"lp": lp}, arrays={"y": y})


def np_bce(x, t, reduction="mean"):
    x = np.asarray(x, np.float64)
    loss = np.maximum(x, 0) - x * t + np.log1p(np.exp(-np.abs(x)))
    return loss.mean() if reduction == "mean" else loss.sum()


def np_smooth_l1(x, y, reduction="mean", beta=1.0):
    d = np.abs(np.asarray(x, np.float64) - y)
    loss = np.where(d < beta, 0.5 * d * d / beta, d - 0.5 * beta)
    return loss.mean() if reduction == "mean" else loss.sum()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_regression_and_binary_losses(reduction):
    x = _x((4, 3), 10, -30.0, 30.0)
    x[0, :] = [-0.3, 0.4, 0.9]
    t = np.random.default_rng(11).uniform(0, 1, (4, 3)).astype(np.float32)
    y = x + _x((4, 3), 12, -2.5, 2.5)
    cases = [
        (lambda a, b: rlx.binary_cross_entropy_with_logits(a, b, reduction), lambda a, b: np_bce(a, b, reduction), t),
        (lambda a, b: rlx.l1_loss(a, b, reduction),
         lambda a, b: getattr(np.abs(a - b), reduction)(), y),
        (lambda a, b: rlx.smooth_l1_loss(a, b, reduction), lambda a, b: np_smooth_l1(a, b, reduction), y),
        (lambda a, b: rlx.smooth_l1_loss(a, b, reduction, beta=0.5),
         lambda a, b: np_smooth_l1(a, b, reduction, 0.5), y),
        (lambda a, b: rlx.mse_loss(a, b, reduction), lambda a, b: getattr((a - b) ** 2, reduction)(), y),
    ]
    for fn, ref, target in cases:
        assert_close(run_forward(fn, {"a": x, "b": target}), ref(x, target.astype(np.float64)), rtol=1e-5, atol=1e-6)
        check_op_grads(fn, ref, {"a": x}, arrays={"b": target})
    if torch is not None:
        F = torch.nn.functional
        tx, tt, ty = torch.tensor(x), torch.tensor(t), torch.tensor(y)
        for fn, want, target in [(rlx.binary_cross_entropy_with_logits, F.binary_cross_entropy_with_logits(tx, tt, reduction=reduction), t),
                                 (rlx.l1_loss, F.l1_loss(tx, ty, reduction=reduction), y),
                                 (rlx.smooth_l1_loss, F.smooth_l1_loss(tx, ty, reduction=reduction), y),
                                 (rlx.mse_loss, F.mse_loss(tx, ty, reduction=reduction), y)]:
            got = float(run_forward(lambda a, b, _f=fn: _f(a, b, reduction), {"a": x, "b": target}))
            assert abs(got - want.item()) < 1e-5 * max(1.0, abs(want.item())), fn.__name__


@pytest.mark.parametrize("call,err,msg", [
    (lambda z, y: rlx.cross_entropy(z, y, reduction="none"), rlx.InputError, r"\[cross_entropy\] reduction must be 'mean' or 'sum'"),
    (lambda z, y: rlx.cross_entropy(z, y.astype("float32")), rlx.DTypeError, r"\[cross_entropy\] labels must be int32"),
    (lambda z, y: rlx.nll_loss(z.reshape(-1), y), rlx.ShapeError, r"\[nll_loss\] expects scores \(N, C\) and labels \(N,\)"),
    (lambda z, y: rlx.cross_entropy(z, y, label_smoothing=1.5), rlx.InputError, r"\[cross_entropy\] label_smoothing"),
    (lambda z, y: rlx.l1_loss(z, z[0]), rlx.ShapeError, r"\[l1_loss\] input \(3, 4\) and target \(4,\) must have the same shape"),
    (lambda z, y: rlx.clip(z), rlx.InputError, r"\[clip\] give lo, hi or both"),
], ids=range(6))
def test_loss_bad_input(call, err, msg):
    with pytest.raises(err, match=msg):
        run_forward(call, {"z": _x((3, 4)), "y": np.zeros(3, np.int32)})


def test_clip_gradient_at_the_bounds_is_pytorchs():
    """torch.clamp: no gradient to x at a bound given as a number; shared half and half with a
    bound given as a tensor (rlx used to pass x's gradient at the bounds in both cases)."""
    x = np.array([-0.5, 2.0, 1.0, -1.0, 3.0], np.float32)
    lo, hi = np.full(5, -0.5, np.float32), np.full(5, 2.0, np.float32)
    _, g = run_grads(lambda m: rlx.clip(m.x * 1.0, -0.5, 2.0).sum(), {"x": x})
    np.testing.assert_array_equal(g["x"], [0, 0, 1, 0, 0])
    _, g = run_grads(lambda m: rlx.clip(m.x * 1.0, m.lo, m.hi).sum(), {"x": x, "lo": lo, "hi": hi})
    np.testing.assert_array_equal(g["x"], [0.5, 0.5, 1, 0, 0])
    np.testing.assert_array_equal(g["lo"], [0.5, 0, 0, 1, 0])
    np.testing.assert_array_equal(g["hi"], [0, 0.5, 0, 0, 1])
