"""Bidirectional (encoder) passes of a decoder model and the sentence-embedding head on top:
attention masks without causality, a padded batch's per-layer attention context, mean pooling
and sentence-transformers' dense projections."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from hf2q_mlx.models.sdpa import sdpa


def bidirectional_mask(length: int, window: int | None) -> mx.array | None:
    """Boolean (L, L) mask of a bidirectional pass (True = attend), or None when every key is
    visible. A sliding ``window`` (the configured value) reaches ``window // 2`` positions on
    either side: transformers' Gemma 3 halves it for bidirectional models and keeps keys with
    ``|q - k| < window // 2 + 1``."""
    if window is None or length - 1 <= window // 2:
        return None
    i = mx.arange(length)
    return mx.abs(i[:, None] - i[None, :]) <= window // 2


class PaddedBatch:
    """A layer's stand-in for a cache during one bidirectional pass over a right-padded batch:
    it stores nothing and hands attention each row's mask, so no query reads a padding key and
    a row's result does not depend on how much padding the batch gave it.

    ``valid`` (B, L) bool marks real tokens; ``window`` is the layer's configured sliding
    window (None for global layers)."""

    offset = 0  # positions start at 0 (right padding keeps every real token's position)

    def __init__(self, valid: mx.array, window: int | None):
        self.valid = valid
        self.window = window

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """keys (B, H, L, Dk), values (B, H, L, Dv) -> (keys, values, mask (B, 1, L|1, L))."""
        mask = self.valid[:, None, None, :]  # (B, 1, 1, L): keys of real tokens only
        local = bidirectional_mask(keys.shape[2], self.window)
        return keys, values, mask if local is None else mask & local

    def attend(
        self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask
    ) -> mx.array:
        return sdpa(queries, keys, values, scale, mask)


def mean_pool(hidden: mx.array, valid: mx.array) -> mx.array:
    """hidden (B, L, D), valid (B, L) bool -> (B, D) fp32: the mean over each row's real tokens
    (sentence-transformers' ``pooling_mode_mean_tokens``)."""
    weights = valid.astype(mx.float32)[..., None]  # (B, L, 1)
    total = (hidden.astype(mx.float32) * weights).sum(axis=1)
    return total / mx.maximum(weights.sum(axis=1), 1.0)


class Dense(nn.Module):
    """sentence-transformers' ``Dense`` with the identity activation (``linear.weight`` as in
    its ``model.safetensors``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.linear(x)


class SentenceHead(nn.Module):
    """Mean pooling, then the dense projections in order: final hidden states -> one vector per
    row (not normalized; the caller truncates, then normalizes)."""

    def __init__(self, hidden_size: int, dense: list[tuple[int, int, bool]]):
        super().__init__()
        self.dims = dense[-1][1] if dense else hidden_size  # the embedding width
        self.dense = [Dense(i, o, b) for i, o, b in dense]

    def __call__(self, hidden: mx.array, valid: mx.array) -> mx.array:
        """hidden (B, L, D), valid (B, L) bool -> (B, dims) fp32."""
        x = mean_pool(hidden, valid)
        for layer in self.dense:
            x = layer(x)
        return x


def encode(model: nn.Module, inputs: mx.array, valid: mx.array) -> mx.array:
    """Final hidden states (B, L, D) of a bidirectional model over the right-padded token ids
    ``inputs`` (B, L) int32, ``valid`` (B, L) bool marking real tokens. The model's layers are
    read for their sliding windows (``self_attn.window``: None on global layers)."""
    contexts = [PaddedBatch(valid, layer.self_attn.window) for layer in model.layers]
    return model.model(inputs, contexts)
