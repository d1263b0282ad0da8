"""One kernel body, two GPU back ends: render a portable body to Metal and CUDA source.

A body is the inside of a kernel function, written once in the common subset of Metal (C++14)
and CUDA C++ plus the vocabulary below; ``Kernel`` renders it for ``mx.fast.metal_kernel`` or
``mx.fast.cuda_kernel``, builds each back-end kernel lazily and once, and registers itself so
tests can syntax-check every kernel. docs/kernels.md is the long version of this list.

Thread indices (``const uint``, defined by the preamble before the body; reserved names):
    tid              linear thread index in the threadgroup (CUDA block)
    tid_x/y/z        thread position in the threadgroup
    gid_x/y/z        threadgroup position in the grid
    ngroups_x/y/z    threadgroups in the grid
    tg_size          threads per threadgroup (tg_size_x/y/z per dimension)
    pos_x/y/z        thread position in the grid (gid * tg_size + tid)
    lane             index in the SIMD group / warp (0..31)
    simd_id          SIMD group / warp index in the threadgroup;  n_simd: how many
    SIMD_SIZE        32 on both (Apple GPUs and NVIDIA warps)
Memory:
    SHARED float buf[N];        threadgroup / __shared__ array, static size, at body scope
    SHARED_PTR(T)               pointer type to shared memory (threadgroup T* / T*)
    DEVICE_PTR(T)               pointer type to device memory (device T* / T*)
    CONSTANT_PTR(T)             pointer to a small input (< 8 elements: Metal passes those in
                                the constant address space); scalars: read ``name[0]`` in the body
    THREAD_PTR(T)               pointer to a thread-local array (helper-function parameters)
    DEVICE_CAST(T, p)           reinterpret a device pointer, e.g. DEVICE_CAST(const uint4, w + o)
    BARRIER()                   threadgroup barrier on shared memory (__syncthreads)
    BARRIER_DEVICE()            same, also ordering device memory within the threadgroup
    SIMD_BARRIER()              SIMD-group barrier (__syncwarp)
Across threadgroups (device memory; the "last threadgroup done" pattern, docs/kernels.md):
    ATOMIC_ADD_U32(p, v)        atomic p[0] += v on a uint in device memory, returns the old
                                value (relaxed); p may point into an input (const cast away)
    ATOMIC_LOAD_U32(p)          p[0], coherent across threadgroups (relaxed atomic / volatile)
    ATOMIC_STORE_U32(p, v)      p[0] = v, likewise
    BARRIER_DEVICE_FENCE()      threadgroup barrier that first makes each thread's earlier
                                device writes visible device-wide (__threadfence; __syncthreads)
SIMD / warp (every lane of the SIMD group must call; int, uint, float, half types):
    simd_sum, simd_max, simd_min, simd_prefix_inclusive_sum, simd_prefix_exclusive_sum,
    simd_shuffle(x, src_lane), simd_broadcast(x, src_lane), simd_shuffle_xor(x, mask),
    simd_shuffle_down(x, delta), simd_shuffle_up(x, delta), simd_any(b), simd_all(b)
    mma_bf16_m16n8k16(c, a, b)  c (4 floats) += A (16x16 bf16) B (16x8 bf16) in the standard
                                PTX fragments (docs/kernels.md); a tensor-core mma on CUDA, a
                                slow portable version from shuffles on Metal and the emulator
    mma_tf32_m16n8k8(c, a, b)   c (4 floats) += A (16x8) B (8x8), tf32 inputs held as floats
                                (round them first: tf32_round), in the PTX fragments; likewise
    tf32_round(x)               x to the nearest tf32 (ties away from zero), as a float: the
                                same bits on every back end
Types and conversions:
    half_t, bfloat_t, uint, ushort, uchar; uint2/uint4/float2/float4 (member access .x.y.z.w only)
    to_float(x)  from_float<T>(f)  bitcast<To>(x)  f16_bits_to_float(u16)  bf16_bits_to_float(u16)
Math (float): exp_f fast_exp_f log_f sqrt_f rsqrt_f tanh_f max_f min_f abs_f fma_f isnan_f
    isinf_f, INF_F; popcount_u(uint)
Misc: UNROLL (before a loop), FN (qualifier for helper functions in a kernel's header).

Inputs and outputs arrive as typed pointers (``const device T* x`` / ``const T* x``). Run-time
scalars go in as 1-element arrays (``n[0]``) or as template parameters (``constexpr`` on CUDA,
``template <...>`` on Metal). The grid is given in threads on both back ends and rounded up
here to whole threadgroups, so both launch the same threads: guard the edges in the body.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Union

import mlx.core as mx

from hf2q_mlx.custom_kernels import cuda_cache

TemplateValue = Union[int, bool, mx.Dtype]

# --------------------------------------------------------------------------------------------
# Per-backend headers: the vocabulary. Metal maps onto built-ins; CUDA implements them.


# The warp mma's portable version (Metal, and the CPU emulator through the CUDA header): each
# lane gathers the A rows and B columns its C fragment needs with simd_shuffle and sums in fp32
# (k ascending). Slow; it exists so the body compiles and runs everywhere. The lane index comes
# from a prefix sum (helpers cannot read Metal's thread attributes); every lane must call.
MMA_PORTABLE = r"""
FN float mma_lo(uint v) { return bitcast<float>(v << 16); }
FN float mma_hi(uint v) { return bitcast<float>(v & 0xFFFF0000u); }
FN void mma_bf16_m16n8k16(THREAD_PTR(float) c, const THREAD_PTR(uint) a,
                          const THREAD_PTR(uint) b) {
  const uint l = simd_prefix_exclusive_sum(1u), g = l >> 2, t = l & 3u;
  float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (uint h = 0; h < 2; ++h) {  // k 0..7 (a[0], a[1], b[0]), then 8..15 (a[2], a[3], b[1])
    for (uint q = 0; q < 4; ++q) {  // k = 8h + 2q, 8h + 2q + 1: held by lane t = q
      const uint r0 = simd_shuffle(a[2 * h], 4 * g + q);  // A[g][k, k+1]
      const uint r1 = simd_shuffle(a[2 * h + 1], 4 * g + q);  // A[g + 8][k, k+1]
      const uint c0 = simd_shuffle(b[h], 8 * t + q);  // B[k, k+1][2t]
      const uint c1 = simd_shuffle(b[h], 8 * t + 4 + q);  // B[k, k+1][2t + 1]
      s[0] = fma_f(mma_hi(r0), mma_hi(c0), fma_f(mma_lo(r0), mma_lo(c0), s[0]));
      s[1] = fma_f(mma_hi(r0), mma_hi(c1), fma_f(mma_lo(r0), mma_lo(c1), s[1]));
      s[2] = fma_f(mma_hi(r1), mma_hi(c0), fma_f(mma_lo(r1), mma_lo(c0), s[2]));
      s[3] = fma_f(mma_hi(r1), mma_hi(c1), fma_f(mma_lo(r1), mma_lo(c1), s[3]));
    }
  }
  for (int i = 0; i < 4; ++i) c[i] += s[i];
}
FN void mma_tf32_m16n8k8(THREAD_PTR(float) c, const THREAD_PTR(float) a,
                         const THREAD_PTR(float) b) {
  const uint l = simd_prefix_exclusive_sum(1u), g = l >> 2, t = l & 3u;
  float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (uint h = 0; h < 2; ++h) {  // k 0..3 (a[0], a[1], b[0]), then 4..7 (a[2], a[3], b[1])
    for (uint q = 0; q < 4; ++q) {  // k = 4h + q: held by lane t = q
      const float r0 = simd_shuffle(a[2 * h], 4 * g + q);  // A[g][k]
      const float r1 = simd_shuffle(a[2 * h + 1], 4 * g + q);  // A[g + 8][k]
      const float c0 = simd_shuffle(b[h], 8 * t + q);  // B[k][2t]
      const float c1 = simd_shuffle(b[h], 8 * t + 4 + q);  // B[k][2t + 1]
      s[0] = fma_f(r0, c0, s[0]);
      s[1] = fma_f(r0, c1, s[1]);
      s[2] = fma_f(r1, c0, s[2]);
      s[3] = fma_f(r1, c1, s[3]);
    }
  }
  for (int i = 0; i < 4; ++i) c[i] += s[i];
}
"""

METAL_HEADER = r"""
#include <metal_stdlib>
using namespace metal;
#define SHARED threadgroup
#define SHARED_PTR(T) threadgroup T*
#define DEVICE_PTR(T) device T*
#define CONSTANT_PTR(T) constant T*
#define THREAD_PTR(T) thread T*
#define DEVICE_CAST(T, p) ((device T*)(p))
#define BARRIER() threadgroup_barrier(mem_flags::mem_threadgroup)
#define BARRIER_DEVICE() threadgroup_barrier(mem_flags::mem_device | mem_flags::mem_threadgroup)
#define SIMD_BARRIER() simdgroup_barrier(mem_flags::mem_threadgroup)
#define ATOMIC_ADD_U32(p, v) \
  atomic_fetch_add_explicit((device atomic_uint*)(p), (v), memory_order_relaxed)
#define ATOMIC_LOAD_U32(p) atomic_load_explicit((device atomic_uint*)(p), memory_order_relaxed)
#define ATOMIC_STORE_U32(p, v) \
  atomic_store_explicit((device atomic_uint*)(p), (v), memory_order_relaxed)
#if __METAL_VERSION__ >= 320  // device-scope fences arrived with MSL 3.2
#define BARRIER_DEVICE_FENCE()                                                              \
  do {                                                                                      \
    atomic_thread_fence(mem_flags::mem_device, memory_order_seq_cst, thread_scope_device);  \
    threadgroup_barrier(mem_flags::mem_device | mem_flags::mem_threadgroup);                \
  } while (0)
#else
#define BARRIER_DEVICE_FENCE() \
  threadgroup_barrier(mem_flags::mem_device | mem_flags::mem_threadgroup)
#endif
#define UNROLL _Pragma("unroll")
#define FN inline
#define SIMD_SIZE 32
#define INF_F INFINITY
typedef half half_t;
typedef bfloat16_t bfloat_t;
template <typename T> inline float to_float(T x) { return static_cast<float>(x); }
template <typename T> inline T from_float(float x) { return static_cast<T>(x); }
template <typename To, typename From> inline To bitcast(From x) { return as_type<To>(x); }
inline float f16_bits_to_float(uint16_t h) { return static_cast<float>(as_type<half>(h)); }
inline float bf16_bits_to_float(uint16_t h) { return as_type<float>(uint(h) << 16); }
inline float exp_f(float x) { return metal::exp(x); }
inline float fast_exp_f(float x) { return metal::fast::exp(x); }
inline float log_f(float x) { return metal::log(x); }
inline float sqrt_f(float x) { return metal::sqrt(x); }
inline float rsqrt_f(float x) { return metal::rsqrt(x); }
inline float tanh_f(float x) { return metal::tanh(x); }
inline float max_f(float a, float b) { return metal::fmax(a, b); }
inline float min_f(float a, float b) { return metal::fmin(a, b); }
inline float abs_f(float x) { return metal::fabs(x); }
inline float fma_f(float a, float b, float c) { return metal::fma(a, b, c); }
inline bool isnan_f(float x) { return metal::isnan(x); }
inline bool isinf_f(float x) { return metal::isinf(x); }
inline uint popcount_u(uint x) { return metal::popcount(x); }
"""
# x to tf32 by its bits (round half away from zero, as cvt.rna.tf32.f32 for finite x), so every
# back end and the emulator feed the tensor cores the same values
TF32_ROUND = r"""
FN float tf32_round(float x) { return bitcast<float>((bitcast<uint>(x) + 0x1000u) & 0xFFFFE000u); }
"""
METAL_HEADER += MMA_PORTABLE + TF32_ROUND

CUDA_HEADER = r"""
#define SHARED __shared__
#define SHARED_PTR(T) T*
#define DEVICE_PTR(T) T*
#define CONSTANT_PTR(T) T*
#define THREAD_PTR(T) T*
#define DEVICE_CAST(T, p) ((T*)(p))
#define BARRIER() __syncthreads()
#define BARRIER_DEVICE() __syncthreads()
#define SIMD_BARRIER() __syncwarp()
#define ATOMIC_ADD_U32(p, v) atomicAdd((unsigned int*)(p), (v))
#define ATOMIC_LOAD_U32(p) (*(volatile const unsigned int*)(p))
#define ATOMIC_STORE_U32(p, v) (*(volatile unsigned int*)(p) = (v))
#define BARRIER_DEVICE_FENCE() \
  do {                         \
    __threadfence();           \
    __syncthreads();           \
  } while (0)
#define UNROLL _Pragma("unroll")
#define FN __device__ __forceinline__
#define SIMD_SIZE 32
#define INF_F (__int_as_float(0x7f800000))
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef __half half_t;
typedef __nv_bfloat16 bfloat_t;
template <typename T> FN float to_float(T x) { return static_cast<float>(x); }
FN float to_float(float x) { return x; }
FN float to_float(__half x) { return __half2float(x); }
FN float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> FN T from_float(float x) { return static_cast<T>(x); }
template <> FN __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> FN __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <typename To, typename From> FN To bitcast(From x) {
  static_assert(sizeof(To) == sizeof(From), "bitcast: sizes differ");
  return *reinterpret_cast<const To*>(&x);
}
FN float f16_bits_to_float(uint16_t h) { return __half2float(__ushort_as_half(h)); }
FN float bf16_bits_to_float(uint16_t h) { return __uint_as_float(uint(h) << 16); }
FN float exp_f(float x) { return expf(x); }
FN float fast_exp_f(float x) { return __expf(x); }
FN float log_f(float x) { return logf(x); }
FN float sqrt_f(float x) { return sqrtf(x); }
FN float rsqrt_f(float x) { return rsqrtf(x); }
FN float tanh_f(float x) { return tanhf(x); }
FN float max_f(float a, float b) { return fmaxf(a, b); }
FN float min_f(float a, float b) { return fminf(a, b); }
FN float abs_f(float x) { return fabsf(x); }
FN float fma_f(float a, float b, float c) { return fmaf(a, b, c); }
FN bool isnan_f(float x) { return x != x; }
FN bool isinf_f(float x) { return fabsf(x) == __int_as_float(0x7f800000); }
FN uint popcount_u(uint x) { return __popc(x); }
FN uint hq_lane_id() {
  return (threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)) & 31u;
}
#define HQ_FULL 0xffffffffu
template <typename T> FN T simd_shuffle(T x, uint s) { return __shfl_sync(HQ_FULL, x, int(s)); }
template <typename T> FN T simd_broadcast(T x, uint s) { return __shfl_sync(HQ_FULL, x, int(s)); }
template <typename T> FN T simd_shuffle_xor(T x, uint m) {
  return __shfl_xor_sync(HQ_FULL, x, int(m));
}
template <typename T> FN T simd_shuffle_down(T x, uint d) {
  return __shfl_down_sync(HQ_FULL, x, d);
}
template <typename T> FN T simd_shuffle_up(T x, uint d) { return __shfl_up_sync(HQ_FULL, x, d); }
template <typename T> FN T simd_sum(T x) {
  UNROLL for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(HQ_FULL, x, o);
  return x;
}
template <typename T> FN T simd_max(T x) {
  UNROLL for (int o = 16; o > 0; o >>= 1) {
    T y = __shfl_xor_sync(HQ_FULL, x, o);
    x = y > x ? y : x;
  }
  return x;
}
template <typename T> FN T simd_min(T x) {
  UNROLL for (int o = 16; o > 0; o >>= 1) {
    T y = __shfl_xor_sync(HQ_FULL, x, o);
    x = y < x ? y : x;
  }
  return x;
}
template <typename T> FN T simd_prefix_inclusive_sum(T x) {
  const uint l = hq_lane_id();
  UNROLL for (uint o = 1; o < 32; o <<= 1) {
    T y = __shfl_up_sync(HQ_FULL, x, o);
    if (l >= o) x += y;
  }
  return x;
}
template <typename T> FN T simd_prefix_exclusive_sum(T x) {
  return simd_prefix_inclusive_sum(x) - x;
}
FN bool simd_any(bool b) { return __any_sync(HQ_FULL, b) != 0; }
FN bool simd_all(bool b) { return __all_sync(HQ_FULL, b) != 0; }
"""
# The warp mma: one tensor-core instruction on the GPU (sm_80+); the portable version where the
# CUDA rendering runs on the CPU emulator (g++ defines neither macro).
CUDA_HEADER += (
    r"""
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
FN void mma_bf16_m16n8k16(float* c, const uint* a, const uint* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
FN void mma_tf32_m16n8k8(float* c, const float* a, const float* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(__float_as_uint(a[0])), "r"(__float_as_uint(a[1])), "r"(__float_as_uint(a[2])),
        "r"(__float_as_uint(a[3])), "r"(__float_as_uint(b[0])), "r"(__float_as_uint(b[1])));
}
#else"""
    + MMA_PORTABLE
    + "#endif\n"
    + TF32_ROUND
)

# The attribute names MLX's metal_kernel looks for in the source and turns into parameters.
_METAL_ATTRIBUTES = (
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
)

METAL_PREAMBLE = """  // hf2q preamble (Metal): thread indices
  const uint tid = thread_index_in_threadgroup;
  const uint tid_x = thread_position_in_threadgroup.x;
  const uint tid_y = thread_position_in_threadgroup.y;
  const uint tid_z = thread_position_in_threadgroup.z;
  const uint gid_x = threadgroup_position_in_grid.x;
  const uint gid_y = threadgroup_position_in_grid.y;
  const uint gid_z = threadgroup_position_in_grid.z;
  const uint ngroups_x = threadgroups_per_grid.x;
  const uint ngroups_y = threadgroups_per_grid.y;
  const uint ngroups_z = threadgroups_per_grid.z;
  const uint tg_size_x = threads_per_threadgroup.x;
  const uint tg_size_y = threads_per_threadgroup.y;
  const uint tg_size_z = threads_per_threadgroup.z;
  const uint tg_size = tg_size_x * tg_size_y * tg_size_z;
  const uint pos_x = thread_position_in_grid.x;
  const uint pos_y = thread_position_in_grid.y;
  const uint pos_z = thread_position_in_grid.z;
  const uint lane = thread_index_in_simdgroup;
  const uint simd_id = simdgroup_index_in_threadgroup;
  const uint n_simd = simdgroups_per_threadgroup;
  (void)tid; (void)tid_x; (void)tid_y; (void)tid_z; (void)gid_x; (void)gid_y; (void)gid_z;
  (void)ngroups_x; (void)ngroups_y; (void)ngroups_z; (void)tg_size; (void)pos_x; (void)pos_y;
  (void)pos_z; (void)lane; (void)simd_id; (void)n_simd;  // silence unused-variable warnings
"""

CUDA_PREAMBLE = """  // hf2q preamble (CUDA): thread indices
  const uint tid_x = threadIdx.x;
  const uint tid_y = threadIdx.y;
  const uint tid_z = threadIdx.z;
  const uint tg_size_x = blockDim.x;
  const uint tg_size_y = blockDim.y;
  const uint tg_size_z = blockDim.z;
  const uint tid = tid_x + tg_size_x * (tid_y + tg_size_y * tid_z);
  const uint tg_size = tg_size_x * tg_size_y * tg_size_z;
  const uint gid_x = blockIdx.x;
  const uint gid_y = blockIdx.y;
  const uint gid_z = blockIdx.z;
  const uint ngroups_x = gridDim.x;
  const uint ngroups_y = gridDim.y;
  const uint ngroups_z = gridDim.z;
  const uint pos_x = gid_x * tg_size_x + tid_x;
  const uint pos_y = gid_y * tg_size_y + tid_y;
  const uint pos_z = gid_z * tg_size_z + tid_z;
  const uint lane = tid & 31u;
  const uint simd_id = tid >> 5;
  const uint n_simd = (tg_size + 31u) >> 5;
  (void)tid; (void)tid_x; (void)tid_y; (void)tid_z; (void)gid_x; (void)gid_y; (void)gid_z;
  (void)ngroups_x; (void)ngroups_y; (void)ngroups_z; (void)tg_size; (void)pos_x; (void)pos_y;
  (void)pos_z; (void)lane; (void)simd_id; (void)n_simd;  // silence unused-variable warnings
"""

# What MLX's cuda_kernel puts before our header (mlx/backend/cuda/custom_kernel.cpp).
CUDA_MLX_PRELUDE = """
#include "mlx/backend/cuda/device/utils.cuh"

#include <cooperative_groups.h>

#define inf cuda::std::numeric_limits<float>::infinity()

"""

_METAL_TYPES = {
    mx.bool_: "bool",
    mx.uint8: "uint8_t",
    mx.uint16: "uint16_t",
    mx.uint32: "uint32_t",
    mx.uint64: "uint64_t",
    mx.int8: "int8_t",
    mx.int16: "int16_t",
    mx.int32: "int32_t",
    mx.int64: "int64_t",
    mx.float16: "float16_t",
    mx.bfloat16: "bfloat16_t",
    mx.float32: "float",
}
_CUDA_TYPES = {
    **_METAL_TYPES,
    mx.float16: "__half",
    mx.bfloat16: "__nv_bfloat16",
}
_SHORT = {
    mx.bool_: "b",
    mx.uint8: "u8",
    mx.uint16: "u16",
    mx.uint32: "u32",
    mx.uint64: "u64",
    mx.int8: "i8",
    mx.int16: "i16",
    mx.int32: "i32",
    mx.int64: "i64",
    mx.float16: "f16",
    mx.bfloat16: "bf16",
    mx.float32: "f32",
}
_METAL_CONSTANT_MAX = 8  # MLX passes inputs with fewer elements in the constant address space
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_MAX_PLANS = 512  # launch plans kept per kernel (a model repeats a handful of call shapes)

BACKENDS = ("metal", "cuda")


def launch_bounds(threads: int, blocks: int | None) -> dict[str, int]:
    """Template values asking nvcc for ``blocks`` resident threadgroups of ``threads`` an SM
    (LB_THREADS / LB_MIN_BLOCKS: ``__launch_bounds__`` on our precompiled units, none on MLX's);
    no values when ``blocks`` is None or 0 (a switch left unset)."""
    return {"LB_THREADS": threads, "LB_MIN_BLOCKS": blocks} if blocks else {}


def gpu_backend() -> str | None:
    """The GPU back end MLX has here ('cuda', 'metal') regardless of overrides, else None."""
    if mx.cuda.is_available():
        return "cuda"
    if mx.metal.is_available():
        return "metal"
    return None


class _Cubin:
    """A cuda_cache cubin and what MLX made of it: ``loaded`` once a launch has run, ``failed``
    when MLX could not load it (MLX's own build serves the kernel from then on).

    MLX 0.32.4's ``CustomKernel::eval_gpu`` keys a precompiled kernel's module by its name and
    a hash of the image (``std::_Hash_bytes`` over the whole cubin), on every evaluation of
    every launch, compiled steps included; its ``cuda_kernel`` path keys by name only. So each
    launch of a cubin costs the host a hash of its bytes (~0.15 us per KiB, copy + hash timed
    on an x86 host; docs/kernel_notes.md, session 16), which is why a per-token step takes MLX's
    build (``cuda_cache.per_token``).
    """

    __slots__ = ("name", "blob", "loaded", "failed")

    def __init__(self, name: str, blob: bytes):
        self.name, self.blob, self.loaded, self.failed = name, blob, False, False


def _launch_precompiled(*, inputs, cubin: _Cubin, fallback, **launch) -> list[mx.array]:
    """A launch of a cuda_cache cubin (MLX passes the inputs' pointers, then the outputs');
    ``fallback()``: the launch of MLX's build of the same kernel, for a cubin MLX cannot load."""
    if cubin.failed:
        return fallback()(inputs=inputs)
    try:
        # the bytes go with every launch: MLX 0.32.4 finds the loaded module by name + a hash
        # of the image (an empty one is another key, which it then fails to load)
        outs = mx.fast.precompiled_cuda_kernel(
            name=cubin.name, compiled_source=cubin.blob, inputs=inputs, scalars=[], **launch
        )
        if not cubin.loaded:
            try:  # run this first launch now: a cubin MLX cannot load falls back here
                mx.eval(outs)
                cubin.loaded = True
            except ValueError:  # inside mx.compile's trace: a later launch loads it
                pass
        return outs
    except RuntimeError as err:
        if cubin.loaded or not any(s in str(err) for s in ("load", "kernel named")):
            raise
        cubin.failed = True
        cuda_cache.record_failure(cubin.name, str(err))
        return fallback()(inputs=inputs)


class _CudaPlan:
    """A CUDA launch's two builds, each made at its first use and chosen per call: our cubin
    where ``cuda_cache.wants_cubin()`` (not inside a per-token step in the default mode) and one
    exists, else MLX's cuda_kernel. A plan made by a prefill and reused by a decode step (the
    same call signature) so takes MLX's build there."""

    __slots__ = ("_cubin_of", "_mlx_of", "_launch", "_cubin", "_mlx")

    def __init__(self, cubin_of: Callable, mlx_of: Callable, launch: dict):
        self._cubin_of, self._mlx_of, self._launch = cubin_of, mlx_of, launch
        self._cubin = self._mlx = _UNSET

    def cubin(self) -> _Cubin | None:
        if self._cubin is _UNSET:
            self._cubin = self._cubin_of()
        return self._cubin

    def mlx(self) -> Callable:
        if self._mlx is _UNSET:
            self._mlx = self._mlx_of()
        return self._mlx

    def __call__(self, inputs) -> list[mx.array]:
        if cuda_cache.wants_cubin():
            cubin = self.cubin()
            if cubin is not None:
                return _launch_precompiled(
                    inputs=inputs, cubin=cubin, fallback=self.mlx, **self._launch
                )
        return self.mlx()(inputs=inputs)


_UNSET = object()


def _norm_template(template: Mapping[str, TemplateValue] | Sequence | None) -> list:
    items = list(template.items()) if isinstance(template, Mapping) else list(template or ())
    out = []
    for name, value in items:
        if not _IDENT.match(name):
            raise ValueError(f"template parameter name {name!r} is not an identifier")
        # bool -> int: both back ends use it as a constant; avoids nanobind variant ambiguity.
        out.append((name, int(value) if isinstance(value, bool) else value))
    return out


def _dims3(v: int | Sequence[int], what: str) -> tuple[int, int, int]:
    t = (v,) if isinstance(v, int) else tuple(int(a) for a in v)
    if not 1 <= len(t) <= 3 or any(a < 1 for a in t):
        raise ValueError(f"{what} must be 1-3 positive ints, got {v!r}")
    return (t + (1, 1))[:3]


# Programmatic dependent launch (sm_90 on): a kernel launched with the programmatic stream
# serialization attribute (cuda_driver.Driver.launch(pdl=True)) may be scheduled before the
# kernel ahead of it ends; its threads first wait for that kernel's completion and writes, then
# (mode 1) let the next kernel be scheduled at once, so a launch's start overlaps its
# predecessor's tail; mode 2 waits only (the next kernel is let in as this one's blocks exit).
# Without the attribute both instructions return at once.
PDL_WAIT = """#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
"""
PDL_PROLOGUE = PDL_WAIT.replace(
    "#endif", '  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");\n#endif'
)
PDL_PROLOGUES = {1: PDL_PROLOGUE, 2: PDL_WAIT}
_PDL_SUFFIX = {0: "", 1: "_pdl", 2: "_pdlw"}

# The launch recorder (custom_kernels/launch_recorder.py) while one is active: every launch then
# goes to it instead of MLX (a CUDA graph step records its kernels so).
_recorder: list = []
# A spec collector (``collecting``) while one is active: every CUDA launch is noted, and made
# through MLX's cuda_kernel, which compiles nothing until its output is evaluated.
_collector: list = []


def _collected_here() -> list | None:
    """The innermost ``collecting`` list of the calling thread, else None."""
    me = threading.get_ident()
    return next((specs for tid, specs in reversed(_collector) if tid == me), None)


class Collected(list):
    """``collecting``'s list of launch specs, and the warm-ups its graph asked for
    (``note_warm_up``): key -> a function of no arguments building MLX ops only."""

    def __init__(self):
        super().__init__()
        self.warm_ups: dict = {}


@contextlib.contextmanager
def collecting() -> Iterator[Collected]:
    """The ``LaunchSpec`` of every launch a graph built inside makes (a dry pass of a forward
    that is never evaluated: its launches' cubins can then be compiled at once,
    ``cuda_cache.cubins``). The outputs are MLX's lazy launches of the same kernels, so a value
    evaluated or kept by mistake is still right (MLX compiles its own build for it then)."""
    specs = Collected()
    entry = (threading.get_ident(), specs)  # this thread's launches only (an engine's beside)
    _collector.append(entry)
    try:
        yield specs
    finally:
        _collector.remove(entry)


def is_collecting() -> bool:
    """Whether a ``collecting`` pass is active on this thread (cheap when none is anywhere)."""
    return bool(_collector) and _collected_here() is not None


def note_warm_up(key, build: Callable[[], object]) -> None:
    """Inside ``collecting`` on this thread: ``build`` (MLX ops only, no kernels of ours, and no
    array of the dry graph: shapes and dtypes only) makes a graph whose evaluation does the
    one-time work of a library op the forward will meet (loading cuDNN for attention, cuBLAS's
    modules for a fp32 batched matmul). ``compile_ahead`` evaluates it while NVRTC compiles.
    Once per ``key``; elsewhere nothing."""
    if _collector:
        specs = _collected_here()
        if specs is not None:
            specs.warm_ups.setdefault(key, build)


@dataclass(frozen=True, eq=False)
class LaunchSpec:
    """Everything about one launch but its arrays (one per ``Kernel.launcher`` call)."""

    kernel: Kernel
    input_dtypes: tuple
    scalar_inputs: tuple
    output_shapes: tuple
    output_dtypes: tuple
    template: tuple  # normalized (name, value) pairs
    grid: tuple  # in threads, whole threadgroups
    threadgroup: tuple
    init_value: float | None
    signature: str

    @property
    def blocks(self) -> tuple[int, int, int]:
        return tuple(g // t for g, t in zip(self.grid, self.threadgroup))

    def pending_unit(self) -> tuple[str, str] | None:
        """``unit()`` where this process has not yet asked cuda_cache for the launch's cubin
        (None for a body that reads its inputs' shapes: MLX's build serves it)."""
        k = self.kernel
        if k.reads_input_shape():
            return None
        if ("precompiled", k._precompiled_name(self.template, self.signature)) in k._built:
            return None
        return self.unit()

    def unit(self, pdl: int = 0) -> tuple[str, str]:
        """(kernel symbol, translation unit) compiled by cuda_cache for a launch of our own;
        ``pdl`` 1 or 2: the body after ``PDL_PROLOGUES[pdl]`` (another symbol)."""
        return self.kernel.precompiled_unit(
            self.input_dtypes, self.scalar_inputs, self.output_dtypes, self.template,
            self.signature, pdl,
        )  # fmt: skip


class _Launch:
    """What ``Kernel.launcher`` returns: ``launch(inputs=[...])`` -> outputs through ``plan``
    (MLX's launch); while a recorder is active the launch goes to the recorder instead."""

    __slots__ = ("spec", "plan")

    def __init__(self, spec: LaunchSpec, plan: Callable):
        self.spec, self.plan = spec, plan

    def __call__(self, inputs) -> list[mx.array]:
        if _recorder:
            return _recorder[-1].launch(self.spec, list(inputs))
        if _collector and type(self.plan) is _CudaPlan:
            specs = _collected_here()
            if specs is not None:
                specs.append(self.spec)
                return self.plan.mlx()(inputs=inputs)
        return self.plan(inputs=inputs)


@dataclass(frozen=True)
class Example:
    """One instantiation used to render a full kernel for syntax checks.

    inputs: name -> dtype (a large array) or (dtype, n_elements) (n_elements < 8 lands in
    Metal's constant address space; 0 means a 0-d scalar array). outputs: name -> dtype.
    """

    inputs: Mapping[str, mx.Dtype | tuple[mx.Dtype, int]]
    outputs: Mapping[str, mx.Dtype]
    template: Mapping[str, TemplateValue] = field(default_factory=dict)


REGISTRY: dict[str, Kernel] = {}


def registered_kernels() -> list[Kernel]:
    """Every Kernel constructed so far (import the kernel modules first)."""
    return list(REGISTRY.values())


class Kernel:
    """A portable kernel body plus what MLX needs to build and launch it on Metal or CUDA.

    ``name``: identifier (also the registry key); ``inputs`` / ``outputs``: parameter names in
    order; ``body``: the portable body; ``header``: helper functions (use ``FN``) placed after the
    vocabulary; ``examples``: at least one ``Example`` for the syntax checks. ``in_place``:
    outputs the body may write over one of its inputs (output name -> input name), because every
    element of that input is read before any thread could write it, with ``in_place_flags``
    (output name -> a bool template constant) where the body must be told; a recorded graph
    uses them to drop a copy (``hf2q_mlx/cuda_graph_step.fuse_state_writes``).
    """

    def __init__(
        self,
        name: str,
        inputs: Sequence[str],
        outputs: Sequence[str],
        body: str,
        *,
        header: str = "",
        examples: Sequence[Example],
        ensure_row_contiguous: bool = True,
        register: bool = True,
        in_place: dict[str, str] | None = None,
        in_place_flags: dict[str, str] | None = None,
    ) -> None:
        for n in (name, *inputs, *outputs):
            if not _IDENT.match(n):
                raise ValueError(f"{n!r} is not a C identifier")
        if not outputs:
            raise ValueError("a kernel needs at least one output")
        if not examples:
            raise ValueError(f"kernel {name!r}: give at least one Example for the syntax checks")
        self.name = name
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)
        self.body = body
        self.header_extra = header
        self.examples = tuple(examples)
        self.ensure_row_contiguous = ensure_row_contiguous
        self.in_place = dict(in_place or {})
        self.in_place_flags = dict(in_place_flags or {})
        for o, i in self.in_place.items():
            if o not in self.outputs or i not in self.inputs:
                raise ValueError(f"kernel {name!r}: in_place {o} -> {i} names no output / input")
        if not set(self.in_place_flags) <= set(self.in_place):
            raise ValueError(f"kernel {name!r}: in_place_flags for outputs not in in_place")
        self._built: dict[tuple[str, str], object] = {}
        self._plans: dict[tuple, Callable[..., list[mx.array]]] = {}
        for ex in self.examples:
            if tuple(ex.inputs) != self.inputs or tuple(ex.outputs) != self.outputs:
                raise ValueError(f"kernel {name!r}: Example names differ from inputs/outputs")
        if register:
            if name in REGISTRY:
                raise ValueError(f"a kernel named {name!r} is already registered")
            REGISTRY[name] = self

    # -- source text ---------------------------------------------------------------------------
    def source(self, backend: str) -> str:
        """What goes in ``source=``: the preamble (thread indices) then the body."""
        preamble = {"metal": METAL_PREAMBLE, "cuda": CUDA_PREAMBLE}[backend]
        return preamble + self.body

    def header(self, backend: str) -> str:
        """What goes in ``header=``: the vocabulary for ``backend`` then the kernel's helpers."""
        vocab = {"metal": METAL_HEADER, "cuda": CUDA_HEADER}[backend]
        return vocab + "\n" + self.header_extra + "\n"

    def render(
        self, backend: str, example: Example | None = None, precompiled: bool = False
    ) -> str:
        """The full translation unit MLX generates for ``example`` (default: the first one);
        ``precompiled`` (CUDA): the one cuda_cache compiles instead.

        MLX's own headers (Metal utils, mlx/backend/cuda/device/utils.cuh) are not inlined.
        """
        ex = example or self.examples[0]
        template = _norm_template(ex.template)
        inputs = [(n, *(v if isinstance(v, tuple) else (v, 1 << 20))) for n, v in ex.inputs.items()]
        outputs = list(ex.outputs.items())
        src, fname = self.source(backend), f"custom_kernel_{self.name}"
        if backend == "cuda":
            return self._render_cuda(fname, src, inputs, outputs, template, precompiled)
        if backend == "metal":
            return self._render_metal(fname, src, inputs, outputs, template)
        raise ValueError(f"unknown backend {backend!r}")

    def _render_cuda(self, fname, src, inputs, outputs, template, precompiled=False) -> str:
        """MLX's translation unit for cuda_kernel; ``precompiled``: ours for cuda_cache (its
        prelude instead of MLX's, the kernel ``extern "C"`` so its symbol is ``fname``)."""
        prelude = cuda_cache.PRELUDE if precompiled else CUDA_MLX_PRELUDE
        lines = [prelude + self.header("cuda"), "namespace mlx::core::cu {\n"]
        if not precompiled:
            lines.append("namespace cg = cooperative_groups;\n")
        params = []
        for name, dt, size in inputs:
            params.append(f"    const {_CUDA_TYPES[dt]}* {name}")
            if size != 0:  # MLX adds shape info only for arrays with ndim > 0
                if f"{name}_shape" in src:
                    params.append(f"    const __grid_constant__ Shape {name}_shape")
                if f"{name}_strides" in src:
                    params.append(f"    const __grid_constant__ Strides {name}_strides")
                if f"{name}_ndim" in src:
                    params.append(f"    const __grid_constant__ int {name}_ndim")
        params += [f"    {_CUDA_TYPES[dt]}* {name}" for name, dt in outputs]
        linkage = 'extern "C" ' if precompiled else ""
        # template values LB_THREADS / LB_MIN_BLOCKS: launch bounds on our own units (the
        # register budget for that many resident threadgroups an SM); MLX's units take none
        t = dict(template)
        bounds = ""
        if precompiled and "LB_THREADS" in t and "LB_MIN_BLOCKS" in t:
            bounds = f"__launch_bounds__({t['LB_THREADS']}, {t['LB_MIN_BLOCKS']}) "
        lines.append(f"{linkage}__global__ void {bounds}{fname}(\n" + ",\n".join(params) + ") {")
        for name, v in template:
            if isinstance(v, mx.Dtype):
                lines.append(f"  using {name} = {_CUDA_TYPES[v]};")
            else:
                lines.append(f"  constexpr int {name} = {v};")
        lines += [src, "}\n", "} // namespace mlx::core::cu\n"]
        return "\n".join(lines)

    def _render_metal(self, fname, src, inputs, outputs, template) -> str:
        lines = [self.header("metal")]
        if template:
            kinds = ", ".join(
                f"{'typename' if isinstance(v, mx.Dtype) else 'int'} {n}" for n, v in template
            )
            lines.append(f"template <{kinds}>")
        params, index = [], 0
        for name, dt, size in inputs:
            space = "constant" if size < _METAL_CONSTANT_MAX else "device"
            ref = "&" if size == 0 else "*"
            params.append(f"  const {space} {_METAL_TYPES[dt]}{ref} {name} [[buffer({index})]]")
            index += 1
            if size != 0:
                for suffix, typ in (("shape", "int*"), ("strides", "int64_t*"), ("ndim", "int&")):
                    if f"{name}_{suffix}" in src:
                        params.append(f"  const constant {typ} {name}_{suffix} [[buffer({index})]]")
                        index += 1
        for name, dt in outputs:
            params.append(f"  device {_METAL_TYPES[dt]}* {name} [[buffer({index})]]")
            index += 1
        params += [f"  {typ} {a} [[{a}]]" for a, typ in _METAL_ATTRIBUTES if a in src]
        lines.append(f"[[kernel]] void {fname}(\n" + ",\n".join(params) + ") {")
        lines += [src, "}"]
        if template:
            args = ", ".join(
                _METAL_TYPES[v] if isinstance(v, mx.Dtype) else str(v) for _, v in template
            )
            inst = f"{fname}<{args}>"
            lines.append(f'template [[host_name("{fname}")]] [[kernel]] decltype({inst}) {inst};')
        return "\n".join(lines) + "\n"

    # -- building and launching ----------------------------------------------------------------
    def _kernel_for(self, backend: str, signature: str):
        # CUDA's JIT cache is keyed by name + template values only, not by dtypes: give each
        # dtype signature its own name so an f16 call never reuses an f32 build.
        key = (backend, signature)
        k = self._built.get(key)
        if k is None:
            name = f"{self.name}_{signature}"
            common = dict(
                name=name,
                input_names=list(self.inputs),
                output_names=list(self.outputs),
                source=self.source(backend),
                header=self.header(backend),
                ensure_row_contiguous=self.ensure_row_contiguous,
            )
            if backend == "cuda":
                k = mx.fast.cuda_kernel(**common)
            else:
                k = mx.fast.metal_kernel(**common)
            self._built[key] = k
        return k

    def launcher(
        self,
        input_dtypes: Sequence[mx.Dtype],
        *,
        grid: int | Sequence[int],
        threadgroup: int | Sequence[int],
        output_shapes: Sequence[Sequence[int]],
        output_dtypes: Sequence[mx.Dtype],
        template: Mapping[str, TemplateValue] | Sequence | None = None,
        init_value: float | None = None,
        backend: str | None = None,
        scalar_inputs: Sequence[int] = (),
        verbose: bool = False,
    ) -> Callable[..., list[mx.array]]:
        """Everything but the arrays, checked and resolved once: ``launcher(...)(inputs=[...])``
        launches like ``__call__`` with those values. ``scalar_inputs``: positions of 0-d inputs.
        Dispatchers cache the result per call shape, so a decode step pays one call per op."""
        backend = backend or gpu_backend()
        if backend not in BACKENDS:
            raise RuntimeError(f"kernel {self.name!r}: no GPU back end (MLX has no CUDA or Metal)")
        if len(input_dtypes) != len(self.inputs) or len(output_dtypes) != len(self.outputs):
            raise ValueError(f"kernel {self.name!r}: wrong number of inputs or outputs")
        if len(output_shapes) != len(output_dtypes):
            raise ValueError(f"kernel {self.name!r}: {len(output_shapes)} output shapes given")
        tg = _dims3(threadgroup, "threadgroup")
        gr = tuple(-(-g // t) * t for g, t in zip(_dims3(grid, "grid"), tg))
        sig = "_".join(
            _SHORT[d] + ("s" if i in scalar_inputs else "") for i, d in enumerate(input_dtypes)
        )
        sig += "__" + "_".join(_SHORT[d] for d in output_dtypes)
        shapes = [tuple(int(n) for n in s) for s in output_shapes]

        def mlx_build():
            return partial(
                self._kernel_for(backend, sig),
                template=_norm_template(template) or None,
                grid=gr,
                threadgroup=tg,
                output_shapes=shapes,
                output_dtypes=list(output_dtypes),
                init_value=init_value,
                verbose=verbose,
            )

        def build():
            if backend == "cuda":
                return _CudaPlan(
                    partial(self._precompiled, input_dtypes, scalar_inputs, output_dtypes,
                            template, sig),
                    mlx_build,
                    dict(grid=gr, threadgroup=tg, output_shapes=shapes,
                         output_dtypes=list(output_dtypes), init_value=init_value,
                         ensure_row_contiguous=self.ensure_row_contiguous),
                )  # fmt: skip
            return mlx_build()

        spec = LaunchSpec(
            self, tuple(input_dtypes), tuple(scalar_inputs), tuple(shapes), tuple(output_dtypes),
            tuple(_norm_template(template)), gr, tg, init_value, sig,
        )  # fmt: skip
        return _Launch(spec, build())

    def reads_input_shape(self) -> bool:
        """Whether the CUDA body reads an input's ``_shape``, ``_strides`` or ``_ndim`` (MLX's
        cuda_kernel adds those parameters; a precompiled launch passes none)."""
        src = self.source("cuda")
        return any(f"{n}_{a}" in src for n in self.inputs for a in ("shape", "strides", "ndim"))

    def _precompiled_name(self, template, sig, pdl: int = 0) -> str:
        """The module name MLX keys its loaded modules by: one per distinct translation unit."""
        tmpl = _norm_template(template)
        tkey = hashlib.sha256(repr(tmpl).encode()).hexdigest()[:12] if tmpl else "0"
        return f"hq_{self.name}_{sig}_{tkey}" + _PDL_SUFFIX[int(pdl)]

    def precompiled_unit(self, input_dtypes, scalar_inputs, output_dtypes, template, sig, pdl=0):
        """(symbol, translation unit) of one instantiation, as cuda_cache compiles it; ``pdl``
        1 or 2: the body after ``PDL_PROLOGUES[pdl]`` (a CUDA graph's launches with
        HF2Q_GRAPH_PDL set)."""
        tmpl = _norm_template(template)
        name = self._precompiled_name(tmpl, sig, pdl)
        inputs = [
            (n, dt, 0 if i in scalar_inputs else 1 << 20)
            for i, (n, dt) in enumerate(zip(self.inputs, input_dtypes))
        ]
        outputs = list(zip(self.outputs, output_dtypes))
        src = PDL_PROLOGUES[int(pdl)] + self.source("cuda") if pdl else self.source("cuda")
        return name, self._render_cuda(name, src, inputs, outputs, tmpl, True)

    def _precompiled(self, input_dtypes, scalar_inputs, output_dtypes, template, sig):
        """The _Cubin from cuda_cache, or None (MLX's cuda_kernel then: also for a body that
        ``reads_input_shape``)."""
        if self.reads_input_shape():
            return None
        name = self._precompiled_name(template, sig)
        if ("precompiled", name) in self._built:
            return self._built[("precompiled", name)]
        _, unit = self.precompiled_unit(input_dtypes, scalar_inputs, output_dtypes, template, sig)
        blob = cuda_cache.cubin(name, unit)
        # a failed compile is not retried in this process (MLX's path serves it)
        self._built[("precompiled", name)] = out = None if blob is None else _Cubin(name, blob)
        return out

    def __call__(
        self,
        inputs: Sequence[mx.array],
        *,
        grid: int | Sequence[int],
        threadgroup: int | Sequence[int],
        output_shapes: Sequence[Sequence[int]],
        output_dtypes: Sequence[mx.Dtype],
        template: Mapping[str, TemplateValue] | Sequence | None = None,
        init_value: float | None = None,
        backend: str | None = None,
        verbose: bool = False,
    ) -> list[mx.array]:
        """Launch on the GPU: grid in threads (rounded up to whole threadgroups) -> outputs.

        The launch values are resolved once per distinct call (``launcher``) and kept."""
        backend = backend or gpu_backend()
        try:
            key = (
                backend,
                grid,
                threadgroup,
                tuple(output_shapes),
                tuple(output_dtypes),
                tuple(template.items()) if type(template) is dict else template,
                init_value,
                verbose,
                tuple([a.dtype if a.ndim else (a.dtype,) for a in inputs]),
            )
            plan = self._plans.get(key)
        except TypeError:  # an unhashable value (a list): resolve it every time
            key, plan = None, None
        if plan is None:
            plan = self.launcher(
                [a.dtype for a in inputs],
                grid=grid,
                threadgroup=threadgroup,
                output_shapes=output_shapes,
                output_dtypes=output_dtypes,
                template=template,
                init_value=init_value,
                backend=backend,
                scalar_inputs=[i for i, a in enumerate(inputs) if a.ndim == 0],
                verbose=verbose,
            )
            if key is not None and len(self._plans) < _MAX_PLANS:
                self._plans[key] = plan
        return plan(inputs=inputs)
