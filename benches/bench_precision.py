"""Mixed precision on the CPU, side by side in one run: rlx precision="fp32" / "bf16" against
PyTorch eager in float32 and under CPU autocast (bfloat16), 2 threads each.

    python benches/bench_precision.py                  # both workloads, a few minutes on 2 cores
    python benches/bench_precision.py --steps 30       # quicker
    python benches/bench_precision.py --curve 300      # also: tiny GPT loss, bf16 vs fp32, 300 steps
    python benches/bench_precision.py --gemm 512       # also: one n^3 GEMM, float32 vs both bf16 paths

Workloads:
  gpt   the tiny GPT of benches/bench_cpu.py (vocab 256, d128, 4 heads, 2 pre-LN blocks, B16 x T64,
        AdamW(1e-3, wd 0.01)); step = forward + backward + update + the loss read back.
  mlp   MLP 512-1024-1024-10 ReLU, softmax-CE, Adam(1e-3), batch 256 (big enough that the
        matmuls dominate).
Each (framework, precision, workload) runs in its own child process; a cell is the median step
time (ms) after warm-up steps. The load average (`uptime`) before and after is printed: on a
shared machine the numbers are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

THREADS = 2
GPT = dict(vocab=256, dim=128, heads=4, layers=2, seq=64, batch=16, lr=1e-3, wd=0.01)
MLP = dict(d_in=512, hidden=1024, classes=10, batch=256)


def gpt_batches(steps: int, seed: int = 0):
    # A learnable stream (a random walk over the vocabulary: each token is the last plus 1..3),
    # so the loss falls from ln(256) towards ln(3) and the curves have something to compare.
    rng = np.random.default_rng(seed)
    stream = np.cumsum(rng.integers(1, 4, 1 << 16)) % GPT["vocab"]
    for _ in range(steps):
        at = rng.integers(0, len(stream) - GPT["seq"] - 1, GPT["batch"])
        w = np.stack([stream[a:a + GPT["seq"] + 1] for a in at]).astype(np.int32)
        yield w[:, :-1], w[:, 1:]


def mlp_batches(steps: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(MLP["batch"], MLP["d_in"])).astype(np.float32)
    y = rng.integers(0, MLP["classes"], MLP["batch"]).astype(np.int32)
    for _ in range(steps):
        yield x, y


def rlx_step(workload: str, precision: str):
    import rlx
    rlx.seed(0)
    if workload == "gpt":
        model = rlx.models.GPT(vocab=GPT["vocab"], dim=GPT["dim"], heads=GPT["heads"], layers=GPT["layers"],
                               seq_len=GPT["seq"])
        spec = {"x": rlx.InputSpec((GPT["batch"], GPT["seq"]), "int32"),
                "y": rlx.InputSpec((GPT["batch"], GPT["seq"]), "int32")}
        step = rlx.compile_train_step(lambda m, x, y: m.loss(x, y), model,
                                      rlx.optim.AdamW(GPT["lr"], weight_decay=GPT["wd"]), spec, precision=precision)
    else:
        model = rlx.nn.Sequential(rlx.nn.Linear(MLP["d_in"], MLP["hidden"]), rlx.nn.ReLU(),
                                  rlx.nn.Linear(MLP["hidden"], MLP["hidden"]), rlx.nn.ReLU(),
                                  rlx.nn.Linear(MLP["hidden"], MLP["classes"]))
        spec = {"x": rlx.InputSpec((MLP["batch"], MLP["d_in"])), "y": rlx.InputSpec((MLP["batch"],), "int32")}
        step = rlx.compile_train_step(lambda m, x, y: rlx.cross_entropy(m(x), y), model, rlx.optim.Adam(1e-3), spec,
                                      precision=precision)
    return lambda x, y: float(step(x=x, y=y))


def torch_step(workload: str, precision: str):
    import torch
    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    F = torch.nn.functional
    if workload == "gpt":
        d, H = GPT["dim"], GPT["heads"]

        class Block(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
                self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
                self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

            def forward(self, x):
                B, T, _ = x.shape
                q, k, v = (t.reshape(B, T, H, d // H).transpose(1, 2) for t in self.qkv(self.ln1(x)).split(d, -1))
                a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                x = x + self.proj(a.transpose(1, 2).reshape(B, T, d))
                return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

        class Gpt(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.tok, self.pos = torch.nn.Embedding(GPT["vocab"], d), torch.nn.Embedding(GPT["seq"], d)
                self.blocks = torch.nn.Sequential(*[Block() for _ in range(GPT["layers"])])
                self.ln_f, self.head = torch.nn.LayerNorm(d), torch.nn.Linear(d, GPT["vocab"], bias=False)

            def forward(self, idx):
                x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
                return self.head(self.ln_f(self.blocks(x)))

        model = Gpt()
        opt = torch.optim.AdamW(model.parameters(), lr=GPT["lr"], weight_decay=GPT["wd"])
    else:
        model = torch.nn.Sequential(torch.nn.Linear(MLP["d_in"], MLP["hidden"]), torch.nn.ReLU(),
                                    torch.nn.Linear(MLP["hidden"], MLP["hidden"]), torch.nn.ReLU(),
                                    torch.nn.Linear(MLP["hidden"], MLP["classes"]))
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step(x, y):
        xs, ys = torch.from_numpy(x), torch.from_numpy(y).long()
        if workload == "gpt":
            xs = xs.long()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            logits = model(xs)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ys.reshape(-1))
        loss.backward()
        opt.step()
        return loss.item()
    return step


def child(fw: str, precision: str, workload: str, steps: int, warmup: int) -> dict:
    make = rlx_step if fw == "rlx" else torch_step
    t0 = time.perf_counter()
    step = make(workload, precision)
    batches = (gpt_batches if workload == "gpt" else mlp_batches)(steps + warmup)
    times, losses = [], []
    for i, (x, y) in enumerate(batches):
        t = time.perf_counter()
        losses.append(step(x, y))
        if i == 0:
            first = time.perf_counter() - t0
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return {"ms": 1e3 * statistics.median(times), "first_s": first, "loss": losses[-1], "losses": losses}


GEMM_CHILD = r"""
import sys, time, json
import ml_dtypes, numpy as np, rlx
from rlx import _rlx
n, dt = int(sys.argv[1]), sys.argv[2]
g = rlx.Graph()
x, y = g.input("a", (n, n), dt), g.input("b", (n, n), dt)
g.output(x @ y)
exe = g.compile("cpu")
a = np.random.default_rng(0).normal(size=(n, n)).astype(ml_dtypes.bfloat16 if dt == "bfloat16" else np.float32)
exe.run(a=a, b=a)
ts = []
for _ in range(10):
    t = time.perf_counter(); exe.run(a=a, b=a); ts.append(time.perf_counter() - t)
print(json.dumps({"path": _rlx.cpu_bf16_path(), "gflops": 2 * n ** 3 / min(ts) / 1e9}))
"""


def gemm_row(n: int, threads: int) -> str:
    cells = []
    for dt, path in (("float32", ""), ("bfloat16", ""), ("bfloat16", "avx512bf16")):
        env = {**os.environ, "RLX_NUM_THREADS": str(threads), "RLX_CPU_BF16": path}
        out = subprocess.run([sys.executable, "-c", GEMM_CHILD, str(n), dt], capture_output=True, text=True, env=env)
        r = json.loads(out.stdout) if out.returncode == 0 else {"path": "error", "gflops": float("nan")}
        cells.append(f"{r['gflops']:.0f} ({dt}, {r['path'] if dt == 'bfloat16' else 'gemm crate'})")
    return f"| GEMM n={n}, {threads} thread(s), GFLOP/s (best of 10) | " + " | ".join(cells) + " |"


def run_child(fw: str, precision: str, workload: str, steps: int, warmup: int) -> dict:
    env = {**os.environ, "RLX_NUM_THREADS": str(THREADS), "OMP_NUM_THREADS": str(THREADS)}
    out = subprocess.run([sys.executable, __file__, "--child", fw, precision, workload, str(steps), str(warmup)],
                         capture_output=True, text=True, env=env)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--only", default="gpt,mlp")
    ap.add_argument("--curve", type=int, default=0, help="also compare tiny-GPT losses over this many steps")
    ap.add_argument("--gemm", type=int, default=0, help="also time one n x n x n GEMM per path")
    ap.add_argument("--child", nargs=5)
    args = ap.parse_args()
    if args.child:
        fw, precision, workload, steps, warmup = args.child
        print(json.dumps(child(fw, precision, workload, int(steps), int(warmup))))
        return
    import rlx
    print(f"load before: {uptime()}")
    print(f"rlx bf16 matmul path: {rlx._rlx.cpu_bf16_path()}, {THREADS} threads, median of {args.steps} steps "
          f"after {args.warmup}")
    print("| workload | rlx fp32 ms | rlx bf16 ms | torch fp32 ms | torch autocast bf16 ms | rlx bf16 / torch bf16 |")
    print("|---|---|---|---|---|---|")
    for w in filter(None, args.only.split(",")):
        cells = {(fw, p): run_child(fw, p, w, args.steps, args.warmup)
                 for fw in ("rlx", "torch") for p in ("fp32", "bf16")}
        ms = {k: v.get("ms", float("nan")) for k, v in cells.items()}
        errs = [f"{k}: {v['error']}" for k, v in cells.items() if "error" in v]
        print(f"| {w} | {ms['rlx', 'fp32']:.2f} | {ms['rlx', 'bf16']:.2f} | {ms['torch', 'fp32']:.2f} | "
              f"{ms['torch', 'bf16']:.2f} | {ms['rlx', 'bf16'] / ms['torch', 'bf16']:.2f} |")
        for e in errs:
            print(f"  error {e}")
    if args.curve:
        f32 = run_child("rlx", "fp32", "gpt", args.curve, 0)["losses"]
        b16 = run_child("rlx", "bf16", "gpt", args.curve, 0)["losses"]
        a, b = np.array(f32).reshape(-1, 10).mean(1), np.array(b16).reshape(-1, 10).mean(1)
        rel = np.abs(b - a) / a
        print(f"tiny GPT loss over {args.curve} steps (10-step means): fp32 {a[0]:.4f} -> {a[-1]:.4f}, "
              f"bf16 {b[0]:.4f} -> {b[-1]:.4f}, max relative difference {rel.max():.2e}")
    if args.gemm:
        for threads in (1, THREADS):
            print(gemm_row(args.gemm, threads))
    print(f"load after: {uptime()}")


if __name__ == "__main__":
    main()
