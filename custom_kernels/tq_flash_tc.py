"""The TurboQuant flash-decode partial kernel on tensor cores (``HF2Q_TQ_TC=1``, CUDA).

The scalar partial kernel (``tq_flash_decode``) spends ~800 instructions a token on a SIMD
group: every lane multiplies its coordinates into each query row and sums across the SIMD
group per row and token, and a KV head's rows split into groups that decode the same codes
again. Here a SIMD group takes 16 tokens at a time and all of a KV head's query rows (up to
8) at once: the scores are Q (rows x PK) times the decoded keys, the value sum the decoded
values times the weights, both as tf32 mma with fp32 accumulation. A decoded code is looked
up once and serves every row; the sums over coordinates happen inside the mma.

Precision: fp32 in, fp32 out. The centroids are tf32 values (``TQCodec.codebook``), so a
decoded code is exact; the queries and the value weights split into a tf32 head and a tail
(``hi = tf32(x)``, ``lo = tf32(x - hi)``: 22 bits of the 24), the queries' as rows 0-7 and 8-15
of the score mma's A (one mma adds both), the weights' as two mma. What is left out (the tail's
own rounding) is below 2^-22 of each product.

The partials (rows, partitions, PV + 2) are the scalar kernel's, so its reduce merges them.
"""

from __future__ import annotations

import mlx.core as mx

from hf2q_mlx.custom_kernels import env_int
from hf2q_mlx.custom_kernels._render import Example, Kernel

# query rows a threadgroup takes (the mma's 8 columns / the score tile's 8 real rows)
ROWS_PER_GROUP = 8
# tokens a SIMD group takes per step (two 8-token tiles)
STEP_TOKENS = 16

# Kernel text shared with the scalar partial (``tq_flash_decode``): the launch's values, the
# rotated queries of a row group (RG rows; @PAIRS@: the butterfly pairs worked on) into ``qs``,
# and the partials' write from the merge buffer.
LAUNCH_VALUES = """  const uint b = gid_z;
  const int offset = off[ROWS ? b : 0u] + OFF_ADD;
  const int cap = consts[0];
  const int window = consts[1];
  const int n_parts = consts[2];
  const float scale = bitcast<float>(consts[3]);
  const uint part = gid_x / uint(NG);
  const uint grp = gid_x % uint(NG);
  const uint kvh = gid_y;
  const uint nthr = uint(W * 32);
"""
QUERY_ROTATION = """  {  // a thread's query loads all in flight (a loop waited on each)
    const int QL = (RG * PK + W * 32 - 1) / (W * 32);
    float ql_[QL];
    UNROLL for (int e = 0; e < QL; ++e) {
      const uint idx = tid + uint(e) * nthr;
      const uint i = idx / uint(PK);
      const uint j = idx % uint(PK);
      const uint r = grp * uint(RG) + i;
      float v = 0.0f;
      if (idx < uint(RG * PK) && r < uint(REP * M) && j < uint(DK)) {
        const uint h = kvh * uint(REP) + r / uint(M);
        const uint qrow = (b * uint(HKV * REP) + h) * uint(M) + r % uint(M);
        v = to_float(q[qrow * uint(DK) + j]) * ksigns[j];
        if (HAS_KS) v *= kscale[((ROWS ? b * uint(HKV) : 0u) + kvh) * uint(DK) + j];
      }
      ql_[e] = v;
    }
    UNROLL for (int e = 0; e < QL; ++e) {
      const uint idx = tid + uint(e) * nthr;
      if (idx < uint(RG * PK)) qs[idx] = ql_[e];
    }
  }
  BARRIER();
  for (uint h = 1; h < uint(PK); h <<= 1) {
    for (uint x = tid; x < @PAIRS@; x += nthr) {
      const uint i = x / uint(PK / 2);
      const uint jj = x % uint(PK / 2);
      const uint a = i * uint(PK) + (jj / h) * 2 * h + (jj % h);
      const float x0 = qs[a];
      const float x1 = qs[a + h];
      qs[a] = x0 + x1;
      qs[a + h] = x0 - x1;
    }
    BARRIER();
  }
"""
PARTIALS_OUT = """  for (uint idx = tid; idx < uint(RG * (PV + 2)); idx += nthr) {
    const uint i = idx / uint(PV + 2);
    const uint j = idx % uint(PV + 2);
    const uint r = grp * uint(RG) + i;
    if (r < uint(REP * M)) {
      const uint h = kvh * uint(REP) + r / uint(M);
      const uint qrow = (b * uint(HKV * REP) + h) * uint(M) + r % uint(M);
      const uint64_t o = (uint64_t(qrow) * uint64_t(n_parts) + part) * uint64_t(PV + 2);
      float v;
      if (j < uint(PV)) {
        v = qs[i * uint(PV) + j];
      } else {
        float mall = NEG;
        for (int w = 0; w < W; ++w) mall = max_f(mall, wm[w * RG + int(i)]);
        float lall = 0.0f;
        for (int w = 0; w < W; ++w) lall += wl[w * RG + int(i)] * exp_f(wm[w * RG + int(i)] - mall);
        v = j == uint(PV) ? mall : lall;
      }
      if (FOLD) ATOMIC_STORE_U32(DEVICE_CAST(uint, partials) + o + j, bitcast<uint>(v));
      else partials[o + j] = v;
    }
  }
"""


def with_shared_text(body: str, pairs: str) -> str:
    """``body`` with the shared text in place of its @LAUNCH_VALUES@, @QUERY_ROTATION@ and
    @PARTIALS_OUT@ (``pairs``: the butterfly pairs a stage works on)."""
    return (
        body.replace("@LAUNCH_VALUES@", LAUNCH_VALUES)
        .replace("@QUERY_ROTATION@", QUERY_ROTATION.replace("@PAIRS@", pairs))
        .replace("@PARTIALS_OUT@", PARTIALS_OUT)
    )


_BODY = """
  // Thread mapping: one threadgroup of W SIMD groups per (partition, group of 8 query rows),
  // KV head, batch (gid_x = partition * NG + row group). SIMD group w takes the 16-token steps
  // start + (j * W + w) * 16. Lane l = 4 g + t (g = l / 4, t = l % 4), two 8-token tiles:
  //   scores (tf32 m16n8k8, rows 8-15 of A zero): S[row g][tile token] += Q[row][k] K[token][k]
  //     over k-steps of 8 coordinates; the lane's B values are key codes of token 8j + g, the
  //     coordinates of its quarter of the row (``tc_coord``: its words are t * VW.., so each
  //     vector load of a quad reads 16 VW consecutive bytes); Q's fragments sit in shared
  //     memory in the same order. The lane ends with row g's scores of tokens 2t, 2t + 1 of
  //     each tile: the four tokens whose weights it later feeds the value mma.
  //   values (m16n8k8): O[coord][row] += V[token][coord] P[row][token], 16 coordinates a tile
  //     of O, the tile's tokens in the order 2t -> k t, 2t + 1 -> k t + 4 (so the scores the
  //     lane holds are the B fragment it needs); the lane's A values are value codes of its four
  //     tokens at the coordinates of its eighth of the row (words g * VW..). It accumulates
  //     O[coord][rows 2t, 2t + 1] for its coordinates: PV / 4 floats.
  const int RG = 8;  // query rows a threadgroup (the shared text's name)
  const int FOLD = 0;
  const int KCPW = 32 / KB;  // codes a word
  const int VCPW = 32 / VB;
  const int KLW = PK * KB / 128;  // words of a key row a lane reads (a quarter of the row)
  const int VLW = PV * VB / 256;  // words of a value row a lane reads (an eighth)
  const int KVW = KLW < 4 ? KLW : 4;  // words a load
  const int VVW = VLW < 4 ? VLW : 4;
  const int KSTEPS = PK / 8;
  const int MT = PV / 16;
  const int QF = KSTEPS * 32;  // query fragments (float4: hi, hi, lo, lo)
  const int QPT = (QF + W * 32 - 1) / (W * 32);
  const int BUF4 = QF > 2 * PV ? QF : 2 * PV;  // float4s: the fragments, then the merge (8 x PV)
  SHARED float4 qf[BUF4];
  SHARED float kcb[(1 << KB) * KR];  // KR / VR interleaved copies: lane l reads copy l % KR
  SHARED float vcb[(1 << VB) * VR];
  SHARED float wm[W * 8];
  SHARED float wl[W * 8];
  SHARED_PTR(float) qs = (SHARED_PTR(float))qf;  // rotated queries (8 x PK), later the merge
@LAUNCH_VALUES@  const uint g = lane >> 2;
  const uint t = lane & 3u;
  const float NEG = -1e30f;  // finite: exp(NEG - m) is 0, never NaN

  // the codecs' centroids are tf32 values (TQCodec.codebook): the mma takes them exactly
  // (each level read once, its copies written from it: one round trip for 256 levels)
  for (uint i = tid; i < (1u << KB); i += nthr) {
    const float x = tf32_round(kcodebook[i]);
    UNROLL for (int c = 0; c < KR; ++c) kcb[i * uint(KR) + uint(c)] = x;
  }
  for (uint i = tid; i < (1u << VB); i += nthr) {
    const float x = tf32_round(vcodebook[i]);
    UNROLL for (int c = 0; c < VR; ++c) vcb[i * uint(VR) + uint(c)] = x;
  }
  // this lane's codebook copies: entry e at kcl[e * KR] (one add per lookup, not two)
  SHARED_PTR(const float) kcl = kcb + lane % uint(KR);
  SHARED_PTR(const float) vcl = vcb + lane % uint(VR);
  // queries: key scale and sign flip, butterflies, then one factor for the orthonormal
  // transform, the codebook's 1 / sqrt(PK) and the softmax scale
  // rows past REP * M stay zero: no butterflies for them
  const uint nrows = uint(REP * M) - grp * 8u < 8u ? uint(REP * M) - grp * 8u : 8u;
@QUERY_ROTATION@  {  // the fragments overwrite the rotated queries: all read first
    const float qscale = scale / float(PK);
    float qv[QPT][2];
    UNROLL for (int e = 0; e < QPT; ++e) {
      const uint idx = tid + uint(e) * nthr;
      qv[e][0] = 0.0f;
      qv[e][1] = 0.0f;
      if (idx < uint(QF)) {  // k-step idx / 32 of lane idx % 32: its codes 2s, 2s + 1
        const uint s = idx / 32u;
        const uint l = idx % 32u;
        const uint row = (l >> 2) * uint(PK);
        qv[e][0] = qs[row + tc_coord(2 * s, l & 3u, KCPW, KVW, 4)] * qscale;
        qv[e][1] = qs[row + tc_coord(2 * s + 1, l & 3u, KCPW, KVW, 4)] * qscale;
      }
    }
    BARRIER();
    UNROLL for (int e = 0; e < QPT; ++e) {
      const uint idx = tid + uint(e) * nthr;
      if (idx < uint(QF)) {
        float4 f;  // A's rows g (hi) and g + 8 (lo) at k = t, then at k = t + 4
        f.x = tf32_round(qv[e][0]);
        f.y = tf32_round(qv[e][0] - f.x);
        f.z = tf32_round(qv[e][1]);
        f.w = tf32_round(qv[e][1] - f.z);
        qf[idx] = f;
      }
    }
    BARRIER();
  }

  const int qpos = offset - M + int((grp * 8u + g) % uint(M));  // row g's position
  float m_run = NEG;  // row g's (the same on the lanes of a quad)
  float l_run = 0.0f;  // row g's sum over this lane's tokens
  float acc[MT][4];
  UNROLL for (int m = 0; m < MT; ++m) {
    UNROLL for (int c = 0; c < 4; ++c) acc[m][c] = 0.0f;
  }
  const int n_slots = offset < cap ? offset : cap;
  const int per = (n_slots + n_parts - 1) / n_parts;
  const int chunk = (per + W * 16 - 1) / (W * 16) * (W * 16);
  const int start = int(part) * chunk;
  const int end = start + chunk < n_slots ? start + chunk : n_slots;
  const uint64_t head = uint64_t(b * uint(HKV) + kvh) * uint64_t(cap);
  const float vfac = 1.0f / sqrt_f(float(PV));  // a value coordinate is codebook * norm / sqrt(PV)
  // (offset - 1) mod cap, once: a slot t < cap is then one conditional add from its distance
  const int last_slot = ((offset - 1) % cap + cap) % cap;
  const uint kmask = (1u << KB) - 1u;
  const uint vmask = (1u << VB) - 1u;

  for (int t0 = start + int(simd_id) * 16; t0 < end; t0 += W * 16) {
    // the lane's four tokens (scores and value weights): t0 + 2t, + 1, + 8, + 9
    float kn[4];
    float vn[4];
    int pos[4];
    UNROLL for (int e = 0; e < 4; ++e) {
      const int tk = t0 + 2 * int(t) + (e & 1) + 8 * (e >> 1);
      kn[e] = 0.0f;
      vn[e] = 0.0f;
      pos[e] = -1;
      if (tk < end) {
        kn[e] = bitcast<float>(krows[(head + uint64_t(tk)) * uint64_t(KRW) + uint64_t(KRW - 1)]);
        vn[e] = bitcast<float>(vrows[(head + uint64_t(tk)) * uint64_t(VRW) + uint64_t(VRW - 1)])
                * vfac;
        // the slot's absolute position: (offset-1) - ((offset-1-t) mod cap), negative = empty
        int d = last_slot - tk;
        if (d < 0) d += cap;
        pos[e] = offset - 1 - d;
      }
    }
    // scores: A's rows 0-7 are the queries' tf32 heads, rows 8-15 their tails, so one mma adds
    // both parts of each product (rows g and g + 8 of the tile: sc[j][0] + sc[j][2], ...)
    float sc[2][4];
    UNROLL for (int j = 0; j < 2; ++j) {
      UNROLL for (int c = 0; c < 4; ++c) sc[j][c] = 0.0f;
    }
    bool kok[2];
    DEVICE_PTR(const uint) kr[2];
    UNROLL for (int j = 0; j < 2; ++j) {
      const int tk = t0 + 8 * j + int(g);
      kok[j] = tk < end;
      kr[j] = krows + (head + uint64_t(kok[j] ? tk : t0)) * uint64_t(KRW);
    }
    UNROLL for (int jj = 0; jj < KLW / KVW; ++jj) {
      uint kw[2][KVW];
      UNROLL for (int j = 0; j < 2; ++j) {
        UNROLL for (int i = 0; i < KVW; ++i) {
          kw[j][i] = kok[j] ? kr[j][jj * 4 * KVW + int(t) * KVW + i] : 0u;
        }
      }
      UNROLL for (int i = 0; i < KVW; ++i) {
        UNROLL for (int c = 0; c < KCPW; c += 2) {
          const int s = ((jj * KVW + i) * KCPW + c) / 2;  // codes 2s, 2s + 1 of the lane
          const float4 qq = qf[s * 32 + int(lane)];
          const float a[4] = {qq.x, qq.y, qq.z, qq.w};
          UNROLL for (int j = 0; j < 2; ++j) {
            const float bk[2] = {kcl[((kw[j][i] >> (c * KB)) & kmask) * uint(KR)],
                                 kcl[((kw[j][i] >> ((c + 1) * KB)) & kmask) * uint(KR)]};
            mma_tf32_m16n8k8(sc[j], a, bk);
          }
        }
      }
    }
    // online softmax of row g over the step (the quad's 16 scores); p becomes the value weight
    // p * norm / sqrt(PV), split into tf32 hi / lo for the value mma
    float p[4];
    float mb = NEG;
    UNROLL for (int e = 0; e < 4; ++e) {
      const float s = (sc[e >> 1][e & 1] + sc[e >> 1][2 + (e & 1)]) * kn[e];
      const bool vis = pos[e] >= 0 && pos[e] <= qpos && pos[e] > qpos - window;
      p[e] = vis ? s : NEG;
      mb = max_f(mb, p[e]);
    }
    mb = max_f(mb, simd_shuffle_xor(mb, 1u));
    mb = max_f(mb, simd_shuffle_xor(mb, 2u));
    const float m_new = max_f(m_run, mb);
    const float alpha = exp_f(m_run - m_new);  // exactly 1 where the max stays
    m_run = m_new;
    l_run *= alpha;
    float ph[2][2];
    float pl[2][2];
    UNROLL for (int e = 0; e < 4; ++e) {
      const float w = p[e] > NEG ? exp_f(p[e] - m_new) : 0.0f;
      l_run += w;
      const float x = w * vn[e];
      ph[e >> 1][e & 1] = tf32_round(x);
      pl[e >> 1][e & 1] = tf32_round(x - ph[e >> 1][e & 1]);
    }
    // the accumulators hold rows 2t and 2t + 1: their factors from quads 2t, 2t + 1
    const float a0 = simd_shuffle(alpha, 8u * t);
    const float a1 = simd_shuffle(alpha, 8u * t + 4u);
    if (simd_any(a0 != 1.0f || a1 != 1.0f)) {
      UNROLL for (int m = 0; m < MT; ++m) {
        acc[m][0] *= a0;
        acc[m][1] *= a1;
        acc[m][2] *= a0;
        acc[m][3] *= a1;
      }
    }
    // values: tile j's A = (codes 2m, 2m + 1) x (tokens 2j, 2j + 1 of the lane's four)
    bool vok[4];
    DEVICE_PTR(const uint) vr[4];
    UNROLL for (int e = 0; e < 4; ++e) {
      const int tk = t0 + 2 * int(t) + (e & 1) + 8 * (e >> 1);
      vok[e] = tk < end;
      vr[e] = vrows + (head + uint64_t(vok[e] ? tk : t0)) * uint64_t(VRW);
    }
    UNROLL for (int jj = 0; jj < VLW / VVW; ++jj) {
      uint vw[4][VVW];
      UNROLL for (int e = 0; e < 4; ++e) {
        UNROLL for (int i = 0; i < VVW; ++i) {
          vw[e][i] = vok[e] ? vr[e][jj * 8 * VVW + int(g) * VVW + i] : 0u;
        }
      }
      UNROLL for (int i = 0; i < VVW; ++i) {
        UNROLL for (int c = 0; c < VCPW; c += 2) {
          const int m = ((jj * VVW + i) * VCPW + c) / 2;
          UNROLL for (int j = 0; j < 2; ++j) {
            const float av[4] = {vcl[((vw[2 * j][i] >> (c * VB)) & vmask) * uint(VR)],
                                 vcl[((vw[2 * j][i] >> ((c + 1) * VB)) & vmask) * uint(VR)],
                                 vcl[((vw[2 * j + 1][i] >> (c * VB)) & vmask) * uint(VR)],
                                 vcl[((vw[2 * j + 1][i] >> ((c + 1) * VB)) & vmask) * uint(VR)]};
            mma_tf32_m16n8k8(acc[m], av, ph[j]);
            mma_tf32_m16n8k8(acc[m], av, pl[j]);
          }
        }
      }
    }
  }

  // merge the SIMD groups: each rescaled to the common max, summed into shared memory in turn
  l_run += simd_shuffle_xor(l_run, 1u);
  l_run += simd_shuffle_xor(l_run, 2u);
  if (t == 0u) {
    wm[simd_id * 8u + g] = m_run;
    wl[simd_id * 8u + g] = l_run;
  }
  BARRIER();  // also: every SIMD group is done with the query fragments
  float fac[2];
  UNROLL for (int i = 0; i < 2; ++i) {
    const uint r = 2u * t + uint(i);
    float mall = NEG;
    for (int w = 0; w < W; ++w) mall = max_f(mall, wm[w * 8 + int(r)]);
    fac[i] = exp_f(wm[simd_id * 8u + r] - mall);
  }
  for (int w = 0; w < W; ++w) {
    if (int(simd_id) == w) {
      UNROLL for (int m = 0; m < MT; ++m) {
        UNROLL for (int c = 0; c < 4; ++c) {
          const int idx = int(2u * t + uint(c & 1)) * PV
                          + tc_coord(2 * m + (c >> 1), g, VCPW, VVW, 8);
          qs[idx] = (w == 0 ? 0.0f : qs[idx]) + acc[m][c] * fac[c & 1];
        }
      }
    }
    BARRIER();
  }
@PARTIALS_OUT@"""

# the coordinate of a lane's n-th code of a row: its words are the row's words (k / vw) *
# (quarters * vw) + part * vw + k % vw for k = 0, 1, ... (part: its quarter of a key row, t, or
# its eighth of a value row, g), each holding cpw codes in order
_HEADER = """
FN int tc_coord(uint n, uint part, int cpw, int vw, int parts) {
  const int k = int(n) / cpw;
  const int word = (k / vw) * (parts * vw) + int(part) * vw + k % vw;
  return word * cpw + int(n) % cpw;
}
"""

INPUTS = ["q", "krows", "vrows", "ksigns", "kscale", "kcodebook", "vcodebook", "consts", "off"]


def _example(dt, dk, dv, kb, vb, rep, m, ng, hkv, w=4, rows=0, kr=1, vr=1) -> Example:
    pk, pv = max(32, 1 << (dk - 1).bit_length()), max(32, 1 << (dv - 1).bit_length())
    inputs = {"q": dt, "krows": mx.uint32, "vrows": mx.uint32, "ksigns": mx.float32,
              "kscale": mx.float32, "kcodebook": mx.float32, "vcodebook": mx.float32,
              "consts": (mx.int32, 4), "off": (mx.int32, 1)}  # fmt: skip
    template = {"T": dt, "DK": dk, "PK": pk, "DV": dv, "PV": pv, "KB": kb, "VB": vb, "REP": rep,
                "M": m, "NG": ng, "HKV": hkv, "KRW": pk * kb // 32 + 1, "VRW": pv * vb // 32 + 1,
                "W": w, "HAS_KS": 1, "ROWS": rows, "OFF_ADD": rows, "KR": kr, "VR": vr}  # fmt: skip
    return Example(inputs, {"partials": mx.float32}, template)


kernel = Kernel(
    "tq_flash_decode_partial_tc",
    inputs=INPUTS,
    outputs=["partials"],
    body=with_shared_text(_BODY, "nrows * uint(PK / 2)"),
    header=_HEADER,
    examples=[
        _example(mx.bfloat16, 512, 512, 8, 8, 8, 1, 1, 2, kr=4, vr=4),  # 26B-A4B global, TQ8
        _example(mx.bfloat16, 256, 256, 8, 8, 2, 1, 1, 8),  # its sliding layer
        _example(mx.float32, 96, 64, 4, 8, 3, 4, 2, 2, w=2),  # padded K, 12 rows in two groups
        _example(mx.float16, 256, 256, 4, 4, 2, 1, 1, 4, rows=1),  # static cache rows
    ],
)


def covers(pk: int, pv: int, kb: int, vb: int, fold: bool) -> bool:
    """Whether the tensor-core partial takes this codec pair: codes that tile a word (1, 2, 4
    or 8 bits), at least one word of a key row per quarter and of a value row per eighth; the
    reduce folded in (HF2Q_TQ_FOLD) stays with the scalar kernel."""
    return (
        not fold
        and kb in (1, 2, 4, 8)
        and vb in (1, 2, 4, 8)
        and pk * kb >= 128
        and pv * vb >= 256
        and pk <= 1024
        and pv <= 1024
    )


def tensor_cores() -> bool:
    """HF2Q_TQ_TC=1: TurboQuant flash-decode's partial kernel on tensor cores where it covers
    the codecs (CUDA). Off: its GPU tests pass, but on an H100 it is slower than the scalar
    partial at every shape but global 16K (session 49: 255 registers, two SIMD groups a
    scheduler, the shared-memory codebook lookups its busiest pipe)."""
    return env_int("HF2Q_TQ_TC", 0, 1) == 1


# interleaved copies of an 8-bit codebook (lane l reads copy l % copies): 4 bound a SIMD
# group's 32 lookups to ~2.5 addresses in the busiest bank, one copy to ~3.5
_CB_COPIES = 4
_SHARED_LIMIT = 48 * 1024  # CUDA's static shared memory


def shared_bytes(pk: int, pv: int, kb: int, vb: int, w: int, kr: int, vr: int) -> int:
    """The kernel's shared memory: query fragments / merge buffer, codebooks, the merge's
    maxima and sums."""
    return 16 * max(4 * pk, 2 * pv) + 4 * ((1 << kb) * kr + (1 << vb) * vr) + 64 * w


def copies_within(kb: int, vb: int, copies: int, used: int, limit: int) -> tuple[int, int]:
    """(KR, VR): ``copies`` copies of the key and value codebooks of more than 32 entries
    (smaller ones sit in distinct banks already), the keys' first, each while a kernel whose
    shared memory is ``used`` bytes with one copy of each stays within ``limit``. The rule of
    both flash-decode partials."""
    out = []
    for bits in (kb, vb):
        more = 4 * (1 << bits) * (copies - 1)
        take = copies > 1 and bits > 5 and used + more <= limit
        used += more if take else 0
        out.append(copies if take else 1)
    return out[0], out[1]


def codebook_copies(pk: int, pv: int, kb: int, vb: int, w: int) -> tuple[int, int]:
    """(KR, VR) of this kernel: _CB_COPIES by ``copies_within``, CUDA's static limit."""
    return copies_within(kb, vb, _CB_COPIES, shared_bytes(pk, pv, kb, vb, w, 1, 1), _SHARED_LIMIT)


def row_groups(rows: int) -> int:
    """Threadgroups a KV head's ``rows`` query rows take (8 each)."""
    return -(-rows // ROWS_PER_GROUP)
