"""Qwen 3.5 MoE: the Qwen 3.5 hybrid stack with a routed SwiGLU expert block and a gated shared
expert in every layer."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from hf2q_mlx.models import ops, qwen3_5
from hf2q_mlx.models.contract import Architecture
from hf2q_mlx.models.experts import ExpertLinear
from hf2q_mlx.models.qwen3_5 import MLP, gguf_config


@dataclass
class ModelArgs(qwen3_5.ModelArgs):
    model_type: str = "qwen3_5_moe_text"
    hidden_size: int = 2048
    num_hidden_layers: int = 40
    num_key_value_heads: int = 2
    num_experts: int = 256
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    norm_topk_prob: bool = True
    # experts' gate and up projections as one (E, 2I, D) weight (HF) or two (most GGUFs)
    fused_gate_up: bool = True


class Experts(nn.Module):
    """The routed experts: SwiGLU per (token, selected expert)."""

    def __init__(self, dims: int, hidden_dims: int, num_experts: int, fused_gate_up: bool):
        super().__init__()
        if fused_gate_up:
            self.gate_up_proj = ExpertLinear(num_experts, dims, 2 * hidden_dims)
        else:
            self.gate_proj = ExpertLinear(num_experts, dims, hidden_dims)
            self.up_proj = ExpertLinear(num_experts, dims, hidden_dims)
        self.down_proj = ExpertLinear(num_experts, hidden_dims, dims)

    def __call__(self, x: mx.array, indices: mx.array, scores: mx.array) -> mx.array:
        """x (..., D), indices and scores (..., k) -> the scores-weighted sum of the chosen
        experts' outputs (..., D)."""
        if "gate_up_proj" in self:  # (..., k, 2I): the kernels read it whole
            h = ops.expert_glu(x, indices, self.gate_up_proj)
        else:
            h = ops.expert_glu(x, indices, self.gate_proj, self.up_proj)
        return ops.expert_down(h, indices, scores, self.down_proj)


class SparseMoeBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.norm_topk_prob = args.norm_topk_prob
        h = args.hidden_size
        self.gate = nn.Linear(h, args.num_experts, bias=False)
        self.experts = Experts(h, args.moe_intermediate_size, args.num_experts, args.fused_gate_up)
        self.shared_expert = MLP(h, args.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(h, 1, bias=False)

    def route(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """x (..., D) -> expert ids (..., k) uint32, weights (..., k) fp32 (one kernel with
        kernels)."""
        k = self.top_k
        routed = ops.moe_router(x, self.gate, k, renormalize=self.norm_topk_prob)
        if routed is not None:
            return routed[:2]
        probs = mx.softmax(self.gate(x).astype(mx.float32), axis=-1)
        indices = mx.argpartition(-probs, kth=k - 1, axis=-1)[..., :k]  # (..., k), unordered
        scores = ops.pick(probs, indices)
        if self.norm_topk_prob:
            scores = scores / scores.sum(axis=-1, keepdims=True)
        return indices, scores

    def shared_gate(self, x: mx.array) -> mx.array:
        """``shared_expert_gate(x)`` (..., 1) in one Matmul node for one row. A dense gate
        multiplies by its weight's transposed view, kept evaluated (nn.Linear's ``x @ w.T``
        adds a Transpose node to every step); a single row's L tokens (1, L, D) (a decode or a
        verify) by that view as (1, D, 1), the same GEMM as (L, D) @ (D, 1) without the
        Flatten / Unflatten MLX puts around a 3-D x times a 2-D weight."""
        gate = self.shared_expert_gate
        if type(gate) is not nn.Linear or "bias" in gate:
            return gate(x)
        weight = gate["weight"]  # (1, D)
        cached = vars(self).get("_gate_t")
        if cached is None or cached[0] is not weight:
            # a plain attribute (nn.Module would put it in the parameter tree); a new weight
            # fails the identity check and is transposed anew
            cached = (weight, weight.T, weight.T[None])  # (D, 1), (1, D, 1): views
            object.__setattr__(self, "_gate_t", cached)
            with contextlib.suppress(ValueError):  # a traced weight (compile inputs): lazy
                mx.eval(cached[1:])  # leaf views: the compiled step holds no Transpose
        one_row = x.ndim == 3 and x.shape[0] == 1
        return x @ cached[2 if one_row else 1]

    def join(self, x: mx.array, y: mx.array, norm: ops.RMSNorm):
        """The layer's ``residual_norm(x, y, norm)`` -> (h, n) and this block's routing of n, in
        one kernel: (h, n, (ids, weights)); None where that kernel does not apply."""
        out = ops.moe_router_after_residual(
            x, y, norm, self.gate, self.top_k, renormalize=self.norm_topk_prob
        )
        return None if out is None else (out[0], out[1], out[2:])

    def __call__(self, x: mx.array, routed: tuple | None = None) -> mx.array:
        """x (..., D) -> (..., D); ``routed``: (ids, weights) of x when made already (``join``).
        Every op takes any leading shape: no reshape nodes."""
        w = ops.gate_weight(self.shared_expert_gate)
        return self._end(*self._branches(x, routed), x, w)

    def then_residual_norm(
        self, x: mx.array, routed: tuple | None, h: mx.array, norm: ops.RMSNorm
    ) -> tuple[mx.array, mx.array]:
        """``residual_norm(h, self(x, routed), norm)``; with kernels (and ``HF2Q_SHARED_GATE_NORM``
        not 0) the block's last kernel makes the add and the norm too (one launch fewer)."""
        y, shared = self._branches(x, routed)
        w = ops.gate_weight(self.shared_expert_gate)
        out = None if w is None else ops.shared_gate_residual_norm(y, shared, x, w, h, norm)
        return out if out is not None else ops.residual_norm(h, self._end(y, shared, x, w), norm)

    def _branches(self, x: mx.array, routed: tuple | None) -> tuple[mx.array, mx.array]:
        """(routed experts' weighted sum, shared expert) of x."""
        indices, scores = self.route(x) if routed is None else routed
        return self.experts(x, indices, scores), self.shared_expert(x)

    def _end(self, y: mx.array, shared: mx.array, x: mx.array, w: mx.array | None) -> mx.array:
        """y + shared * sigmoid(gate(x)): one kernel with the gate's dot where it applies (w,
        ``ops.gate_weight`` of the gate)."""
        out = None if w is None else ops.shared_gate_add(y, shared, x, w)
        return y + ops.sigmoid_gate(shared, self.shared_gate(x)) if out is None else out


class Model(qwen3_5.Model):
    @staticmethod
    def make_mlp(args: ModelArgs) -> nn.Module:
        return SparseMoeBlock(args)

    def sanitize_mlp(self, weights: dict) -> dict:
        """HF's fused experts (gate_up_proj (E, 2I, D), down_proj (E, D, I)), per-expert tensors
        or mlx-lm's switch_mlp -> experts.{gate_up,down}_proj (or gate/up when not fused)."""
        fused = self.args.fused_gate_up
        for i in range(self.args.num_hidden_layers):
            p = f"model.layers.{i}.mlp"
            for name in ("gate_up_proj", "down_proj"):
                if f"{p}.experts.{name}" in weights:
                    weights[f"{p}.experts.{name}.weight"] = weights.pop(f"{p}.experts.{name}")
            if f"{p}.experts.0.gate_proj.weight" in weights:
                for name in ("gate_proj", "up_proj", "down_proj"):
                    weights[f"{p}.experts.{name}.weight"] = mx.stack(
                        [
                            weights.pop(f"{p}.experts.{e}.{name}.weight")
                            for e in range(self.args.num_experts)
                        ]
                    )
            for key in [k for k in weights if k.startswith(f"{p}.switch_mlp.")]:
                weights[key.replace(".switch_mlp.", ".experts.")] = weights.pop(key)
            for part in ("weight", "scales", "biases"):
                gate, up = f"{p}.experts.gate_proj.{part}", f"{p}.experts.up_proj.{part}"
                fused_key = f"{p}.experts.gate_up_proj.{part}"
                if fused and gate in weights:
                    # affine groups run along the input axis, so quantized halves stack too
                    weights[fused_key] = mx.concatenate(
                        [weights.pop(gate), weights.pop(up)], axis=-2
                    )
                elif not fused and fused_key in weights:
                    gate_up = weights.pop(fused_key)
                    mid = gate_up.shape[-2] // 2
                    weights[gate], weights[up] = gate_up[..., :mid, :], gate_up[..., mid:, :]
        return weights


GGUF_TENSOR_MAP = {
    **{k: v for k, v in qwen3_5.GGUF_TENSOR_MAP.items() if not k.startswith("blk.{i}.ffn_")},
    "blk.{i}.ffn_gate_inp.weight": "model.layers.{i}.mlp.gate.weight",
    "blk.{i}.ffn_gate_up_exps.weight": "model.layers.{i}.mlp.experts.gate_up_proj.weight",
    "blk.{i}.ffn_gate_exps.weight": "model.layers.{i}.mlp.experts.gate_proj.weight",
    "blk.{i}.ffn_up_exps.weight": "model.layers.{i}.mlp.experts.up_proj.weight",
    "blk.{i}.ffn_down_exps.weight": "model.layers.{i}.mlp.experts.down_proj.weight",
    "blk.{i}.ffn_gate_inp_shexp.weight": "model.layers.{i}.mlp.shared_expert_gate.weight",
    "blk.{i}.ffn_gate_shexp.weight": "model.layers.{i}.mlp.shared_expert.gate_proj.weight",
    "blk.{i}.ffn_up_shexp.weight": "model.layers.{i}.mlp.shared_expert.up_proj.weight",
    "blk.{i}.ffn_down_shexp.weight": "model.layers.{i}.mlp.shared_expert.down_proj.weight",
}


def args_from_gguf(metadata: dict, tensor_names=()) -> ModelArgs:
    """ModelArgs from llama.cpp's qwen35moe metadata; gate/up experts fused if stored so."""
    config = gguf_config(metadata, tensor_names)
    config["fused_gate_up"] = any(n.endswith("ffn_gate_up_exps.weight") for n in tensor_names)
    return ModelArgs.from_dict(config)


def gguf_transform(name: str, array: mx.array, args: ModelArgs | None = None) -> mx.array:
    """qwen35 fixes, plus the shared-expert gate, which llama.cpp may keep as a vector (D,)."""
    if name.endswith("ffn_gate_inp_shexp.weight") and array.ndim == 1:
        return array[None]
    return qwen3_5.gguf_transform(name, array, args)


ARCHITECTURE = Architecture(
    model_types=("qwen3_5_moe_text", "qwen3_5_moe"),
    args=ModelArgs,
    model=Model,
    gguf_architectures=("qwen35moe",),
    gguf_tensor_map=GGUF_TENSOR_MAP,
    args_from_gguf=args_from_gguf,
    gguf_transform=gguf_transform,
    tokenizer=qwen3_5.ARCHITECTURE.tokenizer,
    rope=qwen3_5.rope_layers,
)
