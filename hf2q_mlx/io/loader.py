"""Build a model from a GGUF file, a Hugging Face safetensors directory or an mlx-lm quantized one.

The architecture comes from the model modules' contracts (``hf2q_mlx.models.contract``): the GGUF
``general.architecture`` or the config's ``model_type`` picks the module that declares it.
GGUF tensors keep their GGML blocks (the matching modules become ``GGMLLinear`` /
``GGMLEmbedding``); float tensors and every activation run in the model dtype: float32 on the CPU,
bfloat16 on a GPU, unless ``dtype`` says otherwise.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from hf2q_mlx.errors import (
    CheckpointFormatError,
    GGUFFormatError,
    Hf2qError,
    InvalidArgumentError,
    ModelNotFoundError,
    UnsupportedArchitectureError,
    UnsupportedQuantTypeError,
    WeightMismatchError,
)
from hf2q_mlx.io.malformed_input import (
    PARSE_ERRORS,
    build_model,
    read_safetensors,
    read_tokenizer,
)
from hf2q_mlx.models.contract import Architecture, architectures, find_architecture
from hf2q_mlx.models.experts import apply_affine_expert_format

_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


@dataclass
class ModelInfo:
    """Where a model came from: ``format`` is "gguf", "safetensors" or "mlx" (affine-quantized).

    ``metadata`` is the GGUF key/value metadata or the parsed config.json; ``quantization`` maps
    module paths to GGML type names (GGUF) or holds the mlx ``quantization`` config.
    """

    path: Path
    format: str
    model_type: str
    dtype: mx.Dtype
    metadata: dict[str, Any]
    quantization: dict[str, Any] = field(default_factory=dict)


def default_dtype() -> mx.Dtype:
    """float32 on the CPU device (exact reference runs), bfloat16 on a GPU."""
    return mx.bfloat16 if mx.default_device().type == mx.DeviceType.gpu else mx.float32


def resolve_dtype(dtype: mx.Dtype | str | None) -> mx.Dtype:
    """None -> default_dtype(); "float32" / "float16" / "bfloat16" or the mx dtype itself."""
    if dtype is None:
        return default_dtype()
    resolved = _DTYPES.get(dtype) if isinstance(dtype, str) else dtype
    if not isinstance(resolved, mx.Dtype) or resolved not in _DTYPES.values():
        raise Hf2qError(f"dtype {dtype!r} is not one of {', '.join(_DTYPES)}")
    return resolved


def architecture_for(
    *, model_type: str | None = None, gguf_architecture: str | None = None
) -> Architecture:
    """The declared architecture serving an HF ``model_type`` or a GGUF architecture name."""
    arch = find_architecture(model_type=model_type, gguf_architecture=gguf_architecture)
    if arch is None:
        if gguf_architecture is not None:
            known = sorted(n for a in architectures() for n in a.gguf_architectures)
            what = f"GGUF architecture {gguf_architecture!r}"
        else:
            known = sorted(n for a in architectures() for n in a.model_types)
            what = f"model type {model_type!r}"
        raise UnsupportedArchitectureError(
            f"{what} is not supported (supported: {', '.join(known)})"
        )
    return arch


def check_weights(model: nn.Module, weights: dict[str, mx.array], unknown: list[str] = ()) -> None:
    """Raise WeightMismatchError naming missing, unexpected and wrongly shaped tensors."""
    expected = dict(tree_flatten(model.parameters()))
    problems = []

    def listing(what: str, names: list[str]) -> None:
        if names:
            shown = ", ".join(names[:8]) + (f" (+{len(names) - 8} more)" if len(names) > 8 else "")
            problems.append(f"{what}: {shown}")

    listing("missing tensors", sorted(expected.keys() - weights.keys()))
    listing("unexpected tensors", sorted(weights.keys() - expected.keys()) + list(unknown))
    listing(
        "shape mismatches",
        [
            f"{k} {tuple(weights[k].shape)} != {tuple(expected[k].shape)}"
            for k in sorted(expected.keys() & weights.keys())
            if weights[k].shape != expected[k].shape
        ],
    )
    if problems:
        raise WeightMismatchError("; ".join(problems))


def _gguf_name_table(arch: Architecture) -> list[tuple[re.Pattern, str | None]]:
    table = []
    for pattern, target in arch.gguf_tensor_map.items():
        regex = re.escape(pattern).replace(re.escape("{i}"), r"(?P<i>\d+)")
        table.append((re.compile(regex + "$"), target))
    return table


def _gguf_param_name(name: str, table) -> tuple[bool, str | None]:
    """(known, parameter name); a known name may map to None: a tensor the model ignores."""
    for regex, target in table:
        m = regex.match(name)
        if m:
            return True, None if target is None else target.format(**m.groupdict())
    return False, None


def _module_at(model: nn.Module, path: str):
    layer = model
    for key in path.split("."):
        if isinstance(layer, list):  # a layer index past the model's layers is no module
            layer = layer[int(key)] if int(key) < len(layer) else None
        else:
            layer = layer.get(key)
        if layer is None:
            return None
    return layer


def _cast_dtype(model: nn.Module, name: str, dtype: mx.Dtype) -> mx.Dtype:
    """The model dtype, except parameters the model keeps in fp32 (e.g. Qwen 3.5's decay gates)."""
    keep = getattr(model, "cast_predicate", None)
    return dtype if keep is None or keep(name) else mx.float32


def _load_gguf(path: Path, dtype: mx.Dtype) -> tuple[nn.Module, ModelInfo]:
    from gguf import GGMLQuantizationType as T

    from hf2q_mlx.io.gguf import GGUFFile
    from hf2q_mlx.models.quantized import ggml_quantize_modules

    f = GGUFFile(path)
    try:
        arch = architecture_for(gguf_architecture=f.architecture)
    except UnsupportedArchitectureError as err:
        raise UnsupportedArchitectureError(f"{path.name}: {err}") from None
    try:
        args = arch.args_from_gguf(f.metadata, f.tensors)
    except (KeyError, TypeError) as err:  # a tensor or metadata key the architecture needs
        raise GGUFFormatError(
            f"{path.name}: incomplete {f.architecture} GGUF ({err!r} missing)"
        ) from None
    except PARSE_ERRORS as err:  # a metadata value of the wrong type or value
        raise GGUFFormatError(f"{path.name}: bad {f.architecture} metadata ({err!r})") from None
    model = build_model(arch.model, args, path.name)

    table = _gguf_name_table(arch)
    weights, unknown, ggml_types = {}, [], {}
    for name, tensor in f.tensors.items():
        known, target = _gguf_param_name(name, table)
        if not known:
            unknown.append(name)
            continue
        # gguf_transform returns None for a tensor the model does not hold
        try:
            array = arch.gguf_transform(name, f.to_mx(name), args) if target else None
        except PARSE_ERRORS as err:  # e.g. a head count that does not divide the rows
            raise WeightMismatchError(
                f"{path.name}: tensor {name!r} does not fit the metadata ({err})"
            ) from None
        if array is None:
            continue
        if tensor.ggml_type in (T.F32, T.F16, T.BF16):
            array = array.astype(_cast_dtype(model, target, dtype))
        else:
            ggml_types[target.rsplit(".", 1)[0]] = tensor.ggml_type
        weights[target] = array
    # modules that hold GGML blocks their own way (expert stacks) convert themselves
    own = {p: t for p, t in ggml_types.items() if hasattr(_module_at(model, p), "to_ggml")}
    ggml_quantize_modules(model, {p: t for p, t in ggml_types.items() if p not in own})
    if own:
        model.update_modules(
            tree_unflatten([(p, _module_at(model, p).to_ggml(t)) for p, t in own.items()])
        )
    check_weights(model, weights, [f"{n} (no mapping for this GGUF tensor)" for n in unknown])
    model.load_weights(list(weights.items()), strict=True)
    info = ModelInfo(
        path=path,
        format="gguf",
        model_type=args.model_type,
        dtype=dtype,
        metadata=f.metadata,
        quantization={k: T(v).name for k, v in ggml_types.items()},
    )
    return model, info


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [p.name for p in files if not p.is_file()]
        if missing:
            raise ModelNotFoundError(
                f"{path}: shards listed in {index.name} are missing: {missing}"
            )
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{path}: no *.safetensors weights next to config.json")
    return files


def _mlx_quantization(config: dict) -> dict | None:
    """mlx-lm's quantization config, or None; other quantizers' checkpoints are refused."""
    quant = config.get("quantization")
    if quant is None and config.get("quantization_config") is not None:
        quant = config["quantization_config"]
        if "quant_method" in quant:  # GPTQ, AWQ, fp8, bitsandbytes...
            raise UnsupportedQuantTypeError(
                f"{quant['quant_method']!r} quantized checkpoints are not supported "
                "(use the float checkpoint, an mlx-lm quantized one or a GGUF)"
            )
    if quant is not None and not {"group_size", "bits"} <= quant.keys():
        raise UnsupportedQuantTypeError(f"quantization config without group_size/bits: {quant}")
    return quant


def _load_hf(path: Path, dtype: mx.Dtype) -> tuple[nn.Module, ModelInfo]:
    try:
        config = json.loads((path / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointFormatError(f"{path / 'config.json'} is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise CheckpointFormatError(f"{path / 'config.json'} must hold a JSON object")
    model_type = config.get("model_type")
    arch = architecture_for(model_type=model_type)
    try:
        args = arch.args.from_dict(config)
    except TypeError as err:  # a required field is absent
        raise UnsupportedArchitectureError(f"{path / 'config.json'}: {err}") from None
    except PARSE_ERRORS as err:  # a field of the wrong type or value
        raise CheckpointFormatError(f"{path / 'config.json'}: {err!r}") from None
    model = build_model(arch.model, args, path / "config.json")

    weights: dict[str, mx.array] = {}
    for file in _safetensors_files(path):
        weights.update(read_safetensors(file))
    weights = model.sanitize(weights)
    weights = {
        k: v.astype(_cast_dtype(model, k, dtype)) if mx.issubdtype(v.dtype, mx.floating) else v
        for k, v in weights.items()
    }

    quant = _mlx_quantization(config)
    if quant is not None:
        # mlx-lm layout: per-layer entries override the defaults (False = left unquantized)
        def predicate(p: str, m: nn.Module):
            if p in quant:
                return quant[p]
            return hasattr(m, "to_quantized") and f"{p}.scales" in weights

        nn.quantize(
            model,
            group_size=quant["group_size"],
            bits=quant["bits"],
            mode=quant.get("mode", "affine"),
            class_predicate=predicate,
        )
    check_weights(model, weights)
    model.load_weights(list(weights.items()), strict=True)
    info = ModelInfo(
        path=path,
        format="mlx" if quant is not None else "safetensors",
        model_type=model_type,
        dtype=dtype,
        metadata=config,
        quantization=dict(quant or {}),
    )
    return model, info


def resolve_model_path(path: str | Path) -> Path:
    """A .gguf file, an HF directory (with config.json), or a directory holding one .gguf."""
    if not isinstance(path, str) and not hasattr(path, "__fspath__"):
        raise InvalidArgumentError(f"model path must be a str or a path, got {type(path).__name__}")
    p = Path(path).expanduser()
    if not p.exists():
        from hf2q_mlx.io.default_model import missing_model_hint

        raise ModelNotFoundError(f"model path {str(p)!r} does not exist{missing_model_hint(path)}")
    if p.is_file() and p.name == "config.json":
        return p.parent
    if p.is_dir() and not (p / "config.json").is_file():
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) != 1:
            raise ModelNotFoundError(
                f"{p}: expected config.json or exactly one .gguf file, found "
                f"{len(ggufs)} .gguf files"
            )
        return ggufs[0]
    return p


def load_model(
    path: str | Path, dtype: mx.Dtype | str | None = None
) -> tuple[nn.Module, ModelInfo]:
    """Load weights from ``path`` into the matching architecture; returns (model, info)."""
    p = resolve_model_path(path)
    dtype = resolve_dtype(dtype)
    model, info = _load_hf(p, dtype) if p.is_dir() else _load_gguf(p, dtype)
    if p.is_dir() and (p / "modules.json").is_file():  # a sentence-transformers folder
        from hf2q_mlx.embedding import read_sentence_transformers

        model.sentence_transformers = read_sentence_transformers(p)
    if hasattr(model, "fuse_projections"):  # q/k/v and gate/up as one matmul each, lossless
        model.fuse_projections()
    apply_affine_expert_format(model)  # HF2Q_AFFINE_EXPERTS=q4_1: MLX 4-bit experts as Q4_1
    model.eval()
    mx.eval(model.parameters())
    return model, info


def load(path: str | Path | None = None, dtype: mx.Dtype | str | None = None):
    """``(model, tokenizer)`` from a GGUF file or HF directory; no path = the demo model."""
    from hf2q_mlx.io.default_model import resolve_named_model
    from hf2q_mlx.tokenizer.tokenizer import Tokenizer

    # None is the demo model; a name from `hf2q-mlx models` is fetched on first use
    path = resolve_named_model(path)
    model, info = load_model(path, dtype)
    if info.format == "gguf":
        tokenizer = read_tokenizer(lambda: Tokenizer.from_gguf(info.metadata), info.path)
    else:
        tokenizer = read_tokenizer(lambda: Tokenizer.from_hf_dir(info.path), info.path)
    return model, tokenizer
