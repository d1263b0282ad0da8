"""The architecture contract: what a model module declares so the engine can load and run it.

A model module ends with one constant, ``ARCHITECTURE = Architecture(...)``: the HF
``model_type`` values and GGUF ``general.architecture`` names it serves, its ``ModelArgs`` and
``Model`` classes, its GGUF tensor-name map and value fixes, the quirks of its GGUF vocabulary and
its per-layer RoPE. The loader, the tokenizer and TurboQuant read only this, so adding an
architecture is one new file in ``models/`` (plus its test).

Finding a module: ``find_architecture`` imports every module of the ``hf2q_mlx.models`` package
(``pkgutil`` over the package's path) and keeps those exporting an ``Architecture``. Nothing lists
the modules. mlx-lm imports ``models.<model_type>`` instead, but GGUF names (``qwen35``) and HF
names (``gemma3_text``) differ from module names, which would bring back an alias table.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from hf2q_mlx import models as _package


def _unchanged(name: str, array: mx.array, args: Any) -> mx.array:
    return array


@dataclass(frozen=True)
class TokenizerQuirks:
    """What a family's GGUF vocabulary needs beyond its ``tokenizer.ggml.*`` keys.

    ``gemma_sentencepiece``: runs of spaces stored as spaces (matched as ``▁``), merges ranked by
    file order when the file has no merge list, no dummy-prefix space. ``chat_template``: the name
    of the tokenizer's built-in template ("gemma", "qwen35") used when the file carries none.
    """

    gemma_sentencepiece: bool = False
    chat_template: str | None = None


@dataclass(frozen=True, eq=False)
class LayerRoPE:
    """How one attention layer rotates its keys: MLX's non-interleaved RoPE over the first
    ``dims`` channels (None = the whole head), pair j turning by ``freqs[j]`` radians per position
    with the position scale applied (None = not described; TurboQuant's key offset then keeps only
    the unrotated channels)."""

    dims: int | None = None
    freqs: mx.array | None = None


@dataclass(frozen=True)
class Architecture:
    """One architecture as its model module declares it.

    ``gguf_tensor_map``: llama.cpp tensor name (``{i}`` = layer index) -> parameter path, None for
    a known tensor that is not loaded. ``args_from_gguf(metadata, tensors)`` -> ``args``;
    ``gguf_transform(name, array, args)`` fixes a tensor's values (None drops it). ``rope(args)``
    -> one ``LayerRoPE`` per layer (None for a layer without RoPE attention).
    """

    model_types: tuple[str, ...]
    args: type
    model: type
    gguf_architectures: tuple[str, ...] = ()
    gguf_tensor_map: Mapping[str, str | None] = field(default_factory=dict)
    args_from_gguf: Callable[[dict, Mapping[str, Any]], Any] | None = None
    gguf_transform: Callable[[str, mx.array, Any], mx.array | None] = _unchanged
    tokenizer: TokenizerQuirks = TokenizerQuirks()
    rope: Callable[[Any], list[LayerRoPE | None]] | None = None

    def __post_init__(self):
        if self.gguf_architectures and self.args_from_gguf is None:
            raise TypeError(f"{self.model_types}: GGUF architectures need args_from_gguf")


def architectures() -> list[Architecture]:
    """Every architecture declared by a module of ``hf2q_mlx.models`` (imports them all)."""
    found = []
    for info in pkgutil.iter_modules(_package.__path__, _package.__name__ + "."):
        if not info.ispkg:
            arch = getattr(importlib.import_module(info.name), "ARCHITECTURE", None)
            if isinstance(arch, Architecture):
                found.append(arch)
    return found


def find_architecture(
    *, model_type: str | None = None, gguf_architecture: str | None = None
) -> Architecture | None:
    """The architecture serving an HF ``model_type`` or a GGUF ``general.architecture``."""
    for arch in architectures():
        if model_type in arch.model_types or gguf_architecture in arch.gguf_architectures:
            return arch
    return None


def architecture_of(model: Any) -> Architecture | None:
    """The contract of a model instance: ``ARCHITECTURE`` of the module defining its class (or
    the nearest base class whose module has one)."""
    for cls in type(model).__mro__:
        arch = getattr(sys.modules.get(cls.__module__), "ARCHITECTURE", None)
        if isinstance(arch, Architecture):
            return arch
    return None
