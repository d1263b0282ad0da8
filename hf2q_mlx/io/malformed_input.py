"""The loader's boundary with files it does not control: a malformed config, tensor file or
tokenizer raises an Hf2qError naming the file, never a parser's own exception or a hang."""

from __future__ import annotations

import dataclasses
import json
import numbers
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import mlx.core as mx

from hf2q_mlx.errors import CheckpointFormatError, TokenizerError

# what parsing code raises on data of the wrong shape or type (UnicodeError is a ValueError)
PARSE_ERRORS = (
    KeyError,
    TypeError,
    ValueError,
    AttributeError,
    IndexError,
    ZeroDivisionError,
    OverflowError,
    RecursionError,
)
MAX_TOKEN_ID = 1 << 24
# Bounds far above any real model (the largest have ~1e6 vocabularies, ~3e4 hidden sizes,
# ~1e2 layers) that keep a corrupt count from building billions of modules or arrays.
MAX_SIZE = 1 << 24
MAX_LAYERS = 4096
_SIZE_SUFFIXES = ("_size", "_dim", "_layers", "_heads", "_experts", "_length", "_per_tok")

T = TypeVar("T")


def _one_line(err: BaseException) -> str:
    return " ".join(f"{type(err).__name__}: {err}".split())[:300]


def _typed_fields(args: Any, prefix: str = "") -> list[tuple[str, str, Any]]:
    """(name, declared type as text, value) of an args dataclass's fields, nested ones too."""
    found = []
    for f in dataclasses.fields(args):
        value = getattr(args, f.name, None)
        declared = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            found += _typed_fields(value, f"{prefix}{f.name}.")
        else:
            found.append((prefix + f.name, declared.replace(" ", ""), value))
    return found


def check_model_settings(args: Any, where: str | Path) -> None:
    """Raise CheckpointFormatError for a field whose value does not have its declared type
    (int, float, bool, optionally None) or a size or count outside its bounds."""
    if not dataclasses.is_dataclass(args):
        return
    for name, declared, value in _typed_fields(args):
        base = declared.removesuffix("|None").removeprefix("Optional[").removesuffix("]")
        if value is None and declared != base:
            continue
        if base == "bool":
            ok = isinstance(value, bool)
        elif base == "int":
            ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
        elif base == "float":  # an integer too large for a double is no float setting
            ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
            ok = ok and (not isinstance(value, numbers.Integral) or abs(value) <= 2**53)
        else:
            continue  # lists, dicts, strings: the architecture's own checks
        if not ok:
            raise CheckpointFormatError(f"{where}: {name} must be {base}, got {value!r}"[:300])
        if base == "int" and (
            name.endswith(_SIZE_SUFFIXES) or name.rsplit(".")[-1].startswith("num_")
        ):
            limit = MAX_LAYERS if name.endswith("_layers") else MAX_SIZE
            if not 0 <= value <= limit:
                raise CheckpointFormatError(f"{where}: {name} = {value} is outside [0, {limit}]")


def build_model(make_model: Callable[[Any], T], args: Any, where: str | Path) -> T:
    """``make_model(args)`` after the size check; construction errors name the file."""
    check_model_settings(args, where)
    try:
        return make_model(args)
    except PARSE_ERRORS as err:
        raise CheckpointFormatError(
            f"{where}: cannot build the model from these settings ({_one_line(err)})"
        ) from err


def read_safetensors(file: Path) -> dict[str, mx.array]:
    """``mx.load`` of one safetensors file; a corrupt header names the file."""
    try:
        return mx.load(str(file))
    except (RuntimeError, ValueError) as err:
        raise CheckpointFormatError(
            f"{file}: not a valid safetensors file ({_one_line(err)})"
        ) from err


def _token_ids(folder: Path) -> list[tuple[str, Any]]:
    """(where, id) of every token id that tokenizer.json and tokenizer_config.json declare."""
    found: list[tuple[str, Any]] = []
    for name in ("tokenizer.json", "tokenizer_config.json"):
        try:
            spec = json.loads((folder / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue  # missing or unreadable: the tokenizer reports it
        if not isinstance(spec, dict):
            continue
        model = spec.get("model")
        vocab = model.get("vocab") if isinstance(model, dict) else None
        if isinstance(vocab, dict):
            found += [(f"{name} vocab", v) for v in vocab.values()]
        added = spec.get("added_tokens")
        for token in added if isinstance(added, list) else []:
            if isinstance(token, dict) and "id" in token:
                found.append((f"{name} added_tokens", token["id"]))
        decoder = spec.get("added_tokens_decoder")
        if isinstance(decoder, dict):
            found += [(f"{name} added_tokens_decoder", k) for k in decoder]
    return found


def check_token_ids(folder: Path) -> None:
    """Raise TokenizerError for a token id outside [0, 2**24): the tokenizer sizes its tables
    by the largest id, so one corrupt id of 2**40 would otherwise exhaust memory."""
    for where, value in _token_ids(folder):
        try:
            ok = not isinstance(value, bool) and 0 <= int(value) < MAX_TOKEN_ID
        except (TypeError, ValueError, OverflowError):
            ok = False
        if not ok:
            raise TokenizerError(
                f"{folder}: {where} has token id {value!r}, outside [0, {MAX_TOKEN_ID})"[:300]
            )


def read_tokenizer(make: Callable[[], T], where: str | Path) -> T:
    """``make()`` (a Tokenizer constructor); malformed tokenizer data names its source.
    A folder's token ids are bounded first (tokenizer.json, tokenizer_config.json)."""
    if Path(where).is_dir():
        check_token_ids(Path(where))
    try:
        return make()
    except PARSE_ERRORS as err:
        raise TokenizerError(f"{where}: malformed tokenizer data ({_one_line(err)})") from err
