"""Computing with bfloat16 and float16 tensors. Ops without low-precision kernels compute in
float32 and round the result back to the operands' dtype (PyTorch's CPU kernels do the same), so
every result is checked against float64 numpy of the same (already rounded) inputs, to within
one rounding of the low dtype. Promotion follows PyTorch: a low dtype with Python numbers or
int32 keeps its dtype, beside float32 or the other low dtype it becomes float32. A model with
bfloat16 weights runs inference; training one is a DTypeError that says what to do instead."""

import ml_dtypes
import numpy as np
import pytest

import rlx
from conftest import DEVICE

BF16 = ml_dtypes.bfloat16
LOW = {"bfloat16": BF16, "float16": np.float16}
# One rounding to the dtype (relative), plus float32 kernel error.
EPS = {"bfloat16": 2.0**-8, "float16": 2.0**-11}

pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="low-precision compute is checked on the CPU backend")


def _run(fn, arrays):
    g = rlx.Graph()
    ins = [g.input(f"x{i}", a.shape, str(a.dtype) if a.dtype != BF16 else "bfloat16") for i, a in enumerate(arrays)]
    out = fn(*ins)
    g.output(out)
    got = g.compile("cpu").run(**{f"x{i}": a for i, a in enumerate(arrays)})
    return out.dtype, (got[0] if isinstance(got, (list, tuple)) else got)


def _check(got, want, dtype, scale=1.0):
    want = np.asarray(want, np.float64)
    err = np.abs(got.astype(np.float64) - want)
    tol = 2 * EPS[dtype] * (np.abs(want) + scale) + 1e-6
    assert np.all(err <= tol), (dtype, float(np.max(err - tol)))


def _softmax(x, axis):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _gelu(x):
    from math import erf

    return 0.5 * x * (1 + np.vectorize(erf)(x / np.sqrt(2)))


UNARY = {
    "tanh": (rlx.tanh, np.tanh),
    "exp": (rlx.exp, np.exp),
    "sigmoid": (rlx.sigmoid, lambda x: 1 / (1 + np.exp(-x))),
    "relu": (rlx.relu, lambda x: np.maximum(x, 0)),
    "gelu": (rlx.gelu, _gelu),
    "neg": (lambda x: -x, np.negative),
    "abs": (abs, np.abs),
    "softmax": (lambda x: rlx.softmax(x, -1), lambda x: _softmax(x, -1)),
    "log_softmax": (lambda x: rlx.log_softmax(x, -1), lambda x: np.log(_softmax(x, -1))),
    "sum": (lambda x: x.sum(axis=1), lambda x: x.sum(axis=1)),
    "mean": (lambda x: x.mean(), np.mean),
    "max": (lambda x: x.max(axis=0), lambda x: x.max(axis=0)),
    "scalar ops": (lambda x: (x * 2.5 + 1) / 4 - 0.5, lambda x: (x * 2.5 + 1) / 4 - 0.5),
    "square": (lambda x: x * x, np.square),
}


@pytest.mark.parametrize("dtype", list(LOW))
@pytest.mark.parametrize("name", list(UNARY))
def test_ops_compute_in_float32_and_round_back(name, dtype):
    ours, ref = UNARY[name]
    x = np.random.default_rng(3).standard_normal((6, 10)).astype(LOW[dtype])
    out_dtype, got = _run(ours, [x])
    assert out_dtype == dtype and got.dtype == LOW[dtype]
    scale = 10.0 if name in ("sum", "log_softmax") else 1.0
    _check(got, ref(x.astype(np.float64)), dtype, scale)


@pytest.mark.parametrize("dtype", list(LOW))
def test_binary_ops_promotion_and_matmul(dtype):
    rng = np.random.default_rng(4)
    a = rng.standard_normal((5, 7)).astype(LOW[dtype])
    b = rng.standard_normal((5, 7)).astype(LOW[dtype])
    f = rng.standard_normal((5, 7)).astype(np.float32)
    i = rng.integers(-3, 3, (5, 7)).astype(np.int32)
    a64, b64, f64 = (v.astype(np.float64) for v in (a, b, f))
    for fn, want, out in [
        (lambda x, y: x * y + x, a64 * b64 + a64, dtype),
        (lambda x, y: x / (rlx.abs(y) + 1), a64 / (np.abs(b64) + 1), dtype),
        (lambda x, y: rlx.maximum(x, y), np.maximum(a64, b64), dtype),
        (lambda x, y: rlx.where(x > y, x, 0.5), np.where(a64 > b64, a64, 0.5), dtype),
    ]:
        got_dtype, got = _run(fn, [a, b])
        assert got_dtype == out
        _check(got, want, dtype)
    # Beside float32: float32, computed from the rounded low values.
    got_dtype, got = _run(lambda x, y: x + y, [a, f])
    assert got_dtype == "float32"
    np.testing.assert_allclose(got, a64 + f64, rtol=1e-6, atol=1e-6)
    # Beside int32: the low dtype.
    got_dtype, got = _run(lambda x, y: x * y, [a, i])
    assert got_dtype == dtype
    _check(got, a64 * i, dtype)
    # bfloat16 with float16: float32.
    other = "float16" if dtype == "bfloat16" else "bfloat16"
    c = rng.standard_normal((5, 7)).astype(LOW[other])
    got_dtype, got = _run(lambda x, y: x - y, [a, c])
    assert got_dtype == "float32"
    np.testing.assert_allclose(got, a64 - c.astype(np.float64), rtol=1e-6, atol=1e-6)
    # A matmul of two low operands sums in float32 and returns float32 (the mixed-precision
    # product); with a float32 operand the low one is widened.
    for y in (b.T.copy(), f.T.copy()):
        got_dtype, got = _run(lambda x, w: x @ w, [a, y])
        assert got_dtype == "float32"
        np.testing.assert_allclose(got, a64 @ y.astype(np.float64), rtol=1e-5, atol=1e-5)


def test_gradients_flow_through_low_precision_activations():
    """A float32 model whose hidden activations are rounded to bfloat16: its gradients are those
    of the float32 model to within bfloat16 rounding, and stop_gradient stops them."""

    class Net(rlx.nn.Module):
        def __init__(self, low):
            self.l1, self.l2, self.low = rlx.nn.Linear(6, 16), rlx.nn.Linear(16, 3), low

        def __call__(self, x, stop=False):
            h = self.l1(x)
            if self.low:
                h = rlx.tanh(h.astype("bfloat16"))
                h = rlx.stop_gradient(h) if stop else h
                return self.l2(h.astype("float32"))
            return self.l2(rlx.tanh(h))

    rng = np.random.default_rng(5)
    x = rng.standard_normal((8, 6)).astype(np.float32)
    y = rng.integers(0, 3, 8).astype(np.int32)
    spec = {"x": rlx.InputSpec((8, 6)), "y": rlx.InputSpec((8,), "int32")}
    grads = {}
    for low in (False, True):
        rlx.seed(2)
        net = Net(low)
        step = rlx.compile_train_step(lambda m, x, y: rlx.cross_entropy(m(x), y), net, rlx.optim.SGD(0.0), spec)
        step(x=x, y=y)
        grads[low] = {k: np.array(v) for k, v in step.grads.items()}
    for k, g32 in grads[False].items():
        np.testing.assert_allclose(grads[True][k], g32, rtol=0.05, atol=2e-3, err_msg=k)
    rlx.seed(2)
    net = Net(True)
    step = rlx.compile_train_step(lambda m, x, y: rlx.cross_entropy(m(x, stop=True), y), net, rlx.optim.SGD(0.0),
                                  spec)
    step(x=x, y=y)
    assert not np.any(np.array(step.grads["l1.weight"]))
    assert np.any(np.array(step.grads["l2.weight"]))


class _Tiny(rlx.nn.Module):
    def __init__(self):
        self.emb = rlx.nn.Embedding(20, 16)
        self.norm = rlx.nn.LayerNorm(16)
        self.fc1, self.fc2 = rlx.nn.Linear(16, 32), rlx.nn.Linear(32, 5)

    def __call__(self, ids):
        h = self.norm(self.emb(ids))
        return self.fc2(rlx.gelu(self.fc1(h)))


def test_a_bfloat16_model_runs_inference_and_refuses_training():
    rlx.seed(7)
    model = _Tiny()
    ids = np.random.default_rng(6).integers(0, 20, (4, 9)).astype(np.int32)
    spec = {"ids": rlx.InputSpec((4, 9), "int32")}
    want = np.array(rlx.compile(lambda m, ids: m(ids), model, spec)(ids=ids))
    model.to("bfloat16")
    got = np.array(rlx.compile(lambda m, ids: m(ids), model, spec)(ids=ids))
    assert np.all(np.isfinite(got))
    # The weights were rounded to bfloat16: a few bfloat16 roundings of error.
    np.testing.assert_allclose(got.astype(np.float32), want, rtol=0.05, atol=0.03)
    with pytest.raises(rlx.DTypeError, match=r"training bfloat16 weights is not supported yet"):
        rlx.compile_train_step(lambda m, ids: m(ids).sum(), model, rlx.optim.SGD(0.1), spec)


def test_a_bfloat16_model_matches_torch():
    torch = pytest.importorskip("torch")
    rlx.seed(8)
    model = _Tiny()
    model.to("bfloat16")
    sd = model.state_dict()
    tm = torch.nn.ModuleDict({"emb": torch.nn.Embedding(20, 16), "norm": torch.nn.LayerNorm(16),
                              "fc1": torch.nn.Linear(16, 32), "fc2": torch.nn.Linear(32, 5)}).to(torch.bfloat16)
    tm.load_state_dict({k: torch.tensor(np.asarray(v).astype(np.float32)).to(torch.bfloat16) for k, v in sd.items()})
    ids = np.random.default_rng(9).integers(0, 20, (4, 9)).astype(np.int32)
    got = np.array(rlx.compile(lambda m, ids: m(ids), model, {"ids": rlx.InputSpec((4, 9), "int32")})(ids=ids))
    t = torch.tensor(ids, dtype=torch.long)
    with torch.no_grad():
        ref = tm["fc2"](torch.nn.functional.gelu(tm["fc1"](tm["norm"](tm["emb"](t))))).float().numpy()
    # PyTorch rounds every op's result to bfloat16; rlx keeps matmul sums in float32.
    np.testing.assert_allclose(got.astype(np.float32), ref, rtol=0.05, atol=0.05)


def test_float64_beside_a_low_dtype_computes_in_float64():
    g = rlx.Graph()
    x, h = g.input("x", (2, 2), "float64"), g.input("h", (2, 2), "bfloat16")
    assert (rlx.exp(x) * h).dtype == "float64"  # float64 wins, as PyTorch's promotion


def test_a_bfloat16_gpt_generates_with_its_kv_caches():
    rlx.seed(4)
    model = rlx.models.GPT(vocab=64, dim=32, heads=4, layers=2, seq_len=16)
    gen = rlx.models.Generator(model)
    want = [gen.step(np.array([[t]])) for t in (3, 5, 7)]
    model.to("bfloat16")
    gen = rlx.models.Generator(model)
    got = [gen.step(np.array([[t]])) for t in (3, 5, 7)]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.astype(np.float32), w, rtol=0.05, atol=0.02)
    assert len(gen.generate([1, 2], n=4, temperature=0.0)) == 6


@pytest.mark.parametrize("dtype", list(LOW))
def test_numbers_are_used_unrounded_and_masks_stay_float32(dtype):
    x = np.full((300,), 1.0, LOW[dtype])
    # 1e5 is inf in float16 and 257 rounds to 256 in bfloat16: the number is used as given and
    # only the result is rounded (PyTorch's CPU kernels do the same).
    got_dtype, got = _run(lambda v: v / 1e5, [x])
    assert got_dtype == dtype
    _check(got, np.full(300, 1e-5), dtype)
    _, got = _run(lambda v: v + 257, [x])
    _check(got, np.full(300, 258.0), dtype)
    # A comparison is a float32 mask whose sum counts exactly (a bfloat16 sum would round 300).
    got_dtype, got = _run(lambda v: (v > 0).sum(), [x])
    assert got_dtype == "float32" and float(got) == 300.0
