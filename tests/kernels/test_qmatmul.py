"""ggml_matmul: the dispatcher and reference on the CPU, the kernel logic through the CPU emulator,
and the GPU kernel against an fp32 CPU reference over types x dtypes x M x odd shapes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import kernel_emulator
import mlx.core as mx
import numpy as np
import pytest
from conftest import requires_gpu
from gguf import GGMLQuantizationType as T

from hf2q_mlx.custom_kernels import dequant as D
from hf2q_mlx.custom_kernels import qmatmul as Q
from hf2q_mlx.custom_kernels import qmatmul_tuning, reference_only
from hf2q_mlx.custom_kernels._render import Example, Kernel
from hf2q_mlx.custom_kernels.dequant import dequantize_reference
from hf2q_mlx.custom_kernels.ggml_formats import BLOCK_FORMATS
from hf2q_mlx.errors import InvalidArgumentError, UnsupportedQuantTypeError, WeightMismatchError
from hf2q_mlx.io.random_weights import random_ggml_blocks

TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
DTYPES = [mx.float32, mx.float16, mx.bfloat16]
QK = {t: BLOCK_FORMATS[t].block_size for t in TYPES}
# fp32: the kernel and the reference sum the same exact products in a different order; over
# K <= 4352 terms that moves the result by ~sqrt(K) fp32 ulps, far below 2e-5 of its norm.
FP32_TOL = 2e-5
# ... and every output within 1e-5 of the largest one (the kernel on the emulator, every type at
# M = 1..16: <= 3.1e-7 at K = 352 / 768, <= 1.5e-6 at K = 4352). Any fp16-level rounding (fp16
# products or sums, TF32 matmuls: 10-bit mantissas, unit roundoff 2^-11) shows as 1e-4 or more.
FP32_MAX_TOL = 1e-5
# The packed fp16 kernels (V = 1, fp16 x) round each product and each partial sum of a group
# (GS / 2 = 4 or 2 fmas per lane) to fp16 before the fp32 accumulation: about 2-3 fp16
# roundings per weight on top of the output's one, all independent, so their error is a small
# multiple of the dtype's own: they may err up to H2_FACTOR times the reference in fp16, or
# H2_FLOOR (two fp16 unit roundoffs, 2 * 2^-11) where few outputs make that reference's error
# itself small by chance (7 rows: measured 8e-5 against the usual 2e-4).
H2_FACTOR = 4
H2_FLOOR = 2 * 2.0**-11

_W_CACHE: dict = {}


def _weight(ggml_type: int, n: int, k: int) -> tuple[mx.array, mx.array]:
    """Random valid blocks (fixed seed per case) and their fp32 dequantization, on the CPU."""
    key = (ggml_type, n, k)
    if key not in _W_CACHE:
        w = random_ggml_blocks(n, k, ggml_type, seed=n * 31 + k + int(ggml_type))
        with mx.stream(mx.cpu):
            wf = dequantize_reference(w, ggml_type, k)
        mx.eval(w, wf)
        _W_CACHE[key] = (w, wf)
    return _W_CACHE[key]


def _x(m: int, k: int, dtype: mx.Dtype, seed: int) -> mx.array:
    return mx.random.normal((m, k), key=mx.random.key(seed)).astype(dtype)


def _check(out: mx.array, x: mx.array, wf: mx.array, h2: bool = False) -> None:
    """Relative error (Frobenius) against fp32 math on the same inputs, computed on the CPU.

    fp32: also every output within FP32_MAX_TOL of the largest reference output (float64).
    fp16/bf16: at most twice the error of the reference computed in that dtype (fp32 math on
    the same rounded inputs, output rounded to the dtype), floored at the fp32 tolerance; for the
    packed fp16 kernels (``h2``) H2_FACTOR times that error, floored at H2_FLOOR.
    """
    assert out.dtype == x.dtype and out.shape == (x.shape[0], wf.shape[0])
    with mx.stream(mx.cpu):
        ref32 = x.astype(mx.float32) @ wf.T
        o = out.astype(mx.float32)
        assert not bool(mx.isnan(o).any()), "unwritten (NaN-poisoned) or NaN outputs"
        norm = float(mx.linalg.norm(ref32)) or 1.0
        err = float(mx.linalg.norm(o - ref32)) / norm
        tol = FP32_TOL
        # an output past the dtype's range would make both errors inf and the check vacuous
        assert bool(mx.isfinite(ref32.astype(x.dtype)).all()), "test data overflows the dtype"
        if x.dtype != mx.float32:
            err_ref = float(mx.linalg.norm(ref32.astype(x.dtype).astype(mx.float32) - ref32)) / norm
            tol = max(2 * err_ref, FP32_TOL)
            if h2:
                tol = max(H2_FACTOR * err_ref, H2_FLOOR)
    assert err <= tol, f"relative error {err:.3g} > {tol:.3g}"
    if x.dtype == mx.float32:
        err_max = _max_rel(out, x, wf)
        assert err_max <= FP32_MAX_TOL, f"error {err_max:.3g} of the largest output"


def _max_rel(out: mx.array, x: mx.array, wf: mx.array) -> float:
    """max |out - x @ wf.T| / max |x @ wf.T|, the reference in float64."""
    ref = np.array(x.astype(mx.float32), dtype=np.float64) @ np.array(wf, dtype=np.float64).T
    o = np.array(out.astype(mx.float32), dtype=np.float64).reshape(ref.shape)
    return float(np.abs(o - ref).max() / (np.abs(ref).max() or 1.0))


# ---------------------------------------------------------------------------------------------
# CPU: reference path and caller errors


def test_dispatcher_uses_the_reference_on_cpu_and_keeps_batch_dims():
    w, _ = _weight(T.Q4_K, 5, 512)
    x = mx.random.normal((2, 3, 512), key=mx.random.key(1))
    with reference_only():
        y = Q.ggml_matmul(x, w, T.Q4_K, 512)
    ref = Q.ggml_matmul_reference(x, w, T.Q4_K, 512)
    assert y.shape == (2, 3, 5) and bool(mx.array_equal(y, ref))


def test_reference_matches_numpy_on_gguf_dequant():
    """The oracle itself: fp32 x @ dequant(W).T, with W from gguf-py's dequantizer."""
    from gguf.quants import dequantize

    w, _ = _weight(T.Q6_K, 7, 512)
    x = np.random.default_rng(0).normal(size=(3, 512)).astype(np.float32)
    wf = dequantize(np.array(w), T.Q6_K).reshape(7, 512)
    with mx.stream(mx.cpu):
        y = np.array(Q.ggml_matmul_reference(mx.array(x), w, T.Q6_K, 512))
    np.testing.assert_allclose(y, x @ wf.T, rtol=1e-5, atol=1e-5)


def test_dequant_chunks_are_aligned_rows_covering_w():
    """The many-rows path's chunks: whole multiples of _DEQ_ROW_ALIGN rows (an odd chunk is an
    odd GEMM leading dimension), about _DEQ_CHUNK elements, all of W in one when it fits."""
    align = Q._DEQ_ROW_ALIGN
    for n, k in [(16384, 5376), (43008, 5376), (5376, 21504), (5376, 8192), (300, 1 << 20)]:
        rows = Q.deq_chunk_rows(n, k)
        assert rows == n or rows % align == 0
        assert rows * k <= max(Q._DEQ_CHUNK, align * k)
        assert rows == n or (rows + align) * k > Q._DEQ_CHUNK  # no smaller than it needs be
    assert Q.deq_chunk_rows(4096, 4096) == 4096  # 16M elements: one chunk


def test_dequant_chunks_concatenate_to_the_reference(monkeypatch):
    """_ggml_matmul_dequant over several chunks (the last one short), the dequantizer swapped
    for the reference one on the CPU: each output column comes from its own row of W (fp32
    math, same order of sums as the oracle: 1e-5)."""
    n, k = 700, 512
    w, _ = _weight(T.Q4_K, n, k)
    x = mx.random.normal((70, k), key=mx.random.key(3))
    monkeypatch.setattr(Q, "_DEQ_CHUNK", 300 * k)  # aligned down: 256, 256, 188
    monkeypatch.setattr(
        Q, "ggml_dequantize_kernel", lambda wr, t, kk, dt: dequantize_reference(wr, t, kk)
    )
    calls = []
    real = Q.mx.concatenate
    monkeypatch.setattr(
        Q.mx,
        "concatenate",
        lambda parts, axis: calls.append([p.shape[-1] for p in parts]) or real(parts, axis=axis),
    )
    with mx.stream(mx.cpu):
        y = Q._ggml_matmul_dequant(x, w, T.Q4_K, k)
        ref = Q.ggml_matmul_reference(x, w, T.Q4_K, k)
        assert [256, 256, 188] in calls and y.shape == (70, n)
        np.testing.assert_allclose(np.array(y), np.array(ref), rtol=1e-5, atol=1e-5)


def test_caller_errors():
    w, _ = _weight(T.Q4_0, 4, 256)
    with pytest.raises(WeightMismatchError):  # x has the wrong number of features
        Q.ggml_matmul(mx.zeros((1, 128)), w, T.Q4_0, 256)
    with pytest.raises(WeightMismatchError):  # row bytes do not match in_features
        Q.ggml_matmul(mx.zeros((1, 512)), w, T.Q4_0, 512)
    with pytest.raises(WeightMismatchError):  # K not a multiple of the block
        Q.ggml_matmul(mx.zeros((1, 100)), w, T.Q4_0, 100)
    with pytest.raises(UnsupportedQuantTypeError):
        Q.ggml_matmul(mx.zeros((1, 256)), w, 9999, 256)


def test_launch_config():
    for t in TYPES:
        for m in (1, 2, 3, 5, 9, 16):
            cfg = Q.launch_config(t, m, 4096, 4096)
            assert cfg["MT"] >= m and cfg["MT"] in (1, 2, 4, 8, 16)
            assert 1 <= cfg["W"] <= 8 and cfg["R"] * cfg["MT"] <= Q.MAX_ACC
            for dt in DTYPES:  # M > 1 changes R only: V, U, W fix a column's operations
                one, many = (Q.launch_config(t, mm, 4096, 2816, dt) for mm in (1, m))
                assert {k: many[k] for k in "VUW"} == {k: one[k] for k in "VUW"}, (t, m, dt)
            assert cfg["V"] in Q.VARIANTS
            # the packed fp16 variant is for fp16 x only; V = 2 (bf16 x) only where an H200
            # sweep put it in BF16_DEFAULTS (Q4_0, Q4_K)
            for k in (4096, 14336):
                v2 = (t.name, k >= 8192) in qmatmul_tuning.BF16_DEFAULTS
                assert Q.launch_config(t, m, 4096, k, mx.bfloat16)["V"] == (2 if v2 else 0)
                assert Q.launch_config(t, m, 4096, k, mx.float32)["V"] == 0
                assert Q.launch_config(t, m, 4096, k, mx.float16)["V"] in (0, 1)
    # K-quant rows of 4096 are 2 steps of 8 blocks (Q4_K): no more SIMD groups than steps
    assert Q.launch_config(T.Q4_K, 1, 4096, 4096)["W"] <= 2
    assert Q.launch_config(T.Q4_K, 1, 4096, 4096, mx.bfloat16)["V"] == 2
    assert Q.launch_config(T.Q6_K, 1, 4096, 4096, mx.bfloat16)["V"] == 0


def test_bf16_defaults_hook(monkeypatch):
    """One BF16_DEFAULTS line switches bf16 x (only) to V = 2, by type or by block family."""
    monkeypatch.setattr(
        qmatmul_tuning, "BF16_DEFAULTS", {("32", True): (2, 4, 1, 8), ("Q4_K", False): (2, 4, 2, 4)}
    )
    assert Q.launch_config(T.Q4_0, 1, 4096, 14336, mx.bfloat16) == {
        "V": 2,
        "MT": 1,
        "R": 4,
        "U": 1,
        "W": 8,
    }
    assert Q.launch_config(T.Q4_K, 1, 4096, 4096, mx.bfloat16)["V"] == 2
    assert Q.launch_config(T.Q4_0, 1, 4096, 4096, mx.bfloat16)["V"] == 0
    assert Q.launch_config(T.Q4_K, 1, 4096, 14336, mx.bfloat16)["V"] == 0
    for dt in (mx.float16, mx.float32):
        assert Q.launch_config(T.Q4_0, 1, 4096, 14336, dt)["V"] != 2


def test_packed_variants_take_their_dtype_only():
    w, _ = _weight(T.Q4_0, 4, 256)
    for v, dt in ((1, mx.bfloat16), (1, mx.float32), (2, mx.float16), (2, mx.float32)):
        with pytest.raises(ValueError):
            Q._plan(T.Q4_0, 1, 4, 256, dt, {"V": v, "MT": 1, "R": 1, "U": 1, "W": 1})
    with pytest.raises(ValueError):
        Q._plan(T.Q4_0, 1, 4, 256, mx.float16, {"V": 3, "MT": 1, "R": 1, "U": 1, "W": 1})


# ---------------------------------------------------------------------------------------------
# CPU emulator: the CUDA rendering's logic for every type, a few configurations

# (type, dtype, M, N, K, config or None)
_EMU_CASES = [(t, mx.float32, 1, 7, 768 if QK[t] == 256 else 352, None) for t in TYPES] + [
    (T.Q4_0, mx.float16, 5, 9, 256, None),
    (T.Q6_K, mx.bfloat16, 16, 3, 512, None),
    (T.Q4_K, mx.float16, 3, 5, 2304, {"MT": 4, "R": 3, "U": 2, "W": 3}),
    (T.Q5_0, mx.bfloat16, 2, 6, 800, {"MT": 2, "R": 2, "U": 3, "W": 2}),
    # several runs per SIMD group: both prefetch buffers and the loop's exits
    (T.Q4_0, mx.float32, 2, 5, 1792, {"MT": 2, "R": 2, "U": 1, "W": 1}),
    (T.Q6_K, mx.float16, 1, 3, 1792, {"MT": 1, "R": 1, "U": 1, "W": 2}),
    (T.Q4_K, mx.bfloat16, 3, 3, 10240, {"MT": 4, "R": 1, "U": 1, "W": 1}),
]
# The packed fp16 variant (V = 1) for every type, then odd configurations and M > 1.
_H2 = {"V": 1, "MT": 1, "R": 2, "U": 2, "W": 2}
_EMU_CASES += [(t, mx.float16, 1, 7, 1280 if QK[t] == 256 else 352, _H2) for t in TYPES] + [
    (T.Q4_0, mx.float16, 5, 9, 256, {"V": 1, "MT": 8, "R": 1, "U": 3, "W": 1}),
    (T.Q4_K, mx.float16, 3, 5, 2304, {"V": 1, "MT": 4, "R": 3, "U": 1, "W": 3}),
    (T.Q8_0, mx.float16, 1, 5, 1792, {"V": 1, "MT": 1, "R": 4, "U": 4, "W": 1}),
    # R = 8 with rows past N (13 rows: the second threadgroup re-reads row 12 three times)
    (T.Q4_1, mx.float16, 1, 13, 512, {"V": 1, "MT": 1, "R": 8, "U": 1, "W": 4}),
]
# The packed fp16 loop on bf16 x (V = 2) for every type, then M > 1, a partial last run and
# rows past N. Checked at the standard bf16 bound (twice the bf16-rounded reference's error),
# not H2_FACTOR: its fp16 roundings (2^-11 each, after an exact scaled conversion of x) sit four
# times under the output's bf16 rounding (2^-9), so they barely add to the reference's error.
_H2BF = {"V": 2, "MT": 1, "R": 2, "U": 2, "W": 2}
_EMU_CASES += [(t, mx.bfloat16, 1, 7, 1280 if QK[t] == 256 else 352, _H2BF) for t in TYPES] + [
    (T.Q4_K, mx.bfloat16, 3, 5, 2304, {"V": 2, "MT": 4, "R": 3, "U": 1, "W": 3}),
    (T.Q8_0, mx.bfloat16, 5, 13, 1792, {"V": 2, "MT": 8, "R": 2, "U": 3, "W": 2}),
]
# The bf16 defaults (BF16_DEFAULTS, V = 2) as launch_config resolves them at M = 1, short and
# long rows: the configurations the models run.
_EMU_CASES += [(t, mx.bfloat16, 1, 11, k, None) for t in (T.Q4_0, T.Q4_K) for k in (2048, 14336)]
# fp32 x at M = 2..16 (issue 15: fp32 x must keep fp32 accuracy at every M): the default launch
# of each type at one M of the grid, every M in both block families (the MT loop is the same
# code for every type; one binary per case keeps the g++ time down); N = 13 leaves the last
# threadgroup's rows past N, K a partial last step (13 blocks / 5 super-blocks).
_M_GRID = (2, 3, 5, 8, 16)
_EMU_CASES += [
    (t, mx.float32, _M_GRID[(i + i // 5) % 5], 13, 1280 if QK[t] == 256 else 416, None)
    for i, t in enumerate(TYPES)
]


_emu_call = kernel_emulator.kernel_call
_emu_launcher = kernel_emulator.kernel_launcher


def _emu_example(case) -> tuple[Kernel, Example]:
    """The instantiation ggml_matmul_kernel will ask for, so it can be built ahead."""
    t, dt, m, n, k, cfg = case
    cfg = cfg or Q.launch_config(t, m, n, k, dt)
    rb = Q.row_bytes(t, k)
    ex = Example(
        {"x": (dt, m * k), "w": (mx.uint8, n * rb), "dims": (mx.int32, 3)},
        {"out": dt},
        {"T": dt, "MT": cfg["MT"], "R": cfg["R"], "U": cfg["U"]},
    )
    return Q._KERNELS[(t, cfg.get("V", 0))], ex


@pytest.fixture(scope="module")
def emulated():
    """Build the emulator binaries two at a time (g++ dominates), then run every case."""
    if not kernel_emulator.available():
        pytest.skip("g++ is not installed")
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda c: kernel_emulator.build(*_emu_example(c)), _EMU_CASES))
    mp = pytest.MonkeyPatch()
    mp.setattr(Kernel, "__call__", _emu_call)
    try:
        outs = {}
        for i, (t, dt, m, n, k, cfg) in enumerate(_EMU_CASES):
            w, _ = _weight(t, n, k)
            outs[i] = Q.ggml_matmul_kernel(_x(m, k, dt, i), w, t, k, config=cfg)
    finally:
        mp.undo()
    return outs


@pytest.mark.parametrize("i", range(len(_EMU_CASES)))
def test_kernel_logic_on_the_emulator(emulated, i):
    t, dt, m, n, k, cfg = _EMU_CASES[i]
    h2 = (cfg or Q.launch_config(t, m, n, k, dt)).get("V") == 1
    _check(emulated[i], _x(m, k, dt, i), _weight(t, n, k)[1], h2)


def _wide_x(wf: mx.array, m: int, seed: int) -> mx.array:
    """bf16 x (m, K) of magnitudes far outside fp16's range, row by row:
    0 normal values with some tiny ones (1e-30, bf16 subnormals); 1 all tiny (1e-30 scale);
    2 a few 1e6 among normal values; 3 one value near bf16's largest (scaled so the outputs stay
    finite) among normal and tiny ones, in one group with them; 4 every 1/4 of the values 1e30,
    the rest normal, signs mixed; more rows repeat the pattern, with other values."""
    k = wf.shape[1]
    rng = np.random.default_rng(seed)
    big = min(3e38, 1e38 / float(mx.abs(wf[:, 1]).max()))  # every output stays finite in bf16
    rows = []
    for i in range(m):
        r = rng.normal(size=k)
        kind = i % 5
        if kind == 0:
            r[rng.random(k) < 0.2] *= 1e-30
            r[3] = 1e-39  # a bf16 subnormal
        elif kind == 1:
            r *= 1e-30
        elif kind == 2:
            r[rng.choice(k, 5, replace=False)] = 1e6 * rng.choice([-1, 1], 5)
        elif kind == 3:
            r[1] = big  # x[0..3] share lane 0's first group in every type
            r[2] = 1e-35
        else:
            r[rng.random(k) < 0.25] *= 1e30
        rows.append(r)
    return mx.array(np.array(rows, dtype=np.float32)).astype(mx.bfloat16)


_WIDE_CASES = [  # (type, M, N, K, config): per type family, the widest fp16 group sums
    (T.Q8_0, 5, 7, 352, {"V": 2, "MT": 8, "R": 2, "U": 2, "W": 2}),
    (T.Q4_K, 5, 7, 1280, {"V": 2, "MT": 8, "R": 2, "U": 2, "W": 2}),
    (T.Q6_K, 5, 7, 1280, {"V": 2, "MT": 8, "R": 2, "U": 2, "W": 2}),
]


def _check_rows(out: mx.array, x: mx.array, wf: mx.array) -> None:
    """_check's bf16 rule row by row of x, in float64 (squares of 1e37 overflow fp32): each
    row's outputs within twice the error of the fp32 result rounded to bf16, all finite."""
    assert bool(mx.isfinite(out).all()), "non-finite outputs (an fp16 group sum overflowed?)"
    o = np.array(out.astype(mx.float32), dtype=np.float64)
    ref = np.array(x.astype(mx.float32), dtype=np.float64) @ np.array(wf, dtype=np.float64).T
    ref_bf = np.array(mx.array(ref.astype(np.float32)).astype(mx.bfloat16).astype(mx.float32))
    assert np.isfinite(ref_bf).all(), "test data overflows bf16"
    for i in range(x.shape[0]):
        norm = np.linalg.norm(ref[i]) or 1.0
        err = np.linalg.norm(o[i] - ref[i]) / norm
        tol = max(2 * np.linalg.norm(ref_bf[i] - ref[i]) / norm, FP32_TOL)
        assert err <= tol, f"row {i}: relative error {err:.3g} > {tol:.3g}"


@pytest.mark.skipif(not kernel_emulator.available(), reason="g++ is not installed")
@pytest.mark.parametrize("case", _WIDE_CASES, ids=lambda c: T(c[0]).name)
def test_h2bf_range_on_the_emulator(case, monkeypatch):
    """V = 2 over bf16's whole range: x from 1e-39 to ~1e37 (3e38 where the weights allow),
    mixed inside one group: every output finite and within the bf16 bound, row by row."""
    t, m, n, k, cfg = case
    monkeypatch.setattr(Kernel, "__call__", _emu_call)
    w, wf = _weight(t, n, k)
    x = _wide_x(wf, m, seed=int(t))
    _check_rows(Q.ggml_matmul_kernel(x, w, t, k, config=cfg), x, wf)


# ---------------------------------------------------------------------------------------------
# GPU: every type x dtype x M x shape, output poisoned with NaN


SHAPES = [(1, 4352), (7, 256), (257, 512), (4099, 2816)]  # (N rows out, K in)


@requires_gpu
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("ggml_type", TYPES, ids=[t.name for t in TYPES])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 16, 33])
def test_gpu_kernel_matches_reference(m, dtype, ggml_type, n, k):
    w, wf = _weight(ggml_type, n, k)
    x = _x(m, k, dtype, seed=m * 7 + n)
    if m <= 16:
        out = Q.ggml_matmul_kernel(x, w, ggml_type, k, init_value=float("nan"))
    else:  # past the kernel's rows: the dispatcher's many-rows path
        out = Q.ggml_matmul(x, w, ggml_type, k)
    mx.eval(out)
    h2 = m <= 16 and Q.launch_config(ggml_type, m, n, k, dtype)["V"] == 1
    _check(out, x, wf, h2)


@requires_gpu
@pytest.mark.parametrize(
    "ggml_type", [T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda t: t.name
)
@pytest.mark.parametrize(
    "cfg",
    [
        {"MT": 4, "R": 1, "U": 1, "W": 1},
        {"MT": 4, "R": 3, "U": 4, "W": 3},
        {"MT": 4, "R": 2, "U": 2, "W": 8},
        {"MT": 1, "R": 8, "U": 2, "W": 4},
    ],
    ids=["r1u1w1", "r3u4w3", "r2u2w8", "r8u2w4"],
)
def test_gpu_launch_configs(ggml_type, cfg):
    """Configurations the benchmark sweeps: every one must compute the same function, in both
    variants (V = 0 with fp32 x, V = 1 with fp16 x; V = 0 with fp16 x is the default of Q6_K,
    Q3_K and Q8_0, which test_gpu_kernel_matches_reference covers)."""
    n, k = 257, 2816
    w, wf = _weight(ggml_type, n, k)
    for v, dt in ((0, mx.float32), (1, mx.float16)):
        x = _x(min(3, cfg["MT"]), k, dt, seed=5)
        c = dict(cfg, V=v)
        out = Q.ggml_matmul_kernel(x, w, ggml_type, k, config=c, init_value=float("nan"))
        _check(out, x, wf, v == 1)


@requires_gpu
@pytest.mark.parametrize("ggml_type", TYPES, ids=[t.name for t in TYPES])
@pytest.mark.parametrize(
    "cfg",
    [{"MT": 4, "R": 3, "U": 4, "W": 3}, {"MT": 1, "R": 8, "U": 2, "W": 4}],
    ids=["r3u4w3", "r8u2w4"],
)
def test_gpu_h2bf(ggml_type, cfg):
    """V = 2 (packed fp16 math on bf16 x; the bf16 default of Q4_0 / Q4_K) at the bf16 bound,
    with M below MT where MT allows and a partial last run."""
    n, k = 257, 2816
    w, wf = _weight(ggml_type, n, k)
    x = _x(min(3, cfg["MT"]), k, mx.bfloat16, seed=6)
    out = Q.ggml_matmul_kernel(x, w, ggml_type, k, config=dict(cfg, V=2), init_value=float("nan"))
    _check(out, x, wf)


@requires_gpu
@pytest.mark.parametrize("case", _WIDE_CASES, ids=lambda c: T(c[0]).name)
def test_gpu_h2bf_range(case):
    """test_h2bf_range_on_the_emulator on the GPU: HFMA2 and F2FP's rounding, subnormals."""
    t, m, n, k, cfg = case
    w, wf = _weight(t, n, k)
    x = _wide_x(wf, m, seed=int(t))
    _check_rows(Q.ggml_matmul_kernel(x, w, t, k, config=cfg, init_value=float("nan")), x, wf)


_FRESH_FP32 = """
import json
import numpy as np
import mlx.core as mx
from gguf import GGMLQuantizationType as T
from hf2q_mlx.custom_kernels.dequant import dequantize_reference
from hf2q_mlx.custom_kernels.expert_matmul import expert_matmul
from hf2q_mlx.custom_kernels.qmatmul import ggml_matmul
from hf2q_mlx.io.random_weights import random_ggml_blocks

def rel(got, want):
    got = np.array(got, dtype=np.float64).reshape(want.shape)
    return float(np.abs(got - want).max() / np.abs(want).max())

res = {}
for t, n, k in ((T.Q4_0, 257, 2816), (T.Q5_0, 96, 512), (T.Q4_K, 257, 2816)):
    w = random_ggml_blocks(n, k, t, seed=int(t))
    with mx.stream(mx.cpu):
        wf = np.array(dequantize_reference(w, t, k), dtype=np.float64)
    for m in (1, 2, 3, 8, 16, 33):
        x = mx.random.normal((m, k), key=mx.random.key(m))
        want = np.array(x, dtype=np.float64) @ wf.T
        res[f"{t.name} M={m}"] = rel(ggml_matmul(x, w, t, k), want)
        if m in (1, 2, 33):  # MLX's own fp32 matmul on this GPU: whether TF32 is on here
            res[f"{t.name} mx.matmul M={m}"] = rel(x @ mx.array(wf.astype(np.float32)).T, want)
e, n, k, t = 8, 64, 512, T.Q4_K
w = random_ggml_blocks(e * n, k, t, seed=3)
with mx.stream(mx.cpu):
    wf = np.array(dequantize_reference(w, t, k), dtype=np.float64).reshape(e, n, k)
for tokens in (2, 40):
    ids = mx.array(np.stack([np.random.default_rng(i).permutation(e)[:3] for i in range(tokens)]))
    x = mx.random.normal((tokens, k), key=mx.random.key(tokens))
    want = np.einsum("tjnk,tk->tjn", wf[np.array(ids)], np.array(x, dtype=np.float64))
    res[f"experts tokens={tokens}"] = rel(expert_matmul(x, w.reshape(e, n, -1), ids, t, k), want)
print(json.dumps(res))
"""


@requires_gpu
def test_gpu_fp32_stays_fp32_with_tf32_on():
    """fp32 x keeps fp32 accuracy at every M on the GPU in a process where MLX runs fp32 matmuls
    as TF32 (MLX_ENABLE_TF32=1, MLX's default; the suite's conftest sets 0, so a fresh
    interpreter): ggml_matmul at M = 1..33 and expert_matmul at 2 and 40 tokens, every output
    within FP32_MAX_TOL of the largest. mx.matmul's own error is in the message (TF32: ~1e-4)."""
    proc = subprocess.run(
        [sys.executable, "-c", _FRESH_FP32],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "MLX_ENABLE_TF32": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(res, indent=1))  # the numbers, with -s
    bad = {c: e for c, e in res.items() if "mx.matmul" not in c and e > FP32_MAX_TOL}
    assert not bad, f"errors of the largest output: {bad}; all: {res}"


@requires_gpu
def test_gpu_dispatcher_takes_the_kernel():
    w, _ = _weight(T.Q4_K, 257, 512)
    x = _x(2, 512, mx.float16, seed=3).reshape(1, 2, 512)
    y = Q.ggml_matmul(x, w, T.Q4_K, 512)
    direct = Q.ggml_matmul_kernel(x.reshape(2, 512), w, T.Q4_K, 512)
    assert y.shape == (1, 2, 257) and bool(mx.array_equal(y.reshape(2, 257), direct))
    _check(y.reshape(2, 257), x.reshape(2, 512), _weight(T.Q4_K, 257, 512)[1], h2=True)


def test_config_with_fewer_columns_than_x_is_refused():
    """MT < M would leave output rows unwritten (the kernel computes MT columns per row)."""
    w, _ = _weight(T.Q4_0, 8, 64)
    with pytest.raises(ValueError, match="MT = 1"):
        Q.ggml_matmul_kernel(_x(3, 64, mx.float32, seed=1), w, T.Q4_0, 64,
                             config={"MT": 1, "R": 8, "U": 2, "W": 4})  # fmt: skip


@pytest.mark.skipif(not kernel_emulator.available(), reason="g++ is not installed")
def test_dispatcher_plan_cache_on_the_emulator(monkeypatch):
    """ggml_matmul's repeat calls go through one cached launch plan per call signature: the
    batch dims stay on x and the output (no reshapes), and the result equals the first call's."""
    monkeypatch.setattr(Q, "backend", lambda: "cuda")
    monkeypatch.setattr(Kernel, "__call__", _emu_call)
    monkeypatch.setattr(Kernel, "launcher", _emu_launcher)
    monkeypatch.setattr(Q, "_CALLS", {})
    w, wf = _weight(T.Q4_0, 7, 352)
    x = _x(2, 352, mx.float16, seed=11).reshape(1, 2, 352)
    y1 = Q.ggml_matmul(x, w, T.Q4_0, 352)
    assert len(Q._CALLS) == 1
    y2 = Q.ggml_matmul(x, w, T.Q4_0, 352)
    assert y1.shape == y2.shape == (1, 2, 7) and bool(mx.array_equal(y1, y2))
    _check(y1.reshape(2, 7), x.reshape(2, 352), wf, h2=True)
    with pytest.raises(WeightMismatchError):  # a new signature is validated again
        Q.ggml_matmul(x[..., :256], w, T.Q4_0, 352)


@pytest.mark.skipif(not kernel_emulator.available(), reason="g++ is not installed")
def test_dispatcher_takes_h2bf_from_bf16_defaults(monkeypatch):
    """A BF16_DEFAULTS line is all it takes: ggml_matmul on bf16 x then launches V = 2 (the
    tensor-core kernel, which CUDA takes for bf16 x of every mma type, switched off)."""
    monkeypatch.setattr(Q, "backend", lambda: "cuda")
    monkeypatch.setattr(Q.mma, "ENABLED", False)
    monkeypatch.setattr(Kernel, "__call__", _emu_call)
    monkeypatch.setattr(Kernel, "launcher", _emu_launcher)
    monkeypatch.setattr(Q, "_CALLS", {})
    monkeypatch.setattr(qmatmul_tuning, "BF16_DEFAULTS", {("32", False): _H2BF_LINE})
    w, wf = _weight(T.Q4_0, 7, 352)
    x = _x(2, 352, mx.bfloat16, seed=12).reshape(1, 2, 352)
    y = Q.ggml_matmul(x, w, T.Q4_0, 352)
    (plan,) = Q._CALLS.values()
    assert plan.kernel is Q._KERNELS[(T.Q4_0, 2)] and y.shape == (1, 2, 7)
    _check(y.reshape(2, 7), x.reshape(2, 352), wf)


_H2BF_LINE = (2, 2, 2, 2)  # (V, R, U, W): _H2BF's, so the emulator binary is shared


@pytest.mark.skipif(not kernel_emulator.available(), reason="g++ is not installed")
def test_dispatcher_fp32_many_rows_on_the_emulator(monkeypatch):
    """fp32 x with more than 16 rows: the mat-vec kernel over 16-row slices (fp32 math), not the
    dequantizer + mx.matmul, which MLX runs as TF32 on CUDA unless MLX_ENABLE_TF32=0 (fp16-level
    error; the suite's conftest turns TF32 off, so only the routing shows it here). fp16 x keeps
    the dequantizing path."""
    monkeypatch.setattr(Q, "backend", lambda: "cuda")
    monkeypatch.setattr(Q, "_CALLS", {})
    monkeypatch.setattr(D, "_PLANS", {})
    launched = []

    def launcher(self, input_dtypes, **launch):
        run = _emu_launcher(self, input_dtypes, **launch)
        return lambda inputs: launched.append(self.name) or run(inputs)

    monkeypatch.setattr(Kernel, "launcher", launcher)
    monkeypatch.setattr(Kernel, "__call__", _emu_call)
    t, n, k = T.Q8_0, 13, 416  # binaries of _EMU_CASES: MT = 16 (the fp32 grid) and 1
    w, wf = _weight(t, n, k)
    x = _x(33, k, mx.float32, seed=21).reshape(3, 11, k)
    y = Q.ggml_matmul(x, w, t, k)
    assert launched == [Q.kernel_name(t)] * 3 and y.shape == (3, 11, n)  # rows 16 + 16 + 1
    _check(y.reshape(33, n), x.reshape(33, k), wf)
    launched.clear()
    xh = _x(Q.ROW_SLICE_MAX + 1, 256, mx.float16, seed=22)  # past a decode batch: dequantize
    wh, whf = _weight(T.Q4_0, 7, 256)
    _check(Q.ggml_matmul(xh, wh, T.Q4_0, 256), xh, whf)
    assert Q.kernel_name(T.Q4_0) not in launched and launched  # the dequantizer's launch


@pytest.mark.skipif(not kernel_emulator.available(), reason="g++ is not installed")
@pytest.mark.parametrize("ggml_type,dtype", [(T.Q5_1, mx.float32), (T.Q3_K, mx.bfloat16)])
def test_dequant_kernel_on_the_emulator(ggml_type, dtype):
    """The many-rows path's dequantizer: the reference's values up to one fp32 rounding (the
    GPU may fuse scale * q + bias), then the cast to dtype."""
    n, k = 5, 768
    w, wf = _weight(ggml_type, n, k)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Kernel, "launcher", _emu_launcher)
        mp.setattr(D, "_PLANS", {})  # keep the emulator's launches out of the real cache
        got = D.ggml_dequantize_kernel(w, ggml_type, k, dtype)
    assert got.shape == (n, k) and got.dtype == dtype
    got, want = np.array(got.astype(mx.float32)), np.array(wf.astype(dtype).astype(mx.float32))
    scale = np.abs(np.array(wf)).max()
    ulp = 2.0**-23 if dtype == mx.float32 else 2.0**-7  # one rounding of the largest term
    np.testing.assert_allclose(got, want, rtol=0, atol=2 * ulp * scale)


@pytest.mark.skipif(not kernel_emulator.available(), reason="g++ is not installed")
@pytest.mark.parametrize(
    "ggml_type,dtype,n",
    [(T.Q4_K, mx.bfloat16, 11), (T.Q6_K, mx.float32, 5), (T.Q4_0, mx.bfloat16, 70),
     (T.Q8_0, mx.float32, 33), (T.Q5_K, mx.float16, 3)],
    ids=lambda v: getattr(v, "name", str(v)),
)  # fmt: skip
def test_staged_dequant_gives_the_plain_kernels_bits(monkeypatch, ggml_type, dtype, n):
    """HF2Q_DEQUANT_STAGED=1: the stores through shared memory give the plain dequantizer's
    bits (data movement only: bit-exact), the last threadgroup partly past the blocks (n rows
    of 768 columns are never a multiple of its blocks); outputs poisoned by the emulator."""
    k = 768
    w, _ = _weight(ggml_type, n, k)
    monkeypatch.setattr(Kernel, "launcher", _emu_launcher)
    monkeypatch.setattr(D, "_PLANS", {})
    got = {}
    for v in ("0", "1"):
        monkeypatch.setenv("HF2Q_DEQUANT_STAGED", v)
        got[v] = D.ggml_dequantize_kernel(w, ggml_type, k, dtype)
    f = D.BLOCK_FORMATS[ggml_type]
    assert (n * k // f.block_size) % D._staged_blocks(f.block_size, f.lanes, dtype) != 0
    assert got["1"].shape == (n, k) and got["1"].dtype == dtype
    bits = {2: mx.uint16, 4: mx.uint32}[dtype.size]
    np.testing.assert_array_equal(np.array(got["1"].view(bits)), np.array(got["0"].view(bits)))
    assert sorted(key[-1] for key in D._PLANS) == [False, True]


@requires_gpu
@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q6_K, T.Q8_0, T.Q5_0], ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32], ids=str)
def test_gpu_staged_dequant_gives_the_plain_kernels_bits(monkeypatch, ggml_type, dtype):
    """On the GPU: the staged stores' output bit for bit the plain kernel's (300 rows x 1,536:
    a last threadgroup partly past the blocks for every type here)."""
    n, k = 301, 1536
    w, _ = _weight(ggml_type, n, k)
    got = {}
    for v in ("0", "1"):
        monkeypatch.setenv("HF2Q_DEQUANT_STAGED", v)
        got[v] = D.ggml_dequantize_kernel(w, ggml_type, k, dtype)
    bits = {2: mx.uint16, 4: mx.uint32}[dtype.size]
    np.testing.assert_array_equal(np.array(got["1"].view(bits)), np.array(got["0"].view(bits)))


def test_staged_switch_and_sizes(monkeypatch):
    """Unset: staged on MLX's CUDA back end only (timed there); 0 / 1 force it either way."""
    monkeypatch.delenv("HF2Q_DEQUANT_STAGED", raising=False)
    for gpu, want in (("cuda", True), ("metal", False), (None, False)):
        monkeypatch.setattr(D, "backend", lambda g=gpu: g)
        assert D.staged_stores() is want
    monkeypatch.setenv("HF2Q_DEQUANT_STAGED", "0")
    assert not D.staged_stores()  # on CUDA too
    monkeypatch.setattr(D, "backend", lambda: None)
    monkeypatch.setenv("HF2Q_DEQUANT_STAGED", "1")
    assert D.staged_stores()
    monkeypatch.setenv("HF2Q_DEQUANT_STAGED", "on")
    with pytest.raises(InvalidArgumentError, match="HF2Q_DEQUANT_STAGED"):
        D.staged_stores()
    for t, f in D.BLOCK_FORMATS.items():
        for dt in (mx.float32, mx.bfloat16, mx.float16):
            bpt = D._staged_blocks(f.block_size, f.lanes, dt)
            assert bpt * f.lanes <= 256 and bpt * f.block_size * dt.size <= D._STAGE_BYTES
            assert bpt * f.lanes % 32 == 0, (t, dt)  # whole SIMD groups


def _get_rows_check(got: mx.array, wf: mx.array, ids: mx.array) -> None:
    want = np.array(wf)[np.array(ids)]
    assert got.shape == want.shape and got.dtype == mx.float32
    # one fp32 rounding of the largest term (the GPU may fuse scale * q + bias)
    np.testing.assert_allclose(np.array(got), want, rtol=0, atol=2 * 2.0**-23 * np.abs(want).max())


@pytest.mark.skipif(not kernel_emulator.available(), reason="g++ is not installed")
@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
def test_get_rows_on_the_emulator(ggml_type, monkeypatch):
    """The GGML embedding lookup with a GPU back end (faked): one gather, then the dequantizer
    over just those rows, in the ids' shape; the reference's rows up to one fp32 rounding."""
    monkeypatch.setattr(D, "backend", lambda: "cuda")
    monkeypatch.setattr(Kernel, "launcher", _emu_launcher)
    monkeypatch.setattr(D, "_PLANS", {})
    launches = []
    real = D.ggml_dequantize_kernel
    monkeypatch.setattr(D, "ggml_dequantize_kernel", lambda *a: launches.append(1) or real(*a))
    w, wf = _weight(ggml_type, 9, 512)
    ids = mx.array([[3, 0, 8], [8, 8, 1]])
    _get_rows_check(D.ggml_get_rows(w, ids, ggml_type, 512), wf, ids)
    assert launches == [1]


@requires_gpu
@pytest.mark.parametrize("ggml_type", [T.Q4_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_gpu_get_rows(ggml_type):
    w, wf = _weight(ggml_type, 300, 768)
    ids = mx.array([[299, 0, 17, 17]])
    _get_rows_check(D.ggml_get_rows(w, ids, ggml_type, 768), wf, ids)


# ---------------------------------------------------------------------------------------------
# MT > 1 rows of x (decode batches, speculative verifies): the launches the tables pick


def _rows_cases() -> list[tuple[int, mx.Dtype, int]]:
    """(type, dtype, M): every type in bf16 and fp16 x (the packed variants V = 2 / V = 1 where
    the tables pick them, V = 0 elsewhere; fp32 x at M > 1 is _M_GRID's), M cycling over 2, 5,
    8, 16 so that every type meets two of them; Q4_K fp16 (W = 1) at M = 16 has more sums
    (R x MT = 64) than threads (32), so the epilogue's loop runs twice."""
    ms = (2, 5, 8, 16)
    cases = [(t, dt, ms[(2 * i + j) % 4]) for i, t in enumerate(TYPES)
             for j, dt in enumerate((mx.bfloat16, mx.float16))]  # fmt: skip
    assert (T.Q4_K, mx.float16, 16) in cases
    return cases


_ROWS_CASES = _rows_cases()


@pytest.mark.skipif(not kernel_emulator.available(), reason="g++ is not installed")
@pytest.mark.parametrize(
    "case", _ROWS_CASES, ids=lambda c: f"{T(c[0]).name}-{str(c[1])[9:]}-M{c[2]}"
)
def test_rows_on_the_emulator_match_reference_and_rows_alone(case, monkeypatch):
    """ggml_matmul at M rows through the dispatcher (launch_config's MT > 1 line: R from
    MT_ROWS): within _check's bound of the fp32 reference (emulator outputs NaN-poisoned), and
    each row bit-identical to that row run alone (M = 1 launch): the row-parity property the
    batched lm_head rests on (tests/test_lm_head_rows.py). N = 13 leaves rows past N in the last
    threadgroup, K a partial last step."""
    t, dt, m = case
    monkeypatch.setattr(Q, "backend", lambda: "cuda")
    monkeypatch.setattr(Kernel, "launcher", _emu_launcher)
    monkeypatch.setattr(Q, "_CALLS", {})
    monkeypatch.setattr(Q.mma, "ENABLED", False)  # the scalar kernels (test_qmatmul_mma: mma)
    n, k = 13, 1280 if QK[t] == 256 else 416
    cfg = Q.launch_config(t, m, n, k, dt)
    assert cfg["MT"] > 1 and cfg["R"] == min(
        qmatmul_tuning.MT_ROWS.get((cfg["MT"], t.name, False))
        or qmatmul_tuning.MT_ROWS[(cfg["MT"], str(QK[t]), False)],
        Q.MAX_ACC // cfg["MT"],
    )
    w, wf = _weight(t, n, k)
    x = _x(m, k, dt, seed=100 + int(t) + m)
    y = Q.ggml_matmul(x, w, t, k)
    _check(y, x, wf, h2=cfg["V"] == 1)
    alone = mx.concatenate([Q.ggml_matmul(x[i : i + 1], w, t, k) for i in range(m)])
    same = np.array(y.view(mx.uint16) == alone.view(mx.uint16)).all(axis=1)
    assert same.all(), f"rows {np.flatnonzero(~same).tolist()} differ from the row alone"


@requires_gpu
@pytest.mark.parametrize("ggml_type", TYPES, ids=[t.name for t in TYPES])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f16", "bf16"])
def test_gpu_rows_bit_identical_to_rows_alone(ggml_type, dtype):
    """Row parity on real shapes (several steps per row, every SIMD group busy): at M = 2, 5,
    8, 16 the tables' launch gives each row the bits it has alone, on K = 2816 and 14336 (long
    rows take other tables); tests/test_lm_head_rows.py checks the heads at K = 256."""
    for n, k in ((4099, 2816), (257, 14336)):
        w, _ = _weight(ggml_type, n, k)
        x = _x(16, k, dtype, seed=n + k)
        # the scalar kernel alone (ggml_matmul takes qmatmul_mma for bf16 x of its types)
        alone = mx.concatenate(
            [Q.ggml_matmul_kernel(x[i : i + 1], w, ggml_type, k) for i in range(16)]
        )
        for m in (2, 5, 8, 16):
            y = Q.ggml_matmul_kernel(x[:m], w, ggml_type, k, init_value=float("nan"))
            same = np.array(y.view(mx.uint16) == alone[:m].view(mx.uint16)).all(axis=1)
            assert same.all(), f"{n}x{k} M = {m}: rows {np.flatnonzero(~same).tolist()} differ"
