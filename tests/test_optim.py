"""Optimizers: SGD / Adam / AdamW against a numpy implementation of torch.optim's update rules."""

import numpy as np
import pytest

import rlx
from conftest import assert_close
from models import LinearNet, mse_loss

N, D_IN, D_OUT = 8, 5, 3
N_STEPS = 5


def Net():
    return LinearNet(D_IN, D_OUT)


loss_fn = mse_loss


INPUTS = {"x": rlx.InputSpec((N, D_IN)), "y": rlx.InputSpec((N, D_OUT))}


def batches(seed=0, n=N_STEPS, dims=(D_IN, D_OUT)):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((N, dims[0])).astype(np.float32),
             rng.standard_normal((N, dims[1])).astype(np.float32)) for _ in range(n)]


def ref_loss_and_grads(p, x, y):
    """mean((x @ W + b - y)^2) and its analytic gradients, float64."""
    x, y = x.astype(np.float64), y.astype(np.float64)
    r = x @ p["fc.weight"].T + p["fc.bias"] - y
    d = 2.0 * r / r.size
    return float(np.mean(r * r)), {"fc.weight": d.T @ x, "fc.bias": d.sum(axis=0)}


class RefOptimizer:
    """torch.optim.SGD / Adam / AdamW semantics in float64 numpy."""

    def __init__(self, kind, lr, momentum=0.0, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8):
        self.kind, self.lr, self.momentum, self.wd = kind, lr, momentum, weight_decay
        self.b1, self.b2 = betas
        self.eps = eps
        self.state = {}

    def step(self, params, grads):
        for k in params:
            p, g = params[k], grads[k].copy()
            st = self.state.setdefault(k, {})
            if self.kind == "sgd":
                if self.wd:
                    g = g + self.wd * p
                if self.momentum:
                    if "momentum_buffer" not in st:
                        st["momentum_buffer"] = g.copy()  # torch: buffer = grad on first step
                    else:
                        st["momentum_buffer"] = self.momentum * st["momentum_buffer"] + g
                    g = st["momentum_buffer"]
                params[k] = p - self.lr * g
            else:
                if self.kind == "adamw":
                    p = p * (1.0 - self.lr * self.wd)  # decoupled weight decay first
                t = st.get("step", 0) + 1
                st["step"] = t
                m = self.b1 * st.get("exp_avg", 0.0) + (1 - self.b1) * g
                v = self.b2 * st.get("exp_avg_sq", 0.0) + (1 - self.b2) * g * g
                st["exp_avg"], st["exp_avg_sq"] = m, v
                m_hat = m / (1 - self.b1**t)
                v_hat = v / (1 - self.b2**t)
                params[k] = p - self.lr * m_hat / (np.sqrt(v_hat) + self.eps)


# (id, rlx optimizer factory, reference factory)
CONFIGS = [
    ("sgd", lambda: rlx.optim.SGD(lr=0.1), lambda: RefOptimizer("sgd", 0.1)),
    ("sgd-momentum", lambda: rlx.optim.SGD(lr=0.05, momentum=0.9),
     lambda: RefOptimizer("sgd", 0.05, momentum=0.9)),
    ("sgd-wd", lambda: rlx.optim.SGD(lr=0.1, weight_decay=0.1),
     lambda: RefOptimizer("sgd", 0.1, weight_decay=0.1)),
    ("sgd-momentum-wd", lambda: rlx.optim.SGD(lr=0.05, momentum=0.8, weight_decay=0.05),
     lambda: RefOptimizer("sgd", 0.05, momentum=0.8, weight_decay=0.05)),
    ("adam-defaults", lambda: rlx.optim.Adam(), lambda: RefOptimizer("adam", 1e-3)),
    ("adam", lambda: rlx.optim.Adam(lr=0.02, betas=(0.8, 0.99), eps=1e-6),
     lambda: RefOptimizer("adam", 0.02, betas=(0.8, 0.99), eps=1e-6)),
    ("adamw-defaults", lambda: rlx.optim.AdamW(),
     lambda: RefOptimizer("adamw", 1e-3, weight_decay=0.01)),
    ("adamw", lambda: rlx.optim.AdamW(lr=0.05, betas=(0.85, 0.995), eps=1e-7, weight_decay=0.2),
     lambda: RefOptimizer("adamw", 0.05, weight_decay=0.2, betas=(0.85, 0.995), eps=1e-7)),
]


def run_both(make_opt, make_ref, lr_schedule=None, seed=0, dims=(D_IN, D_OUT)):
    """Run N_STEPS in rlx and in the reference, checking loss, grads and params at every step."""
    rlx.seed(seed)
    model = LinearNet(*dims)
    inputs = {"x": rlx.InputSpec((N, dims[0])), "y": rlx.InputSpec((N, dims[1]))}
    params = {k: p.numpy().astype(np.float64) for k, p in model.parameters().items()}
    assert list(params) == ["fc.weight", "fc.bias"]
    opt, ref = make_opt(), make_ref()
    step = rlx.compile_train_step(loss_fn, model, opt, inputs)
    for i, (x, y) in enumerate(batches(seed, dims=dims)):
        if lr_schedule is not None:
            opt.lr = ref.lr = lr_schedule[i]
        loss = step(x=x, y=y)
        ref_loss, grads = ref_loss_and_grads(params, x, y)
        assert isinstance(loss, float)
        assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6, err_msg=f"loss at step {i}")
        for k in grads:
            assert_close(step.grads[k], grads[k], rtol=1e-4, atol=1e-6,
                         err_msg=f"grad {k} at step {i}")
        ref.step(params, grads)
        for k, p in model.parameters().items():
            assert_close(p.numpy(), params[k], rtol=2e-4, atol=2e-6,
                         err_msg=f"param {k} after step {i}")
    return model, opt, ref


@pytest.mark.parametrize("name,make_opt,make_ref", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_optimizer_matches_torch_rules(name, make_opt, make_ref):
    model, opt, ref = run_both(make_opt, make_ref)
    # the parameters really moved (a no-op optimizer would pass the checks only at lr=0)
    rlx.seed(0)
    init = {k: p.numpy().copy() for k, p in Net().parameters().items()}
    assert not np.allclose(model.parameters()["fc.weight"].numpy(), init["fc.weight"],
                           rtol=0, atol=1e-5)


@pytest.mark.parametrize("name,make_opt,make_ref",
                         [c for c in CONFIGS if c[0] in ("sgd-momentum", "sgd-momentum-wd")],
                         ids=["sgd-momentum", "sgd-momentum-wd"])
def test_sgd_momentum_state(name, make_opt, make_ref):
    model, opt, ref = run_both(make_opt, make_ref)
    for k in model.parameters():
        st = opt.state(k)
        assert_close(st["momentum_buffer"], ref.state[k]["momentum_buffer"], rtol=2e-4, atol=1e-6)


@pytest.mark.parametrize("name,make_opt,make_ref",
                         [c for c in CONFIGS if c[0].startswith("adam")],
                         ids=[c[0] for c in CONFIGS if c[0].startswith("adam")])
def test_adam_state(name, make_opt, make_ref):
    model, opt, ref = run_both(make_opt, make_ref)
    for k in model.parameters():
        st = opt.state(k)
        assert {"exp_avg", "exp_avg_sq", "step"} <= set(st)
        assert_close(st["exp_avg"], ref.state[k]["exp_avg"], rtol=2e-4, atol=1e-7)
        assert_close(st["exp_avg_sq"], ref.state[k]["exp_avg_sq"], rtol=2e-4, atol=1e-9)
        step_count = np.asarray(st["step"]).reshape(-1)
        assert step_count.size == 1 and int(step_count[0]) == N_STEPS


@pytest.mark.parametrize("kind", ["sgd-momentum", "adam", "adamw"])
def test_lr_change_between_steps_takes_effect(kind):
    cfg = {c[0]: c for c in CONFIGS}[kind]
    schedule = [cfg[2]().lr] * 2 + [0.003, 0.0, 0.2]
    run_both(cfg[1], cfg[2], lr_schedule=schedule)


# 39,000 weights: the CPU shares the update of a large model between its threads in pieces of
# 8K elements (the last one partial); piece boundaries and SGD's first-step flag must not show.
LARGE = (300, 130)


@pytest.mark.parametrize("kind", ["sgd-momentum", "sgd-momentum-wd"])
def test_large_parameters_update_in_pieces(kind):
    cfg = {c[0]: c for c in CONFIGS}[kind]
    run_both(cfg[1], cfg[2], dims=LARGE)


LARGE_SCRIPT = """
import sys, numpy as np, rlx
sys.path.insert(0, {tests!r})
from models import LinearNet, mse_loss
from test_optim import batches, N
out = {{}}
for name, opt in [("sgd", rlx.optim.SGD(lr=0.05, momentum=0.9, nesterov=True)),
                  ("adam", rlx.optim.Adam(lr=0.02, weight_decay=0.1)),
                  ("adamw", rlx.optim.AdamW(lr=0.05, weight_decay=0.2))]:
    rlx.seed(0)
    model = LinearNet(*{dims})
    specs = {{"x": rlx.InputSpec((N, {dims}[0])), "y": rlx.InputSpec((N, {dims}[1]))}}
    step = rlx.compile_train_step(mse_loss, model, opt, specs)
    for x, y in batches(0, dims={dims}):
        step(x=x, y=y)
    for k, p in model.parameters().items():
        out[name + "/" + k] = p.numpy().copy()
        for s, v in opt.state(k).items():
            out[name + "/" + k + "/" + s] = np.asarray(v).copy()
np.savez(sys.argv[1], **out)
"""


def test_large_update_is_the_same_on_one_thread_and_two(tmp_path):
    # Adam's first steps divide by sqrt(v) of tiny gradients, so a float64 reference differs in
    # a few elements; the split update must instead be bit-identical to the one-thread update.
    import os
    import subprocess
    import sys
    script = LARGE_SCRIPT.format(tests=os.path.dirname(__file__), dims=LARGE)
    results = []
    for threads in ("1", "2"):
        path = tmp_path / f"t{threads}.npz"
        env = dict(os.environ, RLX_NUM_THREADS=threads)
        subprocess.run([sys.executable, "-c", script, str(path)], env=env, check=True, timeout=120)
        results.append(np.load(path))
    one, two = results
    assert sorted(one.files) == sorted(two.files) and len(one.files) > 6
    for k in one.files:
        np.testing.assert_array_equal(one[k], two[k], err_msg=k)


def test_lr_attribute_round_trip():
    opt = rlx.optim.SGD(lr=0.1)
    assert opt.lr == pytest.approx(0.1)
    opt.lr = 0.025
    assert opt.lr == pytest.approx(0.025)
    assert rlx.optim.Adam().lr == pytest.approx(1e-3)
    assert rlx.optim.AdamW().lr == pytest.approx(1e-3)


def test_lr_zero_leaves_params_unchanged_after_compiled_change():
    rlx.seed(0)
    model = Net()
    opt = rlx.optim.Adam(lr=0.05)
    step = rlx.compile_train_step(loss_fn, model, opt, INPUTS)
    (x, y), = batches(1, n=1)
    step(x=x, y=y)
    opt.lr = 0.0
    before = {k: p.numpy().copy() for k, p in model.parameters().items()}
    step(x=x, y=y)
    for k, p in model.parameters().items():
        np.testing.assert_array_equal(p.numpy(), before[k])


def test_state_before_compile_raises():
    rlx.seed(0)
    model = Net()
    opt = rlx.optim.Adam(lr=0.01)
    with pytest.raises(rlx.RlxError):
        opt.state("fc.weight")
    sgd = rlx.optim.SGD(lr=0.1, momentum=0.9)
    with pytest.raises(rlx.RlxError):
        sgd.state("fc.weight")
    del model


def test_training_reduces_loss():
    rlx.seed(0)
    model = Net()
    x, y = batches(2, n=1)[0]
    # a target the model can fit exactly: a fixed linear map of x
    y = (x @ np.random.default_rng(3).standard_normal((D_IN, D_OUT))).astype(np.float32)
    step = rlx.compile_train_step(loss_fn, model, rlx.optim.SGD(lr=0.1, momentum=0.9), INPUTS)
    losses = [step(x=x, y=y) for _ in range(100)]
    assert losses[-1] < 0.01 * losses[0]
