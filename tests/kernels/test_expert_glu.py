"""expert_glu: the routed experts' gate, up and activation in one kernel, its CUDA rendering on
the CPU emulator and on a GPU against fp32 reference math, with every unselected expert's
weights poisoned (0xFF bytes: NaN scales) so that reading one shows; the dispatcher and the
models' wiring."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import kernel_emulator
import mlx.core as mx
import numpy as np
import pytest
from conftest import requires_gpu
from gguf import GGMLQuantizationType as T
from kernel_emulator import Emulated

import hf2q_mlx.custom_kernels as ck
from hf2q_mlx.custom_kernels import activations
from hf2q_mlx.custom_kernels import expert_glu as G
from hf2q_mlx.custom_kernels import qmatmul as Q
from hf2q_mlx.custom_kernels._render import Example, Kernel
from hf2q_mlx.custom_kernels.dequant import dequantize_reference
from hf2q_mlx.errors import InvalidArgumentError, WeightMismatchError
from hf2q_mlx.io.random_weights import random_ggml_blocks
from hf2q_mlx.models import gemma4_moe, qwen3_5_moe
from hf2q_mlx.models.experts import ExpertLinear

needs_gxx = pytest.mark.skipif(not kernel_emulator.available(), reason="g++ is not installed")
# fp32: kernel and reference sum the same exact products in different orders (~sqrt(K) ulps of
# each projection, ~3e-6 relative at K <= 2816); the activation keeps that order of error.
FP32_TOL = 1e-5
TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]


_W_CACHE: dict = {}


def _experts(t: int, e: int, rows: int, k: int, seed: int) -> np.ndarray:
    """Random valid blocks (E, rows, row_bytes), numpy (CPU); cached per argument set."""
    key = (t, e, rows, k, seed)
    if key not in _W_CACHE:
        with mx.stream(mx.cpu):
            raw = random_ggml_blocks(e * rows, k, t, seed=seed, scale=0.5)
            _W_CACHE[key] = np.array(raw).reshape(e, rows, -1)
    return _W_CACHE[key]


def _poisoned(raw: np.ndarray, ids: mx.array) -> mx.array:
    """Every expert ``ids`` does not select overwritten by 0xFF bytes (NaN scales)."""
    out = raw.copy()
    keep = np.zeros(raw.shape[0], dtype=bool)
    sel = np.array(ids).reshape(-1).astype(np.int64)
    keep[sel[sel < raw.shape[0]]] = True
    out[~keep] = 0xFF
    return mx.array(out)


def _ids(m: int, k: int, e: int, seed: int) -> mx.array:
    rng = np.random.default_rng(seed)
    return mx.array(np.stack([rng.permutation(e)[:k] for _ in range(m)]).astype(np.uint32))


def _x(shape: tuple, dtype, seed: int, raw: np.ndarray, t: int) -> mx.array:
    """Normal x scaled so the projections are O(1): SiLU / GELU of |gate| in the hundreds (what
    the raw random blocks would give) is so ill-conditioned that fp32 itself loses 1e-4."""
    with mx.stream(mx.cpu):
        w0 = dequantize_reference(mx.array(raw[0]), t, shape[-1])  # expert 0 is enough
        scale = 2.0 / (mx.abs(w0).mean().item() * shape[-1] ** 0.5)
    return (scale * mx.random.normal(shape, key=mx.random.key(seed))).astype(dtype)


def _reference(x, raw_g, raw_u, ids, t, K, act) -> np.ndarray:
    """fp32 act(gate) * up from the clean weights, float64 numpy: expert_glu_reference, or for
    the GPU's large cases its math with each expert dequantized once (gather_mm)."""
    with mx.stream(mx.cpu):
        if ids.size * raw_g.shape[1] * K <= 1 << 24:
            out = G.expert_glu_reference(x.astype(mx.float32), mx.array(raw_g), ids, t, K, act,
                                         mx.array(raw_u))  # fmt: skip
            return np.array(out).astype(np.float64)
        xs = x.astype(mx.float32)
        if xs.ndim == ids.ndim:  # one x row per token for each of its k slots
            xs = mx.broadcast_to(xs[..., None, :], (*ids.shape, K))
        g, u = (
            mx.gather_mm(
                xs[..., None, :],
                dequantize_reference(mx.array(np.ascontiguousarray(r)), t, K).swapaxes(-1, -2),
                rhs_indices=ids,
            ).squeeze(-2)
            for r in (raw_g, raw_u)
        )
        out = activations.gated_activation_reference(g, u, act)
        return np.array(out).astype(np.float64)


def assert_rows_close(out: mx.array, ref: np.ndarray, dtype) -> None:
    """Per output row (last axis): relative 2-norm error <= FP32_TOL against the fp32 result
    ``ref``; fp16/bf16: at most twice the error of ``ref`` rounded to ``dtype`` (floored at
    FP32_TOL). Shared by the expert kernels' tests."""
    got = np.array(out.astype(mx.float32)).astype(np.float64)
    assert np.isfinite(ref).all()
    assert not np.isnan(got).any(), "unwritten (poisoned) outputs or an unselected expert read"
    norm = np.maximum(np.linalg.norm(ref, axis=-1), 1e-30)
    err = np.linalg.norm(got - ref, axis=-1) / norm
    tol = np.full(err.shape, FP32_TOL)
    if dtype != mx.float32:
        rounded = np.array(mx.array(ref.astype(np.float32)).astype(dtype).astype(mx.float32))
        assert np.isfinite(rounded).all(), "test data overflows the dtype"
        tol = np.maximum(2 * np.linalg.norm(rounded - ref, axis=-1) / norm, FP32_TOL)
    worst = np.unravel_index(np.argmax(err / tol), err.shape)
    assert (err <= tol).all(), f"row {worst}: relative error {err[worst]:.3g} > {tol[worst]:.3g}"


def _check(out: mx.array, x, raw_g, raw_u, ids, t, K, act) -> None:
    """Per (token, slot) row: relative 2-norm error <= FP32_TOL against fp32 math; fp16/bf16 x:
    at most twice the error of that fp32 result rounded to x's dtype (floored at FP32_TOL)."""
    F = raw_g.shape[1]
    assert out.dtype == x.dtype and out.shape == (*ids.shape, F)
    ref = _reference(x, raw_g, raw_u, ids, t, K, act)
    assert_rows_close(out, ref, x.dtype)


# (type, x dtype, activation, fused, tokens, k, per-slot x, E, F, K, config): F not a multiple
# of the features per threadgroup, K of 3 super-blocks / 11 blocks (partial steps)
_EMU_CASES = [
    (T.Q4_K, mx.float32, "gelu_tanh", True, 3, 2, False, 6, 9, 768, None),
    (T.Q4_K, mx.bfloat16, "silu", False, 1, 8, True, 9, 5, 512, None),
    (T.Q4_K, mx.float32, "silu", True, 2, 3, False, 7, 7, 256, None),
    (T.Q5_0, mx.float16, "gelu_tanh", True, 3, 2, False, 5, 6, 352, None),
    # several runs per SIMD group, features past F, more SIMD groups than some rows have steps
    (T.Q6_K, mx.float32, "silu", False, 2, 2, True, 5, 7, 2304, {"R": 3, "U": 2, "W": 3}),
]
_IDS = [f"{c[0].name}-{c[1]}-{c[2]}-{'fused' if c[3] else 'split'}-M{c[4]}k{c[5]}" for c in
        _EMU_CASES]  # fmt: skip


def _case(i: int):
    t, dt, act, fused, m, k, per_slot, e, f, kk, _ = _EMU_CASES[i]
    raw = _experts(t, e, 2 * f, kk, seed=i)
    raw_g, raw_u = raw[:, :f], raw[:, f:]
    ids = _ids(m, k, e, seed=100 + i)
    x = _x((m, k, kk) if per_slot else (m, kk), dt, i, raw, t)
    if fused:
        w, w_up = _poisoned(raw, ids), None
    else:
        w, w_up = _poisoned(np.ascontiguousarray(raw_g), ids), _poisoned(raw_u.copy(), ids)
    return x, w, w_up, ids, raw_g, raw_u


def _example(case) -> Example:
    t, dt, act, _, _, _, _, _, f, kk, cfg = case
    cfg = cfg or G.expert_run_config(t, kk)
    return Example(
        {"xs": (dt, 64), "wg": (mx.uint8, 64), "wu": (mx.uint8, 64), "ids": (mx.uint32, 8),
         "edims": (mx.int32, 7)},
        {"ys": dt},
        {"T": dt, "MT": 1, "R": 2 * cfg["R"], "U": cfg["U"], "ACT": G.ACTIVATIONS.index(act)},
    )  # fmt: skip


@pytest.fixture(scope="module")
def emulated():
    """Build the instantiations two at a time (g++ dominates), then run every case."""
    if not kernel_emulator.available():
        pytest.skip("g++ is not installed")
    todo = {(c[0], repr(_example(c))): (G._KERNELS[c[0]], _example(c)) for c in _EMU_CASES}
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda ke: kernel_emulator.build(*ke), todo.values()))
    outs = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Kernel, "__call__", kernel_emulator.kernel_call)
        for i, c in enumerate(_EMU_CASES):
            x, w, w_up, ids, *_ = _case(i)
            outs[i] = G.expert_glu_kernel(x, w, ids, c[0], c[9], c[2], w_up, config=c[10])
    return outs


@pytest.mark.parametrize("i", range(len(_EMU_CASES)), ids=_IDS)
def test_kernel_logic_on_the_emulator(emulated, i):
    x, _, _, ids, raw_g, raw_u = _case(i)
    c = _EMU_CASES[i]
    _check(emulated[i], x, raw_g, raw_u, ids, c[0], c[9], c[2])


@needs_gxx
def test_bad_and_poisoned_ids_give_nan_rows_on_the_emulator(monkeypatch):
    """Pair (0, 1) selects a poisoned expert: NaN row (the poison reaches the output through the
    kernel); ids E and past E: NaN rows, nothing read; the other pairs exact."""
    t, e, f, kk = T.Q4_K, 6, 9, 768  # _EMU_CASES[0]'s instantiation
    raw = _experts(t, e, 2 * f, kk, seed=11)
    ids = mx.array([[2, 3], [e, 0], [e + 7, 2]], dtype=mx.uint32)
    w = _poisoned(raw, mx.array([2, 0]))  # expert 3 poisoned although pair (0, 1) selects it
    x = _x((3, kk), mx.float32, 9, raw, t)
    monkeypatch.setattr(Kernel, "__call__", kernel_emulator.kernel_call)
    out = np.array(G.expert_glu_kernel(x, w, ids, t, kk, "gelu_tanh"))
    assert np.isnan(out[:, 0]).sum() == 2 * f and np.isnan(out[0, 1]).all()
    good = mx.array([[2], [0], [2]], dtype=mx.uint32)
    _check(mx.array(out[[0, 1, 2], [0, 1, 1]][:, None]), x, raw[:, :f], raw[:, f:], good, t, kk,
           "gelu_tanh")  # fmt: skip


@needs_gxx
def test_dispatcher_on_the_emulator(monkeypatch):
    """1..32 tokens: one launch (batch dims kept, int32 ids, a cached plan on repeat); 33 tokens:
    the two-step path (expert_matmul, then the activation); caller errors raise."""
    t, e, f, kk = T.Q4_K, 7, 7, 256  # _EMU_CASES[2]'s instantiation
    raw = _experts(t, e, 2 * f, kk, seed=12)
    emu = Emulated(G._KERNELS[t])
    monkeypatch.setitem(G._KERNELS, t, emu)
    monkeypatch.setattr(G, "backend", lambda: "cuda")
    monkeypatch.setattr(G, "_CALLS", {})
    ids = _ids(32, 3, e, seed=1).reshape(4, 8, 3).astype(mx.int32)
    x = _x((4, 8, kk), mx.float32, 2, raw, t)
    y = G.expert_glu(x, mx.array(raw), ids, t, kk, "silu")
    assert emu.launches == 1 and y.shape == (4, 8, 3, f)
    args = (raw[:, :f], raw[:, f:], ids.reshape(32, 3).astype(mx.uint32), t, kk, "silu")
    _check(y.reshape(32, 3, f), x.reshape(32, kk), *args)
    assert mx.array_equal(G.expert_glu(x, mx.array(raw), ids, t, kk, "silu"), y)
    assert emu.launches == 2 and len(G._CALLS) == 1
    ids33, x33 = _ids(33, 2, e, seed=3), _x((33, kk), mx.float32, 4, raw, t)
    with ck.reference_only():  # the two-step path's own dispatchers on their references
        y33 = G.expert_glu(x33, mx.array(raw), ids33, t, kk, "silu")
    assert emu.launches == 2
    _check(y33, x33, raw[:, :f], raw[:, f:], ids33, t, kk, "silu")
    with pytest.raises(WeightMismatchError):
        G.expert_glu(x[..., :128], mx.array(raw), ids, t, kk, "silu")
    with pytest.raises(WeightMismatchError):
        G.expert_glu(x, mx.array(raw[:, :-1]), ids, t, kk, "silu")  # odd fused rows
    with pytest.raises(InvalidArgumentError):
        G.expert_glu(x, mx.array(raw), ids, t, kk, "relu")


def _dense_case(dtype, seed: int):
    t, f, kk = T.Q4_K, 7, 256  # _EMU_CASES[2]'s instantiation (one expert here)
    raw = _experts(t, 1, 2 * f, kk, seed=seed)
    return t, f, kk, raw, _x((2, 3, kk), dtype, seed, raw, t)


def _check_dense(y, x, raw, t, f, kk) -> None:
    """dense_glu = the experts' contract over one expert (id 0 for every row), (..., F)."""
    assert y.shape == (*x.shape[:-1], f)
    ids = mx.zeros((x.size // kk, 1), dtype=mx.uint32)
    _check(y.reshape(-1, 1, f), x.reshape(-1, kk), raw[:, :f], raw[:, f:], ids, t, kk, "silu")


@needs_gxx
def test_dense_glu_on_the_emulator(monkeypatch):
    """A dense fused [gate | up] GGML layer (2F, row_bytes): one launch, the output in x's
    leading shape; its plan cached; None off a GPU, past 32 rows, or for blocks that are not
    the layer's."""
    t, f, kk, raw, x = _dense_case(mx.float32, seed=21)
    w = mx.array(raw[0])  # (2F, row_bytes)
    assert G.dense_glu(x, w, t, kk) is None  # no GPU here: the caller's two-step path
    emu = Emulated(G._DENSE_KERNELS[t])
    monkeypatch.setitem(G._DENSE_KERNELS, t, emu)
    monkeypatch.setattr(G, "backend", lambda: "cuda")
    monkeypatch.setattr(G, "_DENSE", {})
    y = G.dense_glu(x, w, t, kk)
    assert emu.launches == 1
    _check_dense(y, x, raw, t, f, kk)
    assert mx.array_equal(G.dense_glu(x, w, t, kk), y) and len(G._DENSE) == 1
    assert G.dense_glu(_x((33, kk), mx.float32, 3, raw, t), w, t, kk) is None
    assert G.dense_glu(x, w[:, :-1], t, kk) is None
    assert emu.launches == 2


def test_dense_config_keeps_the_column_order():
    """Every M keeps M = 1's U and W (each row's order of operations) and stays within
    qmatmul.MAX_ACC accumulators; MT covers M in one group of rows up to DENSE_MT."""
    for t in TYPES:
        for f, kk in ((7, 256), (2112, 2816), (512, 8192)):
            if kk % (256 if "_K" in t.name else 32):
                continue
            one = G.dense_config(t, 1, f, kk)
            assert one["MT"] == 1
            for m in range(2, 33):
                cfg = G.dense_config(t, m, f, kk)
                assert (cfg["U"], cfg["W"]) == (one["U"], one["W"])
                assert m <= cfg["MT"] <= G.DENSE_MT and 2 * cfg["R"] * cfg["MT"] <= G.Q.MAX_ACC


_DENSE_ROWS = (2, 5, 8, 16, 32)  # batch sizes checked against each row alone
_DENSE_DTYPES = (mx.bfloat16, mx.float32, mx.float16)
# the type whose batches all go through dense_glu's own configs (MT 2, 8, 16, 32); the others
# run M < 32 on the M = 32 instantiation (padding columns), to keep g++ builds few
_DISPATCHED = T.Q4_K


def _bits(a: mx.array) -> np.ndarray:
    return np.array(a.view(mx.uint16 if a.dtype.size == 2 else mx.uint32))


def _dense_rows_case(i: int, t: int):
    f, kk = 5, 256  # F odd: features past the last threadgroup's; K one super-block / 8 blocks
    raw = _experts(t, 1, 2 * f, kk, seed=40 + i)
    x = _x((32, kk), _DENSE_DTYPES[i % 3], 40 + i, raw, t)  # fresh rows per type
    return f, kk, raw, x


def _dense_cfg(t: int, m: int, f: int, kk: int) -> dict[str, int]:
    return G.dense_config(t, m if t == _DISPATCHED or m == 1 else 32, f, kk)


@pytest.fixture(scope="module")
def dense_builds():
    """The instantiations of test_dense_glu_rows_match_each_row_alone_on_the_emulator, built
    two at a time (g++ dominates)."""
    if not kernel_emulator.available():
        pytest.skip("g++ is not installed")
    todo = {}
    for i, t in enumerate(TYPES):
        f, kk, _, x = _dense_rows_case(i, t)
        for m in (1, *_DENSE_ROWS):
            cfg = _dense_cfg(t, m, f, kk)
            w0 = mx.zeros((2 * f, 1), mx.uint8)
            kernel, launch, _ = G._dense_launch(x[:m], w0, t, kk, "silu", cfg)
            ex = Example({"xs": x.dtype, "w": mx.uint8, "ddims": (mx.int32, 3)}, {"ys": x.dtype},
                         launch["template"])  # fmt: skip
            todo[(t, repr(ex))] = (kernel, ex)
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda ke: kernel_emulator.build(*ke), todo.values()))


@pytest.mark.parametrize("i,t", list(enumerate(TYPES)), ids=[t.name for t in TYPES])
def test_dense_glu_rows_match_each_row_alone_on_the_emulator(dense_builds, i, t, monkeypatch):
    """Row parity: M = 2..32 rows in one launch (each weight row decoded once for all of them)
    give every row the exact bits it has alone through dense_glu (M = 1), and those are within
    _check's bounds of fp32 math; outputs NaN-poisoned by the emulator. M = 32 (and every M
    for _DISPATCHED) through dense_glu; the others through the kernel at M = 32's config."""
    f, kk, raw, x = _dense_rows_case(i, t)
    w = mx.array(raw[0])
    emu = Emulated(G._DENSE_KERNELS[t])
    monkeypatch.setitem(G._DENSE_KERNELS, t, emu)
    monkeypatch.setattr(G, "backend", lambda: "cuda")
    monkeypatch.setattr(G, "_DENSE", {})
    monkeypatch.setattr(G.MM, "ENABLED", False)  # the scalar kernel (bf16 Q6_K would take mma)
    # every row alone in one run: M = 1's instantiation, one row per group of rows (gid_y)
    alone = G.dense_glu_kernel(x, w, t, kk, config=G.dense_config(t, 1, f, kk))
    _check_dense(alone, x, raw, t, f, kk)
    for r in (0, 31):  # ... the bits dense_glu gives that row alone
        assert np.array_equal(_bits(G.dense_glu(x[r : r + 1], w, t, kk)), _bits(alone[r : r + 1]))
    perm = np.random.default_rng(i).permutation(32)
    for m in _DENSE_ROWS:
        rows = mx.array(perm[:m])
        before = emu.launches
        if t == _DISPATCHED or m == 32:
            y = G.dense_glu(x[rows], w, t, kk)
        else:
            y = G.dense_glu_kernel(x[rows], w, t, kk, config=_dense_cfg(t, m, f, kk))
        assert emu.launches == before + 1
        assert np.array_equal(_bits(y), _bits(alone[rows])), f"M = {m}: a row's bits changed"


@needs_gxx
def test_dense_glu_groups_of_rows_on_the_emulator():
    """A config with fewer columns than rows (MT = 8 at M = 20: groups of rows on gid_y, the
    last one partial), 3 features per threadgroup (F = 7: the last group past F), several runs
    per SIMD group: each row's bits as alone, and the reference's values."""
    t, f, kk = T.Q6_K, 7, 2304
    raw = _experts(t, 1, 2 * f, kk, seed=50)
    x = _x((20, kk), mx.bfloat16, 50, raw, t)
    w = mx.array(raw[0])
    cfg = {"MT": 8, "R": 3, "U": 2, "W": 3}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Kernel, "__call__", kernel_emulator.kernel_call)
        y = G.dense_glu_kernel(x, w, t, kk, "gelu_tanh", config=cfg)
        alone = G.dense_glu_kernel(x, w, t, kk, "gelu_tanh", config=dict(cfg, MT=1, R=2))
    assert np.array_equal(_bits(y), _bits(alone))
    ids = mx.zeros((20, 1), dtype=mx.uint32)
    _check(y[:, None], x, raw[:, :f], raw[:, f:], ids, t, kk, "gelu_tanh")


@needs_gxx
@pytest.mark.parametrize("model", ["gemma4", "qwen3_5_moe"])
def test_model_experts_use_the_kernel(model, monkeypatch):
    """GGML Q4_K experts with kernels on (the CPU standing in for the GPU, this kernel emulated,
    every other dispatcher on its reference): one launch for gate, up and the activation, the
    reference path's result to fp32 noise."""
    case = _EMU_CASES[0 if model == "gemma4" else 2]  # their instantiations
    t, _, act, _, _, k, _, e, f, kk, _ = case
    raw = _experts(t, e, 2 * f, kk, seed=13)
    gate_up = ExpertLinear(e, kk, 2 * f, t)
    gate_up.weight = mx.array(raw)
    ids, x = _ids(2, k, e, seed=14), _x((2, kk), mx.float32, 15, raw, t)
    if model == "gemma4":
        experts = gemma4_moe.Experts(kk, f, e, act)
    else:
        experts = qwen3_5_moe.Experts(kk, f, e, fused_gate_up=True)
    experts.gate_up_proj = gate_up
    from hf2q_mlx.models import ops

    def glu():
        return ops.expert_glu(x, ids, experts.gate_up_proj, None, act)

    emu = Emulated(G._KERNELS[t])
    with mx.stream(mx.cpu):
        want = glu()
        monkeypatch.setattr(ck, "_gpu", ("cuda", mx.default_device(), mx.default_device))
        monkeypatch.setitem(G._KERNELS, t, emu)
        monkeypatch.setattr(G, "_CALLS", {})
        got = glu()
    assert emu.launches == 1
    _check(got, x, raw[:, :f], raw[:, f:], ids, t, kk, act)
    ref = np.array(want)
    assert np.abs(np.array(got) - ref).max() <= FP32_TOL * np.abs(ref).max()


def test_expert_run_setting(monkeypatch):
    """HF2Q_EXPERT_RUN "R,U,W" replaces EXPERT_RUN in expert_run_config (W still cut to the runs
    a row has); empty keeps it; anything else is an InvalidArgumentError naming the switch."""
    t, kk = T.Q4_K, 2816  # 11 super-blocks, 8 a step (4 lanes each): 2 steps a row
    monkeypatch.setattr(G, "RUN_SETTING", "")
    assert G.expert_run_config(t, kk) == Q.clamp_w(t, kk, G.EXPERT_RUN)
    monkeypatch.setattr(G, "RUN_SETTING", " 2, 1,2 ")
    assert G.expert_run_config(t, kk) == {"R": 2, "U": 1, "W": 2}
    monkeypatch.setattr(G, "RUN_SETTING", "8,1,8")  # 2 runs of U 1: W 2
    assert G.expert_run_config(t, kk) == {"R": 8, "U": 1, "W": 2}
    for text in ("2,1", "4,1,1,1", "0,1,1", "4,9,1", "a,1,1", "4,1,-1"):
        monkeypatch.setattr(G, "RUN_SETTING", text)
        with pytest.raises(InvalidArgumentError, match="HF2Q_EXPERT_RUN"):
            G.expert_run_config(t, kk)


# ---------------------------------------------------------------------------------------------
# GPU: every type x dtype, the bench models' shapes, outputs and unselected experts poisoned

# (E, F, K): odd tiny; Gemma-4-26B-A4B's (F 704, K 2816) and Qwen3.5-35B-A3B's (F 512,
# K 2048) experts, fewer of them (the kernel reads only the selected ones)
SHAPES = [(5, 7, 256), (16, 704, 2816), (12, 512, 2048)]
ROUTES = [(1, 8, False, True), (3, 2, True, False), (32, 8, False, True)]


@requires_gpu
@pytest.mark.parametrize("e,f,kk", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("m,k,per_slot,fused", ROUTES)
def test_gpu_kernel_matches_reference(m, k, per_slot, fused, dtype, t, e, f, kk):
    if kk % (256 if "_K" in t.name else 32) or k > e:
        pytest.skip("K not a multiple of the block / more slots than experts")
    raw = _experts(t, e, 2 * f, kk, seed=f)
    ids = _ids(m, k, e, seed=m * 7 + k + f)
    x = _x((m, k, kk) if per_slot else (m, kk), dtype, m + f, raw, t)
    act = "silu" if fused else "gelu_tanh"
    if fused:
        w, w_up = _poisoned(raw, ids), None
    else:
        w, w_up = (
            _poisoned(np.ascontiguousarray(raw[:, :f]), ids),
            _poisoned(raw[:, f:].copy(), ids),
        )
    out = G.expert_glu_kernel(x, w, ids, t, kk, act, w_up, init_value=float("nan"))
    mx.eval(out)
    _check(out, x, raw[:, :f], raw[:, f:], ids, t, kk, act)


@requires_gpu
@pytest.mark.parametrize("cfg", [{"R": 1, "U": 1, "W": 1}, {"R": 3, "U": 4, "W": 3}],
                         ids=["r1u1w1", "r3u4w3"])  # fmt: skip
def test_gpu_launch_configs_and_dispatcher(cfg):
    t, e, f, kk = T.Q4_K, 9, 257, 2816
    raw = _experts(t, e, 2 * f, kk, seed=5)
    ids = _ids(3, 4, e, seed=6)
    x = _x((3, kk), mx.bfloat16, 7, raw, t)
    out = G.expert_glu_kernel(x, _poisoned(raw, ids), ids, t, kk, "silu", config=cfg,
                              init_value=float("nan"))  # fmt: skip
    _check(out, x, raw[:, :f], raw[:, f:], ids, t, kk, "silu")
    _check(G.expert_glu(x, mx.array(raw), ids, t, kk, "silu"), x, raw[:, :f], raw[:, f:], ids,
           t, kk, "silu")  # fmt: skip


@requires_gpu
@pytest.mark.parametrize("f,kk", [(7, 256), (2112, 2816)], ids=["tiny", "gemma4-26b"])
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=["f32", "f16", "bf16"])
def test_gpu_dense_glu(dtype, t, f, kk, monkeypatch):
    """On the GPU: every row of M = 2..32 with the bits it has alone, the kernel's outputs
    NaN-poisoned first, values within _check's bounds of fp32 math. The scalar kernel: the
    tensor-core one (bf16 on CUDA) is test_dense_glu_mma.py's."""
    monkeypatch.setattr(G.MM, "ENABLED", False)
    if kk % (256 if "_K" in t.name else 32):
        pytest.skip("K not a multiple of the block")
    raw = _experts(t, 1, 2 * f, kk, seed=f + 60)
    x = _x((32, kk), dtype, f + 61, raw, t)
    w = mx.array(raw[0])
    alone = mx.concatenate([G.dense_glu(x[r : r + 1], w, t, kk) for r in range(32)])
    _check_dense(alone, x, raw, t, f, kk)
    perm = np.random.default_rng(f).permutation(32)
    for m in (2, 3, 5, 8, 13, 16, 17, 32):
        rows = mx.array(perm[:m])
        y = G.dense_glu(x[rows], w, t, kk)
        assert y is not None and y.dtype == dtype
        assert np.array_equal(_bits(y), _bits(alone[rows])), f"M = {m}: a row's bits changed"
        cfg = G.dense_config(t, m, f, kk)
        poisoned = G.dense_glu_kernel(x[rows], w, t, kk, config=cfg, init_value=float("nan"))
        assert np.array_equal(_bits(poisoned), _bits(y))
