"""Mixed precision on the CPU: bfloat16/float16 matmuls with float32 sums (both bfloat16 kernel
paths, against float64 numpy), the autocast rewrite (which ops read low-precision casts),
gradients of an MLP and loss curves of a tiny GPT under precision="bf16" against float32, the
fp16 loss scaler (skipped overflow steps, growth), and the clear errors around them."""

import json
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import rlx
from rlx import _rlx

BF16 = ml_dtypes.bfloat16


def cpu_has_avx512_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "avx512_bf16" in f.read()
    except OSError:
        return False


# ---------------------------------------------------------------------------------------------
# The bfloat16 GEMM, both paths
# ---------------------------------------------------------------------------------------------
# One process per path (the path is chosen once per process). For every shape and transpose:
# the product of bfloat16 operands through rlx.Graph, and its error against float64 numpy of the
# same bfloat16 values, relative to sum |a| |b| (the scale float32 summation errors follow).
GEMM_SCRIPT = r"""
import json, sys
import ml_dtypes, numpy as np, rlx
from rlx import _rlx
rng = np.random.default_rng(0)
errs = {}
for m, k, n in [(1, 1, 1), (7, 33, 65), (65, 130, 7), (130, 65, 33), (33, 7, 130), (1, 130, 1)]:
    for ta in (False, True):
        for tb in (False, True):
            a = rng.normal(size=(m, k)).astype(ml_dtypes.bfloat16)
            b = rng.normal(size=(k, n)).astype(ml_dtypes.bfloat16)
            g = rlx.Graph()
            x = g.input("a", (k, m) if ta else (m, k), "bfloat16")
            y = g.input("b", (n, k) if tb else (k, n), "bfloat16")
            g.output((x.T if ta else x) @ (y.T if tb else y))
            got = g.compile("cpu").run(a=np.ascontiguousarray(a.T) if ta else a,
                                       b=np.ascontiguousarray(b.T) if tb else b)
            got = got[0] if isinstance(got, (list, tuple)) else got
            assert got.dtype == np.float32, got.dtype
            a64, b64 = a.astype(np.float64), b.astype(np.float64)
            scale = np.abs(a64) @ np.abs(b64) + 1e-30
            errs[f"{m}x{k}x{n} {ta} {tb}"] = float(np.max(np.abs(got - a64 @ b64) / scale))
json.dump({"path": _rlx.cpu_bf16_path(), "errs": errs}, sys.stdout)
"""


def run_gemm(env_extra):
    env = {**os.environ, **env_extra}
    out = subprocess.run([sys.executable, "-c", GEMM_SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_bf16_gemm_matches_float64_on_both_kernel_paths():
    default = run_gemm({"RLX_CPU_BF16": ""})
    assert default["path"] == "portable"  # the AVX512-BF16 kernel is opt-in
    kernel = run_gemm({"RLX_CPU_BF16": "avx512bf16"})
    assert kernel["path"] == ("avx512bf16" if cpu_has_avx512_bf16() else "portable")
    for res in (default, kernel):
        assert len(res["errs"]) == 24
        for case, err in res["errs"].items():
            # Exact products, float32 sums: a few float32 ulps of sum |a||b|.
            assert err < 1e-6, (res["path"], case, err)
    # RLX_CPU_ISA=portable turns the AVX512-BF16 kernel off too.
    assert run_gemm({"RLX_CPU_BF16": "avx512bf16", "RLX_CPU_ISA": "portable"})["path"] == "portable"


def test_float16_matmul_and_mixed_operands():
    rng = np.random.default_rng(1)
    a = rng.normal(size=(5, 9)).astype(np.float16)
    b = rng.normal(size=(9, 3)).astype(np.float16)
    g = rlx.Graph()
    x, y = g.input("a", (5, 9), "float16"), g.input("b", (9, 3), "float16")
    g.output(x @ y)
    got = g.compile("cpu").run(a=a, b=b)
    got = got[0] if isinstance(got, (list, tuple)) else got
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, a.astype(np.float64) @ b.astype(np.float64), rtol=1e-6, atol=1e-6)
    # A bfloat16 operand beside a float32 one is widened: a float32 product.
    g = rlx.Graph()
    x, y = g.input("a", (5, 9), "bfloat16"), g.input("b", (9, 3), "float32")
    assert (x @ y).dtype == "float32"


# ---------------------------------------------------------------------------------------------
# The autocast rewrite
# ---------------------------------------------------------------------------------------------
def test_autocast_casts_matmul_operands_only():
    g = _rlx.Graph()
    x = g.input("x", [8, 4], "float32")
    w = g.param("w", [4, 6], "float32")
    h = g.matmul(x, w)
    s = g.softmax(h, 1)
    loss = g.reduce("sum", s, None, False)
    g.set_outputs([loss])
    a, where = g.autocast("bfloat16")
    assert a.outputs() == [where[loss]]
    assert a.dtype(where[h]) == "float32"  # float32 sums, float32 result
    assert a.dtype(where[s]) == "float32" and a.dtype(where[loss]) == "float32"
    assert len(a) == len(g) + 2  # one cast per matmul operand
    bw = a.grad(where[loss], [where[w]])
    assert bw.dtype(bw.outputs()[1]) == "float32"
    with pytest.raises(rlx.DTypeError, match=r"\[autocast\] computes in bfloat16 or float16, got float32"):
        g.autocast("float32")


def mlp(seed=0):
    rlx.seed(seed)
    return rlx.nn.Sequential(rlx.nn.Linear(12, 32), rlx.nn.GELU(), rlx.nn.Linear(32, 5))


def listing_counts(step):
    text = step.graph()
    return {k: text.count(k) for k in ("cast", "matmul", "bfloat16")}


def test_train_step_listing_shows_bf16_products_forward_and_backward():
    spec = {"x": rlx.InputSpec((16, 12)), "y": rlx.InputSpec((16,), "int32")}
    loss = lambda m, x, y: rlx.cross_entropy(m(x), y)  # noqa: E731
    f32 = rlx.compile_train_step(loss, mlp(), rlx.optim.SGD(0.0), spec)
    b16 = rlx.compile_train_step(loss, mlp(), rlx.optim.SGD(0.0), spec, precision="bf16")
    assert b16.precision == "bf16" and f32.precision == "fp32"
    assert "bfloat16" not in f32.graph()
    c = listing_counts(b16)
    assert c["bfloat16"] > 0 and c["cast"] >= 4


# ---------------------------------------------------------------------------------------------
# Gradients and inference
# ---------------------------------------------------------------------------------------------
def grads_of(precision):
    model = mlp()
    spec = {"x": rlx.InputSpec((16, 12)), "y": rlx.InputSpec((16,), "int32")}
    step = rlx.compile_train_step(lambda m, x, y: rlx.cross_entropy(m(x), y), model, rlx.optim.SGD(0.0), spec,
                                  precision=precision)
    rng = np.random.default_rng(4)
    x = rng.normal(size=(16, 12)).astype(np.float32)
    y = rng.integers(0, 5, 16).astype(np.int32)
    loss = step(x=x, y=y)
    return loss, {k: np.array(v) for k, v in step.grads.items()}, step


def test_mlp_gradients_in_bf16_and_fp16_are_close_to_float32_but_not_equal():
    l32, g32, _ = grads_of("fp32")
    for p, tol in (("bf16", 3e-2), ("fp16", 4e-3)):
        lp, gp, step = grads_of(p)
        assert abs(lp - l32) / abs(l32) < tol
        assert set(gp) == set(g32)
        for k in g32:
            assert gp[k].dtype == np.float32  # float32 gradients for the float32 masters
            rel = np.linalg.norm(gp[k] - g32[k]) / np.linalg.norm(g32[k])
            assert rel < tol, (p, k, rel)
        # Low precision really was used: some gradient differs from float32's.
        assert any(not np.array_equal(gp[k], g32[k]) for k in g32), p
        assert step.skipped == 0
    # Weights stay float32 masters.
    assert all(v.dtype == "float32" for v in mlp()._tensors().values())


def test_convolution_gradients_in_bf16_are_close_to_float32():
    def run(precision):
        rlx.seed(7)
        model = rlx.nn.Sequential(rlx.nn.Conv2d(3, 8, 3, padding=1), rlx.nn.ReLU(), rlx.nn.Flatten(),
                                  rlx.nn.Linear(8 * 6 * 6, 4))
        spec = {"x": rlx.InputSpec((5, 3, 6, 6)), "y": rlx.InputSpec((5,), "int32")}
        step = rlx.compile_train_step(lambda m, x, y: rlx.cross_entropy(m(x), y), model, rlx.optim.SGD(0.0), spec,
                                      precision=precision)
        rng = np.random.default_rng(8)
        step(x=rng.normal(size=(5, 3, 6, 6)).astype(np.float32), y=rng.integers(0, 4, 5).astype(np.int32))
        return {k: np.array(v) for k, v in step.grads.items()}, step.graph()

    g32, _ = run("fp32")
    g16, listing = run("bf16")
    assert "im2col" in listing and "bfloat16" in listing
    for k in g32:
        rel = np.linalg.norm(g16[k] - g32[k]) / np.linalg.norm(g32[k])
        assert 0 < rel < 3e-2, (k, rel)


def test_compile_bf16_inference_rounds_matmul_operands_to_bf16():
    model = rlx.nn.Linear(40, 7)
    rng = np.random.default_rng(2)
    x = rng.normal(size=(6, 40)).astype(np.float32)
    f = rlx.compile(lambda m, x: m(x), model, {"x": rlx.InputSpec((6, 40))}, precision="bf16")
    got = f(x=x)
    w, b = model.weight.numpy(), model.bias.numpy()
    r = lambda v: v.astype(BF16).astype(np.float64)  # noqa: E731
    want = r(x) @ r(w).T + b
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    exact = x.astype(np.float64) @ w.T.astype(np.float64) + b
    assert np.max(np.abs(got - exact)) > 1e-4  # the bfloat16 rounding shows
    f16 = rlx.compile(lambda m, x: m(x), model, {"x": rlx.InputSpec((6, 40))}, precision="fp16")
    h = lambda v: v.astype(np.float16).astype(np.float64)  # noqa: E731
    np.testing.assert_allclose(f16(x=x), h(x) @ h(w).T + b, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# fp16 loss scaling
# ---------------------------------------------------------------------------------------------
def scaled_step(**kw):
    rlx.seed(5)
    lin = rlx.nn.Linear(4, 3)
    spec = {"x": rlx.InputSpec((8, 4)), "y": rlx.InputSpec((8, 3))}
    opt = rlx.optim.Adam(1e-2)
    step = rlx.compile_train_step(lambda m, x, y: rlx.mse_loss(m(x), y), lin, opt, spec, precision="fp16", **kw)
    step.opt = opt
    rng = np.random.default_rng(6)
    return lin, step, rng.normal(size=(8, 4)).astype(np.float32), rng.normal(size=(8, 3)).astype(np.float32)


def test_fp16_overflow_step_is_skipped_and_the_scale_halves():
    lin, step, x, y = scaled_step(loss_scale=2.0 ** 40)
    assert step.loss_scale == 2.0 ** 40
    before = {k: np.array(v) for k, v in lin.state_dict().items()}
    loss = step(x=x, y=y)
    assert np.isfinite(loss)  # the reported loss is unscaled
    # loss * 2**40 gives gradients past float16's range: the cast to float16 overflows.
    assert step.skipped == 1
    assert step.loss_scale == 2.0 ** 39
    for k, v in lin.state_dict().items():
        np.testing.assert_array_equal(np.array(v), before[k])
    # The optimizer state did not move either (Adam's moments and step count stay zero).
    state = step.opt.state_dict()["state"]
    assert state and all(not np.any(a) for slots in state.values() for a in slots.values()), state
    # Halving until the gradients fit, then updates happen with unscaled gradients.
    for _ in range(40):
        skipped = step.skipped
        step(x=x, y=y)
        if step.skipped == skipped:
            break
    # |dloss/dy| is about 0.1 here: the first scale that fits float16 (max 65504) is near 2**19.
    assert 2.0 ** 16 <= step.loss_scale <= 2.0 ** 20 and step.skipped > 1
    assert not np.array_equal(np.array(lin.weight.numpy()), before["weight"])
    state = step.opt.state_dict()["state"]
    assert all(np.any(a) for slots in state.values() for a in slots.values()), state
    # The gradients the update used are the true ones: compare with a float32 step.
    rlx.seed(5)
    ref = rlx.nn.Linear(4, 3)
    ref.load_state_dict({k: np.array(v) for k, v in lin.state_dict().items()})
    spec = {"x": rlx.InputSpec((8, 4)), "y": rlx.InputSpec((8, 3))}
    s32 = rlx.compile_train_step(lambda m, x, y: rlx.mse_loss(m(x), y), ref, rlx.optim.SGD(0.0), spec)
    s32(x=x, y=y)
    step(x=x, y=y)
    for k in s32.grads:
        # float16 operands (x and the scaled gradient): about 1e-3 of the gradient's size.
        diff = np.linalg.norm(step.grads[k] - s32.grads[k]) / np.linalg.norm(s32.grads[k])
        assert diff < 3e-3, (k, diff)


def test_fp16_scale_grows_after_growth_interval_good_steps():
    lin, step, x, y = scaled_step(loss_scale=8.0, growth_interval=3)
    scales = []
    for _ in range(7):
        step(x=x, y=y)
        scales.append(step.loss_scale)
    assert step.skipped == 0
    assert scales == [8.0, 8.0, 16.0, 16.0, 16.0, 32.0, 32.0]


def test_precision_errors():
    lin = rlx.nn.Linear(2, 1)
    spec = {"x": rlx.InputSpec((4, 2)), "y": rlx.InputSpec((4, 1))}
    loss = lambda m, x, y: rlx.mse_loss(m(x), y)  # noqa: E731
    with pytest.raises(rlx.InputError, match=r"precision must be one of \['fp32', 'bf16', 'fp16'\], got 'fp8'"):
        rlx.compile_train_step(loss, lin, rlx.optim.SGD(0.1), spec, precision="fp8")
    with pytest.raises(rlx.UnsupportedError, match=r"precision='bf16' \(mixed precision\) runs on the CPU and CUDA "
                                                   r"only so far; device 'metal'"):
        rlx.compile_train_step(loss, lin, rlx.optim.SGD(0.1), spec, device="metal", precision="bf16")
    with pytest.raises(rlx.UnsupportedError, match=r"\[compile\] precision='fp16'"):
        rlx.compile(lambda m, x: m(x), lin, {"x": rlx.InputSpec((4, 2))}, device="metal", precision="fp16")
    if "cuda" not in rlx.devices():
        # Mixed precision is allowed on CUDA: without a GPU the device check refuses it.
        with pytest.raises(rlx.DeviceError):
            rlx.compile_train_step(loss, lin, rlx.optim.SGD(0.1), spec, device="cuda", precision="bf16")
    with pytest.raises(rlx.UnsupportedError, match=r"precision='fp16' with accumulate > 1 is not supported yet"):
        rlx.compile_train_step(loss, lin, rlx.optim.SGD(0.1), spec, precision="fp16", accumulate=2)
    for bad in (0.0, -1.0, float("inf"), float("nan"), True, "1"):
        with pytest.raises(rlx.InputError, match=r"loss_scale must be a positive finite number"):
            rlx.compile_train_step(loss, lin, rlx.optim.SGD(0.1), spec, precision="fp16", loss_scale=bad)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(rlx.InputError, match=r"growth_interval must be an int >= 1"):
            rlx.compile_train_step(loss, lin, rlx.optim.SGD(0.1), spec, precision="fp16", growth_interval=bad)
    # A malformed device name is the device check's error, not a precision one.
    with pytest.raises(rlx.DeviceError, match=r"unknown device 'gpu'"):
        rlx.compile_train_step(loss, lin, rlx.optim.SGD(0.1), spec, device="gpu", precision="bf16")
    step = rlx.compile_train_step(loss, lin, rlx.optim.SGD(0.1), spec, precision="bf16")
    assert step.loss_scale == 1.0


# ---------------------------------------------------------------------------------------------
# The tiny GPT: bf16 loss curve within 2% of float32
# ---------------------------------------------------------------------------------------------
def gpt_curve(precision, steps):
    rlx.seed(11)
    model = rlx.models.GPT(vocab=48, dim=48, heads=4, layers=2, seq_len=24)
    spec = {"x": rlx.InputSpec((8, 24), "int32"), "y": rlx.InputSpec((8, 24), "int32")}
    step = rlx.compile_train_step(lambda m, x, y: m.loss(x, y), model, rlx.optim.AdamW(3e-3, weight_decay=0.01),
                                  spec, precision=precision)
    # A learnable stream: a fixed random walk over the vocabulary, windows at random offsets.
    rng = np.random.default_rng(12)
    stream = np.cumsum(rng.integers(1, 4, 4096)) % 48
    losses = []
    for _ in range(steps):
        at = rng.integers(0, len(stream) - 25, 8)
        w = np.stack([stream[a:a + 25] for a in at]).astype(np.int32)
        losses.append(step(x=w[:, :-1], y=w[:, 1:]))
    return np.array(losses)


def test_tiny_gpt_bf16_loss_curve_within_2_percent_of_float32():
    steps = 300
    f32, b16 = gpt_curve("fp32", steps), gpt_curve("bf16", steps)
    assert np.all(np.isfinite(b16))
    assert f32[-20:].mean() < 0.5 * f32[:5].mean()  # it learned
    # Windows of 10 steps, compared along the whole curve.
    w32, w16 = f32.reshape(-1, 10).mean(1), b16.reshape(-1, 10).mean(1)
    rel = np.abs(w16 - w32) / w32
    assert rel.max() < 0.02, rel
    assert not np.array_equal(f32, b16)


def test_mixed_precision_with_none_dimensions_and_clipping():
    # One executable per batch size, each autocast; the fp16 step's gradient norm (for clipping)
    # is the norm of the unscaled gradients.
    spec = {"x": rlx.InputSpec((None, 12)), "y": rlx.InputSpec((None,), "int32")}
    loss = lambda m, x, y: rlx.cross_entropy(m(x), y)  # noqa: E731
    rng = np.random.default_rng(9)
    steps = {p: rlx.compile_train_step(loss, mlp(), rlx.optim.SGD(0.0), spec, precision=p, clip_grad_norm=1e9)
             for p in ("fp32", "bf16", "fp16")}
    for n in (3, 10):
        x = rng.normal(size=(n, 12)).astype(np.float32)
        y = rng.integers(0, 5, n).astype(np.int32)
        losses = {p: s(x=x, y=y) for p, s in steps.items()}
        norms = {p: s.grad_norm for p, s in steps.items()}
        for p in ("bf16", "fp16"):
            assert abs(losses[p] - losses["fp32"]) < 2e-2 * abs(losses["fp32"])
            assert abs(norms[p] - norms["fp32"]) < 3e-2 * norms["fp32"], (p, n, norms)
    assert steps["fp16"].loss_scale == 65536.0 and steps["fp16"].skipped == 0
