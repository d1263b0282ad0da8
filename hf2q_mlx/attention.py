"""The one attention call models make after ``cache.update_and_fetch``.

``attend(queries, keys, values, cache, scale, mask)`` sends a decode step (M <= 8 queries) on a
TurboQuant cache to the flash-decode kernel, which reads the packed cache. The first call marks
the cache, so from then on its ``update_and_fetch`` returns ``TQPacked`` placeholders instead
of dequantized keys/values for such steps (nothing unused is built); right after the first write
it hands the queries to the cache's key calibration (``TQBalance``). Everything else (prefill,
plain caches, no cache) goes to ``mx.fast.scaled_dot_product_attention`` with the given keys,
values and mask.
"""

from __future__ import annotations

import mlx.core as mx

from .custom_kernels.tq_flash_decode import tq_flash_decode
from .tq_cache import TQPacked, _TQMixin


def attend(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache,
    scale: float,
    mask: mx.array | None,
) -> mx.array:
    """queries (B, Hq, L, Dk), keys/values (B, Hkv, K, D) -> (B, Hq, L, Dv).

    ``mask`` is the boolean (L, K) mask ``update_and_fetch`` returned, or None. On the
    flash-decode path the kernel rebuilds exactly that mask (causal + window) from the cache's slot
    positions, so a caller-made mask of another kind must not be combined with a TurboQuant cache.
    ``keys``/``values`` may be the ``TQPacked`` placeholders ``update_and_fetch`` returned (also
    with ``cache=None``, in a layer that shares another layer's K/V).
    """
    if isinstance(keys, TQPacked):
        return tq_flash_decode(queries, keys.state, scale)
    if isinstance(cache, _TQMixin):
        if cache.needs_calibration:
            # the first write: key scales need these queries, so it is re-quantized with them
            keys, values, mask = cache.calibrate(queries)
        cache.flash_attend = True
        if cache.can_flash(queries.shape[2]):
            return tq_flash_decode(queries, cache.packed_state(), scale)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
