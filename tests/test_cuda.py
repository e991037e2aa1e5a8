"""The CUDA backend against the CPU backend: forward results, gradients, training steps (every
optimizer, clipping, accumulation, skipped steps), the digits MLP and the tiny GPT, KV-cached
generation, prefetch, copies instead of views, and bad inputs. Skipped with the reason where
``"cuda"`` is not in ``rlx.devices()`` (no driver, no GPU or a library missing); the op tables of
``test_ops.py`` run on CUDA with ``RLX_TEST_DEVICE=cuda``."""

import numpy as np
import pytest

import rlx
from conftest import specs as _specs
from models import MLP, ce_loss

CUDA = "cuda" in rlx.devices()
needs_cuda = pytest.mark.skipif(not CUDA, reason="no usable CUDA device here (rlx.devices() has no 'cuda')")


def test_cuda_is_listed_only_where_usable_and_otherwise_a_device_error():
    devs = rlx.devices()
    if CUDA:
        assert "cuda:0" in devs
        return
    assert not any(d.startswith("cuda") for d in devs)
    for device in ["cuda", "cuda:0", "cuda:3"]:
        with pytest.raises(rlx.DeviceError, match="not available: .*(driver|GPU|NVRTC|cuBLAS)") as info:
            rlx.compile(lambda m, x: x * 2.0, rlx.nn.Module(), {"x": rlx.InputSpec((2,))}, device=device)
        assert "cpu" in str(info.value)  # the devices that are available


def test_malformed_cuda_names_are_device_errors():
    for device in ["cuda:", "cuda:x", "cuda:-1", "cuda: 0"]:
        with pytest.raises(rlx.DeviceError):
            rlx.compile(lambda m, x: x * 2.0, rlx.nn.Module(), {"x": rlx.InputSpec((2,))}, device=device)


def _pair(make):
    """The same model twice (same seed): one for cpu, one for cuda."""
    rlx.seed(0)
    a = make()
    rlx.seed(0)
    b = make()
    return a, b


def _data(n=64, d=32, c=10, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, d)).astype(np.float32), rng.integers(0, c, n).astype(np.int32)


@needs_cuda
@pytest.mark.parametrize("opt", ["sgd", "momentum", "nesterov", "adam", "adamw", "rmsprop", "adagrad",
                                 "adam-lt-epilogue", "adam-lt-0"])
def test_mlp_training_matches_cpu(opt, monkeypatch):
    """Every optimizer with the default cuBLASLt products (bias + ReLU epilogues, bias gradients
    in the weight-gradient products: RLX_CUDA_LT=all); Adam also with the other modes."""
    if "-lt-" in opt:
        opt, lt = opt.split("-lt-")
        monkeypatch.setenv("RLX_CUDA_LT", lt)
    make_opt = {
        "sgd": lambda: rlx.optim.SGD(lr=0.1),
        "momentum": lambda: rlx.optim.SGD(lr=0.05, momentum=0.9, weight_decay=1e-3),
        "nesterov": lambda: rlx.optim.SGD(lr=0.05, momentum=0.9, nesterov=True),
        "adam": lambda: rlx.optim.Adam(lr=1e-2, weight_decay=1e-3),
        "adamw": lambda: rlx.optim.AdamW(lr=1e-2),
        "rmsprop": lambda: rlx.optim.RMSprop(lr=1e-3, momentum=0.5),
        "adagrad": lambda: rlx.optim.Adagrad(lr=1e-2, lr_decay=0.01),
    }[opt]
    cpu_m, gpu_m = _pair(lambda: MLP(32, 64, 10))
    x, y = _data()
    specs = _specs({"x": x, "y": y})
    s_cpu = rlx.compile_train_step(ce_loss, cpu_m, make_opt(), specs, device="cpu")
    s_gpu = rlx.compile_train_step(ce_loss, gpu_m, make_opt(), specs, device="cuda")
    for i in range(5):
        xb, yb = _data(seed=i)
        l_cpu, l_gpu = s_cpu(x=xb, y=yb), s_gpu(x=xb, y=yb)
        np.testing.assert_allclose(l_gpu, l_cpu, rtol=1e-4, atol=1e-5, err_msg=f"loss at step {i}")
    for k, g in s_cpu.grads.items():
        np.testing.assert_allclose(s_gpu.grads[k], g, rtol=1e-3, atol=1e-5, err_msg=k)
    for k, p in cpu_m.parameters().items():
        np.testing.assert_allclose(gpu_m.parameters()[k].numpy(), p.numpy(), rtol=1e-3, atol=1e-5, err_msg=k)


@needs_cuda
@pytest.mark.parametrize("opt", ["momentum", "adamw"])
def test_tensors_larger_than_an_update_chunk_match_cpu(opt):
    # The optimizer updates every tensor in one launch, in chunks of 1024 elements for a model
    # this small: a 32x600 weight spans 19 chunks, the last one partial.
    make_opt = {
        "momentum": lambda: rlx.optim.SGD(lr=0.05, momentum=0.9),
        "adamw": lambda: rlx.optim.AdamW(lr=1e-2),
    }[opt]
    cpu_m, gpu_m = _pair(lambda: MLP(32, 600, 10))
    x, y = _data()
    specs = _specs({"x": x, "y": y})
    s_cpu = rlx.compile_train_step(ce_loss, cpu_m, make_opt(), specs, device="cpu")
    s_gpu = rlx.compile_train_step(ce_loss, gpu_m, make_opt(), specs, device="cuda")
    for i in range(3):
        xb, yb = _data(seed=i)
        np.testing.assert_allclose(s_gpu(x=xb, y=yb), s_cpu(x=xb, y=yb), rtol=1e-4, atol=1e-5)
    for k, p in cpu_m.parameters().items():
        np.testing.assert_allclose(gpu_m.parameters()[k].numpy(), p.numpy(), rtol=1e-3, atol=1e-5, err_msg=k)


class _Norms(rlx.nn.Module):
    """Two layer norms: one on a residual branch (its input gradient has the residual's added:
    `normalize_grad_add`), one alone (`normalize_grad`); random scales and shifts."""

    def __init__(self, d, out):
        rng = np.random.default_rng(1)
        self.inp, self.mix, self.head = rlx.nn.Linear(d, d), rlx.nn.Linear(d, d), rlx.nn.Linear(d, out)
        self.ln1, self.ln2 = rlx.nn.LayerNorm(d), rlx.nn.LayerNorm(d)
        for ln in (self.ln1, self.ln2):
            ln.weight = rlx.nn.Parameter((1 + 0.5 * rng.standard_normal(d)).astype(np.float32))
            ln.bias = rlx.nn.Parameter((0.1 * rng.standard_normal(d)).astype(np.float32))

    def __call__(self, x):
        h = self.inp(x)
        h = h + self.mix(self.ln1(h))
        return self.head(self.ln2(h))


@needs_cuda
@pytest.mark.parametrize("rows,width", [(5, 40), (1003, 200), (1024, 256), (4100, 768)])
def test_layer_norm_backward_matches_cpu(rows, width):
    """Up to 1024 rows a layer norm's backward is one launch on CUDA (the bias and weight
    gradients summed by the same kernel, 8 rows a block): one block, many with a short last
    one, the largest partial-sum area; widths not a multiple of 32. 4100 x 768 keeps the
    separate launches. Momentum SGD: Adam would turn rounding differences of near-zero
    gradients into steps of up to lr."""
    cpu_m, gpu_m = _pair(lambda: _Norms(width, 10))
    x, y = _data(n=rows, d=width)
    specs = _specs({"x": x, "y": y})
    s_cpu = rlx.compile_train_step(ce_loss, cpu_m, rlx.optim.SGD(lr=0.05, momentum=0.9), specs, device="cpu")
    s_gpu = rlx.compile_train_step(ce_loss, gpu_m, rlx.optim.SGD(lr=0.05, momentum=0.9), specs, device="cuda")
    for i in range(3):
        xb, yb = _data(n=rows, d=width, seed=i)
        np.testing.assert_allclose(s_gpu(x=xb, y=yb), s_cpu(x=xb, y=yb), rtol=1e-4, atol=1e-5, err_msg=f"step {i}")
    for k, g in s_cpu.grads.items():
        scale = np.abs(g).max()
        np.testing.assert_allclose(s_gpu.grads[k], g, rtol=1e-3, atol=1e-4 * scale, err_msg=k)
    for k, p in cpu_m.parameters().items():
        np.testing.assert_allclose(gpu_m.parameters()[k].numpy(), p.numpy(), rtol=1e-3, atol=1e-5, err_msg=k)


class _CNN(rlx.nn.Module):
    """Both conv2d lowerings: tap-major patches and per-image GEMMs on the 16x16 input (256
    positions), one tall GEMM over position-major patches on the pooled 8x8 one; batch norm,
    max and average pooling."""

    def __init__(self):
        self.conv1 = rlx.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = rlx.nn.BatchNorm2d(8)
        self.conv2 = rlx.nn.Conv2d(8, 12, 3, stride=2, padding=1)
        self.fc = rlx.nn.Linear(12 * 2 * 2, 10)

    def __call__(self, x):
        h = rlx.max_pool2d(rlx.relu(self.bn(self.conv1(x))), 2)
        h = rlx.avg_pool2d(rlx.relu(self.conv2(h)), 2)
        return self.fc(h.reshape(h.shape[0], -1))


@needs_cuda
def test_cnn_training_matches_cpu():
    cpu_m, gpu_m = _pair(_CNN)
    rng = np.random.default_rng(0)
    specs = {"x": rlx.InputSpec((16, 3, 16, 16)), "y": rlx.InputSpec((16,), "int32")}
    # SGD, not Adam: conv1's bias feeds a batch norm, so its gradient is rounding noise (~1e-9)
    # that Adam's normalisation would turn into full-size, device-dependent steps.
    s_cpu = rlx.compile_train_step(ce_loss, cpu_m, rlx.optim.SGD(lr=0.05, momentum=0.9), specs, device="cpu")
    s_gpu = rlx.compile_train_step(ce_loss, gpu_m, rlx.optim.SGD(lr=0.05, momentum=0.9), specs, device="cuda")
    for i in range(4):
        xb = rng.standard_normal((16, 3, 16, 16)).astype(np.float32)
        yb = rng.integers(0, 10, 16).astype(np.int32)
        np.testing.assert_allclose(s_gpu(x=xb, y=yb), s_cpu(x=xb, y=yb), rtol=1e-4, atol=1e-5, err_msg=f"step {i}")
    for k, g in s_cpu.grads.items():
        np.testing.assert_allclose(s_gpu.grads[k], g, rtol=1e-3, atol=1e-4, err_msg=k)
    for k, p in cpu_m.parameters().items():
        np.testing.assert_allclose(gpu_m.parameters()[k].numpy(), p.numpy(), rtol=1e-3, atol=1e-4, err_msg=k)


@needs_cuda
def test_clipping_accumulation_and_skipped_steps_match_cpu():
    cpu_m, gpu_m = _pair(lambda: MLP(32, 16, 10))
    x, y = _data()
    kw = dict(clip_grad_norm=0.5, accumulate=2, skip_nonfinite=True)
    s_cpu = rlx.compile_train_step(ce_loss, cpu_m, rlx.optim.Adam(lr=1e-2), _specs({"x": x, "y": y}), device="cpu", **kw)
    s_gpu = rlx.compile_train_step(ce_loss, gpu_m, rlx.optim.Adam(lr=1e-2), _specs({"x": x, "y": y}), device="cuda", **kw)
    for i in range(6):
        xb, yb = _data(seed=i)
        if i == 3:
            xb[0, 0] = np.nan
        l_cpu, l_gpu = s_cpu(x=xb, y=yb), s_gpu(x=xb, y=yb)
        if i != 3:
            np.testing.assert_allclose(l_gpu, l_cpu, rtol=1e-4, atol=1e-5)
        assert s_gpu.skipped == s_cpu.skipped
        if i != 3:
            np.testing.assert_allclose(s_gpu.grad_norm, s_cpu.grad_norm, rtol=1e-4, equal_nan=True)
    assert s_gpu.skipped == 1
    for k, p in cpu_m.parameters().items():
        np.testing.assert_allclose(gpu_m.parameters()[k].numpy(), p.numpy(), rtol=1e-3, atol=1e-5, err_msg=k)


@needs_cuda
def test_changing_the_learning_rate_between_steps_takes_effect():
    cpu_m, gpu_m = _pair(lambda: MLP(32, 16, 10))
    x, y = _data()
    o_cpu, o_gpu = rlx.optim.SGD(lr=0.1), rlx.optim.SGD(lr=0.1)
    s_cpu = rlx.compile_train_step(ce_loss, cpu_m, o_cpu, _specs({"x": x, "y": y}), device="cpu")
    s_gpu = rlx.compile_train_step(ce_loss, gpu_m, o_gpu, _specs({"x": x, "y": y}), device="cuda")
    for i, lr in enumerate([0.1, 0.0, 0.5]):
        o_cpu.lr = o_gpu.lr = lr
        np.testing.assert_allclose(s_gpu(x=x, y=y), s_cpu(x=x, y=y), rtol=1e-4, err_msg=f"step {i}")
    for k, p in cpu_m.parameters().items():
        np.testing.assert_allclose(gpu_m.parameters()[k].numpy(), p.numpy(), rtol=1e-3, atol=1e-5)


@needs_cuda
def test_parameters_and_grads_are_copies_not_views():
    rlx.seed(0)
    m = MLP(32, 16, 10)
    x, y = _data()
    opt = rlx.optim.SGD(lr=0.1, momentum=0.9)
    step = rlx.compile_train_step(ce_loss, m, opt, _specs({"x": x, "y": y}), device="cuda")
    step(x=x, y=y)
    w = m.fc1.weight.numpy()
    with pytest.raises(ValueError):
        w[...] = 0.0  # a read-only copy: writes could not reach the device
    g1 = step.grads["fc1.weight"].copy()
    step(x=x * 2.0, y=y)
    assert not np.array_equal(step.grads["fc1.weight"], g1), "grads are re-read after each step"
    state = opt.state("fc1.weight")
    assert np.abs(state["momentum_buffer"]).sum() > 0
    assert not any(v.flags.writeable for v in state.values())
    fn = rlx.compile(lambda m, x: m(x), m, _specs({"x": x}), device="cuda")
    fn.bind("x", x)
    v = fn.view("x")
    np.testing.assert_array_equal(v, x)
    assert not v.flags.writeable
    fn.write_rows("x", 0, np.zeros((2, 32), np.float32))
    np.testing.assert_array_equal(fn.view("x")[:2], 0.0)
    np.testing.assert_array_equal(v[:2], x[:2])  # the earlier copy is a snapshot


@needs_cuda
@pytest.mark.parametrize("lt", [None, "0", "epilogue", "all"])
def test_gpt_training_and_cached_generation_match_cpu(lt, monkeypatch):
    """Under every RLX_CUDA_LT mode (fused cuBLASLt epilogues and bias gradients included)."""
    if lt is not None:
        monkeypatch.setenv("RLX_CUDA_LT", lt)
    V, D, H, L, T, B = 32, 32, 2, 2, 16, 4
    cpu_m, gpu_m = _pair(lambda: rlx.models.GPT(vocab=V, dim=D, heads=H, layers=L, seq_len=T))
    rng = np.random.default_rng(0)
    idx = rng.integers(0, V, (B, T)).astype(np.int32)
    tgt = np.roll(idx, -1, axis=1)

    def loss(m, idx, tgt):
        logits = m(idx)
        return rlx.cross_entropy(logits.reshape(B * T, V), tgt.reshape(B * T))

    specs = _specs({"idx": idx, "tgt": tgt})
    s_cpu = rlx.compile_train_step(loss, cpu_m, rlx.optim.AdamW(lr=3e-3), specs, device="cpu")
    s_gpu = rlx.compile_train_step(loss, gpu_m, rlx.optim.AdamW(lr=3e-3), specs, device="cuda")
    for i in range(5):
        np.testing.assert_allclose(s_gpu(idx=idx, tgt=tgt), s_cpu(idx=idx, tgt=tgt), rtol=2e-4, atol=1e-5,
                                   err_msg=f"step {i}")
    for k, p in cpu_m.parameters().items():
        got, want = gpu_m.parameters()[k].numpy(), p.numpy()
        if k.endswith("attn.qkv.bias"):
            # The key bias shifts every score of a row alike, which softmax ignores: its gradient
            # is zero up to rounding, and AdamW turns that rounding into steps of up to lr each,
            # whose signs differ between backends. Those five steps are all they must agree to.
            np.testing.assert_allclose(got[D : 2 * D], want[D : 2 * D], rtol=0, atol=5 * 3e-3, err_msg=k)
            got, want = np.delete(got, np.s_[D : 2 * D]), np.delete(want, np.s_[D : 2 * D])
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=2e-5, err_msg=k)
    # KV-cached decoding on cuda matches the full-prefix logits on cuda and on cpu.
    full = rlx.compile(lambda m, idx: m(idx), gpu_m, {"idx": rlx.InputSpec((1, T), "int32")}, device="cuda")
    ref = full(idx=idx[:1])
    gen = rlx.models.Generator(gpu_m, device="cuda")
    for t in range(T):
        np.testing.assert_allclose(gen.step(idx[0, t]), ref[:, t], atol=1e-4, err_msg=f"position {t}")
    cpu_full = rlx.compile(lambda m, idx: m(idx), cpu_m, {"idx": rlx.InputSpec((1, T), "int32")})
    np.testing.assert_allclose(ref, cpu_full(idx=idx[:1]), atol=1e-4)


@needs_cuda
def test_prefetch_matches_direct_calls():
    cpu_m, gpu_m = _pair(lambda: MLP(32, 16, 10))
    x, y = _data()
    s_cpu = rlx.compile_train_step(ce_loss, cpu_m, rlx.optim.SGD(lr=0.1), _specs({"x": x, "y": y}), device="cpu")
    s_gpu = rlx.compile_train_step(ce_loss, gpu_m, rlx.optim.SGD(lr=0.1), _specs({"x": x, "y": y}), device="cuda")
    batches = [_data(seed=i) for i in range(5)]
    s_gpu.prefetch(x=batches[0][0], y=batches[0][1])
    for i, (xb, yb) in enumerate(batches):
        if i + 1 < len(batches):
            s_gpu.prefetch(x=batches[i + 1][0], y=batches[i + 1][1])
        np.testing.assert_allclose(s_gpu(), s_cpu(x=xb, y=yb), rtol=1e-4, err_msg=f"batch {i}")


@needs_cuda
@pytest.mark.parametrize("rows", [3, 1000])
def test_cross_entropy_and_its_gradient_match_cpu_with_ignored_rows(rows):
    """The loss and its gradient are one launch on CUDA up to 1024 rows (every block counts the
    labelled rows, the last one averages the rows' losses): one block or 125, a tenth of the
    rows ignored; every row ignored gives NaN on both; the block count resets, so a second call
    gives the same result."""
    from conftest import make_module

    rng = np.random.default_rng(3)
    z = (3 * rng.standard_normal((rows, 37))).astype(np.float32)
    y = rng.integers(0, 37, rows).astype(np.int32)
    y[rng.random(rows) < 0.1] = -100
    y[0] = 5

    def loss(m, y):
        return rlx.cross_entropy(m.z, y)

    results = {}
    for device in ["cpu", "cuda"]:
        step = rlx.compile_train_step(loss, make_module(z=z), rlx.optim.SGD(lr=0.0), _specs({"y": y}), device=device)
        first = step(y=y)
        grad = np.array(step.grads["z"], copy=True)
        assert step(y=y) == first
        results[device] = (first, grad, step(y=np.full_like(y, -100)))
    (l_cpu, g_cpu, none_cpu), (l_gpu, g_gpu, none_gpu) = results["cpu"], results["cuda"]
    np.testing.assert_allclose(l_gpu, l_cpu, rtol=1e-5)
    np.testing.assert_allclose(g_gpu, g_cpu, rtol=1e-4, atol=1e-9)
    assert np.isnan(none_cpu) and np.isnan(none_gpu)


def _launched(monkeypatch, capfd, run):
    """What `run()` launched on CUDA: with RLX_PROFILE=1 an executable prints its kernels by
    name when it is dropped (its steps then run launch by launch, not replayed as a graph)."""
    import gc

    capfd.readouterr()
    monkeypatch.setenv("RLX_PROFILE", "1")
    try:
        run()
        gc.collect()
    finally:
        monkeypatch.delenv("RLX_PROFILE")
    return capfd.readouterr().err


@needs_cuda
@pytest.mark.parametrize("rows,width,backward", [(1003, 200, True), (4100, 768, False)])
def test_layer_norms_and_the_loss_are_one_launch_each_where_planned(monkeypatch, capfd, rows, width, backward):
    """The groups form on a real model: a layer norm's forward always, its backward up to 1024
    rows (not at 4100 x 768), the loss with its gradient up to 1024 rows."""
    x, y = _data(n=rows, d=width)

    def run():
        rlx.seed(0)
        step = rlx.compile_train_step(ce_loss, _Norms(width, 10), rlx.optim.SGD(lr=0.1), _specs({"x": x, "y": y}),
                                      device="cuda")
        step(x=x, y=y)

    err = _launched(monkeypatch, capfd, run)
    assert "rlx cuda profile" in err, err
    assert "rlx_normalize_affine" in err and "rlx_normalize " not in err, err
    assert ("rlx_layer_norm_grad" in err) == backward, err
    assert ("rlx_ce_loss_grad" in err) == backward, err


@needs_cuda
def test_bad_labels_and_ids_raise_input_errors():
    rlx.seed(0)
    m = MLP(32, 16, 10)
    x, y = _data()
    step = rlx.compile_train_step(ce_loss, m, rlx.optim.SGD(lr=0.1), _specs({"x": x, "y": y}), device="cuda")
    bad = y.copy()
    bad[3] = 10
    before = m.fc1.weight.numpy()
    with pytest.raises(rlx.InputError, match="out of range"):
        step(x=x, y=bad)
    np.testing.assert_array_equal(m.fc1.weight.numpy(), before)
    assert np.isfinite(step(x=x, y=y))


@needs_cuda
def test_int_ops_and_layout_ops_match_cpu():
    a = np.array([7, -7, 7, -7, 0, 5, -(2**31), 2**31 - 1, -1, 3], dtype=np.int32)
    b = np.array([2, 2, -2, -2, 3, 7, -1, -1, 5, -(2**31)], dtype=np.int32)
    xs = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)

    def f(a, b, x):
        return (a // b, a % b, a / b, (a < b), rlx.where(a > b, a, b), x.transpose(2, 0, 1) * 1.0,
                x.sum(axis=(0, 2)), x.max(axis=1), x.mean(), rlx.softmax(x, axis=1))

    arrays = {"a": a, "b": b, "x": xs}
    specs = _specs(arrays)
    out_cpu = rlx.compile(lambda m, **t: f(**t), rlx.nn.Module(), specs, device="cpu")(**arrays)
    out_gpu = rlx.compile(lambda m, **t: f(**t), rlx.nn.Module(), specs, device="cuda")(**arrays)
    for i, (c, g) in enumerate(zip(out_cpu, out_gpu)):
        np.testing.assert_allclose(g, c, rtol=1e-5, atol=1e-6, err_msg=f"output {i}")
    with pytest.raises(rlx.RlxError, match="division by zero"):
        rlx.compile(lambda m, a, b: a // b, rlx.nn.Module(), {"a": specs["a"], "b": specs["b"]},
                    device="cuda")(a=a, b=np.zeros_like(b))


@needs_cuda
def test_attention_log1p_ignored_labels_and_dropout_match_cpu():
    from conftest import run_grads

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 3, 8, 16)).astype(np.float32) for _ in range(3))
    z = rng.standard_normal((6, 5)).astype(np.float32)
    y = rng.integers(0, 5, 6).astype(np.int32)
    y[1] = -100  # ignored row

    def loss(m, y):
        a = rlx.scaled_dot_product_attention(m.q, m.k, m.v, causal=True)
        return (a * a).mean() + rlx.cross_entropy(m.z, y) + rlx.log1p(rlx.relu(m.z)).sum() * 0.1

    params = {"q": q, "k": k, "v": v, "z": z}
    l_cpu, g_cpu = run_grads(loss, params, {"y": y}, device="cpu")
    l_gpu, g_gpu = run_grads(loss, params, {"y": y}, device="cuda")
    np.testing.assert_allclose(l_gpu, l_cpu, rtol=1e-5, atol=1e-6)
    for name, g in g_cpu.items():
        np.testing.assert_allclose(g_gpu[name], g, rtol=1e-4, atol=1e-6, err_msg=name)

    def drop(m, x):
        return rlx.dropout(x, 0.3)

    outs = []
    for device in ["cpu", "cuda"]:
        rlx.seed(0)
        fn = rlx.compile(drop, rlx.nn.Module(), _specs({"x": z}), device=device)
        outs.append(fn(x=z))
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-6)  # the same mask on both devices
    assert 0 < np.count_nonzero(outs[0] == 0) < z.size


@needs_cuda
def test_parameters_export_dlpack_on_the_gpu_without_a_copy():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("this PyTorch has no CUDA")
    m = MLP(32, 16, 10)
    x, y = _data()
    step = rlx.compile_train_step(ce_loss, m, rlx.optim.SGD(lr=0.1), _specs({"x": x, "y": y}), device="cuda")
    step(x=x, y=y)
    w = m.fc1.weight
    assert w.__dlpack_device__() == (2, 0)
    t = torch.from_dlpack(w)
    assert t.device.type == "cuda" and tuple(t.shape) == tuple(w.shape)
    np.testing.assert_array_equal(t.cpu().numpy(), w.numpy())
    t.mul_(0.5)  # writes the weight store itself
    torch.cuda.synchronize()
    np.testing.assert_array_equal(w.numpy(), t.cpu().numpy())
    with pytest.raises(BufferError, match="without copying"):
        w.__dlpack__(copy=True)


def _torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("this PyTorch has no CUDA")
    return torch


@needs_cuda
def test_grads_and_optimizer_state_export_dlpack_on_the_gpu_without_a_copy():
    """step.grad_tensor / optimizer.state_tensors are the arena's and the state store's own GPU
    memory: the same device pointer on every export, values equal to the copies grads / state
    return, updated in place by the next step, and writes through PyTorch reach the next step."""
    torch = _torch_cuda()
    m = MLP(32, 16, 10)
    x, y = _data()
    opt = rlx.optim.Adam(lr=1e-2)
    step = rlx.compile_train_step(ce_loss, m, opt, _specs({"x": x, "y": y}), device="cuda")
    step(x=x, y=y)
    g = step.grad_tensor("fc1.weight")
    assert g.__dlpack_device__() == (2, 0) and g.shape == (16, 32)
    t = torch.from_dlpack(g)
    assert t.device.type == "cuda" and t.dtype == torch.float32 and t.stride() == (32, 1)
    assert torch.from_dlpack(step.grad_tensor("fc1.weight")).data_ptr() == t.data_ptr()  # a fixed slot
    np.testing.assert_array_equal(t.cpu().numpy(), step.grads["fc1.weight"])
    np.testing.assert_array_equal(g.numpy(), step.grads["fc1.weight"])  # numpy(): a read-only copy on CUDA
    assert not g.numpy().flags.writeable
    np.testing.assert_array_equal(torch.from_dlpack(step.grad_tensor("fc2.bias")).cpu().numpy(), step.grads["fc2.bias"])
    step(x=x * 2.0, y=y)
    np.testing.assert_array_equal(t.cpu().numpy(), step.grads["fc1.weight"])  # the next step's, in place
    st = opt.state_tensors("fc1.weight")
    mom = torch.from_dlpack(st["exp_avg"])
    count = torch.from_dlpack(st["step"])
    assert mom.device.type == "cuda" and count.dtype == torch.int32 and int(count.cpu()) == 2
    np.testing.assert_array_equal(mom.cpu().numpy(), opt.state("fc1.weight")["exp_avg"])
    mom.zero_()  # writes the state store itself
    torch.cuda.synchronize()
    step(x=x, y=y)
    np.testing.assert_allclose(opt.state("fc1.weight")["exp_avg"], 0.1 * step.grads["fc1.weight"], rtol=1e-5, atol=1e-8)
    np.testing.assert_array_equal(mom.cpu().numpy(), opt.state("fc1.weight")["exp_avg"])
    # The copies stay copies (the documented contract of grads / state on CUDA).
    assert not step.grads["fc1.weight"].flags.writeable


@needs_cuda
def test_resident_inputs_export_dlpack_on_the_gpu_and_writes_reach_the_next_call():
    torch = _torch_cuda()
    fn = rlx.compile(lambda m, x, c: x + c * 2.0, rlx.nn.Module(), {"x": rlx.InputSpec((2, 3)), "c": rlx.InputSpec((2, 3))},
                     device="cuda")
    fn.bind("c", np.ones((2, 3), np.float32))
    t = torch.from_dlpack(fn.view_tensor("c"))
    assert t.device.type == "cuda"
    np.testing.assert_array_equal(t.cpu().numpy(), np.ones((2, 3), np.float32))
    t[1] = 5.0
    torch.cuda.synchronize()
    np.testing.assert_array_equal(fn(x=np.zeros((2, 3), np.float32)), [[2.0] * 3, [10.0] * 3])
    np.testing.assert_array_equal(fn.view("c"), t.cpu().numpy())
    fn.write_rows("c", 0, np.full((1, 3), -1.0, np.float32))
    np.testing.assert_array_equal(t.cpu().numpy()[0], [-1.0] * 3)


@needs_cuda
def test_gpu_dlpack_exports_outlive_the_step_and_refuse_bad_requests_by_name():
    torch = _torch_cuda()
    import gc

    m = MLP(32, 16, 10)
    x, y = _data()
    opt = rlx.optim.SGD(lr=0.1, momentum=0.9)
    step = rlx.compile_train_step(ce_loss, m, opt, _specs({"x": x, "y": y}), device="cuda")
    step(x=x, y=y)
    # A consumer on a non-default stream: rlx's calls have finished their GPU work on return.
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        g = torch.from_dlpack(step.grad_tensor("fc1.weight"))
        buf = torch.from_dlpack(opt.state_tensors("fc1.weight")["momentum_buffer"])
        w = torch.from_dlpack(m.fc1.weight)
    want = [step.grads["fc1.weight"].copy(), opt.state("fc1.weight")["momentum_buffer"].copy(), m.fc1.weight.numpy().copy()]
    d = step.grad_tensor("fc2.weight")
    with pytest.raises(BufferError, match=r"\[fc2.weight \(gradient\)\] rlx exports GPU memory without copying"):
        d.__dlpack__(copy=True)
    with pytest.raises(BufferError, match=r"\[fc2.weight \(gradient\)\] stream must be .*got 0"):
        d.__dlpack__(stream=0)
    with pytest.raises(BufferError, match=r"\[fc2.weight \(gradient\)\] the tensor is on \(2, 0\), not \(1, 0\)"):
        d.__dlpack__(dl_device=(1, 0))
    del step, m, opt, d
    gc.collect()
    junk = torch.full((1 << 24,), 7.0, device="cuda")  # would land in freed memory
    torch.cuda.synchronize()
    for t, v in zip([g, buf, w], want):
        np.testing.assert_array_equal(t.cpu().numpy(), v)
    del junk


@needs_cuda
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_training_matches_cpu(precision):
    """precision="bf16"/"fp16" on CUDA (tensor-core products of low-precision casts, float32
    sums and masters) follows the CPU's mixed-precision steps, fp16's loss scale included, and
    really computes in low precision (its first loss is not float32's)."""
    V, D, H, L, T, B = 32, 32, 2, 2, 16, 4
    cpu_m, gpu_m = _pair(lambda: rlx.models.GPT(vocab=V, dim=D, heads=H, layers=L, seq_len=T))
    rlx.seed(0)
    f32_m = rlx.models.GPT(vocab=V, dim=D, heads=H, layers=L, seq_len=T)
    rng = np.random.default_rng(1)
    idx = rng.integers(0, V, (B, T)).astype(np.int32)
    tgt = np.roll(idx, -1, axis=1)

    def loss(m, idx, tgt):
        return rlx.cross_entropy(m(idx).reshape(B * T, V), tgt.reshape(B * T))

    specs = _specs({"idx": idx, "tgt": tgt})
    kw = dict(precision=precision)
    if precision == "fp16":
        kw.update(loss_scale=1024.0, growth_interval=2)
    s_cpu = rlx.compile_train_step(loss, cpu_m, rlx.optim.AdamW(lr=3e-3), specs, device="cpu", **kw)
    s_gpu = rlx.compile_train_step(loss, gpu_m, rlx.optim.AdamW(lr=3e-3), specs, device="cuda", **kw)
    s_f32 = rlx.compile_train_step(loss, f32_m, rlx.optim.AdamW(lr=3e-3), specs, device="cuda")
    assert s_gpu.precision == precision
    assert s_gpu.memory()["workspace_bytes"] > 0  # the GPU program's scratch memory is counted
    first = s_f32(idx=idx, tgt=tgt)
    for i in range(5):
        l_gpu, l_cpu = s_gpu(idx=idx, tgt=tgt), s_cpu(idx=idx, tgt=tgt)
        np.testing.assert_allclose(l_gpu, l_cpu, rtol=2e-3, err_msg=f"step {i}")
        if i == 0:
            assert l_gpu != first, "the low-precision step computed in float32"
        assert s_gpu.loss_scale == s_cpu.loss_scale and s_gpu.skipped == s_cpu.skipped == 0
    if precision == "fp16":
        assert s_gpu.loss_scale == 4096.0  # doubled after every 2 good steps
    for k, p in cpu_m.parameters().items():
        got, want = gpu_m.parameters()[k].numpy(), p.numpy()
        # A low-precision rounding that lands the other way flips the sign of a near-zero
        # gradient, which AdamW turns into a step of up to lr: every element agrees within the
        # five steps, nearly all within 2 %.
        np.testing.assert_allclose(got, want, rtol=0, atol=5 * 3e-3, err_msg=k)
        near = np.isclose(got, want, rtol=2e-2, atol=2e-4)
        assert near.mean() > 0.99, (k, near.mean())


@needs_cuda
def test_low_precision_outside_products_is_a_clear_error_on_cuda():
    f = lambda m, x: x.astype("bfloat16").reshape(3, 4).T.astype("float32")  # noqa: E731
    with pytest.raises(rlx.UnsupportedError, match=r"\[transpose\] the cuda backend runs bfloat16/float16 only in casts "
                                                   r"from and to float32 and in matrix products \(mixed precision\), "
                                                   r"not transpose on \[bfloat16 \(3, 4\)\]"):
        rlx.compile(f, rlx.nn.Module(), {"x": rlx.InputSpec((4, 3))}, device="cuda")


_NCCL_RANK = """
import json, numpy as np, rlx, rlx.distributed as dist
from models import MLP, ce_loss
comm = dist.init("nccl")
assert isinstance(comm, dist.NCCLCommunicator) and (comm.rank, comm.size, comm.device) == (0, 1, "cuda:0")
rng = np.random.default_rng(0)
x, y = rng.standard_normal((64, 32)).astype(np.float32), rng.integers(0, 10, 64).astype(np.int32)
spec = {"x": rlx.InputSpec(x.shape), "y": rlx.InputSpec(y.shape, "int32")}
out = {}
for dp in (False, True):
    rlx.seed(0)
    m = MLP(32, 16, 10)
    s = rlx.compile_train_step(ce_loss, m, rlx.optim.Adam(lr=1e-2), spec, device="cuda", distributed=dp)
    out[str(dp)] = [[s(x=x, y=y) for _ in range(4)], {k: p.numpy().tolist() for k, p in m.parameters().items()}]
try:
    rlx.compile_train_step(ce_loss, MLP(32, 16, 10), rlx.optim.SGD(lr=0.1), spec, device="cpu", distributed=True)
except rlx.InputError as e:
    out["error"] = str(e)
print(json.dumps(out))
"""


@needs_cuda
def test_nccl_data_parallel_on_one_rank_matches_a_plain_step():
    """init(backend="nccl") in a fresh process without a launcher: a group of one whose
    gradients are averaged by NCCL on the GPU and whose weights are broadcast over the store;
    with one rank both are identities, so the step equals a plain CUDA step. (Two ranks need two
    GPUs.)"""
    import json
    import os
    import subprocess
    import sys

    tests = os.path.dirname(os.path.abspath(__file__))
    run = subprocess.run([sys.executable, "-c", _NCCL_RANK], cwd=tests, capture_output=True, text=True, timeout=240)
    if "NCCL backend is not available" in run.stderr:
        pytest.skip(run.stderr.strip().splitlines()[-1])
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    (plain_losses, plain), (dp_losses, dp) = out["False"], out["True"]
    np.testing.assert_allclose(dp_losses, plain_losses, rtol=1e-6)
    for k in plain:
        np.testing.assert_allclose(dp[k], plain[k], rtol=1e-6, atol=1e-7, err_msg=k)
    assert "computes on this rank's GPU 'cuda:0'" in out["error"]


@needs_cuda
def test_int64_labels_train_on_the_gpu_as_int32_and_values_beyond_int32_are_input_errors():
    """The GPU backends compute ids and labels in int32: an int64 input has an int32 slot there,
    int64 labels that fit train exactly as the CPU's int64 step, and a label beyond int32 is
    refused by name before anything runs (never wrapped into a valid one)."""
    x, y = _data()
    spec = {"x": rlx.InputSpec(x.shape), "y": rlx.InputSpec(y.shape, "int64")}
    losses = {}
    for device in ("cpu", "cuda"):
        rlx.seed(0)
        m = MLP(32, 16, 10)
        step = rlx.compile_train_step(ce_loss, m, rlx.optim.SGD(lr=0.1), spec, device=device)
        losses[device] = [step(x=x, y=y.astype(np.int64)) for _ in range(3)]
    np.testing.assert_allclose(losses["cuda"], losses["cpu"], rtol=1e-5)
    bad = y.astype(np.int64)
    bad[0] = 2**32 + 1  # would wrap to label 1 in int32
    with pytest.raises(rlx.InputError, match=r"^\[y\] values .* do not fit in int32"):
        step(x=x, y=bad)


def _masks_and_ids(m, x, ids, keep):
    """bool and int64 tensors inside a program and at its edges (inputs and outputs)."""
    valid = (x > 0) & keep  # bool
    big = ids * 3 - 2  # int64
    sel = rlx.where(valid, big, ids)
    return (sel, valid, x * valid, ~valid, rlx.logical_xor(valid, keep), big // 4, rlx.maximum(big, ids),
            sel.astype("float32") / 2, sel.T, valid.astype("int32"), valid.sum(), sel.max(axis=0), big.sum(axis=1))


@needs_cuda
def test_bool_and_int64_tensors_compute_on_the_gpu_as_on_the_cpu():
    """The GPU computes int64 and bool in int32 (0/1 for bools) between the program's edges and
    casts back at the outputs: results and dtypes equal the CPU's int64 and bool kernels for
    values within int32; an int64 feed beyond int32 is an InputError, never a wrap; a raw
    rlx.Graph with an int64 input takes int64 arrays the same way."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 6)).astype(np.float32)
    x[0, :3] = [np.nan, 0.0, -0.0]
    ids = rng.integers(-50, 50, (4, 6)).astype(np.int64)
    keep = rng.random((4, 6)) > 0.4
    specs = {"x": rlx.InputSpec(x.shape), "ids": rlx.InputSpec(ids.shape, "int64"),
             "keep": rlx.InputSpec(keep.shape, "bool")}
    outs = {d: rlx.compile(_masks_and_ids, rlx.nn.Module(), specs, device=d)(x=x, ids=ids, keep=keep)
            for d in ("cpu", "cuda")}
    for i, (c, g) in enumerate(zip(outs["cpu"], outs["cuda"])):
        assert g.dtype == c.dtype and g.shape == c.shape, (i, g.dtype, c.dtype)
        np.testing.assert_array_equal(g, c, err_msg=f"output {i}")
    fn = rlx.compile(_masks_and_ids, rlx.nn.Module(), specs, device="cuda")
    bad = ids.copy()
    bad[1, 1] = 2**31
    with pytest.raises(rlx.InputError, match=r"^\[ids\] values .* do not fit in int32"):
        fn(x=x, ids=bad, keep=keep)
    g = rlx.Graph()
    i, k = g.input("i", (5,), "int64"), g.input("k", (5,), "bool")
    g.output(rlx.where(k, i * 2, i), k | (i > 0))
    exe = g.compile("cuda")
    got = exe.run(i=np.arange(-2, 3, dtype=np.int64), k=np.array([1, 0, 1, 0, 1], bool))
    np.testing.assert_array_equal(got[0], np.array([-4, -1, 0, 1, 4], np.int64))
    assert got[0].dtype == np.int64 and got[1].dtype == np.bool_
    np.testing.assert_array_equal(got[1], [True, False, True, True, True])


@needs_cuda
def test_a_bool_mask_in_the_loss_trains_on_the_gpu_as_on_the_cpu():
    """A masked mean over a bool mask fed each step: losses and weights as on the CPU."""
    x, y = _data()
    valid = np.arange(len(y)) % 4 != 0

    onehot = np.eye(10, dtype=np.float32)[y]

    def masked_ce(m, x, t, valid):
        per = -(rlx.log_softmax(m(x), axis=-1) * t).sum(axis=1)
        return rlx.where(valid, per, 0.0).sum() / valid.astype("float32").sum()

    spec = {"x": rlx.InputSpec(x.shape), "t": rlx.InputSpec(onehot.shape), "valid": rlx.InputSpec(valid.shape, "bool")}
    losses, weights = {}, {}
    for device in ("cpu", "cuda"):
        rlx.seed(0)
        m = MLP(32, 16, 10)
        step = rlx.compile_train_step(masked_ce, m, rlx.optim.Adam(lr=1e-2), spec, device=device)
        losses[device] = [step(x=x, t=onehot, valid=valid) for _ in range(4)]
        weights[device] = {k: p.numpy().copy() for k, p in m.parameters().items()}
    np.testing.assert_allclose(losses["cuda"], losses["cpu"], rtol=1e-4)
    for k in weights["cpu"]:
        np.testing.assert_allclose(weights["cuda"][k], weights["cpu"][k], rtol=1e-3, atol=1e-5, err_msg=k)
