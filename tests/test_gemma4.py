"""Gemma 4 (dense, MoE, E-series) against transformers' Gemma4ForCausalLM, and GGUF loading."""

from __future__ import annotations

from functools import lru_cache

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from mlx.utils import tree_flatten

from hf2q_mlx.models import gemma4
from hf2q_mlx.models.cache import trim_cache

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

S, F = "sliding_attention", "full_attention"
BASE = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, global_head_dim=64,
    sliding_window=4, hidden_size_per_layer_input=0, final_logit_softcapping=15.0,
    layer_types=[S, S, F, S, S, F], rms_norm_eps=1e-6,
)  # fmt: skip
VARIANTS = {
    # 31B-like: k_eq_v full layers with their own KV head count, proportional RoPE
    "dense": dict(attention_k_eq_v=True, num_global_key_value_heads=1),
    # 26B-A4B-like: experts beside the dense MLP; global layers on plain RoPE for coverage
    "moe": dict(
        attention_k_eq_v=True, num_global_key_value_heads=1, enable_moe_block=True,
        num_experts=8, top_k_experts=3, moe_intermediate_size=32,
        rope_parameters={
            S: {"rope_type": "default", "rope_theta": 1e4},
            F: {"rope_type": "default", "rope_theta": 1e5},
        },
    ),
    # E2B-like: per-layer embeddings, KV shared by the last layers, double-wide MLP there
    "eseries": dict(
        hidden_size_per_layer_input=32, vocab_size_per_layer_input=80, num_kv_shared_layers=3,
        use_double_wide_mlp=True, attention_bias=True,
    ),
    # everything at once (also the GGUF round trip's model)
    "all": dict(
        attention_k_eq_v=True, num_global_key_value_heads=1, enable_moe_block=True,
        num_experts=8, top_k_experts=8, moe_intermediate_size=32,
        hidden_size_per_layer_input=32, vocab_size_per_layer_input=96, num_kv_shared_layers=2,
        use_double_wide_mlp=True,
    ),
}  # fmt: skip
SEQ = 20


@lru_cache(maxsize=None)
def hf_model(variant: str):
    """Tiny Gemma4ForCausalLM with EVERY parameter random (norms, scalars, router scales)."""
    cfg = transformers.Gemma4TextConfig(**{**BASE, **VARIANTS[variant]})
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Gemma4ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 or name.endswith(("layer_scalar", "per_expert_scale")):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))  # around 1, never 1
            else:  # unit-scale activations: keeps logits well inside the softcap
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand(b.shape, generator=g))
    return cfg, model


def hf_weights(model) -> dict[str, mx.array]:
    return {k: mx.array(v.detach().numpy()) for k, v in model.state_dict().items()}


@lru_cache(maxsize=None)
def ours(variant: str):
    cfg, model = hf_model(variant)
    ours = gemma4.Model(gemma4.ModelArgs.from_dict(cfg.to_dict()))
    ours.load_weights(list(ours.sanitize(hf_weights(model)).items()), strict=True)
    return ours


@lru_cache(maxsize=None)
def tokens_and_reference(variant: str) -> tuple[mx.array, np.ndarray]:
    cfg, model = hf_model(variant)
    g = torch.Generator().manual_seed(2)
    vocab = min(cfg.vocab_size, cfg.vocab_size_per_layer_input)
    ids = torch.randint(0, vocab, (2, SEQ), generator=g)  # batch 2, distinct rows
    with torch.no_grad():
        logits = model(ids).logits.numpy()
    return mx.array(ids.numpy().astype(np.int32)), logits


def assert_logits(got: mx.array, want: np.ndarray) -> None:
    # fp32 both sides; differences are summation order and fp32 transcendental rounding
    got = np.array(got)
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_full_sequence_matches_transformers(variant):
    ids, want = tokens_and_reference(variant)
    assert_logits(ours(variant)(ids), want)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cached_prefill_decode_and_trim(variant):
    """Prefill 7 (> window 4), a 3-token chunk, then 10 single steps: the window wraps
    several times; then roll back 3 tokens and decode them again."""
    ids, want = tokens_and_reference(variant)
    model = ours(variant)
    cache = model.make_cache(reserve=2)
    assert len(cache) == model.args.num_hidden_layers - model.args.num_kv_shared_layers
    steps = [(0, 7), (7, 10)] + [(t, t + 1) for t in range(10, SEQ)]
    out = [model(ids[:, a:b], cache) for a, b in steps]
    assert_logits(mx.concatenate(out, axis=1), want)
    assert trim_cache(cache, 3) == 3  # reserve 2 keeps an exact rollback of 3
    redo = [model(ids[:, t : t + 1], cache) for t in range(SEQ - 3, SEQ)]
    assert_logits(mx.concatenate(redo, axis=1), want[:, SEQ - 3 :])


def test_conditional_generation_checkpoint_and_config():
    """Gemma4ForConditionalGeneration layout: text tower under model.language_model, vision and
    audio towers dropped, config nested in text_config with global_head_dim spelled out."""
    cfg, model = hf_model("dense")
    text = {k: v for k, v in cfg.to_dict().items() if k != "per_layer_config"}
    text.update(global_head_dim=64, num_global_key_value_heads=1)  # as google's config.json
    args = gemma4.ModelArgs.from_dict({"model_type": "gemma4", "text_config": text})
    assert args.layer_geometry(2) == (64, 1, True) and args.layer_geometry(1) == (32, 2, False)
    weights = {
        k.replace("model.", "model.language_model.", 1): v for k, v in hf_weights(model).items()
    }
    rng = np.random.default_rng(0)
    weights["model.vision_tower.encoder.layers.0.mlp.up_proj.linear.weight"] = mx.array(
        rng.standard_normal((4, 4), dtype=np.float32)
    )
    weights["model.embed_audio.embedding_projection.weight"] = mx.zeros((4, 4))
    m = gemma4.Model(args)
    m.load_weights(list(m.sanitize(weights).items()), strict=True)
    ids, want = tokens_and_reference("dense")
    assert_logits(m(ids), want)


def test_mlx_lm_layout_and_affine_quantization():
    """mlx-lm names (language_model.model., experts split in switch_glu gate/up stacks) load,
    and nn.quantize turns the experts into gather_qmm layers."""
    cfg, model = hf_model("moe")
    weights = {}
    for k, v in hf_weights(model).items():
        k = k.replace("model.", "language_model.model.", 1)
        if k.endswith("experts.gate_up_proj"):
            gate, up = mx.split(v, 2, axis=1)
            weights[k.replace("gate_up_proj", "switch_glu.gate_proj.weight")] = gate
            weights[k.replace("gate_up_proj", "switch_glu.up_proj.weight")] = up
        elif k.endswith("experts.down_proj"):
            weights[k.replace("down_proj", "switch_glu.down_proj.weight")] = v
        else:
            weights[k] = v
    m = gemma4.Model(gemma4.ModelArgs.from_dict(cfg.to_dict()))
    m.load_weights(list(m.sanitize(weights).items()), strict=True)
    ids, want = tokens_and_reference("moe")
    assert_logits(m(ids), want)
    nn.quantize(m, group_size=32, bits=8)
    assert type(m.layers[0].experts.gate_up_proj).__name__ == "QuantizedExpertLinear"
    # the float model holding the dequantized values of every quantized weight
    params = dict(tree_flatten(m.parameters()))
    dense = {}
    for name, v in params.items():
        base, leaf = name.rsplit(".", 1)
        if f"{base}.scales" not in params:
            dense[name] = v
        elif leaf == "weight":
            s, b = params[f"{base}.scales"], params[f"{base}.biases"]
            dense[name] = mx.dequantize(v, s, b, group_size=32, bits=8)
    f = gemma4.Model(m.args)
    f.load_weights(list(dense.items()), strict=True)
    # identical weight values; gather_qmm vs gather_mm summation order only
    assert_logits(m(ids), np.array(f(ids)))


# ---- GGUF: llama.cpp's gemma4 catalog, written with gguf-py's own HF -> GGUF name table ----


def write_gguf(path, variant: str, qtype: int | None) -> dict[str, mx.array]:
    """The tiny HF model as a GGUF the way llama.cpp's converter lays it out; returns the
    weights (HF names) the file holds after quantization, dequantized by gguf-py."""
    cfg, model = hf_model(variant)
    c = cfg.to_dict()
    n, types = c["num_hidden_layers"], c["layer_types"]
    w = gguf.GGUFWriter(str(path), "gemma4")
    w.add_block_count(n)
    w.add_context_length(256)
    w.add_embedding_length(c["hidden_size"])
    first_shared = n - c["num_kv_shared_layers"]
    ff = c["intermediate_size"]
    w.add_feed_forward_length([ff if i < first_shared else 2 * ff for i in range(n)])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv([2 if t == S else 1 for t in types])
    w.add_key_length(64)
    w.add_value_length(64)
    w.add_key_length_swa(32)
    w.add_value_length_swa(32)
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_freq_base(1e6)
    w.add_rope_freq_base_swa(1e4)
    w.add_sliding_window(c["sliding_window"])
    w.add_sliding_window_pattern([t == S for t in types])
    w.add_shared_kv_layers(c["num_kv_shared_layers"])
    w.add_embedding_length_per_layer_input(c["hidden_size_per_layer_input"])
    w.add_final_logit_softcapping(c["final_logit_softcapping"])
    w.add_expert_count(c["num_experts"])
    w.add_expert_used_count(c["top_k_experts"])
    w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, n)
    held = {}
    for hf_name, t in model.state_dict().items():
        if hf_name == "lm_head.weight":
            continue  # tied
        a = t.detach().numpy().astype(np.float32)
        if hf_name.endswith("router.scale"):
            name = f"blk.{hf_name.split('.')[2]}.ffn_gate_inp.scale"
        elif hf_name.endswith("router.per_expert_scale"):
            name = f"blk.{hf_name.split('.')[2]}.ffn_down_exps.scale"
        else:
            key = hf_name if hf_name.endswith(".weight") else hf_name + ".weight"
            name = names.get_name(key, try_suffixes=(".weight",))
        if qtype is not None and a.ndim >= 2 and a.shape[-1] % 32 == 0:
            q = gguf.quants.quantize(a, qtype)
            w.add_tensor(name, q, raw_dtype=qtype)
            a = gguf.quants.dequantize(q, qtype).reshape(a.shape)
        else:
            w.add_tensor(name, a)
        held[hf_name] = mx.array(a)
    # proportional RoPE factors of the global layers (1 = rotated pair, 1e30 = unrotated)
    w.add_tensor("rope_freqs.weight", np.array([1.0] * 8 + [1e30] * 24, dtype=np.float32))
    # a converter keeps the (unused) K projection of a KV-sharing layer: must be dropped
    w.add_tensor(f"blk.{n - 1}.attn_k.weight", np.ones((64, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


def load_gguf(path) -> gemma4.Model:
    from hf2q_mlx.io.loader import load_model

    return load_model(path, dtype="float32")[0]


@pytest.mark.parametrize("qtype", [None, T.Q8_0, T.Q4_0], ids=["F32", "Q8_0", "Q4_0"])
def test_gguf_matches_safetensors(tmp_path, qtype):
    path = tmp_path / "tiny-gemma4.gguf"
    held = write_gguf(path, "all", qtype)
    model = load_gguf(path)
    cfg, _ = hf_model("all")
    want_args = gemma4.ModelArgs.from_dict(cfg.to_dict())
    for i in range(cfg.num_hidden_layers):
        assert model.args.layer_geometry(i) == want_args.layer_geometry(i)
    assert model.args.kv_source == want_args.kv_source
    assert model.args.rope_parameters[F]["partial_rotary_factor"] == 0.25
    if qtype is not None:
        assert model.layers[0].experts.gate_up_proj.ggml_type == qtype
        mlp = model.layers[0].mlp  # the loader fuses gate/up where the weights stack
        assert "gate_up_proj" in mlp and mlp.gate_up_proj.weight.dtype == mx.uint8
    # the same (dequantized) weights through the safetensors path
    ref = gemma4.Model(want_args)
    ref.load_weights(list(ref.sanitize(held).items()), strict=True)
    ids, _ = tokens_and_reference("all")
    want = np.array(ref(ids))
    # both run fp32 on identical weight values: only summation order differs
    assert_logits(model(ids), want)
    cache = model.make_cache()
    out = [model(ids[:, :6], cache)] + [model(ids[:, t : t + 1], cache) for t in range(6, 10)]
    assert_logits(mx.concatenate(out, axis=1), want[:, :10])


@pytest.mark.parametrize("variant", ["dense", "moe", "eseries"])
def test_fused_projections_change_no_logit(variant):
    """q/k/v and gate/up stacked into one matmul each: the same fp32 logits, bit for bit, on the
    CPU (each output is still one dot product over the same input)."""
    cfg, hf = hf_model(variant)
    model = gemma4.Model(gemma4.ModelArgs.from_dict(cfg.to_dict()))
    model.load_weights(list(model.sanitize(hf_weights(hf)).items()), strict=True)
    ids, _ = tokens_and_reference(variant)
    before = model(ids)
    cache = model.make_cache()
    steps = [model(ids[:, :6], cache)] + [model(ids[:, t : t + 1], cache) for t in range(6, 9)]
    model.fuse_projections()
    fused = [layer for layer in model.layers if "q_proj" not in layer.self_attn]
    assert fused and all("gate_up_proj" in layer.mlp for layer in model.layers)
    assert mx.array_equal(before, model(ids)).item()
    cache = model.make_cache()
    again = [model(ids[:, :6], cache)] + [model(ids[:, t : t + 1], cache) for t in range(6, 9)]
    for want, got in zip(steps, again):
        assert mx.array_equal(want, got).item()
