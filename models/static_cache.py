"""Preallocated caches for a compiled step over B rows, each row at its own position.

The step sets every cache's ``pos`` (B,) int32 (tokens each row holds before the call) and
``active`` (B,) bool, then the model writes and reads the caches as usual. Writes are scatters at
per-row slots and masks are built on the device from ``pos``, so one traced graph serves every
token: nothing here reads a value back from the device.

- ``StaticKVCache``: full attention, ``capacity`` slots per row; attention reads the first
  ``span`` slots, a bucket the step chooses (a few traces instead of reading the whole buffer).
- ``StaticKVCache(window=W)``: sliding-window ring, slot = position % capacity, with
  ``capacity - W`` reserve slots so that L > 1 tokens (a verify step) can be written at once.
- ``StaticRecurrentCache``: Qwen 3.5's conv and delta-net state; inactive rows keep theirs.
"""

from __future__ import annotations

import mlx.core as mx

from hf2q_mlx.errors import Hf2qError


class _RowPositions:
    pos: mx.array  # (B,) int32: tokens each row holds before this call
    active: mx.array  # (B,) bool: rows that advance

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

    def key_positions(self, L: int) -> mx.array:
        """(B, S) absolute position held by each attended slot after this call's L writes
        (negative = empty)."""
        end = self.pos[:, None] + L  # (B, 1): tokens held after the write
        i = mx.arange(self.span)[None]
        if self.window is None:
            return mx.where(i < end, i, -1)
        return (end - 1) - ((end - 1 - i) % self.capacity)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """keys (B, H, L, Dk), values (B, H, L, Dv) written at each row's position ->
        (keys, values, mask (B, 1, L, S))."""
        B, H, L, _ = keys.shape
        q_pos = self.pos[:, None] + mx.arange(L)[None]  # (B, L)
        slots = q_pos if self.window is None else q_pos % self.capacity
        self.keys = _scatter(self.keys, slots, keys)
        self.values = _scatter(self.values, slots, values)
        k_pos = self.key_positions(L)[:, None, :]  # (B, 1, S)
        mask = (k_pos >= 0) & (k_pos <= q_pos[:, :, None])
        if self.window is not None:
            mask = mask & (k_pos > q_pos[:, :, None] - self.window)
        k, v = self.keys, self.values
        if self.span < self.capacity:
            k, v = k[:, :, : self.span], v[:, :, : self.span]
        return k, v, mask[:, None]

    def attend(self, queries, keys, values, scale: float, mask) -> mx.array:
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def _scatter(buf: mx.array, slots: mx.array, new: mx.array) -> mx.array:
    """buf (B, H, C, D) with new (B, H, L, D) written at slots (B, L) of each row."""
    B, H, L, D = new.shape
    idx = mx.broadcast_to(slots[:, None, :, None], (B, H, L, D))
    return mx.put_along_axis(buf, idx, new.astype(buf.dtype), axis=2)


class StaticRecurrentCache(_RowPositions):
    """``conv_state`` (B, K-1, C) and ``state`` (B, Hv, Dv, Dk) for B rows."""

    def __init__(self, conv_state: mx.array, state: mx.array):
        self.conv_state, self.state = conv_state, state

    @property
    def arrays(self) -> list[mx.array]:
        return [self.conv_state, self.state]

    @arrays.setter
    def arrays(self, arrays: list[mx.array]) -> None:
        self.conv_state, self.state = arrays

    def update(self, conv_state: mx.array, state: mx.array, length: int) -> None:
        keep = self.active
        self.conv_state = mx.where(keep[:, None, None], conv_state, self.conv_state)
        self.state = mx.where(keep[:, None, None, None], state, self.state)
