"""RotatingKVCache's one-token step mask: shared across layers, None when every slot is visible."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from hf2q_mlx.models.cache import RotatingKVCache, attention_mask


def _explicit_mask(cache: RotatingKVCache, pos: int) -> np.ndarray:
    """The step's mask from absolute positions: slot i holds position p_i after the write."""
    p = cache.slot_positions()
    return np.array(attention_mask(mx.array([pos]), p, cache.window))


@pytest.mark.parametrize("window,reserve", [(5, 0), (5, 3), (1, 0), (4, 1)])
def test_step_mask_matches_positions(window, reserve):
    rng = np.random.default_rng(window + reserve)
    a, b = RotatingKVCache(window, reserve), RotatingKVCache(window, reserve)
    for pos in range(3 * (window + reserve) + 2):
        k = mx.array(rng.standard_normal((1, 2, 1, 4)).astype(np.float32))
        _, _, mask = a.update_and_fetch(k, k)
        _, _, mask_b = b.update_and_fetch(k, k)
        want = _explicit_mask(a, pos)
        if mask is None:
            # only a full ring without reserve drops the mask, where every slot is visible
            assert reserve == 0 and pos + 1 >= window and want.all()
        else:
            np.testing.assert_array_equal(np.array(mask), want)
            assert mask is mask_b  # a second layer at the same step reuses the same array
