"""The fusion pass: programs compiled with fused elementwise chains (the default) give the same
results as the same programs with every op its own instruction (``RLX_FUSION=0``), forward and
gradients, on random chains (broadcast inputs, reshapes in the middle, shared values) and on the
models."""

from __future__ import annotations

import numpy as np
import pytest

import rlx


def compiled(monkeypatch, fused: bool, build):
    monkeypatch.setenv("RLX_FUSION", "1" if fused else "0")
    try:
        return build()
    finally:
        monkeypatch.delenv("RLX_FUSION")


class Params(rlx.nn.Module):
    def __init__(self, rng):
        self.w = rlx.nn.Parameter(rng.standard_normal((4, 6)).astype(np.float32))
        self.b = rlx.nn.Parameter(rng.standard_normal(6).astype(np.float32))
        self.s = rlx.nn.Parameter(rng.standard_normal(1).astype(np.float32))


def random_chain(seed: int, depth: int):
    """A traced function: a random sequence of elementwise ops over broadcast operands, with
    reshapes between (4, 6) and (2, 2, 6) and values reused later (so some are shared)."""
    rng = np.random.default_rng(seed)
    plan = [(int(rng.integers(0, 12)), int(rng.integers(0, 1 << 30))) for _ in range(depth)]

    def fn(m, x):
        vals = [x * m.w, m.b + x]
        for kind, pick in plan:
            a = vals[-1]
            other = vals[pick % len(vals)]
            if other.shape != a.shape:
                other = other.reshape(*a.shape)
            if kind == 0:
                v = a + m.b
            elif kind == 1:
                v = a * other
            elif kind == 2:
                v = rlx.tanh(a)
            elif kind == 3:
                v = rlx.relu(a) - other
            elif kind == 4:
                v = rlx.gelu(a)
            elif kind == 5:
                v = a / (1.5 + rlx.sigmoid(other))
            elif kind == 6:
                v = rlx.where(a > other, a, other * 0.5)
            elif kind == 7:
                v = a.reshape(2, 2, 6) if len(a.shape) == 2 else a.reshape(4, 6)
            elif kind == 8:
                v = rlx.exp(rlx.tanh(a)) * m.s
            elif kind == 9:
                v = (a - 0.25) ** 2
            elif kind == 10:
                v = -a + m.b
            else:
                v = rlx.gelu(a, approximate="tanh")
            vals.append(v)
        out = vals[-1]
        return (out * out).mean() + vals[len(vals) // 2].sum() * 0.01

    return fn


@pytest.mark.parametrize("seed", range(40))
def test_random_chains_match_the_unfused_program(monkeypatch, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((4, 6)).astype(np.float32)
    fn = random_chain(seed, depth=int(rng.integers(3, 25)))
    results = []
    for fused in (True, False):
        model = Params(np.random.default_rng(seed))
        step = compiled(monkeypatch, fused, lambda m=model: rlx.compile_train_step(
            fn, m, rlx.optim.SGD(lr=0.0), {"x": rlx.InputSpec((4, 6))}))
        loss = step(x=x)
        results.append((loss, {k: v.copy() for k, v in step.grads.items()}, step.memory()["arena_bytes"]))
    (lf, gf, af), (lu, gu, au) = results
    np.testing.assert_allclose(lf, lu, rtol=1e-5, atol=1e-6)
    for k in gu:
        np.testing.assert_allclose(gf[k], gu[k], rtol=1e-4, atol=1e-5, err_msg=k)
    # Recomputing a shared value can keep its inputs alive longer, so a small random program's
    # arena may grow a little; the models' arenas shrink (below).
    assert af <= 2 * au


def test_gpt_training_matches_and_fused_intermediates_take_no_memory(monkeypatch):
    r = np.random.default_rng(0)
    idx = r.integers(0, 64, (2, 16)).astype(np.int32)
    tgt = r.integers(0, 64, (2, 16)).astype(np.int32)
    runs = []
    for fused in (True, False):
        rlx.seed(0)
        model = rlx.models.GPT(vocab=64, dim=32, heads=2, layers=2)
        opt = rlx.optim.AdamW(lr=1e-2, weight_decay=0.01)
        step = compiled(monkeypatch, fused, lambda m=model, o=opt: rlx.compile_train_step(
            lambda m, idx, tgt: m.loss(idx, tgt), m, o,
            {"idx": rlx.InputSpec((2, 16), "int32"), "tgt": rlx.InputSpec((2, 16), "int32")}))
        losses = [step(idx=idx, tgt=tgt) for _ in range(5)]
        runs.append((losses, {k: p.numpy().copy() for k, p in model.parameters().items()}, step.memory()))
    (lf, wf, mf), (lu, wu, mu) = runs
    np.testing.assert_allclose(lf, lu, rtol=1e-4)
    for k in wu:
        np.testing.assert_allclose(wf[k], wu[k], rtol=1e-3, atol=1e-5, err_msg=k)
    # Fused intermediates get no slot at all; the peak (saved activations at the start of the
    # backward pass) is not made of them, so the arena itself does not grow.
    assert mf["naive_bytes"] < mu["naive_bytes"], (mf, mu)
    assert mf["arena_bytes"] <= mu["arena_bytes"], (mf, mu)


def test_floor_division_remainder_and_relu_at_nan_fuse_like_the_unfused_program(monkeypatch):
    # float // and % (Python's rules) inside fused chains, and relu's backward at NaN (the
    # upstream gradient passes), give exactly what the one-op-per-instruction program gives
    x = np.array([[7.5, -7.5, 0.0, np.nan, 3.0, -1.0]] * 4, np.float32)
    x[1] *= -1.0
    results = []
    for fused in (True, False):
        model = Params(np.random.default_rng(0))
        step = compiled(monkeypatch, fused, lambda m=model: rlx.compile_train_step(
            lambda m, x: ((rlx.relu(x * m.w) // 2.0) * m.b + (x * m.w % -1.5) * m.s + rlx.relu(x * m.w)).sum(),
            m, rlx.optim.SGD(lr=0.0), {"x": rlx.InputSpec((4, 6))}))
        loss = step(x=x)
        results.append((loss, {k: v.copy() for k, v in step.grads.items()}))
    (lf, gf), (lu, gu) = results
    np.testing.assert_array_equal(lf, lu)
    for k in gu:
        np.testing.assert_array_equal(gf[k], gu[k], err_msg=k)
    assert np.isnan(gf["w"][:, 3]).all()  # NaN inputs give NaN weight gradients, fused or not
