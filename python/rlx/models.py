"""Reference models built from ``rlx.nn``: the byte-level GPT of the benchmark spec, and a
generator that decodes with resident per-layer key/value caches."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from . import _check, nn
from ._compile import Function, InputSpec, compile
from ._losses import cross_entropy
from ._random import rng
from ._tensor import Tensor, embedding
from .errors import DTypeError, InputError, RlxError, ShapeError


class GPT(nn.Module):
    """A decoder-only transformer: token + learned position embeddings, ``layers`` pre-norm
    blocks, a final LayerNorm and an untied linear head without bias.

    Initialised as the GPT workload of ``benches/bench_cpu.py``: every Linear weight and both
    embeddings ~ N(0, 0.02), biases 0, LayerNorm scale 1 and shift 0.

    Example:
        >>> model = rlx.models.GPT(vocab=256, dim=128, heads=4, layers=2, seq_len=64)
        >>> step = rlx.compile_train_step(lambda m, x, y: m.loss(x, y), model, rlx.optim.AdamW(1e-3),
        ...                               {"x": rlx.InputSpec((16, 64), "int32"), "y": rlx.InputSpec((16, 64), "int32")})
    """

    def __init__(self, vocab: int = 256, dim: int = 128, heads: int = 4, layers: int = 2,
                 seq_len: int = 64, mlp_ratio: int = 4, init_std: float = 0.02) -> None:
        for what, v in (("vocab", vocab), ("dim", dim), ("heads", heads), ("seq_len", seq_len)):
            _check.integer("GPT", what, v, lo=1)
        _check.integer("GPT", "layers", layers, lo=0)
        _check.number("GPT", "init_std", init_std, lo=0.0)
        _check.fits_in_memory("GPT", (vocab, dim))
        self.vocab, self.dim, self.heads, self.n_layers, self.seq_len = vocab, dim, heads, layers, seq_len
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq_len, dim)
        self.blocks = nn.Sequential(*[nn.TransformerBlock(dim, heads, mlp_ratio, causal=True) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        for name, p in self.parameters().items():
            if name.endswith("bias"):
                p._assign(np.zeros(p.shape, np.float32))
            elif not name.startswith(("ln", "blocks")) or name.split(".")[-2] in ("qkv", "proj", "fc1", "fc2"):
                p._assign(rng().normal(0.0, init_std, p.shape))

    def __call__(self, idx: Any) -> Tensor:
        """Logits (B, T, vocab) for int32 token ids (B, T)."""
        b, t = idx.shape
        if t > self.seq_len:
            raise ShapeError(f"[GPT] sequence length {t} exceeds the position table ({self.seq_len})")
        x = self.tok(idx) + self.pos.weight[:t]
        x = self.blocks(x)
        return self.head(self.ln_f(x))

    def loss(self, idx: Any, targets: Any) -> Tensor:
        """Mean next-token cross-entropy over all B*T positions.

        Example:
            >>> step = rlx.compile_train_step(lambda m, x, y: m.loss(x, y), model, opt, specs)
        """
        logits = self(idx)
        b, t, v = logits.shape
        return cross_entropy(logits.reshape(b * t, v), targets.reshape(b * t))

    def decode(self, token: Any, pos: Any, caches: list[tuple[Any, Any]]) -> tuple[Tensor, ...]:
        """One cached step: logits (B, vocab) for ``token`` (B, 1) at position ``pos`` (1,), and the
        new key and value rows of every layer (to be written into the caches at ``pos``).

        Example:
            >>> gen = rlx.models.Generator(model)       # compiles decode() once, with resident caches
        """
        x = self.tok(token) + embedding(self.pos.weight, pos)
        rows = []
        for block, (k_cache, v_cache) in zip(self.blocks, caches):
            x, k, v = block.decode(x, k_cache, v_cache, pos)
            rows += [k, v]
        logits = self.head(self.ln_f(x))
        return (logits.reshape(logits.shape[0], self.vocab), *rows)


class Generator:
    """Token-by-token generation with resident KV caches.

    One inference executable is compiled; each layer's key and value caches
    (B, heads, max_len, head_dim) are bound into its arena once. Every step feeds one token,
    and the new token's key/value rows are written into the caches in place (``write_rows``);
    the caches are never copied whole.

    Example:
        >>> gen = rlx.models.Generator(model, batch=1)
        >>> tokens = gen.generate([72, 105], n=20, temperature=0.8)
    """

    def __init__(self, model: GPT, batch: int = 1, max_len: int | None = None, device: str = "cpu") -> None:
        if not isinstance(model, GPT):
            raise RlxError(f"[Generator] needs an rlx.models.GPT, got {type(model).__name__}")
        self.model, self.batch = model, _check.integer("Generator", "batch", batch, lo=1)
        self.max_len = model.seq_len if max_len is None else _check.integer("Generator", "max_len", max_len, lo=1)
        if self.max_len > model.seq_len:
            raise ShapeError(f"[Generator] max_len {self.max_len} exceeds the position table ({model.seq_len})")
        hd = model.dim // model.heads
        cache = (batch, model.heads, self.max_len, hd)
        names = [f"{kv}{i}" for i in range(model.n_layers) for kv in "kv"]
        inputs = {"token": InputSpec((batch, 1), "int32"), "pos": InputSpec((1,), "int32")}
        inputs.update({n: InputSpec(cache) for n in names})

        def step(m: GPT, token: Tensor, pos: Tensor, **c: Tensor) -> tuple[Tensor, ...]:
            return m.decode(token, pos, [(c[f"k{i}"], c[f"v{i}"]) for i in range(m.n_layers)])

        self.fn: Function = compile(step, model, inputs, device=device)
        self._names = names
        for n in names:
            self.fn.bind(n, np.zeros(cache, np.float32))
        self.pos = 0

    def reset(self) -> None:
        """Starts a new sequence (old cache rows are masked out, not cleared).

        Example:
            >>> gen.reset()
        """
        self.pos = 0

    def step(self, tokens: Any) -> np.ndarray:
        """Feeds one token per batch row at the current position; returns logits (B, vocab).

        Example:
            >>> logits = gen.step(np.array([[72]], np.int32))
        """
        if self.pos >= self.max_len:
            raise InputError(f"[Generator] the cache is full ({self.max_len} positions)")
        try:
            token = np.asarray(tokens)
        except (TypeError, ValueError) as e:
            raise DTypeError(f"[Generator.step] tokens must be ints: {e}") from None
        if token.dtype.kind not in "iu":
            raise DTypeError(f"[Generator.step] tokens must be integer ids, got {token.dtype}")
        if token.size != self.batch:
            raise ShapeError(f"[Generator.step] expected {self.batch} token(s), got shape {token.shape}")
        token = token.reshape(self.batch, 1)
        logits, *rows = self.fn(token=token, pos=np.array([self.pos], np.int32))
        for name, row in zip(self._names, rows):
            self.fn.write_rows(name, self.pos, row, axis=2)
        self.pos += 1
        return logits

    def generate(self, prompt: list[int], n: int, temperature: float = 1.0,
                 sample: Callable[[np.ndarray], int] | None = None) -> list[int]:
        """Feeds ``prompt`` then samples ``n`` more tokens (batch 1); returns prompt + new tokens.

        Example:
            >>> gen.generate([72, 105], n=20, temperature=0.8)
        """
        if self.batch != 1:
            raise ShapeError("[Generator.generate] needs batch=1")
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, (list, tuple)):
            raise InputError(f"[Generator.generate] the prompt must be a list of token ids, got {type(prompt).__name__}")
        n = _check.integer("Generator.generate", "n", n, lo=0)
        temperature = _check.number("Generator.generate", "temperature", temperature, lo=0.0)
        if not prompt:
            raise InputError("[Generator.generate] the prompt must hold at least one token")
        if len(prompt) + n > self.max_len:
            raise InputError(f"[Generator.generate] {len(prompt)} + {n} tokens exceed max_len {self.max_len}")
        vocab = self.model.vocab
        for i, tok in enumerate(prompt):  # before anything is fed: a bad prompt leaves the generator as it was
            if isinstance(tok, (bool, np.bool_)) or not isinstance(tok, (int, np.integer)):
                raise DTypeError(f"[Generator.generate] prompt[{i}] must be an int token id, got {type(tok).__name__} {tok!r}")
            if not 0 <= tok < vocab:
                raise InputError(f"[Generator.generate] prompt[{i}] = {tok} is out of range [0, {vocab})")
        self.reset()
        out = list(prompt)
        for tok in prompt:
            logits = self.step(tok)
        for _ in range(n):
            z = logits[0].astype(np.float64) / max(temperature, 1e-6)
            p = np.exp(z - z.max())
            p /= p.sum()
            nxt = sample(p) if sample else int(rng().choice(len(p), p=p))
            out.append(nxt)
            if len(out) < len(prompt) + n:
                logits = self.step(nxt)
        return out


__all__ = ["GPT", "Generator"]
