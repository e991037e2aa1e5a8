"""One rank of the data-parallel tests (tests/test_distributed.py runs it under mpirun).

usage: dist_worker.py SCENARIO OUT_DIR, with SCENARIO one of
  train-<optimizer>[-clip|-bf16|-fp16]
                             20 steps of the test MLP on this rank's share of a fixed batch (with
                             clipping, or in mixed precision); every rank writes its final
                             weights to OUT_DIR/rank<r>.npz
  raise                      rank 1 raises at its third step (the others must not hang)
  die                        rank 1 exits abruptly at its third step
  save                       rank 0 writes the model and optimizer; the others must see the files
  mismatch                   rank 1 builds a wider hidden layer: compiling must raise on every rank
"""

import os
import sys

import numpy as np

import rlx
import rlx.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402

B, D_IN, D_H, D_OUT, STEPS = 8, 5, 7, 3, 20


def optimizer(name):
    if name == "sgd":
        return rlx.optim.SGD(lr=0.1, momentum=0.9)
    return rlx.optim.AdamW(lr=0.05, weight_decay=0.1)


def data(world):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((B * world, D_IN)).astype(np.float32)
    y = rng.integers(0, D_OUT, B * world).astype(np.int32)
    return x, y


def main(scenario, out):
    dist.init()
    r, n = dist.rank(), dist.world_size()
    rlx.seed(100 + r)  # ranks start different: the broadcast at compile must make them equal
    kind, *rest = scenario.split("-")
    model = models.MLP(D_IN, D_H + (r if kind == "mismatch" else 0), D_OUT)
    opt = optimizer(rest[0] if rest else "adamw")
    clip = 1.0 if rest[1:] == ["clip"] else None
    precision = rest[1] if rest[1:] in (["bf16"], ["fp16"]) else "fp32"
    try:
        step = rlx.compile_train_step(models.ce_loss, model, opt,
                                      {"x": rlx.InputSpec((B, D_IN)), "y": rlx.InputSpec((B,), "int32")},
                                      clip_grad_norm=clip, distributed=True, precision=precision)
    except dist.DistributedError as e:
        if kind != "mismatch":
            raise
        with open(os.path.join(out, f"error{r}.txt"), "w") as f:
            f.write(str(e))
        return
    x, y = data(n)
    mine = slice(r * B, (r + 1) * B)
    for i in range(STEPS):
        if i == 2 and r == 1 and kind == "raise":
            raise ValueError("rank 1 fails on purpose")
        if i == 2 and r == 1 and kind == "die":
            os._exit(3)
        step(x=x[mine], y=y[mine])
    if kind == "save":
        model.save(os.path.join(out, "model.safetensors"))
        opt.save(os.path.join(out, "opt.safetensors"))
        # Every rank returns from save after the file exists.
        assert os.path.exists(os.path.join(out, "model.safetensors"))
        assert os.path.exists(os.path.join(out, "opt.safetensors"))
    np.savez(os.path.join(out, f"rank{r}.npz"), **{k: v.numpy() for k, v in model.named_parameters()})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
