"""Data-parallel step time on one machine: 1 process with the global batch against N ranks under
mpirun with 1/N of it each (each rank gets cores/N threads), and the all-reduce's share.

    python benches/distributed_bench.py [--ranks 2] [--steps 200]

Workloads: the digits MLP (64-256-256-10, Adam, global batch 64 and 512, random data) and the
tiny GPT (rlx.models.GPT defaults, AdamW, global batch 16 x T64, random tokens). A step is the
whole training call (forward, backward, all-reduce of the gradient region, update, the loss read
back); the cell is the median over --steps steps after 20 warm-up steps. "all-reduce" is the
median time of the in-place mean over the ranks of the arena's gradient region (MPI through
mpi4py), measured around that call inside the step.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))


def child(workload: str, global_batch: int, steps: int, distributed: bool) -> None:
    import rlx

    rank, world = 0, 1
    comm = None
    if distributed:
        comm = rlx.distributed.init()
        rank, world = comm.rank, comm.size
        reduce_times: list[float] = []
        inner = comm.allreduce_mean_

        def timed(a: np.ndarray) -> None:
            t = time.perf_counter()
            inner(a)
            reduce_times.append(time.perf_counter() - t)

        comm.allreduce_mean_ = timed  # type: ignore[method-assign]
    b = global_batch // world
    rng = np.random.default_rng(rank)
    rlx.seed(0)
    if workload == "mlp":
        from digits_mlp import MLP

        model, opt = MLP(), rlx.optim.Adam(lr=1e-3)
        spec = {"x": rlx.InputSpec((b, 64)), "y": rlx.InputSpec((b,), "int32")}
        step = rlx.compile_train_step(lambda m, x, y: rlx.cross_entropy(m(x), y), model, opt, spec,
                                      distributed=distributed)
        feeds = {"x": rng.standard_normal((b, 64)).astype(np.float32), "y": rng.integers(0, 10, b).astype(np.int32)}
    else:
        model = rlx.models.GPT()
        opt = rlx.optim.AdamW(lr=1e-3, weight_decay=0.01)
        t_len = 64
        spec = {"idx": rlx.InputSpec((b, t_len), "int32"), "targets": rlx.InputSpec((b, t_len), "int32")}
        step = rlx.compile_train_step(lambda m, idx, targets: m.loss(idx, targets), model, opt, spec,
                                      distributed=distributed)
        feeds = {"idx": rng.integers(0, 256, (b, t_len)).astype(np.int32),
                 "targets": rng.integers(0, 256, (b, t_len)).astype(np.int32)}
    times = []
    for i in range(20 + steps):
        t = time.perf_counter()
        step(**feeds)
        times.append(time.perf_counter() - t)
    if rank == 0:
        out = {"step_ms": statistics.median(times[20:]) * 1e3, "threads": os.environ.get("RLX_NUM_THREADS", "all")}
        if distributed:
            out["allreduce_ms"] = statistics.median(reduce_times[20:]) * 1e3
            out["grad_bytes"] = int(step._last.region.nbytes)
        print("RESULT " + json.dumps(out), flush=True)


def run(cmd: list[str]) -> dict:
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"no result from {cmd}:\n{p.stdout}\n{p.stderr}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--child", nargs=3, metavar=("WORKLOAD", "GLOBAL_BATCH", "DISTRIBUTED"))
    args = ap.parse_args()
    if args.child:
        w, gb, d = args.child
        child(w, int(gb), args.steps, d == "1")
        return
    mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
    mpirun = mpirun if os.path.exists(mpirun) else shutil.which("mpirun")
    me = [sys.executable, os.path.abspath(__file__), "--steps", str(args.steps), "--child"]
    print(f"| workload | 1 process (all cores) | {args.ranks} ranks | ratio | all-reduce per step | gradient bytes |")
    print("|---|---|---|---|---|---|")
    for name, workload, gb in (("digits MLP, global batch 64", "mlp", 64), ("digits MLP, global batch 512", "mlp", 512),
                               ("tiny GPT, global batch 16", "gpt", 16)):
        one = run(me + [workload, str(gb), "0"])
        many = run([mpirun, "--oversubscribe", "-n", str(args.ranks)] + me + [workload, str(gb), "1"])
        print(f"| {name} | {one['step_ms']:.3f} ms | {many['step_ms']:.3f} ms | {many['step_ms'] / one['step_ms']:.2f}x "
              f"| {many['allreduce_ms']:.3f} ms | {many['grad_bytes']:,} |", flush=True)


if __name__ == "__main__":
    main()
