"""Stacked expert weights shared by the MoE architectures (Gemma 4 26B-A4B, Qwen 3.5 MoE): float,
raw GGML blocks or MLX-quantized, multiplied for the selected experts only."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from hf2q_mlx.custom_kernels.dequant import DENSE_TYPES, row_bytes
from hf2q_mlx.custom_kernels.expert_matmul import expert_matmul, gathered_matmul


class ExpertLinear(nn.Module):
    """E stacked linear maps, weight (E, out, in); ``ggml_type`` set = raw GGML block rows.

    ``__call__(x, expert_ids)``: x (..., in) or (..., k, in), ids (..., k) -> (..., k, out).
    """

    def __init__(
        self, num_experts: int, in_features: int, out_features: int, ggml_type: int | None = None
    ):
        super().__init__()
        self.in_features = in_features
        self.ggml_type = ggml_type
        if ggml_type is None:
            self.weight = mx.zeros((num_experts, out_features, in_features))
        else:
            cols = row_bytes(ggml_type, in_features)
            self.weight = mx.zeros((num_experts, out_features, cols), dtype=mx.uint8)

    def __call__(self, x: mx.array, expert_ids: mx.array) -> mx.array:
        return expert_matmul(x, self.weight, expert_ids, self.ggml_type, self.in_features)

    def to_ggml(self, ggml_type: int) -> ExpertLinear:
        """An empty copy holding raw GGML blocks of ``ggml_type`` (filled by load_weights);
        F32/F16/BF16 experts stay plain float weights (itself)."""
        if ggml_type in DENSE_TYPES:
            return self
        E, N, _ = self.weight.shape
        return ExpertLinear(E, self.in_features, N, ggml_type)

    def to_quantized(
        self, group_size: int | None = None, bits: int | None = None, mode: str = "affine", **_
    ) -> QuantizedExpertLinear:
        """MLX affine quantization of the float weight (called by ``nn.quantize``)."""
        if self.ggml_type is not None:
            raise ValueError("GGML expert weights cannot be re-quantized")
        return QuantizedExpertLinear.from_weight(self.weight, group_size or 64, bits or 4, mode)


class QuantizedExpertLinear(nn.Module):
    """``ExpertLinear`` with MLX-quantized weights, multiplied by ``mx.gather_qmm``."""

    def __init__(self, weight, scales, biases, group_size: int, bits: int, mode: str):
        super().__init__()
        self.weight, self.scales = weight, scales
        if biases is not None:
            self.biases = biases
        self.group_size, self.bits, self.mode = group_size, bits, mode

    @classmethod
    def from_weight(cls, w: mx.array, group_size: int, bits: int, mode: str = "affine"):
        q = mx.quantize(w, group_size=group_size, bits=bits, mode=mode)
        return cls(q[0], q[1], q[2] if len(q) > 2 else None, group_size, bits, mode)

    def __call__(self, x: mx.array, expert_ids: mx.array) -> mx.array:
        def matmul(rows, ids, sorted_indices):
            return mx.gather_qmm(
                rows, self.weight, self.scales, self.get("biases"), rhs_indices=ids,
                transpose=True, group_size=self.group_size, bits=self.bits, mode=self.mode,
                sorted_indices=sorted_indices,
            )  # fmt: skip

        return gathered_matmul(x, expert_ids, matmul)
