"""Zero-copy views on CPU: parameters, gradients and optimizer state live in the arena and are
shared by every executable compiled from the same model; memory() reports the plan."""

import gc

import numpy as np
import pytest

import models
import rlx
from conftest import assert_close

B, D_IN, D_H, D_OUT = 6, 4, 5, 3


def MLP():
    return models.MLP(D_IN, D_H, D_OUT)


loss_fn = models.mse_loss


def forward_fn(m, x):
    return m(x)


TRAIN_INPUTS = {"x": rlx.InputSpec((B, D_IN)), "y": rlx.InputSpec((B, D_OUT))}
FWD_INPUTS = {"x": rlx.InputSpec((B, D_IN))}


def data(seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, D_IN)).astype(np.float32),
            rng.standard_normal((B, D_OUT)).astype(np.float32))


def np_forward(p, x):
    x = x.astype(np.float64)
    h = np.maximum(x @ p["fc1.weight"].T + p["fc1.bias"], 0.0)
    return h @ p["fc2.weight"].T + p["fc2.bias"]


def np_loss_and_grads(p, x, y):
    x, y = x.astype(np.float64), y.astype(np.float64)
    z = x @ p["fc1.weight"].T + p["fc1.bias"]
    h = np.maximum(z, 0.0)
    out = h @ p["fc2.weight"].T + p["fc2.bias"]
    r = out - y
    d = 2.0 * r / r.size
    dh = (d @ p["fc2.weight"]) * (z > 0)
    return float(np.mean(r * r)), {
        "fc1.weight": dh.T @ x, "fc1.bias": dh.sum(0),
        "fc2.weight": d.T @ h, "fc2.bias": d.sum(0),
    }


def current(model):
    return {k: p.numpy().astype(np.float64) for k, p in model.parameters().items()}


def new_model(seed=0):
    rlx.seed(seed)
    return MLP()


def test_param_numpy_is_a_stable_view_into_the_arena():
    model = new_model()
    init = {k: p.numpy().copy() for k, p in model.parameters().items()}
    step = rlx.compile_train_step(loss_fn, model, rlx.optim.SGD(lr=0.1), TRAIN_INPUTS, device="cpu")
    w1, w2 = model.fc1.weight.numpy(), model.fc1.weight.numpy()
    assert np.shares_memory(w1, w2)
    ptr = w1.ctypes.data
    # compiling copied the initial values in
    for k, p in model.parameters().items():
        np.testing.assert_array_equal(p.numpy(), init[k])
    x, y = data()
    for _ in range(3):
        step(x=x, y=y)
        assert model.fc1.weight.numpy().ctypes.data == ptr
    # the view taken before the steps sees the updated weights
    assert not np.array_equal(w1, init["fc1.weight"])
    np.testing.assert_array_equal(w1, model.fc1.weight.numpy())


def test_sgd_update_is_visible_through_views_and_matches_grads():
    model = new_model(1)
    lr = 0.05
    step = rlx.compile_train_step(loss_fn, model, rlx.optim.SGD(lr=lr), TRAIN_INPUTS)
    x, y = data(1)
    before = current(model)
    loss = step(x=x, y=y)
    ref_loss, ref_grads = np_loss_and_grads(before, x, y)
    assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    after = current(model)
    for k in before:
        assert_close(step.grads[k], ref_grads[k], rtol=1e-4, atol=1e-6, err_msg=k)
        assert_close(after[k], before[k] - lr * ref_grads[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_grads_are_stable_views():
    model = new_model(2)
    step = rlx.compile_train_step(loss_fn, model, rlx.optim.SGD(lr=0.1), TRAIN_INPUTS)
    x, y = data(2)
    step(x=x, y=y)
    g = step.grads
    assert set(g) == set(model.parameters())
    for k, p in model.parameters().items():
        assert g[k].shape == tuple(p.shape) and g[k].dtype == np.float32
    g1 = g["fc1.weight"]
    ptr = g1.ctypes.data
    first = g1.copy()
    x2, y2 = data(3)
    step(x=x2, y=y2)
    g2 = step.grads["fc1.weight"]
    assert g2.ctypes.data == ptr
    assert np.shares_memory(g1, g2)
    # the old view now shows the new gradients, which differ from the first ones
    np.testing.assert_array_equal(g1, g2)
    assert not np.array_equal(g1, first)


def test_writing_weight_view_changes_next_step():
    model = new_model(3)
    step = rlx.compile_train_step(loss_fn, model, rlx.optim.SGD(lr=0.0), TRAIN_INPUTS)
    x, y = data(4)
    step(x=x, y=y)
    model.fc2.weight.numpy()[...] = 0.0
    model.fc2.bias.numpy()[...] = 0.5
    loss = step(x=x, y=y)
    # output is the constant 0.5 now
    assert_close(loss, np.mean((0.5 - y.astype(np.float64)) ** 2), rtol=1e-6, atol=1e-7)
    # and a partial in-place write is honoured too
    w = model.fc1.weight.numpy()
    w[0, :] += 1.0
    model.fc2.weight.numpy()[...] = np.random.default_rng(0).standard_normal((D_OUT, D_H))
    ref_loss, _ = np_loss_and_grads(current(model), x, y)
    assert_close(step(x=x, y=y), ref_loss, rtol=1e-5, atol=1e-6)


def test_writing_weight_view_changes_inference():
    model = new_model(4)
    fn = rlx.compile(forward_fn, model, FWD_INPUTS, device="cpu")
    x, _ = data(5)
    model.fc2.weight.numpy()[...] = 0.0
    model.fc2.bias.numpy()[...] = np.array([1.0, 2.0, 3.0], np.float32)
    np.testing.assert_array_equal(fn(x=x), np.tile(np.array([1.0, 2.0, 3.0], np.float32), (B, 1)))


def test_view_survives_executable_deletion():
    model = new_model(5)
    step = rlx.compile_train_step(loss_fn, model, rlx.optim.SGD(lr=0.1), TRAIN_INPUTS)
    x, y = data(6)
    w = model.fc1.weight.numpy()
    g = step.grads["fc1.weight"]
    for _ in range(2):
        step(x=x, y=y)
    last_w, last_g = w.copy(), g.copy()
    del step
    gc.collect()
    # touching freed memory would give garbage (or crash); the views keep their owner alive
    np.testing.assert_array_equal(w, last_w)
    np.testing.assert_array_equal(g, last_g)
    np.testing.assert_array_equal(model.fc1.weight.numpy(), last_w)


def test_optimizer_state_is_a_view():
    model = new_model(6)
    opt = rlx.optim.Adam(lr=0.01)
    step = rlx.compile_train_step(loss_fn, model, opt, TRAIN_INPUTS)
    x, y = data(7)
    step(x=x, y=y)
    m = opt.state("fc1.weight")["exp_avg"]
    ptr, first = m.ctypes.data, m.copy()
    step(x=x, y=y)
    m2 = opt.state("fc1.weight")["exp_avg"]
    assert m2.ctypes.data == ptr
    assert not np.array_equal(m, first)
    np.testing.assert_array_equal(m, m2)


@pytest.mark.parametrize("order", ["fn-first", "step-first"])
def test_inference_and_train_step_share_weights(order):
    model = new_model(7)
    x, y = data(8)
    if order == "fn-first":
        fn = rlx.compile(forward_fn, model, FWD_INPUTS, device="cpu")
        step = rlx.compile_train_step(loss_fn, model, rlx.optim.SGD(lr=0.1), TRAIN_INPUTS,
                                      device="cpu")
    else:
        step = rlx.compile_train_step(loss_fn, model, rlx.optim.SGD(lr=0.1), TRAIN_INPUTS,
                                      device="cpu")
        fn = rlx.compile(forward_fn, model, FWD_INPUTS, device="cpu")
    p0 = current(model)
    out0 = fn(x=x)
    assert_close(out0, np_forward(p0, x), rtol=1e-5, atol=1e-6)
    for _ in range(3):
        step(x=x, y=y)
    p3 = current(model)
    out3 = fn(x=x)
    assert not np.allclose(out3, out0)
    assert_close(out3, np_forward(p3, x), rtol=1e-5, atol=1e-6)
    # the next train step starts from the weights the inference function just used
    loss = step(x=x, y=y)
    assert_close(loss, np.mean((out3.astype(np.float64) - y) ** 2), rtol=1e-5, atol=1e-6)
    # and a write through the view reaches both executables
    model.fc2.weight.numpy()[...] = 0.0
    model.fc2.bias.numpy()[...] = 0.25
    np.testing.assert_array_equal(fn(x=x), np.full((B, D_OUT), 0.25, np.float32))
    assert_close(step(x=x, y=y), np.mean((0.25 - y.astype(np.float64)) ** 2), rtol=1e-6,
                 atol=1e-7)


def test_two_train_steps_share_weights():
    model = new_model(8)
    opt = rlx.optim.SGD(lr=0.1)
    s6 = rlx.compile_train_step(loss_fn, model, opt, TRAIN_INPUTS)
    s2 = rlx.compile_train_step(loss_fn, model, opt,
                                {"x": rlx.InputSpec((2, D_IN)), "y": rlx.InputSpec((2, D_OUT))})
    x, y = data(9)
    p = current(model)
    s6(x=x, y=y)
    _, g = np_loss_and_grads(p, x, y)
    p = {k: p[k] - 0.1 * g[k] for k in p}
    loss2 = s2(x=x[:2], y=y[:2])
    ref2, g2 = np_loss_and_grads(p, x[:2], y[:2])  # s2 sees s6's update
    assert_close(loss2, ref2, rtol=1e-5, atol=1e-6)
    p = {k: p[k] - 0.1 * g2[k] for k in p}
    for k, v in current(model).items():
        assert_close(v, p[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_inference_outputs_are_fresh_arrays():
    model = new_model(9)
    fn = rlx.compile(forward_fn, model, FWD_INPUTS)
    x1, _ = data(10)
    x2, _ = data(11)
    o1 = fn(x=x1)
    keep = o1.copy()
    o2 = fn(x=x2)
    assert not np.shares_memory(o1, o2)
    np.testing.assert_array_equal(o1, keep)  # not overwritten by the next call
    o2[...] = 7.0  # writable, and writing does not affect later calls
    np.testing.assert_array_equal(fn(x=x1), keep)


def test_memory_report():
    model = new_model(11)
    step = rlx.compile_train_step(loss_fn, model, rlx.optim.Adam(lr=0.01), TRAIN_INPUTS)
    mem = step.memory()
    for key in ("arena_bytes", "naive_bytes", "param_bytes"):
        assert key in mem and isinstance(mem[key], int) and mem[key] > 0, key
    n_params = sum(int(np.prod(p.shape)) for p in model.parameters().values())
    assert mem["param_bytes"] >= 4 * n_params
    n_tensors = len(model.parameters())
    assert mem["param_bytes"] <= 4 * n_params + 4096 * n_tensors  # params plus alignment only
    assert mem["arena_bytes"] <= mem["naive_bytes"]
    assert set(mem) == {"arena_bytes", "naive_bytes", "param_bytes", "optimizer_state_bytes", "workspace_bytes"}
    assert mem["workspace_bytes"] == 0  # the CPU keeps no per-program device memory
    assert mem["optimizer_state_bytes"] >= 2 * 4 * n_params  # Adam: exp_avg and exp_avg_sq
    # naive = every tensor once: at least the gradients and the hidden activation
    assert mem["naive_bytes"] >= 4 * (n_params + B * D_H)
