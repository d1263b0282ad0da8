"""Speculative decoding: drafts (a small draft model or prompt lookup), one target forward that
verifies them, acceptance, and exact rollback of every cache kind.

A round feeds the target ``todo + drafts``: ``todo`` are the decided tokens the target cache does
not hold yet (the last sampled token, plus accepted tokens after a recurrent rollback), the
drafts K proposed continuations. Logits at the last ``todo`` position and at each draft decide:
greedy keeps drafts while they equal the target's argmax; sampling keeps draft i with
probability min(1, p_i(d) / q_i(d)) and otherwise draws from the normalized residual
max(0, p_i - q_i), which leaves the output distributed as the target's own sampling. Every round
emits the accepted drafts and one more token from the target.

Rollback: KV caches (growing, ring with ``reserve`` slots, TurboQuant) trim their rejected
entries; a model with recurrent layers (Qwen 3.5) restores a snapshot taken before the verify
and re-feeds the accepted tokens at the front of the next round (``todo``). A token tree
(``verify_tree``) writes every candidate, then keeps the accepted path (``cache.keep``).

On the compiled step (``decode_step.DecodeStep``, what ``stream_generate`` uses when it made the
caches itself), ``verify_step_rows`` verifies each row at its own position in one compiled call
and rolls every cache kind back exactly (recurrent layers keep each token's state), so ``todo``
is always the last emitted token. Each round's draft count comes from ``draft_length.DraftLength``
(the k with the most expected tokens per second; fixed K with ``adaptive_drafts=False``, which
pads every verify to K + 1: one trace); each verify length L is its own trace, compiled once.
Greedy prompt lookup there (no logits processors) runs pipelined rounds instead
(``pipelined_rounds``: round r + 1 is launched before round r is read).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from hf2q_mlx import pipelined_rounds
from hf2q_mlx.custom_kernels import cuda_cache
from hf2q_mlx.custom_kernels import sampling as sampling_kernels
from hf2q_mlx.decode_step import DecodeStep, shared_step
from hf2q_mlx.draft_length import DraftLength, RoundCosts
from hf2q_mlx.errors import DraftModelError, SamplingOptionsError
from hf2q_mlx.models.cache import TokenTree
from hf2q_mlx.models.recurrent_cache import RecurrentCache, restore_cache, snapshot_cache
from hf2q_mlx.sampling import apply_min_p, apply_top_k, apply_top_p

MAX_DRAFT_TOKENS = 32
MAX_TREE_WIDTH = 8

# (row index, logits (N, V) of that row's positions, the N tokens at those positions) -> logits
Process = Callable[[int, mx.array, mx.array], mx.array]


@dataclass(frozen=True)
class Warp:
    """The sampler's transforms (``sampling.make_sampler``), kept apart so that speculative
    sampling can read the probabilities it would draw from. Temperature 0: greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def logits(self, logits: mx.array) -> mx.array:
        """(N, V) -> tempered, filtered fp32 logits (-inf where a filter drops a token)."""
        x = logits.astype(mx.float32) * (1.0 / self.temperature)
        return apply_min_p(apply_top_p(apply_top_k(x, self.top_k), self.top_p), self.min_p)

    def probs(self, logits: mx.array) -> mx.array:
        return mx.softmax(self.logits(logits), axis=-1, precise=True)


def check_speculative_arguments(
    draft_model: Any,
    num_draft_tokens: Any,
    prompt_lookup: Any,
    tree_width: Any = 1,
    adaptive_drafts: Any = True,
) -> None:
    """SamplingOptionsError for a K or n-gram size out of range, or for both drafters at once."""
    if not isinstance(adaptive_drafts, bool):
        raise SamplingOptionsError(
            f"adaptive_drafts must be True or False, got {adaptive_drafts!r}"
        )
    if draft_model is not None and prompt_lookup is not None:
        raise SamplingOptionsError("give draft_model or prompt_lookup, not both")
    if not is_int(num_draft_tokens) or not 1 <= num_draft_tokens <= MAX_DRAFT_TOKENS:
        raise SamplingOptionsError(
            f"num_draft_tokens must be an integer in [1, {MAX_DRAFT_TOKENS}], "
            f"got {num_draft_tokens!r}"
        )
    if prompt_lookup is not None and (not is_int(prompt_lookup) or not 1 <= prompt_lookup <= 64):
        raise SamplingOptionsError(
            f"prompt_lookup (the n-gram size) must be an integer in [1, 64], got {prompt_lookup!r}"
        )
    if not is_int(tree_width) or not 1 <= tree_width <= MAX_TREE_WIDTH:
        raise SamplingOptionsError(
            f"tree_width must be an integer in [1, {MAX_TREE_WIDTH}], got {tree_width!r}"
        )
    if tree_width > 1 and draft_model is None:
        raise SamplingOptionsError("tree_width > 1 needs a draft_model (the tree's shape)")


def is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def logits_width(model: Any) -> int | None:
    args = getattr(model, "args", None)
    v = getattr(args, "vocab_size", None)
    return v if isinstance(v, int) else None


def check_draft_model(target: Any, draft: Any, tokenizer: Any) -> None:
    """DraftModelError when the draft cannot propose tokens of the target's vocabulary."""
    if not callable(draft) or not hasattr(draft, "layers"):
        raise DraftModelError(
            f"draft_model must be a model from hf2q_mlx.load, got {type(draft).__name__}"
        )
    vt, vd = logits_width(target), logits_width(draft)
    if vt is not None and vd is not None and vt != vd:
        raise DraftModelError(
            f"draft model vocabulary ({vd} tokens) differs from the target's ({vt}); "
            "a draft must share the target's tokenizer"
        )
    size = getattr(tokenizer, "vocab_size", None)
    if vd is not None and isinstance(size, int) and vd < size:
        raise DraftModelError(
            f"draft model embeds {vd} tokens but the tokenizer has {size}; "
            "a draft must share the target's tokenizer"
        )


def has_recurrent(cache: list) -> bool:
    return any(isinstance(c, RecurrentCache) for c in cache)


def check_reserve(cache: list, rollback: int) -> None:
    """SamplingOptionsError unless every ring cache can roll back ``rollback`` tokens."""
    for c in cache:
        window = getattr(c, "window", None)
        if window is not None and c.capacity - window + 1 < rollback:
            raise SamplingOptionsError(
                f"a sliding-window cache with {c.capacity - window} reserve slots cannot roll "
                f"back {rollback} drafted tokens; build it with make_prompt_cache(model, "
                f"reserve={rollback})"
            )


# ---- acceptance -----------------------------------------------------------------------------


def accept_candidates(
    logits: mx.array,
    drafts: mx.array,
    warp: Warp,
    q: mx.array | None = None,
    key: mx.array | None = None,
) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """Device-side acceptance of one row: ``logits`` (K+1, V) (processed, position i predicts
    the token after draft i-1), ``drafts`` (K,) int32, ``q`` (K, V) the draft's probabilities
    (None: deterministic drafts, a point mass), ``key`` (None: MLX's global generator).
    Returns (ok (K,) bool: draft i passes its test; cand (K+1,): the token emitted when the
    first failure is at i (i = K: all accepted); the log-probabilities of the drafts (K,) and of
    the candidates (K+1,)). The first False of ``ok`` decides."""
    K = drafts.shape[0]
    logprobs = sampling_kernels.log_softmax(logits)

    def picked(tokens: mx.array, n: int) -> mx.array:
        return mx.take_along_axis(logprobs[:n], tokens[:, None], axis=-1)[:, 0]

    if warp.greedy:  # on the log-probabilities, as plain decoding picks
        cand = sampling_kernels.argmax(logprobs).astype(mx.int32)
        return cand[:K] == drafts, cand, picked(drafts, K), picked(cand, K + 1)
    p = warp.probs(logits)  # (K+1, V)
    pd = mx.take_along_axis(p[:K], drafts[:, None], axis=-1)[:, 0]
    if q is None:
        qd = mx.ones_like(pd)
        residual = mx.put_along_axis(p[:K], drafts[:, None], mx.zeros((K, 1), p.dtype), axis=-1)
    else:
        qd = mx.take_along_axis(q, drafts[:, None], axis=-1)[:, 0]
        residual = mx.maximum(p[:K] - q, 0.0)
    k_accept, k_draw = mx.random.split(key) if key is not None else (None, None)
    ok = mx.random.uniform(shape=(K,), key=k_accept) * qd < pd  # u < p / q
    rows = mx.concatenate([residual, p[K:]], axis=0)  # (K+1, V), normalized by categorical
    cand = mx.random.categorical(mx.log(rows), axis=-1, key=k_draw).astype(mx.int32)
    return ok, cand, picked(drafts, K), picked(cand, K + 1)


def first_rejection(ok: Sequence[bool]) -> int:
    for i, good in enumerate(ok):
        if not good:
            return i
    return len(ok)


@dataclass
class RowResult:
    """One row's verify: ``tokens`` emitted (accepted drafts then the target's token),
    their ``logprobs``, ``accepted`` drafts, and ``todo`` for the row's next verify."""

    tokens: list[int]
    logprobs: list[float]
    accepted: int
    todo: list[int] = field(default_factory=list)


def _sequences(todo, drafts) -> list[tuple[int, mx.array]]:
    """Per row: (len(todo), todo + drafts as one int32 array)."""
    out = []
    for t, d in zip(todo, drafts):
        d = d if isinstance(d, mx.array) else mx.array(list(d), dtype=mx.int32)
        out.append((len(t), mx.concatenate([mx.array(list(t), dtype=mx.int32), d])))
    return out


def _accept_rows(logits, where, seqs, tokens, warp, draft_probs, key, process):
    """Acceptance for every row of a verify: row i's logits are ``logits[where[i]]`` (B, L, V)
    and its input ``tokens[where[i]]``; one evaluation, then the decisions on the host ->
    (RowResult per row, tokens as host lists)."""
    where = list(where)
    keys = [None] * len(seqs) if key is None else list(mx.random.split(key, len(seqs)))
    outs = []
    for i, (b, (t, r)) in enumerate(zip(where, seqs)):
        K = r.shape[0] - t
        lg = logits[b, t - 1 : t + K]
        if process is not None:
            lg = process(i, lg, r[t - 1 : t + K])
        q = draft_probs[i] if draft_probs is not None else None
        outs.append(accept_candidates(lg, r[t:], warp, q, keys[i]))
    mx.eval(outs, tokens)
    host = tokens.tolist()
    results = []
    for b, (t, _), out in zip(where, seqs, outs):
        ok, cand, lp_drafts, lp_cand = (x.tolist() for x in out)
        a = first_rejection(ok)
        emitted = host[b][t : t + a] + [cand[a]]
        results.append(RowResult(emitted, lp_drafts[:a] + [lp_cand[a]], a))
    return results, host


def _rollback(cache: list, snap: list | None, written: int, keep: int) -> int:
    """Forget the last ``written - keep`` entries; returns how many of the written stay."""
    if keep >= written:
        return written
    if snap is not None:  # recurrent state: back to before the forward
        restore_cache(cache, snap)
        return 0
    for c in cache:
        c.trim(written - keep)
    return keep


def verify_rows(
    model: Any,
    cache: list,
    todo: Sequence[Sequence[int]],
    drafts: Sequence[Sequence[int] | mx.array],
    *,
    warp: Warp = Warp(),
    draft_probs: Sequence[mx.array | None] | None = None,
    key: mx.array | None = None,
    process: Process | None = None,
) -> list[RowResult]:
    """Verify B rows in one target forward, each with its own ``todo`` and ``drafts``.

    Rows share the cache, so they must be at one common offset (the limit of today's caches):
    shorter rows are padded at the end, and the cache keeps the shortest committed prefix; each
    row's ``todo`` then holds what it must re-feed next time (pass it back as ``todo``).
    ``draft_probs[b]`` (K_b, V): the distribution row b's drafts were drawn from (None: point
    masses, e.g. prompt lookup). ``process(b, logits, tokens)`` applies logits processors.
    """
    rows = _sequences(todo, drafts)
    L = max(r.shape[0] for _, r in rows)
    tokens = mx.stack([mx.pad(r, (0, L - r.shape[0])) for _, r in rows])  # (B, L)
    snap = snapshot_cache(cache) if has_recurrent(cache) else None
    with cuda_cache.per_token():
        logits = model(tokens, cache=cache).astype(mx.float32)  # (B, L, V)
    results, host = _accept_rows(logits, range(len(rows)), rows, tokens, warp, draft_probs, key,
                                 process)  # fmt: skip
    committed = [t + res.accepted for (t, _), res in zip(rows, results)]
    kept = _rollback(cache, snap, L, min(committed))
    for b, res in enumerate(results):
        res.todo = host[b][kept : committed[b]] + [res.tokens[-1]]
    return results


def verify_step_rows(
    step: DecodeStep,
    rows: Sequence[int],
    todo: Sequence[Sequence[int]],
    drafts: Sequence[Sequence[int] | mx.array],
    *,
    warp: Warp = Warp(),
    draft_probs: Sequence[mx.array | None] | None = None,
    key: mx.array | None = None,
    process: Process | None = None,
    length: int | None = None,
) -> list[RowResult]:
    """``verify_rows`` on a compiled step: ``rows`` of ``step`` verify their ``todo + drafts``
    in one call, each at its own position (the other rows idle), padded at the end to one length
    (at least ``length``: a fixed length keeps one compiled trace when the draft count varies).
    Each row then rolls back exactly what it rejected, so its ``todo`` is the last emitted token.
    ``process(i, logits, tokens)`` gets the index i into ``rows``."""
    seqs = _sequences(todo, drafts)
    L = max([r.shape[0] for _, r in seqs] + [length or 1])
    padded = {row: mx.pad(r, (0, L - r.shape[0])) for row, (_, r) in zip(rows, seqs)}
    idle = mx.zeros((L,), dtype=mx.int32)
    tokens = mx.stack([padded.get(b, idle) for b in range(step.max_batch)])  # (B, L)
    active = [b in padded for b in range(step.max_batch)]
    logits = step.verify(tokens, active).astype(mx.float32)  # (B, L, V)
    results, _ = _accept_rows(logits, rows, seqs, tokens, warp, draft_probs, key, process)
    counts = [0] * step.max_batch
    for row, (t, _), res in zip(rows, seqs, results):
        res.todo = [res.tokens[-1]]
        counts[row] = L - (t + res.accepted)  # the cache keeps todo and the accepted drafts
    step.rollback_rows(counts)
    return results


# ---- token tree -------------------------------------------------------------------------------


def tree_layout(n_todo: int, depth: int, width: int) -> tuple[list[int], list[int]]:
    """Parents and depths of a verify input: ``n_todo`` sequential tokens, then a chain of
    ``depth`` draft tokens, then ``width - 1`` alternatives at each depth (siblings of the chain
    token there, leaves). Depth 0 = the last todo token."""
    parents = list(range(-1, n_todo - 1))
    depths = list(range(-n_todo + 1, 1))
    for i in range(1, depth + 1):
        parents.append(n_todo - 2 + i)
        depths.append(i)
    for i in range(1, depth + 1):
        for _ in range(width - 1):
            parents.append(n_todo - 2 + i)
            depths.append(i)
    return parents, depths


def tree_mask(parents: list[int]) -> np.ndarray:
    """(L, L) bool: token i may attend token j when j is i or one of its ancestors."""
    L = len(parents)
    mask = np.eye(L, dtype=bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] |= mask[p]
    return mask


def verify_tree(
    model: Any,
    cache: list,
    todo: Sequence[int],
    chain: mx.array,
    alternatives: mx.array,
    process: Callable[[mx.array, mx.array], mx.array] | None = None,
) -> RowResult:
    """Greedy verify of a token tree in one forward: ``chain`` (K,) the draft's best path,
    ``alternatives`` (K, W-1) other candidates at each depth (leaves). Accepts the longest path
    that equals the target's argmax; the cache keeps exactly that path. KV caches only.
    ``process(logits (1, V), drafts on the node's path)`` applies logits processors."""
    t, K = len(todo), chain.shape[0]
    width = 1 + (alternatives.shape[1] if alternatives.ndim == 2 else 0)
    parents, depths = tree_layout(t, K, width)
    o = cache[0].offset
    tree = TokenTree(
        positions=mx.array([[o + t - 1 + d for d in depths]], dtype=mx.int32),
        mask=mx.array(tree_mask(parents)),
    )
    tokens = mx.concatenate([mx.array(list(todo), dtype=mx.int32), chain, alternatives.reshape(-1)])
    for c in cache:
        c.tree = tree
    try:
        with cuda_cache.per_token():
            logits = model(tokens[None], cache=cache)[0].astype(mx.float32)  # (L, V)
    finally:
        for c in cache:
            c.tree = None
    if process is not None:  # each node's history: the drafts on its root-to-node path
        rows = [logits[i : i + 1] for i in range(t - 1)]
        for n in range(t - 1, len(parents)):
            anc = []
            while n >= t:
                anc.append(n)
                n = parents[n]
            rows.append(
                process(
                    logits[len(rows) : len(rows) + 1], tokens[mx.array(anc[::-1], dtype=mx.int32)]
                )
            )
        logits = mx.concatenate(rows)
    logprobs = sampling_kernels.log_softmax(logits)
    best = sampling_kernels.argmax(logprobs).astype(mx.int32)
    best_lp = mx.take_along_axis(logprobs, best[:, None], axis=-1)[:, 0]
    mx.eval(best, tokens, best_lp)
    best_h, tok_h, best_lp = best.tolist(), tokens.tolist(), best_lp.tolist()
    cur, path = t - 1, list(range(t))
    for i in range(1, K + 1):
        g = best_h[cur]
        at_depth = [t - 1 + i] + [t + K + (i - 1) * (width - 1) + r for r in range(width - 1)]
        hit = next((n for n in at_depth if tok_h[n] == g), None)
        if hit is None:
            break
        path.append(hit)
        cur = hit
        if hit != at_depth[0]:
            break  # a leaf: nothing below it
    nxt = best_h[cur]
    emitted = [tok_h[n] for n in path[t:]] + [nxt]
    lps = [best_lp[n] for n in path[t - 1 :]]  # each emitted token is its parent's argmax
    for c in cache:
        c.keep(o, path)
    return RowResult(emitted, lps, len(path) - t, [nxt])


# ---- drafters -----------------------------------------------------------------------------------


class PromptLookup:
    """Drafts by n-gram lookup: the tokens that followed the latest earlier occurrence of the
    last ``n`` tokens (then n-1, ... 1) in the prompt and the output so far."""

    def __init__(self, n: int):
        self.n = n

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        arr = np.asarray(tokens, dtype=np.int64)
        N = arr.shape[0]
        for size in range(min(self.n, N - 1), 0, -1):
            pattern = arr[N - size :]
            windows = np.lib.stride_tricks.sliding_window_view(arr[: N - 1], size)
            hits = np.nonzero((windows == pattern).all(axis=1))[0]
            if hits.size:
                start = int(hits[-1]) + size
                return arr[start : start + k].tolist()
        return []


class DraftModel:
    """A small model sharing the target's tokenizer drafts K tokens, one forward each, on the
    device without reading anything back (the drafts feed the target's verify directly).

    ``needed`` (tokens the draft will hold, given when the caller made the target's caches):
    a draft without recurrent layers runs on its compiled step (``DecodeStep``: the queued
    tokens as one verify padded to K + 1, then K - 1 decodes; rollback moves the position back)."""

    def __init__(self, model: Any, k: int, warp: Warp, width: int = 1, needed: int = 0):
        self.model, self.k, self.warp, self.width = model, k, warp, width
        # rings keep k + 2 extra slots, recurrent states k + 2 tokens of history: trim is exact
        self.cache = model.make_cache(reserve=k + 2)
        self.todo: list[int] = []  # decided tokens the draft cache does not hold yet
        self.fed = -1  # drafts of this round's proposal that went through it (-1: none)
        self.step = None
        if needed and not has_recurrent(self.cache):  # None too when the step is in use
            self.step = shared_step(model, 1, needed, reserve=k)

    def prefill(self, ids: Sequence[int], prefill_fn: Callable, step: int) -> None:
        """Fill the draft cache with the prompt (``prefill_fn`` = ``generation.prefill``)."""
        prefill_fn(self.model, mx.array(list(ids), dtype=mx.int32), self.cache, step)
        if self.step is not None:
            self.step.busy = True
            self.step.reset_row(0)
            self.step.adopt(0, self.cache)

    def close(self) -> None:
        if self.step is not None:
            self.step.busy = False

    def _forward(self, x: mx.array) -> mx.array:
        """x (n,) int32 tokens -> logits (1, V) fp32 after the last one."""
        if self.step is None:
            with cuda_cache.per_token():
                return self.model(x[None], cache=self.cache)[0, -1:].astype(mx.float32)
        if x.shape[0] == 1:
            return self.step.decode(x).astype(mx.float32)
        L = self.k + 1  # one verify shape for every round: one compiled trace
        while x.shape[0] > L:  # more queued than a round emits (not in stream_generate)
            self.step.verify(x[None, :L])
            x = x[L:]
        n = x.shape[0]
        logits = self.step.verify(mx.pad(x, (0, L - n))[None])[0, n - 1 : n]
        self.step.rollback(0, L - n)
        return logits.astype(mx.float32)

    def propose(
        self,
        k: int,
        key: mx.array | None,
        history: Sequence[int] = (),
        processors: Sequence[Callable] = (),
        history_size: int = 20,
    ) -> tuple[mx.array, mx.array | None, mx.array | None]:
        """-> drafts (k,) int32, their probabilities (k, V) when sampling, and the next
        ``width - 1`` best tokens (k, width - 1) at each depth (a token tree's leaves).
        ``processors`` (the target's, e.g. a repetition penalty over ``history`` and the drafts)
        shape the draft's logits as the target's are shaped, so a good draft agrees."""
        x = mx.array(self.todo, dtype=mx.int32)
        hist = mx.array(list(history[-history_size:]), dtype=mx.int32)
        drafts, probs, alts = [], [], []
        keys = [None] * k if key is None else list(mx.random.split(key, k))
        for i in range(k):
            logits = self._forward(x)  # (1, V)
            for proc in processors:
                logits = proc(hist[None], logits)
            if self.warp.greedy:
                d = sampling_kernels.argmax(logits).astype(mx.int32)
                if self.width > 1:
                    alts.append(mx.argsort(-logits[0])[1 : self.width].astype(mx.int32))
            else:
                q = self.warp.probs(logits)
                d = mx.random.categorical(mx.log(q), key=keys[i]).astype(mx.int32)
                probs.append(q[0])
            drafts.append(d)
            x = d  # (1,): the next forward feeds it; the k-th draft is fed next round
            if processors:
                hist = mx.concatenate([hist, d])[-history_size:]
        self.fed = k - 1
        return (
            mx.concatenate(drafts),
            mx.stack(probs) if probs else None,
            mx.stack(alts) if alts else None,
        )

    def commit(self, emitted: Sequence[int], drafts: Sequence[int]) -> None:
        """After a verify that emitted ``emitted`` (accepted tokens, then the target's own) for
        ``drafts`` proposed: keep the draft cache up to the agreed prefix, queue the rest."""
        if self.fed < 0:  # no proposal this round
            self.todo += list(emitted)
            return
        m = 0
        while m < min(len(emitted) - 1, len(drafts)) and emitted[m] == drafts[m]:
            m += 1
        kept = min(m, self.fed)
        if self.step is not None:
            self.step.rollback(0, self.fed - kept)
        else:
            for c in self.cache:
                c.trim(self.fed - kept)
        self.todo = list(emitted[kept:])
        self.fed = -1


def speculative_tokens(
    model: Any,
    ids: Sequence[int],
    cache: list,
    *,
    budget: int,
    warp: Warp,
    processors: list,
    history_size: int,
    key: mx.array | None,
    draft_model: Any = None,
    prompt_lookup: int | None = None,
    num_draft_tokens: int = 4,
    tree_width: int = 1,
    adaptive_drafts: bool = True,
    prefill_fn: Callable,
    prefill_step: int = 512,
    compiled: bool = False,
    kv_bits: tuple[int, int] | None = None,
) -> Iterator[tuple[int, float, int, int]]:
    """Yield (token, logprob, drafted so far, accepted so far) for each generated token.

    The first token comes from the prompt's prefill as in plain decoding; then each round
    drafts up to ``num_draft_tokens`` tokens and verifies them in one target forward
    (``verify_rows``, or ``verify_tree`` when ``tree_width`` > 1 and the caches are KV caches).
    ``adaptive_drafts``: each round drafts the k in 0..K that ``DraftLength`` expects to give
    the most tokens per second (a token tree, ``tree_width`` > 1, keeps K); False: always K.
    ``compiled`` (the caller made ``cache`` and it has a static form): chain verifies run on
    the model's compiled step (``verify_step_rows``), which takes over ``cache`` after the prefill;
    ``kv_bits``: the (k, v) bits of ``cache``'s TurboQuant form, None for full precision.
    """
    tokens = list(ids)
    logits = prefill_fn(model, mx.array(tokens, dtype=mx.int32), cache, prefill_step)
    step, drafter = None, None
    # greedy prompt lookup on the compiled step runs pipelined rounds (pipelined_rounds.py)
    pipelined = (
        PIPELINE_ROUNDS and compiled and warp.greedy and tree_width == 1 and not processors
        and prompt_lookup is not None and draft_model is None
    )  # fmt: skip
    # a token tree stays eager; recurrent models verify a tree's chain, so they may use the step
    if compiled and (tree_width == 1 or has_recurrent(cache)) and budget > 1:
        # rows hold the prompt, the output and a verify's padded drafts (pipelined: a round
        # launched before the previous one's rollback is known, K + 1 more)
        needed = len(tokens) + budget + num_draft_tokens * (2 if pipelined else 1)
        step = shared_step(model, 1, needed, cache, reserve=num_draft_tokens, kv_bits=kv_bits)
    if step is not None:
        step.busy = True
    try:
        if step is not None:
            step.reset_row(0)
            step.adopt(0, cache)
            drafting = draft_model is not None or prompt_lookup is not None
            if adaptive_drafts and tree_width == 1 and drafting:
                # the controller may pick any k: trace every verify length now, not mid-stream
                step.warm_verify(0, range(2, num_draft_tokens + 2))
        if draft_model is not None:
            # the draft holds the output, a round's drafts and a verify's padding
            needed = len(tokens) + budget + 2 * num_draft_tokens + 2 if compiled else 0
            drafter = DraftModel(draft_model, num_draft_tokens, warp, tree_width, needed)
            drafter.prefill(tokens, prefill_fn, prefill_step)
        elif prompt_lookup is not None:
            drafter = PromptLookup(prompt_lookup)
        yield from _rounds(
            model, tokens, cache, logits, step, drafter, budget=budget, warp=warp,
            processors=processors, history_size=history_size, key=key,
            num_draft_tokens=num_draft_tokens, tree_width=tree_width,
            control=DraftLength(
                num_draft_tokens,
                adaptive_drafts and tree_width == 1,
                memory=pipelined_round_costs(step, num_draft_tokens)
                if pipelined
                else round_costs(step, draft_model, num_draft_tokens),
            ),
            pipelined=pipelined and step is not None,
        )  # fmt: skip
    finally:
        if step is not None:
            step.busy = False
        if isinstance(drafter, DraftModel):
            drafter.close()


# greedy prompt lookup on the compiled step (no logits processors, no token tree) runs
# pipelined rounds (hf2q_mlx/pipelined_rounds.py); False: every round reads its decisions back
PIPELINE_ROUNDS = True

PLAIN_RUN = 8  # tokens of pipelined plain decoding when the draft-length controller picks k = 0
# While k = 0 keeps winning, each run doubles, up to PLAIN_RUN_MAX: a run restarts the pipeline
# (its first step is built while the GPU waits); suspected, not measured, to be most of the 8-11 %
# the adaptive rows lost to plain decoding at 0.5 acceptance on the H200 (docs/speculative.md).
PLAIN_RUN_MAX = 32


def round_costs(step: DecodeStep | None, draft_model: Any, k: int) -> RoundCosts | None:
    """The round times learned on ``step`` for this drafter (a draft model, or prompt lookup
    when None) and K, kept on the step so the next request starts from them (None: no step,
    each generation measures its own)."""
    if step is None:
        return None
    key = (None if draft_model is None else id(draft_model), k)
    return step.round_costs.setdefault(key, RoundCosts())


def pipelined_round_costs(step: DecodeStep | None, k: int) -> RoundCosts | None:
    """``round_costs`` of pipelined prompt-lookup rounds (cheaper rounds: a table of their own)."""
    if step is None:
        return None
    return step.round_costs.setdefault(("pipelined", None, k), RoundCosts())


def plain_run(
    step: DecodeStep, last: int, n: int, warp: Warp, key: mx.array | None, process: Any
) -> Iterator[tuple[int, float]]:
    """Yield (token, logprob) for ``n`` tokens after ``last`` (row 0 of ``step`` holds every
    token before it) by plain decoding: token i + 1's step is launched before token i is read.
    Each token is drawn from the target as a k = 0 verify draws it (greedy: the argmax of the
    log-probabilities; sampled: from ``warp``'s probabilities); ``process(logits, pending)``
    applies logits processors with the tokens not yet read back (``pending``) after the host's."""
    keys = list(mx.random.split(key, n)) if key is not None else [None] * n

    def next_token(y: mx.array, i: int) -> tuple[mx.array, mx.array]:
        lg = step.decode(y).astype(mx.float32)  # (1, V)
        if process is not None:  # the first y is the host's last token, the others pending
            lg = process(lg, y if i > 0 else y[:0])
        logprobs = sampling_kernels.log_softmax(lg)
        if warp.greedy:
            tok = sampling_kernels.argmax(logprobs)
        else:
            tok = mx.random.categorical(mx.log(warp.probs(lg)), axis=-1, key=keys[i])
        tok = tok.astype(mx.int32).reshape(1)
        return tok, mx.take_along_axis(logprobs, tok[:, None], axis=-1)[0, 0]

    y, lp = next_token(mx.array([last], dtype=mx.int32), 0)
    mx.async_eval(y, lp)
    for i in range(n):
        if i + 1 < n:  # build and launch the next step before reading this token back
            nxt = next_token(y, i + 1)
            mx.async_eval(*nxt)
        yield int(y.item()), float(lp.item())
        if i + 1 < n:
            y, lp = nxt


def _rounds(
    model, tokens, cache, logits, step, drafter, *, budget, warp, processors, history_size, key,
    num_draft_tokens, tree_width, control, pipelined=False,
) -> Iterator[tuple[int, float, int, int]]:  # fmt: skip
    tree = tree_width > 1 and not has_recurrent(cache)

    def process_one(x: mx.array, drafts: mx.array) -> mx.array:
        # x (1, V) predicts the token after ``drafts``, which follow the committed tokens
        base = mx.array(tokens[-history_size:], dtype=mx.int32)
        hist = mx.concatenate([base, drafts])[-history_size:][None]
        for proc in processors:
            x = proc(hist, x)
        return x

    def process(_b: int, lg: mx.array, toks: mx.array) -> mx.array:
        # row i predicts the token after toks[i]: its drafts are toks[1 : i + 1]
        return mx.concatenate(
            [process_one(lg[i : i + 1], toks[1 : i + 1]) for i in range(lg.shape[0])]
        )

    first = logits.astype(mx.float32)
    if processors:
        first = process(0, first, mx.array([tokens[-1]], dtype=mx.int32))
    logprobs = sampling_kernels.log_softmax(first)
    if warp.greedy:
        token = sampling_kernels.argmax(logprobs)
    else:
        key, sub = mx.random.split(key)
        token = mx.random.categorical(warp.logits(logprobs), key=sub)
    t0 = int(token.item())
    tokens.append(t0)
    emitted, drafted, accepted = 1, 0, 0
    yield t0, float(logprobs[0, t0].item()), 0, 0
    todo = [t0]
    if pipelined and budget > 1:  # greedy prompt lookup: the rounds' decisions stay on the device
        lookup = pipelined_rounds.DeviceLookup(drafter.n, num_draft_tokens)
        yield from pipelined_rounds.greedy_tokens(step, tokens, budget - 1, lookup, control)
        return
    if isinstance(drafter, DraftModel):
        drafter.todo = [t0]
    run_length = PLAIN_RUN
    while emitted < budget:
        # k depends on past rounds only (never this round's draws): sampling stays exact
        k = min(control.choose(), budget - emitted - 1)
        t_round = control.clock()
        if k == 0 and step is not None and control.adaptive and not tree:
            # no drafts: a run of plain decoding, pipelined as plain decoding is (a one-token
            # verify reads its token back before the next step is built, so it costs more)
            n = min(run_length, budget - emitted)
            run_length = min(2 * run_length, max(PLAIN_RUN, PLAIN_RUN_MAX))
            run_key = None
            if key is not None:
                key, run_key = mx.random.split(key)
            run = plain_run(step, todo[0], n, warp, run_key, process_one if processors else None)
            for i, (tok, lp) in enumerate(run):
                tokens.append(tok)
                emitted += 1
                yield tok, lp, drafted, accepted
                if i == 0:
                    t_first = control.clock()  # the run's first token waited for no pipeline
            seconds = (control.clock() - t_first) / (n - 1) if n > 1 else control.clock() - t_round
            control.observe(0, 0, seconds)
            if isinstance(drafter, DraftModel):
                drafter.commit(tokens[-n:], [])
            todo = [tokens[-1]]
            continue
        run_length = PLAIN_RUN
        sub = None
        if key is not None:
            key, sub, k_draft = mx.random.split(key, 3)
        q = alts = None
        if k == 0 or drafter is None:
            drafts = mx.zeros((0,), dtype=mx.int32)
        elif isinstance(drafter, PromptLookup):
            drafts = mx.array(drafter.propose(tokens, k), dtype=mx.int32)
        else:
            drafts, q, alts = drafter.propose(
                k, None if key is None else k_draft, tokens, processors, history_size
            )
        if tree and alts is not None:
            res = verify_tree(model, cache, todo, drafts, alts, process_one if processors else None)
        elif step is not None:  # todo is one token; fixed K pads drafts to K: one trace
            res = verify_step_rows(
                step, [0], [todo], [drafts], warp=warp, key=sub, draft_probs=[q],
                process=process if processors else None,
                length=1 + num_draft_tokens if drafts.shape[0] and not control.adaptive else 1,
            )[0]  # fmt: skip
        else:
            res = verify_rows(
                model, cache, [todo], [drafts], warp=warp, key=sub,
                draft_probs=[q], process=process if processors else None,
            )[0]  # fmt: skip
        control.observe(drafts.shape[0], res.accepted, control.clock() - t_round)
        drafted += drafts.shape[0]
        accepted += res.accepted
        if isinstance(drafter, DraftModel):
            drafter.commit(res.tokens, drafts.tolist())
        todo = res.todo
        for tok, lp in zip(res.tokens, res.logprobs):
            tokens.append(tok)
            emitted += 1
            yield tok, lp, drafted, accepted
