"""Tiny random Gemma 3 and Llama models against transformers (fp32, eager attention)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch

from hf2q_mlx.models import gemma3, llama
from hf2q_mlx.models.cache import trim_cache

# fp32 on both sides; the two implementations sum in different orders, so allow ~1e-4 relative
RTOL = 1e-4

TINY = {
    # window 5 and 26-token sequences cross the window several times; two global layers use a
    # linear RoPE factor and a different base; query_pre_attn_scalar != head_dim; logit softcap
    "gemma3": dict(
        vocab_size=96,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=5,
        layer_types=[
            "sliding_attention",
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "full_attention",
        ],
        rope_theta=10_000.0,
        rope_local_base_freq=100.0,
        query_pre_attn_scalar=20,
        rope_scaling={"rope_type": "linear", "factor": 4.0},
        final_logit_softcapping=30.0,
    ),
    # SmolLM2-like: tied embeddings, GQA
    "llama": dict(
        vocab_size=96,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        rope_theta=1000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
    # Llama 3.1-like: llama3 RoPE, untied head, attention and MLP biases
    "llama3": dict(
        vocab_size=96,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=50_000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=False,
    ),
}


def tiny_hf_model(name: str, seed: int = 0):
    """A transformers model of the tiny config with every parameter randomized (norms too)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if name == "gemma3":
        config = Gemma3TextConfig(**TINY[name], attn_implementation="eager")
        model = Gemma3ForCausalLM(config)
    else:
        config = LlamaConfig(**TINY[name], attn_implementation="eager")
        model = LlamaForCausalLM(config)
    assert model.config._attn_implementation == "eager"
    with torch.no_grad():
        for pname, p in model.named_parameters():
            std = 0.3 if "norm" in pname else 0.15
            p.copy_(
                torch.randn_like(p) * std + (1.0 if "norm" in pname and name != "gemma3" else 0)
            )
    return model.eval()


def mlx_from_hf(name: str, hf_model):
    """Our model with the transformers model's weights, through our sanitize()."""
    module = gemma3 if name == "gemma3" else llama
    args = module.ModelArgs.from_dict(hf_model.config.to_dict())
    model = module.Model(args)
    weights = {k: mx.array(v.detach().numpy()) for k, v in hf_model.state_dict().items()}
    model.load_weights(list(model.sanitize(weights).items()), strict=True)
    mx.eval(model.parameters())
    return model


def hf_logits(hf_model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return hf_model(torch.from_numpy(tokens).long(), use_cache=False).logits.numpy()


def assert_close(ours: mx.array, ref: np.ndarray):
    ours = np.array(ours.astype(mx.float32))
    assert ours.shape == ref.shape
    err = np.abs(ours - ref).max()
    assert err <= RTOL * np.abs(ref).max(), (
        f"max |diff| {err:.3g} vs max |logit| {np.abs(ref).max()}"
    )


@pytest.fixture(scope="module", params=list(TINY))
def pair(request):
    hf = tiny_hf_model(request.param)
    return request.param, hf, mlx_from_hf(request.param, hf)


@pytest.fixture(scope="module")
def tokens() -> np.ndarray:
    return np.random.default_rng(1).integers(0, 96, size=(2, 26)).astype(np.int32)


def test_full_sequence(pair, tokens):
    _, hf, ours = pair
    ref = hf_logits(hf, tokens)
    out = ours(mx.array(tokens))
    assert out.dtype == mx.float32
    assert_close(out, ref)


def test_prefill_then_decode(pair, tokens):
    _, hf, ours = pair
    ref = hf_logits(hf, tokens)
    cache = ours.make_cache()
    assert_close(ours(mx.array(tokens[:, :9]), cache), ref[:, :9])
    for t in range(9, tokens.shape[1]):
        assert_close(ours(mx.array(tokens[:, t : t + 1]), cache), ref[:, t : t + 1])


def test_chunked_prefill(pair, tokens):
    # chunks shorter and longer than the window, starting before and after the ring wraps
    _, hf, ours = pair
    ref = hf_logits(hf, tokens)
    cache, start = ours.make_cache(), 0
    for size in (3, 7, 1, 4, 11):
        chunk = tokens[:, start : start + size]
        assert_close(ours(mx.array(chunk), cache), ref[:, start : start + size])
        start += size
    assert all(c.offset == start for c in cache)


def test_trim_and_redecode(pair, tokens):
    _, hf, ours = pair
    ref = hf_logits(hf, tokens[:1])
    cache = ours.make_cache(reserve=3)
    ours(mx.array(tokens[:1, :12]), cache)
    for t in range(12, 20):
        ours(mx.array(tokens[:1, t : t + 1]), cache)
    # roll back 4 tokens (the ring's reserve of 3 plus one) and decode them again one by one
    assert trim_cache(cache, 4) == 4
    for t in range(16, 20):
        assert_close(ours(mx.array(tokens[:1, t : t + 1]), cache), ref[:, t : t + 1])
    # and a multi-token rollback re-fed as a chunk
    trim_cache(cache, 3)
    assert_close(ours(mx.array(tokens[:1, 17:22]), cache), ref[:, 17:22])


def test_args_from_nested_and_legacy_config():
    # the multimodal "gemma3" config nests text_config; older configs carry rope_theta,
    # rope_local_base_freq and rope_scaling instead of rope_parameters
    legacy = {
        "model_type": "gemma3",
        "text_config": {
            "hidden_size": 64,
            "num_hidden_layers": 7,
            "intermediate_size": 96,
            "num_attention_heads": 2,
            "vocab_size": 50,
            "sliding_window_pattern": 3,
            "rope_theta": 123.0,
            "rope_local_base_freq": 45.0,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        },
    }
    args = gemma3.ModelArgs.from_dict(legacy)
    assert args.hidden_size == 64 and args.num_hidden_layers == 7
    assert [t[0] for t in args.layer_types] == list("ssfssfs")
    assert (args.rope_theta, args.rope_local_base_freq) == (123.0, 45.0)
    assert args.rope_scaling["factor"] == 8.0
    model = gemma3.Model(args)
    assert [type(c).__name__ for c in model.make_cache()][:3] == [
        "RotatingKVCache",
        "RotatingKVCache",
        "KVCache",
    ]
