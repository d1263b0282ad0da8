"""Tokenizer pipeline pieces: added-token matching, normalizers, pre-tokenizers, BPE, decoding.

Every builder takes a spec in the JSON shape of a Hugging Face ``tokenizer.json`` section, so the
GGUF and SentencePiece loaders describe their tokenizers in the same terms as HF directories.
"""

from __future__ import annotations

import base64
import heapq
import unicodedata
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import regex

from hf2q_mlx.errors import TokenizerError
from hf2q_mlx.tokenizer.charsmap import CharsMap

# (text, starts_the_input) -> text; the flag lets SentencePiece's dummy prefix go only in front.
Normalizer = Callable[[str, bool], str]
PreTokenizer = Callable[[str, bool], list[str]]

# HF ByteLevel's built-in split (the GPT-2 pattern); llama.cpp's list leaves off the last `\s+`,
# which changes nothing because unmatched text becomes a piece of its own there.
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: printable bytes stand for themselves, the rest map to U+0100 on."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    table: dict[int, str] = {}
    extra = 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(0x100 + extra)
            extra += 1
    return table


BYTE_CHARS: list[str] = [bytes_to_unicode()[b] for b in range(256)]
CHAR_BYTES: dict[str, int] = {c: b for b, c in enumerate(BYTE_CHARS)}


def to_byte_alphabet(text: str) -> str:
    """Spell ``text``'s UTF-8 bytes in the byte alphabet, as byte-level vocabularies do."""
    return "".join([BYTE_CHARS[b] for b in text.encode("utf-8")])


class AddedToken(NamedTuple):
    """A token matched whole in the text, never split by BPE: in the raw input, or (when
    ``normalized``) in the normalized text, spelled as the normalizer spells it."""

    id: int
    content: str
    special: bool
    lstrip: bool = False
    rstrip: bool = False
    normalized: bool = False


class TokenMatcher:
    """Leftmost-longest search for added tokens (how HF's added vocabulary and llama.cpp split)."""

    def __init__(self, tokens: Iterable[AddedToken]):
        self._root: dict = {}
        for tok in tokens:
            if not tok.content:
                continue
            node = self._root
            for ch in tok.content:
                node = node.setdefault(ch, {})
            node[None] = tok  # the None key marks the end of a token

    def split(self, text: str, offset: int = 0) -> list[tuple[str, int] | AddedToken]:
        """Text pieces as ``(text, start offset)`` and matched tokens, in order."""
        root = self._root
        if not root:
            return [(text, offset)] if text else []
        out: list[tuple[str, int] | AddedToken] = []
        n = len(text)
        start = i = 0
        while i < n:
            node = root.get(text[i])
            if node is None:
                i += 1
                continue
            best, end, j = None, i, i + 1
            while True:
                tok = node.get(None)
                if tok is not None:
                    best, end = tok, j
                if j >= n:
                    break
                node = node.get(text[j])
                if node is None:
                    break
                j += 1
            if best is None:
                i += 1
                continue
            left = i
            if best.lstrip:
                while left > start and text[left - 1].isspace():
                    left -= 1
            if left > start:
                out.append((text[start:left], offset + start))
            out.append(best)
            if best.rstrip:
                while end < n and text[end].isspace():
                    end += 1
            start = i = end
        if start < n:
            out.append((text[start:], offset + start))
        return out


def compile_pattern(spec: dict[str, str]) -> regex.Pattern:
    """An HF ``{"String": ...}`` (literal) or ``{"Regex": ...}`` pattern."""
    if "String" in spec:
        return regex.compile(regex.escape(spec["String"]))
    if "Regex" in spec:
        return regex.compile(spec["Regex"])
    raise TokenizerError(f"unsupported pattern {spec!r}")


def build_normalizer(spec: dict[str, Any] | None) -> Normalizer | None:
    """The normalizer an HF spec describes, plus two SentencePiece rules (``Spm*``, ours)."""
    if spec is None:
        return None
    kind = spec.get("type")
    if kind == "Sequence":
        steps = [s for s in (build_normalizer(x) for x in spec["normalizers"]) if s is not None]

        def run(text: str, first: bool) -> str:
            for step in steps:
                text = step(text, first)
            return text

        return run
    if kind == "Replace":
        pattern, content = spec["pattern"], spec["content"]
        if "String" in pattern:
            old = pattern["String"]
            return lambda t, f: t.replace(old, content)
        compiled = compile_pattern(pattern)
        return lambda t, f: compiled.sub(lambda _: content, t)
    if kind == "Prepend":
        prefix = spec["prepend"]
        return lambda t, f: prefix + t if t else t
    if kind in ("NFC", "NFD", "NFKC", "NFKD"):
        return lambda t, f: unicodedata.normalize(kind, t)
    if kind == "Lowercase":
        return lambda t, f: t.lower()
    if kind == "Strip":
        left, right = spec.get("strip_left", True), spec.get("strip_right", True)
        return lambda t, f: _strip(t, left, right)
    if kind == "Precompiled":
        blob = spec.get("precompiled_charsmap")
        if not blob:
            return None
        charsmap = CharsMap(base64.b64decode(blob) if isinstance(blob, str) else blob)
        return lambda t, f: charsmap.normalize(t)
    if kind == "SpmWhitespace":
        # SentencePiece's remove_extra_whitespaces: no leading/trailing spaces, runs become one
        return lambda t, f: " ".join(w for w in t.split(" ") if w)
    if kind == "SpmDummyPrefix":
        # SentencePiece's add_dummy_prefix / llama.cpp's add_space_prefix: once, at the start
        return lambda t, f: " " + t if f and t else t
    raise TokenizerError(f"unsupported normalizer {kind!r}")


def _strip(text: str, left: bool, right: bool) -> str:
    text = text.lstrip() if left else text
    return text.rstrip() if right else text


_BEHAVIORS = ("isolated", "removed", "contiguous", "mergedwithprevious", "mergedwithnext")


def split_text(text: str, pattern: regex.Pattern, behavior: str, invert: bool = False) -> list[str]:
    """HF ``Split`` semantics: cut ``text`` at ``pattern`` matches, then place the matches."""
    spans: list[tuple[str, bool]] = []  # (piece, is_match)
    pos = 0
    for m in pattern.finditer(text):
        if m.start() == m.end():
            continue
        if m.start() > pos:
            spans.append((text[pos : m.start()], False))
        spans.append((m.group(), True))
        pos = m.end()
    if pos < len(text):
        spans.append((text[pos:], False))
    if invert:
        spans = [(s, not d) for s, d in spans]
    behavior = behavior.lower()
    if behavior not in _BEHAVIORS:
        raise TokenizerError(f"unsupported split behavior {behavior!r}")
    if behavior == "isolated":
        return [s for s, _ in spans]
    if behavior == "removed":
        return [s for s, d in spans if not d]
    if behavior == "mergedwithnext":
        spans = spans[::-1]
    out: list[str] = []
    previous_match = False
    for s, d in spans:
        if behavior == "contiguous":
            if d and previous_match:
                out[-1] += s
            else:
                out.append(s)
        elif d and not previous_match and out:
            out[-1] = out[-1] + s if behavior == "mergedwithprevious" else s + out[-1]
        else:
            out.append(s)
        previous_match = d
    if behavior == "mergedwithnext":
        out.reverse()
    return out


def build_pre_tokenizer(spec: dict[str, Any] | None) -> PreTokenizer:
    """The word splitter an HF pre-tokenizer spec describes (no spec: the text is one word)."""
    steps = _pre_steps(spec)

    def run(text: str, first: bool) -> list[str]:
        pieces = [text]
        for step in steps:
            out: list[str] = []
            for k, piece in enumerate(pieces):
                out.extend(step(piece, first and k == 0))
            pieces = out
        return [p for p in pieces if p]

    return run


def _pre_steps(spec: dict[str, Any] | None) -> list[PreTokenizer]:
    if spec is None:
        return []
    kind = spec.get("type")
    if kind == "Sequence":
        return [step for sub in spec["pretokenizers"] for step in _pre_steps(sub)]
    if kind == "Split":
        pattern = compile_pattern(spec["pattern"])
        behavior, invert = spec.get("behavior", "Isolated"), spec.get("invert", False)
        return [lambda t, f: split_text(t, pattern, behavior, invert)]
    if kind == "Digits":
        digits = regex.compile(r"\p{N}" if spec.get("individual_digits") else r"\p{N}+")
        return [lambda t, f: split_text(t, digits, "Isolated")]
    if kind == "ByteLevel":
        prefix_space = spec.get("add_prefix_space", False)
        split = regex.compile(GPT2_SPLIT) if spec.get("use_regex", True) else None

        def byte_level(text: str, first: bool) -> list[str]:
            if prefix_space and not text.startswith(" "):
                text = " " + text
            parts = split_text(text, split, "Isolated") if split is not None else [text]
            return [to_byte_alphabet(p) for p in parts]

        return [byte_level]
    if kind == "Metaspace":
        repl = spec.get("replacement", "\u2581")
        scheme = spec.get("prepend_scheme")
        if scheme is None:  # older files: a bool
            scheme = "always" if spec.get("add_prefix_space", True) else "never"
        split = spec.get("split", True)
        delim = regex.compile(regex.escape(repl))

        def metaspace(text: str, first: bool) -> list[str]:
            text = text.replace(" ", repl)
            if (scheme == "always" or (scheme == "first" and first)) and not text.startswith(repl):
                text = repl + text
            return split_text(text, delim, "MergedWithNext") if split else [text]

        return [metaspace]
    raise TokenizerError(f"unsupported pre-tokenizer {kind!r}")


class BPE:
    """Byte-pair encoding of one word, merging the best-ranked adjacent pair first.

    Pairs are ranked either by an explicit merge list (``ranks``: (left, right) -> rank) or, for
    SentencePiece vocabularies without one, by the merged token (``priority``: token -> key,
    lower merges first). ``hf_ties`` breaks ties between equal priorities the way transformers
    orders merges it derives from a vocabulary (longer left piece first); otherwise ties go to
    the leftmost pair, as in SentencePiece itself.
    """

    def __init__(
        self,
        vocab: dict[str, int],
        *,
        ranks: dict[tuple[str, str], int] | None = None,
        priority: dict[str, float] | None = None,
        hf_ties: bool = False,
        byte_fallback: bool = False,
        unk_id: int | None = None,
        fuse_unk: bool = False,
        ignore_merges: bool = False,
    ):
        self.vocab = vocab
        self._ranks = ranks
        self._priority = priority
        self._hf_ties = hf_ties
        self._byte_fallback = byte_fallback
        self._unk_id = unk_id
        self._fuse_unk = fuse_unk
        self._ignore_merges = ignore_merges
        self._bytes = [vocab.get(f"<0x{b:02X}>") for b in range(256)]
        self._cache: dict[str, list[int]] = {}

    def _pair_key(self, left: str, right: str) -> Any:
        if self._ranks is not None:
            return self._ranks.get((left, right))
        merged = left + right
        p = self._priority.get(merged)
        if p is None or left not in self.vocab or right not in self.vocab:
            return None
        if self._hf_ties:
            return (p, -len(left), -len(right), self.vocab[merged])
        return p

    def _merge(self, word: str) -> list[str]:
        syms: list[str | None] = list(word)
        n = len(syms)
        if n < 2:
            return syms
        key = self._pair_key
        nxt = list(range(1, n + 1))
        prv = list(range(-1, n - 1))
        heap = []
        for i in range(n - 1):
            k = key(syms[i], syms[i + 1])
            if k is not None:
                heap.append((k, i, syms[i], syms[i + 1]))
        heapq.heapify(heap)
        while heap:
            _, i, left, right = heapq.heappop(heap)
            j = nxt[i]
            # stale entry: a symbol only ever grows, so equal text means it is unchanged
            if j >= n or syms[i] != left or syms[j] != right:
                continue
            merged = syms[i] = left + right
            syms[j] = None
            after = nxt[i] = nxt[j]
            if after < n:
                prv[after] = i
            before = prv[i]
            if before >= 0:
                k = key(syms[before], merged)
                if k is not None:
                    heapq.heappush(heap, (k, before, syms[before], merged))
            if after < n:
                k = key(merged, syms[after])
                if k is not None:
                    heapq.heappush(heap, (k, i, merged, syms[after]))
        return [s for s in syms if s is not None]

    def _ids(self, pieces: list[str]) -> list[int]:
        ids: list[int] = []
        unk_run = False
        for piece in pieces:
            tid = self.vocab.get(piece)
            if tid is not None:
                ids.append(tid)
                unk_run = False
                continue
            for ch in piece:  # only unknown characters stay unmerged
                raw = [self._bytes[b] for b in ch.encode("utf-8")]
                if self._byte_fallback and None not in raw:
                    ids.extend(raw)
                    unk_run = False
                elif self._unk_id is None:
                    raise TokenizerError(f"character {ch!r} is not in the vocabulary")
                elif not (self._fuse_unk and unk_run):
                    ids.append(self._unk_id)
                    unk_run = True
        return ids

    def encode_word(self, word: str) -> list[int]:
        ids = self._cache.get(word)
        if ids is not None:
            return ids
        if self._ignore_merges and word in self.vocab:
            ids = [self.vocab[word]]
        else:
            ids = self._ids(self._merge(word))
        if len(word) <= 128:  # long words (whole SentencePiece segments) rarely repeat
            if len(self._cache) >= 100_000:
                self._cache.clear()
            self._cache[word] = ids
        return ids


class Decoder:
    """Per-token bytes plus an optional strip of one leading space: all these decoders do.

    Tokens are turned into bytes one at a time (byte-level alphabet, ``<0xNN>`` byte tokens,
    ``▁`` -> space), so a streaming detokenizer can join them without ever splitting a character.
    """

    def __init__(self, spec: dict[str, Any] | None):
        self.byte_level = False
        self.byte_fallback = False
        self.replacements: list[tuple[str, str]] = []
        self.strip_leading_space = False
        self._walk(spec)

    def _walk(self, spec: dict[str, Any] | None) -> None:
        if spec is None:
            return
        kind = spec.get("type")
        if kind == "Sequence":
            for sub in spec["decoders"]:
                self._walk(sub)
        elif kind == "ByteLevel":
            self.byte_level = True
        elif kind == "ByteFallback":
            self.byte_fallback = True
        elif kind == "Fuse":
            pass
        elif kind == "Replace":
            pattern = spec["pattern"]
            if "String" not in pattern:
                raise TokenizerError(f"unsupported decoder pattern {pattern!r}")
            self.replacements.append((pattern["String"], spec["content"]))
        elif kind == "Strip":
            if spec.get("content", " ") != " " or spec.get("stop", 0) or spec.get("start", 0) > 1:
                raise TokenizerError(f"unsupported Strip decoder {spec!r}")
            self.strip_leading_space = spec.get("start", 0) == 1
        elif kind == "Metaspace":
            self.replacements.append((spec.get("replacement", "\u2581"), " "))
            scheme = spec.get("prepend_scheme")
            if scheme is None:
                scheme = "always" if spec.get("add_prefix_space", True) else "never"
            self.strip_leading_space = scheme != "never"
        else:
            raise TokenizerError(f"unsupported decoder {kind!r}")

    def token_bytes(self, token: str) -> bytes:
        if self.byte_level:
            raw = [CHAR_BYTES.get(c) for c in token]
            # a token outside the byte alphabet (an added token) stands for its own text
            return token.encode("utf-8") if None in raw else bytes(raw)
        if self.byte_fallback and len(token) == 6 and token.startswith("<0x") and token[5] == ">":
            try:
                return bytes([int(token[3:5], 16)])
            except ValueError:
                pass
        for old, new in self.replacements:
            token = token.replace(old, new)
        return token.encode("utf-8")


def merge_ranks(merges: Iterable[Any]) -> dict[tuple[str, str], int]:
    """Merge list -> rank per pair ("a b" strings or [a, b] pairs; a later duplicate wins)."""
    ranks = {}
    for rank, merge in enumerate(merges):
        pair = tuple(merge.split(" ", 1)) if isinstance(merge, str) else tuple(merge)
        if len(pair) != 2:
            raise TokenizerError(f"malformed merge {merge!r}")
        ranks[pair] = rank
    return ranks


# Word-split regexes by GGUF `tokenizer.ggml.pre`, applied in order (llama.cpp's llama-vocab.cpp
# and transformers' GGUF notes); names not listed get the GPT-2 split, as transformers does.
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen 3.5/3.6: the Qwen 2 split with combining marks kept inside words
QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTION}"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTION}"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GGUF_PRE_SPLITS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe"), (_LLAMA3,)
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), (_QWEN2,)),
    "qwen35": (QWEN35_SPLIT,),
    **dict.fromkeys(("gpt-4o", "llama4"), (_GPT4O,)),
    "tekken": (_TEKKEN,),
    # StarCoder-style vocabularies put every digit on its own before the GPT-2 split
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"),
        (r"\p{N}", GPT2_SPLIT),
    ),
}
