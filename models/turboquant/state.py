"""What a TurboQuant cache hands its kernels: the packed buffers and codecs (``TQState``) and the
exact transforms between the model's K/V and what the codec stores (``TQBalance``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from hf2q_mlx.custom_kernels.decode_attention import ring_slot_positions
from hf2q_mlx.custom_kernels.tq_quantize import stored_vectors
from hf2q_mlx.models.turboquant.codec import TQCodec


@dataclass
class TQBalance:
    """Exact transforms between the model's K/V and what the codec stores.

    The cache stores ``(k - k_mean) / k_scale`` and ``v / v_scale`` (each (Hkv, D) fp32, or
    (B, Hkv, D) with one per batch row in a static cache; None = skipped); attention uses
    ``q * k_scale`` and multiplies its output by ``v_scale``. The key offset needs nothing at
    attention time: it moves every score of a query by the same
    ``q . k_mean``, which the softmax cancels (the dequantized keys add it back). Scores and
    outputs are unchanged in exact arithmetic; only the codec's error is smaller or spread more
    favourably (``key_mean``, ``key_balance``, ``value_balance`` in ``codec.py``). Both
    sides of attention run in fp32 then: scaled queries and the scaled output are not rounded to
    the model's dtype.
    """

    k_scale: mx.array | None = None
    v_scale: mx.array | None = None
    k_mean: mx.array | None = None
    _derived: dict = field(default_factory=dict, repr=False)

    def set(self, **scales: mx.array) -> None:
        """Set ``k_scale`` / ``v_scale`` / ``k_mean`` (drops the shapes derived from the old)."""
        for name, a in scales.items():
            setattr(self, name, a)
        self._derived.clear()

    def _col(self, name: str) -> mx.array:
        """(..., Hkv, D) scale or offset as (..., Hkv, 1, D); built once, reused every step."""
        if name not in self._derived:
            self._derived[name] = getattr(self, name)[..., None, :]
        return self._derived[name]

    def keys_in(self, k: mx.array) -> mx.array:
        """What the codec stores for keys (B, Hkv, L, D): the transform the quantize kernel and
        its reference apply (``stored_vectors``)."""
        return stored_vectors(k, self.k_scale, self.k_mean)

    def keys_out(self, k: mx.array) -> mx.array:
        if self.k_scale is not None:
            k = k * self._col("k_scale")
        return k if self.k_mean is None else k + self._col("k_mean")

    def values_in(self, v: mx.array) -> mx.array:
        return stored_vectors(v, self.v_scale, None)

    def values_out(self, v: mx.array) -> mx.array:
        return v if self.v_scale is None else v * self._col("v_scale")

    def _rep(self, name: str, hq: int) -> mx.array:
        """The (..., Hkv, D) scale repeated for each query head of its group, (..., Hq, 1, D),
        kept."""
        key = (name, hq)
        if key not in self._derived:
            a = getattr(self, name)
            self._derived[key] = mx.repeat(a, hq // a.shape[-2], axis=-2)[..., None, :]
        return self._derived[key]

    def queries_in(self, q: mx.array) -> mx.array:
        """q (B, Hq, M, D) -> q * k_scale of each query head's KV head (fp32 if scaled)."""
        return q if self.k_scale is None else q * self._rep("k_scale", q.shape[1])

    def output_out(self, o: mx.array) -> mx.array:
        """Attention output over stored values (B, Hq, M, Dv) -> over the model's values."""
        return o if self.v_scale is None else o * self._rep("v_scale", o.shape[1])


@dataclass
class TQState:
    """Packed cache contents for the flash-decode kernel.

    ``keys`` (B, Hkv, C, k_codec.row_words) and ``values`` (B, Hkv, C, v_codec.row_words) are
    uint32 packed rows; slot s holds position ``(offset-1) - ((offset-1-s) % capacity)`` (negative
    = empty), which covers the ring (capacity = window + reserve) and the growing cache (slot =
    position, capacity = buffer length). Only slots ``< min(offset, capacity)`` are read.

    A static cache's rows (``models/static_cache.py``): ``offset`` (B,) int32 on the device, one
    per row, to which ``offset_add`` is added (the step's positions before the call and the
    call's token count: the kernel adds it, so a recorded graph reads the step's own position
    input), and ``span`` the slots the references read (the kernels read each row's own).
    """

    keys: mx.array
    values: mx.array
    k_codec: TQCodec
    v_codec: TQCodec
    offset: int
    capacity: int
    window: int
    balance: TQBalance = field(default_factory=TQBalance)
    span: int | None = None
    offset_add: int = 0

    @property
    def rows(self) -> bool:
        return isinstance(self.offset, mx.array)

    def ends(self) -> mx.array | int:
        """Tokens held: the offset, or (B,) per row for a static cache's rows."""
        return self.offset + self.offset_add

    @property
    def n_slots(self) -> int:
        if self.rows:
            return self.capacity if self.span is None else self.span
        return min(self.ends(), self.capacity)

    def slot_positions(self) -> mx.array:
        """(n_slots,), or (B, n_slots) for a static cache's rows."""
        if self.rows:
            return ring_slot_positions(self.ends()[:, None], self.capacity, self.n_slots)
        return ring_slot_positions(self.ends(), self.capacity)
