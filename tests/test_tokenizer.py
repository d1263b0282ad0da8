"""Tokenizers against their references: transformers (GGUF and tokenizer.json), sentencepiece."""

from __future__ import annotations

import random
import shutil
import time

import pytest

from hf2q_mlx.errors import TokenizerError
from hf2q_mlx.io.gguf import GGUFFile
from hf2q_mlx.tokenizer.tokenizer import GEMMA_CHAT_TEMPLATE, Tokenizer

transformers = pytest.importorskip("transformers")

# English, other scripts, emoji (ZWJ sequences, flags, variation selectors), code with tabs,
# repeated spaces, newlines and \r\n, unusual whitespace, digits, contractions.
TEXT = (
    "Hello world!  The quick brown fox—jumps over 13 lazy dogs (2024). I'LL don't we've\n"
    "你好，世界！这是一个测试。 مرحبا بالعالم، هذا اختبار. नमस्ते दुनिया, यह एक परीक्षण है। "
    "Привет, мир! Это тест.\n"
    "Emoji: 👩‍💻 👨‍👩‍👧‍👦 🏳️‍🌈 🇯🇵 ❤️ 😀😃\r\n"
    "def f(x):\n\tif x  >  1:\n\t\treturn x**2   # comment\n\n\n    pass\r\n"
    "  spaces   \u3000 ideographic\xa0nbsp \x0b\x0c end 3.14159 1,000,000 ٣٤٥ x²\n"
)
# fmt: off
FRAGMENTS = [
    "the", " cat", "Zebra", "über", "naïve", "日本語", "한국어", "ελληνικά", "עברית", "ไทย",
    "ქართული", "🤖", "👍🏽", "🧑‍🤝‍🧑", "\t", "\n", "\r\n", "   ", " ", "  ", "12345", "0.5", "'s",
    "{", "})", "==", "->", "#", "\\", "\u200b", "e\u0301", "﷽", "𝔘𝔫𝔦",
]
# fmt: on


SPM_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen jugs.\n"
    "Tokenizers split text into pieces; byte-pair encoding merges frequent pairs.\n"
    "Numbers like 12345 and 3.14159, code like def f(x): return x * 2, and more.\n"
    "Привет, как дела? Всё хорошо, спасибо. 你好，世界。今天天气很好。 مرحبا بالعالم\n"
)


def _random_text(seed: int, specials: list[str], n: int = 300) -> str:
    """Fresh mixed text: fragments, random code points and special tokens, fixed seed."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.05:
            out.append(rng.choice(specials))
        elif r < 0.2:
            cp = rng.choice(
                [
                    rng.randint(0x20, 0x7E),
                    rng.randint(0xA0, 0x2FFF),
                    rng.randint(0x4E00, 0x9FFF),
                    rng.randint(0x1F300, 0x1FAFF),
                ]
            )
            out.append(chr(cp))
        else:
            out.append(rng.choice(FRAGMENTS))
    return "".join(out)


def _texts(specials: list[str]) -> list[str]:
    with_specials = f"{specials[0]}user\n{TEXT}{specials[1]}\n{specials[0]}model\n ok{specials[1]}"
    return [
        TEXT,
        with_specials,
        " x",
        "",
        "  ",
        "\n\n\n",
        specials[0],
        _random_text(0, specials),
        _random_text(1, specials),
    ]


def _reference(path, cls):
    """transformers' GGUF tokenizer, built by the class AutoTokenizer resolves to for this file
    (GemmaTokenizer, TokenizersBackend): AutoTokenizer itself first reads the whole model config
    through gguf-py, which takes most of a minute on a loaded 2-core machine."""
    return cls.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def gemma_meta(gemma3_gguf_path):
    return GGUFFile(gemma3_gguf_path).metadata


@pytest.fixture(scope="module")
def gemma(gemma_meta):
    return Tokenizer.from_gguf(gemma_meta)


@pytest.fixture(scope="module")
def gemma_ref(gemma3_gguf_path):
    return _reference(gemma3_gguf_path, transformers.GemmaTokenizer)


@pytest.fixture(scope="module")
def smol_meta(smollm2_gguf_path):
    return GGUFFile(smollm2_gguf_path).metadata


@pytest.fixture(scope="module")
def smol(smol_meta):
    return Tokenizer.from_gguf(smol_meta)


@pytest.fixture(scope="module")
def smol_ref(smollm2_gguf_path):
    from tokenizers import pre_tokenizers
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    ref = _reference(smollm2_gguf_path, TokenizersBackend)
    # llama.cpp (which the GGUF is made for) splits every digit off first for pre="smollm", as
    # SmolLM2's own tokenizer.json does; transformers' GGUF conversion leaves that step out, so
    # the reference gets it back here.
    ref.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return ref


GEMMA_SPECIALS = ["<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "<unused7>", "[multimodal]"]
SMOL_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<file_sep>", "<jupyter_code>"]
CASES = {"gemma": GEMMA_SPECIALS, "smol": SMOL_SPECIALS}


@pytest.mark.parametrize("name", ["gemma", "smol"])
def test_gguf_ids_equal_transformers(name, request):
    ours, ref = request.getfixturevalue(name), request.getfixturevalue(f"{name}_ref")
    for text in _texts(CASES[name]):
        for add in (True, False):
            # exact: token ids are integers
            assert ours.encode(text, add_special_tokens=add) == ref.encode(
                text, add_special_tokens=add
            ), (name, add, text[:60])
    ids = ours.encode(TEXT)
    assert ours.decode(ids) == ref.decode(ids)
    assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)


def test_gguf_special_ids(gemma, smol, gemma_ref, smol_ref):
    assert gemma.bos_token_id == gemma_ref.bos_token_id == 2
    assert gemma.encode("a")[0] == 2 and smol.encode("a")[0] != smol.bos_token_id
    # Gemma's turns end at <end_of_turn>, SmolLM2's at <|im_end|>
    assert gemma.eos_token_ids == {
        gemma_ref.eos_token_id,
        gemma_ref.convert_tokens_to_ids("<end_of_turn>"),
    }
    assert smol_ref.convert_tokens_to_ids("<|im_end|>") in smol.eos_token_ids
    assert gemma.vocab_size == 262144 and smol.vocab_size == 49152


@pytest.mark.parametrize("pre", ["qwen2", "qwen35", "llama-bpe", "gpt-4o", "tekken"])
def test_gguf_pre_tokenizer_regexes(pre, smol_meta, smol_ref):
    """The split selected by tokenizer.ggml.pre equals transformers' split for that name."""
    from tokenizers import Regex, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    ours = Tokenizer.from_gguf({**smol_meta, "tokenizer.ggml.pre": pre})
    ref = HFTokenizer.from_str(smol_ref.backend_tokenizer.to_str())
    ref.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(GGUF_PRE_TOKENIZER_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    for text in _texts(SMOL_SPECIALS):
        assert (
            ours.encode(text, add_special_tokens=False)
            == ref.encode(text, add_special_tokens=False).ids
        ), (pre, text[:60])


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory, gemma_ref, smol_ref):
    root = tmp_path_factory.mktemp("hf")
    for name, ref in (("gemma", gemma_ref), ("smol", smol_ref)):
        ref.save_pretrained(root / name)
    return root


@pytest.fixture(scope="module")
def from_dirs(hf_dirs):
    return {name: Tokenizer.from_hf_dir(hf_dirs / name) for name in ("gemma", "smol")}


@pytest.mark.parametrize("name", ["gemma", "smol"])
def test_hf_tokenizer_json_equals_transformers(name, from_dirs, request):
    ref = request.getfixturevalue(f"{name}_ref")
    ours = from_dirs[name]
    for text in _texts(CASES[name]):
        for add in (True, False):
            assert ours.encode(text, add_special_tokens=add) == ref.encode(
                text, add_special_tokens=add
            ), (name, add, text[:60])
    assert ours.bos_token_id == request.getfixturevalue(name).bos_token_id
    assert ours.decode(ref.encode(TEXT)) == ref.decode(ref.encode(TEXT))


def _trained_tokenizer_json(normalizer, pre_tokenizer, decoder, byte_level: bool):
    """A small BPE trained with the tokenizers library, in one of the shapes LLM checkpoints
    use, with byte-fallback tokens, added tokens (lstrip/rstrip, normalized) and BOS/EOS."""
    import json

    from tokenizers import AddedToken, models, pre_tokenizers, processors, trainers
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer(
        models.BPE(
            unk_token=None if byte_level else "<unk>",
            byte_fallback=not byte_level,
            fuse_unk=not byte_level,
        )
    )
    hf.normalizer, hf.pre_tokenizer, hf.decoder = normalizer, pre_tokenizer, decoder
    alphabet = pre_tokenizers.ByteLevel.alphabet() if byte_level else []
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=alphabet,
        show_progress=False,
    )
    hf.train_from_iterator([SPM_CORPUS] * 4, trainer)
    spec = json.loads(hf.to_str())
    if not byte_level:  # byte-fallback tokens, as SentencePiece-converted vocabularies have
        vocab = spec["model"]["vocab"]
        n = max(vocab.values()) + 1
        vocab.update({f"<0x{b:02X}>": n + b for b in range(256)})
    hf = HFTokenizer.from_str(json.dumps(spec))
    hf.add_tokens([AddedToken("<|tool|>", lstrip=True, rstrip=True), AddedToken("[mask]")])
    hf.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)]
    )
    return hf


@pytest.mark.parametrize("shape", ["llama-legacy", "metaspace", "byte-level"])
def test_hf_tokenizer_json_shapes(shape, tmp_path):
    from tokenizers import decoders, normalizers, pre_tokenizers

    sp_decoders = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    args = {
        "llama-legacy": (
            normalizers.Sequence(
                [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
            ),
            None,
            decoders.Sequence([*sp_decoders, decoders.Strip(" ", 1, 0)]),
            False,
        ),
        "metaspace": (
            normalizers.NFKC(),
            pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=True),
            decoders.Metaspace(replacement="\u2581", prepend_scheme="first"),
            False,
        ),
        "byte-level": (
            normalizers.Sequence([normalizers.NFC(), normalizers.Lowercase()]),
            pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Digits(individual_digits=False),
                    pre_tokenizers.Split(" ", behavior="merged_with_next"),
                    pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True),
                ]
            ),
            decoders.ByteLevel(),
            True,
        ),
    }[shape]
    ref = _trained_tokenizer_json(*args)
    ref.save(str(tmp_path / "tokenizer.json"))
    ours = Tokenizer.from_hf_dir(tmp_path)
    specials = ["<|tool|>", "[mask]", "<s>", "</s>"]
    for text in [*_texts(specials), "The fox <|tool|>  jumps [mask] over 12345 dogs. "]:
        ids = ours.encode(text)
        assert ids == ref.encode(text).ids, (shape, text[:60])
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=False), (shape, text[:60])


def test_hf_dir_config_files(tmp_path):
    """BOS/EOS come from tokenizer.json's post-processor even when tokenizer_config.json says
    otherwise (as transformers' generic backend); the flags count only without one. EOS ids
    gather from tokenizer_config, generation_config and config.json."""
    import json

    from tokenizers import decoders, pre_tokenizers
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    hf = _trained_tokenizer_json(None, pre_tokenizers.ByteLevel(), decoders.ByteLevel(), True)
    hf.save(str(tmp_path / "tokenizer.json"))
    config = {
        "bos_token": "<s>",
        "eos_token": {"__type": "AddedToken", "content": "</s>"},
        "add_bos_token": False,
        "add_eos_token": False,
        "chat_template": "{{ messages[0]['content'] }}!",
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7, "bos_token_id": 1}))
    ours = Tokenizer.from_hf_dir(tmp_path)
    ref = TokenizersBackend.from_pretrained(str(tmp_path))
    for text in ["hello world", "<s>x</s>", ""]:
        for add in (True, False):
            assert ours.encode(text, add_special_tokens=add) == ref.encode(
                text, add_special_tokens=add
            ), text
    assert ours.encode("a")[0] == 1 and ours.encode("a")[-1] == 2
    assert ours.bos_token_id == 1 and ours.eos_token_ids == {2, 5, 7}
    assert ours.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi!"

    hf.post_processor = None
    hf.save(str(tmp_path / "tokenizer.json"))
    config.update(add_bos_token=True, add_eos_token=True)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ids = Tokenizer.from_hf_dir(tmp_path).encode("a")
    assert ids == [1, *hf.encode("a").ids, 2]


@pytest.fixture(scope="module")
def spm_models(tmp_path_factory):
    """Tiny SentencePiece BPE models: default (nmt_nfkc, dummy prefix, whitespace cleanup),
    identity normalization without either, and identity with the dummy prefix."""
    spm = pytest.importorskip("sentencepiece")
    root = tmp_path_factory.mktemp("spm")
    corpus = root / "corpus.txt"
    corpus.write_text(SPM_CORPUS * 3, encoding="utf-8")
    out = {}
    identity = {"normalization_rule_name": "identity", "remove_extra_whitespaces": False}
    for name, extra in (
        ("nfkc", {}),
        ("identity", {**identity, "add_dummy_prefix": False}),
        ("llama", identity),  # Llama-2-style: no normalization, dummy prefix
    ):
        spm.SentencePieceTrainer.train(
            input=str(corpus),
            model_prefix=str(root / name),
            vocab_size=600,
            model_type="bpe",
            byte_fallback=True,
            character_coverage=1.0,
            user_defined_symbols=["<sep>", "[CODE]"],
            minloglevel=2,
            **extra,
        )
        (root / f"dir_{name}").mkdir()
        shutil.copy(root / f"{name}.model", root / f"dir_{name}" / "tokenizer.model")
        out[name] = (
            Tokenizer.from_hf_dir(root / f"dir_{name}"),
            spm.SentencePieceProcessor(model_file=str(root / f"{name}.model")),
        )
    return out


SPM_TEXTS = [
    "The quick brown fox",
    "  Leading   spaces  and trailing  ",
    "Hello<sep>world [CODE] x",
    "你好 世界 ｆｕｌｌｗｉｄｔｈ ① ﬁ Ⅻ",
    "new\nlines\r\n\ttabs 👩‍💻 😀 ñ é",
    "",
    " ",
    TEXT,
    _random_text(2, ["<sep>", "[CODE]"]),
]


@pytest.mark.parametrize("name", ["nfkc", "identity"])
def test_tokenizer_model_equals_sentencepiece(name, spm_models):
    ours, sp = spm_models[name]
    for text in SPM_TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == sp.encode(text), (name, text[:60])
        assert ours.decode(ids) == sp.decode(ids)
    assert ours.bos_token_id == sp.bos_id() and ours.eos_token_ids == {sp.eos_id()}
    assert ours.encode("x")[0] == sp.bos_id()  # SentencePiece convention: BOS unless told not to


def test_gguf_llama_scores_equal_sentencepiece(spm_models):
    """A SentencePiece vocabulary in GGUF form (tokens, scores, types, add_space_prefix), as
    llama.cpp converts Llama-2-style models: merges by score, one space prefix at the start."""
    _, sp = spm_models["llama"]
    n = sp.get_piece_size()
    types = [
        3 if sp.is_control(i) else 2 if sp.is_unknown(i) else 6 if sp.is_byte(i) else 1
        for i in range(n)
    ]
    for sym in ("<sep>", "[CODE]"):
        types[sp.piece_to_id(sym)] = 4
    meta = {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
        "tokenizer.ggml.scores": [sp.get_score(i) for i in range(n)],
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": sp.bos_id(),
        "tokenizer.ggml.eos_token_id": sp.eos_id(),
        "tokenizer.ggml.unknown_token_id": sp.unk_id(),
    }
    ours = Tokenizer.from_gguf(meta)
    for text in SPM_TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == sp.encode(text), text[:60]
        assert ours.decode(ids) == sp.decode(ids)
    assert ours.encode("x") == [sp.bos_id(), *sp.encode("x")]  # add_bos defaults on for llama


def _tokenizers(request) -> list[tuple[str, Tokenizer, list[str]]]:
    spm = request.getfixturevalue("spm_models")
    return [
        ("gemma", request.getfixturevalue("gemma"), GEMMA_SPECIALS),
        ("smol", request.getfixturevalue("smol"), SMOL_SPECIALS),
        ("spm", spm["identity"][0], ["<sep>", "[CODE]"]),
        ("spm-nfkc", spm["nfkc"][0], ["<sep>", "[CODE]"]),
    ]


def test_round_trip(request):
    for name, tok, specials in _tokenizers(request):
        for text in _texts(specials):
            if name == "spm-nfkc":  # NFKC and whitespace cleanup change the text on purpose
                continue
            text = text.replace("\u2581", " ")  # SentencePiece reads U+2581 as a space
            assert tok.decode(tok.encode(text, add_special_tokens=False)) == text, (name, text)


def test_streaming_detokenizer(request):
    for name, tok, specials in _tokenizers(request):
        for text in _texts(specials)[:2] + [_random_text(3, specials, 600)]:
            ids = tok.encode(text)
            detok = tok.detokenizer()
            segments, held, data = [], 0, b""
            for k, tid in enumerate(ids):
                detok.add_token(tid)
                seg = detok.last_segment
                # never half a character: no replacement char, valid UTF-8 on its own
                assert "\ufffd" not in seg, (name, k)
                seg.encode("utf-8")
                segments.append(seg)
                data += tok.token_bytes(tid)
                try:
                    data.decode("utf-8")
                except UnicodeDecodeError:  # the ids so far end inside a character
                    held += 1
            detok.finalize()
            segments.append(detok.last_segment)
            assert "".join(segments) == detok.text == tok.decode(ids), name
            assert detok.last_segment == ""
        # the random text has characters split over byte tokens, so something was held back
        assert held > 0, name


def test_streaming_strips_sentencepiece_prefix_once(spm_models):
    tok, sp = spm_models["nfkc"]
    ids = tok.encode("  Hello there", add_special_tokens=False)
    assert sp.id_to_piece(ids[0]).startswith("\u2581")
    detok = tok.detokenizer()
    for tid in ids:
        detok.add_token(tid)
    detok.finalize()
    assert detok.text == tok.decode(ids) == sp.decode(ids) == "Hello there"


CONVERSATION = [
    {"role": "user", "content": "Hi there! 你好"},
    {"role": "assistant", "content": "Hello. How can I help?"},
    {"role": "user", "content": "  Write a haiku.\n"},
]
SYSTEM = [{"role": "system", "content": "You are terse."}]


def test_chat_template_smollm2(smol, smol_ref, from_dirs):
    from_dir = from_dirs["smol"]
    for messages in (CONVERSATION, SYSTEM + CONVERSATION):
        for gen in (True, False):
            expected = smol_ref.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=gen
            )
            assert smol.apply_chat_template(messages, add_generation_prompt=gen) == expected
            assert from_dir.apply_chat_template(messages, add_generation_prompt=gen) == expected


def test_chat_template_gemma(gemma, gemma_ref, from_dirs):
    # the Gemma 3 GGUF carries no template: ours is the built-in Gemma turn format
    rendered = gemma.apply_chat_template(SYSTEM + CONVERSATION)
    assert rendered == (
        "<bos><start_of_turn>user\nYou are terse.\n\nHi there! 你好<end_of_turn>\n"
        "<start_of_turn>model\nHello. How can I help?<end_of_turn>\n"
        "<start_of_turn>user\nWrite a haiku.<end_of_turn>\n<start_of_turn>model\n"
    )
    for messages in (CONVERSATION, SYSTEM + CONVERSATION):
        for gen in (True, False):
            assert gemma.apply_chat_template(messages, add_generation_prompt=gen) == (
                gemma_ref.apply_chat_template(
                    messages,
                    chat_template=GEMMA_CHAT_TEMPLATE,
                    tokenize=False,
                    add_generation_prompt=gen,
                )
            )
    with pytest.raises(TokenizerError, match="alternate"):
        gemma.apply_chat_template(CONVERSATION[:1] * 2)
    with pytest.raises(TokenizerError, match="no chat template"):
        from_dirs["gemma"].apply_chat_template(CONVERSATION)


def test_chat_template_helpers_match_transformers(smol, smol_ref):
    """strftime_now, tojson (no HTML escaping), tools, extra kwargs, loop controls."""
    template = (
        "{{ bos_token }}{{ strftime_now('%Y') }}|{% if tools %}{{ tools | tojson }}{% endif %}"
        "{% for m in messages %}{% if m.role == 'assistant' %}{% continue %}{% endif %}"
        "[{{ m.role }}:{{ m.content }}]{% endfor %}"
        "{% if enable_thinking %}<think>{% endif %}{% if add_generation_prompt %}>{% endif %}"
    )
    tools = [{"type": "function", "function": {"name": "f<x>", "description": "größe & 'a'"}}]
    for kwargs in ({"enable_thinking": True}, {"enable_thinking": False}, {}):
        ours = smol.apply_chat_template(CONVERSATION, chat_template=template, tools=tools, **kwargs)
        ref = smol_ref.apply_chat_template(
            CONVERSATION,
            chat_template=template,
            tools=tools,
            tokenize=False,
            add_generation_prompt=True,
            **kwargs,
        )
        assert ours == ref
    with pytest.raises(TokenizerError, match="boom"):
        smol.apply_chat_template(CONVERSATION, chat_template="{{ raise_exception('boom') }}")


def test_encode_speed(gemma_meta, smol_meta):
    """A 4096-token prompt encodes well under a second, from a cold per-word cache."""
    rng = random.Random(4)
    words = [w for w in TEXT.split() if w.isalpha()]
    for meta in (gemma_meta, smol_meta):
        tok = Tokenizer.from_gguf(meta)
        text = ""
        while len(tok.encode(text)) < 4096:
            text += " ".join(rng.choice(words) + str(rng.randint(0, 99)) for _ in range(400))
        fresh = Tokenizer.from_gguf(meta)
        t0 = time.perf_counter()
        ids = fresh.encode(text)
        elapsed = time.perf_counter() - t0
        assert len(ids) >= 4096
        assert elapsed < 1.0, elapsed


def test_errors(tmp_path):
    with pytest.raises(TokenizerError, match="unsupported GGUF tokenizer"):
        Tokenizer.from_gguf({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(TokenizerError, match="no tokenizer.ggml.tokens"):
        Tokenizer.from_gguf({"tokenizer.ggml.model": "llama"})
    with pytest.raises(TokenizerError, match="no tokenizer.json or tokenizer.model"):
        Tokenizer.from_hf_dir(tmp_path)
    (tmp_path / "tokenizer.model").write_bytes(b"\x0a\x05")  # truncated protobuf
    with pytest.raises(TokenizerError):
        Tokenizer.from_hf_dir(tmp_path)
