"""On two or more threads the CPU runs a layer's input- and weight-gradient products side by side,
one per core, instead of splitting each over both (``schedule::Step::Both``). That must change no
result: a GPT and an MLP train a few steps with the pairs on (the default) and off
(``RLX_CPU_MATMUL_PAIRS=0``, read at compile), in a child process with two threads, and the
losses, gradients and weights must be bit-identical (neither way splits a product's depth). The
profile shows the pairs did form, so the comparison is not between two unpaired runs, and that
the memory planner left room for one whose second product would otherwise overwrite the first's
input (``Backend::runs_together``)."""

import json
import os
import subprocess
import sys

import pytest

CHILD = r"""
import json, os, sys
import numpy as np
import rlx

def train(model_name):
    rlx.seed(3)
    rng = np.random.default_rng(0)
    if model_name == "gpt":
        model = rlx.models.GPT(vocab=64, dim=64, heads=2, layers=2, seq_len=32)
        spec = {"idx": rlx.InputSpec((8, 32), "int32"), "targets": rlx.InputSpec((8, 32), "int32")}
        loss = lambda m, idx, targets: m.loss(idx, targets)
        feeds = [dict(idx=rng.integers(0, 64, (8, 32)).astype(np.int32),
                      targets=rng.integers(0, 64, (8, 32)).astype(np.int32)) for _ in range(3)]
        opt = rlx.optim.AdamW(lr=1e-2, weight_decay=0.1)
    else:
        model = rlx.nn.Sequential(rlx.nn.Linear(96, 256), rlx.nn.ReLU(), rlx.nn.Linear(256, 256),
                                  rlx.nn.ReLU(), rlx.nn.Linear(256, 10))
        spec = {"x": rlx.InputSpec((128, 96)), "y": rlx.InputSpec((128,), "int32")}
        loss = lambda m, x, y: rlx.cross_entropy(m(x), y)
        feeds = [dict(x=rng.standard_normal((128, 96)).astype(np.float32),
                      y=rng.integers(0, 10, 128).astype(np.int32)) for _ in range(3)]
        opt = rlx.optim.Adam(lr=1e-2)
    step = rlx.compile_train_step(loss, model, opt, spec)
    out = {"loss": [], "grads": []}
    for f in feeds:
        out["loss"].append(float(step(**f)))
        out["grads"].append({k: np.array(v).tobytes().hex() for k, v in step.grads.items()})
    out["weights"] = {k: np.array(v).tobytes().hex() for k, v in model.state_dict().items()}
    return out

print(json.dumps(train(sys.argv[1])))
"""


def _run(model_name, pairs):
    env = dict(os.environ, RLX_PROFILE="1", RLX_NUM_THREADS="2")
    env.pop("RLX_CPU_MATMUL_PAIRS", None)
    if pairs is not None:
        env["RLX_CPU_MATMUL_PAIRS"] = pairs
    r = subprocess.run([sys.executable, "-c", CHILD, model_name], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


@pytest.mark.parametrize("model_name", ["gpt", "mlp"])
def test_side_by_side_products_give_the_same_bits(model_name):
    paired, prof_on = _run(model_name, None)
    plain, prof_off = _run(model_name, "0")
    # The profile names a pair "a + b"; the pairs formed only when on.
    assert "matmul" in prof_on and " + matmul" in prof_on, prof_on
    assert " + matmul" not in prof_off, prof_off
    if model_name == "gpt":
        # The second MLP layer's weight gradient beside the GELU-gradient product: the planner
        # keeps the GELU output (which the first reads) from becoming the second's output.
        assert " + matmul_epilogue" in prof_on, prof_on
    assert paired["loss"] == plain["loss"]
    assert all(abs(v) < 1e3 for v in paired["loss"])
    assert paired["grads"] == plain["grads"]
    assert paired["weights"] == plain["weights"]
