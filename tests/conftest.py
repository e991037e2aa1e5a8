"""Shared helpers for the rlx test suite: numpy comparisons, float64 finite differences, tiny modules.

The helpers are plain functions so test files can import them (``from conftest import ...``).
Set ``RLX_TEST_DEVICE`` (or ``RLX_DEVICE``; default ``"cpu"``) to run the device-neutral op tests
on another backend.
"""

import os
import sys

import numpy as np

import rlx

# Make `from conftest import ...` work whatever pytest import mode is configured.
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

DEVICE = os.environ.get("RLX_TEST_DEVICE") or os.environ.get("RLX_DEVICE") or "cpu"


# ----------------------------------------------------------------------------------------------
# comparisons
# ----------------------------------------------------------------------------------------------
def assert_close(actual, expected, rtol=1e-3, atol=1e-4, err_msg=""):
    """Compare a float32 result against a (float64) reference.

    ``atol`` is scaled by the reference's largest magnitude (when that is above 1) so that big
    values get a tolerance proportional to float32 rounding.
    """
    a = np.asarray(actual)
    e = np.asarray(expected, dtype=np.float64)
    assert a.shape == e.shape, f"shape {a.shape} != expected {e.shape}. {err_msg}"
    assert np.all(np.isfinite(a)), f"non-finite values in result. {err_msg}"
    scale = float(np.max(np.abs(e))) if e.size else 0.0
    np.testing.assert_allclose(
        a.astype(np.float64), e, rtol=rtol, atol=atol * max(1.0, scale), err_msg=err_msg
    )


def numeric_grad(f, x, eps=1e-6):
    """Central finite-difference gradient of scalar ``f`` at ``x``, computed in float64."""
    x = np.array(x, dtype=np.float64, copy=True)
    g = np.zeros_like(x)
    flat = x.reshape(-1)
    gflat = g.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + eps
        fp = float(f(x))
        flat[i] = old - eps
        fm = float(f(x))
        flat[i] = old
        gflat[i] = (fp - fm) / (2.0 * eps)
    return g


# ----------------------------------------------------------------------------------------------
# modules
# ----------------------------------------------------------------------------------------------
class Empty(rlx.nn.Module):
    """A model without parameters: compiled functions are pure functions of their inputs."""


class ParamHolder(rlx.nn.Module):
    """A module whose parameters are given numpy arrays, named by the keyword used."""

    def __init__(self, **params):
        super().__init__()
        for name, value in params.items():
            setattr(self, name, rlx.nn.Parameter(np.asarray(value, dtype=np.float32)))


def make_module(**params):
    """Build a module holding ``rlx.nn.Parameter``s named after the keywords (in that order)."""
    return ParamHolder(**params)


def rlx_dtype(a):
    """The InputSpec dtype string for a numpy array."""
    a = np.asarray(a)
    if np.issubdtype(a.dtype, np.integer):
        return "int32"
    return "float32"


def specs(arrays):
    """InputSpecs matching a dict of numpy arrays."""
    return {k: rlx.InputSpec(tuple(np.shape(v)), dtype=rlx_dtype(v)) for k, v in arrays.items()}


def run_forward(fn, arrays, device=None):
    """Compile ``fn(**tensors)`` on a parameter-free model and run it once on ``arrays``."""
    compiled = rlx.compile(
        lambda _model, **t: fn(**t), Empty(), specs(arrays), device=device or DEVICE
    )
    return compiled(**arrays)


def run_grads(loss_fn, params, arrays=None, device=None):
    """One train step with ``SGD(lr=0)``: returns (loss, {name: grad copy}).

    ``loss_fn(model, **tensors)``; ``params`` maps parameter names to numpy arrays.
    """
    arrays = arrays or {}
    model = make_module(**params)
    step = rlx.compile_train_step(
        loss_fn, model, rlx.optim.SGD(lr=0.0), specs(arrays), device=device or DEVICE
    )
    loss = step(**arrays)
    grads = {k: np.array(v, copy=True) for k, v in step.grads.items()}
    return loss, grads


def check_op_grads(rlx_op, np_op, params, seed=0, rtol=1e-3, atol=1e-4, arrays=None):
    """Gradient of ``sum(op(*params) * W)`` (W a fixed random constant) against finite differences.

    ``rlx_op(*tensors, **inputs)`` / ``np_op(*arrays, **inputs)`` take the parameters positionally
    in the order of the ``params`` dict; ``arrays`` are extra (non-differentiated) inputs.
    """
    arrays = arrays or {}
    names = list(params)
    p32 = {k: np.asarray(v, dtype=np.float32) for k, v in params.items()}
    p64 = {k: v.astype(np.float64) for k, v in p32.items()}
    a64 = {k: (v.astype(np.float64) if rlx_dtype(v) == "float32" else v) for k, v in arrays.items()}
    out = np.asarray(np_op(*p64.values(), **a64), dtype=np.float64)
    rng = np.random.default_rng(seed + 1000)
    W = rng.standard_normal(out.shape).astype(np.float32)
    scalar_out = out.ndim == 0
    w_scalar = float(W) if scalar_out else None

    def loss_fn(m, **t):
        # `* 1.0` turns each Parameter into a plain traced Tensor, so these op tests do not depend
        # on Parameter exposing every Tensor method (test_module checks that separately)
        y = rlx_op(*[getattr(m, k) * 1.0 for k in names], **t)
        if scalar_out:
            return y * w_scalar
        return (y * W).sum()

    loss, grads = run_grads(loss_fn, p32, arrays)
    assert isinstance(loss, float), f"step() should return a Python float, got {type(loss)}"
    W64 = W.astype(np.float64)

    def ref_loss(vals):
        return float(np.sum(np.asarray(np_op(*vals, **a64), dtype=np.float64) * W64))

    assert_close(loss, ref_loss(list(p64.values())), rtol=rtol, atol=atol, err_msg="loss")
    assert set(names) <= set(grads), f"missing grads: {set(names) - set(grads)}"
    for k in names:

        def f(v, k=k):
            return ref_loss([v if n == k else p64[n] for n in names])

        expected = numeric_grad(f, p64[k])
        assert_close(grads[k], expected, rtol=rtol, atol=atol, err_msg=f"grad of {k}")
    return grads
