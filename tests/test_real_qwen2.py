"""The real Qwen2.5-Coder 0.5B / 1.5B Instruct Q4_K_M GGUFs against transformers' GGUF loader.

transformers dequantizes every tensor to fp32 and reads llama.cpp's layout itself: an independent
reference for our loader, model and tokenizer. The files come from ``hf2q_mlx.io.fetch``; a model
not in the cache skips.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch

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
# both sides fp32 (transformers on dequantized weights, ours dequantizes per matmul)
LOGIT_RTOL = 1e-3
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


@pytest.fixture(scope="module", params=list(SPLIT_MODELS))
def models(request):
    """(name, ours, our tokenizer, transformers model, transformers tokenizer)."""
    name = request.param
    path = cached_path(SPLIT_MODELS[name], cache_dir())
    if path is None:
        pytest.skip(f"{name} is not in the model cache (fetch it with hf2q_mlx.io.fetch)")
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    kw = dict(gguf_file=path.name)
    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent), dtype=torch.float32, attn_implementation="eager", **kw
    )
    hf_tok = AutoTokenizer.from_pretrained(str(path.parent), **kw)
    ours, tok = load(path)
    assert isinstance(ours, qwen2.Model)
    yield name, ours, tok, hf.eval(), hf_tok


def hf_logits(hf, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.from_numpy(ids).long(), use_cache=False).logits.float().numpy()


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
    # the prompts cut to one length decode as one batch (one dequantization per step)
    ids = [hf_tok(p).input_ids for p in PROMPTS]
    n = min(len(i) for i in ids)
    prompt = np.array([i[:n] for i in ids], dtype=np.int32)

    cache = ours.make_cache()
    logits = ours(mx.array(prompt), cache)[:, -1]
    ours_steps, tokens = [], []
    for step in range(NEW_TOKENS):
        ours_steps.append(np.array(logits))
        nxt = mx.argmax(logits, axis=-1)  # (3,)
        tokens.append(np.array(nxt))
        if step + 1 < NEW_TOKENS:
            logits = ours(nxt[:, None].astype(mx.int32), cache)[:, -1]
    ours_logits = np.stack(ours_steps, axis=1)  # (3, NEW_TOKENS, V)
    generated = np.stack(tokens, axis=1)  # (3, NEW_TOKENS)

    # transformers greedy-decodes exactly these tokens iff its argmax at every step is ours
    full = np.concatenate([prompt, generated], axis=1)
    ref = hf_logits(hf, full[:, :-1])[:, n - 1 :]  # (3, NEW_TOKENS, V)
    for b in range(len(PROMPTS)):
        text = hf_tok.decode(generated[b])
        assert np.array_equal(ref[b].argmax(-1), generated[b]), f"{name} diverged on: {text!r}"
        for t in range(NEW_TOKENS):
            r, o = ref[b, t], ours_logits[b, t]
            tol = LOGIT_RTOL * np.abs(r).max()
            top = np.argsort(-r)[:5]
            assert np.abs(o[top] - r[top]).max() <= tol, (name, b, t)


def test_perplexity(models, capsys):
    name, ours, _, hf, hf_tok = models
    tokens = hf_tok(TEXT, add_special_tokens=False).input_ids

    def hf_as_mlx(batch: mx.array, cache=None) -> mx.array:
        assert cache is None
        return mx.array(hf_logits(hf, np.array(batch)))

    # the same windowing and NLL code on both sides; only the model differs
    mine = perplexity(ours, tokens, len(tokens))
    ref = perplexity(hf_as_mlx, tokens, len(tokens))
    with capsys.disabled():
        print(
            f"\n[{name}] perplexity on {mine.n_tokens} tokens of code: "
            f"hf2q_mlx {mine.ppl:.6f}, transformers {ref.ppl:.6f}"
        )
    assert mine.n_tokens == ref.n_tokens == len(tokens) - 1
    assert f"{mine.ppl:.4g}" == f"{ref.ppl:.4g}"  # four significant digits
    assert 1.0 < mine.ppl < 10.0  # a code model on plain code, not noise
