"""Residual add then RMSNorm in one pass: h = x + residual, y = rms_norm(h) * weight -> (h, y)."""

from __future__ import annotations

import math
from functools import lru_cache

import mlx.core as mx

from hf2q_mlx.custom_kernels import backend, device_constant
from hf2q_mlx.custom_kernels._render import Example, Kernel


def residual_rms_norm_reference(
    x: mx.array,
    residual: mx.array,
    weight: mx.array | None,
    eps: float,
    weight_offset: float = 0.0,
) -> tuple[mx.array, mx.array]:
    """x, residual (..., H) -> (h = x + residual, y) in h's dtype; y from the rounded h in fp32.

    ``y = h * rsqrt(mean(h^2) + eps) * (weight + weight_offset)`` (weight_offset 1 for Gemma's
    zero-centred weights; weight None = no weight).
    """
    h = x + residual
    hf = h.astype(mx.float32)
    y = hf * mx.rsqrt(mx.mean(hf * hf, axis=-1, keepdims=True) + eps)
    if weight is not None:
        y = y * (weight.astype(mx.float32) + weight_offset)
    return h, y.astype(h.dtype)


# Template: T (x, residual, h, y), WT (weight), H, TG (threads), NPT (elements per thread),
# HAS_W. fparams: eps, weight offset.
_BODY = """
  // One threadgroup per row of H; thread t owns elements t + TG j (j < NPT), kept in registers
  // between the sum of squares (SIMD sums, one shared slot per SIMD group) and the output.
  SHARED float part[TG / 32];
  const uint64_t base = uint64_t(gid_x) * uint(H);
  float v[NPT];
  float ss = 0.0f;
  UNROLL for (int j = 0; j < NPT; ++j) {
    const uint i = tid + uint(TG * j);
    v[j] = 0.0f;
    if (i < uint(H)) {
      // round h to T first: y is the norm of the residual stream as stored
      const T hv = from_float<T>(to_float(x[base + i]) + to_float(res[base + i]));
      h[base + i] = hv;
      v[j] = to_float(hv);
      ss = fma_f(v[j], v[j], ss);
    }
  }
  ss = simd_sum(ss);
  if (lane == 0) part[simd_id] = ss;
  BARRIER();
  float total = 0.0f;
  UNROLL for (int s = 0; s < TG / 32; ++s) total += part[s];
  const float inv = rsqrt_f(total / float(H) + fparams[0]);
  UNROLL for (int j = 0; j < NPT; ++j) {
    const uint i = tid + uint(TG * j);
    if (i < uint(H)) {
      float o = v[j] * inv;
      if (HAS_W) o *= to_float(w[i]) + fparams[1];
      y[base + i] = from_float<T>(o);
    }
  }
"""

_kernel = Kernel(
    "residual_rms_norm",
    inputs=["x", "res", "w", "fparams"],
    outputs=["h", "y"],
    body=_BODY,
    examples=[
        Example({"x": t, "res": t, "w": wt, "fparams": (mx.float32, 2)}, {"h": t, "y": t},
                {"T": t, "WT": wt, "H": hh, "TG": tg, "NPT": -(-hh // tg), "HAS_W": hw})
        for t, wt, hh, tg, hw in ((mx.bfloat16, mx.bfloat16, 640, 256, 1),
                                  (mx.float16, mx.float32, 2816, 512, 1),
                                  (mx.float32, mx.float32, 1000, 256, 0))
    ],
)  # fmt: skip

_FLOATS = (mx.float32, mx.float16, mx.bfloat16)


def threads_for(H: int) -> int:
    """Threads per row: about 8 elements each, 64..1024 (a multiple of 32)."""
    return max(64, min(1024, -(-H // 8 // 32) * 32))


def residual_rms_norm(
    x: mx.array,
    residual: mx.array,
    weight: mx.array | None,
    eps: float,
    weight_offset: float = 0.0,
) -> tuple[mx.array, mx.array]:
    """Dispatcher: one kernel for (h, y) where it applies, else the reference."""
    be = backend()
    if be is not None:
        wsig = None if weight is None else (weight.shape, weight.dtype)
        plan = _plan(_kernel, be, x.shape, x.dtype, residual.shape, residual.dtype, wsig, eps,
                     weight_offset)  # fmt: skip
        if plan is not None:
            launch, w_none, fparams = plan
            h, y = launch(inputs=[x, residual, w_none if weight is None else weight, fparams])
            return h, y
    _check(x.shape, residual.shape, None if weight is None else weight.shape)
    return residual_rms_norm_reference(x, residual, weight, eps, weight_offset)


def _check(shape, res_shape, w_shape) -> None:
    if shape != res_shape:
        raise ValueError(f"x {shape} and residual {res_shape} differ")
    H = shape[-1]
    if w_shape is not None and w_shape != (H,):
        raise ValueError(f"weight must be ({H},), got {w_shape}")


@lru_cache(maxsize=256)
def _plan(kernel, be, shape, dtype, res_shape, res_dtype, wsig, eps, woff):
    """(launcher, stand-in weight, fparams) for one call shape, or None for the reference."""
    _check(shape, res_shape, None if wsig is None else wsig[0])
    H = shape[-1]
    size = math.prod(shape)
    covered = (
        dtype in _FLOATS
        and res_dtype == dtype
        and (wsig is None or wsig[1] in _FLOATS)
        and size > 0
        and H <= 16384
    )
    if not covered:
        return None
    tg = threads_for(H)
    WT = dtype if wsig is None else wsig[1]
    launch = kernel.launcher(
        [dtype, dtype, WT, mx.float32],
        grid=(size // H * tg,),
        threadgroup=(tg,),
        output_shapes=[shape, shape],
        output_dtypes=[dtype, dtype],
        template={"T": dtype, "WT": WT, "H": H, "TG": tg, "NPT": -(-H // tg),
                  "HAS_W": wsig is not None},
        backend=be,
    )  # fmt: skip
    return (
        launch,
        device_constant((0.0,) * 8, dtype),
        device_constant((float(eps), float(woff)), mx.float32),
    )
