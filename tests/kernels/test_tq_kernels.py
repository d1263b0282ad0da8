"""TurboQuant kernels (quantize-on-write, flash-decode) against their MLX references: the
kernels' CUDA renderings on the CPU emulator (kernel_emulator.py), driven by the real dispatchers
(grids, partitions, row groups, template values), and the kernels on a GPU (``@requires_gpu``)."""

from __future__ import annotations

import kernel_emulator
import mlx.core as mx
import numpy as np
import pytest
from conftest import requires_gpu

from hf2q_mlx import custom_kernels as ck
from hf2q_mlx.custom_kernels import _render, graph_ops, reference_only
from hf2q_mlx.custom_kernels import tq_flash_decode as fd
from hf2q_mlx.custom_kernels import tq_flash_tc as tc
from hf2q_mlx.custom_kernels import tq_quantize as tqq
from hf2q_mlx.errors import InvalidArgumentError
from hf2q_mlx.models.turboquant import kernels as tqk
from hf2q_mlx.models.turboquant.cache import FULL_WINDOW, TQKVCache, TQRotatingKVCache
from hf2q_mlx.models.turboquant.codec import TQCodec, unpack_bits
from hf2q_mlx.models.turboquant.state import TQBalance, TQState

# ---- CPU emulation ------------------------------------------------------------------------------


Emulated = kernel_emulator.Emulated  # a Kernel stand-in running the CUDA rendering here


needs_gxx = pytest.mark.skipif(not kernel_emulator.available(), reason="g++ not found")


@pytest.fixture
def emulated(monkeypatch):
    """Route both dispatchers to the emulated kernels."""
    kernels = {
        "quantize": Emulated(tqq._kernel),
        "partial": Emulated(fd._partial_kernel),
        "reduce": Emulated(fd._reduce_kernel),
        "fused": Emulated(fd._fused_kernel),
        "tc": Emulated(tc.kernel),
    }
    monkeypatch.setattr(tc, "kernel", kernels["tc"])
    monkeypatch.setattr(tqq, "_kernel", kernels["quantize"])
    monkeypatch.setattr(fd, "_partial_kernel", kernels["partial"])
    monkeypatch.setattr(fd, "_reduce_kernel", kernels["reduce"])
    monkeypatch.setattr(fd, "_fused_kernel", kernels["fused"])
    monkeypatch.setattr(tqq, "backend", _emulated_backend)
    monkeypatch.setattr(fd, "backend", _emulated_backend)
    # launch plans made here hold the emulated kernels: keep them out of the module caches
    monkeypatch.setattr(tqq, "_PLANS", {})
    monkeypatch.setattr(fd, "_PLANS", {})
    return kernels


def _emulated_backend() -> str | None:
    """'cuda', except inside ``reference_only()`` (which the real ``backend()`` honours)."""
    return None if ck._forced_reference.get() > 0 else "cuda"


# ---- shared checks ----------------------------------------------------------------------------


def _check_quantize(rows: mx.array, x: mx.array, codec: TQCodec) -> None:
    """Kernel rows vs the reference: codes equal except rare boundary ties; each row's scale
    within fp32 rounding of the scale its own codes imply."""
    ref = tqk.tq_quantize_reference(x, codec)
    assert rows.shape == ref.shape and rows.dtype == mx.uint32
    words, scales = codec.split(rows)
    words_r, scales_r = codec.split(ref)
    c = np.array(unpack_bits(words, codec.bits, codec.padded_dim)).astype(np.int64)
    c_r = np.array(unpack_bits(words_r, codec.bits, codec.padded_dim)).astype(np.int64)
    # a coordinate within an fp32 rounding of a boundary may land on either side; nothing else
    diff = c != c_r
    assert np.all(np.abs(c - c_r)[diff] == 1)
    assert diff.mean() < 1e-3, diff.mean()
    # scale = |x| * P / sum(codebook[code] * u), u the unit coordinates, here in float64; the
    # kernel and the reference sum in other orders (fp32 rounding), and a tie changes the sum
    y = np.array(codec.rotate(x)).astype(np.float64)
    norm = np.linalg.norm(y, axis=-1)
    u = y * (np.sqrt(codec.padded_dim) / np.maximum(norm, 1e-30)[..., None])
    cb = np.array(codec.codebook).astype(np.float64)
    for got, codes in ((scales, c), (scales_r, c_r)):
        dot = np.sum(cb[codes] * u, axis=-1)
        want = np.where(dot > 0, norm * codec.padded_dim / np.maximum(dot, 1e-300), 0.0)
        np.testing.assert_allclose(np.array(got), want, rtol=2e-5)
    if not diff.any():
        np.testing.assert_array_equal(np.array(words), np.array(words_r))


def _fill_cache(kind, Hkv, Dk, Dv, kb, vb, window, reserve, lengths, seed, Hq=None):
    rng = np.random.default_rng(seed)
    B = 2
    cache = (
        TQKVCache(kb, vb, seed=seed)
        if kind == "growing"
        else TQRotatingKVCache(window, kb, vb, seed=seed, reserve=reserve)
    )
    # channels of unequal size and a value mean: the calibrated TQBalance is far from identity
    k_ch = np.exp(rng.uniform(-1.0, 1.0, Dk)).astype(np.float32)
    v_ch = np.exp(rng.uniform(-1.0, 1.0, Dv)).astype(np.float32)
    v_mean = rng.standard_normal(Dv).astype(np.float32)
    for i, L in enumerate(lengths):
        k = mx.array(rng.standard_normal((B, Hkv, L, Dk)).astype(np.float32) * k_ch)
        v = mx.array(rng.standard_normal((B, Hkv, L, Dv)).astype(np.float32) * v_ch + v_mean)
        if i + 1 < len(lengths):
            # the bulk prefill through the reference quantizer (the emulator is slow for it);
            # the last write, the decode step, goes through the dispatcher
            with reference_only():
                cache.update_and_fetch(k, v)
                if cache.needs_calibration:  # as attend() does, with queries of Hq heads
                    q = rng.standard_normal((B, Hq or 2 * Hkv, L, Dk)).astype(np.float32)
                    cache.calibrate(mx.array(q))
        else:
            cache.update_and_fetch(k, v)
    assert cache.tq_balance.k_scale is not None and cache.tq_balance.v_scale is not None
    return cache, rng


FLASH_CASES = [
    # (kind, Hq, Hkv, Dk, Dv, k_bits, v_bits, window, reserve, write lengths, M)
    ("ring", 4, 1, 256, 256, 4, 4, 64, 0, [150, 1], 1),  # Gemma 3 shape, wrapped twice
    ("growing", 8, 2, 512, 512, 8, 3, None, 0, [299, 2], 2),  # head_dim 512, odd length
    ("growing", 6, 2, 96, 64, 5, 6, None, 0, [70, 3], 3),  # padded K, 5/6-bit straddling
    ("ring", 2, 2, 64, 64, 2, 8, 40, 4, [97, 5], 5),  # MHA, ring with reserve, M = 5
    ("growing", 16, 2, 128, 128, 3, 4, None, 0, [37, 1], 1),  # REP 8: several row groups
]


def _check_flash(case, seed, dtype=mx.float32):
    kind, Hq, Hkv, Dk, Dv, kb, vb, window, reserve, lengths, M = case
    cache, rng = _fill_cache(kind, Hkv, Dk, Dv, kb, vb, window, reserve, lengths, seed, Hq)
    assert cache.can_flash(M)
    st = cache.packed_state()
    q = mx.array(rng.standard_normal((2, Hq, M, Dk)).astype(np.float32) * 2).astype(dtype)
    out = tqk.tq_flash_decode(q, st, Dk**-0.5)
    want = tqk.tq_flash_decode_reference(q, st, Dk**-0.5)
    assert out.shape == want.shape == (2, Hq, M, Dv) and out.dtype == dtype
    out, want = np.array(out.astype(mx.float32)), np.array(want.astype(mx.float32))
    if dtype == mx.float32:
        # fp32 throughout; partitions and butterflies sum in other orders
        np.testing.assert_allclose(out, want, rtol=0, atol=2e-5)
    else:
        # both compute in fp32 and round once to the dtype: one unit of its spacing apart
        eps = {mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7}[dtype]
        np.testing.assert_allclose(out, want, rtol=eps, atol=1e-4)


# a static cache's rows (models/static_cache.py): per-row offsets and balance tables
ROW_CASES = [
    # (window, capacity, Hq, Hkv, Dk, Dv, k_bits, v_bits, row offsets, M)
    (None, 96, 4, 2, 64, 64, 8, 8, [1, 37, 96], 1),  # full buffer: one key, part, all of it
    (16, 20, 4, 1, 128, 64, 4, 3, [5, 21, 50], 2),  # ring with reserve 4: unwrapped, wrapped
]


def _rows_state(case, seed):
    """Random packed rows (from the reference quantizer), per-row offsets and (B, Hkv, D)
    scales: a static TurboQuant cache's state (its positions before the M queries' write, plus
    M added by the kernel, as a static step passes them)."""
    window, C, Hq, Hkv, Dk, Dv, kb, vb, offsets, M = case
    rng = np.random.default_rng(seed)
    B = len(offsets)
    kc, vc = TQCodec(Dk, kb, seed), TQCodec(Dv, vb, seed)
    k = mx.array(rng.standard_normal((B, Hkv, C, Dk)).astype(np.float32))
    v = mx.array(rng.standard_normal((B, Hkv, C, Dv)).astype(np.float32))
    ks = mx.array(np.exp(rng.uniform(-1.0, 1.0, (B, Hkv, Dk))).astype(np.float32))
    vs = mx.array(np.exp(rng.uniform(-1.0, 1.0, (B, Hkv, Dv))).astype(np.float32))
    keys, values = tqk.tq_quantize_reference(k, kc), tqk.tq_quantize_reference(v, vc)
    pos = mx.array([o - M for o in offsets], dtype=mx.int32)
    bal = TQBalance(k_scale=ks, v_scale=vs)
    state = TQState(keys, values, kc, vc, pos, C, window or FULL_WINDOW, bal, span=C, offset_add=M)
    q = mx.array(rng.standard_normal((B, Hq, M, Dk)).astype(np.float32) * 2)
    return state, q


def _check_rows_flash(case, seed):
    """The kernels on a static cache's rows against the rows reference, and that reference
    against each row alone through the per-sequence reference (fp32; other summation orders)."""
    st, q = _rows_state(case, seed)
    scale = q.shape[-1] ** -0.5
    out = tqk.tq_flash_decode(q, st, scale)
    with mx.stream(mx.cpu):
        want = tqk.tq_flash_decode_reference(q, st, scale)
        np.testing.assert_allclose(np.array(out), np.array(want), rtol=0, atol=2e-5)
        bal = st.balance
        assert np.array_equal(np.array(st.ends()), case[8])
        for b, off in enumerate(case[8]):
            alone = TQState(
                st.keys[b : b + 1], st.values[b : b + 1], st.k_codec, st.v_codec, off,
                st.capacity, st.window, TQBalance(k_scale=bal.k_scale[b], v_scale=bal.v_scale[b]),
            )  # fmt: skip
            one = tqk.tq_flash_decode_reference(q[b : b + 1], alone, scale)
            np.testing.assert_allclose(np.array(want[b : b + 1]), np.array(one), rtol=0, atol=2e-5)


def _check_rows_quantize(dim, bits, dtype, seed):
    """(B, H, D) tables, one per batch row: the kernel against the reference on the stored
    vectors, and each row as that row quantized alone with its own (H, D) tables."""
    rng = np.random.default_rng(seed)
    x, _, _ = _balanced_input(rng, (3, 2, 5, dim), dtype)
    scale = mx.array(np.exp(rng.uniform(-1.5, 1.5, (3, 2, dim))).astype(np.float32))
    mean = mx.array(rng.standard_normal((3, 2, dim)).astype(np.float32))
    codec = TQCodec(dim, bits, seed=3)
    rows = tqk.tq_quantize(x, codec, scale, mean)
    with mx.stream(mx.cpu):
        _check_quantize(rows, tqq.stored_vectors(x.astype(mx.float32), scale, mean), codec)
    for b in range(3):
        alone = tqk.tq_quantize(x[b : b + 1], codec, scale[b], mean[b])
        np.testing.assert_array_equal(np.array(rows[b : b + 1]), np.array(alone))


# ---- CPU emulation tests ------------------------------------------------------------------------


@needs_gxx
@pytest.mark.parametrize("case", ROW_CASES, ids=["full", "ring"])
def test_flash_decode_rows_emulated(emulated, case):
    _check_rows_flash(case, seed=21)
    assert emulated["partial"].launches == 1 and emulated["reduce"].launches == 1


@needs_gxx
def test_quantize_rows_tables_emulated(emulated):
    _check_rows_quantize(128, 4, mx.float32, seed=22)
    assert emulated["quantize"].launches == 1 + 3


@needs_gxx
@pytest.mark.parametrize(
    "dim,bits,dtype",
    [(64, 2, mx.float32), (96, 3, mx.float16), (128, 5, mx.float32), (256, 4, mx.bfloat16),
     (256, 6, mx.float32), (512, 8, mx.float32)],
)  # fmt: skip
def test_quantize_kernel_emulated(emulated, dim, bits, dtype):
    rng = np.random.default_rng(dim + bits)
    codec = TQCodec(dim, bits, seed=bits)
    x = mx.array(rng.standard_normal((2, 3, 5, dim)).astype(np.float32) * 3)
    x = mx.concatenate([x, mx.zeros((2, 3, 1, dim))], axis=2).astype(dtype)  # a zero vector too
    rows = tqk.tq_quantize(x, codec)
    assert emulated["quantize"].launches == 1
    _check_quantize(rows, x, codec)


def _balanced_input(rng, shape, dtype):
    """x (B, H, L, D) with a per-head channel mean and scale, and that (H, D) scale and mean."""
    B, H, L, D = shape
    scale = mx.array(np.exp(rng.uniform(-1.5, 1.5, (H, D))).astype(np.float32))
    mean = mx.array(rng.standard_normal((H, D)).astype(np.float32) * 2)
    x = (
        rng.standard_normal(shape).astype(np.float32) * np.array(scale)[:, None]
        + np.array(mean)[:, None]
    )
    return mx.array(x).astype(dtype), scale, mean


def _check_balanced_quantize(x, scale, mean, codec):
    """The kernel folds (x - mean) / scale in: compare with the reference on that input."""
    for sc, mn in ((scale, mean), (scale, None), (None, mean)):
        rows = tqk.tq_quantize(x, codec, sc, mn)
        with mx.stream(mx.cpu):
            _check_quantize(rows, tqq.stored_vectors(x.astype(mx.float32), sc, mn), codec)


@needs_gxx
@pytest.mark.parametrize("dim,bits,dtype", [(256, 4, mx.bfloat16), (96, 5, mx.float32)])
def test_quantize_kernel_balance_emulated(emulated, dim, bits, dtype):
    rng = np.random.default_rng(dim)
    x, scale, mean = _balanced_input(rng, (2, 3, 4, dim), dtype)
    _check_balanced_quantize(x, scale, mean, TQCodec(dim, bits, seed=1))
    assert emulated["quantize"].launches == 3


@needs_gxx
@pytest.mark.parametrize("case", FLASH_CASES, ids=lambda c: f"{c[0]}-{c[3]}-{c[5]}{c[6]}-M{c[-1]}")
def test_flash_decode_kernels_emulated(emulated, case):
    _check_flash(case, seed=11)
    assert emulated["partial"].launches == 1 and emulated["reduce"].launches == 1


@needs_gxx
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_flash_decode_kernels_emulated_low_precision(emulated, dtype):
    _check_flash(FLASH_CASES[0], seed=12, dtype=dtype)


@needs_gxx
def test_flash_decode_emulated_many_partitions(emulated, monkeypatch):
    # force tiny partitions: many split-K parts, some fully masked by the sliding window
    monkeypatch.setattr(fd, "default_parts", lambda n, g, k: max(1, n // 32))
    _check_flash(("ring", 4, 2, 64, 64, 4, 4, 50, 30, [300, 1], 1), seed=3)
    _check_flash(("growing", 4, 2, 64, 64, 4, 4, None, 0, [333, 2], 2), seed=4)


@needs_gxx
@pytest.mark.parametrize("fold", ["0", "1"])
@pytest.mark.parametrize("parts", [1, 7, 8, 9, 17])
def test_flash_decode_sums_any_partition_count(emulated, monkeypatch, parts, fold):
    """The merge sums the partitions _SUM_LOADS at a time (reduce and fold): counts below, at
    and past a multiple of it, each against the reference. Every partition holds keys (the
    cache holds exactly a pass of every SIMD group per partition), so one left out or counted
    twice moves the output far past the fp32 tolerance."""
    monkeypatch.setenv("HF2Q_TQ_FOLD", fold)
    monkeypatch.setattr(fd, "default_parts", lambda n, g, k: parts)
    assert fd._SUM_LOADS == 8
    n = parts * fd._W * fd.tokens_per_step(64, 64, 4, 4)
    _check_flash(("growing", 4, 2, 64, 64, 4, 4, None, 0, [n - 2, 2], 2), seed=parts)
    plans = [p for p in fd._PLANS.values() if p is not None]
    assert plans and all(p[2] == parts for p in plans)


@needs_gxx
@pytest.mark.parametrize("fold", ["0", "1"])
@pytest.mark.parametrize("w", [2, 8])
def test_flash_decode_any_simd_group_count(emulated, monkeypatch, w, fold):
    """W SIMD groups per threadgroup other than the default 4 (the merge over SIMD groups, the
    query rotation's thread strides, the fold's sums): several partitions, rows and a window."""
    monkeypatch.setenv("HF2Q_TQ_FOLD", fold)
    monkeypatch.setattr(fd, "_W", w)
    monkeypatch.setattr(fd, "default_parts", lambda n, g, k: max(1, n // 64))
    _check_flash(("ring", 4, 2, 64, 64, 4, 4, 50, 30, [300, 1], 1), seed=w)
    _check_flash(("growing", 16, 2, 128, 128, 3, 4, None, 0, [333, 2], 2), seed=w + 1)
    _check_rows_flash(ROW_CASES[0], seed=w + 2)
    plans = [p for p in fd._PLANS.values() if p is not None]
    assert plans


class _Planned(list):
    """Template values of each launch plan made (a list), and the plans' input dtypes."""

    dtypes: list


def _planned_templates(emulated, monkeypatch, name: str) -> _Planned:
    """Record the template (and input dtypes) of every plan the emulated ``name`` kernel
    makes from here on."""
    seen = _Planned()
    seen.dtypes = []
    real = emulated[name].launcher

    def launcher(dtypes, **kw):
        seen.append(dict(kw["template"]))
        seen.dtypes.append(list(dtypes))
        return real(dtypes, **kw)

    monkeypatch.setattr(emulated[name], "launcher", launcher)
    return seen


# cases with both, one or neither side's codes in whole words per lane (fd.strided_words)
COALESCE_CASES = [
    (FLASH_CASES[0], 1, 1),  # 256 wide, 4 / 4 bits
    (FLASH_CASES[1], 1, 0),  # 512 wide, 8 bits (four words a lane) / 3 bits
    (("growing", 8, 2, 128, 128, 8, 8, None, 0, [150, 1], 1), 1, 1),  # one word a lane
    (("ring", 4, 2, 256, 256, 8, 8, 40, 4, [97, 3], 3), 1, 1),  # two words a lane, both sides
    (("growing", 4, 2, 512, 256, 2, 8, None, 0, [70, 2], 2), 1, 1),  # 2 bits: 16 codes a word
    (FLASH_CASES[3], 0, 0),  # 64 wide: half a word a lane
]


@needs_gxx
@pytest.mark.parametrize("fold", ["0", "1"])
@pytest.mark.parametrize("case,sk,sv", COALESCE_CASES, ids=lambda c: str(c))
def test_flash_decode_coalesced_words(emulated, monkeypatch, case, sk, sv, fold):
    """HF2Q_TQ_COALESCE=1: lanes read strided words of the packed rows (each load of a SIMD group
    128 consecutive bytes) and own those words' coordinates, where the codes allow it (SK / SV
    as given); the outputs stay within the fp32 tolerance of the reference. A coordinate
    mapped to the wrong query or accumulator element moves them far past it (with one word a
    lane both mappings agree: the cases of two and four words are the ones that tell)."""
    monkeypatch.setenv("HF2Q_TQ_COALESCE", "1")
    monkeypatch.setenv("HF2Q_TQ_FOLD", fold)
    name = "fused" if fold == "1" else "partial"
    seen = _planned_templates(emulated, monkeypatch, name)
    monkeypatch.setattr(fd, "default_parts", lambda n, g, k: max(1, n // 64))
    _check_flash(case, seed=31)
    assert seen and all((t["SK"], t["SV"]) == (sk, sv) for t in seen), seen
    assert emulated[name].launches == 1


def test_strided_words_and_switch(monkeypatch):
    assert [fd.strided_words(512, b) for b in (2, 3, 4, 5, 8)] == [1, 0, 1, 0, 1]
    assert [fd.strided_words(128, b) for b in (2, 4, 8)] == [0, 0, 1]
    assert fd.strided_words(512, 8, on=False) == 0
    monkeypatch.delenv("HF2Q_TQ_COALESCE", raising=False)
    assert fd.coalesced() == fd._COALESCE
    monkeypatch.setattr(fd, "_COALESCE", True)
    monkeypatch.setenv("HF2Q_TQ_COALESCE", "0")
    assert not fd.coalesced()
    monkeypatch.setattr(fd, "_COALESCE", False)
    monkeypatch.setenv("HF2Q_TQ_COALESCE", "1")
    assert fd.coalesced()
    monkeypatch.setenv("HF2Q_TQ_COALESCE", "2")
    with pytest.raises(InvalidArgumentError, match="HF2Q_TQ_COALESCE"):
        fd.coalesced()


# cases with 8-bit codebooks on either side, and the copies the default shared budget gives
COPIES_CASES = [
    (("ring", 4, 2, 256, 256, 8, 8, 40, 4, [97, 3], 3), 16, (16, 16)),  # both, 8-bit
    (FLASH_CASES[1], 16, (16, 1)),  # 512 wide 8-bit keys; 3-bit values need no copies
    (FLASH_CASES[3], 4, (1, 4)),  # 2-bit keys, 8-bit values, M = 5
    (("growing", 6, 2, 96, 64, 6, 6, None, 0, [70, 3], 3), 32, (32, 32)),  # 6 bits, 32 copies
]


@needs_gxx
@pytest.mark.parametrize("fold", ["0", "1"])
@pytest.mark.parametrize("case,copies,want", COPIES_CASES, ids=lambda c: str(c))
def test_flash_decode_codebook_copies(emulated, monkeypatch, case, copies, want, fold):
    """HF2Q_TQ_CB_COPIES: lane l reads copy l % KR of an interleaved codebook; the outputs stay
    within the fp32 tolerance of the reference (a copy filled from the wrong entry, or a lookup
    with the wrong stride, reads another centroid and moves them far past it)."""
    monkeypatch.setenv("HF2Q_TQ_CB_COPIES", str(copies))
    monkeypatch.setenv("HF2Q_TQ_FOLD", fold)
    name = "fused" if fold == "1" else "partial"
    seen = _planned_templates(emulated, monkeypatch, name)
    monkeypatch.setattr(fd, "default_parts", lambda n, g, k: max(1, n // 64))
    _check_flash(case, seed=37)
    assert seen and all((t["KR"], t["VR"]) == want for t in seen), seen


# the tensor-core partial's cases (codes of 1, 2, 4 or 8 bits: tq_flash_tc.covers)
TC_CASES = [
    FLASH_CASES[0],  # 256 wide, 4 / 4 bits, a ring wrapped twice, REP 4
    FLASH_CASES[3],  # 64 wide, 2 / 8 bits, MHA, ring with reserve, M = 5 (5 rows of 8)
    ("growing", 16, 2, 512, 512, 8, 8, None, 0, [299, 1], 1),  # Gemma 4 global: 8 rows, 8 bits
    ("growing", 16, 2, 512, 256, 8, 4, None, 0, [150, 2], 2),  # 16 rows: two row groups
    ("ring", 4, 2, 128, 128, 8, 8, 40, 4, [97, 3], 3),  # one load word a lane, 12-token window
    ("growing", 6, 2, 96, 64, 4, 8, None, 0, [70, 3], 3),  # padded K (96 -> 128), 9 rows
]


@needs_gxx
@pytest.mark.parametrize(
    "case", TC_CASES, ids=lambda c: f"{c[0]}-{c[3]}x{c[4]}-{c[5]}{c[6]}-M{c[-1]}"
)
def test_flash_decode_tensor_cores_emulated(emulated, monkeypatch, case):
    """HF2Q_TQ_TC=1: the partial kernel on tf32 mma (hi / lo split operands) within the fp32
    tolerance of the reference, the scalar reduce merging its partials. A code fed to the wrong
    coordinate, token or row, a weight on the wrong token or a lost tail term moves the output
    far past it (the tails alone are ~2^-11 of each operand, 100x the tolerance)."""
    monkeypatch.setenv("HF2Q_TQ_TC", "1")
    monkeypatch.setattr(fd, "default_parts", lambda n, g, k: max(1, n // 64))
    seen = _planned_templates(emulated, monkeypatch, "tc")
    _check_flash(case, seed=41)
    assert emulated["tc"].launches == 1 and emulated["partial"].launches == 0
    rep_m = case[1] // case[2] * case[-1]
    assert seen and seen[0]["NG"] == -(-rep_m // 8)


@needs_gxx
def test_flash_decode_tensor_cores_rows_and_fallbacks(emulated, monkeypatch):
    """A static cache's rows (per-row offsets and balance tables) on tensor cores; codecs it does
    not cover (3-bit values) and the folded reduce stay on the scalar kernel."""
    monkeypatch.setenv("HF2Q_TQ_TC", "1")
    _check_rows_flash(ROW_CASES[0], seed=43)
    assert emulated["tc"].launches == 1
    _check_flash(FLASH_CASES[1], seed=41)  # 8-bit keys, 3-bit values
    assert emulated["tc"].launches == 1 and emulated["partial"].launches == 1
    monkeypatch.setenv("HF2Q_TQ_FOLD", "1")
    _check_flash(TC_CASES[0], seed=45)
    assert emulated["tc"].launches == 1 and emulated["fused"].launches == 1


def test_tensor_core_switch_and_coverage(monkeypatch):
    monkeypatch.delenv("HF2Q_TQ_TC", raising=False)
    assert not tc.tensor_cores()
    monkeypatch.setenv("HF2Q_TQ_TC", "1")
    assert tc.tensor_cores()
    monkeypatch.setenv("HF2Q_TQ_TC", "yes")
    with pytest.raises(InvalidArgumentError, match="HF2Q_TQ_TC"):
        tc.tensor_cores()
    assert tc.covers(512, 512, 8, 8, False) and tc.covers(64, 64, 2, 4, False)
    assert not tc.covers(512, 512, 8, 3, False)  # 3-bit codes straddle words
    assert not tc.covers(512, 512, 8, 8, True)  # the fold stays scalar
    assert not tc.covers(32, 32, 2, 4, False)  # less than a word a lane
    assert [tc.row_groups(r) for r in (1, 8, 9, 64)] == [1, 1, 2, 8]


@needs_gxx
def test_flash_decode_min_blocks(emulated, monkeypatch):
    """HF2Q_TQ_MIN_BLOCKS: the partial kernel's template carries launch bounds (W * 32 threads,
    that many threadgroups an SM), which our own CUDA units declare and MLX's ignore; the
    outputs stay the reference's."""
    monkeypatch.setenv("HF2Q_TQ_MIN_BLOCKS", "3")
    seen = _planned_templates(emulated, monkeypatch, "partial")
    _check_flash(FLASH_CASES[1], seed=41)
    assert seen and all(t["LB_THREADS"] == 32 * fd._W and t["LB_MIN_BLOCKS"] == 3 for t in seen)
    dtypes, template = seen.dtypes[0], seen[0]
    sig = "_".join(_render._SHORT[d] for d in dtypes) + "__" + _render._SHORT[mx.float32]
    real_kernel = emulated["partial"].kernel
    _, unit = real_kernel.precompiled_unit(dtypes, (), [mx.float32], template, sig)
    assert f"__launch_bounds__({32 * fd._W}, 3) hq_tq_flash_decode_partial" in unit
    assert "__launch_bounds__" not in real_kernel.render("cuda", real_kernel.examples[0])
    plain = {k: v for k, v in template.items() if not k.startswith("LB_")}
    assert (
        "__launch_bounds__"
        not in real_kernel.precompiled_unit(dtypes, (), [mx.float32], plain, sig)[1]
    )


def test_min_blocks_switch(monkeypatch):
    monkeypatch.delenv("HF2Q_TQ_MIN_BLOCKS", raising=False)
    assert fd.min_blocks() == fd._MIN_BLOCKS == 0
    monkeypatch.setenv("HF2Q_TQ_MIN_BLOCKS", "4")
    assert fd.min_blocks() == 4
    monkeypatch.setenv("HF2Q_TQ_MIN_BLOCKS", "9")
    with pytest.raises(InvalidArgumentError, match="HF2Q_TQ_MIN_BLOCKS"):
        fd.min_blocks()


def test_codebook_copies_choice(monkeypatch):
    """Copies only for codebooks of more than 32 entries, keys first, within the back end's
    shared-memory limit; a count that is not a power of two is a one-line error."""
    monkeypatch.setattr(fd, "backend", lambda: "cuda")
    monkeypatch.delenv("HF2Q_TQ_CB_COPIES", raising=False)
    monkeypatch.setattr(fd, "_CB_COPIES", 16)
    # Gemma 4 global layer, TQ8: 8 KB of queries + 2 x 16 KB of codebooks fit CUDA's 48 KB
    assert fd.codebook_copies(8, 8, 4, 512, 512, 4, False) == (16, 16)
    assert fd.codebook_copies(4, 4, 4, 512, 512, 4, False) == (1, 1)
    assert fd.codebook_copies(8, 3, 4, 512, 512, 4, True) == (16, 1)
    monkeypatch.setattr(fd, "backend", lambda: "metal")  # 32 KB: the keys' copies only
    assert fd.codebook_copies(8, 8, 4, 512, 512, 4, False) == (16, 1)
    monkeypatch.setenv("HF2Q_TQ_CB_COPIES", "32")  # 32 KB a codebook: none fits beside the rest
    assert fd.codebook_copies(8, 8, 4, 512, 512, 4, False) == (1, 1)
    monkeypatch.setenv("HF2Q_TQ_CB_COPIES", "1")
    assert fd.codebook_copies(8, 8, 4, 512, 512, 4, False) == (1, 1)
    for bad in ("3", "12", "64", "x"):
        monkeypatch.setenv("HF2Q_TQ_CB_COPIES", bad)
        with pytest.raises(InvalidArgumentError, match="HF2Q_TQ_CB_COPIES"):
            fd.codebook_copies(8, 8, 4, 512, 512, 4, False)


@needs_gxx
@pytest.mark.parametrize("case", FLASH_CASES, ids=lambda c: f"{c[0]}-{c[3]}-{c[5]}{c[6]}-M{c[-1]}")
def test_flash_decode_fused_emulated(emulated, monkeypatch, case):
    """HF2Q_TQ_FOLD=1: the reduce in the last partition's threadgroup, one launch a call; the
    output poisoned first would show any row it left unwritten (the reference check)."""
    monkeypatch.setenv("HF2Q_TQ_FOLD", "1")
    _check_flash(case, seed=11)
    assert emulated["fused"].launches == 1
    assert emulated["partial"].launches == 0 and emulated["reduce"].launches == 0


@needs_gxx
def test_flash_decode_fused_emulated_many_partitions_and_rows(emulated, monkeypatch):
    """Many partitions (some fully masked by the window) count in on their counters: every row
    group's last one merges, and every counter is back at zero for the next call."""
    monkeypatch.setenv("HF2Q_TQ_FOLD", "1")
    monkeypatch.setattr(fd, "default_parts", lambda n, g, k: max(1, n // 32))
    _check_flash(("ring", 4, 2, 64, 64, 4, 4, 50, 30, [300, 1], 1), seed=3)
    _check_flash(("growing", 16, 2, 128, 128, 3, 4, None, 0, [333, 2], 2), seed=4)
    for case in ROW_CASES:
        _check_rows_flash(case, seed=5)
    plans = [p[0] for p in fd._PLANS.values() if p is not None]
    assert len(plans) == 4 and all(isinstance(p, fd.CountedPlan) for p in plans)
    assert not any(np.array(p.counter).any() for p in plans)  # every counter back at zero
    assert emulated["partial"].launches == 0 and emulated["fused"].launches == 4


@needs_gxx
@pytest.mark.parametrize("ring", [False, True])
def test_quantize_into_writes_the_kernels_rows_at_the_slots(emulated, ring, monkeypatch):
    """``tq_quantize_into`` (a recorded graph's TurboQuant write, HF2Q_TQ_FOLD=1) over a cache
    of random words: each token's packed row equals the quantize kernel's row for it, word for
    word, at slot pos[b] + l (wrapped on a ring); every other word is left as it was."""
    rng = np.random.default_rng(9 + ring)
    B, H, L, D, C = 2, 2, 3, 96, 8
    codec = TQCodec(D, 5, seed=2)
    x, _, _ = _balanced_input(rng, (B, H, L, D), mx.bfloat16)
    scale = mx.array(np.exp(rng.uniform(-1.0, 1.0, (B, H, D))).astype(np.float32))
    mean = mx.array(rng.standard_normal((B, H, D)).astype(np.float32))
    words = codec.row_words
    cache = mx.array(rng.integers(0, 2**32, (B, H, C, words), dtype=np.uint64).astype(np.uint32))
    pos = mx.array([6, 1] if ring else [0, 5], dtype=mx.int32)
    # the launch resolves on the CPU (MLX's build stubbed: the emulator runs its rendering)
    monkeypatch.setattr(_render, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(tqq._into_kernel, "_kernel_for", lambda be, sig: print)
    launch = tqq.into_launch(tuple(cache.shape), tuple(x.shape), x.dtype, codec.padded_dim,
                             codec.bits, True, True, True, ring)  # fmt: skip
    s = launch.spec
    one_inputs = [x, codec.signs, scale, mean, codec.boundaries, codec.codebook, pos]
    (got,) = kernel_emulator.emulate(
        s.kernel, one_inputs, grid=s.grid, threadgroup=s.threadgroup,
        output_shapes=s.output_shapes, output_dtypes=s.output_dtypes,
        template=dict(s.template), initial=[cache],
    )  # fmt: skip
    rows = tqk.tq_quantize(x, codec, scale, mean)  # the emulated quantize kernel
    assert emulated["quantize"].launches == 1
    want = graph_ops.kv_write_reference(cache, rows, pos, ring)
    np.testing.assert_array_equal(np.array(got), np.array(want))
    assert not np.array_equal(np.array(got), np.array(cache))
    assert (
        tqq.into_launch(
            (B, H, C, words + 1),
            tuple(x.shape),
            x.dtype,
            codec.padded_dim,
            codec.bits,
            True,
            True,
            True,
            ring,
        )
        is None
    )  # wrong row width


@needs_gxx
@pytest.mark.parametrize("ring", [False, True])
def test_quantize_kv_into_writes_both_caches_in_one_launch(emulated, ring, monkeypatch):
    """``tq_quantize_kv_into`` (HF2Q_TQ_FOLD=1 in a recorded graph): ONE launch writes each
    token's key row (its own signs, scale and mean) and value row (own signs and scale, no mean)
    into their caches, word for word the quantize kernel's rows at slot pos[b] + l; every other
    word is left as it was. Keys and values of other bits fall back to a launch each."""
    rng = np.random.default_rng(21 + ring)
    B, H, L, D, C = 2, 2, 3, 96, 8
    k_codec, v_codec = TQCodec(D, 5, seed=2), TQCodec(D, 5, seed=7)
    xk, _, _ = _balanced_input(rng, (B, H, L, D), mx.bfloat16)
    xv, _, _ = _balanced_input(rng, (B, H, L, D), mx.bfloat16)
    k_scale, v_scale = (
        mx.array(np.exp(rng.uniform(-1.0, 1.0, (B, H, D))).astype(np.float32)) for _ in "kv"
    )
    k_mean = mx.array(rng.standard_normal((B, H, D)).astype(np.float32))
    words = k_codec.row_words
    kc, vc = (
        mx.array(rng.integers(0, 2**32, (B, H, C, words), dtype=np.uint64).astype(np.uint32))
        for _ in "kv"
    )
    pos = mx.array([6, 1] if ring else [0, 5], dtype=mx.int32)
    monkeypatch.setattr(_render, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(tqq._kv_into_kernel, "_kernel_for", lambda be, sig: print)
    launch = tqq.kv_into_launch(tuple(kc.shape), tuple(xk.shape), xk.dtype, k_codec.padded_dim,
                                k_codec.bits, True, True, ring)  # fmt: skip
    s = launch.spec
    assert s.grid[2] == 2 * B and len(s.output_shapes) == 2
    inputs = [xk, xv, k_codec.signs, k_scale, k_mean, k_codec.boundaries, k_codec.codebook,
              v_codec.signs, v_scale, v_codec.boundaries, v_codec.codebook, pos]  # fmt: skip
    got_k, got_v = kernel_emulator.emulate(
        s.kernel, inputs, grid=s.grid, threadgroup=s.threadgroup,
        output_shapes=s.output_shapes, output_dtypes=s.output_dtypes,
        template=dict(s.template), initial=[kc, vc],
    )  # fmt: skip
    k_rows = tqk.tq_quantize(xk, k_codec, k_scale, k_mean)  # the emulated quantize kernel
    v_rows = tqk.tq_quantize(xv, v_codec, v_scale)
    assert emulated["quantize"].launches == 2
    for got, cache, rows in ((got_k, kc, k_rows), (got_v, vc, v_rows)):
        want = graph_ops.kv_write_reference(cache, rows, pos, ring)
        np.testing.assert_array_equal(np.array(got), np.array(want))
    # the pair that cannot share a launch: values of other bits, a mean on the values
    tables = [(k_codec.signs, k_scale, k_mean, k_codec.boundaries, k_codec.codebook)] * 2
    assert tqq.quantize_kv_rows_into((kc, vc), (xk, xv), tuple(tables), 5, pos, ring) is None
    assert tqq.kv_into_launch((B, H, C, words + 1), tuple(xk.shape), xk.dtype,
                              k_codec.padded_dim, 5, True, True, ring) is None  # fmt: skip


def test_quantize_kv_into_falls_back_to_a_launch_each(monkeypatch):
    """Keys and values of different bits (K8 / V4) take ``tq_quantize_into`` twice, the same
    pair of bits one ``quantize_kv_rows_into``."""
    calls = []
    monkeypatch.setattr(tqk, "quantize_kv_rows_into", lambda *a: calls.append("kv") or a[0])
    monkeypatch.setattr(tqk, "quantize_rows_into", lambda cache, *a: calls.append("one") or cache)
    x = mx.random.normal((1, 2, 1, 64), key=mx.random.key(3))  # routing only: stubs take it
    caches = (mx.array([[[[1]]]], dtype=mx.uint32), mx.array([[[[2]]]], dtype=mx.uint32))
    pos = mx.array([5], dtype=mx.int32)
    for bits, want in (((8, 8), ["kv"]), ((8, 4), ["one", "one"])):
        calls.clear()
        codecs = (TQCodec(64, bits[0], seed=0), TQCodec(64, bits[1], seed=1))
        got = tqk.tq_quantize_kv_into(caches, (x, x), codecs, (None, None), None, pos, False)
        assert calls == want and got[0] is caches[0] and got[1] is caches[1]


def test_simd_groups_from_the_environment(monkeypatch):
    monkeypatch.delenv("HF2Q_TQ_W", raising=False)
    assert fd.simd_groups() == fd._W
    monkeypatch.setenv("HF2Q_TQ_W", "8")
    assert fd.simd_groups() == 8
    monkeypatch.setenv("HF2Q_TQ_W", "16")  # 512 threads of 222 registers: more than an SM holds
    with pytest.raises(InvalidArgumentError, match="HF2Q_TQ_W"):
        fd.simd_groups()


def test_partition_and_row_group_choices(monkeypatch):
    monkeypatch.delenv("HF2Q_TQ_ROW_REGS", raising=False)
    assert fd.row_groups(4, 256, 256) == (4, 1)
    assert fd.row_groups(8, 512, 512) == (4, 2)  # 4 * (16 + 16) registers per lane at P = 512
    assert fd.row_groups(12, 128, 128) == (6, 2)  # balanced groups
    monkeypatch.setenv("HF2Q_TQ_ROW_REGS", "64")  # half the rows of a global layer's group
    assert fd.row_regs() == 64 and fd.row_groups(8, 512, 512) == (2, 4)
    monkeypatch.setenv("HF2Q_TQ_ROW_REGS", "8")
    with pytest.raises(InvalidArgumentError, match="HF2Q_TQ_ROW_REGS"):
        fd.row_groups(8, 512, 512)
    assert fd.tokens_per_step(256, 256, 4, 4) == 8  # one key and one value word per lane
    assert fd.tokens_per_step(512, 512, 8, 3) == 2  # 4 + 2 words
    # Gemma 4 global layer, TQ8: 8 rows of 514 floats per partition against 1032 B per key
    assert fd.min_keys(8, 512, 2, 258) == 128
    assert fd.min_keys(2, 256, 8, 66) == 128  # a sliding layer: 4 steps of 8 keys per group
    assert fd.default_parts(1, 1, 128) == 1
    assert fd.default_parts(1024, 8, 128) == 8
    assert fd.default_parts(32768, 4, 128) == 132  # a long global layer: fill the GPU
    assert fd.default_parts(10**7, 1, 32) == 512


# ---- GPU tests (CUDA on the H200; Metal on Apple) ---------------------------------------------


@requires_gpu
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("dim,bits", [(64, 2), (96, 3), (128, 5), (256, 4), (256, 6), (512, 8)])
def test_quantize_kernel_gpu(dim, bits, dtype):
    rng = np.random.default_rng(dim * bits)
    codec = TQCodec(dim, bits, seed=bits)
    x = mx.array(rng.standard_normal((3, 4, 33, dim)).astype(np.float32) * 3).astype(dtype)
    rows = tqk.tq_quantize(x, codec)
    with mx.stream(mx.cpu):
        _check_quantize(rows, x, codec)


@requires_gpu
@pytest.mark.parametrize(
    "dim,bits,dtype", [(256, 4, mx.bfloat16), (512, 8, mx.float16), (96, 5, mx.float32)]
)
def test_quantize_kernel_balance_gpu(dim, bits, dtype):
    rng = np.random.default_rng(dim + 1)
    x, scale, mean = _balanced_input(rng, (2, 4, 37, dim), dtype)
    _check_balanced_quantize(x, scale, mean, TQCodec(dim, bits, seed=2))


@requires_gpu
@pytest.mark.parametrize("case", FLASH_CASES, ids=lambda c: f"{c[0]}-{c[3]}-{c[5]}{c[6]}-M{c[-1]}")
def test_flash_decode_kernels_gpu(case):
    _check_flash(case, seed=5)


@requires_gpu
@pytest.mark.parametrize("case", FLASH_CASES, ids=lambda c: f"{c[0]}-{c[3]}-{c[5]}{c[6]}-M{c[-1]}")
def test_flash_decode_kernels_gpu_eight_simd_groups(monkeypatch, case):
    """W = 8 SIMD groups per threadgroup (bench/tq_sweep.py's variant) on the GPU."""
    monkeypatch.setattr(fd, "_W", 8)
    monkeypatch.setattr(fd, "_PLANS", {})
    _check_flash(case, seed=6)


@requires_gpu
@pytest.mark.parametrize("case,sk,sv", COALESCE_CASES, ids=lambda c: str(c))
def test_flash_decode_kernels_gpu_coalesced(monkeypatch, case, sk, sv):
    """HF2Q_TQ_COALESCE=1 (bench/tq_sweep.py's variant) on the GPU."""
    monkeypatch.setenv("HF2Q_TQ_COALESCE", "1")
    monkeypatch.setattr(fd, "_PLANS", {})
    _check_flash(case, seed=7)


@requires_gpu
@pytest.mark.parametrize("case,copies,want", COPIES_CASES, ids=lambda c: str(c))
def test_flash_decode_kernels_gpu_codebook_copies(monkeypatch, case, copies, want):
    """HF2Q_TQ_CB_COPIES (bench/tq_sweep.py's variant) on the GPU."""
    monkeypatch.setenv("HF2Q_TQ_CB_COPIES", str(copies))
    monkeypatch.setattr(fd, "_PLANS", {})
    _check_flash(case, seed=8)


@requires_gpu
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_flash_decode_gpu_low_precision(dtype):
    """fp16/bf16 queries: error vs the fp32 oracle at most 2x the reference's own in that dtype."""
    cache, rng = _fill_cache("growing", 2, 256, 256, 4, 4, None, 0, [3000, 1], 9)
    st = cache.packed_state()
    q32 = mx.array(rng.standard_normal((2, 8, 1, 256)).astype(np.float32))
    exact = tqk.tq_flash_decode_reference(q32, st, 0.0625)
    err_kernel = mx.abs(tqk.tq_flash_decode(q32.astype(dtype), st, 0.0625) - exact).max().item()
    err_ref = mx.abs(tqk.tq_flash_decode_reference(q32.astype(dtype), st, 0.0625) - exact)
    assert err_kernel <= 2 * err_ref.max().item() + 1e-6


@requires_gpu
@pytest.mark.parametrize("case", ROW_CASES, ids=["full", "ring"])
def test_flash_decode_rows_gpu(case):
    _check_rows_flash(case, seed=23)


@requires_gpu
@pytest.mark.parametrize("dim,bits,dtype", [(256, 8, mx.bfloat16), (128, 4, mx.float32)])
def test_quantize_rows_tables_gpu(dim, bits, dtype):
    _check_rows_quantize(dim, bits, dtype, seed=24)


@requires_gpu
@pytest.mark.parametrize(
    "case", TC_CASES, ids=lambda c: f"{c[0]}-{c[3]}x{c[4]}-{c[5]}{c[6]}-M{c[-1]}"
)
def test_flash_decode_tensor_cores_gpu(monkeypatch, case):
    """HF2Q_TQ_TC=1 on the GPU: the tf32 mma partial within the fp32 tolerance of the reference,
    with the default partitions and with many."""
    monkeypatch.setenv("HF2Q_TQ_TC", "1")
    monkeypatch.setattr(fd, "_PLANS", {})
    _check_flash(case, seed=46)
    monkeypatch.setattr(fd, "default_parts", lambda n, g, k: max(1, n // 64))
    monkeypatch.setattr(fd, "_PLANS", {})
    _check_flash(case, seed=47)


@requires_gpu
def test_flash_decode_tensor_cores_gpu_long_and_low_precision(monkeypatch):
    """HF2Q_TQ_TC=1: 20K tokens through a ring and a growing cache (many partitions), a static
    cache's rows, and bf16 / fp16 queries at most 2x the reference's own error in that dtype."""
    monkeypatch.setenv("HF2Q_TQ_TC", "1")
    monkeypatch.setattr(fd, "_PLANS", {})
    for case in (
        ("ring", 8, 2, 256, 256, 8, 8, 4096, 3, [20_000, 1], 1),
        ("growing", 16, 2, 512, 512, 8, 8, None, 0, [20_001, 1], 1),
    ):
        _check_flash(case, seed=48)
    _check_rows_flash(ROW_CASES[0], seed=49)
    cache, rng = _fill_cache("growing", 2, 256, 256, 8, 8, None, 0, [3000, 1], 9)
    st = cache.packed_state()
    q32 = mx.array(rng.standard_normal((2, 8, 1, 256)).astype(np.float32))
    exact = tqk.tq_flash_decode_reference(q32, st, 0.0625)
    for dtype in (mx.float16, mx.bfloat16):
        err_kernel = mx.abs(tqk.tq_flash_decode(q32.astype(dtype), st, 0.0625) - exact).max()
        err_ref = mx.abs(tqk.tq_flash_decode_reference(q32.astype(dtype), st, 0.0625) - exact)
        assert err_kernel.item() <= 2 * err_ref.max().item() + 1e-6


@requires_gpu
def test_flash_decode_gpu_long_context_ring_wrap():
    # 20K tokens through a 4096-slot ring (several wraps) and a growing cache, many partitions
    for case in (
        ("ring", 8, 2, 256, 256, 4, 4, 4096, 3, [20_000, 1], 1),
        ("growing", 16, 8, 128, 128, 8, 8, None, 0, [20_001, 3], 3),
    ):
        _check_flash(case, seed=13)
