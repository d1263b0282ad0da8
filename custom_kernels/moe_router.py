"""Mixture-of-experts router in one launch: logits, top-k, gate weights, the experts' input norm."""

from __future__ import annotations

import math
import os

import mlx.core as mx
import numpy as np

from hf2q_mlx.custom_kernels import backend, launch_recorder
from hf2q_mlx.custom_kernels._render import Example, Kernel
from hf2q_mlx.custom_kernels.post_norm_residual import post_norm_residual_reference, threads_for
from hf2q_mlx.custom_kernels.residual_rms_norm import residual_rms_norm_reference
from hf2q_mlx.errors import InvalidArgumentError, WeightMismatchError


def top_k_ids(logits: mx.array, k: int) -> mx.array:
    """The k largest logits' indices (..., k) uint32, largest first; equal logits: the lower
    index first (the kernel's rule, -inf included). k rounds of a masked argmax."""
    E = logits.shape[-1]
    iota = mx.arange(E, dtype=mx.uint32)
    taken = mx.zeros(logits.shape, dtype=mx.bool_)
    out = []
    for _ in range(k):
        m = mx.where(taken, -mx.inf, logits).max(axis=-1, keepdims=True)
        # argmax of a bool row: its first True, the lowest index among the untaken maxima
        i = mx.argmax((logits == m) & ~taken, axis=-1, keepdims=True).astype(mx.uint32)
        taken = taken | (iota == i)
        out.append(i)
    return mx.concatenate(out, axis=-1)


def moe_router_reference(
    x: mx.array,
    w: mx.array,
    k: int,
    *,
    eps: float = 1e-6,
    pre_scale: mx.array | None = None,
    pre_mult: float = 1.0,
    expert_scale: mx.array | None = None,
    renormalize: bool = True,
    post_norm: mx.array | None = None,
    quant: tuple | None = None,
    residual: tuple | None = None,
) -> tuple:
    """x (..., D), router weight w (E, D) float -> expert ids (..., k) uint32 (largest logit
    first, ties to the lower index), gate weights (..., k) fp32, and ``post_norm`` given:
    ``rms_norm(x, post_norm, eps)`` (..., D) in x.dtype, else None.

    ``quant`` = (scales, biases, group_size, bits): w is MLX affine-quantized (uint32 codes,
    an ``nn.QuantizedLinear``'s arrays), the logits those of its dequantized weight.
    Logits ``h @ w.T`` in the matmul's dtype, h = x, or with ``pre_scale`` (Gemma 4):
    ``rms_norm(x) * (pre_scale * pre_mult)`` in x.dtype. Weights: softmax over the chosen k
    (``renormalize``) or the full softmax's values at them; times ``expert_scale[ids]`` if given.

    ``residual`` = (res, res_w, res_next_w): a Gemma block join first, x its branch's output:
    ``h, n = post_norm_residual_reference(res, x, res_w, res_next_w, eps)``, the routing on h,
    and the result (ids, weights, xn, h, n). (res, res_w, None): a residual add and norm first
    (Qwen 3.5), ``h, n = residual_rms_norm_reference(res, x, res_w, eps)``, the routing on n.
    """
    if residual is not None:
        res, res_w, res_next_w = residual
        if res_next_w is None:
            hr, nr = residual_rms_norm_reference(res, x, res_w, eps)
        else:
            hr, nr = post_norm_residual_reference(res, x, res_w, res_next_w, eps)
        out = moe_router_reference(
            hr if res_next_w is not None else nr, w, k, eps=eps, pre_scale=pre_scale,
            pre_mult=pre_mult, expert_scale=expert_scale, renormalize=renormalize,
            post_norm=post_norm, quant=quant,
        )  # fmt: skip
        return (*out, hr, nr)
    h = x
    if pre_scale is not None:
        h = mx.fast.rms_norm(x, None, eps) * (pre_scale * pre_mult).astype(x.dtype)
    if quant is None:
        logits = (h @ w.T).astype(mx.float32)  # (..., E)
    else:
        # fp32 dequantization and products, rounded once to the output dtype (as MLX's GPU
        # quantized mat-vecs; its CPU one accumulates bf16 in bf16)
        scales, biases, gs, bits = quant
        f32 = mx.float32
        wd = mx.dequantize(w, scales.astype(f32), biases.astype(f32), group_size=gs, bits=bits)
        lt = _matmul_dtype(x.dtype, scales.dtype)
        logits = (h.astype(f32) @ wd.T).astype(lt).astype(f32)
    ids = top_k_ids(logits, k)
    if renormalize:
        wts = mx.softmax(mx.take_along_axis(logits, ids, axis=-1), axis=-1, precise=True)
    else:
        wts = mx.take_along_axis(mx.softmax(logits, axis=-1, precise=True), ids, axis=-1)
    if expert_scale is not None:
        wts = wts * expert_scale[ids].astype(mx.float32)
    xn = None if post_norm is None else mx.fast.rms_norm(x, post_norm, eps)
    return ids, wts, xn


# --------------------------------------------------------------------------------------------
# Kernel. Template: T (x), TW (w), LT (the logits' matmul dtype: where they round), D, E, K,
# QB (affine bits, 0 = float w), GS (affine group size), VEC (16-byte loads of float rows), WK
# (0 fp32 / 1 fp16 / 2 bf16 float w), flags PRE (Gemma's pre-norm and scale),
# PES (per-expert scale), NORM2 (write xn), RENORM, BATCHED (the row loaded in one round), W
# (SIMD groups per threadgroup), RES (the block join first: x the branch, res the residual
# stream; h and n out) with TGP, NPTP (post_norm_residual's threads and elements a thread).
# params (fp32): eps (every norm's), pre_mult rounded to T.

_HEADER = """
// 16 bytes of weights -> 4 fp32 (kind 0) or 8 fp16 / bf16 (kind 1 / 2) floats
FN void unpack16(uint4 q, int kind, THREAD_PTR(float) f) {
  const uint u[4] = {q.x, q.y, q.z, q.w};
  UNROLL for (int p = 0; p < 4; ++p) {
    if (kind == 0) {
      f[p] = bitcast<float>(u[p]);
    } else if (kind == 1) {
      f[2 * p] = f16_bits_to_float(uint16_t(u[p] & 0xFFFFu));
      f[2 * p + 1] = f16_bits_to_float(uint16_t(u[p] >> 16));
    } else {
      f[2 * p] = bf16_bits_to_float(uint16_t(u[p] & 0xFFFFu));
      f[2 * p + 1] = bf16_bits_to_float(uint16_t(u[p] >> 16));
    }
  }
}
"""

_BODY = r"""
  // Thread mapping: G threadgroups per token row (gid_x = row * G + g). Each stages the row
  // (pre-normed if PRE) in shared memory; its SIMD group s computes the logits of its slice's
  // experts g * EPG + s, + n_simd, ... (EPG = ceil(E / G)) with the lanes striding over the
  // row (16-byte loads for float rows when VEC, else one element each). G = 1: that one
  // threadgroup keeps the logits in shared memory. G > 1: each group writes its logits to lgo
  // (fp32, (rows, E)) and counts itself in on the row's counter; the last group of the row
  // to finish reads them all back. Then SIMD group 0 picks the top K and writes ids and
  // weights. Every logit is one SIMD group's sum in the same order whatever G and the group
  // size, and the norm's statistics are summed as NRW SIMD groups would: the outputs do not
  // depend on the mapping.
  const uint row = gid_x / uint(G);
  const uint grp = gid_x % uint(G);
  DEVICE_PTR(const T) xr = x + size_t(row) * D;
  SHARED float4 xs4[(D + 3) / 4];  // float4s: aligned for the 16-byte reads of VEC
  SHARED_PTR(float) xs = (SHARED_PTR(float))(xs4);
  SHARED float lg[E];
  SHARED float red[32];
  SHARED uint last[1];
  if (RES) {
    // The block join before the routing, in the layout and order of the kernel it replaces
    // (its bits): x is the branch's output y, res the residual stream. RES 1
    // (post_norm_residual): h = res + norm(y; res_w), n = norm(h; res_next_w), h routed;
    // RES 2 (residual_rms_norm): h = res + y, n = norm(h; res_w), n routed. Virtual thread
    // vt = (simd_id + W q) * 32 + lane of that kernel's TGP owns elements vt + TGP j; the
    // routed row goes to xs (read as the row would be); group 0 writes h and n.
    constexpr uint RVW = TGP / SIMD_SIZE;  // that kernel's SIMD groups
    constexpr uint RQ = (RVW + W - 1) / W;  // of them per SIMD group here
    float ya[RQ][NPTP], rx[RQ][NPTP], rw[RQ][NPTP], rn[RQ][NPTP];
    DEVICE_PTR(const T) resr = res + size_t(row) * D;
    UNROLL for (uint q = 0; q < RQ; ++q) {
      UNROLL for (uint j = 0; j < NPTP; ++j) {
        const uint i = (simd_id + W * q) * SIMD_SIZE + lane + TGP * j;
        const bool ok = simd_id + W * q < RVW && i < uint(D);
        ya[q][j] = ok ? to_float(xr[i]) : 0.0f;
        rx[q][j] = ok ? to_float(resr[i]) : 0.0f;
        rw[q][j] = ok ? to_float(res_w[i]) : 0.0f;
        rn[q][j] = (RES == 1 && ok && grp == 0) ? to_float(res_next_w[i]) : 0.0f;
      }
    }
    float ib = 1.0f;
    if (RES == 1) {  // the branch's norm
      UNROLL for (uint q = 0; q < RQ; ++q) {
        if (simd_id + W * q >= RVW) continue;  // the whole SIMD group alike
        float sa = 0.0f;
        UNROLL for (uint j = 0; j < NPTP; ++j) sa = fma_f(ya[q][j], ya[q][j], sa);
        sa = simd_sum(sa);
        if (lane == 0) red[simd_id + W * q] = sa;
      }
      BARRIER();
      float tb = 0.0f;
      UNROLL for (uint s = 0; s < RVW; ++s) tb += red[s];
      ib = rsqrt_f(tb / float(D) + params[0]);
      BARRIER();  // every thread has read red before it is reused
    }
    UNROLL for (uint q = 0; q < RQ; ++q) {
      UNROLL for (uint j = 0; j < NPTP; ++j) {
        const uint i = (simd_id + W * q) * SIMD_SIZE + lane + TGP * j;
        float hv = 0.0f;
        if (simd_id + W * q < RVW && i < uint(D)) {
          const float b = RES == 1 ? to_float(from_float<T>(ya[q][j] * ib * rw[q][j])) : ya[q][j];
          hv = to_float(from_float<T>(rx[q][j] + b));
          if (RES == 1) xs[i] = hv;
          if (grp == 0) h[size_t(row) * D + i] = from_float<T>(hv);
        }
        ya[q][j] = hv;
      }
    }
    UNROLL for (uint q = 0; q < RQ; ++q) {
      if (simd_id + W * q >= RVW) continue;
      float so = 0.0f;
      UNROLL for (uint j = 0; j < NPTP; ++j) so = fma_f(ya[q][j], ya[q][j], so);
      so = simd_sum(so);
      if (lane == 0) red[simd_id + W * q] = so;
    }
    BARRIER();
    float to = 0.0f;
    UNROLL for (uint s = 0; s < RVW; ++s) to += red[s];
    const float io = rsqrt_f(to / float(D) + params[0]);
    UNROLL for (uint q = 0; q < RQ; ++q) {
      UNROLL for (uint j = 0; j < NPTP; ++j) {
        const uint i = (simd_id + W * q) * SIMD_SIZE + lane + TGP * j;
        if (simd_id + W * q >= RVW || i >= uint(D)) continue;
        // (h * io) * weight, as each kernel writes it (residual_rms_norm's offset 0 added)
        const T nv = from_float<T>(ya[q][j] * io * (RES == 1 ? rn[q][j] : rw[q][j] + 0.0f));
        if (RES == 2) xs[i] = to_float(nv);
        if (grp == 0) n[size_t(row) * D + i] = nv;
      }
    }
    BARRIER();  // xs holds the routed row; red is free again
  }
  float inv = 1.0f;
  // BATCHED: every thread loads its elements of the row (and of the norms' weights) once,
  // all before the first use, in the statistics' layout: SIMD group s takes the virtual
  // groups vw = s, s + W, ... (< NRW), its lane l the elements vw * 32 + l + 32 * NRW * j. One
  // round of memory latency; the loop form below issues a round per element a thread owns.
  constexpr uint NJ = (uint(D) + SIMD_SIZE * NRW - 1) / (SIMD_SIZE * NRW);
  constexpr uint VPW = BATCHED ? (uint(NRW) + W - 1) / W : 1;
  float xv[VPW][NJ], pv[VPW][NJ], qv[VPW][NJ];
  if (BATCHED) {
    UNROLL for (uint q = 0; q < VPW; ++q) {
      UNROLL for (uint j = 0; j < NJ; ++j) {
        const uint vw = simd_id + W * q;
        const uint i = vw * SIMD_SIZE + lane + SIMD_SIZE * NRW * j;
        const bool ok = vw < uint(NRW) && i < uint(D);
        xv[q][j] = ok ? (RES ? xs[i] : to_float(xr[i])) : 0.0f;
        pv[q][j] = (PRE && ok) ? to_float(pre_scale[i]) : 0.0f;
        qv[q][j] = (NORM2 && ok && grp == 0) ? to_float(post_norm[i]) : 0.0f;
      }
    }
  }
  if (PRE || NORM2) {  // the row's RMS statistics, as mx.fast.rms_norm computes them
    // SIMD group vw of NRW sums the squares at vw * 32 + lane, + 32 * NRW, ...
    if (BATCHED) {
      UNROLL for (uint q = 0; q < VPW; ++q) {
        const uint vw = simd_id + W * q;
        if (vw >= uint(NRW)) continue;  // the whole SIMD group alike
        float ss = 0.0f;
        UNROLL for (uint j = 0; j < NJ; ++j) {
          if (vw * SIMD_SIZE + lane + SIMD_SIZE * NRW * j < uint(D))
            ss = fma_f(xv[q][j], xv[q][j], ss);
        }
        ss = simd_sum(ss);
        if (lane == 0) red[vw] = ss;
      }
    } else {
      for (uint vw = simd_id; vw < uint(NRW); vw += n_simd) {
        float ss = 0.0f;
        for (uint i = vw * SIMD_SIZE + lane; i < uint(D); i += SIMD_SIZE * NRW) {
          const float v = RES ? xs[i] : to_float(xr[i]);
          ss = fma_f(v, v, ss);
        }
        ss = simd_sum(ss);
        if (lane == 0) red[vw] = ss;
      }
    }
    BARRIER();
    float tot = 0.0f;
    for (uint s = 0; s < uint(NRW); ++s) tot += red[s];
    inv = rsqrt_f(tot / float(D) + params[0]);
  }
  // the staged row: every step rounded to T, as the reference's ops in x's dtype round
  if (BATCHED) {
    UNROLL for (uint q = 0; q < VPW; ++q) {
      UNROLL for (uint j = 0; j < NJ; ++j) {
        const uint vw = simd_id + W * q;
        const uint i = vw * SIMD_SIZE + lane + SIMD_SIZE * NRW * j;
        if (vw >= uint(NRW) || i >= uint(D)) continue;
        const float v = xv[q][j];
        const float nv = to_float(from_float<T>(v * inv));
        float h = v;
        if (PRE) {
          const float sr = to_float(from_float<T>(pv[q][j] * params[1]));
          h = to_float(from_float<T>(nv * sr));
        }
        xs[i] = h;
        if (NORM2 && grp == 0) xn[size_t(row) * D + i] = from_float<T>(nv * qv[q][j]);
      }
    }
  }
  for (uint i = tid; !BATCHED && i < uint(D); i += tg_size) {
    const float v = RES ? xs[i] : to_float(xr[i]);
    const float nv = to_float(from_float<T>(v * inv));
    float h = v;
    if (PRE) {
      const float sr = to_float(from_float<T>(to_float(pre_scale[i]) * params[1]));
      h = to_float(from_float<T>(nv * sr));
    }
    xs[i] = h;
    if (NORM2 && grp == 0) xn[size_t(row) * D + i] = from_float<T>(nv * to_float(post_norm[i]));
  }
  constexpr uint EPG = (uint(E) + G - 1) / G;  // experts per threadgroup
  const uint e_lo = grp * EPG;
  const uint e_hi = e_lo + EPG < uint(E) ? e_lo + EPG : uint(E);
  BARRIER();
  // Logits. Lanes read 16-byte chunks of a row, NU chunks in flight per lane (one SM's share
  // of the bandwidth needs many loads in flight: a 2816-wide bf16 row is one round of 16).
  // VEC (float rows, D a multiple of VW): VW weights per chunk, WK 0 fp32 / 1 fp16 / 2 bf16.
  // QB > 0 (MLX affine rows of D * QB / 32 words): CPW codes of one group per chunk,
  // w = scale * code + bias, summed as scale * sum(code * x) + bias * sum(x). Otherwise
  // (float rows, odd D): one weight per lane.
  // BATCHED, a row of up to 2 NU chunks a lane (26B-A4B's fp32 router: 22): all its loads in
  // one round, chunk u still summed into acc[u % NU] in the loop form's order.
  constexpr uint NU = 16;
  constexpr uint VW = WK == 0 ? 4 : 8;
  constexpr uint NCH = VEC ? uint(D) / VW : 0;
  constexpr uint NL = (NCH + SIMD_SIZE - 1) / SIMD_SIZE;  // chunks a lane
  constexpr uint NB = (BATCHED && NL > NU && NL <= 2 * NU) ? NL : NU;  // loaded per round
  for (uint e = e_lo + simd_id; VEC && e < e_hi; e += n_simd) {
    DEVICE_PTR(const uint4) wr4 = DEVICE_CAST(const uint4, w + size_t(e) * D);
    float acc[NU];
    UNROLL for (uint u = 0; u < NU; ++u) acc[u] = 0.0f;
    for (uint c0 = 0; c0 < NCH; c0 += NB * SIMD_SIZE) {
      uint4 q[NB];
      UNROLL for (uint u = 0; u < NB; ++u) {
        const uint c = c0 + u * SIMD_SIZE + lane;
        if (c < NCH) q[u] = wr4[c];
      }
      UNROLL for (uint u = 0; u < NB; ++u) {
        const uint c = c0 + u * SIMD_SIZE + lane;
        if (c >= NCH) continue;
        float wv[8];
        unpack16(q[u], WK, wv);
        UNROLL for (uint p = 0; p < VW; p += 4) {
          const float4 xv = xs4[(c * VW + p) / 4];
          acc[u % NU] = fma_f(wv[p], xv.x, acc[u % NU]);
          acc[u % NU] = fma_f(wv[p + 1], xv.y, acc[u % NU]);
          acc[u % NU] = fma_f(wv[p + 2], xv.z, acc[u % NU]);
          acc[u % NU] = fma_f(wv[p + 3], xv.w, acc[u % NU]);
        }
      }
    }
    float dot = 0.0f;
    UNROLL for (uint u = 0; u < NU; ++u) dot += acc[u];
    dot = simd_sum(dot);
    if (lane == 0) {
      lg[e] = to_float(from_float<LT>(dot));
      if (G > 1) ATOMIC_STORE_U32(lgo + size_t(row) * E + e, bitcast<uint>(lg[e]));
    }
  }
  constexpr uint QBS = QB ? QB : 8;  // (QB = 0 instantiations compile this loop, never run it)
  constexpr uint WPC = 32 / QBS;     // codes per word
  constexpr uint CPW = 4 * WPC;      // codes per chunk
  constexpr uint NCA = QB ? uint(D) / CPW : 0;
  constexpr uint NUA = 8;
  for (uint e = e_lo + simd_id; QB && e < e_hi; e += n_simd) {
    DEVICE_PTR(const uint4) wr4 = DEVICE_CAST(const uint4, w + size_t(e) * (uint(D) / WPC));
    const size_t g0 = size_t(e) * (uint(D) / GS);
    float acc[NUA];
    UNROLL for (uint u = 0; u < NUA; ++u) acc[u] = 0.0f;
    for (uint c0 = 0; c0 < NCA; c0 += NUA * SIMD_SIZE) {
      uint4 q[NUA];
      UNROLL for (uint u = 0; u < NUA; ++u) {
        const uint c = c0 + u * SIMD_SIZE + lane;
        if (c < NCA) q[u] = wr4[c];
      }
      UNROLL for (uint u = 0; u < NUA; ++u) {
        const uint c = c0 + u * SIMD_SIZE + lane;
        if (c >= NCA) continue;
        const uint wd[4] = {q[u].x, q[u].y, q[u].z, q[u].w};
        float d = 0.0f, sx = 0.0f;
        UNROLL for (uint j = 0; j < 4; ++j) {
          UNROLL for (uint p = 0; p < WPC; p += 4) {
            const float4 xv = xs4[(c * CPW + j * WPC + p) / 4];
            const float xq[4] = {xv.x, xv.y, xv.z, xv.w};
            UNROLL for (uint t = 0; t < 4; ++t) {
              const uint code = (wd[j] >> (QBS * (p + t))) & ((1u << QBS) - 1u);
              d = fma_f(float(code), xq[t], d);
              sx += xq[t];
            }
          }
        }
        const size_t g = g0 + c * CPW / GS;
        acc[u] = fma_f(to_float(w_scales[g]), d, fma_f(to_float(w_biases[g]), sx, acc[u]));
      }
    }
    float dot = 0.0f;
    UNROLL for (uint u = 0; u < NUA; ++u) dot += acc[u];
    dot = simd_sum(dot);
    if (lane == 0) {
      lg[e] = to_float(from_float<LT>(dot));
      if (G > 1) ATOMIC_STORE_U32(lgo + size_t(row) * E + e, bitcast<uint>(lg[e]));
    }
  }
  for (uint e = e_lo + simd_id; !VEC && !QB && e < e_hi; e += n_simd) {
    DEVICE_PTR(const TW) wr = w + size_t(e) * D;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // four chains: more loads in flight per lane
    for (uint i0 = 0; i0 < uint(D); i0 += 4 * SIMD_SIZE) {
      UNROLL for (int u = 0; u < 4; ++u) {
        const uint i = i0 + uint(u) * SIMD_SIZE + lane;
        if (i < uint(D)) acc[u] = fma_f(to_float(wr[i]), xs[i], acc[u]);
      }
    }
    const float dot = simd_sum((acc[0] + acc[1]) + (acc[2] + acc[3]));
    if (lane == 0) {
      lg[e] = to_float(from_float<LT>(dot));
      if (G > 1) ATOMIC_STORE_U32(lgo + size_t(row) * E + e, bitcast<uint>(lg[e]));
    }
  }
  if (G > 1) {
    // publish this group's logits device-wide before counting it in; the group that takes
    // the row's last ticket (G a power of two: the count stays a multiple of G across the
    // counter's wrap, and is never reset) reads every group's logits back. params[2]: which
    // of the plan's counter sets this call counts on (the dispatcher rotates them)
    BARRIER_DEVICE_FENCE();
    DEVICE_PTR(const uint) ctr = counter + size_t(params[2]) * MAX_ROWS + row;  // this call's set
    if (tid == 0) last[0] = (ATOMIC_ADD_U32(ctr, 1u) & uint(G - 1)) == uint(G - 1);
    BARRIER_DEVICE_FENCE();
    if (last[0] == 0u) return;  // the whole group leaves together
    for (uint e = tid; e < uint(E); e += tg_size)
      lg[e] = bitcast<float>(ATOMIC_LOAD_U32(lgo + size_t(row) * E + e));
  }
  BARRIER();
  if (simd_id != 0) return;
  // Top K: K rounds of a SIMD-wide argmax (largest logit, the lower expert index on ties) over
  // the lanes' experts lane, lane + 32, ...; `taken` marks the chosen ones in each lane.
  constexpr uint EPL = (uint(E) + 31) / 32;
  constexpr uint NONE = 0xFFFFFFFFu;
  float v[EPL];
  float lmax = -INF_F;
  UNROLL for (uint q = 0; q < EPL; ++q) {
    const uint e = lane + 32 * q;
    v[q] = e < uint(E) ? lg[e] : -INF_F;
    lmax = max_f(lmax, v[q]);
  }
  lmax = simd_max(lmax);
  float den = 0.0f;  // the full softmax's denominator (RENORM = 0)
  if (!RENORM) {
    UNROLL for (uint q = 0; q < EPL; ++q)
      if (lane + 32 * q < uint(E)) den += exp_f(v[q] - lmax);
    den = simd_sum(den);
  }
  uint taken = 0u;
  float sel_v[K];
  uint sel_i[K];
  UNROLL for (int s = 0; s < K; ++s) {
    float bv = -INF_F;
    uint bi = NONE;
    UNROLL for (uint q = 0; q < EPL; ++q) {
      const uint e = lane + 32 * q;
      if (e < uint(E) && !((taken >> q) & 1u) && (bi == NONE || v[q] > bv)) {
        bv = v[q];
        bi = e;
      }
    }
    const float m = simd_max(bv);
    const uint win = simd_min((bi != NONE && bv == m) ? bi : NONE);
    // NaN logits can leave no winner (NONE): its slots get id NONE and a NaN weight, which
    // the expert kernels turn into NaN rows without reading anything
    if (win < uint(E) && win % 32 == lane) taken |= 1u << (win / 32);
    sel_v[s] = m;
    sel_i[s] = win;
  }
  float tot = 0.0f;
  if (RENORM) {  // softmax over the chosen K; sel_v[0] is their max
    UNROLL for (int s = 0; s < K; ++s) tot += exp_f(sel_v[s] - sel_v[0]);
  }
  UNROLL for (int s = 0; s < K; ++s) {
    if (uint(s) != lane) continue;
    float wt = RENORM ? exp_f(sel_v[s] - sel_v[0]) / tot : exp_f(sel_v[s] - lmax) / den;
    if (sel_i[s] >= uint(E)) wt = bitcast<float>(0x7FC00000u);
    else if (PES) wt *= to_float(expert_scale[sel_i[s]]);
    ids[size_t(row) * K + s] = sel_i[s];
    wts[size_t(row) * K + s] = wt;
  }
"""

_WK = {mx.float32: 0, mx.float16: 1, mx.bfloat16: 2}

_kernel = Kernel(
    "moe_router",
    inputs=["x", "w", "w_scales", "w_biases", "pre_scale", "expert_scale", "post_norm", "res",
            "res_w", "res_next_w", "params", "counter"],
    outputs=["ids", "wts", "xn", "lgo", "h", "n"],
    body=_BODY,
    header=_HEADER,
    examples=[
        Example(
            {"x": t, "w": tw, "w_scales": t, "w_biases": t, "pre_scale": t, "expert_scale": t,
             "post_norm": t, "res": t, "res_w": t, "res_next_w": t, "params": (mx.float32, 3),
             "counter": (mx.uint32, 32 * 256)},
            {"ids": mx.uint32, "wts": mx.float32, "xn": t, "lgo": mx.float32, "h": t, "n": t},
            {"T": t, "TW": tw, "LT": lt, "D": d, "E": e, "K": k, "QB": qb, "GS": gs, "VEC": vec,
             "WK": _WK.get(tw, 0), "PRE": pre, "PES": pre, "NORM2": pre, "RENORM": renorm,
             "G": g, "NRW": min(16, e), "MAX_ROWS": 32, "BATCHED": 1,
             "W": 16 if g == 1 else 8, "RES": res, "TGP": threads_for(d),
             "NPTP": -(-d // threads_for(d))},
        )
        for t, tw, lt, d, e, k, qb, gs, vec, pre, renorm, g, res in (
            (mx.bfloat16, mx.bfloat16, mx.bfloat16, 2816, 128, 8, 0, 1, 1, 1, 1, 1, 0),
            (mx.bfloat16, mx.float32, mx.float32, 2816, 128, 8, 0, 1, 1, 1, 1, 16, 1),
            (mx.float16, mx.float32, mx.float32, 2048, 256, 8, 0, 1, 1, 0, 0, 64, 0),
            (mx.float32, mx.float16, mx.float32, 200, 40, 5, 0, 1, 0, 1, 1, 1, 1),
            (mx.bfloat16, mx.uint32, mx.bfloat16, 2048, 256, 8, 8, 64, 0, 0, 1, 16, 0),
        )
    ],
)  # fmt: skip

MAX_ROWS = 32  # token rows per call the kernel takes (decode); prefill runs the reference
# SIMD groups per threadgroup of the one-group-per-row mapping (G = 1): 512 threads keep 64 KB
# of weight loads in flight on one SM and leave each thread 128 registers (a 1024-thread
# launch fails past 64 on CUDA)
WARPS = 16
# The split mapping (G > 1): SIMD groups per threadgroup, and about how many SIMD groups the
# GPU holds at once (H200: 132 SMs x ~40 at this kernel's 48-54 registers a thread, NVRTC
# sm_90), past which each SIMD group takes more experts rather than the grid growing a wave.
# 8: alone on the H200 at 26B-A4B's router (2816 -> 128, top 8), CUPTI medians of 64 dependent
# calls: G = 1 21.8 us, 16 x 8 11.1 us, 32 x 4 14.8 us, 64 x 2 22.7 us (bench/kernel_floor.py)
SPLIT_WARPS = 8
RESIDENT_WARPS = 4096
SPLIT_MIN_WEIGHTS = 1 << 16  # E * D below this: one threadgroup per row is as fast
# HF2Q_ROUTER_SPLIT (read at import): 1 on, 0 off, unset: on for CUDA only. On the H200 the
# split is bit-identical to G = 1 (29 GPU tests at 16 x 8, 2026-12-03) and halves the router's
# kernel time inside the compiled 26B-A4B step (829 -> 479 us a token, CUPTI, 2026-12-03); on
# Metal its atomics are syntax-checked only, never run (docs/kernel_notes.md, session 17).
SPLIT: bool | None = {"1": True, "0": False}.get(os.environ.get("HF2Q_ROUTER_SPLIT", "").strip())
# HF2Q_ROUTER_BATCHED=0 (read at import): the row's loads in the loop form of sessions 13-41
# (a round of memory latency per element a thread owns), for A/B; same outputs bit for bit.
BATCHED_PROLOGUE: bool = os.environ.get("HF2Q_ROUTER_BATCHED", "").strip() != "0"
# HF2Q_ROUTER_JOIN (read at import): which MoE layers' join after attention the router kernel
# makes (models/ops). Unset / "auto": Qwen 3.5's residual add and norm (35B-A3B Q4_K graph
# decode 1.04x on an H100, session 42), not Gemma 4's post-norm join (26B-A4B 0.99x); "1":
# both; "0": neither.
JOIN: str = os.environ.get("HF2Q_ROUTER_JOIN", "").strip() or "auto"


def join_enabled(kind: str) -> bool:
    """Whether the router kernel makes the join of ``kind``: "post_norm" (Gemma 4) or
    "residual" (Qwen 3.5), per ``JOIN``."""
    if JOIN not in ("auto", "0", "1"):
        raise InvalidArgumentError(f"HF2Q_ROUTER_JOIN must be auto, 0 or 1, not {JOIN!r}")
    return JOIN == "1" or (JOIN == "auto" and kind == "residual")


def split_enabled() -> bool:
    """Whether the dispatcher splits wide routers: ``SPLIT``, or when unset, a CUDA back end."""
    return SPLIT if SPLIT is not None else backend() == "cuda"


COUNTER_SETS = 256  # the split's ticket counters rotate over this many sets per plan (_Plan)
MAX_K = 32  # the top-k rounds keep one lane per chosen expert
MAX_E = 1024  # `taken` holds 32 experts per lane
_SHARED_BYTES = 30 * 1024  # xs (D floats) + logits (E floats), under Metal's 32 KB
_FLOATS = (mx.float32, mx.float16, mx.bfloat16)
_OPTIONAL = ("pre_scale", "expert_scale", "post_norm")


def _matmul_dtype(a: mx.Dtype, b: mx.Dtype) -> mx.Dtype:
    """The dtype ``h @ w.T`` returns (MLX promotes fp16 with bf16 to fp32)."""
    return a if a == b else mx.float32


def kernel_covers(x: mx.array, w: mx.array, k: int, **opts) -> bool:
    """True when :func:`moe_router` (same arguments) runs its kernel: a GPU, 1..32 rows, a float
    or affine-quantized (4/8 bits) weight, the sizes it holds in shared memory."""
    D, E = x.shape[-1], w.shape[0]
    quant = opts.get("quant")
    if quant is None:
        w_ok = w.ndim == 2 and w.dtype in _FLOATS
    else:
        scales, biases, gs, bits = quant
        w_ok = (
            bits in (4, 8)
            and gs % (128 // bits) == 0  # a 16-byte chunk of codes within one group
            and w.dtype == mx.uint32
            and w.shape == (E, D * bits // 32)
            and biases is not None
            and scales.dtype in _FLOATS
            and biases.dtype == scales.dtype
            and D % gs == 0
            and scales.shape == biases.shape == (E, D // gs)
        )
    same = all(opts.get(n) is None or opts[n].dtype == x.dtype for n in ("pre_scale", "post_norm"))
    es = opts.get("expert_scale")
    return (
        backend() is not None
        and w_ok
        and x.dtype in _FLOATS
        and same
        and (es is None or es.dtype in _FLOATS)
        and 1 <= math.prod(x.shape[:-1]) <= MAX_ROWS
        and 1 <= k <= min(E, MAX_K)
        and E <= MAX_E
        and 4 * (D + E + 32) <= _SHARED_BYTES
        and _residual_covered(x, opts.get("residual"))
    )


def _residual_covered(x: mx.array, residual: tuple | None) -> bool:
    """The block join runs in the kernel: a residual stream like x, float norm weights (D,),
    rows the joining kernels take."""
    if residual is None:
        return True
    res, *norms = residual
    D = x.shape[-1]
    return (
        res.shape == x.shape
        and res.dtype == x.dtype
        and all(v.shape == (D,) and v.dtype in _FLOATS for v in norms if v is not None)
        and D <= 8192
    )


def _check(x: mx.array, w: mx.array, k: int, opts: dict) -> None:
    """Caller errors: shapes that cannot belong together."""
    quant = opts.get("quant")
    D = w.shape[-1] if quant is None else w.shape[-1] * 32 // quant[3]  # the weight's width
    if w.ndim != 2 or D != x.shape[-1]:
        raise WeightMismatchError(
            f"router weight {tuple(w.shape)} does not match x's {x.shape[-1]} features"
        )
    if not 1 <= k <= w.shape[0]:
        raise InvalidArgumentError(f"top-k {k} is not in 1..{w.shape[0]} experts")
    for name, n in zip(_OPTIONAL, (D, w.shape[0], D)):
        a = opts.get(name)
        if a is not None and a.shape != (n,):
            raise WeightMismatchError(f"{name} has shape {tuple(a.shape)}, expected ({n},)")
    residual = opts.get("residual")
    if residual is not None:
        res, res_w, res_next_w = residual
        if res.shape != x.shape:
            raise InvalidArgumentError(f"residual {res.shape} and branch {x.shape} differ")
        for name, a in (("res_w", res_w), ("res_next_w", res_next_w)):
            if a is not None and a.shape != (D,):
                raise WeightMismatchError(f"{name} has shape {tuple(a.shape)}, expected ({D},)")


def split_config(rows: int, E: int, D: int) -> tuple[int, int]:
    """The launch mapping for ``rows`` token rows over E experts of width D: (G threadgroups
    per row, SIMD groups per threadgroup). G = 1 is one threadgroup of min(WARPS, E) SIMD
    groups per row; G > 1 (a power of two) spreads a row's experts over G threadgroups of at
    most SPLIT_WARPS, one expert per SIMD group while the grid fits about one wave."""
    if not split_enabled() or E * D < SPLIT_MIN_WEIGHTS:
        return 1, min(WARPS, E)
    per_warp = -(-rows * E // RESIDENT_WARPS)  # experts per SIMD group
    g = 1 << (max(1, E // (SPLIT_WARPS * per_warp)).bit_length() - 1)  # a power of two
    return (g, min(SPLIT_WARPS, -(-E // g))) if g > 1 else (1, min(WARPS, E))


def _mapping(E: int, split: int | tuple[int, int]) -> tuple[int, int]:
    """``split`` G or (G, SIMD groups) -> (G, SIMD groups), checked."""
    g, warps = split if isinstance(split, tuple) else (split, None)
    if g < 1 or g & (g - 1) or g > E:
        raise InvalidArgumentError(f"router split {g}: a power of two in 1..{E} experts")
    if warps is None:
        warps = min(WARPS, E) if g == 1 else min(SPLIT_WARPS, -(-E // g))
    if not 1 <= warps <= 32:
        raise InvalidArgumentError(f"router split: {warps} SIMD groups, not 1..32")
    return g, warps


def _plan(x: mx.array, w: mx.array, k: int, opts: dict, init_value=None, split=None):
    D, E = x.shape[-1], w.shape[0]
    rows = math.prod(x.shape[:-1])
    lead = tuple(x.shape[:-1])
    quant = opts.get("quant")
    scales = x if quant is None else quant[0]
    arrays = _arrays(x, w, opts)
    lt = _matmul_dtype(x.dtype, w.dtype if quant is None else scales.dtype)
    post = opts.get("post_norm") is not None
    res = _res_mode(opts)
    g, warps = split_config(rows, E, D) if split is None else _mapping(E, split)
    tgp = threads_for(D)
    launch = _kernel.launcher(
        [a.dtype for a in arrays] + [mx.float32, mx.uint32],
        grid=(rows * g * 32 * warps,),
        threadgroup=(32 * warps,),
        output_shapes=[(*lead, k), (*lead, k), x.shape if post else (1,),
                       (rows, E) if g > 1 else (1,), x.shape if res else (1,),
                       x.shape if res else (1,)],
        output_dtypes=[mx.uint32, mx.float32, x.dtype, mx.float32, x.dtype, x.dtype],
        template={"T": x.dtype, "TW": w.dtype, "LT": lt, "D": D, "E": E, "K": k,
                  "QB": 0 if quant is None else quant[3], "GS": 1 if quant is None else quant[2],
                  "VEC": quant is None and D % (16 // w.dtype.size) == 0,
                  "WK": _WK.get(w.dtype, 0),
                  "PRE": opts.get("pre_scale") is not None,
                  "PES": opts.get("expert_scale") is not None, "NORM2": post,
                  "RENORM": bool(opts.get("renormalize", True)),
                  "G": g, "NRW": min(WARPS, E), "MAX_ROWS": MAX_ROWS,
                  "BATCHED": BATCHED_PROLOGUE, "W": warps, "RES": res, "TGP": tgp,
                  "NPTP": -(-D // tgp)},
        init_value=init_value,
    )  # fmt: skip
    # pre_mult rounded to x's dtype, as ``array * python_float`` rounds it. Leaf arrays made
    # from Python numbers, so a plan first built inside mx.compile holds no traced op.
    mult = _round_to(opts.get("pre_mult", 1.0), x.dtype)
    return _Plan(launch, [opts.get("eps", 1e-6), mult], post, g > 1, res)


class _Plan:
    """One call shape's resolved launch and leaf inputs.

    ``counter`` (split plans): the rows' tickets, COUNTER_SETS sets of MAX_ROWS, kept across
    launches: each launch adds G to each of its rows' counts in one set, so a count stays a
    multiple of G and never needs zeroing (a fill would be a launch of its own). Two launches
    counting on one set must not run at once, and MLX orders launches only through data (an
    input that launches only read orders nothing: independent rows of a SequentialStep, or
    prompts prefilled together, may run at once). So calls rotate over the sets (params[2]
    names the set): two calls share one only if COUNTER_SETS calls of this shape were made
    between them, more than one command buffer holds (MLX_MAX_OPS_PER_BUFFER) in MLX's
    evaluation order, which follows the calls'. Metal: an input of fewer than 8 elements
    would be in the read-only constant address space."""

    __slots__ = ("launch", "params", "counter", "post", "turn", "res")

    def __init__(
        self, launch, scalars: list[float], post: bool, split: bool, res: bool = False
    ) -> None:
        self.launch, self.post, self.turn, self.res = launch, post, 0, res
        sets = COUNTER_SETS if split else 1
        self.params = [mx.array([*scalars, i], dtype=mx.float32) for i in range(sets)]
        self.counter = mx.array(np.zeros(sets * MAX_ROWS, dtype=np.uint32))

    def next_params(self) -> mx.array:
        i = self.turn
        self.turn = i + 1 if i + 1 < len(self.params) else 0
        return self.params[i]


def _res_mode(opts: dict) -> int:
    """The kernel's RES: 0 no join, 1 Gemma's post-norm join (res, w, next_w), 2 Qwen's residual
    add and norm (res, w, None)."""
    residual = opts.get("residual")
    return 0 if residual is None else 2 if residual[2] is None else 1


def _arrays(x: mx.array, w: mx.array, opts: dict) -> list[mx.array]:
    """The kernel's array inputs but params and counter; x stands in for the absent ones
    (never read)."""
    quant = opts.get("quant")
    sb = [x, x] if quant is None else [quant[0], quant[1]]
    res = opts.get("residual") or (x, x, x)
    res = (res[0], res[1], res[1] if res[2] is None else res[2])
    return [x, w, *sb, *(x if opts.get(n) is None else opts[n] for n in _OPTIONAL), *res]


def _run(plan: _Plan, x: mx.array, w: mx.array, opts: dict):
    # a recorded CUDA graph runs its launches in stream order: one counter set serves them all
    params = plan.params[0] if launch_recorder.active() else plan.next_params()
    inputs = [*_arrays(x, w, opts), params, plan.counter]
    ids, wts, xn, _, h, n = plan.launch(inputs=inputs)
    out = (ids, wts, xn if plan.post else None)
    return (*out, h, n) if plan.res else out


def _round_to(v: float, dtype: mx.Dtype) -> float:
    """``v`` rounded to nearest-even in ``dtype`` (fp32, fp16 or bf16), as a Python float."""
    if dtype == mx.float16:
        return float(np.float16(v))
    f = np.array([v], dtype=np.float32)
    if dtype == mx.bfloat16:
        b = f.view(np.uint32)
        b[:] = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return float(f[0])


def moe_router_kernel(
    x: mx.array,
    w: mx.array,
    k: int,
    *,
    init_value: float | None = None,
    split: int | tuple[int, int] | None = None,
    **opts,
) -> tuple[mx.array, mx.array, mx.array | None]:
    """The GPU kernel alone (tests: no plan cache, no fallback) with the contract and keyword
    arguments of :func:`moe_router_reference`; ``init_value`` pre-fills the outputs; ``split``:
    G threadgroups per row (a power of two; 1: one threadgroup per row) or (G, SIMD groups
    per threadgroup), default :func:`split_config`'s."""
    return _run(_plan(x, w, k, opts, init_value, split), x, w, opts)


def plan_launcher(
    x: mx.array, w: mx.array, k: int, *, split: int | tuple[int, int] | None = None, **opts
):
    """A resolved launch for these arguments' shapes (benchmarks: time one mapping against
    another without the dispatcher): ``f(x, w)`` -> :func:`moe_router`'s outputs."""
    plan = _plan(x, w, k, opts, None, split)
    return lambda x_, w_: _run(plan, x_, w_, opts)


_PLANS: dict[tuple, _Plan] = {}


def _key(x: mx.array, w: mx.array, k: int, opts: dict) -> tuple:
    sig = [(a.shape, a.dtype) for a in _arrays(x, w, opts)]
    quant = opts.get("quant")
    scalars = tuple(opts.get(n) for n in ("eps", "pre_mult", "renormalize"))
    return (_kernel, k, *sig, scalars, None if quant is None else quant[2:], split_enabled(),
            BATCHED_PROLOGUE, *(opts.get(n) is None for n in _OPTIONAL),
            _res_mode(opts))  # fmt: skip


def moe_router(
    x: mx.array, w: mx.array, k: int, **opts
) -> tuple[mx.array, mx.array, mx.array | None]:
    """Dispatcher with the contract and keyword arguments of :func:`moe_router_reference`: one
    kernel launch on a GPU for 1..32 token rows and a float or affine router weight, the
    reference otherwise."""
    be = backend()
    if be is not None:
        key = _key(x, w, k, opts)
        plan = _PLANS.get(key)
        if plan is not None:
            return _run(plan, x, w, opts)
    _check(x, w, k, opts)
    if be is None or not kernel_covers(x, w, k, **opts):
        return moe_router_reference(x, w, k, **opts)
    plan = _PLANS[key] = _plan(x, w, k, opts)
    return _run(plan, x, w, opts)
