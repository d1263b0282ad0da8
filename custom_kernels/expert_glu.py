"""Routed experts' gate and up projections with the gated activation in one launch."""

from __future__ import annotations

import math

import mlx.core as mx
from gguf import GGMLQuantizationType

from hf2q_mlx.custom_kernels import activations, backend
from hf2q_mlx.custom_kernels import qmatmul as Q
from hf2q_mlx.custom_kernels._render import Example, Kernel
from hf2q_mlx.custom_kernels.dequant import row_bytes
from hf2q_mlx.custom_kernels.expert_matmul import (
    expert_matmul,
    expert_matmul_reference,
    uint32_ids,
)
from hf2q_mlx.custom_kernels.ggml_formats import fill_format, kernel_header
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
    float a;
    if (ACT == 0) {
      a = g / (1.0f + exp_f(-g));
    } else {
      a = 0.5f * g * (1.0f + tanh_f(0.7978845608028654f * (g + 0.044715f * g * g * g)));
    }
    out[f0 + tid] = from_float<T>(a * u);
  }
"""


def _loop() -> str:
    """qmatmul's fp32 mat-vec loop with this kernel's row pointers and epilogue."""
    if _ROWS_OLD not in Q._PROLOGUE or "@PROLOGUE@" not in Q._BODY or "@EPILOGUE@" not in Q._BODY:
        # qmatmul's loop changed shape: this kernel must follow it (a loud import error, not a
        # kernel that silently reads the wrong rows)
        raise RuntimeError("expert_glu: qmatmul's mat-vec prologue no longer matches")
    prologue = Q._PROLOGUE.replace(_ROWS_OLD, _ROWS_NEW).lstrip("\n")
    return Q._BODY.replace("@PROLOGUE@", prologue).replace("@EPILOGUE@", _EPILOGUE.lstrip("\n"))


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


def _launch(x, w, w_up, expert_ids, ggml_type: int, K: int, activation: str, config):
    """Launch arguments and the ``edims`` values for one call."""
    E, rows = w.shape[0], w.shape[1]
    F = rows if w_up is not None else rows // 2
    k = expert_ids.shape[-1]
    per_slot = x.ndim == expert_ids.ndim + 1
    cfg = dict(config or Q.launch_config(ggml_type, 1, 2 * F, K, mx.float32))
    rh = max(1, cfg["R"] // 2) if config is None else cfg["R"]  # features per threadgroup
    launch = dict(
        grid=(-(-F // rh) * 32 * cfg["W"], expert_ids.size),
        threadgroup=(32 * cfg["W"], 1),
        output_shapes=[(*expert_ids.shape, F)],  # written flat: no reshape node after
        output_dtypes=[x.dtype],
        template={"T": x.dtype, "MT": 1, "R": 2 * rh, "U": cfg["U"],
                  "ACT": ACTIVATIONS.index(activation)},
    )  # fmt: skip
    up0 = 0 if w_up is not None else F
    return launch, [1, F, K, 1 if per_slot else k, E, rows, up0]


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

    ``config``: R (features per threadgroup), U, W (as qmatmul's ``launch_config``; R there
    counts rows, so the default takes half of it); ``init_value`` pre-fills the output.
    """
    launch, edims = _launch(x, w, w_up, expert_ids, ggml_type, in_features, activation, config)
    wu = w if w_up is None else w_up
    inputs = [x, w, wu, uint32_ids(expert_ids)]
    (out,) = _KERNELS[ggml_type](
        [*inputs, mx.array(edims, dtype=mx.int32)], init_value=init_value, **launch
    )
    return out


class _Plan:
    """One call signature's launch, resolved once (a decode step pays a lookup and the launch)."""

    __slots__ = ("launch", "edims")

    def __init__(self, x, w, w_up, expert_ids, ggml_type: int, K: int, activation: str):
        launch, edims = _launch(x, w, w_up, expert_ids, ggml_type, K, activation, None)
        dtypes = [x.dtype, mx.uint8, mx.uint8, mx.uint32, mx.int32]
        self.launch = _KERNELS[ggml_type].launcher(dtypes, **launch)
        self.edims = mx.array(edims, dtype=mx.int32)

    def __call__(self, x, w, w_up, expert_ids) -> mx.array:
        ids = uint32_ids(expert_ids)
        # x as it comes ((..., K) or (..., k, K)): the kernel reads rows of K from flat memory
        inputs = [x, w, w if w_up is None else w_up, ids, self.edims]
        return self.launch(inputs=inputs)[0]


_CALLS: dict[tuple, _Plan] = {}
_DENSE: dict[tuple, tuple] = {}


def dense_glu(
    x: mx.array, w: mx.array, ggml_type: int, in_features: int, activation: str = "silu"
) -> mx.array | None:
    """act(gate) * up of a dense layer of fused [gate | up] GGML rows ``w`` (2F, row_bytes):
    x (..., K) -> (..., F), for 1..32 rows on a GPU in ONE launch (this kernel over a single
    expert, every id 0), where a mat-vec and the activation kernel take two. None where it
    does not apply (the caller runs the projection, then the activation). Its one rounding to
    x.dtype is the experts' (expert_glu_reference), not the two-step path's two."""
    key = (ggml_type, in_features, activation, x.shape, x.dtype, w.shape, w.dtype)
    plan = _DENSE.get(key) if backend() is not None else None
    if plan is None:
        rows = math.prod(x.shape[:-1])
        if not (
            backend() is not None
            and ggml_type in _KERNELS
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
        ids = mx.array([[0]] * rows, dtype=mx.uint32)  # a leaf with data (safe in a trace)
        launch, edims = _launch(x, w[None], None, ids, ggml_type, in_features, activation, None)
        launch["output_shapes"] = [(*x.shape[:-1], w.shape[0] // 2)]
        dtypes = [x.dtype, mx.uint8, mx.uint8, mx.uint32, mx.int32]
        plan = (_KERNELS[ggml_type].launcher(dtypes, **launch), ids, mx.array(edims, mx.int32))
        _DENSE[key] = plan
    launch, ids, edims = plan
    return launch(inputs=[x, w, w, ids, edims])[0]


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


def _check(x, w, w_up, ggml_type: int, K: int) -> None:
    """Caller errors the kernel path would otherwise miss (the fallback's expert_matmul
    raises the same ones)."""
    if x.shape[-1] != K:
        raise WeightMismatchError(f"x has {x.shape[-1]} features, the experts {K}")
    rb = row_bytes(ggml_type, K)
    for a in (w, w_up):
        if a is not None and (a.ndim != 3 or a.shape[-1] != rb or a.dtype != mx.uint8):
            raise WeightMismatchError(
                f"expected uint8 expert blocks (E, N, {rb}), got {a.dtype} {tuple(a.shape)}"
            )
    if w_up is None and w.shape[1] % 2:
        raise WeightMismatchError(f"a fused gate_up weight needs an even row count: {w.shape}")


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
    1..32 tokens, one kernel; otherwise the two-step path the models ran before (expert_matmul
    of the gate_up rows, then ``activations.gated_activation``), rounding the projections to
    x.dtype in between."""
    if activation not in ACTIVATIONS:
        raise InvalidArgumentError(f"activation {activation!r} is not one of {ACTIVATIONS}")
    key = (_KERNELS.get(ggml_type), ggml_type, in_features, activation, x.shape, x.dtype,
           w.shape, w.dtype, None if w_up is None else w_up.shape, expert_ids.shape,
           expert_ids.dtype)  # fmt: skip
    be = backend()
    if be is not None:
        plan = _CALLS.get(key)
        if plan is not None:
            return plan(x, w, w_up, expert_ids)
    if ggml_type is not None and be is not None and _kernel_covers(x, w, w_up, expert_ids,
                                                                   ggml_type):  # fmt: skip
        _check(x, w, w_up, ggml_type, in_features)
        plan = _CALLS[key] = _Plan(x, w, w_up, expert_ids, ggml_type, in_features, activation)
        return plan(x, w, w_up, expert_ids)
    if w_up is None:
        gate_up = expert_matmul(x, w, expert_ids, ggml_type, in_features)  # (..., k, 2F)
        return activations.gated_activation(gate_up, None, activation)
    gate = expert_matmul(x, w, expert_ids, ggml_type, in_features)
    up = expert_matmul(x, w_up, expert_ids, ggml_type, in_features)
    return activations.gated_activation(gate, up, activation)
