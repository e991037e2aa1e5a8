"""CPU benchmark of rlx against JAX (live) and PyTorch (live if installed, else the reference
figures recorded below in TORCH_REF), printed as one markdown table of rlx/anchor ratios.

    python benches/bench_cpu.py                       # full run, several minutes on 2 cores
    python benches/bench_cpu.py --quick               # smoke run: few steps, one round
    python benches/bench_cpu.py --only mlp64,gpt --json /tmp/bench.json

Workloads (the same specs as the reference figures):
  mlp64, mlp512  digits MLP 64-256-256-10 ReLU, mean softmax-CE, Adam(1e-3), batch 64 / 512.
                 Step = forward + backward + optimizer update + the loss read back as a Python
                 float. Median over 200 full-size steps after a warm-up of 2 epochs.
  gpt            tiny byte-level GPT (B16 x T64, d128, 4 heads, 2 pre-LN blocks, AdamW(1e-3, wd
                 0.01)); median of steps 20..120.
  gpt256         the same GPT at d256, 8 heads, 4 blocks, B8 x T128 (--gpt-steps // 2 steps).
  compile        first-step time: from calling compile_train_step until the first step returned
                 (rlx); the first call of the jitted step (JAX). Taken from the gpt and mlp64 runs.
  rss            peak RSS (ru_maxrss) of each training process; the digits MLP B=64 process is
                 the one with a target (<= 0.4 x PyTorch's 392 MB).
  sgemm          square float32 C = A @ B at n = 256..2048, GFLOP/s = 2n^3/t, median of repeats.
                 rlx: low-level Graph, inputs bound once (resident), so the timed exe.run() does
                 not copy the inputs but does return a fresh copy of C (counted in the time, like
                 the fresh array numpy's `a @ b` returns). JAX: jitted matmul on device arrays.

Every (framework, workload) pair runs in its own child process (`--child FW WORKLOAD`), so peak
RSS is that process's alone and no framework shares a process with another. Frameworks alternate
within each round (rlx, jax / jax, rlx) over --rounds rounds; a cell is the median over rounds.
Other processes' CPU use during each child is measured from /proc/stat; rows with a contended
run (> 0.3 cores used by others) are marked with '*'.
"""

from __future__ import annotations

import argparse
import glob
import importlib.metadata
import importlib.util
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(HERE, "..", "examples")

WORKLOADS = ("mlp64", "mlp512", "gpt", "gpt256", "sgemm", "rss", "compile")
SGEMM_SIZES = (256, 512, 1024, 2048)

# PyTorch (and, for context, JAX/numpy) reference figures of these workloads, recorded here
# (2026-12-02, 2 threads, torch 2.13.0+cpu eager unless noted). That run was on an Intel Xeon
# (family 6 model 167) with 2 vCPUs, not necessarily the machine this script runs on.
REF_MACHINE = "Intel(R) Xeon(R) Processor (family 6 model 167), 2 vCPUs"
TORCH_REF = {
    "mlp64.step_ms": 0.83, "mlp512.step_ms": 1.92, "gpt.step_ms": 19.42,
    "mlp64.first_step_s": 0.01, "gpt.first_step_s": 17.67,  # gpt: torch.compile, cold cache
    "mlp64.rss_mb": 392, "mlp512.rss_mb": 396, "gpt.rss_mb": 370,
    "sgemm.256": 316, "sgemm.512": 333, "sgemm.1024": 340, "sgemm.2048": 361,
}
JAX_REF = {"mlp64.step_ms": 0.51, "mlp512.step_ms": 1.64, "gpt.step_ms": 46.46,
           "mlp64.first_step_s": 0.49, "gpt.first_step_s": 1.72}
NUMPY_REF = {"sgemm.256": 242, "sgemm.512": 270, "sgemm.1024": 314, "sgemm.2048": 323}

# Targets (rlx side). Only the RSS one is set; add more here as (op, value) with op "<=" or ">=".
TARGETS = {"mlp64.rss_mb": ("<=", 0.4 * 392)}

MLP_SIZES = (64, 256, 256, 10)
GPT = dict(vocab=256, dim=128, heads=4, layers=2, mlp=4, seq=64, batch=16, lr=1e-3, wd=0.01,
           std=0.02, ln_eps=1e-5)
# A larger GPT (issue 11's "other sizes"): d256, 8 heads, 4 blocks, T128, B8 (workload `gpt256`;
# its child is `gpt_large`). About 20 GFLOP a step, 80 % of it matrix products.
GPT_LARGE = dict(dim=256, heads=8, layers=4, seq=128, batch=8)
BETAS, ADAM_EPS = (0.9, 0.999), 1e-8


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def summarize(times: list[float]) -> dict:
    return dict(step_ms=statistics.median(times) * 1e3,
                step_ms_p10=float(np.percentile(times, 10)) * 1e3,
                step_ms_p90=float(np.percentile(times, 90)) * 1e3, n_timed=len(times))


# ============================================================================================
# children: one framework, one workload, one process. Each prints a single "RESULT {json}" line.
# ============================================================================================

# ---- digits MLP ----------------------------------------------------------------------------
def digits_train() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    y = d.target.astype(np.int32)
    xtr, _, ytr, _ = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    return xtr, ytr


def full_batches(n: int, batch: int, first_epoch: int, seed: int = 0):
    """Endless stream of full-size index batches, epoch e shuffled by default_rng(seed + e)."""
    epoch = first_epoch
    while True:
        perm = np.random.default_rng(seed + epoch).permutation(n)
        for i in range(0, n - batch + 1, batch):
            yield perm[i:i + batch]
        epoch += 1


def mlp_rlx(batch: int):
    """Returns (first_step(x, y) -> loss, step(x, y) -> loss); first_step includes compiling."""
    import rlx

    sys.path.insert(0, EXAMPLES)
    from digits_mlp import MLP

    rlx.seed(0)
    model, opt = MLP(), rlx.optim.Adam(lr=1e-3)
    holder = {}

    def first(x, y):
        spec = {"x": rlx.InputSpec((batch, 64)), "y": rlx.InputSpec((batch,), "int32")}
        holder["step"] = rlx.compile_train_step(lambda m, x, y: rlx.cross_entropy(m(x), y), model, opt, spec)
        return step(x, y)

    def step(x, y):
        return float(holder["step"](x=x, y=y))
    return first, step


def adam_jax(lr: float, wd: float = 0.0):
    """torch.optim.Adam / AdamW update (decoupled weight decay when wd > 0) over a pytree."""
    import jax
    import jax.numpy as jnp
    b1, b2 = BETAS

    def update(p, g, m, v, t):
        t = t + 1
        tf = t.astype(jnp.float32)
        bc1, bc2 = 1 - b1 ** tf, 1 - b2 ** tf
        m = jax.tree_util.tree_map(lambda m, g: b1 * m + (1 - b1) * g, m, g)
        v = jax.tree_util.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, v, g)

        def upd(p, m, v):
            if wd:
                p = p * (1 - lr * wd)
            return p - (lr / bc1) * m / (jnp.sqrt(v) / jnp.sqrt(bc2) + ADAM_EPS)
        return jax.tree_util.tree_map(upd, p, m, v), m, v, t
    return update


def jax_trainer(loss_fn, params: dict, lr: float, wd: float = 0.0):
    """Jitted train step with donated params / optimizer state; returns step(*batch) -> float."""
    import jax
    import jax.numpy as jnp
    update = adam_jax(lr, wd)

    def train_step(p, m, v, t, *batch):
        loss, g = jax.value_and_grad(loss_fn)(p, *batch)
        p, m, v, t = update(p, g, m, v, t)
        return p, m, v, t, loss

    jitted = jax.jit(train_step, donate_argnums=(0, 1, 2, 3))
    state = [jax.tree_util.tree_map(jnp.asarray, params)]
    state += [jax.tree_util.tree_map(jnp.zeros_like, state[0]) for _ in range(2)]
    state.append(jnp.zeros((), jnp.int32))

    def step(*batch):
        *new, loss = jitted(*state, *batch)
        state[:] = new
        return float(loss)
    return step


def xent_jax(logits, y):
    import jax
    import jax.numpy as jnp
    logp = jax.nn.log_softmax(logits.reshape(-1, logits.shape[-1]), axis=-1)
    return -jnp.take_along_axis(logp, y.reshape(-1, 1), axis=1).mean()


def mlp_jax(batch: int):
    import jax
    rng = np.random.default_rng(0)
    params = {}
    for i, (a, b) in enumerate(zip(MLP_SIZES[:-1], MLP_SIZES[1:])):
        bound = 1 / np.sqrt(a)
        params[f"w{i}"] = rng.uniform(-bound, bound, (a, b)).astype(np.float32)
        params[f"b{i}"] = rng.uniform(-bound, bound, (b,)).astype(np.float32)

    def loss_fn(p, x, y):
        h = jax.nn.relu(x @ p["w0"] + p["b0"])
        h = jax.nn.relu(h @ p["w1"] + p["b1"])
        return xent_jax(h @ p["w2"] + p["b2"], y)
    step = jax_trainer(loss_fn, params, 1e-3)
    return step, step  # the first call of the jitted step compiles it


def torch_threads():
    import torch
    torch.set_num_threads(len(os.sched_getaffinity(0)))  # the cores this process may use
    return torch


def mlp_torch(batch: int):
    torch = torch_threads()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10))  # default init = U(+-1/sqrt(fan_in))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y).long())
        loss.backward()
        opt.step()
        return loss.item()
    return step, step


def child_mlp(fw: str, batch: int, steps: int) -> dict:
    xtr, ytr = digits_train()
    rss_data = peak_rss_mb()
    first, step = {"rlx": mlp_rlx, "jax": mlp_jax, "torch": mlp_torch}[fw](batch)
    warm = full_batches(len(xtr), batch, first_epoch=1000)
    idx = next(warm)
    x, y = xtr[idx], ytr[idx]
    t0 = time.perf_counter()
    loss_first = first(x, y)
    first_step_s = time.perf_counter() - t0
    for _ in range(max(20, 2 * (len(xtr) // batch))):  # warm-up: >= 2 epochs of full batches
        idx = next(warm)
        step(xtr[idx], ytr[idx])
    times, stream = [], full_batches(len(xtr), batch, first_epoch=0)
    for _ in range(steps):
        idx = next(stream)
        x, y = xtr[idx], ytr[idx]  # gathered outside the timer
        t0 = time.perf_counter()
        loss = step(x, y)
        times.append(time.perf_counter() - t0)
    return dict(first_step_s=first_step_s, loss_first=loss_first, loss_last=loss, rss_after_data_mb=rss_data,
                **summarize(times))


# ---- tiny GPT ------------------------------------------------------------------------------
def gpt_rlx():
    import rlx
    rlx.seed(0)
    model = rlx.models.GPT(vocab=GPT["vocab"], dim=GPT["dim"], heads=GPT["heads"], layers=GPT["layers"],
                           seq_len=GPT["seq"], mlp_ratio=GPT["mlp"])
    opt = rlx.optim.AdamW(lr=GPT["lr"], weight_decay=GPT["wd"])
    holder = {}
    B, T = GPT["batch"], GPT["seq"]

    def first(x, y):
        spec = {"idx": rlx.InputSpec((B, T), "int32"), "targets": rlx.InputSpec((B, T), "int32")}
        holder["step"] = rlx.compile_train_step(lambda m, idx, targets: m.loss(idx, targets), model, opt, spec)
        return step(x, y)

    def step(x, y):
        return float(holder["step"](idx=x, targets=y))
    return first, step


def gpt_params_np(rng: np.random.Generator) -> dict:
    """Spec init: Linear weights (in, out) and embeddings ~ N(0, 0.02), biases 0, LayerNorm (1, 0)."""
    d, V, T, s = GPT["dim"], GPT["vocab"], GPT["seq"], GPT["std"]
    normal = lambda *shape: (rng.standard_normal(shape) * s).astype(np.float32)  # noqa: E731
    zeros = lambda n: np.zeros(n, np.float32)  # noqa: E731
    ones = lambda n: np.ones(n, np.float32)  # noqa: E731
    p = dict(tok=normal(V, d), pos=normal(T, d), lnf_g=ones(d), lnf_b=zeros(d), head=normal(d, V))
    for i in range(GPT["layers"]):
        m = GPT["mlp"] * d
        p.update({f"{i}.ln1_g": ones(d), f"{i}.ln1_b": zeros(d), f"{i}.wqkv": normal(d, 3 * d),
                  f"{i}.bqkv": zeros(3 * d), f"{i}.wo": normal(d, d), f"{i}.bo": zeros(d),
                  f"{i}.ln2_g": ones(d), f"{i}.ln2_b": zeros(d), f"{i}.w1": normal(d, m), f"{i}.b1": zeros(m),
                  f"{i}.w2": normal(m, d), f"{i}.b2": zeros(d)})
    return p


def gpt_jax():
    import jax
    import jax.numpy as jnp
    H = GPT["heads"]

    def ln(x, g, b):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) * jax.lax.rsqrt(var + GPT["ln_eps"]) * g + b

    def loss_fn(p, idx, targets):
        B, T = idx.shape
        d = p["tok"].shape[1]
        hd = d // H
        causal = jnp.tril(jnp.ones((T, T), bool))
        x = p["tok"][idx] + p["pos"][:T]
        for i in range(GPT["layers"]):
            q = lambda name: p[f"{i}.{name}"]  # noqa: E731
            qkv = ln(x, q("ln1_g"), q("ln1_b")) @ q("wqkv") + q("bqkv")
            qh, kh, vh = (t.reshape(B, T, H, hd).transpose(0, 2, 1, 3) for t in jnp.split(qkv, 3, axis=-1))
            att = (qh @ kh.transpose(0, 1, 3, 2)) * np.float32(1 / np.sqrt(hd))
            att = jax.nn.softmax(jnp.where(causal, att, -jnp.inf), axis=-1)
            x = x + (att @ vh).transpose(0, 2, 1, 3).reshape(B, T, d) @ q("wo") + q("bo")
            h = jax.nn.gelu(ln(x, q("ln2_g"), q("ln2_b")) @ q("w1") + q("b1"), approximate=False)
            x = x + h @ q("w2") + q("b2")
        return xent_jax(ln(x, p["lnf_g"], p["lnf_b"]) @ p["head"], targets)

    step = jax_trainer(loss_fn, gpt_params_np(np.random.default_rng(0)), GPT["lr"], GPT["wd"])
    return step, step


def gpt_torch():
    torch = torch_threads()
    F = torch.nn.functional
    torch.manual_seed(0)
    d, H = GPT["dim"], GPT["heads"]
    params = {k: torch.nn.Parameter(torch.from_numpy(v)) for k, v in gpt_params_np(np.random.default_rng(0)).items()}

    def forward_loss(idx, targets):
        P = params
        B, T = idx.shape
        x = P["tok"][idx] + P["pos"][:T]
        for i in range(GPT["layers"]):
            q = lambda name: P[f"{i}.{name}"]  # noqa: E731
            qkv = F.layer_norm(x, (d,), q("ln1_g"), q("ln1_b"), GPT["ln_eps"]) @ q("wqkv") + q("bqkv")
            qh, kh, vh = (t.reshape(B, T, H, d // H).transpose(1, 2) for t in qkv.split(d, dim=-1))
            a = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
            x = x + a.transpose(1, 2).reshape(B, T, d) @ q("wo") + q("bo")
            h = F.gelu(F.layer_norm(x, (d,), q("ln2_g"), q("ln2_b"), GPT["ln_eps"]) @ q("w1") + q("b1"))
            x = x + h @ q("w2") + q("b2")
        logits = F.layer_norm(x, (d,), P["lnf_g"], P["lnf_b"], GPT["ln_eps"]) @ P["head"]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    opt = torch.optim.AdamW(params.values(), lr=GPT["lr"], weight_decay=GPT["wd"])

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = forward_loss(torch.from_numpy(x).long(), torch.from_numpy(y).long())
        loss.backward()
        opt.step()
        return loss.item()
    return step, step


def child_gpt(fw: str, steps: int) -> dict:
    sys.path.insert(0, EXAMPLES)
    import gpt_data
    train, _ = gpt_data.corpus()
    offsets = gpt_data.batch_offsets(len(train), steps, GPT["batch"], GPT["seq"], seed=0)
    rss_data = peak_rss_mb()
    first, step = {"rlx": gpt_rlx, "jax": gpt_jax, "torch": gpt_torch}[fw]()
    times, losses = [], []
    for s in range(steps):
        x, y = gpt_data.batch(train, offsets[s], GPT["seq"])  # outside the timer
        t0 = time.perf_counter()
        losses.append((first if s == 0 else step)(x, y))
        times.append(time.perf_counter() - t0)
    skip = min(20, steps // 4)
    return dict(first_step_s=times[0], loss_first=losses[0], loss_last=losses[-1],
                loss_last10=float(np.mean(losses[-10:])), rss_after_data_mb=rss_data, timed_from=skip,
                **summarize(times[skip:]))


# ---- sgemm ---------------------------------------------------------------------------------
def time_call(fn, repeats: int, min_time: float) -> float:
    """Median seconds per call; each repeat averages enough calls to last >= min_time."""
    fn()
    t0 = time.perf_counter()
    fn()
    k = max(1, int(min_time / max(time.perf_counter() - t0, 1e-7)))
    res = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(k):
            fn()
        res.append((time.perf_counter() - t0) / k)
    return statistics.median(res)


def child_sgemm(fw: str, repeats: int, min_time: float) -> dict:
    out = {}
    for n in SGEMM_SIZES:
        rng = np.random.default_rng(n)
        a = rng.standard_normal((n, n), dtype=np.float32)
        b = rng.standard_normal((n, n), dtype=np.float32)
        if fw == "rlx":
            import rlx
            g = rlx.Graph()
            ga, gb = g.input("a", (n, n)), g.input("b", (n, n))
            g.output(ga @ gb)
            exe = g.compile("cpu")
            exe.bind("a", a)
            exe.bind("b", b)
            # The numpy reference is computed after timing: OpenBLAS's threads keep spinning for a
            # while after a call and would steal the cores from the timed rlx runs.
            err = None
            fn = exe.run  # returns a fresh copy of C: part of the measured time
        elif fw == "numpy":
            err, fn = 0.0, (lambda: a @ b)
        elif fw == "jax":
            import jax
            import jax.numpy as jnp
            mm = jax.jit(jnp.matmul)
            da, db = jax.device_put(a), jax.device_put(b)
            err = float(np.abs(np.asarray(mm(da, db)) - a @ b).max())
            fn = lambda: mm(da, db).block_until_ready()  # noqa: E731
        elif fw == "torch":
            torch = torch_threads()
            ta, tb = torch.from_numpy(a), torch.from_numpy(b)
            err, fn = 0.0, (lambda: ta @ tb)
        t = time_call(fn, repeats, min_time)
        if err is None:
            err = float(np.abs(fn()[0] - a @ b).max())
        out[str(n)] = dict(ms=t * 1e3, gflops=2 * n ** 3 / t * 1e-9, max_abs_err=err)
        del fn
    return dict(sgemm=out)


def child_main(fw: str, workload: str, args) -> None:
    t0 = time.perf_counter()
    if workload in ("mlp64", "mlp512"):
        res = child_mlp(fw, int(workload[3:]), args.steps)
    elif workload == "gpt":
        res = child_gpt(fw, args.steps)
    elif workload == "gpt_large":
        GPT.update(GPT_LARGE)
        res = child_gpt(fw, args.steps)
    elif workload == "sgemm":
        res = child_sgemm(fw, args.repeats, args.min_time)
    else:
        raise SystemExit(f"unknown workload {workload}")
    res.update(fw=fw, workload=workload, rss_mb=peak_rss_mb(), child_wall_s=time.perf_counter() - t0)
    print("RESULT " + json.dumps(res), flush=True)


# ============================================================================================
# parent: schedule the children, collect, print the table
# ============================================================================================
def busy_jiffies() -> tuple[int, int]:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return sum(v) - v[3] - v[4], sum(v)  # (busy, total); idle and iowait are not busy


def steal_jiffies() -> int:
    """Time the hypervisor ran something else on this VM's cores (the 8th /proc/stat column)."""
    with open("/proc/stat") as f:
        return int(f.readline().split()[8])


def busy_fraction(dt: float = 0.5) -> float:
    b0, t0 = busy_jiffies()
    time.sleep(dt)
    b1, t1 = busy_jiffies()
    return (b1 - b0) / max(1, t1 - t0)


def run_child(fw: str, workload: str, extra: list[str], wait_quiet: float) -> dict:
    """Runs one child; adds its peak RSS (from wait4) and the cores other processes used meanwhile."""
    deadline = time.time() + wait_quiet
    while wait_quiet > 0 and busy_fraction() > 0.15 and time.time() < deadline:
        pass
    hz = os.sysconf("SC_CLK_TCK")
    b0, _ = busy_jiffies()
    s0 = steal_jiffies()
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", fw, workload, *extra],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = p.stdout.read()
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    b1, _ = busy_jiffies()
    steal = (steal_jiffies() - s0) / hz / wall
    own = ru.ru_utime + ru.ru_stime
    lines = [line[7:] for line in out.splitlines() if line.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        sys.stderr.write(f"child {fw} {workload} failed (rc {p.returncode}):\n{out[-3000:]}\n")
        return dict(fw=fw, workload=workload, error=out[-3000:])
    res = json.loads(lines[-1])
    # Steal counts as busy in /proc/stat: it is not another process of this machine.
    res.update(rss_wait4_mb=ru.ru_maxrss / 1024, proc_wall_s=wall, proc_cpu_s=own, steal_cores=steal,
               others_cores=max(0.0, ((b1 - b0) / hz - own) / wall - steal))
    return res


def machine_info(torch_version: str | None) -> dict:
    cpu = "?"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    def ver(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    so = glob.glob(os.path.join(os.path.dirname(importlib.util.find_spec("rlx").origin), "_rlx*.so"))
    built = time.strftime("%Y-%m-%d %H:%M", time.localtime(os.path.getmtime(so[0]))) if so else "?"
    return dict(cpu=cpu, cores=os.cpu_count(), kernel=platform.release(), python=platform.python_version(),
                numpy=np.__version__, jax=ver("jax"), jaxlib=ver("jaxlib"), rlx=ver("rlx"), rlx_so_built=built,
                torch=torch_version or "not installed")


def torch_version() -> str | None:
    p = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"],
                       capture_output=True, text=True)
    return p.stdout.strip() if p.returncode == 0 else None


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(v, unit: str) -> str:
    if v is None:
        return "–"
    if unit == "ms":
        return f"{v:.3f} ms" if v < 10 else f"{v:.1f} ms"
    if unit == "s":
        return f"{v:.2f} s" if v >= 0.1 else f"{v:.3f} s"
    if unit == "MB":
        return f"{v:.0f} MB"
    return f"{v:.0f}"  # GFLOP/s


def ratio(a, b) -> str:
    if a is None or not b:
        return "–"
    return f"{a / b:.2f}x" if a / b >= 0.1 else f"{a / b:.3f}x"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="few steps and one round (smoke run)")
    ap.add_argument("--only", default=",".join(WORKLOADS), help="comma list of " + ",".join(WORKLOADS))
    ap.add_argument("--json", default=None, help="dump the raw per-child records and the table rows here")
    ap.add_argument("--rounds", type=int, default=None, help="rounds of alternating frameworks (default 2; quick 1)")
    ap.add_argument("--mlp-steps", type=int, default=None, help="timed MLP steps (default 200; quick 30)")
    ap.add_argument("--gpt-steps", type=int, default=None, help="GPT steps incl. 20 warm-up (default 120; quick 24)")
    ap.add_argument("--wait-quiet", type=float, default=None,
                    help="before each child, wait up to this many s for the machine to go quiet (default 10; quick 0)")
    ap.add_argument("--child", nargs=2, metavar=("FW", "WORKLOAD"), help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--repeats", type=int, default=5, help=argparse.SUPPRESS)
    ap.add_argument("--min-time", type=float, default=0.1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child_main(*args.child, args)
        return

    q = args.quick
    rounds = args.rounds or (1 if q else 2)
    mlp_steps = args.mlp_steps or (30 if q else 200)
    gpt_steps = args.gpt_steps or (24 if q else 120)
    wait_quiet = args.wait_quiet if args.wait_quiet is not None else (0 if q else 10)
    only = [w.strip() for w in args.only.split(",") if w.strip()]
    bad = set(only) - set(WORKLOADS)
    if bad:
        ap.error(f"unknown workload(s) {sorted(bad)}; choose from {','.join(WORKLOADS)}")

    tv = torch_version()
    print(f"torch: {tv} (measured live)" if tv else
          "torch: not installed (PyTorch column = the reference figures in TORCH_REF)", flush=True)
    info = machine_info(tv)
    has_jax = importlib.util.find_spec("jax") is not None
    if not has_jax:
        print("jax: not installed (the JAX column stays empty; pip install jax to fill it)", flush=True)
    fws = ["rlx"] + (["jax"] if has_jax else []) + (["torch"] if tv else [])

    # Which child runs are needed: rss comes from the mlp64 processes, compile from gpt + mlp64.
    jobs: list[tuple[str, list[str]]] = []
    if "mlp64" in only or "rss" in only or "compile" in only:
        jobs.append(("mlp64", ["--steps", str(mlp_steps)]))
    if "mlp512" in only:
        jobs.append(("mlp512", ["--steps", str(mlp_steps)]))
    if "gpt" in only or "compile" in only:
        jobs.append(("gpt", ["--steps", str(gpt_steps if "gpt" in only else 4)]))
    if "gpt256" in only:
        jobs.append(("gpt_large", ["--steps", str(max(8, gpt_steps // 2))]))
    if "sgemm" in only:
        jobs.append(("sgemm", ["--repeats", str(3 if q else 5), "--min-time", str(0.03 if q else 0.1)]))

    records = []
    t_start = time.time()
    for r in range(rounds):
        for workload, extra in jobs:
            order = fws + (["numpy"] if workload == "sgemm" else [])
            order = order if r % 2 == 0 else order[::-1]  # alternate who goes first
            for fw in order:
                rec = run_child(fw, workload, extra, wait_quiet)
                rec["round"] = r
                records.append(rec)
                if "error" in rec:
                    continue
                if workload == "sgemm":
                    what = ", ".join(f"{n}: {v['gflops']:.0f}" for n, v in rec["sgemm"].items()) + " GFLOP/s"
                else:
                    what = f"step {rec['step_ms']:.3f} ms, first step {rec['first_step_s']:.3f} s, loss {rec['loss_last']:.3f}"
                print(f"[round {r + 1}/{rounds}] {fw:5s} {workload:6s} {what}; rss {rec['rss_mb']:.0f} MB, "
                      f"wall {rec['proc_wall_s']:.1f} s, others {rec['others_cores']:.2f} cores, "
                      f"steal {rec['steal_cores']:.2f} cores",
                      file=sys.stderr, flush=True)

    def pick(fw: str, workload: str, key) -> tuple[float | None, bool]:
        """Median over rounds of one figure, and whether any run behind it was contended."""
        recs = [x for x in records if x["fw"] == fw and x["workload"] == workload and "error" not in x]
        vals = [key(x) for x in recs]
        return med(vals), any(x["others_cores"] > 0.3 for x in recs)

    rows = []

    def add(label: str, key: str, unit: str, workload: str, getter, lower_better: bool = True):
        live = {fw: pick(fw, workload, getter) for fw in fws + ["numpy"]}
        rlx_v, contended = live["rlx"]
        jax_v, jax_contended = live.get("jax", (None, False))
        if tv:
            torch_v, torch_src = live["torch"][0], "live"
        else:
            torch_v, torch_src = TORCH_REF.get(key), "ref"
        contended = contended or jax_contended or (tv and live["torch"][1])
        tgt = TARGETS.get(key)
        if tgt and rlx_v is not None:
            ok = rlx_v <= tgt[1] if tgt[0] == "<=" else rlx_v >= tgt[1]
            target = f"{'≤' if tgt[0] == '<=' else '≥'} {fmt(tgt[1], unit)}: {'met' if ok else 'MISSED'}"
        else:
            target = "–"
        rows.append(dict(label=label + (" *" if contended else ""), key=key, unit=unit, rlx=rlx_v, jax=jax_v,
                         torch=torch_v, torch_src=torch_src, numpy=live["numpy"][0], target=target,
                         lower_better=lower_better))

    if "mlp64" in only:
        add("digits MLP B=64, step (ms, lower is better)", "mlp64.step_ms", "ms", "mlp64", lambda x: x["step_ms"])
    if "mlp512" in only:
        add("digits MLP B=512, step (ms, lower is better)", "mlp512.step_ms", "ms", "mlp512", lambda x: x["step_ms"])
    if "gpt" in only:
        add(f"tiny GPT B16xT64, step (ms, median of steps 20..{gpt_steps})", "gpt.step_ms", "ms", "gpt",
            lambda x: x["step_ms"])
    if "gpt256" in only:
        add(f"GPT d256 L4 B8xT128, step (ms, median of steps {min(20, max(8, gpt_steps // 2) // 4)}.."
            f"{max(8, gpt_steps // 2)})", "gpt_large.step_ms", "ms", "gpt_large", lambda x: x["step_ms"])
    if "compile" in only:
        add("tiny GPT, compile + first step (s)", "gpt.first_step_s", "s", "gpt", lambda x: x["first_step_s"])
        add("digits MLP B=64, compile + first step (s)", "mlp64.first_step_s", "s", "mlp64",
            lambda x: x["first_step_s"])
    if "rss" in only:
        add("peak RSS, digits MLP B=64 process (MB)", "mlp64.rss_mb", "MB", "mlp64", lambda x: x["rss_mb"])
        if "mlp512" in only:
            add("peak RSS, digits MLP B=512 process (MB)", "mlp512.rss_mb", "MB", "mlp512", lambda x: x["rss_mb"])
        if "gpt" in only:
            add("peak RSS, tiny GPT process (MB)", "gpt.rss_mb", "MB", "gpt", lambda x: x["rss_mb"])
    if "sgemm" in only:
        for n in SGEMM_SIZES:
            add(f"sgemm n={n} (GFLOP/s, higher is better)", f"sgemm.{n}", "GFLOP/s", "sgemm",
                lambda x, n=n: x["sgemm"][str(n)]["gflops"], lower_better=False)

    def round_ratios(row) -> str:
        """rlx/PyTorch of each round (the two ran back to back, so they saw much the same load)."""
        wl = row["key"].split(".")[0]
        if not tv or row["unit"] != "ms" or not row["key"].endswith("step_ms"):
            return "–"
        rs = []
        for r in range(rounds):
            a, b = (next((x for x in records if x["fw"] == fw and x["workload"] == wl and x["round"] == r
                          and "error" not in x), None) for fw in ("rlx", "torch"))
            if a and b:
                rs.append(a["step_ms"] / b["step_ms"])
        return " / ".join(f"{x:.2f}" for x in rs) if rs else "–"

    torch_hdr = f"PyTorch {tv} (live)" if tv else "PyTorch (reference figures)"
    lines = [f"| workload | rlx | JAX | {torch_hdr} | rlx/JAX | rlx/PyTorch | each round | target |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        u = row["unit"]
        lines.append(f"| {row['label']} | {fmt(row['rlx'], u)} | {fmt(row['jax'], u)} | {fmt(row['torch'], u)} | "
                     f"{ratio(row['rlx'], row['jax'])} | {ratio(row['rlx'], row['torch'])} | {round_ratios(row)} | "
                     f"{row['target']} |")
    sg = [row for row in rows if row["key"].startswith("sgemm.")]
    if sg:
        lines += ["", "| sgemm (float32, square) | rlx GFLOP/s | numpy `a @ b` GFLOP/s | rlx/numpy |",
                  "|---|---|---|---|"]
        for row in sg:
            lines.append(f"| n={row['key'].split('.')[1]} | {fmt(row['rlx'], '')} | {fmt(row['numpy'], '')} | "
                         f"{ratio(row['rlx'], row['numpy'])} |")

    m = info
    notes = [
        "",
        f"**Machine** {m['cpu']}, {m['cores']} cores, Linux {m['kernel']}; python {m['python']}, numpy {m['numpy']}, "
        f"jax/jaxlib {m['jax']}/{m['jaxlib']}, rlx {m['rlx']} (extension built {m['rlx_so_built']}), torch {m['torch']}.",
        f"Cells: median over {rounds} round(s), frameworks alternating, each (framework, workload) in its own process; "
        f"MLP: {mlp_steps} timed full-size steps after >= 2 warm-up epochs; GPT: {gpt_steps} steps. "
        "Ratios are rlx/anchor (below 1x is better for ms, s and MB; above 1x is better for GFLOP/s); "
        "'each round' is rlx/PyTorch of each round's two back-to-back processes.",
        "Compile + first step: rlx from calling compile_train_step until the first step returned; JAX the first call "
        "of the jitted step (trace + compile + run).",
    ]
    if sg:
        notes.append("sgemm: rlx's exe.run() returns a fresh copy of C, counted in its time (like numpy's `a @ b`); "
                     "JAX column: jitted jnp.matmul on device arrays; numpy uses its default BLAS threads.")
    if not tv:
        notes.append(
            f"PyTorch column: not measured here (torch not installed) but copied from the reference figures (torch 2.13.0+cpu "
            f"eager, 2 threads; GPT compile row = torch.compile cold cache; sgemm = torch.mm), measured on "
            f"{REF_MACHINE}. Where this machine differs, rlx/PyTorch mixes two machines; JAX here vs JAX in "
            "the reference figures give the scale: " + ", ".join(
                f"{k} {row['jax'] / JAX_REF[k]:.2f}x" for row in rows for k in [row["key"]]
                if k in JAX_REF and row["jax"]) + ".")
    losses = [f"{fw} {r['loss_last10']:.3f}" for fw in ("rlx", "jax", "torch")
              for r in [next((x for x in records if x["fw"] == fw and x["workload"] == "gpt" and "error" not in x), None)]
              if r]
    if losses and "gpt" in only:
        notes.append(f"Sanity: GPT mean loss of the last 10 of {gpt_steps} steps: " + ", ".join(losses) + ".")
    mlp_losses = [f"{fw} {r['loss_last']:.4f}" for fw in fws
                  for r in [next((x for x in records if x["fw"] == fw and x["workload"] == "mlp64" and "error" not in x),
                                 None)] if r]
    if mlp_losses and "mlp64" in only:
        notes.append("Sanity: MLP B=64 loss at the last timed step (rlx and JAX start from the same init, "
                     "rlx.seed(0) = default_rng(0)): " + ", ".join(mlp_losses) + ".")
    data_rss = [f"{fw} {r['rss_after_data_mb']:.0f} MB" for fw in fws
                for r in [next((x for x in records if x["fw"] == fw and x["workload"] == "mlp64" and "error" not in x), None)]
                if r]
    if data_rss and "rss" in only:
        notes.append("RSS of the MLP processes before importing the framework (numpy + sklearn + digits): "
                     + ", ".join(data_rss) + ".")
    if any(row["label"].endswith(" *") for row in rows):
        notes.append("* a run behind this row had > 0.3 cores taken by other processes (see --json others_cores).")
    steals = [x["steal_cores"] for x in records if "steal_cores" in x]
    if steals and max(steals) > 0.02:
        notes.append(f"Hypervisor steal during the children: {min(steals):.2f}-{max(steals):.2f} cores of "
                     f"{os.cpu_count()} (time the host gave this VM's cores to others; it moves step times "
                     "from round to round).")
    notes.append(f"Total wall {time.time() - t_start:.0f} s.")
    print("\n".join(lines + notes))

    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=info, rounds=rounds, mlp_steps=mlp_steps, gpt_steps=gpt_steps, rows=rows,
                           records=records, torch_ref=TORCH_REF, jax_ref=JAX_REF, numpy_ref=NUMPY_REF), f, indent=1)
        print(f"\nraw numbers: {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
