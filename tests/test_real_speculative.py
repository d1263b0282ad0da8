"""Speculative decoding on the real Qwen2.5-Coder Instruct Q4_K_M GGUFs: greedy output with
drafts identical to greedy output without. The 0.5B drafts for itself (every draft accepted);
the 0.5B drafts for the 1.5B when both are fetched
(``hf2q-mlx fetch qwen2.5-coder-0.5b`` / ``qwen2.5-coder-1.5b``). Short runs: CPU forwards on
these GGUFs are slow."""

from __future__ import annotations

from functools import lru_cache

import pytest

from hf2q_mlx.generation import stream_generate
from hf2q_mlx.io.default_model import cache_dir
from hf2q_mlx.io.fetch import SPLIT_MODELS, cached_path
from hf2q_mlx.io.loader import load

pytestmark = pytest.mark.real_model

PROMPT = "def fibonacci(n: int) -> int:\n    "
NEW_TOKENS = 8


@lru_cache(maxsize=None)
def model(name: str):
    path = cached_path(SPLIT_MODELS[name], cache_dir())
    if path is None:
        pytest.skip(f"{name} is not in the model cache: hf2q-mlx fetch {name}")
    return load(path)


def greedy(m, tok, **kw):
    rs = list(stream_generate(m, tok, PROMPT, max_tokens=NEW_TOKENS, **kw))
    return [r.token for r in rs], rs[-1]


def test_small_model_drafting_for_itself():
    m, tok = model("qwen2.5-coder-0.5b")
    want, _ = greedy(m, tok)
    got, last = greedy(m, tok, draft_model=m, num_draft_tokens=4)
    assert got == want
    assert last.drafted_tokens > 0 and last.accepted_tokens == last.drafted_tokens


def test_half_b_drafting_for_one_and_a_half_b():
    target, tok = model("qwen2.5-coder-1.5b")
    draft, _ = model("qwen2.5-coder-0.5b")
    want, _ = greedy(target, tok)
    got, last = greedy(target, tok, draft_model=draft, num_draft_tokens=4)
    assert got == want
    assert last.drafted_tokens > 0
