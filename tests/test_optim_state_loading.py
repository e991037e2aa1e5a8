"""Loading optimizer and scheduler state: every bad state dict or file is a CheckpointError that
names what is wrong, and a failed load changes nothing (for an optimizer shared by several models,
none of their states); saving with an invalid setting is refused without writing; a valid
state_dict() -> load_state_dict() round trip works for every scheduler."""

import copy
import warnings

import numpy as np
import pytest

import rlx

L = rlx.optim.lr_scheduler


class Lin(rlx.nn.Module):
    def __init__(self, n_in):
        self.fc = rlx.nn.Linear(n_in, 2)

    def __call__(self, x):
        return self.fc(x)


def loss_fn(m, x, y):
    return rlx.mse_loss(m(x), y)


def compiled(n_in, opt, seed=0):
    """A Lin(n_in) model trained one step with ``opt``; returns the step function."""
    rlx.seed(seed)
    m = Lin(n_in)
    step = rlx.compile_train_step(loss_fn, m, opt, {"x": rlx.InputSpec((4, n_in)), "y": rlx.InputSpec((4, 2))})
    run(step, n_in, seed)
    return step


def run(step, n_in, seed=0):
    rng = np.random.default_rng(seed)
    step(x=rng.standard_normal((4, n_in)).astype(np.float32), y=rng.standard_normal((4, 2)).astype(np.float32))


def snapshot(opt):
    """Every bit of the optimizer: settings, groups, each state store's bytes, pending state."""
    stores = {id(st): {n: bytes(st.read(n)) for n, _, _ in st.entries()} for _, st in opt._states.values()}
    pending = None if opt._pending is None else {
        p: {k: np.array(v).tobytes() for k, v in d.items()} for p, d in opt._pending["state"].items()}
    return repr(opt), copy.deepcopy(opt.groups), stores, pending


# --- an optimizer shared by two models --------------------------------------------------------------

def test_shared_optimizer_load_is_all_or_nothing(tmp_path):
    opt = rlx.optim.Adam(lr=0.01)
    step_a = compiled(3, opt)  # A's state is checked (and was written) first
    sd = opt.state_dict()
    assert sd["state"]["fc.weight"]["exp_avg"].shape == (2, 3)
    opt.save(str(tmp_path / "a.safetensors"))
    step_b = compiled(5, opt)
    sd["settings"]["lr"] = 0.5
    for d in sd["state"].values():
        d["exp_avg"] = d["exp_avg"] + 1.0
        d["step"] = np.int32(7)
    run(step_a, 3, seed=1)  # A's state moves on from the file's
    run(step_b, 5, seed=1)
    before = snapshot(opt)
    with pytest.raises(rlx.CheckpointError, match=r"'fc.weight.exp_avg' has shape \(2, 3\); the model's is \(2, 5\)"):
        opt.load_state_dict(sd)
    assert snapshot(opt) == before  # model A's state is untouched too
    with pytest.raises(rlx.CheckpointError, match=r"'fc.weight.exp_avg' has shape \(2, 3\); the model's is \(2, 5\)"):
        opt.load(str(tmp_path / "a.safetensors"))
    assert snapshot(opt) == before
    assert opt.lr == 0.01


def test_shared_optimizer_load_fitting_both_models_writes_both():
    opt = rlx.optim.Adam(lr=0.01)
    compiled(5, opt)
    compiled(3, opt)
    bias = {"exp_avg": np.full(2, 0.25, np.float32), "exp_avg_sq": np.full(2, 0.5, np.float32), "step": 3}
    opt.load_state_dict({"type": "Adam", "settings": {"lr": 0.02}, "groups": [], "state": {"fc.bias": bias}})
    assert opt.lr == 0.02
    for _, store in opt._states.values():
        got = {n: np.frombuffer(store.read(n), np.int32 if n.endswith(".step") else np.float32)
               for n, _, _ in store.entries() if n != "hyper"}
        np.testing.assert_array_equal(got["fc.bias.exp_avg"], 0.25)
        np.testing.assert_array_equal(got["fc.bias.step"], 3)
        np.testing.assert_array_equal(got["fc.weight.exp_avg"], 0.0)  # absent: fresh zero state
        np.testing.assert_array_equal(got["fc.weight.step"], 0)


# --- bad values ---------------------------------------------------------------------------------------

@pytest.fixture
def trained():
    opt = rlx.optim.Adam(lr=0.01)
    compiled(3, opt)
    return opt, opt.state_dict()


@pytest.mark.parametrize("step", [2.7, float("nan"), float("inf"), 2**40, -5, np.int64(2**31), [1]])
def test_bad_step_is_refused(trained, step):
    opt, sd = trained
    bad = copy.deepcopy(sd)
    bad["state"]["fc.weight"]["step"] = step
    before = snapshot(opt)
    with pytest.raises(rlx.CheckpointError) as e:
        opt.load_state_dict(bad)
    assert "'fc.weight.step'" in str(e.value)
    assert "whole number in [0, 2147483647]" in str(e.value) or "has shape" in str(e.value)
    assert snapshot(opt) == before


@pytest.mark.parametrize("step", [4, 4.0, np.float32(4.0), np.int64(4), np.array(4, np.uint8)])
def test_whole_step_of_any_real_dtype_loads(trained, step):
    opt, sd = trained
    sd["state"]["fc.weight"]["step"] = step
    opt.load_state_dict(sd)
    assert int(opt.state("fc.weight")["step"]) == 4


@pytest.mark.parametrize("value, words", [
    (np.full((2, 3), 1 + 2j), "must hold real numbers, got dtype complex128"),
    (np.array([[1, 2, 3], [4, 5, None]], dtype=object), "must hold real numbers, got dtype object"),
    (np.array([["a", "b", "c"], ["d", "e", "f"]]), "must hold real numbers, got dtype <U1"),
    ([[1, 2, 3], [4, 5, "x"]], "must hold real numbers"),
    ([[1, 2, 3], [4, 5]], "is not an array of numbers"),
    (np.full((2, 3), 1e300), "beyond the range of float32"),
    ("abc", "must hold real numbers"),
])
def test_bad_state_array_is_refused(trained, value, words):
    opt, sd = trained
    bad = copy.deepcopy(sd)
    bad["state"]["fc.weight"]["exp_avg"] = value
    before = snapshot(opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an error, not a ComplexWarning and a truncated value
        with pytest.raises(rlx.CheckpointError, match="'fc.weight.exp_avg'") as e:
            opt.load_state_dict(bad)
    assert words in str(e.value)
    assert snapshot(opt) == before


def test_bad_values_refused_before_compile_too():
    opt = rlx.optim.Adam(lr=0.01)
    sd = {"type": "Adam", "settings": {}, "groups": [],
          "state": {"fc.weight": {"exp_avg": np.zeros((2, 3)), "exp_avg_sq": np.zeros((2, 3)), "step": 2.5}}}
    with pytest.raises(rlx.CheckpointError, match=r"'fc.weight.step' must be a whole number"):
        opt.load_state_dict(sd)
    sd["state"]["fc.weight"]["step"] = 2
    sd["state"]["fc.weight"]["exp_avg"] = np.zeros((2, 3), np.complex64)
    with pytest.raises(rlx.CheckpointError, match=r"'fc.weight.exp_avg' must hold real numbers"):
        opt.load_state_dict(sd)
    sd["state"]["fc.weight"]["exp_avg"] = np.zeros((2, 3))
    sd["state"]["fc.weight"]["bogus"] = np.zeros((2, 3))
    with pytest.raises(rlx.CheckpointError, match=r"'fc.weight' has unknown state \['bogus'\]"):
        opt.load_state_dict(sd)
    assert opt._pending is None and opt.state_dict()["state"] == {}
    del sd["state"]["fc.weight"]["bogus"]
    opt.load_state_dict(sd)  # valid: kept and placed at the compile
    compiled(3, opt)
    assert int(opt.state("fc.weight")["step"]) == 3


# --- malformed structure ----------------------------------------------------------------------------

@pytest.mark.parametrize("change, words", [
    ({"groups": "x"}, "'groups' must be a list of dicts, got str"),
    ({"groups": ["x"]}, "group 0 must be a dict"),
    ({"groups": [{1: 2}]}, "group 0 must be a dict"),
    ({"groups": [{"params": 3}]}, "bad settings"),
    ({"settings": "x"}, "'settings' must be a dict"),
    ({"settings": {"lr": "fast"}}, "bad settings"),
    ({"settings": {7: 1}}, "unknown settings [7]"),
    ({"state": "x"}, "'state' must map parameter names to dicts, got str"),
    ({"state": {"fc.weight": 3}}, "'state' must map parameter names to dicts of arrays"),
    ({"state": {1: {}}}, "'state' must map parameter names to dicts of arrays"),
])
def test_malformed_structure_is_refused(trained, change, words):
    opt, sd = trained
    before = snapshot(opt)
    with pytest.raises(rlx.CheckpointError) as e:
        opt.load_state_dict({**sd, **change})
    assert words in str(e.value)
    assert snapshot(opt) == before


@pytest.mark.parametrize("bad", [None, "x", [("state", {})], {"type": "Adam"}])
def test_not_a_state_dict_is_refused(trained, bad):
    opt, _ = trained
    before = snapshot(opt)
    with pytest.raises(rlx.CheckpointError, match=r"expects a dict from Optimizer.state_dict\(\)"):
        opt.load_state_dict(bad)
    assert snapshot(opt) == before


def test_groups_none_means_no_groups(trained):
    opt, sd = trained
    opt.load_state_dict({**sd, "groups": None})
    assert opt.groups == []


# --- saving with an invalid setting -------------------------------------------------------------------

def test_save_with_invalid_setting_is_refused_without_writing(trained, tmp_path):
    opt, sd = trained
    before = snapshot(opt)
    opt.lr = -1
    path = tmp_path / "o.safetensors"
    with pytest.raises(rlx.InputError, match=r"lr must be .*got -1.*set a valid value first"):
        opt.state_dict()
    with pytest.raises(rlx.InputError, match="set a valid value first"):
        opt.save(str(path))
    assert not path.exists()
    opt.lr = 0.01
    assert snapshot(opt) == before
    opt.save(str(path))  # once the setting is valid again, the state saves and loads
    o2 = rlx.optim.Adam(lr=0.3)
    o2.load(str(path))
    assert o2.lr == 0.01
    np.testing.assert_array_equal(o2.state_dict()["state"]["fc.weight"]["exp_avg"], sd["state"]["fc.weight"]["exp_avg"])


# --- schedulers ---------------------------------------------------------------------------------------

def make_sched(kind, opt):
    if kind == "StepLR":
        return L.StepLR(opt, step_size=2, gamma=0.5)
    if kind == "CosineAnnealingLR":
        return L.CosineAnnealingLR(opt, T_max=6, eta_min=0.001)
    if kind == "LinearLR":
        return L.LinearLR(opt, start_factor=0.2, total_iters=4)
    if kind == "OneCycleLR":
        return L.OneCycleLR(opt, max_lr=0.1, total_steps=12)
    if kind == "SequentialLR":
        warm = L.LinearLR(opt, start_factor=0.1, total_iters=3)
        cos = L.CosineAnnealingLR(opt, T_max=8)
        return L.SequentialLR(opt, [warm, cos], milestones=[3])
    raise AssertionError(kind)


KINDS = ["StepLR", "CosineAnnealingLR", "LinearLR", "OneCycleLR", "SequentialLR"]


def sched_snapshot(s):
    return copy.deepcopy(s.state_dict()), s.optimizer.lr, s.optimizer.momentum


@pytest.mark.parametrize("kind", KINDS)
def test_scheduler_round_trip(kind):
    o1 = rlx.optim.SGD(lr=0.05, momentum=0.9)
    s1 = make_sched(kind, o1)
    for _ in range(4):
        s1.step()
    saved_opt, saved = o1.state_dict(), copy.deepcopy(s1.state_dict())
    o2 = rlx.optim.SGD(lr=0.05, momentum=0.9)
    s2 = make_sched(kind, o2)
    o2.load_state_dict(saved_opt)
    s2.load_state_dict(saved)
    assert s2.get_last_lr() == s1.get_last_lr()
    for _ in range(5):
        s1.step()
        s2.step()
        assert s2.get_last_lr() == s1.get_last_lr()
        assert (o2.lr, o2.momentum) == (o1.lr, o1.momentum)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bad, words", [
    (None, "expects a dict from {kind}.state_dict(), got NoneType"),
    ([1, 2], "expects a dict from {kind}.state_dict(), got list"),
    ({"foo": 1}, "does not match {kind}.state_dict(): unknown keys ['foo']; missing keys"),
    ("extra", "does not match {kind}.state_dict(): unknown keys ['foo']"),
    ("last_epoch", "'last_epoch' must be an int >= -1, got str 'x'"),
    ("base_lrs", "'base_lrs' must be a list of 1, got NoneType None"),
])
def test_scheduler_bad_state_is_refused(kind, bad, words):
    opt = rlx.optim.SGD(lr=0.05, momentum=0.9)
    s = make_sched(kind, opt)
    s.step()
    sd = s.state_dict()
    if bad == "extra":
        bad = {**sd, "foo": 1}
    elif bad == "last_epoch":
        bad = {**sd, "last_epoch": "x"}
    elif bad == "base_lrs":
        if kind == "SequentialLR":  # its base_lrs live in the sub-schedulers
            bad = {**sd, "_schedulers": [{**sd["_schedulers"][0], "base_lrs": None}, sd["_schedulers"][1]]}
            kind = "LinearLR"
        else:
            bad = {**sd, "base_lrs": None}
    before = sched_snapshot(s)
    with pytest.raises(rlx.CheckpointError) as e:
        s.load_state_dict(bad)
    assert f"[{kind} state]" in str(e.value)
    assert words.format(kind=kind) in str(e.value)
    assert sched_snapshot(s) == before


def test_sequential_lr_bad_sub_state_changes_nothing():
    opt = rlx.optim.SGD(lr=0.05)
    s = make_sched("SequentialLR", opt)
    for _ in range(2):
        s.step()
    sd = copy.deepcopy(s.state_dict())
    for _ in range(2):
        s.step()
    before = sched_snapshot(s)
    subs_before = [copy.deepcopy(sub.state_dict()) for sub in s._schedulers]
    bad = {**sd, "_schedulers": [sd["_schedulers"][0], {**sd["_schedulers"][1], "T_max": 0}]}
    with pytest.raises(rlx.CheckpointError, match=r"\[CosineAnnealingLR state\] 'T_max' must be an int >= 1, got int 0"):
        s.load_state_dict(bad)
    with pytest.raises(rlx.CheckpointError, match=r"'_schedulers' must be a list of 2 scheduler states"):
        s.load_state_dict({**sd, "_schedulers": sd["_schedulers"][:1]})
    assert sched_snapshot(s) == before
    assert [sub.state_dict() for sub in s._schedulers] == subs_before
    s.load_state_dict(sd)  # the valid one still loads, sub-schedulers included
    assert s.last_epoch == sd["last_epoch"] and s._schedulers[0].last_epoch == sd["_schedulers"][0]["last_epoch"]


def test_scheduler_load_copies_the_state():
    opt = rlx.optim.SGD(lr=0.05)
    s = make_sched("StepLR", opt)
    sd = s.state_dict()
    s2 = make_sched("StepLR", rlx.optim.SGD(lr=0.05))
    s2.load_state_dict(sd)
    sd["base_lrs"].append(1.0)  # changing the dict afterwards does not reach the scheduler
    assert s2.base_lrs == [0.05]


@pytest.mark.parametrize("make", [
    lambda: rlx.optim.SGD(lr=0.1),
    lambda: rlx.optim.SGD(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    lambda: rlx.optim.Adam(lr=0.01),
    lambda: rlx.optim.AdamW(lr=0.01, weight_decay=0.1),
    lambda: rlx.optim.RMSprop(lr=0.01, momentum=0.5),
    lambda: rlx.optim.Adagrad(lr=0.1),
], ids=["sgd", "sgd-momentum", "adam", "adamw", "rmsprop", "adagrad"])
@pytest.mark.parametrize("via", ["state_dict", "file"])
def test_every_optimizer_resumes_bit_for_bit_from_its_saved_state(make, via, tmp_path):
    """Train 3 steps, save, load into fresh objects, train 3 more: the same bits as 6 steps (SGD's
    momentum flag once made its saved state unloadable)."""
    rng = np.random.default_rng(0)
    batches = [(rng.standard_normal((4, 3)).astype(np.float32), rng.standard_normal((4, 2)).astype(np.float32))
               for _ in range(6)]
    spec = {"x": rlx.InputSpec((4, 3)), "y": rlx.InputSpec((4, 2))}

    def fresh():
        rlx.seed(0)
        return rlx.nn.Linear(3, 2), make()

    def compiled(m, o):
        return rlx.compile_train_step(lambda m, x, y: rlx.mse_loss(m(x), y), m, o, spec)

    m, o = fresh()
    step = compiled(m, o)
    whole = [step(x=x, y=y) for x, y in batches]
    m, o = fresh()
    step = compiled(m, o)
    part = [step(x=x, y=y) for x, y in batches[:3]]
    m2, o2 = fresh()
    if via == "file":
        m.save(str(tmp_path / "m.safetensors"))
        o.save(str(tmp_path / "o.safetensors"))
        m2.load(str(tmp_path / "m.safetensors"))
        o2.load(str(tmp_path / "o.safetensors"))
    else:
        m2.load_state_dict(m.state_dict())
        o2.load_state_dict(o.state_dict())
    step = compiled(m2, o2)
    part += [step(x=x, y=y) for x, y in batches[3:]]
    assert part == whole
