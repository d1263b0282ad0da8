"""Launch mapping of the decode attention kernel (``custom_kernels/decode_attention.py``) at
Gemma-4-26B-A4B's and Qwen3.5-35B-A3B's shapes, one token per row: (parts of the span, SIMD
groups per part), the load variants (HF2Q_ATTN_LOADS letters) and the virtual SIMD groups
(HF2Q_ATTN_VW, the same bits) against the default, at one or more batch sizes, in interleaved
rounds in one process.

Each evaluation runs ``--chain`` independent calls (fresh q per call) and is timed to its
completion, so per call it is close to the kernels' GPU time (the host builds the chain while
the GPU runs it); ``--profile`` adds the CUPTI kernel time (torch.profiler), the number to
compare at one row. Prints us per call (median, min-max over rounds) and the ratio to the
default, checks every variant's output against the default's (fp32 sums in another order:
bf16 outputs within 2 ulps), and writes JSON. A mapping is a function of the model's shape
only (row parity), so one mapping has to serve every batch size.

    python3 bench/attention_sweep.py --json bench/results/attention_sweep_h200.json
    python3 bench/attention_sweep.py --batch 1 32 --loads "" vp --profile --chain 16
    python3 bench/attention_sweep.py --batch 8 32 --vws "" 1 2 4 8 --mappings "" --profile
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qmatmul import Profiler  # noqa: E402

# (label, Hq, Hk, D, capacity, window or None, position before the token, span)
SHAPES = [
    ("sliding pos 512", 16, 8, 256, 1032, 1024, 512, 1032),
    ("sliding pos 4096", 16, 8, 256, 1032, 1024, 4096, 1032),
    ("global pos 512", 16, 2, 512, 4096, None, 512, 1024),
    ("global pos 4096", 16, 2, 512, 8192, None, 4096, 8192),
    # bench/decode_profile.py's step: a 512-token prompt, 544 slots (26B-A4B, 35B-A3B full)
    ("sliding step 544", 16, 8, 256, 544, 1024, 528, 544),
    ("global step 544", 16, 2, 512, 544, None, 528, 544),
    ("35b full step 544", 16, 2, 256, 544, None, 528, 544),
]
MAPPINGS = [None, (4, 8), (8, 8), (16, 4), (16, 8), (32, 2), (32, 4), (64, 2), (64, 4)]


def _mappings(text: str | None) -> list:
    """--mappings "4,8 8,8": (parts, groups) pairs after the default (None); "": the default
    alone; unset: the built-in list."""
    if text is None:
        return MAPPINGS
    return [None] + [tuple(int(v) for v in m.split(",")) for m in text.split()]


def run_shape(shape, a, batch: int) -> dict:
    label, Hq, Hk, D, C, window, pos, span = shape
    dt = mx.bfloat16
    keys = (mx.random.normal((batch, Hk, C, D)) * 0.5).astype(dt)
    values = (mx.random.normal((batch, Hk, C, D)) * 0.5).astype(dt)
    qs = [(mx.random.normal((batch, Hq, 1, D))).astype(dt) for _ in range(a.chain)]
    p = mx.array([pos] * batch, dtype=mx.int32)
    mx.eval(keys, values, qs)
    default_split = DA.split
    mappings = _mappings(a.mappings)
    # (None, "", "") first: the default
    variants = [(m, lo, vw) for vw in a.vws for lo in a.loads for m in mappings]
    rates = {v: [] for v in variants}
    gpu = {v: [] for v in variants}
    outs = {}

    def with_variant(v):
        m, lo, vw = v
        DA.split = default_split if m is None else (lambda *_a, m=m: m)
        DA.LOADS_RAW = lo
        DA.VW_OVERRIDE = vw
        DA._plan.cache_clear()

    try:
        for v in variants:  # warm-up: compile, and keep each variant's output of q 0
            with_variant(v)
            y = DA.decode_attention(qs[0], keys, values, p, D**-0.5, span, window)
            mx.eval(y)
            outs[v] = y
        for _ in range(a.rounds):
            for v in variants:
                with_variant(v)
                with Profiler(a.profile) as prof:
                    ys = [DA.decode_attention(q, keys, values, p, D**-0.5, span, window)
                          for q in qs]  # fmt: skip
                    tic = time.perf_counter()
                    mx.eval(ys)
                    mx.synchronize()
                    rates[v].append((time.perf_counter() - tic) / a.chain * 1e6)
                us = prof.median_us("decode_attention")
                if us is not None:
                    gpu[v].append(us)
    finally:
        DA.split = default_split
        DA.LOADS_RAW = ""
        DA.VW_OVERRIDE = ""
        DA._plan.cache_clear()
    ref = outs[variants[0]].astype(mx.float32)
    tol = 2 * 2.0**-8 * mx.abs(ref).max().item()  # two bf16 ulps of the largest output
    rows = []
    base = statistics.median(rates[variants[0]])
    gbase = statistics.median(gpu[variants[0]]) if gpu[variants[0]] else None
    for v in variants:
        m, lo, vw = v
        med = statistics.median(rates[v])
        g = statistics.median(gpu[v]) if gpu[v] else None
        err = mx.abs(outs[v].astype(mx.float32) - ref).max().item()
        name = "default " + str(default_split(Hq, span, D)) if m is None else str(m)
        rows.append({"mapping": name, "loads": lo, "vw": vw, "us": med, "min": min(rates[v]),
                     "max": max(rates[v]), "vs_default": base / med, "gpu_us": g,
                     "gpu_vs_default": gbase / g if g and gbase else None,
                     "max_err": err, "ok": err <= tol})  # fmt: skip
    print(f"\n{label}, batch {batch}: Hq {Hq}, Hk {Hk}, D {D}, span {span}, us per call over "
          f"{a.rounds} rounds (wall of a chain of {a.chain}; gpu: CUPTI median)")  # fmt: skip
    for r in rows:
        ok = "ok" if r["ok"] else "DIFF"
        g = f"  gpu {r['gpu_us']:8.2f} x{r['gpu_vs_default']:.2f}" if r["gpu_us"] else ""
        span_us = f"{r['us']:8.2f} [{r['min']:.2f}-{r['max']:.2f}]  x{r['vs_default']:.2f}"
        print(f"  {r['mapping']:<16} {r['loads'] or '-':<3} vw {r['vw'] or '-':<2} {span_us}{g}  "
              f"err {r['max_err']:.2e} {ok}")  # fmt: skip
    return {"shape": label, "batch": batch, "Hq": Hq, "Hk": Hk, "D": D, "span": span,
            "pos": pos, "rows": rows}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--chain", type=int, default=64)
    ap.add_argument("--batch", type=int, nargs="+", default=[1], help="rows a call (each)")
    ap.add_argument("--loads", nargs="+", default=[""], help='HF2Q_ATTN_LOADS values ("" vp)')
    ap.add_argument("--mappings", default=None, help='"P,W P,W ..." instead of the built-in list')
    ap.add_argument("--vws", nargs="+", default=[""], help='HF2Q_ATTN_VW values ("": the rule)')
    ap.add_argument("--shapes", default=None, help="labels' substrings, comma-separated")
    ap.add_argument("--profile", action="store_true", help="CUPTI kernel time (torch.profiler)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    for lo in a.loads:
        DA.load_flags(lo)  # a bad value fails here, once
    keep = [s for s in SHAPES if not a.shapes or any(k in s[0] for k in a.shapes.split(","))]
    results = [run_shape(s, a, b) for b in a.batch for s in keep]
    if a.json:
        Path(a.json).write_text(json.dumps({"device": str(mx.default_device()),
                                            "shapes": results}, indent=1))  # fmt: skip
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
