"""``BatchGenerator``: many prompts decoded together from Python (a script or a notebook).

gen = BatchGenerator(model, tokenizer, max_batch=8)
texts = gen.generate(["Hello", "2 + 2 ="], max_tokens=32)
uid = gen.submit([{"role": "user", "content": "Hi"}], temperature=0.7, seed=1)
for r in gen.results():        # BatchResponse per token, as rows produce them
    print(r.uid, r.text, r.finish_reason)
gen.close()
"""

from __future__ import annotations

import queue
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, fields
from typing import Any

from hf2q_mlx.errors import SamplingOptionsError
from hf2q_mlx.generation import Prompt, encode_prompt
from hf2q_mlx.serving.batch_sampler import SamplingParams
from hf2q_mlx.serving.engine import Engine, Event

OPTIONS = {f.name for f in fields(SamplingParams)}


@dataclass
class BatchResponse:
    """One generated token of request ``uid`` and the text it released (may be empty).
    ``finish_reason`` is None until the request's last response: "stop", "length",
    "cancelled" or "error"."""

    uid: str
    text: str
    token: int | None
    logprob: float | None
    top_logprobs: list[tuple[int, float]]
    finish_reason: str | None
    prompt_tokens: int
    generation_tokens: int


def sampling_params(options: dict[str, Any]) -> SamplingParams:
    """``SamplingParams`` from keyword options (``stop`` may be one string); checked."""
    unknown = set(options) - OPTIONS
    if unknown:
        raise SamplingOptionsError(
            f"unknown generation option(s) {sorted(unknown)}; known: {sorted(OPTIONS)}"
        )
    options = dict(options)
    if isinstance(options.get("stop"), str):
        options["stop"] = [options["stop"]]
    elif options.get("stop") is None:
        options["stop"] = []
    params = SamplingParams(**options)
    params.validate()
    return params


class BatchGenerator:
    """Continuous batching behind a blocking Python API; the engine runs in its own thread.

    Options of ``submit`` / ``generate``: those of ``SamplingParams`` (max_tokens, temperature,
    top_k, top_p, min_p, seed, stop, logprobs, top_logprobs, presence_penalty,
    frequency_penalty, ignore_eos, logit_bias); the defaults decode greedily, as ``generate``
    does.
    ``compiled`` picks the batched ``DecodeStep`` (default: on a GPU) or the sequential rows;
    ``batch_prefill`` packs a step's prompt chunks of several rows into one forward pass (the
    batched step only; off by default: docs/serving.md). ``warmup`` builds the kernels, traces
    and CUDA graphs of each prompt-length bucket, sampling class and attention span before the
    constructor returns (default: where kernels run, on a GPU), so requests do not wait on JIT
    compiles (docs/serving.md, "Warm-up").
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_batch: int = 8,
        max_len: int | None = None,
        kv_bits: Any = None,
        prefill_chunk: int = 512,
        prefix_cache_bytes: int = 256 << 20,
        compiled: bool | None = None,
        batch_prefill: bool = False,
        warmup: bool | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.engine = Engine(
            model,
            tokenizer,
            max_batch=max_batch,
            max_queue=1 << 30,  # a Python caller waits instead of getting 429
            max_len=max_len,
            kv_bits=kv_bits,
            prefill_chunk=prefill_chunk,
            prefix_cache_bytes=prefix_cache_bytes,
            compiled=compiled,
            batch_prefill=batch_prefill,
            warmup=warmup,
        ).start()
        self._events: queue.Queue[Event] = queue.Queue()
        self._open: set[str] = set()

    def submit(self, prompt: Prompt, **options: Any) -> str:
        """Queue one prompt (text, token ids or chat messages); returns its uid."""
        params = sampling_params(options)
        ids = encode_prompt(self.tokenizer, prompt)
        uid = self.engine.submit(ids, params, self._events.put)
        self._open.add(uid)
        return uid

    def cancel(self, uid: str) -> None:
        self.engine.cancel(uid)

    def results(self, uids: Iterable[str] | None = None) -> Iterator[BatchResponse]:
        """Responses of the given requests (default: every open one) as they arrive, until each
        has finished. Responses of other requests that arrive meanwhile are not lost: a later
        ``results()`` call yields them."""
        wanted = set(self._open if uids is None else uids)
        held: list[Event] = []
        try:
            while wanted:
                e = self._events.get()
                if e.request_id not in wanted:
                    held.append(e)
                    continue
                if e.finish_reason is not None:
                    wanted.discard(e.request_id)
                    self._open.discard(e.request_id)
                yield BatchResponse(
                    e.request_id, e.text, e.token, e.logprob, e.top_logprobs,
                    e.finish_reason, e.prompt_tokens, e.completion_tokens,
                )  # fmt: skip
        finally:
            for e in held:
                self._events.put(e)

    def generate(self, prompts: list[Prompt], **options: Any) -> list[str]:
        """The generated text of every prompt, in order (all decoded together)."""
        uids = [self.submit(p, **options) for p in prompts]
        texts = {u: [] for u in uids}
        for r in self.results(uids):
            texts[r.uid].append(r.text)
        return ["".join(texts[u]) for u in uids]

    def close(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> BatchGenerator:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
