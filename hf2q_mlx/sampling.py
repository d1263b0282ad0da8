"""Token samplers and logits processors built from MLX ops only (no host sync, (B, V) logits).

The order follows transformers' logits warpers: logits processors (repetition penalty) first,
then temperature, then top-k, top-p and min-p filters on the tempered distribution, then a
categorical draw with an explicit ``mx.random.key`` so that a seeded run reproduces exactly.
Temperature 0 is greedy decoding: argmax, no filters, no randomness.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

import mlx.core as mx

from hf2q_mlx.custom_kernels import sampling as sampling_kernels
from hf2q_mlx.errors import SamplingOptionsError

# sampler(logits (B, V), key or None) -> token ids (B,) uint32
Sampler = Callable[[mx.array, "mx.array | None"], mx.array]
# processor(history (B, T) token ids, logits (B, V)) -> logits (B, V)
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


def validate_sampling_options(
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    context_size: int = 20,
    max_tokens: int = 0,
) -> None:
    """Raise SamplingOptionsError for any option outside its range (checked before any work)."""
    real_options = {"temperature": temperature, "top_p": top_p, "min_p": min_p}
    real_options["repetition_penalty"] = repetition_penalty
    for name, value in real_options.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise SamplingOptionsError(f"{name} must be a number, got {value!r}")
    checks = [
        (
            math.isfinite(temperature) and temperature >= 0,
            f"temperature must be >= 0, got {temperature}",
        ),
        (isinstance(top_k, int) and top_k >= 0, f"top_k must be an integer >= 0, got {top_k}"),
        (0 < top_p <= 1, f"top_p must be in (0, 1], got {top_p}"),
        (0 <= min_p < 1, f"min_p must be in [0, 1), got {min_p}"),
        (
            math.isfinite(repetition_penalty) and repetition_penalty > 0,
            f"repetition_penalty must be > 0, got {repetition_penalty}",
        ),
        (
            isinstance(context_size, int) and context_size >= 1,
            f"repetition context size must be an integer >= 1, got {context_size}",
        ),
        (
            isinstance(max_tokens, int) and max_tokens >= 0,
            f"max_tokens must be an integer >= 0, got {max_tokens}",
        ),
    ]
    for ok, message in checks:
        if not ok:
            raise SamplingOptionsError(message)


def apply_top_k(logits: mx.array, k: int) -> mx.array:
    """Keep the k largest logits of each row, set the rest to -inf (exactly k survive)."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    # the block top-k kernel on a GPU (k <= 64), the argpartition reference elsewhere
    return sampling_kernels.top_k_filter(logits, k)


def apply_top_p(logits: mx.array, p: float) -> mx.array:
    """Keep the smallest set of most likely tokens whose probability mass reaches p."""
    if p >= 1.0:
        return logits
    order = mx.argsort(-logits, axis=-1)  # (B, V), most likely first
    sorted_logits = mx.take_along_axis(logits, order, axis=-1)
    probs = mx.softmax(sorted_logits, axis=-1, precise=True)
    # mass strictly before each token; the top token always has 0 < p, so one survives
    mass_before = mx.cumsum(probs, axis=-1) - probs
    sorted_logits = mx.where(mass_before < p, sorted_logits, -mx.inf)
    return mx.put_along_axis(logits, order, sorted_logits, axis=-1)


def apply_min_p(logits: mx.array, min_p: float) -> mx.array:
    """Drop tokens whose probability is below min_p times the most likely token's."""
    if min_p <= 0.0:
        return logits
    # p_i >= min_p * p_max  <=>  logit_i >= max_logit + log(min_p)
    threshold = mx.max(logits, axis=-1, keepdims=True) + math.log(min_p)
    return mx.where(logits >= threshold, logits, -mx.inf)


def make_sampler(
    temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> Sampler:
    """Return ``sampler(logits (B, V), key) -> (B,)`` token ids; greedy at temperature 0."""
    validate_sampling_options(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    if temperature == 0:

        def greedy(logits: mx.array, key: mx.array | None = None) -> mx.array:
            return sampling_kernels.argmax(logits).astype(mx.uint32)

        return greedy

    def sample(logits: mx.array, key: mx.array | None = None) -> mx.array:
        logits = logits.astype(mx.float32) * (1.0 / temperature)
        logits = apply_top_k(logits, top_k)
        logits = apply_top_p(logits, top_p)
        logits = apply_min_p(logits, min_p)
        return mx.random.categorical(logits, axis=-1, key=key)

    return sample


def apply_repetition_penalty(history: mx.array, logits: mx.array, penalty: float) -> mx.array:
    """CTRL-style penalty on every token id in ``history`` (B, T): divide a positive logit by
    the penalty, multiply a negative one, so a penalty > 1 always makes the token less likely."""
    picked = mx.take_along_axis(logits, history, axis=-1)
    picked = mx.where(picked < 0, picked * penalty, picked / penalty)
    # a repeated id writes the same value twice, so duplicates are harmless
    return mx.put_along_axis(logits, history, picked, axis=-1)


def make_logits_processors(
    repetition_penalty: float = 1.0, context_size: int = 20
) -> list[LogitsProcessor]:
    """Processors applied in order to the raw logits; the penalty covers the last
    ``context_size`` tokens of the history (prompt and generated tokens)."""
    validate_sampling_options(repetition_penalty=repetition_penalty, context_size=context_size)
    processors: list[LogitsProcessor] = []
    if repetition_penalty != 1.0:

        def repetition(history: mx.array, logits: mx.array) -> mx.array:
            if history.shape[-1] == 0:
                return logits
            return apply_repetition_penalty(
                history[..., -context_size:], logits, repetition_penalty
            )

        processors.append(repetition)
    return processors
