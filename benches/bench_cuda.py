"""CUDA benchmark: training-step time of rlx on device="cuda" against PyTorch eager (and JAX for
the MLP) in one process on one GPU, float32 (no TF32), the loss read back as a Python float
every step.

    python benches/bench_cuda.py                 # all workloads
    python benches/bench_cuda.py --steps 50      # fewer timed steps

Workloads:
  mlp64, mlp4096  digits-MLP shape 64-256-256-10 ReLU, mean softmax-CE, Adam(1e-3), batch 64 / 4096
                  (random inputs of the digits' shape).
  gpt             tiny GPT (vocab 256, d128, 4 heads, 2 pre-LN blocks, T64, B16), AdamW(1e-3, wd 0.01).
  gpt768          GPT d768, 12 layers, 12 heads, T256, B16, vocab 256, AdamW (fewer steps).
  gpt768bf16      the same with precision="bf16", against PyTorch under torch.autocast(bfloat16),
                  eager and through torch.compile (printed below the table).
  first           rlx: seconds from compile_train_step to the end of the first step of the tiny
                  GPT, in a fresh process with the PTX disk cache off (cold NVRTC) and on (warm).
Each cell is the median step time in ms over --steps steps after --warmup steps. "memory" is rlx's
planned device bytes (arena + weights + optimizer state + per-program workspace, step.memory()) against PyTorch's
torch.cuda.max_memory_allocated() for the same step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))


def timed(step, n, warmup):
    for _ in range(warmup):
        step()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def mlp_data(batch, seed=0):
    rng = np.random.default_rng(seed)
    return rng.random((batch, 64), dtype=np.float32), rng.integers(0, 10, batch).astype(np.int32)


MEM = {}


def rlx_mlp(batch, n, warmup):
    from digits_mlp import MLP, loss_fn

    import rlx

    rlx.seed(0)
    x, y = mlp_data(batch)
    specs = {"x": rlx.InputSpec(x.shape), "y": rlx.InputSpec(y.shape, "int32")}
    step = rlx.compile_train_step(loss_fn, MLP(), rlx.optim.Adam(lr=1e-3), specs, device="cuda")
    ms = timed(lambda: float(step(x=x, y=y)), n, warmup)
    MEM[f"rlx mlp{batch}"] = sum(step.memory()[k] for k in ("arena_bytes", "param_bytes", "optimizer_state_bytes", "workspace_bytes"))
    return ms


def torch_mlp(batch, n, warmup):
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = "cuda"
    m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                            torch.nn.ReLU(), torch.nn.Linear(256, 10)).to(dev)
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    x, y = mlp_data(batch)
    x, y = torch.tensor(x, device=dev), torch.tensor(y, device=dev, dtype=torch.long)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    torch.cuda.reset_peak_memory_stats()
    ms = timed(step, n, warmup)
    MEM[f"torch mlp{batch}"] = torch.cuda.max_memory_allocated()
    return ms


def jax_mlp(batch, n, warmup):
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_default_matmul_precision", "highest")
    key = jax.random.PRNGKey(0)
    ks = jax.random.split(key, 3)
    sizes = [(64, 256), (256, 256), (256, 10)]
    params = [(jax.random.normal(k, s) * (1.0 / np.sqrt(s[0])), jnp.zeros(s[1])) for k, s in zip(ks, sizes)]
    m = [(jnp.zeros_like(w), jnp.zeros_like(b)) for w, b in params]
    v = [(jnp.zeros_like(w), jnp.zeros_like(b)) for w, b in params]

    def loss_fn(params, x, y):
        h = x
        for i, (w, b) in enumerate(params):
            h = h @ w + b
            if i < 2:
                h = jax.nn.relu(h)
        lp = jax.nn.log_softmax(h)
        return -jnp.mean(lp[jnp.arange(y.shape[0]), y])

    @jax.jit
    def step(params, m, v, t, x, y):
        loss, g = jax.value_and_grad(loss_fn)(params, x, y)
        b1, b2, lr, eps = 0.9, 0.999, 1e-3, 1e-8
        m = jax.tree.map(lambda a, b: b1 * a + (1 - b1) * b, m, g)
        v = jax.tree.map(lambda a, b: b2 * a + (1 - b2) * b * b, v, g)
        params = jax.tree.map(lambda p, a, c: p - lr * (a / (1 - b1**t)) / (jnp.sqrt(c / (1 - b2**t)) + eps),
                              params, m, v)
        return params, m, v, loss

    x, y = mlp_data(batch)
    x, y = jnp.asarray(x), jnp.asarray(y)
    state = {"p": params, "m": m, "v": v, "t": 1.0}

    def one():
        state["p"], state["m"], state["v"], loss = step(state["p"], state["m"], state["v"], state["t"], x, y)
        state["t"] += 1.0
        return float(loss)

    return timed(one, n, warmup)


GPT = dict(vocab=256, dim=128, heads=4, layers=2, seq_len=64)
B = 16
BIG = dict(vocab=256, dim=768, heads=12, layers=12, seq_len=256)


def gpt_data(seed=0):
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, GPT["vocab"], (B, GPT["seq_len"])).astype(np.int32)
    return idx, np.roll(idx, -1, axis=1)


def rlx_gpt(n, warmup, cfg=None, precision="fp32"):
    import rlx

    if cfg is not None:
        GPT.update(cfg)
    rlx.seed(0)
    t0 = time.perf_counter()
    model = rlx.models.GPT(**GPT)
    T, V = GPT["seq_len"], GPT["vocab"]

    def loss(m, idx, tgt):
        return rlx.cross_entropy(m(idx).reshape(B * T, V), tgt.reshape(B * T))

    idx, tgt = gpt_data()
    specs = {"idx": rlx.InputSpec(idx.shape, "int32"), "tgt": rlx.InputSpec(tgt.shape, "int32")}
    step = rlx.compile_train_step(loss, model, rlx.optim.AdamW(lr=1e-3, weight_decay=0.01), specs, device="cuda",
                                  precision=precision)
    float(step(idx=idx, tgt=tgt))
    first = time.perf_counter() - t0
    ms = timed(lambda: float(step(idx=idx, tgt=tgt)), n, warmup)
    MEM[f"rlx gpt d{GPT['dim']} {precision}"] = sum(
        step.memory()[k] for k in ("arena_bytes", "param_bytes", "optimizer_state_bytes", "workspace_bytes"))
    return ms, first


def torch_gpt(n, warmup, cfg=None, precision="fp32", compiled=False):
    """PyTorch's step; ``precision="bf16"`` under ``torch.autocast`` (bfloat16 products),
    ``compiled`` through ``torch.compile``."""
    import contextlib

    import torch
    import torch.nn as nn

    if cfg is not None:
        GPT.update(cfg)
    torch.backends.cuda.matmul.allow_tf32 = False
    d, h, T, V = GPT["dim"], GPT["heads"], GPT["seq_len"], GPT["vocab"]

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
            sh = lambda t: t.view(B, T, h, d // h).transpose(1, 2)  # noqa: E731
            att = (sh(q) @ sh(k).transpose(-1, -2)) / (d // h) ** 0.5
            att = att.masked_fill(torch.ones(T, T, device=x.device).tril() == 0, float("-inf")).softmax(-1)
            x = x + self.proj((att @ sh(v)).transpose(1, 2).reshape(B, T, d))
            return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x)), approximate="tanh"))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos = nn.Embedding(V, d), nn.Embedding(T, d)
            self.blocks = nn.Sequential(*[Block() for _ in range(GPT["layers"])])
            self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, V, bias=False)

        def forward(self, idx):
            x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
            return self.head(self.ln(self.blocks(x)))

    m = Net().cuda()
    fwd = torch.compile(m) if compiled else m
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01)
    idx, tgt = gpt_data()
    idx, tgt = torch.tensor(idx, device="cuda").long(), torch.tensor(tgt, device="cuda").long()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()

    def step():
        opt.zero_grad(set_to_none=True)
        with autocast:
            loss = nn.functional.cross_entropy(fwd(idx).view(B * T, V), tgt.view(B * T))
        loss.backward()
        opt.step()
        return loss.item()

    torch.cuda.reset_peak_memory_stats()
    ms = timed(step, n, warmup)
    MEM[f"torch gpt d{GPT['dim']} {precision}{' compiled' if compiled else ''}"] = torch.cuda.max_memory_allocated()
    return ms


def first_step(cache):
    """Seconds to the end of the first tiny-GPT step in a fresh process (PTX cache on or off)."""
    import subprocess

    env = dict(os.environ)
    if not cache:
        env["RLX_CUDA_CACHE"] = "0"
    code = f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); " \
           "import bench_cuda as b; print(b.rlx_gpt(1, 0)[1])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    return float(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--only", default="mlp64,mlp4096,gpt,first,gpt768")
    ap.add_argument("--rlx-only", action="store_true", help="time rlx alone (A/B runs)")
    a = ap.parse_args()
    only = a.only.split(",")
    rows = []

    def cell(f, *args):
        if a.rlx_only and not f.__name__.startswith("rlx"):
            return float("nan")
        try:
            return f(*args)
        except Exception as e:  # a framework missing or failing: say so in the table
            print(f"  ({f.__name__} failed: {type(e).__name__}: {e})", file=sys.stderr)
            return float("nan")

    for name, batch in (("mlp64", 64), ("mlp4096", 4096)):
        if name in only:
            rows.append((f"digits MLP B{batch} (Adam)", cell(rlx_mlp, batch, a.steps, a.warmup),
                         cell(torch_mlp, batch, a.steps, a.warmup), cell(jax_mlp, batch, a.steps, a.warmup)))
    first = float("nan")
    if "gpt" in only:
        r = cell(rlx_gpt, a.steps, a.warmup)
        ms, first = r if isinstance(r, tuple) else (r, float("nan"))
        rows.append(("tiny GPT B16 T64 (AdamW)", ms, cell(torch_gpt, a.steps, a.warmup), float("nan")))
    if "gpt768" in only:
        r = cell(rlx_gpt, 10, 3, BIG)
        ms = r[0] if isinstance(r, tuple) else r
        rows.append(("GPT d768 L12 H12 T256 B16 (AdamW)", ms, cell(torch_gpt, 10, 3, BIG), float("nan")))
    if "gpt768bf16" in only:
        r = cell(rlx_gpt, 20, 5, BIG, "bf16")
        ms = r[0] if isinstance(r, tuple) else r
        rows.append(("GPT d768 bf16 mixed precision (AdamW)", ms, cell(torch_gpt, 20, 5, BIG, "bf16"), float("nan")))
        compiled_ms = cell(torch_gpt, 20, 10, BIG, "bf16", True)
        print(f"GPT d768 bf16: torch.compile + autocast bf16 step {compiled_ms:.3f} ms")
    colds = (cell(first_step, False), cell(first_step, True)) if "first" in only else (float("nan"),) * 2
    import torch

    print(f"GPU: {torch.cuda.get_device_name(0)}; torch {torch.__version__}")
    print("| workload | rlx cuda ms | PyTorch eager ms | JAX jit ms |")
    print("|---|---|---|---|")
    for name, r, t, j in rows:
        print(f"| {name} | {r:.3f} | {t:.3f} | {j:.3f} |")
    print(f"first step incl. compile, tiny GPT (rlx, in-process after other workloads): {first:.2f} s")
    print(f"first step incl. compile, tiny GPT (rlx, fresh process): PTX cache off {colds[0]:.2f} s, "
          f"on {colds[1]:.2f} s")
    for k, v in MEM.items():
        print(f"memory {k}: {v / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
