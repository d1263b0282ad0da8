// CPU mat-vec against GGML weight blocks as an MLX primitive (eval_cpu only).
//
// y (M, N) = x (M, K) @ dequant(W (N, row_bytes))^T, fp32 math on x as given (no 8-bit
// requantization of x as llama.cpp does), for M of a few rows (decode; any M works, the weight
// is read once per 4 rows). Built on first use by custom_kernels/cpu_ext/__init__.py with
// -march=native: AVX-512 (F, BW, VL) or AVX2 + FMA where the compiler targets them, a portable
// scalar loop otherwise.
//
// Every format is decoded 32 weights at a time (a "sub-block") to integers q, with up to two
// scales (for the first and the second 16 weights: Q6_K has a scale per 16) and one min:
// w = scale * q - min. Then sum_i w_i x_i = scale * sum_i q_i x_i - min * sum_i x_i, and the
// sums of x per 32 are computed once per call, so the loop over weights is an integer to float
// conversion and one FMA per weight and row of x. Each row of x goes through the same
// operations whatever M is: a row's output bits do not depend on the batch.
//
// Threads: the N weight rows are cut in chunks that the caller and a small persistent pool
// claim from one atomic ticket (class Pool); idle workers spin a while, then sleep.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <pthread.h>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HF2Q_AVX2 1
#else
#define HF2Q_AVX2 0
#endif
// AVX-512 (where -march=native has it): the same decoders, 16-wide conversion and math
#if HF2Q_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    !defined(HF2Q_NO_AVX512)
#define HF2Q_AVX512 1
#else
#define HF2Q_AVX512 0
#endif

#include <nanobind/nanobind.h>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"
#include "mlx/types/half_types.h"

namespace mx = mlx::core;
namespace nb = nanobind;

// fused_ops.cpp: the element offset of row r of x (its last axis a row, any strides)
int64_t row_offset(const mx::array& x, int64_t r);

namespace {

// GGML type ids (ggml.h)
enum GgmlType : int {
  Q4_0 = 2,
  Q4_1 = 3,
  Q5_0 = 6,
  Q5_1 = 7,
  Q8_0 = 8,
  Q4_K = 12,
  Q5_K = 13,
  Q6_K = 14,
};

struct Format {
  int block;  // weights per block
  int bytes;  // bytes per block
};

bool format_of(int type, Format* f) {
  switch (type) {
    case Q4_0: *f = {32, 18}; return true;
    case Q4_1: *f = {32, 20}; return true;
    case Q5_0: *f = {32, 22}; return true;
    case Q5_1: *f = {32, 24}; return true;
    case Q8_0: *f = {32, 34}; return true;
    case Q4_K: *f = {256, 144}; return true;
    case Q5_K: *f = {256, 176}; return true;
    case Q6_K: *f = {256, 210}; return true;
    default: return false;
  }
}

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if HF2Q_AVX2
  return _cvtsh_ss(h);
#else
  return static_cast<float>(*reinterpret_cast<const mx::float16_t*>(&h));
#endif
}

// Q4_K / Q5_K: the 6-bit scale and min of sub-block j from the 12 scale bytes.
inline void k4_scale_min(const uint8_t* s, int j, int* sc, int* mn) {
  if (j < 4) {
    *sc = s[j] & 63;
    *mn = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// One sub-block of 32 weights: q (signed), w = sa * q (first 16) or sb * q (last 16), - mn.
struct Sub {
  float sa, sb, mn;
};

// ---- portable decoders: sub-block j of a block to q[32] ------------------------------------

template <int TYPE>
inline Sub decode_scalar(const uint8_t* b, int j, int8_t* q) {
  if constexpr (TYPE == Q4_0 || TYPE == Q4_1) {
    const uint8_t* qs = b + (TYPE == Q4_0 ? 2 : 4);
    const int off = TYPE == Q4_0 ? 8 : 0;
    for (int i = 0; i < 16; ++i) {
      q[i] = int8_t((qs[i] & 0x0F) - off);
      q[i + 16] = int8_t((qs[i] >> 4) - off);
    }
    const float d = f16(b);
    return {d, d, TYPE == Q4_0 ? 0.0f : -f16(b + 2)};
  } else if constexpr (TYPE == Q5_0 || TYPE == Q5_1) {
    const int o = TYPE == Q5_0 ? 2 : 4;
    uint32_t qh;
    std::memcpy(&qh, b + o, 4);
    const uint8_t* qs = b + o + 4;
    const int off = TYPE == Q5_0 ? 16 : 0;
    for (int i = 0; i < 16; ++i) {
      q[i] = int8_t(((qs[i] & 0x0F) | (((qh >> i) & 1) << 4)) - off);
      q[i + 16] = int8_t(((qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4)) - off);
    }
    const float d = f16(b);
    return {d, d, TYPE == Q5_0 ? 0.0f : -f16(b + 2)};
  } else if constexpr (TYPE == Q8_0) {
    std::memcpy(q, b + 2, 32);
    const float d = f16(b);
    return {d, d, 0.0f};
  } else if constexpr (TYPE == Q4_K || TYPE == Q5_K) {
    const uint8_t* qs = b + (TYPE == Q4_K ? 16 : 48) + 32 * (j / 2);
    const int shift = 4 * (j & 1);
    for (int i = 0; i < 32; ++i) {
      int v = (qs[i] >> shift) & 0x0F;
      if constexpr (TYPE == Q5_K) v |= ((b[16 + i] >> j) & 1) << 4;
      q[i] = int8_t(v);
    }
    int sc, mn;
    k4_scale_min(b + 4, j, &sc, &mn);
    // as the reference: (d * sc) * q - (dmin * m)
    const float s = f16(b) * float(sc);
    return {s, s, f16(b + 2) * float(mn)};
  } else {  // Q6_K
    const int n = j / 4, r = j % 4;
    const uint8_t* ql = b + 64 * n + 32 * (r & 1);
    const uint8_t* qh = b + 128 + 32 * n;
    const int lshift = 4 * (r >> 1), hshift = 2 * r;
    for (int i = 0; i < 32; ++i)
      q[i] = int8_t((((ql[i] >> lshift) & 0x0F) | (((qh[i] >> hshift) & 3) << 4)) - 32);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192) + 8 * n + 2 * r;
    const float d = f16(b + 208);
    return {d * float(sc[0]), d * float(sc[1]), 0.0f};
  }
}

#if HF2Q_AVX2
// ---- AVX2 decoders: sub-block j of a block to 32 int8 in one register ----------------------

inline __m256i load256(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

inline __m256i nibbles16(const uint8_t* p) {
  // 16 bytes -> their low nibbles (bytes 0..15), then their high nibbles (16..31)
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i m = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}

inline __m256i bits_to_bytes(uint32_t x) {
  // bit i of x -> byte i: 0x10 if set, else 0 (llama.cpp's bytes_from_bits_32, shifted)
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                         0x0101010101010101, 0x0000000000000000);
  __m256i r = _mm256_shuffle_epi8(_mm256_set1_epi32(int(x)), shuf);
  const __m256i bit = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);
  r = _mm256_or_si256(r, bit);
  r = _mm256_cmpeq_epi8(r, _mm256_set1_epi64x(-1));  // 0xFF where the bit is set
  return _mm256_and_si256(r, _mm256_set1_epi8(0x10));
}

template <int TYPE>
inline Sub decode_avx2(const uint8_t* b, int j, __m256i* q) {
  if constexpr (TYPE == Q4_0) {
    *q = _mm256_sub_epi8(nibbles16(b + 2), _mm256_set1_epi8(8));
    const float d = f16(b);
    return {d, d, 0.0f};
  } else if constexpr (TYPE == Q4_1) {
    *q = nibbles16(b + 4);
    const float d = f16(b);
    return {d, d, -f16(b + 2)};
  } else if constexpr (TYPE == Q5_0 || TYPE == Q5_1) {
    const int o = TYPE == Q5_0 ? 2 : 4;
    uint32_t qh;
    std::memcpy(&qh, b + o, 4);
    __m256i v = _mm256_or_si256(nibbles16(b + o + 4), bits_to_bytes(qh));
    if constexpr (TYPE == Q5_0) v = _mm256_sub_epi8(v, _mm256_set1_epi8(16));
    *q = v;
    const float d = f16(b);
    return {d, d, TYPE == Q5_0 ? 0.0f : -f16(b + 2)};
  } else if constexpr (TYPE == Q8_0) {
    *q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
    const float d = f16(b);
    return {d, d, 0.0f};
  } else if constexpr (TYPE == Q4_K || TYPE == Q5_K) {
    const __m256i raw =
        load256(b + (TYPE == Q4_K ? 16 : 48) + 32 * (j / 2));
    __m256i v = _mm256_and_si256(_mm256_srli_epi16(raw, 4 * (j & 1)), _mm256_set1_epi8(0x0F));
    if constexpr (TYPE == Q5_K) {
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
      const __m256i hb = _mm256_and_si256(_mm256_srli_epi16(qh, j), _mm256_set1_epi8(1));
      v = _mm256_or_si256(v, _mm256_slli_epi16(hb, 4));  // hb is 0/1 per byte: no carry
    }
    *q = v;
    int sc, mn;
    k4_scale_min(b + 4, j, &sc, &mn);
    const float s = f16(b) * float(sc);
    return {s, s, f16(b + 2) * float(mn)};
  } else {  // Q6_K
    const int n = j / 4, r = j % 4;
    const __m256i ql = load256(b + 64 * n + 32 * (r & 1));
    const __m256i qh = load256(b + 128 + 32 * n);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(ql, 4 * (r >> 1)), m4);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * r), _mm256_set1_epi8(3));
    *q = _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192) + 8 * n + 2 * r;
    const float d = f16(b + 208);
    return {d * float(sc[0]), d * float(sc[1]), 0.0f};
  }
}

#if HF2Q_AVX512
// ---- AVX-512 decoders: sub-block j to its weights 0..15 and 16..31 as int32 -------------------
// Bytes widen straight from memory (vpmovzxbd), so a nibble costs one AND or shift per 16.

inline __m512i u8x16(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

template <int TYPE>
inline Sub decode512(const uint8_t* b, int j, __m512i* lo, __m512i* hi) {
  const __m512i m4 = _mm512_set1_epi32(0x0F);
  if constexpr (TYPE == Q4_0 || TYPE == Q4_1) {
    const __m512i raw = u8x16(b + (TYPE == Q4_0 ? 2 : 4));
    *lo = _mm512_and_si512(raw, m4);
    *hi = _mm512_srli_epi32(raw, 4);
    if constexpr (TYPE == Q4_0) {
      *lo = _mm512_sub_epi32(*lo, _mm512_set1_epi32(8));
      *hi = _mm512_sub_epi32(*hi, _mm512_set1_epi32(8));
    }
    const float d = f16(b);
    return {d, d, TYPE == Q4_0 ? 0.0f : -f16(b + 2)};
  } else if constexpr (TYPE == Q5_0 || TYPE == Q5_1) {
    const int o = TYPE == Q5_0 ? 2 : 4;
    uint32_t qh;
    std::memcpy(&qh, b + o, 4);
    const __m512i raw = u8x16(b + o + 4);
    const __m512i h = _mm512_set1_epi32(16);
    // the fifth bit: +16 where bit i of qh is set
    const __m512i l = _mm512_and_si512(raw, m4), u = _mm512_srli_epi32(raw, 4);
    *lo = _mm512_mask_add_epi32(l, __mmask16(qh), l, h);
    *hi = _mm512_mask_add_epi32(u, __mmask16(qh >> 16), u, h);
    if constexpr (TYPE == Q5_0) {
      *lo = _mm512_sub_epi32(*lo, h);
      *hi = _mm512_sub_epi32(*hi, h);
    }
    const float d = f16(b);
    return {d, d, TYPE == Q5_0 ? 0.0f : -f16(b + 2)};
  } else if constexpr (TYPE == Q8_0) {
    *lo = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2)));
    *hi = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18)));
    const float d = f16(b);
    return {d, d, 0.0f};
  } else if constexpr (TYPE == Q4_K || TYPE == Q5_K) {
    const uint8_t* qs = b + (TYPE == Q4_K ? 16 : 48) + 32 * (j / 2);
    const int sh = 4 * (j & 1);
    *lo = _mm512_and_si512(_mm512_srli_epi32(u8x16(qs), sh), m4);
    *hi = _mm512_and_si512(_mm512_srli_epi32(u8x16(qs + 16), sh), m4);
    if constexpr (TYPE == Q5_K) {
      // bit j of each of the 32 qh bytes -> +16
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
      const __mmask32 k = _mm256_test_epi8_mask(qh, _mm256_set1_epi8(char(1 << j)));
      const __m512i h = _mm512_set1_epi32(16);
      *lo = _mm512_mask_add_epi32(*lo, __mmask16(k), *lo, h);
      *hi = _mm512_mask_add_epi32(*hi, __mmask16(k >> 16), *hi, h);
    }
    int sc, mn;
    k4_scale_min(b + 4, j, &sc, &mn);
    const float s = f16(b) * float(sc);
    return {s, s, f16(b + 2) * float(mn)};
  } else {  // Q6_K
    const int n = j / 4, r = j % 4;
    const uint8_t* ql = b + 64 * n + 32 * (r & 1);
    const uint8_t* qh = b + 128 + 32 * n;
    const int ls = 4 * (r >> 1), hs = 2 * r;
    const __m512i m2 = _mm512_set1_epi32(3), o = _mm512_set1_epi32(32);
    for (int half = 0; half < 2; ++half) {
      const __m512i l = _mm512_and_si512(_mm512_srli_epi32(u8x16(ql + 16 * half), ls), m4);
      const __m512i h = _mm512_and_si512(_mm512_srli_epi32(u8x16(qh + 16 * half), hs), m2);
      (half ? *hi : *lo) = _mm512_sub_epi32(_mm512_or_si512(l, _mm512_slli_epi32(h, 4)), o);
    }
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192) + 8 * n + 2 * r;
    const float d = f16(b + 208);
    return {d * float(sc[0]), d * float(sc[1]), 0.0f};
  }
}
#endif

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// Bytes ahead of the block being decoded that are prefetched. Measured (SmolLM2's Q4_1 shapes,
// 66 MB of distinct weights per pass): without it the loop streams ~2 GB/s, the hardware
// prefetcher stopping at every 4 KiB page (MLX's buffers are not huge pages); 2-4 KiB ahead
// gives 5x that. Past the last row it reads nothing that matters (prefetches never fault).
#ifndef PREFETCH
#define PREFETCH 2048
#endif

// Rows [n0, n1) of W against MB rows of x (xf: fp32 (MB, K) contiguous rows of stride K;
// xs: sums of x per 32, (MB, K / 32)), into y (rows of stride N).
template <int TYPE, int MB>
void rows_kernel(const uint8_t* w, size_t w_stride, int n0, int n1, int K, const float* xf,
                 const float* xs, float* y, int N) {
  Format f;
  format_of(TYPE, &f);
  const int nblk = K / f.block, subs = f.block / 32;
  for (int n = n0; n < n1; ++n) {
    const uint8_t* row = w + size_t(n) * w_stride;
#if HF2Q_AVX512
    // Per sub-block and row of x: q * x over the 32 weights (one MUL, one FMA), then one FMA
    // of the scale into the row's accumulator (two for Q6_K: a scale per 16). Even and odd
    // sub-blocks go to two accumulators (the FMA latency would bound one chain); the loop is
    // unrolled by two so that they stay registers. Every row of x meets the same operations
    // whatever MB is: a row's bits do not depend on the batch.
    __m512 acc0[MB], acc1[MB];
    float mins0[MB] = {}, mins1[MB] = {};  // the sums of min * sum(x), in the same two chains
    for (int m = 0; m < MB; ++m) acc0[m] = acc1[m] = _mm512_setzero_ps();
    auto step = [&](int sub, __m512* acc, float* mins) {
      const int ib = sub / subs, j = sub % subs, k0 = 32 * sub;
      const uint8_t* b = row + size_t(ib) * f.bytes;
      if (j == 0)
        for (int o = 0; o < f.bytes; o += 64)  // one per cache line (a prefetch never faults)
          _mm_prefetch(reinterpret_cast<const char*>(b) + PREFETCH + o, _MM_HINT_T0);
      __m512i qlo, qhi;
      const Sub s = decode512<TYPE>(b, j, &qlo, &qhi);
      const __m512 wa = _mm512_cvtepi32_ps(qlo), wb = _mm512_cvtepi32_ps(qhi);
      const __m512 sa = _mm512_set1_ps(s.sa), sb = _mm512_set1_ps(s.sb);
      for (int m = 0; m < MB; ++m) {
        const float* xp = xf + size_t(m) * K + k0;
        if constexpr (TYPE == Q6_K) {
          acc[m] = _mm512_fmadd_ps(sa, _mm512_mul_ps(wa, _mm512_loadu_ps(xp)), acc[m]);
          acc[m] = _mm512_fmadd_ps(sb, _mm512_mul_ps(wb, _mm512_loadu_ps(xp + 16)), acc[m]);
        } else {
          __m512 d = _mm512_mul_ps(wa, _mm512_loadu_ps(xp));
          d = _mm512_fmadd_ps(wb, _mm512_loadu_ps(xp + 16), d);
          acc[m] = _mm512_fmadd_ps(sa, d, acc[m]);
        }
        if constexpr (TYPE == Q4_1 || TYPE == Q5_1 || TYPE == Q4_K || TYPE == Q5_K)
          mins[m] += s.mn * xs[size_t(m) * (K / 32) + sub];
      }
    };
    const int nsub = nblk * subs;
    int sub = 0;
    for (; sub + 1 < nsub; sub += 2) {
      step(sub, acc0, mins0);
      step(sub + 1, acc1, mins1);
    }
    if (sub < nsub) step(sub, acc0, mins0);
    for (int m = 0; m < MB; ++m) {
      const __m512 t = _mm512_add_ps(acc0[m], acc1[m]);
      y[size_t(m) * N + n] = _mm512_reduce_add_ps(t) - (mins0[m] + mins1[m]);
    }
#elif HF2Q_AVX2
    float mins[MB] = {};
    __m256 acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
    for (int ib = 0; ib < nblk; ++ib) {
      const uint8_t* b = row + size_t(ib) * f.bytes;
      for (int o = 0; o < f.bytes; o += 64)  // one per cache line (a prefetch never faults)
        _mm_prefetch(reinterpret_cast<const char*>(b) + PREFETCH + o, _MM_HINT_T0);
      for (int j = 0; j < subs; ++j) {
        __m256i q8;
        const Sub s = decode_avx2<TYPE>(b, j, &q8);
        const __m128i lo = _mm256_castsi256_si128(q8), hi = _mm256_extracti128_si256(q8, 1);
        const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
        const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
        const __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
        const __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
        const __m256 sa = _mm256_set1_ps(s.sa), sb = _mm256_set1_ps(s.sb);
        const int k0 = (ib * subs + j) * 32;
        for (int m = 0; m < MB; ++m) {
          const float* xp = xf + size_t(m) * K + k0;
          __m256 pa = _mm256_mul_ps(w0, _mm256_loadu_ps(xp));
          pa = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xp + 8), pa);
          __m256 pb = _mm256_mul_ps(w2, _mm256_loadu_ps(xp + 16));
          pb = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xp + 24), pb);
          acc[m] = _mm256_fmadd_ps(sa, pa, acc[m]);
          acc[m] = _mm256_fmadd_ps(sb, pb, acc[m]);
          if constexpr (TYPE == Q4_1 || TYPE == Q5_1 || TYPE == Q4_K || TYPE == Q5_K)
            mins[m] += s.mn * xs[size_t(m) * (K / 32) + k0 / 32];
        }
      }
    }
    for (int m = 0; m < MB; ++m) y[size_t(m) * N + n] = hsum(acc[m]) - mins[m];
#else
    float mins[MB] = {};
    float acc[MB] = {};
    int8_t q[32];
    for (int ib = 0; ib < nblk; ++ib) {
      const uint8_t* b = row + size_t(ib) * f.bytes;
      for (int j = 0; j < subs; ++j) {
        const Sub s = decode_scalar<TYPE>(b, j, q);
        const int k0 = (ib * subs + j) * 32;
        for (int m = 0; m < MB; ++m) {
          const float* xp = xf + size_t(m) * K + k0;
          float pa = 0.0f, pb = 0.0f;
          for (int i = 0; i < 16; ++i) pa += float(q[i]) * xp[i];
          for (int i = 16; i < 32; ++i) pb += float(q[i]) * xp[i];
          acc[m] += s.sa * pa + s.sb * pb;
          mins[m] += s.mn * xs[size_t(m) * (K / 32) + k0 / 32];
        }
      }
    }
    for (int m = 0; m < MB; ++m) y[size_t(m) * N + n] = acc[m] - mins[m];
#endif
  }
}

using RowsFn = void (*)(const uint8_t*, size_t, int, int, int, const float*, const float*,
                        float*, int);

template <int TYPE>
RowsFn rows_fn(int mb) {
  switch (mb) {
    case 1: return rows_kernel<TYPE, 1>;
    case 2: return rows_kernel<TYPE, 2>;
    case 3: return rows_kernel<TYPE, 3>;
    default: return rows_kernel<TYPE, 4>;
  }
}

RowsFn pick(int type, int mb) {
  switch (type) {
    case Q4_0: return rows_fn<Q4_0>(mb);
    case Q4_1: return rows_fn<Q4_1>(mb);
    case Q5_0: return rows_fn<Q5_0>(mb);
    case Q5_1: return rows_fn<Q5_1>(mb);
    case Q8_0: return rows_fn<Q8_0>(mb);
    case Q4_K: return rows_fn<Q4_K>(mb);
    case Q5_K: return rows_fn<Q5_K>(mb);
    case Q6_K: return rows_fn<Q6_K>(mb);
    default: throw std::invalid_argument("ggml_matvec: unsupported GGML type");
  }
}

constexpr int MAX_MB = 4;  // rows of x per pass over the weight (accumulators in registers)

// ---- thread pool ----------------------------------------------------------------------------
// A job is cut into chunks that the caller and the workers claim from one atomic ticket, so a
// worker that is not running (another process holds its core, or it sleeps) costs nothing: the
// caller takes the chunks itself and waits only for chunks a worker claimed and is computing.
// The ticket carries the job's generation in its high half, so a late worker cannot claim a
// chunk of a later job with an earlier job's function.

class Pool {
 public:
  explicit Pool(int threads) : n_(std::max(1, threads)) {
    const char* e = std::getenv("HF2Q_CPU_EXT_SPIN_US");
    // Measured (SmolLM2 decode, 2 cores): 50 us, the worker sleeping between most mat-vecs
    // of a step, 45-48 tok/s; 2-5 ms, the worker awake through the step, 49-54 tok/s.
    spin_ = std::chrono::microseconds(e != nullptr ? std::atoi(e) : 5000);
    for (int i = 1; i < n_; ++i) workers_.emplace_back([this] { loop(); });
  }
  ~Pool() {
    stop_.store(true);
    gen_.fetch_add(1);
    {
      std::lock_guard<std::mutex> lk(mu_);
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }
  int size() const { return n_; }

  // fn(chunk) for chunk in [0, chunks), over the caller and the workers; returns when all ran.
  void run(int chunks, const std::function<void(int)>& fn) {
    // one job at a time: a second caller (another CPU stream evaluating at the same moment)
    // runs its chunks alone
    std::unique_lock<std::mutex> busy(run_mu_, std::try_to_lock);
    if (chunks <= 1 || n_ == 1 || !busy.owns_lock()) {
      for (int c = 0; c < chunks; ++c) fn(c);
      return;
    }
    const uint64_t g = gen_.load(std::memory_order_relaxed) + 1;
    fn_.store(&fn, std::memory_order_relaxed);
    chunks_.store(chunks, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    ticket_.store(g << 32, std::memory_order_relaxed);
    gen_.store(g, std::memory_order_seq_cst);  // publishes fn_, chunks_, the ticket
    if (sleeping_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lk(mu_);
      cv_.notify_all();
    }
    work(g, fn, chunks);
    // only chunks a worker claimed can be left: they are being computed right now
    for (int spins = 0; done_.load(std::memory_order_acquire) != chunks; ++spins) {
      if (spins < 4096) {
        spin_pause();
      } else {
        std::this_thread::yield();  // the worker may be waiting for this core
      }
    }
  }

 private:
  static void spin_pause() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }

  void work(uint64_t g, const std::function<void(int)>& fn, int chunks) {
    uint64_t t = ticket_.load(std::memory_order_acquire);
    for (;;) {
      if ((t >> 32) != g || int(t & 0xFFFFFFFFu) >= chunks) return;
      if (ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) {
        fn(int(t & 0xFFFFFFFFu));
        done_.fetch_add(1, std::memory_order_release);
        t = ticket_.load(std::memory_order_acquire);
      }
    }
  }

  void loop() {
    uint64_t seen = 0;  // the generation at construction (a late start still sees every job)
    for (;;) {
      // spin a while (the next mat-vec of a decode step usually comes soon), then sleep
      uint64_t g = gen_.load(std::memory_order_acquire);
      const auto t0 = std::chrono::steady_clock::now();
      while (g == seen) {
        for (int k = 0; k < 64 && g == seen; ++k) {
          spin_pause();
          g = gen_.load(std::memory_order_acquire);
        }
        if (g == seen && std::chrono::steady_clock::now() - t0 > spin_) {
          std::unique_lock<std::mutex> lk(mu_);
          sleeping_.fetch_add(1, std::memory_order_seq_cst);
          cv_.wait(lk, [&] { return gen_.load(std::memory_order_seq_cst) != seen || stop_; });
          sleeping_.fetch_sub(1, std::memory_order_relaxed);
          g = gen_.load(std::memory_order_acquire);
        }
      }
      if (stop_.load()) return;
      seen = g;
      // fn_ and chunks_ are job g's or a later job's (published before gen_); a later job's
      // ticket has another generation, so nothing is claimed with them
      const std::function<void(int)>* fn = fn_.load(std::memory_order_relaxed);
      work(g, *fn, chunks_.load(std::memory_order_relaxed));
    }
  }

  int n_;
  std::chrono::microseconds spin_;  // how long an idle worker spins before it sleeps
  std::vector<std::thread> workers_;
  std::mutex mu_, run_mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> gen_{0}, ticket_{0};
  std::atomic<int> done_{0}, sleeping_{0};
  std::atomic<bool> stop_{false};
  std::atomic<const std::function<void(int)>*> fn_{nullptr};
  std::atomic<int> chunks_{0};
};

int default_threads() {
  if (const char* e = std::getenv("HF2Q_CPU_EXT_THREADS")) {
    const int n = std::atoi(e);
    if (n >= 1) return n;
  }
  return std::max(1u, std::thread::hardware_concurrency());
}

Pool* g_pool = nullptr;
int g_threads = 0;

Pool& pool() {
  // one pool per process, made on the first call; set_threads() replaces it (not thread-safe
  // with a mat-vec in flight: call it between evaluations)
  if (g_pool == nullptr) g_pool = new Pool(g_threads > 0 ? g_threads : default_threads());
  return *g_pool;
}

// Weights per chunk of rows at least (smaller jobs: fewer chunks, down to one on the caller).
constexpr size_t MIN_CHUNK = 1 << 15;
constexpr int MAX_CHUNKS = 16;  // per job: the threads balance over them

void matvec(int type, const float* xf, const float* xs, int M, int K, const uint8_t* w,
            size_t w_stride, int N, float* y) {
  Pool& p = pool();
  const size_t work = size_t(N) * size_t(K);
  int chunks = int(std::min<size_t>(MAX_CHUNKS, std::max<size_t>(1, work / MIN_CHUNK)));
  // rows per chunk: a multiple of 8 (whole cache lines of y)
  const int per = ((N + chunks - 1) / chunks + 7) / 8 * 8;
  chunks = (N + per - 1) / per;
  const std::function<void(int)> fn = [&](int c) {
    const int n0 = c * per, n1 = std::min(N, n0 + per);
    for (int m0 = 0; m0 < M; m0 += MAX_MB) {
      const int mb = std::min(MAX_MB, M - m0);
      pick(type, mb)(w, w_stride, n0, n1, K, xf + size_t(m0) * K, xs + size_t(m0) * (K / 32),
                     y + size_t(m0) * N, N);
    }
  };
  p.run(chunks, fn);
}

// Time spent in evaluations and their count (stats(): the mat-vec's share of a decode step).
std::atomic<uint64_t> g_ns{0}, g_calls{0};

// ---- the MLX primitive ----------------------------------------------------------------------

// x (..., K) at any strides: each row read from where row_offset puts it
template <typename T>
void load_x(const mx::array& x, int M, int K, float* xf, float* xs) {
  const T* p = x.data<T>();
  const int64_t s1 = x.strides().back();
  for (int m = 0; m < M; ++m) {
    const int64_t base = row_offset(x, m);
    float* dst = xf + size_t(m) * K;
    for (int k = 0; k < K; ++k) dst[k] = static_cast<float>(p[base + k * s1]);
    for (int c = 0; c < K / 32; ++c) {
      float s = 0.0f;
      for (int i = 0; i < 32; ++i) s += dst[32 * c + i];
      xs[size_t(m) * (K / 32) + c] = s;
    }
  }
}

template <typename T>
void store_y(const float* y, size_t n, mx::array& out) {
  T* o = out.data<T>();
  for (size_t i = 0; i < n; ++i) o[i] = static_cast<T>(y[i]);
}

class GGMLMatVec : public mx::UnaryPrimitive {
 public:
  GGMLMatVec(mx::Stream stream, int type, int k)
      : mx::UnaryPrimitive(stream), type_(type), k_(k) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& x = inputs[0];
    const mx::array& w = inputs[1];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.set_input_array(x);
    enc.set_input_array(w);
    enc.set_output_array(out);
    enc.dispatch([x, w, out, type = type_, K = k_]() mutable {
      const auto t0 = std::chrono::steady_clock::now();
      const int M = int(x.size() / K), N = int(w.shape(0));
      if (w.strides()[1] != 1) throw std::invalid_argument("ggml_matvec: weight rows strided");
      std::vector<float> xf(size_t(M) * K), xs(size_t(M) * (K / 32));
      switch (x.dtype()) {
        case mx::float32: load_x<float>(x, M, K, xf.data(), xs.data()); break;
        case mx::float16: load_x<mx::float16_t>(x, M, K, xf.data(), xs.data()); break;
        case mx::bfloat16: load_x<mx::bfloat16_t>(x, M, K, xf.data(), xs.data()); break;
        default: throw std::invalid_argument("ggml_matvec: x must be float32, float16 or bfloat16");
      }
      const bool f32 = out.dtype() == mx::float32;
      std::vector<float> tmp(f32 ? 0 : size_t(M) * N);
      float* y = f32 ? out.data<float>() : tmp.data();
      matvec(type, xf.data(), xs.data(), M, K, w.data<uint8_t>(), size_t(w.strides()[0]), N, y);
      if (out.dtype() == mx::float16) store_y<mx::float16_t>(y, tmp.size(), out);
      if (out.dtype() == mx::bfloat16) store_y<mx::bfloat16_t>(y, tmp.size(), out);
      const auto dt = std::chrono::steady_clock::now() - t0;
      g_ns.fetch_add(uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(dt).count()));
      g_calls.fetch_add(1);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("ggml_matvec runs on the CPU only");
  }

  const char* name() const override { return "GGMLMatVec"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const GGMLMatVec&>(other);
    return type_ == o.type_ && k_ == o.k_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape shape = inputs[0].shape();
    shape.back() = inputs[1].shape(0);
    return {shape};
  }

 private:
  int type_, k_;
};

mx::array ggml_matvec(const mx::array& x, const mx::array& w, int type, int k) {
  Format f;
  if (!format_of(type, &f))
    throw std::invalid_argument("ggml_matvec: unsupported GGML type " + std::to_string(type));
  if (k <= 0 || k % f.block != 0)
    throw std::invalid_argument("ggml_matvec: K is not a multiple of the block");
  if (x.ndim() < 1 || x.shape(-1) != k || x.size() == 0)
    throw std::invalid_argument("ggml_matvec: x must be (..., K) with at least one row");
  if (x.dtype() != mx::float32 && x.dtype() != mx::float16 && x.dtype() != mx::bfloat16)
    throw std::invalid_argument("ggml_matvec: x must be float32, float16 or bfloat16");
  const int64_t rb = int64_t(k / f.block) * f.bytes;
  if (w.ndim() != 2 || w.dtype() != mx::uint8 || w.shape(1) != rb)
    throw std::invalid_argument("ggml_matvec: w must be uint8 (N, " + std::to_string(rb) + ")");
  const mx::Stream s = mx::default_stream(mx::Device(mx::Device::cpu));
  mx::Shape shape = x.shape();  // (..., K) -> (..., N): no reshape ops around the call
  shape.back() = w.shape(0);
  return mx::array(shape, x.dtype(), std::make_shared<GGMLMatVec>(s, type, k), {x, w});
}

}  // namespace

void register_fused_ops(nb::module_& m);  // fused_ops.cpp: the RMS norm and RoPE primitives

NB_MODULE(_hf2q_cpu_matvec, m) {
  // a forked child has none of the pool's threads (and maybe a mutex held by one): it makes
  // its own pool at its first mat-vec (the parent's is left as it is)
  pthread_atfork(nullptr, nullptr, [] { g_pool = nullptr; });
  m.doc() = "CPU mat-vec against GGML weight blocks (hf2q_mlx custom_kernels/cpu_ext)";
  m.def("ggml_matvec", &ggml_matvec, nb::arg("x"), nb::arg("w"), nb::arg("ggml_type"),
        nb::arg("k"),
        "x (..., K) float @ dequant(w (N, row_bytes) uint8 GGML blocks).T -> (..., N) in x.dtype");
  m.def("simd", []() -> const char* {
    return HF2Q_AVX512 ? "avx512f" : HF2Q_AVX2 ? "avx2+fma" : "scalar";
  });
  register_fused_ops(m);
  m.def("threads", [] { return pool().size(); });
  m.def(
      "stats",
      [](bool reset) {
        const nb::tuple t = nb::make_tuple(g_calls.load(), double(g_ns.load()) * 1e-9);
        if (reset) g_ns = 0, g_calls = 0;
        return t;
      },
      nb::arg("reset") = false, "(calls, seconds) of mat-vec evaluations so far");
  m.def(
      "set_threads",
      [](int n) {
        delete g_pool;  // the next mat-vec makes a pool of n threads (0: the default)
        g_pool = nullptr;
        g_threads = std::max(0, n);
      },
      nb::arg("n"), "threads of the next mat-vecs (0: $HF2Q_CPU_EXT_THREADS or one per core)");
}
