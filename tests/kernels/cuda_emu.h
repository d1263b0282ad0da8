// A CPU stand-in for the CUDA built-ins our rendered kernels use, so g++ can (1) syntax-check a
// CUDA rendering and (2) run it: each threadgroup runs as tg_size fibers on one OS thread,
// switching at barriers and warp operations (_setjmp / _longjmp; swapcontext, which makes a
// signal-mask syscall per switch and ran the emulated tests 3-6x slower, with HQ_EMU_UCONTEXT:
// kernel_emulator.py takes it where a probe finds the fast switch broken). Strict where
// portability needs it: a barrier or warp operation that not every thread (lane) reaches
// aborts as a deadlock.
// Groups run one after another, so `__shared__` as `static` gives each group one shared array.
#pragma once
#include <setjmp.h>
#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <utility>
#include <vector>

#define __global__
#define __launch_bounds__(...)
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __grid_constant__

using std::isinf;
using std::isnan;
typedef unsigned int uint;
struct uint3 { unsigned x, y, z; };
struct dim3 { unsigned x = 1, y = 1, z = 1; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };

template <typename To, typename From> inline To hq_bits(From v) {
  static_assert(sizeof(To) == sizeof(From), "size");
  To t;
  std::memcpy(&t, &v, sizeof(To));
  return t;
}
inline float __int_as_float(int v) { return hq_bits<float>(v); }
inline float __uint_as_float(unsigned v) { return hq_bits<float>(v); }
inline unsigned __float_as_uint(float v) { return hq_bits<unsigned>(v); }
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline float __expf(float v) { return std::exp(v); }
inline float rsqrtf(float v) { return 1.0f / std::sqrt(v); }

struct __half { unsigned short x; };
struct __nv_bfloat16 { unsigned short x; };
inline __half __ushort_as_half(unsigned short h) { return __half{h}; }
inline float __half2float(__half h) {  // exact IEEE binary16 -> binary32
  const unsigned s = (h.x >> 15) & 1, e = (h.x >> 10) & 31, m = h.x & 1023;
  float v = e == 0 ? std::ldexp(float(m), -24)
            : e == 31 ? (m ? NAN : INFINITY)
                      : std::ldexp(float(m | 1024), int(e) - 25);
  return s ? -v : v;
}
inline __half __float2half_rn(float f) {  // the compiler's _Float16 rounds to nearest even
  const _Float16 h = (_Float16)f;
  return __half{hq_bits<unsigned short>(h)};
}
inline float __bfloat162float(__nv_bfloat16 b) { return __uint_as_float(unsigned(b.x) << 16); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  unsigned u = __float_as_uint(f);
  if (std::isnan(f)) return __nv_bfloat16{0x7fc0};
  u += 0x7fffu + ((u >> 16) & 1u);
  return __nv_bfloat16{(unsigned short)(u >> 16)};
}

namespace cooperative_groups {}
namespace mlx { namespace core { namespace cu {
struct Shape { int v[8]; int operator[](int i) const { return v[i]; } };
struct Strides { long long v[8]; long long operator[](int i) const { return v[i]; } };
}}}  // namespace mlx::core::cu

namespace hq_emu {
struct Fiber {
  ucontext_t ctx;  // its own stack; with the fast switch, only its first entry
  jmp_buf jb;
  unsigned tid = 0;
  bool done = false, started = false;
  std::vector<char> stack;
};
struct State {
  std::vector<Fiber> f;
  ucontext_t main_ctx;
  jmp_buf main;
  unsigned cur = 0;
  uint3 bidx{0, 0, 0}, bdim{1, 1, 1}, gdim{1, 1, 1};
  unsigned bar_count = 0;
  unsigned long bar_gen = 0, progress = 0;
  std::vector<unsigned> wcount;
  std::vector<unsigned long> wgen;
  std::vector<unsigned long long> xchg;  // 32 slots per warp
  std::function<void()> body;
};
inline State& S() { static State s; return s; }
inline uint3 tidx() {
  const State& s = S();
  const unsigned t = s.f[s.cur].tid;
  return uint3{t % s.bdim.x, (t / s.bdim.x) % s.bdim.y, t / (s.bdim.x * s.bdim.y)};
}
// The switches: fiber -> main loop (yield, finish) and main loop -> fiber s.cur (resume).
inline void yield() {
  State& s = S();
#ifdef HQ_EMU_UCONTEXT
  swapcontext(&s.f[s.cur].ctx, &s.main_ctx);
#else
  if (!_setjmp(s.f[s.cur].jb)) _longjmp(s.main, 1);
#endif
}
inline void resume() {
  State& s = S();
  Fiber& fb = s.f[s.cur];
#ifdef HQ_EMU_UCONTEXT
  swapcontext(&s.main_ctx, &fb.ctx);
#else
  if (!_setjmp(s.main)) {
    if (fb.started) _longjmp(fb.jb, 1);
    fb.started = true;
    setcontext(&fb.ctx);
  }
#endif
}
inline void group_barrier() {
  State& s = S();
  const unsigned long g = s.bar_gen;
  if (++s.bar_count == s.f.size()) { s.bar_count = 0; ++s.bar_gen; ++s.progress; }
  else while (s.bar_gen == g) yield();
}
inline void warp_barrier() {
  State& s = S();
  const unsigned w = s.f[s.cur].tid / 32;
  const unsigned long g = s.wgen[w];
  if (++s.wcount[w] == 32) { s.wcount[w] = 0; ++s.wgen[w]; ++s.progress; }
  else while (s.wgen[w] == g) yield();
}
template <typename T> inline T exchange(T v, int src_lane) {
  static_assert(sizeof(T) <= 8, "exchange: value too wide");
  State& s = S();
  const unsigned t = s.f[s.cur].tid, base = (t / 32) * 32;
  unsigned long long bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  s.xchg[t] = bits;
  warp_barrier();
  bits = s.xchg[base + (unsigned)src_lane];
  warp_barrier();
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}
inline unsigned lane_id() { return S().f[S().cur].tid % 32; }
inline void trampoline() {
  State& s = S();
  s.body();
  s.f[s.cur].done = true;
  ++s.progress;
#ifndef HQ_EMU_UCONTEXT
  _longjmp(s.main, 1);  // never returns (uc_link takes the ucontext switch back)
#endif
}
inline void run_group() {
  State& s = S();
  const unsigned n = s.bdim.x * s.bdim.y * s.bdim.z;
  if (n % 32) { std::fprintf(stderr, "emu: threadgroup size %u is not a multiple of 32\n", n); std::exit(3); }
  s.f.resize(n);
  s.wcount.assign(n / 32, 0);
  s.wgen.assign(n / 32, 0);
  s.xchg.assign(n, 0);
  s.bar_count = 0;
  for (unsigned i = 0; i < n; ++i) {
    Fiber& fb = s.f[i];
    fb.tid = i;
    fb.done = false;
    fb.started = false;
    fb.stack.resize(1 << 18);
    getcontext(&fb.ctx);
    fb.ctx.uc_stack.ss_sp = fb.stack.data();
    fb.ctx.uc_stack.ss_size = fb.stack.size();
    fb.ctx.uc_link = &s.main_ctx;
    makecontext(&fb.ctx, trampoline, 0);
  }
  for (;;) {
    bool all_done = true;
    const unsigned long p0 = s.progress;
    for (unsigned i = 0; i < n; ++i) {
      if (s.f[i].done) continue;
      all_done = false;
      s.cur = i;
      resume();
    }
    if (all_done) return;
    if (s.progress == p0) {
      std::fprintf(stderr, "emu: deadlock in group (%u,%u,%u): a barrier or warp op is not reached "
                   "by every thread\n", s.bidx.x, s.bidx.y, s.bidx.z);
      std::exit(4);
    }
  }
}
// Groups run in grid order (x fastest), or shuffled when HF2Q_EMU_SHUFFLE holds a seed: a
// kernel whose threadgroups coordinate (the last one done finishes the work) must not depend
// on which one runs last.
inline void launch(dim3 groups, dim3 block, std::function<void()> body) {
  State& s = S();
  s.body = std::move(body);
  s.bdim = uint3{block.x, block.y, block.z};
  s.gdim = uint3{groups.x, groups.y, groups.z};
  std::vector<uint3> order;
  for (unsigned z = 0; z < groups.z; ++z)
    for (unsigned y = 0; y < groups.y; ++y)
      for (unsigned x = 0; x < groups.x; ++x) order.push_back(uint3{x, y, z});
  if (const char* seed = std::getenv("HF2Q_EMU_SHUFFLE")) {
    unsigned long long r = std::strtoull(seed, nullptr, 10) * 6364136223846793005ull + 1;
    for (size_t i = order.size(); i > 1; --i) {  // Fisher-Yates on a 64-bit LCG
      r = r * 6364136223846793005ull + 1442695040888963407ull;
      std::swap(order[i - 1], order[(r >> 33) % i]);
    }
  }
  for (const uint3& g : order) {
    s.bidx = g;
    run_group();
  }
}
}  // namespace hq_emu

#define threadIdx (hq_emu::tidx())
#define blockIdx (hq_emu::S().bidx)
#define blockDim (hq_emu::S().bdim)
#define gridDim (hq_emu::S().gdim)
inline void __syncthreads() { hq_emu::group_barrier(); }
// Groups run one after another on one OS thread: a plain add is atomic, a fence has nothing
// to order.
inline void __threadfence() {}
inline unsigned atomicAdd(unsigned* p, unsigned v) {
  const unsigned old = *p;
  *p = old + v;
  return old;
}
inline void __syncwarp(unsigned = 0xffffffffu) { hq_emu::warp_barrier(); }
template <typename T> inline T __shfl_sync(unsigned, T v, int src, int = 32) {
  return hq_emu::exchange(v, src & 31);
}
template <typename T> inline T __shfl_xor_sync(unsigned, T v, int m, int = 32) {
  return hq_emu::exchange(v, int(hq_emu::lane_id() ^ unsigned(m)) & 31);
}
template <typename T> inline T __shfl_down_sync(unsigned, T v, unsigned d, int = 32) {
  const unsigned l = hq_emu::lane_id();
  return hq_emu::exchange(v, int(l + d < 32 ? l + d : l));
}
template <typename T> inline T __shfl_up_sync(unsigned, T v, unsigned d, int = 32) {
  const unsigned l = hq_emu::lane_id();
  return hq_emu::exchange(v, int(l >= d ? l - d : l));
}
inline int __any_sync(unsigned, int b) {
  int any = 0;
  for (int l = 0; l < 32; ++l) any |= hq_emu::exchange(b != 0, l);
  return any;
}
inline int __all_sync(unsigned, int b) {
  int all = 1;
  for (int l = 0; l < 32; ++l) all &= hq_emu::exchange(b != 0, l);
  return all;
}
