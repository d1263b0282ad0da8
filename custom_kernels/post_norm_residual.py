"""A Gemma-style block join in one pass: the branch's output norm(s), the residual add, the layer
scale, and the norms of the new residual stream that the next ops read."""

from __future__ import annotations

import math
from functools import lru_cache

import mlx.core as mx

from hf2q_mlx.custom_kernels import backend, device_array
from hf2q_mlx.custom_kernels._render import Example, Kernel


def post_norm_residual_reference(
    x: mx.array,
    y: mx.array,
    w: mx.array,
    next_w: mx.array,
    eps: float,
    y2: mx.array | None = None,
    w1: mx.array | None = None,
    w2: mx.array | None = None,
    scale: mx.array | None = None,
    next_w2: mx.array | None = None,
) -> tuple[mx.array, ...]:
    """x, y (..., H) -> (h, n[, n2]) with

    b = y, or norm(y; w1) + norm(y2; w2) when a second branch y2 is given
    h = (x + norm(b; w)) * scale (no scale: 1)
    n = norm(h; next_w), n2 = norm(h; next_w2) when next_w2 is given

    where norm(v; w) = v * rsqrt(mean(v^2) + eps) * w, each result rounded to x's dtype as the
    separate ops round it (``mx.fast.rms_norm`` and the elementwise ops, in this order)."""
    if y2 is not None:
        y = mx.fast.rms_norm(y, w1, eps) + mx.fast.rms_norm(y2, w2, eps)
    h = x + mx.fast.rms_norm(y, w, eps)
    if scale is not None:
        h = h * scale
    out = (h, mx.fast.rms_norm(h, next_w, eps))
    return out if next_w2 is None else (*out, mx.fast.rms_norm(h, next_w2, eps))


# Template: T (x, y, y2, outputs), WT (weights), H, TG (threads), NPT (elements per thread),
# TWO (second branch y2 with norms w1, w2), SCALED, N2 (second output norm). fparams: eps.
_BODY = """
  // One threadgroup per row of H; thread t owns elements t + TG j (j < NPT), kept in registers
  // through every norm: a norm's sum of squares is a SIMD sum, then one shared slot per group.
  SHARED float part[2 * (TG / 32)];
  const uint64_t base = uint64_t(gid_x) * uint(H);
  const float eps = fparams[0];
  float a[NPT];
  float c[NPT];
  // every operand loaded up front: one round of memory latency instead of one per norm (the
  // barriers between the norms keep loads from moving past them)
  float xv[NPT], wv[NPT], w1v[NPT], w2v[NPT], nv[NPT], nv2[NPT];
  float sa = 0.0f, sc = 0.0f;
  UNROLL for (int j = 0; j < NPT; ++j) {
    const uint i = tid + uint(TG * j);
    const bool ok = i < uint(H);
    a[j] = ok ? to_float(y[base + i]) : 0.0f;
    c[j] = (TWO && ok) ? to_float(y2[base + i]) : 0.0f;
    xv[j] = ok ? to_float(x[base + i]) : 0.0f;
    wv[j] = ok ? to_float(w[i]) : 0.0f;
    w1v[j] = (TWO && ok) ? to_float(w1[i]) : 0.0f;
    w2v[j] = (TWO && ok) ? to_float(w2[i]) : 0.0f;
    nv[j] = ok ? to_float(next_w[i]) : 0.0f;
    nv2[j] = (N2 && ok) ? to_float(next_w2[i]) : 0.0f;
  }
  UNROLL for (int j = 0; j < NPT; ++j) {
    sa = fma_f(a[j], a[j], sa);
    sc = fma_f(c[j], c[j], sc);
  }
  if (TWO) {
    sa = simd_sum(sa);
    sc = simd_sum(sc);
    if (lane == 0) { part[simd_id] = sa; part[TG / 32 + simd_id] = sc; }
    BARRIER();
    float ta = 0.0f, tc = 0.0f;
    UNROLL for (int s = 0; s < TG / 32; ++s) { ta += part[s]; tc += part[TG / 32 + s]; }
    const float ia = rsqrt_f(ta / float(H) + eps);
    const float ic = rsqrt_f(tc / float(H) + eps);
    sa = 0.0f;
    UNROLL for (int j = 0; j < NPT; ++j) {
      const uint i = tid + uint(TG * j);
      if (i < uint(H)) {
        const float na = to_float(from_float<T>(a[j] * ia * w1v[j]));
        const float nc = to_float(from_float<T>(c[j] * ic * w2v[j]));
        a[j] = to_float(from_float<T>(na + nc));
      }
      sa = fma_f(a[j], a[j], sa);
    }
    BARRIER();  // every thread has read part before it is reused
  }
  sa = simd_sum(sa);
  if (lane == 0) part[simd_id] = sa;
  BARRIER();
  float tb = 0.0f;
  UNROLL for (int s = 0; s < TG / 32; ++s) tb += part[s];
  const float ib = rsqrt_f(tb / float(H) + eps);
  const float sv = SCALED ? to_float(scale[0]) : 1.0f;
  float so = 0.0f;
  UNROLL for (int j = 0; j < NPT; ++j) {
    const uint i = tid + uint(TG * j);
    float hv = 0.0f;
    if (i < uint(H)) {
      const float nb = to_float(from_float<T>(a[j] * ib * wv[j]));
      hv = to_float(from_float<T>(xv[j] + nb));
      if (SCALED) hv = to_float(from_float<T>(hv * sv));
      h[base + i] = from_float<T>(hv);
    }
    a[j] = hv;
    so = fma_f(a[j], a[j], so);
  }
  BARRIER();
  so = simd_sum(so);
  if (lane == 0) part[simd_id] = so;
  BARRIER();
  float to = 0.0f;
  UNROLL for (int s = 0; s < TG / 32; ++s) to += part[s];
  const float io = rsqrt_f(to / float(H) + eps);
  UNROLL for (int j = 0; j < NPT; ++j) {
    const uint i = tid + uint(TG * j);
    if (i < uint(H)) {
      n[base + i] = from_float<T>(a[j] * io * nv[j]);
      if (N2) n2[base + i] = from_float<T>(a[j] * io * nv2[j]);
    }
  }
"""

_kernel = Kernel(
    "post_norm_residual",
    inputs=["x", "y", "y2", "w", "w1", "w2", "next_w", "next_w2", "scale", "fparams"],
    outputs=["h", "n", "n2"],
    body=_BODY,
    examples=[
        Example(
            {"x": t, "y": t, "y2": t, "w": wt, "w1": wt, "w2": wt, "next_w": wt, "next_w2": wt,
             "scale": t, "fparams": (mx.float32, 1)},
            {"h": t, "n": t, "n2": t},
            {"T": t, "WT": wt, "H": hh, "TG": tg, "NPT": -(-hh // tg), "TWO": two,
             "SCALED": scaled, "N2": n2},
        )
        for t, wt, hh, tg, two, scaled, n2 in (
            (mx.bfloat16, mx.bfloat16, 2816, 352, 1, 1, 0),
            (mx.float16, mx.float32, 640, 96, 0, 0, 1),
            (mx.float32, mx.float32, 1000, 128, 1, 0, 1),
        )
    ],
)  # fmt: skip

_FLOATS = (mx.float32, mx.float16, mx.bfloat16)


def threads_for(H: int) -> int:
    """Threads per row: about 8 elements each, 64..1024 (a multiple of 32)."""
    return max(64, min(1024, -(-H // 8 // 32) * 32))


def post_norm_residual(
    x: mx.array,
    y: mx.array,
    w: mx.array,
    next_w: mx.array,
    eps: float,
    y2: mx.array | None = None,
    w1: mx.array | None = None,
    w2: mx.array | None = None,
    scale: mx.array | None = None,
    next_w2: mx.array | None = None,
) -> tuple[mx.array, ...]:
    """Dispatcher for ``post_norm_residual_reference`` (same arguments): one kernel on a GPU."""
    H = x.shape[-1]
    arrays = [y, y2] if y2 is not None else [y]
    if any(a.shape != x.shape for a in arrays):
        raise ValueError(f"x {x.shape} and the branch {[a.shape for a in arrays]} differ")
    weights = (
        [w, next_w] + ([w1, w2] if y2 is not None else []) + [v for v in [next_w2] if v is not None]
    )
    if any(v is None or v.shape != (H,) for v in weights):
        raise ValueError(f"every norm weight must be ({H},) (w1 and w2 with a second branch)")
    if scale is not None and scale.size != 1:
        raise ValueError(f"the layer scale must hold one value, got {scale.shape}")
    be = backend()
    if be is not None:
        sig = (
            tuple(a.dtype for a in [x, *arrays]),
            tuple(v.dtype for v in weights),
            None if scale is None else scale.dtype,
        )
        plan = _plan(_kernel, be, x.shape, sig, y2 is not None, next_w2 is not None, float(eps))
        if plan is not None:
            launch, fparams, dummy = plan
            outs = launch(
                inputs=[x, y, y2 if y2 is not None else dummy, w, w1 if w1 is not None else w,
                        w2 if w2 is not None else w, next_w, next_w2 if next_w2 is not None else w,
                        scale if scale is not None else dummy, fparams]
            )  # fmt: skip
            return tuple(outs) if next_w2 is not None else tuple(outs[:2])
    return post_norm_residual_reference(x, y, w, next_w, eps, y2, w1, w2, scale, next_w2)


@lru_cache(maxsize=256)
def _plan(kernel, be, shape, sig, two, n2, eps):
    """(launcher, fparams, stand-in) for one call shape, or None for the reference."""
    (dt, *acts), (wt, *wts), scale_dt = sig
    H, size = shape[-1], math.prod(shape)
    if dt not in _FLOATS or wt not in _FLOATS or any(a != dt for a in acts):
        return None
    if (
        any(v != wt for v in wts)
        or (scale_dt is not None and scale_dt != dt)
        or size == 0
        or H > 16384
    ):
        return None
    tg = threads_for(H)
    launch = kernel.launcher(
        [dt, dt, dt, wt, wt, wt, wt, wt, dt, mx.float32],
        grid=(size // H * tg,),
        threadgroup=(tg,),
        output_shapes=[shape, shape, shape if n2 else (1,)],
        output_dtypes=[dt, dt, dt],
        template={"T": dt, "WT": wt, "H": H, "TG": tg, "NPT": -(-H // tg), "TWO": two,
                  "SCALED": scale_dt is not None, "N2": n2},
        backend=be,
    )  # fmt: skip
    return launch, device_array([eps], mx.float32), device_array([0], dt)
