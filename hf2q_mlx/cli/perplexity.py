"""Perplexity over non-overlapping windows, each evaluated in one forward pass without a cache.

The token list is cut into consecutive windows of ``context`` tokens (the last one may be
shorter; a window of one token predicts nothing and is dropped). Within a window, token i is
scored by the logits at position i - 1, so every window contributes len(window) - 1 negative
log-likelihoods, computed in fp32 as ``logsumexp(logits) - logits[target]``. With
``bos_token_id`` set, every window starts with that token followed by ``context - 1`` text
tokens, and the BOS itself is never scored (models such as Gemma expect a BOS at position 0).
perplexity = exp(total NLL / number of scored tokens).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from hf2q_mlx.custom_kernels import sampling as sampling_kernels
from hf2q_mlx.errors import InvalidArgumentError, SamplingOptionsError
from hf2q_mlx.generation import (
    check_token_ids,
    is_int,
    make_prompt_cache,
    parse_kv_bits,
    vocab_limit,
)


@dataclass
class PerplexityResult:
    """``nll`` is the mean negative log-likelihood per scored token in nats; ppl = exp(nll)."""

    ppl: float
    nll: float
    n_tokens: int


def _windows(tokens: list[int], context: int, bos_token_id: int | None) -> list[list[int]]:
    if bos_token_id is None:
        wins = [tokens[i : i + context] for i in range(0, len(tokens), context)]
    else:
        step = context - 1
        wins = [[bos_token_id, *tokens[i : i + step]] for i in range(0, len(tokens), step)]
    return [w for w in wins if len(w) >= 2]


def window_nll(model: Any, batch: mx.array, kv_bits=None) -> mx.array:
    """Summed NLL (fp32) of tokens 1..L-1 of each row of ``batch`` (B, L) -> (B,).

    With ``kv_bits`` the window runs through a fresh TurboQuant cache, so attention reads the
    quantized keys/values."""
    cache = make_prompt_cache(model, kv_bits) if kv_bits is not None else None
    logits = model(batch[:, :-1], cache=cache).astype(mx.float32)  # (B, L - 1, V)
    targets = batch[:, 1:, None]
    picked = mx.take_along_axis(logits, targets, axis=-1)[..., 0]
    return (sampling_kernels.logsumexp(logits)[..., 0] - picked).sum(axis=-1)


def check_perplexity_options(context: Any, batch_size: Any, bos: bool = False) -> None:
    """Raise SamplingOptionsError for a window shorter than 2 tokens (3 with a BOS per window)
    or a batch size below 1."""
    least = 3 if bos else 2
    if isinstance(context, bool) or not isinstance(context, int) or context < least:
        raise SamplingOptionsError(
            f"perplexity context must be an integer of at least {least} tokens, got {context!r}"
        )
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise SamplingOptionsError(f"batch_size must be an integer >= 1, got {batch_size!r}")


def perplexity(
    model: Any,
    tokens: list[int],
    context: int = 1024,
    batch_size: int = 1,
    bos_token_id: int | None = None,
    kv_bits=None,
    progress: bool = False,
) -> PerplexityResult:
    """Perplexity of ``tokens`` under ``model`` (see the module docstring for the windows);
    ``progress`` shows a bar with an ETA on stderr, one step per scored token."""
    from tqdm import tqdm

    check_perplexity_options(context, batch_size, bos=bos_token_id is not None)
    parse_kv_bits(kv_bits)  # validate before any work
    if isinstance(tokens, (str, bytes)) or not all(is_int(t) for t in tokens):
        raise InvalidArgumentError("perplexity tokens must be a list of integer token ids")
    check_token_ids(
        [*tokens, *([] if bos_token_id is None else [bos_token_id])], vocab_limit(model, None)
    )
    windows = _windows(list(tokens), context, bos_token_id)
    if not windows:
        raise SamplingOptionsError("perplexity needs at least 2 tokens of text")
    total = 0.0
    n = 0
    # equal-length windows are batched; the shorter last window runs alone
    full = [w for w in windows if len(w) == len(windows[0])]
    rest = windows[len(full) :]
    groups = [full[i : i + batch_size] for i in range(0, len(full), batch_size)]
    groups += [[w] for w in rest]
    scored = sum(len(w) - 1 for w in windows)
    bar = tqdm(total=scored, desc="perplexity", unit="tok", file=sys.stderr, disable=not progress)
    with bar:
        for group in groups:
            nll = window_nll(model, mx.array(group, dtype=mx.int32), kv_bits)
            total += float(nll.sum().item())
            n += sum(len(w) - 1 for w in group)
            bar.update(sum(len(w) - 1 for w in group))
    mean = total / n
    return PerplexityResult(ppl=math.exp(mean), nll=mean, n_tokens=n)
