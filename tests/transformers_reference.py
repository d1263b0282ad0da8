"""transformers loading the same GGUF as the reference for real-model tests: the model, its
logits, and the greedy-continuation check shared by every real-model test file.

transformers dequantizes every tensor to fp32 and undoes llama.cpp's conventions itself, so it is
an independent reference for our loader (raw GGML blocks, our own un-permutation) and models.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch

# both sides run fp32 (transformers on the dequantized weights, we dequantize per matmul); they
# sum in different orders, so logits agree to ~1e-5 of the largest one: 1e-3 leaves headroom
LOGIT_RTOL = 1e-3


@contextlib.contextmanager
def _one_reader_per_file():
    """transformers builds a ``gguf.GGUFReader`` for the model's config, its weights and the
    tokenizer's config, each parsing every field (Gemma's 262,144 token strings: ~15 s on a
    2-core CI machine); inside this block one reader (read-only memory maps) serves a path."""
    import gguf

    real, readers = gguf.GGUFReader, {}

    def reader(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = real(path, mode)
        return readers[key]

    gguf.GGUFReader = reader  # transformers imports it inside load_gguf_checkpoint
    try:
        yield
    finally:
        gguf.GGUFReader = real


def load_transformers_gguf(path: Path):
    """(transformers model, its tokenizer) read from the GGUF at ``path``, fp32, eager."""
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    kw = dict(gguf_file=path.name)
    with _one_reader_per_file():
        hf = AutoModelForCausalLM.from_pretrained(
            str(path.parent), dtype=torch.float32, attn_implementation="eager", **kw
        )
        return hf.eval(), AutoTokenizer.from_pretrained(str(path.parent), **kw)


def hf_logits(hf, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.from_numpy(ids).long(), use_cache=False).logits.float().numpy()


def hf_as_mlx(hf):
    """The transformers model called like ours (no cache): for ``perplexity``'s windowing."""

    def call(batch: mx.array, cache=None) -> mx.array:
        assert cache is None  # no KV quantization here: one plain pass per window
        return mx.array(hf_logits(hf, np.array(batch)))

    return call


def assert_greedy_matches(name: str, ours, hf, hf_tok, prompts: list[str], new_tokens: int):
    """Our cached greedy decode of ``prompts`` (cut to one length, one batch) gives the tokens
    transformers' greedy decode gives, and each step's top-5 logits within LOGIT_RTOL of the
    largest logit, with the same top-5 set up to ties within that tolerance."""
    ids = [hf_tok(p).input_ids for p in prompts]
    n = min(len(i) for i in ids)
    prompt = np.array([i[:n] for i in ids], dtype=np.int32)

    cache = ours.make_cache()
    logits = ours(mx.array(prompt), cache)[:, -1]
    ours_steps, tokens = [], []
    for step in range(new_tokens):
        ours_steps.append(np.array(logits))
        nxt = mx.argmax(logits, axis=-1)  # (B,)
        tokens.append(np.array(nxt))
        if step + 1 < new_tokens:
            logits = ours(nxt[:, None].astype(mx.int32), cache)[:, -1]
    ours_logits = np.stack(ours_steps, axis=1)  # (B, new_tokens, V)
    generated = np.stack(tokens, axis=1)  # (B, new_tokens)

    # transformers scores the same sequences in one pass; greedy decoding on its side produces
    # exactly these tokens iff its argmax at every step is our token
    full = np.concatenate([prompt, generated], axis=1)
    ref = hf_logits(hf, full[:, :-1])[:, n - 1 :]  # (B, new_tokens, V)
    for b in range(len(prompts)):
        text = hf_tok.decode(generated[b])
        assert np.array_equal(ref[b].argmax(-1), generated[b]), f"{name} diverged on: {text!r}"
        for t in range(new_tokens):
            r, o = ref[b, t], ours_logits[b, t]
            tol = LOGIT_RTOL * np.abs(r).max()
            top = np.argsort(-r)[:5]
            assert np.abs(o[top] - r[top]).max() <= tol, (name, b, t)
            extra = set(np.argsort(-o)[:5].tolist()) - set(top.tolist())
            assert all(r[i] >= r[top[-1]] - tol for i in extra), (name, b, t)
