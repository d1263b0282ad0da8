// Stand-ins for the Metal names our rendered kernels use, so `g++ -fsyntax-only` can parse a
// rendered Metal kernel as C++. Declarations only: this checks syntax, names and arity, not
// Metal semantics (address spaces vanish, see docs/kernels.md). Include dir must supply an
// empty <metal_stdlib>.
#pragma once
// Take the kernels' `#ifdef __METAL_VERSION__` branches, as the Metal compiler does.
#define __METAL_VERSION__ 310
#include <cmath>
#include <cstdint>
#define device
#define threadgroup
#define constant
#define thread
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
struct half { half(); half(float); operator float() const; };
struct bfloat16_t { bfloat16_t(); bfloat16_t(float); operator float() const; };
typedef half float16_t;
template <typename T> struct vec2 { T x, y; };
template <typename T> struct vec3 { T x, y, z; };
template <typename T> struct vec4 { T x, y, z, w; };
typedef vec2<uint> uint2; typedef vec3<uint> uint3; typedef vec4<uint> uint4;
typedef vec2<float> float2; typedef vec2<half> half2; typedef vec4<float> float4; typedef vec4<half> half4;
namespace metal {
enum mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(int(a) | int(b)); }
void threadgroup_barrier(mem_flags);
void simdgroup_barrier(mem_flags);
template <typename To, typename From> To as_type(From);
template <typename T> T simd_sum(T); template <typename T> T simd_max(T);
template <typename T> T simd_min(T); template <typename T> T simd_prefix_inclusive_sum(T);
template <typename T> T simd_prefix_exclusive_sum(T);
template <typename T> T simd_shuffle(T, ushort); template <typename T> T simd_broadcast(T, ushort);
template <typename T> T simd_shuffle_xor(T, ushort);
template <typename T> T simd_shuffle_down(T, ushort); template <typename T> T simd_shuffle_up(T, ushort);
bool simd_any(bool); bool simd_all(bool);
float exp(float); float log(float); float sqrt(float); float rsqrt(float); float tanh(float);
float fmax(float, float); float fmin(float, float); float fabs(float);
float fma(float, float, float); half2 fma(half2, half2, half2); bool isnan(float); bool isinf(float); uint popcount(uint);
namespace fast { float exp(float); }
struct atomic_uint;  // only ever pointed to
enum memory_order { memory_order_relaxed = 0, memory_order_seq_cst = 5 };
enum thread_scope { thread_scope_thread, thread_scope_simdgroup, thread_scope_threadgroup,
                    thread_scope_device };
uint atomic_fetch_add_explicit(atomic_uint*, uint, memory_order);
uint atomic_load_explicit(atomic_uint*, memory_order);
void atomic_store_explicit(atomic_uint*, uint, memory_order);
void atomic_thread_fence(mem_flags, memory_order, thread_scope);
}  // namespace metal
