"""SentencePiece's precompiled character map (the ``Precompiled`` normalizer of tokenizer.json)."""

from __future__ import annotations

import sys
from array import array

from hf2q_mlx.errors import TokenizerError


class CharsMap:
    """SentencePiece's precompiled normalization rules: a darts-clone double-array trie over
    UTF-8 bytes, whose values index NUL-terminated replacement strings; longest match wins."""

    def __init__(self, blob: bytes):
        if len(blob) < 4:
            raise TokenizerError("precompiled charsmap too short")
        size = int.from_bytes(blob[:4], "little")
        if size % 4 or 4 + size > len(blob):
            raise TokenizerError("precompiled charsmap: bad trie size")
        self._units = array("I", blob[4 : 4 + size])
        if sys.byteorder == "big":
            self._units.byteswap()
        self._strings = blob[4 + size :]

    @staticmethod
    def _offset(unit: int) -> int:
        return (unit >> 10) << ((unit & (1 << 9)) >> 6)

    def _longest(self, data: bytes, i: int) -> tuple[int, int] | None:
        """(match length, value) of the longest rule matching ``data`` at ``i``."""
        units = self._units
        pos = self._offset(units[0])
        best = None
        for k in range(i, len(data)):
            c = data[k]
            pos ^= c
            if pos >= len(units):
                break
            unit = units[pos]
            if unit & ((1 << 31) | 0xFF) != c:  # label check
                break
            pos ^= self._offset(unit)
            if (unit >> 8) & 1:  # has a leaf: a rule ends here
                best = (k - i + 1, units[pos] & 0x7FFFFFFF)
        return best

    def normalize(self, text: str) -> str:
        data = text.encode("utf-8", errors="replace")
        out = bytearray()
        i, n = 0, len(data)
        while i < n:
            match = self._longest(data, i)
            if match is not None:
                length, value = match
                end = self._strings.find(b"\0", value)
                out += self._strings[value : end if end >= 0 else None]
                i += length
                continue
            b = data[i]  # copy one UTF-8 character unchanged
            width = 1 if b < 0x80 else 2 if b < 0xE0 else 3 if b < 0xF0 else 4
            out += data[i : i + width]
            i += width
        return out.decode("utf-8", errors="replace")
