"""Several rows' prompt chunks in one forward pass (``DecodeStep.prefill_rows``).

The rows' tokens are packed into one sequence (1, T): norms, projections, MLPs and the MoE see T
tokens at once (one weight read for all of them), while each layer's ``PackedRows`` cache sends
every row's segment of the keys and values to that row's own per-sequence cache and runs each
segment's queries against it. RoPE takes one position per token (``segment_positions``, read by
``ops.positions``), so each segment rotates from its row's position. A recurrent layer (Qwen
3.5's gated delta-net) runs each segment from its row's state (``per_row``).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from hf2q_mlx.models.attention import attend


def segment_positions(starts: Sequence[int], lengths: Sequence[int]) -> mx.array:
    """(1, T) int32: each segment's positions start, start + 1, ... packed one after another."""
    parts = [mx.arange(s, s + n, dtype=mx.int32) for s, n in zip(starts, lengths)]
    return mx.concatenate(parts)[None]


class PackedRows:
    """One layer's cache for a packed forward: ``views[j]`` is segment j's row cache (a
    per-sequence cache of the model's kind), ``bounds[j]`` its token range in the pack."""

    def __init__(self, views: Sequence, bounds: Sequence[tuple[int, int]], positions: mx.array):
        self.views, self.bounds = list(views), list(bounds)
        self.segment_positions = positions  # (1, T), shared by every layer
        self._fetched: list[tuple] = []

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """keys (1, H, T, Dk), values (1, H, T, Dv): each segment into its row's cache; what each
        cache returns is kept for ``attend`` (the arrays handed back are only placeholders)."""
        self._fetched = [
            view.update_and_fetch(keys[:, :, a:b], values[:, :, a:b])
            for view, (a, b) in zip(self.views, self.bounds)
        ]
        return keys, values, None

    def attend(self, queries: mx.array, keys, values, scale: float, mask) -> mx.array:
        """queries (1, Hq, T, Dk) -> (1, Hq, T, Dv): each segment over its own row's keys."""
        outs = [
            attend(queries[:, :, a:b], k, v, view, scale, m)
            for view, (a, b), (k, v, m) in zip(self.views, self.bounds, self._fetched)
        ]
        self._fetched = []
        return mx.concatenate(outs, axis=2 if outs[0].ndim == 4 else 1)

    def per_row(self, fn, *xs: mx.array) -> mx.array:
        """``fn(view, *segments)`` for each row, each x (1, T, ...) cut to the row's tokens,
        the outputs joined on the token axis: a recurrent layer (its state is per row)."""
        outs = [fn(view, *(x[:, a:b] for x in xs)) for view, (a, b) in zip(self.views, self.bounds)]
        return mx.concatenate(outs, axis=1)
