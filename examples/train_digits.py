"""Train the digits MLP (64-256-256-10, ReLU, Adam 1e-3, batch 64) on scikit-learn's bundled
digits data with rlx on the CPU, then report test accuracy on the held-out 20%.

    python examples/train_digits.py [--epochs 10] [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from digits_mlp import MLP, digits_split, loss_fn

import rlx
from rlx.utils import progress


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save", default=None, help="write the trained weights to this safetensors file")
    args = ap.parse_args()

    rlx.seed(args.seed)
    xtr, xte, ytr, yte = digits_split()
    model = MLP()
    opt = rlx.optim.Adam(lr=1e-3)
    t0 = time.perf_counter()
    steps = {}  # one compiled step per batch size (the last batch is smaller); they share weights and Adam state

    def step_for(n):
        if n not in steps:
            spec = {"x": rlx.InputSpec((n, 64)), "y": rlx.InputSpec((n,), "int32")}
            steps[n] = rlx.compile_train_step(loss_fn, model, opt, spec, device=args.device)
        return steps[n]

    step_for(args.batch)
    compile_s = time.perf_counter() - t0
    times = []
    for epoch in range(args.epochs):
        perm = np.random.default_rng(args.seed + epoch).permutation(len(xtr))
        batches = [perm[i : i + args.batch] for i in range(0, len(xtr), args.batch)]
        bar = progress(batches, desc=f"epoch {epoch + 1:2d}/{args.epochs}")
        for idx in bar:
            xb, yb = xtr[idx], ytr[idx]
            step = step_for(len(idx))
            t = time.perf_counter()
            loss = step(x=xb, y=yb)
            times.append((len(idx), time.perf_counter() - t))
            bar.set_postfix(loss=loss)

    predict = rlx.compile(lambda m, x: m(x), model, {"x": rlx.InputSpec(xte.shape)}, device=args.device)
    acc = float((predict(x=xte).argmax(axis=1) == yte).mean())
    full = [dt for n, dt in times if n == args.batch]
    mem = steps[args.batch].memory()
    print(f"test accuracy: {acc:.4f}")
    print(f"median step: {statistics.median(full) * 1e3:.3f} ms (batch {args.batch}); first compile {compile_s * 1e3:.1f} ms")
    print(f"arena: {mem['arena_bytes']:,} bytes planned vs {mem['naive_bytes']:,} naive "
          f"({mem['arena_bytes'] / mem['naive_bytes']:.0%}); weights {mem['param_bytes']:,} bytes")
    if args.save:
        model.save(args.save)
        print(f"saved weights to {args.save}")


if __name__ == "__main__":
    main()
