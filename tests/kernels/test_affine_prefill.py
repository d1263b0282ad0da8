"""MLX affine linears at prompt sizes through dequantized chunks and a matmul
(custom_kernels/affine_prefill.py, ``HF2Q_AFFINE_PREFILL=1``). On the CPU the chunk dequantizer
is MLX's ``dequantize`` (the kernel's own bits against it: test_cuda_graph_step.py's
``test_gather_affine_rows_kernel_equals_mlx_dequantize``); on a GPU the kernel itself."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import requires_gpu

from hf2q_mlx.custom_kernels import affine_prefill as AP
from hf2q_mlx.custom_kernels import graph_ops
from hf2q_mlx.custom_kernels import qmatmul as Q
from models import kernel_linears


def _layer(n: int, k: int, gs: int, bits: int, dtype, bias: bool, seed: int):
    """An nn.QuantizedLinear (k -> n) of random weights, as the kernel-taking subclass."""
    lin = nn.Linear(k, n, bias=bias)
    ks = mx.random.split(mx.random.key(seed), 2)
    lin.weight = mx.random.normal((n, k), key=ks[0]).astype(dtype) * 0.05
    if bias:
        lin.bias = mx.random.normal((n,), key=ks[1]).astype(dtype)
    q = nn.QuantizedLinear.from_linear(lin, group_size=gs, bits=bits)
    q.set_dtype(dtype)
    kernel_linears.use_kernels(q)
    return q


def _errors(got, want_mlx, layer, x):
    """Largest |error| of ours and of MLX's quantized_matmul against the fp32 product of x and
    the dequantized weight."""
    w = mx.dequantize(layer.weight, layer.scales, layer.biases, layer.group_size, layer.bits)
    oracle = x.astype(mx.float32) @ w.astype(mx.float32).T
    if "bias" in layer:
        oracle = oracle + layer.bias.astype(mx.float32)
    err = lambda y: mx.abs(y.astype(mx.float32) - oracle).max().item()  # noqa: E731
    return err(got), err(want_mlx), mx.abs(oracle).max().item()


@pytest.fixture
def on_cuda(monkeypatch):
    """The path taken as on CUDA, the kernel swapped for MLX's dequantize (the CPU has no
    launcher), and chunks of 128 rows so that several chunks and a short last one run."""
    monkeypatch.setenv("HF2Q_AFFINE_PREFILL", "1")
    monkeypatch.setattr(AP, "backend", lambda: "cuda")
    monkeypatch.setattr(kernel_linears, "backend", lambda: "cuda")
    calls = []

    def dequant(wq, scales, biases, ids, gs, bits):
        calls.append((wq.shape[0], ids.size))
        return graph_ops.gather_affine_rows_reference(wq, scales, biases, ids, gs, bits)

    monkeypatch.setattr(AP, "affine_rows_kernel", dequant)
    monkeypatch.setattr(Q, "_DEQ_CHUNK", 128 * 256)
    return calls


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("gs,bits,bias", [(64, 4, False), (32, 8, True), (128, 4, True)])
def test_prompt_rows_match_quantized_matmul(on_cuda, dtype, gs, bits, bias):
    """Prompt rows (B, L, K) with L past the mat-vec kernels' 32: chunks of 128 rows of W (the
    last one short), each dequantized once; within twice MLX's own quantized_matmul error of
    the fp32 product (both round to the same half dtype; 1e-6 of the largest output for the
    fp32-exact cases)."""
    n, k = 300, 256
    layer = _layer(n, k, gs, bits, dtype, bias, seed=bits + gs)
    x = mx.random.normal((2, 40, k), key=mx.random.key(9)).astype(dtype)
    got = layer(x)
    assert on_cuda == [(128, 128), (128, 128), (44, 44)]  # the chunks: 128, 128, 44 rows
    want = nn.QuantizedLinear.__call__(layer, x)  # MLX's quantized_matmul
    assert got.shape == want.shape == (2, 40, n) and got.dtype == dtype
    ours, mlx, scale = _errors(got, want, layer, x)
    assert ours <= 2 * mlx + 1e-6 * scale, (ours, mlx)


def test_switch_and_decode_rows_keep_their_paths(on_cuda, monkeypatch):
    """0: MLX's quantized_matmul (no chunk dequantized); unset: on with the CUDA back end, off
    elsewhere; 32 rows or fewer: the mat-vec kernels' path, not this one; fp32 x: MLX's op
    (its CUDA matmul would run TF32)."""
    layer = _layer(256, 256, 64, 4, mx.bfloat16, False, seed=3)
    x = mx.random.normal((1, 40, 256), key=mx.random.key(1)).astype(mx.bfloat16)
    monkeypatch.setenv("HF2Q_AFFINE_PREFILL", "0")
    layer(x)
    assert on_cuda == []
    monkeypatch.setenv("HF2Q_AFFINE_PREFILL", "")
    layer(x)
    assert on_cuda == [(128, 128), (128, 128)]  # unset, on CUDA: two chunks dequantized
    monkeypatch.setattr(AP, "backend", lambda: "metal")
    assert not AP.enabled()
    monkeypatch.setattr(AP, "backend", lambda: "cuda")
    on_cuda.clear()
    monkeypatch.setenv("HF2Q_AFFINE_PREFILL", "1")
    args = (layer.weight, layer.scales, layer.biases, 64, 4)
    assert not AP.covers(x[:, :32], *args)
    assert not AP.covers(x.astype(mx.float32), *args)
    assert AP.covers(x, *args)
    assert on_cuda == []
    monkeypatch.setenv("HF2Q_AFFINE_PREFILL", "yes")
    with pytest.raises(ValueError, match="HF2Q_AFFINE_PREFILL"):
        AP.enabled()


@requires_gpu
@pytest.mark.parametrize("bits", [4, 8])
def test_gpu_prompt_rows_match_quantized_matmul(bits, monkeypatch):
    """On CUDA, the kernel dequantizing each chunk: within twice MLX's quantized_matmul error
    of the fp32 product, with several chunks (a 2,000-row W in chunks of 1,024 rows)."""
    if AP.backend() != "cuda":
        pytest.skip("MLX's CUDA back end only")
    monkeypatch.setenv("HF2Q_AFFINE_PREFILL", "1")
    monkeypatch.setattr(Q, "_DEQ_CHUNK", 1024 * 512)
    layer = _layer(2000, 512, 64, bits, mx.bfloat16, True, seed=bits)
    x = mx.random.normal((1, 300, 512), key=mx.random.key(2)).astype(mx.bfloat16)
    got = layer(x)
    want = nn.QuantizedLinear.__call__(layer, x)
    ours, mlx, scale = _errors(got, want, layer, x)
    assert ours <= 2 * mlx + 1e-6 * scale, (ours, mlx)
    np.testing.assert_array_equal(np.isfinite(np.array(got.astype(mx.float32))), True)
