"""Where a dense GGML linear's prefill time goes: Gemma-4-31B's four Q4_K linears at T tokens
of bf16 x (issue 15: our 31B prefill ran 0.72x mlx-lm's; a 512-token prefill spent ~0.42 s in
the 240 GGML linears, ~7 ms a layer, several times what their bytes and FLOPs cost).

For each (shape, T), in interleaved rounds in one process (CUPTI kernel time when torch sees
the GPU, else wall time), median [min-max] of:
  ours     ``qmatmul.ggml_matmul`` (past 64 rows: the GPU dequantizer by row chunks, then
           ``mx.matmul`` in bf16), with its time split by kernel (dequant, GEMM, the rest);
  dequant  ``dequant.ggml_dequantize_kernel`` of the whole weight alone (GB/s moved: the Q4_K
           bytes read plus the bf16 written, against the copy bandwidth);
  matmul   ``x @ W.T`` on a bf16 weight dequantized beforehand (the floor of our path);
  mlx q4   ``mx.quantized_matmul`` on the same shape as MLX affine 4-bit, group 64 (mlx-lm's
           kernel for these weights);
  ours staged, dequant staged  (GPU) the same with ``HF2Q_DEQUANT_STAGED=1`` (the dequantizer's
           stores through shared memory, 16-byte words; "ours staged" prints its error to
           ``ours``, which must be 0: same bits);
  grouped  (CUDA) ``HF2Q_DENSE_PREFILL=grouped``'s path (``expert_mma.dense_grouped_matmul``:
           the MoE prefill's wide grouped down kernel with one expert every token chose at
           weight 1, a Q4_K GEMM that never writes a dequantized weight), at the default n-tiles
           and as "grouped nt4" at HF2Q_GROUPED_WIDE_NT=4 (its relative error to ``ours`` is
           printed).

    python3 bench/dense_prefill.py OUT.json
    python3 bench/dense_prefill.py OUT.json --tiny --rounds 1     # CPU smoke run (wall time)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import mlx.core as mx
from gguf import GGMLQuantizationType as GT

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from turboquant_speed import cupti_profiler, kernel_time  # noqa: E402

from hf2q_mlx.custom_kernels import backend  # noqa: E402
from hf2q_mlx.custom_kernels import expert_mma as EM  # noqa: E402
from hf2q_mlx.custom_kernels import qmatmul as Q  # noqa: E402
from hf2q_mlx.custom_kernels.dequant import (  # noqa: E402
    dequantize_reference,
    ggml_dequantize_kernel,
)
from hf2q_mlx.io.random_weights import random_ggml_blocks  # noqa: E402

# (label, N out, K in): Gemma-4-31B's q|k|v, o, gate|up and down projections
SHAPES = [("qkv", 16384, 5376), ("o", 5376, 8192), ("gate_up", 43008, 5376), ("down", 5376, 21504)]
TINY = [("tiny_in", 512, 256), ("tiny_out", 256, 512)]
# kernel kinds by substrings of their lower-cased names (cuBLAS / CUTLASS GEMMs, MLX's affine
# quantized matmuls); anything else counts as "rest" (copies, casts, concatenation)
KINDS = [("dequant", ("dequant",)), ("gemm", ("gemm", "cutlass", "xmma", "sm90")),
         ("qmm", ("qmm", "quantized", "affine"))]  # fmt: skip


def kernel_kind(name: str) -> str:
    """KINDS' kind of a CUDA kernel name, else "rest"."""
    n = name.lower()
    return next((kd for kd, parts in KINDS if any(q in n for q in parts)), "rest")


def timed(fn, prof_on: bool) -> tuple[float, dict[str, float]]:
    """us of one evaluated call: CUPTI kernel time by KINDS where available, else wall."""
    return kernel_time(fn, prof_on, kernel_kind)


def dequantize(w: mx.array, k: int) -> mx.array:
    """The GPU dequantizer, or the reference where no GPU back end runs (the CPU smoke run)."""
    if backend() is None:
        return dequantize_reference(w, GT.Q4_K, k).astype(mx.bfloat16)
    return ggml_dequantize_kernel(w, GT.Q4_K, k, mx.bfloat16)


def grouped(x: mx.array, w: mx.array, k: int):
    """The one-expert grouped prefill, or None where its kernels do not take the call."""
    return EM.dense_grouped_matmul(x, w, GT.Q4_K, k)


def with_env(env: dict[str, str], fn, *args):
    """fn(*args) with ``env`` set (the switches are read at each call), restored after."""
    old = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        return fn(*args)
    finally:
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def copy_gbps(prof_on: bool) -> float:
    a = mx.random.randint(0, 1 << 30, (1 << 28,), dtype=mx.uint32)  # 1 GiB
    mx.eval(a)
    timed(lambda: a ^ 1, prof_on)
    us = statistics.median(timed(lambda: a ^ 1, prof_on)[0] for _ in range(5))
    return 2 * a.nbytes / us / 1e3


def run_case(label: str, n: int, k: int, t: int, a) -> dict:
    w = random_ggml_blocks(n, k, GT.Q4_K, seed=1)
    x = mx.random.normal((t, k), key=mx.random.key(2)).astype(mx.bfloat16)
    wd = dequantize(w, k)
    wq = mx.quantize(wd, group_size=64, bits=4)
    mx.eval(w, x, wd, wq)
    cases = {
        "ours": lambda: Q.ggml_matmul(x, w, GT.Q4_K, k),
        "dequant": lambda: dequantize(w, k),
        "matmul": lambda: x @ wd.T,
        "mlx q4": lambda: mx.quantized_matmul(x, *wq, transpose=True, group_size=64, bits=4),
    }
    if backend() is not None:  # the dequantizer's stores staged through shared memory
        st = {"HF2Q_DEQUANT_STAGED": "1"}
        cases["ours staged"] = lambda: with_env(st, Q.ggml_matmul, x, w, GT.Q4_K, k)
        cases["dequant staged"] = lambda: with_env(st, dequantize, w, k)
    nt2 = {"HF2Q_DENSE_PREFILL": "grouped"}
    nt4 = {**nt2, "HF2Q_GROUPED_WIDE_NT": "4"}
    if backend() == "cuda" and with_env(nt2, grouped, x, w, k) is not None:  # kernels take it
        cases["grouped"] = lambda: with_env(nt2, grouped, x, w, k)
        cases["grouped nt4"] = lambda: with_env(nt4, grouped, x, w, k)
    outs = {}
    for c, f in cases.items():  # warm-up: compile, allocate; the outputs compared below
        outs[c] = f()
        mx.eval(outs[c])
        timed(f, a.cupti)
    us = {c: [] for c in cases}
    kinds = {c: {} for c in cases}
    for _ in range(a.rounds):
        for c, f in cases.items():
            total, by = timed(f, a.cupti)
            us[c].append(total)
            for kd, v in by.items():
                kinds[c][kd] = kinds[c].get(kd, 0.0) + v / a.rounds
    flops = 2.0 * t * n * k
    moved = w.nbytes + n * k * 2  # the dequantizer reads the blocks, writes bf16
    ref = outs["ours"].astype(mx.float32)
    scale = mx.abs(ref).max().item() or 1.0
    compared = [c for c in outs if c in ("matmul", "ours staged") or c.startswith("grouped")]
    errs = {c: mx.abs(outs[c].astype(mx.float32) - ref).max().item() / scale for c in compared}
    row = {"shape": label, "N": n, "K": k, "T": t, "us": {}, "kernels_us": kinds,
           "max_err_vs_ours": errs}  # fmt: skip
    print(f"\n{label} {n} x {k}, T {t}: us per call, median [min-max]")
    for c in cases:
        med = statistics.median(us[c])
        row["us"][c] = {"median": med, "min": min(us[c]), "max": max(us[c])}
        rate = (
            f"{moved / med / 1e3:7.0f} GB/s"
            if c.startswith("dequant")
            else f"{flops / med / 1e6:7.1f} TFLOP/s"
        )
        split = " ".join(f"{kd} {v:.0f}" for kd, v in sorted(kinds[c].items()))
        err = f"  err {errs[c]:.1e}" if c in errs else ""
        print(f"  {c:14s} {med:10.1f} [{min(us[c]):.1f}-{max(us[c]):.1f}]  {rate}  {split}{err}")
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="JSON file to write")
    p.add_argument("--tokens", default="512,2048", help="T values, comma list")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tiny", action="store_true", help="small shapes (CPU smoke run)")
    p.add_argument("--no-cupti", dest="cupti", action="store_false", help="wall time only")
    a = p.parse_args(argv)
    tokens = [int(v) for v in a.tokens.split(",") if v]
    if a.rounds < 1 or not tokens or min(tokens) < 1:
        p.error("--rounds and every --tokens value must be >= 1")
    a.cupti = a.cupti and cupti_profiler() is not None
    gbps = copy_gbps(a.cupti)
    timing = "CUPTI kernel time" if a.cupti else "wall time"
    print(f"mlx {mx.__version__} on {mx.default_device()}, {timing}, copy {gbps:.0f} GB/s")
    rows = [run_case(*s, t, a) for t in tokens for s in (TINY if a.tiny else SHAPES)]
    Path(a.out).write_text(json.dumps({"device": str(mx.default_device()), "timing": timing,
                                       "copy_GBps": gbps, "rows": rows}, indent=1))  # fmt: skip
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
