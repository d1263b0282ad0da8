"""Launch configurations of the routed-expert kernels at the MoE shapes, B = 1, 8, 32 tokens.

Times the per-pair kernels (custom_kernels/expert_glu.py gate/up + activation,
custom_kernels/expert_down.py down + weighted sum) over a grid of (R, U, W), the down kernel's
slot-parallel mapping ("down_slots": a token's k slots over S teams of W SIMD groups) over
(R, U, W, S), and the grouped tensor-core ones (custom_kernels/expert_mma.py) over (NT, U, W)
(the prefill's wide ones, "wide_glu" / "wide_down", up to 512 tokens: per-pair kernels only run
to 32 tokens, the 32-token grouped ones to 256 pairs),
each against its kernel's default configuration ("down_slots" against the per-pair down
kernel's default, today's mapping), on random Q4_K / Q5_0 experts (the bench/moe_launches.py
recipe) and random top-k ids. Weights rotate over COPIES layers' worth and each call draws
fresh ids, so the selected experts stream from HBM as in a decode step, not from L2.

U and W set the order of a row's sums (a token's output bits), so a default may depend on
(type, N, K) only, never on the tokens: the summary picks, per kernel and shape, the (U, W)
with the lowest summed time over the batch sizes, and R (or NT; R and S for "down_slots",
whose bits do not depend on them) per batch size.

Timing: median over repetitions of (one mx.eval of CALLS independent calls) / CALLS,
synchronised: it includes MLX's per-launch host cost (~5 us), so it is the rate a decode step
sees, not the kernel's duration alone.

    python3 bench/expert_sweep.py --json bench/results/expert_sweep_h200.json
    python3 bench/expert_sweep.py --shapes gemma4:26b-a4b --batch 1 --budget 60
    python3 bench/expert_sweep.py --kernels down down_slots --json OUT.json  # old vs new down
    python3 bench/expert_sweep.py --kernels grouped_glu grouped_down wide_glu wide_down \
        --batch 32 512 --json OUT.json                      # the prefill's wide kernels
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

from hf2q_mlx.custom_kernels import expert_down as D
from hf2q_mlx.custom_kernels import expert_glu as G
from hf2q_mlx.custom_kernels import expert_mma as X
from hf2q_mlx.custom_kernels import qmatmul as Q
from hf2q_mlx.custom_kernels import qmatmul_mma as MM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_launches import SHAPES, ggml_experts  # noqa: E402  (bench/moe_launches.py)

COPIES = 3  # layers of experts the calls rotate over
CALLS = 24  # calls per evaluation
PER_PAIR = [dict(R=r, U=u, W=w) for r, u, w in itertools.product((2, 4), (1, 2), (1, 2, 4))]
GROUPED = [dict(NT=n, U=u, W=w) for n, u, w in itertools.product((1, 2), (1, 2), (2, 4))]
# the slot-parallel down kernel: S teams of W SIMD groups, 8 SIMD groups at most
SLOTS = [dict(R=r, U=u, W=w, S=s)
         for r, u, w, s in itertools.product((2, 4, 8), (1, 2), (1, 2), (2, 4, 8))
         if w * s <= 8]  # fmt: skip
# the prefill's wide grouped kernels (a 4,096-pair list; HF2Q_EXPERT_PREFILL=grouped-wide)
WIDE = [dict(NT=n, U=u, W=w) for n, u, w in itertools.product((1, 2, 4), (1, 2), (2, 4))]
KERNELS = ("glu", "down", "down_slots", "grouped_glu", "grouped_down", "wide_glu", "wide_down")


def experts(E: int, rows: int, cols: int, seed: int) -> tuple[mx.array, int]:
    """(blocks (E, rows, row_bytes), type): bench/moe_launches.py's random experts."""
    m = ggml_experts(E, rows, cols, seed)
    return m.weight, int(m.ggml_type)


def random_ids(B: int, E: int, k: int) -> mx.array:
    """(B, k) distinct experts per token, uint32."""
    return mx.argsort(mx.random.uniform(shape=(B, E)), axis=-1)[:, :k].astype(mx.uint32)


def timed(fns, reps: int) -> float:
    """fns: callables (one per weight copy) -> median microseconds per call."""
    for f in fns:
        mx.eval(f())
    mx.synchronize()
    walls = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval([fns[i % len(fns)]() for i in range(CALLS)])
        mx.synchronize()
        walls.append((time.perf_counter() - t0) / CALLS * 1e6)
    return statistics.median(walls)


def calls(grouped_fn, per_pair_fn, arg_sets):
    """-> make(cfg, grouped): one callable per weight copy, each running the kernel once."""

    def make(cfg, grouped=False):
        f = grouped_fn if grouped else per_pair_fn
        return [lambda a=a: f(*a, config=cfg) for a in arg_sets]

    return make


def sweep_shape(
    shape: str, batches: list[int], reps: int, deadline: float, which=KERNELS
) -> list[dict]:
    H, E, k, F, act = SHAPES[shape]
    gu = [experts(E, 2 * F, H, seed=10 + c) for c in range(COPIES)]
    dn = [experts(E, H, F, seed=20 + c) for c in range(COPIES)]
    t_gu, t_dn = gu[0][1], dn[0][1]
    rows = []
    for B in batches:
        ids = [random_ids(B, E, k) for _ in range(COPIES)]
        wts = [mx.random.uniform(shape=(B, k)) for _ in range(COPIES)]
        x = mx.random.normal((B, H)).astype(mx.bfloat16)
        h = mx.random.normal((B, k, F)).astype(mx.bfloat16)
        mx.eval(ids, wts, x, h)

        glu = calls(X.grouped_expert_glu, G.expert_glu_kernel,
                    [(x, g[0], i, t_gu, H, act) for g, i in zip(gu, ids)])  # fmt: skip
        down = calls(X.grouped_expert_down, D.expert_down_kernel,
                     [(h, d[0], i, w, t_dn, F) for d, i, w in zip(dn, ids, wts)])  # fmt: skip
        slots = [c for c in SLOTS if c["S"] <= k]  # more teams than slots would idle
        kernels = []
        if B <= G.MAX_TOKENS:  # the per-pair kernels' reach
            kernels += [("glu", glu, PER_PAIR, False), ("down", down, PER_PAIR, False),
                        ("down_slots", down, slots, False)]  # fmt: skip
        mma_ok = MM.supports(t_gu, mx.bfloat16, glu=True) and MM.supports(t_dn, mx.bfloat16)
        if B * k <= X.MAX_PAIRS and mma_ok:
            kernels += [("grouped_glu", glu, GROUPED, True), ("grouped_down", down, GROUPED, True)]
        if B * k <= X.WIDE_LIST and mma_ok:
            wglu = calls(functools.partial(X.grouped_expert_glu, wide=True), None,
                         [(x, g[0], i, t_gu, H, act) for g, i in zip(gu, ids)])  # fmt: skip
            wdown = calls(functools.partial(X.grouped_expert_down, wide=True), None,
                          [(h, d[0], i, w, t_dn, F) for d, i, w in zip(dn, ids, wts)])  # fmt: skip
            kernels += [("wide_glu", wglu, WIDE, True), ("wide_down", wdown, WIDE, True)]
        for name, make, grid, grouped in kernels:
            if name not in which:
                continue
            base = timed(make(None, grouped), reps)
            row = {"shape": shape, "kernel": name, "B": B, "default_us": base, "configs": []}
            for cfg in grid:
                if time.perf_counter() > deadline:
                    break
                try:
                    us = timed(make(cfg, grouped), reps)
                except Exception as e:  # an invalid combination for this shape: skip it
                    row["configs"].append({**cfg, "error": str(e).splitlines()[0][:80]})
                    continue
                row["configs"].append({**cfg, "us": us})
            ok = [c for c in row["configs"] if "us" in c]
            best = min(ok, key=lambda c: c["us"]) if ok else None
            row["best"] = best
            print(f"{shape:16} B={B:<3} {name:13} default {base:8.1f} us   best "
                  + (f"{best['us']:8.1f} us {({a: b for a, b in best.items() if a != 'us'})}"
                     if best else "-"), flush=True)  # fmt: skip
            rows.append(row)
    return rows


def summarize(rows: list[dict]) -> None:
    """Per (shape, kernel): the (U, W) with the lowest time summed over the batch sizes (each
    B at its best R or NT), against the defaults' sum."""
    for shape, kernel in sorted({(r["shape"], r["kernel"]) for r in rows}):
        mine = [r for r in rows if r["shape"] == shape and r["kernel"] == kernel]
        inner = ("NT",) if kernel.startswith(("grouped", "wide")) else ("R",)
        inner += ("S",) if kernel == "down_slots" else ()
        totals = {}
        for r in mine:
            best_at = {}
            for c in r["configs"]:
                if "us" in c:
                    uw = (c["U"], c["W"])
                    best_at[uw] = min(best_at.get(uw, float("inf")), c["us"])
            for uw, us in best_at.items():
                totals.setdefault(uw, []).append(us)
        full = {uw: sum(v) for uw, v in totals.items() if len(v) == len(mine)}
        if not full:
            continue
        uw = min(full, key=full.get)
        base = sum(r["default_us"] for r in mine)
        per_b = []
        for r in mine:
            cands = [c for c in r["configs"] if "us" in c and (c["U"], c["W"]) == uw]
            c = min(cands, key=lambda c: c["us"])
            at = " ".join(f"{a}={c[a]}" for a in inner)
            per_b.append(f"B={r['B']}: {at} {c['us']:.1f} us (default {r['default_us']:.1f})")
        print(f"{shape:16} {kernel:13} U={uw[0]} W={uw[1]}: {full[uw]:.1f} us vs default {base:.1f}"
              f" ({base / full[uw]:.2f}x)  " + "; ".join(per_b))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--budget", type=float, default=200, help="seconds of sweeping at most")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if Q.backend() is None:
        raise SystemExit("expert_sweep times GPU kernels: no Metal or CUDA device here")
    deadline = time.perf_counter() + args.budget
    rows = []
    for shape in args.shapes:
        rows += sweep_shape(shape, args.batch, args.reps, deadline, args.kernels)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"mlx": mx.__version__, "calls": CALLS, "rows": rows}, f, indent=1)
    summarize(rows)


if __name__ == "__main__":
    main()
