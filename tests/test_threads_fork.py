"""Adversarial threading and fork(): no deadlock between a prefetched step and any other rlx
call, fork-safe children, consistent save/load snapshots, prefetch snapshots, checked unused
inputs, and checkpoint paths (links, long names).

Scenarios that could hang run in a subprocess with a timeout, so a regression fails the test
instead of freezing the suite."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import rlx

TIMEOUT = 180

PRELUDE = textwrap.dedent(
    """
    import os, sys, threading, time
    import numpy as np
    import rlx

    class MLP(rlx.nn.Module):
        def __init__(self, d_in=32, d_h=64):
            self.fc1 = rlx.nn.Linear(d_in, d_h)
            self.fc2 = rlx.nn.Linear(d_h, 10)
        def __call__(self, x):
            return self.fc2(rlx.relu(self.fc1(x)))

    def make(b=16, d_in=32, d_h=64):
        rlx.seed(0)
        model = MLP(d_in, d_h)
        step = rlx.compile_train_step(lambda m, x, y: rlx.cross_entropy(m(x), y), model,
                                      rlx.optim.SGD(lr=0.01),
                                      {"x": rlx.InputSpec((b, d_in)), "y": rlx.InputSpec((b,), "int32")})
        return model, step

    def wait_child(pid, seconds):
        # The child's exit code; kills it and fails if it runs longer than `seconds`.
        deadline = time.monotonic() + seconds
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status)
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                raise SystemExit("a child hung")
            time.sleep(0.01)

    def batch(b=16, d_in=32, seed=0):
        r = np.random.default_rng(seed)
        return r.standard_normal((b, d_in)).astype(np.float32), r.integers(0, 10, b).astype(np.int32)
    """
)


def run_script(body: str, timeout: int = TIMEOUT) -> subprocess.CompletedProcess:
    code = PRELUDE + textwrap.dedent(body)
    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    try:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the scenario hung for {timeout} s; output so far:\n{e.stdout}\n{e.stderr}")


def check_ok(r: subprocess.CompletedProcess) -> None:
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    assert "panicked" not in r.stderr, r.stderr
    assert "OK" in r.stdout, r.stdout


def test_prefetched_steps_do_not_deadlock_with_calls_from_other_threads(tmp_path):
    """Thread A prefetches fresh arrays and steps; thread B reads `prefetched`, views and
    writes rows of another function sharing the weights, saves and loads the model."""
    r = run_script(
        f"""
        model, step = make()
        fn = rlx.compile(lambda m, x, cache: (m(x), cache * 1.0), model,
                         {{"x": rlx.InputSpec((4, 32)), "cache": rlx.InputSpec((8, 32))}})
        fn.bind("cache", np.zeros((8, 32), np.float32))
        path = {str(tmp_path / "m.safetensors")!r}
        model.save(path)
        stop = time.monotonic() + 4
        errors = []
        def a():
            try:
                i = 0
                while time.monotonic() < stop:
                    x, y = batch(seed=i)
                    step.prefetch(x=x.copy(), y=y.copy())
                    step()
                    i += 1
            except Exception as e:
                errors.append(repr(e))
        def b():
            try:
                i = 0
                while time.monotonic() < stop:
                    step.prefetched
                    fn.view("cache")
                    fn.write_rows("cache", i % 8, np.ones((1, 32), np.float32))
                    fn(x=np.ones((4, 32), np.float32))
                    if i % 20 == 0:
                        model.load(path)
                        model.save(path)
                    i += 1
            except Exception as e:
                errors.append(repr(e))
        ts = [threading.Thread(target=a), threading.Thread(target=b), threading.Thread(target=b)]
        for t in ts: t.start()
        for t in ts: t.join()
        assert not errors, errors
        print("OK")
        """
    )
    check_ok(r)


def test_forked_child_works_after_steps_pools_and_copies():
    """After compiling, stepping (worker pool started), prefetching (copy thread started) and
    with a copy in flight, a forked child steps, prefetches and exits cleanly."""
    r = run_script(
        """
        model, step = make(b=512, d_in=256, d_h=1024)   # large enough to use every worker
        x, y = batch(512, 256)
        step(x=x, y=y)
        step.prefetch(x=x, y=y)
        step()
        big = np.ones((512, 256), np.float32)
        step.prefetch(x=big, y=y)        # possibly still copying at the fork
        pid = os.fork()
        if pid == 0:
            try:
                a = step(x=x, y=y)
                step.prefetch(x=x, y=y)
                b = step()
                assert np.isfinite(a) and np.isfinite(b)
                try:
                    step(); step()
                    raise SystemExit("a batch prefetched by the parent was consumed in the child")
                except rlx.InputError as e:
                    assert "fork" in str(e) or "missing input" in str(e), e
                sys.stdout.write("child OK\\n"); sys.stdout.flush()
            except BaseException as e:
                sys.stdout.write(f"child failed: {e!r}\\n"); sys.stdout.flush()
                os._exit(3)
            sys.exit(0)                  # normal exit: executables and engines are dropped
        assert wait_child(pid, 120) == 0
        step()                           # the parent's own prefetched batch is intact
        print("OK")
        """
    )
    check_ok(r)
    assert "child OK" in r.stdout


def test_fork_while_another_thread_steps_waits_for_the_step():
    r = run_script(
        """
        model, step = make(b=256, d_in=128, d_h=512)
        x, y = batch(256, 128)
        stop = time.monotonic() + 3
        def train():
            while time.monotonic() < stop:
                step(x=x, y=y)
        t = threading.Thread(target=train); t.start()
        for _ in range(10):
            pid = os.fork()
            if pid == 0:
                step(x=x, y=y)
                os._exit(0)
            assert wait_child(pid, 60) == 0
        t.join()
        print("OK")
        """
    )
    check_ok(r)


def test_fork_while_another_thread_compiles_new_sizes():
    """rlx's Python locks (store creation, building a new size) are held across the fork and
    fresh in the child, so a child compiling while the parent compiles elsewhere never hangs."""
    r = run_script(
        """
        rlx.seed(0)
        model = MLP()
        step = rlx.compile_train_step(lambda m, x, y: rlx.cross_entropy(m(x), y), model,
                                      rlx.optim.SGD(lr=0.01),
                                      {"x": rlx.InputSpec((None, 32)), "y": rlx.InputSpec((None,), "int32")})
        stop = time.monotonic() + 3
        def compile_sizes():
            b = 1
            while time.monotonic() < stop:
                x, y = batch(b=b)
                step(x=x, y=y)
                fresh = MLP()
                rlx.compile(lambda m, x: m(x), fresh, {"x": rlx.InputSpec((b, 32))})
                b += 1
        t = threading.Thread(target=compile_sizes); t.start()
        for i in range(8):
            pid = os.fork()
            if pid == 0:
                x, y = batch(b=1000 + i)
                step(x=x, y=y)
                rlx.compile(lambda m, x: m(x), MLP(), {"x": rlx.InputSpec((3, 32))})
                os._exit(0)
            assert wait_child(pid, 60) == 0
        t.join()
        print("OK")
        """
    )
    check_ok(r)


class Flat(rlx.nn.Module):
    """Two big parameters whose gradient is 1 everywhere: SGD with lr = 2**-10 moves every
    element by exactly 2**-10 per step, so a consistent snapshot has one value throughout."""

    def __init__(self, n):
        self.a = rlx.nn.Parameter(np.zeros(n, np.float32))
        self.b = rlx.nn.Parameter(np.zeros(n, np.float32))


def test_save_while_training_writes_one_steps_weights(tmp_path):
    model = Flat(1 << 18)
    step = rlx.compile_train_step(lambda m, x: m.a.sum() + m.b.sum() + (x * 0.0).sum(), model,
                                  rlx.optim.SGD(lr=2.0**-10), {"x": rlx.InputSpec((1,))})
    x = np.zeros(1, np.float32)
    stop = threading.Event()

    def train():
        while not stop.is_set():
            step(x=x)

    t = threading.Thread(target=train)
    t.start()
    try:
        for i in range(10):
            path = tmp_path / f"s{i}.safetensors"
            model.save(path)
            check = Flat(1 << 18)
            check.load(path)
            values = np.concatenate([check.a.numpy(), check.b.numpy()])
            assert np.all(values == values[0]), f"checkpoint {i} mixes steps: {np.unique(values)[:5]}"
    finally:
        stop.set()
        t.join()


def test_load_is_seen_whole_by_a_concurrent_function(tmp_path):
    n = 1 << 18
    model = Flat(n)
    paths = []
    for v in (1.0, 2.0):
        m = Flat(n)
        m.a.numpy()[:] = v
        m.b.numpy()[:] = v
        p = tmp_path / f"{v}.safetensors"
        m.save(p)
        paths.append(p)
    fn = rlx.compile(lambda m, x: m.a.sum() + m.b.sum() + (x * 0.0).sum(), model, {"x": rlx.InputSpec((1,))})
    model.load(paths[0])
    stop = threading.Event()
    seen = set()

    def infer():
        while not stop.is_set():
            seen.add(float(fn(x=np.zeros(1, np.float32))))

    t = threading.Thread(target=infer)
    t.start()
    try:
        for i in range(20):
            model.load(paths[i % 2])
    finally:
        stop.set()
        t.join()
    assert seen <= {2.0 * n, 4.0 * n}, f"a function saw half-loaded weights: {sorted(seen)}"


def test_prefetch_takes_a_snapshot_of_the_batch():
    model = Flat(4)
    fn = rlx.compile(lambda m, x: x * 1.0, model, {"x": rlx.InputSpec((1024,))})
    x = np.arange(1024, dtype=np.float32)
    fn.prefetch(x=x)
    x[:] = -1.0  # changed right after the call: the batch was copied already
    np.testing.assert_array_equal(fn(), np.arange(1024, dtype=np.float32))


def test_unused_declared_inputs_are_checked_like_used_ones():
    model = Flat(4)
    step = rlx.compile_train_step(lambda m, x, mask: m.a.sum() + (x * 0.0).sum(), model, rlx.optim.SGD(lr=0.1),
                                  {"x": rlx.InputSpec((2,)), "mask": rlx.InputSpec((3,))})
    x = np.zeros(2, np.float32)
    with pytest.raises(rlx.ShapeError, match="mask"):
        step(x=x, mask=np.zeros((7, 7), np.float32))
    with pytest.raises(rlx.DTypeError, match="mask"):
        step(x=x, mask=np.array(["a", "b", "c"]))
    step(x=x, mask=np.zeros(3, np.float32))
    step.prefetch(x=x, mask=np.zeros(3, np.float32))  # the same batch prefetches too
    step()
    with pytest.raises(rlx.ShapeError, match="mask"):
        step.prefetch(x=x, mask=np.zeros(4, np.float32))


def test_checkpoint_mismatches_name_the_tensor(tmp_path):
    class Two(rlx.nn.Module):
        def __init__(self, n=3, extra=False):
            self.w = rlx.nn.Parameter(np.ones(n, np.float32))
            if extra:
                self.extra = rlx.nn.Parameter(np.ones(5, np.float32))

    Two(extra=True).save(tmp_path / "extra.safetensors")
    Two(n=4).save(tmp_path / "shape.safetensors")
    m = Two()
    before = m.w.numpy().copy()
    with pytest.raises(rlx.CheckpointError, match=r"unexpected \['extra'\]"):
        m.load(tmp_path / "extra.safetensors")
    with pytest.raises(rlx.CheckpointError, match=r"'w' is float32 \(4,\) in the checkpoint but float32 \(3,\)"):
        m.load(tmp_path / "shape.safetensors")
    np.testing.assert_array_equal(m.w.numpy(), before)


def test_save_through_a_symlink_writes_its_target(tmp_path):
    m = Flat(3)
    (tmp_path / "real").mkdir()
    link = tmp_path / "latest.safetensors"
    link.symlink_to("real/ckpt.safetensors")
    m.save(link)
    assert link.is_symlink()
    assert (tmp_path / "real" / "ckpt.safetensors").is_file()
    m.a.numpy()[:] = 5.0
    m.save(link)
    check = Flat(3)
    check.load(tmp_path / "real" / "ckpt.safetensors")
    np.testing.assert_array_equal(check.a.numpy(), 5.0)


def test_save_accepts_the_longest_file_names(tmp_path):
    m = Flat(3)
    path = tmp_path / ("n" * 240 + ".safetensors")  # 252 characters
    m.save(path)
    Flat(3).load(path)
    assert sorted(os.listdir(tmp_path)) == [path.name]
