"""GGMLLinear / GGMLEmbedding against dequantize-then-dense, module swapping and weight loading."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from mlx.utils import tree_flatten

from hf2q_mlx.custom_kernels.dequant import dequantize_reference
from hf2q_mlx.errors import UnsupportedQuantTypeError, WeightMismatchError
from hf2q_mlx.io.random_weights import random_ggml_blocks
from hf2q_mlx.models.quantized import GGMLEmbedding, GGMLLinear, ggml_quantize_modules

BLOCK_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]


def assert_close(got: mx.array, want: mx.array, rtol: float = 1e-5) -> None:
    got, want = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * np.abs(want).max())


@pytest.mark.parametrize("ggml_type", BLOCK_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("x_shape", [(1, 1), (2, 3)])
def test_linear_matches_dequantize_then_dense(ggml_type, x_shape):
    in_features, out_features = 512, 7
    layer = GGMLLinear(in_features, out_features, ggml_type)
    layer.weight = random_ggml_blocks(out_features, in_features, ggml_type, seed=ggml_type)
    x = mx.random.normal((*x_shape, in_features), key=mx.random.key(1))
    dense = dequantize_reference(layer.weight, ggml_type, in_features)
    y = layer(x)
    assert y.dtype == mx.float32
    assert_close(y, x @ dense.T)


def test_linear_bias_and_half_input():
    layer = GGMLLinear(256, 5, T.Q4_K, bias=True)
    layer.weight = random_ggml_blocks(5, 256, T.Q4_K, seed=2)
    layer.bias = mx.arange(5, dtype=mx.float32)
    x = mx.random.normal((3, 256), key=mx.random.key(2))
    dense = dequantize_reference(layer.weight, T.Q4_K, 256)
    assert_close(layer(x), x @ dense.T + layer.bias)
    y16 = layer(x.astype(mx.float16))
    assert y16.dtype == mx.float16
    assert_close(y16, x @ dense.T + layer.bias, rtol=1e-2)


@pytest.mark.parametrize("ggml_type", [T.Q8_0, T.Q6_K, T.Q5_0])
def test_embedding_gathers_then_dequantizes(ggml_type):
    emb = GGMLEmbedding(11, 256, ggml_type)
    emb.weight = random_ggml_blocks(11, 256, ggml_type, seed=3)
    table = dequantize_reference(emb.weight, ggml_type, 256)
    ids = mx.array([[0, 10, 3], [3, 3, 7]])
    out = emb(ids)
    assert out.shape == (2, 3, 256) and out.dtype == mx.float32
    assert mx.array_equal(out, table[ids]).item()  # same elementwise decode: exact
    x = mx.random.normal((2, 256), key=mx.random.key(4))
    assert_close(emb.as_linear(x), x @ table.T)


def test_only_weight_and_bias_are_parameters():
    layer = GGMLLinear(256, 4, T.Q4_K, bias=True)
    assert [k for k, _ in tree_flatten(layer.parameters())] == ["weight", "bias"]
    assert layer.weight.dtype == mx.uint8 and layer.weight.shape == (4, 144)
    assert type(layer.ggml_type) is not mx.array and layer.ggml_type == T.Q4_K
    emb = GGMLEmbedding(10, 64, T.Q8_0)
    assert [k for k, _ in tree_flatten(emb.parameters())] == ["weight"]
    assert emb.weight.shape == (10, 68)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(256, 32, bias=False)
        self.o_proj = nn.Linear(32, 256, bias=True)
        self.norm = nn.RMSNorm(256)

    def __call__(self, x):
        return self.o_proj(self.q_proj(self.norm(x)))


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(20, 256)
        self.layers = [Block(), Block()]

    def __call__(self, ids):
        h = self.embed_tokens(ids)
        for layer in self.layers:
            h = h + layer(h)
        return self.embed_tokens.as_linear(h)


TINY_TYPES = {
    "embed_tokens": T.Q8_0,
    "layers.0.q_proj": T.Q4_K,
    "layers.1.q_proj": T.Q6_K,
    "layers.0.o_proj": T.Q4_0,  # in_features 32: one legacy block per row
    "layers.1.o_proj": T.F16,  # dense types keep their nn.Linear
}


def tiny_weights() -> dict[str, mx.array]:
    w = {
        "embed_tokens.weight": random_ggml_blocks(20, 256, T.Q8_0, seed=5),
        "layers.0.q_proj.weight": random_ggml_blocks(32, 256, T.Q4_K, seed=6),
        "layers.1.q_proj.weight": random_ggml_blocks(32, 256, T.Q6_K, seed=7),
        "layers.0.o_proj.weight": random_ggml_blocks(256, 32, T.Q4_0, seed=8),
        "layers.1.o_proj.weight": mx.random.normal((256, 32)).astype(mx.float16),
    }
    for i in range(2):
        w[f"layers.{i}.o_proj.bias"] = mx.zeros((256,))
        w[f"layers.{i}.norm.weight"] = mx.ones((256,))
    return w


def test_quantize_modules_then_load_weights():
    model = ggml_quantize_modules(Tiny(), TINY_TYPES)
    assert isinstance(model.embed_tokens, GGMLEmbedding)
    assert isinstance(model.layers[0].q_proj, GGMLLinear)
    assert model.layers[1].q_proj.ggml_type == T.Q6_K
    assert isinstance(model.layers[0].o_proj, GGMLLinear) and "bias" in model.layers[0].o_proj
    assert type(model.layers[1].o_proj) is nn.Linear
    weights = tiny_weights()
    assert {k for k, _ in tree_flatten(model.parameters())} == weights.keys()
    model.load_weights(list(weights.items()), strict=True)
    ids = mx.array([[1, 2, 19]])
    logits = model(ids)
    assert logits.shape == (1, 3, 20)

    # the same network written out with dequantized dense weights
    deq = dequantize_reference
    h = deq(weights["embed_tokens.weight"], T.Q8_0, 256)[ids]
    for i, (q_type, o_type) in enumerate([(T.Q4_K, T.Q4_0), (T.Q6_K, T.F16)]):
        n = mx.fast.rms_norm(h, weights[f"layers.{i}.norm.weight"], 1e-5)
        q = n @ deq(weights[f"layers.{i}.q_proj.weight"], q_type, 256).T
        h = h + q @ deq(weights[f"layers.{i}.o_proj.weight"], o_type, 32).T
    assert_close(logits, h @ deq(weights["embed_tokens.weight"], T.Q8_0, 256).T, rtol=1e-4)


def test_wrong_weights_raise_weight_mismatch():
    model = ggml_quantize_modules(Tiny(), TINY_TYPES)
    weights = tiny_weights()
    bad = {**weights, "layers.0.q_proj.weight": random_ggml_blocks(32, 512, T.Q4_K)}
    with pytest.raises(WeightMismatchError, match=r"\(32, 144\)"):
        model.load_weights(list(bad.items()), strict=False)
    dense = {**weights, "layers.0.q_proj.weight": mx.zeros((32, 144), dtype=mx.float16)}
    with pytest.raises(WeightMismatchError, match="uint8"):
        model.load_weights(list(dense.items()), strict=False)
    with pytest.raises(WeightMismatchError, match="bias"):
        model.update({"layers": [{"o_proj": {"bias": mx.zeros((255,))}}]})
    with pytest.raises(WeightMismatchError):
        model.embed_tokens.weight = mx.zeros((21, 272), dtype=mx.uint8)


def test_quantize_modules_errors():
    with pytest.raises(WeightMismatchError, match="found nothing"):
        ggml_quantize_modules(Tiny(), {"layers.5.q_proj": T.Q4_K})
    with pytest.raises(WeightMismatchError, match="RMSNorm"):
        ggml_quantize_modules(Tiny(), {"layers.0.norm": T.Q4_K})
    with pytest.raises(WeightMismatchError, match="blocks of 256"):
        ggml_quantize_modules(Tiny(), {"layers.0.o_proj": T.Q4_K})  # in_features 32
    with pytest.raises(UnsupportedQuantTypeError):
        ggml_quantize_modules(Tiny(), {"layers.0.q_proj": T.IQ2_XXS})
