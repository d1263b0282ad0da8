"""One-time costs of single MLX ops in a fresh process: which library start-up, plan or module
load sits inside a first prefill (issue 15: "the first 512-token prefill under 2 s including
compilation"). Each case is one op at a shape of a real model's prefill, its inputs made from
numpy and evaluated beforehand; it runs twice, evaluated each time. Printed per case: first and
second seconds, the major page faults and bytes read from storage during the first (a fresh
machine reads the big CUDA libraries from disk on first use), and the shared libraries that the
first mapped. Run it as a process's first MLX work, with empty ``CUDA_CACHE_PATH`` and
``MLX_PTX_CACHE_DIR`` for a fresh machine's view; a second run shows the warm one.

    python3 bench/first_ops.py OUT.json [--cases conv1d,sdpa_512]
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hf2q_mlx  # noqa: E402, F401  (before mlx: the CPU BLAS routing)

# isort: split
import mlx.core as mx  # noqa: E402

RNG = np.random.default_rng(0)


def arr(shape, dtype=mx.bfloat16) -> mx.array:
    x = mx.array(RNG.standard_normal(shape, dtype=np.float32)).astype(dtype)
    mx.eval(x)
    return x


def cases() -> dict:
    """name -> (inputs maker, op). Shapes: Qwen3.5-35B-A3B's delta-net (conv width 8,192, 32
    value heads of 128, 64-token chunks) and Gemma-4-26B-A4B's attention (16 heads, 256 / 512)."""
    C, T = 8192, 512
    gqa_mask = lambda L: mx.array(np.tril(np.ones((L, L), bool)))  # noqa: E731
    return {
        "add_f32": (lambda: (arr((T, C), mx.float32),), lambda x: x + 1),
        "matmul_bf16": (lambda: (arr((T, 2048)), arr((2048, 4096))), lambda a, b: a @ b),
        "matmul_f32_batched": (
            lambda: (arr((1, 32, 8, 64, 128), mx.float32), arr((1, 32, 8, 128, 64), mx.float32)),
            lambda a, b: a @ b,
        ),
        "matmul_f32_64": (
            lambda: (arr((1, 32, 8, 64, 64), mx.float32),) * 2,
            lambda a, b: a @ b,
        ),
        "cumsum_f32": (lambda: (arr((1, 32, 8, 64), mx.float32),), lambda x: mx.cumsum(x, -1)),
        "exp_where_f32": (
            lambda: (arr((1, 32, 8, 64, 64), mx.float32),),
            lambda x: mx.exp(mx.where(mx.tril(mx.ones((64, 64), mx.bool_)), x, -mx.inf)),
        ),
        "rms_norm_f32": (
            lambda: (arr((1, T, 16, 128), mx.float32),),
            lambda x: mx.fast.rms_norm(x, None, 1e-6),
        ),
        "concat_bf16": (
            lambda: (arr((1, 3, C)), arr((1, T, C))),
            lambda a, b: mx.concatenate([a, b], axis=1),
        ),
        "conv1d_depthwise_bf16": (
            lambda: (arr((1, T + 3, C)), arr((C, 4, 1))),
            lambda x, w: mx.conv1d(x, w, groups=C),
        ),
        "sigmoid_bf16": (lambda: (arr((1, T, C)),), lambda x: x * mx.sigmoid(x)),
        "sdpa_256_causal": (
            lambda: (arr((1, 16, T, 256)), arr((1, 8, T, 256)), arr((1, 8, T, 256))),
            lambda q, k, v: mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0, mask="causal"),
        ),
        "sdpa_256_boolmask": (
            lambda: (arr((1, 16, T, 256)), arr((1, 8, T, 256)), arr((1, 8, T, 256)), gqa_mask(T)),
            lambda q, k, v, m: mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0, mask=m),
        ),
        "sdpa_512_boolmask": (
            lambda: (arr((1, 16, T, 512)), arr((1, 2, T, 512)), arr((1, 2, T, 512)), gqa_mask(T)),
            lambda q, k, v, m: mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0, mask=m),
        ),
        "argpartition_f32": (
            lambda: (arr((T, 128), mx.float32),),
            lambda x: mx.argpartition(-x, 7, axis=-1)[:, :8],
        ),
        "argsort_i32": (
            lambda: (mx.array(RNG.integers(0, 128, T * 8).astype(np.int32)),),
            lambda x: mx.argsort(x),
        ),
        "softmax_f32": (lambda: (arr((T, 256), mx.float32),), lambda x: mx.softmax(x, -1)),
        "tanh_bf16": (lambda: (arr((T, 4096)),), lambda x: mx.tanh(x / 30.0) * 30.0),
    }


def io_read_bytes() -> int:
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        pass
    return -1


def mapped_libs() -> set[str]:
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return set()
    return {ln.split()[-1].rsplit("/", 1)[-1] for ln in lines if ".so" in ln.split()[-1]}


def run(names: list[str]) -> list[dict]:
    table = cases()
    rows = []
    for name in names:
        make, op = table[name]
        inputs = make()
        times = []
        faults0, read0, libs0 = (
            resource.getrusage(resource.RUSAGE_SELF).ru_majflt,
            io_read_bytes(),
            mapped_libs(),
        )
        for i in range(2):
            t0 = time.perf_counter()
            try:
                mx.eval(op(*inputs))
            except Exception as err:  # noqa: BLE001  (a probe: report and go on)
                rows.append({"case": name, "error": str(err)[:200]})
                break
            times.append(time.perf_counter() - t0)
            if i == 0:
                faults = resource.getrusage(resource.RUSAGE_SELF).ru_majflt - faults0
                read = io_read_bytes() - read0
                libs = sorted(mapped_libs() - libs0)
        else:
            rows.append({"case": name, "first_s": times[0], "second_s": times[1],
                         "major_faults": faults, "read_mb": read / 1e6,
                         "new_libs": libs})  # fmt: skip
        r = rows[-1]
        if "error" in r:
            print(f"{name:24s} error: {r['error']}", flush=True)
        else:
            print(f"{name:24s} first {r['first_s']:7.3f} s  second {r['second_s']:7.4f} s  "
                  f"major faults {faults:6d}  read {r['read_mb']:7.1f} MB  new libs {libs}",
                  flush=True)  # fmt: skip
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="JSON file to write")
    p.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    args = p.parse_args()
    names = args.cases.split(",") if args.cases else list(cases())
    unknown = [n for n in names if n not in cases()]
    if unknown:
        p.error(f"unknown cases {unknown}; known: {', '.join(cases())}")
    t0 = time.perf_counter()
    rows = run(names)
    out = {"device": str(mx.default_device()), "mlx": mx.__version__, "rows": rows,
           "total_s": time.perf_counter() - t0}  # fmt: skip
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"total {out['total_s']:.2f} s; wrote {args.out}")


if __name__ == "__main__":
    main()
