"""The MoE router kernel alone (custom_kernels/moe_router.py): one threadgroup per token row
(G = 1) against the split mapping (G threadgroups per row, the last one done ranks the logits),
at the Gemma-4-26B-A4B and Qwen3.5-35B-A3B router shapes.

    python3 bench/router_split.py                      # both shapes, B = 1, 8, 32
    python3 bench/router_split.py --profile --json bench/results/router_split.json
    python3 bench/router_split.py --shapes gemma4 --batch 1 --splits 8,16x8,32x8,64 --formats bf16
    python3 bench/router_split.py --profile --loop --batch 1   # the row's loads: one round / loop

Per (shape, weight format, B) it checks that every mapping gives the G = 1 outputs bit for bit,
then times them interleaved (ROUNDS rounds, each mapping once per round, so drift hits all
alike): `chain_us` is one mx.eval of CHAIN dependent router calls / CHAIN, synchronised.
Dependent because two launches of one plan must not run at once (they share the rows'
counters); Gemma's calls chain through the experts' norm output xn (no extra op), Qwen's through
one compiled elementwise op on the weights (the same for every mapping). It includes MLX's host
cost per call. With --profile, `gpu_us` is the kernel duration CUPTI records (torch.profiler),
median over the profiled calls. Prints median [min, max] over rounds; --json writes every number.

Formats: bf16 (a bf16 model's router), f32 (a GGUF's F32 router under bf16 x), q8 (the MLX 4-bit
builds' 8-bit affine router, group 64). "auto" is the dispatcher's split_config choice; --splits
adds mappings (G threadgroups per row, or GxW with W SIMD groups each) to tune it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import datetime, timezone

import mlx.core as mx

from hf2q_mlx.custom_kernels import moe_router as R

SHAPES = {"gemma4": (2816, 128, 8), "qwen3_5": (2048, 256, 8)}  # D, E, k (26B-A4B, 35B-A3B)
ROUNDS = 7
CHAIN = 32


def router_args(shape: str, fmt: str) -> dict:
    """The router's weight and options as the model passes them, random at the real shape."""
    D, E, _ = SHAPES[shape]
    keys = mx.random.split(mx.random.key(0), 4)
    w = mx.random.normal((E, D), key=keys[0]) * D**-0.5
    a = {"w": w.astype(mx.float32 if fmt == "f32" else mx.bfloat16)}
    if fmt == "q8":
        wq, scales, biases = mx.quantize(a["w"], group_size=64, bits=8)
        a.update(w=wq, quant=(scales, biases, 64, 8))
    if shape == "gemma4":
        u = [mx.random.uniform(shape=(n,), key=kk) for n, kk in ((D, keys[1]), (E, keys[2]))]
        a.update(eps=1e-6, pre_scale=(0.75 + 0.5 * u[0]).astype(mx.bfloat16), pre_mult=D**-0.5,
                 expert_scale=(0.5 + u[1]).astype(mx.bfloat16),
                 post_norm=(0.75 + 0.5 * mx.random.uniform(shape=(D,), key=keys[3])).astype(
                     mx.bfloat16))  # fmt: skip
    else:
        a.update(renormalize=True)
    mx.eval([v for v in a.values() if isinstance(v, mx.array)], *a.get("quant", ())[:2])
    return a


def mappings(rows: int, E: int, D: int, splits: list[str]) -> dict[str, object]:
    """name -> split argument: G = 1, the dispatcher's choice, and any extra "G" or "GxW" (W
    SIMD groups per threadgroup) asked for."""
    g, warps = R.split_config(rows, E, D)
    out = {"G=1": 1, f"auto(G={g},W={warps})": (g, warps)}
    for s in splits:
        gs, _, ws = s.partition("x")
        m = R._mapping(E, (int(gs), int(ws)) if ws else int(gs)) if int(gs) <= E else None
        if m is not None and m[0] > 1 and m != (g, warps):
            out[f"G={m[0]},W={m[1]}"] = m
    return out


_nudge = mx.compile(lambda x, wts: x + (wts[:, :1] * 1e-3).astype(x.dtype))


def chain(run, x: mx.array, w: mx.array, n: int) -> list[mx.array]:
    """n dependent calls: each one's x is made from the previous call's outputs."""
    for _ in range(n):
        ids, wts, xn = run(x, w)
        x = xn if xn is not None else _nudge(x, wts)
    return [ids, wts, x]


def wall_us(run, x: mx.array, w: mx.array) -> float:
    t0 = time.perf_counter()
    mx.eval(chain(run, x, w, CHAIN))
    mx.synchronize()
    return (time.perf_counter() - t0) / CHAIN * 1e6


def gpu_us(run, x: mx.array, w: mx.array) -> float | None:
    """Median CUPTI duration of the router's kernels over CHAIN dependent calls; None without
    torch."""
    try:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return None
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        mx.eval(chain(run, x, w, CHAIN))
        mx.synchronize()
    times = [e.time_range.elapsed_us() for e in prof.events()
             if e.device_type == DeviceType.CUDA and "moe_router" in e.name]  # fmt: skip
    return statistics.median(times) if times else None


def summary(v: list[float]) -> dict:
    return {"median": statistics.median(v), "min": min(v), "max": max(v)}


def bench_case(
    shape: str, fmt: str, rows: int, splits: list[str], profile: bool, loop: bool = False
) -> dict:
    D, E, k = SHAPES[shape]
    a = router_args(shape, fmt)
    w = a.pop("w")
    x = (3 * mx.random.normal((rows, D), key=mx.random.key(rows))).astype(mx.bfloat16)
    runs, keep = {}, R.BATCHED_PROLOGUE
    try:
        for batched in (True, False) if loop else (keep,):
            R.BATCHED_PROLOGUE = batched  # read when each plan is built
            for n, s in mappings(rows, E, D, splits).items():
                name = n if batched or not loop else f"{n} loop"
                runs[name] = R.plan_launcher(x, w, k, split=s, **a)
    finally:
        R.BATCHED_PROLOGUE = keep
    base = [o for o in runs["G=1"](x, w) if o is not None]
    mx.eval(base)
    same = {}
    for name, run in runs.items():  # correctness first, and warm-up (builds)
        got = [o for o in run(x, w) if o is not None]
        mx.eval(got)
        same[name] = all(mx.array_equal(p, q).item() for p, q in zip(got, base))
        wall_us(run, x, w)
    walls = {n: [] for n in runs}
    for _ in range(ROUNDS):
        for name, run in runs.items():
            walls[name].append(wall_us(run, x, w))
    out = {}
    for name, run in runs.items():
        out[name] = {"chain_us": summary(walls[name]), "bit_identical": same[name]}
        if profile:
            out[name]["gpu_us"] = gpu_us(run, x, w)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--formats", default="bf16,f32,q8")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--splits", default="", help="extra mappings: G or GxW, e.g. 16,16x8,64")
    ap.add_argument("--profile", action="store_true", help="kernel times via torch.profiler")
    ap.add_argument("--loop", action="store_true",
                    help="each mapping also with the row's loads in the loop form "
                         "(HF2Q_ROUTER_BATCHED=0), named '<mapping> loop'")  # fmt: skip
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    splits = [s for s in args.splits.split(",") if s]
    results = []
    for shape in args.shapes.split(","):
        for fmt in args.formats.split(","):
            for rows in args.batch:
                case = bench_case(shape, fmt, rows, splits, args.profile, args.loop)
                results.append({"shape": shape, "format": fmt, "rows": rows, "mappings": case})
                for name, r in case.items():
                    c = r["chain_us"]
                    gpu = r.get("gpu_us")
                    print(f"{shape:8s} {fmt:5s} B={rows:<3d} {name:23s} chain "
                          f"{c['median']:7.2f} us [{c['min']:.2f}, {c['max']:.2f}]"
                          + ("" if gpu is None else f"  gpu {gpu:6.2f} us")
                          + ("" if r["bit_identical"] else "  OUTPUTS DIFFER FROM G=1"),
                          flush=True)  # fmt: skip
    if args.json:
        meta = {"date": datetime.now(timezone.utc).isoformat(), "rounds": ROUNDS, "chain": CHAIN,
                "device": str(mx.default_device())}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
