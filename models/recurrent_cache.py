"""Recurrent-layer cache (Qwen 3.5 gated delta-net) and whole-model snapshot / restore.

MLX arrays are immutable values and this cache only ever replaces its arrays (never writes into
them), so a snapshot is a tuple of references: taking one costs nothing and restoring it is exact.
``trim(n)`` rolls back through a short history of earlier states kept for ``reserve`` tokens;
any other rollback goes through ``snapshot()`` / ``restore(state)``.
"""

from __future__ import annotations

from collections import deque

import mlx.core as mx

from hf2q_mlx.errors import Hf2qError


class RecurrentCache:
    """``conv_state`` (B, K-1, C): the last K-1 conv inputs; ``state`` (B, Hv, Dv, Dk) fp32."""

    def __init__(self, reserve: int = 0):
        if reserve < 0:
            raise Hf2qError(f"invalid recurrent cache reserve: {reserve}")
        self.reserve = reserve
        self.conv_state: mx.array | None = None
        self.state: mx.array | None = None
        self.offset = 0
        # (offset, conv_state, state) before each recent update, oldest first
        self._history: deque = deque()

    def update(self, conv_state: mx.array, state: mx.array, length: int) -> None:
        """Replace both states after a forward pass over ``length`` new tokens."""
        if self.reserve > 0:
            self._history.append((self.offset, self.conv_state, self.state))
            while self._history and self.offset + length - self._history[0][0] > self.reserve:
                self._history.popleft()
        self.conv_state, self.state = conv_state, state
        self.offset += length

    def snapshot(self) -> tuple:
        """The current state as an opaque value for ``restore``."""
        return (self.offset, self.conv_state, self.state)

    def restore(self, snap: tuple) -> None:
        """Go back (or forward) to a snapshot taken earlier from this cache."""
        self.offset, self.conv_state, self.state = snap
        self._history = deque(h for h in self._history if h[0] < self.offset)

    def is_trimmable(self) -> bool:
        return self.reserve > 0

    def trim(self, n: int) -> int:
        """Forget the last n tokens; exact when n lands on an update kept in the history."""
        n = max(0, min(n, self.offset))
        if n == 0:
            return 0
        target = self.offset - n
        while self._history and self._history[-1][0] > target:
            self._history.pop()
        if not self._history or self._history[-1][0] != target:
            raise Hf2qError(
                f"cannot roll a recurrent cache back by {n} tokens: it keeps the states of the "
                f"last {self.reserve} tokens at update boundaries only; make the cache with a "
                "larger reserve or use snapshot() / restore()"
            )
        self.offset, self.conv_state, self.state = self._history.pop()
        return n

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.conv_state, self.state) if a is not None)


def snapshot_cache(cache: list) -> list:
    """Snapshot of a model's cache list: recurrent states by reference, KV caches by offset."""
    return [c.snapshot() if isinstance(c, RecurrentCache) else c.offset for c in cache]


def restore_cache(cache: list, snap: list) -> None:
    """Return every layer to ``snap``; KV caches are trimmed back to the offset they had."""
    for c, s in zip(cache, snap):
        if isinstance(c, RecurrentCache):
            c.restore(s)
        elif c.offset < s:
            raise Hf2qError(f"cannot restore a KV cache at offset {c.offset} forward to {s}")
        else:
            c.trim(c.offset - s)
