"""Pipelined greedy speculative rounds: round r + 1 is built and launched before round r is read.

An unpipelined round (``speculative.verify_step_rows``) reads its accept decisions back before
the next round can be built, so the host's graph building and the device's work alternate and
a round costs about two plain steps on a host-bound GPU. Here everything the next round needs is
computed on the device from the previous round's lazy outputs, as plain decoding feeds token
n + 1 with token n still unread (``speculative.plain_run``):

- acceptance: the verify's argmax ``cand`` (L,) against the drafts; ``a`` = leading matches;
  the round emits cand[0 .. a] (accepted drafts equal their argmax) and cand[a] is the next
  round's first token;
- positions: ``DecodeStep.begin_lazy`` / ``rollback_lazy`` move the row back by the rejected
  count on the device (recurrent layers take their state after the kept tokens from the
  verify's history); the host keeps upper bounds (span bucket, max_len) and subtracts each
  round's count once it has read it (``rollback_known``), one round later;
- drafts: a device drafter reads a fixed-size token buffer (prompt + output, its length a device
  scalar) that each round appends cand to: ``DeviceLookup`` (prompt lookup) or ``ReplayDrafter``
  (the benchmark's replayed reference).

The output equals plain greedy decoding's token for token; a generation that ends (budget) may
leave one round that was launched for nothing. ``DraftLength`` picks each round's k from the
rounds read so far (k of round r + 1 sees rounds up to r - 1), k = 0 being a pipelined plain
step; a round's cost is the steady-state time between two reads.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx
import numpy as np

from hf2q_mlx.custom_kernels import sampling as sampling_kernels
from hf2q_mlx.decode_step import DecodeStep
from hf2q_mlx.draft_length import DraftLength
from hf2q_mlx.errors import InvalidArgumentError

# ---- device drafters ------------------------------------------------------------------------


def lookup_drafts(buf: mx.array, n: mx.array, ngram: int, k: int) -> mx.array:
    """Prompt lookup on the device: ``buf`` (M,) int32 tokens of which the first ``n`` (a device
    scalar) are the sequence -> (k,) int32 drafts: the tokens after the latest earlier occurrence
    of the longest matching suffix of at most ``ngram`` tokens (``speculative.PromptLookup``'s
    choice). Where the host would return fewer than k tokens (the occurrence ends less than k
    tokens before the end) the copy continues periodically, as a repeat would; no match at all
    gives the last token k times (the host: no drafts)."""
    M = buf.shape[0]
    i = mx.arange(M)[:, None]
    j = mx.arange(ngram)[None]
    src, tail = i - j, n - 1 - j  # (M, G): token i - j against the sequence's token n - 1 - j
    eq = (buf[mx.maximum(src, 0)] == buf[mx.maximum(tail, 0)]) & (src >= 0) & (tail >= 0)
    # (M,) the suffix length matched at i: the first mismatch (a min, not a scan)
    match = mx.where(eq, ngram, j).min(axis=1)
    at = mx.arange(M)
    # longest match first, then the latest; an occurrence must end before the last token
    score = mx.where(at <= n - 2, match * M + at, -1)
    best = score.max()
    size, end = best // M, best % M
    start = mx.where(size > 0, end + 1, n - 1)
    period = n - start  # >= 1
    return buf[start + mx.arange(k) % period].astype(mx.int32)


@lru_cache(maxsize=None)
def _compiled_lookup(ngram: int, k: int):
    return mx.compile(lambda buf, n: lookup_drafts(buf, n, ngram, k))


class DeviceLookup:
    """``lookup_drafts`` as a drafter (compiled once per (n-gram, K, buffer size): the buffer
    sizes are powers of two, so requests share their traces)."""

    def __init__(self, ngram: int, k: int):
        self.ngram, self.k = ngram, k
        self._fn = _compiled_lookup(ngram, k)

    def __call__(self, buf: mx.array, n: mx.array, r: int) -> mx.array:
        return self._fn(buf, n)


class ReplayDrafter:
    """The benchmark's drafter: ``ref`` (the target's greedy output after the prompt, its first
    token included) on the device, each draft replaced by a wrong token with probability
    1 - ``acceptance`` from draws made up front (row r: round r's)."""

    def __init__(self, ref: Sequence[int], prompt_len: int, k: int, acceptance: float, vocab: int,
                 seed: int = 0):  # fmt: skip
        rng = np.random.default_rng(seed)
        rounds = len(ref) + 2  # a round emits at least one token
        self.ref = mx.array(list(ref), dtype=mx.int32)
        self.keep = mx.array(rng.random((rounds, k)) < acceptance)
        self.shift = mx.array(rng.integers(1, vocab, (rounds, k)), dtype=mx.int32)
        self.prompt_len, self.k, self.vocab = prompt_len, k, vocab

    def __call__(self, buf: mx.array, n: mx.array, r: int) -> mx.array:
        r %= self.keep.shape[0]
        at = mx.minimum(n - self.prompt_len + mx.arange(self.k), self.ref.shape[0] - 1)
        want = self.ref[at]
        return mx.where(self.keep[r], want, (want + self.shift[r]) % self.vocab).astype(mx.int32)


# ---- the rounds --------------------------------------------------------------------------------


@dataclass
class Round:
    """One round as read back: the tokens it emits (cut at the budget), their log-probabilities,
    the drafts it verified and accepted, and the seconds since the previous round's read."""

    tokens: list[int]
    logprobs: list[float]
    drafted: int
    accepted: int
    seconds: float


def _accept(logits: mx.array, drafts: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """logits (L, V) of the verify of [last, drafts (L-1,)] -> the argmax of each position's
    log-probabilities (plain greedy decoding's pick) (L,), their log-probabilities (L,), and the
    number of leading drafts equal to their argmax ()."""
    lg = logits.astype(mx.float32)
    logprobs = sampling_kernels.log_softmax(lg)
    cand = sampling_kernels.argmax(logprobs).astype(mx.int32)
    lp = mx.take_along_axis(logprobs, cand[:, None], axis=-1)[:, 0]
    k = drafts.shape[0]
    if k == 0:
        return cand, lp, mx.array(0, dtype=mx.int32)
    # the first mismatch (k: none)
    a = mx.where(cand[:k] == drafts, k, mx.arange(k)).min()
    return cand, lp, a.astype(mx.int32)


def _settle(logits, drafts, buf, n, at_row):
    """After a verify: acceptance (``_accept``), the rejected count on ``at_row`` (B,) bool,
    and the round's tokens cand[0 .. a] appended to the buffer (all of cand is written; what
    lies past the new length is overwritten later) -> (cand, lp, a, counts (B,), buf, n, the
    next round's first token (1,)). One compiled call: few host dispatches per round."""
    cand, lp, a = _accept(logits, drafts)
    counts = mx.where(at_row, drafts.shape[0] - a, 0).astype(mx.int32)
    # a scatter (as the static caches write): proven on the CUDA back end
    buf = mx.put_along_axis(buf, n + mx.arange(cand.shape[0]), cand, axis=0)
    return cand, lp, a, counts, buf, n + a + 1, cand[a][None]


_settle_compiled = mx.compile(_settle)


def pipelined_rounds(
    step: DecodeStep,
    tokens: Sequence[int],
    budget: int,
    drafter,
    control: DraftLength,
    row: int = 0,
    adaptive_cap: bool | None = None,
) -> Iterator[Round]:
    """Greedy speculative rounds on ``row`` of ``step`` (which holds every token of ``tokens``
    but the last), pipelined: yields each round's tokens until ``budget`` tokens are out.
    ``drafter(buf, n, r)`` -> (K,) int32 drafts on the device; ``control`` picks each round's
    k <= K (``adaptive_cap``, default ``control.adaptive``: k is also capped by what the budget
    can still take, which needs every verify length traced). The step is in lazy-position mode
    meanwhile; afterwards its positions are exact again (a round launched for nothing stays:
    the row then holds the tokens that round accepted too)."""
    if budget <= 0:
        return
    if step.max_batch <= row or len(tokens) < 1:
        raise InvalidArgumentError("pipelined_rounds needs a step row and at least one token")
    K = control.max_drafts
    cap = control.adaptive if adaptive_cap is None else adaptive_cap
    # the buffer holds the tokens, the output, and the writes of two rounds past the budget
    # (a power of two: the drafter's compiled trace serves the next requests too)
    size = max(256, 1 << (len(tokens) + budget + 2 * K + 3).bit_length())
    buf = mx.array(list(tokens) + [0] * (size - len(tokens)), dtype=mx.int32)
    n = mx.array(len(tokens), dtype=mx.int32)
    last = mx.array([tokens[-1]], dtype=mx.int32)
    B = step.max_batch
    active = [b == row for b in range(B)]
    at_row = mx.arange(B) == row
    inflight: deque = deque()
    emitted, submitted = 0, 0

    def submit() -> None:
        nonlocal buf, n, last, submitted
        low = emitted + len(inflight)  # each round in flight emits at least one token
        k = control.choose()
        if cap:
            k = max(0, min(k, budget - low - 1))
        drafts = drafter(buf, n, submitted)[:k] if k else mx.zeros((0,), dtype=mx.int32)
        seq = mx.concatenate([last, drafts])[None]  # (1, L)
        if B > 1:  # the other rows idle on zeros
            seq = mx.concatenate([mx.zeros((row, k + 1), mx.int32), seq,
                                  mx.zeros((B - row - 1, k + 1), mx.int32)])  # fmt: skip
        logits = step.verify(seq, active)[row]  # (L, V), positions from the device
        cand, lp, a, counts, buf, n, last = _settle_compiled(logits, drafts, buf, n, at_row)
        if k:  # the rejected drafts leave the caches (device counts)
            step.rollback_lazy(counts)
        mx.async_eval(cand, lp, a, buf, n, last, step.lazy_positions,
                      [s.arrays for s in step.caches])  # fmt: skip
        inflight.append((k, cand, lp, a))
        submitted += 1

    step.begin_lazy()
    try:
        t_prev = None
        while emitted < budget:
            # keep two rounds in flight: the next is launched before this one is read
            while len(inflight) < 2 and emitted + len(inflight) < budget:
                submit()
                if t_prev is None:
                    t_prev = control.clock()  # after the first launch: steady-state periods
            k, cand, lp, a = inflight.popleft()
            a = int(a.item())
            if k:
                step.rollback_known([k - a if b == row else 0 for b in range(B)])
            take = min(a + 1, budget - emitted)
            t = control.clock()
            control.observe(k, a, t - t_prev)
            # whole arrays (evaluated with their round): a slice would be a new op, queued on
            # the stream behind round r + 1, and its read would wait for that round too
            # accepted: drafts among the tokens kept (a round cut at the budget keeps fewer)
            out = Round(cand.tolist()[:take], lp.tolist()[:take], k, min(a, take), t - t_prev)
            t_prev = t
            emitted += take
            yield out
    finally:
        step.end_lazy()  # reads the device positions: the rounds still in flight finish


def greedy_tokens(
    step: DecodeStep,
    tokens: list[int],
    budget: int,
    drafter,
    control: DraftLength,
    drafted: int = 0,
    accepted: int = 0,
) -> Iterator[tuple[int, float, int, int]]:
    """``pipelined_rounds`` as ``speculative_tokens`` yields: (token, logprob, drafted so far,
    accepted so far); ``tokens`` (the prompt and output so far) grows with the output."""
    rounds = pipelined_rounds(step, tokens, budget, drafter, control)
    try:
        for rnd in rounds:
            drafted += rnd.drafted
            accepted += rnd.accepted
            for tok, lp in zip(rnd.tokens, rnd.logprobs):
                tokens.append(tok)
                yield tok, lp, drafted, accepted
    finally:  # a caller that stops early (EOS, a stop string): the step's positions settle now
        rounds.close()
