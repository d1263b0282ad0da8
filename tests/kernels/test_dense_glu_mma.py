"""The tensor-core dense GLU (expert_glu.dense_glu_mma_kernel: qmatmul_mma's loop over the gate
and up rows, the activation in its epilogue): accuracy on the CPU emulator against fp32 math,
row parity (each row's bits the same at any M and whatever the other rows hold), the
dispatcher's choice, and the same on the GPU on Qwen3.5-9B's MLP shapes."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import kernel_emulator
import mlx.core as mx
import numpy as np
import pytest
from conftest import requires_gpu
from gguf import GGMLQuantizationType as T
from test_expert_glu import _bits, _check, _experts, _x
from test_qmatmul_mma import LOAD_VARIANTS, NEW, TYPES, _wild_rows

from hf2q_mlx.custom_kernels import backend
from hf2q_mlx.custom_kernels import expert_glu as G
from hf2q_mlx.custom_kernels import qmatmul_mma as MM
from hf2q_mlx.custom_kernels._render import Example, Kernel
from hf2q_mlx.custom_kernels.dequant import row_bytes
from hf2q_mlx.custom_kernels.ggml_formats import BLOCK_FORMATS

VERIFIED = TYPES  # qmatmul_mma.GLU_GPU_VERIFIED: every type passed the H200 GLU tests
QK = {t: BLOCK_FORMATS[t].block_size for t in TYPES}
F_EMU = 20  # features: two threadgroups of 16, the second with features past F
# Tolerance (test_expert_glu._check, bf16 x): per row, the relative error at most twice that
# of the fp32 result rounded to bf16. Weights and x enter the mma exactly, its products are
# exact, its sums and the scales, the activation and the product fp32: the one bf16 rounding
# of the output (2^-9) dominates.

needs_gxx = pytest.mark.skipif(not kernel_emulator.available(), reason="g++ is not installed")


def _k(t: int) -> int:
    """K for the emulator: 2 super-blocks (K-quants) or 3 blocks: short rows, fast fibers."""
    return 2 * QK[t] if QK[t] == 256 else 3 * QK[t]


def _case(t: int, m: int, k: int, seed: int):
    """(raw (1, 2F, row_bytes) numpy, w (2F, row_bytes), bf16 x (m, k)): O(1) projections."""
    raw = _experts(t, 1, 2 * F_EMU, k, seed=int(t) + k)
    return raw, mx.array(raw[0]), _x((m, k), mx.bfloat16, seed, raw, t)


def _check_glu(y: mx.array, x: mx.array, raw: np.ndarray, t: int, k: int, act: str) -> None:
    """dense GLU = the experts' contract over one expert (id 0 for every row)."""
    f = raw.shape[1] // 2
    assert y.shape == (*x.shape[:-1], f) and y.dtype == x.dtype
    ids = mx.zeros((x.shape[0], 1), dtype=mx.uint32)
    _check(y[:, None], x, raw[:, :f], raw[:, f:], ids, t, k, act)


# (type, M, K, activation, config or None): every type at M = 1, 5 (NT 1), 16 (NT 2), 20 and 32
# (type, M, K, activation, config or None): every GPU-verified type at M = 1, 5 (NT 1), 16
# (NT 2), 20 and 32 (NT 4) with the default launch, the others at 1 and 20 with silu (NT 1
# and 4: fewer emulator builds; the n-tiles and activations are the loop's and the epilogue's,
# the mat-vec tests take each decoder at NT 1 and 2), then several SIMD groups, several runs
# each, a partial last run and NT = 3.
_CASES = [
    (t, m, _k(t), "gelu_tanh" if m == 20 and t not in NEW else "silu", None)
    for t in TYPES
    for m in ((1, 20) if t in NEW else (1, 5, 16, 20, 32))
] + [
    (T.Q4_K, 5, 3 * 256, "silu", {"NT": 1, "U": 1, "W": 2}),
    (T.Q6_K, 11, 3 * 256, "gelu_tanh", {"NT": 2, "U": 2, "W": 2}),
    (T.Q8_0, 2, 13 * 32, "silu", {"NT": 1, "U": 2, "W": 3}),
    (T.Q5_0, 24, 13 * 32, "silu", {"NT": 3, "U": 3, "W": 2}),
]


def _example(t: int, m: int, k: int, act: str, cfg: dict | None) -> tuple[Kernel, Example]:
    cfg = cfg or MM.glu_launch_config(t, m, F_EMU, k)
    ex = Example(
        {
            "x": (mx.bfloat16, m * k),
            "w": (mx.uint8, 2 * F_EMU * row_bytes(t, k)),
            "dims": (mx.int32, 3),
        },
        {"out": mx.bfloat16},
        {
            "T": mx.bfloat16,
            "NT": cfg["NT"],
            "U": cfg["U"],
            "PF": cfg.get("PF", 0),
            "XG": cfg.get("XG", 1),
            "ACT": G.ACTIVATIONS.index(act),
        },  # fmt: skip
    )
    return G._DENSE_MMA_KERNELS[t], ex


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
        for i, (t, m, k, act, cfg) in enumerate(_CASES):
            _, w, x = _case(t, m, k, 700 + i)
            outs[i] = G.dense_glu_mma_kernel(x, w, t, k, act, config=cfg)
    finally:
        mp.undo()
    return outs


@pytest.mark.parametrize(
    "i", range(len(_CASES)), ids=[f"{T(c[0]).name}-M{c[1]}-K{c[2]}-{c[3]}" for c in _CASES]
)
def test_emulator_matches_reference(emulated, i):
    """Within the bf16 bound of fp32 math, row by row; every output written (NaN-poisoned)."""
    t, m, k, act, _ = _CASES[i]
    raw, _, x = _case(t, m, k, 700 + i)
    _check_glu(emulated[i], x, raw, t, k, act)


@needs_gxx
@pytest.mark.parametrize("ggml_type", TYPES, ids=[t.name for t in TYPES])
def test_emulator_rows_bit_identical_to_rows_alone(ggml_type, monkeypatch):
    """Row parity: at M = 2..32 (NT 1, 2, 4) each row has the bits it has alone (M = 1), and
    the first row keeps them at M = 16 and 32 when the other rows hold inf, NaN, huge values."""
    monkeypatch.setattr(Kernel, "__call__", kernel_emulator.kernel_call)
    t, k = ggml_type, _k(ggml_type)
    raw, w, x = _case(t, 32, k, seed=int(t) + 70)
    perm = np.random.default_rng(int(t)).permutation(32)
    # Parity is the loop's, shared by every type: the types not yet run on a GPU check fewer
    # M (NT 1 and 4, partial and full: the builds of their accuracy cases) and rows alone (row
    # 0 and those that land at columns 0, 1, 7, 8, 16 and 31: every n-tile), to keep the
    # emulator time down.
    if t in NEW:
        ms, wild_ms, ids = (2, 8, 17, 32), (32,), {0, *perm[[0, 1, 7, 8, 16, 31]].tolist()}
    else:
        ms, wild_ms, ids = (2, 5, 8, 9, 16, 17, 32), (16, 32), set(range(32))
    alone = {i: G.dense_glu_mma_kernel(x[i : i + 1], w, t, k)[0] for i in sorted(ids)}
    order = sorted(ids)
    _check_glu(mx.stack([alone[i] for i in order]), x[mx.array(order)], raw, t, k, "silu")
    for m in ms:
        rows = perm[:m]  # rows in another order than alone's
        y = G.dense_glu_mma_kernel(x[mx.array(rows)], w, t, k)
        differ = [int(r) for j, r in enumerate(rows) if r in ids and not _same(y[j], alone[r])]
        assert not differ, f"M = {m}: rows {differ} differ"
    for m in wild_ms:
        y = G.dense_glu_mma_kernel(_wild_rows(x[:m]), w, t, k)
        assert _same(y[0], alone[0]), f"M = {m}: row 0 changed"


def _same(a: mx.array, b: mx.array) -> bool:
    return np.array_equal(_bits(a), _bits(b))


@needs_gxx
@pytest.mark.parametrize("ggml_type", [T.Q4_K], ids=["Q4_K"])
def test_emulator_load_variants_give_the_same_bits(ggml_type, monkeypatch):
    """Configs S = 1 (streaming weight loads), PF = 1 (loads a run ahead) and XG (x loads of
    all scale groups first) give the default GLU kernel's bits, every output written
    (NaN-poisoned first), also at U = 1 over two SIMD groups (8 blocks a row: several runs
    each)."""
    monkeypatch.setattr(Kernel, "__call__", kernel_emulator.kernel_call)
    t, k = ggml_type, 8 * QK[ggml_type]  # several runs per SIMD group: PF's hand-over
    raw, w, x = _case(t, 5, k, seed=int(t) + 80)
    cfg = MM.glu_launch_config(t, 5, raw.shape[1] // 2, k)
    for base in (cfg, {"NT": 1, "U": 1, "W": 2}):
        plain = G.dense_glu_mma_kernel(x, w, t, k, config=base)
        for var in LOAD_VARIANTS:
            y = G.dense_glu_mma_kernel(x, w, t, k, config={**base, **var}, init_value=float("nan"))
            assert _same(y, plain), f"{base} {var}"


@needs_gxx
@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q8_0], ids=["Q4_K", "Q8_0"])
def test_emulator_column_split_gives_the_unsplit_bits(ggml_type, monkeypatch):
    """Config CS (qmatmul_mma's column split, HF2Q_MMA_COLUMN_TILES): the GLU's n-tiles over
    CS threadgroups a 16-feature tile, every element the unsplit kernel's bits (NaN-poisoned
    first) at M = 13 and 20 (the last threadgroup all padding at 1 n-tile each), W 2."""
    monkeypatch.setattr(Kernel, "__call__", kernel_emulator.kernel_call)
    t, k = ggml_type, 4 * QK[ggml_type]
    raw, w, x = _case(t, 20, k, seed=int(t) + 90)
    f = raw.shape[1] // 2
    for m in (13, 20):
        base = {**MM.with_columns(MM.glu_launch_config(t, m, f, k), 4), "W": 2}
        plain = G.dense_glu_mma_kernel(x[:m], w, t, k, config=base)
        for tiles in (1, 2):
            cfg = MM.with_columns(base, tiles)
            if "CS" not in cfg:
                continue
            y = G.dense_glu_mma_kernel(x[:m], w, t, k, config=cfg, init_value=float("nan"))
            assert _same(y, plain), f"M = {m}, {tiles} n-tiles a threadgroup"


@pytest.fixture
def cuda_launches(monkeypatch) -> list[str]:
    """dense_glu on a faked CUDA back end: the names of the kernels launched, in order; the
    tensor-core kernel runs on the emulator, the scalar one is stubbed (zeros: only the choice
    is checked). Plans cached per call shape start empty."""
    launched: list[str] = []

    def launcher(self, input_dtypes, **launch):
        launched.append(self.name)
        if not self.name.startswith("ggml_dense_glu_mma"):
            shapes, dtypes = launch["output_shapes"], launch["output_dtypes"]
            return lambda inputs: [mx.zeros(s, d) for s, d in zip(shapes, dtypes)]
        return kernel_emulator.kernel_launcher(self, input_dtypes, **launch)

    monkeypatch.setattr(G, "backend", lambda: "cuda")
    monkeypatch.setattr(Kernel, "launcher", launcher)
    monkeypatch.setattr(G, "_DENSE", {})
    return launched


@needs_gxx
def test_dispatcher_routes_bf16_to_mma_on_cuda_only(monkeypatch, cuda_launches):
    """dense_glu on CUDA with bf16 x of a covered type: the mma kernel at M = 1, 3 (batch dims
    kept) and 20 (one launch); ENABLED = False, fp16 x, an uncovered type or Metal: the scalar
    dense kernel (stubbed here: only the choice is checked)."""
    launched = cuda_launches
    t, k = T.Q8_0, _k(T.Q8_0)
    raw, w, x = _case(t, 20, k, seed=9)
    y1 = G.dense_glu(x[:1], w, t, k)
    y3 = G.dense_glu(x[:3].reshape(1, 3, k), w, t, k)
    y20 = G.dense_glu(x, w, t, k, "gelu_tanh")
    assert launched == [G.dense_kernel_name(t, mma=True)] * 3
    assert y3.shape == (1, 3, F_EMU) and y20.shape == (20, F_EMU)
    _check_glu(y3.reshape(3, F_EMU), x[:3], raw, t, k, "silu")
    _check_glu(y20, x, raw, t, k, "gelu_tanh")
    assert np.array_equal(_bits(y1[0]), _bits(y3[0, 0]))
    assert G.dense_glu(x, w, t, k, "gelu_tanh") is not None and len(launched) == 3  # cached
    launched.clear()
    monkeypatch.setattr(MM, "ENABLED", False)
    G.dense_glu(x, w, t, k)
    monkeypatch.setattr(MM, "ENABLED", True)
    G.dense_glu(x.astype(mx.float16), w, t, k)
    # Q5_1 as a type not GPU-verified for the GLU
    monkeypatch.setattr(MM, "GLU_GPU_VERIFIED", MM.GLU_GPU_VERIFIED - {T.Q5_1})
    raw5 = _experts(T.Q5_1, 1, 2 * F_EMU, 96, seed=4)
    G.dense_glu(_x((3, 96), mx.bfloat16, 10, raw5, T.Q5_1), mx.array(raw5[0]), T.Q5_1, 96)
    monkeypatch.setattr(G, "backend", lambda: "metal")
    G.dense_glu(x[:2], w, t, k)
    assert launched == [G.dense_kernel_name(tt, mma=False) for tt in (t, t, T.Q5_1, t)]
    assert G.dense_glu(mx.concatenate([x, x]), w, t, k) is None  # 40 rows: past MAX_TOKENS


def test_dense_mma_covers_the_gpu_verified_types_unless_opted_in(monkeypatch):
    """dense_glu's choice: the GPU-verified types by default, every type with ALL_TYPES, none
    with ENABLED off or for fp16 x."""
    monkeypatch.setattr(MM, "ALL_TYPES", False)
    assert [t for t in TYPES if G.dense_mma_covers(t, mx.bfloat16)] == VERIFIED
    assert set(MM.GLU_GPU_VERIFIED) == set(VERIFIED)
    monkeypatch.setattr(MM, "GLU_GPU_VERIFIED", MM.GLU_GPU_VERIFIED - {T.Q3_K})
    assert [t for t in TYPES if G.dense_mma_covers(t, mx.bfloat16)] == [
        t for t in VERIFIED if t != T.Q3_K
    ]
    monkeypatch.setattr(MM, "ALL_TYPES", True)
    assert all(G.dense_mma_covers(t, mx.bfloat16) for t in TYPES)
    assert not any(G.dense_mma_covers(t, mx.float16) for t in TYPES)
    monkeypatch.setattr(MM, "ENABLED", False)
    assert not any(G.dense_mma_covers(t, mx.bfloat16) for t in TYPES)


@needs_gxx
def test_dispatcher_takes_unverified_types_only_when_opted_in(monkeypatch, cuda_launches):
    """dense_glu on CUDA, bf16 x of a type with a decoder but not GPU-verified (Q5_1 taken out
    of the set): the
    scalar dense kernel by default (stubbed: only the choice is checked), the mma kernel with
    ALL_TYPES (within the bf16 bound)."""
    launched = cuda_launches
    monkeypatch.setattr(MM, "ALL_TYPES", False)
    monkeypatch.setattr(MM, "GLU_GPU_VERIFIED", MM.GLU_GPU_VERIFIED - {T.Q5_1})
    t, k = T.Q5_1, _k(T.Q5_1)
    raw, w, x = _case(t, 3, k, seed=12)
    G.dense_glu(x, w, t, k)
    monkeypatch.setattr(MM, "ALL_TYPES", True)
    monkeypatch.setattr(G, "_DENSE", {})  # plans are cached per call shape, not per ALL_TYPES
    _check_glu(G.dense_glu(x, w, t, k), x, raw, t, k, "silu")
    assert launched == [G.dense_kernel_name(t, mma=False), G.dense_kernel_name(t, mma=True)]


def test_process_load_flags_reach_the_glu_kernel(monkeypatch):
    """HF2Q_MMA_LOADS's flags (qmatmul_mma.LOADS) pick the GLU's kernel and template when the
    call passes no config: s the streaming-load kernel, p the run-ahead template value."""
    x = mx.zeros((1, 256), mx.bfloat16)
    w = mx.zeros((32, row_bytes(T.Q4_K, 256)), mx.uint8)
    plan = G._dense_plan(x, w, T.Q4_K, 256, "silu", None, mma=True)
    assert plan.kernel is G._DENSE_MMA_KERNELS[T.Q4_K]
    monkeypatch.setattr(MM, "LOADS", {"S": 1, "PF": 1})
    plan = G._dense_plan(x, w, T.Q4_K, 256, "silu", None, mma=True)
    assert plan.kernel is G._DENSE_MMA_STREAM_KERNELS[T.Q4_K]
    assert dict(plan.template)["PF"] == 1


def test_glu_launch_config_fixes_the_order_whatever_m():
    """U and W (which SIMD group sums which blocks) do not depend on M; NT covers M."""
    for t in TYPES:
        for f, k in ((12288, 4096), (2816, 2816), (F_EMU, _k(t))):
            cfgs = [MM.glu_launch_config(t, m, f, k) for m in range(1, G.MAX_TOKENS + 1)]
            assert len({(c["U"], c["W"]) for c in cfgs}) == 1
            assert all(m <= 8 * c["NT"] <= 32 for m, c in zip(range(1, 33), cfgs))
            c = cfgs[0]
            assert 1 <= c["W"] <= min(MM.MAX_SIMD, -(-(k // QK[t]) // c["U"]))
    # the H200's choice for Q4_K: fewer SIMD groups on a big grid (9B's MLP), more on a small one
    # (and at one n-tile a block's x loads 16 scale groups at a time: DENSE_XG)
    assert MM.glu_launch_config(T.Q4_K, 1, 12288, 4096) == {"NT": 1, "U": 1, "W": 4, "XG": 16}
    assert MM.glu_launch_config(T.Q4_K, 1, 2816, 2816) == {"NT": 1, "U": 2, "W": 6, "XG": 16}
    x, w = mx.zeros((9, 256), mx.bfloat16), mx.zeros((32, 144), mx.uint8)
    with pytest.raises(ValueError):  # one n-tile cannot hold 9 rows
        G.dense_glu_mma_kernel(x, w, T.Q4_K, 256, config={"NT": 1, "U": 1, "W": 1})
    with pytest.raises(ValueError):  # past the shared `red` buffer's 4 n-tiles
        G.dense_glu_mma_kernel(x, w, T.Q4_K, 256, config={"NT": 5, "U": 1, "W": 1})


# ---------------------------------------------------------------------------------------------
# GPU: Qwen3.5-9B's MLP (F 12288 of K 4096) and a 2816-feature one (F 2816 of K 2816)

_GPU_SHAPES = ((2816, 2816), (12288, 4096))


@requires_gpu
@pytest.mark.parametrize("f,k", _GPU_SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("ggml_type", TYPES, ids=[t.name for t in TYPES])
def test_gpu_matches_reference_and_rows_alone(ggml_type, f, k):
    """On CUDA: within the bf16 bound at M = 1, 5, 16, 20, 32 (outputs NaN-poisoned first),
    each row's bits at M = 2..32 those it has alone, the first row's too when the other rows
    hold inf, NaN and huge values."""
    if backend() != "cuda":
        pytest.skip("the mma kernel runs on CUDA only")
    t = ggml_type
    raw = _experts(t, 1, 2 * f, k, seed=f + k)
    w = mx.array(raw[0])
    x = _x((32, k), mx.bfloat16, f + 1, raw, t)
    nan = float("nan")
    alone = mx.concatenate(
        [G.dense_glu_mma_kernel(x[i : i + 1], w, t, k, init_value=nan) for i in range(32)]
    )
    _check_glu(alone, x, raw, t, k, "silu")
    perm = np.random.default_rng(f).permutation(32)
    for m in range(2, 33):
        rows = mx.array(perm[:m])
        y = G.dense_glu_mma_kernel(x[rows], w, t, k, init_value=nan)
        same = (_bits(y) == _bits(alone[rows])).all(axis=1)
        assert same.all(), f"{f}x{k} M = {m}: rows {np.flatnonzero(~same).tolist()} differ"
    for m in (5, 20):
        y = G.dense_glu_mma_kernel(x[:m], w, t, k, "gelu_tanh", init_value=nan)
        _check_glu(y, x[:m], raw, t, k, "gelu_tanh")
    y = G.dense_glu_mma_kernel(_wild_rows(x), w, t, k)
    assert np.array_equal(_bits(y[0]), _bits(alone[0]))


def _gpu_weights(t: int, seed: int):
    """(F, K, raw experts, w) per GPU shape, seeded F + K + ``seed``; skips off CUDA."""
    if backend() != "cuda":
        pytest.skip("the mma kernel runs on CUDA only")
    for f, k in _GPU_SHAPES:
        raw = _experts(t, 1, 2 * f, k, seed=f + k + seed)
        yield f, k, raw, mx.array(raw[0])


@requires_gpu
@pytest.mark.parametrize("ggml_type", TYPES, ids=[t.name for t in TYPES])
def test_gpu_load_variants_give_the_same_bits(ggml_type):
    """On CUDA: the GLU's configs S = 1 (ld.global.cs weight loads), PF = 1 (loads a run
    ahead) and XG (x loads of all scale groups first) give the default's bits at M = 1 and 8
    on both shapes."""
    t, nan = ggml_type, float("nan")
    for f, k, raw, w in _gpu_weights(t, 3):
        for m in (1, 8):
            x = _x((m, k), mx.bfloat16, f + m, raw, t)
            cfg = MM.glu_launch_config(t, m, f, k)
            plain = G.dense_glu_mma_kernel(x, w, t, k, config=cfg)
            for var in LOAD_VARIANTS:
                y = G.dense_glu_mma_kernel(x, w, t, k, config={**cfg, **var}, init_value=nan)
                assert _same(y, plain), f"{f}x{k} M = {m} {var}"


@requires_gpu
@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q6_K, T.Q5_0], ids=["Q4_K", "Q6_K", "Q5_0"])
def test_gpu_column_split_gives_the_unsplit_bits(ggml_type):
    """On CUDA: the GLU's column split (config CS at 1 and 2 n-tiles a threadgroup) gives the
    unsplit kernel's bits at M = 13, 20 and 32 on both shapes, outputs NaN-poisoned."""
    t, nan = ggml_type, float("nan")
    for f, k, raw, w in _gpu_weights(t, 5):
        x = _x((32, k), mx.bfloat16, f + 7, raw, t)
        for m in (13, 20, 32):
            cfg = MM.with_columns(MM.glu_launch_config(t, m, f, k), 4)  # unsplit
            plain = G.dense_glu_mma_kernel(x[:m], w, t, k, config=cfg, init_value=nan)
            _check_glu(plain, x[:m], raw, t, k, "silu")
            for tiles in (1, 2):
                split = MM.with_columns(cfg, tiles)
                y = G.dense_glu_mma_kernel(x[:m], w, t, k, config=split, init_value=nan)
                assert _same(y, plain), f"{f}x{k} M = {m} {split}"


@requires_gpu
def test_gpu_dispatcher_takes_the_mma_kernel(monkeypatch):
    """dense_glu on CUDA with bf16 x picks the mma kernel at M = 1, 5 and 32 (equal to the kernel
    called directly, near the scalar kernel); with ENABLED off, the scalar kernel; for a type
    not GPU-verified (Q5_K), the mma kernel only with ALL_TYPES."""
    if backend() != "cuda":
        pytest.skip("the mma kernel runs on CUDA only")
    monkeypatch.setattr(G, "_DENSE", {})
    t, f, k = T.Q4_K, 2816, 2816
    raw = _experts(t, 1, 2 * f, k, seed=3)
    w = mx.array(raw[0])
    for m in (1, 5, 32):
        x = _x((m, k), mx.bfloat16, m, raw, t)
        y = G.dense_glu(x, w, t, k)
        assert np.array_equal(_bits(y), _bits(G.dense_glu_mma_kernel(x, w, t, k)))
        scalar = G.dense_glu_kernel(x, w, t, k, config=G.dense_config(t, m, f, k))
        _check_glu(y, x, raw, t, k, "silu")
        _check_glu(scalar, x, raw, t, k, "silu")
    monkeypatch.setattr(MM, "ENABLED", False)
    assert np.array_equal(_bits(G.dense_glu(x, w, t, k)), _bits(scalar))
    # a type not GPU-verified (Q5_K, taken out of the set): the scalar kernel unless ALL_TYPES
    monkeypatch.setattr(MM, "ENABLED", True)
    monkeypatch.setattr(MM, "GLU_GPU_VERIFIED", MM.GLU_GPU_VERIFIED - {T.Q5_K})
    t = T.Q5_K
    raw = _experts(t, 1, 2 * f, k, seed=4)
    w = mx.array(raw[0])
    x = _x((5, k), mx.bfloat16, 5, raw, t)
    mma = G.dense_glu_mma_kernel(x, w, t, k)
    scalar = G.dense_glu_kernel(x, w, t, k, config=G.dense_config(t, 5, f, k))
    for all_types, expected in ((False, scalar), (True, mma)):
        monkeypatch.setattr(MM, "ALL_TYPES", all_types)
        monkeypatch.setattr(G, "_DENSE", {})
        assert np.array_equal(_bits(G.dense_glu(x, w, t, k)), _bits(expected))
