"""Preallocated caches for a compiled step over B rows, each row at its own position.

The step sets every cache's ``pos`` (B,) int32 (tokens each row holds before the call) and
``active`` (B,) bool, then the model writes and reads the caches as usual. Writes are scatters at
per-row slots and masks are built on the device from ``pos``, so one traced graph serves every
token: nothing here reads a value back from the device.

- ``StaticKVCache``: full attention, ``capacity`` slots per row; attention reads the first
  ``span`` slots, a bucket the step chooses (a few traces instead of reading the whole buffer).
- ``StaticKVCache(window=W)``: sliding-window ring, slot = position % capacity, with
  ``capacity - W`` reserve slots so that L > 1 tokens (a verify step) can be written at once.
- ``StaticTQCache``: either of the above holding TurboQuant rows (packed codes) and each row's
  ``TQBalance`` tables; attention is the flash-decode kernel reading every row's own offset.
- ``StaticRecurrentCache``: Qwen 3.5's conv and delta-net state; inactive rows keep theirs. An
  L > 1 call (a speculative verify) runs the recurrence over the L tokens in one decode kernel
  (``models.ops.gated_delta_net``), which also leaves every token's starting states
  (``history``), so that a rollback picks the state after the accepted tokens exactly.
"""

from __future__ import annotations

import mlx.core as mx

from hf2q_mlx.custom_kernels import env_int, launch_recorder
from hf2q_mlx.custom_kernels.decode_attention import decode_attention, visible
from hf2q_mlx.custom_kernels.graph_ops import kv_write, scatter_slots
from hf2q_mlx.custom_kernels.launch_recorder import GraphCaptureError
from hf2q_mlx.custom_kernels.tq_flash_decode import fold
from hf2q_mlx.errors import Hf2qError, InvalidArgumentError
from hf2q_mlx.models.turboquant.cache import (
    FULL_WINDOW,
    TQKVCache,
    TQPacked,
    TQRotatingKVCache,
)
from hf2q_mlx.models.turboquant.kernels import tq_quantize, tq_quantize_kv_into
from hf2q_mlx.models.turboquant.state import TQBalance, TQState


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
        self._write(keys, values)
        mask = visible(self.pos, L, self.read_span, self.capacity, self.window)  # (B, 1, L, S)
        k, v = self.keys, self.values
        if self.read_span < self.capacity:
            k, v = k[:, :, : self.read_span], v[:, :, : self.read_span]
        return k, v, mask

    def _write(self, keys: mx.array, values: mx.array) -> None:
        """keys / values (B, H, L, D*) into each row's next L slots."""
        if launch_recorder.active():  # a CUDA graph step: written in place, slots on the GPU
            ring = self.window is not None
            self.keys, self.values = kv_write(self.keys, self.values, keys, values, self.pos, ring)
        else:
            slots = self._slots(keys.shape[2])
            self.keys = scatter_slots(self.keys, slots, keys)
            self.values = scatter_slots(self.values, slots, values)

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


# TurboQuant rows in a recorded CUDA graph step (kv_write_words, per-row offsets read by the
# flash-decode kernel): the replay equals the MLX step bit for bit on the CPU emulator, and on
# the H200 (session 25) the graph's tokens equal the compiled step's on tiny Gemma 4 / Qwen 3.5
# MoE models. On unless HF2Q_TQ_GRAPH=0 (then the graph refuses these caches and the compiled
# step decodes them).
def tq_graph() -> bool:
    return env_int("HF2Q_TQ_GRAPH", 0, 1) != 0


class StaticTQCache(StaticKVCache):
    """``StaticKVCache`` of TurboQuant rows: keys (B, H, C, k words) / values (B, H, C, v words)
    uint32 packed as ``TQKVCache`` packs them, and each row's ``TQBalance`` as (B, H, D) fp32
    tables (identity where the row's cache had none: x - 0 and x / 1 are exact, so a row decodes
    as its per-sequence cache would). ``like``: a per-sequence TurboQuant cache that has been
    written; its codecs and settings serve every row."""

    def __init__(self, keys, values, tables: list[mx.array], like, window: int | None = None):
        super().__init__(keys, values, window)
        self.k_scale, self.v_scale, self.k_mean = tables
        self.k_codec, self.v_codec = like.k_codec, like.v_codec
        self.settings = dict(
            k_bits=like.k_bits, v_bits=like.v_bits, seed=like.seed, balance=like.balance,
            rope_dims=like.rope_dims, center=like.center, rope_freqs=like.rope_freqs,
        )  # fmt: skip

    # arrays: the two packed buffers (slots on axis 2), then the three per-row tables
    SLOT_ARRAYS = 2

    @property
    def arrays(self) -> list[mx.array]:
        return [self.keys, self.values, self.k_scale, self.v_scale, self.k_mean]

    @arrays.setter
    def arrays(self, arrays: list[mx.array]) -> None:
        self.keys, self.values, self.k_scale, self.v_scale, self.k_mean = arrays

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """keys (B, H, L, Dk), values (B, H, L, Dv) quantized with each row's balance and
        written at its position -> (TQPacked, TQPacked, None): attention reads the packed rows."""
        if launch_recorder.active() and not tq_graph():
            raise GraphCaptureError("TurboQuant caches kept out of graphs (HF2Q_TQ_GRAPH=0)")
        L = keys.shape[2]
        if launch_recorder.active() and fold():
            # HF2Q_TQ_FOLD=1: one quantize launch writes the K and V rows into their caches
            self.keys, self.values = tq_quantize_kv_into(
                (self.keys, self.values), (keys, values), (self.k_codec, self.v_codec),
                (self.k_scale, self.v_scale), self.k_mean, self.pos, self.window is not None,
            )  # fmt: skip
        else:
            pk = tq_quantize(keys, self.k_codec, self.k_scale, self.k_mean)
            pv = tq_quantize(values, self.v_codec, self.v_scale)
            self._write(pk, pv)  # in a graph: kv_write_words, the packed rows in place
        balance = TQBalance(k_scale=self.k_scale, v_scale=self.v_scale)
        # the kernel adds L to the positions itself: a recorded graph reads the step's input
        state = TQState(
            self.keys, self.values, self.k_codec, self.v_codec, self.pos, self.capacity,
            self.window or FULL_WINDOW, balance, span=self.read_span, offset_add=L,
        )  # fmt: skip
        packed = TQPacked(state)
        return packed, packed, None

    def attend(self, queries, keys, values, scale: float, mask) -> mx.array:
        return keys.attend(queries, scale)  # (B, Hq, L, Dv)

    def row_view(self, row: int, pos: int):
        """A per-sequence TurboQuant cache over the row's slots and balance (its offset left to
        the caller); at ``pos`` 0 an empty one, so the first write calibrates the row."""
        C, W = self.capacity, self.window
        if W is not None and C >= W:
            c = TQRotatingKVCache(W, reserve=C - W, **self.settings)
        else:  # full attention, or a ring shorter than its window (it never wraps)
            c = TQKVCache(max_size=C, **self.settings)
        if pos > 0:
            c.k_codec, c.v_codec = self.k_codec, self.v_codec
            c.keys, c.values = self.keys[row : row + 1], self.values[row : row + 1]
            c.tq_balance.set(
                k_scale=self.k_scale[row], v_scale=self.v_scale[row], k_mean=self.k_mean[row]
            )
        return c

    def row_tables(self, cache) -> list[mx.array]:
        """A per-sequence TurboQuant cache's balance as this cache's row tables (H, D); raises
        where its codecs differ from the rows'."""
        own = (cache.k_bits, cache.v_bits, cache.seed)
        mine = tuple(self.settings[k] for k in ("k_bits", "v_bits", "seed"))
        if own != mine:
            raise InvalidArgumentError(
                f"a TurboQuant cache of (k bits, v bits, seed) {own}, rows of {mine}"
            )
        bal = cache.tq_balance
        out = []
        pairs = ((bal.k_scale, self.k_scale, 1.0), (bal.v_scale, self.v_scale, 1.0),
                 (bal.k_mean, self.k_mean, 0.0))  # fmt: skip
        for a, ref, fill in pairs:
            out.append(
                mx.full(ref.shape[1:], fill, ref.dtype) if a is None else a.astype(ref.dtype)
            )
        return out


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
