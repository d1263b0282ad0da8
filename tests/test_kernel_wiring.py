"""The models route through the fused-kernel dispatchers (q/k(/v) norm + RoPE, residual add +
norm, gated activations, logit softcap) when kernels run, and build exactly their plain-MLX
graphs under ``HF2Q_KERNELS=reference`` / ``reference_only()`` and on the CPU. The choice is the
ops layer's (models/ops.py): a model file has one forward path.

On the CPU the kernel path runs through the CUDA renderings on the CPU emulator
(tests/kernels/kernel_emulator.py): ``backend()`` is told the CPU is the GPU, the four fused
kernels are emulated, every other dispatcher keeps its reference. On a GPU the same tiny models
decode greedily with kernels and with ``reference_only()``: same tokens, close logits.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import pkgutil
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import requires_gpu
from mlx.utils import tree_flatten, tree_unflatten

import hf2q_mlx.custom_kernels as ck
from hf2q_mlx.custom_kernels import (
    activations,
    post_norm_residual,
    reference_only,
    residual_rms_norm,
    rms_norm_rope,
    softcap,
)
from hf2q_mlx.models import gemma3, gemma4, llama, qwen3_5, qwen3_5_moe

sys.path.insert(0, str(Path(__file__).resolve().parent / "kernels"))
import kernel_emulator  # noqa: E402
from kernel_emulator import Emulated  # noqa: E402

FUSED = {
    "rms_norm_rope": rms_norm_rope,
    "residual_rms_norm": residual_rms_norm,
    "post_norm_residual": post_norm_residual,
    "activations": activations,
    "softcap": softcap,
}
S, F = "sliding_attention", "full_attention"
QWEN = dict(
    vocab_size=96, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=6, rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.25},
    num_hidden_layers=4,
)  # fmt: skip
# head dims are multiples of 32 (what the norm + RoPE kernel covers)
MODELS = {
    # sliding + global layers (linear RoPE factor on the global one), logit softcap; fused
    # q/k/v and gate/up projections (what the loader does)
    "gemma3": (gemma3, dict(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=4,
        layer_types=[S, F, S], rope_theta=10_000.0, rope_local_base_freq=100.0,
        query_pre_attn_scalar=20, rope_scaling={"rope_type": "linear", "factor": 4.0},
        final_logit_softcapping=30.0,
    )),
    # k_eq_v global layers with proportional RoPE, experts, per-layer inputs, shared KV
    "gemma4": (gemma4, dict(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, global_head_dim=64,
        sliding_window=4, layer_types=[S, F, S, F], final_logit_softcapping=15.0,
        attention_k_eq_v=True, num_global_key_value_heads=1, enable_moe_block=True,
        num_experts=8, top_k_experts=3, moe_intermediate_size=32,
        hidden_size_per_layer_input=32, vocab_size_per_layer_input=96, num_kv_shared_layers=2,
    )),
    # 26B-A4B-like: no per-layer inputs, so each block's end (branch norms, residual, layer
    # scalar) shares one kernel with the next block's input norm
    "gemma4_moe": (gemma4, dict(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, global_head_dim=64,
        sliding_window=4, layer_types=[S, S, F, S], final_logit_softcapping=15.0,
        attention_k_eq_v=True, num_global_key_value_heads=1, enable_moe_block=True,
        num_experts=8, top_k_experts=3, moe_intermediate_size=32, hidden_size_per_layer_input=0,
    )),
    # SmolLM2-like (no q/k norms: RoPE stays mx.fast.rope); fused projections
    "llama": (llama, dict(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, rope_theta=1000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )),
    # [linear, linear, full, linear]: [query | gate] heads, partial RoPE, (1 + w) norms
    "qwen3_5": (qwen3_5, dict(QWEN, intermediate_size=96, full_attention_interval=3)),
    # [linear, full, linear, full], fused gate_up experts and a shared expert
    "qwen3_5_moe": (qwen3_5_moe, dict(
        QWEN, full_attention_interval=2, num_experts=8, num_experts_per_tok=3,
        moe_intermediate_size=32, shared_expert_intermediate_size=64, tie_word_embeddings=True,
    )),
}  # fmt: skip
CALLS = 3  # prefill of 5 tokens, then 2 decode steps
# kernel launches over CALLS forward passes: per layer (or per attention layer) and call.
# residual_rms_norm counts every standalone RMSNorm too (ops.rms_norm: the residual kernel with
# a zero residual, so that a recorded CUDA graph can replay it): each call's first input norm,
# Gemma 4's per-layer-input and unfused branch norms, the delta-net prefill's norms
LAUNCHES = {
    # norm + RoPE per layer; 2 (branch norm + residual + norm) per layer; 1 GeGLU per layer;
    # the softcap
    "gemma3": dict(rms_norm_rope=3 * CALLS, residual_rms_norm=CALLS, post_norm_residual=6 * CALLS,
                   activations=3 * CALLS, softcap=CALLS),
    # norm + RoPE (q only on the 2 KV-sharing layers); 1 branch norm + residual + norm (the
    # per-layer inputs keep each block's end apart); MLP + experts GeGLU (the per-layer-input
    # gate stays compiled MLX)
    "gemma4": dict(rms_norm_rope=4 * CALLS, residual_rms_norm=26 * CALLS,
                   post_norm_residual=4 * CALLS, activations=8 * CALLS, softcap=CALLS),
    # 2 joins per layer (after attention; the block's end with the next input norm)
    "gemma4_moe": dict(rms_norm_rope=4 * CALLS, residual_rms_norm=5 * CALLS,
                       post_norm_residual=8 * CALLS, activations=8 * CALLS, softcap=CALLS),
    "llama": dict(rms_norm_rope=0, residual_rms_norm=7 * CALLS, post_norm_residual=0,
                  activations=3 * CALLS, softcap=0),
    "qwen3_5": dict(rms_norm_rope=1 * CALLS, residual_rms_norm=10 * CALLS, post_norm_residual=0,
                    activations=4 * CALLS, softcap=0),
    # routed experts + shared expert: 2 SwiGLUs per layer; each MoE end makes the residual add
    # and next norm itself (shared_gate_residual_norm: 4 residual norms a call fewer)
    "qwen3_5_moe": dict(rms_norm_rope=2 * CALLS, residual_rms_norm=4 * CALLS + 5,
                        post_norm_residual=0, activations=8 * CALLS, softcap=0),
}  # fmt: skip

needs_gxx = pytest.mark.skipif(not kernel_emulator.available(), reason="g++ not found")


def random_model(name: str, seed: int = 0, dtype=mx.float32):
    """The tiny model with every parameter random: 1-d ones (norms, scalars) around 1."""
    module, cfg = MODELS[name]
    model = module.Model(module.ModelArgs.from_dict(cfg))
    params = []
    for i, (key, p) in enumerate(tree_flatten(model.parameters())):
        k = mx.random.key(seed * 1000 + i)
        if p.ndim == 1 or key.endswith("layer_scalar"):
            v = 0.75 + 0.5 * mx.random.uniform(shape=p.shape, key=k)
        else:
            v = mx.random.normal(p.shape, key=k) / p.shape[-1] ** 0.5
        params.append((key, v.astype(dtype)))
    model.update(tree_unflatten(params))
    if hasattr(model, "fuse_projections"):  # as the loader does
        model.fuse_projections()
    mx.eval(model.parameters())
    return model


def run(model, ids: np.ndarray) -> mx.array:
    """Logits of a 5-token prefill then one decode step per remaining token, (B, L, V)."""
    cache = model.make_cache()
    outs = [model(mx.array(ids[:, :5]), cache)]
    outs += [model(mx.array(ids[:, t : t + 1]), cache) for t in range(5, ids.shape[1])]
    return mx.concatenate(outs, axis=1)


def token_ids(batch: int = 2, length: int = 4 + CALLS, seed: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 96, (batch, length)).astype(np.int32)


@contextlib.contextmanager
def kernels_on_cpu(monkeypatch):
    """backend() says 'cuda' on this CPU (reference_only() and HF2Q_KERNELS still apply); the
    four fused kernels run on the emulator; every other dispatcher keeps its reference."""
    for info in pkgutil.iter_modules(ck.__path__):
        mod = importlib.import_module(f"{ck.__name__}.{info.name}")
        if mod not in FUSED.values() and hasattr(mod, "backend"):
            monkeypatch.setattr(mod, "backend", lambda: None)
    monkeypatch.setattr(ck, "_gpu", ("cuda", mx.default_device(), mx.default_device))
    emulated = {}
    for name, mod in FUSED.items():
        emulated[name] = Emulated(mod._kernel)
        monkeypatch.setattr(mod, "_kernel", emulated[name])
    try:
        yield emulated
    finally:
        monkeypatch.undo()


def launches(emulated) -> dict[str, int]:
    return {name: e.launches for name, e in emulated.items()}


def assert_close(got: mx.array, want: mx.array, rtol: float = 1e-4) -> None:
    got, want = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    assert got.shape == want.shape
    err = np.abs(got - want).max()
    assert err <= rtol * np.abs(want).max(), (err, np.abs(want).max())


@pytest.fixture
def on_cpu():
    """The emulated runs use the CPU stream (also on a machine with a GPU)."""
    with mx.stream(mx.cpu):
        yield


@needs_gxx
@pytest.mark.parametrize("name", list(MODELS))
def test_model_routes_through_the_fused_kernels(name, monkeypatch, on_cpu):
    model, ids = random_model(name), token_ids()
    plain = run(model, ids)  # the CPU: no kernels
    with kernels_on_cpu(monkeypatch) as emulated:
        assert ck.backend() == "cuda"
        with reference_only():
            forced = run(model, ids)
        assert launches(emulated) == dict.fromkeys(FUSED, 0)
        monkeypatch.setenv(ck.ENV_VAR, "reference")
        env = run(model, ids)
        assert launches(emulated) == dict.fromkeys(FUSED, 0)
        monkeypatch.delenv(ck.ENV_VAR)
        fused = run(model, ids)
        assert launches(emulated) == LAUNCHES[name]
    # the reference switches give today's graph bit for bit; the kernels agree to fp32 noise
    assert mx.array_equal(forced, plain) and mx.array_equal(env, plain)
    assert_close(fused, plain)


# what only models/ops.py may call or do: the fused dispatchers, the kernel switch, mx.compile
OPS_ONLY = {
    "residual_rms_norm", "qk_norm_rope", "rms_norm_rope", "gated_activation", "silu_mul",
    "gelu_tanh_mul", "softcap", "use_kernels", "backend", "compile",
}  # fmt: skip
MODEL_FILES = ["gemma3", "gemma4", "gemma4_moe", "llama", "qwen3_5", "qwen3_5_moe"]


@pytest.mark.parametrize("name", MODEL_FILES)
def test_model_has_one_forward_path(name):
    """Kernel or reference is the ops layer's choice per op: a model file names no fused
    dispatcher, never asks whether kernels run, compiles nothing and has no twin forward."""
    path = Path(importlib.import_module(f"hf2q_mlx.models.{name}").__file__)
    tree = ast.parse(path.read_text())
    named = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            named |= {alias.name for alias in node.names}
        elif isinstance(node, ast.Name):
            named.add(node.id)
        elif isinstance(node, ast.Attribute) and not (
            isinstance(node.value, ast.Name) and node.value.id == "ops"
        ):
            named.add(node.attr)
        elif isinstance(node, ast.FunctionDef):
            assert "fused" not in node.name, f"{name}.{node.name}: a second forward path"
    assert not named & OPS_ONLY, sorted(named & OPS_ONLY)


def test_backend_reads_the_environment_only_when_it_changes(monkeypatch, on_cpu):
    monkeypatch.setattr(ck, "_gpu", ("cuda", mx.default_device(), mx.default_device))
    assert ck.backend() == "cuda" and not ck.reference_forced()
    monkeypatch.setenv(ck.ENV_VAR, " Reference ")
    assert ck.backend() is None and ck.reference_forced()
    monkeypatch.setenv(ck.ENV_VAR, "kernels")
    assert ck.backend() == "cuda"
    monkeypatch.delenv(ck.ENV_VAR)
    with reference_only():
        assert ck.backend() is None
    monkeypatch.setattr(ck, "_gpu", ("cuda", mx.Device(mx.DeviceType.gpu), mx.default_device))
    assert ck.backend() is None  # the default device is the CPU
    ck.refresh()
    monkeypatch.setattr(ck, "_gpu", None)  # looked up again: this machine's own answer
    assert ck.backend() == (ck._render.gpu_backend() if mx.default_device() == mx.gpu else None)


# ---- GPU: greedy decoding, kernels against reference_only() ------------------------------------


class Counting:
    """Wraps a module's Kernel: counts launches of the launchers the dispatcher builds."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def launcher(self, *args, **kwargs):
        launch = self.kernel.launcher(*args, **kwargs)

        def counted(**kw):
            self.launches += 1
            return launch(**kw)

        return counted


def greedy(model, prompt: mx.array, steps: int) -> tuple[list[int], list[np.ndarray]]:
    cache = model.make_cache()
    logits = model(prompt, cache)[:, -1]
    tokens, all_logits = [], []
    for _ in range(steps):
        tok = mx.argmax(logits, axis=-1)
        tokens.append(tok.item())
        all_logits.append(np.array(logits.astype(mx.float32)))
        logits = model(tok[:, None], cache)[:, -1]
    return tokens, all_logits


@requires_gpu
@pytest.mark.parametrize("name", list(MODELS))
def test_gpu_greedy_kernels_match_reference(name, monkeypatch):
    """16 greedy tokens: identical with kernels and with reference_only(); logits within 1e-4 of
    the largest (fp32, MLX_ENABLE_TF32=0 from conftest)."""
    counters = {}
    for key, mod in FUSED.items():
        counters[key] = Counting(mod._kernel)
        monkeypatch.setattr(mod, "_kernel", counters[key])
    with mx.stream(mx.gpu):
        model = random_model(name, seed=1)
        prompt = mx.array(token_ids(1, 6, seed=4))
        with reference_only():
            want_tokens, want_logits = greedy(model, prompt, 16)
        assert all(c.launches == 0 for c in counters.values())
        got_tokens, got_logits = greedy(model, prompt, 16)
    # Llama has no q/k norms: its RoPE stays mx.fast.rope (the H200 run of 07:47 caught this)
    expected = ["activations"] + ["rms_norm_rope"] * (name != "llama")
    joins = counters["residual_rms_norm"].launches + counters["post_norm_residual"].launches
    assert joins > 0 and all(counters[k].launches > 0 for k in expected), {
        k: c.launches for k, c in counters.items()
    }
    assert got_tokens == want_tokens
    for got, want in zip(got_logits, want_logits):
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


@pytest.mark.parametrize("cuda", [True, False], ids=["cuda", "no-cuda"])
def test_device_array_keeps_values_and_pads_on_cuda(cuda, monkeypatch):
    """Kernel constants: the given values, dtype and length; with CUDA a view of a zero-padded
    16-byte buffer (out of MLX's small pool), the pad never visible. Longer lists are kept."""
    monkeypatch.setattr(mx.cuda, "is_available", lambda: cuda)
    for values, dt in (([3], mx.int32), ([1.5, -2.25], mx.float32), ([True], mx.bool_),
                       ([0.5], mx.bfloat16), (list(range(6)), mx.uint32)):  # fmt: skip
        a = ck.device_array(values, dt)
        assert a.dtype == dt and a.shape == (len(values),)
        assert a.tolist() == values
    import io

    # the padded parent is what a kernel's pointer sees; the view comes back evaluated, so no
    # Slice node joins a compiled graph that builds the constant while tracing
    made = []
    real_array = mx.array

    def spy(values, dtype=None):
        made.append(len(values) * dtype.size)
        return real_array(values, dtype=dtype)

    monkeypatch.setattr(mx, "array", spy)
    for values, dt in (([7], mx.int32), ([1, 2, 3, 4], mx.int32), ([True] * 3, mx.bool_)):
        made.clear()
        n_bytes = len(values) * dt.size
        traced = mx.compile(lambda x, v=values, d=dt: x + ck.device_array(v, d).astype(x.dtype))
        out = traced(real_array([1.0] * len(values)))
        buf = io.StringIO()
        mx.export_to_dot(buf, out)
        assert "Slice" not in buf.getvalue(), buf.getvalue()
        assert out.tolist() == [1.0 + float(v) for v in values]
        assert made == [max(16, n_bytes) if cuda else n_bytes], (values, made)
