"""The CPU's one-op RMS norm and RoPE (custom_kernels/cpu_ext/fused_ops.cpp) against MLX's
fallbacks of mx.fast.rms_norm / mx.fast.rope (``HF2Q_CPU_FUSED=0``), interleaved rounds in one
process on a real GGUF: decode tok/s (greedy, after a short prompt and after a long one) and
prefill tok/s, medians and ranges, saved as JSON.

    python3 bench/cpu_fused_ab.py OUT.json --model SmolLM2-135M-Instruct.Q4_1.gguf --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf2q_mlx import load, stream_generate  # noqa: E402  (before mlx: the CPU BLAS routing)

SETTINGS = {"fused": "1", "mlx": "0"}


def one(model, tokenizer, prompt: list[int], gen: int) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) of one greedy generation."""
    *_, last = stream_generate(model, tokenizer, prompt, max_tokens=gen)
    return last.prompt_tps, last.generation_tps


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="JSON file to write")
    p.add_argument("--model", required=True, help="a GGUF file or model folder")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--gen", type=int, default=64, help="tokens decoded a run")
    a = p.parse_args(argv)
    model, tokenizer = load(a.model)
    vocab = 1000
    prompts = {"p16": [(7 * i + 3) % vocab + 10 for i in range(16)],
               "p512": [(11 * i + 5) % vocab + 10 for i in range(512)]}  # fmt: skip
    rows: dict[str, list[float]] = {}
    for value in SETTINGS.values():  # warm both
        os.environ["HF2Q_CPU_FUSED"] = value
        one(model, tokenizer, prompts["p16"], 8)
    for r in range(a.rounds):
        line = []
        for name, value in SETTINGS.items():
            os.environ["HF2Q_CPU_FUSED"] = value
            for pname, prompt in prompts.items():
                pre, dec = one(model, tokenizer, prompt, a.gen)
                rows.setdefault(f"{name} decode {pname}", []).append(dec)
                if pname == "p512":
                    rows.setdefault(f"{name} prefill 512", []).append(pre)
                line.append(f"{name} {pname} {dec:.1f}")
        print(f"round {r}: " + ", ".join(line), flush=True)
    summary = {}
    for key, vals in rows.items():
        summary[key] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
        print(f"  {key:24s} {summary[key]['median']:8.1f}  [{min(vals):.1f}-{max(vals):.1f}]")
    for kind in ("decode p16", "decode p512", "prefill 512"):
        f, m = rows[f"fused {kind}"], rows[f"mlx {kind}"]
        ratios = [x / y for x, y in zip(f, m)]
        summary[f"ratio {kind}"] = {"median": statistics.median(ratios), "min": min(ratios),
                                    "max": max(ratios)}  # fmt: skip
        print(f"  fused / mlx {kind:12s} {statistics.median(ratios):.2f}x "
              f"[{min(ratios):.2f}-{max(ratios):.2f}]")  # fmt: skip
    Path(a.out).write_text(json.dumps({"model": a.model, "rounds": a.rounds, "gen": a.gen,
                                       "summary": summary, "rows": rows}, indent=1))  # fmt: skip
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
