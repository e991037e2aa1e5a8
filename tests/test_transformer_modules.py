"""Specs for issue 3 (transformer layers); moved into tests/ when they land."""
import numpy as np
import pytest

import rlx
from conftest import assert_close, specs


def test_gelu_module_matches_function():
    x = np.linspace(-3, 3, 12, dtype=np.float32).reshape(3, 4)
    from conftest import Empty

    g = rlx.nn.GELU()
    fn = rlx.compile(lambda m, x: (g(x), rlx.gelu(x)), Empty(), specs({"x": x}))
    a, b = fn(x=x)
    assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_layernorm_module_init():
    ln = rlx.nn.LayerNorm(6)
    vals = [p.numpy() for p in ln.parameters().values()]
    assert len(vals) == 2
    assert all(v.shape == (6,) for v in vals)
    assert np.array_equal(vals[0], np.ones(6, np.float32))   # gamma = 1
    assert np.array_equal(vals[1], np.zeros(6, np.float32))  # beta = 0


def test_embedding_module_init():
    rlx.seed(3)
    emb = rlx.nn.Embedding(1000, 16)
    (w,) = [p.numpy() for p in emb.parameters().values()]
    assert w.shape == (1000, 16)
    assert abs(w.std() - 1.0) < 0.05 and abs(w.mean()) < 0.05  # N(0, 1) as PyTorch


@pytest.mark.parametrize("causal", [True, False])
def test_multi_head_attention_causality(causal):
    rlx.seed(4)
    mha = rlx.nn.MultiHeadAttention(8, 2, causal=causal)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 5, 8)).astype(np.float32)
    x2 = x.copy()
    x2[:, -1, :] += 1.0  # change only the last position
    fn = rlx.compile(lambda m, x: m(x), mha, specs({"x": x}))
    y, y2 = fn(x=x), fn(x=x2)
    assert y.shape == (2, 5, 8) and np.all(np.isfinite(y))
    if causal:
        np.testing.assert_allclose(y[:, :-1], y2[:, :-1], rtol=1e-5, atol=1e-6)
    else:
        assert np.max(np.abs(y[:, :-1] - y2[:, :-1])) > 1e-4
    assert np.max(np.abs(y[:, -1] - y2[:, -1])) > 1e-4


def test_transformer_block_trains():
    rlx.seed(5)
    blk = rlx.nn.TransformerBlock(8, 2)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 4, 8)).astype(np.float32)
    t = rng.standard_normal((2, 4, 8)).astype(np.float32)
    step = rlx.compile_train_step(lambda m, x, t: rlx.mse_loss(m(x), t), blk,
                                  rlx.optim.Adam(lr=1e-2), specs({"x": x, "t": t}))
    losses = [step(x=x, t=t) for _ in range(30)]
    assert all(np.isfinite(losses))
    assert losses[-1] < losses[0]
    for k, p in blk.parameters().items():
        assert step.grads[k].shape == tuple(p.shape)
