"""Edge cases of Tensor against numpy (and PyTorch): bool scalar and mask indices, iteration,
negative and out-of-range constant indices, Graph.constant's dtype, ``b ** x``, attention with
head dim 0, and exact means / variances of integers."""

import numpy as np
import pytest

import rlx
from conftest import run_forward


def run(build, **feeds):
    """Builds ``build(g, **inputs)`` (a tensor or tuple of tensors) on a Graph and runs it on the CPU."""
    g = rlx.Graph()
    ins = {k: g.input(k, v.shape, str(v.dtype)) for k, v in feeds.items()}
    out = build(g, **ins)
    outs = out if isinstance(out, tuple) else (out,)
    g.output(*outs)
    got = g.compile("cpu").run(**feeds)
    return got if isinstance(out, tuple) else got[0]


X = np.arange(6, dtype=np.float32).reshape(2, 3)


# ---- 1. bool scalars: numpy's new axis of length 1 (True) or 0 (False) -------------------------
@pytest.mark.parametrize("key", [True, False, np.True_, np.False_, np.array(True), (True, 0), (Ellipsis, False),
                                 (0, True, slice(1, 3)), (None, False, 1)], ids=repr)
def test_bool_scalar_indices_follow_numpy(key):
    want = X[key]
    got = run(lambda g, x: x[key], x=X)
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def test_bool_scalar_index_of_a_0d_tensor():
    s = np.array(3.0, np.float32)
    for key in (True, False):
        got = run(lambda g, x: x.reshape(())[key] + 0.0, x=s.reshape(1))
        np.testing.assert_array_equal(got, s[key])


# ---- 2. boolean masks are refused clearly -----------------------------------------------------
@pytest.mark.parametrize("mask", [np.array([True, False]), [True, False], (np.array([True, False]), 0)], ids=repr)
def test_boolean_mask_indices_are_unsupported(mask):
    with pytest.raises(rlx.UnsupportedError, match=r"\[getitem\] boolean mask .*shape \(2,\).*rlx\.where"):
        run(lambda g, x: x[mask], x=X)


def test_bool_tensor_mask_is_unsupported_and_a_float_mask_names_where():
    with pytest.raises(rlx.UnsupportedError, match=r"\[getitem\] boolean mask .*rlx\.where"):
        run(lambda g, x: x[(x > 1).astype("bool")], x=X)
    with pytest.raises(rlx.DTypeError, match=r"\[getitem\] tensor indices must be int32, got float32.*rlx\.where"):
        run(lambda g, x: x[x > 1], x=X)


def test_arrays_inside_a_tuple_index_are_unsupported_not_a_numpy_error():
    with pytest.raises(rlx.UnsupportedError, match=r"\[getitem\] unsupported index"):
        run(lambda g, x: x[np.array([0, 1]), 0], x=X)


# ---- 3. iteration --------------------------------------------------------------------------
def test_iterating_a_tensor_yields_its_rows():
    rows = run(lambda g, x: tuple(x), x=X)
    assert len(rows) == 2
    for got, want in zip(rows, X):
        np.testing.assert_array_equal(got, want)

    def unpack(g, x):
        a, b = x
        return a * b + sum(r for r in x)

    np.testing.assert_array_equal(run(unpack, x=X), X[0] * X[1] + X[0] + X[1])


def test_iteration_errors():
    def zero_d(g, x):
        return list(x.sum())

    with pytest.raises(rlx.ShapeError, match=r"\[iter\] cannot iterate over a 0-d tensor"):
        run(zero_d, x=X)

    def too_many(g, x):
        a, b, c = x
        return a

    with pytest.raises(ValueError, match="not enough values to unpack"):  # Python's own, as for numpy
        run(too_many, x=X)


def test_iteration_follows_each_traced_batch_size():
    fn = rlx.compile(lambda m, x: sum(r for r in x), rlx.nn.Module(), {"x": rlx.InputSpec((None, 3))})
    for n in (1, 4):
        a = np.arange(3 * n, dtype=np.float32).reshape(n, 3)
        np.testing.assert_array_equal(fn(x=a), a.sum(0))


# ---- 4. constant integer indices: negative ones and range checks at trace time ---------------
@pytest.mark.parametrize("ids", [[-1, 0], [-2, -1, 1], np.array([[1, -2], [0, -1]]), np.array([1, 0], np.uint8),
                                 np.array([-1], np.int64)], ids=repr)
def test_negative_constant_indices_follow_numpy(ids):
    np.testing.assert_array_equal(run(lambda g, x: x[ids], x=X), X[ids])


@pytest.mark.parametrize("ids, bad", [([0, 2], 2), ([-3, 0], -3), (np.array([5], np.uint64), 5), ([0, 2**40], 2**40)])
def test_out_of_range_constant_indices_raise_when_tracing(ids, bad):
    g = rlx.Graph()
    x = g.input("x", (2, 3))
    with pytest.raises(rlx.ShapeError, match=rf"\[getitem\] index {bad} is out of range for axis 0 of size 2"):
        x[ids]


def test_ragged_index_list_is_a_shape_error():
    g = rlx.Graph()
    with pytest.raises(rlx.ShapeError, match=r"\[getitem\] .* is ragged"):
        g.input("x", (2, 3))[[[0], [0, 1]]]


# ---- 5. Graph.constant and dtype -----------------------------------------------------------
@pytest.mark.parametrize("value, dtype", [(np.array([1.0, -2.0]), "int32"), (np.array([3.0, 2.0**40]), "int64"),
                                          ([1, 2], "int64"), (np.array([1, 2], np.int64), "int32"),
                                          (np.array([True, False]), "int32"), (np.array([1, 2]), "float64"),
                                          (5.0, "int32"), (-(2.0**62), "int64"), (np.float32(4), "int32")], ids=repr)
def test_constant_dtype_is_honoured(value, dtype):
    g = rlx.Graph()
    c = g.constant(value, dtype=dtype)
    assert c.dtype == dtype
    g.output(c)
    got = g.compile("cpu").run()[0]
    want = np.asarray(value).astype(dtype)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("value, dtype, message", [
    (np.array([1.7]), "int32", r"1\.7 at index \[0\] has no exact int32 value \(it is not a whole number\)"),
    (np.array([1.0, 2.5]), "int64", r"2\.5 at index \[1\] has no exact int64 value"),
    (np.array([[0.0, np.nan]]), "int32", r"nan at index \[0, 1\] has no exact int32 value \(NaN and infinities"),
    (np.array([np.inf]), "int64", r"inf .*has no exact int64 value"),
    (np.array([2.0**31]), "int32", r"do not fit in int32"),
    (np.array([2**31]), "int32", r"do not fit in int32"),
    (1.7, "int32", r"1\.7 has no exact int32 value \(it is not a whole number\)"),
    (float("nan"), "int32", r"nan has no exact int32 value \(NaN and infinities"),
    (float("inf"), "int64", r"inf has no exact int64 value"),
    (2**63, "int64", r"does not fit in int64"),
    (2.0**31, "int32", r"does not fit in int32"),
], ids=repr)
def test_lossy_constants_are_refused(value, dtype, message):
    with pytest.raises(rlx.DTypeError, match=r"\[constant\] .*" + message):
        rlx.Graph().constant(value, dtype=dtype)


def test_ragged_and_huge_constants():
    with pytest.raises(rlx.ShapeError, match=r"\[constant\] \[\[1\], \[1, 2\]\] is ragged"):
        rlx.Graph().constant([[1], [1, 2]])
    g = rlx.Graph()
    with pytest.raises(rlx.ShapeError, match=r"\[constant\] .* is ragged"):
        g.input("x", (2,)) + [[1.0], [1.0, 2.0]]
    with pytest.raises(rlx.DTypeError, match=r"\[constant\] .* does not fit in float32"):
        rlx.Graph().constant(10**400)


def test_constants_without_dtype_are_unchanged():
    g = rlx.Graph()
    assert g.constant(np.array([1.5])).dtype == "float32"
    assert g.constant(np.array([1, 2], np.int64)).dtype == "int32"
    assert g.constant(np.array([2**40])).dtype == "int64"
    assert g.constant(np.array([True])).dtype == "int32"
    assert g.constant(1.7).dtype == "float32"


# ---- 6. b ** x -------------------------------------------------------------------------------
EXPONENTS = np.array([-3.0, -1.5, -1.0, 0.0, 0.5, 1.0, 2.0, 3.0, 10.0, np.inf, -np.inf, np.nan], np.float32)


@pytest.mark.parametrize("base", [2.0, 0.5, np.float32(3.0), np.array(1.5), 1.0, 0.0, -2.0, -0.5, np.inf, -np.inf,
                                  np.nan, 10], ids=repr)
def test_rpow_matches_numpy(base):
    x = EXPONENTS
    if isinstance(base, int):
        x = x[np.isfinite(x)]
        base = float(base)  # an int base takes float exponents as numpy's float results
    with np.errstate(all="ignore"):
        want = np.float64(base) ** x.astype(np.float64)
    got = run(lambda g, x: base ** x, x=x)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want.astype(np.float32), rtol=3e-6, equal_nan=True)
    assert (np.signbit(got) == np.signbit(want))[got == 0].all()


def test_rpow_of_int_and_float64_tensors():
    i = np.array([0, 1, 5, -2], np.int32)
    np.testing.assert_allclose(run(lambda g, i: 2.0 ** i, i=i), 2.0 ** i.astype(np.float64), rtol=1e-6)
    with pytest.raises(rlx.DTypeError, match=r"\[pow\] an int to the power of an int32 tensor"):
        run(lambda g, i: 2 ** i, i=i)
    d = np.array([0.25, 3.0, -7.5], np.float64)
    got = run(lambda g, d: 1.5 ** d, d=d)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, 1.5 ** d, rtol=1e-14)
    with pytest.raises(rlx.DTypeError, match=r"\[pow\] the base of b \*\* tensor must be"):
        run(lambda g, x: np.ones(3) ** x, x=X[0])


def test_rpow_gradient():
    g = rlx.Graph()
    x = g.param("x", (4,))
    g.output((3.0 ** x).sum())
    bw = rlx.grad(g, ["x"]).compile("cpu")
    v = np.array([-1.0, 0.0, 0.5, 2.0], np.float32)
    bw.set_param("x", v)
    loss, dx = bw.run()
    np.testing.assert_allclose(loss, (3.0 ** v.astype(np.float64)).sum(), rtol=1e-6)
    np.testing.assert_allclose(dx, 3.0 ** v.astype(np.float64) * np.log(3.0), rtol=1e-6)


# ---- 7. attention with head dim 0 (PyTorch: all scores 0, uniform attention) -------------------
@pytest.mark.parametrize("causal", [False, True])
def test_attention_with_head_dim_0_matches_pytorch(causal):
    torch = pytest.importorskip("torch")
    q, k = np.zeros((1, 2, 3, 0), np.float32), np.zeros((1, 2, 4, 0), np.float32)
    v = np.arange(2 * 4 * 5, dtype=np.float32).reshape(1, 2, 4, 5)
    want = torch.nn.functional.scaled_dot_product_attention(torch.from_numpy(q), torch.from_numpy(k),
                                                            torch.from_numpy(v), is_causal=causal).numpy()
    got = run(lambda g, q, k, v: rlx.scaled_dot_product_attention(q, k, v, causal=causal), q=q, k=k, v=v)
    np.testing.assert_allclose(got, want, rtol=1e-6)


# ---- 8. means and variances of integers ------------------------------------------------------
CASES = [np.array([2**30, 2**30 + 1, 2**30 + 2, 2**30 + 3], np.int32),
         np.array([-7, -1, 0, 3, 7, 2**31 - 1, -(2**31)], np.int32),
         np.array([2**40 + 1, -(2**40), 3], np.int64),
         np.array([2**31 - 1, 2**31 - 2, 2**31 - 5], np.int32),
         np.array([-(2**31), -(2**31) + 3], np.int32),
         np.array([32767, 32768, 32769, -32768, -32769], np.int32),
         np.array([True, False, True]),
         np.array([2**62, 2**62 + 4, -5], np.int64)]


@pytest.mark.parametrize("a", CASES, ids=lambda a: f"{a.dtype}{a.tolist()}")
@pytest.mark.parametrize("ddof", [0, 1])
def test_integer_mean_and_var_are_correctly_rounded(a, ddof):
    mean, var = run(lambda g, x: (x.mean(), x.var(ddof=ddof)), x=a)
    assert mean.dtype == var.dtype == np.float32
    assert mean == np.float32(a.astype(np.float64).mean())  # rounded once from the exact mean
    np.testing.assert_allclose(var, a.astype(np.float64).var(ddof=ddof), rtol=2e-7)


@pytest.mark.parametrize("dtype", ["int32", "int64"])
@pytest.mark.parametrize("axis, keepdims", [(0, False), (1, True), ((0, 2), False), (None, True), (-1, False)])
def test_integer_mean_and_var_over_axes(dtype, axis, keepdims):
    rng = np.random.default_rng(0)
    a = rng.integers(-(2**31), 2**31, (5, 6, 7)).astype(dtype)
    a[1] = 2**31 - 1 - rng.integers(0, 5, (6, 7))  # large and close together
    mean, var, var1 = run(lambda g, x: (x.mean(axis, keepdims), x.var(axis, keepdims), x.var(axis, keepdims, ddof=1)), x=a)
    wide = a.astype(np.float64)
    np.testing.assert_allclose(mean, wide.mean(axis, keepdims=keepdims), rtol=1e-7, atol=0.5)
    np.testing.assert_allclose(var, wide.var(axis, keepdims=keepdims), rtol=1e-6)
    np.testing.assert_allclose(var1, wide.var(axis, keepdims=keepdims, ddof=1), rtol=1e-6)


def test_int32_var_of_close_values_over_many_rows_and_empty_means():
    a = (2**31 - 10 + np.arange(3000) % 7).astype(np.int32)
    mean, var = run(lambda g, x: (x.mean(), x.var()), x=a)
    np.testing.assert_allclose(mean, a.astype(np.float64).mean(), rtol=1e-7)
    np.testing.assert_allclose(var, a.astype(np.float64).var(), rtol=1e-4)
    empty = np.zeros((0, 3), np.int32)
    with np.errstate(all="ignore"):
        assert np.isnan(run(lambda g, x: x.mean(axis=0), x=empty)).all()


@pytest.mark.filterwarnings("ignore:Degrees of freedom")
@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.int64])
def test_var_with_ddof_at_least_the_count_is_inf_or_nan_as_numpy_and_pytorch(dtype):
    a = np.array([[1, 2], [3, 3]], dtype)
    got = run(lambda g, x: (x.var(axis=1, ddof=2), x.var(axis=1, ddof=3)), x=a)
    with np.errstate(all="ignore"):
        for ddof, g_ in zip((2, 3), got):
            np.testing.assert_array_equal(g_, a.astype(np.float64).var(axis=1, ddof=ddof).astype(np.float32))


def test_float_mean_and_var_are_unchanged():
    a = np.random.default_rng(1).standard_normal((4, 5)).astype(np.float32)
    mean, var = run(lambda g, x: (x.mean(1), x.var(0, ddof=1)), x=a)
    np.testing.assert_allclose(mean, a.mean(1), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(var, a.var(0, ddof=1), rtol=1e-5)


def test_layer_norm_names_a_misshapen_weight_and_clip_refuses_a_nan_bound():
    x = {"x": np.ones((2, 3, 4), np.float32)}
    with pytest.raises(rlx.ShapeError, match=r"\[layer_norm\] weight must have shape \(4,\) .* got \(3,\)"):
        run_forward(lambda x: rlx.layer_norm(x, weight=np.ones(3, np.float32)), x)
    with pytest.raises(rlx.ShapeError, match=r"\[layer_norm\] bias must have shape \(4,\)"):
        run_forward(lambda x: rlx.layer_norm(x, bias=np.ones((2, 4), np.float32)), x)
    with pytest.raises(rlx.InputError, match=r"\[clip\] lo is NaN"):
        run_forward(lambda x: rlx.clip(x, float("nan"), 2.0), x)
