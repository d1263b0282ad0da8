"""dense_matvec: y = x @ W.T (+ bias) for 1..32 rows of x over float and MLX affine weights; the
CUDA renderings on the CPU emulator (outputs NaN-poisoned) and on a GPU against fp32 reference
math, each row's bits those it has alone (row parity), and the dispatchers."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import kernel_emulator
import mlx.core as mx
import numpy as np
import pytest
from conftest import requires_gpu
from kernel_emulator import Emulated

import hf2q_mlx.custom_kernels as ck
from hf2q_mlx.custom_kernels import dense_matvec as D
from hf2q_mlx.custom_kernels._render import Example, Kernel, _norm_template
from hf2q_mlx.errors import InvalidArgumentError, WeightMismatchError

needs_gxx = pytest.mark.skipif(not kernel_emulator.available(), reason="g++ is not installed")
# fp32 x: the kernel sums the same fp32 products as the reference in another order (lanes, SIMD
# groups; per group scale * dot + bias * sum(x) for affine weights): ~sqrt(K) ulps of the
# largest partial sums, well under 1e-5 of the row's largest |output|.
FP32_TOL = 1e-5
NAN = float("nan")
_RAW = {2: mx.uint16, 4: mx.uint32}
_NAMES = {mx.float32: "f32", mx.float16: "f16", mx.bfloat16: "bf16"}


def _x(shape: tuple, dtype, seed: int) -> mx.array:
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)


@lru_cache(maxsize=4)
def _weight(n: int, k: int, dtype, seed: int) -> mx.array:
    """Random (N, K) rows scaled by K^-1/2: outputs about N(0, 1), fp16 in range; the last few
    kept (the GPU tests' weights are large)."""
    return (mx.random.normal((n, k), key=mx.random.key(seed)) * k**-0.5).astype(dtype)


@lru_cache(maxsize=4)
def _affine(n: int, k: int, dtype, gs: int, bits: int, seed: int) -> tuple[mx.array, ...]:
    """(codes, scales, biases) as mx.quantize leaves a float weight of ``dtype``; the last few
    kept (the GPU tests' weights are large)."""
    q = mx.quantize(_weight(n, k, dtype, seed), group_size=gs, bits=bits)
    mx.eval(q)
    return tuple(q)


def _ulp(v: np.ndarray, dtype) -> np.ndarray:
    """The spacing of ``dtype`` at |v| (bf16: 8 significant bits, fp16: 11, subnormals kept)."""
    mant, emin = {mx.bfloat16: (7, -126), mx.float16: (10, -14)}[dtype]
    _, e = np.frexp(np.abs(v))  # |v| = f 2^e, f in [0.5, 1)
    return np.ldexp(1.0, np.maximum(e - 1, emin) - mant)


def assert_close(out: mx.array, ref32: mx.array, dtype) -> None:
    """fp32 x: |out - ref| <= FP32_TOL x the row's largest |ref| (fp32 sums in another order).
    fp16 / bf16 x: within one unit of the output dtype at |ref| on top of that (the kernel's
    fp32 result rounded once: at most half a unit, twice that allowed)."""
    got = np.array(out.astype(mx.float32)).astype(np.float64)
    ref = np.array(ref32).astype(np.float64)
    assert out.dtype == dtype and got.shape == ref.shape
    assert not np.isnan(got).any(), "unwritten (poisoned) outputs"
    tol = FP32_TOL * np.abs(ref).max(axis=-1, keepdims=True)
    if dtype != mx.float32:
        tol = tol + _ulp(ref, dtype)
    err = np.abs(got - ref)
    worst = np.unravel_index(np.argmax(err / tol), err.shape)
    assert (err <= tol).all(), f"at {worst}: |error| {err[worst]:.3g} > {tol[worst]:.3g}"


def _bits(a: mx.array) -> np.ndarray:
    return np.array(a.view(_RAW[a.dtype.size]))


def _prebuild(items) -> None:
    """Compile the emulator binaries two at a time (g++ dominates the emulator tests)."""
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda ke: kernel_emulator.build(*ke), items))


# ---------------------------------------------------------------------------------------------
# Float weights on the emulator

# (x dtype, w dtype, bias dtype or None, R, W, tokens, N, K): every x dtype with every weight
# dtype once; N not a multiple of R (N < R once), K a few chunks, some lanes idle or with one
# chunk more than others
_FLOAT_CASES = [
    (mx.float32, mx.float32, mx.float32, 4, 2, 3, 13, 260),
    (mx.float32, mx.float16, None, 2, 1, 17, 9, 136),
    (mx.float32, mx.bfloat16, mx.float32, 1, 4, 1, 7, 1032),
    (mx.float16, mx.float32, None, 3, 1, 32, 11, 96),
    (mx.float16, mx.float16, mx.float16, 4, 8, 3, 3, 2056),
    (mx.float16, mx.bfloat16, mx.float16, 2, 2, 17, 5, 64),
    (mx.bfloat16, mx.float32, mx.bfloat16, 1, 1, 32, 3, 44),
    (mx.bfloat16, mx.float16, mx.float32, 4, 1, 1, 10, 512),
    (mx.bfloat16, mx.bfloat16, None, 4, 2, 32, 33, 264),
]
_FLOAT_IDS = [
    f"x{_NAMES[c[0]]}-w{_NAMES[c[1]]}-{'b' + _NAMES[c[2]] if c[2] else 'nobias'}-R{c[3]}W{c[4]}"
    f"-M{c[5]}" for c in _FLOAT_CASES
]  # fmt: skip


def _float_case(i: int):
    dt, wt, bt, _, _, m, n, k = _FLOAT_CASES[i]
    bias = None if bt is None else _x((n,), bt, seed=20 + i)
    return _x((m, k), dt, seed=i), _weight(n, k, wt, seed=10 + i), bias


def _float_example(x, w, bias, r: int) -> tuple[Kernel, Example]:
    launch, _ = D._float_launch(x, w, bias, {"W": 1, "R": r})
    bt = x.dtype if bias is None else bias.dtype
    ex = Example({"x": x.dtype, "w": w.dtype, "bias": bt, "dims": (mx.int32, 3)}, {"y": x.dtype},
                 dict(_norm_template(launch["template"])))  # fmt: skip
    return D._float_kernel, ex


@pytest.fixture(scope="module")
def float_emulated():
    if not kernel_emulator.available():
        pytest.skip("g++ is not installed")
    cases = [_float_case(i) for i in range(len(_FLOAT_CASES))]
    _prebuild([_float_example(*c, _FLOAT_CASES[i][3]) for i, c in enumerate(cases)])
    outs = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Kernel, "__call__", kernel_emulator.kernel_call)
        for i, (x, w, bias) in enumerate(cases):
            cfg = {"R": _FLOAT_CASES[i][3], "W": _FLOAT_CASES[i][4]}
            outs[i] = D.float_matvec_kernel(x, w, bias, init_value=NAN, config=cfg)
    return outs


@pytest.mark.parametrize("i", range(len(_FLOAT_CASES)), ids=_FLOAT_IDS)
def test_float_kernel_on_the_emulator(float_emulated, i):
    x, w, bias = _float_case(i)
    assert_close(
        float_emulated[i], D.float_matvec_reference(x.astype(mx.float32), w, bias), x.dtype
    )


# ---------------------------------------------------------------------------------------------
# MLX affine weights on the emulator

# (x dtype, scales dtype, bits, group size, bias dtype or None, R, W, tokens, N, K): both bit
# widths, every group size, scales in each dtype (once not x's); N not a multiple of R, K of
# 10..65 chunks (lanes idle at W = 4)
_AFFINE_CASES = [
    (mx.bfloat16, mx.bfloat16, 4, 64, mx.bfloat16, 4, 2, 3, 9, 320),
    (mx.float32, mx.float32, 8, 32, None, 2, 1, 17, 7, 544),
    (mx.float16, mx.float16, 4, 128, mx.float16, 1, 4, 32, 5, 1152),
    (mx.float32, mx.bfloat16, 4, 32, None, 4, 1, 1, 11, 2080),
    (mx.bfloat16, mx.bfloat16, 8, 128, mx.float32, 3, 2, 32, 10, 384),
]
_AFFINE_IDS = [
    f"x{_NAMES[c[0]]}-s{_NAMES[c[1]]}-q{c[2]}g{c[3]}-{'b' + _NAMES[c[4]] if c[4] else 'nobias'}"
    f"-R{c[5]}W{c[6]}-M{c[7]}" for c in _AFFINE_CASES
]  # fmt: skip


def _affine_case(i: int):
    dt, st, bits, gs, bt, _, _, m, n, k = _AFFINE_CASES[i]
    q = _affine(n, k, st, gs, bits, seed=30 + i)
    bias = None if bt is None else _x((n,), bt, seed=50 + i)
    return _x((m, k), dt, seed=40 + i), q, bias


def _affine_example(x, q, bias, gs: int, bits: int, r: int) -> tuple[Kernel, Example]:
    launch, _ = D._affine_launch(x, q[0], gs, bits, bias, {"W": 1, "R": r})
    bt = x.dtype if bias is None else bias.dtype
    ex = Example({"x": x.dtype, "wq": mx.uint32, "sc": q[1].dtype, "bi": q[2].dtype, "bias": bt,
                  "dims": (mx.int32, 3)}, {"y": x.dtype},
                 dict(_norm_template(launch["template"])))  # fmt: skip
    return D._affine_kernel, ex


@pytest.fixture(scope="module")
def affine_emulated():
    if not kernel_emulator.available():
        pytest.skip("g++ is not installed")
    cases = [_affine_case(i) for i in range(len(_AFFINE_CASES))]
    _prebuild([_affine_example(*cs, c[3], c[2], c[5]) for cs, c in zip(cases, _AFFINE_CASES)])
    outs = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Kernel, "__call__", kernel_emulator.kernel_call)
        for i, (x, q, bias) in enumerate(cases):
            _, _, bits, gs, _, r, w, *_ = _AFFINE_CASES[i]
            outs[i] = D.affine_matvec_kernel(x, *q, gs, bits, bias, init_value=NAN,
                                             config={"R": r, "W": w})  # fmt: skip
    return outs


@pytest.mark.parametrize("i", range(len(_AFFINE_CASES)), ids=_AFFINE_IDS)
def test_affine_kernel_on_the_emulator(affine_emulated, i):
    x, q, bias = _affine_case(i)
    _, _, bits, gs, *_ = _AFFINE_CASES[i]
    ref = D.affine_matvec_reference(x.astype(mx.float32), *q, gs, bits, bias)
    assert_close(affine_emulated[i], ref, x.dtype)


# ---------------------------------------------------------------------------------------------
# Row parity on the emulator: a row's bits are those it has alone, whatever the launch's rows

_PARITY_ROWS = (2, 3, 17, 32)


@needs_gxx
@pytest.mark.parametrize("kind", ["float", "affine"])
def test_row_parity_on_the_emulator(kind, float_emulated, affine_emulated, monkeypatch):
    """B = 2, 3, 17, 32 rows of x in one launch: row r's output bits are its bits at B = 1
    (_FLOAT_CASES[8] / _AFFINE_CASES[4]: their instantiations, 32 rows, bf16 x)."""
    monkeypatch.setattr(Kernel, "__call__", kernel_emulator.kernel_call)
    if kind == "float":
        x, w, bias = _float_case(8)
        cfg = {"R": _FLOAT_CASES[8][3], "W": _FLOAT_CASES[8][4]}

        def run(rows):
            return D.float_matvec_kernel(rows, w, bias, init_value=NAN, config=cfg)
    else:
        x, q, bias = _affine_case(4)
        _, _, bits, gs, _, r, wg, *_ = _AFFINE_CASES[4]

        def run(rows):
            return D.affine_matvec_kernel(rows, *q, gs, bits, bias, init_value=NAN,
                                          config={"R": r, "W": wg})  # fmt: skip

    assert x.shape[0] == 32
    alone = np.concatenate([_bits(run(x[j : j + 1])) for j in range(32)])
    for b in _PARITY_ROWS:
        assert np.array_equal(_bits(run(x[:b])), alone[:b]), b


# ---------------------------------------------------------------------------------------------
# Dispatchers


def test_dispatchers_take_the_reference_without_a_gpu():
    """The CPU (no back end): the references' bits, batch dims kept."""
    x, w, bias = _float_case(2)
    x = x.reshape(1, 1, -1)
    xa, q, abias = _affine_case(3)
    with mx.stream(mx.cpu):
        assert ck.backend() is None
        y = D.float_matvec(x, w, bias)
        assert y.shape == (1, 1, w.shape[0])
        assert mx.array_equal(y, D.float_matvec_reference(x, w, bias))
        ya = D.affine_matvec(xa, *q, 32, 4, abias)
        assert mx.array_equal(ya, D.affine_matvec_reference(xa, *q, 32, 4, abias))


def test_launch_shape():
    """From K and N only; long K: more SIMD groups, short N: fewer rows per threadgroup."""
    assert D.launch_shape(5376, 8192, 8) == {"W": 4, "R": 4}  # Gemma-4-31B q/o, gate/up rows
    assert D.launch_shape(21504, 5376, 8) == {"W": 8, "R": 4}  # its down projection
    assert D.launch_shape(2816, 262144, 8) == {"W": 2, "R": 4}  # a dense lm_head
    assert D.launch_shape(2048, 256, 8) == {"W": 8, "R": 1}  # short N: every lane one chunk
    for k, n, c in ((5376, 1024, 8), (2048, 2048, 4), (21504, 5376, 32), (96, 7, 16)):
        s = D.launch_shape(k, n, c)
        assert s["W"] in (1, 2, 4, 8) and s["R"] in (1, 2, 4)
        assert s["W"] == 1 or k // c >= 32 * s["W"]  # no SIMD group without a chunk


@needs_gxx
def test_float_dispatcher_on_the_emulator(float_emulated, monkeypatch):
    """1..32 rows: one launch at launch_shape's (W, R) (batch dims kept, the plan cached: the
    same bits on repeat); 33 rows or K not a multiple of the chunk: the reference; caller errors
    raise ours."""
    _, w, bias = _float_case(2)  # f32 x, bf16 w, f32 bias: launch_shape gives its R = 1
    n, k = w.shape
    assert D.launch_shape(k, n, 8)["R"] == _FLOAT_CASES[2][3]
    emu = Emulated(D._float_kernel)
    monkeypatch.setattr(D, "_float_kernel", emu)
    monkeypatch.setattr(D, "backend", lambda: "cuda")
    monkeypatch.setattr(D, "_CALLS", {})
    xs = _x((2, 3, k), mx.float32, seed=60)
    y = D.float_matvec(xs, w, bias)
    assert emu.launches == 1 and y.shape == (2, 3, n)
    assert_close(y, D.float_matvec_reference(xs, w, bias), mx.float32)
    assert mx.array_equal(D.float_matvec(xs, w, bias), y)
    assert emu.launches == 2 and len(D._CALLS) == 1
    x33 = _x((33, k), mx.float32, seed=61)
    assert mx.array_equal(D.float_matvec(x33, w, bias), D.float_matvec_reference(x33, w, bias))
    w12 = _weight(n, 12, mx.bfloat16, seed=62)  # 12 bf16: one and a half chunks
    x12 = _x((2, 12), mx.float32, seed=63)
    assert mx.array_equal(D.float_matvec(x12, w12), D.float_matvec_reference(x12, w12))
    assert emu.launches == 2
    with pytest.raises(WeightMismatchError):
        D.float_matvec(xs[..., :-8], w, bias)
    with pytest.raises(WeightMismatchError):
        D.float_matvec(xs, w, bias[:-1])
    with pytest.raises(InvalidArgumentError):
        D.float_matvec(xs.astype(mx.int32), w)
    with pytest.raises(InvalidArgumentError):
        D.float_matvec(xs, w.astype(mx.uint8))
    with pytest.raises(InvalidArgumentError):
        D.float_matvec(xs, w, bias.astype(mx.int32))
    with pytest.raises(InvalidArgumentError):
        D.float_matvec(xs, w[None])


@needs_gxx
def test_affine_dispatcher_on_the_emulator(affine_emulated, monkeypatch):
    """As the float dispatcher: one launch for 1..32 rows, the reference for 33 rows and 2-bit
    codes; caller errors raise ours."""
    dt, _, bits, gs, *_ = _AFFINE_CASES[2]  # f16 x and scales, q4 g128, f16 bias: R = 1
    _, q, bias = _affine_case(2)
    n, k = q[0].shape[0], q[0].shape[1] * 32 // bits
    assert D.launch_shape(k, n, 128 // bits)["R"] == _AFFINE_CASES[2][5]
    emu = Emulated(D._affine_kernel)
    monkeypatch.setattr(D, "_affine_kernel", emu)
    monkeypatch.setattr(D, "backend", lambda: "cuda")
    monkeypatch.setattr(D, "_CALLS", {})
    xs = _x((4, 8, k), dt, seed=70)
    y = D.affine_matvec(xs, *q, gs, bits, bias)
    assert emu.launches == 1 and y.shape == (4, 8, n)
    ref = D.affine_matvec_reference(xs.astype(mx.float32), *q, gs, bits, bias)
    assert_close(y, ref, dt)
    assert mx.array_equal(D.affine_matvec(xs, *q, gs, bits, bias), y)
    assert emu.launches == 2 and len(D._CALLS) == 1
    x33 = _x((33, k), dt, seed=71)
    want = D.affine_matvec_reference(x33, *q, gs, bits, bias)
    assert mx.array_equal(D.affine_matvec(x33, *q, gs, bits, bias), want)
    q2 = _affine(n, k, mx.float16, gs, 2, seed=72)
    want = D.affine_matvec_reference(xs, *q2, gs, 2, bias)
    assert mx.array_equal(D.affine_matvec(xs, *q2, gs, 2, bias), want)
    assert emu.launches == 2
    with pytest.raises(WeightMismatchError):
        D.affine_matvec(xs[..., :-128], *q, gs, bits, bias)
    with pytest.raises(WeightMismatchError):
        D.affine_matvec(xs, q[0], q[1][:, :-1], q[2], gs, bits, bias)
    with pytest.raises(WeightMismatchError):
        D.affine_matvec(xs, *q, gs, bits, bias[:-1])
    with pytest.raises(InvalidArgumentError):
        D.affine_matvec(xs, *q, gs, 7, bias)
    with pytest.raises(InvalidArgumentError):
        D.affine_matvec(xs, q[0].astype(mx.int32), q[1], q[2], gs, bits, bias)
    with pytest.raises(InvalidArgumentError):
        D.affine_matvec(xs, q[0], q[1], None, gs, bits, bias)


# ---------------------------------------------------------------------------------------------
# GPU: real shapes, outputs poisoned; references on the CPU

# (N, K): odd tiny; Gemma-4-31B's q (8192 x 5376) and down (5376 x 21504); an lm_head's K with
# an eighth of its 262144 rows (the launch shape of the full one)
GPU_SHAPES = [(13, 1032), (8192, 5376), (5376, 21504), (32768, 2816)]
# affine: K a multiple of every group size (1152 = 9 x 128)
AFFINE_GPU_SHAPES = [(13, 1152), *GPU_SHAPES[1:]]
_DTYPES = [mx.float32, mx.float16, mx.bfloat16]
_DT_IDS = ["f32", "f16", "bf16"]


def _cpu_ref(fn, *args) -> mx.array:
    with mx.stream(mx.cpu):
        out = fn(*args)
        mx.eval(out)
    return out


@requires_gpu
@pytest.mark.parametrize("n,k", GPU_SHAPES, ids=str)
@pytest.mark.parametrize("wt", _DTYPES, ids=_DT_IDS)
@pytest.mark.parametrize("dt", _DTYPES, ids=_DT_IDS)
@pytest.mark.parametrize("m", [1, 32])
def test_gpu_float_kernel_matches_reference(m, dt, wt, n, k):
    x, w = _x((m, k), dt, seed=m + n), _weight(n, k, wt, seed=n + k)
    bias = _x((n,), dt, seed=n) if m == 32 else None
    out = D.float_matvec_kernel(x, w, bias, init_value=NAN)
    mx.eval(out)
    assert_close(out, _cpu_ref(D.float_matvec_reference, x.astype(mx.float32), w, bias), dt)


@requires_gpu
@pytest.mark.parametrize("n,k", AFFINE_GPU_SHAPES, ids=str)
@pytest.mark.parametrize("bits,gs", [(4, 64), (8, 64), (4, 32), (8, 128)],
                         ids=["q4g64", "q8g64", "q4g32", "q8g128"])  # fmt: skip
@pytest.mark.parametrize("dt", _DTYPES, ids=_DT_IDS)
@pytest.mark.parametrize("m", [1, 32])
def test_gpu_affine_kernel_matches_reference(m, dt, bits, gs, n, k):
    x, q = _x((m, k), dt, seed=m + n), _affine(n, k, dt, gs, bits, seed=n + k)
    bias = _x((n,), dt, seed=n) if m == 32 else None
    out = D.affine_matvec_kernel(x, *q, gs, bits, bias, init_value=NAN)
    mx.eval(out)
    ref = _cpu_ref(D.affine_matvec_reference, x.astype(mx.float32), *q, gs, bits, bias)
    assert_close(out, ref, dt)


@requires_gpu
@pytest.mark.parametrize("n,k", [(8192, 5376), (262144, 2816)], ids=["q-proj", "lm-head"])
@pytest.mark.parametrize("kind", ["bf16", "q4g64"])
@pytest.mark.parametrize("dt", [mx.float32, mx.bfloat16], ids=["f32", "bf16"])
def test_gpu_row_parity(dt, kind, n, k):
    """Through the dispatchers: rows 0, 7 and 31 alone, and every row of B = 2, 5, 17, have the
    bits they have in a launch of 32 rows."""
    x = _x((32, k), dt, seed=k)
    if kind == "bf16":
        w = _weight(n, k, mx.bfloat16, seed=n)

        def run(rows):
            return _bits(D.float_matvec(rows, w))
    else:
        q = _affine(n, k, mx.bfloat16, 64, 4, seed=n)

        def run(rows):
            return _bits(D.affine_matvec(rows, *q, 64, 4))

    assert ck.backend() is not None
    batch = run(x)
    for j in (0, 7, 31):
        assert np.array_equal(run(x[j : j + 1]), batch[j : j + 1]), j
    for b in (2, 5, 17):
        assert np.array_equal(run(x[:b]), batch[:b]), b
