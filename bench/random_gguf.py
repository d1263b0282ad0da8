"""Random-weight GGUF files at the benchmark shapes, loadable by hf2q_mlx and by llama.cpp.

The model is the benchmarks' random model (bench/gemma4.py and bench/qwen3_5.py shapes: GGML
Q4_K weights, Q5_0 where a Gemma 4 row is not a multiple of 256, dense gates and norms) under
llama.cpp's tensor names and metadata for its ``gemma4``, ``qwen35`` and ``qwen35moe``
architectures, plus a dummy SentencePiece (``llama``) vocabulary of vocab_size tokens. The
weights are built lazily and written one tensor at a time: a 20 GB file needs one tensor of host
memory.

    python bench/random_gguf.py gemma4:26b-a4b /tmp/g26.gguf
    python bench/random_gguf.py --list                     # the shapes (tiny ones for the CPU)
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gemma4 as gemma4_bench  # noqa: E402  (bench/gemma4.py: SHAPES, TINY)
import qwen3_5 as qwen3_5_bench  # noqa: E402  (bench/qwen3_5.py: SHAPES, TINY_SHAPES)

from hf2q_mlx.errors import InvalidArgumentError  # noqa: E402
from hf2q_mlx.io.random_weights import fill_ggml_modules  # noqa: E402
from hf2q_mlx.models import gemma4, gemma4_gguf, qwen3_5, qwen3_5_moe  # noqa: E402

SHAPES = {  # copies: the benches' own tables stay as they are
    "gemma4": {k: dict(v) for k, v in {**gemma4_bench.SHAPES, **gemma4_bench.TINY}.items()},
    "qwen3_5": {
        k: dict(v) for k, v in {**qwen3_5_bench.SHAPES, **qwen3_5_bench.TINY_SHAPES}.items()
    },
}
# llama.cpp's qwen35 sizes the delta-net with one head dim (ssm.state_size) for keys and values,
# as the real shapes have (128 / 128); bench/qwen3_5.py's tiny shapes use 32 / 64
for _c in SHAPES["qwen3_5"].values():
    _c["linear_key_head_dim"] = _c["linear_value_head_dim"]
TINY = ["gemma4:tiny-dense", "gemma4:tiny-moe", "qwen3_5:tiny", "qwen3_5:tiny-moe"]
# metadata keys the written file carries (tests check them; llama.cpp reads them)
GEMMA4_KEYS = [
    "block_count", "context_length", "embedding_length", "feed_forward_length",
    "attention.head_count", "attention.head_count_kv", "attention.key_length",
    "attention.value_length", "attention.key_length_swa", "attention.value_length_swa",
    "attention.layer_norm_rms_epsilon", "attention.sliding_window",
    "attention.sliding_window_pattern", "attention.shared_kv_layers", "rope.freq_base",
    "rope.freq_base_swa", "rope.dimension_count", "rope.dimension_count_swa",
    "embedding_length_per_layer_input", "final_logit_softcapping",
]  # fmt: skip
GEMMA4_MOE_KEYS = ["expert_count", "expert_used_count", "expert_feed_forward_length"]
QWEN35_KEYS = [
    "block_count", "context_length", "embedding_length", "feed_forward_length",
    "attention.head_count", "attention.head_count_kv", "attention.key_length",
    "attention.value_length", "attention.layer_norm_rms_epsilon", "rope.freq_base",
    "rope.dimension_count", "rope.dimension_sections", "ssm.conv_kernel", "ssm.state_size",
    "ssm.group_count", "ssm.time_step_rank", "ssm.inner_size", "full_attention_interval",
]  # fmt: skip
QWEN35_MOE_KEYS = [
    "expert_count", "expert_used_count", "expert_feed_forward_length",
    "expert_shared_feed_forward_length",
]  # fmt: skip
TOKENIZER_KEYS = [
    "tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.scores",
    "tokenizer.ggml.token_type", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id",
]  # fmt: skip


class RandomGGUFError(InvalidArgumentError):
    """An unknown family:shape name."""


def parse_shape(family_shape: str) -> tuple[str, str, dict]:
    """ "gemma4:26b-a4b" -> ("gemma4", "26b-a4b", its config dict)."""
    family, _, shape = family_shape.partition(":")
    if family not in SHAPES or shape not in SHAPES[family]:
        known = ", ".join(f"{f}:{s}" for f in SHAPES for s in SHAPES[f])
        raise RandomGGUFError(f"unknown shape {family_shape!r} (known: {known})")
    return family, shape, dict(SHAPES[family][shape])


def gguf_architecture(family: str, config: dict) -> str:
    if family == "gemma4":
        return "gemma4"
    return "qwen35moe" if config.get("num_experts", 0) else "qwen35"


def _norm_like(shape: tuple, key: mx.array, dtype: mx.Dtype) -> mx.array:
    """Norm weights and scalars: around 1, not all equal (a swapped tensor would show)."""
    return mx.random.uniform(0.8, 1.2, shape, key=key).astype(dtype)


def _fill(model: nn.Module, seed: int, dtype: mx.Dtype, skip=()) -> None:
    """Random GGML blocks for every GGML module, random float leaves (lazy: nothing evaluated)."""
    fill_ggml_modules(model, base_seed=seed * 100_003)
    key = mx.random.key(seed)
    leaves = []
    for name, v in tree_flatten(model.parameters()):
        if v.dtype == mx.uint8 or name.endswith(skip):
            continue
        key, k = mx.random.split(key)
        if v.ndim == 1 or name.endswith("layer_scalar"):
            leaves.append((name, _norm_like(v.shape, k, dtype)))
        else:  # dense matrices (routers, gates): ~ 1/sqrt(in) like a trained layer
            w = mx.random.normal(v.shape, key=k) * v.shape[-1] ** -0.5
            leaves.append((name, w.astype(dtype)))
    model.load_weights(leaves, strict=False)


def build_gemma4(config: dict, dtype: mx.Dtype, seed: int = 0) -> nn.Module:
    """bench/gemma4.py build_ggml's model, unfused and unevaluated (GGUF tensors are unfused)."""
    model = gemma4_bench.ggml_layout(gemma4.ModelArgs.from_dict(config), dtype)
    _fill(model, seed, dtype)
    return model


def build_qwen3_5(config: dict, dtype: mx.Dtype, seed: int = 0) -> nn.Module:
    """bench/qwen3_5.py's Q4_K model (randomize_q4k), unfused and unevaluated, with llama.cpp's
    tiled delta-net value heads (the layout the loader assumes for a GGUF)."""
    module = qwen3_5_moe if qwen3_5_bench.is_moe(config) else qwen3_5
    model = module.Model(module.ModelArgs.from_dict(dict(config, v_heads_tiled=True)))
    qwen3_5_bench.q4k_layout(model)
    model.set_dtype(dtype)
    _fill(model, seed, dtype, skip=("A_log", "dt_bias", "conv1d.weight"))
    key = mx.random.key(seed + 1)
    for layer in model.layers:
        if layer.is_linear:  # as bench/qwen3_5.py build_ours; decay gates stay fp32
            la = layer.linear_attn
            k1, k2, key = mx.random.split(key, 3)
            la.A_log = mx.log(mx.random.uniform(1.0, 16.0, la.A_log.shape, key=k1))
            la.dt_bias = mx.ones(la.dt_bias.shape)
            la.conv1d.weight = (0.3 * mx.random.normal(la.conv1d.weight.shape, key=k2)).astype(
                dtype
            )
    return model


def build_random(family_shape: str, dtype: mx.Dtype | None = None, seed: int = 0):
    """(model, family, config): the random model, unfused, lazy (evaluate or write it)."""
    family, _, config = parse_shape(family_shape)
    if dtype is None:
        dtype = mx.bfloat16 if mx.default_device().type == mx.DeviceType.gpu else mx.float32
    build = build_gemma4 if family == "gemma4" else build_qwen3_5
    return build(config, dtype, seed), family, config


# ---- names: our parameter paths -> llama.cpp's tensor names (the loader's table, inverted) ----


def _inverse_names(arch_map: dict) -> list[tuple[re.Pattern, str]]:
    table = []
    for gguf_name, target in arch_map.items():
        if target is None:
            continue
        regex = re.escape(target).replace(re.escape("{i}"), r"(?P<i>\d+)")
        table.append((re.compile(regex + "$"), gguf_name))
    return table


def gguf_name(param: str, table) -> str:
    for regex, name in table:
        m = regex.match(param)
        if m:
            return name.format(**m.groupdict())
    raise RandomGGUFError(f"no llama.cpp name for parameter {param}")


def _to_numpy(v: mx.array) -> np.ndarray:
    if v.dtype == mx.uint8:
        return np.asarray(v)
    return np.asarray(v.astype(mx.float32))  # F32 in the file: exact for bf16 too


def gguf_tensors(model: nn.Module, family: str, config: dict):
    """[(gguf name, lazy array, GGML type or None)] in file order (inverse loader transforms)."""
    if family == "gemma4":
        arch_map = gemma4_gguf.GGUF_TENSOR_MAP
    elif qwen3_5_bench.is_moe(config):
        arch_map = qwen3_5_moe.GGUF_TENSOR_MAP
    else:
        arch_map = qwen3_5.GGUF_TENSOR_MAP
    table = _inverse_names(arch_map)
    types_ = {p: m.ggml_type for p, m in model.named_modules() if getattr(m, "ggml_type", None)}
    out = []
    for param, v in tree_flatten(model.parameters()):
        name = gguf_name(param, table)
        t = types_.get(param.rsplit(".", 1)[0]) if v.dtype == mx.uint8 else None
        if name.endswith(".ssm_a"):  # llama.cpp stores -exp(A_log)
            v = -mx.exp(v.astype(mx.float32))
        elif name.endswith(".ssm_conv1d.weight"):  # (C, K, 1) -> llama.cpp's (C, K)
            v = v[..., 0]
        elif name.endswith("ffn_gate_inp_shexp.weight"):  # a (D,) vector in llama.cpp
            v = v.reshape(-1)
        out.append((name, v, t))
    if family == "gemma4":
        out.insert(0, ("rope_freqs.weight", gemma4_rope_freqs(config), None))
    return out


def gemma4_rope_freqs(config: dict) -> mx.array:
    """Proportional RoPE of the full layers: factor 1 = rotated pair, 1e30 = unrotated."""
    full = config["rope_parameters"]["full_attention"]
    half = config["global_head_dim"] // 2
    rotated = int(full.get("partial_rotary_factor", 1.0) * half)
    return mx.array([1.0] * rotated + [1e30] * (half - rotated), dtype=mx.float32)


# ---- metadata ----


def add_vocab(w: gguf.GGUFWriter, vocab_size: int) -> None:
    """A dummy SentencePiece vocabulary: <unk> <s> </s>, the 256 byte tokens, then filler."""
    specials = ["<unk>", "<s>", "</s>"]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"\u2581t{i}" for i in range(vocab_size - len(tokens))]
    if len(tokens) != vocab_size:
        raise RandomGGUFError(f"vocab_size {vocab_size} < {len(tokens)} tokens needed")
    types_ = [2, 3, 3] + [6] * 256 + [1] * (vocab_size - 259)  # unknown, control, byte, normal
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(vocab_size - 259)])
    w.add_token_types(types_)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)


def add_gemma4_metadata(w: gguf.GGUFWriter, c: dict) -> None:
    args = gemma4.ModelArgs.from_dict(c)
    n, types_ = args.num_hidden_layers, args.layer_types
    full = [t == "full_attention" for t in types_]
    w.add_block_count(n)
    w.add_context_length(131_072)
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length([c["intermediate_size"]] * n)
    w.add_head_count(c["num_attention_heads"])
    kv_full = c.get("num_global_key_value_heads") or c["num_key_value_heads"]
    w.add_head_count_kv([kv_full if f else c["num_key_value_heads"] for f in full])
    w.add_key_length(c["global_head_dim"])
    w.add_value_length(c["global_head_dim"])
    w.add_key_length_swa(c["head_dim"])
    w.add_value_length_swa(c["head_dim"])
    w.add_rope_dimension_count(c["global_head_dim"])
    w.add_uint32("gemma4.rope.dimension_count_swa", c["head_dim"])
    w.add_layer_norm_rms_eps(args.rms_norm_eps)
    w.add_rope_freq_base(c["rope_parameters"]["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(c["rope_parameters"]["sliding_attention"]["rope_theta"])
    w.add_sliding_window(c["sliding_window"])
    w.add_sliding_window_pattern([not f for f in full])
    w.add_shared_kv_layers(c.get("num_kv_shared_layers", 0))
    w.add_embedding_length_per_layer_input(c.get("hidden_size_per_layer_input", 0))
    w.add_final_logit_softcapping(c["final_logit_softcapping"])
    if c.get("enable_moe_block"):
        w.add_expert_count(c["num_experts"])
        w.add_expert_used_count(c["top_k_experts"])
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])


def add_qwen35_metadata(w: gguf.GGUFWriter, c: dict) -> None:
    n = c["num_hidden_layers"]
    rope_dims = int(c["head_dim"] * c["partial_rotary_factor"])
    w.add_block_count(n)
    w.add_context_length(262_144)
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c.get("intermediate_size", 0))
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_freq_base(c["rope_theta"])
    w.add_rope_dimension_count(rope_dims)
    # Qwen 3.5's mrope sections (11, 11, 10 of 32 pairs); text positions make them plain RoPE
    half = rope_dims // 2
    s0 = round(11 * half / 32)
    w.add_rope_dimension_sections([s0, s0, half - 2 * s0, 0])
    w.add_ssm_conv_kernel(c["linear_conv_kernel_dim"])
    w.add_ssm_state_size(c["linear_key_head_dim"])
    w.add_ssm_group_count(c["linear_num_key_heads"])
    w.add_ssm_time_step_rank(c["linear_num_value_heads"])
    w.add_ssm_inner_size(c["linear_num_value_heads"] * c["linear_value_head_dim"])
    w.add_full_attention_interval(c["full_attention_interval"])
    if c.get("num_experts", 0):
        w.add_expert_count(c["num_experts"])
        w.add_expert_used_count(c["num_experts_per_tok"])
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])


# ---- writing ----


def write_gguf(tensors: list, family: str, config: dict, path: str | Path) -> dict:
    """Write ``gguf_tensors(model, ...)`` as a GGUF, one tensor at a time; returns a summary.

    Tensors still lazy are generated here and dropped once written (the list is emptied), so
    host memory holds about one tensor when nothing else references them.
    """
    arch = gguf_architecture(family, config)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"hf2q_mlx random {family}")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    (add_gemma4_metadata if family == "gemma4" else add_qwen35_metadata)(w, config)
    add_vocab(w, config["vocab_size"])
    nbytes = 0
    for name, v, t in tensors:
        np_dtype = np.uint8 if t is not None else np.float32
        size = v.size * (1 if t is not None else 4)
        w.add_tensor_info(name, v.shape, np.dtype(np_dtype), size, raw_dtype=t)
        nbytes += size
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    count = len(tensors)
    while tensors:
        _, v, _ = tensors.pop(0)  # the list's reference: a lazy tensor is freed once written
        w.write_tensor_data(_to_numpy(v))
        del v
    w.close()
    return {"path": str(path), "architecture": arch, "tensors": count, "bytes": nbytes}


def write_random_gguf(
    family_shape: str, path: str | Path, seed: int = 0, dtype: mx.Dtype | None = None
) -> dict:
    """Write the random model of ``family_shape`` (e.g. "qwen3_5:9b") to ``path``."""
    model, family, config = build_random(family_shape, dtype, seed)
    tensors = gguf_tensors(model, family, config)
    del model  # the list holds the only references to the lazy weights
    return write_gguf(tensors, family, config, path)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shape", nargs="?", help="family:shape, e.g. gemma4:26b-a4b, qwen3_5:tiny")
    p.add_argument("out", nargs="?", help="output .gguf path")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--list", action="store_true", help="list the shapes")
    a = p.parse_args(argv)
    if a.list or not a.shape or not a.out:
        for family, shapes in SHAPES.items():
            print(" ".join(f"{family}:{s}" for s in shapes))
        return
    tic = time.perf_counter()
    info = write_random_gguf(a.shape, a.out, seed=a.seed)
    gb = info["bytes"] / 1e9
    print(f"wrote {a.out}: {info['architecture']}, {info['tensors']} tensors, {gb:.2f} GB "
          f"in {time.perf_counter() - tic:.0f} s")  # fmt: skip


if __name__ == "__main__":
    main()
