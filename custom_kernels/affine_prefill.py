"""MLX affine (4-/8-bit) linears at prompt sizes on CUDA: the weight dequantized in chunks of
rows by our kernel (``graph_ops.affine_rows_kernel`` over each chunk's rows, MLX's dequantize
arithmetic), each chunk then one MLX matmul (cuBLAS), as the GGML many-rows path does.

Why: MLX 0.32.4's CUDA ``quantized_matmul`` compiles each of its GEMM variants at first use on
a machine (a fresh H100's first 512-token prefill of Gemma-4-31B in MLX 4-bit took 45.6 s in
session 38) and ran 31B's linears at 2,471 us on q|k|v at 2,048 tokens against 462 us for the
plain bf16 matmul of that shape (``bench/dense_prefill.py``, "mlx q4"). ``HF2Q_AFFINE_PREFILL``
(read per call; ``1`` on, ``0`` off, unset: on with MLX's CUDA back end). Session 39 (H100,
31B MLX 4-bit, ``bench/prefill.py``, 3 rounds): 1,716 -> 2,240 tok/s at 512 tokens, 2,038 ->
4,854 at 2,048 (mlx-lm 1,736 / 2,034 in the same rounds).
"""

from __future__ import annotations

import math

import mlx.core as mx

from hf2q_mlx.custom_kernels import backend, env_int, row_threads
from hf2q_mlx.custom_kernels.dense_matvec import MAX_TOKENS
from hf2q_mlx.custom_kernels.graph_ops import affine_rows_kernel
from hf2q_mlx.custom_kernels.qmatmul import dequant_matmul

_IDS: dict[int, mx.array] = {}  # row count -> arange(rows) int32, made once


def _ids(m: int) -> mx.array:
    ids = _IDS.get(m)
    if ids is None:
        ids = _IDS[m] = mx.arange(m, dtype=mx.int32)
        mx.eval(ids)
    return ids


def enabled() -> bool:
    """The switch: ``1`` on, ``0`` off, unset on with MLX's CUDA back end (the only back end
    ``covers`` takes; Metal's quantized_matmul is not compiled at first use)."""
    on = env_int("HF2Q_AFFINE_PREFILL", 0, 1)
    return backend() == "cuda" if on is None else on == 1


def covers(x, wq, scales, biases, group_size: int, bits: int) -> bool:
    """True when :func:`affine_matmul` takes ``x``: the switch on, MLX's CUDA back end, more
    rows than the mat-vec kernels take, x in the weights' half dtype (an fp32 x would run as
    TF32 in MLX's CUDA matmul), 4-/8-bit codes with biases."""
    D = scales.shape[-1] * group_size
    return (
        enabled()
        and backend() == "cuda"
        and math.prod(x.shape[:-1]) > MAX_TOKENS
        and bits in (4, 8)
        and biases is not None
        and x.dtype == scales.dtype == biases.dtype
        and x.dtype in (mx.bfloat16, mx.float16)
        and x.shape[-1] == D
        and wq.shape[-1] * 32 == D * bits
        and row_threads(D) > 0
    )


def affine_matmul(x, wq, scales, biases, group_size: int, bits: int, bias=None) -> mx.array:
    """x (..., D) @ dequantize(wq, scales, biases).T (+ bias) -> (..., N): chunks of whole
    multiples of 128 rows (an odd chunk is an odd GEMM dimension), each dequantized then
    multiplied (``qmatmul.dequant_matmul``, the GGML path's chunking)."""

    def rows(r: int, m: int) -> mx.array:  # (m, D): rows r .. r + m of W
        return affine_rows_kernel(wq[r : r + m], scales[r : r + m], biases[r : r + m], _ids(m),
                                  group_size, bits)  # fmt: skip

    y = dequant_matmul(x, wq.shape[0], x.shape[-1], rows)
    return y if bias is None else y + bias
