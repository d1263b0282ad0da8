"""Tiny random Qwen 2 models against transformers' Qwen2ForCausalLM (fp32, eager), and GGUF."""

from __future__ import annotations

from functools import lru_cache

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from hf2q_mlx.errors import UnsupportedArchitectureError
from hf2q_mlx.io.loader import load, load_model
from hf2q_mlx.models import qwen2
from hf2q_mlx.models.contract import architecture_of
from hf2q_mlx.models.turboquant.cache import model_rope_freqs

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# fp32 on both sides; the implementations sum in different orders
RTOL = 1e-4
CONFIGS = {
    # Qwen2.5-0.5B-like: tied head, GQA, a large RoPE base
    "tied": dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=True,
    ),
    # separate head, 6 query heads over 2 KV heads, a small base (fast-turning pairs)
    "untied": dict(
        vocab_size=128, hidden_size=96, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 100.0}, tie_word_embeddings=False,
    ),
}  # fmt: skip
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}"


@lru_cache(maxsize=None)
def hf_model(name: str):
    """Qwen2ForCausalLM with every parameter random: biases, norms, embeddings, head."""
    config = transformers.Qwen2Config(**CONFIGS[name], attn_implementation="eager")
    torch.manual_seed(len(name))
    model = transformers.Qwen2ForCausalLM(config)
    assert model.config._attn_implementation == "eager"
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if "norm" in pname else 0.15))
            if "norm" in pname:
                p.add_(1.0)
    return model.eval()


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(tokens).long(), use_cache=False).logits.numpy()


def ours_from_hf(name: str) -> qwen2.Model:
    hf = hf_model(name)
    model = qwen2.Model(qwen2.ModelArgs.from_dict(hf.config.to_dict()))
    weights = {k: mx.array(v.detach().numpy()) for k, v in hf.state_dict().items()}
    model.load_weights(list(model.sanitize(weights).items()), strict=True)
    mx.eval(model.parameters())
    return model


def assert_close(ours: mx.array, ref: np.ndarray):
    ours = np.array(ours.astype(mx.float32))
    assert ours.shape == ref.shape
    err = np.abs(ours - ref).max()
    assert err <= RTOL * np.abs(ref).max(), f"max |diff| {err:.3g} vs {np.abs(ref).max():.3g}"


@pytest.fixture(scope="module")
def tokens() -> np.ndarray:
    return np.random.default_rng(1).integers(0, 128, size=(2, 23)).astype(np.int32)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_full_sequence_batch_2(name, tokens):
    ours = ours_from_hf(name)
    assert ("lm_head" in ours) != CONFIGS[name]["tie_word_embeddings"]
    assert "bias" not in ours.layers[0].self_attn.o_proj
    assert_close(ours(mx.array(tokens)), hf_logits(hf_model(name), tokens))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_then_decode(name, tokens):
    ours, ref = ours_from_hf(name), hf_logits(hf_model(name), tokens)
    cache = ours.make_cache()
    assert_close(ours(mx.array(tokens[:, :8]), cache), ref[:, :8])
    for t in range(8, tokens.shape[1]):
        assert_close(ours(mx.array(tokens[:, t : t + 1]), cache), ref[:, t : t + 1])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hf_folder_loads_through_the_contract(name, tokens, tmp_path):
    hf_model(name).save_pretrained(tmp_path, safe_serialization=True)
    model, info = load_model(tmp_path, dtype="float32")
    assert isinstance(model, qwen2.Model) and info.model_type == "qwen2"
    assert_close(model(mx.array(tokens)), hf_logits(hf_model(name), tokens))


def write_gguf(path, name: str, qtype: int | None) -> dict[str, np.ndarray]:
    """The HF model as llama.cpp's converter lays out a qwen2 GGUF (q/k rows unpermuted, no
    output.weight when tied) with a byte-level vocabulary; returns the weights the file holds
    (HF names), dequantized by gguf-py where quantized."""
    hf = hf_model(name)
    c = hf.config
    n = c.num_hidden_layers
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_block_count(n)
    w.add_context_length(256)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    letters = [chr(ord("a") + i % 26) * (1 + i // 26) for i in range(c.vocab_size - 5)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([*letters, "1", "2", "12", "<|im_start|>", "<|im_end|>"])
    w.add_token_types([1] * (c.vocab_size - 2) + [3, 3])
    w.add_token_merges(["a a", "aa a", "1 2"])
    w.add_eos_token_id(c.vocab_size - 1)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, n)
    held = {}
    for hf_name, t in hf.state_dict().items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        a = t.detach().numpy().astype(np.float32)
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if qtype is not None and a.ndim == 2 and a.shape[-1] % 32 == 0:
            q = gguf.quants.quantize(a, qtype)
            w.add_tensor(gguf_name, q, raw_dtype=qtype)
            a = gguf.quants.dequantize(q, qtype).reshape(a.shape)
        else:
            w.add_tensor(gguf_name, a)
        held[hf_name] = a
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


@pytest.mark.parametrize(("name", "qtype"), [("tied", None), ("untied", None), ("tied", T.Q8_0)])
def test_gguf_round_trip(name, qtype, tokens, tmp_path):
    held = write_gguf(tmp_path / "tiny.gguf", name, qtype)
    hf = hf_model(name)
    ref_model = transformers.Qwen2ForCausalLM(hf.config).eval()  # the weights the file holds
    ref_model.load_state_dict({k: torch.from_numpy(v) for k, v in held.items()}, strict=False)
    if hf.config.tie_word_embeddings:
        ref_model.tie_weights()
    ref = hf_logits(ref_model, tokens)

    model, tokenizer = load(tmp_path / "tiny.gguf", dtype="float32")
    assert isinstance(model, qwen2.Model)
    assert architecture_of(model) is qwen2.ARCHITECTURE
    assert_close(model(mx.array(tokens)), ref)
    cache = model.make_cache()
    assert_close(model(mx.array(tokens[:, :5]), cache), ref[:, :5])
    assert_close(model(mx.array(tokens[:, 5:6]), cache), ref[:, 5:6])

    # the template is the file's own; Qwen's split keeps "aaa" one word (merged to one token)
    # but splits digits one by one, so "12" never merges (GPT-2's split would give [125])
    assert tokenizer.chat_template == CHAT_TEMPLATE and not tokenizer.chat_template_is_builtin
    assert tokenizer.encode("aaa", add_special_tokens=False) == [52]
    assert tokenizer.encode("12", add_special_tokens=False) == [123, 124]
    assert tokenizer.encode("<|im_start|>", add_special_tokens=False) == [126]


def test_rope_description_matches_transformers():
    hf = hf_model("untied")
    freqs = model_rope_freqs(ours_from_hf("untied"))
    assert len(freqs) == CONFIGS["untied"]["num_hidden_layers"]
    inv_freq = hf.model.rotary_emb.inv_freq.numpy()
    np.testing.assert_allclose(np.array(freqs[1]), inv_freq, rtol=1e-6)


def test_unsupported_settings_are_named():
    base = dict(CONFIGS["tied"])
    with pytest.raises(UnsupportedArchitectureError, match="sliding"):
        qwen2.ModelArgs.from_dict({**base, "use_sliding_window": True})
    with pytest.raises(UnsupportedArchitectureError, match="MLP bias"):
        qwen2.ModelArgs.from_dict({**base, "mlp_bias": True})
