"""float64 compute on the CPU: every op with float64 kernels against numpy in float64, gradients
of float64 graphs against central finite differences (float64 makes them tight), float64
models through rlx.compile, float64 weights trained by every optimizer (against numpy in float64),
promotion, and the clear errors where float64 stops (GPU backends, mixed precision, data
parallelism, ops without float64 kernels)."""

import math

import numpy as np
import pytest

import rlx

ERF = np.vectorize(math.erf)


def softmax(a, axis):
    e = np.exp(a - a.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


def run(build, feeds):
    g = rlx.Graph()
    g.output(*build(g))
    return g.compile("cpu").run(**feeds)


rng = np.random.default_rng(0)
X = rng.standard_normal((4, 6))
W = rng.standard_normal((6, 3))
Y = np.array([0, 2, 1, 2], np.int32)

# name -> (rlx builder of x (4, 6) float64 and w (6, 3) float64, numpy reference)
CASES = {
    "matmul": (lambda x, w: x @ w, lambda: X @ W),
    "matmul_t": (lambda x, w: rlx.matmul(w.reshape(3, 6), x.reshape(6, 4)), lambda: W.reshape(3, 6) @ X.reshape(6, 4)),
    "batched": (lambda x, w: rlx.matmul(x.reshape(2, 2, 6), w), lambda: X.reshape(2, 2, 6) @ W),
    "tanh": (lambda x, w: rlx.tanh(x), lambda: np.tanh(X)),
    "sigmoid": (lambda x, w: rlx.sigmoid(x), lambda: 1 / (1 + np.exp(-X))),
    "gelu": (lambda x, w: rlx.gelu(x), lambda: 0.5 * X * (1 + ERF(X / np.sqrt(2)))),
    "gelu_tanh": (lambda x, w: rlx.gelu(x, approximate="tanh"),
                  lambda: 0.5 * X * (1 + np.tanh(np.sqrt(2 / np.pi) * (X + 0.044715 * X**3)))),
    "exp_log_sqrt": (lambda x, w: rlx.log(rlx.exp(x) + 1.0) + rlx.sqrt(abs(x)), lambda: np.log(np.exp(X) + 1) + np.sqrt(np.abs(X))),
    "pow": (lambda x, w: x**3 - x**2, lambda: X**3 - X**2),
    "relu_silu": (lambda x, w: rlx.relu(x) + rlx.silu(x), lambda: np.maximum(X, 0) + X / (1 + np.exp(-X))),
    "softplus_log1p": (lambda x, w: rlx.softplus(x) + rlx.log1p(abs(x)), lambda: np.log1p(np.exp(X)) + np.log1p(np.abs(X))),
    "arith": (lambda x, w: (x * 0.1 - 1 / (abs(x) + 1.5)) // 0.3 + x % 0.7, lambda: (X * 0.1 - 1 / (np.abs(X) + 1.5)) // 0.3 + X % 0.7),
    "broadcast": (lambda x, w: x + w.sum(axis=1).reshape(6), lambda: X + W.sum(1)),
    "sums": (lambda x, w: x.sum(axis=0) + x.mean(axis=0) + x.max(axis=0) + x.min(axis=0),
             lambda: X.sum(0) + X.mean(0) + X.max(0) + X.min(0)),
    "var": (lambda x, w: x.var(axis=1, ddof=1), lambda: X.var(1, ddof=1)),
    "softmax": (lambda x, w: rlx.softmax(x, -1) + rlx.log_softmax(x, 0), lambda: softmax(X, -1) + np.log(softmax(X, 0))),
    "where_clip": (lambda x, w: rlx.where(x > 0, x, -2 * x) + rlx.clip(x, -0.5, 0.5) + rlx.maximum(x, 0.2),
                   lambda: np.where(X > 0, X, -2 * X) + np.clip(X, -0.5, 0.5) + np.maximum(X, 0.2)),
    "layer_norm": (lambda x, w: rlx.layer_norm(x, eps=1e-5),
                   lambda: (X - X.mean(1, keepdims=True)) / np.sqrt(X.var(1, keepdims=True) + 1e-5)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_float64_ops_match_numpy_in_float64(name):
    build, ref = CASES[name]
    got = run(lambda g: [build(g.input("x", X.shape, "float64"), g.input("w", W.shape, "float64"))], {"x": X, "w": W})[0]
    assert got.dtype == np.float64
    # The graph keeps a norm's eps as a float32 attribute (1e-5 is 1e-5 * (1 - 2.5e-9) there).
    tol = 1e-10 if name == "layer_norm" else 1e-13
    np.testing.assert_allclose(got, ref(), rtol=tol, atol=tol)


def test_float64_losses_and_comparisons():
    def build(g):
        x = g.input("x", X.shape, "float64")
        y = g.input("y", Y.shape, "int32")
        return [rlx.cross_entropy(x, y), rlx.cross_entropy(x, y, label_smoothing=0.1, reduction="sum"),
                rlx.mse_loss(x, x * 0.5), x > 0.25]

    ce, ce_sum, mse, mask = run(build, {"x": X, "y": Y})
    logp = np.log(softmax(X, -1))
    np.testing.assert_allclose(ce, -logp[np.arange(4), Y].mean(), rtol=1e-14)
    want = (-(logp[np.arange(4), Y]) * 0.9 - logp.mean(1) * 0.1).sum()
    np.testing.assert_allclose(ce_sum, want, rtol=1e-13)
    assert ce.dtype == ce_sum.dtype == mse.dtype == np.float64
    np.testing.assert_allclose(mse, np.mean((0.5 * X) ** 2), rtol=1e-14)
    np.testing.assert_array_equal(mask, (X > 0.25).astype(np.float32))  # comparisons give float32 masks


def test_float64_promotes_every_other_dtype_and_numbers_stay_unrounded():
    def build(g):
        d = g.input("d", (3,), "float64")
        outs = [d + g.input("f", (3,), "float32"), d * g.input("h", (3,), "bfloat16"), d + g.input("i", (3,), "int64"),
                d * g.input("m", (3,), "bool"), d + 0.1, 0.1 * g.input("f2", (3,), "float32").astype("float64")]
        assert all(o.dtype == "float64" for o in outs)
        return outs

    import ml_dtypes
    d = np.array([1e-17, 1.0, -2.5])
    f = np.array([0.1, 0.2, 0.3], np.float32)
    got = run(build, {"d": d, "f": f, "h": np.ones(3, ml_dtypes.bfloat16), "i": np.array([2**60, 1, 2], np.int64),
                      "m": np.array([True, False, True]), "f2": f})
    np.testing.assert_array_equal(got[0], d + f.astype(np.float64))
    np.testing.assert_array_equal(got[2], d + np.array([2**60, 1, 2], np.float64))
    np.testing.assert_array_equal(got[3], d * [1, 0, 1])
    np.testing.assert_array_equal(got[4], d + 0.1)  # 1e-17 + 0.1 in float64, not a float32 0.1
    np.testing.assert_array_equal(got[5], 0.1 * f.astype(np.float64))


def numeric_grad(f, x, eps=1e-6):
    """Central differences of the scalar function ``f`` at ``x`` (float64)."""
    out = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        hi, lo = x.copy(), x.copy()
        hi[i] += eps
        lo[i] -= eps
        out[i] = (f(hi) - f(lo)) / (2 * eps)
    return out


@pytest.mark.parametrize("name", ["mlp", "softmax_ce", "layer_norm", "reductions", "elementwise"])
def test_float64_gradients_match_finite_differences(name):
    x0 = rng.standard_normal((3, 4))
    w0 = rng.standard_normal((4, 5)) * 0.5
    labels = np.array([0, 4, 2], np.int32)

    def model(x, w, y):
        if name == "mlp":
            return (rlx.tanh(x @ w) ** 2).sum() + rlx.gelu(x @ w).mean()
        if name == "softmax_ce":
            return rlx.cross_entropy(x @ w, y) + rlx.log_softmax(x @ w, 0).mean()
        if name == "layer_norm":
            return (rlx.layer_norm(x @ w, eps=1e-5) * rlx.sigmoid(x @ w)).sum()
        if name == "reductions":
            h = x @ w
            return h.max(axis=1).sum() + h.var(axis=0).sum() + rlx.softmax(h, -1).max()
        h = x @ w
        return (rlx.where(h > 0, h, 0.1 * h) / (1.0 + abs(h)) + rlx.softplus(h) + rlx.clip(h, -0.3, 0.3)).mean()

    g = rlx.Graph()
    x, w, y = g.input("x", x0.shape, "float64"), g.input("w", w0.shape, "float64"), g.input("y", (3,), "int32")
    g.output(model(x, w, y))
    exe = rlx.grad(g, ["x", "w"]).compile("cpu")
    loss, dx, dw = exe.run(x=x0, w=w0, y=labels)
    assert loss.dtype == dx.dtype == dw.dtype == np.float64
    fwd = g.compile("cpu")
    value = lambda xv, wv: float(fwd.run(x=xv, w=wv, y=labels)[0])  # noqa: E731
    np.testing.assert_allclose(dx, numeric_grad(lambda v: value(v, w0), x0), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(dw, numeric_grad(lambda v: value(x0, v), w0), rtol=1e-6, atol=1e-8)


def test_float64_models_compile_for_inference_and_training():
    rlx.seed(0)

    class Net(rlx.nn.Module):
        def __init__(self):
            self.fc1 = rlx.nn.Linear(6, 8, dtype="float64")
            self.norm = rlx.nn.LayerNorm(8, dtype="float64")
            self.fc2 = rlx.nn.Linear(8, 3, dtype="float64")

        def __call__(self, x):
            return self.fc2(self.norm(rlx.gelu(self.fc1(x))))

    net = Net()
    fn = rlx.compile(lambda m, x: rlx.softmax(m(x), -1), net, {"x": ((4, 6), "float64")})
    out = fn(x=X)
    assert out.dtype == np.float64
    w1, b1, w2, b2 = (np.asarray(p) for p in (net.fc1.weight, net.fc1.bias, net.fc2.weight, net.fc2.bias))
    h = X @ w1.T + b1
    h = 0.5 * h * (1 + ERF(h / np.sqrt(2)))
    h = (h - h.mean(1, keepdims=True)) / np.sqrt(h.var(1, keepdims=True) + 1e-5) * np.asarray(net.norm.weight) \
        + np.asarray(net.norm.bias)
    np.testing.assert_allclose(out, softmax(h @ w2.T + b2, -1), rtol=1e-10, atol=1e-12)  # float32 eps, as above
    step = rlx.compile_train_step(lambda m, x: m(x).sum(), net, rlx.optim.SGD(0.1), {"x": ((4, 6), "float64")})
    assert isinstance(step(x=X), float)  # and trains (the tests below check the values)


def test_float64_causal_attention_matches_numpy():
    q, k, v = (rng.standard_normal((2, 3, 5, 4)) for _ in range(3))
    got = run(lambda g: [rlx.scaled_dot_product_attention(*(g.input(n, q.shape, "float64") for n in "qkv"), causal=True)],
              {"q": q, "k": k, "v": v})[0]
    s = np.where(np.tril(np.ones((5, 5))) > 0, q @ k.swapaxes(-1, -2) / 2.0, -np.inf)
    np.testing.assert_allclose(got, softmax(s, -1) @ v, rtol=1e-13, atol=1e-14)
    assert got.dtype == np.float64


def test_float64_stops_with_clear_errors_where_kernels_end():
    g = rlx.Graph()
    d = g.input("d", (1, 2, 4, 4), "int64")
    with pytest.raises(rlx.DTypeError, match=r"^\[max_pool2d\] x must be float32, float64, bfloat16 or float16, got int64"):
        rlx.max_pool2d(d, 2)
    g = rlx.Graph()
    g.output(g.input("x", (2,), "float64") * 2.0)
    if "cuda" in rlx.devices():
        with pytest.raises(rlx.DTypeError, match=r"holds a float64 tensor"):
            g.compile("cuda")


def test_float64_embeddings_and_training_dropout():
    """A float64 table's rows (gather) and its gradient (scatter-add of repeated ids) in float64;
    training-mode dropout of float64 keeps the elements float32 dropout keeps for the same seed,
    scaled exactly by 1 / (1 - p)."""
    table = rng.standard_normal((5, 3))
    ids = np.array([[4, 0], [2, 4]], np.int32)
    wts = rng.standard_normal((2, 2, 3))
    g = rlx.Graph()
    t, i, w = g.input("t", table.shape, "float64"), g.input("i", ids.shape, "int32"), g.input("w", wts.shape, "float64")
    rows = rlx.embedding(t, i)
    g.output((rows * w).sum())
    loss, dt = rlx.grad(g, ["t"]).compile("cpu").run(t=table, i=ids, w=wts)
    assert loss.dtype == dt.dtype == np.float64
    assert loss == pytest.approx((table[ids] * wts).sum(), rel=1e-14)
    expect = np.zeros_like(table)
    np.add.at(expect, ids, wts)
    np.testing.assert_array_equal(dt, expect)

    x64 = rng.standard_normal((64, 33))

    def dropped(x):
        g = rlx.Graph()
        g.output(rlx.dropout(g.input("x", x.shape, x.dtype.name), 0.3, training=True))
        return g.compile("cpu").run(x=x, **{"rlx.rng": np.array([7, 1], np.int32)})[0]

    d64, d32 = dropped(x64), dropped(x64.astype(np.float32))
    assert d64.dtype == np.float64
    kept = d32 != 0
    assert 0.6 < kept.mean() < 0.8
    np.testing.assert_array_equal(d64 != 0, kept)
    np.testing.assert_array_equal(d64[kept], x64[kept] * np.float64(np.float32(1 / 0.7)))


def test_float64_stop_gradient_dropout_losses_and_constants_stay_float64():
    g = rlx.Graph()
    x = g.input("x", (3,), "float64")
    g.output((rlx.stop_gradient(x) * x).sum())
    _, dx = rlx.grad(g, ["x"]).compile("cpu").run(x=np.array([1.0, 2.0, 3.0]))
    np.testing.assert_array_equal(dx, [1.0, 2.0, 3.0])  # the stopped factor gets no gradient

    def build(g):
        v = g.input("v", (1, 2), "float64")
        f = g.input("f", (1, 2), "float32")
        return [v @ np.array([[0.1], [0.2]]), rlx.mse_loss(v, np.array([[0.1, 0.2]])), rlx.l1_loss(f, v),
                rlx.smooth_l1_loss(v, f), rlx.binary_cross_entropy_with_logits(v, np.array([[1.0, 0.0]])),
                g.constant(np.array([0.1, 0.2]), dtype="float64") + v, rlx.dropout(v, 0.5, training=False)]

    v, f = np.array([[1.0, 1.0]]), np.array([[0.5, 2.0]], np.float32)
    got = run(build, {"v": v, "f": f})
    assert all(o.dtype == np.float64 for o in got)
    np.testing.assert_array_equal(got[0], v @ np.array([[0.1], [0.2]]))  # 0.30000000000000004, not a float32 0.1
    np.testing.assert_array_equal(got[1], np.mean((v - [[0.1, 0.2]]) ** 2))
    np.testing.assert_array_equal(got[5], [[0.1, 0.2]] + v)
    np.testing.assert_array_equal(got[6], v)
    with pytest.raises(rlx.DTypeError, match=r"^\[constant\] dtype must be float32, float64, int32 or int64"):
        rlx.Graph().constant(1.0, dtype="bfloat16")


def test_a_float64_input_to_a_float32_model_trains_the_float32_weights():
    """Promotion makes the ops after a float64 input float64 (so the loss is float64); the float32
    weights get float32 gradients back through the casts and are updated in float32."""
    lin = rlx.nn.Linear(2, 1)
    w = np.array(lin.weight)
    step = rlx.compile_train_step(lambda m, x: m(x).sum(), lin, rlx.optim.SGD(0.1), {"x": ((1, 2), "float64")})
    assert isinstance(step(x=np.array([[1.0, 2.0]])), float)
    assert lin.weight.numpy().dtype == np.float32
    np.testing.assert_allclose(lin.weight.numpy(), w - 0.1 * np.array([[1.0, 2.0]], np.float32), rtol=1e-6)
    model = rlx.nn.Sequential(rlx.nn.Linear(2, 2, dtype="float64"), rlx.nn.Dropout(0.5))
    assert rlx.compile(lambda m, x: m(x), model, {"x": ((1, 2), "float64")})(x=np.ones((1, 2))).dtype == np.float64


# ---- training float64 weights (CPU) ------------------------------------------------------------

def _np_update(rule, kw, p, g, st, t):
    """One step of PyTorch's rule for ``rule`` in float64 numpy, in place over ``p`` and ``st``."""
    lr, wd = kw["lr"], kw.get("weight_decay", 0.0)
    if rule == "SGD":
        d = g + wd * p
        m = kw.get("momentum", 0.0)
        if m:
            st["buf"] = d.copy() if t == 1 else m * st["buf"] + (1 - kw.get("dampening", 0.0)) * d
            d = d + m * st["buf"] if kw.get("nesterov") else st["buf"]
        p -= lr * d
    elif rule in ("Adam", "AdamW"):
        b1, b2 = kw.get("betas", (0.9, 0.999))
        eps = kw.get("eps", 1e-8)
        if rule == "AdamW":
            p *= 1 - lr * wd
            d = g
        else:
            d = g + wd * p
        st["m"] = b1 * st.get("m", 0) + (1 - b1) * d
        st["v"] = b2 * st.get("v", 0) + (1 - b2) * d * d
        p -= lr / (1 - b1**t) * st["m"] / (np.sqrt(st["v"]) / np.sqrt(1 - b2**t) + eps)
    elif rule == "RMSprop":
        a, eps, m = kw.get("alpha", 0.99), kw.get("eps", 1e-8), kw.get("momentum", 0.0)
        d = g + wd * p
        st["sq"] = a * st.get("sq", 0) + (1 - a) * d * d
        avg = np.sqrt(st["sq"]) + eps
        if m:
            st["buf"] = m * st.get("buf", 0) + d / avg
            p -= lr * st["buf"]
        else:
            p -= lr * d / avg
    else:  # Adagrad
        d = g + wd * p
        st["sum"] = st.get("sum", 0) + d * d
        p -= lr / (1 + (t - 1) * kw.get("lr_decay", 0.0)) * d / (np.sqrt(st["sum"]) + kw.get("eps", 1e-10))


OPTIMIZERS = {
    "sgd_nesterov": ("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    "sgd_dampening": ("SGD", {"lr": 0.1, "momentum": 0.5, "dampening": 0.3}),
    "adam_l2": ("Adam", {"lr": 0.01, "weight_decay": 0.1}),
    "adamw": ("AdamW", {"lr": 0.01, "betas": (0.8, 0.95), "weight_decay": 0.1}),
    "rmsprop_momentum": ("RMSprop", {"lr": 0.01, "momentum": 0.9, "weight_decay": 0.01}),
    "adagrad": ("Adagrad", {"lr": 0.1, "lr_decay": 0.01, "weight_decay": 0.01}),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_float64_weights_train_as_numpy_does_in_float64(name):
    """A float64 linear model under mean-squared error: losses, weights and optimizer state after
    four steps equal a float64 numpy run of PyTorch's rule to float64 rounding (a float32 hyper-
    parameter or update anywhere would be ~1e-8 off)."""
    rule, kw = OPTIMIZERS[name]
    rlx.seed(1)
    model = rlx.nn.Linear(6, 3, dtype="float64")
    w, b = np.array(model.weight), np.array(model.bias)
    opt = getattr(rlx.optim, rule)(**kw)
    step = rlx.compile_train_step(lambda m, x, y: rlx.mse_loss(m(x), y), model, opt,
                                  {"x": ((4, 6), "float64"), "y": ((4, 3), "float64")})
    target = rng.standard_normal((4, 3))
    states: dict = {"w": {}, "b": {}}
    for t in range(1, 5):
        err = X @ w.T + b - target
        assert step(x=X, y=target) == pytest.approx(np.mean(err**2), rel=1e-14)
        gout = 2 * err / err.size
        _np_update(rule, kw, w, gout.T @ X, states["w"], t)
        _np_update(rule, kw, b, gout.sum(0), states["b"], t)
    assert model.weight.numpy().dtype == np.float64
    np.testing.assert_allclose(model.weight.numpy(), w, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(model.bias.numpy(), b, rtol=1e-13, atol=1e-15)
    state = opt.state("weight")
    assert int(state["step"]) == 4
    for key, value in state.items():
        if key != "step":
            assert value.dtype == np.float64, key
    if rule in ("Adam", "AdamW"):
        np.testing.assert_allclose(state["exp_avg"], states["w"]["m"], rtol=1e-13, atol=1e-16)


def test_float64_training_with_float32_layers_clipping_accumulation_and_checkpoints(tmp_path):
    """A model mixing a float32 layer and float64 layers trains with global-norm clipping over
    both dtypes and gradient accumulation; the optimizer state keeps each parameter's dtype through
    state_dict and save/load, and a resumed run continues exactly where the first one stood."""

    class Mixed(rlx.nn.Module):
        def __init__(self):
            self.fc32 = rlx.nn.Linear(6, 8)
            self.fc64 = rlx.nn.Linear(8, 8, dtype="float64")
            self.norm = rlx.nn.LayerNorm(8, dtype="float64")
            self.head = rlx.nn.Linear(8, 3, dtype="float64")

        def __call__(self, x):
            h = rlx.gelu(self.fc32(x)).astype("float64")
            return self.head(self.norm(rlx.tanh(self.fc64(h))))

    def make():
        rlx.seed(3)
        model, opt = Mixed(), rlx.optim.AdamW(1e-2)
        step = rlx.compile_train_step(lambda m, x, y: rlx.cross_entropy(m(x), y), model, opt,
                                      {"x": ((4, 6), "float32"), "y": ((4,), "int32")},
                                      clip_grad_norm=0.5, accumulate=2)
        return model, opt, step

    x = X.astype(np.float32)
    model, opt, step = make()
    before = {k: np.array(v) for k, v in model.state_dict().items()}
    losses = [step(x=x, y=Y) for _ in range(4)]
    assert all(isinstance(v, float) and np.isfinite(v) for v in losses)
    assert np.isfinite(step.grad_norm)
    after = model.state_dict()
    for k, v in after.items():
        assert np.asarray(v).dtype == before[k].dtype and not np.array_equal(np.asarray(v), before[k]), k
    assert opt.state("fc32.weight")["exp_avg"].dtype == np.float32
    assert opt.state("head.weight")["exp_avg"].dtype == np.float64
    # Save both, train on; a fresh model and optimizer loaded from the files follow the same path.
    model.save(str(tmp_path / "m.safetensors"))
    opt.save(str(tmp_path / "o.safetensors"))
    sd = opt.state_dict()
    assert sd["state"]["head.bias"]["exp_avg_sq"].dtype == np.float64
    cont = [step(x=x, y=Y) for _ in range(4)]
    model2, opt2, step2 = make()
    model2.load(str(tmp_path / "m.safetensors"))
    opt2.load(str(tmp_path / "o.safetensors"))
    assert [step2(x=x, y=Y) for _ in range(4)] == cont
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(np.asarray(model2.state_dict()[k]), np.asarray(v))
    np.testing.assert_array_equal(opt2.state("head.weight")["exp_avg_sq"], opt.state("head.weight")["exp_avg_sq"])


def test_float64_training_refusals_name_the_parameter():
    wide = rlx.nn.Linear(3, 2, dtype="float64")
    spec = {"x": ((1, 3), "float64")}
    with pytest.raises(rlx.DTypeError, match=r"^\[compile_train_step\] parameter 'weight' is float64: "
                                             r"precision='bf16' \(mixed precision\) keeps float32 master weights"):
        rlx.compile_train_step(lambda m, x: m(x).sum(), wide, rlx.optim.SGD(0.1), spec, precision="bf16")
    with pytest.raises(rlx.DTypeError, match=r"^\[compile_train_step\] distributed=True averages float32 gradients; "
                                             r"parameter 'weight' is float64"):
        rlx.compile_train_step(lambda m, x: m(x).sum(), wide, rlx.optim.SGD(0.1), spec, distributed=True)
    if "cuda" in rlx.devices():
        with pytest.raises(rlx.DTypeError, match=r"^\[compile_train_step\] parameter 'weight' is float64: float64 "
                                                 r"weights train on the cpu only"):
            rlx.compile_train_step(lambda m, x: m(x).sum(), wide, rlx.optim.SGD(0.1), spec, device="cuda")
    with pytest.raises(rlx.DTypeError, match=r"^\[loss\] loss_fn must return a float32 \(or float64\) scalar, got int64"):
        rlx.compile_train_step(lambda m, x: m(x).astype("int64").sum(), wide, rlx.optim.SGD(0.1), spec)


def test_float64_training_edges_accumulation_clipping_huge_losses_and_buffers():
    """Accumulation's 1/k and the clip factor are float64 for float64 weights; a finite float64
    loss beyond float32's range is not "non-finite"; a float64 buffer (batch-norm statistics) is
    updated whole."""
    rlx.seed(2)
    model = rlx.nn.Linear(6, 3, dtype="float64")
    w, b = np.array(model.weight), np.array(model.bias)
    step = rlx.compile_train_step(lambda m, x, y: rlx.mse_loss(m(x), y), model, rlx.optim.SGD(0.1, momentum=0.9),
                                  {"x": ((4, 6), "float64"), "y": ((4, 3), "float64")}, accumulate=3, clip_grad_norm=0.3)
    targets = [rng.standard_normal((4, 3)) for _ in range(6)]
    st: dict = {"w": {}, "b": {}}
    gw, gb = np.zeros_like(w), np.zeros_like(b)
    for i, y in enumerate(targets):
        step(x=X, y=y)
        gout = 2 * (X @ w.T + b - y) / 12
        gw, gb = gw + gout.T @ X, gb + gout.sum(0)
        if i % 3 == 2:
            gw, gb = gw / 3, gb / 3
            norm = np.sqrt((gw**2).sum() + (gb**2).sum())
            assert step.grad_norm == pytest.approx(norm, rel=1e-6)  # reported as float32
            coef = min(1.0, 0.3 / (norm + 1e-6))
            _np_update("SGD", {"lr": 0.1, "momentum": 0.9}, w, gw * coef, st["w"], i // 3 + 1)
            _np_update("SGD", {"lr": 0.1, "momentum": 0.9}, b, gb * coef, st["b"], i // 3 + 1)
            gw, gb = np.zeros_like(w), np.zeros_like(b)
    np.testing.assert_allclose(model.weight.numpy(), w, rtol=1e-13, atol=1e-15)

    huge = rlx.nn.Linear(2, 1, dtype="float64")
    step = rlx.compile_train_step(lambda m, x: m(x).sum() + 1e300, huge, rlx.optim.SGD(0.1),
                                  {"x": ((1, 2), "float64")}, skip_nonfinite=True)
    before = np.array(huge.weight)
    assert abs(step(x=np.ones((1, 2)))) > 1e200
    assert step.skipped == 0 and not np.array_equal(huge.weight.numpy(), before)

    net = rlx.nn.Sequential(rlx.nn.Linear(3, 4), rlx.nn.BatchNorm1d(4)).to("float64")
    xb = rng.standard_normal((8, 3))
    step = rlx.compile_train_step(lambda m, x: m(x).sum(), net, rlx.optim.SGD(0.0), {"x": ((8, 3), "float64")})
    lin = net[0]
    h = xb @ np.asarray(lin.weight).T + np.asarray(lin.bias)
    step(x=xb)
    bn = net[1]
    np.testing.assert_allclose(bn.running_mean.numpy(), 0.1 * h.mean(0), rtol=1e-14)
    np.testing.assert_allclose(bn.running_var.numpy(), 0.9 + 0.1 * h.var(0, ddof=1), rtol=1e-14)


def test_fp16_loss_scaling_scales_a_float64_loss():
    lin = rlx.nn.Linear(2, 1)
    w = np.array(lin.weight)
    step = rlx.compile_train_step(lambda m, x: m(x).sum(), lin, rlx.optim.SGD(0.1), {"x": ((1, 2), "float64")},
                                  precision="fp16")
    step(x=np.array([[1.0, 2.0]]))
    np.testing.assert_allclose(lin.weight.numpy(), w - 0.1 * np.array([[1.0, 2.0]]), rtol=2e-3)


def _np_conv(x, w, stride, pad):
    n, c, h, wd = x.shape
    o, _, kh, kw = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    ho, wo = (h + 2 * pad - kh) // stride + 1, (wd + 2 * pad - kw) // stride + 1
    out = np.zeros((n, o, ho, wo))
    for i in range(ho):
        for j in range(wo):
            win = xp[:, :, i * stride:i * stride + kh, j * stride:j * stride + kw]
            out[:, :, i, j] = np.einsum("nckl,ockl->no", win, w)
    return out


@pytest.mark.parametrize("size", [6, 17])  # 17x17 outputs take the tap-major (per-image GEMM) lowering
def test_float64_convolutions_and_pooling_match_numpy_and_finite_differences(size):
    x0 = rng.standard_normal((2, 3, size, size))
    w0 = rng.standard_normal((4, 3, 3, 3))
    bias = rng.standard_normal(4)

    def build(g):
        x, w = g.input("x", x0.shape, "float64"), g.input("w", w0.shape, "float64")
        y = rlx.conv2d(x, w, bias, stride=1, padding=1)
        return [(rlx.max_pool2d(rlx.tanh(y), 2) ** 2).sum() + (rlx.avg_pool2d(y, 3, stride=2, padding=1) * 0.5).sum()]

    g = rlx.Graph()
    x, w = g.input("x", x0.shape, "float64"), g.input("w", w0.shape, "float64")
    conv = rlx.conv2d(x, w, bias, stride=1, padding=1)
    g.output(conv, rlx.max_pool2d(conv, 2), rlx.avg_pool2d(conv, 3, stride=2, padding=1))
    y, mp, ap = g.compile("cpu").run(x=x0, w=w0)
    expect = _np_conv(x0, w0, 1, 1) + bias.reshape(1, 4, 1, 1)
    assert y.dtype == mp.dtype == ap.dtype == np.float64
    np.testing.assert_allclose(y, expect, rtol=1e-13, atol=1e-13)
    half = size // 2
    np.testing.assert_array_equal(mp, y[:, :, :2 * half, :2 * half].reshape(2, 4, half, 2, half, 2).max((3, 5)))
    padded = np.pad(y, ((0, 0), (0, 0), (1, 1), (1, 1)))
    ho = (size + 2 - 3) // 2 + 1
    avg = np.array([[padded[:, :, 2 * i:2 * i + 3, 2 * j:2 * j + 3].mean((2, 3)) for j in range(ho)] for i in range(ho)])
    np.testing.assert_allclose(ap, avg.transpose(2, 3, 0, 1), rtol=1e-13, atol=1e-14)

    g = rlx.Graph()
    g.output(*build(g))
    _, dx, dw = rlx.grad(g, ["x", "w"]).compile("cpu").run(x=x0, w=w0)
    fwd = g.compile("cpu")
    value = lambda xv, wv: float(fwd.run(x=xv, w=wv)[0])  # noqa: E731
    np.testing.assert_allclose(dw, numeric_grad(lambda v: value(x0, v), w0), rtol=1e-6, atol=1e-7)
    if size == 6:  # the 17x17 input's 1734 finite differences would take long
        np.testing.assert_allclose(dx, numeric_grad(lambda v: value(v, w0), x0), rtol=1e-6, atol=1e-7)


def test_a_float64_cnn_trains_and_a_float32_image_promotes():
    class CNN(rlx.nn.Module):
        def __init__(self):
            self.conv = rlx.nn.Conv2d(1, 4, 3, padding=1, dtype="float64")
            self.fc = rlx.nn.Linear(4 * 4 * 4, 3, dtype="float64")

        def __call__(self, x):
            return self.fc(rlx.max_pool2d(rlx.relu(self.conv(x)), 2).reshape(x.shape[0], -1))

    rlx.seed(4)
    model = CNN()
    step = rlx.compile_train_step(lambda m, x, y: rlx.cross_entropy(m(x), y), model, rlx.optim.Adam(1e-2),
                                  {"x": ((5, 1, 8, 8), "float32"), "y": ((5,), "int32")})
    xs = rng.standard_normal((5, 1, 8, 8)).astype(np.float32)
    losses = [step(x=xs, y=np.array([0, 1, 2, 0, 1], np.int32)) for _ in range(20)]
    assert losses[-1] < 0.5 * losses[0]
    assert model.conv.weight.numpy().dtype == np.float64


@pytest.mark.parametrize("causal", [False, True])
def test_multi_head_attention_and_a_transformer_block_run_in_float64(causal):
    """The fused attention op is float32; float64 modules take the attention built from ops (they
    used to be refused although the guide says attention computes in float64)."""
    rlx.seed(0)
    m = rlx.nn.TransformerBlock(6, num_heads=2, causal=causal)
    x = np.random.default_rng(0).standard_normal((2, 5, 6))
    want = rlx.compile(lambda m, x: m(x), m, {"x": rlx.InputSpec((2, 5, 6))})(x=x.astype(np.float32))
    m.to("float64")
    got = rlx.compile(lambda m, x: m(x), m, {"x": rlx.InputSpec((2, 5, 6), "float64")})(x=x)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    step = rlx.compile_train_step(lambda m, x: (m(x) ** 2).mean(), m, rlx.optim.SGD(0.1),
                                  {"x": rlx.InputSpec((2, 5, 6), "float64")})
    assert np.isfinite(step(x=x))
