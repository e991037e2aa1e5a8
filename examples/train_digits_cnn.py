"""Train a small CNN on scikit-learn's 8x8 digits with rlx on the CPU and report test accuracy:
Conv(1->16, 3x3, pad 1)-BN-ReLU-MaxPool(2) -> Conv(16->32, 3x3, pad 1)-BN-ReLU-MaxPool(2) ->
Dropout(0.25) -> Linear(32*2*2 -> 10); Adam 2e-3, batch 64.

    python examples/train_digits_cnn.py [--epochs 20] [--device cpu]

The model is also what benches/bench_cnn.py times against PyTorch.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from digits_mlp import digits_split

import rlx


class DigitsCNN(rlx.nn.Module):
    def __init__(self):
        self.conv1 = rlx.nn.Conv2d(1, 16, 3, padding=1)
        self.bn1 = rlx.nn.BatchNorm2d(16)
        self.conv2 = rlx.nn.Conv2d(16, 32, 3, padding=1)
        self.bn2 = rlx.nn.BatchNorm2d(32)
        self.pool = rlx.nn.MaxPool2d(2)
        self.drop = rlx.nn.Dropout(0.25)
        self.fc = rlx.nn.Linear(32 * 2 * 2, 10)

    def __call__(self, x):
        h = self.pool(rlx.relu(self.bn1(self.conv1(x))))
        h = self.pool(rlx.relu(self.bn2(self.conv2(h))))
        return self.fc(self.drop(h.reshape(h.shape[0], -1)))


def loss_fn(model, x, y):
    return rlx.cross_entropy(model(x), y)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    rlx.seed(args.seed)
    xtr, xte, ytr, yte = digits_split()
    xtr, xte = xtr.reshape(-1, 1, 8, 8), xte.reshape(-1, 1, 8, 8)
    model = DigitsCNN()
    opt = rlx.optim.Adam(lr=2e-3)
    spec = {"x": rlx.InputSpec((None, 1, 8, 8)), "y": rlx.InputSpec((None,), "int32")}
    step = rlx.compile_train_step(loss_fn, model, opt, spec, device=args.device)
    times = []
    t0 = time.perf_counter()
    for epoch in range(args.epochs):
        perm = np.random.default_rng(args.seed + epoch).permutation(len(xtr))
        losses = []
        for i in range(0, len(xtr), args.batch):
            idx = perm[i : i + args.batch]
            t = time.perf_counter()
            losses.append(step(x=xtr[idx], y=ytr[idx]))
            if len(idx) == args.batch:
                times.append(time.perf_counter() - t)
        print(f"epoch {epoch + 1:2d}/{args.epochs}  loss {np.mean(losses):.4f}")
    train_s = time.perf_counter() - t0
    # Evaluation: BatchNorm uses its running statistics, Dropout is off (rlx.compile's eval mode).
    predict = rlx.compile(lambda m, x: m(x), model, {"x": rlx.InputSpec(xte.shape)}, device=args.device)
    acc = float((predict(x=xte).argmax(axis=1) == yte).mean())
    print(f"test accuracy {acc:.4f}  ({len(yte)} images)")
    print(f"median step {statistics.median(times) * 1e3:.2f} ms (batch {args.batch}), training {train_s:.1f} s")


if __name__ == "__main__":
    main()
