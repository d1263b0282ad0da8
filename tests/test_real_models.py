"""Real GGUF models (Gemma 3 270M Q4_K_M, SmolLM2-135M Q4_1) against transformers' GGUF loader.

transformers dequantizes every tensor to fp32 and undoes llama.cpp's conventions itself, so it is
an independent reference for our loader (raw GGML blocks, our own un-permutation) and models.
Token ids come from the transformers tokenizer, so these tests do not depend on ours.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch

from hf2q_mlx.cli.perplexity import perplexity
from hf2q_mlx.io.loader import load_model

pytestmark = pytest.mark.real_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
]
NEW_TOKENS = 32
# both sides run fp32 (transformers on the dequantized weights, we dequantize per matmul); they
# sum in different orders, so logits agree to ~1e-5 of the largest one: 1e-3 leaves headroom
LOGIT_RTOL = 1e-3
# perplexity windows: fewer tokens than the full text keeps this test within the CPU budget
PPL_CONTEXT, PPL_WINDOWS = 96, 2
TEXT = Path(__file__).parent / "data" / "us_constitution.txt"


@pytest.fixture(scope="module", params=["gemma3", "smollm2"])
def models(request):
    """(name, ours, transformers model, transformers tokenizer), one architecture at a time."""
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = request.getfixturevalue(f"{request.param}_gguf_path")
    torch.set_num_threads(2)
    kw = dict(gguf_file=path.name)
    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent), dtype=torch.float32, attn_implementation="eager", **kw
    )
    tok = AutoTokenizer.from_pretrained(str(path.parent), **kw)
    ours, info = load_model(path)
    assert info.format == "gguf" and info.dtype == mx.float32
    yield request.param, ours, hf.eval(), tok


def hf_logits(hf, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.from_numpy(ids).long(), use_cache=False).logits.float().numpy()


def test_greedy_continuation_and_top5(models):
    name, ours, hf, tok = models
    # cut the prompts to one length so all three decode as one batch (one dequant per step)
    ids = [tok(p).input_ids for p in PROMPTS]
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

    # transformers scores the same sequences in one pass; greedy decoding on its side produces
    # exactly these tokens iff its argmax at every step is our token
    full = np.concatenate([prompt, generated], axis=1)
    ref = hf_logits(hf, full[:, :-1])[:, n - 1 :]  # (3, NEW_TOKENS, V)
    for b in range(len(PROMPTS)):
        text = tok.decode(generated[b])
        assert np.array_equal(ref[b].argmax(-1), generated[b]), f"{name} diverged on: {text!r}"
        for t in range(NEW_TOKENS):
            r, o = ref[b, t], ours_logits[b, t]
            tol = LOGIT_RTOL * np.abs(r).max()
            top = np.argsort(-r)[:5]
            assert np.abs(o[top] - r[top]).max() <= tol, (name, b, t)
            # same top-5 set, up to ties within the tolerance at the 5th place
            extra = set(np.argsort(-o)[:5].tolist()) - set(top.tolist())
            assert all(r[i] >= r[top[-1]] - tol for i in extra), (name, b, t)


def test_perplexity(models, capsys):
    name, ours, hf, tok = models
    ids = tok(TEXT.read_text()).input_ids
    bos = tok.bos_token_id if ids[0] == tok.bos_token_id else None
    body = ids[1:] if bos is not None else ids
    step = PPL_CONTEXT - (1 if bos is not None else 0)
    tokens = body[: step * PPL_WINDOWS]

    def hf_as_mlx(batch: mx.array, cache=None) -> mx.array:
        assert cache is None  # no KV quantization here: one plain pass per window
        return mx.array(hf_logits(hf, np.array(batch)))

    # the same windowing and NLL code on both sides; only the model differs
    mine = perplexity(ours, tokens, PPL_CONTEXT, batch_size=PPL_WINDOWS, bos_token_id=bos)
    ref = perplexity(hf_as_mlx, tokens, PPL_CONTEXT, batch_size=PPL_WINDOWS, bos_token_id=bos)
    with capsys.disabled():
        print(
            f"\n[{name}] perplexity on {mine.n_tokens} tokens of {TEXT.name}: "
            f"hf2q_mlx {mine.ppl:.4f}, transformers {ref.ppl:.4f}"
        )
    assert mine.n_tokens == ref.n_tokens
    # logits agree to ~1e-5 relative (see LOGIT_RTOL), so the mean NLL agrees far inside 1e-3
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
