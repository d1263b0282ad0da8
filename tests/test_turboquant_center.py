"""TurboQuant key offset (``TQBalance.k_mean``) and per-layer bit widths, CPU only."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from test_turboquant import assert_logits_track_full, tiny_gemma3

from hf2q_mlx.errors import Hf2qError
from hf2q_mlx.models.attention import attend
from hf2q_mlx.models.cache import KVCache, RotatingKVCache
from hf2q_mlx.models.turboquant.cache import (
    TQKVCache,
    TQRotatingKVCache,
    make_tq_cache,
    model_rope_freqs,
    to_tq_cache,
)
from hf2q_mlx.models.turboquant.codec import BALANCE_PRIOR_TOKENS, key_balance, key_mean
from hf2q_mlx.models.turboquant.state import TQBalance


def _biased(rng: np.random.Generator, *shape, mean: float) -> mx.array:
    """Gaussian vectors plus one common vector of RMS ``mean`` per head (a key bias)."""
    common = mean * rng.standard_normal((shape[1], 1, shape[-1]))
    return mx.array((rng.standard_normal(shape) + common).astype(np.float32))


def test_key_mean_keeps_unrotated_channels_and_slow_pairs():
    """The offset is the shrunk mean in the channels past rope_dims and in the RoPE pairs
    (i, i + r/2) turning by less than a radian over the context; zero in the other pairs, and in
    every pair when the frequencies are unknown."""
    rng = np.random.default_rng(0)
    k = _biased(rng, 2, 3, 40, 64, mean=2.0)
    want = np.array(k).astype(np.float64).sum(axis=(0, 2)) / (80 + BALANCE_PRIOR_TOKENS)
    freqs = np.array([1.0, 0.1, 1e-3, 1e-6] + [0.0] * 12, np.float32)  # 16 pairs of 32 channels
    mu = np.array(key_mean(k, 32, mx.array(freqs), context=1000))
    assert mu.shape == (3, 64) and mu.dtype == np.float32
    slow = np.tile(freqs * 1000 < 1, 2)  # 1e-3 turns by exactly one radian: dropped
    keep = np.concatenate([slow, np.ones(32, bool)])
    np.testing.assert_allclose(mu[:, keep], want[:, keep], rtol=1e-5, atol=1e-6)
    assert not mu[:, ~keep].any() and keep.sum() == 32 + 2 * 13
    unknown = np.array(key_mean(k, 32))
    assert not unknown[:, :32].any()
    np.testing.assert_allclose(unknown[:, 32:], want[:, 32:], rtol=1e-5, atol=1e-6)
    # nothing kept: no offset at all (no subtraction on the write path)
    assert key_mean(k) is None and key_mean(k, 32, mx.array(freqs), context=10**7) is not None
    assert key_mean(k, None, mx.full((32,), 0.01), context=1000) is None
    # one token: barely centred (1 / 17 of its key)
    one = k[:1, :, :1]
    np.testing.assert_allclose(np.array(key_mean(one, 0)), np.array(one[0, :, 0]) / 17, rtol=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_key_mean_holds_at_far_positions_better_than_the_plain_mean(seed):
    """Keys with a constant pre-RoPE bias in the pairs turning slower than 3e-3 rad/position,
    RoPE'd at base 1e5: calibrated on positions 0-255, the stored energy E||k - mu||^2 at
    positions 4096-8191. The plain mean (every pair kept) has turned away in the middle pairs,
    which cancels what it saves in the slow ones (measured 0.87-1.10x the raw energy, seeds
    0-4); the offset for an 8192-position context keeps only the 12 pairs that stay put
    (0.74-0.79x)."""
    rng = np.random.default_rng(seed)
    D, base = 64, 1e5
    freqs = (base ** (-np.arange(D // 2) / (D // 2))).astype(np.float32)
    bias = 2.0 * rng.standard_normal(D).astype(np.float32) * np.tile(freqs < 3e-3, 2)
    pre = rng.standard_normal((1, 1, 8192, D)).astype(np.float32) + bias
    k = mx.fast.rope(mx.array(pre), D, traditional=False, base=base, scale=1.0, offset=0)
    first, far = k[:, :, :256], k[:, :, 4096:]

    def energy(mu):
        return mx.mean(mx.sum((far - mu[:, None, :]) ** 2, axis=-1)).item()

    raw = energy(mx.zeros((1, D)))
    plain = energy(key_mean(first, D, mx.zeros((D // 2,))))  # every pair kept
    aware = energy(key_mean(first, D, mx.array(freqs), context=8192))
    assert aware < 0.85 * raw, (aware, raw)
    assert aware < plain - 0.05 * raw, (aware, plain, raw)


@pytest.mark.parametrize("window", [None, 7])
def test_offset_and_scales_leave_attention_exact_without_codec(window):
    """With the codec bypassed, attention over what the cache would store, (k - mu) / s with
    queries q * s and outputs * t (the flash-decode path: no mean term), equals plain attention
    over k, v; the fetched keys k_out(k_in(k)) equal k. Causal and sliding-window masks."""
    rng = np.random.default_rng(1)
    B, Hq, Hkv, L, D = 2, 6, 2, 23, 64
    q = _biased(rng, B, Hq, L, D, mean=1.0)
    k = _biased(rng, B, Hkv, L, D, mean=4.0)
    v = _biased(rng, B, Hkv, L, D, mean=1.0)
    bal = TQBalance()
    bal.set(k_scale=key_balance(k, q), k_mean=key_mean(k, rope_dims=0))  # no RoPE: all kept
    bal.set(v_scale=mx.array(rng.uniform(0.5, 2.0, (Hkv, D)).astype(np.float32)))
    assert np.abs(np.array(bal.k_mean)).max() > 1.0  # a real offset: scores move by q . mu
    pos = np.arange(L)
    ok = pos[None, :] <= pos[:, None]
    if window is not None:
        ok &= pos[None, :] > pos[:, None] - window
    mask = mx.array(ok)
    exact = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    stored_k, stored_v = bal.keys_in(k), bal.values_in(v)
    out = mx.fast.scaled_dot_product_attention(
        bal.queries_in(q), stored_k, stored_v, scale=0.125, mask=mask
    )
    out = bal.output_out(out)
    # scores up to ~40 in magnitude before the shift: fp32 rounding of the logits
    np.testing.assert_allclose(np.array(out), np.array(exact), rtol=0, atol=2e-4)
    np.testing.assert_allclose(np.array(bal.keys_out(stored_k)), np.array(k), atol=2e-5)


def _stored_and_score_error(center: bool, seed: int) -> tuple[float, float]:
    """(mean stored key norm / mean key norm, relative score error) of a TQ4 cache on keys with
    a common part: 400 tokens calibrate, 200 fresh tokens of the same law are measured."""
    rng = np.random.default_rng(seed)
    D, bias = 64, 3.0 * rng.standard_normal(64).astype(np.float32)
    k = mx.array(rng.standard_normal((1, 1, 600, D)).astype(np.float32) + bias)
    q = mx.array(rng.standard_normal((1, 4, 600, D)).astype(np.float32))
    v = mx.array(rng.standard_normal((1, 1, 600, D)).astype(np.float32))
    # keys without RoPE: every pair "turns" at 0 radians per position, so all keep their mean
    c = TQKVCache(4, 4, seed=seed, center=center, rope_freqs=mx.zeros((D // 2,)))
    kq, vq, mask = c.update_and_fetch(k[:, :, :400], v[:, :, :400])
    attend(q[:, :, :400], kq, vq, c, 0.125, mask)  # calibrates
    c.update_and_fetch(k[:, :, 400:], v[:, :, 400:])
    st = c.packed_state()
    kn = k[:, :, 400:]
    stored = st.balance.keys_in(kn) * st.balance.k_scale[:, None, :]  # undo the scale only
    norm_ratio = mx.linalg.norm(stored, axis=-1).mean() / mx.linalg.norm(kn, axis=-1).mean()
    kh = st.balance.keys_out(st.k_codec.dequantize(st.keys[:, :, 400:600]))
    qn = q[:, :, 400:]
    err = mx.linalg.norm(qn @ (kh - kn).swapaxes(-1, -2)) / mx.linalg.norm(qn @ kn.swapaxes(-1, -2))
    return norm_ratio.item(), err.item()


def test_centering_shrinks_stored_keys_and_score_error():
    """Keys = N(0, I) + a common vector of RMS 3: centring leaves the stored norms about
    sqrt(D / (D + 9 D)) = 0.32 of the keys' (measured 0.30-0.36 for seeds 1-3), and the codec's
    score error shrinks with them, a little less (0.39-0.46x): the key scales come from the raw
    keys' energies, which RoPE leaves in place, not the centred ones."""
    for seed in (1, 2):
        n_off, e_off = _stored_and_score_error(False, seed)
        n_on, e_on = _stored_and_score_error(True, seed)
        assert n_off == pytest.approx(1.0, abs=1e-5)
        assert n_on < 0.4 * n_off, (n_on, n_off)
        assert e_on < 0.55 * e_off, (e_on, e_off)


def test_center_switch_and_balance_off():
    rng = np.random.default_rng(3)
    k, v = _biased(rng, 1, 2, 9, 64, mean=2.0), _biased(rng, 1, 2, 9, 64, mean=2.0)
    q = _biased(rng, 1, 4, 9, 64, mean=1.0)
    still = mx.zeros((32,))  # pairs that never turn: every channel keeps its mean
    for center, want in ((True, True), (False, False)):
        c = TQRotatingKVCache(8, 4, 4, reserve=1, center=center, rope_freqs=still)
        kq, vq, mask = c.update_and_fetch(k, v)
        attend(q, kq, vq, c, 0.125, mask)
        assert (c.tq_balance.k_mean is not None) == want
        assert c.tq_balance.k_scale is not None
    off = TQKVCache(4, 4, balance=False, rope_freqs=still)  # no balance: no offset either
    kq, vq, mask = off.update_and_fetch(k, v)
    attend(q, kq, vq, off, 0.125, mask)
    assert off.tq_balance.k_mean is None and off.tq_balance.k_scale is None


def test_layer_bits_per_layer_widths():
    cache = [RotatingKVCache(16), KVCache(), RotatingKVCache(16, 2), KVCache()]
    out = to_tq_cache(cache, 4, layer_bits=[(8, 6), None, (3, 5)])
    assert [(c.k_bits, c.v_bits) for c in out] == [(8, 6), (4, 4), (3, 5), (4, 4)]
    assert out[2].capacity == 18 and [c.seed for c in out] == [0, 1, 2, 3]
    with pytest.raises(Hf2qError):
        to_tq_cache([KVCache()], 4, layer_bits=[(7, 4)])


def test_make_tq_cache_layer_bits_on_tiny_gemma3():
    model = tiny_gemma3()
    cache = make_tq_cache(model, 6, layer_bits=[None, (8, 8)], center=True)
    assert [(c.k_bits, c.v_bits) for c in cache] == [(6, 6), (8, 8), (6, 6)]
    assert_logits_track_full(model, cache, 16, 11)
    # the offset keeps the pairs turning by < 1 rad in CENTER_CONTEXT positions: none at the
    # sliding layers' base 1e4, the 7 slowest of 32 at the global layer's 1e6 (w < 1 / 32768)
    freqs = model_rope_freqs(model)
    np.testing.assert_allclose(np.array(freqs[1]), 1e6 ** (-np.arange(32) / 32), rtol=1e-5)
    np.testing.assert_allclose(np.array(freqs[0]), 1e4 ** (-np.arange(32) / 32), rtol=1e-5)
    assert cache[0].tq_balance.k_mean is None and cache[2].tq_balance.k_mean is None
    kept = np.abs(np.array(cache[1].tq_balance.k_mean)).sum(0) > 0
    np.testing.assert_array_equal(kept, np.tile(np.arange(32) >= 25, 2))
