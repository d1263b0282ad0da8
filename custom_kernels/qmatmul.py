"""Matmul against GGML-quantized weights kept in their block layout: x @ W.T."""

from __future__ import annotations

import math

import mlx.core as mx
from gguf import GGMLQuantizationType as T

from hf2q_mlx.errors import WeightMismatchError

from . import backend
from ._render import Example, Kernel
from .dequant import GGML_BLOCK_INFO, dequantize_reference, row_bytes


def ggml_matmul_reference(
    x: mx.array, w_raw: mx.array, ggml_type: int, in_features: int
) -> mx.array:
    """x (..., K) float, w_raw (N, row_bytes) uint8 GGML blocks -> (..., N) in x.dtype.

    Dequantizes the whole weight to fp32 and multiplies in fp32: the oracle for the kernels.
    """
    w = dequantize_reference(w_raw, ggml_type, in_features)  # (N, K) fp32
    return (x.astype(mx.float32) @ w.T).astype(x.dtype)


# --------------------------------------------------------------------------------------------
# Kernel. Every type shares two loops: _BODY (fp32 decode and math, any x dtype) and _BODY_H2
# (packed fp16: the `h2` kernels on fp16 x, variant V = 1, and the `h2bf` kernels on bf16 x,
# V = 2, which converts x to fp16 in the loop). A type supplies how a lane loads its
# bytes of a block (load_*), decodes them into exact small integers with a scale and a bias per
# group of GS weights (dq_*, templated on the output: floats carrying 2^p, or fp16 pairs), where
# each group's x values sit (xoff_*) and at which bit position each of its fields was read
# (p0_*). No repacking: the bytes are read where GGUF put them, with 2- or 4-byte loads as each
# format's alignment allows.

_COMMON = r"""
// The float trick: a 16-bit half of a word under 0x4B000000 (the bits of 2^23), masked down to
// one field at bit p (p + width <= 16), reads as 2^23 + 2^p * field; one subtraction leaves
// 2^p * (field - zero) exactly. x is pre-scaled by 2^-p instead (exact), so decoding costs one
// LOP3 and one FADD per weight, with no int->float conversion and no constant registers.
FN uint mlo(uint v) { return (v & 0xFFFFu) | 0x4B000000u; }
FN uint mhi(uint v) { return (v >> 16) | 0x4B000000u; }
FN float fld(uint m, int p, uint wmask, float zero) {
  return bitcast<float>(m & (0xFF000000u | (wmask << p))) - (8388608.0f + zero * float(1u << p));
}
// Fields at bits p0 and p0 + 8 of each half of v: out = 2^{p0, p0+8, p0, p0+8} * (field - zero).
FN void quad(uint v, int p0, uint wmask, float zero, THREAD_PTR(float) out) {
  const uint lo = mlo(v), hi = mhi(v);
  out[0] = fld(lo, p0, wmask, zero);
  out[1] = fld(lo, p0 + 8, wmask, zero);
  out[2] = fld(hi, p0, wmask, zero);
  out[3] = fld(hi, p0 + 8, wmask, zero);
}
FN uint ld16(DEVICE_PTR(const uchar) p, uint i) { return uint(DEVICE_CAST(const ushort, p)[i]); }
FN uint ld32(DEVICE_PTR(const uchar) p, uint i) { return DEVICE_CAST(const uint, p)[i]; }
// 4 bytes at a 2-byte aligned offset (2*i): formats whose blocks are only 2-byte aligned.
FN uint ld32u(DEVICE_PTR(const uchar) p, uint i) { return ld16(p, i) | (ld16(p, i + 1) << 16); }
FN float f16lo(uint v) { return f16_bits_to_float(ushort(v & 0xFFFFu)); }
FN float f16hi(uint v) { return f16_bits_to_float(ushort(v >> 16)); }
FN void load_x4(DEVICE_PTR(const float) p, THREAD_PTR(float) v) {
  const float4 a = DEVICE_CAST(const float4, p)[0];
  v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
}
FN void load_x4(DEVICE_PTR(const half_t) p, THREAD_PTR(float) v) {
  const uint2 a = DEVICE_CAST(const uint2, p)[0];
  v[0] = f16lo(a.x); v[1] = f16hi(a.x); v[2] = f16lo(a.y); v[3] = f16hi(a.y);
}
FN void load_x4(DEVICE_PTR(const bfloat_t) p, THREAD_PTR(float) v) {
  const uint2 a = DEVICE_CAST(const uint2, p)[0];
  v[0] = bf16_bits_to_float(ushort(a.x & 0xFFFFu)); v[1] = bf16_bits_to_float(ushort(a.x >> 16));
  v[2] = bf16_bits_to_float(ushort(a.y & 0xFFFFu)); v[3] = bf16_bits_to_float(ushort(a.y >> 16));
}
// Packed fp16 pairs (the `h2` kernels, fp16 x): a uint holds two fp16 values, low half first.
// h2_fma is one HFMA2 on CUDA and a half2 fma on Metal; elsewhere (the CPU emulator, syntax
// checks) it is computed in fp32 and rounded once to fp16 (the product of two fp16 is exact in
// fp32, so only rare double roundings differ from a fused fp16 fma).
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
FN uint h2_fma(uint a, uint b, uint c) {
  return bitcast<uint>(__hfma2(bitcast<__half2>(a), bitcast<__half2>(b), bitcast<__half2>(c)));
}
#elif defined(__METAL_VERSION__)
FN uint h2_fma(uint a, uint b, uint c) {
  return as_type<uint>(fma(as_type<half2>(a), as_type<half2>(b), as_type<half2>(c)));
}
#else
FN uint h1_fma(uint a, uint b, uint c) {
  const float f = fma_f(f16_bits_to_float(ushort(a & 0xFFFFu)),
                        f16_bits_to_float(ushort(b & 0xFFFFu)),
                        f16_bits_to_float(ushort(c & 0xFFFFu)));
  return uint(bitcast<ushort>(from_float<half_t>(f)));
}
FN uint h2_fma(uint a, uint b, uint c) {
  return h1_fma(a, b, c) | (h1_fma(a >> 16, b >> 16, c >> 16) << 16);
}
#endif
// fp16 bits of f, f an integer or a power of two inside fp16's normal range (constants only).
FN uint f16_bits(float f) {
  const uint u = bitcast<uint>(f);
  return ((u >> 16) & 0x8000u) | ((((u >> 23) & 0xFFu) - 112u) << 10) | ((u >> 13) & 0x3FFu);
}
FN uint h2_splat(float f) { return f16_bits(f) * 0x00010001u; }
// Bytes of (y, x) picked by the nibbles of s: result byte n = byte (s >> 4n) & 7 of the pair,
// x holding bytes 0-3 and y 4-7 (CUDA's __byte_perm, one PRMT; spelled out elsewhere).
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
FN uint byte_perm(uint x, uint y, uint s) { return __byte_perm(x, y, s); }
#else
FN uint byte_perm(uint x, uint y, uint s) {
  uint r = 0u;
  UNROLL for (int n = 0; n < 4; ++n) {
    const uint sel = (s >> (4 * n)) & 7u;
    r |= (((sel < 4u ? x : y) >> (8u * (sel & 3u))) & 0xFFu) << (8 * n);
  }
  return r;
}
#endif
// The fp16 twin of the float trick: a field of at most 8 - p bits at bit p of a byte, moved
// into the low byte of a 16-bit half under 0x64 (the high byte of 1024 in fp16), reads as
// 1024 + 2^p * field; one fma by (2^-p, -(1024 2^-p + zero)) leaves field - zero, exact.
// out[0] pairs bytes (0, 2) of v, out[1] bytes (1, 3): one mask for the word, one byte
// permutation per pair (the magic is a register operand, hoisted out of the loop).
FN void quad(uint v, int p0, uint wmask, float zero, THREAD_PTR(uint) out) {
  const uint vm = v & ((wmask << p0) * 0x01010101u);
  const uint s = h2_splat(1.0f / float(1u << p0));
  const uint c = h2_splat(-(1024.0f / float(1u << p0) + zero));
  out[0] = h2_fma(byte_perm(vm, 0x64006400u, 0x7250u), s, c);
  out[1] = h2_fma(byte_perm(vm, 0x64006400u, 0x7351u), s, c);
}
FN int qstride(THREAD_PTR(float) w) { return 4; }  // a quad fills 4 floats or 2 fp16 pairs
FN int qstride(THREAD_PTR(uint) w) { return 2; }
// 4 consecutive fp16 x as the pairs quad() makes: out[0] = (x0, x2), out[1] = (x1, x3).
FN void load_xh(DEVICE_PTR(const half_t) p, THREAD_PTR(uint) out) {
  const uint2 a = DEVICE_CAST(const uint2, p)[0];
  out[0] = (a.x & 0xFFFFu) | (a.y << 16);
  out[1] = (a.x >> 16) | (a.y & 0xFFFF0000u);
}
// Two floats rounded to fp16 (nearest even) as a pair, lo in the low half: one F2FP on sm_90.
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
FN uint h2_pack(float lo, float hi) { return bitcast<uint>(__floats2half2_rn(lo, hi)); }
#elif defined(__METAL_VERSION__)
FN uint h2_pack(float lo, float hi) {
  half2 h; h.x = half(lo); h.y = half(hi); return as_type<uint>(h);
}
#else
FN uint h2_pack(float lo, float hi) {
  return uint(bitcast<ushort>(from_float<half_t>(lo)))
       | (uint(bitcast<ushort>(from_float<half_t>(hi))) << 16);
}
#endif
// bf16 x for the packed fp16 loop (V = 2): a group's n values (fp32, exact bf16) scaled by a
// power of two that puts the largest |x| in [2^5, 2^6), rounded to the pairs load_xh makes;
// returns the inverse power (to scale the group's sum back, exact). Exact for every value
// within 2^-19 of the group's largest (bf16's 8 significant bits fit fp16's 11); smaller ones
// round as fp16 subnormals: an error below 2^-30 of the largest |x| each. 2^6 keeps every fp16
// group sum finite: at most GS / 2 products of |field - zero| <= 128 (Q8_0) per half, 2^15.
// A NaN may be skipped by the max but still reaches the sum; an inf scales to inf.
FN float x_h2(THREAD_PTR(float) xf, int n, THREAD_PTR(uint) out) {
  float mx = abs_f(xf[0]);
  UNROLL for (int i = 1; i < n; ++i) mx = max_f(mx, abs_f(xf[i]));
  const uint e = bitcast<uint>(mx) >> 23;  // biased exponent of the max, 0 (zero) .. 255
  const uint se = e < 6u ? 253u : 259u - e;  // scale 2^(132 - e), capped at 2^126 (normal)
  const float s = bitcast<float>(se << 23);
  UNROLL for (int q = 0; q < n / 4; ++q) {
    out[2 * q] = h2_pack(xf[4 * q] * s, xf[4 * q + 2] * s);
    out[2 * q + 1] = h2_pack(xf[4 * q + 1] * s, xf[4 * q + 3] * s);
  }
  return bitcast<float>((254u - se) << 23);
}
// bit i of v (i < 4) -> bit 8i+4: the fifth bit of four packed nibbles (shifted copies of v
// do not overlap, so the multiply is an OR).
FN uint spread4(uint v) { return (v * 0x02040810u) & 0x10101010u; }
"""


_Q4_0 = r"""
// Lane t owns qs bytes 4t..4t+3: weights 4t+i (low nibbles, read at bits 0/8) and 16+4t+i
// (high nibbles, read at bits 4/12).
struct RawQ4_0 { uint d; uint q; };
FN RawQ4_0 load_q4_0(DEVICE_PTR(const uchar) p, uint t) {
  RawQ4_0 r; r.d = ld16(p, 0); r.q = ld32u(p, 1 + 2 * t); return r;
}
FN uint xoff_q4_0(uint t, int g, int p) { return uint(16 * p) + 4 * t; }
FN int p0_q4_0(int g, int p) { return 4 * p; }
template <typename W>
FN void dq_q4_0(RawQ4_0 r, uint t, int g, THREAD_PTR(W) w, THREAD_PTR(float) sc,
          THREAD_PTR(float) bi) {
  quad(r.q, 0, 0xFu, 8.0f, w); quad(r.q, 4, 0xFu, 8.0f, w + qstride(w));
  sc[0] = f16lo(r.d); bi[0] = 0.0f;
}
"""

_Q4_1 = r"""
struct RawQ4_1 { uint dm; uint q; };
FN RawQ4_1 load_q4_1(DEVICE_PTR(const uchar) p, uint t) {
  RawQ4_1 r; r.dm = ld32(p, 0); r.q = ld32(p, 1 + t); return r;
}
FN uint xoff_q4_1(uint t, int g, int p) { return uint(16 * p) + 4 * t; }
FN int p0_q4_1(int g, int p) { return 4 * p; }
template <typename W>
FN void dq_q4_1(RawQ4_1 r, uint t, int g, THREAD_PTR(W) w, THREAD_PTR(float) sc,
          THREAD_PTR(float) bi) {
  quad(r.q, 0, 0xFu, 0.0f, w); quad(r.q, 4, 0xFu, 0.0f, w + qstride(w));
  sc[0] = f16lo(r.dm); bi[0] = f16hi(r.dm);
}
"""

_Q5_0 = r"""
// As Q4_0; bit j of qh is the fifth bit of weight j (moved next to its nibble: 5-bit bytes).
struct RawQ5_0 { uint d; uint qh; uint q; };
FN RawQ5_0 load_q5_0(DEVICE_PTR(const uchar) p, uint t) {
  RawQ5_0 r; r.d = ld16(p, 0); r.qh = ld32u(p, 1); r.q = ld32u(p, 3 + 2 * t); return r;
}
FN uint xoff_q5_0(uint t, int g, int p) { return uint(16 * p) + 4 * t; }
FN int p0_q5_0(int g, int p) { return 0; }
template <typename W>
FN void dq_q5_0(RawQ5_0 r, uint t, int g, THREAD_PTR(W) w, THREAD_PTR(float) sc,
          THREAD_PTR(float) bi) {
  const uint lo = (r.q & 0x0F0F0F0Fu) | spread4((r.qh >> (4 * t)) & 0xFu);
  const uint hi = ((r.q >> 4) & 0x0F0F0F0Fu) | spread4((r.qh >> (16 + 4 * t)) & 0xFu);
  quad(lo, 0, 0x1Fu, 16.0f, w); quad(hi, 0, 0x1Fu, 16.0f, w + qstride(w));
  sc[0] = f16lo(r.d); bi[0] = 0.0f;
}
"""

_Q5_1 = r"""
struct RawQ5_1 { uint dm; uint qh; uint q; };
FN RawQ5_1 load_q5_1(DEVICE_PTR(const uchar) p, uint t) {
  RawQ5_1 r; r.dm = ld32(p, 0); r.qh = ld32(p, 1); r.q = ld32(p, 2 + t); return r;
}
FN uint xoff_q5_1(uint t, int g, int p) { return uint(16 * p) + 4 * t; }
FN int p0_q5_1(int g, int p) { return 0; }
template <typename W>
FN void dq_q5_1(RawQ5_1 r, uint t, int g, THREAD_PTR(W) w, THREAD_PTR(float) sc,
          THREAD_PTR(float) bi) {
  const uint lo = (r.q & 0x0F0F0F0Fu) | spread4((r.qh >> (4 * t)) & 0xFu);
  const uint hi = ((r.q >> 4) & 0x0F0F0F0Fu) | spread4((r.qh >> (16 + 4 * t)) & 0xFu);
  quad(lo, 0, 0x1Fu, 0.0f, w); quad(hi, 0, 0x1Fu, 0.0f, w + qstride(w));
  sc[0] = f16lo(r.dm); bi[0] = f16hi(r.dm);
}
"""

_Q8_0 = r"""
// Lane t owns weights 8t..8t+7; signed bytes are biased by 128 (xor 0x80) for the float trick.
struct RawQ8_0 { uint d; uint a; uint b; };
FN RawQ8_0 load_q8_0(DEVICE_PTR(const uchar) p, uint t) {
  RawQ8_0 r; r.d = ld16(p, 0); r.a = ld32u(p, 1 + 4 * t); r.b = ld32u(p, 3 + 4 * t); return r;
}
FN uint xoff_q8_0(uint t, int g, int p) { return 8 * t + uint(4 * p); }
FN int p0_q8_0(int g, int p) { return 0; }
template <typename W>
FN void dq_q8_0(RawQ8_0 r, uint t, int g, THREAD_PTR(W) w, THREAD_PTR(float) sc,
          THREAD_PTR(float) bi) {
  quad(r.a ^ 0x80808080u, 0, 0xFFu, 128.0f, w);
  quad(r.b ^ 0x80808080u, 0, 0xFFu, 128.0f, w + qstride(w));
  sc[0] = f16lo(r.d); bi[0] = 0.0f;
}
"""

_Q2_K = r"""
// Lane t: half n = t/8, bytes l0..l0+3 (l0 = 4(t%8)) of that half's qs; group j holds weights
// 128n + 32j + l0 + i (2-bit fields at bit 2j), sub-block 8n + 2j + h (h = (t%8)/4), whose
// scale byte (low nibble: scale, high: min) is byte 2j + h of the half's 8 scale bytes.
struct RawQ2_K { uint q; uint s0; uint s1; uint dd; };
FN RawQ2_K load_q2_k(DEVICE_PTR(const uchar) p, uint t) {
  const uint n = t >> 3;
  RawQ2_K r; r.q = ld32(p, 4 + t); r.s0 = ld32(p, 2 * n); r.s1 = ld32(p, 2 * n + 1);
  r.dd = ld32(p, 20); return r;
}
FN uint xoff_q2_k(uint t, int g, int p) { return 128 * (t >> 3) + uint(32 * g) + 4 * (t & 7); }
FN int p0_q2_k(int g, int p) { return 2 * g; }
template <typename W>
FN void dq_q2_k(RawQ2_K r, uint t, int g, THREAD_PTR(W) w, THREAD_PTR(float) sc,
          THREAD_PTR(float) bi) {
  quad(r.q, 2 * g, 0x3u, 0.0f, w);
  const uint m = (g & 1) ? mhi((g < 2 ? r.s0 : r.s1) >> (8 * ((t & 7) >> 2)))
                         : mlo((g < 2 ? r.s0 : r.s1) >> (8 * ((t & 7) >> 2)));
  sc[0] = f16lo(r.dd) * fld(m, 0, 0xFu, 0.0f);
  bi[0] = -(f16hi(r.dd) * 0.0625f) * fld(m, 4, 0xFu, 0.0f);
}
"""

_Q3_K = r"""
// Lanes as Q2_K; the high bit of weight 128n + 32j + l is bit 4n + j of hmask[l]; 6-bit scales
// (minus 32) are split into low nibbles (bytes 0-7) and 2-bit pairs (bytes 8-11). The lane's
// four scales are gathered into one word, bytes [j0, j2, j1, j3], and decoded as a quad.
struct RawQ3_K { uint hm; uint q; uint a0; uint a1; uint a2; uint d; };
FN RawQ3_K load_q3_k(DEVICE_PTR(const uchar) p, uint t) {
  const uint n = t >> 3, c = t & 7;
  RawQ3_K r; r.hm = ld32u(p, 2 * c); r.q = ld32u(p, 16 + 16 * n + 2 * c);
  r.a0 = ld32u(p, 48); r.a1 = ld32u(p, 50); r.a2 = ld32u(p, 52); r.d = ld16(p, 54); return r;
}
FN uint xoff_q3_k(uint t, int g, int p) { return 128 * (t >> 3) + uint(32 * g) + 4 * (t & 7); }
FN int p0_q3_k(int g, int p) { return 0; }
template <typename W>
FN void dq_q3_k(RawQ3_K r, uint t, int g, THREAD_PTR(W) w, THREAD_PTR(float) sc,
          THREAD_PTR(float) bi) {
  const uint n = t >> 3, sh = 8 * ((t & 7) >> 2) + 4 * n;
  const uint v = ((r.q >> (2 * g)) & 0x03030303u) | (((r.hm >> (4 * n + g)) & 0x01010101u) << 2);
  quad(v, 0, 0x7u, 4.0f, w);
  const uint a0 = r.a0 >> sh, a1 = r.a1 >> sh, h = r.a2 >> sh;
  const uint s6 = (a0 & 0x000F000Fu) | ((a1 & 0x000F000Fu) << 8)
                | ((h & 0x00030003u) << 4) | ((h & 0x000C000Cu) << 10);
  float s[4];
  quad(s6, 0, 0x3Fu, 32.0f, s);  // s = {j0, 256 j2, j1, 256 j3}
  const float d = f16lo(r.d);
  sc[0] = (g & 1) ? ((g & 2) ? s[3] * (d * 0.00390625f) : s[2] * d)
                  : ((g & 2) ? s[1] * (d * 0.00390625f) : s[0] * d);
  bi[0] = 0.0f;
}
"""

_K4_SCALES = r"""
// Q4_K / Q5_K: the eight 6-bit scales (or mins) of a block as two words of bytes, sub-blocks
// 0-3 and 4-7; `which` 0 = scales, 1 = mins; then sub-block s as d * value (exact d * sc).
FN uint k4_word(uint s0, uint s1, uint s2, int which, int half) {
  const uint a = which ? s1 : s0;
  return half ? (((which ? s2 >> 4 : s2) & 0x0F0F0F0Fu) | ((a >> 2) & 0x30303030u))
              : (a & 0x3F3F3F3Fu);
}
FN float k4_value(uint s0, uint s1, uint s2, int which, int s, float d) {
  const uint word = k4_word(s0, s1, s2, which, s >> 2);
  const uint m = (s & 2) ? mhi(word) : mlo(word);
  return (s & 1) ? fld(m, 8, 0x3Fu, 0.0f) * (d * 0.00390625f) : fld(m, 0, 0x3Fu, 0.0f) * d;
}
// The same value for each kernel's decode (overloaded on its weight pointer): the fp32 kernels
// take k4_value; the packed fp16 ones decode the block's four words of 6-bit values as fp16
// pairs, which the unrolled group loop computes once per block and row (same expressions).
FN float k4_get(uint s0, uint s1, uint s2, int which, int s, float d, THREAD_PTR(float) w) {
  return k4_value(s0, s1, s2, which, s, d);
}
FN float k4_get(uint s0, uint s1, uint s2, int which, int s, float d, THREAD_PTR(uint) w) {
  uint pr[2];  // bytes (0, 2) and (1, 3) of the word: sub-blocks 4 (s / 4) + 0..3
  quad(k4_word(s0, s1, s2, which, s >> 2), 0, 0x3Fu, 0.0f, pr);
  return ((s & 2) ? f16hi(pr[s & 1]) : f16lo(pr[s & 1])) * d;
}
"""

_Q4_K = (
    _K4_SCALES
    + r"""
// Lane t (of 4) owns words t and t+4 of each quarter j's 32 qs bytes; group g = (j, half hh):
// weights 64j + 32hh + {4t, 16+4t} + i, nibble hh (bits 4hh / 4hh+8), sub-block g.
struct RawQ4_K { uint dd; uint s0; uint s1; uint s2; uint q[8]; };
FN RawQ4_K load_q4_k(DEVICE_PTR(const uchar) p, uint t) {
  RawQ4_K r; r.dd = ld32(p, 0); r.s0 = ld32(p, 1); r.s1 = ld32(p, 2); r.s2 = ld32(p, 3);
  UNROLL for (int j = 0; j < 4; ++j) {
    r.q[2 * j] = ld32(p, 4 + 8 * j + t); r.q[2 * j + 1] = ld32(p, 8 + 8 * j + t);
  }
  return r;
}
FN uint xoff_q4_k(uint t, int g, int p) { return uint(32 * g + 16 * p) + 4 * t; }
FN int p0_q4_k(int g, int p) { return 4 * (g & 1); }
template <typename W>
FN void dq_q4_k(RawQ4_K r, uint t, int g, THREAD_PTR(W) w, THREAD_PTR(float) sc,
          THREAD_PTR(float) bi) {
  const int j = g >> 1, hh = g & 1;
  quad(r.q[2 * j], 4 * hh, 0xFu, 0.0f, w);
  quad(r.q[2 * j + 1], 4 * hh, 0xFu, 0.0f, w + qstride(w));
  sc[0] = k4_get(r.s0, r.s1, r.s2, 0, g, f16lo(r.dd), w);
  bi[0] = -k4_get(r.s0, r.s1, r.s2, 1, g, f16hi(r.dd), w);
}
"""
)

_Q5_K = (
    _K4_SCALES
    + r"""
// As Q4_K; bit g of qh[l] is the fifth bit of weight 32g + l (qh words t and t+4 for this lane).
struct RawQ5_K { uint dd; uint s0; uint s1; uint s2; uint h0; uint h1; uint q[8]; };
FN RawQ5_K load_q5_k(DEVICE_PTR(const uchar) p, uint t) {
  RawQ5_K r; r.dd = ld32(p, 0); r.s0 = ld32(p, 1); r.s1 = ld32(p, 2); r.s2 = ld32(p, 3);
  r.h0 = ld32(p, 4 + t); r.h1 = ld32(p, 8 + t);
  UNROLL for (int j = 0; j < 4; ++j) {
    r.q[2 * j] = ld32(p, 12 + 8 * j + t); r.q[2 * j + 1] = ld32(p, 16 + 8 * j + t);
  }
  return r;
}
FN uint xoff_q5_k(uint t, int g, int p) { return uint(32 * g + 16 * p) + 4 * t; }
FN int p0_q5_k(int g, int p) { return 0; }
template <typename W>
FN void dq_q5_k(RawQ5_K r, uint t, int g, THREAD_PTR(W) w, THREAD_PTR(float) sc,
          THREAD_PTR(float) bi) {
  const int j = g >> 1, hh = g & 1;
  const uint v0 = ((r.q[2 * j] >> (4 * hh)) & 0x0F0F0F0Fu) | (((r.h0 >> g) & 0x01010101u) << 4);
  const uint v1 = ((r.q[2 * j + 1] >> (4 * hh)) & 0x0F0F0F0Fu) | (((r.h1 >> g) & 0x01010101u) << 4);
  quad(v0, 0, 0x1Fu, 0.0f, w); quad(v1, 0, 0x1Fu, 0.0f, w + qstride(w));
  sc[0] = k4_get(r.s0, r.s1, r.s2, 0, g, f16lo(r.dd), w);
  bi[0] = -k4_get(r.s0, r.s1, r.s2, 1, g, f16hi(r.dd), w);
}
"""
)

_Q6_K = r"""
// Lane t: half n = t/8, l0 = 4(t%8); group c holds weights 128n + 32c + l0 + i: low (c < 2) or
// high nibbles of ql[64n + 32(c%2) + l], plus bits 2c, 2c+1 of qh[32n + l]; scale 8n + 2c + h.
struct RawQ6_K { uint qa; uint qb; uint qh; uint s[4]; uint d; };
FN RawQ6_K load_q6_k(DEVICE_PTR(const uchar) p, uint t) {
  const uint n = t >> 3, c = t & 7, h = c >> 2;
  RawQ6_K r; r.qa = ld32u(p, 32 * n + 2 * c); r.qb = ld32u(p, 32 * n + 16 + 2 * c);
  r.qh = ld32u(p, 64 + 16 * n + 2 * c);
  UNROLL for (int k = 0; k < 4; ++k) r.s[k] = ld16(p, 96 + 4 * n + k) >> (8 * h);
  r.d = ld16(p, 104); return r;
}
FN uint xoff_q6_k(uint t, int g, int p) { return 128 * (t >> 3) + uint(32 * g) + 4 * (t & 7); }
FN int p0_q6_k(int g, int p) { return 0; }
template <typename W>
FN void dq_q6_k(RawQ6_K r, uint t, int g, THREAD_PTR(W) w, THREAD_PTR(float) sc,
          THREAD_PTR(float) bi) {
  const uint src = (g & 1) ? r.qb : r.qa;
  const uint v = ((src >> (4 * (g >> 1))) & 0x0F0F0F0Fu) | (((r.qh >> (2 * g)) & 0x03030303u) << 4);
  quad(v, 0, 0x3Fu, 32.0f, w);
  sc[0] = f16lo(r.d) * fld(mlo(r.s[g] ^ 0x80u), 0, 0xFFu, 128.0f);
  bi[0] = 0.0f;
}
"""

# Per type: (header code, QK, BB, lanes per block, groups per lane, weights per group, has bias).
# Lane t = lane % LPB; "group" g: GS weights sharing one scale, x at xoff(t, g, p) + 0..3.
_TYPES: dict[int, tuple[str, int, int, int, int, int, bool]] = {
    T.Q4_0: (_Q4_0, 32, 18, 4, 1, 8, False),
    T.Q4_1: (_Q4_1, 32, 20, 4, 1, 8, True),
    T.Q5_0: (_Q5_0, 32, 22, 4, 1, 8, False),
    T.Q5_1: (_Q5_1, 32, 24, 4, 1, 8, True),
    T.Q8_0: (_Q8_0, 32, 34, 4, 1, 8, False),
    T.Q2_K: (_Q2_K, 256, 84, 16, 4, 4, True),
    T.Q3_K: (_Q3_K, 256, 110, 16, 4, 4, False),
    T.Q4_K: (_Q4_K, 256, 144, 4, 8, 8, True),
    T.Q5_K: (_Q5_K, 256, 176, 4, 8, 8, True),
    T.Q6_K: (_Q6_K, 256, 210, 16, 4, 4, False),
}

# The rows, runs and accumulators both mat-vec loops start from.
_PROLOGUE = r"""
  const uint Mrt = uint(dims[0]);
  const uint N = uint(dims[1]);
  const uint K = uint(dims[2]);
  const uint nb = K / QK;
  const size_t row_bytes = size_t(nb) * BB;
  const uint row0 = gid_x * R;
  const uint t = lane % LPB;
  const uint bsub = lane / LPB;
  const uint nsteps = (nb + BPS - 1) / BPS;
  float acc[R][MT];
  UNROLL for (int r = 0; r < R; ++r) UNROLL for (int m = 0; m < MT; ++m) acc[r][m] = 0.0f;
  DEVICE_PTR(const uchar) wrow[R];  // rows past N re-read row N-1; their sums are dropped
  UNROLL for (int r = 0; r < R; ++r)
    wrow[r] = w + size_t(row0 + r < N ? row0 + r : N - 1) * row_bytes;
"""
# ... and how both end: the lanes' and SIMD groups' sums, written as (M, N).
_EPILOGUE = r"""
  // Sum the lanes, then the SIMD groups (through shared memory), and write (M, N).
  SHARED float red[8 * R * MT];
  UNROLL for (int r = 0; r < R; ++r) UNROLL for (int m = 0; m < MT; ++m) {
    const float v = simd_sum(acc[r][m]);
    if (lane == 0) red[(simd_id * R + r) * MT + m] = v;
  }
  BARRIER();
  if (tid < uint(R * MT)) {
    const uint r = tid / MT, m = tid % MT, row = row0 + r;
    float v = 0.0f;
    for (uint s = 0; s < n_simd; ++s) v += red[(s * R + r) * MT + m];
    if (row < N && m < Mrt) out[size_t(m) * N + row] = from_float<T>(v);
  }
"""

_BODY = r"""
  // Thread mapping: a threadgroup owns R consecutive rows; its n_simd SIMD groups take
  // interleaved runs of U steps along K (a step = BPS blocks); the LPB lanes of a block each own
  // one unit of it (t = lane % LPB), and every lane keeps partial sums for all R rows x MT columns.
  constexpr uint QK = @QK@, BB = @BB@, LPB = @LPB@, BPS = 32 / LPB, NG = @NG@, GS = @GS@;
@PROLOGUE@  for (uint s0 = simd_id * U; s0 < nsteps; s0 += n_simd * U) {
    // All loads of the run first, so U * R blocks' bytes are in flight together. (Measured:
    // double-buffering the next run's loads was slower on the H200, docs/kernel_notes.md.)
    Raw@SUF@ raw[U][R];
    UNROLL for (int u = 0; u < U; ++u) {
      const uint blk = (s0 + u) * BPS + bsub;
      const uint off = (blk < nb ? blk : 0) * BB;  // past the end: read block 0, skip its math
      UNROLL for (int r = 0; r < R; ++r) raw[u][r] = load_@suf@(wrow[r] + off, t);
    }
    UNROLL for (int u = 0; u < U; ++u) {
      const uint blk = (s0 + u) * BPS + bsub;
      if (blk >= nb) continue;
      DEVICE_PTR(const T) xb = x + size_t(blk) * QK;
      UNROLL for (int g = 0; g < int(NG); ++g) {
        float wv[R][GS];
        float sc[R];
        float bi[R];
        UNROLL for (int r = 0; r < R; ++r) dq_@suf@(raw[u][r], t, g, wv[r], &sc[r], &bi[r]);
        UNROLL for (int m = 0; m < MT; ++m) {
          float xv[GS];
          if (uint(m) < Mrt) {
            UNROLL for (int p = 0; p < int(GS / 4); ++p)
              load_x4(xb + size_t(m) * K + xoff_@suf@(t, g, p), xv + 4 * p);
          } else {
            UNROLL for (int i = 0; i < int(GS); ++i) xv[i] = 0.0f;
          }
          float sx = 0.0f;
          if (@BIAS@) { UNROLL for (int i = 0; i < int(GS); ++i) sx += xv[i]; }
          // x * 2^-p for a field read at bit p (exact): the decoded weights carry 2^p
          UNROLL for (int i = 0; i < int(GS); ++i)
            xv[i] *= 1.0f / float(1u << (p0_@suf@(g, i >> 2) + 8 * (i & 1)));
          UNROLL for (int r = 0; r < R; ++r) {
            float s = 0.0f;
            UNROLL for (int i = 0; i < int(GS); ++i) s = fma_f(wv[r][i], xv[i], s);
            acc[r][m] = fma_f(sc[r], s, acc[r][m]);
            if (@BIAS@) acc[r][m] = fma_f(bi[r], sx, acc[r][m]);
          }
        }
      }
    }
  }
@EPILOGUE@"""

# One run of U steps of the packed fp16 loop; @CHECK@ guards steps past the row's end (only the
# last run of a SIMD group can have them, so the main loop's copy has no guards at all).
_RUN_H2 = r"""
    {
      const uint blk0 = s0 * BPS + bsub;
      Raw@SUF@ raw[U][R];
      UNROLL for (int r = 0; r < R; ++r) {
        // one base address per row and run: the U steps are immediate offsets of the loads
        DEVICE_PTR(const uchar) wb = wrow[r] + size_t(blk0) * BB;
        UNROLL for (int u = 0; u < U; ++u)
          if (@CHECK@) raw[u][r] = load_@suf@(wb + u * BPS * BB, t);
      }
      DEVICE_PTR(const T) xb0 = x + size_t(blk0) * QK;
      UNROLL for (int u = 0; u < U; ++u) {
        if (!(@CHECK@)) continue;
        DEVICE_PTR(const T) xb = xb0 + u * BPS * QK;
        UNROLL for (int g = 0; g < int(NG); ++g) {
          uint wv[R][GP];
          float sc[R];
          float bi[R];
          UNROLL for (int r = 0; r < R; ++r) dq_@suf@(raw[u][r], t, g, wv[r], &sc[r], &bi[r]);
          UNROLL for (int m = 0; m < MT; ++m) {
@XLOAD@            float sx = 0.0f;
            if (@BIAS@) {  // the group's x sum: fp16 pair adds, the last one in fp32
              uint hs = xv[0];
              UNROLL for (int i = 1; i < int(GP); ++i) hs = h2_fma(xv[i], 0x3C003C00u, hs);
              sx = f16lo(hs) + f16hi(hs);
            }
            UNROLL for (int r = 0; r < R; ++r) {
              uint s = 0u;
              UNROLL for (int i = 0; i < int(GP); ++i) s = h2_fma(wv[r][i], xv[i], s);
@ACC@            }
          }
        }
      }
    }
"""

_BODY_H2 = r"""
  // Thread mapping as _BODY (R rows per threadgroup, SIMD groups on interleaved runs of U steps,
  // LPB lanes per block). Weights decode to exact fp16 pairs (field - zero) and meet x in
  // packed fp16 fmas, two weights per instruction; each group's GS products are summed in fp16
  // (GS / 2 roundings), then scaled and accumulated in fp32 across groups and blocks.
  // Range, fp16 x (V = 1): a lane's fp16 group sum is GS / 2 products of |field - zero| * |x|,
  // so it overflows past 65504 / (GS / 2 * max |field - zero|): |x| ~2048 for Q4_0, ~500 for
  // Q5_K, ~128 Q8_0. bf16 x (V = 2) is scaled per group into range first (x_h2): no overflow.
  constexpr uint QK = @QK@, BB = @BB@, LPB = @LPB@, BPS = 32 / LPB, NG = @NG@, GS = @GS@;
  constexpr uint GP = GS / 2;  // fp16 pairs per group
@PROLOGUE@  uint s0 = simd_id * U;
  // Whole runs (all U steps of every lane inside the row), then at most one partial run.
  for (; (s0 + U) * BPS <= nb; s0 += n_simd * U) @RUN_FULL@
  if (s0 < nsteps) @RUN_TAIL@
@EPILOGUE@"""

# How the packed loop gets a group's x as fp16 pairs and adds its sums, per variant. V = 1:
# fp16 x as it is. V = 2: bf16 x under a power-of-two scale per group and lane (x_h2), so the
# fp16 sums never overflow and keep their precision whatever the magnitude of x (x_h2's
# comment); the sum goes back to scale after its fp32 multiply by the group's scale (one extra
# FMUL per group and row against V = 1).
_H2_XLOAD = {
    1: r"""            uint xv[GP];
            if (uint(m) < Mrt) {
              UNROLL for (int p = 0; p < int(GS / 4); ++p)
                load_xh(xb + size_t(m) * K + xoff_@suf@(t, g, p), xv + 2 * p);
            } else {
              UNROLL for (int i = 0; i < int(GP); ++i) xv[i] = 0u;
            }
""",
    2: r"""            uint xv[GP];
            float xs = 1.0f;  // 2^e: the group's x are x * 2^-e in xv
            if (uint(m) < Mrt) {
              float xf[GS];
              UNROLL for (int p = 0; p < int(GS / 4); ++p)
                load_x4(xb + size_t(m) * K + xoff_@suf@(t, g, p), xf + 4 * p);
              xs = x_h2(xf, int(GS), xv);
            } else {
              UNROLL for (int i = 0; i < int(GP); ++i) xv[i] = 0u;
            }
""",
}
_H2_ACC = {
    1: r"""              acc[r][m] = fma_f(sc[r], f16lo(s) + f16hi(s), acc[r][m]);
              if (@BIAS@) acc[r][m] = fma_f(bi[r], sx, acc[r][m]);
""",
    # scale before the power of two: sc * sum stays finite where sum * 2^e alone could not
    2: r"""              float v = sc[r] * (f16lo(s) + f16hi(s));
              if (@BIAS@) v = fma_f(bi[r], sx, v);
              acc[r][m] = fma_f(v, xs, acc[r][m]);
""",
}


def _h2_body(variant: int) -> str:
    run = _RUN_H2.replace("@XLOAD@", _H2_XLOAD[variant]).replace("@ACC@", _H2_ACC[variant])
    return _BODY_H2.replace("@RUN_FULL@", run.replace("@CHECK@", "true")).replace(
        "@RUN_TAIL@", run.replace("@CHECK@", "blk0 + uint(u) * BPS < nb")
    )


_MAX_SIMD = 8  # the `red` buffer holds 8 SIMD groups: threadgroups of at most 256 threads
_M_BUCKETS = (1, 2, 4, 8, 16)  # MT template values; M is rounded up to one of these
_X_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
X_DTYPES = _X_DTYPES  # x dtypes the mat-vec kernels take
MAT_VEC_TYPES = tuple(_TYPES)  # GGML types with a mat-vec kernel


_LOOPS = {  # mat-vec loop per variant, with the shared prologue and epilogue in place
    v: b.replace("@PROLOGUE@", _PROLOGUE.lstrip("\n")).replace("@EPILOGUE@", _EPILOGUE.lstrip("\n"))
    for v, b in {0: _BODY, 1: _h2_body(1), 2: _h2_body(2)}.items()
}

_DEQ_BODY = r"""
  // Thread mapping: one thread per (row, block, lane unit t), writing the unit's weights.
  constexpr uint QK = @QK@, BB = @BB@, LPB = @LPB@, NG = @NG@, GS = @GS@;
  const uint N = uint(dims[0]);
  const uint K = uint(dims[1]);
  const uint nb = K / QK;
  const uint row = pos_x / (nb * LPB);
  const uint blk = (pos_x / LPB) % nb;
  const uint t = pos_x % LPB;
  if (row >= N) return;  // no barriers or SIMD operations below
  const Raw@SUF@ raw = load_@suf@(w + size_t(row) * nb * BB + size_t(blk) * BB, t);
  DEVICE_PTR(T) o = out + size_t(row) * K + size_t(blk) * QK;
  UNROLL for (int g = 0; g < int(NG); ++g) {
    float wv[GS];
    float sc;
    float bi;
    dq_@suf@(raw, t, g, wv, &sc, &bi);
    UNROLL for (int i = 0; i < int(GS); ++i) {
      // wv carries 2^p: fold 2^-p into the scale (exact), so sc2 * wv rounds once as d * q
      const float sc2 = sc * (1.0f / float(1u << (p0_@suf@(g, i >> 2) + 8 * (i & 1))));
      o[xoff_@suf@(t, g, i >> 2) + uint(i & 3)] = from_float<T>(sc2 * wv[i] + bi);
    }
  }
"""


def _substitute(body: str, ggml_type: int) -> str:
    _, qk, bb, lpb, ng, gs, bias = _TYPES[ggml_type]
    for key, val in (("QK", qk), ("BB", bb), ("LPB", lpb), ("NG", ng), ("GS", gs)):
        body = body.replace(f"@{key}@", str(val))
    body = body.replace("@SUF@", T(ggml_type).name).replace("@suf@", T(ggml_type).name.lower())
    return body.replace("@BIAS@", "true" if bias else "false")


def mat_vec_body(ggml_type: int, variant: int = 0, prefix: str = "") -> tuple[str, str]:
    """(body, header) of the mat-vec loop for one GGML type: what expert_matmul builds on.

    ``prefix`` goes before the loop (its @QK@ / @BB@ become the type's block size and bytes).
    The loop reads ``dims`` (M, N, K), ``x``, ``w`` and ``gid_x`` (block of R rows), takes the
    template values T, MT, R, U, and writes ``out[m * N + row]``. ``variant`` 0 works for fp32,
    fp16 and bf16 x (fp32 decode and math); 1 (``VARIANTS``) for fp16 x only (packed fp16 math),
    2 for bf16 x only (the same packed fp16 math on x scaled per group by a power of two).
    """
    return _substitute(prefix + _LOOPS[variant], ggml_type), _COMMON + _TYPES[ggml_type][0]


# Kernel variants: 0 = fp32 decode and fmas (any x dtype), 1 = packed fp16 (fp16 x only),
# 2 = packed fp16 on bf16 x (bf16 x only). VARIANT_DTYPES: the x dtype a variant takes.
VARIANTS = {0: "f32", 1: "h2", 2: "h2bf"}
VARIANT_DTYPES = {1: mx.float16, 2: mx.bfloat16}


def _make_kernel(ggml_type: int, variant: int) -> Kernel:
    dts = (mx.float32, mx.float16, mx.bfloat16) if variant == 0 else (VARIANT_DTYPES[variant],) * 3
    examples = [
        Example(
            {"x": dt, "w": mx.uint8, "dims": (mx.int32, 3)},
            {"out": dt},
            {"T": dt, "MT": mt, "R": r, "U": u},
        )
        for dt, mt, r, u in zip(dts, (1, 8, 16), (4, 2, 1), (2, 1, 1))
    ]
    body, header = mat_vec_body(ggml_type, variant)
    suffix = "" if variant == 0 else VARIANTS[variant] + "_"
    return Kernel(
        f"ggml_qmv_{suffix}{T(ggml_type).name.lower()}",
        inputs=["x", "w", "dims"],
        outputs=["out"],
        body=body,
        header=header,
        examples=examples,
    )


def _make_dequant_kernel(ggml_type: int) -> Kernel:
    examples = [
        Example({"w": mx.uint8, "dims": (mx.int32, 2)}, {"out": dt}, {"T": dt})
        for dt in (mx.float32, mx.bfloat16)
    ]
    return Kernel(
        f"ggml_dequant_{T(ggml_type).name.lower()}",
        inputs=["w", "dims"],
        outputs=["out"],
        body=_substitute(_DEQ_BODY, ggml_type),
        header=_COMMON + _TYPES[ggml_type][0],
        examples=examples,
    )


_KERNELS: dict[tuple[int, int], Kernel] = {
    (t, v): _make_kernel(t, v) for t in _TYPES for v in VARIANTS
}
_DEQUANT_KERNELS: dict[int, Kernel] = {t: _make_dequant_kernel(t) for t in _TYPES}


def kernel_name(ggml_type: int, variant: int = 0) -> str:
    """The registered name of a mat-vec kernel (benchmarks match profiler events on it)."""
    return _KERNELS[(ggml_type, variant)].name


# Defaults at M = 1, per block family and row length: (V, R, U, W max), for fp16 x. One table
# so the H200 sweep (bench/qmatmul.py --sweep, which prints ready lines) can switch them by
# editing a line. Rows of K >= 8192 count as long. H200 sweep of 2026-11-30 07:51 UTC, fp16 x
# (docs/kernel_notes.md): V = 1 won every 4-bit shape it ran.
DEFAULTS: dict[tuple[str, bool], tuple[int, int, int, int]] = {
    ("32", False): (1, 8, 1, 4),  # Q4_0, Q4_1, Q5_0, Q5_1, Q8_0
    ("32", True): (1, 4, 1, 8),
    ("256", False): (1, 4, 1, 4),  # K-quants
    ("256", True): (1, 2, 1, 8),
}
# Per type overrides of DEFAULTS, keyed (type name, long rows). The packed fp16 decode costs
# more instructions than the fp32 one for the 4-weight groups of Q3_K (sm_90 build). Q8_0 stays
# on fp32 math: its fp16 group sums (4 products of |q| <= 128 per half) overflow once |x|
# reaches ~128, where the 4-bit types (|q| <= 8 .. 31) have 4-16x more headroom.
TYPE_DEFAULTS: dict[tuple[str, bool], tuple[int, int, int, int]] = {
    ("Q4_0", True): (1, 2, 4, 8),  # 16.6 us at 4096x14336 against 28.7 for (1, 4, 1, 8)
    ("Q4_K", False): (1, 4, 2, 1),  # lm_head 262144x2816: 209 us against 251 for (1, 4, 1, 2)
    ("Q8_0", False): (0, 4, 2, 4),
    ("Q8_0", True): (0, 2, 4, 8),
    ("Q3_K", False): (0, 4, 1, 4),
    ("Q3_K", True): (0, 2, 1, 8),
    ("Q6_K", False): (0, 4, 1, 4),  # V = 1 won at 14336x4096 but the lm_head was not swept
    ("Q6_K", True): (1, 2, 1, 8),  # 29.2 us at 4096x14336 against 31.8 for V = 0
}
# fp32 and bf16 x run the fp32 decode (V = 0), whose own measured bests differ (session 1):
# 4 rows per threadgroup and 2 steps per run (1 for K-quants) below K = 8192, 2 rows and 8 SIMD
# groups above. bf16 x is what the models run on a GPU.
V0_DEFAULTS: dict[tuple[str, bool], tuple[int, int, int, int]] = {
    ("32", False): (0, 4, 2, 4),
    ("32", True): (0, 2, 4, 8),
    ("256", False): (0, 4, 1, 4),
    ("256", True): (0, 2, 1, 8),
}
# bf16 x: entries here, keyed (type name, long rows) or (block family, long rows) as above,
# replace V0_DEFAULTS. H200 sweep of 2026-11-30 (session 3, `bench/qmatmul.py --dtype bf16
# --profile --sweep --types Q4_0,Q4_K`, bench/results/qmatmul_bf16_v2_sweep_h200_2026-11-30.json):
# the packed fp16 loop on bf16 x (V = 2) won three of the four 4-bit shapes; % of copy bandwidth,
# N x K. Other types keep V = 0 until swept.
BF16_DEFAULTS: dict[tuple[str, bool], tuple[int, int, int, int]] = {
    ("Q4_0", False): (2, 4, 2, 4),  # 14336x4096 48.0 % (V0 default 44.6); 4096x4096 27.7 (28.3)
    ("Q4_0", True): (2, 2, 4, 8),  # 4096x14336 42.6 % (41.0)
    ("Q4_K", False): (2, 4, 1, 2),  # 14336x4096 47.6 % (33.0); 4096x4096 20.2 (16.0)
    ("Q4_K", True): (2, 4, 1, 7),  # 4096x14336 42.7 % (33.9)
}


def launch_config(ggml_type: int, M: int, N: int, K: int, dtype=mx.float16) -> dict[str, int]:
    """V (variant), MT (columns compiled for), R (rows per threadgroup), U (steps per run),
    W (SIMD groups).

    From the H200 measurements (docs/kernel_notes.md, M = 1): fp16 x takes the tables above;
    other dtypes the fp32 decode with its own measured table (bf16: BF16_DEFAULTS first).
    W never exceeds the runs a row has, so no SIMD group idles.
    """
    qk = _TYPES[ggml_type][1]
    mt = next(b for b in _M_BUCKETS if b >= M)
    long_rows = K >= 8192
    name = T(ggml_type).name
    v, r, u, w_max = TYPE_DEFAULTS.get((name, long_rows)) or DEFAULTS[(str(qk), long_rows)]
    if dtype != mx.float16 and v != 0:
        v, r, u, w_max = V0_DEFAULTS[(str(qk), long_rows)]
    if dtype == mx.bfloat16:
        bf = BF16_DEFAULTS.get((name, long_rows)) or BF16_DEFAULTS.get((str(qk), long_rows))
        v, r, u, w_max = bf or (v, r, u, w_max)
    r = max(1, min(r, 16 // mt))  # R x MT accumulators per lane
    return clamp_w(ggml_type, K, {"V": v, "MT": mt, "R": r, "U": u, "W": w_max})


def clamp_w(ggml_type: int, K: int, cfg: dict[str, int]) -> dict[str, int]:
    """cfg with W cut to the runs of U steps a row has, so no SIMD group idles."""
    qk, lpb = _TYPES[ggml_type][1], _TYPES[ggml_type][3]
    nsteps = -(-(K // qk) // (32 // lpb))
    return dict(cfg, W=max(1, min(cfg["W"], -(-nsteps // cfg["U"]))))


class _Plan:
    """Everything a launch needs for one (type, M, N, K, dtype, config), built once."""

    __slots__ = ("kernel", "grid", "threadgroup", "out_shapes", "out_dtypes", "template", "dims",
                 "launch")  # fmt: skip

    def __init__(self, ggml_type: int, M: int, N: int, K: int, dtype, cfg: dict[str, int]):
        self.kernel = _KERNELS[(ggml_type, cfg.get("V", 0))]
        self.grid = (-(-N // cfg["R"]) * 32 * cfg["W"],)
        self.threadgroup = (32 * cfg["W"],)
        self.out_shapes = [(M, N)]
        self.out_dtypes = [dtype]
        self.template = {"T": dtype, "MT": cfg["MT"], "R": cfg["R"], "U": cfg["U"]}
        self.dims = mx.array([M, N, K], dtype=mx.int32)
        self.launch = None  # the resolved launch (Kernel.launcher), built on the first GPU call


_PLANS: dict[tuple, _Plan] = {}


def _plan(ggml_type: int, M: int, N: int, K: int, dtype, config: dict | None) -> _Plan:
    key = (ggml_type, M, N, K, dtype, None if config is None else tuple(sorted(config.items())))
    plan = _PLANS.get(key)
    if plan is None:
        cfg = config or launch_config(ggml_type, M, N, K, dtype)
        v = cfg.get("V", 0)
        if v not in VARIANTS:
            raise ValueError(f"unknown mat-vec variant V = {v}")
        if cfg["MT"] < M:
            # the kernel computes MT columns of x per row; more would be left unwritten
            raise ValueError(f"config MT = {cfg['MT']} is below the {M} rows of x")
        if v in VARIANT_DTYPES and dtype != VARIANT_DTYPES[v]:
            raise ValueError(
                f"the {VARIANTS[v]} variant (V = {v}) takes {VARIANT_DTYPES[v]} x only"
            )
        plan = _PLANS[key] = _Plan(ggml_type, M, N, K, dtype, cfg)
    return plan


def ggml_matmul_kernel(
    x: mx.array,
    w_raw: mx.array,
    ggml_type: int,
    in_features: int,
    *,
    config: dict[str, int] | None = None,
    init_value: float | None = None,
) -> mx.array:
    """The GPU kernel alone: x (M, K) with 1 <= M <= 16, w_raw (N, row_bytes) -> (M, N).

    ``config`` overrides ``launch_config`` (benchmarks; V defaults to 0); ``init_value``
    pre-fills the output (tests poison it with NaN to prove every element is written).
    """
    M, K = x.shape
    p = _plan(ggml_type, M, w_raw.shape[0], K, x.dtype, config)
    return p.kernel(
        [x, w_raw, p.dims],
        grid=p.grid,
        threadgroup=p.threadgroup,
        output_shapes=p.out_shapes,
        output_dtypes=p.out_dtypes,
        template=p.template,
        init_value=init_value,
    )[0]


def ggml_dequantize_kernel(w_raw: mx.array, ggml_type: int, in_features: int, dtype: mx.Dtype):
    """The GPU dequantizer: w_raw (N, row_bytes) -> (N, in_features) in ``dtype``.

    Equal to ``dequantize_reference`` up to one rounding (the GPU may fuse scale * q + bias)
    and the final cast to ``dtype``.
    """
    n = w_raw.shape[0]
    key = (ggml_type, n, in_features, dtype)
    plan = _DEQUANT_PLANS.get(key)
    if plan is None:
        qk, lpb = _TYPES[ggml_type][1], _TYPES[ggml_type][3]
        # resolved once per shape; the dims array too (a host-made array per call costs more)
        launch = _DEQUANT_KERNELS[ggml_type].launcher(
            [mx.uint8, mx.int32],
            grid=(n * (in_features // qk) * lpb,),
            threadgroup=(256,),
            output_shapes=[(n, in_features)],
            output_dtypes=[dtype],
            template={"T": dtype},
        )
        if len(_DEQUANT_PLANS) >= 512:  # one per prompt length on the lookup path: stay bounded
            _DEQUANT_PLANS.clear()
        plan = _DEQUANT_PLANS[key] = (launch, mx.array([n, in_features], dtype=mx.int32))
    launch, dims = plan
    return launch(inputs=[w_raw, dims])[0]


_DEQUANT_PLANS: dict[tuple, tuple] = {}


def ggml_get_rows(w_raw: mx.array, ids: mx.array, ggml_type: int, in_features: int) -> mx.array:
    """Rows ``ids`` (...) of a GGML table w_raw (V, row_bytes) -> (..., in_features) fp32.

    On a GPU one gather and one dequantize launch (the reference's ~20 small ops per lookup
    each cost a launch); the reference elsewhere (bit-exact with gguf-py).
    """
    rows = w_raw[ids]
    if backend() is None or ggml_type not in _DEQUANT_KERNELS or ids.size == 0:
        return dequantize_reference(rows, ggml_type, in_features)
    flat = ggml_dequantize_kernel(rows.reshape(ids.size, -1), ggml_type, in_features, mx.float32)
    return flat.reshape(*ids.shape, in_features)


_DEQ_CHUNK = 1 << 26  # elements of dequantized weight alive at once on the many-rows path


def _ggml_matmul_dequant(x: mx.array, w_raw: mx.array, ggml_type: int, k: int) -> mx.array:
    """Many rows of x: dequantize row chunks of W on the GPU, then mx.matmul in x.dtype."""
    n = w_raw.shape[0]
    rows = max(1, _DEQ_CHUNK // k)
    parts = [
        x @ ggml_dequantize_kernel(w_raw[r : r + rows], ggml_type, k, x.dtype).T
        for r in range(0, n, rows)
    ]
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)


# Launch plans by call signature: a repeat call (every decode step) is one dict lookup, then
# the launch. x goes in with its own shape (the kernel reads M, N, K from dims) and the output
# is created in (..., N): no reshapes.
_CALLS: dict[tuple, _Plan] = {}


def ggml_matmul(x: mx.array, w_raw: mx.array, ggml_type: int, in_features: int) -> mx.array:
    """x (..., K) @ dequant(w_raw).T -> (..., N) in x.dtype, fp32 accumulation.

    Dispatcher, for the ten block types and x in fp32/fp16/bf16 on a GPU: the mat-vec kernel
    for 1..16 rows of x; for more, the GPU dequantizer by row chunks and mx.matmul. The reference
    elsewhere (CPU, HF2Q_KERNELS=reference, dense GGML types, other dtypes).
    """
    be = backend()
    if be is not None:
        p = _CALLS.get((ggml_type, in_features, x.shape, x.dtype, w_raw.shape, w_raw.dtype))
        if p is not None:
            return p.launch(inputs=[x, w_raw, p.dims])[0]
    if x.shape[-1] != in_features:
        raise WeightMismatchError(f"x has {x.shape[-1]} features, the weight {in_features}")
    rb = row_bytes(ggml_type, in_features)  # raises for unknown types / bad K
    if ggml_type in GGML_BLOCK_INFO and GGML_BLOCK_INFO[ggml_type][0] > 1:
        if w_raw.ndim != 2 or w_raw.shape[1] != rb or w_raw.dtype != mx.uint8:
            raise WeightMismatchError(
                f"expected uint8 weight blocks (N, {rb}), got {w_raw.dtype} {w_raw.shape}"
            )
    M = math.prod(x.shape[:-1])
    if (
        be is None
        or ggml_type not in _TYPES
        or x.dtype not in _X_DTYPES
        or M == 0
        or w_raw.shape[0] == 0
    ):
        return ggml_matmul_reference(x, w_raw, ggml_type, in_features)
    if M <= _M_BUCKETS[-1]:
        N = w_raw.shape[0]
        plan = _Plan(ggml_type, M, N, in_features, x.dtype,
                     launch_config(ggml_type, M, N, in_features, x.dtype))  # fmt: skip
        plan.out_shapes = [(*x.shape[:-1], N)]
        # resolved once: a template dict is unhashable, so Kernel.__call__ would redo it per call
        plan.launch = plan.kernel.launcher(
            [x.dtype, mx.uint8, mx.int32],
            grid=plan.grid,
            threadgroup=plan.threadgroup,
            output_shapes=plan.out_shapes,
            output_dtypes=plan.out_dtypes,
            template=plan.template,
        )
        _CALLS[(ggml_type, in_features, x.shape, x.dtype, w_raw.shape, w_raw.dtype)] = plan
        return ggml_matmul(x, w_raw, ggml_type, in_features)
    out = _ggml_matmul_dequant(x.reshape(M, in_features), w_raw, ggml_type, in_features)
    return out.reshape(*x.shape[:-1], w_raw.shape[0])
