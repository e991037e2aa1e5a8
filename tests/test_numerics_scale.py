"""Accuracy of long reductions, losses over empty batches, and compile time that grows
linearly with graph depth (checked as a growth ratio, not an absolute time)."""

from __future__ import annotations

import time

import numpy as np

import rlx


class Holder(rlx.nn.Module):
    def __init__(self):
        self.w = rlx.nn.Parameter(np.ones(4, np.float32))


def test_sum_and_mean_of_16m_values_are_accurate():
    n = 1 << 24
    fn = rlx.compile(lambda m, x: (x.sum(), x.mean()), Holder(), {"x": rlx.InputSpec((n,))})
    s, mean = fn(x=np.full(n, 0.1, np.float32))
    exact = float(np.float32(0.1)) * n
    assert abs(float(s) - exact) / exact < 1e-6
    assert abs(float(mean) - exact / n) / (exact / n) < 1e-6


def test_losses_over_an_empty_batch_are_nan():
    fn = rlx.compile(
        lambda m, logits, y, p, t: (rlx.cross_entropy(logits, y), rlx.mse_loss(p, t)),
        Holder(),
        {"logits": rlx.InputSpec((0, 5)), "y": rlx.InputSpec((0,), "int32"),
         "p": rlx.InputSpec((0, 3)), "t": rlx.InputSpec((0, 3))},
    )
    ce, mse = fn(logits=np.zeros((0, 5), np.float32), y=np.zeros(0, np.int32),
                 p=np.zeros((0, 3), np.float32), t=np.zeros((0, 3), np.float32))
    assert np.isnan(ce) and np.isnan(mse)  # a mean over nothing, as numpy and PyTorch give


def _compile_seconds(depth: int) -> float:
    def f(m, x):
        h = x * m.w
        for _ in range(depth):
            h = rlx.tanh(h * 1.0001 + 0.001)  # every block adds two fresh Python scalars
        return h.sum()

    best = float("inf")
    for _ in range(2):
        t = time.perf_counter()
        step = rlx.compile_train_step(f, Holder(), rlx.optim.SGD(lr=0.1), {"x": rlx.InputSpec((4,))})
        best = min(best, time.perf_counter() - t)
    assert np.isfinite(step(x=np.ones(4, np.float32)))
    return best


def test_compile_time_grows_linearly_with_depth():
    small, large = _compile_seconds(1000), _compile_seconds(8000)
    # 8x the depth: linear growth is ~8x, the old quadratic planner gave ~50x. The bound leaves
    # room for a noisy machine without letting quadratic growth through.
    assert large / max(small, 1e-3) < 24, f"1k blocks {small:.3f} s, 8k blocks {large:.3f} s"
