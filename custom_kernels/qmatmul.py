"""Matmul against GGML-quantized weights kept in their block layout: x @ W.T."""

from __future__ import annotations

import math

import mlx.core as mx
from gguf import GGMLQuantizationType as T

from hf2q_mlx.custom_kernels import backend
from hf2q_mlx.custom_kernels import qmatmul_mma as mma
from hf2q_mlx.custom_kernels import qmatmul_tuning as tuning
from hf2q_mlx.custom_kernels._render import Example, Kernel
from hf2q_mlx.custom_kernels.dequant import (
    dequantize_reference,
    ggml_dequantize_kernel,
    row_bytes,
)
from hf2q_mlx.custom_kernels.ggml_formats import BLOCK_FORMATS, fill_format, kernel_header
from hf2q_mlx.custom_kernels.launch_plan import LaunchPlan
from hf2q_mlx.errors import WeightMismatchError


def ggml_matmul_reference(
    x: mx.array, w_raw: mx.array, ggml_type: int, in_features: int
) -> mx.array:
    """x (..., K) float, w_raw (N, row_bytes) uint8 GGML blocks -> (..., N) in x.dtype.

    Dequantizes the whole weight to fp32 and multiplies in fp32: the oracle for the kernels.
    """
    w = dequantize_reference(w_raw, ggml_type, in_features)  # (N, K) fp32
    return (x.astype(mx.float32) @ w.T).astype(x.dtype)


# --------------------------------------------------------------------------------------------
# Kernel. Every type shares two loops: _BODY (fp32 decode and math, any x dtype) and _BODY_H2
# (packed fp16: the `h2` kernels on fp16 x, variant V = 1, and the `h2bf` kernels on bf16 x,
# V = 2, which converts x to fp16 in the loop), over each format's C decoder (ggml_formats).

# The rows, runs and accumulators both mat-vec loops start from.
_PROLOGUE = r"""
  const uint Mrt = uint(dims[0]);
  const uint N = uint(dims[1]);
  const uint K = uint(dims[2]);
  const uint nb = K / QK;
  const size_t row_bytes = size_t(nb) * BB;
  const uint row0 = gid_x * R;
  const uint t = lane % LPB;
  const uint bsub = lane / LPB;
  const uint nsteps = (nb + BPS - 1) / BPS;
  float acc[R][MT];
  UNROLL for (int r = 0; r < R; ++r) UNROLL for (int m = 0; m < MT; ++m) acc[r][m] = 0.0f;
  DEVICE_PTR(const uchar) wrow[R];  // rows past N re-read row N-1; their sums are dropped
  UNROLL for (int r = 0; r < R; ++r)
    wrow[r] = w + size_t(row0 + r < N ? row0 + r : N - 1) * row_bytes;
"""
# ... and how both end: the lanes' and SIMD groups' sums, written as (M, N).
_EPILOGUE = r"""
  // Sum the lanes, then the SIMD groups (through shared memory), and write (M, N).
  SHARED float red[8 * R * MT];
  UNROLL for (int r = 0; r < R; ++r) UNROLL for (int m = 0; m < MT; ++m) {
    if (uint(m) >= Mrt) continue;  // padding columns (MT > M): never written
    const float v = simd_sum(acc[r][m]);
    if (lane == 0) red[(simd_id * R + r) * MT + m] = v;
  }
  BARRIER();
  // R x MT (up to MAX_ACC = 64) sums may outnumber the threads (32 per SIMD group)
  for (uint i = tid; i < uint(R * MT); i += 32 * n_simd) {
    const uint r = i / MT, m = i % MT, row = row0 + r;
    if (row >= N || m >= Mrt) continue;
    float v = 0.0f;
    for (uint s = 0; s < n_simd; ++s) v += red[(s * R + r) * MT + m];
    out[size_t(m) * N + row] = from_float<T>(v);
  }
"""

_BODY = r"""
  // Thread mapping: a threadgroup owns R consecutive rows; its n_simd SIMD groups take
  // interleaved runs of U steps along K (a step = BPS blocks); the LPB lanes of a block each own
  // one unit of it (t = lane % LPB), and every lane keeps partial sums for all R rows x MT columns.
  constexpr uint QK = @QK@, BB = @BB@, LPB = @LPB@, BPS = 32 / LPB, NG = @NG@, GS = @GS@;
@PROLOGUE@  for (uint s0 = simd_id * U; s0 < nsteps; s0 += n_simd * U) {
    // All loads of the run first, so U * R blocks' bytes are in flight together. (Measured:
    // double-buffering the next run's loads was slower on the H200, docs/kernel_notes.md.)
    Raw@SUF@ raw[U][R];
    UNROLL for (int u = 0; u < U; ++u) {
      const uint blk = (s0 + u) * BPS + bsub;
      const uint off = (blk < nb ? blk : 0) * BB;  // past the end: read block 0, skip its math
      UNROLL for (int r = 0; r < R; ++r) raw[u][r] = load_@suf@(wrow[r] + off, t);
    }
    UNROLL for (int u = 0; u < U; ++u) {
      const uint blk = (s0 + u) * BPS + bsub;
      if (blk >= nb) continue;
      DEVICE_PTR(const T) xb = x + size_t(blk) * QK;
      UNROLL for (int g = 0; g < int(NG); ++g) {
        float wv[R][GS];
        float sc[R];
        float bi[R];
        UNROLL for (int r = 0; r < R; ++r) dq_@suf@(raw[u][r], t, g, wv[r], &sc[r], &bi[r]);
        UNROLL for (int m = 0; m < MT; ++m) {
          // padding columns (M rounded up to MT) cost nothing: a uniform branch, per call
          if (uint(m) >= Mrt) continue;
          float xv[GS];
          UNROLL for (int p = 0; p < int(GS / 4); ++p)
            load_x4(xb + size_t(m) * K + xoff_@suf@(t, g, p), xv + 4 * p);
          float sx = 0.0f;
          if (@BIAS@) { UNROLL for (int i = 0; i < int(GS); ++i) sx += xv[i]; }
          // x * 2^-p for a field read at bit p (exact): the decoded weights carry 2^p
          UNROLL for (int i = 0; i < int(GS); ++i)
            xv[i] *= 1.0f / float(1u << (p0_@suf@(g, i >> 2) + 8 * (i & 1)));
          UNROLL for (int r = 0; r < R; ++r) {
            float s = 0.0f;
            UNROLL for (int i = 0; i < int(GS); ++i) s = fma_f(wv[r][i], xv[i], s);
            acc[r][m] = fma_f(sc[r], s, acc[r][m]);
            if (@BIAS@) acc[r][m] = fma_f(bi[r], sx, acc[r][m]);
          }
        }
      }
    }
  }
@EPILOGUE@"""

# One run of U steps of the packed fp16 loop; @CHECK@ guards steps past the row's end (only the
# last run of a SIMD group can have them, so the main loop's copy has no guards at all).
_RUN_H2 = r"""
    {
      const uint blk0 = s0 * BPS + bsub;
      Raw@SUF@ raw[U][R];
      UNROLL for (int r = 0; r < R; ++r) {
        // one base address per row and run: the U steps are immediate offsets of the loads
        DEVICE_PTR(const uchar) wb = wrow[r] + size_t(blk0) * BB;
        UNROLL for (int u = 0; u < U; ++u)
          if (@CHECK@) raw[u][r] = load_@suf@(wb + u * BPS * BB, t);
      }
      DEVICE_PTR(const T) xb0 = x + size_t(blk0) * QK;
      UNROLL for (int u = 0; u < U; ++u) {
        if (!(@CHECK@)) continue;
        DEVICE_PTR(const T) xb = xb0 + u * BPS * QK;
        UNROLL for (int g = 0; g < int(NG); ++g) {
          uint wv[R][GP];
          float sc[R];
          float bi[R];
          UNROLL for (int r = 0; r < R; ++r) dq_@suf@(raw[u][r], t, g, wv[r], &sc[r], &bi[r]);
          UNROLL for (int m = 0; m < MT; ++m) {
            if (uint(m) >= Mrt) continue;  // padding columns (MT > M): no work
@XLOAD@            float sx = 0.0f;
            if (@BIAS@) {  // the group's x sum: fp16 pair adds, the last one in fp32
              uint hs = xv[0];
              UNROLL for (int i = 1; i < int(GP); ++i) hs = h2_fma(xv[i], 0x3C003C00u, hs);
              sx = f16lo(hs) + f16hi(hs);
            }
            UNROLL for (int r = 0; r < R; ++r) {
              uint s = 0u;
              UNROLL for (int i = 0; i < int(GP); ++i) s = h2_fma(wv[r][i], xv[i], s);
@ACC@            }
          }
        }
      }
    }
"""

_BODY_H2 = r"""
  // Thread mapping as _BODY (R rows per threadgroup, SIMD groups on interleaved runs of U steps,
  // LPB lanes per block). Weights decode to exact fp16 pairs (field - zero) and meet x in
  // packed fp16 fmas, two weights per instruction; each group's GS products are summed in fp16
  // (GS / 2 roundings), then scaled and accumulated in fp32 across groups and blocks.
  // Range, fp16 x (V = 1): a lane's fp16 group sum is GS / 2 products of |field - zero| * |x|,
  // so it overflows past 65504 / (GS / 2 * max |field - zero|): |x| ~2048 for Q4_0, ~500 for
  // Q5_K, ~128 Q8_0. bf16 x (V = 2) is scaled per group into range first (x_h2): no overflow.
  constexpr uint QK = @QK@, BB = @BB@, LPB = @LPB@, BPS = 32 / LPB, NG = @NG@, GS = @GS@;
  constexpr uint GP = GS / 2;  // fp16 pairs per group
@PROLOGUE@  uint s0 = simd_id * U;
  // Whole runs (all U steps of every lane inside the row), then at most one partial run.
  for (; (s0 + U) * BPS <= nb; s0 += n_simd * U) @RUN_FULL@
  if (s0 < nsteps) @RUN_TAIL@
@EPILOGUE@"""

# How the packed loop gets a group's x as fp16 pairs and adds its sums, per variant. V = 1:
# fp16 x as it is. V = 2: bf16 x under a power-of-two scale per group and lane (x_h2), so the
# fp16 sums never overflow and keep their precision whatever the magnitude of x (x_h2's
# comment); the sum goes back to scale after its fp32 multiply by the group's scale (one extra
# FMUL per group and row against V = 1).
_H2_XLOAD = {
    1: r"""            uint xv[GP];
            UNROLL for (int p = 0; p < int(GS / 4); ++p)
              load_xh(xb + size_t(m) * K + xoff_@suf@(t, g, p), xv + 2 * p);
""",
    2: r"""            uint xv[GP];
            float xf[GS];
            UNROLL for (int p = 0; p < int(GS / 4); ++p)
              load_x4(xb + size_t(m) * K + xoff_@suf@(t, g, p), xf + 4 * p);
            const float xs = x_h2(xf, int(GS), xv);  // 2^e: the group's x are x * 2^-e in xv
""",
}
_H2_ACC = {
    1: r"""              acc[r][m] = fma_f(sc[r], f16lo(s) + f16hi(s), acc[r][m]);
              if (@BIAS@) acc[r][m] = fma_f(bi[r], sx, acc[r][m]);
""",
    # scale before the power of two: sc * sum stays finite where sum * 2^e alone could not
    2: r"""              float v = sc[r] * (f16lo(s) + f16hi(s));
              if (@BIAS@) v = fma_f(bi[r], sx, v);
              acc[r][m] = fma_f(v, xs, acc[r][m]);
""",
}


def _h2_body(variant: int) -> str:
    run = _RUN_H2.replace("@XLOAD@", _H2_XLOAD[variant]).replace("@ACC@", _H2_ACC[variant])
    return _BODY_H2.replace("@RUN_FULL@", run.replace("@CHECK@", "true")).replace(
        "@RUN_TAIL@", run.replace("@CHECK@", "blk0 + uint(u) * BPS < nb")
    )


_MAX_SIMD = 8  # the `red` buffer holds 8 SIMD groups: threadgroups of at most 256 threads
_M_BUCKETS = (1, 2, 4, 8, 16)  # MT template values; M is rounded up to one of these
MAX_ACC = 64  # R x MT fp32 accumulators per lane at most (registers: 255 per CUDA thread)
_X_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
X_DTYPES = _X_DTYPES  # x dtypes the mat-vec kernels take
MAT_VEC_TYPES = tuple(BLOCK_FORMATS)  # GGML types with a mat-vec kernel


_LOOPS = {  # mat-vec loop per variant, with the shared prologue and epilogue in place
    v: b.replace("@PROLOGUE@", _PROLOGUE.lstrip("\n")).replace("@EPILOGUE@", _EPILOGUE.lstrip("\n"))
    for v, b in {0: _BODY, 1: _h2_body(1), 2: _h2_body(2)}.items()
}


def mat_vec_body(ggml_type: int, variant: int = 0, prefix: str = "") -> tuple[str, str]:
    """(body, header) of the mat-vec loop for one GGML type: what expert_matmul builds on.

    ``prefix`` goes before the loop (its @QK@ / @BB@ become the type's block size and bytes).
    The loop reads ``dims`` (M, N, K), ``x``, ``w`` and ``gid_x`` (block of R rows), takes the
    template values T, MT, R, U, and writes ``out[m * N + row]``. ``variant`` 0 works for fp32,
    fp16 and bf16 x (fp32 decode and math); 1 (``VARIANTS``) for fp16 x only (packed fp16 math),
    2 for bf16 x only (the same packed fp16 math on x scaled per group by a power of two).
    """
    return fill_format(prefix + _LOOPS[variant], ggml_type), kernel_header(ggml_type)


# Kernel variants: 0 = fp32 decode and fmas (any x dtype), 1 = packed fp16 (fp16 x only),
# 2 = packed fp16 on bf16 x (bf16 x only). VARIANT_DTYPES: the x dtype a variant takes.
VARIANTS = {0: "f32", 1: "h2", 2: "h2bf"}
VARIANT_DTYPES = {1: mx.float16, 2: mx.bfloat16}


def _make_kernel(ggml_type: int, variant: int) -> Kernel:
    dts = (mx.float32, mx.float16, mx.bfloat16) if variant == 0 else (VARIANT_DTYPES[variant],) * 3
    examples = [
        Example(
            {"x": dt, "w": mx.uint8, "dims": (mx.int32, 3)},
            {"out": dt},
            {"T": dt, "MT": mt, "R": r, "U": u},
        )
        for dt, mt, r, u in zip(dts, (1, 8, 16), (4, 8, 4), (2, 1, 1))
    ]
    body, header = mat_vec_body(ggml_type, variant)
    suffix = "" if variant == 0 else VARIANTS[variant] + "_"
    return Kernel(
        f"ggml_qmv_{suffix}{T(ggml_type).name.lower()}",
        inputs=["x", "w", "dims"],
        outputs=["out"],
        body=body,
        header=header,
        examples=examples,
    )


_KERNELS: dict[tuple[int, int], Kernel] = {
    (t, v): _make_kernel(t, v) for t in BLOCK_FORMATS for v in VARIANTS
}


def kernel_name(ggml_type: int, variant: int = 0) -> str:
    """The registered name of a mat-vec kernel (benchmarks match profiler events on it)."""
    return _KERNELS[(ggml_type, variant)].name


def launch_config(ggml_type: int, M: int, N: int, K: int, dtype=mx.float16) -> dict[str, int]:
    """V (variant), MT (columns compiled for), R (rows per threadgroup), U (steps per run),
    W (SIMD groups).

    From the H200 measurements at M = 1 (qmatmul_tuning; docs/kernel_notes.md): fp16 x takes
    DEFAULTS / TYPE_DEFAULTS; other dtypes the fp32 decode with its own measured table
    (V0_DEFAULTS; bf16: BF16_DEFAULTS first).
    W never exceeds the runs a row has, so no SIMD group idles.

    M > 1 keeps M = 1's V, U and W, so each row of x meets the same operations in the same
    order as it does alone (its output bits do not depend on the batch: the batched lm_head's
    row parity); only R changes, from MT_ROWS (more weight rows share each column's x work).
    """
    qk = BLOCK_FORMATS[ggml_type].block_size
    mt = next(b for b in _M_BUCKETS if b >= M)
    by_type, by_family = (T(ggml_type).name, K >= 8192), (str(qk), K >= 8192)
    v, r, u, w_max = tuning.TYPE_DEFAULTS.get(by_type) or tuning.DEFAULTS[by_family]
    if dtype != mx.float16 and v != 0:
        v, r, u, w_max = tuning.V0_DEFAULTS[by_family]
    if dtype == mx.bfloat16:
        bf = tuning.BF16_DEFAULTS.get(by_type) or tuning.BF16_DEFAULTS.get(by_family)
        v, r, u, w_max = bf or (v, r, u, w_max)
    if mt > 1:
        r = tuning.MT_ROWS.get((mt, *by_type)) or tuning.MT_ROWS.get((mt, *by_family)) or r
    r = max(1, min(r, MAX_ACC // mt))  # R x MT accumulators per lane
    return clamp_w(ggml_type, K, {"V": v, "MT": mt, "R": r, "U": u, "W": w_max})


def clamp_w(ggml_type: int, K: int, cfg: dict[str, int]) -> dict[str, int]:
    """cfg with W cut to the runs of U steps a row has, so no SIMD group idles."""
    f = BLOCK_FORMATS[ggml_type]
    nsteps = -(-(K // f.block_size) // (32 // f.lanes))
    return dict(cfg, W=max(1, min(cfg["W"], -(-nsteps // cfg["U"]))))


class _Plan(LaunchPlan):
    """The mat-vec launch for one (type, M, N, K, dtype, config)."""

    __slots__ = ()

    def __init__(self, ggml_type: int, M: int, N: int, K: int, dtype, cfg: dict[str, int]):
        super().__init__(
            _KERNELS[(ggml_type, cfg.get("V", 0))],
            [M, N, K],
            grid=(-(-N // cfg["R"]) * 32 * cfg["W"],),
            threadgroup=(32 * cfg["W"],),
            output_shapes=[(M, N)],
            output_dtypes=[dtype],
            template={"T": dtype, "MT": cfg["MT"], "R": cfg["R"], "U": cfg["U"]},
        )


_PLANS: dict[tuple, _Plan] = {}


def _plan(ggml_type: int, M: int, N: int, K: int, dtype, config: dict | None) -> _Plan:
    key = (ggml_type, M, N, K, dtype, None if config is None else tuple(sorted(config.items())))
    plan = _PLANS.get(key)
    if plan is None:
        cfg = config or launch_config(ggml_type, M, N, K, dtype)
        v = cfg.get("V", 0)
        if v not in VARIANTS:
            raise ValueError(f"unknown mat-vec variant V = {v}")
        if cfg["MT"] < M:
            # the kernel computes MT columns of x per row; more would be left unwritten
            raise ValueError(f"config MT = {cfg['MT']} is below the {M} rows of x")
        if v in VARIANT_DTYPES and dtype != VARIANT_DTYPES[v]:
            raise ValueError(
                f"the {VARIANTS[v]} variant (V = {v}) takes {VARIANT_DTYPES[v]} x only"
            )
        plan = _PLANS[key] = _Plan(ggml_type, M, N, K, dtype, cfg)
    return plan


def ggml_matmul_kernel(
    x: mx.array,
    w_raw: mx.array,
    ggml_type: int,
    in_features: int,
    *,
    config: dict[str, int] | None = None,
    init_value: float | None = None,
) -> mx.array:
    """The GPU kernel alone: x (M, K) with 1 <= M <= 16, w_raw (N, row_bytes) -> (M, N).

    ``config`` overrides ``launch_config`` (benchmarks; V defaults to 0); ``init_value``
    pre-fills the output (tests poison it with NaN to prove every element is written).
    """
    M, K = x.shape
    p = _plan(ggml_type, M, w_raw.shape[0], K, x.dtype, config)
    return p.call(x, w_raw, init_value=init_value)


_DEQ_CHUNK = 1 << 26  # elements of dequantized weight alive at once on the many-rows path
# Chunks are whole multiples of this many rows: an odd chunk (Gemma-4-31B's q|k|v took 12,483
# rows) is an odd GEMM leading dimension, and cuBLAS then ran it ~9x slower (session 37, H200).
_DEQ_ROW_ALIGN = 128


def deq_chunk_rows(n: int, k: int) -> int:
    """Rows of W dequantized at once: about _DEQ_CHUNK elements, a multiple of _DEQ_ROW_ALIGN
    (all of W when it fits)."""
    rows = _DEQ_CHUNK // k // _DEQ_ROW_ALIGN * _DEQ_ROW_ALIGN
    return n if rows >= n else max(rows, _DEQ_ROW_ALIGN)


def dequant_matmul(x: mx.array, n: int, k: int, dequant_rows) -> mx.array:
    """x (..., k) @ W.T for an n-row W dequantized ``deq_chunk_rows`` rows at a time:
    ``dequant_rows(r, m)`` gives rows r .. r + m of W (m, k) in x.dtype; the chunks' products
    concatenated -> (..., n)."""
    rows = deq_chunk_rows(n, k)
    parts = [x @ dequant_rows(r, min(rows, n - r)).T for r in range(0, n, rows)]
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)


def _ggml_matmul_dequant(x: mx.array, w_raw: mx.array, ggml_type: int, k: int) -> mx.array:
    """Many rows of x: dequantize row chunks of W on the GPU, then mx.matmul in x.dtype."""
    return dequant_matmul(
        x, w_raw.shape[0], k,
        lambda r, m: ggml_dequantize_kernel(w_raw[r : r + m], ggml_type, k, x.dtype),
    )  # fmt: skip


def _ggml_matmul_row_slices(
    x: mx.array, w_raw: mx.array, ggml_type: int, k: int, step: int
) -> mx.array:
    """Many rows of x: the mat-vec kernel over slices of ``step`` rows (one launch each: 16 for
    the scalar kernels, qmatmul_mma.MAX_ROWS = 32 for the tensor-core one).

    For fp32 x, not mx.matmul: MLX runs fp32 matmuls as TF32 (10-bit mantissa, fp16-level
    error) on CUDA and M5-class GPUs unless MLX_ENABLE_TF32=0, and fp32 x asks for fp32
    accuracy. For a decode batch (up to ``ROW_SLICE_MAX`` rows) each row's output stays the
    bits it has alone (the batched lm_head's row parity), and reading the weight a few times
    costs less than dequantizing it.
    """
    return mx.concatenate(
        [ggml_matmul(x[r : r + step], w_raw, ggml_type, k) for r in range(0, x.shape[0], step)]
    )


ROW_SLICE_MAX = 64  # rows of fp16/bf16 x still run as mat-vec slices (a decode batch)

# Launch plans by call signature: a repeat call (every decode step) is one dict lookup, then
# the launch. x goes in with its own shape (the kernel reads M, N, K from dims) and the output
# is created in (..., N): no reshapes.
_CALLS: dict[tuple, LaunchPlan] = {}


def ggml_matmul(x: mx.array, w_raw: mx.array, ggml_type: int, in_features: int) -> mx.array:
    """x (..., K) @ dequant(w_raw).T -> (..., N) in x.dtype, fp32 accumulation.

    Dispatcher, for the ten block types and x in fp32/fp16/bf16 on a GPU: one mat-vec launch
    for 1..16 rows of x, over 16-row slices (one launch each) up to 64 rows (each row's bits
    as alone) and for fp32 x at any size (fp32 math whatever MLX_ENABLE_TF32 says). On CUDA,
    bf16 x of the GPU-verified types (``qmatmul_mma.GPU_VERIFIED``: all ten) takes the
    tensor-core kernel (qmatmul_mma, unless ``qmatmul_mma.ENABLED`` is off) instead: one
    launch for 1..32 rows, 32-row slices up to 64
    rows (the weight read once per 32 rows, not per 16). fp16/bf16 x past 64 rows take the
    GPU dequantizer by row chunks and mx.matmul. The reference elsewhere (CPU,
    HF2Q_KERNELS=reference, dense GGML types, other dtypes).
    """
    be = backend()
    if be is not None:
        key = (ggml_type, in_features, x.shape, x.dtype, w_raw.shape, w_raw.dtype, mma.ENABLED)
        p = _CALLS.get(key)
        if p is not None:
            return p.run(x, w_raw)
    if x.shape[-1] != in_features:
        raise WeightMismatchError(f"x has {x.shape[-1]} features, the weight {in_features}")
    rb = row_bytes(ggml_type, in_features)  # raises for unknown types / bad K
    if ggml_type in BLOCK_FORMATS and (
        w_raw.ndim != 2 or w_raw.shape[1] != rb or w_raw.dtype != mx.uint8
    ):
        raise WeightMismatchError(
            f"expected uint8 weight blocks (N, {rb}), got {w_raw.dtype} {w_raw.shape}"
        )
    M = math.prod(x.shape[:-1])
    if (
        be is None
        or ggml_type not in BLOCK_FORMATS
        or x.dtype not in _X_DTYPES
        or M == 0
        or w_raw.shape[0] == 0
    ):
        return ggml_matmul_reference(x, w_raw, ggml_type, in_features)
    # the tensor-core kernel for every M in 1..32 (M = 1 too) and every slice past it: one math
    # for a row alone and in a batch (row parity); Metal keeps the scalar kernels at every M
    use_mma = be == "cuda" and mma.ENABLED and mma.supports(ggml_type, x.dtype)
    max_rows = mma.MAX_ROWS if use_mma else _M_BUCKETS[-1]  # rows one launch takes
    if M <= max_rows:
        N = w_raw.shape[0]
        if use_mma:
            plan = mma.dispatch_plan(ggml_type, M, N, in_features)
        else:
            cfg = launch_config(ggml_type, M, N, in_features, x.dtype)
            plan = _Plan(ggml_type, M, N, in_features, x.dtype, cfg)
        plan.output_shapes = [(*x.shape[:-1], N)]  # x's batch dims kept (a fresh plan: ours)
        key = (ggml_type, in_features, x.shape, x.dtype, w_raw.shape, w_raw.dtype, mma.ENABLED)
        _CALLS[key] = plan.resolve(x.dtype, mx.uint8)
        return ggml_matmul(x, w_raw, ggml_type, in_features)
    x2 = x.reshape(M, in_features)
    if x.dtype == mx.float32 or M <= ROW_SLICE_MAX:
        out = _ggml_matmul_row_slices(x2, w_raw, ggml_type, in_features, max_rows)
    else:
        out = _ggml_matmul_dequant(x2, w_raw, ggml_type, in_features)
    return out.reshape(*x.shape[:-1], w_raw.shape[0])
