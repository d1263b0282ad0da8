"""Routed experts' down projections and their gate-weighted sum in one launch (GGML blocks)."""

from __future__ import annotations

import math
import os

import mlx.core as mx
from gguf import GGMLQuantizationType

from hf2q_mlx.custom_kernels import backend, expert_mma, int_setting
from hf2q_mlx.custom_kernels import qmatmul as Q
from hf2q_mlx.custom_kernels._render import Example, Kernel
from hf2q_mlx.custom_kernels.dequant import row_bytes
from hf2q_mlx.custom_kernels.expert_glu import MAX_TOKENS, expert_run_config, grouped_slice_tokens
from hf2q_mlx.custom_kernels.expert_matmul import (
    GROUPED_MODES,
    expert_matmul,
    expert_matmul_reference,
    ids_and_weights,
    prefill_mode,
    run_slices,
)
from hf2q_mlx.custom_kernels.ggml_formats import fill_format, kernel_header, rows_per_step
from hf2q_mlx.custom_kernels.launch_plan import LaunchPlan
from hf2q_mlx.errors import InvalidArgumentError, WeightMismatchError


def expert_down_reference(
    h: mx.array,
    w: mx.array,
    expert_ids: mx.array,
    weights: mx.array,
    ggml_type: int | None,
    in_features: int,
) -> mx.array:
    """h (..., k, F) one row per slot, expert_ids and weights (..., k) -> the weighted sum of
    the slots' down projections, sum_s weights[s] * (W[ids[s]] @ h[s]), (..., N) in h.dtype.
    fp32 throughout (expert_matmul_reference's math), rounded once: the kernel's oracle."""
    y = expert_matmul_reference(h.astype(mx.float32), w, expert_ids, ggml_type, in_features)
    return (y * weights[..., None].astype(mx.float32)).sum(axis=-2).astype(h.dtype)


# --------------------------------------------------------------------------------------------
# Kernel: qmatmul's fp32 GGML mat-vec loop (as expert_matmul runs it) once per slot of a token
# inside one threadgroup, each slot's R row sums added into `tot` with the slot's weight; the
# lane and SIMD-group reduction runs once, on the weighted sum.

_PREFIX = r"""
  // Thread mapping: threadgroup (gid_x, gid_y) = (block of R output rows, token t); its SIMD
  // groups run the mat-vec loop below for each slot s of t in turn (expert ids[t, s], input
  // row h[t, s]) and keep sum_s wts[t, s] * row sums. edims = (1, N, K, slots, E).
  const uint ex_tok = gid_y;
  const uint ex_slots = uint(edims[3]);
  const uint ex_k = uint(edims[2]);
  float tot[R];
  UNROLL for (int r = 0; r < R; ++r) tot[r] = 0.0f;
  bool ex_bad = false;  // an id past the last expert: NaN rows (nothing of it is read)
  for (uint slot = 0; slot < ex_slots; ++slot) {
    const uint ex_pair = ex_tok * ex_slots + slot;
    const uint ex_e = uint(ids[ex_pair]);
    if (ex_e >= uint(edims[4])) {  // the same for every thread: no divergence
      ex_bad = true;
      continue;
    }
    const float ex_w = wts[ex_pair];
    CONSTANT_PTR(const int) dims = edims;
    DEVICE_PTR(const T) x = xs + size_t(ex_pair) * ex_k;
    DEVICE_PTR(const uchar) w = wq + size_t(ex_e) * uint(edims[1]) * (size_t(ex_k / @QK@) * @BB@);
"""

_EPILOGUE = r"""
    UNROLL for (int r = 0; r < R; ++r) tot[r] = fma_f(ex_w, acc[r][0], tot[r]);
  }
  // Sum the lanes, then the SIMD groups, and write the token's R rows.
  const uint out_row0 = gid_x * R;
  const uint out_n = uint(edims[1]);
  SHARED float red[8 * R];
  UNROLL for (int r = 0; r < R; ++r) {
    const float v = simd_sum(tot[r]);
    if (lane == 0) red[simd_id * R + r] = v;
  }
  BARRIER();
  if (tid < uint(R) && out_row0 + tid < out_n) {
    float v = 0.0f;
    for (uint s = 0; s < n_simd; ++s) v += red[s * R + tid];
    if (ex_bad) v = bitcast<float>(0x7FC00000u);
    ys[size_t(ex_tok) * out_n + out_row0 + tid] = from_float<T>(v);
  }
"""


# The slot kernel's prologue with PK (row packing): lane block slot ex_lb = lane / LPB takes
# block ex_lb % nb of row group ex_lb / nb; row r of a SIMD group is row0 + r ex_pk + group.
_PACK_EDITS = [
    ("  const uint row0 = gid_x * R;\n", "  const uint row0 = out_row0;\n"),
    (
        "  const uint bsub = lane / LPB;\n",
        "  const uint ex_lb = lane / LPB;\n"
        "  const uint bsub = PK ? ex_lb % nb : ex_lb;\n"
        "  const uint ex_rsub = PK ? ex_lb / nb : 0u;  // the lane's row group\n",
    ),
    (
        "    wrow[r] = w + size_t(row0 + r < N ? row0 + r : N - 1) * row_bytes;\n",
        "    wrow[r] = w + size_t(row0 + r * ex_pk + ex_rsub < N ? row0 + r * ex_pk + ex_rsub\n"
        "                                                     : N - 1) * row_bytes;\n",
    ),
]


def _loop(slots: bool = False) -> str:
    """qmatmul's fp32 mat-vec loop inside this kernel's slot loop, with its own epilogue;
    ``slots``: the slot-parallel kernel's, a team's SIMD groups (not the threadgroup's) along K."""
    body = Q._BODY
    if "@PROLOGUE@" not in body or "@EPILOGUE@" not in body:
        raise RuntimeError("expert_down: qmatmul's mat-vec loop no longer has its placeholders")
    if slots:
        for old in ("simd_id * U", "n_simd * U"):
            if body.count(old) != 1:
                raise RuntimeError(
                    f"expert_down: qmatmul's mat-vec loop no longer has {old!r} once"
                )
        body = body.replace("simd_id * U", "ex_sg * U").replace("n_simd * U", "ex_nsg * U")
    prologue = Q._PROLOGUE.lstrip("\n")
    if slots:
        for old, new in _PACK_EDITS:
            if prologue.count(old) != 1:
                raise RuntimeError(f"expert_down: qmatmul's prologue no longer has {old!r} once")
            prologue = prologue.replace(old, new)
    epilogue = (_SLOTS_EPILOGUE if slots else _EPILOGUE).lstrip("\n")
    return body.replace("@PROLOGUE@", prologue).replace("@EPILOGUE@", epilogue)


def _make_kernel(ggml_type: int, slots: bool = False) -> Kernel:
    """Today's kernel, or with ``slots`` the slot-parallel one (template S: slot teams)."""
    # (T, R, U, S, PK) to render
    configs = ((mx.float32, 4, 2, 2, 0), (mx.bfloat16, 2, 1, 8, 0), (mx.bfloat16, 4, 1, 8, 1))
    examples = [
        Example(
            {"xs": dt, "wq": mx.uint8, "ids": mx.uint32, "wts": mx.float32, "edims": (mx.int32, 5)},
            {"ys": dt},
            {"T": dt, "MT": 1, "R": r, "U": u, **({"S": s, "PK": pk} if slots else {})},
        )  # fmt: skip
        for dt, r, u, s, pk in (configs if slots else configs[:2])
    ]
    prefix, kind = (_SLOTS_PREFIX, "slots_") if slots else (_PREFIX, "")
    return Kernel(
        f"ggml_expert_down_{kind}{GGMLQuantizationType(ggml_type).name.lower()}",
        inputs=["xs", "wq", "ids", "wts", "edims"],
        outputs=["ys"],
        body=fill_format(prefix + _loop(slots), ggml_type),
        header=kernel_header(ggml_type),
        examples=examples,
    )


# --------------------------------------------------------------------------------------------
# Kernel, slot-parallel ("S" >= 2 in a launch config): the same mat-vec loop, but a token's k
# slots spread over S teams of SIMD groups, so a threadgroup runs S slots at once instead of a
# chain of k short mat-vecs. Each slot's row sums are reduced whole (lanes, then the team's
# SIMD groups), then added times their gate weights in slot order 0..k-1: the bits depend on
# U and W (the order along K) only, not on S, R or the tokens beside.

_SLOTS_PREFIX = r"""
  // Thread mapping: threadgroup (gid_x, gid_y) = (block of R output rows, token t) of S teams of
  // n_simd / S SIMD groups; in round b team j runs the mat-vec loop below for slot b * S + j of t
  // (its SIMD groups on interleaved runs along K), and threads tid < R (one per row) then add
  // the round's S slot sums, times their weights, in slot order. With PK, each SIMD group's
  // step holds ex_pk short rows (block slot j: block j % nb of row group j / nb), so the
  // threadgroup owns R ex_pk rows. edims = (1, N, K, slots, E).
  const uint ex_tok = gid_y;
  const uint ex_slots = uint(edims[3]);
  const uint ex_k = uint(edims[2]);
  const uint out_n = uint(edims[1]);
  // PK = 1 (rows of nb < BPS blocks, BPS a multiple of nb): a step's BPS block slots hold
  // ex_pk = BPS / nb rows' blocks, so each SIMD group sums R x ex_pk rows with every lane busy
  const uint ex_pk = PK ? (32u / uint(@LPB@)) / (ex_k / uint(@QK@)) : 1u;
  const uint out_row0 = gid_x * R * ex_pk;
  const uint ex_nsg = n_simd / uint(S);  // SIMD groups per team
  const uint ex_team = simd_id / ex_nsg;
  const uint ex_sg = simd_id % ex_nsg;  // the SIMD group's place in its team: its runs along K
  SHARED float ex_red[8 * R * (PK ? 32 / @LPB@ : 1)];  // [simd_id][row]: a round's slot sums
  float tot = 0.0f;  // thread tid < R ex_pk: row out_row0 + tid, slots 0..b * S + S - 1 so far
  bool ex_bad = false;  // an id past the last expert: NaN rows (nothing of it is read)
  for (uint ex_base = 0; ex_base < ex_slots; ex_base += uint(S)) {
    const uint slot = ex_base + ex_team;
    const uint ex_pair = ex_tok * ex_slots + slot;
    const uint ex_e = slot < ex_slots ? uint(ids[ex_pair]) : 0u;
    if (slot < ex_slots && ex_e < uint(edims[4])) {  // the same for a team's threads
    CONSTANT_PTR(const int) dims = edims;
    DEVICE_PTR(const T) x = xs + size_t(ex_pair) * ex_k;
    DEVICE_PTR(const uchar) w = wq + size_t(ex_e) * out_n * (size_t(ex_k / @QK@) * @BB@);
"""

_SLOTS_EPILOGUE = r"""
    UNROLL for (int r = 0; r < R; ++r) {
      float v;
      if (PK) {  // a row group's lanes: nb * LPB consecutive ones (a power of 2)
        v = acc[r][0];
        for (uint o = 1; o < nb * uint(LPB); o <<= 1) v += simd_shuffle_xor(v, o);
      } else {
        v = simd_sum(acc[r][0]);
      }
      if (lane % (PK ? nb * uint(LPB) : 32u) == 0) ex_red[(simd_id * R + r) * ex_pk + ex_rsub] = v;
    }
    }
    BARRIER();
    if (tid < uint(R) * ex_pk) {
      for (uint j = 0; j < uint(S) && ex_base + j < ex_slots; ++j) {
        const uint pair = ex_tok * ex_slots + ex_base + j;
        if (uint(ids[pair]) >= uint(edims[4])) {
          ex_bad = true;
          continue;
        }
        float v = 0.0f;  // the slot's sum over its team's SIMD groups, in their order
        for (uint s = 0; s < ex_nsg; ++s) v += ex_red[(j * ex_nsg + s) * R * ex_pk + tid];
        tot = fma_f(wts[pair], v, tot);
      }
    }
    BARRIER();  // ex_red is rewritten by the next round
  }
  if (tid < uint(R) * ex_pk && out_row0 + tid < out_n) {
    if (ex_bad) tot = bitcast<float>(0x7FC00000u);
    ys[size_t(ex_tok) * out_n + out_row0 + tid] = from_float<T>(tot);
  }
"""


_KERNELS: dict[int, Kernel] = {t: _make_kernel(t) for t in Q.MAT_VEC_TYPES}
_SLOT_KERNELS: dict[int, Kernel] = {t: _make_kernel(t, slots=True) for t in Q.MAT_VEC_TYPES}
_MAX_SIMD = 8  # both kernels' shared buffers hold 8 SIMD groups' sums

# HF2Q_DOWN_SLOTS: slot teams the dispatcher gives the slot-parallel kernel; 0 or 1: the
# per-pair kernel, each SIMD group looping over a token's k slots. S >= 2 is capped at k and at
# 8 // W teams (the bits do not depend on S). Unset ("auto"): 8 with the CUDA back end (session
# 41, H100, graph decode: 26B-A4B Q4_K 1.08x, 35B-A3B Q4_K 1.14x the per-pair kernel), 0
# elsewhere (never run on Metal). SLOT_ROWS: its R (0: expert_run_config's). Both are read
# when a call shape's launch is first built (the plan cache keys on them), so a benchmark may
# flip them in one process.
SLOT_TEAMS: int | str = os.environ.get("HF2Q_DOWN_SLOTS", "auto")
SLOT_ROWS: int | str = os.environ.get("HF2Q_DOWN_SLOT_ROWS", "0")
AUTO_SLOT_TEAMS = 8  # "auto" on CUDA

# HF2Q_DOWN_PACK: the slot kernel packs rows of fewer blocks than a step's block slots
# (``ggml_formats.rows_per_step``: Qwen3.5-35B-A3B's Q4_K down rows, K 512 = 2 blocks, leave 24
# of 32 lanes idle otherwise). "auto" (unset): on with the CUDA back end (session 46, H200,
# 35B-A3B Q4_K: the down 97.8 -> 35.5 us a call at 8 rows; one stream 303 against 281 tok/s), 0
# elsewhere (never run on Metal); 0 / 1 force it. Read when a call shape's launch is built.
PACK: str = os.environ.get("HF2Q_DOWN_PACK", "auto")


def pack_on() -> bool:
    """Whether HF2Q_DOWN_PACK (PACK) asks for row packing here."""
    if PACK.strip().lower() in ("auto", ""):
        return backend() == "cuda"
    return bool(int_setting("HF2Q_DOWN_PACK", PACK, 0, 1))


def slot_config(ggml_type: int, K: int, k: int) -> dict[str, int] | None:
    """The dispatcher's slot-parallel launch for k slots per token: expert_run_config's R, U, W
    (R = SLOT_ROWS when set) and S = min(SLOT_TEAMS, k, 8 // W); None (today's kernel) while
    SLOT_TEAMS < 2 ("auto": ``AUTO_SLOT_TEAMS`` with the CUDA back end, else 0). Depends on
    (type, K, k) only, never on the tokens."""
    teams = SLOT_TEAMS
    if str(teams).strip().lower() in ("auto", ""):
        teams = AUTO_SLOT_TEAMS if backend() == "cuda" else 0
    try:
        teams, rows = int(teams), int(SLOT_ROWS)
    except ValueError:
        raise InvalidArgumentError(
            f"HF2Q_DOWN_SLOTS / HF2Q_DOWN_SLOT_ROWS must be integers, got {SLOT_TEAMS!r} / "
            f"{SLOT_ROWS!r}"
        ) from None
    if teams < 2 or k < 2:
        return None
    cfg = expert_run_config(ggml_type, K)
    if rows > 0:
        cfg["R"] = rows
    cfg["S"] = max(1, min(teams, k, _MAX_SIMD // cfg["W"]))
    if pack_on() and rows_per_step(ggml_type, K) > 1:
        cfg["PK"] = 1
    return cfg if cfg["S"] > 1 else None


def _plan(h, w, expert_ids, ggml_type: int, K: int, config) -> LaunchPlan:
    """One call's launch on its type's kernel, with ``edims`` (1, N, K, slots, E); config "S"
    >= 2 takes the slot-parallel kernel with S teams of W SIMD groups."""
    E, N, _ = w.shape
    k = expert_ids.shape[-1]
    tokens = expert_ids.size // k
    cfg = dict(config or expert_run_config(ggml_type, K))
    S = cfg.get("S", 1)
    if S < 1 or S * cfg["W"] > _MAX_SIMD:
        raise InvalidArgumentError(f"config {cfg}: S x W must be 1..{_MAX_SIMD} SIMD groups")
    template = {"T": h.dtype, "MT": 1, "R": cfg["R"], "U": cfg["U"]}
    pk = 1
    if S > 1:
        pk = rows_per_step(ggml_type, K) if cfg.get("PK") else 1
        if cfg.get("PK") and (pk < 2 or cfg["R"] * pk > 32 * cfg["W"] * S):
            raise InvalidArgumentError(f"config {cfg}: no row packing for K {K} of this type")
        template.update(S=S, PK=int(pk > 1))
    return LaunchPlan(
        (_SLOT_KERNELS if S > 1 else _KERNELS)[ggml_type],
        [1, N, K, k, E],
        grid=(-(-N // (cfg["R"] * pk)) * 32 * cfg["W"] * S, tokens),
        threadgroup=(32 * cfg["W"] * S, 1),
        output_shapes=[(*expert_ids.shape[:-1], N)],  # written flat: no reshape node after
        output_dtypes=[h.dtype],
        template=template,
    )


def expert_down_kernel(
    h: mx.array,
    w: mx.array,
    expert_ids: mx.array,
    weights: mx.array,
    ggml_type: int,
    in_features: int,
    *,
    config: dict[str, int] | None = None,
    init_value: float | None = None,
) -> mx.array:
    """The GPU kernel alone, the contract of :func:`expert_down_reference` for GGML weights;
    a token with an id >= E gives a NaN row. ``config`` overrides R, U, W (and S: slot teams,
    the slot-parallel kernel from 2 on); ``init_value`` pre-fills the output (tests poison it
    with NaN)."""
    plan = _plan(h, w, expert_ids, ggml_type, in_features, config)
    return plan.call(h, w, *ids_and_weights(expert_ids, weights), init_value=init_value)


_CALLS: dict[tuple, LaunchPlan] = {}  # per dispatcher call signature: its launch, resolved once


def kernel_covers(h, w, expert_ids, weights, ggml_type) -> bool:
    """True when :func:`expert_down` runs its kernel: a GPU, GGML experts, 1..32 tokens, one
    input row per (token, slot)."""
    return (
        backend() is not None
        and ggml_type in _KERNELS
        and h.dtype in Q.X_DTYPES
        and h.ndim == expert_ids.ndim + 1
        and tuple(h.shape[:-1]) == tuple(expert_ids.shape)
        and tuple(weights.shape) == tuple(expert_ids.shape)
        and 1 <= math.prod(expert_ids.shape[:-1]) <= MAX_TOKENS
        and expert_ids.size > 0
        and w.shape[0] > 0
        and w.shape[1] > 0
    )


def _grouped_prefill(h, w, expert_ids, weights, ggml_type: int, K: int,
                     wide: bool) -> mx.array | None:  # fmt: skip
    """HF2Q_EXPERT_PREFILL=grouped, more than MAX_TOKENS tokens: this dispatcher over slices of
    ``grouped_slice_tokens`` tokens (the grouped kernels; a short last slice takes whichever
    kernel its size takes), each slice's h, ids and weights ``owned_rows`` (not views at an
    offset); ``wide`` (grouped-wide): every slice one launch of the wide kernels. None where
    the grouped kernels do not cover a full slice."""
    lead, k = expert_ids.shape[:-1], expert_ids.shape[-1]
    n_tok = math.prod(lead)
    if (
        not expert_mma.ENABLED
        or h.ndim != expert_ids.ndim + 1
        or tuple(h.shape[:-1]) != tuple(expert_ids.shape)
        or tuple(weights.shape) != tuple(expert_ids.shape)
    ):
        return None
    hs = h.reshape(n_tok, k, h.shape[-1])
    ids, wts = expert_ids.reshape(n_tok, k), weights.reshape(n_tok, k)
    step = grouped_slice_tokens(k, wide)
    if not expert_mma.covers(hs[:step], w, ids[:step], ggml_type, glu=False, wide=wide):
        return None

    def launch(hi, ii, wi, rows):  # one slice
        if wide:  # the GLU's sorted pair lists of this slice, where it got the same expert_ids
            return expert_mma.expert_down(hi, w, ii, wi, ggml_type, K, True,
                                          pairs_of=(expert_ids, rows))  # fmt: skip
        return expert_down(hi, w, ii, wi, ggml_type, K)

    return mx.concatenate(run_slices((hs, ids, wts), step, launch)).reshape(*lead, w.shape[1])


def expert_down(
    h: mx.array,
    w: mx.array,
    expert_ids: mx.array,
    weights: mx.array,
    ggml_type: int | None,
    in_features: int,
) -> mx.array:
    """Dispatcher with the contract of :func:`expert_down_reference`: on a GPU, GGML experts
    and 1..32 tokens, one kernel; past 32 tokens with HF2Q_EXPERT_PREFILL=grouped, the grouped
    kernels over slices of 32 tokens (grouped-wide: the wide kernels, 512 tokens a slice at
    top-8); otherwise the path the models ran before (expert_matmul,
    then the weighted sum in h's dtype)."""
    if expert_mma.ENABLED:  # each expert read once for its pairs (from MIN_TOKENS tokens on)
        y = expert_mma.expert_down(h, w, expert_ids, weights, ggml_type, in_features)
        if y is not None:  # None: expert_mma.covers says no
            return y
    key = (_KERNELS.get(ggml_type), _SLOT_KERNELS.get(ggml_type), SLOT_TEAMS, SLOT_ROWS, PACK,
           ggml_type, in_features, h.shape, h.dtype, w.shape, expert_ids.shape,
           expert_ids.dtype, weights.dtype)  # fmt: skip
    plan = _CALLS.get(key) if backend() is not None else None
    if plan is None and ggml_type is not None and kernel_covers(h, w, expert_ids, weights,
                                                                ggml_type):  # fmt: skip
        if h.shape[-1] != in_features:
            raise WeightMismatchError(f"h has {h.shape[-1]} features, the experts {in_features}")
        rb = row_bytes(ggml_type, in_features)
        if w.ndim != 3 or w.shape[-1] != rb or w.dtype != mx.uint8:
            raise WeightMismatchError(
                f"expected uint8 expert blocks (E, N, {rb}), got {w.dtype} {tuple(w.shape)}"
            )
        slots = slot_config(ggml_type, in_features, expert_ids.shape[-1])
        plan = _plan(h, w, expert_ids, ggml_type, in_features, slots)
        _CALLS[key] = plan.resolve(h.dtype, mx.uint8, mx.uint32, mx.float32)
    if plan is not None:
        return plan.run(h, w, *ids_and_weights(expert_ids, weights))
    if (
        ggml_type is not None
        and h.dtype == mx.bfloat16
        and math.prod(expert_ids.shape[:-1]) > MAX_TOKENS
        and backend() is not None
        and (mode := prefill_mode()) in GROUPED_MODES
    ):
        wide = mode == "grouped-wide"
        y = _grouped_prefill(h, w, expert_ids, weights, ggml_type, in_features, wide)
        if y is not None:
            return y
    y = expert_matmul(h, w, expert_ids, ggml_type, in_features)  # (..., k, N)
    return (y * weights[..., None].astype(y.dtype)).sum(axis=-2)
