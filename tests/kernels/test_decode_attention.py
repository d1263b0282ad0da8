"""Attention over a static KV cache with in-kernel masks: the reference against a brute-force
numpy attention that reads each slot's position from an explicit table, the kernel's CUDA
rendering on the CPU emulator, and the kernel on a GPU."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import requires_gpu
from test_norm_rope import emulate, needs_gxx

from hf2q_mlx.custom_kernels import decode_attention as da
from hf2q_mlx.errors import InvalidArgumentError


def _case(B, Hq, Hk, L, D, Dv, C, pos, seed, dtype=mx.float32):
    rng = np.random.default_rng(seed)
    q = mx.array(rng.standard_normal((B, Hq, L, D)).astype(np.float32)).astype(dtype)
    k = mx.array(rng.standard_normal((B, Hk, C, D)).astype(np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal((B, Hk, C, Dv)).astype(np.float32)).astype(dtype)
    return q, k, v, mx.array(pos, dtype=mx.int32)


def _brute(q, k, v, pos, scale, span, window):
    """Each row's slots hold the positions written last (a dict per row), attended in fp64."""
    q, k, v = (np.array(a.astype(mx.float32), np.float64) for a in (q, k, v))
    B, Hq, L, _ = q.shape
    Hk, C = k.shape[1], k.shape[2]
    out = np.zeros((B, Hq, L, v.shape[-1]))
    for b in range(B):
        held = {}  # slot -> position, after positions 0 .. pos+L-1 were written in order
        for p in range(int(pos[b]) + L):
            held[p % C if window is not None else p] = p
        for h in range(Hq):
            for li in range(L):
                qp = int(pos[b]) + li
                slots = [s for s in range(span) if s in held and held[s] <= qp
                         and (window is None or held[s] > qp - window)]  # fmt: skip
                kk, vv = k[b, h // (Hq // Hk), slots], v[b, h // (Hq // Hk), slots]
                w = kk @ q[b, h, li] * scale
                w = np.exp(w - w.max())
                out[b, h, li] = (w / w.sum()) @ vv
    return out


CASES = [  # B, Hq, Hk, L, D, Dv, C, pos, window, span
    (2, 4, 2, 1, 64, 64, 40, [5, 30], None, 32),
    (2, 4, 4, 3, 80, 48, 19, [3, 37], 16, 19),  # ring wrapped on row 1, 3 query tokens
    (3, 6, 2, 1, 32, 32, 8, [0, 7, 21], 6, 8),  # a window smaller than its ring
    (1, 2, 1, 2, 32, 32, 64, [150], 48, 64),  # a wrapped ring read in 4 parts
    (1, 4, 1, 1, 512, 512, 64, [40], None, 64),  # Gemma 4's wide global heads, 4 parts
]


@pytest.mark.parametrize("case", CASES)
def test_reference_is_attention_over_the_slots_positions(case):
    B, Hq, Hk, L, D, Dv, C, pos, window, span = case
    q, k, v, p = _case(B, Hq, Hk, L, D, Dv, C, pos, 1)
    got = da.decode_attention_reference(q, k, v, p, 0.3, span, window)
    np.testing.assert_allclose(np.array(got), _brute(q, k, v, pos, 0.3, span, window),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


def test_bad_shapes_raise():
    q, k, v, p = _case(1, 3, 2, 1, 16, 16, 8, [2], 1)
    with pytest.raises(ValueError):
        da.decode_attention(q, k, v, p, 1.0, 8)  # 3 query heads over 2 KV heads
    q, k, v, p = _case(1, 2, 2, 1, 16, 16, 8, [2], 1)
    with pytest.raises(ValueError):
        da.decode_attention(q, k, v, p, 1.0, 9)  # span past the buffer


def _errors(got, ref32, ref_lo):
    """(kernel error, same-dtype reference error) against the fp32 reference, max abs."""
    r = np.array(ref32, np.float64)
    g = np.array(got.astype(mx.float32), np.float64)
    lo = np.array(ref_lo.astype(mx.float32), np.float64)
    return np.abs(g - r).max(), np.abs(lo - r).max()


def _check(case, dtype):
    B, Hq, Hk, L, D, Dv, C, pos, window, span = case
    q, k, v, p = _case(B, Hq, Hk, L, D, Dv, C, pos, 7, dtype)
    got = da.decode_attention(q, k, v, p, 0.25, span, window)
    # heads merged as the output projection reads them (one token per row: the kernel writes
    # that shape itself): the same values moved, bit for bit
    merged = da.decode_attention(q, k, v, p, 0.25, span, window, merge_heads=True)
    assert merged.shape == (B, L, Hq * Dv)
    assert mx.array_equal(merged, got.transpose(0, 2, 1, 3).reshape(B, L, -1)).item()
    f32 = [a.astype(mx.float32) for a in (q, k, v)]
    ref32 = da.decode_attention_reference(*f32, p, 0.25, span, window)
    if dtype == mx.float32:
        # fp32 math in both; the online softmax sums in another order: ~1e-6
        np.testing.assert_allclose(np.array(got), np.array(ref32), rtol=1e-5, atol=1e-5)
        return
    err, ref_err = _errors(
        got, ref32, da.decode_attention_reference(q, k, v, p, 0.25, span, window)
    )
    assert err <= 2 * ref_err + 1e-6, (err, ref_err)  # no worse than twice the dtype's own


@needs_gxx
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("groups", [1, 4096])  # one part per row; the span split in parts
def test_emulated_kernel_matches_reference(monkeypatch, case, dtype, groups):
    emu = emulate(monkeypatch, da, "_kernel")
    monkeypatch.setattr(da, "TARGET_GROUPS", groups)
    da._plan.cache_clear()
    try:
        _check(case, dtype)
    finally:
        da._plan.cache_clear()
    parts, _ = da.split(case[1], case[-1])
    assert parts > 1 or groups == 1 or case[-1] < 32  # case 0 runs split in two parts
    # two calls (heads apart, heads merged), one launch each: a split row's last part merges
    assert emu["_kernel"].launches == 2


def _shared_kv_matches_one_head_per_group(monkeypatch, cases, dtype):
    """Each case twice: one query head per threadgroup, then G heads of a KV head sharing each
    key and value read (HF2Q_ATTN_SHARED_KV, every call): the same bits."""
    for case in cases:
        B, Hq, Hk, L, D, Dv, C, pos, window, span = case
        q, k, v, p = _case(B, Hq, Hk, L, D, Dv, C, pos, 13, dtype)
        outs = []
        for shared in (False, True):
            monkeypatch.setattr(da, "SHARED_KV", shared)
            monkeypatch.setattr(da, "SHARED_KV_MIN_ROWS", 1)
            da._plan.cache_clear()
            assert da.heads_per_group(Hq // Hk, B * Hq * L, D, Dv) == (
                1 if not shared else max(g for g in range(1, Hq // Hk + 1) if (Hq // Hk) % g == 0
                                         and g * (-(-D // 32) + -(-Dv // 32)) <= 64)
            )  # fmt: skip
            outs.append(da.decode_attention(q, k, v, p, 0.25, span, window))
        da._plan.cache_clear()
        a, b = (np.array(o.astype(mx.float32)) for o in outs)
        assert np.array_equal(a, b, equal_nan=True), case


@needs_gxx
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("groups", [1, 4096])  # one part per row; the span split in parts
def test_emulated_shared_kv_heads_give_the_same_bits(monkeypatch, dtype, groups):
    emu = emulate(monkeypatch, da, "_kernel")
    monkeypatch.setattr(da, "TARGET_GROUPS", groups)
    cases = [c for c in CASES if c[1] > c[2]]  # several query heads per KV head
    _shared_kv_matches_one_head_per_group(monkeypatch, cases, dtype)
    assert emu["_kernel"].launches == 2 * len(cases)


# Gemma 4 26B-A4B's sliding and global layers at 8 rows, a Qwen 3.5 verify of 5 tokens
GPU_ROW_CASES = [
    (8, 16, 8, 1, 256, 256, 1024, [700, 5, 1023, 64, 300, 900, 2, 511], 1024, 1024),
    (8, 16, 2, 1, 512, 512, 2048, [900, 1500, 3, 2000, 40, 700, 1200, 1999], None, 2048),
    (2, 16, 2, 5, 256, 256, 4096, [10, 3000], None, 4096),
]


@requires_gpu
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_gpu_shared_kv_heads_give_the_same_bits(monkeypatch, dtype):
    """The same on the GPU at Gemma 4 26B-A4B's sliding and global shapes, 8 rows."""
    _shared_kv_matches_one_head_per_group(monkeypatch, GPU_ROW_CASES, dtype)


@requires_gpu
@pytest.mark.parametrize(
    "case",
    CASES + [
        (1, 16, 8, 1, 256, 256, 1024, [700], 1024, 1024),  # Gemma 4 26B sliding layer
        (2, 16, 2, 1, 512, 512, 2048, [900, 1500], None, 2048),  # its global layer
        (4, 16, 2, 5, 256, 256, 4096, [10, 300, 1000, 3000], None, 4096),  # Qwen 3.5, verify
    ],
)  # fmt: skip
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_gpu_kernel_matches_reference(case, dtype):
    da._plan.cache_clear()
    _check(case, dtype)


def _rows_alone_match(case, dtype):
    """Each (row, token) of a batched multi-token call has the bits it gets alone: one row, one
    token at its own position over the same buffers (slots written after it are masked)."""
    B, Hq, Hk, L, D, Dv, C, pos, window, span = case
    q, k, v, p = _case(B, Hq, Hk, L, D, Dv, C, pos, 11, dtype)
    got = da.decode_attention(q, k, v, p, 0.25, span, window)
    for b in range(B):
        for li in range(L):
            alone = da.decode_attention(
                q[b : b + 1, :, li : li + 1], k[b : b + 1], v[b : b + 1],
                mx.array([pos[b] + li], dtype=mx.int32), 0.25, span, window,
            )  # fmt: skip
            same = mx.array_equal(alone[0, :, 0], got[b, :, li]).item()
            assert same, f"{case}: row {b} token {li} differs from the row alone"


@needs_gxx
@pytest.mark.parametrize("case", [CASES[1], CASES[3]])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_emulated_rows_bit_identical_alone(monkeypatch, case, dtype):
    """Row parity: the span's split does not depend on the batch or tokens per row. A small
    target (8 threadgroups) makes a batch-dependent split pick other parts at these shapes."""
    emulate(monkeypatch, da, "_kernel")
    monkeypatch.setattr(da, "TARGET_GROUPS", 8)
    da._plan.cache_clear()
    try:
        _rows_alone_match(case, dtype)
    finally:
        da._plan.cache_clear()


@requires_gpu
@pytest.mark.parametrize(
    "case",
    [
        (4, 16, 2, 5, 256, 256, 4096, [10, 300, 1000, 3000], None, 4096),  # Qwen 3.5 verify
        (3, 16, 8, 4, 256, 256, 1024, [700, 2000, 5], 1020, 1024),  # Gemma 4 sliding, wrapped
        (8, 12, 2, 1, 128, 128, 2048, [1, 50, 400, 900, 1200, 1500, 1800, 2000], None, 2048),
    ],
)  # fmt: skip
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_gpu_rows_bit_identical_alone(case, dtype):
    """Row parity on the GPU at real shapes: batches of rows and verify tokens."""
    da._plan.cache_clear()
    _rows_alone_match(case, dtype)


def test_split_override_sets_the_mapping_within_its_caps(monkeypatch):
    monkeypatch.setattr(da, "SPLIT_OVERRIDE", "4,8")
    assert da.split(16, 1032, 256) == (4, 8)
    assert da.split(16, 40, 256) == (2, 8)  # at most span // 16 parts
    assert da.split(16, 1032, 512) == (4, 8)  # SIMD groups capped for wide heads: 8
    monkeypatch.setattr(da, "SPLIT_OVERRIDE", "4,16")
    assert da.split(16, 1032, 512) == (4, 8)
    for bad in ("4", "a,b", "0,8", "4,-1"):
        monkeypatch.setattr(da, "SPLIT_OVERRIDE", bad)
        with pytest.raises(InvalidArgumentError):
            da.split(16, 1032, 256)


@needs_gxx
@pytest.mark.parametrize("forced", ["4,8", "1,1", "32,2"])
def test_emulated_kernel_matches_reference_under_split_override(monkeypatch, forced):
    emulate(monkeypatch, da, "_kernel")
    monkeypatch.setattr(da, "SPLIT_OVERRIDE", forced)
    da._plan.cache_clear()
    try:
        for case in CASES:
            _check(case, mx.float32)
    finally:
        da._plan.cache_clear()


@requires_gpu
def test_gpu_split_rows_merge_in_the_last_part_call_after_call():
    """A split row's parts count in on a counter that the merging part zeroes: every call of a
    plan, past a full turn of its counter sets and twice through each, gives the first call's
    bits (a counter left non-zero would make no part merge and leave the output unwritten)."""
    da._plan.cache_clear()
    B, Hq, Hk, L, D, Dv, C, pos, window, span = (1, 16, 8, 1, 256, 256, 1024, [700], 1024, 1024)
    q, k, v, p = _case(B, Hq, Hk, L, D, Dv, C, pos, 3, mx.bfloat16)
    first = da.decode_attention(q, k, v, p, 0.25, span, window)
    mx.eval(first)
    sig = (q.dtype, k.dtype, v.dtype, p.dtype)
    plan = da._plan(da._kernel, da.backend(), q.shape, C, Dv, Hq // Hk, span, window, 0.25, sig)
    assert da.split(Hq, span, D)[0] > 1 and len(plan.sets) > 1
    for _ in range(2 * len(plan.sets) + 1):
        again = da.decode_attention(q, k, v, p, 0.25, span, window)
        assert mx.array_equal(again, first).item()
    assert not mx.any(plan.counter).item()
    da._plan.cache_clear()


# cases the contiguous-lane (vector load) mapping takes in 16-bit: D 128, 256, 512
VEC_CASES = [
    CASES[4],
    (2, 4, 2, 1, 128, 128, 40, [5, 33], 32, 40),  # a window over a wrapped ring, 8-byte loads
    (1, 4, 2, 2, 256, 256, 48, [60], 40, 48),  # two tokens, 16-byte loads
]


def _load_variants(monkeypatch, cases, dtype):
    """Each case under HF2Q_ATTN_LOADS "", "p", "v", "vp": two slots in flight give the bits of
    one at a time; the vector mapping is its own order of additions, within the dtype's bound
    of the reference (_check), and the same as the default where it does not apply."""
    for case in cases:
        B, Hq, Hk, L, D, Dv, C, pos, window, span = case
        q, k, v, p = _case(B, Hq, Hk, L, D, Dv, C, pos, 17, dtype)
        outs = {}
        for loads in ("", "p", "v", "vp"):
            monkeypatch.setattr(da, "LOADS_RAW", loads)
            da._plan.cache_clear()
            outs[loads] = np.array(
                da.decode_attention(q, k, v, p, 0.25, span, window).astype(mx.float32)
            )
            if loads == "vp":
                _check(case, dtype)
        assert np.array_equal(outs[""], outs["p"], equal_nan=True), case
        assert np.array_equal(outs["v"], outs["vp"], equal_nan=True), case
        if not da.vector_lanes(dtype, D, Dv, frozenset("v")):
            assert np.array_equal(outs[""], outs["v"], equal_nan=True), case
    da._plan.cache_clear()


@needs_gxx
@pytest.mark.parametrize(  # one part per row (1), the span split in parts (4096)
    "dtype, groups", [(mx.bfloat16, 1), (mx.bfloat16, 4096), (mx.float16, 4096), (mx.float32, 1)]
)
def test_emulated_load_variants(monkeypatch, dtype, groups):
    emulate(monkeypatch, da, "_kernel")
    monkeypatch.setattr(da, "TARGET_GROUPS", groups)
    _load_variants(monkeypatch, [CASES[1], *VEC_CASES], dtype)


@needs_gxx
def test_emulated_vector_rows_bit_identical_alone(monkeypatch):
    emulate(monkeypatch, da, "_kernel")
    monkeypatch.setattr(da, "TARGET_GROUPS", 8)
    monkeypatch.setattr(da, "LOADS_RAW", "vp")
    da._plan.cache_clear()
    try:
        _rows_alone_match(VEC_CASES[2], mx.bfloat16)
        _rows_alone_match((3, 4, 2, 1, 128, 128, 40, [5, 33, 39], 32, 40), mx.bfloat16)
    finally:
        da._plan.cache_clear()


def test_attention_load_flags():
    assert da.load_flags(" VP ") == frozenset("vp") and da.load_flags("") == frozenset()
    with pytest.raises(InvalidArgumentError):
        da.load_flags("x")
    v = frozenset("v")
    assert da.vector_lanes(mx.bfloat16, 256, 256, v) and da.vector_lanes(mx.float16, 128, 128, v)
    assert not da.vector_lanes(mx.float32, 256, 256, v)
    assert not da.vector_lanes(mx.bfloat16, 80, 80, v) and not da.vector_lanes(
        mx.bfloat16, 256, 128, v
    )
    assert not da.vector_lanes(mx.bfloat16, 256, 256, frozenset("p"))


@requires_gpu
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_gpu_load_variants(monkeypatch, dtype):
    """On the GPU at Gemma 4 26B-A4B's sliding / global and Qwen 3.5's full shapes, 8 rows."""
    cases = [*GPU_ROW_CASES, (4, 12, 2, 1, 128, 128, 2048, [1, 400, 1200, 2000], None, 2048)]
    _load_variants(monkeypatch, cases, dtype)
    monkeypatch.setattr(da, "LOADS_RAW", "vp")
    da._plan.cache_clear()
    try:
        _rows_alone_match(cases[2], dtype)
    finally:
        da._plan.cache_clear()


def test_virtual_groups_rule(monkeypatch):
    """VW follows the launch's size (the bits do not depend on it): none at one row of Gemma 4
    26B-A4B's sliding layer (256 threadgroups of 16 groups), VIRTUAL_MAX at 32 rows; a power of
    two dividing W; none where the parked values would not fit shared memory."""
    assert da.virtual_groups(256, 16, 1, 256) == 1
    assert da.virtual_groups(32 * 256, 16, 1, 256) == da.VIRTUAL_MAX == 4
    assert da.virtual_groups(8 * 256, 16, 1, 256) == 2
    assert da.virtual_groups(32 * 256, 6, 1, 256) == 2  # 6 groups: VW 2 divides, 4 does not
    assert da.virtual_groups(32 * 256, 16, 4, 256) == 1  # 4 heads' parked values: 64 KB
    monkeypatch.setattr(da, "VW_OVERRIDE", "1")
    assert da.virtual_groups(32 * 256, 16, 1, 256) == 1
    monkeypatch.setattr(da, "VW_OVERRIDE", "4")
    assert da.virtual_groups(256, 16, 1, 256) == 4
    monkeypatch.setattr(da, "VW_OVERRIDE", "x")
    with pytest.raises(InvalidArgumentError):
        da.virtual_groups(256, 16, 1, 256)


def _virtual_groups_match(monkeypatch, cases, dtype, vws=(2, 4, 8)):
    """Each case with every SIMD group physical (VW 1) and with W / VW physical groups taking
    VW virtual ones each: the same bits (a wrong parked index or merge order fails)."""
    for case in cases:
        B, Hq, Hk, L, D, Dv, C, pos, window, span = case
        q, k, v, p = _case(B, Hq, Hk, L, D, Dv, C, pos, 19, dtype)
        _, warps = da.split(Hq, span, max(D, Dv))
        outs = {}
        for vw in (1, *vws):
            monkeypatch.setattr(da, "VW_OVERRIDE", str(vw))
            da._plan.cache_clear()
            if vw > 1 and da.virtual_groups(1, warps, 1, Dv) != vw:
                continue  # W = warps not a multiple of vw
            outs[vw] = np.array(
                da.decode_attention(q, k, v, p, 0.25, span, window).astype(mx.float32)
            )
        assert len(outs) > 1, (case, warps)
        for vw, got in outs.items():
            assert np.array_equal(outs[1], got, equal_nan=True), (case, vw)
        _check(case, dtype)  # under the last VW: within the dtype's bound of the reference
    da._plan.cache_clear()


@needs_gxx
@pytest.mark.parametrize(  # one part per row (1), the span split in parts (4096)
    "dtype, groups", [(mx.float32, 1), (mx.float32, 4096), (mx.bfloat16, 4096)]
)
def test_emulated_virtual_groups_give_the_same_bits(monkeypatch, dtype, groups):
    emu = emulate(monkeypatch, da, "_kernel")
    monkeypatch.setattr(da, "TARGET_GROUPS", groups)
    cases = [c for c in CASES if da.split(c[1], c[-1], max(c[4], c[5]))[1] % 2 == 0]
    assert len(cases) >= 3
    _virtual_groups_match(monkeypatch, cases, dtype)
    assert emu["_kernel"].launches > 2 * len(cases)


@requires_gpu
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_gpu_virtual_groups_give_the_same_bits(monkeypatch, dtype):
    """On the GPU at Gemma 4 26B-A4B's sliding / global and Qwen 3.5's verify shapes, 8 rows
    (the compiler may contract the products differently in the two loops: only a GPU shows)."""
    _virtual_groups_match(monkeypatch, GPU_ROW_CASES, dtype)
