"""Greedy decoding of a real GGUF with the GPU kernels and with the reference path, side by side.

    python3 bench/kernels_vs_reference.py MODEL.gguf [--tokens 32] [--json OUT.json]
                                             [--expect CPU.json] [--dtype float32]

Checks the tokens are identical (the kernels must not change a greedy continuation) and reports
decode tokens/s of both paths measured in the same run. Meant for a GPU; on the CPU both paths
are the reference. ``--expect`` takes the JSON of a CPU run of the same model and token count
and checks the kernel path's tokens against it too (the GPU giving the CPU's tokens); the CPU
runs float32 by default and a GPU bfloat16, so compare like with like (``--dtype``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

# isort: off
import hf2q_mlx  # before mlx.core: it routes MLX's CPU matmuls to a fast BLAS
# isort: on

import mlx.core as mx

from hf2q_mlx.custom_kernels import backend, reference_only

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
]


def greedy(model, tokenizer, prompt: str, n: int) -> tuple[list[int], float]:
    tokens, last = [], None
    for last in hf2q_mlx.stream_generate(model, tokenizer, prompt, max_tokens=n, ignore_eos=True):
        tokens.append(last.token)
    return tokens, last.generation_tps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--json", default=None)
    ap.add_argument("--expect", default=None, help="a CPU run's --json: its tokens must match")
    ap.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: load's)")
    args = ap.parse_args()
    expected = {}
    if args.expect:
        with open(args.expect) as f:
            cpu = json.load(f)
        if cpu.get("dtype", "default") != (args.dtype or "default"):
            print(f"note: --expect ran in dtype {cpu.get('dtype', 'default')}, this run in "
                  f"{args.dtype or 'default'}")  # fmt: skip
        if cpu["tokens"] != args.tokens:
            ap.error(f"--expect holds {cpu['tokens']} tokens a prompt, not {args.tokens}")
        expected = {row["prompt"]: row["kernel_tokens"] for row in cpu["rows"]}
        if missing := [p for p in PROMPTS if p not in expected]:
            ap.error(
                f"--expect has no tokens for {len(missing)} of the prompts, e.g. {missing[0]!r}"
            )
    t0 = time.perf_counter()
    model, tokenizer = hf2q_mlx.load(args.model, dtype=args.dtype)
    print(f"loaded in {time.perf_counter() - t0:.1f} s; kernel backend: {backend()}")
    rows, same = [], True
    for prompt in PROMPTS:
        greedy(model, tokenizer, prompt, 2)  # warm-up: builds the kernels
        fast, fast_tps = greedy(model, tokenizer, prompt, args.tokens)
        with reference_only():
            greedy(model, tokenizer, prompt, 2)
            ref, ref_tps = greedy(model, tokenizer, prompt, args.tokens)
        match = fast == ref
        cpu_match = expected[prompt] == fast if expected else None  # None: no CPU run given
        same &= match and cpu_match is not False
        rows.append(
            dict(prompt=prompt, match=match, cpu_match=cpu_match, kernel_tps=fast_tps,
                 reference_tps=ref_tps,
                 text=tokenizer.decode(fast), kernel_tokens=fast, reference_tokens=ref)
        )  # fmt: skip
        verdict = ("SAME" if match else "DIFFERENT") + (
            "" if cpu_match is not False else ", NOT the CPU's"
        )
        print(f"{verdict} tokens | kernels {fast_tps:7.1f} tok/s | reference {ref_tps:7.1f} tok/s"
              f" | {prompt!r} -> {tokenizer.decode(fast)!r}")  # fmt: skip
    result = dict(model=args.model, backend=backend(), device=str(mx.default_device()),
                  dtype=args.dtype or "default", tokens=args.tokens, all_same=same,
                  rows=rows)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    against = " and to the CPU run" if expected else ""
    print(f"all greedy continuations identical{against}" if same else "MISMATCH")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
