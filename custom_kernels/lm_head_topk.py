"""Greedy / top-k decode head: lm_head mat-vec fused with block top-k (no full logits written),
then the finalists' logits recomputed exactly and re-ranked."""

from __future__ import annotations

import mlx.core as mx
from gguf import GGMLQuantizationType as GT

from hf2q_mlx.custom_kernels import backend, device_constant
from hf2q_mlx.custom_kernels._render import Example, Kernel
from hf2q_mlx.custom_kernels.dequant import dequantize_reference, row_bytes
from hf2q_mlx.custom_kernels.qmatmul import ggml_matmul
from hf2q_mlx.custom_kernels.sampling import HEADER as _TOPK_HEADER
from hf2q_mlx.custom_kernels.sampling import merge_candidates, topk, topk_reference

MAX_K = 32  # one running-list entry per lane
RERANK_MARGIN = 4  # finalists beyond k that get the exact recomputation


def _logits_fp32(x, weight, ggml_type):
    if ggml_type is not None and ggml_type not in (GT.F32, GT.F16, GT.BF16):
        w = dequantize_reference(weight, ggml_type, x.shape[-1])
    else:
        w = weight.astype(mx.float32)
    return x.astype(mx.float32) @ w.T


def lm_head_topk_reference(
    x: mx.array,
    weight: mx.array,
    k: int = 1,
    *,
    softcap: float | None = None,
    ggml_type: int | None = None,
) -> tuple[mx.array, mx.array]:
    """x (..., H), weight (V, H) (or GGML raw blocks (V, row_bytes) with ``ggml_type``) ->
    the k best (values fp32 (..., k), indices uint32 (..., k)) of the fp32 logits
    ``x @ W.T`` (soft-capped ``cap * tanh(l / cap)`` when ``softcap``), ``topk_reference`` order."""
    logits = _logits_fp32(x, weight, ggml_type)
    if softcap is not None:
        logits = mx.tanh(logits / softcap) * softcap
    return topk_reference(logits, k)


# Weight formats: 0 fp32, 1 fp16, 2 bf16 (dense rows), 3 GGML Q8_0 blocks. Each loads one
# "item" = 8 consecutive values of a row into wv[8].
HEADER = (
    _TOPK_HEADER
    + r"""
#ifdef __METAL_VERSION__
#define LM_REF(T) thread T&
#else
#define LM_REF(T) T&
#endif
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
// rounded products and sums that the compiler may not contract into an fma: the error-free
// transformations of the exact re-rank depend on each operation rounding on its own
FN float lm_mul(float a, float b) { return __fmul_rn(a, b); }
FN float lm_add(float a, float b) { return __fadd_rn(a, b); }
FN float lm_sub(float a, float b) { return __fsub_rn(a, b); }
#else
FN float lm_mul(float a, float b) { return a * b; }
FN float lm_add(float a, float b) { return a + b; }
FN float lm_sub(float a, float b) { return a - b; }
#endif
FN float lm_half(uint h, int fmt) {  // fmt 1: fp16 bits, 2: bf16 bits
  return fmt == 1 ? f16_bits_to_float(ushort(h)) : bf16_bits_to_float(ushort(h));
}
FN float lm_lo16(uint v, int fmt) { return lm_half(v & 0xFFFFu, fmt); }
FN float lm_hi16(uint v, int fmt) { return lm_half(v >> 16, fmt); }
// Insert (s, id) into a sorted running list held one entry per lane (entry j in lane j < k);
// every lane calls with the same (s, id); (tv, ti) is the list's last entry afterwards.
FN void lm_insert(LM_REF(float) lv, LM_REF(uint) li, float s, uint id, uint lane, uint k,
                  LM_REF(float) tv, LM_REF(uint) ti) {
  const uint before = simd_sum((lane < k && tk_better(lv, li, s, id)) ? 1u : 0u);
  const float pv = simd_shuffle(lv, (lane + 31u) & 31u);
  const uint pi = simd_shuffle(li, (lane + 31u) & 31u);
  if (lane == before) { lv = s; li = id; }
  else if (lane > before && lane < k) { lv = pv; li = pi; }
  tv = simd_shuffle(lv, k - 1);
  ti = simd_shuffle(li, k - 1);
}
"""
)

# The item loader, pasted into both bodies: 8 values of row `row`, item `it` -> wv[8].
_LOAD = """
    if (FMT == 0) {
      DEVICE_PTR(const uint4) p = DEVICE_CAST(const uint4, w + uint64_t(row) * uint(H) + it * 8);
      const uint4 a = p[0];
      const uint4 c = p[1];
      wv[0] = bitcast<float>(a.x); wv[1] = bitcast<float>(a.y);
      wv[2] = bitcast<float>(a.z); wv[3] = bitcast<float>(a.w);
      wv[4] = bitcast<float>(c.x); wv[5] = bitcast<float>(c.y);
      wv[6] = bitcast<float>(c.z); wv[7] = bitcast<float>(c.w);
    } else if (FMT == 1 || FMT == 2) {
      const uint4 a = DEVICE_CAST(const uint4, w + uint64_t(row) * uint(H) + it * 8)[0];
      wv[0] = lm_lo16(a.x, FMT); wv[1] = lm_hi16(a.x, FMT);
      wv[2] = lm_lo16(a.y, FMT); wv[3] = lm_hi16(a.y, FMT);
      wv[4] = lm_lo16(a.z, FMT); wv[5] = lm_hi16(a.z, FMT);
      wv[6] = lm_lo16(a.w, FMT); wv[7] = lm_hi16(a.w, FMT);
    } else {
      // Q8_0: 34-byte blocks (fp16 scale, 32 int8); item = a quarter block; 2-byte aligned loads
      DEVICE_PTR(const uchar) blk =
          DEVICE_CAST(const uchar, w) + uint64_t(row) * uint(H / 32 * 34) + (it / 4) * 34;
      DEVICE_PTR(const ushort) p = DEVICE_CAST(const ushort, blk);
      const float d = f16_bits_to_float(p[0]);
      UNROLL for (int u = 0; u < 4; ++u) {
        const uint q = uint(p[1 + (it % 4) * 4 + uint(u)]);
        wv[2 * u] = float(int(q << 24) >> 24) * d;
        wv[2 * u + 1] = float(int(q << 16) >> 24) * d;
      }
    }
"""

# Template: XT (x), WT (weight array), FMT, H, HP (H padded to 256), BG (batch rows per group),
# SM (shared floats), SOFTCAP. params: V, rows per SIMD group, B, K (list length <= 32).
_PARTIAL_BODY = (
    """
  // One threadgroup (8 SIMD groups) per chunk of 8 * RPW vocabulary rows and group of BG batch
  // rows. x is staged once in shared memory as fp32, permuted so that lane l reads word l of a
  // 32-word line (no bank conflicts). SIMD group w takes rows chunk + w + 8 r; a lane takes
  // 8-value items it = lane + 32 s of the row; one SIMD sum per (row, batch row). Each SIMD group
  // keeps a running top-K list per batch row (entry j in lane j); the 8 lists are merged through
  // shared memory at the end, so only K candidates per chunk and batch row reach memory.
  SHARED float sm[SM];
  const uint V = params[0];
  const uint RPW = params[1];
  const uint B = params[2];
  const uint K = params[3];
  const uint b0 = gid_z * uint(BG);
  const uint nb = B - b0 < uint(BG) ? B - b0 : uint(BG);
  const float cap = SOFTCAP ? fparams[0] : 1.0f;
  for (uint e = tid; e < uint(BG * H); e += tg_size) {
    const uint b = e / uint(H);
    const uint kk = e % uint(H);
    const uint it = kk / 8;
    sm[b * uint(HP) + (it / 32) * 256 + (kk % 8) * 32 + it % 32] =
        b < nb ? to_float(x[uint64_t(b0 + b) * uint(H) + kk]) : 0.0f;
  }
  BARRIER();
  float lv[BG];
  uint li[BG];
  float tv[BG];
  uint ti[BG];
  UNROLL for (int b = 0; b < BG; ++b) {
    lv[b] = -INF_F; li[b] = 0xFFFFFFFFu; tv[b] = -INF_F; ti[b] = 0xFFFFFFFFu;
  }
  const uint row0 = gid_x * 8 * RPW;
  for (uint r = 0; r < RPW; ++r) {
    const uint row = row0 + simd_id + 8 * r;
    if (row >= V) break;  // the same for the whole SIMD group
    float acc[BG];
    UNROLL for (int b = 0; b < BG; ++b) acc[b] = 0.0f;
    for (uint it = lane; it < uint(H / 8); it += 32) {
      float wv[8];
"""
    + _LOAD
    + """
      const uint xo = (it / 32) * 256 + it % 32;
      UNROLL for (int b = 0; b < BG; ++b) {
        UNROLL for (int u = 0; u < 8; ++u) acc[b] = fma_f(wv[u], sm[b * HP + xo + u * 32], acc[b]);
      }
    }
    UNROLL for (int b = 0; b < BG; ++b) {
      float s = simd_broadcast(simd_sum(acc[b]), 0);
      if (SOFTCAP) s = tanh_f(s / cap) * cap;
      if (uint(b) < nb && tk_better(s, row, tv[b], ti[b])) {
        lm_insert(lv[b], li[b], s, row, lane, K, tv[b], ti[b]);
      }
    }
  }
  BARRIER();  // x is no longer needed: the shared array holds the lists now
  UNROLL for (int b = 0; b < BG; ++b) {
    if (lane < K) {
      sm[(uint(b) * 8 + simd_id) * 2 * K + lane] = lv[b];
      sm[(uint(b) * 8 + simd_id) * 2 * K + K + lane] = bitcast<float>(li[b]);
    }
  }
  BARRIER();
  for (uint b = simd_id; b < nb; b += 8) {
    SHARED_PTR(float) lists = sm + b * 8 * 2 * K;
    float mv = lane < K ? lists[lane] : -INF_F;
    uint mi = lane < K ? bitcast<uint>(lists[K + lane]) : 0xFFFFFFFFu;
    float tv2 = simd_shuffle(mv, K - 1);
    uint ti2 = simd_shuffle(mi, K - 1);
    for (uint w8 = 1; w8 < 8; ++w8) {
      for (uint j = 0; j < K; ++j) {
        const float cv = lists[w8 * 2 * K + j];
        const uint ci = bitcast<uint>(lists[w8 * 2 * K + K + j]);
        if (!tk_better(cv, ci, tv2, ti2)) break;  // sorted: the rest rank lower too
        lm_insert(mv, mi, cv, ci, lane, K, tv2, ti2);
      }
    }
    if (lane < K) {
      const uint64_t o = (uint64_t(b0 + b) * ngroups_x + gid_x) * K + lane;
      cand_v[o] = mv;
      cand_i[o] = mi;
    }
  }
"""
)

# Template: XT, WT, FMT, H, SOFTCAP. params: V, B, KC (finalists per row, one SIMD group each),
# KOUT (how many to write).
_RERANK_BODY = (
    """
  // One threadgroup per batch row, one SIMD group per finalist. Its logit again as an
  // error-free dot product (Dot2): products split exactly by fma, running sums by TwoSum, the
  // errors summed apart and added once at the end, so the value is the exact dot product
  // rounded about once. SIMD group 0 then ranks the finalists and writes the best KOUT in order.
  SHARED float fv[32];
  SHARED uint fi[32];
  const uint V = params[0];
  const uint KC = params[2];
  const uint KOUT = params[3];
  const uint b = gid_x;
  const uint row = cand[b * KC + simd_id];
  float s = 0.0f;
  float c = 0.0f;
  if (row < V) {
    for (uint it = lane; it < uint(H / 8); it += 32) {
      float wv[8];
"""
    + _LOAD
    + """
      UNROLL for (int u = 0; u < 8; ++u) {
        const float xv = to_float(x[uint64_t(b) * uint(H) + it * 8 + uint(u)]);
        const float p = lm_mul(wv[u], xv);
        const float pe = fma_f(wv[u], xv, -p);
        const float t = lm_add(s, p);
        const float z = lm_sub(t, s);
        const float e = lm_add(lm_sub(s, lm_sub(t, z)), lm_sub(p, z));
        s = t;
        c = lm_add(c, lm_add(e, pe));
      }
    }
  }
  UNROLL for (uint o = 16; o > 0; o >>= 1) {
    const float os = simd_shuffle_xor(s, o);
    const float oc = simd_shuffle_xor(c, o);
    const float t = lm_add(s, os);
    const float z = lm_sub(t, s);
    const float e = lm_add(lm_sub(s, lm_sub(t, z)), lm_sub(os, z));
    s = t;
    c = lm_add(lm_add(c, oc), e);
  }
  float logit = lm_add(s, c);
  if (SOFTCAP) logit = tanh_f(logit / fparams[0]) * fparams[0];
  if (lane == 0) {
    fv[simd_id] = row < V ? logit : -INF_F;
    fi[simd_id] = row < V ? row : 0xFFFFFFFFu;
  }
  BARRIER();
  if (simd_id == 0 && lane < KC) {
    const float mv = fv[lane];
    const uint mi = fi[lane];
    uint rank = 0;
    for (uint j = 0; j < KC; ++j) rank += tk_better(fv[j], fi[j], mv, mi) ? 1u : 0u;
    if (rank < KOUT) {
      out_v[b * KOUT + rank] = mv;
      out_i[b * KOUT + rank] = mi;
    }
  }
"""
)


def _partial_example(xt, wt, fmt, H, BG, K, softcap) -> Example:
    HP = -(-H // 256) * 256
    return Example(
        {"x": xt, "w": wt, "params": (mx.uint32, 4), "fparams": (mx.float32, 1)},
        {"cand_v": mx.float32, "cand_i": mx.uint32},
        {"XT": xt, "WT": wt, "FMT": fmt, "H": H, "HP": HP, "BG": BG,
         "SM": BG * max(HP, 16 * K), "SOFTCAP": softcap},
    )  # fmt: skip


_partial_kernel = Kernel(
    "lm_head_topk_partial",
    inputs=["x", "w", "params", "fparams"],
    outputs=["cand_v", "cand_i"],
    body=_PARTIAL_BODY,
    header=HEADER,
    examples=[
        _partial_example(mx.bfloat16, mx.uint8, 3, 640, 1, 5, 1),  # Gemma 3 270M Q8_0 head
        _partial_example(mx.float16, mx.float16, 1, 2816, 2, 32, 0),
        _partial_example(mx.float32, mx.bfloat16, 2, 1536, 4, 8, 1),
        _partial_example(mx.float32, mx.float32, 0, 64, 16, 1, 0),
    ],
)

_rerank_kernel = Kernel(
    "lm_head_topk_rerank",
    inputs=["x", "w", "cand", "params", "fparams"],
    outputs=["out_v", "out_i"],
    body=_RERANK_BODY,
    header=HEADER,
    examples=[
        Example({"x": xt, "w": wt, "cand": mx.uint32, "params": (mx.uint32, 4),
                 "fparams": (mx.float32, 1)}, {"out_v": mx.float32, "out_i": mx.uint32},
                {"XT": xt, "WT": wt, "FMT": fmt, "H": h, "SOFTCAP": sc})
        for xt, wt, fmt, h, sc in ((mx.bfloat16, mx.uint8, 3, 640, 1),
                                   (mx.float16, mx.float16, 1, 2816, 0),
                                   (mx.float32, mx.float32, 0, 64, 1))
    ],
)  # fmt: skip

_DENSE_FMT = {mx.float32: 0, mx.float16: 1, mx.bfloat16: 2}
_FLOATS = (mx.float32, mx.float16, mx.bfloat16)
_SHARED_FLOATS = 8192  # 32 KB


def _format(weight: mx.array, ggml_type: int | None, H: int) -> int | None:
    """Kernel weight format, or None where the kernels do not read this weight."""
    if ggml_type in (None, GT.F32, GT.F16, GT.BF16):
        return _DENSE_FMT.get(weight.dtype) if weight.shape[-1] == H else None
    if (
        ggml_type == GT.Q8_0
        and weight.dtype == mx.uint8
        and weight.shape[-1] == row_bytes(GT.Q8_0, H)
    ):
        return 3
    return None


def plan(V: int, B: int, H: int, K: int) -> tuple[int, int, int]:
    """(rows per SIMD group, batch rows per group BG, shared floats SM) of the partial kernel:
    about 1024 threadgroups for V = 262144 (<= 64 rows per SIMD group), x plus lists in 32 KB."""
    rpw = max(1, min(64, -(-V // (8 * 1024))))
    per_b = max(-(-H // 256) * 256, 16 * K)
    bg = max(0, min(B, 16, _SHARED_FLOATS // per_b))
    return rpw, bg, bg * per_b


def lm_head_topk(
    x: mx.array,
    weight: mx.array,
    k: int = 1,
    *,
    softcap: float | None = None,
    ggml_type: int | None = None,
    rerank: bool = True,
) -> tuple[mx.array, mx.array]:
    """Dispatcher for ``lm_head_topk_reference``: (values fp32 (..., k), indices uint32 (..., k)).

    GPU path (weights fp32 / fp16 / bf16 dense or GGML Q8_0, k <= 32, H % 32 == 0): the fused
    mat-vec + top-k kernel keeps k + 4 candidates per chunk of the vocabulary, a merge picks the
    finalists, and the re-rank recomputes their logits exactly (``rerank=False``: the fused
    kernel's fp32 logits and the best k straight from the merge). Other GGML types: the quantized
    matmul, then the top-k kernels, with no fused head.
    """
    H = x.shape[-1]
    lead = x.shape[:-1]
    B = x.size // H if H else 0
    V = weight.shape[0]
    if not 1 <= k <= V:
        raise ValueError(f"k must be in [1, {V}], got {k}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0, got {softcap}")
    if backend() is None or x.dtype not in _FLOATS or B == 0:
        return lm_head_topk_reference(x, weight, k, softcap=softcap, ggml_type=ggml_type)
    fmt = _format(weight, ggml_type, H)
    kc = min(MAX_K, k + RERANK_MARGIN, V) if rerank else k
    rpw, bg, sm = plan(V, B, H, kc)
    if fmt is None or k > MAX_K or H % 32 or bg == 0 or V >= 2**31:
        return _unfused(x, weight, k, softcap, ggml_type)
    xr = x.reshape(B, H)
    n_tg = -(-V // (8 * rpw))
    cap = (float(softcap) if softcap is not None else 1.0,)
    cand_v, cand_i = _partial_kernel(
        [xr, weight, device_constant((V, rpw, B, kc), mx.uint32), device_constant(cap, mx.float32)],
        grid=(n_tg * 256, 1, -(-B // bg)),
        threadgroup=(256, 1, 1),
        output_shapes=[(B, n_tg, kc), (B, n_tg, kc)],
        output_dtypes=[mx.float32, mx.uint32],
        template={"XT": x.dtype, "WT": weight.dtype, "FMT": fmt, "H": H,
                  "HP": -(-H // 256) * 256, "BG": bg, "SM": sm, "SOFTCAP": softcap is not None},
    )  # fmt: skip
    vals, idx = merge_candidates(cand_v.reshape(B, n_tg * kc), cand_i.reshape(B, n_tg * kc), kc)
    if rerank:
        vals, idx = _rerank_kernel(
            [xr, weight, idx, device_constant((V, B, kc, k), mx.uint32),
             device_constant(cap, mx.float32)],
            grid=(B * 32 * kc,),
            threadgroup=(32 * kc,),
            output_shapes=[(B, k), (B, k)],
            output_dtypes=[mx.float32, mx.uint32],
            template={"XT": x.dtype, "WT": weight.dtype, "FMT": fmt, "H": H,
                      "SOFTCAP": softcap is not None},
        )  # fmt: skip
    return vals.reshape(*lead, k), idx.reshape(*lead, k)


def _unfused(x, weight, k, softcap, ggml_type):
    """The mat-vec (quantized matmul for GGML blocks) in fp32, softcap, the top-k kernels."""
    xf = x.astype(mx.float32)
    if ggml_type is not None and ggml_type not in (GT.F32, GT.F16, GT.BF16):
        logits = ggml_matmul(xf, weight, ggml_type, x.shape[-1])
    else:
        logits = xf @ weight.astype(mx.float32).T
    if softcap is not None:
        logits = mx.tanh(logits / softcap) * softcap
    return topk(logits, k)
