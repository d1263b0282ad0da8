"""TurboQuant KV caches: the growing and ring caches of ``cache.py`` holding packed codes, and
their attention call.

Each K/V head vector is stored as one packed row (``codec.TQCodec``: bit-packed Lloyd-Max codes
of the rotated vector, then its norm), so the slot arithmetic, growth, masks and ``trim`` of
``KVCache`` / ``RotatingKVCache`` apply unchanged to the packed buffers. ``update_and_fetch``
returns dequantized keys/values, or for a step the flash-decode kernel covers ``TQPacked``
placeholders (nothing dequantized is built); ``attend`` runs that kernel on the packed buffers
(``packed_state()``), or plain attention on the dequantized ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from hf2q_mlx.custom_kernels.tq_flash_decode import MAX_FLASH_QUERIES
from hf2q_mlx.errors import Hf2qError
from hf2q_mlx.models.cache import KVCache, RotatingKVCache
from hf2q_mlx.models.contract import architecture_of
from hf2q_mlx.models.sdpa import sdpa
from hf2q_mlx.models.turboquant.codec import (
    CENTER_CONTEXT,
    SUPPORTED_BITS,
    TQCodec,
    key_balance,
    key_mean,
    value_balance,
)
from hf2q_mlx.models.turboquant.kernels import tq_flash_decode, tq_quantize
from hf2q_mlx.models.turboquant.state import TQBalance, TQState

# window of a full-attention layer in the kernels' position test (larger than any context)
FULL_WINDOW = 1 << 30


@dataclass
class TQPacked:
    """Stands for the keys and values ``update_and_fetch`` did not dequantize (a step the
    flash-decode kernel covers): ``attend`` runs that kernel on ``state``, also in a layer that
    shares another layer's K/V and has no cache of its own."""

    state: TQState

    def attend(self, queries: mx.array, scale: float) -> mx.array:
        return tq_flash_decode(queries, self.state, scale)


class _TQMixin:
    """Quantize on write, dequantize on fetch; codecs are built at the first write (head dims).

    A write of at most ``MAX_FLASH_QUERIES`` tokens after the first, whose queries the packed
    buffers serve (``can_flash``), skips the dequantized views and the mask entirely:
    update_and_fetch returns ``(TQPacked, TQPacked, None)`` and ``attend`` runs the flash-decode
    kernel, which saves building ~50 unused graph nodes per layer. The choice depends on the
    write alone, never on earlier calls.

    With ``balance`` (the default) the first write calibrates the layer's ``TQBalance``: value
    scales from its values, key scales (and with ``center`` the key offset) from its keys and
    the queries ``attend`` passes to ``calibrate`` right after, which re-quantizes that first
    write (a model that never calls ``attend`` keeps raw keys). Later writes reuse the
    calibration. ``center``: the context in positions the key offset is chosen for (True =
    ``CENTER_CONTEXT``, False or 0 = no offset); ``rope_freqs``: the layer's RoPE radians per
    position for each rotated pair, which tells the offset which pairs stay put (``key_mean``).
    """

    def _init_tq(
        self,
        k_bits: int,
        v_bits: int,
        seed: int,
        balance: bool,
        rope_dims: int | None,
        center: bool | int = True,
        rope_freqs: mx.array | None = None,
    ) -> None:
        for bits in (k_bits, v_bits):
            if bits not in SUPPORTED_BITS:
                raise Hf2qError(f"TurboQuant supports {SUPPORTED_BITS} bits, not {bits}")
        self.k_bits, self.v_bits, self.seed = k_bits, v_bits, seed
        self.k_codec: TQCodec | None = None
        self.v_codec: TQCodec | None = None
        self.balance, self.rope_dims, self.rope_freqs = balance, rope_dims, rope_freqs
        self.center = 0 if not balance else CENTER_CONTEXT if center is True else int(center)
        self.tq_balance = TQBalance()
        self._first: tuple[mx.array, mx.array] | None = None  # raw first write, until calibrate

    @property
    def needs_calibration(self) -> bool:
        """Whether the first write waits for ``calibrate(queries)`` (``attend`` calls it)."""
        return self._first is not None

    def calibrate(self, queries: mx.array):
        """Key scales (and offset) from the first write's keys and these queries; re-writes that
        first write with them and returns what its ``update_and_fetch`` would have: (keys,
        values, mask)."""
        keys, values = self._first
        self._first = None
        self.tq_balance.set(k_scale=key_balance(keys, queries, self.rope_dims))
        if self.center:  # None where no channel keeps its mean (no RoPE pair turns slowly)
            mean = key_mean(keys, self.rope_dims, self.rope_freqs, self.center)
            self.tq_balance.set(k_mean=mean)
        self.keys = self.values = None
        self.offset = 0
        return self.update_and_fetch(keys, values)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """keys (B, H, L, Dk), values (B, H, L, Dv) -> dequantized (keys, values, mask)."""
        if self.k_codec is None:
            # K and V share a seed: one rotation per layer (and per head dim)
            self.k_codec = TQCodec(keys.shape[-1], self.k_bits, self.seed)
            self.v_codec = TQCodec(values.shape[-1], self.v_bits, self.seed)
            if self.balance:
                self.tq_balance.set(v_scale=value_balance(values))
                self._first = (keys, values)
        elif self._first is not None:
            self._first = None  # no calibrate() after the first write: keys stay unscaled
        bal = self.tq_balance
        # the balance transform runs inside the quantize kernel (one launch each for K and V)
        pk = tq_quantize(keys, self.k_codec, bal.k_scale, bal.k_mean)
        pv = tq_quantize(values, self.v_codec, bal.v_scale)
        L = keys.shape[2]
        if self.keys is not None and L <= MAX_FLASH_QUERIES and self.tree is None:
            if self._write_only(pk, pv):
                packed = TQPacked(self.packed_state())
                return packed, packed, None
        rows_k, rows_v, mask = super().update_and_fetch(pk, pv)
        k = bal.keys_out(self.k_codec.dequantize(rows_k)).astype(keys.dtype)
        v = bal.values_out(self.v_codec.dequantize(rows_v)).astype(values.dtype)
        return k, v, mask

    def packed_state(self) -> TQState:
        if self.keys is None:
            raise Hf2qError("packed_state() of an empty TurboQuant cache")
        window = getattr(self, "window", None) or FULL_WINDOW
        return TQState(
            self.keys, self.values, self.k_codec, self.v_codec, self.offset,
            self.keys.shape[2], window, self.tq_balance,
        )  # fmt: skip

    def attend(
        self, queries: mx.array, keys, values, scale: float, mask: mx.array | None
    ) -> mx.array:
        """queries (B, Hq, L, Dk) over what ``update_and_fetch`` returned -> (B, Hq, L, Dv).

        ``TQPacked`` keys: the flash-decode kernel on their state. Right after the first write,
        that write is calibrated with these queries (``calibrate``); a first write of at most
        ``MAX_FLASH_QUERIES`` tokens then goes to the kernel too. Everything else: plain
        attention over the dequantized keys/values and ``mask`` (the kernel rebuilds exactly
        that causal + window mask from slot positions, so a mask of another kind must not be
        combined with a TurboQuant cache).
        """
        if isinstance(keys, TQPacked):
            return keys.attend(queries, scale)
        if self.needs_calibration:
            # the first write: key scales need these queries, so it is re-quantized with them
            keys, values, mask = self.calibrate(queries)
        if self.can_flash(queries.shape[2]):
            return tq_flash_decode(queries, self.packed_state(), scale)
        return sdpa(queries, keys, values, scale, mask)

    def can_flash(self, n_queries: int) -> bool:
        """Whether the packed buffers hold every key the last ``n_queries`` writes attend to."""
        if self.keys is None or n_queries > MAX_FLASH_QUERIES or self.tree is not None:
            return False  # the kernel builds causal masks only, not a token tree's
        window = getattr(self, "window", None)
        # a ring keeps the first query's window only while n_queries <= reserve + 1
        return window is None or n_queries <= self.capacity - window + 1


class TQKVCache(_TQMixin, KVCache):
    """Growing full-attention cache of TurboQuant rows (see ``KVCache``)."""

    def __init__(
        self,
        k_bits: int,
        v_bits: int,
        seed: int = 0,
        max_size: int | None = None,
        balance: bool = True,
        rope_dims: int | None = None,
        center: bool | int = True,
        rope_freqs: mx.array | None = None,
    ):
        KVCache.__init__(self, max_size)
        self._init_tq(k_bits, v_bits, seed, balance, rope_dims, center, rope_freqs)

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

    def __init__(
        self,
        window: int,
        k_bits: int,
        v_bits: int,
        seed: int = 0,
        reserve: int = 0,
        balance: bool = True,
        rope_dims: int | None = None,
        center: bool | int = True,
        rope_freqs: mx.array | None = None,
    ):
        RotatingKVCache.__init__(self, window, reserve)
        self._init_tq(k_bits, v_bits, seed, balance, rope_dims, center, rope_freqs)

    def _write_only(self, pk: mx.array, pv: mx.array) -> bool:
        """RotatingKVCache.update_and_fetch without the history views or the mask."""
        L = pk.shape[2]
        if not self.can_flash(L):
            return False
        self._write(self.keys, pk, self.offset)
        self._write(self.values, pv, self.offset)
        self.offset += L
        return True


def to_tq_cache(
    cache: list,
    k_bits: int,
    v_bits: int | None = None,
    seed: int = 0,
    balance: bool = True,
    rope_dims: list | None = None,
    center: bool | int = True,
    layer_bits: list | None = None,
    rope_freqs: list | None = None,
) -> list:
    """Replace each empty ``KVCache`` / ``RotatingKVCache`` by its TurboQuant version.

    Other layer caches (recurrent states) pass through. Layer i gets rotation seed ``seed + i``,
    ``rope_dims[i]`` (rotated channels of its head dim, None = all) and ``rope_freqs[i]`` (see
    ``key_mean``) for its ``TQBalance``, and ``layer_bits[i]`` = (k_bits, v_bits) where given
    (None entries and layers past the list's end take ``k_bits`` / ``v_bits``). ``center``: the
    key offset's context (see ``_TQMixin``).
    """
    v_bits = k_bits if v_bits is None else v_bits
    out = []
    for i, c in enumerate(cache):
        if isinstance(c, _TQMixin):
            out.append(c)
            continue
        if isinstance(c, (KVCache, RotatingKVCache)) and c.offset > 0:
            raise Hf2qError("convert a cache to TurboQuant before its first use")
        rd = rope_dims[i] if rope_dims is not None else None
        own = layer_bits[i] if layer_bits is not None and i < len(layer_bits) else None
        kb, vb = own if own is not None else (k_bits, v_bits)
        rf = rope_freqs[i] if rope_freqs is not None else None
        opts = dict(balance=balance, rope_dims=rd, center=center, rope_freqs=rf)
        if isinstance(c, RotatingKVCache):
            reserve = c.capacity - c.window
            out.append(TQRotatingKVCache(c.window, kb, vb, seed + i, reserve, **opts))
        elif isinstance(c, KVCache):
            out.append(TQKVCache(kb, vb, seed + i, c.max_size, **opts))
        else:
            out.append(c)
    return out


def _model_rope(model) -> list:
    """Per layer: the ``LayerRoPE`` its architecture's contract describes, or None."""
    arch = architecture_of(model)
    layers = getattr(model, "layers", None) or []
    if arch is None or arch.rope is None or not hasattr(model, "args"):
        return [None] * len(layers)
    return arch.rope(model.args)


def model_rope_dims(model) -> list:
    """Per layer: the rotated channels of its head (partial RoPE), None = all or no RoPE."""
    return [r.dims if r is not None else None for r in _model_rope(model)]


def model_rope_freqs(model) -> list:
    """Per layer: RoPE radians per position of each rotated pair (the position scale applied),
    None where the architecture describes none (the key offset then keeps only unrotated
    channels)."""
    return [r.freqs if r is not None else None for r in _model_rope(model)]


def make_tq_cache(
    model,
    k_bits: int,
    v_bits: int | None = None,
    reserve: int = 0,
    seed: int = 0,
    balance: bool = True,
    center: bool | int = True,
    layer_bits: list | None = None,
) -> list:
    """The model's ``make_cache(reserve)`` with every attention cache in TurboQuant form.

    ``k_bits`` / ``v_bits`` in (2, 3, 4, 5, 6, 8); ``v_bits`` defaults to ``k_bits``;
    ``layer_bits``: per-layer (k_bits, v_bits) overrides (see ``to_tq_cache``); ``balance``
    calibrates per-channel scales at the first write and ``center`` (with ``balance``) a key
    offset for contexts up to ``center`` positions (True = ``CENTER_CONTEXT``; ``TQBalance``).
    """
    if hasattr(model, "make_cache"):
        cache = model.make_cache(reserve=reserve)
    else:
        cache = [KVCache() for _ in model.layers]
    dims = model_rope_dims(model)
    freqs = model_rope_freqs(model)
    dims, freqs = (dims, freqs) if len(dims) == len(cache) else (None, None)
    return to_tq_cache(cache, k_bits, v_bits, seed, balance, dims, center, layer_bits, freqs)
