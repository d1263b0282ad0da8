"""Qwen 2 / Qwen 2.5: Llama's blocks with q/k/v biases and no o_proj bias."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import mlx.nn as nn

from hf2q_mlx.custom_kernels.rms_norm_rope import rope_inv_freq
from hf2q_mlx.errors import UnsupportedArchitectureError
from hf2q_mlx.models import llama
from hf2q_mlx.models.contract import Architecture, LayerRoPE


@dataclass
class ModelArgs(llama.ModelArgs):
    model_type: str = "qwen2"
    rms_norm_eps: float = 1e-6
    attention_bias: bool = True  # q/k/v only: Model drops the o_proj bias
    use_sliding_window: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.use_sliding_window:
            raise UnsupportedArchitectureError("qwen2: sliding-window attention is not supported")
        if not self.attention_bias or self.mlp_bias:
            raise UnsupportedArchitectureError("qwen2: q/k/v biases and no MLP bias expected")


class Model(llama.Model):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        for layer in self.layers:  # Llama biases o_proj with q/k/v; Qwen 2 does not
            attn = layer.self_attn
            attn.o_proj = nn.Linear(attn.n_heads * attn.head_dim, args.hidden_size, bias=False)


def args_from_gguf(metadata: dict[str, Any], tensors: Mapping[str, Any]) -> ModelArgs:
    """llama.cpp's ``qwen2.*`` keys are Llama's under another prefix."""
    renamed = {k.replace("qwen2.", "llama.", 1): v for k, v in metadata.items()}
    args = vars(llama.args_from_gguf(renamed, tensors))
    return ModelArgs.from_dict({**args, "model_type": "qwen2"})


def rope_layers(args: ModelArgs) -> list[LayerRoPE]:
    """Plain whole-head RoPE on every layer."""
    rope = LayerRoPE(dims=args.head_dim, freqs=rope_inv_freq(args.head_dim, args.rope_theta))
    return [rope] * args.num_hidden_layers


# llama.cpp rotates Qwen 2 NeoX-style (as HF does), so its q/k rows are stored unpermuted and the
# tensors need no transform; the chat template comes from the GGUF's tokenizer.chat_template
ARCHITECTURE = Architecture(
    model_types=("qwen2",),
    args=ModelArgs,
    model=Model,
    gguf_architectures=("qwen2",),
    gguf_tensor_map=llama.GGUF_TENSOR_MAP,
    args_from_gguf=args_from_gguf,
    rope=rope_layers,
)
