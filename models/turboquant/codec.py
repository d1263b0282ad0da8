"""TurboQuant codec for KV vectors: randomized Hadamard rotation, Lloyd-Max codes, bit packing.

A head vector x (dim d) is stored as one row of uint32 words: its rotated unit vector's
coordinates quantized with a Lloyd-Max codebook for N(0, 1) and bit-packed, then one word holding
the vector's scale as fp32 bits (about ||x||, set so that the decoded vector's projection on x is
exactly ||x||: scores q . k come out unbiased). The rotation is ``H @ diag(signs)`` with H the
orthonormal Sylvester Walsh-Hadamard matrix and ±1 signs drawn from a per-layer seed; it makes
every coordinate of ``sqrt(P) * R x / ||x||`` close to N(0, 1) whatever the input's outliers, so
one fixed codebook fits all heads and tokens. A dim that is not a power of two is zero-padded to
the next one (P >= d): the rotation stays orthonormal, at the cost of storing P codes instead of
d. ``key_balance`` / ``value_balance`` calibrate exact per-channel scales and ``key_mean`` an
exact key offset, which the caches apply around the codec (``state.TQBalance``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property, lru_cache
from statistics import NormalDist

import mlx.core as mx
import numpy as np

from hf2q_mlx.custom_kernels.graph_ops import table_lookup
from hf2q_mlx.errors import Hf2qError

SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
_SQRT2 = math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _gauss_pdf(t: np.ndarray) -> np.ndarray:
    return np.exp(-0.5 * t * t) * _INV_SQRT_2PI


def _gauss_cdf(t: np.ndarray) -> np.ndarray:
    return np.array([0.5 * (1.0 + math.erf(v / _SQRT2)) for v in t.tolist()])


def _lloyd_step(c: np.ndarray):
    """One Lloyd iteration on the positive half of a symmetric codebook.

    Returns (new centroids, cell edges, cell masses): each cell [t_i, t_i+1) gets its conditional
    mean E[X | cell] = (pdf(t_i) - pdf(t_i+1)) / (cdf(t_i+1) - cdf(t_i)).
    """
    t = np.concatenate([[0.0], 0.5 * (c[:-1] + c[1:]), [np.inf]])
    pdf, cdf = _gauss_pdf(t), _gauss_cdf(t)
    mass = cdf[1:] - cdf[:-1]
    return (pdf[:-1] - pdf[1:]) / mass, t, mass


@lru_cache(maxsize=None)
def _lloyd_max_half(bits: int) -> np.ndarray:
    """Positive half (ascending, float64) of the 2**bits-level Lloyd-Max codebook for N(0, 1).

    Solves the Lloyd fixed point c = g(c) by Newton's method on c - g(c) (the plain iteration
    needs ~60k steps at 8 bits), then polishes with plain Lloyd steps. The start is the
    high-resolution optimum: points spread like N(0, 3) quantiles (density ~ pdf^(1/3)).
    """
    half = 1 << (bits - 1)
    nd = NormalDist()
    c = np.array([math.sqrt(3.0) * nd.inv_cdf(0.5 + (i + 0.5) / (2 * half)) for i in range(half)])
    for _ in range(50):
        g, t, mass = _lloyd_step(c)
        # d g_i / d t: cell i moves with its lower edge t_i (i > 0) and upper edge t_i+1 (finite)
        pdf = _gauss_pdf(t)
        d_lo = pdf[:-1] * (g - t[:-1]) / mass
        t_hi = np.where(np.isfinite(t[1:]), t[1:], 0.0)  # the last cell's edge is +inf: no term
        d_hi = np.where(np.isfinite(t[1:]), pdf[1:] * (t_hi - g) / mass, 0.0)
        jac = np.zeros((half, half))  # d g / d c, each edge t_j (0 < j < half) = (c_j-1 + c_j) / 2
        for i in range(half):
            if i > 0:
                jac[i, i - 1] += 0.5 * d_lo[i]
                jac[i, i] += 0.5 * d_lo[i]
            if i < half - 1:
                jac[i, i] += 0.5 * d_hi[i]
                jac[i, i + 1] += 0.5 * d_hi[i]
        step = np.linalg.solve(np.eye(half) - jac, g - c)
        c = c + step
        if np.max(np.abs(step)) < 1e-13:
            break
    for _ in range(3):
        c, _, _ = _lloyd_step(c)
    return c


def lloyd_max_gaussian(bits: int) -> tuple[np.ndarray, np.ndarray]:
    """(codebook (2**bits,), boundaries (2**bits - 1,)) ascending float64 for N(0, 1)."""
    if bits not in SUPPORTED_BITS:
        raise Hf2qError(f"TurboQuant supports {SUPPORTED_BITS} bits, not {bits}")
    h = _lloyd_max_half(bits)
    cb = np.concatenate([-h[::-1], h])
    return cb, 0.5 * (cb[:-1] + cb[1:])


def tf32_round(x: np.ndarray) -> np.ndarray:
    """fp32 values rounded to tf32 (10 stored mantissa bits; half away from zero), as the
    kernels' ``tf32_round``."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


def lloyd_max_distortion(bits: int) -> float:
    """Mean squared error per coordinate of the Lloyd-Max quantizer on N(0, 1)."""
    c = _lloyd_max_half(bits)
    _, _, mass = _lloyd_step(c)
    # at the centroid condition E[(X - Q(X))^2] = E[X^2] - E[Q(X)^2]
    return float(1.0 - 2.0 * np.sum(mass * c * c))


def fwht(x: mx.array) -> mx.array:
    """Orthonormal Walsh-Hadamard transform over the last axis (a power of two), in fp32.

    Sylvester order, so ``fwht(fwht(x)) == x`` and ``fwht(x) == x @ H / sqrt(n)``.
    """
    return mx.hadamard_transform(x.astype(mx.float32))


def rotation_signs(dim: int, seed: int) -> mx.array:
    """±1 (dim,) fp32 from ``seed``: numpy's PCG64 so every device and run gets the same signs."""
    bits = np.random.default_rng(seed).integers(0, 2, size=dim)
    return mx.array((1 - 2 * bits).astype(np.float32))


def pack_bits(codes: mx.array, bits: int) -> mx.array:
    """codes (..., n) with values < 2**bits -> (..., ceil(n * bits / 32)) uint32.

    One little-endian bit stream: code i occupies stream bits [i*bits, (i+1)*bits), stream bit j
    is bit j % 32 of word j // 32; a code may straddle two words (3, 5, 6 bits).
    """
    n = codes.shape[-1]
    lead = codes.shape[:-1]
    n_words = (n * bits + 31) // 32
    groups = (n + 31) // 32  # 32 codes fill exactly `bits` words
    c = codes.astype(mx.uint32)
    if groups * 32 != n:
        c = mx.pad(c, [(0, 0)] * len(lead) + [(0, groups * 32 - n)])
    c = c.reshape(*lead, groups, 32, 1)
    # left shift of code i inside word w of its group: i*bits - 32*w, negative = high part
    rel = np.arange(32)[:, None] * bits - 32 * np.arange(bits)[None, :]  # (32, bits)
    low = (rel >= 0) & (rel < 32)
    high = (rel < 0) & (rel > -bits)
    shl = mx.array(np.where(low, rel, 0).astype(np.uint32))
    shr = mx.array(np.where(high, -rel, 0).astype(np.uint32))
    part = mx.where(mx.array(low), mx.left_shift(c, shl), 0) + mx.where(
        mx.array(high), mx.right_shift(c, shr), 0
    )
    # bit fields never overlap, so the sum is an OR
    words = mx.sum(part.astype(mx.uint32), axis=-2).astype(mx.uint32)  # (..., groups, bits)
    return words.reshape(*lead, groups * bits)[..., :n_words]


def unpack_bits(words: mx.array, bits: int, n: int) -> mx.array:
    """Inverse of ``pack_bits``: (..., ceil(n * bits / 32)) uint32 -> (..., n) uint32 codes."""
    lead = words.shape[:-1]
    groups = (n + 31) // 32
    w = words.astype(mx.uint32)
    if w.shape[-1] != groups * bits:
        w = mx.pad(w, [(0, 0)] * len(lead) + [(0, groups * bits - w.shape[-1])])
    w = w.reshape(*lead, groups, bits)
    off = np.arange(32) * bits
    lo, sh = off // 32, off % 32
    straddle = sh + bits > 32
    hi = np.minimum(lo + 1, bits - 1)
    w_lo, w_hi = _take_runs(w, lo), _take_runs(w, hi)
    low_part = mx.right_shift(w_lo, mx.array(sh.astype(np.uint32)))
    high_shift = mx.array(np.where(straddle, 32 - sh, 0).astype(np.uint32))
    high_part = mx.where(mx.array(straddle), mx.left_shift(w_hi, high_shift), 0)
    mask = mx.array(np.uint32((1 << bits) - 1))
    codes = mx.bitwise_and(low_part.astype(mx.uint32) | high_part.astype(mx.uint32), mask)
    return codes.reshape(*lead, groups * 32)[..., :n]


def _take_runs(w: mx.array, idx: np.ndarray) -> mx.array:
    """``mx.take(w, idx, axis=-1)`` for a non-decreasing constant ``idx``, as slices broadcast
    over each run of equal entries (no gather: MLX's CUDA back end JIT-compiles its gathers at a
    machine's first use). The same values."""
    starts = [0, *(np.flatnonzero(np.diff(idx)) + 1), len(idx)]
    parts = [
        mx.broadcast_to(w[..., int(idx[a]) : int(idx[a]) + 1], (*w.shape[:-1], int(b - a)))
        for a, b in zip(starts[:-1], starts[1:])
    ]
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)


def search_codes(u: mx.array, boundaries: mx.array, bits: int) -> mx.array:
    """Index of the codebook cell holding each u: count of boundaries strictly below u, uint32.

    A branch-free binary search (``bits`` gathers); kernels run the same comparisons.
    """
    idx = mx.zeros(u.shape, dtype=mx.uint32)
    for k in range(bits - 1, -1, -1):
        cand = idx + (1 << k)
        idx = mx.where(u > table_lookup(boundaries, cand - 1), cand, idx)
    return idx


@dataclass(frozen=True)
class TQCodec:
    """Quantizer for head vectors of size ``dim`` at ``bits`` bits, rotation from ``seed``.

    Packed row layout (uint32, ``row_words`` long): ``code_words`` words of bit-packed codes for
    the ``padded_dim`` rotated coordinates, then the scale as fp32 bits (``quantize``).
    """

    dim: int
    bits: int
    seed: int = 0

    def __post_init__(self):
        if self.bits not in SUPPORTED_BITS:
            raise Hf2qError(f"TurboQuant supports {SUPPORTED_BITS} bits, not {self.bits}")
        if not 1 <= self.dim <= 8192:
            raise Hf2qError(f"TurboQuant head dim must be in 1..8192, got {self.dim}")

    @property
    def padded_dim(self) -> int:
        return max(32, 1 << (self.dim - 1).bit_length())

    @property
    def code_words(self) -> int:
        return self.padded_dim * self.bits // 32

    @property
    def row_words(self) -> int:
        return self.code_words + 1

    @cached_property
    def signs(self) -> mx.array:
        return rotation_signs(self.padded_dim, self.seed)

    @cached_property
    def codebook(self) -> mx.array:
        """The centroids at tf32 precision (11 significant bits, half an ulp at most 2^-11 of a
        centroid, a small part of a cell at 8 bits), so tensor cores take them exactly
        (``custom_kernels/tq_flash_tc``); the boundaries stay the float64 codebook's midpoints,
        so the codes are those of the exact centroids."""
        return mx.array(tf32_round(lloyd_max_gaussian(self.bits)[0].astype(np.float32)))

    @cached_property
    def boundaries(self) -> mx.array:
        return mx.array(lloyd_max_gaussian(self.bits)[1].astype(np.float32))

    def rotate(self, x: mx.array) -> mx.array:
        """(..., dim) -> (..., padded_dim) fp32: R x = H (signs * x)."""
        x = x.astype(mx.float32)
        if self.padded_dim != self.dim:
            x = mx.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, self.padded_dim - self.dim)])
        return fwht(x * self.signs)

    def unrotate(self, y: mx.array) -> mx.array:
        """(..., padded_dim) -> (..., dim) fp32: R^T y = signs * H y."""
        return (fwht(y) * self.signs)[..., : self.dim]

    def quantize(self, x: mx.array) -> mx.array:
        """x (..., dim) float -> packed rows (..., row_words) uint32.

        u = sqrt(P) R x / ||x|| gets codes c = Q(u); the stored scale is ||x|| P / sum(c u), so
        that the decoded ``R^T c * scale / sqrt(P)`` has projection exactly ||x|| on x.
        """
        y = self.rotate(x)  # (..., P)
        norm = mx.sqrt(mx.sum(y * y, axis=-1, keepdims=True))
        # a zero vector gets codes of 0.0 and norm 0, so it decodes to zeros
        u = y * (math.sqrt(self.padded_dim) / mx.maximum(norm, 1e-30))
        codes = search_codes(u, self.boundaries, self.bits)
        words = pack_bits(codes, self.bits)
        # the stored scale makes x_hat . x = ||x||^2: Lloyd-Max codes shrink a vector by about
        # 1 - D(b) on average (E[Q(u) u] = E[Q(u)^2] = 1 - D), which would scale every score
        # q . k and attention output by that much; this way the error is orthogonal to x
        dot = mx.sum(table_lookup(self.codebook, codes) * u, axis=-1, keepdims=True)
        scale = mx.where(dot > 0, norm * (self.padded_dim / mx.maximum(dot, 1e-30)), 0.0)
        return mx.concatenate([words, scale.view(mx.uint32)], axis=-1)

    def split(self, rows: mx.array) -> tuple[mx.array, mx.array]:
        """Packed rows -> (code words (..., code_words) uint32, scales (...,) fp32)."""
        return rows[..., : self.code_words], rows[..., self.code_words].view(mx.float32)

    def dequantize_rotated(self, rows: mx.array) -> mx.array:
        """Packed rows -> the rotated vectors R x_hat (..., padded_dim) fp32."""
        words, scales = self.split(rows)
        codes = unpack_bits(words, self.bits, self.padded_dim)
        scale = scales * (1.0 / math.sqrt(self.padded_dim))
        return table_lookup(self.codebook, codes) * scale[..., None]

    def dequantize(self, rows: mx.array, dtype: mx.Dtype = mx.float32) -> mx.array:
        """Packed rows (..., row_words) uint32 -> (..., dim) in ``dtype``."""
        return self.unrotate(self.dequantize_rotated(rows)).astype(dtype)

    def bytes_per_vector(self) -> int:
        return 4 * self.row_words


# ---- channel balancing (exact transforms around the codec, calibrated once per layer) ---------

# weight, in tokens, of the flat prior the channel statistics shrink towards: a one-token first
# write gets nearly flat scales (no change), a long prompt its measured ones
BALANCE_PRIOR_TOKENS = 16


def _pair_mean(e: mx.array, rope_dims: int | None) -> mx.array:
    """Average (..., D) energies over RoPE pairs: channels i and i + r/2 for i < r/2 (r =
    ``rope_dims``, default D; MLX's non-interleaved rope); channels >= r stay as they are.

    A RoPE pair's energy does not depend on the position, so scales constant on pairs stay right
    at positions the calibration never saw.
    """
    D = e.shape[-1]
    r = D if rope_dims is None else min(rope_dims, D)
    h = r // 2
    if h == 0:
        return e
    m = 0.5 * (e[..., :h] + e[..., h : 2 * h])
    return mx.concatenate([m, m, e[..., 2 * h :]], axis=-1)


def _shrunk(e: mx.array, n: int) -> mx.array:
    """Per-channel energies (..., D) from n tokens, shrunk towards their channel mean."""
    flat = mx.mean(e, axis=-1, keepdims=True)
    return (n * e + BALANCE_PRIOR_TOKENS * flat) / (n + BALANCE_PRIOR_TOKENS)


def _unit_rms(s: mx.array) -> mx.array:
    return s * mx.rsqrt(mx.mean(s * s, axis=-1, keepdims=True))


def key_balance(keys: mx.array, queries: mx.array, rope_dims: int | None = None) -> mx.array:
    """Per-channel key scales s (Hkv, D) fp32: the cache stores k / s and attention uses q * s.

    q . k = (q * s) . (k / s) for any positive s. The codec's error is isotropic with a size
    proportional to the stored vector, so the score error variance goes like
    sum_i E[q_i^2] s_i^2 * sum_i E[k_i^2] / s_i^2, smallest at s_i^2 = sqrt(E[k_i^2] / E[q_i^2]).
    keys (B, Hkv, L, D) and queries (B, Hq, L', D) after RoPE; energies averaged over RoPE pairs
    (see ``_pair_mean``) and over each KV head's group of query heads.
    """
    B, Hkv, L, D = keys.shape
    Bq, Hq, Lq, _ = queries.shape
    k = keys.astype(mx.float32)
    q = queries.astype(mx.float32).reshape(Bq, Hkv, Hq // Hkv, Lq, D)
    ek = _shrunk(_pair_mean(mx.mean(k * k, axis=(0, 2)), rope_dims), B * L)
    eq = _shrunk(_pair_mean(mx.mean(q * q, axis=(0, 2, 3)), rope_dims), Bq * Lq)
    # tiny floor: an all-zero head gets s = 1
    return _unit_rms(mx.power((ek + 1e-30) / (eq + 1e-30), 0.25))


# positions a key offset is chosen to hold for (``key_mean``)
CENTER_CONTEXT = 32768


def key_mean(
    keys: mx.array,
    rope_dims: int | None = None,
    rope_freqs: mx.array | None = None,
    context: int = CENTER_CONTEXT,
) -> mx.array | None:
    """Key offset mu (Hkv, D) fp32: the cache stores k - mu, exact for attention (every score of
    a query moves by the same q . mu, which the softmax cancels).

    The codec's error is proportional to the stored vector's norm, and keys share a large common
    part (Gemma 3 270M: ||mean||^2 is 30-70 % of E||k||^2 over the first 512 positions), so
    removing it shrinks the error. But the offset is fixed and the keys are post-RoPE: the mean
    of a RoPE pair turning at w radians per position is a vector turning with it, and a fixed
    offset left in such a pair adds energy once the pair has turned by more than about a radian
    (measured: the plain mean of positions 0-511 made the error at 3072-4095 larger than no offset
    in every sliding layer of Gemma 3). So the offset is the first write's mean only in the
    channels RoPE leaves alone (>= ``rope_dims``) and in the pairs with w * context < 1
    (``rope_freqs``: (rope_dims / 2,) radians per position, positions scale included; None =
    unknown, no pair kept). Shrunk towards zero like the energies (``BALANCE_PRIOR_TOKENS``).
    keys (B, Hkv, L, D) after RoPE. None when no channel is kept (nothing to subtract).
    """
    B, H, L, D = keys.shape
    h = (D if rope_dims is None else min(rope_dims, D)) // 2
    if rope_freqs is None:
        slow = np.zeros(h, dtype=bool)
    else:
        slow = np.array(rope_freqs[:h].astype(mx.float32)) * context < 1.0
    keep = np.concatenate([slow, slow, np.ones(D - 2 * h, dtype=bool)])
    if not keep.any():
        return None
    mu = mx.sum(keys.astype(mx.float32), axis=(0, 2)) / (B * L + BALANCE_PRIOR_TOKENS)
    return mx.where(mx.array(keep), mu, 0.0)


def value_balance(values: mx.array) -> mx.array:
    """Per-channel value scales t (Hkv, D) fp32: the cache stores v / t, attention outputs are
    multiplied by t (exact: the output is linear in the values).

    The output error variance goes like sum_i t_i^2 * sum_i E[v_i^2] / t_i^2, smallest at
    t_i^2 = sqrt(E[v_i^2]). (Centring the values on their mean, also exact since attention
    weights sum to one, measured no better on Gemma 3: the attention-sink token's value is
    nearly zero, and centring gives it the mean's size where the attention mass is largest.)
    """
    B, H, L, D = values.shape
    v = values.astype(mx.float32)
    ev = _shrunk(mx.mean(v * v, axis=(0, 2)), B * L)
    return _unit_rms(mx.power(ev + 1e-30, 0.25))
