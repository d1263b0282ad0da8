"""Saved row states keyed by the prompt tokens they hold, bounded by bytes, evicted LRU first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


def saved_nbytes(saved: Any) -> int:
    """Bytes a ``save_row`` snapshot holds (its ``nbytes`` property)."""
    return int(getattr(saved, "nbytes", 0))


def whole_entries(common: int, length: int, saved: Any) -> int:
    """``match``'s default rule: an entry serves only when all its tokens begin the prompt."""
    return length if common == length else 0


class PrefixPool:
    """``tokens -> saved row state``; ``match(ids)`` finds the entry that serves the most of ids.

    An entry serves the tokens it shares with ids where the row's state can be cut back to them
    (full-attention KV: any prefix; a recurrent state: all or nothing), which the caller's
    ``usable`` rule decides. The pool never holds more than ``budget_bytes``: the least recently
    used entries go first, and an entry larger than the budget is not kept.
    """

    def __init__(self, budget_bytes: int) -> None:
        self.budget = max(0, int(budget_bytes))
        self.entries: OrderedDict[tuple[int, ...], tuple[Any, int, np.ndarray]] = OrderedDict()
        self.nbytes = 0
        self.hits = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, tokens: Sequence[int]) -> bool:
        return tuple(tokens) in self.entries

    def put(self, tokens: Sequence[int], saved: Any, evict: bool = True) -> bool:
        """Keep ``saved`` under ``tokens``; False when it does not fit the budget (with
        ``evict=False``: the budget left free, so no entry makes room for it)."""
        key = tuple(tokens)
        size = saved_nbytes(saved)
        if key in self.entries:
            self.entries.move_to_end(key)
            return True
        room = self.budget if evict else self.budget - self.nbytes
        if size > room:
            return False
        while self.entries and self.nbytes + size > self.budget:
            _, (_, old, _) = self.entries.popitem(last=False)
            self.nbytes -= old
            self.evictions += 1
        self.entries[key] = (saved, size, np.asarray(key, dtype=np.int64))
        self.nbytes += size
        return True

    def match(
        self, ids: Sequence[int], usable: Callable[[int, int, Any], int] = whole_entries
    ) -> tuple[int, Any]:
        """(tokens served, saved) of the entry that serves the most of ``ids``, or (0, None).

        ``usable(common, length, saved)``: how many tokens an entry of ``length`` tokens that
        shares its first ``common`` with ids can serve (0: none)."""
        if not self.entries or not len(ids):
            return 0, None
        want = np.asarray(ids, dtype=np.int64)
        best, best_key = 0, None
        for key, (saved, _, arr) in self.entries.items():
            k = min(len(arr), len(want))
            diff = np.flatnonzero(arr[:k] != want[:k])
            common = int(diff[0]) if diff.size else k
            n = usable(common, len(arr), saved) if common else 0
            if n > best:
                best, best_key = n, key
        if best_key is None:
            return 0, None
        self.entries.move_to_end(best_key)
        self.hits += 1
        return best, self.entries[best_key][0]

    def drop_covered(self, tokens: Sequence[int], covered: Callable[[int], bool]) -> int:
        """Drop the entries whose tokens begin ``tokens`` (shorter ones) where ``covered(length)``
        says the entry under ``tokens`` serves every prompt they serve; returns how many went."""
        want = np.asarray(tokens, dtype=np.int64)
        gone = [
            key
            for key, (_, _, arr) in self.entries.items()
            if len(arr) < len(want) and covered(len(arr)) and np.array_equal(arr, want[: len(arr)])
        ]
        for key in gone:
            self.nbytes -= self.entries.pop(key)[1]
        return len(gone)

    def clear(self) -> None:
        self.entries.clear()
        self.nbytes = 0
