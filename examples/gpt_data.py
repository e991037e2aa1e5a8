"""The tiny-GPT workload of the benchmark spec: the corpus (the first 4 MiB of this Python's
top-level standard-library *.py files, sorted by name; last 10% held out) and the batch order."""

from __future__ import annotations

import os
import sysconfig

import numpy as np

CORPUS_BYTES = 4 * 1024 * 1024


def corpus() -> tuple[np.ndarray, np.ndarray]:
    """(train, val) uint8 arrays. ``RLX_CORPUS=FILE`` reads the bytes from a file instead."""
    path = os.environ.get("RLX_CORPUS")
    if path:
        data = np.fromfile(path, dtype=np.uint8)
    else:
        lib = sysconfig.get_paths()["stdlib"]
        parts, total = [], 0
        for name in sorted(os.listdir(lib)):
            if name.endswith(".py"):
                with open(os.path.join(lib, name), "rb") as f:
                    parts.append(f.read())
                total += len(parts[-1])
                if total >= CORPUS_BYTES:
                    break
        data = np.frombuffer(b"".join(parts)[:CORPUS_BYTES], dtype=np.uint8)
    n_val = len(data) // 10
    return data[:-n_val], data[-n_val:]


def batch_offsets(n_data: int, steps: int, batch: int, seq: int, seed: int = 0) -> np.ndarray:
    """(steps, batch) window starts; batch s reads data[o : o + seq + 1] for each offset o."""
    return np.random.default_rng(seed).integers(0, n_data - seq - 1, size=(steps, batch))


def batch(data: np.ndarray, offsets: np.ndarray, seq: int) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets), both int32 (B, seq): targets are the inputs shifted by one byte."""
    idx = offsets[:, None] + np.arange(seq + 1)[None, :]
    w = data[idx].astype(np.int32)
    return w[:, :-1], w[:, 1:]
