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

    def __call__(self, x: mx.array, post_norm: ops.RMSNorm | None = None):
        """x (..., H) -> expert ids (..., k) uint32, weights (..., k) fp32, and ``post_norm(x)``
        (the experts' input; None without), all three from one kernel when kernels run."""
        routed = ops.moe_router(
            x, self.proj, self.top_k, eps=self.eps, pre_scale=self.scale, pre_mult=self._root,
            expert_scale=self.per_expert_scale, post_norm=post_norm,
        )  # fmt: skip
        if routed is not None:
            return routed
        return self._reference(x, post_norm)

    def join(self, x: mx.array, y: mx.array, norm, next_norm, post_norm):
        """The layer's join ``post_norm_residual(x, y, norm, next_norm)`` -> (h, n) and this
        routing of h, in one kernel: (h, n, ids, weights, post_norm(h)); None where that kernel
        does not apply (the layer then runs the two)."""
        return ops.moe_router_joined(
            x, y, norm, next_norm, self.proj, self.top_k, eps=self.eps, pre_scale=self.scale,
            pre_mult=self._root, expert_scale=self.per_expert_scale, post_norm=post_norm,
        )  # fmt: skip

    def _reference(self, x: mx.array, post_norm):
        h = mx.fast.rms_norm(x, None, self.eps) * (self.scale * self._root).astype(x.dtype)
        logits = self.proj(h).astype(mx.float32)
        k = self.top_k
        ids = mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k]
        # softmax over the chosen k == full softmax renormalized over the top k
        w = mx.softmax(ops.pick(logits, ids), axis=-1, precise=True)
        xn = None if post_norm is None else post_norm(x)
        return ids, w * ops.pick(self.per_expert_scale, ids).astype(mx.float32), xn


class Experts(nn.Module):
    """E gated experts: gate_up_proj (E, 2I, H) -> act(gate) * up -> down_proj (E, H, I);
    ``activation`` as ``ops.gated_activation`` names it."""

    def __init__(self, hidden_size: int, intermediate: int, num_experts: int, activation: str):
        super().__init__()
        self.gate_up_proj = ExpertLinear(num_experts, hidden_size, 2 * intermediate)
        self.down_proj = ExpertLinear(num_experts, intermediate, hidden_size)
        self.activation = activation

    def __call__(self, x: mx.array, ids: mx.array, weights: mx.array) -> mx.array:
        # (..., k, I): gate_up (..., k, 2I) [gate | up] and the activation (one kernel for GGML)
        h = ops.expert_glu(x, ids, self.gate_up_proj, None, self.activation)
        return ops.expert_down(h, ids, weights, self.down_proj)  # (..., H)
