"""The fusion pass: programs compiled with fused elementwise chains (the default) give the same
results as the same programs with every op its own instruction (``RLX_FUSION=0``), forward and
gradients, on random chains (broadcast inputs, reshapes in the middle, shared values) and on the
models."""

from __future__ import annotations

import numpy as np
import pytest

import rlx


def compiled(monkeypatch, fused: bool, build):
    monkeypatch.setenv("RLX_FUSION", "1" if fused else "0")
    try:
        return build()
    finally:
        monkeypatch.delenv("RLX_FUSION")


class Params(rlx.nn.Module):
    def __init__(self, rng):
        self.w = rlx.nn.Parameter(rng.standard_normal((4, 6)).astype(np.float32))
        self.b = rlx.nn.Parameter(rng.standard_normal(6).astype(np.float32))
        self.s = rlx.nn.Parameter(rng.standard_normal(1).astype(np.float32))


def random_chain(seed: int, depth: int):
    """A traced function: a random sequence of elementwise ops over broadcast operands, with
    reshapes between (4, 6) and (2, 2, 6) and values reused later (so some are shared)."""
    rng = np.random.default_rng(seed)
    plan = [(int(rng.integers(0, 12)), int(rng.integers(0, 1 << 30))) for _ in range(depth)]

    def fn(m, x):
        vals = [x * m.w, m.b + x]
        for kind, pick in plan:
            a = vals[-1]
            other = vals[pick % len(vals)]
            if other.shape != a.shape:
                other = other.reshape(*a.shape)
            if kind == 0:
                v = a + m.b
            elif kind == 1:
                v = a * other
            elif kind == 2:
                v = rlx.tanh(a)
            elif kind == 3:
                v = rlx.relu(a) - other
            elif kind == 4:
                v = rlx.gelu(a)
            elif kind == 5:
                v = a / (1.5 + rlx.sigmoid(other))
            elif kind == 6:
                v = rlx.where(a > other, a, other * 0.5)
            elif kind == 7:
                v = a.reshape(2, 2, 6) if len(a.shape) == 2 else a.reshape(4, 6)
            elif kind == 8:
                v = rlx.exp(rlx.tanh(a)) * m.s
            elif kind == 9:
                v = (a - 0.25) ** 2
            elif kind == 10:
                v = -a + m.b
            else:
                v = rlx.gelu(a, approximate="tanh")
            vals.append(v)
        out = vals[-1]
        return (out * out).mean() + vals[len(vals) // 2].sum() * 0.01

    return fn


@pytest.mark.parametrize("seed", range(40))
def test_random_chains_match_the_unfused_program(monkeypatch, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((4, 6)).astype(np.float32)
    fn = random_chain(seed, depth=int(rng.integers(3, 25)))
    results = []
    for fused in (True, False):
        model = Params(np.random.default_rng(seed))
        step = compiled(monkeypatch, fused, lambda m=model: rlx.compile_train_step(
            fn, m, rlx.optim.SGD(lr=0.0), {"x": rlx.InputSpec((4, 6))}))
        loss = step(x=x)
        results.append((loss, {k: v.copy() for k, v in step.grads.items()}, step.memory()["arena_bytes"]))
    (lf, gf, af), (lu, gu, au) = results
    np.testing.assert_allclose(lf, lu, rtol=1e-5, atol=1e-6)
    for k in gu:
        np.testing.assert_allclose(gf[k], gu[k], rtol=1e-4, atol=1e-5, err_msg=k)
    # Recomputing a shared value can keep its inputs alive longer, so a small random program's
    # arena may grow a little; the models' arenas shrink (below).
    assert af <= 2 * au


def test_gpt_training_matches_and_fused_intermediates_take_no_memory(monkeypatch):
    r = np.random.default_rng(0)
    idx = r.integers(0, 64, (2, 16)).astype(np.int32)
    tgt = r.integers(0, 64, (2, 16)).astype(np.int32)
    runs = []
    for fused in (True, False):
        rlx.seed(0)
        model = rlx.models.GPT(vocab=64, dim=32, heads=2, layers=2)
        opt = rlx.optim.AdamW(lr=1e-2, weight_decay=0.01)
        step = compiled(monkeypatch, fused, lambda m=model, o=opt: rlx.compile_train_step(
            lambda m, idx, tgt: m.loss(idx, tgt), m, o,
            {"idx": rlx.InputSpec((2, 16), "int32"), "tgt": rlx.InputSpec((2, 16), "int32")}))
        losses = [step(idx=idx, tgt=tgt) for _ in range(5)]
        runs.append((losses, {k: p.numpy().copy() for k, p in model.parameters().items()}, step.memory()))
    (lf, wf, mf), (lu, wu, mu) = runs
    np.testing.assert_allclose(lf, lu, rtol=1e-4)
    for k in wu:
        np.testing.assert_allclose(wf[k], wu[k], rtol=1e-3, atol=1e-5, err_msg=k)
    # Fused intermediates get no slot at all; the peak (saved activations at the start of the
    # backward pass) is not made of them, so the arena itself does not grow.
    assert mf["naive_bytes"] < mu["naive_bytes"], (mf, mu)
    assert mf["arena_bytes"] <= mu["arena_bytes"], (mf, mu)


def test_floor_division_remainder_and_relu_at_nan_fuse_like_the_unfused_program(monkeypatch):
    # float // and % (Python's rules) inside fused chains, and relu's backward at NaN (the
    # upstream gradient passes), give exactly what the one-op-per-instruction program gives
    x = np.array([[7.5, -7.5, 0.0, np.nan, 3.0, -1.0]] * 4, np.float32)
    x[1] *= -1.0
    results = []
    for fused in (True, False):
        model = Params(np.random.default_rng(0))
        step = compiled(monkeypatch, fused, lambda m=model: rlx.compile_train_step(
            lambda m, x: ((rlx.relu(x * m.w) // 2.0) * m.b + (x * m.w % -1.5) * m.s + rlx.relu(x * m.w)).sum(),
            m, rlx.optim.SGD(lr=0.0), {"x": rlx.InputSpec((4, 6))}))
        loss = step(x=x)
        results.append((loss, {k: v.copy() for k, v in step.grads.items()}))
    (lf, gf), (lu, gu) = results
    np.testing.assert_array_equal(lf, lu)
    for k in gu:
        np.testing.assert_array_equal(gf[k], gu[k], err_msg=k)
    assert np.isnan(gf["w"][:, 3]).all()  # NaN inputs give NaN weight gradients, fused or not


# ---- matmul epilogues and fused attention (issue 11, second part) ----------------------------
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from conftest import run_forward  # noqa: E402
from rlx._tensor import _as_tensor, _matmul_nt, _sdpa_composed, _trace_of  # noqa: E402


class Weights(rlx.nn.Module):
    def __init__(self, arrays: dict):
        for k, v in arrays.items():
            setattr(self, k, rlx.nn.Parameter(v))


def loss_and_grads(monkeypatch, fused: bool, fn, arrays: dict, inputs: dict):
    model = Weights({k: v.copy() for k, v in arrays.items()})
    specs = {k: rlx.InputSpec(v.shape) for k, v in inputs.items()}
    step = compiled(monkeypatch, fused, lambda: rlx.compile_train_step(fn, model, rlx.optim.SGD(lr=0.0), specs))
    loss = step(**inputs)
    return loss, {k: v.copy() for k, v in step.grads.items()}, step


def assert_same(a, b, rtol=1e-4, atol=1e-5):
    np.testing.assert_allclose(a[0], b[0], rtol=rtol, atol=atol)
    for k in b[1]:
        np.testing.assert_allclose(a[1][k], b[1][k], rtol=rtol, atol=atol, err_msg=k)


def program_ops(step) -> list[str]:
    return [line.split("= ", 1)[1].split("(")[0].split("[")[0] for line in step.graph().splitlines()
            if "= " in line and line.strip()[0].isdigit()]


# `compiled` sets and removes RLX_FUSION itself, so the shared monkeypatch is safe.
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.integers(1, 300), k=st.integers(1, 40), n=st.integers(1, 150), batched=st.booleans(),
       trans_b=st.booleans(), act=st.sampled_from(["relu", "gelu", "tanh", "none"]), residual=st.booleans(),
       seed=st.integers(0, 2**16))
def test_matmul_epilogues_match_the_unfused_program(monkeypatch, rows, k, n, batched, trans_b, act, residual, seed):
    # act(x @ w (+ b) (+ r)) and its gradients, x 2-D or 3-D (a tall product), w maybe read
    # transposed (Linear's layout); odd sizes give partial blocks of rows.
    rng = np.random.default_rng(seed)
    xs = (3, rows, k) if batched else (rows, k)
    arrays = {"w": rng.standard_normal((n, k) if trans_b else (k, n)).astype(np.float32) * 0.3,
              "b": rng.standard_normal(n).astype(np.float32),
              "c": rng.standard_normal((n, 3)).astype(np.float32)}
    inputs = {"x": rng.standard_normal(xs).astype(np.float32),
              "r": rng.standard_normal(xs[:-1] + (n,)).astype(np.float32)}

    def fn(m, x, r):
        if trans_b:
            flat = x.reshape(-1, k)
            h = _matmul_nt(flat, _as_tensor(m.w, _trace_of(flat))).reshape(*xs[:-1], n) + m.b
        else:
            h = x @ m.w + m.b
        if residual:
            h = h + r
        h = {"relu": rlx.relu, "gelu": rlx.gelu, "tanh": rlx.tanh, "none": lambda v: v * 1.5}[act](h)
        y = h @ m.c
        return (y * y).mean()

    fused = loss_and_grads(monkeypatch, True, fn, arrays, inputs)
    plain = loss_and_grads(monkeypatch, False, fn, arrays, inputs)
    assert_same(fused[:2], plain[:2])
    assert "matmul_epilogue" not in program_ops(plain[2])
    # GELU's backward reads its input, so the product is read twice and stays a matmul; the
    # others' backward reads their output, and the product becomes the epilogue's.
    if act != "gelu":
        assert "matmul_epilogue" in program_ops(fused[2])


def test_large_and_batched_epilogues_match_the_unfused_program(monkeypatch):
    # 512 x 128 @ 128 x 256: over the parallel threshold (the product computed whole by the
    # threaded GEMM, then the epilogue in parallel tiles); and a batched product of two 3-D
    # operands (not one tall GEMM).
    rng = np.random.default_rng(1)
    arrays = {"w": rng.standard_normal((128, 256)).astype(np.float32) * 0.1,
              "b": rng.standard_normal(256).astype(np.float32),
              "v": rng.standard_normal((4, 16, 8)).astype(np.float32),
              "c": rng.standard_normal((256, 2)).astype(np.float32),
              "d": rng.standard_normal((4, 8, 3)).astype(np.float32)}
    inputs = {"x": rng.standard_normal((512, 128)).astype(np.float32),
              "y": rng.standard_normal((4, 8, 16)).astype(np.float32)}

    def fn(m, x, y):
        return ((rlx.relu(x @ m.w + m.b) @ m.c) ** 2).mean() + (rlx.tanh(y @ m.v * 2.0) @ m.d).sum()

    fused = loss_and_grads(monkeypatch, True, fn, arrays, inputs)
    plain = loss_and_grads(monkeypatch, False, fn, arrays, inputs)
    assert_same(fused[:2], plain[:2])
    assert program_ops(fused[2]).count("matmul_epilogue") >= 2


@settings(max_examples=30, deadline=None)
@given(lead=st.lists(st.integers(1, 3), min_size=0, max_size=2), tq=st.integers(1, 20), s=st.integers(1, 20),
       e=st.integers(1, 9), ev=st.integers(1, 9), causal=st.sampled_from([None, "top_left", "bottom_right"]),
       seed=st.integers(0, 2**16))
def test_fused_attention_matches_the_composed_ops(lead, tq, s, e, ev, causal, seed):
    # rlx.scaled_dot_product_attention (one fused op) against the same attention from primitive
    # ops, forward and gradients, any leading dims, L != S, both causal alignments.
    rng = np.random.default_rng(seed)
    arrays = {"q": rng.standard_normal((*lead, tq, e)).astype(np.float32),
              "k": rng.standard_normal((*lead, s, e)).astype(np.float32),
              "v": rng.standard_normal((*lead, s, ev)).astype(np.float32)}
    up = rng.standard_normal((*lead, tq, ev)).astype(np.float32)
    if causal == "bottom_right" and s < tq:
        causal = "top_left"  # else query 0 sees no key: NaN both ways (tested below)
    offset = None if causal is None else (s - tq if causal == "bottom_right" else 0)

    def fused_fn(m, u):
        y = rlx.scaled_dot_product_attention(m.q, m.k, m.v, causal=causal is not None,
                                             causal_align=causal or "top_left")
        return (y * u).sum()

    def composed_fn(m, u):
        t = _trace_of(u)
        q, k, v = (_as_tensor(p, t) for p in (m.q, m.k, m.v))
        return (_sdpa_composed(q, k, v, offset) * u).sum()

    a = loss_and_grads_plain(fused_fn, arrays, {"u": up})
    b = loss_and_grads_plain(composed_fn, arrays, {"u": up})
    assert_same(a[:2], b[:2], rtol=2e-4, atol=2e-5)
    assert "attention" in program_ops(a[2])


def loss_and_grads_plain(fn, arrays, inputs):
    model = Weights({k: v.copy() for k, v in arrays.items()})
    step = rlx.compile_train_step(fn, model, rlx.optim.SGD(lr=0.0), {k: rlx.InputSpec(v.shape) for k, v in inputs.items()})
    loss = step(**inputs)
    return loss, {k: v.copy() for k, v in step.grads.items()}, step


@pytest.mark.parametrize("causal", [False, True])
def test_packed_attention_of_multi_head_attention_matches_the_composed_ops(causal):
    # MultiHeadAttention runs one packed op over the q|k|v projection; the same module computed
    # from split heads, primitive attention and merged heads gives the same loss and gradients.
    rng = np.random.default_rng(3)
    b, t, d, h = 3, 13, 12, 3
    x = rng.standard_normal((b, t, d)).astype(np.float32)
    u = rng.standard_normal((b, t, d)).astype(np.float32)
    rlx.seed(0)
    mha = rlx.nn.MultiHeadAttention(d, h, causal=causal)
    weights = {k: p.numpy().copy() for k, p in mha.parameters().items()}

    def composed(m, x, u):
        q, k, v = m._heads(x)
        return (m._merge(_sdpa_composed(q, k, v, 0 if causal else None)) * u).sum()

    results = []
    for fn in (lambda m, x, u: (m(x) * u).sum(), composed):
        m = rlx.nn.MultiHeadAttention(d, h, causal=causal)
        m.load_state_dict(weights)
        step = rlx.compile_train_step(fn, m, rlx.optim.SGD(lr=0.0),
                                      {"x": rlx.InputSpec((b, t, d)), "u": rlx.InputSpec((b, t, d))})
        results.append((step(x=x, u=u), {k: v.copy() for k, v in step.grads.items()}, step))
    assert_same(results[0][:2], results[1][:2], rtol=2e-4, atol=2e-5)
    ops = program_ops(results[0][2])
    assert ops.count("attention") == 1 and ops.count("attention_grad") == 1
    assert "softmax" not in ops and "transpose" not in ops


def test_attention_errors_and_queries_that_see_no_key():
    q = np.ones((2, 4, 3), np.float32)
    k = np.ones((2, 2, 3), np.float32)
    out = run_forward(lambda q, k: rlx.scaled_dot_product_attention(q, k, k, causal=True, causal_align="bottom_right"),
                      {"q": q, "k": k})
    out = np.asarray(out)
    assert np.isnan(out[:, :2]).all() and np.isfinite(out[:, 2:]).all()
    # The IR op checks its shapes itself (the Python function falls back to primitive ops for
    # shapes it does not take, so call the graph builder directly).
    with pytest.raises(rlx.ShapeError, match=r"\[attention\].*do not fit"):
        run_forward(lambda q, k: _raw_attention(q, k, k[:, :1]), {"q": q, "k": k})
    with pytest.raises(rlx.ShapeError, match=r"\[attention\] packed"):
        run_forward(lambda q: _raw_attention(q, heads=2), {"q": q})


def _raw_attention(*xs, heads=None):
    t = _trace_of(*xs)
    return rlx.Tensor(t, t.graph.attention([_as_tensor(x, t)._id for x in xs], 1.0, None, heads))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.integers(1, 400), n=st.integers(1, 70), lead=st.booleans(), seed=st.integers(0, 2**16))
def test_fused_sums_of_products_match_the_unfused_program(monkeypatch, rows, n, lead, seed):
    # Gradients of parameters broadcast against (rows, n) — a row (n,), a (1, n) and a column
    # (rows, 1) — are sums of products: one fused_sum_to each, the expression never stored.
    rng = np.random.default_rng(seed)
    xs = (2, rows, n) if lead else (rows, n)
    arrays = {"row": rng.standard_normal(n).astype(np.float32),
              "row2": rng.standard_normal((1, n)).astype(np.float32),
              "col": rng.standard_normal((rows, 1)).astype(np.float32)}
    inputs = {"x": rng.standard_normal(xs).astype(np.float32), "y": rng.standard_normal(xs).astype(np.float32)}

    def fn(m, x, y):
        return ((x * m.row + m.row2) * rlx.tanh(y * m.col)).sum() * 0.5

    fused = loss_and_grads(monkeypatch, True, fn, arrays, inputs)
    plain = loss_and_grads(monkeypatch, False, fn, arrays, inputs)
    assert_same(fused[:2], plain[:2], rtol=2e-4, atol=2e-4)
    assert "fused_sum_to" in program_ops(fused[2]) and "fused_sum_to" not in program_ops(plain[2])


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.integers(1, 300), n=st.integers(1, 70), seed=st.integers(0, 2**16))
def test_layer_norm_gradient_plus_a_residual_gradient_is_one_op(monkeypatch, rows, n, seed):
    # h feeds a layer norm and, beside it, the loss directly (a residual stream): its gradient
    # normalize_grad(h, g) + (the other path's gradient) is one normalize_grad_add.
    rng = np.random.default_rng(seed)
    arrays = {"a": rng.standard_normal((n, n)).astype(np.float32),
              "w": rng.standard_normal((n, n)).astype(np.float32) * 0.3}
    inputs = {"x": rng.standard_normal((rows, n)).astype(np.float32), "u": rng.standard_normal((rows, n)).astype(np.float32)}

    def fn(m, x, u):
        h = x @ m.a  # its gradient is read by the product's backward: stored
        return (rlx.layer_norm(h) @ m.w * u).sum() + (rlx.tanh(rlx.layer_norm(h, eps=1e-3)) @ m.w).sum() * 0.5

    fused = loss_and_grads(monkeypatch, True, fn, arrays, inputs)
    plain = loss_and_grads(monkeypatch, False, fn, arrays, inputs)
    assert_same(fused[:2], plain[:2], rtol=2e-4, atol=2e-4)
    assert "normalize_grad_add" in program_ops(fused[2]) and "normalize_grad_add" not in program_ops(plain[2])


@settings(max_examples=30, deadline=None)
@given(lead=st.integers(1, 3), rows=st.integers(1, 300), n=st.integers(1, 256), seed=st.integers(0, 2**16))
def test_short_rows_with_per_row_operands_match_numpy(lead, rows, n, seed):
    # Rows of at most half a tile take the row-group path: operands that are the same for every
    # row (a layer norm's scale and shift: (n,), (1, n)) are expanded once for all tiles, one
    # that differs between rows (rows, 1) tile by tile; short last tiles, one row, many.
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((lead, rows, n)).astype(np.float32)
    w = rng.standard_normal(n).astype(np.float32)
    b = rng.standard_normal((1, n)).astype(np.float32)
    c = rng.standard_normal((rows, 1)).astype(np.float32)

    got = run_forward(lambda x, w, b, c: (x * w + b) * c - w, {"x": x, "w": w, "b": b, "c": c})
    want = (x.astype(np.float64) * w + b) * c - w
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_a_zero_size_axis_trains_through_a_fused_expression(reduce):
    """The fused kernel tiled an empty output by its row length, 0: a division by zero (the
    unfused program was fine)."""

    class M(rlx.nn.Module):
        def __init__(self):
            self.a = rlx.nn.Parameter(np.zeros((3, 0), np.float32))

    step = rlx.compile_train_step(lambda m: getattr(m.a * 1.0, reduce)(axis=1).sum(), M(), rlx.optim.SGD(lr=0.0), {})
    loss = step()
    assert loss == 0.0 or (reduce == "mean" and np.isnan(loss))
    assert step.grads["a"].shape == (3, 0)
