"""Stacked expert weights shared by the MoE architectures (Gemma 4 26B-A4B, Qwen 3.5 MoE): float,
raw GGML blocks or MLX-quantized, multiplied for the selected experts only."""

from __future__ import annotations

import os
import warnings

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from hf2q_mlx.custom_kernels import affine_q4_1
from hf2q_mlx.custom_kernels.dequant import DENSE_TYPES, row_bytes
from hf2q_mlx.custom_kernels.expert_matmul import expert_matmul, gathered_matmul
from hf2q_mlx.errors import InvalidArgumentError


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


# HF2Q_AFFINE_EXPERTS (read at load): "q4_1" keeps MLX 4-bit routed experts as GGML Q4_1 blocks.
AFFINE_EXPERT_FORMATS = ("affine", "q4_1")


def affine_expert_format() -> str:
    """``HF2Q_AFFINE_EXPERTS``: ``affine`` (unset: MLX's arrays and the affine kernels) or
    ``q4_1`` (:func:`affine_experts_to_q4_1` at load)."""
    text = os.environ.get("HF2Q_AFFINE_EXPERTS", "").strip().lower() or "affine"
    if text not in AFFINE_EXPERT_FORMATS:
        raise InvalidArgumentError(
            f"HF2Q_AFFINE_EXPERTS={text!r}: expected one of {', '.join(AFFINE_EXPERT_FORMATS)}"
        )
    return text


def to_q4_1_experts(m: QuantizedExpertLinear) -> ExpertLinear | None:
    """The same experts as GGML Q4_1 blocks, weight for weight (an affine group of 32 / 64 / 128
    codes is 1 / 2 / 4 blocks of the group's scale and bias), or None where that would round:
    not 4-bit affine, or a scale or bias that fp16 does not hold (``affine_q4_1.fp16_holds``)."""
    arrays = (m.weight, m.scales, m.get("biases"))
    if m.mode != "affine" or not affine_q4_1.transcodes(arrays, m.group_size, m.bits):
        return None
    if not affine_q4_1.fp16_holds(m.scales, m.biases):
        return None
    E, N, words = m.weight.shape
    out = ExpertLinear(E, words * 8, N, affine_q4_1.Q4_1)
    out.weight = affine_q4_1.to_q4_1(*arrays, m.group_size)  # (E, N, K / 32 * 20)
    return out


def affine_experts_to_q4_1(model: nn.Module) -> tuple[int, int]:
    """Every MLX 4-bit routed-expert module of ``model`` replaced by its GGML Q4_1 copy (one at a
    time, each evaluated before the next: the old arrays go as the new arrive, ~11 % more bytes:
    5 bits a weight against 4.5 at group 64), so its experts run the GGML kernels, whose grouped
    ones serve many rows (the affine experts have per-pair kernels only). -> (replaced, kept)."""
    done = kept = 0
    for path, m in list(model.named_modules()):
        if not isinstance(m, QuantizedExpertLinear):
            continue
        q = to_q4_1_experts(m)
        if q is None:
            kept += 1
            continue
        model.update_modules(tree_unflatten([(path, q)]))
        mx.eval(q.weight)
        done += 1
    return done, kept


def apply_affine_expert_format(model: nn.Module) -> tuple[int, int]:
    """:func:`affine_experts_to_q4_1` when ``HF2Q_AFFINE_EXPERTS=q4_1`` (a warning names the
    modules that stay affine); else (0, 0)."""
    if affine_expert_format() != "q4_1":
        return 0, 0
    done, kept = affine_experts_to_q4_1(model)
    if kept:
        warnings.warn(
            f"HF2Q_AFFINE_EXPERTS=q4_1: {kept} of {done + kept} MLX expert modules stay affine "
            "(not 4-bit affine, or scales / biases that fp16 would round)",
            stacklevel=2,
        )
    return done, kept
