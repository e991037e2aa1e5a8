"""On the CPU a layer norm's backward (four instructions after fusion: the bias gradient's
``sum_to``, ``dY * w``, the weight gradient's ``fused_sum_to`` and ``normalize_grad(_add)``)
runs as one step of two passes (``schedule::Step::LayerNormGrad``). That must change no result:
the tiny GPT trains a few steps with the step on (the default) and off (``RLX_CPU_LAYER_NORM_GRAD=0``,
read at compile), on one and two threads, and the losses, gradients and weights must be
bit-identical. The profile shows the four instructions ran as one step only when on."""

import json
import os
import re
import subprocess
import sys

import pytest

# The tiny GPT's shapes (rows of 128, 1024 of them): the weight gradient's partial sums take
# 128 rows, the bias gradient's 256, so a pass that blocked both alike would differ in bits.
CHILD = r"""
import json, sys
import numpy as np
import rlx

rlx.seed(3)
rng = np.random.default_rng(0)
model = rlx.models.GPT(vocab=64, dim=128, heads=4, layers=2, seq_len=64)
spec = {"idx": rlx.InputSpec((16, 64), "int32"), "targets": rlx.InputSpec((16, 64), "int32")}
step = rlx.compile_train_step(lambda m, idx, targets: m.loss(idx, targets), model,
                              rlx.optim.AdamW(lr=1e-2, weight_decay=0.1), spec)
out = {"loss": [], "grads": []}
for _ in range(3):
    f = dict(idx=rng.integers(0, 64, (16, 64)).astype(np.int32), targets=rng.integers(0, 64, (16, 64)).astype(np.int32))
    out["loss"].append(float(step(**f)))
    out["grads"].append({k: np.array(v).tobytes().hex() for k, v in step.grads.items()})
out["weights"] = {k: np.array(v).tobytes().hex() for k, v in model.state_dict().items()}
print(json.dumps(out))
"""

# The profile names a step by its instructions with their shapes, joined by " + ".
GROUP = re.compile(r"sum_to [^+]*\+ mul [^+]*\+ fused_sum_to [^+]*\+ normalize_grad(_add)? ")


def _run(threads, on):
    env = dict(os.environ, RLX_PROFILE="1", RLX_NUM_THREADS=str(threads))
    env.pop("RLX_CPU_LAYER_NORM_GRAD", None)
    if not on:
        env["RLX_CPU_LAYER_NORM_GRAD"] = "0"
    r = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


@pytest.mark.parametrize("threads", [1, 2])
def test_the_layer_norm_backward_step_gives_the_same_bits(threads):
    grouped, prof_on = _run(threads, True)
    plain, prof_off = _run(threads, False)
    assert {m.group(1) for m in GROUP.finditer(prof_on)} == {None, "_add"}, prof_on
    assert not GROUP.search(prof_off), prof_off
    assert grouped["loss"] == plain["loss"]
    assert all(abs(v) < 1e3 for v in grouped["loss"])
    assert grouped["grads"] == plain["grads"]
    assert grouped["weights"] == plain["weights"]
