"""`hf2q-mlx serve` end to end: a live server on a free port (one per module), the real `openai`
client, SmolLM2-135M-Instruct Q4_1 on the CPU. Greedy outputs are checked against
``stream_generate`` run alone, token for token."""

from __future__ import annotations

import json
import threading
import time

import pytest

pytest.importorskip("fastapi", reason="pip install '.[serve]'")
pytest.importorskip("uvicorn", reason="pip install '.[serve]'")
openai = pytest.importorskip("openai", reason="pip install openai")
httpx = pytest.importorskip("httpx", reason="pip install httpx")

from hf2q_mlx.generation import encode_prompt, stream_generate  # noqa: E402
from hf2q_mlx.io.loader import load  # noqa: E402
from hf2q_mlx.serving.engine import Engine  # noqa: E402
from hf2q_mlx.serving.sequential_step import SequentialStep  # noqa: E402
from hf2q_mlx.serving.serve import ServerThread  # noqa: E402

pytestmark = pytest.mark.real_model

MODEL_ID = "smollm2-test"
MAX_LEN = 256
CHAT = [{"role": "user", "content": "Name a fruit."}]


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf_path):
    return load(smollm2_gguf_path)


@pytest.fixture(scope="module")
def server(smollm2):
    model, tokenizer = smollm2
    engine = Engine(model, tokenizer, max_batch=4, max_queue=16, max_len=MAX_LEN, prefill_chunk=64)
    with ServerThread(engine, MODEL_ID) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def reference(smollm2, prompt, max_tokens: int, **opts) -> tuple[list[int], str]:
    model, tokenizer = smollm2
    out = list(stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, **opts))
    return [r.token for r in out], "".join(r.text for r in out)


def metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    for line in text.splitlines():
        if line.startswith(f"hf2q_{name} "):
            return float(line.split()[-1])
    return 0.0


def wait_idle(server, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(server.url + "/health").json()
        if health["running"] == 0 and health["outstanding"] == 0 or time.monotonic() > deadline:
            return health
        time.sleep(0.05)


def test_models_health_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL_ID]
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok"
    text = httpx.get(server.url + "/metrics").text
    for name in ("queue_depth", "batch_occupancy", "generation_tokens_per_second",
                 "time_to_first_token_seconds_bucket"):  # fmt: skip
        assert f"hf2q_{name}" in text


def test_chat_non_streaming_and_streaming_equal_generate(smollm2, client):
    _, tokenizer = smollm2
    tokens, text = reference(smollm2, CHAT, 6)
    r = client.chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=6, temperature=0)
    assert r.choices[0].message.content == text
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == ("stop" if len(tokens) < 6 else "length")
    prompt_len = len(encode_prompt(tokenizer, CHAT))
    assert r.usage.prompt_tokens == prompt_len and r.usage.completion_tokens == len(tokens)

    chunks = list(
        client.chat.completions.create(
            model=MODEL_ID, messages=CHAT, max_completion_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(deltas) == text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == r.choices[0].finish_reason and all(f is None for f in finishes[:-1])
    assert chunks[-1].usage.completion_tokens == len(tokens)


def test_completions_logprobs_match_stream_generate(smollm2, client):
    model, tokenizer = smollm2
    prompt = "The capital of France is"
    ref = list(stream_generate(model, tokenizer, prompt, max_tokens=4))
    r = client.completions.create(
        model=MODEL_ID, prompt=prompt, max_tokens=4, temperature=0, logprobs=3
    )
    choice = r.choices[0]
    assert choice.text == "".join(x.text for x in ref)
    lp = choice.logprobs
    assert len(lp.token_logprobs) == len(ref)
    for mine, theirs in zip(lp.token_logprobs, ref):
        assert abs(mine - theirs.logprob) <= 1e-4  # same fp32 logits, log-softmax on another shape
    for top, chosen in zip(lp.top_logprobs, lp.token_logprobs):
        assert len(top) == 3 and max(top.values()) == pytest.approx(chosen, abs=1e-6)  # greedy

    streamed = client.completions.create(
        model=MODEL_ID, prompt=prompt, max_tokens=4, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == choice.text

    # a stop string cut from the middle of that text: never emitted, finish_reason "stop"
    assert len(choice.text) >= 4
    stop = choice.text[2:4]
    r = client.completions.create(
        model=MODEL_ID, prompt=prompt, max_tokens=4, temperature=0, stop=[stop]
    )
    assert r.choices[0].text == choice.text[: choice.text.find(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_eight_concurrent_mixed_sampling(smollm2, server, client):
    prompts = ["The sky is", "My favourite food", "Water boils at", "One, two,"]
    refs = [reference(smollm2, p, 4)[1] for p in prompts]
    sampled = [
        dict(temperature=0.9, top_p=0.9, seed=1),
        dict(temperature=0.7, seed=2, presence_penalty=0.5, extra_body={"top_k": 20}),
        dict(temperature=1.0, seed=3, frequency_penalty=1.0, extra_body={"min_p": 0.05}),
        dict(temperature=0.5, seed=4, top_p=0.8, extra_body={"top_k": 5, "min_p": 0.1}),
    ]
    results: dict[int, str] = {}

    def run(i: int) -> None:
        opts = dict(temperature=0) if i < 4 else sampled[i - 4]
        r = client.completions.create(model=MODEL_ID, prompt=prompts[i % 4], max_tokens=4, **opts)
        results[i] = r.choices[0].text

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert sorted(results) == list(range(8))
    for i in range(4):
        assert results[i] == refs[i], f"greedy stream {i} differs from generate alone"
    # a seeded request draws the same tokens alone as inside the batch (per-row keys)
    alone = client.completions.create(model=MODEL_ID, prompt=prompts[0], max_tokens=4, **sampled[0])
    assert alone.choices[0].text == results[4]
    assert wait_idle(server)["running"] == 0


def test_disconnect_mid_stream_frees_the_slot(server):
    before = metric(server, "client_disconnects_total")
    body = {"model": MODEL_ID, "messages": CHAT, "max_tokens": 200, "temperature": 0,
            "stream": True, "ignore_eos": True}  # fmt: skip
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", server.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            got = [next(lines) for _ in range(3)]  # role chunk, blank line, first token
            assert got[0].startswith("data: ")
            assert httpx.get(server.url + "/health").json()["running"] == 1
    health = wait_idle(server, timeout=20)
    assert health["running"] == 0 and health["outstanding"] == 0
    assert metric(server, "client_disconnects_total") == before + 1


def _error(resp) -> dict:
    body = resp.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize(
    "body, param, code",
    [
        ({"model": "nope", "messages": CHAT}, "model", "model_not_found"),
        ({"model": MODEL_ID, "messages": CHAT, "temperature": -1}, "temperature", None),
        ({"model": MODEL_ID, "messages": CHAT, "top_p": 1.5}, "top_p", None),
        ({"model": MODEL_ID, "messages": CHAT, "max_tokens": 0}, "max_tokens", None),
        ({"model": MODEL_ID, "messages": CHAT, "n": 0}, "n", None),
        ({"model": MODEL_ID, "messages": CHAT, "logit_bias": {"12": 101}}, "logit_bias", None),
        ({"model": MODEL_ID, "messages": CHAT, "logit_bias": {"x": 1}}, "logit_bias", None),
        ({"model": MODEL_ID, "messages": CHAT, "logit_bias": {"²": 1}}, "logit_bias", None),
        ({"model": MODEL_ID, "messages": CHAT, "logit_bias": {"99999999": 1}}, "logit_bias",
         None),
        ({"model": MODEL_ID, "messages": CHAT, "response_format": {"type": "json_object"}},
         "response_format", "unsupported"),
        ({"model": MODEL_ID, "messages": CHAT, "repetition_penalty": 1.2}, "repetition_penalty",
         "unsupported"),
        ({"model": MODEL_ID, "messages": CHAT, "n": 21}, "n", None),  # 4 rows + 16 queued
        ({"model": MODEL_ID, "messages": []}, "messages", None),
        ({"model": MODEL_ID, "messages": CHAT, "top_logprobs": 30, "logprobs": True},
         "top_logprobs", None),
        ({"model": MODEL_ID, "messages": [{"role": "user", "content": "x " * 400}]},
         "messages", "context_length_exceeded"),
    ],
)  # fmt: skip
def test_bad_requests_answer_400(server, body, param, code):
    resp = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == 400
    err = _error(resp)
    assert err["param"] == param and err["code"] == code and err["type"] == "invalid_request_error"


def test_malformed_json_and_openai_client_errors(server, client):
    resp = httpx.post(
        server.url + "/v1/completions",
        content=b'{"model": "x", "prompt": ',
        headers={"content-type": "application/json"},
    )
    assert resp.status_code == 400 and _error(resp)["code"] == "invalid_json"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="other", prompt="hi", max_tokens=2)
    assert info.value.status_code == 400 and "not served" in info.value.message
    assert wait_idle(server)["outstanding"] == 0  # no request leaked into the engine


def test_generation_server_refuses_embeddings(server, client):
    """/v1/embeddings belongs to a server of an embedding model: 400, and nothing queued."""
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=MODEL_ID, input="hi")
    assert "embedding model" in info.value.message
    resp = httpx.post(server.url + "/v1/embeddings", json={"model": MODEL_ID, "input": "hi"})
    assert resp.status_code == 400 and _error(resp)["code"] == "unsupported_endpoint"
    assert wait_idle(server)["outstanding"] == 0


def test_queue_full_answers_429(smollm2):
    model, tokenizer = smollm2
    step = SequentialStep(model, 1, MAX_LEN)
    engine = Engine(model, tokenizer, max_batch=1, max_queue=1, max_len=MAX_LEN, step=step)
    body = {"model": MODEL_ID, "prompt": "Hi", "max_tokens": 100, "stream": True,
            "ignore_eos": True, "temperature": 0}  # fmt: skip
    with ServerThread(engine, MODEL_ID) as srv, httpx.Client(timeout=60) as h:
        with h.stream("POST", srv.url + "/v1/completions", json=body) as a:
            with h.stream("POST", srv.url + "/v1/completions", json=body) as b:
                assert a.status_code == 200 and b.status_code == 200
                c = h.post(srv.url + "/v1/completions", json=body)
                assert c.status_code == 429 and c.headers["retry-after"] == "1"
                err = c.json()["error"]
                assert err["type"] == "rate_limit_exceeded" and "retry" in err["message"]
        assert wait_idle(srv)["outstanding"] == 0
        ok = h.post(srv.url + "/v1/completions", json={**body, "stream": False, "max_tokens": 2})
        assert ok.status_code == 200  # served again once the slots are free


def test_prefix_reuse_same_tokens_and_skips_prefill(smollm2, server, client):
    model, tokenizer = smollm2
    system = "You are a terse assistant. " * 3
    first = [{"role": "system", "content": system}, {"role": "user", "content": "Pick a number."}]
    n = len(encode_prompt(tokenizer, first))
    _, ref_text = reference(smollm2, first, 4)

    def run(messages) -> tuple[str, float, float, int]:
        p0, r0 = (
            metric(server, "prefill_tokens_total"),
            metric(server, "prefix_reused_tokens_total"),
        )
        r = client.chat.completions.create(
            model=MODEL_ID, messages=messages, max_tokens=4, temperature=0
        )
        wait_idle(server)
        cached = r.usage.prompt_tokens_details.cached_tokens
        return (r.choices[0].message.content, metric(server, "prefill_tokens_total") - p0,
                metric(server, "prefix_reused_tokens_total") - r0, cached)  # fmt: skip

    # a prompt never seen: prefilled but for the chat template's opening tokens, which earlier
    # tests' prompts saved too
    text1, prefilled1, reused1, cached1 = run(first)
    assert text1 == ref_text and prefilled1 == n - reused1 and reused1 == cached1 < 8
    # the same prompt again: only the last token is computed, the output is the same
    text2, prefilled2, reused2, cached2 = run(first)
    assert text2 == ref_text and prefilled2 == 1 and reused2 == n - 1 == cached2
    # a longer conversation that starts with the first prompt reuses it and matches generate
    longer = first + [{"role": "assistant", "content": text1}, {"role": "user", "content": "Why?"}]
    ids = encode_prompt(tokenizer, longer)
    assert ids[: n - 1] == encode_prompt(tokenizer, first)[: n - 1]
    _, ref_longer = reference(smollm2, longer, 4)
    text3, prefilled3, reused3, _ = run(longer)
    assert text3 == ref_longer and reused3 == n - 1 and prefilled3 == len(ids) - (n - 1)
    # another question after the same system prompt: the saved rows' shared start is reused
    other = [first[0], {"role": "user", "content": "Name a colour."}]
    ids4 = encode_prompt(tokenizer, other)
    shared = 0
    while shared < len(ids4) - 1 and ids4[shared] == ids[shared]:
        shared += 1
    assert len(encode_prompt(tokenizer, first[:1])) - 1 <= shared < n - 1  # the system turn
    _, ref_other = reference(smollm2, other, 4)
    text4, prefilled4, reused4, cached4 = run(other)
    assert text4 == ref_other and reused4 == shared == cached4
    assert prefilled4 == len(ids4) - shared


def test_logit_bias_steers_the_tokens(smollm2, client):
    """+100 on one token: a greedy stream is that token throughout; -100 on the reference's
    first token: the stream starts otherwise (and equals generate with that token banned)."""
    model, tokenizer = smollm2
    ids, _ = reference(smollm2, CHAT, 4)
    forced = tokenizer.encode(" banana", add_special_tokens=False)[0]
    r = client.chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=3,
                                       temperature=0, logit_bias={str(forced): 100})  # fmt: skip
    assert r.choices[0].message.content == tokenizer.decode([forced] * 3)
    r = client.completions.create(model=MODEL_ID, prompt=encode_prompt(tokenizer, CHAT),
                                  max_tokens=1, temperature=0, logprobs=0,
                                  logit_bias={str(ids[0]): -100})  # fmt: skip
    assert r.choices[0].logprobs.tokens[0] != tokenizer.decode([ids[0]])
    ok = client.chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=1,
                                        response_format={"type": "text"}, temperature=0,
                                        extra_body={"repetition_penalty": 1.0})  # fmt: skip
    assert ok.choices[0].finish_reason == "length"
    # a top-k past the vocabulary (valid: it keeps it all) once failed the engine's whole step
    wide = client.chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=2, seed=1,
                                          temperature=1.0, extra_body={"top_k": 2**31})  # fmt: skip
    assert wide.choices[0].finish_reason in ("length", "stop")


def test_n_choices_share_one_prefill_and_repeat_alone(smollm2, server, client):
    """n = 3 seeded sampled choices: choice i equals the request alone with seed + i; the
    prompt is prefilled once (the other choices compute only its last token); usage counts the
    prompt once. Streamed, each chunk names its choice and the texts are the same."""
    messages = [{"role": "user", "content": "Write one word about the sea, please."}]
    opts = dict(model=MODEL_ID, messages=messages, max_tokens=5, temperature=0.9, seed=40)
    runs = [client.chat.completions.create(**{**opts, "seed": 40 + i}) for i in range(3)]
    alone = [run.choices[0].message.content for run in runs]
    assert len(set(alone)) > 1  # the seeds give different samples: the check below can fail
    wait_idle(server)
    n_prompt = len(encode_prompt(smollm2[1], messages))
    p0, r0 = metric(server, "prefill_tokens_total"), metric(server, "prefix_reused_tokens_total")
    r = client.chat.completions.create(**opts, n=3)
    wait_idle(server)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.message.content for c in r.choices] == alone
    assert r.usage.prompt_tokens == n_prompt
    assert r.usage.completion_tokens == sum(run.usage.completion_tokens for run in runs)
    assert r.usage.total_tokens == n_prompt + r.usage.completion_tokens
    # the three seeded requests above saved this prompt: every choice reuses it whole
    assert metric(server, "prefix_reused_tokens_total") - r0 == 3 * (n_prompt - 1)
    assert metric(server, "prefill_tokens_total") - p0 == 3

    texts = ["", "", ""]
    finishes = [None, None, None]
    for chunk in client.chat.completions.create(**opts, n=3, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finishes[c.index] = c.finish_reason or finishes[c.index]
    assert texts == alone and None not in finishes


def test_n_choices_prefill_a_new_prompt_once(smollm2, server, client):
    prompt = "Seven unusual words about mountains:"
    p0 = metric(server, "prefill_tokens_total")
    r = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=3, n=2, seed=1)
    wait_idle(server)
    n_prompt = r.usage.prompt_tokens
    assert [c.index for c in r.choices] == [0, 1]
    assert 2 <= r.usage.completion_tokens <= 6  # 1..3 each
    # the first choice prefills the prompt, the second waits for it and computes its last token
    assert metric(server, "prefill_tokens_total") - p0 == n_prompt + 1


def test_metrics_count_requests_and_ttft(server):
    text = httpx.get(server.url + "/metrics").text
    count = [
        ln for ln in text.splitlines() if ln.startswith("hf2q_time_to_first_token_seconds_count")
    ]
    assert float(count[0].split()[-1]) >= 1
    assert metric(server, "requests_total") >= 1
    assert json.loads(httpx.get(server.url + "/health").text)["status"] == "ok"


def test_batch_generator_through_decode_step(smollm2):
    """The compiled batched step (the GPU default), forced on here: outputs equal generate's,
    prefix reuse restores a saved row, a cancel ends a stream."""
    import hf2q_mlx
    from hf2q_mlx.decode_step import DecodeStep

    model, tokenizer = smollm2
    prompts = ["The sky is", [{"role": "user", "content": "Hi!"}]]
    refs = [reference(smollm2, p, 4)[1] for p in prompts]
    with hf2q_mlx.BatchGenerator(model, tokenizer, max_batch=2, max_len=96, compiled=True) as gen:
        assert isinstance(gen.engine.step, DecodeStep)
        assert gen.generate(prompts, max_tokens=4) == refs
        reused = gen.engine.metrics.value("prefix_reused_tokens_total")
        assert gen.generate(prompts[:1], max_tokens=4) == refs[:1]  # from the prefix pool
        assert gen.engine.metrics.value("prefix_reused_tokens_total") > reused
        uid = gen.submit("Once upon a time", max_tokens=60, ignore_eos=True)
        seen = []
        for r in gen.results([uid]):
            seen.append(r)
            if len(seen) == 2:
                gen.cancel(uid)
        assert seen[-1].finish_reason == "cancelled" and len(seen) < 10
        assert gen.engine.stats()["running"] == 0


def test_batch_generator_turboquant_through_decode_step(smollm2):
    """``kv_bits`` on the compiled batched step: TurboQuant rows, each calibrated on its own
    prompt, give what generate gives alone with the same cache (batched with another request,
    and again from the prefix pool, which keeps the packed rows and their balance)."""
    import hf2q_mlx
    from hf2q_mlx.decode_step import DecodeStep
    from hf2q_mlx.models.static_cache import StaticTQCache

    model, tokenizer = smollm2
    prompts = ["The capital of France is", "Once upon a time"]
    refs = [reference(smollm2, p, 6, kv_bits=8)[1] for p in prompts]
    opts = dict(max_batch=2, max_len=96, compiled=True, kv_bits=8)
    with hf2q_mlx.BatchGenerator(model, tokenizer, **opts) as gen:
        step = gen.engine.step
        assert isinstance(step, DecodeStep)
        assert all(isinstance(s, StaticTQCache) for s in step.caches)
        assert gen.generate(prompts, max_tokens=6) == refs
        reused = gen.engine.metrics.value("prefix_reused_tokens_total")
        assert gen.generate(prompts[1:], max_tokens=6) == refs[1:]
        assert gen.engine.metrics.value("prefix_reused_tokens_total") > reused
        # a longer prompt whose first chunk the saved one does not hold whole: calibrated on its
        # own first chunk, as alone, so the saved row is not reused
        reused = gen.engine.metrics.value("prefix_reused_tokens_total")
        longer = prompts[1] + " there lived a"
        assert gen.generate([longer], max_tokens=6) == [reference(smollm2, longer, 6, kv_bits=8)[1]]
        assert gen.engine.metrics.value("prefix_reused_tokens_total") == reused
