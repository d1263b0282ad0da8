"""expert_down: the routed experts' down projections and their weighted sum in one kernel; its
CUDA rendering on the CPU emulator and on a GPU against fp32 reference math with every
unselected expert's blocks poisoned (0xFF: NaN scales), the dispatcher and the models' wiring."""

from __future__ import annotations

import os

import kernel_emulator
import mlx.core as mx
import numpy as np
import pytest
from conftest import requires_gpu
from gguf import GGMLQuantizationType as T
from kernel_emulator import Emulated
from test_expert_glu import _experts, _poisoned, assert_rows_close

import hf2q_mlx.custom_kernels as ck
from hf2q_mlx.custom_kernels import expert_down as D
from hf2q_mlx.custom_kernels import expert_glu as G
from hf2q_mlx.custom_kernels._render import Kernel
from hf2q_mlx.custom_kernels.dequant import dequantize_reference
from hf2q_mlx.custom_kernels.ggml_formats import rows_per_step
from hf2q_mlx.errors import InvalidArgumentError, WeightMismatchError
from hf2q_mlx.models import gemma4_moe, qwen3_5_moe
from hf2q_mlx.models.experts import ExpertLinear

needs_gxx = pytest.mark.skipif(not kernel_emulator.available(), reason="g++ is not installed")
# fp32: the same exact products summed in other orders over K and the k slots (~sqrt(kK) ulps)
FP32_TOL = 1e-5


def _route(m: int, k: int, e: int, seed: int) -> tuple[mx.array, mx.array]:
    """Distinct experts per token and gate weights (fp32, summing to 1 as top-k routing's)."""
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.permutation(e)[:k] for _ in range(m)]).astype(np.uint32)
    w = rng.random((m, k)).astype(np.float32) + 0.1
    return mx.array(ids), mx.array(w / w.sum(-1, keepdims=True))


def _h(shape: tuple, dtype, seed: int) -> mx.array:
    # fp16: h / 32 keeps the largest outputs (Q6_K blocks at scale 0.5) inside fp16's range
    scale = 2.0**-5 if dtype == mx.float16 else 1.0
    return (scale * mx.random.normal(shape, key=mx.random.key(seed))).astype(dtype)


def _reference(h, raw, ids, wts, t, K) -> np.ndarray:
    """fp32 weighted sum of the down projections, float64 numpy: expert_down_reference, or
    for the GPU's large cases the same math with each expert dequantized once (gather_mm)."""
    with mx.stream(mx.cpu):
        if ids.size * raw.shape[1] * K <= 1 << 24:
            out = D.expert_down_reference(h.astype(mx.float32), mx.array(raw), ids, wts, t, K)
        else:
            wf = dequantize_reference(mx.array(raw), t, K).swapaxes(-1, -2)
            y = mx.gather_mm(h.astype(mx.float32)[..., None, :], wf, rhs_indices=ids)
            out = (y.squeeze(-2) * wts[..., None]).sum(axis=-2)
        return np.array(out).astype(np.float64)


def _check(out: mx.array, h, raw, ids, wts, t, K) -> None:
    """Per token: relative 2-norm error <= FP32_TOL against fp32 math; fp16/bf16 h: at most
    twice the error of that fp32 result rounded to h's dtype (floored at FP32_TOL)."""
    ref = _reference(h, raw, ids, wts, t, K)
    assert out.dtype == h.dtype and out.shape == ref.shape
    assert_rows_close(out, ref, h.dtype)


# (type, h dtype, tokens, k, E, N, K, config): Gemma-4-26B-A4B's down rows are Q5_0 (K 704 is
# not a multiple of 256); N past a threadgroup's rows, K of 11 blocks / 3 super-blocks
_EMU_CASES = [
    (T.Q5_0, mx.float32, 3, 2, 6, 9, 352, None),
    (T.Q4_K, mx.bfloat16, 2, 3, 5, 7, 768, None),
    (T.Q6_K, mx.float16, 1, 8, 9, 5, 2304, {"R": 3, "U": 2, "W": 3}),
]
_IDS = [f"{c[0].name}-{c[1]}-M{c[2]}k{c[3]}" for c in _EMU_CASES]


def _case(i: int):
    t, dt, m, k, e, n, kk, _ = _EMU_CASES[i]
    raw = _experts(t, e, n, kk, seed=i)
    ids, wts = _route(m, k, e, seed=100 + i)
    return _h((m, k, kk), dt, seed=i), _poisoned(raw, ids), ids, wts, raw


@pytest.fixture(scope="module")
def emulated():
    if not kernel_emulator.available():
        pytest.skip("g++ is not installed")
    outs = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Kernel, "__call__", kernel_emulator.kernel_call)
        for i, c in enumerate(_EMU_CASES):
            h, w, ids, wts, _ = _case(i)
            outs[i] = D.expert_down_kernel(h, w, ids, wts, c[0], c[6], config=c[7])
    return outs


@pytest.mark.parametrize("i", range(len(_EMU_CASES)), ids=_IDS)
def test_kernel_logic_on_the_emulator(emulated, i):
    h, _, ids, wts, raw = _case(i)
    _check(emulated[i], h, raw, ids, wts, _EMU_CASES[i][0], _EMU_CASES[i][6])


@needs_gxx
def test_bad_and_poisoned_ids_give_nan_rows_on_the_emulator(monkeypatch):
    """Token 0 selects a poisoned expert, token 1 an id past E: NaN rows; token 2 exact."""
    t, dt, _, k, e, n, kk, _ = _EMU_CASES[0]  # its instantiation
    raw = _experts(t, e, n, kk, seed=11)
    ids = mx.array([[2, 3], [e, 0], [4, 2]], dtype=mx.uint32)
    _, wts = _route(3, k, e, seed=1)
    w = _poisoned(raw, mx.array([2, 0, 4]))  # expert 3 poisoned although token 0 selects it
    h = _h((3, k, kk), dt, seed=9)
    monkeypatch.setattr(Kernel, "__call__", kernel_emulator.kernel_call)
    out = np.array(D.expert_down_kernel(h, w, ids, wts, t, kk))
    assert np.isnan(out[0]).all() and np.isnan(out[1]).all()
    _check(mx.array(out[2:]), h[2:], raw, ids[2:], wts[2:], t, kk)


@needs_gxx
def test_dispatcher_on_the_emulator(monkeypatch):
    """1..32 tokens: one launch (batch dims kept, int32 ids, bf16 weights, a cached plan on
    repeat); 33 tokens: expert_matmul, then the weighted sum; caller errors raise."""
    t, dt, _, k, e, n, kk, _ = _EMU_CASES[0]  # its instantiation
    raw = _experts(t, e, n, kk, seed=12)
    emu = Emulated(D._KERNELS[t])
    monkeypatch.setitem(D._KERNELS, t, emu)
    monkeypatch.setattr(D, "backend", lambda: "cuda")
    monkeypatch.setattr(D, "_CALLS", {})
    monkeypatch.setattr(D, "SLOT_TEAMS", "0")  # the per-pair kernel (the slot one's test below)
    ids, wts = _route(32, k, e, seed=1)
    h = _h((4, 8, k, kk), dt, seed=2)
    y = D.expert_down(h, mx.array(raw), ids.reshape(4, 8, k).astype(mx.int32),
                      wts.reshape(4, 8, k).astype(mx.bfloat16), t, kk)  # fmt: skip
    assert emu.launches == 1 and y.shape == (4, 8, n)
    wts16 = wts.astype(mx.bfloat16).astype(mx.float32)
    _check(y.reshape(32, n), h.reshape(32, k, kk), raw, ids, wts16, t, kk)
    ids33, wts33 = _route(33, k, e, seed=3)
    h33 = _h((33, k, kk), dt, seed=4)
    with ck.reference_only():  # expert_matmul's own dispatcher on its reference
        y33 = D.expert_down(h33, mx.array(raw), ids33, wts33, t, kk)
    assert emu.launches == 1
    _check(y33, h33, raw, ids33, wts33, t, kk)
    with pytest.raises(WeightMismatchError):
        D.expert_down(h[..., :32], mx.array(raw), ids.reshape(4, 8, k), wts.reshape(4, 8, k),
                      t, kk)  # fmt: skip


@needs_gxx
@pytest.mark.parametrize("slots", ["auto", "0"], ids=["slot_kernel", "per_pair"])
@pytest.mark.parametrize("model", ["gemma4", "qwen3_5_moe"])
def test_model_experts_use_the_kernels(model, slots, monkeypatch):
    """A whole routed-expert block over GGML experts with kernels on (the CPU standing in for
    the GPU, the gate/up and down kernels emulated, every other dispatcher on its reference):
    one launch each (the down: the slot-parallel kernel by default on CUDA, the per-pair one
    with HF2Q_DOWN_SLOTS=0), the reference path's result to fp32 noise."""
    # instantiations built for expert_glu's and this file's other tests; F = 32: the down
    # projection's rows are one Q5_0 block
    t, e, F, hidden, k = T.Q4_K, 6, 32, 768, 2
    gate_up = ExpertLinear(e, hidden, 2 * F, t)
    gate_up.weight = mx.array(_experts(t, e, 2 * F, hidden, seed=13))
    down = ExpertLinear(e, F, hidden, T.Q5_0)
    down.weight = mx.array(_experts(T.Q5_0, e, hidden, F, seed=14))
    if model == "gemma4":
        experts = gemma4_moe.Experts(hidden, F, e, "gelu_tanh")
    else:
        experts = qwen3_5_moe.Experts(hidden, F, e, fused_gate_up=True)
    experts.gate_up_proj, experts.down_proj = gate_up, down
    ids, wts = _route(2, k, e, seed=15)
    x = 0.02 * mx.random.normal((2, hidden), key=mx.random.key(16))
    table = D._SLOT_KERNELS if slots == "auto" else D._KERNELS
    glu, dn = Emulated(G._KERNELS[t]), Emulated(table[T.Q5_0])
    monkeypatch.setattr(D, "SLOT_TEAMS", slots)
    with mx.stream(mx.cpu):
        want = experts(x, ids, wts)
        monkeypatch.setattr(ck, "_gpu", ("cuda", mx.default_device(), mx.default_device))
        monkeypatch.setitem(G._KERNELS, t, glu)
        monkeypatch.setitem(table, T.Q5_0, dn)
        monkeypatch.setattr(G, "_CALLS", {})
        monkeypatch.setattr(D, "_CALLS", {})
        got = experts(x, ids, wts)
    assert glu.launches == 1 and dn.launches == 1 and got.shape == want.shape == (2, hidden)
    ref = np.array(want)
    assert np.abs(np.array(got) - ref).max() <= FP32_TOL * np.abs(ref).max()


# ---------------------------------------------------------------------------------------------
# Slot-parallel kernel (config S >= 2, off by default): a token's k slots over S teams of SIMD
# groups, the slots' sums added in slot order. Same contract and tolerances; a token's bits
# depend on (U, W) only: the same alone, in a 5-token verify, in a batch of 32, at any S or R.

# (type, h dtype, k, E, N, K, config): S = k (one round), S = 2 with teams of 2 SIMD groups,
# S = 3 with k = 8 (a partial last round), U = 2; N past a threadgroup's rows
_SLOT_CASES = [
    (T.Q5_0, mx.float32, 8, 10, 9, 352, {"R": 4, "U": 1, "W": 1, "S": 8}),
    (T.Q4_K, mx.bfloat16, 2, 5, 7, 512, {"R": 2, "U": 1, "W": 2, "S": 2}),
    (T.Q8_0, mx.bfloat16, 8, 9, 5, 256, {"R": 3, "U": 2, "W": 2, "S": 3}),
    (T.Q4_K, mx.float32, 8, 9, 6, 256, {"R": 4, "U": 1, "W": 1, "S": 4}),
    (T.Q8_0, mx.float32, 2, 4, 10, 128, {"R": 8, "U": 1, "W": 1, "S": 2}),
    # PK 1 (HF2Q_DOWN_PACK): rows of nb < BPS blocks packed into a step's block slots; N past
    # a threadgroup's R x pack rows: Q4_K K 512 (4 rows a step), K 256 (8), K 1024 with U 2 (2);
    # Q6_K (16 lanes a block) K 256 with W 2 (its second SIMD group has no run)
    (T.Q4_K, mx.float32, 8, 9, 21, 512, {"R": 4, "U": 1, "W": 1, "S": 8, "PK": 1}),
    (T.Q4_K, mx.bfloat16, 8, 9, 19, 256, {"R": 2, "U": 1, "W": 1, "S": 4, "PK": 1}),
    (T.Q4_K, mx.float32, 2, 5, 9, 1024, {"R": 4, "U": 2, "W": 1, "S": 2, "PK": 1}),
    (T.Q6_K, mx.float32, 4, 6, 5, 256, {"R": 2, "U": 1, "W": 2, "S": 2, "PK": 1}),
]
_SLOT_IDS = [
    f"{c[0].name}-{c[1]}-k{c[2]}-S{c[6]['S']}" + ("-PK" if c[6].get("PK") else "")
    for c in _SLOT_CASES
]
_BATCH, _VERIFY = 32, slice(11, 16)  # a decode batch and a 5-token speculative verify inside it
_SLICES = {1: slice(7, 8), 5: _VERIFY, 32: slice(None)}  # tokens per call: which of the batch


def _slot_case(i: int):
    """(h (32, k, K), poisoned experts, ids, weights, raw blocks) of _SLOT_CASES[i]."""
    t, dt, k, e, n, kk, _ = _SLOT_CASES[i]
    raw = _experts(t, e, n, kk, seed=40 + i)
    ids, wts = _route(_BATCH, k, e, seed=140 + i)
    return _h((_BATCH, k, kk), dt, seed=40 + i), _poisoned(raw, ids), ids, wts, raw


@pytest.fixture(scope="module")
def emulated_slots():
    """Per case: its outputs at 32 tokens, at the 5-token verify slice and at one token alone."""
    if not kernel_emulator.available():
        pytest.skip("g++ is not installed")
    outs = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Kernel, "__call__", kernel_emulator.kernel_call)
        for i, c in enumerate(_SLOT_CASES):
            h, w, ids, wts, _ = _slot_case(i)
            outs[i] = {
                m: D.expert_down_kernel(h[s], w, ids[s], wts[s], c[0], c[5], config=c[6])
                for m, s in _SLICES.items()
            }
    return outs


@pytest.mark.parametrize("i", range(len(_SLOT_CASES)), ids=_SLOT_IDS)
@pytest.mark.parametrize("m", [1, 5, 32])
def test_slot_kernel_logic_on_the_emulator(emulated_slots, i, m):
    h, _, ids, wts, raw = _slot_case(i)
    s = _SLICES[m]
    _check(emulated_slots[i][m], h[s], raw, ids[s], wts[s], _SLOT_CASES[i][0], _SLOT_CASES[i][5])


@pytest.mark.parametrize("i", range(len(_SLOT_CASES)), ids=_SLOT_IDS)
def test_slot_kernel_row_parity_on_the_emulator(emulated_slots, i):
    """A token's output bits alone (token 7) and in the 5-token verify are its bits in the batch."""
    out = {m: np.array(o.astype(mx.float32)) for m, o in emulated_slots[i].items()}
    assert np.array_equal(out[1], out[32][7:8])
    assert np.array_equal(out[5], out[32][_VERIFY])


@needs_gxx
def test_slot_kernel_bits_do_not_depend_on_s_or_r(emulated_slots, monkeypatch):
    """_SLOT_CASES[0] (S 8, R 4) at S 2 (4 rounds), S 3 (a partial round) and S 4 with R 2 / 8:
    the same bits (each slot reduced whole, then the slots in order); today's kernel (S 1, or
    no S) is another order of the same sums, so only close."""
    t, _, _, _, _, kk, cfg = _SLOT_CASES[0]
    h, w, ids, wts, raw = _slot_case(0)
    monkeypatch.setattr(Kernel, "__call__", kernel_emulator.kernel_call)
    want = np.array(emulated_slots[0][5])
    for s, r in ((2, 4), (3, 4), (4, 2), (4, 8)):
        got = D.expert_down_kernel(h[_VERIFY], w, ids[_VERIFY], wts[_VERIFY], t, kk,
                                   config=dict(cfg, S=s, R=r))  # fmt: skip
        assert np.array_equal(np.array(got), want), (s, r)
    old = np.array(D.expert_down_kernel(h[_VERIFY], w, ids[_VERIFY], wts[_VERIFY], t, kk,
                                        config=dict(cfg, S=1)))  # fmt: skip
    assert not np.array_equal(old, want)  # the other kernel ran
    plain = D.expert_down_kernel(h[_VERIFY], w, ids[_VERIFY], wts[_VERIFY], t, kk,
                                 config={a: b for a, b in cfg.items() if a != "S"})  # fmt: skip
    assert np.array_equal(old, np.array(plain))  # S 1 is today's kernel and launch
    _check(mx.array(old), h[_VERIFY], raw, ids[_VERIFY], wts[_VERIFY], t, kk)


@needs_gxx
def test_packed_slot_kernel_bits_do_not_depend_on_s_or_r(emulated_slots, monkeypatch):
    """The first PK case (Q4_K K 512: 4 rows a step) at other S and R: the same bits; without
    PK the same sums in another order (the lanes' butterfly against simd_sum), so only close."""
    i = next(j for j, c in enumerate(_SLOT_CASES) if c[6].get("PK"))
    t, _, _, _, _, kk, cfg = _SLOT_CASES[i]
    h, w, ids, wts, raw = _slot_case(i)
    monkeypatch.setattr(Kernel, "__call__", kernel_emulator.kernel_call)
    want = np.array(emulated_slots[i][5])
    for s, r in ((2, 4), (3, 2), (4, 8)):
        got = D.expert_down_kernel(h[_VERIFY], w, ids[_VERIFY], wts[_VERIFY], t, kk,
                                   config=dict(cfg, S=s, R=r))  # fmt: skip
        assert np.array_equal(np.array(got), want), (s, r)
    plain = D.expert_down_kernel(h[_VERIFY], w, ids[_VERIFY], wts[_VERIFY], t, kk,
                                 config=dict(cfg, PK=0))  # fmt: skip
    assert not np.array_equal(np.array(plain), want)  # the unpacked kernel ran
    _check(plain, h[_VERIFY], raw, ids[_VERIFY], wts[_VERIFY], t, kk)


def test_row_packing_switch(monkeypatch):
    """rows_per_step: BPS / nb where a row's nb blocks divide a step's BPS slots (Q4_K: 8), else
    1; HF2Q_DOWN_PACK (PACK) unset: PK in slot_config with the CUDA back end only, 0 never, 1
    always, each only where it packs; bad values raise; a PK config that cannot pack raises
    instead of launching."""
    assert [rows_per_step(T.Q4_K, kk) for kk in (256, 512, 768, 1024, 2048)] == [8, 4, 1, 2, 1]
    assert rows_per_step(T.Q6_K, 256) == 2 and rows_per_step(T.Q5_0, 704) == 1
    assert rows_per_step(T.F16, 256) == 1
    monkeypatch.setattr(D, "SLOT_TEAMS", "8")
    if "HF2Q_DOWN_PACK" not in os.environ:
        assert D.PACK == "auto"
    monkeypatch.setattr(D, "PACK", "auto")
    for gpu, want in ((None, False), ("metal", False), ("cuda", True)):
        monkeypatch.setattr(D, "backend", lambda g=gpu: g)
        assert ("PK" in D.slot_config(T.Q4_K, 512, 8)) == want, gpu
    monkeypatch.setattr(D, "PACK", "0")
    assert "PK" not in D.slot_config(T.Q4_K, 512, 8)
    monkeypatch.setattr(D, "PACK", "1")
    assert D.slot_config(T.Q4_K, 512, 8)["PK"] == 1
    assert "PK" not in D.slot_config(T.Q5_0, 704, 8)
    monkeypatch.setattr(D, "PACK", "yes")
    with pytest.raises(InvalidArgumentError, match="HF2Q_DOWN_PACK"):
        D.slot_config(T.Q4_K, 512, 8)
    raw = _experts(T.Q5_0, 3, 4, 704, seed=5)
    ids, wts = _route(2, 2, 3, seed=6)
    with pytest.raises(InvalidArgumentError, match="row packing"):
        D._plan(_h((2, 2, 704), mx.float32, 7), mx.array(raw), ids, T.Q5_0, 704,
                {"R": 4, "U": 1, "W": 1, "S": 2, "PK": 1})  # fmt: skip


@needs_gxx
def test_slot_kernel_bad_and_poisoned_ids_give_nan_rows_on_the_emulator(monkeypatch):
    """S 3 over k 8: token 0 has an id past E in its last (partial) round, token 1 in its first,
    token 2 selects a poisoned expert: NaN rows; token 3 its bits alone, and exact."""
    t, dt, k, e, n, kk, cfg = _SLOT_CASES[2]
    cfg = dict(cfg, R=2)
    raw = _experts(t, e, n, kk, seed=41)
    _, wts = _route(4, k, e, seed=42)
    rng = np.random.default_rng(42)
    ids_np = np.stack([rng.permutation(e - 1)[:k] for _ in range(4)]).astype(np.uint32)
    ids_np[0, 7], ids_np[1, 0], ids_np[2, 4] = e, e + 5, e - 1  # only token 2 selects e - 1
    ids = mx.array(ids_np)
    w = _poisoned(raw, ids[[0, 1, 3]])
    assert (np.array(w[e - 1]) == 0xFF).all()
    h = _h((4, k, kk), dt, seed=43)
    monkeypatch.setattr(Kernel, "__call__", kernel_emulator.kernel_call)
    out = np.array(D.expert_down_kernel(h, w, ids, wts, t, kk, config=cfg).astype(mx.float32))
    assert np.isnan(out[:3]).all()
    alone = D.expert_down_kernel(h[3:], w, ids[3:], wts[3:], t, kk, config=cfg)
    assert np.array_equal(out[3:], np.array(alone.astype(mx.float32)))
    _check(alone, h[3:], raw, ids[3:], wts[3:], t, kk)


@needs_gxx
def test_dispatcher_slot_switch_on_the_emulator(monkeypatch):
    """Unset ("auto"): the slot kernel with 8 teams on CUDA, the per-pair kernel elsewhere;
    SLOT_TEAMS (HF2Q_DOWN_SLOTS) 0: the per-pair kernel; >= 2: one launch of the slot kernel, S
    capped at k and at 8 // W, the bits of expert_down_kernel at slot_config; a flipped switch
    gets its own plan; malformed values and S x W > 8 raise."""
    if "HF2Q_DOWN_SLOTS" not in os.environ:
        assert D.SLOT_TEAMS == "auto" and "S" not in G.expert_run_config(T.Q5_0, 704)
        for gpu, want in ((None, None), ("metal", None), ("cuda", 8)):
            with monkeypatch.context() as mp:
                mp.setattr(D, "backend", lambda g=gpu: g)
                got = D.slot_config(T.Q5_0, 704, 8)
                assert (got and got["S"]) == want, (gpu, got)
    t, dt, k, e, n, kk, _ = _SLOT_CASES[0]
    h, w, ids, wts, raw = _slot_case(0)
    old, new = Emulated(D._KERNELS[t]), Emulated(D._SLOT_KERNELS[t])
    monkeypatch.setitem(D._KERNELS, t, old)
    monkeypatch.setitem(D._SLOT_KERNELS, t, new)
    monkeypatch.setattr(D, "backend", lambda: "cuda")
    monkeypatch.setattr(D, "_CALLS", {})
    monkeypatch.setattr(D, "SLOT_TEAMS", "0")
    monkeypatch.setattr(D, "SLOT_ROWS", "0")
    y0 = D.expert_down(h[:5], w, ids[:5], wts[:5], t, kk)
    assert (old.launches, new.launches) == (1, 0)
    monkeypatch.setattr(D, "SLOT_TEAMS", "16")  # the environment's string; past k: S = k = 8
    monkeypatch.setattr(D, "SLOT_ROWS", 2)
    assert D.slot_config(t, kk, k) == dict(G.expert_run_config(t, kk), R=2, S=8)
    assert D.slot_config(t, kk, 3)["S"] == 3 and D.slot_config(t, kk, 1) is None
    y1 = D.expert_down(h[:5], w, ids[:5], wts[:5], t, kk)
    assert (old.launches, new.launches) == (1, 1)
    monkeypatch.setattr(Kernel, "__call__", kernel_emulator.kernel_call)
    want = D.expert_down_kernel(h[:5], w, ids[:5], wts[:5], t, kk, config=D.slot_config(t, kk, k))
    assert np.array_equal(np.array(y1), np.array(want))
    assert not np.array_equal(np.array(y0), np.array(y1))
    _check(y1, h[:5], raw, ids[:5], wts[:5], t, kk)
    with monkeypatch.context() as mp:
        mp.setattr(G, "EXPERT_RUN", {"R": 4, "U": 1, "W": 4})
        assert D.slot_config(t, 2048, k)["S"] == 2  # 8 SIMD groups at most
    monkeypatch.setattr(D, "SLOT_TEAMS", "eight")
    with pytest.raises(InvalidArgumentError):
        D.slot_config(t, kk, k)
    with pytest.raises(InvalidArgumentError):
        D.expert_down_kernel(
            h[:1], w, ids[:1], wts[:1], t, kk, config={"R": 4, "U": 1, "W": 2, "S": 8}
        )


# ---------------------------------------------------------------------------------------------
# GPU: every type x dtype, the bench models' down shapes, outputs and unselected experts poisoned

TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
# (E, N, K): odd tiny; Gemma-4-26B-A4B's down (N 2816, K 704: 32-weight blocks only) and
# Qwen3.5-35B-A3B's (N 2048, K 512), fewer experts (only the selected ones are read)
SHAPES = [(5, 7, 256), (16, 2816, 704), (12, 2048, 512)]
ROUTES = [(1, 8), (3, 2), (32, 8)]


@requires_gpu
@pytest.mark.parametrize("e,n,kk", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("m,k", ROUTES)
def test_gpu_kernel_matches_reference(m, k, dtype, t, e, n, kk):
    if kk % (256 if "_K" in t.name else 32) or k > e:
        pytest.skip("K not a multiple of the block / more slots than experts")
    raw = _experts(t, e, n, kk, seed=n)
    ids, wts = _route(m, k, e, seed=m * 7 + k + n)
    h = _h((m, k, kk), dtype, seed=m + n)
    out = D.expert_down_kernel(h, _poisoned(raw, ids), ids, wts, t, kk, init_value=float("nan"))
    mx.eval(out)
    _check(out, h, raw, ids, wts, t, kk)


# Slot-parallel kernel on the GPU: the reference at every type, dtype and shape (S = k, R 4,
# the per-pair U, W), then row parity and S / R independence at the two models' down shapes.


def _slot_cfg(t, kk: int, k: int, **kw) -> dict[str, int]:
    """The per-pair R, U, W with S = k teams (8 SIMD groups at most), then ``kw``."""
    cfg = G.expert_run_config(t, kk)
    return {**cfg, "S": min(k, 8 // cfg["W"]), **kw}


@requires_gpu
@pytest.mark.parametrize("e,n,kk", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("m,k", ROUTES)
def test_gpu_slot_kernel_matches_reference(m, k, dtype, t, e, n, kk):
    if kk % (256 if "_K" in t.name else 32) or k > e:
        pytest.skip("K not a multiple of the block / more slots than experts")
    raw = _experts(t, e, n, kk, seed=n)
    ids, wts = _route(m, k, e, seed=m * 7 + k + n)
    h = _h((m, k, kk), dtype, seed=m + n)
    out = D.expert_down_kernel(h, _poisoned(raw, ids), ids, wts, t, kk,
                               config=_slot_cfg(t, kk, k), init_value=float("nan"))  # fmt: skip
    mx.eval(out)
    _check(out, h, raw, ids, wts, t, kk)


@requires_gpu
@pytest.mark.parametrize("kk", [512, 256, 1024], ids=lambda v: f"K{v}")
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["f32", "bf16"])
def test_gpu_packed_slot_kernel(kk, dtype):
    """PK 1 (HF2Q_DOWN_PACK) at Qwen3.5-35B-A3B's down (Q4_K, N 2048, k 8; K 512 packs 4 rows a
    step, 256 8, 1024 2): within tolerance of the reference with unselected experts poisoned
    and NaN-filled output; each token's bits alone and in a 5-token verify are its bits in the
    batch of 32, and do not move with R or S (a row's lanes and their butterfly stay put)."""
    t, e, n, k, nan = T.Q4_K, 12, 2048, 8, float("nan")
    assert rows_per_step(t, kk) == 8 * 256 // kk
    raw = _experts(t, e, n, kk, seed=kk + 1)
    ids, wts = _route(_BATCH, k, e, seed=kk + 2)
    h = _h((_BATCH, k, kk), dtype, seed=kk + 3)
    w = _poisoned(raw, ids)

    def run(s, **kw):
        cfg = _slot_cfg(t, kk, k, PK=1, **kw)
        return np.array(D.expert_down_kernel(h[s], w, ids[s], wts[s], t, kk, config=cfg,
                                             init_value=nan).astype(mx.float32))  # fmt: skip

    batch = run(slice(None), R=4)
    _check(mx.array(batch).astype(dtype), h, raw, ids, wts, t, kk)
    assert np.array_equal(run(_VERIFY), batch[_VERIFY])
    for j in (0, 31):
        assert np.array_equal(run(slice(j, j + 1)), batch[j : j + 1]), j
    for s, r in ((4, 4), (8, 2), (2, 8)):
        assert np.array_equal(run(slice(None), S=s, R=r), batch), (s, r)


@requires_gpu
@pytest.mark.parametrize("t,e,n,kk", [(T.Q5_0, 16, 2816, 704), (T.Q4_K, 12, 2048, 512)],
                         ids=["gemma4-26b-a4b", "qwen3.5-35b-a3b"])  # fmt: skip
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["f32", "bf16"])
def test_gpu_slot_kernel_row_parity(t, e, n, kk, dtype):
    """k 8: each token's bits alone, in a 5-token verify and at S 2, 4 / R 2, 8 are its bits
    in a batch of 32 at S 8, R 4; and within tolerance of the reference."""
    k, nan = 8, float("nan")
    raw = _experts(t, e, n, kk, seed=n + 1)
    ids, wts = _route(_BATCH, k, e, seed=n + 2)
    h = _h((_BATCH, k, kk), dtype, seed=n + 3)
    w = _poisoned(raw, ids)

    def run(s, **kw):
        cfg = _slot_cfg(t, kk, k, **kw)
        return np.array(D.expert_down_kernel(h[s], w, ids[s], wts[s], t, kk, config=cfg,
                                             init_value=nan).astype(mx.float32))  # fmt: skip

    batch = run(slice(None), R=4)
    _check(mx.array(batch).astype(dtype), h, raw, ids, wts, t, kk)
    assert np.array_equal(run(_VERIFY), batch[_VERIFY])
    for j in (0, 7, 31):
        assert np.array_equal(run(slice(j, j + 1)), batch[j : j + 1]), j
    w_max = 8 // G.expert_run_config(t, kk)["W"]
    for s, r in ((2, 4), (4, 2), (4, 8)):
        assert np.array_equal(run(slice(None), S=min(s, w_max), R=r), batch), (s, r)
