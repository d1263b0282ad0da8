"""Routed experts' gate and up projections with the gated activation in one launch, MLX affine."""

from __future__ import annotations

import math

import mlx.core as mx

from hf2q_mlx.custom_kernels import activations, backend, device_array, device_constant
from hf2q_mlx.custom_kernels._render import Example, Kernel
from hf2q_mlx.custom_kernels.expert_glu import ACTIVATIONS, MAX_TOKENS
from hf2q_mlx.custom_kernels.expert_matmul import uint32_ids
from hf2q_mlx.custom_kernels.ggml_formats import COMMON
from hf2q_mlx.errors import InvalidArgumentError, WeightMismatchError

# One expert stack's arrays as nn.quantize leaves them: codes (E, N, K * bits / 32) uint32,
# scales and biases (E, N, K / group_size).
Affine = tuple[mx.array, mx.array, mx.array]


def expert_glu_affine_reference(
    x: mx.array,
    gate_up: Affine,
    expert_ids: mx.array,
    group_size: int,
    bits: int,
    activation: str = "silu",
    up: Affine | None = None,
) -> mx.array:
    """x (..., K) or (..., k, K), expert_ids (..., k) -> act(gate) * up (..., k, F) in x.dtype.

    ``gate_up``: fused [gate | up] rows (2F of them), or the gate rows with ``up`` the up rows.
    The selected experts are dequantized (``mx.dequantize``, fp32) and multiplied in fp32,
    rounded once: the oracle for the kernel.
    """
    xs = x if x.ndim == expert_ids.ndim + 1 else x[..., None, :]  # (..., k or 1, K)
    xs = xs.astype(mx.float32)[..., None]  # (..., k or 1, K, 1)

    def project(arrays: Affine) -> mx.array:
        wq, scales, biases = (a[expert_ids] for a in arrays)  # (..., k, N, .)
        # fp32 scale * code + bias, as MLX's quantized mat-vecs compute them (not rounded)
        scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
        w = mx.dequantize(wq, scales, biases, group_size=group_size, bits=bits)
        return (w @ xs).squeeze(-1)  # (..., k, N)

    if up is None:
        g, u = mx.split(project(gate_up), 2, axis=-1)
    else:
        g, u = project(gate_up), project(up)
    return activations.gated_activation_reference(g, u, activation).astype(x.dtype)


# --------------------------------------------------------------------------------------------
# Kernel. Template: T (x), TS (scales and biases), BITS (4 or 8), GS (group size), R (rows:
# R/2 gate, R/2 up), ACT (0 silu, 1 gelu_tanh). edims as expert_glu's: (1, F, K, slots per x
# row, E, rows per expert in the gate arrays, first up row of an expert in the up arrays).

_BODY = r"""
  // Thread mapping: threadgroup (gid_x, gid_y) = (features f0 .. f0 + R/2 - 1, (token, slot)
  // pair p); rows r < R/2 are expert ids[p]'s gate rows of those features, r >= R/2 the
  // matching up rows. Lanes take consecutive 16-byte chunks of the rows (CPW weights of one
  // group each), SIMD groups interleaved runs of 32 chunks; a chunk's x is loaded once for all
  // R rows.
  constexpr uint CPW = 128 / BITS;  // weights per 16-byte chunk
  constexpr uint WPC = 32 / BITS;   // weights per 32-bit word
  const uint pair = gid_y;
  const uint F = uint(edims[1]);
  const uint K = uint(edims[2]);
  const uint e = uint(ids[pair]);
  const uint f0 = gid_x * uint(R / 2);
  DEVICE_PTR(T) out = ys + size_t(pair) * F;
  if (e >= uint(edims[4])) {
    // An id past the last expert: NaN rows, nothing read; the threadgroup leaves before any
    // barrier or SIMD operation.
    if (tid < uint(R / 2) && f0 + tid < F)
      out[f0 + tid] = from_float<T>(bitcast<float>(0x7FC00000u));
    return;
  }
  DEVICE_PTR(const T) xr = xs + size_t(pair / uint(edims[3])) * K;
  const uint nch = K / CPW;
  const uint ngr = K / GS;
  size_t rowi[R];  // each row's index in its array (rows past F re-read row F - 1, dropped)
  UNROLL for (int r = 0; r < R; ++r) {
    const uint f = f0 + uint(r % (R / 2));
    rowi[r] = size_t(e) * uint(edims[5]) + (r < R / 2 ? 0u : uint(edims[6])) + (f < F ? f : F - 1);
  }
  float acc[R];
  UNROLL for (int r = 0; r < R; ++r) acc[r] = 0.0f;
  for (uint c = simd_id * SIMD_SIZE + lane; c < nch; c += n_simd * SIMD_SIZE) {
    uint4 q[R];
    UNROLL for (int r = 0; r < R; ++r)
      q[r] = DEVICE_CAST(const uint4, (r < R / 2 ? wg : wu) + rowi[r] * (K / WPC))[c];
    float xv[CPW];
    UNROLL for (int p = 0; p < int(CPW / 4); ++p) load_x4(xr + c * CPW + 4 * p, xv + 4 * p);
    float sx = 0.0f;
    UNROLL for (int i = 0; i < int(CPW); ++i) sx += xv[i];
    const uint g = c * CPW / GS;
    UNROLL for (int r = 0; r < R; ++r) {
      const size_t gi = rowi[r] * ngr + g;
      const float s = to_float(r < R / 2 ? sg[gi] : su[gi]);
      const float b = to_float(r < R / 2 ? bg[gi] : bu[gi]);
      const uint wd[4] = {q[r].x, q[r].y, q[r].z, q[r].w};
      float d = 0.0f;
      UNROLL for (int j = 0; j < 4; ++j)
        UNROLL for (int i = 0; i < int(WPC); ++i)
          d = fma_f(float((wd[j] >> (BITS * i)) & ((1u << BITS) - 1u)), xv[j * WPC + i], d);
      acc[r] = fma_f(s, d, fma_f(b, sx, acc[r]));
    }
  }
  // Sum the lanes, then the SIMD groups; thread f < R/2 holds feature f0 + f's gate and up.
  SHARED float red[8 * R];
  UNROLL for (int r = 0; r < R; ++r) {
    const float v = simd_sum(acc[r]);
    if (lane == 0) red[simd_id * R + r] = v;
  }
  BARRIER();
  if (tid < uint(R / 2) && f0 + tid < F) {
    float gs = 0.0f, us = 0.0f;
    for (uint s = 0; s < n_simd; ++s) {
      gs += red[s * R + tid];
      us += red[s * R + R / 2 + tid];
    }
    float a;
    if (ACT == 0) {
      a = gs / (1.0f + exp_f(-gs));
    } else {
      a = 0.5f * gs * (1.0f + tanh_f(0.7978845608028654f * (gs + 0.044715f * gs * gs * gs)));
    }
    out[f0 + tid] = from_float<T>(a * us);
  }
"""

_kernel = Kernel(
    "affine_expert_glu",
    inputs=["xs", "wg", "sg", "bg", "wu", "su", "bu", "ids", "edims"],
    outputs=["ys"],
    body=_BODY,
    header=COMMON,
    examples=[
        Example(
            {"xs": t, "wg": mx.uint32, "sg": t, "bg": t, "wu": mx.uint32, "su": t, "bu": t,
             "ids": mx.uint32, "edims": (mx.int32, 7)},
            {"ys": t},
            {"T": t, "BITS": bits, "GS": gs, "R": r, "ACT": act},
        )
        for t, bits, gs, r, act in ((mx.bfloat16, 4, 64, 4, 1), (mx.float32, 8, 32, 2, 0))
    ],
)  # fmt: skip

ROWS, WARPS = 4, 2  # rows (2 features) and SIMD groups per threadgroup
_FLOATS = (mx.float32, mx.float16, mx.bfloat16)


def _launch(x, gate_up: Affine, up, expert_ids, group_size: int, bits: int, activation: str):
    E, rows = gate_up[0].shape[:2]
    F = rows if up is not None else rows // 2
    K = gate_up[0].shape[-1] * 32 // bits
    k = expert_ids.shape[-1]
    per_slot = x.ndim == expert_ids.ndim + 1
    # written flat as (..., k, F): no reshape node after
    launch = _launch_args(F, expert_ids.size, (*expert_ids.shape, F), x.dtype, group_size, bits,
                          activation)  # fmt: skip
    edims = [1, F, K, 1 if per_slot else k, E, rows, 0 if up is not None else F]
    return launch, edims


def _launch_args(F: int, pairs: int, out_shape: tuple, dtype, group_size: int, bits: int,
                 activation: str) -> dict:  # fmt: skip
    """The launch keywords for ``pairs`` (token, slot) rows of F features each."""
    return dict(
        grid=(-(-F // (ROWS // 2)) * 32 * WARPS, pairs),
        threadgroup=(32 * WARPS, 1),
        output_shapes=[out_shape],
        output_dtypes=[dtype],
        template={"T": dtype, "BITS": bits, "GS": group_size, "R": ROWS,
                  "ACT": ACTIVATIONS.index(activation)},
    )  # fmt: skip


def affine_experts_covered(x: mx.array, w: Affine, group_size: int, bits: int) -> bool:
    """The affine expert kernels' common terms: x in a float dtype, 4- or 8-bit codes (E, rows,
    K bits / 32) in groups of 32..128 with float scales and biases of one dtype."""
    wq, scales, biases = w
    K = x.shape[-1]
    return (
        bits in (4, 8)
        and group_size in (32, 64, 128)
        and biases is not None
        and x.dtype in _FLOATS
        and scales.dtype in _FLOATS
        and biases.dtype == scales.dtype
        and K % group_size == 0
        and wq.dtype == mx.uint32
        and wq.ndim == 3
        and wq.shape[-1] * 32 == K * bits
        and scales.shape == biases.shape == (*wq.shape[:2], K // group_size)
    )


def kernel_covers(x, gate_up: Affine, up, expert_ids, group_size: int, bits: int) -> bool:
    """True when :func:`expert_glu_affine` runs its kernel (a GPU, 1..32 tokens, 4- or 8-bit
    codes in groups of 32..128, x's leading dims those of the ids)."""
    wq = gate_up[0]
    lead = expert_ids.shape if x.ndim == expert_ids.ndim + 1 else expert_ids.shape[:-1]
    return (
        backend() is not None
        and affine_experts_covered(x, gate_up, group_size, bits)
        and (
            up is None
            or all(a.shape == b.shape and a.dtype == b.dtype for a, b in zip(up, gate_up))
        )  # fmt: skip
        and (up is not None or wq.shape[1] % 2 == 0)
        and tuple(x.shape[:-1]) == tuple(lead)
        and 1 <= math.prod(expert_ids.shape[:-1]) <= MAX_TOKENS
        and expert_ids.size > 0
        and wq.shape[0] > 0
    )


def expert_glu_affine_kernel(
    x: mx.array,
    gate_up: Affine,
    expert_ids: mx.array,
    group_size: int,
    bits: int,
    activation: str = "silu",
    up: Affine | None = None,
    *,
    init_value: float | None = None,
) -> mx.array:
    """The GPU kernel alone, the contract of :func:`expert_glu_affine_reference`; an id >= E
    gives NaN rows; ``init_value`` pre-fills the output (tests poison it with NaN)."""
    launch, edims = _launch(x, gate_up, up, expert_ids, group_size, bits, activation)
    upa = gate_up if up is None else up
    inputs = [x, *gate_up, *upa, uint32_ids(expert_ids), device_array(list(edims), mx.int32)]
    return _kernel(inputs, init_value=init_value, **launch)[0]


_CALLS: dict[tuple, tuple] = {}


def expert_glu_affine(
    x: mx.array,
    gate_up: Affine,
    expert_ids: mx.array,
    group_size: int,
    bits: int,
    activation: str = "silu",
    up: Affine | None = None,
) -> mx.array:
    """Dispatcher with the contract of :func:`expert_glu_affine_reference`: on a GPU one kernel
    for 1..32 tokens and 4- or 8-bit affine experts; otherwise the reference (callers with a
    faster path of their own check :func:`kernel_covers` first)."""
    if activation not in ACTIVATIONS:
        raise InvalidArgumentError(f"activation {activation!r} is not one of {ACTIVATIONS}")
    arrays = [*gate_up, *(() if up is None else up)]
    key = (_kernel, group_size, bits, activation, x.shape, x.dtype, expert_ids.shape,
           expert_ids.dtype, *((a.shape, a.dtype) for a in arrays))  # fmt: skip
    if backend() is not None:
        plan = _CALLS.get(key)
        if plan is not None:
            return _run(plan, x, gate_up, up, expert_ids)
    if x.shape[-1] * bits != gate_up[0].shape[-1] * 32:
        raise WeightMismatchError(
            f"x has {x.shape[-1]} features, the {bits}-bit experts {gate_up[0].shape[-1]} words"
        )
    if not kernel_covers(x, gate_up, up, expert_ids, group_size, bits):
        return expert_glu_affine_reference(x, gate_up, expert_ids, group_size, bits, activation,
                                           up)  # fmt: skip
    launch, edims = _launch(x, gate_up, up, expert_ids, group_size, bits, activation)
    dtypes = [x.dtype, *(a.dtype for a in gate_up), *(a.dtype for a in (up or gate_up)),
              mx.uint32, mx.int32]  # fmt: skip
    plan = _CALLS[key] = (_kernel.launcher(dtypes, **launch), device_array(list(edims), mx.int32))
    return _run(plan, x, gate_up, up, expert_ids)


def _run(plan, x, gate_up: Affine, up, expert_ids) -> mx.array:
    launch, edims = plan
    # x and the ids in their own shapes: the kernel reads flat memory (no reshape nodes)
    inputs = [x, *gate_up, *(gate_up if up is None else up), uint32_ids(expert_ids), edims]
    return launch(inputs=inputs)[0]


# --------------------------------------------------------------------------------------------
# A dense MLP's fused [gate | up] affine weight: the same kernel over one expert (every id 0,
# the 2-D arrays read as expert 0's), the output (..., F) as the rows of x: no view nodes.

_DENSE_CALLS: dict[tuple, tuple | None] = {}


def dense_glu_affine(
    x: mx.array, w: Affine, group_size: int, bits: int, activation: str = "silu"
) -> mx.array | None:
    """act(gate) * up of one fused [gate | up] affine weight (codes (2F, K bits / 32), scales
    and biases (2F, K / group_size)) for 1..32 rows of x (..., K) -> (..., F) in x.dtype, as
    :func:`expert_glu_affine_reference` over that one expert; None where the kernel does not
    apply (no GPU, other rows, shapes or dtypes, an unknown activation)."""
    wq = w[0]
    rows = x.size // x.shape[-1] if x.ndim and x.shape[-1] else 0
    key = (_kernel, group_size, bits, activation, x.shape, x.dtype,
           *((a.shape, a.dtype) for a in w))  # fmt: skip
    plan = _DENSE_CALLS.get(key, False)
    if plan is False:
        plan = None
        if (
            backend() is not None
            and activation in ACTIVATIONS
            and 1 <= rows <= MAX_TOKENS
            and wq.ndim == 2
            and wq.shape[0] % 2 == 0
            and affine_experts_covered(x, tuple(a[None] for a in w), group_size, bits)
        ):
            F, K = wq.shape[0] // 2, x.shape[-1]
            launch = _launch_args(F, rows, (*x.shape[:-1], F), x.dtype, group_size, bits,
                                  activation)  # fmt: skip
            dtypes = [x.dtype, *(a.dtype for a in w), *(a.dtype for a in w), mx.uint32, mx.int32]
            edims = device_array([1, F, K, 1, 1, 2 * F, F], mx.int32)
            ids = device_constant((0,) * rows, mx.uint32)  # every row: expert 0
            plan = (_kernel.launcher(dtypes, **launch), ids, edims)
        _DENSE_CALLS[key] = plan
    if plan is None:
        return None
    launch, ids, edims = plan
    return launch(inputs=[x, *w, *w, ids, edims])[0]
