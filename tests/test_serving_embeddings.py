"""`hf2q-mlx serve` with an embedding model: ``/v1/embeddings`` through the real `openai` client
on a tiny random EmbeddingGemma-style folder (tests/test_embedding.py builds it), against
``embed`` run directly; the worker's queue, cancellation and shutdown; the refusals between a
text-generation server and an embedding one."""

from __future__ import annotations

import argparse
import base64
import threading
import time

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("fastapi", reason="pip install '.[serve]'")
pytest.importorskip("uvicorn", reason="pip install '.[serve]'")
openai = pytest.importorskip("openai", reason="pip install openai")
httpx = pytest.importorskip("httpx", reason="pip install httpx")
torch = pytest.importorskip("torch", reason="the tiny folder's weights come from transformers")

from test_embedding import DENSE, MAX_SEQ_LENGTH, tiny_hf_model, write_folder  # noqa: E402

import hf2q_mlx  # noqa: E402
from hf2q_mlx.embedding import embed, embed_token_ids, embedding_token_ids  # noqa: E402
from hf2q_mlx.errors import InvalidArgumentError, QueueFullError  # noqa: E402
from hf2q_mlx.serving.embedding_worker import EmbeddingWorker  # noqa: E402
from hf2q_mlx.serving.serve import ServerThread, _embedding_worker  # noqa: E402

MODEL_ID = "tiny-embedder"
BATCH = 2  # the worker's batch: embed() runs with the same, so the batches (and bits) match
TEXTS = ["hi", "which planet is known as the red planet", "mars: the red planet", "a fox"]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    rng = np.random.default_rng(1)
    dense = [(rng.standard_normal((o, i)) * 0.2).astype(np.float32) for i, o in DENSE]
    folder = write_folder(tmp_path_factory.mktemp("st") / MODEL_ID, tiny_hf_model(), dense)
    return hf2q_mlx.load(folder, dtype="float32")


@pytest.fixture(scope="module")
def server(loaded):
    model, tokenizer = loaded
    with ServerThread(EmbeddingWorker(model, tokenizer, batch_size=BATCH), MODEL_ID) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def direct(loaded, texts, **opts) -> np.ndarray:
    model, tokenizer = loaded
    return np.array(embed(model, tokenizer, texts, batch_size=BATCH, **opts))


def vectors(response) -> np.ndarray:
    return np.array([d.embedding for d in response.data], dtype=np.float32)


def test_openai_client_gets_embed_outputs_bit_for_bit(loaded, client):
    """The client's default request (base64 float32) and encoding_format float both give
    ``embed``'s vectors exactly, in input order, with the usage of the inputs' tokens."""
    model, tokenizer = loaded
    want = direct(loaded, TEXTS)
    got = client.embeddings.create(model=MODEL_ID, input=TEXTS)
    assert [d.index for d in got.data] == list(range(len(TEXTS))) and got.model == MODEL_ID
    np.testing.assert_array_equal(vectors(got), want)
    as_float = client.embeddings.create(model=MODEL_ID, input=TEXTS, encoding_format="float")
    np.testing.assert_array_equal(vectors(as_float), want)
    tokens = sum(len(r) for r in embedding_token_ids(model, tokenizer, TEXTS))
    assert got.usage.prompt_tokens == got.usage.total_tokens == tokens
    one = client.embeddings.create(model=MODEL_ID, input=TEXTS[1])  # a bare string
    np.testing.assert_array_equal(vectors(one)[0], direct(loaded, [TEXTS[1]])[0])


def test_dimensions_prompt_name_and_token_id_input(loaded, client):
    model, tokenizer = loaded
    got = client.embeddings.create(model=MODEL_ID, input=TEXTS, dimensions=8)
    want = direct(loaded, TEXTS, dimensions=8)
    assert vectors(got).shape == (len(TEXTS), 8)
    np.testing.assert_array_equal(vectors(got), want)
    np.testing.assert_allclose(np.linalg.norm(vectors(got), axis=1), 1.0, rtol=1e-6)
    query = client.embeddings.create(
        model=MODEL_ID, input=TEXTS, extra_body={"prompt_name": "query"}
    )
    np.testing.assert_array_equal(vectors(query), direct(loaded, TEXTS, prompt_name="query"))
    assert not np.array_equal(vectors(query), direct(loaded, TEXTS))  # the prompt counts
    ids = embedding_token_ids(model, tokenizer, TEXTS)
    by_ids = client.embeddings.create(model=MODEL_ID, input=ids)
    np.testing.assert_array_equal(vectors(by_ids), direct(loaded, TEXTS))
    single = client.embeddings.create(model=MODEL_ID, input=ids[2])  # one list of token ids
    np.testing.assert_array_equal(vectors(single)[0], direct(loaded, [TEXTS[2]])[0])


def _error(resp) -> dict:
    return resp.json()["error"]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": MODEL_ID, "input": []}, "input"),
        ({"model": MODEL_ID, "input": ""}, "input"),
        ({"model": MODEL_ID, "input": ["ok", 3]}, "input"),
        ({"model": MODEL_ID, "input": [[1, 2], []]}, "input"),
        ({"model": MODEL_ID, "input": [[5, -1]]}, "input"),
        ({"model": MODEL_ID, "input": [[5, 10**9]]}, "input"),
        ({"model": MODEL_ID, "input": [[5] * (MAX_SEQ_LENGTH + 1)]}, "input"),
        ({"model": MODEL_ID, "input": ["x"] * 2049}, "input"),
        ({"model": MODEL_ID, "input": "hi", "dimensions": 0}, "dimensions"),
        ({"model": MODEL_ID, "input": "hi", "dimensions": 25}, "dimensions"),
        ({"model": MODEL_ID, "input": "hi", "dimensions": True}, "dimensions"),
        ({"model": MODEL_ID, "input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"model": MODEL_ID, "input": "hi", "prompt_name": "nope"}, "prompt_name"),
        ({"model": MODEL_ID, "input": [[5, 6]], "prompt_name": "query"}, "prompt_name"),
        ({"model": "other", "input": "hi"}, "model"),
        ({"input": "hi"}, "model"),
    ],
)
def test_bad_embedding_requests_answer_400(server, body, param):
    resp = httpx.post(server.url + "/v1/embeddings", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    err = _error(resp)
    assert err["param"] == param and err["type"] == "invalid_request_error"


def test_embedding_server_refuses_text_generation_and_reports_health(server, client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "x"}])
    assert "embedding model" in info.value.message
    resp = httpx.post(server.url + "/v1/completions", json={"model": MODEL_ID, "prompt": "x"})
    assert resp.status_code == 400 and _error(resp)["code"] == "unsupported_endpoint"
    resp = httpx.post(
        server.url + "/v1/embeddings",
        content=b'{"model": ',
        headers={"content-type": "application/json"},
    )
    assert resp.status_code == 400 and _error(resp)["code"] == "invalid_json"
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["outstanding"] == 0
    assert [m.id for m in client.models.list().data] == [MODEL_ID]
    client.embeddings.create(model=MODEL_ID, input="ok")
    metrics = httpx.get(server.url + "/metrics").text
    assert 'requests_finished_total{reason="stop"}' in metrics


def test_concurrent_requests_each_get_their_own_vectors(loaded, server, client):
    """Eight clients at once, each with other texts: every answer is its own texts' vectors (to
    fp32 rounding: requests that wait together share forward passes, and a row's padding
    differs from its run alone)."""
    sets = [[f"{t} {i}" for t in TEXTS[: 1 + i % len(TEXTS)]] for i in range(8)]
    got: dict[int, np.ndarray] = {}

    def ask(i: int) -> None:
        got[i] = vectors(client.embeddings.create(model=MODEL_ID, input=sets[i]))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i, texts in enumerate(sets):
        np.testing.assert_allclose(got[i], direct(loaded, texts), rtol=1e-5, atol=1e-6)


def test_waiting_requests_share_forward_passes(loaded, monkeypatch):
    """Requests queued together run as one batch of their inputs: one embed call for three
    requests, each answered with its own rows of it, cut to its own dimensions and normalized
    (bit for bit what embed_token_ids + finish_vectors give those rows), close to each alone.
    A model call that fails answers every request of the batch with the error; the worker
    lives on."""
    from hf2q_mlx.embedding import finish_vectors
    from hf2q_mlx.serving import embedding_worker as ew

    model, tokenizer = loaded
    ids = embedding_token_ids(model, tokenizer, TEXTS)
    answers: dict[str, tuple] = {}
    worker = EmbeddingWorker(model, tokenizer, batch_size=8)
    jobs = [
        worker.submit(ids[:2], None, lambda v, e: answers.setdefault("a", (v, e))),
        worker.submit(ids[2:3], 6, lambda v, e: answers.setdefault("b", (v, e))),
        worker.submit(ids[3:], None, lambda v, e: answers.setdefault("c", (v, e))),
    ]
    worker.start()
    wait_for(lambda: len(answers) == 3)
    assert worker.metrics.value("embedding_batches_total") == 1
    pooled = embed_token_ids(model, ids, batch_size=8, normalize=False)
    for key, rows, dims in (
        ("a", slice(0, 2), None),
        ("b", slice(2, 3), 6),
        ("c", slice(3, 4), None),
    ):
        got, err = answers[key]
        assert err is None
        np.testing.assert_array_equal(got, np.array(finish_vectors(pooled[rows], dims)))
        alone = direct(loaded, TEXTS[rows], dimensions=dims)
        np.testing.assert_allclose(got, alone, rtol=1e-5, atol=1e-6)
    assert all(j.id.startswith("emb-") for j in jobs)

    def broken(*a, **k):
        raise RuntimeError("device lost")

    monkeypatch.setattr(ew, "embed_token_ids", broken)
    failed: list = []
    worker.submit(ids[:1], None, lambda v, e: failed.append((v, e)))
    wait_for(lambda: len(failed) == 1)
    assert failed[0][0] is None and "device lost" in failed[0][1]
    monkeypatch.undo()
    ok: list = []
    worker.submit(ids[:1], None, lambda v, e: ok.append((v, e)))
    wait_for(lambda: len(ok) == 1)
    assert ok[0][1] is None and worker.alive()
    worker.shutdown()


def wait_for(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_worker_queue_cancel_errors_and_shutdown(loaded):
    """A full queue raises QueueFullError; a request cancelled before it runs is answered
    "cancelled"; inputs the model cannot run are refused at submit; a shutdown answers what is
    still queued."""
    model, tokenizer = loaded
    ids = embedding_token_ids(model, tokenizer, TEXTS)
    answers: list[tuple] = []
    done = lambda v, e: answers.append((v, e))  # noqa: E731
    worker = EmbeddingWorker(model, tokenizer, max_queue=1, batch_size=BATCH)  # not started
    first = worker.submit(ids, None, done)
    worker.submit(ids[:1], 4, done)
    with pytest.raises(QueueFullError):
        worker.submit(ids, None, done)
    worker.cancel(first)
    worker.start()
    wait_for(lambda: len(answers) == 2)
    for bad_ids, dims in (([[10**6]], None), ([[]], None), (ids, 0), (ids, 25)):
        with pytest.raises(InvalidArgumentError):  # refused before it is queued
            worker.submit(bad_ids, dims, done)
    worker.shutdown()
    assert [a[1] for a in answers[:1]] == ["cancelled"]
    np.testing.assert_array_equal(answers[1][0], direct(loaded, TEXTS[:1], dimensions=4))
    assert worker.stats()["outstanding"] == 0 and not worker.alive()
    queued = EmbeddingWorker(model, tokenizer)
    queued.submit(ids, None, done)
    queued.shutdown()  # never started: what it holds is answered, nothing hangs
    assert answers[-1] == (None, "the server is shutting down")
    with pytest.raises(InvalidArgumentError):
        queued.submit(ids, None, done)


def test_embed_token_ids_checks_its_input(loaded):
    model, tokenizer = loaded
    ids = embedding_token_ids(model, tokenizer, TEXTS[:2])
    np.testing.assert_array_equal(
        np.array(embed_token_ids(model, [np.array(r) for r in ids], batch_size=BATCH)),
        direct(loaded, TEXTS[:2]),
    )
    for bad in ([], "abc", [[1, 2.5]], [[True]], [[]], [[-3]], [[1] * (MAX_SEQ_LENGTH + 1)]):
        with pytest.raises(InvalidArgumentError):
            embed_token_ids(model, bad)
    with pytest.raises(InvalidArgumentError):
        EmbeddingWorker(model, tokenizer, batch_size=0)
    smol = mx.array([1])  # anything without the sentence-transformers modules
    with pytest.raises(InvalidArgumentError):
        EmbeddingWorker(smol, tokenizer)


def test_serve_refuses_generation_flags_for_an_embedding_model(loaded):
    model, tokenizer = loaded
    args = argparse.Namespace(kv_bits="8", batch_prefill=False, max_len=None, max_queue=4,
                              max_batch=2, step="auto", no_warmup=False)  # fmt: skip
    with pytest.raises(InvalidArgumentError, match="--kv-bits"):
        _embedding_worker(args, model, tokenizer)
    args.kv_bits, args.batch_prefill = None, True
    with pytest.raises(InvalidArgumentError, match="--batch-prefill"):
        _embedding_worker(args, model, tokenizer)
    args.batch_prefill, args.step = False, "batched"
    with pytest.raises(InvalidArgumentError, match="--step"):
        _embedding_worker(args, model, tokenizer)
    args.step, args.no_warmup = "auto", True
    with pytest.raises(InvalidArgumentError, match="--no-warmup"):
        _embedding_worker(args, model, tokenizer)
    args.no_warmup = False
    worker = _embedding_worker(args, model, tokenizer)
    assert worker.alive() and worker.batch_size == 2 and worker.max_queue == 4
    worker.shutdown()


def test_base64_is_little_endian_float32(loaded, server):
    """What the openai client decodes: the base64 of the vectors' little-endian float32."""
    body = {"model": MODEL_ID, "input": TEXTS[:2], "encoding_format": "base64"}
    data = httpx.post(server.url + "/v1/embeddings", json=body, timeout=30).json()["data"]
    got = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in data])
    np.testing.assert_array_equal(got, direct(loaded, TEXTS[:2]))


def test_fuzz_embedding_request_bodies(loaded):
    """Request bodies of /v1/embeddings: parsed and, when accepted, embedded by a worker's
    model call; a 400-class Hf2qError or success, never another exception."""
    from hypothesis import given
    from hypothesis import strategies as st
    from test_fuzz import ANY_VALUE, FUZZ, _mostly, outcome

    from hf2q_mlx.serving import openai_embeddings as oe

    model, tokenizer = loaded
    vocab = model.args.vocab_size
    ids = st.lists(st.integers(-2, vocab + 2), min_size=0, max_size=MAX_SEQ_LENGTH + 2)
    inputs = (
        st.text(max_size=20)
        | st.lists(st.text(max_size=12), max_size=4)
        | ids
        | st.lists(ids, max_size=3)
        | ANY_VALUE
    )
    bodies = st.fixed_dictionaries(
        {"model": _mostly(st.just(MODEL_ID)), "input": inputs},
        optional={
            "encoding_format": _mostly(st.sampled_from(["float", "base64"])),
            "dimensions": _mostly(st.integers(-1, 30)),
            "prompt_name": _mostly(st.sampled_from(["query", "document"])),
            "user": ANY_VALUE,
        },
    )

    @FUZZ
    @given(body=bodies | ANY_VALUE)
    def run(body) -> None:
        def call() -> None:
            parsed = oe.parse_embeddings(body, {MODEL_ID}, model, tokenizer, 24)
            out = embed_token_ids(model, parsed.ids, batch_size=BATCH, dimensions=parsed.dimensions)
            response = oe.embeddings_response(parsed, np.array(out))
            assert len(response["data"]) == len(parsed.ids)

        outcome("OpenAI embedding bodies", call)

    run()
