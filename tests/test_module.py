"""Modules: parameter naming and order, initialisation, seeding, layers' forward results."""

import math

import numpy as np
import pytest

import rlx
from conftest import assert_close, specs


def params_np(model):
    return {k: np.array(p.numpy(), copy=True) for k, p in model.parameters().items()}


def test_linear_parameters_shapes_and_init_bounds():
    rlx.seed(0)
    lin = rlx.nn.Linear(64, 32)
    ps = lin.parameters()
    assert list(ps) == ["weight", "bias"]
    w, b = ps["weight"], ps["bias"]
    assert tuple(w.shape) == (32, 64) and tuple(b.shape) == (32,)  # PyTorch's (out, in)
    assert np.dtype(w.dtype) == np.float32 and np.dtype(b.dtype) == np.float32
    wn, bn = w.numpy(), b.numpy()
    assert wn.shape == (32, 64) and wn.dtype == np.float32
    bound = 1.0 / math.sqrt(64)
    assert np.all(np.abs(wn) <= bound) and np.all(np.abs(bn) <= bound)
    # U(-bound, bound): std = bound / sqrt(3), mean ~ 0, and it really spreads over the interval
    assert abs(wn.std() - bound / math.sqrt(3)) < 0.1 * bound
    assert abs(wn.mean()) < 0.05 * bound
    assert wn.max() > 0.9 * bound and wn.min() < -0.9 * bound
    assert len(np.unique(bn)) > 16


def test_linear_without_bias():
    lin = rlx.nn.Linear(3, 2, bias=False)
    assert list(lin.parameters()) == ["weight"]
    assert tuple(lin.weight.shape) == (2, 3)


def test_seed_makes_init_deterministic():
    rlx.seed(123)
    a = params_np(rlx.nn.Linear(8, 4))
    rlx.seed(123)
    b = params_np(rlx.nn.Linear(8, 4))
    rlx.seed(124)
    c = params_np(rlx.nn.Linear(8, 4))
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    assert not np.array_equal(a["weight"], c["weight"])


def test_two_layers_after_one_seed_differ():
    rlx.seed(0)
    a, b = rlx.nn.Linear(8, 8), rlx.nn.Linear(8, 8)
    assert not np.array_equal(a.weight.numpy(), b.weight.numpy())


class Nested(rlx.nn.Module):
    def __init__(self):
        super().__init__()
        self.zeta = rlx.nn.Linear(4, 5)          # assigned first, sorts last alphabetically
        self.scale = rlx.nn.Parameter(np.full((5,), 2.0, dtype=np.float64))
        self.alpha = rlx.nn.Linear(5, 3, bias=False)

    def __call__(self, x):
        return self.alpha(self.zeta(x) * self.scale)


def test_nested_names_follow_assignment_order():
    m = Nested()
    assert list(m.parameters()) == ["zeta.weight", "zeta.bias", "scale", "alpha.weight"]
    assert isinstance(m.parameters()["scale"], rlx.nn.Parameter)


def test_parameter_wraps_array_as_float32():
    a = np.arange(6, dtype=np.float64).reshape(2, 3)
    p = rlx.nn.Parameter(a)
    assert tuple(p.shape) == (2, 3)
    assert np.dtype(p.dtype) == np.float32
    out = p.numpy()
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, a.astype(np.float32))


def test_parameters_act_as_tensors_in_a_trace():
    from conftest import make_module

    w = np.arange(6, dtype=np.float32).reshape(2, 3) - 2.5
    m = make_module(w=w)
    seen = {}

    def fwd(m):
        seen["shape"] = tuple(m.w.shape)
        return (m.w.sum(axis=0), m.w.T, m.w.reshape(3, 2), m.w.max(), m.w.mean(axis=1),
                m.w @ np.ones((3, 1), np.float32), rlx.relu(m.w), -m.w, m.w ** 2, m.w > 0.0)

    outs = rlx.compile(fwd, m, {})()
    assert seen["shape"] == (2, 3)
    refs = (w.sum(axis=0), w.T, w.reshape(3, 2), w.max(), w.mean(axis=1), w @ np.ones((3, 1)),
            np.maximum(w, 0), -w, w**2, (w > 0).astype(np.float32))
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs):
        assert_close(o, r, rtol=1e-6, atol=1e-6)


def test_every_tensor_operator_behaves_the_same_on_a_parameter():
    from conftest import make_module

    # systematically: each operator dunder of Tensor is also Parameter's (forwarded, not object's)
    tensor_ops = {n for n in vars(rlx.Tensor) if n.startswith("__") and n.endswith("__")}
    dunders = tensor_ops & rlx.nn.OPERATOR_DUNDERS
    assert {"__eq__", "__ne__", "__floordiv__", "__mod__", "__rmod__", "__getitem__", "__neg__"} <= dunders
    for name in dunders:
        assert name in vars(rlx.nn.Parameter), name
    # and Tensor's other dunders are not operators (so nothing is missed by the list)
    others = tensor_ops - dunders - {"__init__", "__repr__", "__hash__", "__bool__", "__array_ufunc__",
                                     "__array_priority__", "__dict__", "__doc__", "__module__", "__weakref__",
                                     "__annotations__", "__firstlineno__", "__static_attributes__"}
    assert not others, f"Tensor dunders neither forwarded nor known: {sorted(others)}"
    w = np.array([[1.0, -2.0, 3.0], [0.0, 2.0, -1.0]], np.float32)
    x = np.array([1.0, 2.0, 3.0], np.float32)
    cases = {
        "==": (lambda p, x: p == x, lambda w, x: w == x), "!=": (lambda p, x: p != x, lambda w, x: w != x),
        "== scalar": (lambda p, x: p == 2.0, lambda w, x: w == 2.0),
        "!= scalar": (lambda p, x: p != 0.0, lambda w, x: w != 0.0),
        "scalar ==": (lambda p, x: 3.0 == p, lambda w, x: 3.0 == w),
        "<": (lambda p, x: p < x, lambda w, x: w < x), ">=": (lambda p, x: p >= x, lambda w, x: w >= x),
        "//": (lambda p, x: p // 2.0, lambda w, x: w // 2.0), "%": (lambda p, x: p % 2.0, lambda w, x: w % 2.0),
        "r%": (lambda p, x: 5.0 % p, lambda w, x: np.remainder(5.0, w)),
        "r//": (lambda p, x: 5.0 // p, lambda w, x: np.floor_divide(5.0, w)),
        "+": (lambda p, x: p + x, lambda w, x: w + x), "r-": (lambda p, x: 1.0 - p, lambda w, x: 1.0 - w),
        "r/": (lambda p, x: 6.0 / p, lambda w, x: 6.0 / w), "neg": (lambda p, x: -p, lambda w, x: -w),
        "[]": (lambda p, x: p[1, :2], lambda w, x: w[1, :2]), "@": (lambda p, x: p @ x.reshape(3, 1), lambda w, x: w @ x.reshape(3, 1)),
    }
    m = make_module(w=w)
    for name, (op, ref) in cases.items():
        with np.errstate(divide="ignore", invalid="ignore"):
            expected = np.asarray(ref(w, x)).astype(np.float32)
        as_param = rlx.compile(lambda m, x, op=op: op(m.w, x), m, {"x": rlx.InputSpec((3,))})(x=x)
        as_tensor = rlx.compile(lambda m, x, op=op: op(m.w * 1.0, x), m, {"x": rlx.InputSpec((3,))})(x=x)
        np.testing.assert_array_equal(as_param, expected, err_msg=name)
        np.testing.assert_array_equal(as_tensor, expected, err_msg=name)


def test_parameter_equality_outside_a_trace_is_identity_and_hashing_is_kept():
    p, q = rlx.nn.Parameter(np.zeros(2)), rlx.nn.Parameter(np.zeros(2))
    assert p == p and p != q and not (p == q) and not (p != p)
    assert {p: 1, q: 2}[q] == 2 and len({p, q, p}) == 2
    assert q in [p, q] and [p, q].index(q) == 1
    assert hash(p) == object.__hash__(p)
    assert bool(p)  # a Parameter is truthy outside a trace, as any object


def test_nested_module_forward():
    m = Nested()
    x = np.random.default_rng(0).standard_normal((6, 4)).astype(np.float32)
    p = params_np(m)
    fn = rlx.compile(lambda m, x: m(x), m, specs({"x": x}))
    expected = ((x @ p["zeta.weight"].T + p["zeta.bias"]) * 2.0) @ p["alpha.weight"].T
    assert_close(fn(x=x), expected, rtol=1e-5, atol=1e-5)


def test_sequential_names_and_forward():
    rlx.seed(1)
    seq = rlx.nn.Sequential(rlx.nn.Linear(4, 8), rlx.nn.ReLU(), rlx.nn.Linear(8, 3))
    assert list(seq.parameters()) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    p = params_np(seq)
    x = np.random.default_rng(1).standard_normal((5, 4)).astype(np.float32)
    fn = rlx.compile(lambda m, x: m(x), seq, specs({"x": x}))
    h = np.maximum(x.astype(np.float64) @ p["0.weight"].T + p["0.bias"], 0)
    assert_close(fn(x=x), h @ p["2.weight"].T + p["2.bias"], rtol=1e-5, atol=1e-5)


def test_sequential_nested_in_module_names():
    class M(rlx.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = rlx.nn.Sequential(rlx.nn.Linear(2, 2), rlx.nn.ReLU(), rlx.nn.Linear(2, 1))

    assert list(M().parameters()) == ["body.0.weight", "body.0.bias", "body.2.weight",
                                      "body.2.bias"]


def test_linear_on_3d_input():
    rlx.seed(2)
    lin = rlx.nn.Linear(4, 3)
    p = params_np(lin)
    x = np.random.default_rng(2).standard_normal((2, 5, 4)).astype(np.float32)
    fn = rlx.compile(lambda m, x: m(x), lin, specs({"x": x}))
    assert_close(fn(x=x), x.astype(np.float64) @ p["weight"].T + p["bias"], rtol=1e-5, atol=1e-5)


class _EncoderHead(rlx.nn.Module):
    def __init__(self):
        self.encoder = rlx.nn.Linear(3, 4)
        self.head = rlx.nn.Linear(4, 2)

    def __call__(self, x):
        return self.head(rlx.relu(self.encoder(x)))


def test_compiling_a_sub_module_stops_the_parents_step_loudly_and_keeps_its_weights():
    """A sub-module compiled on its own takes its weights into a store of its own; the parent's
    step used to go on updating weights nothing read (state_dict and save were stale)."""
    model = _EncoderHead()
    spec = {"x": rlx.InputSpec((8, 3))}
    step = rlx.compile_train_step(lambda m, x: (m(x) ** 2).mean(), model, rlx.optim.SGD(lr=0.05), spec)
    x = np.random.default_rng(0).random((8, 3), dtype=np.float32)
    for _ in range(3):
        step(x=x)
    trained = model.state_dict()
    embed = rlx.compile(lambda m, x: m(x), model.encoder, spec)
    np.testing.assert_allclose(embed(x=x), x @ trained["encoder.weight"].T + trained["encoder.bias"],
                               rtol=1e-5, atol=1e-6)
    with pytest.raises(rlx.RlxError, match="weights moved to the store of a model compiled since"):
        step(x=x)
    for k, v in model.state_dict().items():  # nothing the parent trained is lost
        np.testing.assert_array_equal(v, trained[k], err_msg=k)
    # Compiled as a function of the whole model, the sub-module shares the parent's weights.
    step = rlx.compile_train_step(lambda m, x: (m(x) ** 2).mean(), model, rlx.optim.SGD(lr=0.05), spec)
    encode = rlx.compile(lambda m, x: m.encoder(x), model, spec)
    step(x=x)
    w = model.state_dict()
    np.testing.assert_allclose(encode(x=x), x @ w["encoder.weight"].T + w["encoder.bias"], rtol=1e-5, atol=1e-6)
    step(x=x)
    assert not np.array_equal(model.state_dict()["encoder.weight"], w["encoder.weight"])


def test_two_models_sharing_a_layer_cannot_both_train_it_silently():
    shared = rlx.nn.Linear(3, 3)

    class Wrap(rlx.nn.Module):
        def __init__(self, layer):
            self.layer = layer

        def __call__(self, x):
            return self.layer(x)

    a, b = Wrap(shared), Wrap(shared)
    spec = {"x": rlx.InputSpec((2, 3))}
    x = np.ones((2, 3), np.float32)
    step_a = rlx.compile_train_step(lambda m, x: m(x).sum(), a, rlx.optim.SGD(lr=0.1), spec)
    step_a(x=x)
    rlx.compile(lambda m, x: m(x), b, spec)
    with pytest.raises(rlx.RlxError, match="weights moved"):
        step_a(x=x)


def test_assigning_an_array_over_a_parameter_is_refused():
    """It used to unregister the parameter silently (no longer trained or saved)."""
    lin = rlx.nn.Linear(3, 2)
    with pytest.raises(rlx.RlxError, match=r"\[Linear.weight\] assigning a numpy array would unregister the parameter"):
        lin.weight = np.ones((2, 3), np.float32)
    assert "weight" in lin.parameters()
    lin.weight = rlx.nn.Parameter(np.ones((2, 3), np.float32))
    np.testing.assert_array_equal(lin.state_dict()["weight"], np.ones((2, 3)))
