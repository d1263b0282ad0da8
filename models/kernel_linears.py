"""Float and MLX affine linears and embeddings that take our kernels on CUDA at decode sizes.

A CUDA graph step (hf2q_mlx/cuda_graph_step.py) replays kernel launches only: an MLX matmul,
``quantized_matmul``, gather or ``dequantize`` on a token's values cannot be replayed, so a model
with plain float or MLX 4-/8-bit weights could not be captured. ``use_kernels(model)`` (called by
``DecodeStep``) turns its ``nn.Linear``, ``nn.QuantizedLinear``, ``nn.Embedding`` and
``nn.QuantizedEmbedding`` modules into the subclasses below: the same parameters and the same
results elsewhere, and on CUDA (or inside a recording) for 1..32 rows of x the mat-vec kernels of
``custom_kernels/dense_matvec.py``, whose every row is computed alike whatever the number of rows
(a batched lm_head's rows equal the single-stream logits bit for bit), and the graph ops' row
gathers (``custom_kernels/graph_ops.py``). The compiled step takes them too on CUDA, so the graph
and the compiled step run the same kernels. Metal and the CPU keep MLX's ops.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from hf2q_mlx.custom_kernels import (
    affine_prefill,
    backend,
    dense_matvec,
    env_int,
    expert_glu_affine,
    launch_recorder,
)
from hf2q_mlx.custom_kernels.graph_ops import gather_affine_rows, gather_rows

MAX_ROWS = dense_matvec.MAX_TOKENS  # rows of x the mat-vec kernels take (prompts: affine_prefill)


def _on_cuda() -> bool:
    """Whether the linears take our kernels (their ``*_kernel_covers`` then check the rows): on
    CUDA, or while a graph is recorded."""
    return launch_recorder.active() or backend() == "cuda"


def _affine(layer: nn.Module) -> bool:
    return layer.mode == "affine" and "biases" in layer and layer.bits in (4, 8)


def _float_linear(x, w, bias):
    if _on_cuda() and dense_matvec.float_kernel_covers(x, w, bias):
        return dense_matvec.float_matvec(x, w, bias)
    return None


def _affine_linear(layer, x, bias):
    if _on_cuda() and _affine(layer):
        args = (layer.weight, layer.scales, layer.biases, layer.group_size, layer.bits)
        if dense_matvec.affine_kernel_covers(x, *args, bias):
            return dense_matvec.affine_matvec(x, *args, bias)
        if affine_prefill.covers(x, *args):  # a prompt: dequantized chunks, then cuBLAS
            return affine_prefill.affine_matmul(x, *args, bias)
    return None


def _affine_glu(layer, x: mx.array, kind: str) -> mx.array | None:
    """act(gate) * up of ``layer``'s fused [gate | up] rows in one launch
    (``expert_glu_affine.dense_glu_affine``: the affine experts' GLU kernel over one expert), so
    a decode's dense MLP skips the separate activation launch and the gate / up rounding between
    them; None where it does not apply (the caller runs the linear, then the activation)."""
    if not (_on_cuda() and _affine(layer)) or "bias" in layer:
        return None
    if env_int("HF2Q_AFFINE_DENSE_GLU", 0, 1) == 0:  # 0: the mat-vec, then the activation
        return None
    w = (layer.weight, layer.scales, layer.biases)
    return expert_glu_affine.dense_glu_affine(x, w, layer.group_size, layer.bits, kind)


class KernelLinear(nn.Linear):
    def __call__(self, x: mx.array) -> mx.array:
        y = _float_linear(x, self.weight, self.get("bias"))
        return super().__call__(x) if y is None else y


class KernelQuantizedLinear(nn.QuantizedLinear):
    def __call__(self, x: mx.array) -> mx.array:
        y = _affine_linear(self, x, self.get("bias"))
        return super().__call__(x) if y is None else y

    def glu(self, x: mx.array, kind: str) -> mx.array | None:
        """``act(gate) * up`` of fused [gate | up] rows in one launch (``ops.gated_projection``),
        or None: then the caller runs this linear and the activation."""
        return _affine_glu(self, x, kind)


class KernelEmbedding(nn.Embedding):
    def __call__(self, ids: mx.array) -> mx.array:
        w = self.weight
        if not launch_recorder.active() or ids.dtype != mx.int32:
            return super().__call__(ids)
        # the raw bytes of the rows: bit-equal to MLX's gather
        rows = gather_rows(w.view(mx.uint8), ids)  # (..., D * itemsize) uint8
        return rows.view(w.dtype)

    def as_linear(self, x: mx.array) -> mx.array:
        y = _float_linear(x, self.weight, None)
        return super().as_linear(x) if y is None else y


class KernelQuantizedEmbedding(nn.QuantizedEmbedding):
    def __call__(self, ids: mx.array) -> mx.array:
        if not _affine(self):
            return super().__call__(ids)
        # a kernel when recorded or on CUDA, MLX's dequantize of the rows elsewhere
        return gather_affine_rows(self.weight, self.scales, self.biases, ids.astype(mx.int32),
                                  self.group_size, self.bits)  # fmt: skip

    def as_linear(self, x: mx.array) -> mx.array:
        y = _affine_linear(self, x, None)
        return super().as_linear(x) if y is None else y


_KERNEL_CLASS = {
    nn.Linear: KernelLinear,
    nn.QuantizedLinear: KernelQuantizedLinear,
    nn.Embedding: KernelEmbedding,
    nn.QuantizedEmbedding: KernelQuantizedEmbedding,
}


def use_kernels(model: nn.Module) -> int:
    """Turn ``model``'s MLX linears and embeddings into the kernel-taking subclasses (same
    parameters, no copies; idempotent) -> how many changed."""
    n = 0
    for _, module in model.named_modules():
        kind = _KERNEL_CLASS.get(type(module))
        if kind is not None:
            module.__class__ = kind
            n += 1
    return n
