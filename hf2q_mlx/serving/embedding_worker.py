"""The server's worker for an embedding model (EmbeddingGemma): one thread owns the model (every
MLX call happens there) and runs the queued requests' token ids through ``embed_token_ids``; the
HTTP handlers tokenize and wait, as they do for ``Engine``. Requests waiting together run
together: their inputs fill forward passes of ``batch_size`` (32 clients at once on the 2-core
CPU: 2.28x the requests per second of one request a pass, ``bench/serve_embeddings.py``,
docs/serving.md).
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from hf2q_mlx.embedding import (
    check_embedding_ids,
    embed_token_ids,
    embedding_spec,
    finish_vectors,
)
from hf2q_mlx.errors import InvalidArgumentError, QueueFullError
from hf2q_mlx.generation import is_int
from hf2q_mlx.serving.engine import release_memory
from hf2q_mlx.serving.metrics import Metrics

# the worker wakes this often to see a stop request while idle
_IDLE_POLL_S = 0.5


@dataclass
class EmbeddingJob:
    """One request's inputs; ``done(vectors, error)`` is called once from the worker thread with
    the (N, D) float32 embeddings in input order, or None and why it failed / was cancelled."""

    id: str
    ids: list[list[int]]
    dimensions: int | None
    done: Callable[[np.ndarray | None, str | None], None]
    cancelled: bool = False


class EmbeddingWorker:
    """``Engine``'s counterpart for embedding models: ``submit`` queues token ids and returns at
    once (QueueFullError past ``max_queue`` waiting requests), ``cancel`` drops a request that
    has not started. The requests waiting when the worker is free are taken together, up to
    ``batch_size`` inputs (a larger request alone), and their inputs run ``batch_size`` to a
    forward pass: a vector is the same as the request run alone up to fp32 rounding (the
    padding of its batch differs; ~1e-7 on EmbeddingGemma)."""

    def __init__(self, model: Any, tokenizer: Any, *, max_queue: int = 64, batch_size: int = 32):
        spec = embedding_spec(model)  # raises for a model that is not an embedding model
        for name, v, low in (("max_queue", max_queue, 0), ("batch_size", batch_size, 1)):
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise InvalidArgumentError(f"{name} must be an integer >= {low}, got {v!r}")
        self.model, self.tokenizer = model, tokenizer
        self.max_queue, self.batch_size = max_queue, batch_size
        self.dims = spec.head.dims
        self.metrics = Metrics(batch_size)
        self.inbox: queue.Queue[EmbeddingJob | None] = queue.Queue()
        self._lock = threading.Lock()
        self._outstanding = 0  # queued or running
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.finished = 0

    # ---- caller side (any thread) --------------------------------------------------------------

    def submit(
        self,
        ids: Sequence[Sequence[int]],
        dimensions: int | None,
        done: Callable[[np.ndarray | None, str | None], None],
    ) -> EmbeddingJob:
        """Queue one request's inputs; raises InvalidArgumentError for ids the model cannot run
        (``check_embedding_ids``) or a bad ``dimensions``, before queueing."""
        if self._stop.is_set():
            raise InvalidArgumentError("this worker has been shut down; make a new one")
        check_embedding_ids(self.model, ids, "ids")
        if dimensions is not None and (not is_int(dimensions) or not 1 <= dimensions <= self.dims):
            raise InvalidArgumentError(
                f"dimensions must be an integer in [1, {self.dims}], got {dimensions!r}"
            )
        with self._lock:
            if self._outstanding >= 1 + self.max_queue:
                raise QueueFullError(
                    f"server busy: {self._outstanding} embedding requests running or queued "
                    f"(1 + max_queue {self.max_queue}); retry later"
                )
            self._outstanding += 1
            job = EmbeddingJob(f"emb-{next(self._ids)}", [list(r) for r in ids], dimensions, done)
        self.metrics.inc("requests_total")
        self.metrics.inc("prompt_tokens_total", sum(len(r) for r in job.ids))
        self.metrics.set("queue_depth", self.inbox.qsize() + 1)
        self.inbox.put(job)
        return job

    def cancel(self, job: EmbeddingJob) -> None:
        """Skip ``job`` if it has not started (one that runs finishes: a request is short)."""
        job.cancelled = True

    def start(self) -> EmbeddingWorker:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="hf2q-embed", daemon=True)
            self._thread.start()
        return self

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the thread; requests still queued are answered "the server is shutting down"."""
        self._stop.set()
        self.inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self._drain()

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stats(self) -> dict[str, int]:
        with self._lock:
            outstanding, finished = self._outstanding, self.finished
        return {"outstanding": outstanding, "waiting": self.inbox.qsize(), "finished": finished}

    # ---- worker thread -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    job = self.inbox.get(timeout=_IDLE_POLL_S)
                except queue.Empty:
                    continue
                if job is not None:
                    self._serve([job, *self._more(len(job.ids))])
                if self.inbox.empty():
                    release_memory()
        finally:
            mx.synchronize()  # as Engine: MLX's per-thread stream ends with its thread
            mx.clear_streams()
            self._drain()

    def _drain(self) -> None:
        """Answer every queued request: nothing is left waiting."""
        while True:
            try:
                job = self.inbox.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                self._finish(job, None, "the server is shutting down", "cancelled")

    def _more(self, inputs: int) -> list[EmbeddingJob]:
        """Queued requests to run with one of ``inputs`` inputs, while they fit a batch."""
        more: list[EmbeddingJob] = []
        while inputs < self.batch_size:
            try:
                job = self.inbox.get_nowait()
            except queue.Empty:
                break
            if job is None:  # shutdown: leave the sentinel for the loop
                self.inbox.put(None)
                break
            if inputs + len(job.ids) > self.batch_size:
                more.append(job)  # taken now, so the queue order holds; past the batch size
                break
            more.append(job)
            inputs += len(job.ids)
        return more

    def _serve(self, jobs: list[EmbeddingJob]) -> None:
        live = []
        for job in jobs:
            if job.cancelled:
                self._finish(job, None, "cancelled", "cancelled")
            else:
                live.append(job)
        if not live:
            return
        try:
            pooled = embed_token_ids(  # every request's inputs, not yet cut or normalized
                self.model, [r for j in live for r in j.ids], batch_size=self.batch_size,
                normalize=False,
            )  # fmt: skip
            self.metrics.inc("embedding_batches_total")
            outs, start = [], 0
            for job in live:
                rows = pooled[start : start + len(job.ids)]
                outs.append(np.array(finish_vectors(rows, job.dimensions).astype(mx.float32)))
                start += len(job.ids)
        except Exception as err:  # an answer for the clients, never a dead worker
            for job in live:
                self._finish(job, None, f"{type(err).__name__}: {err}", "error")
            return
        for job, out in zip(live, outs):
            self._finish(job, out, None, "stop")

    def _finish(self, job: EmbeddingJob, out, error: str | None, reason: str) -> None:
        with self._lock:  # the worker thread, or shutdown's caller draining the queue
            self._outstanding -= 1
            self.finished += 1
        self.metrics.inc("requests_finished_total", reason=reason)
        self.metrics.set("queue_depth", self.inbox.qsize())
        try:
            job.done(out, error)
        except Exception:  # the waiting handler's loop is gone (server stopping): nobody to tell
            pass
