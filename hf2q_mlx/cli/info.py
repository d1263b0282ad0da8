"""``hf2q-mlx info``: describe a GGUF file or a Hugging Face directory from headers alone."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

from hf2q_mlx.errors import Hf2qError, ModelNotFoundError
from hf2q_mlx.io.gguf import GGUFFile, type_mix

# headline config.json keys -> the labels the GGUF summary uses
_HF_HEADLINE = {
    "max_position_embeddings": "context_length",
    "num_hidden_layers": "layers",
    "hidden_size": "embedding_length",
    "num_attention_heads": "heads",
    "num_key_value_heads": "kv_heads",
    "vocab_size": "vocab_size",
}


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _table(rows: list[tuple], header: tuple) -> list[str]:
    cells = [tuple(str(c) for c in r) for r in [header, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]


def _render(s: dict[str, Any], kind: str) -> str:
    lines = [f"{s['path']}  ({kind}, {_size(s['file_size'])})"]
    for label, key in [
        ("architecture", "architecture"),
        ("name", "name"),
        ("quantization", "file_type"),
        ("context length", "context_length"),
        ("layers", "layers"),
        ("hidden size", "embedding_length"),
        ("attention heads", "heads"),
        ("kv heads", "kv_heads"),
        ("vocab size", "vocab_size"),
    ]:
        if s.get(key) is not None:
            lines.append(f"{label + ':':17}{s[key]}")
    lines.append(f"{'parameters:':17}{s['parameters']:,}")
    if s["hparams"]:
        lines += ["", "hyperparameters:"]
        lines += [f"  {k} = {v}" for k, v in s["hparams"].items()]
    lines += ["", "tensor types:"]
    mix = [
        (name, r["tensors"], f"{r['elements']:,}", f"{r['bytes']:,}", _size(r["bytes"]))
        for name, r in s["types"].items()
    ]
    lines += ["  " + x for x in _table(mix, ("type", "tensors", "elements", "bytes", ""))]
    lines += ["", f"tensors ({len(s['tensors'])}):"]
    rows = [
        (n, t, "x".join(map(str, shape)) or "scalar", f"{b:,}") for n, t, shape, b in s["tensors"]
    ]
    lines += ["  " + x for x in _table(rows, ("name", "type", "shape", "bytes"))]
    return "\n".join(lines)


def _json(text: bytes, path: Path) -> Any:
    try:
        return json.loads(text)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise Hf2qError(f"{path}: unreadable JSON: {e}") from e


def _safetensors_header(path: Path) -> dict[str, Any]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < n <= size - 8:
            raise Hf2qError(f"{path}: not a safetensors file (header length {n})")
        header = _json(f.read(n), path)
    if not isinstance(header, dict):
        raise Hf2qError(f"{path}: the safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    return header


def _hf_summary(path: Path) -> dict[str, Any]:
    config = _json((path / "config.json").read_bytes(), path / "config.json")
    text = {**config, **(config.get("text_config") or {})}  # multimodal configs nest the LM
    quant = config.get("quantization") or config.get("quantization_config") or {}
    files = sorted(path.glob("*.safetensors"))
    tensors, sizes = [], []
    for file in files:
        for name, t in _safetensors_header(file).items():
            shape, dtype = tuple(t["shape"]), t["dtype"]
            nbytes = t["data_offsets"][1] - t["data_offsets"][0]
            n = math.prod(shape)
            # mlx-lm packs quantized weights in uint32 words of 32 // bits elements
            if dtype == "U32" and name.endswith(".weight") and "bits" in quant:
                n = n * 32 // quant["bits"]
            tensors.append((name, dtype, shape, nbytes))
            sizes.append((dtype, n, nbytes))
    types = type_mix(sizes)
    return {
        "path": str(path),
        "file_size": sum(f.stat().st_size for f in files),
        "architecture": config.get("model_type", text.get("model_type")),
        "name": ", ".join(config.get("architectures", [])) or None,
        "file_type": json.dumps(quant) if quant else text.get("torch_dtype", text.get("dtype")),
        **{label: text.get(key) for key, label in _HF_HEADLINE.items()},
        "hparams": {
            k: v
            for k, v in text.items()
            if k not in _HF_HEADLINE
            and isinstance(v, (int, float, str, bool))
            and k != "model_type"
        },
        "parameters": sum(r["elements"] for r in types.values()),
        "types": types,
        "tensors": tensors,
    }


def describe(path: str | Path) -> str:
    """A readable report of a model's metadata and tensors; reads no tensor data."""
    p = Path(path)
    if p.is_dir():
        if (p / "config.json").is_file():
            return _render(_hf_summary(p), "Hugging Face directory")
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) != 1:
            raise ModelNotFoundError(f"{p}: no config.json and not exactly one .gguf file")
        p = ggufs[0]
    if not p.exists():
        raise ModelNotFoundError(f"{p}: no such file or directory")
    f = GGUFFile(p)
    return _render(f.summary(), f"GGUF v{f.version}")
