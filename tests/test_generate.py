"""Generation loop on a tiny random transformer and a scripted model; perplexity and bench."""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from hf2q_mlx.cli.bench import run_bench
from hf2q_mlx.cli.perplexity import perplexity
from hf2q_mlx.errors import ContextLengthError, InvalidArgumentError, SamplingOptionsError
from hf2q_mlx.generation import (
    GenerationResponse,
    encode_prompt,
    generate,
    make_prompt_cache,
    prefill,
    stream_generate,
)
from hf2q_mlx.models.attention import attend
from hf2q_mlx.models.cache import KVCache, causal_mask

# ---------------------------------------------------------------- toy tokenizer

PIECES = ["<bos>", "<eos>", *"abcdefghijklmnopqrstuvwxyz", " ", ".", ":", "\n", "S", "T"]
PIECES += ["aS", "Tb", "ST", "he", "llo", "é"]
PIECES += [f"<w{i}>" for i in range(64 - len(PIECES))]


class ToyDetokenizer:
    def __init__(self, pieces: list[str]):
        self.pieces, self.text, self._read = pieces, "", 0

    def add_token(self, token: int) -> None:
        self.text += self.pieces[token]

    def finalize(self) -> None:
        pass

    @property
    def last_segment(self) -> str:
        segment, self._read = self.text[self._read :], len(self.text)
        return segment


class ToyTokenizer:
    """Greedy longest-match over PIECES; BOS 0, EOS 1; a 'role: content' chat template."""

    bos_token_id = 0
    eos_token_ids = {1}
    vocab_size = len(PIECES)

    def __init__(self, template_writes_bos: bool = False):
        self.template_writes_bos = template_writes_bos

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            n = max(len(p) for p in PIECES if text.startswith(p, i))
            ids.append(PIECES.index(text[i : i + n]))
            i += n
        return [0, *ids] if add_special_tokens else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(PIECES[i] for i in ids if not (skip_special_tokens and i < 2))

    def apply_chat_template(self, messages, add_generation_prompt=True, **kwargs) -> str:
        text = "<bos>" if self.template_writes_bos else ""
        text += "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + ("model:" if add_generation_prompt else "")

    def detokenizer(self) -> ToyDetokenizer:
        return ToyDetokenizer(PIECES)


# ---------------------------------------------------------------- toy models


@dataclass
class TinyArgs:
    vocab_size: int = 64
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_hidden_layers: int = 2
    max_position_embeddings: int = 256


class TinyBlock(nn.Module):
    def __init__(self, args: TinyArgs):
        super().__init__()
        d = args.hidden_size
        self.heads = args.num_attention_heads
        self.q_proj, self.k_proj = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.v_proj, self.o_proj = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.norm1, self.norm2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.rope = nn.RoPE(d // self.heads)

    def __call__(self, x: mx.array, cache: KVCache | None) -> mx.array:
        B, L, D = x.shape
        h = self.norm1(x)

        def heads(t):  # (B, L, D) -> (B, H, L, D / H)
            return t.reshape(B, L, self.heads, -1).transpose(0, 2, 1, 3)

        q, k, v = heads(self.q_proj(h)), heads(self.k_proj(h)), heads(self.v_proj(h))
        offset = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        if cache is not None:
            k, v, mask = cache.update_and_fetch(k, v)
        else:
            mask = causal_mask(L)
        scale = (D // self.heads) ** -0.5
        o = attend(q, k, v, cache, scale, mask)  # the cache owns its attention call
        x = x + self.o_proj(o.transpose(0, 2, 1, 3).reshape(B, L, D))
        return x + self.down(nn.gelu(self.up(self.norm2(x))))


class TinyModel(nn.Module):
    """A 2-layer random transformer following the model protocol."""

    def __init__(self, args: TinyArgs | None = None, seed: int = 0):
        super().__init__()
        self.args = args or TinyArgs()
        mx.random.seed(seed)
        self.embed = nn.Embedding(self.args.vocab_size, self.args.hidden_size)
        self.layers = [TinyBlock(self.args) for _ in range(self.args.num_hidden_layers)]
        self.norm = nn.RMSNorm(self.args.hidden_size)
        self.lm_head = nn.Linear(self.args.hidden_size, self.args.vocab_size, bias=False)
        # sharper logits so greedy choices are well separated
        self.lm_head.weight = self.lm_head.weight * 8

    def __call__(self, inputs: mx.array, cache: list | None = None) -> mx.array:
        x = self.embed(inputs)
        for i, layer in enumerate(self.layers):
            x = layer(x, cache[i] if cache is not None else None)
        return self.lm_head(self.norm(x))

    def make_cache(self, reserve: int = 0) -> list:
        return [KVCache() for _ in self.layers]


class ScriptedModel(nn.Module):
    """Random logits plus a large bonus on ``table[p]`` at absolute position p, so greedy
    decoding emits a chosen token sequence."""

    def __init__(self, table: list[int], vocab: int = 64):
        super().__init__()
        self.args = TinyArgs(max_position_embeddings=len(table))
        self.table = mx.array(table, mx.int32)
        self.noise = mx.random.normal((len(table), vocab), key=mx.random.key(42))
        self.layers = [None]

    def __call__(self, inputs: mx.array, cache: list | None = None) -> mx.array:
        B, L = inputs.shape
        offset = cache[0].offset if cache is not None else 0
        if cache is not None:
            dummy = mx.zeros((B, 1, L, 1))
            cache[0].update_and_fetch(dummy, dummy)
        pos = mx.arange(offset, offset + L)
        bonus = 20.0 * (mx.arange(self.noise.shape[1])[None] == self.table[pos][:, None])
        return mx.broadcast_to(self.noise[pos] + bonus, (B, L, self.noise.shape[1]))

    def make_cache(self, reserve: int = 0) -> list:
        return [KVCache()]


TOK = ToyTokenizer()


def scripted(prompt: list[int], script: list[str], extra: int = 8) -> ScriptedModel:
    """A model whose greedy continuation of ``prompt`` is the pieces in ``script``."""
    out = [PIECES.index(s) for s in script]
    table = [2] * (len(prompt) - 1) + out + [2] * extra
    return ScriptedModel(table)


def texts(responses: list[GenerationResponse]) -> list[str]:
    return [r.text for r in responses]


# ---------------------------------------------------------------- prefill and decode


@pytest.mark.parametrize("step", [1, 5, 16, 64])
def test_chunked_prefill_matches_one_shot(step):
    model = TinyModel(seed=1)
    tokens = mx.random.randint(2, 64, (37,), key=mx.random.key(2)).astype(mx.int32)
    want = model(tokens[None])[:, -1, :]
    got = prefill(model, tokens, model.make_cache(), step)
    assert got.shape == (1, 64)
    # same fp32 math in a different association (cached vs full keys): rounding only
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)


def _reference_greedy(model, prompt: list[int], n: int, penalty: float = 1.0, ctx: int = 20):
    """Greedy tokens and their logprobs by full no-cache forwards (and numpy penalty math)."""
    seq, out, lps = list(prompt), [], []
    for _ in range(n):
        logits = np.array(model(mx.array([seq], mx.int32))[0, -1], dtype=np.float64)
        if penalty != 1.0:
            for t in set(seq[-ctx:]):
                logits[t] = logits[t] / penalty if logits[t] > 0 else logits[t] * penalty
        logp = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
        t = int(np.argmax(logp))
        out.append(t)
        lps.append(logp[t])
        seq.append(t)
    return out, lps


def test_greedy_decode_matches_full_forward():
    model = TinyModel(seed=3)
    prompt = [0, 5, 9, 12, 30, 7, 7, 21]
    responses = list(
        stream_generate(model, TOK, prompt, max_tokens=12, ignore_eos=True, prefill_step_size=3)
    )
    want, want_lp = _reference_greedy(model, prompt, 12)
    assert [r.token for r in responses] == want
    # fp32 log-softmax vs the float64 reference on the same fp32 logits
    np.testing.assert_allclose([r.logprob for r in responses], want_lp, rtol=1e-4, atol=1e-4)


def test_repetition_penalty_in_decode_matches_reference():
    model = TinyModel(seed=4)
    prompt = [0, 3, 4, 3, 4, 3]
    got = [
        r.token
        for r in stream_generate(
            model,
            TOK,
            prompt,
            max_tokens=10,
            repetition_penalty=1.8,
            repetition_context_size=6,
            ignore_eos=True,
        )
    ]
    want, _ = _reference_greedy(model, prompt, 10, penalty=1.8, ctx=6)
    assert got == want
    plain, _ = _reference_greedy(model, prompt, 10)
    assert got != plain  # the penalty changed the continuation


def test_response_fields_and_text():
    model = TinyModel(seed=5)
    responses = list(stream_generate(model, TOK, "hello", max_tokens=6, ignore_eos=True))
    assert [r.generation_tokens for r in responses] == list(range(1, 7))
    assert all(r.prompt_tokens == len(TOK.encode("hello")) for r in responses)
    assert [r.finish_reason for r in responses] == [None] * 5 + ["length"]
    assert all(r.prompt_tps > 0 and r.peak_memory >= 0 for r in responses)
    assert responses[0].generation_tps == 0.0 and responses[-1].generation_tps > 0
    assert all(r.logprob <= 0 for r in responses)
    assert "".join(texts(responses)) == TOK.decode([r.token for r in responses])
    assert generate(model, TOK, "hello", max_tokens=6, ignore_eos=True) == "".join(texts(responses))


def test_seeded_sampling_reproduces():
    model = TinyModel(seed=6)

    def run(seed):
        opts = dict(max_tokens=16, temperature=1.5, seed=seed, ignore_eos=True)
        return [r.token for r in stream_generate(model, TOK, [0, 9, 8], **opts)]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_eos_ends_generation():
    prompt = [0, 2, 3]
    model = scripted(prompt, ["a", "b", "<eos>", "c", "d"])
    responses = list(stream_generate(model, TOK, prompt, max_tokens=10))
    assert [r.token for r in responses] == [2, 3, 1]
    assert texts(responses) == ["a", "b", ""]
    assert [r.finish_reason for r in responses] == [None, None, "stop"]
    # ignore_eos runs through it to max_tokens
    more = list(stream_generate(model, TOK, prompt, max_tokens=5, ignore_eos=True))
    assert [r.token for r in more] == [2, 3, 1, PIECES.index("c"), PIECES.index("d")]
    assert more[-1].finish_reason == "length"


def test_max_tokens():
    prompt = [0, 2]
    model = scripted(prompt, list("abcdef"))
    responses = list(stream_generate(model, TOK, prompt, max_tokens=3))
    assert texts(responses) == ["a", "b", "c"]
    assert responses[-1].finish_reason == "length"
    with pytest.raises(SamplingOptionsError, match="max_tokens"):
        stream_generate(model, TOK, prompt, max_tokens=0)


@pytest.mark.parametrize(
    "script, stop, emitted, final",
    [
        # "S" is held until "T" completes the stop string
        (["x", "y", "S", "T", "z"], "ST", ["x", "y", "", ""], "xy"),
        # the stop string straddles two multi-character tokens
        (["he", "aS", "Tb", "c"], "ST", ["he", "a", ""], "hea"),
        # a held "S" that turns out not to start the stop string is released
        (["S", "a", "S", "T"], "ST", ["", "Sa", "", ""], "Sa"),
        # several stop strings; the one that matches spans a token boundary
        (["x", "aS", "T"], ["q", "aST"], ["x", "", ""], "x"),
        # text before a possible stop string inside the same token still comes out
        (["he", "llo", "."], ["lo."], ["he", "l", ""], "hel"),
    ],
)
def test_stop_strings_are_held_back_and_never_emitted(script, stop, emitted, final):
    prompt = [0, 5]
    model = scripted(prompt, script)
    responses = list(stream_generate(model, TOK, prompt, max_tokens=10, stop=stop))
    assert texts(responses) == emitted
    assert "".join(texts(responses)) == final
    assert responses[-1].finish_reason == "stop"


def test_held_text_is_flushed_at_length():
    prompt = [0, 5]
    model = scripted(prompt, ["a", "S"])
    responses = list(stream_generate(model, TOK, prompt, max_tokens=2, stop="ST"))
    assert texts(responses) == ["a", "S"]
    assert responses[-1].finish_reason == "length"


def test_context_length():
    prompt = [0] + [5] * 11  # 12 tokens
    model = scripted(prompt, list("abcd"), extra=0)  # context of 15 positions
    with pytest.raises(ContextLengthError):
        stream_generate(model, TOK, prompt + [5] * 4, max_tokens=1)
    responses = list(stream_generate(model, TOK, prompt, max_tokens=100))
    # positions 12..14 can be fed, the last position's logits give one more token
    assert len(responses) == 4 and responses[-1].finish_reason == "length"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -1.0},
        {"max_tokens": -1},
        {"top_p": 0.0},
        {"stop": [""]},
        {"prefill_step_size": 0},
        {"prompt": []},
        {"prompt": [1.5, 2.0]},
    ],
)
def test_bad_options_raise_at_call(kwargs):
    model = TinyModel(seed=7)
    prompt = kwargs.pop("prompt", "abc")
    with pytest.raises(InvalidArgumentError):
        stream_generate(model, TOK, prompt, **kwargs)  # not iterated: raises eagerly


@pytest.mark.parametrize("writes_bos", [False, True])
def test_chat_messages_prompt(writes_bos):
    tok = ToyTokenizer(template_writes_bos=writes_bos)
    messages = [{"role": "user", "content": "hello"}]
    ids = encode_prompt(tok, messages)
    assert ids[0] == 0 and ids[1] != 0
    assert tok.decode(ids) == "<bos>user: hello\nmodel:"


def test_cache_continues_a_sequence():
    model = TinyModel(seed=8)
    prompt = [0, 11, 12, 13]
    first = [r.token for r in stream_generate(model, TOK, prompt, max_tokens=4, ignore_eos=True)]
    cache = make_prompt_cache(model)
    part = [
        r.token
        for r in stream_generate(model, TOK, prompt, max_tokens=2, cache=cache, ignore_eos=True)
    ]
    # the cache holds the prompt and the first generated token (the last one is never fed)
    assert cache[0].offset == len(prompt) + 1
    rest = [
        r.token
        for r in stream_generate(model, TOK, [part[1]], max_tokens=2, cache=cache, ignore_eos=True)
    ]
    assert part + rest == first


def test_token_id_prompts_of_any_integer_kind():
    want = [0, 3, 4]
    for prompt in (want, tuple(want), np.array(want), mx.array(want)):
        assert encode_prompt(TOK, prompt) == want


# ---------------------------------------------------------------- perplexity and bench


def _reference_nll(model, windows: list[list[int]]) -> tuple[float, int]:
    total, n = 0.0, 0
    for w in windows:
        logits = np.array(model(mx.array([w], mx.int32))[0], dtype=np.float64)
        for i in range(1, len(w)):
            row = logits[i - 1]
            total += np.log(np.exp(row - row.max()).sum()) + row.max() - row[w[i]]
            n += 1
    return total, n


@pytest.mark.parametrize("batch_size", [1, 2, 3])
def test_perplexity_windows(batch_size):
    model = TinyModel(seed=9)
    tokens = np.random.default_rng(0).integers(2, 64, size=45).tolist()
    result = perplexity(model, tokens, context=8, batch_size=batch_size)
    windows = [tokens[i : i + 8] for i in range(0, 45, 8)]  # 5 full + one of 5
    total, n = _reference_nll(model, windows)
    assert result.n_tokens == n == 5 * 7 + 4
    # fp32 log-softmax sums against a float64 reference on the same logits
    assert math.isclose(result.nll, total / n, rel_tol=1e-5)
    assert math.isclose(result.ppl, math.exp(total / n), rel_tol=1e-5)


def test_perplexity_with_bos_per_window():
    model = TinyModel(seed=10)
    tokens = np.random.default_rng(1).integers(2, 64, size=20).tolist()
    result = perplexity(model, tokens, context=8, bos_token_id=0)
    windows = [[0, *tokens[i : i + 7]] for i in range(0, 20, 7)]
    total, n = _reference_nll(model, windows)
    assert result.n_tokens == n == 20
    assert math.isclose(result.nll, total / n, rel_tol=1e-5)
    with pytest.raises(SamplingOptionsError):
        perplexity(model, [5], context=8)


def test_bench_reports_speeds():
    model = TinyModel(seed=11)
    result = run_bench(model, TOK, prompt_tokens=24, gen_tokens=6)
    assert result["prompt_tokens"] == 24 and result["gen_tokens"] == 6
    assert result["prompt_tps"] > 0 and result["decode_tps"] > 0 and result["ttft_s"] > 0
    assert result["decode_step_ops"] > 10
    assert result["model"]["num_hidden_layers"] == 2
    with pytest.raises(SamplingOptionsError):
        run_bench(model, TOK, prompt_tokens=0)


def test_bench_and_perplexity_progress_bars(capsys):
    model = TinyModel(seed=11)
    run_bench(model, TOK, prompt_tokens=8, gen_tokens=3, progress=True)
    err = capsys.readouterr().err
    assert "bench" in err and "11/11" in err  # prompt + generated tokens, with tqdm's ETA
    perplexity(model, list(range(2, 40)), context=8, progress=True)
    err = capsys.readouterr().err
    assert "perplexity" in err and "33/33" in err  # 38 tokens in windows of 8: 33 scored
    run_bench(model, TOK, prompt_tokens=8, gen_tokens=3)
    perplexity(model, list(range(2, 40)), context=8)
    assert capsys.readouterr().err == ""


# ---------------------------------------------------------------- real model


@pytest.fixture(scope="module")
def gemma3(gemma3_gguf_path):
    from hf2q_mlx.io.loader import load

    return load(gemma3_gguf_path)


@pytest.mark.real_model
def test_real_model_decode_matches_full_forward(gemma3):
    model, tokenizer = gemma3
    messages = [{"role": "user", "content": "Name a large city in Europe."}]
    # the base Gemma 3 270M has only the generic built-in template: a warning says so
    with pytest.warns(UserWarning, match="no chat template"):
        responses = list(stream_generate(model, tokenizer, messages, max_tokens=3, ignore_eos=True))
        prompt = encode_prompt(tokenizer, messages)
    tokens = [r.token for r in responses]
    assert prompt.count(tokenizer.bos_token_id) == 1 and responses[0].prompt_tokens == len(prompt)
    # one no-cache forward over prompt + generated: greedy tokens are its argmaxes
    logits = model(mx.array([prompt + tokens[:-1]], mx.int32))[0, len(prompt) - 1 :]
    logits = logits.astype(mx.float32)
    assert mx.argmax(logits, axis=-1).tolist() == tokens
    want = (logits - mx.logsumexp(logits, axis=-1, keepdims=True))[mx.arange(3), mx.array(tokens)]
    # fp32 with cached vs full attention: rounding-level differences only
    np.testing.assert_allclose([r.logprob for r in responses], np.array(want), atol=2e-3)
    assert "".join(texts(responses)) == tokenizer.decode(tokens)


def test_kv_bits_selects_turboquant_cache():
    from hf2q_mlx.generation import make_prompt_cache, parse_kv_bits
    from hf2q_mlx.models.turboquant.cache import TQKVCache

    model = TinyModel(seed=5)
    assert parse_kv_bits("8,4") == (8, 4) and parse_kv_bits(6) == (6, 6)
    cache = make_prompt_cache(model, (8, 4))
    assert all(isinstance(c, TQKVCache) for c in cache)
    prompt = [0, 5, 9, 12, 30, 7, 7, 21]
    fp = list(stream_generate(model, TOK, prompt, max_tokens=6, ignore_eos=True))
    tq = list(stream_generate(model, TOK, prompt, max_tokens=6, ignore_eos=True, kv_bits=8))
    assert len(tq) == 6 and cache[0].offset == 0
    # 8-bit keys/values move the first token's log-probability by far less than 0.05 nats
    assert tq[0].token == fp[0].token and abs(tq[0].logprob - fp[0].logprob) < 0.05


@pytest.mark.parametrize("bad", [7, (8, 1), "8,x", (4, 4, 4)])
def test_bad_kv_bits_raise(bad):
    with pytest.raises(SamplingOptionsError):
        stream_generate(TinyModel(seed=0), TOK, [0, 1, 2], kv_bits=bad)
