"""Dense linears y = x @ W.T (+ bias) for 1..32 rows of x: float and MLX affine weights."""

from __future__ import annotations

import math
from functools import partial

import mlx.core as mx

from hf2q_mlx.custom_kernels import backend, device_array, device_constant
from hf2q_mlx.custom_kernels._render import Example, Kernel
from hf2q_mlx.custom_kernels.ggml_formats import COMMON
from hf2q_mlx.errors import InvalidArgumentError, WeightMismatchError

_FLOATS = (mx.float32, mx.float16, mx.bfloat16)


def float_matvec_reference(x: mx.array, w: mx.array, bias: mx.array | None = None) -> mx.array:
    """x (..., K), w (N, K), bias (N,) or None -> (..., N) in x.dtype: fp32 products and sums,
    the bias added in fp32, rounded once. The kernel's oracle."""
    f32 = mx.float32
    y = x.astype(f32) @ w.astype(f32).T
    if bias is not None:
        y = y + bias.astype(f32)
    return y.astype(x.dtype)


def affine_matvec_reference(
    x: mx.array,
    wq: mx.array,
    scales: mx.array,
    biases: mx.array,
    group_size: int,
    bits: int,
    bias: mx.array | None = None,
) -> mx.array:
    """x (..., K) and the arrays ``nn.QuantizedLinear(mode="affine")`` keeps (wq (N, K bits /
    32) uint32, scales and biases (N, K / group_size)) -> (..., N) in x.dtype: weights
    dequantized in fp32 (scale * code + bias, not rounded), fp32 products, the linear's bias
    added in fp32, rounded once. The kernel's oracle."""
    f32 = mx.float32
    w = mx.dequantize(wq, scales.astype(f32), biases.astype(f32), group_size=group_size,
                      bits=bits)  # fmt: skip
    y = x.astype(f32) @ w.T
    if bias is not None:
        y = y + bias.astype(f32)
    return y.astype(x.dtype)


# --------------------------------------------------------------------------------------------
# Kernels. dims = (N, K, tokens). Float template: T (x), WT (w), R (output rows per
# threadgroup), HAS_BIAS. Affine template: T, BITS (4 or 8), GS (group size), R, HAS_BIAS.

# Where a threadgroup's rows and token are, the rows' weight offsets (rows past N re-read
# row N - 1 and drop their sums) and the accumulators; shared by both bodies.
_PROLOGUE = r"""
  const uint N = uint(dims[0]);
  const uint K = uint(dims[1]);
  const uint tokens = uint(dims[2]);
  const uint tok = gid_x % tokens;
  const uint row0 = (gid_x / tokens) * uint(R);
  DEVICE_PTR(const T) xr = x + size_t(tok) * K;
  size_t rowi[R];
  UNROLL for (int r = 0; r < R; ++r) rowi[r] = row0 + uint(r) < N ? row0 + uint(r) : N - 1;
  float acc[R];
  UNROLL for (int r = 0; r < R; ++r) acc[r] = 0.0f;
"""

# Sum the lanes, then the SIMD groups in order; thread r < R writes row row0 + r of the token.
_EPILOGUE = r"""
  SHARED float red[8 * R];
  UNROLL for (int r = 0; r < R; ++r) {
    const float v = simd_sum(acc[r]);
    if (lane == 0) red[simd_id * R + r] = v;
  }
  BARRIER();
  if (tid < uint(R) && row0 + tid < N) {
    float v = 0.0f;
    for (uint s = 0; s < n_simd; ++s) v += red[s * R + tid];
    if (HAS_BIAS) v += to_float(bias[row0 + tid]);
    y[size_t(tok) * N + row0 + tid] = from_float<T>(v);
  }
"""

_MAPPING = r"""
  // Thread mapping: threadgroup gid_x = (block b of R output rows) * tokens + token t (a
  // block's tokens run side by side and share its weight rows in cache); lanes take
  // consecutive 16-byte chunks of the R rows, SIMD groups interleaved runs of 32 chunks. A
  // row's sum for a token depends on K, R and the threadgroup size only, never on the number
  // of tokens: a row's bits are those it has alone (row parity).
"""

# 16 bytes of float weights as fp32: the weight pointer's type picks the unpacking.
_UNPACK = r"""
FN void unpack_w(uint4 q, THREAD_PTR(float) v, DEVICE_PTR(const float) tag) {
  v[0] = bitcast<float>(q.x); v[1] = bitcast<float>(q.y);
  v[2] = bitcast<float>(q.z); v[3] = bitcast<float>(q.w);
}
FN void unpack_w(uint4 q, THREAD_PTR(float) v, DEVICE_PTR(const half_t) tag) {
  const uint u[4] = {q.x, q.y, q.z, q.w};
  UNROLL for (int j = 0; j < 4; ++j) { v[2 * j] = f16lo(u[j]); v[2 * j + 1] = f16hi(u[j]); }
}
FN void unpack_w(uint4 q, THREAD_PTR(float) v, DEVICE_PTR(const bfloat_t) tag) {
  const uint u[4] = {q.x, q.y, q.z, q.w};
  UNROLL for (int j = 0; j < 4; ++j) {
    v[2 * j] = bitcast<float>(u[j] << 16);
    v[2 * j + 1] = bitcast<float>(u[j] & 0xFFFF0000u);
  }
}
"""

_FLOAT_BODY = (
    _MAPPING
    + r"""
  constexpr uint CW = 16 / sizeof(WT);  // weights per 16-byte chunk
"""
    + _PROLOGUE
    + r"""
  const uint nch = K / CW;
  for (uint c = simd_id * SIMD_SIZE + lane; c < nch; c += n_simd * SIMD_SIZE) {
    uint4 q[R];  // every row's load issued before any use
    UNROLL for (int r = 0; r < R; ++r) q[r] = DEVICE_CAST(const uint4, w + rowi[r] * K)[c];
    float xv[CW];
    UNROLL for (int p = 0; p < int(CW / 4); ++p) load_x4(xr + c * CW + 4 * p, xv + 4 * p);
    UNROLL for (int r = 0; r < R; ++r) {
      float wv[CW];
      unpack_w(q[r], wv, w);
      float d = acc[r];
      UNROLL for (int i = 0; i < int(CW); ++i) d = fma_f(wv[i], xv[i], d);
      acc[r] = d;
    }
  }
"""
    + _EPILOGUE
)

_float_kernel = Kernel(
    "dense_float_matvec",
    inputs=["x", "w", "bias", "dims"],
    outputs=["y"],
    body=_FLOAT_BODY,
    header=COMMON + _UNPACK,
    examples=[
        Example({"x": t, "w": wt, "bias": bt, "dims": (mx.int32, 3)}, {"y": t},
                {"T": t, "WT": wt, "R": r, "HAS_BIAS": hb})
        for t, wt, bt, r, hb in ((mx.bfloat16, mx.bfloat16, mx.bfloat16, 4, 1),
                                 (mx.float32, mx.float16, mx.float32, 2, 0),
                                 (mx.float16, mx.float32, mx.float16, 1, 1))
    ],
)  # fmt: skip

_AFFINE_BODY = (
    _MAPPING
    + r"""
  // A chunk is CPW codes of one group: acc += scale * dot(codes, x) + bias * sum(x).
  constexpr uint CPW = 128 / BITS;  // codes per 16-byte chunk
  constexpr uint WPC = 32 / BITS;   // codes per 32-bit word
"""
    + _PROLOGUE
    + r"""
  const uint nch = K / CPW;
  const uint ngr = K / GS;
  for (uint c = simd_id * SIMD_SIZE + lane; c < nch; c += n_simd * SIMD_SIZE) {
    uint4 q[R];
    UNROLL for (int r = 0; r < R; ++r)
      q[r] = DEVICE_CAST(const uint4, wq + rowi[r] * (K / WPC))[c];
    float xv[CPW];
    UNROLL for (int p = 0; p < int(CPW / 4); ++p) load_x4(xr + c * CPW + 4 * p, xv + 4 * p);
    float sx = 0.0f;
    UNROLL for (int i = 0; i < int(CPW); ++i) sx += xv[i];
    const uint g = c * CPW / GS;
    UNROLL for (int r = 0; r < R; ++r) {
      const uint wd[4] = {q[r].x, q[r].y, q[r].z, q[r].w};
      float d = 0.0f;
      UNROLL for (int j = 0; j < 4; ++j)
        UNROLL for (int i = 0; i < int(WPC); ++i)
          d = fma_f(float((wd[j] >> (BITS * i)) & ((1u << BITS) - 1u)), xv[j * WPC + i], d);
      const size_t gi = rowi[r] * ngr + g;
      acc[r] = fma_f(to_float(sc[gi]), d, fma_f(to_float(bi[gi]), sx, acc[r]));
    }
  }
"""
    + _EPILOGUE
)

_affine_kernel = Kernel(
    "dense_affine_matvec",
    inputs=["x", "wq", "sc", "bi", "bias", "dims"],
    outputs=["y"],
    body=_AFFINE_BODY,
    header=COMMON,
    examples=[
        Example({"x": t, "wq": mx.uint32, "sc": st, "bi": st, "bias": t, "dims": (mx.int32, 3)},
                {"y": t}, {"T": t, "BITS": bits, "GS": gs, "R": r, "HAS_BIAS": hb})
        for t, st, bits, gs, r, hb in ((mx.bfloat16, mx.bfloat16, 4, 64, 4, 1),
                                       (mx.float32, mx.float16, 8, 32, 2, 0),
                                       (mx.float16, mx.float32, 4, 128, 1, 1))
    ],
)  # fmt: skip

# --------------------------------------------------------------------------------------------
# Launch shape and dispatchers

MAX_TOKENS = 32
TARGET_WARPS = 4096  # SIMD groups a launch should hold: ~30 resident on each of 132 SMs (H200)


def launch_shape(K: int, N: int, chunk: int) -> dict[str, int]:
    """SIMD groups W and output rows R per threadgroup for K weights a row in 16-byte chunks of
    ``chunk`` weights, from K and N only (never the token count: row parity).

    At one token the launch streams the weights once, so it must keep enough 16-byte loads in
    flight: W grows with K until each lane has about 4 chunks (longer loops amortise the
    reduction, shorter ones starve the loads), R = 4 rows share each x load. Where that gives
    under TARGET_WARPS SIMD groups (short N), W grows while each lane keeps 2 chunks, then R
    shrinks to 2 and 1, then W grows to one chunk a lane (at most 8 SIMD groups).
    """
    chunks = K // chunk
    w, r = 1, 4
    while w < 8 and chunks >= 256 * w:
        w *= 2
    while -(-N // r) * w < TARGET_WARPS:
        if w < 8 and chunks >= 128 * w:
            w *= 2
        elif r > 1:
            r //= 2
        elif w < 8 and chunks >= 64 * w:
            w *= 2
        else:
            break
    return {"W": w, "R": r}


def _tokens(x: mx.array) -> int:
    return math.prod(x.shape[:-1])


def _launch(x: mx.array, N: int, chunk: int, template: dict, config: dict | None):
    """(launch keywords, dims) over x's rows, N outputs a row, chunks of ``chunk`` weights."""
    K, tokens = x.shape[-1], _tokens(x)
    cfg = config or launch_shape(K, N, chunk)
    tg = 32 * cfg["W"]
    launch = dict(
        grid=(-(-N // cfg["R"]) * tokens * tg,),
        threadgroup=(tg,),
        output_shapes=[(*x.shape[:-1], N)],  # written flat: no reshape node after
        output_dtypes=[x.dtype],
        template={**template, "R": cfg["R"]},
    )
    return launch, [N, K, tokens]


def _no_bias(x: mx.array) -> mx.array:
    return device_constant((0,) * 8, x.dtype)  # the bias input when HAS_BIAS is 0


def _check_bias(bias: mx.array | None, N: int) -> None:
    if bias is None:
        return
    if bias.dtype not in _FLOATS:
        raise InvalidArgumentError(f"bias must be float32, float16 or bfloat16, not {bias.dtype}")
    if tuple(bias.shape) != (N,):
        raise WeightMismatchError(f"bias has shape {tuple(bias.shape)}, the weight {N} rows")


# -- float weights ---------------------------------------------------------------------------


def _float_chunk(w: mx.array) -> int:
    return 16 // w.dtype.size


def _float_check(x: mx.array, w: mx.array, bias: mx.array | None) -> None:
    """Caller errors: one line each."""
    if x.dtype not in _FLOATS or w.dtype not in _FLOATS:
        raise InvalidArgumentError(f"float_matvec takes float x and w, not {x.dtype}, {w.dtype}")
    if w.ndim != 2 or x.ndim < 1:
        raise InvalidArgumentError(f"float_matvec takes x (..., K) and w (N, K), not w {w.shape}")
    if x.shape[-1] != w.shape[1]:
        raise WeightMismatchError(f"x has {x.shape[-1]} features, the weight {w.shape[1]}")
    _check_bias(bias, w.shape[0])


def float_kernel_covers(x: mx.array, w: mx.array, bias: mx.array | None = None) -> bool:
    """True when :func:`float_matvec` runs its kernel (a GPU, 1..32 rows of x, K a multiple of
    the weights' 16-byte chunk)."""
    N, K = w.shape
    return (
        backend() is not None
        and 1 <= _tokens(x) <= MAX_TOKENS
        and N > 0
        and K > 0
        and K % _float_chunk(w) == 0
    )


def _float_launch(x, w, bias, config=None):
    template = {"T": x.dtype, "WT": w.dtype, "HAS_BIAS": bias is not None}
    return _launch(x, w.shape[0], _float_chunk(w), template, config)


def float_matvec_kernel(
    x: mx.array,
    w: mx.array,
    bias: mx.array | None = None,
    *,
    init_value: float | None = None,
    config: dict[str, int] | None = None,
) -> mx.array:
    """The GPU kernel alone, the contract of :func:`float_matvec_reference`; ``init_value``
    pre-fills the output (tests poison it), ``config`` = {"W", "R"} overrides
    :func:`launch_shape`."""
    launch, dims = _float_launch(x, w, bias, config)
    inputs = [x, w, _no_bias(x) if bias is None else bias, device_array(dims, mx.int32)]
    return _float_kernel(inputs, init_value=init_value, **launch)[0]


# (kernel, shapes and dtypes of every input) -> (launcher, dims, the bias stand-in): a decode
# step calls each linear with the same shapes every token
_CALLS: dict[tuple, tuple] = {}


def _key(kernel: Kernel, arrays: list, bias, *extra) -> tuple:
    return (kernel, *extra, *((a.shape, a.dtype) for a in arrays),
            None if bias is None else (bias.shape, bias.dtype))  # fmt: skip


def _run(key: tuple, kernel: Kernel, arrays: list, bias, launch_and_dims) -> mx.array:
    """The cached launch of ``kernel`` over ``arrays`` (x and the weight's), the bias (or its
    stand-in) and the dims; ``launch_and_dims()`` makes the plan on the first call."""
    plan = _CALLS.get(key)
    if plan is None:
        launch, dims = launch_and_dims()
        stand_in = _no_bias(arrays[0])
        dtypes = [a.dtype for a in arrays] + [(stand_in if bias is None else bias).dtype, mx.int32]
        plan = (kernel.launcher(dtypes, **launch), device_array(dims, mx.int32), stand_in)
        _CALLS[key] = plan
    launch, dims, stand_in = plan
    return launch(inputs=[*arrays, stand_in if bias is None else bias, dims])[0]


def float_matvec(x: mx.array, w: mx.array, bias: mx.array | None = None) -> mx.array:
    """Dispatcher with the contract of :func:`float_matvec_reference`: one kernel on a GPU for
    1..32 rows of x, otherwise the reference."""
    key = _key(_float_kernel, [x, w], bias)
    if backend() is None or key not in _CALLS:  # a cached plan was checked when made
        _float_check(x, w, bias)
        if not float_kernel_covers(x, w, bias):
            return float_matvec_reference(x, w, bias)
    return _run(key, _float_kernel, [x, w], bias, partial(_float_launch, x, w, bias))


# -- MLX affine weights ----------------------------------------------------------------------


def _affine_check(x, wq, scales, biases, group_size: int, bits: int, bias) -> None:
    """Caller errors: one line each."""
    if x.dtype not in _FLOATS or x.ndim < 1:
        raise InvalidArgumentError(f"affine_matvec takes float x (..., K), not {x.dtype}")
    if bits not in (2, 3, 4, 5, 6, 8) or group_size not in (32, 64, 128):
        raise InvalidArgumentError(f"no MLX affine format of {bits} bits in groups of {group_size}")
    if biases is None or wq.dtype != mx.uint32 or wq.ndim != 2:
        raise InvalidArgumentError("affine_matvec takes uint32 codes (N, K bits / 32) and biases")
    if scales.dtype not in _FLOATS or biases.dtype not in _FLOATS:
        raise InvalidArgumentError(f"float scales and biases, not {scales.dtype}, {biases.dtype}")
    K, N = x.shape[-1], wq.shape[0]
    if K % group_size or wq.shape[1] * 32 != K * bits:
        raise WeightMismatchError(f"x has {K} features, the {bits}-bit weight {wq.shape[1]} words")
    groups = (N, K // group_size)
    if tuple(scales.shape) != groups or tuple(biases.shape) != groups:
        raise WeightMismatchError(
            f"scales {tuple(scales.shape)} and biases {tuple(biases.shape)}, expected {groups}"
        )
    _check_bias(bias, N)


def affine_kernel_covers(x, wq, scales, biases, group_size: int, bits: int, bias=None) -> bool:
    """True when :func:`affine_matvec` runs its kernel (a GPU, 1..32 rows of x, 4- or 8-bit
    codes in groups of 32..128)."""
    return (
        backend() is not None
        and bits in (4, 8)
        and group_size in (32, 64, 128)
        and 1 <= _tokens(x) <= MAX_TOKENS
        and wq.shape[0] > 0
        and x.shape[-1] > 0
    )


def _affine_launch(x, wq, group_size: int, bits: int, bias, config=None):
    template = {"T": x.dtype, "BITS": bits, "GS": group_size, "HAS_BIAS": bias is not None}
    return _launch(x, wq.shape[0], 128 // bits, template, config)


def affine_matvec_kernel(
    x: mx.array,
    wq: mx.array,
    scales: mx.array,
    biases: mx.array,
    group_size: int,
    bits: int,
    bias: mx.array | None = None,
    *,
    init_value: float | None = None,
    config: dict[str, int] | None = None,
) -> mx.array:
    """The GPU kernel alone, the contract of :func:`affine_matvec_reference`; ``init_value``
    pre-fills the output (tests poison it), ``config`` = {"W", "R"} overrides
    :func:`launch_shape`."""
    launch, dims = _affine_launch(x, wq, group_size, bits, bias, config)
    inputs = [x, wq, scales, biases, _no_bias(x) if bias is None else bias,
              device_array(dims, mx.int32)]  # fmt: skip
    return _affine_kernel(inputs, init_value=init_value, **launch)[0]


def affine_matvec(
    x: mx.array,
    wq: mx.array,
    scales: mx.array,
    biases: mx.array,
    group_size: int,
    bits: int,
    bias: mx.array | None = None,
) -> mx.array:
    """Dispatcher with the contract of :func:`affine_matvec_reference`: one kernel on a GPU for
    1..32 rows of x and 4- or 8-bit codes, otherwise the reference."""
    if biases is None:  # a caller error _affine_check reports
        _affine_check(x, wq, scales, biases, group_size, bits, bias)
    arrays = [x, wq, scales, biases]
    key = _key(_affine_kernel, arrays, bias, group_size, bits)
    if backend() is None or key not in _CALLS:  # a cached plan was checked when made
        _affine_check(x, wq, scales, biases, group_size, bits, bias)
        if not affine_kernel_covers(x, wq, scales, biases, group_size, bits, bias):
            return affine_matvec_reference(x, wq, scales, biases, group_size, bits, bias)
    plan = partial(_affine_launch, x, wq, group_size, bits, bias)
    return _run(key, _affine_kernel, arrays, bias, plan)
