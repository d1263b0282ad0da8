"""Gemma 3 text model: interleaved sliding-window / global attention, q/k norms, 4 norms a block."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from hf2q_mlx.custom_kernels.graph_ops import scale_cast
from hf2q_mlx.custom_kernels.rms_norm_rope import rope_inv_freq
from hf2q_mlx.errors import UnsupportedArchitectureError
from hf2q_mlx.models import ops
from hf2q_mlx.models.base import BaseModelArgs
from hf2q_mlx.models.cache import KVCache, RotatingKVCache, causal_mask
from hf2q_mlx.models.contract import Architecture, LayerRoPE, TokenizerQuirks
from hf2q_mlx.models.encoder import bidirectional_mask
from hf2q_mlx.models.fused_projections import FusedQKV, fuse_gate_up, gated_mlp_hidden
from hf2q_mlx.models.llama_cpp_names import LLAMA_CPP_TENSOR_NAMES
from hf2q_mlx.models.ops import RMSNorm, RoPE


@dataclass
class ModelArgs(BaseModelArgs):
    # defaults are transformers' Gemma3TextConfig defaults: multimodal configs omit them
    hidden_size: int = 2304
    num_hidden_layers: int = 26
    intermediate_size: int = 9216
    num_attention_heads: int = 8
    vocab_size: int = 262_208
    num_key_value_heads: int = 4
    head_dim: int = 256
    model_type: str = "gemma3_text"
    rms_norm_eps: float = 1e-6
    query_pre_attn_scalar: float = 256
    sliding_window: int = 4096
    sliding_window_pattern: int = 6
    layer_types: list[str] | None = None
    rope_theta: float = 1_000_000.0
    rope_local_base_freq: float = 10_000.0
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    use_bidirectional_attention: bool = False
    attention_bias: bool = False
    hidden_activation: str = "gelu_pytorch_tanh"
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 131_072

    @classmethod
    def from_dict(cls, params: dict) -> ModelArgs:
        # the multimodal "gemma3" config nests the language model's settings in text_config
        if "text_config" in params:
            params = {**params["text_config"], "model_type": params.get("model_type", "gemma3")}
        return super().from_dict(params)

    def __post_init__(self):
        if self.attn_logit_softcapping is not None:
            raise UnsupportedArchitectureError("gemma3: attention logit softcapping")
        if self.hidden_activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise UnsupportedArchitectureError(f"gemma3: activation {self.hidden_activation}")
        if self.layer_types is None:
            p = self.sliding_window_pattern
            self.layer_types = [
                "sliding_attention" if (i + 1) % p else "full_attention"
                for i in range(self.num_hidden_layers)
            ]
        # transformers >= 5 writes rope settings per layer type in rope_parameters
        rp = self.rope_parameters or {}
        full = rp.get("full_attention") or self.rope_scaling or {}
        self.rope_theta = full.get("rope_theta", self.rope_theta)
        self.rope_local_base_freq = (rp.get("sliding_attention") or {}).get(
            "rope_theta", self.rope_local_base_freq
        )
        rope_type = full.get("rope_type", full.get("type", "default"))
        if rope_type not in ("default", "linear"):
            raise UnsupportedArchitectureError(f"gemma3: rope type {rope_type!r}")
        self.rope_scaling = {"rope_type": rope_type, "factor": float(full.get("factor", 1.0))}


class Attention(FusedQKV, nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        dim, self.head_dim = args.hidden_size, args.head_dim
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.scale = args.query_pre_attn_scalar**-0.5
        self.is_sliding = args.layer_types[layer_idx] == "sliding_attention"
        self.window = args.sliding_window if self.is_sliding else None
        self.bidirectional = args.use_bidirectional_attention  # EmbeddingGemma
        bias = args.attention_bias
        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
        if self.is_sliding:
            self.rope = RoPE(self.head_dim, args.rope_local_base_freq)
        else:
            self.rope = RoPE(self.head_dim, args.rope_theta, 1.0 / args.rope_scaling["factor"])
        self._set_qkv_plan()

    def __call__(self, x: mx.array, cache, pos: mx.array) -> mx.array:
        B, L, _ = x.shape
        q, k, v = self.project_packed(x)  # each (B, L, H, D), unsplit: the kernel reads them
        # v (no norm) only laid out (B, H, L, D) by the same kernel
        args = (self.q_norm, self.k_norm, self.rope, pos)
        q, k, v = ops.qk_norm_rope(q, k, *args, v=v, v_norm=False)
        if cache is not None:
            k, v, mask = cache.update_and_fetch(k, v)
        elif self.bidirectional:
            mask = bidirectional_mask(L, self.window)
        else:
            mask = causal_mask(L, 0, self.window)
        return self.o_proj(ops.attention(q, k, v, cache, self.scale, mask))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)

    def fuse_projections(self) -> None:
        fuse_gate_up(self)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(gated_mlp_hidden(self, x, "gelu_tanh"))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        dim, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = Attention(args, layer_idx)
        self.mlp = MLP(dim, args.intermediate_size)
        self.input_layernorm = RMSNorm(dim, eps)
        self.post_attention_layernorm = RMSNorm(dim, eps)
        self.pre_feedforward_layernorm = RMSNorm(dim, eps)
        self.post_feedforward_layernorm = RMSNorm(dim, eps)

    def __call__(self, x: mx.array, n: mx.array, cache, next_norm: RMSNorm, pos: mx.array):
        """x the residual stream, n = input_layernorm(x) -> (x after the block, ``next_norm`` of
        it: the next block's input norm or the final one). Each residual add shares one kernel
        with the norm that follows it."""
        y = self.self_attn(n, cache, pos)
        h, n = ops.residual_norm(
            x, y, self.pre_feedforward_layernorm, self.post_attention_layernorm
        )
        return ops.residual_norm(h, self.mlp(n), next_norm, self.post_feedforward_layernorm)


class Gemma3Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [TransformerBlock(args, i) for i in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        # the model dtype: a GGML embedding returns fp32 rows, which would run every layer in fp32
        # the scale is rounded to the activation dtype first, as the reference does; a kernel
        # when recorded
        h = scale_cast(self.embed_tokens(inputs), math.sqrt(self.args.hidden_size),
                       self.norm.weight.dtype)  # fmt: skip
        cache = cache if cache is not None else [None] * len(self.layers)
        pos = ops.positions(cache[0])
        return ops.prenorm_layers(self.layers, h, cache, self.norm, pos)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = Gemma3Model(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        h = self.model(inputs, cache)
        if self.args.tie_word_embeddings:
            logits = self.model.embed_tokens.as_linear(h)
        else:
            logits = self.lm_head(h)
        return ops.softcap(logits, self.args.final_logit_softcapping)

    @property
    def layers(self) -> list[TransformerBlock]:
        return self.model.layers

    def fuse_projections(self) -> Model:
        """After ``load_weights``: q/k/v and gate/up as one matmul each where the weights stack
        (one dtype, GGML type or mlx quantization); differing ones stay apart. Outputs do not
        change. The fused model loads no more checkpoints (its parameter names changed)."""
        for layer in self.layers:
            layer.self_attn.fuse_projections()
            layer.mlp.fuse_projections()
        return self

    def make_cache(self, reserve: int = 0) -> list:
        if self.args.use_bidirectional_attention:
            raise UnsupportedArchitectureError(
                "gemma3 with bidirectional attention is an embedding model: it does not "
                "generate text (use hf2q_mlx.embed or `hf2q-mlx embed`)"
            )
        return [
            RotatingKVCache(self.args.sliding_window, reserve)
            if layer.self_attn.is_sliding
            else KVCache()
            for layer in self.layers
        ]

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """HF / mlx-lm names -> ours; drops the vision tower; norms w -> effective 1 + w."""
        out = {}
        for name, w in weights.items():
            if name.startswith(("vision_tower", "multi_modal_projector", "model.vision_tower")):
                continue
            if name.startswith("model.multi_modal_projector"):
                continue
            for prefix, repl in _PREFIXES:
                if name.startswith(prefix):
                    name = repl + name[len(prefix) :]
                    break
            if name == "lm_head.weight" and self.args.tie_word_embeddings:
                continue
            if name.endswith("norm.weight"):
                w = 1.0 + w.astype(mx.float32)  # add in fp32: HF computes 1 + w in fp32
            out[name] = w
        return out


# checkpoint prefixes of the multimodal Gemma3ForConditionalGeneration (old and new layouts)
_PREFIXES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
    # a bare Gemma3TextModel (sentence-transformers folders: EmbeddingGemma)
    ("embed_tokens.", "model.embed_tokens."),
    ("layers.", "model.layers."),
    ("norm.", "model.norm."),
)

# llama.cpp tensor names -> module parameters; llama.cpp already stores norms as 1 + w
GGUF_TENSOR_MAP = {
    **LLAMA_CPP_TENSOR_NAMES,
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight",
}


def args_from_gguf(metadata: dict[str, Any], tensors: Mapping[str, Any]) -> ModelArgs:
    """llama.cpp's gemma3 metadata -> ModelArgs, with llama.cpp's defaults for what it omits."""

    def get(key: str, default: Any = None) -> Any:
        return metadata.get(f"gemma3.{key}", default)

    n_layers, hidden = get("block_count"), get("embedding_length")
    n_heads, head_dim = get("attention.head_count"), get("attention.key_length", 256)
    # llama.cpp hard-codes what its converter does not write: pattern 6, local base 10k, and the
    # 27B model (62 layers) scaling queries by hidden / heads instead of head_dim
    pattern = get("attention.sliding_window_pattern", 6)
    layer_types = None
    if isinstance(pattern, list):
        layer_types = ["sliding_attention" if s else "full_attention" for s in pattern]
        pattern = 6
    scaling = None
    if get("rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor", 1.0))}
    return ModelArgs(
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        intermediate_size=get("feed_forward_length"),
        num_attention_heads=n_heads,
        num_key_value_heads=get("attention.head_count_kv", n_heads),
        head_dim=head_dim,
        vocab_size=tensors["token_embd.weight"].shape[0],
        rms_norm_eps=get("attention.layer_norm_rms_epsilon", 1e-6),
        query_pre_attn_scalar=hidden // n_heads if n_layers == 62 else head_dim,
        sliding_window=get("attention.sliding_window", 4096),
        sliding_window_pattern=pattern,
        layer_types=layer_types,
        rope_theta=get("rope.freq_base", 1_000_000.0),
        rope_local_base_freq=get("rope.freq_base_swa", 10_000.0),
        rope_scaling=scaling,
        final_logit_softcapping=get("final_logit_softcapping"),
        tie_word_embeddings="output.weight" not in tensors,
        max_position_embeddings=get("context_length", 131_072),
    )


def gguf_transform(name: str, array: mx.array, args: ModelArgs) -> mx.array:
    """No value fixes: GGUF norms already hold 1 + w, which is what RMSNorm keeps."""
    return array


def rope_layers(args: ModelArgs) -> list[LayerRoPE]:
    """Whole-head RoPE: the local base on sliding layers, the global base and linear scale on
    full ones."""
    out = []
    for kind in args.layer_types:
        if kind == "sliding_attention":
            base, scale = args.rope_local_base_freq, 1.0
        else:
            base, scale = args.rope_theta, 1.0 / args.rope_scaling["factor"]
        out.append(LayerRoPE(freqs=rope_inv_freq(args.head_dim, base) * scale))
    return out


ARCHITECTURE = Architecture(
    model_types=("gemma3_text", "gemma3"),
    args=ModelArgs,
    model=Model,
    gguf_architectures=("gemma3",),
    gguf_tensor_map=GGUF_TENSOR_MAP,
    args_from_gguf=args_from_gguf,
    gguf_transform=gguf_transform,
    tokenizer=TokenizerQuirks(gemma_sentencepiece=True, chat_template="gemma"),
    rope=rope_layers,
)
