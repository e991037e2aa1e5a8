"""Run-time kernel selection: `RLX_CPU_ISA=portable` forces the baseline x86-64 kernels and
`RLX_CPU_ISA=avx2` the AVX2/FMA ones, and they give bit-identical results to the widest kernels
chosen by default (AVX-512 where the CPU has it; same source, no fused multiply-adds the source does
not write). Each run is its own process: the choice is per process."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import rlx

# One process: a tiny GPT (embedding, layer norm, attention with softmax and a causal `where`, GELU,
# cross-entropy; AdamW) trained three steps on one batch, and a wide elementwise/reduction workload big enough to be split across
# threads; prints the chosen ISA, the losses and the final weights.
SCRIPT = r"""
import json, sys
import numpy as np
import rlx
from rlx import _rlx

rlx.seed(0)
model = rlx.models.GPT(vocab=32, dim=16, heads=2, layers=2, seq_len=9)
opt = rlx.optim.AdamW(lr=1e-2, weight_decay=0.01)
spec = {"idx": rlx.InputSpec((3, 9), "int32"), "targets": rlx.InputSpec((3, 9), "int32")}
step = rlx.compile_train_step(lambda m, idx, targets: m.loss(idx, targets), model, opt, spec)
idx = np.random.default_rng(1).integers(0, 32, (3, 9)).astype(np.int32)
losses = [float(step(idx=idx, targets=np.roll(idx, -1, axis=1))) for _ in range(3)]
weights = {k: p.numpy().tolist() for k, p in model.named_parameters()}

x = np.random.default_rng(2).normal(size=(300, 1001)).astype(np.float32)
f = rlx.compile(
    lambda m, x: (rlx.gelu(x), rlx.softmax(x, -1), rlx.tanh(x) * rlx.exp(-x * x), x.sum(0), x.max(1)),
    rlx.nn.Module(),
    {"x": rlx.InputSpec(x.shape)},
)
wide = [np.asarray(o).ravel().tolist() for o in f(x=x)]
json.dump({"isa": _rlx.cpu_isa(), "losses": losses, "weights": weights, "wide": wide}, sys.stdout)
"""


def run(isa: str | None) -> dict:
    env = dict(os.environ)
    env.pop("RLX_CPU_ISA", None)
    if isa is not None:
        env["RLX_CPU_ISA"] = isa
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def cpu_flags() -> set[str]:
    try:
        return set(open("/proc/cpuinfo").read().split())
    except OSError:
        return set()


def cpu_has_avx2_fma() -> bool:
    return {"avx2", "fma"} <= cpu_flags()


def widest() -> str:
    if not cpu_has_avx2_fma():
        return "portable"
    return "avx512" if "avx512f" in cpu_flags() else "avx2"


def same_results(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"]
    assert a["weights"] == b["weights"]
    for x, y in zip(a["wide"], b["wide"]):
        np.testing.assert_array_equal(np.array(x), np.array(y))


def test_portable_kernels_match_the_default_ones_bitwise():
    portable, default = run("portable"), run(None)
    assert portable["isa"] == "portable"
    assert default["isa"] == widest()
    assert portable["losses"][-1] < portable["losses"][0]
    same_results(portable, default)


@pytest.mark.skipif(not cpu_has_avx2_fma(), reason="this CPU has no AVX2/FMA")
def test_avx2_kernels_on_request_match_bitwise():
    avx2 = run("avx2")
    assert avx2["isa"] == "avx2"
    same_results(avx2, run("portable"))
    assert run("auto")["isa"] == widest()


def test_this_process_reports_its_choice():
    assert rlx._rlx.cpu_isa() in ("avx512", "avx2", "portable")


@pytest.mark.parametrize("var,value", [("RLX_CPU_ISA", "avx-512"), ("RLX_CPU_GEMM", "mkl"), ("RLX_CPU_BF16", "on"),
                                       ("RLX_NUM_THREADS", "0"), ("RLX_NUM_THREADS", "abc")])
def test_a_misspelt_cpu_setting_is_an_input_error_at_compile(monkeypatch, var, value):
    """These used to fall back to the default silently."""
    monkeypatch.setenv(var, value)
    with pytest.raises(rlx.InputError, match=rf"\[cpu\] {var} must be .*got '{value}'"):
        rlx.compile(lambda m, x: m(x), rlx.nn.Linear(2, 2), {"x": rlx.InputSpec((1, 2))})
    monkeypatch.setenv(var, "AVX2" if var != "RLX_NUM_THREADS" else "2")
    if var == "RLX_CPU_BF16":
        monkeypatch.setenv(var, "portable")
    rlx.compile(lambda m, x: m(x), rlx.nn.Linear(2, 2), {"x": rlx.InputSpec((1, 2))})
