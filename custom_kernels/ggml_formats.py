"""GGML block formats: one table of their layouts, and each format's decoder in C (kernels)."""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGMLQuantizationType as T

from hf2q_mlx.errors import UnsupportedQuantTypeError, WeightMismatchError


@dataclass(frozen=True)
class BlockFormat:
    """One GGML block format: its bytes, and how the kernels share a block among SIMD lanes."""

    block_size: int  # weights per block (QK in the kernels)
    block_bytes: int  # bytes per block (BB)
    scale_offsets: tuple[int, ...]  # byte offsets of the block's fp16 scale fields (d, dmin)
    lanes: int  # lanes per block (LPB): lane t = lane % LPB owns one unit of the block
    groups: int  # groups per lane (NG)
    group_size: int  # weights of a group, sharing one scale (GS): x at xoff(t, g, p) + 0..3
    has_bias: bool  # a per-group bias term (the formats with a min: weight = d * q - m)
    decoder: str  # C: Raw<TYPE>, load_<type>, xoff_<type>, p0_<type>, dq_<type>


# Types held as plain numbers (one element per "block"): bytes per element.
DENSE_BYTES: dict[int, int] = {T.F32: 4, T.F16: 2, T.BF16: 2}
DENSE_TYPES = tuple(DENSE_BYTES)

# The C decoders. A type supplies how a lane loads its bytes of a block (load_*), decodes them
# into exact small integers with a scale and a bias per group of GS weights (dq_*, templated on
# the output: floats carrying 2^p, or fp16 pairs), where each group's x values sit (xoff_*) and
# at which bit position each of its fields was read (p0_*). No repacking: the bytes are read
# where GGUF put them, with 2- or 4-byte loads as each format's alignment allows. COMMON holds
# what every GGML kernel shares: the decoding tricks and the x loaders.

COMMON = r"""
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

# The one table of block formats: dequant, the random test weights and the kernels read it.
BLOCK_FORMATS: dict[int, BlockFormat] = {
    T.Q4_0: BlockFormat(32, 18, (0,), 4, 1, 8, False, _Q4_0),
    T.Q4_1: BlockFormat(32, 20, (0, 2), 4, 1, 8, True, _Q4_1),
    T.Q5_0: BlockFormat(32, 22, (0,), 4, 1, 8, False, _Q5_0),
    T.Q5_1: BlockFormat(32, 24, (0, 2), 4, 1, 8, True, _Q5_1),
    T.Q8_0: BlockFormat(32, 34, (0,), 4, 1, 8, False, _Q8_0),
    T.Q2_K: BlockFormat(256, 84, (80, 82), 16, 4, 4, True, _Q2_K),
    T.Q3_K: BlockFormat(256, 110, (108,), 16, 4, 4, False, _Q3_K),
    T.Q4_K: BlockFormat(256, 144, (0, 2), 4, 8, 8, True, _Q4_K),
    T.Q5_K: BlockFormat(256, 176, (0, 2), 4, 8, 8, True, _Q5_K),
    T.Q6_K: BlockFormat(256, 210, (208,), 16, 4, 4, False, _Q6_K),
}
BLOCK_TYPES = tuple(BLOCK_FORMATS)


def rows_per_step(ggml_type: int, K: int) -> int:
    """Rows of K columns whose blocks fill one step of the mat-vec loop (32 / LPB block slots)
    when a row has fewer blocks than that (``nb`` dividing the slots, ``nb * LPB`` a power of
    2, so a row's lanes are a butterfly's); else 1. Qwen3.5-35B-A3B's Q4_K expert down (K 512,
    2 blocks, 8 slots): 4."""
    f = BLOCK_FORMATS.get(ggml_type)
    if f is None:
        return 1
    nb, slots = K // f.block_size, 32 // f.lanes
    if nb < 1 or nb >= slots or slots % nb or (nb * f.lanes) & (nb * f.lanes - 1):
        return 1
    return slots // nb


# ggml_type -> (elements per block, bytes per block), dense types first.
GGML_BLOCK_INFO: dict[int, tuple[int, int]] = {t: (1, n) for t, n in DENSE_BYTES.items()} | {
    t: (f.block_size, f.block_bytes) for t, f in BLOCK_FORMATS.items()
}


def type_name(ggml_type: int) -> str:
    """The GGML type's name, or a description of an unknown id (for error messages)."""
    try:
        return T(ggml_type).name
    except ValueError:
        return f"unknown type id {ggml_type}"


def block_info(ggml_type: int) -> tuple[int, int]:
    """(elements per block, bytes per block); UnsupportedQuantTypeError for other types."""
    info = GGML_BLOCK_INFO.get(ggml_type)
    if info is None:
        raise UnsupportedQuantTypeError(
            f"GGML type {type_name(ggml_type)} is not supported; supported: "
            + ", ".join(T(t).name for t in GGML_BLOCK_INFO)
        )
    return info


def row_bytes(ggml_type: int, cols: int) -> int:
    """Bytes of one row of ``cols`` elements stored as ``ggml_type``."""
    block, nbytes = block_info(ggml_type)
    if cols <= 0 or cols % block:
        raise WeightMismatchError(
            f"a row of {cols} elements cannot be stored as {type_name(ggml_type)} "
            f"(blocks of {block})"
        )
    return cols // block * nbytes


def kernel_header(ggml_type: int) -> str:
    """The C a kernel over ``ggml_type`` blocks includes: COMMON, then the type's decoder."""
    return COMMON + BLOCK_FORMATS[ggml_type].decoder


def fill_format(body: str, ggml_type: int) -> str:
    """``body`` with the format's @QK@, @BB@, @LPB@, @NG@, @GS@, @BIAS@ and @SUF@ / @suf@ (the
    type's name, upper / lower case: its decoder's names) filled in."""
    f = BLOCK_FORMATS[ggml_type]
    for key, val in (
        ("QK", f.block_size),
        ("BB", f.block_bytes),
        ("LPB", f.lanes),
        ("NG", f.groups),
        ("GS", f.group_size),
    ):
        body = body.replace(f"@{key}@", str(val))
    body = body.replace("@SUF@", T(ggml_type).name).replace("@suf@", T(ggml_type).name.lower())
    return body.replace("@BIAS@", "true" if f.has_bias else "false")
