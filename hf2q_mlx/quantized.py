"""Linear and embedding layers whose weights stay in GGML block layout (raw uint8 rows)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from gguf import GGMLQuantizationType as T

from .custom_kernels.dequant import DENSE_TYPES, dequantize_reference, row_bytes
from .custom_kernels.qmatmul import ggml_matmul
from .errors import WeightMismatchError


class _GGMLModule(nn.Module):
    """Checks every weight assigned to it (``load_weights``, ``update``, attribute set), so a
    wrongly shaped or dequantized tensor fails at load with the layer's expected layout."""

    def _init_layout(self, rows: int, cols: int, ggml_type: int) -> None:
        # Python ints, not arrays or tuples: mlx.nn keeps those in the parameter tree.
        self.ggml_type = ggml_type
        self.row_bytes = row_bytes(ggml_type, cols)
        self._rows = rows

    @property
    def weight_shape(self) -> tuple[int, int]:
        return (self._rows, self.row_bytes)

    def __setitem__(self, key, value):
        if key == "weight" and isinstance(value, mx.array):
            if value.shape != self.weight_shape or value.dtype != mx.uint8:
                raise WeightMismatchError(
                    f"{type(self).__name__} ({self._extra_repr()}) expects a uint8 weight of "
                    f"shape {self.weight_shape} (raw GGML blocks), got {value.dtype} {value.shape}"
                )
        elif key == "bias" and isinstance(value, mx.array):
            if value.shape != self.weight_shape[:1]:
                raise WeightMismatchError(
                    f"{type(self).__name__} ({self._extra_repr()}) expects a bias of shape "
                    f"{self.weight_shape[:1]}, got {value.shape}"
                )
        super().__setitem__(key, value)


class GGMLLinear(_GGMLModule):
    """y = x @ W.T (+ b) with W (out_features, in_features) kept as GGML blocks."""

    def __init__(self, in_features: int, out_features: int, ggml_type: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self._init_layout(out_features, in_features, ggml_type)
        self.weight = mx.zeros(self.weight_shape, dtype=mx.uint8)
        if bias:
            self.bias = mx.zeros((out_features,))

    def _extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, {T(self.ggml_type).name}"

    def __call__(self, x: mx.array) -> mx.array:
        """x (..., in_features) -> (..., out_features) in x.dtype."""
        y = ggml_matmul(x, self.weight, self.ggml_type, self.in_features)
        return y + self.bias.astype(y.dtype) if "bias" in self else y


class GGMLEmbedding(_GGMLModule):
    """Token embedding table of GGML blocks: looks up raw rows, then dequantizes only those."""

    def __init__(self, num_embeddings: int, dims: int, ggml_type: int):
        super().__init__()
        self.num_embeddings, self.dims = num_embeddings, dims
        self._init_layout(num_embeddings, dims, ggml_type)
        self.weight = mx.zeros(self.weight_shape, dtype=mx.uint8)

    def _extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.dims}, {T(self.ggml_type).name}"

    def __call__(self, ids: mx.array) -> mx.array:
        """ids (...) int -> (..., dims) fp32."""
        return dequantize_reference(self.weight[ids], self.ggml_type, self.dims)

    def as_linear(self, x: mx.array) -> mx.array:
        """x (..., dims) -> logits (..., num_embeddings) in x.dtype (tied output head)."""
        return ggml_matmul(x, self.weight, self.ggml_type, self.dims)


def _child(parent, key: str):
    if isinstance(parent, list):
        return parent[int(key)] if key.isdigit() and int(key) < len(parent) else None
    return parent.get(key) if isinstance(parent, dict) else None


def ggml_quantize_modules(model: nn.Module, ggml_types: dict[str, int]) -> nn.Module:
    """Swap the nn.Linear / nn.Embedding at each dotted path for its GGML layer, in place.

    Call before ``load_weights``. Dense types (F32, F16, BF16) keep their nn layer, which loads
    the plain arrays ``GGUFFile.to_mx`` returns for them.
    """
    for path, ggml_type in ggml_types.items():
        *parents, last = path.split(".")
        parent = model
        for key in parents:
            parent = _child(parent, key)
        layer = _child(parent, last)
        if not isinstance(layer, (nn.Linear, nn.Embedding)):
            found = "nothing" if layer is None else f"a {type(layer).__name__}"
            raise WeightMismatchError(
                f"{path}: expected an nn.Linear or nn.Embedding for a GGML tensor, found {found}"
            )
        if ggml_type in DENSE_TYPES:
            continue
        if isinstance(layer, nn.Linear):
            out_features, in_features = layer.weight.shape
            new = GGMLLinear(in_features, out_features, ggml_type, bias="bias" in layer)
        else:
            new = GGMLEmbedding(*layer.weight.shape, ggml_type)
        parent[int(last) if isinstance(parent, list) else last] = new
    return model
