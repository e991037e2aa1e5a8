"""End to end: the digits MLP of the benchmark anchors (64-256-256-10, relu, cross-entropy,
Adam lr 1e-3, batch 64, 10 epochs, last partial batch kept), trained with rlx and checked against
a float64 numpy reference for the first epoch and a test-accuracy floor."""

import numpy as np
import pytest

import rlx
from conftest import assert_close

SIZES = (64, 256, 256, 10)
BATCH = 64
EPOCHS = 10
LR = 1e-3
SEED = 0


def digits_split():
    """sklearn digits, X/16 float32, 80/20 split (random_state=0, stratified): 1437 / 360 rows."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    X = (d.data / 16.0).astype(np.float32)
    y = d.target.astype(np.int64)
    Xtr, Xte, ytr, yte = train_test_split(X, y, test_size=0.2, random_state=0, stratify=y)
    return Xtr, ytr, Xte, yte


def epoch_batches(n, batch, epoch, seed=SEED):
    perm = np.random.default_rng(seed + epoch).permutation(n)
    return [perm[i:i + batch] for i in range(0, n, batch)]


class MLP(rlx.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = rlx.nn.Linear(SIZES[0], SIZES[1])
        self.fc2 = rlx.nn.Linear(SIZES[1], SIZES[2])
        self.fc3 = rlx.nn.Linear(SIZES[2], SIZES[3])

    def __call__(self, x):
        h = rlx.relu(self.fc1(x))
        h = rlx.relu(self.fc2(h))
        return self.fc3(h)


def loss_fn(m, x, y):
    return rlx.cross_entropy(m(x), y)


# ----------------------------------------------------------------------------------------------
# numpy reference (float64)
# ----------------------------------------------------------------------------------------------
def np_forward(p, x):
    h1 = np.maximum(x @ p["fc1.weight"].T + p["fc1.bias"], 0.0)
    h2 = np.maximum(h1 @ p["fc2.weight"].T + p["fc2.bias"], 0.0)
    return h2 @ p["fc3.weight"].T + p["fc3.bias"]


def np_loss_and_grads(p, x, y):
    x = x.astype(np.float64)
    z1 = x @ p["fc1.weight"].T + p["fc1.bias"]
    h1 = np.maximum(z1, 0.0)
    z2 = h1 @ p["fc2.weight"].T + p["fc2.bias"]
    h2 = np.maximum(z2, 0.0)
    z3 = h2 @ p["fc3.weight"].T + p["fc3.bias"]
    z3 = z3 - z3.max(axis=1, keepdims=True)
    lse = np.log(np.exp(z3).sum(axis=1, keepdims=True))
    n = len(y)
    loss = float(-(z3 - lse)[np.arange(n), y].mean())
    d3 = np.exp(z3 - lse)
    d3[np.arange(n), y] -= 1.0
    d3 /= n
    d2 = (d3 @ p["fc3.weight"]) * (z2 > 0)
    d1 = (d2 @ p["fc2.weight"]) * (z1 > 0)
    return loss, {
        "fc1.weight": d1.T @ x, "fc1.bias": d1.sum(0),
        "fc2.weight": d2.T @ h1, "fc2.bias": d2.sum(0),
        "fc3.weight": d3.T @ h2, "fc3.bias": d3.sum(0),
    }


class NumpyAdam:
    def __init__(self, lr, b1=0.9, b2=0.999, eps=1e-8):
        self.lr, self.b1, self.b2, self.eps, self.t = lr, b1, b2, eps, 0
        self.m, self.v = {}, {}

    def step(self, p, g):
        self.t += 1
        for k in p:
            self.m[k] = self.b1 * self.m.get(k, 0.0) + (1 - self.b1) * g[k]
            self.v[k] = self.b2 * self.v.get(k, 0.0) + (1 - self.b2) * g[k] ** 2
            m_hat = self.m[k] / (1 - self.b1**self.t)
            v_hat = self.v[k] / (1 - self.b2**self.t)
            p[k] = p[k] - self.lr * m_hat / (np.sqrt(v_hat) + self.eps)


# ----------------------------------------------------------------------------------------------
# the run (once per module)
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def run():
    Xtr, ytr, Xte, yte = digits_split()
    assert Xtr.shape == (1437, 64) and Xte.shape == (360, 64)
    ytr32 = ytr.astype(np.int32)
    n = len(Xtr)

    rlx.seed(SEED)
    model = MLP()
    n_params = sum(int(np.prod(p.shape)) for p in model.parameters().values())
    init = {k: p.numpy().astype(np.float64) for k, p in model.parameters().items()}
    opt = rlx.optim.Adam(lr=LR, betas=(0.9, 0.999), eps=1e-8)

    # one compiled step per distinct batch size (64 and the last partial batch of 1437 % 64 = 29);
    # both share the model's weights and the optimizer's state
    sizes = sorted({len(idx) for idx in epoch_batches(n, BATCH, 0)})
    steps = {
        bs: rlx.compile_train_step(
            loss_fn, model, opt,
            {"x": rlx.InputSpec((bs, SIZES[0])), "y": rlx.InputSpec((bs,), dtype="int32")})
        for bs in sizes
    }
    losses = []
    for epoch in range(EPOCHS):
        epoch_losses = []
        for idx in epoch_batches(n, BATCH, epoch):
            epoch_losses.append(steps[len(idx)](x=Xtr[idx], y=ytr32[idx]))
        losses.append(epoch_losses)

    fn = rlx.compile(lambda m, x: m(x), model, {"x": rlx.InputSpec((len(Xte), SIZES[0]))})
    logits = fn(x=Xte)
    final = {k: p.numpy().astype(np.float64) for k, p in model.parameters().items()}
    return dict(Xtr=Xtr, ytr=ytr, Xte=Xte, yte=yte, init=init, final=final, losses=losses,
                logits=logits, opt=opt, model=model, sizes=sizes, n_params=n_params)


def test_model_matches_spec(run):
    assert run["n_params"] == 85_002
    assert run["sizes"] == [29, 64]
    init = run["init"]
    for name, fan_in in (("fc1", 64), ("fc2", 256), ("fc3", 256)):
        bound = 1.0 / np.sqrt(fan_in)
        for part in ("weight", "bias"):
            assert np.all(np.abs(init[f"{name}.{part}"]) <= bound + 1e-7)
    assert init["fc1.weight"].shape == (256, 64)


def test_first_epoch_matches_numpy_reference(run):
    """Every loss of epoch 0 (22 full batches and the 29-row partial batch) against float64."""
    Xtr, ytr = run["Xtr"], run["ytr"]
    p = {k: v.copy() for k, v in run["init"].items()}
    adam = NumpyAdam(LR)
    got = run["losses"][0]
    batches = epoch_batches(len(Xtr), BATCH, 0)
    assert len(got) == len(batches) == 23
    for i, idx in enumerate(batches):
        loss, g = np_loss_and_grads(p, Xtr[idx], ytr[idx])
        assert_close(got[i], loss, rtol=1e-3, atol=1e-5, err_msg=f"loss of batch {i}")
        adam.step(p, g)


def test_loss_decreases(run):
    means = [float(np.mean(e)) for e in run["losses"]]
    assert all(np.isfinite(means))
    assert means[0] > 1.0  # starts near log(10) = 2.3
    assert means[-1] < 0.15
    assert means[-1] < 0.1 * means[0]


def test_optimizer_state_shared_by_both_step_sizes(run):
    """230 updates in all (10 epochs x 23 batches) reached the one Adam state."""
    for k in run["model"].parameters():
        st = run["opt"].state(k)
        assert int(np.asarray(st["step"]).reshape(-1)[0]) == EPOCHS * 23, k


def test_inference_logits_match_numpy(run):
    expected = np_forward(run["final"], run["Xte"].astype(np.float64))
    assert run["logits"].shape == (360, 10)
    assert_close(run["logits"], expected, rtol=1e-4, atol=1e-4)


def test_test_accuracy(run):
    acc = float(np.mean(np.argmax(run["logits"], axis=1) == run["yte"]))
    assert acc >= 0.96, f"test accuracy {acc:.4f} < 0.96"
