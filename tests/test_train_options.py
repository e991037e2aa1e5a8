"""Training-step options against numpy references (no PyTorch needed): gradient clipping,
accumulation, skipping non-finite steps, (loss, aux) returns, None dimensions sharing weights and
optimizer state, the program listing; the update rules of every optimizer, parameter groups and
settings changed between steps; the schedulers' formulas; optimizer checkpoints and bit-for-bit
resume."""

import math

import numpy as np
import pytest

import rlx

D_IN, D_OUT, B = 4, 3, 6


class Lin(rlx.nn.Module):
    def __init__(self):
        self.fc = rlx.nn.Linear(D_IN, D_OUT)

    def __call__(self, x):
        return self.fc(x)


def loss_fn(m, x, y):
    return rlx.mse_loss(m(x), y)


SPEC = {"x": rlx.InputSpec((B, D_IN)), "y": rlx.InputSpec((B, D_OUT))}


def grads(p, x, y):
    """mse(x @ W.T + b, y) and its gradients, float64."""
    x, y = x.astype(np.float64), y.astype(np.float64)
    r = x @ p["fc.weight"].T + p["fc.bias"] - y
    d = 2.0 * r / r.size
    return float(np.mean(r * r)), {"fc.weight": d.T @ x, "fc.bias": d.sum(0)}


def batches(n, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((B, D_IN)).astype(np.float32) * scale,
             rng.standard_normal((B, D_OUT)).astype(np.float32)) for _ in range(n)]


def fresh(seed=0):
    rlx.seed(seed)
    m = Lin()
    return m, {k: v.astype(np.float64) for k, v in m.state_dict().items()}


# --- update rules (PyTorch's, written out in numpy) -----------------------------------------------

def ref_sgd(lr, momentum=0.0, dampening=0.0, wd=0.0, nesterov=False):
    def rule(p, g, st, t):
        d = g + wd * p
        if momentum:
            st["buf"] = d.copy() if "buf" not in st else momentum * st["buf"] + (1 - dampening) * d
            d = d + momentum * st["buf"] if nesterov else st["buf"]
        return p - lr * d
    return rule


def ref_rmsprop(lr, alpha=0.99, eps=1e-8, wd=0.0, momentum=0.0):
    def rule(p, g, st, t):
        g = g + wd * p
        st["v"] = alpha * st.get("v", 0.0) + (1 - alpha) * g * g
        avg = np.sqrt(st["v"]) + eps
        if momentum:
            st["buf"] = momentum * st.get("buf", 0.0) + g / avg
            return p - lr * st["buf"]
        return p - lr * g / avg
    return rule


def ref_adagrad(lr, lr_decay=0.0, wd=0.0, eps=1e-10):
    def rule(p, g, st, t):
        g = g + wd * p
        st["s"] = st.get("s", 0.0) + g * g
        return p - lr / (1 + (t - 1) * lr_decay) * g / (np.sqrt(st["s"]) + eps)
    return rule


def ref_adam(lr, b1=0.9, b2=0.999, eps=1e-8, wd=0.0, decoupled=False):
    def rule(p, g, st, t):
        if decoupled:
            p = p * (1 - lr * wd)
        else:
            g = g + wd * p
        st["m"] = b1 * st.get("m", 0.0) + (1 - b1) * g
        st["v"] = b2 * st.get("v", 0.0) + (1 - b2) * g * g
        mh, vh = st["m"] / (1 - b1 ** t), st["v"] / (1 - b2 ** t)
        return p - lr * mh / (np.sqrt(vh) + eps)
    return rule


RULES = {
    "sgd-nesterov": (lambda: rlx.optim.SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
                     ref_sgd(0.05, 0.9, wd=0.01, nesterov=True)),
    "sgd-dampening": (lambda: rlx.optim.SGD(lr=0.05, momentum=0.8, dampening=0.3),
                      ref_sgd(0.05, 0.8, dampening=0.3)),
    "rmsprop": (lambda: rlx.optim.RMSprop(lr=0.01, weight_decay=0.01), ref_rmsprop(0.01, wd=0.01)),
    "rmsprop-momentum": (lambda: rlx.optim.RMSprop(lr=0.01, alpha=0.9, momentum=0.5),
                         ref_rmsprop(0.01, alpha=0.9, momentum=0.5)),
    "adagrad": (lambda: rlx.optim.Adagrad(lr=0.1, lr_decay=0.05, weight_decay=0.01),
                ref_adagrad(0.1, lr_decay=0.05, wd=0.01)),
    "adam": (lambda: rlx.optim.Adam(lr=0.01, weight_decay=0.01), ref_adam(0.01, wd=0.01)),
    "adamw": (lambda: rlx.optim.AdamW(lr=0.01, weight_decay=0.1), ref_adam(0.01, wd=0.1, decoupled=True)),
}


def run_reference(p, rule, data, clip=None, accumulate=1):
    p = {k: v.copy() for k, v in p.items()}
    states = {k: {} for k in p}
    norms = []
    for t, i in enumerate(range(0, len(data), accumulate), start=1):
        acc = {k: np.zeros_like(v) for k, v in p.items()}
        for x, y in data[i:i + accumulate]:
            for k, g in grads(p, x, y)[1].items():
                acc[k] += g / accumulate
        norm = math.sqrt(sum(float((g * g).sum()) for g in acc.values()))
        norms.append(norm)
        if clip is not None:
            coef = min(1.0, clip / (norm + 1e-6))
            acc = {k: g * coef for k, g in acc.items()}
        p = {k: rule(p[k], acc[k], states[k], t) for k in p}
    return p, norms


@pytest.mark.parametrize("name", list(RULES))
@pytest.mark.parametrize("clip,accumulate", [(None, 1), (0.3, 1), (None, 3), (0.3, 2)])
def test_rules_with_clipping_and_accumulation_match_numpy(name, clip, accumulate):
    make, rule = RULES[name]
    model, p0 = fresh()
    data = batches(6 * accumulate)
    step = rlx.compile_train_step(loss_fn, model, make(), SPEC, clip_grad_norm=clip, accumulate=accumulate)
    norms = []
    for k, (x, y) in enumerate(data):
        step(x=x, y=y)
        if (k + 1) % accumulate == 0:
            norms.append(step.grad_norm)
    want, want_norms = run_reference(p0, rule, data, clip, accumulate)
    for k, v in want.items():
        np.testing.assert_allclose(model.state_dict()[k], v, rtol=1e-4, atol=1e-5, err_msg=k)
    if clip is not None:
        np.testing.assert_allclose(norms, want_norms, rtol=1e-4)
    else:
        assert all(math.isnan(n) for n in norms)  # not computed without clipping or skipping


def test_skip_nonfinite_changes_nothing_and_counts():
    model, _ = fresh()
    opt = rlx.optim.Adam(lr=0.01)
    step = rlx.compile_train_step(loss_fn, model, opt, SPEC, skip_nonfinite=True)
    (x, y), = batches(1)
    step(x=x, y=y)
    before = model.state_dict()
    state = {k: np.array(v) for k, v in opt.state("fc.weight").items()}
    bad = x.copy()
    bad[0, 0] = np.nan
    loss = step(x=bad, y=y)
    assert math.isnan(loss) and step.skipped == 1
    huge = x * np.float32(1e30)  # finite loss? no: inf; and an infinite gradient norm
    step(x=huge, y=y)
    assert step.skipped == 2
    for k, v in before.items():
        np.testing.assert_array_equal(model.state_dict()[k], v)
    for k, v in state.items():
        np.testing.assert_array_equal(opt.state("fc.weight")[k], v)
    step(x=x, y=y)
    assert step.skipped == 2 and int(opt.state("fc.weight")["step"]) == 2


def test_without_skip_a_nan_step_poisons_the_weights():
    model, _ = fresh()
    step = rlx.compile_train_step(loss_fn, model, rlx.optim.SGD(lr=0.1), SPEC)
    (x, y), = batches(1)
    x[0, 0] = np.nan
    step(x=x, y=y)
    assert np.isnan(model.fc.weight.numpy()).any() and step.skipped == 0


def test_loss_with_aux_returns_arrays():
    model, p0 = fresh()

    def fn(m, x, y):
        out = m(x)
        return rlx.mse_loss(out, y), {"pred": out, "err": ((out - y) ** 2).sum(axis=1)}

    step = rlx.compile_train_step(fn, model, rlx.optim.SGD(lr=0.0), SPEC)
    (x, y), = batches(1)
    loss, aux = step(x=x, y=y)
    pred = x.astype(np.float64) @ p0["fc.weight"].T + p0["fc.bias"]
    assert set(aux) == {"pred", "err"} and aux["pred"].shape == (B, D_OUT) and aux["err"].shape == (B,)
    np.testing.assert_allclose(aux["pred"], pred, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(aux["err"], ((pred - y) ** 2).sum(1), rtol=1e-4, atol=1e-5)
    assert loss == pytest.approx(grads(p0, x, y)[0], rel=1e-5)


def test_none_dims_compile_per_size_and_share_weights_and_state():
    model, p0 = fresh()
    opt = rlx.optim.Adam(lr=0.01)
    spec = {"x": rlx.InputSpec((None, D_IN)), "y": rlx.InputSpec((None, D_OUT))}
    step = rlx.compile_train_step(loss_fn, model, opt, spec)
    predict = rlx.compile(lambda m, x: m(x), model, {"x": rlx.InputSpec((None, D_IN))})
    rng = np.random.default_rng(5)
    sizes = [6, 2, 6, 5, 2]
    ref_model, _ = fresh()
    ref_opt = rlx.optim.Adam(lr=0.01)
    ref_steps = {}
    for n in sizes:
        x = rng.standard_normal((n, D_IN)).astype(np.float32)
        y = rng.standard_normal((n, D_OUT)).astype(np.float32)
        step(x=x, y=y)
        if n not in ref_steps:
            ref_steps[n] = rlx.compile_train_step(loss_fn, ref_model, ref_opt,
                                                  {"x": rlx.InputSpec((n, D_IN)), "y": rlx.InputSpec((n, D_OUT))})
        ref_steps[n](x=x, y=y)
    assert len(step._variants) == 3
    for k, v in ref_model.state_dict().items():
        np.testing.assert_array_equal(model.state_dict()[k], v)  # one weight store, one Adam state
    assert int(opt.state("fc.weight")["step"]) == len(sizes)
    for n in (1, 7):
        x = rng.standard_normal((n, D_IN)).astype(np.float32)
        sd = model.state_dict()
        np.testing.assert_allclose(predict(x=x), x @ sd["fc.weight"].T + sd["fc.bias"], rtol=1e-5, atol=1e-6)
    with pytest.raises(rlx.ShapeError, match=r"expected shape \(None, 4\)"):
        step(x=np.zeros((3, 5), np.float32), y=np.zeros((3, D_OUT), np.float32))
    with pytest.raises(rlx.ShapeError):
        step(x=np.zeros((3, D_IN), np.float32), y=np.zeros((4, D_OUT), np.float32))
    with pytest.raises(rlx.UnsupportedError, match="accumulate"):
        rlx.compile_train_step(loss_fn, model, opt, spec, accumulate=2)


def test_none_dims_with_prefetch():
    model, _ = fresh()
    step = rlx.compile_train_step(loss_fn, model, rlx.optim.SGD(lr=0.1),
                                  {"x": rlx.InputSpec((None, D_IN)), "y": rlx.InputSpec((None, D_OUT))})
    ref, _ = fresh()
    ref_step = rlx.compile_train_step(loss_fn, ref, rlx.optim.SGD(lr=0.1),
                                      {"x": rlx.InputSpec((None, D_IN)), "y": rlx.InputSpec((None, D_OUT))})
    data = [(np.full((n, D_IN), 0.1 * n, np.float32), np.ones((n, D_OUT), np.float32)) for n in (3, 5, 3)]
    step.prefetch(x=data[0][0], y=data[0][1])
    losses = []
    for k in range(3):
        if k + 1 < 3:
            step.prefetch(x=data[k + 1][0], y=data[k + 1][1])
        losses.append(step())
    assert losses == [ref_step(x=x, y=y) for x, y in data]


def test_graph_listing():
    model, _ = fresh()
    step = rlx.compile_train_step(loss_fn, model, rlx.optim.Adam(), SPEC, clip_grad_norm=1.0)
    text = step.graph()
    assert text.startswith("program:") and "matmul" in text and "@params+" in text and "@arena+" in text
    assert "update Adam over 2 parameters: clip_grad_norm=1" in text
    fn = rlx.compile(lambda m, x: m(x), model, {"x": rlx.InputSpec((None, D_IN))})
    with pytest.raises(rlx.RlxError, match="nothing compiled yet"):
        fn.graph()
    fn(x=np.zeros((2, D_IN), np.float32))
    assert "float32 (2, 4)" in fn.graph()


# --- settings, groups, state ------------------------------------------------------------------------

def test_momentum_switched_on_after_compile_takes_effect():
    model, p0 = fresh()
    opt = rlx.optim.SGD(lr=0.1)
    step = rlx.compile_train_step(loss_fn, model, opt, SPEC)
    data = batches(4)
    step(x=data[0][0], y=data[0][1])
    opt.momentum = 0.9
    for x, y in data[1:]:
        step(x=x, y=y)
    p, st = {k: v.copy() for k, v in p0.items()}, {k: {} for k in p0}
    plain, mom = ref_sgd(0.1), ref_sgd(0.1, 0.9)
    for t, (x, y) in enumerate(data, start=1):
        g = grads(p, x, y)[1]
        p = {k: (plain if t == 1 else mom)(p[k], g[k], st[k], t) for k in p}
    for k, v in p.items():
        np.testing.assert_allclose(model.state_dict()[k], v, rtol=1e-5, atol=1e-6)


def test_parameter_groups_by_pattern():
    model, p0 = fresh()
    opt = rlx.optim.SGD(lr=0.1, weight_decay=0.5, groups=[{"params": ["*.bias"], "weight_decay": 0.0, "lr": 0.01}])
    step = rlx.compile_train_step(loss_fn, model, opt, SPEC)
    (x, y), = batches(1)
    step(x=x, y=y)
    g = grads(p0, x, y)[1]
    np.testing.assert_allclose(model.fc.weight.numpy(), p0["fc.weight"] - 0.1 * (g["fc.weight"] + 0.5 * p0["fc.weight"]),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.fc.bias.numpy(), p0["fc.bias"] - 0.01 * g["fc.bias"], rtol=1e-5, atol=1e-6)
    opt.groups[0]["lr"] = 0.0  # group settings may change between steps too
    before = model.fc.bias.numpy().copy()
    step(x=x, y=y)
    np.testing.assert_array_equal(model.fc.bias.numpy(), before)
    with pytest.raises(rlx.InputError, match="unknown settings"):
        rlx.optim.SGD(lr=0.1, groups=[{"params": ["*"], "betas": (0.9, 0.9)}])
    with pytest.raises(rlx.InputError, match="Nesterov"):
        rlx.optim.SGD(lr=0.1, nesterov=True)


def test_optimizer_checkpoint_resumes_bit_for_bit(tmp_path):
    data = batches(10, seed=7)

    def setup():
        m, _ = fresh(seed=4)
        o = rlx.optim.AdamW(lr=0.02, weight_decay=0.1, groups=[{"params": ["*.bias"], "weight_decay": 0.0}])
        s = rlx.optim.lr_scheduler.CosineAnnealingLR(o, T_max=10)
        return m, o, s

    m, o, s = setup()
    step = rlx.compile_train_step(loss_fn, m, o, SPEC, clip_grad_norm=0.5)
    for x, y in data:
        step(x=x, y=y)
        s.step()
    straight = m.state_dict()

    m, o, s = setup()
    step = rlx.compile_train_step(loss_fn, m, o, SPEC, clip_grad_norm=0.5)
    for x, y in data[:4]:
        step(x=x, y=y)
        s.step()
    m.save(str(tmp_path / "m.safetensors"))
    o.save(str(tmp_path / "o.safetensors"))
    sched_state = s.state_dict()
    del m, o, s, step

    m, o, s = setup()
    m.load(str(tmp_path / "m.safetensors"))
    o.load(str(tmp_path / "o.safetensors"))  # before compiling: placed at the compile
    s.load_state_dict(sched_state)
    assert o.lr == sched_state["_last_lr"][0]
    step = rlx.compile_train_step(loss_fn, m, o, SPEC, clip_grad_norm=0.5)
    assert int(o.state("fc.weight")["step"]) == 4
    for x, y in data[4:]:
        step(x=x, y=y)
        s.step()
    for k, v in straight.items():
        np.testing.assert_array_equal(m.state_dict()[k], v)  # bit for bit


def test_optimizer_state_dict_validation(tmp_path):
    m, _ = fresh()
    o = rlx.optim.Adam(lr=0.01)
    step = rlx.compile_train_step(loss_fn, m, o, SPEC)
    (x, y), = batches(1)
    step(x=x, y=y)
    sd = o.state_dict()
    assert sd["type"] == "Adam" and set(sd["state"]["fc.weight"]) == {"exp_avg", "exp_avg_sq", "step"}
    before = {k: np.array(v) for k, v in o.state("fc.bias").items()}
    bad = {**sd, "state": {**sd["state"], "fc.bias": {**sd["state"]["fc.bias"], "exp_avg": np.zeros(7)}}}
    with pytest.raises(rlx.CheckpointError, match=r"'fc.bias.exp_avg' has shape \(7,\)"):
        o.load_state_dict(bad)
    with pytest.raises(rlx.CheckpointError, match="holds 'Adam' state; this is SGD"):
        rlx.optim.SGD(lr=0.1).load_state_dict(sd)
    with pytest.raises(rlx.CheckpointError, match="does not have"):
        o.load_state_dict({**sd, "state": {"nope": {}}})
    for k, v in before.items():
        np.testing.assert_array_equal(o.state("fc.bias")[k], v)
    m.save(str(tmp_path / "model.safetensors"))
    with pytest.raises(rlx.CheckpointError, match="not an rlx optimizer checkpoint"):
        o.load(str(tmp_path / "model.safetensors"))
    o.save(str(tmp_path / "o.safetensors"))
    o2 = rlx.optim.Adam(lr=0.5)
    o2.load(str(tmp_path / "o.safetensors"))
    assert o2.lr == 0.01


# --- schedulers: PyTorch's formulas in closed form ------------------------------------------------

def lrs(sched, n):
    out = [sched.optimizer.lr]
    for _ in range(n):
        sched.step()
        out.append(sched.optimizer.lr)
    return out


def test_step_lr_and_linear_lr_formulas():
    opt = rlx.optim.SGD(lr=0.5)
    got = lrs(rlx.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.1), 10)
    np.testing.assert_allclose(got, [0.5 * 0.1 ** (t // 3) for t in range(11)], rtol=1e-12)
    opt = rlx.optim.SGD(lr=0.5)
    got = lrs(rlx.optim.lr_scheduler.LinearLR(opt, start_factor=0.2, end_factor=0.9, total_iters=4), 8)
    np.testing.assert_allclose(got, [0.5 * (0.2 + 0.7 * min(t, 4) / 4) for t in range(9)], rtol=1e-12)


def test_cosine_formula():
    opt = rlx.optim.Adam(lr=0.1)
    got = lrs(rlx.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10, eta_min=0.01), 10)
    want = [0.01 + 0.09 * (1 + math.cos(math.pi * t / 10)) / 2 for t in range(11)]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)


def test_one_cycle_and_sequential():
    opt = rlx.optim.SGD(lr=0.1, momentum=0.9)
    sched = rlx.optim.lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=100)
    assert opt.lr == pytest.approx(1.0 / 25) and opt.momentum == pytest.approx(0.95)
    got = lrs(sched, 99)
    assert max(got) == pytest.approx(1.0) and int(np.argmax(got)) == 29
    assert got[-1] == pytest.approx(1.0 / 25 / 1e4) and opt.momentum == pytest.approx(0.95)
    with pytest.raises(rlx.InputError):
        sched.step()
        sched.step()
    opt = rlx.optim.SGD(lr=1.0)
    warm = rlx.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=2)
    cos = rlx.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)
    got = lrs(rlx.optim.lr_scheduler.SequentialLR(opt, [warm, cos], milestones=[2]), 6)
    want = [0.5, 0.75] + [(1 + math.cos(math.pi * t / 4)) / 2 for t in range(5)]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)


# --- bad arguments ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,exc", [
    (dict(clip_grad_norm=0.0), rlx.InputError),
    (dict(clip_grad_norm=-1.0), rlx.InputError),
    (dict(clip_grad_norm=float("nan")), rlx.InputError),
    (dict(clip_grad_norm="1"), rlx.DTypeError),
    (dict(accumulate=0), rlx.ShapeError),
    (dict(accumulate=1.5), rlx.DTypeError),
    (dict(skip_nonfinite="yes"), rlx.InputError),
])
def test_bad_step_options_raise_before_compiling(kwargs, exc):
    model, _ = fresh()
    with pytest.raises(exc):
        rlx.compile_train_step(loss_fn, model, rlx.optim.SGD(lr=0.1), SPEC, **kwargs)


@pytest.mark.parametrize("make", [
    lambda: rlx.optim.RMSprop(alpha=1.5),
    lambda: rlx.optim.Adagrad(lr_decay=-1.0),
    lambda: rlx.optim.SGD(lr=0.1, dampening=-0.1),
    lambda: rlx.optim.SGD(lr=0.1, nesterov="yes"),
    lambda: rlx.optim.Adam(groups="*.bias"),
    lambda: rlx.optim.Adam(groups=[{"weight_decay": 0.0}]),
    lambda: rlx.optim.Adam(groups=[{"params": [3]}]),
    lambda: rlx.optim.Adam(groups=[{"params": ["*"], "lr": -1.0}]),
])
def test_bad_optimizer_settings_raise(make):
    with pytest.raises(rlx.RlxError):
        make()


def test_setting_changed_to_a_bad_value_raises_at_the_next_step_and_changes_nothing():
    model, _ = fresh()
    opt = rlx.optim.RMSprop(lr=0.01)
    step = rlx.compile_train_step(loss_fn, model, opt, SPEC)
    (x, y), = batches(1)
    step(x=x, y=y)
    before = model.state_dict()
    opt.alpha = 2.0
    with pytest.raises(rlx.InputError, match="alpha"):
        step(x=x, y=y)
    for k, v in before.items():
        np.testing.assert_array_equal(model.state_dict()[k], v)
    opt.alpha = 0.9
    step(x=x, y=y)


@pytest.mark.parametrize("make", [
    lambda o: rlx.optim.lr_scheduler.StepLR(o, step_size=0),
    lambda o: rlx.optim.lr_scheduler.CosineAnnealingLR(o, T_max=0),
    lambda o: rlx.optim.lr_scheduler.LinearLR(o, start_factor=0.0),
    lambda o: rlx.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1),
    lambda o: rlx.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=10, anneal_strategy="exp"),
    lambda o: rlx.optim.lr_scheduler.SequentialLR(o, [rlx.optim.lr_scheduler.StepLR(o, 2)], milestones=[3]),
    lambda o: rlx.optim.lr_scheduler.StepLR(object(), step_size=2),
])
def test_bad_scheduler_arguments_raise(make):
    with pytest.raises(rlx.RlxError):
        make(rlx.optim.SGD(lr=0.1))


def test_bad_state_dict_arguments_raise():
    m = Lin()
    with pytest.raises(rlx.CheckpointError):
        m.load_state_dict([("fc.weight", np.zeros((3, 4)))])
    with pytest.raises(rlx.CheckpointError):
        m.load_state_dict({1: np.zeros(3)}, strict=False)
    with pytest.raises(rlx.InputError):
        m.load_state_dict(m.state_dict(), strict="no")
    with pytest.raises(rlx.CheckpointError, match="cannot read"):
        m.load_state_dict({"fc.bias": object()}, strict=False)
    with pytest.raises(rlx.RlxError):
        rlx.nn.ModuleDict({"a.b": Lin()})
    with pytest.raises(rlx.RlxError):
        rlx.nn.ModuleList([Lin(), 3])
