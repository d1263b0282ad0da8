"""Qwen 3.5: gated delta-net (linear attention) layers interleaved with gated full attention."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from hf2q_mlx.custom_kernels.graph_ops import cast
from hf2q_mlx.custom_kernels.rms_norm_rope import Heads, rope_inv_freq
from hf2q_mlx.errors import UnsupportedArchitectureError
from hf2q_mlx.models import ops
from hf2q_mlx.models.base import BaseModelArgs
from hf2q_mlx.models.cache import KVCache, causal_mask
from hf2q_mlx.models.contract import Architecture, LayerRoPE, TokenizerQuirks
from hf2q_mlx.models.delta_net_projections import FusedInProj
from hf2q_mlx.models.fused_projections import FusedQKV, fuse_gate_up, gated_mlp_hidden
from hf2q_mlx.models.llama_cpp_names import LLAMA_CPP_TENSOR_NAMES
from hf2q_mlx.models.ops import RMSNorm, RoPE
from hf2q_mlx.models.recurrent_cache import RecurrentCache, restore_cache, snapshot_cache


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str = "qwen3_5_text"
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    vocab_size: int = 248320
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    layer_types: list[str] | None = None
    full_attention_interval: int = 4
    # llama.cpp's GGUF stores the delta-net value heads tiled (head h reads key head h % Hk)
    v_heads_tiled: bool = False

    def __post_init__(self):
        if self.layer_types is None:
            n = self.full_attention_interval
            self.layer_types = [
                "full_attention" if (i + 1) % n == 0 else "linear_attention"
                for i in range(self.num_hidden_layers)
            ]

    @classmethod
    def from_dict(cls, params: dict):
        """HF config (a text config, or a multimodal one with ``text_config``) -> ModelArgs."""
        text = dict(params.get("text_config") or params)
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "mrope"):  # text positions make mrope plain RoPE
            raise UnsupportedArchitectureError(f"Qwen 3.5 RoPE type {kind!r} is not supported")
        for key in ("rope_theta", "partial_rotary_factor"):
            if key not in text and key in rope:
                text[key] = rope[key]
        return super().from_dict(text)


class GatedDeltaNet(FusedInProj, nn.Module):
    """Linear attention: in_proj qkv / z / b / a (fused by ``fuse_projections``), a short
    causal conv, the gated delta rule and a gated RMSNorm (``ops.gated_delta_net``), out_proj."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.num_k_heads = args.linear_num_key_heads
        self.num_v_heads = args.linear_num_value_heads
        self.head_k_dim = args.linear_key_head_dim
        self.head_v_dim = args.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.conv_dim = 2 * self.key_dim + self.num_v_heads * self.head_v_dim
        self.kernel_size = args.linear_conv_kernel_dim
        self.tiled = args.v_heads_tiled
        h, value_dim = args.hidden_size, self.num_v_heads * self.head_v_dim
        self.in_proj_qkv = nn.Linear(h, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(h, value_dim, bias=False)
        self.in_proj_b = nn.Linear(h, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(h, self.num_v_heads, bias=False)
        # depthwise causal conv, weight (C, K, 1) as mlx-lm keeps it; the kernels read (C, K)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, self.kernel_size, groups=self.conv_dim, bias=False
        )
        self.A_log = mx.zeros((self.num_v_heads,))
        self.dt_bias = mx.ones((self.num_v_heads,))
        self.norm = RMSNorm(self.head_v_dim, args.rms_norm_eps)  # a plain weight, gated by z
        self.out_proj = nn.Linear(value_dim, h, bias=False)
        self._set_in_plan()

    def __call__(self, x: mx.array, cache: RecurrentCache | None = None) -> mx.array:
        # conv, gates, delta rule and gated norm in ops (decode with kernels: one kernel)
        qkv, z, a, b = self.project(x)
        return self.out_proj(ops.gated_delta_net(self, qkv, z, a, b, cache))


class Attention(FusedQKV, nn.Module):
    """Full attention whose q_proj also yields a per-channel sigmoid gate on the output."""

    q_heads_per_head = 2  # q_proj's [query | gate] heads: two head_dim-wide heads each

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = args.head_dim**-0.5
        h, d, bias = args.hidden_size, args.head_dim, args.attention_bias
        self.q_proj = nn.Linear(h, self.n_heads * d * 2, bias=bias)
        self.k_proj = nn.Linear(h, self.n_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.n_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=bias)
        self.q_norm = RMSNorm(d, eps=args.rms_norm_eps)
        self.k_norm = RMSNorm(d, eps=args.rms_norm_eps)
        self.rope = RoPE(int(d * args.partial_rotary_factor), args.rope_theta)  # partial
        self._set_qkv_plan()  # fuse_projections (FusedQKV) stacks q/k/v where kinds match

    def _project(self, x: mx.array) -> tuple[Heads, Heads, Heads]:
        """q as (B, L, H, 2 D) [query | gate] heads, k and v as (B, L, Hk, D) heads, all read in
        place from the projections' outputs (fused or not)."""
        q, k, v = self.project_packed(x)  # q: 2 H heads of head_dim, the first of its output
        return Heads(q.data, q.first // 2, self.n_heads, 2 * self.head_dim), k, v

    def __call__(self, x: mx.array, cache: KVCache | None, pos: mx.array) -> mx.array:
        L = x.shape[1]
        qg, k, v = self._project(x)
        # one kernel: the queries' and keys' norms + RoPE, v laid out (B, Hk, L, D) beside them
        # (so the cache write can fold into it); the queries read out of the [query | gate] heads
        q, k, v = ops.qk_norm_rope(qg, k, self.q_norm, self.k_norm, self.rope, pos, v=v,
                                   v_norm=False)  # fmt: skip
        if cache is None:
            mask = causal_mask(L)
        else:
            k, v, mask = cache.update_and_fetch(k, v)
        out = ops.attention(q, k, v, cache, self.scale, mask)
        return self.o_proj(ops.head_gate(out, qg))


class MLP(nn.Module):
    def __init__(self, dims: int, hidden_dims: int):
        super().__init__()
        self.gate_proj = nn.Linear(dims, hidden_dims, bias=False)
        self.up_proj = nn.Linear(dims, hidden_dims, bias=False)
        self.down_proj = nn.Linear(hidden_dims, dims, bias=False)

    def fuse_projections(self) -> None:
        fuse_gate_up(self)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(gated_mlp_hidden(self, x, "silu"))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_type: str, mlp: nn.Module):
        super().__init__()
        self.is_linear = layer_type == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(args)
        else:
            self.self_attn = Attention(args)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, n: mx.array, cache, next_norm: RMSNorm, pos: mx.array):
        """x the residual stream, n = input_layernorm(x) -> (x after the layer, ``next_norm`` of
        it: the next layer's input norm or the final one). Each residual add shares one kernel
        with the norm that follows it."""
        y = self.linear_attn(n, cache) if self.is_linear else self.self_attn(n, cache, pos)
        # a MoE block's router kernel makes the add and norm too (one launch fewer), and its
        # last kernel the add and norm after it (another)
        join = getattr(self.mlp, "join", None)
        joined = None if join is None else join(x, y, self.post_attention_layernorm)
        if joined is None:
            h, n = ops.residual_norm(x, y, self.post_attention_layernorm)
            routed = None
        else:
            h, n, routed = joined
        then = getattr(self.mlp, "then_residual_norm", None)
        if then is None:
            return ops.residual_norm(h, self.mlp(n), next_norm)
        return then(n, routed, h, next_norm)


class TextModel(nn.Module):
    def __init__(self, args: ModelArgs, make_mlp):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [
            DecoderLayer(args, t, make_mlp(args))
            for t in args.layer_types[: args.num_hidden_layers]
        ]
        self.norm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, inputs: mx.array, cache: list | None = None) -> mx.array:
        # the model dtype: a GGML embedding returns fp32 rows, which would run every layer in fp32
        h = cast(self.embed_tokens(inputs), self.norm.weight.dtype)  # a kernel when recorded
        caches = cache or [None] * len(self.layers)
        pos = ops.positions(caches[0])
        return ops.prenorm_layers(self.layers, h, caches, self.norm, pos)


# zero-centred norms: HF stores w and computes (1 + w); the modules here hold 1 + w
_ZERO_CENTRED_NORMS = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "q_norm.weight",
    "k_norm.weight",
    "model.norm.weight",
)
_DROPPED_PREFIXES = ("mtp.", "model.visual.", "visual.", "vision_tower.", "model.mtp.")


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = TextModel(args, self.make_mlp)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    @staticmethod
    def make_mlp(args: ModelArgs) -> nn.Module:
        return MLP(args.hidden_size, args.intermediate_size)

    def __call__(self, inputs: mx.array, cache: list | None = None) -> mx.array:
        h = self.model(inputs, cache)
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    @property
    def layers(self) -> list:
        return self.model.layers

    def fuse_projections(self) -> Model:
        """Lossless, after loading (the loader calls it): each delta-net's input projections
        and each gate/up pair (the dense MLP, the MoE shared expert) and each attention's q/k/v
        as one matmul per weight kind where the weights stack."""
        for _, module in self.named_modules():
            if isinstance(module, (GatedDeltaNet, MLP, Attention)):
                module.fuse_projections()
        return self

    def make_cache(self, reserve: int = 0) -> list:
        """KVCache for attention layers, RecurrentCache(reserve) for delta-net layers."""
        return [RecurrentCache(reserve) if l.is_linear else KVCache() for l in self.layers]

    def snapshot(self, cache: list) -> list:
        """Free snapshot of the whole model state, for ``restore`` (e.g. speculative rollback)."""
        return snapshot_cache(cache)

    def restore(self, cache: list, snap: list) -> None:
        """Return ``cache`` to ``snap``: recurrent states as they were, KV caches trimmed."""
        restore_cache(cache, snap)

    @staticmethod
    def cast_predicate(name: str) -> bool:
        """False for parameters to keep in fp32 when the rest is cast (the decay gates)."""
        return not name.endswith(("A_log", "dt_bias"))

    def sanitize(self, weights: dict) -> dict:
        """HF names (Qwen3_5ForCausalLM or the text part of ...ForConditionalGeneration) and
        mlx-lm names -> module names. Raw HF tensors (conv1d (C, 1, K)) get their conv weight
        moved to (C, K, 1) and 1 added to the zero-centred norms."""
        out = {}
        for key, value in weights.items():
            if key.startswith(_DROPPED_PREFIXES):
                continue
            for old, new in (("model.language_model.", "model."), ("language_model.", "")):
                if key.startswith(old):
                    key = new + key[len(old) :]
            out[key] = value
        if self.args.tie_word_embeddings:
            out.pop("lm_head.weight", None)
        raw_hf = any(k.endswith("conv1d.weight") and v.shape[-1] != 1 for k, v in out.items())
        if raw_hf:
            for key, value in out.items():
                if key.endswith("conv1d.weight"):
                    out[key] = mx.contiguous(value.swapaxes(1, 2))
                elif key.endswith(_ZERO_CENTRED_NORMS):
                    out[key] = (value.astype(mx.float32) + 1.0).astype(value.dtype)
        return self.sanitize_mlp(out)

    def sanitize_mlp(self, weights: dict) -> dict:
        return weights


# ---- GGUF (llama.cpp "qwen35") ----

GGUF_TENSOR_MAP = {
    **LLAMA_CPP_TENSOR_NAMES,
    "blk.{i}.attn_qkv.weight": "model.layers.{i}.linear_attn.in_proj_qkv.weight",
    "blk.{i}.attn_gate.weight": "model.layers.{i}.linear_attn.in_proj_z.weight",
    "blk.{i}.ssm_beta.weight": "model.layers.{i}.linear_attn.in_proj_b.weight",
    "blk.{i}.ssm_alpha.weight": "model.layers.{i}.linear_attn.in_proj_a.weight",
    "blk.{i}.ssm_conv1d.weight": "model.layers.{i}.linear_attn.conv1d.weight",
    "blk.{i}.ssm_a": "model.layers.{i}.linear_attn.A_log",
    "blk.{i}.ssm_dt.bias": "model.layers.{i}.linear_attn.dt_bias",
    "blk.{i}.ssm_norm.weight": "model.layers.{i}.linear_attn.norm.weight",
    "blk.{i}.ssm_out.weight": "model.layers.{i}.linear_attn.out_proj.weight",
}


def args_from_gguf(metadata: dict, tensor_names=()) -> ModelArgs:
    """ModelArgs from llama.cpp's qwen35 metadata; no output.weight = tied embeddings."""
    return ModelArgs.from_dict(gguf_config(metadata, tensor_names))


def gguf_config(metadata: dict, tensor_names=()) -> dict:
    """HF-style config dict from GGUF metadata, shared with the MoE variant."""
    arch = metadata["general.architecture"]

    def get(key, default=None):
        return metadata.get(f"{arch}.{key}", default)

    head_dim = get("attention.key_length", 256)
    v_heads = get("ssm.time_step_rank")
    vocab = get("vocab_size") or len(metadata.get("tokenizer.ggml.tokens", [])) or 248320
    return {
        "model_type": "qwen3_5_moe_text" if arch.endswith("moe") else "qwen3_5_text",
        "hidden_size": get("embedding_length"),
        "intermediate_size": get("feed_forward_length", 0),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": get("attention.head_count"),
        "num_key_value_heads": get("attention.head_count_kv"),
        "head_dim": head_dim,
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "rope_theta": get("rope.freq_base", 10_000_000.0),
        "partial_rotary_factor": get("rope.dimension_count", head_dim // 4) / head_dim,
        "linear_conv_kernel_dim": get("ssm.conv_kernel", 4),
        "linear_key_head_dim": get("ssm.state_size"),
        "linear_value_head_dim": get("ssm.inner_size") // v_heads,
        "linear_num_key_heads": get("ssm.group_count"),
        "linear_num_value_heads": v_heads,
        "full_attention_interval": get("full_attention_interval", 4),
        "v_heads_tiled": True,
        "num_experts": get("expert_count", 0),
        "num_experts_per_tok": get("expert_used_count", 0),
        "moe_intermediate_size": get("expert_feed_forward_length", 0),
        "shared_expert_intermediate_size": get("expert_shared_feed_forward_length", 0),
        "norm_topk_prob": get("expert_weights_norm", True),
    }


def gguf_transform(name: str, array: mx.array, args: ModelArgs | None = None) -> mx.array:
    """llama.cpp stores -exp(A_log) as ssm_a and the conv weight squeezed to (C, K)."""
    if name.endswith(".ssm_a"):
        return mx.log(-array.astype(mx.float32))
    if name.endswith(".ssm_conv1d.weight"):
        return array[..., None]
    return array


def rope_layers(args: ModelArgs) -> list[LayerRoPE | None]:
    """Partial RoPE on the full-attention layers; the delta-net layers have none."""
    dims = int(args.head_dim * args.partial_rotary_factor)
    rope = LayerRoPE(dims=dims, freqs=rope_inv_freq(dims, args.rope_theta))
    return [rope if t == "full_attention" else None for t in args.layer_types]


ARCHITECTURE = Architecture(
    model_types=("qwen3_5_text", "qwen3_5"),
    args=ModelArgs,
    model=Model,
    gguf_architectures=("qwen35",),
    gguf_tensor_map=GGUF_TENSOR_MAP,
    args_from_gguf=args_from_gguf,
    gguf_transform=gguf_transform,
    tokenizer=TokenizerQuirks(chat_template="qwen35"),
    rope=rope_layers,
)
