"""The ops a recorded CUDA graph step runs where the MLX step uses MLX ops (launch_recorder):
a KV row written into the cache in place, an embedding table's raw rows gathered, and the
embedding's cast-and-scale. Each has its reference (what the MLX step computes) and a kernel;
``kv_write`` only exists in place, so it runs only inside a recording (or, in tests, as a
launch whose output is a fresh array: the written slots are checked, the rest stay poisoned).
"""

from __future__ import annotations

import mlx.core as mx

from hf2q_mlx.custom_kernels import device_constant
from hf2q_mlx.custom_kernels._render import Example, Kernel
from hf2q_mlx.custom_kernels.launch_recorder import GraphCaptureError, active, launch_into

_F = (mx.float32, mx.float16, mx.bfloat16)

# ---- KV cache write ----------------------------------------------------------------------------


def kv_write_reference(cache: mx.array, src: mx.array, pos: mx.array, ring: bool) -> mx.array:
    """cache (B, H, C, D) with src (B, H, L, D) written at each row's slots pos[b] + l (modulo
    C for a ring), as ``models.static_cache`` writes them."""
    B, H, L, D = src.shape
    slots = pos[:, None] + mx.arange(L)[None]  # (B, L)
    if ring:
        slots = slots % cache.shape[2]
    idx = mx.broadcast_to(slots[:, None, :, None], (B, H, L, D))
    return mx.put_along_axis(cache, idx, src.astype(cache.dtype), axis=2)


_KV_BODY = """
  // One thread per element of src (B, H, L, D): copied to its row's slot of the cache.
  const uint e = gid_x * tg_size + tid;
  if (e >= N) return;
  const uint d = e % D;
  const uint l = (e / D) % L;
  const uint bh = e / (D * L);
  uint slot = uint(pos[bh / H]) + l;
  if (RING) slot %= C;
  cache[(uint64_t(bh) * C + slot) * D + d] = from_float<TO>(to_float(src[e]));
"""

_kv_kernel = Kernel(
    "kv_write",
    inputs=["src", "pos"],
    outputs=["cache"],
    body=_KV_BODY,
    examples=[
        Example(
            {"src": t, "pos": mx.int32},
            {"cache": t},
            {"TO": t, "N": 64, "H": 2, "L": 1, "C": 16, "D": 32, "RING": 1},
        )
        for t in _F
    ],
)


def kv_write_launch(cache_shape, cache_dtype, src_shape, src_dtype, ring: bool):
    """The launch (``Kernel.launcher``) writing src into a cache of this shape."""
    B, H, C, D = cache_shape
    L = src_shape[2]
    n = B * H * L * D
    return _kv_kernel.launcher(
        [src_dtype, mx.int32],
        grid=(n,),
        threadgroup=(256,),
        output_shapes=[tuple(cache_shape)],
        output_dtypes=[cache_dtype],
        template={"TO": cache_dtype, "N": n, "H": H, "L": L, "C": C, "D": D, "RING": int(ring)},
    )


def kv_write(cache: mx.array, src: mx.array, pos: mx.array, ring: bool) -> mx.array:
    """In a recording: the cache written in place (the same array back). Elsewhere the
    reference (an MLX scatter, a new array)."""
    if not active():
        return kv_write_reference(cache, src, pos, ring)
    if cache.dtype not in _F or src.dtype not in _F or cache.size >= 2**32:
        raise GraphCaptureError(f"kv_write: no kernel for a {cache.dtype} cache of {cache.shape}")
    launch = kv_write_launch(cache.shape, cache.dtype, src.shape, src.dtype, ring)
    return launch_into(launch, [src, pos], [cache])[0]


# ---- embedding rows --------------------------------------------------------------------------

_ROWS_BODY = """
  // One thread per 32-bit word of the output (R, W): a word of row ids[r] of the table.
  const uint e = gid_x * tg_size + tid;
  if (e >= R * W) return;
  const uint r = e / W;
  out[e] = table[uint64_t(uint(ids[r])) * W + (e % W)];
"""

_rows_kernel = Kernel(
    "gather_rows",
    inputs=["table", "ids"],
    outputs=["out"],
    body=_ROWS_BODY,
    examples=[Example({"table": mx.uint32, "ids": mx.int32}, {"out": mx.uint32}, {"R": 2, "W": 8})],
)


def gather_rows(table: mx.array, ids: mx.array) -> mx.array:
    """table (V, row_bytes) uint8, ids (...) int -> (ids.size, row_bytes): ``table[ids]`` as one
    kernel when recording and row_bytes is whole 32-bit words; MLX's gather otherwise."""
    V, RB = table.shape
    R = ids.size
    if not active() or RB % 4 or table.dtype != mx.uint8 or ids.dtype != mx.int32:
        return table[ids.reshape(-1)]
    W = RB // 4
    launch = _rows_kernel.launcher(
        [mx.uint32, mx.int32],
        grid=(R * W,),
        threadgroup=(256,),
        output_shapes=[(R, W)],
        output_dtypes=[mx.uint32],
        template={"R": R, "W": W},
    )
    return launch(inputs=[table.view(mx.uint32), ids.reshape(-1)])[0].view(mx.uint8)


# ---- embedding scale ---------------------------------------------------------------------------


def scale_cast_reference(x: mx.array, scale: float, dtype: mx.Dtype) -> mx.array:
    """``x.astype(dtype) * scale`` with the scale rounded to ``dtype`` first (Gemma's embedding
    scale, rounded like the weights)."""
    return x.astype(dtype) * mx.array(scale, dtype=dtype)


_SCALE_BODY = """
  // One thread per element: cast to T, times the scale (already rounded to T), rounded to T.
  const uint e = gid_x * tg_size + tid;
  if (e >= N) return;
  out[e] = from_float<T>(to_float(from_float<T>(to_float(x[e]))) * scale[0]);
"""

_scale_kernel = Kernel(
    "scale_cast",
    inputs=["x", "scale"],
    outputs=["out"],
    body=_SCALE_BODY,
    examples=[
        Example({"x": mx.float32, "scale": (mx.float32, 1)}, {"out": t}, {"T": t, "N": 64})
        for t in _F
    ],
)


def scale_cast(x: mx.array, scale: float, dtype: mx.Dtype) -> mx.array:
    """``scale_cast_reference`` as one kernel when recording (fp32 x); the reference elsewhere."""
    if not active() or x.dtype != mx.float32 or dtype not in _F:
        return scale_cast_reference(x, scale, dtype)
    s = mx.array(scale, dtype=dtype).astype(mx.float32).item()
    launch = _scale_kernel.launcher(
        [mx.float32, mx.float32],
        grid=(x.size,),
        threadgroup=(256,),
        output_shapes=[x.shape],
        output_dtypes=[dtype],
        template={"T": dtype, "N": x.size},
    )
    return launch(inputs=[x, device_constant((s,), mx.float32)])[0]


def cast(x: mx.array, dtype: mx.Dtype) -> mx.array:
    """``x.astype(dtype)``; in a recording of fp32 x, the cast-and-scale kernel with scale 1
    (exact: a rounded value times 1 is itself)."""
    if not active() or x.dtype != mx.float32 or dtype not in _F or x.dtype == dtype:
        return x.astype(dtype)
    return scale_cast(x, 1.0, dtype)
