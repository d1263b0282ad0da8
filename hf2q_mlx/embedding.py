"""Sentence embeddings: ``embed(model, tokenizer, texts) -> (N, D)`` for a sentence-transformers
folder of a bidirectional model (EmbeddingGemma), and the reading of that folder's modules.

The pipeline is sentence-transformers' own: the task prompt prepended to each text, one
bidirectional pass over a right-padded batch (padding masked out of attention and pooling), mean
pooling, the dense projections, optional Matryoshka truncation, then L2 normalization.
"""

from __future__ import annotations

import json
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from hf2q_mlx.errors import (
    CheckpointFormatError,
    InvalidArgumentError,
    NotAnEmbeddingModelError,
    PromptNameError,
    UnsupportedArchitectureError,
    WeightMismatchError,
)
from hf2q_mlx.io.malformed_input import read_safetensors
from hf2q_mlx.models.encoder import SentenceHead, encode

_ST = "sentence_transformers.models."
IDENTITY = "torch.nn.modules.linear.Identity"


@dataclass
class SentenceTransformersSpec:
    """What a sentence-transformers folder adds to its transformer: the head (pooling + dense),
    the task prompts of ``config_sentence_transformers.json``, and its length limit."""

    head: SentenceHead
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    max_seq_length: int | None = None


def _json(path: Path, kind: type = dict, default=None):
    """The JSON value of ``path``, which must be a ``kind``; ``default`` when the file is absent
    (None: the file is required)."""
    if default is not None and not path.is_file():
        return default
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise CheckpointFormatError(f"{path}: cannot read it as JSON ({err})") from None
    if not isinstance(value, kind):
        raise CheckpointFormatError(f"{path}: expected a JSON {kind.__name__}")
    return value


def _dense_layer(path: Path) -> tuple[int, int, bool]:
    cfg = _json(path / "config.json")
    if cfg.get("activation_function", IDENTITY) != IDENTITY:
        raise UnsupportedArchitectureError(
            f"{path}: dense activation {cfg['activation_function']} (only Identity)"
        )
    try:
        return int(cfg["in_features"]), int(cfg["out_features"]), bool(cfg.get("bias", True))
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointFormatError(f"{path / 'config.json'}: bad Dense config ({err!r})") from None


def read_sentence_transformers(folder: Path) -> SentenceTransformersSpec:
    """The modules of a sentence-transformers ``folder`` (its ``modules.json``): Transformer,
    mean Pooling, Dense layers with the identity activation, Normalize. Other modules raise
    UnsupportedArchitectureError; the dense weights load in fp32."""
    modules = _json(folder / "modules.json", list)
    width = _json(folder / "config.json").get("hidden_size")
    if not isinstance(width, int):
        raise CheckpointFormatError(f"{folder / 'config.json'}: no hidden_size")
    dense, weights = [], []
    for m in modules:
        if not isinstance(m, dict):
            raise CheckpointFormatError(f"{folder / 'modules.json'}: a module is not an object")
        kind, path = str(m.get("type", "")).removeprefix(_ST), folder / str(m.get("path", ""))
        if kind in ("Transformer", "Normalize"):  # the model itself; embed(normalize=True)
            continue
        if kind == "Pooling":
            pooling = _json(path / "config.json")
            modes = sorted(k for k, v in pooling.items() if k.startswith("pooling_mode") and v)
            if modes != ["pooling_mode_mean_tokens"] or not pooling.get("include_prompt", True):
                raise UnsupportedArchitectureError(
                    f"{path}: only mean pooling over every token is supported, not {modes}"
                )
        elif kind == "Dense":
            layer = _dense_layer(path)
            if layer[0] != (dense[-1][1] if dense else width):
                raise CheckpointFormatError(
                    f"{path}: in_features {layer[0]} do not follow the width before it"
                )
            dense.append(layer)
            weights += [
                (f"dense.{len(dense) - 1}.{k}", v.astype(mx.float32))
                for k, v in read_safetensors(path / "model.safetensors").items()
            ]
        else:
            raise UnsupportedArchitectureError(f"{folder}: sentence-transformers module {kind!r}")
    head = SentenceHead(width, dense)
    try:
        head.load_weights(weights, strict=True)
    except ValueError as err:
        raise WeightMismatchError(f"{folder}: dense weights do not fit ({err})") from None
    mx.eval(head.parameters())
    config = _json(folder / "config_sentence_transformers.json", default={})
    prompts = config.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(isinstance(v, str) for v in prompts.values()):
        raise CheckpointFormatError(f"{folder}: prompts must map names to strings")
    max_length = _json(folder / "sentence_bert_config.json", default={}).get("max_seq_length")
    default_name = config.get("default_prompt_name")
    return SentenceTransformersSpec(
        head=head,
        prompts=dict(prompts),
        default_prompt_name=default_name if isinstance(default_name, str) else None,
        max_seq_length=max_length if isinstance(max_length, int) and max_length > 0 else None,
    )


def embedding_spec(model: nn.Module) -> SentenceTransformersSpec:
    """The sentence-transformers modules the loader attached to ``model``, checked usable."""
    spec = getattr(model, "sentence_transformers", None)
    if not isinstance(spec, SentenceTransformersSpec):
        raise NotAnEmbeddingModelError(
            "this model is not an embedding model (no sentence-transformers modules.json next "
            "to its config.json); load one such as `embeddinggemma-300m`"
        )
    if not getattr(getattr(model, "args", None), "use_bidirectional_attention", False):
        raise UnsupportedArchitectureError(
            "embeddings need a bidirectional model (EmbeddingGemma's gemma3_text)"
        )
    return spec


def _prompt(spec: SentenceTransformersSpec, prompt_name: str | None, prompt: str | None) -> str:
    if prompt is not None and prompt_name is not None:
        raise PromptNameError("give prompt or prompt_name, not both")
    if prompt is not None:
        if not isinstance(prompt, str):
            raise InvalidArgumentError(f"prompt must be a str, got {type(prompt).__name__}")
        return prompt
    name = prompt_name if prompt_name is not None else spec.default_prompt_name
    if name is None:
        return ""
    if name not in spec.prompts:
        known = ", ".join(spec.prompts) or "none"
        raise PromptNameError(f"unknown prompt name {name!r}; this model has: {known}")
    return spec.prompts[name]


def _check_texts(texts) -> list[str]:
    if isinstance(texts, str):
        return [texts]
    if not isinstance(texts, Sequence):
        raise InvalidArgumentError(
            f"texts must be a str or a list of str, got {type(texts).__name__}"
        )
    if len(texts) == 0:
        raise InvalidArgumentError("texts is empty: give at least one text")
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise InvalidArgumentError(f"texts[{i}] is a {type(t).__name__}, not a str")
    return list(texts)


def _positive_int(name: str, value, upper: int | None = None) -> None:
    bad = isinstance(value, bool) or not isinstance(value, int) or value < 1
    if bad or (upper is not None and value > upper):
        limit = f" and at most {upper}" if upper is not None else ""
        raise InvalidArgumentError(f"{name} must be an int >= 1{limit}, got {value!r}")


def _token_ids(tokenizer, text: str, max_length: int | None) -> list[int]:
    """The text's ids with the tokenizer's BOS/EOS; a longer text than ``max_length`` loses its
    tail but keeps the special tokens (sentence-transformers' truncation)."""
    full = tokenizer.encode(text, add_special_tokens=True)
    if max_length is None or len(full) <= max_length:
        return full
    plain = tokenizer.encode(text, add_special_tokens=False)
    start = next((i for i in range(len(full)) if full[i : i + len(plain)] == plain), None)
    if start is None:  # the special tokens are not around the text: plain truncation
        return full[:max_length]
    prefix, suffix = full[:start], full[start + len(plain) :]
    return prefix + plain[: max_length - len(prefix) - len(suffix)] + suffix


def is_embedding_model(model: nn.Module) -> bool:
    """Whether ``model`` was loaded from a sentence-transformers folder (``embed`` takes it)."""
    return isinstance(getattr(model, "sentence_transformers", None), SentenceTransformersSpec)


def max_input_tokens(model: nn.Module) -> int | None:
    """Tokens an input may have: the folder's max_seq_length, else the model's positions."""
    spec = embedding_spec(model)
    return spec.max_seq_length or getattr(model.args, "max_position_embeddings", None)


def _is_id_list(row) -> bool:
    if isinstance(row, np.ndarray):
        return row.ndim == 1 and np.issubdtype(row.dtype, np.integer)
    if not isinstance(row, Sequence) or isinstance(row, (str, bytes)):
        return False
    return all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in row)


def check_embedding_ids(model: nn.Module, ids: Sequence[Sequence[int]], what: str = "texts"):
    """Raise InvalidArgumentError for an input without tokens, with an id outside the
    vocabulary or longer than ``max_input_tokens`` (``what`` names the inputs in the message)."""
    vocab, limit = model.args.vocab_size, max_input_tokens(model)
    for i, row in enumerate(ids):
        if not row:
            raise InvalidArgumentError(f"{what}[{i}] has no tokens (an empty text and prompt)")
        low, high = min(row), max(row)
        if low < 0 or high >= vocab:
            bad = low if low < 0 else high
            raise InvalidArgumentError(
                f"{what}[{i}] has token id {bad} outside the model's {vocab}"
            )
        if limit is not None and len(row) > limit:
            raise InvalidArgumentError(
                f"{what}[{i}] has {len(row)} tokens, over this model's {limit}"
            )


def embedding_token_ids(
    model: nn.Module,
    tokenizer,
    texts: str | Sequence[str],
    *,
    prompt_name: str | None = None,
    prompt: str | None = None,
    what: str = "texts",
) -> list[list[int]]:
    """The token ids ``embed`` runs for ``texts``: the task prompt prepended, the tokenizer's
    special tokens added, cut to ``max_input_tokens`` (sentence-transformers' truncation).
    ``what`` names the texts in error messages."""
    spec = embedding_spec(model)
    texts = _check_texts(texts)
    if not callable(getattr(tokenizer, "encode", None)):
        raise InvalidArgumentError(f"tokenizer has no encode(): got {type(tokenizer).__name__}")
    prefix = _prompt(spec, prompt_name, prompt)
    max_length = max_input_tokens(model)
    ids = [_token_ids(tokenizer, prefix + t, max_length) for t in texts]
    check_embedding_ids(model, ids, what)
    return ids


def embed(
    model: nn.Module,
    tokenizer,
    texts: str | Sequence[str],
    *,
    prompt_name: str | None = None,
    prompt: str | None = None,
    batch_size: int = 32,
    normalize: bool = True,
    dimensions: int | None = None,
) -> mx.array:
    """Embeddings (N, D) fp32 of ``texts`` (a str counts as one text), in their order.

    ``prompt_name`` picks a task prompt of the model's config (e.g. "query", "document"), or
    ``prompt`` gives the text to prepend; neither: the config's default prompt, if any.
    ``dimensions`` keeps the first D values (Matryoshka), before the L2 normalization that
    ``normalize`` applies. Texts are sorted by length and run ``batch_size`` at a time."""
    ids = embedding_token_ids(model, tokenizer, texts, prompt_name=prompt_name, prompt=prompt)
    return embed_token_ids(
        model, ids, batch_size=batch_size, normalize=normalize, dimensions=dimensions
    )


def embed_token_ids(
    model: nn.Module,
    ids: Sequence[Sequence[int]],
    *,
    batch_size: int = 32,
    normalize: bool = True,
    dimensions: int | None = None,
) -> mx.array:
    """``embed`` from token ids (each input's whole sequence, special tokens included, as
    ``embedding_token_ids`` makes them): (N, D) fp32 in the inputs' order."""
    spec = embedding_spec(model)
    _positive_int("batch_size", batch_size)
    if dimensions is not None:
        _positive_int("dimensions", dimensions, spec.head.dims)
    rows_ok = isinstance(ids, Sequence) and not isinstance(ids, (str, bytes)) and len(ids) > 0
    if not rows_ok or not all(_is_id_list(row) for row in ids):
        raise InvalidArgumentError("ids must be a non-empty list of lists of integer token ids")
    ids = [[int(t) for t in row] for row in ids]
    check_embedding_ids(model, ids, "ids")

    order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))  # little padding per batch
    rows: list[mx.array] = []
    for start in range(0, len(order), batch_size):
        batch = [ids[i] for i in order[start : start + batch_size]]
        L = max(len(r) for r in batch)
        tokens = np.zeros((len(batch), L), dtype=np.int32)  # right padding: positions unchanged
        valid = np.zeros((len(batch), L), dtype=bool)
        for b, r in enumerate(batch):
            tokens[b, : len(r)], valid[b, : len(r)] = r, True
        mask = mx.array(valid)
        vectors = spec.head(encode(model, mx.array(tokens), mask), mask)  # (B, D)
        mx.eval(vectors)
        rows.append(vectors)
    out = mx.concatenate(rows, axis=0)[mx.array(np.argsort(order))]  # back to the text order
    return finish_vectors(out, dimensions, normalize)


def finish_vectors(out: mx.array, dimensions: int | None, normalize: bool = True) -> mx.array:
    """(N, D) pooled vectors -> the first ``dimensions`` values of each, then L2-normalized (as
    torch.nn.functional.normalize: eps 1e-12 keeps a zero vector zero)."""
    if dimensions is not None:
        out = out[:, :dimensions]
    if normalize:
        out = out / mx.maximum(mx.linalg.norm(out, axis=-1, keepdims=True), 1e-12)
    return out
