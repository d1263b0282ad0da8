"""SentencePiece ``tokenizer.model`` files (a small protobuf reader) and SentencePiece-style BPE
from GGUF metadata."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hf2q_mlx.errors import TokenizerError
from hf2q_mlx.tokenizer.bpe import BPE, AddedToken, merge_ranks

# SentencePiece.Type values (sentencepiece_model.proto)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
MODEL_UNIGRAM, MODEL_BPE = 1, 2


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(buf):
            raise TokenizerError("tokenizer.model: truncated varint")
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            return value, i


def _fields(buf: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) for each field of one message: ints for varint / fixed32 fields
    (fixed32 as its raw 4 bytes), bytes for length-delimited ones."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 1:
            value, i = buf[i : i + 8], i + 8
        elif wire == 2:
            n, i = _varint(buf, i)
            value, i = buf[i : i + n], i + n
        elif wire == 5:
            value, i = buf[i : i + 4], i + 4
        else:
            raise TokenizerError(f"tokenizer.model: unsupported protobuf wire type {wire}")
        if i > len(buf):
            raise TokenizerError("tokenizer.model: truncated message")
        yield number, value


def _int32(value: int) -> int:
    # negative int32 values are varint-encoded as 64-bit two's complement
    return value - (1 << 64) if value >= 1 << 63 else value


@dataclass
class SpmModel:
    """The parts of a SentencePiece ModelProto a BPE tokenizer needs (proto defaults filled in)."""

    pieces: list[tuple[str, float, int]] = field(default_factory=list)  # (piece, score, type)
    model_type: int = MODEL_UNIGRAM
    byte_fallback: bool = False
    treat_whitespace_as_suffix: bool = False
    unk_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    pad_id: int = -1
    charsmap: bytes = b""
    add_dummy_prefix: bool = True
    remove_extra_whitespaces: bool = True
    escape_whitespaces: bool = True


def read_spm_model(path: str | Path) -> SpmModel:
    """Parse a ``tokenizer.model`` (serialized ``sentencepiece.ModelProto``)."""
    model = SpmModel()
    for number, value in _fields(Path(path).read_bytes()):
        if number == 1:  # pieces
            piece, score, kind = "", 0.0, NORMAL
            for n, v in _fields(value):
                if n == 1:
                    piece = v.decode("utf-8")
                elif n == 2:
                    score = struct.unpack("<f", v)[0]
                elif n == 3:
                    kind = v
            model.pieces.append((piece, score, kind))
        elif number == 2:  # trainer_spec
            for n, v in _fields(value):
                if n == 3:
                    model.model_type = v
                elif n == 35:
                    model.byte_fallback = bool(v)
                elif n == 24:
                    model.treat_whitespace_as_suffix = bool(v)
                elif n in (40, 41, 42, 43):
                    setattr(model, ("unk_id", "bos_id", "eos_id", "pad_id")[n - 40], _int32(v))
        elif number == 3:  # normalizer_spec
            for n, v in _fields(value):
                if n == 2:
                    model.charsmap = bytes(v)
                elif n == 3:
                    model.add_dummy_prefix = bool(v)
                elif n == 4:
                    model.remove_extra_whitespaces = bool(v)
                elif n == 5:
                    model.escape_whitespaces = bool(v)
    if not model.pieces:
        raise TokenizerError(f"{path}: no pieces (not a SentencePiece model?)")
    return model


def gguf_sentencepiece(metadata: dict, tokens: list[str], gemma_vocab: bool) -> dict[str, Any]:
    """SentencePiece-style BPE (``llama``/``gemma4``): merges ranked by the merged token.
    ``gemma_vocab``: the architecture's ``TokenizerQuirks.gemma_sentencepiece``."""
    gemma = gemma_vocab or metadata.get("tokenizer.ggml.model") == "gemma4"
    if gemma_vocab:
        # Gemma stores its runs-of-spaces tokens as real spaces but matches them as "▁▁..."
        tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = metadata.get("tokenizer.ggml.merges")
    if merges:
        model_kw: dict[str, Any] = {"ranks": merge_ranks(merges)}
    elif gemma_vocab:
        # Gemma's scores do not follow its merge order; the file order does (as transformers)
        model_kw = {"priority": {t: i for i, t in enumerate(tokens)}, "hf_ties": True}
    else:
        scores = metadata.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        model_kw = {"priority": {t: -s for t, s in zip(tokens, scores)}, "hf_ties": True}
    unk = metadata.get("tokenizer.ggml.unknown_token_id", vocab.get("<unk>"))
    model = BPE(vocab, byte_fallback=True, unk_id=unk, fuse_unk=True, **model_kw)
    space = space_rule(not gemma and metadata.get("tokenizer.ggml.add_space_prefix", True))
    return {"model": model, **space}


def space_rule(dummy_prefix: bool) -> dict[str, Any]:
    """Normalizer + decoder for SentencePiece spaces: ``▁`` for " ", optional dummy prefix."""
    steps = [{"type": "SpmDummyPrefix"}] if dummy_prefix else []
    steps.append({"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"})
    decoders = [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]
    if dummy_prefix:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    return {
        "normalizer": {"type": "Sequence", "normalizers": steps},
        "decoder": {"type": "Sequence", "decoders": decoders},
    }


def hf_sentencepiece(path: Path, names: dict[str, str]) -> tuple[dict, list, Any]:
    """A bare SentencePiece BPE model: encodes as ``sentencepiece`` does, except that control
    tokens written in the text are matched whole (as transformers and llama.cpp do)."""
    spm = read_spm_model(path)
    if spm.model_type != MODEL_BPE:
        raise TokenizerError(f"{path}: only SentencePiece BPE models are supported")
    if spm.treat_whitespace_as_suffix:
        raise TokenizerError(f"{path}: treat_whitespace_as_suffix is not supported")
    vocab = {piece: i for i, (piece, _, _) in enumerate(spm.pieces)}
    priority = {p: -s for p, s, kind in spm.pieces if kind in (NORMAL, USER_DEFINED)}
    model = BPE(
        vocab,
        priority=priority,
        byte_fallback=spm.byte_fallback,
        unk_id=spm.unk_id if spm.unk_id >= 0 else None,
    )
    added = []
    for i, (piece, _, kind) in enumerate(spm.pieces):
        if kind == CONTROL or kind == UNKNOWN:
            added.append(AddedToken(i, piece, special=True))
        elif kind == USER_DEFINED:
            # sentencepiece matches these inside its normalized text
            added.append(AddedToken(i, piece, special=False, normalized=True))
    steps = []
    if spm.charsmap:
        steps.append({"type": "Precompiled", "precompiled_charsmap": spm.charsmap})
    if spm.remove_extra_whitespaces:
        steps.append({"type": "SpmWhitespace"})
    space = space_rule(spm.add_dummy_prefix)
    if spm.escape_whitespaces:
        steps.extend(space["normalizer"]["normalizers"])
    elif spm.add_dummy_prefix:
        steps.append({"type": "SpmDummyPrefix"})
    for key, tid in (
        ("bos_token", spm.bos_id),
        ("eos_token", spm.eos_id),
        ("unk_token", spm.unk_id),
    ):
        if 0 <= tid < len(spm.pieces):
            names.setdefault(key, spm.pieces[tid][0])
    kwargs = {
        "model": model,
        "normalizer": {"type": "Sequence", "normalizers": steps},
        "decoder": space["decoder"],
    }
    return kwargs, added, None
