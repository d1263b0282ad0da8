"""Dequantization of GGML blocks: bit-exact plain-MLX decoders (oracle and CPU path), the GPU
dequantizer, and the embedding lookup."""

from __future__ import annotations

import mlx.core as mx
from gguf import GGMLQuantizationType as T

from hf2q_mlx.custom_kernels import backend, device_array, env_int
from hf2q_mlx.custom_kernels._render import Example, Kernel
from hf2q_mlx.custom_kernels.ggml_formats import (
    BLOCK_FORMATS,
    BLOCK_TYPES,
    DENSE_TYPES,
    GGML_BLOCK_INFO,
    block_info,
    fill_format,
    kernel_header,
    row_bytes,
    type_name,
)
from hf2q_mlx.custom_kernels.graph_ops import gather_rows
from hf2q_mlx.errors import WeightMismatchError

# the format names callers import from here, with the decoders
__all__ = [
    "BLOCK_TYPES",
    "DENSE_TYPES",
    "GGML_BLOCK_INFO",
    "dequantize_reference",
    "ggml_dequantize_kernel",
    "ggml_get_rows",
    "row_bytes",
]

_DENSE_DTYPES = {T.F32: mx.float32, T.F16: mx.float16, T.BF16: mx.bfloat16}


def _f16(b: mx.array, offset: int) -> mx.array:
    """The fp16 field at byte ``offset`` of each block (..., nbytes) as fp32 (..., 1)."""
    return b[..., offset : offset + 2].view(mx.float16).astype(mx.float32)


def _unpack(x: mx.array, run: int, bits: int) -> mx.array:
    """Split each byte of x (..., n) into 8 // bits fields -> (..., n * 8 // bits) uint8.

    Bytes are taken in runs of ``run``; each run yields its lowest fields (bits 0..bits-1) for all
    its bytes first, then the next shift: the element order of every GGML block format.
    """
    shifts = mx.arange(0, 8, bits, dtype=mx.uint8)[:, None]  # (8 // bits, 1)
    runs = x.reshape(*x.shape[:-1], -1, 1, run)  # (..., n // run, 1, run)
    return ((runs >> shifts) & ((1 << bits) - 1)).reshape(*x.shape[:-1], -1)


def _k4_scales_mins(s: mx.array) -> tuple[mx.array, mx.array]:
    """Q4_K / Q5_K: 12 bytes (..., 12) -> eight 6-bit scales and eight 6-bit mins, uint8."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    scales = mx.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = mx.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return scales, mins


# Each decoder maps blocks (..., bytes per block) uint8 -> (..., elements per block) fp32. The
# float operations and their order follow gguf-py's quants.py (which mirrors ggml-quants.c), so
# every product and difference rounds exactly as there: e.g. Q4_K is (d * sc) * q - (dmin * m).


def _q4_0(b: mx.array) -> mx.array:
    q = _unpack(b[..., 2:], 16, 4).astype(mx.int8) - 8
    return _f16(b, 0) * q.astype(mx.float32)


def _q4_1(b: mx.array) -> mx.array:
    q = _unpack(b[..., 4:], 16, 4).astype(mx.float32)
    return _f16(b, 0) * q + _f16(b, 2)


def _q5(b: mx.array, offset: int) -> mx.array:
    """Q5_0 / Q5_1 quants (..., 32) uint8: a 4-byte high-bit mask at ``offset``, then nibbles."""
    qh = _unpack(b[..., offset : offset + 4], 1, 1)  # bit j of the little-endian uint32
    return _unpack(b[..., offset + 4 :], 16, 4) | (qh << 4)


def _q5_0(b: mx.array) -> mx.array:
    q = _q5(b, 2).astype(mx.int8) - 16
    return _f16(b, 0) * q.astype(mx.float32)


def _q5_1(b: mx.array) -> mx.array:
    return _f16(b, 0) * _q5(b, 4).astype(mx.float32) + _f16(b, 2)


def _q8_0(b: mx.array) -> mx.array:
    return b[..., 2:].view(mx.int8).astype(mx.float32) * _f16(b, 0)


def _q2_k(b: mx.array) -> mx.array:
    # 16 scale bytes (low nibble scale, high nibble min), 64 quant bytes, d, dmin
    sc = b[..., 0:16]
    dl = (_f16(b, 80) * (sc & 0x0F).astype(mx.float32))[..., None]  # (..., 16, 1)
    ml = (_f16(b, 82) * (sc >> 4).astype(mx.float32))[..., None]
    q = _unpack(b[..., 16:80], 32, 2).astype(mx.float32)
    q = q.reshape(*b.shape[:-1], 16, 16)
    return (dl * q - ml).reshape(*b.shape[:-1], 256)


def _q3_k(b: mx.array) -> mx.array:
    # 32 high-bit mask bytes, 64 quant bytes (2 low bits each), 12 bytes of 6-bit scales, d
    s = b[..., 96:108]
    sc = _unpack(s[..., 0:8], 8, 4) | (_unpack(s[..., 8:12], 4, 2) << 4)  # (..., 16) 0..63
    sc = (sc.astype(mx.int8) - 32).astype(mx.float32)
    dl = (_f16(b, 108) * sc)[..., None]  # (..., 16, 1)
    ql = _unpack(b[..., 32:96], 32, 2).astype(mx.int8)
    # a cleared mask bit subtracts 4
    qh = ((_unpack(b[..., 0:32], 32, 1) ^ 1) << 2).astype(mx.int8)
    q = (ql - qh).astype(mx.float32).reshape(*b.shape[:-1], 16, 16)
    return (dl * q).reshape(*b.shape[:-1], 256)


def _q45_k(b: mx.array, q: mx.array) -> mx.array:
    """Q4_K / Q5_K: d, dmin, 12 scale bytes at the block start; q (..., 256) uint8 quants."""
    sc, m = _k4_scales_mins(b[..., 4:16])
    dl = (_f16(b, 0) * sc.astype(mx.float32))[..., None]  # (..., 8, 1)
    ml = (_f16(b, 2) * m.astype(mx.float32))[..., None]
    q = q.astype(mx.float32).reshape(*b.shape[:-1], 8, 32)
    return (dl * q - ml).reshape(*b.shape[:-1], 256)


def _q4_k(b: mx.array) -> mx.array:
    return _q45_k(b, _unpack(b[..., 16:144], 32, 4))


def _q5_k(b: mx.array) -> mx.array:
    qh = _unpack(b[..., 16:48], 32, 1)
    return _q45_k(b, _unpack(b[..., 48:176], 32, 4) | (qh << 4))


def _q6_k(b: mx.array) -> mx.array:
    # 128 low-nibble bytes, 64 bytes of 2-bit high parts, 16 int8 scales, d
    dl = (_f16(b, 208) * b[..., 192:208].view(mx.int8).astype(mx.float32))[..., None]
    q = _unpack(b[..., 0:128], 64, 4) | (_unpack(b[..., 128:192], 32, 2) << 4)
    q = (q.astype(mx.int8) - 32).astype(mx.float32).reshape(*b.shape[:-1], 16, 16)
    return (dl * q).reshape(*b.shape[:-1], 256)


_DECODERS = {
    T.Q4_0: _q4_0,
    T.Q4_1: _q4_1,
    T.Q5_0: _q5_0,
    T.Q5_1: _q5_1,
    T.Q8_0: _q8_0,
    T.Q2_K: _q2_k,
    T.Q3_K: _q3_k,
    T.Q4_K: _q4_k,
    T.Q5_K: _q5_k,
    T.Q6_K: _q6_k,
}


def dequantize_reference(raw: mx.array, ggml_type: int, cols: int) -> mx.array:
    """raw (..., row_bytes) uint8 GGML blocks -> (..., cols) fp32, bit-exact with gguf-py.

    F32/F16/BF16 rows may also come in their own dtype (..., cols), as ``GGUFFile.to_mx`` gives.
    """
    block, nbytes = block_info(ggml_type)
    if ggml_type in DENSE_TYPES and raw.dtype == _DENSE_DTYPES[ggml_type]:
        if raw.ndim == 0 or raw.shape[-1] != cols:
            raise WeightMismatchError(f"expected rows of {cols} elements, got shape {raw.shape}")
        return raw.astype(mx.float32)
    expected = row_bytes(ggml_type, cols)
    if raw.dtype != mx.uint8 or raw.ndim == 0 or raw.shape[-1] != expected:
        raise WeightMismatchError(
            f"{type_name(ggml_type)} rows of {cols} elements are {expected} uint8 bytes; "
            f"got {raw.dtype} of shape {raw.shape}"
        )
    lead = raw.shape[:-1]
    if ggml_type in DENSE_TYPES:
        return raw.view(_DENSE_DTYPES[ggml_type]).astype(mx.float32)
    blocks = raw.reshape(*lead, cols // block, nbytes)
    return _DECODERS[ggml_type](blocks).reshape(*lead, cols)


# --------------------------------------------------------------------------------------------
# GPU dequantizer: each format's C decoder (ggml_formats), one thread per lane unit of a block.

# A lane unit's weights decoded and stored through ``o`` (global memory, or the staged
# kernel's shared memory): the two dequantizers' common loop.
_DECODE_UNIT = r"""
  UNROLL for (int g = 0; g < int(NG); ++g) {
    float wv[GS];
    float sc;
    float bi;
    dq_@suf@(raw, t, g, wv, &sc, &bi);
    UNROLL for (int i = 0; i < int(GS); ++i) {
      // wv carries 2^p: fold 2^-p into the scale (exact), so sc2 * wv rounds once as d * q
      const float sc2 = sc * (1.0f / float(1u << (p0_@suf@(g, i >> 2) + 8 * (i & 1))));
      o[xoff_@suf@(t, g, i >> 2) + uint(i & 3)] = from_float<T>(sc2 * wv[i] + bi);
    }
  }
""".lstrip("\n")

_DEQ_BODY = r"""
  // Thread mapping: one thread per (row, block, lane unit t), writing the unit's weights.
  constexpr uint QK = @QK@, BB = @BB@, LPB = @LPB@, NG = @NG@, GS = @GS@;
  const uint N = uint(dims[0]);
  const uint K = uint(dims[1]);
  const uint nb = K / QK;
  const uint row = pos_x / (nb * LPB);
  const uint blk = (pos_x / LPB) % nb;
  const uint t = pos_x % LPB;
  if (row >= N) return;  // no barriers or SIMD operations below
  const Raw@SUF@ raw = load_@suf@(w + size_t(row) * nb * BB + size_t(blk) * BB, t);
  DEVICE_PTR(T) o = out + size_t(row) * K + size_t(blk) * QK;
@DECODE_UNIT@"""

# The same decode with the stores staged: a threadgroup's blocks are one contiguous run of the
# output, so they go to shared memory first and leave as 16-byte words, consecutive threads on
# consecutive words. (_DEQ_BODY's lanes each store 2-4 byte scalars 8-32 bytes apart: on the
# H200 it reaches ~600 GB/s, session 37, where a copy runs ~4 TB/s.) Each block's run in shared
# memory is padded by one word, so the SIMD group's blocks start in different banks.
_DEQ_STAGED_BODY = r"""
  // Thread mapping: thread tid of threadgroup gid_x decodes lane unit t = tid % LPB of block
  // gid_x * BPT + tid / LPB (blocks numbered row-major over (N, K / QK)) into shared memory;
  // then all BPT * LPB threads write the threadgroup's blocks, one run of out, word by word.
  constexpr uint QK = @QK@, BB = @BB@, LPB = @LPB@, NG = @NG@, GS = @GS@;
  constexpr uint WPB = QK * uint(sizeof(T)) / 16;  // 16-byte words of one block's output
  SHARED uint4 stage4[BPT * (WPB + 1)];
  const uint N = uint(dims[0]);
  const uint K = uint(dims[1]);
  const size_t total = size_t(N) * (K / QK);  // blocks
  const size_t b0 = size_t(gid_x) * BPT;
  const uint lb = tid / LPB;
  const uint t = tid % LPB;
  if (b0 + lb < total) {
    const Raw@SUF@ raw = load_@suf@(w + (b0 + lb) * BB, t);
    SHARED_PTR(T) o = (SHARED_PTR(T))(stage4 + lb * (WPB + 1));
@DECODE_UNIT@  }
  BARRIER();
  const size_t left = total - b0;
  const uint words = uint(left < size_t(BPT) ? left : size_t(BPT)) * WPB;
  DEVICE_PTR(uint4) dst = DEVICE_CAST(uint4, out + b0 * QK);
  for (uint i = tid; i < words; i += BPT * LPB) dst[i] = stage4[(i / WPB) * (WPB + 1) + i % WPB];
"""
_STAGE_BYTES = 16384  # shared memory a staged threadgroup's blocks take (padding aside)


def _staged_blocks(qk: int, lanes: int, dtype: mx.Dtype) -> int:
    """Blocks a staged threadgroup decodes: _STAGE_BYTES of output, 256 threads at most."""
    return max(1, min(_STAGE_BYTES // (qk * dtype.size), 256 // lanes))


def _make_kernel(ggml_type: int, staged: bool = False) -> Kernel:
    f = BLOCK_FORMATS[ggml_type]
    body = (_DEQ_STAGED_BODY if staged else _DEQ_BODY).replace("@DECODE_UNIT@", _DECODE_UNIT)
    examples = [
        Example(
            {"w": mx.uint8, "dims": (mx.int32, 2)},
            {"out": dt},
            {"T": dt, "BPT": _staged_blocks(f.block_size, f.lanes, dt)} if staged else {"T": dt},
        )
        for dt in (mx.float32, mx.bfloat16)
    ]
    return Kernel(
        f"ggml_dequant_{'staged_' if staged else ''}{T(ggml_type).name.lower()}",
        inputs=["w", "dims"],
        outputs=["out"],
        body=fill_format(body, ggml_type),
        header=kernel_header(ggml_type),
        examples=examples,
    )


def staged_stores() -> bool:
    """``HF2Q_DEQUANT_STAGED`` (read per call; 1 on, 0 off, unset: on with MLX's CUDA back end,
    off elsewhere, where it is not yet timed): the GPU dequantizer's stores through shared
    memory (_DEQ_STAGED_BODY). Same values, bit for bit (the emulator tests and, on CUDA, the
    GPU tests compare both kernels). Session 38 (H100, Gemma-4-31B's Q4_K linears at 2,048
    tokens): 2,840-2,890 GB/s against 460 for the plain kernel's stores; the whole 31B
    prefill 1.37-2.0x."""
    on = env_int("HF2Q_DEQUANT_STAGED", 0, 1)
    return backend() == "cuda" if on is None else on == 1


_KERNELS: dict[int, Kernel] = {t: _make_kernel(t) for t in BLOCK_FORMATS}
_STAGED: dict[int, Kernel] = {t: _make_kernel(t, staged=True) for t in BLOCK_FORMATS}
_PLANS: dict[tuple, tuple] = {}  # (type, rows, cols, dtype, staged) -> (launch, dims array)


def ggml_dequantize_kernel(w_raw: mx.array, ggml_type: int, in_features: int, dtype: mx.Dtype):
    """The GPU dequantizer: w_raw (N, row_bytes) -> (N, in_features) in ``dtype``.

    Equal to ``dequantize_reference`` up to one rounding (the GPU may fuse scale * q + bias)
    and the final cast to ``dtype``.
    """
    n = w_raw.shape[0]
    staged = staged_stores()
    key = (ggml_type, n, in_features, dtype, staged)
    plan = _PLANS.get(key)
    if plan is None:
        f = BLOCK_FORMATS[ggml_type]
        blocks = n * (in_features // f.block_size)
        # resolved once per shape; the dims array too (a host-made array per call costs more)
        if staged:  # BPT blocks a threadgroup, the grid whole threadgroups
            bpt = _staged_blocks(f.block_size, f.lanes, dtype)
            kernel, tg, template = _STAGED[ggml_type], bpt * f.lanes, {"T": dtype, "BPT": bpt}
            threads = -(-blocks // bpt) * tg
        else:  # a thread per lane unit
            kernel, tg, template = _KERNELS[ggml_type], 256, {"T": dtype}
            threads = blocks * f.lanes
        launch = kernel.launcher(
            [mx.uint8, mx.int32],
            grid=(threads,),
            threadgroup=(tg,),
            output_shapes=[(n, in_features)],
            output_dtypes=[dtype],
            template=template,
        )
        if len(_PLANS) >= 512:  # one per prompt length on the lookup path: stay bounded
            _PLANS.clear()
        plan = _PLANS[key] = (launch, device_array([n, in_features], mx.int32))
    launch, dims = plan
    return launch(inputs=[w_raw, dims])[0]


def ggml_get_rows(w_raw: mx.array, ids: mx.array, ggml_type: int, in_features: int) -> mx.array:
    """Rows ``ids`` (...) of a GGML table w_raw (V, row_bytes) -> (..., in_features) fp32.

    On a GPU one gather and one dequantize launch (the reference's ~20 small ops per lookup
    each cost a launch); the reference elsewhere (bit-exact with gguf-py).
    """
    rows = gather_rows(w_raw, ids)  # MLX's gather; a kernel in a recorded CUDA graph step
    if backend() is None or ggml_type not in _KERNELS or ids.size == 0:
        return dequantize_reference(rows, ggml_type, in_features)
    flat = ggml_dequantize_kernel(rows.reshape(ids.size, -1), ggml_type, in_features, mx.float32)
    return flat.reshape(*ids.shape, in_features)
