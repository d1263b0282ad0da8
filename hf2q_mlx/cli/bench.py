"""Prompt and decode speed of a loaded model, measured through ``stream_generate``."""

from __future__ import annotations

import io
import platform
import re
import sys
import time
from typing import Any

import mlx.core as mx
import mlx.utils

from hf2q_mlx.errors import SamplingOptionsError
from hf2q_mlx.generation import make_prompt_cache, parse_kv_bits, prefill, stream_generate


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


def _cpu_blas() -> str | None:
    """The BLAS MLX's CPU matmuls go through when hf2q_mlx routed them (cpu_blas), else None."""
    from hf2q_mlx.custom_kernels import cpu_blas

    return cpu_blas.enable() if cpu_blas.routed() else None


def check_bench_options(prompt_tokens: Any, gen_tokens: Any) -> None:
    """Raise SamplingOptionsError unless both counts are integers >= 1."""
    for name, value in (("prompt_tokens", prompt_tokens), ("gen_tokens", gen_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SamplingOptionsError(f"bench {name} must be an integer >= 1, got {value!r}")


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
    progress: bool = False,
) -> dict[str, Any]:
    """Greedy generation of ``gen_tokens`` after a random ``prompt_tokens`` prompt (EOS ignored),
    after an untimed warm-up run that builds the kernels. Speeds in tokens/s, memory in GB.
    ``progress`` shows a bar with an ETA on stderr (prompt and generated tokens)."""
    from tqdm import tqdm

    check_bench_options(prompt_tokens, gen_tokens)
    prompt = random_prompt(tokenizer, prompt_tokens, seed)
    opts = dict(ignore_eos=True, prefill_step_size=prefill_step_size, kv_bits=kv_bits)
    bar = tqdm(
        total=prompt_tokens + gen_tokens,
        desc="bench: warm-up",
        unit="tok",
        file=sys.stderr,
        disable=not progress,
        leave=False,
    )
    with bar:
        if warmup:
            # one prefill and one decode step build every kernel the timed run uses
            for _ in stream_generate(model, tokenizer, prompt[:16], max_tokens=2, **opts):
                pass
        mx.clear_cache()
        bar.set_description(f"bench: prefill {prompt_tokens} + decode {gen_tokens}")
        start = time.perf_counter()
        first = last = None
        for response in stream_generate(model, tokenizer, prompt, max_tokens=gen_tokens, **opts):
            last = response
            if first is None:
                first = time.perf_counter() - start
            bar.update(prompt_tokens + 1 if response.generation_tokens == 1 else 1)
        total = time.perf_counter() - start
        bar.set_description("bench: counting ops")
        ops = decode_step_ops(model, prompt[:1])
    return {
        "prompt_tokens": last.prompt_tokens,
        "gen_tokens": last.generation_tokens,
        "prompt_tps": round(last.prompt_tps, 2),
        "decode_tps": round(last.generation_tps, 2),
        "ttft_s": round(first, 4),
        "total_s": round(total, 4),
        "peak_memory_gb": round(last.peak_memory, 4),
        "decode_step_ops": ops,
        "kv_bits": list(parse_kv_bits(kv_bits)) if kv_bits is not None else None,
        "model": model_info(model),
        "device": str(mx.default_device()),
        "cpu_blas": _cpu_blas(),
        "mlx_version": mx.__version__,
        "platform": platform.platform(),
    }
