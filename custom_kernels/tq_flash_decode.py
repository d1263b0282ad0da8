"""Flash-decode attention straight from a TurboQuant cache's packed codes (M <= 8 queries).

The work happens in the rotated domain: with R the cache's rotation, q . k = (R q) . (R k), and
R k is just ``codebook[code] * norm / sqrt(P)`` per coordinate, so scores and the value sum never
need the inverse transform of any cached vector; only the output is rotated back once.
Visibility comes from slot positions (``TQState``): causal, sliding window, empty slots.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..tq_cache import MAX_FLASH_QUERIES, TQState
from . import backend
from ._render import Example, Kernel

# masked scores: finite, so a fully masked partition gives exp(0) * 0 instead of NaN
_NEG = -1e30


def query_positions(state: TQState, n_queries: int) -> mx.array:
    """Absolute positions of the last ``n_queries`` tokens written (the queries), (M,)."""
    return mx.arange(state.offset - n_queries, state.offset)


def visibility(state: TQState, n_queries: int) -> mx.array:
    """Boolean (M, n_slots): query m may attend slot s."""
    p = state.slot_positions()[None, : state.n_slots]
    qp = query_positions(state, n_queries)[:, None]
    return (p >= 0) & (p <= qp) & (p > qp - state.window)


def tq_flash_decode_reference(
    queries: mx.array, state: TQState, scale: float, n_parts: int = 1
) -> mx.array:
    """queries (B, Hq, M, Dk) -> (B, Hq, M, Dv) in queries.dtype, in fp32 MLX ops.

    The kernel's algorithm: rotated queries, scores from codebook values, the keys split into
    ``n_parts`` partitions each reduced to (max, sum, weighted values), then one merge and the
    inverse rotation of the output; the state's ``TQBalance`` around it as in the dispatcher.
    """
    bal = state.balance
    dtype = queries.dtype
    queries = bal.queries_in(queries)
    B, Hq, M, _ = queries.shape
    kc, vc = state.k_codec, state.v_codec
    Hkv, S = state.keys.shape[1], state.n_slots
    rep = Hq // Hkv
    q = (kc.rotate(queries) * scale).reshape(B, Hkv, rep * M, kc.padded_dim)  # row = j*M + m
    k = kc.dequantize_rotated(state.keys[:, :, :S])  # (B, Hkv, S, P) rotated domain
    v = vc.dequantize_rotated(state.values[:, :, :S])  # (B, Hkv, S, Pv)
    visible = mx.tile(visibility(state, M), (rep, 1))  # (rep*M, S)
    s = mx.where(visible, q @ k.swapaxes(-1, -2), _NEG)
    chunk = -(-S // n_parts)
    parts = []
    for i in range(0, S, chunk):
        sp = s[..., i : i + chunk]
        m = mx.max(sp, axis=-1, keepdims=True)
        p = mx.where(visible[:, i : i + chunk], mx.exp(sp - m), 0.0)
        parts.append((m, p.sum(-1, keepdims=True), p @ v[:, :, i : i + chunk]))
    m_all = parts[0][0]
    for m, _, _ in parts[1:]:
        m_all = mx.maximum(m_all, m)
    den = sum(l_i * mx.exp(m - m_all) for m, l_i, _ in parts)
    num = sum(acc * mx.exp(m - m_all) for m, _, acc in parts)
    out = vc.unrotate(num / den)  # (B, Hkv, rep*M, Dv)
    return bal.output_out(out.reshape(B, Hq, M, vc.dim)).astype(dtype)


def tq_attention_oracle(queries: mx.array, state: TQState, scale: float) -> mx.array:
    """Dequantize the whole cache to the model's domain (codec and ``TQBalance`` undone), then
    plain fp32 attention (tests)."""
    B, Hq, M, _ = queries.shape
    S = state.n_slots
    k = state.balance.keys_out(state.k_codec.dequantize(state.keys[:, :, :S]))
    v = state.balance.values_out(state.v_codec.dequantize(state.values[:, :, :S]))
    out = mx.fast.scaled_dot_product_attention(
        queries.astype(mx.float32), k, v, scale=scale, mask=visibility(state, M)
    )
    return out.astype(queries.dtype)


# ---- kernels ----------------------------------------------------------------------------------
# params (int32): offset, capacity (slots in the buffers), window, n_slots, tokens per partition,
# partitions, scale as fp32 bits. Partials (rows = B * Hq * M, partitions, PV + 2) fp32: the
# partition's unnormalized weighted values (rotated domain), then its running max and sum.

_PARTIAL_BODY = """
  // One SIMD group (the whole threadgroup) per (partition, KV head * row group, batch). Rows are
  // the REP * M (query head, query) pairs of the KV head, RG at a time. Score phase: lane = one
  // token of a 32-token block, whole packed K row per lane, queries broadcast from shared memory.
  // Value phase: lane = PV / 32 consecutive rotated output coordinates, acc in registers.
  SHARED float qs[RG * PK];
  SHARED float kcb[1 << KB];
  SHARED float vcb[1 << VB];
  SHARED float pw[RG * 32];
  const int offset = params[0];
  const int cap = params[1];
  const int window = params[2];
  const int n_slots = params[3];
  const int chunk = params[4];
  const float scale = bitcast<float>(params[6]);
  const uint part = gid_x;
  const uint kvh = gid_y % uint(HKV);
  const uint grp = gid_y / uint(HKV);
  const uint b = gid_z;
  const float NEG = -1e30f;  // finite: a fully masked block gives exp(0) * 0, not NaN

  for (uint i = lane; i < (1u << KB); i += 32) kcb[i] = kcodebook[i];
  for (uint i = lane; i < (1u << VB); i += 32) vcb[i] = vcodebook[i];
  // queries: sign flip, butterflies, then one factor for the orthonormal transform, the
  // codebook's 1 / sqrt(PK) and the softmax scale
  for (uint idx = lane; idx < uint(RG * PK); idx += 32) {
    const uint i = idx / uint(PK);
    const uint j = idx % uint(PK);
    const uint r = grp * uint(RG) + i;
    float v = 0.0f;
    if (r < uint(REP * M) && j < uint(DK)) {
      const uint h = kvh * uint(REP) + r / uint(M);
      const uint qrow = (b * uint(HKV * REP) + h) * uint(M) + r % uint(M);
      v = to_float(q[qrow * uint(DK) + j]) * ksigns[j];
    }
    qs[idx] = v;
  }
  BARRIER();
  for (uint h = 1; h < uint(PK); h <<= 1) {
    for (uint t = lane; t < uint(RG * PK / 2); t += 32) {
      const uint i = t / uint(PK / 2);
      const uint jj = t % uint(PK / 2);
      const uint a = i * uint(PK) + (jj / h) * 2 * h + (jj % h);
      const float x0 = qs[a];
      const float x1 = qs[a + h];
      qs[a] = x0 + x1;
      qs[a + h] = x0 - x1;
    }
    BARRIER();
  }
  const float qscale = scale / float(PK);
  for (uint idx = lane; idx < uint(RG * PK); idx += 32) qs[idx] *= qscale;
  BARRIER();

  int qpos[RG];
  float m_run[RG];
  float l_run[RG];
  float acc[RG][PV / 32];
  UNROLL for (int i = 0; i < RG; ++i) {
    qpos[i] = offset - M + int((grp * uint(RG) + uint(i)) % uint(M));
    m_run[i] = NEG;
    l_run[i] = 0.0f;
    UNROLL for (int c = 0; c < PV / 32; ++c) acc[i][c] = 0.0f;
  }
  const uint64_t head = uint64_t(b * uint(HKV) + kvh) * uint64_t(cap);
  const int start = int(part) * chunk;
  const int end = start + chunk < n_slots ? start + chunk : n_slots;
  for (int t0 = start; t0 < end; t0 += 32) {
    const int t = t0 + int(lane);
    const bool live = t < end;
    float s[RG];
    UNROLL for (int i = 0; i < RG; ++i) s[i] = 0.0f;
    float vnorm = 0.0f;
    int pos = -1;
    if (live) {
      // the slot's absolute position: (offset-1) - ((offset-1-t) mod cap), negative = empty
      int d = (offset - 1 - t) % cap;
      if (d < 0) d += cap;
      pos = offset - 1 - d;
      DEVICE_PTR(const uint) kr = krows + (head + uint64_t(t)) * uint64_t(KRW);
      for (int g = 0; g < PK / 32; ++g) {
        // 32 codes fill exactly KB words, so bit positions inside a group are constants
        uint w[KB];
        UNROLL for (int k = 0; k < KB; ++k) w[k] = kr[g * KB + k];
        UNROLL for (int c = 0; c < 32; ++c) {
          const int off = c * KB;
          const int lo = off >> 5;
          const int sh = off & 31;
          uint code = w[lo] >> sh;
          if (sh + KB > 32) code |= w[lo + 1 < KB ? lo + 1 : KB - 1] << (32 - sh);
          const float kv = kcb[code & ((1u << KB) - 1)];
          UNROLL for (int i = 0; i < RG; ++i) s[i] = fma_f(qs[i * PK + g * 32 + c], kv, s[i]);
        }
      }
      const float knorm = bitcast<float>(kr[KRW - 1]);
      UNROLL for (int i = 0; i < RG; ++i) s[i] *= knorm;
      // a value coordinate is codebook[code] * norm / sqrt(PV): the factor rides on the weight
      vnorm = bitcast<float>(vrows[(head + uint64_t(t)) * uint64_t(VRW) + uint64_t(VRW - 1)])
              * (1.0f / sqrt_f(float(PV)));
    }
    // online softmax over the block, per row
    UNROLL for (int i = 0; i < RG; ++i) {
      const bool vis = live && pos >= 0 && pos <= qpos[i] && pos > qpos[i] - window;
      const float si = vis ? s[i] : NEG;
      const float m_new = max_f(m_run[i], simd_max(si));
      const float alpha = exp_f(m_run[i] - m_new);
      const float p = vis ? exp_f(si - m_new) : 0.0f;
      l_run[i] = l_run[i] * alpha + simd_sum(p);
      m_run[i] = m_new;
      UNROLL for (int c = 0; c < PV / 32; ++c) acc[i][c] *= alpha;
      pw[i * 32 + lane] = p * vnorm;
    }
    SIMD_BARRIER();
    const int n_tok = end - t0 < 32 ? end - t0 : 32;
    for (int tt = 0; tt < n_tok; ++tt) {
      DEVICE_PTR(const uint) vr = vrows + (head + uint64_t(t0 + tt)) * uint64_t(VRW);
      UNROLL for (int c = 0; c < PV / 32; ++c) {
        const uint bit = (lane * uint(PV / 32) + uint(c)) * uint(VB);
        const uint lo = bit >> 5;
        const uint sh = bit & 31;
        uint code = vr[lo] >> sh;
        if (sh + uint(VB) > 32) code |= vr[lo + 1] << (32 - sh);
        const float vv = vcb[code & ((1u << VB) - 1)];
        UNROLL for (int i = 0; i < RG; ++i) acc[i][c] = fma_f(pw[i * 32 + tt], vv, acc[i][c]);
      }
    }
    SIMD_BARRIER();
  }
  const uint n_parts = ngroups_x;
  UNROLL for (int i = 0; i < RG; ++i) {
    const uint r = grp * uint(RG) + uint(i);
    if (r < uint(REP * M)) {
      const uint h = kvh * uint(REP) + r / uint(M);
      const uint qrow = (b * uint(HKV * REP) + h) * uint(M) + r % uint(M);
      const uint64_t o = (uint64_t(qrow) * n_parts + part) * uint64_t(PV + 2);
      UNROLL for (int c = 0; c < PV / 32; ++c) {
        partials[o + lane * uint(PV / 32) + uint(c)] = acc[i][c];
      }
      if (lane == 0) {
        partials[o + uint(PV)] = m_run[i];
        partials[o + uint(PV + 1)] = l_run[i];
      }
    }
  }
"""

_REDUCE_BODY = """
  // One threadgroup per query row, one thread per rotated output coordinate (PV threads): merge
  // the partitions' (values, max, sum), normalize, then the inverse rotation: butterflies in
  // shared memory and the sign flip.
  SHARED float buf[PV];
  const uint row = gid_x;
  const uint j = tid;
  const int n_parts = params[5];
  DEVICE_PTR(const float) base = partials + uint64_t(row) * uint64_t(n_parts) * uint64_t(PV + 2);
  float m = -1e30f;
  for (int p = 0; p < n_parts; ++p) m = max_f(m, base[p * (PV + 2) + PV]);
  float den = 0.0f;
  float num = 0.0f;
  for (int p = 0; p < n_parts; ++p) {
    const float w = exp_f(base[p * (PV + 2) + PV] - m);
    den = fma_f(w, base[p * (PV + 2) + PV + 1], den);
    num = fma_f(w, base[p * (PV + 2) + int(j)], num);
  }
  buf[j] = num / den;
  BARRIER();
  for (uint h = 1; h < uint(PV); h <<= 1) {
    if (j < uint(PV) / 2) {
      const uint i = (j / h) * 2 * h + (j % h);
      const float a = buf[i];
      const float c = buf[i + h];
      buf[i] = a + c;
      buf[i + h] = a - c;
    }
    BARRIER();
  }
  if (j < uint(DV)) {
    out[row * uint(DV) + j] = from_float<T>(buf[j] * (1.0f / sqrt_f(float(PV))) * vsigns[j]);
  }
"""


def _partial_example(dt, dk, dv, kb, vb, rep, m, rg, hkv) -> Example:
    pk, pv = max(32, 1 << (dk - 1).bit_length()), max(32, 1 << (dv - 1).bit_length())
    return Example(
        {"q": dt, "krows": mx.uint32, "vrows": mx.uint32, "ksigns": mx.float32,
         "kcodebook": mx.float32, "vcodebook": mx.float32, "params": (mx.int32, 7)},
        {"partials": mx.float32},
        {"T": dt, "DK": dk, "PK": pk, "DV": dv, "PV": pv, "KB": kb, "VB": vb, "REP": rep,
         "M": m, "RG": rg, "HKV": hkv, "KRW": pk * kb // 32 + 1, "VRW": pv * vb // 32 + 1},
    )  # fmt: skip


_partial_kernel = Kernel(
    "tq_flash_decode_partial",
    inputs=["q", "krows", "vrows", "ksigns", "kcodebook", "vcodebook", "params"],
    outputs=["partials"],
    body=_PARTIAL_BODY,
    examples=[
        _partial_example(mx.bfloat16, 256, 256, 4, 4, 4, 1, 4, 1),  # Gemma 3 270M
        _partial_example(mx.float16, 512, 512, 8, 3, 8, 1, 4, 2),  # Gemma 4 global layer
        _partial_example(mx.float32, 96, 64, 5, 6, 3, 4, 6, 2),  # padded K, small M
    ],
)

_reduce_kernel = Kernel(
    "tq_flash_decode_reduce",
    inputs=["partials", "vsigns", "params"],
    outputs=["out"],
    body=_REDUCE_BODY,
    examples=[
        Example(
            {"partials": mx.float32, "vsigns": mx.float32, "params": (mx.int32, 7)},
            {"out": dt},
            {"T": dt, "DV": dv, "PV": pv},
        )
        for dt, dv, pv in ((mx.bfloat16, 256, 256), (mx.float32, 80, 128))
    ],
)

# per threadgroup of the partial kernel: at most 8 rows, 64 accumulators per lane (RG * PV / 32)
# and 16 KB of rotated queries (RG * PK floats)
_MAX_ROWS, _MAX_ACC, _MAX_Q = 8, 64, 4096


def row_groups(rows: int, pk: int, pv: int) -> tuple[int, int]:
    """(rows per threadgroup RG, number of row groups) for ``rows`` = REP * M query rows."""
    cap = max(1, min(_MAX_ROWS, _MAX_ACC * 32 // pv, _MAX_Q // pk))
    n = -(-rows // cap)
    return -(-rows // n), n


def default_parts(n_slots: int, groups: int) -> int:
    """Split-K partitions: aim at ~512 SIMD groups in all, each at least 64 keys (<= 256)."""
    by_work = -(-n_slots // 64)
    by_fill = max(1, -(-512 // groups))
    return max(1, min(by_work, by_fill, 256))


def _covered(queries: mx.array, state: TQState) -> bool:
    B, Hq, M, Dk = queries.shape
    Hkv = state.keys.shape[1]
    kc, vc = state.k_codec, state.v_codec
    return (
        queries.dtype in (mx.float16, mx.bfloat16, mx.float32)
        and M <= MAX_FLASH_QUERIES
        and Hq % Hkv == 0
        and Dk == kc.dim
        and kc.padded_dim <= 4096  # one query row of shared memory (16 KB)
        and vc.padded_dim <= 1024  # one reduce thread per output coordinate
        and state.n_slots > 0
    )


def tq_flash_decode(queries: mx.array, state: TQState, scale: float) -> mx.array:
    """Dispatcher: the GPU kernels where they apply, else the reference (one partition).

    The kernels see only the stored vectors; the state's ``TQBalance`` goes around them: fp32
    queries times the key scales in, the fp32 output times the value scales, then one rounding.
    """
    if backend() is None or not _covered(queries, state):
        return tq_flash_decode_reference(queries, state, scale)
    bal = state.balance
    dtype = queries.dtype
    out_dtype = dtype if bal.v_scale is None else mx.float32
    queries = bal.queries_in(queries)
    B, Hq, M, Dk = queries.shape
    Hkv = state.keys.shape[1]
    kc, vc = state.k_codec, state.v_codec
    rep = Hq // Hkv
    rg, n_groups = row_groups(rep * M, kc.padded_dim, vc.padded_dim)
    n_parts = default_parts(state.n_slots, B * Hkv * n_groups)
    chunk = -(-state.n_slots // n_parts)
    chunk = -(-chunk // 32) * 32  # whole 32-token blocks per partition
    n_parts = -(-state.n_slots // chunk)
    scale_bits = int(np.array(scale, dtype=np.float32).view(np.int32))
    params = mx.array(
        [state.offset, state.capacity, state.window, state.n_slots, chunk, n_parts, scale_bits],
        dtype=mx.int32,
    )
    (partials,) = _partial_kernel(
        [queries, state.keys, state.values, kc.signs, kc.codebook, vc.codebook, params],
        grid=(n_parts * 32, Hkv * n_groups, B),
        threadgroup=(32, 1, 1),
        output_shapes=[(B * Hq * M, n_parts, vc.padded_dim + 2)],
        output_dtypes=[mx.float32],
        template={"T": queries.dtype, "DK": Dk, "PK": kc.padded_dim, "DV": vc.dim,
                  "PV": vc.padded_dim, "KB": kc.bits, "VB": vc.bits, "REP": rep, "M": M,
                  "RG": rg, "HKV": Hkv, "KRW": kc.row_words, "VRW": vc.row_words},
    )  # fmt: skip
    (out,) = _reduce_kernel(
        [partials, vc.signs, params],
        grid=(B * Hq * M * vc.padded_dim,),
        threadgroup=(vc.padded_dim,),
        output_shapes=[(B, Hq, M, vc.dim)],
        output_dtypes=[out_dtype],
        template={"T": out_dtype, "DV": vc.dim, "PV": vc.padded_dim},
    )
    return bal.output_out(out).astype(dtype)
