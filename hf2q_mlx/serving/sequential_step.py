"""DecodeStep's interface over the per-sequence caches: every row runs alone, one after another.

The fallback for caches the compiled ``hf2q_mlx.decode_step.DecodeStep`` has no static form for
(TurboQuant). Each row is the model's own cache list, so a row's logits are exactly those of
``stream_generate`` on the same tokens; only the speed of a batch is lost.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from hf2q_mlx.custom_kernels import cuda_cache
from hf2q_mlx.decode_step import RowSlots
from hf2q_mlx.errors import ContextLengthError, InvalidArgumentError
from hf2q_mlx.generation import cache_arrays, make_prompt_cache
from hf2q_mlx.models.cache import KVCache


class SavedRow:
    """A deep copy of one row's caches and its position (the arrays are new objects, so later
    in-place cache writes never reach it)."""

    def __init__(self, position: int, caches: list) -> None:
        self.position = position
        self.caches = caches

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in cache_arrays(self.caches))


class SequentialStep(RowSlots):
    """``max_batch`` rows of per-sequence caches; ``decode`` runs the active rows one by one."""

    def __init__(self, model: Any, max_batch: int, max_len: int, kv_bits: Any = None) -> None:
        if max_batch < 1 or max_len < 1:
            raise InvalidArgumentError(
                f"max_batch and max_len must be >= 1, got {max_batch}, {max_len}"
            )
        self.model, self.max_batch, self.max_len, self.kv_bits = model, max_batch, max_len, kv_bits
        self.caches = [make_prompt_cache(model, kv_bits) for _ in range(max_batch)]
        self.positions = [0] * max_batch
        # built in the caller's thread: nothing lazy may reach the engine thread
        mx.eval(cache_arrays(self.caches))

    @staticmethod
    def supports(model: Any, kv_bits: Any = None) -> bool:
        return True

    def _layers(self) -> list:
        return self.caches[0]

    def reset_row(self, row: int) -> None:
        self._check_row(row)
        self.caches[row] = make_prompt_cache(self.model, self.kv_bits)
        self.positions[row] = 0

    def prefill(self, row: int, ids: Sequence[int]) -> mx.array:
        """Feed ``ids`` to ``row`` after what it holds -> lazy logits (V,) of the last token.
        Nothing is evaluated: the engine evaluates every row's caches after a step's chunks
        (not the logits, so the head over a chunk is never computed)."""
        self._check_prefill(row, len(ids))
        logits = self.model(mx.array([list(ids)], dtype=mx.int32), cache=self.caches[row])
        self.positions[row] += len(ids)
        return logits[0, -1]

    def decode(self, tokens: mx.array, active: Sequence[bool] | mx.array) -> mx.array:
        """One token per active row (``tokens`` (B,) int32) -> lazy logits (B, V); inactive rows
        are not advanced and their logits are zeros."""
        active = [bool(a) for a in (active.tolist() if isinstance(active, mx.array) else active)]
        B = self.max_batch
        if tokens.shape != (B,) or len(active) != B:
            raise InvalidArgumentError(f"decode needs {B} tokens and {B} active flags")
        rows: list[mx.array | None] = []
        for row, on in enumerate(active):
            if not on:
                rows.append(None)
                continue
            if self.positions[row] + 1 > self.max_len:
                raise ContextLengthError(f"row {row} would pass max_len {self.max_len}")
            with cuda_cache.per_token():
                out = self.model(tokens[row : row + 1][None], cache=self.caches[row])
            rows.append(out[0, -1])
            self.positions[row] += 1
        live = [r for r in rows if r is not None]
        if not live:
            vocab = self.model.args.vocab_size
            return mx.zeros((B, vocab), mx.float32)
        zero = mx.zeros_like(live[0])
        return mx.stack([zero if r is None else r for r in rows])  # (B, V)

    def save_row(self, row: int) -> SavedRow:
        self._check_row(row)
        saved = copy.deepcopy(self.caches[row])
        for c in saved:
            # a growing buffer keeps only its filled slots; the next write grows it again
            if type(c) is KVCache and c.keys is not None:
                c.keys = mx.contiguous(c.keys[..., : c.offset, :])
                c.values = mx.contiguous(c.values[..., : c.offset, :])
        mx.eval(cache_arrays(saved))
        return SavedRow(self.positions[row], saved)

    def load_row(self, row: int, saved: SavedRow, length: int | None = None) -> None:
        """Row ``row`` takes a saved row's caches, or their first ``length`` tokens (from
        ``resume_floor(saved.position)`` up)."""
        self._check_row(row)
        if saved.position > self.max_len:
            raise ContextLengthError(f"{saved.position} saved tokens exceed max_len {self.max_len}")
        n = self._check_length(saved.position, length)
        caches = copy.deepcopy(saved.caches)
        if n < saved.position:
            for c in {id(c): c for c in caches}.values():  # a cache object listed twice trims once
                c.trim(saved.position - n)
        self.caches[row] = caches
        self.positions[row] = n
