"""Facts the native module owns and the Python layer re-exports: the exception classes (defined in
rlx._rlx, importable as rlx.errors.*) and the optimizer state slot names (OptimRule::slots)."""

import pickle

import numpy as np
import pytest

import rlx
from rlx import _rlx

BASES = {
    "ShapeError": ValueError,
    "DTypeError": TypeError,
    "InputError": ValueError,
    "DeviceError": RuntimeError,
    "UnsupportedError": NotImplementedError,
    "CheckpointError": Exception,
}


@pytest.mark.parametrize("name", sorted(BASES))
def test_exception_classes_are_the_native_ones(name):
    cls = getattr(rlx.errors, name)
    assert cls is getattr(_rlx, name) is getattr(rlx, name)
    assert issubclass(cls, rlx.RlxError) and issubclass(cls, BASES[name])
    assert cls.__module__ == "rlx.errors" and cls.__doc__
    e = pickle.loads(pickle.dumps(cls("[op] message")))
    assert type(e) is cls and str(e) == "[op] message"


def test_native_errors_raise_the_native_classes():
    with pytest.raises(rlx.DeviceError, match="unknown device 'tpu'") as info:
        _rlx.check_device("tpu")
    assert isinstance(info.value, RuntimeError)
    with pytest.raises(rlx.UnsupportedError, match="unknown update rule 'lamb'"):
        _rlx.optimizer_slots("lamb")


# SGD keeps its momentum buffer even without momentum, so momentum may be switched on later.
@pytest.mark.parametrize("rule,slots", [("sgd", ["momentum_buffer"]), ("sgd_momentum", ["momentum_buffer"]),
                                        ("adam", ["exp_avg", "exp_avg_sq"]), ("adamw", ["exp_avg", "exp_avg_sq"]),
                                        ("rmsprop", ["square_avg", "momentum_buffer"]), ("adagrad", ["sum"])])
def test_optimizer_slot_names_come_from_the_native_rule(rule, slots):
    assert _rlx.optimizer_slots(rule) == slots


@pytest.mark.parametrize("opt", [rlx.optim.SGD(lr=0.1, momentum=0.9), rlx.optim.Adam(lr=0.01), rlx.optim.SGD(lr=0.1)])
def test_optimizer_state_has_exactly_the_native_slots(opt):
    class Net(rlx.nn.Module):
        def __init__(self):
            self.fc = rlx.nn.Linear(3, 2)

        def __call__(self, x):
            return self.fc(x)

    rlx.seed(0)
    model = Net()
    step = rlx.compile_train_step(lambda m, x: (m(x) ** 2).mean(), model, opt, {"x": rlx.InputSpec((4, 3))})
    step(x=np.ones((4, 3), np.float32))
    state = opt.state("fc.weight")
    slots = _rlx.optimizer_slots(opt._rule)
    assert set(slots) <= set(state)
    assert set(state) - set(slots) <= {"step", "started"}  # the per-parameter counters
    for s in slots:
        assert state[s].shape == model.fc.weight.shape
