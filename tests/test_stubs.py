"""The type stubs of the native module (python/rlx/_rlx.pyi) match it: mypy's stubtest compares every
class, method, signature and default against the runtime module."""

import os
import subprocess
import sys

import rlx

HERE = os.path.dirname(__file__)


def test_stubtest_passes_on_the_native_module():
    cmd = [sys.executable, "-m", "mypy.stubtest", "rlx._rlx", "--allowlist", os.path.join(HERE, "stubtest_allowlist.txt")]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE, timeout=600)
    assert r.returncode == 0, f"stubtest found differences:\n{r.stdout}\n{r.stderr}"


def test_package_is_marked_typed():
    assert os.path.exists(os.path.join(os.path.dirname(rlx.__file__), "py.typed"))
