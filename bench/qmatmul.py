"""Benchmark ggml_matmul's GPU kernel (M rows of x) against copy bandwidth and mx.quantized_matmul.

    python3 bench/qmatmul.py OUT.json [--dtype f16] [--types Q4_0,Q4_K] [--rows M] [--sweep]
        [--profile] [--budget SECONDS]
    python3 bench/qmatmul.py OUT.json --mma [--types Q4_K] [--shapes 4096x2816] [--profile]
    python3 bench/qmatmul.py OUT.json --glu [--types Q4_K] [--shapes 12288x4096] [--profile]

--sweep times every SWEEP configuration (variant V: 0 fp32 math, 1 packed fp16, fp16 x only,
2 packed fp16 on bf16 x; R rows per threadgroup, U steps per run, W SIMD groups) after the
default one, on the same weights, and the summary (also in the JSON under "best") gives per type
and shape the fastest configuration, its % of copy bandwidth and its speed against
mx.quantized_matmul 4-bit, plus the lines it suggests for the dtype's table (fp16:
qmatmul_tuning.TYPE_DEFAULTS, bf16: qmatmul_tuning.BF16_DEFAULTS, the models' activations on a
GPU). --budget stops sweeping (defaults still run) once that many seconds have passed, so a
capped device call still returns every shape.

--rows M (default 1) times M rows of x (MT = M rounded up to 2, 4, 8, 16). At M > 1 the sweep
varies R only (ROWS_SWEEP, at most qmatmul.MAX_ACC // MT): V, U and W stay the M = 1 default's,
which a row's output bits depend on (row parity), and each (type, shape) also times its M = 1
default ("m1", the baseline the M-row call is held against); the suggested lines are for
qmatmul_tuning.MT_ROWS.

--mma times the tensor-core kernel (custom_kernels/qmatmul_mma.py) against the scalar one (the
launch_config default) on bf16 x, in one process and interleaved (ROUNDS alternations, medians
kept), at M = 1, 2, 5, 8, 16 for Q4_K, Q6_K, Q5_0, Q8_0 (or --types) on MMA_SHAPES, printing
mma / scalar per M and each kernel's time at M against its own M = 1 (the goal: about 1).
--mma-configs 2x4,4x8 also times those (U blocks per run, W SIMD groups) of the mma kernel
("2x8s": with streaming weight loads, config S = 1; "1x8p": each run's loads issued a run
ahead, PF = 1; "1x8sp" both; "2x8k2": split over K in 2, KS = 2; "2x8k2f": that with its sum
fused, SF = 1; "1x4r": paired rows, R = 2, 16 rows of each half of W a threadgroup;
"2x8c1": x's columns split over threadgroups, at most 1 n-tile of 8 each, config CS);
--mma-rows 1,8 times those M only (M = 1 first: the other rows' "x M=1" are against it); above
16 rows (the scalar kernel's most) the mma alone.

--glu does the same for the dense gate/up + activation kernel (expert_glu.dense_glu): its
tensor-core version (dense_glu_mma_kernel) against the scalar one (dense_config's launch) at
M = 1, 5, 8, 16, 32 on GLU_SHAPES, given as F x K (the weight holds 2F rows: gate, then up);
--mma-configs applies to its mma kernel likewise.

Shapes are (N out, K in): 4096x4096, 4096x14336 (down-proj-like), 14336x4096 (up-proj-like) and
262144x2816 (an lm_head: 262144 outputs from 2816 features). Weights rotate over enough copies to
exceed the 60 MB L2 several times, so every call streams from HBM.

Timing: `wall_us` is the median over repetitions of (one mx.eval of B independent calls) / B,
after warm-up, synchronised: it includes MLX's per-op CPU cost (~5 us), which hides the kernel
for the small shapes. With --profile, `gpu_us` is the median kernel duration that CUPTI records
(through torch.profiler, in the same process), the number to hold against the copy bandwidth.
GB/s counts the weight bytes read once per call; the copy bandwidth counts bytes read + written.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from datetime import datetime, timezone
from functools import partial

import mlx.core as mx
from gguf import GGMLQuantizationType as T

from hf2q_mlx.custom_kernels import expert_glu as G
from hf2q_mlx.custom_kernels import qmatmul as Q
from hf2q_mlx.custom_kernels import qmatmul_mma as MM
from hf2q_mlx.io.random_weights import random_ggml_blocks

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (262144, 2816)]
ALL_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
DTYPES = {"f32": mx.float32, "f16": mx.float16, "bf16": mx.bfloat16}
ROTATE_BYTES = 512 << 20  # weight copies per case: at least this many bytes (>> L2)
SWEEP = [  # (V, R, U, W) configurations tried with --sweep (MT = 1); V = 1 needs fp16 x,
    # V = 2 bf16 x (the other dtypes skip them)
    (1, 8, 1, 4), (1, 4, 1, 8), (1, 4, 1, 4), (1, 2, 1, 8), (1, 4, 2, 4), (1, 2, 4, 8),
    (1, 8, 1, 8), (2, 8, 1, 4), (2, 4, 1, 8), (2, 4, 1, 4), (2, 2, 1, 8), (2, 4, 2, 4),
    (2, 2, 4, 8), (2, 8, 1, 8), (0, 4, 2, 4), (0, 2, 4, 8), (0, 2, 1, 8), (0, 4, 1, 4),
]  # fmt: skip
ROWS_SWEEP = (1, 2, 4, 8, 16)  # R tried with --sweep at --rows M > 1 (V, U, W: the M = 1 default)
# --mma: the models' projection shapes (Gemma-like 2816 / 2112 features) and an lm_head
MMA_SHAPES = [(4096, 2816), (2816, 4096), (2112, 2816), (2816, 2112), (262144, 2816)]
MMA_TYPES = ["Q4_K", "Q6_K", "Q5_0", "Q8_0"]
MMA_ROWS = (1, 2, 5, 8, 16)
ROUNDS = 3  # scalar / mma alternations per (type, shape, M)
SCALAR_MAX_ROWS = 16  # rows of x the scalar mat-vec takes (qmatmul._M_BUCKETS)
# --glu: dense MLPs as F x K (gate and up rows of F each): Qwen3.5-9B's, a 2816-feature one
GLU_SHAPES = [(12288, 4096), (2816, 2816)]
GLU_ROWS = (1, 5, 8, 16, 32)


class Profiler:
    """Kernel durations from CUPTI via torch.profiler; inert when torch is absent."""

    def __init__(self, enabled: bool):
        self.prof = None
        if enabled:
            import torch  # noqa: F401  (only to check it imports before we rely on it)
            from torch.profiler import ProfilerActivity, profile

            self.prof = profile(activities=[ProfilerActivity.CUDA])

    def __enter__(self):
        if self.prof is not None:
            self.prof.__enter__()
        return self

    def __exit__(self, *exc):
        if self.prof is not None:
            self.prof.__exit__(*exc)

    def median_us(self, name_part: str | tuple[str, ...]) -> float | None:
        """The median GPU us of the kernels whose names hold ``name_part``; a tuple: the sum
        of each part's median (a call of several launches, e.g. the split mat-vec's two)."""
        if self.prof is None:
            return None
        from torch.autograd import DeviceType

        parts = name_part if isinstance(name_part, tuple) else (name_part,)
        meds = []
        for part in parts:
            times = [
                e.time_range.elapsed_us()
                for e in self.prof.events()
                if e.device_type == DeviceType.CUDA and part in e.name
            ]
            if not times:
                return None
            meds.append(statistics.median(times))
        return sum(meds)


def _time(fn_list, reps: int, batch: int, profile: bool, name_part: str):
    """fn_list: callables returning an array (one per weight copy). -> (wall_us, gpu_us)."""
    for f in fn_list:  # warm-up: compile, allocate
        mx.eval(f())
    mx.synchronize()
    walls = []
    with Profiler(profile) as prof:
        for _ in range(reps):
            t0 = time.perf_counter()
            outs = [fn_list[i % len(fn_list)]() for i in range(batch)]
            mx.eval(outs)
            mx.synchronize()
            walls.append((time.perf_counter() - t0) / batch * 1e6)
    return statistics.median(walls), prof.median_us(name_part)


def copy_bandwidth(profile: bool) -> dict:
    n = 1 << 28  # 1 GiB of uint32
    a = mx.random.randint(0, 1 << 30, (n,), dtype=mx.uint32)
    mx.eval(a)
    wall, gpu = _time([lambda: a ^ 1], reps=10, batch=1, profile=profile, name_part="")
    nbytes = 2 * a.nbytes  # read + write
    return {
        "bytes": nbytes,
        "wall_us": wall,
        "GBps_wall": nbytes / wall / 1e3,
        "gpu_us": gpu,
        "GBps_gpu": nbytes / gpu / 1e3 if gpu else None,
    }


def _copies(nbytes: int) -> int:
    return max(1, min(64, -(-ROTATE_BYTES // nbytes)))


def bench_ggml(tname, n, k, dtype, cfgs, args, t_start) -> list[dict]:
    """One weight set per (type, shape), every configuration of ``cfgs`` timed on it."""
    t = T[tname]
    w0 = random_ggml_blocks(n, k, t, seed=1)
    ws = [w0] + [random_ggml_blocks(n, k, t, seed=2 + i) for i in range(_copies(w0.nbytes) - 1)]
    xs = {m: mx.random.normal((m, k)).astype(dtype) for m in {1, args.rows}}
    mx.eval(ws, xs)
    m_rows = args.rows
    if m_rows > 1:  # at M > 1 the sweep varies R of the default only (row parity)
        d = Q.launch_config(t, m_rows, n, k, dtype)
        cfgs = [c for c in cfgs if c is None] + (
            [dict(d, R=r) for r in ROWS_SWEEP if r * d["MT"] <= Q.MAX_ACC] if len(cfgs) > 1 else []
        )
        cfgs.append("m1")  # the M = 1 default: the baseline
    rows, skipped = [], False
    for cfg in cfgs:
        m = 1 if cfg == "m1" else m_rows
        if cfg not in (None, "m1") and time.perf_counter() - t_start > args.budget:
            if not skipped:
                print(f"budget: skipping the sweep for {tname} {n}x{k}", flush=True)
            skipped = True
            continue  # the m1 baseline still runs
        if cfg not in (None, "m1") and Q.VARIANT_DTYPES.get(cfg["V"], dtype) != dtype:
            continue  # a packed variant for another x dtype
        if cfg in (None, "m1"):
            c = Q.launch_config(t, m, n, k, dtype)
        else:
            c = Q.clamp_w(t, k, cfg)
        if cfg not in (None, "m1") and any(r.get("config") == c for r in rows):
            continue  # W clamped onto a configuration already timed
        x = xs[m]
        fns = [lambda w=w, c=c, x=x: Q.ggml_matmul_kernel(x, w, t, k, config=c) for w in ws]
        batch = max(args.batch, len(ws))
        name = Q.kernel_name(t, c["V"])
        row = {"type": tname, "N": n, "K": k, "M": m, "bytes": w0.nbytes, "config": c,
               "default": cfg is None, "copies": len(ws)}  # fmt: skip
        try:
            row["wall_us"], row["gpu_us"] = _time(fns, args.reps, batch, args.profile, name)
        except Exception as e:  # noqa: BLE001 (report and go on: partial results are useful)
            print(f"FAILED {tname} {n}x{k} {c}: {type(e).__name__}: {e}", flush=True)
            row["error"] = f"{type(e).__name__}: {e}"
            continue
        rows.append(row)
    del ws
    return rows


def _mma_kinds(t, n, k, m, x, ws, args) -> tuple[dict, dict, dict]:
    """--mma: {kind: (callables, kernel name)}, the scalar and the mma configs at M = m."""
    kinds = {}
    c = None
    if m <= SCALAR_MAX_ROWS:  # the scalar mat-vec takes up to 16 rows; above, the mma alone
        c = Q.launch_config(t, m, n, k, mx.bfloat16)
        kinds["scalar"] = (
            [lambda w=w, x=x, c=c: Q.ggml_matmul_kernel(x, w, t, k, config=c) for w in ws],
            Q.kernel_name(t, c["V"]),
        )
    mcfg = MM.launch_config(t, m, n, k)
    # the default's launches (a split's two, the split with its sum fused, paired rows)
    kinds["mma"] = (
        [lambda w=w, x=x: MM.mma_matmul_kernel(x, w, t, k) for w in ws],
        MM.launch_names(t, mcfg),
    )
    for u, wm, flags in args.mma_configs:  # other (U, W) of the mma kernel, same M-free rule
        ks = int(flags[1]) if flags.startswith("k") else 1
        mc = {key: v for key, v in mcfg.items() if key not in ("R", "CS")}
        mc.update(U=u, W=max(1, min(wm, -(-(k // MM.BLOCK_FORMATS[t].block_size) // u))))
        mc.update(S=int("s" in flags), PF=int("p" in flags), **({"R": 2} if "r" in flags else {}))
        mc = {key: v for key, v in MM.with_split(mc, t, k, ks).items() if key != "SF"}
        if "f" in flags:
            mc["SF"] = 1
        if "c" in flags:  # a column split: this many n-tiles a threadgroup at most
            mc = MM.with_columns(mc, int(flags[flags.index("c") + 1]))
        kinds[f"mma_U{u}_W{mc['W']}{flags}"] = (
            [lambda w=w, x=x, mc=mc: MM.mma_matmul_kernel(x, w, t, k, config=mc) for w in ws],
            MM.launch_names(t, mc),
        )
    return kinds, c, mcfg


def _glu_kinds(t, f, k, m, x, ws, args) -> tuple[dict, dict, dict]:
    """--glu: likewise for expert_glu's dense kernels (F = f features of 2F weight rows)."""
    c = G.dense_config(t, m, f, k)
    kinds = {
        "scalar": ([lambda w=w, x=x, c=c: G.dense_glu_kernel(x, w, t, k, config=c) for w in ws],
                   G.dense_kernel_name(t, mma=False)),
    }  # fmt: skip
    mcfg = MM.glu_launch_config(t, m, f, k)
    kinds["mma"] = (
        [lambda w=w, x=x: G.dense_glu_mma_kernel(x, w, t, k) for w in ws],
        G.dense_kernel_name(t, mma=True, columns=mcfg.get("CS", 1) > 1),
    )
    for u, wm, flags in args.mma_configs:
        mc = dict(mcfg, U=u, W=max(1, min(wm, -(-(k // MM.BLOCK_FORMATS[t].block_size) // u))))
        mc.update(S=int("s" in flags), PF=int("p" in flags))
        kinds[f"mma_U{u}_W{mc['W']}{flags}"] = (
            [lambda w=w, x=x, mc=mc: G.dense_glu_mma_kernel(x, w, t, k, config=mc) for w in ws],
            G.dense_kernel_name(t, mma=True, stream="s" in flags, columns=mc.get("CS", 1) > 1),
        )
    return kinds, c, mcfg


def bench_mma(tname, n, k, args, glu: bool = False) -> list[dict]:
    """The mma kernel against the scalar one on the same weights and bf16 x, interleaved.
    ``glu``: expert_glu's dense kernels, n = F features (2F weight rows)."""
    t = T[tname]
    w0 = random_ggml_blocks(2 * n if glu else n, k, t, seed=1)
    ws = [w0] + [
        random_ggml_blocks(w0.shape[0], k, t, seed=2 + i) for i in range(_copies(w0.nbytes) - 1)
    ]
    ms = args.mma_rows or (GLU_ROWS if glu else MMA_ROWS)
    # small x for the GLU: moderate gate sums, no inf in the activation
    xs = {m: (0.05 * mx.random.normal((m, k))).astype(mx.bfloat16) for m in ms}
    mx.eval(ws, xs)
    batch = max(args.batch, len(ws))
    reps = max(1, args.reps // ROUNDS)
    rows = []
    for m in ms:
        x = xs[m]
        kinds, c, mcfg = (_glu_kinds if glu else _mma_kinds)(t, n, k, m, x, ws, args)
        got: dict[str, list] = {kind: [] for kind in kinds}
        for _ in range(ROUNDS):
            for kind, (fns, name) in kinds.items():
                got[kind].append(_time(fns, reps, batch, args.profile, name))
        row = {"type": tname, "N": n, "K": k, "M": m, "bytes": w0.nbytes, "copies": len(ws),
               "scalar_config": c, "mma_config": mcfg, "glu": glu}  # fmt: skip
        for kind, vals in got.items():
            row[f"{kind}_wall_us"] = statistics.median(v[0] for v in vals)
            gpu = [v[1] for v in vals if v[1] is not None]
            row[f"{kind}_gpu_us"] = statistics.median(gpu) if gpu else None
            if kind.startswith("mma_U"):
                wall, gpu = row[kind + "_wall_us"], row[kind + "_gpu_us"] or float("nan")
                print(f"{tname:>5} {n:>6}x{k:<5} M{m:<2}  {kind}: wall {wall:.1f} us, "
                      f"gpu {gpu:.1f} us", flush=True)  # fmt: skip
        rows.append(row)
    base = rows[0]  # M = 1
    for row in rows:
        for kind in ("scalar", "mma"):
            for what in ("wall", "gpu"):
                v, b = row.get(f"{kind}_{what}_us"), base.get(f"{kind}_{what}_us")
                row[f"{kind}_{what}_x_m1"] = v / b if v and b else None
        for what in ("wall", "gpu"):
            v, b = row[f"mma_{what}_us"], row.get(f"scalar_{what}_us")
            row[f"mma_over_scalar_{what}"] = v / b if v and b else None
        _print_mma_row(row)
    del ws
    return rows


def _print_mma_row(row: dict) -> None:
    def f(v, fmt):
        return format(v, fmt) if v is not None else "-"

    print(
        f"{'glu ' if row.get('glu') else ''}{row['type']:>5} {row['N']:>6}x{row['K']:<5} "
        f"M{row['M']:<2}  wall scalar {f(row.get('scalar_wall_us'), '7.1f')} "
        f"mma {row['mma_wall_us']:7.1f} us "
        f"(mma/scalar {f(row['mma_over_scalar_wall'], '.2f')})  gpu scalar "
        f"{f(row.get('scalar_gpu_us'), '7.1f')} mma {f(row['mma_gpu_us'], '7.1f')} us "
        f"(mma/scalar {f(row['mma_over_scalar_gpu'], '.2f')})  x M=1: scalar "
        f"{f(row['scalar_gpu_x_m1'] or row['scalar_wall_x_m1'], '.2f')} "
        f"mma {f(row['mma_gpu_x_m1'] or row['mma_wall_x_m1'], '.2f')}",
        flush=True,
    )


def main_mma(args, types: list[str], shapes, glu: bool = False) -> None:
    res = {"date": datetime.now(timezone.utc).isoformat(), "mode": "glu" if glu else "mma",
           "dtype": "bf16", "device": str(mx.default_device()), "rows": [],
           "skipped": []}  # fmt: skip
    t_start = time.perf_counter()
    for n, k in shapes:
        for tname in types:
            try:
                if k % Q.BLOCK_FORMATS[T[tname]].block_size:
                    raise ValueError("K is not a multiple of the block")
                res["rows"] += bench_mma(tname, n, k, args, glu)
            except Exception as e:  # noqa: BLE001 (report and go on: partial results are useful)
                print(f"skipped {tname} {n}x{k}: {type(e).__name__}: {e}", flush=True)
                res["skipped"].append(f"{tname} {n}x{k}: {type(e).__name__}: {e}")
            with open(args.out, "w") as fh:  # partial results survive
                json.dump(res, fh, indent=1)
    print(f"total {time.perf_counter() - t_start:.0f} s")


def bench_affine(bits, n, k, dtype, args) -> dict:
    # scales and biases in x's dtype: with fp16 ones and bf16 x, session 3's bf16 sweep read
    # 113-202 % of copy bandwidth here, most likely because a per-call dtype conversion kernel
    # became the median of all kernels (name_part ""); not yet re-run on a GPU
    w = mx.random.normal((n, k)).astype(dtype)
    q = mx.quantize(w, group_size=32, bits=bits)
    nbytes = sum(a.nbytes for a in q)
    del w
    qs = [q] + [
        mx.quantize(mx.random.normal((n, k)).astype(dtype), group_size=32, bits=bits)
        for _ in range(_copies(nbytes) - 1)
    ]
    x = mx.random.normal((args.rows, k)).astype(dtype)
    mx.eval(qs, x)
    fns = [
        lambda q=q: mx.quantized_matmul(x, *q, transpose=True, group_size=32, bits=bits) for q in qs
    ]
    batch = max(args.batch, len(qs))
    wall, gpu = _time(fns, args.reps, batch, args.profile, "")  # only its kernels run
    return {"type": f"mlx_affine{bits}_g32", "N": n, "K": k, "bytes": nbytes, "wall_us": wall,
            "gpu_us": gpu, "copies": len(qs)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="JSON output path")
    ap.add_argument("--dtype", default="f16", choices=list(DTYPES))
    ap.add_argument("--types", default=",".join(ALL_TYPES))
    ap.add_argument("--shapes", default="all", help="'all' or e.g. 4096x14336,14336x4096")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=32, help="calls per evaluation")
    ap.add_argument("--sweep", action="store_true", help="also try the SWEEP configurations")
    ap.add_argument("--profile", action="store_true", help="kernel times via torch.profiler")
    ap.add_argument("--no-affine", action="store_true")
    ap.add_argument("--budget", type=float, default=170, help="seconds of sweeping at most")
    ap.add_argument("--rows", type=int, default=1, help="rows of x, 1..16")
    ap.add_argument(
        "--mma", action="store_true", help="mma vs scalar kernel, bf16 x, M 1..32 (scalar to 16)"
    )
    ap.add_argument("--glu", action="store_true", help="dense GLU: mma vs scalar, bf16 x, M 1..32")
    ap.add_argument(
        "--mma-configs",
        default="",
        help="--mma, --glu: also time these UxW, e.g. 2x4,4x8 (flags after: kN split over K "
        "in N (f: its sum fused), r paired rows and cN at most N n-tiles a threadgroup, --mma "
        "only; s streaming loads; p loads a run ahead: 2x8k3s, 1x4k2r, 2x8k2f, 2x8c1)",
    )
    ap.add_argument("--mma-rows", default="", help="--mma, --glu: these M only (1 first), e.g. 1,8")
    args = ap.parse_args()
    args.mma_rows = tuple(int(v) for v in args.mma_rows.split(",") if v)
    # "UxW", then flags: "kN" N splits over K (KS = N), "f" their sum fused (SF = 1), "r"
    # paired rows (R = 2), "s" streaming weight loads (S = 1), "p" loads a run ahead (PF = 1)
    configs = [
        re.fullmatch(r"(\d+)x(\d+)((?:k[2-8]f?)?r?(?:c[124])?[sp]*)", c)
        for c in args.mma_configs.split(",")
        if c
    ]
    mma_only = any(("k" in c[3] or "r" in c[3] or "c" in c[3]) for c in configs if c)
    clash = any(("r" in c[3] or "f" in c[3]) and "s" in c[3] for c in configs if c)
    clash = clash or any("f" in c[3] and "r" in c[3] for c in configs if c)
    if not all(configs) or (args.glu and mma_only) or clash:
        ap.error(
            f"--mma-configs {args.mma_configs!r}: expected UxW[kN[f]][r][cN][s][p], kN, r and cN "
            "with --mma only, f and r without s or each other"
        )
    args.mma_configs = [(int(c[1]), int(c[2]), c[3]) for c in configs]
    if args.mma or args.glu:
        types = MMA_TYPES if args.types == ",".join(ALL_TYPES) else args.types.split(",")
        shapes = GLU_SHAPES if args.glu else MMA_SHAPES
        if args.shapes != "all":
            shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
        return main_mma(args, [s for s in types if s], shapes, glu=args.glu)
    dtype = DTYPES[args.dtype]
    if not 1 <= args.rows <= 16:
        ap.error("--rows takes 1..16 (the mat-vec kernel's rows of x)")
    shapes = SHAPES
    if args.shapes != "all":
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    types = [s for s in args.types.split(",") if s]

    res = {
        "date": datetime.now(timezone.utc).isoformat(),
        "dtype": args.dtype,
        "rows_x": args.rows,
        "device": str(mx.default_device()),
        "copy": copy_bandwidth(args.profile),
        "rows": [],
    }
    cp = res["copy"]
    print(f"copy: {cp['GBps_wall']:.0f} GB/s wall, gpu {cp['GBps_gpu'] or float('nan'):.0f} GB/s")
    t_start = time.perf_counter()
    sweep = [{"V": v, "MT": 1, "R": r, "U": u, "W": w} for v, r, u, w in SWEEP]
    for n, k in shapes:
        if not args.no_affine:
            for bits in (4, 8):
                _run(res, partial(bench_affine, bits, n, k, dtype, args), (bits, n, k))
        for tname in types:
            cfgs = [None] + (sweep if args.sweep else [])
            for row in bench_ggml(tname, n, k, dtype, cfgs, args, t_start):
                res["rows"].append(row)
                _print_row(row, res["copy"])
        res["best"] = _best(res)
        with open(args.out, "w") as f:  # rewrite after every shape: partial results survive
            json.dump(res, f, indent=1)
    _print_table(res)
    print(f"total {time.perf_counter() - t_start:.0f} s")


def _run(res: dict, fn, what) -> None:
    """One benchmark row; a failure is recorded and reported, not fatal for the others."""
    try:
        row = fn()
    except Exception as e:  # noqa: BLE001 (report and go on: partial results are useful)
        print(f"FAILED {what}: {type(e).__name__}: {e}", flush=True)
        res.setdefault("errors", []).append(f"{what}: {type(e).__name__}: {e}")
        return
    res["rows"].append(row)
    _print_row(row, res["copy"])


def _rates(row: dict, copy: dict) -> tuple[float, float | None]:
    wall = row["bytes"] / row["wall_us"] / 1e3
    gpu = row["bytes"] / row["gpu_us"] / 1e3 if row.get("gpu_us") else None
    return wall, gpu


def _print_row(row: dict, copy: dict) -> None:
    wall, gpu = _rates(row, copy)
    ref = copy["GBps_gpu"] or copy["GBps_wall"]
    best = gpu or wall
    cfg = row.get("config") or {}
    print(
        f"{row['type']:>16} {row['N']:>6}x{row['K']:<6} {row['wall_us']:8.1f} us "
        f"{wall:6.0f} GB/s  gpu {row.get('gpu_us') or float('nan'):8.1f} us "
        f"{gpu or float('nan'):6.0f} GB/s  {best / ref:5.1%} of copy  "
        f"V{cfg.get('V', '-')} R{cfg.get('R', '-')} U{cfg.get('U', '-')} W{cfg.get('W', '-')}"
        f" M{row.get('M', 1)}",
        flush=True,
    )


def _best(res: dict) -> list[dict]:
    """Per (type, N, K): the fastest configuration, % of copy, x mx.quantized_matmul 4-bit."""
    ref = res["copy"]["GBps_gpu"] or res["copy"]["GBps_wall"]
    m_rows = res.get("rows_x", 1)
    best: dict = {}
    for row in res["rows"]:
        if row.get("M", m_rows) != m_rows:
            continue  # the M = 1 baseline of an M-row run
        wall, gpu = _rates(row, res["copy"])
        key = (row["type"], row["N"], row["K"])
        if key not in best or (gpu or wall) > best[key]["GBps"]:
            rate = gpu or wall
            best[key] = {"type": row["type"], "N": row["N"], "K": row["K"], "GBps": rate,
                         "pct_copy": 100 * rate / ref, "config": row.get("config")}  # fmt: skip
    for key, b in best.items():
        dflt = [r for r in res["rows"] if (r["type"], r["N"], r["K"]) == key and r.get("default")]
        if dflt:
            wall, gpu = _rates(dflt[0], res["copy"])
            b["default_pct_copy"] = 100 * (gpu or wall) / ref
        m1 = [r for r in res["rows"] if (r["type"], r["N"], r["K"]) == key and r.get("M") == 1]
        if m_rows > 1 and m1:  # time of the best M-row call / the M = 1 default's
            b["x_m1"] = (m1[0]["bytes"] / b["GBps"] / 1e3) / (
                m1[0].get("gpu_us") or m1[0]["wall_us"]
            )
        aff = best.get(("mlx_affine4_g32", key[1], key[2]))
        if aff and not b["type"].startswith("mlx"):
            b["x_mx_affine4"] = b["GBps"] / aff["GBps"]
    return sorted(best.values(), key=lambda b: (b["N"], b["K"], b["type"]))


def _print_table(res: dict) -> None:
    print("\n== summary (best config per type and shape; % of copy bandwidth) ==")
    best = res.get("best") or _best(res)
    for b in best:
        c = b.get("config") or {}
        cfg = " ".join(f"{k}{c[k]}" for k in ("V", "R", "U", "W") if k in c)
        print(f"{b['type']:>16} {b['N']:>6}x{b['K']:<6} {b['GBps']:6.0f} GB/s "
              f"{b['pct_copy']:5.1f} % (default {b.get('default_pct_copy') or 0:5.1f} %)  "
              f"x{b.get('x_mx_affine4') or 0:4.2f} mx-affine4  {cfg}"
              + (f"  time x{b['x_m1']:.2f} of M = 1" if "x_m1" in b else ""))  # fmt: skip
    if res.get("rows_x", 1) > 1:
        print(
            f"\nsuggested qmatmul_tuning.MT_ROWS entries (MT, type, K >= 8192) -> R"
            f" ({res['dtype']} x):"
        )
        for b in best:
            c = b.get("config")
            if c and "MT" in c and not b["type"].startswith("mlx"):
                key = f"({c['MT']}, {b['type']!r}, {b['K'] >= 8192})"
                pct, xm1 = b["pct_copy"], b.get("x_m1", 0)
                print(f"    {key}: {c['R']},  # {b['N']}x{b['K']} {pct:.0f} %, x{xm1:.2f} of M = 1")
        return
    table = {"f16": "TYPE_DEFAULTS", "bf16": "BF16_DEFAULTS"}.get(res["dtype"], "V0_DEFAULTS")
    print(f"\nsuggested qmatmul_tuning.{table} entries (type, K >= 8192) -> (V, R, U, W):")
    for b in best:
        c = b.get("config")
        if c and "V" in c:
            print(f"  ({b['type']!r}, {b['K'] >= 8192}): ({c['V']}, {c['R']}, {c['U']}, {c['W']}),"
                  f"  # {b['N']}x{b['K']} {b['pct_copy']:.0f} %")  # fmt: skip


if __name__ == "__main__":
    main()
