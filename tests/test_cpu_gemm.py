"""The CPU's float32 GEMM paths: rlx's own AVX-512 and AVX2 kernels and the `gemm` crate
(`RLX_CPU_GEMM=crate`), each in its own process (the path is chosen once per process). Every path
this CPU can run multiplies random shapes, both transposes and batches through rlx.Graph, and
its error against float64 numpy stays within float32 summation error; `cpu_gemm_path()` names
the path that ran."""

import json
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, sys
import numpy as np, rlx
from rlx import _rlx
rng = np.random.default_rng(0)
errs = {}
shapes = [(1, 1, 1), (7, 13, 31), (33, 65, 1), (65, 257, 33), (257, 31, 65), (13, 600, 7), (300, 64, 70)]
for m, k, n in shapes:
    for ta in (False, True):
        for tb in (False, True):
            for batch in ((), (3,)):
                a = rng.normal(size=batch + (m, k)).astype(np.float32)
                b = rng.normal(size=(k, n)).astype(np.float32)
                g = rlx.Graph()
                x = g.input("a", batch + ((k, m) if ta else (m, k)))
                y = g.input("b", (n, k) if tb else (k, n))
                # The matmul op with transpose flags, as autodiff emits it (transposes read in place).
                g.output(rlx.Tensor(x._trace, x._trace.graph.matmul(x._id, y._id, ta, tb)))
                got = g.compile("cpu").run(a=np.ascontiguousarray(np.swapaxes(a, -1, -2)) if ta else a,
                                           b=np.ascontiguousarray(b.T) if tb else b)
                got = got[0] if isinstance(got, (list, tuple)) else got
                a64, b64 = a.astype(np.float64), b.astype(np.float64)
                scale = np.abs(a64) @ np.abs(b64) + 1e-30
                errs[f"{batch} {m}x{k}x{n} {ta} {tb}"] = float(np.max(np.abs(got - a64 @ b64) / scale))
json.dump({"path": _rlx.cpu_gemm_path(), "errs": errs}, sys.stdout)
"""


def run(gemm: str | None) -> dict:
    env = dict(os.environ)
    env.pop("RLX_CPU_GEMM", None)
    if gemm is not None:
        env["RLX_CPU_GEMM"] = gemm
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def cpu_flags() -> set[str]:
    try:
        return set(open("/proc/cpuinfo").read().split())
    except OSError:
        return set()


def check(res: dict) -> None:
    # Relative to sum |a||b|: float32 rounding of the products' sum, not a wrong element.
    worst = max(res["errs"].items(), key=lambda kv: kv[1])
    assert worst[1] < 1e-5, (res["path"], worst)


def test_default_path_is_the_best_kernel_the_cpu_has():
    res = run(None)
    check(res)
    flags = cpu_flags()
    if "avx512f" in flags:
        assert res["path"] == "avx512"
    elif {"avx2", "fma"} <= flags:
        assert res["path"] == "avx2"
    elif flags:
        assert res["path"] == "crate"


def test_crate_path_selected_by_env_matches_float64():
    res = run("crate")
    assert res["path"] == "crate"
    check(res)


def test_avx2_kernel_on_an_avx512_cpu_matches_float64():
    flags = cpu_flags()
    if not {"avx2", "fma"} <= flags:
        pytest.skip("this CPU has no AVX2 + FMA")
    res = run("avx2")
    assert res["path"] == "avx2"
    check(res)

