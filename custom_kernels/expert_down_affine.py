"""Routed experts' down projections and their gate-weighted sum in one launch, MLX affine."""

from __future__ import annotations

import math

import mlx.core as mx

from hf2q_mlx.custom_kernels import backend, device_array
from hf2q_mlx.custom_kernels._render import Example, Kernel
from hf2q_mlx.custom_kernels.expert_glu import MAX_TOKENS
from hf2q_mlx.custom_kernels.expert_glu_affine import Affine, affine_experts_covered
from hf2q_mlx.custom_kernels.expert_matmul import ids_and_weights
from hf2q_mlx.custom_kernels.ggml_formats import COMMON
from hf2q_mlx.errors import WeightMismatchError


def expert_down_affine_reference(
    h: mx.array,
    down: Affine,
    expert_ids: mx.array,
    weights: mx.array,
    group_size: int,
    bits: int,
) -> mx.array:
    """h (..., k, F) one row per slot, expert_ids and weights (..., k) -> the weighted sum of
    the slots' down projections (..., N) in h.dtype; ``down`` = (codes, scales, biases) as
    nn.quantize leaves an expert stack. The selected experts dequantized in fp32 (scale * code
    + bias, not rounded), fp32 products, rounded once: the kernel's oracle."""
    wq, scales, biases = (a[expert_ids] for a in down)  # (..., k, N, .)
    f32 = mx.float32
    w = mx.dequantize(wq, scales.astype(f32), biases.astype(f32), group_size=group_size,
                      bits=bits)  # fmt: skip
    y = (w @ h.astype(f32)[..., None]).squeeze(-1)  # (..., k, N)
    return (y * weights[..., None].astype(f32)).sum(axis=-2).astype(h.dtype)


# --------------------------------------------------------------------------------------------
# Kernel. Template: T (h), BITS (4 or 8), GS (group size), R (output rows per threadgroup).
# edims = (1, N, K, slots, E).

_BODY = r"""
  // Thread mapping: threadgroup (gid_x, gid_y) = (output rows row0 .. row0 + R - 1, token t);
  // for each slot s of t in turn (expert ids[t, s], input row h[t, s]) lanes take consecutive
  // 16-byte chunks of the R rows (CPW codes of one group each), SIMD groups interleaved runs of
  // 32 chunks; tot keeps sum_s wts[t, s] * row sums.
  constexpr uint CPW = 128 / BITS;  // codes per 16-byte chunk
  constexpr uint WPC = 32 / BITS;   // codes per 32-bit word
  const uint tok = gid_y;
  const uint N = uint(edims[1]);
  const uint K = uint(edims[2]);
  const uint slots = uint(edims[3]);
  const uint row0 = gid_x * uint(R);
  const uint nch = K / CPW;
  const uint ngr = K / GS;
  float tot[R];
  UNROLL for (int r = 0; r < R; ++r) tot[r] = 0.0f;
  bool bad = false;  // an id past the last expert: NaN rows (nothing of it is read)
  for (uint slot = 0; slot < slots; ++slot) {
    const uint pair = tok * slots + slot;
    const uint e = uint(ids[pair]);
    if (e >= uint(edims[4])) {  // the same for every thread: no divergence
      bad = true;
      continue;
    }
    DEVICE_PTR(const T) xr = xs + size_t(pair) * K;
    size_t rowi[R];  // rows past N re-read row N - 1; their sums are dropped
    UNROLL for (int r = 0; r < R; ++r)
      rowi[r] = size_t(e) * N + (row0 + uint(r) < N ? row0 + uint(r) : N - 1);
    float acc[R];
    UNROLL for (int r = 0; r < R; ++r) acc[r] = 0.0f;
    for (uint c = simd_id * SIMD_SIZE + lane; c < nch; c += n_simd * SIMD_SIZE) {
      uint4 q[R];
      UNROLL for (int r = 0; r < R; ++r)
        q[r] = DEVICE_CAST(const uint4, wq + rowi[r] * (K / WPC))[c];
      float xv[CPW];
      UNROLL for (int p = 0; p < int(CPW / 4); ++p) load_x4(xr + c * CPW + 4 * p, xv + 4 * p);
      float sx = 0.0f;
      UNROLL for (int i = 0; i < int(CPW); ++i) sx += xv[i];
      const uint g = c * CPW / GS;
      UNROLL for (int r = 0; r < R; ++r) {
        const uint wd[4] = {q[r].x, q[r].y, q[r].z, q[r].w};
        float d = 0.0f;
        UNROLL for (int j = 0; j < 4; ++j)
          UNROLL for (int i = 0; i < int(WPC); ++i)
            d = fma_f(float((wd[j] >> (BITS * i)) & ((1u << BITS) - 1u)), xv[j * WPC + i], d);
        const size_t gi = rowi[r] * ngr + g;
        acc[r] = fma_f(to_float(sc[gi]), d, fma_f(to_float(bi[gi]), sx, acc[r]));
      }
    }
    const float wt = wts[pair];
    UNROLL for (int r = 0; r < R; ++r) tot[r] = fma_f(wt, acc[r], tot[r]);
  }
  // Sum the lanes, then the SIMD groups, and write the token's R rows.
  SHARED float red[8 * R];
  UNROLL for (int r = 0; r < R; ++r) {
    const float v = simd_sum(tot[r]);
    if (lane == 0) red[simd_id * R + r] = v;
  }
  BARRIER();
  if (tid < uint(R) && row0 + tid < N) {
    float v = 0.0f;
    for (uint s = 0; s < n_simd; ++s) v += red[s * R + tid];
    if (bad) v = bitcast<float>(0x7FC00000u);
    ys[size_t(tok) * N + row0 + tid] = from_float<T>(v);
  }
"""

_kernel = Kernel(
    "affine_expert_down",
    inputs=["xs", "wq", "sc", "bi", "ids", "wts", "edims"],
    outputs=["ys"],
    body=_BODY,
    header=COMMON,
    examples=[
        Example(
            {"xs": t, "wq": mx.uint32, "sc": t, "bi": t, "ids": mx.uint32, "wts": mx.float32,
             "edims": (mx.int32, 5)},
            {"ys": t},
            {"T": t, "BITS": bits, "GS": gs, "R": r},
        )
        for t, bits, gs, r in ((mx.bfloat16, 4, 64, 4), (mx.float32, 8, 32, 2))
    ],
)  # fmt: skip

ROWS, WARPS = 4, 1  # output rows and SIMD groups per threadgroup (short rows: F of 512-704)
_FLOATS = (mx.float32, mx.float16, mx.bfloat16)


def kernel_covers(h, down: Affine, expert_ids, weights, group_size: int, bits: int) -> bool:
    """True when :func:`expert_down_affine` runs its kernel (a GPU, 1..32 tokens, 4- or 8-bit
    codes in groups of 32..128, one input row per (token, slot))."""
    wq = down[0]
    return (
        backend() is not None
        and affine_experts_covered(h, down, group_size, bits)
        and h.ndim == expert_ids.ndim + 1
        and tuple(h.shape[:-1]) == tuple(expert_ids.shape)
        and tuple(weights.shape) == tuple(expert_ids.shape)
        and 1 <= math.prod(expert_ids.shape[:-1]) <= MAX_TOKENS
        and expert_ids.size > 0
        and wq.shape[0] > 0
        and wq.shape[1] > 0
    )


def _launch(h, down: Affine, expert_ids, group_size: int, bits: int):
    E, N, _ = down[0].shape
    k = expert_ids.shape[-1]
    tokens = expert_ids.size // k
    launch = dict(
        grid=(-(-N // ROWS) * 32 * WARPS, tokens),
        threadgroup=(32 * WARPS, 1),
        output_shapes=[(*expert_ids.shape[:-1], N)],  # written flat: no reshape node after
        output_dtypes=[h.dtype],
        template={"T": h.dtype, "BITS": bits, "GS": group_size, "R": ROWS},
    )
    return launch, [1, N, h.shape[-1], k, E]


def _inputs(h, down: Affine, expert_ids, weights, edims) -> list[mx.array]:
    return [h, *down, *ids_and_weights(expert_ids, weights), edims]


def expert_down_affine_kernel(
    h: mx.array,
    down: Affine,
    expert_ids: mx.array,
    weights: mx.array,
    group_size: int,
    bits: int,
    *,
    init_value: float | None = None,
) -> mx.array:
    """The GPU kernel alone, the contract of :func:`expert_down_affine_reference`; a token with
    an id >= E gives a NaN row; ``init_value`` pre-fills the output (tests poison it)."""
    launch, edims = _launch(h, down, expert_ids, group_size, bits)
    inputs = _inputs(h, down, expert_ids, weights, device_array(list(edims), mx.int32))
    return _kernel(inputs, init_value=init_value, **launch)[0]


_CALLS: dict[tuple, tuple] = {}


def expert_down_affine(
    h: mx.array,
    down: Affine,
    expert_ids: mx.array,
    weights: mx.array,
    group_size: int,
    bits: int,
) -> mx.array:
    """Dispatcher with the contract of :func:`expert_down_affine_reference`: on a GPU one kernel
    for 1..32 tokens and 4- or 8-bit affine experts; otherwise the reference (callers with a
    faster path of their own check :func:`kernel_covers` first)."""
    key = (_kernel, group_size, bits, h.shape, h.dtype, expert_ids.shape, expert_ids.dtype,
           weights.dtype, *((a.shape, a.dtype) for a in down))  # fmt: skip
    if backend() is not None:
        plan = _CALLS.get(key)
        if plan is not None:
            launch, edims = plan
            return launch(inputs=_inputs(h, down, expert_ids, weights, edims))[0]
    if h.shape[-1] * bits != down[0].shape[-1] * 32:
        raise WeightMismatchError(
            f"h has {h.shape[-1]} features, the {bits}-bit experts {down[0].shape[-1]} words"
        )
    if not kernel_covers(h, down, expert_ids, weights, group_size, bits):
        return expert_down_affine_reference(h, down, expert_ids, weights, group_size, bits)
    launch, edims = _launch(h, down, expert_ids, group_size, bits)
    dtypes = [h.dtype, *(a.dtype for a in down), mx.uint32, mx.float32, mx.int32]
    _CALLS[key] = (_kernel.launcher(dtypes, **launch), device_array(list(edims), mx.int32))
    return expert_down_affine(h, down, expert_ids, weights, group_size, bits)
