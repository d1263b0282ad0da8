"""expert_down: the routed experts' down projections and their weighted sum in one kernel; its
CUDA rendering on the CPU emulator and on a GPU against fp32 reference math with every
unselected expert's blocks poisoned (0xFF: NaN scales), the dispatcher and the models' wiring."""

from __future__ import annotations

import kernel_emulator
import mlx.core as mx
import numpy as np
import pytest
from conftest import requires_gpu
from gguf import GGMLQuantizationType as T
from kernel_emulator import Emulated
from test_expert_glu import _experts, _poisoned, assert_rows_close

import hf2q_mlx.custom_kernels as ck
from hf2q_mlx.custom_kernels import expert_down as D
from hf2q_mlx.custom_kernels import expert_glu as G
from hf2q_mlx.custom_kernels._render import Kernel
from hf2q_mlx.custom_kernels.dequant import dequantize_reference
from hf2q_mlx.errors import WeightMismatchError
from hf2q_mlx.models import gemma4_moe, qwen3_5_moe
from hf2q_mlx.models.experts import ExpertLinear

needs_gxx = pytest.mark.skipif(not kernel_emulator.available(), reason="g++ is not installed")
# fp32: the same exact products summed in other orders over K and the k slots (~sqrt(kK) ulps)
FP32_TOL = 1e-5


def _route(m: int, k: int, e: int, seed: int) -> tuple[mx.array, mx.array]:
    """Distinct experts per token and gate weights (fp32, summing to 1 as top-k routing's)."""
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.permutation(e)[:k] for _ in range(m)]).astype(np.uint32)
    w = rng.random((m, k)).astype(np.float32) + 0.1
    return mx.array(ids), mx.array(w / w.sum(-1, keepdims=True))


def _h(shape: tuple, dtype, seed: int) -> mx.array:
    # fp16: h / 32 keeps the largest outputs (Q6_K blocks at scale 0.5) inside fp16's range
    scale = 2.0**-5 if dtype == mx.float16 else 1.0
    return (scale * mx.random.normal(shape, key=mx.random.key(seed))).astype(dtype)


def _reference(h, raw, ids, wts, t, K) -> np.ndarray:
    """fp32 weighted sum of the down projections, float64 numpy: expert_down_reference, or
    for the GPU's large cases the same math with each expert dequantized once (gather_mm)."""
    with mx.stream(mx.cpu):
        if ids.size * raw.shape[1] * K <= 1 << 24:
            out = D.expert_down_reference(h.astype(mx.float32), mx.array(raw), ids, wts, t, K)
        else:
            wf = dequantize_reference(mx.array(raw), t, K).swapaxes(-1, -2)
            y = mx.gather_mm(h.astype(mx.float32)[..., None, :], wf, rhs_indices=ids)
            out = (y.squeeze(-2) * wts[..., None]).sum(axis=-2)
        return np.array(out).astype(np.float64)


def _check(out: mx.array, h, raw, ids, wts, t, K) -> None:
    """Per token: relative 2-norm error <= FP32_TOL against fp32 math; fp16/bf16 h: at most
    twice the error of that fp32 result rounded to h's dtype (floored at FP32_TOL)."""
    ref = _reference(h, raw, ids, wts, t, K)
    assert out.dtype == h.dtype and out.shape == ref.shape
    assert_rows_close(out, ref, h.dtype)


# (type, h dtype, tokens, k, E, N, K, config): Gemma-4-26B-A4B's down rows are Q5_0 (K 704 is
# not a multiple of 256); N past a threadgroup's rows, K of 11 blocks / 3 super-blocks
_EMU_CASES = [
    (T.Q5_0, mx.float32, 3, 2, 6, 9, 352, None),
    (T.Q4_K, mx.bfloat16, 2, 3, 5, 7, 768, None),
    (T.Q6_K, mx.float16, 1, 8, 9, 5, 2304, {"R": 3, "U": 2, "W": 3}),
]
_IDS = [f"{c[0].name}-{c[1]}-M{c[2]}k{c[3]}" for c in _EMU_CASES]


def _case(i: int):
    t, dt, m, k, e, n, kk, _ = _EMU_CASES[i]
    raw = _experts(t, e, n, kk, seed=i)
    ids, wts = _route(m, k, e, seed=100 + i)
    return _h((m, k, kk), dt, seed=i), _poisoned(raw, ids), ids, wts, raw


@pytest.fixture(scope="module")
def emulated():
    if not kernel_emulator.available():
        pytest.skip("g++ is not installed")
    outs = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Kernel, "__call__", kernel_emulator.kernel_call)
        for i, c in enumerate(_EMU_CASES):
            h, w, ids, wts, _ = _case(i)
            outs[i] = D.expert_down_kernel(h, w, ids, wts, c[0], c[6], config=c[7])
    return outs


@pytest.mark.parametrize("i", range(len(_EMU_CASES)), ids=_IDS)
def test_kernel_logic_on_the_emulator(emulated, i):
    h, _, ids, wts, raw = _case(i)
    _check(emulated[i], h, raw, ids, wts, _EMU_CASES[i][0], _EMU_CASES[i][6])


@needs_gxx
def test_bad_and_poisoned_ids_give_nan_rows_on_the_emulator(monkeypatch):
    """Token 0 selects a poisoned expert, token 1 an id past E: NaN rows; token 2 exact."""
    t, dt, _, k, e, n, kk, _ = _EMU_CASES[0]  # its instantiation
    raw = _experts(t, e, n, kk, seed=11)
    ids = mx.array([[2, 3], [e, 0], [4, 2]], dtype=mx.uint32)
    _, wts = _route(3, k, e, seed=1)
    w = _poisoned(raw, mx.array([2, 0, 4]))  # expert 3 poisoned although token 0 selects it
    h = _h((3, k, kk), dt, seed=9)
    monkeypatch.setattr(Kernel, "__call__", kernel_emulator.kernel_call)
    out = np.array(D.expert_down_kernel(h, w, ids, wts, t, kk))
    assert np.isnan(out[0]).all() and np.isnan(out[1]).all()
    _check(mx.array(out[2:]), h[2:], raw, ids[2:], wts[2:], t, kk)


@needs_gxx
def test_dispatcher_on_the_emulator(monkeypatch):
    """1..32 tokens: one launch (batch dims kept, int32 ids, bf16 weights, a cached plan on
    repeat); 33 tokens: expert_matmul, then the weighted sum; caller errors raise."""
    t, dt, _, k, e, n, kk, _ = _EMU_CASES[0]  # its instantiation
    raw = _experts(t, e, n, kk, seed=12)
    emu = Emulated(D._KERNELS[t])
    monkeypatch.setitem(D._KERNELS, t, emu)
    monkeypatch.setattr(D, "backend", lambda: "cuda")
    monkeypatch.setattr(D, "_CALLS", {})
    ids, wts = _route(32, k, e, seed=1)
    h = _h((4, 8, k, kk), dt, seed=2)
    y = D.expert_down(h, mx.array(raw), ids.reshape(4, 8, k).astype(mx.int32),
                      wts.reshape(4, 8, k).astype(mx.bfloat16), t, kk)  # fmt: skip
    assert emu.launches == 1 and y.shape == (4, 8, n)
    wts16 = wts.astype(mx.bfloat16).astype(mx.float32)
    _check(y.reshape(32, n), h.reshape(32, k, kk), raw, ids, wts16, t, kk)
    ids33, wts33 = _route(33, k, e, seed=3)
    h33 = _h((33, k, kk), dt, seed=4)
    with ck.reference_only():  # expert_matmul's own dispatcher on its reference
        y33 = D.expert_down(h33, mx.array(raw), ids33, wts33, t, kk)
    assert emu.launches == 1
    _check(y33, h33, raw, ids33, wts33, t, kk)
    with pytest.raises(WeightMismatchError):
        D.expert_down(h[..., :32], mx.array(raw), ids.reshape(4, 8, k), wts.reshape(4, 8, k),
                      t, kk)  # fmt: skip


@needs_gxx
@pytest.mark.parametrize("model", ["gemma4", "qwen3_5_moe"])
def test_model_experts_use_the_kernels(model, monkeypatch):
    """A whole routed-expert block over GGML experts with kernels on (the CPU standing in for
    the GPU, the gate/up and down kernels emulated, every other dispatcher on its reference):
    one launch each, the reference path's result to fp32 noise."""
    # instantiations built for expert_glu's and this file's other tests; F = 32: the down
    # projection's rows are one Q5_0 block
    t, e, F, hidden, k = T.Q4_K, 6, 32, 768, 2
    gate_up = ExpertLinear(e, hidden, 2 * F, t)
    gate_up.weight = mx.array(_experts(t, e, 2 * F, hidden, seed=13))
    down = ExpertLinear(e, F, hidden, T.Q5_0)
    down.weight = mx.array(_experts(T.Q5_0, e, hidden, F, seed=14))
    if model == "gemma4":
        experts = gemma4_moe.Experts(hidden, F, e, "gelu_tanh")
    else:
        experts = qwen3_5_moe.Experts(hidden, F, e, fused_gate_up=True)
    experts.gate_up_proj, experts.down_proj = gate_up, down
    ids, wts = _route(2, k, e, seed=15)
    x = 0.02 * mx.random.normal((2, hidden), key=mx.random.key(16))
    glu, dn = Emulated(G._KERNELS[t]), Emulated(D._KERNELS[T.Q5_0])
    with mx.stream(mx.cpu):
        want = experts(x, ids, wts)
        monkeypatch.setattr(ck, "_gpu", ("cuda", mx.default_device(), mx.default_device))
        monkeypatch.setitem(G._KERNELS, t, glu)
        monkeypatch.setitem(D._KERNELS, T.Q5_0, dn)
        monkeypatch.setattr(G, "_CALLS", {})
        monkeypatch.setattr(D, "_CALLS", {})
        got = experts(x, ids, wts)
    assert glu.launches == 1 and dn.launches == 1 and got.shape == want.shape == (2, hidden)
    ref = np.array(want)
    assert np.abs(np.array(got) - ref).max() <= FP32_TOL * np.abs(ref).max()


# ---------------------------------------------------------------------------------------------
# GPU: every type x dtype, the bench models' down shapes, outputs and unselected experts poisoned

TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
# (E, N, K): odd tiny; Gemma-4-26B-A4B's down (N 2816, K 704: 32-weight blocks only) and
# Qwen3.5-35B-A3B's (N 2048, K 512), fewer experts (only the selected ones are read)
SHAPES = [(5, 7, 256), (16, 2816, 704), (12, 2048, 512)]
ROUTES = [(1, 8), (3, 2), (32, 8)]


@requires_gpu
@pytest.mark.parametrize("e,n,kk", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("m,k", ROUTES)
def test_gpu_kernel_matches_reference(m, k, dtype, t, e, n, kk):
    if kk % (256 if "_K" in t.name else 32) or k > e:
        pytest.skip("K not a multiple of the block / more slots than experts")
    raw = _experts(t, e, n, kk, seed=n)
    ids, wts = _route(m, k, e, seed=m * 7 + k + n)
    h = _h((m, k, kk), dtype, seed=m + n)
    out = D.expert_down_kernel(h, _poisoned(raw, ids), ids, wts, t, kk, init_value=float("nan"))
    mx.eval(out)
    _check(out, h, raw, ids, wts, t, kk)
