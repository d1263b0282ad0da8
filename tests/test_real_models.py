"""Real GGUF models (Gemma 3 270M Q4_K_M, SmolLM2-135M Q4_1) against transformers' GGUF loader
(tests/transformers_reference.py). Token ids come from the transformers tokenizer, so these tests
do not depend on ours.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from transformers_reference import assert_greedy_matches, hf_as_mlx, load_transformers_gguf

from hf2q_mlx.cli.perplexity import perplexity
from hf2q_mlx.io.loader import load_model

pytestmark = pytest.mark.real_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
]
NEW_TOKENS = 32
# perplexity windows: fewer tokens than the full text keeps this test within the CPU budget
PPL_CONTEXT, PPL_WINDOWS = 96, 2
TEXT = Path(__file__).parent / "data" / "us_constitution.txt"


@pytest.fixture(scope="module", params=["gemma3", "smollm2"])
def models(request):
    """(name, ours, transformers model, transformers tokenizer), one architecture at a time."""
    path = request.getfixturevalue(f"{request.param}_gguf_path")
    hf, tok = load_transformers_gguf(path)
    ours, info = load_model(path)
    assert info.format == "gguf" and info.dtype == mx.float32
    yield request.param, ours, hf, tok


def test_greedy_continuation_and_top5(models):
    name, ours, hf, tok = models
    assert_greedy_matches(name, ours, hf, tok, PROMPTS, NEW_TOKENS)


def test_perplexity(models, capsys):
    name, ours, hf, tok = models
    ids = tok(TEXT.read_text()).input_ids
    bos = tok.bos_token_id if ids[0] == tok.bos_token_id else None
    body = ids[1:] if bos is not None else ids
    step = PPL_CONTEXT - (1 if bos is not None else 0)
    tokens = body[: step * PPL_WINDOWS]

    # the same windowing and NLL code on both sides; only the model differs
    mine = perplexity(ours, tokens, PPL_CONTEXT, batch_size=PPL_WINDOWS, bos_token_id=bos)
    ref = perplexity(hf_as_mlx(hf), tokens, PPL_CONTEXT, batch_size=PPL_WINDOWS, bos_token_id=bos)
    with capsys.disabled():
        print(
            f"\n[{name}] perplexity on {mine.n_tokens} tokens of {TEXT.name}: "
            f"hf2q_mlx {mine.ppl:.4f}, transformers {ref.ppl:.4f}"
        )
    assert mine.n_tokens == ref.n_tokens
    # logits agree to ~1e-5 relative (see transformers_reference.LOGIT_RTOL), so the mean NLL
    # agrees far inside 1e-3
    assert abs(mine.nll - ref.nll) <= 1e-3 * ref.nll
    assert 1.0 < mine.ppl < 100.0  # a working model on English prose, not noise


def test_public_load_with_our_tokenizer(models, request):
    # hf2q_mlx.load: the same weights plus our tokenizer, which must reproduce the ids
    pytest.importorskip("hf2q_mlx.tokenizer.tokenizer")
    import hf2q_mlx

    name, ours, _, tok = models
    model, tokenizer = hf2q_mlx.load(request.getfixturevalue(f"{name}_gguf_path"))
    assert type(model) is type(ours)
    for prompt in PROMPTS:
        assert tokenizer.encode(prompt) == tok(prompt).input_ids, prompt
