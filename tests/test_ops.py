"""Ops: forward results against numpy and gradients against float64 central finite differences."""

import zlib

import numpy as np
import pytest

import rlx
from conftest import Empty, assert_close, check_op_grads, run_forward, run_grads


def rng_for(*key):
    """A generator seeded from the test's parameters (stable across processes)."""
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def values(rng, shape, domain="any"):
    """float32 test values kept away from points where an op is not smooth."""
    if domain == "any":
        return rng.uniform(-2.0, 2.0, shape).astype(np.float32)
    if domain == "nonzero":  # |x| in [0.2, 2]: away from kinks at 0 and from division by ~0
        mag = rng.uniform(0.2, 2.0, shape)
        sign = rng.choice([-1.0, 1.0], shape)
        return (mag * sign).astype(np.float32)
    if domain == "positive":
        return rng.uniform(0.5, 2.0, shape).astype(np.float32)
    if domain == "distinct":  # no ties anywhere (for max), gaps of at least 0.2
        n = int(np.prod(shape)) if shape else 1
        v = (rng.permutation(n) - n / 2) * 0.25 + rng.uniform(-0.02, 0.02, n)
        return v.reshape(shape).astype(np.float32)
    raise ValueError(domain)


def np_sigmoid(a):
    return 1.0 / (1.0 + np.exp(-a))


def np_log_softmax(a, axis=-1):
    m = np.max(a, axis=axis, keepdims=True)
    s = a - m
    return s - np.log(np.sum(np.exp(s), axis=axis, keepdims=True))


def np_softmax(a, axis=-1):
    return np.exp(np_log_softmax(a, axis))


def np_cross_entropy(logits, labels):
    lp = np_log_softmax(logits, axis=-1)
    return -np.mean(lp[np.arange(len(labels)), labels])


# ----------------------------------------------------------------------------------------------
# unary ops
# ----------------------------------------------------------------------------------------------
UNARY = {
    "neg": (lambda t: -t, lambda a: -a, "any"),
    "relu": (lambda t: rlx.relu(t), lambda a: np.maximum(a, 0.0), "nonzero"),
    "tanh": (lambda t: rlx.tanh(t), np.tanh, "any"),
    "sigmoid": (lambda t: rlx.sigmoid(t), np_sigmoid, "any"),
    "exp": (lambda t: rlx.exp(t), np.exp, "any"),
    "log": (lambda t: rlx.log(t), np.log, "positive"),
    "sqrt": (lambda t: rlx.sqrt(t), np.sqrt, "positive"),
}
UNARY_SHAPES = [(7,), (3, 4), (2, 3, 4)]


@pytest.mark.parametrize("shape", UNARY_SHAPES, ids=str)
@pytest.mark.parametrize("name", list(UNARY))
def test_unary_forward(name, shape):
    op, ref, domain = UNARY[name]
    x = values(rng_for("unary", name, shape), shape, domain)
    out = run_forward(lambda x: op(x), {"x": x})
    assert isinstance(out, np.ndarray)
    assert out.dtype == np.float32
    assert_close(out, ref(x.astype(np.float64)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [(5,), (2, 3, 4)], ids=str)
@pytest.mark.parametrize("name", list(UNARY))
def test_unary_grad(name, shape):
    op, ref, domain = UNARY[name]
    x = values(rng_for("unary-grad", name, shape), shape, domain)
    check_op_grads(op, ref, {"x": x})


def test_relu_large_batch_forward():
    # enough elements to exercise any vectorised / multithreaded path, with exact zeros included
    rng = np.random.default_rng(1)
    x = rng.standard_normal((67, 129)).astype(np.float32)
    x[0, :5] = 0.0
    out = run_forward(lambda x: rlx.relu(x), {"x": x})
    np.testing.assert_array_equal(out, np.maximum(x, 0.0))


# ----------------------------------------------------------------------------------------------
# binary elementwise ops with broadcasting
# ----------------------------------------------------------------------------------------------
BINARY = {
    "add": (lambda a, b: a + b, np.add),
    "sub": (lambda a, b: a - b, np.subtract),
    "mul": (lambda a, b: a * b, np.multiply),
    "div": (lambda a, b: a / b, np.divide),
}
BCAST_SHAPES = [
    ((3, 4), (3, 4)),
    ((3, 4), (4,)),
    ((4,), (3, 4)),
    ((2, 1, 4), (3, 1)),
    ((3, 1), (1, 4)),
    ((2, 3, 4), (1,)),
    ((2, 3, 1), (2, 1, 4)),
]


@pytest.mark.parametrize("shapes", BCAST_SHAPES, ids=str)
@pytest.mark.parametrize("name", list(BINARY))
def test_binary_forward(name, shapes):
    op, ref = BINARY[name]
    rng = rng_for("binary", name, shapes)
    a = values(rng, shapes[0])
    b = values(rng, shapes[1], "nonzero")
    out = run_forward(lambda a, b: op(a, b), {"a": a, "b": b})
    expected = ref(a.astype(np.float64), b.astype(np.float64))
    assert out.shape == np.broadcast_shapes(*shapes)
    assert out.dtype == np.float32
    assert_close(out, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shapes", BCAST_SHAPES, ids=str)
@pytest.mark.parametrize("name", list(BINARY))
def test_binary_grad(name, shapes):
    op, ref = BINARY[name]
    rng = rng_for("binary-grad", name, shapes)
    a = values(rng, shapes[0])
    b = values(rng, shapes[1], "nonzero")
    grads = check_op_grads(op, ref, {"a": a, "b": b})
    # gradients of broadcast operands are reduced back to the operand's own shape
    assert grads["a"].shape == shapes[0]
    assert grads["b"].shape == shapes[1]


SCALAR_CASES = {
    "x+s": (lambda t: t + 2.5, lambda a: a + 2.5, "any"),
    "s+x": (lambda t: 2.5 + t, lambda a: 2.5 + a, "any"),
    "x-s": (lambda t: t - 1.5, lambda a: a - 1.5, "any"),
    "s-x": (lambda t: 1.5 - t, lambda a: 1.5 - a, "any"),
    "x*s": (lambda t: t * -3.0, lambda a: a * -3.0, "any"),
    "s*x": (lambda t: 0.5 * t, lambda a: 0.5 * a, "any"),
    "x/s": (lambda t: t / 4.0, lambda a: a / 4.0, "any"),
    "s/x": (lambda t: 2.0 / t, lambda a: 2.0 / a, "nonzero"),
    "x+int": (lambda t: t + 2, lambda a: a + 2, "any"),
    "int*x": (lambda t: 3 * t, lambda a: 3 * a, "any"),
    "chain": (lambda t: (t * 2.0 - 1.0) / 3.0 + 0.25,
              lambda a: (a * 2.0 - 1.0) / 3.0 + 0.25, "any"),
}


@pytest.mark.parametrize("name", list(SCALAR_CASES))
def test_python_scalar_constants(name):
    op, ref, domain = SCALAR_CASES[name]
    x = values(rng_for("scalar", name), (3, 4), domain)
    out = run_forward(lambda x: op(x), {"x": x})
    assert out.dtype == np.float32
    assert_close(out, ref(x.astype(np.float64)), rtol=1e-5, atol=1e-6)
    check_op_grads(op, ref, {"x": x})


NUMPY_CONST = np.array([0.5, -1.0, 2.0, 3.0], dtype=np.float32)
NUMPY_CASES = {
    "x+C": (lambda t: t + NUMPY_CONST, lambda a: a + NUMPY_CONST),
    "x*C": (lambda t: t * NUMPY_CONST, lambda a: a * NUMPY_CONST),
    "x-C2d": (lambda t: t - NUMPY_CONST.reshape(1, 4) * 2,
              lambda a: a - NUMPY_CONST.reshape(1, 4) * 2),
    "x/C": (lambda t: t / NUMPY_CONST, lambda a: a / NUMPY_CONST),
}


@pytest.mark.parametrize("name", list(NUMPY_CASES))
def test_numpy_array_constants(name):
    op, ref = NUMPY_CASES[name]
    x = values(rng_for("npconst", name), (3, 4))
    out = run_forward(lambda x: op(x), {"x": x})
    assert_close(out, ref(x.astype(np.float64)), rtol=1e-5, atol=1e-6)
    check_op_grads(op, ref, {"x": x})


def test_numpy_array_constant_on_the_left():
    # ndarray (op) Tensor must defer to the Tensor (not build an object array)
    x = values(np.random.default_rng(3), (3, 4))
    out = run_forward(lambda x: NUMPY_CONST * x + NUMPY_CONST - x, {"x": x})
    x64 = x.astype(np.float64)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32
    assert_close(out, NUMPY_CONST * x64 + NUMPY_CONST - x64, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# integer division, floor division, remainder, int/float promotion (numpy's rules, float32)
# ----------------------------------------------------------------------------------------------
INT_A = np.array([7, -7, 7, -7, 0, 5, -(2**31), 2**31 - 1, -1, 3], dtype=np.int32)
INT_B = np.array([2, 2, -2, -2, 3, 7, -1, -1, 5, -(2**31)], dtype=np.int32)


def test_int_true_division_gives_float32():
    out = run_forward(lambda a, b: a / b, {"a": INT_A, "b": INT_B})
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, (INT_A / INT_B).astype(np.float32))  # float64 rounded once


def test_int_true_division_by_zero_is_inf_or_nan():
    a = np.array([1, -1, 0], np.int32)
    with np.errstate(divide="ignore", invalid="ignore"):
        expected = (a / np.zeros(3, np.int32)).astype(np.float32)
    out = run_forward(lambda a, b: a / b, {"a": a, "b": np.zeros(3, np.int32)})
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("name", ["//", "%"])
def test_int_floor_division_and_remainder_match_numpy(name):
    op = (lambda a, b: a // b) if name == "//" else (lambda a, b: a % b)
    with np.errstate(over="ignore"):
        expected = op(INT_A, INT_B)  # INT_MIN // -1 wraps to INT_MIN, as numpy's
    out = run_forward(op, {"a": INT_A, "b": INT_B})
    assert out.dtype == np.int32
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("name", ["//", "%"])
def test_int_floor_division_broadcasts_and_takes_scalars(name):
    op = (lambda a, b: a // b) if name == "//" else (lambda a, b: a % b)
    rng = np.random.default_rng(5)
    a = rng.integers(-50, 50, (3, 4)).astype(np.int32)
    b = rng.choice([-7, -3, 2, 5], (4,)).astype(np.int32)
    out = run_forward(lambda a, b: (op(a, b), op(a, 3), op(-9, b)), {"a": a, "b": b})
    for got, want in zip(out, (op(a, b), op(a, 3), op(-9, b))):
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", ["//", "%"])
def test_int_division_by_zero_raises_at_run_time(name):
    op = (lambda a, b: a // b) if name == "//" else (lambda a, b: a % b)
    fn = rlx.compile(lambda m, a, b: op(a, b), Empty(),
                     {"a": rlx.InputSpec((3,), "int32"), "b": rlx.InputSpec((3,), "int32")})
    a = np.array([1, 2, 3], np.int32)
    with pytest.raises(rlx.RlxError, match=r"\[(floor_divide|remainder)\] integer division by zero"):
        fn(a=a, b=np.array([1, 0, 2], np.int32))
    # the function keeps working with a valid divisor
    np.testing.assert_array_equal(fn(a=a, b=np.array([2, 2, 2], np.int32)), op(a, np.int32(2)))


def test_int_division_by_zero_in_a_train_step_changes_nothing():
    from conftest import make_module

    model = make_module(w=np.array([1.0, 2.0, 3.0], np.float32))
    step = rlx.compile_train_step(lambda m, i, d: (m.w * (i // d).astype("float32")).sum(), model,
                                  rlx.optim.SGD(lr=0.5), {"i": rlx.InputSpec((3,), "int32"), "d": rlx.InputSpec((3,), "int32")})
    i = np.array([4, 5, 6], np.int32)
    with pytest.raises(rlx.RlxError, match=r"\[floor_divide\] integer division by zero"):
        step(i=i, d=np.array([2, 0, 2], np.int32))
    np.testing.assert_array_equal(model.w.numpy(), [1.0, 2.0, 3.0])  # no update ran
    assert step(i=i, d=np.array([2, 2, 2], np.int32)) == 1.0 * 2 + 2.0 * 2 + 3.0 * 3
    np.testing.assert_array_equal(model.w.numpy(), [1.0 - 0.5 * 2, 2.0 - 0.5 * 2, 3.0 - 0.5 * 3])


@pytest.mark.parametrize("name", ["//", "%"])
def test_float_floor_division_and_remainder_match_numpy(name):
    op, ref = ((lambda a, b: a // b), np.floor_divide) if name == "//" else ((lambda a, b: a % b), np.remainder)
    a = np.array([7.5, -7.5, 7.5, -7.5, 0.0, -0.0, 1.0, -1.0, 5.0, 3.0], np.float32)
    b = np.array([2.0, 2.0, -2.0, -2.0, 3.0, 3.0, 0.0, np.inf, 0.1, -0.0], np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        expected = ref(a, b)
    out = run_forward(op, {"a": a, "b": b})
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, expected)  # NaN and the sign of zero included


def test_float_remainder_gradient_against_finite_differences():
    rng = np.random.default_rng(6)
    a = rng.uniform(0.1, 0.9, (3, 4)).astype(np.float32) + rng.integers(-3, 3, (3, 4))  # away from jumps
    b = rng.choice([1.0, 2.0], (4,)).astype(np.float32)  # a/b never an integer
    check_op_grads(lambda a, b: a % b, np.remainder, {"a": a.astype(np.float32), "b": b})


def test_floor_division_has_zero_gradient():
    a = np.array([1.5, -2.5, 3.2], np.float32)
    _, grads = run_grads(lambda m: ((m.a // 2.0) * m.a).sum(), {"a": a})
    np.testing.assert_array_equal(grads["a"], np.floor_divide(a, 2.0))  # d(a // 2)/da = 0


PROMOTION = {  # name: (rlx op, numpy reference, result dtype)
    "int+float": (lambda i, f: i + 1.5, None, "float32"),
    "int*int": (lambda i, f: i * 3, None, "int32"),
    "float+int": (lambda i, f: f + 2, None, "float32"),
    "int+floattensor": (lambda i, f: i + f, None, "float32"),
    "floattensor-int": (lambda i, f: f - i, None, "float32"),
    "int<float": (lambda i, f: i < 1.5, None, "float32"),
    "where(int, float)": (lambda i, f: rlx.where(f > 0, i, 0.5), lambda i, f: np.where(f > 0, i, 0.5), "float32"),
    "where(int, int)": (lambda i, f: rlx.where(f > 0, i, -1), lambda i, f: np.where(f > 0, i, -1), "int32"),
    "neg int": (lambda i, f: -i, None, "int32"),
    "int+float64 array": (lambda i, f: i + np.array([0.25, 0.5, 0.75]), None, "float32"),
    "int+int array": (lambda i, f: i + np.array([1, 2, 3]), None, "int32"),
    "relu int": (lambda i, f: rlx.relu(i), lambda i, f: np.maximum(i, 0), "int32"),
    "exp int": (lambda i, f: rlx.exp(i // 2**28), lambda i, f: np.exp(i // 2**28), "float32"),
    "sqrt int": (lambda i, f: rlx.sqrt(i * i), lambda i, f: np.sqrt((i * i).astype(np.float64)), "float32"),
    "concat(int, float)": (lambda i, f: rlx.concat([i, f]), lambda i, f: np.concatenate([i, f]), "float32"),
    "concat(int, int)": (lambda i, f: rlx.concat([i, i]), lambda i, f: np.concatenate([i, i]), "int32"),
    "int**0": (lambda i, f: i**0, None, "int32"),
    "int**1": (lambda i, f: i**1, None, "int32"),
    "int**5": (lambda i, f: i**5, None, "int32"),
    "int**0.5": (lambda i, f: (i * i) ** 0.5, lambda i, f: ((i * i).astype(np.float32) ** 0.5), "float32"),
}


@pytest.mark.parametrize("name", list(PROMOTION))
def test_int_float_promotion_follows_numpy(name):
    op, ref, dtype = PROMOTION[name]
    i = np.array([-(2**31), -2, 5], np.int32)
    f = np.array([0.5, -1.25, 3.0], np.float32)
    out = run_forward(op, {"i": i, "f": f})
    assert out.dtype == np.dtype(dtype)
    with np.errstate(over="ignore"):
        expected = np.asarray((ref or op)(i, f))  # numpy's result (float64 where numpy promotes)
    if name in ("exp int", "sqrt int", "int**0.5"):  # transcendental: float32 rounding
        assert_close(out, expected, rtol=1e-6, atol=0)
    else:
        np.testing.assert_array_equal(out, expected.astype(dtype))


def test_int_to_a_negative_int_power_is_a_dtype_error():
    with pytest.raises(rlx.DTypeError, match=r"\[pow\].*negative int power"):
        run_forward(lambda i: i**-1, {"i": np.ones(3, np.int32)})


def test_pow_of_negative_infinity_follows_c_pow():
    # C's pow and numpy: (-inf) ** -0.5 is 0 (PyTorch's pow gives NaN here; a documented difference)
    x = np.array([-np.inf, np.inf, -4.0, 0.0], np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        expected = np.power(x, np.float32(-0.5))
    np.testing.assert_array_equal(run_forward(lambda x: x**-0.5, {"x": x}), expected)


def test_int_constant_out_of_range_is_a_dtype_error():
    with pytest.raises(rlx.DTypeError, match=r"\[constant\].*int32"):
        run_forward(lambda i: i + 2**40, {"i": np.zeros(3, np.int32)})


# ----------------------------------------------------------------------------------------------
# NaN through backward passes (as PyTorch: relu passes the upstream gradient at NaN)
# ----------------------------------------------------------------------------------------------
def test_relu_gradient_at_nan_passes_through():
    x = np.array([np.nan, 1.0, -1.0, 0.0], np.float32)
    # d/dx relu(x) * w: w where x > 0, 0 where x <= 0, and w at NaN (PyTorch's threshold_backward)
    w = np.array([2.0, 3.0, 4.0, 5.0], np.float32)
    _, grads = run_grads(lambda m, w: (rlx.relu(m.x * 1.0) * w).sum(), {"x": x}, {"w": w})
    np.testing.assert_array_equal(grads["x"], [2.0, 3.0, 0.0, 0.0])
    out = run_forward(lambda x: rlx.relu(x), {"x": x})
    np.testing.assert_array_equal(out, [np.nan, 1.0, 0.0, 0.0])


def test_nan_propagates_through_backward_of_max_where_and_unary_ops():
    x = np.array([[np.nan, 1.0, 2.0], [0.5, 3.0, 1.0]], np.float32)
    # max: a row holding NaN has a NaN maximum, and gets NaN gradients (PyTorch's amax)
    _, g = run_grads(lambda m: m.x.max(axis=1).sum(), {"x": x})
    assert np.isnan(g["x"][0]).all()
    np.testing.assert_array_equal(g["x"][1], [0.0, 1.0, 0.0])
    for name, f in {"tanh": rlx.tanh, "sigmoid": rlx.sigmoid, "exp": rlx.exp, "gelu": rlx.gelu,
                    "sqrt": rlx.sqrt, "log": rlx.log, "pow": lambda t: t**3}.items():
        _, g = run_grads(lambda m, f=f: f(m.x).sum(), {"x": x})
        assert np.isnan(g["x"][0, 0]), name
        assert np.isfinite(g["x"][1]).all(), name
    # where: the NaN sits in the branch not taken, so no gradient reaches it; the taken branch
    # passes the upstream gradient unchanged
    _, g = run_grads(lambda m: rlx.where(m.x > 1.5, m.x, 0.0).sum(), {"x": x})
    np.testing.assert_array_equal(g["x"], [[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])


# ----------------------------------------------------------------------------------------------
# pow
# ----------------------------------------------------------------------------------------------
POW_CASES = [(2, "any"), (3, "any"), (2.0, "any"), (0.5, "positive"), (-1.0, "positive"),
             (1.5, "positive"), (-0.5, "positive")]


@pytest.mark.parametrize("exponent,domain", POW_CASES, ids=[str(p[0]) for p in POW_CASES])
def test_pow_scalar(exponent, domain):
    x = values(rng_for("pow", exponent), (3, 4), domain)
    out = run_forward(lambda x: x ** exponent, {"x": x})
    expected = np.power(x.astype(np.float64), exponent)
    assert_close(out, expected, rtol=1e-5, atol=1e-6)
    check_op_grads(lambda t: t ** exponent, lambda a: np.power(a, exponent), {"x": x})


# ----------------------------------------------------------------------------------------------
# reductions
# ----------------------------------------------------------------------------------------------
AXES = [None, 0, 1, -1, (0, 2), (-1, -2), (0, 1, 2)]
REDUCE_NP = {"sum": np.sum, "mean": np.mean, "max": np.max}


def _reduce(t, name, axis, keepdims):
    return getattr(t, name)(axis=axis, keepdims=keepdims)


@pytest.mark.parametrize("keepdims", [False, True])
@pytest.mark.parametrize("axis", AXES, ids=str)
@pytest.mark.parametrize("name", list(REDUCE_NP))
def test_reduce_forward(name, axis, keepdims):
    x = values(rng_for("reduce", name, axis, keepdims), (2, 3, 4), "distinct")
    out = run_forward(lambda x: _reduce(x, name, axis, keepdims), {"x": x})
    expected = REDUCE_NP[name](x.astype(np.float64), axis=axis, keepdims=keepdims)
    assert np.shape(out) == np.shape(expected)
    assert_close(out, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("keepdims", [False, True])
@pytest.mark.parametrize("axis", AXES, ids=str)
@pytest.mark.parametrize("name", list(REDUCE_NP))
def test_reduce_grad(name, axis, keepdims):
    x = values(rng_for("reduce-grad", name, axis, keepdims), (2, 3, 4), "distinct")
    check_op_grads(
        lambda t: _reduce(t, name, axis, keepdims),
        lambda a: REDUCE_NP[name](a, axis=axis, keepdims=keepdims),
        {"x": x},
    )


def test_reduce_defaults_are_full_reductions():
    x = values(np.random.default_rng(5), (3, 4), "distinct")
    s, m, mx = run_forward(lambda x: (x.sum(), x.mean(), x.max()), {"x": x})
    x64 = x.astype(np.float64)
    assert np.shape(s) == () and np.shape(m) == () and np.shape(mx) == ()
    assert_close(s, x64.sum(), rtol=1e-5, atol=1e-6)
    assert_close(m, x64.mean(), rtol=1e-5, atol=1e-6)
    assert_close(mx, x64.max(), rtol=1e-6, atol=0)


def test_max_of_negative_values():
    # a max kernel that starts its accumulator at 0 instead of -inf gets this wrong
    x = -values(np.random.default_rng(6), (4, 5), "positive")
    out = run_forward(lambda x: x.max(axis=1), {"x": x})
    assert_close(out, x.max(axis=1), rtol=1e-6, atol=0)


def test_sum_large_rows():
    rng = np.random.default_rng(7)
    x = rng.uniform(0.0, 1.0, (33, 1000)).astype(np.float32)
    out = run_forward(lambda x: (x.sum(axis=1), x.mean(axis=0)), {"x": x})
    assert_close(out[0], x.astype(np.float64).sum(axis=1), rtol=1e-5, atol=1e-5)
    assert_close(out[1], x.astype(np.float64).mean(axis=0), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# reshape / transpose
# ----------------------------------------------------------------------------------------------
RESHAPES = [((2, 3, 4), (6, 4)), ((2, 3, 4), (4, 6)), ((2, 3, 4), (24,)), ((6, 4), (2, 3, 4)),
            ((2, 3, 4), (2, 12)), ((12,), (3, 1, 4))]


@pytest.mark.parametrize("as_tuple", [False, True])
@pytest.mark.parametrize("src,dst", RESHAPES, ids=str)
def test_reshape(src, dst, as_tuple):
    x = values(rng_for("reshape", src, dst), src)

    def op(t):
        return t.reshape(dst) if as_tuple else t.reshape(*dst)

    out = run_forward(lambda x: op(x), {"x": x})
    np.testing.assert_array_equal(out, x.reshape(dst))
    check_op_grads(op, lambda a: a.reshape(dst), {"x": x})


def test_reshape_minus_one():
    x = values(np.random.default_rng(8), (2, 3, 4))
    out = run_forward(lambda x: x.reshape(-1, 4), {"x": x})
    np.testing.assert_array_equal(out, x.reshape(-1, 4))


TRANSPOSES = [((2, 3, 4), ()), ((2, 3, 4), (1, 0, 2)), ((2, 3, 4), (2, 0, 1)),
              ((2, 3, 4), (0, 2, 1)), ((3, 4), (1, 0)), ((3, 4), ())]


@pytest.mark.parametrize("as_tuple", [False, True])
@pytest.mark.parametrize("shape,axes", TRANSPOSES, ids=str)
def test_transpose(shape, axes, as_tuple):
    x = values(rng_for("transpose", shape, axes), shape)

    def op(t):
        if as_tuple and axes:
            return t.transpose(axes)
        return t.transpose(*axes)

    def ref(a):
        return np.transpose(a, axes or None)

    out = run_forward(lambda x: op(x), {"x": x})
    np.testing.assert_array_equal(out, ref(x))
    check_op_grads(op, ref, {"x": x})


def test_T_property():
    x = values(np.random.default_rng(9), (3, 5))
    out = run_forward(lambda x: x.T, {"x": x})
    np.testing.assert_array_equal(out, x.T)
    check_op_grads(lambda t: t.T, lambda a: a.T, {"x": x})


def test_transpose_then_elementwise_and_reduce():
    # a lazy transpose must be materialised with the right strides before elementwise/reductions
    rng = np.random.default_rng(10)
    x = values(rng, (3, 5))
    y = values(rng, (5, 3))
    out = run_forward(lambda x, y: (x.T * y + 1.0).sum(axis=0), {"x": x, "y": y})
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    assert_close(out, (x64.T * y64 + 1.0).sum(axis=0), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# matmul
# ----------------------------------------------------------------------------------------------
MATMUL_SHAPES = [
    ((3, 4), (4, 5)),
    ((1, 4), (4, 1)),
    ((2, 3, 4), (4, 5)),
    ((2, 3, 4), (2, 4, 5)),
    ((3, 4), (2, 4, 5)),
    ((2, 2, 3, 4), (2, 2, 4, 5)),
    ((2, 1, 3, 4), (3, 4, 5)),
]


@pytest.mark.parametrize("use_fn", [False, True], ids=["@", "rlx.matmul"])
@pytest.mark.parametrize("shapes", MATMUL_SHAPES, ids=str)
def test_matmul_forward(shapes, use_fn):
    rng = rng_for("matmul", shapes)
    a, b = values(rng, shapes[0]), values(rng, shapes[1])
    op = (lambda a, b: rlx.matmul(a, b)) if use_fn else (lambda a, b: a @ b)
    out = run_forward(lambda a, b: op(a, b), {"a": a, "b": b})
    expected = np.matmul(a.astype(np.float64), b.astype(np.float64))
    assert out.shape == expected.shape
    assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shapes", MATMUL_SHAPES, ids=str)
def test_matmul_grad(shapes):
    rng = rng_for("matmul-grad", shapes)
    a, b = values(rng, shapes[0]), values(rng, shapes[1])
    grads = check_op_grads(lambda a, b: a @ b, np.matmul, {"a": a, "b": b})
    assert grads["a"].shape == shapes[0] and grads["b"].shape == shapes[1]


def test_matmul_large_odd_sizes():
    rng = np.random.default_rng(11)
    a = rng.standard_normal((65, 130)).astype(np.float32)
    b = rng.standard_normal((130, 97)).astype(np.float32)
    out = run_forward(lambda a, b: a @ b, {"a": a, "b": b})
    assert_close(out, a.astype(np.float64) @ b.astype(np.float64), rtol=1e-4, atol=1e-4)


def test_matmul_with_transposed_operands():
    rng = np.random.default_rng(12)
    a = values(rng, (4, 3))
    b = values(rng, (5, 4))
    ref = lambda a, b: a.T @ b.T  # noqa: E731
    out = run_forward(lambda a, b: a.T @ b.T, {"a": a, "b": b})
    assert_close(out, ref(a.astype(np.float64), b.astype(np.float64)), rtol=1e-5, atol=1e-5)
    check_op_grads(lambda a, b: a.T @ b.T, ref, {"a": a, "b": b})


def test_transposed_operands_of_batched_products_are_read_in_place():
    """``q @ k.transpose(0, 1, 3, 2)`` and ``x @ w.T`` compute as numpy does, forward and gradient,
    and the training program holds no transpose at all (the product reads the operand with its
    transpose flag, and so do the products autodiff derives from it); a transpose of other axes
    stays a transpose."""
    rng = np.random.default_rng(14)
    q, k, w = values(rng, (2, 3, 5, 4)), values(rng, (2, 3, 6, 4)), values(rng, (7, 6))
    ref = lambda q, k, w: (q @ np.swapaxes(k, -1, -2)) @ w.T  # noqa: E731
    f = lambda q, k, w: (q @ k.transpose(0, 1, 3, 2)) @ w.T  # noqa: E731
    inputs = {"q": q, "k": k, "w": w}
    out = run_forward(f, inputs)
    assert_close(out, ref(*(v.astype(np.float64) for v in inputs.values())), rtol=1e-5, atol=1e-5)
    check_op_grads(f, ref, inputs)
    model = rlx.nn.Module()
    model.w = rlx.nn.Parameter(w)
    spec = {"q": rlx.InputSpec(q.shape), "k": rlx.InputSpec(k.shape)}
    step = rlx.compile_train_step(lambda m, q, k: ((q @ k.transpose(0, 1, 3, 2)) @ m.w.T).sum(), model,
                                  rlx.optim.SGD(lr=0.1), spec)
    step(q=q, k=k)
    assert "matmul" in step.graph() and "transpose" not in step.graph()
    fn = rlx.compile(lambda m, q: q.transpose((1, 0, 2, 3)) @ m.w[:4, :4], model, {"q": rlx.InputSpec(q.shape)})
    got = fn(q=q)
    w_now = model.w.numpy()[:4, :4].astype(np.float64)  # after the SGD step
    assert_close(got, np.transpose(q, (1, 0, 2, 3)).astype(np.float64) @ w_now, rtol=1e-5, atol=1e-5)
    assert "transpose" in fn.graph()


def test_matmul_with_numpy_constant():
    rng = np.random.default_rng(13)
    x = values(rng, (3, 4))
    W = values(rng, (4, 2))
    out = run_forward(lambda x: x @ W, {"x": x})
    assert_close(out, x.astype(np.float64) @ W.astype(np.float64), rtol=1e-5, atol=1e-5)
    check_op_grads(lambda t: t @ W, lambda a: a @ W.astype(np.float64), {"x": x})


# ----------------------------------------------------------------------------------------------
# softmax / log_softmax
# ----------------------------------------------------------------------------------------------
SOFTMAX_CASES = [((3, 5), -1), ((3, 5), 0), ((2, 3, 4), -1), ((2, 3, 4), 0), ((2, 3, 4), 1),
                 ((6,), -1)]


@pytest.mark.parametrize("shape,axis", SOFTMAX_CASES, ids=str)
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_softmax_forward(shape, axis, log):
    x = values(rng_for("softmax", shape, axis, log), shape)
    rfn = rlx.log_softmax if log else rlx.softmax
    nfn = np_log_softmax if log else np_softmax
    out = run_forward(lambda x: rfn(x, axis=axis), {"x": x})
    assert_close(out, nfn(x.astype(np.float64), axis), rtol=1e-5, atol=1e-6)
    if not log:
        assert_close(out.sum(axis=axis), np.ones(np.delete(np.array(shape), axis)), rtol=1e-5,
                     atol=1e-6)


@pytest.mark.parametrize("shape,axis", SOFTMAX_CASES, ids=str)
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_softmax_grad(shape, axis, log):
    x = values(rng_for("softmax-grad", shape, axis, log), shape)
    rfn = rlx.log_softmax if log else rlx.softmax
    nfn = np_log_softmax if log else np_softmax
    check_op_grads(lambda t: rfn(t, axis=axis), lambda a: nfn(a, axis), {"x": x})


def test_softmax_default_axis_is_last():
    x = values(np.random.default_rng(14), (3, 4))
    s, ls = run_forward(lambda x: (rlx.softmax(x), rlx.log_softmax(x)), {"x": x})
    assert_close(s, np_softmax(x.astype(np.float64), -1), rtol=1e-5, atol=1e-6)
    assert_close(ls, np_log_softmax(x.astype(np.float64), -1), rtol=1e-5, atol=1e-6)


def test_softmax_is_numerically_stable():
    x = np.array([[1000.0, 1001.0, 1002.0], [-1000.0, -1001.0, -1002.0]], dtype=np.float32)
    s, ls = run_forward(lambda x: (rlx.softmax(x), rlx.log_softmax(x)), {"x": x})
    x64 = x.astype(np.float64)
    assert_close(s, np_softmax(x64), rtol=1e-5, atol=1e-6)
    assert_close(ls, np_log_softmax(x64), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# losses
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,c", [(5, 4), (8, 10), (1, 3), (33, 7)])
def test_cross_entropy(n, c):
    rng = rng_for("ce", n, c)
    logits = values(rng, (n, c))
    labels = rng.integers(0, c, n).astype(np.int32)
    out = run_forward(lambda x, y: rlx.cross_entropy(x, y), {"x": logits, "y": labels})
    assert np.shape(out) == ()
    assert_close(out, np_cross_entropy(logits.astype(np.float64), labels), rtol=1e-5, atol=1e-6)

    grads = check_op_grads(
        lambda t, y: rlx.cross_entropy(t, y),
        lambda a, y: np_cross_entropy(a, y),
        {"logits": logits},
        arrays={"y": labels},
    )
    # analytic form too: (softmax - onehot) / N, scaled by the scalar weight the helper used
    sm = np_softmax(logits.astype(np.float64))
    onehot = np.eye(c)[labels]
    direction = (sm - onehot) / n
    g = grads["logits"]
    w = np.sum(g * direction) / np.sum(direction * direction)
    assert_close(g, w * direction, rtol=1e-3, atol=1e-5)


def test_cross_entropy_large_logits_is_stable():
    logits = np.array([[500.0, 0.0, -500.0], [0.0, 800.0, 1.0]], dtype=np.float32)
    labels = np.array([0, 2], dtype=np.int32)
    out = run_forward(lambda x, y: rlx.cross_entropy(x, y), {"x": logits, "y": labels})
    assert_close(out, np_cross_entropy(logits.astype(np.float64), labels), rtol=1e-5, atol=1e-4)


def test_cross_entropy_with_constant_labels():
    rng = np.random.default_rng(15)
    logits = values(rng, (6, 5))
    labels = rng.integers(0, 5, 6).astype(np.int32)
    out = run_forward(lambda x: rlx.cross_entropy(x, labels), {"x": logits})
    assert_close(out, np_cross_entropy(logits.astype(np.float64), labels), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [(5,), (3, 4), (2, 3, 4)], ids=str)
def test_mse_loss(shape):
    rng = rng_for("mse", shape)
    pred, target = values(rng, shape), values(rng, shape)
    out = run_forward(lambda p, t: rlx.mse_loss(p, t), {"p": pred, "t": target})
    expected = np.mean((pred.astype(np.float64) - target.astype(np.float64)) ** 2)
    assert np.shape(out) == ()
    assert_close(out, expected, rtol=1e-5, atol=1e-6)
    # gradient with respect to both arguments
    check_op_grads(
        lambda p, t: rlx.mse_loss(p, t), lambda p, t: np.mean((p - t) ** 2),
        {"pred": pred, "target": target},
    )


def test_mse_loss_grad_against_input_target():
    rng = np.random.default_rng(16)
    pred, target = values(rng, (4, 3)), values(rng, (4, 3))
    check_op_grads(
        lambda p, t: rlx.mse_loss(p, t), lambda p, t: np.mean((p - t) ** 2),
        {"pred": pred}, arrays={"t": target},
    )


# ----------------------------------------------------------------------------------------------
# where / comparisons
# ----------------------------------------------------------------------------------------------
def test_where_forward_and_grad():
    rng = np.random.default_rng(17)
    a = values(rng, (3, 4), "distinct")
    b = values(rng, (3, 4), "distinct") + 0.1  # no ties with a
    out = run_forward(lambda a, b: rlx.where(a > b, a, b), {"a": a, "b": b})
    np.testing.assert_array_equal(out, np.where(a > b, a, b))
    check_op_grads(
        lambda a, b: rlx.where(a > b, a, b) * 1.0,
        lambda a, b: np.where(a > b, a, b),
        {"a": a, "b": b},
    )


def test_where_broadcasting():
    rng = np.random.default_rng(18)
    x = values(rng, (3, 4), "nonzero")
    b = values(rng, (4,))
    ref = lambda x, b: np.where(x > 0.0, x * 2.0, b)  # noqa: E731
    out = run_forward(lambda x, b: rlx.where(x > 0.0, x * 2.0, b), {"x": x, "b": b})
    assert_close(out, ref(x, b), rtol=1e-6, atol=0)
    grads = check_op_grads(lambda x, b: rlx.where(x > 0.0, x * 2.0, b), ref, {"x": x, "b": b})
    assert grads["b"].shape == (4,)


def test_where_with_mask_input():
    rng = np.random.default_rng(19)
    m = (rng.uniform(size=(2, 5)) > 0.5).astype(np.float32)
    a, b = values(rng, (2, 5)), values(rng, (2, 5))
    out = run_forward(lambda mask, a, b: rlx.where(mask, a, b), {"mask": m, "a": a, "b": b})
    np.testing.assert_array_equal(out, np.where(m != 0, a, b))


COMPARISONS = {
    "<": (lambda a, b: a < b, np.less),
    ">": (lambda a, b: a > b, np.greater),
    "<=": (lambda a, b: a <= b, np.less_equal),
    ">=": (lambda a, b: a >= b, np.greater_equal),
    "==": (lambda a, b: a == b, np.equal),
    "!=": (lambda a, b: a != b, np.not_equal),
}


@pytest.mark.parametrize("shapes", [((3, 4), (3, 4)), ((3, 4), (4,)), ((2, 1, 3), (4, 1))], ids=str)
@pytest.mark.parametrize("name", list(COMPARISONS))
def test_comparison_tensor_tensor(name, shapes):
    op, ref = COMPARISONS[name]
    rng = rng_for("cmp", name, shapes)
    # small integers so that ties (where <= and < differ) really occur
    a = rng.integers(-2, 3, shapes[0]).astype(np.float32)
    b = rng.integers(-2, 3, shapes[1]).astype(np.float32)
    out = run_forward(lambda a, b: op(a, b), {"a": a, "b": b})
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, ref(a, b).astype(np.float32))


@pytest.mark.parametrize("name", list(COMPARISONS))
def test_comparison_with_scalar(name):
    op, ref = COMPARISONS[name]
    a = np.array([[-1.0, 0.0, 1.0, 2.0], [1.0, 1.0, -3.0, 0.5]], dtype=np.float32)
    out = run_forward(lambda a: op(a, 1.0), {"a": a})
    np.testing.assert_array_equal(out, ref(a, 1.0).astype(np.float32))


def test_comparison_scalar_on_left_and_mask_arithmetic():
    a = np.array([-1.0, 0.0, 0.5, 2.0, 3.0], dtype=np.float32)
    out = run_forward(lambda a: (0.5 < a) * a + (a <= 0.0) * 10.0, {"a": a})
    np.testing.assert_array_equal(out, ((0.5 < a) * a + (a <= 0.0) * 10.0).astype(np.float32))


# ----------------------------------------------------------------------------------------------
# tensor metadata, multiple outputs, composites
# ----------------------------------------------------------------------------------------------
def test_tensor_metadata_during_trace():
    seen = {}

    def fn(m, x, y):
        h = x @ np.ones((4, 6), dtype=np.float32)
        seen["x"] = (x.shape, x.dtype, x.ndim)
        seen["y"] = (y.shape, y.dtype, y.ndim)
        seen["h"] = (h.shape, h.ndim)
        seen["s"] = h.sum(axis=1, keepdims=True).shape
        return h

    from conftest import Empty

    rlx.compile(fn, Empty(), {"x": rlx.InputSpec((3, 4)), "y": rlx.InputSpec((3,), dtype="int32")})
    assert seen["x"] == ((3, 4), "float32", 2)
    assert seen["y"] == ((3,), "int32", 1)
    assert seen["h"] == ((3, 6), 2)
    assert seen["s"] == (3, 1)
    assert all(isinstance(d, int) for d in seen["x"][0])


def test_tuple_outputs():
    x = values(np.random.default_rng(20), (3, 4))
    out = run_forward(lambda x: (x + 1.0, x.sum(axis=0), rlx.relu(x)), {"x": x})
    assert isinstance(out, tuple) and len(out) == 3
    assert_close(out[0], x + 1.0, rtol=1e-6, atol=1e-6)
    assert_close(out[1], x.astype(np.float64).sum(axis=0), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(out[2], np.maximum(x, 0))


def test_composite_mlp_grad():
    rng = np.random.default_rng(21)
    x = values(rng, (5, 4))
    params = {"w1": values(rng, (4, 6)) * 0.5, "b1": values(rng, (6,)) * 0.1,
              "w2": values(rng, (6, 3)) * 0.5}

    def rlx_fn(w1, b1, w2, x):
        return rlx.tanh(x @ w1 + b1) @ w2

    def np_fn(w1, b1, w2, x):
        return np.tanh(x @ w1 + b1) @ w2

    check_op_grads(rlx_fn, np_fn, params, arrays={"x": x})


def test_parameter_used_twice_accumulates_grad():
    x = values(np.random.default_rng(22), (3, 3))
    check_op_grads(lambda t: t * t + t @ t + t.T, lambda a: a * a + a @ a + a.T, {"x": x})


def test_unused_parameter_has_zero_grad():
    rng = np.random.default_rng(23)
    x, unused = values(rng, (3,)), values(rng, (2,))
    loss, grads = run_grads(lambda m: (m.x * m.x).sum(), {"x": x, "unused": unused})
    assert_close(loss, float(np.sum(x.astype(np.float64) ** 2)), rtol=1e-5, atol=1e-6)
    assert_close(grads["x"], 2 * x.astype(np.float64), rtol=1e-5, atol=1e-6)
    if "unused" in grads:
        np.testing.assert_array_equal(grads["unused"], np.zeros(2, np.float32))


# ----------------------------------------------------------------------------------------------
# trace-time errors
# ----------------------------------------------------------------------------------------------
def _trace(fn, arrays_specs):
    from conftest import Empty

    return rlx.compile(fn, Empty(), arrays_specs)


F = lambda *shape: rlx.InputSpec(shape)  # noqa: E731
I32 = lambda *shape: rlx.InputSpec(shape, dtype="int32")  # noqa: E731


def test_matmul_shape_error_names_op_and_shapes():
    with pytest.raises(rlx.ShapeError, match="(?i)matmul") as info:
        _trace(lambda m, a, b: a @ b, {"a": F(3, 4), "b": F(5, 6)})
    assert isinstance(info.value, ValueError) and isinstance(info.value, rlx.RlxError)
    msg = str(info.value)
    assert "3" in msg and "4" in msg and "5" in msg and "6" in msg


def test_matmul_function_shape_error():
    with pytest.raises(rlx.ShapeError, match="(?i)matmul"):
        _trace(lambda m, a, b: rlx.matmul(a, b), {"a": F(3, 4), "b": F(5, 6)})


def test_batched_matmul_incompatible_batch_dims():
    with pytest.raises(rlx.ShapeError, match="(?i)matmul"):
        _trace(lambda m, a, b: a @ b, {"a": F(2, 3, 4), "b": F(3, 4, 5)})


def test_add_broadcast_error():
    with pytest.raises(rlx.ShapeError, match="(?i)(add|broadcast)"):
        _trace(lambda m, a, b: a + b, {"a": F(3, 4), "b": F(5)})


def test_mul_broadcast_error():
    with pytest.raises(rlx.ShapeError, match="(?i)(mul|broadcast)"):
        _trace(lambda m, a, b: a * b, {"a": F(2, 3), "b": F(3, 2)})


def test_add_numpy_constant_broadcast_error():
    with pytest.raises(rlx.ShapeError):
        _trace(lambda m, a: a + np.ones(5, dtype=np.float32), {"a": F(3, 4)})


def test_reshape_size_mismatch():
    with pytest.raises(rlx.ShapeError, match="(?i)reshape"):
        _trace(lambda m, a: a.reshape(5, 2), {"a": F(3, 4)})


def test_reduce_axis_out_of_range():
    with pytest.raises(rlx.ShapeError):
        _trace(lambda m, a: a.sum(axis=2), {"a": F(3, 4)})


def test_cross_entropy_float_labels_is_dtype_error():
    with pytest.raises(rlx.DTypeError, match="(?i)(cross_entropy|label)") as info:
        _trace(lambda m, x, y: rlx.cross_entropy(x, y), {"x": F(4, 3), "y": F(4)})
    assert isinstance(info.value, TypeError) and isinstance(info.value, rlx.RlxError)


def test_cross_entropy_label_count_mismatch():
    with pytest.raises(rlx.ShapeError, match="(?i)(cross_entropy|label)"):
        _trace(lambda m, x, y: rlx.cross_entropy(x, y), {"x": F(4, 3), "y": I32(5)})


def test_mse_loss_shape_mismatch():
    with pytest.raises(rlx.ShapeError, match="(?i)mse"):
        _trace(lambda m, p, t: rlx.mse_loss(p, t), {"p": F(3, 4), "t": F(4, 3)})


def test_train_step_loss_must_be_scalar():
    from conftest import make_module

    model = make_module(w=np.ones((3, 4), np.float32))
    with pytest.raises(rlx.RlxError):
        rlx.compile_train_step(lambda m: m.w * 2.0, model, rlx.optim.SGD(lr=0.1), {})



# ----------------------------------------------------------------------------------------------
# property-based: random broadcastable shapes and random reduction axes
# ----------------------------------------------------------------------------------------------
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.extra import numpy as hnp  # noqa: E402


@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(
    shapes=hnp.mutually_broadcastable_shapes(num_shapes=2, min_dims=0, max_dims=4, max_side=4),
    name=st.sampled_from(["add", "sub", "mul", "div"]),
    seed=st.integers(0, 2**16),
)
def test_binary_broadcasting_property(shapes, name, seed):
    a_shape, b_shape = shapes.input_shapes
    op, ref = BINARY[name]
    rng = np.random.default_rng(seed)
    a = values(rng, a_shape)
    b = values(rng, b_shape, "nonzero")
    out = run_forward(lambda a, b: op(a, b), {"a": a, "b": b})
    expected = ref(a.astype(np.float64), b.astype(np.float64))
    assert np.shape(out) == shapes.result_shape
    assert_close(out, expected, rtol=1e-5, atol=1e-6)


@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(
    shape=hnp.array_shapes(min_dims=1, max_dims=4, min_side=1, max_side=4),
    data=st.data(),
    name=st.sampled_from(list(REDUCE_NP)),
    keepdims=st.booleans(),
)
def test_reduce_property(shape, data, name, keepdims):
    ndim = len(shape)
    axes = data.draw(st.lists(st.integers(-ndim, ndim - 1), min_size=1, max_size=ndim,
                              unique_by=lambda a: a % ndim))
    axis = axes[0] if len(axes) == 1 else tuple(axes)
    x = values(np.random.default_rng(len(shape)), shape, "distinct")
    out = run_forward(lambda x: _reduce(x, name, axis, keepdims), {"x": x})
    expected = REDUCE_NP[name](x.astype(np.float64), axis=axis, keepdims=keepdims)
    assert np.shape(out) == np.shape(expected)
    assert_close(out, expected, rtol=1e-5, atol=1e-6)
