"""tiktoken vocabularies (one ``base64(token bytes) rank`` per line): loading, and the same
vocabulary restated as BPE merges for a HF ``tokenizer.json`` or GGUF ``tokenizer.ggml.*``.

In a tiktoken vocabulary the rank is the token id, and encoding a word repeatedly merges the
adjacent pair whose concatenation has the lowest rank (the leftmost on a tie), after a whole-word
lookup. The merge list that reproduces this keeps, for each token, the one split tiktoken itself
ever uses to build it (see ``rank_merges``); a HF BPE with that list and ``ignore_merges`` (the
whole-word lookup) gives tiktoken's ids.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

from hf2q_mlx.errors import TokenizerError
from hf2q_mlx.tokenizer.bpe import BYTE_CHARS
from hf2q_mlx.tokenizer.spm import CONTROL, NORMAL, UNUSED, USER_DEFINED

_NO_RANK = 1 << 62
# bytes.decode("latin-1") then this table: each byte -> its byte-alphabet character, in C
_LATIN1_TO_ALPHABET = {b: BYTE_CHARS[b] for b in range(256)}


def load_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    """Token bytes -> rank from a ``.tiktoken`` file."""
    path = Path(path)
    ranks: dict[bytes, int] = {}
    try:
        lines = path.read_bytes().splitlines()
    except OSError as err:
        raise TokenizerError(f"{path}: {err}") from err
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as err:
            raise TokenizerError(f"{path}:{n}: not a 'base64 rank' line") from err
    if not ranks:
        raise TokenizerError(f"{path}: no tokens")
    return ranks


def byte_alphabet(token: bytes) -> str:
    """A token's bytes spelled in the GPT-2 byte alphabet (how tokenizer.json and GGUF store it)."""
    return token.decode("latin-1").translate(_LATIN1_TO_ALPHABET)


def _last_split(token: bytes, ranks: dict[bytes, int]) -> int | None:
    """Run tiktoken's merge loop on one token: where its last merge joined two parts, or None
    when the loop stops short of the whole token."""
    get = ranks.get
    cuts = list(range(len(token) + 1))  # part boundaries
    pair = [get(token[i : i + 2], _NO_RANK) for i in range(len(token) - 1)]
    last = None
    while pair:
        best = min(pair)
        if best == _NO_RANK:
            return None
        i = pair.index(best)  # the leftmost of equal ranks, as tiktoken
        last = cuts.pop(i + 1)
        del pair[i]
        if i > 0:
            pair[i - 1] = get(token[cuts[i - 1] : cuts[i + 1]], _NO_RANK)
        if i < len(pair):
            pair[i] = get(token[cuts[i] : cuts[i + 2]], _NO_RANK)
    return last


def rank_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge that builds each multi-byte token, in rank order.

    Wherever tiktoken builds token T inside a longer word, the parts inside T have gone through
    the same merges, in the same order, as tiktoken's loop on T alone (a part never crosses T's
    edges before T is made). So T's one merge is the last merge of that loop. Usually both parts
    rank below T; a token the loop never completes (a word added whole to the vocabulary) gets
    no merge: only the whole-word lookup produces it.
    """
    merges: list[tuple[int, bytes, bytes]] = []
    for token, rank in ranks.items():
        if len(token) > 1:
            cut = _last_split(token, ranks)
            if cut is not None:
                merges.append((rank, token[:cut], token[cut:]))
    merges.sort()
    return [(left, right) for _, left, right in merges]


def rank_vocab(ranks: dict[bytes, int]) -> dict[str, int]:
    """Byte-alphabet token -> id (the rank)."""
    return {byte_alphabet(token): rank for token, rank in ranks.items()}


def is_control_token(token: str) -> bool:
    """Added tokens spelled ``<|...|>`` are control tokens; others (``<think>``) are matched
    whole but decoded as text (how llama.cpp's converter marks added tokens by spelling)."""
    return token.startswith("<|") and token.endswith("|>")


def added_tokens(special_tokens: dict[str, int], ranks: dict[bytes, int]) -> list[tuple[str, int]]:
    """The added tokens by id, checked against the base vocabulary's ids."""
    taken = set(ranks.values())
    for token, tid in special_tokens.items():
        if tid in taken:
            raise TokenizerError(f"special token {token!r} reuses id {tid} of the base vocabulary")
    return sorted(special_tokens.items(), key=lambda item: item[1])


def tokenizer_json(
    ranks: dict[bytes, int],
    merges: list[tuple[bytes, bytes]],
    special_tokens: dict[str, int],
    pattern: str,
    *,
    nfc: bool = False,
) -> dict[str, Any]:
    """A HF ``tokenizer.json`` (as a dict) for this vocabulary: regex split + byte-level BPE."""
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False}
    added = [
        {
            "id": tid,
            "content": token,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": is_control_token(token),
        }
        for token, tid in added_tokens(special_tokens, ranks)
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"} if nfc else None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": pattern},
                    "behavior": "Isolated",
                    "invert": False,
                },
                {**byte_level, "use_regex": False},
            ],
        },
        "post_processor": {**byte_level, "use_regex": False},
        "decoder": {**byte_level, "use_regex": False},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": True,
            "vocab": rank_vocab(ranks),
            "merges": [[byte_alphabet(a), byte_alphabet(b)] for a, b in merges],
        },
    }


def gguf_metadata(
    ranks: dict[bytes, int],
    merges: list[tuple[bytes, bytes]],
    special_tokens: dict[str, int],
    *,
    pre: str,
    architecture: str | None = None,
    eos_token: str | None = None,
    pad_token: str | None = None,
    vocab_size: int | None = None,
) -> dict[str, Any]:
    """GGUF ``tokenizer.ggml.*`` metadata (``model=gpt2``) for this vocabulary. Ids without a
    token up to ``vocab_size`` (the embedding rows) become ``[PAD<id>]``, as llama.cpp writes."""
    added = added_tokens(special_tokens, ranks)
    size = max([*ranks.values(), *(tid for _, tid in added)]) + 1
    size = max(size, vocab_size or 0)
    tokens: list[str | None] = [None] * size
    types = [NORMAL] * size
    for token, rank in ranks.items():
        tokens[rank] = byte_alphabet(token)
    for token, tid in added:
        tokens[tid] = token
        types[tid] = CONTROL if is_control_token(token) else USER_DEFINED
    for i, token in enumerate(tokens):
        if token is None:
            tokens[i], types[i] = f"[PAD{i}]", UNUSED
    ids = {token: tid for token, tid in added}
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": [f"{byte_alphabet(a)} {byte_alphabet(b)}" for a, b in merges],
        "tokenizer.ggml.add_bos_token": False,
    }
    if architecture is not None:
        meta["general.architecture"] = architecture
    for key, name in (("eos", eos_token), ("padding", pad_token)):
        if name is not None:
            if name not in ids:
                raise TokenizerError(f"{key} token {name!r} is not among the special tokens")
            meta[f"tokenizer.ggml.{key}_token_id"] = ids[name]
    return meta
