"""Per-row sampling of a (B, V) logits batch on the device; only token ids (and the log-probs a
request asked for) go to the host.

Each row has its own temperature, top-k, top-p, min-p, presence / frequency penalties, logit bias
and random key. The order is that of ``hf2q_mlx.sampling``: logit bias and penalties,
log-softmax, temperature, top-k, top-p, min-p, then a Gumbel-max draw with the row's key (a
seeded request draws the same tokens whatever else shares the batch). Temperature 0 rows take
the argmax of the log-probs, as ``stream_generate`` does.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from hf2q_mlx.custom_kernels import backend, device_array
from hf2q_mlx.custom_kernels import sampling as sampling_kernels
from hf2q_mlx.errors import SamplingOptionsError
from hf2q_mlx.generation import check_generation_arguments, is_int
from hf2q_mlx.sampling import validate_sampling_options

MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024  # token ids one request may bias (OpenAI allows 300)


@dataclass
class SamplingParams:
    """One request's generation options (OpenAI's names; ``top_k`` and ``min_p`` as in vLLM).

    Penalties count the tokens generated so far (OpenAI's definition): ``logit -= count *
    frequency_penalty + (count > 0) * presence_penalty``. ``logit_bias`` ({token id: bias in
    [-100, 100]}, OpenAI's) is added to those tokens' logits first. ``logprobs`` returns the
    log-probability of each chosen token and ``top_logprobs`` (0..20) the most likely
    alternatives.
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
    logit_bias: dict[int, float] = field(default_factory=dict)

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
        if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise SamplingOptionsError(
                f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to numbers"
            )
        for t, v in self.logit_bias.items():
            if not is_int(t) or t < 0:
                raise SamplingOptionsError(f"logit_bias keys must be token ids >= 0, got {t!r}")
            number = isinstance(v, (int, float)) and not isinstance(v, bool)
            if not number or not -100.0 <= v <= 100.0:
                raise SamplingOptionsError(
                    f"logit_bias values must be numbers in [-100, 100], got {v!r} for token {t}"
                )


@dataclass
class SampledBatch:
    """Host values of one step: per row the token, its log-prob (NaN when no row asked for
    log-probs: they are not read back then) and the top alternatives."""

    tokens: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]


@dataclass
class PendingSample:
    """One step's sampling, submitted (``mx.async_eval``) but not read back: ``tokens`` (B,)
    int32 stay on the device as the next step's input; ``BatchSampler.read`` brings the host
    values over."""

    tokens: mx.array  # (B,) int32
    outputs: list[mx.array]  # tokens, then the chosen log-probs and top ids / values if asked
    tops: list[int]  # top_logprobs per row at launch (0: none, or the row was not active)


class BatchSampler:
    """Device-side sampling state for ``max_batch`` rows of a ``vocab``-wide head.

    ``candidates``: rows that filter with top-k (0 < k <= 64) draw among the top-k candidates
    of a GPU top-k kernel (``custom_kernels/sampling.py``) instead of a full sort of the
    vocabulary; the draw is exactly that of the full path (the same filters over the same
    values, the same Gumbel noise gathered at the candidates). On by default where a GPU kernel
    runs; the full path is the CPU / reference one."""

    def __init__(self, max_batch: int, vocab: int, candidates: bool | None = None) -> None:
        self.B, self.V = max_batch, vocab
        self.params: list[SamplingParams | None] = [None] * max_batch
        self.keys = mx.zeros((max_batch, 2), mx.uint32)  # one random key per row
        self.counts: mx.array | None = None  # (B, V) generated-token counts, for penalties
        self._rows: dict[str, mx.array] | None = None
        self._masks: dict[str, tuple[tuple, mx.array]] = {}
        self.candidates = backend() is not None if candidates is None else candidates
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
            f32 = mx.float32
            self._rows = {
                "inv_temp": device_array(
                    [1.0 / p.temperature if p.temperature > 0 else 1.0 for p in ps], f32
                ),
                "greedy": device_array([p.temperature == 0 for p in ps], mx.bool_),
                # a top-k past the vocabulary keeps all of it (and fits the int32 vector)
                "top_k": device_array(
                    [min(p.top_k, self.V) if p.top_k > 0 else self.V for p in ps], mx.int32
                ),
                "top_p": device_array([float(p.top_p) for p in ps], f32),
                "log_min_p": device_array(
                    [math.log(p.min_p) if p.min_p > 0 else -math.inf for p in ps], f32
                ),
                "presence": device_array([float(p.presence_penalty) for p in ps], f32),
                "frequency": device_array([float(p.frequency_penalty) for p in ps], f32),
            }
            if any(p.logit_bias for p in ps):
                self._rows["bias"] = _bias_table(ps)
        return self._rows

    def plain_greedy(self, active: Sequence[bool]) -> bool:
        """Whether every active row takes the argmax of its logits as they are: temperature 0,
        no penalties, no log-probs asked for. A step whose ids come with its logits (the CUDA
        graph's) then needs no sampling on the device."""
        live = [p for p, a in zip(self.params, active) if a]
        return all(
            p is not None and p.temperature == 0 and not p.presence_penalty
            and not p.frequency_penalty and not p.logprobs and not p.top_logprobs
            and not p.logit_bias for p in live
        )  # fmt: skip

    def _mask(self, name: str, values: Sequence, dtype: mx.Dtype) -> mx.array:
        # a per-row mask uploaded only when it changes: the first GPU read of a buffer the host
        # wrote costs 12-24 us on the H200 (docs/kernel_notes.md, session 17)
        key = tuple(values)
        kept = self._masks.get(name)
        if kept is None or kept[0] != key:
            kept = self._masks[name] = (key, device_array(list(key), dtype))
        return kept[1]

    def sample(self, logits: mx.array, active: Sequence[bool]) -> SampledBatch:
        """logits (B, V) -> one token per row (inactive rows: meaningless values)."""
        return self.read(self.launch(logits, active))

    def launch(self, logits: mx.array, active: Sequence[bool]) -> PendingSample:
        """Build one step's sampling over logits (B, V) and submit it without waiting."""
        r = self._row_arrays()
        live = [p for p, a in zip(self.params, active) if a and p is not None]
        logits = logits.astype(mx.float32)
        if "bias" in r:  # (B, K) ids and biases, each row's padded with its own first entry
            ids, bias = r["bias"]
            picked = mx.take_along_axis(logits, ids, axis=-1)
            logits = mx.put_along_axis(logits, ids, picked + bias, axis=-1)
        if any(p.presence_penalty or p.frequency_penalty for p in live):
            if self.counts is None:
                self.counts = mx.zeros((self.B, self.V), mx.float32)
            c = self.counts
            logits = logits - c * r["frequency"][:, None] - (c > 0) * r["presence"][:, None]
        logprobs = sampling_kernels.log_softmax(logits)  # (B, V)
        tokens = sampling_kernels.argmax(logprobs).astype(mx.int32)
        sampled = [a and p is not None and p.temperature > 0 for p, a in zip(self.params, active)]
        if any(sampled):
            split = mx.vmap(mx.random.split)(self.keys)  # (B, 2, 2): [next key, sub-key]
            drawn = [p for p, s in zip(self.params, sampled) if s]
            draw = self._draw(logprobs, r, drawn, split[:, 1])
            tokens = mx.where(r["greedy"], tokens, draw)
            chosen = self._mask("sampled", sampled, mx.bool_)
            self.keys = mx.where(chosen[:, None], split[:, 0], self.keys)
        if self.counts is not None:
            on = self._mask("active", [float(bool(a)) for a in active], mx.float32)
            self.counts = mx.put_along_axis(
                self.counts,
                tokens[:, None],
                mx.take_along_axis(self.counts, tokens[:, None], axis=-1) + on[:, None],
                axis=-1,
            )
        outputs = [tokens]
        if any(p.logprobs or p.top_logprobs for p in live):
            outputs.append(mx.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0])
        tops = [p.top_logprobs if a and p is not None else 0 for p, a in zip(self.params, active)]
        want_top = max(tops, default=0)
        if want_top > 0:
            top_ids = mx.argpartition(-logprobs, want_top - 1, axis=-1)[:, :want_top]
            top_vals = mx.take_along_axis(logprobs, top_ids, axis=-1)
            order = mx.argsort(-top_vals, axis=-1)
            outputs += [
                mx.take_along_axis(top_ids, order, axis=-1),
                mx.take_along_axis(top_vals, order, axis=-1),
            ]
        mx.async_eval(outputs, self.keys, *(() if self.counts is None else (self.counts,)))
        return PendingSample(tokens, outputs, tops)

    def read(self, pending: PendingSample) -> SampledBatch:
        """Wait for a launched step and bring its token ids (and asked-for log-probs) over."""
        host = [o.tolist() for o in pending.outputs]
        lps = host[1] if len(host) > 1 else [float("nan")] * self.B
        top: list[list[tuple[int, float]]] = [[] for _ in range(self.B)]
        for row, n in enumerate(pending.tops):
            if n:
                top[row] = list(zip(host[2][row][:n], host[3][row][:n]))
        return SampledBatch(host[0], lps, top)

    def _draw(
        self, logprobs: mx.array, r: dict[str, mx.array], drawn: list, subkeys: mx.array
    ) -> mx.array:
        """Tempered, filtered Gumbel-max draw for every row with its sub-key (B, 2); ``drawn``:
        the options of the rows that sample."""
        x = logprobs * r["inv_temp"][:, None]
        noise = mx.vmap(lambda k: mx.random.gumbel((self.V,), key=k))(subkeys)  # (B, V)
        if not any(p.top_k > 0 or p.top_p < 1.0 for p in drawn):
            return _gumbel_max(x, noise, r["log_min_p"])
        kc = min(max(p.top_k for p in drawn), self.V)  # a top-k past the vocabulary keeps all
        if self.candidates and all(0 < p.top_k <= sampling_kernels.MAX_K for p in drawn):
            # the k best of each row (sorted, ties to the lower index), then the filters over
            # them alone: the rest of the vocabulary is -inf after top-k anyway
            vals, ids = sampling_kernels.topk(x, kc)  # (B, kc) each
            ids = ids.astype(mx.int32)
            s = _nucleus(vals, r, kc)
            pick = _gumbel_max(s, mx.take_along_axis(noise, ids, axis=-1), r["log_min_p"])
            return mx.take_along_axis(ids, pick[:, None], axis=-1)[:, 0]
        order = mx.argsort(-x, axis=-1)  # (B, V), most likely first
        s = _nucleus(mx.take_along_axis(x, order, axis=-1), r, self.V)
        return _gumbel_max(mx.put_along_axis(x, order, s, axis=-1), noise, r["log_min_p"])


def _bias_table(ps: list[SamplingParams]) -> tuple[mx.array, mx.array]:
    """Every row's logit bias as (B, K) token ids and fp32 biases, K the most any row has. A
    row's padding repeats its first entry (or token 0 with 0 for a row without bias), so every
    write at one id carries the same value whatever order the scatter runs in."""
    K = max(len(p.logit_bias) for p in ps)
    ids, vals = [], []
    for p in ps:
        items = sorted(p.logit_bias.items()) or [(0, 0.0)]
        items += [items[0]] * (K - len(items))
        ids.append([t for t, _ in items])
        vals.append([float(v) for _, v in items])
    return mx.array(ids, dtype=mx.int32), mx.array(vals, dtype=mx.float32)


def _nucleus(s: mx.array, r: dict[str, mx.array], n: int) -> mx.array:
    """Values s (B, n) sorted most likely first -> top-k, then top-p applied (-inf dropped)."""
    rank = mx.arange(n)[None]
    s = mx.where(rank < r["top_k"][:, None], s, -mx.inf)
    probs = mx.softmax(s, axis=-1, precise=True)
    mass_before = mx.cumsum(probs, axis=-1) - probs
    return mx.where(mass_before < r["top_p"][:, None], s, -mx.inf)


def _gumbel_max(x: mx.array, noise: mx.array, log_min_p: mx.array) -> mx.array:
    """min-p, then argmax(x + noise) per row -> (B,) int32 positions in x."""
    # p_i >= min_p * p_max  <=>  x_i >= max(x) + log(min_p)
    floor = mx.max(x, axis=-1, keepdims=True) + log_min_p[:, None]
    x = mx.where(x >= floor, x, -mx.inf)
    return mx.argmax(x + noise, axis=-1).astype(mx.int32)
