"""The block join (branch norms, residual add, layer scale, next norms): the reference against
numpy, the kernel's CUDA rendering on the CPU emulator, and the kernel on a GPU."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import requires_gpu
from test_norm_rope import emulate, needs_gxx

from hf2q_mlx.custom_kernels import post_norm_residual as pnr

EPS = 1e-6


def _args(rows, H, two, scaled, n2, seed, dtype=mx.float32):
    rng = np.random.default_rng(seed)

    def arr(shape, s=1.0, off=0.0):
        return mx.array((rng.standard_normal(shape) * s + off).astype(np.float32)).astype(dtype)

    kw = {"x": arr((rows, H), 4), "y": arr((rows, H), 2), "w": arr((H,), 0.3, 1.0),
          "next_w": arr((H,), 0.3, 1.0), "eps": EPS}  # fmt: skip
    if two:
        kw.update(y2=arr((rows, H), 5), w1=arr((H,), 0.3, 1.0), w2=arr((H,), 0.3, 1.0))
    if scaled:
        kw["scale"] = arr((1,), 0.1, 0.8)
    if n2:
        kw["next_w2"] = arr((H,), 0.3, 1.0)
    return kw


def _np_norm(v, w):
    return v / np.sqrt((v * v).mean(-1, keepdims=True) + EPS) * w


def _numpy(kw):
    g = {k: np.array(v, np.float64) for k, v in kw.items() if isinstance(v, mx.array)}
    b = g["y"]
    if "y2" in g:
        b = _np_norm(g["y"], g["w1"]) + _np_norm(g["y2"], g["w2"])
    h = (g["x"] + _np_norm(b, g["w"])) * g.get("scale", 1.0)
    out = [h, _np_norm(h, g["next_w"])]
    return out + ([_np_norm(h, g["next_w2"])] if "next_w2" in g else [])


CASES = [  # rows, H, two branches, scaled, second output norm
    (3, 1000, True, True, True),
    (2, 77, False, False, False),
    (1, 2816, True, True, False),  # Gemma-4-26B-A4B's MoE block
    (4, 640, False, True, True),
]


@pytest.mark.parametrize("case", CASES)
def test_reference_against_numpy(case):
    kw = _args(*case, seed=1)
    got = pnr.post_norm_residual_reference(**kw)
    want = _numpy(kw)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.array(g), w, rtol=1e-5, atol=1e-5)


def test_bad_arguments_raise():
    kw = _args(2, 64, True, True, False, seed=2)
    with pytest.raises(ValueError):
        pnr.post_norm_residual(**{**kw, "y": kw["y"][:, :32]})
    with pytest.raises(ValueError):
        pnr.post_norm_residual(**{**kw, "w2": None})
    with pytest.raises(ValueError):
        pnr.post_norm_residual(**{**kw, "scale": mx.ones((2,))})


def _check(case, dtype):
    kw = _args(*case, seed=3, dtype=dtype)
    got = pnr.post_norm_residual(**kw)
    f32 = {k: v.astype(mx.float32) if isinstance(v, mx.array) else v for k, v in kw.items()}
    ref32 = pnr.post_norm_residual_reference(**f32)
    assert len(got) == len(ref32)
    if dtype == mx.float32:
        for g, r in zip(got, ref32):  # fp32 math in both, sums in another order
            np.testing.assert_allclose(np.array(g), np.array(r), rtol=1e-5, atol=1e-5)
        return
    ref_lo = pnr.post_norm_residual_reference(**kw)  # the same ops in the low dtype
    for g, lo, r in zip(got, ref_lo, ref32):
        r = np.array(r, np.float64)
        err = np.abs(np.array(g.astype(mx.float32), np.float64) - r).max()
        ref_err = np.abs(np.array(lo.astype(mx.float32), np.float64) - r).max()
        assert err <= 2 * ref_err + 1e-6, (err, ref_err)


@needs_gxx
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_emulated_kernel_matches_reference(monkeypatch, case, dtype):
    emu = emulate(monkeypatch, pnr, "_kernel")["_kernel"]
    pnr._plan.cache_clear()
    try:
        _check(case, dtype)
    finally:
        pnr._plan.cache_clear()
    assert emu.launches == 1


@requires_gpu
@pytest.mark.parametrize("case", CASES + [(8, 5376, False, True, False)])  # 31B, 8 rows
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_gpu_kernel_matches_reference(case, dtype):
    pnr._plan.cache_clear()
    _check(case, dtype)
