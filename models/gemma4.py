"""Gemma 4 text models: dense (31B), 26B-A4B mixture of experts, and the E-series (E2B/E4B)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from hf2q_mlx.custom_kernels.graph_ops import scale_cast
from hf2q_mlx.custom_kernels.rms_norm_rope import Heads
from hf2q_mlx.errors import UnsupportedArchitectureError
from hf2q_mlx.models import gemma4_gguf, ops
from hf2q_mlx.models.base import BaseModelArgs
from hf2q_mlx.models.cache import KVCache, RotatingKVCache, causal_mask
from hf2q_mlx.models.contract import Architecture, LayerRoPE
from hf2q_mlx.models.fused_projections import QKV, FusedQKV, fuse_gate_up, gated_mlp_hidden
from hf2q_mlx.models.gemma4_moe import Experts, Router
from hf2q_mlx.models.ops import RMSNorm

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass
class ModelArgs(BaseModelArgs):
    # defaults are transformers' Gemma4TextConfig defaults, so sparse config.json files agree
    model_type: str = "gemma4_text"
    vocab_size: int = 262_144
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 30
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 256
    global_head_dim: int = 512
    num_global_key_value_heads: int | None = None
    hidden_activation: str = "gelu_pytorch_tanh"
    rms_norm_eps: float = 1e-6
    sliding_window: int = 512
    layer_types: list[str] | None = None
    rope_parameters: dict | None = None
    final_logit_softcapping: float | None = None
    attention_bias: bool = False
    attention_k_eq_v: bool = False
    vocab_size_per_layer_input: int = 262_144
    hidden_size_per_layer_input: int = 256
    num_kv_shared_layers: int = 0
    use_double_wide_mlp: bool = False
    enable_moe_block: bool = False
    num_experts: int | None = None
    top_k_experts: int | None = None
    moe_intermediate_size: int | None = None
    tie_word_embeddings: bool = True
    use_bidirectional_attention: str | None = None
    per_layer_config: dict | None = None  # transformers' own serialization of the overrides
    kv_source: list[int | None] = field(init=False)  # derived: shared layer -> its producer

    @classmethod
    def from_dict(cls, params: dict) -> ModelArgs:
        """Accepts a Gemma4TextConfig dict or a Gemma4Config one (text tower in text_config)."""
        if "text_config" in params:
            text = dict(params["text_config"] or {})
            text.setdefault("tie_word_embeddings", params.get("tie_word_embeddings", True))
            params = text
        return super().from_dict(params)

    def __post_init__(self):
        n = self.num_hidden_layers
        if self.layer_types is None:  # 5 sliding : 1 full
            self.layer_types = [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(n)]
        self.layer_types = list(self.layer_types)
        self.layer_types[-1] = FULL  # as transformers: the last layer always attends globally
        rope = {
            SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
            FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
        }
        for kind, params in (self.rope_parameters or {}).items():
            rope[kind] = {**rope.get(kind, {}), **(params or {})}
        self.rope_parameters = rope
        if self.use_bidirectional_attention == "all":
            raise UnsupportedArchitectureError("Gemma 4 with bidirectional attention is not causal")
        self.kv_source = _kv_sources(self.layer_types, self.num_kv_shared_layers)
        if self.per_layer_config is not None:
            self.per_layer_config = {
                int(k): dict(v)
                for k, v in self.per_layer_config.items()
                if str(k).isascii() and str(k).isdigit()
            }

    def layer_geometry(self, i: int) -> tuple[int, int, bool]:
        """(head_dim, kv heads, k_eq_v) of layer i: full layers have their own head dim, and
        with k_eq_v their own KV head count and no v_proj."""
        full = self.layer_types[i] == FULL
        D, kv = self.head_dim, self.num_key_value_heads
        if self.per_layer_config is not None:
            D = self.per_layer_config.get(i, {}).get("head_dim", D)
            kv = self.per_layer_config.get(i, {}).get("num_key_value_heads", kv)
        elif full:
            D = self.global_head_dim
            if self.attention_k_eq_v and self.num_global_key_value_heads is not None:
                kv = self.num_global_key_value_heads
        return D, kv, full and self.attention_k_eq_v


def _kv_sources(layer_types: list[str], num_shared: int) -> list[int | None]:
    """For each layer, the earlier layer whose keys/values it reuses (None = its own)."""
    n = len(layer_types)
    first = n - num_shared
    if num_shared and first <= 0:
        raise UnsupportedArchitectureError("every Gemma 4 layer shares KV: nothing produces it")
    last_of = {t: i for i, t in enumerate(layer_types[:first])}  # last producer of each type
    sources: list[int | None] = [None] * first
    for i in range(first, n):
        if layer_types[i] not in last_of:
            raise UnsupportedArchitectureError(f"shared layer {i} has no {layer_types[i]} producer")
        sources.append(last_of[layer_types[i]])
    return sources


# the activations by their ops names ("gelu" is exact GELU, which has no kernel)
ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "silu": "silu"}


def activation(name: str) -> str:
    """The ops name of a Gemma 4 ``hidden_activation``."""
    if name not in ACTIVATIONS:
        raise UnsupportedArchitectureError(f"Gemma 4 activation {name!r} is not supported")
    return ACTIVATIONS[name]


class RoPE(ops.RoPE):
    """Rotary embedding of one layer type, from its ``rope_parameters`` (whole head).

    "proportional" rotates only the first ``partial_rotary_factor`` of the frequency pairs, with
    exponents over the full head dim; the rest get an infinite period (angle 0, unrotated).
    """

    def __init__(self, params: dict, head_dim: int):
        kind = params.get("rope_type", "default")
        theta = float(params.get("rope_theta", 10_000.0))
        scale = 1.0 / float(params.get("factor", 1.0))
        if kind == "proportional":
            n_rot = int(float(params.get("partial_rotary_factor", 1.0)) * head_dim // 2)
            periods = theta ** (mx.arange(0, 2 * n_rot, 2, dtype=mx.float32) / head_dim)
            inf = mx.full((head_dim // 2 - n_rot,), math.inf)
            super().__init__(head_dim, None, scale, mx.concatenate([periods, inf]))
        elif kind in ("default", "linear"):
            super().__init__(head_dim, theta, scale if kind == "linear" else 1.0)
        else:
            raise UnsupportedArchitectureError(f"Gemma 4 rope_type {kind!r} is not supported")


class Attention(FusedQKV, nn.Module):
    def __init__(self, args: ModelArgs, i: int):
        super().__init__()
        self.head_dim, self.n_kv_heads, self.k_eq_v = args.layer_geometry(i)
        self.n_heads = args.num_attention_heads
        self.shares_kv = args.kv_source[i] is not None
        H, D, bias, eps = args.hidden_size, self.head_dim, args.attention_bias, args.rms_norm_eps
        self.q_proj = nn.Linear(H, self.n_heads * D, bias=bias)
        self.q_norm = RMSNorm(D, eps=eps)
        if not self.shares_kv:  # shared layers read an earlier layer's K/V
            self.k_proj = nn.Linear(H, self.n_kv_heads * D, bias=bias)
            self.k_norm = RMSNorm(D, eps=eps)
            if not self.k_eq_v:
                self.v_proj = nn.Linear(H, self.n_kv_heads * D, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * D, H, bias=bias)
        self.rope = RoPE(args.rope_parameters[args.layer_types[i]], D)

    def fuse_projections(self) -> None:
        """q/k/v (q/k where V is K) as one matmul where their weights stack; not in a layer
        that reads another layer's K/V."""
        if not self.shares_kv:
            FusedQKV.fuse_projections(self, ("q_proj", "k_proj") if self.k_eq_v else QKV)

    def __call__(self, x, pos: mx.array, cache=None, shared_kv=None, mask=None):
        """-> (output, (keys, values, mask)) so later shared layers can attend the same K/V."""
        fused = "q_proj" not in self
        if fused:  # Heads of the fused output(s): the norm + RoPE kernel reads them in place
            q, k, *v = self.project_packed(x)  # (B, L, H, D) each, unsplit
            v = k if self.k_eq_v else v[0]
        else:  # separate projections: Heads too, no reshape node
            q = Heads(self.q_proj(x), 0, self.n_heads, self.head_dim)
        if shared_kv is not None:
            q = ops.norm_rope(q, self.q_norm, self.rope, pos)
            k, v, mask = shared_kv
        else:
            if not fused:
                k = Heads(self.k_proj(x), 0, self.n_kv_heads, self.head_dim)
                v = k if self.k_eq_v else Heads(self.v_proj(x), 0, self.n_kv_heads, self.head_dim)
            # v: a weightless norm, no RoPE
            q, k, v = ops.qk_norm_rope(q, k, self.q_norm, self.k_norm, self.rope, pos, v=v)
            if cache is not None:
                k, v, mask = cache.update_and_fetch(k, v)
        return self.o_proj(ops.attention(q, k, v, cache, 1.0, mask)), (k, v, mask)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, activation: str):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.activation = activation

    def fuse_projections(self) -> None:
        fuse_gate_up(self)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(gated_mlp_hidden(self, x, self.activation))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, i: int):
        super().__init__()
        H, eps, act = args.hidden_size, args.rms_norm_eps, activation(args.hidden_activation)
        self.self_attn = Attention(args, i)
        wide = args.use_double_wide_mlp and args.kv_source[i] is not None
        self.mlp = MLP(H, args.intermediate_size * (2 if wide else 1), act)
        self.input_layernorm = RMSNorm(H, eps=eps)
        self.post_attention_layernorm = RMSNorm(H, eps=eps)
        self.pre_feedforward_layernorm = RMSNorm(H, eps=eps)
        self.post_feedforward_layernorm = RMSNorm(H, eps=eps)
        self.layer_scalar = mx.ones((1,))
        self.moe = args.enable_moe_block
        if self.moe:  # experts run side by side with the dense MLP
            self.router = Router(H, args.num_experts, args.top_k_experts, eps)
            self.experts = Experts(H, args.moe_intermediate_size, args.num_experts, act)
            self.post_feedforward_layernorm_1 = RMSNorm(H, eps=eps)
            self.post_feedforward_layernorm_2 = RMSNorm(H, eps=eps)
            self.pre_feedforward_layernorm_2 = RMSNorm(H, eps=eps)
        self.ple = bool(args.hidden_size_per_layer_input)
        if self.ple:
            P = args.hidden_size_per_layer_input
            self.per_layer_input_gate = nn.Linear(H, P, bias=False)
            self.per_layer_projection = nn.Linear(P, H, bias=False)
            self.post_per_layer_input_norm = RMSNorm(H, eps=eps)
            self.activation = act

    def __call__(
        self, x, pos, cache=None, shared_kv=None, mask=None, per_layer_input=None, n=None,
        next_norm=None,
    ):  # fmt: skip
        """-> (residual stream, ``next_norm`` of it or None, (keys, values, mask)). ``n``: this
        layer's input norm of x when the previous layer made it (one kernel with its end)."""
        n = self.input_layernorm(x) if n is None else n
        y, kv = self.self_attn(n, pos, cache, shared_kv, mask)
        norms = (self.post_attention_layernorm, self.pre_feedforward_layernorm)
        # with kernels the router kernel makes the join too (one launch fewer)
        joined = (
            self.router.join(x, y, *norms, self.pre_feedforward_layernorm_2) if self.moe else None
        )
        if joined is None:
            h, n = ops.post_norm_residual(x, y, *norms)
        else:
            h, n, ids, weights, xn = joined
        f = self.mlp(n)
        e = None
        if self.moe:
            if joined is None:  # routed on the residual stream; the experts' norm comes along
                ids, weights, xn = self.router(h, self.pre_feedforward_layernorm_2)
            e = self.experts(xn, ids, weights)
        if not self.ple and next_norm is not None:
            # the scalar scales the whole residual stream; the next norm shares the kernel
            return (*ops.post_norm_residual(
                h, f, self.post_feedforward_layernorm, next_norm, y2=e,
                norm1=self.post_feedforward_layernorm_1 if self.moe else None,
                norm2=self.post_feedforward_layernorm_2 if self.moe else None,
                scale=self.layer_scalar,
            ), kv)  # fmt: skip
        if self.moe:
            f = self.post_feedforward_layernorm_1(f) + self.post_feedforward_layernorm_2(e)
        h = h + self.post_feedforward_layernorm(f)
        if self.ple:
            # compiled MLX even with kernels: it reads the strided per-layer slice in place
            gate = self.per_layer_input_gate(h)
            g = ops.gated_activation(gate, per_layer_input, self.activation, kernel=False)
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(g))
        return h * self.layer_scalar, None, kv


class Gemma4TextModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        H, P, n = args.hidden_size, args.hidden_size_per_layer_input, args.num_hidden_layers
        self.embed_tokens = nn.Embedding(args.vocab_size, H)
        self.layers = [DecoderLayer(args, i) for i in range(n)]
        self.norm = RMSNorm(H, eps=args.rms_norm_eps)
        if P:  # per-layer embeddings (E-series): one P-wide input per layer, packed
            self.embed_tokens_per_layer = nn.Embedding(args.vocab_size_per_layer_input, n * P)
            self.per_layer_model_projection = nn.Linear(H, n * P, bias=False)
            self.per_layer_projection_norm = RMSNorm(P, eps=args.rms_norm_eps)
        self._producers = {s for s in args.kv_source if s is not None}

    def _per_layer_inputs(self, inputs: mx.array, h: mx.array) -> mx.array:
        """(B, L) ids and scaled embeddings -> (B, L, n_layers, P)."""
        n, P = self.args.num_hidden_layers, self.args.hidden_size_per_layer_input
        tok = self.embed_tokens_per_layer(inputs).astype(h.dtype)
        tok = tok * mx.array(P**0.5, dtype=h.dtype)
        proj = self.per_layer_model_projection(h) * (self.args.hidden_size**-0.5)
        proj = self.per_layer_projection_norm(proj.reshape(*h.shape[:-1], n, P))
        return (proj + tok.reshape(*inputs.shape, n, P)) * (2.0**-0.5)

    def __call__(self, inputs: mx.array, cache: list | None = None) -> mx.array:
        dtype = self.norm.weight.dtype  # the model dtype (a GGML embedding returns fp32)
        # cast, then the scale rounded like the weights (one kernel in a recorded graph)
        h = scale_cast(self.embed_tokens(inputs), self.args.hidden_size**0.5, dtype)
        ple = self._per_layer_inputs(inputs, h) if self.args.hidden_size_per_layer_input else None
        L = inputs.shape[1]
        pos = ops.positions(cache[0] if cache else None)
        masks = {}
        if cache is None:
            masks = {FULL: causal_mask(L), SLIDING: causal_mask(L, 0, self.args.sliding_window)}
        sources = self.args.kv_source
        produced: dict[int, tuple] = {}
        n = None  # the next layer's input norm, when the last layer's end kernel made it
        next_norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        for i, layer in enumerate(self.layers):
            src = sources[i]
            c = cache[i] if cache is not None and src is None else None
            h, n, kv = layer(
                h, pos, c,
                shared_kv=produced.get(src) if src is not None else None,
                mask=masks.get(self.args.layer_types[i]),
                per_layer_input=ple[:, :, i, :] if ple is not None else None,
                n=n, next_norm=next_norms[i],
            )  # fmt: skip
            if i in self._producers:
                produced[i] = kv
        return self.norm(h) if n is None else n


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = Gemma4TextModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache: list | None = None) -> mx.array:
        h = self.model(inputs, cache)
        if self.args.tie_word_embeddings:
            logits = self.model.embed_tokens.as_linear(h)
        else:
            logits = self.lm_head(h)
        return ops.softcap(logits, self.args.final_logit_softcapping)

    @property
    def layers(self) -> list:
        return self.model.layers

    def fuse_projections(self) -> Model:
        """After ``load_weights``: q/k/v and the dense MLP's gate/up as one matmul each where
        the weights stack. Outputs do not change; the fused model loads no more checkpoints."""
        for layer in self.layers:
            layer.self_attn.fuse_projections()
            layer.mlp.fuse_projections()
        return self

    def make_cache(self, reserve: int = 0) -> list:
        """One cache per KV-producing layer: ring buffers for sliding layers, growing buffers for
        global ones. KV-sharing layers (the E-series' last layers) read their producer's entries
        and own no cache, so the list is shorter than ``layers`` by ``num_kv_shared_layers``."""
        a = self.args
        return [
            RotatingKVCache(a.sliding_window, reserve) if a.layer_types[i] == SLIDING else KVCache()
            for i, src in enumerate(a.kv_source)
            if src is None
        ]

    def sanitize(self, weights: dict[str, Any]) -> dict[str, Any]:
        """HF Gemma4ForCausalLM / Gemma4ForConditionalGeneration (and mlx-lm) names -> ours,
        idempotent: text tower only, no tied head, no shared-layer K/V, one gate_up stack."""
        out, halves = {}, {}
        for name, w in weights.items():
            for old, new in _PREFIXES:
                if name.startswith(old):
                    name = new + name[len(old) :]
                    break
            if name.startswith(_DROPPED) or "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.args.tie_word_embeddings:
                continue
            if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
                name += ".weight"
            if ".switch_glu." in name:  # mlx-lm: gate and up stacks apart, same row layout
                name = name.replace(".switch_glu.down_proj.", ".down_proj.")
                if ".switch_glu." in name:
                    halves[name] = w
                    continue
            parts = name.split(".")
            if len(parts) > 4 and parts[1] == "layers" and parts[3] == "self_attn":
                i, proj = int(parts[2]), parts[4]
                shared = self.args.kv_source[i] is not None
                if shared and proj in ("k_proj", "v_proj", "k_norm", "v_norm"):
                    continue
                if proj == "v_proj" and self.args.layer_geometry(i)[2]:
                    continue
            out[name] = w
        for name, gate in halves.items():
            if ".switch_glu.gate_proj." in name:
                up = halves[name.replace(".gate_proj.", ".up_proj.")]
                out[name.replace(".switch_glu.gate_proj.", ".gate_up_proj.")] = mx.concatenate(
                    [gate, up], axis=1
                )
        return out


_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."))
_DROPPED = (
    "model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.",
    "vision_tower.", "audio_tower.", "embed_vision.", "embed_audio.", "multi_modal_projector.",
)  # fmt: skip


def args_from_gguf(metadata: dict[str, Any], tensors: Any) -> ModelArgs:
    """llama.cpp's gemma4 metadata and tensor shapes -> ModelArgs (``gemma4_gguf`` reads them,
    taking ModelArgs as an argument so that it never imports this module)."""
    return gemma4_gguf.args_from_gguf(metadata, tensors, ModelArgs)


def rope_layers(args: ModelArgs) -> list[LayerRoPE]:
    """Each layer's RoPE as its attention builds it (``RoPE``): whole head; the pairs that
    proportional RoPE leaves unrotated have frequency 0."""
    out = []
    for i, kind in enumerate(args.layer_types):
        rope = RoPE(args.rope_parameters[kind], args.layer_geometry(i)[0])
        out.append(LayerRoPE(freqs=rope.inv_freq * rope.scale))
    return out


ARCHITECTURE = Architecture(
    model_types=("gemma4_text", "gemma4"),
    args=ModelArgs,
    model=Model,
    gguf_architectures=("gemma4",),
    gguf_tensor_map=gemma4_gguf.GGUF_TENSOR_MAP,
    args_from_gguf=args_from_gguf,
    gguf_transform=gemma4_gguf.gguf_transform,
    rope=rope_layers,
)
