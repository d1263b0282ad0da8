"""Llama (and SmolLM2): pre-norm blocks, grouped-query attention, SwiGLU MLP."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from hf2q_mlx.custom_kernels.graph_ops import cast
from hf2q_mlx.errors import UnsupportedArchitectureError
from hf2q_mlx.models import ops
from hf2q_mlx.models.base import BaseModelArgs
from hf2q_mlx.models.cache import KVCache, causal_mask
from hf2q_mlx.models.contract import Architecture
from hf2q_mlx.models.fused_projections import FusedQKV, fuse_gate_up, gated_mlp_hidden
from hf2q_mlx.models.llama_cpp_names import LLAMA_CPP_TENSOR_NAMES
from hf2q_mlx.models.ops import RMSNorm, RoPE


@dataclass
class ModelArgs(BaseModelArgs):
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    model_type: str = "llama"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    max_position_embeddings: int | None = None

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.hidden_act != "silu":
            raise UnsupportedArchitectureError(f"llama: activation {self.hidden_act!r}")
        # transformers >= 5 folds rope_theta and rope_scaling into rope_parameters
        rope = dict(self.rope_parameters or self.rope_scaling or {})
        self.rope_theta = rope.pop("rope_theta", self.rope_theta)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3"):
            raise UnsupportedArchitectureError(f"llama: rope type {rope_type!r}")
        self.rope_scaling = {**rope, "rope_type": rope_type} if rope_type != "default" else None


def rope_periods(args: ModelArgs) -> mx.array | None:
    """Per-pair RoPE periods (1 / inverse frequency) for llama3 scaling, else None."""
    s = args.rope_scaling
    if s is None or s["rope_type"] != "llama3":
        return None
    d = args.head_dim
    inv_freq = [args.rope_theta ** (-i / d) for i in range(0, d, 2)]
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_ctx = s["original_max_position_embeddings"]
    periods = []
    for f in inv_freq:
        wavelen = 2 * math.pi / f
        if wavelen < old_ctx / hi:  # high frequencies stay
            g = f
        elif wavelen > old_ctx / lo:  # low frequencies are slowed down by the factor
            g = f / factor
        else:  # in between: interpolate
            smooth = (old_ctx / wavelen - lo) / (hi - lo)
            g = (1 - smooth) * f / factor + smooth * f
        periods.append(1.0 / g)
    return mx.array(periods, dtype=mx.float32)


class Attention(FusedQKV, nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim, self.head_dim = args.hidden_size, args.head_dim
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.scale = self.head_dim**-0.5
        bias = args.attention_bias
        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=bias)
        s = args.rope_scaling
        scale = 1.0 / s["factor"] if s and s["rope_type"] == "linear" else 1.0
        periods = rope_periods(args)
        base = None if periods is not None else args.rope_theta
        self.rope = RoPE(self.head_dim, base, scale, periods)
        self._set_qkv_plan()

    def __call__(self, x: mx.array, cache, pos: mx.array) -> mx.array:
        B, L, _ = x.shape
        q, k, v = self.project_packed(x)  # each (B, L, H, D), unsplit: the kernel reads them
        q, k, v = ops.rope_qkv(q, k, v, self.rope, pos)  # each (B, H, L, D)
        if cache is not None:
            k, v, mask = cache.update_and_fetch(k, v)
        else:
            mask = causal_mask(L, 0)
        return self.o_proj(ops.attention(q, k, v, cache, self.scale, mask))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, bias: bool):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=bias)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=bias)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=bias)

    def fuse_projections(self) -> None:
        fuse_gate_up(self)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(gated_mlp_hidden(self, x, "silu"))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args.hidden_size, args.intermediate_size, args.mlp_bias)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def __call__(self, x: mx.array, n: mx.array, cache, next_norm: RMSNorm, pos: mx.array):
        """x the residual stream, n = input_layernorm(x) -> (x after the block, ``next_norm`` of
        it: the next block's input norm or the final one). Each residual add shares one kernel
        with the norm that follows it."""
        h, n = ops.residual_norm(x, self.self_attn(n, cache, pos), self.post_attention_layernorm)
        return ops.residual_norm(h, self.mlp(n), next_norm)


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [TransformerBlock(args) for _ in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        # the model dtype: a GGML embedding returns fp32 rows, which would run every layer in fp32
        h = cast(self.embed_tokens(inputs), self.norm.weight.dtype)  # a kernel when recorded
        cache = cache if cache is not None else [None] * len(self.layers)
        pos = ops.positions(cache[0])
        return ops.prenorm_layers(self.layers, h, cache, self.norm, pos)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = LlamaModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        h = self.model(inputs, cache)
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

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
        return [KVCache() for _ in self.layers]

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Drops precomputed rotary tables and, when tied, the duplicate output head."""
        return {
            k: v
            for k, v in weights.items()
            if "rotary_emb.inv_freq" not in k
            and not (k == "lm_head.weight" and self.args.tie_word_embeddings)
        }


# llama.cpp tensor names -> module parameters, beyond the shared ones
GGUF_TENSOR_MAP = {
    **LLAMA_CPP_TENSOR_NAMES,
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_output.bias": "model.layers.{i}.self_attn.o_proj.bias",
    "blk.{i}.ffn_gate.bias": "model.layers.{i}.mlp.gate_proj.bias",
    "blk.{i}.ffn_up.bias": "model.layers.{i}.mlp.up_proj.bias",
    "blk.{i}.ffn_down.bias": "model.layers.{i}.mlp.down_proj.bias",
}


def args_from_gguf(metadata: dict[str, Any], tensors: Mapping[str, Any]) -> ModelArgs:
    """llama.cpp's llama metadata -> ModelArgs; an absent output.weight means tied embeddings."""

    def get(key: str, default: Any = None) -> Any:
        return metadata.get(f"llama.{key}", default)

    n_heads, hidden = get("attention.head_count"), get("embedding_length")
    if "rope_freqs.weight" in tensors:
        raise UnsupportedArchitectureError("llama: GGUF rope_freqs (llama3 RoPE) is not supported")
    scaling = None
    if get("rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor", 1.0))}
    return ModelArgs(
        hidden_size=hidden,
        num_hidden_layers=get("block_count"),
        intermediate_size=get("feed_forward_length"),
        num_attention_heads=n_heads,
        num_key_value_heads=get("attention.head_count_kv", n_heads),
        head_dim=get("attention.key_length", get("rope.dimension_count", hidden // n_heads)),
        vocab_size=tensors["token_embd.weight"].shape[0],
        rms_norm_eps=get("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=get("rope.freq_base", 10_000.0),
        rope_scaling=scaling,
        attention_bias="blk.0.attn_q.bias" in tensors,
        mlp_bias="blk.0.ffn_up.bias" in tensors,
        tie_word_embeddings="output.weight" not in tensors,
        max_position_embeddings=get("context_length"),
    )


def _unpermute_rows(array: mx.array, n_heads: int) -> mx.array:
    # llama.cpp interleaves each head's two rotary halves row by row (its RoPE pairs adjacent
    # dims); rows are independent, so this also works on raw quantized block rows
    rows = array.shape[0]
    half = rows // n_heads // 2
    x = array.reshape(n_heads, half, 2, *array.shape[1:])
    return x.swapaxes(1, 2).reshape(array.shape)


def gguf_transform(name: str, array: mx.array, args: ModelArgs) -> mx.array:
    """Undo llama.cpp's q/k row permutation (weights and biases)."""
    if ".attn_q." in name:
        return _unpermute_rows(array, args.num_attention_heads)
    if ".attn_k." in name:
        return _unpermute_rows(array, args.num_key_value_heads)
    return array


# no RoPE description (rope=None): TurboQuant's key offset leaves every rotated channel alone
ARCHITECTURE = Architecture(
    model_types=("llama",),
    args=ModelArgs,
    model=Model,
    gguf_architectures=("llama",),
    gguf_tensor_map=GGUF_TENSOR_MAP,
    args_from_gguf=args_from_gguf,
    gguf_transform=gguf_transform,
)
