"""Vision and regularisation: conv2d, pooling, batch norm and dropout (ops and layers) against
numpy references, finite differences and PyTorch (train and eval mode; skipped without torch),
plus their bad-input errors."""

import numpy as np
import pytest

import rlx
from conftest import Empty, assert_close, check_op_grads, run_forward, specs

try:
    import torch
except ImportError:  # pragma: no cover - torch is optional
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="PyTorch is not installed")


def np_conv2d(x, w, b=None, stride=1, padding=0):
    """Direct cross-correlation in float64."""
    s, p = (stride, stride) if np.isscalar(stride) else stride, (padding, padding) if np.isscalar(padding) else padding
    x = np.pad(np.asarray(x, np.float64), ((0, 0), (0, 0), (p[0], p[0]), (p[1], p[1])))
    n, c, h, wd = x.shape
    o, _, kh, kw = w.shape
    ho, wo = (h - kh) // s[0] + 1, (wd - kw) // s[1] + 1
    out = np.zeros((n, o, ho, wo))
    for i in range(kh):
        for j in range(kw):
            patch = x[:, :, i : i + s[0] * (ho - 1) + 1 : s[0], j : j + s[1] * (wo - 1) + 1 : s[1]]
            out += np.einsum("nchw,oc->nohw", patch, w[:, :, i, j])
    if b is not None:
        out += np.asarray(b).reshape(1, -1, 1, 1)
    return out


def np_pool(x, k, s, p, kind):
    x = np.asarray(x, np.float64)
    fill = -np.inf if kind == "max" else 0.0
    xp = np.pad(x, ((0, 0), (0, 0), (p, p), (p, p)), constant_values=fill)
    n, c, h, w = xp.shape
    ho, wo = (h - k) // s + 1, (w - k) // s + 1
    out = np.zeros((n, c, ho, wo))
    for y in range(ho):
        for xo in range(wo):
            win = xp[:, :, y * s : y * s + k, xo * s : xo * s + k]
            out[:, :, y, xo] = win.max(axis=(2, 3)) if kind == "max" else win.mean(axis=(2, 3))
    return out


# (N, C, H, W), (O, kh, kw), stride, padding: stride 2, padding, 1x1, 5x5, odd channel counts, batch 1.
CONV_CASES = [
    ((2, 3, 6, 5), (5, 3, 3), 1, 1),
    ((1, 3, 7, 7), (4, 3, 3), 2, 1),
    ((2, 5, 4, 4), (3, 1, 1), 1, 0),
    ((1, 2, 6, 6), (3, 5, 5), 1, 2),
    ((2, 3, 5, 6), (2, 2, 3), (2, 1), (0, 1)),
    ((1, 4, 5, 5), (6, 1, 1), 2, 0),
    ((2, 2, 17, 16), (3, 3, 3), 1, 1),  # >= 256 output positions: one GEMM per image
]


# Large images one pixel wide: most kernel taps miss every column.
NARROW_CASES = [((1, 2, 256, 1), (2, 5, 5), 1, 2), ((1, 1, 512, 1), (2, 5, 5), 2, 2)]


@pytest.mark.parametrize("xs,ws,stride,padding", CONV_CASES + NARROW_CASES, ids=str)
def test_conv2d_forward_and_gradients(xs, ws, stride, padding):
    rng = np.random.default_rng(sum(xs) + sum(ws))
    x = rng.standard_normal(xs).astype(np.float32)
    w = (rng.standard_normal((ws[0], xs[1], ws[1], ws[2])) * 0.5).astype(np.float32)
    b = rng.standard_normal(ws[0]).astype(np.float32)
    out = run_forward(lambda x, w, b: rlx.conv2d(x, w, b, stride, padding), {"x": x, "w": w, "b": b})
    assert_close(out, np_conv2d(x, w, b, stride, padding), rtol=1e-4, atol=1e-5)
    check_op_grads(lambda x, w, b: rlx.conv2d(x, w, b, stride=stride, padding=padding),
                   lambda x, w, b: np_conv2d(x, w, b, stride, padding), {"x": x, "w": w, "b": b})


@pytest.mark.parametrize("kind", ["max", "avg"])
@pytest.mark.parametrize("k,s,p,shape", [(2, 2, 0, (2, 3, 6, 6)), (3, 2, 1, (1, 5, 7, 6)), (3, 1, 1, (1, 2, 4, 5)),
                                         (2, 1, 0, (1, 1, 3, 3))], ids=str)
def test_pool2d_forward_and_gradients(kind, k, s, p, shape):
    rng = np.random.default_rng(k * 10 + s)
    x = rng.permutation(np.prod(shape)).reshape(shape).astype(np.float32) * 0.1  # no ties
    op = rlx.max_pool2d if kind == "max" else rlx.avg_pool2d
    out = run_forward(lambda x: op(x, k, s, p), {"x": x})
    assert_close(out, np_pool(x, k, s, p, kind), rtol=1e-6, atol=1e-6)
    check_op_grads(lambda x: op(x, k, s, p), lambda x: np_pool(x, k, s, p, kind), {"x": x})


def test_max_pool_ties_send_the_gradient_to_the_first_maximum():
    x = np.zeros((1, 1, 2, 2), np.float32)
    model = rlx.nn.Module()
    model.x = rlx.nn.Parameter(x)
    step = rlx.compile_train_step(lambda m: rlx.max_pool2d(m.x * 1.0, 2).sum(), model, rlx.optim.SGD(lr=0.0), {})
    step()
    np.testing.assert_array_equal(step.grads["x"], [[[[1.0, 0.0], [0.0, 0.0]]]])


def _torch_copy(rlx_model, torch_model):
    torch_model.load_state_dict({k: torch.tensor(np.array(v)) for k, v in rlx_model.state_dict().items()})


class _CNN(rlx.nn.Module):
    """Conv-BN-ReLU-Pool, Dropout, Linear over 8x8 images (the digits example's shape, smaller)."""

    def __init__(self, p=0.0):
        self.conv = rlx.nn.Conv2d(1, 6, 3, padding=1)
        self.bn = rlx.nn.BatchNorm2d(6)
        self.pool = rlx.nn.MaxPool2d(2)
        self.drop = rlx.nn.Dropout(p)
        self.fc = rlx.nn.Linear(6 * 4 * 4, 10)

    def __call__(self, x):
        h = self.pool(rlx.relu(self.bn(self.conv(x))))
        return self.fc(self.drop(rlx.nn.Flatten()(h)))


@needs_torch
def test_cnn_train_steps_and_eval_match_torch():
    rlx.seed(3)
    model = _CNN()
    tm = torch.nn.ModuleDict({
        "conv": torch.nn.Conv2d(1, 6, 3, padding=1), "bn": torch.nn.BatchNorm2d(6), "fc": torch.nn.Linear(96, 10)})
    _torch_copy(model, tm)

    def tforward(x):
        h = torch.nn.functional.max_pool2d(torch.relu(tm["bn"](tm["conv"](x))), 2)
        return tm["fc"](h.flatten(1))

    rng = np.random.default_rng(0)
    xs = rng.standard_normal((3, 5, 1, 8, 8)).astype(np.float32)
    ys = rng.integers(0, 10, (3, 5)).astype(np.int32)
    step = rlx.compile_train_step(lambda m, x, y: rlx.cross_entropy(m(x), y), model, rlx.optim.SGD(lr=0.1, momentum=0.9),
                                  {"x": rlx.InputSpec((5, 1, 8, 8)), "y": rlx.InputSpec((5,), "int32")})
    topt = torch.optim.SGD(tm.parameters(), lr=0.1, momentum=0.9)
    tm.train()
    for x, y in zip(xs, ys):
        loss = step(x=x, y=y)
        topt.zero_grad()
        tl = torch.nn.functional.cross_entropy(tforward(torch.tensor(x)), torch.tensor(y, dtype=torch.long))
        tl.backward()
        topt.step()
        assert abs(loss - tl.item()) < 1e-4
    ours = model.state_dict()
    for k, v in tm.state_dict().items():
        assert_close(ours[k], v.numpy().astype(np.float64), rtol=1e-4, atol=1e-5, err_msg=k)
    tm.eval()
    predict = rlx.compile(lambda m, x: m(x), model, {"x": rlx.InputSpec((5, 1, 8, 8))})
    assert_close(predict(x=xs[0]), tforward(torch.tensor(xs[0])).detach().numpy(), rtol=1e-4, atol=1e-5)


@needs_torch
@pytest.mark.parametrize("dims", [(4, 5), (3, 5, 7), (1, 3, 5, 4), (2, 9, 3, 3)], ids=str)
def test_batch_norm_train_and_eval_match_torch(dims):
    rng = np.random.default_rng(len(dims))
    x = (rng.standard_normal(dims) * 2 + 1).astype(np.float32)
    c = dims[1]
    bn = rlx.nn.BatchNorm2d(c) if len(dims) == 4 else rlx.nn.BatchNorm1d(c)
    tb = torch.nn.BatchNorm2d(c) if len(dims) == 4 else torch.nn.BatchNorm1d(c)
    bn.weight._assign(rng.uniform(0.5, 1.5, c).astype(np.float32))
    bn.bias._assign(rng.uniform(-0.5, 0.5, c).astype(np.float32))
    _torch_copy(bn, tb)
    g = rng.standard_normal(dims).astype(np.float32)

    class Net(rlx.nn.Module):
        def __init__(self):
            self.bn = bn

    net = Net()
    step = rlx.compile_train_step(lambda m, x, g: (m.bn(x) * g).sum(), net, rlx.optim.SGD(lr=0.0),
                                  {"x": rlx.InputSpec(dims), "g": rlx.InputSpec(dims)})
    tx = torch.tensor(x, requires_grad=True)
    ty = tb(tx)
    (ty * torch.tensor(g)).sum().backward()
    for _ in range(2):  # the running statistics move twice, as two torch forward passes do
        loss = step(x=x, g=g)
    tb(torch.tensor(x))
    assert abs(loss - float((ty * torch.tensor(g)).sum().detach())) < 1e-3 * max(1.0, abs(loss))
    assert_close(step.grads["bn.weight"], tb.weight.grad.numpy(), rtol=1e-4, atol=1e-4)
    assert_close(step.grads["bn.bias"], tb.bias.grad.numpy(), rtol=1e-4, atol=1e-4)
    for k in ("running_mean", "running_var", "num_batches_tracked"):
        assert_close(np.asarray(getattr(bn, k)), getattr(tb, k).numpy().astype(np.float64), rtol=1e-5, atol=1e-6, err_msg=k)
    # Eval mode normalises with the running statistics.
    dx_fn = rlx.compile(lambda m, x, g: m.bn(x), net, {"x": rlx.InputSpec(dims), "g": rlx.InputSpec(dims)})
    tb.eval()
    assert_close(dx_fn(x=x, g=g), tb(torch.tensor(x)).detach().numpy(), rtol=1e-4, atol=1e-5)


def test_batch_norm_input_gradient_matches_finite_differences():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 2, 2, 2)).astype(np.float32)
    rm, rv = np.zeros(2, np.float32), np.ones(2, np.float32)

    def np_bn(x):
        m = x.mean(axis=(0, 2, 3), keepdims=True)
        v = ((x - m) ** 2).mean(axis=(0, 2, 3), keepdims=True)
        return (x - m) / np.sqrt(v + 1e-5)

    check_op_grads(lambda x: rlx.batch_norm(x, rm, rv, training=True), np_bn, {"x": x})


def test_batch_norm_one_value_per_channel_in_training_is_refused():
    bn = rlx.nn.BatchNorm1d(3)
    with pytest.raises(rlx.ShapeError, match=r"\[batch_norm\] expected more than 1 value per channel"):
        rlx.compile_train_step(lambda m, x: m(x).sum(), bn, rlx.optim.SGD(lr=0.1), {"x": rlx.InputSpec((1, 3))})


def _dropout_model(p):
    class M(rlx.nn.Module):
        def __init__(self):
            self.w = rlx.nn.Parameter(np.ones((400,), np.float32))
            self.drop = rlx.nn.Dropout(p)

        def __call__(self, x):
            return self.drop(x * self.w)

    return M()


def test_dropout_train_masks_scale_and_differ_per_step_and_gradients_use_the_mask():
    rlx.seed(11)
    m = _dropout_model(0.25)
    step = rlx.compile_train_step(lambda m, x: (m(x) * 1.0).sum(), m, rlx.optim.SGD(lr=0.0), {"x": rlx.InputSpec((400,))})
    x = np.ones(400, np.float32)
    step(x=x)
    g1 = np.array(step.grads["w"])
    step(x=x)
    g2 = np.array(step.grads["w"])
    for g in (g1, g2):
        kept = g != 0
        assert set(np.unique(g)) <= {0.0, np.float32(1 / 0.75)}
        assert 0.6 < kept.mean() < 0.9
    assert not np.array_equal(g1, g2), "each step draws a new mask"
    # Reproducible: the same seed gives the same masks, step by step.
    rlx.seed(11)
    m2 = _dropout_model(0.25)
    step2 = rlx.compile_train_step(lambda m, x: (m(x) * 1.0).sum(), m2, rlx.optim.SGD(lr=0.0), {"x": rlx.InputSpec((400,))})
    step2(x=x)
    np.testing.assert_array_equal(step2.grads["w"], g1)
    step2(x=x)
    np.testing.assert_array_equal(step2.grads["w"], g2)


def test_two_dropouts_in_one_step_draw_different_masks():
    out = run_forward(lambda x: rlx.concat([rlx.dropout(x, 0.5), rlx.dropout(x, 0.5)]), {"x": np.ones(300, np.float32)})
    assert not np.array_equal(out[:300], out[300:])


def test_dropout_is_the_identity_in_eval_mode_and_with_prefetch():
    m = _dropout_model(0.5)
    x = np.arange(400, dtype=np.float32)
    fn = rlx.compile(lambda m, x: m(x), m, {"x": rlx.InputSpec((400,))})
    np.testing.assert_array_equal(fn(x=x), x)
    step = rlx.compile_train_step(lambda m, x: m(x).sum(), m, rlx.optim.SGD(lr=0.0), {"x": rlx.InputSpec((400,))})
    step.prefetch(x=x)
    assert np.isfinite(step())


def test_layers_repr_and_state_dict_names_match_torch():
    net = rlx.nn.Sequential(rlx.nn.Conv2d(3, 8, 3, padding=1), rlx.nn.BatchNorm2d(8), rlx.nn.LeakyReLU(0.1),
                            rlx.nn.AvgPool2d(2), rlx.nn.Flatten(), rlx.nn.Identity(), rlx.nn.SiLU(), rlx.nn.Tanh(),
                            rlx.nn.Sigmoid(), rlx.nn.Dropout(0.2))
    assert list(net.state_dict()) == ["0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean", "1.running_var",
                                      "1.num_batches_tracked"]
    assert "Conv2d(3, 8, kernel_size=(3, 3)" in repr(net)
    if torch is not None:
        tnet = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8))
        net.load_state_dict({k: v.numpy() for k, v in tnet.state_dict().items()})


@needs_torch
def test_activation_layers_match_torch():
    x = np.linspace(-25, 25, 101, dtype=np.float32).reshape(1, 101)
    for ours, theirs in [(rlx.nn.SiLU(), torch.nn.SiLU()), (rlx.nn.Tanh(), torch.nn.Tanh()),
                         (rlx.nn.Sigmoid(), torch.nn.Sigmoid()), (rlx.nn.LeakyReLU(0.2), torch.nn.LeakyReLU(0.2)),
                         (rlx.nn.Identity(), torch.nn.Identity())]:
        got = run_forward(lambda x, _m=ours: _m(x), {"x": x})
        assert_close(got, theirs(torch.tensor(x)).numpy().astype(np.float64), rtol=1e-5, atol=1e-6, err_msg=type(ours).__name__)


# --- bad input ------------------------------------------------------------------------------------
def _trace_error(fn, arrays):
    return rlx.compile(lambda _m, **t: fn(**t), Empty(), specs(arrays))


@pytest.mark.parametrize("fn,arrays,err,msg", [
    (lambda x, w: rlx.conv2d(x, w), {"x": np.zeros((3, 4, 4), np.float32), "w": np.zeros((2, 3, 1, 1), np.float32)},
     rlx.ShapeError, r"\[conv2d\] x must have rank 4 \(N, C, H, W\), got shape \(3, 4, 4\)"),
    (lambda x, w: rlx.conv2d(x, w), {"x": np.zeros((1, 4, 4, 4), np.float32), "w": np.zeros((2, 3, 1, 1), np.float32)},
     rlx.ShapeError, r"\[conv2d\] x has 4 channels but weight \(2, 3, 1, 1\) expects 3"),
    (lambda x, w: rlx.conv2d(x, w, padding=1), {"x": np.zeros((1, 3, 2, 2), np.float32),
                                                "w": np.zeros((2, 3, 5, 5), np.float32)},
     rlx.ShapeError, r"\[conv2d\] kernel \(5, 5\) is larger than the padded input \(4, 4\)"),
    (lambda x, w: rlx.conv2d(x, w, stride=0), {"x": np.zeros((1, 3, 4, 4), np.float32),
                                               "w": np.zeros((2, 3, 1, 1), np.float32)},
     rlx.ShapeError, r"\[conv2d\] stride"),
    (lambda x: rlx.max_pool2d(x, 5), {"x": np.zeros((1, 1, 4, 4), np.float32)},
     rlx.ShapeError, r"\[max_pool2d\] kernel_size \(5, 5\) is larger than the padded input"),
    (lambda x: rlx.avg_pool2d(x, 2), {"x": np.zeros((4, 4), np.float32)},
     rlx.ShapeError, r"\[avg_pool2d\] x must have rank 4"),
    (lambda x: rlx.max_pool2d(x, 2, padding=2), {"x": np.zeros((1, 1, 4, 4), np.float32)},
     rlx.ShapeError, r"\[max_pool2d\] padding \(2, 2\) must be at most half the kernel size"),
    (lambda x: rlx.dropout(x, 1.0), {"x": np.zeros(3, np.float32)}, rlx.InputError, r"\[dropout\] p must be in \[0, 1\)"),
    (lambda x: rlx.dropout(x, -0.1), {"x": np.zeros(3, np.float32)}, rlx.InputError, r"\[dropout\] p must be in \[0, 1\)"),
    (lambda x, w: rlx.conv2d(x, w), {"x": np.zeros((1, 3, 4, 4), np.float32), "w": np.zeros((2, 3, 1), np.float32)},
     rlx.ShapeError, r"\[conv2d\] weight must have rank 4 \(out_channels, in_channels, kh, kw\), got shape \(2, 3, 1\)"),
], ids=range(10))
def test_bad_input_names_op_and_shapes(fn, arrays, err, msg):
    with pytest.raises(err, match=msg):
        _trace_error(fn, arrays)


def test_bad_layer_arguments():
    for cls in (rlx.nn.MaxPool2d, rlx.nn.AvgPool2d):  # refused when the layer is made, not at its first call
        name = cls.__name__
        with pytest.raises(rlx.ShapeError, match=rf"\[{name}\] stride must be >= 1, got 0"):
            cls(2, stride=0)
        with pytest.raises(rlx.ShapeError, match=rf"\[{name}\] kernel_size must be >= 1, got -1"):
            cls((2, -1))
        with pytest.raises(rlx.ShapeError, match=rf"\[{name}\] padding must be >= 0, got -1"):
            cls(2, padding=-1)
        with pytest.raises(rlx.DTypeError, match=rf"\[{name}\] stride must be an int, got float 1.5"):
            cls(2, stride=1.5)
    with pytest.raises(rlx.InputError, match=r"\[Dropout\] p must be in \[0, 1\)"):
        rlx.nn.Dropout(1.5)
    with pytest.raises(rlx.ShapeError, match=r"\[BatchNorm2d\] expects inputs of rank 4 with 3 channels in axis 1, got \(2, 4, 5, 5\)"):
        rlx.compile(lambda m, x: m(x), rlx.nn.BatchNorm2d(3), {"x": rlx.InputSpec((2, 4, 5, 5))})
    with pytest.raises(rlx.ShapeError, match=r"\[conv2d\] x has 2 channels but weight \(4, 3, 3, 3\) expects 3"):
        rlx.compile(lambda m, x: m(x), rlx.nn.Conv2d(3, 4, 3), {"x": rlx.InputSpec((1, 2, 5, 5))})


@needs_torch
@pytest.mark.parametrize("xs,ws,stride,padding", CONV_CASES, ids=str)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_conv_and_pool_layers_match_torch(xs, ws, stride, padding, training):
    """Conv2d -> MaxPool2d / AvgPool2d layers: outputs, and in train mode the gradients of the
    weight, bias and input, against PyTorch on the same weights."""
    rlx.seed(sum(xs))
    conv = rlx.nn.Conv2d(xs[1], ws[0], ws[1:], stride=stride, padding=padding)
    tconv = torch.nn.Conv2d(xs[1], ws[0], ws[1:], stride=stride, padding=padding)
    _torch_copy(conv, tconv)
    x = np.random.default_rng(1).standard_normal(xs).astype(np.float32)
    tx = torch.tensor(x, requires_grad=True)
    ty = tconv(tx)
    k = min(2, ty.shape[2], ty.shape[3])

    class Net(rlx.nn.Module):
        def __init__(self):
            self.conv, self.mp, self.ap = conv, rlx.nn.MaxPool2d(k, 1), rlx.nn.AvgPool2d(k)

        def __call__(self, x):
            y = self.conv(x)
            return y, self.mp(y), self.ap(y)

    tys = (ty, torch.nn.functional.max_pool2d(ty, k, 1), torch.nn.functional.avg_pool2d(ty, k))
    net = Net().train(training)
    outs = rlx.compile(lambda m, x: m(x), net, {"x": rlx.InputSpec(xs)}, training=training)(x=x)
    for got, want in zip(outs, tys):
        assert_close(got, want.detach().numpy().astype(np.float64), rtol=1e-4, atol=1e-5)
    if not training:
        return
    gs = [np.random.default_rng(i).standard_normal(t.shape).astype(np.float32) for i, t in enumerate(tys)]
    sum(((t * torch.tensor(g)).sum() for t, g in zip(tys, gs)), torch.zeros(())).backward()
    net.x = rlx.nn.Parameter(x)
    step = rlx.compile_train_step(
        lambda m, g0, g1, g2: sum(((o * g).sum() for o, g in zip(m(m.x * 1.0), (g0, g1, g2))), 0.0), net,
        rlx.optim.SGD(lr=0.0), {f"g{i}": rlx.InputSpec(g.shape) for i, g in enumerate(gs)})
    step(g0=gs[0], g1=gs[1], g2=gs[2])
    for name, want in [("conv.weight", tconv.weight.grad), ("conv.bias", tconv.bias.grad), ("x", tx.grad)]:
        assert_close(step.grads[name], want.numpy().astype(np.float64), rtol=1e-4, atol=1e-4, err_msg=name)
