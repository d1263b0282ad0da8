"""Flash-decode attention straight from a TurboQuant cache's packed codes (M <= 8 queries).

The work happens in the rotated domain: with R the cache's rotation, q . k = (R q) . (R k), and
R k is just ``codebook[code] * norm / sqrt(P)`` per coordinate, so scores and the value sum never
need the inverse transform of any cached vector; only the output is rotated back once.
Visibility comes from slot positions (the ring arithmetic of ``models/cache.py``): causal,
sliding window, empty slots. The kernels and their launch take arrays and ints; the MLX reference
and the dispatcher taking a cache's packed state sit with the cache, in
``models/turboquant/kernels.py``.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from hf2q_mlx.custom_kernels import backend, env_int
from hf2q_mlx.custom_kernels import tq_flash_tc as tc
from hf2q_mlx.custom_kernels._render import Example, Kernel, launch_bounds
from hf2q_mlx.custom_kernels.decode_attention import CountedPlan
from hf2q_mlx.custom_kernels.tq_quantize import stand_in
from hf2q_mlx.errors import InvalidArgumentError

# the kernels cover up to this many query rows per sequence (decode, short drafts)
MAX_FLASH_QUERIES = 8


# ---- kernels ----------------------------------------------------------------------------------
# consts (int32): capacity (slots in the buffers), window, partitions, scale as fp32 bits; built
# once per distinct value (``_consts``). off: the cache offset, a one-element view of a device
# table (``_offset_view``), so no host-written buffer reaches the GPU per step; with ROWS, (B,)
# offsets and (B, Hkv, D) key / value scales, one per batch row (a static cache's rows). OFF_ADD
# is added to the offsets read: a static step passes its positions as they are and the call's
# token count here, so a recorded CUDA graph reads the step's own position input.
# Partials (rows = B * Hq * M, partitions, PV + 2) fp32: the partition's unnormalized weighted
# values (rotated domain), then its running max and sum.

_PARTIAL_BODY = tc.with_shared_text(
    """
  // Thread mapping: one threadgroup of W SIMD groups per (partition, row group), KV head, batch
  // (gid_x = partition * NG + row group, so row groups reading the same keys run together).
  // Lane l owns rotated coordinates [l*CK, l*CK + CK) of every key and [l*CV, l*CV + CV) of
  // every value: a packed row is read coalesced by the SIMD group. SIMD group w walks tokens
  // start + (j*W + w)*U .. +U for j = 0, 1, ...; scores are per-lane partial dots plus a SIMD sum
  // (bit-identical on every lane), then an online softmax per row; the W SIMD groups' states
  // merge in shared memory at the end. Each pass loads the next U tokens' rows before working
  // on the current ones (one step of software pipelining). SK / SV (codes whole in 32-bit
  // words, each lane's bits a whole number of words): lane l owns a key row's words l, l + 32,
  // ... instead, so each load instruction reads 32 consecutive words (coalesced), and its
  // coordinates are those words' codes.
  // KR / VR copies of a codebook, interleaved (entry e's copy c at e * KR + c): lane l reads
  // copy l % KR, so a SIMD group's lookups of a large codebook touch fewer addresses per bank.
  const int CK = PK / 32;
  const int CV = PV / 32;
  const int KBITS = CK * KB;  // bits of one key row per lane
  const int VBITS = CV * VB;
  const int NKA = (KBITS + 31) / 32;  // words holding them once aligned to the lane's first bit
  const int NVA = (VBITS + 31) / 32;
  const int NKW = NKA + (KBITS % 32 != 0 ? 1 : 0);  // words loaded: one more if not word-aligned
  const int NVW = NVA + (VBITS % 32 != 0 ? 1 : 0);
  const int PMAX = PK > PV ? PK : PV;
  const int KPW = 32 / KB;  // codes per word (whole ones where SK)
  const int VPW = 32 / VB;
  SHARED float qs[RG * PMAX];  // rotated queries, later the merge buffer
  SHARED float kcb[(1 << KB) * KR];
  SHARED float vcb[(1 << VB) * VR];
  SHARED float wm[W * RG];
  SHARED float wl[W * RG];
@FOLD_SHARED@
@LAUNCH_VALUES@  const float NEG = -1e30f;  // finite: exp(NEG - m) is 0, never NaN

  for (uint i = tid; i < (1u << KB) * uint(KR); i += nthr) kcb[i] = kcodebook[i / uint(KR)];
  for (uint i = tid; i < (1u << VB) * uint(VR); i += nthr) vcb[i] = vcodebook[i / uint(VR)];
  const uint kcopy = lane % uint(KR);
  const uint vcopy = lane % uint(VR);
  int qpos[RG];
  float m_run[RG];
  float l_run[RG];
  float acc[RG][CV];
  UNROLL for (int i = 0; i < RG; ++i) {
    qpos[i] = offset - M + int((grp * uint(RG) + uint(i)) % uint(M));
    m_run[i] = NEG;
    l_run[i] = 0.0f;
    UNROLL for (int c = 0; c < CV; ++c) acc[i][c] = 0.0f;
  }
  const int n_slots = offset < cap ? offset : cap;
  const int per = (n_slots + n_parts - 1) / n_parts;
  const int chunk = (per + W * U - 1) / (W * U) * (W * U);
  const int start = int(part) * chunk;
  // end >= start even for a partition past the slots: every SIMD group makes the first pass
  const int end = start + chunk < n_slots ? start + chunk : (n_slots > start ? n_slots : start);
  const uint64_t head = uint64_t(b * uint(HKV) + kvh) * uint64_t(cap);
  const uint kw0 = (lane * uint(KBITS)) >> 5;  // SK = 0: the lane's first word
  const uint ksh = (lane * uint(KBITS)) & 31u;
  const uint vw0 = (lane * uint(VBITS)) >> 5;
  const uint vsh = (lane * uint(VBITS)) & 31u;
  const float vfac = 1.0f / sqrt_f(float(PV));  // a value coordinate is codebook * norm / sqrt(PV)
  // (offset - 1) mod cap, once: a slot t < cap is then one conditional add from its distance
  // (an integer modulo by the run-time cap per token cost ~20 instructions of a pass's ~1,200)
  const int last_slot = ((offset - 1) % cap + cap) % cap;

  // Software pipeline: each pass loads the rows of the SIMD group's next U tokens, then works
  // on the rows the previous pass loaded. The first pass has nothing to work on: it rotates the
  // queries (the only barriers before the merge; every SIMD group makes that pass) while its
  // loads are in flight.
  float qr[RG][CK];
  uint kw[U][NKW];
  uint vw[U][NVW];
  float kn[U];
  float vn[U];
  int pos[U];
  const int first = start + int(simd_id) * U;
  for (int t0 = first - W * U; t0 < end; t0 += W * U) {
    uint nkw[U][NKW];
    uint nvw[U][NVW];
    float nkn[U];
    float nvn[U];
    int npos[U];
    UNROLL for (int u = 0; u < U; ++u) {
      const int t = t0 + W * U + u;
      npos[u] = -1;
      nkn[u] = 0.0f;
      nvn[u] = 0.0f;
      UNROLL for (int k = 0; k < NKW; ++k) nkw[u][k] = 0u;
      UNROLL for (int k = 0; k < NVW; ++k) nvw[u][k] = 0u;
      if (t < end) {  // the same for every lane
        DEVICE_PTR(const uint) kr = krows + (head + uint64_t(t)) * uint64_t(KRW);
        DEVICE_PTR(const uint) vr = vrows + (head + uint64_t(t)) * uint64_t(VRW);
        // a word past the lane's bits may be the row's scale word, never past the row
        UNROLL for (int k = 0; k < NKW; ++k) {
          const uint wi = SK ? uint(k) * 32u + lane : kw0 + uint(k);
          nkw[u][k] = kr[wi < uint(KRW) ? wi : uint(KRW - 1)];
        }
        UNROLL for (int k = 0; k < NVW; ++k) {
          const uint wi = SV ? uint(k) * 32u + lane : vw0 + uint(k);
          nvw[u][k] = vr[wi < uint(VRW) ? wi : uint(VRW - 1)];
        }
        nkn[u] = bitcast<float>(kr[KRW - 1]);
        nvn[u] = bitcast<float>(vr[VRW - 1]) * vfac;
        // the slot's absolute position: (offset-1) - ((offset-1-t) mod cap), negative = empty;
        // 0 <= t < cap, so (offset-1-t) mod cap is last_slot - t, plus cap where negative
        int d = last_slot - t;
        if (d < 0) d += cap;
        npos[u] = offset - 1 - d;
      }
    }
    if (t0 < first) {
      // queries: key scale and sign flip, butterflies, then one factor for the orthonormal
      // transform, the codebook's 1 / sqrt(PK) and the softmax scale
@QUERY_ROTATION@      const float qscale = scale / float(PK);
      UNROLL for (int i = 0; i < RG; ++i) {
        UNROLL for (int c = 0; c < CK; ++c) {
          qr[i][c] = qs[i * PK + lane_coord(c, lane, CK, KPW, SK)] * qscale;
        }
      }
    } else {
      float s[U][RG];
      UNROLL for (int u = 0; u < U; ++u) {
        uint ka[NKA];  // the lane's key bits from bit 0: code c at bits [c*KB, c*KB + KB)
        UNROLL for (int k = 0; k < NKA; ++k) {
          ka[k] = KBITS % 32 == 0 ? kw[u][k]
                : uint(((uint64_t(kw[u][k < NKW - 1 ? k + 1 : k]) << 32) | kw[u][k]) >> ksh);
        }
        UNROLL for (int i = 0; i < RG; ++i) s[u][i] = 0.0f;
        UNROLL for (int c = 0; c < CK; ++c) {
          const int lo = (c * KB) >> 5;
          const int sh = (c * KB) & 31;
          uint code = ka[lo] >> sh;
          if (sh + KB > 32) code |= ka[lo + 1 < NKA ? lo + 1 : lo] << (32 - sh);
          const float kv = kcb[(code & ((1u << KB) - 1)) * uint(KR) + kcopy];
          UNROLL for (int i = 0; i < RG; ++i) s[u][i] = fma_f(qr[i][c], kv, s[u][i]);
        }
      }
      UNROLL for (int u = 0; u < U; ++u) {
        UNROLL for (int i = 0; i < RG; ++i) s[u][i] = simd_sum(s[u][i]) * kn[u];
      }
      // online softmax per row; s becomes the value weight p * norm / sqrt(PV)
      UNROLL for (int i = 0; i < RG; ++i) {
        float mb = NEG;
        UNROLL for (int u = 0; u < U; ++u) {
          const bool vis = pos[u] >= 0 && pos[u] <= qpos[i] && pos[u] > qpos[i] - window;
          s[u][i] = vis ? s[u][i] : NEG;
          mb = max_f(mb, s[u][i]);
        }
        if (mb > m_run[i]) {  // uniform: every lane holds the same scores
          const float alpha = exp_f(m_run[i] - mb);
          l_run[i] *= alpha;
          UNROLL for (int c = 0; c < CV; ++c) acc[i][c] *= alpha;
          m_run[i] = mb;
        }
        UNROLL for (int u = 0; u < U; ++u) {
          const float p = s[u][i] > NEG ? exp_f(s[u][i] - m_run[i]) : 0.0f;
          l_run[i] += p;
          s[u][i] = p * vn[u];
        }
      }
      UNROLL for (int u = 0; u < U; ++u) {
        uint va[NVA];
        UNROLL for (int k = 0; k < NVA; ++k) {
          va[k] = VBITS % 32 == 0 ? vw[u][k]
                : uint(((uint64_t(vw[u][k < NVW - 1 ? k + 1 : k]) << 32) | vw[u][k]) >> vsh);
        }
        UNROLL for (int c = 0; c < CV; ++c) {
          const int lo = (c * VB) >> 5;
          const int sh = (c * VB) & 31;
          uint code = va[lo] >> sh;
          if (sh + VB > 32) code |= va[lo + 1 < NVA ? lo + 1 : lo] << (32 - sh);
          const float vv = vcb[(code & ((1u << VB) - 1)) * uint(VR) + vcopy];
          UNROLL for (int i = 0; i < RG; ++i) acc[i][c] = fma_f(s[u][i], vv, acc[i][c]);
        }
      }
    }
    UNROLL for (int u = 0; u < U; ++u) {
      UNROLL for (int k = 0; k < NKW; ++k) kw[u][k] = nkw[u][k];
      UNROLL for (int k = 0; k < NVW; ++k) vw[u][k] = nvw[u][k];
      kn[u] = nkn[u];
      vn[u] = nvn[u];
      pos[u] = npos[u];
    }
  }

  // merge the SIMD groups: rescale each to the common max, sum into shared memory in turn
  if (lane == 0) {
    UNROLL for (int i = 0; i < RG; ++i) {
      wm[simd_id * uint(RG) + uint(i)] = m_run[i];
      wl[simd_id * uint(RG) + uint(i)] = l_run[i];
    }
  }
  BARRIER();  // also: every SIMD group has its queries in registers, qs is free
  float fac[RG];
  UNROLL for (int i = 0; i < RG; ++i) {
    float mall = NEG;
    for (int w = 0; w < W; ++w) mall = max_f(mall, wm[w * RG + i]);
    fac[i] = exp_f(m_run[i] - mall);
  }
  for (int w = 0; w < W; ++w) {
    if (int(simd_id) == w) {
      UNROLL for (int i = 0; i < RG; ++i) {
        UNROLL for (int c = 0; c < CV; ++c) {
          const int idx = i * PV + lane_coord(c, lane, CV, VPW, SV);
          qs[idx] = (w == 0 ? 0.0f : qs[idx]) + acc[i][c] * fac[i];
        }
      }
    }
    BARRIER();
  }
@PARTIALS_OUT@""",
    "uint(RG * PK / 2)",
)

# The reduce folded into the partial kernel (``tq_flash_decode_fused``): the threadgroup of a
# (batch, KV head, row group) that finishes last merges every partition of its rows. Partials go
# out as coherent stores above (FOLD) and come back as coherent loads here.
_FOLD_SHARED = """  SHARED float wts[@MAXP@];
  SHARED uint last_part[1];"""

_FOLD_BODY = """
  // The fold: count this threadgroup in on its (batch, KV head, row group) counter (set cset[0]
  // of the plan's, B * HKV * NG counters a set). The one taking ticket n_parts - 1 zeroes it for
  // the next call and, row by row, weighs each partition by its max and sum, sums their values
  // (thread t owns rotated coordinates t, t + nthr, ...), rotates back (butterflies in shared
  // memory), applies the sign flip and value scale and rounds once to T; the others leave. One
  // partition: no counter, that threadgroup merges.
  if (n_parts > 1) {
    BARRIER_DEVICE_FENCE();
    if (tid == 0) {
      const uint per_set = ngroups_z * uint(HKV * NG);
      DEVICE_PTR(uint) ctr = DEVICE_CAST(uint, counter) + size_t(cset[0]) * per_set
                             + (b * uint(HKV) + kvh) * uint(NG) + grp;
      const uint ticket = ATOMIC_ADD_U32(ctr, 1u);
      last_part[0] = ticket == uint(n_parts - 1) ? 1u : 0u;
      if (ticket == uint(n_parts - 1)) ATOMIC_STORE_U32(ctr, 0u);
    }
    BARRIER_DEVICE_FENCE();
    if (last_part[0] == 0u) return;  // the whole threadgroup leaves together
  } else {
    BARRIER_DEVICE_FENCE();
  }
  DEVICE_PTR(uint) pb = DEVICE_CAST(uint, partials);
  const uint kv_row = ROWS ? b * uint(HKV) + kvh : kvh;
  for (int i = 0; i < RG; ++i) {
    const uint r = grp * uint(RG) + uint(i);
    if (r >= uint(REP * M)) break;  // the same for every thread
    const uint h = kvh * uint(REP) + r / uint(M);
    const uint qrow = (b * uint(HKV * REP) + h) * uint(M) + r % uint(M);
    const uint64_t base = uint64_t(qrow) * uint64_t(n_parts) * uint64_t(PV + 2);
    float mall = NEG;
    for (int p = int(tid); p < n_parts; p += int(nthr))
      mall = max_f(mall, bitcast<float>(ATOMIC_LOAD_U32(pb + base + uint64_t(p) * (PV + 2) + PV)));
    mall = simd_max(mall);
    if (lane == 0) wm[simd_id] = mall;
    BARRIER();
    mall = wm[0];
    for (int w = 1; w < W; ++w) mall = max_f(mall, wm[w]);
    float den = 0.0f;
    for (int p = int(tid); p < n_parts; p += int(nthr)) {
      const uint64_t o = base + uint64_t(p) * uint64_t(PV + 2);
      const float wgt = exp_f(bitcast<float>(ATOMIC_LOAD_U32(pb + o + PV)) - mall);
      wts[p] = wgt;
      den = fma_f(wgt, bitcast<float>(ATOMIC_LOAD_U32(pb + o + PV + 1)), den);
    }
    den = simd_sum(den);
    if (lane == 0) wl[simd_id] = den;
    BARRIER();  // also: every partition's weight is in wts
    den = 0.0f;
    for (int w = 0; w < W; ++w) den += wl[w];
    for (int j = int(tid); j < PV; j += int(nthr)) {
@SUM@
      qs[j] = num / den;
    }
    BARRIER();
    for (uint hh = 1; hh < uint(PV); hh <<= 1) {
      for (uint t = tid; t < uint(PV / 2); t += nthr) {
        const uint a = (t / hh) * 2 * hh + (t % hh);
        const float x0 = qs[a];
        const float x1 = qs[a + hh];
        qs[a] = x0 + x1;
        qs[a + hh] = x0 - x1;
      }
      BARRIER();
    }
    for (int j = int(tid); j < DV; j += int(nthr)) {
      float o = qs[j] * (1.0f / sqrt_f(float(PV))) * vsigns[j];
      if (HAS_VS) o *= vscale[kv_row * uint(DV) + uint(j)];
      out[uint64_t(qrow) * uint64_t(DV) + uint64_t(j)] = from_float<T>(o);
    }
    BARRIER();  // qs, wm, wl and wts serve the next row
  }
"""

# loads in flight per thread in the sum over partitions (one at a time cost a memory latency
# per partition: ~0.37 us each on the H100, session 31)
_SUM_LOADS = 8


def _weighted_sum(load: str) -> str:
    """Code for ``@SUM@``: ``const float num`` = the sum over partitions p of ``wts[p] * LOAD``
    (``load`` written with ``p_k`` for p), _SUM_LOADS independent chains of loads at a time,
    added up in a fixed order at the end."""
    n = _SUM_LOADS
    total = " + ".join(f"num_[{k}]" for k in range(n))
    return f"""  float num_[{n}];
  UNROLL for (int k = 0; k < {n}; ++k) num_[k] = 0.0f;
  for (int p = 0; p < n_parts; p += {n}) {{
    float ld_[{n}];
    UNROLL for (int k = 0; k < {n}; ++k) {{
      const int p_k = p + k < n_parts ? p + k : n_parts - 1;
      ld_[k] = {load};
    }}
    UNROLL for (int k = 0; k < {n}; ++k) {{
      if (p + k < n_parts) num_[k] = fma_f(wts[p + k], ld_[k], num_[k]);
    }}
  }}
  const float num = {total};"""


_REDUCE_BODY = """
  // One threadgroup per query row, one thread per rotated output coordinate (PV threads): the
  // partitions' maxima and weights in parallel (shared memory), then each thread's weighted sum
  // over partitions, the inverse rotation (butterflies in shared memory, the sign flip), the
  // value scale of the row's KV head (of its batch row with ROWS) and one rounding to T.
  SHARED float buf[PV];
  SHARED float wts[MAXP];
  SHARED float red[PV / 32];
  const uint row = gid_x;
  const uint j = tid;
  const int n_parts = consts[2];
  DEVICE_PTR(const float) base = partials + uint64_t(row) * uint64_t(n_parts) * uint64_t(PV + 2);
  float m = -1e30f;
  for (int p = int(j); p < n_parts; p += PV) m = max_f(m, base[p * (PV + 2) + PV]);
  m = simd_max(m);
  if (lane == 0) red[simd_id] = m;
  BARRIER();
  m = red[0];
  for (int s = 1; s < PV / 32; ++s) m = max_f(m, red[s]);
  float den = 0.0f;
  for (int p = int(j); p < n_parts; p += PV) {
    const float w = exp_f(base[p * (PV + 2) + PV] - m);
    wts[p] = w;
    den = fma_f(w, base[p * (PV + 2) + PV + 1], den);
  }
  den = simd_sum(den);
  BARRIER();  // every thread has read red[] (the maximum) and written its weights
  if (lane == 0) red[simd_id] = den;
  BARRIER();
  den = 0.0f;
  for (int s = 0; s < PV / 32; ++s) den += red[s];
@SUM@
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
    float o = buf[j] * (1.0f / sqrt_f(float(PV))) * vsigns[j];
    const uint kv_row = ROWS ? row / uint(M * REP) : (row / uint(M)) % uint(HKV * REP) / uint(REP);
    if (HAS_VS) o *= vscale[kv_row * uint(DV) + j];
    out[row * uint(DV) + j] = from_float<T>(o);
  }
"""


def strided_words(p: int, bits: int, on: bool | int = True) -> int:
    """SK / SV of the partial kernel: 1 where ``on`` and a lane's codes of a P-wide row are
    whole 32-bit words (bits dividing 32, (P / 32) * bits a multiple of 32: 2, 4, 8 bits at
    P >= 256, 4 and 8 at 128), so the lanes can read the row's words 32 at a time."""
    return int(bool(on) and 32 % bits == 0 and (p // 32) * bits % 32 == 0)


def _partial_example(
    dt, dk, dv, kb, vb, rep, m, rg, ng, hkv, u, rows=0, fold=0, sw=0, kr=1, vr=1
) -> Example:
    pk, pv = max(32, 1 << (dk - 1).bit_length()), max(32, 1 << (dv - 1).bit_length())
    inputs = {"q": dt, "krows": mx.uint32, "vrows": mx.uint32, "ksigns": mx.float32,
              "kscale": mx.float32, "kcodebook": mx.float32, "vcodebook": mx.float32,
              "consts": (mx.int32, 4), "off": (mx.int32, 1)}  # fmt: skip
    outputs = {"partials": mx.float32}
    template = {"T": dt, "DK": dk, "PK": pk, "DV": dv, "PV": pv, "KB": kb, "VB": vb, "REP": rep,
                "M": m, "RG": rg, "NG": ng, "HKV": hkv, "KRW": pk * kb // 32 + 1,
                "VRW": pv * vb // 32 + 1, "W": _W, "U": u, "HAS_KS": 1, "ROWS": rows,
                "OFF_ADD": rows, "FOLD": fold, "SK": strided_words(pk, kb, sw),
                "SV": strided_words(pv, vb, sw), "KR": kr, "VR": vr}  # fmt: skip
    if fold:
        inputs.update(vsigns=mx.float32, vscale=mx.float32, counter=(mx.uint32, 64),
                      cset=(mx.int32, 1))  # fmt: skip
        outputs["out"] = dt
        template["HAS_VS"] = 1
    return Example(inputs, outputs, template)


# SIMD groups per flash-decode threadgroup; most split-K partitions (the reduce's shared weights)
_W = 4
_MAX_PARTS = 512

# the coordinate of a lane's c-th code of a row: c of its own ``per_lane`` consecutive ones, or
# (``strided``: SK / SV) code c % per_word of its word c / per_word, the row's words lane,
# lane + 32, ...
_COORD_HEADER = """
FN int lane_coord(int c, uint lane, int per_lane, int per_word, int strided) {
  return strided ? ((c / per_word) * 32 + int(lane)) * per_word + c % per_word
                 : int(lane) * per_lane + c;
}
"""

_PARTIAL_INPUTS = ["q", "krows", "vrows", "ksigns", "kscale", "kcodebook", "vcodebook", "consts",
                   "off"]  # fmt: skip

_partial_kernel = Kernel(
    "tq_flash_decode_partial",
    inputs=_PARTIAL_INPUTS,
    outputs=["partials"],
    body=_PARTIAL_BODY.replace("@FOLD_SHARED@", ""),
    header=_COORD_HEADER,
    examples=[
        _partial_example(mx.bfloat16, 256, 256, 4, 4, 4, 1, 4, 1, 1, 8),  # Gemma 3 270M
        _partial_example(mx.float16, 512, 512, 8, 3, 8, 1, 4, 2, 2, 2),  # Gemma 4 global layer
        _partial_example(mx.float32, 96, 64, 5, 6, 3, 4, 6, 2, 2, 4),  # padded K, small M
        _partial_example(mx.bfloat16, 256, 256, 8, 8, 2, 1, 2, 1, 4, 2, 1),  # static cache rows
        _partial_example(mx.bfloat16, 512, 512, 8, 4, 8, 1, 4, 2, 2, 2, sw=1),  # coalesced
        _partial_example(mx.bfloat16, 512, 512, 8, 8, 8, 1, 4, 2, 2, 2, sw=1, kr=16, vr=16),
    ],
)

# the partial kernel with the reduce folded in (FOLD): one launch writes the output
_fused_kernel = Kernel(
    "tq_flash_decode_fused",
    inputs=_PARTIAL_INPUTS + ["vsigns", "vscale", "counter", "cset"],
    outputs=["partials", "out"],
    body=_PARTIAL_BODY.replace("@FOLD_SHARED@", _FOLD_SHARED.replace("@MAXP@", str(_MAX_PARTS)))
    + _FOLD_BODY.replace(
        "@SUM@",
        _weighted_sum("bitcast<float>(ATOMIC_LOAD_U32(pb + base + uint64_t(p_k) * (PV + 2) + j))"),
    ),
    header=_COORD_HEADER,
    examples=[
        _partial_example(mx.bfloat16, 256, 256, 4, 4, 4, 1, 4, 1, 1, 8, fold=1),
        _partial_example(mx.float32, 96, 64, 5, 6, 3, 4, 6, 2, 2, 4, fold=1),
        _partial_example(mx.bfloat16, 256, 256, 8, 8, 2, 1, 2, 1, 4, 2, 1, fold=1),
        _partial_example(mx.bfloat16, 256, 256, 4, 8, 2, 1, 2, 1, 4, 2, fold=1, sw=1, vr=16),
    ],
)

_reduce_kernel = Kernel(
    "tq_flash_decode_reduce",
    inputs=["partials", "vsigns", "vscale", "consts"],
    outputs=["out"],
    body=_REDUCE_BODY.replace("@SUM@", _weighted_sum("base[p_k * (PV + 2) + int(j)]")),
    examples=[
        Example(
            {
                "partials": mx.float32,
                "vsigns": mx.float32,
                "vscale": mx.float32,
                "consts": (mx.int32, 4),
            },
            {"out": dt},
            {
                "T": dt,
                "DV": dv,
                "PV": pv,
                "M": m,
                "HKV": hkv,
                "REP": rep,
                "HAS_VS": 1,
                "MAXP": _MAX_PARTS,
                "ROWS": rows,
            },
        )  # fmt: skip
        for dt, dv, pv, m, hkv, rep, rows in (
            (mx.bfloat16, 256, 256, 1, 8, 2, 0),
            (mx.float32, 80, 128, 3, 2, 4, 0),
            (mx.bfloat16, 256, 256, 2, 4, 2, 1),
        )
    ],
)

# per lane of the partial kernel: RG * (CK + CV) query and accumulator registers at most
_MAX_REGS = 128
# threadgroups the partitions aim at (about four per SM of an H200)
_TARGET_GROUPS = 528


def row_regs() -> int:
    """Registers a lane gives query rows x coordinates (``row_groups``): HF2Q_TQ_ROW_REGS (16..256)
    where set, else _MAX_REGS (A/B runs: 64 halves a global layer's rows per threadgroup)."""
    return env_int("HF2Q_TQ_ROW_REGS", 16, 256) or _MAX_REGS


def row_groups(rows: int, pk: int, pv: int) -> tuple[int, int]:
    """(rows per threadgroup RG, number of row groups) for ``rows`` = REP * M query rows."""
    cap = max(1, min(8, row_regs() // (pk // 32 + pv // 32)))
    n = -(-rows // cap)
    return -(-rows // n), n


def tokens_per_step(pk: int, pv: int, kb: int, vb: int) -> int:
    """U: tokens a SIMD group loads at once, so that each lane has ~16 words in flight."""
    words = -(-(pk // 32 * kb) // 32) + -(-(pv // 32 * vb) // 32)
    return max(1, min(8, 16 // words))


def min_keys(rows: int, pv: int, tokens: int, row_words: int) -> int:
    """Fewest keys worth a partition: 16 steps of ``tokens`` (4 for each of the default 4 SIMD
    groups; more SIMD groups split the same keys), and the partition's partials (rows * (pv + 2)
    floats) at most 1/8 of the K+V bytes it reads (``row_words`` words per token)."""
    return max(16 * tokens, -(-8 * rows * (pv + 2) // row_words))


def simd_groups() -> int:
    """SIMD groups per flash-decode threadgroup: HF2Q_TQ_W (2..8: 16 SIMD groups of a global
    layer's 222 registers would not fit one SM) where set, else _W. A plan is made per value
    (A/B runs: bench/turboquant_speed.py --tq-env HF2Q_TQ_W=8)."""
    return env_int("HF2Q_TQ_W", 2, 8) or _W


def coalesced() -> bool:
    """Lanes own strided words of the packed rows where ``strided_words`` allows (each load
    instruction of a SIMD group then reads 128 consecutive bytes, not 32 lanes x 4 bytes at a
    16-byte stride): HF2Q_TQ_COALESCE (0 or 1) where set, else _COALESCE. On by default since
    session 34 (H200, the 8-bit partial kernel 1.31x at global 4K, 1.24x at 16K; docs/
    kernel_notes.md)."""
    on = env_int("HF2Q_TQ_COALESCE", 0, 1)
    return _COALESCE if on is None else on == 1


_COALESCE = True

# Threadgroups an SM the partial kernel's registers are budgeted for (``min_blocks``): 0 leaves
# nvcc's choice (224 registers on a global TQ8 layer: two threadgroups, 8 SIMD groups an SM; the
# kernel stalls on fixed-latency dependencies first, ncu session 34). 3 caps it at 168 (184
# bytes spilled, nvcc sm_90).
_MIN_BLOCKS = 0


def min_blocks() -> int:
    """HF2Q_TQ_MIN_BLOCKS (1..8) where set, else _MIN_BLOCKS: launch bounds on the partial
    kernel's own CUDA units (the graph's and the cubin cache's; MLX's builds take none), 0 none."""
    v = env_int("HF2Q_TQ_MIN_BLOCKS", 0, 8)
    return _MIN_BLOCKS if v is None else v


# Copies of a codebook of more than 32 entries in shared memory (``codebook_copies``): with one,
# a SIMD group's 32 lookups of a 256-entry codebook meet ~3.1 addresses in their busiest bank
# (ncu, TQ8 global 4K: 2.8 shared wavefronts per load); with 16, at most 2; with 32, 1.
_CB_COPIES = 1
# bytes of threadgroup memory a partial kernel may declare (Metal's limit; CUDA's static is 48K)
_SHARED_BYTES = {"cuda": 48 * 1024, "metal": 32 * 1024}


def cb_copies() -> int:
    """HF2Q_TQ_CB_COPIES (1, 2, 4, 8, 16 or 32) where set, else _CB_COPIES."""
    copies = env_int("HF2Q_TQ_CB_COPIES", 1, 32) or _CB_COPIES
    if copies & (copies - 1):
        raise InvalidArgumentError(f"HF2Q_TQ_CB_COPIES={copies}: expected a power of two")
    return copies


def codebook_copies(kb: int, vb: int, rg: int, pk: int, pv: int, w: int, fold: bool) -> tuple:
    """(KR, VR): ``cb_copies()`` copies of the key and value codebooks of more than 32 entries
    (smaller ones sit in distinct banks already), the keys' first, while the kernel's shared
    memory stays within the back end's limit."""
    used = 4 * (rg * max(pk, pv) + (1 << kb) + (1 << vb) + 2 * w * rg + (_MAX_PARTS if fold else 0))
    limit = _SHARED_BYTES.get(backend() or "", _SHARED_BYTES["metal"])
    return tc.copies_within(kb, vb, cb_copies(), used, limit)


def default_parts(capacity: int, groups: int, keys: int) -> int:
    """Split-K partitions over a buffer of ``capacity`` slots, for ``groups`` threadgroups per
    partition: at least ``keys`` keys each (``min_keys``), else enough to fill ~_TARGET_GROUPS
    threadgroups, at most _MAX_PARTS. Depends on the capacity, not the offset, so a ring or a grown
    cache keeps one launch shape."""
    by_work = -(-capacity // keys)
    by_fill = max(1, -(-_TARGET_GROUPS // groups))
    return max(1, min(by_work, by_fill, _MAX_PARTS))


_CONSTS: dict[tuple, mx.array] = {}
_OFFSETS: list = [None]
_PLANS: dict[tuple, tuple] = {}


def _consts(capacity: int, window: int, n_parts: int, scale: float) -> mx.array:
    """The per-shape int32 constants, made once per distinct value (a host-made array read by
    the GPU costs a page migration; these change only when a growing cache grows)."""
    key = (capacity, window, n_parts, scale)
    a = _CONSTS.get(key)
    if a is None:
        if len(_CONSTS) >= 4096:
            _CONSTS.clear()
        bits = int(np.array(scale, dtype=np.float32).view(np.int32))
        a = _CONSTS[key] = mx.array([capacity, min(window, 1 << 30), n_parts, bits], mx.int32)
    return a


def _offset_view(offset: int) -> mx.array:
    """A one-element int32 array holding ``offset``: a view into a device-made table, so the
    per-step value costs no host-to-device transfer."""
    table = _OFFSETS[0]
    if table is None or table.shape[0] <= offset:
        table = _OFFSETS[0] = mx.arange(
            max(1 << 16, 1 << (offset + 1).bit_length()), dtype=mx.int32
        )
    return table[offset : offset + 1]


def _flash_plan(
    queries: mx.array, keys: mx.array, pk: int, kb: int, dv: int, pv: int, vb: int,
    has_ks: bool, has_vs: bool, rows: bool = False, offset_add: int = 0, fold: bool = False,
):  # fmt: skip
    """(partial launch, reduce launch, partition count) for one call signature, or None where
    the kernels do not apply. ``fold``: (``CountedPlan`` of the fused launch, None, count)."""
    B, Hq, M, Dk = queries.shape
    Hkv, capacity, krw = keys.shape[1:]
    vrw = pv * vb // 32 + 1
    covered = (
        queries.dtype in (mx.float16, mx.bfloat16, mx.float32)
        and M <= MAX_FLASH_QUERIES
        and Hq % Hkv == 0
        and pk == max(32, 1 << (Dk - 1).bit_length())  # the queries' padded dim
        and pk <= 1024  # RG * PK floats of shared memory
        and pv <= 1024  # one reduce thread per output coordinate
    )
    if not covered:
        return None
    rep = Hq // Hkv
    in_dtypes = [queries.dtype, mx.uint32, mx.uint32] + [mx.float32] * 4 + [mx.int32, mx.int32]
    if tc.tensor_cores() and backend() == "cuda" and tc.covers(pk, pv, kb, vb, fold):
        return _tensor_core_plan(queries, Hkv, capacity, krw, vrw, pk, kb, dv, pv, vb, has_ks,
                                 has_vs, rows, offset_add, in_dtypes)  # fmt: skip
    rg, ng = row_groups(rep * M, pk, pv)
    u = tokens_per_step(pk, pv, kb, vb)
    w = simd_groups()
    co = coalesced()
    kr, vr = codebook_copies(kb, vb, rg, pk, pv, w, fold)
    n_parts = default_parts(capacity, B * Hkv * ng, min_keys(rep * M, pv, u, krw + vrw))
    template = {"T": queries.dtype, "DK": Dk, "PK": pk, "DV": dv, "PV": pv, "KB": kb,
                "VB": vb, "REP": rep, "M": M, "RG": rg, "NG": ng, "HKV": Hkv, "KRW": krw,
                "VRW": vrw, "W": w, "U": u, "HAS_KS": int(has_ks), "ROWS": int(rows),
                "OFF_ADD": offset_add, "FOLD": int(fold), "SK": strided_words(pk, kb, co),
                "SV": strided_words(pv, vb, co), "KR": kr, "VR": vr}  # fmt: skip
    template.update(launch_bounds(32 * w, min_blocks()))
    geometry = dict(grid=(n_parts * ng * 32 * w, Hkv, B), threadgroup=(32 * w, 1, 1))
    if fold:
        fused = _fused_kernel.launcher(
            in_dtypes + [mx.float32, mx.float32, mx.uint32, mx.int32],
            output_shapes=[(B * Hq * M, n_parts, pv + 2), (B, Hq, M, dv)],
            output_dtypes=[mx.float32, queries.dtype],
            template={**template, "HAS_VS": int(has_vs)},
            **geometry,
        )
        return CountedPlan(fused, (), B * Hkv * ng, n_parts), None, n_parts
    partial = _partial_kernel.launcher(
        in_dtypes,
        output_shapes=[(B * Hq * M, n_parts, pv + 2)],
        output_dtypes=[mx.float32],
        template=template,
        **geometry,
    )
    return partial, _reduce_launch(queries, Hkv, dv, pv, has_vs, rows), n_parts


def _reduce_launch(queries: mx.array, Hkv: int, dv: int, pv: int, has_vs: bool, rows: bool):
    """The reduce's launch: one threadgroup of PV threads a query row."""
    B, Hq, M, _ = queries.shape
    return _reduce_kernel.launcher(
        [mx.float32, mx.float32, mx.float32, mx.int32],
        grid=(B * Hq * M * pv,),
        threadgroup=(pv,),
        output_shapes=[(B, Hq, M, dv)],
        output_dtypes=[queries.dtype],
        template={"T": queries.dtype, "DV": dv, "PV": pv, "M": M, "HKV": Hkv, "REP": Hq // Hkv,
                  "HAS_VS": int(has_vs), "MAXP": _MAX_PARTS, "ROWS": int(rows)},
    )  # fmt: skip


# a tensor-core partition holds at least this many steps of every SIMD group (16 tokens each)
_TC_STEPS = 2


def _tensor_core_plan(
    queries: mx.array, Hkv: int, capacity: int, krw: int, vrw: int, pk: int, kb: int, dv: int,
    pv: int, vb: int, has_ks: bool, has_vs: bool, rows: bool, offset_add: int, in_dtypes: list,
):  # fmt: skip
    """(partial launch on tensor cores, the reduce, partition count): 8 query rows a
    threadgroup, the partitions by the scalar kernel's rule with 16-token steps."""
    B, Hq, M, Dk = queries.shape
    rep = Hq // Hkv
    ng = tc.row_groups(rep * M)
    w = simd_groups()
    keys = max(_TC_STEPS * w * tc.STEP_TOKENS, min_keys(rep * M, pv, 1, krw + vrw))
    n_parts = default_parts(capacity, B * Hkv * ng, keys)
    template = {"T": queries.dtype, "DK": Dk, "PK": pk, "DV": dv, "PV": pv, "KB": kb, "VB": vb,
                "REP": rep, "M": M, "NG": ng, "HKV": Hkv, "KRW": krw, "VRW": vrw, "W": w,
                "HAS_KS": int(has_ks), "ROWS": int(rows), "OFF_ADD": offset_add}  # fmt: skip
    template["KR"], template["VR"] = tc.codebook_copies(pk, pv, kb, vb, w)
    template.update(launch_bounds(32 * w, min_blocks()))
    partial = tc.kernel.launcher(
        in_dtypes,
        output_shapes=[(B * Hq * M, n_parts, pv + 2)],
        output_dtypes=[mx.float32],
        template=template,
        grid=(n_parts * ng * 32 * w, Hkv, B),
        threadgroup=(32 * w, 1, 1),
    )
    return partial, _reduce_launch(queries, Hkv, dv, pv, has_vs, rows), n_parts


def flash_decode(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    *,
    k_signs: mx.array,
    k_codebook: mx.array,
    k_bits: int,
    k_scale: mx.array | None,
    v_signs: mx.array,
    v_codebook: mx.array,
    v_bits: int,
    v_dim: int,
    v_scale: mx.array | None,
    offset: int | mx.array,
    window: int,
    scale: float,
    offset_add: int = 0,
) -> mx.array | None:
    """queries (B, Hq, M, Dk) -> (B, Hq, M, v_dim) in queries.dtype on the GPU kernels, or None
    where they do not run (no GPU back end, an empty cache, a shape they do not cover): the
    caller then runs its reference.

    ``keys`` / ``values`` (B, Hkv, capacity, row words) uint32: packed rows, slot s holding
    position ``(offset-1) - ((offset-1-s) % capacity)``; ``window``: the sliding window (a huge
    value for full attention). ``*_signs`` (P,) / ``*_codebook`` / ``*_bits``: each codec's
    tables. ``k_scale`` / ``v_scale`` (Hkv, D) fp32 or None: the partial kernel multiplies the
    queries by the key scales as it loads them, the reduce kernel the fp32 output by the value
    scales before its one rounding to the queries' dtype. Two launches in all, or one with the
    reduce folded into the partial kernel (``fold()``: HF2Q_TQ_FOLD=1).

    ``offset`` as a (B,) int32 array: each batch row's own, plus ``offset_add`` (at least 1: a
    static cache's rows, read on the device), and the scales, where given, (B, Hkv, D): one per
    row.
    """
    capacity = keys.shape[2]
    rows = isinstance(offset, mx.array)
    if not rows:
        offset, offset_add = offset + offset_add, 0
    if backend() is None or (not rows and min(offset, capacity) == 0):
        return None
    pk, pv = k_signs.shape[0], v_signs.shape[0]
    has_ks, has_vs = k_scale is not None, v_scale is not None
    # ints only (the codecs' signs and codebooks are inputs, not part of the plan)
    folded = fold()
    key = (queries.shape, queries.dtype, keys.shape, pk, k_bits, v_dim, pv, v_bits, has_ks,
           has_vs, rows, offset_add, folded, simd_groups(), coalesced(),
           cb_copies(), min_blocks(), row_regs(), tc.tensor_cores())  # fmt: skip
    plan = _PLANS.get(key, _MISSING)
    if plan is _MISSING:
        if len(_PLANS) >= 1024:
            _PLANS.clear()
        plan = _PLANS[key] = _flash_plan(
            queries, keys, pk, k_bits, v_dim, pv, v_bits, has_ks, has_vs, rows, offset_add,
            folded,
        )  # fmt: skip
    if plan is None:
        return None
    partial, reduce, n_parts = plan
    consts = _consts(capacity, window, n_parts, scale)
    ks = stand_in() if k_scale is None else k_scale
    vs = stand_in() if v_scale is None else v_scale
    off = offset.astype(mx.int32) if rows else _offset_view(offset)
    inputs = [queries, keys, values, k_signs, ks, k_codebook, v_codebook, consts, off]
    if reduce is None:  # folded: partial is a CountedPlan (its counter and this call's set)
        return partial.launch(inputs=inputs + [v_signs, vs, *partial.inputs()])[1]
    (partials,) = partial(inputs=inputs)
    return reduce(inputs=[partials, v_signs, vs, consts])[0]


def fold() -> bool:
    """The reduce folded into the partial kernel (one launch a call): HF2Q_TQ_FOLD=1. Off by
    default until its H200 run (its CPU emulator tests pass)."""
    return env_int("HF2Q_TQ_FOLD", 0, 1) == 1


_MISSING = object()
