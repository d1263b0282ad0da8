"""Tensor-core mat-vec against GGML blocks for 1..32 rows of bf16 x: x @ W.T through warp mmas.

Its loop (``make_kernel``) also serves the dense GLU (expert_glu.dense_glu_mma_kernel: gate and
up rows as two row sets, up to 32 rows of x)."""

from __future__ import annotations

import os
import re

import mlx.core as mx
from gguf import GGMLQuantizationType as T

from hf2q_mlx.custom_kernels import int_setting
from hf2q_mlx.custom_kernels._render import Example, Kernel, launch_bounds
from hf2q_mlx.custom_kernels.decode_attention import CountedPlan
from hf2q_mlx.custom_kernels.ggml_formats import BLOCK_FORMATS, fill_format, kernel_header
from hf2q_mlx.custom_kernels.launch_plan import LaunchPlan
from hf2q_mlx.errors import InvalidArgumentError

# The reference is qmatmul.ggml_matmul_reference (fp32 dequantize, fp32 matmul): the same op.

# --------------------------------------------------------------------------------------------
# Decoders. Per type: MRaw<TYPE> (a lane's bytes of one block of one row), load_m_<type>,
# dq_m_<type> (group gi of the block as A fragments of rows g and g + 8, with each row's scale
# and min), xoff_m_<type> (where the lane's x values of group gi sit in the block) and the
# constants NGR (scale groups per block) and MMG (mmas per group: its k / 16), _GROUPS.
#
# k permutation: inside an mma the sum over k is order-free, so lane t takes 4 CONSECUTIVE
# physical k (4t..4t+3 of a 16-k group, or 8t..8t+3 / 8t+4..8t+7 of a 32-k group) as the
# fragment's logical k {2t, 2t+1, 2t+8, 2t+9}; A and B use the same map, so a lane's weight
# bytes and its x values are contiguous loads.

_MMA_COMMON = r"""
// bf16 pair a - b (lo half first), for exact results only (small integers): one HSUB2 on the
// GPU; elsewhere in fp32, truncated back to bf16 (exact for a representable result).
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
FN uint bf2_sub(uint a, uint b) {
  return bitcast<uint>(__hsub2(bitcast<__nv_bfloat162>(a), bitcast<__nv_bfloat162>(b)));
}
#else
FN uint bf2_sub(uint a, uint b) {
  const float lo = bitcast<float>(a << 16) - bitcast<float>(b << 16);
  const float hi = bitcast<float>(a & 0xFFFF0000u) - bitcast<float>(b & 0xFFFF0000u);
  return (bitcast<uint>(lo) >> 16) | (bitcast<uint>(hi) & 0xFFFF0000u);
}
#endif
// bf16 bits of 128 + zero in both halves (128 + zero < 256: exact in bf16's 8 bits).
FN uint bf2_zero(float zero) { return (bitcast<uint>(128.0f + zero) >> 16) * 0x00010001u; }
// Four fields (< 128) in the bytes of v -> bf16 pairs (byte 0, 1), (2, 3) of field - zero,
// exact: a byte under 0x43 (the high byte of 128.0 in bf16) reads as 128 + field, and one
// packed subtract of 128 + zero leaves field - zero (|field - zero| <= 128: exact in bf16).
FN void bf_quad(uint v, uint zb, THREAD_PTR(uint) out) {
  out[0] = bf2_sub(byte_perm(v, 0x43434343u, 0x4140u), zb);
  out[1] = bf2_sub(byte_perm(v, 0x43434343u, 0x4342u), zb);
}
// Four signed bytes (Q8_0) -> bf16 pairs, exact: the fp32 float trick (2^23 + byte + 128,
// minus 2^23 + 128), then the high halves of two floats as one pair (|q| <= 128: exact).
FN void bf_quad_s8(uint v, THREAD_PTR(uint) out) {
  const uint u = v ^ 0x80808080u;
  float f[4];
  UNROLL for (int i = 0; i < 4; ++i)
    f[i] = bitcast<float>(0x4B000000u | ((u >> (8 * i)) & 0xFFu)) - 8388736.0f;
  out[0] = byte_perm(bitcast<uint>(f[0]), bitcast<uint>(f[1]), 0x7632u);
  out[1] = byte_perm(bitcast<uint>(f[2]), bitcast<uint>(f[3]), 0x7632u);
}
// The A fragment of one mma from the pairs of rows g (p0) and g + 8 (p1): a[0] = A[g][k0, k1],
// a[1] = A[g + 8][k0, k1], a[2] = A[g][k2, k3], a[3] = A[g + 8][k2, k3].
FN void frag(THREAD_PTR(uint) p0, THREAD_PTR(uint) p1, THREAD_PTR(uint) a) {
  a[0] = p0[0]; a[1] = p1[0]; a[2] = p0[1]; a[3] = p1[1];
}
"""

# The 32-blocks with fifth bits (Q5_0, Q5_1): lane t's word h (k 8t + 4h..+3 of the block) as
# four 5-bit bytes: nibbles of qs word q (low for t < 2, high above) with bits 8t + 4h..+3 of qh.
_Q5_WORD = r"""FN uint q5_word(uint q, uint qh, uint t, int h) {
  return ((q >> (4 * (t >> 1))) & 0x0F0F0F0Fu) | spread4((qh >> (8 * t + 4 * h)) & 0xFu);
}
"""

_DECODERS = {
    T.Q4_K: r"""
// Sub-block gi (32 k, 2 mmas): qs bytes 32j + 8t..8t+7 (j = gi / 2), nibble gi % 2; lane t's k
// are 8t..8t+7 of the sub-block. Scales and mins: k4_value (6-bit, get_scale_min_k4).
struct MRawQ4_K { uint dd; uint s0; uint s1; uint s2; uint q[8]; };
FN MRawQ4_K load_m_q4_k(DEVICE_PTR(const uchar) p, uint t) {
  MRawQ4_K r; r.dd = ld32(p, 0); r.s0 = ld32(p, 1); r.s1 = ld32(p, 2); r.s2 = ld32(p, 3);
  UNROLL for (int j = 0; j < 4; ++j) {
    const uint2 v = DEVICE_CAST(const uint2, p + 16 + 32 * j + 8 * t)[0];
    r.q[2 * j] = v.x; r.q[2 * j + 1] = v.y;
  }
  return r;
}
FN uint xoff_m_q4_k(uint t, int gi) { return uint(32 * gi) + 8 * t; }
FN void dq_m_q4_k(MRawQ4_K r0, MRawQ4_K r1, uint t, int gi, THREAD_PTR(uint) a,
                  THREAD_PTR(float) sc, THREAD_PTR(float) mn) {
  const int j = gi >> 1, sh = 4 * (gi & 1);
  const uint zb = bf2_zero(0.0f);
  UNROLL for (int h = 0; h < 2; ++h) {
    uint p0[2], p1[2];
    bf_quad((r0.q[2 * j + h] >> sh) & 0x0F0F0F0Fu, zb, p0);
    bf_quad((r1.q[2 * j + h] >> sh) & 0x0F0F0F0Fu, zb, p1);
    frag(p0, p1, a + 4 * h);
  }
  sc[0] = k4_value(r0.s0, r0.s1, r0.s2, 0, gi, f16lo(r0.dd));
  sc[1] = k4_value(r1.s0, r1.s1, r1.s2, 0, gi, f16lo(r1.dd));
  mn[0] = k4_value(r0.s0, r0.s1, r0.s2, 1, gi, f16hi(r0.dd));
  mn[1] = k4_value(r1.s0, r1.s1, r1.s2, 1, gi, f16hi(r1.dd));
}
""",
    T.Q6_K: r"""
// Group gi (16 k, 1 mma, its own int8 scale): half n = gi / 8, quarter c = (gi / 2) % 4, is =
// gi % 2; weight 16 gi + 4t + i is the nibble c / 2 of ql[64n + 32(c%2) + 16is + 4t + i] with
// bits 2c, 2c+1 of qh[32n + 16is + 4t + i] on top, minus 32. Blocks are 2-byte aligned.
struct MRawQ6_K { uint ql[8]; uint qh[4]; uint s[4]; uint d; };
FN MRawQ6_K load_m_q6_k(DEVICE_PTR(const uchar) p, uint t) {
  MRawQ6_K r;
  UNROLL for (int i = 0; i < 8; ++i)  // i = 4n + 2h + is: bytes 64n + 32h + 16is + 4t
    r.ql[i] = ld32u(p, 32 * (i >> 2) + 16 * ((i >> 1) & 1) + 8 * (i & 1) + 2 * t);
  UNROLL for (int i = 0; i < 4; ++i)  // i = 2n + is: bytes 128 + 32n + 16is + 4t
    r.qh[i] = ld32u(p, 64 + 16 * (i >> 1) + 8 * (i & 1) + 2 * t);
  UNROLL for (int i = 0; i < 4; ++i) r.s[i] = ld32u(p, 96 + 2 * i);  // the 16 int8 scales
  r.d = ld16(p, 104);
  return r;
}
FN uint xoff_m_q6_k(uint t, int gi) { return uint(16 * gi) + 4 * t; }
FN float q6_scale(MRawQ6_K r, int gi) {
  const uint b = (r.s[gi >> 2] >> (8 * (gi & 3))) & 0xFFu;
  return f16lo(r.d) * float(int(b ^ 0x80u) - 128);
}
FN void dq_m_q6_k(MRawQ6_K r0, MRawQ6_K r1, uint t, int gi, THREAD_PTR(uint) a,
                  THREAD_PTR(float) sc, THREAD_PTR(float) mn) {
  const int n = gi >> 3, c = (gi >> 1) & 3, is = gi & 1;
  const int iql = 4 * n + 2 * (c & 1) + is, iqh = 2 * n + is;
  const uint zb = bf2_zero(32.0f);
  uint p0[2], p1[2];
  bf_quad(((r0.ql[iql] >> (4 * (c >> 1))) & 0x0F0F0F0Fu)
          | (((r0.qh[iqh] >> (2 * c)) & 0x03030303u) << 4), zb, p0);
  bf_quad(((r1.ql[iql] >> (4 * (c >> 1))) & 0x0F0F0F0Fu)
          | (((r1.qh[iqh] >> (2 * c)) & 0x03030303u) << 4), zb, p1);
  frag(p0, p1, a);
  sc[0] = q6_scale(r0, gi); sc[1] = q6_scale(r1, gi);
  mn[0] = 0.0f; mn[1] = 0.0f;
}
""",
    T.Q5_0: r"""
// One group (32 k, 2 mmas); lane t's k are 8t..8t+7: qs bytes 8(t%2)..+7, low (t < 2) or high
// nibbles, fifth bits 8t..8t+7 of qh, minus 16. Blocks are 2-byte aligned.
struct MRawQ5_0 { uint d; uint qh; uint q0; uint q1; };
FN MRawQ5_0 load_m_q5_0(DEVICE_PTR(const uchar) p, uint t) {
  MRawQ5_0 r; r.d = ld16(p, 0); r.qh = ld32u(p, 1);
  r.q0 = ld32u(p, 3 + 4 * (t & 1)); r.q1 = ld32u(p, 5 + 4 * (t & 1));
  return r;
}
FN uint xoff_m_q5_0(uint t, int gi) { return 8 * t; }
"""
    + _Q5_WORD
    + r"""FN void dq_m_q5_0(MRawQ5_0 r0, MRawQ5_0 r1, uint t, int gi, THREAD_PTR(uint) a,
                  THREAD_PTR(float) sc, THREAD_PTR(float) mn) {
  const uint zb = bf2_zero(16.0f);
  uint p0[2], p1[2];
  bf_quad(q5_word(r0.q0, r0.qh, t, 0), zb, p0); bf_quad(q5_word(r1.q0, r1.qh, t, 0), zb, p1);
  frag(p0, p1, a);
  bf_quad(q5_word(r0.q1, r0.qh, t, 1), zb, p0); bf_quad(q5_word(r1.q1, r1.qh, t, 1), zb, p1);
  frag(p0, p1, a + 4);
  sc[0] = f16lo(r0.d); sc[1] = f16lo(r1.d);
  mn[0] = 0.0f; mn[1] = 0.0f;
}
""",
    T.Q8_0: r"""
// One group (32 k, 2 mmas); lane t's k are 8t..8t+7: qs bytes 8t..8t+7. 2-byte aligned.
struct MRawQ8_0 { uint d; uint q0; uint q1; };
FN MRawQ8_0 load_m_q8_0(DEVICE_PTR(const uchar) p, uint t) {
  MRawQ8_0 r; r.d = ld16(p, 0); r.q0 = ld32u(p, 1 + 4 * t); r.q1 = ld32u(p, 3 + 4 * t);
  return r;
}
FN uint xoff_m_q8_0(uint t, int gi) { return 8 * t; }
FN void dq_m_q8_0(MRawQ8_0 r0, MRawQ8_0 r1, uint t, int gi, THREAD_PTR(uint) a,
                  THREAD_PTR(float) sc, THREAD_PTR(float) mn) {
  uint p0[2], p1[2];
  bf_quad_s8(r0.q0, p0); bf_quad_s8(r1.q0, p1); frag(p0, p1, a);
  bf_quad_s8(r0.q1, p0); bf_quad_s8(r1.q1, p1); frag(p0, p1, a + 4);
  sc[0] = f16lo(r0.d); sc[1] = f16lo(r1.d);
  mn[0] = 0.0f; mn[1] = 0.0f;
}
""",
    # Below: GPU-verified in a later run (the GLU in a third: GLU_GPU_VERIFIED).
    T.Q4_0: r"""
// As Q5_0 without fifth bits: lane t's k are 8t..8t+7, qs bytes 8(t%2)..+7, low (t < 2) or
// high nibbles, minus 8. Blocks are 2-byte aligned.
struct MRawQ4_0 { uint d; uint q0; uint q1; };
FN MRawQ4_0 load_m_q4_0(DEVICE_PTR(const uchar) p, uint t) {
  MRawQ4_0 r; r.d = ld16(p, 0);
  r.q0 = ld32u(p, 1 + 4 * (t & 1)); r.q1 = ld32u(p, 3 + 4 * (t & 1));
  return r;
}
FN uint xoff_m_q4_0(uint t, int gi) { return 8 * t; }
FN void dq_m_q4_0(MRawQ4_0 r0, MRawQ4_0 r1, uint t, int gi, THREAD_PTR(uint) a,
                  THREAD_PTR(float) sc, THREAD_PTR(float) mn) {
  const uint zb = bf2_zero(8.0f), sh = 4 * (t >> 1);
  uint p0[2], p1[2];
  bf_quad((r0.q0 >> sh) & 0x0F0F0F0Fu, zb, p0); bf_quad((r1.q0 >> sh) & 0x0F0F0F0Fu, zb, p1);
  frag(p0, p1, a);
  bf_quad((r0.q1 >> sh) & 0x0F0F0F0Fu, zb, p0); bf_quad((r1.q1 >> sh) & 0x0F0F0F0Fu, zb, p1);
  frag(p0, p1, a + 4);
  sc[0] = f16lo(r0.d); sc[1] = f16lo(r1.d);
  mn[0] = 0.0f; mn[1] = 0.0f;
}
""",
    T.Q4_1: r"""
// As Q4_0, fields unbiased, with a min: weight d q + m, so the x-sum term's mn is -m. Blocks
// are 4-byte aligned.
struct MRawQ4_1 { uint dm; uint q0; uint q1; };
FN MRawQ4_1 load_m_q4_1(DEVICE_PTR(const uchar) p, uint t) {
  MRawQ4_1 r; r.dm = ld32(p, 0);
  r.q0 = ld32(p, 1 + 2 * (t & 1)); r.q1 = ld32(p, 2 + 2 * (t & 1));
  return r;
}
FN uint xoff_m_q4_1(uint t, int gi) { return 8 * t; }
FN void dq_m_q4_1(MRawQ4_1 r0, MRawQ4_1 r1, uint t, int gi, THREAD_PTR(uint) a,
                  THREAD_PTR(float) sc, THREAD_PTR(float) mn) {
  const uint zb = bf2_zero(0.0f), sh = 4 * (t >> 1);
  uint p0[2], p1[2];
  bf_quad((r0.q0 >> sh) & 0x0F0F0F0Fu, zb, p0); bf_quad((r1.q0 >> sh) & 0x0F0F0F0Fu, zb, p1);
  frag(p0, p1, a);
  bf_quad((r0.q1 >> sh) & 0x0F0F0F0Fu, zb, p0); bf_quad((r1.q1 >> sh) & 0x0F0F0F0Fu, zb, p1);
  frag(p0, p1, a + 4);
  sc[0] = f16lo(r0.dm); sc[1] = f16lo(r1.dm);
  mn[0] = -f16hi(r0.dm); mn[1] = -f16hi(r1.dm);
}
""",
    T.Q5_1: r"""
// As Q5_0, fields unbiased, with a min (as Q4_1: mn = -m). Blocks are 4-byte aligned.
struct MRawQ5_1 { uint dm; uint qh; uint q0; uint q1; };
FN MRawQ5_1 load_m_q5_1(DEVICE_PTR(const uchar) p, uint t) {
  MRawQ5_1 r; r.dm = ld32(p, 0); r.qh = ld32(p, 1);
  r.q0 = ld32(p, 2 + 2 * (t & 1)); r.q1 = ld32(p, 3 + 2 * (t & 1));
  return r;
}
FN uint xoff_m_q5_1(uint t, int gi) { return 8 * t; }
"""
    + _Q5_WORD
    + r"""FN void dq_m_q5_1(MRawQ5_1 r0, MRawQ5_1 r1, uint t, int gi, THREAD_PTR(uint) a,
                  THREAD_PTR(float) sc, THREAD_PTR(float) mn) {
  const uint zb = bf2_zero(0.0f);
  uint p0[2], p1[2];
  bf_quad(q5_word(r0.q0, r0.qh, t, 0), zb, p0); bf_quad(q5_word(r1.q0, r1.qh, t, 0), zb, p1);
  frag(p0, p1, a);
  bf_quad(q5_word(r0.q1, r0.qh, t, 1), zb, p0); bf_quad(q5_word(r1.q1, r1.qh, t, 1), zb, p1);
  frag(p0, p1, a + 4);
  sc[0] = f16lo(r0.dm); sc[1] = f16lo(r1.dm);
  mn[0] = -f16hi(r0.dm); mn[1] = -f16hi(r1.dm);
}
""",
    T.Q5_K: r"""
// As Q4_K (qs at byte 48); the fifth bit of weight 32 gi + l is bit gi of qh[l]: lane t holds
// qh bytes 8t..8t+7, the bits of its k 8t..8t+7 in every sub-block.
struct MRawQ5_K { uint dd; uint s0; uint s1; uint s2; uint h0; uint h1; uint q[8]; };
FN MRawQ5_K load_m_q5_k(DEVICE_PTR(const uchar) p, uint t) {
  MRawQ5_K r; r.dd = ld32(p, 0); r.s0 = ld32(p, 1); r.s1 = ld32(p, 2); r.s2 = ld32(p, 3);
  const uint2 h = DEVICE_CAST(const uint2, p + 16 + 8 * t)[0];
  r.h0 = h.x; r.h1 = h.y;
  UNROLL for (int j = 0; j < 4; ++j) {
    const uint2 v = DEVICE_CAST(const uint2, p + 48 + 32 * j + 8 * t)[0];
    r.q[2 * j] = v.x; r.q[2 * j + 1] = v.y;
  }
  return r;
}
FN uint xoff_m_q5_k(uint t, int gi) { return uint(32 * gi) + 8 * t; }
FN uint q5k_word(uint q, uint h, int gi) {
  return ((q >> (4 * (gi & 1))) & 0x0F0F0F0Fu) | (((h >> gi) & 0x01010101u) << 4);
}
FN void dq_m_q5_k(MRawQ5_K r0, MRawQ5_K r1, uint t, int gi, THREAD_PTR(uint) a,
                  THREAD_PTR(float) sc, THREAD_PTR(float) mn) {
  const int j = gi >> 1;
  const uint zb = bf2_zero(0.0f);
  uint p0[2], p1[2];
  bf_quad(q5k_word(r0.q[2 * j], r0.h0, gi), zb, p0);
  bf_quad(q5k_word(r1.q[2 * j], r1.h0, gi), zb, p1);
  frag(p0, p1, a);
  bf_quad(q5k_word(r0.q[2 * j + 1], r0.h1, gi), zb, p0);
  bf_quad(q5k_word(r1.q[2 * j + 1], r1.h1, gi), zb, p1);
  frag(p0, p1, a + 4);
  sc[0] = k4_value(r0.s0, r0.s1, r0.s2, 0, gi, f16lo(r0.dd));
  sc[1] = k4_value(r1.s0, r1.s1, r1.s2, 0, gi, f16lo(r1.dd));
  mn[0] = k4_value(r0.s0, r0.s1, r0.s2, 1, gi, f16hi(r0.dd));
  mn[1] = k4_value(r1.s0, r1.s1, r1.s2, 1, gi, f16hi(r1.dd));
}
""",
    T.Q3_K: r"""
// Groups as Q6_K (16 k, 1 mma, own scale): n = gi / 8, j = (gi / 2) % 4, is = gi % 2; weight
// 16 gi + 4t + i is bits 2j, 2j+1 of qs[32n + 16is + 4t + i] with bit 4n + j of
// hmask[16is + 4t + i] as bit 2, minus 4 (a cleared mask bit subtracts 4). Scale s (6 bits,
// minus 32): nibble s / 8 of byte s % 8, bits 2 (s / 4) of byte 8 + s % 4. 2-byte aligned.
struct MRawQ3_K { uint q[4]; uint hm[2]; uint s[3]; uint d; };
FN MRawQ3_K load_m_q3_k(DEVICE_PTR(const uchar) p, uint t) {
  MRawQ3_K r;
  UNROLL for (int i = 0; i < 4; ++i)  // i = 2n + is: bytes 32 + 32n + 16is + 4t
    r.q[i] = ld32u(p, 16 + 16 * (i >> 1) + 8 * (i & 1) + 2 * t);
  UNROLL for (int i = 0; i < 2; ++i) r.hm[i] = ld32u(p, 8 * i + 2 * t);  // bytes 16is + 4t
  UNROLL for (int i = 0; i < 3; ++i) r.s[i] = ld32u(p, 48 + 2 * i);  // the 12 scale bytes
  r.d = ld16(p, 54);
  return r;
}
FN uint xoff_m_q3_k(uint t, int gi) { return uint(16 * gi) + 4 * t; }
FN float q3_scale(MRawQ3_K r, int gi) {
  const uint lo = (r.s[(gi & 7) >> 2] >> (8 * (gi & 3) + 4 * (gi >> 3))) & 0xFu;
  const uint hi = (r.s[2] >> (8 * (gi & 3) + 2 * (gi >> 2))) & 0x3u;
  return f16lo(r.d) * float(int(lo | (hi << 4)) - 32);
}
FN uint q3_word(MRawQ3_K r, int gi) {
  const int n = gi >> 3, j = (gi >> 1) & 3, is = gi & 1;
  return ((r.q[2 * n + is] >> (2 * j)) & 0x03030303u)
         | (((r.hm[is] >> (4 * n + j)) & 0x01010101u) << 2);
}
FN void dq_m_q3_k(MRawQ3_K r0, MRawQ3_K r1, uint t, int gi, THREAD_PTR(uint) a,
                  THREAD_PTR(float) sc, THREAD_PTR(float) mn) {
  const uint zb = bf2_zero(4.0f);
  uint p0[2], p1[2];
  bf_quad(q3_word(r0, gi), zb, p0); bf_quad(q3_word(r1, gi), zb, p1);
  frag(p0, p1, a);
  sc[0] = q3_scale(r0, gi); sc[1] = q3_scale(r1, gi);
  mn[0] = 0.0f; mn[1] = 0.0f;
}
""",
    T.Q2_K: r"""
// Groups as Q6_K (16 k, 1 mma): n = gi / 8, j = (gi / 2) % 4, is = gi % 2; weight
// 16 gi + 4t + i is bits 2j, 2j+1 of qs[32n + 16is + 4t + i]; scale byte gi holds the group's
// scale (low nibble) and min (high): weight d sc q - dmin m. Blocks are 4-byte aligned.
struct MRawQ2_K { uint q[4]; uint s[4]; uint dd; };
FN MRawQ2_K load_m_q2_k(DEVICE_PTR(const uchar) p, uint t) {
  MRawQ2_K r;
  UNROLL for (int i = 0; i < 4; ++i)  // i = 2n + is: bytes 16 + 32n + 16is + 4t
    r.q[i] = ld32(p, 4 + 8 * (i >> 1) + 4 * (i & 1) + t);
  UNROLL for (int i = 0; i < 4; ++i) r.s[i] = ld32(p, i);  // the 16 scale bytes
  r.dd = ld32(p, 20);
  return r;
}
FN uint xoff_m_q2_k(uint t, int gi) { return uint(16 * gi) + 4 * t; }
FN void dq_m_q2_k(MRawQ2_K r0, MRawQ2_K r1, uint t, int gi, THREAD_PTR(uint) a,
                  THREAD_PTR(float) sc, THREAD_PTR(float) mn) {
  const int n = gi >> 3, j = (gi >> 1) & 3, is = gi & 1;
  const uint zb = bf2_zero(0.0f);
  uint p0[2], p1[2];
  bf_quad((r0.q[2 * n + is] >> (2 * j)) & 0x03030303u, zb, p0);
  bf_quad((r1.q[2 * n + is] >> (2 * j)) & 0x03030303u, zb, p1);
  frag(p0, p1, a);
  const uint b0 = (r0.s[gi >> 2] >> (8 * (gi & 3))) & 0xFFu;
  const uint b1 = (r1.s[gi >> 2] >> (8 * (gi & 3))) & 0xFFu;
  sc[0] = f16lo(r0.dd) * float(b0 & 0xFu); sc[1] = f16lo(r1.dd) * float(b1 & 0xFu);
  mn[0] = f16hi(r0.dd) * float(b0 >> 4); mn[1] = f16hi(r1.dd) * float(b1 >> 4);
}
""",
}

# (NGR scale groups per block, MMG mmas per group): the group's k / 16
_GROUPS = {
    T.Q4_K: (8, 2), T.Q6_K: (16, 1), T.Q5_0: (1, 2), T.Q8_0: (1, 2),
    T.Q4_0: (1, 2), T.Q4_1: (1, 2), T.Q5_1: (1, 2), T.Q5_K: (8, 2),
    T.Q3_K: (16, 1), T.Q2_K: (16, 1),
}  # fmt: skip
MMA_TYPES = tuple(_DECODERS)  # GGML types with a tensor-core kernel (a decoder)
# The types whose kernels passed the GPU tests (H200: fragment layout, the bf16 bound, row
# parity at M = 1..32); the dispatchers take only these unless ALL_TYPES (below). The mat-vec:
# every decoder (Q4_K, Q6_K, Q5_0, Q8_0 first, the other six in a later run). The dense GLU
# (its own GPU test, two row sets): every decoder too (Q5_1, Q5_K, Q3_K, Q2_K on 2026-12-02).
GPU_VERIFIED = frozenset(_DECODERS)
GLU_GPU_VERIFIED = frozenset(_DECODERS)
MAX_ROWS = 32  # rows of x one launch takes (up to four n-tiles of 8)
# NVRTC for sm_90: every type's NT = 4 kernel at its default U holds its accumulators in
# registers, no spills (Q6_K the most: 181 registers, 184 at NT = 2), so every type takes the
# full MAX_ROWS (its GPU test covers M = 1..32); docs/kernel_notes.md, "tensor-core mat-vec".

# --------------------------------------------------------------------------------------------
# Kernel

_BODY = r"""
  // Thread mapping: a threadgroup owns 16 rows (row0 + 0..15) of each of its H row sets (H = 1:
  // the weight's rows; H = 2: a GLU's gate rows and, N rows further, its up rows) and every
  // column of x (M <= 8 NT: NT n-tiles of 8); each of its n_simd SIMD groups takes interleaved
  // runs of U blocks of those rows. Lane = 4g + t decodes rows g and g + 8 of each set (its A
  // fragments) and loads x column 8 nt + g (its B fragments, shared by the sets); a scale
  // group's mmas sum into a zeroed c, which the group's scale (and, with a min, the column's x
  // sum) folds into fp32 accumulators. The SIMD groups' sums meet in shared memory, added in
  // SIMD-group order. Each output column depends on its own x column only, in an order fixed
  // by (N, K): a row's bits are the same at any M.
  constexpr uint QK = @QK@, BB = @BB@;
  constexpr int NGR = @NGR@, MMG = @MMG@;  // scale groups per block, mmas per group
  constexpr int H = @H@;  // row sets
  const uint M = uint(dims[0]);
  const uint N = uint(dims[1]);  // rows per set
  const uint K = uint(dims[2]);
  const uint nb = K / QK;
  const size_t row_bytes = size_t(nb) * BB;
  const uint g = lane >> 2, t = lane & 3u;
@ROW0@  // rows g, g + 8 of set h: wr[2h], wr[2h + 1]; rows past N re-read row N - 1, sums dropped
  DEVICE_PTR(const uchar) wr[2 * H];
  UNROLL for (int h = 0; h < H; ++h) {
    wr[2 * h] = w + (size_t(h) * N + (row0 + g < N ? row0 + g : N - 1)) * row_bytes;
    wr[2 * h + 1] = w + (size_t(h) * N + (row0 + g + 8 < N ? row0 + g + 8 : N - 1)) * row_bytes;
  }
  float acc[H][NT][4];
  UNROLL for (int h = 0; h < H; ++h) UNROLL for (int n = 0; n < NT; ++n)
    UNROLL for (int i = 0; i < 4; ++i) acc[h][n][i] = 0.0f;
  // PF = 1: each run's loads are issued one run ahead, before the current run's math (the
  // loads then overlap it); PF = 0: a run loads, then works. The math and its order are the same.
  MRaw@SUF@ raw[U][2 * H];
  if (PF) {
@LOADS_FIRST@  }
  for (uint b0 = kb0 + simd_id * U; b0 < kb1; b0 += n_simd * U) {
    MRaw@SUF@ nxt[U][2 * H];
    if (PF) {  // the SIMD group's next run (past the end: block 0, never worked on)
@LOADS_NEXT@    } else {  // all loads of the run first: U blocks x 2H rows in flight per lane
@LOADS_THIS@    }
    UNROLL for (int u = 0; u < U; ++u) {
      const uint blk = b0 + uint(u);
      if (blk >= kb1) continue;  // uniform over the SIMD group: its shuffles stay together
      DEVICE_PTR(const T) xb = x + size_t(blk) * QK;
      // XG scale groups at a time (XG from HF2Q_MMA_XG, a power of 2): their x fragments are
      // all loaded before the first of their mmas, so those loads are in flight together
      constexpr int XGN = XG < NGR ? XG : NGR;
      UNROLL for (int gi0 = 0; gi0 < NGR; gi0 += XGN) {
        uint bxs[XGN][NT][2 * MMG];
        UNROLL for (int n = 0; n < NT; ++n) {
          const uint col = 8 * uint(n) + g;
          // x of column col at the lane's k; padding columns are zeros. Branch-free (column
          // 0 re-read, then selected away), so the warp stays converged for the mma.sync.
          const bool live = col < M;
          UNROLL for (int gj = 0; gj < XGN; ++gj) {
            THREAD_PTR(uint) bx = bxs[gj][n];
            load_xb(xb + size_t(live ? col : 0u) * K + xoff_m_@suf@(t, gi0 + gj), MMG, bx);
            UNROLL for (int i = 0; i < 2 * MMG; ++i) bx[i] = live ? bx[i] : 0u;
          }
        }
        UNROLL for (int gj = 0; gj < XGN; ++gj) {
          const int gi = gi0 + gj;
          uint a[H][4 * MMG];
          float sc[H][2], mn[H][2];
          UNROLL for (int h = 0; h < H; ++h)
            dq_m_@suf@(raw[u][2 * h], raw[u][2 * h + 1], t, gi, a[h], sc[h], mn[h]);
          UNROLL for (int n = 0; n < NT; ++n) {
            if (8 * uint(n) >= M) continue;  // an n-tile of padding only: uniform skip
            THREAD_PTR(const uint) bx = bxs[gj][n];
            UNROLL for (int h = 0; h < H; ++h) {
              float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
              UNROLL for (int mm = 0; mm < MMG; ++mm)
                mma_bf16_m16n8k16(c, a[h] + 4 * mm, bx + 2 * mm);
              acc[h][n][0] = fma_f(sc[h][0], c[0], acc[h][n][0]);  // C[g][2t], C[g][2t + 1]
              acc[h][n][1] = fma_f(sc[h][0], c[1], acc[h][n][1]);
              acc[h][n][2] = fma_f(sc[h][1], c[2], acc[h][n][2]);  // C[g + 8][2t], [2t + 1]
              acc[h][n][3] = fma_f(sc[h][1], c[3], acc[h][n][3]);
            }
            if (@BIAS@) {
              // the group's x sum per column, by the tensor core (once for all sets): A = all
              // ones puts the sum of column 2t (2t + 1) in cs[0] and cs[2] (cs[1], cs[3]),
              // already in the C layout; each column's sum depends on that column only
              const uint ones[4] = {0x3F803F80u, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u};
              float cs[4] = {0.0f, 0.0f, 0.0f, 0.0f};
              UNROLL for (int mm = 0; mm < MMG; ++mm) mma_bf16_m16n8k16(cs, ones, bx + 2 * mm);
              UNROLL for (int h = 0; h < H; ++h) {
                acc[h][n][0] = fma_f(-mn[h][0], cs[0], acc[h][n][0]);
                acc[h][n][1] = fma_f(-mn[h][0], cs[1], acc[h][n][1]);
                acc[h][n][2] = fma_f(-mn[h][1], cs[2], acc[h][n][2]);
                acc[h][n][3] = fma_f(-mn[h][1], cs[3], acc[h][n][3]);
              }
            }
          }
        }
      }
    }
    if (PF) {
      UNROLL for (int u = 0; u < U; ++u)
        UNROLL for (int r = 0; r < 2 * H; ++r) raw[u][r] = nxt[u][r];
    }
  }
  // The SIMD groups' sums, through shared memory in a fixed order; the epilogue writes (M, N).
  constexpr uint CW = 8 * NT;  // columns of x
  SHARED float red[H * 8 * 16 * CW];  // [set][SIMD group][row 0..15][column 0..CW - 1]
  UNROLL for (int h = 0; h < H; ++h) UNROLL for (int n = 0; n < NT; ++n)
    UNROLL for (int i = 0; i < 4; ++i)
      red[((uint(h) * 8 + simd_id) * 16 + g + 8 * uint(i >> 1)) * CW + 8 * uint(n) + 2 * t +
          uint(i & 1)] = acc[h][n][i];
  BARRIER();
  for (uint i = tid; i < 16 * CW; i += tg_size) {
    const uint r = i / CW, col = i % CW;
    if (row0 + r >= N || col >= M) continue;
    float v[H];
    UNROLL for (int h = 0; h < H; ++h) {
      v[h] = red[(uint(h) * 8 * 16 + r) * CW + col];
      for (uint s = 1; s < n_simd; ++s) v[h] += red[((uint(h) * 8 + s) * 16 + r) * CW + col];
    }
@EPILOGUE@  }
"""

# the mat-vec's epilogue: row0 + r of W, column col of x
_MATMUL_EPILOGUE = "    out[size_t(col) * N + row0 + r] = from_float<T>(v[0]);\n"

_LOAD_XB = r"""
// n * 4 consecutive bf16 x (8 * n bytes, aligned) as n * 2 pairs, lower k in the low half.
FN void load_xb(DEVICE_PTR(const bfloat_t) p, int n, THREAD_PTR(uint) b) {
  if (n == 2) {
    const uint4 v = DEVICE_CAST(const uint4, p)[0];
    b[0] = v.x; b[1] = v.y; b[2] = v.z; b[3] = v.w;
  } else {
    const uint2 v = DEVICE_CAST(const uint2, p)[0];
    b[0] = v.x; b[1] = v.y;
  }
}
"""

# Weight bytes are read once per call: the streaming variant (config S = 1) loads them with
# ld.global.cs (evicted from L1 first), so the small x every SIMD group re-reads stays in L1
# (Nsight Compute, session 32: the kernel waits on memory with L1 hitting 54 %). Plain loads on
# Metal and the CPU emulator, so both variants give the same bits everywhere.
_STREAM_LOADS = r"""
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
template <typename V> FN V load_stream(const V* p) { return __ldcs(p); }
#else
template <typename V> FN V load_stream(DEVICE_PTR(const V) p) { return *p; }
#endif
FN uint ld32s(DEVICE_PTR(const uchar) p, uint i) {
  return load_stream(DEVICE_CAST(const uint, p) + i);
}
FN uint ld16s(DEVICE_PTR(const uchar) p, uint i) {
  return uint(load_stream(DEVICE_CAST(const ushort, p) + i));
}
FN uint ld32us(DEVICE_PTR(const uchar) p, uint i) { return ld16s(p, i) | (ld16s(p, i + 1) << 16); }
"""


def _run_loads(dst: str, first: str, indent: str) -> str:
    """Body text: the U blocks x 2H rows of the run starting at block ``first`` into ``dst``
    (blocks past the end read block 0, whose math is skipped)."""
    return (
        f"{indent}UNROLL for (int u = 0; u < U; ++u) {{\n"
        f"{indent}  const uint blk = {first} + uint(u);\n"
        f"{indent}  const size_t off = size_t(blk < nb ? blk : 0) * BB;\n"
        f"{indent}  UNROLL for (int r = 0; r < 2 * H; ++r)\n"
        f"{indent}    {dst}[u][r] = load_m_@suf@(wr[r] + off, t);\n"
        f"{indent}}}\n"
    )


# the loop with its run loads written out (expert_mma edits this text too; PF is a template
# value here, a constant 0 there)
_BODY = (
    _BODY.replace("@LOADS_FIRST@", _run_loads("raw", "kb0 + simd_id * U", "    "))
    .replace("@LOADS_NEXT@", _run_loads("nxt", "(b0 + n_simd * U)", "      "))
    .replace("@LOADS_THIS@", _run_loads("raw", "b0", "      "))
)
# which 16 rows a threadgroup owns, and which of their blocks [kb0, kb1): all of them, or (the
# split over K, template KS) split ks of KS, the threadgroups of split 0 first
_ROW0_ALL = """  const uint row0 = gid_x * 16;
  constexpr uint kb0 = 0u;
  const uint kb1 = nb;
"""
_ROW0_SPLIT = """
  // KS > 1: threadgroup gid_x sums split gid_x / tiles of its rows' blocks (fp32 sums, added
  // in split order by the sum kernel)
  const uint tiles = (N + 15u) / 16u, ks = gid_x / tiles;
  const uint row0 = (gid_x - ks * tiles) * 16u;
  const uint kb0 = ks * nb / uint(KS), kb1 = (ks + 1u) * nb / uint(KS);
"""
_SPLIT_BODY = _BODY.replace("@ROW0@", _ROW0_SPLIT)
_BODY = _BODY.replace("@ROW0@", _ROW0_ALL)


def stream_decoder(text: str) -> str:
    """A decoder's text with its weight loads made streaming loads (``_STREAM_LOADS``)."""
    text = re.sub(r"\bld32\(p,", "ld32s(p,", text)
    text = re.sub(r"\bld32u\(p,", "ld32us(p,", text)
    text = re.sub(r"\bld16\(p,", "ld16s(p,", text)
    return re.sub(
        r"DEVICE_CAST\(const (uint[24]?), ([^)]*)\)\[0\]",
        r"load_stream(DEVICE_CAST(const \1, \2))",
        text,
    )


MAX_SIMD = 8  # the `red` buffer holds 8 SIMD groups
X_ALL = 16  # XG that loads every scale group's x fragments of a block at once (NGR <= 16)
# (U, W max) per block size, not yet measured on the GPU: enough blocks in flight per SM for
# the small projection shapes (docs/kernel_notes.md, "tensor-core mat-vec")
_DEFAULTS = {256: (2, 8), 32: (8, 8)}


def make_kernel(
    name: str,
    ggml_type: int,
    examples: list[Example],
    *,
    halves: int = 1,
    epilogue: str = _MATMUL_EPILOGUE,
    header: str = "",
    stream: bool = False,
    body: str = _BODY,
    inputs: tuple[str, ...] = ("x", "w", "dims"),
    outputs: tuple[str, ...] = ("out",),
) -> Kernel:
    """The mma loop over ``halves`` row sets of ``ggml_type`` weights (inputs x, w, dims; output
    out) with ``epilogue``: the lines that write output row0 + r, column col from the sets'
    fp32 sums v[0..halves - 1]. Template T, NT, U, plus whatever ``header`` and ``epilogue``
    use. The tensor-core GLU (expert_glu.dense_glu) is ``halves`` = 2 with an activation.
    ``stream``: the weight loads as streaming loads (``_STREAM_LOADS``; config S = 1).
    ``body``: the loop's text (``_SPLIT_BODY``: one split over K a threadgroup); ``inputs``,
    ``outputs``: the kernel's names (x, w and out first)."""
    ngr, mmg = _GROUPS[ggml_type]
    decoder = _DECODERS[ggml_type]
    if stream:
        decoder = _STREAM_LOADS + stream_decoder(decoder)
    body = (
        fill_format(body, ggml_type)
        .replace("@NGR@", str(ngr))
        .replace("@MMG@", str(mmg))
        .replace("@H@", str(halves))
        .replace("@EPILOGUE@", epilogue)
    )
    return Kernel(
        name,
        inputs=list(inputs),
        outputs=list(outputs),
        body=body,
        header=kernel_header(ggml_type) + _MMA_COMMON + _LOAD_XB + decoder + header,
        examples=examples,
    )


def _example(
    out: mx.Dtype,
    nt: int,
    u: int,
    pf: int,
    xg: int,
    ks: int = 1,
    extra_inputs: dict | None = None,
    extra_outputs: dict | None = None,
) -> Example:
    """An Example of a mat-vec kernel: x, w (``extra_inputs`` after them), dims -> out
    (``extra_outputs`` after it); template KS where ``ks`` > 1."""
    inputs = {"x": mx.bfloat16, "w": mx.uint8, **(extra_inputs or {}), "dims": (mx.int32, 3)}
    template = {"T": mx.bfloat16, "NT": nt, "U": u, "PF": pf, "XG": xg,
                **({"KS": ks} if ks > 1 else {})}  # fmt: skip
    return Example(inputs, {"out": out, **(extra_outputs or {})}, template)


def _make_kernel(ggml_type: int, stream: bool = False, split: bool = False) -> Kernel:
    """The mat-vec of one type; ``split``: its split over K (template KS), whose fp32 output
    (KS, M, N) holds each split's sums for ``_SUM_KERNEL``."""
    out = mx.float32 if split else mx.bfloat16
    examples = [
        _example(out, nt, u, pf, xg, 3 if split else 1)
        for nt, u, pf, xg in ((1, 2, 0, 1), (2, 1, 1, X_ALL), (4, 2, 0, 1))
    ]
    name = f"ggml_qmv_mma_{'s_' if stream else ''}{'ks_' if split else ''}"
    name += T(ggml_type).name.lower()
    if not split:
        return make_kernel(name, ggml_type, examples, stream=stream)
    return make_kernel(name, ggml_type, examples, stream=stream, body=_SPLIT_BODY,
                       epilogue=_SPLIT_EPILOGUE)  # fmt: skip


# a split's sums, fp32: out is (KS, M, N)
_SPLIT_EPILOGUE = "    out[(size_t(ks) * M + col) * N + row0 + r] = v[0];\n"

# Paired rows (config R = 2): a threadgroup owns rows row0 + 0..15 and N / 2 + row0 + 0..15 of an
# N-row weight (N even), the GLU's two row sets without its activation. The same math per row as
# R = 1 at the same U and W (the same bits); each lane decodes 4 rows against one load of its x
# fragments, as the dense GLU does (session 32's Nsight Compute: the mat-vec at ~4.2
# instructions a weight and lane, the GLU reading at 44 % of DRAM where the mat-vec read 30 %).
_PAIR_EPILOGUE = """    UNROLL for (int h = 0; h < 2; ++h)
      out[size_t(col) * 2u * N + size_t(h) * N + row0 + r] = from_float<T>(v[h]);
"""
_PAIR_SPLIT_EPILOGUE = """    UNROLL for (int h = 0; h < 2; ++h)
      out[(size_t(ks) * M + col) * 2u * N + size_t(h) * N + row0 + r] = v[h];
"""


def _make_pair_kernel(ggml_type: int, split: bool = False) -> Kernel:
    """The mat-vec of one type over paired rows (R = 2; dims [M, N / 2, K]); ``split``: its
    split over K, fp32 (KS, M, N) out as the unpaired split's."""
    example = _example(mx.float32 if split else mx.bfloat16, 1, 2, 0, X_ALL, 3 if split else 1)
    name = f"ggml_qmv_mma_{'ks_' if split else ''}r2_{T(ggml_type).name.lower()}"
    return make_kernel(name, ggml_type, [example], halves=2,
                       epilogue=_PAIR_SPLIT_EPILOGUE if split else _PAIR_EPILOGUE,
                       body=_SPLIT_BODY if split else _BODY)  # fmt: skip


_KERNELS: dict[int, Kernel] = {t: _make_kernel(t) for t in MMA_TYPES}
_STREAM_KERNELS: dict[int, Kernel] = {t: _make_kernel(t, stream=True) for t in MMA_TYPES}
_SPLIT_KERNELS: dict[tuple[int, bool], Kernel] = {
    (t, s): _make_kernel(t, stream=s, split=True) for t in MMA_TYPES for s in (False, True)
}

# The split with its sum fused (config SF = 1): each split stores its fp32 sums coherently into
# ``part`` (KS, M, N), counts itself in on its tile's counter (set cset[0] of the plan's), and
# the split taking ticket KS - 1 zeroes the counter and adds the KS sums in split order, the
# sum kernel's order: the same bits in one launch instead of two.
_FUSED_SPLIT_EPILOGUE = """    ATOMIC_STORE_U32(
        DEVICE_CAST(uint, part) + (size_t(ks) * M + col) * N + row0 + r, bitcast<uint>(v[0]));
"""
_FUSED_SPLIT_TAIL = """
  SHARED uint last_split[1];
  BARRIER_DEVICE_FENCE();
  if (tid == 0) {
    const uint tile = gid_x - ks * tiles;
    DEVICE_PTR(uint) ctr = DEVICE_CAST(uint, counter) + size_t(cset[0]) * tiles + tile;
    const uint ticket = ATOMIC_ADD_U32(ctr, 1u);
    last_split[0] = ticket == uint(KS - 1) ? 1u : 0u;
    if (ticket == uint(KS - 1)) ATOMIC_STORE_U32(ctr, 0u);
  }
  BARRIER_DEVICE_FENCE();
  if (last_split[0] == 0u) return;  // the whole threadgroup leaves together
  DEVICE_PTR(const uint) pb = DEVICE_CAST(const uint, part);
  for (uint i = tid; i < 16 * CW; i += tg_size) {
    const uint r = i / CW, col = i % CW;
    if (row0 + r >= N || col >= M) continue;
    const size_t e = size_t(col) * N + row0 + r;
    float v = bitcast<float>(ATOMIC_LOAD_U32(pb + e));
    for (uint j = 1; j < uint(KS); ++j)
      v += bitcast<float>(ATOMIC_LOAD_U32(pb + size_t(j) * M * N + e));
    out[e] = from_float<T>(v);
  }
"""


def _make_fused_split_kernel(ggml_type: int) -> Kernel:
    """The split over K with its sum fused (config SF = 1): inputs x, w, counter, cset, dims;
    outputs out (M, N) and the splits' fp32 sums part (KS, M, N)."""
    example = _example(
        mx.bfloat16, 1, 2, 0, X_ALL, 2,
        extra_inputs={"counter": (mx.uint32, 64), "cset": (mx.int32, 1)},
        extra_outputs={"part": mx.float32},
    )  # fmt: skip
    return make_kernel(
        f"ggml_qmv_mma_ksf_{T(ggml_type).name.lower()}",
        ggml_type,
        [example],
        body=_SPLIT_BODY + _FUSED_SPLIT_TAIL,
        epilogue=_FUSED_SPLIT_EPILOGUE,
        inputs=("x", "w", "counter", "cset", "dims"),
        outputs=("out", "part"),
    )


_FUSED_SPLIT_KERNELS: dict[int, Kernel] = {t: _make_fused_split_kernel(t) for t in MMA_TYPES}

_PAIR_KERNELS: dict[tuple[int, bool], Kernel] = {
    (t, split): _make_pair_kernel(t, split) for t in MMA_TYPES for split in (False, True)
}

# Column splits (config CS > 1): the M <= 8 NT columns of x split over CS threadgroups per 16
# rows, each taking NT / CS n-tiles (template NT: a threadgroup's), the splits of a tile next
# to each other in the grid (its weight bytes read from L2 by the later ones). Every column's
# math is that of the unsplit kernel at the same U and W: the same bits at every M. At 4
# n-tiles a threadgroup reads all 32 rows of x for its 16 weight rows and its SIMD groups wait
# on them group by group (session 54, H100: 35B-A3B's 32-row mat-vecs at 0.22-0.39 TB/s).
_COLUMN_EDITS = [
    ("  const uint row0 = gid_x * 16;\n",
     "  // CS > 1: threadgroup gid_x owns n-tiles NT (gid_x % CS) .. + NT - 1 of x's columns\n"
     "  const uint row0 = (gid_x / uint(CS)) * 16u, c0 = 8u * NT * (gid_x % uint(CS));\n"
     "  if (c0 >= M) return;  // columns of padding only: the whole threadgroup leaves\n"),
    ("          const uint col = 8 * uint(n) + g;\n",
     "          const uint col = c0 + 8 * uint(n) + g;\n"),
    ("if (8 * uint(n) >= M) continue;", "if (c0 + 8 * uint(n) >= M) continue;"),
    ("const uint r = i / CW, col = i % CW;\n", "const uint r = i / CW, col = c0 + i % CW;\n"),
    ("      v[h] = red[(uint(h) * 8 * 16 + r) * CW + col];\n",
     "      v[h] = red[(uint(h) * 8 * 16 + r) * CW + col - c0];\n"),
    ("v[h] += red[((uint(h) * 8 + s) * 16 + r) * CW + col];",
     "v[h] += red[((uint(h) * 8 + s) * 16 + r) * CW + col - c0];"),
]  # fmt: skip


def column_body() -> str:
    """``_BODY`` with its columns split over CS threadgroups (``_COLUMN_EDITS``)."""
    body = _BODY
    for old, new in _COLUMN_EDITS:
        if body.count(old) != 1:  # the loop changed shape: these edits must follow it
            raise RuntimeError(f"qmatmul_mma: the loop no longer has {old.strip()!r} once")
        body = body.replace(old, new)
    return body


def _make_column_kernel(ggml_type: int, stream: bool = False) -> Kernel:
    """The mat-vec of one type with its columns split (template CS; ``stream``: S = 1)."""
    examples = [
        Example(ex.inputs, ex.outputs, {**ex.template, "CS": cs})
        for ex, cs in ((_example(mx.bfloat16, 1, 2, 0, X_ALL), 4),
                       (_example(mx.bfloat16, 2, 2, 0, 1), 2))
    ]  # fmt: skip
    name = f"ggml_qmv_mma_{'s_' if stream else ''}cs_{T(ggml_type).name.lower()}"
    return make_kernel(name, ggml_type, examples, stream=stream, body=column_body())


_COLUMN_KERNELS: dict[tuple[int, bool], Kernel] = {
    (t, s): _make_column_kernel(t, s) for t in MMA_TYPES for s in (False, True)
}

_SUM_BODY = """
  // One thread per output element e of (M, N): the KS splits' fp32 sums added in split order.
  const uint64_t e = uint64_t(gid_x) * tg_size + tid;
  const uint64_t size = uint64_t(uint(dims[0])) * uint(dims[1]);
  if (e >= size) return;
  float v = part[e];
  for (int s = 1; s < dims[2]; ++s) v += part[uint64_t(s) * size + e];
  out[e] = from_float<T>(v);
"""
_SUM_KERNEL = Kernel(
    "ggml_qmv_mma_split_sum",
    inputs=["part", "dims"],
    outputs=["out"],
    body=_SUM_BODY,
    examples=[
        Example(
            {"part": mx.float32, "dims": (mx.int32, 3)}, {"out": mx.bfloat16}, {"T": mx.bfloat16}
        )
    ],
)


def switches(value: str) -> tuple[bool, bool]:
    """(ENABLED, ALL_TYPES) from an HF2Q_MMA value: "0" off, "all" every type, else the
    GPU-verified types (case and spaces ignored)."""
    mode = value.strip().lower()
    return mode != "0", mode == "all"


# Module switches, read from HF2Q_MMA at import. ENABLED (A/B runs, bench/qmatmul.py --mma):
# False (HF2Q_MMA=0) sends every call to the scalar kernels. ALL_TYPES (HF2Q_MMA=all): the
# dispatchers take every type with a decoder, not only the GPU-verified ones (to verify the
# others on a GPU). The dispatchers cache their plans per call shape keyed on ENABLED only: set
# ALL_TYPES before the first call, or clear qmatmul._CALLS and expert_glu._DENSE.
ENABLED, ALL_TYPES = switches(os.environ.get("HF2Q_MMA", "1"))


def load_flags(value: str) -> dict[str, int]:
    """The load variants an HF2Q_MMA_LOADS value asks for: letters "s" (streaming weight loads,
    S = 1) and "p" (each run's loads a run ahead, PF = 1); "" the default loads. Neither changes
    a bit of any output, so both can go on at every M (row parity holds)."""
    flags = value.strip().lower()
    if set(flags) - {"s", "p"}:
        raise InvalidArgumentError(f"HF2Q_MMA_LOADS={value!r}: expected letters of 'sp' or ''")
    return {k: 1 for k, letter in (("S", "s"), ("PF", "p")) if letter in flags}


def x_groups(raw: str | None = None) -> int:
    """XG: how many scale groups of a block load their x fragments together, before the first
    of their mmas (HF2Q_MMA_XG, 1..X_ALL, unset 1; ``raw`` in its place). The loop issued each
    group's loads just before its mmas, so a Q4_K block waited on 8 x loads in turn (16 with
    two n-tiles). Same math, same bits at every value; more registers (nvcc sm_90, the wide
    Q4_K gate/up: 166 at 1, 172 at 4, 248 at 16)."""
    raw = os.environ.get("HF2Q_MMA_XG", "") if raw is None else raw
    xg = int_setting("HF2Q_MMA_XG", raw, 1, X_ALL) or 1
    if xg & (xg - 1):  # the body steps through a block's 1, 8 or 16 groups XG at a time
        raise InvalidArgumentError(f"HF2Q_MMA_XG={raw!r}: expected 1, 2, 4, 8 or 16")
    return xg


# Read at import (A/B runs in worker processes: bench/mlx_env_ab.py --env HF2Q_MMA_LOADS=s):
# merged into every launch_config / glu_launch_config of the process, with HF2Q_MMA_XG (XG).
_XG_SET = bool(os.environ.get("HF2Q_MMA_XG", "").strip())
_XG = x_groups()
LOADS = {**load_flags(os.environ.get("HF2Q_MMA_LOADS", "")), **({"XG": _XG} if _XG > 1 else {})}
# XG of the dense mat-vec and GLU at one n-tile (M <= 8) where HF2Q_MMA_XG is unset. Session 49
# (H100, bench/mlx_env_ab.py --step graph, 5 interleaved rounds, every kernel at 16): Gemma-4-31B
# Q4_K decode 57.4 -> 75.6 tok/s (1.32x), 26B-A4B 251.4 -> 263.0 (1.05x); the GPU tests of
# every type's load variants pass. Not at NT 2 / 4 (nvcc sm_90, Q4_K: 170 / 254 registers
# against 134 / 133) nor in the grouped expert kernels (their tests ran, their speed alone
# did not).
DENSE_XG = 16
# HF2Q_MMA_MIN_BLOCKS (1..8; unset: none; read at import, checked at the first plan): launch
# bounds on the mat-vec's cubins asking nvcc for that many threadgroups an SM. At 31B's N =
# 5,376 shapes the grid is 336 threadgroups of 8 SIMD groups, two an SM at 86 registers (1.27
# waves); 3 gives 80 registers (32 bytes spilled, nvcc 13.0) and one wave. Same math, same bits
# (launch bounds only bound the registers); cubins only (graph and prefill), not MLX's builds.
# Stays unset: session 39 (H100, mlx_env_ab, 7 rounds) 26B-A4B's graph decode 0.98x [0.97-0.99]
# with 3 (31B 1.03x in session 37): no default that loses a shape.
MIN_BLOCKS_RAW = os.environ.get("HF2Q_MMA_MIN_BLOCKS", "")


# HF2Q_MMA_SPLIT_K (1..8; unset: auto; 1: off; read at import, checked at the first plan): the
# mat-vecs of few rows split each row's blocks over that many threadgroups (fp32 sums, then a
# small kernel adds them in split order). At 31B's N = 5,376 shapes the grid is 336
# threadgroups, two an SM at XG 16's 124 registers: 1.27 waves, the second a quarter full
# (nvcc 13.0, sm_90). The split is fixed by (N, K), so a row's bits are the same at every M
# (row parity), not those of the unsplit kernel.
SPLIT_K_RAW = os.environ.get("HF2Q_MMA_SPLIT_K", "")
# 16-row tiles from which no split applies: two waves of two 8-SIMD-group threadgroups an SM
# on a 132-SM H100 / H200
SPLIT_TILES = 528
SPLIT_MIN_BLOCKS = 4  # blocks a split sums at least
# Unset: 2 splits where K >= SPLIT_MIN_K and the unsplit grid runs more than one wave (over
# SPLIT_TILES / 2 tiles: its second wave part full). H100, session 51 (CUPTI, M = 1): 31B's
# 5,376 x 21,504 / 8,192 / 16,384 (336 tiles) at 2 splits 50.0 / 23.2 / 41.5 us against 53.1 /
# 24.7 / 42.3 unsplit; 26B-A4B's 2,816 x 4,096 and 8,192 x 2,816 lose at any split (12.4-21.6
# against 10.9 / 12.6). Whole graph decode: 31B 1.03x (2 splits; 3: 1.03x, lower median),
# 26B-A4B untouched. Grids of one wave or less (Qwen3.5-9B's down, 256 tiles) stay unsplit:
# unmeasured.
SPLIT_AUTO = 2
SPLIT_MIN_K = 8192


def split_k(N: int, K: int, qk: int, raw: str | None = None, auto: bool = True) -> int:
    """KS for an N x K weight of ``qk``-element blocks, where the grid has fewer than
    SPLIT_TILES tiles: HF2Q_MMA_SPLIT_K (``raw`` in its place) when set, else (``auto``)
    SPLIT_AUTO where K >= SPLIT_MIN_K and the grid has more than SPLIT_TILES / 2 tiles; cut so
    each split sums at least SPLIT_MIN_BLOCKS blocks. 1: no split."""
    tiles = -(-N // 16)
    ks = int_setting("HF2Q_MMA_SPLIT_K", SPLIT_K_RAW if raw is None else raw, 1, 8)
    if ks is None:
        ks = SPLIT_AUTO if auto and K >= SPLIT_MIN_K and tiles > SPLIT_TILES // 2 else 1
    if ks == 1 or tiles >= SPLIT_TILES:
        return 1
    return max(1, min(ks, (K // qk) // SPLIT_MIN_BLOCKS))


# HF2Q_MMA_PAIRS (unset or 0: off; read at import): 1, every mat-vec of an even N takes the
# paired-rows kernel (config R = 2, ``_PAIR_KERNELS``) at the dense GLU's U and W; 2, the
# mat-vecs of 17..32 rows (4 n-tiles) of an even N take it at their own U and W, the bits of
# the unpaired kernel (row parity kept): at 4 n-tiles each threadgroup reads all 32 rows of x
# for its 16 weight rows (35B-A3B's 32-row step: 33 us a mat-vec, 8.6 at one row, session 53),
# and a pair reads them once for 32. A/B switches until a GPU shows one faster.
PAIRS_RAW = os.environ.get("HF2Q_MMA_PAIRS", "")


def _pairs_mode(raw: str | None) -> int:
    return int_setting("HF2Q_MMA_PAIRS", PAIRS_RAW if raw is None else raw, 0, 2) or 0


def pairs(N: int, raw: str | None = None) -> bool:
    """Whether an N-row mat-vec takes paired rows at every M (the GLU's U and W):
    HF2Q_MMA_PAIRS (``raw`` in its place) 1 and N even."""
    return _pairs_mode(raw) == 1 and N % 2 == 0


def wide_pairs(N: int, raw: str | None = None) -> bool:
    """Whether an N-row mat-vec at 4 n-tiles takes paired rows at its own U and W:
    HF2Q_MMA_PAIRS (``raw`` in its place) 2 and N even."""
    return _pairs_mode(raw) == 2 and N % 2 == 0


# HF2Q_MMA_SPLIT_FUSED (unset or 0: off; 1: on; read at import): a split's sum added by the
# threadgroup of each tile that finishes last (config SF = 1, ``_FUSED_SPLIT_KERNELS``), not by
# a second launch: the same bits, 120 launches a 31B token fewer. CPU emulator only so far.
SPLIT_FUSED_RAW = os.environ.get("HF2Q_MMA_SPLIT_FUSED", "")


def split_fused(raw: str | None = None) -> bool:
    """HF2Q_MMA_SPLIT_FUSED (``raw`` in its place) on."""
    return int_setting("HF2Q_MMA_SPLIT_FUSED", SPLIT_FUSED_RAW if raw is None else raw, 0, 1) == 1


def min_blocks() -> int | None:
    """HF2Q_MMA_MIN_BLOCKS as an integer 1..8, None when unset; InvalidArgumentError else."""
    return int_setting("HF2Q_MMA_MIN_BLOCKS", MIN_BLOCKS_RAW, 1, 8)


def has_kernel(ggml_type: int, dtype: mx.Dtype) -> bool:
    """Whether a kernel exists for (type, x dtype) (M in 1..MAX_ROWS, CUDA): what the kernel
    functions called directly accept, verified on a GPU or not."""
    return dtype == mx.bfloat16 and ggml_type in _KERNELS


def supports(ggml_type: int, dtype: mx.Dtype, *, glu: bool = False) -> bool:
    """Whether the dispatchers may take this kernel for (type, x dtype): has_kernel, and the
    type in GPU_VERIFIED (``glu``: GLU_GPU_VERIFIED) unless ALL_TYPES. (ENABLED is the
    dispatchers' own check.)"""
    verified = GLU_GPU_VERIFIED if glu else GPU_VERIFIED
    return has_kernel(ggml_type, dtype) and (ALL_TYPES or ggml_type in verified)


def kernel_name(
    ggml_type: int,
    stream: bool = False,
    split: bool = False,
    paired: bool = False,
    fused: bool = False,
    columns: bool = False,
) -> str:
    """The registered name of a type's kernel (benchmarks match profiler events on it);
    ``stream``: its streaming-load variant's (config S = 1); ``split``: the split over K's
    first launch (config KS > 1; ``_SUM_KERNEL`` the second); ``paired``: the paired-rows
    kernel's (config R = 2); ``fused``: the split with its sum fused (KS > 1, SF = 1);
    ``columns``: the column split's (CS > 1)."""
    if columns:
        return _COLUMN_KERNELS[ggml_type, stream].name
    if fused:
        return _FUSED_SPLIT_KERNELS[ggml_type].name
    if paired:
        return _PAIR_KERNELS[ggml_type, split].name
    if split:
        return _SPLIT_KERNELS[ggml_type, stream].name
    return (_STREAM_KERNELS if stream else _KERNELS)[ggml_type].name


def launch_names(ggml_type: int, cfg: dict[str, int]) -> str | tuple[str, str]:
    """The kernel name of ``cfg``'s launch (benchmarks match profiler events on it), or the
    split's two (its kernel, then ``_SUM_KERNEL``)."""
    split, fused = cfg.get("KS", 1) > 1, bool(cfg.get("SF"))
    paired, columns = cfg.get("R", 1) == 2, cfg.get("CS", 1) > 1
    name = kernel_name(ggml_type, bool(cfg.get("S")), split, paired, fused and split, columns)
    return (name, _SUM_KERNEL.name) if split and not fused else name


def n_tiles(M: int) -> int:
    """NT for M rows of x (M <= 32): 1, 2 or 4 n-tiles of 8 columns. (3 would do for 17..24
    rows; one fewer compiled variant, and a column's math is the same at any NT.)"""
    return 1 if M <= 8 else 2 if M <= 16 else 4


def launch_config(ggml_type: int, M: int, N: int, K: int) -> dict[str, int]:
    """NT (n-tiles of 8 columns), U (blocks per run), W (SIMD groups per 16 rows).

    Only NT depends on M: U and W fix which SIMD group sums which blocks, and so the order of
    a column's additions, from (type, K) alone (row parity). W never exceeds the runs a row has.
    KS (HF2Q_MMA_SPLIT_K, from N and K alone): splits over K; W then cut to a split's runs.
    R = 2 (HF2Q_MMA_PAIRS=1, N even): paired rows at the dense GLU's U and W for F = N / 2 (the
    same kernel loop without the activation), split over K only where HF2Q_MMA_SPLIT_K is set;
    the bits of the unpaired kernel at that U and W. HF2Q_MMA_PAIRS=2: R = 2 at 4 n-tiles only,
    with the unpaired U, W and KS (its bits).
    """
    qk = BLOCK_FORMATS[ggml_type].block_size
    if pairs(N):
        cfg = {**glu_launch_config(ggml_type, M, N // 2, K), "R": 2}
        return with_split(cfg, ggml_type, K, split_k(N // 2, K, qk, auto=False))
    cfg = _config(_DEFAULTS, ggml_type, M, K)
    if cfg["NT"] == 4 and not cfg.get("S") and wide_pairs(N):
        cfg["R"] = 2  # the same U, W and split: the unpaired bits
    cfg = with_split(cfg, ggml_type, K, split_k(N, K, qk))
    return with_columns(cfg, column_tiles(qk))


def with_columns(cfg: dict[str, int], tiles: int) -> dict[str, int]:
    """``cfg`` with its NT n-tiles split over CS = NT / ``tiles`` threadgroups a 16-row tile
    (none where that is 1, and none on a split over K or paired rows); a threadgroup of one
    n-tile loads its x as the dense one-tile config does (DENSE_XG, unless HF2Q_MMA_XG is set).
    U and W stay: the unsplit bits."""
    out = {k: v for k, v in cfg.items() if k != "CS"}
    cs = out["NT"] // min(out["NT"], tiles)
    if cs == 1 or out.get("KS", 1) > 1 or out.get("R", 1) == 2:
        return out
    out["CS"] = cs
    if out["NT"] // cs == 1 and not _XG_SET:
        out["XG"] = DENSE_XG
    return out


# HF2Q_MMA_COLUMN_TILES (1, 2 or 4, every type; unset: COLUMN_TILES by block size; read at
# import): the n-tiles of 8 columns of x one threadgroup of the mat-vec and dense GLU takes at
# most; more split over threadgroups (config CS, ``_COLUMN_KERNELS``): the unsplit bits at
# every M. Session 55 (H100, decode_profile --step compiled --batch 32 --by-launch, one run
# each, not interleaved): the 32-row step at 4 (no split) / 1 / 2 n-tiles, 35B-A3B 14.08 /
# 12.00 / 11.84 ms a token, 26B-A4B 15.38 / 14.72 / 14.07; the Q4_K mat-vecs 4,132 -> 2,440 us
# a 35B-A3B token at 2 (its lm_head 730 -> 475), but 26B-A4B's Q5_0 down 521 -> 754 (17.4 ->
# 25.1 us a call; 898 at 1). So 2 for 256-element blocks, no split for 32-element ones (Q5_0
# measured, the others unmeasured: kept as they were). 16 rows and fewer: unchanged.
COLUMN_TILES_RAW = os.environ.get("HF2Q_MMA_COLUMN_TILES", "")
COLUMN_TILES = {256: 2, 32: 4}


def column_split(cfg: dict[str, int]) -> tuple[int, int]:
    """(a threadgroup's n-tiles NT / CS: the template's NT, CS) of ``cfg``; ValueError where CS
    does not divide NT."""
    cs = cfg.get("CS", 1)
    if cfg["NT"] % cs:
        raise ValueError(f"config {cfg}: a column split takes NT / CS n-tiles")
    return cfg["NT"] // cs, cs


def column_tiles(qk: int, raw: str | None = None) -> int:
    """HF2Q_MMA_COLUMN_TILES (``raw`` in its place) as 1, 2 or 4; unset COLUMN_TILES[qk]."""
    raw = COLUMN_TILES_RAW if raw is None else raw
    tiles = int_setting("HF2Q_MMA_COLUMN_TILES", raw, 1, 4) or COLUMN_TILES[qk]
    if tiles == 3:
        raise InvalidArgumentError(f"HF2Q_MMA_COLUMN_TILES={raw!r}: expected 1, 2 or 4")
    return tiles


def with_split(cfg: dict[str, int], ggml_type: int, K: int, ks: int) -> dict[str, int]:
    """``cfg`` split over K in ``ks`` (KS; none at 1), W cut to the runs of U blocks the
    smallest split has (no idle SIMD group); with HF2Q_MMA_SPLIT_FUSED its sum fused (SF = 1)
    where the loads are plain and the rows unpaired."""
    out = {k: v for k, v in cfg.items() if k not in ("KS", "SF")}
    if ks > 1:
        blocks = K // BLOCK_FORMATS[ggml_type].block_size // ks
        out.update(KS=ks, W=max(1, min(out["W"], -(-blocks // out["U"]))))
        if split_fused() and _fusable(out):
            out["SF"] = 1
    return out


def _fusable(cfg: dict[str, int]) -> bool:
    """Whether a split config's sum can be fused (``_FUSED_SPLIT_KERNELS``): plain loads,
    unpaired rows."""
    return cfg.get("R", 1) == 1 and not cfg.get("S")


def _config(
    table: dict[int, tuple[int, int]], ggml_type: int, M: int, K: int, dense: bool = True
) -> dict[str, int]:
    """NT from M; U and W max from ``table`` by block size, W cut to the runs a row has; the
    load variants (``LOADS``), and ``dense`` at one n-tile DENSE_XG unless HF2Q_MMA_XG is set."""
    qk = BLOCK_FORMATS[ggml_type].block_size
    u, w_max = table[qk]
    runs = -(-(K // qk) // u)
    cfg = {"NT": n_tiles(M), "U": u, "W": max(1, min(w_max, runs)), **LOADS}
    if dense and not _XG_SET and "XG" not in cfg and cfg["NT"] == 1:
        cfg["XG"] = DENSE_XG
    return cfg


GLU_MAX_ROWS = 32  # rows of x one GLU launch takes (NT up to 4 n-tiles)
# (U, W max) of the GLU kernel (two row sets) per block size. H200 (2026-12-02, CUPTI, Q4_K,
# bench/qmatmul.py --glu --mma-configs): F 2816 x K 2816 (176 threadgroups) U 2 W 6 15.1 us
# at M = 1 against U 1 W 8 17.5; F 12288 x K 4096 (768 threadgroups) U 1 W 4 42.5 against
# U 1 W 8 52.0 and U 2 W 8 48.2: a big grid wants fewer SIMD groups per threadgroup. 32-blocks
# are unmeasured.
_GLU_DEFAULTS = {256: (2, 8), 32: (4, 8)}
_GLU_BIG_GRID = {256: (1, 4), 32: (4, 8)}
GLU_BIG_GRID = 512  # threadgroups (16 gate + 16 up rows each) from which _GLU_BIG_GRID applies


def glu_launch_config(ggml_type: int, M: int, F: int, K: int) -> dict[str, int]:
    """NT, U, W of the GLU kernel (expert_glu.dense_glu) for M <= GLU_MAX_ROWS rows: as
    ``launch_config``, U and W from (type, F, K) alone (row parity); NT 1, 2 or 4 n-tiles,
    split over CS threadgroups as HF2Q_MMA_COLUMN_TILES asks (``with_columns``)."""
    table = _GLU_BIG_GRID if -(-F // 16) >= GLU_BIG_GRID else _GLU_DEFAULTS
    qk = BLOCK_FORMATS[ggml_type].block_size
    return with_columns(_config(table, ggml_type, M, K), column_tiles(qk))


class _Plan(LaunchPlan):
    """The tensor-core mat-vec launch for one (type, M, N, K, config): 16 rows per threadgroup
    (R = 2: 16 of each half of the rows; ``split``: one of KS splits of their blocks, fp32 sums
    (KS, M, N) out)."""

    __slots__ = ()

    def __init__(
        self, ggml_type: int, M: int, N: int, K: int, cfg: dict[str, int], split: bool = False
    ):
        if not 1 <= M <= 8 * cfg["NT"] or not 1 <= cfg["W"] <= MAX_SIMD:
            raise ValueError(f"config {cfg} cannot run {M} rows of x")
        ks = cfg.get("KS", 1) if split else 1
        stream = bool(cfg.get("S"))
        paired = cfg.get("R", 1) == 2
        cs = cfg.get("CS", 1)
        if paired and (N % 2 or stream):
            raise ValueError(f"config {cfg}: paired rows need an even N ({N}), plain loads")
        if cs > 1 and (paired or ks > 1):
            raise ValueError(f"config {cfg}: a column split takes unpaired rows, no split over K")
        if paired:
            kernel = _PAIR_KERNELS[ggml_type, split]
        elif cs > 1:
            kernel = _COLUMN_KERNELS[ggml_type, stream]
        else:
            kernel = _SPLIT_KERNELS[ggml_type, stream] if split else (
                _STREAM_KERNELS if stream else _KERNELS)[ggml_type]  # fmt: skip
        rows = N // 2 if paired else N  # rows a threadgroup's row set spans
        super().__init__(
            kernel,
            [M, rows, K],
            grid=(-(-rows // 16) * ks * cs * 32 * cfg["W"],),
            threadgroup=(32 * cfg["W"],),
            output_shapes=[(ks, M, N) if split else (M, N)],
            output_dtypes=[mx.float32 if split else mx.bfloat16],
            template=_launch_template(cfg, ks if split else None),
        )


class _SplitPlan:
    """The split mat-vec (config KS > 1) as LaunchPlan's interface: the splits' launch, then
    the launch that adds their sums into the (M, N) output (``output_shapes``: that one's)."""

    __slots__ = ("part", "sum")

    def __init__(self, ggml_type: int, M: int, N: int, K: int, cfg: dict[str, int]):
        self.part = _Plan(ggml_type, M, N, K, cfg, split=True)
        self.sum = LaunchPlan(
            _SUM_KERNEL,
            [M, N, cfg["KS"]],
            grid=(M * N,),
            threadgroup=(256,),
            output_shapes=[(M, N)],
            output_dtypes=[mx.bfloat16],
            template={"T": mx.bfloat16},
        )

    @property
    def output_shapes(self) -> list[tuple[int, ...]]:
        return self.sum.output_shapes

    @output_shapes.setter
    def output_shapes(self, shapes: list[tuple[int, ...]]) -> None:
        self.sum.output_shapes = shapes

    def call(self, x: mx.array, w: mx.array, init_value: float | None = None) -> mx.array:
        part = self.part.call(x, w, init_value=init_value)
        return self.sum.call(part, init_value=init_value)

    def resolve(self, *dtypes: mx.Dtype) -> _SplitPlan:
        self.part.resolve(*dtypes)
        self.sum.resolve(mx.float32)
        return self

    def run(self, x: mx.array, w: mx.array) -> mx.array:
        return self.sum.run(self.part.run(x, w))


class _FusedSplitPlan:
    """The split with its sum fused (config KS > 1, SF = 1) as LaunchPlan's interface: one
    launch, its tiles' counters in ``CountedPlan``'s rotating sets (two calls of the plan that
    MLX may run at once count on other sets; a recorded graph's one set)."""

    __slots__ = ("plan", "counted")

    def __init__(self, ggml_type: int, M: int, N: int, K: int, cfg: dict[str, int]):
        if not _fusable(cfg):
            raise ValueError(f"config {cfg}: the fused split sum takes plain loads, unpaired rows")
        ks, tiles, w = cfg["KS"], -(-N // 16), cfg["W"]
        self.plan = LaunchPlan(
            _FUSED_SPLIT_KERNELS[ggml_type],
            [M, N, K],
            grid=(tiles * ks * 32 * w,),
            threadgroup=(32 * w,),
            output_shapes=[(M, N), (ks, M, N)],
            output_dtypes=[mx.bfloat16, mx.float32],
            template=_launch_template(cfg, ks),
        )
        self.counted = CountedPlan(None, (), tiles, ks)

    @property
    def output_shapes(self) -> list[tuple[int, ...]]:
        return self.plan.output_shapes[:1]

    @output_shapes.setter
    def output_shapes(self, shapes: list[tuple[int, ...]]) -> None:
        self.plan.output_shapes = [shapes[0], self.plan.output_shapes[1]]

    def call(self, x: mx.array, w: mx.array, init_value: float | None = None) -> mx.array:
        return self.plan.call(x, w, *self.counted.inputs(), init_value=init_value)

    def resolve(self, *dtypes: mx.Dtype) -> _FusedSplitPlan:
        self.plan.resolve(*dtypes, mx.uint32, mx.int32)
        return self

    def run(self, x: mx.array, w: mx.array) -> mx.array:
        return self.plan.run(x, w, *self.counted.inputs())


MatvecPlan = _Plan | _SplitPlan | _FusedSplitPlan


def make_plan(ggml_type: int, M: int, N: int, K: int, cfg: dict[str, int]) -> MatvecPlan:
    """The launch plan of ``cfg``: one launch, the split's two (KS > 1), or the split with its
    sum fused (KS > 1, SF = 1: one)."""
    if cfg.get("KS", 1) > 1:
        fused = cfg.get("SF")
        return (_FusedSplitPlan if fused else _SplitPlan)(ggml_type, M, N, K, cfg)
    return _Plan(ggml_type, M, N, K, cfg)


def _launch_template(cfg: dict[str, int], ks: int | None) -> dict:
    """A mat-vec launch's template from ``cfg`` (KS = ``ks`` for a split's kernel, None
    otherwise), with HF2Q_MMA_MIN_BLOCKS's launch bounds for its W SIMD groups, if set."""
    nt, cs = column_split(cfg)
    template = {"T": mx.bfloat16, "NT": nt, "U": cfg["U"], "PF": cfg.get("PF", 0),
                "XG": cfg.get("XG", 1), **({"KS": ks} if ks is not None else {}),
                **({"CS": cs} if cs > 1 else {})}  # fmt: skip
    return {**template, **launch_bounds(32 * cfg["W"], min_blocks())}


_PLANS: dict[tuple, MatvecPlan] = {}


def _plan(ggml_type: int, M: int, N: int, K: int, config: dict | None) -> MatvecPlan:
    key = (ggml_type, M, N, K, None if config is None else tuple(sorted(config.items())))
    plan = _PLANS.get(key)
    if plan is None:
        cfg = config or launch_config(ggml_type, M, N, K)
        plan = _PLANS[key] = make_plan(ggml_type, M, N, K, cfg)
    return plan


def mma_matmul_kernel(
    x: mx.array,
    w_raw: mx.array,
    ggml_type: int,
    in_features: int,
    *,
    config: dict[str, int] | None = None,
    init_value: float | None = None,
) -> mx.array:
    """The GPU kernel alone: bf16 x (M, K) with 1 <= M <= 32, w_raw (N, row_bytes) -> (M, N).

    ``config`` overrides ``launch_config`` (benchmarks; S = 1 takes the streaming-load
    variant); ``init_value`` pre-fills the output.
    """
    M, K = x.shape
    if not has_kernel(ggml_type, x.dtype) or K != in_features:
        raise ValueError(f"no mma kernel for {T(ggml_type).name} with {x.dtype} x of {x.shape}")
    p = _plan(ggml_type, M, w_raw.shape[0], K, config)
    return p.call(x, w_raw, init_value=init_value)


def dispatch_plan(ggml_type: int, M: int, N: int, K: int) -> MatvecPlan:
    """A fresh plan at ``launch_config`` for qmatmul.ggml_matmul's call cache (1..32 rows of x
    in all), which sets its output shape (x's batch dims) and resolves it."""
    return make_plan(ggml_type, M, N, K, launch_config(ggml_type, M, N, K))
