"""Top-k / argmax over the vocabulary and the fused lm_head + top-k: references against numpy,
the kernel bodies on the CPU emulation (test_norm_rope.Emulated), the kernels on a GPU."""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import numpy as np
import pytest
from conftest import requires_gpu
from gguf import GGMLQuantizationType as GT
from gguf import quants
from test_norm_rope import emulate, needs_gxx

from hf2q_mlx.custom_kernels import lm_head_topk as lm
from hf2q_mlx.custom_kernels import sampling as smp
from hf2q_mlx.custom_kernels.dequant import dequantize_reference
from hf2q_mlx.io.random_weights import random_ggml_blocks


def np_topk(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Largest first, equal values by lowest index; rows of a 2-D array."""
    x = np.asarray(x, np.float64)
    order = np.stack([np.lexsort((np.arange(x.shape[-1]), -row))[:k] for row in x])
    return np.take_along_axis(x, order, -1), order


def tied_logits(shape, seed, dtype=mx.float32) -> mx.array:
    """Random logits with many exact ties (rounded to 1/4), some -inf and a -0.0 / +0.0 pair."""
    rng = np.random.default_rng(seed)
    x = np.round(rng.standard_normal(shape) * 8) / 4
    x[..., rng.integers(0, shape[-1], 5)] = -np.inf
    x[..., 3], x[..., 1] = -0.0, 0.0
    return mx.array(x.astype(np.float32)).astype(dtype)


# ---- references on the CPU ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=str)
@pytest.mark.parametrize("k", [1, 7, 64])
def test_topk_reference_against_numpy(dtype, k):
    x = tied_logits((3, 2000), k, dtype)
    vals, idx = smp.topk_reference(x, k)
    want_v, want_i = np_topk(np.array(x.astype(mx.float32)), k)
    assert vals.dtype == dtype and idx.dtype == mx.uint32 and idx.shape == (3, k)
    np.testing.assert_array_equal(np.array(idx), want_i)
    np.testing.assert_array_equal(np.array(vals.astype(mx.float32)), want_v)
    assert mx.array_equal(smp.argmax_reference(x), idx[:, 0])


def test_topk_reference_all_minus_inf_and_errors():
    x = mx.full((1, 10), -np.inf)
    np.testing.assert_array_equal(np.array(smp.topk_reference(x, 3)[1]), [[0, 1, 2]])
    with pytest.raises(ValueError):
        smp.topk(x, 11)
    with pytest.raises(ValueError):
        smp.topk(x, 0)
    # CPU dispatcher: the reference
    y = tied_logits((2, 500), 1)
    assert mx.array_equal(smp.topk(y, 4)[1], smp.topk_reference(y, 4)[1])
    assert mx.array_equal(smp.argmax(y), mx.argmax(y, axis=-1))


def q8_0_weight(V: int, H: int, seed: int) -> tuple[mx.array, np.ndarray]:
    """Raw Q8_0 blocks (V, row_bytes) uint8 and their dequantized values (float64)."""
    w = np.random.default_rng(seed).standard_normal((V, H)).astype(np.float32) * 0.05
    raw = quants.quantize(w, GT.Q8_0)
    return mx.array(raw), quants.dequantize(raw, GT.Q8_0).astype(np.float64)


def np_head(x, w64, cap=None):
    logits = np.asarray(x.astype(mx.float32), np.float64).reshape(-1, w64.shape[1]) @ w64.T
    return cap * np.tanh(logits / cap) if cap else logits


@pytest.mark.parametrize("cap", [None, 30.0])
def test_lm_head_reference_against_numpy(cap):
    rng = np.random.default_rng(3)
    x = mx.array(rng.standard_normal((2, 64)).astype(np.float32))
    raw, w64 = q8_0_weight(300, 64, 4)
    vals, idx = lm.lm_head_topk_reference(x, raw, 5, softcap=cap, ggml_type=GT.Q8_0)
    want_v, want_i = np_topk(np_head(x, w64, cap), 5)
    np.testing.assert_array_equal(np.array(idx), want_i)
    np.testing.assert_allclose(np.array(vals), want_v, rtol=1e-5, atol=1e-6)
    # the CPU dispatcher is the reference
    assert mx.array_equal(lm.lm_head_topk(x, raw, 5, softcap=cap, ggml_type=GT.Q8_0)[1], idx)
    with pytest.raises(ValueError):
        lm.lm_head_topk(x, raw, 0, ggml_type=GT.Q8_0)


def test_lm_head_plan():
    assert lm.plan(262144, 1, 640, 5) == (32, 1, 768)  # ~1024 threadgroups
    assert lm.plan(1000, 16, 640, 5) == (1, 10, 7680)  # batch rows in groups of 10
    assert lm.plan(262144, 2, 5376, 5)[1] == 1
    assert lm.plan(1000, 1, 16384, 5)[1] == 0  # x does not fit: unfused path


# ---- the kernel bodies, emulated on the CPU ----------------------------------------------------


@needs_gxx
@pytest.mark.parametrize("V,k", [(1000, 5), (9000, 3), (5000, 64)])
def test_topk_body_emulated(monkeypatch, V, k):
    emu = emulate(monkeypatch, smp, "_kernel")
    x = tied_logits((2, V), V + k)
    vals, idx = smp.topk(x, k)
    want_v, want_i = smp.topk_reference(x, k)
    # selection copies values: exact
    assert mx.array_equal(idx, want_i) and mx.array_equal(vals, want_v)
    assert emu["_kernel"].launches == (1 if V <= smp.first_pass_plan(V, k)[0] * 4 else 2)


@needs_gxx
def test_topk_body_emulated_many_merges(monkeypatch):
    emulate(monkeypatch, smp, "_kernel")
    monkeypatch.setattr(smp, "merge_plan", lambda n: (32, 2))  # 64 candidates a group
    x = tied_logits((1, 3000), 8, mx.float16)
    vals, idx = smp.topk(x, 9)
    want_v, want_i = smp.topk_reference(x, 9)
    assert mx.array_equal(idx, want_i) and mx.array_equal(vals, want_v)
    assert smp.argmax(x).item() == mx.argmax(x).item()


def _check_head(vals, idx, x, w64, k, cap, exact):
    want_v, want_i = np_topk(np_head(x, w64, cap), k)
    np.testing.assert_array_equal(np.array(idx).reshape(-1, k), want_i)
    got = np.array(vals, np.float64).reshape(-1, k)
    if exact:
        # the re-rank's Dot2 sum: the float64 logit rounded about once to fp32 (then tanh)
        np.testing.assert_allclose(got, want_v, rtol=3e-7 if cap is None else 2e-6, atol=1e-30)
    else:
        np.testing.assert_allclose(got, want_v, rtol=2e-5, atol=2e-6)  # fp32 fma sums


@needs_gxx
@pytest.mark.parametrize(
    "wkind,H,B,cap,rerank",
    [("f32", 64, 1, None, True), ("f16", 96, 3, 30.0, True), ("q8_0", 64, 2, None, False),
     ("q8_0", 128, 1, 15.0, True)],
)  # fmt: skip
def test_lm_head_body_emulated(monkeypatch, wkind, H, B, cap, rerank):
    emu = emulate(monkeypatch, lm, "_partial_kernel", "_rerank_kernel")
    emulate(monkeypatch, smp, "_kernel")
    monkeypatch.setattr(lm, "backend", lambda: "cuda")
    real_plan = lm.plan
    monkeypatch.setattr(lm, "plan", lambda V, B, H, K: (16, *real_plan(V, B, H, K)[1:]))
    V, k = 1000, 3
    rng = np.random.default_rng(H + B)
    x32 = rng.standard_normal((B, H)).astype(np.float32)
    x = mx.array(x32).astype(mx.float16 if wkind == "f16" else mx.float32)
    if wkind == "q8_0":
        w, w64 = q8_0_weight(V, H, 5)
        gtype = GT.Q8_0
    else:
        w32 = rng.standard_normal((V, H)).astype(np.float32) * 0.1
        w32[700] = w32[701] = x32[0] * 0.3  # the top row twice: the lower index ranks first
        w = mx.array(w32).astype(mx.float16 if wkind == "f16" else mx.float32)
        w64, gtype = np.array(w.astype(mx.float32), np.float64), None
    vals, idx = lm.lm_head_topk(x, w, k, softcap=cap, ggml_type=gtype, rerank=rerank)
    assert emu["_partial_kernel"].launches == 1
    assert emu["_rerank_kernel"].launches == int(rerank)
    assert vals.shape == idx.shape == (B, k) and vals.dtype == mx.float32
    _check_head(vals, idx, x, w64, k, cap, exact=rerank)


# ---- GPU ----------------------------------------------------------------------------------------


@requires_gpu
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=str)
@pytest.mark.parametrize("V", [1000, 32003, 262144])
@pytest.mark.parametrize("B,k", [(1, 1), (2, 5), (16, 64), (3, 40)])
def test_topk_gpu(dtype, V, B, k):
    x = tied_logits((B, V), V + B + k, dtype)
    vals, idx = smp.topk(x, k)
    with mx.stream(mx.cpu):
        want_v, want_i = smp.topk_reference(x, k)
    assert mx.array_equal(idx, want_i) and mx.array_equal(vals, want_v)
    assert mx.array_equal(smp.argmax(x), mx.argmax(x, axis=-1))


@requires_gpu
def test_topk_gpu_continuous_logits():
    x = mx.random.normal((4, 1, 262144), key=mx.random.key(0)) * 5  # (B, 1, V) decode logits
    vals, idx = smp.topk(x, 50)
    want_v, want_i = smp.topk_reference(x, 50)
    assert idx.shape == (4, 1, 50)
    assert mx.array_equal(idx, want_i) and mx.array_equal(vals, want_v)


HEAD_CASES = [
    # (weight, H, V, B, k, softcap)
    ("q8_0", 640, 262144, 1, 1, None),  # Gemma 3 270M tied head, greedy
    ("q8_0", 640, 262144, 4, 8, 30.0),
    ("bf16", 640, 32003, 16, 1, None),
    ("f16", 2816, 32003, 2, 5, 30.0),
    ("f32", 2816, 1000, 1, 28, None),
    ("bf16", 2816, 262144, 1, 1, 30.0),
]


@lru_cache(maxsize=4)
def _head_weight(wkind: str, V: int, H: int) -> mx.array:
    """Made on the device (a numpy Q8_0 quantization of 262144 rows takes seconds)."""
    if wkind == "q8_0":
        w = random_ggml_blocks(V, H, GT.Q8_0, seed=V + H, scale=0.05)
    else:
        dtype = {"bf16": mx.bfloat16, "f16": mx.float16, "f32": mx.float32}[wkind]
        w = (mx.random.normal((V, H), key=mx.random.key(V + H)) * 0.05).astype(dtype)
    mx.eval(w)
    return w


@requires_gpu
@pytest.mark.parametrize("case", HEAD_CASES, ids=str)
@pytest.mark.parametrize("xdtype", [mx.float32, mx.bfloat16], ids=str)
@pytest.mark.parametrize("rerank", [True, False])
def test_lm_head_topk_gpu(case, xdtype, rerank):
    wkind, H, V, B, k, cap = case
    gtype = GT.Q8_0 if wkind == "q8_0" else None
    w = _head_weight(wkind, V, H)
    x = mx.random.normal((B, H), key=mx.random.key(B + k)).astype(xdtype)
    vals, idx = lm.lm_head_topk(x, w, k, softcap=cap, ggml_type=gtype, rerank=rerank)
    _, ref_i = lm.lm_head_topk_reference(x, w, k, softcap=cap, ggml_type=gtype)
    assert vals.shape == idx.shape == (B, k)
    assert mx.array_equal(idx, ref_i)
    # the chosen rows' logits in float64
    rows = w[idx.reshape(-1)]
    rows = dequantize_reference(rows, gtype, H) if gtype is not None else rows
    rows64 = np.array(rows.astype(mx.float32), np.float64).reshape(B, k, H)
    want = np.einsum("bkh,bh->bk", rows64, np.array(x.astype(mx.float32), np.float64))
    want = cap * np.tanh(want / cap) if cap else want
    if rerank:
        # the re-rank's Dot2 sum: the exact logit rounded about once to fp32 (then tanh)
        np.testing.assert_allclose(np.array(vals), want, rtol=3e-7 if cap is None else 2e-6)
    else:
        np.testing.assert_allclose(np.array(vals), want, rtol=2e-5, atol=2e-6)  # fp32 fma sums


@requires_gpu
def test_lm_head_topk_gpu_ties_and_unfused_types():
    rng = np.random.default_rng(7)
    H, V = 640, 32003
    w32 = rng.standard_normal((V, H)).astype(np.float32) * 0.05
    x = mx.array(rng.standard_normal((2, H)).astype(np.float32))
    w32[30000] = w32[12345] = np.array(x[0]) * 0.1  # the top row twice: the lower index wins
    vals, idx = lm.lm_head_topk(x, mx.array(w32), 2)
    assert idx[0].tolist() == [12345, 30000] and vals[0, 0].item() == vals[0, 1].item()
    # a GGML type the fused kernel does not read: the quantized matmul + top-k kernels
    raw = mx.array(quants.quantize(w32[:1000], GT.Q4_0))
    w64 = quants.dequantize(np.array(raw), GT.Q4_0).astype(np.float64)
    vals, idx = lm.lm_head_topk(x, raw, 3, ggml_type=GT.Q4_0)
    _check_head(vals, idx, x, w64, 3, None, exact=False)


# ---- hf2q_mlx.cli.profile: the per-op profile of a decode step ---------------------------------


def test_profile_decode_step_tiny_model():
    from hf2q_mlx.cli.profile import format_profile, profile_decode_step, profiling
    from hf2q_mlx.models.gemma3 import Model, ModelArgs

    args = ModelArgs(
        hidden_size=64,
        num_hidden_layers=3,
        intermediate_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=300,
        head_dim=32,
        sliding_window=8,
    )
    model = Model(args)
    mx.eval(model.parameters())
    cache = model.make_cache()
    mx.eval(model(mx.array([[1, 2, 3, 4]]), cache=cache))
    want = model(mx.array([[5]]), cache=model.make_cache())  # hooks must not change results
    call_before = type(model.model.layers[0].self_attn.q_proj).__call__
    r = profile_decode_step(model, cache, 7)
    assert type(model.model.layers[0].self_attn.q_proj).__call__ is call_before  # unhooked
    assert cache[0].offset == 7  # warm-up, plain and profiled steps
    layers = {rec["layer"] for rec in r["records"]}
    assert {0, 1, 2, None} <= layers
    ops = r["by_op_ms"]
    assert {"self_attn.q_proj", "mlp.down_proj", "sdpa", "embed_tokens"} <= set(ops)
    assert abs(sum(ops.values()) - r["total_ms"]) < 1e-3 * max(1.0, r["total_ms"])
    calls = {(rec["op"], rec["layer"]): rec["calls"] for rec in r["records"]}
    assert calls[("self_attn.q_proj", 1)] == 1 and calls[("mlp", 2)] == 1
    assert "decode step" in format_profile(r)
    with profiling(model):
        got = model(mx.array([[5]]), cache=model.make_cache())
    assert mx.array_equal(got, want)
