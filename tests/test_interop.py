"""PyTorch-style module API: state dicts, the (out, in) Linear layout and old-layout refusal,
ModuleList/ModuleDict, buffers, train/eval, requires_grad, repr, np.asarray, copies and pickles,
and the footguns that now raise (plain lists of modules, models changed after compile,
numpy() arrays taken before compile)."""

import copy
import pickle
import threading

import numpy as np
import pytest

import rlx
from rlx import _rlx


class MLP(rlx.nn.Module):
    def __init__(self, d_in=4, d_h=6, d_out=3):
        self.fc1 = rlx.nn.Linear(d_in, d_h)
        self.fc2 = rlx.nn.Linear(d_h, d_out)

    def __call__(self, x):
        return self.fc2(rlx.relu(self.fc1(x)))


def np_mlp(sd, x):
    h = np.maximum(x.astype(np.float64) @ sd["fc1.weight"].T + sd["fc1.bias"], 0)
    return h @ sd["fc2.weight"].T + sd["fc2.bias"]


X = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
SPEC = {"x": rlx.InputSpec((5, 4))}


def test_linear_has_pytorch_layout():
    lin = rlx.nn.Linear(4, 3)
    assert lin.weight.shape == (3, 4)
    fn = rlx.compile(lambda m, x: m(x), lin, SPEC)
    sd = lin.state_dict()
    np.testing.assert_allclose(fn(x=X), X @ sd["weight"].T + sd["bias"], rtol=1e-5, atol=1e-6)


def test_state_dict_round_trip_and_copies():
    rlx.seed(0)
    a, b = MLP(), MLP()
    sd = a.state_dict()
    assert list(sd) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    sd["fc1.bias"][:] = 7.0  # a copy: the model is untouched
    assert not np.any(a.fc1.bias.numpy() == 7.0)
    result = b.load_state_dict(a.state_dict())
    assert result == ([], []) and result.missing_keys == [] and result.unexpected_keys == []
    for k, v in a.state_dict().items():
        np.testing.assert_array_equal(b.state_dict()[k], v)


class ArrayLike:
    def __init__(self, a):
        self.a = a

    def __array__(self, dtype=None, copy=None):
        return self.a


class DLPackOnly:
    def __init__(self, a):
        self.a = a

    def __dlpack__(self, **kw):
        return self.a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


def test_load_state_dict_casts_and_accepts_array_protocols():
    m = rlx.nn.Linear(2, 2)
    w = np.array([[1, 2], [3, 4]], np.int64)  # cast like copy_
    m.load_state_dict({"weight": ArrayLike(w), "bias": DLPackOnly(np.array([0.5, 1.5], np.float64))})
    np.testing.assert_array_equal(m.weight.numpy(), w.astype(np.float32))
    np.testing.assert_array_equal(m.bias.numpy(), [0.5, 1.5])
    m.load_state_dict({"weight": np.eye(2, dtype=np.float16), "bias": [True, False]})
    np.testing.assert_array_equal(m.bias.numpy(), [1.0, 0.0])


def test_load_state_dict_strict_and_non_strict():
    m = MLP()
    before = m.state_dict()
    partial = {"fc1.weight": np.ones((6, 4), np.float32), "extra.weight": np.zeros(3, np.float32)}
    with pytest.raises(rlx.CheckpointError, match=r"missing \['fc1.bias'.*unexpected \['extra.weight'\]"):
        m.load_state_dict(partial)
    for k, v in before.items():
        np.testing.assert_array_equal(m.state_dict()[k], v)  # nothing changed
    missing, unexpected = m.load_state_dict(partial, strict=False)
    assert missing == ["fc1.bias", "fc2.weight", "fc2.bias"] and unexpected == ["extra.weight"]
    np.testing.assert_array_equal(m.fc1.weight.numpy(), np.ones((6, 4)))
    with pytest.raises(rlx.CheckpointError, match=r"'fc2.bias' has shape \(4,\) but the model's is \(3,\)"):
        m.load_state_dict({"fc2.bias": np.zeros(4, np.float32)}, strict=False)
    with pytest.raises(rlx.CheckpointError, match="complex"):
        m.load_state_dict({"fc2.bias": np.zeros(3, np.complex64)}, strict=False)


def test_old_in_out_layout_is_refused_and_convertible(tmp_path):
    rlx.seed(1)
    m = MLP()
    sd = m.state_dict()
    old = tmp_path / "old.safetensors"
    # A file as rlx wrote it before: Linear weights (in, out), no layout metadata.
    _rlx.save_checkpoint(str(old), [(k, "float32", list(v.T.shape if k.endswith("weight") else v.shape),
                                     np.ascontiguousarray(v.T if k.endswith("weight") else v).reshape(-1))
                                    for k, v in sd.items()])
    other = MLP()
    with pytest.raises(rlx.CheckpointError, match=r"older rlx \(in_features, out_features\) Linear layout"):
        other.load(str(old))
    # An in-memory dict is not an old file: a transposed array is a plain shape mismatch.
    with pytest.raises(rlx.CheckpointError, match=r"has shape \(\d+, \d+\) but the model's is .*out_features, in_features"):
        other.load_state_dict({k: (v.T if k.endswith("weight") else v) for k, v in sd.items()})
    other.load(str(old), legacy_layout=True)
    for k, v in sd.items():
        np.testing.assert_array_equal(other.state_dict()[k], v)
    new = tmp_path / "new.safetensors"
    other.save(str(new))
    _, meta = _rlx.load_checkpoint_raw(str(new))
    assert meta["rlx.layout"] == "out_in"
    third = MLP()
    third.load(str(new))
    # legacy_layout=True on a file in today's layout is refused (a square weight would transpose
    # silently), and nothing changes.
    sq = rlx.nn.Sequential(rlx.nn.Linear(4, 4), rlx.nn.Linear(4, 4))
    sq.save(str(tmp_path / "sq.safetensors"))
    sq2 = rlx.nn.Sequential(rlx.nn.Linear(4, 4), rlx.nn.Linear(4, 4))
    before = sq2.state_dict()
    with pytest.raises(rlx.CheckpointError, match="legacy_layout=True is for files saved by rlx before 0.2"):
        sq2.load(str(tmp_path / "sq.safetensors"), legacy_layout=True)
    for k, v in sq2.state_dict().items():
        np.testing.assert_array_equal(v, before[k])
    np.testing.assert_array_equal(third.fc1.weight.numpy(), sd["fc1.weight"])


@pytest.mark.parametrize("dtype", ["float16", "float64", "bfloat16"])
def test_half_and_double_files_load_by_casting(tmp_path, dtype):
    m = rlx.nn.Linear(3, 2)
    w = np.array([[0.5, -1.25, 2.0], [3.0, 0.125, -4.0]], np.float32)
    b = np.array([1.5, -0.75], np.float32)
    path = tmp_path / "h.safetensors"
    if dtype == "bfloat16":
        raw = lambda a: (a.view(np.uint32) >> 16).astype("<u2")  # noqa: E731  (exact in bf16)
    else:
        raw = lambda a: a.astype(dtype)  # noqa: E731
    header = {"weight": {"dtype": {"float16": "F16", "float64": "F64", "bfloat16": "BF16"}[dtype], "shape": [2, 3]},
              "bias": {"dtype": {"float16": "F16", "float64": "F64", "bfloat16": "BF16"}[dtype], "shape": [2]}}
    wb, bb = raw(w).tobytes(), raw(b).tobytes()
    header["weight"]["data_offsets"] = [0, len(wb)]
    header["bias"]["data_offsets"] = [len(wb), len(wb) + len(bb)]
    import json
    import struct
    hj = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(hj)) + hj + wb + bb)
    m.load(str(path))
    np.testing.assert_array_equal(m.weight.numpy(), w)
    np.testing.assert_array_equal(m.bias.numpy(), b)


def test_np_asarray_and_repr():
    lin = rlx.nn.Linear(3, 2)
    a = np.asarray(lin.weight)
    assert a.shape == (2, 3) and a.dtype == np.float32
    np.testing.assert_array_equal(a, lin.weight.numpy())
    assert np.asarray(lin.weight, dtype=np.float64).dtype == np.float64
    m = MLP()
    m.scale = rlx.nn.Parameter(np.ones(3))
    text = repr(m)
    assert text.splitlines()[0] == "MLP("
    assert "(fc1): Linear(in_features=4, out_features=6, bias=True)" in text
    assert "(scale): Parameter(shape=(3,), dtype=float32)" in text
    assert repr(rlx.nn.Sequential(rlx.nn.Linear(2, 2), rlx.nn.ReLU())).count("\n") == 3


def test_plain_list_or_dict_of_modules_raises():
    m = rlx.nn.Module()
    with pytest.raises(rlx.RlxError, match="ModuleList"):
        m.layers = [rlx.nn.Linear(2, 2), rlx.nn.Linear(2, 2)]
    with pytest.raises(rlx.RlxError, match="ModuleDict"):
        m.heads = {"a": rlx.nn.Linear(2, 2)}
    with pytest.raises(rlx.RlxError, match="ModuleList"):
        m.ps = (rlx.nn.Parameter(np.ones(2)),)
    m.sizes = [1, 2, 3]  # plain data is fine
    assert m.sizes == [1, 2, 3]


def test_module_list_and_dict_register_and_train():
    class Net(rlx.nn.Module):
        def __init__(self):
            self.layers = rlx.nn.ModuleList([rlx.nn.Linear(4, 4) for _ in range(2)])
            self.heads = rlx.nn.ModuleDict({"out": rlx.nn.Linear(4, 2)})

        def __call__(self, x):
            for layer in self.layers:
                x = rlx.relu(layer(x))
            return self.heads["out"](x)

    net = Net()
    assert list(net.parameters()) == ["layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias",
                                      "heads.out.weight", "heads.out.bias"]
    assert len(net.layers) == 2 and "out" in net.heads and list(net.heads) == ["out"]
    before = net.state_dict()
    step = rlx.compile_train_step(lambda m, x: (m(x) ** 2).mean(), net, rlx.optim.SGD(lr=0.1), SPEC)
    step(x=X)
    after = net.state_dict()
    assert all(not np.array_equal(before[k], after[k]) for k in before if "weight" in k)


def test_requires_grad_false_freezes():
    rlx.seed(2)
    m = MLP()
    m.fc1.weight.requires_grad = False
    frozen = m.fc1.weight.numpy().copy()
    opt = rlx.optim.AdamW(lr=0.1, weight_decay=0.5)
    step = rlx.compile_train_step(lambda m, x: (m(x) ** 2).mean(), m, opt, SPEC)
    for _ in range(3):
        step(x=X)
    np.testing.assert_array_equal(m.fc1.weight.numpy(), frozen)
    assert "fc1.weight" not in step.grads and "fc1.bias" in step.grads
    assert int(opt.state("fc1.weight")["step"]) == 0 and int(opt.state("fc1.bias")["step"]) == 3
    with pytest.raises(rlx.RlxError, match="model changed since compile"):
        m.fc1.weight.requires_grad = True
        step(x=X)


def test_train_eval_modes_and_what_compile_records():
    m = MLP()
    assert m.training and m.fc1.training
    assert m.eval() is m and not m.training and not m.fc2.training
    m.train()
    seen = []

    def f(mod, x):
        seen.append(mod.training)
        return mod(x)

    rlx.compile(f, m, SPEC)
    rlx.compile_train_step(lambda mod, x: (f(mod, x) ** 2).mean(), m, rlx.optim.SGD(lr=0.1), SPEC)
    rlx.compile(f, m, SPEC, training=True)
    assert seen == [False, True, True] and m.training  # the mode is restored after tracing


def test_buffers_are_saved_not_trained(tmp_path):
    m = MLP()
    m.register_buffer("count", np.array([3.0], np.float32))
    assert list(m.buffers()) == ["count"] and "count" not in m.parameters()
    assert "count" in m.state_dict()
    step = rlx.compile_train_step(lambda mod, x: (mod(x) ** 2).mean() + (mod.count * 0.0).sum(), m,
                                  rlx.optim.SGD(lr=0.1, weight_decay=0.1), SPEC)
    step(x=X)
    np.testing.assert_array_equal(m.count.numpy(), [3.0])
    m.save(str(tmp_path / "b.safetensors"))
    m2 = MLP()
    m2.register_buffer("count", np.zeros(1, np.float32))
    m2.load(str(tmp_path / "b.safetensors"))
    np.testing.assert_array_equal(m2.count.numpy(), [3.0])
    with pytest.raises(rlx.RlxError):
        m.count.requires_grad = True


@pytest.mark.parametrize("change", ["add-parameter", "replace-parameter", "add-module", "replace-module", "delete"])
def test_model_changed_after_compile_raises(change):
    m = MLP()
    fn = rlx.compile(lambda mod, x: mod(x), m, SPEC)
    step = rlx.compile_train_step(lambda mod, x: (mod(x) ** 2).mean(), m, rlx.optim.SGD(lr=0.1), SPEC)
    fn(x=X)
    step(x=X)
    if change == "add-parameter":
        m.extra = rlx.nn.Parameter(np.ones(2))
    elif change == "replace-parameter":
        m.fc1.bias = rlx.nn.Parameter(np.zeros(6))
    elif change == "add-module":
        m.fc3 = rlx.nn.Linear(2, 2)
    elif change == "replace-module":
        m.fc2 = rlx.nn.Linear(6, 3)
    else:
        del m.fc2
    for f in (lambda: fn(x=X), lambda: step(x=X), lambda: step.prefetch(x=X)):
        with pytest.raises(rlx.RlxError, match=r"model changed since compile; compile again"):
            f()
    if change != "delete":
        fresh = rlx.compile(lambda mod, x: mod(x), m, SPEC)  # compiling again works
        fresh(x=X)


def test_unrelated_attribute_changes_do_not_invalidate():
    m = MLP()
    fn = rlx.compile(lambda mod, x: mod(x), m, SPEC)
    m.note = "hello"
    other = MLP()
    other.fc1 = rlx.nn.Linear(4, 6)  # another model's structure change
    fn(x=X)


def test_numpy_before_compile_is_not_silently_detached():
    m = MLP()
    w = m.fc1.weight.numpy()  # the host array, before compile
    with pytest.raises(rlx.RlxError, match=r"'fc1.weight'.numpy\(\) \(or a DLPack export of it\) was taken before compiling"):
        rlx.compile(lambda mod, x: mod(x), m, SPEC)
    kept = np.array(w)
    del w
    fn = rlx.compile(lambda mod, x: mod(x), m, SPEC)
    view = m.fc1.weight.numpy()
    np.testing.assert_array_equal(view, kept)
    view[...] = 0.0  # after compile: a live view
    np.testing.assert_allclose(fn(x=X), np_mlp(m.state_dict(), X), rtol=1e-5, atol=1e-6)
    # np.asarray before compile is a copy and never blocks compiling
    m2 = MLP()
    a = np.asarray(m2.fc1.weight)
    rlx.compile(lambda mod, x: mod(x), m2, SPEC)
    assert a.shape == (6, 4)


def test_two_threads_compiling_one_fresh_model_share_one_store():
    for _ in range(5):
        m = MLP()
        fns, errors = [None, None], []
        barrier = threading.Barrier(2)

        def work(i):
            try:
                barrier.wait()
                fns[i] = rlx.compile(lambda mod, x: mod(x), m, SPEC)
            except Exception as e:  # pragma: no cover - reported below
                errors.append(e)

        ts = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        [t.start() for t in ts]
        [t.join(30) for t in ts]
        assert not errors
        m.fc1.weight.numpy()[...] = 0.5  # both functions must see this write
        out0, out1 = fns[0](x=X), fns[1](x=X)
        np.testing.assert_array_equal(out0, out1)
        np.testing.assert_allclose(out0, np_mlp(m.state_dict(), X), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copy_of_compiled_model_is_uncompiled_with_current_values(how):
    rlx.seed(3)
    m = MLP()
    step = rlx.compile_train_step(lambda mod, x: (mod(x) ** 2).mean(), m, rlx.optim.SGD(lr=0.1), SPEC)
    step(x=X)
    c = copy.deepcopy(m) if how == "deepcopy" else pickle.loads(pickle.dumps(m))
    for k, v in m.state_dict().items():
        np.testing.assert_array_equal(c.state_dict()[k], v)
    assert c.fc1.weight._store is None  # uncompiled
    step(x=X)  # training the original leaves the copy alone
    assert not np.array_equal(c.fc1.weight.numpy(), m.fc1.weight.numpy())
    fn = rlx.compile(lambda mod, x: mod(x), c, SPEC)
    np.testing.assert_allclose(fn(x=X), np_mlp(c.state_dict(), X), rtol=1e-5, atol=1e-5)


class RunningMean(rlx.nn.Module):
    """A layer that keeps running statistics in a buffer, updated inside the step in train mode."""

    def __init__(self, n):
        self.fc = rlx.nn.Linear(n, n)
        self.register_buffer("running_mean", np.zeros(n, np.float32))

    def __call__(self, x):
        y = self.fc(x)
        if self.training:
            self.running_mean.update(0.9 * self.running_mean + 0.1 * y.mean(axis=0))
        return y - self.running_mean


def test_buffer_updates_happen_inside_the_step():
    rlx.seed(4)
    m = RunningMean(4)
    step = rlx.compile_train_step(lambda mod, x: (mod(x) ** 2).mean(), m, rlx.optim.SGD(lr=0.0), SPEC,
                                  skip_nonfinite=True)
    fn = rlx.compile(lambda mod, x: mod(x), m, SPEC)  # eval mode: reads, never updates
    sd = m.state_dict()
    want = np.zeros(4)
    for _ in range(3):
        step(x=X)
        want = 0.9 * want + 0.1 * (X.astype(np.float64) @ sd["fc.weight"].T + sd["fc.bias"]).mean(0)
        np.testing.assert_allclose(m.running_mean.numpy(), want, rtol=1e-5, atol=1e-6)
    out = fn(x=X)
    np.testing.assert_allclose(out, X @ sd["fc.weight"].T + sd["fc.bias"] - want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(m.running_mean.numpy(), want, rtol=1e-5, atol=1e-6)  # unchanged by fn
    bad = X.copy()
    bad[0, 0] = np.nan
    step(x=bad)  # skipped: the buffer keeps its value
    np.testing.assert_allclose(m.running_mean.numpy(), want, rtol=1e-5, atol=1e-6)
    assert "running_mean" in step.graph()
    with pytest.raises(rlx.RlxError, match="only inside a traced function"):
        m.running_mean.update(np.zeros(4))


def test_parameters_export_dlpack_without_a_copy():
    # Before compile (host values) and after (a view of the weight store): from_dlpack shares
    # the memory on the CPU, so writes through the consumer reach the model.
    lin = rlx.nn.Linear(3, 2)
    assert lin.weight.__dlpack_device__() == (1, 0)
    np.testing.assert_array_equal(np.from_dlpack(lin.weight), lin.weight.numpy())
    step = rlx.compile_train_step(
        lambda m, x: (m(x) ** 2).mean(), lin, rlx.optim.SGD(lr=0.1), {"x": rlx.InputSpec((4, 3))}
    )
    step(x=np.ones((4, 3), np.float32))
    w = np.from_dlpack(lin.weight)
    assert np.shares_memory(w, lin.weight.numpy())
    w[0, 0] = 7.0
    assert lin.weight.numpy()[0, 0] == 7.0
    torch = pytest.importorskip("torch")
    t = torch.from_dlpack(lin.weight)
    t[1, 2] = -3.0
    assert lin.weight.numpy()[1, 2] == -3.0
    assert t.device.type == "cpu" and tuple(t.shape) == (2, 3)


def test_bfloat16_parameters_in_host_memory_refuse_dlpack_by_name():
    lin = rlx.nn.Linear(2, 2).to("bfloat16")
    with pytest.raises(BufferError, match=r"bfloat16 parameter in host memory has no DLPack export"):
        lin.weight.__dlpack__()
