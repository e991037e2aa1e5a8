"""Threads: calls on one step / function object are serialised (no crash, no torn weights, no
mixed-up inputs), different executables run side by side, and tracing in two threads at once
keeps the traces apart. With identical batches and a deterministic optimizer the order of the
steps does not matter, so N steps from two threads must equal N sequential steps bitwise.

The wall-time comparison (GIL released during a step) is printed for information only (run with
``-s`` to see it): the machine is noisy and rlx's own kernels may already use every core.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import models
import rlx

S = rlx.InputSpec
JOIN_TIMEOUT = 120


def MLP(d_in=32, d_h=64, d_out=10):
    return models.MLP(d_in, d_h, d_out)


loss_fn = models.ce_loss


def make(opt_name, seed=0, b=16, d_in=32, d_h=64, d_out=10):
    rlx.seed(seed)
    model = MLP(d_in, d_h, d_out)
    opt = {"sgd": lambda: rlx.optim.SGD(lr=0.05),
           "sgd-momentum": lambda: rlx.optim.SGD(lr=0.05, momentum=0.9, weight_decay=1e-3),
           "adam": lambda: rlx.optim.Adam(lr=1e-3)}[opt_name]()
    step = rlx.compile_train_step(loss_fn, model, opt,
                                  {"x": S((b, d_in)), "y": S((b,), "int32")})
    return model, opt, step


def batch(seed=0, b=16, d_in=32, d_out=10):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((b, d_in)).astype(np.float32), rng.integers(0, d_out, b).astype(np.int32)


def run_threads(targets):
    errors = []

    def wrap(f):
        def g():
            try:
                f()
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
        return g

    threads = [threading.Thread(target=wrap(f)) for f in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_TIMEOUT)
    assert not any(t.is_alive() for t in threads), "a thread hung (deadlock?)"
    if errors:
        raise errors[0]


def bits(a):
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


def assert_params_equal(ma, mb):
    for k, p in ma.parameters().items():
        np.testing.assert_array_equal(bits(p.numpy()), bits(mb.parameters()[k].numpy()), err_msg=k)


# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("opt_name", ["sgd", "sgd-momentum", "adam"])
def test_same_step_from_two_threads_equals_sequential(opt_name):
    n_per_thread = 150
    x, y = batch(1)
    ref_model, ref_opt, ref_step = make(opt_name)
    ref_losses = [ref_step(x=x, y=y) for _ in range(2 * n_per_thread)]

    model, opt, step = make(opt_name)
    losses = [[], []]

    def worker(k):
        def f():
            for _ in range(n_per_thread):
                losses[k].append(step(x=x, y=y))
        return f

    run_threads([worker(0), worker(1)])
    assert len(losses[0]) == len(losses[1]) == n_per_thread
    assert all(np.isfinite(losses[0] + losses[1]))
    # serialised calls: the multiset of losses is exactly the sequential one
    assert sorted(losses[0] + losses[1]) == sorted(ref_losses)
    assert_params_equal(model, ref_model)
    for k in model.parameters():
        for key, v in opt.state(k).items():
            np.testing.assert_array_equal(np.asarray(v), np.asarray(ref_opt.state(k)[key]),
                                          err_msg=f"{key} of {k}")


def test_four_threads_with_reader():
    """Four writers on one step while a reader copies weights, grads, state and memory()."""
    n_per_thread = 60
    x, y = batch(2)
    ref_model, _, ref_step = make("adam", seed=1)
    for _ in range(4 * n_per_thread):
        ref_step(x=x, y=y)
    model, opt, step = make("adam", seed=1)
    stop = threading.Event()
    reads = [0]

    def writer():
        for _ in range(n_per_thread):
            assert np.isfinite(step(x=x, y=y))

    def reader():
        while not stop.is_set():
            w = model.fc1.weight.numpy().copy()
            g = {k: v.copy() for k, v in step.grads.items()}
            st = opt.state("fc2.bias")
            mem = step.memory()
            assert w.shape == (64, 32) and set(g) == set(model.parameters())
            assert mem["arena_bytes"] <= mem["naive_bytes"] and st["exp_avg"].shape == (10,)
            reads[0] += 1

    r = threading.Thread(target=reader)
    r.start()
    try:
        run_threads([writer] * 4)
    finally:
        stop.set()
        r.join(JOIN_TIMEOUT)
    assert not r.is_alive()
    assert reads[0] > 0
    assert_params_equal(model, ref_model)


def test_inference_function_from_threads_keeps_inputs_apart():
    """Each thread feeds its own input; a call must never compute on another thread's input."""
    rlx.seed(3)
    model = MLP()
    fn = rlx.compile(lambda m, x: m(x), model, {"x": S((16, 32))})
    xs = [batch(10 + k)[0] for k in range(4)]
    expected = [fn(x=x).copy() for x in xs]

    def worker(k):
        def f():
            for _ in range(150):
                out = fn(x=xs[k])
                np.testing.assert_array_equal(out, expected[k], err_msg=f"thread {k}")
        return f

    run_threads([worker(k) for k in range(4)])


def test_prefetch_and_step_from_two_threads():
    """Two threads each prefetch a batch and consume one; refused prefetches (queue full) and
    empty-queue steps raise rlx errors. The weights equal as many sequential steps as succeeded."""
    x, y = batch(4)
    model, _, step = make("sgd-momentum", seed=2)
    done = [0, 0]
    lock = threading.Lock()

    def worker(k):
        def f():
            for _ in range(100):
                try:
                    step.prefetch(x=x, y=y)
                except rlx.RlxError:
                    pass
                try:
                    loss = step()
                except rlx.RlxError:
                    continue
                assert np.isfinite(loss)
                with lock:
                    done[k] += 1
        return f

    run_threads([worker(0), worker(1)])
    while step.prefetched:
        step()
        done[0] += 1
    total = sum(done)
    assert total > 0
    ref_model, _, ref_step = make("sgd-momentum", seed=2)
    for _ in range(total):
        ref_step(x=x, y=y)
    assert_params_equal(model, ref_model)


def test_tracing_in_two_threads_at_once():
    """Tracing state is per thread: two threads compiling different models at once both get the
    right graph."""
    results = {}
    barrier = threading.Barrier(2)

    def compile_and_check(k, d_h):
        def f():
            for i in range(10):
                rlx.seed(100 + k)
                model = MLP(d_h=d_h)

                def fwd(m, x):
                    barrier.wait(timeout=30)  # both threads are inside a trace now
                    return m(x)

                fn = rlx.compile(fwd, model, {"x": S((4, 32))})
                x = batch(k, b=4)[0]
                p = {n: v.numpy().astype(np.float64) for n, v in model.parameters().items()}
                h = np.maximum(x @ p["fc1.weight"].T + p["fc1.bias"], 0)
                ref = h @ p["fc2.weight"].T + p["fc2.bias"]
                np.testing.assert_allclose(fn(x=x), ref, rtol=1e-4, atol=1e-5)
            results[k] = True
        return f

    run_threads([compile_and_check(0, 48), compile_and_check(1, 80)])
    assert results == {0: True, 1: True}


def test_two_models_in_parallel_threads():
    """Different executables run side by side and each ends where its sequential run ends.
    Prints (for information only) the wall time of both in parallel vs one alone."""
    dims = dict(b=128, d_in=256, d_h=1024, d_out=10)
    n = 30
    xa, ya = batch(5, b=128, d_in=256)
    xb, yb = batch(6, b=128, d_in=256)

    ref_a, _, sa = make("adam", seed=5, **dims)
    ref_b, _, sb = make("sgd", seed=6, **dims)
    sa(x=xa, y=ya)  # warm up
    sb(x=xb, y=yb)
    t0 = time.perf_counter()
    for _ in range(n):
        sa(x=xa, y=ya)
    one = time.perf_counter() - t0
    for _ in range(n):
        sb(x=xb, y=yb)

    ma, _, pa = make("adam", seed=5, **dims)
    mb, _, pb = make("sgd", seed=6, **dims)
    pa(x=xa, y=ya)
    pb(x=xb, y=yb)
    t0 = time.perf_counter()
    run_threads([lambda: [pa(x=xa, y=ya) for _ in range(n)],
                 lambda: [pb(x=xb, y=yb) for _ in range(n)]])
    both = time.perf_counter() - t0
    assert_params_equal(ma, ref_a)
    assert_params_equal(mb, ref_b)
    print(f"\n[info] {n} steps alone: {one * 1e3:.0f} ms; two models x {n} steps in two threads: "
          f"{both * 1e3:.0f} ms ({both / one:.2f}x one thread; 2.00x = fully serialised)")
