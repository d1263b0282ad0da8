"""The CPU mat-vec extension (custom_kernels/cpu_ext): every type it has against the reference
dequantizer + a float64 product, x of 1..16 rows in fp32/fp16/bf16, the split over threads, the
wiring into GGMLLinear and the fallbacks (disabled, or no way to build it).

Random blocks and x are fresh on every run (the seed is in each failure message). Tolerance:
1e-5 of the largest |output| for fp32 x (fp32 math, x as given: each output sums K products
in fp32 with a different grouping than the float64 reference, ~1e-6 observed; a wrong block,
scale, sub-block or nibble order is off by far more). fp16 / bf16 x: the output is rounded to
x's dtype once, so 2^-10 / 2^-7 of the largest output on top of that.

The first test of a session may build the extension (~10 s on 2 cores, once per cache).
"""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from hf2q_mlx.custom_kernels import cpu_ext
from hf2q_mlx.custom_kernels.dequant import GGML_BLOCK_INFO, dequantize_reference
from hf2q_mlx.io.random_weights import random_ggml_blocks
from hf2q_mlx.models.quantized import GGMLLinear

TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]
RTOL = 1e-5  # of the largest |output|, fp32 x: see the module docstring
RTOL_DTYPE = {mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7}  # + the output's one rounding


@pytest.fixture(scope="module")
def ext():
    module = cpu_ext.load()
    if module is None:
        pytest.skip("the CPU mat-vec extension cannot be built or is disabled (stderr says why)")
    return module


@pytest.fixture
def seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def _k(ggml_type: int) -> int:
    # 640 (Gemma 3's width, not a multiple of 256) for the 32-blocks, 2 blocks of 256 else
    return 512 if GGML_BLOCK_INFO[ggml_type][0] == 256 else 640


def _want(x: mx.array, w: mx.array, ggml_type: int, k: int) -> np.ndarray:
    """float64 x @ W.T over the reference dequantizer's fp32 weights (bit-exact with gguf-py)."""
    w64 = np.array(dequantize_reference(w, ggml_type, k)).astype(np.float64)
    return np.array(x.astype(mx.float32)).astype(np.float64) @ w64.T


def _err(got: mx.array, want: np.ndarray) -> float:
    got64 = np.array(got.astype(mx.float32)).astype(np.float64)
    assert got64.shape == want.shape
    return float(np.abs(got64 - want).max() / max(np.abs(want).max(), 1e-30))


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_every_type_and_row_count_matches_reference(ext, ggml_type, seed):
    k = _k(ggml_type)
    n = 203  # several chunks of rows (a multiple of 8 each), the last one short
    w = random_ggml_blocks(n, k, ggml_type, seed=seed)
    for m in (1, 2, 5, 16):  # passes over the weight of 4 rows of x, then the remainder
        # fresh x, centred off zero so the min / offset terms of the formats matter
        x = mx.random.normal((m, k), key=mx.random.key(seed + m)) + 0.5
        got = ext.ggml_matvec(x, w, int(ggml_type), k)
        assert got.dtype == mx.float32 and got.shape == (m, n)
        err = _err(got, _want(x, w, ggml_type, k))
        assert err <= RTOL, f"seed {seed} {ggml_type.name} M {m}: error {err:.2e}"


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=str)
def test_half_x_computes_in_fp32_and_returns_its_dtype(ext, dtype, seed):
    k, n = 512, 45
    w = random_ggml_blocks(n, k, T.Q4_K, seed=seed)
    x = mx.random.normal((3, k), key=mx.random.key(seed)).astype(dtype)
    got = cpu_ext.ggml_matvec(x, w, T.Q4_K, k)
    assert got.dtype == dtype
    err = _err(got, _want(x, w, T.Q4_K, k))
    assert err <= RTOL + RTOL_DTYPE[dtype], f"seed {seed} {dtype}: error {err:.2e}"


def test_strided_and_batched_x(ext, seed):
    k, n = 640, 37
    w = random_ggml_blocks(n, k, T.Q8_0, seed=seed)
    wide = mx.random.normal((4, 2 * k), key=mx.random.key(seed))
    x = wide[:, ::2]  # a strided view: rows of stride 2K, elements of stride 2
    err = _err(ext.ggml_matvec(x, w, int(T.Q8_0), k), _want(x, w, T.Q8_0, k))
    assert err <= RTOL, f"seed {seed}: error {err:.2e}"
    xb = mx.random.normal((2, 3, k), key=mx.random.key(seed + 1))  # (..., K) -> (..., N)
    got = cpu_ext.ggml_matvec(xb, w, T.Q8_0, k)
    assert got.shape == (2, 3, n)
    assert _err(got.reshape(6, n), _want(xb.reshape(6, k), w, T.Q8_0, k)) <= RTOL


def test_nd_x_is_one_op_with_the_rows_bits(ext, seed):
    """x (..., K) at any strides (a transposed 3-D view, a 4-D broadcast row) gives (..., N) in
    one op, each row the bits of the same row as a contiguous (M, K) call (data movement only)."""
    k, n = 512, 29
    w = random_ggml_blocks(n, k, T.Q4_K, seed=seed)
    base = mx.random.normal((3, 2, k), key=mx.random.key(seed)) + 0.25
    x = base.transpose(1, 0, 2)  # (2, 3, K), rows not in memory order
    got = ext.ggml_matvec(x, w, int(T.Q4_K), k)
    assert got.shape == (2, 3, n)
    flat = mx.array(np.ascontiguousarray(np.array(x)).reshape(6, k))
    assert np.array_equal(
        np.array(got).reshape(6, n), np.array(ext.ggml_matvec(flat, w, int(T.Q4_K), k))
    )
    row = mx.broadcast_to(base[1:2, :1], (2, 2, 1, k))  # 4-D, zero strides on the leading dims
    got4 = np.array(ext.ggml_matvec(row, w, int(T.Q4_K), k))
    assert got4.shape == (2, 2, 1, n)
    one = np.array(ext.ggml_matvec(base[1, :1], w, int(T.Q4_K), k))
    assert all(np.array_equal(got4[i, j], one) for i in range(2) for j in range(2))
    with pytest.raises(ValueError):
        ext.ggml_matvec(mx.zeros((0, k)), w, int(T.Q4_K), k)  # no rows


def test_threads_give_the_same_bits(ext, seed):
    # each output row is computed by one thread, whatever the split: bit-identical results
    k, n = 512, 1001
    w = random_ggml_blocks(n, k, T.Q6_K, seed=seed)
    x = mx.random.normal((2, k), key=mx.random.key(seed))
    try:
        outs = []
        for threads in (1, 3):
            ext.set_threads(threads)
            assert ext.threads() == threads
            outs.append(np.array(ext.ggml_matvec(x, w, int(T.Q6_K), k)))
    finally:
        ext.set_threads(0)  # back to the default
    assert np.array_equal(outs[0], outs[1]), f"seed {seed}"
    assert _err(mx.array(outs[0]), _want(x, w, T.Q6_K, k)) <= RTOL


@pytest.mark.parametrize("ggml_type", [T.Q4_1, T.Q6_K], ids=lambda t: t.name)
def test_a_row_has_the_same_bits_alone_and_in_a_batch(ext, ggml_type, seed):
    # the batched lm_head's row parity (tests/test_lm_head_rows.py): passes of 4 rows and the
    # remainder all run each row through the same operations
    k, n = _k(ggml_type), 61
    w = random_ggml_blocks(n, k, ggml_type, seed=seed)
    x = mx.random.normal((7, k), key=mx.random.key(seed))
    batch = np.array(ext.ggml_matvec(x, w, int(ggml_type), k))
    for i in range(7):
        alone = np.array(ext.ggml_matvec(x[i : i + 1], w, int(ggml_type), k))[0]
        assert np.array_equal(batch[i], alone), f"seed {seed} row {i}"


def test_rejects_what_it_cannot_take(ext):
    w = random_ggml_blocks(8, 64, T.Q8_0)
    with pytest.raises(ValueError):
        ext.ggml_matvec(mx.zeros((1, 32)), w, int(T.Q8_0), 64)  # x of the wrong width
    with pytest.raises(ValueError):
        ext.ggml_matvec(mx.zeros((1, 64)), w, int(T.Q2_K), 64)  # a type it does not have
    # the Python entry hands back None where its caller's path must run instead
    assert cpu_ext.ggml_matvec(mx.zeros((65, 64)), w, T.Q8_0, 64) is None  # > MAX_ROWS rows
    assert cpu_ext.ggml_matvec(mx.zeros((1, 256)), w, T.Q2_K, 256) is None


def test_linear_layer_uses_it_and_falls_back_when_disabled(ext, seed, monkeypatch):
    k, n = 640, 24
    layer = GGMLLinear(k, n, T.Q5_0)
    layer.weight = random_ggml_blocks(n, k, T.Q5_0, seed=seed)
    x = mx.random.normal((1, 2, k), key=mx.random.key(seed))
    want = _want(x.reshape(2, k), layer.weight, T.Q5_0, k)
    calls = ext.stats()[0]
    y = layer(x)
    mx.eval(y)
    assert ext.stats()[0] == calls + 1  # through the extension
    assert _err(y.reshape(2, n), want) <= RTOL
    # HF2Q_CPU_EXT=0 (read by the first load() of a process): the MLX path, same result
    monkeypatch.setenv(cpu_ext.ENV_VAR, "0")
    monkeypatch.setattr(cpu_ext, "_state", {})
    assert cpu_ext.load() is None
    y = layer(x)
    mx.eval(y)
    assert ext.stats()[0] == calls + 1  # not through the extension
    assert _err(y.reshape(2, n), want) <= 1e-4  # the affine repack path's own tolerance


def test_no_build_tools_means_none_and_one_line(monkeypatch, tmp_path, capsys):
    # no cmake on PATH: load() reports once on stderr, leaves a marker, returns None
    monkeypatch.setenv("HF2Q_MLX_CACHE", str(tmp_path))
    monkeypatch.delenv(cpu_ext.ENV_VAR, raising=False)
    monkeypatch.setattr(cpu_ext, "_state", {})
    monkeypatch.setattr(cpu_ext.shutil, "which", lambda name: None)
    assert cpu_ext.load() is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no cmake" in err[0], err
    assert list((tmp_path / "ext").glob("*.failed"))
    # a later process skips the attempt quietly (delete the marker to retry)
    monkeypatch.setattr(cpu_ext, "_state", {})
    assert cpu_ext.load() is None
    assert capsys.readouterr().err == ""
