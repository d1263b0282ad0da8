"""expert_mma: the routed experts grouped by expert on the tensor cores (each expert's weights
read once for every (token, slot) pair that chose it). On the CPU emulator: accuracy against
fp32 math with unselected experts poisoned, row parity (a pair's bits the same at T = 1 as in
any batch, whatever the other tokens hold), NaN rows for bad ids, the dispatch switch; on a GPU
the same on Gemma-4-26B-A4B's expert shapes."""

from __future__ import annotations

import kernel_emulator
import mlx.core as mx
import numpy as np
import pytest
import test_expert_down as TD
from conftest import requires_gpu
from gguf import GGMLQuantizationType as T
from test_expert_glu import _bits, _check, _experts, _ids, _poisoned, _x
from test_qmatmul_mma import _wild_rows

from hf2q_mlx.custom_kernels import backend
from hf2q_mlx.custom_kernels import expert_down as D
from hf2q_mlx.custom_kernels import expert_glu as G
from hf2q_mlx.custom_kernels import expert_mma as EM
from hf2q_mlx.custom_kernels import qmatmul_mma as MM
from hf2q_mlx.custom_kernels._render import Kernel
from hf2q_mlx.custom_kernels.dequant import row_bytes
from hf2q_mlx.custom_kernels.ggml_formats import BLOCK_FORMATS
from hf2q_mlx.errors import WeightMismatchError

# Tolerance (test_expert_glu._check / assert_rows_close, bf16 x): per (token, slot) row (the
# down: per token), the relative 2-norm error at most twice that of the fp32 result rounded to
# bf16. Weights and x enter the mma exactly, its products are exact, its sums, the scales, the
# activation and the slot sum fp32: the one bf16 rounding of the output dominates.

needs_gxx = pytest.mark.skipif(not kernel_emulator.available(), reason="g++ is not installed")
E_EMU, K_SLOTS, F_EMU = 6, 3, 20  # F: two threadgroups of 16 rows, the second partly past F
# Q4_K and Q8_0 (the models' types), Q4_1 and Q6_K (a min; 16-k groups), Q5_0 (26B's down)
TYPES = [T.Q4_K, T.Q8_0, T.Q4_1, T.Q6_K, T.Q5_0]


@pytest.fixture
def emulate(monkeypatch):
    """Every Kernel call runs on the emulator (which NaN-poisons every output first)."""
    if not kernel_emulator.available():
        pytest.skip("g++ is not installed")
    monkeypatch.setattr(Kernel, "__call__", kernel_emulator.kernel_call)


def _k(t: int) -> int:
    """K: two super-blocks (K-quants) or three 32-blocks: short rows, fast emulator runs."""
    qk = BLOCK_FORMATS[t].block_size
    return 2 * qk if qk == 256 else 3 * qk


def _glu_case(t: int, m: int, seed: int, ids: mx.array | None = None):
    """(raw (E, 2F, row_bytes), bf16 x (m, K), ids (m, k)): O(1) projections."""
    kk = _k(t)
    raw = _experts(t, E_EMU, 2 * F_EMU, kk, seed=int(t))
    ids = _ids(m, K_SLOTS, E_EMU, seed=seed) if ids is None else ids
    return raw, _x((m, kk), mx.bfloat16, seed, raw, t), ids


def _down_case(t: int, m: int, seed: int, ids: mx.array | None = None):
    """(raw (E, N, row_bytes), bf16 h (m, k, K), ids, fp32 gate weights (m, k))."""
    kk = _k(t)
    raw = _experts(t, E_EMU, F_EMU, kk, seed=int(t) + 1)
    r_ids, wts = TD._route(m, K_SLOTS, E_EMU, seed=seed)
    ids = r_ids if ids is None else ids
    return raw, TD._h((m, K_SLOTS, kk), mx.bfloat16, seed), ids, wts


def _glu(x, raw, ids, t, act="silu", w=None):
    """The grouped GLU with every expert ``ids`` does not select poisoned (NaN scales)."""
    w = _poisoned(raw, ids) if w is None else w
    return EM.grouped_expert_glu(x, w, ids, t, x.shape[-1], act)


def _down(h, raw, ids, wts, t):
    return EM.grouped_expert_down(h, _poisoned(raw, ids), ids, wts, t, h.shape[-1])


def _down_pairs(h, raw, ids, t) -> mx.array:
    """The down kernel's first launch alone: the fp32 projection of every (token, slot), (m, k,
    N). Parity is checked on these too: a bf16 output hides most fp32 order changes (a 1-ulp
    fp32 difference moves its bf16 rounding about once in 2^16)."""
    proj, _ = EM._down_plans(h, raw, ids, t, h.shape[-1], None)
    return proj.call(h, _poisoned(raw, ids), _poisoned(raw, ids), ids)


def _same(a: mx.array, b: mx.array) -> bool:
    return np.array_equal(_bits(a), _bits(b))


# --------------------------------------------------------------------------------------------
# Accuracy


@pytest.mark.usefixtures("emulate")
@pytest.mark.parametrize("m", [1, 5, 17])
@pytest.mark.parametrize("t", TYPES, ids=[t.name for t in TYPES])
def test_glu_matches_reference(t, m):
    """act(gate) * up per (token, slot) within the bf16 bound, every output written; GELU at
    m = 5 (the epilogue's other branch)."""
    raw, x, ids = _glu_case(t, m, seed=10 + m)
    act = "gelu_tanh" if m == 5 else "silu"
    y = _glu(x, raw, ids, t, act)
    _check(y, x, raw[:, :F_EMU], raw[:, F_EMU:], ids, t, _k(t), act)


@pytest.mark.usefixtures("emulate")
def test_glu_split_weights_per_slot_x_and_batch_dims():
    """Separate gate and up weights, x one row per (token, slot), ids (2, 3, k) int32: the
    output in the ids' shape, within the bf16 bound."""
    t, kk = T.Q4_K, _k(T.Q4_K)
    raw = _experts(t, E_EMU, 2 * F_EMU, kk, seed=int(t))
    ids = _ids(6, K_SLOTS, E_EMU, seed=3)
    x = _x((6, K_SLOTS, kk), mx.bfloat16, 4, raw, t)
    wg = _poisoned(np.ascontiguousarray(raw[:, :F_EMU]), ids)
    wu = _poisoned(np.ascontiguousarray(raw[:, F_EMU:]), ids)
    ids3 = ids.reshape(2, 3, K_SLOTS).astype(mx.int32)
    y = EM.grouped_expert_glu(x.reshape(2, 3, K_SLOTS, kk), wg, ids3, t, kk, "silu", wu)
    assert y.shape == (2, 3, K_SLOTS, F_EMU)
    _check(y.reshape(6, K_SLOTS, F_EMU), x, raw[:, :F_EMU], raw[:, F_EMU:], ids, t, kk, "silu")


@pytest.mark.usefixtures("emulate")
@pytest.mark.parametrize("m", [1, 5, 17])
@pytest.mark.parametrize("t", TYPES, ids=[t.name for t in TYPES])
def test_down_matches_reference(t, m):
    """The gate-weighted sum of the slots' down projections within the bf16 bound."""
    raw, h, ids, wts = _down_case(t, m, seed=20 + m)
    y = _down(h, raw, ids, wts, t)
    TD._check(y, h, raw, ids, wts, t, _k(t))


# --------------------------------------------------------------------------------------------
# Row parity

PARITY_TYPES = [T.Q4_K, T.Q8_0, T.Q4_1]
BATCHES = (2, 5, 9, 17)


def _shared_ids(m: int, seed: int) -> mx.array:
    """Routes with heavy sharing: every token picks expert 1 (m pairs: up to three n-tiles),
    the other slots random distinct experts among 0, 2..4; expert 5 never chosen."""
    rng = np.random.default_rng(seed)
    ids = np.stack([np.r_[1, rng.permutation([0, 2, 3, 4])[: K_SLOTS - 1]] for _ in range(m)])
    return mx.array(rng.permuted(ids, axis=1).astype(np.uint32))


@pytest.mark.usefixtures("emulate")
@pytest.mark.parametrize("t", PARITY_TYPES, ids=[t.name for t in PARITY_TYPES])
def test_glu_pairs_bit_identical_to_tokens_alone(t):
    """Each (token, slot) output has the bits of its token alone (T = 1) in batches of 2, 5, 9
    and 17 tokens (tokens in another order; expert 1 chosen by every token: up to 17 pairs, three
    n-tiles), and keeps them when the other tokens' x hold inf, NaN, huge values."""
    n = max(BATCHES)
    raw, x, ids = _glu_case(t, n, seed=31, ids=_shared_ids(n, seed=31))
    w = _poisoned(raw, mx.array([0, 1, 2, 3, 4]))  # expert 5: never chosen, NaN scales
    alone = [_glu(x[i : i + 1], raw, ids[i : i + 1], t, w=w)[0] for i in range(n)]
    _check(mx.stack(alone), x, raw[:, :F_EMU], raw[:, F_EMU:], ids, t, _k(t), "silu")
    perm = np.random.default_rng(int(t)).permutation(n)
    for m in BATCHES:
        rows = mx.array(perm[:m])
        y = _glu(x[rows], raw, ids[rows], t, w=w)
        differ = [int(r) for j, r in enumerate(perm[:m]) if not _same(y[j], alone[int(r)])]
        assert not differ, f"T = {m}: tokens {differ} differ"
    y = _glu(_wild_rows(x), raw, ids, t, w=w)
    assert _same(y[0], alone[0]), "token 0 changed with wild values in the other tokens"


@pytest.mark.usefixtures("emulate")
@pytest.mark.parametrize("t", PARITY_TYPES, ids=[t.name for t in PARITY_TYPES])
def test_down_pairs_bit_identical_to_tokens_alone(t):
    """The down's per-token outputs: the bits of the token alone in batches of 2..17 tokens and
    with wild values in the other tokens' h (the slot sum runs in slot order, whatever the
    grouping)."""
    n = max(BATCHES)
    raw, h, ids, wts = _down_case(t, n, seed=41, ids=_shared_ids(n, seed=41))
    alone = [_down(h[i : i + 1], raw, ids[i : i + 1], wts[i : i + 1], t)[0] for i in range(n)]
    TD._check(mx.stack(alone), h, raw, ids, wts, t, _k(t))
    alone32 = [_down_pairs(h[i : i + 1], raw, ids[i : i + 1], t)[0] for i in range(n)]
    perm = np.random.default_rng(int(t) + 1).permutation(n)
    for m in BATCHES:
        rows = mx.array(perm[:m])
        y = _down(h[rows], raw, ids[rows], wts[rows], t)
        differ = [int(r) for j, r in enumerate(perm[:m]) if not _same(y[j], alone[int(r)])]
        assert not differ, f"T = {m}: tokens {differ} differ"
        y32 = _down_pairs(h[rows], raw, ids[rows], t)
        differ = [int(r) for j, r in enumerate(perm[:m]) if not _same(y32[j], alone32[int(r)])]
        assert not differ, f"T = {m}: the fp32 projections of tokens {differ} differ"
    hw = _wild_rows(h.reshape(n, -1)).reshape(h.shape)
    y = _down(hw, raw, ids, wts, t)
    assert _same(y[0], alone[0]), "token 0 changed with wild values in the other tokens"
    assert _same(_down_pairs(hw, raw, ids, t)[0], alone32[0])


@pytest.mark.usefixtures("emulate")
def test_more_than_32_pairs_on_one_expert_loop_column_groups():
    """Ids repeated inside tokens (not top-k routing, but legal): 17 tokens x 3 slots all on
    expert 4 = 51 pairs, two column groups of 32; each pair's bits those of its token alone,
    within the bf16 bound (GLU and down)."""
    t, m = T.Q8_0, 17
    ids = mx.array(np.full((m, K_SLOTS), 4, dtype=np.uint32))
    raw, x, _ = _glu_case(t, m, seed=51)
    y = _glu(x, raw, ids, t)
    _check(y, x, raw[:, :F_EMU], raw[:, F_EMU:], ids, t, _k(t), "silu")
    for i in (0, 9, 16):  # group 0; pairs 27..29 (both groups); group 1
        assert _same(y[i], _glu(x[i : i + 1], raw, ids[i : i + 1], t)[0]), f"token {i}"
    raw, h, _, wts = _down_case(t, m, seed=52)
    y = _down(h, raw, ids, wts, t)
    TD._check(y, h, raw, ids, wts, t, _k(t))
    for i in (0, 10, 16):
        assert _same(y[i], _down(h[i : i + 1], raw, ids[i : i + 1], wts[i : i + 1], t)[0])


@pytest.mark.usefixtures("emulate")
def test_bad_ids_give_nan_rows_and_unchosen_experts_are_not_read():
    """Ids E and past E (and -1 as int32): NaN rows (GLU: the pair's; down: the token's); the
    other pairs exact although every expert they do not choose holds NaN scales."""
    t, kk = T.Q4_K, _k(T.Q4_K)
    raw, x, _ = _glu_case(t, 3, seed=61)
    ids = mx.array([[2, E_EMU, 0], [E_EMU + 7, 2, 3], [0, 2, -1]], dtype=mx.int32)
    good = mx.array([2, 0, 3])
    y = np.array(_glu(x, raw, ids, t, w=_poisoned(raw, good)).astype(mx.float32))
    bad = np.array([[0, 1, 0], [1, 0, 0], [0, 0, 1]], dtype=bool)
    assert np.isnan(y[bad]).all() and not np.isnan(y[~bad]).any()
    for i, j in np.argwhere(~bad):
        one = ids[i : i + 1, j : j + 1].astype(mx.uint32)
        yij = mx.array(y[i : i + 1, j : j + 1]).astype(mx.bfloat16)
        _check(yij, x[i : i + 1], raw[:, :F_EMU], raw[:, F_EMU:], one, t, kk, "silu")
    raw, h, _, wts = _down_case(t, 3, seed=62)
    ids = mx.array([[2, 0, 3], [E_EMU, 2, 3], [0, 2, 3]], dtype=mx.uint32)
    y = np.array(_down(h, raw, ids, wts, t).astype(mx.float32))
    assert np.isnan(y[1]).all() and not np.isnan(y[[0, 2]]).any()
    TD._check(mx.array(y[[0, 2]]).astype(mx.bfloat16), h[mx.array([0, 2])], raw,
              ids[mx.array([0, 2])], wts[mx.array([0, 2])], t, kk)  # fmt: skip


def test_kernel_functions_reject_what_they_cannot_run():
    x = mx.zeros((33, 256), mx.bfloat16)
    ids = mx.zeros((33, 8), mx.uint32)  # 264 pairs: past the pair list
    w = mx.zeros((4, 32, 144), mx.uint8)
    with pytest.raises(ValueError):
        EM.grouped_expert_glu(x, w, ids, T.Q4_K, 256)
    with pytest.raises(ValueError):  # fp16 x: no mma kernel
        EM.grouped_expert_glu(x[:2].astype(mx.float16), w, ids[:2], T.Q4_K, 256)


# --------------------------------------------------------------------------------------------
# Dispatch


def test_covers(monkeypatch):
    """CUDA, bf16, MIN_TOKENS..32 tokens, a GLU_GPU_VERIFIED (GLU) / GPU_VERIFIED (down) type,
    uint8 blocks of the right row size; nothing on Metal or off a GPU."""
    t, kk = T.Q4_K, 256
    x, ids = mx.zeros((4, kk), mx.bfloat16), mx.zeros((4, 8), mx.uint32)
    w = mx.zeros((8, 32, 144), mx.uint8)
    monkeypatch.setattr(EM, "backend", lambda: "cuda")
    monkeypatch.setattr(MM, "ALL_TYPES", False)
    assert not EM.covers(x, w, ids, t)  # 4 tokens < MIN_TOKENS (HF2Q_GROUPED_EXPERTS "auto")
    h = mx.zeros((4, 8, kk), mx.bfloat16)
    monkeypatch.setattr(EM, "MIN_TOKENS_GLU", 4)  # HF2Q_GROUPED_GLU_MIN=4: the gate/up only
    assert EM.covers(x, w, ids, t) and not EM.covers(h, w, ids, t, glu=False)
    monkeypatch.setattr(EM, "MIN_TOKENS_GLU", None)
    monkeypatch.setattr(EM, "MIN_TOKENS", 1)
    assert EM.covers(x, w, ids, t)
    assert EM.covers(mx.zeros((4, 8, kk), mx.bfloat16), w, ids, t, glu=False)
    assert not EM.covers(x, w, ids, t, glu=False)  # the down takes one h row per pair
    assert not EM.covers(x.astype(mx.float16), w, ids, t)
    assert not EM.covers(x, w[:, :31], ids, t)  # odd fused rows
    assert not EM.covers(x, w[..., :100], ids, t)  # not Q4_K rows of K
    assert not EM.covers(x, w, ids, None)
    x33, ids33 = mx.zeros((33, kk), mx.bfloat16), mx.zeros((33, 2), mx.uint32)
    assert not EM.covers(x33, w, ids33, t)
    monkeypatch.setattr(MM, "GLU_GPU_VERIFIED", MM.GLU_GPU_VERIFIED - {T.Q5_1})
    w51 = mx.zeros(
        (8, 32, row_bytes(T.Q5_1, kk)), mx.uint8
    )  # Q5_1 as GPU-verified for the mat-vec only
    assert not EM.covers(x, w51, ids, T.Q5_1)
    assert EM.covers(mx.zeros((4, 8, kk), mx.bfloat16), w51, ids, T.Q5_1, glu=False)
    monkeypatch.setattr(EM, "backend", lambda: "metal")
    assert not EM.covers(x, w, ids, t)
    monkeypatch.setattr(EM, "backend", lambda: None)
    assert not EM.covers(x, w, ids, t)


@needs_gxx
def test_dispatchers_take_the_grouped_kernels_only_when_enabled(monkeypatch):
    """expert_glu / expert_down on CUDA with bf16 x: below their thresholds (8 tokens for the
    gate/up, 16 for the down) -> the per-pair kernels (the down's slot-parallel form by default;
    stubbed: only the choice is checked);
    from them on -> the grouped kernels (emulated, within the bf16 bound, one plan per call
    shape)."""
    launched = []

    def launcher(self, input_dtypes, **launch):
        launched.append(self.name)
        if "grouped" not in self.name:
            shapes, dtypes = launch["output_shapes"], launch["output_dtypes"]
            return lambda inputs: [mx.zeros(s, d) for s, d in zip(shapes, dtypes)]
        return kernel_emulator.kernel_launcher(self, input_dtypes, **launch)

    for mod in (G, D, EM):
        monkeypatch.setattr(mod, "backend", lambda: "cuda")
    monkeypatch.setattr(Kernel, "launcher", launcher)
    for mod, name in ((G, "_CALLS"), (D, "_CALLS"), (EM, "_GLU_CALLS"), (EM, "_DOWN_CALLS")):
        monkeypatch.setattr(mod, name, {})
    # HF2Q_GROUPED_EXPERTS unset: "auto", the grouped gate/up and down from 8 tokens on (every
    # type and row length): 5 are per-pair
    assert EM.ENABLED and EM.MIN_TOKENS is None and EM.MIN_TOKENS_GLU == EM.GLU_MIN_DEFAULT == 8
    assert EM.down_min() == EM.DOWN_MIN == 8
    t, kk = T.Q4_K, _k(T.Q4_K)
    raw, x, ids = _glu_case(t, 5, seed=71)
    rawd, h, idsd, wts = _down_case(t, 5, seed=72)
    G.expert_glu(x, mx.array(raw), ids, t, kk)
    D.expert_down(h, mx.array(rawd), idsd, wts, t, kk)
    # the down's per-pair choice on CUDA: the slot-parallel kernel (HF2Q_DOWN_SLOTS unset)
    down = D._SLOT_KERNELS[t] if D.slot_config(t, kk, ids.shape[-1]) else D._KERNELS[t]
    assert launched == [G._KERNELS[t].name, down.name]
    launched.clear()
    for n in (7, 8, 15, 16):  # the "auto" thresholds: the gate/up and the down from 8 tokens
        _, x_n, ids_n = _glu_case(t, n, seed=73)
        assert EM.covers(x_n, mx.array(raw), ids_n, t) == (n >= 8)
        _, h_n, ids_n, _ = _down_case(t, n, seed=74)
        down_from = EM.down_min()
        assert EM.covers(h_n, mx.array(rawd), ids_n, t, glu=False) == (n >= down_from)
    monkeypatch.setattr(EM, "MIN_TOKENS", 1)  # HF2Q_GROUPED_EXPERTS=1: every covered call
    monkeypatch.setattr(EM, "MIN_TOKENS_GLU", None)
    y = G.expert_glu(x, _poisoned(raw, ids), ids, t, kk)
    _check(y, x, raw[:, :F_EMU], raw[:, F_EMU:], ids, t, kk, "silu")
    yd = D.expert_down(h, _poisoned(rawd, idsd), idsd, wts, t, kk)
    TD._check(yd, h, rawd, idsd, wts, t, kk)
    G.expert_glu(x, _poisoned(raw, ids), ids, t, kk)  # cached plan: no new launcher
    names = [EM._GLU_KERNELS[t].name, EM._DOWN_KERNELS[t].name, EM._SLOT_SUM.name]
    assert launched == names
    # fp16 x: not covered, the per-pair kernel
    G.expert_glu(x.astype(mx.float16), mx.array(raw), ids, t, kk)
    assert launched[-1] == G._KERNELS[t].name
    with pytest.raises(WeightMismatchError):  # x of K features, experts said to have K / 2
        G.expert_glu(x, mx.array(raw), ids, t, kk // 2)
    with pytest.raises(WeightMismatchError):
        D.expert_down(h, mx.array(rawd), idsd, wts, t, kk // 2)


# ---------------------------------------------------------------------------------------------
# GPU: Gemma-4-26B-A4B's experts (E 128, k 8; gate_up 2 x 704 rows of K 2816, Q4_K; down 2816
# rows of K 704, Q5_0 and Q8_0)

_E26, _K26 = 128, 8
_GLU26 = (704, 2816)  # (F, K) of the gate_up weight
_DOWN26 = (2816, 704)  # (N, K) of the down weight


def _gpu_ids(m: int, seed: int) -> mx.array:
    return _ids(m, _K26, _E26, seed=seed)


@requires_gpu
@pytest.mark.parametrize("t", [T.Q4_K, T.Q8_0], ids=["Q4_K", "Q8_0"])
def test_gpu_glu_matches_reference_and_tokens_alone(t):
    """On CUDA, F 704 of K 2816: within the bf16 bound at T = 1, 8, 32 (outputs NaN-poisoned);
    each token's bits in every batch those it has alone; token 0 unchanged beside wild x."""
    if backend() != "cuda":
        pytest.skip("the grouped kernels run on CUDA only")
    (f, kk), nan = _GLU26, float("nan")
    raw = _experts(t, _E26, 2 * f, kk, seed=5)
    w = mx.array(raw)
    x = _x((32, kk), mx.bfloat16, 6, raw, t)
    ids = _gpu_ids(32, seed=7)
    run = lambda xx, ii: EM.grouped_expert_glu(xx, w, ii, t, kk, init_value=nan)  # noqa: E731
    alone = mx.concatenate([run(x[i : i + 1], ids[i : i + 1]) for i in range(32)])
    _check(alone, x, raw[:, :f], raw[:, f:], ids, t, kk, "silu")
    for m in (8, 32):
        y = run(x[:m], ids[:m])
        _check(y, x[:m], raw[:, :f], raw[:, f:], ids[:m], t, kk, "silu")
        same = (_bits(y) == _bits(alone[:m])).reshape(m, -1).all(axis=1)
        assert same.all(), f"T = {m}: tokens {np.flatnonzero(~same).tolist()} differ"
    # every token on the same 8 experts (32 pairs each: 4 full n-tiles), then all 256 pairs on
    # expert 3 (ids repeated inside tokens: 8 column groups)
    for same_ids in (mx.broadcast_to(ids[:1], (32, _K26)), mx.full((32, _K26), 3, mx.uint32)):
        y = run(x, same_ids)
        _check(y, x, raw[:, :f], raw[:, f:], same_ids, t, kk, "silu")
        one = mx.concatenate([run(x[i : i + 1], same_ids[i : i + 1]) for i in (0, 17, 31)])
        assert np.array_equal(_bits(y[mx.array([0, 17, 31])]), _bits(one))
    y = run(_wild_rows(x), ids)
    assert np.array_equal(_bits(y[0]), _bits(alone[0]))


@requires_gpu
@pytest.mark.parametrize("t", [T.Q5_0, T.Q8_0], ids=["Q5_0", "Q8_0"])
def test_gpu_down_matches_reference_and_tokens_alone(t):
    """On CUDA, N 2816 of K 704: within the bf16 bound at T = 1, 8, 32, each token's bits
    those it has alone, token 0 unchanged beside wild h."""
    if backend() != "cuda":
        pytest.skip("the grouped kernels run on CUDA only")
    (n, kk), nan = _DOWN26, float("nan")
    raw = _experts(t, _E26, n, kk, seed=8)
    w = mx.array(raw)
    ids, wts = TD._route(32, _K26, _E26, seed=9)
    h = TD._h((32, _K26, kk), mx.bfloat16, 10)
    run = lambda hh, ii, ww: EM.grouped_expert_down(hh, w, ii, ww, t, kk, init_value=nan)  # noqa: E731
    alone = mx.concatenate([run(h[i : i + 1], ids[i : i + 1], wts[i : i + 1]) for i in range(32)])
    TD._check(alone, h, raw, ids, wts, t, kk)

    def pairs(hh, ii):  # the fp32 projections per (token, slot): parity below bf16's rounding
        proj, _ = EM._down_plans(hh, w, ii, t, kk, None)
        return proj.call(hh, w, w, ii, init_value=nan)

    alone32 = mx.concatenate([pairs(h[i : i + 1], ids[i : i + 1]) for i in range(32)])
    for m in (8, 32):
        y = run(h[:m], ids[:m], wts[:m])
        TD._check(y, h[:m], raw, ids[:m], wts[:m], t, kk)
        same = (_bits(y) == _bits(alone[:m])).all(axis=1)
        assert same.all(), f"T = {m}: tokens {np.flatnonzero(~same).tolist()} differ"
        same = (_bits(pairs(h[:m], ids[:m])) == _bits(alone32[:m])).reshape(m, -1).all(axis=1)
        assert same.all(), f"T = {m}: fp32 of tokens {np.flatnonzero(~same).tolist()} differ"
    hw = _wild_rows(h.reshape(32, -1)).reshape(h.shape)
    assert np.array_equal(_bits(run(hw, ids, wts)[0]), _bits(alone[0]))


@requires_gpu
def test_gpu_dispatchers_switch(monkeypatch):
    """With ENABLED, expert_glu and expert_down return the grouped kernels' bits (Q4_K GLU,
    Q5_0 down at T = 8); without, the per-pair kernels' (within the bf16 bound of each other)."""
    if backend() != "cuda":
        pytest.skip("the grouped kernels run on CUDA only")
    f, kk = _GLU26
    raw = _experts(T.Q4_K, _E26, 2 * f, kk, seed=5)
    x, ids = _x((8, kk), mx.bfloat16, 6, raw, T.Q4_K), _gpu_ids(8, seed=7)
    rawd = _experts(T.Q5_0, _E26, kk, f, seed=8)
    idsd, wts = TD._route(8, _K26, _E26, seed=9)
    h = TD._h((8, _K26, f), mx.bfloat16, 10)
    monkeypatch.setattr(EM, "ENABLED", True)
    monkeypatch.setattr(EM, "MIN_TOKENS", 1)
    monkeypatch.setattr(EM, "MIN_TOKENS_GLU", None)
    y = G.expert_glu(x, mx.array(raw), ids, T.Q4_K, kk)
    assert np.array_equal(_bits(y), _bits(EM.grouped_expert_glu(x, mx.array(raw), ids, T.Q4_K,
                                                                 kk)))  # fmt: skip
    yd = D.expert_down(h, mx.array(rawd), idsd, wts, T.Q5_0, f)
    ref = EM.grouped_expert_down(h, mx.array(rawd), idsd, wts, T.Q5_0, f)
    assert np.array_equal(_bits(yd), _bits(ref))
    monkeypatch.setattr(EM, "ENABLED", False)
    y0 = G.expert_glu(x, mx.array(raw), ids, T.Q4_K, kk)
    assert np.array_equal(_bits(y0), _bits(G.expert_glu_kernel(x, mx.array(raw), ids, T.Q4_K,
                                                                kk)))  # fmt: skip
    _check(y0, x, raw[:, :f], raw[:, f:], ids, T.Q4_K, kk, "silu")
    TD._check(D.expert_down(h, mx.array(rawd), idsd, wts, T.Q5_0, f), h, rawd, idsd, wts, T.Q5_0,
              f)  # fmt: skip


def test_wide_min_blocks_bound_the_wide_kernels_only(monkeypatch):
    """HF2Q_GROUPED_WIDE_MIN_BLOCKS (read per call): launch bounds in the wide (prefill) plans'
    templates, which reach our cubin's source as __launch_bounds__; none on the 32-token plans;
    1..16, anything else a one-line InvalidArgumentError naming the switch."""
    from hf2q_mlx.errors import InvalidArgumentError

    t = T.Q4_K
    raw, x, ids = _glu_case(t, 5, seed=91)
    w, kk = mx.array(raw), _k(t)

    def plan(wide: bool):
        cfg = (EM.wide_config if wide else EM.grouped_config)(t, kk)
        kernel = EM._kernels(True, wide, False)[t]
        return EM._grouped_plan(kernel, x, w, None, ids, kk, F_EMU, 2, x.dtype, cfg,
                                {"ACT": 0}, wide)  # fmt: skip

    monkeypatch.setattr(EM, "WIDE_MIN_BLOCKS", "")
    monkeypatch.delenv("HF2Q_GROUPED_WIDE_MIN_BLOCKS", raising=False)
    assert EM.wide_min_blocks() is None and "LB_MIN_BLOCKS" not in plan(True).template
    monkeypatch.setenv("HF2Q_GROUPED_WIDE_MIN_BLOCKS", "8")
    assert EM.wide_min_blocks() == 8
    wide = plan(True)
    cfg = EM.wide_config(t, kk)
    assert wide.template["LB_MIN_BLOCKS"] == 8 and wide.template["LB_THREADS"] == 32 * cfg["W"]
    assert "LB_MIN_BLOCKS" not in plan(False).template
    ins = [x.dtype, mx.uint8, mx.uint8, mx.uint32, mx.int32]
    _, unit = wide.kernel.precompiled_unit(ins, (), [x.dtype], wide.template, "sig")
    assert f"__launch_bounds__({32 * cfg['W']}, 8)" in unit
    for bad in ("0", "17", "eight"):
        monkeypatch.setenv("HF2Q_GROUPED_WIDE_MIN_BLOCKS", bad)
        with pytest.raises(InvalidArgumentError, match="HF2Q_GROUPED_WIDE_MIN_BLOCKS"):
            EM.wide_min_blocks()
