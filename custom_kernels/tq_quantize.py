"""Quantize-on-write for TurboQuant caches: head vectors -> packed rows (codes + scale)."""

from __future__ import annotations

import mlx.core as mx

from ..turboquant import TQCodec
from . import backend
from ._render import Example, Kernel


def tq_quantize_reference(x: mx.array, codec: TQCodec) -> mx.array:
    """x (..., dim) float -> packed rows (..., codec.row_words) uint32, in MLX ops."""
    return codec.quantize(x)


# Template: T (input dtype), D (dim), P (padded dim, a power of two), BITS, CW (code words).
_BODY = """
  // One threadgroup per head vector, one thread per rotated coordinate (P threads): sign flip,
  // Walsh-Hadamard butterflies in shared memory, the norm from SIMD sums, a binary search of
  // the Lloyd-Max boundaries, the dot of codebook values with the unit coordinates (SIMD sums
  // again) for the stored scale, then thread w < CW assembles packed word w from the codes.
  SHARED float buf[P];
  SHARED float partial[P / 32];
  SHARED float dots[P / 32];
  SHARED uint codes[P];
  const uint row = gid_x;
  const uint j = tid;
  buf[j] = (j < uint(D) ? to_float(x[row * uint(D) + j]) : 0.0f) * signs[j];
  BARRIER();
  for (uint h = 1; h < uint(P); h <<= 1) {
    if (j < uint(P) / 2) {
      const uint i = (j / h) * 2 * h + (j % h);
      const float a = buf[i];
      const float b = buf[i + h];
      buf[i] = a + b;
      buf[i + h] = a - b;
    }
    BARRIER();
  }
  const float y = buf[j] * (1.0f / sqrt_f(float(P)));
  const float sq = simd_sum(y * y);
  if (lane == 0) partial[simd_id] = sq;
  BARRIER();
  float total = 0.0f;
  for (uint s = 0; s < uint(P) / 32; ++s) total += partial[s];
  const float norm = sqrt_f(total);
  // a zero vector: u = 0, its codes decode to zeros times a zero norm
  const float u = y * (sqrt_f(float(P)) / max_f(norm, 1e-30f));
  uint code = 0;
  UNROLL for (int k = BITS - 1; k >= 0; --k) {
    const uint cand = code + (1u << k);
    if (u > boundaries[cand - 1]) code = cand;
  }
  codes[j] = code;
  const float cu = simd_sum(codebook[code] * u);
  if (lane == 0) dots[simd_id] = cu;
  BARRIER();
  if (j < uint(CW)) {
    // codes overlapping stream bits [32 j, 32 j + 32): a code may straddle two words
    const uint first = (32 * j) / uint(BITS);
    const uint last = (32 * j + 31) / uint(BITS);
    uint word = 0;
    for (uint i = first; i <= last; ++i) {
      const int sh = int(i * uint(BITS)) - int(32 * j);
      word |= sh >= 0 ? (codes[i] << uint(sh)) : (codes[i] >> uint(-sh));
    }
    out[row * uint(CW + 1) + j] = word;
  }
  if (j == 0) {
    // scale = norm * P / sum(c * u): the decoded vector's projection on x is exactly |x|
    float dot = 0.0f;
    for (uint s = 0; s < uint(P) / 32; ++s) dot += dots[s];
    const float scale = dot > 0.0f ? norm * (float(P) / dot) : 0.0f;
    out[row * uint(CW + 1) + uint(CW)] = bitcast<uint>(scale);
  }
"""

_kernel = Kernel(
    "tq_quantize",
    inputs=["x", "signs", "boundaries", "codebook"],
    outputs=["out"],
    body=_BODY,
    examples=[
        Example(
            {"x": dt, "signs": mx.float32, "boundaries": mx.float32, "codebook": mx.float32},
            {"out": mx.uint32},
            {"T": dt, "D": d, "P": p, "BITS": b, "CW": p * b // 32},
        )
        for dt, d, p, b in (
            (mx.float16, 256, 256, 4),
            (mx.bfloat16, 512, 512, 3),
            (mx.float32, 96, 128, 8),
        )
    ],
)


def tq_quantize(x: mx.array, codec: TQCodec) -> mx.array:
    """Dispatcher: the GPU kernel where one applies, else the reference."""
    if backend() is None or x.dtype not in (mx.float16, mx.bfloat16, mx.float32):
        return tq_quantize_reference(x, codec)
    if codec.padded_dim > 1024 or x.size == 0:
        return tq_quantize_reference(x, codec)
    lead = x.shape[:-1]
    n = x.size // codec.dim
    P = codec.padded_dim
    (rows,) = _kernel(
        [x.reshape(n, codec.dim), codec.signs, codec.boundaries, codec.codebook],
        grid=(n * P,),
        threadgroup=(P,),
        output_shapes=[(n, codec.row_words)],
        output_dtypes=[mx.uint32],
        template={"T": x.dtype, "D": codec.dim, "P": P, "BITS": codec.bits,
                  "CW": codec.code_words},
    )  # fmt: skip
    return rows.reshape(*lead, codec.row_words)
