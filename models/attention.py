"""The one attention call models make after ``cache.update_and_fetch``.

``attend(queries, keys, values, cache, scale, mask)`` hands the call to the cache that fetched
the keys/values (``cache.attend``): plain caches run ``sdpa`` (models/sdpa.py: MLX's attention),
TurboQuant caches their flash-decode kernel on the packed buffers where it applies. Without a
cache it is plain attention, or the flash-decode kernel on ``TQPacked`` placeholders (a layer
that shares another layer's TurboQuant K/V).
"""

from __future__ import annotations

import mlx.core as mx

from hf2q_mlx.models.sdpa import sdpa
from hf2q_mlx.models.turboquant.cache import TQPacked


def attend(
    queries: mx.array,
    keys: mx.array | TQPacked,
    values: mx.array | TQPacked,
    cache,
    scale: float,
    mask: mx.array | None,
) -> mx.array:
    """queries (B, Hq, L, Dk), keys/values (B, Hkv, K, D) -> (B, Hq, L, Dv), or (B, L, Hq * Dv)
    from a cache that merges the heads itself (``StaticKVCache``: its kernel writes that layout).

    ``mask`` is the boolean (L, K) mask ``update_and_fetch`` returned, or None.
    """
    if cache is not None:
        return cache.attend(queries, keys, values, scale, mask)
    if isinstance(keys, TQPacked):
        return keys.attend(queries, scale)
    return sdpa(queries, keys, values, scale, mask)
