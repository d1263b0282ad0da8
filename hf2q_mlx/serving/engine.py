"""The serving engine: one background thread owns MLX and runs a continuous-batching loop.

Every iteration (a *step*) the loop (1) takes new requests and cancellations from a thread-safe
inbox, (2) admits waiting requests into free rows, each from the saved row that holds most of
its prompt (the prefix pool),
(3) feeds at most ``prefill_chunk`` prompt tokens in all, over as many rows as fit (whole
chunks, evaluated together, so a long prompt delays the running streams by one chunk at most),
(4) builds one batched decode over every row that is generating plus each row's sampling and
submits it without waiting, then (5) reads the *previous* step's token ids back and streams
them. The sampled ids stay on the device as the next step's input, so the host work of a step
overlaps the device work of the one before; a row that ends (EOS, a stop string) is dropped
one step late and its extra token is discarded, never emitted. A row's last prompt token goes
through the decode step like a generated one, so a prompt's chunks and its first token are
computed exactly as ``stream_generate`` computes them.

Callers talk to the engine only through ``submit`` / ``cancel`` (any thread); results come back
through each request's ``sink`` callback, called on the engine thread (it must not block).
"""

from __future__ import annotations

import atexit
import ctypes
import itertools
import queue
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import mlx.core as mx

from hf2q_mlx import compile_ahead
from hf2q_mlx.custom_kernels import backend, cuda_cache, device_array
from hf2q_mlx.decode_step import DecodeStep
from hf2q_mlx.errors import (
    ContextLengthError,
    InvalidArgumentError,
    QueueFullError,
    SamplingOptionsError,
)
from hf2q_mlx.generation import (
    cache_arrays,
    check_token_ids,
    context_limit,
    graph_step,
    make_prompt_cache,
    parse_kv_bits,
    vocab_limit,
)
from hf2q_mlx.serving.batch_sampler import (
    BatchSampler,
    PendingSample,
    SampledBatch,
    SamplingParams,
)
from hf2q_mlx.serving.metrics import Metrics
from hf2q_mlx.serving.prefix_pool import PrefixPool
from hf2q_mlx.serving.sequential_step import SequentialStep
from hf2q_mlx.serving.stop_text import StopText

DEFAULT_MAX_LEN = 4096
# Prompt tokens of one prefill chunk at which a kernel dispatcher may pick other kernels (an MMA
# tile, the dequantize + GEMM path). The warm-up prefills each once, so no request pays the JIT
# compile of a new kernel (~1.5 s each on the H200); tests/test_jit_lengths.py keeps it whole.
PREFILL_SWITCH_TOKENS = (1, 2, 8, 9, 16, 17, 33, 65)
# top-k values, one of each class of the sampling kernels' launch shapes (values per thread
# switch past 8, the merge's threads double with the candidates): ``custom_kernels/sampling.py``
WARM_TOP_K = (64, 1, 2, 4, 8, 16, 32)
_LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _shutdown_live_engines() -> None:
    """Stop engine threads still running at exit (a notebook that never closed its engine)."""
    for engine in list(_LIVE):
        engine.shutdown(timeout=10.0)


def make_step(
    model: Any, max_batch: int, max_len: int, kv_bits: Any = None, compiled: bool | None = None
):
    """The compiled batched step (``DecodeStep``) where it applies, else ``SequentialStep``.

    ``compiled=None`` picks the compiled step on a GPU only: on the CPU a compiled batch pays for
    all its rows, busy or not (SmolLM2, 8 rows: 15.5 tok/s with one stream against 44 per row;
    83 against 57 with all eight busy; docs/serving.md), so a server there opts in
    (``hf2q-mlx serve --step batched``) when it expects to be full."""
    if compiled is None:
        compiled = mx.default_device() == mx.gpu
    if compiled and DecodeStep.supports(model, kv_bits):
        return DecodeStep(model, max_batch, max_len, kv_bits=parse_kv_bits(kv_bits))
    return SequentialStep(model, max_batch, max_len, kv_bits)


def _warm_params(n: int) -> list[SamplingParams]:
    """``n`` warm-up requests' options: greedy first, then one sampled request per top-k class
    of the sampling kernels (the first with every other option too), then greedy again."""
    sampled = [
        SamplingParams(max_tokens=2, temperature=0.8, top_k=k, ignore_eos=True) for k in WARM_TOP_K
    ]
    sampled[0] = SamplingParams(max_tokens=2, temperature=0.8, top_k=WARM_TOP_K[0], top_p=0.9,
                                min_p=0.05, seed=0, logprobs=True, top_logprobs=2,
                                presence_penalty=0.1, frequency_penalty=0.1, ignore_eos=True,
                                logit_bias={1: 0.5})  # fmt: skip
    greedy = SamplingParams(max_tokens=2, ignore_eos=True)
    return ([greedy] + sampled + [greedy] * n)[:n]


def _set_at_end(flag: threading.Event, event: Event) -> None:
    """A warm-up request's sink: nothing is streamed, its end is flagged."""
    if event.finish_reason is not None:
        flag.set()


def _materialize_model(model: Any) -> None:
    """Evaluate every array a model holds, private attributes too (RoPE tables, ...): MLX streams
    are per thread, so an array left lazy by the loading thread cannot be evaluated by the engine
    thread."""
    params, others = [], []
    for _, m in model.named_modules():
        # parameters (the module's dict items) and plain attributes, helper objects included
        params += [v for v in m.values() if isinstance(v, mx.array)]
        others += cache_arrays(list(vars(m).values()))
    mx.eval(params)
    for a in others:
        try:
            mx.eval(a)
        except RuntimeError:  # a placeholder an earlier mx.compile trace left behind
            pass


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` (None elsewhere): it returns the C heap's free pages to the system,
    which ``free`` alone leaves mapped (a server's RSS then stays at its peak after load)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl) or no libc.so.6
        return None


_TRIM = _malloc_trim()


def release_memory() -> None:
    """MLX's cached buffers and the C heap's free pages back to the system (the engine calls it
    when it falls idle)."""
    mx.clear_cache()
    if _TRIM is not None:
        _TRIM(0)


@dataclass
class Event:
    """One generated token of a request (``text`` may be empty), or its end.

    ``finish_reason``: None while running, then "stop" (EOS or a stop string), "length"
    (max_tokens or the context), "cancelled" or "error" (``error`` says why).
    """

    request_id: str
    text: str
    token: int | None
    logprob: float | None
    top_logprobs: list[tuple[int, float]]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    error: str | None = None


@dataclass
class _Inflight:
    """A submitted decode step: its rows (with the request each held) and its sampling (host
    values already, when the CUDA graph's ids served plain greedy rows)."""

    rows: list[tuple[int, Request]]
    sample: PendingSample | SampledBatch


@dataclass(eq=False)
class Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    sink: Callable[[Event], None]
    budget: int
    submitted: float = field(default_factory=time.perf_counter)
    row: int = -1
    cursor: int = 0  # prompt tokens held by the row
    pending: int = -1  # the first token the decode step feeds (the prompt's last)
    launched: int = 0  # decode steps submitted for the row (tokens computed or in flight)
    generated: int = 0  # tokens read back and emitted
    reused: int = 0
    counted: bool = True  # in the 429 count (a warm-up request is not)
    text: StopText | None = None
    eos: frozenset = frozenset()
    after: str | None = None  # admitted once this request's prompt is prefilled (or it ended)


class Engine:
    """Continuous batching over ``max_batch`` rows; ``start()`` launches the loop thread."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_batch: int = 8,
        max_queue: int = 64,
        max_len: int | None = None,
        kv_bits: Any = None,
        prefill_chunk: int = 512,
        prefix_cache_bytes: int = 256 << 20,
        min_prefix_tokens: int = 1,
        compiled: bool | None = None,
        step: Any = None,
        batch_prefill: bool = False,
        warmup: bool | None = None,
    ) -> None:
        for name, v, low in (
            ("max_batch", max_batch, 1),
            ("max_queue", max_queue, 0),
            ("prefill_chunk", prefill_chunk, 1),
            ("prefix_cache_bytes", prefix_cache_bytes, 0),
            ("min_prefix_tokens", min_prefix_tokens, 1),
        ):
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise InvalidArgumentError(f"{name} must be an integer >= {low}, got {v!r}")
        limit = context_limit(model)
        if max_len is None:
            max_len = min(limit or DEFAULT_MAX_LEN, DEFAULT_MAX_LEN)
        if not isinstance(max_len, int) or max_len < 2:
            raise InvalidArgumentError(f"max_len must be an integer >= 2, got {max_len!r}")
        _materialize_model(model)
        self.model, self.tokenizer = model, tokenizer
        self.max_batch, self.max_queue, self.prefill_chunk = max_batch, max_queue, prefill_chunk
        self.max_len = max_len if limit is None else min(max_len, limit)
        self.min_prefix_tokens = min_prefix_tokens
        # a step's prompt chunks of several rows in one forward pass (DecodeStep.prefill_rows)
        self.batch_prefill = bool(batch_prefill)
        self.vocab = vocab_limit(model, tokenizer)
        self.eos = frozenset(tokenizer.eos_token_ids)
        self.step = step or make_step(model, max_batch, self.max_len, kv_bits, compiled)
        # on CUDA (HF2Q_DECODE auto or graph): the step replayed as one CUDA graph (else None)
        self.graph = graph_step(self.step) if isinstance(self.step, DecodeStep) else None
        self.sampler = BatchSampler(max_batch, model.args.vocab_size)
        self.pool = PrefixPool(prefix_cache_bytes)
        self.metrics = Metrics(max_batch)
        self._tally = self.metrics  # what the engine thread counts into (not during warm-up)
        self.rows: list[Request | None] = [None] * max_batch
        self.waiting: deque[Request] = deque()
        self.inbox: queue.Queue = queue.Queue()
        self.by_id: dict[str, Request] = {}
        self._lock = threading.Lock()
        self._outstanding = 0  # admitted or waiting, counted at submit for the 429 decision
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._inflight: _Inflight | None = None
        self.steps = 0
        # build the kernels, traces and graphs requests meet before serving (None: on a GPU)
        self.warmup = backend() is not None if warmup is None else bool(warmup)
        self.warmup_s: float | None = None  # what the warm-up took, once done
        self._warmed = threading.Event()

    # ---- caller side (any thread) --------------------------------------------------------------

    def submit(
        self,
        prompt: list[int],
        params: SamplingParams,
        sink: Callable[[Event], None],
        after: str | None = None,
    ) -> str:
        """Queue a request; returns its id. Raises SamplingOptionsError, InvalidArgumentError,
        ContextLengthError before queueing, QueueFullError when max_batch + max_queue requests
        are already in the engine. ``after``: the id of a request with the same prompt (another
        choice of one API request); this one waits until that prompt is prefilled, then takes
        its saved row from the prefix pool instead of prefilling it again."""
        if self._stop.is_set():
            raise InvalidArgumentError("this engine has been shut down; make a new one")
        params.validate()
        top = max(params.logit_bias, default=-1)
        if self.vocab is not None and top >= self.vocab:
            raise SamplingOptionsError(
                f"logit_bias token id {top} is outside the vocabulary [0, {self.vocab})"
            )
        if not prompt:
            raise InvalidArgumentError("prompt is empty: give at least one token or character")
        check_token_ids(prompt, self.vocab)
        if len(prompt) > self.max_len:
            raise ContextLengthError(
                f"prompt of {len(prompt)} tokens exceeds the context of {self.max_len} tokens"
            )
        with self._lock:
            if self._outstanding >= self.max_batch + self.max_queue:
                raise QueueFullError(
                    f"server busy: {self._outstanding} requests running or queued "
                    f"(max_batch {self.max_batch} + max_queue {self.max_queue}); retry later"
                )
            self._outstanding += 1
            rid = f"req-{next(self._ids)}"
        budget = min(params.max_tokens, self.max_len - len(prompt) + 1)
        req = Request(rid, list(prompt), params, sink, budget, after=after)
        self.metrics.inc("requests_total")
        self.metrics.inc("prompt_tokens_total", len(prompt))
        self.inbox.put(("add", req))
        return rid

    def cancel(self, request_id: str) -> None:
        """Stop a request; its row is free before the next step runs."""
        self.inbox.put(("cancel", request_id))

    def start(self) -> Engine:
        """Start the loop thread; returns once the warm-up (if any) is done. Requests submitted
        from other threads meanwhile wait in the queue."""
        if self._thread is None:
            _LIVE.add(self)
            self._thread = threading.Thread(target=self._run, name="hf2q-engine", daemon=True)
            self._thread.start()
            self._warmed.wait()
        return self

    def shutdown(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self.inbox.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stats(self) -> dict[str, int]:
        """Running rows, waiting requests and outstanding requests (a snapshot)."""
        with self._lock:
            outstanding = self._outstanding
        return {
            "running": sum(r is not None for r in self.rows),
            "waiting": len(self.waiting),
            "outstanding": outstanding,
            "steps": self.steps,
            "prefix_entries": len(self.pool),
            "prefix_bytes": self.pool.nbytes,
        }

    # ---- engine thread -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            try:
                if self.warmup:
                    self._warm_up()
            finally:
                self._warmed.set()
            self._loop()
        finally:
            # MLX keeps a worker per thread-local stream: without this, the process may abort
            # at exit ("terminate called without an active exception")
            mx.synchronize()
            if self.graph is not None:
                # the CUDA graphs' executables go with the engine (they held the step's
                # buffers' addresses); a later decode of this step through a graph captures anew
                self.graph.close()
            mx.clear_streams()

    def _loop(self) -> None:
        busy = False
        while not self._stop.is_set():
            idle = not self.waiting and all(r is None for r in self.rows) and self._inflight is None
            if idle and busy:
                release_memory()  # nothing running: hand freed buffers back to the system
            busy = not idle
            try:
                self._drain(block=idle)
                if self._stop.is_set():
                    break
                self._admit()
                self._prefill()
                self._decode()
                self.steps += 1
            except Exception as err:  # an engine bug: fail the running requests, keep serving
                traceback.print_exc()
                self._fail_all(f"internal error: {type(err).__name__}: {err}")
            self._update_gauges()
        self._fail_all("server shutting down", reason="cancelled")

    def _warm_up(self) -> None:
        """One request at a time through the loop's own paths: a prefill chunk of each of
        ``PREFILL_SWITCH_TOKENS`` and two decode steps each, greedy and then sampling through
        each top-k class of the sampling kernels (``WARM_TOP_K``; penalties, log-probs and a
        logit bias once); a chunk after a chunk and, with ``batch_prefill``, packed chunks;
        then the decode at every attention span. The kernels, the compiled step or the CUDA
        graph and the sampling are then built before a client waits on them. Counted in no
        metric and no 429 decision, saved in no prefix pool; a failure is printed and serving
        goes on (it only costs time). ``tests/test_jit_lengths.py`` checks that a varied load
        after it asks for no new kernel."""
        t0 = time.perf_counter()
        pool = self.pool
        self._tally, self.pool = Metrics(self.max_batch), PrefixPool(0)
        vocab = self.vocab or self.model.args.vocab_size
        top = min(self.prefill_chunk, self.max_len - 3)  # room for the prompt's 2 tokens
        lengths = [n for n in PREFILL_SWITCH_TOKENS if n <= top]
        try:
            if not lengths:
                return
            # on a fresh machine the warm-up's cubins compile together first (compile_ahead):
            # its prefill lengths and chunk lengths, each once on a throwaway cache
            dry = sorted(set(lengths) | {n for n in (*range(1, 10), 65) if n <= top})
            ids = [(5 * j + 1) % vocab for j in range(max(dry))]
            compile_ahead.once(
                self.model,
                lambda: [self.model(mx.array([ids[:n]]), cache=make_prompt_cache(self.model))
                         for n in dry],
                ("engine", *dry),
            )  # fmt: skip
            for i, params in enumerate(_warm_params(max(len(lengths), 1 + len(WARM_TOP_K)))):
                if self._stop.is_set():
                    return
                n = lengths[i % len(lengths)]
                ended = threading.Event()
                prompt = [(7 * j + 3 + i) % vocab for j in range(n + 1)]
                req = Request(f"warm-up-{i}", prompt, params, partial(_set_at_end, ended), 2,
                              counted=False)  # fmt: skip
                self.waiting.append(req)
                self.by_id[req.id] = req
                for _ in range(n + 8):  # a prefill step, two decode steps, one to read back
                    if ended.is_set() or self._stop.is_set():
                        break
                    self._admit()
                    self._prefill()
                    self._decode()
                if not ended.is_set() and not self._stop.is_set():
                    raise RuntimeError(f"warm-up request of {n + 1} tokens did not end")
            self._warm_chunks(vocab, top)
            # every attention span a row can reach: the graph's recordings, or the compiled
            # step's traces (of the logits the sampler reads: the engine's decode)
            for span in self.step.spans() if isinstance(self.step, DecodeStep) else []:
                if self._stop.is_set():
                    return
                if self.graph is not None:
                    self.graph.prepare(span)
                else:
                    self.step.warm_span(span)
        except Exception:  # noqa: BLE001  (a warm-up that fails leaves a slower first request)
            traceback.print_exc()
        finally:
            self._fail_all("warm-up over", reason="cancelled")  # rows and queue empty again
            self.sampler.counts = None  # the penalties' counts, allocated by a warm-up row
            self._tally, self.pool = self.metrics, pool
            release_memory()
            self.warmup_s = time.perf_counter() - t0

    def _warm_chunks(self, vocab: int, top: int) -> None:
        """On free rows: a chunk of 1..8, 9 and 65 tokens after a first chunk (TurboQuant's
        flash-decode takes a chunk of up to 8 tokens with one build per count, its quantize
        the calibrated means); where the engine packs rows, packed chunks with a one-token
        segment (the delta-net's step kernel on a row's own inputs), first and after."""
        ids = [(5 * j + 1) % vocab for j in range(65)]
        for n in [m for m in (*range(1, 10), 65) if 9 + m + 2 <= self.max_len and m <= top]:
            self.step.reset_row(0)
            self.step.prefill(0, ids[:9])
            self.step.prefill(0, ids[:n])
            self._materialize()
        if self.batch_prefill and getattr(self.step, "packs_rows", False) and self.max_batch > 1:
            for row in (0, 1):
                self.step.reset_row(row)
            for n in [m for m in (9, 65) if 2 * m + 2 <= self.max_len and m <= top]:
                self.step.prefill_rows([0, 1], [ids[:n], ids[:1]])
                self._materialize()
        for row in range(min(2, self.max_batch)):
            self.step.reset_row(row)

    def _drain(self, block: bool) -> None:
        try:
            item = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, value = item
            if kind == "add":
                self.waiting.append(value)
                self.by_id[value.id] = value
            elif kind == "cancel":
                self._cancel(value)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _cancel(self, request_id: str) -> None:
        req = self.by_id.get(request_id)
        if req is None:
            return
        if req in self.waiting:
            self.waiting.remove(req)
        self._finish(req, "cancelled", "")

    def _finish(self, req: Request, reason: str, text: str, error: str | None = None) -> None:
        """Free the request's row and send its last event."""
        if self._release(req, reason):
            self._send(req, Event(req.id, text, None, None, [], reason, len(req.prompt),
                                  req.generated, req.reused, error))  # fmt: skip

    def _release(self, req: Request, reason: str) -> bool:
        """Free the request's row, drop it from the live requests and count its end; False
        (nothing counted) if it had ended already."""
        if req.row >= 0 and self.rows[req.row] is req:
            self.rows[req.row] = None
            self.sampler.clear_row(req.row)
        req.row = -1
        if self.by_id.pop(req.id, None) is None:
            return False
        if req.counted:
            with self._lock:
                self._outstanding -= 1
        self._tally.inc("requests_finished_total", reason=reason)
        return True

    def _send(self, req: Request, event: Event) -> None:
        try:
            req.sink(event)
        except Exception:  # a broken sink must not stop the engine
            traceback.print_exc()

    def _fail_all(self, message: str, reason: str = "error") -> None:
        self._inflight = None
        for req in [r for r in self.rows if r is not None] + list(self.waiting):
            self._finish(req, reason, "", message)
        self.waiting.clear()
        for row in range(self.max_batch):
            try:
                self.step.reset_row(row)
            except Exception:
                traceback.print_exc()

    def _ready(self, req: Request) -> bool:
        """A waiting request may take a row: it waits for no prompt, or that prompt is done."""
        first = self.by_id.get(req.after) if req.after is not None else None
        return first is None or (first.row >= 0 and first.cursor >= len(first.prompt) - 1)

    def _admit(self) -> None:
        for row in range(self.max_batch):
            if not self.waiting:
                return
            if self.rows[row] is not None:
                continue
            req = next((r for r in self.waiting if self._ready(r)), None)
            if req is None:
                return
            self.waiting.remove(req)
            n = len(req.prompt)
            reused, saved = self.pool.match(req.prompt[: n - 1], partial(self._servable, n))
            if saved is not None:
                self.step.load_row(row, saved, reused)
            else:
                self.step.reset_row(row)
            req.row, req.cursor, req.reused = row, reused, reused
            req.text = StopText(self.tokenizer, req.params.stop)
            req.eos = frozenset() if req.params.ignore_eos else self.eos
            self.rows[row] = req
            self.sampler.set_row(row, req.params)
            self._tally.inc("prefix_reused_tokens_total", reused)
            if req.cursor == n - 1:
                req.pending = req.prompt[-1]

    def _servable(self, n: int, common: int, length: int, saved: Any) -> int:
        """Tokens a saved row of ``length`` tokens, sharing its first ``common`` with a prompt
        of ``n``, can serve it: all of them, or the shared ones where the row's state can be cut
        back to them (``resume_floor``); 0 if none."""
        m = min(common, length)
        if m < self.min_prefix_tokens or m < self.step.resume_floor(length):
            return 0
        if getattr(self.step, "kv_bits", None) is not None:
            # a TurboQuant row's balance is calibrated on its first prefill chunk: a saved row
            # serves only where its calibration is this prompt's (its whole first chunk shared),
            # else the tokens would differ from the request run alone
            chunk = self.prefill_chunk
            if m < min(chunk, n - 1) or (m < length and m < chunk):
                return 0
        return m

    def _prefill(self) -> None:
        """Whole chunks of the oldest prefilling rows, at most ``prefill_chunk`` tokens in all
        (the first chunk always runs), evaluated together once; with ``batch_prefill`` in one
        forward pass where the step packs rows (``DecodeStep.prefill_rows``)."""
        spent, done, partway, chunks = 0, [], [], []
        for req in sorted((r for r in self.rows if r is not None), key=lambda r: r.submitted):
            end = len(req.prompt) - 1
            if req.cursor >= end:
                continue
            size = min(self.prefill_chunk, end - req.cursor)
            if spent and spent + size > self.prefill_chunk:
                continue  # a shorter chunk further on may still fit
            chunks.append((req.row, req.prompt[req.cursor : req.cursor + size]))
            req.cursor += size
            spent += size
            if req.cursor == end:
                done.append(req)
            elif self.step.resume_floor(end) > req.cursor:
                partway.append(req)  # the prompt's own snapshot could not be cut back to here
        if not spent:
            return
        if self.batch_prefill and len(chunks) > 1 and hasattr(self.step, "prefill_rows"):
            self.step.prefill_rows([row for row, _ in chunks], [ids for _, ids in chunks])
        else:
            for row, ids in chunks:
                self.step.prefill(row, ids)
        self._materialize()
        self._tally.inc("prefill_tokens_total", spent)
        for req in done:
            req.pending = req.prompt[-1]
            self._save_prefix(req, req.cursor)
        for req in partway:
            # a chunk boundary of a state that cannot be unwound (recurrent layers, wrapped
            # rings): kept only in the budget left free, never evicting a whole prompt's
            self._save_prefix(req, req.cursor, evict=False)

    def _materialize(self) -> None:
        """Evaluate the rows' caches now (not the chunk's logits), so the chunk's cost lands in
        this step. DecodeStep keeps each layer's state in ``.arrays``."""
        caches = getattr(self.step, "caches", [])
        if all(hasattr(c, "arrays") for c in caches):
            mx.eval([c.arrays for c in caches])
        else:
            mx.eval(cache_arrays(caches))

    def _save_prefix(self, req: Request, length: int, evict: bool = True) -> None:
        """The row's state, holding the prompt's first ``length`` tokens, into the pool."""
        key = req.prompt[:length]
        if self.pool.budget == 0 or length < self.min_prefix_tokens or key in self.pool:
            return
        if not evict and self.pool.nbytes >= self.pool.budget:
            return
        if self.pool.put(key, self.step.save_row(req.row), evict) and (
            self.step.resume_floor(length) == 0
        ):
            # a row that cuts back to any length serves whatever a saved start of its prompt
            # served (a chat's earlier turns): those go; TurboQuant keeps the ones shorter than a
            # chunk, which serve a prompt of their own length that this row cannot
            tq = getattr(self.step, "kv_bits", None) is not None
            self.pool.drop_covered(key, lambda n: not tq or n >= self.prefill_chunk)

    def _decode(self) -> None:
        """Submit this step's decode and sampling, then stream the previous step's tokens."""
        if self.graph is not None:
            self._graph_decode()
            return
        prev, self._inflight = self._inflight, None
        self._inflight = self._launch(prev)
        if prev is not None:
            self._collect(prev)

    def _generating(self) -> list[bool]:
        """The rows this step decodes: a row generates until it has launched its budget; one
        that turns out to have ended (EOS, a stop string) in a step still being read back is
        dropped one step late."""
        return [
            r is not None and r.cursor >= len(r.prompt) - 1 and r.launched < r.budget
            for r in self.rows
        ]

    def _launched(self, active: list[bool], sample: PendingSample) -> _Inflight:
        """Count a launched step against the active rows' budgets."""
        rows = []
        for row, on in enumerate(active):
            if on:
                self.rows[row].launched += 1
                rows.append((row, self.rows[row]))
        return _Inflight(rows, sample)

    def _launch(self, prev: _Inflight | None) -> _Inflight | None:
        active = self._generating()
        if not any(active):
            return None
        # rows already generating feed the previous step's ids, still on the device
        chained = [a and r.launched > 0 for r, a in zip(self.rows, active)]
        if chained == active:
            # the steady state: nothing to upload (the first GPU read of a host-written buffer
            # costs 12-24 us on the H200); idle rows' ids are ignored
            tokens = prev.sample.tokens
        else:
            tokens = device_array(
                [r.pending if a and not c else 0 for r, a, c in zip(self.rows, active, chained)],
                mx.int32,
            )
            if any(chained):
                mask = device_array(chained, mx.bool_)
                tokens = mx.where(mask, prev.sample.tokens, tokens)  # (B,)
        with cuda_cache.per_token():  # MLX's kernel builds in a per-token step (cuda_cache)
            sample = self.sampler.launch(self.step.decode(tokens, active), active)
        return self._launched(active, sample)

    def _graph_decode(self) -> None:
        """One step through the CUDA graph, its tokens read and streamed at once: every row
        feeds the token it emitted last (or its prompt's last). Plain greedy rows take the
        graph's own argmax ids (as ``stream_generate`` does); any other row sampling runs on the
        graph's logits. Nothing to overlap: the graph keeps the GPU busy on its own."""
        active = self._generating()
        if not any(active):
            return
        ids = self.graph.decode([r.pending if a else 0 for r, a in zip(self.rows, active)], active)
        if self.sampler.plain_greedy(active):
            nan = [float("nan")] * self.max_batch
            sample = SampledBatch(list(ids), nan, [[] for _ in range(self.max_batch)])
        else:
            with cuda_cache.per_token():
                sample = self.sampler.launch(self.graph.last.logits, active)
        self._collect(self._launched(active, sample))

    def _collect(self, done: _Inflight) -> None:
        out = done.sample
        if isinstance(out, PendingSample):
            out = self.sampler.read(out)
        now = time.perf_counter()
        n_new = 0
        for row, req in done.rows:
            if self.rows[row] is not req:
                continue  # ended or cancelled since: its token is discarded
            if req.generated == 0:
                # the last prompt token went through this step
                self._tally.inc("prefill_tokens_total", 1)
                self._tally.observe_ttft(now - req.submitted)
            n_new += 1
            req.pending = out.tokens[row]  # what the graph step feeds next (unused otherwise)
            self._emit(req, out.tokens[row], out.logprobs[row], out.top[row])
        self._tally.tokens_generated(n_new)

    def _emit(self, req: Request, token: int, logprob: float, top: list) -> None:
        req.generated += 1
        lp = logprob if req.params.logprobs or req.params.top_logprobs else None
        if token in req.eos:
            text, _ = req.text.finish()
            finish: str | None = "stop"
        else:
            text, hit = req.text.add(token)
            finish = "stop" if hit else None
            if finish is None and req.generated >= req.budget:
                more, hit = req.text.finish()
                text, finish = text + more, "stop" if hit else "length"
        event = Event(req.id, text, token, lp, top, None, len(req.prompt), req.generated,
                      req.reused)  # fmt: skip
        if finish is None:
            self._send(req, event)
            return
        # the token and the end travel in one event (the row is live: the caller skips ended ones)
        self._release(req, finish)
        event.finish_reason = finish
        self._send(req, event)

    def _update_gauges(self) -> None:
        self._tally.set("running", sum(r is not None for r in self.rows))
        self._tally.set("queue_depth", len(self.waiting) + self.inbox.qsize())
        self._tally.set("prefix_pool_bytes", self.pool.nbytes)
        self._tally.set("prefix_pool_entries", len(self.pool))
        self._tally.set("mlx_active_memory_bytes", mx.get_active_memory())
        self._tally.set("mlx_cache_memory_bytes", mx.get_cache_memory())
