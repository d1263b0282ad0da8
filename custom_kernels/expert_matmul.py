"""Mixture-of-experts matmul: each token multiplies only its selected experts, x @ W[e].T."""

from __future__ import annotations

import mlx.core as mx

from .dequant import dequantize_reference

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
    """Runs ``matmul(rows (..., 1, K), ids, sorted_indices) -> (..., 1, N)`` (a gather_mm or
    gather_qmm over the experts) for every (token, slot) pair -> (..., k, N).

    With many pairs they are sorted by expert first, so each expert's weight is read once.
    """
    xs = _per_slot(x, expert_ids)
    k, K = expert_ids.shape[-1], xs.shape[-1]
    if expert_ids.size < SORT_THRESHOLD:
        return matmul(xs[..., None, :], expert_ids, False).squeeze(-2)
    ids = expert_ids.flatten()
    order = mx.argsort(ids)
    src = order if xs.shape[-2] == k else order // k  # shared x: pair p reads token p // k
    out = matmul(xs.reshape(-1, K)[src][:, None, :], ids[order], True).squeeze(-2)
    return out[mx.argsort(order)].reshape(*expert_ids.shape, -1)  # back to (token, slot)


def _gather_dense(x: mx.array, w: mx.array, expert_ids: mx.array) -> mx.array:
    w_t = w.swapaxes(-1, -2)  # (E, K, N): a view, gather_mm reads it transposed
    return gathered_matmul(
        x, expert_ids, lambda a, ids, s: mx.gather_mm(a, w_t, rhs_indices=ids, sorted_indices=s)
    )


def expert_matmul(
    x: mx.array,
    w: mx.array,
    expert_ids: mx.array,
    ggml_type: int | None = None,
    in_features: int | None = None,
) -> mx.array:
    """Dispatcher with the contract of :func:`expert_matmul_reference`.

    Float weights go through ``mx.gather_mm`` (the reference for half-precision weights on the
    CPU, where gather_mm is float32-only). GGML weights: while there are fewer (token,
    expert) pairs than experts (decode), gather the selected blocks and dequantize them (the
    reference); from then on every expert is needed about once anyway, so all experts are
    dequantized once for this call and multiplied with gather_mm (prefill).
    """
    if ggml_type is None:
        if w.dtype != mx.float32 and mx.default_device().type == mx.DeviceType.cpu:
            # MLX's CPU gather_mm is float32-only; gathering the selected experts costs less
            # than converting all of them
            return expert_matmul_reference(x, w, expert_ids)
        return _gather_dense(x, w, expert_ids).astype(x.dtype)
    if in_features is None:
        raise ValueError("in_features is required for GGML expert weights")
    if expert_ids.size < w.shape[0]:
        return expert_matmul_reference(x, w, expert_ids, ggml_type, in_features)
    w_all = dequantize_reference(w, ggml_type, in_features)  # (E, N, K) fp32, this call only
    return _gather_dense(x.astype(mx.float32), w_all, expert_ids).astype(x.dtype)
