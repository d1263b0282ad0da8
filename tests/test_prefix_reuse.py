"""Prefix reuse across requests that share only the start of their prompts (tiny random models,
CPU): a later prompt resumes from the saved row that holds most of it, the tokens equal the
request run with no pool, and the prefilled token count drops by exactly the reused tokens.

Where the reuse comes from depends on the caches: full attention cuts a saved prompt back to
the shared tokens; a recurrent state (Qwen 3.5) or a ring that has wrapped (Gemma 3's window of
5 here) cannot be cut back, so the engine also keeps the row at each prefill chunk's end.
A TurboQuant row (``@tq``: 8-bit keys, 4-bit values) serves only prompts that share its whole
first chunk, on which its balance was calibrated.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from conftest import IdsTokenizer
from test_decode_step import prompts, tiny_model

import hf2q_mlx

CHUNK = 16
# (model, compiled) -> tokens the second prompt reuses: its 35 shared tokens where the first
# prompt's row can be cut back to them, else the last chunk boundary before them (32)
CASES = {
    ("llama", False): 35,
    ("llama", True): 35,
    ("qwen3_5-dense", False): 32,
    ("qwen3_5-dense", True): 32,
    ("gemma3", True): 32,
    ("llama@tq", False): 35,
    ("llama@tq", True): 35,
    ("gemma4-moe@tq", True): 32,
}


@pytest.fixture(autouse=True)
def on_cpu():
    with mx.stream(mx.cpu):
        yield


def run(model, compiled: bool, batch: list[list[int]], pool: bool, kv=None):
    """Each prompt in turn (the next submitted once the last is done): tokens, prefilled and
    reused token counts."""
    with hf2q_mlx.BatchGenerator(
        model, IdsTokenizer(), max_batch=2, max_len=96, prefill_chunk=CHUNK,
        prefix_cache_bytes=(64 << 20) if pool else 0, compiled=compiled, kv_bits=kv,
    ) as gen:  # fmt: skip
        out = [gen.generate([p], max_tokens=6, ignore_eos=True)[0] for p in batch]
        m = gen.engine.metrics
        return out, m.value("prefill_tokens_total"), m.value("prefix_reused_tokens_total")


@pytest.mark.parametrize("name, compiled", list(CASES))
def test_a_shared_prompt_start_is_reused(name, compiled):
    model_name, _, tq = name.partition("@")
    model, kv = tiny_model(model_name), "8,4" if tq else None
    first, tail = prompts([40, 10], seed=21)
    second = first[:35] + tail  # the first 35 tokens shared, then different
    assert second[35] != first[35]
    want, prefilled_alone, _ = run(model, compiled, [first, second], False, kv)
    got, prefilled, reused = run(model, compiled, [first, second], True, kv)
    assert got == want
    assert reused == CASES[name, compiled]
    assert prefilled == prefilled_alone - reused == len(first) + len(second) - reused


@pytest.mark.parametrize("name, kept", [("llama", 1), ("qwen3_5-dense", 5)])
def test_a_chats_earlier_turns_make_way_for_the_latest(name, kept):
    """A chat's turns, each prompt extending the last: full attention keeps only the latest
    row (it serves every earlier start, cut back), and a question after the first 20 tokens
    reuses 20 from it. Qwen 3.5 keeps every turn and chunk boundary (16, 32; 39, 49, 59 whole)."""
    model = tiny_model(name)
    turn, more, other = prompts([40, 10, 12], seed=23)
    batch = [turn, turn + more, turn + more + more, turn[:20] + other]
    with hf2q_mlx.BatchGenerator(model, IdsTokenizer(), max_batch=2, max_len=96,
                                 prefill_chunk=CHUNK) as gen:  # fmt: skip
        got = [gen.generate([p], max_tokens=4, ignore_eos=True)[0] for p in batch[:3]]
        assert len(gen.engine.pool) == kept
        reused = gen.engine.metrics.value("prefix_reused_tokens_total")
        got.append(gen.generate([batch[3]], max_tokens=4, ignore_eos=True)[0])
        reused = gen.engine.metrics.value("prefix_reused_tokens_total") - reused
        assert reused == (20 if name == "llama" else 16)
    with hf2q_mlx.BatchGenerator(model, IdsTokenizer(), max_batch=2, max_len=96,
                                 prefix_cache_bytes=0) as gen:  # fmt: skip
        assert got == [gen.generate([p], max_tokens=4, ignore_eos=True)[0] for p in batch]


@pytest.mark.parametrize("compiled", [False, True])
def test_turboquant_rows_serve_only_a_shared_first_chunk(compiled):
    """10 shared tokens, fewer than the 16 of the first chunk the saved row calibrated on: not
    reused (bf16 rows would serve them)."""
    model = tiny_model("llama")
    first, tail = prompts([40, 10], seed=22)
    second = first[:10] + tail
    assert second[10] != first[10]
    want, _, _ = run(model, compiled, [first, second], False, "8,4")
    got, _, reused = run(model, compiled, [first, second], True, "8,4")
    assert got == want and reused == 0
    assert run(model, compiled, [first, second], True)[2] == 10
