"""Incremental text of one stream: detokenizing, stop strings held back until they cannot match."""

from __future__ import annotations

from typing import Any


class StopText:
    """Feeds tokens to a streaming detokenizer and releases text that cannot begin a stop string.

    ``add(token) -> (text, stopped)``: the new text to emit and whether a stop string appeared
    (the stop string and everything after it are never emitted). ``finish()`` releases the held
    tail once generation ends for another reason.
    """

    def __init__(self, tokenizer: Any, stops: list[str]) -> None:
        self.detok = tokenizer.detokenizer()
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.pending = ""

    def _release(self) -> tuple[str, bool]:
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            text, self.pending = self.pending[: min(hits)], ""
            return text, True
        # hold the longest tail that could still grow into a stop string
        for k in range(min(len(self.pending), self.hold), 0, -1):
            tail = self.pending[-k:]
            if any(s.startswith(tail) for s in self.stops):
                text, self.pending = self.pending[:-k], tail
                return text, False
        text, self.pending = self.pending, ""
        return text, False

    def add(self, token: int) -> tuple[str, bool]:
        self.detok.add_token(token)
        self.pending += self.detok.last_segment
        return self._release()

    def finish(self) -> tuple[str, bool]:
        """Flush the detokenizer; a stop string completed by the flush still stops."""
        self.detok.finalize()
        self.pending += self.detok.last_segment
        text, stopped = self._release()
        if not stopped:
            text, self.pending = text + self.pending, ""
        return text, stopped
