"""The real Qwen2.5-Coder 0.5B / 1.5B Instruct Q4_K_M GGUFs against transformers' GGUF loader.

transformers (tests/transformers_reference.py) is an independent reference for our loader, model
and tokenizer. The files come from ``hf2q_mlx.io.fetch``; a model not in the cache skips with its
fetch command (CI fetches the 0.5B: README "Set up").
"""

from __future__ import annotations

import pytest
from transformers_reference import assert_greedy_matches, hf_as_mlx, load_transformers_gguf

from hf2q_mlx.cli.perplexity import perplexity
from hf2q_mlx.io.default_model import cache_dir
from hf2q_mlx.io.fetch import SPLIT_MODELS, cached_path
from hf2q_mlx.io.loader import load
from hf2q_mlx.models import qwen2

pytestmark = pytest.mark.real_model

PROMPTS = [
    "def is_prime(n: int) -> bool:\n    ",
    "import numpy as np\n\n\ndef softmax(x):\n    ",
    "# Return the index of target in the sorted list items, or -1.\ndef binary_search(",
]
NEW_TOKENS = 32
TEXT = '''def merge_sorted(a: list[int], b: list[int]) -> list[int]:
    """Merge two sorted lists into one sorted list."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    out.extend(a[i:])
    out.extend(b[j:])
    return out
'''
# text the tokenizers must split alike: digits, whitespace runs, contractions, CJK, emoji
TRICKY = "x  =  12345 ;\n\n\t  it's   OK's \u4f60\u597d\u4e16\u754c \U0001f600 caf\u00e9\r\n  "
CHAT = [
    {"role": "system", "content": "You are a careful Python reviewer."},
    {"role": "user", "content": "Write a function that reverses a string."},
    {"role": "assistant", "content": "def reverse(s):\n    return s[::-1]"},
    {"role": "user", "content": "Now without slicing."},
]


QWEN2_MODELS = ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]  # not every fetched model is a Qwen 2


@pytest.fixture(scope="module", params=QWEN2_MODELS)
def models(request):
    """(name, ours, our tokenizer, transformers model, transformers tokenizer)."""
    name = request.param
    path = cached_path(SPLIT_MODELS[name], cache_dir())
    if path is None:
        pytest.skip(f"{name} is not in the model cache: hf2q-mlx fetch {name}")
    hf, hf_tok = load_transformers_gguf(path)
    ours, tok = load(path)
    assert isinstance(ours, qwen2.Model)
    yield name, ours, tok, hf, hf_tok


def test_tokenizer_and_chat_template(models):
    name, _, tok, _, hf_tok = models
    for text in [*PROMPTS, TEXT, TRICKY]:
        ids = hf_tok(text, add_special_tokens=False).input_ids
        assert tok.encode(text, add_special_tokens=False) == ids, (name, text)
        assert tok.decode(ids) == text
    rendered = hf_tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert tok.apply_chat_template(CHAT, add_generation_prompt=True) == rendered
    assert tok.encode(rendered) == hf_tok(rendered).input_ids
    assert rendered.endswith("<|im_start|>assistant\n")


def test_greedy_continuation_and_top5(models):
    name, ours, _, hf, hf_tok = models
    assert_greedy_matches(name, ours, hf, hf_tok, PROMPTS, NEW_TOKENS)


def test_perplexity(models, capsys):
    name, ours, _, hf, hf_tok = models
    tokens = hf_tok(TEXT, add_special_tokens=False).input_ids

    # the same windowing and NLL code on both sides; only the model differs
    mine = perplexity(ours, tokens, len(tokens))
    ref = perplexity(hf_as_mlx(hf), tokens, len(tokens))
    with capsys.disabled():
        print(
            f"\n[{name}] perplexity on {mine.n_tokens} tokens of code: "
            f"hf2q_mlx {mine.ppl:.6f}, transformers {ref.ppl:.6f}"
        )
    assert mine.n_tokens == ref.n_tokens == len(tokens) - 1
    assert f"{mine.ppl:.4g}" == f"{ref.ppl:.4g}"  # four significant digits
    assert 1.0 < mine.ppl < 10.0  # a code model on plain code, not noise
