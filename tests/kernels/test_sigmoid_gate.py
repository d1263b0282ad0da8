"""Qwen 3.5's sigmoid output gates: the references against numpy, the kernel bodies on the CPU
emulation, the kernels on a GPU (each rounding step in the array dtype, as MLX's ops)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import requires_gpu
from kernel_emulator import Emulated
from test_norm_rope import assert_one_rounding, emulate, needs_gxx

from hf2q_mlx.custom_kernels import residual_rms_norm as rrn
from hf2q_mlx.custom_kernels import row_threads
from hf2q_mlx.custom_kernels import sigmoid_gate as sg
from hf2q_mlx.custom_kernels.rms_norm_rope import Heads

DTYPES = [mx.float32, mx.float16, mx.bfloat16]


def _heads(B, L, H, D, seed, dtype=mx.float32):
    rng = np.random.default_rng(seed)
    x = mx.array(rng.standard_normal((B, L, H * D)).astype(np.float32)).astype(dtype)
    qg = mx.array((rng.standard_normal((B, L, H, 2 * D)) * 3).astype(np.float32)).astype(dtype)
    return x, qg


def _shared(B, L, D, seed, dtype=mx.float32):
    rng = np.random.default_rng(seed)
    y, s, x = (mx.array(rng.standard_normal((B, L, D)).astype(np.float32)).astype(dtype)
               for _ in range(3))  # fmt: skip
    w = mx.array((rng.standard_normal((1, D)) / np.sqrt(D)).astype(np.float32)).astype(dtype)
    return y, s, x, w


def test_references_against_numpy():
    x, qg = _heads(2, 3, 4, 16, 1)
    g = np.array(qg)[..., 16:].reshape(2, 3, 64)
    want = np.array(x, np.float64) / (1 + np.exp(-np.asarray(g, np.float64)))
    np.testing.assert_allclose(np.array(sg.head_gate_reference(x, qg)), want, rtol=1e-5, atol=1e-7)
    y, s, x, w = _shared(2, 3, 40, 2)
    d = np.array(x, np.float64) @ np.array(w, np.float64).T
    want = np.array(y, np.float64) + np.array(s, np.float64) / (1 + np.exp(-d))
    np.testing.assert_allclose(np.array(sg.shared_gate_add_reference(y, s, x, w)), want,
                               rtol=1e-5, atol=1e-6)  # fmt: skip


@needs_gxx
def test_head_gate_body_emulated(monkeypatch):
    emu = emulate(monkeypatch, sg, "_head_kernel")
    sg._head_plan.cache_clear()
    x, qg = _heads(1, 2, 3, 32, 3)
    got = sg.head_gate(x, qg)
    assert emu["_head_kernel"].launches == 1
    np.testing.assert_allclose(np.array(got), np.array(sg.head_gate_reference(x, qg)),
                               rtol=2e-6, atol=1e-7)  # fmt: skip
    sg._head_plan.cache_clear()


def _packed(B, L, H, Hk, D, seed, dtype=mx.float32):
    """x and the [query | gate] heads of a fused q/k/v output (B, L, H 2 D + 2 Hk D), in place."""
    rng = np.random.default_rng(seed)
    x = mx.array(rng.standard_normal((B, L, H * D)).astype(np.float32)).astype(dtype)
    n = H * 2 * D + 2 * Hk * D
    data = mx.array((rng.standard_normal((B, L, n)) * 3).astype(np.float32)).astype(dtype)
    return x, Heads(data, 0, H, 2 * D), data


@needs_gxx
def test_head_gate_reads_fused_heads_in_place_emulated(monkeypatch):
    """Heads of a fused q/k/v output (rows of H 2 D + 2 Hk D values): the kernel reads the gates
    where they lie, and gives the bits it gives on the same heads as their own array."""
    emu = emulate(monkeypatch, sg, "_head_kernel")
    sg._head_plan.cache_clear()
    x, qg, data = _packed(2, 3, 3, 1, 32, 7)
    got = sg.head_gate(x, qg)
    assert emu["_head_kernel"].launches == 1
    alone = sg.head_gate(x, mx.contiguous(data[..., : 3 * 64].reshape(2, 3, 3, 64)))
    assert np.array_equal(np.array(got), np.array(alone))
    np.testing.assert_allclose(np.array(got), np.array(sg.head_gate_reference(x, qg)),
                               rtol=2e-6, atol=1e-7)  # fmt: skip
    sg._head_plan.cache_clear()


@needs_gxx
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=str)
def test_shared_gate_add_body_emulated(monkeypatch, dtype):
    """fp32: the reference up to the dot product's summation order; bf16: each step rounded as
    MLX rounds it, so within one bf16 unit of the reference."""
    emu = emulate(monkeypatch, sg, "_shared_kernel")
    sg._shared_plan.cache_clear()
    y, s, x, w = _shared(2, 1, 700, 4, dtype)
    got = sg.shared_gate_add(y, s, x, w)
    assert emu["_shared_kernel"].launches == 1 and got.dtype == dtype
    want = sg.shared_gate_add_reference(y, s, x, w)
    if dtype == mx.float32:
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-6)
    else:
        assert_one_rounding(got, want, dtype, noise=0.02)
    sg._shared_plan.cache_clear()


@needs_gxx
@pytest.mark.parametrize("early", ["", "0"], ids=["early", "late"])
@pytest.mark.parametrize("D", [700, 2048, 5000], ids=lambda d: f"D{d}")
def test_shared_gate_residual_norm_is_the_two_kernels_emulated(monkeypatch, D, early):
    """The MoE block's end with the residual add and norm after it (one launch) gives
    shared_gate_add's kernel then residual_rms_norm's kernel bit for bit (h and n), within
    the reference's tolerance: residual_rms_norm's threads 96 (fewer than this kernel's 256),
    256 (35B-A3B's 2048) and 640 (more: three virtual threads on some); its loads all before
    the first barrier (EARLY, the CUDA default: the test's backend) or where they are used."""
    monkeypatch.setattr(sg, "EARLY", early)
    emu = emulate(monkeypatch, sg, "_shared_kernel", "_shared_norm_kernel")
    monkeypatch.setattr(rrn, "backend", lambda: "cuda")
    monkeypatch.setattr(rrn, "_kernel", Emulated(rrn._kernel))
    sg._shared_plan.cache_clear()
    sg._norm_plan.cache_clear()
    rrn._plan.cache_clear()
    try:
        y, s, x, w = _shared(3, 1, D, D % 7, mx.bfloat16)
        res = (4 * mx.random.normal(y.shape, key=mx.random.key(D))).astype(mx.bfloat16)
        nw = (0.5 + mx.random.uniform(shape=(D,), key=mx.random.key(D + 1))).astype(mx.bfloat16)
        h, n = sg.shared_gate_residual_norm(y, s, x, w, res, nw, 1e-6)
        assert emu["_shared_norm_kernel"].launches == 1 and emu["_shared_kernel"].launches == 0
        wh, wn = rrn.residual_rms_norm(res, sg.shared_gate_add(y, s, x, w), nw, 1e-6)
        assert bool(mx.array_equal(h, wh)) and bool(mx.array_equal(n, wn))
        rh, rn = sg.shared_gate_residual_norm_reference(y, s, x, w, res, nw, 1e-6)
        assert_one_rounding(h, rh, mx.bfloat16, noise=0.05)
        assert_one_rounding(n, rn, mx.bfloat16, noise=0.05)
    finally:
        sg._shared_plan.cache_clear()
        sg._norm_plan.cache_clear()
        rrn._plan.cache_clear()


def test_gate_norm_switch(monkeypatch):
    """HF2Q_SHARED_GATE_NORM: unset or 1 on (the default since session 43), 0 off, anything else
    an InvalidArgumentError naming the switch; ``ops.shared_gate_residual_norm`` follows it."""
    from hf2q_mlx.errors import InvalidArgumentError

    for text, want in (("", True), ("1", True), (" 1 ", True), ("0", False)):
        monkeypatch.setattr(sg, "GATE_NORM", text)
        assert sg.gate_norm_enabled() is want, text
    for text in ("2", "on", "-1"):
        monkeypatch.setattr(sg, "GATE_NORM", text)
        with pytest.raises(InvalidArgumentError, match="HF2Q_SHARED_GATE_NORM"):
            sg.gate_norm_enabled()
    for text, be, want in (("", "cuda", True), ("", "metal", False), ("", None, False),
                           ("1", "metal", True), ("0", "cuda", False)):  # fmt: skip
        monkeypatch.setattr(sg, "EARLY", text)
        monkeypatch.setattr(sg, "backend", lambda b=be: b)
        assert sg.early_on() is want, (text, be)
    monkeypatch.setattr(sg, "EARLY", "early")
    with pytest.raises(InvalidArgumentError, match="HF2Q_GATE_NORM_EARLY"):
        sg.early_on()


def test_dispatchers_fall_back_for_other_shapes(monkeypatch):
    """A weight wider than the rows (MLX would promote) or a wrong layout: the reference."""
    monkeypatch.setattr(sg, "backend", lambda: "cuda")
    y, s, x, w = _shared(1, 1, 64, 5, mx.bfloat16)
    got = sg.shared_gate_add(y, s, x, w.astype(mx.float32))
    assert got.dtype == mx.float32  # the reference's promotion, no kernel asked for
    x, qg = _heads(1, 1, 2, 8, 6)
    with pytest.raises(ValueError):  # x not (B, L, H D): the reference's broadcast fails
        sg.head_gate(x[..., :5], qg)


# ---- GPU ----------------------------------------------------------------------------------------


@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1, 16, 2, 256), (4, 1, 32, 2, 256), (2, 3, 4, 1, 128)],
                         ids=str)  # fmt: skip
def test_head_gate_gpu_fused_heads(dtype, shape):
    """The gates read in place from a fused q/k/v output (Qwen 3.5's decode): the same bits as
    on the [query | gate] heads copied out to their own array."""
    x, qg, data = _packed(*shape, seed=sum(shape), dtype=dtype)
    B, L, H, _, D = shape
    got = sg.head_gate(x, qg)
    alone = sg.head_gate(x, mx.contiguous(data[..., : H * 2 * D].reshape(B, L, H, 2 * D)))
    assert got.shape == alone.shape and bool(mx.array_equal(got, alone))


@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1, 16, 256), (2, 3, 4, 128), (1, 5, 32, 256)], ids=str)
def test_head_gate_gpu(dtype, shape):
    x, qg = _heads(*shape, seed=sum(shape), dtype=dtype)
    got = sg.head_gate(x, qg)
    tg = row_threads(shape[2] * shape[3])
    # the kernel with its output poisoned first: every element written, the same bits
    poisoned = sg._head_kernel(
        [x, qg], grid=(x.size,), threadgroup=(tg,), output_shapes=[x.shape],
        output_dtypes=[dtype], template={"T": dtype, "TG": tg, "D": shape[3], "H": shape[2],
                                         "RS": 2 * shape[2] * shape[3], "OFF": 0},
        init_value=float("nan"),
    )[0]  # fmt: skip
    assert bool(mx.array_equal(poisoned, got))
    want = sg.head_gate_reference(x, qg)
    assert got.shape == want.shape and got.dtype == dtype
    if dtype == mx.float32:
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-6)
    else:
        assert_one_rounding(got, want, dtype, noise=0.02)


@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1, 2048), (4, 1, 2048), (1, 7, 4096)], ids=str)
def test_shared_gate_add_gpu(dtype, shape):
    y, s, x, w = _shared(*shape, seed=shape[2] + shape[0], dtype=dtype)
    got = sg.shared_gate_add(y, s, x, w)
    rows, D = y.size // shape[2], shape[2]
    poisoned = sg._shared_kernel(
        [y, s, x, w], grid=(rows * 256,), threadgroup=(256,), output_shapes=[y.shape],
        output_dtypes=[dtype], template={"T": dtype, "D": D, "TG": 256}, init_value=float("nan"),
    )[0]  # fmt: skip
    assert bool(mx.array_equal(poisoned, got))
    want = sg.shared_gate_add_reference(y, s, x, w)
    assert got.shape == want.shape and got.dtype == dtype
    if dtype == mx.float32:
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)
    else:
        assert_one_rounding(got, want, dtype, noise=0.02)


@requires_gpu
@pytest.mark.parametrize("rows", [1, 8, 32])
def test_shared_gate_residual_norm_gpu(rows):
    """On the GPU at 35B-A3B's width (2048, bf16): the MoE end with the residual add and norm
    gives shared_gate_add's kernel then residual_rms_norm's kernel bit for bit."""
    D = 2048
    y, s, x, w = _shared(rows, 1, D, rows, mx.bfloat16)
    res = (4 * mx.random.normal(y.shape, key=mx.random.key(rows))).astype(mx.bfloat16)
    nw = (0.5 + mx.random.uniform(shape=(D,), key=mx.random.key(rows + 1))).astype(mx.bfloat16)
    h, n = sg.shared_gate_residual_norm(y, s, x, w, res, nw, 1e-6)
    wh, wn = rrn.residual_rms_norm(res, sg.shared_gate_add(y, s, x, w), nw, 1e-6)
    assert bool(mx.array_equal(h, wh)) and bool(mx.array_equal(n, wn))
