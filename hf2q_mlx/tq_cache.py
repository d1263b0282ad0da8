"""TurboQuant KV caches: the growing and ring caches of ``cache.py`` holding packed codes.

Each K/V head vector is stored as one packed row (``turboquant.TQCodec``: bit-packed Lloyd-Max
codes of the rotated vector, then its norm), so the slot arithmetic, growth, masks and ``trim`` of
``KVCache`` / ``RotatingKVCache`` apply unchanged to the packed buffers. ``update_and_fetch``
returns dequantized keys/values (lazy: a decode step that goes to the flash-decode kernel never
computes them) and ``packed_state()`` hands the packed buffers to that kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .cache import KVCache, RotatingKVCache
from .custom_kernels.tq_quantize import tq_quantize
from .errors import Hf2qError
from .turboquant import SUPPORTED_BITS, TQCodec

# the flash-decode kernel covers up to this many query rows per sequence (decode, short drafts)
MAX_FLASH_QUERIES = 8
# window of a full-attention layer in the kernels' position test (larger than any context)
FULL_WINDOW = 1 << 30


@dataclass
class TQState:
    """Packed cache contents for the flash-decode kernel.

    ``keys`` (B, Hkv, C, k_codec.row_words) and ``values`` (B, Hkv, C, v_codec.row_words) are
    uint32 packed rows; slot s holds position ``(offset-1) - ((offset-1-s) % capacity)`` (negative
    = empty), which covers the ring (capacity = window + reserve) and the growing cache (slot =
    position, capacity = buffer length). Only slots ``< min(offset, capacity)`` are read.
    """

    keys: mx.array
    values: mx.array
    k_codec: TQCodec
    v_codec: TQCodec
    offset: int
    capacity: int
    window: int

    @property
    def n_slots(self) -> int:
        return min(self.offset, self.capacity)

    def slot_positions(self) -> mx.array:
        o, s = self.offset, mx.arange(self.capacity)
        return (o - 1) - ((o - 1 - s) % self.capacity)


@dataclass
class TQPacked:
    """Stands for the keys and values ``update_and_fetch`` did not dequantize: ``attend`` runs
    the flash-decode kernel on ``state`` (also when a KV-sharing layer passes it on)."""

    state: TQState


class _TQMixin:
    """Quantize on write, dequantize on fetch; codecs are built at the first write (head dims).

    Once ``attend`` has seen the cache (``flash_attend``), a step it will send to the flash-decode
    kernel skips the dequantized views and the mask entirely: update_and_fetch then returns
    ``(TQPacked, TQPacked, None)``, which saves building ~50 unused graph nodes per layer.
    """

    def _init_tq(self, k_bits: int, v_bits: int, seed: int) -> None:
        for bits in (k_bits, v_bits):
            if bits not in SUPPORTED_BITS:
                raise Hf2qError(f"TurboQuant supports {SUPPORTED_BITS} bits, not {bits}")
        self.k_bits, self.v_bits, self.seed = k_bits, v_bits, seed
        self.k_codec: TQCodec | None = None
        self.v_codec: TQCodec | None = None
        self.flash_attend = False

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """keys (B, H, L, Dk), values (B, H, L, Dv) -> dequantized (keys, values, mask)."""
        if self.k_codec is None:
            # K and V share a seed: one rotation per layer (and per head dim)
            self.k_codec = TQCodec(keys.shape[-1], self.k_bits, self.seed)
            self.v_codec = TQCodec(values.shape[-1], self.v_bits, self.seed)
        pk = tq_quantize(keys, self.k_codec)
        pv = tq_quantize(values, self.v_codec)
        L = keys.shape[2]
        if self.flash_attend and self.keys is not None and L <= MAX_FLASH_QUERIES:
            if self._write_only(pk, pv):
                packed = TQPacked(self.packed_state())
                return packed, packed, None
        rows_k, rows_v, mask = super().update_and_fetch(pk, pv)
        k = self.k_codec.dequantize(rows_k, keys.dtype)
        v = self.v_codec.dequantize(rows_v, values.dtype)
        return k, v, mask

    def packed_state(self) -> TQState:
        if self.keys is None:
            raise Hf2qError("packed_state() of an empty TurboQuant cache")
        window = getattr(self, "window", None) or FULL_WINDOW
        return TQState(
            self.keys, self.values, self.k_codec, self.v_codec, self.offset,
            self.keys.shape[2], window,
        )  # fmt: skip

    def can_flash(self, n_queries: int) -> bool:
        """Whether the packed buffers hold every key the last ``n_queries`` writes attend to."""
        if self.keys is None or n_queries > MAX_FLASH_QUERIES:
            return False
        window = getattr(self, "window", None)
        # a ring keeps the first query's window only while n_queries <= reserve + 1
        return window is None or n_queries <= self.capacity - window + 1


class TQKVCache(_TQMixin, KVCache):
    """Growing full-attention cache of TurboQuant rows (see ``KVCache``)."""

    def __init__(self, k_bits: int, v_bits: int, seed: int = 0, max_size: int | None = None):
        KVCache.__init__(self, max_size)
        self._init_tq(k_bits, v_bits, seed)

    def _write_only(self, pk: mx.array, pv: mx.array) -> bool:
        """KVCache.update_and_fetch without building the fetched views or the mask."""
        L, prev = pk.shape[2], self.offset
        if self.max_size is not None and prev + L > self.max_size:
            return False  # the regular path raises the error
        if prev + L > self.keys.shape[2]:
            self._grow(pk, pv, prev + L)
        self.keys[..., prev : prev + L, :] = pk
        self.values[..., prev : prev + L, :] = pv
        self.offset = prev + L
        return True


class TQRotatingKVCache(_TQMixin, RotatingKVCache):
    """Sliding-window ring of TurboQuant rows, ``window + reserve`` slots (``RotatingKVCache``)."""

    def __init__(self, window: int, k_bits: int, v_bits: int, seed: int = 0, reserve: int = 0):
        RotatingKVCache.__init__(self, window, reserve)
        self._init_tq(k_bits, v_bits, seed)

    def _write_only(self, pk: mx.array, pv: mx.array) -> bool:
        """RotatingKVCache.update_and_fetch without the history views or the mask."""
        L = pk.shape[2]
        if not self.can_flash(L):
            return False
        self._write(self.keys, pk, self.offset)
        self._write(self.values, pv, self.offset)
        self.offset += L
        return True


def to_tq_cache(cache: list, k_bits: int, v_bits: int | None = None, seed: int = 0) -> list:
    """Replace each empty ``KVCache`` / ``RotatingKVCache`` by its TurboQuant version.

    Other layer caches (recurrent states) pass through. Layer i gets rotation seed ``seed + i``.
    """
    v_bits = k_bits if v_bits is None else v_bits
    out = []
    for i, c in enumerate(cache):
        if isinstance(c, _TQMixin):
            out.append(c)
            continue
        if isinstance(c, (KVCache, RotatingKVCache)) and c.offset > 0:
            raise Hf2qError("convert a cache to TurboQuant before its first use")
        if isinstance(c, RotatingKVCache):
            reserve = c.capacity - c.window
            out.append(TQRotatingKVCache(c.window, k_bits, v_bits, seed + i, reserve))
        elif isinstance(c, KVCache):
            out.append(TQKVCache(k_bits, v_bits, seed + i, c.max_size))
        else:
            out.append(c)
    return out


def make_tq_cache(
    model, k_bits: int, v_bits: int | None = None, reserve: int = 0, seed: int = 0
) -> list:
    """The model's ``make_cache(reserve)`` with every attention cache in TurboQuant form.

    ``k_bits`` / ``v_bits`` in (2, 3, 4, 5, 6, 8); ``v_bits`` defaults to ``k_bits``.
    """
    if hasattr(model, "make_cache"):
        cache = model.make_cache(reserve=reserve)
    else:
        cache = [KVCache() for _ in model.layers]
    return to_tq_cache(cache, k_bits, v_bits, seed)
