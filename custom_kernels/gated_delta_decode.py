"""Qwen 3.5 gated delta-net decode in one launch: conv, gates, recurrence and gated output norm.

For L >= 1 tokens per row, from the block's projections (``qkv`` (B, L, C) with
C = 2 Hk Dk + Hv Dv, ``z`` (B, L, Hv Dv), ``a``, ``b`` (B, L, Hv)), the conv state (B, K-1, C),
the depthwise conv weight (C, K) or (C, K, 1), A_log, dt_bias (Hv,), the recurrent state
(B, Hv, Dv, Dk) and the gated norm's weight (Dv,): the short causal conv update with SiLU, the
split into q/k/v, the q/k l2 norms (q scaled by Dk**-0.5), the gates (decay =
exp(-exp(A_log) softplus(a + dt_bias)), beta = sigmoid(b)), the delta-rule update and readout
y = S q, then out = rms_norm(y) * w * silu(z) per value head: the input of ``out_proj``.
``active`` (B,) bool (a static cache's rows that advance): rows not active keep their conv state
and state (their output is meaningless).
L > 1 is a speculative verify on a static cache: the kernel runs the row's tokens one after
the other (the same math as L single-token calls) and, when asked, also writes each token's
starting states (the history an exact rollback gathers from).

Each of qkv, z, a, b may be ``Channels`` of a fused in_proj's output (B, L, N), read in place at
its offset (template constants: each input's values per token and first channel), so a decode
graph holds no slice between the fused mat-vec and this kernel.

The math is ``custom_kernels/gated_delta.py``'s (its module docstring); this file adds the
output norm and the row mask so that the decode of a delta-net block is one kernel between
in_proj and out_proj.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx
import numpy as np

from hf2q_mlx.custom_kernels import backend, device_array, int_setting
from hf2q_mlx.custom_kernels._render import Example, Kernel, launch_bounds
from hf2q_mlx.custom_kernels.gated_delta import gated_delta_update_reference
from hf2q_mlx.errors import InvalidArgumentError

SIMD_WIDTH = 32
MAX_WARPS = 16  # SIMD groups per threadgroup (512 threads): value rows are spread over them
MAX_STATE_REGS = 64  # floats of state a lane holds (rows per SIMD group x Dk / 32)
_FLOATS = (mx.float32, mx.float16, mx.bfloat16)
# HF2Q_GDN_PRELOAD: the new conv state's inputs loaded with the state at the start (template
# PRELOAD) rather than after the state's stores (the same values and bits either way). "1" on,
# "0" or unset off: no faster (session 47, H100, bench/gdn_decode.py: 13.8 / 14.2 us a call at
# one row, 35.1 / 34.8 at 8; 35B-A3B graph decode 1.01x). Read at import, parsed at the first
# call, in the plan key.
PRELOAD: str = os.environ.get("HF2Q_GDN_PRELOAD", "")


def preload_on() -> bool:
    """Whether HF2Q_GDN_PRELOAD (PRELOAD) asks for the preloaded conv state."""
    return bool(int_setting("HF2Q_GDN_PRELOAD", PRELOAD, 0, 1))


# HF2Q_GDN_MIN_BLOCKS (1..4; unset: none): launch bounds on the kernel's own cubins (the graph's
# and the cubin cache's, not MLX's builds) asking nvcc for that many threadgroups an SM. At one
# token a threadgroup is 512 threads at 96 registers (nvcc sm_90), so one an SM: 8 rows of
# Qwen 3.5 MoE are 256 threadgroups in two waves of ~14 us, 32 rows eight. 2 gives 64 registers
# (132 bytes spilled). Same math, same bits. Read at import, parsed at the first call, in the
# plan key.
MIN_BLOCKS: str = os.environ.get("HF2Q_GDN_MIN_BLOCKS", "")


def min_blocks() -> int | None:
    """HF2Q_GDN_MIN_BLOCKS (MIN_BLOCKS) as an integer 1..4, None when unset."""
    return int_setting("HF2Q_GDN_MIN_BLOCKS", MIN_BLOCKS, 1, 4)


@dataclass(frozen=True, eq=False)
class Channels:
    """Channels ``first .. first + count`` of a fused projection's output ``data`` (B, L, N),
    left unsplit: the decode kernel reads them in place. Stands where a (B, L, count) array
    does."""

    data: mx.array  # (B, L, N)
    first: int
    count: int

    def __post_init__(self):
        shape = self.data.shape
        if len(shape) != 3 or self.first < 0 or self.count <= 0:
            raise InvalidArgumentError(f"channels {self.first}+{self.count} of a {shape} array")
        if self.first + self.count > shape[-1]:
            raise InvalidArgumentError(
                f"channels {self.first}..{self.first + self.count} outside {shape[-1]}"
            )

    @property
    def shape(self) -> tuple[int, int, int]:
        B, L, _ = self.data.shape
        return (B, L, self.count)

    @property
    def dtype(self) -> mx.Dtype:
        return self.data.dtype


def dense(x: mx.array | Channels) -> mx.array:
    """``x`` as its (B, L, count) array: a slice of a ``Channels``' data (not for a decode
    step's kernel path, where the slice would be one more node)."""
    if isinstance(x, Channels):
        return x.data[..., x.first : x.first + x.count]
    return x


def _layout(x: mx.array | Channels) -> tuple[int, int]:
    """(values per token, first channel) of an input as the kernel reads it."""
    if isinstance(x, Channels):
        return x.data.shape[-1], x.first
    return x.shape[-1], 0


def _decode_one(
    qkv, z, a, b, conv_state, conv_weight, A_log, dt_bias, state, norm_weight, norm_eps,
    num_k_heads, head_k_dim, tiled, active,
):  # fmt: skip
    """One token (B, 1, .) in MLX ops -> (out, conv state, state)."""
    y, conv, s = gated_delta_update_reference(
        qkv, conv_state, conv_weight, a, b, A_log, dt_bias, state, num_k_heads, head_k_dim, tiled
    )
    B, L, hv, dv = y.shape
    gate = z.reshape(B, L, hv, dv).astype(mx.float32)
    normed = mx.fast.rms_norm(y.astype(mx.float32), norm_weight.astype(mx.float32), norm_eps)
    out = (normed * gate * mx.sigmoid(gate)).reshape(B, L, hv * dv).astype(qkv.dtype)
    if active is not None:
        conv = mx.where(active[:, None, None], conv, conv_state.astype(conv.dtype))
        s = mx.where(active[:, None, None, None], s, state.astype(s.dtype))
    return out, conv, s


def gated_delta_decode_reference(
    qkv: mx.array,
    z: mx.array,
    a: mx.array,
    b: mx.array,
    conv_state: mx.array,
    conv_weight: mx.array,
    A_log: mx.array,
    dt_bias: mx.array,
    state: mx.array,
    norm_weight: mx.array,
    norm_eps: float,
    num_k_heads: int,
    head_k_dim: int,
    tiled: bool = False,
    active: mx.array | None = None,
    history: bool = False,
) -> tuple[mx.array, ...]:
    """The same in MLX ops, one token at a time -> (out (B, L, Hv Dv) in qkv.dtype, conv state,
    state fp32), and with ``history`` the states before each token: (conv (B, L, K-1, C) in
    qkv.dtype, state (B, L, Hv, Dv, Dk) fp32), entry j = after j of the call's tokens."""
    conv_weight = conv_weight.reshape(conv_weight.shape[:2])  # (C, K, 1) -> (C, K)
    rest = (A_log, dt_bias)
    norm = (norm_weight, norm_eps, num_k_heads, head_k_dim, tiled, active)
    outs, convs, states = [], [], []
    conv, s = conv_state, state.astype(mx.float32)
    L = qkv.shape[1]
    for t in range(L):
        convs.append(conv.astype(qkv.dtype))
        states.append(s)
        one = [x if L == 1 else x[:, t : t + 1] for x in (qkv, z, a, b)]
        out, conv, s = _decode_one(*one, conv, conv_weight, *rest, s, *norm)
        outs.append(out)
    out = outs[0] if L == 1 else mx.concatenate(outs, axis=1)
    if not history:
        return out, conv, s
    return out, conv, s, mx.stack(convs, axis=1), mx.stack(states, axis=1)


# conv + SiLU + l2 norm of a lane's q and k channels and the head's gates for token t (the
# register path's token loop and the streamed path both; ``tok`` the token's row in the inputs)
_QK_GATES = """\
    // conv + SiLU of this lane's q and k channels, then l2 norms (eps 1e-6 on the sum of squares)
    float qv[NK], kv[NK];
    float qq = 0.0f, kk = 0.0f;
    UNROLL for (int i = 0; i < NK; ++i) {
      const uint c = hk * Dk + lane + SIMD_SIZE * i;
      float aq = 0.0f, ak = 0.0f;
      for (int j = 0; j < KC; ++j) {
        aq += to_float(conv_w[c * KC + j]) * GDD_SEQ(t + j, c);
        ak += to_float(conv_w[(KD + c) * KC + j]) * GDD_SEQ(t + j, KD + c);
      }
      qv[i] = aq / (1.0f + exp_f(-aq));
      kv[i] = ak / (1.0f + exp_f(-ak));
      qq += qv[i] * qv[i];
      kk += kv[i] * kv[i];
    }
    const float qs = rsqrt_f(simd_sum(qq) + 1e-6f) * rsqrt_f(float(Dk));  // + the readout scale
    const float ks = rsqrt_f(simd_sum(kk) + 1e-6f);
    UNROLL for (int i = 0; i < NK; ++i) kv[i] *= ks;

    const float x = to_float(a[tok * AS + AO + h]) + to_float(dt_bias[h]);
    const float softplus = x > 20.0f ? x : log_f(1.0f + exp_f(x));
    const float decay = exp_f(-exp_f(to_float(A_log[h])) * softplus);
    const float beta = 1.0f / (1.0f + exp_f(-to_float(b[tok * BS + BO + h])));
"""

# One value row's update and readout (its state elements @S@, its v @V@, y into @Y@): the
# register path and the streamed path run this same text, so a row gets the same bits in both.
_ROW_UPDATE = """\
      float mem = 0.0f;
      UNROLL for (int i = 0; i < NK; ++i) mem += @S@ * kv[i];
      const float delta = (@V@ - decay * simd_sum(mem)) * beta;
      float o = 0.0f;
      UNROLL for (int i = 0; i < NK; ++i) {
        const float sn = fma_f(@S@, decay, kv[i] * delta);
        o += sn * qv[i];
        if (act) @S@ = sn;
      }
      @Y@ = simd_sum(o) * qs;
"""


def _row_update(state: str, v: str, y: str) -> str:
    return _ROW_UPDATE.replace("@S@", state).replace("@V@", v).replace("@Y@", y)


_BODY = (
    """
  // One threadgroup per (batch row bi, value head h), looping over the row's NT tokens with the
  // state in registers. SIMD group w owns the value rows dv = w + NW * r (r < R); lane owns key
  // channels lane + 32 i (i < NK, Dk = 32 NK), so a state row is one coalesced sweep and each
  // reduction over Dk is one simd_sum. Every SIMD group redoes the conv, l2 norms and gates of
  // its key head (a few dozen FMAs, no barrier); one barrier per token shares y^2 over the head
  // for the gated RMSNorm (``part`` double-buffered, so a token's writes never meet the previous
  // token's reads). All threads then copy the new conv state (and, with HIST, the per-token ones).
  // STREAM (one token, many rows): the state streamed through RU rows at a time (below).
  constexpr int NK = Dk / SIMD_SIZE;
  constexpr int KD = Hk * Dk;
  constexpr int C = 2 * KD + Hv * Dv;
  const uint n = gid_x;  // bi * Hv + h
  const uint bi = n / Hv;
  const uint h = n % Hv;
  const uint hk = TILED ? h % Hk : h / (Hv / Hk);
  const bool act = MASKED ? bool(active[bi]) : true;
  const uint crow = bi * (KC - 1) * C;    // this row's conv state
  constexpr int DVP = (Dv + SIMD_SIZE - 1) / SIMD_SIZE * SIMD_SIZE;
  SHARED float part[2 * DVP];
  SHARED float ysh[STREAM ? DVP : 1];  // STREAM: the head's outputs before the norm
  SHARED uint qk_last[1];
  // the conv's input p of this row: the K-1 conv state slots, then the call's tokens
#define GDD_SEQ(p, c) ((p) < KC - 1 ? to_float(conv_state[crow + (p) * C + (c)]) \
                                    : to_float(qkv[(bi * NT + (p) - (KC - 1)) * QS + QO + (c)]))

  // per owned row: its state row and norm weight (STREAM: neither, below)
  float s[R * NK], wr[R];
  if (!STREAM) {
  UNROLL for (int r = 0; r < R; ++r) {
    const uint dv = simd_id + NW * r < uint(Dv) ? simd_id + NW * r : uint(Dv - 1);  // past Dv:
    // a copy of the last row, computed and never stored
    UNROLL for (int i = 0; i < NK; ++i)
      s[r * NK + i] = to_float(state_in[(n * Dv + dv) * Dk + lane + SIMD_SIZE * i]);
    wr[r] = to_float(norm_w[dv]);
  }
  }

  // PRE (no history, a channel a thread): the new conv state's inputs of thread tid's channel
  // (q, k of the key head, then the head's v), loaded with the state: the stores at the end then
  // wait on no load (each load after a store to a buffer that may alias is one more round trip)
  constexpr bool PRE = PRELOAD && !HIST && !STREAM && 2 * Dk + Dv <= NW * SIMD_SIZE;
  const uint pc = tid < uint(2 * Dk) ? (tid < uint(Dk) ? hk * Dk + tid : KD + hk * Dk + tid - Dk)
                                     : 2 * KD + h * Dv + (tid - 2 * Dk);
  float pre[KC - 1];
  if (PRE && tid < uint(2 * Dk + Dv)) {
    UNROLL for (int i = 0; i < KC - 1; ++i) pre[i] = GDD_SEQ((act ? NT : 0) + i, pc);
  }

  if (!STREAM) {
  for (int t = 0; t < NT; ++t) {
    const uint tok = bi * NT + t;
    if (HIST) {  // the state before token t: entry t of the history
      UNROLL for (int r = 0; r < R; ++r) {
        const uint dv = simd_id + NW * r;
        if (dv < uint(Dv)) {
          UNROLL for (int i = 0; i < NK; ++i)
            state_hist[((tok * Hv + h) * Dv + dv) * Dk + lane + SIMD_SIZE * i] = s[r * NK + i];
        }
      }
    }
    // conv + SiLU of the owned rows' v channels, their z
    float vv[R], zr[R];
    UNROLL for (int r = 0; r < R; ++r) {
      const uint dv = simd_id + NW * r < uint(Dv) ? simd_id + NW * r : uint(Dv - 1);
      const uint cv = 2 * KD + h * Dv + dv;
      float v = 0.0f;
      for (int j = 0; j < KC; ++j) v += to_float(conv_w[cv * KC + j]) * GDD_SEQ(t + j, cv);
      vv[r] = v / (1.0f + exp_f(-v));
      zr[r] = to_float(z[tok * ZS + ZO + h * Dv + dv]);
    }

"""
    + _QK_GATES
    + """
    // S' = decay S + beta (v - decay S k) k^T, y = S' q; inactive rows keep S
    float ys[R];
    UNROLL for (int r = 0; r < R; ++r) {
"""
    + _row_update("s[r * NK + i]", "vv[r]", "ys[r]")
    + """    }

    // gated RMSNorm over the head's Dv outputs: out = y rsqrt(mean(y^2) + eps) w silu(z)
    // The sum of y^2 runs in an order fixed by Dv alone, never by NW (an L-token launch has
    // fewer SIMD groups than a one-token launch and must give the same bits: row parity).
    SHARED_PTR(float) pt = part + (t & 1) * DVP;
    UNROLL for (int r = 0; r < R; ++r) {
      if (lane == 0 && simd_id + NW * r < uint(Dv)) pt[simd_id + NW * r] = ys[r] * ys[r];
    }
    BARRIER();
    float sq = 0.0f;
    for (int i = int(lane); i < Dv; i += SIMD_SIZE) sq += pt[i];
    const float tot = simd_sum(sq);
    const float rstd = rsqrt_f(tot / float(Dv) + eps[0]);
    UNROLL for (int r = 0; r < R; ++r) {
      const uint dv = simd_id + NW * r;
      if (dv < uint(Dv) && lane == uint(r % SIMD_SIZE)) {
        const float o = ys[r] * rstd * wr[r] * (zr[r] / (1.0f + exp_f(-zr[r])));
        out[(tok * Hv + h) * Dv + dv] = from_float<OutT>(o);
      }
    }
  }
  UNROLL for (int r = 0; r < R; ++r) {
    const uint dv = simd_id + NW * r;
    if (dv < uint(Dv)) {
      UNROLL for (int i = 0; i < NK; ++i)
        state_out[(n * Dv + dv) * Dk + lane + SIMD_SIZE * i] = s[r * NK + i];
    }
  }
  } else {
    // STREAM (one token, no history; a batch of many rows): the state is not held in
    // registers. SIMD group w takes rows dv = w + NW (r0 + u), RU rows at a time: loads the
    // state rows, updates, stores them; y goes to shared memory for the norm. Each row's
    // arithmetic is the register path's (the same bits); few registers a thread, so many
    // threadgroups an SM (the register path holds 64 KB of state a threadgroup: one an SM).
    const int t = 0;
    const uint tok = bi;
"""
    + _QK_GATES
    + """    for (int r0 = 0; r0 < R; r0 += RU) {
      float sr[RU][NK], vr[RU];
      UNROLL for (int u = 0; u < RU; ++u) {  // every load of RU rows before any math
        const uint dv = simd_id + NW * (r0 + u) < uint(Dv) ? simd_id + NW * (r0 + u) : uint(Dv - 1);
        UNROLL for (int i = 0; i < NK; ++i)
          sr[u][i] = to_float(state_in[(n * Dv + dv) * Dk + lane + SIMD_SIZE * i]);
        const uint cv = 2 * KD + h * Dv + dv;
        float v = 0.0f;
        for (int j = 0; j < KC; ++j) v += to_float(conv_w[cv * KC + j]) * GDD_SEQ(j, cv);
        vr[u] = v / (1.0f + exp_f(-v));
      }
      UNROLL for (int u = 0; u < RU; ++u) {
        const uint dv = simd_id + NW * (r0 + u);
"""
    + _row_update("sr[u][i]", "vr[u]", "const float y")
    + """        if (dv < uint(Dv)) {
          UNROLL for (int i = 0; i < NK; ++i)
            state_out[(n * Dv + dv) * Dk + lane + SIMD_SIZE * i] = sr[u][i];
          if (lane == 0) {
            part[dv] = y * y;
            ysh[dv] = y;
          }
        }
      }
    }
    BARRIER();
    float sq = 0.0f;
    for (int i = int(lane); i < Dv; i += SIMD_SIZE) sq += part[i];
    const float tot = simd_sum(sq);
    const float rstd = rsqrt_f(tot / float(Dv) + eps[0]);
    for (uint dv = tid; dv < uint(Dv); dv += tg_size) {
      const float zr = to_float(z[tok * ZS + ZO + h * Dv + dv]);
      const float o = ysh[dv] * rstd * to_float(norm_w[dv]) * (zr / (1.0f + exp_f(-zr)));
      out[(tok * Hv + h) * Dv + dv] = from_float<OutT>(o);
    }
  }

  // conv state after j tokens = inputs j .. j + K-2 (inactive rows: the old one, inputs 0..K-2);
  // j = NT is the new conv state, j < NT (HIST) entry j of the history. The head's v channels
  // here; q and k channels from the first value head of each key head. CONV_INPLACE (a recorded
  // graph: conv_out is conv_state's own buffer): every value head of a key head has read its
  // q / k channels by now but may run after the first one, so each counts itself in on the
  // (row, key head) counter and the last one writes them (all compute the same values), then
  // zeroes the counter; a thread's slot i is read before it writes slot i.
  bool qk_writer = TILED ? h < uint(Hk) : h % uint(Hv / Hk) == 0;
  if (CONV_INPLACE) {
    BARRIER_DEVICE_FENCE();
    if (tid == 0) {
      DEVICE_PTR(uint) ctr = DEVICE_CAST(uint, counter) + bi * uint(Hk) + hk;
      const uint ticket = ATOMIC_ADD_U32(ctr, 1u);
      qk_last[0] = ticket == uint(Hv / Hk - 1) ? 1u : 0u;
      if (ticket == uint(Hv / Hk - 1)) ATOMIC_STORE_U32(ctr, 0u);
    }
    BARRIER();
    qk_writer = qk_last[0] != 0u;
  }
  if (PRE) {
    if (tid < uint(2 * Dk + Dv) && (qk_writer || tid >= uint(2 * Dk))) {
      UNROLL for (int i = 0; i < KC - 1; ++i)
        conv_out[crow + i * C + pc] = from_float<OutT>(pre[i]);
    }
  }
  const uint nqk = qk_writer ? uint(2 * Dk) : 0u;
  for (int j = HIST ? 0 : NT; j <= (PRE ? -1 : NT); ++j) {
    const int shift = act ? j : 0;
    for (int i = 0; i < KC - 1; ++i) {
      for (uint e = tid; e < nqk + uint(Dv); e += tg_size) {
        const uint c = e < nqk ? (e < uint(Dk) ? hk * Dk + e : KD + hk * Dk + e - Dk)
                               : 2 * KD + h * Dv + (e - nqk);
        const float v = GDD_SEQ(shift + i, c);
        if (j == NT) conv_out[crow + i * C + c] = from_float<OutT>(v);
        else conv_hist[((bi * NT + j) * (KC - 1) + i) * C + c] = from_float<OutT>(v);
      }
    }
  }
#undef GDD_SEQ
"""
)

_INPUTS = [
    "qkv", "z", "a", "b", "conv_state", "conv_w", "A_log", "dt_bias", "state_in", "norm_w",
    "eps", "active", "counter",
]  # fmt: skip
_OUTPUTS = ["out", "state_out", "conv_out", "state_hist", "conv_hist"]


def _warps(dv: int, L: int, stream: tuple | None = None) -> int:
    """SIMD groups per threadgroup. More than one token: at most 256 threads, so the compiler may
    give each up to 255 registers (it does not know the group size; at 512 threads an L-token
    loop's registers failed to launch on the H200: "too many resources requested"). Streamed
    (``stream`` = (SIMD groups, rows at a time)): that many."""
    if stream:
        return min(stream[0], dv)
    return min(MAX_WARPS if L == 1 else MAX_WARPS // 2, dv)


# HF2Q_GDN_STREAM: the state streamed through shared-nothing registers, RU rows at a time, in
# threadgroups of STREAM_WARPS SIMD groups (template STREAM), where a launch has at least
# STREAM_MIN_GROUPS threadgroups (rows x value heads) at one token: the register path holds a
# head's whole state (64 KB at 128 x 128) in one 512-thread threadgroup an SM, so 32 rows of
# Qwen3.5-35B-A3B ran in eight waves of ~14 us (118 us a call, session 49). The same bits either
# way. "1" always at one token, "0" never, unset the rule. Read at import, parsed per call.
STREAM: str = os.environ.get("HF2Q_GDN_STREAM", "")
# Session 53 (H200, bench/gdn_decode.py, CUPTI us a call, register path / 4 / 8 SIMD groups,
# 4 rows at a time): 1 row 14.4 / 23.8 / 17.1, 8 rows 36.6 / 38.0 / 31.9, 32 rows 107.9 / 46.1
# / 51.2; so 8 SIMD groups below STREAM_WIDE_GROUPS threadgroups, STREAM_WARPS from there.
STREAM_WARPS = 4
STREAM_ROWS = 4  # RU: rows whose loads a SIMD group issues before their math
STREAM_MIN_GROUPS = 256
STREAM_WIDE_GROUPS = 1024


def stream_plan(B: int, L: int, hv: int, history: bool) -> tuple[int, int] | None:
    """(SIMD groups, rows at a time) of the streamed path for a call; None: the register path."""
    on = int_setting("HF2Q_GDN_STREAM", STREAM, 0, 1)
    if L != 1 or history or on == 0 or (on is None and B * hv < STREAM_MIN_GROUPS):
        return None
    return (STREAM_WARPS if B * hv >= STREAM_WIDE_GROUPS else 2 * STREAM_WARPS), STREAM_ROWS


def _example(
    dtype: mx.Dtype,
    tiled: bool,
    masked: bool,
    dk: int,
    dv: int,
    layout: tuple,
    nt: int = 1,
    conv_in_place: bool = False,
    stream: tuple | None = None,
) -> Example:
    return Example(
        inputs={
            "qkv": dtype, "z": dtype, "a": dtype, "b": dtype, "conv_state": dtype,
            "conv_w": dtype, "A_log": mx.float32, "dt_bias": mx.float32,
            "state_in": mx.float32, "norm_w": dtype, "eps": (mx.float32, 1),
            "active": (mx.bool_, 4), "counter": (mx.uint32, 16),
        },
        outputs={
            "out": dtype, "state_out": mx.float32, "conv_out": dtype,
            "state_hist": mx.float32, "conv_hist": dtype,
        },
        template={
            **_template(dtype, 16, dk, 32, dv, 4, nt, tiled, masked, nt > 1, layout, stream),
            "CONV_INPLACE": conv_in_place,
        },
    )  # fmt: skip


def _template(dtype, hk, dk, hv, dv, K, L, tiled, masked, hist, layout: tuple,
              stream: tuple | None = None) -> dict:  # fmt: skip
    """The kernel's template constants for one call shape; ``layout``: QS, QO, ZS, ZO, AS, AO,
    BS, BO, the values per token and first channel of qkv, z, a, b; ``stream``: the streamed
    path's (SIMD groups, rows at a time), None for the register path."""
    nw = _warps(dv, L, stream)
    r = -(-dv // nw)
    return {
        "Dk": dk, "Dv": dv, "Hk": hk, "Hv": hv, "KC": K, "NW": nw, "R": r,
        "STREAM": bool(stream), "RU": max(1, min(stream[1], r)) if stream else 1,
        "TILED": tiled, "MASKED": masked, "OutT": dtype, "NT": L, "HIST": hist,
        "CONV_INPLACE": False,  # set by a recorded graph writing the conv state in place
        "PRELOAD": True,  # the examples render the preloaded path too; _plan sets the switch
        **dict(zip(("QS", "QO", "ZS", "ZO", "AS", "AO", "BS", "BO"), layout)),
    }  # fmt: skip


_kernel = Kernel(
    "gated_delta_decode",
    inputs=_INPUTS,
    outputs=_OUTPUTS,
    body=_BODY,
    # each state element is read into a register by the lane that writes it back, and the only
    # other reads (a SIMD group past Dv re-reading row Dv - 1) come before the token loop's
    # barrier; the conv state in place takes CONV_INPLACE (the key heads' counters, above)
    in_place={"state_out": "state_in", "conv_out": "conv_state"},
    in_place_flags={"conv_out": "CONV_INPLACE"},
    examples=[
        # Qwen 3.5 9B / 35B-A3B: in_proj qkv + z fused, b + a fused
        _example(mx.bfloat16, False, True, 128, 128, (12288, 0, 12288, 8192, 64, 32, 64, 0)),
        _example(mx.float32, True, False, 64, 7, (2272, 0, 224, 0, 32, 0, 32, 0)),  # unfused
        # a verify of 5 tokens on a static cache: the per-token history too
        _example(mx.bfloat16, False, True, 128, 128, (12288, 0, 12288, 8192, 64, 32, 64, 0), 5),
        # a recorded graph's step: the conv state written in place
        _example(
            mx.bfloat16, False, True, 128, 128, (12288, 0, 12288, 8192, 64, 32, 64, 0), 1, True
        ),
        # many rows: the state streamed (plain and in place)
        *(
            _example(
                mx.bfloat16,
                False,
                True,
                128,
                128,
                (12288, 0, 12288, 8192, 64, 32, 64, 0),
                1,
                in_place,
                (STREAM_WARPS, STREAM_ROWS),
            )
            for in_place in (False, True)
        ),  # fmt: skip
    ],
)


def _covered(dtype: mx.Dtype, hk: int, dk: int, hv: int, dv: int, K: int, L: int = 1) -> bool:
    """Shapes the kernel takes (else the reference): Dk a multiple of 32 and the state of a
    SIMD group's rows within MAX_STATE_REGS floats per lane."""
    nw = _warps(dv, L)
    return (
        dtype in _FLOATS
        and dk % SIMD_WIDTH == 0
        and -(-dv // nw) * (dk // SIMD_WIDTH) <= MAX_STATE_REGS
        and K >= 2
    )


@lru_cache(maxsize=64)
def _plan(
    kernel,
    be,
    B,
    L,
    C,
    K,
    hk,
    dk,
    hv,
    dv,
    tiled,
    masked,
    hist,
    eps,
    dtypes,
    layout,
    init_value,
    preload,
    blocks,
    stream=None,
):
    """(launcher, eps array, placeholder mask, counters) for one call shape; ``blocks``:
    HF2Q_GDN_MIN_BLOCKS's launch bounds, or None; ``stream``: ``stream_plan``'s."""
    nw = _warps(dv, L, stream)
    bounds = launch_bounds(SIMD_WIDTH * nw, blocks)
    dtype = dtypes[0]
    # without history its two outputs are one element each, never written
    hist_shapes = [(B, L, hv, dv, dk), (B, L, K - 1, C)] if hist else [(1,), (1,)]
    launch = kernel.launcher(
        list(dtypes),
        grid=(B * hv * SIMD_WIDTH * nw,),
        threadgroup=(SIMD_WIDTH * nw,),
        output_shapes=[(B, L, hv * dv), (B, hv, dv, dk), (B, K - 1, C), *hist_shapes],
        output_dtypes=[dtype, mx.float32, dtype, mx.float32, dtype],
        template={
            **_template(dtype, hk, dk, hv, dv, K, L, tiled, masked, hist, layout, stream),
            "PRELOAD": preload,
            **bounds,
        },
        init_value=init_value,
        backend=be,
    )  # fmt: skip
    # the key heads' counters of CONV_INPLACE (a recorded graph's launch; zero between calls),
    # at least 8: Metal would put a smaller input in its read-only constant space (a leaf from
    # host values: a plan first made inside mx.compile holds no traced op)
    counter = mx.array(np.zeros(max(8, B * hk), dtype=np.uint32))
    return launch, device_array([eps], mx.float32), device_array([True], mx.bool_), counter


def gated_delta_decode(
    qkv: mx.array | Channels,
    z: mx.array | Channels,
    a: mx.array | Channels,
    b: mx.array | Channels,
    conv_state: mx.array | None,
    conv_weight: mx.array,
    A_log: mx.array,
    dt_bias: mx.array,
    state: mx.array | None,
    norm_weight: mx.array,
    norm_eps: float,
    num_k_heads: int,
    head_k_dim: int,
    tiled: bool = False,
    active: mx.array | None = None,
    init_value: float | None = None,
    history: bool = False,
) -> tuple[mx.array, ...]:
    """Dispatcher -> (out (B, L, Hv Dv) in qkv.dtype, new conv state, new state fp32) for L >= 1
    tokens per row (a speculative verify: L > 1), and with ``history`` the states before each
    token (conv (B, L, K-1, C), state (B, L, Hv, Dv, Dk) fp32; entry j = after j tokens, so a
    rollback is one gather): one kernel where it applies, else the reference. ``conv_weight``
    (C, K), or (C, K, 1) as the model keeps it (the kernel reads it flat: no reshape node).
    ``conv_state`` / ``state`` None: zeros (a first token). ``init_value`` fills the outputs
    before the launch (tests poison them). Every array goes in and comes out in its own shape:
    a reshape would be one more node in each decode step's graph. Any of qkv, z, a, b may be
    ``Channels`` of a fused projection's output (several may share one), which the kernel
    reads in place."""
    B, L, C = qkv.shape
    hv = a.shape[-1]
    dv, rem = divmod(C - 2 * num_k_heads * head_k_dim, hv)
    gates = a.shape == b.shape == (B, L, hv)
    if L < 1 or rem or dv <= 0 or hv % num_k_heads or z.shape != (B, L, hv * dv) or not gates:
        raise InvalidArgumentError(
            f"gated_delta_decode: qkv {qkv.shape}, z {z.shape}, a {a.shape} and b {b.shape} do not "
            f"match {num_k_heads} key heads of {head_k_dim}"
        )
    w_shape = conv_weight.shape
    if len(w_shape) < 2 or w_shape[0] != C or w_shape[2:] not in ((), (1,)):
        raise InvalidArgumentError(
            f"gated_delta_decode: conv weight {w_shape} is not (C, K) or (C, K, 1) "
            f"for C = {C} channels"
        )
    K = w_shape[1]
    if conv_state is None:
        conv_state = mx.zeros((B, K - 1, C), dtype=qkv.dtype)
    if state is None:
        state = mx.zeros((B, hv, dv, head_k_dim), dtype=mx.float32)
    be = backend()
    if be is None or not _covered(qkv.dtype, num_k_heads, head_k_dim, hv, dv, K, L):
        return gated_delta_decode_reference(
            *(dense(x) for x in (qkv, z, a, b)), conv_state, conv_weight, A_log, dt_bias,
            state, norm_weight, norm_eps, num_k_heads, head_k_dim, tiled, active, history,
        )  # fmt: skip
    masked = active is not None
    if masked and active.dtype != mx.bool_:
        active = active.astype(mx.bool_)
    projections = (qkv, z, a, b)
    layout = tuple(v for x in projections for v in _layout(x))
    data = [x.data if isinstance(x, Channels) else x for x in projections]  # read in place
    inputs = [*data, conv_state, conv_weight, A_log, dt_bias, state, norm_weight]
    dtypes = (*(x.dtype for x in inputs), mx.float32, mx.bool_, mx.uint32)
    launch, eps, unmasked, counter = _plan(
        _kernel, be, B, L, C, K, num_k_heads, head_k_dim, hv, dv, bool(tiled), masked,
        bool(history), float(norm_eps), dtypes, layout, init_value, preload_on(),
        min_blocks(), stream_plan(B, L, hv, bool(history)),
    )  # fmt: skip
    inputs += [eps, active if masked else unmasked, counter]
    out, state, conv, state_hist, conv_hist = launch(inputs=inputs)
    return (out, conv, state, conv_hist, state_hist) if history else (out, conv, state)
