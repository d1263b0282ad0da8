"""The serving engine's two decode steps side by side (``hf2q-mlx serve --step``): the compiled
batched ``DecodeStep`` (all ``--max-batch`` rows every step, busy or not) against
``SequentialStep`` (one row at a time), through ``BatchGenerator`` with 1 and with max-batch
greedy streams; interleaved rounds in one process, aggregate tok/s (prefill included) as median
[min-max]. Made for the CPU, where ``--step auto`` picks the per-row step. Prints and writes JSON.

    python3 bench/cpu_step_ab.py OUT.json --model smollm2-135m-instruct --max-batch 8 --rounds 3
"""

from __future__ import annotations

# isort: off
import hf2q_mlx  # before mlx.core: it routes MLX's CPU matmuls to a fast BLAS (cpu_blas.py)

# isort: on
import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx

from hf2q_mlx import BatchGenerator


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("out", help="JSON file for the results")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    model, tokenizer = hf2q_mlx.load(a.model)
    prompts = [f"Write a short story number {i} about a cat." for i in range(a.max_batch)]
    steps = {"sequential": False, "batched": True}
    gens = {
        name: BatchGenerator(model, tokenizer, max_batch=a.max_batch, compiled=compiled,
                             prefix_cache_bytes=0)
        for name, compiled in steps.items()
    }  # fmt: skip
    for g in gens.values():  # warm-up: the compiled step traces once
        g.generate(prompts[:2], max_tokens=4, temperature=0)
    rates: dict[str, list[float]] = {}
    try:
        for r in range(a.rounds):
            for n in (1, a.max_batch):
                for name, g in gens.items():
                    tic = time.perf_counter()
                    g.generate(prompts[:n], max_tokens=a.tokens, temperature=0, ignore_eos=True)
                    rate = n * a.tokens / (time.perf_counter() - tic)
                    rates.setdefault(f"{n} streams, {name}", []).append(rate)
                    print(f"round {r}: {n} streams, {name}: {rate:.1f} tok/s", flush=True)
    finally:
        for g in gens.values():
            g.close()
    for key, v in rates.items():
        print(f"{key}: {statistics.median(v):.1f} tok/s [{min(v):.1f}-{max(v):.1f}]")
    result = {"model": a.model, "max_batch": a.max_batch, "tokens": a.tokens, "rounds": a.rounds,
              "device": str(mx.default_device()), "tok_per_s": rates}  # fmt: skip
    Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
