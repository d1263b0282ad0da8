"""HF2Q_AFFINE_EXPERTS=q4_1: MLX 4-bit routed experts kept as GGML Q4_1 blocks from load on, so
their many-row steps take the grouped GGML kernels (the affine experts have per-pair ones only)."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import requires_gpu
from mlx.utils import tree_flatten
from test_gemma4 import hf_model, hf_weights

from hf2q_mlx.custom_kernels import affine_q4_1
from hf2q_mlx.custom_kernels.dequant import dequantize_reference
from hf2q_mlx.errors import InvalidArgumentError
from hf2q_mlx.io.loader import load_model
from hf2q_mlx.models import gemma4
from hf2q_mlx.models.experts import (
    ExpertLinear,
    QuantizedExpertLinear,
    affine_experts_to_q4_1,
    apply_affine_expert_format,
    to_q4_1_experts,
)


@pytest.fixture(autouse=True)
def on_cpu():
    with mx.stream(mx.cpu):
        yield


def experts(gs: int, dtype, seed: int = 0) -> QuantizedExpertLinear:
    w = mx.random.normal((3, 8, 256), key=mx.random.key(seed)).astype(dtype)
    return QuantizedExpertLinear.from_weight(w, gs, 4)


@pytest.mark.parametrize("gs", [32, 64, 128])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_q4_1_copy_holds_the_same_weights(gs, dtype):
    """Data movement: every Q4_1 weight d q + m equals the affine scale q + bias, bit for bit
    (fp32; a bf16 / fp16 scale and bias are exact in fp16)."""
    m = experts(gs, dtype)
    q = to_q4_1_experts(m)
    assert isinstance(q, ExpertLinear) and q.ggml_type == affine_q4_1.Q4_1
    assert q.weight.shape == (3, 8, 256 // 32 * 20) and q.in_features == 256
    f32 = mx.float32
    want = mx.dequantize(m.weight, m.scales.astype(f32), m.biases.astype(f32), gs, 4)
    got = dequantize_reference(q.weight.reshape(24, -1), affine_q4_1.Q4_1, 256).reshape(3, 8, 256)
    np.testing.assert_array_equal(np.array(got.astype(f32)), np.array(want))


def test_what_would_round_stays_affine():
    """A scale past fp16's range, fp32 scales that fp16 does not hold, 8-bit codes: no copy."""
    big = experts(64, mx.bfloat16)
    big.scales = big.scales * 1e6  # past 65504 (|scale| ~ 0.2-0.5)
    assert to_q4_1_experts(big) is None
    fine = experts(64, mx.float32)  # fp32 scales of fp32 weights: fp16 would round them
    assert to_q4_1_experts(fine) is None
    fine.scales = fine.scales.astype(mx.bfloat16).astype(mx.float32)
    fine.biases = fine.biases.astype(mx.bfloat16).astype(mx.float32)
    assert to_q4_1_experts(fine) is not None  # bf16 values in fp32: exact
    w = mx.random.normal((2, 8, 64), key=mx.random.key(3))
    assert to_q4_1_experts(QuantizedExpertLinear.from_weight(w, 32, 8)) is None
    model = nn.Module()
    model.a, model.b = big, experts(32, mx.bfloat16)
    assert affine_experts_to_q4_1(model) == (1, 1)
    assert isinstance(model.a, QuantizedExpertLinear) and isinstance(model.b, ExpertLinear)


def test_the_switch_says_what_stays_affine(monkeypatch):
    model = nn.Module()
    model.a, model.b = experts(64, mx.float32), experts(32, mx.bfloat16)
    monkeypatch.delenv("HF2Q_AFFINE_EXPERTS", raising=False)
    assert apply_affine_expert_format(model) == (0, 0)
    monkeypatch.setenv("HF2Q_AFFINE_EXPERTS", " Q4_1 ")
    with pytest.warns(UserWarning, match="1 of 2 MLX expert modules stay affine"):
        assert apply_affine_expert_format(model) == (1, 1)
    assert isinstance(model.b, ExpertLinear) and isinstance(model.a, QuantizedExpertLinear)


def test_an_all_zero_group_rounds_below_5e_7():
    """An all-zero group's scale is MLX's epsilon (~1e-7, below fp16's normal range): rounded to
    fp16 it moves that group's weights by less than 15 * 2^-25; every other group stays exact."""
    w = mx.random.normal((2, 8, 128), key=mx.random.key(5)).astype(mx.bfloat16)
    w[0, 3, :64] = 0
    m = QuantizedExpertLinear.from_weight(w, 64, 4)
    assert abs(m.scales[0, 3, 0].item()) < 2.0**-14  # the case this test is about
    q = to_q4_1_experts(m)
    assert q is not None
    f32 = mx.float32
    want = np.array(mx.dequantize(m.weight, m.scales.astype(f32), m.biases.astype(f32), 64, 4))
    got = np.array(dequantize_reference(q.weight.reshape(16, -1), affine_q4_1.Q4_1, 128))
    got = got.reshape(2, 8, 128)
    assert np.abs(got - want).max() < 15 * 2.0**-25
    rest = np.ones(want.shape, bool)
    rest[0, 3, :64] = False
    np.testing.assert_array_equal(got[rest], want[rest])


@pytest.fixture(scope="module")
def mlx_moe_dir(tmp_path_factory):
    """A tiny Gemma 4 MoE checkpoint with MLX 4-bit experts (bf16-valued scales, as a bf16
    checkpoint's), everything else fp32."""
    cfg, hf = hf_model("moe")
    m = gemma4.Model(gemma4.ModelArgs.from_dict(cfg.to_dict()))
    m.load_weights(list(m.sanitize(hf_weights(hf)).items()), strict=True)
    nn.quantize(m, group_size=32, bits=4, class_predicate=lambda _, x: isinstance(x, ExpertLinear))
    for _, x in m.named_modules():
        if isinstance(x, QuantizedExpertLinear):
            x.scales = x.scales.astype(mx.bfloat16).astype(mx.float32)
            x.biases = x.biases.astype(mx.bfloat16).astype(mx.float32)
    d = tmp_path_factory.mktemp("g4q")
    mx.save_safetensors(str(d / "model.safetensors"), dict(tree_flatten(m.parameters())))
    config = {**cfg.to_dict(), "quantization": {"group_size": 32, "bits": 4}}
    (d / "config.json").write_text(json.dumps(config))
    return d


def test_load_keeps_experts_as_q4_1_with_the_same_logits(mlx_moe_dir, monkeypatch):
    """fp32 math over the same weights in another order: 1e-5 of the largest logit."""
    monkeypatch.delenv("HF2Q_AFFINE_EXPERTS", raising=False)
    affine, _ = load_model(mlx_moe_dir)
    monkeypatch.setenv("HF2Q_AFFINE_EXPERTS", "q4_1")
    q4_1, _ = load_model(mlx_moe_dir)
    for a, b in zip(affine.layers, q4_1.layers):
        for name in ("gate_up_proj", "down_proj"):
            assert isinstance(getattr(a.experts, name), QuantizedExpertLinear)
            assert getattr(b.experts, name).ggml_type == affine_q4_1.Q4_1
    ids = mx.array([[1, 5, 9, 22, 7, 3, 40, 11]])
    want, got = np.array(affine(ids)), np.array(q4_1(ids))
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_bad_switch_is_one_line(mlx_moe_dir, monkeypatch):
    monkeypatch.setenv("HF2Q_AFFINE_EXPERTS", "q5_k")
    with pytest.raises(InvalidArgumentError, match="HF2Q_AFFINE_EXPERTS='q5_k'") as err:
        load_model(mlx_moe_dir)
    assert "\n" not in str(err.value)


@requires_gpu
def test_gpu_q4_1_experts_keep_bf16_accuracy(mlx_moe_dir, monkeypatch):
    """On the GPU in bf16 (the GGML Q4_1 expert kernels against the affine ones): the Q4_1 load's
    logits within twice the affine load's distance from the fp32 CPU logits, plus one bf16 step
    of the largest (2^-8: a near-zero distance must not make the bound zero)."""
    ids = mx.array([[1, 5, 9, 22, 7, 3, 40, 11]])
    monkeypatch.delenv("HF2Q_AFFINE_EXPERTS", raising=False)
    want = np.array(load_model(mlx_moe_dir)[0](ids))
    out = {}
    with mx.stream(mx.gpu):
        for fmt in ("affine", "q4_1"):
            monkeypatch.setenv("HF2Q_AFFINE_EXPERTS", fmt)
            model = load_model(mlx_moe_dir, "bfloat16")[0]
            out[fmt] = np.array(model(ids).astype(mx.float32))
    scale = np.abs(want).max()
    err = {k: np.abs(v - want).max() / scale for k, v in out.items()}
    assert err["q4_1"] <= 2 * err["affine"] + 2.0**-8, err
