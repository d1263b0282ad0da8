"""Qwen 3.5 speed at real shapes (9B dense, 35B-A3B MoE) with random weights, batch 1.

hf2q_mlx with GGML Q4_K and with MLX 4-bit weights, next to mlx-lm 0.32.2's ``qwen3_5`` on the
very same MLX 4-bit arrays, in one run. Prints a table and writes JSON. ``--tiny`` runs small
shapes (a CPU smoke test). mlx-lm is optional: pip install --no-deps mlx-lm==0.32.2 (its model
modules are imported without running mlx_lm/__init__, which would pull in transformers).

    python bench/qwen3_5.py --json qwen3_5_bench.json
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import io
import json
import os
import re
import sys
import time
import types
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from gguf import GGMLQuantizationType as T
from mlx.utils import tree_flatten

from hf2q_mlx.io.random_weights import fill_ggml_modules
from hf2q_mlx.models import qwen3_5, qwen3_5_moe
from hf2q_mlx.models.quantized import ggml_quantize_modules

ATTN = dict(num_attention_heads=16, head_dim=256, rope_theta=10_000_000.0,
            partial_rotary_factor=0.25, full_attention_interval=4, vocab_size=248320,
            linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
            linear_value_head_dim=128, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
            tie_word_embeddings=False)  # fmt: skip
SHAPES = {
    "9b": dict(ATTN, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
               num_key_value_heads=4),
    "35b-a3b": dict(ATTN, hidden_size=2048, num_hidden_layers=40, num_key_value_heads=2,
                    num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                    shared_expert_intermediate_size=512),
}  # fmt: skip
# K-quant blocks need widths that are multiples of 256
TINY = dict(num_attention_heads=2, head_dim=128, rope_theta=10_000.0, partial_rotary_factor=0.25,
            full_attention_interval=2, vocab_size=512, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=64,
            linear_conv_kernel_dim=4, rms_norm_eps=1e-6, tie_word_embeddings=False,
            hidden_size=256, num_hidden_layers=4, num_key_value_heads=1)  # fmt: skip
TINY_SHAPES = {
    "tiny": dict(TINY, intermediate_size=512),
    "tiny-moe": dict(TINY, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
                     shared_expert_intermediate_size=256),
}  # fmt: skip


def is_moe(config: dict) -> bool:
    return config.get("num_experts", 0) > 0


def small_gate(path: str) -> bool:
    """Router and shared-expert gate: 8-bit in mlx-lm's recipe, dense in GGUF Q4_K_M files."""
    return path.endswith("mlp.gate") or path.endswith("shared_expert_gate")


def _quant_predicate(path: str, module: nn.Module):
    if not hasattr(module, "to_quantized"):
        return False
    return {"group_size": 64, "bits": 8} if small_gate(path) else True


def build_ours(config: dict, dtype: mx.Dtype) -> nn.Module:
    module = qwen3_5_moe if is_moe(config) else qwen3_5
    model = module.Model(module.ModelArgs.from_dict(config))
    # float leaves: never evaluated from their lazy init; replaced by small random values
    for layer in model.layers:
        if layer.is_linear:
            la = layer.linear_attn
            la.A_log = mx.log(mx.random.uniform(1.0, 16.0, la.A_log.shape))
            la.dt_bias = mx.ones(la.dt_bias.shape)
            la.conv1d.weight = (0.3 * mx.random.normal(la.conv1d.weight.shape)).astype(dtype)
    return model


def randomize_mlx_quantized(model: nn.Module, dtype: mx.Dtype) -> None:
    """MLX affine 4-bit (8-bit gates) with random codes; each weight ~ 0.02 std."""
    nn.quantize(model, group_size=64, bits=4, class_predicate=_quant_predicate)
    for _, m in model.named_modules():
        if "scales" not in m:
            continue
        *lead, words = m.weight.shape
        codes = mx.random.randint(0, 256, (*lead, 4 * words)).astype(mx.uint8).view(mx.uint32)
        levels = 2**m.bits
        scales = mx.random.uniform(0.5, 1.5, m.scales.shape) * (0.07 / levels)
        m.weight, m.scales = codes, scales.astype(dtype)
        m.biases = (-scales * (levels - 1) / 2).astype(dtype)
        mx.eval(m.parameters())  # one module at a time keeps the peak small


def q4k_layout(model: nn.Module) -> None:
    """GGML Q4_K layers (blocks still zeros) for every projection, embedding and expert stack,
    in place; gates stay dense."""
    modules = dict(model.named_modules())
    types_ = {
        p: T.Q4_K
        for p, m in modules.items()
        if isinstance(m, (nn.Linear, nn.Embedding)) and not small_gate(p)
    }
    for p in [p for p, m in modules.items() if hasattr(m, "to_ggml")]:
        *parent, last = p.split(".")
        modules[".".join(parent)][last] = modules[p].to_ggml(T.Q4_K)
    ggml_quantize_modules(model, types_)


def randomize_q4k(model: nn.Module, dtype: mx.Dtype) -> None:
    """GGML Q4_K blocks for every projection, embedding and expert stack; gates stay dense."""
    q4k_layout(model)
    fill_ggml_modules(model, evaluate=True)
    cast_floats(model, dtype)
    model.fuse_projections()  # as the loader does


def cast_floats(model: nn.Module, dtype: mx.Dtype) -> None:
    """Dense float leaves to ``dtype``, A_log / dt_bias kept fp32 (as the gates compute)."""
    model.update(
        mlx_unflatten(
            [
                (k, v if k.endswith(("A_log", "dt_bias")) else v.astype(dtype))
                for k, v in tree_flatten(model.parameters())
                if mx.issubdtype(v.dtype, mx.floating)
            ]
        )
    )
    mx.eval(model.parameters())


def mlx_unflatten(items):
    from mlx.utils import tree_unflatten

    return tree_unflatten(items)


def import_mlx_lm(name: str):
    """mlx_lm.models.<name> without executing mlx_lm/__init__ (transformers-free)."""
    if "mlx_lm" not in sys.modules:
        spec = importlib.util.find_spec("mlx_lm")
        if spec is None:
            return None
        pkg = types.ModuleType("mlx_lm")
        pkg.__path__ = [str(Path(spec.origin).parent)]
        sys.modules["mlx_lm"] = pkg
    return importlib.import_module(f"mlx_lm.models.{name}")


def mlx_lm_twin(ours: nn.Module, config: dict):
    """mlx-lm's model holding the same quantized arrays as ``ours`` (experts split, not copied
    beyond the gate/up halves)."""
    lm = import_mlx_lm("qwen3_5_moe" if is_moe(config) else "qwen3_5")
    if lm is None:
        return None
    rope = {k: config[k] for k in ("rope_theta", "partial_rotary_factor")}
    text = dict(config, rope_parameters=dict(rope, type="default"))
    model = lm.Model(lm.ModelArgs.from_dict({"model_type": "qwen3_5", "text_config": text}))
    nn.quantize(model, group_size=64, bits=4, class_predicate=_quant_predicate)
    weights = []
    for k, v in tree_flatten(ours.parameters()):
        k = "language_model." + k
        if ".experts.gate_up_proj." in k:
            mid = v.shape[-2] // 2
            base = k.replace(".experts.gate_up_proj.", ".switch_mlp.{}.")
            weights += [(base.format("gate_proj"), mx.contiguous(v[..., :mid, :])),
                        (base.format("up_proj"), mx.contiguous(v[..., mid:, :]))]  # fmt: skip
        else:
            weights.append((k.replace(".experts.", ".switch_mlp."), v))
    model.load_weights(weights, strict=True)
    mx.eval(model.parameters())
    return model


def cache_arrays(cache: list) -> list:
    out = []
    for c in cache:
        for v in vars(c).values():
            if isinstance(v, mx.array):
                out.append(v)
            elif isinstance(v, (list, tuple)):
                out += [a for a in v if isinstance(a, mx.array)]
    return out


def decode_ops(model, cache) -> int:
    """Primitive ops in one decode step's graph (an upper bound on kernel launches)."""
    logits = model(mx.array([[1]], mx.int32), cache)
    dot = io.StringIO()
    mx.export_to_dot(dot, mx.argmax(logits[:, -1, :], axis=-1))
    return len(re.findall(r"shape=rectangle", dot.getvalue()))


def measure(model, prompt: mx.array, gen: int, budget_s: float) -> dict:
    """Prefill tokens/s of ``prompt`` (one chunk), then greedy decode tokens/s."""
    warm = model.make_cache()  # builds every kernel once, at the timed shapes
    mx.eval(model(prompt, warm), cache_arrays(warm))
    mx.eval(model(prompt[:, :1], warm), cache_arrays(warm))
    del warm
    cache = model.make_cache()
    ops = decode_ops(model, model.make_cache())
    mx.synchronize()
    t0 = time.perf_counter()
    logits = model(prompt, cache)
    tok = mx.argmax(logits[:, -1:, :], axis=-1)
    mx.eval(tok, cache_arrays(cache))
    prefill_s = time.perf_counter() - t0

    def step(t):
        return mx.argmax(model(t, cache)[:, -1:, :], axis=-1)

    nxt = step(tok)
    mx.async_eval(nxt)
    n, t0 = 0, time.perf_counter()
    while n < gen and time.perf_counter() - t0 < budget_s:
        tok, nxt = nxt, step(nxt)
        mx.async_eval(nxt)
        tok.item()
        n += 1
    decode_s = time.perf_counter() - t0
    return {
        "prompt_tokens": prompt.shape[1],
        "prefill_tok_s": prompt.shape[1] / prefill_s,
        "decode_tokens": n,
        "decode_tok_s": n / decode_s,
        "decode_step_ops": ops,
        "peak_memory_gb": mx.get_peak_memory() / 1e9,
    }


def weight_gb(model) -> float:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters())) / 1e9


def run_shape(name: str, config: dict, args) -> list[dict]:
    dtype = mx.bfloat16 if mx.default_device().type == mx.DeviceType.gpu else mx.float32
    prompt = mx.random.randint(0, config["vocab_size"], (1, args.prompt), key=mx.random.key(0))
    rows = []

    def record(fmt, impl, model, prefill_mode=None):
        if prefill_mode:
            os.environ["HF2Q_GDN_PREFILL"] = prefill_mode
        mx.reset_peak_memory()
        r = measure(model, prompt, args.gen, args.decode_seconds)
        os.environ.pop("HF2Q_GDN_PREFILL", None)
        r.update(shape=name, format=fmt, impl=impl, prefill_mode=prefill_mode or "-",
                 weight_gb=weight_gb(model))  # fmt: skip
        print(row_text(r), flush=True)
        rows.append(r)

    if "mlx4" in args.formats:
        ours = build_ours(config, dtype)
        randomize_mlx_quantized(ours, dtype)
        cast_floats(ours, dtype)
        twin = None if args.no_mlx_lm else mlx_lm_twin(ours, config)  # from unfused names
        ours.fuse_projections()  # as the loader does
        for mode in args.prefill_modes:
            record("mlx4", "hf2q_mlx", ours, mode)
        if twin is not None:
            # same weights, same math: the logits must agree (up to bf16 rounding order)
            a, b = ours(prompt[:, :16]), twin(prompt[:, :16])
            agree = (mx.abs(a - b).max() / mx.abs(a).max()).item()
            print(f"{name}: max |hf2q - mlx-lm| / max |logit| = {agree:.2e}")
            record("mlx4", "mlx-lm 0.32.2", twin)
            rows[-1]["logit_rel_diff_vs_hf2q"] = agree
        elif not args.no_mlx_lm:
            print("mlx-lm not installed: skipped (pip install --no-deps mlx-lm==0.32.2)")
        del ours, twin
        mx.clear_cache()
    if "q4k" in args.formats:
        ours = build_ours(config, dtype)
        randomize_q4k(ours, dtype)
        record("q4_k", "hf2q_mlx", ours, args.prefill_modes[0])
        del ours
        mx.clear_cache()
    return rows


HEADER = (f"{'shape':<9} {'format':<6} {'impl':<14} {'prefill':<8} {'weights GB':>10} "
          f"{'prefill tok/s':>13} {'decode tok/s':>12} {'ops/step':>8} {'peak GB':>8}")  # fmt: skip


def row_text(r: dict) -> str:
    return (f"{r['shape']:<9} {r['format']:<6} {r['impl']:<14} {r['prefill_mode']:<8} "
            f"{r['weight_gb']:>10.2f} {r['prefill_tok_s']:>13.1f} {r['decode_tok_s']:>12.1f} "
            f"{r['decode_step_ops']:>8d} {r['peak_memory_gb']:>8.2f}")  # fmt: skip


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="small shapes (CPU smoke test)")
    p.add_argument("--shapes", default=None, help="comma list (default: all of the set)")
    p.add_argument("--formats", default="mlx4,q4k")
    p.add_argument("--prefill-modes", default="fast,step",
                   help="delta-rule prefill forms for hf2q_mlx: fast (mx.fast), step (our "
                        "kernel), chunked, reference")  # fmt: skip
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--gen", type=int, default=128)
    p.add_argument("--decode-seconds", type=float, default=20.0, help="decode time cap per run")
    p.add_argument("--no-mlx-lm", action="store_true")
    p.add_argument("--json", default="qwen3_5_bench.json")
    args = p.parse_args(argv)
    args.formats = args.formats.split(",")
    args.prefill_modes = args.prefill_modes.split(",")
    shapes = TINY_SHAPES if args.tiny else SHAPES
    names = args.shapes.split(",") if args.shapes else list(shapes)
    print(f"device: {mx.default_device()}  mlx {mx.__version__}")
    print(HEADER)
    rows = []
    for name in names:
        rows += run_shape(name, shapes[name], args)
    report = {"device": str(mx.default_device()), "mlx": mx.__version__, "rows": rows,
              "shapes": {n: shapes[n] for n in names}}  # fmt: skip
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
