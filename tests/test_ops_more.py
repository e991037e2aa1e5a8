"""The remaining contract ops (API.md): gelu (exact and tanh form), layer_norm, embedding."""

import math

import numpy as np
import pytest

import rlx
from conftest import assert_close, check_op_grads, run_forward, run_grads

_erf = np.vectorize(math.erf, otypes=[np.float64])


def np_gelu(a, approximate=False):
    a = np.asarray(a, dtype=np.float64)
    if approximate:
        return 0.5 * a * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (a + 0.044715 * a**3)))
    return 0.5 * a * (1.0 + _erf(a / math.sqrt(2.0)))


def np_layer_norm(x, w, b, eps=1e-5):
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def test_gelu_reference_value():
    # the numpy reference itself: gelu(1) = Phi(1) = 0.8413447...
    assert math.isclose(float(np_gelu(np.array(1.0))), 0.8413447460685429, rel_tol=1e-12)


@pytest.mark.parametrize("approximate", [False, True])
def test_gelu(approximate):
    rng = np.random.default_rng(1)
    x = rng.uniform(-4.0, 4.0, (3, 7)).astype(np.float32)
    if approximate:
        out = run_forward(lambda x: rlx.gelu(x, approximate=True), {"x": x})
    else:
        out = run_forward(lambda x: rlx.gelu(x), {"x": x})
    assert_close(out, np_gelu(x, approximate), rtol=1e-5, atol=1e-6)
    check_op_grads(lambda t: rlx.gelu(t, approximate=approximate),
                   lambda a: np_gelu(a, approximate), {"x": x})


def test_gelu_default_is_exact_erf_form():
    # the erf and tanh forms differ by ~1e-3 near |x| = 2; the default must be the erf one
    x = np.array([-2.0, -1.5, 1.5, 2.0, 3.0], dtype=np.float32)
    out = run_forward(lambda x: rlx.gelu(x), {"x": x})
    assert_close(out, np_gelu(x, False), rtol=1e-6, atol=1e-7)
    assert np.max(np.abs(np_gelu(x, False) - np_gelu(x, True))) > 1e-4


@pytest.mark.parametrize("shape", [(4, 8), (2, 3, 5)], ids=str)
def test_layer_norm(shape):
    rng = np.random.default_rng(2)
    d = shape[-1]
    x = rng.standard_normal(shape).astype(np.float32) * 2 + 1
    w = rng.uniform(0.5, 1.5, d).astype(np.float32)
    b = rng.uniform(-0.5, 0.5, d).astype(np.float32)
    out = run_forward(lambda x, w, b: rlx.layer_norm(x, w, b), {"x": x, "w": w, "b": b})
    assert_close(out, np_layer_norm(x.astype(np.float64), w, b), rtol=1e-4, atol=1e-5)
    check_op_grads(lambda x, w, b: rlx.layer_norm(x, w, b), np_layer_norm,
                   {"x": x, "w": w, "b": b})


@pytest.mark.parametrize("rows,d", [(410, 100), (37, 1000)], ids=str)
def test_large_layer_norm_and_its_gradient_match_numpy(rows, d):
    # Large enough that the CPU splits the rows over its threads in blocks (the last one short);
    # the residual term makes the gradient one normalize_grad_add, whose added tensor is read
    # row by row in those blocks too. Checked against the float64 VJP, not finite differences.
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((rows, d)) * 2 + 1).astype(np.float32)
    w = rng.standard_normal((rows, d)).astype(np.float32)
    u = rng.standard_normal((rows, d)).astype(np.float32)
    x64 = x.astype(np.float64)
    out = run_forward(lambda x: rlx.layer_norm(x), {"x": x})
    assert_close(out, np_layer_norm(x64, 1.0, 0.0), rtol=1e-4, atol=1e-5)
    _, grads = run_grads(lambda m, w, u: (rlx.layer_norm(m.x * 1.0) * w).sum() + (m.x * u).sum(),
                         {"x": x}, {"w": w, "u": u})
    mu = x64.mean(-1, keepdims=True)
    rstd = 1.0 / np.sqrt(((x64 - mu) ** 2).mean(-1, keepdims=True) + 1e-5)
    xhat = (x64 - mu) * rstd
    g = w.astype(np.float64)
    want = rstd * (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True)) + u
    assert_close(grads["x"], want, rtol=1e-3, atol=1e-4)


def test_layer_norm_eps():
    # with tiny variance eps dominates: a different eps gives a visibly different result
    x = np.array([[1.0, 1.001, 0.999, 1.0]], dtype=np.float32)
    w, b = np.ones(4, np.float32), np.zeros(4, np.float32)
    out = run_forward(lambda x, w, b: rlx.layer_norm(x, w, b, eps=1e-3), {"x": x, "w": w, "b": b})
    assert_close(out, np_layer_norm(x.astype(np.float64), w, b, eps=1e-3), rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("ids_shape", [(6,), (2, 5)], ids=str)
def test_embedding(ids_shape):
    rng = np.random.default_rng(3)
    table = rng.standard_normal((7, 4)).astype(np.float32)
    ids = rng.integers(0, 7, ids_shape).astype(np.int32)
    ids.reshape(-1)[:2] = 3  # repeated ids: their gradients must accumulate
    out = run_forward(lambda t, i: rlx.embedding(t, i), {"t": table, "i": ids})
    np.testing.assert_array_equal(out, table[ids])
    grads = check_op_grads(lambda t, i: rlx.embedding(t, i), lambda t, i: t[i],
                           {"table": table}, arrays={"i": ids})
    unused = np.setdiff1d(np.arange(7), ids)
    np.testing.assert_array_equal(grads["table"][unused], 0.0)


def _np_attention(q, k, v, offset):
    """Reference attention with key j visible to query i when j <= i + offset (None: no mask)."""
    s = q.astype(np.float64) @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    if offset is not None:
        keep = np.tril(np.ones(s.shape[-2:], bool), k=offset)
        s = np.where(keep, s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return (p / p.sum(axis=-1, keepdims=True)) @ v


@pytest.mark.parametrize("tq,tk", [(3, 6), (4, 4), (1, 5)])
@pytest.mark.parametrize("align", [None, "top_left", "bottom_right"])
def test_sdpa_causal_alignment(tq, tk, align):
    rng = np.random.default_rng(tq * 10 + tk)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in [(2, tq, 8), (2, tk, 8), (2, tk, 5)])
    kw = {} if align is None else {"causal_align": align}
    out = run_forward(lambda q, k, v: rlx.scaled_dot_product_attention(q, k, v, causal=True, **kw),
                      {"q": q, "k": k, "v": v})
    # the default is PyTorch's is_causal=True: top-left aligned (query i sees keys 0..i)
    offset = tk - tq if align == "bottom_right" else 0
    assert_close(out, _np_attention(q, k, v, offset), rtol=1e-4, atol=1e-5)
    if tq == tk:  # the two alignments agree on square masks
        other = run_forward(lambda q, k, v: rlx.scaled_dot_product_attention(
            q, k, v, causal=True, causal_align="bottom_right"), {"q": q, "k": k, "v": v})
        np.testing.assert_array_equal(out, other)
    check_op_grads(lambda q, k, v: rlx.scaled_dot_product_attention(q, k, v, causal=True, **kw),
                   lambda q, k, v: _np_attention(q, k, v, offset), {"q": q, "k": k, "v": v})


def test_sdpa_more_queries_than_keys():
    rng = np.random.default_rng(3)
    q, k = rng.standard_normal((4, 8)).astype(np.float32), rng.standard_normal((2, 8)).astype(np.float32)
    top = run_forward(lambda q, k: rlx.scaled_dot_product_attention(q, k, k, causal=True), {"q": q, "k": k})
    assert_close(top, _np_attention(q, k, k, 0), rtol=1e-4, atol=1e-5)  # later queries see every key
    bottom = run_forward(lambda q, k: rlx.scaled_dot_product_attention(q, k, k, causal=True, causal_align="bottom_right"),
                         {"q": q, "k": k})
    assert np.isnan(bottom[:2]).all()  # queries that see no key: a softmax over nothing
    with np.errstate(invalid="ignore"):  # the reference's fully masked rows
        expected = _np_attention(q, k, k, -2)
    assert_close(bottom[2:], expected[2:], rtol=1e-4, atol=1e-5)


def test_sdpa_bad_alignment_is_an_input_error():
    q = np.zeros((2, 3, 4), np.float32)
    with pytest.raises(rlx.InputError, match=r"\[scaled_dot_product_attention\] causal_align"):
        run_forward(lambda q: rlx.scaled_dot_product_attention(q, q, q, causal=True, causal_align="left"),
                    {"q": q})


@pytest.mark.parametrize("shapes, dtypes, causal, error, message", [
    ([(2, 3, 4), (2, 3, 5), (2, 3, 4)], "fff", False, rlx.ShapeError, r"q and k need the same last dim \(d\): "
     r"q \(2, 3, 4\), k \(2, 3, 5\), v \(2, 3, 4\)"),
    ([(2, 3, 4), (2, 3, 4), (2, 6, 4)], "fff", False, rlx.ShapeError, r"k and v need the same number of keys"),
    ([(3, 4), (4,), (3, 4)], "fff", False, rlx.ShapeError, r"at least 2 dims"),
    ([(2, 3, 4), (3, 3, 4), (3, 3, 4)], "fff", False, rlx.ShapeError, r"leading \(batch, head\) dims do not broadcast"),
    ([(2, 3, 4), (2, 3, 4), (2, 3, 4)], "fif", False, rlx.DTypeError, r"one float dtype: q float32, k int32, v float32"),
    ([(2, 3, 4), (2, 3, 4), (2, 3, 4)], "iii", False, rlx.DTypeError, r"one float dtype: q int32"),
    ([(2, 3, 4), (2, 3, 4), (2, 3, 4)], "fff", "yes", rlx.InputError, r"causal must be True or False, got 'yes'"),
])
def test_sdpa_errors_name_attention_and_its_inputs(shapes, dtypes, causal, error, message):
    arrays = {n: np.zeros(s, np.float32 if d == "f" else np.int32) for n, s, d in zip("qkv", shapes, dtypes)}
    with pytest.raises(error, match=r"\[scaled_dot_product_attention\] .*" + message):
        run_forward(lambda q, k, v: rlx.scaled_dot_product_attention(q, k, v, causal=causal), arrays)


def test_embedding_out_of_range_id_raises():
    from conftest import Empty

    table = np.zeros((5, 2), np.float32)
    fn = rlx.compile(lambda m, t, i: rlx.embedding(t, i), Empty(),
                     {"t": rlx.InputSpec((5, 2)), "i": rlx.InputSpec((3,), dtype="int32")})
    # must be refused (an rlx error, InputError expected), never read out of bounds
    with pytest.raises(rlx.RlxError):
        fn(t=table, i=np.array([0, 5, 1], np.int32))


SLICE_CASES = {
    # disjoint slices of one axis: one concat with zero gaps
    "disjoint": (lambda x: x[0:2] * x[3:5], lambda x: x[0:2] * x[3:5]),
    # overlapping slices: summed zero-padded gradients
    "overlapping": (lambda x: x[0:3] * x[1:4], lambda x: x[0:3] * x[1:4]),
    # slices on two different axes of the same tensor
    "two-axes": (lambda x: x[1:3, :] + x[:, 0:2].T[:, 0:2].T,
                 lambda x: x[1:3, :] + x[:, 0:2].T[:, 0:2].T),
    # split into all parts, recombined out of order
    "split-concat": (lambda x: rlx.concat(rlx.split(x, [1, 2, 2], axis=0)[::-1], axis=0) * 2.0,
                     lambda x: np.concatenate(np.split(x, [1, 3], axis=0)[::-1], axis=0) * 2.0),
    # an int index drops the axis; the slice of a slice
    "index-and-nested": (lambda x: x[4] + x[1:5][0:2].sum(axis=0), lambda x: x[4] + x[1:5][0:2].sum(axis=0)),
}


@pytest.mark.parametrize("case", list(SLICE_CASES), ids=list(SLICE_CASES))
def test_slice_gradients(case):
    rlx_op, np_op = SLICE_CASES[case]
    x = np.random.default_rng(3).standard_normal((5, 2)).astype(np.float32)
    check_op_grads(rlx_op, np_op, {"x": x})
