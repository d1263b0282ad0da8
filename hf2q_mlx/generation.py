"""Text generation: chunked prefill, then one pipelined graph evaluation per decoded token.

``stream_generate`` yields one ``GenerationResponse`` per generated token; ``generate`` joins
their text. Step n+1 is built and handed to ``mx.async_eval`` before token n is read back, so
the host builds the next graph while the device runs the current one.
"""

from __future__ import annotations

import numbers
import os
import secrets
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Union

import mlx.core as mx
import numpy as np

from hf2q_mlx import compile_ahead
from hf2q_mlx import speculative as spec
from hf2q_mlx.custom_kernels import affine_prefill, cuda_cache
from hf2q_mlx.custom_kernels import sampling as sampling_kernels
from hf2q_mlx.decode_step import shared_step
from hf2q_mlx.errors import ContextLengthError, InvalidArgumentError, SamplingOptionsError
from hf2q_mlx.models import kernel_linears
from hf2q_mlx.models.cache import KVCache
from hf2q_mlx.sampling import make_logits_processors, make_sampler, validate_sampling_options

Prompt = str | Sequence[int] | Sequence[dict[str, Any]] | mx.array


@dataclass
class GenerationResponse:
    """One generated token and the text it released.

    ``text`` is the new text since the previous response; it can be empty while a multi-byte
    character is incomplete or while text that may begin a stop string is held back.
    ``logprob`` is the token's log-probability under the model's distribution (after the
    repetition penalty, before temperature and top-k/top-p/min-p). ``generation_tps`` counts the
    tokens decoded after the first one (the first comes out of prefill). ``peak_memory`` is in GB.
    ``finish_reason`` is None until the last response: "stop" (EOS or a stop string) or
    "length" (max_tokens or the model's context reached). With speculative decoding
    ``drafted_tokens`` / ``accepted_tokens`` count the drafts proposed and accepted so far.
    """

    text: str
    token: int
    logprob: float
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float
    finish_reason: str | None = None
    drafted_tokens: int = 0
    accepted_tokens: int = 0


def context_limit(model: Any) -> int | None:
    """The model's maximum sequence length from its args, or None when it declares none."""
    args = getattr(model, "args", None)
    for name in ("max_position_embeddings", "context_length", "max_seq_len", "n_ctx"):
        value = getattr(args, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


KVBits = Union[int, tuple[int, int], None]


def parse_kv_bits(kv_bits: KVBits | str) -> tuple[int, int] | None:
    """None (full precision), 8, (8, 4) or "8,4" -> (k_bits, v_bits); bad values raise."""
    if kv_bits is None:
        return None
    from hf2q_mlx.models.turboquant.codec import SUPPORTED_BITS

    widths = ", ".join(str(b) for b in SUPPORTED_BITS)
    bad = SamplingOptionsError(
        f'kv_bits must be one of {widths} or a K,V pair of them (e.g. 8 or "8,4"), got {kv_bits!r}'
    )
    if isinstance(kv_bits, str):
        try:
            parts = tuple(int(b) for b in kv_bits.split(","))
        except ValueError:
            raise bad from None
        kv_bits_value: Any = parts[0] if len(parts) == 1 else parts
    else:
        kv_bits_value = kv_bits
    if is_int(kv_bits_value):
        pair: tuple = (kv_bits_value, kv_bits_value)
    elif isinstance(kv_bits_value, (tuple, list)):
        pair = tuple(kv_bits_value)
    else:
        raise bad
    if len(pair) != 2 or any(not is_int(b) or b not in SUPPORTED_BITS for b in pair):
        raise bad
    return (int(pair[0]), int(pair[1]))


def make_prompt_cache(model: Any, kv_bits: KVBits | str = None, reserve: int = 0) -> list:
    """One cache per layer: the model's own ``make_cache()``, else growing KV caches.

    ``kv_bits`` (8, or (8, 4) for K8/V4) turns every attention cache into a TurboQuant cache.
    ``reserve``: how many tokens the cache must be able to roll back (speculative decoding).
    """
    pair = parse_kv_bits(kv_bits)
    if pair is not None:
        from hf2q_mlx.models.turboquant.cache import make_tq_cache

        return make_tq_cache(model, *pair, reserve=reserve)
    if hasattr(model, "make_cache"):
        return model.make_cache(reserve=reserve) if reserve else model.make_cache()
    return [KVCache() for _ in model.layers]


def is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_messages(messages: Sequence[dict]) -> None:
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise InvalidArgumentError(
                f"prompt message {i}: 'role' must be a non-empty string, got {role!r}"
            )
        if not isinstance(content, str):
            raise InvalidArgumentError(
                f"prompt message {i}: 'content' must be a string, got {type(content).__name__}"
            )


def encode_prompt(tokenizer: Any, prompt: Prompt) -> list[int]:
    """Token ids for a string, a list of token ids, or a list of chat messages (dicts)."""
    if isinstance(prompt, (mx.array, np.ndarray)):
        if prompt.ndim != 1:
            raise InvalidArgumentError(
                f"prompt as an array must be 1-D token ids, got shape {tuple(prompt.shape)}"
            )
        prompt = prompt.tolist()
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt, add_special_tokens=True)
    elif not isinstance(prompt, (list, tuple)):
        raise InvalidArgumentError(
            "prompt must be a string, a list of token ids or a list of chat messages "
            f"({{'role': str, 'content': str}} dicts), got {type(prompt).__name__}"
        )
    elif len(prompt) > 0 and all(isinstance(m, dict) for m in prompt):
        _check_messages(prompt)
        if getattr(tokenizer, "chat_template_is_builtin", False):
            warnings.warn(
                "this model's files carry no chat template (a base model?): a generic one is "
                "used and replies may be poor; for chat load an instruction-tuned model such as "
                'hf2q_mlx.load("smollm2-135m-instruct")',
                stacklevel=3,
            )
        text = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True)
        ids = tokenizer.encode(text, add_special_tokens=True)
        # templates that write the BOS themselves would otherwise get a second one
        bos = tokenizer.bos_token_id
        if bos is not None and ids[:2] == [bos, bos]:
            ids = ids[1:]
    elif all(is_int(t) for t in prompt):
        ids = [int(t) for t in prompt]
    else:
        raise InvalidArgumentError(
            "prompt must be a string, a list of token ids or a list of chat messages "
            "({'role': str, 'content': str} dicts), not a mixed or non-integer list"
        )
    if not ids:
        raise InvalidArgumentError("prompt is empty: give at least one token or character")
    return ids


def vocab_limit(model: Any, tokenizer: Any) -> int | None:
    """Number of token ids the model embeds (its args), else the tokenizer's vocabulary size."""
    args = getattr(model, "args", None)
    sizes = [getattr(args, n, None) for n in ("vocab_size", "vocab_size_per_layer_input")]
    sizes = [v for v in sizes if is_int(v) and v > 0]
    if sizes:
        return min(sizes)
    size = getattr(tokenizer, "vocab_size", None)
    return size if is_int(size) and size > 0 else None


def check_token_ids(ids: Sequence[int], vocab: int | None) -> None:
    """Raise InvalidArgumentError for ids the model cannot embed (an out-of-range gather reads
    outside the embedding table)."""
    upper = min(vocab, 2**31) if vocab is not None else 2**31
    for i, t in enumerate(ids):
        if not 0 <= t < upper:
            raise InvalidArgumentError(
                f"prompt token id {t} at position {i} is outside the vocabulary [0, {upper})"
            )


def check_generation_arguments(
    *,
    max_tokens: Any,
    seed: Any,
    stop: Any,
    kv_bits: Any,
    prefill_step_size: Any = 512,
    ignore_eos: Any = False,
) -> None:
    """Raise SamplingOptionsError for a bad max_tokens, seed, stop, kv_bits, ... (before any
    work; the sampling options are checked by ``validate_sampling_options``)."""
    if not is_int(max_tokens) or max_tokens < 1:
        raise SamplingOptionsError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    if seed is not None and (not is_int(seed) or not 0 <= seed < 2**64):
        raise SamplingOptionsError(f"seed must be an integer in [0, 2**64) or None, got {seed!r}")
    if not is_int(prefill_step_size) or prefill_step_size < 1:
        raise SamplingOptionsError(
            f"prefill_step_size must be an integer >= 1, got {prefill_step_size!r}"
        )
    if not isinstance(ignore_eos, bool):
        raise SamplingOptionsError(f"ignore_eos must be True or False, got {ignore_eos!r}")
    _normalize_stop(stop)
    parse_kv_bits(kv_bits)


def cache_arrays(value: Any, depth: int = 0) -> list[mx.array]:
    """Every array inside nested lists, tuples, dicts and objects (a cache list's state), to
    evaluate caches without computing any logits."""
    if isinstance(value, mx.array):
        return [value]
    if depth >= 5:
        return []
    if isinstance(value, (list, tuple)):
        items = value
    elif isinstance(value, dict):
        items = list(value.values())
    elif hasattr(value, "__dict__"):
        items = list(vars(value).values())
    else:
        return []
    return [a for v in items for a in cache_arrays(v, depth + 1)]


def prefill(model: Any, tokens: mx.array, cache: list, step: int = 512) -> mx.array:
    """Run prompt ``tokens`` (L,) through the model in chunks of ``step``; logits (1, V) of the
    last position. Chunks before the last token only evaluate the cache, so the output head
    runs once, on one position."""
    if affine_prefill.enabled():  # MLX affine linears' prompt rows: dequantized chunks, cuBLAS
        kernel_linears.use_kernels(model)
    # a process's first prefill: its CUDA kernels compiled together first (compile_ahead)
    n = tokens.shape[0]
    sizes = tuple(sorted({min(step, n - 1 - i) for i in range(0, n - 1, step)} | {1}))
    dry = lambda: _forward(model, tokens, make_prompt_cache(model), step)  # noqa: E731
    compile_ahead.once(model, dry, sizes)
    return _forward(model, tokens, cache, step, evaluate=True)


def _forward(model: Any, tokens: mx.array, cache: list, step: int, evaluate: bool = False):
    """``prefill``'s chunks; not ``evaluate``: a dry graph of each distinct chunk length once."""
    n = tokens.shape[0]
    i, seen = 0, set()
    while n - 1 - i > 0:
        size = min(step, n - 1 - i)
        if evaluate or size not in seen:
            seen.add(size)
            model(tokens[None, i : i + size], cache=cache)
        if evaluate:
            mx.eval(cache_arrays(cache))
        i += size
    return model(tokens[None, n - 1 :], cache=cache)[:, -1, :]


def _normalize_stop(stop: str | Sequence[str] | None) -> list[str]:
    if stop is None:
        return []
    if not isinstance(stop, (str, list, tuple)):
        raise SamplingOptionsError(
            f"stop must be a string or a list of strings, got {type(stop).__name__}"
        )
    stops = [stop] if isinstance(stop, str) else list(stop)
    if any(not isinstance(s, str) or s == "" for s in stops):
        raise SamplingOptionsError(f"stop strings must be non-empty strings, got {stop!r}")
    return stops


def _release(pending: str, stops: list[str]) -> tuple[str, str, bool]:
    """Split ``pending`` into (text to emit, text to hold, stop string found)."""
    hits = [i for i in (pending.find(s) for s in stops) if i >= 0]
    if hits:
        return pending[: min(hits)], "", True
    # hold the longest tail that could still grow into a stop string
    for k in range(min(len(pending), max((len(s) for s in stops), default=1) - 1), 0, -1):
        tail = pending[-k:]
        if any(s.startswith(tail) for s in stops):
            return pending[:-k], tail, False
    return pending, "", False


def stream_generate(
    model: Any,
    tokenizer: Any,
    prompt: Prompt,
    *,
    max_tokens: int = 256,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    repetition_context_size: int = 20,
    seed: int | None = None,
    stop: str | Sequence[str] | None = None,
    prefill_step_size: int = 512,
    cache: list | None = None,
    kv_bits: KVBits | str = None,
    ignore_eos: bool = False,
    draft_model: Any = None,
    num_draft_tokens: int = 4,
    prompt_lookup: int | None = None,
    tree_width: int = 1,
    adaptive_drafts: bool = True,
) -> Iterator[GenerationResponse]:
    """Yield one GenerationResponse per generated token.

    ``prompt``: a string (encoded with the tokenizer's BOS), a list of token ids (used as is), or
    a list of chat messages ``{"role": ..., "content": ...}`` rendered with the chat template.
    Generation ends at an EOS token (unless ``ignore_eos``), when the text contains a ``stop``
    string (never emitted), after ``max_tokens`` tokens, or at the model's context length.
    ``kv_bits`` (8, or (8, 4) for K8/V4) keeps the KV cache in TurboQuant form; the default is
    full precision. ``seed`` makes sampling reproducible. ``cache`` (from
    ``make_prompt_cache``) continues an earlier sequence; after the call it also holds the
    generated tokens that were fed back.
    Speculative decoding (``docs/speculative.md``): ``draft_model`` (a model sharing the
    tokenizer) or ``prompt_lookup`` = n (n-gram drafts from the prompt and output) proposes up
    to ``num_draft_tokens`` tokens that the model verifies in one forward; greedy output is the
    same tokens, sampled output the same distribution. ``tree_width`` > 1 (greedy, with a draft
    model) verifies a token tree with that many candidates per depth. ``adaptive_drafts``
    (default): each round drafts the k <= ``num_draft_tokens`` with the most expected tokens per
    second, from the acceptance so far and the measured verify times (k = 0: a plain step);
    False: always ``num_draft_tokens`` (a token tree always is).
    Arguments are checked here, before the first token: SamplingOptionsError for a bad option,
    InvalidArgumentError for a bad prompt (token ids must lie in the model's vocabulary),
    ContextLengthError for a prompt longer than the model's context.
    """
    validate_sampling_options(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        context_size=repetition_context_size,
    )
    check_generation_arguments(
        max_tokens=max_tokens,
        seed=seed,
        stop=stop,
        kv_bits=kv_bits,
        prefill_step_size=prefill_step_size,
        ignore_eos=ignore_eos,
    )
    stops = _normalize_stop(stop)
    speculative = draft_model is not None or prompt_lookup is not None
    if speculative:
        spec.check_speculative_arguments(
            draft_model, num_draft_tokens, prompt_lookup, tree_width, adaptive_drafts
        )
        if draft_model is not None:
            spec.check_draft_model(model, draft_model, tokenizer)
        if tree_width > 1 and temperature != 0:
            raise SamplingOptionsError("tree_width > 1 verifies greedy decoding (temperature 0)")
    if cache is not None and not isinstance(cache, list):
        raise InvalidArgumentError(
            f"cache must be the list make_prompt_cache returns, got {type(cache).__name__}"
        )
    ids = encode_prompt(tokenizer, prompt)
    check_token_ids(ids, vocab_limit(model, tokenizer))
    # a verify writes up to K drafts (a tree: K * width) that may have to be rolled back
    rollback = num_draft_tokens * tree_width + 1 if speculative else 0
    # the compiled decode step applies to caches made here (a caller's cache stays updated)
    compiled = cache is None and decode_mode() in ("compiled", "graph")
    if cache is None:
        cache = make_prompt_cache(model, kv_bits, reserve=rollback)
    elif speculative:
        spec.check_reserve(cache, rollback)
    start = getattr(cache[0], "offset", 0) if cache else 0
    limit = context_limit(model)
    if limit is not None and start + len(ids) > limit:
        cached = f" after {start} cached tokens" if start else ""
        raise ContextLengthError(
            f"prompt of {len(ids)} tokens{cached} exceeds the model context of {limit} tokens"
        )
    # the last position's logits give one more token, so a full context still yields one
    budget = max_tokens if limit is None else min(max_tokens, limit - start - len(ids) + 1)
    if temperature == 0:
        key = None  # greedy decoding draws nothing
    else:
        key = mx.random.key(secrets.randbits(63) if seed is None else seed)
    return _decode(
        model,
        tokenizer,
        ids,
        budget=budget,
        sampler=make_sampler(temperature, top_k, top_p, min_p),
        processors=make_logits_processors(repetition_penalty, repetition_context_size),
        history_size=repetition_context_size,
        key=key,
        stops=stops,
        prefill_step_size=prefill_step_size,
        cache=cache,
        eos_ids=set() if ignore_eos else set(tokenizer.eos_token_ids),
        compiled=compiled,
        kv_bits=parse_kv_bits(kv_bits),
        speculative=dict(
            draft_model=draft_model, prompt_lookup=prompt_lookup,
            num_draft_tokens=num_draft_tokens, tree_width=tree_width,
            adaptive_drafts=adaptive_drafts, warp=spec.Warp(temperature, top_k, top_p, min_p),
        ) if speculative else None,
    )  # fmt: skip


def _decode_env() -> str:
    """``HF2Q_DECODE`` as written, normalized (``auto`` when unset or empty)."""
    return os.environ.get("HF2Q_DECODE", "auto").strip().lower() or "auto"


def decode_mode() -> str:
    """``HF2Q_DECODE``: ``compiled`` (the compiled DecodeStep), ``graph`` (on CUDA, the step
    recorded once and replayed as one CUDA graph, ``hf2q_mlx/cuda_graph_step.py``; the compiled
    step elsewhere, or where the model's step records MLX ops), ``eager`` (a new graph per token
    on per-sequence caches) or ``auto`` (unset): the graph on CUDA (since session 21; on the H200
    1.4-1.5x the compiled step's tok/s on the 9B, 26B-A4B and 35B-A3B shapes, 1.07x on the
    GPU-bound 31B: docs/kernel_notes.md), compiled on other GPUs, eager on the CPU, where the
    compiled step measured 3-10 ms a token slower (docs/kernel_notes.md)."""
    mode = _decode_env()
    if mode not in ("auto", "compiled", "graph", "eager"):
        raise InvalidArgumentError(f"HF2Q_DECODE={mode!r}: expected auto, compiled, graph or eager")
    if mode == "auto":
        if mx.default_device().type == mx.DeviceType.cpu:
            return "eager"
        return "graph" if mx.cuda.is_available() else "compiled"
    return mode


def graph_step(step):
    """The CUDA graph step over ``step`` (made once, kept on it) when ``decode_mode()`` is
    ``graph`` (the default on CUDA) and MLX runs on CUDA; None otherwise, or when the model's
    step records MLX ops (e.g. a model with float MoE experts, or heads under 32 wide; TurboQuant
    caches with ``HF2Q_TQ_GRAPH=0``: said once on stderr when ``HF2Q_DECODE=graph`` was asked
    for; the compiled step then decodes). Greedy tokens come from the graph's argmax, sampled
    ones from MLX's sampler on the graph's logits."""
    if decode_mode() != "graph" or not mx.cuda.is_available():
        return None
    graph = step.__dict__.get("_graph")
    if graph is None:
        from hf2q_mlx.cuda_graph_step import CudaGraphStep
        from hf2q_mlx.custom_kernels.cuda_driver import Driver
        from hf2q_mlx.custom_kernels.launch_recorder import GraphCaptureError

        try:
            graph = CudaGraphStep(step, Driver())
            rec = graph.record(step._span(max(step.positions) + 1))
            if rec.logits is None:
                raise GraphCaptureError("the recorded step leaves no logits to sample from")
        except GraphCaptureError as err:
            if _decode_env() == "graph":
                print(f"hf2q-mlx: no CUDA graph for this model ({err}); compiled step",
                      file=sys.stderr)  # fmt: skip
            graph = False
        step.__dict__["_graph"] = graph
    return graph or None


def _decode(
    model,
    tokenizer,
    ids,
    *,
    budget,
    sampler,
    processors,
    history_size,
    key,
    stops,
    prefill_step_size,
    cache,
    eos_ids,
    speculative=None,
    compiled=False,
    kv_bits=None,
) -> Iterator[GenerationResponse]:
    if budget <= 0:
        return
    mx.reset_peak_memory()
    history = mx.array(ids[-history_size:], mx.int32)[None] if processors else None
    state = {"key": key, "history": history}

    def sample(logits: mx.array) -> tuple[mx.array, mx.array]:
        # logits (1, V) -> token (1,) int32 and its log-probability (1,)
        logits = logits.astype(mx.float32)
        for proc in processors:
            logits = proc(state["history"], logits)
        logprobs = sampling_kernels.log_softmax(logits)
        sub = None
        if state["key"] is not None:
            state["key"], sub = mx.random.split(state["key"])
        token = sampler(logprobs, sub).astype(mx.int32)
        if processors:
            state["history"] = mx.concatenate([state["history"], token[:, None]], axis=1)[
                :, -history_size:
            ]
        return token, mx.take_along_axis(logprobs, token[:, None], axis=-1)[:, 0]

    def plain_tokens() -> Iterator[tuple[int, float, int, int]]:
        y, logprob = sample(prefill(model, mx.array(ids, mx.int32), cache, prefill_step_size))
        mx.async_eval(y, logprob)
        # the compiled step (hf2q_mlx/decode_step.py) takes over caches this call made itself
        step = None
        if compiled and budget > 1:
            step = shared_step(model, 1, len(ids) + budget, cache, kv_bits=kv_bits)
        if step is not None:
            step.busy = True
            step.reset_row(0)
            step.adopt(0, cache)

        def forward(y: mx.array) -> mx.array:  # called inside cuda_cache.per_token()
            if step is not None:
                return step.decode(y)  # (1, V)
            return model(y[:, None], cache=cache)[:, -1, :]

        greedy = state["key"] is None and not processors
        graph = graph_step(step) if step is not None else None
        try:
            if graph is not None:
                # one replay per token, read back before the next (the graph keeps the GPU busy
                # on its own); a sampled token is drawn by MLX from the graph's logits
                token, lp = y.item(), logprob.item()
                for n in range(budget):
                    yield token, lp, 0, 0
                    if n + 1 < budget:
                        next_ids = graph.decode([token])
                        if greedy:
                            token, lp = next_ids[0], graph.logprob(0, next_ids[0])
                        else:
                            with cuda_cache.per_token():
                                t, t_lp = sample(graph.last.logits)
                            token, lp = t.item(), t_lp.item()
                return
            for n in range(budget):
                if n + 1 < budget:
                    # build and launch step n+1 before reading token n back
                    with cuda_cache.per_token():
                        next_y, next_logprob = sample(forward(y))
                    mx.async_eval(next_y, next_logprob)
                yield y.item(), logprob.item(), 0, 0
                if n + 1 < budget:
                    y, logprob = next_y, next_logprob
        finally:
            if step is not None:
                step.busy = False

    if speculative is None:
        source = plain_tokens()
    else:
        source = spec.speculative_tokens(
            model, ids, cache, budget=budget, processors=processors, history_size=history_size,
            key=key, prefill_fn=prefill, prefill_step=prefill_step_size, compiled=compiled,
            kv_bits=kv_bits, **speculative,
        )  # fmt: skip
    tic = time.perf_counter()
    detok = tokenizer.detokenizer()
    pending = ""
    prompt_tps = 0.0
    t_first = tic
    n = 0
    for token, token_logprob, drafted, accepted in source:
        n += 1
        now = time.perf_counter()
        if n == 1:
            t_first = now
            prompt_tps = len(ids) / max(now - tic, 1e-9)

        finish = None
        if token in eos_ids:
            finish = "stop"
            detok.finalize()
        else:
            detok.add_token(token)
            if n == budget:
                finish = "length"
                detok.finalize()
        pending += detok.last_segment
        text, pending, hit = _release(pending, stops)
        if hit:
            finish = "stop"
        elif finish is not None:
            text, pending = text + pending, ""

        yield GenerationResponse(
            text=text,
            token=token,
            logprob=token_logprob,
            prompt_tokens=len(ids),
            prompt_tps=prompt_tps,
            generation_tokens=n,
            generation_tps=(n - 1) / (now - t_first) if n > 1 else 0.0,
            peak_memory=mx.get_peak_memory() / 1e9,
            finish_reason=finish,
            drafted_tokens=drafted,
            accepted_tokens=accepted,
        )
        if finish is not None:
            return


def generate(
    model: Any, tokenizer: Any, prompt: Prompt, *, verbose: bool = False, **kwargs: Any
) -> str:
    """The full generated text; ``verbose`` streams it to stdout and prints speeds to stderr.
    Keyword options are those of ``stream_generate``."""
    parts: list[str] = []
    last = None
    for last in stream_generate(model, tokenizer, prompt, **kwargs):
        parts.append(last.text)
        if verbose:
            print(last.text, end="", flush=True)
    if verbose:
        print()
        if last is not None:
            print(format_stats(last), file=sys.stderr)
    return "".join(parts)


def format_stats(r: GenerationResponse) -> str:
    """Lines of speeds and memory for the last response of a run (and draft acceptance)."""
    drafts = ""
    if r.drafted_tokens:
        rate = r.accepted_tokens / r.drafted_tokens
        drafts = f"\nspeculative: {r.accepted_tokens} of {r.drafted_tokens} drafts accepted"
        drafts += f" ({rate:.0%})"
    return (
        f"prompt: {r.prompt_tokens} tokens, {r.prompt_tps:.1f} tokens/s\n"
        f"generation: {r.generation_tokens} tokens, {r.generation_tps:.1f} tokens/s\n"
        f"peak memory: {r.peak_memory:.3f} GB{drafts}"
    )
