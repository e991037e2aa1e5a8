"""Dtypes at the edges: float16, bfloat16, float64, int64 and bool tensors as inputs, outputs,
views, parameters, buffers and checkpoints; casts between every pair (rounding to nearest even,
NaN/inf, subnormals) against numpy and ml_dtypes; the DTypeErrors of ops that compute only in
float32/int32 so far; int64 labels and ids; model.to and dtype= on layers; precision=."""

import json
import os
import pickle
import struct
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import rlx

BF16 = np.dtype(ml_dtypes.bfloat16)
NP = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": BF16,
      "float64": np.dtype(np.float64), "int32": np.dtype(np.int32), "int64": np.dtype(np.int64),
      "bool": np.dtype(np.bool_)}
DTYPES = list(NP)
FLOATS = ["float32", "float16", "bfloat16", "float64"]


def sample(dtype, shape=(3, 4), seed=0):
    """Values of ``dtype`` covering its edges: NaN, +-inf, -0, subnormals and extremes for
    floats; the extremes for integers; both values for bool."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    if dtype == "bool":
        return (rng.integers(0, 2, n) == 1).reshape(shape)
    if dtype in ("int32", "int64"):
        info = np.iinfo(dtype)
        v = rng.integers(-1000, 1000, n).astype(dtype)
        v[:3] = [info.min, info.max, 0]
        return v.reshape(shape)
    v = rng.standard_normal(n).astype(np.float32).astype(NP[dtype])
    tiny = {"float16": np.float16(6e-8), "bfloat16": ml_dtypes.bfloat16(1e-39), "float32": np.float32(1e-40),
            "float64": np.float64(5e-324)}[dtype]
    v[:5] = [np.nan, np.inf, -np.inf, tiny, -0.0]
    return v.reshape(shape)


def bits(a):
    """The raw bits of an array, for exact comparisons (NaN included)."""
    a = np.ascontiguousarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def same(got, want):
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert got.shape == want.shape
    np.testing.assert_array_equal(bits(got), bits(want))


def run_graph(build, feeds, params=None):
    """Builds a graph with ``build(g)`` (which returns the outputs), compiles and runs it."""
    g = rlx.Graph()
    g.output(*build(g))
    exe = g.compile("cpu")
    for k, v in (params or {}).items():
        exe.set_param(k, v)
    return exe.run(**feeds)


# ---------------------------------------------------------------------------------------------
# inputs, outputs, data movement
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_round_trips_through_inputs_outputs_and_data_movement(dtype):
    x, y = sample(dtype, (3, 4), 0), sample(dtype, (2, 4), 1)
    mask = np.array([[True], [False], [True]])

    def build(g):
        a, b = g.input("x", (3, 4), dtype), g.input("y", (2, 4), dtype)
        m = g.input("m", (3, 1), "bool")
        assert (a.dtype, b.dtype) == (dtype, dtype)
        # transpose, slice, concat, where (broadcasting the condition and one branch), reshape
        return [a.T, a[1:3], rlx.concat([a, b], axis=0), rlx.where(m, a, a[0:1]), a.reshape(4, 3), a[:, 1:2].T]

    outs = run_graph(build, {"x": x, "y": y, "m": mask})
    same(outs[0], x.T.copy())
    same(outs[1], x[1:3])
    same(outs[2], np.concatenate([x, y], axis=0))
    same(outs[3], np.where(mask, x, x[0:1]))
    same(outs[4], x.reshape(4, 3))
    same(outs[5], x[:, 1:2].T.copy())


@pytest.mark.parametrize("dtype", DTYPES)
def test_views_of_resident_inputs_have_the_dtype(dtype):
    x = sample(dtype, (2, 3))
    fn = rlx.compile(lambda m, x: x.astype("float64"), rlx.nn.Module(), {"x": rlx.InputSpec((2, 3), dtype)})
    fn.bind("x", x)
    v = fn.view("x")
    same(v, x)
    v[0, 0] = np.ones((), NP[dtype])  # writes through the zero-copy view
    want = x.copy()
    want[0, 0] = np.ones((), NP[dtype])
    np.testing.assert_array_equal(fn(), want.astype(np.float64))


def test_prefetched_batches_and_dynamic_shapes_take_every_dtype():
    specs = {d: ((None, 3), d) for d in DTYPES}
    fn = rlx.compile(lambda m, **xs: tuple(xs[d].T for d in DTYPES), rlx.nn.Module(), specs)
    for rows, seed in [(2, 0), (5, 1), (2, 2)]:
        batch = {d: sample(d, (rows, 3), seed) for d in DTYPES}
        fn.prefetch(**batch)
        outs = fn()
        for d, o in zip(DTYPES, outs):
            same(o, batch[d].T.copy())


def test_input_specs_and_feeds_check_dtypes():
    assert rlx.InputSpec((2,), np.float16).dtype == "float16"
    assert rlx.InputSpec((2,), ml_dtypes.bfloat16).dtype == "bfloat16"
    assert rlx.InputSpec((2,), "bool").dtype == "bool"
    with pytest.raises(rlx.DTypeError, match=r"\[InputSpec\] unsupported dtype 'uint8'"):
        rlx.InputSpec((2,), "uint8")
    fn = rlx.compile(lambda m, x, i, b: (x.astype("float32"), i.astype("float32"), b.astype("float32")),
                     rlx.nn.Module(), {"x": ((2,), "bfloat16"), "i": ((2,), "int64"), "b": ((2,), "bool")})
    ok = {"x": np.ones(2, BF16), "i": np.array([1, 2], np.int64), "b": np.array([True, False])}
    with pytest.raises(rlx.DTypeError, match=r"\[x\] expected a bfloat16 array, got float32; .*ml_dtypes.bfloat16"):
        fn(**{**ok, "x": np.ones(2, np.float32)})
    with pytest.raises(rlx.DTypeError, match=r"\[b\] expected a bool array, got int64"):
        fn(**{**ok, "b": np.array([1, 0])})
    # Integer arrays of another width are accepted when their values fit.
    out = fn(**{**ok, "i": np.array([3, 4], np.uint64)})
    np.testing.assert_array_equal(out[1], [3, 4])
    with pytest.raises(rlx.InputError, match=r"\[i\] values .* do not fit in int64"):
        fn(**{**ok, "i": np.array([2**64 - 1, 0], np.uint64)})
    x16 = rlx.compile(lambda m, x: x.astype("float32"), rlx.nn.Module(), {"x": rlx.InputSpec((2,), "float16")})
    with pytest.raises(rlx.DTypeError, match=r"expected a float16 array, got float64; convert it with .astype\(np.float16\)"):
        x16(x=np.ones(2))


# ---------------------------------------------------------------------------------------------
# casts
# ---------------------------------------------------------------------------------------------
def cast_on_rlx(x, to):
    (out,) = run_graph(lambda g: [g.input("x", x.shape, np.asarray(x).dtype).astype(to)], {"x": x})
    return out


@pytest.mark.parametrize("src", DTYPES)
@pytest.mark.parametrize("dst", DTYPES)
def test_casts_between_every_pair_match_numpy(src, dst):
    # Values every conversion defines the same way in numpy: small integers and halves, zeros.
    base = np.array([0, 1, -1, 2.5, -3.5, 7, 100, -128, 0.5, 1.5], np.float64)
    if src == "bool":
        x = base != 0
    elif src in ("int32", "int64"):
        x = np.trunc(base).astype(src)
    else:
        x = base.astype(np.float32).astype(NP[src])
    got = cast_on_rlx(x, dst)
    want = x.astype(NP[dst])
    same(got, want)


def test_narrowing_rounds_to_nearest_even_with_subnormals_overflow_and_nan():
    f16 = np.arange(0, 0x7C00, dtype=np.uint16).view(np.float16)  # every finite non-negative f16
    lo, hi = f16[:-1].astype(np.float64), f16[1:].astype(np.float64)
    mid = ((lo + hi) / 2).astype(np.float32)  # exact in float32
    up = np.nextafter(mid, np.float32(np.inf))
    down = np.nextafter(mid, np.float32(0))
    x = np.concatenate([mid, up, down, -mid, [np.nan, -np.nan, np.inf, -np.inf, 65519.99, 65520.0, 1e-8, -1e-8,
                                            2.0**-24, 2.0**-25, 3 * 2.0**-26]]).astype(np.float32)
    with np.errstate(over="ignore"):
        same(cast_on_rlx(x, "float16"), x.astype(np.float16))
    got = cast_on_rlx(x, "bfloat16")
    same(got, x.astype(BF16))  # ml_dtypes rounds float32 -> bfloat16 to nearest even
    nan_bits = bits(got)[np.isnan(x)]
    assert np.all((nan_bits & 0x7F80) == 0x7F80) and np.all(nan_bits & 0x7F)
    # Float32 subnormals keep their value in bfloat16 (same exponent range).
    sub = np.array([1e-40, -3e-39, 1.2e-38], np.float32)
    same(cast_on_rlx(sub, "bfloat16"), sub.astype(BF16))
    # Every float16 and bfloat16 widens exactly (NaN stays NaN).
    all16 = np.arange(0, 2**16, dtype=np.uint16)
    for d in (np.float16, BF16):
        h = all16.view(d)
        got = cast_on_rlx(h, "float32")
        ok = ~np.isnan(h.astype(np.float32))
        same(got[ok], h[ok].astype(np.float32))
        assert np.all(np.isnan(got[~ok]))


def test_wide_sources_round_once():
    # A float64 just above the midpoint between 1 and the next float16 / bfloat16: a double
    # rounding through the nearest float32 would give the even neighbour, 1.0.
    x = np.array([1 + 2.0**-11 + 2.0**-40, 1 + 2.0**-8 + 2.0**-40, 1e300, -1e-300], np.float64)
    h = cast_on_rlx(x, "float16")
    assert bits(h)[0] == 0x3C01
    with np.errstate(over="ignore"):
        same(h, x.astype(np.float16))  # numpy rounds float64 -> float16 once
    b = bits(cast_on_rlx(x, "bfloat16"))
    assert list(b) == [0x3F80, 0x3F81, 0x7F80, 0x8000]
    n = np.array([2**30 + 2**22 + 1, -(2**30 + 2**22 + 1)], np.int64)
    assert list(bits(cast_on_rlx(n, "bfloat16"))) == [0x4E81, 0xCE81]


def test_float_to_int_bool_and_wrapping_follow_the_documented_rules():
    x = np.array([2.9, -2.9, np.nan, 1e10, -1e10, np.inf, 0.0, -0.0], np.float32)
    np.testing.assert_array_equal(cast_on_rlx(x, "int32"), [2, -2, 0, 2**31 - 1, -(2**31), 2**31 - 1, 0, 0])
    np.testing.assert_array_equal(cast_on_rlx(x, "int64"), [2, -2, 0, 10**10, -(10**10), 2**63 - 1, 0, 0])
    np.testing.assert_array_equal(cast_on_rlx(x, "bool"), [True, True, True, True, True, True, False, False])
    big = np.array([2**40 + 5, -(2**33) - 1, 2**31], np.int64)
    np.testing.assert_array_equal(cast_on_rlx(big, "int32"), big.astype(np.int32))  # wraps as numpy


def cpu_has(*flags):
    """Whether /proc/cpuinfo lists every flag (False where there is no /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as f:
            have = set(f.read().split())
    except OSError:
        return False
    return all(fl in have for fl in flags)


def test_portable_and_f16c_conversions_give_the_same_bits():
    script = (
        "import sys, numpy as np, rlx\n"
        "x = np.random.default_rng(3).standard_normal(1 << 19).astype(np.float32) * 3e4\n"
        "x[:4] = [np.nan, np.inf, 1e-6, 6e-8]\n"
        "g = rlx.Graph(); a = g.input('x', x.shape, 'float32'); h = a.astype('float16')\n"
        "g.output(h, h.astype('float32'))\n"
        "h, back = g.compile('cpu').run(x=x)\n"
        "sys.stdout.buffer.write(h.view(np.uint16).tobytes() + back.view(np.uint32).tobytes())\n"
        "sys.stderr.write(rlx._rlx.cpu_isa())\n"
    )
    outs = {}
    for isa in ("portable", "auto"):
        env = {**os.environ, "RLX_CPU_ISA": isa}
        r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, check=True)
        outs[isa] = r.stdout
        # The default run uses the widest kernels (AVX2 or AVX-512), and F16C with them, where the
        # CPU has them.
        widest = "avx512" if cpu_has("avx2", "fma", "avx512f") else "avx2"
        assert r.stderr.decode() == ("portable" if isa == "portable" or not cpu_has("avx2", "fma") else widest)
    assert len(outs["portable"]) == (1 << 19) * 6
    assert outs["portable"] == outs["auto"]


def test_cast_gradients_flow_back_to_float_inputs_only():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 4)).astype(np.float16)
    w = rng.standard_normal((4,)).astype(np.float32)
    g = rlx.Graph()
    xi, wp = g.input("x", (3, 4), "float16"), g.param("w", (4,))
    y = (xi.astype("float32") * wp).astype("bfloat16").astype("float32")
    dead = (wp * 3.0).astype("int32").astype("float32")  # no gradient through an integer
    g.output((y + dead).sum())
    bw = rlx.grad(g, ["w"])
    exe = bw.compile("cpu")
    exe.set_param("w", w)
    loss, dw = exe.run(x=x)
    want = np.sum((x.astype(np.float32) * w).astype(BF16).astype(np.float32)) + 3 * np.sum(np.trunc(w * 3))
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    np.testing.assert_allclose(dw, x.astype(np.float32).sum(0), rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# ops without kernels for a dtype: clear errors at trace time
# ---------------------------------------------------------------------------------------------
def test_ops_without_kernels_raise_dtype_errors_naming_op_and_dtypes():
    g = rlx.Graph()
    h = g.input("h", (2, 2), "float16")
    i = g.input("i", (2,), "int64")
    d = g.input("d", (2,), "float64")
    m = g.input("m", (2,), "bool")
    cases = [
        (lambda: rlx.conv2d(i.reshape(1, 1, 1, 2), d.reshape(1, 1, 1, 2)), r"^\[conv2d\] .*got int64"),
        (lambda: i.reshape(1, 2) @ i.reshape(2, 1), r"^\[matmul\] int64 x int64 is not supported yet; cast to float32 "
                                                     r"with \.astype\('float32'\)$"),
        (lambda: rlx.embedding(i.reshape(2, 1), g.input("ids", (1,), "int32")), r"^\[gather\] int64"),
        (lambda: rlx.softmax(m, -1), r"^\[softmax\] bool is not supported yet"),
        (lambda: rlx.max_pool2d(m.reshape(1, 1, 1, 2), 1), r"^\[max_pool2d\] .*got bool"),
    ]
    for fn, msg in cases:
        with pytest.raises(rlx.DTypeError, match=msg):
            fn()
    # Moving data works for every dtype, and so does a cast to float32 first.
    assert rlx.concat([h, h]).dtype == "float16"
    assert (h.astype("float32") @ h.astype("float32")).dtype == "float32"
    # A float16 (or bfloat16) pair is the mixed-precision matmul: float32 sums and result.
    assert (h @ h).dtype == "float32"
    with pytest.raises(rlx.DTypeError, match=r"\[astype\] unsupported dtype 'complex64'"):
        h.astype("complex64")


# ---------------------------------------------------------------------------------------------
# int64 and bool compute
# ---------------------------------------------------------------------------------------------
I64_EDGES = np.array([0, 1, -1, 7, -7, 2**40, -(2**40) - 3, 2**62, np.iinfo(np.int64).max, np.iinfo(np.int64).min],
                     np.int64)


def int64_operands(seed):
    rng = np.random.default_rng(seed)
    a = rng.integers(-(2**62), 2**62, (4, 10), dtype=np.int64)
    a[0] = I64_EDGES
    b = rng.integers(-50, 50, (10,), dtype=np.int64)
    b[b == 0] = 3
    b[:4] = [1, -1, 2**33 + 1, -(2**35)]
    return a, b


def test_int64_arithmetic_and_comparisons_match_numpy_with_wrapping():
    a, b = int64_operands(0)
    names = ("add", "sub", "mul", "floordiv", "mod", "div", "lt", "le", "gt", "ge", "eq", "ne")
    ops = [lambda x, y: x + y, lambda x, y: x - y, lambda x, y: x * y, lambda x, y: x // y, lambda x, y: x % y,
           lambda x, y: x / y, lambda x, y: x < y, lambda x, y: x <= y, lambda x, y: x > y, lambda x, y: x >= y,
           lambda x, y: x == y, lambda x, y: x != y]
    def build(g):
        x, y = g.input("a", a.shape, "int64"), g.input("b", b.shape, "int64")
        return [op(x, y) for op in ops]

    outs = run_graph(build, {"a": a, "b": b})
    with np.errstate(over="ignore"):
        for name, op, got in zip(names, ops, outs):
            want = op(a, b)
            if name == "div":
                np.testing.assert_allclose(got, want.astype(np.float32), rtol=1e-7, err_msg=name)
                assert got.dtype == np.float32
            elif want.dtype == np.bool_:
                np.testing.assert_array_equal(got, want.astype(np.float32), err_msg=name)  # float32 masks
            else:
                assert got.dtype == np.int64, name
                np.testing.assert_array_equal(got, want, err_msg=name)


def test_int64_python_numbers_and_promotion_follow_pytorch():
    a, _ = int64_operands(1)
    i32 = np.arange(10, dtype=np.int32) - 5
    x = np.linspace(-2, 2, 10, dtype=np.float32)

    def build(g):
        i, j, f = g.input("i", a.shape, "int64"), g.input("j", (10,), "int32"), g.input("x", (10,), "float32")
        outs = [i + 2**40, 3 * i, i + j, j - i, i * f, i // 3, -i, abs(i), i ** 2, rlx.where(i > 0, i, j)]
        assert [o.dtype for o in outs] == ["int64"] * 4 + ["float32"] + ["int64"] * 5
        return outs

    got = run_graph(build, {"i": a, "j": i32, "x": x})
    with np.errstate(over="ignore"):
        wants = [a + 2**40, 3 * a, a + i32, i32 - a, (a.astype(np.float32) * x), a // 3, -a, np.abs(a), a ** 2,
                 np.where(a > 0, a, i32)]
    for k, (g_, w) in enumerate(zip(got, wants)):
        np.testing.assert_array_equal(g_, w, err_msg=str(k))
    g = rlx.Graph()
    with pytest.raises(rlx.DTypeError, match=r"\[constant\] 9223372036854775808 does not fit in int64$"):
        g.input("i", (2,), "int64") + 2**63
    with pytest.raises(rlx.DTypeError, match=r"\[constant\] 1099511627776 does not fit in int32; cast the tensor with "
                                             r"\.astype\('int64'\)"):
        g.input("j", (2,), "int32") + 2**40


def test_integer_division_by_zero_names_the_int64_divisor():
    g = rlx.Graph()
    g.output(g.input("a", (3,), "int64") // g.input("b", (3,), "int64"))
    exe = g.compile("cpu")
    with pytest.raises(rlx.RlxError, match=r"\[floor_divide\] integer division by zero \(the int64 divisor \(3,\) holds a 0\)"):
        exe.run(a=np.ones(3, np.int64), b=np.array([1, 0, 2], np.int64))


@pytest.mark.parametrize("dtype", ["int32", "int64", "bool"])
def test_integer_and_bool_reductions_follow_pytorch(dtype):
    rng = np.random.default_rng(3)
    if dtype == "bool":
        v = rng.random((3, 4, 5)) > 0.5
    else:
        info = np.iinfo(dtype)
        v = rng.integers(info.min, info.max, (3, 4, 5), dtype=dtype, endpoint=True)
        v[0, 0, :2] = [info.min, info.max]
    axes = [None, 0, 2, (0, 2), (1, 2)]

    def build(g):
        t = g.input("v", v.shape, dtype)
        outs = []
        for ax in axes:
            for keep in (False, True):
                outs += [t.sum(ax, keepdims=keep), t.max(ax, keepdims=keep), t.min(ax, keepdims=keep),
                         t.mean(ax, keepdims=keep)]
        return outs

    got = iter(run_graph(build, {"v": v}))
    with np.errstate(over="ignore"):
        for ax in axes:
            for keep in (False, True):
                s, mx, mn, mean = (next(got) for _ in range(4))
                np.testing.assert_array_equal(s, v.astype(np.int64).sum(ax, keepdims=keep))
                assert s.dtype == np.int64  # PyTorch sums integers and bools to int64
                np.testing.assert_array_equal(mx, v.max(ax, keepdims=keep))
                np.testing.assert_array_equal(mn, v.min(ax, keepdims=keep))
                assert mx.dtype == mn.dtype == v.dtype
                # float32 sums: within a few roundings of the largest value's size
                np.testing.assert_allclose(mean, v.astype(np.float64).mean(ax, keepdims=keep), rtol=1e-6,
                                           atol=1e-6 * np.abs(v.astype(np.float64)).max())
                assert mean.dtype == np.float32


@pytest.mark.parametrize("dtype", ["float32", "int64", "bool"])
def test_min_over_an_empty_axis_names_min(dtype):
    x = rlx.Graph().input("x", (0, 3), dtype)
    with pytest.raises(rlx.ShapeError, match=r"^\[min\] cannot take the min over an empty axis of \(0, 3\)"):
        x.min(axis=0)
    assert x.min(axis=1).shape == (0,)


def test_bool_masks_promote_and_combine_with_logical_ops():
    rng = np.random.default_rng(4)
    m, n = rng.random((3, 4)) > 0.5, rng.random((4,)) > 0.3
    x = rng.standard_normal((3, 4)).astype(np.float32)
    i = rng.integers(-5, 5, (3, 4)).astype(np.int64)

    def build(g):
        bm, bn = g.input("m", m.shape, "bool"), g.input("n", n.shape, "bool")
        f, k = g.input("x", x.shape, "float32"), g.input("i", i.shape, "int64")
        outs = [bm & bn, bm | bn, bm ^ bn, ~bm, bm + bn, bm * bn, bm & True, rlx.logical_and(f > 0, bm),
                rlx.logical_or(k, bn), rlx.logical_xor(f, 0.0), rlx.logical_not(k), f * bm, k + bm, bm + 1, bm == bn,
                rlx.where(bm, f, -f)]
        assert [o.dtype for o in outs] == ["bool"] * 11 + ["float32", "int64", "int32", "float32", "float32"]
        return outs

    got = run_graph(build, {"m": m, "n": n, "x": x, "i": i})
    wants = [m & n, m | n, m ^ n, ~m, m | n, m & n, m, (x > 0) & m, (i != 0) | n, x != 0, i == 0, x * m, i + m,
             m.astype(np.int32) + 1, (m == n).astype(np.float32), np.where(m, x, -x)]
    for k, (g_, w) in enumerate(zip(got, wants)):
        np.testing.assert_array_equal(g_, w, err_msg=str(k))
        assert g_.dtype == w.dtype, (k, g_.dtype, w.dtype)


def test_bitwise_operators_take_masks_only_and_bool_subtraction_is_refused():
    g = rlx.Graph()
    m, i, d = g.input("m", (2,), "bool"), g.input("i", (2,), "int32"), g.input("d", (2,), "float64")
    with pytest.raises(rlx.DTypeError, match=r"^\[bitwise_and\] & \| \^ take bool tensors or comparison masks, got int32; "
                                             r"use rlx.logical_and"):
        m & i
    with pytest.raises(rlx.DTypeError, match=r"^\[bitwise_or\] .* got int64"):
        np.array([1], np.int64) | m
    with pytest.raises(rlx.DTypeError, match=r"^\[bitwise_not\] ~ takes a bool tensor or a comparison mask, got int32"):
        ~i
    with pytest.raises(rlx.DTypeError, match=r"^\[sub\] bool - bool is not supported \(as in PyTorch\)"):
        m - m
    with pytest.raises(rlx.DTypeError, match=r"^\[neg\] negating a bool tensor is not supported"):
        -m
    assert rlx.logical_or(d, m).dtype == "bool"  # any dtype's truth values


def test_comparison_masks_combine_with_operators_and_extrema_keep_integer_dtypes():
    x = np.array([-2.0, 0.5, 3.0, np.nan], np.float32)
    ids = np.array([2**40 + 1, 7, -3, 2**62], np.int64)
    other = np.array([2**40, 9, -4, -1], np.int64)
    m = np.array([True, False, True, True])

    def build(g):
        f, i, j, b = (g.input("x", (4,), "float32"), g.input("ids", (4,), "int64"), g.input("other", (4,), "int64"),
                      g.input("m", (4,), "bool"))
        outs = [(f > 0) & b, ~(f > 0), (i > 5) | (f < 0), b & np.array([True, True, False, True]),
                b + np.array([True, False, False, False]), rlx.maximum(i, j), rlx.minimum(i, j), rlx.maximum(b, ~b)]
        assert [o.dtype for o in outs] == ["bool"] * 5 + ["int64", "int64", "bool"]
        return outs

    got = run_graph(build, {"x": x, "ids": ids, "other": other, "m": m})
    with np.errstate(invalid="ignore"):
        wants = [(x > 0) & m, ~(x > 0), (ids > 5) | (x < 0), m & [True, True, False, True], m | [True, False, False, False],
                 np.maximum(ids, other), np.minimum(ids, other), np.ones(4, bool)]
    for k, (g_, w) in enumerate(zip(got, wants)):
        np.testing.assert_array_equal(g_, w, err_msg=str(k))
        assert g_.dtype == w.dtype, k


def test_integer_array_constants_widen_to_int64_only_when_needed():
    g = rlx.Graph()
    assert g.constant(np.array([1, 2], np.int64)).dtype == "int32"  # numpy's default ints stay int32
    big = g.constant(np.array([2**40, -1]))
    assert big.dtype == "int64"
    g.output(big + 1)
    np.testing.assert_array_equal(g.compile("cpu").run()[0], [2**40 + 1, 0])
    i = rlx.Graph().input("i", (3,), "int64")
    with pytest.raises(rlx.DTypeError, match=r"\[constant\] integer values do not fit in int64"):
        i + np.array([2**64 - 1, 0, 0], np.uint64)


def test_a_model_masks_with_bools_and_counts_with_int64_while_training():
    """Masked mean loss over int64 ids, the mask a bool input; the count is an int64 sum."""
    rlx.seed(0)

    class Net(rlx.nn.Module):
        def __init__(self):
            self.fc = rlx.nn.Linear(4, 1)

        def __call__(self, x):
            return self.fc(x).reshape(-1)

    def loss(m, x, y, valid, ids):
        keep = valid & (ids % 2 == 0)
        err = rlx.where(keep, (m(x) - y) ** 2, 0.0)
        return err.sum() / keep.sum().astype("float32"), {"count": keep.sum()}

    model = Net()
    step = rlx.compile_train_step(loss, model, rlx.optim.SGD(0.1), {
        "x": ((8, 4), "float32"), "y": ((8,), "float32"), "valid": ((8,), "bool"), "ids": ((8,), "int64")})
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((8, 4)).astype(np.float32), rng.standard_normal(8).astype(np.float32)
    valid, ids = rng.random(8) > 0.2, np.arange(8, dtype=np.int64) + 2**40
    w, b = model.fc.weight.numpy().copy(), model.fc.bias.numpy().copy()
    value, aux = step(x=x, y=y, valid=valid, ids=ids)
    keep = valid & (ids % 2 == 0)
    assert aux["count"] == keep.sum() and aux["count"].dtype == np.int64
    pred = x @ w.T[:, 0] + b[0]
    np.testing.assert_allclose(value, np.mean((pred - y)[keep] ** 2), rtol=1e-5)
    grad_w = 2 * ((pred - y) * keep) @ x / keep.sum()
    np.testing.assert_allclose(model.fc.weight.numpy()[0], w[0] - 0.1 * grad_w, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# int64 labels and ids
# ---------------------------------------------------------------------------------------------
def test_int64_labels_and_ids_work_and_are_range_checked_before_the_cast():
    rlx.seed(0)

    class Net(rlx.nn.Module):
        def __init__(self):
            self.emb = rlx.nn.Embedding(5, 3)

        def __call__(self, ids):
            return self.emb(ids)

    model = Net()
    loss = lambda m, ids, y: rlx.cross_entropy(m(ids), y)  # noqa: E731
    ids = np.array([0, 4, 2, 1], np.int64)
    y = np.array([2, 0, 1, -100], np.int64)
    outs = {}
    for dt in ("int32", "int64"):
        fn = rlx.compile(loss, model, {"ids": ((4,), dt), "y": ((4,), dt)})
        outs[dt] = fn(ids=ids.astype(dt), y=y.astype(dt))
    np.testing.assert_array_equal(outs["int32"], outs["int64"])
    fn = rlx.compile(loss, model, {"ids": ((4,), "int64"), "y": ((4,), "int64")})
    # 2**32 + 1 would wrap to the valid id 1 in int32: it is refused before the cast.
    with pytest.raises(rlx.InputError, match=r"\[ids\] id 4294967297 is out of range \[0, 5\)"):
        fn(ids=np.array([0, 2**32 + 1, 2, 1], np.int64), y=y)
    with pytest.raises(rlx.InputError, match=r"\[y\] label -4294967294 is out of range \[0, 3\)"):
        fn(ids=ids, y=np.array([2, -(2**32) + 2, 1, 0], np.int64))
    step = rlx.compile_train_step(loss, model, rlx.optim.SGD(0.1), {"ids": ((4,), "int64"), "y": ((4,), "int64")})
    assert np.isfinite(step(ids=ids, y=y))


# ---------------------------------------------------------------------------------------------
# parameters, buffers, model.to, dtype=
# ---------------------------------------------------------------------------------------------
def test_layers_take_a_dtype_and_compiling_them_names_the_parameter():
    lin = rlx.nn.Linear(3, 2, dtype="bfloat16")
    assert lin.weight.dtype == "bfloat16" and lin.weight.numpy().dtype == BF16
    assert rlx.nn.Embedding(4, 2, dtype=np.float16).weight.numpy().dtype == np.float16
    assert rlx.nn.LayerNorm(4, dtype="float64").bias.numpy().dtype == np.float64
    assert rlx.nn.Conv2d(1, 2, 3, dtype="float16").weight.dtype == "float16"
    assert "dtype=bfloat16" in repr(lin.weight)
    copy = pickle.loads(pickle.dumps(lin))
    assert copy.weight.dtype == "bfloat16"
    same(copy.weight.numpy(), lin.weight.numpy())
    spec = {"x": rlx.InputSpec((1, 3))}
    with pytest.raises(rlx.DTypeError, match=r"^\[compile_train_step\] parameter 'weight' is bfloat16: training "
                                             r"bfloat16 weights is not supported yet; train a float32 model "
                                             r"\(model.to\('float32'\)\) with precision='bf16'"):
        rlx.compile_train_step(lambda m, x: m(x).sum(), lin, rlx.optim.SGD(0.1), spec)
    wide = rlx.nn.Linear(3, 2, dtype="float64")
    out = rlx.compile(lambda m, x: m(x), wide, spec)(x=np.ones((1, 3), np.float32))  # computes in float64
    assert out.dtype == np.float64
    np.testing.assert_allclose(out, wide.weight.numpy().sum(1, keepdims=True).T + wide.bias.numpy(), rtol=1e-14)
    # float64 weights train on the CPU (tests/test_float64.py checks the values).
    assert isinstance(rlx.compile_train_step(lambda m, x: m(x).sum(), wide, rlx.optim.SGD(0.1), spec)(x=np.ones((1, 3), np.float32)), float)
    with pytest.raises(rlx.DTypeError, match=r"\[Parameter\] a parameter holds one of"):
        rlx.nn.Parameter(np.zeros(2), dtype="int32")
    with pytest.raises(rlx.DTypeError, match=r"\[Linear\]|\[Parameter\] unsupported dtype 'float8'"):
        rlx.nn.Linear(2, 2, dtype="float8")


def test_model_to_converts_values_and_a_float32_model_compiles_again():
    rlx.seed(1)
    lin = rlx.nn.Linear(3, 2)
    x = np.random.default_rng(0).standard_normal((1, 3)).astype(np.float32)
    fn = rlx.compile(lambda m, x: m(x), lin, {"x": rlx.InputSpec((1, 3))})
    w32 = lin.weight.numpy().copy()
    fn(x=x)
    assert lin.to("bfloat16") is lin
    same(lin.weight.numpy(), w32.astype(BF16))
    with pytest.raises(rlx.RlxError, match="model changed since compile"):
        fn(x=x)
    lin.to("float32")
    assert lin.weight.numpy().dtype == np.float32
    np.testing.assert_array_equal(lin.weight.numpy(), w32.astype(BF16).astype(np.float32))
    out = rlx.compile(lambda m, x: m(x), lin, {"x": rlx.InputSpec((1, 3))})(x=x)
    np.testing.assert_allclose(out, x @ lin.weight.numpy().T + lin.bias.numpy(), rtol=1e-6)
    with pytest.raises(rlx.DTypeError, match=r"\[Module.to\] parameters are floating point; int32"):
        lin.to("int32")


def test_integer_and_bool_buffers_live_in_the_weight_store():
    class Net(rlx.nn.Module):
        def __init__(self):
            self.emb = rlx.nn.Embedding(6, 2)
            self.register_buffer("ids", np.array([5, 0, 3], np.int64))
            self.register_buffer("keep", np.array([True, False, True]))

        def __call__(self, x):
            rows = self.emb(self.ids)                      # int64 buffer as ids
            return rlx.where(self.keep.reshape(3, 1), rows, x)

    net = Net()
    assert net.ids.dtype == "int64" and net.keep.dtype == "bool"
    x = np.full((3, 2), 7.0, np.float32)
    out = rlx.compile(lambda m, x: m(x), net, {"x": rlx.InputSpec((3, 2))})(x=x)
    table = net.emb.weight.numpy()
    np.testing.assert_array_equal(out, np.where([[True], [False], [True]], table[[5, 0, 3]], x))
    assert net.ids.numpy().dtype == np.int64  # a view of the store
    sd = net.state_dict()
    assert sd["ids"].dtype == np.int64 and sd["keep"].dtype == np.bool_
    # Training leaves integer and bool buffers alone: no optimizer state, no update.
    opt = rlx.optim.Adam(0.1)
    step = rlx.compile_train_step(lambda m, x: (m(x) * m(x)).mean(), net, opt, {"x": rlx.InputSpec((3, 2))})
    before = net.emb.weight.numpy().copy()
    step(x=x)
    assert not np.array_equal(net.emb.weight.numpy(), before)
    np.testing.assert_array_equal(net.ids.numpy(), [5, 0, 3])
    assert set(opt.state_dict()["state"]) == {"emb.weight"}
    with pytest.raises(rlx.InputError, match=r"'ids' has no optimizer state \(only float32 and float64 tensors are trained\)"):
        opt.state("ids")


# ---------------------------------------------------------------------------------------------
# checkpoints
# ---------------------------------------------------------------------------------------------
ST = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "int32": "I32", "int64": "I64",
      "bool": "BOOL"}


def write_safetensors(path, tensors):
    """A safetensors file built by hand from numpy arrays: the header, then the data."""
    header, blobs, at = {}, [], 0
    for name, arr in tensors.items():
        data = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": ST[arr.dtype.name], "shape": list(arr.shape), "data_offsets": [at, at + len(data)]}
        blobs.append(data)
        at += len(data)
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def read_header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def test_checkpoints_hold_every_dtype_and_round_trip(tmp_path):
    class Holder(rlx.nn.Module):
        pass

    m = Holder()
    values = {}
    for d in DTYPES:
        v = sample(d, (2, 3), seed=DTYPES.index(d))
        if d in FLOATS:
            m.__setattr__(f"p_{d}", rlx.nn.Parameter(v, dtype=d))
        else:
            m.register_buffer(f"p_{d}", v)
        values[f"p_{d}"] = v
    path = tmp_path / "all.safetensors"
    m.save(str(path))
    header = read_header(path)
    assert {k: v["dtype"] for k, v in header.items() if k != "__metadata__"} == {f"p_{d}": ST[d] for d in DTYPES}
    for k, v in m.state_dict().items():
        same(v, values[k])
    # Load into a fresh holder whose tensors are zeros of the same dtypes.
    fresh = Holder()
    for d in DTYPES:
        z = np.zeros((2, 3), NP[d])
        if d in FLOATS:
            fresh.__setattr__(f"p_{d}", rlx.nn.Parameter(z, dtype=d))
        else:
            fresh.register_buffer(f"p_{d}", z)
    fresh.load(str(path))
    for k, v in fresh.state_dict().items():
        same(v, values[k])


def test_low_precision_files_load_into_float32_models_by_casting(tmp_path):
    rlx.seed(2)
    lin = rlx.nn.Linear(3, 2)
    w = np.random.default_rng(5).standard_normal((2, 3))
    b = np.array([1e-3, -7.25])
    for wd, bd in [("bfloat16", "float16"), ("float64", "bfloat16"), ("float16", "float64")]:
        path = tmp_path / f"{wd}.safetensors"
        write_safetensors(path, {"weight": w.astype(NP[wd]), "bias": b.astype(NP[bd])})
        lin.load(str(path))
        np.testing.assert_array_equal(lin.weight.numpy(), w.astype(NP[wd]).astype(np.float32))
        np.testing.assert_array_equal(lin.bias.numpy(), b.astype(NP[bd]).astype(np.float32))
    # And a bfloat16 model saves bfloat16 and takes float32 / float64 values rounded once.
    lin16 = rlx.nn.Linear(3, 2, dtype="bfloat16")
    path = tmp_path / "f64.safetensors"
    tricky = np.full((2, 3), 1 + 2.0**-8 + 2.0**-40)  # ml_dtypes would round it twice, to 1.0
    write_safetensors(path, {"weight": tricky, "bias": b})
    lin16.load(str(path))
    assert np.all(bits(lin16.weight.numpy()) == 0x3F81)
    out = tmp_path / "bf16.safetensors"
    lin16.save(str(out))
    assert read_header(out)["weight"]["dtype"] == "BF16"
    lin.load(str(out))
    np.testing.assert_array_equal(lin.weight.numpy(), np.float32(1 + 2.0**-7))


def test_integer_checkpoint_values_cast_when_they_fit_and_name_the_tensor_otherwise(tmp_path):
    class Counter(rlx.nn.Module):
        def __init__(self, dt):
            self.register_buffer("count", np.zeros(3, dt))

    c32 = Counter(np.int32)
    path = tmp_path / "i64.safetensors"
    write_safetensors(path, {"count": np.array([1, -2, 2**31 - 1], np.int64)})
    c32.load(str(path))
    np.testing.assert_array_equal(c32.count.numpy(), [1, -2, 2**31 - 1])
    write_safetensors(path, {"count": np.array([1, 2**31, 0], np.int64)})
    with pytest.raises(rlx.CheckpointError, match=r"'count': values 0\.\.2147483648 do not fit in the model's int32"):
        c32.load(str(path))
    np.testing.assert_array_equal(c32.count.numpy(), [1, -2, 2**31 - 1])  # unchanged
    c64 = Counter(np.int64)
    write_safetensors(path, {"count": np.array([5, -6, 7], np.int32)})
    c64.load(str(path))
    np.testing.assert_array_equal(c64.count.numpy(), [5, -6, 7])
    write_safetensors(path, {"count": np.array([0.5, 1, 2], np.float32)})
    with pytest.raises(rlx.CheckpointError, match=r"'count' is float32 \(3,\) in the checkpoint but int64 \(3,\) in the model"):
        c64.load(str(path))
    with pytest.raises(rlx.CheckpointError, match=r"'count': values .* do not fit in the model's int32"):
        c32.load_state_dict({"count": np.array([2**40, 0, 0])})
    lin = rlx.nn.Linear(1, 1)
    write_safetensors(path, {"weight": np.ones((1, 1), np.int64), "bias": np.ones(1, np.float32)})
    with pytest.raises(rlx.CheckpointError, match=r"'weight' is int64 \(1, 1\) in the checkpoint but float32"):
        lin.load(str(path))


def test_files_written_by_torch_load_with_casting(tmp_path):
    torch = pytest.importorskip("torch")
    st = pytest.importorskip("safetensors.torch")
    ref = torch.nn.Linear(3, 2).to(torch.bfloat16)
    path = tmp_path / "torch.safetensors"
    st.save_file(ref.state_dict(), str(path))
    lin = rlx.nn.Linear(3, 2)
    lin.load(str(path))
    np.testing.assert_array_equal(lin.weight.numpy(), ref.weight.detach().float().numpy())


def test_torch_state_dicts_of_any_dtype_load():
    torch = pytest.importorskip("torch")
    ref = torch.nn.Linear(3, 2).to(torch.bfloat16)
    lin = rlx.nn.Linear(3, 2, dtype="bfloat16")
    lin.load_state_dict(ref.state_dict())
    np.testing.assert_array_equal(lin.weight.numpy().astype(np.float32), ref.weight.detach().float().numpy())
    lin32 = rlx.nn.Linear(3, 2)
    lin32.load_state_dict({k: v.to(torch.float16) for k, v in ref.state_dict().items()})
    np.testing.assert_array_equal(lin32.weight.numpy(), ref.weight.detach().float().numpy())


# ---------------------------------------------------------------------------------------------
# precision=
# ---------------------------------------------------------------------------------------------
def test_precision_fp32_trains_and_bad_precision_is_a_clear_error():
    # Mixed precision itself: tests/test_precision.py.
    rlx.seed(3)
    lin = rlx.nn.Linear(2, 1)
    spec = {"x": rlx.InputSpec((4, 2)), "y": rlx.InputSpec((4, 1))}
    loss = lambda m, x, y: rlx.mse_loss(m(x), y)  # noqa: E731
    with pytest.raises(rlx.InputError, match=r"precision must be one of \['fp32', 'bf16', 'fp16'\], got 'fp8'"):
        rlx.compile_train_step(loss, lin, rlx.optim.SGD(0.1), spec, precision="fp8")
    step = rlx.compile_train_step(loss, lin, rlx.optim.SGD(0.1), spec, precision="fp32")
    x, y = np.ones((4, 2), np.float32), np.zeros((4, 1), np.float32)
    first = step(x=x, y=y)
    assert step(x=x, y=y) < first


def test_ml_dtypes_is_imported_only_for_bfloat16():
    code = ("import sys, numpy as np, rlx\n"
            "g = rlx.Graph(); x = g.input('x', (2,), 'float16'); g.output(x.astype('float32'))\n"
            "g.compile('cpu').run(x=np.ones(2, np.float16))\n"
            "print('ml_dtypes' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_metal_compiles_int64_inputs_as_int32():
    """Metal has no int64 outputs: there an int64 input spec becomes int32 (fed int64 arrays are
    range-checked into it); the CPU and CUDA trace int64 (CUDA narrows it inside the program and
    range-checks fed arrays into its int32 slot, see tests/test_cuda.py)."""
    from rlx._compile import _device_specs

    specs = {"ids": rlx.InputSpec((2, 3), "int64"), "x": rlx.InputSpec((2,), "float32")}
    for device in ("cpu", "cuda", "cuda:1"):
        assert _device_specs(specs, device) is specs
    for device in ("metal",):
        got = _device_specs(specs, device)
        assert (got["ids"].shape, got["ids"].dtype) == ((2, 3), "int32")
        assert got["x"] is specs["x"]


def test_integer_means_and_variances_take_the_int32_path_where_a_gpu_narrows_integers():
    """On a GPU (a trace for a device computing integers in int32) the mean and variance of int64
    and bool tensors take the exact int32 path instead of float64 (which the GPU backends lack):
    the same values as numpy's, checked here on the CPU with such a trace."""
    rng = np.random.default_rng(3)
    ids = rng.integers(-50_000, 50_000, (4, 7)).astype(np.int64)
    mask = rng.random((4, 7)) > 0.3
    g = rlx.Graph()
    g._trace.int32_device = True  # as traced for cuda
    i, m = g.input("i", ids.shape, "int64"), g.input("m", mask.shape, "bool")
    g.output(i.mean(), i.mean(axis=1), m.mean(axis=0), i.var(axis=1), m.var())
    got = g.compile("cpu").run(i=ids, m=mask)
    want = [ids.mean(), ids.mean(axis=1), mask.mean(axis=0), ids.var(axis=1), mask.var()]
    for k, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == np.float32, k
        np.testing.assert_allclose(a, b, rtol=1e-6, err_msg=f"output {k}")
    native = g._trace.graph
    assert "float64" not in {native.dtype(k) for k in range(len(native))}
