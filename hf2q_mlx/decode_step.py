"""The decode step built once: B rows, each at its own position, one compiled graph per token.

``DecodeStep(model, max_batch, max_len)`` preallocates every layer's cache for ``max_batch`` rows
(``models/static_cache.py``) and compiles ``model(tokens, caches)`` once per attention-span bucket
(full-attention layers read the first 256, 512, 1024, ... slots, whichever covers the longest
row). Per token the host says which rows advance and gets lazy logits (or greedy token ids) back;
it never reads a value from the device in between. The rows' positions stay on the device from
step to step (each step returns the next ones); the host uploads them only after changing them
itself (a prefill, a reset, a rollback).

``kv_bits`` (8, or (8, 4) for K8/V4) keeps the attention caches in TurboQuant form
(``StaticTQCache``): each row quantized with its own balance, calibrated on its own prompt.

Prompts go in through ``prefill(row, ids)``: the model's ordinary per-sequence caches, viewing the
row's slots, run the chunk eagerly and are copied back. ``save_row`` / ``load_row`` move a row's
whole state (prefix reuse), ``adopt`` takes over caches that ``stream_generate`` prefilled.

Speculative decoding: ``verify(tokens (B, L))`` feeds L tokens per row in one compiled call
(one trace per L), ``rollback(row, n)`` then forgets the last n of them exactly (KV positions move
back; recurrent layers take the state kept for that token). It needs ``reserve >= L - 1``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx

from hf2q_mlx.custom_kernels import (
    MIN_DEVICE_BYTES,
    cuda_cache,
    device_array,
    launch_recorder,
    sampling,
)
from hf2q_mlx.errors import ContextLengthError, InvalidArgumentError
from hf2q_mlx.models import kernel_linears
from hf2q_mlx.models.cache import KVCache, RotatingKVCache, ring_resume_floor
from hf2q_mlx.models.packed_rows import PackedRows, segment_positions
from hf2q_mlx.models.recurrent_cache import RecurrentCache
from hf2q_mlx.models.static_cache import StaticKVCache, StaticRecurrentCache, StaticTQCache
from hf2q_mlx.models.turboquant.cache import TQKVCache, TQRotatingKVCache, make_tq_cache

MIN_SPAN = 256


@dataclass
class RowState:
    """One row's cache contents: ``position`` tokens; per layer the arrays of that row."""

    position: int
    arrays: list[list[mx.array]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for layer in self.arrays for a in layer)


def _model_caches(model, kv_bits: tuple[int, int] | None = None) -> list:
    if kv_bits is not None:
        return make_tq_cache(model, *kv_bits)
    if hasattr(model, "make_cache"):
        return model.make_cache()
    return [KVCache() for _ in model.layers]


def _kv_pair(kv_bits) -> tuple[int, int] | None:
    """None, 8 or (8, 4) -> None or (k bits, v bits) (the widths checked by the TurboQuant
    caches). Not ``generation.parse_kv_bits``, which also takes "8,4" text: generation sits
    above this module (tests/test_layering.py), and its callers hand the parsed pair here."""
    if kv_bits is None:
        return None
    pair = (kv_bits, kv_bits) if isinstance(kv_bits, int) else tuple(kv_bits)
    if len(pair) != 2 or not all(isinstance(b, int) for b in pair):
        raise InvalidArgumentError(f"kv_bits must be an int or a (k, v) pair, got {kv_bits!r}")
    return pair


class RowSlots:
    """What every step over ``max_batch`` rows shares (DecodeStep here, the serving fallback
    ``SequentialStep``): the rows' positions and the row and prefill checks."""

    max_batch: int
    max_len: int
    positions: list[int]

    def _check_row(self, row: int) -> None:
        if not (isinstance(row, int) and 0 <= row < self.max_batch):
            raise InvalidArgumentError(f"row must be in [0, {self.max_batch}), got {row!r}")

    def _check_prefill(self, row: int, n: int) -> None:
        """A valid row, at least one token, and room for ``n`` more."""
        self._check_row(row)
        if n == 0:
            raise InvalidArgumentError("prefill needs at least one token")
        if self.positions[row] + n > self.max_len:
            raise ContextLengthError(
                f"row {row}: {self.positions[row]} + {n} tokens pass max_len {self.max_len}"
            )

    def position(self, row: int) -> int:
        self._check_row(row)
        return self.positions[row]

    def resume_floor(self, position: int) -> int:
        """The fewest tokens a row saved at ``position`` can be cut back to on load (``load_row``'s
        ``length``): any where every layer is full attention, ``position`` itself with a
        recurrent state (it cannot be unwound)."""
        layers = self._layers()
        return position if layers is None else resume_floor(layers, position)

    def _layers(self) -> list | None:
        """One cache per layer, as every row has them (their kinds and sizes); None: unknown,
        so a saved row is never cut back."""
        return None

    def _check_length(self, saved_position: int, length: int | None) -> int:
        """``length`` (None: all) of a row saved at ``saved_position``, checked."""
        if length is None:
            return saved_position
        floor = self.resume_floor(saved_position)
        if not (isinstance(length, int) and floor <= length <= saved_position):
            raise InvalidArgumentError(
                f"a row saved at {saved_position} tokens loads {floor}..{saved_position} of them, "
                f"got {length!r}"
            )
        return length


def resume_floor(caches: Sequence, position: int) -> int:
    """The fewest of ``position`` written tokens that caches (a step's static ones or one
    sequence's) can be cut back to: a full-attention layer any number, a ring only while every
    slot the window before the cut reads still holds its token (``ring_resume_floor``), a
    recurrent state none (``position``)."""
    floor = 0
    for c in caches:
        if not isinstance(c, (StaticKVCache, KVCache, RotatingKVCache)):
            return position  # a recurrent state (or a cache this rule does not know)
        if getattr(c, "window", None) is not None:
            floor = max(floor, ring_resume_floor(position, c.capacity, c.window))
    return floor


class DecodeStep(RowSlots):
    """A compiled one-token step over ``max_batch`` rows of at most ``max_len`` tokens each."""

    def __init__(
        self, model, max_batch: int = 1, max_len: int = 4096, reserve: int = 0, like=None,
        kv_bits=None,
    ):  # fmt: skip
        if max_batch < 1 or max_len < 1:
            raise InvalidArgumentError(
                f"DecodeStep needs max_batch >= 1 and max_len >= 1, got {max_batch}, {max_len}"
            )
        if not self.supports(model):
            raise InvalidArgumentError(
                f"{type(model).__module__}: its caches have no static form for DecodeStep"
            )
        if reserve < 0:
            raise InvalidArgumentError(f"DecodeStep reserve must be >= 0, got {reserve}")
        self.model, self.max_batch, self.max_len = model, max_batch, max_len
        # MLX float / affine linears and embeddings take our kernels on CUDA at decode sizes,
        # so a CUDA graph can hold them (models/kernel_linears.py)
        kernel_linears.use_kernels(model)
        self.kv_bits = _kv_pair(kv_bits)
        self.reserve = reserve  # tokens a verify may write past a row's end (L - 1)
        self.positions = [0] * max_batch
        self.caches = self._allocate(reserve, like)
        self.recurrent = any(isinstance(s, StaticRecurrentCache) for s in self.caches)
        self._compiled = mx.compile(self._step)
        self._compiled_rollback = mx.compile(self._rollback)
        # tokens each row's rollback may still forget (see rollback), and the last verify's
        # recurrent states per token
        self._verified = [0] * max_batch
        self._history: list = []
        self._traced: set[tuple[int, int, bool]] = set()  # (L, span, greedy) traced so far
        # writes a row of a cache array in place and returns that array, or returns None: the
        # CUDA graph step's, for the arrays it owns (else a row write makes a new array)
        self.row_writer: Callable | None = None
        # pipelined rounds (hf2q_mlx/pipelined_rounds.py): the positions the compiled step reads,
        # on the device, updated lazily by rollback_lazy; self.positions are then upper bounds
        self.lazy_positions: mx.array | None = None
        # the rows' positions and active flags as the step reads them: padded past MLX's CUDA
        # small pool (custom_kernels.MIN_DEVICE_BYTES), and kept on the device between steps
        # (each step returns the next positions), so a steady decode uploads nothing: the ops
        # that first read a host-written buffer took 12-24 us each (docs/kernel_notes.md, s. 17)
        self._rows = max(max_batch, -(-MIN_DEVICE_BYTES // 4))  # on every back end: one code path
        self._device_pos: tuple[tuple[int, ...], mx.array] | None = None
        self._device_active: tuple[tuple[bool, ...], mx.array] | None = None
        self.busy = False
        # what speculation learned about round times on this step, per (drafter, K), kept
        # for the step's next request (speculative.round_costs)
        self.round_costs: dict = {}

    @staticmethod
    def supports(model, kv_bits=None) -> bool:
        """True for our model files (they read positions through ``models.ops.positions``)
        when every cache the model makes has a static counterpart (TurboQuant ones included:
        ``kv_bits`` turns the attention caches into them)."""
        if not type(model).__module__.startswith("hf2q_mlx.models."):
            return False
        kinds = (KVCache, RotatingKVCache, RecurrentCache)
        return all(type(c) in kinds for c in _model_caches(model))

    # ---- cache allocation and row transfer -----------------------------------------------------

    def _allocate(self, reserve: int, like=None) -> list:
        """Shapes and dtypes from filled per-sequence caches ``like`` (else one probe token
        through fresh ones), then B rows."""
        # one eager token first in any case: layers that build a per-weight form lazily on their
        # first few-row call (the CPU's affine repack of GGML blocks) then hold it evaluated,
        # instead of rebuilding it inside every compiled call
        fresh = _model_caches(self.model, self.kv_bits)
        mx.eval(self.model(mx.array([[0]]), cache=fresh))
        probe = like
        if probe is None or any(getattr(c, "keys", 0) is None for c in probe):
            probe = fresh
        tq = (TQKVCache, TQRotatingKVCache)
        attention = [c for c in probe if not isinstance(c, RecurrentCache)]
        if any(isinstance(c, tq) != (self.kv_bits is not None) for c in attention):
            raise InvalidArgumentError("DecodeStep(like=...) caches must match its kv_bits")
        B, out = self.max_batch, []
        for c in probe:
            if isinstance(c, RecurrentCache):
                conv, st = c.conv_state, c.state
                out.append(
                    StaticRecurrentCache(
                        mx.zeros((B, *conv.shape[1:]), conv.dtype),
                        mx.zeros((B, *st.shape[1:]), st.dtype),
                    )
                )
                continue
            window = c.window if isinstance(c, RotatingKVCache) else None
            # ``reserve`` slots past the end: an idle row's L-token write stays in bounds, and a
            # ring keeps its whole window while L tokens are written
            C = (self.max_len if window is None else min(window, self.max_len)) + reserve
            _, H, _, Dk = c.keys.shape
            Dv = c.values.shape[-1]
            keys = mx.zeros((B, H, C, Dk), c.keys.dtype)
            values = mx.zeros((B, H, C, Dv), c.values.dtype)
            if isinstance(c, tq):  # packed rows; balance tables start as the identity
                dk, dv = c.k_codec.dim, c.v_codec.dim
                tables = [mx.ones((B, H, dk)), mx.ones((B, H, dv)), mx.zeros((B, H, dk))]
                out.append(StaticTQCache(keys, values, tables, c, window))
                continue
            out.append(StaticKVCache(keys, values, window))
        mx.eval([s.arrays for s in out])
        return out

    def _layers(self) -> list:
        return self.caches

    def reset_row(self, row: int) -> None:
        """The row becomes empty. KV slots need no clearing (masks come from positions);
        recurrent states start from zero."""
        self._check_row(row)
        self.positions[row], self._verified[row] = 0, 0
        self._set_lazy(row)
        for s in self.caches:
            if isinstance(s, StaticRecurrentCache):
                zeros = [mx.zeros(a.shape[1:], a.dtype) for a in s.arrays]
                s.arrays = [self._write_row(a, row, z) for a, z in zip(s.arrays, zeros)]

    def _row_views(self, row: int) -> list:
        """Per-sequence caches holding the row's state, for an eager forward pass."""
        pos, views = self.positions[row], []
        for s in self.caches:
            if isinstance(s, StaticRecurrentCache):
                c = RecurrentCache()
                if pos > 0:
                    c.conv_state, c.state = (a[row : row + 1] for a in s.arrays)
            elif isinstance(s, StaticTQCache):
                c = s.row_view(row, pos)
            elif s.window is None:
                c = KVCache(max_size=s.capacity)
                c.keys, c.values = (a[row : row + 1] for a in s.arrays)
            else:  # a ring shorter than the window never wraps: a plain buffer then
                C = s.capacity
                c = RotatingKVCache(s.window, C - s.window) if C >= s.window else KVCache(C)
                c.keys, c.values = (a[row : row + 1] for a in s.arrays)
            c.offset = pos
            views.append(c)
        return views

    def adopt(self, row: int, caches: Sequence) -> None:
        """Copy per-sequence caches (batch 1, the model's own kinds) into ``row``."""
        self._check_row(row)
        offsets = {c.offset for c in caches}
        if len(offsets) != 1 or len(caches) != len(self.caches):
            raise InvalidArgumentError("adopt() needs one consistent cache per layer")
        pos = offsets.pop()
        if pos > self.max_len:
            raise ContextLengthError(f"{pos} cached tokens exceed DecodeStep's {self.max_len}")
        for s, c in zip(self.caches, caches):
            if isinstance(s, StaticRecurrentCache):
                if c.state is not None:
                    s.arrays = [
                        self._write_row(a, row, n[0])
                        for a, n in zip(s.arrays, [c.conv_state, c.state])
                    ]
                continue
            if c.keys is None:
                continue
            tq = isinstance(c, (TQKVCache, TQRotatingKVCache))
            if tq != isinstance(s, StaticTQCache):
                raise InvalidArgumentError("adopt() needs caches of the step's kind (kv_bits)")
            row_tables = s.row_tables(c) if tq else []  # checks the codecs first
            slots = s.arrays[:2]
            if s.window is None:
                n = min(pos, c.keys.shape[2])
                slots = [
                    self._write_row(a, row, src[0, :, :n], n)
                    for a, src in zip(slots, [c.keys, c.values])
                ]
            else:
                slots = [
                    _adopt_ring(a, row, src[0], pos, self._write_row)
                    for a, src in zip(slots, [c.keys, c.values])
                ]
            # the row's balance, calibrated on its own prompt
            tables = [self._write_row(a, row, t) for a, t in zip(s.arrays[2:], row_tables)]
            s.arrays = slots + tables
        self.positions[row], self._verified[row] = pos, 0
        self._set_lazy(row)

    @property
    def packs_rows(self) -> bool:
        """Whether ``prefill_rows`` runs one forward pass for several rows: not with layers
        reading another layer's keys and values (Gemma 4 E-series)."""
        shared = getattr(getattr(self.model, "args", None), "kv_source", None) or []
        return all(s is None for s in shared)

    def prefill_rows(self, rows: Sequence[int], chunks: Sequence[Sequence[int]]) -> None:
        """Feed each row its chunk, the rows' tokens packed into one forward pass
        (``models/packed_rows.py``: one weight read for all of them); each row's caches end as
        ``prefill`` leaves them, its attention over its own tokens only. One ``prefill`` per row
        where the model cannot be packed (``packs_rows``). Lazy: nothing is evaluated."""
        if len(rows) != len(chunks) or len(set(rows)) != len(rows):
            raise InvalidArgumentError("prefill_rows needs distinct rows, one chunk each")
        for row, ids in zip(rows, chunks):
            self._check_prefill(row, len(ids))
        if len(rows) < 2 or not self.packs_rows:
            for row, ids in zip(rows, chunks):
                self.prefill(row, ids)
            return
        lengths = [len(ids) for ids in chunks]
        ends = list(itertools.accumulate(lengths))
        bounds = list(zip([0] + ends[:-1], ends))
        positions = segment_positions([self.positions[r] for r in rows], lengths)
        views = [self._row_views(row) for row in rows]  # per row: one cache per layer
        layers = [PackedRows(layer, bounds, positions) for layer in zip(*views)]
        tokens = mx.array([[t for ids in chunks for t in ids]], dtype=mx.int32)  # (1, T)
        self.model(tokens, cache=layers)  # the caches' writes; the logits stay unbuilt
        for row, v in zip(rows, views):
            self.adopt(row, v)

    def prefill(self, row: int, ids: Sequence[int]) -> mx.array:
        """Feed prompt tokens to ``row`` after what it holds -> logits (V,) of the last token."""
        self._check_prefill(row, len(ids))
        views = self._row_views(row)
        logits = self.model(mx.array([list(ids)], dtype=mx.int32), cache=views)
        self.adopt(row, views)
        return logits[0, -1]

    def _write_row(self, buf: mx.array, row: int, value: mx.array, n: int | None = None):
        """``_set_row``, or the row written in place where ``row_writer`` owns ``buf``."""
        out = None if self.row_writer is None else self.row_writer(buf, row, value, n)
        return _set_row(buf, row, value, n) if out is None else out

    def save_row(self, row: int) -> RowState:
        """A copy of the row's state (for prefix reuse); full-attention layers keep only the
        filled slots."""
        self._check_row(row)
        pos, arrays = self.positions[row], []
        for s in self.caches:
            # copies of their own (x * 1 is exact): a contiguous slice may share the cache's
            # buffer, which a CUDA graph step writes rows into in place
            arrays.append([
                a[row, :, :pos] * 1 if n is not None else a[row] * 1
                for a, n in zip(s.arrays, _slot_counts(s, pos))
            ])  # fmt: skip
        mx.eval(arrays)
        return RowState(pos, arrays)

    def load_row(self, row: int, saved: RowState, length: int | None = None) -> None:
        """Row ``row`` takes a saved row's state, or its first ``length`` tokens (from
        ``resume_floor(saved.position)`` up: a shared prompt prefix)."""
        self._check_row(row)
        n = self._check_length(saved.position, length)
        for s, arrs in zip(self.caches, saved.arrays):
            counts = _slot_counts(s, n)
            # full-attention arrays keep their first n slots; ring slots past n are masked
            # (a ring's mask comes from the row's position), the floor keeps the rest valid
            arrs = [v if c is None else v[:, :c] for v, c in zip(arrs, counts)]
            s.arrays = [self._write_row(a, row, v, c) for a, v, c in zip(s.arrays, arrs, counts)]
        self.positions[row], self._verified[row] = n, 0
        self._set_lazy(row)

    # ---- the compiled step ---------------------------------------------------------------------

    def _step(self, tokens, pos_rows, active_rows, arrays, span: int, greedy: bool):
        B, L = tokens.shape
        pos, active = pos_rows[:B], active_rows[:B]  # views of the padded buffers
        next_rows = pos_rows + L * active_rows[: pos_rows.shape[0]].astype(mx.int32)
        shared: dict = {}  # write slots, computed once per step for every layer
        for s, a in zip(self.caches, arrays):
            s.arrays, s.pos, s.active, s.shared = a, pos, active, shared
            if isinstance(s, StaticKVCache) and s.window is None:
                s.span = span
        with cuda_cache.per_token():  # MLX's kernel builds in the step (cuda_cache's docstring)
            logits = self.model(tokens, cache=self.caches)  # (B, L, V)
        if tokens.shape[1] == 1:
            logits = logits[:, -1, :]
        if greedy and launch_recorder.active():  # a CUDA graph step: argmax as our kernels
            launch_recorder.mark("logits", logits)
            out = sampling.topk(logits, 1)[1].reshape(logits.shape[:-1])  # uint32
        else:
            out = mx.argmax(logits, axis=-1).astype(mx.int32) if greedy else logits
        recurrent = [s for s in self.caches if isinstance(s, StaticRecurrentCache)]
        history = [s.history for s in recurrent] if tokens.shape[1] > 1 else []
        return out, [s.arrays for s in self.caches], history, next_rows

    def _padded(self, values: list, dtype: mx.Dtype) -> mx.array:
        """``values`` then zeros: at least ``rows`` elements and MIN_DEVICE_BYTES (the step's
        padded inputs: 4 int32 positions, 16 bool flags at B <= 4)."""
        n = max(self._rows, -(-MIN_DEVICE_BYTES // dtype.size))
        return mx.array(list(values) + [0] * (n - len(values)), dtype=dtype)

    def _run(self, tokens: mx.array, active: list[bool], greedy: bool) -> mx.array:
        """tokens (B, L) through the compiled step; rows advance by L where active."""
        L = tokens.shape[1]
        longest = max((p for p, a in zip(self.positions, active) if a), default=0) + L
        if longest > self.max_len:
            raise ContextLengthError(f"a row would pass max_len {self.max_len}")
        span = self._span(longest)
        self._traced.add((L, span, greedy))
        lazy = self.lazy_positions is not None
        flags = tuple(bool(a) for a in active)
        if self._device_active is None or self._device_active[0] != flags:
            self._device_active = (flags, self._padded(flags, mx.bool_))
        if lazy:
            pad = self._rows - self.max_batch
            pos = self.lazy_positions
            pos = mx.concatenate([pos, mx.zeros((pad,), mx.int32)]) if pad else pos
        elif self._device_pos is not None and self._device_pos[0] == tuple(self.positions):
            pos = self._device_pos[1]  # the previous step's output: nothing to upload
        else:
            pos = self._padded(self.positions, mx.int32)
        out, arrays, history, next_pos = self._compiled(
            tokens.astype(mx.int32), pos, self._device_active[1],
            [s.arrays for s in self.caches], span, greedy,
        )  # fmt: skip
        for s, a in zip(self.caches, arrays):
            s.arrays = a
        self._history = history
        self.positions = [p + L * a for p, a in zip(self.positions, active)]
        self._device_pos = None if lazy else (tuple(self.positions), next_pos)
        if lazy:  # the device positions advance as the host's upper bounds do
            self.lazy_positions = next_pos[: self.max_batch]
        if self.recurrent:  # states kept per token by this verify only
            self._verified = [L * a if L > 1 else 0 for a in active]
        else:  # a ring keeps reserve + 1 tokens behind its window; an idle write uses L of them
            cap = self.reserve + 1
            self._verified = [
                min(v + L, cap) if a else max(0, min(v, cap - L))
                for v, a in zip(self._verified, active)
            ]
        return out

    def _span(self, longest: int) -> int:
        """The attention-span bucket (a compiled trace each) covering ``longest`` tokens."""
        return min(self.max_len, max(MIN_SPAN, 1 << (longest - 1).bit_length()))

    def spans(self) -> list[int]:
        """Every attention-span bucket a decode can take: MIN_SPAN doubling up to max_len."""
        tops = [1 << k for k in range(self.max_len.bit_length()) if 1 << k <= self.max_len]
        return sorted({self._span(n) for n in tops + [self.max_len]})

    def warm_span(self, span: int, greedy: bool = False) -> bool:
        """Trace the one-token step at ``span`` (one of ``spans()``) with every row idle,
        evaluate it and drop its outputs: the rows' caches and positions stay as they were, and
        no request pays the trace (with its kernels' JIT) when a row first reaches the span.
        -> False where that trace was made already."""
        if span not in self.spans():
            raise InvalidArgumentError(f"span {span!r} is not one of {self.spans()}")
        if (1, span, greedy) in self._traced:
            return False
        B, kept = self.max_batch, [s.arrays for s in self.caches]
        try:
            out = self._compiled(
                mx.zeros((B, 1), dtype=mx.int32), self._padded(self.positions, mx.int32),
                self._padded([False] * B, mx.bool_), kept, span, greedy,
            )[0]  # fmt: skip
            mx.eval(out)  # the caches' new arrays only as intermediates: one at a time
        finally:
            for s, a in zip(self.caches, kept):  # the trace left its own arrays on the caches
                s.arrays = a
        self._traced.add((1, span, greedy))
        return True

    def warm_verify(self, row: int, lengths: Sequence[int]) -> int:
        """Trace the verify of each L in ``lengths`` (2 .. reserve + 1) at ``row``'s position,
        the other rows idle: a verify of zeros, evaluated, then rolled back, so the row's caches
        are as before. A speculative run whose draft count varies then compiles its lengths up
        front instead of stopping mid-stream the first time it picks one (a new trace, with its
        fused kernels' JIT, is the suspected cause of an H200 replay run at 0.13x plain).
        Lengths traced at this span already are skipped. -> the number of lengths traced."""
        self._check_row(row)
        active = [b == row for b in range(self.max_batch)]
        traced = 0
        for L in lengths:
            if not (isinstance(L, int) and 2 <= L <= self.reserve + 1):
                top = self.reserve + 1
                raise InvalidArgumentError(f"warm_verify lengths must be in [2, {top}], got {L!r}")
            if self.positions[row] + L > self.max_len:
                continue  # a verify this long cannot happen at this row's position
            if (L, self._span(self.positions[row] + L), False) in self._traced:
                continue
            out = self.verify(mx.zeros((self.max_batch, L), dtype=mx.int32), active)
            mx.eval(out, [s.arrays for s in self.caches])
            self.rollback(row, L)
            traced += 1
        return traced

    def _active(self, active: Sequence[bool] | None) -> list[bool]:
        B = self.max_batch
        active = [True] * B if active is None else [bool(a) for a in active]
        if len(active) != B:
            raise InvalidArgumentError(f"need {B} active flags, got {len(active)}")
        return active

    def decode(
        self, tokens: mx.array | Sequence[int], active: Sequence[bool] | None = None, greedy=False
    ) -> mx.array:
        """One token for every row (``tokens`` (B,)) at its own position; rows not ``active`` do
        not advance (their logits are meaningless). -> lazy logits (B, V), or token ids (B,) int32
        with ``greedy``."""
        B = self.max_batch
        active = [True] * B if active is None else [bool(a) for a in active]
        tokens = mx.array(tokens, dtype=mx.int32) if not isinstance(tokens, mx.array) else tokens
        if tokens.shape != (B,) or len(active) != B:
            raise InvalidArgumentError(f"decode needs {B} tokens and {B} active flags")
        return self._run(tokens[:, None], active, greedy)

    def verify(
        self,
        tokens: mx.array | Sequence[Sequence[int]],
        active: Sequence[bool] | None = None,
        greedy: bool = False,
    ) -> mx.array:
        """L tokens for every row (``tokens`` (B, L)), written at the row's position onward with
        a causal mask among them (one compiled trace per L). -> lazy logits (B, L, V), position
        i predicting the token after token i, or ids (B, L) int32 with ``greedy``. Active rows
        advance by L; ``rollback`` then forgets the rejected tail."""
        B = self.max_batch
        active = self._active(active)
        tokens = mx.array(tokens, dtype=mx.int32) if not isinstance(tokens, mx.array) else tokens
        if tokens.ndim != 2 or tokens.shape[0] != B or tokens.shape[1] < 1:
            raise InvalidArgumentError(f"verify needs tokens (B = {B}, L >= 1), got {tokens.shape}")
        L = tokens.shape[1]
        if L - 1 > self.reserve:
            raise InvalidArgumentError(
                f"a verify of {L} tokens needs DecodeStep(reserve >= {L - 1}), "
                f"this one has {self.reserve}"
            )
        out = self._run(tokens, active, greedy)
        return out[:, None] if L == 1 else out

    def rollback(self, row: int, n: int) -> None:
        """Forget the last ``n`` tokens fed to ``row``: its caches then equal those of a row fed
        only the tokens before them. With recurrent layers: tokens of the latest ``verify``
        only; otherwise up to ``reserve + 1`` tokens of the latest verify and decode calls."""
        self._check_row(row)
        counts = [0] * self.max_batch
        counts[row] = n
        self.rollback_rows(counts)

    def rollback_rows(self, counts: Sequence[int]) -> None:
        """``rollback`` for every row at once (``counts`` (B,), 0 = keep the row as it is)."""
        if len(counts) != self.max_batch:
            raise InvalidArgumentError(f"rollback_rows needs {self.max_batch} counts")
        for row, n in enumerate(counts):
            if not (isinstance(n, int) and 0 <= n <= self._verified[row]):
                raise InvalidArgumentError(
                    f"row {row}: can roll back 0 to {self._verified[row]} tokens now, not {n!r}"
                )
        if not any(counts):
            return
        self._verified = [v - n for v, n in zip(self._verified, counts)]
        self.positions = [p - n for p, n in zip(self.positions, counts)]
        if self.lazy_positions is not None:
            self.lazy_positions = self.lazy_positions - mx.array(counts, dtype=mx.int32)
        recurrent = [s for s in self.caches if isinstance(s, StaticRecurrentCache)]
        if not recurrent:
            return
        # each row's state after the verify tokens it keeps (history index 0: before them)
        arrays = self._compiled_rollback(
            self._history, [s.arrays for s in recurrent],
            mx.array(self._verified, dtype=mx.int32), mx.array([n > 0 for n in counts]),
        )  # fmt: skip
        for s, a in zip(recurrent, arrays):
            s.arrays = a

    # ---- lazy positions (pipelined rounds: no host read between verifies) ---------------------

    def begin_lazy(self) -> None:
        """From now on the compiled step reads the rows' positions from a device array that
        ``rollback_lazy`` moves back without a host read; ``self.positions`` become upper bounds
        (for the span bucket and the max_len check) until ``rollback_known`` tells the host what
        the device did, and exact again at ``end_lazy``."""
        if self.lazy_positions is None:
            self.lazy_positions = device_array(self.positions, mx.int32)

    def rollback_lazy(self, counts: mx.array) -> None:
        """``rollback_rows`` of the latest verify with ``counts`` (B,) int32 on the device
        (unchecked: 0 <= counts <= that verify's length). Only the device positions move."""
        if self.lazy_positions is None:
            raise InvalidArgumentError("rollback_lazy needs begin_lazy first")
        counts = counts.astype(mx.int32)
        self.lazy_positions = self.lazy_positions - counts
        recurrent = [s for s in self.caches if isinstance(s, StaticRecurrentCache)]
        if recurrent and self._history:  # the states after the tokens each row keeps
            kept = mx.array(self._verified, dtype=mx.int32) - counts
            arrays = self._compiled_rollback(
                self._history, [s.arrays for s in recurrent], kept, counts > 0
            )
            for s, a in zip(recurrent, arrays):
                s.arrays = a
        self._verified = [0] * self.max_batch  # the host cannot check a further rollback

    def rollback_known(self, counts: Sequence[int]) -> None:
        """The host learned the counts of an earlier ``rollback_lazy``: tighter upper bounds."""
        self.positions = [p - n for p, n in zip(self.positions, counts)]

    def _set_lazy(self, row: int) -> None:
        """The host set ``row``'s exact position: the device positions take it too."""
        if self.lazy_positions is not None:
            at = mx.arange(self.max_batch) == row
            self.lazy_positions = mx.where(at, self.positions[row], self.lazy_positions)

    def end_lazy(self) -> None:
        """Back to host positions: read the device's (exact) positions, one sync."""
        if self.lazy_positions is not None:
            self.positions = [int(p) for p in self.lazy_positions.tolist()]
            self.lazy_positions = None
            self._verified = [0] * self.max_batch

    def _rollback(self, history, arrays, kept, rows):
        recurrent = [s for s in self.caches if isinstance(s, StaticRecurrentCache)]
        for s, h, a in zip(recurrent, history, arrays):
            s.arrays = a
            s.rollback(h, kept, rows)
        return [s.arrays for s in recurrent]


def _slot_counts(s, pos: int) -> list[int | None]:
    """Per array of cache ``s``: ``pos`` where a row keeps only its first ``pos`` slots (a
    full-attention layer's KV or packed buffers), None where it keeps the whole row."""
    full = isinstance(s, StaticKVCache) and s.window is None
    n = len(s.arrays)
    slots = (StaticTQCache.SLOT_ARRAYS if isinstance(s, StaticTQCache) else n) if full else 0
    return [pos] * slots + [None] * (n - slots)


def _set_row(buf: mx.array, row: int, value: mx.array, n: int | None = None) -> mx.array:
    """A new array: buf with row ``row`` (its first ``n`` slots on axis 1 when n is given) set
    to value. ``buf`` itself is left as it is: a CUDA graph step may hold that array object and
    replay at its buffer's address (an in-place ``buf[row] = value`` would move the object to a
    new buffer and let the old one be freed under the graph)."""
    out = mx.stop_gradient(buf)  # another array object over the same value, no copy
    if n is None:
        out[row] = value
    elif n > 0:
        out[row, :, :n] = value
    return out


def _adopt_ring(buf: mx.array, row: int, src: mx.array, pos: int, set_row=None) -> mx.array:
    """A ring (H, C', D) filled by a per-sequence RotatingKVCache (slot = position % C') put
    into the static ring (slot = position % C) of ``row`` of ``buf``: the last min(pos, C, C')
    positions move. Written by ``set_row`` (default ``_set_row``: a new array, ``buf`` left as
    it is)."""
    set_row = set_row or _set_row
    C, C2 = buf.shape[2], src.shape[1]
    if C == C2:
        return set_row(buf, row, src)
    p = mx.arange(pos - min(pos, C, C2), pos)  # rings of different sizes (a short max_len)
    moved = mx.take(src, p % C2, axis=1)  # (H, n, D)
    idx = mx.broadcast_to((p % C)[None, :, None], moved.shape)
    return set_row(buf, row, mx.put_along_axis(buf[row], idx, moved.astype(buf.dtype), axis=1))


_STEPS = "_hf2q_decode_steps"  # a model's DecodeSteps by (rows, max_len, reserve)


def shared_step(
    model, max_batch: int, needed: int, like=None, reserve: int = 0, kv_bits=None
) -> DecodeStep | None:
    """A DecodeStep of the model with ``max_batch`` rows of at least ``needed`` tokens (and at
    least ``reserve``, for a verify of ``reserve + 1`` tokens) and caches of ``kv_bits``, built
    once and reused across calls (an idle one that fits, else a new one of the next power of two
    from 1024, which replaces the idle ones of its kind that do not fit), or None when the model
    has no static caches or its step is in use (a second generator on the same model)."""
    if not DecodeStep.supports(model):
        return None
    kind = _kv_pair(kv_bits)
    steps = model.__dict__.get(_STEPS)
    if steps is None:
        steps = {}
        object.__setattr__(model, _STEPS, steps)  # not an nn.Module child or parameter
    fits = [
        v for (b, n, r, k), v in steps.items()
        if b == max_batch and n >= needed and r >= reserve and k == kind
    ]  # fmt: skip
    if fits:
        step = min(fits, key=lambda v: (v.max_len, v.reserve))
        return None if step.busy else step
    stale = [k for k, v in steps.items() if k[0] == max_batch and k[3] == kind and not v.busy]
    for key in stale:
        del steps[key]
    max_len = max(1024, 1 << (needed - 1).bit_length())
    step = DecodeStep(model, max_batch, max_len, reserve=reserve, like=like, kv_bits=kind)
    steps[(max_batch, max_len, reserve, kind)] = step
    return step
