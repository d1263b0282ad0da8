"""Saved row states keyed by the prompt tokens they hold, bounded by bytes, evicted LRU first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any


def saved_nbytes(saved: Any) -> int:
    """Bytes a ``save_row`` snapshot holds (its ``nbytes`` property)."""
    return int(getattr(saved, "nbytes", 0))


class PrefixPool:
    """``tokens -> saved row state``; ``longest(ids)`` finds the longest saved prefix of ids.

    Entries are whole snapshots (KV, rings, recurrent state), so only an entry whose every token
    begins ``ids`` can be reused. The pool never holds more than ``budget_bytes``: the least
    recently used entries go first, and an entry larger than the budget is not kept.
    """

    def __init__(self, budget_bytes: int) -> None:
        self.budget = max(0, int(budget_bytes))
        self.entries: OrderedDict[tuple[int, ...], tuple[Any, int]] = OrderedDict()
        self.nbytes = 0
        self.hits = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, tokens: Sequence[int]) -> bool:
        return tuple(tokens) in self.entries

    def put(self, tokens: Sequence[int], saved: Any) -> bool:
        """Keep ``saved`` under ``tokens``; False when it cannot fit the budget at all."""
        key = tuple(tokens)
        size = saved_nbytes(saved)
        if key in self.entries:
            self.entries.move_to_end(key)
            return True
        if size > self.budget:
            return False
        while self.entries and self.nbytes + size > self.budget:
            _, (_, old) = self.entries.popitem(last=False)
            self.nbytes -= old
            self.evictions += 1
        self.entries[key] = (saved, size)
        self.nbytes += size
        return True

    def longest(self, ids: Sequence[int], usable=None) -> tuple[int, Any]:
        """(length, saved) of the longest entry that is a prefix of ``ids`` (and whose length
        ``usable(length)`` accepts, where given); (0, None) if none."""
        lengths = sorted({len(k) for k in self.entries if len(k) <= len(ids)}, reverse=True)
        if usable is not None:
            lengths = [n for n in lengths if usable(n)]
        for n in lengths:
            key = tuple(ids[:n])
            if key in self.entries:
                self.entries.move_to_end(key)
                self.hits += 1
                return n, self.entries[key][0]
        return 0, None

    def clear(self) -> None:
        self.entries.clear()
        self.nbytes = 0
