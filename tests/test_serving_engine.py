"""The serving engine's pieces without a model: per-row batch sampling, the prefix pool, stop
strings, option checks (fast, CPU)."""

from __future__ import annotations

import math
import platform
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import requires_gpu

from hf2q_mlx.decode_step import RowSlots
from hf2q_mlx.errors import InvalidArgumentError, SamplingOptionsError
from hf2q_mlx.serving import engine as engine_module
from hf2q_mlx.serving.batch_generator import sampling_params
from hf2q_mlx.serving.batch_sampler import BatchSampler, SamplingParams
from hf2q_mlx.serving.engine import Engine
from hf2q_mlx.serving.prefix_pool import PrefixPool
from hf2q_mlx.serving.stop_text import StopText

V = 37  # an awkward vocabulary size


def random_logits(B: int, seed: int) -> mx.array:
    return mx.array(np.random.default_rng(seed).normal(size=(B, V)).astype(np.float32) * 3)


def test_greedy_rows_take_the_argmax_with_its_logprob():
    s = BatchSampler(3, V)
    for row in range(3):
        s.set_row(row, SamplingParams(logprobs=True, top_logprobs=4))
    logits = random_logits(3, 0)
    out = s.sample(logits, [True, True, True])
    ref = np.asarray(logits)
    logsm = ref - np.log(np.exp(ref - ref.max(-1, keepdims=True)).sum(-1, keepdims=True))
    logsm -= ref.max(-1, keepdims=True)
    assert out.tokens == ref.argmax(-1).tolist()
    for row in range(3):
        # fp32 log-softmax on the device vs float64 numpy: ~1e-6 relative
        assert out.logprobs[row] == pytest.approx(logsm[row].max(), abs=1e-5)
        ids = [t for t, _ in out.top[row]]
        assert ids == np.argsort(-logsm[row])[:4].tolist()
        assert [v for _, v in out.top[row]] == pytest.approx(
            np.sort(logsm[row])[::-1][:4], abs=1e-5
        )


def test_logit_bias_moves_each_rows_own_logits():
    """Row 0 pushes its second-best token over the best (+ a margin), row 1 sinks its best
    (-100), row 2 has no bias, row 3 samples with a bias on one token that the draw must then
    take at a low temperature; each row's log-probs are the biased logits' log-softmax."""
    logits = random_logits(4, 7)
    ref = np.asarray(logits).astype(np.float64)
    order = np.argsort(-ref, axis=-1)
    gap = ref[0, order[0, 0]] - ref[0, order[0, 1]]
    s = BatchSampler(4, V)
    s.set_row(0, SamplingParams(logprobs=True, logit_bias={int(order[0, 1]): gap + 1.0}))
    s.set_row(1, SamplingParams(logit_bias={int(order[1, 0]): -100, int(order[1, 5]): 0.5}))
    s.set_row(2, SamplingParams())
    s.set_row(3, SamplingParams(temperature=0.05, seed=3, logit_bias={int(order[3, 30]): 60}))
    out = s.sample(logits, [True] * 4)
    biased = ref[1].copy()
    biased[order[1, 0]] -= 100
    biased[order[1, 5]] += 0.5
    assert out.tokens == [order[0, 1], biased.argmax(), order[2, 0], order[3, 30]]
    row0 = ref[0].copy()
    row0[order[0, 1]] += gap + 1.0
    logsm = row0 - row0.max() - np.log(np.exp(row0 - row0.max()).sum())
    assert out.logprobs[0] == pytest.approx(logsm.max(), abs=1e-5)  # of the biased logits
    assert not s.plain_greedy([True, False, False, False]) and s.plain_greedy([0, 0, 1, 0])
    s.clear_row(1)  # the bias table is rebuilt without row 1's entries
    s.set_row(1, SamplingParams())
    assert s.sample(logits, [True] * 4).tokens[1] == order[1, 0]


@pytest.mark.parametrize(
    "bias, fragment",
    [({-1: 1.0}, "keys"), ({3: 101}, "[-100, 100]"), ({3: True}, "numbers"), ([1], "map")],
)
def test_logit_bias_is_checked(bias, fragment):
    with pytest.raises(SamplingOptionsError, match="logit_bias") as info:
        SamplingParams(logit_bias=bias).validate()
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    "options", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=0.999), dict(top_k=3, top_p=1e-6)]
)
def test_filters_that_keep_one_token_give_the_argmax(options):
    s = BatchSampler(4, V)
    for row in range(4):
        s.set_row(row, SamplingParams(temperature=1.5, seed=row, **options))
    for step in range(5):
        logits = random_logits(4, 10 + step)
        out = s.sample(logits, [True] * 4)
        assert out.tokens == np.asarray(logits).argmax(-1).tolist()


def test_a_top_k_past_the_vocabulary_keeps_it_all():
    """top_k = 2**31 (valid: any k >= 0) samples as top_k = 0 with the same seed; it once
    overflowed the sampler's int32 vector, failing every running request of the engine."""
    logits = random_logits(2, 8)
    outs = []
    for k in (2**31, 0):
        s = BatchSampler(2, V)
        s.set_row(0, SamplingParams(temperature=1.0, top_k=k, seed=5))
        s.set_row(1, SamplingParams(temperature=1.0, top_p=0.9, seed=6))
        outs.append(s.sample(logits, [True, True]).tokens)
    assert outs[0] == outs[1]


def test_top_k_keeps_only_the_k_best():
    s = BatchSampler(2, V)
    s.set_row(0, SamplingParams(temperature=5.0, top_k=3, seed=1))
    s.set_row(1, SamplingParams(temperature=5.0, top_k=0, seed=2))
    logits = random_logits(2, 3)
    best = set(np.argsort(-np.asarray(logits)[0])[:3].tolist())
    drawn = [s.sample(logits, [True, True]).tokens for _ in range(60)]
    assert {d[0] for d in drawn} <= best
    assert len({d[1] for d in drawn}) > 3  # the unfiltered row at high temperature wanders


def test_sampling_frequencies_follow_the_distribution():
    B, steps = 64, 40
    s = BatchSampler(B, V)
    for row in range(B):
        s.set_row(row, SamplingParams(temperature=1.0, seed=1000 + row))
    logits = mx.full((B, V), -30.0)
    logits[:, 5] = math.log(0.75)
    logits[:, 9] = math.log(0.25)
    counts = {5: 0, 9: 0}
    for _ in range(steps):
        for t in s.sample(logits, [True] * B).tokens:
            counts[t] += 1
    share = counts[5] / (B * steps)
    # 2560 Bernoulli(0.75) draws: standard deviation 0.0086, so 0.05 is ~6 sigma
    assert abs(share - 0.75) < 0.05


def test_a_seeded_row_draws_the_same_whatever_shares_the_batch():
    def run(active_others: bool, row: int) -> list[int]:
        s = BatchSampler(4, V)
        for r in range(4):
            seed = 7 if r == row else 100 + r
            s.set_row(r, SamplingParams(temperature=1.0, top_p=0.95, seed=seed))
        active = [True] * 4 if active_others else [r == row for r in range(4)]
        return [s.sample(random_logits(4, i), active).tokens[row] for i in range(12)]

    alone = run(False, 2)
    assert run(True, 2) == alone
    other_seed = BatchSampler(1, V)
    other_seed.set_row(0, SamplingParams(temperature=1.0, top_p=0.95, seed=8))
    assert [
        other_seed.sample(random_logits(4, i)[2:3], [True]).tokens[0] for i in range(12)
    ] != alone


@pytest.mark.parametrize("gpu", [False, pytest.param(True, marks=requires_gpu)])
def test_candidate_draw_equals_the_full_sort_draw(gpu):
    """Rows filtering with top-k draw among the top-k candidates (the GPU top-k kernel where a
    GPU runs, its reference on the CPU) exactly what the full-vocabulary sort draws: the same
    filters over the same values and the same Gumbel noise at the candidates."""
    B, vocab = 6, 1000
    opts = [
        dict(top_k=1),
        dict(top_k=5, top_p=0.8),
        dict(top_k=64, min_p=0.05),
        dict(top_k=40, top_p=0.9, min_p=0.01),
        dict(temperature=0.0),
        dict(top_k=17),
    ]
    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**32))
    seeds = rng.integers(0, 2**31, size=B).tolist()
    xs = [rng.normal(size=(B, vocab)).astype(np.float32) * 4 for _ in range(8)]
    runs = []
    for candidates in (False, True):
        with mx.stream(mx.gpu if gpu else mx.cpu):
            s = BatchSampler(B, vocab, candidates=candidates)
            for row, o in enumerate(opts):
                s.set_row(row, SamplingParams(**{"temperature": 0.7, **o}, seed=seeds[row]))
            runs.append([s.sample(mx.array(x), [True] * B).tokens for x in xs])
    assert runs[1] == runs[0]
    assert len({t for step in runs[0] for t in step}) > B  # the draws do vary


def test_frequency_and_presence_penalties_count_generated_tokens():
    s = BatchSampler(2, V)
    s.set_row(0, SamplingParams(frequency_penalty=2.0))
    s.set_row(1, SamplingParams())
    logits = mx.zeros((2, V))
    logits[:, 3] = 1.0
    logits[:, 4] = 0.5
    first = s.sample(logits, [True, True]).tokens
    second = s.sample(logits, [True, True]).tokens
    assert first == [3, 3] and second == [4, 3]  # 1 - 2*1 < 0.5: the penalised row moves on
    s.set_row(0, SamplingParams(presence_penalty=0.6))  # a new request: counts start again
    assert s.sample(logits, [True, True]).tokens == [3, 3]
    assert s.sample(logits, [True, True]).tokens == [4, 3]  # 1 - 0.6 < 0.5


def test_sampling_options_are_checked():
    with pytest.raises(SamplingOptionsError, match="top_logprobs"):
        SamplingParams(top_logprobs=21).validate()
    with pytest.raises(SamplingOptionsError, match="presence_penalty"):
        SamplingParams(presence_penalty=3).validate()
    with pytest.raises(SamplingOptionsError, match="temperature"):
        sampling_params({"temperature": -0.1})
    with pytest.raises(SamplingOptionsError, match="unknown generation option"):
        sampling_params({"temprature": 0.5})
    assert sampling_params({"stop": "x"}).stop == ["x"]


class Saved:
    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


def test_prefix_pool_longest_match_and_lru_eviction_by_bytes():
    pool = PrefixPool(budget_bytes=100)
    a, b, c = Saved(40), Saved(40), Saved(40)
    assert pool.put([1, 2, 3], a) and pool.put([1, 2, 3, 4, 5], b)
    assert pool.match([1, 2, 3, 4, 5, 6]) == (5, b)
    assert pool.match([1, 2, 3, 9]) == (3, a)  # now a is the most recently used
    assert pool.match([1, 2]) == (0, None)  # whole entries only by default
    assert pool.match([]) == (0, None)
    assert pool.put([7, 8], c)  # 120 > 100: the least recently used (b) goes
    assert [1, 2, 3, 4, 5] not in pool and [1, 2, 3] in pool and [7, 8] in pool
    assert pool.nbytes == 80 and pool.evictions == 1
    assert not pool.put([9], Saved(101))  # larger than the whole budget: not kept
    assert pool.nbytes == 80
    # without eviction an entry takes only the budget left free
    assert not pool.put([5, 5], Saved(21), evict=False) and pool.put([5, 5], Saved(20), evict=False)
    assert pool.nbytes == 100 and pool.evictions == 1


def test_prefix_pool_drops_entries_a_longer_one_covers():
    pool = PrefixPool(budget_bytes=1000)
    for key in ([1], [1, 2], [1, 2, 3], [1, 3], [2, 2, 3, 4]):
        pool.put(key, Saved(10))
    # [1] and [1, 2] begin the new key; the rule keeps the one of length 1
    assert pool.drop_covered([1, 2, 3, 4], lambda n: n >= 2) == 2
    assert [1, 2] not in pool and [1, 2, 3] not in pool and [1] in pool and [1, 3] in pool
    assert pool.nbytes == 30 and len(pool) == 3
    assert pool.drop_covered([1, 2, 3, 4], lambda n: True) == 1 and pool.nbytes == 20


def test_prefix_pool_serves_shared_prefixes_by_rule():
    """``usable(common, length, saved)`` decides how many shared tokens an entry serves; the
    entry serving the most wins, whatever its own length."""
    pool = PrefixPool(budget_bytes=1000)
    a, b, c = Saved(10), Saved(10), Saved(10)
    pool.put([1, 2, 3, 4, 5, 6], a)  # shares 4 tokens with the prompt below
    pool.put([1, 2, 3, 9], b)  # shares 3
    pool.put([7, 7, 7, 7, 7], c)  # shares none
    prompt = [1, 2, 3, 4, 8, 8]
    seen = []

    def cut_back(common, length, saved):
        seen.append((common, length, saved))
        return common

    assert pool.match(prompt, cut_back) == (4, a)
    assert sorted(seen, key=lambda s: s[1]) == [(3, 4, b), (4, 6, a)]  # no call for c
    assert pool.match(prompt) == (0, None)  # neither is whole in the prompt
    assert pool.match(prompt, lambda common, length, saved: common if saved is b else 0) == (3, b)
    # the entry matched last is the most recently used: evictions (c, then a) spare it
    pool.budget = 20
    assert pool.put([4], Saved(10)) and [1, 2, 3, 9] in pool and [1, 2, 3, 4, 5, 6] not in pool
    assert len(pool) == 2 and pool.evictions == 2


class _Detok:
    def __init__(self, pieces: dict[int, str]) -> None:
        self.pieces, self.segment = pieces, ""

    def add_token(self, t: int) -> None:
        self.segment += self.pieces[t]

    def finalize(self) -> None:
        pass

    @property
    def last_segment(self) -> str:
        s, self.segment = self.segment, ""
        return s


class _Tok:
    pieces = {0: "Hello", 1: " wor", 2: "ld", 3: " EN", 4: "D!", 5: " E"}

    def detokenizer(self) -> _Detok:
        return _Detok(self.pieces)


def test_stop_strings_are_held_back_and_never_emitted():
    st = StopText(_Tok(), ["END"])
    out = [st.add(t) for t in (0, 1, 2, 3)]
    assert [o[0] for o in out] == ["Hello", " wor", "ld", " "]  # "EN" may begin "END"
    assert st.add(4) == ("", True)
    st = StopText(_Tok(), ["END"])
    assert st.add(5) == (" ", False)  # " E" holds "E"
    assert st.finish() == ("E", False)  # generation ended otherwise: the tail is released


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--port", "0"], "--port"),
        (["--max-batch", "0"], "--max-batch"),
        (["--max-queue", "-1"], "--max-queue"),
        (["--kv-bits", "7"], "kv_bits"),
    ],
)
def test_serve_rejects_bad_flags_before_loading(flags, fragment, capsys, monkeypatch):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from hf2q_mlx.cli import commands

    monkeypatch.setattr(commands, "_load", lambda *a, **k: pytest.fail("loaded a model"))
    assert commands.main(["serve", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and fragment in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "step, compiled", [("auto", None), ("batched", True), ("sequential", False)]
)
def test_serve_step_flag_reaches_the_engine(step, compiled, capsys, monkeypatch):
    """``--step`` picks the engine's decode step: auto leaves it to make_step (batched on a GPU,
    per row on the CPU), batched / sequential force it."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from hf2q_mlx.cli import commands
    from hf2q_mlx.serving import engine

    seen = {}

    def fake_engine(model, tokenizer, **kw):
        seen.update(kw)
        raise InvalidArgumentError("stopped before serving")

    monkeypatch.setattr(commands, "_load", lambda *a, **k: (object(), object()))
    monkeypatch.setattr(engine, "Engine", fake_engine)
    assert commands.main(["serve", "--step", step]) == 2
    assert "stopped before serving" in capsys.readouterr().err
    assert seen["compiled"] is compiled


class _AnyDetok:
    def __init__(self) -> None:
        self.last_segment = ""

    def add_token(self, t: int) -> None:
        self.last_segment = f"<{t}>"

    def finalize(self) -> None:
        self.last_segment = ""


class _CountTok:
    eos_token_ids = [6]

    def detokenizer(self) -> _AnyDetok:
        return _AnyDetok()


class _CountModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.args = SimpleNamespace(vocab_size=50, max_position_embeddings=64)


class _CountStep(RowSlots):
    """A model-free decode step: the next token after t is t + 1 (greedy logits); it records
    every row's input tokens, so the test sees what the engine fed while overlapping steps."""

    def __init__(self, max_batch: int, vocab: int) -> None:
        self.max_batch, self.V = max_batch, vocab
        self.positions = [0] * max_batch
        self.caches: list = []
        self.fed: list[tuple[list[bool], mx.array]] = []

    def reset_row(self, row: int) -> None:
        self.positions[row] = 0

    def prefill(self, row: int, ids) -> mx.array:
        self.positions[row] += len(ids)
        return mx.zeros((self.V,))

    def decode(self, tokens: mx.array, active) -> mx.array:
        self.fed.append((list(active), tokens))
        self.positions = [p + bool(a) for p, a in zip(self.positions, active)]
        return mx.eye(self.V)[(tokens + 1) % self.V] * 10.0  # (B, V)


def test_overlapped_steps_drop_an_ended_row_one_step_late_without_emitting(monkeypatch):
    """The engine submits step k before reading step k - 1: a row that hits EOS in k - 1 has a
    token in flight that is discarded, a max_tokens row launches exactly max_tokens steps, and a
    row reused right away starts from its own prompt, not the discarded device token. Token ids
    are uploaded only in a step where a row starts; the others feed the device's last ids."""
    uploads = []
    real_device_array = engine_module.device_array

    def counting(values, dtype):
        uploads.append((list(values), dtype))
        return real_device_array(values, dtype)

    monkeypatch.setattr(engine_module, "device_array", counting)
    step = _CountStep(2, 50)
    engine = Engine(_CountModel(), _CountTok(), max_batch=2, max_queue=4, max_len=64,
                    prefix_cache_bytes=0, step=step)  # fmt: skip
    events: dict[str, list] = {}
    done = threading.Semaphore(0)

    def sink(e) -> None:
        events.setdefault(e.request_id, []).append(e)
        if e.finish_reason is not None:
            done.release()

    a = engine.submit([1, 2, 3], SamplingParams(max_tokens=20), sink)  # 4, 5, 6 = EOS
    b = engine.submit([9, 10], SamplingParams(max_tokens=3), sink)  # 11, 12, 13: length
    c = engine.submit([20, 30], SamplingParams(max_tokens=2), sink)  # waits for a row
    engine.start()
    try:
        for _ in range(3):
            assert done.acquire(timeout=30)
        assert engine.stats()["running"] == 0 and engine.stats()["outstanding"] == 0
    finally:
        engine.shutdown()
    toks = {k: [e.token for e in v if e.token is not None] for k, v in events.items()}
    assert toks == {a: [4, 5, 6], b: [11, 12, 13], c: [31, 32]}
    assert [events[r][-1].finish_reason for r in (a, b, c)] == ["stop", "length", "length"]
    assert sum(e.finish_reason is not None for v in events.values() for e in v) == 3
    fed: dict[int, list[int]] = {0: [], 1: []}
    for active, tokens in step.fed:
        for row, t in enumerate(tokens.tolist()):
            if active[row]:
                fed[row].append(t)
    # row 0: a fed 3, 4, 5, 6 (the step after EOS ran, its token 7 was dropped), then c's
    # prompt end 30 and 31; row 1: b's three steps, never a fourth
    assert fed == {0: [3, 4, 5, 6, 30, 31], 1: [10, 11, 12]}
    # ids uploaded twice: a and b's prompt ends (one step), then c's; every other step chained
    assert [v for v, dt in uploads if dt == mx.int32] == [[3, 10], [30, 0]], uploads
    assert len(step.fed) > 2


def _count_engine(step) -> tuple[Engine, Callable, threading.Semaphore]:
    """(engine over the model-free ``step``, a sink, a semaphore it releases once a request
    ends)."""
    engine = Engine(_CountModel(), _CountTok(), max_batch=2, max_queue=4, max_len=64,
                    prefix_cache_bytes=0, step=step)  # fmt: skip
    done = threading.Semaphore(0)

    def sink(e) -> None:
        if e.finish_reason is not None:
            done.release()

    return engine, sink, done


def test_an_engine_falling_idle_releases_memory(monkeypatch):
    """After its last request the engine hands freed memory back (MLX's buffer cache and, on
    glibc, the C heap's free pages: a server's RSS returns toward its baseline after load)."""
    calls = []
    monkeypatch.setattr(engine_module, "release_memory", lambda: calls.append(1))
    engine, sink, done = _count_engine(_CountStep(2, 50))
    engine.submit([1, 2], SamplingParams(max_tokens=2), sink)
    engine.start()
    try:
        assert done.acquire(timeout=30)
        deadline = time.monotonic() + 10
        while not calls and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        engine.shutdown()
    assert calls, "the engine never released memory after its work"
    if platform.libc_ver()[0] == "glibc":
        assert engine_module._TRIM is not None  # malloc_trim found
    engine_module.release_memory()  # the real one runs


def test_decode_steps_run_per_token_and_prefills_do_not(monkeypatch):
    """On CUDA our kernels take their cached cubins in prefills and MLX's own builds in the
    per-token work (MLX 0.32.4 hashes a cubin's image at each launch): the engine's decode step
    and its sampling run inside ``cuda_cache.per_token()``, its prefills outside."""
    from hf2q_mlx.custom_kernels import cuda_cache

    monkeypatch.setattr(cuda_cache, "MODE", "auto")
    monkeypatch.setattr(cuda_cache, "ENABLED", True)
    seen = []

    class Step(_CountStep):
        def prefill(self, row: int, ids) -> mx.array:
            seen.append(("prefill", cuda_cache.wants_cubin()))
            return super().prefill(row, ids)

        def decode(self, tokens: mx.array, active) -> mx.array:
            seen.append(("decode", cuda_cache.wants_cubin()))
            return super().decode(tokens, active)

    engine, sink, done = _count_engine(Step(2, 50))
    engine.submit([1, 2, 3], SamplingParams(max_tokens=4), sink)
    engine.submit([9, 10], SamplingParams(max_tokens=4, temperature=0.7, seed=1), sink)
    engine.start()
    try:
        for _ in range(2):
            assert done.acquire(timeout=30)
    finally:
        engine.shutdown()
    kinds = {k for k, _ in seen}
    assert kinds == {"prefill", "decode"}, seen
    assert all(w == (k == "prefill") for k, w in seen), seen
