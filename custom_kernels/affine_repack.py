"""Lossless repack of GGML blocks into MLX affine quantization (w = scale * q + bias per 32)."""

from __future__ import annotations

import math

import mlx.core as mx
from gguf import GGMLQuantizationType as T

from hf2q_mlx.custom_kernels.dequant import (
    GGML_BLOCK_INFO,
    _f16,
    _k4_scales_mins,
    _q5,
    _unpack,
    row_bytes,
)
from hf2q_mlx.errors import WeightMismatchError

GROUP_SIZE = 32

# Why each mapping is exact (fp32, finite fp16 scales d, dmin): every product below has at most
# 24 significant bits, so it is exact, and at most one addition rounds, the same one the
# reference rounds (gguf-py, dequant.py):
# - Q8_0 / Q4_0 / Q5_0: d * (q + o) + (-o * d) is d * q exactly (o = 128, 8, 16): no rounding at
#   all. The one visible difference: where q = 0 under a negative d the reference gives -0.0 and
#   the repack +0.0 (x + (-x) is +0 in IEEE round-to-nearest); values compare equal.
# - Q4_1 / Q5_1: d * q + m, the reference's own expression.
# - Q4_K / Q5_K: the 32-element sub-blocks are the groups; (d * sc) * q + (-(dmin * m)) with
#   d * sc exact (11 + 6 bits) and (d * sc) * q exact (+ 5 bits): the reference's one rounding.
# - Q3_K: its 16-element sub-blocks differ in scale, but d * sc * q = d * (sc * q) with
#   sc * q in [-124, 128] (sc 6-bit signed, q 3-bit signed): 8-bit codes sc * q + 124 under the
#   super-block scale d, bias -124 * d; exact like Q8_0 (same -0.0 caveat).
# Not mapped (None): Q6_K (16-element sub-blocks, sc * (q - 32) needs 13 bits), Q2_K (16-element
# sub-blocks with their own scale and min under two unrelated fp16 factors: no common grid) and
# the dense types. MLX groups are 32, 64 or 128 elements, so a 16-element scale cannot be a group.


def _q8_0(b: mx.array):
    d = _f16(b, 0)  # (..., nb, 1)
    return b[..., 2:] ^ 0x80, d, d * -128.0, 8  # int8 q -> q + 128 as uint8


def _q4_0(b: mx.array):
    d = _f16(b, 0)
    return _unpack(b[..., 2:], 16, 4), d, d * -8.0, 4


def _q4_1(b: mx.array):
    return _unpack(b[..., 4:], 16, 4), _f16(b, 0), _f16(b, 2), 4


def _q5_0(b: mx.array):
    d = _f16(b, 0)
    return _q5(b, 2), d, d * -16.0, 5


def _q5_1(b: mx.array):
    return _q5(b, 4), _f16(b, 0), _f16(b, 2), 5


def _q45_k(b: mx.array, q: mx.array, bits: int):
    sc, m = _k4_scales_mins(b[..., 4:16])  # (..., nb, 8): one per 32-element sub-block
    scale = _f16(b, 0) * sc.astype(mx.float32)
    bias = -(_f16(b, 2) * m.astype(mx.float32))
    return q, scale, bias, bits


def _q4_k(b: mx.array):
    return _q45_k(b, _unpack(b[..., 16:144], 32, 4), 4)


def _q5_k(b: mx.array):
    qh = _unpack(b[..., 16:48], 32, 1)
    return _q45_k(b, _unpack(b[..., 48:176], 32, 4) | (qh << 4), 5)


def _q3_k(b: mx.array):
    s = b[..., 96:108]
    sc = _unpack(s[..., 0:8], 8, 4) | (_unpack(s[..., 8:12], 4, 2) << 4)  # (..., nb, 16) 0..63
    sc = sc.astype(mx.int16) - 32
    ql = _unpack(b[..., 32:96], 32, 2).astype(mx.int16)
    qh = (_unpack(b[..., 0:32], 32, 1) ^ 1).astype(mx.int16) << 2  # a cleared bit subtracts 4
    q = (ql - qh).reshape(*b.shape[:-1], 16, 16) * sc[..., None] + 124  # (..., nb, 16, 16)
    d = _f16(b, 108)
    return q.astype(mx.uint8).reshape(*b.shape[:-1], 256), d, d * -124.0, 8


_REPACKERS = {
    T.Q8_0: _q8_0,
    T.Q4_0: _q4_0,
    T.Q4_1: _q4_1,
    T.Q5_0: _q5_0,
    T.Q5_1: _q5_1,
    T.Q3_K: _q3_k,
    T.Q4_K: _q4_k,
    T.Q5_K: _q5_k,
}


def _pack(q: mx.array, bits: int) -> mx.array:
    """Codes q (..., n) uint8 below 2**bits -> (..., n * bits // 32) uint32 in MLX's layout.

    MLX reads a little-endian bit stream: code i at bits [i * bits, (i + 1) * bits) (4-bit: low
    nibble first; 5-bit: 8 codes in 5 bytes, see extract_bits in mlx/backend/cpu/quantized.cpp).
    """
    if bits == 8:
        return q.view(mx.uint32)
    per = 8 // math.gcd(8, bits)  # codes per whole number of bytes: 2 (4-bit), 8 (5-bit)
    g = q.reshape(*q.shape[:-1], -1, per)
    out = []
    for k in range(per * bits // 8):  # output byte k holds stream bits [8k, 8k + 8)
        byte = None
        for j in range(per):
            shift = j * bits - 8 * k
            if -bits < shift < 8:  # uint8 shifts drop the bits that belong to other bytes
                part = g[..., j] << shift if shift >= 0 else g[..., j] >> -shift
                byte = part if byte is None else byte | part
        out.append(byte)
    return mx.stack(out, axis=-1).reshape(*q.shape[:-1], -1).view(mx.uint32)


def affine_repack(
    raw: mx.array, ggml_type: int, cols: int
) -> tuple[mx.array, mx.array, mx.array, int] | None:
    """raw (..., row_bytes) uint8 GGML blocks -> (wq, scales, biases, bits), or None.

    wq (..., cols * bits // 32) uint32, scales and biases (..., cols // 32) fp32, for
    ``mx.quantized_matmul`` / ``mx.dequantize`` with ``group_size=32, bits=bits``; the
    dequantized values equal ``dequantize_reference`` (see the notes above). None for the types
    without an exact mapping (Q2_K, Q6_K, F32, F16, BF16, unknown).
    """
    repack = _REPACKERS.get(ggml_type)
    if repack is None:
        return None
    expected = row_bytes(ggml_type, cols)
    if raw.dtype != mx.uint8 or raw.ndim == 0 or raw.shape[-1] != expected:
        raise WeightMismatchError(
            f"{T(ggml_type).name} rows of {cols} elements are {expected} uint8 bytes; "
            f"got {raw.dtype} of shape {raw.shape}"
        )
    block, nbytes = GGML_BLOCK_INFO[ggml_type]
    lead = raw.shape[:-1]
    q, scales, biases, bits = repack(raw.reshape(*lead, cols // block, nbytes))
    per_block = (*lead, cols // block, block // GROUP_SIZE)  # Q3_K: one d for 8 groups
    scales, biases = (mx.broadcast_to(a, per_block).reshape(*lead, -1) for a in (scales, biases))
    return _pack(q.reshape(*lead, cols), bits), scales, biases, bits
