"""Soak test (not part of CI): train for many steps and watch the resident memory for leaks.

Trains the digits MLP (64-256-256-10, ReLU, Adam lr 1e-3, batch 64, explicit ``step(x=, y=)``
calls plus a periodic evaluation through a compiled inference function, ``step.grads`` and
``step.memory()``) and/or the tiny byte-level GPT (``rlx.models.GPT()`` defaults, AdamW, batch 16,
the ``step.prefetch`` pipeline). Every ``--every`` steps it samples the resident set size from
``/proc/self/statm``, prints the samples, and fits a least-squares line through the samples after
the first 10% of the steps (warm-up): the slope, in KB per 1,000 steps, should be ~0.

    python scripts/soak.py                      # both: MLP 10,000 steps, GPT 2,000 steps
    python scripts/soak.py --mlp --steps 3000   # only the MLP, 3,000 steps
    python scripts/soak.py --gpt --steps 400    # only the GPT
    python scripts/soak.py --max-slope 64       # exit 1 if a slope exceeds 64 KB / 1k steps
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

import rlx

HERE = os.path.dirname(os.path.abspath(__file__))
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_kb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE / 1024.0


def slope_kb_per_1k(samples: list[tuple[int, float]], total: int) -> float:
    """Least-squares slope of RSS (KB) against the step, per 1,000 steps, after 10% warm-up."""
    pts = [(s, r) for s, r in samples if s >= 0.1 * total]
    if len(pts) < 2:
        return float("nan")
    x = np.array([p[0] for p in pts], np.float64)
    y = np.array([p[1] for p in pts], np.float64)
    x_mean = x.mean()
    denom = float(((x - x_mean) ** 2).sum())
    if denom == 0:
        return float("nan")
    return float(((x - x_mean) * (y - y.mean())).sum() / denom * 1000.0)


def report(name: str, samples: list[tuple[int, float]], total: int, seconds: float) -> float:
    slope = slope_kb_per_1k(samples, total)
    print(f"\n== {name}: {total} steps in {seconds:.1f} s ({total / seconds:.0f} steps/s)")
    print(f"{'step':>8} {'rss_kb':>12} {'delta_kb':>10}")
    base = samples[0][1]
    for s, r in samples:
        print(f"{s:>8} {r:>12.0f} {r - base:>+10.0f}")
    print(f"{name}: RSS slope after {int(0.1 * total)} warm-up steps: {slope:+.1f} KB per 1,000 steps "
          f"(first {samples[0][1] / 1024:.1f} MiB, last {samples[-1][1] / 1024:.1f} MiB)")
    return slope


# ----------------------------------------------------------------------------------------------
# the digits MLP
# ----------------------------------------------------------------------------------------------
def soak_mlp(steps: int, every: int, batch: int = 64, seed: int = 0) -> float:
    sys.path.insert(0, os.path.join(HERE, "..", "examples"))
    from digits_mlp import MLP, digits_split

    xtr, xte, ytr, yte = digits_split()
    rlx.seed(seed)
    model = MLP()
    step = rlx.compile_train_step(lambda m, x, y: rlx.cross_entropy(m(x), y), model,
                                  rlx.optim.Adam(lr=1e-3),
                                  {"x": rlx.InputSpec((batch, 64)), "y": rlx.InputSpec((batch,), "int32")})
    predict = rlx.compile(lambda m, x: m(x), model, {"x": rlx.InputSpec(xte.shape)})
    rng = np.random.default_rng(seed)
    perm, pos = rng.permutation(len(xtr)), 0
    samples: list[tuple[int, float]] = []
    loss = float("nan")
    t0 = time.perf_counter()
    for s in range(steps + 1):
        if s % every == 0:
            acc = float((predict(x=xte).argmax(axis=1) == yte).mean())
            _ = step.grads["fc1.weight"].sum(), step.memory()
            samples.append((s, rss_kb()))
            print(f"mlp step {s:>6}  loss {loss:.4f}  test acc {acc:.3f}  rss {samples[-1][1] / 1024:.1f} MiB",
                  flush=True)
        if s == steps:
            break
        if pos + batch > len(perm):
            perm, pos = rng.permutation(len(xtr)), 0
        idx = perm[pos:pos + batch]
        pos += batch
        loss = step(x=xtr[idx], y=ytr[idx])
    return report("digits MLP", samples, steps, time.perf_counter() - t0)


# ----------------------------------------------------------------------------------------------
# the tiny GPT
# ----------------------------------------------------------------------------------------------
def soak_gpt(steps: int, every: int, batch: int = 16, seed: int = 0) -> float:
    sys.path.insert(0, os.path.join(HERE, "..", "examples"))
    import gpt_data

    rlx.seed(seed)
    model = rlx.models.GPT()
    T = model.seq_len
    train, _ = gpt_data.corpus()
    offsets = gpt_data.batch_offsets(len(train), steps + 1, batch, T, seed=seed)
    spec = {"idx": rlx.InputSpec((batch, T), "int32"), "targets": rlx.InputSpec((batch, T), "int32")}
    step = rlx.compile_train_step(lambda m, idx, targets: m.loss(idx, targets), model,
                                  rlx.optim.AdamW(lr=1e-3, weight_decay=0.01), spec)

    def feed(s):
        x, y = gpt_data.batch(train, offsets[s], T)
        step.prefetch(idx=x, targets=y)

    samples: list[tuple[int, float]] = []
    loss = float("nan")
    t0 = time.perf_counter()
    feed(0)
    for s in range(steps + 1):
        if s % every == 0:
            _ = step.memory()
            samples.append((s, rss_kb()))
            print(f"gpt step {s:>6}  loss {loss:.4f}  rss {samples[-1][1] / 1024:.1f} MiB", flush=True)
        if s == steps:
            break
        if s + 1 < steps:
            feed(s + 1)  # copy the next batch while this one computes
        loss = step()
    return report("tiny GPT", samples, steps, time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mlp", action="store_true", help="soak the digits MLP (default: both)")
    ap.add_argument("--gpt", action="store_true", help="soak the tiny GPT (default: both)")
    ap.add_argument("--steps", type=int, default=None,
                    help="steps for the selected runs (default: MLP 10,000, GPT 2,000)")
    ap.add_argument("--mlp-steps", type=int, default=10_000)
    ap.add_argument("--gpt-steps", type=int, default=2_000)
    ap.add_argument("--every", type=int, default=200, help="sample the RSS every N steps")
    ap.add_argument("--max-slope", type=float, default=None,
                    help="exit with status 1 when a slope exceeds this many KB per 1,000 steps")
    args = ap.parse_args()
    both = not (args.mlp or args.gpt)
    slopes = {}
    if args.mlp or both:
        slopes["mlp"] = soak_mlp(args.steps or args.mlp_steps, args.every)
    if args.gpt or both:
        slopes["gpt"] = soak_gpt(args.steps or args.gpt_steps, args.every)
    print("\nsummary: " + ", ".join(f"{k} {v:+.1f} KB/1k steps" for k, v in slopes.items()))
    if args.max_slope is not None and any(v > args.max_slope for v in slopes.values()):
        print(f"FAIL: a slope exceeds {args.max_slope} KB per 1,000 steps")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
