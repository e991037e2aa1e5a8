"""Bad input: every refused call raises the right rlx error and leaves params and optimizer state
untouched; accepted conversions (int dtypes, strides, byte order) give the contiguous result."""

import numpy as np
import pytest

import rlx
from conftest import Empty, assert_close
from models import LinearNet, ce_loss

N, D, C = 6, 4, 3


def Net():
    return LinearNet(D, C)


loss_fn = ce_loss


INPUTS = {"x": rlx.InputSpec((N, D)), "y": rlx.InputSpec((N,), dtype="int32")}


def good_batch(seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((N, D)).astype(np.float32),
            rng.integers(0, C, N).astype(np.int32))


def np_loss(model, x, y):
    p = {k: v.numpy().astype(np.float64) for k, v in model.parameters().items()}
    z = x.astype(np.float64) @ p["fc.weight"].T + p["fc.bias"]
    z = z - z.max(axis=1, keepdims=True)
    lp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return float(-lp[np.arange(len(y)), np.asarray(y, dtype=np.int64)].mean())


OPTIMIZERS = {
    "adam": lambda: rlx.optim.Adam(lr=0.01),
    "sgd-momentum": lambda: rlx.optim.SGD(lr=0.1, momentum=0.9, weight_decay=0.01),
}
STATE_KEYS = {"adam": ("exp_avg", "exp_avg_sq", "step"), "sgd-momentum": ("momentum_buffer",)}


def setup(opt_name, seed=0):
    rlx.seed(seed)
    model = Net()
    opt = OPTIMIZERS[opt_name]()
    step = rlx.compile_train_step(loss_fn, model, opt, INPUTS)
    x, y = good_batch()
    step(x=x, y=y)  # optimizer state is non-trivial from here on
    return model, opt, step


def snapshot(model, opt, opt_name):
    snap = {}
    for k, p in model.parameters().items():
        snap[("param", k)] = p.numpy().copy()
        st = opt.state(k)
        for key in STATE_KEYS[opt_name]:
            snap[(key, k)] = np.array(st[key], copy=True)
    return snap


def assert_unchanged(model, opt, opt_name, snap):
    for k, p in model.parameters().items():
        np.testing.assert_array_equal(p.numpy(), snap[("param", k)], err_msg=f"param {k}")
        st = opt.state(k)
        for key in STATE_KEYS[opt_name]:
            np.testing.assert_array_equal(np.asarray(st[key]), snap[(key, k)],
                                          err_msg=f"{key} of {k}")


def _x():
    return good_batch()[0]


def _y():
    return good_batch()[1]


# (id, kwargs factory, expected exception(s), regex the message must match)
BAD_CALLS = [
    ("missing-x", lambda: dict(y=_y()), rlx.InputError, r"\bx\b"),
    ("missing-y", lambda: dict(x=_x()), rlx.InputError, r"\by\b"),
    ("missing-all", lambda: dict(), rlx.InputError, None),
    ("unknown-name", lambda: dict(x=_x(), y=_y(), z=_x()), rlx.InputError, r"\bz\b"),
    ("misspelled-name", lambda: dict(X=_x(), y=_y()), rlx.InputError, r"\b[Xx]\b"),
    ("x-too-few-rows", lambda: dict(x=_x()[:5], y=_y()), rlx.ShapeError, r"\bx\b"),
    ("x-wrong-cols", lambda: dict(x=np.zeros((N, D + 1), np.float32), y=_y()), rlx.ShapeError,
     r"\bx\b"),
    ("x-extra-dim", lambda: dict(x=_x()[None], y=_y()), rlx.ShapeError, r"\bx\b"),
    ("x-flattened", lambda: dict(x=_x().reshape(-1), y=_y()), rlx.ShapeError, r"\bx\b"),
    ("y-wrong-shape", lambda: dict(x=_x(), y=_y()[:, None]), rlx.ShapeError, r"\by\b"),
    ("x-float64", lambda: dict(x=_x().astype(np.float64), y=_y()), rlx.DTypeError, r"\bx\b"),
    ("y-float32", lambda: dict(x=_x(), y=_y().astype(np.float32)), rlx.DTypeError, r"\by\b"),
    ("label-equals-C", lambda: dict(x=_x(), y=np.array([0, 1, 2, C, 0, 1], np.int32)),
     rlx.InputError, None),
    ("label-huge", lambda: dict(x=_x(), y=np.array([0, 1, 2, 1000, 0, 1], np.int32)),
     rlx.InputError, None),
    ("label-negative", lambda: dict(x=_x(), y=np.array([0, -1, 2, 1, 0, 1], np.int32)),
     rlx.InputError, None),
    ("label-int64-overflow", lambda: dict(x=_x(), y=np.array([0, 1, 2, 2**40, 0, 1], np.int64)),
     (rlx.InputError, rlx.DTypeError), None),
]


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("case", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_step_call_raises_and_changes_nothing(case, opt_name):
    _, make_kwargs, exc, pattern = case
    model, opt, step = setup(opt_name)
    snap = snapshot(model, opt, opt_name)
    with pytest.raises(exc, match=pattern) as info:
        step(**make_kwargs())
    assert isinstance(info.value, rlx.RlxError)
    assert_unchanged(model, opt, opt_name, snap)


def test_training_after_failed_calls_matches_clean_run():
    """A run interleaved with refused calls ends exactly where a clean run does."""
    model_a, _, step_a = setup("adam")
    model_b, _, step_b = setup("adam")
    x, y = good_batch(1)
    for _, make_kwargs, exc, _ in BAD_CALLS:
        with pytest.raises(exc):
            step_a(**make_kwargs())
    for _ in range(2):
        la, lb = step_a(x=x, y=y), step_b(x=x, y=y)
        assert la == pytest.approx(lb, rel=1e-6, abs=1e-7)
    for k, p in model_a.parameters().items():
        np.testing.assert_allclose(p.numpy(), model_b.parameters()[k].numpy(), rtol=1e-6,
                                   atol=1e-7, err_msg=k)


def test_error_classes_hierarchy():
    assert issubclass(rlx.ShapeError, rlx.RlxError) and issubclass(rlx.ShapeError, ValueError)
    assert issubclass(rlx.DTypeError, rlx.RlxError) and issubclass(rlx.DTypeError, TypeError)
    assert issubclass(rlx.DeviceError, rlx.RlxError) and issubclass(rlx.DeviceError, RuntimeError)
    assert issubclass(rlx.UnsupportedError, rlx.RlxError)
    assert issubclass(rlx.UnsupportedError, NotImplementedError)
    assert issubclass(rlx.CheckpointError, rlx.RlxError)
    assert issubclass(rlx.InputError, rlx.RlxError) and issubclass(rlx.InputError, ValueError)
    assert issubclass(rlx.RlxError, Exception)


# ----------------------------------------------------------------------------------------------
# inference functions refuse the same mistakes
# ----------------------------------------------------------------------------------------------
FN_BAD = [
    ("missing", lambda x: dict(), rlx.InputError, r"\bx\b"),
    ("unknown", lambda x: dict(x=x, extra=x), rlx.InputError, r"\bextra\b"),
    ("shape", lambda x: dict(x=x[:, :2]), rlx.ShapeError, r"\bx\b"),
    ("float64", lambda x: dict(x=x.astype(np.float64)), rlx.DTypeError, r"\bx\b"),
]


@pytest.mark.parametrize("case", FN_BAD, ids=[c[0] for c in FN_BAD])
def test_bad_inference_call(case):
    _, make_kwargs, exc, pattern = case
    rlx.seed(0)
    model = Net()
    fn = rlx.compile(lambda m, x: m(x), model, {"x": rlx.InputSpec((N, D))})
    x = _x()
    expected = fn(x=x)
    with pytest.raises(exc, match=pattern):
        fn(**make_kwargs(x))
    np.testing.assert_array_equal(fn(x=x), expected)


# ----------------------------------------------------------------------------------------------
# accepted conversions
# ----------------------------------------------------------------------------------------------
def _noncontig(a):
    big = np.zeros((a.shape[0], a.shape[1] * 2), dtype=a.dtype)
    big[:, ::2] = a
    v = big[:, ::2]
    assert not v.flags.c_contiguous
    return v


def _reversed_strides(a):
    r = a[::-1].copy()[::-1]
    assert r.strides[0] < 0
    return r


def _readonly(a):
    a = a.copy()
    a.setflags(write=False)
    return a


X_VARIANTS = {
    "non-contiguous": _noncontig,
    "fortran": np.asfortranarray,
    "big-endian": lambda a: a.astype(">f4"),
    "negative-strides": _reversed_strides,
    "read-only": _readonly,
    "transposed-view": lambda a: np.ascontiguousarray(a.T).T,
}
Y_VARIANTS = {
    "int64": lambda a: a.astype(np.int64),
    "int16": lambda a: a.astype(np.int16),
    "int8": lambda a: a.astype(np.int8),
    "uint8": lambda a: a.astype(np.uint8),
    "uint32": lambda a: a.astype(np.uint32),
    "non-contiguous": lambda a: np.repeat(a, 2)[::2],
    "big-endian": lambda a: a.astype(">i4"),
}


def lr0_step(seed=0):
    rlx.seed(seed)
    model = Net()
    step = rlx.compile_train_step(loss_fn, model, rlx.optim.SGD(lr=0.0), INPUTS)
    return model, step


@pytest.mark.parametrize("variant", list(X_VARIANTS))
def test_x_layout_variants_accepted(variant):
    model, step = lr0_step()
    x, y = good_batch(2)
    ref = step(x=x, y=y)
    assert_close(ref, np_loss(model, x, y), rtol=1e-5, atol=1e-6)
    xv = X_VARIANTS[variant](x)
    np.testing.assert_array_equal(xv, x)
    assert step(x=xv, y=y) == pytest.approx(ref, rel=1e-6, abs=1e-7)


@pytest.mark.parametrize("variant", list(Y_VARIANTS))
def test_label_dtype_variants_accepted(variant):
    model, step = lr0_step()
    x, y = good_batch(3)
    ref = step(x=x, y=y)
    yv = Y_VARIANTS[variant](y)
    assert step(x=x, y=yv) == pytest.approx(ref, rel=1e-6, abs=1e-7)


@pytest.mark.parametrize("variant", ["non-contiguous", "fortran", "big-endian"])
def test_inference_layout_variants_accepted(variant):
    rlx.seed(0)
    model = Net()
    fn = rlx.compile(lambda m, x: m(x), model, {"x": rlx.InputSpec((N, D))})
    x = _x()
    np.testing.assert_allclose(fn(x=X_VARIANTS[variant](x)), fn(x=x), rtol=1e-6, atol=1e-7)


def test_int64_labels_train_like_int32():
    model_a, step_a = lr0_step()
    x, y = good_batch(4)
    _, step_b = lr0_step()
    assert step_a(x=x, y=y.astype(np.int64)) == pytest.approx(step_b(x=x, y=y), rel=1e-6)
    for k in step_a.grads:
        np.testing.assert_allclose(step_a.grads[k], step_b.grads[k], rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------------------------
# devices
# ----------------------------------------------------------------------------------------------
def test_devices_lists_cpu():
    devs = rlx.devices()
    assert isinstance(devs, list) and all(isinstance(d, str) for d in devs)
    assert "cpu" in devs


@pytest.mark.parametrize("device", ["tpu", "cuda:99", "gpu", ""])
def test_unknown_device_raises_listing_available(device):
    rlx.seed(0)
    with pytest.raises(rlx.DeviceError, match="cpu") as info:
        rlx.compile(lambda m, x: m(x), Net(), {"x": rlx.InputSpec((N, D))}, device=device)
    assert isinstance(info.value, RuntimeError)
    with pytest.raises(rlx.DeviceError, match="cpu"):
        rlx.compile_train_step(loss_fn, Net(), rlx.optim.SGD(lr=0.1), INPUTS, device=device)


@pytest.mark.parametrize("device", ["cuda", "cuda:0", "metal"])
def test_absent_backend_raises_device_error(device):
    if device.split(":")[0] in rlx.devices() or device in rlx.devices():
        pytest.skip(f"{device} is available here")
    with pytest.raises(rlx.DeviceError, match="cpu"):
        rlx.compile(lambda m, x: m(x), Net(), {"x": rlx.InputSpec((N, D))}, device=device)


def test_explicit_cpu_device():
    rlx.seed(0)
    model = Net()
    fn = rlx.compile(lambda m, x: m(x), model, {"x": rlx.InputSpec((N, D))}, device="cpu")
    x = _x()
    p = {k: v.numpy().astype(np.float64) for k, v in model.parameters().items()}
    assert_close(fn(x=x), x @ p["fc.weight"].T + p["fc.bias"], rtol=1e-5, atol=1e-6)


def test_a_rust_panic_becomes_an_rlx_error_and_the_process_lives_on():
    from rlx import _rlx

    with pytest.raises(rlx.RlxError, match="internal error.*deliberate panic"):
        _rlx._panic_for_tests()
    # the interpreter and the library keep working afterwards
    fn = rlx.compile(lambda m, x: x * 2.0, Empty(), {"x": rlx.InputSpec((2,))})
    np.testing.assert_array_equal(fn(x=np.ones(2, np.float32)), [2.0, 2.0])


def test_a_nan_setting_names_the_setting_without_a_bogus_range():
    """A number checked for finiteness only used to read 'must be a finite number >= None'."""
    from conftest import run_forward
    x = {"x": np.ones((2, 2), np.float32)}
    with pytest.raises(rlx.InputError, match=r"^\[leaky_relu\] negative_slope must be a finite number, got nan$"):
        run_forward(lambda x: rlx.leaky_relu(x, float("nan")), x)
    with pytest.raises(rlx.InputError, match=r"^\[dropout\] p must be a finite number, got nan$"):
        run_forward(lambda x: rlx.dropout(x, float("nan"), True), x)
