"""GEMM study (issue 11): rlx's matrix products (its own GEMM, and the `gemm` crate it used before,
selected with RLX_CPU_GEMM=crate) against torch.matmul (the BLAS PyTorch uses) on the exact shapes
of the benchmark workloads, both transposes, each in its own process pinned to the same cores.
The three are measured in alternation, round after round (the machine may be shared: each sees the
same load), and each cell is the best round; the spread is the median round's time over the best.

    taskset -c 0,1 python benches/gemm_study.py            # prints one markdown table

rlx side: a one-matmul graph with resident inputs, run with RLX_PROFILE=1 so the time is the
kernel's alone (no copy of the result); the kernel time per call is the profile's total / calls of
an executable compiled after a warm-up one (thread pool and packing buffers already made).
PyTorch side: torch.matmul(a, b, out=c) on views that transpose the stored operand (as autograd
calls it), with as many threads as the process may use; best of
several rounds of timed loops.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import numpy as np

# (label, m, k, n, trans_a, trans_b): C (m x n) = op(A) @ op(B); op(A) is m x k, op(B) k x n.
SHAPES = [
    ("gpt qkv fwd", 1024, 128, 384, False, True),
    ("gpt proj fwd", 1024, 128, 128, False, True),
    ("gpt fc1 fwd", 1024, 128, 512, False, True),
    ("gpt fc2 fwd", 1024, 512, 128, False, True),
    ("gpt head fwd", 1024, 128, 256, False, True),
    ("gpt qkv dX", 1024, 384, 128, False, False),
    ("gpt fc1 dX", 1024, 512, 128, False, False),
    ("gpt fc2 dX", 1024, 128, 512, False, False),
    ("gpt qkv dW", 384, 1024, 128, True, False),
    ("gpt fc1 dW", 512, 1024, 128, True, False),
    ("gpt fc2 dW", 128, 1024, 512, True, False),
    ("gpt head dW", 256, 1024, 128, True, False),
    ("gpt256 qkv fwd", 1024, 256, 768, False, True),
    ("gpt256 fc1 fwd", 1024, 256, 1024, False, True),
    ("gpt256 fc2 fwd", 1024, 1024, 256, False, True),
    ("gpt256 fc1 dX", 1024, 1024, 256, False, False),
    ("gpt256 fc2 dX", 1024, 256, 1024, False, False),
    ("gpt256 fc1 dW", 1024, 1024, 256, True, False),
    ("gpt256 fc2 dW", 256, 1024, 1024, True, False),
    ("gpt256 qkv dW", 768, 1024, 256, True, False),
    ("mlp64 l1 fwd", 64, 64, 256, False, True),
    ("mlp64 l2 fwd", 64, 256, 256, False, True),
    ("mlp64 l2 dW", 256, 64, 256, True, False),
    ("mlp512 l2 fwd", 512, 256, 256, False, True),
    ("mlp512 l2 dX", 512, 256, 256, False, False),
    ("mlp512 l2 dW", 256, 512, 256, True, False),
]
ROUNDS, CALLS = int(os.environ.get("ROUNDS", "5")), 50
if os.environ.get("ONLY"):  # e.g. ONLY=dW: the shapes whose label contains it
    SHAPES = [s for s in SHAPES if os.environ["ONLY"] in s[0]]


def stored(m: int, k: int, n: int, ta: bool, tb: bool, rng):
    a = rng.standard_normal((k, m) if ta else (m, k), dtype=np.float32)
    b = rng.standard_normal((n, k) if tb else (k, n), dtype=np.float32)
    return a, b


def child_rlx() -> dict:
    out = {}
    for label, m, k, n, ta, tb in SHAPES:
        a, b = stored(m, k, n, ta, tb, np.random.default_rng(0))
        best = float("inf")
        for _ in range(1):
            code = (
                "import sys, numpy as np, rlx\n"
                f"m,k,n,ta,tb={m},{k},{n},{ta},{tb}\n"
                "a=np.load(sys.argv[1]); b=np.load(sys.argv[2])\n"
                "g=rlx.Graph(); ga=g.input('a',a.shape); gb=g.input('b',b.shape)\n"
                "g.output(rlx.Tensor(ga._trace, ga._trace.graph.matmul(ga._id, gb._id, ta, tb)))\n"
                "for calls in (5, %d):  # a warm-up executable, then the measured one\n"
                "    e=g.compile('cpu'); e.bind('a',a); e.bind('b',b)\n"
                "    [e.run() for _ in range(calls)]\n"
                "    del e\n" % CALLS
            )
            best = min(best, profiled(code, a, b))
        out[label] = best
    return out


def profiled(code: str, a, b) -> float:
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        pa, pb = os.path.join(d, "a.npy"), os.path.join(d, "b.npy")
        np.save(pa, a)
        np.save(pb, b)
        r = subprocess.run([sys.executable, "-c", code, pa, pb], env={**os.environ, "RLX_PROFILE": "1"},
                           capture_output=True, text=True, check=True)
    times = []
    for line in r.stderr.splitlines():
        mm = re.match(r"\s+matmul\S* .*?\s([\d.]+) ms\s+[\d.]+%\s+(\d+) calls", line)
        if mm:
            times.append(float(mm.group(1)) / int(mm.group(2)) * 1e-3)
    if not times:
        raise RuntimeError(r.stderr)
    return times[-1]  # the measured executable's profile is printed last


def child_torch() -> dict:
    import torch
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    out = {}
    for label, m, k, n, ta, tb in SHAPES:
        a, b = stored(m, k, n, ta, tb, np.random.default_rng(0))
        ta_, tb_ = torch.from_numpy(a), torch.from_numpy(b)
        va, vb = (ta_.t() if ta else ta_), (tb_.t() if tb else tb_)
        c = torch.empty(m, n)
        best = float("inf")
        for _ in range(3):
            torch.matmul(va, vb, out=c)
            t0 = time.perf_counter()
            for _ in range(CALLS):
                torch.matmul(va, vb, out=c)
            best = min(best, (time.perf_counter() - t0) / CALLS)
        out[label] = best
    return out


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        fw = sys.argv[2]
        print("RESULT " + json.dumps(child_torch() if fw == "torch" else child_rlx()))
        return
    variants = {"rlx": {}, "crate": {"RLX_CPU_GEMM": "crate"}, "torch": {}}
    rounds = {fw: [] for fw in variants}
    for _ in range(ROUNDS):
        for fw, env in variants.items():
            r = subprocess.run([sys.executable, __file__, "--child", fw], capture_output=True, text=True,
                               check=True, env={**os.environ, **env})
            rounds[fw].append(json.loads(next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))[7:]))
    best = {fw: {s[0]: min(r[s[0]] for r in rs) for s in SHAPES} for fw, rs in rounds.items()}
    spread = {fw: {s[0]: float(np.median([r[s[0]] for r in rs])) / best[fw][s[0]] for s in SHAPES}
              for fw, rs in rounds.items()}
    print("| product | m x k x n | rlx | rlx, gemm crate | PyTorch | rlx / PyTorch | crate / PyTorch |")
    print("|---|---|---|---|---|---|---|")
    for label, m, k, n, ta, tb in SHAPES:
        gf = lambda s: 2 * m * k * n / s * 1e-9  # noqa: E731
        cell = lambda fw: (f"{best[fw][label] * 1e6:.0f} us ({gf(best[fw][label]):.0f} GFLOP/s, "  # noqa: E731
                           f"+{(spread[fw][label] - 1) * 100:.0f} %)")
        flags = ("A^T " if ta else "") + ("B^T" if tb else "")
        t = best["torch"][label]
        print(f"| {label} {flags.strip()} | {m}x{k}x{n} | {cell('rlx')} | {cell('crate')} | {cell('torch')} | "
              f"{best['rlx'][label] / t:.2f} | {best['crate'][label] / t:.2f} |")


if __name__ == "__main__":
    main()
