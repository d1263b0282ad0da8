"""expert_glu_affine and expert_down_affine: the routed experts' gate, up and activation, and
their down projections with the weighted sum, over MLX affine weights, one kernel each; their
CUDA renderings on the CPU emulator and on a GPU against fp32 reference math, with the scales and
biases of every unselected expert poisoned (NaN) so that reading one shows; the dispatchers and
the models' wiring."""

from __future__ import annotations

import kernel_emulator
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import requires_gpu
from kernel_emulator import Emulated
from test_expert_glu import assert_rows_close

import hf2q_mlx.custom_kernels as ck
from hf2q_mlx.custom_kernels import expert_down_affine as AD
from hf2q_mlx.custom_kernels import expert_glu_affine as A
from hf2q_mlx.custom_kernels._render import Kernel
from hf2q_mlx.errors import InvalidArgumentError, WeightMismatchError
from hf2q_mlx.models import gemma4_moe, ops, qwen3_5_moe
from hf2q_mlx.models.experts import QuantizedExpertLinear

needs_gxx = pytest.mark.skipif(not kernel_emulator.available(), reason="g++ is not installed")
# fp32: kernel and reference sum the same products in different orders (~sqrt(K) ulps of each
# projection); the activation keeps that order of error.
FP32_TOL = 1e-5


_W_CACHE: dict = {}


def _experts(e: int, rows: int, k: int, gs: int, bits: int, dtype, seed: int):
    """Random float experts quantized by mx.quantize (codes, scales, biases) on the CPU;
    cached per argument set."""
    key = (e, rows, k, gs, bits, dtype, seed)
    if key not in _W_CACHE:
        with mx.stream(mx.cpu):
            w = mx.random.normal((e, rows, k), key=mx.random.key(seed)) * k**-0.5
            q = mx.quantize(w.astype(dtype), group_size=gs, bits=bits)
            mx.eval(q)
        _W_CACHE[key] = tuple(q)
    return _W_CACHE[key]


def _poisoned(arrays, ids: mx.array) -> tuple[mx.array, ...]:
    """The experts ``ids`` does not select get NaN scales and biases."""
    wq, s, b = (mx.array(a) for a in arrays)
    keep = np.zeros(wq.shape[0], dtype=bool)
    sel = np.array(ids).reshape(-1).astype(np.int64)
    keep[sel[sel < wq.shape[0]]] = True
    nan = mx.array(~keep)[:, None, None]
    return wq, mx.where(nan, mx.nan, s), mx.where(nan, mx.nan, b)


def _ids(m: int, k: int, e: int, seed: int) -> mx.array:
    rng = np.random.default_rng(seed)
    return mx.array(np.stack([rng.permutation(e)[:k] for _ in range(m)]).astype(np.uint32))


def _x(shape: tuple, dtype, seed: int) -> mx.array:
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)


def _split(arrays, f: int, fused: bool):
    """(gate_up, up) as the kernel takes them: fused rows, or the halves as two stacks."""
    arrays = tuple(mx.array(a) for a in arrays)
    if fused:
        return arrays, None
    return tuple(a[:, :f] for a in arrays), tuple(a[:, f:] for a in arrays)


def _check(out: mx.array, x, arrays, ids, gs, bits, act) -> None:
    """Per (token, slot) row: relative 2-norm error <= FP32_TOL against fp32 math; fp16/bf16 x:
    at most twice the error of that fp32 result rounded to x's dtype (floored at FP32_TOL)."""
    with mx.stream(mx.cpu):
        gate_up = tuple(mx.array(a) for a in arrays)
        if ids.size * gate_up[0].shape[1] * x.shape[-1] <= 1 << 24:
            ref = A.expert_glu_affine_reference(x.astype(mx.float32), gate_up, ids, gs, bits, act)
        else:  # the GPU's large cases: the same math, each expert dequantized once (gather_mm)
            wq, sc, bi = gate_up
            w = mx.dequantize(wq, sc.astype(mx.float32), bi.astype(mx.float32), group_size=gs,
                              bits=bits)  # fmt: skip
            xs = x.astype(mx.float32)
            if xs.ndim == ids.ndim:
                xs = mx.broadcast_to(xs[..., None, :], (*ids.shape, xs.shape[-1]))
            y = mx.gather_mm(xs[..., None, :], w.swapaxes(-1, -2), rhs_indices=ids).squeeze(-2)
            g, u = mx.split(y, 2, axis=-1)
            ref = A.activations.gated_activation_reference(g, u, act)
        ref = np.array(ref).astype(np.float64)
    assert out.dtype == x.dtype and out.shape == ref.shape
    assert_rows_close(out, ref, x.dtype)


# (x dtype, bits, group size, activation, fused, tokens, k, per-slot x, E, F, K): F odd (a
# feature past F in the last threadgroup), K not a multiple of a SIMD group's 32 chunks
_EMU_CASES = [
    (mx.bfloat16, 4, 64, "gelu_tanh", True, 3, 2, False, 6, 9, 320),
    (mx.float32, 8, 32, "silu", False, 2, 3, True, 7, 5, 96),
    (mx.float16, 4, 128, "silu", True, 1, 4, False, 5, 3, 1152),
]
_IDS = [f"{c[0]}-q{c[1]}g{c[2]}-{c[3]}-{'fused' if c[4] else 'split'}" for c in _EMU_CASES]


def _case(i: int):
    dt, bits, gs, act, fused, m, k, per_slot, e, f, kk = _EMU_CASES[i]
    arrays = _experts(e, 2 * f, kk, gs, bits, dt, seed=i)
    ids = _ids(m, k, e, seed=100 + i)
    x = _x((m, k, kk) if per_slot else (m, kk), dt, seed=i)
    gate_up, up = _split(_poisoned(arrays, ids), f, fused)
    return x, gate_up, up, ids, arrays


@pytest.fixture(scope="module")
def emulated():
    if not kernel_emulator.available():
        pytest.skip("g++ is not installed")
    outs = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Kernel, "__call__", kernel_emulator.kernel_call)
        for i, c in enumerate(_EMU_CASES):
            x, gate_up, up, ids, _ = _case(i)
            outs[i] = A.expert_glu_affine_kernel(x, gate_up, ids, c[2], c[1], c[3], up)
    return outs


@pytest.mark.parametrize("i", range(len(_EMU_CASES)), ids=_IDS)
def test_kernel_logic_on_the_emulator(emulated, i):
    x, _, _, ids, arrays = _case(i)
    c = _EMU_CASES[i]
    _check(emulated[i], x, arrays, ids, c[2], c[1], c[3])


@needs_gxx
def test_bad_and_poisoned_ids_give_nan_rows_on_the_emulator(monkeypatch):
    """Pair (0, 1) selects a poisoned expert: NaN row; ids E and past E: NaN rows, nothing
    read; the other pairs exact."""
    dt, bits, gs, act, _, _, _, _, e, f, kk = _EMU_CASES[0]  # its instantiation
    arrays = _experts(e, 2 * f, kk, gs, bits, dt, seed=11)
    ids = mx.array([[2, 3], [e, 0], [e + 7, 2]], dtype=mx.uint32)
    gate_up = _poisoned(arrays, mx.array([2, 0]))  # expert 3 poisoned although selected
    x = _x((3, kk), dt, seed=9)
    monkeypatch.setattr(Kernel, "__call__", kernel_emulator.kernel_call)
    out = np.array(A.expert_glu_affine_kernel(x, gate_up, ids, gs, bits, act).astype(mx.float32))
    assert np.isnan(out[:, 0]).sum() == 2 * f and np.isnan(out[0, 1]).all()
    good = mx.array([[2], [0], [2]], dtype=mx.uint32)
    picked = mx.array(out[[0, 1, 2], [0, 1, 1]][:, None]).astype(dt)
    _check(picked, x, arrays, good, gs, bits, act)


@needs_gxx
def test_dispatcher_on_the_emulator(monkeypatch):
    """1..32 tokens: one launch (batch dims kept, int32 ids, a cached plan on repeat); 33 tokens
    and 2-bit codes: the reference; caller errors raise."""
    dt, bits, gs, act, _, _, _, _, e, f, kk = _EMU_CASES[1]  # its instantiation (split halves)
    arrays = _experts(e, 2 * f, kk, gs, bits, dt, seed=12)
    gate_up, up = _split(arrays, f, False)
    emu = Emulated(A._kernel)
    monkeypatch.setattr(A, "_kernel", emu)
    monkeypatch.setattr(A, "backend", lambda: "cuda")
    monkeypatch.setattr(A, "_CALLS", {})
    ids = _ids(32, 3, e, seed=1).reshape(4, 8, 3).astype(mx.int32)
    x = _x((4, 8, kk), dt, seed=2)
    y = A.expert_glu_affine(x, gate_up, ids, gs, bits, act, up)
    assert emu.launches == 1 and y.shape == (4, 8, 3, f)
    _check(y.reshape(32, 3, f), x.reshape(32, kk), arrays, ids.reshape(32, 3), gs, bits, act)
    assert mx.array_equal(A.expert_glu_affine(x, gate_up, ids, gs, bits, act, up), y)
    assert emu.launches == 2 and len(A._CALLS) == 1
    ids33, x33 = _ids(33, 2, e, seed=3), _x((33, kk), dt, seed=4)
    _check(A.expert_glu_affine(x33, gate_up, ids33, gs, bits, act, up), x33, arrays, ids33, gs,
           bits, act)  # fmt: skip
    assert emu.launches == 2
    with pytest.raises(WeightMismatchError):
        A.expert_glu_affine(x[..., :64], gate_up, ids, gs, bits, act, up)
    with pytest.raises(InvalidArgumentError):
        A.expert_glu_affine(x, gate_up, ids, gs, bits, "relu", up)


@needs_gxx
@pytest.mark.parametrize("model", ["gemma4", "qwen3_5_moe"])
def test_model_experts_use_the_kernel(model, monkeypatch):
    """MLX affine experts (nn.quantize's QuantizedExpertLinear) with kernels on (the CPU standing
    in for the GPU, this kernel emulated, every other dispatcher on its reference): one launch
    for gate, up and the activation, the reference path's result to fp32 noise."""
    dt, bits, gs, act, _, _, k, _, e, f, kk = _EMU_CASES[1]  # its instantiation (fp32, silu)
    if model == "qwen3_5_moe":
        experts = qwen3_5_moe.Experts(kk, f, e, fused_gate_up=True)
    else:
        experts = gemma4_moe.Experts(kk, f, e, act)
    arrays = _experts(e, 2 * f, kk, gs, bits, dt, seed=13)
    experts.gate_up_proj = QuantizedExpertLinear(*(mx.array(a) for a in arrays), gs, bits,
                                                 "affine")  # fmt: skip
    ids, x = _ids(2, k, e, seed=14), _x((2, kk), dt, seed=15)
    emu = Emulated(A._kernel)

    def glu():
        return ops.expert_glu(x, ids, experts.gate_up_proj, None, act)

    with mx.stream(mx.cpu):
        want = glu()
        monkeypatch.setattr(ck, "_gpu", ("cuda", mx.default_device(), mx.default_device))
        monkeypatch.setattr(A, "_kernel", emu)
        monkeypatch.setattr(A, "_CALLS", {})
        got = glu()
    assert emu.launches == 1
    _check(got, x, arrays, ids, gs, bits, act)
    ref = np.array(want)  # gather_qmm, then the activation: fp32 noise apart
    assert np.abs(np.array(got) - ref).max() <= FP32_TOL * np.abs(ref).max()


# ---------------------------------------------------------------------------------------------
# GPU: the MLX 4-bit benches' shapes (groups of 64), 8 bits, every dtype, outputs poisoned

# (E, F, K): odd tiny; Gemma-4-26B-A4B's (F 704, K 2816) and Qwen3.5-35B-A3B's (F 512, K 2048)
# experts, fewer of them (the kernel reads only the selected ones)
SHAPES = [(5, 7, 256), (16, 704, 2816), (12, 512, 2048)]
ROUTES = [(1, 8, False, True), (3, 2, True, False), (32, 8, False, True)]


@requires_gpu
@pytest.mark.parametrize("e,f,kk", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("bits,gs", [(4, 64), (8, 64), (4, 32)], ids=["q4g64", "q8g64", "q4g32"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("m,k,per_slot,fused", ROUTES)
def test_gpu_kernel_matches_reference(m, k, per_slot, fused, dtype, bits, gs, e, f, kk):
    if k > e:
        pytest.skip("more slots than experts")
    arrays = _experts(e, 2 * f, kk, gs, bits, dtype, seed=f + bits)
    ids = _ids(m, k, e, seed=m * 7 + k + f)
    x = _x((m, k, kk) if per_slot else (m, kk), dtype, seed=m + f)
    act = "silu" if fused else "gelu_tanh"
    gate_up, up = _split(_poisoned(arrays, ids), f, fused)
    out = A.expert_glu_affine_kernel(x, gate_up, ids, gs, bits, act, up, init_value=float("nan"))
    mx.eval(out)
    _check(out, x, arrays, ids, gs, bits, act)


# ---------------------------------------------------------------------------------------------
# expert_down_affine: the down projections and their weighted sum, same weights and helpers


def _route_weights(m: int, k: int, seed: int) -> mx.array:
    w = np.random.default_rng(seed).random((m, k)).astype(np.float32) + 0.1
    return mx.array(w / w.sum(-1, keepdims=True))


def _check_down(out: mx.array, h, arrays, ids, wts, gs, bits) -> None:
    """Per token: relative 2-norm error <= FP32_TOL against fp32 math; fp16/bf16 h: at most
    twice the error of that fp32 result rounded to h's dtype (floored at FP32_TOL)."""
    with mx.stream(mx.cpu):
        down = tuple(mx.array(a) for a in arrays)
        if ids.size * down[0].shape[1] * h.shape[-1] <= 1 << 24:
            ref = AD.expert_down_affine_reference(h.astype(mx.float32), down, ids, wts, gs, bits)
        else:  # the GPU's large cases: each expert dequantized once (gather_mm)
            wq, sc, bi = down
            w = mx.dequantize(wq, sc.astype(mx.float32), bi.astype(mx.float32), group_size=gs,
                              bits=bits)  # fmt: skip
            y = mx.gather_mm(h.astype(mx.float32)[..., None, :], w.swapaxes(-1, -2),
                             rhs_indices=ids).squeeze(-2)  # fmt: skip
            ref = (y * wts[..., None]).sum(axis=-2)
        ref = np.array(ref).astype(np.float64)
    assert out.dtype == h.dtype and out.shape == ref.shape
    assert_rows_close(out, ref, h.dtype)


# (h dtype, bits, group size, tokens, k, E, N, K): N past a threadgroup's rows, K of 1-3 chunk
# rounds; Gemma-4-26B-A4B's down rows are 704 wide
_DOWN_CASES = [
    (mx.bfloat16, 4, 64, 3, 2, 6, 9, 704),
    (mx.float32, 8, 32, 2, 3, 5, 7, 96),
]


@needs_gxx
@pytest.mark.parametrize("i", range(len(_DOWN_CASES)), ids=["bf16-q4g64", "f32-q8g32"])
def test_down_kernel_logic_on_the_emulator(i, monkeypatch):
    dt, bits, gs, m, k, e, n, kk = _DOWN_CASES[i]
    arrays = _experts(e, n, kk, gs, bits, dt, seed=20 + i)
    ids, wts = _ids(m, k, e, seed=30 + i), _route_weights(m, k, seed=i)
    h = _x((m, k, kk), dt, seed=40 + i)
    monkeypatch.setattr(Kernel, "__call__", kernel_emulator.kernel_call)
    out = AD.expert_down_affine_kernel(h, _poisoned(arrays, ids), ids, wts, gs, bits)
    _check_down(out, h, arrays, ids, wts, gs, bits)


@needs_gxx
def test_down_bad_ids_and_dispatcher_on_the_emulator(monkeypatch):
    """A token with an id past E or a poisoned expert: NaN row, the others exact; the
    dispatcher: one launch for 1..32 tokens (batch dims kept), the reference for 33, and the
    models' Experts take it for nn.quantize'd down projections."""
    dt, bits, gs, _, k, e, n, kk = _DOWN_CASES[1]  # its instantiation
    arrays = _experts(e, n, kk, gs, bits, dt, seed=21)
    ids = mx.array([[2, 3, 1], [e, 0, 1], [4, 2, 0]], dtype=mx.uint32)
    wts, h = _route_weights(3, k, seed=2), _x((3, k, kk), dt, seed=3)
    monkeypatch.setattr(Kernel, "__call__", kernel_emulator.kernel_call)
    out = np.array(AD.expert_down_affine_kernel(h, _poisoned(arrays, mx.array([2, 1, 0, 4])),
                                                ids, wts, gs, bits))  # fmt: skip
    assert np.isnan(out[0]).all() and np.isnan(out[1]).all()  # expert 3 poisoned; id E
    _check_down(mx.array(out[2:]), h[2:], arrays, ids[2:], wts[2:], gs, bits)

    emu = Emulated(AD._kernel)
    monkeypatch.setattr(AD, "_kernel", emu)
    monkeypatch.setattr(AD, "backend", lambda: "cuda")
    monkeypatch.setattr(AD, "_CALLS", {})
    down = tuple(mx.array(a) for a in arrays)
    ids32, wts32 = _ids(32, k, e, seed=4), _route_weights(32, k, seed=5)
    h32 = _x((4, 8, k, kk), dt, seed=6)
    y = AD.expert_down_affine(h32, down, ids32.reshape(4, 8, k), wts32.reshape(4, 8, k), gs, bits)
    assert emu.launches == 1 and y.shape == (4, 8, n)
    _check_down(y.reshape(32, n), h32.reshape(32, k, kk), arrays, ids32, wts32, gs, bits)
    ids33, wts33, h33 = (
        _ids(33, k, e, seed=7),
        _route_weights(33, k, seed=8),
        _x((33, k, kk), dt, 9),
    )
    _check_down(AD.expert_down_affine(h33, down, ids33, wts33, gs, bits), h33, arrays, ids33,
                wts33, gs, bits)  # fmt: skip
    assert emu.launches == 1
    with pytest.raises(WeightMismatchError):
        AD.expert_down_affine(h32[..., :64], down, ids32.reshape(4, 8, k), wts32.reshape(4, 8, k),
                              gs, bits)  # fmt: skip

    # the models' op (ops.expert_down) on an nn.quantize'd stack, kernels on
    layer = QuantizedExpertLinear(*down, gs, bits, "affine")
    good = mx.repeat(ids[2:], 3, axis=0)
    with mx.stream(mx.cpu):
        want = ops.expert_down(h, good, wts, layer)  # gather_qmm, then the weighted sum
        monkeypatch.setattr(ck, "_gpu", ("cuda", mx.default_device(), mx.default_device))
        got = ops.expert_down(h, good, wts, layer)
    assert emu.launches == 2
    ref = np.array(want)
    assert np.abs(np.array(got) - ref).max() <= FP32_TOL * np.abs(ref).max()


@requires_gpu
@pytest.mark.parametrize("e,n,kk", [(5, 7, 256), (16, 2816, 704), (12, 2048, 512)],
                         ids=lambda v: str(v))  # fmt: skip
@pytest.mark.parametrize("bits,gs", [(4, 64), (8, 64), (4, 32)], ids=["q4g64", "q8g64", "q4g32"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("m,k", [(1, 8), (3, 2), (32, 8)])
def test_gpu_down_kernel_matches_reference(m, k, dtype, bits, gs, e, n, kk):
    if k > e:
        pytest.skip("more slots than experts")
    arrays = _experts(e, n, kk, gs, bits, dtype, seed=n + bits)
    ids, wts = _ids(m, k, e, seed=m * 7 + k + n), _route_weights(m, k, seed=m)
    h = _x((m, k, kk), dtype, seed=m + n)
    out = AD.expert_down_affine_kernel(h, _poisoned(arrays, ids), ids, wts, gs, bits,
                                       init_value=float("nan"))  # fmt: skip
    mx.eval(out)
    _check_down(out, h, arrays, ids, wts, gs, bits)


# --------------------------------------------------------------------------------------------
# A dense MLP's fused [gate | up] MLX affine rows (kernel_linears.KernelQuantizedLinear.glu):
# the same kernel over one expert, so a decode runs one launch instead of the mat-vec and the
# activation (session 40: one launch a layer fewer on the MLX 4-bit shapes)


def _dense_glu_layer(f: int, kk: int, gs: int, bits: int, dt, seed: int):
    from hf2q_mlx.models import kernel_linears

    layer = nn.QuantizedLinear(kk, 2 * f, bias=False, group_size=gs, bits=bits)
    wq, sc, bi = (a[0] for a in _experts(1, 2 * f, kk, gs, bits, dt, seed=seed))
    layer.weight, layer.scales, layer.biases = wq, sc, bi
    kernel_linears.use_kernels(layer)
    return layer, (wq[None], sc[None], bi[None])


@needs_gxx
@pytest.mark.parametrize("dt,bits,gs,act,shape", [
    (mx.bfloat16, 4, 64, "gelu_tanh", (1, 1)),
    (mx.float32, 8, 32, "silu", (3, 1)),
    (mx.float16, 4, 128, "silu", (32,)),
], ids=["bf16-q4-B1", "fp32-q8-B3", "fp16-q4-32rows"])  # fmt: skip
def test_dense_affine_glu_is_one_launch_on_the_emulator(monkeypatch, dt, bits, gs, act, shape):
    """ops.gated_projection on an MLX affine kernel linear of fused [gate | up] rows, 1..32 rows
    of x, CUDA standing in: one launch of this kernel (no mat-vec, no activation launch), within
    the kernel's tolerance of fp32 math; 33 rows: not taken (the prompt path)."""
    from hf2q_mlx.custom_kernels import dense_matvec
    from hf2q_mlx.models import kernel_linears

    f, kk = 9, 320 if gs != 128 else 1152
    layer, arrays = _dense_glu_layer(f, kk, gs, bits, dt, seed=21)
    emu = Emulated(A._kernel)
    monkeypatch.setattr(A, "_kernel", emu)
    for mod in (A, kernel_linears, ck, dense_matvec):
        monkeypatch.setattr(mod, "backend", lambda: "cuda")
    monkeypatch.setattr(A, "_DENSE_CALLS", {})
    monkeypatch.setattr(ops, "gated_activation", None)  # a second launch would call it
    monkeypatch.setattr(dense_matvec, "affine_matvec", None)
    x = _x((*shape, kk), dt, seed=22)
    y = ops.gated_projection(layer, x, act)
    assert emu.launches == 1 and y.shape == (*shape, f) and y.dtype == dt
    rows = x.size // kk
    zeros = mx.zeros((rows, 1), dtype=mx.uint32)
    _check(y.reshape(rows, 1, f), x.reshape(rows, kk), arrays, zeros, gs, bits, act)
    assert layer.glu(_x((33, kk), dt, seed=23), act) is None  # a prompt: the linear's own path
    assert layer.glu(x, "relu") is None and emu.launches == 1
    monkeypatch.setenv("HF2Q_AFFINE_DENSE_GLU", "0")  # off: the two launches again
    assert layer.glu(x, act) is None
    monkeypatch.setenv("HF2Q_AFFINE_DENSE_GLU", "2")
    with pytest.raises(InvalidArgumentError, match="HF2Q_AFFINE_DENSE_GLU"):
        layer.glu(x, act)


@requires_gpu
def test_gpu_dense_affine_glu_matches_fp32_math():
    """On a GPU: the dense GLU at Gemma-4-26B-A4B's shared MLP (2 x 2112 rows of K 2816, MLX
    4-bit, groups of 64), bf16 x of 1 and 4 rows, within twice the error of fp32 math rounded
    to bf16, and equal to the experts' kernel over the same rows as expert 0."""
    from hf2q_mlx.custom_kernels import backend

    if backend() is None:
        pytest.skip("no GPU back end")
    layer, arrays = _dense_glu_layer(2112, 2816, 64, 4, mx.bfloat16, seed=31)
    for rows in (1, 4):
        x = _x((rows, 1, 2816), mx.bfloat16, seed=32 + rows)
        y = layer.glu(x, "gelu_tanh")
        assert y is not None and y.shape == (rows, 1, 2112)
        zeros = mx.zeros((rows, 1), dtype=mx.uint32)
        _check(y.reshape(rows, 1, 2112), x.reshape(rows, 2816), arrays, zeros, 64, 4, "gelu_tanh")
        want = A.expert_glu_affine_kernel(x.reshape(rows, 2816), arrays, zeros, 64, 4, "gelu_tanh")
        np.testing.assert_array_equal(np.array(y.reshape(rows, 1, 2112).astype(mx.float32)),
                                      np.array(want.astype(mx.float32)))  # fmt: skip
