"""The serving engine's packed prefill (``batch_prefill``): a step's prompt chunks of several
rows in one forward pass (``DecodeStep.prefill_rows``). Tiny random models on the CPU through
the batched step: the streams' greedy tokens are those of one prefill per row, and the passes
really hold several rows."""

from __future__ import annotations

import mlx.core as mx
import pytest
from conftest import IdsTokenizer
from test_decode_step import prompts, tiny_model

import hf2q_mlx
from hf2q_mlx.decode_step import DecodeStep


@pytest.fixture(autouse=True)
def on_cpu():
    with mx.stream(mx.cpu):
        yield


@pytest.mark.parametrize("name", ["gemma4-moe", "llama", "qwen3_5-dense"])
def test_packed_prefill_gives_each_rows_tokens(name, monkeypatch):
    model = tiny_model(name)
    batch = prompts([30, 5, 17, 41], seed=31)
    packed_rows = []
    real = DecodeStep.prefill_rows

    def counting(self, rows, chunks):
        packed_rows.append(len(rows))
        return real(self, rows, chunks)

    monkeypatch.setattr(DecodeStep, "prefill_rows", counting)

    def run(batch_prefill: bool) -> list:
        with hf2q_mlx.BatchGenerator(
            model, IdsTokenizer(), max_batch=4, max_len=96, prefill_chunk=24, compiled=True,
            prefix_cache_bytes=0, batch_prefill=batch_prefill,
        ) as gen:  # fmt: skip
            return gen.generate(batch, max_tokens=6, ignore_eos=True)

    want = run(False)
    assert packed_rows == []
    got = run(True)
    assert got == want
    # chunks of 24 tokens in all per step: the 5- and 17-token prompts' chunks share a pass
    assert max(packed_rows) >= 2
    assert DecodeStep(model, 1, 8).packs_rows
