"""Per-row sampling of a (B, V) logits batch on the device; only token ids (and the log-probs a
request asked for) go to the host.

Each row has its own temperature, top-k, top-p, min-p, presence / frequency penalties and random
key. The order is that of ``hf2q_mlx.sampling``: penalties, log-softmax, temperature, top-k, top-p,
min-p, then a Gumbel-max draw with the row's key (a seeded request draws the same tokens whatever
else shares the batch). Temperature 0 rows take the argmax of the log-probs, as
``stream_generate`` does.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from hf2q_mlx.custom_kernels import sampling as sampling_kernels
from hf2q_mlx.errors import SamplingOptionsError
from hf2q_mlx.generation import check_generation_arguments, is_int
from hf2q_mlx.sampling import validate_sampling_options

MAX_TOP_LOGPROBS = 20


@dataclass
class SamplingParams:
    """One request's generation options (OpenAI's names; ``top_k`` and ``min_p`` as in vLLM).

    Penalties count the tokens generated so far (OpenAI's definition): ``logit -= count *
    frequency_penalty + (count > 0) * presence_penalty``. ``logprobs`` returns the log-probability
    of each chosen token and ``top_logprobs`` (0..20) the most likely alternatives.
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False

    def validate(self) -> None:
        """SamplingOptionsError (one line, naming the option) for any value out of range."""
        validate_sampling_options(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p
        )
        check_generation_arguments(
            max_tokens=self.max_tokens,
            seed=self.seed,
            stop=self.stop,
            kv_bits=None,
            ignore_eos=self.ignore_eos,
        )
        if not isinstance(self.logprobs, bool):
            raise SamplingOptionsError(f"logprobs must be true or false, got {self.logprobs!r}")
        n = self.top_logprobs
        if not is_int(n) or not 0 <= n <= MAX_TOP_LOGPROBS:
            raise SamplingOptionsError(
                f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {n!r}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -2.0 <= v <= 2.0:
                raise SamplingOptionsError(f"{name} must be a number in [-2, 2], got {v!r}")


@dataclass
class SampledBatch:
    """Host values of one step: per row the token, its log-prob and the top alternatives."""

    tokens: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]


class BatchSampler:
    """Device-side sampling state for ``max_batch`` rows of a ``vocab``-wide head."""

    def __init__(self, max_batch: int, vocab: int) -> None:
        self.B, self.V = max_batch, vocab
        self.params: list[SamplingParams | None] = [None] * max_batch
        self.keys = mx.zeros((max_batch, 2), mx.uint32)  # one random key per row
        self.counts: mx.array | None = None  # (B, V) generated-token counts, for penalties
        self._rows: dict[str, mx.array] | None = None
        mx.eval(self.keys)  # lazy arrays cannot cross threads: the engine thread samples

    def set_row(self, row: int, params: SamplingParams) -> None:
        self.params[row] = params
        seed = secrets.randbits(63) if params.seed is None else params.seed
        self.keys[row] = mx.random.key(seed)
        if self.counts is not None:
            self.counts[row] = 0.0
        self._rows = None

    def clear_row(self, row: int) -> None:
        self.params[row] = None
        self._rows = None

    def _row_arrays(self) -> dict[str, mx.array]:
        # per-row option vectors, rebuilt only when a row changes
        if self._rows is None:
            ps = [p or SamplingParams() for p in self.params]
            self._rows = {
                "inv_temp": mx.array(
                    [1.0 / p.temperature if p.temperature > 0 else 1.0 for p in ps]
                ),
                "greedy": mx.array([p.temperature == 0 for p in ps]),
                "top_k": mx.array([p.top_k if p.top_k > 0 else self.V for p in ps], mx.int32),
                "top_p": mx.array([float(p.top_p) for p in ps]),
                "log_min_p": mx.array(
                    [math.log(p.min_p) if p.min_p > 0 else -math.inf for p in ps]
                ),
                "presence": mx.array([float(p.presence_penalty) for p in ps]),
                "frequency": mx.array([float(p.frequency_penalty) for p in ps]),
            }
        return self._rows

    def sample(self, logits: mx.array, active: Sequence[bool]) -> SampledBatch:
        """logits (B, V) -> one token per row (inactive rows: meaningless values)."""
        r = self._row_arrays()
        live = [p for p, a in zip(self.params, active) if a and p is not None]
        logits = logits.astype(mx.float32)
        if any(p.presence_penalty or p.frequency_penalty for p in live):
            if self.counts is None:
                self.counts = mx.zeros((self.B, self.V), mx.float32)
            c = self.counts
            logits = logits - c * r["frequency"][:, None] - (c > 0) * r["presence"][:, None]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)  # (B, V)
        tokens = sampling_kernels.argmax(logprobs).astype(mx.int32)
        sampled = [a and p is not None and p.temperature > 0 for p, a in zip(self.params, active)]
        if any(sampled):
            split = mx.vmap(mx.random.split)(self.keys)  # (B, 2, 2): [next key, sub-key]
            draw = self._draw(logprobs, r, live, split[:, 1])
            tokens = mx.where(r["greedy"], tokens, draw)
            self.keys = mx.where(mx.array(sampled)[:, None], split[:, 0], self.keys)
        if self.counts is not None:
            on = mx.array([bool(a) for a in active], mx.float32)
            self.counts = mx.put_along_axis(
                self.counts,
                tokens[:, None],
                mx.take_along_axis(self.counts, tokens[:, None], axis=-1) + on[:, None],
                axis=-1,
            )
        chosen = mx.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
        want_top = max((p.top_logprobs for p in live), default=0)
        outputs = [tokens, chosen]
        if want_top > 0:
            top_ids = mx.argpartition(-logprobs, want_top - 1, axis=-1)[:, :want_top]
            top_vals = mx.take_along_axis(logprobs, top_ids, axis=-1)
            order = mx.argsort(-top_vals, axis=-1)
            outputs += [
                mx.take_along_axis(top_ids, order, axis=-1),
                mx.take_along_axis(top_vals, order, axis=-1),
            ]
        mx.eval(outputs, self.keys, *(() if self.counts is None else (self.counts,)))
        host = [o.tolist() for o in outputs]
        top: list[list[tuple[int, float]]] = [[] for _ in range(self.B)]
        if want_top > 0:
            for row, p in enumerate(self.params):
                if p is not None and active[row] and p.top_logprobs:
                    n = p.top_logprobs
                    top[row] = list(zip(host[2][row][:n], host[3][row][:n]))
        return SampledBatch(host[0], host[1], top)

    def _draw(
        self, logprobs: mx.array, r: dict[str, mx.array], live: list, subkeys: mx.array
    ) -> mx.array:
        """Tempered, filtered Gumbel-max draw for every row with its sub-key (B, 2)."""
        x = logprobs * r["inv_temp"][:, None]
        if any(p.top_k > 0 or p.top_p < 1.0 for p in live):
            order = mx.argsort(-x, axis=-1)  # (B, V), most likely first
            s = mx.take_along_axis(x, order, axis=-1)
            rank = mx.arange(self.V)[None]
            s = mx.where(rank < r["top_k"][:, None], s, -mx.inf)
            probs = mx.softmax(s, axis=-1, precise=True)
            mass_before = mx.cumsum(probs, axis=-1) - probs
            s = mx.where(mass_before < r["top_p"][:, None], s, -mx.inf)
            x = mx.put_along_axis(x, order, s, axis=-1)
        # p_i >= min_p * p_max  <=>  x_i >= max(x) + log(min_p)
        floor = mx.max(x, axis=-1, keepdims=True) + r["log_min_p"][:, None]
        x = mx.where(x >= floor, x, -mx.inf)
        noise = mx.vmap(lambda k: mx.random.gumbel((self.V,), key=k))(subkeys)
        return mx.argmax(x + noise, axis=-1).astype(mx.int32)
