"""The ops every model's forward pass is written in: each runs its fused kernel when kernels run
and otherwise builds the plain-MLX reference graph, so a model has one forward path.

References compile their elementwise glue (a decode step is counted in launches; on the CPU
``mx.fast.rms_norm`` / ``rope`` expand into primitives that compile fuses). Matmuls and cache
writes stay outside. A dispatcher still falls back to its own reference for a shape it does not
cover, so a kernel-path result may come from either.
"""

from __future__ import annotations

from functools import lru_cache, partial

import mlx.core as mx
import mlx.nn as nn

from hf2q_mlx import custom_kernels
from hf2q_mlx.custom_kernels import (
    activations,
    affine_q4_1,
    cpu_ext,
    device_array,
    gated_delta,
    launch_recorder,
)
from hf2q_mlx.custom_kernels import expert_down as expert_down_kernel
from hf2q_mlx.custom_kernels import expert_down_affine as affine_down_kernel
from hf2q_mlx.custom_kernels import expert_glu as expert_glu_kernel
from hf2q_mlx.custom_kernels import expert_glu_affine as affine_glu_kernel
from hf2q_mlx.custom_kernels import gated_delta_decode as delta_decode_kernel
from hf2q_mlx.custom_kernels import moe_router as moe_router_kernel
from hf2q_mlx.custom_kernels import post_norm_residual as post_norm_kernel
from hf2q_mlx.custom_kernels import residual_rms_norm as residual_norm_kernel
from hf2q_mlx.custom_kernels import rms_norm_rope as norm_rope_kernel
from hf2q_mlx.custom_kernels import sigmoid_gate as sigmoid_gate_kernel
from hf2q_mlx.custom_kernels import softcap as softcap_kernel
from hf2q_mlx.custom_kernels.decode_attention import heads_merged
from hf2q_mlx.custom_kernels.rms_norm_rope import Heads, rope_inv_freq, split_heads
from hf2q_mlx.models.attention import attend
from hf2q_mlx.models.packed_rows import PackedRows


def use_kernels() -> bool:
    """True when the fused GPU kernels may run (a GPU default device, no reference override).

    False on the CPU, under ``HF2Q_KERNELS=reference`` and inside ``reference_only()``: every op
    then builds its plain-MLX graph.
    """
    return custom_kernels.backend() is not None


def positions(cache) -> mx.array:
    """The first position of this call, read from a layer cache (0 without one), as a (1,) int32
    array: kernels and ``mx.fast.rope`` read it, so every decode step builds the same graph. A
    static cache (``models/static_cache.py``) holds one position per row: (B,)."""
    pos = getattr(cache, "pos", None)
    if pos is not None:
        return pos
    packed = getattr(cache, "segment_positions", None)
    if packed is not None:  # several rows' chunks in one pass (models/packed_rows.py): (1, T)
        return packed
    tree = getattr(cache, "tree", None)
    if tree is not None:  # a token tree (speculative verify): (1, L), offset + depth per token
        return tree.positions
    return device_array([cache.offset if cache is not None else 0], mx.int32)


# ---- norms -------------------------------------------------------------------------------------


@partial(mx.compile, shapeless=True)
def _rms_norm(x: mx.array, weight: mx.array | None, eps: float) -> mx.array:
    return mx.fast.rms_norm(x, weight, eps)


@partial(mx.compile, shapeless=True)
def _add_rms_norm(x: mx.array, y: mx.array, weight: mx.array, eps: float):
    h = x + y
    return h, mx.fast.rms_norm(h, weight, eps)


@partial(mx.compile, shapeless=True)
def _norm_add_rms_norm(x, y, y_weight, y_eps: float, weight, eps: float):
    h = x + mx.fast.rms_norm(y, y_weight, y_eps)
    return h, mx.fast.rms_norm(h, weight, eps)


def rms_norm(x: mx.array, weight: mx.array | None, eps: float) -> mx.array:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last axis. With kernels and at most 64
    rows: our residual norm kernel with a zero residual (one launch, as ``mx.fast.rms_norm``, one
    a recorded CUDA graph can replay, and each row's bits the same at any row count); else
    ``mx.fast.rms_norm``."""
    if weight is not None and x.size // max(x.shape[-1], 1) <= 64 and use_kernels():
        # decode-sized rows only: the zero residual is kept per shape (a prefill's would be big)
        zero = _zeros(tuple(x.shape), x.dtype)
        return residual_norm_kernel.residual_rms_norm(x, zero, weight, eps)[1]
    ext = _cpu_ext(x, weight)
    if ext is not None:  # the CPU: one op where mx.fast.rms_norm's fallback is four or five
        return ext.rms_norm_cpu(x, weight, eps)
    return _rms_norm(x, weight, eps)


def _cpu_ext(x: mx.array, weight: mx.array | None = None):
    """The CPU extension (custom_kernels/cpu_ext: its one-op RMS norm and RoPE) where this call's
    ops run on the CPU in float32 with a (D,) weight or none, else None. MLX 0.32.4's CPU back
    end runs mx.fast.rms_norm and mx.fast.rope as their fallbacks: 4-5 and ~10 ops a call."""
    if weight is not None and (weight.dtype != mx.float32 or weight.shape != x.shape[-1:]):
        return None
    return cpu_ext.fused_module(x)


@lru_cache(maxsize=64)
def _zeros(shape: tuple, dtype: mx.Dtype) -> mx.array:
    z = mx.zeros(shape, dtype)
    mx.eval(z)
    return z


class RMSNorm(nn.Module):
    """RMS norm holding its effective weight (models whose checkpoints store ``w`` for ``1 + w``
    add the 1 when they load)."""

    def __init__(self, dims: int, eps: float = 1e-5):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return rms_norm(x, self.weight, self.eps)


def residual_norm(
    x: mx.array, y: mx.array, norm: RMSNorm, post_norm: RMSNorm | None = None
) -> tuple[mx.array, mx.array]:
    """A residual add and the norm that follows it: ``h = x + y`` and ``norm(h)``, one kernel.
    ``post_norm``: the branch's own output norm (Gemma's post-attention / post-feedforward
    norms), ``h = x + post_norm(y)``."""
    if use_kernels():
        if post_norm is not None and post_norm.eps == norm.eps:  # the branch norm too
            w = post_norm.weight
            return post_norm_kernel.post_norm_residual(x, y, w, norm.weight, norm.eps)
        y = y if post_norm is None else post_norm(y)
        return residual_norm_kernel.residual_rms_norm(x, y, norm.weight, norm.eps)
    ext = _cpu_ext(x, norm.weight) if y.dtype == mx.float32 else None
    if ext is not None and (post_norm is None or _cpu_ext(y, post_norm.weight) is not None):
        # the CPU: the extension's one-op norms and the add, 2-3 ops (MLX's fallbacks: 8)
        h = x + (y if post_norm is None else ext.rms_norm_cpu(y, post_norm.weight, post_norm.eps))
        return h, ext.rms_norm_cpu(h, norm.weight, norm.eps)
    if post_norm is None:
        return _add_rms_norm(x, y, norm.weight, norm.eps)
    return _norm_add_rms_norm(x, y, post_norm.weight, post_norm.eps, norm.weight, norm.eps)


def post_norm_residual(
    x: mx.array,
    y: mx.array,
    norm: RMSNorm,
    next_norm: RMSNorm,
    y2: mx.array | None = None,
    norm1: RMSNorm | None = None,
    norm2: RMSNorm | None = None,
    scale: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """A Gemma-style branch join: ``h = (x + norm(b)) * scale`` with ``b = y``, or
    ``norm1(y) + norm2(y2)`` for two branches, and ``next_norm(h)``, one kernel on a GPU. The
    norms share one eps."""
    w = [None if m is None else m.weight for m in (norm1, norm2)]
    # the dispatcher takes the reference where no kernel applies (CPU, a scale of another dtype)
    return post_norm_kernel.post_norm_residual(
        x, y, norm.weight, next_norm.weight, norm.eps, y2, *w, scale
    )


def prenorm_layers(layers, h: mx.array, caches, final_norm: RMSNorm, pos: mx.array) -> mx.array:
    """Run pre-norm blocks -> the final norm of the residual stream. Each block takes (h, its
    normed input) and returns both for the next block, so its last residual add shares one
    kernel with the next block's input norm (the final norm after the last block)."""
    n = layers[0].input_layernorm(h)
    next_norms = [layer.input_layernorm for layer in layers[1:]] + [final_norm]
    for layer, c, next_norm in zip(layers, caches, next_norms):
        h, n = layer(h, n, c, next_norm, pos)
    return n


def gated_rms_norm(x: mx.array, gate: mx.array, norm: RMSNorm) -> mx.array:
    """``norm(x) * silu(gate)`` (the output norm of a gated delta-net)."""
    return gated_activation(gate, norm(x), "silu", kernel=False)


def gated_delta_net(net, qkv, z, a, b, cache) -> mx.array:
    """The core of a Qwen 3.5 gated delta-net block ``net`` from its projections (B, L, .),
    arrays or ``Channels`` of a fused in_proj's output: conv, gates, delta rule, gated output
    norm -> (B, L, Hv Dv) for out_proj; reads and advances ``cache`` (None: zero states).
    Decode (L == 1) with kernels is one kernel (custom_kernels/gated_delta_decode.py), which
    reads fused projections in place and also keeps a static cache's inactive rows
    (``cache.active``), so those states are stored without the cache's own masking. A static
    cache's L > 1 call (a speculative verify, decode_step.py) is that kernel over the L tokens
    (or its token-by-token reference), which also leaves each token's states in
    ``cache.history`` for an exact rollback; plain prefill keeps the chunked path."""
    if isinstance(cache, PackedRows):  # several rows' chunks: each from its row's states
        parts = (delta_decode_kernel.dense(x) for x in (qkv, z, a, b))
        return cache.per_row(lambda c, *xs: gated_delta_net(net, *xs, c), *parts)
    B, L, _ = qkv.shape
    conv, state = (None, None) if cache is None else (cache.conv_state, cache.state)
    gate_args = (net.A_log, net.dt_bias)
    heads = (net.num_k_heads, net.head_k_dim)
    active = getattr(cache, "active", None)
    verify = L > 1 and active is not None
    if verify or (L == 1 and use_kernels()):
        # the kernel reads the (C, K, 1) weight flat: a reshape would be a node in every step
        out, conv, state, *history = delta_decode_kernel.gated_delta_decode(
            qkv, z, a, b, conv, net.conv1d.weight, *gate_args, state, net.norm.weight,
            net.norm.eps, *heads, net.tiled, active, history=verify,
        )  # fmt: skip
        if active is not None:
            cache.conv_state, cache.state = conv, state
            cache.history = history or None
        elif cache is not None:
            cache.update(conv, state, L)
        return out
    qkv, z, a, b = (delta_decode_kernel.dense(x) for x in (qkv, z, a, b))  # fused: slices
    weight = net.conv1d.weight.reshape(net.conv_dim, net.kernel_size)  # (C, K, 1) -> (C, K)
    y, conv, state = gated_delta.gated_delta_update(
        qkv, conv, weight, a, b, *gate_args, state, *heads, tiled=net.tiled
    )
    if cache is not None:
        cache.update(conv, state, L)
    return gated_rms_norm(y, z.reshape(y.shape), net.norm).reshape(B, L, -1)


# ---- rotary embedding ----------------------------------------------------------------------------


class RoPE:
    """MLX's non-interleaved rotary embedding over the first ``dims`` channels of each head.

    Pair i turns by ``position * scale / period_i``: the periods are ``base ** (2 i / dims)``, or
    ``freqs`` when given (``inf`` = an unrotated pair). ``inv_freq`` is the same as the norm +
    RoPE kernel reads it: radians per (scaled) position, 0 for an unrotated pair.
    """

    def __init__(
        self,
        dims: int,
        base: float | None = None,
        scale: float = 1.0,
        freqs: mx.array | None = None,
    ):
        self.dims, self.base, self.scale, self.freqs = dims, base, scale, freqs
        self.inv_freq = rope_inv_freq(dims, base) if freqs is None else 1.0 / freqs
        # evaluated now: left lazy, a compiled decode step would recompute it every token
        # (five graph nodes per attention layer)
        mx.eval(self.inv_freq)

    def __call__(self, x: mx.array, pos: mx.array) -> mx.array:
        """x (B, H, L, D), ``pos`` the (1,) first position -> rotated x."""
        ext = self._cpu_ext(x, pos)
        if ext is not None:  # the CPU: one op where mx.fast.rope's fallback is about ten
            return ext.rope_cpu(x, pos, self.inv_freq, self.dims, self.scale)
        return _rope(x, pos, self.dims, self.base, self.scale, self.freqs)

    def _cpu_ext(self, x: mx.array, pos: mx.array):
        """``ops._cpu_ext`` for a (B, H, L, D) x at (1,) or (B,) first positions or (1 or B,
        L) positions per token."""
        ok = x.ndim == 4 and pos.ndim in (1, 2) and pos.shape[0] in (1, x.shape[0])
        ok = ok and (pos.ndim == 1 or pos.shape[1] == x.shape[2])
        ok = ok and self.dims % 2 == 0 and self.inv_freq.dtype == mx.float32
        return _cpu_ext(x) if ok else None


def _rope_graph(x, pos, dims: int, base, scale: float, freqs):
    if pos.ndim == 2:  # (1 or B, L): one position per token, so each token becomes a batch row
        B, H, L, D = x.shape
        rows = x.transpose(0, 2, 1, 3).reshape(B * L, H, 1, D)
        offsets = mx.broadcast_to(pos, (B, L)).reshape(B * L)
        rows = mx.fast.rope(
            rows, dims, traditional=False, base=base, scale=scale, offset=offsets, freqs=freqs
        )
        return rows.reshape(B, L, H, D).transpose(0, 2, 1, 3)
    # a scalar: the GPU rope reads a (1,) offset once per row; (B,) offsets turn each row
    offset = pos.reshape(()) if pos.size == 1 else pos
    return mx.fast.rope(
        x, dims, traditional=False, base=base, scale=scale, offset=offset, freqs=freqs
    )


# shape-specialised: on the CPU mx.fast.rope expands into slices, which shapeless tracing refuses;
# positions are an array so that decode steps reuse one trace
_rope = mx.compile(_rope_graph)


def _norm_rope_graph(x, weight, eps: float, pos, dims: int, base, scale, freqs, D: int):
    """rms_norm over the first D channels of each (B, L, H, P) head -> (B, H, L, D), rotated
    unless ``dims`` is 0."""
    y = mx.fast.rms_norm(x[..., :D] if x.shape[-1] > D else x, weight, eps)
    y = y.transpose(0, 2, 1, 3)
    if not dims:
        return y
    return _rope_graph(y, pos, dims, base, scale, freqs)


_norm_rope = mx.compile(_norm_rope_graph)  # shape-specialised, as _rope


def norm_rope(x: mx.array | Heads, norm: RMSNorm, rope: RoPE, pos: mx.array) -> mx.array:
    """Per-head norm then RoPE: x (B, L, H, D) (or ``Heads`` of a fused projection) -> (B, H, L,
    D), one kernel."""
    if use_kernels() and pos.ndim == 1:  # a token tree's (1, L) positions: the reference
        return norm_rope_kernel.rms_norm_rope(
            x, norm.weight, rope.inv_freq, eps=norm.eps, offset=pos, scale=rope.scale
        )
    (x,) = split_heads((x,))
    return _norm_rope_any(x, norm.weight, norm.eps, pos, rope, x.shape[-1])


def _norm_rope_any(x, weight, eps: float, pos, rope: RoPE | None, D: int) -> mx.array:
    """``_norm_rope`` (``rope`` None: the norm alone): on the CPU the extension's norm and RoPE
    (two ops), elsewhere the compiled MLX graph."""
    xs = x[..., :D] if x.shape[-1] > D else x  # (B, L, H, D)
    ext = _cpu_ext(xs, weight)
    if ext is not None:  # the rope takes the extension too where it can
        y = ext.rms_norm_cpu(xs, weight, eps).transpose(0, 2, 1, 3)
        return y if rope is None else rope(y, pos)
    if rope is None:
        return _norm_rope(x, weight, eps, pos, 0, None, 1.0, None, D)
    return _norm_rope(x, weight, eps, pos, rope.dims, rope.base, rope.scale, rope.freqs, D)


def qk_norm_rope(
    q: mx.array | Heads,
    k: mx.array | Heads,
    q_norm: RMSNorm,
    k_norm: RMSNorm,
    rope: RoPE,
    pos: mx.array,
    v: mx.array | Heads | None = None,
    v_norm: bool = True,
) -> tuple[mx.array, ...]:
    """Queries' and keys' per-head norms then RoPE, all in one kernel: q (B, L, Hq, P), k (B, L,
    Hk, D) -> (B, H, L, D) each; queries wider than D (Qwen 3.5's [query | gate] heads) use their
    first D channels. ``v`` given: also returned, normed without weight (``v_norm`` False: not
    normed, only laid out (B, H, L, D)) and not rotated. One eps for all, ``q_norm``'s (as the
    kernel takes it). Any of q, k, v may be ``Heads`` of a fused projection's output
    (``FusedQKV.project_packed``): the kernel reads them in place."""
    if use_kernels() and pos.ndim == 1:  # a token tree's (1, L) positions: the reference
        return norm_rope_kernel.qk_norm_rope(
            q, k, q_norm.weight, k_norm.weight, rope.inv_freq,
            eps=q_norm.eps, offset=pos, scale=rope.scale, v=v, v_norm=v_norm,
        )  # fmt: skip
    q, k, v = split_heads((q, k, v))
    D, eps = k.shape[-1], q_norm.eps
    q = _norm_rope_any(q, q_norm.weight, eps, pos, rope, D)
    k = _norm_rope_any(k, k_norm.weight, eps, pos, rope, D)
    if v is None:
        return q, k
    if not v_norm:
        return q, k, v.transpose(0, 2, 1, 3)
    return q, k, _norm_rope_any(v, None, eps, pos, None, D)


def rope_qkv(
    q: mx.array | Heads, k: mx.array | Heads, v: mx.array | Heads, rope: RoPE, pos: mx.array
) -> tuple[mx.array, mx.array, mx.array]:
    """RoPE of q and k, v only laid out, for attention without head norms (Llama, Qwen 2): q
    (B, L, Hq, D), k and v (B, L, Hk, D) (or ``Heads`` of a fused projection) -> (B, H, L, D)
    each, one kernel (which can also write k and v into a recorded graph's cache)."""
    if use_kernels() and pos.ndim == 1:  # a token tree's (1, L) positions: the reference
        return norm_rope_kernel.qkv_rope(q, k, v, rope.inv_freq, offset=pos, scale=rope.scale)
    q, k, v = (t.transpose(0, 2, 1, 3) for t in split_heads((q, k, v)))
    return rope(q, pos), rope(k, pos), v


# ---- activations ---------------------------------------------------------------------------------

_ACTIVATIONS = {"silu": nn.silu, "gelu_tanh": nn.gelu_approx, "gelu": nn.gelu}
# act(gate) * up compiled into one kernel per activation
_GATED = {
    name: mx.compile(lambda gate, up, f=f: f(gate) * up, shapeless=True)
    for name, f in _ACTIVATIONS.items()
}


def gated_activation(
    gate: mx.array, up: mx.array | None = None, kind: str = "silu", kernel: bool = True
) -> mx.array:
    """``act(gate) * up``, ``kind`` one of "silu", "gelu_tanh", "gelu" (exact: no kernel). ``up``
    None: ``gate`` is a fused [gate | up] projection (last axis), which the kernel reads whole.
    ``kernel`` False keeps the compiled MLX graph (an input the kernel would first copy)."""
    if kernel and kind in activations.ACTIVATIONS and use_kernels():
        return activations.gated_activation(gate, up, kind)
    if up is None:
        gate, up = mx.split(gate, 2, axis=-1)
    if kind == "silu" and custom_kernels.avoid_mlx_jit():  # unfused: no fusion to JIT
        return gated_delta.silu(gate) * up
    if kind == "silu" and up.dtype == mx.float32 and up.shape == gate.shape:
        ext = _cpu_ext(gate)
        if ext is not None:  # the CPU: MLX's values, its exp vectorized (12 ns an element)
            return ext.silu_glu_cpu(gate, up)
    return _GATED[kind](gate, up)


_GLU_ACTS = expert_glu_kernel.ACTIVATIONS


def gated_projection(proj: nn.Module, x: mx.array, kind: str = "silu") -> mx.array:
    """``act(gate) * up`` of a fused [gate | up] projection ``proj``: x (..., D) -> (..., F).
    A GGML layer with kernels and 1..32 rows: one launch (expert_glu.dense_glu, the experts' GLU
    kernel over one expert), an MLX affine kernel linear likewise (``glu``, on CUDA); otherwise
    ``proj``, then ``gated_activation``."""
    t = getattr(proj, "ggml_type", None)
    if t is not None and use_kernels() and kind in _GLU_ACTS and "bias" not in proj:
        y = expert_glu_kernel.dense_glu(x, proj.weight, t, proj.in_features, kind)
        if y is not None:
            return y
    glu = getattr(proj, "glu", None)  # MLX affine rows turned into kernel linears
    if glu is not None and use_kernels():
        y = glu(x, kind)
        if y is not None:
            return y
    return gated_activation(proj(x), None, kind)


def expert_glu(
    x: mx.array, ids: mx.array, gate_up: nn.Module, up: nn.Module | None = None, kind: str = "silu"
) -> mx.array:
    """``act(gate) * up`` of the routed experts: x (..., D), ids (..., k) -> (..., k, F).
    ``gate_up`` an ExpertLinear of fused [gate | up] rows, or the gate rows with ``up``. GGML or
    MLX affine experts with kernels: gate, up and the activation in one kernel (expert_glu.py,
    expert_glu_affine.py)."""
    if use_kernels() and getattr(gate_up, "mode", None) == "affine" and kind in _GLU_ACTS:
        gs, bits = gate_up.group_size, gate_up.bits
        arrays = (gate_up.weight, gate_up.scales, gate_up.get("biases"))
        up_arrays = None if up is None else (up.weight, up.scales, up.get("biases"))
        same = up is None or (up.group_size, up.bits, up.mode) == (gs, bits, "affine")
        if same and affine_glu_kernel.kernel_covers(x, arrays, up_arrays, ids, gs, bits):
            return affine_glu_kernel.expert_glu_affine(x, arrays, ids, gs, bits, kind, up_arrays)
        if same and affine_q4_1.covers(x, ids, (arrays, up_arrays), gs, bits):
            # a prompt: the experts as Q4_1 blocks through the grouped kernels (no gather_qmm)
            w = affine_q4_1.to_q4_1(*arrays, gs)
            w_up = None if up is None else affine_q4_1.to_q4_1(*up_arrays, gs)
            return expert_glu_kernel.expert_glu(x, w, ids, affine_q4_1.Q4_1, x.shape[-1], kind,
                                                w_up)  # fmt: skip
    t = getattr(gate_up, "ggml_type", None)
    if (
        use_kernels()
        and t is not None
        and kind in _GLU_ACTS
        and (up is None or getattr(up, "ggml_type", None) == t)
    ):
        w_up = None if up is None else up.weight
        return expert_glu_kernel.expert_glu(x, gate_up.weight, ids, t, gate_up.in_features,
                                            kind, w_up)  # fmt: skip
    if up is None:
        return gated_activation(gate_up(x, ids), None, kind)
    return gated_activation(gate_up(x, ids), up(x, ids), kind)


def expert_down(h: mx.array, ids: mx.array, weights: mx.array, down: nn.Module) -> mx.array:
    """The routed experts' down projections summed with their gate weights: h (..., k, F),
    ids and weights (..., k) -> (..., D). GGML or MLX affine experts with kernels: one kernel
    (expert_down.py, expert_down_affine.py); otherwise ``down``, then the weighted sum in h's
    dtype."""
    if use_kernels() and getattr(down, "mode", None) == "affine":
        arrays = (down.weight, down.scales, down.get("biases"))
        gs, bits = down.group_size, down.bits
        if affine_down_kernel.kernel_covers(h, arrays, ids, weights, gs, bits):
            return affine_down_kernel.expert_down_affine(h, arrays, ids, weights, gs, bits)
        if affine_q4_1.covers(h, ids, (arrays,), gs, bits):  # a prompt: as in expert_glu
            w = affine_q4_1.to_q4_1(*arrays, gs)
            return expert_down_kernel.expert_down(h, w, ids, weights, affine_q4_1.Q4_1,
                                                  h.shape[-1])  # fmt: skip
    t = getattr(down, "ggml_type", None)
    if use_kernels() and t is not None:
        return expert_down_kernel.expert_down(h, down.weight, ids, weights, t, down.in_features)
    y = down(h, ids)  # (..., k, D)
    return (y * weights[..., None].astype(y.dtype)).sum(axis=-2)


def pick(a: mx.array, ids: mx.array) -> mx.array:
    """a (..., E) or (E,) at the last axis's ``ids`` (..., k) -> (..., k): ``take_along_axis``
    (or ``a[ids]`` for a 1-D a). With ``custom_kernels.avoid_mlx_jit()`` a one-hot select
    summed over E instead (ops MLX's CUDA back end ships compiled; its gathers compile at
    first use): the same values, but a -0.0 comes back +0.0."""
    if not custom_kernels.avoid_mlx_jit():
        return a[ids] if a.ndim == 1 else mx.take_along_axis(a, ids, axis=-1)
    hit = ids[..., None] == mx.arange(a.shape[-1], dtype=ids.dtype)  # (..., k, E)
    return mx.where(hit, a if a.ndim == 1 else a[..., None, :], 0).sum(axis=-1)


def _router_kernel(x: mx.array, proj: nn.Module, k: int, **opts) -> tuple | None:
    """The router kernel's outputs (moe_router.moe_router) for a router projection it reads
    (nn.Linear or affine nn.QuantizedLinear, unbiased) and a call it covers; None otherwise.
    The caller has checked that kernels run."""
    if "bias" in proj:
        return None
    if isinstance(proj, nn.QuantizedLinear) and proj.mode == "affine":
        opts["quant"] = (proj.scales, proj.get("biases"), proj.group_size, proj.bits)
    elif not isinstance(proj, nn.Linear):
        return None
    if not moe_router_kernel.kernel_covers(x, proj.weight, k, **opts):
        return None
    return moe_router_kernel.moe_router(x, proj.weight, k, **opts)


def moe_router(
    x: mx.array,
    proj: nn.Module,
    k: int,
    *,
    eps: float = 1e-6,
    pre_scale: mx.array | None = None,
    pre_mult: float = 1.0,
    expert_scale: mx.array | None = None,
    renormalize: bool = True,
    post_norm: RMSNorm | None = None,
) -> tuple[mx.array, mx.array, mx.array | None] | None:
    """The router kernel (moe_router.py: logits, top-k, weights and ``post_norm(x)`` in one
    launch) -> (ids (..., k) uint32, weights (..., k) fp32, post_norm(x) or None); None when it
    does not apply (no kernels, a biased or GGML router, prefill rows): the model then builds
    its own routing graph, the reference. ``proj``: nn.Linear or affine nn.QuantizedLinear."""
    if not use_kernels():
        return None
    norm_w = None if post_norm is None or post_norm.eps != eps else post_norm.weight
    out = _router_kernel(
        x, proj, k, eps=eps, pre_scale=pre_scale, pre_mult=pre_mult, expert_scale=expert_scale,
        renormalize=renormalize, post_norm=norm_w,
    )  # fmt: skip
    if out is None:
        return None
    ids, weights, xn = out
    return ids, weights, xn if norm_w is not None or post_norm is None else post_norm(x)


def moe_router_joined(
    x: mx.array,
    y: mx.array,
    norm: RMSNorm,
    next_norm: RMSNorm,
    proj: nn.Module,
    k: int,
    *,
    eps: float,
    pre_scale: mx.array | None = None,
    pre_mult: float = 1.0,
    expert_scale: mx.array | None = None,
    post_norm: RMSNorm | None = None,
) -> tuple[mx.array, ...] | None:
    """``post_norm_residual(x, y, norm, next_norm)`` and :func:`moe_router` on its h in ONE
    kernel launch (a Gemma 4 MoE layer's join after attention: one launch fewer) -> (h, n,
    ids, weights, post_norm(h)), the separate kernels' bits; None where it does not apply (as
    :func:`moe_router`, norms of another eps, or ``HF2Q_ROUTER_JOIN`` not 1: on the H100 it
    lost 1 % on 26B-A4B, moe_router.JOIN)."""
    if not (use_kernels() and moe_router_kernel.join_enabled("post_norm")):
        return None
    if post_norm is None or any(m.eps != eps for m in (norm, next_norm, post_norm)):
        return None
    out = _router_kernel(
        y, proj, k, eps=eps, pre_scale=pre_scale, pre_mult=pre_mult, expert_scale=expert_scale,
        post_norm=post_norm.weight, residual=(x, norm.weight, next_norm.weight),
    )  # fmt: skip
    if out is None:
        return None
    ids, weights, xn, h, n = out
    return h, n, ids, weights, xn


def moe_router_after_residual(
    x: mx.array, y: mx.array, norm: RMSNorm, proj: nn.Module, k: int, *, renormalize: bool = True
) -> tuple[mx.array, ...] | None:
    """``residual_norm(x, y, norm)`` and :func:`moe_router` on its n in ONE kernel launch (a
    Qwen 3.5 MoE layer's add and norm after attention: one launch fewer) -> (h, n, ids,
    weights), the separate kernels' bits; None where it does not apply (as
    :func:`moe_router`, ``HF2Q_ROUTER_JOIN=0``)."""
    if not (use_kernels() and moe_router_kernel.join_enabled("residual")):
        return None
    out = _router_kernel(y, proj, k, eps=norm.eps, renormalize=renormalize,
                         residual=(x, norm.weight, None))  # fmt: skip
    if out is None:
        return None
    ids, weights, _, h, n = out
    return h, n, ids, weights


@partial(mx.compile, shapeless=True)
def _sigmoid_gate(x: mx.array, gate: mx.array) -> mx.array:
    return x * mx.sigmoid(gate)


def sigmoid_gate(x: mx.array, gate: mx.array) -> mx.array:
    """``x * sigmoid(gate)``, one compiled kernel."""
    return _sigmoid_gate(x, gate)


def _gate_kernels() -> bool:
    """Qwen 3.5's gate kernels: in a recorded CUDA graph step always, elsewhere once they are
    GPU-verified (``sigmoid_gate.GPU_VERIFIED``)."""
    return use_kernels() and (sigmoid_gate_kernel.GPU_VERIFIED or launch_recorder.active())


def head_gate(x: mx.array, qg: mx.array | Heads) -> mx.array:
    """Gated attention's output: x (B, L, H D) times sigmoid of each [query | gate] head's gate
    half (qg (B, L, H, 2 D), or ``Heads`` of a fused q/k/v output); with kernels one launch
    reading the gates in place."""
    if _gate_kernels():
        return sigmoid_gate_kernel.head_gate(x, qg)
    (qg,) = split_heads([qg])
    B, L, _, D2 = qg.shape
    return sigmoid_gate(x, qg[..., D2 // 2 :].reshape(B, L, -1))


def gate_weight(gate: nn.Module) -> mx.array | None:
    """A one-output gate's weight as a dense (1, D) array for ``shared_gate_add``: an
    ``nn.Linear``'s own, an affine ``nn.QuantizedLinear``'s dequantized once and kept with the
    codes it came from; None for anything else (the caller's ops then)."""
    if "bias" in gate:
        return None
    if isinstance(gate, nn.Linear):
        return gate["weight"]
    if not isinstance(gate, nn.QuantizedLinear) or gate.mode != "affine" or "biases" not in gate:
        return None
    kept = vars(gate).get("_dense_gate")
    if kept is None or kept[0] is not gate["weight"]:
        w = mx.dequantize(gate["weight"], gate["scales"], gate["biases"],
                          group_size=gate.group_size, bits=gate.bits)  # fmt: skip
        mx.eval(w)
        kept = (gate["weight"], w)
        object.__setattr__(gate, "_dense_gate", kept)
    return kept[1]


def shared_gate_add(y: mx.array, s: mx.array, x: mx.array, w: mx.array) -> mx.array | None:
    """``y + s * sigmoid(x @ w.T)`` as one kernel (None without kernels: the caller's ops)."""
    if _gate_kernels():
        return sigmoid_gate_kernel.shared_gate_add(y, s, x, w)
    return None


def shared_gate_residual_norm(
    y: mx.array, s: mx.array, x: mx.array, w: mx.array, h: mx.array, norm: RMSNorm
) -> tuple[mx.array, mx.array] | None:
    """``residual_norm(h, y + s * sigmoid(x @ w.T), norm)`` as one kernel with the two kernels'
    bits (shared_gate_add's, residual_rms_norm's); None unless kernels run and
    ``HF2Q_SHARED_GATE_NORM`` is not 0 (on since session 43: 1.03x on 35B-A3B)."""
    if not (_gate_kernels() and sigmoid_gate_kernel.gate_norm_enabled()):
        return None
    return sigmoid_gate_kernel.shared_gate_residual_norm(y, s, x, w, h, norm.weight, norm.eps)


# ---- logits and attention ------------------------------------------------------------------------


@partial(mx.compile, shapeless=True)
def _softcap(x: mx.array, cap: mx.array) -> mx.array:
    return mx.tanh(x / cap) * cap


def softcap(x: mx.array, cap: float | None) -> mx.array:
    """``cap * tanh(x / cap)`` (logit soft-capping); x itself when ``cap`` is None or 0."""
    if not cap:
        return x
    if use_kernels():
        return softcap_kernel.softcap(x, cap)
    return _softcap(x, mx.array(cap, dtype=x.dtype))  # the cap rounded to x's dtype first


def attention(
    q: mx.array, k: mx.array, v: mx.array, cache, scale: float, mask: mx.array | None
) -> mx.array:
    """q (B, Hq, L, Dk), keys/values as the cache returned them -> (B, L, Hq * Dv)."""
    out = attend(q, k, v, cache, scale, mask)
    return out if out.ndim == 3 else heads_merged(out)  # 3-D: merged by the cache's kernel
