"""The digits MLP (64-256-256-10, ReLU, mean softmax cross-entropy) and the digits data split: one
definition shared by examples/train_digits.py, benches/bench_cpu.py and scripts/soak.py."""

from __future__ import annotations

import numpy as np

import rlx


class MLP(rlx.nn.Module):
    def __init__(self):
        self.fc1 = rlx.nn.Linear(64, 256)
        self.fc2 = rlx.nn.Linear(256, 256)
        self.fc3 = rlx.nn.Linear(256, 10)

    def __call__(self, x):
        return self.fc3(rlx.relu(self.fc2(rlx.relu(self.fc1(x)))))


def loss_fn(model, x, y):
    return rlx.cross_entropy(model(x), y)


def digits_split():
    """scikit-learn's digits scaled to [0, 1]: (x_train, x_test, y_train, y_test), 80/20 stratified."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    y = d.target.astype(np.int32)
    return train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
