"""The OpenAI-compatible HTTP server (FastAPI): completions, chat completions, models, health,
metrics, and embeddings when the model is an embedding model. Handlers never touch MLX: they
tokenize, submit to the engine (or embedding worker) thread and await what it sends back through
``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from hf2q_mlx.errors import ContextLengthError, Hf2qError, QueueFullError
from hf2q_mlx.serving import openai_api as oa
from hf2q_mlx.serving import openai_embeddings as oe
from hf2q_mlx.serving.embedding_worker import EmbeddingWorker
from hf2q_mlx.serving.engine import Engine, Event

DISCONNECT_POLL_S = 0.5


def _error(status: int, err: Exception, kind: str = "invalid_request_error") -> JSONResponse:
    body = oa.error_body(err, kind)
    if isinstance(err, ContextLengthError):
        body["error"]["code"] = "context_length_exceeded"
        body["error"]["param"] = body["error"]["param"] or "messages"
    return JSONResponse(body, status_code=status)


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def create_app(engine: Engine | EmbeddingWorker, model_id: str) -> FastAPI:
    """The app serving ``engine`` under the model name ``model_id``: text generation through an
    ``Engine``, or ``/v1/embeddings`` through an ``EmbeddingWorker``."""
    app = FastAPI(title="hf2q-mlx", docs_url=None, redoc_url=None)
    embeddings_only = isinstance(engine, EmbeddingWorker)
    tokenizer = engine.tokenizer
    model_ids = {model_id}
    metrics = engine.metrics
    created = int(time.time())

    @app.exception_handler(Hf2qError)
    async def on_hf2q_error(request: Request, err: Hf2qError) -> JSONResponse:
        if isinstance(err, QueueFullError):
            metrics.inc("http_requests_total", status="429")
            resp = _error(429, err, "rate_limit_exceeded")
            resp.headers["Retry-After"] = "1"  # seconds: clients that honour it back off
            return resp
        metrics.inc("http_requests_total", status="400")
        return _error(400, err)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        metrics.inc("http_requests_total", status=str(err.status_code))
        return _error(err.status_code, Exception(err.detail), "invalid_request_error")

    @app.exception_handler(Exception)
    async def on_crash(request: Request, err: Exception) -> JSONResponse:
        metrics.inc("http_requests_total", status="500")
        return _error(500, Exception(f"internal error: {type(err).__name__}"), "server_error")

    async def body_of(request: Request) -> Any:
        raw = await request.body()
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise oa.bad_request(f"malformed JSON body: {err}", None, "invalid_json") from None

    def submit(parsed: oa.ParsedRequest) -> tuple[list[str], asyncio.Queue]:
        """One engine request per choice (the later ones wait for the first's prompt and reuse
        it); their events arrive on one queue as (choice index, event)."""
        room = engine.max_batch + engine.max_queue
        if parsed.n > room:
            raise oa.bad_request(
                f"n = {parsed.n} choices exceed this server's {room} places "
                f"(max_batch {engine.max_batch} + max_queue {engine.max_queue})",
                "n",
            )
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def sink(index: int, event: Event) -> None:
            loop.call_soon_threadsafe(events.put_nowait, (index, event))

        rids: list[str] = []
        try:
            for i, params in enumerate(parsed.choice_params()):
                first = rids[0] if rids else None
                rids.append(engine.submit(parsed.prompt, params, partial(sink, i), first))
        except Hf2qError:
            cancel(rids)  # a full queue part-way: the choices already in go too
            raise
        return rids, events

    def cancel(rids: list[str]) -> None:
        for rid in rids:
            engine.cancel(rid)

    async def collect(
        request: Request, rids: list[str], events: asyncio.Queue
    ) -> list[list[Event]] | None:
        """Every choice's events; None when the client went away (the choices are cancelled)."""
        out: list[list[Event]] = [[] for _ in rids]
        left = len(rids)
        while True:
            try:
                i, event = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    cancel(rids)
                    metrics.inc("client_disconnects_total")
                    return None
                continue
            out[i].append(event)
            left -= event.finish_reason is not None
            if left == 0:
                return out

    async def stream(
        rids: list[str], events: asyncio.Queue, first: list[dict],
        chunk: Callable[[int, Event], dict | None], last: Callable[[int, Event], dict],
        tail: Callable[[list[Event]], list[dict]],
    ) -> AsyncIterator[str]:  # fmt: skip
        """SSE of every choice as its tokens come (each chunk names its choice's index), each
        choice's finish chunk, then ``tail`` of the choices' last events (usage) and [DONE]."""
        done = False
        try:
            for obj in first:
                yield _sse(obj)
            lasts: list[Event | None] = [None] * len(rids)
            while None in lasts:
                i, event = await events.get()
                if event.finish_reason == "error":
                    err = oa.error_body(Exception(event.error or "internal error"), "server_error")
                    yield _sse(err)
                    cancel(rids)
                    break
                obj = chunk(i, event)
                if obj is not None:
                    yield _sse(obj)
                if event.finish_reason is not None:
                    yield _sse(last(i, event))
                    lasts[i] = event
            else:
                for obj in tail(lasts):
                    yield _sse(obj)
            done = True
            yield "data: [DONE]\n\n"
        finally:
            if not done:  # the client went away (or the server is stopping): free the rows
                cancel(rids)
                metrics.inc("client_disconnects_total")

    def finished(choices: list[list[Event]] | None, build: Callable[[list[list[Event]]], dict]):
        if choices is None:
            metrics.inc("http_requests_total", status="499")
            return JSONResponse({}, status_code=499)
        failed = [events[-1] for events in choices if events[-1].finish_reason == "error"]
        if failed:
            metrics.inc("http_requests_total", status="500")
            return _error(500, Exception(failed[0].error or "internal error"), "server_error")
        metrics.inc("http_requests_total", status="200")
        return JSONResponse(build(choices))

    def generating() -> None:
        if embeddings_only:
            raise oa.bad_request(
                f"model {model_id!r} is an embedding model: this server answers /v1/embeddings",
                "model",
                "unsupported_endpoint",
            )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        generating()
        body = await body_of(request)
        parsed = await run_in_threadpool(oa.parse_chat, body, tokenizer, model_ids, engine.max_len)
        rids, events = submit(parsed)
        cid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        want_lp = parsed.params.logprobs
        model = parsed.model
        if not parsed.stream:
            got = await collect(request, rids, events)
            return finished(got, lambda ch: oa.chat_response(cid, model, tokenizer, ch, want_lp))

        def chunk(i: int, e: Event) -> dict | None:
            lp = oa.chat_logprobs(tokenizer, [e]) if want_lp and e.token is not None else None
            if e.text or lp is not None:
                return oa.chat_chunk(cid, model, {"content": e.text}, None, lp, i)
            return None

        def last(i: int, e: Event) -> dict:
            return oa.chat_chunk(cid, model, {}, e.finish_reason, index=i)

        def tail(lasts: list[Event]) -> list[dict]:
            if not parsed.include_usage:
                return []
            return [oa.usage_chunk(cid, model, "chat.completion.chunk", lasts)]

        role = {"role": "assistant", "content": ""}
        first = [oa.chat_chunk(cid, model, role, None, index=i) for i in range(parsed.n)]
        metrics.inc("http_requests_total", status="200")
        return StreamingResponse(
            stream(rids, events, first, chunk, last, tail), media_type="text/event-stream"
        )

    @app.post("/v1/completions")
    async def completions(request: Request):
        generating()
        body = await body_of(request)
        parsed = await run_in_threadpool(
            oa.parse_completion, body, tokenizer, model_ids, engine.max_len
        )
        rids, events = submit(parsed)
        cid = f"cmpl-{uuid.uuid4().hex[:24]}"
        want_lp = parsed.params.logprobs
        model = parsed.model
        if not parsed.stream:
            got = await collect(request, rids, events)
            return finished(
                got, lambda ch: oa.completion_response(cid, model, tokenizer, ch, want_lp)
            )

        def chunk(i: int, e: Event) -> dict | None:
            lp = oa.completion_logprobs(tokenizer, [e]) if want_lp and e.token is not None else None
            if e.text or lp is not None:
                return oa.completion_chunk(cid, model, e.text, None, lp, i)
            return None

        def last(i: int, e: Event) -> dict:
            return oa.completion_chunk(cid, model, "", e.finish_reason, index=i)

        def tail(lasts: list[Event]) -> list[dict]:
            if not parsed.include_usage:
                return []
            return [oa.usage_chunk(cid, model, "text_completion", lasts)]

        metrics.inc("http_requests_total", status="200")
        return StreamingResponse(
            stream(rids, events, [], chunk, last, tail), media_type="text/event-stream"
        )

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        if not embeddings_only:
            raise oa.bad_request(
                f"model {model_id!r} generates text; /v1/embeddings needs a server of an "
                "embedding model (e.g. hf2q-mlx serve --model embeddinggemma-300m)",
                "model",
                "unsupported_endpoint",
            )
        body = await body_of(request)
        parsed = await run_in_threadpool(
            oe.parse_embeddings, body, model_ids, engine.model, tokenizer, engine.dims
        )
        loop = asyncio.get_running_loop()
        answer: asyncio.Future = loop.create_future()

        def settle(vectors, error) -> None:
            if not answer.done():
                answer.set_result((vectors, error))

        job = engine.submit(
            parsed.ids, parsed.dimensions, lambda v, e: loop.call_soon_threadsafe(settle, v, e)
        )
        while not answer.done():
            try:
                await asyncio.wait_for(asyncio.shield(answer), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    engine.cancel(job)
                    metrics.inc("client_disconnects_total")
                    metrics.inc("http_requests_total", status="499")
                    return JSONResponse({}, status_code=499)
        vectors, error = answer.result()
        if error is not None:
            metrics.inc("http_requests_total", status="500")
            return _error(500, Exception(error), "server_error")
        metrics.inc("http_requests_total", status="200")
        return JSONResponse(oe.embeddings_response(parsed, vectors))

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": m, "object": "model", "created": created, "owned_by": "hf2q-mlx"}
                     for m in sorted(model_ids)],
        }  # fmt: skip

    @app.get("/health")
    async def health():
        alive = engine.alive()
        body = {"status": "ok" if alive else "engine stopped", **engine.stats()}
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    return app
