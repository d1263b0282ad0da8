"""Per-head RMSNorm then rotary embedding (rotate-half pairs) of q, k (and v), out (B, H, L, D)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx

from hf2q_mlx.custom_kernels import backend, device_array, device_constant
from hf2q_mlx.custom_kernels._render import Example, Kernel
from hf2q_mlx.errors import InvalidArgumentError, UnsupportedArchitectureError


@dataclass(frozen=True, eq=False)
class Heads:
    """Heads ``first .. first + count`` (each ``width`` values) of a projection's output ``data``
    (B, L, N), left unsplit: the kernel reads q, k and v in place from a fused q/k/v matmul, so
    the graph holds no reshape or split between the two. Stands where a (B, L, H, P) array does.
    """

    data: mx.array  # (B, L, N)
    first: int
    count: int
    width: int

    def __post_init__(self):
        shape = self.data.shape
        if len(shape) != 3 or self.width <= 0:
            raise InvalidArgumentError(f"heads of {self.width} values in a {shape} array")
        # heads of another width may share the output (Qwen 3.5's [query | gate] heads are two
        # head_dim-wide heads of k and v): values first * width .. (first + count) * width
        if self.first < 0 or self.count <= 0 or (self.first + self.count) * self.width > shape[-1]:
            raise InvalidArgumentError(
                f"heads {self.first}..{self.first + self.count} of {self.width} values outside "
                f"{shape[-1]}"
            )

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(B, L, H, P) of the array these heads stand for."""
        B, L, _ = self.data.shape
        return (B, L, self.count, self.width)

    @property
    def dtype(self) -> mx.Dtype:
        return self.data.dtype


def split_heads(xs) -> list:
    """Each ``Heads`` of ``xs`` as its (B, L, H, P) array (others as they are): one reshape and
    one split per projection output, as an unfused reader would take them."""
    out = list(xs)
    groups: dict[int, list[int]] = {}
    for i, x in enumerate(xs):
        if isinstance(x, Heads):
            groups.setdefault(id(x.data), []).append(i)
    for idx in groups.values():
        parts = sorted(idx, key=lambda i: xs[i].first)
        h0 = xs[parts[0]]
        ends = [xs[i].first + xs[i].count for i in parts]
        same = all(xs[i].width == h0.width for i in parts)
        whole = ends[-1] * h0.width == h0.data.shape[-1]
        if same and whole and [xs[i].first for i in parts] == [0, *ends[:-1]]:
            y = h0.data.reshape(*h0.shape[:2], -1, h0.width)  # (B, L, N / P, P)
            for i, piece in zip(parts, mx.split(y, ends[:-1], axis=2) if ends[:-1] else [y]):
                out[i] = piece
        else:  # overlapping, partial or of mixed widths: one slice each
            for i in parts:
                h = xs[i]
                flat = h.data[..., h.first * h.width : (h.first + h.count) * h.width]
                out[i] = flat.reshape(h.shape)  # (B, L, H, P)
    return out


def rope_inv_freq(dims: int, base: float) -> mx.array:
    """``base ** (-i / (dims / 2))`` for i < dims / 2, fp32, computed as ``mx.fast.rope`` does."""
    half = dims // 2
    log_step = mx.log(mx.array(base, dtype=mx.float32)) / half
    return mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * log_step)


def rope_config(params: dict | None, head_dim: int) -> tuple[int, mx.array]:
    """HF ``rope_parameters`` -> (rotated dims R, inverse frequencies (R / 2,) fp32).

    transformers' formulas: "default" / "linear" rotate the first ``partial_rotary_factor`` of the
    head with ``base ** (-2i / R)`` (linear divides by ``factor``); "proportional" (Gemma 4 global
    layers) pairs over the whole head with exponents over ``head_dim`` and gives the pairs past
    ``partial_rotary_factor`` a zero frequency (passed through), also divided by ``factor``.
    """
    params = params or {}
    kind = params.get("rope_type", params.get("type", "default"))
    base = float(params.get("rope_theta", 10_000.0))
    prf = float(params.get("partial_rotary_factor", 1.0))
    factor = float(params.get("factor", 1.0)) if kind != "default" else 1.0
    if kind in ("default", "linear"):
        R = int(head_dim * prf)
        inv = 1.0 / base ** (mx.arange(0, R, 2, dtype=mx.float32) / R)
    elif kind == "proportional":
        R, n_rot = head_dim, int(prf * head_dim // 2)
        inv = 1.0 / base ** (mx.arange(0, 2 * n_rot, 2, dtype=mx.float32) / head_dim)
        inv = mx.concatenate([inv, mx.zeros((head_dim // 2 - n_rot,), mx.float32)])
    else:
        raise UnsupportedArchitectureError(f"rope_type {kind!r} is not supported")
    return R, (inv / factor).astype(mx.float32)


def _positions(B: int, L: int, offset, positions) -> mx.array:
    """Absolute positions, int32 (1 or B, L)."""
    if positions is not None:
        p = positions.astype(mx.int32)
        return p.reshape(1, L) if p.ndim == 1 else p
    off = mx.array(offset, dtype=mx.int32) if not isinstance(offset, mx.array) else offset
    return off.astype(mx.int32).reshape(-1, 1) + mx.arange(L, dtype=mx.int32)


def rms_norm_rope_reference(
    x: mx.array,
    weight: mx.array | None,
    inv_freq: mx.array | None,
    *,
    eps: float,
    offset: int | mx.array = 0,
    positions: mx.array | None = None,
    scale: float = 1.0,
    weight_offset: float = 0.0,
    dims: int | None = None,
    transpose: bool = True,
    norm: bool = True,
) -> mx.array:
    """x (B, L, H, P) -> (B, H, L, D) (or (B, L, H, D)) in x.dtype, fp32 math in MLX ops.

    Uses the first ``D = dims or P`` values of each head: ``y = x * rsqrt(mean(x^2) + eps) *
    (weight + weight_offset)`` (``norm`` False: ``y = x``; ``weight`` None: no product), then the
    first ``R = 2 * len(inv_freq)`` dims rotate in pairs ``(i, i + R/2)`` by ``(position *
    scale) * inv_freq[i]`` (``mx.fast.rope``, traditional=False) and the rest pass through.
    Positions: ``offset`` (int, scalar or (B,) array) + arange(L), or ``positions`` (L,) / (B, L).
    """
    B, L, H, _ = x.shape
    D = dims or x.shape[-1]
    xf = x[..., :D].astype(mx.float32)
    y = xf * mx.rsqrt(mx.mean(xf * xf, axis=-1, keepdims=True) + eps) if norm else xf
    if weight is not None:
        y = y * (weight.astype(mx.float32) + weight_offset)
    if inv_freq is not None:
        half = inv_freq.shape[0]
        pos = _positions(B, L, offset, positions).astype(mx.float32) * scale
        theta = pos[..., None] * inv_freq  # (1 or B, L, R/2)
        c, s = mx.cos(theta)[:, :, None, :], mx.sin(theta)[:, :, None, :]
        y1, y2 = y[..., :half], y[..., half : 2 * half]
        y = mx.concatenate([y1 * c - y2 * s, y1 * s + y2 * c, y[..., 2 * half :]], axis=-1)
    y = y.astype(x.dtype)
    return y.transpose(0, 2, 1, 3) if transpose else y


# Template: T (activations), WT (weights), D (values per row). Everything else is a run-time
# value, so one build serves every model shape: params (int32) B, L, H0..H2 (heads per tensor,
# 0 = absent), P0..P2 (values per head in the input, >= D), R (rotated dims, 0 = none), ROPE (bit
# t: tensor t rotates), HASW (bit t: tensor t has a weight), POS (0 offset, 1 per-batch offsets,
# 2 positions (L,), 3 positions (B, L)), TRANS (write (B, H, L, D)), S0..S2 (values per token in
# input t: H * P, or N for ``Heads`` of a (B, L, N) output), O0..O2 (where tensor t's first head
# starts in a token: 0, or first * P), NORM (bit t: tensor t is normed, else only moved and
# laid out); fparams: eps, scale, w offset.
_HEADER = r"""
// sin / cos are not in the shared vocabulary yet. On CUDA the argument is told to be reduced
// (nr_reduce: |a| <= pi + a rounding): the same fast path, bit for bit, without the library's
// large-argument path, which made this the slowest unit to compile (0.41 -> 0.20 s at D 512)
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
FN float nr_sin(float a) { __builtin_assume(fabsf(a) <= 4.0f); return sinf(a); }
FN float nr_cos(float a) { __builtin_assume(fabsf(a) <= 4.0f); return cosf(a); }
FN float nr_rint(float a) { return rintf(a); }
#else
FN float nr_sin(float a) { return sin(a); }
FN float nr_cos(float a) { return cos(a); }
FN float nr_rint(float a) { return rint(a); }
#endif
// Reduce an angle to [-pi, pi] with 2 pi split in three parts (Cody-Waite): fast-math sin / cos
// (Metal's default) lose accuracy on large arguments, and angles reach ~10^5 rad at long context.
FN float nr_reduce(float a) {
  const float k = nr_rint(a * 0.15915494309189535f);
  a = fma_f(-k, 6.28125f, a);
  a = fma_f(-k, 1.9353071795864769e-3f, a);
  return fma_f(-k, 2.3406740737876e-11f, a);
}
"""

_BODY = """
  // One SIMD group per (tensor, batch, token, head) row of D values, 4 rows per threadgroup;
  // lane owns elements lane + 32 j. The norm is one SIMD sum; a RoPE partner (i +- R/2) comes
  // from the row's copy in shared memory, so any even R works.
  SHARED float rows[4 * D];
  const uint B = uint(params[0]);
  const uint L = uint(params[1]);
  const uint n0 = B * L * uint(params[2]);
  const uint n1 = B * L * uint(params[3]);
  const uint n2 = B * L * uint(params[4]);
  const uint R = uint(params[8]);
  const uint row = gid_x * 4 + simd_id;
  if (row >= n0 + n1 + n2) return;  // whole SIMD group: only SIMD barriers below
  const uint t = row < n0 ? 0u : (row < n0 + n1 ? 1u : 2u);
  const uint r = row - (t == 0 ? 0u : (t == 1 ? n0 : n0 + n1));
  const uint H = uint(params[2 + t]);
  const uint h = r % H;
  const uint l = (r / H) % L;
  const uint b = r / (H * L);
  // token (b, l) of input t starts S_t values in; the tensor's heads O_t values into it
  DEVICE_PTR(const T) src = (t == 0 ? x0 : (t == 1 ? x1 : x2)) +
                            uint64_t(r / H) * uint(params[13 + t]) + uint(params[16 + t]) +
                            uint64_t(h) * uint(params[5 + t]);

  float v[D / 32];
  float ss = 0.0f;
  UNROLL for (int j = 0; j < D / 32; ++j) {
    v[j] = to_float(src[lane + 32 * j]);
    ss = fma_f(v[j], v[j], ss);
  }
  const float sum = simd_sum(ss);  // every lane, whichever branch the row takes below
  const bool normed = ((params[19] >> t) & 1) != 0;
  const float inv = rsqrt_f(sum / float(D) + fparams[0]);
  const bool has_w = ((params[10] >> t) & 1) != 0;
  DEVICE_PTR(const WT) w = t == 0 ? w0 : (t == 1 ? w1 : w2);
  UNROLL for (int j = 0; j < D / 32; ++j) {
    if (normed) v[j] *= inv;  // else no arithmetic: an exact copy (flushing can't touch it)
    if (has_w) v[j] *= to_float(w[lane + 32 * j]) + fparams[2];
  }
  if (R > 0 && ((params[9] >> t) & 1) != 0) {
    SHARED_PTR(float) buf = rows + simd_id * uint(D);
    UNROLL for (int j = 0; j < D / 32; ++j) buf[lane + 32 * j] = v[j];
    SIMD_BARRIER();
    const int mode = params[11];
    int p;
    if (mode == 0) p = pos[0] + int(l);
    else if (mode == 1) p = pos[b] + int(l);
    else if (mode == 2) p = pos[l];
    else p = pos[b * L + l];
    const float tp = float(p) * fparams[1];
    UNROLL for (int j = 0; j < D / 32; ++j) {
      const uint e = lane + 32 * j;
      if (e < R) {
        const bool lo = e < R / 2;
        const float a = nr_reduce(tp * inv_freq[lo ? e : e - R / 2]);
        const float c = nr_cos(a);
        const float s = nr_sin(a);
        v[j] = lo ? v[j] * c - buf[e + R / 2] * s : buf[e - R / 2] * s + v[j] * c;
      }
    }
  }
  DEVICE_PTR(T) dst = t == 0 ? o0 : (t == 1 ? o1 : o2);
  uint64_t orow = params[12] ? uint64_t(b * H + h) * L + l : uint64_t(r);
  // cache mode (params[20] = C > 0, only in a recorded CUDA graph step): keys and values land
  // in their rows' slots of caches (B, H, C, D), in place; params[21]: a ring (slot mod C)
  const uint C = uint(params[20]);
  if (t > 0 && C > 0) {
    uint slot = uint(pos[B > 1u ? b : 0u]) + l;
    if (params[21] != 0) slot %= C;
    orow = uint64_t(b * H + h) * C + slot;
  }
  UNROLL for (int j = 0; j < D / 32; ++j) dst[orow * uint(D) + lane + 32 * j] = from_float<T>(v[j]);
"""


_kernel = Kernel(
    "rms_norm_rope",
    inputs=["x0", "x1", "x2", "w0", "w1", "w2", "inv_freq", "pos", "params", "fparams"],
    outputs=["o0", "o1", "o2"],
    body=_BODY,
    header=_HEADER,
    examples=[
        Example(
            {"x0": t, "x1": t, "x2": t, "w0": wt, "w1": wt, "w2": wt, "inv_freq": mx.float32,
             "pos": (mx.int32, 1), "params": (mx.int32, 22), "fparams": (mx.float32, 3)},
            {"o0": t, "o1": t, "o2": t},
            {"T": t, "WT": wt, "D": d},
        )
        for t, wt, d in ((mx.bfloat16, mx.bfloat16, 256), (mx.float16, mx.float32, 512),
                         (mx.float32, mx.float32, 128))
    ],
)  # fmt: skip

_FLOATS = (mx.float32, mx.float16, mx.bfloat16)


def _pos_key(offset, positions) -> tuple:
    """How positions arrive: ("p", shape, dtype) positions, ("o", shape, dtype) an offset array,
    ("i",) a Python int."""
    if positions is not None:
        return ("p", positions.shape, positions.dtype)
    if isinstance(offset, mx.array):
        return ("o", offset.shape, offset.dtype)
    return ("i",)


def _validate(shapes, wshapes, fshape, pkey, D) -> None:
    """Raise InvalidArgumentError (a ValueError) for caller errors (both paths; shapes only, so
    plans can cache it)."""
    for shape, w, name in zip(shapes, wshapes, ("q", "k", "v") if len(shapes) > 1 else ("x",)):
        if len(shape) != 4 or shape[-1] < D:
            raise InvalidArgumentError(f"{name} must be (B, L, H, >= {D}), got {shape}")
        if w is not None and w != (D,):
            raise InvalidArgumentError(f"{name} norm weight must be ({D},), got {w}")
    B, L = shapes[0][:2]
    if any(shape[:2] != (B, L) for shape in shapes):
        raise InvalidArgumentError(f"q, k, v disagree on (B, L): {shapes}")
    if fshape is None:
        return
    if len(fshape) != 1 or 2 * fshape[0] > D:
        raise InvalidArgumentError(f"inv_freq must be (R/2,) with R <= {D}, got {fshape}")
    if pkey[0] == "p" and pkey[1] not in ((L,), (B, L)):
        raise InvalidArgumentError(f"positions must be (L,) or (B, L) = ({B}, {L}), got {pkey[1]}")
    if pkey[0] == "o" and math.prod(pkey[1]) != 1 and pkey[1] != (B,):
        raise InvalidArgumentError(f"offset must be a scalar or (B,) = ({B},), got {pkey[1]}")


def qk_norm_rope(
    q: mx.array | Heads,
    k: mx.array | Heads,
    q_weight: mx.array | None,
    k_weight: mx.array | None,
    inv_freq: mx.array | None,
    *,
    eps: float,
    offset: int | mx.array = 0,
    positions: mx.array | None = None,
    scale: float = 1.0,
    weight_offset: float = 0.0,
    dims: int | None = None,
    transpose: bool = True,
    v: mx.array | Heads | None = None,
    v_weight: mx.array | None = None,
    v_norm: bool = True,
) -> tuple[mx.array, ...]:
    """Norm + RoPE of q (B, L, Hq, Pq) and k (B, L, Hk, Pk) in one launch -> (q, k) (B, H, L, D).

    ``v`` (optional) is normed with ``v_weight`` (None = no weight) but not rotated, and returned
    third (Gemma 4); ``v_norm`` False: not normed either, only laid out as q and k (Gemma 3). D =
    ``dims`` or k's last dim; wider heads use their first D values (Qwen 3.5's [query | gate]
    heads). Semantics: ``rms_norm_rope_reference`` applied to each tensor. Pass
    positions as an int32 array (``offset`` (1,) or ``positions``) so decode steps share a graph.
    Each of q, k, v may be ``Heads`` of a fused projection's output, read in place.
    """
    if v is None:
        xs, ws, rope, norm = (q, k), (q_weight, k_weight), (True, True), (True, True)
    else:
        xs, ws, rope = (q, k, v), (q_weight, k_weight, v_weight), (True, True, False)
        norm = (True, True, v_norm)
    out = _launch(xs, ws, rope, norm, inv_freq, eps, offset, positions, scale, weight_offset,
                  dims or k.shape[-1], transpose)  # fmt: skip
    return tuple(out)


def qkv_rope(
    q: mx.array | Heads,
    k: mx.array | Heads,
    v: mx.array | Heads,
    inv_freq: mx.array,
    *,
    offset: int | mx.array = 0,
    positions: mx.array | None = None,
    scale: float = 1.0,
    dims: int | None = None,
    transpose: bool = True,
) -> tuple[mx.array, mx.array, mx.array]:
    """RoPE of q and k with v laid out beside them, no norms, in one launch (Llama, Qwen 2):
    q (B, L, Hq, D), k and v (B, L, Hk, D) (or ``Heads``) -> (q, k, v) (B, H, L, D)."""
    rope, norm = (True, True, False), (False, False, False)
    out = _launch((q, k, v), (None, None, None), rope, norm, inv_freq, 1e-6, offset, positions,
                  scale, 0.0, dims or k.shape[-1], transpose)  # fmt: skip
    return tuple(out)


def rms_norm_rope(
    x: mx.array | Heads,
    weight: mx.array | None,
    inv_freq: mx.array | None,
    *,
    eps: float,
    offset: int | mx.array = 0,
    positions: mx.array | None = None,
    scale: float = 1.0,
    weight_offset: float = 0.0,
    dims: int | None = None,
    transpose: bool = True,
) -> mx.array:
    """Dispatcher for one tensor: see ``rms_norm_rope_reference``; inv_freq None = norm only."""
    return _launch((x,), (weight,), (True,), (True,), inv_freq, eps, offset, positions, scale,
                   weight_offset, dims or x.shape[-1], transpose)[0]  # fmt: skip


def _input_sig(x) -> tuple:
    """(shape, dtype, layout): layout (values per token, first head's offset) for ``Heads``."""
    if isinstance(x, Heads):
        return x.shape, x.dtype, (x.data.shape[-1], x.first * x.width)
    return x.shape, x.dtype, None


def _launch(xs, ws, rope, norm, inv_freq, eps, offset, positions, scale, woff, D, transpose):
    be = backend()
    fshape = None if inv_freq is None else inv_freq.shape
    if be is not None:
        plan = _plan(
            _kernel, be, tuple([_input_sig(x) for x in xs]),
            tuple([None if w is None else (w.shape, w.dtype) for w in ws]), rope, norm,
            None if inv_freq is None else (fshape, inv_freq.dtype), _pos_key(offset, positions),
            eps, scale, woff, D, transpose,
        )  # fmt: skip
        if plan is not None:
            launch, wslot, consts, n = plan
            if inv_freq is None:
                pos, freqs = consts[0], consts[1]
            else:
                freqs = inv_freq if inv_freq.dtype == mx.float32 else inv_freq.astype(mx.float32)
                pos = _pos_array(offset, positions)
            wd = ws[wslot] if wslot is not None else consts[2]
            data = [x.data if isinstance(x, Heads) else x for x in xs]  # Heads: read in place
            xin = [*data, *data[:1] * (3 - n)]
            win = [wd if w is None else w for w in ws] + [wd] * (3 - n)
            return launch(inputs=[*xin, *win, freqs, pos, consts[3], consts[4]])[:n]
    xs = split_heads(xs)
    wshapes = [None if w is None else w.shape for w in ws]
    _validate([x.shape for x in xs], wshapes, fshape, _pos_key(offset, positions), D)
    return [
        rms_norm_rope_reference(
            x, w, inv_freq if r else None, eps=eps, offset=offset, positions=positions,
            scale=scale, weight_offset=woff, dims=D, transpose=transpose, norm=nm,
        )
        for x, w, r, nm in zip(xs, ws, rope, norm)
    ]  # fmt: skip


def _pos_array(offset, positions) -> mx.array:
    """The kernel's ``pos`` input (int32, 1-d) without copies when it already is one."""
    p = positions if positions is not None else offset
    if not isinstance(p, mx.array):
        return device_array([int(p)], mx.int32)
    if p.dtype != mx.int32:
        p = p.astype(mx.int32)
    return p if p.ndim == 1 else p.reshape(-1)


def _pos_mode(pkey: tuple, B: int) -> int:
    """0 one offset, 1 per-batch offsets, 2 positions (L,), 3 positions (B, L)."""
    if pkey[0] == "p":
        return 2 if len(pkey[1]) == 1 else 3
    if pkey[0] == "o" and math.prod(pkey[1]) != 1:
        return 1
    return 0


PARAMS = 22  # the kernel's int32 parameters (the last two: cache mode)


def cache_mode_params(params: mx.array, capacity: int, ring: bool) -> mx.array:
    """A copy of a launch's ``params`` with cache mode on: its keys and values (tensors 1 and 2)
    written into caches of ``capacity`` slots per row at the rows' positions (a ring: modulo
    capacity) instead of (B, H, L, D) outputs. A recorded CUDA graph step fuses its KV write so
    (``hf2q_mlx/cuda_graph_step.py``); MLX's launches cannot write in place."""
    values = [int(v) for v in params.tolist()]
    if len(values) != PARAMS:
        raise ValueError(f"rms_norm_rope params have {PARAMS} values, got {len(values)}")
    return device_array(values[:20] + [int(capacity), int(ring)], mx.int32)


@lru_cache(maxsize=256)
def _plan(kernel, be, xsig, wsig, rope, norm, fsig, pkey, eps, scale, woff, D, transpose):
    """Everything about a call that its shapes and dtypes decide, checked and computed once:
    (launcher, index of a weight to stand in for missing ones, constants, tensors) or None for
    the reference. Caller errors raise here (not cached: every such call raises)."""
    shapes = [s for s, _, _ in xsig]
    dtypes = {d for _, d, _ in xsig}
    _validate(shapes, [None if w is None else w[0] for w in wsig], fsig and fsig[0], pkey, D)
    B, L = shapes[0][:2]
    R = 0 if fsig is None else 2 * fsig[0][0]
    wts = {w[1] for w in wsig if w is not None}
    T = xsig[0][1]
    covered = (
        D % 32 == 0
        and D <= 1024
        and T in _FLOATS
        and len(dtypes) == 1
        and len(wts) <= 1
        and wts <= set(_FLOATS)
        and B * L > 0
    )
    if not covered:
        return None
    n = len(xsig)
    heads = tuple(s[2] for s in shapes)
    pitch = tuple(s[3] for s in shapes)
    strides = tuple(lay[0] if lay else s[2] * s[3] for s, _, lay in xsig)
    starts = tuple(lay[1] if lay else 0 for _, _, lay in xsig)
    # unused slots get stand-ins that are never read (8+ elements: Metal keeps every pointer
    # in the device address space, which the body's pointer selects need)
    wslot = next((i for i, w in enumerate(wsig) if w is not None), None)
    WT = wsig[wslot][1] if wslot is not None else T
    pos_mode = _pos_mode(pkey, B) if R else 2
    flags = (
        R,
        sum(1 << i for i, r in enumerate(rope) if r),
        sum(1 << i for i, w in enumerate(wsig) if w is not None),
        pos_mode,
        int(transpose),
    )
    pad = (0,) * (3 - n)
    normed = sum(1 << i for i, nm in enumerate(norm) if nm)
    layout = (*strides, *pad, *starts, *pad, normed)
    # the last two: cache mode off (a CUDA graph step turns it on: cache_mode_params)
    params = device_constant(
        (B, L, *heads, *pad, *pitch, *(D,) * (3 - n), *flags, *layout, 0, 0), mx.int32
    )
    fparams = device_constant((float(eps), float(scale), float(woff)), mx.float32)
    consts = (
        device_constant((0,) * 8, mx.int32),
        device_constant((0.0,) * 8, mx.float32),
        device_constant((0.0,) * 8, T),
        params,
        fparams,
    )
    rows = sum(B * L * h for h in heads)
    out_shapes = [(B, h, L, D) if transpose else (B, L, h, D) for h in heads] + [(1,)] * (3 - n)
    launch = kernel.launcher(
        [T] * 3 + [WT] * 3 + [mx.float32, mx.int32, mx.int32, mx.float32],
        grid=(-(-rows // 4) * 128,),
        threadgroup=(128,),
        output_shapes=out_shapes,
        output_dtypes=[T] * 3,
        template={"T": T, "WT": WT, "D": D},
        backend=be,
    )
    return launch, wslot, consts, n
