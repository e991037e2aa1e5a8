"""The CPU runs conv2d's patch copies and GEMMs image by image (im2col with the forward product,
the input-gradient product with col2im). That must change no result: each model here trains a
few steps with the pairing on (the default) and off (``RLX_CPU_CONV_PIPE=0``, read at compile),
and the losses, gradients, weights and predictions must be bit-identical. A profile of one
model shows the pairs did form, so the comparison is not between two unpaired runs."""

import os
import subprocess
import sys

import numpy as np
import pytest

import rlx


class _Net(rlx.nn.Module):
    """conv -> [residual] -> relu -> [pool] -> conv -> relu -> linear, over one image size."""

    def __init__(self, c_in, c_mid, k, stride, padding, bias, residual, pool, hw):
        self.conv1 = rlx.nn.Conv2d(c_in, c_mid, k, stride=stride, padding=padding, bias=bias)
        self.conv2 = rlx.nn.Conv2d(c_mid, c_mid, 3, padding=1)
        self.residual, self.pool = residual, pool
        h = (hw + 2 * padding - k) // stride + 1
        h = h // 2 if pool else h
        self.fc = rlx.nn.Linear(c_mid * h * h, 5)

    def __call__(self, x):
        h = self.conv1(x)
        if self.residual:
            h = h + x  # a full-size input of the matmul epilogue
        h = rlx.relu(h)
        if self.pool:
            h = rlx.max_pool2d(h, 2)
        h = rlx.relu(self.conv2(h))
        return self.fc(h.reshape(h.shape[0], -1))


CASES = {
    # (batch, c_in, c_mid, kernel, stride, padding, bias, residual, pool, image size)
    "cifar-like, parallel over images": (16, 3, 16, 3, 1, 1, True, False, True, 32),
    "5x5 stride 2, no bias": (6, 5, 7, 5, 2, 2, False, False, False, 33),
    "residual epilogue": (4, 8, 8, 3, 1, 1, True, True, False, 16),
    "1x1 kernel": (3, 6, 9, 1, 1, 0, True, False, False, 17),
    "batch of one (not paired: too few images)": (1, 3, 5, 3, 1, 1, True, False, True, 40),
}


def _train(case, steps=3):
    n, c_in, c_mid, k, s, p, bias, residual, pool, hw = case
    rlx.seed(5)
    model = _Net(c_in, c_mid, k, s, p, bias, residual, pool, hw)
    rng = np.random.default_rng(1)
    xs = rng.standard_normal((steps, n, c_in, hw, hw)).astype(np.float32)
    ys = rng.integers(0, 5, (steps, n)).astype(np.int32)
    spec = {"x": rlx.InputSpec((n, c_in, hw, hw)), "y": rlx.InputSpec((n,), "int32")}
    step = rlx.compile_train_step(lambda m, x, y: rlx.cross_entropy(m(x), y), model, rlx.optim.Adam(lr=1e-2), spec)
    losses, grads = [], []
    for x, y in zip(xs, ys):
        losses.append(step(x=x, y=y))
        grads.append({k: np.array(v) for k, v in step.grads.items()})
    predict = rlx.compile(lambda m, x: m(x), model, {"x": rlx.InputSpec((n, c_in, hw, hw))})
    out = np.array(predict(x=xs[0]))
    return losses, grads, {k: np.array(v) for k, v in model.state_dict().items()}, out


@pytest.mark.parametrize("name", list(CASES))
def test_paired_convolutions_give_the_same_bits(name, monkeypatch):
    monkeypatch.delenv("RLX_CPU_CONV_PIPE", raising=False)
    paired = _train(CASES[name])
    monkeypatch.setenv("RLX_CPU_CONV_PIPE", "0")
    plain = _train(CASES[name])
    assert paired[0] == plain[0]
    assert all(np.isfinite(paired[0]))
    for gp, gq in zip(paired[1], plain[1]):
        for k in gq:
            np.testing.assert_array_equal(gp[k], gq[k], err_msg=k)
    for k in plain[2]:
        np.testing.assert_array_equal(paired[2][k], plain[2][k], err_msg=k)
    np.testing.assert_array_equal(paired[3], plain[3])


PROFILE = r"""
import sys
sys.path.insert(0, {here!r})
from test_conv_pipe import CASES, _train
_train(CASES["cifar-like, parallel over images"], steps=1)
"""


@pytest.mark.parametrize("setting", [None, "0"])
def test_the_profile_shows_the_pairs_only_when_pairing_is_on(setting):
    # Two threads: a batch of 16 gives each at least two images (pairs split by image only).
    env = dict(os.environ, RLX_PROFILE="1", RLX_NUM_THREADS="2")
    env.pop("RLX_CPU_CONV_PIPE", None)
    if setting is not None:
        env["RLX_CPU_CONV_PIPE"] = setting
    code = PROFILE.format(here=os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    # Each program prints its profile when dropped: the training step's has the update.
    train = [p for p in r.stderr.split("rlx profile (") if "update Adam" in p]
    assert len(train) == 1, r.stderr
    lines = train[0].splitlines()
    forward = [line for line in lines if "im2col" in line and "+ matmul" in line]
    backward = [line for line in lines if "+ col2im" in line]
    if setting is None:
        # Both convolutions' forward products; the second one's input gradient (the first
        # convolution's input needs no gradient).
        assert len(forward) == 2 and len(backward) == 1, r.stderr
    else:
        assert not forward and not backward, r.stderr
