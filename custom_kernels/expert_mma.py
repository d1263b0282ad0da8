"""Routed experts grouped by expert on the tensor cores: each expert's weights read once per call.

The references are expert_glu.expert_glu_reference and expert_down.expert_down_reference."""

from __future__ import annotations

import math
import os

import mlx.core as mx
from gguf import GGMLQuantizationType

from hf2q_mlx.custom_kernels import activations, backend, env_int, int_setting
from hf2q_mlx.custom_kernels import qmatmul_mma as MM
from hf2q_mlx.custom_kernels._render import Example, Kernel, launch_bounds
from hf2q_mlx.custom_kernels.dequant import row_bytes
from hf2q_mlx.custom_kernels.expert_matmul import (
    check_expert_blocks,
    ids_and_weights,
    owned_rows,
    uint32_ids,
)
from hf2q_mlx.custom_kernels.ggml_formats import fill_format, kernel_header
from hf2q_mlx.custom_kernels.launch_plan import LaunchPlan
from hf2q_mlx.custom_kernels.qmatmul import ROW_SLICE_MAX
from hf2q_mlx.errors import InvalidArgumentError, WeightMismatchError

# HF2Q_GROUPED_EXPERTS: "auto" (default) takes the grouped kernels from MIN_TOKENS tokens per
# call, the gate/up from MIN_TOKENS_GLU (a serving step's rows; on the H200 they are 1.7x the
# per-pair kernels at 32 tokens, slower at 1: bench/expert_sweep.py), "1" at every covered
# call, "0" never.
# The choice depends on the call's shape only, so a compiled step of B rows always runs the
# same kernels (a row's tokens do not depend on the other rows' activity).
MODE = os.environ.get("HF2Q_GROUPED_EXPERTS", "auto")
ENABLED = MODE != "0"
# The down's threshold (auto): 8 tokens. 8 rows of distinct prompts, CUPTI, the slot-parallel
# down against the grouped one: session 46 (H200), 35B-A3B Q4_K (K 512 = two blocks) 97.8 us a
# call (35.5 packed) against 24.3, serving 8 streams steady 1,419 against 942 tok/s; session 47
# (H100), 26B-A4B Q5_0 (K 704) 63.6 against 24.9 us, the step's kernels 7.90 -> 6.71 ms a token.
# HF2Q_GROUPED_MIN (1..32) sets it; MIN_TOKENS None: DOWN_MIN.
_min_env = env_int("HF2Q_GROUPED_MIN", 1, 32)
MIN_TOKENS: int | None = 1 if MODE == "1" else _min_env
DOWN_MIN = 8
# The gate/up kernel's own threshold (auto only): 8 tokens. On the H200 an 8-row serving step
# gained with it on both MoE shapes, one process each (session 24, `grouped-glu-serve`): 8
# streams 1,089 against 840 tok/s on 26B-A4B, 981 against 877 on 35B-A3B; the down stays
# per-pair below 16 (153 against 108 us a call at 8 tokens). HF2Q_GROUPED_GLU_MIN moves it.
GLU_MIN_DEFAULT = 8
_glu_env = env_int("HF2Q_GROUPED_GLU_MIN", 1, 32)
MIN_TOKENS_GLU = (GLU_MIN_DEFAULT if _glu_env is None else _glu_env) if MODE == "auto" else None
MAX_TOKENS = MM.GLU_MAX_ROWS  # tokens per call (32: the n-tiles' columns)
MAX_PAIRS = 256  # (token, slot) pairs per call: the shared pair list's size (32 tokens x 8)
# The prefill's kernels ("wide"): the same loop with a pair list of WIDE_LIST entries, so one
# launch takes up to WIDE_PAIRS pairs (512 tokens at top-8) and reads each chosen expert once
# for all of them, where the 32-token kernels read it once per 32 tokens. A pair's bits are the
# same in both (see below). WIDE_PAIRS is read at each call (tests lower it to cut slices).
WIDE_LIST = 4096
WIDE_PAIRS = WIDE_LIST
# n-tiles of 8 columns per column group in the wide kernels (HF2Q_GROUPED_WIDE_NT: 1, 2 or 4;
# ``wide_nt``, the plan caches key on it): an expert's weight tile is decoded once per group,
# and a 512-token launch gives an expert ~16 (35B-A3B) to ~32 (26B-A4B) pairs, a dense
# linear's one-expert prefill (``dense_grouped_matmul``) all of them. Not timed yet; NT
# changes no bits (U and W alone set a column's sum).
WIDE_NT = os.environ.get("HF2Q_GROUPED_WIDE_NT", "2")  # its value at import; parsed by wide_config


def wide_nt() -> str:
    """HF2Q_GROUPED_WIDE_NT as set at this call (bench/prefill.py's ``--env`` variants in one
    process), else WIDE_NT."""
    return os.environ.get("HF2Q_GROUPED_WIDE_NT", WIDE_NT)


# HF2Q_GROUPED_WIDE_MIN_BLOCKS (1..16; unset: none; read per call as HF2Q_GROUPED_WIDE_NT is):
# launch bounds on the wide kernels' cubins (our units: the prefill's; not MLX's builds) asking
# nvcc for that many threadgroups an SM. Same math, same bits. nvcc 13.0 (sm_90), the sorted
# Q4_K gate/up at its wide config (NT 2, U 1, W 2): 172 registers, 5 threadgroups (10 SIMD
# groups) an SM; 8 gives 128 registers with 72 bytes spilled. Session 47's prefill profile put
# that kernel at half of 26B-A4B's 512-token prefill (0.22 TB/s). Not yet on a GPU: unset.
WIDE_MIN_BLOCKS = os.environ.get("HF2Q_GROUPED_WIDE_MIN_BLOCKS", "")


def wide_min_blocks() -> int | None:
    """HF2Q_GROUPED_WIDE_MIN_BLOCKS as set at this call, else WIDE_MIN_BLOCKS: 1..16, None when
    unset; ``InvalidArgumentError`` (one line) else."""
    raw = os.environ.get("HF2Q_GROUPED_WIDE_MIN_BLOCKS", WIDE_MIN_BLOCKS)
    return int_setting("HF2Q_GROUPED_WIDE_MIN_BLOCKS", raw, 1, 16)


def sorted_lists() -> bool:
    """``HF2Q_GROUPED_SORTED`` (read per call; 1 or unset on, 0 off): the wide kernels take
    each expert's pairs from the call's pairs sorted by expert (``expert_order``: MLX's argsort
    and a count, once per slice for a layer's GLU and down) instead of every threadgroup
    scanning all of the call's ids. At 512 tokens that scan (P / 32 steps per SIMD group, in
    each of the (rows / 16) x (E + 1) threadgroups) is longer than a threadgroup's math;
    sorted, a threadgroup reads its own pairs only, and one without any leaves at once. No
    bits change: a pair's sums do not depend on the pairs beside it. Session 37 (H200, Q4_K
    prefill tok/s, 3 rounds): 26B-A4B 1.19x at 512 tokens, 1.26x at 2048; 35B-A3B 1.22x,
    1.46x."""
    return env_int("HF2Q_GROUPED_SORTED", 0, 1) != 0


def expert_order(expert_ids: mx.array, E: int) -> tuple[mx.array, mx.array]:
    """The call's pairs by expert: ``order`` (P,) uint32, the pair indices sorted by id (ids
    past the last expert as E), and ``offs`` (E + 2,) int32, expert e's pairs at
    order[offs[e]:offs[e + 1]] (e = E: the bad ids). MLX ops its CUDA back end ships compiled
    (argsort, a one-hot count, a cumulative sum): nothing for it to JIT."""
    key = mx.minimum(expert_ids.reshape(-1).astype(mx.uint32), E)
    order = mx.argsort(key).astype(mx.uint32)
    counts = (key[:, None] == mx.arange(E + 1, dtype=mx.uint32)).astype(mx.int32).sum(axis=0)
    offs = mx.concatenate([mx.zeros((1,), mx.int32), mx.cumsum(counts)])
    return order, offs


# --------------------------------------------------------------------------------------------
# Kernel: qmatmul_mma's loop (16 rows of H row sets against up to 8 NT columns of x) with the
# columns taken from the pairs that chose the threadgroup's expert. The text edits below keep
# the loop itself as it is: each column's sum meets the same operations in the same order as a
# lone column's (U, W from (type, K); NT only sets how many columns ride along), so a pair's
# bits do not depend on which or how many pairs share its expert.

_PREFIX = r"""
  // Thread mapping: threadgroup (gid_x, gid_y) = (rows row0 .. row0 + 15 of each row set,
  // expert gid_y); gid_y = E takes the ids past the last expert (NaN rows, nothing read). The
  // pairs (token, slot) that chose the expert are its columns, in column groups of 8 NT; the
  // mma loop below (qmatmul_mma's) runs once per group. dims = (pairs P, N rows per set, K, E,
  // pairs per x row, rows per expert, first row of set 1 in w1).
  const uint ex_e = gid_y, ex_E = uint(dims[3]), ex_P = uint(dims[0]);
  const uint ex_per_row = uint(dims[4]);
  // Every SIMD group scans the ids 32 at a time (so each knows the count before any barrier);
  // SIMD group 0 writes the pair list, in pair order.
  SHARED ushort ex_pairs[@MAX_PAIRS@];
  uint ex_n = 0;
  for (uint ex_c = 0; ex_c < ex_P; ex_c += 32) {
    const uint p = ex_c + lane;
    const uint id = p < ex_P ? uint(ids[p]) : 0u;
    const uint hit = (p < ex_P && (ex_e < ex_E ? id == ex_e : id >= ex_E)) ? 1u : 0u;
    const uint incl = simd_prefix_inclusive_sum(hit);
    if (hit != 0u && simd_id == 0) ex_pairs[ex_n + incl - 1u] = ushort(p);
    ex_n += simd_broadcast(incl, 31u);
  }
  if (ex_n == 0) return;  // no pair chose this expert: the whole threadgroup leaves here
  BARRIER();
"""

# HF2Q_GROUPED_SORTED's prefix: the expert's pairs read from the sorted list (expert_order)
_PREFIX_SORTED = r"""
  // Thread mapping: threadgroup (gid_x, gid_y) = (rows row0 .. row0 + 15 of each row set,
  // expert gid_y); gid_y = E takes the ids past the last expert (NaN rows, nothing read). The
  // pairs (token, slot) that chose the expert are its columns, read from the call's pairs
  // sorted by expert (order[offs[e] .. offs[e + 1]]), in column groups of 8 NT; the mma loop
  // below (qmatmul_mma's) runs once per group. dims = (pairs P, N rows per set, K, E, pairs
  // per x row, rows per expert, first row of set 1 in w1).
  const uint ex_e = gid_y, ex_E = uint(dims[3]);
  const uint ex_per_row = uint(dims[4]);
  // The list is read where it lies (no shared copy), and the SIMD groups' sums meet in a
  // buffer of SW groups, not 8: less shared memory a threadgroup, more of them an SM.
  const uint ex_lo = uint(offs[ex_e]);
  const uint ex_n = uint(offs[ex_e + 1]) - ex_lo;
  if (ex_n == 0) return;  // no pair chose this expert: the whole threadgroup leaves here
  DEVICE_PTR(const uint) ex_pairs = order + ex_lo;
"""

# after the loop's N, K, row_bytes, g, row0: the NaN rows of bad ids, the expert's row sets
_SETUP = r"""  if (ex_e >= ex_E) {
    for (uint i = tid; i < 16 * ex_n; i += tg_size) {
      const uint r = i % 16;
      const float nan = bitcast<float>(0x7FC00000u);
      if (row0 + r < N) out[size_t(ex_pairs[i / 16]) * N + row0 + r] = from_float<@OUT_T@>(nan);
    }
    return;
  }
  DEVICE_PTR(const T) x = xs;
  // set 0 (gate, or the down rows) from w0, set 1 (up) from w1, each at this expert's rows
  DEVICE_PTR(const uchar) ex_w[2];
  ex_w[0] = w0 + size_t(ex_e) * uint(dims[5]) * row_bytes;
  ex_w[1] = w1 + (size_t(ex_e) * uint(dims[5]) + uint(dims[6])) * row_bytes;
  constexpr uint CW = 8 * NT;  // columns per group
  SHARED float red[H * @RED_SIMD@ * 16 * CW];  // [set][SIMD group][row 0..15][column 0..CW - 1]
"""

_GROUP_HEAD = r"""  for (uint ex_c0 = 0; ex_c0 < ex_n; ex_c0 += CW) {
  // this group's columns: pairs ex_pairs[ex_c0 ..], M of them; lane g's x row in n-tile n
  const uint M = ex_n - ex_c0 < CW ? ex_n - ex_c0 : CW;
  uint ex_xrow[NT];
  UNROLL for (int n = 0; n < NT; ++n) {
    const uint c = 8 * uint(n) + g;
    ex_xrow[n] = c < M ? uint(ex_pairs[ex_c0 + c]) / ex_per_row : 0u;
  }
"""

_GROUP_TAIL = r"""  BARRIER();  // the next group rewrites red
  }
"""

# (old, new, count) text edits of qmatmul_mma._BODY, in order (CW and red move up to _SETUP)
_EDITS = [
    ("  constexpr uint CW = 8 * NT;  // columns of x\n", "", 1),
    ("  SHARED float red[H * 8 * 16 * CW];  // [set][SIMD group][row 0..15][column 0..CW - 1]\n",
     "", 1),
    ("  const uint M = uint(dims[0]);\n", "", 1),
    ("  // rows g, g + 8 of set h", _SETUP + "  // rows g, g + 8 of set h", 1),
    ("= w + (size_t(h) * N + ", "= ex_w[h] + (", 2),
    ("  float acc[H][NT][4];\n", _GROUP_HEAD + "  float acc[H][NT][4];\n", 1),
    (
        "          const uint col = 8 * uint(n) + g;\n",
        "          if (8 * uint(n) >= M) continue;  // an n-tile of padding only: uniform skip\n"
        "          const uint col = 8 * uint(n) + g;\n",
        1,
    ),
    ("xb + size_t(live ? col : 0u) * K", "xb + size_t(ex_xrow[n]) * K", 1),
]  # fmt: skip


def _body(ggml_type: int, halves: int, epilogue: str, out_t: str, max_pairs: int,
          sorted_: bool = False) -> str:  # fmt: skip
    """The grouped body: _PREFIX (``sorted_``: _PREFIX_SORTED), then qmatmul_mma's loop edited
    (_EDITS) inside the column-group loop, with ``epilogue`` writing pair ex_pairs[ex_c0 +
    col]'s row0 + r."""
    body = MM._BODY
    for old, new, count in _EDITS:
        if body.count(old) != count:
            # qmatmul_mma's loop changed shape: these edits must follow it (a loud import error,
            # not a kernel that silently reads the wrong columns)
            raise RuntimeError(f"expert_mma: qmatmul_mma's loop no longer has {old.strip()!r}")
        body = body.replace(old, new)
    ngr, mmg = MM._GROUPS[ggml_type]
    # the loop's loads a run ahead (qmatmul_mma's PF) are not measured here: off
    head = _PREFIX_SORTED if sorted_ else _PREFIX
    prefix = "  constexpr int PF = 0;\n" + head.replace("@MAX_PAIRS@", str(max_pairs))
    body = prefix + body.rstrip("\n") + "\n" + _GROUP_TAIL
    if sorted_:  # the reduction buffer by SW SIMD groups (a template value: the plan's W)
        if body.count("uint(h) * 8") != 3:
            raise RuntimeError("expert_mma: qmatmul_mma's reduction no longer indexes uint(h) * 8")
        body = body.replace("uint(h) * 8", "uint(h) * SW")
    body = body.replace("@RED_SIMD@", "SW" if sorted_ else "8")
    body = (
        body.replace("@NGR@", str(ngr))
        .replace("@MMG@", str(mmg))
        .replace("@H@", str(halves))
        .replace("@EPILOGUE@", epilogue)
        .replace("@OUT_T@", out_t)
    )
    return fill_format(body, ggml_type)


def _header(ggml_type: int) -> str:
    return kernel_header(ggml_type) + MM._MMA_COMMON + MM._LOAD_XB + MM._DECODERS[ggml_type]


_GLU_EPILOGUE = r"""    {
      const float g = v[0], u = v[1];  // feature row0 + r's gate and up sums, column col
@ACTIVATE@      out[size_t(ex_pairs[ex_c0 + col]) * N + row0 + r] = from_float<T>(a * u);
    }
""".replace("@ACTIVATE@", activations.ACTIVATE_EPILOGUE)

_DOWN_EPILOGUE = "    out[size_t(ex_pairs[ex_c0 + col]) * N + row0 + r] = v[0];\n"


def _make_kernel(ggml_type: int, glu: bool, wide: bool = False, sorted_: bool = False) -> Kernel:
    """The grouped GLU (gate and up row sets, act(gate) * up in x's dtype) or the grouped down
    projections (one row set, fp32 per pair) of a type; ``wide``: a pair list of WIDE_LIST;
    ``sorted_`` (wide only): the pairs from ``expert_order``'s order and offs, not the ids."""
    act = [{"ACT": 0}, {"ACT": 1}] if glu else [{}, {}]
    lists = {"order": mx.uint32, "offs": (mx.int32, 9)} if sorted_ else {"ids": mx.uint32}
    examples = [
        Example(
            {"xs": mx.bfloat16, "w0": mx.uint8, "w1": mx.uint8, **lists, "dims": (mx.int32, 7)},
            {"out": mx.bfloat16 if glu else mx.float32},
            {"T": mx.bfloat16, "NT": nt, "U": u, "XG": xg, **a, **({"SW": 2} if sorted_ else {})},
        )
        for (nt, u, xg), a in zip(((1, 1, 1), (4, 2, MM.X_ALL)), act)
    ]
    kind = ("glu" if glu else "down") + ("_wide" if wide else "") + ("_sorted" if sorted_ else "")
    cap = WIDE_LIST if wide else MAX_PAIRS
    body = (
        _body(ggml_type, 2, _GLU_EPILOGUE, "T", cap, sorted_)
        if glu
        else _body(ggml_type, 1, _DOWN_EPILOGUE, "float", cap, sorted_)
    )
    return Kernel(
        f"ggml_grouped_{kind}_mma_{GGMLQuantizationType(ggml_type).name.lower()}",
        inputs=["xs", "w0", "w1", *lists, "dims"],
        outputs=["out"],
        body=body,
        header=_header(ggml_type),
        examples=examples,
    )


_GLU_KERNELS: dict[int, Kernel] = {t: _make_kernel(t, glu=True) for t in MM.MMA_TYPES}
_DOWN_KERNELS: dict[int, Kernel] = {t: _make_kernel(t, glu=False) for t in MM.MMA_TYPES}
_GLU_WIDE: dict[int, Kernel] = {t: _make_kernel(t, glu=True, wide=True) for t in MM.MMA_TYPES}
_DOWN_WIDE: dict[int, Kernel] = {t: _make_kernel(t, glu=False, wide=True) for t in MM.MMA_TYPES}
_GLU_SORTED: dict[int, Kernel] = {
    t: _make_kernel(t, glu=True, wide=True, sorted_=True) for t in MM.MMA_TYPES
}
_DOWN_SORTED: dict[int, Kernel] = {
    t: _make_kernel(t, glu=False, wide=True, sorted_=True) for t in MM.MMA_TYPES
}

_SLOT_SUM_BODY = r"""
  // Thread mapping: one thread per output (token, feature n): the token's k slot rows of y
  // times their gate weights, summed in slot order 0..k-1 (never the grouping's order), fp32,
  // rounded once. dims = (tokens, N, k).
  const uint N = uint(dims[1]), k = uint(dims[2]);
  if (pos_x >= uint(dims[0]) * N) return;
  const uint tok = pos_x / N, n = pos_x % N;
  float acc = 0.0f;
  for (uint s = 0; s < k; ++s) {
    const size_t pair = size_t(tok) * k + s;
    acc = fma_f(wts[pair], y[pair * N + n], acc);
  }
  out[pos_x] = from_float<T>(acc);
"""

_SLOT_SUM = Kernel(
    "grouped_expert_slot_sum",
    inputs=["y", "wts", "dims"],
    outputs=["out"],
    body=_SLOT_SUM_BODY,
    examples=[
        Example(
            {"y": mx.float32, "wts": mx.float32, "dims": (mx.int32, 3)},
            {"out": mx.bfloat16},
            {"T": mx.bfloat16},
        )
    ],
)
_SUM_THREADS = 256


# --------------------------------------------------------------------------------------------
# Launches


# One n-tile, one block per run, 2 SIMD groups: on the H200 (bench/expert_sweep.py,
# 2026-12-02) 1.4-2.0x faster than qmatmul_mma's defaults over B = 1, 8, 32 tokens at the
# 26B-A4B and 35B-A3B shapes (an expert has ~1-3 pairs there: wider n-tiles carry padding).
GROUPED_RUN = (1, 2)  # (U, W max)


def grouped_config(ggml_type: int, K: int) -> dict[str, int]:
    """NT, U, W of both grouped kernels: NT 1; U, W from (type, K) alone (row parity), W cut to
    the runs a row has."""
    return MM._config(dict.fromkeys((32, 256), GROUPED_RUN), ggml_type, 1, K, dense=False)


def wide_config(ggml_type: int, K: int) -> dict[str, int]:
    """NT, U, W, XG of the wide kernels: the 32-token kernels' U and W, WIDE_NT n-tiles, and
    HF2Q_MMA_XG read at this call (bench/prefill.py --env A/Bs in one process; the 32-token
    kernels take it from qmatmul_mma.LOADS, read at import, through grouped_config)."""
    raw = wide_nt()
    nt = str(raw).strip()
    if nt not in ("1", "2", "4"):
        raise InvalidArgumentError(f"HF2Q_GROUPED_WIDE_NT={raw!r}: expected 1, 2 or 4")
    return {**grouped_config(ggml_type, K), "NT": int(nt), "XG": MM.x_groups()}


def _grouped_plan(kernel: Kernel, x, w, w_up, expert_ids, K: int, N: int, halves: int,
                  out_dtype, cfg: dict, template: dict, wide: bool) -> LaunchPlan:  # fmt: skip
    """The grouped launch: (ceil(N / 16), E + 1) threadgroups of W SIMD groups."""
    E, P = w.shape[0], expert_ids.size
    k = expert_ids.shape[-1]
    cap = WIDE_LIST if wide else MAX_PAIRS
    if not 1 <= P <= cap or not 1 <= cfg["NT"] <= 4 or not 1 <= cfg["W"] <= MM.MAX_SIMD:
        raise ValueError(f"config {cfg} or {P} pairs: not a grouped launch")
    if wide:  # launch bounds on our cubins (HF2Q_GROUPED_WIDE_MIN_BLOCKS)
        template = {**template, **launch_bounds(32 * cfg["W"], wide_min_blocks())}
    per_row = k if x.ndim == expert_ids.ndim else 1  # pairs per row of x
    if w_up is None:  # fused [gate | up] (E, 2N, ...) or down (E, N, ...)
        dims = [P, N, K, E, per_row, halves * N, N]
    else:  # gate (E, N, ...), up (E, N, ...)
        dims = [P, N, K, E, per_row, N, 0]
    return LaunchPlan(
        kernel,
        dims,
        grid=(-(-N // 16) * 32 * cfg["W"], E + 1),
        threadgroup=(32 * cfg["W"], 1),
        output_shapes=[(*expert_ids.shape, N)],
        output_dtypes=[out_dtype],
        template={"T": x.dtype, "NT": cfg["NT"], "U": cfg["U"], "XG": cfg.get("XG", 1), **template},
    )


def _kernels(glu: bool, wide: bool, sorted_: bool) -> dict[int, Kernel]:
    if glu:
        return _GLU_SORTED if sorted_ and wide else _GLU_WIDE if wide else _GLU_KERNELS
    return _DOWN_SORTED if sorted_ and wide else _DOWN_WIDE if wide else _DOWN_KERNELS


def _sorted_template(cfg: dict, sorted_: bool) -> dict:
    """The sorted kernels' SW: the plan's SIMD groups, which size their reduction buffer."""
    return {"SW": cfg["W"]} if sorted_ else {}


def _list_dtypes(sorted_: bool) -> tuple:
    """The dtypes of ``_pair_lists``' arrays."""
    return (mx.uint32, mx.int32) if sorted_ else (mx.uint32,)


def _glu_plan(x, w, w_up, expert_ids, ggml_type: int, K: int, activation: str, config,
              wide: bool = False, sorted_: bool = False):  # fmt: skip
    F = w.shape[1] if w_up is not None else w.shape[1] // 2
    cfg = config or (wide_config if wide else grouped_config)(ggml_type, K)
    act = {"ACT": activations.ACTIVATIONS.index(activation), **_sorted_template(cfg, sorted_)}
    kernel = _kernels(True, wide, sorted_)[ggml_type]
    return _grouped_plan(kernel, x, w, w_up, expert_ids, K, F, 2, x.dtype, cfg, act, wide)


def _down_plans(h, w, expert_ids, ggml_type: int, K: int, config, wide: bool = False,
                sorted_: bool = False):  # fmt: skip
    N = w.shape[1]
    k = expert_ids.shape[-1]
    tokens = expert_ids.size // k
    cfg = config or (wide_config if wide else grouped_config)(ggml_type, K)
    kernel = _kernels(False, wide, sorted_)[ggml_type]
    sw = _sorted_template(cfg, sorted_)
    proj = _grouped_plan(kernel, h, w, None, expert_ids, K, N, 1, mx.float32, cfg, sw, wide)
    total = LaunchPlan(
        _SLOT_SUM,
        [tokens, N, k],
        grid=(-(-(tokens * N) // _SUM_THREADS) * _SUM_THREADS,),
        threadgroup=(_SUM_THREADS,),
        output_shapes=[(*expert_ids.shape[:-1], N)],
        output_dtypes=[h.dtype],
        template={"T": h.dtype},
    )
    return proj, total


def _check_kernel_args(x, ggml_type: int, K: int, expert_ids, wide: bool) -> None:
    if not MM.has_kernel(ggml_type, x.dtype) or x.shape[-1] != K:
        raise ValueError(f"no grouped kernel for {ggml_type} with {x.dtype} x of {x.shape}")
    cap = WIDE_LIST if wide else MAX_PAIRS
    if expert_ids.size > cap:
        raise ValueError(f"{expert_ids.size} (token, slot) pairs: at most {cap}")


def grouped_expert_glu(
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
    wide: bool = False,
    sorted_: bool = False,
) -> mx.array:
    """act(gate) * up per (token, slot), the contract of expert_glu_reference: bf16 x (..., K)
    or (..., k, K), ids (..., k) (at most MAX_PAIRS in all; WIDE_LIST with ``wide``, the
    prefill's kernel), w the fused [gate | up] blocks (E, 2F, row_bytes) (or the gate rows with
    ``w_up``) of a qmatmul_mma type -> (..., k, F). One launch; each expert's rows are read once
    for all the pairs that chose it. An id >= E gives NaN rows. ``config``: NT, U, W;
    ``init_value`` pre-fills the output; ``sorted_`` (with ``wide``): HF2Q_GROUPED_SORTED's
    kernel."""
    _check_kernel_args(x, ggml_type, in_features, expert_ids, wide)
    sorted_ = sorted_ and wide
    plan = _glu_plan(x, w, w_up, expert_ids, ggml_type, in_features, activation, config, wide,
                     sorted_)  # fmt: skip
    wu = w if w_up is None else w_up
    return plan.call(x, w, wu, *_pair_lists(expert_ids, w.shape[0], sorted_),
                     init_value=init_value)  # fmt: skip


def grouped_expert_down(
    h: mx.array,
    w: mx.array,
    expert_ids: mx.array,
    weights: mx.array,
    ggml_type: int,
    in_features: int,
    *,
    config: dict[str, int] | None = None,
    init_value: float | None = None,
    wide: bool = False,
    sorted_: bool = False,
) -> mx.array:
    """sum over slots of weights[s] * (W[ids[s]] @ h[s]), the contract of expert_down_reference:
    bf16 h (..., k, F), ids and weights (..., k), w (E, N, row_bytes) -> (..., N) in h.dtype.
    Two launches: the grouped down projections (fp32 per (token, slot)), then their weighted
    sum in slot order 0..k-1. An id >= E gives a NaN row. ``config``: NT, U, W of the first;
    ``init_value`` pre-fills both outputs; ``wide``: the prefill's kernel (WIDE_LIST pairs);
    ``sorted_`` (with ``wide``): HF2Q_GROUPED_SORTED's kernel."""
    _check_kernel_args(h, ggml_type, in_features, expert_ids, wide)
    sorted_ = sorted_ and wide
    proj, total = _down_plans(h, w, expert_ids, ggml_type, in_features, config, wide, sorted_)
    ids, wts = ids_and_weights(expert_ids, weights)
    lists = _pair_lists(ids, w.shape[0], sorted_)
    y = proj.call(h, w, w, *lists, init_value=init_value)
    return total.call(y, wts, init_value=init_value)


# The sorted pair lists of the last grouped prefill call's slices: (the model's ids array, E,
# {slice rows: lists}). A layer's GLU and down get the same ids array from the model, so the
# down reuses the GLU's argsorts. The array is held, so its identity cannot pass to another
# array meanwhile; one tuple, replaced whole (threads at worst miss the share).
_SHARED_LISTS: list = [None]


def _pair_lists(
    expert_ids: mx.array, E: int, sorted_: bool, pairs_of: tuple | None = None
) -> tuple[mx.array, ...]:
    """The kernel's pair inputs: the ids (uint32), or ``expert_order``'s order and offs;
    ``pairs_of`` = (the model's ids array, (i, j)): expert_ids are its rows i:j (tokens), and
    their lists are made once for every call that names the same array and rows."""
    if not sorted_:
        return (uint32_ids(expert_ids),)
    if pairs_of is None:
        return expert_order(expert_ids, E)
    parent, rows = pairs_of
    memo = _SHARED_LISTS[0]
    if memo is None or memo[0] is not parent or memo[1] != E:
        memo = _SHARED_LISTS[0] = (parent, E, {})
    lists = memo[2].get(rows)
    if lists is None:
        lists = memo[2][rows] = expert_order(expert_ids, E)
    return lists


# --------------------------------------------------------------------------------------------
# Dispatch (expert_glu.expert_glu and expert_down.expert_down call expert_glu / expert_down
# below when ENABLED)


def down_min() -> int:
    """Tokens per call from which the grouped down kernel is taken (every type and row length
    since session 47)."""
    return DOWN_MIN if MIN_TOKENS is None else MIN_TOKENS


def _glu_min() -> int:
    """Tokens per call from which the grouped gate/up kernel is taken."""
    return down_min() if MIN_TOKENS_GLU is None else MIN_TOKENS_GLU


def covers(
    x: mx.array,
    w: mx.array,
    expert_ids: mx.array,
    ggml_type: int | None,
    *,
    glu: bool = True,
    w_up: mx.array | None = None,
    wide: bool = False,
) -> bool:
    """Whether the grouped kernels take this call: CUDA, bf16 x, a type in GLU_GPU_VERIFIED
    (``glu``) or GPU_VERIFIED (down) unless qmatmul_mma.ALL_TYPES, MIN_TOKENS..32 tokens of at most
    MAX_PAIRS pairs (``wide``, the prefill's kernels: any tokens of at most WIDE_PAIRS pairs), x
    one row per token or per pair (down: per pair), uint8 expert blocks."""
    if ggml_type is None or backend() != "cuda" or not MM.supports(ggml_type, x.dtype, glu=glu):
        return False
    cap = min(WIDE_PAIRS, WIDE_LIST) if wide else MAX_PAIRS
    if expert_ids.ndim < 2 or not 1 <= expert_ids.size <= cap:
        return False
    tokens = math.prod(expert_ids.shape[:-1])
    if tokens < (1 if wide else _glu_min() if glu else down_min()):
        return False
    per_pair = x.ndim == expert_ids.ndim + 1 and tuple(x.shape[:-1]) == tuple(expert_ids.shape)
    per_token = x.ndim == expert_ids.ndim and tuple(x.shape[:-1]) == tuple(expert_ids.shape[:-1])
    rb = row_bytes(ggml_type, x.shape[-1])
    return (
        (wide or tokens <= MAX_TOKENS)
        and (per_pair or (glu and per_token))
        and w.ndim == 3
        and w.dtype == mx.uint8
        and w.shape[0] > 0
        and w.shape[-1] == rb
        and (not glu or w_up is not None or w.shape[1] % 2 == 0)
        and (w_up is None or (w_up.shape == w.shape and w_up.dtype == w.dtype))
    )


# per call shape: the resolved plan(s), or None where covers() said no (decided once)
_GLU_CALLS: dict[tuple, LaunchPlan | None] = {}
_DOWN_CALLS: dict[tuple, tuple[LaunchPlan, LaunchPlan] | None] = {}


def expert_glu(
    x: mx.array,
    w: mx.array,
    expert_ids: mx.array,
    ggml_type: int | None,
    in_features: int,
    activation: str,
    w_up: mx.array | None = None,
    wide: bool = False,
    pairs_of: tuple | None = None,
) -> mx.array | None:
    """expert_glu.expert_glu's grouped path: grouped_expert_glu through a plan cached per call
    shape where ``covers`` (caller errors raise as expert_glu's), else None; ``wide``: the
    prefill's kernel, for one slice of a grouped prefill (``pairs_of``: ``_pair_lists``')."""
    be = backend()
    srt = wide and sorted_lists()
    wkey = wide and (WIDE_PAIRS, wide_nt(), srt, wide_min_blocks(), MM.x_groups())
    key = (be, MM.ALL_TYPES, _glu_min(), wkey, ggml_type, in_features, activation, x.shape,
           x.dtype, w.shape, w.dtype, None if w_up is None else (w_up.shape, w_up.dtype),
           expert_ids.shape, expert_ids.dtype)  # fmt: skip
    if key in _GLU_CALLS:
        plan = _GLU_CALLS[key]
    else:
        plan = None
        if covers(x, w, expert_ids, ggml_type, w_up=w_up, wide=wide):
            check_expert_blocks(x, w, w_up, ggml_type, in_features)
            plan = _glu_plan(x, w, w_up, expert_ids, ggml_type, in_features, activation, None,
                             wide, srt)  # fmt: skip
            plan.resolve(x.dtype, mx.uint8, mx.uint8, *_list_dtypes(srt))
        _GLU_CALLS[key] = plan
    if plan is None:
        return None
    wu = w if w_up is None else w_up
    return plan.run(x, w, wu, *_pair_lists(expert_ids, w.shape[0], srt, pairs_of))


def expert_down(
    h: mx.array,
    w: mx.array,
    expert_ids: mx.array,
    weights: mx.array,
    ggml_type: int | None,
    in_features: int,
    wide: bool = False,
    pairs_of: tuple | None = None,
) -> mx.array | None:
    """expert_down.expert_down's grouped path: grouped_expert_down through plans cached per
    call shape where ``covers`` (and the weights match the ids), else None; ``wide``: the
    prefill's kernel, for one slice of a grouped prefill (``pairs_of``: ``_pair_lists``')."""
    be = backend()
    srt = wide and sorted_lists()
    wkey = wide and (WIDE_PAIRS, wide_nt(), srt, wide_min_blocks(), MM.x_groups())
    key = (be, MM.ALL_TYPES, MIN_TOKENS, wkey, ggml_type,
           in_features, h.shape, h.dtype, w.shape, w.dtype, expert_ids.shape, expert_ids.dtype,
           weights.shape)  # fmt: skip
    if key in _DOWN_CALLS:
        plans = _DOWN_CALLS[key]
    else:
        plans = None
        ok = covers(h, w, expert_ids, ggml_type, glu=False, wide=wide)
        if ok and weights.shape == expert_ids.shape:
            if h.shape[-1] != in_features:
                raise WeightMismatchError(
                    f"h has {h.shape[-1]} features, the experts {in_features}"
                )
            proj, total = _down_plans(h, w, expert_ids, ggml_type, in_features, None, wide, srt)
            proj.resolve(h.dtype, mx.uint8, mx.uint8, *_list_dtypes(srt))
            total.resolve(mx.float32, mx.float32)
            plans = (proj, total)
        _DOWN_CALLS[key] = plans
    if plans is None:
        return None
    proj, total = plans
    ids, wts = ids_and_weights(expert_ids, weights)
    return total.run(proj.run(h, w, w, *_pair_lists(ids, w.shape[0], srt, pairs_of)), wts)


# --------------------------------------------------------------------------------------------
# A dense GGML linear's prefill as a one-expert grouped prefill (models/quantized.GGMLLinear)

DENSE_PREFILL_MODES = ("dequant", "grouped")


def dense_prefill_mode() -> str:
    """HF2Q_DENSE_PREFILL (read at each call): how a dense GGML linear runs bf16 x past
    qmatmul.ROW_SLICE_MAX rows on CUDA. ``dequant`` (unset): ``qmatmul.ggml_matmul``'s path, the
    weight dequantized to bf16 by row chunks, then ``mx.matmul``; ``grouped``:
    ``dense_grouped_matmul``. Session 34: emulator-tested, not yet timed."""
    mode = os.environ.get("HF2Q_DENSE_PREFILL", "").strip().lower() or "dequant"
    if mode not in DENSE_PREFILL_MODES:
        raise InvalidArgumentError(
            f"HF2Q_DENSE_PREFILL={mode!r}: expected one of {', '.join(DENSE_PREFILL_MODES)}"
        )
    return mode


_ONE_EXPERT: dict[int, tuple[mx.array, mx.array]] = {}  # tokens -> (ids 0, weights 1)


def dense_grouped_matmul(x: mx.array, w_raw: mx.array, ggml_type: int, in_features: int):
    """x (..., K) @ dequant(w_raw).T -> (..., N) as a one-expert grouped prefill: every token
    chose expert 0 (``w_raw`` (N, row_bytes)) at weight 1, through the wide down kernel in
    slices of WIDE_PAIRS tokens, so the blocks are read as they are (no dequantized weight
    written, no bf16 rounding of the weights, fp32 sums). None unless HF2Q_DENSE_PREFILL is
    ``grouped`` and x has more than ROW_SLICE_MAX rows that the kernels cover (bf16 on CUDA):
    the caller then takes ``qmatmul.ggml_matmul``."""
    m = math.prod(x.shape[:-1])
    if m <= ROW_SLICE_MAX or dense_prefill_mode() != "grouped":
        return None
    x2 = x.reshape(m, x.shape[-1])
    w3 = w_raw[None]  # (1, N, row_bytes): one expert
    outs = []
    for r in range(0, m, WIDE_PAIRS):
        xs = owned_rows(x2, r, min(r + WIDE_PAIRS, m))
        t = xs.shape[0]
        if t not in _ONE_EXPERT:
            _ONE_EXPERT[t] = (mx.zeros((t, 1), mx.uint32), mx.ones((t, 1), mx.float32))
        ids, weights = _ONE_EXPERT[t]
        y = expert_down(xs[:, None, :], w3, ids, weights, ggml_type, in_features, wide=True)
        if y is None:
            return None
        outs.append(y)
    y = outs[0] if len(outs) == 1 else mx.concatenate(outs)
    return y.reshape(*x.shape[:-1], w_raw.shape[0])
