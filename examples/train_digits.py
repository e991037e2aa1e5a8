"""Train the digits MLP (64-256-256-10, ReLU, Adam 1e-3, batch 64) on scikit-learn's bundled
digits data with rlx on the CPU, then report test accuracy on the held-out 20%.

    python examples/train_digits.py [--epochs 10] [--device cpu]
    python examples/train_digits.py --clip 1.0 --schedule cosine     # clipping, cosine lr
    python examples/train_digits.py --checkpoint ckpt --stop-after 4   # saves after every epoch
    python examples/train_digits.py --resume ckpt                      # continues from epoch 5
    mpirun -n 2 python examples/train_digits.py --distributed         # data parallel, 2 processes

A run resumed from a checkpoint continues exactly as the uninterrupted run would have (same
weights, optimizer state, learning-rate schedule and batch order). With --distributed each of the
N ranks takes every N-th row of each batch (--batch is the global batch) and the ranks average
their gradients every step, so the weights follow the single-process run's.
"""

from __future__ import annotations

import argparse
import json
import os
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
    ap.add_argument("--clip", type=float, default=None, help="clip the gradient's global L2 norm to this")
    ap.add_argument("--schedule", choices=["constant", "cosine"], default="constant",
                    help="learning-rate schedule over all steps (cosine: CosineAnnealingLR to 0)")
    ap.add_argument("--checkpoint", default=None, help="folder to save model, optimizer and progress after every epoch")
    ap.add_argument("--resume", default=None, help="folder written by --checkpoint to continue from")
    ap.add_argument("--stop-after", type=int, default=None, help="stop after this epoch, as if interrupted")
    ap.add_argument("--distributed", action="store_true", help="data parallel across the ranks of mpirun -n N")
    args = ap.parse_args()
    rank, world = 0, 1
    if args.distributed:
        rlx.distributed.init()
        rank, world = rlx.distributed.rank(), rlx.distributed.world_size()
    say = print if rank == 0 else (lambda *a, **k: None)

    rlx.seed(args.seed)
    xtr, xte, ytr, yte = digits_split()
    model = MLP()
    opt = rlx.optim.Adam(lr=1e-3)
    steps_per_epoch = -(-len(xtr) // args.batch)
    sched = None
    if args.schedule == "cosine":
        sched = rlx.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * steps_per_epoch)
    first_epoch = 0
    if args.resume:
        model.load(os.path.join(args.resume, "model.safetensors"))
        opt.load(os.path.join(args.resume, "optimizer.safetensors"))  # placed in the arena at compile
        with open(os.path.join(args.resume, "progress.json")) as f:
            progress_state = json.load(f)
        first_epoch = progress_state["epoch"]
        if sched is not None and progress_state.get("scheduler"):
            sched.load_state_dict(progress_state["scheduler"])
        say(f"resumed from {args.resume} after epoch {first_epoch}")
        if first_epoch >= args.epochs:
            say(f"the checkpoint has finished all {args.epochs} epochs: evaluating only (raise --epochs to train on)")
    t0 = time.perf_counter()
    # One step for every batch size (None): the last, smaller batch compiles its own executable on
    # first use; all share the weights and the Adam state.
    spec = {"x": rlx.InputSpec((None, 64)), "y": rlx.InputSpec((None,), "int32")}
    step = rlx.compile_train_step(loss_fn, model, opt, spec, device=args.device, clip_grad_norm=args.clip,
                                  distributed=args.distributed)
    compile_s = time.perf_counter() - t0
    times = []
    for epoch in range(first_epoch, args.epochs):
        perm = np.random.default_rng(args.seed + epoch).permutation(len(xtr))
        batches = [perm[i : i + args.batch] for i in range(0, len(xtr), args.batch)]
        bar = progress(batches, desc=f"epoch {epoch + 1:2d}/{args.epochs}", disable=rank != 0)
        for idx in bar:
            if world > 1:  # this rank's share: every world-th row of the rows that split evenly
                idx = idx[: len(idx) - len(idx) % world][rank::world]
            xb, yb = xtr[idx], ytr[idx]
            t = time.perf_counter()
            loss = step(x=xb, y=yb)
            times.append((len(idx), time.perf_counter() - t))
            if sched is not None:
                sched.step()
            bar.set_postfix(loss=loss, lr=opt.lr)
        if args.checkpoint:
            os.makedirs(args.checkpoint, exist_ok=True)
            model.save(os.path.join(args.checkpoint, "model.safetensors"))
            opt.save(os.path.join(args.checkpoint, "optimizer.safetensors"))
            if rank == 0:
                with open(os.path.join(args.checkpoint, "progress.json"), "w") as f:
                    json.dump({"epoch": epoch + 1, "scheduler": sched.state_dict() if sched else None}, f)
        if args.stop_after is not None and epoch + 1 >= args.stop_after:
            say(f"stopped after epoch {epoch + 1}")
            break

    predict = rlx.compile(lambda m, x: m(x), model, {"x": rlx.InputSpec(xte.shape)}, device=args.device)
    acc = float((predict(x=xte).argmax(axis=1) == yte).mean())
    full = [dt for n, dt in times if n == args.batch // world][1:]  # the first call also compiled
    say(f"test accuracy: {acc:.4f}" + (f" ({world} ranks)" if world > 1 else ""))
    if full:
        per = f"batch {args.batch // world} per rank" if world > 1 else f"batch {args.batch}"
        say(f"median step: {statistics.median(full) * 1e3:.3f} ms ({per}); "
            f"compile + first step {times[0][1] * 1e3 + compile_s * 1e3:.1f} ms")
    if times:  # (each batch size compiles at its first step: with no step, nothing was compiled)
        mem = step.memory()
        say(f"arena: {mem['arena_bytes']:,} bytes planned vs {mem['naive_bytes']:,} naive "
            f"({mem['arena_bytes'] / mem['naive_bytes']:.0%}); weights {mem['param_bytes']:,} bytes")
    if args.save:
        model.save(args.save)
        say(f"saved weights to {args.save}")


if __name__ == "__main__":
    main()
