"""Logit soft-capping: cap * tanh(x / cap), elementwise."""

from __future__ import annotations

import math
from functools import lru_cache

import mlx.core as mx

from hf2q_mlx.custom_kernels import backend, device_constant
from hf2q_mlx.custom_kernels._render import Example, Kernel


def softcap_reference(x: mx.array, cap: float) -> mx.array:
    """cap * tanh(x / cap) in fp32, returned in x.dtype."""
    return (mx.tanh(x.astype(mx.float32) / cap) * cap).astype(x.dtype)


_BODY = """
  // One thread per element; the cap arrives as a 1-element fp32 array.
  const uint64_t e = uint64_t(gid_x) * tg_size + tid;
  if (e >= uint64_t(n[0])) return;
  out[e] = from_float<T>(tanh_f(to_float(x[e]) / cap[0]) * cap[0]);
"""

_kernel = Kernel(
    "softcap",
    inputs=["x", "cap", "n"],
    outputs=["out"],
    body=_BODY,
    examples=[
        Example({"x": t, "cap": (mx.float32, 1), "n": (mx.uint32, 1)}, {"out": t}, {"T": t})
        for t in (mx.float32, mx.bfloat16, mx.float16)
    ],
)

_FLOATS = (mx.float32, mx.float16, mx.bfloat16)


def softcap(x: mx.array, cap: float) -> mx.array:
    """Dispatcher: the kernel for float arrays under 2^32 elements, else the reference."""
    if not cap > 0:
        raise ValueError(f"softcap must be > 0, got {cap}")
    be = backend()
    if be is not None:
        plan = _plan(_kernel, be, x.shape, x.dtype, cap)
        if plan is not None:
            launch, cap_arr, n_arr = plan
            return launch(inputs=[x, cap_arr, n_arr])[0]
    return softcap_reference(x, cap)


@lru_cache(maxsize=64)
def _plan(kernel, be, shape, dtype, cap):
    """(launcher, cap, n) for one call shape, or None for the reference."""
    size = math.prod(shape)
    if dtype not in _FLOATS or not 0 < size < 2**32:
        return None
    launch = kernel.launcher(
        [dtype, mx.float32, mx.uint32],
        grid=(size,),
        threadgroup=(256,),
        output_shapes=[shape],
        output_dtypes=[dtype],
        template={"T": dtype},
        backend=be,
    )
    return launch, device_constant((float(cap),), mx.float32), device_constant((size,), mx.uint32)
