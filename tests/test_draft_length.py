"""The cost-aware draft length (hf2q_mlx/draft_length.py): its choice on synthetic costs and
acceptances, re-exploration, and greedy identity through stream_generate while fake verify
costs make it change k (never wall time)."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from hf2q_mlx import speculative as spec
from hf2q_mlx.decode_step import DecodeStep
from hf2q_mlx.draft_length import DraftLength, RoundCosts, expected_tokens
from hf2q_mlx.errors import SamplingOptionsError
from hf2q_mlx.generation import stream_generate

K = 4


@pytest.fixture(autouse=True)
def compiled_decode(monkeypatch):
    """These tests drive the compiled step's speculative path, which a GPU takes by default and
    the CPU with HF2Q_DECODE=compiled (eager there by default: generation.decode_mode)."""
    monkeypatch.setenv("HF2Q_DECODE", "compiled")


def simulate(control: DraftLength, p: float, cost, rounds: int, seed: int = 0) -> list[int]:
    """Rounds of drafts each accepted with probability p; ``cost(L, round)`` seconds per round.
    -> the k chosen each round."""
    rng = np.random.default_rng(seed)
    ks = []
    for r in range(rounds):
        k = control.choose()
        ok = rng.random(k) < p
        accepted = int(np.argmin(ok)) if not ok.all() else k
        control.observe(k, accepted, cost(k + 1, r))
        ks.append(k)
    return ks


def steady(ks: list[int]) -> int:
    """The most frequent k of the last half (explorations aside)."""
    tail = ks[len(ks) // 2 :]
    return max(set(tail), key=tail.count)


def test_expected_tokens_is_the_geometric_sum():
    for p in (0.0, 0.3, 0.9):
        for k in range(6):
            assert expected_tokens(p, k) == pytest.approx(sum(p**i for i in range(k + 1)))
    assert expected_tokens(1.0, 3) == 4


@pytest.mark.parametrize(
    "p, cost, want",
    [
        (0.5, lambda L, r: float(L), 0),  # a verify costs L plain steps: drafting never pays
        (0.9, lambda L, r: 1.0 + 0.02 * (L - 1), K),  # nearly free verifies: draft all K
        (0.9, lambda L, r: float(L), 0),  # L steps: even at 0.9, E(k) < k + 1
        (0.1, lambda L, r: 1.0 + 0.2 * (L - 1), 0),  # 1.1 tokens for 1.2 steps: not worth it
        (0.1, lambda L, r: 1.0 + 0.02 * (L - 1), 1),  # 1.1 tokens for 1.02 steps: one draft
        # every verify costs 1.9 plain steps (the H200 9B's shape): K drafts at 0.5 give 1.94
        # tokens, 2 % over plain, fewer drafts less: plain
        (0.5, lambda L, r: 1.0 if L == 1 else 1.9, 0),
        (0.8, lambda L, r: 1.0 if L == 1 else 1.9, K),  # 3.36 tokens for 1.9 steps: all K
    ],
)
def test_choice_on_synthetic_costs(p, cost, want):
    control = DraftLength(K)
    ks = simulate(control, p, cost, 200)
    assert ks[:2] == [K, K]  # optimistic start: full rounds first (the first sample dropped)
    assert 0 in ks[2:4]  # then the plain step is measured
    assert steady(ks) == want
    assert control.p == pytest.approx(p, abs=0.2)


def test_interior_optimum_is_found_by_exploration():
    # p ~ 1 and t(L) = 1 + 0.1 (L - 1)^2: (k + 1) / t(k + 1) peaks at k = 2 (3 / 1.4), while
    # the line between t(1) and t(5) alone would favour k = 4
    control = DraftLength(K)
    ks = simulate(control, 1.0, lambda L, r: 1.0 + 0.1 * (L - 1) ** 2, 300)
    assert steady(ks) == 2


def test_reexplores_when_costs_change():
    # verifies expensive for 100 rounds (k = 0 chosen), then nearly free: exploring the
    # runner-up every 16 rounds climbs back to K
    control = DraftLength(K)
    ks = simulate(control, 0.9, lambda L, r: float(L) if r < 100 else 1.0 + 0.02 * (L - 1), 400)
    assert steady(ks[:100]) == 0
    assert any(k > 0 for k in ks[50:100])  # explorations while k = 0 wins
    assert steady(ks[300:]) == K
    # and the other way: K while cheap, then 0 once the moving averages see the load
    control = DraftLength(K)
    ks = simulate(control, 0.9, lambda L, r: 1.0 + 0.02 * (L - 1) if r < 100 else float(L), 300)
    assert steady(ks[:100]) == K and steady(ks[200:]) == 0


def test_acceptance_follows_the_text():
    control = DraftLength(K)
    simulate(control, 0.95, lambda L, r: 1.0 + 0.02 * (L - 1), 100)
    assert control.p > 0.85
    simulate(control, 0.2, lambda L, r: 1.0 + 0.02 * (L - 1), 100, seed=1)
    assert control.p < 0.4


def test_seeded_controller_skips_the_start_up_and_shares_its_costs():
    """A controller given the RoundCosts of an earlier one (same step and drafter) picks the
    best k from its first round, with no K-then-plain measurements and no dropped samples, and
    its samples update the shared table."""
    cost = lambda L, r: float(L)  # noqa: E731  (drafting never pays)
    first = DraftLength(K)
    ks = simulate(first, 0.9, cost, 40)
    assert ks[:2] == [K, K] and steady(ks) == 0
    memory = RoundCosts(first.cost, first.seen)
    second = DraftLength(K, memory=memory)
    ks = simulate(second, 0.9, cost, 10)
    assert ks[0] == 0 and K not in ks  # no start-up round of K drafts
    before = dict(memory.cost)
    simulate(second, 0.9, lambda L, r: 3.0 * L, 5)
    assert memory.cost[1] > before[1]  # its samples went into the shared table
    assert DraftLength(K).cost == {}  # without memory: a fresh table


def test_fixed_never_adapts():
    control = DraftLength(K, adaptive=False)
    assert set(simulate(control, 0.1, lambda L, r: float(L), 50)) == {K}


# ---- through stream_generate: fake verify costs, greedy identity ----------------------------

N = 48


@pytest.fixture
def fake_costs(monkeypatch):
    """The target's compiled verify of L tokens (and each plain decode, L = 1) advances a fake
    clock by ``costs[0](L, n)`` (n: the call's index); returns (costs, lengths): set
    ``costs[0]``, read the L of each call."""
    now, lengths, costs = [0.0], [], [lambda L, n: 1.0]
    verify, warm_verify, warming = DecodeStep.verify, DecodeStep.warm_verify, [False]

    def flagged_warm_verify(self, *args, **kwargs):  # traces before the rounds: not a round
        warming[0] = True
        try:
            return warm_verify(self, *args, **kwargs)
        finally:
            warming[0] = False

    def timed_verify(self, tokens, *args, **kwargs):
        if self.model is TARGET[0] and not warming[0]:
            L = tokens.shape[1]
            now[0] += costs[0](L, len(lengths))
            lengths.append(L)
        return verify(self, tokens, *args, **kwargs)

    decode = DecodeStep.decode

    def timed_decode(self, tokens, *args, **kwargs):  # a k = 0 round's plain decoding
        if self.model is TARGET[0]:
            now[0] += costs[0](1, len(lengths))
            lengths.append(1)
        return decode(self, tokens, *args, **kwargs)

    monkeypatch.setattr(DecodeStep, "verify", timed_verify)
    monkeypatch.setattr(DecodeStep, "warm_verify", flagged_warm_verify)
    monkeypatch.setattr(DecodeStep, "decode", timed_decode)
    monkeypatch.setattr(DraftLength, "clock", staticmethod(lambda: now[0]))
    # explore often (a short run sees several k), rarely enough that k = 0 runs for 7 rounds;
    # a k = 0 round decodes 2 tokens (not PLAIN_RUN): as many rounds in a short run as before
    monkeypatch.setattr(spec, "DraftLength", functools.partial(DraftLength, explore_every=8))
    monkeypatch.setattr(spec, "PLAIN_RUN", 2)
    monkeypatch.setattr(spec, "PLAIN_RUN_MAX", 2)  # runs do not grow here (see the runs test)
    # each generation learns its costs afresh (test_costs_carry_to_the_next_request: shared)
    monkeypatch.setattr(spec, "round_costs", lambda *args: None)
    return costs, lengths


TARGET: list = [None]


def run(m, prompt, **kwargs):
    import test_speculative as ts

    kwargs = {"repetition_penalty": ts.PENALTY, **kwargs}
    rs = list(stream_generate(m, ts.Tok(), prompt, max_tokens=N, ignore_eos=True, **kwargs))
    return [r.token for r in rs], rs[-1]


def shifting(L: int, n: int) -> float:
    """Cheap verifies, then a verify costs L^2 steps (k = 0 even at p = 1), then cheap again."""
    return float(L * L) if 4 <= n < 20 else 1.0 + 0.05 * (L - 1)


@pytest.mark.parametrize("name", ["llama", "qwen3_5-dense"])
def test_greedy_identical_while_the_draft_length_changes(name, fake_costs):
    import test_speculative as ts

    costs, lengths = fake_costs
    m = TARGET[0] = ts.target(name)
    prompts = [ts.PROMPT, [3, 8, 3, 8, 21, 3, 8, 50, 7]]
    for prompt in prompts:
        want, _ = run(m, prompt)
        for kwargs in (
            dict(draft_model=m),  # every draft accepted
            # the same weights as another model: its own compiled step (not Qwen 3.5), which
            # catches up in one call on the tokens of the rounds that drafted nothing
            dict(draft_model=ts.noisy_draft(name, 0.0)),
            dict(draft_model=ts.noisy_draft(name)),  # some rejected
            dict(prompt_lookup=2),
        ):
            costs[0] = shifting
            lengths.clear()
            got, last = run(m, prompt, num_draft_tokens=K, **kwargs)
            assert got == want, kwargs
            # several draft lengths, each verify exactly its drafts (no padding to K + 1)
            assert len(set(lengths)) >= 3 and 1 in lengths, (kwargs, lengths)
            assert last.drafted_tokens == sum(L - 1 for L in lengths)
            if any(kwargs.get("draft_model") is d for d in (m, ts.noisy_draft(name, 0.0))):
                assert last.accepted_tokens == last.drafted_tokens > 0, kwargs


def test_fixed_option_keeps_k(fake_costs):
    import test_speculative as ts

    costs, lengths = fake_costs
    m = TARGET[0] = ts.target("llama")
    want, _ = run(m, ts.PROMPT)
    costs[0] = lambda L, n: float(L)  # drafting never pays: adaptive would stop drafting
    got, last = run(m, ts.PROMPT, draft_model=m, num_draft_tokens=K, adaptive_drafts=False)
    assert got == want
    assert set(lengths) <= {1, K + 1} and K + 1 in lengths
    full = lengths.count(K + 1)  # the last round may draft fewer (the budget), still padded
    assert K * (full - 1) < last.drafted_tokens <= K * full
    lengths.clear()
    got, last = run(m, ts.PROMPT, draft_model=m, num_draft_tokens=K)
    assert got == want
    assert lengths.count(1) > len(lengths) // 2  # adaptive: mostly plain steps


def test_adaptive_option_is_checked():
    import test_speculative as ts

    m = ts.target("llama")
    with pytest.raises(SamplingOptionsError, match="adaptive_drafts"):
        run(m, ts.PROMPT, prompt_lookup=2, adaptive_drafts="yes")


def test_cli_fixed_draft_flag():
    from hf2q_mlx.cli import commands as cli

    argv = ["generate", "hi", "--model", "m.gguf", "--prompt-lookup", "2"]
    opts = cli._generation_options(cli.build_parser().parse_args(argv))
    assert opts["adaptive_drafts"] is True
    opts = cli._generation_options(cli.build_parser().parse_args([*argv, "--fixed-draft"]))
    assert opts["adaptive_drafts"] is False


@pytest.mark.parametrize("name", ["llama", "qwen3_5-dense"])
def test_rounds_without_drafts_decode_runs_of_plain_tokens(name, fake_costs, monkeypatch):
    """When drafting never pays (a verify of L tokens costs L steps), k = 0 rounds decode
    PLAIN_RUN tokens each, pipelined, with the same greedy tokens (logits processors on: the
    tokens not yet read back count in their history) and the draft caught up afterwards."""
    import test_speculative as ts

    monkeypatch.setattr(spec, "PLAIN_RUN", 2)
    monkeypatch.setattr(spec, "PLAIN_RUN_MAX", 8)
    runs = []
    plain_run = spec.plain_run

    def recorded(step, last, n, *args):
        runs.append(n)
        return plain_run(step, last, n, *args)

    monkeypatch.setattr(spec, "plain_run", recorded)
    costs, lengths = fake_costs
    m = TARGET[0] = ts.target(name)
    want, _ = run(m, ts.PROMPT)
    costs[0] = lambda L, n: float(L)
    for kwargs in (dict(draft_model=ts.noisy_draft(name)), dict(prompt_lookup=2)):
        lengths.clear()
        runs.clear()
        got, last = run(m, ts.PROMPT, num_draft_tokens=K, **kwargs)
        assert got == want, kwargs
        assert lengths.count(1) >= N // 2, lengths  # most tokens from plain runs
        assert last.drafted_tokens == sum(L - 1 for L in lengths)
        # consecutive plain runs double (2, 4, 8, 8, ...), back to 2 after a drafting round
        assert runs[0] == 2 and 4 in runs and max(runs) <= 8, runs
        for i, (a, b) in enumerate(zip(runs, runs[1:])):
            last = i == len(runs) - 2  # the budget may cut the last run short
            assert b in (min(2 * a, 8), 2) or (last and b < min(2 * a, 8)), runs


def test_costs_carry_to_the_next_request(fake_costs, monkeypatch):
    """stream_generate keeps the learned round costs on the target's compiled step, per drafter:
    a second request with the same draft model starts from them (no K-draft start-up round when
    drafting never pays), prompt lookup gets a table of its own; the tokens stay the plain
    greedy ones."""
    import test_speculative as ts

    tables = []

    def recorded(step, draft_model, k):
        tables.append(ROUND_COSTS(step, draft_model, k))
        return tables[-1]

    monkeypatch.setattr(spec, "round_costs", recorded)
    costs, lengths = fake_costs
    m = TARGET[0] = ts.target.__wrapped__("llama")  # a new model: no step, no costs yet
    want, _ = run(m, ts.PROMPT)
    costs[0] = lambda L, n: float(L)  # drafting never pays
    lengths.clear()
    got, _ = run(m, ts.PROMPT, draft_model=m, num_draft_tokens=K)
    assert got == want and lengths[:2] == [K + 1, K + 1]  # the first request measures
    lengths.clear()
    got, last = run(m, ts.PROMPT, draft_model=m, num_draft_tokens=K)
    assert got == want and K + 1 not in lengths[:4]  # the second starts from what it learned
    got, _ = run(m, ts.PROMPT, prompt_lookup=2, num_draft_tokens=K)
    assert got == want
    assert tables[0] is tables[1] and tables[2] is not tables[0]  # one table per drafter
    assert 1 in tables[0].cost and tables[0].cost[1] < tables[0].cost[K + 1]


ROUND_COSTS = spec.round_costs
