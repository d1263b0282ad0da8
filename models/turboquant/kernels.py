"""TurboQuant's kernel dispatch: the packed-cache ops on the GPU kernels of ``custom_kernels``
where they run, else their MLX references, written against the codec (``TQCodec``) and the cache's
packed state (``TQState``)."""

from __future__ import annotations

import mlx.core as mx

from hf2q_mlx.custom_kernels.tq_flash_decode import flash_decode
from hf2q_mlx.custom_kernels.tq_quantize import (
    quantize_kv_rows_into,
    quantize_rows,
    quantize_rows_into,
    stored_vectors,
)
from hf2q_mlx.models.turboquant.codec import TQCodec
from hf2q_mlx.models.turboquant.state import TQState

# masked scores: finite, so a fully masked partition gives exp(0) * 0 instead of NaN
_NEG = -1e30


# ---- quantize-on-write ------------------------------------------------------------------------


def tq_quantize_reference(
    x: mx.array, codec: TQCodec, scale: mx.array | None = None, mean: mx.array | None = None
) -> mx.array:
    """x (B, H, L, dim) float -> packed rows (B, H, L, codec.row_words) uint32, in MLX ops.

    Without ``scale`` / ``mean`` any leading shape (..., dim) is accepted.
    """
    return codec.quantize(stored_vectors(x, scale, mean))


def tq_quantize(
    x: mx.array, codec: TQCodec, scale: mx.array | None = None, mean: mx.array | None = None
) -> mx.array:
    """Dispatcher: the GPU kernel where one applies, else the reference.

    x (B, H, L, dim) -> (B, H, L, row_words); ``scale`` / ``mean`` (H, dim) fp32 are folded into
    the kernel (the codec stores (x - mean) / scale). Without them any (..., dim) is accepted.
    """
    rows = quantize_rows(x, codec.signs, codec.boundaries, codec.codebook, codec.bits, scale, mean)
    return tq_quantize_reference(x, codec, scale, mean) if rows is None else rows


def tq_quantize_into(
    cache: mx.array,
    x: mx.array,
    codec: TQCodec,
    scale: mx.array | None,
    mean: mx.array | None,
    pos: mx.array,
    ring: bool,
) -> mx.array:
    """In a recorded CUDA graph: x (B, H, L, dim) quantized into ``cache`` (B, H, C, row_words)
    at each row's slots pos[b] + l (modulo C for a ring), in place, one launch; the reference
    is ``tq_quantize`` then ``graph_ops.kv_write_reference``."""
    return quantize_rows_into(cache, x, codec.signs, codec.boundaries, codec.codebook,
                              codec.bits, scale, mean, pos, ring)  # fmt: skip


def tq_quantize_kv_into(
    caches: tuple[mx.array, mx.array],
    xs: tuple[mx.array, mx.array],
    codecs: tuple[TQCodec, TQCodec],
    scales: tuple[mx.array | None, mx.array | None],
    k_mean: mx.array | None,
    pos: mx.array,
    ring: bool,
) -> tuple[mx.array, mx.array]:
    """``tq_quantize_into`` for a layer's keys and values: one launch where both sides share
    its shape, dtype, width and bits, else a launch each. ``caches`` / ``xs`` / ``codecs`` /
    ``scales``: (keys, values); ``k_mean``: the keys' offset (values have none)."""
    (kc, vc), (xk, xv), (k_codec, v_codec), (k_scale, v_scale) = caches, xs, codecs, scales
    if k_codec.bits == v_codec.bits:
        tables = tuple(
            (c.signs, s, m, c.boundaries, c.codebook)
            for c, s, m in ((k_codec, k_scale, k_mean), (v_codec, v_scale, None))
        )
        both = quantize_kv_rows_into(caches, xs, tables, k_codec.bits, pos, ring)
        if both is not None:
            return both
    return (
        tq_quantize_into(kc, xk, k_codec, k_scale, k_mean, pos, ring),
        tq_quantize_into(vc, xv, v_codec, v_scale, None, pos, ring),
    )


# ---- flash-decode attention -------------------------------------------------------------------


def query_positions(state: TQState, n_queries: int) -> mx.array:
    """Absolute positions of the last ``n_queries`` tokens written (the queries), (M,), or
    (B, M) for a static cache's rows."""
    end = state.ends()
    if state.rows:
        return end[:, None] - n_queries + mx.arange(n_queries)[None]
    return mx.arange(end - n_queries, end)


def visibility(state: TQState, n_queries: int) -> mx.array:
    """Boolean (M, n_slots): query m may attend slot s; (B, M, n_slots) for a static cache's
    rows."""
    p = state.slot_positions()[..., None, : state.n_slots]
    qp = query_positions(state, n_queries)[..., None]
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
    vis = visibility(state, M)
    vis = vis if vis.ndim == 3 else vis[None]  # (B or 1, M, S)
    visible = mx.tile(vis, (1, rep, 1))[:, None]  # (B or 1, 1, rep*M, S)
    s = mx.where(visible, q @ k.swapaxes(-1, -2), _NEG)
    chunk = -(-S // n_parts)
    parts = []
    for i in range(0, S, chunk):
        sp = s[..., i : i + chunk]
        m = mx.max(sp, axis=-1, keepdims=True)
        p = mx.where(visible[..., i : i + chunk], mx.exp(sp - m), 0.0)
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
    mask = visibility(state, M)
    mask = mask[:, None] if mask.ndim == 3 else mask  # (B, 1, M, S) for a static cache's rows
    out = mx.fast.scaled_dot_product_attention(
        queries.astype(mx.float32), k, v, scale=scale, mask=mask
    )
    return out.astype(queries.dtype)


def tq_flash_decode(queries: mx.array, state: TQState, scale: float) -> mx.array:
    """Dispatcher: queries (B, Hq, M, Dk) -> (B, Hq, M, Dv) on the GPU kernels where they apply,
    else the reference (one partition). The state's ``TQBalance`` is folded into the kernels."""
    kc, vc, bal = state.k_codec, state.v_codec, state.balance
    out = None
    if queries.shape[-1] == kc.dim:
        out = flash_decode(
            queries, state.keys, state.values,
            k_signs=kc.signs, k_codebook=kc.codebook, k_bits=kc.bits, k_scale=bal.k_scale,
            v_signs=vc.signs, v_codebook=vc.codebook, v_bits=vc.bits, v_dim=vc.dim,
            v_scale=bal.v_scale, offset=state.offset, window=state.window, scale=scale,
            offset_add=state.offset_add,
        )  # fmt: skip
    return tq_flash_decode_reference(queries, state, scale) if out is None else out
