"""Gemma 4 mixture-of-experts block: router with per-expert scales and stacked GeGLU experts."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from hf2q_mlx.models import ops
from hf2q_mlx.models.experts import ExpertLinear, QuantizedExpertLinear  # noqa: F401  (their old home)


class Router(nn.Module):
    """Top-k expert choice from the residual stream: weights softmax-renormalized over the
    chosen k, then multiplied by a learned per-expert scale."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, eps: float):
        super().__init__()
        self.proj = nn.Linear(hidden_size, num_experts, bias=False)
        self.scale = mx.ones((hidden_size,))
        self.per_expert_scale = mx.ones((num_experts,))
        self.top_k, self.eps = top_k, eps
        self._root = hidden_size**-0.5

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """x (..., H) -> expert ids (..., k) uint32, weights (..., k) fp32."""
        h = mx.fast.rms_norm(x, None, self.eps) * (self.scale * self._root).astype(x.dtype)
        logits = self.proj(h).astype(mx.float32)
        k = self.top_k
        ids = mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k]
        # softmax over the chosen k == full softmax renormalized over the top k
        w = mx.softmax(mx.take_along_axis(logits, ids, axis=-1), axis=-1, precise=True)
        return ids, w * self.per_expert_scale[ids].astype(mx.float32)


class Experts(nn.Module):
    """E gated experts: gate_up_proj (E, 2I, H) -> act(gate) * up -> down_proj (E, H, I);
    ``activation`` as ``ops.gated_activation`` names it."""

    def __init__(self, hidden_size: int, intermediate: int, num_experts: int, activation: str):
        super().__init__()
        self.gate_up_proj = ExpertLinear(num_experts, hidden_size, 2 * intermediate)
        self.down_proj = ExpertLinear(num_experts, intermediate, hidden_size)
        self.activation = activation

    def __call__(self, x: mx.array, ids: mx.array, weights: mx.array) -> mx.array:
        # (..., k, 2I) [gate | up]: the reference splits it, the kernel reads it whole
        h = ops.gated_activation(self.gate_up_proj(x, ids), None, self.activation)
        y = self.down_proj(h, ids)  # (..., k, H)
        return (y * weights[..., None].astype(y.dtype)).sum(axis=-2)
