"""Launch mapping of the decode attention kernel (``custom_kernels/decode_attention.py``) at
Gemma-4-26B-A4B's shapes, one token per row: (parts of the span, SIMD groups per part) against
the default ``split``, in interleaved rounds in one process.

Each evaluation runs ``--chain`` independent calls (fresh q per call) and is timed to its
completion, so per call it is close to the kernels' GPU time (the host builds the chain while
the GPU runs it). Prints us per call (median, min-max over rounds) and the ratio to the default,
checks every mapping's output against the default's (fp32 sums in another order: bf16 outputs
within 2 ulps), and writes JSON.

    python3 bench/attention_sweep.py --json bench/results/attention_sweep_h200.json
    python3 bench/attention_sweep.py --rounds 1 --chain 2      # CPU: reference only, smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf2q_mlx.custom_kernels import decode_attention as DA  # noqa: E402

# (label, Hq, Hk, D, capacity, window or None, position before the token, span)
SHAPES = [
    ("sliding pos 512", 16, 8, 256, 1032, 1024, 512, 1032),
    ("sliding pos 4096", 16, 8, 256, 1032, 1024, 4096, 1032),
    ("global pos 512", 16, 2, 512, 4096, None, 512, 1024),
    ("global pos 4096", 16, 2, 512, 8192, None, 4096, 8192),
]
MAPPINGS = [None, (4, 8), (8, 8), (16, 4), (16, 8), (32, 2), (32, 4), (64, 2), (64, 4)]


def run_shape(shape, a) -> dict:
    label, Hq, Hk, D, C, window, pos, span = shape
    dt = mx.bfloat16
    keys = (mx.random.normal((1, Hk, C, D)) * 0.5).astype(dt)
    values = (mx.random.normal((1, Hk, C, D)) * 0.5).astype(dt)
    qs = [(mx.random.normal((1, Hq, 1, D))).astype(dt) for _ in range(a.chain)]
    p = mx.array([pos], dtype=mx.int32)
    mx.eval(keys, values, qs)
    default_split = DA.split
    rates = {m: [] for m in MAPPINGS}
    outs = {}

    def with_mapping(m):
        DA.split = default_split if m is None else (lambda *_a, m=m: m)
        DA._plan.cache_clear()

    try:
        for m in MAPPINGS:  # warm-up: compile, and keep each mapping's output of q 0
            with_mapping(m)
            y = DA.decode_attention(qs[0], keys, values, p, D**-0.5, span, window)
            mx.eval(y)
            outs[m] = y
        for _ in range(a.rounds):
            for m in MAPPINGS:
                with_mapping(m)
                ys = [DA.decode_attention(q, keys, values, p, D**-0.5, span, window) for q in qs]
                tic = time.perf_counter()
                mx.eval(ys)
                rates[m].append((time.perf_counter() - tic) / a.chain * 1e6)
    finally:
        DA.split = default_split
        DA._plan.cache_clear()
    ref = outs[None].astype(mx.float32)
    tol = 2 * 2.0**-8 * mx.abs(ref).max().item()  # two bf16 ulps of the largest output
    rows = []
    base = statistics.median(rates[None])
    for m in MAPPINGS:
        med = statistics.median(rates[m])
        err = mx.abs(outs[m].astype(mx.float32) - ref).max().item()
        rows.append({"mapping": "default " + str(default_split(Hq, span, D)) if m is None
                     else str(m), "us": med, "min": min(rates[m]), "max": max(rates[m]),
                     "vs_default": base / med, "max_err": err, "ok": err <= tol})  # fmt: skip
    print(f"\n{label}: Hq {Hq}, Hk {Hk}, D {D}, span {span}, us per call over {a.rounds} rounds")
    for r in rows:
        ok = "ok" if r["ok"] else "DIFF"
        print(f"  {r['mapping']:<22} {r['us']:8.2f} [{r['min']:.2f}-{r['max']:.2f}]"
              f"  x{r['vs_default']:.2f}  err {r['max_err']:.2e} {ok}")  # fmt: skip
    return {"shape": label, "Hq": Hq, "Hk": Hk, "D": D, "span": span, "pos": pos, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--chain", type=int, default=64)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    results = [run_shape(s, a) for s in SHAPES]
    if a.json:
        Path(a.json).write_text(json.dumps({"device": str(mx.default_device()),
                                            "shapes": results}, indent=1))  # fmt: skip
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
