"""TurboQuant codec, caches and the flash-decode reference (CPU; kernels in tests/kernels)."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from hf2q_mlx.errors import Hf2qError
from hf2q_mlx.models.attention import attend
from hf2q_mlx.models.cache import KVCache, RotatingKVCache
from hf2q_mlx.models.turboquant.cache import (
    TQKVCache,
    TQPacked,
    TQRotatingKVCache,
    make_tq_cache,
    to_tq_cache,
)
from hf2q_mlx.models.turboquant.codec import (
    SUPPORTED_BITS,
    TQCodec,
    fwht,
    key_balance,
    lloyd_max_distortion,
    lloyd_max_gaussian,
    pack_bits,
    rotation_signs,
    unpack_bits,
    value_balance,
)
from hf2q_mlx.models.turboquant.kernels import tq_attention_oracle, tq_flash_decode_reference

# fp32 attention through different but equivalent orders of summation
ATOL = 2e-5


def _normal(rng: np.random.Generator, *shape) -> mx.array:
    return mx.array(rng.standard_normal(shape).astype(np.float32))


# ---- Lloyd-Max codebooks ----


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_lloyd_max_codebook_is_optimal(bits):
    cb, bnd = lloyd_max_gaussian(bits)
    assert cb.shape == (1 << bits,) and bnd.shape == ((1 << bits) - 1,)
    assert np.all(np.diff(cb) > 0) and np.allclose(cb, -cb[::-1], rtol=0, atol=1e-15)
    # both Lloyd conditions, checked by Simpson integration over each cell (independent of the
    # closed forms used to build the codebook): boundaries are midpoints (by construction) and
    # each level is its cell's conditional mean
    edges = np.concatenate([[-12.0], bnd, [12.0]])
    n = 2001  # odd: Simpson weights 1, 4, 2, ..., 4, 1
    simpson = np.ones(n)
    simpson[1:-1:2], simpson[2:-1:2] = 4.0, 2.0
    x = edges[:-1, None] + (edges[1:] - edges[:-1])[:, None] * np.linspace(0, 1, n)  # (cells, n)
    w = simpson * (edges[1:] - edges[:-1])[:, None] / (3 * (n - 1))
    w = w * np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    mean = (w * x).sum(-1) / w.sum(-1)
    np.testing.assert_allclose(mean, cb, rtol=0, atol=1e-9)
    mse = np.sum(w * (x - cb[:, None]) ** 2)
    assert abs(mse - lloyd_max_distortion(bits)) < 1e-9


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_codec_centroids_are_tf32_and_codes_unchanged(bits):
    """The codec's centroids are the Lloyd-Max levels rounded to tf32 (10 stored mantissa bits,
    what the tensor-core flash-decode reads exactly), at most half a tf32 ulp away, each still
    inside its cell; the boundaries are the exact levels' midpoints, so codes do not move."""
    cb, bnd = lloyd_max_gaussian(bits)
    codec = TQCodec(64, bits, seed=0)
    got = np.array(codec.codebook)
    assert np.all((got.view(np.uint32) & 0x1FFF) == 0)
    np.testing.assert_allclose(got, cb, rtol=2.0**-11, atol=0)
    assert np.any(got != cb.astype(np.float32))  # rounded, not the fp32 levels
    edges = np.concatenate([[-np.inf], bnd, [np.inf]])
    assert np.all((got > edges[:-1]) & (got < edges[1:]))
    np.testing.assert_array_equal(np.array(codec.boundaries), bnd.astype(np.float32))


def test_lloyd_max_distortion_matches_published_values():
    # Max (1960), Gaussian, 4 significant digits (his 4-bit entry 0.009497 is 4e-4 relative low)
    for bits, d in ((2, 0.1175), (3, 0.03454), (4, 0.009497)):
        assert abs(lloyd_max_distortion(bits) / d - 1) < 1e-3
    # high-resolution limit (Panter-Dite): sqrt(3) pi / 2 * 4^-b, approached from below
    pd = math.sqrt(3) * math.pi / 2 * 4.0**-8
    assert 0.98 < lloyd_max_distortion(8) / pd < 1.0


# ---- rotation ----


def _sylvester(n: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


@pytest.mark.parametrize("n", [32, 64, 256, 512])
def test_fwht_is_orthonormal_sylvester_and_self_inverse(n):
    rng = np.random.default_rng(n)
    x = rng.standard_normal((5, n)).astype(np.float32)
    y = np.array(fwht(mx.array(x)))
    # fp32 transform of O(1) values vs a float64 matrix product
    np.testing.assert_allclose(y, x @ _sylvester(n) / math.sqrt(n), rtol=0, atol=1e-5)
    h = np.array(fwht(mx.eye(n)))
    np.testing.assert_allclose(h @ h.T, np.eye(n), rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.array(fwht(mx.array(y))), x, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dim", [64, 80, 256, 512])
def test_codec_rotation_round_trip(dim):
    codec = TQCodec(dim, 4, seed=11)
    assert codec.padded_dim == 1 << (dim - 1).bit_length()
    x = _normal(np.random.default_rng(dim), 7, dim)
    y = codec.rotate(x)
    # orthonormal: norms kept, and the inverse gives x back (fp32 rounding only)
    np.testing.assert_allclose(
        np.linalg.norm(np.array(y), axis=-1), np.linalg.norm(np.array(x), axis=-1), rtol=1e-5
    )
    np.testing.assert_allclose(np.array(codec.unrotate(y)), np.array(x), rtol=0, atol=1e-5)


def test_rotation_signs_are_seeded():
    a, b = np.array(rotation_signs(256, 1)), np.array(rotation_signs(256, 2))
    assert set(np.unique(a)) == {-1.0, 1.0}
    assert np.array_equal(a, np.array(rotation_signs(256, 1)))
    assert not np.array_equal(a, b)
    assert 80 < (a > 0).sum() < 176  # balanced: binomial(256, 1/2) is 128 +- 8


# ---- bit packing ----


def _pack_numpy(codes: np.ndarray, bits: int) -> np.ndarray:
    """The documented layout, bit by bit: code i at stream bits [i*bits, ...), LSB first."""
    n = codes.shape[-1]
    stream = ((codes[..., :, None] >> np.arange(bits)) & 1).reshape(*codes.shape[:-1], n * bits)
    n_words = (n * bits + 31) // 32
    stream = np.concatenate(
        [stream, np.zeros((*codes.shape[:-1], n_words * 32 - n * bits), np.int64)], axis=-1
    )
    stream = stream.reshape(*codes.shape[:-1], n_words, 32).astype(np.uint64)
    return (stream << np.arange(32, dtype=np.uint64)).sum(-1).astype(np.uint32)


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
@pytest.mark.parametrize("n", [1, 5, 31, 32, 33, 97, 256, 515])
def test_pack_round_trip_bit_exact(bits, n):
    rng = np.random.default_rng(1000 * bits + n)
    codes = rng.integers(0, 1 << bits, size=(3, 2, n)).astype(np.uint32)
    words = pack_bits(mx.array(codes), bits)
    assert words.dtype == mx.uint32 and words.shape == (3, 2, (n * bits + 31) // 32)
    np.testing.assert_array_equal(np.array(words), _pack_numpy(codes.astype(np.int64), bits))
    np.testing.assert_array_equal(np.array(unpack_bits(words, bits, n)), codes)


# ---- codec ----


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
@pytest.mark.parametrize("dim", [64, 256, 512])
def test_codec_mse_matches_lloyd_max(bits, dim):
    rng = np.random.default_rng(bits * dim)
    x = rng.standard_normal((1500, dim)).astype(np.float32)
    codec = TQCodec(dim, bits, seed=5)

    def rel_mse(x):
        rows = codec.quantize(mx.array(x))
        assert rows.shape == (len(x), codec.row_words) and rows.dtype == mx.uint32
        xh = np.array(codec.dequantize(rows))
        rel = np.sum((x - xh) ** 2, axis=-1) / np.sum(x * x, axis=-1)
        return rel.mean() / lloyd_max_distortion(bits), rows

    # ||x - x_hat||^2 / ||x||^2 is the per-coordinate MSE of sqrt(d) * (unit vector): Lloyd-Max's
    # D(b) with the norm stored, D / (1 - D) with the unbiased scale (x_hat = x + an orthogonal
    # error; the scale grows by 1 / (1 - D) and the error with it); the exact coordinate law
    # (Beta, lighter tails than the Gaussian) gives 4-8% less at d = 64 (1-2% at 256, 512), and
    # 1500 * d samples estimate the mean to about 1%
    dist = lloyd_max_distortion(bits)
    ratio, rows = rel_mse(x)
    ratio *= 1 - dist
    assert 0.90 < ratio < 1.03, ratio
    # outlier channels (as in real keys): after a Hadamard rotation the coordinates are a few
    # large +- terms, less Gaussian but more concentrated, so the error is not larger
    x_out = x.copy()
    x_out[:, :3] *= 20.0
    assert rel_mse(x_out)[0] * (1 - dist) < 1.03
    # the stored scale makes the projection of x_hat on x exactly ||x||^2 (no shrinkage of
    # q . k towards 0 by 1 - D); only fp32 rounding of sums over d terms remains
    xh = np.array(codec.dequantize(rows)).astype(np.float64)
    proj = np.sum(xh * x, axis=-1) / np.sum(x.astype(np.float64) ** 2, axis=-1)
    np.testing.assert_allclose(proj, 1.0, rtol=1e-5)


def test_codec_scores_unbiased():
    """E[q . x_hat] = q . x for queries independent of the rotation: the error is orthogonal to
    x and isotropic in the rest. 2 bits (D = 0.1175) makes the old 1 - D shrinkage obvious."""
    rng = np.random.default_rng(11)
    d, n = 128, 4000
    x = rng.standard_normal((n, d)).astype(np.float32)
    q = (x + 0.5 * rng.standard_normal((n, d))).astype(np.float32)  # correlated with x
    codec = TQCodec(d, 2, seed=4)
    xh = np.array(codec.dequantize(codec.quantize(mx.array(x)))).astype(np.float64)
    ratio = np.sum(q * xh) / np.sum(q * x.astype(np.float64))
    # the orthogonal error's share of q . x_hat averages out over 4000 vectors to ~0.3%
    assert abs(ratio - 1) < 0.015, ratio


def test_codec_zero_vector_low_precision_inputs_and_padding():
    codec = TQCodec(96, 4, seed=0)  # padded to 128
    assert codec.padded_dim == 128 and codec.row_words == 128 * 4 // 32 + 1
    x = _normal(np.random.default_rng(3), 4, 96)
    x = mx.concatenate([x, mx.zeros((1, 96))])
    out = np.array(codec.dequantize(codec.quantize(x)))
    assert np.all(out[-1] == 0.0)
    rel = np.sum((np.array(x[:4]) - out[:4]) ** 2, -1) / np.sum(np.array(x[:4]) ** 2, -1)
    assert rel.max() < 0.05  # 4 bits: D = 0.0095 on average
    # the padded dim is as exact as a power of two: x_hat . x = ||x||^2 up to fp32 sums (a scale
    # formed with the unpadded 96 instead of 128 is 13 % off here and passes the check above)
    x64 = np.array(x[:4]).astype(np.float64)
    proj = np.sum(out[:4] * x64, axis=-1) / np.sum(x64**2, axis=-1)
    np.testing.assert_allclose(proj, 1.0, rtol=1e-5)
    for dt in (mx.float16, mx.bfloat16):
        y = codec.dequantize(codec.quantize(x.astype(dt)), dt)
        assert y.dtype == dt
        # quantizing the rounded input: same codes up to rare boundary flips
        err = mx.abs(y.astype(mx.float32) - mx.array(out)).max().item()
        assert err < 0.5


def test_codec_rejects_bad_settings():
    with pytest.raises(Hf2qError):
        TQCodec(128, 7)
    with pytest.raises(Hf2qError):
        TQCodec(0, 4)
    with pytest.raises(Hf2qError):
        TQKVCache(4, 1)


# ---- caches ----


def _roundtrip(codec: TQCodec, x: mx.array) -> mx.array:
    return codec.dequantize(codec.quantize(x), x.dtype)


def _cache_roundtrip(tq, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
    """What the cache stores for k, v, mapped back: balance in, codec round trip, balance out."""
    b = tq.tq_balance
    kr = b.keys_out(tq.k_codec.dequantize(tq.k_codec.quantize(b.keys_in(k)))).astype(k.dtype)
    vr = b.values_out(tq.v_codec.dequantize(tq.v_codec.quantize(b.values_in(v))))
    return kr, vr.astype(v.dtype)


def _skewed(rng: np.random.Generator, *shape, spread: float = 8.0, mean: float = 0.0):
    """Gaussian vectors whose channel scales span ``spread`` (log-uniform), plus a common mean."""
    scales = np.exp(rng.uniform(-0.5, 0.5, shape[-1]) * np.log(spread)).astype(np.float32)
    x = rng.standard_normal(shape).astype(np.float32) * scales + mean * rng.standard_normal(
        shape[-1]
    ).astype(np.float32)
    return mx.array(x)


CACHE_CASES = [
    # (name, factory of (TQ cache, plain cache), write lengths): decode steps, short drafts,
    # odd chunks, a chunk longer than the ring, wrap-around several times
    ("growing", lambda: (TQKVCache(4, 3, seed=1), KVCache()), [5, 1, 1, 7, 1, 3, 300, 1, 2, 1]),
    (
        "ring",
        lambda: (TQRotatingKVCache(16, 4, 3, seed=1, reserve=3), RotatingKVCache(16, 3)),
        [5, 1, 1, 7, 1, 1, 1, 3, 1, 20, 1, 2, 4, 1, 1],
    ),
    (
        "ring-long-first-write",  # the calibrated re-write of a first write longer than the ring
        lambda: (TQRotatingKVCache(8, 4, 4, seed=3, reserve=1), RotatingKVCache(8, 1)),
        [21, 1, 1, 2, 1, 1, 1, 5, 1, 1],
    ),
    (
        "ring-no-reserve",
        lambda: (TQRotatingKVCache(8, 8, 5, seed=2), RotatingKVCache(8)),
        [3, 1, 9, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2],
    ),
]


@pytest.mark.parametrize("name,factory,lengths", CACHE_CASES, ids=[c[0] for c in CACHE_CASES])
def test_tq_cache_matches_plain_cache_of_dequantized_vectors(name, factory, lengths):
    """attend() on a TQ cache == sdpa on a plain cache fed the quantize-dequantize round trip."""
    rng = np.random.default_rng(7)
    B, Hq, Hkv, D = 2, 4, 2, 64
    tq, ref = factory()
    for i, L in enumerate(lengths):
        q, k, v = (_skewed(rng, B, h, L, D, mean=0.5) for h in (Hq, Hkv, Hkv))
        kq, vq, mask = tq.update_and_fetch(k, v)
        if tq.needs_calibration:
            # what attend() does right after the first write (scales non-trivial from here on)
            assert i == 0
            kq, vq, mask = tq.calibrate(q)
            assert tq.tq_balance.k_scale is not None and tq.tq_balance.v_scale is not None
        kr, vr, mask_r = ref.update_and_fetch(*_cache_roundtrip(tq, k, v))
        if isinstance(kq, TQPacked):
            # a step the flash-decode kernel covers fetches nothing
            assert i > 0 and tq.can_flash(L) and vq is kq and mask is None
            assert kq.state.offset == tq.offset
        else:
            # fetched tensors are the dequantized history, bit for bit
            assert i == 0 or not tq.can_flash(L)
            np.testing.assert_array_equal(np.array(kq), np.array(kr))
            np.testing.assert_array_equal(np.array(vq), np.array(vr))
            assert (mask is None) == (mask_r is None)
            if mask is not None:
                np.testing.assert_array_equal(np.array(mask), np.array(mask_r))
        out = attend(q, kq, vq, tq, 0.125, mask)
        want = mx.fast.scaled_dot_product_attention(q, kr, vr, scale=0.125, mask=mask_r)
        np.testing.assert_allclose(np.array(out), np.array(want), rtol=0, atol=ATOL)
        assert tq.offset == ref.offset
        if i == 6:
            # roll back like a rejected draft, within the reserve
            n = min(2, tq.capacity - tq.window + 1) if name.startswith("ring") else 2
            assert tq.trim(n) == ref.trim(n) == n


def _balance_numpy(k: np.ndarray, q: np.ndarray, rope_dims: int | None, prior: float = 16.0):
    """key_balance written out in numpy: pair-averaged, shrunk energies -> (ek / eq) ** 0.25."""
    B, Hkv, L, D = k.shape
    q = q.reshape(B, Hkv, -1, q.shape[2], D)
    ek, eq = (k**2).mean(axis=(0, 2)), (q**2).mean(axis=(0, 2, 3))
    r = D if rope_dims is None else rope_dims
    for e in (ek, eq):
        for i in range(r // 2):
            e[:, i] = e[:, i + r // 2] = 0.5 * (e[:, i] + e[:, i + r // 2])
    n = B * L
    ek = (n * ek + prior * ek.mean(-1, keepdims=True)) / (n + prior)
    eq = (n * eq + prior * eq.mean(-1, keepdims=True)) / (n + prior)
    s = (ek / eq) ** 0.25
    return s / np.sqrt((s**2).mean(-1, keepdims=True))


@pytest.mark.parametrize("rope_dims", [None, 16])
def test_key_balance_matches_closed_form_and_is_constant_on_rope_pairs(rope_dims):
    rng = np.random.default_rng(5)
    k, q = _skewed(rng, 2, 2, 50, 64), _skewed(rng, 2, 6, 50, 64)
    s = np.array(key_balance(k, q, rope_dims))
    want = _balance_numpy(np.array(k), np.array(q), rope_dims)
    # fp32 means of ~100 squares against float64-ish numpy of the same fp32 data
    np.testing.assert_allclose(s, want, rtol=1e-4)
    r = 64 if rope_dims is None else rope_dims
    np.testing.assert_array_equal(s[:, : r // 2], s[:, r // 2 : r])  # scales commute with RoPE
    assert s.std() > 0.1  # not flat: the inputs' channels differ
    # one token: the flat prior dominates, scales stay near 1
    s1 = np.array(key_balance(k[:, :, :1], q[:, :, :1], rope_dims))
    assert np.abs(np.log(s1)).max() < np.abs(np.log(s)).max()


def test_value_balance_closed_form():
    rng = np.random.default_rng(6)
    v = _skewed(rng, 3, 2, 40, 32, mean=2.0)
    scale = value_balance(v)
    e = (np.array(v).astype(np.float64) ** 2).mean(axis=(0, 2))
    e = (120 * e + 16 * e.mean(-1, keepdims=True)) / (120 + 16)
    t = e**0.25 / np.sqrt((e**0.5).mean(-1, keepdims=True))
    np.testing.assert_allclose(np.array(scale), t, rtol=1e-4)


def _score_and_output_errors(balance: bool, seed: int) -> tuple[float, float]:
    """Relative errors of scores q.k and attention outputs, TQ4 cache vs exact, on fresh data
    whose queries and keys put their energy in different channels, values uneven channels."""
    rng = np.random.default_rng(seed)
    D, L = 64, 400
    # k energy rises over the channels, q energy falls; equal on RoPE pairs (i, i + D/2)
    ch = np.tile(np.exp(np.linspace(-1.5, 1.5, D // 2)), 2).astype(np.float32)
    k = mx.array(rng.standard_normal((1, 1, L, D)).astype(np.float32) * ch)
    q = mx.array(rng.standard_normal((1, 4, L, D)).astype(np.float32) / ch)
    v = mx.array(rng.standard_normal((1, 1, L, D)).astype(np.float32) * ch**2)
    c = TQKVCache(4, 4, seed=seed, balance=balance)
    kq, vq, mask = c.update_and_fetch(k, v)
    out = attend(q, kq, vq, c, 0.125, mask)
    st = c.packed_state()
    kh = st.balance.keys_out(st.k_codec.dequantize(st.keys[:, :, :L]))
    err_s = mx.linalg.norm(q @ (kh - k).swapaxes(-1, -2)) / mx.linalg.norm(q @ k.swapaxes(-1, -2))
    exact = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    err_o = mx.linalg.norm(out - exact) / mx.linalg.norm(exact)
    return err_s.item(), err_o.item()


def test_balance_cuts_score_and_output_error():
    """The calibrated scales shrink the errors as predicted. Scores: with E[k_i^2] = c_i^2 and
    E[q_i^2] = 1 / c_i^2 the error variance ratio is sum(c^2) sum(c^-2) / D^2 (about 12 here,
    so the error norm about 3.5x). Outputs: the value error alone, with E[v_i^2] = c_i^4, has
    the ratio D sum(c^4) / sum(c^2)^2 (about 3.1, error norm about 1.8x); the smaller score
    errors cut the output error further (measured about 3x in norm)."""
    c2 = np.exp(np.linspace(-3.0, 3.0, 32))
    pred_s = np.sqrt(c2.sum() * (1 / c2).sum() / 32**2)
    pred_o = np.sqrt(32 * (c2**2).sum() / c2.sum() ** 2)
    for seed in (1, 2):
        s_off, o_off = _score_and_output_errors(False, seed)
        s_on, o_on = _score_and_output_errors(True, seed)
        # scores measured 3.26-3.35 for seeds 1-3, about 0.9x the prediction: the flat prior
        # (16 tokens against 400) pulls the scales towards 1, and a ratio of two sampled errors
        # is noisy by a few %
        assert s_off / s_on > 0.75 * pred_s, (s_off, s_on, pred_s)
        assert o_off / o_on > 0.75 * pred_o, (o_off, o_on, pred_o)


def test_balance_without_attend_keeps_keys_unscaled():
    """A model that never calls attend(): the next write drops the pending calibration."""
    rng = np.random.default_rng(8)
    c = TQKVCache(4, 4)
    c.update_and_fetch(_skewed(rng, 1, 2, 9, 64), _skewed(rng, 1, 2, 9, 64))
    assert c.needs_calibration
    c.update_and_fetch(_skewed(rng, 1, 2, 1, 64), _skewed(rng, 1, 2, 1, 64))
    assert not c.needs_calibration and c.tq_balance.k_scale is None
    assert c.tq_balance.v_scale is not None
    off = TQKVCache(4, 4, balance=False)
    off.update_and_fetch(_skewed(rng, 1, 2, 9, 64), _skewed(rng, 1, 2, 9, 64))
    assert not off.needs_calibration and off.tq_balance.v_scale is None


def test_attend_placeholders_and_shared_kv():
    """The first write fetches tensors; a decode step fetches TQPacked, which the cache's
    attend() and a KV-sharing layer's (cache=None) run on the flash-decode kernel alike."""
    rng = np.random.default_rng(2)
    c = TQRotatingKVCache(16, 4, 4, reserve=1)
    k, v = _normal(rng, 1, 2, 20, 64), _normal(rng, 1, 2, 20, 64)
    kq, vq, mask = c.update_and_fetch(k, v)
    assert isinstance(kq, mx.array)
    q = _normal(rng, 1, 4, 20, 64)
    attend(q, kq, vq, c, 0.125, mask)
    k1, v1 = _normal(rng, 1, 2, 2, 64), _normal(rng, 1, 2, 2, 64)
    kq, vq, mask = c.update_and_fetch(k1, v1)
    assert isinstance(kq, TQPacked) and mask is None and c.offset == 22
    q1 = _normal(rng, 1, 4, 2, 64)
    own = attend(q1, kq, vq, c, 0.125, mask)
    shared = attend(q1, kq, vq, None, 0.125, mask)
    want = tq_attention_oracle(q1, c.packed_state(), 0.125)
    np.testing.assert_allclose(np.array(own), np.array(want), rtol=0, atol=ATOL)
    np.testing.assert_array_equal(np.array(shared), np.array(own))
    # 3 queries exceed reserve + 1: the dequantized path again
    kq, _, mask = c.update_and_fetch(*(_normal(rng, 1, 2, 3, 64) for _ in range(2)))
    assert isinstance(kq, mx.array) and mask.shape == (3, 17 + 3)


def _fetch_summary(fetched) -> tuple:
    """What update_and_fetch returned, as comparable host data."""
    k, v, mask = fetched
    if isinstance(k, TQPacked):
        st = k.state
        return ("packed", v is k, mask, st.offset, np.array(st.keys), np.array(st.values))
    m = None if mask is None else np.array(mask)
    return ("tensors", np.array(k), np.array(v), m)


@pytest.mark.parametrize("balance", [True, False])
@pytest.mark.parametrize("ring", [True, False])
def test_update_and_fetch_does_not_depend_on_earlier_attend(balance, ring):
    """Two caches get the same writes; one also runs attend() after each, the other only what
    attend() does to its state (the first write's calibration): every fetch is the same."""
    rng = np.random.default_rng(4)

    def make():
        if ring:
            return TQRotatingKVCache(8, 4, 4, seed=1, reserve=2, balance=balance)
        return TQKVCache(4, 4, seed=1, balance=balance)

    attended, fetched_only = make(), make()
    for L in [6, 1, 1, 2, 3, 1, 12, 1]:
        q, k, v = (_normal(rng, 1, h, L, 64) for h in (4, 2, 2))
        a = attended.update_and_fetch(k, v)
        b = fetched_only.update_and_fetch(k, v)
        if fetched_only.needs_calibration:
            fetched_only.calibrate(q)
        out = attend(q, *a[:2], attended, 0.125, a[2])
        for x, y in zip(_fetch_summary(a), _fetch_summary(b), strict=True):
            if isinstance(x, np.ndarray):
                np.testing.assert_array_equal(x, y)
            else:
                assert x == y
        # the decode steps the kernel covers come packed, whatever happened before
        first = fetched_only.offset == L
        assert (_fetch_summary(b)[0] == "packed") == (not first and L <= (3 if ring else 8))
        mx.eval(out)


def test_tq_cache_nbytes_and_state():
    c = TQRotatingKVCache(32, 4, 8, seed=0, reserve=2)
    assert c.nbytes == 0
    rng = np.random.default_rng(0)
    k, v = _normal(rng, 1, 2, 40, 256), _normal(rng, 1, 2, 40, 128)
    c.update_and_fetch(k, v)
    # per slot: 4-bit K codes (128 B) + norm, 8-bit V codes (128 B) + norm
    assert c.nbytes == 2 * 34 * (4 * (32 + 1) + 4 * (32 + 1))
    st = c.packed_state()
    assert st.n_slots == 34 and st.capacity == 34 and st.window == 32
    np.testing.assert_array_equal(
        np.array(st.slot_positions()), np.array(RotatingKVCache.slot_positions(c))
    )
    assert c.can_flash(1) and c.can_flash(3) and not c.can_flash(4)
    # a plain growing cache grows its packed rows in steps
    g = TQKVCache(4, 4)
    g.update_and_fetch(k, k)
    assert g.packed_state().capacity == 256 and g.packed_state().n_slots == 40


def test_ring_trim_beyond_reserve_raises():
    c = TQRotatingKVCache(4, 4, 4, reserve=1)
    rng = np.random.default_rng(1)
    for _ in range(9):
        c.update_and_fetch(_normal(rng, 1, 1, 1, 64), _normal(rng, 1, 1, 1, 64))
    with pytest.raises(Hf2qError):
        c.trim(3)
    assert c.trim(2) == 2


# ---- flash-decode reference vs dequantize + attention ----

FLASH_CASES = [
    # (Hq, Hkv, Dk, Dv, k_bits, v_bits, ring window or None, reserve, total tokens, M)
    (4, 1, 256, 256, 4, 4, 512, 0, 700, 1),  # Gemma 3 270M sliding layer, wrapped ring
    (8, 2, 512, 512, 8, 4, None, 0, 301, 1),  # Gemma 4 global layer shape, odd length
    (6, 2, 128, 128, 3, 5, None, 0, 77, 4),  # small-M draft verification
    (4, 4, 64, 96, 6, 2, 40, 5, 233, 6),  # MHA, Dv != Dk (padded), ring with reserve
]


@pytest.mark.parametrize("case", FLASH_CASES)
@pytest.mark.parametrize("n_parts", [1, 3, 7])
def test_flash_decode_reference_equals_oracle(case, n_parts):
    Hq, Hkv, Dk, Dv, kb, vb, window, reserve, total, M = case
    rng = np.random.default_rng(total + n_parts)
    B = 2
    cache = (
        TQKVCache(kb, vb, seed=3)
        if window is None
        else TQRotatingKVCache(window, kb, vb, seed=3, reserve=reserve)
    )
    # prefill then the M-query step
    cache.update_and_fetch(_normal(rng, B, Hkv, total - M, Dk), _normal(rng, B, Hkv, total - M, Dv))
    cache.update_and_fetch(_normal(rng, B, Hkv, M, Dk), _normal(rng, B, Hkv, M, Dv))
    assert cache.can_flash(M)
    st = cache.packed_state()
    q = _normal(rng, B, Hq, M, Dk) * 2.0
    out = tq_flash_decode_reference(q, st, Dk**-0.5, n_parts=n_parts)
    want = tq_attention_oracle(q, st, Dk**-0.5)
    assert out.shape == (B, Hq, M, Dv)
    np.testing.assert_allclose(np.array(out), np.array(want), rtol=0, atol=ATOL)


# ---- models ----


def tiny_gemma3():
    """A 3-layer Gemma 3 (sliding, global, sliding; window 8, head_dim 64), seeded weights."""
    from hf2q_mlx.models import gemma3

    args = gemma3.ModelArgs(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        query_pre_attn_scalar=64,
    )  # fmt: skip
    mx.random.seed(0)
    return gemma3.Model(args)


def assert_logits_track_full(model, cache, n_tokens: int, prefill: int) -> list:
    """A prefill of ``prefill`` tokens then one-token steps, through ``cache`` and a fresh
    full-precision cache side by side: logits within a small angle (cosine > 0.999) at every
    step. Returns the full-precision cache."""
    full = model.make_cache()
    ids = mx.array(np.random.default_rng(0).integers(0, 64, size=(1, n_tokens)), mx.int32)
    for x in [ids[:, :prefill]] + [ids[:, i : i + 1] for i in range(prefill, n_tokens)]:
        a, b = model(x, cache=cache), model(x, cache=full)
        cos = mx.sum(a * b, -1) / (mx.linalg.norm(a, axis=-1) * mx.linalg.norm(b, axis=-1))
        assert cos.min().item() > 0.999
    return full


def test_make_tq_cache_on_tiny_gemma3():
    model = tiny_gemma3()
    cache = make_tq_cache(model, 8, 6, reserve=2)
    assert [type(c).__name__ for c in cache] == [
        "TQRotatingKVCache", "TQKVCache", "TQRotatingKVCache"
    ]  # fmt: skip
    assert cache[0].capacity == 10 and cache[0].seed != cache[2].seed
    # 8-bit keys, 6-bit values: logits stay within a small angle of full precision
    full = assert_logits_track_full(model, cache, 20, 13)
    with pytest.raises(Hf2qError):
        to_tq_cache(full, 4)  # already used
    # attend() calibrated every layer's key scales at the first (13-token) write
    assert all(c.tq_balance.k_scale is not None and c.rope_dims is None for c in cache)


def test_make_tq_cache_on_tiny_qwen3_5_partial_rope():
    """Attention layers get the model's partial-RoPE width for their key-scale pairs; the
    recurrent layers' caches pass through; logits stay close to full precision."""
    from hf2q_mlx.models import qwen3_5

    args = qwen3_5.ModelArgs.from_dict(dict(
        vocab_size=96, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=6, rms_norm_eps=1e-5, intermediate_size=96,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0,
                         "partial_rotary_factor": 0.25},
        num_hidden_layers=4, full_attention_interval=3, tie_word_embeddings=False,
    ))  # fmt: skip
    mx.random.seed(1)
    model = qwen3_5.Model(args)
    cache = make_tq_cache(model, 8, 8)
    assert [type(c).__name__ for c in cache] == ["RecurrentCache"] * 2 + [
        "TQKVCache",
        "RecurrentCache",
    ]
    assert cache[2].rope_dims == 8  # 32 * 0.25
    full = model.make_cache()
    ids = mx.array(np.random.default_rng(1).integers(0, 96, size=(1, 16)), mx.int32)
    for x in [ids[:, :11]] + [ids[:, i : i + 1] for i in range(11, 16)]:
        a, b = model(x, cache=cache), model(x, cache=full)
        cos = mx.sum(a * b, -1) / (mx.linalg.norm(a, axis=-1) * mx.linalg.norm(b, axis=-1))
        assert cos.min().item() > 0.999  # 8-bit K and V
    k_scale = np.array(cache[2].tq_balance.k_scale)
    np.testing.assert_array_equal(k_scale[:, :4], k_scale[:, 4:8])  # RoPE pairs (i, i + 4)
