"""Prompt and decode speed of a loaded model, measured through ``stream_generate``."""

from __future__ import annotations

import io
import platform
import re
import time
from typing import Any

import mlx.core as mx
import mlx.utils

from .errors import SamplingOptionsError
from .generate import make_prompt_cache, parse_kv_bits, prefill, stream_generate


def random_prompt(tokenizer: Any, n: int, seed: int = 0) -> list[int]:
    """n token ids drawn uniformly from the vocabulary, avoiding BOS/EOS."""
    special = set(tokenizer.eos_token_ids) | {tokenizer.bos_token_id}
    ids = mx.random.randint(0, tokenizer.vocab_size, (4 * n + 16,), key=mx.random.key(seed))
    picked = [t for t in ids.tolist() if t not in special][:n]
    return picked


def decode_step_ops(model: Any, prompt: list[int]) -> int:
    """Primitive operations in the graph of one decode step (an upper bound on kernel launches),
    counted from MLX's DOT export after prefilling ``prompt``."""
    cache = make_prompt_cache(model)
    mx.eval(prefill(model, mx.array(prompt, mx.int32), cache))
    logits = model(mx.array([[prompt[-1]]], mx.int32), cache=cache)
    dot = io.StringIO()
    mx.export_to_dot(dot, mx.argmax(logits[:, -1, :], axis=-1))
    return len(re.findall(r"shape=rectangle", dot.getvalue()))


def model_info(model: Any) -> dict[str, Any]:
    """Class, size in bytes and parameter-array count, and a few shape fields of ``model.args``."""
    leaves = mlx.utils.tree_flatten(model.parameters())
    args = getattr(model, "args", None)
    info: dict[str, Any] = {
        "class": f"{type(model).__module__}.{type(model).__name__}",
        "weight_bytes": sum(v.nbytes for _, v in leaves),
        "weight_arrays": len(leaves),
    }
    for name in ("model_type", "num_hidden_layers", "hidden_size", "vocab_size"):
        if hasattr(args, name):
            info[name] = getattr(args, name)
    return info


def run_bench(
    model: Any,
    tokenizer: Any,
    prompt_tokens: int = 512,
    gen_tokens: int = 128,
    *,
    warmup: bool = True,
    seed: int = 0,
    prefill_step_size: int = 512,
    kv_bits=None,
) -> dict[str, Any]:
    """Greedy generation of ``gen_tokens`` after a random ``prompt_tokens`` prompt (EOS ignored),
    after an untimed warm-up run that builds the kernels. Speeds in tokens/s, memory in GB."""
    if prompt_tokens < 1 or gen_tokens < 1:
        raise SamplingOptionsError(
            f"bench needs at least 1 prompt and 1 generated token, got {prompt_tokens}/{gen_tokens}"
        )
    prompt = random_prompt(tokenizer, prompt_tokens, seed)
    opts = dict(ignore_eos=True, prefill_step_size=prefill_step_size, kv_bits=kv_bits)
    if warmup:
        # one prefill and one decode step build every kernel the timed run uses
        for _ in stream_generate(model, tokenizer, prompt[:16], max_tokens=2, **opts):
            pass
    mx.clear_cache()
    start = time.perf_counter()
    first = last = None
    for response in stream_generate(model, tokenizer, prompt, max_tokens=gen_tokens, **opts):
        last = response
        if first is None:
            first = time.perf_counter() - start
    total = time.perf_counter() - start
    return {
        "prompt_tokens": last.prompt_tokens,
        "gen_tokens": last.generation_tokens,
        "prompt_tps": round(last.prompt_tps, 2),
        "decode_tps": round(last.generation_tps, 2),
        "ttft_s": round(first, 4),
        "total_s": round(total, 4),
        "peak_memory_gb": round(last.peak_memory, 4),
        "decode_step_ops": decode_step_ops(model, prompt[:1]),
        "kv_bits": list(parse_kv_bits(kv_bits)) if kv_bits is not None else None,
        "model": model_info(model),
        "device": str(mx.default_device()),
        "mlx_version": mx.__version__,
        "platform": platform.platform(),
    }
