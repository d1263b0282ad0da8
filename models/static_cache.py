"""Preallocated caches for a compiled step over B rows, each row at its own position.

The step sets every cache's ``pos`` (B,) int32 (tokens each row holds before the call) and
``active`` (B,) bool, then the model writes and reads the caches as usual. Writes are scatters at
per-row slots and masks are built on the device from ``pos``, so one traced graph serves every
token: nothing here reads a value back from the device.

- ``StaticKVCache``: full attention, ``capacity`` slots per row; attention reads the first
  ``span`` slots, a bucket the step chooses (a few traces instead of reading the whole buffer).
- ``StaticKVCache(window=W)``: sliding-window ring, slot = position % capacity, with
  ``capacity - W`` reserve slots so that L > 1 tokens (a verify step) can be written at once.
- ``StaticRecurrentCache``: Qwen 3.5's conv and delta-net state; inactive rows keep theirs. An
  L > 1 call (a speculative verify) runs the recurrence over the L tokens in one decode kernel
  (``models.ops.gated_delta_net``), which also leaves every token's starting states
  (``history``), so that a rollback picks the state after the accepted tokens exactly.
"""

from __future__ import annotations

import mlx.core as mx

from hf2q_mlx.custom_kernels import launch_recorder
from hf2q_mlx.custom_kernels.decode_attention import decode_attention, visible
from hf2q_mlx.custom_kernels.graph_ops import kv_write, scatter_slots
from hf2q_mlx.errors import Hf2qError


class _RowPositions:
    pos: mx.array  # (B,) int32: tokens each row holds before this call
    active: mx.array  # (B,) bool: rows that advance
    shared: dict | None = None  # one step's values computed once for all layers

    @property
    def offset(self):
        raise Hf2qError("a static cache has one position per row: read .pos, not .offset")


class StaticKVCache(_RowPositions):
    """keys (B, H, C, Dk) / values (B, H, C, Dv) for B rows; ``window`` None = full attention."""

    def __init__(self, keys: mx.array, values: mx.array, window: int | None = None):
        # a ring shorter than its window is fine when it never wraps (capacity >= max length)
        self.keys, self.values, self.window = keys, values, window
        self.capacity = keys.shape[2]
        self.span = self.capacity

    @property
    def arrays(self) -> list[mx.array]:
        return [self.keys, self.values]

    @arrays.setter
    def arrays(self, arrays: list[mx.array]) -> None:
        self.keys, self.values = arrays

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """keys (B, H, L, Dk), values (B, H, L, Dv) written at each row's position ->
        (keys, values, mask (B, 1, L, S))."""
        L = keys.shape[2]
        if launch_recorder.active():  # a CUDA graph step: written in place, slots on the GPU
            ring = self.window is not None
            self.keys, self.values = kv_write(self.keys, self.values, keys, values, self.pos, ring)
        else:
            slots = self._slots(L)
            self.keys = scatter_slots(self.keys, slots, keys)
            self.values = scatter_slots(self.values, slots, values)
        mask = visible(self.pos, L, self.read_span, self.capacity, self.window)  # (B, 1, L, S)
        k, v = self.keys, self.values
        if self.read_span < self.capacity:
            k, v = k[:, :, : self.read_span], v[:, :, : self.read_span]
        return k, v, mask

    @property
    def read_span(self) -> int:
        """Slots attention reads: the step's bucket (full attention) or the whole ring."""
        return self.span if self.window is None else self.capacity

    def _slots(self, L: int) -> mx.array:
        """(B, L) slot of each new token. One set of ops per step: the step hands every cache
        the same ``shared`` dict, so layers with the same ring size reuse the first one's."""
        memo = self.shared if self.shared is not None else {}
        key = (L, None if self.window is None else self.capacity)
        if key not in memo:
            q_pos = self.pos[:, None] + mx.arange(L)[None]  # (B, L)
            memo[key] = q_pos if self.window is None else q_pos % self.capacity
        return memo[key]

    def attend(self, queries, keys, values, scale: float, mask) -> mx.array:
        # one kernel with the masks worked out from pos inside it (the mask above stays unbuilt);
        # out (B, L, Hq * Dv): the heads merged as the output projection reads them
        return decode_attention(
            queries, self.keys, self.values, self.pos, scale, self.read_span, self.window, True
        )


class StaticRecurrentCache(_RowPositions):
    """``conv_state`` (B, K-1, C) and ``state`` (B, Hv, Dv, Dk) for B rows."""

    def __init__(self, conv_state: mx.array, state: mx.array):
        self.conv_state, self.state = conv_state, state
        # after an L > 1 call: [conv (B, L, K-1, C), state (B, L, Hv, Dv, Dk)], index j = the
        # row's state after j of the call's tokens (0: before the call; after all L: the state)
        self.history: list[mx.array] | None = None

    @property
    def arrays(self) -> list[mx.array]:
        return [self.conv_state, self.state]

    @arrays.setter
    def arrays(self, arrays: list[mx.array]) -> None:
        self.conv_state, self.state = arrays

    def update(self, conv_state: mx.array, state: mx.array, length: int) -> None:
        """One token's new states (the path without kernels), inactive rows masked."""
        self.history = None  # an L > 1 call leaves its history through the decode kernel
        keep = self.active
        self.conv_state = mx.where(keep[:, None, None], conv_state, self.conv_state)
        self.state = mx.where(keep[:, None, None, None], state, self.state)

    def rollback(self, history: list[mx.array], kept: mx.array, rows: mx.array) -> None:
        """Rows ``rows`` (B,) bool take their state after ``kept`` (B,) int32 tokens of the call
        that left ``history`` (kept < L for those rows); the others keep theirs."""
        out = []
        last = history[0].shape[1] - 1  # a row kept whole (kept = L) gathers in bounds, unused
        kept = mx.minimum(kept, last)
        for cur, hist in zip(self.arrays, history):
            idx = kept.reshape((-1,) + (1,) * (hist.ndim - 1))
            picked = mx.take_along_axis(hist, idx, axis=1)[:, 0]
            out.append(mx.where(rows.reshape((-1,) + (1,) * (cur.ndim - 1)), picked, cur))
        self.arrays = out
