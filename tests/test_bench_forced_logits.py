"""bench/forced_logits.py: both paths read the same tokens and agree on the CPU (tiny Gemma 3),
and ``compare`` finds the first argmax flip with both runs' margins and the largest logit
difference on the other run's top ids."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import forced_logits as fl  # noqa: E402
import test_fused_projections as tfp  # noqa: E402


def test_compare_finds_the_first_flip_its_margins_and_the_largest_difference():
    mine = [
        dict(ids=[5, 7, 1], logits=[3.0, 2.0, 1.0]),
        dict(ids=[4, 9, 2], logits=[2.5, 2.25, 0.0]),
    ]
    other = [
        dict(ids=[5, 7, 3], logits=[3.5, 2.0, 0.5]),
        dict(ids=[9, 4, 8], logits=[2.4, 2.3, 1.0]),
    ]
    c = fl.compare(mine, other)
    # 0.5 on id 5 at position 0; ids missing from this run's top (3, 8) are not compared
    assert c["max_abs_diff"] == pytest.approx(0.5)
    assert c["first_argmax_difference"] == dict(position=1, ids=(4, 9), margin=0.25,
                                                other_margin=pytest.approx(0.1))  # fmt: skip
    assert fl.compare(mine, mine) == dict(max_abs_diff=0.0, first_argmax_difference=None)


def test_kernel_and_reference_paths_read_the_same_tokens_on_the_cpu():
    """The CPU's decode step and reference ops give the same top ids and logits within 1e-4
    (fp32 math, different evaluation orders) at every forced position, equal to one forward
    over the prompt and the forced tokens (the paths read the given tokens, random ones the
    model would not pick, not their own argmax)."""
    model = tfp.tiny_model("gemma3")
    rng = np.random.default_rng(5)
    ids = rng.integers(0, 64, 7).tolist()
    tokens = rng.integers(0, 64, 6).tolist()
    with mx.stream(mx.cpu):
        a = fl.kernel_path(model, ids, tokens, 4)
        b = fl.reference_path(model, ids, tokens, 4)
    assert len(a) == len(b) == len(tokens)
    for p, q in zip(a, b):
        assert p["ids"][:1] == q["ids"][:1]
        np.testing.assert_allclose(p["logits"], q["logits"], rtol=0, atol=1e-4)
    # one forward over prompt + forced tokens gives every position's logits at once
    with mx.stream(mx.cpu):
        full = model(mx.array([ids + tokens[:-1]]), cache=fl.make_prompt_cache(model))
    full = np.array(full[0, len(ids) - 1 :].astype(mx.float32))  # (len(tokens), V)
    for i, p in enumerate(a):
        np.testing.assert_allclose(p["logits"], full[i, p["ids"]], rtol=0, atol=1e-4)
