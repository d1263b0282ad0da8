"""Linear and embedding layers whose weights stay in GGML block layout (raw uint8 rows).

On the CPU (default device the CPU, so no GPU kernel applies, and no ``reference_only()`` /
``HF2Q_KERNELS=reference``) the matmul depends on the rows of x:

- up to ``cpu_ext.MAX_ROWS`` (64) rows, for the types it has (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
  Q4_K, Q5_K, Q6_K): the compiled CPU mat-vec (``custom_kernels/cpu_ext``: an MLX C++
  extension built on first use; fp32 math, AVX-512 or AVX2, all cores; a row gets the same
  bits alone and in a batch). Where it cannot be built or
  ``HF2Q_CPU_EXT=0``, the paths below.
- up to ``CPU_QMM_MAX_ROWS`` rows (decode): a layer whose type has an exact MLX affine form
  (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q3_K, Q4_K, Q5_K: ``custom_kernels/affine_repack.py``)
  multiplies with ``mx.quantized_matmul`` on a repack built lazily on its first call. Memory:
  the raw blocks stay (they are the parameter that loads and is checked), and the repack adds
  about bits + 2 bits per weight (the codes plus an fp32 scale and bias per 32 weights): 6 for
  the 4-bit types, 7 for the 5-bit ones, 10 for Q8_0 and Q3_K; on the CPU only. Q2_K and
  Q6_K have no exact affine form: their layers keep an fp32 copy instead (32 bits per weight,
  built on the first few-row call) rather than dequantizing the whole weight on every step.
- more rows (prefill, perplexity): the weight is dequantized per call by chunks of rows and
  multiplied in one fp32 GEMM per chunk, which MLX runs through the BLAS
  ``custom_kernels/cpu_blas.py`` routed it to. MLX's CPU
  ``quantized_matmul`` costs about M times its one-row cost, the dequantize-and-GEMM about the
  same for any M: past a few rows the second wins (docs/cli.md, CPU figures).

On a GPU ``ggml_matmul`` dispatches as before.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from gguf import GGMLQuantizationType as T

from hf2q_mlx import custom_kernels
from hf2q_mlx.custom_kernels import cpu_ext
from hf2q_mlx.custom_kernels.affine_repack import GROUP_SIZE, affine_repack
from hf2q_mlx.custom_kernels.dequant import (
    DENSE_TYPES,
    dequantize_reference,
    ggml_get_rows,
    row_bytes,
)
from hf2q_mlx.custom_kernels.expert_mma import dense_grouped_matmul
from hf2q_mlx.custom_kernels.graph_ops import add_bias
from hf2q_mlx.custom_kernels.qmatmul import ggml_matmul
from hf2q_mlx.errors import WeightMismatchError


def _cpu_affine_path() -> bool:
    """True when the CPU runs the layers and no override forces the reference path."""
    if mx.default_device().type != mx.DeviceType.cpu:
        return False  # on a GPU ggml_matmul picks the kernel (or its reference)
    # backend() is None on the CPU either way; tell a forced reference apart
    return not custom_kernels.reference_forced()


CPU_QMM_MAX_ROWS = 4  # rows of x up to which the CPU multiplies on the affine repack
_CPU_DEQ_CHUNK = 1 << 24  # weight elements dequantized at once on the CPU (64 MB of fp32)


def _cpu_rows(x: mx.array) -> int:
    rows = 1
    for d in x.shape[:-1]:
        rows *= d
    return rows


def _cpu_dequant_matmul(x: mx.array, w_raw: mx.array, ggml_type: int, k: int) -> mx.array:
    """x (..., K) @ W.T on the CPU for many rows: W (N, row_bytes) dequantized by chunks of
    rows to fp32 (the reference dequantizer's exact values), one fp32 GEMM per chunk."""
    n = w_raw.shape[0]
    xf = x.astype(mx.float32)
    step = max(1, _CPU_DEQ_CHUNK // k)
    parts = [
        xf @ dequantize_reference(w_raw[r : r + step], ggml_type, k).T for r in range(0, n, step)
    ]  # each (..., <= step)
    y = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
    return y.astype(x.dtype)


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

    def _cpu_matmul(self, x: mx.array) -> mx.array | None:
        """x @ W.T on the CPU path (see the module docstring), or None off it (GPU, forced
        reference, or an x of the wrong width: ``ggml_matmul`` then checks and reports)."""
        if x.shape[-1] != self._cols or not _cpu_affine_path():
            return None
        # the compiled CPU mat-vec (custom_kernels/cpu_ext) first: None where it cannot run
        y = cpu_ext.ggml_matvec(x, self["weight"], self.ggml_type, self._cols)
        if y is not None:
            return y
        if _cpu_rows(x) > CPU_QMM_MAX_ROWS:
            return _cpu_dequant_matmul(x, self["weight"], self.ggml_type, self._cols)
        packed = self._affine_weight()
        if packed is not None:
            return _affine_matmul(x, packed)
        dense = self._dense_weight()  # (N, K) fp32: no exact affine form (Q2_K, Q6_K)
        return (x.astype(mx.float32) @ dense.T).astype(x.dtype)

    def _dense_weight(self) -> mx.array:
        """``weight`` dequantized to fp32 once (the reference's values), for the few-row CPU
        path of the types without an affine repack; kept and dropped like the repack."""
        weight = self["weight"]
        cached = vars(self).get("_dense")
        if cached is None or cached[0] is not weight:
            cached = (weight, dequantize_reference(weight, self.ggml_type, self._cols))
            object.__setattr__(self, "_dense", cached)
        return cached[1]

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
            vars(self).pop("_dense", None)
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
        y = self._cpu_matmul(x)
        if y is None:  # HF2Q_DENSE_PREFILL=grouped: many rows as a one-expert grouped prefill
            y = dense_grouped_matmul(x, self.weight, self.ggml_type, self.in_features)
        if y is None:
            y = ggml_matmul(x, self.weight, self.ggml_type, self.in_features)
        return add_bias(y, self.bias) if "bias" in self else y  # a kernel when recorded


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

        Always from the raw rows: a gather of a few rows is cheap, and on the CPU it keeps the
        reference's bits exactly (the affine repack turns its -0.0 under negative scales into
        +0.0). On a GPU the rows are dequantized by one kernel (up to one fp32 rounding).
        """
        return ggml_get_rows(self.weight, ids, self.ggml_type, self.dims)

    def as_linear(self, x: mx.array) -> mx.array:
        """x (..., dims) -> logits (..., num_embeddings) in x.dtype (tied output head)."""
        y = self._cpu_matmul(x)
        return ggml_matmul(x, self.weight, self.ggml_type, self.dims) if y is None else y


def _child(parent, key: str):
    if isinstance(parent, list):
        return (
            parent[int(key)] if key.isascii() and key.isdigit() and int(key) < len(parent) else None
        )
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


# ----- fused projections ---------------------------------------------------------------------


def _bias_dtype(layer: nn.Module) -> str | None:
    # dtypes as strings: mx.Dtype does not compare with None
    return str(layer["bias"].dtype) if "bias" in layer else None


def linear_fusion_key(layer: nn.Module) -> tuple | None:
    """What a linear layer must share with others to be stacked into one matmul, or None.

    Layers with equal keys compute each output row from the same input with the same kind of
    weight, so concatenating their weights along the output axis gives one layer whose output is
    theirs side by side: GGML layers of one ``ggml_type`` (raw block rows are independent),
    dense ``nn.Linear`` of one dtype, and mlx affine ``nn.QuantizedLinear`` of one
    mode / group size / bits. Input size and bias presence must match too.
    """
    # the kinds, not the classes: models/kernel_linears.py's subclasses fuse as their bases
    kind = next((k for k in (GGMLLinear, nn.Linear, nn.QuantizedLinear) if isinstance(layer, k)),
                None)  # fmt: skip
    if kind is GGMLLinear:
        return (kind, layer.ggml_type, layer.in_features, _bias_dtype(layer))
    if kind is nn.Linear:
        w = layer["weight"]
        return (kind, str(w.dtype), w.shape[1], _bias_dtype(layer))
    if kind is nn.QuantizedLinear:
        w, scales, biases = layer["weight"], layer["scales"], layer.get("biases")
        return (
            kind,
            layer.mode,
            layer.group_size,
            layer.bits,
            str(w.dtype),
            w.shape[1],
            str(scales.dtype),
            None if biases is None else str(biases.dtype),
            _bias_dtype(layer),
        )
    return None


def fuse_linears(layers: list[nn.Module]) -> nn.Module:
    """One layer equal to ``layers`` side by side: its output is their outputs concatenated on
    the last axis. The layers must have one ``linear_fusion_key`` (ValueError otherwise)."""
    key = linear_fusion_key(layers[0])
    if key is None or any(linear_fusion_key(layer) != key for layer in layers[1:]):
        raise ValueError(f"cannot fuse {[type(layer).__name__ for layer in layers]}")
    first, has_bias = layers[0], "bias" in layers[0]

    def cat(name: str) -> mx.array:
        return mx.concatenate([layer[name] for layer in layers], axis=0)

    if key[0] is GGMLLinear:
        out = sum(layer.out_features for layer in layers)
        fused = GGMLLinear(first.in_features, out, first.ggml_type, bias=has_bias)
        names = ["weight"]
    elif key[0] is nn.Linear:
        out = sum(layer["weight"].shape[0] for layer in layers)
        fused = nn.Linear(first["weight"].shape[1], out, bias=has_bias)
        names = ["weight"]
    else:
        out = sum(layer["weight"].shape[0] for layer in layers)
        in_dims = first["weight"].shape[1] * 32 // first.bits
        fused = nn.QuantizedLinear(
            in_dims, out, has_bias, first.group_size, first.bits, mode=first.mode
        )
        # affine mode has per-group biases, the float-scale modes none (as the constructor makes)
        names = ["weight", "scales"] + (["biases"] if first.get("biases") is not None else [])
    # the constructors' random initial weights are lazy and never evaluated
    fused.update({name: cat(name) for name in names + (["bias"] if has_bias else [])})
    fused.train(first.training)
    return fused


def fused_name(members: tuple[str, ...]) -> str:
    """("q_proj", "k_proj", "v_proj") -> "qkv_proj"; ("gate_proj", "up_proj") -> "gate_up_proj"."""
    stems = [m.removesuffix("_proj") for m in members]
    sep = "" if all(len(stem) == 1 for stem in stems) else "_"
    return sep.join(stems) + "_proj"


def fuse_linear_groups(
    parent: nn.Module, names: tuple[str, ...]
) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Replace the linear layers ``parent.<name>`` by fused layers, one per set of layers with
    one ``linear_fusion_key`` (for instance q and k fused, v apart when only v has another GGML
    type); a layer that fuses with nothing stays as it is, under its name.

    A fused layer is named by ``fused_name`` (q_proj + k_proj -> qk_proj). Returns the groups in
    order of their first member, each as (attribute name, member names); the names that are not
    layers of ``parent`` (fused already) are skipped. Each fused weight is evaluated here, so
    the separate weights are freed layer by layer.
    """
    groups: dict[object, list[str]] = {}
    for i, name in enumerate(names):
        if name not in parent:
            continue
        key = linear_fusion_key(parent[name])
        groups.setdefault(i if key is None else key, []).append(name)
    out = []
    for members in groups.values():
        if len(members) == 1:
            out.append((members[0], tuple(members)))
            continue
        fused = fuse_linears([parent[name] for name in members])
        mx.eval(fused.parameters())
        for name in members:
            delattr(parent, name)
        target = fused_name(tuple(members))
        setattr(parent, target, fused)
        out.append((target, tuple(members)))
    return tuple(out)
