"""Fused q/k/v and gate/up projections (``Model.fuse_projections``) on tiny random models.

Fusing stacks weights along the output axis (dense rows, GGML block rows, mlx affine rows), and
each output row is still one dot product over the same input, so in fp32 on the CPU the logits
must stay bit-identical, on the affine repack path and on the dequantize-then-matmul reference.
These tests pin the CPU; on a GPU (last test) a GEMM may pick another blocking for the wider
matrix, so there the check is a tolerance.
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from conftest import requires_gpu
from gguf import GGMLQuantizationType as T
from mlx.utils import tree_flatten

from hf2q_mlx import custom_kernels
from hf2q_mlx.cli.bench import decode_step_ops
from hf2q_mlx.custom_kernels import rms_norm_rope
from hf2q_mlx.io.random_weights import random_ggml_blocks
from hf2q_mlx.models import gemma3, gemma4, llama, ops
from hf2q_mlx.models.fused_projections import FusedQKV
from hf2q_mlx.models.quantized import (
    GGMLLinear,
    fuse_linears,
    ggml_quantize_modules,
    linear_fusion_key,
)

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(autouse=True)
def on_cpu(request):
    """Every test here on the CPU (the bit-exact claim), except the GPU one."""
    if "gpu" in request.node.name:
        yield
        return
    device = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        yield
    finally:
        mx.set_default_device(device)


def tiny_args(arch: str, dim: int = 64, hidden: int = 96, head_dim: int = 32, **extra):
    if arch == "gemma3":
        return gemma3.ModelArgs(
            vocab_size=80,
            hidden_size=dim,
            intermediate_size=hidden,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=head_dim,
            sliding_window=4,
            sliding_window_pattern=2,
            rope_local_base_freq=100.0,
            rope_theta=10_000.0,
            query_pre_attn_scalar=24,
            final_logit_softcapping=30.0,
            **extra,
        )
    return llama.ModelArgs(
        vocab_size=80,
        hidden_size=dim,
        intermediate_size=hidden,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        rope_theta=1000.0,
        tie_word_embeddings=False,
        **extra,
    )


def tiny_model(arch: str, types: dict[str, int] | None = None, seed: int = 0, **kw):
    """Random fp32 model; ``types`` maps a projection name (q_proj, ...) to the GGML type every
    layer holds it in, with random valid blocks. Norm weights are randomized too."""
    mx.random.seed(seed)
    module = gemma3 if arch == "gemma3" else llama
    model = module.Model(tiny_args(arch, **kw))
    params = dict(tree_flatten(model.parameters()))
    update = {k: 1.0 + 0.3 * mx.random.normal(v.shape) for k, v in params.items() if "norm" in k}
    update.update({k: 0.3 * mx.random.normal(v.shape) for k, v in params.items() if "proj" in k})
    model.load_weights(list(update.items()), strict=False)
    if types:
        paths = {}
        for i in range(len(model.layers)):
            for name, t in types.items():
                owner = "self_attn" if name in PROJ[:4] else "mlp"
                paths[f"model.layers.{i}.{owner}.{name}"] = t
        ggml_quantize_modules(model, paths)
        blocks = []
        for j, (path, t) in enumerate(paths.items()):
            _, _, i, owner, name = path.split(".")
            lin = model.layers[int(i)][owner][name]
            w = random_ggml_blocks(lin.out_features, lin.in_features, t, seed + j, 0.1)
            blocks.append((f"{path}.weight", w))
        model.load_weights(blocks, strict=False)
    mx.eval(model.parameters())
    return model


def run(model) -> list[mx.array]:
    """Prefill 7 tokens into a cache, 3 decode steps, and a batch-2 full forward pass."""
    tokens = mx.random.randint(0, 80, (2, 10), key=mx.random.key(5)).astype(mx.int32)
    cache = model.make_cache()
    outs = [model(tokens[:1, :7], cache=cache)]
    for i in range(7, 10):
        outs.append(model(tokens[:1, i : i + 1], cache=cache))
    outs.append(model(tokens))
    mx.eval(outs)
    return outs


def fused_vs_unfused(model) -> None:
    """fuse_projections changes no bit of the logits, on the CPU affine and reference paths."""
    before = run(model)
    with custom_kernels.reference_only():
        before_ref = run(model)
    model.fuse_projections()
    for want, got in zip(before, run(model)):
        assert mx.array_equal(want, got).item(), mx.abs(want - got).max().item()
    with custom_kernels.reference_only():
        for want, got in zip(before_ref, run(model)):
            assert mx.array_equal(want, got).item(), mx.abs(want - got).max().item()


def layer0_names(model) -> set[str]:
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    names = {k for k, v in attn.children().items() if isinstance(v, nn.Module)}
    return names | {k for k, v in mlp.children().items() if isinstance(v, nn.Module)}


ARCHS = ["gemma3", "llama"]


@pytest.mark.parametrize("arch", ARCHS)
def test_dense_fp32(arch):
    model = tiny_model(arch)
    fused_vs_unfused(model)
    assert {"qkv_proj", "gate_up_proj", "o_proj", "down_proj"} <= layer0_names(model)
    assert not {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"} & layer0_names(model)
    w = model.layers[0].self_attn.qkv_proj.weight
    assert w.shape == ((4 + 2 + 2) * 32, 64) and w.dtype == mx.float32


def test_dense_with_biases():
    model = tiny_model("llama", attention_bias=True, mlp_bias=True)
    fused_vs_unfused(model)
    assert model.layers[1].self_attn.qkv_proj.bias.shape == ((4 + 2 + 2) * 32,)
    assert model.layers[1].mlp.gate_up_proj.bias.shape == (2 * 96,)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    "ggml_type, dim",
    [(T.Q8_0, 64), (T.Q5_0, 64), (T.Q4_1, 64), (T.Q4_K, 256), (T.Q6_K, 256)],
)
def test_ggml_same_type(arch, ggml_type, dim):
    # K-quant rows are 256 wide: hidden, MLP and 4 heads x head_dim all 256 then
    sizes = dict(dim=dim, hidden=dim if dim == 256 else 96, head_dim=dim // 4 if dim == 256 else 32)
    model = tiny_model(arch, {name: ggml_type for name in PROJ}, **sizes)
    raw = [model.layers[2].self_attn[n].weight for n in ("q_proj", "k_proj", "v_proj")]
    fused_vs_unfused(model)
    qkv = model.layers[2].self_attn.qkv_proj
    assert isinstance(qkv, GGMLLinear) and qkv.ggml_type == ggml_type
    # lossless: the fused weight is the raw block rows, stacked
    assert mx.array_equal(qkv.weight, mx.concatenate(raw, axis=0)).item()
    assert isinstance(model.layers[2].mlp.gate_up_proj, GGMLLinear)


@pytest.mark.parametrize("arch", ARCHS)
def test_ggml_mixed_types_fuse_only_matching(arch):
    # Gemma 3 270M Q4_K_M's pattern: q, k Q5_0, v Q8_0; here gate and up differ too
    types = {"q_proj": T.Q5_0, "k_proj": T.Q5_0, "v_proj": T.Q8_0, "o_proj": T.Q4_0}
    types.update(gate_proj=T.Q4_0, up_proj=T.Q8_0, down_proj=T.Q4_0)
    model = tiny_model(arch, types)
    fused_vs_unfused(model)
    assert layer0_names(model) == {
        "qk_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
        *(["q_norm", "k_norm"] if arch == "gemma3" else []),
    }
    assert model.layers[0].self_attn.qk_proj.ggml_type == T.Q5_0


def test_ggml_all_types_differ_nothing_fused():
    types = {"q_proj": T.Q4_0, "k_proj": T.Q8_0, "v_proj": T.Q5_0, "gate_proj": T.Q8_0}
    model = tiny_model("gemma3", types)  # up_proj stays dense: another kind of layer
    before = dict(tree_flatten(model.parameters()))
    fused_vs_unfused(model)
    after = dict(tree_flatten(model.parameters()))
    assert before.keys() == after.keys()
    assert all(before[k] is after[k] for k in before)


def test_ggml_non_adjacent_group_keeps_qkv_order():
    # q and v share a type, k does not: q and v fuse ("qv_proj"), outputs still land as q, k, v
    types = {"q_proj": T.Q8_0, "k_proj": T.Q4_0, "v_proj": T.Q8_0}
    model = tiny_model("llama", types)
    fused_vs_unfused(model)
    assert {"qv_proj", "k_proj"} <= layer0_names(model)


def test_mixed_dense_and_ggml_not_fused():
    model = tiny_model("llama", {"k_proj": T.Q8_0, "up_proj": T.Q8_0})
    fused_vs_unfused(model)  # q and v (dense fp32) fuse; k and gate/up do not
    assert {"qv_proj", "k_proj", "gate_proj", "up_proj"} <= layer0_names(model)


@pytest.mark.parametrize("arch", ARCHS)
def test_mlx_affine_quantized(arch):
    model = tiny_model(arch)

    def predicate(path: str, module: nn.Module):
        if not isinstance(module, nn.Linear) or "embed" in path or "lm_head" in path:
            return False
        return {"group_size": 32, "bits": 8} if path.endswith("v_proj") else True

    nn.quantize(model, group_size=32, bits=4, class_predicate=predicate)
    mx.eval(model.parameters())
    fused_vs_unfused(model)
    names = layer0_names(model)
    assert {"qk_proj", "v_proj", "gate_up_proj"} <= names
    qk = model.layers[0].self_attn.qk_proj
    assert isinstance(qk, nn.QuantizedLinear) and qk.bits == 4 and qk.group_size == 32


def test_fuse_twice_is_a_no_op():
    model = tiny_model("gemma3", {name: T.Q8_0 for name in PROJ})
    model.fuse_projections()
    first = dict(tree_flatten(model.parameters()))
    model.fuse_projections()
    assert dict(tree_flatten(model.parameters())).keys() == first.keys()


def test_fewer_decode_ops():
    model = tiny_model("llama", {name: T.Q8_0 for name in PROJ})
    before = decode_step_ops(model, [1, 2, 3])
    model.fuse_projections()
    # per layer (3): 3 q/k/v mat-vecs -> 1 and 2 gate/up -> 1, each fused output split once
    # (+2), the head reshapes of q, k and v -> one (-2): at least 3 ops fewer a layer
    assert decode_step_ops(model, [1, 2, 3]) <= before - 3 * 3


def test_fusion_keys_and_errors():
    a, b = GGMLLinear(64, 32, T.Q8_0), GGMLLinear(64, 16, T.Q8_0)
    assert linear_fusion_key(a) == linear_fusion_key(b)
    assert linear_fusion_key(GGMLLinear(64, 32, T.Q4_0)) != linear_fusion_key(a)
    assert linear_fusion_key(GGMLLinear(96, 32, T.Q8_0)) != linear_fusion_key(a)  # other input
    assert linear_fusion_key(GGMLLinear(64, 32, T.Q8_0, bias=True)) != linear_fusion_key(a)
    assert linear_fusion_key(nn.Linear(4, 4)) != linear_fusion_key(nn.Linear(4, 4, bias=False))
    half = nn.Linear(4, 4)
    half.set_dtype(mx.float16)
    assert linear_fusion_key(half) != linear_fusion_key(nn.Linear(4, 4))
    assert linear_fusion_key(nn.Embedding(4, 4)) is None
    with pytest.raises(ValueError):
        fuse_linears([a, GGMLLinear(64, 32, T.Q4_0)])
    with pytest.raises(ValueError):
        fuse_linears([nn.Linear(64, 4), a])
    fused = fuse_linears([a, b])
    assert (fused.in_features, fused.out_features, fused.ggml_type) == (64, 48, T.Q8_0)


def test_half_precision_dense_runs():
    model = tiny_model("gemma3")
    model.set_dtype(mx.bfloat16)
    x = mx.array([[3, 4, 5]])
    want = model(x)
    model.fuse_projections()
    assert model.layers[0].self_attn.qkv_proj.weight.dtype == mx.bfloat16
    got = model(x)
    assert got.dtype == want.dtype == mx.bfloat16
    assert mx.array_equal(want, got).item()  # the CPU's bf16 matmuls are row-independent too


@pytest.mark.parametrize("types", [None, {"q_proj": T.Q8_0, "k_proj": T.Q8_0, "v_proj": T.Q5_0}])
def test_project_packed_is_project_heads_unsplit(types):
    """``project_packed``'s Heads view each matmul output whole; split, they are exactly
    ``project_heads``' q, k, v (one (qkv) or two (qk, v) outputs)."""
    model = tiny_model("gemma3", types)
    model.fuse_projections()
    attn = model.layers[0].self_attn
    x = mx.random.normal((2, 3, 64), key=mx.random.key(8))
    heads = attn.project_packed(x)
    outputs = {id(h.data): h.data for h in heads}
    assert len(outputs) == (1 if types is None else 2)
    v_first = 6 if types is None else 0  # in the qkv output, or first of its own
    assert [(h.first, h.count, h.width) for h in heads] == [
        (0, 4, 32),
        (4, 2, 32),
        (v_first, 2, 32),
    ]
    assert all(h.data.ndim == 3 for h in heads)  # (B, L, N): not reshaped
    for got, want in zip(rms_norm_rope.split_heads(heads), attn.project_heads(x, transpose=False)):
        assert mx.array_equal(got, want).item()


GEMMA4 = dict(
    vocab_size=80, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, global_head_dim=64,
    sliding_window=4, hidden_size_per_layer_input=0, final_logit_softcapping=15.0,
    layer_types=["sliding_attention", "full_attention"], attention_k_eq_v=True,
    num_global_key_value_heads=1,
)  # fmt: skip


@pytest.mark.parametrize("arch", ["gemma4", "gemma3"])
def test_norm_rope_kernel_reads_fused_qkv(monkeypatch, arch):
    """The fused q/k/v output goes to the norm + RoPE kernel (CUDA rendering on the CPU
    emulator) unsplit (Gemma 4's sliding layer; every Gemma 3 layer, v only laid out): logits
    bit-identical to the reshape + split inputs. Gemma 4's k_eq_v global layer fuses q and k
    (V is K), read unsplit too."""
    sys.path.insert(0, str(Path(__file__).resolve().parent / "kernels"))
    import kernel_emulator

    if not kernel_emulator.available():
        pytest.skip("g++ not found")
    if arch == "gemma4":
        mx.random.seed(3)
        model = gemma4.Model(gemma4.ModelArgs.from_dict(GEMMA4))
        params = dict(tree_flatten(model.parameters()))
        model.load_weights([(k, 0.2 * mx.random.normal(v.shape)) for k, v in params.items()])
        model.fuse_projections()
        assert "qkv_proj" in model.layers[0].self_attn and "qk_proj" in model.layers[1].self_attn
        ndims = [[3, 3, 3], [3, 3, 3]]  # per layer: the q, k, v inputs' ndim
    else:
        model = tiny_model("gemma3", seed=3)
        model.fuse_projections()
        ndims = [[3, 3, 3]] * 3
    seen = []  # per launch

    class Recording(kernel_emulator.Emulated):
        def __call__(self, inputs, **launch):
            seen.append([x.ndim for x in inputs[:3]])
            return super().__call__(inputs, **launch)

    monkeypatch.setattr(rms_norm_rope, "_kernel", Recording(rms_norm_rope._kernel))
    monkeypatch.setattr(rms_norm_rope, "backend", lambda: "cuda")
    monkeypatch.setattr(ops, "use_kernels", lambda: True)
    tokens = mx.random.randint(0, 80, (2, 7), key=mx.random.key(6)).astype(mx.int32)

    def logits():
        cache = model.make_cache()
        outs = [model(tokens[:, :5], cache=cache)]
        outs += [model(tokens[:, t : t + 1], cache=cache) for t in (5, 6)]
        return mx.concatenate(outs, axis=1)

    packed = logits()
    assert seen == ndims * 3  # prefill and 2 decode steps
    seen.clear()
    monkeypatch.setattr(
        FusedQKV, "project_packed", lambda self, x: self.project_heads(x, transpose=False)
    )
    assert mx.array_equal(packed, logits()).item()
    # the reshape + split form: fused layers' inputs 4-D
    split = [[4, 4, 4]] * (2 if arch == "gemma4" else 3)
    assert seen == split * 3


@requires_gpu
@pytest.mark.parametrize("arch", ARCHS)
def test_gpu_fused_close(arch):
    model = tiny_model(arch, {name: T.Q8_0 for name in PROJ if name != "v_proj"})
    before = run(model)
    model.fuse_projections()
    for want, got in zip(before, run(model)):
        err = mx.abs(want - got).max().item()
        assert err <= 1e-5 * mx.abs(want).max().item(), err
