"""Routed experts' gate and up projections with the gated activation in one launch."""

from __future__ import annotations

import math
import os

import mlx.core as mx
from gguf import GGMLQuantizationType

from hf2q_mlx.custom_kernels import activations, backend, expert_mma, int_tuple_setting
from hf2q_mlx.custom_kernels import qmatmul as Q
from hf2q_mlx.custom_kernels import qmatmul_mma as MM
from hf2q_mlx.custom_kernels._render import Example, Kernel
from hf2q_mlx.custom_kernels.dequant import row_bytes
from hf2q_mlx.custom_kernels.expert_matmul import (
    GROUPED_MODES,
    check_expert_blocks,
    expert_matmul,
    expert_matmul_reference,
    prefill_mode,
    run_slices,
    uint32_ids,
)
from hf2q_mlx.custom_kernels.ggml_formats import fill_format, kernel_header
from hf2q_mlx.custom_kernels.launch_plan import LaunchPlan
from hf2q_mlx.errors import InvalidArgumentError, WeightMismatchError


def _halves(w: mx.array, w_up: mx.array | None) -> tuple[mx.array, mx.array]:
    """(gate, up) weights: ``w`` fused (E, 2F, ...) [gate | up] rows, or ``w``, ``w_up``."""
    if w_up is not None:
        return w, w_up
    if w.shape[1] % 2:
        raise WeightMismatchError(f"a fused gate_up weight needs an even row count, got {w.shape}")
    F = w.shape[1] // 2
    return w[:, :F], w[:, F:]


def expert_glu_reference(
    x: mx.array,
    w: mx.array,
    expert_ids: mx.array,
    ggml_type: int | None,
    in_features: int,
    activation: str = "silu",
    w_up: mx.array | None = None,
) -> mx.array:
    """x (..., K) or (..., k, K), expert_ids (..., k) -> act(gate) * up (..., k, F) in x.dtype.

    ``w``: the experts' gate and up rows fused, (E, 2F, K) float or (E, 2F, row_bytes) GGML
    blocks of ``ggml_type``, gate first; or the gate rows (E, F, ...) with ``w_up`` the up rows.
    fp32 throughout (expert_matmul_reference's math), rounded once: the oracle for the kernel.
    """
    wg, wu = _halves(w, w_up)
    xf = x.astype(mx.float32)
    g = expert_matmul_reference(xf, wg, expert_ids, ggml_type, in_features)
    u = expert_matmul_reference(xf, wu, expert_ids, ggml_type, in_features)
    return activations.gated_activation_reference(g, u, activation).astype(x.dtype)


# --------------------------------------------------------------------------------------------
# Kernel: qmatmul's fp32 GGML mat-vec loop (as expert_matmul runs it, one (token, slot) pair
# per threadgroup column) over R = 2 RH rows: RH gate rows and the RH up rows of the same
# features, so one threadgroup ends with both halves of RH outputs and applies the activation
# in its epilogue. Only the loop's row pointers and its epilogue differ from expert_matmul's.

_PREFIX = r"""
  // Thread mapping: threadgroup (gid_x, gid_y) = (features f0 .. f0 + R/2 - 1, (token, slot)
  // pair p); its SIMD groups run the mat-vec loop over expert ids[p]'s gate rows of those
  // features (r < R/2) and the matching up rows (r >= R/2). edims = (1, F, K, slots per x row,
  // E, rows per expert in wg / wu, first up row of an expert in wu).
  const uint ex_pair = gid_y;
  const uint ex_k = uint(edims[2]);
  const uint ex_e = uint(ids[ex_pair]);
  const uint f0 = gid_x * uint(R / 2);
  DEVICE_PTR(T) out = ys + size_t(ex_pair) * uint(edims[1]);
  if (ex_e >= uint(edims[4])) {
    // An id past the last expert: NaN rows, nothing read; the threadgroup leaves before any
    // barrier or SIMD operation.
    const uint ex_f = f0 + tid;
    if (tid < uint(R / 2) && ex_f < uint(edims[1]))
      out[ex_f] = from_float<T>(bitcast<float>(0x7FC00000u));
    return;
  }
  CONSTANT_PTR(const int) dims = edims;
  DEVICE_PTR(const T) x = xs + size_t(ex_pair / uint(edims[3])) * ex_k;
  const size_t g_row0 = size_t(ex_e) * uint(edims[5]);
  const size_t u_row0 = g_row0 + uint(edims[6]);
"""

# the loop's row pointers: gate rows, then up rows (rows past F re-read row F - 1, dropped)
_ROWS_OLD = "    wrow[r] = w + size_t(row0 + r < N ? row0 + r : N - 1) * row_bytes;\n"
_ROWS_NEW = r"""    wrow[r] = (r < R / 2 ? wg + g_row0 * row_bytes : wu + u_row0 * row_bytes) +
              size_t(f0 + uint(r % (R / 2)) < N ? f0 + uint(r % (R / 2)) : N - 1) * row_bytes;
"""

_ACTIVATE = activations.ACTIVATE_EPILOGUE  # a = act(g) on the fp32 sums g, u

_COLS_OLD = "  const uint Mrt = uint(dims[0]);\n"  # the prologue's columns of x

_EPILOGUE = r"""
  // Sum the lanes, then the SIMD groups; thread f < R/2 holds feature f0 + f's gate and up.
  SHARED float red[8 * R];
  UNROLL for (int r = 0; r < R; ++r) {
    const float v = simd_sum(acc[r][0]);
    if (lane == 0) red[simd_id * R + r] = v;
  }
  BARRIER();
  if (tid < uint(R / 2) && f0 + tid < N) {
    float g = 0.0f, u = 0.0f;
    for (uint s = 0; s < n_simd; ++s) {
      g += red[s * R + tid];
      u += red[s * R + R / 2 + tid];
    }
@ACTIVATE@    out[f0 + tid] = from_float<T>(a * u);
  }
"""


def _loop(epilogue: str = _EPILOGUE, columns: str | None = None) -> str:
    """qmatmul's fp32 mat-vec loop with this kernel's row pointers and ``epilogue``;
    ``columns``: the line that replaces the prologue's count of x columns."""
    if (
        _ROWS_OLD not in Q._PROLOGUE
        or _COLS_OLD not in Q._PROLOGUE
        or "@PROLOGUE@" not in Q._BODY
        or "@EPILOGUE@" not in Q._BODY
    ):
        # qmatmul's loop changed shape: this kernel must follow it (a loud import error, not a
        # kernel that silently reads the wrong rows)
        raise RuntimeError("expert_glu: qmatmul's mat-vec prologue no longer matches")
    prologue = Q._PROLOGUE.replace(_ROWS_OLD, _ROWS_NEW).lstrip("\n")
    if columns is not None:
        prologue = prologue.replace(_COLS_OLD, columns)
    epilogue = epilogue.replace("@ACTIVATE@", _ACTIVATE).lstrip("\n")
    return Q._BODY.replace("@PROLOGUE@", prologue).replace("@EPILOGUE@", epilogue)


def _make_kernel(ggml_type: int) -> Kernel:
    examples = [
        Example(
            {"xs": dt, "wg": mx.uint8, "wu": mx.uint8, "ids": mx.uint32, "edims": (mx.int32, 7)},
            {"ys": dt},
            {"T": dt, "MT": 1, "R": r, "U": u, "ACT": act},
        )
        for dt, r, u, act in ((mx.float32, 4, 2, 0), (mx.bfloat16, 2, 1, 1))
    ]
    return Kernel(
        f"ggml_expert_glu_{GGMLQuantizationType(ggml_type).name.lower()}",
        inputs=["xs", "wg", "wu", "ids", "edims"],
        outputs=["ys"],
        body=fill_format(_PREFIX + _loop(), ggml_type),
        header=kernel_header(ggml_type),
        examples=examples,
    )


_KERNELS: dict[int, Kernel] = {t: _make_kernel(t) for t in Q.MAT_VEC_TYPES}
# tokens per call the kernel takes: a compiled decode step's rows (up to 32); past that every
# expert is read about once anyway, and the dequantizing paths of expert_matmul take over
MAX_TOKENS = 32
ACTIVATIONS = activations.ACTIVATIONS  # "silu", "gelu_tanh": the epilogue's ACT 0, 1


# The per-pair expert launches (here and expert_down): 4 outputs per threadgroup, one SIMD group,
# one block per run. On the H200 (bench/expert_sweep.py, 2026-12-02, Q4_K gate/up, Q5_0 / Q4_K
# down at the 26B-A4B and 35B-A3B shapes) that beat qmatmul's mat-vec defaults by 1.05-1.5x at
# B = 1, 8 and 32: an expert's K (512..2816) is too short to split over SIMD groups. U and W
# depend on (type, K) only, so a pair's bits do not depend on the tokens beside it. Those sweep
# times were whole calls at B = 1 (47 us, host cost inside) where the graph decode spends 21 us
# (session 43's profile): HF2Q_EXPERT_RUN="R,U,W" (read at import) replaces them for an A/B.
EXPERT_RUN = {"R": 4, "U": 1, "W": 1}


def _run_setting(text: str) -> dict[str, int] | None:
    """HF2Q_EXPERT_RUN's "R,U,W" (R 1..16, U 1..8, W 1..8), None when empty."""
    example = "R,U,W (R 1..16, U 1..8, W 1..8), e.g. 4,1,1"
    vals = int_tuple_setting("HF2Q_EXPERT_RUN", text, ((1, 16), (1, 8), (1, 8)), example)
    return None if vals is None else dict(zip("RUW", vals))


RUN_SETTING = os.environ.get("HF2Q_EXPERT_RUN", "")  # parsed when a launch is first built


def expert_run_config(ggml_type: int, K: int) -> dict[str, int]:
    """R (outputs per threadgroup: features of the GLU, rows of the down projection), U, W of
    the per-pair expert kernels (``HF2Q_EXPERT_RUN`` where set)."""
    return Q.clamp_w(ggml_type, K, dict(_run_setting(RUN_SETTING) or EXPERT_RUN))


def _plan(x, w, w_up, expert_ids, ggml_type: int, K: int, activation: str, config) -> LaunchPlan:
    """One call's launch on its type's kernel, with ``edims`` (1, F, K, slots per x row, E, rows
    per expert, first up row)."""
    E, rows = w.shape[0], w.shape[1]
    F = rows if w_up is not None else rows // 2
    k = expert_ids.shape[-1]
    per_slot = x.ndim == expert_ids.ndim + 1
    cfg = dict(config or expert_run_config(ggml_type, K))
    rh = cfg["R"]  # features per threadgroup
    up0 = 0 if w_up is not None else F
    return LaunchPlan(
        _KERNELS[ggml_type],
        [1, F, K, 1 if per_slot else k, E, rows, up0],
        grid=(-(-F // rh) * 32 * cfg["W"], expert_ids.size),
        threadgroup=(32 * cfg["W"], 1),
        output_shapes=[(*expert_ids.shape, F)],  # written flat: no reshape node after
        output_dtypes=[x.dtype],
        template={"T": x.dtype, "MT": 1, "R": 2 * rh, "U": cfg["U"],
                  "ACT": ACTIVATIONS.index(activation)},
    )  # fmt: skip


def expert_glu_kernel(
    x: mx.array,
    w: mx.array,
    expert_ids: mx.array,
    ggml_type: int,
    in_features: int,
    activation: str = "silu",
    w_up: mx.array | None = None,
    *,
    config: dict[str, int] | None = None,
    init_value: float | None = None,
) -> mx.array:
    """The GPU kernel alone, with the contract of :func:`expert_glu_reference` for GGML weights;
    x's leading dims must equal the ids' (no broadcasting). An id >= E gives NaN rows.

    ``config``: R (features per threadgroup), U, W (default: ``expert_run_config``);
    ``init_value`` pre-fills the output.
    """
    plan = _plan(x, w, w_up, expert_ids, ggml_type, in_features, activation, config)
    wu = w if w_up is None else w_up
    return plan.call(x, w, wu, uint32_ids(expert_ids), init_value=init_value)


# per dispatcher call signature: its launch, resolved once (a decode step: a lookup, the launch)
_CALLS: dict[tuple, LaunchPlan] = {}


# --------------------------------------------------------------------------------------------
# Dense layers: one fused [gate | up] weight (2F, row_bytes) and M <= 32 rows of x. The same
# loop with the rows of x as its MT columns: a threadgroup decodes its gate and up rows once for
# all of them. Each column meets the same operations in the same order whatever MT and R are (V,
# U, W fixed: qmatmul.launch_config), so a row's output bits do not depend on the rows beside it.

_DENSE_PREFIX = r"""
  // Thread mapping: threadgroup (gid_x, gid_y) = (features f0 .. f0 + R/2 - 1, rows c0 ..
  // c0 + MT - 1 of x); its SIMD groups run the mat-vec loop over those features' gate rows
  // (r < R/2) and up rows (r >= R/2), each column of acc one row of x. ddims = (M, F, K).
  const uint f0 = gid_x * uint(R / 2);
  const uint c0 = gid_y * uint(MT);
  CONSTANT_PTR(const int) dims = ddims;
  DEVICE_PTR(const T) x = xs + size_t(c0) * uint(ddims[2]);
  DEVICE_PTR(T) out = ys + size_t(c0) * uint(ddims[1]);
  DEVICE_PTR(const uchar) wg = w;
  DEVICE_PTR(const uchar) wu = w;
  const size_t g_row0 = 0, u_row0 = uint(ddims[1]);
"""
# this threadgroup's rows of x: MT, fewer in the last group of rows
_DENSE_COLS = "  const uint Mrt = uint(dims[0]) - c0 < uint(MT) ? uint(dims[0]) - c0 : uint(MT);\n"

_DENSE_EPILOGUE = r"""
  // Sum the lanes, then the SIMD groups (in _EPILOGUE's order); each (feature, row of x) pair
  // then gets its gate and up sums and the activation.
  SHARED float red[8 * R * MT];
  UNROLL for (int r = 0; r < R; ++r) UNROLL for (int m = 0; m < MT; ++m) {
    if (uint(m) >= Mrt) continue;  // padding columns (MT > rows left): never written
    const float v = simd_sum(acc[r][m]);
    if (lane == 0) red[(simd_id * R + r) * MT + m] = v;
  }
  BARRIER();
  for (uint i = tid; i < uint(R / 2 * MT); i += 32 * n_simd) {
    const uint f = i / MT, m = i % MT;
    if (f0 + f >= N || m >= Mrt) continue;
    float g = 0.0f, u = 0.0f;
    for (uint s = 0; s < n_simd; ++s) {
      g += red[(s * R + f) * MT + m];
      u += red[(s * R + R / 2 + f) * MT + m];
    }
@ACTIVATE@    out[size_t(m) * N + f0 + f] = from_float<T>(a * u);
  }
"""


def _make_dense_kernel(ggml_type: int) -> Kernel:
    examples = [
        Example(
            {"xs": dt, "w": mx.uint8, "ddims": (mx.int32, 3)},
            {"ys": dt},
            {"T": dt, "MT": mt, "R": r, "U": u, "ACT": act},
        )
        for dt, mt, r, u, act in ((mx.float32, 1, 4, 2, 0), (mx.bfloat16, 32, 2, 1, 1))
    ]
    return Kernel(
        f"ggml_dense_glu_{GGMLQuantizationType(ggml_type).name.lower()}",
        inputs=["xs", "w", "ddims"],
        outputs=["ys"],
        body=fill_format(_DENSE_PREFIX + _loop(_DENSE_EPILOGUE, _DENSE_COLS), ggml_type),
        header=kernel_header(ggml_type),
        examples=examples,
    )


_DENSE_KERNELS: dict[int, Kernel] = {t: _make_dense_kernel(t) for t in Q.MAT_VEC_TYPES}
# rows of x one threadgroup takes (MT, a power of two up to this); more rows take more groups
# of rows (gid_y), each decoding the weight again. 2 x MT x R/2 <= qmatmul.MAX_ACC accumulators.
DENSE_MT = 32


def dense_config(ggml_type: int, M: int, F: int, K: int) -> dict[str, int]:
    """MT (rows of x per threadgroup), R (features per threadgroup), U, W of a dense call of M
    rows: M = 1's U and W whatever M is (row parity), R from qmatmul's MT_ROWS."""
    mt = min(1 << (M - 1).bit_length(), DENSE_MT)
    cfg = Q.launch_config(ggml_type, min(mt, 16), 2 * F, K, mx.float32)
    rh = max(1, min(cfg["R"] // 2, Q.MAX_ACC // (2 * mt)))
    return {"MT": mt, "R": rh, "U": cfg["U"], "W": cfg["W"]}


def _dense_launch(
    x, w, ggml_type: int, K: int, activation: str, config, mma: bool = False
) -> tuple[Kernel, dict, list]:
    """The kernel, launch arguments and ``ddims`` values (M, F, K) of a dense call: the scalar
    kernel's or, with ``mma``, the tensor-core kernel's (``config``: dense_config's or
    qmatmul_mma.glu_launch_config's; S = 1 in it takes the streaming-load variant)."""
    M, F = math.prod(x.shape[:-1]), w.shape[0] // 2
    if mma:
        cfg = config or MM.glu_launch_config(ggml_type, M, F, K)
        nt_max = MM.GLU_MAX_ROWS // 8  # the `red` buffer's size (32 KB of shared memory at 4)
        if not 1 <= M <= 8 * cfg["NT"] <= 8 * nt_max or not 1 <= cfg["W"] <= MM.MAX_SIMD:
            raise ValueError(f"config {cfg} cannot run {M} rows of x")
        # 16 features (gate and up rows) per threadgroup, every row of x in its n-tiles (CS > 1:
        # the n-tiles split over CS threadgroups, qmatmul_mma's column split)
        nt, cs = MM.column_split(cfg)
        grid, tg = (-(-F // 16) * cs * 32 * cfg["W"],), (32 * cfg["W"],)
        template = {
            "T": x.dtype,
            "NT": nt,
            "U": cfg["U"],
            "PF": cfg.get("PF", 0),
            "XG": cfg.get("XG", 1),
            **({"CS": cs} if cs > 1 else {}),
        }
        kernel = _dense_mma_kernel(ggml_type, bool(cfg.get("S")), cs > 1)
    else:
        cfg = config or dense_config(ggml_type, M, F, K)
        grid = (-(-F // cfg["R"]) * 32 * cfg["W"], -(-M // cfg["MT"]))
        tg = (32 * cfg["W"], 1)
        template = {"T": x.dtype, "MT": cfg["MT"], "R": 2 * cfg["R"], "U": cfg["U"]}
        kernel = _DENSE_KERNELS[ggml_type]
    template["ACT"] = ACTIVATIONS.index(activation)
    launch = dict(grid=grid, threadgroup=tg, output_shapes=[(*x.shape[:-1], F)],
                  output_dtypes=[x.dtype], template=template)  # fmt: skip
    return kernel, launch, [M, F, K]


def _dense_plan(x, w, ggml_type: int, K: int, activation: str, config, mma: bool) -> LaunchPlan:
    """A dense call's launch (``_dense_launch``) on its kernel."""
    kernel, launch, ddims = _dense_launch(x, w, ggml_type, K, activation, config, mma)
    return LaunchPlan(kernel, ddims, **launch)


def dense_glu_kernel(
    x: mx.array,
    w: mx.array,
    ggml_type: int,
    in_features: int,
    activation: str = "silu",
    *,
    config: dict[str, int] | None = None,
    init_value: float | None = None,
) -> mx.array:
    """The dense GPU kernel alone: x (..., K), w (2F, row_bytes) [gate | up] -> (..., F), the
    contract of :func:`expert_glu_reference` over one expert. ``config``: MT, R (features per
    threadgroup), U, W (``dense_config``'s); ``init_value`` pre-fills the output."""
    plan = _dense_plan(x, w, ggml_type, in_features, activation, config, mma=False)
    return plan.call(x, w, init_value=init_value)


# The tensor-core version (CUDA, bf16 x, qmatmul_mma.MMA_TYPES): qmatmul_mma's loop over two
# row sets, the gate rows f .. f + 15 and the up rows F + f .., sharing each B fragment of x
# (two mmas per n-tile and k16 step, each set with its own scales and mins); after the SIMD
# groups' fixed-order sum the epilogue applies the scalar kernel's activation (_ACTIVATE) to the
# fp32 sums and rounds once. Each row of x is one mma column: its bits do not depend on M.
_DENSE_MMA_EPILOGUE = r"""    {
      const float g = v[0], u = v[1];  // feature row0 + r's gate and up sums, row col of x
@ACTIVATE@      out[size_t(col) * N + row0 + r] = from_float<T>(a * u);
    }
"""


def _make_dense_mma_kernel(ggml_type: int, stream: bool = False, columns: bool = False) -> Kernel:
    """The tensor-core GLU of one type; ``stream``: S = 1; ``columns``: x's columns split over
    threadgroups (template CS, qmatmul_mma's column split)."""
    configs = ((1, 1, 0, 0, 1, 4), (2, 1, 1, 1, 1, 2)) if columns else (
        (1, 1, 0, 0, 1, 1), (4, 1, 1, 1, MM.X_ALL, 1))  # fmt: skip
    examples = [
        Example(
            {"x": mx.bfloat16, "w": mx.uint8, "dims": (mx.int32, 3)},
            {"out": mx.bfloat16},
            {
                "T": mx.bfloat16,
                "NT": nt,
                "U": u,
                "ACT": act,
                "PF": pf,
                "XG": xg,
                **({"CS": cs} if columns else {}),
            },
        )  # fmt: skip
        for nt, u, act, pf, xg, cs in configs
    ]
    type_name = GGMLQuantizationType(ggml_type).name.lower()
    return MM.make_kernel(
        f"ggml_dense_glu_mma_{'s_' if stream else ''}{'cs_' if columns else ''}{type_name}",
        ggml_type,
        examples,
        halves=2,
        epilogue=_DENSE_MMA_EPILOGUE.replace("@ACTIVATE@", _ACTIVATE),
        stream=stream,
        **({"body": MM.column_body()} if columns else {}),
    )


_DENSE_MMA_KERNELS: dict[int, Kernel] = {t: _make_dense_mma_kernel(t) for t in MM.MMA_TYPES}
# streaming weight loads (config S = 1, qmatmul_mma._STREAM_LOADS): an A/B variant
_DENSE_MMA_STREAM_KERNELS: dict[int, Kernel] = {
    t: _make_dense_mma_kernel(t, stream=True) for t in MM.MMA_TYPES
}
# x's columns split over threadgroups (config CS), plain and streaming loads
_DENSE_MMA_COLUMN_KERNELS: dict[tuple[int, bool], Kernel] = {
    (t, s): _make_dense_mma_kernel(t, stream=s, columns=True)
    for t in MM.MMA_TYPES
    for s in (False, True)
}


def _dense_mma_kernel(ggml_type: int, stream: bool, columns: bool) -> Kernel:
    """The tensor-core GLU kernel of a type for a config's S and CS > 1."""
    if columns:
        return _DENSE_MMA_COLUMN_KERNELS[ggml_type, stream]
    return (_DENSE_MMA_STREAM_KERNELS if stream else _DENSE_MMA_KERNELS)[ggml_type]


if MAX_TOKENS > MM.GLU_MAX_ROWS:  # every M dense_glu takes must fit one tensor-core launch
    raise RuntimeError("expert_glu: MAX_TOKENS exceeds qmatmul_mma.GLU_MAX_ROWS")


def dense_mma_covers(ggml_type: int, dtype: mx.Dtype) -> bool:
    """Whether dense_glu takes the tensor-core kernel for (type, x dtype) on CUDA (every M in
    1..MAX_TOKENS, M = 1 included: one math per row whatever the batch): qmatmul_mma.supports,
    GLU_GPU_VERIFIED unless qmatmul_mma.ALL_TYPES."""
    covered = ggml_type in _DENSE_MMA_KERNELS
    return MM.ENABLED and covered and MM.supports(ggml_type, dtype, glu=True)


def dense_glu_mma_kernel(
    x: mx.array,
    w: mx.array,
    ggml_type: int,
    in_features: int,
    activation: str = "silu",
    *,
    config: dict[str, int] | None = None,
    init_value: float | None = None,
) -> mx.array:
    """The tensor-core dense kernel alone: bf16 x (..., K) of 1..32 rows, w (2F, row_bytes)
    [gate | up] of a qmatmul_mma type -> (..., F). ``config``: NT, U, W
    (``qmatmul_mma.glu_launch_config``'s), and S = 1 for the streaming weight loads;
    ``init_value`` pre-fills the output."""
    if not MM.has_kernel(ggml_type, x.dtype) or x.shape[-1] != in_features:
        raise ValueError(f"no mma kernel for {ggml_type} with {x.dtype} x of {x.shape}")
    plan = _dense_plan(x, w, ggml_type, in_features, activation, config, mma=True)
    return plan.call(x, w, init_value=init_value)


def dense_kernel_name(
    ggml_type: int, mma: bool, stream: bool = False, columns: bool = False
) -> str:
    """The registered name of a dense kernel (benchmarks match profiler events on it);
    ``stream``: the tensor-core kernel's streaming-load variant (config S = 1); ``columns``:
    its column split (CS > 1)."""
    if mma:
        return _dense_mma_kernel(ggml_type, stream, columns).name
    return _DENSE_KERNELS[ggml_type].name


_DENSE: dict[tuple, LaunchPlan] = {}


def dense_glu(
    x: mx.array, w: mx.array, ggml_type: int, in_features: int, activation: str = "silu"
) -> mx.array | None:
    """act(gate) * up of a dense layer of fused [gate | up] GGML rows ``w`` (2F, row_bytes):
    x (..., K) -> (..., F), for 1..32 rows on a GPU in ONE launch that reads each weight row
    once for all rows (dense_glu_kernel; on CUDA, bf16 x of a qmatmul_mma type unless
    ``qmatmul_mma.ENABLED`` is off, the tensor-core dense_glu_mma_kernel at every M), where a
    mat-vec and the activation kernel take two. Each row's bits are those it has alone. None
    where it does not apply (the caller runs the projection, then the activation). Its one
    rounding to x.dtype is the experts' (expert_glu_reference), not the two-step path's two."""
    be = backend()
    key = (ggml_type, in_features, activation, x.shape, x.dtype, w.shape, w.dtype, MM.ENABLED)
    plan = _DENSE.get(key) if be is not None else None
    if plan is None:
        rows = math.prod(x.shape[:-1])
        if not (
            be is not None
            and ggml_type in _DENSE_KERNELS
            and activation in ACTIVATIONS
            and x.dtype in Q.X_DTYPES
            and 1 <= rows <= MAX_TOKENS
            and x.shape[-1] == in_features
            and w.ndim == 2
            and w.dtype == mx.uint8
            and w.shape[0] % 2 == 0
            and w.shape[1] == row_bytes(ggml_type, in_features)
        ):
            return None
        mma = be == "cuda" and dense_mma_covers(ggml_type, x.dtype)
        plan = _dense_plan(x, w, ggml_type, in_features, activation, None, mma)
        _DENSE[key] = plan.resolve(x.dtype, mx.uint8)
    return plan.run(x, w)


def _kernel_covers(x, w, w_up, expert_ids, ggml_type) -> bool:
    lead = expert_ids.shape if x.ndim == expert_ids.ndim + 1 else expert_ids.shape[:-1]
    return (
        ggml_type in _KERNELS
        and x.dtype in Q.X_DTYPES
        and tuple(x.shape[:-1]) == tuple(lead)
        and 1 <= math.prod(expert_ids.shape[:-1]) <= MAX_TOKENS
        and expert_ids.size > 0
        and w.shape[0] > 0
        and w.shape[1] > 0
        and (w_up is None or (w_up.shape == w.shape and w_up.dtype == w.dtype))
    )


def grouped_slice_tokens(k: int, wide: bool = False) -> int:
    """Tokens per slice of a grouped prefill of k slots: as many as one grouped launch takes
    (``wide``: one launch of the prefill's kernels, expert_mma.WIDE_PAIRS pairs)."""
    if wide:
        return max(1, min(expert_mma.WIDE_PAIRS, expert_mma.WIDE_LIST) // k)
    return max(1, min(expert_mma.MAX_TOKENS, expert_mma.MAX_PAIRS // k))


def _grouped_prefill(x, w, w_up, expert_ids, ggml_type: int, K: int, activation: str,
                     wide: bool):  # fmt: skip
    """HF2Q_EXPERT_PREFILL=grouped, more than MAX_TOKENS tokens: this dispatcher over slices of
    ``grouped_slice_tokens`` tokens (the grouped kernels; a short last slice takes whichever
    kernel its size takes), each slice reading its selected experts once, each slice's x and
    ids ``owned_rows`` (not views at an offset). ``wide`` (grouped-wide): slices of
    WIDE_PAIRS // k tokens, each one launch of the wide kernel, the last one too. None where
    the grouped kernels do not cover a full slice (x broadcast, a type they lack, switched
    off)."""
    lead, k = expert_ids.shape[:-1], expert_ids.shape[-1]
    n_tok = math.prod(lead)
    per_slot = x.ndim == expert_ids.ndim + 1
    if not expert_mma.ENABLED or x.shape[:-1] != (expert_ids.shape if per_slot else lead):
        return None  # x broadcast over the ids' leading dims: not sliced
    D = x.shape[-1]
    xs = x.reshape(n_tok, k, D) if per_slot else x.reshape(n_tok, D)
    ids = expert_ids.reshape(n_tok, k)
    step = grouped_slice_tokens(k, wide)
    if not expert_mma.covers(xs[:step], w, ids[:step], ggml_type, w_up=w_up, wide=wide):
        return None

    def launch(xi, ii, rows):  # one slice
        if wide:  # the slice's sorted pair lists shared with the layer's down (same expert_ids)
            return expert_mma.expert_glu(xi, w, ii, ggml_type, K, activation, w_up, True,
                                         pairs_of=(expert_ids, rows))  # fmt: skip
        return expert_glu(xi, w, ii, ggml_type, K, activation, w_up)

    parts = run_slices((xs, ids), step, launch)
    return mx.concatenate(parts).reshape(*expert_ids.shape, parts[0].shape[-1])


def expert_glu(
    x: mx.array,
    w: mx.array,
    expert_ids: mx.array,
    ggml_type: int | None,
    in_features: int,
    activation: str = "silu",
    w_up: mx.array | None = None,
) -> mx.array:
    """Dispatcher with the contract of :func:`expert_glu_reference`: on a GPU, GGML experts and
    1..32 tokens, one kernel; past 32 tokens with HF2Q_EXPERT_PREFILL=grouped, those kernels
    over slices of 32 tokens (grouped-wide: the wide kernels, 512 tokens a slice at top-8);
    otherwise the two-step path the models ran before (expert_matmul
    of the gate_up rows, then ``activations.gated_activation``), rounding the projections to
    x.dtype in between."""
    if activation not in ACTIVATIONS:
        raise InvalidArgumentError(f"activation {activation!r} is not one of {ACTIVATIONS}")
    if expert_mma.ENABLED:  # each expert read once for its pairs (from MIN_TOKENS tokens on)
        y = expert_mma.expert_glu(x, w, expert_ids, ggml_type, in_features, activation, w_up)
        if y is not None:  # None: expert_mma.covers says no
            return y
    key = (_KERNELS.get(ggml_type), ggml_type, in_features, activation, x.shape, x.dtype,
           w.shape, w.dtype, None if w_up is None else w_up.shape, expert_ids.shape,
           expert_ids.dtype)  # fmt: skip
    be = backend()
    plan = _CALLS.get(key) if be is not None else None
    if (
        plan is None
        and ggml_type is not None
        and be is not None
        and _kernel_covers(x, w, w_up, expert_ids, ggml_type)
    ):
        check_expert_blocks(x, w, w_up, ggml_type, in_features)
        plan = _plan(x, w, w_up, expert_ids, ggml_type, in_features, activation, None)
        _CALLS[key] = plan.resolve(x.dtype, mx.uint8, mx.uint8, mx.uint32)
    if plan is not None:
        # x as it comes ((..., K) or (..., k, K)): the kernel reads rows of K from flat memory
        return plan.run(x, w, w if w_up is None else w_up, uint32_ids(expert_ids))
    if (
        ggml_type is not None
        and be is not None
        and x.dtype == mx.bfloat16
        and math.prod(expert_ids.shape[:-1]) > MAX_TOKENS
        and (mode := prefill_mode()) in GROUPED_MODES
    ):
        wide = mode == "grouped-wide"
        y = _grouped_prefill(x, w, w_up, expert_ids, ggml_type, in_features, activation, wide)
        if y is not None:
            return y
    if w_up is None:
        gate_up = expert_matmul(x, w, expert_ids, ggml_type, in_features)  # (..., k, 2F)
        return activations.gated_activation(gate_up, None, activation)
    gate = expert_matmul(x, w, expert_ids, ggml_type, in_features)
    up = expert_matmul(x, w_up, expert_ids, ggml_type, in_features)
    return activations.gated_activation(gate, up, activation)
