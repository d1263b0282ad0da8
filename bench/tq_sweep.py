"""Split-K partitions of the TurboQuant flash-decode kernels (``custom_kernels/tq_flash_decode.py``)
at Gemma-4-26B-A4B's attention shapes: the default partition count against more, smaller
partitions, in interleaved rounds in one process.

A partition's SIMD groups walk their keys one token after another, so a launch with few
partitions leaves most of the GPU idle waiting on loads (session 31: the partial kernel took
about the same time at 4K and 16K keys). A variant ``(d, g)`` divides ``min_keys`` (the fewest
keys worth a partition) by ``d`` and multiplies the threadgroups aimed at by ``g``.

Each evaluation runs ``--chain`` calls (fresh queries each); with torch and CUDA present every
evaluation is under CUPTI and the kernels' GPU time per call is reported (launches excluded),
else the wall time per call. Every variant's output is checked against the default's (fp32 sums
in another order: bf16 outputs within two ulps of the largest output).

    python3 bench/tq_sweep.py --json bench/results/tq_sweep_h200.json
    python3 bench/tq_sweep.py --tiny --rounds 1 --chain 2     # CPU smoke run (reference only)
    python3 bench/tq_sweep.py --tc --bits 8,4       # the tensor-core partial (HF2Q_TQ_TC)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from turboquant_speed import cupti_profiler, fill, kernel_time, make_layer_cache  # noqa: E402

from hf2q_mlx.custom_kernels import tq_flash_decode as TF  # noqa: E402
from hf2q_mlx.custom_kernels import tq_flash_tc as TC  # noqa: E402
from hf2q_mlx.models.turboquant.kernels import tq_flash_decode  # noqa: E402

# (label, Hq, Hkv, D, window or None, tokens in the cache)
SHAPES = [
    # few tokens: what a call costs with next to no work (a fixed cost per launch shows here)
    ("sliding 64", 16, 8, 256, 1024, 64),
    ("global 256", 16, 2, 512, None, 256),
    ("sliding 4K", 16, 8, 256, 1024, 4096),
    ("global 4K", 16, 2, 512, None, 4096),
    ("global 16K", 16, 2, 512, None, 16384),
]
TINY = [("sliding", 4, 2, 64, 64, 100), ("global", 4, 1, 128, None, 200)]
# (d, g, w, r, c, k, b): min_keys / d, _TARGET_GROUPS * g, w SIMD groups per threadgroup
# (None: _W's default; the same partitions, their keys split over w), r the registers
# row_groups budgets for rows x coordinates (None: _MAX_REGS; 64 halves a global layer's rows
# per threadgroup), c = 1 coalesced row reads, 0 not (tq_flash_decode.coalesced), k copies of a
# codebook over 32 entries (codebook_copies), b threadgroups an SM the registers are bounded
# for (min_blocks; 0: nvcc's choice).
# Session 32: one SIMD group per scheduler at the default (ncu, H200: 4.6 cycles per issued
# instruction, 222 registers on the global layers), so w = 8 doubles the SIMD groups per SM.
# Session 33 (H100): r = 64 never slower; more threadgroups help TQ4, not TQ8. Session 34:
# coalesced reads 1.24-1.31x on the 8-bit global partial (H200), the default since; 16 codebook
# copies no gain (H100). nvcc (sm_90), global TQ8: 224 registers at the default, 168 with b = 3
# (184 bytes spilled); r = 64: 158, and 128 with b = 4, no spills (4 threadgroups an SM, not 2).
VARIANTS = [(1, 1, None, None, 1, 1, 0), (1, 1, None, None, 1, 1, 3), (1, 1, None, 64, 1, 1, 0),
            (1, 1, None, 64, 1, 1, 3), (1, 1, None, 64, 1, 1, 4), (2, 1, None, 64, 1, 1, 4),
            (1, 1, None, None, 1, 16, 0), (1, 1, None, None, 0, 1, 0)]  # fmt: skip
# --tc: the tensor-core partial (HF2Q_TQ_TC=1, an eighth field: 1 with its codebook copies, 2
# with one copy) against the default, at its own partitions, half their keys (twice the
# partitions) and twice their keys
# and bounded to 3 threadgroups an SM (nvcc sm_90, global TQ8: 255 -> 168 registers, 316 bytes
# spilled; session 49's ncu: 2 SIMD groups a scheduler at 255)
TC_VARIANTS = [(1, 1, None, None, 1, 1, 0), (1, 1, None, None, 1, 1, 0, 1),
               (1, 1, None, None, 1, 1, 0, 2), (2, 1, None, None, 1, 1, 0, 1),
               (0.5, 1, None, None, 1, 1, 0, 1), (1, 1, None, None, 1, 1, 3, 1)]  # fmt: skip


_TC_STEPS, _TC_COPIES = TF._TC_STEPS, TC._CB_COPIES


def use(variant, base_min_keys, base_target, base_w, base_r) -> None:
    d, g, w, r, c, k, b = variant[:7]
    t = variant[7] if len(variant) > 7 else 0
    os.environ["HF2Q_TQ_TC"] = str(min(t, 1))  # in the plan key
    TC._CB_COPIES = 1 if t == 2 else _TC_COPIES
    TF._TC_STEPS = max(1, round(_TC_STEPS / d))  # the tensor-core partitions' fewest steps
    TF._COALESCE = bool(c)
    TF._CB_COPIES = k
    TF._MIN_BLOCKS = b
    TF.min_keys = lambda *a: max(1, int(base_min_keys(*a) / d))
    TF._TARGET_GROUPS = base_target * g
    TF._W = base_w if w is None else w
    TF._MAX_REGS = base_r if r is None else r
    TF._PLANS.clear()


def kernel_kind(name: str) -> str:
    """The flash-decode kernel a CUDA kernel name belongs to (else its name's start)."""
    return next((k for k in ("partial", "reduce", "fused") if k in name), name[:40])


def run_shape(shape, a, bits: int) -> dict:
    label, Hq, Hkv, D, window, n = shape
    dt = mx.bfloat16
    cache = make_layer_cache(window, bits, seed=3)
    fill(cache, Hkv, D, n, dt)
    # a ring filled past its window in one write holds a sliced view, which every kernel call
    # would copy first (session 32: a 5-14 us copy kernel per sliding call); a decode step's
    # write leaves a contiguous array, so time that
    cache.keys, cache.values = mx.contiguous(cache.keys), mx.contiguous(cache.values)
    mx.eval(cache.keys, cache.values)
    state = cache.packed_state()
    qs = [mx.random.normal((1, Hq, 1, D), key=mx.random.key(i)).astype(dt) for i in range(a.chain)]
    mx.eval(qs)
    base_mk, base_tg, base_w, base_r = TF.min_keys, TF._TARGET_GROUPS, TF._W, TF._MAX_REGS
    base_c, base_k, base_b = TF._COALESCE, TF._CB_COPIES, TF._MIN_BLOCKS
    times = {v: [] for v in VARIANTS}
    kernels = {v: {} for v in VARIANTS}  # us per call by kernel, summed over rounds
    outs, parts = {}, {}
    try:
        for v in VARIANTS:  # warm-up: compile, keep each variant's output of q 0 and its split
            use(v, base_mk, base_tg, base_w, base_r)
            outs[v] = tq_flash_decode(qs[0], state, D**-0.5)
            mx.eval(outs[v])
            plans = [p for p in TF._PLANS.values() if p is not None]
            parts[v] = plans[0][2] if plans else 1
        for _ in range(a.rounds):
            for v in VARIANTS:
                use(v, base_mk, base_tg, base_w, base_r)
                t, names = kernel_time(
                    lambda: [tq_flash_decode(q, state, D**-0.5) for q in qs], a.cupti, kernel_kind
                )
                times[v].append(t / a.chain)
                for k, us in names.items():
                    kernels[v][k] = kernels[v].get(k, 0.0) + us / a.chain / a.rounds
    finally:
        TF.min_keys, TF._TARGET_GROUPS, TF._W = base_mk, base_tg, base_w
        TF._MAX_REGS = base_r
        TF._COALESCE, TF._CB_COPIES, TF._MIN_BLOCKS = base_c, base_k, base_b
        TF._TC_STEPS, TC._CB_COPIES = _TC_STEPS, _TC_COPIES
        os.environ.pop("HF2Q_TQ_TC", None)
        TF._PLANS.clear()
    ref = outs[VARIANTS[0]].astype(mx.float32)
    tol = 2 * 2.0**-8 * mx.abs(ref).max().item()
    base = statistics.median(times[VARIANTS[0]])
    rows = []
    print(f"\n{label} TQ{bits}: Hq {Hq}, Hkv {Hkv}, D {D}, {n} tokens, us per call")
    for v in VARIANTS:
        # under Nsight Compute the CUPTI times are zeros (ncu holds the counters): 1 us stands in
        med = statistics.median(times[v]) or 1.0
        base = base or 1.0
        err = mx.abs(outs[v].astype(mx.float32) - ref).max().item()
        row = {"variant": list(v), "parts": parts[v], "us": med, "min": min(times[v]),
               "max": max(times[v]), "vs_default": base / med, "max_err": err,
               "ok": err <= tol, "kernels_us": kernels[v]}  # fmt: skip
        rows.append(row)
        print(f"  keys/{v[0]:<4} groups x{v[1]} W {v[2] or base_w} regs {v[3] or base_r:3d} "
              f"{'coal' if v[4] else 'word'} cb x{v[5]:<2d} mb {v[6]}"
              f"{('', ' tc', ' tc cb1')[v[7] if len(v) > 7 else 0]}  "
              f"parts {parts[v]:4d}  "
              f"{med:8.2f} "
              f"[{row['min']:.2f}-{row['max']:.2f}]  x{base / med:.2f}  err {err:.2e} "
              f"{'ok' if row['ok'] else 'DIFF'}  "
              + " ".join(f"{k} {us:.1f}" for k, us in sorted(kernels[v].items())))  # fmt: skip
    return {"shape": label, "bits": bits, "Hq": Hq, "Hkv": Hkv, "D": D, "tokens": n, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--chain", type=int, default=32)
    ap.add_argument("--bits", default="8,4", help="TurboQuant bits, comma list")
    ap.add_argument("--tiny", action="store_true", help="small shapes (CPU smoke run)")
    ap.add_argument("--no-cupti", dest="cupti", action="store_false", help="wall time only")
    ap.add_argument("--only", default="", help="shapes whose label contains this")
    ap.add_argument("--default-only", action="store_true", help="the default split alone")
    ap.add_argument("--tc", action="store_true", help="the tensor-core partial's variants")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.tc:
        VARIANTS[:] = TC_VARIANTS
    if a.default_only:
        VARIANTS[1:] = []
    timing = "CUPTI kernel time" if a.cupti and cupti_profiler() is not None else "wall time"
    print(f"mlx {mx.__version__} on {mx.default_device()}, {timing}")
    results = [run_shape(s, a, int(b)) for b in a.bits.split(",")
               for s in (TINY if a.tiny else SHAPES) if a.only in s[0]]  # fmt: skip
    if a.json:
        Path(a.json).write_text(json.dumps({"device": str(mx.default_device()), "timing": timing,
                                            "shapes": results}, indent=1))  # fmt: skip
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
