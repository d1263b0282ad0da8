"""The serving engine's warm-up: before ``start()`` returns, a prefill chunk of every length at
which a kernel dispatcher switches kernels (``PREFILL_SWITCH_TOKENS``), decode steps greedy and
sampled, and the compiled step at every attention span; none of it counted, saved or left in a
row. CPU: a model-free step, then a tiny random model through the compiled ``DecodeStep``."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import IdsTokenizer, requires_gpu
from test_decode_step import prompts, tiny_model
from test_serving_engine import _CountModel, _CountStep, _CountTok

import hf2q_mlx
from hf2q_mlx.decode_step import DecodeStep
from hf2q_mlx.errors import InvalidArgumentError
from hf2q_mlx.serving.batch_sampler import SamplingParams
from hf2q_mlx.serving.engine import PREFILL_SWITCH_TOKENS, WARM_TOP_K, Engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


@pytest.fixture(autouse=True)
def on_cpu():
    with mx.stream(mx.cpu):
        yield


class _ChunkStep(_CountStep):
    """The model-free step, recording each prefill chunk's length."""

    def __init__(self, max_batch: int, vocab: int) -> None:
        super().__init__(max_batch, vocab)
        self.chunks: list[int] = []

    def prefill(self, row: int, ids) -> mx.array:
        self.chunks.append(len(ids))
        return super().prefill(row, ids)


def _run(engine: Engine, prompt: list[int], params: SamplingParams) -> list[int]:
    tokens, ended = [], threading.Event()

    def sink(e) -> None:
        if e.token is not None:
            tokens.append(e.token)
        if e.finish_reason is not None:
            ended.set()

    engine.submit(prompt, params, sink)
    assert ended.wait(60)
    return tokens


def test_warm_up_prefills_every_switch_length_and_leaves_no_trace():
    step = _ChunkStep(2, 50)
    engine = Engine(_CountModel(), _CountTok(), max_batch=2, max_queue=4, max_len=64,
                    prefix_cache_bytes=0, step=step, warmup=True)  # fmt: skip
    engine.start()
    try:
        # a request at each length that leaves the prompt and 2 tokens inside max_len 64 (again
        # from the first while sampling options are left), then chunks of 1..9 tokens after a
        # 9-token one (65 does not fit)
        lengths = [n for n in PREFILL_SWITCH_TOKENS if n <= 61]
        n_requests = max(len(lengths), 1 + len(WARM_TOP_K))
        after = [c for m in range(1, 10) for c in (9, m)]
        assert step.chunks == [lengths[i % len(lengths)] for i in range(n_requests)] + after
        assert engine.warmup_s is not None and engine.warmup_s > 0
        assert len(step.fed) >= 2 * n_requests  # two decode steps a request at least
        stats = engine.stats()
        assert stats["outstanding"] == stats["running"] == stats["prefix_entries"] == 0
        for name in ("requests_total", "prompt_tokens_total", "prefill_tokens_total",
                     "generation_tokens_total"):  # fmt: skip
            assert engine.metrics.value(name) == 0, name
        # a request afterwards runs as on a cold engine: 1, 2, 3 -> 4, 5, 6 (EOS)
        assert _run(engine, [1, 2, 3], SamplingParams(max_tokens=20)) == [4, 5, 6]
        assert engine.metrics.value("requests_total") == 1
    finally:
        engine.shutdown()


class _GatedStep(_ChunkStep):
    """The chunk-recording step whose first prefill waits for ``gate``: a warm-up in progress."""

    def __init__(self, max_batch: int, vocab: int) -> None:
        super().__init__(max_batch, vocab)
        self.entered, self.gate = threading.Event(), threading.Event()

    def prefill(self, row: int, ids) -> mx.array:
        self.entered.set()
        assert self.gate.wait(60)
        return super().prefill(row, ids)


def test_a_request_sent_during_the_warm_up_is_queued_and_counted():
    """max_batch 1, max_queue 0: the warm-up's requests take no place in the 429 count, and a
    client's request sent meanwhile is counted in the real metrics and served after it."""
    step = _GatedStep(1, 50)
    engine = Engine(_CountModel(), _CountTok(), max_batch=1, max_queue=0, max_len=64,
                    prefix_cache_bytes=0, step=step, warmup=True)  # fmt: skip
    starter = threading.Thread(target=engine.start)
    starter.start()
    try:
        assert step.entered.wait(30)
        tokens, ended = [], threading.Event()

        def sink(e) -> None:
            tokens.append(e.token)
            if e.finish_reason is not None:
                ended.set()

        engine.submit([1, 2, 3], SamplingParams(max_tokens=20), sink)  # no QueueFullError
        assert engine.metrics.value("requests_total") == 1
        step.gate.set()
        starter.join(60)
        assert ended.wait(60) and tokens == [4, 5, 6]
        assert engine.metrics.value("requests_finished_total", reason="stop") == 1
        assert engine.metrics.value("requests_finished_total", reason="cancelled") == 0
        assert engine.stats()["outstanding"] == 0
    finally:
        step.gate.set()
        engine.shutdown()


def test_a_shutdown_during_the_warm_up_ends_it_quietly():
    step = _GatedStep(2, 50)
    engine = Engine(_CountModel(), _CountTok(), max_batch=2, max_len=64, prefix_cache_bytes=0,
                    step=step, warmup=True)  # fmt: skip
    starter = threading.Thread(target=engine.start)
    starter.start()
    assert step.entered.wait(30)
    threading.Timer(0.2, step.gate.set).start()
    engine.shutdown()
    starter.join(30)
    assert not starter.is_alive() and not engine.alive()
    assert step.chunks == [1]  # stopped after its first request's prefill
    assert engine.metrics.value("requests_finished_total", reason="cancelled") == 0
    assert engine.stats()["outstanding"] == 0


def test_no_warm_up_unless_asked_on_the_cpu():
    step = _ChunkStep(1, 50)
    engine = Engine(_CountModel(), _CountTok(), max_batch=1, max_len=64, prefix_cache_bytes=0,
                    step=step).start()  # fmt: skip
    try:
        assert engine.warmup is False and engine.warmup_s is None and step.chunks == []
    finally:
        engine.shutdown()


def test_warm_span_traces_without_touching_the_rows(monkeypatch):
    model = tiny_model("llama")
    step = DecodeStep(model, max_batch=2, max_len=600)
    assert step.spans() == [256, 512, 600]
    step.prefill(0, prompts([9])[0])
    mx.eval([s.arrays for s in step.caches])
    before = [[np.array(a) for a in s.arrays] for s in step.caches]
    positions = list(step.positions)
    assert [step.warm_span(s) for s in step.spans()] == [True, True, True]
    assert step.warm_span(512) is False  # traced already
    assert step.positions == positions
    for s, arrays in zip(step.caches, before):
        for a, b in zip(s.arrays, arrays):
            assert np.array_equal(np.array(a), b)  # bit-exact: nothing written
    # the row decodes as one never warmed: the same logits, bit for bit
    fresh = DecodeStep(model, max_batch=2, max_len=600)
    fresh.prefill(0, prompts([9])[0])
    tok = [5, 0]
    got, want = step.decode(tok, [True, False]), fresh.decode(tok, [True, False])
    assert np.array_equal(np.array(got[0]), np.array(want[0]))
    with pytest.raises(InvalidArgumentError, match="span 300"):
        step.warm_span(300)
    # the warm trace is the one a decode takes: a row reaching span 512 runs no Python model
    # code (a new trace would call the model)
    step.prefill(1, prompts([300], seed=3)[0])
    calls = []
    real_call = type(model).__call__
    monkeypatch.setattr(type(model), "__call__", lambda m, *a, **k: calls.append(1) or
                        real_call(m, *a, **k))  # fmt: skip
    mx.eval(step.decode([5, 7], [True, True]))
    assert step._span(step.positions[1]) == 512 and calls == []


@pytest.mark.parametrize("name", ["gemma4-moe", "qwen3_5-dense"])
def test_a_warmed_engine_gives_the_cold_engines_tokens(name):
    """Through the compiled step: every span traced by the warm-up, and greedy and seeded
    sampled streams equal to those of an engine that did not warm up."""
    model = tiny_model(name)
    batch = prompts([30, 5, 17], seed=5)
    options = [dict(max_tokens=6, ignore_eos=True),
               dict(max_tokens=6, ignore_eos=True, temperature=0.9, top_p=0.9, seed=4),
               dict(max_tokens=6, ignore_eos=True, top_logprobs=2, logprobs=True)]  # fmt: skip

    def run(warmup: bool):
        with hf2q_mlx.BatchGenerator(model, IdsTokenizer(), max_batch=2, max_len=300,
                                     compiled=True, warmup=warmup) as gen:  # fmt: skip
            if warmup:
                traced = {span for L, span, _ in gen.engine.step._traced if L == 1}
                assert traced == set(gen.engine.step.spans()) == {256, 300}
                assert gen.engine.metrics.value("requests_total") == 0
                assert gen.engine.stats()["prefix_entries"] == 0  # nothing saved in the pool
            return [gen.generate([p], **o)[0] for p, o in zip(batch, options)]

    assert run(True) == run(False)


def test_serve_no_warmup_flag_reaches_the_engine(capsys, monkeypatch):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from hf2q_mlx.cli import commands
    from hf2q_mlx.serving import engine

    seen = []

    def fake_engine(model, tokenizer, **kw):
        seen.append(kw["warmup"])
        raise InvalidArgumentError("stopped before serving")

    monkeypatch.setattr(commands, "_load", lambda *a, **k: (object(), object()))
    monkeypatch.setattr(engine, "Engine", fake_engine)
    for flags in ([], ["--no-warmup"]):
        assert commands.main(["serve", *flags]) == 2
        assert "stopped before serving" in capsys.readouterr().err
    assert seen == [None, False]  # None: the engine warms up where kernels run


@requires_gpu
def test_gpu_warmed_graph_engine_gives_the_cold_engines_tokens(monkeypatch):
    """On CUDA through the graph step: the warm-up records every span's graph before start()
    returns, and greedy and seeded sampled streams equal those of a cold engine."""
    if not mx.cuda.is_available():
        pytest.skip("the CUDA graph step needs MLX's CUDA back end")
    from decode_profile import build

    from hf2q_mlx.cuda_graph_step import CudaGraphStep

    monkeypatch.setenv("HF2Q_DECODE", "graph")
    model, _ = build("gemma4", "tiny-moe", "q4_k", mx.bfloat16)
    batch = prompts([30, 5, 70], seed=9)
    options = [dict(max_tokens=8, ignore_eos=True),
               dict(max_tokens=8, ignore_eos=True, temperature=0.9, top_p=0.9, seed=4),
               dict(max_tokens=8, ignore_eos=True, logprobs=True, top_logprobs=2)]  # fmt: skip

    def run(warmup: bool):
        with (
            mx.stream(mx.gpu),  # the module's autouse fixture put the CPU stream first
            hf2q_mlx.BatchGenerator(
                model, IdsTokenizer(), max_batch=2, max_len=600, warmup=warmup
            ) as gen,
        ):
            graph = gen.engine.graph
            assert isinstance(graph, CudaGraphStep)
            if warmup:
                assert sorted(graph.recordings) == gen.engine.step.spans() == [256, 512, 600]
            return [gen.generate([p], **o)[0] for p, o in zip(batch, options)]

    assert run(True) == run(False)
