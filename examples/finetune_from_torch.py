"""Fine-tune a PyTorch model with rlx, then hand it back to PyTorch.

1. The starting weights come from a PyTorch model (built here when torch is installed) or from a
   safetensors file (``--weights``, e.g. written by ``safetensors.torch.save_file``).
2. They load into the same-named rlx modules with ``load_state_dict`` (PyTorch's layout: no
   transposes), the first layer is frozen (``requires_grad = False``), and the rest is trained on
   scikit-learn's digits with AdamW (no weight decay on biases), gradient clipping and a cosine
   schedule.
3. The result is saved as safetensors and reloaded into PyTorch, whose predictions are checked
   against rlx's.

    pip install ".[examples]"            # + torch / safetensors if you have them
    python examples/finetune_from_torch.py [--weights start.safetensors] [--out tuned.safetensors]
"""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import rlx

try:
    import torch
except ImportError:  # the rlx side works without it
    torch = None


def rlx_model() -> rlx.nn.Module:
    # The same structure (and so the same parameter names) as the PyTorch model below.
    return rlx.nn.Sequential(rlx.nn.Linear(64, 128), rlx.nn.ReLU(), rlx.nn.Linear(128, 10))


def torch_model():
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def starting_weights(args) -> dict[str, np.ndarray] | str:
    if args.weights:
        return args.weights  # a safetensors file, loaded by Module.load
    if torch is not None:
        torch.manual_seed(0)
        print("starting from a PyTorch model's state_dict")
        return torch_model().state_dict()  # torch tensors go straight into load_state_dict
    path = os.path.join(tempfile.mkdtemp(), "start.safetensors")
    rlx.seed(0)
    rlx_model().save(path)  # stands in for a file exported from PyTorch
    print(f"torch is not installed: starting from the safetensors file {path}")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", default=None, help="starting weights (safetensors with PyTorch's names)")
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "finetuned.safetensors"))
    ap.add_argument("--epochs", type=int, default=8)
    args = ap.parse_args()

    d = load_digits()
    x, y = (d.data / 16.0).astype(np.float32), d.target.astype(np.int32)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)

    model = rlx_model()
    start = starting_weights(args)
    if isinstance(start, str):
        model.load(start)  # also reads float16 / bfloat16 files, casting to float32
    else:
        model.load_state_dict(start)
    print(model)

    model[0].weight.requires_grad = False  # keep the first layer as it came
    model[0].bias.requires_grad = False
    opt = rlx.optim.AdamW(lr=1e-2, weight_decay=0.05, groups=[{"params": ["*.bias"], "weight_decay": 0.0}])
    batch = 64
    steps_per_epoch = -(-len(xtr) // batch)
    sched = rlx.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * steps_per_epoch)

    def loss_fn(m, x, y):
        logits = m(x)
        return rlx.cross_entropy(logits, y), {"logits": logits}

    spec = {"x": rlx.InputSpec((None, 64)), "y": rlx.InputSpec((None,), "int32")}
    step = rlx.compile_train_step(loss_fn, model, opt, spec, clip_grad_norm=1.0)
    frozen = model[0].weight.numpy().copy()
    for epoch in range(args.epochs):
        perm = np.random.default_rng(epoch).permutation(len(xtr))
        correct = 0
        for i in range(0, len(xtr), batch):
            idx = perm[i : i + batch]
            loss, aux = step(x=xtr[idx], y=ytr[idx])
            correct += int((aux["logits"].argmax(1) == ytr[idx]).sum())  # accuracy from the same call
            sched.step()
        print(f"epoch {epoch + 1}: loss {loss:.4f}, train accuracy {correct / len(xtr):.3f}, "
              f"grad norm {step.grad_norm:.3f}, lr {opt.lr:.2e}")
    assert np.array_equal(model[0].weight.numpy(), frozen), "the frozen layer changed"

    predict = rlx.compile(lambda m, x: m(x), model, {"x": rlx.InputSpec((None, 64))})
    logits = predict(x=xte)
    print(f"test accuracy: {float((logits.argmax(1) == yte).mean()):.4f}")
    model.save(args.out)
    print(f"saved {args.out}")

    if torch is None:
        print("torch is not installed: skipping the reload in PyTorch")
        return
    try:
        from safetensors.torch import load_file
        state = load_file(args.out)
    except ImportError:  # no safetensors package: go through the state dict
        state = {k: torch.from_numpy(v) for k, v in model.state_dict().items()}
    back = torch_model()
    back.load_state_dict(state)
    with torch.no_grad():
        t_logits = back(torch.from_numpy(xte)).numpy()
    diff = float(np.abs(t_logits - logits).max())
    print(f"reloaded in PyTorch: max |logit difference| vs rlx = {diff:.2e}")
    assert diff < 1e-4


if __name__ == "__main__":
    main()
