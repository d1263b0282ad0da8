"""The tensor-core GGML mat-vec (qmatmul_mma): its logic on the CPU emulator (the portable warp
mma), row parity (each row's bits the same at any M and whatever the other rows hold), the
dispatcher's choice, and the same checks on the GPU on real shapes."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import kernel_emulator
import mlx.core as mx
import numpy as np
import pytest
from conftest import requires_gpu
from gguf import GGMLQuantizationType as T
from test_qmatmul import _check, _weight, _x

from hf2q_mlx.custom_kernels import backend
from hf2q_mlx.custom_kernels import qmatmul as Q
from hf2q_mlx.custom_kernels import qmatmul_mma as MM
from hf2q_mlx.custom_kernels._render import Example, Kernel
from hf2q_mlx.custom_kernels.ggml_formats import BLOCK_FORMATS
from hf2q_mlx.errors import InvalidArgumentError

# every type with a decoder, in the order they were GPU-verified (the mat-vec: all of them)
TYPES = [T.Q4_K, T.Q6_K, T.Q5_0, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_1, T.Q5_K, T.Q3_K, T.Q2_K]
VERIFIED = TYPES  # qmatmul_mma.GPU_VERIFIED
NEW = TYPES[4:]  # the six verified later: fewer emulator row counts below (CI time)
QK = {t: BLOCK_FORMATS[t].block_size for t in TYPES}
MS = (1, 3, 8, 13, 16, 20, 32)  # one, two and four n-tiles, padding columns in some
N_EMU = 40  # not a multiple of 16: the last threadgroup has rows past N
# Tolerance (_check, bf16 x): the relative error at most twice that of the fp32 reference
# rounded to bf16. The kernel's own rounding sits far below the output's bf16 rounding (2^-9):
# exact weights and x, exact products, fp32 sums of 16 products, fp32 scale and accumulation.

needs_gxx = pytest.mark.skipif(not kernel_emulator.available(), reason="g++ is not installed")


def _k(t: int) -> int:
    """K for the emulator: 2 super-blocks (K-quants) or 3 blocks: short rows, fast fibers."""
    return 2 * QK[t] if QK[t] == 256 else 3 * QK[t]


# (type, M, K, config or None): every GPU-verified type at every M of MS with the default
# launch, the others at M = 1 and 13 (one and two n-tiles, padding columns in each: fewer
# emulator runs), then configurations with several SIMD groups, several runs each and a
# partial last run (four n-tiles too).
_CASES = [(t, m, _k(t), None) for t in TYPES for m in ((1, 13) if t in NEW else MS)] + [
    (T.Q4_K, 5, 3 * 256, {"NT": 1, "U": 1, "W": 2}),
    (T.Q6_K, 11, 3 * 256, {"NT": 2, "U": 2, "W": 2}),
    (T.Q8_0, 2, 13 * 32, {"NT": 1, "U": 2, "W": 3}),
    (T.Q5_0, 16, 13 * 32, {"NT": 2, "U": 3, "W": 2}),
    (T.Q6_K, 27, 3 * 256, {"NT": 4, "U": 2, "W": 2}),
]


def _example(t: int, m: int, k: int, cfg: dict | None) -> tuple[Kernel, Example]:
    cfg = cfg or MM.launch_config(t, m, N_EMU, k)
    rb = Q.row_bytes(t, k)
    ex = Example(
        {"x": (mx.bfloat16, m * k), "w": (mx.uint8, N_EMU * rb), "dims": (mx.int32, 3)},
        {"out": mx.bfloat16},
        {"T": mx.bfloat16, "NT": cfg["NT"], "U": cfg["U"], "PF": cfg.get("PF", 0),
         "XG": cfg.get("XG", 1)},
    )  # fmt: skip
    return MM._KERNELS[t], ex


@pytest.fixture(scope="module")
def emulated():
    """Build the binaries two at a time (g++ dominates), run every case once."""
    if not kernel_emulator.available():
        pytest.skip("g++ is not installed")
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda c: kernel_emulator.build(*_example(*c)), _CASES))
    mp = pytest.MonkeyPatch()
    mp.setattr(Kernel, "__call__", kernel_emulator.kernel_call)
    try:
        outs = {}
        for i, (t, m, k, cfg) in enumerate(_CASES):
            w, _ = _weight(t, N_EMU, k)
            outs[i] = MM.mma_matmul_kernel(_x(m, k, mx.bfloat16, 500 + i), w, t, k, config=cfg)
    finally:
        mp.undo()
    return outs


@pytest.mark.parametrize(
    "i", range(len(_CASES)), ids=[f"{T(c[0]).name}-M{c[1]}-K{c[2]}" for c in _CASES]
)
def test_emulator_matches_reference(emulated, i):
    """Within the bf16 bound of the fp32 reference; every output written (NaN-poisoned)."""
    t, m, k, _ = _CASES[i]
    _check(emulated[i], _x(m, k, mx.bfloat16, 500 + i), _weight(t, N_EMU, k)[1])


def _wild_rows(x: mx.array) -> mx.array:
    """x with every row but the first replaced by values that would poison a shared sum:
    inf, -inf, NaN, 1e38 and bf16 subnormals."""
    rng = np.random.default_rng(7)
    xn = np.array(x.astype(mx.float32))
    pool = np.array([np.inf, -np.inf, np.nan, 1e38, -1e38, 1e-39, 0.0], dtype=np.float32)
    xn[1:] = rng.choice(pool, size=xn[1:].shape)
    return mx.array(xn).astype(mx.bfloat16)


@needs_gxx
@pytest.mark.parametrize("ggml_type", TYPES, ids=[t.name for t in TYPES])
def test_emulator_rows_bit_identical_to_rows_alone(ggml_type, monkeypatch):
    """Row parity: at M = 2..32 each row has the bits it has alone (M = 1), and the first row
    keeps them at M = 32 when the other rows hold inf, NaN and huge values."""
    monkeypatch.setattr(Kernel, "__call__", kernel_emulator.kernel_call)
    t, k = ggml_type, _k(ggml_type)
    w, _ = _weight(t, N_EMU, k)
    x = _x(32, k, mx.bfloat16, seed=int(t) + 40)
    # Parity is the loop's, shared by every type: the types not yet run on a GPU check fewer
    # M (each n-tile count, full and partial) and rows (both halves of each n-tile's columns),
    # to keep the emulator time down. Four n-tiles (17..32, the same loop at another NT): the M
    # where a tile starts or ends, and both halves of tiles 2 and 3's columns.
    if t in VERIFIED:
        ms, rows = (*range(2, 18), 24, 25, 32), (*range(17), 23, 24, 31)
    else:
        ms, rows = (2, 8, 9, 16, 17, 32), (0, 1, 7, 8, 15, 16, 24, 31)
    alone = {i: MM.mma_matmul_kernel(x[i : i + 1], w, t, k)[0] for i in rows}
    assert not any(bool(mx.isnan(a).any()) for a in alone.values())
    for m in ms:
        y = MM.mma_matmul_kernel(x[:m], w, t, k)
        differ = [i for i in rows if i < m and not _same_bits(y[i], alone[i])]
        assert not differ, f"M = {m}: rows {differ} differ"
    y = MM.mma_matmul_kernel(_wild_rows(x), w, t, k)
    assert _same_bits(y[0], alone[0])


def _same_bits(a: mx.array, b: mx.array) -> bool:
    return bool(mx.array_equal(a.view(mx.uint16), b.view(mx.uint16)))


def test_streaming_variant_has_no_plain_weight_load():
    """S = 1's decoders read every weight byte through the streaming loads: no plain ld16 /
    ld32 / ld32u of p and no plain uint2 / uint4 cast of it is left, for every type."""
    import re

    plain = re.compile(r"\bld(16|32|32u)\(p,|DEVICE_CAST\(const uint[24]?, p[^)]*\)\[0\]")
    for t in TYPES:
        src = MM._STREAM_KERNELS[t].header("cuda")
        decoder = src[src.index("load_m_") :]
        assert not plain.search(decoder), T(t).name
        assert "ld32s(p" in decoder or "ld16s(p" in decoder or "load_stream(DEVICE_CAST" in decoder
        assert MM._STREAM_KERNELS[t].name != MM._KERNELS[t].name


# load variants that must not change a bit: streaming weight loads (S), loads a run ahead (PF),
# a block's x fragments loaded for all its scale groups at once (XG)
LOAD_VARIANTS = ({"S": 1}, {"PF": 1}, {"S": 1, "PF": 1}, {"XG": MM.X_ALL, "PF": 1})


@needs_gxx
@pytest.mark.parametrize("ggml_type", TYPES, ids=[t.name for t in TYPES])
def test_emulator_streaming_loads_give_the_same_bits(ggml_type, monkeypatch):
    """Config S = 1 (each decoder's weight loads rewritten as streaming loads: another load
    instruction, the same bytes) gives the default kernel's bits, every output written
    (NaN-poisoned first)."""
    monkeypatch.setattr(Kernel, "__call__", kernel_emulator.kernel_call)
    t, k = ggml_type, _k(ggml_type)
    w, _ = _weight(t, N_EMU, k)
    x = _x(1, k, mx.bfloat16, seed=int(t) + 91)
    cfg = MM.launch_config(t, 1, N_EMU, k)
    plain = MM.mma_matmul_kernel(x, w, t, k, config=cfg)
    y = MM.mma_matmul_kernel(x, w, t, k, config={**cfg, "S": 1}, init_value=float("nan"))
    assert _same_bits(y, plain)


@needs_gxx
@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q8_0], ids=["Q4_K", "Q8_0"])
def test_emulator_loads_a_run_ahead_give_the_same_bits(ggml_type, monkeypatch):
    """PF = 1 (each run's loads a run ahead: the same math in the same order; the loop's, not
    a decoder's, so two block sizes) alone and with S = 1 gives the default's bits, every
    output written: M = 1 and 13, the default launch and U = 1 over three SIMD groups, on 8
    blocks a row (several runs per SIMD group, so a run's loads are handed over)."""
    monkeypatch.setattr(Kernel, "__call__", kernel_emulator.kernel_call)
    t, k = ggml_type, 8 * QK[ggml_type]
    w, _ = _weight(t, N_EMU, k)
    for m in (1, 13):
        x = _x(m, k, mx.bfloat16, seed=int(t) + 90 + m)
        for cfg in (MM.launch_config(t, m, N_EMU, k), {"NT": 2, "U": 1, "W": 3}):
            plain = MM.mma_matmul_kernel(x, w, t, k, config=cfg)
            for var in LOAD_VARIANTS[1:]:
                nan = float("nan")
                y = MM.mma_matmul_kernel(x, w, t, k, config={**cfg, **var}, init_value=nan)
                assert _same_bits(y, plain), f"M = {m} {cfg} {var}"


@needs_gxx
@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q6_K, T.Q5_0], ids=["Q4_K", "Q6_K", "Q5_0"])
def test_emulator_x_loads_together_give_the_same_bits(ggml_type, monkeypatch):
    """XG (HF2Q_MMA_XG: a block's x fragments for XG scale groups loaded before their mmas)
    gives XG = 1's bits, every output written: 8, 16 and 1 groups a block (Q4_K, Q6_K, Q5_0),
    XG 2 and 16 (16 past Q4_K's 8 and Q5_0's 1: clamped), M = 1 and 13 (a padding n-tile)."""
    monkeypatch.setattr(Kernel, "__call__", kernel_emulator.kernel_call)
    t, k = ggml_type, 2 * QK[ggml_type] if QK[ggml_type] == 256 else 8 * QK[ggml_type]
    w, _ = _weight(t, N_EMU, k)
    for m in (1, 13):
        x = _x(m, k, mx.bfloat16, seed=int(t) + 70 + m)
        cfg = MM.launch_config(t, m, N_EMU, k)
        plain = MM.mma_matmul_kernel(x, w, t, k, config={**cfg, "XG": 1})
        for xg in (2, 16):
            nan = float("nan")
            y = MM.mma_matmul_kernel(x, w, t, k, config={**cfg, "XG": xg}, init_value=nan)
            assert _same_bits(y, plain), f"M = {m} XG = {xg}"


def test_dense_x_groups_default(monkeypatch):
    """HF2Q_MMA_XG unset: the dense mat-vec and GLU take DENSE_XG at one n-tile (M <= 8), the
    loop's default at more n-tiles and in the grouped expert kernels; set, its value everywhere
    (LOADS)."""
    from hf2q_mlx.custom_kernels import expert_mma as E

    monkeypatch.setattr(MM, "_XG_SET", False)
    monkeypatch.setattr(MM, "LOADS", {})
    for m in (1, 8, 9, 32):
        want = MM.DENSE_XG if m <= 8 else None
        assert MM.launch_config(T.Q4_K, m, 4096, 4096).get("XG") == want
        assert MM.glu_launch_config(T.Q6_K, m, 2816, 2816).get("XG") == want
    assert "XG" not in E.grouped_config(T.Q4_K, 2816)
    monkeypatch.setattr(MM, "_XG_SET", True)
    monkeypatch.setattr(MM, "LOADS", {"XG": 4})
    assert MM.launch_config(T.Q4_K, 1, 4096, 4096)["XG"] == 4
    assert E.grouped_config(T.Q4_K, 2816)["XG"] == 4
    monkeypatch.setattr(MM, "LOADS", {})  # HF2Q_MMA_XG=1
    assert "XG" not in MM.launch_config(T.Q4_K, 1, 4096, 4096)


def test_x_groups_setting(monkeypatch):
    """HF2Q_MMA_XG: unset 1; a power of 2 up to X_ALL; else an InvalidArgumentError naming it."""
    monkeypatch.delenv("HF2Q_MMA_XG", raising=False)
    assert MM.x_groups() == 1
    assert [MM.x_groups(v) for v in ("1", " 4 ", "16")] == [1, 4, 16]
    for bad in ("3", "0", "32", "x"):
        with pytest.raises(InvalidArgumentError, match="HF2Q_MMA_XG"):
            MM.x_groups(bad)
    monkeypatch.setenv("HF2Q_MMA_XG", "8")
    assert MM.x_groups() == 8


@pytest.fixture
def cuda_launches(monkeypatch) -> list[str]:
    """ggml_matmul on a faked CUDA back end, every launch run by the emulator: the names of the
    kernels launched, in order (plans cached per call shape start empty)."""
    launched: list[str] = []

    def launcher(self, input_dtypes, **launch):
        run = kernel_emulator.kernel_launcher(self, input_dtypes, **launch)
        return lambda inputs: launched.append(self.name) or run(inputs)

    monkeypatch.setattr(Q, "backend", lambda: "cuda")
    monkeypatch.setattr(Kernel, "launcher", launcher)
    monkeypatch.setattr(Q, "_CALLS", {})
    return launched


@needs_gxx
def test_dispatcher_routes_bf16_to_mma_on_cuda_only(monkeypatch, cuda_launches):
    """CUDA + bf16 x + a covered type: the mma kernel at M = 1 and M > 1 (batch dims kept);
    ENABLED = False, fp16 x, an uncovered type or Metal: the scalar kernels."""
    launched = cuda_launches
    monkeypatch.setattr(MM, "GPU_VERIFIED", frozenset(TYPES) - {T.Q4_0})  # Q4_0: uncovered
    t, k = T.Q8_0, _k(T.Q8_0)
    w, wf = _weight(t, N_EMU, k)
    x = _x(3, k, mx.bfloat16, seed=9)
    y1 = Q.ggml_matmul(x[:1], w, t, k)
    y3 = Q.ggml_matmul(x.reshape(1, 3, k), w, t, k)
    assert launched == [MM.kernel_name(t)] * 2 and y3.shape == (1, 3, N_EMU)
    _check(y3.reshape(3, N_EMU), x, wf)
    assert bool(mx.array_equal(y1[0], y3[0, 0]))
    launched.clear()
    monkeypatch.setattr(MM, "ENABLED", False)
    Q.ggml_matmul(x, w, t, k)
    monkeypatch.setattr(MM, "ENABLED", True)
    Q.ggml_matmul(x.astype(mx.float16), w, t, k)
    w4, _ = _weight(T.Q4_0, N_EMU, 96)
    Q.ggml_matmul(_x(3, 96, mx.bfloat16, seed=10), w4, T.Q4_0, 96)
    monkeypatch.setattr(Q, "backend", lambda: "metal")
    Q.ggml_matmul(x[:2], w, t, k)
    assert not any(n.startswith("ggml_qmv_mma") for n in launched) and len(launched) == 4


def test_dispatch_gate_defaults_to_the_gpu_verified_types(monkeypatch):
    """supports() (what the dispatchers ask) holds for GPU_VERIFIED only unless ALL_TYPES
    (HF2Q_MMA=all); has_kernel (what the kernel functions accept) for every decoder's type."""
    assert set(MM.GPU_VERIFIED) == set(VERIFIED) and set(MM.MMA_TYPES) == set(TYPES)
    assert MM.switches("1") == (True, False) and MM.switches("0") == (False, False)
    assert MM.switches(" All ") == (True, True)
    monkeypatch.setattr(MM, "ALL_TYPES", False)
    for t in TYPES:
        assert MM.has_kernel(t, mx.bfloat16) and not MM.has_kernel(t, mx.float16)
        assert MM.supports(t, mx.bfloat16) == (t in VERIFIED), T(t).name
    monkeypatch.setattr(MM, "ALL_TYPES", True)
    assert all(MM.supports(t, mx.bfloat16) for t in TYPES)
    assert not MM.supports(T.Q4_K, mx.float16) and not MM.supports(T.F16, mx.bfloat16)


@needs_gxx
def test_dispatcher_takes_unverified_types_only_when_opted_in(monkeypatch, cuda_launches):
    """CUDA, bf16 x of a type with a decoder but not GPU-verified (Q4_0, taken out of
    GPU_VERIFIED here: every decoder has passed since): the scalar kernel by default, the mma
    kernel with ALL_TYPES; both within the bf16 bound."""
    launched = cuda_launches
    monkeypatch.setattr(MM, "ALL_TYPES", False)
    monkeypatch.setattr(MM, "GPU_VERIFIED", frozenset(TYPES) - {T.Q4_0})
    t, k = T.Q4_0, _k(T.Q4_0)
    w, wf = _weight(t, N_EMU, k)
    x = _x(3, k, mx.bfloat16, seed=11)
    _check(Q.ggml_matmul(x, w, t, k), x, wf)
    monkeypatch.setattr(MM, "ALL_TYPES", True)
    monkeypatch.setattr(Q, "_CALLS", {})  # plans are cached per call shape, not per ALL_TYPES
    _check(Q.ggml_matmul(x, w, t, k), x, wf)
    assert len(launched) == 2 and not launched[0].startswith("ggml_qmv_mma")
    assert launched[1] == MM.kernel_name(t)


def test_load_flags_from_the_environment_value(monkeypatch):
    assert MM.load_flags("") == {}
    assert MM.load_flags("s") == {"S": 1}
    assert MM.load_flags(" PS ") == {"S": 1, "PF": 1}
    with pytest.raises(InvalidArgumentError, match="HF2Q_MMA_LOADS"):
        MM.load_flags("sx")
    # the process's flags go into every launch (mat-vec and GLU); none by default (past one
    # n-tile: at one, DENSE_XG, test_dense_x_groups_default)
    monkeypatch.setattr(MM, "LOADS", {})
    assert set(MM.launch_config(T.Q4_K, 9, 4096, 4096)) == {"NT", "U", "W"}
    monkeypatch.setattr(MM, "LOADS", {"XG": 4})
    assert MM.launch_config(T.Q4_K, 1, 4096, 4096)["XG"] == 4
    monkeypatch.setattr(MM, "LOADS", {"PF": 1})
    assert MM.launch_config(T.Q4_K, 1, 4096, 4096)["PF"] == 1
    assert MM.glu_launch_config(T.Q4_K, 8, 4096, 4096)["PF"] == 1
    # and the dispatcher's plan takes them: s the streaming-load kernel, p the template value
    monkeypatch.setattr(MM, "LOADS", {"S": 1, "PF": 1})
    plan = MM.dispatch_plan(T.Q4_K, 1, 64, 256)
    assert plan.kernel is MM._STREAM_KERNELS[T.Q4_K] and dict(plan.template)["PF"] == 1


def test_min_blocks_puts_launch_bounds_on_the_cubins_only(monkeypatch):
    """HF2Q_MMA_MIN_BLOCKS: unset, no bounds; 3, every mat-vec plan's template asks nvcc for 3
    threadgroups of its W SIMD groups (our unit gets ``__launch_bounds__``, MLX's cuda_kernel
    source none: it is not ours to bound); a bad value is an InvalidArgumentError naming it at
    the first plan."""
    monkeypatch.setattr(MM, "SPLIT_K_RAW", "1")  # one launch at 31B's down shape
    monkeypatch.setattr(MM, "MIN_BLOCKS_RAW", "")
    assert "LB_MIN_BLOCKS" not in dict(MM.dispatch_plan(T.Q4_K, 1, 5376, 21504).template)
    monkeypatch.setattr(MM, "MIN_BLOCKS_RAW", " 3 ")
    plan = MM.dispatch_plan(T.Q4_K, 1, 5376, 21504)
    w = MM.launch_config(T.Q4_K, 1, 5376, 21504)["W"]
    tmpl = dict(plan.template)
    assert tmpl["LB_MIN_BLOCKS"] == 3 and tmpl["LB_THREADS"] == 32 * w == plan.threadgroup[0]
    dts = [mx.bfloat16, mx.uint8, mx.int32]
    _, unit = plan.kernel.precompiled_unit(dts, (), [mx.bfloat16], tmpl, "sig", 0)
    assert f"__launch_bounds__({32 * w}, 3)" in unit
    ex = plan.kernel.examples[0]
    bounded = Example(ex.inputs, ex.outputs, {**ex.template, "LB_THREADS": 256, "LB_MIN_BLOCKS": 3})
    assert "__launch_bounds__" not in plan.kernel.render("cuda", bounded)
    assert "__launch_bounds__(256, 3)" in plan.kernel.render("cuda", bounded, precompiled=True)
    for bad in ("0", "9", "x", "2.5"):
        monkeypatch.setattr(MM, "MIN_BLOCKS_RAW", bad)
        with pytest.raises(InvalidArgumentError, match="HF2Q_MMA_MIN_BLOCKS"):
            MM.dispatch_plan(T.Q4_K, 1, 64, 256)


# (type, K, KS) of the emulated split tests: 13 Q8_0 blocks split 4, 4, 5
SPLIT_CASES = pytest.mark.parametrize(
    "ggml_type,k,ks",
    [(T.Q4_K, 3 * 256, 3), (T.Q8_0, 13 * 32, 3), (T.Q6_K, 4 * 256, 2)],
    ids=["Q4_K-KS3", "Q8_0-KS3-uneven", "Q6_K-KS2"],
)


@needs_gxx
@SPLIT_CASES
def test_emulator_split_k_matches_reference_and_rows_alone(ggml_type, k, ks, monkeypatch):
    """Config KS (HF2Q_MMA_SPLIT_K): each threadgroup sums one of KS splits of its rows' blocks
    (13 blocks in 3: 4, 4, 5), a second kernel adds them. Within the bf16 bound of the fp32
    reference at M = 1 and 13 with both launches' outputs NaN-poisoned (a split left unwritten,
    or one that sums blocks outside its range, fails), and each row's bits those it has alone."""
    monkeypatch.setattr(Kernel, "__call__", kernel_emulator.kernel_call)
    t = ggml_type
    w, wf = _weight(t, N_EMU, k)
    x = _x(13, k, mx.bfloat16, seed=int(t) + 90)
    nan = float("nan")
    base = MM.launch_config(t, 1, N_EMU, k)
    assert "KS" not in base  # HF2Q_MMA_SPLIT_K unset: no split
    for m in (1, 13):
        cfg = {**MM.launch_config(t, m, N_EMU, k), "KS": ks, "W": 2, "U": 1}
        plan = MM._plan(t, m, N_EMU, k, cfg)
        assert isinstance(plan, MM._SplitPlan) and plan.part.grid[0] == 3 * ks * 64
        y = MM.mma_matmul_kernel(x[:m], w, t, k, config=cfg, init_value=nan)
        _check(y, x[:m], wf)
        if m == 1:
            alone = y[0]
        else:
            assert _same_bits(y[0], alone)


@needs_gxx
@SPLIT_CASES
def test_emulator_fused_split_sum_gives_the_two_launch_bits(ggml_type, k, ks, monkeypatch):
    """Config SF = 1 (HF2Q_MMA_SPLIT_FUSED): the split's sum added by each tile's last
    threadgroup in one launch. Every element has the bits of the split kernel + sum kernel at
    M = 1 and 13 (N 40: a tile 8 rows short), outputs NaN-poisoned (a tile whose last
    threadgroup is not the one summing, or a sum missing a split, fails); successive calls
    rotate over the plan's counter sets. (The emulator hands each launch a fresh copy of the
    counters: that they return to zero is the GPU test's.)"""
    monkeypatch.setattr(Kernel, "__call__", kernel_emulator.kernel_call)
    t, nan = ggml_type, float("nan")
    w, wf = _weight(t, N_EMU, k)
    x = _x(13, k, mx.bfloat16, seed=int(t) + 50)
    for m in (1, 13):
        cfg = MM.with_split({**MM.launch_config(t, m, N_EMU, k), "W": 2, "U": 1}, t, k, ks)
        plan = MM._plan(t, m, N_EMU, k, {**cfg, "SF": 1})
        assert isinstance(plan, MM._FusedSplitPlan) and plan.plan.grid[0] == 3 * ks * 32 * cfg["W"]
        two = MM.mma_matmul_kernel(x[:m], w, t, k, config=cfg, init_value=nan)
        sets = len(plan.counted.sets)
        assert sets > 1
        for turn in range(2):
            fused = MM.mma_matmul_kernel(x[:m], w, t, k, config={**cfg, "SF": 1}, init_value=nan)
            _check(fused, x[:m], wf)
            assert _same_bits(fused, two), f"M = {m}, call {turn}"
        assert plan.counted.turn == 2 % sets


def _dispatch_with_switch(monkeypatch, cuda_launches, switch: str, k: int, kernel: dict):
    """ggml_matmul (Q4_K, N 24) at M = 1 and 5, then again with qmatmul_mma's ``switch`` set to
    "1": one launch a call of ``kernel_name(**kernel)``, within the bf16 bound, each row the
    bits it had without the switch."""
    t, n = T.Q4_K, 24
    w, wf = _weight(t, n, k)
    x = _x(5, k, mx.bfloat16, seed=k + 14)
    before = [Q.ggml_matmul(x[:m], w, t, k) for m in (1, 5)]
    monkeypatch.setattr(MM, switch, "1")
    monkeypatch.setattr(Q, "_CALLS", {})
    cuda_launches.clear()
    after = [Q.ggml_matmul(x[:m], w, t, k) for m in (1, 5)]
    assert cuda_launches == [MM.kernel_name(t, **kernel)] * 2
    _check(after[1], x, wf)
    assert all(_same_bits(a, b) for a, b in zip(after, before))


@needs_gxx
def test_dispatcher_runs_the_fused_split(monkeypatch, cuda_launches):
    """ggml_matmul with HF2Q_MMA_SPLIT_K=2 and HF2Q_MMA_SPLIT_FUSED=1: ONE launch (the fused
    kernel), the bits of the two-launch split at M = 1 and 5; a bad HF2Q_MMA_SPLIT_FUSED is an
    InvalidArgumentError naming it."""
    monkeypatch.setattr(MM, "SPLIT_K_RAW", "2")
    _dispatch_with_switch(monkeypatch, cuda_launches, "SPLIT_FUSED_RAW", 8 * 256, {"fused": True})
    for bad in ("2", "on"):
        with pytest.raises(InvalidArgumentError, match="HF2Q_MMA_SPLIT_FUSED"):
            MM.split_fused(bad)


def test_split_k_setting(monkeypatch):
    """HF2Q_MMA_SPLIT_K: 1, no split; unset, SPLIT_AUTO splits from K = SPLIT_MIN_K where the
    grid runs more than one wave (31B's o and down: yes; 26B-A4B's o, K 4,096: no; 9B's down,
    256 tiles: no); a value splits grids under SPLIT_TILES tiles
    (31B's N = 5,376: yes; its q | k | v N = 16,384: no), cut to SPLIT_MIN_BLOCKS blocks a
    split; the same KS and W at every M (row parity), W cut to a split's runs; a bad value is
    an InvalidArgumentError naming it."""
    assert MM.split_k(5376, 21504, 256, "") == MM.SPLIT_AUTO == 2
    assert MM.split_k(5376, MM.SPLIT_MIN_K, 256, "") == 2
    assert MM.split_k(2816, 4096, 256, "") == 1
    assert MM.split_k(16384, 21504, 256, "") == 1
    assert MM.split_k(4096, 12288, 256, "") == 1
    assert MM.split_k(4096, 12288, 256, "2") == 2
    assert MM.split_k(5376, 21504, 256, "1") == 1
    assert MM.split_k(5376, 21504, 256, "3") == 3
    assert MM.split_k(16384, 5376, 256, "3") == 1
    assert MM.split_k(5376, 8 * 256, 256, "3") == 2  # 8 blocks: two splits of 4
    assert MM.split_k(5376, 3 * 256, 256, "3") == 1
    for bad in ("0", "9", "x"):
        with pytest.raises(InvalidArgumentError, match="HF2Q_MMA_SPLIT_K"):
            MM.split_k(5376, 21504, 256, bad)
    monkeypatch.setattr(MM, "SPLIT_K_RAW", "3")
    cfgs = [MM.launch_config(T.Q4_K, m, 5376, 8192) for m in range(1, 33)]
    # 32 blocks: 10, 11, 11 a split; W 5, the smallest split's runs of U 2 (no idle SIMD group)
    assert {(c["KS"], c["U"], c["W"]) for c in cfgs} == {(3, 2, 5)}
    plan = MM.dispatch_plan(T.Q4_K, 1, 5376, 8192)
    assert isinstance(plan, MM._SplitPlan) and plan.part.output_shapes == [(3, 1, 5376)]
    plan.output_shapes = [(1, 1, 5376)]  # the dispatcher's batch dims land on the sum's output
    assert plan.sum.output_shapes == [(1, 1, 5376)]
    assert not isinstance(MM.dispatch_plan(T.Q4_K, 1, 16384, 5376), MM._SplitPlan)


@needs_gxx
def test_dispatcher_runs_the_split_and_its_sum(monkeypatch, cuda_launches):
    """ggml_matmul with HF2Q_MMA_SPLIT_K set: the split kernel, then the sum kernel, the result
    within the bf16 bound; M = 1 and 5 give row 0 the same bits."""
    monkeypatch.setattr(MM, "SPLIT_K_RAW", "2")
    t, n, k = T.Q4_K, 24, 8 * 256
    w, wf = _weight(t, n, k)
    x = _x(5, k, mx.bfloat16, seed=12)
    y1 = Q.ggml_matmul(x[:1], w, t, k)
    assert cuda_launches == [MM._SPLIT_KERNELS[t, False].name, MM._SUM_KERNEL.name]
    y5 = Q.ggml_matmul(x, w, t, k)
    _check(y5, x, wf)
    assert _same_bits(y5[0], y1[0])


@needs_gxx
@pytest.mark.parametrize(
    "ggml_type,k", [(T.Q4_K, 8 * 256), (T.Q8_0, 13 * 32), (T.Q6_K, 4 * 256)],
    ids=["Q4_K", "Q8_0", "Q6_K"],
)  # fmt: skip
def test_emulator_paired_rows_give_the_plain_bits(ggml_type, k, monkeypatch):
    """Config R = 2 (HF2Q_MMA_PAIRS): a threadgroup owns 16 rows of each half of the weight (N
    40: halves of 20, their second tiles 4 rows short). Every output element has the bits of
    the unpaired kernel at the same U and W, at M = 1 and 13, with the output NaN-poisoned (a
    half left unwritten, or written at the other half's rows, fails); split over K in 2 too,
    against the unpaired split."""
    monkeypatch.setattr(Kernel, "__call__", kernel_emulator.kernel_call)
    t, nan = ggml_type, float("nan")
    w, wf = _weight(t, N_EMU, k)
    x = _x(13, k, mx.bfloat16, seed=int(t) + 70)
    for m in (1, 13):
        base = {**MM.launch_config(t, m, N_EMU, k), "W": 2}
        for ks in (1, 2):
            plain_cfg = MM.with_split(base, t, k, ks)
            paired_cfg = {**plain_cfg, "R": 2}
            plan = MM._plan(t, m, N_EMU, k, paired_cfg)
            part = plan.part if ks > 1 else plan
            assert part.kernel is MM._PAIR_KERNELS[t, ks > 1]
            # 2 tiles of 16 over a half's 20 rows, KS splits, W SIMD groups
            assert part.grid[0] == 2 * ks * 32 * paired_cfg["W"]
            plain = MM.mma_matmul_kernel(x[:m], w, t, k, config=plain_cfg, init_value=nan)
            paired = MM.mma_matmul_kernel(x[:m], w, t, k, config=paired_cfg, init_value=nan)
            _check(paired, x[:m], wf)
            assert _same_bits(paired, plain), f"M = {m} KS {ks}"


def test_paired_rows_setting(monkeypatch):
    """HF2Q_MMA_PAIRS: 1 pairs the rows of an even N (R = 2 in the config at every M, with the
    dense GLU's U and W for F = N / 2, no split unless HF2Q_MMA_SPLIT_K is set), unset or 0
    does not, an odd N never; a paired config on an odd N is refused; a bad value is an
    InvalidArgumentError naming the switch."""
    monkeypatch.setattr(MM, "PAIRS_RAW", "1")
    for n, k in ((16384, 5376), (5376, 21504), (2816, 4096)):
        cfgs = [MM.launch_config(T.Q4_K, m, n, k) for m in (1, 8, 13, 32)]
        glu = [MM.glu_launch_config(T.Q4_K, m, n // 2, k) for m in (1, 8, 13, 32)]
        assert cfgs == [{**g, "R": 2} for g in glu]
    assert "R" not in MM.launch_config(T.Q4_K, 1, 4099, 2816)
    monkeypatch.setattr(MM, "SPLIT_K_RAW", "2")
    assert MM.launch_config(T.Q4_K, 1, 5376, 21504)["KS"] == 2
    monkeypatch.setattr(MM, "PAIRS_RAW", "")
    assert MM.pairs(5376, "1") and not MM.pairs(4099, "1")
    assert not MM.pairs(5376, "") and not MM.pairs(5376, "0")
    assert not MM.pairs(5376, "2") and MM.wide_pairs(5376, "2") and not MM.wide_pairs(5376, "1")
    for bad in ("3", "yes"):
        with pytest.raises(InvalidArgumentError, match="HF2Q_MMA_PAIRS"):
            MM.pairs(5376, bad)
    with pytest.raises(ValueError, match="even N"):
        MM.make_plan(T.Q4_K, 1, 41, 2816, {**MM.launch_config(T.Q4_K, 1, 41, 2816), "R": 2})


def test_wide_paired_rows_setting(monkeypatch):
    """HF2Q_MMA_PAIRS=2: R = 2 only at 4 n-tiles (17..32 rows) of an even N, every other key of
    the config (U, W, KS, NT) as unset: the unpaired kernel's order of additions at every M."""
    for n, k in ((12288, 2048), (5376, 21504), (2048, 4096), (4099, 2816)):
        monkeypatch.setattr(MM, "PAIRS_RAW", "")
        plain = [MM.launch_config(T.Q4_K, m, n, k) for m in range(1, 33)]
        monkeypatch.setattr(MM, "PAIRS_RAW", "2")
        wide = [MM.launch_config(T.Q4_K, m, n, k) for m in range(1, 33)]
        for m, a, b in zip(range(1, 33), plain, wide):
            paired = m > 16 and n % 2 == 0
            unsplit = {key: v for key, v in a.items() if key != "CS"}  # pairs take no CS
            assert b == ({**unsplit, "R": 2} if paired else a), (n, k, m)


def _dispatch_20_rows(monkeypatch, cuda_launches, switch: str, value: str, kernel: dict):
    """ggml_matmul (Q4_K, N 24) on 20 rows with qmatmul_mma's ``switch`` set to ``value``: one
    launch of ``kernel_name(**kernel)``, within the bf16 bound, rows 0, 7 and 19 the bits they
    have alone at M = 1 without the switch (row parity across the switch and M)."""
    t, n, k = T.Q4_K, 24, 4 * 256
    w, wf = _weight(t, n, k)
    x = _x(20, k, mx.bfloat16, seed=91)
    alone = [Q.ggml_matmul(x[i : i + 1], w, t, k) for i in (0, 7, 19)]
    monkeypatch.setattr(MM, switch, value)
    monkeypatch.setattr(Q, "_CALLS", {})
    cuda_launches.clear()
    got = Q.ggml_matmul(x, w, t, k)
    assert cuda_launches == [MM.kernel_name(t, **kernel)]
    _check(got, x, wf)
    assert all(_same_bits(got[i : i + 1], a) for i, a in zip((0, 7, 19), alone))


@needs_gxx
def test_dispatcher_pairs_wide_row_counts_with_the_plain_bits(monkeypatch, cuda_launches):
    """ggml_matmul with HF2Q_MMA_PAIRS=2: 20 rows in the paired kernel (before any column
    split), each row's bits those it has alone."""
    _dispatch_20_rows(monkeypatch, cuda_launches, "PAIRS_RAW", "2", {"paired": True})


@needs_gxx
def test_dispatcher_runs_the_paired_kernel(monkeypatch, cuda_launches):
    """ggml_matmul with HF2Q_MMA_PAIRS=1: the paired kernel, the bits of the unpaired dispatch
    at M = 1 and 5."""
    _dispatch_with_switch(monkeypatch, cuda_launches, "PAIRS_RAW", 4 * 256, {"paired": True})


@needs_gxx
@pytest.mark.parametrize(
    "ggml_type,k", [(T.Q4_K, 4 * 256), (T.Q8_0, 13 * 32), (T.Q6_K, 2 * 256)],
    ids=["Q4_K", "Q8_0", "Q6_K"],
)  # fmt: skip
def test_emulator_column_split_gives_the_unsplit_bits(ggml_type, k, monkeypatch):
    """Config CS (HF2Q_MMA_COLUMN_TILES): x's n-tiles split over CS threadgroups a 16-row tile
    (N 40: the last tile 8 rows short). At M = 13 (2 n-tiles), 20 (4, the last threadgroup all
    padding) and 32, with 1 and 2 n-tiles a threadgroup, every element has the unsplit
    kernel's bits (same U and W, W 2: two SIMD groups' sums meet), output NaN-poisoned."""
    monkeypatch.setattr(Kernel, "__call__", kernel_emulator.kernel_call)
    t, nan = ggml_type, float("nan")
    w, wf = _weight(t, N_EMU, k)
    x = _x(32, k, mx.bfloat16, seed=int(t) + 80)
    for m in (13, 20, 32):
        plain_cfg = {**MM.with_columns(MM.launch_config(t, m, N_EMU, k), 4), "W": 2}
        assert "CS" not in plain_cfg
        plain = MM.mma_matmul_kernel(x[:m], w, t, k, config=plain_cfg, init_value=nan)
        _check(plain, x[:m], wf)
        for tiles in (1, 2):
            cfg = MM.with_columns(plain_cfg, tiles)
            if plain_cfg["NT"] <= tiles:
                assert cfg == plain_cfg
                continue
            cs = plain_cfg["NT"] // tiles
            assert cfg["CS"] == cs and (cfg.get("XG") == MM.DENSE_XG) == (tiles == 1)
            plan = MM._plan(t, m, N_EMU, k, cfg)
            assert plan.kernel is MM._COLUMN_KERNELS[t, False]
            assert plan.grid[0] == 3 * cs * 32 * 2  # 3 tiles of 16 rows, CS splits, W 2
            got = MM.mma_matmul_kernel(x[:m], w, t, k, config=cfg, init_value=nan)
            assert _same_bits(got, plain), f"M = {m}, {tiles} n-tiles a threadgroup"


def test_column_tiles_setting(monkeypatch):
    """HF2Q_MMA_COLUMN_TILES: unset, COLUMN_TILES by block size (Q4_K 2: 4 n-tiles over 2
    threadgroups; 32-blocks unsplit); 1, 2 or 4 for every type split NT n-tiles over NT /
    value threadgroups (4: none). Every other key (U, W, KS, NT) is the unsplit config's (XG 16
    at one n-tile a threadgroup), never on a split over K or paired rows; 3 or a bad value is
    an InvalidArgumentError naming the switch."""
    assert MM.COLUMN_TILES == {256: 2, 32: 4}
    for t, n, k in ((T.Q4_K, 12352, 2048), (T.Q4_K, 5376, 21504), (T.Q4_K, 248320, 2048),
                    (T.Q8_0, 2048, 512), (T.Q5_0, 2816, 2112)):  # fmt: skip
        monkeypatch.setattr(MM, "COLUMN_TILES_RAW", "4")
        plain = [MM.launch_config(t, m, n, k) for m in range(1, 33)]
        assert not any("CS" in c for c in plain)
        for raw in ("", "1", "2"):
            tiles = int(raw) if raw else MM.COLUMN_TILES[QK[t]]
            monkeypatch.setattr(MM, "COLUMN_TILES_RAW", raw)
            for m, a in zip(range(1, 33), plain):
                b = MM.launch_config(t, m, n, k)
                cs = 1 if a.get("KS", 1) > 1 else a["NT"] // min(a["NT"], tiles)
                assert b.get("CS", 1) == cs, (n, k, m, raw)
                assert b.get("XG", 1) == (MM.DENSE_XG if a["NT"] // cs == 1 else 1)
                assert {key: v for key, v in b.items() if key not in ("CS", "XG")} == {
                    key: v for key, v in a.items() if key != "XG"
                }
    monkeypatch.setattr(MM, "PAIRS_RAW", "2")
    monkeypatch.setattr(MM, "COLUMN_TILES_RAW", "1")
    paired = MM.launch_config(T.Q4_K, 32, 12352, 2048)
    assert paired["R"] == 2 and "CS" not in paired
    for bad in ("3", "8", "yes"):
        with pytest.raises(InvalidArgumentError, match="HF2Q_MMA_COLUMN_TILES"):
            MM.column_tiles(256, bad)
    with pytest.raises(ValueError, match="column split"):
        MM.make_plan(T.Q4_K, 32, 48, 512, {"NT": 4, "U": 2, "W": 1, "CS": 3})


@needs_gxx
@pytest.mark.parametrize("tiles,columns", [("", True), ("1", True), ("4", False)])
def test_dispatcher_splits_the_columns_with_the_plain_bits(monkeypatch, cuda_launches, tiles,
                                                           columns):  # fmt: skip
    """ggml_matmul on 20 rows: the column-split kernel as shipped (2 n-tiles a threadgroup) and
    at HF2Q_MMA_COLUMN_TILES=1, the plain one at 4; each row's bits those it has alone."""
    _dispatch_20_rows(monkeypatch, cuda_launches, "COLUMN_TILES_RAW", tiles, {"columns": columns})


def test_launch_config_fixes_the_order_whatever_m():
    """U and W (which SIMD group sums which blocks) do not depend on M; NT covers M, 4 n-tiles
    (one launch) up to MAX_ROWS = 32."""
    assert MM.MAX_ROWS == 32
    ms = range(1, MM.MAX_ROWS + 1)
    for t in TYPES:
        for n, k in ((4096, 2816), (257, 14336), (40, _k(t))):
            cfgs = [MM.launch_config(t, m, n, k) for m in ms]
            assert len({(c["U"], c["W"]) for c in cfgs}) == 1
            assert all(8 * c["NT"] >= m for m, c in zip(ms, cfgs))
            assert [c["NT"] for c in cfgs] == [1] * 8 + [2] * 8 + [4] * 16
            c = cfgs[0]
            assert 1 <= c["W"] <= -(-(k // QK[t]) // c["U"])  # no idle SIMD group
    with pytest.raises(ValueError):  # one n-tile cannot hold 9 rows
        MM._Plan(T.Q4_K, 9, 16, 256, {"NT": 1, "U": 1, "W": 1})
    with pytest.raises(ValueError):  # nor two 17
        MM._Plan(T.Q4_K, 17, 16, 256, {"NT": 2, "U": 1, "W": 1})


@needs_gxx
def test_dispatcher_takes_one_launch_per_32_rows(monkeypatch):
    """CUDA + bf16 x of a GPU-verified type: 20 and 32 rows in ONE mma launch (NT = 4), 48 and
    64 rows in 32-row slices (two launches, the second 16 and 32 rows); each row's bits those
    it has alone. fp16 x (the scalar kernels) keeps 16-row slices: two launches at 20 rows."""
    launched = []

    def launcher(self, input_dtypes, **launch):
        run = kernel_emulator.kernel_launcher(self, input_dtypes, **launch)
        nt = launch["template"].get("NT")
        return lambda inputs: launched.append((self.name, nt, inputs[0].shape[0])) or run(inputs)

    monkeypatch.setattr(Q, "backend", lambda: "cuda")
    monkeypatch.setattr(Kernel, "launcher", launcher)
    monkeypatch.setattr(Q, "_CALLS", {})
    monkeypatch.setattr(MM, "ALL_TYPES", False)
    t, k = T.Q8_0, _k(T.Q8_0)
    w, wf = _weight(t, N_EMU, k)
    x = _x(64, k, mx.bfloat16, seed=12)
    name = MM.kernel_name(t)
    alone = mx.concatenate([Q.ggml_matmul(x[i : i + 1], w, t, k) for i in range(64)])
    assert launched == [(name, 1, 1)] * 64
    for m, want in (
        (20, [(name, 4, 20)]),
        (32, [(name, 4, 32)]),
        (48, [(name, 4, 32), (name, 2, 16)]),
        (64, [(name, 4, 32)] * 2),
    ):
        launched.clear()
        y = Q.ggml_matmul(x[:m], w, t, k)
        assert launched == want, f"M = {m}: {launched}"
        assert _same_bits(y, alone[:m]), f"M = {m}: rows differ from the rows alone"
        if m in (20, 64):
            _check(y, x[:m], wf)
    launched.clear()
    y = Q.ggml_matmul(x[:20].reshape(4, 5, k), w, t, k)  # batch dims: one launch as well
    assert len(launched) == 1 and y.shape == (4, 5, N_EMU)
    assert _same_bits(y.reshape(20, N_EMU), alone[:20])
    launched.clear()
    Q.ggml_matmul(x[:20].astype(mx.float16), w, t, k)
    assert [(n.startswith("ggml_qmv_mma"), m) for n, _, m in launched] == [(False, 16), (False, 4)]


# ---------------------------------------------------------------------------------------------
# The warp mma's fragment layout (docs/kernels.md), pinned on both implementations: the
# emulator's portable one here, the tensor core's in the GPU test. Small integers: every sum is
# exact in fp32, whatever order either implementation adds in, so the check is bit-exact.

_MMA_BODY = r"""
  // One SIMD group; lane = 4g + t loads its fragments as documented, from A (16, 16), B^T
  // (8, 16) (bf16, row-major) and C (16, 8) fp32, and writes D = C + A B in C's layout.
  const uint g = lane >> 2, t = lane & 3u;
  DEVICE_PTR(const uint) A = DEVICE_CAST(const uint, a);
  DEVICE_PTR(const uint) BT = DEVICE_CAST(const uint, bt);
  uint af[4], bf[2];
  af[0] = A[(g * 16 + 2 * t) / 2];
  af[1] = A[((g + 8) * 16 + 2 * t) / 2];
  af[2] = A[(g * 16 + 2 * t + 8) / 2];
  af[3] = A[((g + 8) * 16 + 2 * t + 8) / 2];
  bf[0] = BT[(g * 16 + 2 * t) / 2];
  bf[1] = BT[(g * 16 + 2 * t + 8) / 2];
  float cf[4] = {c[g * 8 + 2 * t], c[g * 8 + 2 * t + 1], c[(g + 8) * 8 + 2 * t],
                 c[(g + 8) * 8 + 2 * t + 1]};
  mma_bf16_m16n8k16(cf, af, bf);
  d[g * 8 + 2 * t] = cf[0];
  d[g * 8 + 2 * t + 1] = cf[1];
  d[(g + 8) * 8 + 2 * t] = cf[2];
  d[(g + 8) * 8 + 2 * t + 1] = cf[3];
"""
_MMA_PROBE = Kernel(
    "mma_layout_probe",
    ["a", "bt", "c"],
    ["d"],
    _MMA_BODY,
    examples=[Example({"a": mx.bfloat16, "bt": mx.bfloat16, "c": mx.float32}, {"d": mx.float32})],
    register=False,
)


def _mma_probe(run) -> None:
    rng = np.random.default_rng()
    a = rng.integers(-128, 129, size=(16, 16)).astype(np.float32)
    b = rng.integers(-64, 65, size=(16, 8)).astype(np.float32)
    c = rng.integers(-1000, 1001, size=(16, 8)).astype(np.float32)
    launch = dict(grid=(32,), threadgroup=(32,), output_shapes=[(16, 8)],
                  output_dtypes=[mx.float32])  # fmt: skip
    inputs = [mx.array(a).astype(mx.bfloat16), mx.array(b.T.copy()).astype(mx.bfloat16)]
    (d,) = run(_MMA_PROBE, [*inputs, mx.array(c)], **launch)
    np.testing.assert_array_equal(np.array(d), c + a @ b)


@needs_gxx
def test_mma_fragment_layout_on_the_emulator():
    _mma_probe(kernel_emulator.emulate)


@requires_gpu
def test_gpu_mma_fragment_layout():
    """The tensor core reads and writes the fragments as documented (and as the emulator's
    portable version does): what every emulator test of the mma kernel rests on."""
    if backend() != "cuda":
        pytest.skip("the tensor-core mma is CUDA only")
    _mma_probe(lambda k, inputs, **launch: k(inputs, **launch))


# ---------------------------------------------------------------------------------------------
# GPU: real shapes

_GPU_SHAPES = ((4099, 2816), (257, 14336))


@requires_gpu
@pytest.mark.parametrize("ggml_type", TYPES, ids=[t.name for t in TYPES])
def test_gpu_matches_reference_and_rows_alone(ggml_type):
    """On CUDA: within the bf16 bound at M = 1..32 (one launch, up to four n-tiles), and each
    row's bits those it has alone; the first row's too when the other rows hold inf, NaN and
    huge values."""
    if backend() != "cuda":
        pytest.skip("the mma kernel runs on CUDA only")
    t = ggml_type
    for n, k in _GPU_SHAPES:
        w, wf = _weight(t, n, k)
        x = _x(MM.MAX_ROWS, k, mx.bfloat16, seed=n + k)
        alone = mx.concatenate(
            [
                MM.mma_matmul_kernel(x[i : i + 1], w, t, k, init_value=float("nan"))
                for i in range(MM.MAX_ROWS)
            ]
        )
        for m in range(1, MM.MAX_ROWS + 1):
            y = MM.mma_matmul_kernel(x[:m], w, t, k, init_value=float("nan"))
            if m in MS:
                _check(y, x[:m], wf)
            same = np.array(y.view(mx.uint16) == alone[:m].view(mx.uint16)).all(axis=1)
            assert same.all(), f"{n}x{k} M = {m}: rows {np.flatnonzero(~same).tolist()} differ"
        y = MM.mma_matmul_kernel(_wild_rows(x), w, t, k)
        assert bool(mx.array_equal(y[0].view(mx.uint16), alone[0].view(mx.uint16)))


@requires_gpu
@pytest.mark.parametrize("ggml_type", TYPES, ids=[t.name for t in TYPES])
def test_gpu_load_variants_give_the_same_bits(ggml_type):
    """On CUDA: configs S = 1 (ld.global.cs weight loads), PF = 1 (loads a run ahead) and XG
    (x loads of all scale groups first), at the default U and at U = 1, give the default's bits
    at M = 1, 8 and 32 on both shapes, every output written."""
    if backend() != "cuda":
        pytest.skip("the mma kernel runs on CUDA only")
    t = ggml_type
    nan = float("nan")
    for n, k in _GPU_SHAPES:
        w, _ = _weight(t, n, k)
        for m in (1, 8, 32):
            x = _x(m, k, mx.bfloat16, seed=n + k + m)
            cfg = MM.launch_config(t, m, n, k)
            for base in (cfg, {**cfg, "U": 1}):
                plain = MM.mma_matmul_kernel(x, w, t, k, config=base)
                for var in LOAD_VARIANTS:
                    y = MM.mma_matmul_kernel(x, w, t, k, config={**base, **var}, init_value=nan)
                    assert _same_bits(y, plain), f"{n}x{k} M = {m} U {base['U']} {var}"


@requires_gpu
@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q6_K, T.Q5_0], ids=["Q4_K", "Q6_K", "Q5_0"])
def test_gpu_split_k_matches_reference_and_rows_alone(ggml_type):
    """On CUDA, config KS 2 and 3 (HF2Q_MMA_SPLIT_K): within the bf16 bound at M = 1, 8, 13
    and 32, both launches' outputs NaN-poisoned, and each row's bits those it has alone, on
    both GPU shapes and 31B's o shape (N 5,376, K 8,192)."""
    if backend() != "cuda":
        pytest.skip("the mma kernel runs on CUDA only")
    t, nan = ggml_type, float("nan")
    for n, k in (*_GPU_SHAPES, (5376, 8192)):
        w, wf = _weight(t, n, k)
        x = _x(MM.MAX_ROWS, k, mx.bfloat16, seed=n + k + 5)
        for ks in (2, 3):
            cfg1 = MM.with_split(MM.launch_config(t, 1, n, k), t, k, ks)
            alone = [
                MM.mma_matmul_kernel(x[i : i + 1], w, t, k, config=cfg1, init_value=nan)[0]
                for i in range(MM.MAX_ROWS)
            ]
            for m in (1, 8, 13, 32):
                cfg = {**cfg1, "NT": MM.n_tiles(m)}
                y = MM.mma_matmul_kernel(x[:m], w, t, k, config=cfg, init_value=nan)
                _check(y, x[:m], wf)
                differ = [i for i in range(m) if not _same_bits(y[i], alone[i])]
                assert not differ, f"{n}x{k} KS {ks} M = {m}: rows {differ} differ"


def _cuda_cases(t, shapes, seed: int):
    """(N, K, weight, its fp32 rows, MAX_ROWS rows of bf16 x) per shape; skips off CUDA."""
    if backend() != "cuda":
        pytest.skip("the mma kernel runs on CUDA only")
    for n, k in shapes:
        w, wf = _weight(t, n, k)
        yield n, k, w, wf, _x(MM.MAX_ROWS, k, mx.bfloat16, seed=n + k + seed)


@requires_gpu
@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q6_K, T.Q5_0], ids=["Q4_K", "Q6_K", "Q5_0"])
def test_gpu_paired_rows_give_the_plain_bits(ggml_type):
    """On CUDA, config R = 2 (HF2Q_MMA_PAIRS): every element the unpaired kernel's bits at the
    same U / W (and split over K in 2), output NaN-poisoned, at M = 1, 8, 13 and 32, on an
    even N not a multiple of 32 and on 31B's o shape."""
    t, nan = ggml_type, float("nan")
    for n, k, w, wf, x in _cuda_cases(t, ((4098, 2816), (5376, 8192)), seed=9):
        for m in (1, 8, 13, 32):
            for ks in (1, 2):
                plain_cfg = MM.with_split(MM.launch_config(t, m, n, k), t, k, ks)
                paired_cfg = {**plain_cfg, "R": 2}
                plain = MM.mma_matmul_kernel(x[:m], w, t, k, config=plain_cfg, init_value=nan)
                paired = MM.mma_matmul_kernel(x[:m], w, t, k, config=paired_cfg, init_value=nan)
                _check(paired, x[:m], wf)
                assert _same_bits(paired, plain), f"{n}x{k} M = {m} KS {ks}"


@requires_gpu
@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q6_K, T.Q5_0], ids=["Q4_K", "Q6_K", "Q5_0"])
def test_gpu_column_split_gives_the_unsplit_bits(ggml_type):
    """On CUDA, config CS (HF2Q_MMA_COLUMN_TILES 1 and 2): every element the unsplit kernel's
    bits at the default U / W, output NaN-poisoned, at M = 13, 20 and 32, on an N not a
    multiple of 16, 35B-A3B's shared-expert down and its delta-net input shape."""
    t, nan = ggml_type, float("nan")
    for n, k, w, wf, x in _cuda_cases(t, ((4099, 2816), (2048, 512), (12352, 2048)), seed=11):
        for m in (13, 20, 32):
            plain_cfg = MM.with_columns(MM.launch_config(t, m, n, k), 4)  # unsplit
            plain = MM.mma_matmul_kernel(x[:m], w, t, k, config=plain_cfg, init_value=nan)
            _check(plain, x[:m], wf)
            for tiles in (1, 2):
                cfg = MM.with_columns(plain_cfg, tiles)
                got = MM.mma_matmul_kernel(x[:m], w, t, k, config=cfg, init_value=nan)
                assert _same_bits(got, plain), f"{n}x{k} M = {m}, {tiles} n-tiles, {cfg}"


@requires_gpu
@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q6_K, T.Q5_0], ids=["Q4_K", "Q6_K", "Q5_0"])
def test_gpu_fused_split_sum_gives_the_two_launch_bits_call_after_call(ggml_type):
    """On CUDA, config SF = 1 (HF2Q_MMA_SPLIT_FUSED) at KS 2 and 3: the bits of the split
    kernel + sum kernel at M = 1, 8 and 32, outputs NaN-poisoned, on 31B's o shape and an N
    not a multiple of 16; the 1-row plan called past a full turn of its counter sets, twice
    through each, keeps those bits (a counter left non-zero makes no threadgroup sum, and the
    output stays NaN), and its counters end at zero."""
    t, nan = ggml_type, float("nan")
    for n, k, w, wf, x in _cuda_cases(t, ((5376, 8192), (4099, 2816)), seed=11):
        for ks in (2, 3):
            for m in (1, 8, 32):
                cfg = MM.with_split(MM.launch_config(t, m, n, k), t, k, ks)
                two = MM.mma_matmul_kernel(x[:m], w, t, k, config=cfg, init_value=nan)
                fused_cfg = {**cfg, "SF": 1}
                plan = MM._plan(t, m, n, k, fused_cfg)
                calls = 2 * len(plan.counted.sets) + 1 if m == 1 else 1
                for _ in range(calls):
                    y = MM.mma_matmul_kernel(x[:m], w, t, k, config=fused_cfg, init_value=nan)
                    assert _same_bits(y, two), f"{n}x{k} KS {ks} M = {m}"
                _check(y, x[:m], wf)
                assert not mx.any(plan.counted.counter).item()


@requires_gpu
def test_gpu_dispatcher_takes_the_mma_kernel(monkeypatch):
    """ggml_matmul on CUDA with bf16 x picks the mma plan at M = 1, 5, 20 and 32 (one launch,
    NT = 4 past 16 rows; equal to the kernel called directly), and 32-row slices at M = 48;
    with ENABLED off, the scalar kernel's plan; for a type not GPU-verified (Q5_K), the mma
    plan only with ALL_TYPES."""
    if backend() != "cuda":
        pytest.skip("the mma kernel runs on CUDA only")
    monkeypatch.setattr(Q, "_CALLS", {})
    t, n, k = T.Q4_K, 257, 2816
    w, wf = _weight(t, n, k)
    for m in (1, 5, 20, 32):
        x = _x(m, k, mx.bfloat16, seed=m)
        y = Q.ggml_matmul(x, w, t, k)
        plan = Q._CALLS[(t, k, x.shape, x.dtype, w.shape, w.dtype, True)]
        assert plan.kernel is MM._KERNELS[t] and plan.template["NT"] == MM.n_tiles(m)
        assert bool(mx.array_equal(y, MM.mma_matmul_kernel(x, w, t, k)))
        _check(y, x, wf)
    monkeypatch.setattr(Q, "_CALLS", {})
    x48 = _x(48, k, mx.bfloat16, seed=48)
    y = Q.ggml_matmul(x48, w, t, k)
    shapes = sorted(key[2] for key in Q._CALLS)
    assert shapes == [(16, k), (32, k)], shapes  # two launches: 32 rows, then 16
    want = mx.concatenate(
        [MM.mma_matmul_kernel(x48[:32], w, t, k), MM.mma_matmul_kernel(x48[32:], w, t, k)]
    )
    assert bool(mx.array_equal(y, want))
    _check(y, x48, wf)
    monkeypatch.setattr(MM, "ENABLED", False)
    x = x[:5]  # one scalar launch (16 rows at most)
    Q.ggml_matmul(x, w, t, k)
    plan = Q._CALLS[(t, k, x.shape, x.dtype, w.shape, w.dtype, False)]
    assert plan.kernel is not MM._KERNELS[t] and plan.kernel in Q._KERNELS.values()
    # a type not GPU-verified: the scalar kernel unless ALL_TYPES
    monkeypatch.setattr(MM, "ENABLED", True)
    t, x = T.Q5_K, _x(5, k, mx.bfloat16, seed=6)
    w, wf = _weight(t, n, k)
    for all_types in (False, True):
        monkeypatch.setattr(MM, "ALL_TYPES", all_types)
        monkeypatch.setattr(Q, "_CALLS", {})
        _check(Q.ggml_matmul(x, w, t, k), x, wf)
        plan = Q._CALLS[(t, k, x.shape, x.dtype, w.shape, w.dtype, True)]
        # every type GPU-verified since session 10: the mma kernel whatever ALL_TYPES says
        assert (plan.kernel is MM._KERNELS[t]) == (all_types or t in MM.GPU_VERIFIED)
