"""Train the tiny byte-level GPT of the benchmark spec (d_model 128, 4 heads, 2 pre-norm blocks,
MLP 4x exact GELU, seq 64, batch 16, AdamW lr 1e-3 wd 0.01) on the standard library's *.py
files, save a checkpoint, then sample text from it with the KV-cache generator.

    python examples/train_gpt.py [--steps 300] [--save gpt.safetensors]
"""

from __future__ import annotations

import argparse
import statistics
import time

import gpt_data
import numpy as np

import rlx
from rlx.utils import progress


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--save", default="gpt.safetensors")
    ap.add_argument("--log", default=None, help="write the per-step losses to this .npy file")
    ap.add_argument("--init", default=None, help="start from these weights (safetensors) instead of a fresh init")
    ap.add_argument("--sample", type=int, default=200, help="bytes to generate after training")
    args = ap.parse_args()

    rlx.seed(args.seed)
    model = rlx.models.GPT()
    if args.init:
        model.load(args.init)
    T = model.seq_len
    train, val = gpt_data.corpus()
    offsets = gpt_data.batch_offsets(len(train), args.steps, args.batch, T, seed=args.seed)
    opt = rlx.optim.AdamW(lr=1e-3, weight_decay=0.01)
    spec = {"idx": rlx.InputSpec((args.batch, T), "int32"), "targets": rlx.InputSpec((args.batch, T), "int32")}
    t0 = time.perf_counter()
    step = rlx.compile_train_step(lambda m, idx, targets: m.loss(idx, targets), model, opt, spec, device=args.device)
    compile_s = time.perf_counter() - t0

    losses, times = [], []
    bar = progress(range(args.steps), desc="train")
    for s in bar:
        x, y = gpt_data.batch(train, offsets[s], T)
        t = time.perf_counter()
        loss = step(idx=x, targets=y)
        times.append(time.perf_counter() - t)
        losses.append(loss)
        if s % 10 == 0:
            bar.set_postfix(loss=loss)

    evaluate = rlx.compile(lambda m, idx, targets: m.loss(idx, targets), model, spec, device=args.device)
    voff = gpt_data.batch_offsets(len(val), 8, args.batch, T, seed=1)
    val_loss = float(np.mean([evaluate(**dict(zip(("idx", "targets"), gpt_data.batch(val, o, T)))) for o in voff]))
    mem = step.memory()
    print(f"loss {losses[0]:.3f} -> {np.mean(losses[-20:]):.3f} (mean of the last 20 steps); val {val_loss:.3f}")
    print(f"median step {statistics.median(times[20:] or times) * 1e3:.2f} ms; compile {compile_s * 1e3:.0f} ms")
    print(f"arena {mem['arena_bytes']:,} bytes vs {mem['naive_bytes']:,} naive "
          f"({mem['arena_bytes'] / mem['naive_bytes']:.0%}); weights {mem['param_bytes']:,} bytes")
    if args.log:
        np.save(args.log, np.array(losses, np.float32))
    if args.save:
        model.save(args.save)
        print(f"saved {args.save}")
    if args.sample:
        gen = rlx.models.Generator(model)
        prompt = list(b"def ")
        t = time.perf_counter()
        out = gen.generate(prompt, min(args.sample, gen.max_len - len(prompt)), temperature=0.8)
        dt = time.perf_counter() - t
        print(f"--- sample ({len(out) / dt:.0f} tokens/s) ---")
        print(bytes(out).decode("utf-8", errors="replace"))


if __name__ == "__main__":
    main()
