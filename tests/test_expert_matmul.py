"""expert_matmul (reference and dispatcher) against a dense gather-then-matmul oracle."""

from __future__ import annotations

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from hf2q_mlx.custom_kernels.expert_matmul import (
    SORT_THRESHOLD,
    expert_matmul,
    expert_matmul_reference,
)
from hf2q_mlx.io.random_weights import random_ggml_blocks
from hf2q_mlx.models.gemma4_moe import ExpertLinear

E, N = 12, 24  # experts, output rows per expert


def oracle(x: np.ndarray, w: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Per token and slot, x @ W[expert].T in float64: the definition, no gathers or batching."""
    T_, k = ids.shape
    out = np.zeros((T_, k, w.shape[1]))
    for t in range(T_):
        for j in range(k):
            row = x[t] if x.ndim == 2 else x[t, j]
            out[t, j] = w[ids[t, j]].astype(np.float64) @ row.astype(np.float64)
    return out


def routing(tokens: int, k: int, seed: int) -> mx.array:
    """Distinct experts per token, as top-k routing produces."""
    rng = np.random.default_rng(seed)
    return mx.array(np.stack([rng.permutation(E)[:k] for _ in range(tokens)]).astype(np.uint32))


def assert_close(got: mx.array, want: np.ndarray, rtol: float) -> None:
    got = np.array(got.astype(mx.float32))
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * np.abs(want).max())


# M = 1 (decode), a few tokens, and enough (token, expert) pairs for the sorted gather path
CASES = [(1, 1), (1, 8), (3, 2), (5, 8), (2 * SORT_THRESHOLD // 3, 3)]


@pytest.mark.parametrize("tokens,k", CASES)
@pytest.mark.parametrize("per_slot", [False, True], ids=["shared_x", "per_slot_x"])
def test_dense_experts(tokens, k, per_slot):
    K = 40
    w = mx.random.normal((E, N, K), key=mx.random.key(0))
    x_shape = (tokens, k, K) if per_slot else (tokens, K)
    x = mx.random.normal(x_shape, key=mx.random.key(1))
    ids = routing(tokens, k, seed=tokens * 10 + k)
    want = oracle(np.array(x), np.array(w), np.array(ids))
    # fp32 math over K = 40 terms: about 1e-6 relative; 1e-5 leaves room for summation order
    assert_close(expert_matmul_reference(x, w, ids), want, 1e-5)
    assert_close(expert_matmul(x, w, ids), want, 1e-5)


@pytest.mark.parametrize(
    "ggml_type", [T.Q8_0, T.Q4_0, T.Q5_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name
)
@pytest.mark.parametrize("tokens,k", [(1, 8), (4, 2), (5, 8)])
def test_ggml_experts(ggml_type, tokens, k):
    K = 256
    raw = random_ggml_blocks(E * N, K, ggml_type, seed=int(ggml_type), scale=0.5)
    w_raw = raw.reshape(E, N, -1)  # (E, N, row_bytes)
    dense = gguf.quants.dequantize(np.array(raw), ggml_type).reshape(E, N, K)  # gguf-py oracle
    x = mx.random.normal((tokens, K), key=mx.random.key(2))
    ids = routing(tokens, k, seed=int(ggml_type) + tokens)
    want = oracle(np.array(x), dense, np.array(ids))
    # dequantization is bit-exact; what remains is fp32 summation over K = 256 terms
    assert_close(expert_matmul_reference(x, w_raw, ids, ggml_type, K), want, 1e-5)
    # (5, 8): more pairs than experts, so the dispatcher dequantizes all experts once
    assert_close(expert_matmul(x, w_raw, ids, ggml_type, K), want, 1e-5)


def test_reference_reads_only_selected_experts():
    """Unselected experts hold blocks whose scale is fp16 NaN: the result stays finite only if
    they are never dequantized (the reference must not dequantize all experts)."""
    K, t = 64, T.Q8_0
    raw = np.array(random_ggml_blocks(E * N, K, t, seed=3)).reshape(E, N, K // 32, 34)
    ids = mx.array([[1, 4], [4, 7]], dtype=mx.uint32)
    chosen = {1, 4, 7}
    raw[[e for e in range(E) if e not in chosen], :, :, 0:2] = [0x00, 0x7E]  # fp16 NaN scale
    w_raw = mx.array(raw.reshape(E, N, -1))
    x = mx.random.normal((2, K), key=mx.random.key(4))
    out = expert_matmul_reference(x, w_raw, ids, t, K)
    assert bool(mx.all(mx.isfinite(out)))
    assert bool(mx.all(mx.isfinite(expert_matmul(x, w_raw, ids, t, K))))  # decode path too


def test_output_dtype_and_bad_shapes():
    K = 32
    w = mx.random.normal((E, N, K), key=mx.random.key(5)).astype(mx.bfloat16)
    x = mx.random.normal((3, K), key=mx.random.key(6)).astype(mx.bfloat16)
    ids = routing(3, 2, seed=7)
    out = expert_matmul(x, w, ids)
    assert out.dtype == mx.bfloat16 and out.shape == (3, 2, N)
    want = oracle(np.array(x.astype(mx.float32)), np.array(w.astype(mx.float32)), np.array(ids))
    ref32 = expert_matmul_reference(x.astype(mx.float32), w.astype(mx.float32), ids)
    ref16 = expert_matmul_reference(x, w, ids)  # the reference itself in bf16 output precision
    err16 = np.abs(np.array(ref16.astype(mx.float32)) - want).max()
    # bf16 output rounding: the dispatcher may be at most 2x the bf16 reference's error
    assert np.abs(np.array(out.astype(mx.float32)) - want).max() <= 2 * err16 + 1e-6
    assert_close(ref32, want, 1e-5)
    with pytest.raises(ValueError):
        expert_matmul(mx.zeros((3, 2, 2, K)), w, ids)


def test_expert_linear_module():
    """ExpertLinear float, GGML (to_ggml + raw blocks) and MLX-affine (to_quantized) modes."""
    K, k, t = 64, 3, T.Q8_0
    layer = ExpertLinear(E, K, N)
    raw = random_ggml_blocks(E * N, K, t, seed=8, scale=0.5)
    dense = gguf.quants.dequantize(np.array(raw), t).reshape(E, N, K)
    layer.weight = mx.array(dense)
    x = mx.random.normal((4, K), key=mx.random.key(9))
    ids = routing(4, k, seed=10)
    want = oracle(np.array(x), dense, np.array(ids))
    assert_close(layer(x, ids), want, 1e-5)

    g = layer.to_ggml(t)
    assert g.weight.shape == (E, N, 68) and g.weight.dtype == mx.uint8
    g.weight = raw.reshape(E, N, -1)
    assert_close(g(x, ids), want, 1e-5)

    q = layer.to_quantized(group_size=32, bits=8)
    deq = mx.dequantize(q.weight, q.scales, q.biases, group_size=32, bits=8)
    want_q = oracle(np.array(x), np.array(deq), np.array(ids))
    assert_close(q(x, ids), want_q, 1e-5)  # gather_qmm == oracle on the dequantized weights
    many = routing(SORT_THRESHOLD, k, seed=11)  # sorted gather_qmm path
    xm = mx.random.normal((SORT_THRESHOLD, K), key=mx.random.key(12))
    assert_close(q(xm, many), oracle(np.array(xm), np.array(deq), np.array(many)), 1e-5)


def test_sorted_flag_on_a_cuda_device(monkeypatch):
    """Where the device drops the sorted flag (CUDA), neither gather_mm nor gather_qmm gets it,
    though the pairs still arrive sorted by expert; where it takes it, they get it past the
    threshold only."""
    import hf2q_mlx.custom_kernels.expert_matmul as EXM

    seen = []

    def matmul(rows, ids, flag):
        seen.append((flag, np.array(ids).ravel().tolist()))
        return mx.zeros((*rows.shape[:-1], N))

    x = mx.random.normal((SORT_THRESHOLD, 8), key=mx.random.key(3))
    many = routing(SORT_THRESHOLD, 2, seed=4)
    for device_takes_it in (False, True):
        monkeypatch.setattr(EXM, "_sorted_flag_ok", lambda v=device_takes_it: v)
        out = EXM.gathered_matmul(x, many, matmul)
        flag, ids = seen[-1]
        assert out.shape == (SORT_THRESHOLD, 2, N) and flag is device_takes_it
        assert ids == sorted(ids)
        EXM.gathered_matmul(x[:2], many[:2], matmul)
        assert seen[-1][0] is False
