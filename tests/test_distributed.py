"""Data-parallel training (rlx.distributed): 2 ranks under mpirun against one process with the
whole batch, failures that must not hang, rank-0 saves; and the single-process seam (gradient
region, step phases, the communicator protocol) with a stand-in communicator."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

import models
import rlx
import rlx.distributed as dist

HERE = os.path.dirname(__file__)
WORKER = os.path.join(HERE, "dist_worker.py")
sys.path.insert(0, HERE)
import dist_worker  # noqa: E402


def _mpirun():
    if importlib.util.find_spec("mpi4py") is None:
        return None
    beside = os.path.join(os.path.dirname(sys.executable), "mpirun")
    return beside if os.path.exists(beside) else shutil.which("mpirun")


MPIRUN = _mpirun()
needs_mpi = pytest.mark.skipif(MPIRUN is None, reason='needs mpi4py and mpirun: pip install "rlx[mpi]"')


def run_ranks(scenario, out, n=2, timeout=120):
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe",
               RLX_DIST_TIMEOUT="30", PYTHONUNBUFFERED="1")
    env.pop("RLX_NUM_THREADS", None)
    start = time.monotonic()
    p = subprocess.run([MPIRUN, "-n", str(n), sys.executable, WORKER, scenario, str(out)],
                       capture_output=True, text=True, timeout=timeout, env=env)
    return p, time.monotonic() - start


def reference(opt_name, clip, world=2, precision="fp32"):
    """One process, the whole batch (world * B rows), rank 0's initial weights."""
    rlx.seed(100)
    model = models.MLP(dist_worker.D_IN, dist_worker.D_H, dist_worker.D_OUT)
    opt = dist_worker.optimizer(opt_name)
    b = dist_worker.B * world
    step = rlx.compile_train_step(models.ce_loss, model, opt,
                                  {"x": rlx.InputSpec((b, dist_worker.D_IN)), "y": rlx.InputSpec((b,), "int32")},
                                  clip_grad_norm=clip, precision=precision)
    x, y = dist_worker.data(world)
    for _ in range(dist_worker.STEPS):
        step(x=x, y=y)
    return {k: v.numpy().copy() for k, v in model.named_parameters()}


@needs_mpi
@pytest.mark.parametrize("scenario", ["train-sgd", "train-adamw", "train-adamw-clip", "train-adamw-bf16",
                                      "train-adamw-fp16"])
def test_two_ranks_match_one_process_with_the_whole_batch(tmp_path, scenario):
    p, _ = run_ranks(scenario, tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    _, opt_name, *extra = scenario.split("-")
    precision = extra[0] if extra and extra[0] in ("bf16", "fp16") else "fp32"
    want = reference(opt_name, 1.0 if extra == ["clip"] else None, precision=precision)
    # Mixed precision: the same roundings, summed in another order over the ranks.
    tol = (1e-5, 1e-6) if precision == "fp32" else (2e-3, 2e-4)
    r0, r1 = (np.load(tmp_path / f"rank{r}.npz") for r in (0, 1))
    for name, w in want.items():
        np.testing.assert_array_equal(r0[name], r1[name], err_msg=f"ranks disagree on {name}")
        np.testing.assert_allclose(r0[name], w, rtol=tol[0], atol=tol[1], err_msg=name)


@needs_mpi
@pytest.mark.parametrize("scenario", ["raise", "die"])
def test_a_failing_rank_stops_the_others_instead_of_hanging(tmp_path, scenario):
    p, took = run_ranks(scenario, tmp_path, timeout=90)
    assert p.returncode != 0
    assert took < 80
    assert not (tmp_path / "rank0.npz").exists(), "rank 0 finished training without its peer"
    if scenario == "raise":
        assert "rank 1 fails on purpose" in p.stderr
        assert "aborting every rank" in p.stderr


@needs_mpi
def test_ranks_with_different_models_are_refused_at_compile_on_every_rank(tmp_path):
    p, _ = run_ranks("mismatch", tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    e0, e1 = ((tmp_path / f"error{r}.txt").read_text() for r in (0, 1))
    # rank 1 built hidden width 8 where rank 0 has 7: its error names the tensor and both shapes
    assert re.search(r"'fc1\.(weight|bias)' is float32\[8(, 5)?\] on rank 1 but float32\[7(, 5)?\] on rank 0", e1), e1
    assert "another rank's model differs from rank 0's" in e0, e0


@needs_mpi
def test_save_writes_on_rank_0_and_every_rank_waits_for_it(tmp_path):
    p, _ = run_ranks("save", tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    m = models.MLP(dist_worker.D_IN, dist_worker.D_H, dist_worker.D_OUT)
    m.load(str(tmp_path / "model.safetensors"))
    r0 = np.load(tmp_path / "rank0.npz")
    for k, v in m.named_parameters():
        np.testing.assert_array_equal(v.numpy(), r0[k])


class OneRank:
    """A stand-in communicator of one rank that records the calls the step makes."""

    rank, size, local_rank, local_size = 0, 1, 0, 1

    def __init__(self):
        self.calls = []

    def allreduce_mean_(self, array):
        self.calls.append(("allreduce", array.size))

    def broadcast_(self, array, root=0):
        self.calls.append(("broadcast", array.size))

    def barrier(self):
        self.calls.append(("barrier",))


@pytest.fixture
def one_rank(monkeypatch):
    comm = OneRank()
    monkeypatch.setattr(dist, "_COMM", comm)
    return comm


def _train(distributed, steps=5, opt=None):
    rlx.seed(3)
    model = models.MLP(5, 7, 3)
    opt = opt or rlx.optim.AdamW(lr=0.05)
    step = rlx.compile_train_step(models.ce_loss, model, opt,
                                  {"x": rlx.InputSpec((8, 5)), "y": rlx.InputSpec((8,), "int32")},
                                  distributed=distributed)
    x, y = dist_worker.data(1)
    losses = [step(x=x, y=y) for _ in range(steps)]
    return model, step, losses


def test_phased_step_equals_the_one_call_step(one_rank):
    m1, s1, l1 = _train(False)
    m2, s2, l2 = _train(True)
    assert l1 == l2
    for (k, a), (_, b) in zip(m1.named_parameters(), m2.named_parameters()):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=k)
    n_params = len(list(m2.named_parameters()))
    assert one_rank.calls.count(("allreduce", one_rank.calls[-1][1])) == 5
    # at compile: the model check (rank 0's tensor list: its length, its bytes; then whether any
    # rank differs), then one broadcast per parameter
    assert [c[0] for c in one_rank.calls[:3 + n_params]] == ["broadcast", "broadcast", "allreduce"] + ["broadcast"] * n_params
    assert one_rank.calls[0] == ("broadcast", 1) and one_rank.calls[2] == ("allreduce", 1)


def test_the_gradient_region_is_every_gradient_in_one_range(one_rank):
    _, step, _ = _train(True, steps=1)
    var = step._last
    region = var.region
    grads = step.grads
    # Each gradient is a view into the region, in order, none overlapping.
    base = region.__array_interface__["data"][0]
    end = base + region.nbytes
    spans = []
    for name, g in grads.items():
        p = g.__array_interface__["data"][0]
        assert base <= p and p + g.nbytes <= end, name
        spans.append((p, p + g.nbytes))
    assert spans == sorted(spans) and all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    # The region holds the gradients' values (padding is zero).
    total = sum(np.abs(g).sum() for g in grads.values())
    np.testing.assert_allclose(np.abs(region).sum(), total, rtol=1e-6)


def test_phases_are_refused_on_a_step_that_is_not_data_parallel():
    _, step, _ = _train(False, steps=1)
    with pytest.raises(rlx.UnsupportedError, match="data-parallel"):
        step._last.exe.run({}, (0.1, 0, 0, 0.9, 0.999, 1e-8), [], "update")
    with pytest.raises(rlx.InputError, match="unknown phase"):
        step._last.exe.run({}, None, [], "backward")


def test_distributed_needs_init_and_a_bool():
    assert not dist.is_initialized()
    with pytest.raises(rlx.RlxError, match="init"):
        _train(True, steps=1)
    with pytest.raises(rlx.InputError, match="distributed must be True or False"):
        rlx.compile_train_step(models.ce_loss, models.MLP(5, 7, 3), rlx.optim.SGD(lr=0.1),
                               {"x": rlx.InputSpec((8, 5)), "y": rlx.InputSpec((8,), "int32")}, distributed="yes")
    if rlx._rlx.nccl_unavailable() is not None:
        # No GPU or no NCCL library here (CUDA machines run the NCCL group in test_cuda.py).
        with pytest.raises(rlx.UnsupportedError, match="the NCCL backend is not available here"):
            dist.init("nccl")
        assert not dist.is_initialized()
    with pytest.raises(rlx.InputError, match="unknown backend"):
        dist.init("gloo")
    assert (dist.rank(), dist.world_size(), dist.local_rank()) == (0, 1, 0)
