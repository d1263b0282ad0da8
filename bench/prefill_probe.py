"""Which piece of the GPU MoE prefill path ("dequant32") departs from fp32 math?

Random Q4_K experts at 26B-A4B's gate/up widths (E 128, 2F 1408, K 2816), bf16 x, T tokens with
top-8 ids. Prints the relative 2-norm error, against a numpy fp32 product over the same
dequantized weights, of: the GPU dequantizer; gather_mm on the expert-sorted pairs (the path);
gather_mm unsorted; a per-expert matmul loop; and the whole expert_matmul dispatcher. Then the
same for MLX affine 4-bit experts (the MLX 4-bit models' prefill, and mlx-lm's): gather_qmm over
the expert-sorted pairs with sorted_indices on and off (the CUDA path drops the flag since
session 13, which mlx-lm keeps), with the time of each.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests" / "kernels"))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

from gguf import GGMLQuantizationType as GT  # noqa: E402
from test_expert_glu import _experts  # noqa: E402

from hf2q_mlx.custom_kernels import backend  # noqa: E402
from hf2q_mlx.custom_kernels import expert_matmul as EXM  # noqa: E402
from hf2q_mlx.custom_kernels.dequant import (  # noqa: E402
    dequantize_reference,
    ggml_dequantize_kernel,
)


def rel(a, b) -> float:
    a, b = (np.array(v.astype(mx.float32)) if isinstance(v, mx.array) else v for v in (a, b))
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main() -> None:
    E, N, K, k = 128, 1408, 2816, 8
    raw = _experts(GT.Q4_K, E, N, K, seed=1)
    w = mx.array(raw)
    ref_w = dequantize_reference(w, GT.Q4_K, K)  # (E, N, K) fp32, plain MLX ops
    gpu_w = ref_w
    if backend() is not None:  # the GPU dequantizer
        flat_w = w.reshape(E * N, -1)
        gpu_w = ggml_dequantize_kernel(flat_w, GT.Q4_K, K, mx.float32).reshape(E, N, K)
    mx.eval(ref_w, gpu_w)
    print(f"dequant kernel vs reference ops: {rel(gpu_w, ref_w):.3e}")
    W = np.array(ref_w)
    for T in (4, 33, 100, 512):
        rng = np.random.default_rng(T)
        x = mx.array(rng.standard_normal((T, K)).astype(np.float32)).astype(mx.bfloat16)
        ids = mx.array(
            np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32)
        )
        xs = np.array(x.astype(mx.float32))
        want = np.einsum("tk,tsnk->tsn", xs, W[np.array(ids)])  # (T, k, N)
        x32 = x.astype(mx.float32)
        w_t = ref_w.swapaxes(-1, -2)
        pairs = mx.broadcast_to(x32[:, None, None, :], (T, k, 1, K))
        unsorted = mx.gather_mm(pairs, w_t, rhs_indices=ids, sorted_indices=False).squeeze(-2)
        flat = ids.flatten()
        order = mx.argsort(flat)
        rows = x32[order // k][:, None, :]
        s = mx.gather_mm(rows, w_t, rhs_indices=flat[order], sorted_indices=True).squeeze(-2)
        sorted_back = s[mx.argsort(order)].reshape(T, k, N)
        s_nosort = mx.gather_mm(rows, w_t, rhs_indices=flat[order], sorted_indices=False)
        nosort_back = s_nosort.squeeze(-2)[mx.argsort(order)].reshape(T, k, N)
        w_tc = mx.contiguous(w_t)  # (E, K, N) in its own row-major buffer
        s_cont = mx.gather_mm(rows, w_tc, rhs_indices=flat[order], sorted_indices=True)
        cont_back = s_cont.squeeze(-2)[mx.argsort(order)].reshape(T, k, N)
        loop = mx.stack(
            [mx.stack([x32[t] @ w_t[int(ids[t, j])] for j in range(k)]) for t in range(T)]
        )
        disp = EXM.expert_matmul(x, w, ids, GT.Q4_K, K)
        mx.eval(unsorted, sorted_back, nosort_back, cont_back, loop, disp)
        print(
            f"T={T:4d} gather_mm unsorted {rel(unsorted, want):.3e}"
            f"  sorted {rel(sorted_back, want):.3e}"
            f"  sorted order, flag off {rel(nosort_back, want):.3e}"
            f"  sorted, contiguous b {rel(cont_back, want):.3e}"
            f"  matmul loop {rel(loop, want):.3e}"
            f"  dispatcher ({EXM.prefill_mode()}) {rel(disp, want):.3e}"
        )
    affine_probe(ref_w)


def affine_probe(ref_w: mx.array, k: int = 8) -> None:
    """gather_qmm over sorted pairs, the flag on and off, against fp32 math on the same
    (dequantized affine) weights; the median of 5 timed runs of each."""
    E, N, K = ref_w.shape
    wq, scales, biases = mx.quantize(ref_w, group_size=64, bits=4)
    W = np.array(mx.dequantize(wq, scales, biases, group_size=64, bits=4))  # (E, N, K)
    for T in (33, 512, 2048):
        rng = np.random.default_rng(T + 7)
        x = mx.array(rng.standard_normal((T, K)).astype(np.float32)).astype(mx.bfloat16)
        ids = mx.array(np.stack([rng.choice(E, k, replace=False) for _ in range(T)]), mx.int32)
        want = np.einsum("tk,tsnk->tsn", np.array(x.astype(mx.float32)), W[np.array(ids)])
        flat = ids.flatten()
        order = mx.argsort(flat)
        rows = x[order // k][:, None, :]
        out, took = {}, {}
        for flag in (True, False):
            times = []
            for _ in range(6):
                tic = time.perf_counter()
                y = mx.gather_qmm(
                    rows, wq, scales, biases, rhs_indices=flat[order], transpose=True,
                    group_size=64, bits=4, sorted_indices=flag,
                )  # fmt: skip
                mx.eval(y)
                times.append(time.perf_counter() - tic)
            out[flag] = y.squeeze(-2)[mx.argsort(order)].reshape(T, k, N)
            took[flag] = sorted(times[1:])[2] * 1e6
        print(
            f"T={T:4d} gather_qmm sorted flag on {rel(out[True], want):.3e} "
            f"({took[True]:.0f} us)  flag off {rel(out[False], want):.3e} ({took[False]:.0f} us)"
        )


if __name__ == "__main__":
    main()
