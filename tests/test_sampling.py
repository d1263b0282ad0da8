"""Samplers and logits processors: allowed sets, frequencies, seeding, penalty math, validation."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from hf2q_mlx.custom_kernels import reference_forced, reference_only
from hf2q_mlx.custom_kernels import sampling as sampling_kernels
from hf2q_mlx.errors import SamplingOptionsError
from hf2q_mlx.generation import stream_generate
from hf2q_mlx.sampling import (
    apply_repetition_penalty,
    apply_top_k,
    make_logits_processors,
    make_sampler,
    validate_sampling_options,
)

sys.path.insert(0, str(Path(__file__).resolve().parent / "kernels"))
import kernel_emulator  # noqa: E402

V = 24
DRAWS = 20_000


def _logits(seed: int, rows: int = 1) -> mx.array:
    return mx.random.normal((rows, V), key=mx.random.key(seed)) * 1.5


def _draw(sampler, logits: mx.array, seed: int = 0) -> np.ndarray:
    """DRAWS samples from one row of logits: the row tiled, one categorical draw per row."""
    tiled = mx.broadcast_to(logits, (DRAWS, V))
    return np.array(sampler(tiled, mx.random.key(seed)))


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def _check_frequencies(tokens: np.ndarray, probs: np.ndarray) -> None:
    freq = np.bincount(tokens, minlength=V) / DRAWS
    # binomial standard error is at most sqrt(0.25 / DRAWS) = 0.0035; 5 sigma avoids flakes
    np.testing.assert_allclose(freq, probs, atol=0.018)


def test_greedy_is_argmax():
    logits = _logits(1, rows=7)
    tokens = make_sampler(0.0)(logits, None)
    assert np.array_equal(np.array(tokens), np.argmax(np.array(logits), axis=-1))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_frequencies(temperature):
    logits = _logits(2)
    tokens = _draw(make_sampler(temperature), logits, seed=3)
    _check_frequencies(tokens, _softmax(np.array(logits)[0] / temperature))


@pytest.mark.parametrize("k", [1, 3, 7])
def test_top_k_keeps_exactly_k(k):
    logits = _logits(4)
    tokens = _draw(make_sampler(1.0, top_k=k), logits, seed=5)
    row = np.array(logits)[0]
    allowed = np.argsort(-row)[:k]
    probs = np.zeros(V)
    probs[allowed] = _softmax(row[allowed])
    _check_frequencies(tokens, probs)
    assert set(np.unique(tokens)) <= set(allowed.tolist())


@pytest.mark.parametrize("p", [0.3, 0.75, 0.95])
def test_top_p_smallest_set_reaching_mass(p):
    temperature = 0.8
    logits = _logits(6)
    tokens = _draw(make_sampler(temperature, top_p=p), logits, seed=7)
    probs = _softmax(np.array(logits)[0] / temperature)
    order = np.argsort(-probs)
    # smallest prefix of the sorted distribution whose mass reaches p
    n_keep = int(np.searchsorted(np.cumsum(probs[order]), p) + 1)
    allowed = order[:n_keep]
    expected = np.zeros(V)
    expected[allowed] = probs[allowed] / probs[allowed].sum()
    assert set(np.unique(tokens)) <= set(allowed.tolist())
    _check_frequencies(tokens, expected)


@pytest.mark.parametrize("min_p", [0.05, 0.2, 0.6])
def test_min_p_threshold(min_p):
    logits = _logits(8)
    tokens = _draw(make_sampler(1.0, min_p=min_p), logits, seed=9)
    probs = _softmax(np.array(logits)[0])
    allowed = np.flatnonzero(probs >= min_p * probs.max())
    expected = np.zeros(V)
    expected[allowed] = probs[allowed] / probs[allowed].sum()
    assert set(np.unique(tokens)) <= set(allowed.tolist())
    _check_frequencies(tokens, expected)


def test_filters_combine_and_rows_are_independent():
    logits = _logits(10, rows=3)
    tokens = np.array(make_sampler(1.3, top_k=6, top_p=0.9, min_p=0.1)(logits, mx.random.key(1)))
    assert tokens.shape == (3,)
    big = mx.repeat(logits, DRAWS // 3, axis=0)  # (DRAWS', V): each row repeated
    drawn = np.array(make_sampler(1.3, top_k=6, top_p=0.9, min_p=0.1)(big, mx.random.key(2)))
    for r in range(3):
        row = np.array(logits)[r] / 1.3
        keep = np.argsort(-row)[:6]
        probs = _softmax(row[keep])
        order = np.argsort(-probs)
        keep = keep[order[: int(np.searchsorted(np.cumsum(probs[order]), 0.9) + 1)]]
        probs = _softmax(row[keep])
        keep = keep[probs >= 0.1 * probs.max()]
        got = drawn[r * (DRAWS // 3) : (r + 1) * (DRAWS // 3)]
        assert set(np.unique(got)) <= set(keep.tolist())


def test_seeded_draws_repeat_and_differ_by_key():
    logits = _logits(11, rows=64)
    sampler = make_sampler(1.0, top_p=0.9)
    a = np.array(sampler(logits, mx.random.key(123)))
    b = np.array(sampler(logits, mx.random.key(123)))
    c = np.array(sampler(logits, mx.random.key(124)))
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


def test_repetition_penalty_math():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, V)).astype(np.float32)
    history = np.array([[3, 5, 5, 9, 0], [1, 2, 3, 4, 23]], dtype=np.int32)
    penalty = 1.7
    got = np.array(apply_repetition_penalty(mx.array(history), mx.array(logits), penalty))
    want = logits.copy()
    for b in range(2):
        for t in set(history[b].tolist()):
            x = logits[b, t]
            want[b, t] = x / penalty if x > 0 else x * penalty
    # one multiply or divide per entry: fp32 rounding only
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_repetition_processor_uses_recent_context_only():
    rng = np.random.default_rng(1)
    logits = mx.array(rng.normal(size=(1, V)).astype(np.float32))
    history = mx.array([[7, 8, 9, 10]], dtype=mx.int32)
    (proc,) = make_logits_processors(repetition_penalty=2.0, context_size=2)
    got = np.array(proc(history, logits))
    want = np.array(apply_repetition_penalty(history[:, -2:], logits, 2.0))
    assert np.array_equal(got, want)
    assert got[0, 7] == np.array(logits)[0, 7] and got[0, 10] != np.array(logits)[0, 10]
    assert make_logits_processors(repetition_penalty=1.0) == []


@pytest.mark.parametrize(
    "opts",
    [
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"top_k": -1},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"min_p": 1.0},
        {"min_p": -0.2},
        {"repetition_penalty": 0.0},
        {"context_size": 0},
        {"max_tokens": -1},
    ],
)
def test_invalid_options_raise(opts):
    with pytest.raises(SamplingOptionsError):
        validate_sampling_options(**opts)


def test_make_sampler_validates():
    with pytest.raises(SamplingOptionsError, match="top_p"):
        make_sampler(1.0, top_p=0.0)
    with pytest.raises(SamplingOptionsError, match="repetition_penalty"):
        make_logits_processors(repetition_penalty=-1.0)


# ---- the top-k filter through the GPU top-k kernel, on the CPU emulator ------------------------


@pytest.fixture
def topk_kernel_on_cpu(monkeypatch):
    """custom_kernels.sampling's backend() says 'cuda' (outside reference_only()) and its kernel
    runs on the emulator (the CUDA rendering compiled with g++); other dispatchers: reference."""
    if not kernel_emulator.available():
        pytest.skip("g++ is not installed")
    emu = kernel_emulator.Emulated(sampling_kernels._kernel)
    monkeypatch.setattr(sampling_kernels, "_kernel", emu)
    monkeypatch.setattr(sampling_kernels, "backend", lambda: None if reference_forced() else "cuda")
    with mx.stream(mx.cpu):
        yield emu


def _untied_logits(shape, seed: int) -> mx.array:
    """Distinct values in every row (a permutation of a grid), so the top k is one set."""
    rng = np.random.default_rng(seed)
    rows = [rng.permutation(shape[-1]) * 0.01 - 7.0 for _ in range(shape[0])]
    return mx.array(np.stack(rows).astype(np.float32))


@pytest.mark.parametrize("V,k", [(24, 1), (24, 5), (3000, 7), (3000, 64)])
def test_top_k_takes_the_kernel_and_matches_the_reference(V, k, topk_kernel_on_cpu):
    logits = _untied_logits((3, V), seed=V + k)
    with reference_only():
        want = apply_top_k(logits, k)
        want_tokens = make_sampler(0.7, top_k=k)(logits, mx.random.key(4))
    assert topk_kernel_on_cpu.launches == 0
    got = apply_top_k(logits, k)
    assert topk_kernel_on_cpu.launches >= 1, "apply_top_k did not take the top-k kernel"
    assert mx.array_equal(got, want)  # the same k survivors, values copied exactly
    assert mx.array_equal(make_sampler(0.7, top_k=k)(logits, mx.random.key(4)), want_tokens)


def test_top_k_kernel_keeps_the_lower_ids_of_equal_logits(topk_kernel_on_cpu):
    logits = mx.array([[0.0, 2.0, 1.0, 2.0, 1.0, 1.0, -1.0, 1.0]])
    kept = np.isfinite(np.array(apply_top_k(logits, 3)))[0]
    assert topk_kernel_on_cpu.launches == 1
    assert kept.tolist() == [False, True, True, True, False, False, False, False]
    with reference_only():  # the reference keeps exactly k too (which tied ones: argpartition's)
        assert np.isfinite(np.array(apply_top_k(logits, 3))).sum() == 3


def test_generation_with_top_k_through_the_kernel(topk_kernel_on_cpu):
    """Seeded top-k sampling in the decode loop: the same tokens and logprobs with the kernel
    (emulated) as with the reference."""
    from test_generate import TOK, TinyModel

    model = TinyModel(seed=3)
    opts = dict(max_tokens=6, temperature=1.2, top_k=5, seed=11, ignore_eos=True)
    with reference_only():
        want = [(r.token, r.logprob) for r in stream_generate(model, TOK, [0, 9, 8], **opts)]
    got = [(r.token, r.logprob) for r in stream_generate(model, TOK, [0, 9, 8], **opts)]
    assert topk_kernel_on_cpu.launches == 6
    assert got == want
