"""Checkpoints under hostile conditions.

1. Crash safety: a child process saves a large (64 MiB) checkpoint over an existing good one in a
   loop and is SIGKILLed at random moments. After every kill the file at the path loads and holds
   either the previous or the new weights, never a mix or a torn file; the only other files
   allowed in the folder are the hidden temporaries ``.NAME.tmp-PID[-N]`` of killed writers (listed
   in the test output: run with ``-s``).
2. Hostile safetensors files (huge declared sizes, overlapping / reversed / out-of-file offsets,
   a header length past the end, non-UTF-8 headers, bad dtype strings, duplicate names, files
   that never end): each load raises ``rlx.CheckpointError`` quickly, without a large allocation,
   and leaves the (compiled) model unchanged.
"""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import struct
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import rlx

N_KILLS = 6
TENSORS = 4
ELEMS = 4 * 1024 * 1024  # 4 tensors x 16 MiB = 64 MiB per checkpoint

CHILD = textwrap.dedent("""
    import sys, numpy as np, rlx
    path, start = sys.argv[1], int(sys.argv[2])
    TENSORS, ELEMS = int(sys.argv[3]), int(sys.argv[4])

    class Big(rlx.nn.Module):
        def __init__(self):
            for i in range(TENSORS):
                setattr(self, f"t{i}", rlx.nn.Parameter(np.zeros(ELEMS, np.float32)))

    model = Big()
    # compiling moves the weights into the weight store: .numpy() are views to fill in place
    rlx.compile(lambda m, x: x * 1.0, model, {"x": rlx.InputSpec((1,))})
    views = [p.numpy() for p in model.parameters().values()]
    k = start
    while True:
        for i, v in enumerate(views):
            v[:] = k + i / 8.0
        print("saving", k, flush=True)
        model.save(path)
        print("saved", k, flush=True)
        k += 1
""")


class Big(rlx.nn.Module):
    def __init__(self):
        for i in range(TENSORS):
            setattr(self, f"t{i}", rlx.nn.Parameter(np.zeros(ELEMS, np.float32)))


def version_of(model):
    """The version k a loaded Big model holds, checking that every tensor agrees (never partial)."""
    vals = [p.numpy() for p in model.parameters().values()]
    k = float(vals[0][0])
    for i, v in enumerate(vals):
        expect = k + i / 8.0
        assert v[0] == expect and v[-1] == expect and np.all(v == expect), (
            f"tensor t{i} is not uniformly version {k}: a mix of two saves")
    return int(k)


TMP_RE = re.compile(r"^\.ckpt\.safetensors\.tmp-(\d+)(-\d+)?$")  # .NAME.tmp-PID[-N]


def test_sigkill_during_save_leaves_old_or_new_file(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    # the initial good checkpoint: version 0
    model = Big()
    rlx.compile(lambda m, x: x * 1.0, model, {"x": rlx.InputSpec((1,))})
    for i, p in enumerate(model.parameters().values()):
        p.numpy()[:] = 0 + i / 8.0
    model.save(str(path))

    rng = np.random.default_rng(0)
    current, start = 0, 1
    leftovers_seen = []
    killed_mid_save = 0
    loader = Big()
    for trial in range(N_KILLS):
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(path), str(start), str(TENSORS),
                                  str(ELEMS)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, bufsize=1)
        try:
            line = child.stdout.readline()  # wait until the first save has begun
            assert line.startswith("saving"), (line, child.stderr.read() if child.poll() else "")
            time.sleep(float(rng.uniform(0.0, 0.6)))
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(30)
        rest = child.stdout.read()
        child.stdout.close()
        child.stderr.close()
        lines = [line] + rest.splitlines()
        saved = [int(ln.split()[1]) for ln in lines if ln.startswith("saved")]
        saving = [int(ln.split()[1]) for ln in lines if ln.startswith("saving")]
        last_done = saved[-1] if saved else current
        in_progress = saving[-1] if saving and (not saved or saving[-1] > saved[-1]) else None
        allowed = {last_done} | ({in_progress} if in_progress is not None else set())
        killed_mid_save += in_progress is not None

        loader.load(str(path))  # must parse and validate: never a torn file
        got = version_of(loader)
        assert got in allowed, f"trial {trial}: file holds version {got}, expected one of {allowed}"

        others = sorted(set(os.listdir(tmp_path)) - {"ckpt.safetensors"})
        for name in others:
            m = TMP_RE.match(name)
            assert m, f"unexpected file left in the folder: {name!r}"
            assert int(m.group(1)) == child.pid, f"temp file of another process: {name}"
            leftovers_seen.append(name)
            os.remove(tmp_path / name)  # keep the folder tidy for the next trial's check
        current = got
        start = max(saving + [start]) + 1

    print(f"\n[info] {N_KILLS} kills, {killed_mid_save} while a save was in progress; "
          f"leftover temp files (removed after each check): {leftovers_seen or 'none'}")
    # a normal save in this process still works and leaves just the file
    model.save(str(path))
    assert sorted(os.listdir(tmp_path)) == ["ckpt.safetensors"]
    loader.load(str(path))
    assert version_of(loader) == 0


# ----------------------------------------------------------------------------------------------
# hostile files
# ----------------------------------------------------------------------------------------------
class Net(rlx.nn.Module):
    def __init__(self):
        self.a = rlx.nn.Linear(4, 3)

    def __call__(self, x):
        return self.a(x)


W = np.arange(12, dtype=np.float32).reshape(3, 4)  # Linear(4, 3): (out, in)
B_ = np.array([0.5, -1.5, 2.5], np.float32)
DATA = W.tobytes() + B_.tobytes()  # 60 bytes


def good_header():
    return {"a.weight": {"dtype": "F32", "shape": [3, 4], "data_offsets": [0, 48]},
            "a.bias": {"dtype": "F32", "shape": [3], "data_offsets": [48, 60]}}


def with_bias(**kw):
    h = good_header()
    h["a.bias"].update(kw)
    return h


def pack(header=None, data=DATA, hlen=None, raw=None):
    """A safetensors file: u64 header length, header bytes (JSON unless ``raw``), data."""
    h = raw if raw is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(h) if hlen is None else hlen) + h + data


GOOD_JSON = json.dumps(good_header()).encode()

HOSTILE = {
    # huge declared sizes
    "shape-2**60": pack(with_bias(shape=[2**60])),
    "shape-product-overflow": pack(with_bias(shape=[2**31, 2**31, 2**31])),
    "shape-2**64": pack(with_bias(shape=[2**64])),
    "shape-negative": pack(with_bias(shape=[-3])),
    "shape-float": pack(with_bias(shape=[3.0])),
    "shape-not-list": pack(with_bias(shape=3)),
    "shape-too-small-for-offsets": pack(with_bias(shape=[2])),
    "offsets-claim-2**60-bytes": pack(with_bias(data_offsets=[48, 2**60])),
    "offsets-u64-max": pack(with_bias(data_offsets=[2**64 - 12, 2**64 - 1])),
    "offsets-reversed": pack(with_bias(data_offsets=[60, 48])),
    "offsets-overlapping": pack(with_bias(data_offsets=[36, 48])),
    "offsets-overlap-same-start": pack(with_bias(data_offsets=[0, 12])),
    "offsets-gap": pack(with_bias(data_offsets=[52, 64]), data=W.tobytes() + b"\0" * 4 + B_.tobytes()),
    "offsets-past-end": pack(with_bias(data_offsets=[48, 64])),
    "offsets-negative": pack(with_bias(data_offsets=[-12, 0])),
    "offsets-three": pack(with_bias(data_offsets=[48, 60, 72])),
    "offsets-missing": pack({**good_header(), "a.bias": {"dtype": "F32", "shape": [3]}}),
    "data-trailing-garbage": pack(good_header(), data=DATA + b"garbage!"),
    "data-truncated": pack(good_header(), data=DATA[:-1]),
    # header length
    "hlen-past-end": pack(good_header(), hlen=10**6),
    "hlen-one-past-end": pack(good_header(), hlen=len(GOOD_JSON) + len(DATA) + 1),
    "hlen-2**63": pack(good_header(), hlen=2**63),
    "hlen-u64-max": pack(good_header(), hlen=2**64 - 1),
    "hlen-zero": pack(good_header(), hlen=0),
    "hlen-too-short": pack(good_header(), hlen=len(GOOD_JSON) - 1),
    "file-shorter-than-length-field": b"\x10\x00\x00",
    "empty-file": b"",
    # header encoding / structure
    "header-non-utf8": pack(raw=b'{"a.weight\xff\xfe": 1}'),
    "header-utf16": pack(raw=GOOD_JSON.decode().encode("utf-16")),
    "header-bom": pack(raw=b"\xef\xbb\xbf" + GOOD_JSON),
    "header-nul-bytes": pack(raw=GOOD_JSON + b"\0\0\0\0"),
    "header-list": pack([1, 2]),
    "header-null": pack(None),
    "header-number": pack(raw=b"12345678"),
    "header-deeply-nested": pack(raw=b"[" * 100_000 + b"]" * 100_000),
    "header-entry-not-object": pack({**good_header(), "a.bias": 5}),
    "header-metadata-not-strings": pack({**good_header(), "__metadata__": {"x": 1}}),
    "header-truncated-json": pack(raw=GOOD_JSON[:-5]),
    # dtypes
    "dtype-unknown": pack(with_bias(dtype="F99")),
    "dtype-lowercase": pack(with_bias(dtype="f32")),
    "dtype-empty": pack(with_bias(dtype="")),
    "dtype-null": pack(with_bias(dtype=None)),
    "dtype-number": pack(with_bias(dtype=32)),
    "dtype-I64": pack(with_bias(dtype="I64", data_offsets=[48, 72]),
                      data=W.tobytes() + B_.astype(np.float64).tobytes()),
    "dtype-I16": pack(with_bias(dtype="I16", data_offsets=[48, 54]), data=W.tobytes() + b"\0" * 6),
    "dtype-I32": pack(with_bias(dtype="I32")),
    "dtype-F32-as-U8-size": pack(with_bias(dtype="U8")),
    # names
    "duplicate-name-identical": pack(raw=GOOD_JSON[:-1] + b', "a.bias": {"dtype": "F32", "shape": [3], '
                                                          b'"data_offsets": [48, 60]}}'),
    "duplicate-name-different": pack(raw=b'{"a.bias": {"dtype": "F32", "shape": [4], '
                                         b'"data_offsets": [48, 64]}, ' + GOOD_JSON[1:]),
    "duplicate-name-shadowing-weight": pack(raw=GOOD_JSON[:-1] + b', "a.weight": {"dtype": "F32", '
                                                                b'"shape": [12], "data_offsets": [0, 48]}}'),
    "empty-name-extra": pack({**good_header(), "": {"dtype": "F32", "shape": [0],
                                                    "data_offsets": [60, 60]}}),
    "missing-tensor": pack({"a.weight": good_header()["a.weight"]}, data=W.tobytes()),
}


@pytest.fixture
def compiled_model():
    rlx.seed(0)
    model = Net()
    fn = rlx.compile(lambda m, x: m(x), model, {"x": rlx.InputSpec((2, 4))})
    step = rlx.compile_train_step(lambda m, x: (m(x) ** 2).mean(), model, rlx.optim.Adam(lr=0.1),
                                  {"x": rlx.InputSpec((2, 4))})
    step(x=np.ones((2, 4), np.float32))
    return model, fn


def test_the_good_file_loads(tmp_path, compiled_model):
    model, fn = compiled_model
    path = tmp_path / "good.safetensors"
    path.write_bytes(pack(good_header()))
    model.load(str(path))
    np.testing.assert_array_equal(model.a.weight.numpy(), W)
    np.testing.assert_array_equal(model.a.bias.numpy(), B_)
    np.testing.assert_allclose(fn(x=np.ones((2, 4), np.float32)), np.ones((2, 4)) @ W.T + B_,
                               rtol=1e-6)


@pytest.mark.parametrize("case", list(HOSTILE), ids=list(HOSTILE))
def test_hostile_file_refused_cleanly(tmp_path, compiled_model, case):
    model, fn = compiled_model
    path = tmp_path / "hostile.safetensors"
    raw = HOSTILE[case]
    path.write_bytes(raw)
    before = {k: p.numpy().copy() for k, p in model.parameters().items()}
    x = np.ones((2, 4), np.float32)
    out_before = fn(x=x)
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    with pytest.raises(rlx.CheckpointError) as info:
        model.load(str(path))
    elapsed = time.perf_counter() - t0
    grew_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before) / 1024
    assert str(path) in str(info.value) or "hostile" in str(info.value), "the message names the file"
    assert elapsed < 2.0, f"took {elapsed:.2f} s"
    assert grew_mb < 64, f"peak memory grew by {grew_mb:.0f} MiB while refusing a {len(raw)}-byte file"
    for k, p in model.parameters().items():
        np.testing.assert_array_equal(p.numpy(), before[k], err_msg=f"{k} changed")
    np.testing.assert_array_equal(fn(x=x), out_before)
    assert path.read_bytes() == raw, "a refused load modified the file"


def _isolated_load(path_expr, timeout=20):
    code = textwrap.dedent(f"""
        import resource, sys, faulthandler
        faulthandler.enable()
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
        import numpy as np, rlx
        m = rlx.nn.Linear(4, 3)
        try:
            m.load({path_expr})
        except rlx.CheckpointError as e:
            print("CHECKPOINT-ERROR", str(e)[:300])
        except BaseException as e:
            print("OTHER", type(e).__name__, str(e)[:300])
        else:
            print("LOADED")
        # VmHWM is this process's own peak: ru_maxrss would include the (possibly large) parent's
        # peak, which Linux carries across fork and exec.
        try:
            hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]
            print("MAXRSS_MB", int(hwm) // 1024)
        except (OSError, IndexError):
            print("MAXRSS_MB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
    """)
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"load({path_expr}) did not return within {timeout} s")
    assert p.returncode == 0, f"the interpreter died (rc={p.returncode}): {p.stderr[-1500:]}"
    assert p.stdout.startswith("CHECKPOINT-ERROR"), p.stdout + p.stderr[-1500:]
    rss = int(p.stdout.split("MAXRSS_MB")[1])
    assert rss < 512, f"refusing the file took {rss} MiB of memory (it was read whole): {p.stdout}"


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_never_ending_file_is_refused():
    """/dev/zero (a "file" with no end) must not be read into memory until allocation fails."""
    _isolated_load("'/dev/zero'")


def test_fifo_is_refused_without_blocking(tmp_path):
    """A named pipe with no writer: load must not block forever in open()/read()."""
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs here")
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    _isolated_load(repr(str(fifo)), timeout=60)


def test_sparse_huge_file_is_refused_without_reading_it(tmp_path):
    """A valid 60-byte checkpoint followed by a 1 GiB hole (no disk space used): the header says
    the file should be 60 bytes of data, so it can be refused after reading the header, not after
    reading 1 GiB into memory. (Isolated with a 2 GiB address-space limit.)"""
    path = tmp_path / "sparse.safetensors"
    with open(path, "wb") as f:
        f.write(pack(good_header()))
        f.truncate(1 << 30)
    _isolated_load(repr(str(path)))
