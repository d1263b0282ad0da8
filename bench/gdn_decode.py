"""The Qwen 3.5 delta-net decode kernel (``custom_kernels/gated_delta_decode.py``) alone at the
real shape (16 key heads, 32 value heads, 128 x 128 state, conv 4; Qwen3.5-35B-A3B and 9B) and
1 / 8 / 32 rows: its variants in interleaved rounds in one process.

Session 46's profile had it at 13.5 us a call at one row, 28 at 8 and 113 at 32: about 14 us
for each wave of threadgroups (one 512-thread threadgroup an SM), whatever the bytes. Variants:
``preload`` (the new conv state's inputs loaded with the state, ``PRELOAD``) and ``mb2``
(launch bounds for two threadgroups an SM, ``MIN_BLOCKS``: 64 registers, some spilled) against
the loop that loads them after the state's stores. Each evaluation chains ``--chain`` calls
(the state and conv state of one call feed the next); with torch and CUDA present every
evaluation is under CUPTI and the kernel's GPU time per call is reported, else the wall time.
``stream*`` (the state streamed, ``STREAM``: SIMD groups a threadgroup, rows at a time).
Every variant's outputs are checked bit for bit against the first's. Session 47 (H100):
preload no faster (13.8 / 14.2 us at 1 row, 35.1 / 34.8 at 8, 119.1 / 118.3 at 32), bits equal.
Session 53 (H200): the register path 14.4 / 36.6 / 107.9 us at 1 / 8 / 32 rows, stream4
23.8 / 38.0 / 46.1, stream8 17.1 / 31.9 / 51.2, bits equal (the rule: registers below 8 rows,
8 SIMD groups to 31 rows, 4 from 32).

    python3 bench/gdn_decode.py --json bench/results/gdn_decode_h200.json
    python3 bench/gdn_decode.py --tiny --rounds 1 --chain 2      # CPU smoke run (reference)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "kernels"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_gated_delta_decode import bits, make_inputs  # noqa: E402
from turboquant_speed import cupti_profiler, kernel_time  # noqa: E402

from hf2q_mlx.custom_kernels import gated_delta_decode as gdd  # noqa: E402

HEADS = (16, 32, 128, 128)  # key heads, value heads, Dk, Dv
TINY = (2, 4, 32, 16)
PLAIN = {
    "PRELOAD": "0",
    "MIN_BLOCKS": "",
    "STREAM": "0",
    "STREAM_WARPS": 4,
    "STREAM_ROWS": 4,
    "STREAM_WIDE_GROUPS": 0,  # each variant's STREAM_WARPS at every row count
}
VARIANTS = {
    "loop": PLAIN,
    "preload": {**PLAIN, "PRELOAD": "1"},
    "mb2": {**PLAIN, "MIN_BLOCKS": "2"},
    # the state streamed (STREAM_WARPS SIMD groups a threadgroup, STREAM_ROWS rows at a time)
    "stream4": {**PLAIN, "STREAM": "1"},
    "stream8": {**PLAIN, "STREAM": "1", "STREAM_WARPS": 8},
    "stream4r2": {**PLAIN, "STREAM": "1", "STREAM_ROWS": 2},
    "stream2r8": {**PLAIN, "STREAM": "1", "STREAM_WARPS": 2, "STREAM_ROWS": 8},
}


def use(settings: dict) -> None:
    for name, value in settings.items():
        setattr(gdd, name, value)


def run_rows(B: int, a, heads) -> dict:
    hk, hv, dk, dv = heads
    inp = make_inputs(B, hk, hv, dk, dv, seed=B, dtype=mx.bfloat16, module_conv=True)
    inp["active"] = mx.ones((B,), dtype=mx.bool_)  # a static cache's mask, every row on
    mx.eval([v for v in inp.values() if isinstance(v, mx.array)])

    def chain():
        conv, state, outs = inp["conv_state"], inp["state"], []
        for _ in range(a.chain):
            out, conv, state = gdd.gated_delta_decode(**{**inp, "conv_state": conv, "state": state})
            outs.append(out)
        return outs + [conv, state]

    base = {k: getattr(gdd, k) for v in VARIANTS.values() for k in v}
    first, times = {}, {v: [] for v in VARIANTS}
    try:
        for name, v in VARIANTS.items():  # warm-up (compiles), outputs of one call
            use(v)
            first[name] = gdd.gated_delta_decode(**inp)
            mx.eval(first[name])
        for _ in range(a.rounds):
            for name, v in VARIANTS.items():
                use(v)
                t, _ = kernel_time(chain, a.cupti, lambda n: "gdn")
                times[name].append(t / a.chain)
    finally:
        use(base)
    ref = first[next(iter(VARIANTS))]
    state_bytes = 2 * B * hv * dv * dk * 4  # fp32 state read and written
    print(f"\nB {B}: {hv} value heads, state {dv}x{dk} fp32 ({state_bytes / 1e6:.1f} MB moved)")
    rows = []
    for name in VARIANTS:
        med = statistics.median(times[name])
        same = all(np.array_equal(bits(x), bits(y)) for x, y in zip(first[name], ref))
        base_med = statistics.median(times[next(iter(VARIANTS))])
        row = {"variant": name, "us": med, "min": min(times[name]), "max": max(times[name]),
               "vs_first": base_med / med, "GB_s": state_bytes / med / 1e3,
               "bit_equal": same}  # fmt: skip
        rows.append(row)
        print(f"  {name:10s} {med:8.2f} us [{row['min']:.2f}-{row['max']:.2f}]  "
              f"x{row['vs_first']:.2f}  {row['GB_s']:7.1f} GB/s  "
              f"{'bits equal' if same else 'BITS DIFFER'}")  # fmt: skip
    return {"B": B, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--chain", type=int, default=20)
    ap.add_argument("--tiny", action="store_true", help="small heads (CPU smoke run)")
    ap.add_argument("--no-cupti", dest="cupti", action="store_false", help="wall time only")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    timing = "CUPTI kernel time" if a.cupti and cupti_profiler() is not None else "wall time"
    print(f"mlx {mx.__version__} on {mx.default_device()}, {timing}")
    results = [run_rows(B, a, TINY if a.tiny else HEADS) for B in a.batch]
    if a.json:
        Path(a.json).write_text(json.dumps({"device": str(mx.default_device()), "timing": timing,
                                            "rows": results}, indent=1))  # fmt: skip
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
