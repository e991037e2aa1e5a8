"""Loss-curve parity between rlx and JAX on the tiny byte-level GPT of the benchmark spec.

Both frameworks train the same model (d_model 128, 4 heads, 2 pre-norm blocks, MLP 4x exact
GELU, seq 64, batch 16) with AdamW (lr 1e-3, weight decay 0.01 on every parameter, PyTorch
semantics) from the *same* initial weights (rlx's seeded init, copied into JAX) on the *same*
batches. rlx runs first, then JAX (the whole train step under ``jax.jit``, float32, CPU). The
script prints the loss of both at every logged step with the relative difference
``|rlx - jax| / |jax|``, the largest such difference, and each framework's median step time
(steps 20 onwards; the timer wraps the step call and reading the loss back as a Python float).

    python benches/gpt_loss_compare.py [--steps 300] [--log-every 10] [--out curves.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from typing import Callable

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import gpt_data  # noqa: E402

BATCH, SEQ, HEADS, LAYERS = 16, 64, 4, 2
LR, WEIGHT_DECAY, BETAS, EPS = 1e-3, 0.01, (0.9, 0.999), 1e-8
LN_EPS = 1e-5
TIMED_FROM = 20  # step times before this one are warm-up and left out of the median

Batches = Callable[[int], tuple[np.ndarray, np.ndarray]]


def train_rlx(steps: int, batches: Batches, seed: int) -> tuple[dict[str, np.ndarray], list[float], list[float]]:
    """Trains rlx's GPT; returns (initial weights, per-step losses, per-step seconds)."""
    import rlx

    rlx.seed(seed)
    model = rlx.models.GPT(heads=HEADS, layers=LAYERS, seq_len=SEQ)
    # Copy before compiling: afterwards p.numpy() is a live view of the training weights.
    init = {name: p.numpy().copy() for name, p in model.parameters().items()}
    opt = rlx.optim.AdamW(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    spec = {"idx": rlx.InputSpec((BATCH, SEQ), "int32"), "targets": rlx.InputSpec((BATCH, SEQ), "int32")}
    step = rlx.compile_train_step(lambda m, idx, targets: m.loss(idx, targets), model, opt, spec)

    losses, times = [], []
    for s in range(steps):
        x, y = batches(s)
        t0 = time.perf_counter()
        loss = float(step(idx=x, targets=y))
        times.append(time.perf_counter() - t0)
        losses.append(loss)
    return init, losses, times


def train_jax(init: dict[str, np.ndarray], steps: int, batches: Batches) -> tuple[list[float], list[float]]:
    """Trains the same GPT written in JAX from ``init``; returns (per-step losses, per-step seconds)."""
    import jax
    import jax.numpy as jnp

    def layer_norm(x, w, b):
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)  # biased, as rlx and PyTorch
        return (x - mean) / jnp.sqrt(var + LN_EPS) * w + b

    def attention(p, pre, x):
        b, t, d = x.shape
        hd = d // HEADS
        qkv = x @ p[pre + "qkv.weight"].T + p[pre + "qkv.bias"]
        q, k, v = qkv.reshape(b, t, 3, HEADS, hd).transpose(2, 0, 3, 1, 4)  # each (B, H, T, hd)
        scores = (q * (1.0 / math.sqrt(hd))) @ k.swapaxes(-1, -2)
        causal = jnp.tril(jnp.ones((t, t), bool))
        att = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        y = (att @ v).transpose(0, 2, 1, 3).reshape(b, t, d)
        return y @ p[pre + "proj.weight"].T + p[pre + "proj.bias"]

    def block(p, pre, x):
        x = x + attention(p, pre + "attn.", layer_norm(x, p[pre + "ln1.weight"], p[pre + "ln1.bias"]))
        h = layer_norm(x, p[pre + "ln2.weight"], p[pre + "ln2.bias"]) @ p[pre + "fc1.weight"].T + p[pre + "fc1.bias"]
        return x + jax.nn.gelu(h, approximate=False) @ p[pre + "fc2.weight"].T + p[pre + "fc2.bias"]

    def loss_fn(p, idx, targets):
        x = p["tok.weight"][idx] + p["pos.weight"][: idx.shape[1]]
        for i in range(LAYERS):
            x = block(p, f"blocks.{i}.", x)
        logits = layer_norm(x, p["ln_f.weight"], p["ln_f.bias"]) @ p["head.weight"].T
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()

    def adamw(p, g, m, v, t):
        """One PyTorch-style AdamW update of one tensor; ``t`` is the 1-based step count."""
        b1, b2 = BETAS
        p = p * (1.0 - LR * WEIGHT_DECAY)
        m = b1 * m + (1.0 - b1) * g
        v = b2 * v + (1.0 - b2) * g * g
        denom = jnp.sqrt(v) / jnp.sqrt(1.0 - b2**t) + EPS
        return p - (LR / (1.0 - b1**t)) * m / denom, m, v

    @jax.jit
    def train_step(params, m, v, t, idx, targets):
        loss, grads = jax.value_and_grad(loss_fn)(params, idx, targets)
        t = t + 1.0
        new = {k: adamw(params[k], grads[k], m[k], v[k], t) for k in params}
        return ({k: u[0] for k, u in new.items()}, {k: u[1] for k, u in new.items()},
                {k: u[2] for k, u in new.items()}, t, loss)

    params = {k: jnp.asarray(w, jnp.float32) for k, w in init.items()}
    m = {k: jnp.zeros_like(w) for k, w in params.items()}
    v = {k: jnp.zeros_like(w) for k, w in params.items()}
    t = jnp.zeros((), jnp.float32)

    losses, times = [], []
    for s in range(steps):
        x, y = batches(s)
        t0 = time.perf_counter()
        params, m, v, t, loss = train_step(params, m, v, t, x, y)
        loss = float(loss)
        times.append(time.perf_counter() - t0)
        losses.append(loss)
    return losses, times


def median_ms(times: list[float]) -> float:
    return statistics.median(times[TIMED_FROM:] or times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0, help="seeds rlx's init and the batch order")
    ap.add_argument("--out", default=None, help="write both curves and the max relative difference to this JSON")
    args = ap.parse_args()

    train, _ = gpt_data.corpus()
    offsets = gpt_data.batch_offsets(len(train), args.steps, BATCH, SEQ, seed=args.seed)

    def batches(s: int) -> tuple[np.ndarray, np.ndarray]:
        return gpt_data.batch(train, offsets[s], SEQ)

    print(f"training {args.steps} steps in rlx ...", flush=True)
    init, rlx_loss, rlx_times = train_rlx(args.steps, batches, args.seed)
    print(f"training {args.steps} steps in JAX ...", flush=True)
    jax_loss, jax_times = train_jax(init, args.steps, batches)

    logged = sorted(set(range(0, args.steps, args.log_every)) | {args.steps - 1})
    rel = {s: abs(rlx_loss[s] - jax_loss[s]) / abs(jax_loss[s]) for s in logged}
    worst = max(logged, key=rel.__getitem__)

    print()
    print("| step | rlx loss | JAX loss | rel diff |")
    print("|-----:|---------:|---------:|---------:|")
    for s in logged:
        print(f"| {s} | {rlx_loss[s]:.4f} | {jax_loss[s]:.4f} | {rel[s]:.4%} |")
    print()
    print(f"max rel diff {rel[worst]:.4%} at step {worst} (over {len(logged)} logged steps); "
          f"median step (steps {TIMED_FROM}+): rlx {median_ms(rlx_times):.2f} ms, JAX {median_ms(jax_times):.2f} ms")

    if args.out:
        result = {
            "steps": args.steps,
            "logged_steps": logged,
            "rlx_loss": rlx_loss,
            "jax_loss": jax_loss,
            "rel_diff": [rel[s] for s in logged],
            "max_rel_diff": rel[worst],
            "max_rel_diff_step": worst,
            "median_step_ms": {"rlx": median_ms(rlx_times), "jax": median_ms(jax_times)},
        }
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
