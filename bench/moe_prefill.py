"""MoE prefill: one layer's routed experts past the expert kernels' tokens, per prefill path
(HF2Q_EXPERT_PREFILL: custom_kernels/expert_matmul.py), A/B in one process.

The block is gate/up + activation, then down + gate-weighted sum, as ``models/ops.expert_glu``
and ``expert_down`` run them, at the 26B-A4B and 35B-A3B shapes with random Q4_K gate/up and
Q5_0 (26B) / Q4_K (35B) down experts (bench/moe_launches.py's recipe), bf16 x and random top-k
ids. For each T tokens per call, ``--rounds`` rounds; in each, every path runs once (the order
rotates between rounds) on fresh ids and gate weights (made and evaluated before the timer).
A timing is one ``mx.eval`` of the block, synchronised; the peak memory of a call is
mx.get_peak_memory after mx.reset_peak_memory, less the memory active before it.

Paths: dequant32 (every expert dequantized to fp32, gather_mm in fp32: the path before),
dequant (to bf16 in row slices, gather_mm in bf16; GPU only), grouped (the grouped tensor-core
kernels over slices of 32 tokens, each slice's inputs copied into buffers of their own; CUDA)
grouped-view (the same with the slices passed as views, HF2Q_GROUPED_SLICE_COPY=0: the
session-12 path, kept to show whether the views' offsets are what made it wrong), and
grouped-wide (the grouped kernels with a list of 4,096 pairs: one launch per 512 tokens at
top-8, each chosen expert read once per launch instead of once per 32 tokens). A path the
device cannot run prints "n/a". ``rel_err`` is each path's relative 2-norm difference from
dequant32's output on the warm-up call's ids (bf16 rounding: ~1e-3; a wrong path: ~1).

    python3 bench/moe_prefill.py --json bench/results/moe_prefill_h200.json
    python3 bench/moe_prefill.py --shapes gemma4:26b-a4b --tokens 256 4096 --rounds 7
    python3 bench/moe_prefill.py --tiny                   # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

from hf2q_mlx.custom_kernels import backend
from hf2q_mlx.custom_kernels import expert_matmul as EXM
from hf2q_mlx.models import ops

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_launches import SHAPES, ggml_experts  # noqa: E402  (bench/moe_launches.py)

PATHS = ("dequant32", "dequant", "grouped", "grouped-view", "grouped-wide")
# path -> (EXM.PREFILL, EXM.GROUPED_SLICE_COPY)
SWITCHES = {"dequant32": ("dequant32", True), "dequant": ("dequant", True),
            "grouped": ("grouped", True), "grouped-view": ("grouped", False),
            "grouped-wide": ("grouped-wide", True)}  # fmt: skip
TINY = {"tiny": (256, 8, 2, 64, "silu")}  # hidden, experts, top-k, expert width, activation


def runnable(path: str) -> bool:
    """Whether this device runs ``path`` as itself (not a fallback)."""
    if path == "dequant32":
        return True
    if path == "dequant":
        return backend() is not None
    return backend() == "cuda"


def build(shape: str, dtype: mx.Dtype):
    """-> (block(x, ids, weights), H, E, k): the routed experts of one layer at ``shape``."""
    H, E, k, F, act = {**SHAPES, **TINY}[shape]
    gate_up, down = ggml_experts(E, 2 * F, H, seed=1), ggml_experts(E, H, F, seed=2)
    mx.eval(gate_up.parameters(), down.parameters())

    def block(x: mx.array, ids: mx.array, weights: mx.array) -> mx.array:
        return ops.expert_down(ops.expert_glu(x, ids, gate_up, None, act), ids, weights, down)

    return block, H, E, k


def routes(T: int, E: int, k: int) -> tuple[mx.array, mx.array]:
    """Random top-k routing: (T, k) distinct uint32 ids, fp32 gate weights summing to 1."""
    ids = mx.argsort(mx.random.uniform(shape=(T, E)), axis=-1)[:, :k].astype(mx.uint32)
    w = mx.softmax(mx.random.normal((T, k)), axis=-1)
    mx.eval(ids, w)
    return ids, w


def timed_call(block, x, ids, w, path: str) -> tuple[float, float, mx.array]:
    """(microseconds, peak MB above the memory active before, output) of one call."""
    EXM.PREFILL, EXM.GROUPED_SLICE_COPY = SWITCHES[path]
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    y = block(x, ids, w)
    mx.eval(y)
    mx.synchronize()
    us = (time.perf_counter() - t0) * 1e6
    return us, (mx.get_peak_memory() - base) / 2**20, y


def rel_err(y: mx.array, ref: mx.array) -> float:
    d = (y.astype(mx.float32) - ref.astype(mx.float32)).square().sum()
    return float(mx.sqrt(d / ref.astype(mx.float32).square().sum()).item())


def bench_shape(shape: str, tokens: list[int], paths: list[str], rounds: int) -> list[dict]:
    block, H, E, k = build(shape, mx.bfloat16)
    rows = []
    for T in tokens:
        x = mx.random.normal((T, H)).astype(mx.bfloat16)
        mx.eval(x)
        live = [p for p in paths if runnable(p)]
        ids, w = routes(T, E, k)
        outs, errors = {}, {}
        for p in list(live):  # warm-up: plans, JIT; a path that fails is reported, not timed
            try:
                outs[p] = timed_call(block, x, ids, w, p)[2]
            except Exception as e:
                errors[p] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                live.remove(p)
        times = {p: [] for p in live}
        peaks = {p: [] for p in live}
        for r in range(rounds):
            order = live[r % len(live) :] + live[: r % len(live)]
            for p in order:
                ids, w = routes(T, E, k)
                us, mb, _ = timed_call(block, x, ids, w, p)
                times[p].append(us)
                peaks[p].append(mb)
        base = statistics.median(times["dequant32"]) if "dequant32" in times else None
        for p in paths:
            row = {"shape": shape, "T": T, "path": p}
            if p in times:
                med = statistics.median(times[p])
                row.update(
                    median_us=round(med, 1),
                    min_us=round(min(times[p]), 1),
                    max_us=round(max(times[p]), 1),
                    tok_s=round(T / med * 1e6, 1),
                    speedup_vs_dequant32=round(base / med, 3) if base else None,
                    peak_mb=round(max(peaks[p]), 1),
                    rel_err=rel_err(outs[p], outs["dequant32"]) if "dequant32" in outs else None,
                    rounds=[round(t, 1) for t in times[p]],
                )
            elif p in errors:
                row["error"] = errors[p]
            rows.append(row)
            print(format_row(row), flush=True)
        del outs
    return rows


def format_row(r: dict) -> str:
    head = f"{r['shape']:16} T={r['T']:<5} {r['path']:12}"
    if "median_us" not in r:
        return head + " n/a" + (f" ({r['error']})" if "error" in r else "")
    sp = r["speedup_vs_dequant32"]
    err = r["rel_err"]
    return (
        head
        + f" {r['median_us']:10.1f} us [{r['min_us']:.1f}-{r['max_us']:.1f}]"
        + f" {r['tok_s']:10.0f} tok/s"
        + (f"  x{sp:.2f} vs dequant32" if sp else "")
        + f"  peak +{r['peak_mb']:.0f} MB"
        + (f"  rel_err {err:.2e}" if err is not None else "")
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--tokens", nargs="+", type=int, default=[64, 256, 1024, 4096])
    ap.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="a small shape, T = 33 and 64 (CPU)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    shapes, tokens = (list(TINY), [33, 64]) if args.tiny else (args.shapes, args.tokens)
    paths = ["dequant32"] + [p for p in args.paths if p != "dequant32"]  # the ratios' base
    print(f"backend {backend()}, MLX {mx.__version__}, {args.rounds} rounds")
    rows = []
    saved = EXM.PREFILL, EXM.GROUPED_SLICE_COPY
    try:
        for shape in shapes:
            rows += bench_shape(shape, tokens, paths, args.rounds)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"mlx": mx.__version__, "backend": backend(), "rows": rows}, f,
                              indent=1)  # fmt: skip
    finally:
        EXM.PREFILL, EXM.GROUPED_SLICE_COPY = saved


if __name__ == "__main__":
    main()
