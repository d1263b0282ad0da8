"""Gemma 4 from llama.cpp GGUF files: tensor-name table, metadata -> ModelArgs, value fixes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import mlx.core as mx
import numpy as np

from hf2q_mlx.errors import UnsupportedArchitectureError
from hf2q_mlx.models.llama_cpp_names import LLAMA_CPP_TENSOR_NAMES

SLIDING, FULL = "sliding_attention", "full_attention"


# llama.cpp's gemma4 tensor catalog (gguf-py 0.19.0) -> module parameters, beyond the shared
# names. A None target is a known tensor that is not loaded: rope_freqs holds the
# proportional-RoPE factors, which args_from_gguf reads and RoPE recomputes.
GGUF_TENSOR_MAP = {
    **LLAMA_CPP_TENSOR_NAMES,
    "rope_freqs.weight": None,
    "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "blk.{i}.layer_output_scale.weight": "model.layers.{i}.layer_scalar",
    "blk.{i}.ffn_gate_inp.weight": "model.layers.{i}.router.proj.weight",
    "blk.{i}.ffn_gate_inp.scale": "model.layers.{i}.router.scale",
    "blk.{i}.ffn_down_exps.scale": "model.layers.{i}.router.per_expert_scale",
    "blk.{i}.ffn_gate_up_exps.weight": "model.layers.{i}.experts.gate_up_proj.weight",
    "blk.{i}.ffn_down_exps.weight": "model.layers.{i}.experts.down_proj.weight",
    "blk.{i}.pre_ffw_norm_2.weight": "model.layers.{i}.pre_feedforward_layernorm_2.weight",
    "blk.{i}.post_ffw_norm_1.weight": "model.layers.{i}.post_feedforward_layernorm_1.weight",
    "blk.{i}.post_ffw_norm_2.weight": "model.layers.{i}.post_feedforward_layernorm_2.weight",
    "blk.{i}.inp_gate.weight": "model.layers.{i}.per_layer_input_gate.weight",
    "blk.{i}.proj.weight": "model.layers.{i}.per_layer_projection.weight",
    "blk.{i}.post_norm.weight": "model.layers.{i}.post_per_layer_input_norm.weight",
}


def args_from_gguf(metadata: dict[str, Any], tensors: Mapping[str, Any], model_args: type):
    """llama.cpp's gemma4 metadata (and tensor shapes) -> ``model_args`` (gemma4's ModelArgs,
    passed in: gemma4 imports this module).

    What the metadata leaves out is read from the tensors: vocabulary sizes, a tied head (no
    output.weight), k_eq_v (full layers without attn_v) and the rotated fraction of the full
    layers' proportional RoPE (rope_freqs: 1 = rotated pair, 1e30 = unrotated).
    """

    def get(key: str, default: Any = None) -> Any:
        return metadata.get(f"gemma4.{key}", default)

    def at(value: Any, i: int) -> Any:  # llama.cpp writes per-layer values as arrays
        return value[i] if isinstance(value, list) else value

    n = get("block_count")
    pattern = get("attention.sliding_window_pattern")
    if isinstance(pattern, list):
        layer_types = [SLIDING if s else FULL for s in pattern]
    else:
        layer_types = model_args(num_hidden_layers=n, hidden_size_per_layer_input=0).layer_types
    n_shared = get("attention.shared_kv_layers", 0)
    head_dim_full = get("attention.key_length")
    head_dim_swa = get("attention.key_length_swa", head_dim_full)
    kv_heads = get("attention.head_count_kv")
    per_layer = {
        i: {
            "head_dim": head_dim_swa if t == SLIDING else head_dim_full,
            "num_key_value_heads": at(kv_heads, i),
        }
        for i, t in enumerate(layer_types)
    }
    ff = get("feed_forward_length")
    ff0 = at(ff, 0)
    widths = set(ff) if isinstance(ff, list) else {ff}
    if not widths <= {ff0, 2 * ff0} or any(at(ff, i) != ff0 for i in range(n - n_shared)):
        raise UnsupportedArchitectureError(f"gemma4 feed_forward_length {ff} is not supported")
    producers = [i for i in range(n - n_shared) if layer_types[i] == FULL]
    k_eq_v = bool(producers) and f"blk.{producers[0]}.attn_v.weight" not in tensors
    rope_full = {"rope_type": "default", "rope_theta": float(get("rope.freq_base", 1e6))}
    if "rope_freqs.weight" in tensors:
        factors = np.asarray(tensors["rope_freqs.weight"].data, dtype=np.float64)
        rotated = factors < 1e20
        if not np.all(factors[rotated] == 1.0) or not np.all(rotated[: rotated.sum()]):
            raise UnsupportedArchitectureError("gemma4 rope_freqs other than 1 / 1e30 factors")
        fraction = 2 * int(rotated.sum()) / head_dim_full
        rope_full.update(rope_type="proportional", partial_rotary_factor=fraction)
    first_swa = layer_types.index(SLIDING) if SLIDING in layer_types else 0
    n_experts = get("expert_count", 0)
    P = get("embedding_length_per_layer_input", 0)
    return model_args(
        vocab_size=tensors["token_embd.weight"].shape[0],
        hidden_size=get("embedding_length"),
        intermediate_size=ff0,
        num_hidden_layers=n,
        num_attention_heads=at(get("attention.head_count"), 0),
        num_key_value_heads=at(kv_heads, first_swa),
        head_dim=head_dim_swa,
        global_head_dim=head_dim_full,
        per_layer_config=per_layer,
        rms_norm_eps=get("attention.layer_norm_rms_epsilon", 1e-6),
        sliding_window=get("attention.sliding_window", 512),
        layer_types=layer_types,
        rope_parameters={
            SLIDING: {"rope_type": "default", "rope_theta": float(get("rope.freq_base_swa", 1e4))},
            FULL: rope_full,
        },
        final_logit_softcapping=get("final_logit_softcapping"),
        attention_k_eq_v=k_eq_v,
        hidden_size_per_layer_input=P,
        vocab_size_per_layer_input=tensors["per_layer_token_embd.weight"].shape[0] if P else 0,
        num_kv_shared_layers=n_shared,
        use_double_wide_mlp=len(widths) > 1,
        enable_moe_block=n_experts > 0,
        num_experts=n_experts or None,
        top_k_experts=get("expert_used_count") if n_experts else None,
        moe_intermediate_size=get("expert_feed_forward_length") if n_experts else None,
        tie_word_embeddings="output.weight" not in tensors,
    )


def gguf_transform(name: str, array: mx.array, args) -> mx.array | None:
    """No value fixes (Gemma 4 norms are plain w in both formats); None drops a tensor the model
    does not hold: rope_freqs and the K/V weights of KV-sharing layers."""
    if name == "rope_freqs.weight":
        return None
    parts = name.split(".")
    if parts[0] == "blk" and parts[2] in ("attn_k", "attn_v", "attn_k_norm"):
        i = int(parts[1])
        if args.kv_source[i] is not None or (parts[2] == "attn_v" and args.layer_geometry(i)[2]):
            return None
    return array
