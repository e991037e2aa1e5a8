"""Side-by-side CPU benchmark of a CNN training step, rlx vs PyTorch eager, each framework in a
process of its own.

    python benches/bench_cnn.py [--threads 2] [--steps 30] [--rounds 3] [--device cuda]

Workloads (float32, Adam(1e-3), mean softmax cross-entropy, step = forward + backward + update +
the loss read back as a Python float):
  digits  examples/train_digits_cnn.py's model (Conv 1->16 -BN-ReLU-Pool, Conv 16->32 -BN-ReLU-Pool,
          Dropout(0.25), Linear 128->10) on 8x8 inputs, batch 64.
  cifar   Conv(3->32, 3x3, pad 1)-ReLU-MaxPool(2), Conv(32->64, 3x3, pad 1)-ReLU-MaxPool(2),
          Linear(4096->10) on random 3x32x32 inputs, batch 64.
Both frameworks get the same weights and batches. Each (framework, workload, round) runs in a
fresh process (one framework's idle worker threads never spin beside the other's), the frameworks
alternate by round (rlx, torch / torch, rlx), and a cell is the median step time over all timed
steps of all rounds. PyTorch runs with torch.set_num_threads(threads); rlx uses its worker pool
(RAYON_NUM_THREADS, default: the cores). With ``--device cuda`` both run on the first GPU
(PyTorch eager with its inputs on the GPU; the loss read back each step synchronises both).
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

from train_digits_cnn import DigitsCNN  # noqa: E402

import rlx  # noqa: E402


class CifarCNN(rlx.nn.Module):
    def __init__(self):
        self.conv1 = rlx.nn.Conv2d(3, 32, 3, padding=1)
        self.conv2 = rlx.nn.Conv2d(32, 64, 3, padding=1)
        self.fc = rlx.nn.Linear(64 * 8 * 8, 10)

    def __call__(self, x):
        h = rlx.max_pool2d(rlx.relu(self.conv1(x)), 2)
        h = rlx.max_pool2d(rlx.relu(self.conv2(h)), 2)
        return self.fc(h.reshape(h.shape[0], -1))


def torch_models(torch):
    nn = torch.nn

    class TDigits(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16)
            self.conv2, self.bn2 = nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32)
            self.drop, self.fc = nn.Dropout(0.25), nn.Linear(128, 10)

        def forward(self, x):
            h = nn.functional.max_pool2d(torch.relu(self.bn1(self.conv1(x))), 2)
            h = nn.functional.max_pool2d(torch.relu(self.bn2(self.conv2(h))), 2)
            return self.fc(self.drop(h.flatten(1)))

    class TCifar(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.conv2 = nn.Conv2d(3, 32, 3, padding=1), nn.Conv2d(32, 64, 3, padding=1)
            self.fc = nn.Linear(4096, 10)

        def forward(self, x):
            h = nn.functional.max_pool2d(torch.relu(self.conv1(x)), 2)
            h = nn.functional.max_pool2d(torch.relu(self.conv2(h)), 2)
            return self.fc(h.flatten(1))

    return {"digits": TDigits, "cifar": TCifar}


def child(fw: str, name: str, steps: int, threads: int, device: str = "cpu") -> list[float]:
    """Step times (seconds) of `steps` timed steps of framework `fw` on workload `name`."""
    shapes = {"digits": (1, 8, 8), "cifar": (3, 32, 32)}
    ours = {"digits": DigitsCNN, "cifar": CifarCNN}
    batch = 64
    rng = np.random.default_rng(0)
    xs = rng.random((steps, batch, *shapes[name]), dtype=np.float32)
    ys = rng.integers(0, 10, (steps, batch)).astype(np.int32)
    rlx.seed(0)
    model = ours[name]()
    if fw == "rlx":
        spec = {"x": rlx.InputSpec((batch, *shapes[name])), "y": rlx.InputSpec((batch,), "int32")}
        step = rlx.compile_train_step(lambda m, x, y: rlx.cross_entropy(m(x), y), model, rlx.optim.Adam(lr=1e-3), spec,
                                      device=device)

        def run(i):
            return step(x=xs[i], y=ys[i])
    else:
        import torch

        torch.set_num_threads(threads)
        tm = torch_models(torch)[name]()
        tm.load_state_dict({k: torch.tensor(np.array(v)) for k, v in model.state_dict().items()})
        tm = tm.to(device)
        topt = torch.optim.Adam(tm.parameters(), lr=1e-3)
        txs, tys = torch.tensor(xs, device=device), torch.tensor(ys, dtype=torch.long, device=device)

        def run(i):
            topt.zero_grad()
            loss = torch.nn.functional.cross_entropy(tm(txs[i]), tys[i])
            loss.backward()
            topt.step()
            return loss.item()

    run(0)  # warm-up
    times = []
    for i in range(steps):
        t = time.perf_counter()
        run(i)
        times.append(time.perf_counter() - t)
    return times


def load() -> str:
    try:
        with open("/proc/loadavg") as f:
            return f.read().split()[0]
    except OSError:
        return "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default="digits,cifar")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--child", nargs=2, metavar=("FRAMEWORK", "WORKLOAD"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], args.steps, args.threads, args.device)))
        return
    import torch

    print(f"rlx {rlx.__version__}, torch {torch.__version__}, device {args.device}, {args.threads} threads, batch 64, "
          f"each framework in its own process, 1-min load average {load()}")
    print("| workload | rlx ms/step | PyTorch ms/step | rlx / PyTorch | load after |")
    print("|---|---|---|---|---|")
    for name in args.only.split(","):
        times: dict[str, list[float]] = {"rlx": [], "torch": []}
        for r in range(args.rounds):
            order = ["rlx", "torch"] if r % 2 == 0 else ["torch", "rlx"]
            for fw in order:
                cmd = [sys.executable, os.path.abspath(__file__), "--child", fw, name,
                       "--steps", str(args.steps), "--threads", str(args.threads), "--device", args.device]
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode != 0:
                    sys.exit(f"{fw} {name} failed:\n{done.stderr}")
                out = done.stdout
                times[fw] += json.loads(out.strip().splitlines()[-1])
        a, b = statistics.median(times["rlx"]) * 1e3, statistics.median(times["torch"]) * 1e3
        print(f"| {name} | {a:.2f} | {b:.2f} | {a / b:.2f} | {load()} |")


if __name__ == "__main__":
    main()
