"""Linear and embedding layers whose weights stay in GGML block layout (raw uint8 rows).

On the CPU (default device the CPU, so no GPU kernel applies, and no ``reference_only()`` /
``HF2Q_KERNELS=reference``) a layer whose type has an exact MLX affine form (Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0, Q3_K, Q4_K, Q5_K: ``custom_kernels/affine_repack.py``) multiplies with
``mx.quantized_matmul`` on a repack built lazily on its first call, instead of dequantizing the
whole weight to fp32 on every call. Memory: the raw blocks stay (they are the parameter that
loads and is checked), and the repack adds about bits + 2 bits per weight (the codes plus an
fp32 scale and bias per 32 weights): 6 for the 4-bit types, 7 for the 5-bit ones, 10 for Q8_0
and Q3_K; on the CPU only. Q2_K and Q6_K keep the dequantize-per-call path; on a GPU
``ggml_matmul`` dispatches as before.
"""

from __future__ import annotations

import os

import mlx.core as mx
import mlx.nn as nn
from gguf import GGMLQuantizationType as T

from . import custom_kernels
from .custom_kernels.affine_repack import GROUP_SIZE, affine_repack
from .custom_kernels.dequant import DENSE_TYPES, dequantize_reference, row_bytes
from .custom_kernels.qmatmul import ggml_matmul
from .errors import WeightMismatchError


def _cpu_affine_path() -> bool:
    """True when the CPU runs the layers and no override forces the reference path."""
    if mx.default_device().type != mx.DeviceType.cpu:
        return False  # on a GPU ggml_matmul picks the kernel (or its reference)
    # backend() is None on the CPU either way; tell a forced reference apart (same checks).
    forced = custom_kernels._forced_reference.get() > 0
    env = os.environ.get(custom_kernels.ENV_VAR, "").strip().lower() == "reference"
    return not (forced or env)


def _affine_matmul(x: mx.array, packed: tuple) -> mx.array:
    """x (..., K) @ W.T for W in affine form: fp32 math like the reference, out in x.dtype."""
    wq, scales, biases, bits = packed
    y = mx.quantized_matmul(
        x.astype(mx.float32), wq, scales, biases, transpose=True, group_size=GROUP_SIZE, bits=bits
    )
    return y.astype(x.dtype)


class _GGMLModule(nn.Module):
    """Checks every weight assigned to it (``load_weights``, ``update``, attribute set), so a
    wrongly shaped or dequantized tensor fails at load with the layer's expected layout."""

    def _init_layout(self, rows: int, cols: int, ggml_type: int) -> None:
        # Python ints, not arrays or tuples: mlx.nn keeps those in the parameter tree.
        self.ggml_type = ggml_type
        self.row_bytes = row_bytes(ggml_type, cols)
        self._rows, self._cols = rows, cols

    def _affine_weight(self) -> tuple | None:
        """(wq, scales, biases, bits) of ``weight`` on the CPU path, else None.

        Built once, lazily (the first forward evaluates it with the rest of its graph), and kept
        in a plain attribute: nn.Module would put a tuple of arrays into the parameter tree.
        Dropped when ``weight`` is assigned; the identity check covers any other way in.
        """
        if not _cpu_affine_path():
            return None
        weight = self["weight"]
        cached = vars(self).get("_affine")
        if cached is None or cached[0] is not weight:
            cached = (weight, affine_repack(weight, self.ggml_type, self._cols))
            object.__setattr__(self, "_affine", cached)
        return cached[1]

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
            vars(self).pop("_affine", None)  # the repack of the old weight
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
        packed = self._affine_weight() if x.shape[-1] == self.in_features else None
        if packed is None:
            y = ggml_matmul(x, self.weight, self.ggml_type, self.in_features)
        else:
            y = _affine_matmul(x, packed)
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
        """ids (...) int -> (..., dims) fp32.

        Always from the raw rows: a gather of a few rows is cheap, and it keeps the reference's
        bits exactly (the affine repack turns its -0.0 under negative scales into +0.0).
        """
        return dequantize_reference(self.weight[ids], self.ggml_type, self.dims)

    def as_linear(self, x: mx.array) -> mx.array:
        """x (..., dims) -> logits (..., num_embeddings) in x.dtype (tied output head)."""
        packed = self._affine_weight() if x.shape[-1] == self.dims else None
        if packed is None:
            return ggml_matmul(x, self.weight, self.ggml_type, self.dims)
        return _affine_matmul(x, packed)


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
