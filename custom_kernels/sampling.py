"""Top-k over the vocabulary (k <= 64) for sampling, and argmax: block selection, then merges; the
samplers' log-softmax."""

from __future__ import annotations

import mlx.core as mx

from hf2q_mlx.custom_kernels import backend, cpu_ext, device_constant
from hf2q_mlx.custom_kernels._render import Example, Kernel

MAX_K = 64


def topk_reference(logits: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """logits (..., V) -> (values (..., k) in logits.dtype, indices (..., k) uint32).

    Sorted by value, largest first; equal values by index, lowest first (``mx.argmax``'s rule).
    One uint64 key per logit (order-preserving bits of the fp32 value, then the complement of
    the index) makes every key distinct, so ``mx.topk`` picks exactly that set.
    """
    V = logits.shape[-1]
    _check_k(k, V)
    u = (logits.astype(mx.float32) + 0.0).view(mx.uint32)  # + 0.0: -0 becomes +0 (equal values)
    key = mx.where((u >> 31) == 1, ~u, u | 0x80000000)  # unsigned order == float order
    rank = mx.array(0xFFFFFFFF, mx.uint32) - mx.arange(V, dtype=mx.uint32)
    combined = (key.astype(mx.uint64) << 32) | rank.astype(mx.uint64)
    top = mx.sort(mx.topk(combined, k, axis=-1), axis=-1)[..., ::-1]
    idx = (mx.array(0xFFFFFFFF, mx.uint64) - (top & 0xFFFFFFFF)).astype(mx.uint32)
    return mx.take_along_axis(logits, idx, axis=-1), idx


def logsumexp(logits: mx.array) -> mx.array:
    """logsumexp over the last axis, kept: (..., V) -> (..., 1). On the CPU in float32 the CPU
    extension's one op (``cpu_ext``: MLX's values bit for bit, its exp vectorized; MLX's own
    takes ~3 ms over a 262,144-token row on x86), else ``mx.logsumexp``."""
    ext = cpu_ext.fused_module(logits) if logits.size else None  # empty rows: MLX's op
    if ext is not None:
        return ext.logsumexp_cpu(logits)
    return mx.logsumexp(logits, axis=-1, keepdims=True)


def log_softmax(logits: mx.array) -> mx.array:
    """``logits - logsumexp(logits)`` over the last axis (the samplers' log-probabilities)."""
    return logits - logsumexp(logits)


def argmax_reference(logits: mx.array) -> mx.array:
    """(..., V) -> (...,) uint32: the first index of the largest value."""
    return mx.argmax(logits, axis=-1)


def top_k_filter_reference(logits: mx.array, k: int) -> mx.array:
    """logits (..., V) with all but the k largest of each row set to -inf: exactly k survive
    (which of equal logits at the cut survive is ``mx.argpartition``'s choice)."""
    V = logits.shape[-1]
    _check_k(k, V)
    drop = mx.argpartition(logits, kth=V - k - 1, axis=-1)[..., : V - k]  # the V - k smallest
    return mx.put_along_axis(logits, drop, mx.array(-mx.inf, logits.dtype), axis=-1)


def _check_k(k: int, V: int) -> None:
    if not 1 <= k <= V:
        raise ValueError(f"k must be in [1, {V}] for a vocabulary of {V}, got {k}")


# Template: T (values in), OT (values out), CAND (0: src is a logits row and the index is the
# position; 1: src / cidx are candidate values / indices from an earlier pass), EPT (values per
# thread, <= 32), TG (threads). params: n (values per row), K. Output (rows, groups, K).
HEADER = r"""
// (av, ai) ranks before (bv, bi): larger value, then lower index; NaN never ranks first
FN bool tk_better(float av, uint ai, float bv, uint bi) { return av > bv || (av == bv && ai < bi); }
"""

_BODY = """
  // One threadgroup per (group of TG * EPT values, row); thread t owns values t + TG j. K rounds
  // of block argmax: each thread's best untaken value, a SIMD butterfly over (value, index),
  // one shared slot per SIMD group (double-buffered: one barrier a round), every thread scans
  // the slots, and the owner of the winner marks it taken. Empty places read (-inf, 0xFFFFFFFF),
  // which ranks after every real value, -inf included.
  SHARED float sv[2][TG / 32];
  SHARED uint si[2][TG / 32];
  const uint n = params[0];
  const uint K = params[1];
  const uint row = gid_y;
  const uint start = gid_x * uint(TG * EPT);
  float v[EPT];
  uint id[EPT];
  uint taken = 0;
  UNROLL for (int j = 0; j < EPT; ++j) {
    const uint e = start + tid + uint(TG * j);
    v[j] = -INF_F;
    id[j] = 0xFFFFFFFFu;
    if (e < n) {
      v[j] = to_float(src[uint64_t(row) * n + e]);
      id[j] = CAND ? cidx[uint64_t(row) * n + e] : e;
    } else {
      taken |= 1u << j;
    }
  }
  const uint64_t out0 = (uint64_t(row) * ngroups_x + gid_x) * K;
  for (uint k = 0; k < K; ++k) {
    float bv = -INF_F;
    uint bi = 0xFFFFFFFFu;
    int bj = -1;
    UNROLL for (int j = 0; j < EPT; ++j) {
      if (((taken >> j) & 1u) == 0 && tk_better(v[j], id[j], bv, bi)) {
        bv = v[j];
        bi = id[j];
        bj = j;
      }
    }
    float rv = bv;
    uint ri = bi;
    UNROLL for (uint o = 16; o > 0; o >>= 1) {
      const float ov = simd_shuffle_xor(rv, o);
      const uint oi = simd_shuffle_xor(ri, o);
      if (tk_better(ov, oi, rv, ri)) {
        rv = ov;
        ri = oi;
      }
    }
    const uint buf = k & 1;
    if (lane == 0) {
      sv[buf][simd_id] = rv;
      si[buf][simd_id] = ri;
    }
    BARRIER();
    float gv = sv[buf][0];
    uint gi = si[buf][0];
    for (uint s = 1; s < uint(TG / 32); ++s) {
      if (tk_better(sv[buf][s], si[buf][s], gv, gi)) {
        gv = sv[buf][s];
        gi = si[buf][s];
      }
    }
    if (bj >= 0 && bi == gi) taken |= 1u << uint(bj);
    if (tid == 0) {
      out_v[out0 + k] = from_float<OT>(gv);
      out_i[out0 + k] = gi;
    }
  }
"""

_kernel = Kernel(
    "topk_select",
    inputs=["src", "cidx", "params"],
    outputs=["out_v", "out_i"],
    body=_BODY,
    header=HEADER,
    examples=[
        Example({"src": t, "cidx": mx.uint32, "params": (mx.uint32, 2)},
                {"out_v": ot, "out_i": mx.uint32},
                {"T": t, "OT": ot, "CAND": cand, "EPT": ept, "TG": tg})
        for t, ot, cand, ept, tg in ((mx.bfloat16, mx.float32, 0, 16, 256),
                                     (mx.float32, mx.float16, 1, 4, 1024),
                                     (mx.float16, mx.float16, 0, 4, 256))
    ],
)  # fmt: skip

_FLOATS = (mx.float32, mx.float16, mx.bfloat16)


def first_pass_plan(V: int, k: int) -> tuple[int, int]:
    """(threads, values per thread) of the pass over the logits: 256 threads; 16 values each
    for large k (fewer groups to merge), 4 for small k (more groups in flight)."""
    return 256, 16 if k > 8 else 4


def merge_plan(n: int) -> tuple[int, int]:
    """(threads, values per thread) of a merge over n candidates per row: one group up to 16384;
    power-of-two thread counts, so few distinct builds."""
    ept = 16 if n > 4096 else 4
    return max(32, min(1024, 1 << (-(-n // ept) - 1).bit_length())), ept


def _select(vals, idx, n, k, tg, ept, cand, out_dtype):
    R = vals.shape[0]
    G = -(-n // (tg * ept))
    ov, oi = _kernel(
        [vals, idx, device_constant((n, k), mx.uint32)],
        grid=(G * tg, R),
        threadgroup=(tg, 1),
        output_shapes=[(R, G, k), (R, G, k)],
        output_dtypes=[out_dtype if G == 1 else mx.float32, mx.uint32],
        template={"T": vals.dtype, "OT": out_dtype if G == 1 else mx.float32, "CAND": cand,
                  "EPT": ept, "TG": tg},
    )  # fmt: skip
    return ov.reshape(R, G * k), oi.reshape(R, G * k), G


def merge_candidates(
    values: mx.array, indices: mx.array, k: int, out_dtype: mx.Dtype = mx.float32
) -> tuple[mx.array, mx.array]:
    """Candidates (R, N) fp32 values / uint32 indices -> the best k of each row, (R, k) each, in
    ``topk_reference`` order (kernels only: callers check ``backend()``). Used by lm_head_topk."""
    n = values.shape[-1]
    G = 2
    while G > 1:
        tg, ept = merge_plan(n)
        values, indices, G = _select(values, indices, n, k, tg, ept, True, out_dtype)
        n = values.shape[-1]
    return values, indices


def topk(logits: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """Dispatcher: block selection + merges on the GPU for k <= 64, else the reference."""
    V = logits.shape[-1]
    _check_k(k, V)
    lead = logits.shape[:-1]
    R = logits.size // V
    if backend() is None or logits.dtype not in _FLOATS or k > MAX_K or R == 0 or V >= 2**31:
        return topk_reference(logits, k)
    tg, ept = first_pass_plan(V, k)
    dummy = device_constant((0,) * 8, mx.uint32)  # no candidate indices on the first pass
    vals, idx, G = _select(logits.reshape(R, V), dummy, V, k, tg, ept, False, logits.dtype)
    if G > 1:
        vals, idx = merge_candidates(vals, idx, k, logits.dtype)
    return vals.reshape(*lead, k), idx.reshape(*lead, k)


def top_k_filter(logits: mx.array, k: int) -> mx.array:
    """Dispatcher for ``top_k_filter_reference``: on a GPU for k <= 64 the survivors are the
    ``topk`` kernels' k (equal logits at the cut: the lower indices), values copied exactly."""
    V = logits.shape[-1]
    _check_k(k, V)
    if backend() is None or logits.dtype not in _FLOATS or k > MAX_K or logits.size == 0:
        return top_k_filter_reference(logits, k)
    values, ids = topk(logits, k)
    kept = mx.full(logits.shape, -mx.inf, logits.dtype)
    return mx.put_along_axis(kept, ids, values, axis=-1)


def argmax(logits: mx.array) -> mx.array:
    """(..., V) -> (...,) uint32, ties to the lowest index: ``mx.argmax``, one kernel with this
    rule already and faster than the two-pass top-1 (docs/kernel_notes.md, "argmax")."""
    return argmax_reference(logits)
