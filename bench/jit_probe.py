"""What a fresh process pays the first time it runs an op on the GPU (MLX CUDA back end probe).

Session 15's first-prefill profile (bench/first_prefill.py) put ~1.5 s on the first call of
each of several ops, with MLX's PTX disk cache warm as much as cold. This times single ops the
first and the second time in one process: a large first allocation, a cuBLAS matmul, cuDNN
attention, a trivial ``mx.fast.cuda_kernel``, and some of ours (softcap, post_norm_residual,
through custom_kernels/cuda_cache when HF2Q_CUDA_KERNEL_CACHE=1). It then lists MLX's PTX
cache (session 15: MLX 0.32.4 writes none for custom kernels) and cuda_cache's status. Run it
twice with the same MLX_PTX_CACHE_DIR (cold, then warm); inputs are made and evaluated before
each timed call, so a time is the op's alone.

    MLX_PTX_CACHE_DIR=/tmp/p python3 bench/jit_probe.py --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offset_probe import copy_kernel, run  # noqa: E402  (a one-line mx.fast.cuda_kernel)

from hf2q_mlx.custom_kernels import cuda_cache  # noqa: E402
from hf2q_mlx.custom_kernels.post_norm_residual import post_norm_residual  # noqa: E402
from hf2q_mlx.custom_kernels.softcap import softcap  # noqa: E402


def cases():
    """(label, inputs maker, op): the maker's arrays are evaluated before the op is timed."""
    bf = mx.bfloat16
    rn = mx.random.normal
    copy = copy_kernel() if mx.cuda.is_available() else None
    H = 2816

    def pnr(a):
        return post_norm_residual(a[0], a[1], a[2], a[3], 1e-6)

    return [
        ("small builtin op (context, first kernel)", lambda: [mx.ones((4,))], lambda a: a[0] + 1),
        ("fill 512 MB, new buffer", lambda: [], lambda a: mx.full((1 << 28,), 1.0, bf)),
        ("fill 512 MB again", lambda: [], lambda a: mx.full((1 << 28,), 2.0, bf)),
        (
            "matmul bf16 512x2816x2816 (cuBLAS)",
            lambda: [rn((512, H)).astype(bf), rn((H, H)).astype(bf)],
            lambda a: a[0] @ a[1],
        ),  # fmt: skip
        (
            "matmul again, other shape",
            lambda: [rn((512, H)).astype(bf), rn((H, 704)).astype(bf)],
            lambda a: a[0] @ a[1],
        ),  # fmt: skip
        (
            "sdpa causal (1,16,512,256) (cuDNN)",
            lambda: [rn((1, 16, 512, 256)).astype(bf)] * 3,
            lambda a: mx.fast.scaled_dot_product_attention(*a, scale=1.0, mask="causal"),
        ),  # fmt: skip
        (
            "sdpa again, head dim 512",
            lambda: [rn((1, 16, 512, 512)).astype(bf)] * 3,
            lambda a: mx.fast.scaled_dot_product_attention(*a, scale=1.0, mask="causal"),
        ),  # fmt: skip
        ("trivial custom kernel", lambda: [rn((4096,))], lambda a: run(copy, a[0])),
        ("trivial custom kernel again", lambda: [rn((8192,))], lambda a: run(copy, a[0])),
        (
            "softcap (1,512,2816) bf16",
            lambda: [rn((1, 512, H)).astype(bf)],
            lambda a: softcap(a[0], 30.0),
        ),  # fmt: skip
        ("softcap again", lambda: [rn((1, 512, H)).astype(bf)], lambda a: softcap(a[0], 30.0)),
        (
            "softcap (1,512,262144) bf16",
            lambda: [rn((1, 512, 262144)).astype(bf)],
            lambda a: softcap(a[0], 30.0),
        ),  # fmt: skip
        (
            "post_norm_residual (1,512,2816) bf16",
            lambda: [rn((1, 512, H)).astype(bf)] * 2 + [rn((H,)).astype(bf)] * 2,
            pnr,
        ),  # fmt: skip
        (
            "post_norm_residual again",
            lambda: [rn((1, 512, H)).astype(bf)] * 2 + [rn((H,)).astype(bf)] * 2,
            pnr,
        ),  # fmt: skip
    ]


def cache_listing(since: float) -> dict:
    d = Path(os.environ.get("MLX_PTX_CACHE_DIR", f"/tmp/mlx/{mx.__version__}/ptx"))
    files = sorted(d.glob("*.ptx")) if d.is_dir() else []
    return {
        "dir": str(d),
        "files": len(files),
        "longest_name": max((len(f.name) for f in files), default=0),
        "written_now": [f.name for f in files if f.stat().st_mtime >= since],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if not mx.cuda.is_available():
        print("no CUDA device: nothing to probe")
        return
    start = time.time()
    rows = []
    for label, make, op in cases():
        args = make()
        mx.eval(args)
        mx.synchronize()
        tic = time.perf_counter()
        mx.eval(op(args))
        mx.synchronize()
        rows.append({"case": label, "s": time.perf_counter() - tic})
        print(f"{label:<45}{rows[-1]['s']:>9.3f} s", flush=True)
    listing = cache_listing(start)
    print(f"PTX cache {listing['dir']}: {listing['files']} files, longest name "
          f"{listing['longest_name']} chars; written by this process: "
          f"{len(listing['written_now'])}")  # fmt: skip
    for n in listing["written_now"]:
        print(f"  {n}")
    ours = cuda_cache.status()
    print(f"hf2q cuda_cache: {ours}")
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "cache": listing, "cuda_cache": ours},
                                           indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
