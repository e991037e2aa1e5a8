"""DLPack export of gradients, optimizer state and resident inputs (``step.grad_tensor``,
``optimizer.state_tensors``, ``fn.view_tensor`` and the numpy views ``grads`` / ``state`` /
``view`` return on the CPU): PyTorch and numpy share rlx's memory (writes go both ways where the
contract says so), values against numpy, dtypes, shapes and strides, lifetimes, and bad requests
as ``BufferError`` naming the tensor. The GPU side of the same checks is in ``test_cuda.py``."""

import gc

import numpy as np
import pytest

import rlx

torch = pytest.importorskip("torch")

X = np.arange(12, dtype=np.float32).reshape(4, 3) / 10.0 - 0.5


def _linear_step(opt):
    """A Linear(3, 2) trained on mean((x W^T + b)^2), compiled with ``opt``."""
    rlx.seed(0)
    lin = rlx.nn.Linear(3, 2)
    step = rlx.compile_train_step(lambda m, x: (m(x) ** 2).mean(), lin, opt, {"x": rlx.InputSpec((4, 3))})
    return lin, step


def _np_grads(w, b, x):
    """d mean((x W^T + b)^2) / dW, / db in float64."""
    out = x.astype(np.float64) @ w.T.astype(np.float64) + b
    dout = 2.0 * out / out.size
    return dout.T @ x, dout.sum(0)


def test_gradients_export_dlpack_over_the_step_s_own_memory():
    lin, step = _linear_step(rlx.optim.SGD(lr=0.1))
    w0, b0 = np.array(lin.weight), np.array(lin.bias)
    step(x=X)
    gw, gb = _np_grads(w0, b0, X)
    g = step.grad_tensor("weight")
    assert isinstance(g, rlx.DeviceTensor)
    assert g.__dlpack_device__() == (1, 0) and g.shape == (2, 3) and g.dtype == "float32" and g.ndim == 2
    assert g.name == "weight (gradient)"
    t = torch.from_dlpack(g)
    assert t.dtype == torch.float32 and tuple(t.shape) == (2, 3) and t.stride() == (3, 1)
    np.testing.assert_allclose(t.numpy(), gw, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(torch.from_dlpack(step.grad_tensor("bias")).numpy(), gb, rtol=1e-5, atol=1e-6)
    # The same memory as the grads view, numpy's import of it and the DeviceTensor's numpy().
    n = np.from_dlpack(g)
    assert np.shares_memory(n, step.grads["weight"]) and np.shares_memory(n, g.numpy())
    assert t.data_ptr() == n.ctypes.data
    # The slot is stable between calls and holds the latest call's gradient.
    w1, b1 = np.array(lin.weight), np.array(lin.bias)
    step(x=2.0 * X)
    gw2, _ = _np_grads(w1, b1, 2.0 * X)
    np.testing.assert_allclose(t.numpy(), gw2, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(t.numpy(), step.grads["weight"])


def test_the_grads_view_itself_exports_dlpack_on_the_cpu():
    # step.grads on the CPU are numpy views of the arena: their own __dlpack__ shares it.
    lin, step = _linear_step(rlx.optim.SGD(lr=0.1))
    step(x=X)
    view = step.grads["weight"]
    t = torch.from_dlpack(view)
    assert t.data_ptr() == view.ctypes.data
    step(x=X + 1.0)
    np.testing.assert_array_equal(t.numpy(), step.grads["weight"])


def test_writes_through_a_gradient_reach_rlx_memory():
    lin, step = _linear_step(rlx.optim.SGD(lr=0.1))
    step(x=X)
    t = torch.from_dlpack(step.grad_tensor("weight"))
    t.fill_(3.0)
    np.testing.assert_array_equal(step.grads["weight"], np.full((2, 3), 3.0, np.float32))
    np.testing.assert_array_equal(step.grad_tensor("weight").numpy(), np.full((2, 3), 3.0, np.float32))


def test_optimizer_state_exports_dlpack_and_writes_reach_the_next_step():
    opt = rlx.optim.Adam(lr=1e-2)
    lin, step = _linear_step(opt)
    step(x=X)
    st = opt.state_tensors("weight")
    assert sorted(st) == ["exp_avg", "exp_avg_sq", "step"]
    m = torch.from_dlpack(st["exp_avg"])
    v = torch.from_dlpack(st["exp_avg_sq"])
    count = torch.from_dlpack(st["step"])
    assert count.dtype == torch.int32 and tuple(count.shape) == () and int(count) == 1
    assert m.dtype == torch.float32 and m.stride() == (3, 1)
    g1 = np.array(step.grads["weight"])
    np.testing.assert_allclose(m.numpy(), 0.1 * g1, rtol=1e-5, atol=1e-7)  # (1 - beta1) g on step 1
    np.testing.assert_allclose(v.numpy(), 0.001 * g1 * g1, rtol=1e-5, atol=1e-9)
    assert np.shares_memory(np.from_dlpack(st["exp_avg"]), opt.state("weight")["exp_avg"])
    # The state view of opt.state() exports the same memory too.
    assert torch.from_dlpack(opt.state("weight")["exp_avg"]).data_ptr() == m.data_ptr()
    # Zeroing the first moment through PyTorch: the next step starts it again from 0.
    m.zero_()
    step(x=X)
    g2 = np.array(step.grads["weight"])
    np.testing.assert_allclose(opt.state("weight")["exp_avg"], 0.1 * g2, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(m.numpy(), 0.1 * g2, rtol=1e-5, atol=1e-7)  # updated in place
    assert int(count) == 2


def test_resident_inputs_export_dlpack_and_writes_reach_the_next_call():
    fn = rlx.compile(lambda m, x, c: x + c * 2.0, rlx.nn.Module(),
                     {"x": rlx.InputSpec((2, 3)), "c": rlx.InputSpec((2, 3))})
    fn.bind("c", np.ones((2, 3), np.float32))
    c = fn.view_tensor("c")
    assert c.name == "c (input)" and c.__dlpack_device__() == (1, 0)
    t = torch.from_dlpack(c)
    np.testing.assert_array_equal(t.numpy(), np.ones((2, 3), np.float32))
    t[1] = 5.0
    np.testing.assert_array_equal(fn(x=np.zeros((2, 3), np.float32)), [[2.0] * 3, [10.0] * 3])
    # fn.view (a numpy view on the CPU) exports the same memory.
    view = fn.view("c")
    assert np.shares_memory(np.from_dlpack(view), np.from_dlpack(c))
    fn.write_rows("c", 0, np.full((1, 3), -1.0, np.float32))
    np.testing.assert_array_equal(t.numpy()[0], [-1.0] * 3)


def test_consumers_keep_the_memory_alive_after_rlx_objects_are_dropped():
    opt = rlx.optim.Adam(lr=1e-2)
    lin, step = _linear_step(opt)
    step(x=X)
    g = torch.from_dlpack(step.grad_tensor("weight"))
    m = torch.from_dlpack(opt.state_tensors("weight")["exp_avg"])
    kept = step.grad_tensor("bias")
    want_g, want_m = g.clone(), m.clone()
    del step, lin, opt
    gc.collect()
    filler = [np.full(4096, 9.0, np.float32) for _ in range(64)]  # reuse of freed memory would show
    assert torch.equal(g, want_g) and torch.equal(m, want_m)
    g.add_(1.0)  # still writable memory of its own
    assert torch.equal(g, want_g + 1.0)
    assert kept.numpy().shape == (2,) and np.isfinite(kept.numpy()).all()
    del filler


def test_copy_requests_on_host_memory():
    lin, step = _linear_step(rlx.optim.SGD(lr=0.1))
    step(x=X)
    g = step.grad_tensor("weight")
    c = np.from_dlpack(g, copy=True)
    assert not np.shares_memory(c, step.grads["weight"])
    np.testing.assert_array_equal(c, step.grads["weight"])
    assert np.shares_memory(np.from_dlpack(g, copy=False), step.grads["weight"])
    assert np.shares_memory(np.from_dlpack(g, device="cpu"), step.grads["weight"])  # dl_device=(1, 0)
    assert np.shares_memory(torch.from_dlpack(g.__dlpack__(max_version=(1, 0))).numpy(), step.grads["weight"])
    a = np.asarray(g)
    assert np.shares_memory(a, step.grads["weight"])
    assert not np.shares_memory(np.array(g, copy=True), a)


def test_bad_dlpack_requests_raise_buffer_error_naming_the_tensor():
    opt = rlx.optim.SGD(lr=0.1, momentum=0.9)
    lin, step = _linear_step(opt)
    step(x=X)
    g = step.grad_tensor("weight")
    with pytest.raises(BufferError, match=r"\[weight \(gradient\)\] the tensor is in host memory: stream must be None, got 1"):
        g.__dlpack__(stream=1)
    with pytest.raises(BufferError, match=r"\[weight \(gradient\)\] the tensor is on \(1, 0\), not \(2, 0\)"):
        g.__dlpack__(dl_device=(2, 0))
    with pytest.raises(BufferError, match=r"\[weight \(gradient\)\] dl_device must be a \(device type, ordinal\) pair"):
        g.__dlpack__(dl_device="cuda")
    with pytest.raises(BufferError, match=r"\[weight \(gradient\)\] max_version must be a \(major, minor\) tuple"):
        g.__dlpack__(max_version=1)
    with pytest.raises(BufferError, match=r"\[weight \(gradient\)\] copy must be None, True or False"):
        g.__dlpack__(copy="yes")
    s = opt.state_tensors("weight")["momentum_buffer"]
    with pytest.raises(BufferError, match=r"\[weight.momentum_buffer \(optimizer state\)\] .*stream must be None"):
        s.__dlpack__(stream=2)
    # Parameters follow the same rules.
    with pytest.raises(BufferError, match=r"\[weight\] the tensor is in host memory: stream must be None"):
        lin.weight.__dlpack__(stream=1)


def test_unknown_names_are_input_errors():
    opt = rlx.optim.Adam(lr=1e-2)
    with pytest.raises(rlx.RlxError, match=r"\[Adam\] has no state until a training step is compiled"):
        opt.state_tensors("weight")
    rlx.seed(0)
    lin = rlx.nn.Linear(3, 2)
    lin.bias.requires_grad = False
    step = rlx.compile_train_step(lambda m, x: (m(x) ** 2).mean(), lin, opt, {"x": rlx.InputSpec((4, 3))})
    with pytest.raises(rlx.InputError,
                       match=r"\['bias'\] has no gradient: it is not a trained parameter of this step \(trained: \['weight'\]\)"):
        step.grad_tensor("bias")
    with pytest.raises(rlx.InputError, match=r"\['nope'\] has no gradient"):
        step.grad_tensor("nope")
    with pytest.raises(rlx.InputError, match=r"\[Adam\] no parameter named 'nope'"):
        opt.state_tensors("nope")
    fn = rlx.compile(lambda m, x: x * 2.0, rlx.nn.Module(), {"x": rlx.InputSpec((2,))})
    with pytest.raises(rlx.InputError, match=r"\[y\] unknown input"):
        fn.view_tensor("y")
    dyn = rlx.compile(lambda m, x: x * 2.0, rlx.nn.Module(), {"x": rlx.InputSpec((None,))})
    with pytest.raises(rlx.UnsupportedError, match="need fixed shapes"):
        dyn.view_tensor("x")
    dstep = rlx.compile_train_step(lambda m, x: (m(x) ** 2).mean(), rlx.nn.Linear(3, 2), rlx.optim.SGD(lr=0.1),
                                   {"x": rlx.InputSpec((None, 3))})
    with pytest.raises(rlx.RlxError, match="nothing compiled yet"):
        dstep.grad_tensor("weight")


def test_bfloat16_inputs_in_host_memory_refuse_dlpack_by_name():
    fn = rlx.compile(lambda m, x: x.astype("float32") * 2.0, rlx.nn.Module(), {"x": rlx.InputSpec((2,), "bfloat16")})
    fn.bind("x", np.ones(2, np.float32).astype(fn.view("x").dtype))
    v = fn.view_tensor("x")
    assert v.dtype == "bfloat16" and v.numpy().dtype == fn.view("x").dtype
    with pytest.raises(BufferError, match=r"\[x \(input\)\] a bfloat16 tensor in host memory has no DLPack export"):
        v.__dlpack__()
