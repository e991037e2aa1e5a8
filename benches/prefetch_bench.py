"""Prefetch benchmark: step time with and without asynchronous input copies, side by side.

A 32 MiB float32 batch (8192 x 1024) goes through a small model (Linear 1024->64, ReLU,
Linear 64->10, cross-entropy, SGD). Without prefetch each `step(x=..., y=...)` copies the batch
into the arena and then computes; with prefetch the copy of batch k+1 runs on the copy engine's
thread while batch k computes, so the step should approach max(copy, compute) rather than the sum.
Also measured alone: the copy (a prefetch followed by waiting for it) and the compute (a step on
already-resident inputs).

    python benches/prefetch_bench.py [--steps 30] [--rows 8192] [--cols 1024]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import rlx


class Small(rlx.nn.Module):
    def __init__(self, cols: int) -> None:
        self.fc1 = rlx.nn.Linear(cols, 64)
        self.fc2 = rlx.nn.Linear(64, 10)

    def __call__(self, x):
        return self.fc2(rlx.relu(self.fc1(x)))


def median_ms(ts: list[float]) -> float:
    return statistics.median(ts) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--cols", type=int, default=1024)
    args = ap.parse_args()
    rlx.seed(0)
    n, d = args.rows, args.cols
    model = Small(d)
    spec = {"x": rlx.InputSpec((n, d)), "y": rlx.InputSpec((n,), "int32")}
    step = rlx.compile_train_step(lambda m, x, y: rlx.cross_entropy(m(x), y), model, rlx.optim.SGD(lr=1e-3), spec)
    rng = np.random.default_rng(0)
    batches = [(rng.standard_normal((n, d), dtype=np.float32), rng.integers(0, 10, n).astype(np.int32))
               for _ in range(4)]
    mb = batches[0][0].nbytes / 2**20

    def plain() -> float:
        ts = []
        for k in range(args.steps):
            x, y = batches[k % 4]
            t = time.perf_counter()
            step(x=x, y=y)
            ts.append(time.perf_counter() - t)
        return median_ms(ts)

    def prefetched() -> float:
        ts = []
        step.prefetch(x=batches[0][0], y=batches[0][1])
        for k in range(args.steps):
            t = time.perf_counter()
            if k + 1 < args.steps:
                x, y = batches[(k + 1) % 4]
                step.prefetch(x=x, y=y)
            step()
            ts.append(time.perf_counter() - t)
        return median_ms(ts)

    plain()
    prefetched()  # warm-up
    rows = []
    for _ in range(3):  # alternate the two modes
        rows.append((plain(), prefetched()))
    no_pf = statistics.median(r[0] for r in rows)
    with_pf = statistics.median(r[1] for r in rows)
    # Compute alone: the second of two queued batches, whose copy finished during the first step.
    ts = []
    for k in range(args.steps):
        for j in (0, 1):
            step.prefetch(x=batches[(k + j) % 4][0], y=batches[(k + j) % 4][1])
        step()
        t = time.perf_counter()
        step()
        ts.append(time.perf_counter() - t)
    compute = median_ms(ts)
    dst = np.zeros_like(batches[0][0])  # touched once, as the arena slot is
    ts = []
    for k in range(args.steps):
        t = time.perf_counter()
        np.copyto(dst, batches[k % 4][0])
        ts.append(time.perf_counter() - t)
    copy = median_ms(ts)
    print(f"batch {mb:.0f} MiB ({n} x {d} float32), {args.steps} steps per run, medians of 3 alternating runs")
    print("| mode | step ms |")
    print("|---|---|")
    print(f"| without prefetch: step(x=..., y=...) | {no_pf:.2f} |")
    print(f"| with prefetch: prefetch(next); step() | {with_pf:.2f} |")
    print(f"| compute alone (inputs already copied) | {compute:.2f} |")
    print(f"| copy alone (numpy copyto into a resident buffer) | {copy:.2f} |")
    print(f"prefetch / no prefetch = {with_pf / no_pf:.2f}; max(copy, compute) = {max(copy, compute):.2f} ms, "
          f"sum = {copy + compute:.2f} ms")


if __name__ == "__main__":
    main()
