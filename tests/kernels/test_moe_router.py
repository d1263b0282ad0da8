"""moe_router: the top-k rule of the reference, the kernel's CUDA rendering on the CPU emulator
against the reference (Gemma 4's and Qwen 3.5's routing), the split mapping (G threadgroups per
row) against one threadgroup per row bit for bit, the dispatcher and the models' wiring, and GPU
cases with poisoned outputs."""

from __future__ import annotations

import importlib
import pkgutil
from concurrent.futures import ThreadPoolExecutor

import kernel_emulator
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import requires_gpu
from gguf import GGMLQuantizationType as GT
from kernel_emulator import Emulated
from mlx.utils import tree_flatten, tree_unflatten

import hf2q_mlx.custom_kernels as ck
from hf2q_mlx.custom_kernels import moe_router as R
from hf2q_mlx.custom_kernels import post_norm_residual as PNR
from hf2q_mlx.custom_kernels import residual_rms_norm as RRN
from hf2q_mlx.errors import InvalidArgumentError, WeightMismatchError
from hf2q_mlx.io.random_weights import random_ggml_blocks
from hf2q_mlx.models import gemma4, gemma4_moe, ops, qwen3_5_moe
from hf2q_mlx.models.experts import ExpertLinear

needs_gxx = pytest.mark.skipif(not kernel_emulator.available(), reason="g++ is not installed")
# fp32: kernel and reference sum the same D products in different orders (~sqrt(D) ulps of the
# logits); softmax moves the weights by about as much: 1e-5 absolute on weights <= 1.
FP32_TOL = 1e-5
_MANT = {mx.float32: 23, mx.float16: 10, mx.bfloat16: 7}  # significand bits after the point


# ---------------------------------------------------------------------------------------------
# CPU: the reference's top-k rule


def test_top_k_ids_rule():
    """Largest first, equal logits by lower index, -inf logits too: against numpy's lexsort over
    (index, -logit) on rows full of ties."""
    rng = np.random.default_rng(0)
    for E, k in ((7, 7), (40, 5), (130, 8)):
        vals = rng.integers(-3, 4, (6, E)).astype(np.float32)  # many equal logits
        vals[rng.random(vals.shape) < 0.1] = -np.inf
        got = np.array(R.top_k_ids(mx.array(vals), k))
        want = np.stack([np.lexsort((np.arange(E), -row))[:k] for row in vals])
        assert got.dtype == np.uint32 and (got == want).all()


def _args(kind: str, D: int, E: int, dtype, wdtype, seed: int) -> dict:
    """Router arguments as the models pass them: "gemma" (pre-norm, per-expert scale, the
    experts' norm), "qwen" (renormalized top k), "qwen_full" (full-softmax weights); a suffix
    "_q8" / "_q4": the weight MLX affine-quantized (8 bits, groups of 64 / 4 bits, 32)."""
    keys = mx.random.split(mx.random.key(seed), 4)
    w = (mx.random.normal((E, D), key=keys[0]) * D**-0.5).astype(wdtype)
    kind, _, q = kind.partition("_q")
    a = dict(w=w, renormalize=kind == "qwen")
    if kind == "gemma":
        a = dict(
            w=w,
            eps=1e-6,
            pre_scale=(0.75 + 0.5 * mx.random.uniform(shape=(D,), key=keys[1])).astype(dtype),
            pre_mult=D**-0.5,
            expert_scale=(0.5 + mx.random.uniform(shape=(E,), key=keys[2])).astype(dtype),
            post_norm=(0.75 + 0.5 * mx.random.uniform(shape=(D,), key=keys[3])).astype(dtype),
        )
    if q:
        bits, gs = int(q), 64 if q == "8" else 32
        wq, scales, biases = mx.quantize(w, group_size=gs, bits=bits)
        a.update(w=wq, quant=(scales, biases, gs, bits))
    return a


def _x(rows: int, D: int, dtype, seed: int) -> mx.array:
    # Gemma scales the residual stream up; the pre-norm makes the router indifferent to it
    return (3 * mx.random.normal((rows, D), key=mx.random.key(1000 + seed))).astype(dtype)


def _logits(x: mx.array, a: dict) -> np.ndarray:
    """The reference's fp32 logits (what its top-k ranks), on the CPU."""
    with mx.stream(mx.cpu):
        h = x
        if a.get("pre_scale") is not None:
            h = mx.fast.rms_norm(x, None, a["eps"]) * (a["pre_scale"] * a["pre_mult"]).astype(
                x.dtype
            )
        if a.get("quant") is None:
            return np.array((h @ a["w"].T).astype(mx.float32))
        s, b, gs, bits = a["quant"]
        wd = mx.dequantize(a["w"], s.astype(mx.float32), b.astype(mx.float32), group_size=gs,
                           bits=bits)  # fmt: skip
        y = (h.astype(mx.float32) @ wd.T).astype(R._matmul_dtype(x.dtype, s.dtype))
        return np.array(y.astype(mx.float32))


def _check(got, x: mx.array, a: dict, k: int) -> None:
    """ids equal the reference's wherever its logits separate them by more than the logits'
    rounding (else the chosen logits must be within it of those they displace); weights within
    FP32_TOL (fp32) or one rounding of a logit (fp16/bf16, where the logits round to the
    matmul's dtype); the experts' norm within fp32 noise / one ulp of x's dtype."""
    ids, wts, xn = got
    with mx.stream(mx.cpu):
        r_ids, r_wts, r_xn = R.moe_router_reference(x, k=k, **a)
    ids, r_ids = np.array(ids).astype(np.int64), np.array(r_ids).astype(np.int64)
    wts, r_wts = np.array(wts), np.array(r_wts)
    assert ids.shape == r_ids.shape and wts.shape == r_wts.shape and wts.dtype == np.float32
    assert not np.isnan(wts).any(), "unwritten (poisoned) weights"
    assert ((ids >= 0) & (ids < a["w"].shape[0])).all(), "unwritten (poisoned) ids"
    lg = _logits(x, a)
    ldt = R._matmul_dtype(x.dtype, a["w"].dtype if "quant" not in a else a["quant"][0].dtype)
    ltol = np.abs(lg).max() * 2.0 ** -_MANT[ldt]  # an ulp of the largest logit
    es = a.get("expert_scale")
    es = None if es is None else np.array(es.astype(mx.float32))
    loose = 0
    for r in range(ids.shape[0]):
        same = (ids[r] == r_ids[r]).all()
        if same and np.abs(wts[r] - r_wts[r]).max() <= FP32_TOL:
            continue
        # fp32 logits round alike: only fp16/bf16 ones may land an ulp apart (a near-tie picks
        # another expert, or a weight moves with that ulp), and in few rows
        assert ldt != mx.float32, (r, ids[r], r_ids[r], wts[r], r_wts[r])
        loose += 1
        sel = lg[r][ids[r]]
        assert sel.min() >= np.sort(lg[r])[::-1][k - 1] - ltol, (r, ids[r], r_ids[r])
        assert (np.diff(sel) <= ltol).all() and len(set(ids[r])) == k, (r, ids[r], sel)
        # the weights: the softmax of the reference's logits at the kernel's picks (or of all
        # of them), to that rounding
        logp = np.log(wts[r] / (1.0 if es is None else es[ids[r]]))
        over = sel if a.get("renormalize", True) else lg[r]
        want = sel - over.max() - np.log(np.exp(over - over.max()).sum())
        assert np.abs(logp - want).max() <= 2 * ltol, (r, logp, want)
    assert loose <= max(1, ids.shape[0] // 4), f"{loose} of {ids.shape[0]} rows off the reference"
    if "post_norm" in a:
        got_n, ref_n = np.array(xn.astype(mx.float32)), np.array(r_xn.astype(mx.float32))
        assert not np.isnan(got_n).any()
        # fp16 / bf16: two ulps. The kernel rounds x * rsqrt(.) to x's dtype, then the product
        # with the weight (as the separate ops do); its rsqrt is the GPU's, the reference's the
        # CPU's: an ulp apart in the first rounding can end two apart (H200, 2026-12-02)
        tol = FP32_TOL if x.dtype == mx.float32 else 2.0 ** (1 - _MANT[x.dtype])
        assert (np.abs(got_n - ref_n) <= tol * np.maximum(np.abs(ref_n), 1e-3)).all()
    else:
        assert xn is None


def test_reference_is_the_models_routing():
    """moe_router_reference computes what Gemma 4's Router and Qwen 3.5's SparseMoeBlock.route
    compute on their reference path (the same experts, as sets; the same weights)."""
    D, E, k = 96, 16, 4
    x = _x(3, D, mx.float32, seed=0)
    g = gemma4_moe.Router(D, E, k, eps=1e-6)
    a = _args("gemma", D, E, mx.float32, mx.float32, seed=1)
    g.proj.weight, g.scale, g.per_expert_scale = a["w"], a["pre_scale"], a["expert_scale"]
    norm = ops.RMSNorm(D, eps=1e-6)
    norm.weight = a["post_norm"]
    args = qwen3_5_moe.ModelArgs(hidden_size=D, num_experts=E, num_experts_per_tok=k)
    q = qwen3_5_moe.SparseMoeBlock(args)
    q.gate.weight = a["w"]
    with mx.stream(mx.cpu):
        cases = [
            (g(x, norm), R.moe_router_reference(x, k=k, **a)),
            (q.route(x) + (None,), R.moe_router_reference(x, a["w"], k)),
        ]
        for (ids, wts, xn), (r_ids, r_wts, r_xn) in cases:
            order, r_order = mx.argsort(ids, axis=-1), mx.argsort(r_ids, axis=-1)
            sort = mx.take_along_axis
            assert mx.array_equal(sort(ids, order, -1), sort(r_ids, r_order, -1))
            assert mx.allclose(sort(wts, order, -1), sort(r_wts, r_order, -1), atol=1e-6)
            assert (xn is None) == (r_xn is None)
            if xn is not None:
                assert mx.allclose(xn, r_xn, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# CPU emulator: the CUDA rendering

# (kind, x dtype, weight dtype, rows, D, E, k): D and E off every power of two, E < and > 32
_EMU_CASES = [
    ("gemma", mx.float32, mx.float32, 3, 200, 40, 5),
    ("gemma", mx.bfloat16, mx.bfloat16, 2, 264, 67, 8),
    ("gemma", mx.float16, mx.float16, 1, 96, 8, 8),  # k = E
    ("qwen", mx.float32, mx.float32, 5, 77, 33, 4),
    ("qwen", mx.bfloat16, mx.float32, 1, 128, 130, 8),  # fp32 router, bf16 x: fp32 logits
    ("qwen_full", mx.bfloat16, mx.bfloat16, 3, 2064, 64, 1),  # two rounds of chunk loads
    ("qwen_q8", mx.bfloat16, mx.bfloat16, 2, 256, 40, 8),  # mlx-lm's 8-bit router
    ("gemma_q4", mx.float32, mx.float32, 1, 96, 24, 3),
]
_IDS = [f"{c[0]}-{c[1]}-w{c[2]}-B{c[3]}D{c[4]}E{c[5]}k{c[6]}" for c in _EMU_CASES]


def _case(i: int):
    kind, dt, wdt, rows, D, E, k = _EMU_CASES[i]
    return _x(rows, D, dt, seed=i), _args(kind, D, E, dt, wdt, seed=i), k


@pytest.fixture(scope="module")
def emulated():
    """Build the distinct instantiations two at a time (g++ dominates), then run every case."""
    if not kernel_emulator.available():
        pytest.skip("g++ is not installed")
    cases = [_case(i) for i in range(len(_EMU_CASES))]
    examples = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(R._kernel.__class__, "launcher", kernel_emulator.kernel_launcher)
        mp.setattr(kernel_emulator, "emulate", _recording(examples))
        for x, a, k in cases:  # a dry run notes each launch's instantiation
            R.moe_router_kernel(x, k=k, **a)
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda ex: kernel_emulator.build(R._kernel, ex), examples))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(R._kernel.__class__, "launcher", kernel_emulator.kernel_launcher)
        runs = {i: R.moe_router_kernel(x, k=k, **a) for i, (x, a, k) in enumerate(cases)}
    return runs


def _recording(examples: list):
    """An ``emulate`` stand-in noting the example each launch would build, returning dummies."""
    from hf2q_mlx.custom_kernels import _render

    def record(kernel, inputs, *, output_shapes, output_dtypes, template=None, **_):
        examples.append(
            _render.Example(
                {n: (a.dtype, a.size) for n, a in zip(kernel.inputs, inputs)},
                dict(zip(kernel.outputs, output_dtypes)),
                dict(_render._norm_template(template)),
            )
        )
        return [mx.zeros(s, dtype=d) for s, d in zip(output_shapes, output_dtypes)]

    return record


@pytest.mark.parametrize("i", range(len(_EMU_CASES)), ids=_IDS)
def test_kernel_logic_on_the_emulator(emulated, i):
    x, a, k = _case(i)
    _check(emulated[i], x, a, k)


@needs_gxx
def test_ties_on_the_emulator(monkeypatch):
    """Integer x and weights: every logit is exact in any summation order, so the many equal
    logits must be broken exactly as the reference breaks them (the lower index first)."""
    rng = np.random.default_rng(5)
    D, E, k = 77, 33, 4  # _EMU_CASES[3]'s instantiation: no build of its own
    x = mx.array(rng.integers(-2, 3, (4, D)).astype(np.float32))
    w = mx.array(rng.integers(-1, 2, (E, D)).astype(np.float32))
    monkeypatch.setattr(R._kernel.__class__, "launcher", kernel_emulator.kernel_launcher)
    ids, wts, _ = R.moe_router_kernel(x, w, k)
    r_ids, r_wts, _ = R.moe_router_reference(x, w, k)
    lg = np.array(x @ w.T)
    assert any(len(set(np.sort(row)[-k - 1 :])) <= k for row in lg), "no tie at the boundary"
    assert mx.array_equal(ids, r_ids) and mx.allclose(wts, r_wts, atol=FP32_TOL)


@needs_gxx
def test_nan_row_on_the_emulator(monkeypatch):
    """A NaN row of x (a static step's unused row may hold anything) gets NaN weights and ids
    the expert kernels treat as past the last expert; the other rows stay exact."""
    kind, dt, wdt, _, D, E, k = _EMU_CASES[3]  # its instantiation
    a = _args(kind, D, E, dt, wdt, seed=6)
    x = _x(3, D, dt, seed=6)
    x = mx.where(mx.arange(3)[:, None] == 1, mx.nan, x)
    monkeypatch.setattr(R._kernel.__class__, "launcher", kernel_emulator.kernel_launcher)
    ids, wts, _ = R.moe_router_kernel(x, k=k, **a)
    assert np.isnan(np.array(wts[1])).all() and (np.array(ids[1]) >= E).all()
    keep = mx.array([0, 2])
    _check((ids[keep], wts[keep], None), x[keep], a, k)


@needs_gxx
def test_dispatcher_on_the_emulator(monkeypatch):
    """The kernel for 1..32 rows with leading dims kept, a cached plan on repeat, the reference
    for 33 rows and for quantized (non-float) routers; caller errors raise."""
    emu = Emulated(R._kernel)
    monkeypatch.setattr(R, "_kernel", emu)
    monkeypatch.setattr(R, "backend", lambda: "cuda")
    monkeypatch.setattr(R, "_PLANS", {})
    D, E, k = 77, 33, 4  # as _EMU_CASES[3]
    a = _args("qwen", D, E, mx.float32, mx.float32, seed=3)
    x = _x(32, D, mx.float32, seed=4).reshape(4, 8, D)
    ids, wts, xn = R.moe_router(x, a["w"], k)
    assert emu.launches == 1 and ids.shape == (4, 8, k) and xn is None
    _check((ids.reshape(32, k), wts.reshape(32, k), None), x.reshape(32, D), a, k)
    again = R.moe_router(x, a["w"], k)
    assert emu.launches == 2 and len(R._PLANS) == 1 and mx.array_equal(again[0], ids)
    x33 = _x(33, D, mx.float32, seed=5)
    _check(R.moe_router(x33, k=k, **a), x33, a, k)
    assert emu.launches == 2 and not R.kernel_covers(x33, a["w"], k)
    assert not R.kernel_covers(x, a["w"].astype(mx.uint8), k)
    with pytest.raises(WeightMismatchError):
        R.moe_router(x[..., :32], a["w"], k)
    with pytest.raises(InvalidArgumentError):
        R.moe_router(x, a["w"], E + 1)
    with pytest.raises(WeightMismatchError):
        R.moe_router(x, a["w"], k, expert_scale=mx.ones((E - 1,)))


@needs_gxx
@pytest.mark.parametrize("split", [False, True], ids=["G1", "split"])
@pytest.mark.parametrize("model", ["gemma4", "gemma4_q4", "qwen3_5_moe"])
def test_models_route_through_the_kernel(model, split, monkeypatch):
    """With kernels on (the CPU standing in for the GPU, the router kernel emulated, every other
    dispatcher on its reference) a model's routing takes one router launch and gives its
    reference routing: the same experts (as sets) and weights to fp32 noise. gemma4_q4: the
    router an affine 4-bit nn.QuantizedLinear (as nn.quantize makes it). split: these small
    routers split too (G = 8 or 4 threadgroups per row)."""
    if split:
        monkeypatch.setattr(R, "SPLIT", True)
        monkeypatch.setattr(R, "SPLIT_MIN_WEIGHTS", 0)
        monkeypatch.setenv("HF2Q_EMU_SHUFFLE", "8")
    emu = Emulated(R._kernel)
    case = {"gemma4": 0, "gemma4_q4": 7, "qwen3_5_moe": 3}[model]  # their instantiations
    kind, _, _, _, D, E, k = _EMU_CASES[case]
    x = _x(2, D, mx.float32, seed=7)
    a = _args(kind.partition("_q")[0], D, E, mx.float32, mx.float32, seed=8)
    if model.startswith("gemma4"):
        mod = gemma4_moe.Router(D, E, k, eps=1e-6)
        mod.proj.weight, mod.scale, mod.per_expert_scale = a["w"], a["pre_scale"], a["expert_scale"]
        if model == "gemma4_q4":
            mod.proj = nn.QuantizedLinear.from_linear(mod.proj, group_size=32, bits=4)
        norm = ops.RMSNorm(D, eps=1e-6)
        norm.weight = a["post_norm"]

        def route():
            return mod(x, norm)
    else:
        args = qwen3_5_moe.ModelArgs(hidden_size=D, num_experts=E, num_experts_per_tok=k)
        mod = qwen3_5_moe.SparseMoeBlock(args)
        mod.gate.weight = a["w"]

        def route():
            return (*mod.route(x), None)

    with mx.stream(mx.cpu):
        want = route()
        monkeypatch.setattr(ck, "_gpu", ("cuda", mx.default_device(), mx.default_device))
        monkeypatch.setattr(R, "_kernel", emu)
        monkeypatch.setattr(R, "_PLANS", {})
        assert ops.use_kernels()
        got = route()
        with ck.reference_only():
            forced = route()
    assert emu.launches == 1
    assert (next(iter(R._PLANS.values())).turn == 1) == split  # the split plan's set rotated
    assert all(mx.array_equal(f, w) for f, w in zip(forced, want) if w is not None)
    for a_, b_ in zip(got[:2], want[:2]):
        assert a_.shape == b_.shape
    order, w_order = mx.argsort(got[0], axis=-1), mx.argsort(want[0], axis=-1)
    sort = mx.take_along_axis
    assert mx.array_equal(sort(got[0], order, -1), sort(want[0], w_order, -1))
    assert mx.allclose(sort(got[1], order, -1), sort(want[1], w_order, -1), atol=FP32_TOL)
    if want[2] is not None:
        assert mx.allclose(got[2], want[2], atol=FP32_TOL)


# ---------------------------------------------------------------------------------------------
# CPU emulator: the split mapping (G threadgroups per row, the last one done ranks the logits)


def test_split_config(monkeypatch):
    """The mapping the dispatcher picks: G a power of two that keeps one expert per SIMD group
    while the grid fits about a wave, one threadgroup per row for small routers or with the
    switch off."""
    monkeypatch.setattr(R, "SPLIT", True)  # whatever HF2Q_ROUTER_SPLIT says
    assert R.RESIDENT_WARPS == 4096  # the numbers below assume it
    assert R.split_config(1, 128, 2816) == (16, 8)  # Gemma-4-26B-A4B: 128 SIMD groups
    assert R.split_config(32, 128, 2816) == (16, 8)  # 4096 SIMD groups
    assert R.split_config(1, 256, 2048) == (32, 8)  # Qwen3.5-35B-A3B
    assert R.split_config(16, 256, 2048) == (32, 8)
    assert R.split_config(32, 256, 2048) == (16, 8)  # two experts per SIMD group
    assert R.split_config(3, 33, 77) == (1, 16)  # E * D < SPLIT_MIN_WEIGHTS
    for rows in range(1, 33):
        for E, D in ((128, 2816), (256, 2048), (67, 1024), (8, 8192), (1024, 64)):
            g, warps = R.split_config(rows, E, D)
            assert g >= 1 and g & (g - 1) == 0 and g <= E and 1 <= warps <= R.WARPS
            if g > 1:  # about the fewest experts per SIMD group that fit the wave
                per_warp = -(-E // (g * warps))
                assert warps <= R.SPLIT_WARPS
                assert per_warp <= 2 * -(-rows * E // R.RESIDENT_WARPS), (rows, E, g, warps)
    monkeypatch.setattr(R, "SPLIT", False)
    assert R.split_config(1, 128, 2816) == (1, 16)
    with pytest.raises(InvalidArgumentError):
        R._mapping(40, 6)  # not a power of two
    with pytest.raises(InvalidArgumentError):
        R._mapping(40, 64)  # more groups than experts


# (kind, x dtype, weight dtype, rows, D, E, k, splits): each case runs with G = 1 and each
# split; E off the splits' multiples (empty slices at the end), non-VEC and quantized rows,
# 1..32 rows, one SIMD group per threadgroup (k = E = G = 8), an explicit (G, SIMD groups)
_SPLIT_CASES = [
    ("gemma", mx.bfloat16, mx.bfloat16, 5, 264, 67, 8, [2, 16]),
    ("gemma", mx.float32, mx.float32, 3, 200, 40, 5, [8]),
    ("gemma", mx.float16, mx.float16, 1, 96, 8, 8, [8]),
    ("qwen", mx.float32, mx.float32, 32, 77, 33, 4, [4, 32]),  # odd D: a weight per lane
    ("qwen_full", mx.bfloat16, mx.bfloat16, 17, 2064, 64, 1, [64]),
    ("qwen_q8", mx.bfloat16, mx.bfloat16, 8, 256, 40, 8, [8]),
    ("gemma_q4", mx.float32, mx.float32, 2, 96, 24, 3, [4, (2, 3)]),
    ("gemma", mx.bfloat16, mx.float32, 2, 2304, 24, 4, [4]),  # 18 chunks a lane: one round
]
_SPLIT_IDS = [f"{c[0]}-{c[1]}-w{c[2]}-B{c[3]}D{c[4]}E{c[5]}k{c[6]}" for c in _SPLIT_CASES]


def _split_case(i: int):
    kind, dt, wdt, rows, D, E, k, splits = _SPLIT_CASES[i]
    return _x(rows, D, dt, seed=50 + i), _args(kind, D, E, dt, wdt, seed=50 + i), k, splits


def _build_all(calls) -> None:
    """Build the emulator binaries ``calls`` (thunks launching the kernel) need, four at once."""
    examples = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(R._kernel.__class__, "launcher", kernel_emulator.kernel_launcher)
        mp.setattr(kernel_emulator, "emulate", _recording(examples))
        for call in calls:  # a dry run notes each launch's instantiation
            call()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda ex: kernel_emulator.build(R._kernel, ex), examples))


@pytest.fixture(scope="module")
def split_runs():
    """{(case, split): outputs}, split 1 the one-group-per-row mapping; the split runs with
    the threadgroups in a shuffled order (any of them may be a row's last)."""
    if not kernel_emulator.available():
        pytest.skip("g++ is not installed")
    cases = [_split_case(i) for i in range(len(_SPLIT_CASES))]
    calls = {
        (i, sp): (lambda x=x, a=a, k=k, sp=sp: R.moe_router_kernel(x, k=k, split=sp, **a))
        for i, (x, a, k, splits) in enumerate(cases)
        for sp in [1, *splits]
    }
    _build_all(calls.values())
    runs = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(R._kernel.__class__, "launcher", kernel_emulator.kernel_launcher)
        for n, (key, call) in enumerate(calls.items()):
            mp.setenv("HF2Q_EMU_SHUFFLE", str(n))
            runs[key] = call()
    return runs


def _bits(a: mx.array) -> np.ndarray:
    return np.array(a.view({1: mx.uint8, 2: mx.uint16, 4: mx.uint32}[a.dtype.size]))


@pytest.mark.parametrize("i", range(len(_SPLIT_CASES)), ids=_SPLIT_IDS)
def test_split_on_the_emulator(split_runs, i):
    """Every split gives the one-group-per-row kernel's outputs bit for bit (each logit is one
    SIMD group's sum in the same order, the norm's statistics are summed alike, the top k is
    the same code), and those match the reference."""
    x, a, k, splits = _split_case(i)
    base = split_runs[(i, 1)]
    _check(base, x, a, k)
    for sp in splits:
        got = split_runs[(i, sp)]
        for g_, b_ in zip(got, base):
            assert (g_ is None) == (b_ is None)
            if b_ is not None:
                assert np.array_equal(_bits(g_), _bits(b_)), sp


@needs_gxx
def test_batched_prologue_keeps_the_bits_on_the_emulator(monkeypatch):
    """The row loaded once into registers (BATCHED_PROLOGUE, the default) gives the loop
    form's ids, weights, experts' norm and split logits bit for bit: the same sums in the same
    order. Gemma's pre-norm and norm output at one group per row and split (G, SIMD groups) =
    (4, 2), so a SIMD group takes two of the statistics' virtual groups; Qwen's fp32 rows at
    G = 4; an fp32 router row of 18 16-byte chunks a lane (26B-A4B's has 22), loaded in one
    round (its logits, not its weights, show a change of summation order)."""
    calls = []
    for i, split in ((0, 1), (0, (4, 2)), (1, (2, 3)), (3, 4), (7, 4)):
        x, a, k, _ = _split_case(i)
        for batched in (False, True):
            calls.append((i, split, batched, x, a, k))

    def run(i, split, batched, x, a, k):
        monkeypatch.setattr(R, "BATCHED_PROLOGUE", batched)
        plan = R._plan(x, a["w"], k, a, None, split)
        return plan.launch(inputs=[*R._arrays(x, a["w"], a), plan.params[0], plan.counter])

    _build_all([lambda c=c: run(*c) for c in calls])
    monkeypatch.setattr(R._kernel.__class__, "launcher", kernel_emulator.kernel_launcher)
    runs = {(c[0], str(c[1]), c[2]): run(*c) for c in calls}
    for i, split, _, x, a, k in calls[::2]:
        loop, batched = runs[(i, str(split), False)], runs[(i, str(split), True)]
        ids, wts, xn = batched[:3]
        _check((ids, wts, xn if a.get("post_norm") is not None else None), x, a, k)
        for got, want in zip(batched, loop):
            assert np.array_equal(_bits(got), _bits(want)), (i, split)


# (x dtype, router weight dtype, rows, D, E, k, split): 26B-A4B's fp32 router under bf16 x
# split over 4 groups of 6 SIMD groups (the join's 9 SIMD groups two to a group), one group of
# 16 per row, and 3 SIMD groups a group taking the join's two one each
_JOIN_CASES = [
    (mx.bfloat16, mx.float32, 2, 2304, 24, 4, 4),
    (mx.float32, mx.float32, 3, 1000, 40, 5, 1),
    (mx.float16, mx.float16, 1, 264, 67, 8, (2, 3)),
    (mx.bfloat16, mx.float32, 1, 256, 8, 2, 1),
]


def _join_inputs(i: int, mode: int = 1):
    """Mode 1: Gemma's join (res, res_w, res_next_w) and router; 2: Qwen's residual add and
    norm (res, res_w, None) and router."""
    dt, wdt, rows, D, E, k, split = _JOIN_CASES[i]
    keys = mx.random.split(mx.random.key(70 + i), 3)
    res = (4 * mx.random.normal((rows, D), key=keys[0])).astype(dt)
    y = mx.random.normal((rows, D), key=keys[1]).astype(dt)
    res_w, res_next_w = (0.5 + mx.random.uniform(shape=(2, D), key=keys[2])).astype(dt)
    if mode == 1:
        return y, (res, res_w, res_next_w), _args("gemma", D, E, dt, wdt, seed=70 + i), k, split
    return (
        y,
        (res, res_w, None),
        dict(_args("qwen", D, E, dt, wdt, seed=70 + i), eps=1e-6),
        k,
        split,
    )


@needs_gxx
@pytest.mark.parametrize("mode", [1, 2], ids=["gemma", "qwen"])
def test_residual_join_is_the_two_kernels_on_the_emulator(monkeypatch, mode):
    """The router with the block join (``residual``) gives the joining kernel's h and n
    (Gemma: post_norm_residual's, h routed; Qwen: residual_rms_norm's, n routed) and the router
    kernel's ids, weights, experts' norm and split logits on the routed row, bit for bit (the
    join in that kernel's layout and order, the routing reading the row from shared memory as
    it would from memory), within the reference's tolerance; group 0 alone writes h and n, the
    other groups of a split row only read."""
    cases = [_join_inputs(i, mode) for i in range(len(_JOIN_CASES))]

    def fused(y, residual, a, k, split):
        opts = dict(a, residual=residual)
        plan = R._plan(y, a["w"], k, opts, None, split)
        return plan.launch(inputs=[*R._arrays(y, a["w"], opts), plan.params[0], plan.counter])

    def routed(x, a, k, split):
        plan = R._plan(x, a["w"], k, a, None, split)
        return plan.launch(inputs=[*R._arrays(x, a["w"], a), plan.params[0], plan.counter])

    _build_all([lambda c=c: fused(*c) for c in cases])
    monkeypatch.setattr(R._kernel.__class__, "launcher", kernel_emulator.kernel_launcher)
    monkeypatch.setattr(PNR, "backend", lambda: "cuda")
    monkeypatch.setattr(RRN, "backend", lambda: "cuda")
    PNR._plan.cache_clear()
    RRN._plan.cache_clear()
    try:
        for n_case, (y, residual, a, k, split) in enumerate(cases):
            res, res_w, res_next_w = residual
            if mode == 1:
                h, n = PNR.post_norm_residual(res, y, res_w, res_next_w, a["eps"])
            else:
                h, n = RRN.residual_rms_norm(res, y, res_w, a["eps"])
            monkeypatch.setenv("HF2Q_EMU_SHUFFLE", str(200 + n_case))
            row = h if mode == 1 else n
            want = [*routed(row, a, k, split)[:4], h, n]
            got = fused(y, residual, a, k, split)
            for g_, w_, name in zip(got, want, ("ids", "wts", "xn", "lgo", "h", "n")):
                assert np.array_equal(_bits(g_), _bits(w_)), (n_case, name)
            _check(tuple(got[:3]) if mode == 1 else (*got[:2], None), row, a, k)
    finally:
        PNR._plan.cache_clear()
        RRN._plan.cache_clear()


def test_residual_join_reference_and_errors():
    """The reference's join is post_norm_residual's reference then the routing on its h; a
    residual of another shape or norm weights of another width are caller errors."""
    y, residual, a, k, _ = _join_inputs(1)
    with mx.stream(mx.cpu):
        got = R.moe_router_reference(y, k=k, residual=residual, **a)
        h, n = PNR.post_norm_residual_reference(*residual[:1], y, *residual[1:], a["eps"])
        want = (*R.moe_router_reference(h, k=k, **a), h, n)
    for g_, w_ in zip(got, want):
        assert mx.array_equal(g_, w_)
    y, residual2, a2, k, _ = _join_inputs(1, 2)
    with mx.stream(mx.cpu):
        got = R.moe_router_reference(y, k=k, residual=residual2, **a2)
        h, n = RRN.residual_rms_norm_reference(residual2[0], y, residual2[1], a2["eps"])
        want = (*R.moe_router_reference(n, k=k, **a2), h, n)
    for g_, w_ in zip(got, want):
        assert (g_ is None) == (w_ is None) and (w_ is None or mx.array_equal(g_, w_))
    res, res_w, res_next_w = residual
    with pytest.raises(InvalidArgumentError):
        R.moe_router(y, k=k, residual=(res[:1], res_w, res_next_w), **a)
    with pytest.raises(WeightMismatchError):
        R.moe_router(y, k=k, residual=(res, res_w[:-1], res_next_w), **a)


@needs_gxx
def test_split_ties_and_nan_rows_on_the_emulator(monkeypatch):
    """Integer logits full of ties broken by the lower index, and a NaN row (NaN weights, ids
    past the last expert), with G = 4 and G = 32 threadgroups per row of 33 experts (one
    with a single expert, the last ones empty): as the reference."""
    rng = np.random.default_rng(7)
    D, E, k = 77, 33, 4  # _SPLIT_CASES[3]'s instantiations
    x = mx.array(rng.integers(-2, 3, (6, D)).astype(np.float32))
    x = mx.where(mx.arange(6)[:, None] == 4, mx.nan, x)
    w = mx.array(rng.integers(-1, 2, (E, D)).astype(np.float32))
    r_ids, r_wts, _ = R.moe_router_reference(x, w, k)
    lg = np.array(x @ w.T)
    assert any(len(set(np.sort(row)[-k - 1 :])) <= k for row in lg[:4]), "no tie at the boundary"
    monkeypatch.setattr(R._kernel.__class__, "launcher", kernel_emulator.kernel_launcher)
    keep = mx.array([0, 1, 2, 3, 5])
    for n, sp in enumerate((4, 32)):
        monkeypatch.setenv("HF2Q_EMU_SHUFFLE", str(100 + n))
        ids, wts, _ = R.moe_router_kernel(x, w, k, split=sp)
        assert np.isnan(np.array(wts[4])).all() and (np.array(ids[4]) >= E).all()
        assert mx.array_equal(ids[keep], r_ids[keep])
        assert mx.allclose(wts[keep], r_wts[keep], atol=FP32_TOL)


@needs_gxx
def test_split_counter_wraps_on_the_emulator(monkeypatch):
    """The rows' counts are never reset: a launch adds G to each, and the last group is the one
    whose ticket is G - 1 modulo G, also across the uint32 wrap (G a power of two)."""
    kind, dt, wdt, rows, D, E, k, _ = _SPLIT_CASES[3]
    a = _args(kind, D, E, dt, wdt, seed=9)
    x = _x(rows, D, dt, seed=9)
    monkeypatch.setattr(R._kernel.__class__, "launcher", kernel_emulator.kernel_launcher)
    want = R.moe_router_kernel(x, k=k, split=1, **a)
    plan = R._plan(x, a["w"], k, a, None, 4)
    n = R.COUNTER_SETS * R.MAX_ROWS
    assert plan.counter.shape == (n,) and plan.counter.dtype == mx.uint32
    assert not np.array(plan.counter).any()  # a fresh plan starts at zero
    # any multiple of G; 2 and 1 launches to go before the wrap; sets 0, 1, 2 in turn
    for turn, start in enumerate((4 * 12345, 2**32 - 8, 2**32 - 4)):
        c = np.zeros(n, dtype=np.uint32)
        c[turn * R.MAX_ROWS : (turn + 1) * R.MAX_ROWS] = start
        plan.counter = mx.array(c)
        assert plan.turn == turn
        got = R._run(plan, x, a["w"], a)
        assert all(mx.array_equal(g_, w_) for g_, w_ in zip(got[:2], want[:2])), start


@needs_gxx
def test_split_dispatcher_on_the_emulator(monkeypatch):
    """The dispatcher splits a wide router (Qwen's 64 experts x 2064 here: G = 8) in one
    launch, rotating its counter sets; HF2Q_ROUTER_SPLIT=0's switch sends it to one group per
    row, same outputs."""
    kind, dt, wdt, rows, D, E, k, _ = _SPLIT_CASES[4]
    monkeypatch.setattr(R, "SPLIT", True)
    assert R.split_config(rows, E, D) == (8, 8)
    a = _args(kind, D, E, dt, wdt, seed=11)
    x = _x(rows, D, dt, seed=11)
    monkeypatch.setattr(R, "backend", lambda: "cuda")
    outs = []
    for split in (True, False):
        emu = Emulated(R._kernel)
        monkeypatch.setattr(R, "_kernel", emu)
        monkeypatch.setattr(R, "_PLANS", {})
        monkeypatch.setattr(R, "SPLIT", split)
        monkeypatch.setenv("HF2Q_EMU_SHUFFLE", "3")
        outs.append(R.moe_router(x, a["w"], k, renormalize=False))
        assert emu.launches == 1
        (plan,) = R._PLANS.values()
        # a split plan's calls take its counter sets in turn (params[2]); G = 1 needs one
        assert len(plan.params) == (R.COUNTER_SETS if split else 1) and plan.turn == int(split)
        assert [float(p[2]) for p in plan.params[:3]] == [0.0, 1.0, 2.0][: len(plan.params)]
        monkeypatch.setattr(R, "_kernel", emu.kernel)
    _check(outs[0], x, a, k)
    assert all(mx.array_equal(p, q) for p, q in zip(outs[0][:2], outs[1][:2]))


@needs_gxx
@pytest.mark.parametrize("shape", ["gemma4", "qwen3_5"])
def test_split_at_the_models_shapes_on_the_emulator(shape, monkeypatch):
    """Gemma-4-26B-A4B's router (bf16, pre-norm, expert scale, post-norm; G = 16) and
    Qwen3.5-35B-A3B's (fp32 weight under bf16 x; G = 32) split as the dispatcher splits them:
    the one-group-per-row outputs bit for bit."""
    kind, D, E, k, dt, wdt, rows = {
        "gemma4": ("gemma", 2816, 128, 8, mx.bfloat16, mx.bfloat16, 2),
        "qwen3_5": ("qwen", 2048, 256, 8, mx.bfloat16, mx.float32, 1),
    }[shape]
    a = _args(kind, D, E, dt, wdt, seed=12)
    x = _x(rows, D, dt, seed=12)
    monkeypatch.setattr(R, "SPLIT", True)
    split = R.split_config(rows, E, D)
    assert split == (E // R.SPLIT_WARPS, R.SPLIT_WARPS)
    monkeypatch.setattr(R._kernel.__class__, "launcher", kernel_emulator.kernel_launcher)
    monkeypatch.setenv("HF2Q_EMU_SHUFFLE", "5")
    got = R.moe_router_kernel(x, k=k, split=split, **a)
    want = R.moe_router_kernel(x, k=k, split=1, **a)
    _check(got, x, a, k)
    assert all(np.array_equal(_bits(p), _bits(q)) for p, q in zip(got, want) if q is not None)


# ---------------------------------------------------------------------------------------------
# GPU: the models' shapes, outputs poisoned with NaN

# (kind, rows, D, E, k): Gemma-4-26B-A4B, Qwen3.5-35B-A3B, and odd tiny ones
GPU_SHAPES = [
    ("gemma", 1, 2816, 128, 8),
    ("gemma", 32, 2816, 128, 8),
    ("qwen", 1, 2048, 256, 8),
    ("qwen", 17, 2048, 256, 8),
    ("qwen_full", 3, 200, 67, 5),
    ("gemma", 5, 264, 33, 1),
    ("gemma_q8", 1, 2816, 128, 8),  # the 8-bit routers of the MLX 4-bit benches
    ("qwen_q8", 8, 2048, 256, 8),
    ("qwen_full_q4", 3, 256, 40, 4),
]


@requires_gpu
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("kind,rows,D,E,k", GPU_SHAPES, ids=lambda v: str(v))
def test_gpu_kernel_matches_reference(kind, rows, D, E, k, dtype):
    a = _args(kind, D, E, dtype, dtype, seed=rows + E)
    x = _x(rows, D, dtype, seed=rows + D)
    got = R.moe_router_kernel(x, k=k, init_value=float("nan"), **a)
    mx.eval(got[:2] if got[2] is None else got)
    _check(got, x, a, k)


@requires_gpu
def test_gpu_dispatcher_mixed_dtypes():
    """An fp32 router weight under bf16 x (a GGUF's F32 router in a bf16 model): fp32 logits."""
    a = _args("qwen", 2048, 256, mx.bfloat16, mx.float32, seed=3)
    x = _x(4, 2048, mx.bfloat16, seed=4)
    _check(R.moe_router(x, k=8, **a), x, a, 8)


@requires_gpu
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("kind,rows,D,E,k", GPU_SHAPES, ids=lambda v: str(v))
def test_gpu_split_matches_one_group_per_row(kind, rows, D, E, k, dtype):
    """The split mapping (the dispatcher's G, and G = 2 and 16 where E allows) against G = 1 on
    the GPU: bit for bit (the same per-logit SIMD-group sums, norm statistics and top-k code),
    outputs poisoned with NaN first."""
    a = _args(kind, D, E, dtype, dtype, seed=rows + E + 1)
    x = _x(rows, D, dtype, seed=rows + D + 1)
    base = R.moe_router_kernel(x, k=k, split=1, init_value=float("nan"), **a)
    mx.eval([o for o in base if o is not None])
    _check(base, x, a, k)
    auto = R.split_config(rows, E, D)
    for split in {auto, *(g for g in (2, 16) if g <= E)}:
        got = R.moe_router_kernel(x, k=k, split=split, init_value=float("nan"), **a)
        mx.eval([o for o in got if o is not None])
        for p, q in zip(got, base):
            if q is not None:
                assert np.array_equal(_bits(p), _bits(q)), (split, p, q)


@requires_gpu
@pytest.mark.parametrize("kind", ["gemma", "qwen_q8"])
def test_gpu_split_in_a_dependent_chain(kind, monkeypatch):
    """A decode's pattern: 30 dependent router calls of one plan in one graph, each x made from
    the previous call's outputs, as G = 1 computes them; afterwards each call's counter set
    (one per call, in turn) holds G for each row (never reset: a multiple of G), the rest 0."""
    D, E, k, rows = (2816, 128, 8, 3) if kind == "gemma" else (2048, 256, 8, 5)
    a = _args(kind, D, E, mx.bfloat16, mx.bfloat16, seed=21)
    x0 = _x(rows, D, mx.bfloat16, seed=21)
    w = a.pop("w")
    monkeypatch.setattr(R, "SPLIT", True)  # off by default since session 12
    g = R.split_config(rows, E, D)[0]
    assert g > 1
    plans = {s: R._plan(x0, w, k, a, None, s) for s in (1, g)}
    outs = {}
    for s, plan in plans.items():
        x, seq = x0, []
        for _ in range(30):
            ids, wts, xn = R._run(plan, x, w, a)
            seq += [ids, wts]
            x = xn if xn is not None else x + (wts[:, :1] * 1e-2).astype(x.dtype)
        mx.eval(seq, x)
        outs[s] = seq
    assert all(mx.array_equal(p, q).item() for p, q in zip(outs[g], outs[1]))
    mx.synchronize()
    count = np.array(plans[g].counter).reshape(R.COUNTER_SETS, R.MAX_ROWS)
    assert (count[:30, :rows] == g).all(), count[:30]  # one set per call, in turn
    assert not count[:, rows:].any() and not count[30:].any()


# ---------------------------------------------------------------------------------------------
# Whole tiny models: every MoE kernel on the emulator at once

S_, F_ = "sliding_attention", "full_attention"
TINY_MOE = {
    "gemma4": (gemma4, dict(
        vocab_size=96, hidden_size=256, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, global_head_dim=64,
        sliding_window=4, layer_types=[S_, F_], enable_moe_block=True, num_experts=8,
        top_k_experts=3, moe_intermediate_size=64,
    )),
    "qwen3_5_moe": (qwen3_5_moe, dict(
        vocab_size=96, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=6, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0,
                         "partial_rotary_factor": 0.25},
        num_hidden_layers=2, full_attention_interval=2, num_experts=8, num_experts_per_tok=3,
        moe_intermediate_size=64, shared_expert_intermediate_size=64,
    )),
}  # fmt: skip


def _tiny_ggml_moe(name: str):
    """The tiny model, every parameter random; experts as GGML blocks (gate/up Q4_K, down
    Q5_0: its 64-wide rows are no K-quant super-block), as a GGUF of them loads."""
    module, cfg = TINY_MOE[name]
    model = module.Model(module.ModelArgs.from_dict(cfg))
    params = []
    for i, (key, p) in enumerate(tree_flatten(model.parameters())):
        k = mx.random.key(i)
        if p.ndim == 1 or key.endswith("layer_scalar"):
            params.append((key, 0.75 + 0.5 * mx.random.uniform(shape=p.shape, key=k)))
        else:
            params.append((key, mx.random.normal(p.shape, key=k) / p.shape[-1] ** 0.5))
    model.update(tree_unflatten(params))
    modules = dict(model.named_modules())
    for i, (path, m) in enumerate(list(modules.items())):
        if isinstance(m, ExpertLinear):
            t = GT.Q4_K if m.in_features % 256 == 0 else GT.Q5_0
            g = m.to_ggml(t)
            E, N, _ = g.weight.shape
            raw = random_ggml_blocks(E * N, m.in_features, t, seed=i, scale=0.002)
            g.weight = raw.reshape(g.weight.shape)
            *parent, last = path.split(".")
            modules[".".join(parent)][last] = g
    mx.eval(model.parameters())
    return model


@needs_gxx
@pytest.mark.parametrize("name", list(TINY_MOE))
def test_tiny_moe_model_with_every_moe_kernel(name, monkeypatch):
    """Prefill then decode with the router, gate/up and down kernels on the emulator (every
    other dispatcher on its reference; the down: its slot-parallel form, the CUDA default): one
    launch of each per MoE layer and call, the logits of the reference path to fp32 noise."""
    from hf2q_mlx.custom_kernels import expert_down, expert_glu

    tokens = mx.array([[5, 7, 9, 11]])

    def run(model):
        cache = model.make_cache()
        return mx.concatenate([model(tokens[:, :3], cache), model(tokens[:, 3:], cache)], 1)

    with mx.stream(mx.cpu):
        model = _tiny_ggml_moe(name)
        want = run(model)
        for info in pkgutil.iter_modules(ck.__path__):
            mod = importlib.import_module(f"{ck.__name__}.{info.name}")
            if mod not in (R, expert_glu, expert_down) and hasattr(mod, "backend"):
                monkeypatch.setattr(mod, "backend", lambda: None)
        monkeypatch.setattr(ck, "_gpu", ("cuda", mx.default_device(), mx.default_device))
        emus = [Emulated(R._kernel), Emulated(expert_glu._KERNELS[GT.Q4_K]),
                Emulated(expert_down._SLOT_KERNELS[GT.Q5_0])]  # fmt: skip
        monkeypatch.setattr(R, "_kernel", emus[0])
        monkeypatch.setitem(expert_glu._KERNELS, GT.Q4_K, emus[1])
        monkeypatch.setitem(expert_down._SLOT_KERNELS, GT.Q5_0, emus[2])
        monkeypatch.setattr(expert_down, "SLOT_TEAMS", "auto")
        for mod in (R, expert_glu, expert_down):
            monkeypatch.setattr(mod, "_PLANS" if mod is R else "_CALLS", {})
        got = run(model)
    assert [e.launches for e in emus] == [4, 4, 4]  # 2 MoE layers x 2 calls
    ref = np.array(want)
    assert np.abs(np.array(got) - ref).max() <= 1e-5 * np.abs(ref).max()


@requires_gpu
@pytest.mark.parametrize("rows", [1, 8, 32])
@pytest.mark.parametrize("wdt", [mx.float32, mx.bfloat16], ids=["w_f32", "w_bf16"])
def test_gpu_batched_prologue_and_join_keep_the_bits(rows, wdt, monkeypatch):
    """On the GPU at 26B-A4B's router (2816 -> 128, top 8; the GGUF's fp32 rows or bf16):
    the row loaded in one round gives the loop form's outputs bit for bit, and the router
    with the block join gives post_norm_residual's kernel's h and n and the router kernel's
    outputs on that h bit for bit; every output poisoned with NaN first."""
    D, E, k = 2816, 128, 8
    a = _args("gemma", D, E, mx.bfloat16, wdt, seed=rows + 90)
    keys = mx.random.split(mx.random.key(rows + 91), 3)
    res = (4 * mx.random.normal((rows, D), key=keys[0])).astype(mx.bfloat16)
    y = mx.random.normal((rows, D), key=keys[1]).astype(mx.bfloat16)
    res_w, res_next_w = (0.5 + mx.random.uniform(shape=(2, D), key=keys[2])).astype(mx.bfloat16)
    h, n = PNR.post_norm_residual(res, y, res_w, res_next_w, a["eps"])
    mx.eval(h, n)

    def launch(x, opts, batched):
        monkeypatch.setattr(R, "BATCHED_PROLOGUE", batched)
        plan = R._plan(x, opts["w"], k, opts, float("nan"), None)
        out = plan.launch(inputs=[*R._arrays(x, opts["w"], opts), plan.params[0], plan.counter])
        mx.eval(out)
        return out

    loop = launch(h, a, False)
    batched = launch(h, a, True)
    joined = launch(y, dict(a, residual=(res, res_w, res_next_w)), True)
    _check(tuple(batched[:3]), h, a, k)
    for i in range(4):  # ids, weights, xn, split logits
        assert np.array_equal(_bits(batched[i]), _bits(loop[i])), i
        assert np.array_equal(_bits(joined[i]), _bits(batched[i])), i
    assert np.array_equal(_bits(joined[4]), _bits(h)) and np.array_equal(_bits(joined[5]), _bits(n))


@requires_gpu
@pytest.mark.parametrize("rows", [1, 8, 32])
def test_gpu_qwen_join_keeps_the_bits(rows, monkeypatch):
    """On the GPU at 35B-A3B's router (2048 -> 256, top 8, bf16): the router with Qwen's
    residual add and norm gives residual_rms_norm's kernel's h and n and the router kernel's
    outputs on that n bit for bit; outputs poisoned with NaN first."""
    D, E, k = 2048, 256, 8
    a = dict(_args("qwen", D, E, mx.bfloat16, mx.bfloat16, seed=rows + 95), eps=1e-6)
    keys = mx.random.split(mx.random.key(rows + 96), 3)
    res = (4 * mx.random.normal((rows, D), key=keys[0])).astype(mx.bfloat16)
    y = mx.random.normal((rows, D), key=keys[1]).astype(mx.bfloat16)
    res_w = (0.5 + mx.random.uniform(shape=(D,), key=keys[2])).astype(mx.bfloat16)
    h, n = RRN.residual_rms_norm(res, y, res_w, a["eps"])
    mx.eval(h, n)

    def launch(x, opts):
        plan = R._plan(x, opts["w"], k, opts, float("nan"), None)
        out = plan.launch(inputs=[*R._arrays(x, opts["w"], opts), plan.params[0], plan.counter])
        mx.eval(out)
        return out

    separate = launch(n, a)
    joined = launch(y, dict(a, residual=(res, res_w, None)))
    _check((*separate[:2], None), n, a, k)
    for i in (0, 1, 3):  # ids, weights, split logits
        assert np.array_equal(_bits(joined[i]), _bits(separate[i])), i
    assert np.array_equal(_bits(joined[4]), _bits(h)) and np.array_equal(_bits(joined[5]), _bits(n))


def test_join_switch(monkeypatch):
    """HF2Q_ROUTER_JOIN: auto joins Qwen 3.5's residual norm only, 1 both, 0 neither; another
    value is a caller error."""
    for value, want in (("auto", (False, True)), ("1", (True, True)), ("0", (False, False))):
        monkeypatch.setattr(R, "JOIN", value)
        assert (R.join_enabled("post_norm"), R.join_enabled("residual")) == want
    monkeypatch.setattr(R, "JOIN", "yes")
    with pytest.raises(InvalidArgumentError, match="HF2Q_ROUTER_JOIN"):
        R.join_enabled("residual")
