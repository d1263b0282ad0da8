"""Quantize-on-write for TurboQuant caches: head vectors -> packed rows (codes + scale).

The kernel and its launch, on arrays: the codec's tables come in as arrays and ints. The MLX
reference (the codec's own ``quantize``) and the dispatcher taking a codec sit with the codec, in
``models/turboquant/kernels.py``.
"""

from __future__ import annotations

import math

import mlx.core as mx

from hf2q_mlx.custom_kernels import backend
from hf2q_mlx.custom_kernels._render import Example, Kernel
from hf2q_mlx.custom_kernels.launch_recorder import GraphCaptureError, launch_into


def stored_vectors(x: mx.array, scale: mx.array | None, mean: mx.array | None) -> mx.array:
    """What the codec sees for x (B, H, L, D): (x - mean) / scale per head channel, both (H, D)
    or (B, H, D) (one per batch row) fp32 and optional (``TQBalance``); the kernel folds the same
    transform into its loads."""
    if mean is not None:
        x = x - mean[..., None, :]
    if scale is not None:
        x = x * (1.0 / scale)[..., None, :]
    return x


# Template: T (input dtype), D (dim), P (padded dim, a power of two), BITS, CW (code words),
# HAS_SCALE / HAS_MEAN (the TQBalance transform of the input), ROWS (that transform given per
# batch row: (B, H, D) tables, a static cache's rows each calibrated on its own prompt).
# @SELECT@ defines bz (the batch row) and mean_on; the K + V kernel also picks its side's arrays.
_BODY = """
  // One threadgroup per head vector (gid_x = token, gid_y = head, gid_z = batch of x (B, H, L,
  // D); the K + V kernel: z < B keys, z >= B values), one thread per rotated coordinate (P
  // threads): the balance transform, sign flip,
  // Walsh-Hadamard butterflies in shared memory, the norm from SIMD sums, a binary search of
  // the Lloyd-Max boundaries, the dot of codebook values with the unit coordinates (SIMD sums
  // again) for the stored scale, then thread w < CW assembles packed word w from the codes.
  SHARED float buf[P];
  SHARED float partial[P / 32];
  SHARED float dots[P / 32];
  SHARED uint codes[P];
  SHARED float bnd[1 << BITS];  // the binary search reads these many times: shared, not device
  SHARED float cbk[1 << BITS];
@SELECT@
  const uint head = gid_y;
  const uint row = (bz * ngroups_y + head) * ngroups_x + gid_x;
  const uint j = tid;
  // the balance's row: one (H, D) table, or (B, H, D) with one per batch row (ROWS)
  const uint srow = ROWS ? bz * ngroups_y + head : head;
@OUT_ROW@
  float xv = 0.0f;
  if (j < uint(D)) {
    xv = to_float(x[row * uint(D) + j]);
    if (mean_on) xv -= mean[srow * uint(D) + j];
    if (HAS_SCALE) xv /= scale[srow * uint(D) + j];
  }
  buf[j] = xv * signs[j];
  for (uint i = j; i < (1u << BITS); i += uint(P)) {
    bnd[i] = i + 1 < (1u << BITS) ? boundaries[i] : 0.0f;
    cbk[i] = codebook[i];
  }
  BARRIER();
  for (uint h = 1; h < uint(P); h <<= 1) {
    if (j < uint(P) / 2) {
      const uint i = (j / h) * 2 * h + (j % h);
      const float a = buf[i];
      const float b = buf[i + h];
      buf[i] = a + b;
      buf[i + h] = a - b;
    }
    BARRIER();
  }
  const float y = buf[j] * (1.0f / sqrt_f(float(P)));
  const float sq = simd_sum(y * y);
  if (lane == 0) partial[simd_id] = sq;
  BARRIER();
  float total = 0.0f;
  for (uint s = 0; s < uint(P) / 32; ++s) total += partial[s];
  const float norm = sqrt_f(total);
  // a zero vector: u = 0, its codes decode to zeros times a zero norm
  const float u = y * (sqrt_f(float(P)) / max_f(norm, 1e-30f));
  uint code = 0;
  UNROLL for (int k = BITS - 1; k >= 0; --k) {
    const uint cand = code + (1u << k);
    if (u > bnd[cand - 1]) code = cand;
  }
  codes[j] = code;
  const float cu = simd_sum(cbk[code] * u);
  if (lane == 0) dots[simd_id] = cu;
  BARRIER();
  if (j < uint(CW)) {
    // codes overlapping stream bits [32 j, 32 j + 32): a code may straddle two words
    const uint first = (32 * j) / uint(BITS);
    const uint last = (32 * j + 31) / uint(BITS);
    uint word = 0;
    for (uint i = first; i <= last; ++i) {
      const int sh = int(i * uint(BITS)) - int(32 * j);
      word |= sh >= 0 ? (codes[i] << uint(sh)) : (codes[i] >> uint(-sh));
    }
    out[orow * uint64_t(CW + 1) + j] = word;
  }
  if (j == 0) {
    // scale = norm * P / sum(c * u): the decoded vector's projection on x is exactly |x|
    float dot = 0.0f;
    for (uint s = 0; s < uint(P) / 32; ++s) dot += dots[s];
    const float scale = dot > 0.0f ? norm * (float(P) / dot) : 0.0f;
    out[orow * uint64_t(CW + 1) + uint(CW)] = bitcast<uint>(scale);
  }
"""


def _example(dt, d, p, b, hs, hm, rows, ring=None) -> Example:
    """An example signature; ``ring`` (0 / 1): the in-place kernel's, with its pos input."""
    inputs = {"x": dt, "signs": mx.float32, "scale": mx.float32, "mean": mx.float32,
              "boundaries": mx.float32, "codebook": mx.float32}  # fmt: skip
    template = {"T": dt, "D": d, "P": p, "BITS": b, "CW": p * b // 32, "HAS_SCALE": hs,
                "HAS_MEAN": hm, "ROWS": rows}  # fmt: skip
    if ring is not None:
        inputs["pos"] = mx.int32
        template.update(C=64, RING=ring)
    return Example(inputs, {"out": mx.uint32}, template)


_ONE = "  const uint bz = gid_z;\n  const bool mean_on = HAS_MEAN;"

_kernel = Kernel(
    "tq_quantize",
    inputs=["x", "signs", "scale", "mean", "boundaries", "codebook"],
    outputs=["out"],
    body=_BODY.replace("@SELECT@", _ONE).replace("@OUT_ROW@", "  const uint64_t orow = row;"),
    examples=[
        _example(mx.float16, 256, 256, 4, 1, 0, 0),
        _example(mx.bfloat16, 512, 512, 3, 1, 1, 1),
        _example(mx.float32, 96, 128, 8, 0, 0, 0),
    ],
)


# The same kernel writing each packed row into a cache's slot in place (a recorded CUDA graph's
# TurboQuant write: no separate kv_write_words launch). Cache (B, H, C, CW + 1) words; the
# token's slot is pos[batch] + token (modulo C with RING).
_INTO_ROW = """  uint slot = uint(pos[bz]) + gid_x;
  if (RING) slot %= uint(C);
  const uint64_t orow = uint64_t(bz * ngroups_y + head) * uint64_t(C) + slot;"""

_into_kernel = Kernel(
    "tq_quantize_into",
    inputs=["x", "signs", "scale", "mean", "boundaries", "codebook", "pos"],
    outputs=["out"],
    body=_BODY.replace("@SELECT@", _ONE).replace("@OUT_ROW@", _INTO_ROW),
    examples=[
        _example(mx.bfloat16, 256, 256, 8, 1, 1, 1, ring=1),
        _example(mx.float16, 96, 128, 4, 1, 0, 1, ring=0),
    ],
)


# K and V of one layer's tokens into their two caches in ONE launch (grid z = 2B), each side with
# its own signs, balance and codebook; the same D, P and BITS on both, the mean on K only (a
# TurboQuant cache centers keys, never values).
_KV_SELECT = """  const bool is_v = gid_z >= ngroups_z / 2;
  const uint bz = is_v ? gid_z - ngroups_z / 2 : gid_z;
  const bool mean_on = HAS_MEAN && !is_v;
  DEVICE_PTR(const T) x = is_v ? vx : kx;
  DEVICE_PTR(const float) signs = is_v ? vsigns : ksigns;
  DEVICE_PTR(const float) scale = is_v ? vscale : kscale;
  DEVICE_PTR(const float) mean = kmean;
  DEVICE_PTR(const float) boundaries = is_v ? vboundaries : kboundaries;
  DEVICE_PTR(const float) codebook = is_v ? vcodebook : kcodebook;
  DEVICE_PTR(uint) out = is_v ? vout : kout;"""

KV_INPUTS = ["kx", "vx", "ksigns", "kscale", "kmean", "kboundaries", "kcodebook", "vsigns",
             "vscale", "vboundaries", "vcodebook", "pos"]  # fmt: skip


def _kv_example(dt, d, p, b, hs, hm, ring) -> Example:
    inputs = {name: mx.float32 for name in KV_INPUTS}
    inputs.update(kx=dt, vx=dt, pos=mx.int32)
    template = {"T": dt, "D": d, "P": p, "BITS": b, "CW": p * b // 32, "HAS_SCALE": hs,
                "HAS_MEAN": hm, "ROWS": 1, "C": 64, "RING": ring}  # fmt: skip
    return Example(inputs, {"kout": mx.uint32, "vout": mx.uint32}, template)


_kv_into_kernel = Kernel(
    "tq_quantize_kv_into",
    inputs=KV_INPUTS,
    outputs=["kout", "vout"],
    body=_BODY.replace("@SELECT@", _KV_SELECT).replace("@OUT_ROW@", _INTO_ROW),
    examples=[
        _kv_example(mx.bfloat16, 256, 256, 8, 1, 1, 1),
        _kv_example(mx.float16, 96, 128, 4, 1, 0, 0),
    ],
)


def _launch(kernel: Kernel, x_shape: tuple, dtype: mx.Dtype, padded_dim: int, bits: int,
            has_scale: bool, has_mean: bool, rows: bool, out_shape=None, **template):  # fmt: skip
    """One threadgroup of P threads per head vector of x (B, H, L, D) (of K and of V for the
    two-output kernel): ``kernel``'s launch writing (B, H, L, words) rows, or ``out_shape``
    (an in-place cache, extra ``template`` values); None where the kernel does not apply."""
    B, H, L, D = x_shape
    P, CW = padded_dim, padded_dim * bits // 32
    if dtype not in (mx.float16, mx.bfloat16, mx.float32) or P > 1024 or B * H * L == 0:
        return None
    sides = len(kernel.outputs)  # 2: the K + V kernel, its grid z = 2B
    in_dtypes = [dtype if n in ("x", "kx", "vx") else mx.int32 if n == "pos" else mx.float32
                 for n in kernel.inputs]  # fmt: skip
    return kernel.launcher(
        in_dtypes,
        grid=(L * P, H, sides * B),
        threadgroup=(P, 1, 1),
        output_shapes=[tuple(out_shape or (B, H, L, CW + 1))] * sides,
        output_dtypes=[mx.uint32] * sides,
        template={"T": dtype, "D": D, "P": P, "BITS": bits, "CW": CW,
                  "HAS_SCALE": int(has_scale), "HAS_MEAN": int(has_mean), "ROWS": int(rows),
                  **template},
    )  # fmt: skip


def _table_inputs(signs, scale, mean, boundaries, codebook) -> tuple[bool, list[mx.array]]:
    """(the tables are per batch row, the kernel's inputs after x): an absent scale or mean
    passes the stand-in its template flag skips."""
    given = [a for a in (scale, mean) if a is not None]
    one = stand_in()
    tables = [signs, one if scale is None else scale, one if mean is None else mean,
              boundaries, codebook]  # fmt: skip
    return bool(given) and given[0].ndim == 3, tables


def into_launch(cache_shape: tuple, x_shape: tuple, dtype: mx.Dtype, padded_dim: int, bits: int,
                has_scale: bool, has_mean: bool, rows: bool, ring: bool):  # fmt: skip
    """The launch quantizing x (B, H, L, D) into a cache of ``cache_shape`` (B, H, C, words) at
    each batch row's slots (``tq_quantize_into``), or None where the kernel does not apply."""
    B, H = x_shape[:2]
    if tuple(cache_shape[:2]) != (B, H) or cache_shape[3] != padded_dim * bits // 32 + 1:
        return None
    return _launch(_into_kernel, x_shape, dtype, padded_dim, bits, has_scale, has_mean, rows,
                   cache_shape, C=cache_shape[2], RING=int(ring))  # fmt: skip


def kv_into_launch(cache_shape: tuple, x_shape: tuple, dtype: mx.Dtype, padded_dim: int,
                   bits: int, has_scale: bool, has_mean: bool, ring: bool):  # fmt: skip
    """The one launch quantizing keys and values, both x (B, H, L, D) with (B, H, D) tables, into
    their caches, both of ``cache_shape`` (``tq_quantize_kv_into``); None where it does not
    apply (then a launch each)."""
    B, H = x_shape[:2]
    if tuple(cache_shape[:2]) != (B, H) or cache_shape[3] != padded_dim * bits // 32 + 1:
        return None
    return _launch(_kv_into_kernel, x_shape, dtype, padded_dim, bits, has_scale, has_mean, True,
                   cache_shape, C=cache_shape[2], RING=int(ring))  # fmt: skip


def quantize_kv_rows_into(
    caches: tuple[mx.array, mx.array],
    xs: tuple[mx.array, mx.array],
    tables: tuple[tuple, tuple],
    bits: int,
    pos: mx.array,
    ring: bool,
) -> tuple[mx.array, mx.array] | None:
    """In a recording: keys and values (``xs``, each (B, H, L, dim)) quantized into their
    ``caches`` (B, H, C, words) at slots pos[b] + l in ONE launch; the same arrays back, or None
    where the pair does not share one (other shapes, dtypes, widths or bits, a table not per
    batch row, a mean on the values: then ``quantize_rows_into`` twice). ``tables``: per side
    (signs, scale, mean, boundaries, codebook) as ``quantize_rows_into`` takes them."""
    (kc, vc), (xk, xv) = caches, xs
    (ks, kscale, kmean, kb, kcb), (vs, vscale, vmean, vb, vcb) = tables
    if (
        kc.shape != vc.shape or xk.shape != xv.shape or xk.dtype != xv.dtype
        or ks.shape != vs.shape or vmean is not None or (kscale is None) != (vscale is None)
        or any(t is not None and t.ndim != 3 for t in (kscale, kmean, vscale))
    ):  # fmt: skip
        return None
    launch = kv_into_launch(tuple(kc.shape), tuple(xk.shape), xk.dtype, ks.shape[0], bits,
                            kscale is not None, kmean is not None, ring)  # fmt: skip
    if launch is None:
        return None
    one = stand_in()
    inputs = [xk, xv, ks, one if kscale is None else kscale, one if kmean is None else kmean,
              kb, kcb, vs, one if vscale is None else vscale, vb, vcb, pos]  # fmt: skip
    kc, vc = launch_into(launch, inputs, [kc, vc])
    return kc, vc


def quantize_rows_into(
    cache: mx.array,
    x: mx.array,
    signs: mx.array,
    boundaries: mx.array,
    codebook: mx.array,
    bits: int,
    scale: mx.array | None,
    mean: mx.array | None,
    pos: mx.array,
    ring: bool,
) -> mx.array:
    """In a recording: x (B, H, L, dim) quantized straight into ``cache`` (B, H, C, words) at
    slots pos[b] + l (modulo C for a ring), in place; the same array back. ``scale`` / ``mean``
    as ``quantize_rows``' (B, H, dim) tables. Raises GraphCaptureError where it does not apply."""
    rows, tables = _table_inputs(signs, scale, mean, boundaries, codebook)
    launch = into_launch(tuple(cache.shape), tuple(x.shape), x.dtype, signs.shape[0], bits,
                         scale is not None, mean is not None, rows, ring)  # fmt: skip
    if launch is None:
        raise GraphCaptureError(f"tq_quantize_into: no kernel for {x.shape} into {cache.shape}")
    return launch_into(launch, [x, *tables, pos], [cache])[0]


_PLANS: dict[tuple, tuple | None] = {}
_STAND_IN: list = []


def stand_in() -> mx.array:
    """Passed for an absent scale or offset (the TurboQuant kernels skip it under a template
    flag: HAS_SCALE / HAS_MEAN here, HAS_KS / HAS_VS in flash-decode); made once."""
    if not _STAND_IN:
        _STAND_IN.append(mx.ones((8,), dtype=mx.float32))
    return _STAND_IN[0]


def _plan(
    shape: tuple,
    dtype: mx.Dtype,
    padded_dim: int,
    bits: int,
    has_scale: bool,
    has_mean: bool,
    rows: bool = False,
):
    """The resolved launch for one call signature, or None where the kernel does not apply."""
    if dtype not in (mx.float16, mx.bfloat16, mx.float32) or padded_dim > 1024:
        return None
    if len(shape) != 4:
        if has_scale or has_mean:
            raise ValueError(f"tq_quantize with a scale or mean takes (B, H, L, D), got {shape}")
        shape = (1, 1, math.prod(shape[:-1]), shape[-1])
    launch = _launch(_kernel, shape, dtype, padded_dim, bits, has_scale, has_mean, rows)
    return None if launch is None else (launch, shape)


def quantize_rows(
    x: mx.array,
    signs: mx.array,
    boundaries: mx.array,
    codebook: mx.array,
    bits: int,
    scale: mx.array | None = None,
    mean: mx.array | None = None,
) -> mx.array | None:
    """x (B, H, L, dim) -> packed rows (B, H, L, P * bits / 32 + 1) uint32 on the GPU kernel, or
    None where it does not run (no GPU back end, a dtype or size it does not cover): the caller
    then runs its reference.

    ``signs`` (P,): the rotation's signs, P = dim padded to a power of two; ``boundaries`` /
    ``codebook``: the Lloyd-Max tables for ``bits``; ``scale`` / ``mean`` (H, dim) fp32 are folded
    into the kernel (it stores (x - mean) / scale), or (B, H, dim): one table per batch row. Without
    them any (..., dim) is accepted.
    """
    if backend() is None:
        return None
    P = signs.shape[0]
    rows, tables = _table_inputs(signs, scale, mean, boundaries, codebook)
    # ints only: the key is built every call
    key = (x.shape, x.dtype, P, bits, scale is not None, mean is not None, rows)
    plan = _PLANS.get(key, _MISSING)
    if plan is _MISSING:
        if len(_PLANS) >= 1024:  # one per prompt length: stay bounded
            _PLANS.clear()
        has = (scale is not None, mean is not None)
        plan = _PLANS[key] = _plan(x.shape, x.dtype, P, bits, *has, rows)
    if plan is None:
        return None
    launch, shape = plan
    out = launch(inputs=[x.reshape(shape) if x.ndim != 4 else x, *tables])[0]
    return out if x.ndim == 4 else out.reshape(*x.shape[:-1], out.shape[-1])


_MISSING = object()
