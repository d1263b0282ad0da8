"""Attention of a few new tokens per row over a preallocated (static) KV cache, masks in-kernel.

The compiled decode step keeps each row's keys and values in fixed buffers: full attention in
slots 0..capacity-1, sliding windows in a ring (slot = position % capacity). This op reads the
first ``span`` slots, works out each slot's absolute position from the row's position, and
attends the visible ones (causal, inside the window) in one launch, where the MLX graph needs
the mask arithmetic, two matmuls and a softmax.
"""

from __future__ import annotations

import os
from functools import lru_cache

import mlx.core as mx
import numpy as np

from hf2q_mlx.custom_kernels import (
    backend,
    device_array,
    int_setting,
    int_tuple_setting,
    launch_recorder,
)
from hf2q_mlx.custom_kernels._render import Example, Kernel
from hf2q_mlx.errors import InvalidArgumentError


def ring_slot_positions(offset, capacity: int, span: int | None = None) -> mx.array:
    """Absolute position held by each of the first ``span`` (default all) slots of a ring of
    ``capacity`` slots after ``offset`` writes, slot = position % capacity (negative = empty);
    a growing buffer is the case capacity >= offset. ``offset``: an int, or (B, 1) per row."""
    i = mx.arange(capacity if span is None else span)
    return (offset - 1) - ((offset - 1 - i) % capacity)


def key_positions(pos: mx.array, L: int, span: int, capacity: int, ring: bool) -> mx.array:
    """(B, span) absolute position held by each of the first ``span`` slots once the L new
    tokens of every row are written at positions pos..pos+L-1 (negative = empty)."""
    end = pos[:, None] + L  # (B, 1): tokens held after the write
    if ring:
        return ring_slot_positions(end, capacity, span)
    i = mx.arange(span)[None]
    return mx.where(i < end, i, -1)


def visible(pos: mx.array, L: int, span: int, capacity: int, window: int | None) -> mx.array:
    """(B, 1, L, span) bool: query l of row b (position pos[b] + l) sees slot s."""
    q_pos = pos[:, None] + mx.arange(L)[None]  # (B, L)
    k_pos = key_positions(pos, L, span, capacity, window is not None)[:, None, :]  # (B, 1, S)
    mask = (k_pos >= 0) & (k_pos <= q_pos[:, :, None])
    if window is not None:
        mask = mask & (k_pos > q_pos[:, :, None] - window)
    return mask[:, None]


def decode_attention_reference(
    q: mx.array,
    keys: mx.array,
    values: mx.array,
    pos: mx.array,
    scale: float,
    span: int,
    window: int | None = None,
) -> mx.array:
    """q (B, Hq, L, D), keys (B, Hk, C, D), values (B, Hk, C, Dv) holding the L new tokens
    already, pos (B,) int32 tokens each row held before them -> (B, Hq, L, Dv) in q's dtype.
    ``window`` None: full attention over slots 0..span-1; else a ring of C slots."""
    C = keys.shape[2]
    mask = visible(pos, q.shape[2], span, C, window)
    k, v = keys[:, :, :span], values[:, :, :span]
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


_HEADER = """
// Absolute position held by slot s once a row holds ``end`` tokens: a ring of cap slots
// (slot = position % cap) or a growing buffer (slot = position); -1 for an empty slot.
FN int slot_position(int s, int end, int cap, bool ring) {
  if (ring) {
    int r = (end - 1 - s) % cap;
    if (r < 0) r += cap;
    return end - 1 - r;
  }
  return s < end ? s : -1;
}
"""

# Template: T, D, DV, REP (query heads per KV head), G (query heads per threadgroup, a divisor
# of REP), L, SPAN, CAP, RING, WIN, W (SIMD groups), P (parts of the span), CHUNK (slots a part),
# VEC (a lane's elements contiguous: vector loads), BF (T is bf16), PF (two slots in flight),
# VW (the part's W SIMD groups taken VW at a time by each of W / VW physical ones: the same bits).
_BODY = """
  // One threadgroup per (row group = (b, query heads h0 .. h0 + G - 1 of one KV head, token l),
  // part of the span); its W SIMD groups take the part's slots s = first + simd_id, + W, ...;
  // lane j holds q/o elements j, j + 32, ... of each of the G heads, which share each key and
  // value read. Each SIMD group keeps an online softmax per head (max, sum, weighted values);
  // the groups merge at the end, head after head, into the output (P == 1) or into the part's
  // (max, sum, values); with P > 1 the part of a row group that finishes last merges its P
  // parts into the output (no second launch). A head's arithmetic is the same at any G.
  // VEC: lane j holds elements j * EK .. j * EK + EK - 1 instead (16-bit T, D == DV, EK a
  // multiple of 4: 8- or 16-byte loads). PF: two slots of a SIMD group loaded before either
  // is scored (the same order of additions as one at a time).
  // VW > 1 (a batch of many rows, default loads): the W SIMD groups of the arithmetic are
  // virtual; physical group simd_id runs virtual groups simd_id + (W / VW) * v one after the
  // other, parks each one's (max, sum, values) in shared memory, and the merge reads them in
  // the same order as W physical groups: the same bits with W / VW times fewer threads.
  constexpr int EK = (D + 31) / 32;
  constexpr int EV = (DV + 31) / 32;
  constexpr int NS = PF ? 2 : 1;
  constexpr int CH = 128;  // output dims merged per pass through shared memory
  constexpr int WP = W / VW;  // physical SIMD groups
  SHARED float wm[G * W];
  SHARED float wl[G * W];
  SHARED float wo[VW == 1 ? W * CH : 1];
  SHARED float parked[VW == 1 ? 1 : G * W * EV * 32];  // [g][virtual group][e][lane]
  SHARED uint last_part[1];
  const int Hq = int(dims[0]);
  const int grp = int(gid_x);  // (b * (Hq / G) + h0 / G) * L + l
  const int part = int(gid_y);
  const int l = grp % L;
  const int h0 = (grp / L) % (Hq / G) * G;
  const int b = grp / (L * (Hq / G));
  const int hk = h0 / REP;
  const int Hk = Hq / REP;
  const float sc = scale[0];
  const int p0 = int(pos[b]);
  const int end = p0 + L;
  const int qp = p0 + l;
  float qv[G][EK];
  float o[G][EV];
  float m[G];
  float den[G];
  UNROLL for (int g = 0; g < G; ++g) {
    const uint64_t row = uint64_t((b * Hq + h0 + g) * L + l);
    UNROLL for (int e = 0; e < EK; ++e) {
      const int i = VEC ? int(lane) * EK + e : int(lane) + 32 * e;
      qv[g][e] = i < D ? to_float(q[row * D + i]) * sc : 0.0f;
    }
    UNROLL for (int e = 0; e < EV; ++e) o[g][e] = 0.0f;
    m[g] = -INF_F;
    den[g] = 0.0f;
  }
  const uint64_t kbase = uint64_t(b * Hk + hk) * CAP;
  const int last = (part + 1) * CHUNK < SPAN ? (part + 1) * CHUNK : SPAN;
  // The default (one slot at a time, a lane's elements 32 apart) keeps its own loop: the
  // two-slot loop below at one slot costs it registers (nvcc sm_90: 56 against 48, 26B-A4B's
  // sliding layer; 89 against 72 global, one threadgroup an SM fewer).
  if (!VEC && !PF) {
    for (int v = 0; v < VW; ++v) {  // VW == 1: once, simd_id's own slots
    const int vw = int(simd_id) + WP * v;
    if (VW > 1) {
      UNROLL for (int g = 0; g < G; ++g) {
        UNROLL for (int e = 0; e < EV; ++e) o[g][e] = 0.0f;
        m[g] = -INF_F;
        den[g] = 0.0f;
      }
    }
    for (int s = part * CHUNK + vw; s < last; s += W) {
      const int kp = slot_position(s, end, CAP, RING);
      if (kp < 0 || kp > qp || (WIN > 0 && kp <= qp - WIN)) continue;  // uniform in the group
      const uint64_t ko = (kbase + uint64_t(s)) * D;
      const uint64_t vo = (kbase + uint64_t(s)) * DV;
      float vv[EV];
      UNROLL for (int e = 0; e < EV; ++e) {  // issued before the score needs them
        const int i = int(lane) + 32 * e;
        vv[e] = i < DV ? to_float(values[vo + i]) : 0.0f;
      }
      float kv[EK];
      UNROLL for (int e = 0; e < EK; ++e) {
        const int i = int(lane) + 32 * e;
        kv[e] = i < D ? to_float(keys[ko + i]) : 0.0f;
      }
      UNROLL for (int g = 0; g < G; ++g) {
        float part_dot = 0.0f;
        UNROLL for (int e = 0; e < EK; ++e) {
          if (int(lane) + 32 * e < D) part_dot += qv[g][e] * kv[e];
        }
        const float score = simd_sum(part_dot);
        const float m2 = max_f(m[g], score);
        const float fix = exp_f(m[g] - m2);
        const float p = exp_f(score - m2);
        den[g] = den[g] * fix + p;
        UNROLL for (int e = 0; e < EV; ++e) o[g][e] = o[g][e] * fix + p * vv[e];
        m[g] = m2;
      }
    }
    if (VW > 1) {
      UNROLL for (int g = 0; g < G; ++g) {
        if (lane == 0) {
          wm[g * W + vw] = m[g];
          wl[g * W + vw] = den[g];
        }
        UNROLL for (int e = 0; e < EV; ++e)
          parked[((g * W + vw) * EV + e) * 32 + int(lane)] = o[g][e];
      }
    }
    }
  } else {
    for (int s0 = part * CHUNK + int(simd_id); s0 < last; s0 += W * NS) {
      bool vis[NS];
      float kv[NS][EK];
      float vv[NS][EV];
      UNROLL for (int j = 0; j < NS; ++j) {
        const int s = s0 + j * W;
        const int kp = s < last ? slot_position(s, end, CAP, RING) : -1;
        vis[j] = !(kp < 0 || kp > qp || (WIN > 0 && kp <= qp - WIN));  // uniform in the group
        if (!vis[j]) continue;
        const uint64_t ko = (kbase + uint64_t(s)) * D;
        const uint64_t vo = (kbase + uint64_t(s)) * DV;
        if (VEC && EK % 8 == 0) {  // 16-byte loads: 8 elements each
          UNROLL for (int c = 0; c < EK / 8; ++c) {  // values first: issued before the score
            const uint4 a = DEVICE_CAST(const uint4, values + vo + int(lane) * EK)[c];
            const uint4 b = DEVICE_CAST(const uint4, keys + ko + int(lane) * EK)[c];
            const uint aw[4] = {a.x, a.y, a.z, a.w};
            const uint bw[4] = {b.x, b.y, b.z, b.w};
            UNROLL for (int h = 0; h < 8; ++h) {
              const ushort ab = ushort(h % 2 ? aw[h / 2] >> 16 : aw[h / 2] & 0xffffu);
              const ushort bb = ushort(h % 2 ? bw[h / 2] >> 16 : bw[h / 2] & 0xffffu);
              vv[j][8 * c + h] = BF ? bf16_bits_to_float(ab) : f16_bits_to_float(ab);
              kv[j][8 * c + h] = BF ? bf16_bits_to_float(bb) : f16_bits_to_float(bb);
            }
          }
        } else if (VEC) {  // 8-byte loads: 4 elements each
          UNROLL for (int c = 0; c < EK / 4; ++c) {
            const uint2 a = DEVICE_CAST(const uint2, values + vo + int(lane) * EK)[c];
            const uint2 b = DEVICE_CAST(const uint2, keys + ko + int(lane) * EK)[c];
            const uint aw[2] = {a.x, a.y};
            const uint bw[2] = {b.x, b.y};
            UNROLL for (int h = 0; h < 4; ++h) {
              const ushort ab = ushort(h % 2 ? aw[h / 2] >> 16 : aw[h / 2] & 0xffffu);
              const ushort bb = ushort(h % 2 ? bw[h / 2] >> 16 : bw[h / 2] & 0xffffu);
              vv[j][4 * c + h] = BF ? bf16_bits_to_float(ab) : f16_bits_to_float(ab);
              kv[j][4 * c + h] = BF ? bf16_bits_to_float(bb) : f16_bits_to_float(bb);
            }
          }
        } else {
          UNROLL for (int e = 0; e < EV; ++e) {  // issued before the score needs them
            const int i = int(lane) + 32 * e;
            vv[j][e] = i < DV ? to_float(values[vo + i]) : 0.0f;
          }
          UNROLL for (int e = 0; e < EK; ++e) {
            const int i = int(lane) + 32 * e;
            kv[j][e] = i < D ? to_float(keys[ko + i]) : 0.0f;
          }
        }
      }
      UNROLL for (int j = 0; j < NS; ++j) {
        if (!vis[j]) continue;
        UNROLL for (int g = 0; g < G; ++g) {
          float part_dot = 0.0f;
          UNROLL for (int e = 0; e < EK; ++e) {
            if (VEC || int(lane) + 32 * e < D) part_dot += qv[g][e] * kv[j][e];
          }
          const float score = simd_sum(part_dot);
          const float m2 = max_f(m[g], score);
          const float fix = exp_f(m[g] - m2);
          const float p = exp_f(score - m2);
          den[g] = den[g] * fix + p;
          UNROLL for (int e = 0; e < EV; ++e) o[g][e] = o[g][e] * fix + p * vv[j][e];
          m[g] = m2;
        }
      }
    }
  }
  if (VW == 1 && lane == 0) {
    UNROLL for (int g = 0; g < G; ++g) {
      wm[g * W + int(simd_id)] = m[g];
      wl[g * W + int(simd_id)] = den[g];
    }
  }
  BARRIER();
  // a part's (max, sum, values) go out as coherent stores: the row's last part reads them back
  DEVICE_PTR(uint) pm_bits = DEVICE_CAST(uint, pm);
  DEVICE_PTR(uint) pl_bits = DEVICE_CAST(uint, pl);
  DEVICE_PTR(uint) po_bits = DEVICE_CAST(uint, po);
  UNROLL for (int g = 0; g < G; ++g) {
    const int row = (b * Hq + h0 + g) * L + l;
    float M = -INF_F;
    for (int w = 0; w < W; ++w) M = max_f(M, wm[g * W + w]);
    float total = 0.0f;
    for (int w = 0; w < W; ++w)
      total += wm[g * W + w] == -INF_F ? 0.0f : wl[g * W + w] * exp_f(wm[g * W + w] - M);
    const float own = m[g] == -INF_F ? 0.0f : exp_f(m[g] - M);
    const float inv = (P == 1 && total > 0.0f) ? 1.0f / total : 1.0f;
    const uint64_t prow = uint64_t(row) * P + part;
    if (P > 1 && tid == 0) {
      ATOMIC_STORE_U32(pm_bits + prow, bitcast<uint>(M));
      ATOMIC_STORE_U32(pl_bits + prow, bitcast<uint>(total));
    }
    if (VW > 1) {
      // the parked groups: each physical group scales its own virtual groups' values by their
      // weight in place (a rounded product, as the W-group merge stores it in wo), then
      // thread t sums element t of every group in group order
      for (int v = 0; v < VW; ++v) {
        const int vw = int(simd_id) + WP * v;
        const float mw = wm[g * W + vw];
        const float own_w = mw == -INF_F ? 0.0f : exp_f(mw - M);
        UNROLL for (int e = 0; e < EV; ++e) {
          const int k = ((g * W + vw) * EV + e) * 32 + int(lane);
          parked[k] = parked[k] * own_w;
        }
      }
      BARRIER();
      for (int i = int(tid); i < DV; i += int(tg_size)) {
        float acc = 0.0f;
        for (int w = 0; w < W; ++w) acc += parked[((g * W + w) * EV + i / 32) * 32 + i % 32];
        if (P == 1) {
          out[uint64_t(row) * DV + i] = from_float<T>(acc * inv);
        } else {
          ATOMIC_STORE_U32(po_bits + prow * DV + i, bitcast<uint>(acc));
        }
      }
      continue;
    }
    UNROLL for (int e = 0; e < EV; ++e) {
      const int i0 = 32 * e;  // this pass merges dims i0 .. i0 + 31 of every group (CH >= 32)
      if (e % (CH / 32) == 0) BARRIER();
      wo[int(simd_id) * CH + (i0 % CH) + int(lane)] = o[g][e] * own;
      if (e % (CH / 32) == CH / 32 - 1 || e == EV - 1) {
        BARRIER();
        const int base = i0 - (i0 % CH);
        for (int t = int(tid); t < CH; t += int(tg_size)) {
          // slot t of the pass holds element base / 32 + t / 32 of lane t % 32
          const int i = VEC ? (t % 32) * EV + base / 32 + t / 32 : base + t;
          if (i >= DV || t > (i0 % CH) + 31) continue;
          float acc = 0.0f;
          for (int w = 0; w < W; ++w) acc += wo[w * CH + t];
          if (P == 1) {
            out[uint64_t(row) * DV + i] = from_float<T>(acc * inv);
          } else {
            ATOMIC_STORE_U32(po_bits + prow * DV + i, bitcast<uint>(acc));
          }
        }
      }
    }
  }
  if (P > 1) {
    // Count this part in on the row group's counter (set cset[0] of the plan's, dims[1] a
    // set). The part taking ticket P - 1 zeroes the counter for the next call and merges each
    // head's P parts (max, sum, values), rescaled to the largest max and summed in part order
    // (thread t owns output dims t, t + tg_size, ...); the others leave.
    BARRIER_DEVICE_FENCE();
    if (tid == 0) {
      DEVICE_PTR(uint) ctr = DEVICE_CAST(uint, counter) + size_t(cset[0]) * uint(dims[1]) + grp;
      const uint ticket = ATOMIC_ADD_U32(ctr, 1u);
      last_part[0] = ticket == uint(P - 1) ? 1u : 0u;
      if (ticket == uint(P - 1)) ATOMIC_STORE_U32(ctr, 0u);
    }
    BARRIER_DEVICE_FENCE();
    if (last_part[0] == 0u) return;  // the whole threadgroup leaves together
    for (int g = 0; g < G; ++g) {
      const int row = (b * Hq + h0 + g) * L + l;
      const uint64_t r0 = uint64_t(row) * P;
      float mx_all = -INF_F;
      for (int j = 0; j < P; ++j)
        mx_all = max_f(mx_all, bitcast<float>(ATOMIC_LOAD_U32(pm_bits + r0 + j)));
      float sum_all = 0.0f;
      float wj[P];
      UNROLL for (int j = 0; j < P; ++j) {
        const float mj = bitcast<float>(ATOMIC_LOAD_U32(pm_bits + r0 + j));
        wj[j] = mj == -INF_F ? 0.0f : exp_f(mj - mx_all);
        sum_all += wj[j] * bitcast<float>(ATOMIC_LOAD_U32(pl_bits + r0 + j));
      }
      const float inv_all = sum_all > 0.0f ? 1.0f / sum_all : 0.0f;
      for (int i = int(tid); i < DV; i += int(tg_size)) {
        float acc = 0.0f;
        UNROLL for (int j = 0; j < P; ++j)
          acc += wj[j] * bitcast<float>(ATOMIC_LOAD_U32(po_bits + (r0 + j) * DV + i));
        out[uint64_t(row) * DV + i] = from_float<T>(acc * inv_all);
      }
    }
  }
"""

_kernel = Kernel(
    "decode_attention",
    inputs=["q", "keys", "values", "pos", "scale", "dims", "counter", "cset"],
    outputs=["out", "pm", "pl", "po"],
    body=_BODY,
    header=_HEADER,
    examples=[
        Example(
            {"q": t, "keys": t, "values": t, "pos": (mx.int32, 2), "scale": (mx.float32, 1),
             "dims": (mx.int32, 2), "counter": (mx.uint32, 64), "cset": (mx.int32, 1)},
            {"out": t, "pm": mx.float32, "pl": mx.float32, "po": mx.float32},
            {"T": t, "D": d, "DV": d, "REP": rep, "G": g, "L": l, "SPAN": 256, "CAP": cap,
             "RING": ring, "WIN": win, "W": w, "P": parts, "CHUNK": -(-256 // parts),
             "VEC": vec, "BF": int(t == mx.bfloat16), "PF": pf, "VW": vw},
        )
        for t, d, rep, g, l, cap, ring, win, w, parts, vec, pf, vw in (
            (mx.bfloat16, 256, 2, 2, 1, 1024, 0, 0, 32, 8, 0, 0, 1),
            (mx.float32, 80, 1, 1, 3, 260, 1, 256, 8, 1, 0, 1, 1),
            (mx.float16, 512, 8, 2, 1, 1024, 1, 1024, 16, 4, 1, 1, 1),
            (mx.bfloat16, 128, 2, 1, 1, 1024, 1, 1024, 8, 4, 1, 0, 1),
            (mx.bfloat16, 256, 2, 1, 1, 1024, 1, 1024, 16, 16, 0, 0, 8),
            (mx.float32, 80, 1, 1, 3, 260, 0, 0, 8, 1, 0, 0, 4),
        )
    ],
)  # fmt: skip

_FLOATS = (mx.float32, mx.float16, mx.bfloat16)


def decode_attention(
    q: mx.array,
    keys: mx.array,
    values: mx.array,
    pos: mx.array,
    scale: float,
    span: int,
    window: int | None = None,
    merge_heads: bool = False,
) -> mx.array:
    """Dispatcher for ``decode_attention_reference`` (same arguments): one kernel launch on a
    GPU for up to 16 query tokens per row, the reference elsewhere. ``merge_heads``: the output
    as (B, L, Hq * Dv), the layout the output projection reads (one token per row: the
    kernel's own (B, Hq, 1, Dv) memory, so no transpose or reshape node)."""
    B, Hq, L, D = q.shape
    Bk, Hk, C, Dk = keys.shape
    if Bk != B or Dk != D or values.shape[:3] != keys.shape[:3] or Hk == 0 or Hq % Hk:
        raise ValueError(f"q {q.shape}, keys {keys.shape}, values {values.shape} do not match")
    if not 0 < span <= C or pos.shape != (B,):
        raise ValueError(f"span {span} of {C} slots, pos {pos.shape} for {B} rows")
    be = backend()
    if be is not None:
        sig = (q.dtype, keys.dtype, values.dtype, pos.dtype)
        flat = merge_heads and L == 1
        plan = _plan(_kernel, be, q.shape, C, values.shape[-1], Hq // Hk, span, window, scale,
                     sig, flat, load_flags(LOADS_RAW))  # fmt: skip
        if plan is not None:
            out = plan.launch(inputs=[q, keys, values, pos, *plan.inputs()])[0]
            return out if flat or not merge_heads else heads_merged(out)
    out = decode_attention_reference(q, keys, values, pos, scale, span, window)
    return heads_merged(out) if merge_heads else out


def heads_merged(out: mx.array) -> mx.array:
    """Attention output (B, Hq, L, Dv) as the output projection reads it: (B, L, Hq * Dv)."""
    B, _, L, _ = out.shape
    return out.transpose(0, 2, 1, 3).reshape(B, L, -1)  # (B, Hq, L, Dv) -> (B, L, Hq * Dv)


# Threadgroups to aim at: about two per streaming multiprocessor of a large GPU; a model with
# fewer query heads splits each row's span into parts (merged by the part that finishes last).
TARGET_GROUPS = 256


# HF2Q_ATTN_SPLIT="P,W": the (parts, SIMD groups per part) of every call, for measuring other
# mappings in a whole step (bench/attention_sweep.py times them per call); still capped as below
# and still a function of the model's shape only. Unset: split()'s own choice.
SPLIT_OVERRIDE = os.environ.get("HF2Q_ATTN_SPLIT", "")


def _override() -> tuple[int, int] | None:
    bounds = ((1, 1 << 30), (1, 1 << 30))
    return int_tuple_setting("HF2Q_ATTN_SPLIT", SPLIT_OVERRIDE, bounds, "two positive ints 'P,W'")


def split(heads: int, span: int, head_dim: int = 128) -> tuple[int, int]:
    """-> (parts, SIMD groups per part) for one token of a row with ``heads`` query heads over
    ``span`` slots. The split (which fixes each output's order of additions) depends on the
    model's shape only, never on the batch or the tokens per row: a query gets the same bits
    alone, in a batch or in a speculative verify (row parity; greedy tokens cannot flip on a
    near tie). Wide heads take fewer groups: each lane holds 3 head_dim / 32 floats, and a
    threadgroup of 32 groups (1024 threads) leaves 64 registers per thread, past which the
    launch fails."""
    forced = _override()
    want = forced[0] if forced is not None else TARGET_GROUPS // max(heads, 1)
    parts = max(1, min(32, want, span // 16))
    chunk = -(-span // parts)
    most = 32 if head_dim <= 128 else 16 if head_dim <= 256 else 8
    if forced is not None:
        return parts, max(1, min(most, forced[1]))
    # two slots per SIMD group or more: each slot is a dependent round trip to memory, so the
    # part's latency is its slots per group (at one token per row, the whole step waits on it)
    return parts, max(2, min(most, chunk // 2))


# A launch of at least this many SIMD groups (a few waves of an H100 / H200 full) takes the
# part's W groups VW at a time (W / VW physical groups, the same bits): at 32 rows the default
# mapping gives each group one or two slots, and its merge and launch costs swamp the reads
# (session 52: a 32-row sliding call 222 us, (4 parts, 8 groups) 95 us).
VIRTUAL_MIN_WARPS = 16384
VIRTUAL_MAX = 4  # session 53, H100, 26B-A4B sliding at 32 rows: 111 us a call at 4, 124 at 8
PARKED_FLOATS = 8192  # shared floats the parked groups may take (32 KB: Metal's limit)
# HF2Q_ATTN_VW: VW at most this (1: every group physical; the largest power of two dividing W,
# where the parked values fit); unset: virtual_groups' own choice. Read at import.
VW_OVERRIDE = os.environ.get("HF2Q_ATTN_VW", "")


def virtual_groups(groups: int, warps: int, heads: int, Dv: int) -> int:
    """VW for a launch of ``groups`` threadgroups of ``warps`` SIMD groups (``heads`` query
    heads each, ``Dv`` output dims): a power of two dividing ``warps``, so that the launch
    keeps at least VIRTUAL_MIN_WARPS physical groups. Any VW gives the same bits, so it may
    follow the batch."""
    forced = int_setting("HF2Q_ATTN_VW", VW_OVERRIDE, 1, 64)
    want = forced if forced is not None else min(VIRTUAL_MAX, groups * warps // VIRTUAL_MIN_WARPS)
    vw = 1
    while vw * 2 <= want and warps % (vw * 2) == 0:
        vw *= 2
    return 1 if heads * warps * 32 * -(-Dv // 32) > PARKED_FLOATS else vw


# HF2Q_ATTN_LOADS: letters "v" (a lane's key / value elements contiguous, read by 8- or 16-byte
# loads, where the cache is 16-bit and a lane holds a multiple of 4 elements; the dot product's
# order of additions changes, the same at any batch) and "p" (each SIMD group loads two slots
# before scoring either: the same bits). Read at import; "" the one-element loads.
LOADS_RAW = os.environ.get("HF2Q_ATTN_LOADS", "")


@lru_cache(maxsize=8)
def load_flags(value: str) -> frozenset[str]:
    """The letters of an HF2Q_ATTN_LOADS value ("", "v", "p", "vp"); cached: every call of
    ``decode_attention`` asks for them before its plan lookup."""
    flags = frozenset(value.strip().lower())
    if flags - {"v", "p"}:
        raise InvalidArgumentError(f"HF2Q_ATTN_LOADS={value!r}: expected letters of 'vp' or ''")
    return flags


def vector_lanes(dtype, D: int, Dv: int, flags: frozenset[str]) -> bool:
    """Whether a call takes the contiguous-lane (vector load) mapping."""
    return "v" in flags and dtype in (mx.bfloat16, mx.float16) and D == Dv and D % 128 == 0


# Query heads of one KV head that a threadgroup takes together (G), reading each key and value
# once for all of them: a batch of rows reads the cache G times less (Gemma 4 26B-A4B at 8 rows:
# the decode attention was 17 % of the step's kernel time, session 22). A head's arithmetic is
# the same at any G, so G may follow the batch size (row parity holds); from SHARED_KV_MIN_ROWS
# query rows on, as many heads as keep a lane's q and output floats within SHARED_KV_FLOATS.
# Not yet run on a GPU: off unless HF2Q_ATTN_SHARED_KV=1.
SHARED_KV = os.environ.get("HF2Q_ATTN_SHARED_KV", "0") == "1"
SHARED_KV_MIN_ROWS = 64
SHARED_KV_FLOATS = 64


def heads_per_group(rep: int, rows: int, D: int, Dv: int) -> int:
    """G for a call of ``rows`` query rows (B Hq L) with ``rep`` query heads per KV head."""
    if not SHARED_KV or rows < SHARED_KV_MIN_ROWS:
        return 1
    per_head = -(-D // 32) + -(-Dv // 32)  # q and o floats a lane holds for one head
    return next(g for g in range(rep, 0, -1) if rep % g == 0 and g * per_head <= SHARED_KV_FLOATS)


# The parts of a row count themselves in on a counter (the part taking the last ticket merges
# and zeroes it). Two launches counting on one counter must not run at once, and MLX orders
# launches only through data (Metal may run independent ones together: the rows of a
# SequentialStep, prompts prefilled side by side), so a plan's calls rotate over sets of
# counters: two calls share a set only with COUNTER_SETS calls of the shape between them. A
# recorded CUDA graph runs its launches in stream order: one set serves them all.
COUNTER_SETS = 64
COUNTER_BYTES = 256 * 1024  # at most this much counter memory per plan (fewer sets if more rows)


class CountedPlan:
    """One call shape's launch, its constant inputs and its counter sets."""

    __slots__ = ("launch", "consts", "counter", "sets", "turn")

    def __init__(self, launch, consts: tuple, rows: int, parts: int) -> None:
        n = 1 if parts == 1 else max(1, min(COUNTER_SETS, COUNTER_BYTES // (4 * rows)))
        self.launch, self.consts, self.turn = launch, consts, 0
        # at least 8 elements: Metal would put a smaller input in its read-only constant space.
        # Leaf arrays from host values: a plan first made inside mx.compile holds no traced op.
        self.counter = mx.array(np.zeros(max(8, n * rows), dtype=np.uint32))
        self.sets = [device_array([i], mx.int32) for i in range(n)]

    def inputs(self) -> list[mx.array]:
        """The constant inputs after pos: scale, dims, the counter and this call's set."""
        if launch_recorder.active():
            return [*self.consts, self.counter, self.sets[0]]
        i = self.turn
        self.turn = i + 1 if i + 1 < len(self.sets) else 0
        return [*self.consts, self.counter, self.sets[i]]


@lru_cache(maxsize=256)
def _plan(kernel, be, q_shape, C, Dv, rep, span, window, scale, sig, flat=False,
          loads=frozenset()):  # fmt: skip
    """The ``CountedPlan`` of one call shape, or None for the reference. ``flat`` (one token per
    row): the output shaped (B, 1, Hq * Dv); ``loads``: HF2Q_ATTN_LOADS's letters."""
    B, Hq, L, D = q_shape
    dt = sig[0]
    if dt not in _FLOATS or sig[1:3] != (dt, dt) or sig[3] != mx.int32 or L > 16:
        return None
    if max(D, Dv) > 1024 or B * Hq * L >= 2**31:
        return None
    rows = B * Hq * L
    out_shape = (B, 1, Hq * Dv) if flat else (B, Hq, L, Dv)
    parts, warps = split(Hq, span, max(D, Dv))  # never B or L: row parity
    group = heads_per_group(rep, rows, D, Dv)  # may follow B: a head's bits do not depend on it
    vec = vector_lanes(dt, D, Dv, loads)
    plain = not vec and "p" not in loads
    vw = virtual_groups(rows // group * parts, warps, group, Dv) if plain else 1  # same bits
    one = parts == 1
    launch = kernel.launcher(
        list(sig) + [mx.float32, mx.int32, mx.uint32, mx.int32],
        grid=(rows // group * 32 * (warps // vw), parts, 1),
        threadgroup=(32 * (warps // vw), 1, 1),
        output_shapes=[out_shape, (1,) if one else (rows, parts),
                       (1,) if one else (rows, parts), (1,) if one else (rows, parts, Dv)],
        output_dtypes=[dt, mx.float32, mx.float32, mx.float32],
        template={"T": dt, "D": D, "DV": Dv, "REP": rep, "G": group, "L": L, "SPAN": span, "CAP": C,
                  "RING": window is not None, "WIN": window or 0, "W": warps, "P": parts,
                  "CHUNK": -(-span // parts), "VEC": int(vec),
                  "BF": int(dt == mx.bfloat16), "PF": int("p" in loads), "VW": vw},
        backend=be,
    )  # fmt: skip
    consts = (device_array([scale], mx.float32), device_array([Hq, rows], mx.int32))
    return CountedPlan(launch, consts, rows, parts)
