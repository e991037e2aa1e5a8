"""Checkpoints: safetensors save/load round trips, strict validation that changes nothing on
failure, corrupted files, atomic writes. The file format is checked with an independent reader."""

import json
import os
import pathlib
import struct

import numpy as np
import pytest

import models
import rlx
from conftest import assert_close

B, D_IN, D_H, D_OUT = 4, 4, 5, 3


def MLP(d_h=D_H):
    return models.MLP(D_IN, d_h, D_OUT)


loss_fn = models.mse_loss


TRAIN_INPUTS = {"x": rlx.InputSpec((B, D_IN)), "y": rlx.InputSpec((B, D_OUT))}
FWD_INPUTS = {"x": rlx.InputSpec((B, D_IN))}
NAMES = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


def data(seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, D_IN)).astype(np.float32),
            rng.standard_normal((B, D_OUT)).astype(np.float32))


def model_with_seed(seed, **kw):
    rlx.seed(seed)
    return MLP(**kw)


def values(model):
    return {k: p.numpy().copy() for k, p in model.parameters().items()}


def np_forward(p, x):
    h = np.maximum(x.astype(np.float64) @ p["fc1.weight"].T + p["fc1.bias"], 0.0)
    return h @ p["fc2.weight"].T + p["fc2.bias"]


def np_loss(p, x, y):
    return float(np.mean((np_forward(p, x) - y.astype(np.float64)) ** 2))


# ----------------------------------------------------------------------------------------------
# an independent safetensors reader / writer
# ----------------------------------------------------------------------------------------------
_DT = {"F32": "<f4", "F64": "<f8", "F16": "<f2", "I32": "<i4", "I64": "<i8"}


def read_safetensors(path):
    raw = pathlib.Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n].decode("utf-8"))
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        arr = np.frombuffer(raw[base + a:base + b], dtype=_DT[info["dtype"]])
        out[name] = (info["dtype"], arr.reshape(info["shape"]))
    return out


def write_safetensors(path, tensors):
    """tensors: dict name -> ndarray (written in the given order, little endian)."""
    code = {np.dtype("float32"): "F32", np.dtype("float64"): "F64", np.dtype("float16"): "F16",
            np.dtype("int32"): "I32", np.dtype("int64"): "I64"}
    header, blobs, off = {}, [], 0
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        blob = arr.astype(arr.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": code[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [off, off + len(blob)]}
        blobs.append(blob)
        off += len(blob)
    h = json.dumps(header).encode("utf-8")
    h += b" " * (-len(h) % 8)
    pathlib.Path(path).write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


# ----------------------------------------------------------------------------------------------
# round trips
# ----------------------------------------------------------------------------------------------
def test_save_writes_a_real_safetensors_file(tmp_path):
    model = model_with_seed(0)
    path = tmp_path / "m.safetensors"
    model.save(str(path))
    got = read_safetensors(path)
    assert set(got) == set(NAMES)
    for k, v in values(model).items():
        dtype, arr = got[k]
        assert dtype == "F32"
        assert arr.shape == v.shape  # (in, out) layout for Linear weights
        np.testing.assert_array_equal(arr, v)


def test_save_after_training_writes_current_weights(tmp_path):
    model = model_with_seed(1)
    step = rlx.compile_train_step(loss_fn, model, rlx.optim.Adam(lr=0.05), TRAIN_INPUTS)
    init = values(model)
    x, y = data(1)
    for _ in range(3):
        step(x=x, y=y)
    trained = values(model)
    assert not np.array_equal(trained["fc1.weight"], init["fc1.weight"])
    path = tmp_path / "trained.safetensors"
    model.save(str(path))
    got = read_safetensors(path)
    for k in NAMES:
        np.testing.assert_array_equal(got[k][1], trained[k])


def test_load_before_compile(tmp_path):
    a, b = model_with_seed(2), model_with_seed(3)
    va = values(a)
    assert not np.array_equal(va["fc1.weight"], values(b)["fc1.weight"])
    path = str(tmp_path / "a.safetensors")
    a.save(path)
    b.load(path)
    for k, v in values(b).items():
        np.testing.assert_array_equal(v, va[k])
    fn = rlx.compile(lambda m, x: m(x), b, FWD_INPUTS)
    x, y = data(2)
    assert_close(fn(x=x), np_forward(va, x), rtol=1e-5, atol=1e-6)
    step = rlx.compile_train_step(loss_fn, b, rlx.optim.SGD(lr=0.0), TRAIN_INPUTS)
    assert_close(step(x=x, y=y), np_loss(va, x, y), rtol=1e-5, atol=1e-6)


def test_load_after_compile_updates_arena_in_place(tmp_path):
    a, b = model_with_seed(4), model_with_seed(5)
    x, y = data(4)
    step_a = rlx.compile_train_step(loss_fn, a, rlx.optim.SGD(lr=0.1), TRAIN_INPUTS)
    for _ in range(2):
        step_a(x=x, y=y)
    va = values(a)
    path = str(tmp_path / "a.safetensors")
    a.save(path)

    fn_b = rlx.compile(lambda m, x: m(x), b, FWD_INPUTS)
    step_b = rlx.compile_train_step(loss_fn, b, rlx.optim.SGD(lr=0.0), TRAIN_INPUTS)
    view = b.fc1.weight.numpy()
    ptr = view.ctypes.data
    before = fn_b(x=x)
    b.load(path)
    assert b.fc1.weight.numpy().ctypes.data == ptr
    np.testing.assert_array_equal(view, va["fc1.weight"])  # the old view sees the loaded values
    out = fn_b(x=x)
    assert not np.allclose(out, before)
    assert_close(out, np_forward(va, x), rtol=1e-5, atol=1e-6)
    assert_close(step_b(x=x, y=y), np_loss(va, x, y), rtol=1e-5, atol=1e-6)


def test_load_independently_written_file(tmp_path):
    rng = np.random.default_rng(6)
    tensors = {"fc2.bias": rng.standard_normal(D_OUT).astype(np.float32),
               "fc1.weight": rng.standard_normal((D_H, D_IN)).astype(np.float32),
               "fc2.weight": rng.standard_normal((D_OUT, D_H)).astype(np.float32),
               "fc1.bias": rng.standard_normal(D_H).astype(np.float32)}
    path = tmp_path / "ext.safetensors"
    write_safetensors(path, tensors)
    model = model_with_seed(6)
    model.load(str(path))
    for k, v in values(model).items():
        np.testing.assert_array_equal(v, tensors[k])


def test_load_accepts_pathlib_path(tmp_path):
    a, b = model_with_seed(7), model_with_seed(8)
    path = tmp_path / "p.safetensors"
    a.save(path)
    b.load(path)
    for k, v in values(b).items():
        np.testing.assert_array_equal(v, values(a)[k])


# ----------------------------------------------------------------------------------------------
# refused loads change nothing
# ----------------------------------------------------------------------------------------------
def _good_tensors(seed=9):
    rng = np.random.default_rng(seed)
    return {"fc1.weight": rng.standard_normal((D_H, D_IN)).astype(np.float32),
            "fc1.bias": rng.standard_normal(D_H).astype(np.float32),
            "fc2.weight": rng.standard_normal((D_OUT, D_H)).astype(np.float32),
            "fc2.bias": rng.standard_normal(D_OUT).astype(np.float32)}


def _without(d, key):
    return {k: v for k, v in d.items() if k != key}


# Each variant keeps the first tensors valid (and different from the model's), so a loader that
# writes while it validates would be caught.
MISMATCHES = {
    "missing-name": lambda t: _without(t, "fc2.bias"),
    "extra-name": lambda t: {**t, "fc3.weight": np.zeros((3, 3), np.float32)},
    "renamed": lambda t: {**_without(t, "fc2.bias"), "fc2.b": t["fc2.bias"]},
    "wrong-shape": lambda t: {**t, "fc2.bias": np.zeros(D_OUT + 1, np.float32)},
    "old-rlx-in-out-layout-weight": lambda t: {**_without(t, "fc2.bias"),
                                      "fc2.weight": np.ascontiguousarray(t["fc2.weight"].T),
                                      "fc2.bias": t["fc2.bias"]},
    "wrong-dtype-i32": lambda t: {**t, "fc2.bias": np.zeros(D_OUT, np.int32)},
}


def _assert_refused_and_untouched(model, path, compiled=None):
    before = values(model)
    raw = pathlib.Path(path).read_bytes()
    x, y = data(10)
    with pytest.raises(rlx.CheckpointError):
        model.load(str(path))
    for k, v in values(model).items():
        np.testing.assert_array_equal(v, before[k], err_msg=f"{k} changed by a failed load")
    assert pathlib.Path(path).read_bytes() == raw, "a failed load modified the file"
    if compiled is not None:
        assert_close(compiled(x=x, y=y), np_loss({k: v.astype(np.float64) for k, v in
                                                  before.items()}, x, y), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("compiled", [False, True], ids=["uncompiled", "compiled"])
@pytest.mark.parametrize("variant", list(MISMATCHES))
def test_mismatched_checkpoint_is_refused(tmp_path, variant, compiled):
    path = tmp_path / "bad.safetensors"
    write_safetensors(path, MISMATCHES[variant](_good_tensors()))
    model = model_with_seed(11)
    step = None
    if compiled:
        step = rlx.compile_train_step(loss_fn, model, rlx.optim.SGD(lr=0.0), TRAIN_INPUTS)
    _assert_refused_and_untouched(model, path, step)


def test_checkpoint_of_other_architecture_is_refused(tmp_path):
    other = model_with_seed(12, d_h=7)
    path = tmp_path / "other.safetensors"
    other.save(str(path))
    model = model_with_seed(13)
    step = rlx.compile_train_step(loss_fn, model, rlx.optim.SGD(lr=0.0), TRAIN_INPUTS)
    _assert_refused_and_untouched(model, path, step)


def _saved_bytes(tmp_path):
    src = tmp_path / "src.safetensors"
    model_with_seed(14).save(str(src))
    raw = src.read_bytes()
    src.unlink()
    return raw


CORRUPTIONS = {
    "truncated-half": lambda raw: raw[: len(raw) // 2],
    "truncated-last-byte": lambda raw: raw[:-1],
    "truncated-in-header": lambda raw: raw[:12],
    "only-length": lambda raw: raw[:8],
    "too-short-for-length": lambda raw: raw[:3],
    "empty": lambda raw: b"",
    "garbage": lambda raw: np.random.default_rng(0).integers(0, 256, 2000, np.uint8).tobytes(),
    "huge-header-length": lambda raw: struct.pack("<Q", 2**60) + raw[8:],
    "header-not-json": lambda raw: struct.pack("<Q", 16) + b"this is not json" + raw[24:],
    "header-length-past-end": lambda raw: struct.pack("<Q", len(raw)) + raw[8:],
}


@pytest.mark.parametrize("variant", list(CORRUPTIONS))
def test_corrupted_file_is_refused(tmp_path, variant):
    raw = _saved_bytes(tmp_path)
    path = tmp_path / "corrupt.safetensors"
    path.write_bytes(CORRUPTIONS[variant](raw))
    model = model_with_seed(15)
    step = rlx.compile_train_step(loss_fn, model, rlx.optim.SGD(lr=0.0), TRAIN_INPUTS)
    _assert_refused_and_untouched(model, path, step)


def test_data_offsets_out_of_bounds_is_refused(tmp_path):
    t = _good_tensors()
    path = tmp_path / "oob.safetensors"
    write_safetensors(path, t)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header["fc2.bias"]["data_offsets"][1] += 4000  # claims bytes the file does not have
    header["fc2.bias"]["shape"] = [D_OUT + 1000]
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + raw[8 + n:])
    _assert_refused_and_untouched(model_with_seed(16), path)


def test_missing_file(tmp_path):
    model = model_with_seed(17)
    before = values(model)
    with pytest.raises((rlx.CheckpointError, OSError)):
        model.load(str(tmp_path / "does-not-exist.safetensors"))
    for k, v in values(model).items():
        np.testing.assert_array_equal(v, before[k])


# ----------------------------------------------------------------------------------------------
# atomic writes
# ----------------------------------------------------------------------------------------------
def test_save_leaves_no_temp_files(tmp_path):
    model = model_with_seed(18)
    path = tmp_path / "m.safetensors"
    model.save(str(path))
    assert sorted(os.listdir(tmp_path)) == ["m.safetensors"]
    # overwrite with different weights: replaced, still a single file
    step = rlx.compile_train_step(loss_fn, model, rlx.optim.SGD(lr=0.5), TRAIN_INPUTS)
    x, y = data(18)
    step(x=x, y=y)
    model.save(str(path))
    assert sorted(os.listdir(tmp_path)) == ["m.safetensors"]
    got = read_safetensors(path)
    for k, v in values(model).items():
        np.testing.assert_array_equal(got[k][1], v)


def test_failed_save_keeps_previous_file(tmp_path):
    model = model_with_seed(19)
    path = tmp_path / "m.safetensors"
    model.save(str(path))
    raw = path.read_bytes()
    bad_dir = tmp_path / "no" / "such" / "dir" / "m.safetensors"
    with pytest.raises((rlx.CheckpointError, OSError)):
        model.save(str(bad_dir))
    assert path.read_bytes() == raw
    assert sorted(os.listdir(tmp_path)) == ["m.safetensors"]
