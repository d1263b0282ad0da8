"""KV caches: growing buffers for full attention, ring buffers for sliding-window attention.

Every cache keeps its write position in Python (``offset``), so building a decode step never
reads a value back from the device. ``update_and_fetch(keys, values)`` writes the new entries
with slice updates inside the graph and returns ``(keys, values, mask)``: the keys/values the
queries attend to and a boolean mask ``(L, K)`` (True = attend) or None when every key is visible.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from hf2q_mlx.custom_kernels.decode_attention import ring_slot_positions
from hf2q_mlx.errors import Hf2qError
from hf2q_mlx.models.sdpa import sdpa


def attention_mask(
    q_positions: mx.array, k_positions: mx.array, window: int | None = None
) -> mx.array:
    """Causal (and optionally sliding-window) boolean mask (L, K) from absolute positions.

    A key at position kp is visible to a query at qp when ``0 <= kp <= qp`` and, with a window W,
    ``kp > qp - W`` (W keys including the query's own), as in transformers' sliding attention.
    """
    qp = q_positions[:, None]
    kp = k_positions[None, :]
    mask = (kp <= qp) & (kp >= 0)
    if window is not None:
        mask = mask & (kp > qp - window)
    return mask


def causal_mask(length: int, offset: int = 0, window: int | None = None) -> mx.array | None:
    """Mask for ``length`` queries at positions offset.. against keys 0..offset+length-1."""
    if length == 1 and (window is None or offset < window):
        return None
    q = mx.arange(offset, offset + length)
    k = mx.arange(0, offset + length)
    return attention_mask(q, k, window)


@dataclass
class TokenTree:
    """The next write is a token tree (speculative verify): ``positions`` (1, L) int32 absolute
    position of each new token (offset + depth), ``mask`` (L, L) bool, True where a token may
    attend another new token (its ancestors and itself). Set as ``cache.tree`` on every layer
    cache for one forward, then cleared; ``ops.positions`` reads the positions."""

    positions: mx.array
    mask: mx.array


class _KVBuffers:
    """What every K/V buffer cache shares: ``keys``/``values`` arrays (None until the first
    write), the Python ``offset`` and the bytes they hold."""

    keys: mx.array | None = None
    values: mx.array | None = None
    tree: TokenTree | None = None

    def _slot(self, position: int) -> int:
        return position

    def keep(self, start: int, indices: list[int]) -> None:
        """After writes at ``start``..``offset``-1 (a token tree), keep the entries written at
        ``start + indices[j]`` as ``start + j`` (the accepted path, ``indices`` increasing) and
        forget the rest."""
        src = mx.array([self._slot(start + i) for i in indices])
        dst = mx.array([self._slot(start + j) for j in range(len(indices))])
        k, v = self.keys[..., src, :], self.values[..., src, :]  # gathered before the scatter
        self.keys[..., dst, :] = k
        self.values[..., dst, :] = v
        self.offset = start + len(indices)

    def is_trimmable(self) -> bool:
        return True

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.nbytes + self.values.nbytes

    def attend(
        self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask
    ) -> mx.array:
        """queries (B, Hq, L, Dk) over the keys/values and mask ``update_and_fetch`` returned."""
        return sdpa(queries, keys, values, scale, mask)


class KVCache(_KVBuffers):
    """Full-attention cache: one buffer per K and V that grows in steps of ``step`` tokens."""

    step = 256

    def __init__(self, max_size: int | None = None):
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0
        self.max_size = max_size

    def _grow(self, keys: mx.array, values: mx.array, needed: int) -> None:
        capacity = ((needed + self.step - 1) // self.step) * self.step
        B, H, _, Dk = keys.shape
        Dv = values.shape[-1]
        new_k = mx.zeros((B, H, capacity, Dk), dtype=keys.dtype)
        new_v = mx.zeros((B, H, capacity, Dv), dtype=values.dtype)
        if self.keys is not None and self.offset > 0:
            new_k[..., : self.offset, :] = self.keys[..., : self.offset, :]
            new_v[..., : self.offset, :] = self.values[..., : self.offset, :]
        self.keys, self.values = new_k, new_v

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """keys (B, H, L, Dk), values (B, H, L, Dv) -> (keys, values, mask) over all tokens."""
        L = keys.shape[2]
        prev = self.offset
        if self.max_size is not None and prev + L > self.max_size:
            raise Hf2qError(
                f"KV cache full: {prev} + {L} tokens exceed its size of {self.max_size}"
            )
        if self.keys is None or prev + L > self.keys.shape[2]:
            self._grow(keys, values, prev + L)
        self.keys[..., prev : prev + L, :] = keys
        self.values[..., prev : prev + L, :] = values
        self.offset = prev + L
        if self.tree is not None:  # every cached token, then the tree among the new ones
            seen = mx.ones((L, prev), dtype=mx.bool_)
            return (
                self.keys[..., : self.offset, :],
                self.values[..., : self.offset, :],
                (mx.concatenate([seen, self.tree.mask], axis=1)),
            )
        mask = causal_mask(L, prev)
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :], mask

    def trim(self, n: int) -> int:
        """Forget the last n tokens (speculative-decoding rollback); returns how many went."""
        n = max(0, min(n, self.offset))
        self.offset -= n
        return n


# one-token ring masks by (position, capacity, window): the sliding layers of a model share one
_RING_MASKS: dict[tuple[int, int, int], mx.array] = {}


def _ring_step_mask(pos: int, capacity: int, window: int) -> mx.array | None:
    """(1, capacity) mask of a one-token step at ``pos`` on a ring of ``capacity`` slots, or None
    when every slot is visible (a full ring without reserve slots: all hold the last ``window``
    positions). Built once per step and shared by every layer with the same ring, instead of
    ~7 small ops per layer."""
    if capacity == window and pos + 1 >= capacity:
        return None
    key = (pos, capacity, window)
    mask = _RING_MASKS.get(key)
    if mask is None:
        if len(_RING_MASKS) >= 64:
            _RING_MASKS.clear()
        p = ring_slot_positions(pos + 1, capacity)  # after the step's write
        mask = _RING_MASKS[key] = ((p >= 0) & (p > pos - window))[None]
    return mask


class RotatingKVCache(_KVBuffers):
    """Sliding-window cache: a ring of ``window + reserve`` slots; slot = position % capacity.

    Attention is order-free once RoPE is applied, so a decode step attends the whole ring in slot
    order with a mask built from each slot's position. ``reserve`` extra slots keep tokens that
    fell out of the window, so ``trim(n)`` stays exact for n <= reserve + 1 after the ring wraps.
    """

    def __init__(self, window: int, reserve: int = 0):
        if window < 1 or reserve < 0:
            raise Hf2qError(f"invalid ring cache: window={window}, reserve={reserve}")
        self.window = window
        self.capacity = window + reserve
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0

    def _slot(self, position: int) -> int:
        return position % self.capacity

    def slot_positions(self, offset: int | None = None) -> mx.array:
        """Absolute position held by each slot after ``offset`` writes (negative = empty)."""
        return ring_slot_positions(self.offset if offset is None else offset, self.capacity)

    def _history(self, buf: mx.array, n: int) -> mx.array:
        # the last n tokens in temporal order, gathered from at most two contiguous slot ranges
        start = (self.offset - n) % self.capacity
        if start + n <= self.capacity:
            return buf[..., start : start + n, :]
        return mx.concatenate(
            [buf[..., start:, :], buf[..., : start + n - self.capacity, :]], axis=2
        )

    def _write(self, buf: mx.array, new: mx.array, first_pos: int) -> None:
        m = new.shape[2]
        s0 = first_pos % self.capacity
        head = min(m, self.capacity - s0)
        buf[..., s0 : s0 + head, :] = new[..., :head, :]
        if head < m:
            buf[..., : m - head, :] = new[..., head:, :]

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        B, H, L, Dk = keys.shape
        C, W, o = self.capacity, self.window, self.offset
        if self.keys is None:
            self.keys = mx.zeros((B, H, C, Dk), dtype=keys.dtype)
            self.values = mx.zeros((B, H, C, values.shape[-1]), dtype=values.dtype)
        if L == 1 and self.tree is None:
            s = o % C
            self.keys[..., s : s + 1, :] = keys
            self.values[..., s : s + 1, :] = values
            self.offset = o + 1
            return self.keys, self.values, _ring_step_mask(o, C, W)
        n_hist = min(o, C)
        if n_hist > 0:
            k_all = mx.concatenate([self._history(self.keys, n_hist), keys], axis=2)
            v_all = mx.concatenate([self._history(self.values, n_hist), values], axis=2)
        else:
            k_all, v_all = keys, values
        if self.tree is None:
            mask = attention_mask(mx.arange(o, o + L), mx.arange(o - n_hist, o + L), W)
        else:  # window by tree positions; among the new tokens only the tree's edges
            pos = self.tree.positions[0]
            mask = attention_mask(pos, mx.concatenate([mx.arange(o - n_hist, o), pos]), W)
            tree = mx.concatenate([mx.ones((L, n_hist), dtype=mx.bool_), self.tree.mask], axis=1)
            mask = mask & tree
        m = min(L, C)
        self._write(self.keys, keys[..., L - m :, :], o + L - m)
        self._write(self.values, values[..., L - m :, :], o + L - m)
        self.offset = o + L
        return k_all, v_all, mask

    def trim(self, n: int) -> int:
        n = max(0, min(n, self.offset))
        # once wrapped, a trimmed slot's earlier token is gone; it is still needed when n is
        # larger than the reserve + 1
        if self.offset - 1 >= self.capacity and n > self.capacity - self.window + 1:
            raise Hf2qError(
                f"cannot roll back {n} tokens of a sliding-window cache with "
                f"{self.capacity - self.window} reserve slots (at most "
                f"{self.capacity - self.window + 1}); make the cache with a larger reserve"
            )
        self.offset -= n
        return n


def ring_resume_floor(position: int, capacity: int, window: int) -> int:
    """The fewest tokens a ring holding ``position`` written tokens can be cut back to: after a
    cut to m, the next query reads positions m - window + 1 .. m - 1, and each must still be in
    its slot (slot = position % capacity, overwritten by position + capacity once written)."""
    if position <= capacity:
        return 0
    return max(0, position - capacity + window - 1)


def trim_cache(cache: list, n: int) -> int:
    """Roll every layer's cache back by n tokens; returns the number trimmed."""
    trimmed = 0
    for c in cache:
        trimmed = c.trim(n)
    return trimmed
