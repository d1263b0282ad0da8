"""Gemma 4 speed at the real shapes (26B-A4B MoE, 31B dense) with random weights.

For each shape: our model with GGML Q4_K weights (Q5_0 where a row is not a multiple of 256,
as llama.cpp falls back), our model with MLX 4-bit affine weights, and mlx-lm 0.32.2's
gemma4_text on the very same MLX 4-bit arrays. Reports prefill tokens/s over the prompt, batch-1
greedy decode tokens/s after it, peak memory and the primitives in one decode step's graph (an
upper bound on its kernel launches). Prints a table and writes JSON.

    python bench/gemma4.py                      # both real shapes (H200: about 5-8 minutes)
    python bench/gemma4.py --tiny               # CPU smoke run on tiny shapes
    pip install --no-deps mlx-lm==0.32.2        # for the mlx-lm column
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import json
import os
import sys
import tempfile
import time
import types

import mlx.core as mx
import mlx.nn as nn
from gguf import GGMLQuantizationType as T
from mlx.utils import tree_flatten, tree_unflatten

from hf2q_mlx.io.random_weights import fill_ggml_modules
from hf2q_mlx.models import gemma4
from hf2q_mlx.models.experts import ExpertLinear
from hf2q_mlx.models.quantized import ggml_quantize_modules

S, F = "sliding_attention", "full_attention"
ROPE = {
    S: {"rope_type": "default", "rope_theta": 10_000.0},
    F: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
COMMON = dict(
    vocab_size=262_144, head_dim=256, global_head_dim=512, attention_k_eq_v=True,
    sliding_window=1024, final_logit_softcapping=30.0, hidden_size_per_layer_input=0,
    num_kv_shared_layers=0, use_double_wide_mlp=False, rope_parameters=ROPE,
    tie_word_embeddings=True,
)  # fmt: skip
# google/gemma-4-26B-A4B-it and google/gemma-4-31B-it text configs
SHAPES = {
    "26b-a4b": dict(
        COMMON, hidden_size=2816, intermediate_size=2112, num_hidden_layers=30,
        num_attention_heads=16, num_key_value_heads=8, num_global_key_value_heads=2,
        layer_types=([S] * 5 + [F]) * 5, enable_moe_block=True, num_experts=128,
        top_k_experts=8, moe_intermediate_size=704,
    ),
    "31b": dict(
        COMMON, hidden_size=5376, intermediate_size=21504, num_hidden_layers=60,
        num_attention_heads=32, num_key_value_heads=16, num_global_key_value_heads=4,
        layer_types=([S] * 5 + [F]) * 10,
    ),
}  # fmt: skip
TINY = {
    "tiny-moe": dict(
        COMMON, vocab_size=1024, hidden_size=256, intermediate_size=320, num_hidden_layers=6,
        num_attention_heads=2, num_key_value_heads=1, num_global_key_value_heads=1,
        head_dim=64, global_head_dim=128, sliding_window=16, layer_types=[S, S, F] * 2,
        enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=128,
    ),
    "tiny-dense": dict(
        COMMON, vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=6,
        num_attention_heads=2, num_key_value_heads=1, num_global_key_value_heads=1,
        head_dim=64, global_head_dim=128, sliding_window=16, layer_types=[S, S, F] * 2,
    ),
}  # fmt: skip


def quant_predicate(path: str, module: nn.Module):
    """4-bit everywhere, the router at 8 bits (mlx-lm's gemma4 choice), for both models."""
    if path.endswith("router.proj"):
        return {"group_size": 64, "bits": 8}
    return hasattr(module, "to_quantized")


def ggml_type_for(cols: int) -> int | None:
    if cols % 256 == 0:
        return T.Q4_K
    return T.Q5_0 if cols % 32 == 0 else None  # llama.cpp's fallback for Q4_K


def eval_by_layer(model: nn.Module) -> None:
    """Materialize the parameters one layer at a time: random init transients stay small."""
    for layer in model.layers:
        mx.eval(layer.parameters())
    mx.eval(model.parameters())


def set_module(model: nn.Module, path: str, module: nn.Module) -> None:
    model.update_modules(tree_unflatten([(path, module)]))


def ggml_layout(args: gemma4.ModelArgs, dtype: mx.Dtype) -> nn.Module:
    """The model with GGML layers (their blocks still zeros), unfused: Q4_K / Q5_0 by row width
    for the linears, embedding and experts; norms, scalars and the router stay in ``dtype``."""
    model = gemma4.Model(args)
    model.set_dtype(dtype)
    linear = {}
    for path, m in model.named_modules():
        if isinstance(m, (nn.Linear, nn.Embedding)) and not path.endswith("router.proj"):
            t = ggml_type_for(m.weight.shape[1])
            if t is not None:
                linear[path] = t
    ggml_quantize_modules(model, linear)
    for path, m in model.named_modules():
        if isinstance(m, ExpertLinear):
            t = ggml_type_for(m.in_features)
            if t is not None:
                set_module(model, path, m.to_ggml(t))
    return model


def build_ggml(args: gemma4.ModelArgs, dtype: mx.Dtype) -> nn.Module:
    """GGML blocks generated on the device; norms, scalars and the router stay in ``dtype``."""
    model = ggml_layout(args, dtype)
    fill_ggml_modules(model)
    model.fuse_projections()  # as the loader does
    eval_by_layer(model)
    return model


def build_mlx4(args: gemma4.ModelArgs, dtype: mx.Dtype) -> nn.Module:
    model = gemma4.Model(args)
    for _, m in model.named_modules():
        if isinstance(m, ExpertLinear):
            m.weight = mx.random.normal(m.weight.shape) * m.in_features**-0.5
    model.set_dtype(dtype)
    nn.quantize(model, group_size=64, bits=4, class_predicate=quant_predicate)
    eval_by_layer(model)
    return model


def import_mlx_lm():
    """mlx_lm.models.{gemma4_text, cache}, without mlx_lm/__init__'s heavy imports if those
    fail (only the model files are needed); None when mlx-lm is not installed."""
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None:
        return None
    try:
        return (
            importlib.import_module("mlx_lm.models.gemma4_text"),
            importlib.import_module("mlx_lm.models.cache"),
        )
    except ImportError:
        for name in [n for n in sys.modules if n == "mlx_lm" or n.startswith("mlx_lm.")]:
            del sys.modules[name]
        pkg = types.ModuleType("mlx_lm")
        pkg.__path__ = list(spec.submodule_search_locations)
        sys.modules["mlx_lm"] = pkg
        return (
            importlib.import_module("mlx_lm.models.gemma4_text"),
            importlib.import_module("mlx_lm.models.cache"),
        )


def build_mlx_lm(mlx_lm, config: dict, ours: nn.Module) -> nn.Module:
    """mlx-lm's model holding our MLX 4-bit arrays (experts split into its gate/up stacks)."""
    gemma4_text, _ = mlx_lm
    model = gemma4_text.Model(gemma4_text.ModelArgs.from_dict(config))
    nn.quantize(model, group_size=64, bits=4, class_predicate=quant_predicate)
    weights = {}
    for name, v in tree_flatten(ours.parameters()):
        if ".experts.gate_up_proj." in name:
            base, leaf = name.split(".experts.gate_up_proj.")
            half = v.shape[1] // 2
            weights[f"{base}.experts.switch_glu.gate_proj.{leaf}"] = mx.contiguous(v[:, :half])
            weights[f"{base}.experts.switch_glu.up_proj.{leaf}"] = mx.contiguous(v[:, half:])
        else:
            weights[name.replace(".experts.down_proj.", ".experts.switch_glu.down_proj.")] = v
    model.load_weights(list(weights.items()), strict=True)
    eval_by_layer(model)
    return model


def graph_primitives(y: mx.array) -> int:
    """Primitives in the unevaluated graph of y (export_to_dot draws one rectangle each)."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "step.dot")
        mx.export_to_dot(path, y)
        with open(path) as f:
            return sum("shape=rectangle" in line for line in f)


def cache_arrays(cache: list) -> list:
    """The K/V buffers of our caches and of mlx-lm's (same attribute names)."""
    return [a for c in cache for a in (getattr(c, "keys", None), getattr(c, "values", None))
            if isinstance(a, mx.array)]  # fmt: skip


def measure(model, make_cache, vocab: int, prompt_len: int, n_decode: int) -> dict:
    prompt = mx.random.randint(0, vocab, (1, prompt_len), key=mx.random.key(0))

    def step(y, cache):
        return mx.argmax(model(y[:, None], cache)[:, -1, :], axis=-1)

    warm = make_cache()  # first use compiles the kernels (CUDA JIT): keep it out of the timing
    y = mx.argmax(model(prompt, warm)[:, -1, :], axis=-1)
    mx.eval(step(step(y, warm), warm))
    del warm, y
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()

    cache = make_cache()
    tic = time.perf_counter()
    y = mx.argmax(model(prompt, cache)[:, -1, :], axis=-1)
    mx.eval(y, cache_arrays(cache))  # ring-buffer writes are not inputs of the logits
    prefill_s = time.perf_counter() - tic
    y = step(y, cache)
    mx.eval(y)
    y = step(y, cache)
    n_prims = graph_primitives(y)  # a steady-state step: no leftover prefill writes in it
    mx.eval(y)
    tic = time.perf_counter()
    for _ in range(n_decode):
        y = step(y, cache)  # the next graph is built while the previous step runs
        mx.async_eval(y)
    mx.eval(y)
    decode_s = time.perf_counter() - tic
    return {
        "prefill_tok_s": prompt_len / prefill_s,
        "decode_tok_s": n_decode / decode_s,
        "decode_ms_per_tok": 1e3 * decode_s / n_decode,
        "peak_gb": mx.get_peak_memory() / 1e9,
        "decode_graph_primitives": n_prims,
    }


def weights_gb(model: nn.Module) -> float:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters())) / 1e9


def logits_gap(a: nn.Module, b: nn.Module, vocab: int) -> float:
    """max |logit difference| / max |logit| of two models on one 16-token prompt (no cache)."""
    ids = mx.random.randint(0, vocab, (1, 16), key=mx.random.key(1))
    la, lb = a(ids).astype(mx.float32), b(ids).astype(mx.float32)
    return (mx.abs(la - lb).max() / mx.abs(la).max()).item()


def run(shapes: dict, formats: list[str], prompt: int, decode: dict, use_mlx_lm: bool) -> list:
    dtype = mx.bfloat16 if mx.default_device().type == mx.DeviceType.gpu else mx.float32
    mlx_lm = import_mlx_lm() if use_mlx_lm else None
    if use_mlx_lm and mlx_lm is None:
        print("mlx-lm is not installed: no mlx-lm column (pip install --no-deps mlx-lm==0.32.2)")
    rows = []
    for shape, config in shapes.items():
        args = gemma4.ModelArgs.from_dict(config)
        for fmt in formats:
            tic = time.perf_counter()
            model = build_ggml(args, dtype) if fmt == "q4_k" else build_mlx4(args, dtype)
            base = {"shape": shape, "format": fmt, "prompt": prompt, "decode": decode[fmt]}
            row = {**base, "impl": "hf2q_mlx", "weights_gb": weights_gb(model),
                   "build_s": time.perf_counter() - tic}  # fmt: skip
            rows.append({**row, **measure(model, model.make_cache, args.vocab_size, prompt,
                                          decode[fmt])})  # fmt: skip
            print(row_text(rows[-1]), flush=True)
            if fmt == "mlx4" and mlx_lm is not None:
                theirs = build_mlx_lm(mlx_lm, config, model)  # shares our quantized arrays
                # same weights, same math: a large gap would make the comparison meaningless
                gap = logits_gap(model, theirs, args.vocab_size)
                del model
                gc.collect()
                row = {**base, "impl": "mlx-lm 0.32.2", "weights_gb": weights_gb(theirs),
                       "logit_gap_vs_ours": gap}  # fmt: skip
                rows.append({**row, **measure(theirs, theirs.make_cache, args.vocab_size, prompt,
                                              decode[fmt])})  # fmt: skip
                print(row_text(rows[-1]) + f"   (logit gap vs ours {gap:.1e})", flush=True)
                del theirs
            else:
                del model
            gc.collect()
            mx.clear_cache()
    return rows


HEADER = (
    f"{'shape':<10} {'format':<6} {'impl':<14} {'weights GB':>10} {'prefill tok/s':>13} "
    f"{'decode tok/s':>12} {'ms/tok':>8} {'peak GB':>8} {'prims/step':>10}"
)


def row_text(r: dict) -> str:
    return (
        f"{r['shape']:<10} {r['format']:<6} {r['impl']:<14} {r['weights_gb']:>10.2f} "
        f"{r['prefill_tok_s']:>13.1f} {r['decode_tok_s']:>12.2f} {r['decode_ms_per_tok']:>8.2f} "
        f"{r['peak_gb']:>8.2f} {r['decode_graph_primitives']:>10d}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
    p.add_argument("--shapes", default=None, help="comma list of: " + ", ".join(SHAPES))
    p.add_argument("--formats", default="q4_k,mlx4", help="comma list of: q4_k, mlx4")
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 512)")
    p.add_argument("--decode", type=int, default=None, help="decode tokens, mlx4 (default 64)")
    p.add_argument("--decode-q4k", type=int, default=None, help="decode tokens, q4_k (32)")
    p.add_argument("--no-mlx-lm", action="store_true", help="skip the mlx-lm comparison")
    p.add_argument("--json", default="bench_gemma4.json", help="output file")
    a = p.parse_args()
    table = TINY if a.tiny else SHAPES
    names = a.shapes.split(",") if a.shapes else list(table)
    shapes = {n: table[n] for n in names}
    prompt = a.prompt or (32 if a.tiny else 512)
    decode = {
        "mlx4": a.decode or (8 if a.tiny else 64),
        "q4_k": a.decode_q4k or (4 if a.tiny else 32),
    }
    print(f"mlx {mx.__version__} on {mx.default_device()}; prompt {prompt} tokens")
    print(HEADER, flush=True)
    rows = run(shapes, a.formats.split(","), prompt, decode, not a.no_mlx_lm)
    print("\n" + HEADER + "\n" + "\n".join(row_text(r) for r in rows))
    info = {"mlx": mx.__version__, "device": str(mx.default_device()), "rows": rows}
    with open(a.json, "w") as f:
        json.dump(info, f, indent=1)
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
