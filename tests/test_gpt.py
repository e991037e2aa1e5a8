"""The GPT model end to end: cached decoding matches full-prefix logits, training lowers the loss,
bad inputs (ids out of the vocabulary, sequences past the position table, cache overflow) raise
clear errors and corrupt nothing, and the training arena stays lean."""

import numpy as np
import pytest

import rlx

V, D, H, L, T = 32, 16, 2, 2, 8


@pytest.fixture
def model():
    rlx.seed(0)
    return rlx.models.GPT(vocab=V, dim=D, heads=H, layers=L, seq_len=T)


def full_logits(model, seq):
    fn = rlx.compile(lambda m, idx: m(idx), model, {"idx": rlx.InputSpec(seq.shape, "int32")})
    return fn(idx=seq)


@pytest.mark.parametrize("batch", [1, 3])
def test_cached_decoding_matches_full_prefix(model, batch):
    seq = np.random.default_rng(1).integers(0, V, (batch, T)).astype(np.int32)
    ref = full_logits(model, seq)
    gen = rlx.models.Generator(model, batch=batch)
    for t in range(T):
        logits = gen.step(seq[:, t])
        np.testing.assert_allclose(logits, ref[:, t], atol=1e-4, rtol=0, err_msg=f"position {t}")


def test_cache_is_resident_and_written_in_place(model):
    gen = rlx.models.Generator(model)
    view = gen.fn.view("k0")
    ptr = view.ctypes.data
    seq = np.arange(3, dtype=np.int32)
    for tok in seq:
        gen.step(tok)
    # Rows 0..2 were filled by write_rows through the same memory; the rest are still zero.
    assert gen.fn.view("k0").ctypes.data == ptr
    assert np.abs(view[:, :, :3]).sum() > 0
    assert np.all(view[:, :, 3:] == 0)


def test_decoding_after_reset_ignores_stale_rows(model):
    gen = rlx.models.Generator(model)
    a = np.array([5, 6, 7, 8], np.int32)
    for tok in a:
        gen.step(tok)
    gen.reset()
    b = np.array([1, 2], np.int32)
    out = [gen.step(tok) for tok in b]
    ref = full_logits(model, b[None])
    np.testing.assert_allclose(out[1][0], ref[0, 1], atol=1e-4)


def test_training_lowers_the_loss(model):
    rng = np.random.default_rng(0)
    # A learnable pattern: each sequence counts up from a random start.
    def batch():
        s = rng.integers(0, V, (4, 1))
        w = (s + np.arange(T + 1)) % V
        return w[:, :-1].astype(np.int32), w[:, 1:].astype(np.int32)

    spec = {"idx": rlx.InputSpec((4, T), "int32"), "targets": rlx.InputSpec((4, T), "int32")}
    step = rlx.compile_train_step(lambda m, idx, targets: m.loss(idx, targets), model,
                                  rlx.optim.AdamW(lr=1e-2), spec)
    losses = [step(**dict(zip(("idx", "targets"), batch()))) for _ in range(60)]
    assert losses[0] == pytest.approx(np.log(V), rel=0.1)
    assert np.mean(losses[-10:]) < 0.5 * losses[0]


def test_tiny_gpt_arena_is_lean():
    rlx.seed(0)
    m = rlx.models.GPT()
    spec = {"idx": rlx.InputSpec((16, 64), "int32"), "targets": rlx.InputSpec((16, 64), "int32")}
    step = rlx.compile_train_step(lambda m, idx, targets: m.loss(idx, targets), m, rlx.optim.AdamW(), spec)
    mem = step.memory()
    # Planning reuses memory (fusion already keeps most intermediates out of the naive sum), and
    # fused attention keeps the (B, H, T, T) scores out of the arena: under the 24.8 MB of before.
    assert mem["arena_bytes"] <= 0.6 * mem["naive_bytes"], mem
    assert mem["arena_bytes"] < 23_000_000, mem
    # Fused attention, matmul epilogues, fused sums and normalize_grad_add: at most 80
    # instructions per step (179 with one instruction per op).
    listing = step.graph()
    n = int(listing.split(" instructions")[0].split()[-1])
    assert n <= 80, listing.splitlines()[0]
    for op in ("attention[", "attention_grad[", "matmul_epilogue", "fused_sum_to", "normalize_grad_add"):
        assert op in listing, op
    assert mem["param_bytes"] >= 470_528 * 4


def test_token_ids_out_of_vocabulary_raise_before_running(model):
    fn = rlx.compile(lambda m, idx: m(idx), model, {"idx": rlx.InputSpec((1, T), "int32")})
    before = {n: p.numpy().copy() for n, p in model.parameters().items()}
    bad = np.full((1, T), V, np.int32)
    with pytest.raises(rlx.InputError, match=r"idx.*out of range"):
        fn(idx=bad)
    with pytest.raises(rlx.InputError, match=r"out of range"):
        fn(idx=-bad)
    spec = {"idx": rlx.InputSpec((1, T), "int32"), "targets": rlx.InputSpec((1, T), "int32")}
    opt = rlx.optim.AdamW()
    step = rlx.compile_train_step(lambda m, idx, targets: m.loss(idx, targets), model, opt, spec)
    with pytest.raises(rlx.InputError):
        step(idx=bad, targets=np.zeros((1, T), np.int32))
    for n, p in model.parameters().items():
        np.testing.assert_array_equal(p.numpy(), before[n])
    assert int(opt.state("tok.weight")["step"]) == 0


def test_sequence_longer_than_position_table(model):
    with pytest.raises(rlx.ShapeError, match="position"):
        rlx.compile(lambda m, idx: m(idx), model, {"idx": rlx.InputSpec((1, T + 1), "int32")})
    with pytest.raises(rlx.ShapeError, match="max_len"):
        rlx.models.Generator(model, max_len=T + 1)


def test_cache_overflow_is_refused_and_leaves_cache_intact(model):
    gen = rlx.models.Generator(model)
    for tok in range(T):
        gen.step(tok)
    snapshot = gen.fn.view("v1").copy()
    with pytest.raises(rlx.InputError, match="full"):
        gen.step(0)
    row = np.ones((1, H, 1, D // H), np.float32)
    with pytest.raises(rlx.InputError, match="overflows"):
        gen.fn.write_rows("v1", T, row, axis=2)
    with pytest.raises(rlx.InputError, match="overflows"):
        gen.fn.write_rows("v1", T - 1, np.ones((1, H, 2, D // H), np.float32), axis=2)
    with pytest.raises(rlx.ShapeError):
        gen.fn.write_rows("v1", 0, np.ones((1, H + 1, 1, D // H), np.float32), axis=2)
    np.testing.assert_array_equal(gen.fn.view("v1"), snapshot)
    # A position past the table is refused by the position lookup before anything runs.
    with pytest.raises(rlx.InputError, match="pos"):
        gen.fn(token=np.zeros((1, 1), np.int32), pos=np.array([T], np.int32))


def test_generate_produces_tokens(model):
    gen = rlx.models.Generator(model)
    out = gen.generate([1, 2, 3], 4, sample=lambda p: int(np.argmax(p)))
    assert out[:3] == [1, 2, 3] and len(out) == 7 and all(0 <= t < V for t in out)
    with pytest.raises(rlx.InputError):
        gen.generate([1] * T, 1)


def test_a_bad_prompt_is_refused_before_anything_is_fed(model):
    """The prompt's ids are checked first: a bad one used to leave the generator mid-sequence."""
    gen = rlx.models.Generator(model)
    gen.step(np.array([[5]], np.int32))
    with pytest.raises(rlx.InputError, match=rf"prompt\[1\] = {V} is out of range \[0, {V}\)"):
        gen.generate([1, V], 3)
    with pytest.raises(rlx.DTypeError, match=r"prompt\[0\] must be an int token id, got float 1.5"):
        gen.generate([1.5], 3)
    assert gen.pos == 1
