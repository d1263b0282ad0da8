"""Tokenizers for GGUF files and HF directories: BPE encode/decode, chat templates, streaming."""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterable
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from hf2q_mlx.errors import TokenizerError
from hf2q_mlx.models.contract import TokenizerQuirks, find_architecture
from hf2q_mlx.tokenizer.bpe import (
    BPE,
    CHAR_BYTES,
    GGUF_PRE_SPLITS,
    GPT2_SPLIT,
    AddedToken,
    Decoder,
    TokenMatcher,
    build_normalizer,
    build_pre_tokenizer,
    merge_ranks,
    to_byte_alphabet,
)
from hf2q_mlx.tokenizer.spm import (
    CONTROL,
    UNKNOWN,
    USER_DEFINED,
    gguf_sentencepiece,
    hf_sentencepiece,
)
from hf2q_mlx.tokenizer.tiktoken_bpe import (
    added_tokens,
    is_control_token,
    load_tiktoken_ranks,
    rank_vocab,
)

# Turn/document enders that should stop generation even when a file names another EOS.
_END_OF_TURN = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>")

# Gemma's turn format, for GGUFs that carry no template: a system message is folded into the
# first user turn, roles must alternate, the assistant speaks as "model".
GEMMA_CHAT_TEMPLATE = r"""{{- bos_token -}}
{%- if messages and messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set prefix = messages[0]['content'] ~ '\n\n' -%}
    {%- else -%}
        {%- set prefix = messages[0]['content'][0]['text'] ~ '\n\n' -%}
    {%- endif -%}
    {%- set turns = messages[1:] -%}
{%- else -%}
    {%- set prefix = '' -%}
    {%- set turns = messages -%}
{%- endif -%}
{%- for m in turns -%}
    {%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/...') -}}
    {%- endif -%}
    {{- '<start_of_turn>' ~ ('model' if m['role'] == 'assistant' else m['role']) ~ '\n' -}}
    {%- if loop.first -%}{{- prefix -}}{%- endif -%}
    {%- if m['content'] is string -%}
        {{- m['content'] | trim -}}
    {%- else -%}
        {%- for part in m['content'] -%}
            {%- if part['type'] == 'image' -%}{{- '<start_of_image>' -}}
            {%- elif part['type'] == 'text' -%}{{- part['text'] | trim -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
    {{- '<end_of_turn>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}
"""

# Qwen 3.5 (ChatML turns with <think> blocks), for GGUFs that carry no template. Reasoning is
# kept only for assistant turns after the last user message (earlier turns show the answer
# alone); it comes from `reasoning_content` or from a <think>...</think> block in the content.
# The generation prompt opens a <think> block, or closes an empty one when enable_thinking is
# false. Text content only; no tool definitions or tool calls.
QWEN35_CHAT_TEMPLATE = r"""
{%- macro as_text(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable -%}
        {%- for part in content -%}
            {%- if part['type'] != 'text' -%}
                {{- raise_exception('only text content is supported, not ' ~ part['type']) -}}
            {%- endif -%}
            {{- part['text'] -}}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- if not messages -%}{{- raise_exception('no messages') -}}{%- endif -%}
{%- if tools -%}
    {{- raise_exception('the built-in Qwen 3.5 template has no tool support') -}}
{%- endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}
    {%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- for m in messages -%}
    {%- set content = as_text(m['content']) | trim -%}
    {%- if m['role'] == 'system' -%}
        {%- if not loop.first -%}
            {{- raise_exception('the system message must come first') -}}
        {%- endif -%}
        {{- '<|im_start|>system\n' ~ content ~ '<|im_end|>\n' -}}
    {%- elif m['role'] == 'user' -%}
        {{- '<|im_start|>user\n' ~ content ~ '<|im_end|>\n' -}}
    {%- elif m['role'] == 'assistant' -%}
        {%- set reasoning = '' -%}
        {%- if m.reasoning_content is string -%}
            {%- set reasoning = m.reasoning_content -%}
        {%- elif '</think>' in content -%}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}
            {%- set content = content.split('</think>')[-1] | trim -%}
        {%- endif -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- if loop.index0 > ns.last_user -%}
            {{- '<think>\n' ~ (reasoning | trim) ~ '\n</think>\n\n' -}}
        {%- endif -%}
        {{- content ~ '<|im_end|>\n' -}}
    {%- else -%}
        {{- raise_exception('unsupported role ' ~ m['role']) -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}
        {{- '<think>\n\n</think>\n\n' -}}
    {%- else -%}
        {{- '<think>\n' -}}
    {%- endif -%}
{%- endif -%}
"""
# the built-in templates an architecture's TokenizerQuirks.chat_template names
BUILTIN_CHAT_TEMPLATES = {"gemma": GEMMA_CHAT_TEMPLATE, "qwen35": QWEN35_CHAT_TEMPLATE}


class StreamingDetokenizer:
    """Incremental decode: ``add_token(id)``, then read ``last_segment`` (text added since the
    previous read). Bytes are decoded with an incremental UTF-8 decoder, so a character split
    over byte tokens is held back until complete; the joined segments equal ``decode(ids)``."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._strip = tokenizer._decoder.strip_leading_space
        self._started = False
        self._segment = ""
        self.text = ""
        self.tokens: list[int] = []

    def reset(self) -> None:
        self.__init__(self._tokenizer, self._skip)

    def add_token(self, token_id: int) -> None:
        token_id = int(token_id)
        self.tokens.append(token_id)
        if self._skip and token_id in self._tokenizer._special_ids:
            return
        self._push(self._utf8.decode(self._tokenizer.token_bytes(token_id)))

    def finalize(self) -> None:
        self._push(self._utf8.decode(b"", final=True))

    def _push(self, text: str) -> None:
        if not self._started and text:
            # SentencePiece decoders drop the one dummy-prefix space at the very start
            if self._strip and text.startswith(" "):
                text = text[1:]
            self._started = True
        self._segment += text
        self.text += text

    @property
    def last_segment(self) -> str:
        segment, self._segment = self._segment, ""
        return segment


class Tokenizer:
    """BPE tokenizer built from HF-style specs (``tokenizer.json`` sections); see the loaders."""

    def __init__(
        self,
        model: BPE,
        added_tokens: Iterable[AddedToken] = (),
        *,
        normalizer: dict[str, Any] | None = None,
        pre_tokenizer: dict[str, Any] | None = None,
        decoder: dict[str, Any] | None = None,
        bos_token_id: int | None = None,
        eos_token_ids: Iterable[int] = (),
        prefix_ids: Iterable[int] = (),
        suffix_ids: Iterable[int] = (),
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
    ):
        self._model = model
        self._normalizer = build_normalizer(normalizer)
        self._pre_tokenizer = build_pre_tokenizer(pre_tokenizer)
        self._decoder = Decoder(decoder)
        # "normalized" added tokens are matched, and decoded, in their normalized spelling (HF)
        norm = self._normalizer or (lambda t, f: t)
        added = [
            t._replace(content=norm(t.content, False)) if t.normalized else t for t in added_tokens
        ]
        self._raw_matcher = TokenMatcher(t for t in added if not t.normalized)
        self._norm_matcher = TokenMatcher(t for t in added if t.normalized)
        self._special_ids = {t.id for t in added if t.special}
        self._added_ids = {t.content: t.id for t in added}
        self.vocab_size = max([*model.vocab.values(), *(t.id for t in added)]) + 1
        self._id_to_token = [""] * self.vocab_size
        for token, tid in model.vocab.items():
            self._id_to_token[tid] = token
        for t in added:
            self._id_to_token[t.id] = t.content
        self._bytes: list[bytes | None] = [None] * self.vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_ids: set[int] = set(eos_token_ids)
        self._prefix = list(prefix_ids)
        self._suffix = list(suffix_ids)
        self.chat_template = chat_template
        # True when the template is our built-in fallback, not one the model files carry
        self.chat_template_is_builtin = False
        self.special_tokens = dict(special_tokens or {})

    # ---- loaders -------------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, metadata: dict[str, Any]) -> Tokenizer:
        """From a GGUF's metadata (``tokenizer.ggml.*``, ``tokenizer.chat_template``)."""
        kind = metadata.get("tokenizer.ggml.model")
        tokens = list(metadata.get("tokenizer.ggml.tokens") or [])
        if not tokens:
            raise TokenizerError("GGUF metadata has no tokenizer.ggml.tokens")
        types = list(metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        quirks = _gguf_quirks(metadata.get("general.architecture", ""))
        if kind in ("llama", "gemma4"):
            kwargs = gguf_sentencepiece(metadata, tokens, quirks.gemma_sentencepiece)
        elif kind == "gpt2":
            kwargs = _gguf_byte_level(metadata, tokens)
        else:
            raise TokenizerError(
                f"unsupported GGUF tokenizer model {kind!r} (supported: llama, gemma4, gpt2)"
            )
        vocab = kwargs["model"].vocab
        added = []
        for i, (token, ttype) in enumerate(zip(tokens, types)):
            # as transformers: control tokens become special; a byte-level vocabulary's control
            # token outside the byte alphabet is a mislabel; user-defined ones must be in vocab
            if ttype in (CONTROL, UNKNOWN) and not (
                kind == "gpt2" and not _in_byte_alphabet(token)
            ):
                added.append(AddedToken(vocab.get(token, i), token, special=True))
            elif ttype == USER_DEFINED and token in vocab:
                added.append(AddedToken(vocab[token], token, special=False))
        names = {}
        for name, key in zip(("bos", "eos", "unk", "pad"), ("bos", "eos", "unknown", "padding")):
            tid = metadata.get(f"tokenizer.ggml.{key}_token_id")
            if tid is not None and 0 <= tid < len(tokens):
                names[f"{name}_token"] = tokens[tid]
        bos = metadata.get("tokenizer.ggml.bos_token_id")
        eos_id = metadata.get("tokenizer.ggml.eos_token_id")
        add_bos = metadata.get("tokenizer.ggml.add_bos_token", kind == "llama")
        if kind == "gemma4":  # its chat template writes <bos> itself (transformers does the same)
            add_bos = False
        add_eos = metadata.get("tokenizer.ggml.add_eos_token", False)
        eos = {
            metadata[f"tokenizer.ggml.{k}_token_id"]
            for k in ("eos", "eot", "eom")
            if metadata.get(f"tokenizer.ggml.{k}_token_id") is not None
        }
        special = {t.id for t in added if t.special}
        eos |= {vocab[t] for t in _END_OF_TURN if vocab.get(t) in special}
        template = metadata.get("tokenizer.chat_template")
        builtin = template is None and quirks.chat_template is not None
        if builtin:
            template = BUILTIN_CHAT_TEMPLATES[quirks.chat_template]
        tokenizer = cls(
            added_tokens=added,
            bos_token_id=bos,
            eos_token_ids=eos,
            prefix_ids=[bos] if add_bos and bos is not None else [],
            suffix_ids=[eos_id] if add_eos and eos_id is not None else [],
            chat_template=template,
            special_tokens=names,
            **kwargs,
        )
        tokenizer.chat_template_is_builtin = builtin
        return tokenizer

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """From a HF directory: ``tokenizer.json`` (else ``tokenizer.model``) plus
        ``tokenizer_config.json``, ``special_tokens_map.json``, ``generation_config.json``."""
        root = Path(path)
        if not root.is_dir():
            raise TokenizerError(f"{root} is not a directory")
        config = _read_json(root / "tokenizer_config.json")
        special_map = _read_json(root / "special_tokens_map.json")
        names = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = config.get(key) or special_map.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                names[key] = value
        if (root / "tokenizer.json").exists():
            kwargs, added, processor = _hf_tokenizer_json(root / "tokenizer.json")
        elif (root / "tokenizer.model").exists():
            kwargs, added, processor = hf_sentencepiece(root / "tokenizer.model", names)
        else:
            raise TokenizerError(f"{root}: no tokenizer.json or tokenizer.model")
        vocab = kwargs["model"].vocab
        known = {t.id for t in added}
        for tid, spec in (config.get("added_tokens_decoder") or {}).items():
            if int(tid) not in known:
                added.append(_added_token(int(tid), spec))
        ids = {**vocab, **{t.content: t.id for t in added}}

        bos = ids.get(names.get("bos_token", ""))
        model_config = _read_json(root / "config.json")
        if bos is None and isinstance(model_config.get("bos_token_id"), int):
            bos = model_config["bos_token_id"]
        eos: set[int] = set()
        if names.get("eos_token") in ids:
            eos.add(ids[names["eos_token"]])
        for cfg in (_read_json(root / "generation_config.json"), model_config):
            value = cfg.get("eos_token_id")
            eos.update([value] if isinstance(value, int) else value or [])
        special = {t.id for t in added if t.special}
        eos |= {ids[t] for t in _END_OF_TURN if ids.get(t) in special}

        # tokenizer.json's post-processor decides (as in the tokenizers library and transformers'
        # generic backend); without one, the tokenizer_config flags do
        if processor is None:
            default_bos = not (root / "tokenizer.json").exists()  # SentencePiece convention
            prefix = [bos] if config.get("add_bos_token", default_bos) and bos is not None else []
            eos_id = ids.get(names.get("eos_token", ""))
            suffix = [eos_id] if config.get("add_eos_token", False) and eos_id is not None else []
        else:
            prefix, suffix = _post_processor_ids(processor)

        template_file = root / "chat_template.jinja"
        template = config.get("chat_template")
        if template_file.exists():
            template = template_file.read_text(encoding="utf-8")
        elif isinstance(template, list):  # named templates: take "default", else the first
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default", next(iter(named.values()), None))
        return cls(
            added_tokens=added,
            bos_token_id=bos,
            eos_token_ids=eos,
            prefix_ids=prefix,
            suffix_ids=suffix,
            chat_template=template,
            special_tokens=names,
            **kwargs,
        )

    @classmethod
    def from_tiktoken(
        cls,
        path: str | Path,
        *,
        pattern: str,
        special_tokens: dict[str, int] | None = None,
        nfc: bool = False,
        eos_tokens: Iterable[str] = (),
        chat_template: str | None = None,
    ) -> Tokenizer:
        """From a tiktoken rank file: ``pattern`` splits words, ``special_tokens`` (text -> id)
        are matched whole, ``nfc`` normalizes the text first (Qwen does). Ids are tiktoken's:
        rank-based BPE, a word that is itself a token taken whole. ``<|...|>`` tokens are
        special; the others (``<think>``) decode as text even with ``skip_special_tokens``.
        For Qwen 3.5/3.6: ``pattern=tokenizer_bpe.QWEN35_SPLIT, nfc=True,
        chat_template=QWEN35_CHAT_TEMPLATE``.
        """
        ranks = load_tiktoken_ranks(path)
        vocab = rank_vocab(ranks)
        special_tokens = dict(special_tokens or {})
        eos_tokens = list(eos_tokens)
        added = [
            AddedToken(tid, token, special=is_control_token(token))
            for token, tid in added_tokens(special_tokens, ranks)
        ]
        eos = set()
        for name in eos_tokens:
            if name not in special_tokens:
                raise TokenizerError(f"eos token {name!r} is not among the special tokens")
            eos.add(special_tokens[name])
        eos |= {special_tokens[t] for t in _END_OF_TURN if t in special_tokens}
        byte_level = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}
        split = {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated"}
        names = {}
        if "<|endoftext|>" in special_tokens:
            names["pad_token"] = "<|endoftext|>"
        if eos_tokens:
            names["eos_token"] = eos_tokens[0]
        return cls(
            # the merged pair's own rank orders merges: ``priority`` is the vocabulary itself
            BPE(vocab, priority=vocab, ignore_merges=True),
            added,
            normalizer={"type": "NFC"} if nfc else None,
            pre_tokenizer={"type": "Sequence", "pretokenizers": [split, byte_level]},
            decoder=byte_level,
            eos_token_ids=eos,
            chat_template=chat_template,
            special_tokens=names,
        )

    # ---- encode / decode -----------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; added/special tokens in the text are matched whole, and the BOS/EOS the
        tokenizer adds by itself come only with ``add_special_tokens``."""
        ids: list[int] = []
        for part in self._raw_matcher.split(text):
            if isinstance(part, AddedToken):
                ids.append(part.id)
                continue
            segment, start = part
            first = start == 0
            if self._normalizer is not None:
                segment = self._normalizer(segment, first)
            for sub in self._norm_matcher.split(segment):
                if isinstance(sub, AddedToken):
                    ids.append(sub.id)
                    continue
                piece, offset = sub
                for word in self._pre_tokenizer(piece, first and offset == 0):
                    ids.extend(self._model.encode_word(word))
        if add_special_tokens:
            ids = self._prefix + ids + self._suffix
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (ids outside the vocabulary stand for nothing)."""
        if not 0 <= token_id < self.vocab_size:
            return b""
        data = self._bytes[token_id]
        if data is None:
            data = self._bytes[token_id] = self._decoder.token_bytes(self._id_to_token[token_id])
        return data

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise TokenizerError(f"decode: token id {bad[0]} is outside [0, {self.vocab_size})")
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special_ids]
        text = b"".join([self.token_bytes(i) for i in ids]).decode("utf-8", errors="replace")
        if self._decoder.strip_leading_space and text.startswith(" "):
            text = text[1:]
        return text

    def detokenizer(self, skip_special_tokens: bool = False) -> StreamingDetokenizer:
        return StreamingDetokenizer(self, skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        return self._id_to_token[token_id]

    def token_to_id(self, token: str) -> int | None:
        return self._added_ids.get(token, self._model.vocab.get(token))

    # ---- chat ----------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Render the conversation with the model's Jinja chat template (HF conventions)."""
        template = chat_template or self.chat_template
        if not template:
            raise TokenizerError(
                "this tokenizer has no chat template; pass chat_template= or a plain prompt"
            )
        import jinja2

        try:
            return _compile_template(template).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                **{"documents": None, **self.special_tokens, **kwargs},
            )
        except jinja2.TemplateError as err:
            raise TokenizerError(f"chat template: {err}") from err


# ---- GGUF -------------------------------------------------------------------------------------


def _gguf_quirks(architecture: str) -> TokenizerQuirks:
    """What the model module serving this GGUF architecture declares about its vocabulary."""
    arch = find_architecture(gguf_architecture=architecture)
    return arch.tokenizer if arch is not None else TokenizerQuirks()


def _in_byte_alphabet(token: str) -> bool:
    return all(c in CHAR_BYTES for c in token)


def _gguf_byte_level(metadata: dict, tokens: list[str]) -> dict[str, Any]:
    """GPT-2-style byte-level BPE with an explicit merge list."""
    merges = metadata.get("tokenizer.ggml.merges")
    if not merges:
        raise TokenizerError("GGUF gpt2 tokenizer has no tokenizer.ggml.merges")
    # a token written outside the byte alphabet is respelled through its UTF-8 bytes
    vocab = {t if _in_byte_alphabet(t) else to_byte_alphabet(t): i for i, t in enumerate(tokens)}
    splits = GGUF_PRE_SPLITS.get(metadata.get("tokenizer.ggml.pre", "default"), (GPT2_SPLIT,))
    pre = [{"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated"} for r in splits]
    pre.append({"type": "ByteLevel", "add_prefix_space": False, "use_regex": False})
    return {
        "model": BPE(vocab, ranks=merge_ranks(merges)),
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": pre},
        "decoder": {"type": "ByteLevel"},
    }


# ---- HF directories ---------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise TokenizerError(f"{path}: {err}") from err
    return data if isinstance(data, dict) else {}


def _added_token(tid: int, spec: dict[str, Any]) -> AddedToken:
    return AddedToken(
        tid,
        spec["content"],
        special=bool(spec.get("special", False)),
        lstrip=bool(spec.get("lstrip", False)),
        rstrip=bool(spec.get("rstrip", False)),
        normalized=bool(spec.get("normalized", False)),
    )


def _hf_tokenizer_json(path: Path) -> tuple[dict, list, Any]:
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise TokenizerError(f"{path}: {err}") from err
    model = spec.get("model") or {}
    if model.get("type", "BPE") != "BPE" or "vocab" not in model:
        raise TokenizerError(f"{path}: only BPE models are supported, not {model.get('type')!r}")
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        raise TokenizerError(f"{path}: BPE subword prefixes/suffixes are not supported")
    vocab = model["vocab"]
    unk = model.get("unk_token")
    bpe = BPE(
        vocab,
        ranks=merge_ranks(model.get("merges") or []),
        byte_fallback=bool(model.get("byte_fallback")),
        unk_id=vocab.get(unk) if unk is not None else None,
        fuse_unk=bool(model.get("fuse_unk")),
        ignore_merges=bool(model.get("ignore_merges")),
    )
    added = [_added_token(t["id"], t) for t in spec.get("added_tokens") or []]
    kwargs = {
        "model": bpe,
        "normalizer": spec.get("normalizer"),
        "pre_tokenizer": spec.get("pre_tokenizer"),
        "decoder": spec.get("decoder"),
    }
    return kwargs, added, spec.get("post_processor")


def _post_processor_ids(spec: dict[str, Any] | None) -> tuple[list[int], list[int]]:
    """Ids an HF post-processor puts before and after a single sequence."""
    if spec is None:
        return [], []
    kind = spec.get("type")
    if kind == "Sequence":
        prefix, suffix = [], []
        for sub in spec.get("processors", []):
            p, s = _post_processor_ids(sub)
            prefix, suffix = p + prefix, suffix + s
        return prefix, suffix
    if kind == "TemplateProcessing":
        tokens = spec.get("special_tokens", {})
        prefix, suffix, after = [], [], False
        for item in spec.get("single", []):
            if "Sequence" in item:
                after = True
            elif "SpecialToken" in item:
                (suffix if after else prefix).extend(tokens[item["SpecialToken"]["id"]]["ids"])
        return prefix, suffix
    if kind in ("BertProcessing", "RobertaProcessing"):
        return [spec["cls"][1]], [spec["sep"][1]]
    if kind == "ByteLevel":
        return [], []
    raise TokenizerError(f"unsupported post-processor {kind!r}")


# ---- chat templates ---------------------------------------------------------------------------


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, indent: int | None = None, separators=None, sort_keys=False) -> str:
    # unlike Jinja's own tojson: no HTML escaping, non-ASCII kept (what HF templates expect)
    return json.dumps(
        value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys
    )


@lru_cache(maxsize=16)
def _compile_template(template: str) -> Any:
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
