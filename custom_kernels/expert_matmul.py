"""Mixture-of-experts matmul: each token multiplies only its selected experts, x @ W[e].T."""

from __future__ import annotations

import math
import os

import mlx.core as mx
from gguf import GGMLQuantizationType

from hf2q_mlx.custom_kernels import avoid_mlx_jit, backend, on_cuda_device
from hf2q_mlx.custom_kernels import qmatmul as Q
from hf2q_mlx.custom_kernels._render import Example, Kernel
from hf2q_mlx.custom_kernels.dequant import (
    BLOCK_TYPES,
    dequantize_reference,
    ggml_dequantize_kernel,
    row_bytes,
)
from hf2q_mlx.custom_kernels.launch_plan import LaunchPlan
from hf2q_mlx.errors import InvalidArgumentError, WeightMismatchError

# HF2Q_EXPERT_PREFILL: how fp16/bf16 x runs past the expert kernels' tokens (prefill) on a GPU.
# "dequant32": every expert dequantized to fp32, gather_mm in fp32 (reference precision);
# "dequant": every expert dequantized to x.dtype, PREFILL_DEQ_CHUNK elements at a time, gather_mm
# in x.dtype (the dense layers' many-rows precision; ~40 % less peak memory, 2-9 % slower on the
# H200, docs/kernel_notes.md); "grouped": expert_glu / expert_down run the grouped
# tensor-core kernels over slices of 32 tokens ("dequant" where those do not cover the call);
# "grouped-wide": the grouped kernels with a pair list of expert_mma.WIDE_LIST, over slices of
# 512 tokens at top-8 (each chosen expert read once per 512 tokens, not per 32); "auto":
# PREFILL_AUTO. Read at each call: a benchmark flips PREFILL in one process.
PREFILL_MODES = ("auto", "dequant32", "dequant", "grouped", "grouped-wide")
GROUPED_MODES = ("grouped", "grouped-wide")
PREFILL = os.environ.get("HF2Q_EXPERT_PREFILL", "auto")
# "grouped-wide": right on the H200 (the GPU parity tests) and 1.1-2.6x "grouped" at 64-4,096
# tokens on the 26B-A4B and 35B-A3B layers (session 15, docs/kernel_notes.md)
PREFILL_AUTO = "grouped-wide"
# HF2Q_GROUPED_SLICE_COPY: "grouped"'s token slices copied into buffers of their own (owned_rows;
# default) or passed as views ("0"). Both are right on the H200 (bench/offset_probe.py: MLX's
# CUDA kernels read views at their offset; session 12's wrong output was gather_mm's, below);
# the views save a copy per slice (~10 % at 64 tokens). Read at each call.
GROUPED_SLICE_COPY = os.environ.get("HF2Q_GROUPED_SLICE_COPY", "1").strip() != "0"
# elements of dequantized expert weight alive at once on the "dequant" path (512 MB in bf16):
# one or two slices per projection at the 26B-A4B and 35B-A3B shapes
PREFILL_DEQ_CHUNK = 1 << 28


def prefill_mode() -> str:
    """The prefill path HF2Q_EXPERT_PREFILL (``PREFILL``) names, "auto" resolved:
    "dequant32", "dequant", "grouped" or "grouped-wide". Raises InvalidArgumentError for any
    other value."""
    mode = PREFILL.strip().lower()
    if mode not in PREFILL_MODES:
        raise InvalidArgumentError(
            f"HF2Q_EXPERT_PREFILL={PREFILL!r} is not one of {', '.join(PREFILL_MODES)}"
        )
    return PREFILL_AUTO if mode == "auto" else mode


def owned_rows(a: mx.array, i: int, j: int) -> mx.array:
    """Rows i:j (axis 0) of ``a`` as a kernel input of the grouped prefill: with
    GROUPED_SLICE_COPY a gather, so a buffer of its own at offset 0; otherwise the view a[i:j]
    (row-contiguous, so no kernel input check copies it; it lies at an offset into its parent's
    buffer). The copy was a guard against kernels reading views from the parent's start, which
    bench/offset_probe.py ruled out on the H200; it stays the default until the views have
    their GPU run against the fixed dequant32. ``avoid_mlx_jit()`` takes the views too (MLX's
    CUDA gather compiles at its first use on a machine)."""
    if not GROUPED_SLICE_COPY or avoid_mlx_jit():
        return a[i:j]
    return mx.take(a, mx.arange(i, j), axis=0)


def run_slices(arrays: tuple[mx.array, ...], step: int, call) -> list[mx.array]:
    """``call(*slices, rows=(i, j))`` over consecutive ``step``-row slices of ``arrays`` (same
    leading size), each slice ``owned_rows`` -> the calls' outputs in order (a grouped
    prefill's launches)."""
    n = arrays[0].shape[0]
    spans = [(i, min(i + step, n)) for i in range(0, n, step)]
    return [call(*(owned_rows(a, i, j) for a in arrays), rows=(i, j)) for i, j in spans]


# From this many (token, expert) pairs on, the pairs are sorted by expert so each expert's
# weight is read once per call (gather_mm's sorted path) instead of once per pair.
SORT_THRESHOLD = 64


def _per_slot(x: mx.array, expert_ids: mx.array) -> mx.array:
    """x (..., K) shared by the k slots or (..., k, K) one row per slot -> (..., k or 1, K)."""
    if x.ndim == expert_ids.ndim:
        return x[..., None, :]
    if x.ndim == expert_ids.ndim + 1:
        return x
    raise ValueError(
        f"x {tuple(x.shape)} does not match expert_ids {tuple(expert_ids.shape)}: "
        "expected (..., K) or (..., k, K) for ids (..., k)"
    )


def expert_matmul_reference(
    x: mx.array,
    w: mx.array,
    expert_ids: mx.array,
    ggml_type: int | None = None,
    in_features: int | None = None,
) -> mx.array:
    """x (..., K) or (..., k, K), expert_ids (..., k) -> (..., k, N) in x.dtype.

    ``w`` is (E, N, K) float, or (E, N, row_bytes) uint8 GGML blocks of ``ggml_type`` with
    ``in_features`` = K. Gathers the selected experts' weights only, dequantizes those blocks,
    and multiplies in fp32: the oracle for the kernels.
    """
    xs = _per_slot(x, expert_ids).astype(mx.float32)
    w_sel = w[expert_ids]  # (..., k, N, K) or (..., k, N, row_bytes)
    if ggml_type is None:
        w_sel = w_sel.astype(mx.float32)
    else:
        w_sel = dequantize_reference(w_sel, ggml_type, in_features)
    out = (w_sel @ xs[..., None]).squeeze(-1)  # (..., k, N)
    return out.astype(x.dtype)


def gathered_matmul(x: mx.array, expert_ids: mx.array, matmul) -> mx.array:
    """Runs ``matmul(rows (..., 1, K), ids, sorted_indices) -> (..., 1, N)`` (a gather_mm or a
    gather_qmm over the experts) for every (token, slot) pair -> (..., k, N).

    With many pairs they are sorted by expert first, so each expert's weight is read once. The
    sorted flag goes only where the device takes it (``_sorted_flag_ok``): on the H200 MLX's
    sorted gather_qmm was right but no faster than with the flag off (26B-A4B experts, 33 and
    512 tokens, bench/prefill_probe.py, session 16), so CUDA keeps the order and drops the flag.
    """
    xs = _per_slot(x, expert_ids)
    k, K = expert_ids.shape[-1], xs.shape[-1]
    if expert_ids.size < SORT_THRESHOLD:
        return matmul(xs[..., None, :], expert_ids, False).squeeze(-2)
    ids = expert_ids.flatten()
    order = mx.argsort(ids)
    src = order if xs.shape[-2] == k else order // k  # shared x: pair p reads token p // k
    out = matmul(xs.reshape(-1, K)[src][:, None, :], ids[order], _sorted_flag_ok()).squeeze(-2)
    return out[mx.argsort(order)].reshape(*expert_ids.shape, -1)  # back to (token, slot)


def _sorted_flag_ok() -> bool:
    """Whether gather_mm / gather_qmm may be told the pairs are sorted on the device they run on.

    MLX 0.32.4's CUDA gather_mm with sorted_indices=True returns wrong rows (relative error
    0.4-1.4 on the H200, bench/prefill_probe.py); the same sorted pairs with the flag off are
    right, so CUDA keeps the order (each expert's rows together) and drops the flag. The CPU
    needs the flag: its unsorted gather_mm takes fp32 only.
    """
    return not on_cuda_device()


def _gather_dense(x: mx.array, w: mx.array, expert_ids: mx.array) -> mx.array:
    w_t = w.swapaxes(-1, -2)  # (E, K, N): a view, gather_mm reads it transposed
    return gathered_matmul(
        x, expert_ids, lambda a, ids, s: mx.gather_mm(a, w_t, rhs_indices=ids, sorted_indices=s)
    )


# --------------------------------------------------------------------------------------------
# Kernel: qmatmul's GGML mat-vec loop (Q.mat_vec_body, its fp32 variant, with the per-type
# block decoders) behind a prefix that aims it at one (token, slot) pair. The loop reads `dims`
# (M, N, K), `x`, `w` and `gid_x` (block of R rows) and writes `out[m * N + row]`; the prefix
# defines those as locals: M = 1, x = the pair's row, w = its expert's (N, row_bytes) blocks,
# out = its output row.

_PREFIX = r"""
  // Thread mapping: threadgroup (gid_x, gid_y) = (block of R rows, (token, slot) pair p); its
  // SIMD groups run the mat-vec loop below over expert ids[p]'s rows only, so the weights of
  // unselected experts are never read. edims = (1, N, K, slots per x row, E).
  const uint ex_pair = gid_y;
  const uint ex_n = uint(edims[1]);
  const uint ex_k = uint(edims[2]);
  const uint ex_e = uint(ids[ex_pair]);
  DEVICE_PTR(T) out = ys + size_t(ex_pair) * ex_n;
  if (ex_e >= uint(edims[4])) {
    // An id past the last expert: NaN rows, nothing read. The whole threadgroup leaves here,
    // before any barrier or SIMD operation.
    const uint ex_row = gid_x * uint(R) + tid;
    if (tid < uint(R) && ex_row < ex_n) out[ex_row] = from_float<T>(bitcast<float>(0x7FC00000u));
    return;
  }
  // (M, N, K) for the loop, read from the input as qmatmul reads its own: a compile-time M = 1
  // looked simpler but cost up to 26 more registers per thread in the sm_90 build (NVRTC).
  CONSTANT_PTR(const int) dims = edims;
  DEVICE_PTR(const T) x = xs + size_t(ex_pair / uint(edims[3])) * ex_k;
  DEVICE_PTR(const uchar) w = wq + size_t(ex_e) * ex_n * (size_t(ex_k / @QK@) * @BB@);
"""

MAX_TOKENS = 16  # tokens per call the kernel takes; more go through the dequantizing paths


def _make_kernel(ggml_type: int) -> Kernel:
    examples = [
        Example(
            {"xs": dt, "wq": mx.uint8, "ids": mx.uint32, "edims": (mx.int32, 5)},
            {"ys": dt},
            {"T": dt, "MT": 1, "R": r, "U": u},
        )
        for dt, r, u in ((mx.float32, 4, 2), (mx.float16, 2, 1), (mx.bfloat16, 1, 4))
    ]
    body, header = Q.mat_vec_body(ggml_type, 0, prefix=_PREFIX)
    return Kernel(
        f"ggml_expert_qmv_{GGMLQuantizationType(ggml_type).name.lower()}",
        inputs=["xs", "wq", "ids", "edims"],
        outputs=["ys"],
        body=body,
        header=header,
        examples=examples,
    )


_KERNELS: dict[int, Kernel] = {t: _make_kernel(t) for t in Q.MAT_VEC_TYPES}


def _plan(x, w, expert_ids, ggml_type: int, K: int, config: dict | None) -> LaunchPlan:
    """One call's launch on its type's kernel, with ``edims`` (1, N, K, slots per x row, E)."""
    E, N, _ = w.shape
    k = expert_ids.shape[-1]
    per_slot = x.ndim == expert_ids.ndim + 1
    pairs = expert_ids.size
    cfg = dict(config or Q.launch_config(ggml_type, 1, N, K, mx.float32), MT=1)
    return LaunchPlan(
        _KERNELS[ggml_type],
        [1, N, K, 1 if per_slot else k, E],
        grid=(-(-N // cfg["R"]) * 32 * cfg["W"], pairs),
        threadgroup=(32 * cfg["W"], 1),
        output_shapes=[(pairs, N)],
        output_dtypes=[x.dtype],
        template={"T": x.dtype, "MT": 1, "R": cfg["R"], "U": cfg["U"]},
    )


def check_expert_blocks(x, w, w_up, ggml_type: int, K: int) -> None:
    """Caller errors a GLU kernel path would otherwise miss (the fallback's expert_matmul
    raises the same ones): x's features, uint8 expert blocks (E, N, row_bytes) of K, and an
    even row count for a fused gate_up ``w`` (``w_up`` None)."""
    if x.shape[-1] != K:
        raise WeightMismatchError(f"x has {x.shape[-1]} features, the experts {K}")
    rb = row_bytes(ggml_type, K)
    for a in (w, w_up):
        if a is not None and (a.ndim != 3 or a.shape[-1] != rb or a.dtype != mx.uint8):
            raise WeightMismatchError(
                f"expected uint8 expert blocks (E, N, {rb}), got {a.dtype} {tuple(a.shape)}"
            )
    if w_up is None and w.shape[1] % 2:
        raise WeightMismatchError(f"a fused gate_up weight needs an even row count: {w.shape}")


def uint32_ids(expert_ids: mx.array) -> mx.array:
    """The ids as every expert kernel reads them: uint32 (negative ids: NaN rows), in their own
    shape (the kernels read flat memory; a reshape would be one more graph node per call)."""
    return expert_ids if expert_ids.dtype == mx.uint32 else expert_ids.astype(mx.uint32)


def ids_and_weights(expert_ids: mx.array, weights: mx.array) -> tuple[mx.array, mx.array]:
    """ids uint32, gate weights fp32, in their own shapes, as the down kernels (GGML, affine
    and grouped) read them: flat memory, no reshape node."""
    ids = uint32_ids(expert_ids)
    return ids, weights if weights.dtype == mx.float32 else weights.astype(mx.float32)


def expert_matmul_kernel(
    x: mx.array,
    w: mx.array,
    expert_ids: mx.array,
    ggml_type: int,
    in_features: int,
    *,
    config: dict[str, int] | None = None,
    init_value: float | None = None,
) -> mx.array:
    """The GPU kernel alone, with the contract of :func:`expert_matmul_reference` for GGML
    weights w (E, N, row_bytes); x's leading dims must equal the ids' (no broadcasting).

    An id >= E gives NaN rows (nothing outside w is read). ``config`` overrides qmatmul's
    ``launch_config`` R, U, W (MT is always 1: one x row per threadgroup); ``init_value``
    pre-fills the output (tests poison it with NaN to prove every element is written).
    """
    plan = _plan(x, w, expert_ids, ggml_type, in_features, config)
    out = plan.call(x.reshape(-1, in_features), w, uint32_ids(expert_ids), init_value=init_value)
    return out.reshape(*expert_ids.shape, w.shape[1])


# per dispatcher call signature: its launch, resolved once, so a decode step pays a dict lookup,
# two views and the launch (no per-call validation, config or host-made arrays)
_CALLS: dict[tuple, LaunchPlan] = {}


def _run(plan: LaunchPlan, x: mx.array, w: mx.array, expert_ids: mx.array, K: int) -> mx.array:
    """A resolved plan's launch on this call's arrays -> (..., k, N)."""
    out = plan.run(x.reshape(-1, K), w, uint32_ids(expert_ids))
    return out.reshape(*expert_ids.shape, w.shape[1])


def _kernel_covers(
    x: mx.array, w: mx.array, expert_ids: mx.array, ggml_type: int, all_tokens: bool = False
) -> bool:
    """Whether the kernel takes this call as it is: 1..MAX_TOKENS tokens and x with the ids'
    leading dims; ``all_tokens``: any number of tokens, x broadcast or not (_fp32_by_slices)."""
    lead = expert_ids.shape if x.ndim == expert_ids.ndim + 1 else expert_ids.shape[:-1]
    return (
        backend() is not None
        and ggml_type in _KERNELS
        and x.dtype in Q.X_DTYPES
        # broadcast x: the reference handles it
        and (all_tokens or tuple(x.shape[:-1]) == tuple(lead))
        and (all_tokens or 1 <= math.prod(expert_ids.shape[:-1]) <= MAX_TOKENS)
        and expert_ids.size > 0
        and w.shape[0] > 0
        and w.shape[1] > 0
    )


def _fp32_by_slices(
    x: mx.array, w: mx.array, expert_ids: mx.array, ggml_type: int, K: int
) -> mx.array:
    """fp32 x past the kernel's tokens (or broadcast): the kernel over slices of MAX_TOKENS
    tokens. Not gather_mm / matmul: MLX runs fp32 matmuls as TF32 (fp16-level error) on CUDA and
    M5-class GPUs unless MLX_ENABLE_TF32=0, and fp32 x asks for fp32 accuracy. Each pair reads
    its expert's rows (no sharing between tokens): a precision mode, not the fast path."""
    lead, k = expert_ids.shape[:-1], expert_ids.shape[-1]
    n_tok = math.prod(lead)
    per_slot = x.ndim == expert_ids.ndim + 1
    xs = mx.broadcast_to(x, (*lead, k, K) if per_slot else (*lead, K))
    xs = xs.reshape(n_tok, k, K) if per_slot else xs.reshape(n_tok, K)
    ids = expert_ids.reshape(n_tok, k)
    parts = [
        expert_matmul(xs[i : i + MAX_TOKENS], w, ids[i : i + MAX_TOKENS], ggml_type, K)
        for i in range(0, n_tok, MAX_TOKENS)
    ]
    return mx.concatenate(parts).reshape(*lead, k, w.shape[1])


def _dequant_by_rows(
    x: mx.array, w: mx.array, expert_ids: mx.array, ggml_type: int, K: int
) -> mx.array:
    """fp16/bf16 x past the kernels on a GPU (HF2Q_EXPERT_PREFILL "dequant", or a grouped mode
    where the grouped kernels do not cover the call):
    every expert dequantized to x.dtype by the GPU kernel, in slices of rows (all experts'
    rows r .. r + n, PREFILL_DEQ_CHUNK elements at most), each slice multiplied with gather_mm
    in x.dtype over the expert-sorted pairs; the slices' outputs are disjoint columns. Not the
    selected experts only: from ~E / k tokens on nearly every expert is selected, and which
    ones is known on the device only (no host sync inside a forward)."""
    E, N, rb = w.shape
    rows = max(1, min(N, PREFILL_DEQ_CHUNK // (E * K)))

    def matmul(a: mx.array, ids: mx.array, sorted_indices: bool) -> mx.array:
        parts = []
        for r in range(0, N, rows):
            n = min(rows, N - r)
            flat = w[:, r : r + n].reshape(E * n, rb)  # a copy of the slice's blocks (uint8)
            wd = ggml_dequantize_kernel(flat, ggml_type, K, x.dtype).reshape(E, n, K)
            parts.append(mx.gather_mm(a, wd.swapaxes(-1, -2), rhs_indices=ids,
                                      sorted_indices=sorted_indices))  # fmt: skip
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)

    return gathered_matmul(x, expert_ids, matmul)


def expert_matmul(
    x: mx.array,
    w: mx.array,
    expert_ids: mx.array,
    ggml_type: int | None = None,
    in_features: int | None = None,
) -> mx.array:
    """Dispatcher with the contract of :func:`expert_matmul_reference`.

    Float weights go through ``mx.gather_mm`` (the reference for half-precision weights on the
    CPU, where gather_mm is float32-only). GGML weights: on a GPU, for 1..16 tokens, the expert
    mat-vec kernel (each (token, slot) pair reads its expert's blocks only); fp32 x takes it for
    any number of tokens, 16 at a time (fp32 math whatever MLX_ENABLE_TF32 says). Otherwise, while
    there are fewer (token, expert) pairs than experts (decode), gather the selected blocks and
    dequantize them (the reference); from then on every expert is needed about once anyway, so
    all experts are dequantized once for this call and multiplied with gather_mm (prefill): on a
    GPU, for fp16/bf16 x, in fp32 or in x.dtype as ``prefill_mode()`` says.
    """
    if ggml_type is not None and backend() is not None:
        key = (ggml_type, in_features, x.shape, x.dtype, w.shape, w.dtype, expert_ids.shape,
               expert_ids.dtype)  # fmt: skip
        plan = _CALLS.get(key)
        if plan is not None:
            return _run(plan, x, w, expert_ids, in_features)
    if ggml_type is None:
        if w.dtype != mx.float32 and mx.default_device().type == mx.DeviceType.cpu:
            # MLX's CPU gather_mm is float32-only; gathering the selected experts costs less
            # than converting all of them
            return expert_matmul_reference(x, w, expert_ids)
        return _gather_dense(x, w, expert_ids).astype(x.dtype)
    if in_features is None:
        raise ValueError("in_features is required for GGML expert weights")
    _per_slot(x, expert_ids)  # raises for mismatched ranks
    if x.shape[-1] != in_features:
        raise WeightMismatchError(f"x has {x.shape[-1]} features, the experts {in_features}")
    rb = row_bytes(ggml_type, in_features)  # raises for unknown types / bad K
    if ggml_type in BLOCK_TYPES and (w.ndim != 3 or w.shape[-1] != rb or w.dtype != mx.uint8):
        raise WeightMismatchError(
            f"expected uint8 expert blocks (E, N, {rb}), got {w.dtype} {tuple(w.shape)}"
        )
    if _kernel_covers(x, w, expert_ids, ggml_type):
        plan = _plan(x, w, expert_ids, ggml_type, in_features, None)
        _CALLS[key] = plan.resolve(x.dtype, mx.uint8, mx.uint32)
        return _run(plan, x, w, expert_ids, in_features)
    if x.dtype == mx.float32 and _kernel_covers(x, w, expert_ids, ggml_type, all_tokens=True):
        return _fp32_by_slices(x, w, expert_ids, ggml_type, in_features)
    if expert_ids.size < w.shape[0]:
        return expert_matmul_reference(x, w, expert_ids, ggml_type, in_features)
    E, N = w.shape[:2]
    if backend() is not None and ggml_type in BLOCK_TYPES:
        if x.dtype in (mx.float16, mx.bfloat16) and prefill_mode() != "dequant32":
            return _dequant_by_rows(x, w, expert_ids, ggml_type, in_features)
        # prefill on a GPU: every expert dequantized once by the GPU kernel (fp32, the
        # reference's values up to one rounding), as the dense layers' many-rows path does,
        # not by the reference's ~20 plain-MLX ops with fp32 intermediates per weight, which
        # ran over every expert of every MoE layer on each prefill chunk (speed: unmeasured).
        flat = ggml_dequantize_kernel(w.reshape(E * N, w.shape[-1]), ggml_type, in_features,
                                      mx.float32)  # fmt: skip
        w_all = flat.reshape(E, N, in_features)
    else:
        w_all = dequantize_reference(w, ggml_type, in_features)  # (E, N, K) fp32, this call only
    return _gather_dense(x.astype(mx.float32), w_all, expert_ids).astype(x.dtype)
