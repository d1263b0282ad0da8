"""Scaled dot-product attention as ``mx.fast.scaled_dot_product_attention`` computes it, with
MLX 0.32.4's CPU fallback made fast: on the CPU in float32 its graph is rebuilt op for op with
the softmax as one op of the CPU extension (``custom_kernels/cpu_ext``, ``softmax_cpu``), whose
values are MLX's bit for bit (the same exp, vectorized). MLX's own CPU softmax computes its exp
one element at a time, each fma a libm call: ~12 ns an element, 29 of the 34 ms a 512-token
SmolLM2-135M layer spent in attention (session 40). ``HF2Q_CPU_FUSED=0`` keeps MLX's.
"""

from __future__ import annotations

import mlx.core as mx

from hf2q_mlx.custom_kernels import _render, cpu_ext


def sdpa(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask=None):
    """``mx.fast.scaled_dot_product_attention``. On the CPU in float32 (where MLX 0.32.4 runs
    its fallback graph) the same graph with the softmax as one op of the CPU extension
    (``softmax_cpu``: MLX's values bit for bit, its exp vectorized; MLX's own runs one element
    at a time, about 12 ns each: half of a 512-token SmolLM2-135M prefill). ``mask``: None,
    "causal", or a boolean or additive array broadcastable to (B, Hq, L, K)."""
    if _render.is_collecting():  # a dry pass (compile_ahead): MLX's first attention of a shape
        _note_warm_up(queries, keys, values, scale, mask)
    ext = _cpu_softmax(queries, keys, values, mask)
    if ext is None:
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
    # MLX's fallback, op for op (mlx/fast.cpp), so the matmuls see the same operands
    n_q, n_kv = queries.shape[1], keys.shape[1]
    rep = n_q // n_kv
    q = mx.array(scale, mx.float32) * queries
    k, v = keys, values
    if rep > 1:
        q = mx.unflatten(q, 1, (n_kv, rep))  # (B, Hkv, rep, L, D)
        k, v = mx.expand_dims(k, 2), mx.expand_dims(v, 2)
    scores = mx.matmul(q, mx.swapaxes(k, -1, -2))
    if mask is not None:
        if isinstance(mask, str):  # "causal": the queries are the last L of the K positions
            kl, ql = k.shape[-2], q.shape[-2]
            q_idx = mx.expand_dims(mx.arange(kl - ql, kl), 1)
            mask = q_idx >= mx.expand_dims(mx.arange(0, kl), 0)
        else:
            if mask.dtype != mx.bool_:
                mask = mask.astype(mx.float32)
            mask = mx.broadcast_to(mask, (*queries.shape[:-1], keys.shape[-2]))
            if rep > 1:
                mask = mx.unflatten(mask, -3, (n_kv, rep))
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(mx.finfo(mx.float32).min, mx.float32))
        else:
            scores = scores + mask
    out = mx.matmul(ext.softmax_cpu(scores), v)
    return mx.flatten(out, 1, 2) if rep > 1 else out


def _cpu_softmax(queries, keys, values, mask):
    """The CPU extension where ``sdpa`` takes its CPU graph, else None."""
    if any(a.ndim != 4 for a in (queries, keys, values)):
        return None
    if isinstance(mask, str) and mask != "causal":
        return None
    q, k, v = queries.shape, keys.shape, values.shape
    if q[1] % k[1] or q[-1] != k[-1] or q[0] != k[0] or k[:3] != v[:3]:
        return None  # MLX's own checks and messages
    return cpu_ext.fused_module(queries, keys, values)


def _note_warm_up(queries, keys, values, scale, mask) -> None:
    """The same attention on constant arrays of the same shapes and dtypes, for
    ``compile_ahead`` to run while it compiles: a CUDA process's first attention loads cuDNN
    and builds a plan per shape. Only shapes and dtypes are kept (never the dry graph's
    arrays, whose evaluation would run that graph)."""
    sig = [(a.shape, a.dtype) for a in (queries, keys, values)]
    m = mask if mask is None or isinstance(mask, str) else (mask.shape, mask.dtype)

    def build():
        q, k, v = (mx.full(shape, 0.01, dtype) for shape, dtype in sig)
        arr = m if m is None or isinstance(m, str) else mx.ones(*m)  # bool: nothing masked
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=arr)

    _render.note_warm_up(("sdpa", *sig, m, scale), build)
