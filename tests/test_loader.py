"""Loading tiny Gemma 3 / Llama checkpoints: HF safetensors, GGUF (float and quantized), mlx-lm."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from mlx.utils import tree_flatten

from hf2q_mlx.errors import (
    GGUFFormatError,
    Hf2qError,
    ModelNotFoundError,
    UnsupportedArchitectureError,
    UnsupportedQuantTypeError,
    WeightMismatchError,
)
from hf2q_mlx.io.loader import load_model

# fp32 on both sides: ~1e-4 of the largest logit covers the different summation orders
RTOL = 1e-4

# Row lengths are multiples of 32 (GGML block size). Gemma 3 uses what llama.cpp assumes for it:
# sliding pattern 6 (layers 0-4 local, 5 global), local RoPE base 10k, query scale 1/sqrt(head_dim)
CONFIGS = {
    "gemma3": dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=4,
        query_pre_attn_scalar=16,
        rope_theta=50_000.0,
        rope_local_base_freq=10_000.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        max_position_embeddings=512,
    ),
    "llama": dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=10_000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        max_position_embeddings=512,
    ),
    "llama_untied": dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        rope_theta=10_000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        max_position_embeddings=512,
    ),
}

# HF parameter suffix -> llama.cpp tensor suffix
_BLOCK_NAMES = {
    "gemma3": {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    },
    "llama": {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    },
}

# tensor types of the mixed-quantization GGUF, by llama.cpp suffix (others F32)
QUANT_TYPES = {
    "token_embd": T.Q8_0,
    "output": T.Q8_0,
    "attn_q": T.Q4_0,
    "attn_k": T.Q8_0,
    "attn_v": T.F16,
    "attn_output": T.Q4_0,
    "ffn_gate": T.Q8_0,
    "ffn_up": T.Q4_0,
    "ffn_down": T.F16,
}


def hf_model(name: str, seed: int = 0):
    """transformers model with every parameter randomized (Gemma norms are zero-centred)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if name == "gemma3":
        model = Gemma3ForCausalLM(Gemma3TextConfig(**CONFIGS[name], attn_implementation="eager"))
    else:
        model = LlamaForCausalLM(LlamaConfig(**CONFIGS[name], attn_implementation="eager"))
    assert model.config._attn_implementation == "eager"
    with torch.no_grad():
        for pname, p in model.named_parameters():
            offset = 1.0 if "norm" in pname and name != "gemma3" else 0.0
            p.copy_(torch.randn_like(p) * (0.3 if "norm" in pname else 0.15) + offset)
    return model.eval()


def hf_state(model) -> dict[str, np.ndarray]:
    state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def gguf_name(arch: str, hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, i, rest = hf_name.split(".", 3)
    stem, suffix = rest.rsplit(".", 1)
    return f"blk.{i}.{_BLOCK_NAMES[arch][stem]}.{suffix}"


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's converter: interleave each head's two rotary halves
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def llamacpp_unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return (
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(path: Path, model, quantize: bool) -> dict[str, np.ndarray]:
    """A GGUF of ``model`` with llama.cpp's names, keys and value conventions.

    Returns the HF state dict the file decodes to (dequantized, conventions undone), the
    reference our GGUF load must reproduce.
    """
    cfg = model.config
    arch = "gemma3" if cfg.model_type == "gemma3_text" else "llama"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if arch == "gemma3":
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_sliding_window(cfg.sliding_window)
        full = cfg.rope_parameters["full_attention"]
        w.add_rope_freq_base(full["rope_theta"])
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    else:
        w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
        w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
        w.add_vocab_size(cfg.vocab_size)
    decoded = {}
    for name, value in hf_state(model).items():
        gname = gguf_name(arch, name)
        if arch == "gemma3" and name.endswith("norm.weight"):
            value = (1.0 + value).astype(np.float32)  # llama.cpp stores Gemma norms as 1 + w
        if arch == "llama" and ".attn_q." in gname:
            value = llamacpp_permute(value, cfg.num_attention_heads)
        if arch == "llama" and ".attn_k." in gname:
            value = llamacpp_permute(value, cfg.num_key_value_heads)
        kind = gname.split(".")[-2]
        qtype = QUANT_TYPES.get(kind, T.F32) if quantize and value.ndim == 2 else T.F32
        data = gguf.quants.quantize(value, qtype)
        if qtype in (T.F32, T.F16):
            w.add_tensor(gname, data)
        else:
            w.add_tensor(gname, data, raw_dtype=qtype)
        back = gguf.quants.dequantize(data, qtype).reshape(value.shape).astype(np.float32)
        if arch == "gemma3" and name.endswith("norm.weight"):
            back = back - 1.0
        if arch == "llama" and ".attn_q." in gname:
            back = llamacpp_unpermute(back, cfg.num_attention_heads)
        if arch == "llama" and ".attn_k." in gname:
            back = llamacpp_unpermute(back, cfg.num_key_value_heads)
        decoded[name] = back
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return decoded


def save_hf(path: Path, model) -> Path:
    model.save_pretrained(path, safe_serialization=True)
    return path


def reference_logits(model, state: dict[str, np.ndarray], tokens: np.ndarray) -> np.ndarray:
    """transformers logits with ``state`` (e.g. dequantized weights) loaded into ``model``."""
    sd = {k: torch.from_numpy(v) for k, v in state.items()}
    with torch.no_grad():
        missing = model.load_state_dict(sd, strict=False).missing_keys
        assert set(missing) <= {"lm_head.weight"}
        if model.config.tie_word_embeddings:
            model.tie_weights()
        return model(torch.from_numpy(tokens).long(), use_cache=False).logits.numpy()


def assert_close(ours: mx.array, ref: np.ndarray):
    ours = np.array(ours)
    err = np.abs(ours - ref).max()
    assert err <= RTOL * np.abs(ref).max(), (
        f"max |diff| {err:.3g} vs max |logit| {np.abs(ref).max()}"
    )


@pytest.fixture(scope="module")
def tokens() -> np.ndarray:
    return np.random.default_rng(3).integers(0, 96, size=(2, 13)).astype(np.int32)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_safetensors_dir(tmp_path, name, tokens):
    model = hf_model(name)
    ref = reference_logits(model, hf_state(model), tokens)
    ours, info = load_model(save_hf(tmp_path, model))
    assert info.format == "safetensors" and info.dtype == mx.float32
    assert_close(ours(mx.array(tokens)), ref)


def test_multimodal_gemma3_layout(tmp_path, tokens):
    # Gemma3ForConditionalGeneration checkpoints: text weights under model.language_model,
    # a vision tower to drop, the text settings nested in text_config
    model = hf_model("gemma3")
    state = {
        k.replace("model.", "model.language_model.", 1): mx.array(v)
        for k, v in hf_state(model).items()
    }
    state["model.vision_tower.patch_embedding.weight"] = mx.ones((4, 3))
    state["model.multi_modal_projector.mm_input_projection_weight"] = mx.ones((4, 64))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), state)
    config = {"model_type": "gemma3", "text_config": model.config.to_dict()}
    (tmp_path / "config.json").write_text(json.dumps(config))
    ours, info = load_model(tmp_path)
    assert info.model_type == "gemma3"
    assert_close(ours(mx.array(tokens)), reference_logits(model, hf_state(model), tokens))


def test_sharded_safetensors_and_bf16(tmp_path, tokens):
    model = hf_model("gemma3")
    model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ours, _ = load_model(tmp_path)
    assert_close(ours(mx.array(tokens)), reference_logits(model, hf_state(model), tokens))
    bf16, info = load_model(tmp_path, dtype="bfloat16")
    assert info.dtype == mx.bfloat16
    assert all(v.dtype == mx.bfloat16 for _, v in tree_flatten(bf16.parameters()))
    assert bf16(mx.array(tokens)).dtype == mx.bfloat16


@pytest.mark.parametrize("name", list(CONFIGS))
def test_gguf_float_matches_safetensors(tmp_path, name, tokens):
    model = hf_model(name)
    decoded = write_gguf(tmp_path / "m.gguf", model, quantize=False)
    from_gguf, info = load_model(tmp_path / "m.gguf")
    from_hf, _ = load_model(save_hf(tmp_path / "hf", model))
    assert info.format == "gguf" and info.quantization == {}
    a, b = dict(tree_flatten(from_gguf.parameters())), dict(tree_flatten(from_hf.parameters()))
    assert a.keys() == b.keys()
    for k in a:
        # data movement is exact; Gemma norms went through 1 + w in fp32 on both paths
        assert mx.array_equal(a[k], b[k]).item(), k
    assert_close(from_gguf(mx.array(tokens)), reference_logits(model, decoded, tokens))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_gguf_quantized(tmp_path, name, tokens):
    model = hf_model(name)
    path = tmp_path / "q.gguf"
    decoded = write_gguf(path, model, quantize=True)
    ours, info = load_model(path)
    assert info.quantization["model.layers.0.self_attn.q_proj"] == "Q4_0"
    assert info.quantization["model.embed_tokens"] == "Q8_0"
    # quantized tensors stay raw GGML blocks; the q rows were un-permuted block row by block row
    q = ours.model.layers[0].self_attn.q_proj.weight
    assert q.dtype == mx.uint8
    ref = reference_logits(model, decoded, tokens)
    assert_close(ours(mx.array(tokens)), ref)


def test_gguf_q_rows_unpermuted_on_raw_blocks(tmp_path):
    model = hf_model("llama")
    path = tmp_path / "q.gguf"
    write_gguf(path, model, quantize=True)
    ours, _ = load_model(path)
    reader = gguf.GGUFReader(str(path))
    stored = next(t for t in reader.tensors if t.name == "blk.1.attn_q.weight")
    expected = llamacpp_unpermute(np.asarray(stored.data), model.config.num_attention_heads)
    assert np.array_equal(np.array(ours.model.layers[1].self_attn.q_proj.weight), expected)


def mlx_quantize_state(state: dict[str, np.ndarray], overrides: dict) -> dict[str, mx.array]:
    """mlx-lm's on-disk layout: weight (packed uint32), scales, biases for quantized modules."""
    out = {}
    for name, value in state.items():
        module = name.rsplit(".", 1)[0]
        spec = overrides.get(module, {"group_size": 32, "bits": 4})
        if value.ndim == 2 and spec is not False:
            wq, s, b = mx.quantize(mx.array(value), spec["group_size"], spec["bits"])
            out[name], out[f"{module}.scales"], out[f"{module}.biases"] = wq, s, b
        else:
            out[name] = mx.array(value)
    return out


def mlx_dequantize_state(q: dict[str, mx.array], overrides: dict) -> dict[str, np.ndarray]:
    out = {}
    for name, value in q.items():
        if name.endswith((".scales", ".biases")):
            continue
        module = name.rsplit(".", 1)[0]
        if f"{module}.scales" in q:
            spec = overrides.get(module, {"group_size": 32, "bits": 4})
            value = mx.dequantize(
                value,
                q[f"{module}.scales"],
                q[f"{module}.biases"],
                spec["group_size"],
                spec["bits"],
            )
        out[name] = np.array(value)
    return out


@pytest.mark.parametrize("name", ["gemma3", "llama"])
def test_mlx_affine_quantized_dir(tmp_path, name, tokens):
    model = hf_model(name)
    overrides = {
        "model.layers.0.mlp.down_proj": {"group_size": 32, "bits": 8},
        "model.layers.1.self_attn.v_proj": False,
    }
    q = mlx_quantize_state(hf_state(model), overrides)
    mx.save_safetensors(str(tmp_path / "model.safetensors"), q)
    config = model.config.to_dict()
    config["quantization"] = {"group_size": 32, "bits": 4, **overrides}
    (tmp_path / "config.json").write_text(json.dumps(config))
    ours, info = load_model(tmp_path)
    assert info.format == "mlx"
    assert ours.model.layers[0].mlp.down_proj.bits == 8
    assert type(ours.model.layers[1].self_attn.v_proj).__name__ == "Linear"
    ref = reference_logits(model, mlx_dequantize_state(q, overrides), tokens)
    assert_close(ours(mx.array(tokens)), ref)


# ----- bad inputs ---------------------------------------------------------------------------


def test_missing_path(tmp_path):
    with pytest.raises(ModelNotFoundError):
        load_model(tmp_path / "nope.gguf")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **CONFIGS["llama"]}))
    with pytest.raises(ModelNotFoundError, match="safetensors"):
        load_model(tmp_path)


def test_unknown_architectures(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.ones((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedArchitectureError, match="mamba"):
        load_model(tmp_path / "x.gguf")
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "not_a_model"}))
    with pytest.raises(UnsupportedArchitectureError, match="not_a_model"):
        load_model(d)


def test_bad_config_and_options(tmp_path):
    model = hf_model("llama")
    save_hf(tmp_path, model)
    with pytest.raises(Hf2qError, match="dtype"):
        load_model(tmp_path, dtype="int8")
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedQuantTypeError, match="gptq"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(Hf2qError, match="JSON"):
        load_model(tmp_path)


def test_corrupt_gguf(tmp_path):
    (tmp_path / "bad.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 13)
    with pytest.raises(GGUFFormatError):
        load_model(tmp_path / "bad.gguf")


def test_gguf_missing_and_extra_tensors(tmp_path):
    model = hf_model("llama")
    path = tmp_path / "m.gguf"
    write_gguf(path, model, quantize=False)
    reader = gguf.GGUFReader(str(path))
    # rewrite without blk.1.ffn_up.weight and with a tensor no mapping knows
    w = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), "llama")
    for key, field in reader.fields.items():
        if key.startswith("llama."):
            getattr(w, "add_uint32" if isinstance(field.contents(), int) else "add_float32")(
                key, field.contents()
            )
    for t in reader.tensors:
        if t.name != "blk.1.ffn_up.weight":
            w.add_tensor(t.name, np.asarray(t.data).reshape(tuple(reversed(t.shape.tolist()))))
    w.add_tensor("blk.0.mystery.weight", np.ones((2, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(WeightMismatchError) as err:
        load_model(tmp_path / "bad.gguf")
    assert "model.layers.1.mlp.up_proj.weight" in str(err.value)
    assert "blk.0.mystery.weight" in str(err.value)


def test_safetensors_shape_mismatch(tmp_path):
    model = hf_model("llama")
    save_hf(tmp_path, model)
    weights = mx.load(str(tmp_path / "model.safetensors"))
    weights["model.layers.0.mlp.up_proj.weight"] = mx.zeros((95, 64))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), weights)
    with pytest.raises(WeightMismatchError, match=r"model\.layers\.0\.mlp\.up_proj\.weight"):
        load_model(tmp_path)
