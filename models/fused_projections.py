"""Fused q/k/v and gate/up projections shared by the decoders (Gemma 3, Gemma 4, Llama)."""

from __future__ import annotations

import itertools

import mlx.core as mx
import mlx.nn as nn

from hf2q_mlx.custom_kernels.rms_norm_rope import Heads
from hf2q_mlx.models.ops import gated_activation, gated_projection
from hf2q_mlx.models.quantized import fuse_linear_groups

QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")


def heads_plan(groups, n_heads: int, n_kv_heads: int, names: tuple[str, ...] = QKV):
    """((attribute, head split points), ...) and the order that puts the outputs back as
    ``names`` (q, k, v; or q, k where V is K)."""
    heads = {"q_proj": n_heads, "k_proj": n_kv_heads, "v_proj": n_kv_heads}
    plan, produced = [], []
    for attr, members in groups:
        counts = [heads[m] for m in members]
        plan.append((attr, tuple(itertools.accumulate(counts[:-1]))))
        produced.extend(members)
    return tuple(plan), tuple(produced.index(name) for name in names)


class FusedQKV:
    """Mixin for an attention module with ``q_proj``/``k_proj``/``v_proj``, ``n_heads``,
    ``n_kv_heads`` and ``head_dim``: projects through whichever layers hold q/k/v after
    ``fuse_projections`` (one matmul per weight kind)."""

    # head_dim-wide heads q_proj yields per query head (Qwen 3.5's [query | gate] heads: 2)
    q_heads_per_head = 1

    def _set_qkv_plan(self, groups=None, names: tuple[str, ...] = QKV) -> None:
        groups = tuple((name, (name,)) for name in names) if groups is None else groups
        q_heads = self.n_heads * self.q_heads_per_head
        plan = heads_plan(groups, q_heads, self.n_kv_heads, names)
        # a plain attribute (object.__setattr__), outside the parameter tree
        object.__setattr__(self, "_qkv_plan", plan)

    def fuse_projections(self, names: tuple[str, ...] = QKV) -> None:
        """The ``names`` projections (q/k/v, or q/k where V is K) as one matmul where their
        weights stack (``quantized.fuse_linear_groups``)."""
        if all(name in self for name in names):  # not fused yet
            self._set_qkv_plan(fuse_linear_groups(self, names), names)

    def project_heads(self, x: mx.array, transpose: bool = True) -> list[mx.array]:
        """q, k, v as (B, H, L, D) (``transpose`` False: (B, L, H, D)): one reshape (and
        transpose) per matmul, then one split along the head axis (whole heads, contiguous when
        L == 1)."""
        B, L, _ = x.shape
        groups, order = self._qkv_plan
        axis = 1 if transpose else 2
        outs = []
        for attr, splits in groups:
            y = self[attr](x).reshape(B, L, -1, self.head_dim)
            if transpose:
                y = y.transpose(0, 2, 1, 3)
            outs.extend(mx.split(y, list(splits), axis=axis) if splits else [y])
        return [outs[i] for i in order]

    def project_packed(self, x: mx.array) -> list[Heads]:
        """q, k, v (q, k where V is K) as ``Heads`` of the matmul outputs (B, L, N), unsplit,
        for ``ops.norm_rope`` / ``ops.qk_norm_rope``: their kernel reads the heads in place, so
        a decode graph holds no reshape or split node between the matmul and the kernel (the
        reference splits)."""
        groups, order = self._qkv_plan
        outs = []
        for attr, splits in groups:
            y = self[attr](x)  # (B, L, heads * head_dim)
            bounds = (0, *splits, y.shape[-1] // self.head_dim)
            outs.extend(Heads(y, a, b - a, self.head_dim) for a, b in zip(bounds, bounds[1:]))
        return [outs[i] for i in order]


def fuse_gate_up(mlp: nn.Module) -> None:
    """gate/up as one matmul where their weights stack."""
    fuse_linear_groups(mlp, GATE_UP)


def gated_mlp_hidden(mlp: nn.Module, x: mx.array, kind: str) -> mx.array:
    """act(gate) * up (``ops.gated_activation``) from the fused ``gate_up_proj``, whose output the
    kernel reads whole, or from the separate projections."""
    if "gate_up_proj" in mlp:
        return gated_projection(mlp.gate_up_proj, x, kind)
    return gated_activation(mlp.gate_proj(x), mlp.up_proj(x), kind)
