"""Pipelined greedy rounds (hf2q_mlx/pipelined_rounds.py): output identical to plain greedy
decoding on every family, the device n-gram drafter against the host's, lazy rollback against
the host rollback (bit-identical caches), and round r + 1 launched before round r is read."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import IdsTokenizer

from hf2q_mlx import pipelined_rounds as pr
from hf2q_mlx import speculative as spec
from hf2q_mlx.decode_step import DecodeStep
from hf2q_mlx.draft_length import DraftLength
from hf2q_mlx.generation import stream_generate

pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_speculative import FAMILIES, target  # noqa: E402  (tiny models of every family)

# a repeated 5-gram: prompt lookup finds matches from the start; the models' outputs vary
PROMPTS = {
    "gemma3": [62, 87, 48, 58, 93] * 2,
    "gemma4-dense": [73, 36, 44, 95, 77] * 2,
    "gemma4-moe": [81, 61, 49, 25, 29] * 2,
}
PROMPT = [38, 2, 0, 11, 0] * 2
N_TOKENS = 40  # Gemma 3's window is 5 and Gemma 4's 4: a run crosses them many times
K = 3


@pytest.fixture(autouse=True)
def compiled_decode(monkeypatch):
    """The compiled step (the pipelined path's) on the CPU too (eager there by default)."""
    monkeypatch.setenv("HF2Q_DECODE", "compiled")


@pytest.fixture
def rounds_run(monkeypatch) -> list[int]:
    """Counts the pipelined loops that ran (one entry per stream_generate that took it)."""
    runs: list[int] = []
    loop = pr.pipelined_rounds

    def counted(*args, **kwargs):
        runs.append(1)
        return loop(*args, **kwargs)

    monkeypatch.setattr(pr, "pipelined_rounds", counted)
    return runs


def generate(model, prompt, max_tokens=N_TOKENS, **kwargs):
    rs = list(
        stream_generate(
            model, IdsTokenizer(96), prompt, max_tokens=max_tokens, ignore_eos=True, **kwargs
        )
    )
    return [r.token for r in rs], [r.logprob for r in rs], rs[-1]


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_identical_to_plain_on_every_family(name, rounds_run):
    m, prompt = target(name), PROMPTS.get(name, PROMPT)
    m.__dict__.pop("_hf2q_decode_steps", None)  # earlier tests' steps (other reserves) shared
    want, want_lp, _ = generate(m, prompt)
    got, got_lp, last = generate(m, prompt, prompt_lookup=2, num_draft_tokens=K,
                                 adaptive_drafts=False)  # fmt: skip
    assert rounds_run == [1]
    assert got == want
    # fp32 log-probabilities of a (K + 1)-token verify against one-token steps: rounding only
    np.testing.assert_allclose(got_lp, want_lp, atol=1e-3)
    assert last.drafted_tokens % K == 0 and last.drafted_tokens > 0  # K drafts every round
    # the step leaves lazy positions; its row holds what the caches hold (at least the output)
    (step,) = [s for s in m.__dict__["_hf2q_decode_steps"].values() if s.reserve == K]
    assert step.lazy_positions is None and not step.busy
    assert len(prompt) + N_TOKENS - 1 <= step.positions[0] <= len(prompt) + N_TOKENS + 2 * K


def test_rounds_accept_and_reject_across_the_families(rounds_run):
    """The family runs above prove little unless drafts were both accepted and rejected."""
    totals = np.zeros(2)
    for name in ("llama", "qwen3_5-dense", "gemma4-moe"):
        _, _, last = generate(target(name), PROMPTS.get(name, PROMPT), prompt_lookup=2,
                              num_draft_tokens=K, adaptive_drafts=False)  # fmt: skip
        totals += [last.accepted_tokens, last.drafted_tokens - last.accepted_tokens]
    assert (totals > 5).all(), totals


@pytest.mark.parametrize("name", ["gemma3", "qwen3_5-moe"])
@pytest.mark.parametrize("max_tokens", [2, 3, 6, 13])
def test_budget_cuts_a_round(name, max_tokens, rounds_run):
    """The budget ends inside a round (Gemma 3's output here accepts whole rounds of K + 1
    tokens): exactly max_tokens tokens, plain decoding's."""
    m, prompt = target(name), PROMPTS.get(name, PROMPT)
    want = generate(m, prompt)[0]
    got, _, _ = generate(m, prompt, max_tokens, prompt_lookup=2, num_draft_tokens=K,
                         adaptive_drafts=False)  # fmt: skip
    assert got == want[:max_tokens]
    assert rounds_run == [1]


@pytest.mark.parametrize("name", ["llama", "qwen3_5-dense"])
def test_adaptive_pipelined_rounds_stay_exact(name, monkeypatch, rounds_run):
    """The controller in the loop (a fake clock: every round 1 ms): it measures K drafts, then
    a plain step (k = 0, a one-token round in the pipeline), then explores k = K - 1 now and
    then; the output is still plain decoding's."""
    m, prompt = target(name), PROMPT
    want = generate(m, prompt)[0]
    m.__dict__.pop("_hf2q_decode_steps", None)  # no round costs learned by earlier tests
    ticks = iter(range(10**6))
    monkeypatch.setattr(DraftLength, "clock", staticmethod(lambda: next(ticks) * 1e-3))
    chosen: list[int] = []
    choose = DraftLength.choose
    monkeypatch.setattr(
        DraftLength, "choose", lambda self: chosen.append(choose(self)) or chosen[-1]
    )
    got, _, last = generate(m, prompt, prompt_lookup=2, num_draft_tokens=K, adaptive_drafts=True)
    assert got == want and rounds_run == [1]
    assert {0, K - 1, K} <= set(chosen) and last.drafted_tokens > 0


def test_a_caller_that_stops_early_leaves_the_step_settled(rounds_run):
    """stream_generate's caller stops mid-run (as on EOS or a stop string): the shared step
    leaves lazy positions and is free, and the next request decodes as before."""
    m = target("qwen3_5-dense")
    want = generate(m, PROMPT)[0]
    gen = stream_generate(m, IdsTokenizer(96), PROMPT, max_tokens=N_TOKENS, ignore_eos=True,
                          prompt_lookup=2, num_draft_tokens=K, adaptive_drafts=False)  # fmt: skip
    got = [next(gen).token for _ in range(7)]
    gen.close()
    assert got == want[:7]
    steps = list(m.__dict__["_hf2q_decode_steps"].values())
    assert all(s.lazy_positions is None and not s.busy for s in steps)
    again = generate(m, PROMPT, prompt_lookup=2, num_draft_tokens=K, adaptive_drafts=False)[0]
    assert again == want and rounds_run == [1, 1]


def test_processors_and_sampling_keep_the_unpipelined_rounds(rounds_run):
    m = target("llama")
    generate(m, PROMPT, prompt_lookup=2, num_draft_tokens=K, repetition_penalty=1.5)
    generate(m, PROMPT, prompt_lookup=2, num_draft_tokens=K, temperature=0.7, seed=1)
    assert rounds_run == []


# ---- the device drafters -------------------------------------------------------------------------


def test_device_lookup_chooses_what_prompt_lookup_chooses():
    """Random sequences over a few tokens (many repeats), every n-gram size and K: the device's
    drafts start with the host's; where the host has fewer than K they repeat periodically, and
    without a match they are the last token."""
    rng = np.random.default_rng(0)
    for _ in range(150):
        N = int(rng.integers(1, 40))
        seq = rng.integers(0, int(rng.integers(2, 6)), N).tolist()
        ngram, k = int(rng.integers(1, 5)), int(rng.integers(1, 6))
        # garbage past the sequence, as a buffer holds rejected candidates there
        buf = mx.array(seq + rng.integers(0, 9, 48).tolist(), dtype=mx.int32)
        got = pr.lookup_drafts(buf, mx.array(N, dtype=mx.int32), ngram, k).tolist()
        host = spec.PromptLookup(ngram).propose(seq, k)
        if not host:
            assert got == [seq[-1]] * k, (seq, ngram, k)
        else:
            assert got == [host[j % len(host)] for j in range(k)], (seq, ngram, k, host)
    compiled = pr.DeviceLookup(3, 4)
    toks = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    buf = mx.array(toks + [0] * 10, dtype=mx.int32)
    assert compiled(buf, mx.array(len(toks), dtype=mx.int32), 0).tolist() == [7, 8, 1, 2]


def test_replay_drafter_replays_the_reference_with_wrong_tokens():
    ref, P, V = list(range(10, 40)), 5, 96
    buf, n = mx.zeros((64,), dtype=mx.int32), mx.array(P + 3, dtype=mx.int32)
    assert pr.ReplayDrafter(ref, P, 4, 1.0, V)(buf, n, 0).tolist() == ref[3:7]
    wrong = pr.ReplayDrafter(ref, P, 4, 0.0, V)(buf, n, 2).tolist()
    assert all(w != t for w, t in zip(wrong, ref[3:7]))
    half = pr.ReplayDrafter(ref, P, 4, 0.5, V, seed=3)
    hits = [np.equal(half(buf, n, r).tolist(), ref[3:7]).mean() for r in range(30)]
    assert 0.3 < np.mean(hits) < 0.7  # 120 draws at p = 0.5: about 4.4 standard deviations


# ---- lazy rollback, pipelining ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gemma3", "qwen3_5-dense"])
def test_lazy_rollback_equals_host_rollback(name):
    """Two steps fed the same prompt and verifies: one rolls back with host counts, the other
    with device counts (lazy positions); the caches and the following verify's logits are
    bit-identical (same ops on the same data), and the positions agree."""
    m = target(name)
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 96, 9).tolist()
    host, lazy = (DecodeStep(m, 1, 64, reserve=K) for _ in range(2))
    for s in (host, lazy):
        s.prefill(0, prompt)
    lazy.begin_lazy()
    for rejected in (2, 0, 3, 1):  # a ring of window 5 wraps during these
        tokens = mx.array(rng.integers(0, 96, (1, K + 1)), dtype=mx.int32)
        out_h, out_l = host.verify(tokens), lazy.verify(tokens)
        assert mx.array_equal(out_h, out_l)
        host.rollback(0, rejected)
        lazy.rollback_lazy(mx.array([rejected], dtype=mx.int32))
        mx.eval([s.arrays for s in host.caches], [s.arrays for s in lazy.caches])
        for a, b in zip(host.caches, lazy.caches):
            assert all(mx.array_equal(x, y) for x, y in zip(a.arrays, b.arrays))
        lazy.rollback_known([rejected])
        assert lazy.positions == host.positions  # the bounds are exact once counts are known
    lazy.end_lazy()
    assert lazy.positions == host.positions and lazy.lazy_positions is None


def test_round_r_plus_1_is_launched_before_round_r_is_read(monkeypatch):
    """Every round's read (the host's rollback_known after it) comes after the next round's
    verify was launched; an unpipelined loop (read, then build) fails this."""
    m = target("llama")
    step = DecodeStep(m, 1, 128, reserve=K)
    prompt = PROMPT
    logits = step.prefill(0, prompt)
    first = int(mx.argmax(logits).item())
    events: list[str] = []
    verify, known = DecodeStep.verify, DecodeStep.rollback_known

    def logged_verify(self, *args, **kwargs):
        events.append("launch")
        return verify(self, *args, **kwargs)

    def logged_known(self, counts):
        events.append("read")
        return known(self, counts)

    monkeypatch.setattr(DecodeStep, "verify", logged_verify)
    monkeypatch.setattr(DecodeStep, "rollback_known", logged_known)
    budget = 20
    rounds = list(pr.pipelined_rounds(step, prompt + [first], budget, pr.DeviceLookup(2, K),
                                      DraftLength(K, adaptive=False)))  # fmt: skip
    assert sum(len(r.tokens) for r in rounds) == budget
    reads = [i for i, e in enumerate(events) if e == "read"]
    assert len(reads) == len(rounds) >= 4
    for r, at in enumerate(reads[:-1]):
        # round r + 1 launched before round r's read
        assert events[:at].count("launch") >= r + 2, events
    # and the tokens are plain decoding's
    want = generate(m, prompt, budget + 1)[0]
    assert [first] + [t for r in rounds for t in r.tokens] == want


def test_a_row_of_a_wider_step_runs_pipelined_rounds_alone():
    """Row 1 of a two-row step: its tokens are plain decoding's, row 0 keeps its position."""
    m = target("qwen3_5-dense")
    step = DecodeStep(m, 2, 128, reserve=K)
    step.prefill(0, [7, 8, 9])
    first = int(mx.argmax(step.prefill(1, PROMPT)).item())
    rounds = pr.pipelined_rounds(step, PROMPT + [first], 12, pr.DeviceLookup(2, K),
                                 DraftLength(K, adaptive=False), row=1)  # fmt: skip
    got = [first] + [t for r in rounds for t in r.tokens]
    assert got == generate(m, PROMPT, 13)[0]
    assert step.positions[0] == 3 and step.positions[1] >= len(PROMPT) + 12


@pytest.mark.parametrize("name", ["gemma3", "llama"])
def test_a_step_sized_as_speculative_tokens_sizes_it_suffices(name):
    """The host's positions are upper bounds while a round is unread: a step of exactly
    prompt + budget + 2 K tokens (what speculative_tokens asks for) is enough when every
    draft is accepted (the replayed reference, acceptance 1), with budgets that end anywhere
    in a round."""
    m = target(name)
    want = generate(m, PROMPT, 30)[0]
    for budget in (9, 10, 11, 12):  # max_tokens = budget + 1 (the prefill's token first)
        step = DecodeStep(m, 1, len(PROMPT) + budget + 1 + 2 * K, reserve=K)
        first = int(mx.argmax(step.prefill(0, PROMPT)).item())
        drafter = pr.ReplayDrafter(want, len(PROMPT), K, 1.0, 96)
        rounds = list(pr.pipelined_rounds(step, PROMPT + [first], budget, drafter,
                                          DraftLength(K, adaptive=False)))  # fmt: skip
        assert [first] + [t for r in rounds for t in r.tokens] == want[: budget + 1]
        assert all(r.accepted == K for r in rounds[:-1])
