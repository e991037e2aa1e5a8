"""Equivalence with PyTorch (skipped when torch is not installed): every optimizer x scheduler x
clipping x accumulation over 20 updates from the same weights; state dicts both ways."""

import numpy as np
import pytest

import rlx

torch = pytest.importorskip("torch", reason="PyTorch is not installed; these tests compare against it")

D_IN, D_H, D_OUT, B = 5, 7, 3, 8
UPDATES = 20

OPTIMIZERS = {
    "sgd": (lambda: rlx.optim.SGD(lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
    "sgd-momentum-wd-dampening": (lambda: rlx.optim.SGD(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01),
                                  lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    "sgd-nesterov": (lambda: rlx.optim.SGD(lr=0.05, momentum=0.9, nesterov=True),
                     lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True)),
    "adam-wd": (lambda: rlx.optim.Adam(lr=1e-2, weight_decay=0.01),
                lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.01)),
    "adamw": (lambda: rlx.optim.AdamW(lr=1e-2, weight_decay=0.1), lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1)),
    "rmsprop": (lambda: rlx.optim.RMSprop(lr=1e-2), lambda p: torch.optim.RMSprop(p, lr=1e-2)),
    "rmsprop-momentum-wd": (lambda: rlx.optim.RMSprop(lr=1e-2, alpha=0.9, momentum=0.5, weight_decay=0.01),
                            lambda p: torch.optim.RMSprop(p, lr=1e-2, alpha=0.9, momentum=0.5, weight_decay=0.01)),
    "adagrad": (lambda: rlx.optim.Adagrad(lr=0.1, lr_decay=0.01, weight_decay=0.01),
                lambda p: torch.optim.Adagrad(p, lr=0.1, lr_decay=0.01, weight_decay=0.01)),
}


def _sched(mod, kind, opt):
    if kind == "none":
        return None
    if kind == "step":
        return mod.StepLR(opt, step_size=3, gamma=0.5)
    if kind == "cosine":
        return mod.CosineAnnealingLR(opt, T_max=7, eta_min=1e-3)
    if kind == "linear":
        return mod.LinearLR(opt, start_factor=0.25, total_iters=6)
    if kind == "onecycle":
        return mod.OneCycleLR(opt, max_lr=0.01, total_steps=UPDATES)
    if kind == "sequential":
        warm = mod.LinearLR(opt, start_factor=0.1, total_iters=4)
        cos = mod.CosineAnnealingLR(opt, T_max=16)
        return mod.SequentialLR(opt, [warm, cos], milestones=[4])
    raise AssertionError(kind)


class MLP(rlx.nn.Module):
    def __init__(self):
        self.fc1 = rlx.nn.Linear(D_IN, D_H)
        self.fc2 = rlx.nn.Linear(D_H, D_OUT)

    def __call__(self, x):
        return self.fc2(rlx.tanh(self.fc1(x)))


def _torch_mlp(state):
    m = torch.nn.Sequential(torch.nn.Linear(D_IN, D_H), torch.nn.Tanh(), torch.nn.Linear(D_H, D_OUT))
    names = {"0.weight": "fc1.weight", "0.bias": "fc1.bias", "2.weight": "fc2.weight", "2.bias": "fc2.bias"}
    m.load_state_dict({k: torch.from_numpy(state[v].copy()) for k, v in names.items()})
    return m, names


@pytest.mark.parametrize("sched", ["none", "step", "cosine", "linear", "onecycle", "sequential"])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_training_matches_torch(opt_name, sched):
    make_rlx, make_torch = OPTIMIZERS[opt_name]
    if sched == "onecycle" and opt_name == "adagrad":
        with pytest.raises(rlx.RlxError, match="momentum"):
            _sched(rlx.optim.lr_scheduler, sched, make_rlx())
        return
    rng = np.random.default_rng(0)
    for clip in (None, 0.5):
        for k in (1, 3):
            rlx.seed(1)
            model = MLP()
            t_model, names = _torch_mlp(model.state_dict())
            opt = make_rlx()
            t_opt = make_torch(t_model.parameters())
            s, t_s = _sched(rlx.optim.lr_scheduler, sched, opt), _sched(torch.optim.lr_scheduler, sched, t_opt)
            step = rlx.compile_train_step(lambda m, x, y: rlx.mse_loss(m(x), y), model, opt,
                                          {"x": rlx.InputSpec((B, D_IN)), "y": rlx.InputSpec((B, D_OUT))},
                                          clip_grad_norm=clip, accumulate=k)
            for _ in range(UPDATES):
                t_opt.zero_grad()
                for _ in range(k):
                    x = rng.standard_normal((B, D_IN)).astype(np.float32)
                    y = rng.standard_normal((B, D_OUT)).astype(np.float32)
                    step(x=x, y=y)
                    loss = torch.nn.functional.mse_loss(t_model(torch.from_numpy(x)), torch.from_numpy(y)) / k
                    loss.backward()
                if clip is not None:
                    norm = torch.nn.utils.clip_grad_norm_(t_model.parameters(), clip)
                    assert step.grad_norm == pytest.approx(float(norm), rel=1e-4)
                t_opt.step()
                if s is not None:
                    s.step()
                    t_s.step()
                    assert s.get_last_lr()[0] == t_s.get_last_lr()[0]
            got = model.state_dict()
            for tn, rn in names.items():
                want = t_model.state_dict()[tn].numpy()
                diff = np.abs(got[rn] - want).max()
                assert diff <= 1e-5, f"{opt_name} {sched} clip={clip} accumulate={k}: {rn} differs by {diff}"


def test_frozen_and_unused_parameters_match_torch():
    """A frozen parameter and one the loss does not use get no update and no decay (as PyTorch
    skips parameters without a gradient)."""
    rlx.seed(2)
    model = MLP()
    model.unused = rlx.nn.Parameter(np.ones(4, np.float32))
    model.fc1.bias.requires_grad = False
    opt = rlx.optim.AdamW(lr=0.1, weight_decay=0.5)
    step = rlx.compile_train_step(lambda m, x, y: rlx.mse_loss(m(x), y), model, opt,
                                  {"x": rlx.InputSpec((B, D_IN)), "y": rlx.InputSpec((B, D_OUT))})
    before = model.state_dict()
    t_model, names = _torch_mlp(before)
    t_model[0].bias.requires_grad_(False)
    t_unused = torch.nn.Parameter(torch.ones(4))
    t_opt = torch.optim.AdamW([p for p in t_model.parameters() if p.requires_grad] + [t_unused], lr=0.1, weight_decay=0.5)
    rng = np.random.default_rng(3)
    for _ in range(5):
        x = rng.standard_normal((B, D_IN)).astype(np.float32)
        y = rng.standard_normal((B, D_OUT)).astype(np.float32)
        step(x=x, y=y)
        t_opt.zero_grad()
        torch.nn.functional.mse_loss(t_model(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        t_opt.step()
    after = model.state_dict()
    np.testing.assert_array_equal(after["unused"], before["unused"])
    np.testing.assert_array_equal(after["fc1.bias"], before["fc1.bias"])
    np.testing.assert_array_equal(t_unused.detach().numpy(), np.ones(4, np.float32))
    for tn, rn in names.items():
        np.testing.assert_allclose(after[rn], t_model.state_dict()[tn].numpy(), atol=1e-5)
    assert "fc1.bias" not in step.grads and int(opt.state("unused")["step"]) == 0


def test_state_dict_round_trips_with_torch(tmp_path):
    st = pytest.importorskip("safetensors.torch", reason="safetensors is not installed")
    t_model = torch.nn.Sequential(torch.nn.Linear(D_IN, D_H), torch.nn.Tanh(), torch.nn.Linear(D_H, D_H))
    model = rlx.nn.Sequential(rlx.nn.Linear(D_IN, D_H), rlx.nn.Tanh() if hasattr(rlx.nn, "Tanh") else rlx.nn.ReLU(),
                              rlx.nn.Linear(D_H, D_H))
    # torch tensors straight in; a square layer must not come out transposed.
    model.load_state_dict(t_model.state_dict())
    for k, v in t_model.state_dict().items():
        np.testing.assert_array_equal(model.state_dict()[k], v.numpy())
    # bf16 / f16 files from safetensors.torch load into the float32 model by casting.
    for dtype in (torch.bfloat16, torch.float16):
        path = tmp_path / f"m-{dtype}.safetensors"
        st.save_file({k: v.to(dtype).contiguous() for k, v in t_model.state_dict().items()}, str(path))
        model.load(str(path))
        for k, v in t_model.state_dict().items():
            np.testing.assert_array_equal(model.state_dict()[k], v.to(dtype).float().numpy())
    # rlx's own file loads back into PyTorch unchanged.
    path = tmp_path / "rlx.safetensors"
    model.save(str(path))
    back = st.load_file(str(path))
    t2 = torch.nn.Sequential(torch.nn.Linear(D_IN, D_H), torch.nn.Tanh(), torch.nn.Linear(D_H, D_H))
    t2.load_state_dict(back)
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(t2.state_dict()[k].numpy(), v)


SCHEDULES = {
    "step": lambda m, o: m.StepLR(o, step_size=4, gamma=0.3),
    "cosine-past-tmax": lambda m, o: m.CosineAnnealingLR(o, T_max=6, eta_min=0.01),
    "linear-default": lambda m, o: m.LinearLR(o),
    "linear-down": lambda m, o: m.LinearLR(o, start_factor=1.0, end_factor=0.1, total_iters=10),
    "onecycle-linear": lambda m, o: m.OneCycleLR(o, max_lr=0.5, total_steps=40, anneal_strategy="linear"),
    "onecycle-three-phase": lambda m, o: m.OneCycleLR(o, max_lr=0.5, epochs=4, steps_per_epoch=10, three_phase=True,
                                                      pct_start=0.25, div_factor=10.0, final_div_factor=100.0),
    "sequential-3": lambda m, o: m.SequentialLR(o, [m.LinearLR(o, start_factor=0.2, total_iters=3),
                                                    m.StepLR(o, step_size=5, gamma=0.5),
                                                    m.CosineAnnealingLR(o, T_max=10)], milestones=[3, 15]),
}


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_schedules_match_torch_exactly(name, opt):
    p = torch.nn.Parameter(torch.zeros(2))
    if opt == "sgd":
        o, t_o = rlx.optim.SGD(lr=0.2, momentum=0.9), torch.optim.SGD([p], lr=0.2, momentum=0.9)
    else:
        o, t_o = rlx.optim.Adam(lr=0.2), torch.optim.Adam([p], lr=0.2)
    s, t_s = SCHEDULES[name](rlx.optim.lr_scheduler, o), SCHEDULES[name](torch.optim.lr_scheduler, t_o)
    for _ in range(39):
        assert o.lr == t_o.param_groups[0]["lr"]  # bit for bit, float64
        if opt == "sgd":
            assert o.momentum == t_o.param_groups[0]["momentum"]
        else:
            assert tuple(o.betas) == tuple(t_o.param_groups[0]["betas"])
        t_o.step()
        s.step()
        t_s.step()


def test_group_learning_rates_follow_the_schedule_like_torch():
    o = rlx.optim.SGD(lr=0.1, groups=[{"params": ["*.bias"], "lr": 0.02}])
    w, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    t_o = torch.optim.SGD([{"params": [w]}, {"params": [b], "lr": 0.02}], lr=0.1)
    s = rlx.optim.lr_scheduler.CosineAnnealingLR(o, T_max=8)
    t_s = torch.optim.lr_scheduler.CosineAnnealingLR(t_o, T_max=8)
    for _ in range(10):
        assert [o.lr, o.groups[0]["lr"]] == [g["lr"] for g in t_o.param_groups]
        t_o.step()
        s.step()
        t_s.step()
