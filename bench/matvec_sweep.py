"""Launch shapes of ``custom_kernels/dense_matvec.py`` at real shapes: GB/s against the copy
bandwidth (issue 15: the 31B reads its weights at 37-40 % of it).

For each (N, K) weight and each (W SIMD groups, R rows) configuration, a chain of ``--chain``
one-row mat-vecs (each fed a fresh slice of one x, so no two run side by side) timed under
CUPTI: the kernel's median duration, the weight bytes it read per microsecond, and that as a
share of a device-to-device copy's bandwidth measured in the same process. ``launch_shape``'s
own choice is marked. MLX affine 4-bit weights (group 64) by default, ``--float`` for bf16.

    python3 bench/matvec_sweep.py --json /tmp/out/matvec_sweep.json            # H200 (CUPTI)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import decode_profile as dp  # noqa: E402  (CUPTI kernel list)
from speed_table import copy_bandwidth  # noqa: E402

from hf2q_mlx.custom_kernels import dense_matvec as DM  # noqa: E402

# (name, N, K): Gemma-4-31B's attention (q | k | v), gate | up, down and lm_head; Qwen3.5-9B's
# gate | up and down
SHAPES = [
    ("31b qkv", 16384, 5376),
    ("31b gate_up", 43008, 5376),
    ("31b down", 5376, 21504),
    ("31b lm_head", 262144, 5376),
    ("9b gate_up", 24576, 4096),
    ("9b down", 4096, 12288),
]
CONFIGS = [{"W": w, "R": r} for w in (1, 2, 4, 8) for r in (1, 2, 4, 8)]


def _weights(n: int, k: int, use_float: bool):
    w = (mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16)
    if use_float:
        return (w,), n * k * 2
    wq, scales, biases = mx.quantize(w, group_size=64, bits=4)
    nbytes = wq.nbytes + scales.nbytes + biases.nbytes
    return (wq, scales, biases), nbytes


def time_config(x, arrays, cfg, chain: int, use_float: bool) -> float:
    """Median CUPTI microseconds of one launch in a chain of ``chain``."""
    from torch.profiler import ProfilerActivity, profile

    def call(i):
        xi = x[i % x.shape[0] : i % x.shape[0] + 1]
        if use_float:
            return DM.float_matvec_kernel(xi, arrays[0], config=cfg)
        return DM.affine_matvec_kernel(xi, *arrays, 64, 4, config=cfg)

    mx.eval([call(i) for i in range(3)])  # builds, first loads
    mx.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        mx.eval([call(i) for i in range(chain)])
        mx.synchronize()
    us = [t for name, t in dp._cuda_kernels(prof) if "matvec" in name]
    return statistics.median(us) if us else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--chain", type=int, default=40)
    ap.add_argument("--float", dest="use_float", action="store_true", help="bf16 weights")
    ap.add_argument("--shapes", default=None, help="comma list of SHAPES names (default: all)")
    a = ap.parse_args(argv)
    if not mx.cuda.is_available() or not dp.cupti_available():
        print("matvec_sweep: needs MLX's CUDA back end and torch's CUPTI profiler")
        return 2
    copy = copy_bandwidth(4.0) or float("nan")
    print(f"mlx {mx.__version__}, copy bandwidth {copy:.0f} GB/s, "
          f"{'bf16' if a.use_float else 'MLX affine 4-bit, group 64'} weights")  # fmt: skip
    wanted = None if a.shapes is None else set(a.shapes.split(","))
    rows = []
    for name, n, k in SHAPES:
        if wanted is not None and name not in wanted:
            continue
        arrays, nbytes = _weights(n, k, a.use_float)
        x = mx.random.normal((8, k)).astype(mx.bfloat16)
        mx.eval(arrays, x)
        chunk = 8 if a.use_float else 32
        chosen = DM.launch_shape(k, n, chunk)
        print(f"{name} (N {n}, K {k}, {nbytes / 1e6:.1f} MB); launch_shape {chosen}")
        for cfg in CONFIGS:
            us = time_config(x, arrays, cfg, a.chain, a.use_float)
            gbs = nbytes / us / 1e3
            mark = " <- launch_shape" if cfg == chosen else ""
            print(f"  W {cfg['W']} R {cfg['R']}: {us:8.1f} us {gbs:7.0f} GB/s "
                  f"{gbs / copy:6.1%}{mark}", flush=True)  # fmt: skip
            rows.append(dict(shape=name, N=n, K=k, bytes=nbytes, **cfg, us=us, gb_s=gbs,
                             of_copy=gbs / copy, chosen=cfg == chosen))  # fmt: skip
    if a.json:
        out = dict(mlx=mx.__version__, copy_gb_s=copy, float=a.use_float, rows=rows)
        Path(a.json).write_text(json.dumps(out, indent=1))
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
