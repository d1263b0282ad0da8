"""Small pieces shared by every architecture: argument dataclasses and attention."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import mlx.core as mx


@dataclass
class BaseModelArgs:
    @classmethod
    def from_dict(cls, params: dict):
        """Build from a config dict, ignoring keys this architecture does not use."""
        names = inspect.signature(cls).parameters
        return cls(**{k: v for k, v in params.items() if k in names})


def scaled_dot_product_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
    mask: mx.array | None,
) -> mx.array:
    """queries (B, Hq, L, D), keys/values (B, Hkv, K, D) with Hq % Hkv == 0 -> (B, Hq, L, Dv).

    ``mask`` is a boolean (L, K) array (True = attend) or None; grouped-query attention is handled
    by the fused kernel without repeating K/V.
    """
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
