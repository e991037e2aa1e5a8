"""Lifetime of zero-copy views (CPU): ``Parameter.numpy()``, ``step.grads``,
``optimizer.state(...)`` and ``fn.view(...)`` outlive the step / function object, the model
(``del model``) and a recompile without dangling: after ``gc.collect()`` and fresh allocations
that would reuse freed memory, the values stay readable and unchanged; nothing reallocates under
a live view (the weight pointer is stable across steps, recompiles and loads); and once the last
view is gone the memory is released."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

import models
import rlx

pytestmark = pytest.mark.skipif("cpu" not in rlx.devices(), reason="zero-copy views need the CPU")

B, D_IN, D_H, D_OUT = 8, 5, 7, 3
S = rlx.InputSpec


def MLP():
    return models.MLP(D_IN, D_H, D_OUT)


loss_fn = models.mse_loss


def inputs(b=B):
    return {"x": S((b, D_IN)), "y": S((b, D_OUT))}


def data(seed=0, b=B):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((b, D_IN)).astype(np.float32),
            rng.standard_normal((b, D_OUT)).astype(np.float32))


def churn(n=50):
    """Allocate and free memory of the sizes just released, so a dangling view would see it."""
    keep = []
    for i in range(n):
        rlx.seed(1000 + i)
        m = MLP()
        s = rlx.compile_train_step(loss_fn, m, rlx.optim.Adam(lr=0.1), inputs())
        s(**dict(zip(("x", "y"), data(i))))
        keep.append(np.full(256, np.nan, np.float32))
        del m, s
    gc.collect()
    return keep


def ptr(a):
    return a.__array_interface__["data"][0]


def setup(seed=0, opt=None):
    rlx.seed(seed)
    model = MLP()
    opt = opt or rlx.optim.Adam(lr=0.05)
    step = rlx.compile_train_step(loss_fn, model, opt, inputs())
    x, y = data(seed)
    for _ in range(2):
        step(x=x, y=y)
    return model, opt, step


def take_views(model, opt, step):
    return {
        "w": model.fc1.weight.numpy(),
        "b": model.fc2.bias.numpy(),
        "g": step.grads["fc1.weight"],
        "m": opt.state("fc1.weight")["exp_avg"],
        "v": opt.state("fc2.bias")["exp_avg_sq"],
    }


def copies(views):
    return {k: np.array(v, copy=True) for k, v in views.items()}


def assert_same(views, snap, what):
    for k, v in views.items():
        np.testing.assert_array_equal(v, snap[k], err_msg=f"view {k} {what}")
        assert np.all(np.isfinite(v)), f"view {k} {what}: non-finite values"


# ----------------------------------------------------------------------------------------------
def test_views_outlive_the_step():
    model, opt, step = setup(0)
    views = take_views(model, opt, step)
    snap = copies(views)
    del step
    gc.collect()
    churn()
    assert_same(views, snap, "after del step")
    # the parameter views are still the model's live weights
    assert ptr(model.fc1.weight.numpy()) == ptr(views["w"])


def test_views_outlive_the_model_and_optimizer():
    model, opt, step = setup(1)
    views = take_views(model, opt, step)
    params = model.parameters()  # Parameter objects held on their own
    snap = copies(views)
    del model, opt, step
    gc.collect()
    churn()
    assert_same(views, snap, "after del model/opt/step")
    np.testing.assert_array_equal(params["fc1.weight"].numpy(), snap["w"])
    # still writable where it was (the weight view), and the write sticks
    views["w"][0, 0] = 42.0
    churn(5)
    assert views["w"][0, 0] == 42.0


def test_views_survive_a_recompile_and_weights_stay_put():
    model, opt, step = setup(2)
    views = take_views(model, opt, step)
    w_ptr = ptr(views["w"])
    before = copies(views)
    # a second training step on the same model (another batch size, same optimizer)
    step2 = rlx.compile_train_step(loss_fn, model, opt, inputs(b=3))
    assert ptr(model.fc1.weight.numpy()) == w_ptr
    assert ptr(opt.state("fc1.weight")["exp_avg"]) == ptr(views["m"])
    x, y = data(3, b=3)
    step2(x=x, y=y)
    # the old views see the update made by the new executable
    np.testing.assert_array_equal(views["w"], model.fc1.weight.numpy())
    assert not np.array_equal(views["w"], before["w"])
    assert not np.array_equal(views["m"], before["m"])
    # the old step's grads stay readable (and were not touched by step2)
    np.testing.assert_array_equal(views["g"], before["g"])
    # drop the first step entirely; everything else still works
    del step
    gc.collect()
    churn()
    np.testing.assert_array_equal(views["g"], before["g"])
    step2(x=x, y=y)
    np.testing.assert_array_equal(views["w"], model.fc1.weight.numpy())
    assert ptr(model.fc1.weight.numpy()) == w_ptr


def test_weight_pointer_stable_across_steps_compiles_and_load(tmp_path):
    model, opt, step = setup(4)
    w = model.fc1.weight.numpy()
    p0 = ptr(w)
    x, y = data(4)
    for _ in range(5):
        step(x=x, y=y)
        assert ptr(model.fc1.weight.numpy()) == p0
    fn = rlx.compile(lambda m, x: m(x), model, {"x": S((B, D_IN))})
    assert ptr(model.fc1.weight.numpy()) == p0
    step_sgd = rlx.compile_train_step(loss_fn, model, rlx.optim.SGD(lr=0.1, momentum=0.9), inputs())
    assert ptr(model.fc1.weight.numpy()) == p0
    step_sgd(x=x, y=y)
    path = tmp_path / "m.safetensors"
    model.save(str(path))
    saved = w.copy()
    step(x=x, y=y)
    model.load(str(path))
    assert ptr(model.fc1.weight.numpy()) == p0
    np.testing.assert_array_equal(w, saved)
    fn(x=x)
    assert ptr(model.fc1.weight.numpy()) == p0


def test_grads_and_state_pointers_stable_across_steps():
    model, opt, step = setup(5)
    g, m = step.grads["fc1.weight"], opt.state("fc1.weight")["exp_avg"]
    x, y = data(5)
    for i in range(4):
        step(**dict(zip(("x", "y"), data(100 + i))))
        assert ptr(step.grads["fc1.weight"]) == ptr(g)
        assert ptr(opt.state("fc1.weight")["exp_avg"]) == ptr(m)
    np.testing.assert_array_equal(g, step.grads["fc1.weight"])


def test_fn_view_outlives_the_function():
    rlx.seed(6)
    model = MLP()
    fn = rlx.compile(lambda m, x, cache: m(x) + cache.sum(), model,
                     {"x": S((B, D_IN)), "cache": S((4, 3))})
    cache = np.arange(12, dtype=np.float32).reshape(4, 3)
    fn.bind("cache", cache)
    view = fn.view("cache")
    fn.write_rows("cache", 1, np.full((1, 3), 9.0, np.float32))
    expect = cache.copy()
    expect[1] = 9.0
    x, _ = data(6)
    out = fn(x=x)
    del fn, model
    gc.collect()
    churn()
    np.testing.assert_array_equal(view, expect)
    view[0, 0] = -1.0  # still writable, nothing else owns it now
    assert view[0, 0] == -1.0
    assert np.all(np.isfinite(out))


def test_generator_cache_view_outlives_generator():
    rlx.seed(7)
    gpt = rlx.models.GPT(vocab=16, dim=8, heads=2, layers=1, seq_len=6)
    gen = rlx.models.Generator(gpt)
    for t in (1, 2, 3):
        gen.step(t)
    k0 = gen.fn.view("k0")
    snap = k0.copy()
    assert np.abs(snap[:, :, :3]).sum() > 0
    del gen, gpt
    gc.collect()
    churn()
    np.testing.assert_array_equal(k0, snap)


def test_outputs_are_not_overwritten_by_the_next_call():
    rlx.seed(8)
    model = MLP()
    fn = rlx.compile(lambda m, x: (m(x), m.fc1(x)), model, {"x": S((B, D_IN))})
    a = fn(x=data(8)[0])
    a_copy = [o.copy() for o in a]
    b = fn(x=data(9)[0])
    for o, c, n in zip(a, a_copy, b):
        np.testing.assert_array_equal(o, c)
        assert not np.shares_memory(o, n)
    del fn, model
    gc.collect()
    churn()
    for o, c in zip(a, a_copy):
        np.testing.assert_array_equal(o, c)


def test_many_recompiles_keep_one_weight_buffer():
    model, opt, _ = setup(9)
    w = model.fc1.weight.numpy()
    p0 = ptr(w)
    x, y = data(9)
    for i in range(20):
        s = rlx.compile_train_step(loss_fn, model, opt, inputs())
        s(x=x, y=y)
        g = s.grads["fc2.weight"]
        del s
        gc.collect()
        assert np.all(np.isfinite(g))
        assert ptr(model.fc1.weight.numpy()) == p0
    np.testing.assert_array_equal(w, model.fc1.weight.numpy())


def _rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
def test_memory_released_when_the_last_view_goes():
    """A view keeps its buffer alive (and nothing more once the owners are gone); dropping the
    view releases it. 64 MiB of weights make the effect visible above allocator noise."""

    gc.collect()
    start = _rss_mb()
    rlx.seed(10)
    model = models.LinearNet(4096, 4096)
    step = rlx.compile_train_step(lambda m, x: (m(x) ** 2).mean(), model, rlx.optim.Adam(lr=1e-3),
                                  {"x": S((2, 4096))})
    step(x=np.ones((2, 4096), np.float32))
    w = model.fc.weight.numpy()
    snap = w[:4, :4].copy()
    full = _rss_mb()
    del step, model
    gc.collect()
    held = _rss_mb()
    np.testing.assert_array_equal(w[:4, :4], snap)
    assert held >= start + 48, f"the weights behind a live view were freed? {start:.0f} -> {held:.0f} MiB"
    assert held <= full - 64, (f"deleting the step and model did not free the arena / optimizer "
                               f"state: {full:.0f} -> {held:.0f} MiB")
    del w
    gc.collect()
    end = _rss_mb()
    assert end <= start + 32, f"memory not released after the last view: {start:.0f} -> {end:.0f} MiB"
