"""The routed experts past the expert kernels' tokens (prefill), HF2Q_EXPERT_PREFILL: the switch,
the "dequant" path (experts dequantized to x.dtype in row slices, gather_mm in x.dtype) and the
"grouped" path (the grouped tensor-core kernels over slices of 32 tokens, each slice's inputs
copied into buffers of their own unless HF2Q_GROUPED_SLICE_COPY=0) against fp32 math: on the CPU
with the kernels emulated, on a GPU at Gemma-4-26B-A4B's and Qwen3.5-35B-A3B's expert widths.

Tolerance (bf16 / fp16 x): the relative 2-norm error of the whole output against fp32 math at
most twice that of the same math run in x.dtype with plain MLX ops (weights rounded to x.dtype
once, fp32 sums, projections rounded, activation or slot sum in x.dtype: what the dense layers'
many-rows path does), the flash-attention rule; and every row within GROSS of fp32 math (a row
from a wrong expert or a wrong token is off by ~100 %). fp32 x: FP32_TOL per row.
"""

from __future__ import annotations

import os
import subprocess
import sys

import kernel_emulator
import mlx.core as mx
import numpy as np
import pytest
import test_expert_down as TD
from conftest import requires_gpu
from gguf import GGMLQuantizationType as T
from test_expert_glu import _bits, _check, _experts, _ids, _x

from hf2q_mlx.custom_kernels import activations, backend
from hf2q_mlx.custom_kernels import dequant as DQ
from hf2q_mlx.custom_kernels import expert_down as D
from hf2q_mlx.custom_kernels import expert_glu as G
from hf2q_mlx.custom_kernels import expert_matmul as EXM
from hf2q_mlx.custom_kernels import expert_mma as EM
from hf2q_mlx.custom_kernels._render import Kernel
from hf2q_mlx.custom_kernels.dequant import dequantize_reference
from hf2q_mlx.errors import InvalidArgumentError

GROSS = 0.05  # per row: ~13 bf16 ulps of relative error; a misrouted row is off by ~1
FP32_TOL = 1e-5  # fp32 math in another order: ~sqrt(K) ulps (test_expert_glu.FP32_TOL)
E_EMU, K_SLOTS, F_EMU = 6, 3, 20

needs_gxx = pytest.mark.skipif(not kernel_emulator.available(), reason="g++ is not installed")


def _rel(out: mx.array, ref: np.ndarray, axis=None) -> np.ndarray:
    got = np.array(out.astype(mx.float32)).astype(np.float64)
    assert not np.isnan(got).any(), "NaN outputs (an unwritten row or a poisoned expert read)"
    return np.linalg.norm(got - ref, axis=axis) / np.maximum(np.linalg.norm(ref, axis=axis), 1e-30)


def _assert_within(out: mx.array, ref: np.ndarray, same_dtype: mx.array) -> None:
    """``out`` against fp32 ``ref``: at most twice the error of the x.dtype run ``same_dtype``
    over the whole output, every row within GROSS."""
    err, bound = _rel(out, ref), 2 * _rel(same_dtype, ref)
    assert err <= bound, f"relative error {err:.3g} > twice the x.dtype run's ({bound:.3g})"
    rows = _rel(out, ref, axis=-1)
    assert (rows <= GROSS).all(), f"row error {rows.max():.3g} > {GROSS}"


_DEQ: dict = {}  # (raw's id, type, K, dtype) -> experts dequantized, numpy fp32


def _deq(raw: np.ndarray, t: int, K: int, dtype) -> np.ndarray:
    """All experts dequantized (fp32 reference), rounded to ``dtype`` once, as fp32 numpy;
    cached (test_expert_glu._experts keeps each raw array alive)."""
    key = (id(raw), t, K, dtype)
    if key not in _DEQ:
        with mx.stream(mx.cpu):
            if dtype == mx.float32:
                w = dequantize_reference(mx.array(raw), t, K)
            else:
                w = mx.array(_deq(raw, t, K, mx.float32)).astype(dtype).astype(mx.float32)
            _DEQ[key] = np.array(w)
    return _DEQ[key]


def _gather(xs: mx.array, w: np.ndarray, ids: mx.array) -> np.ndarray:
    """fp32 products of x rows (..., k, K) or (..., K) (one per token) and the experts w (E, N,
    K) the ids (..., k) select -> (..., k, N) fp32 numpy, one BLAS matmul per expert."""
    X = np.array(xs.astype(mx.float32))
    idx = np.array(ids).reshape(-1).astype(np.int64)
    if X.ndim == ids.ndim:  # one x row per token, shared by its k slots
        X = np.broadcast_to(X[..., None, :], (*ids.shape, X.shape[-1]))
    X = X.reshape(idx.size, -1)
    out = np.empty((idx.size, w.shape[1]), np.float32)
    for e in np.unique(idx):
        sel = idx == e
        out[sel] = X[sel] @ w[e].T
    return out.reshape(*ids.shape, w.shape[1])


def _glu_same_dtype(x, raw, ids, t, K, act) -> mx.array:
    """The two-step GLU in x.dtype with plain ops: x.dtype weights, fp32 sums, the gate_up
    projection rounded to x.dtype, the activation of the rounded values."""
    gu = mx.array(_gather(x, _deq(raw, t, K, x.dtype), ids)).astype(x.dtype)
    with mx.stream(mx.cpu):
        return activations.gated_activation_reference(gu, None, act)


def _down_same_dtype(h, raw, ids, wts, t, K) -> mx.array:
    """The down projections and their weighted sum in h.dtype with plain ops."""
    y = mx.array(_gather(h, _deq(raw, t, K, h.dtype), ids)).astype(h.dtype)
    with mx.stream(mx.cpu):
        return (y * wts[..., None].astype(h.dtype)).sum(axis=-2)


def _glu_ref(x, raw, ids, t, K, act) -> np.ndarray:
    """fp32 act(gate) * up (float64 numpy)."""
    gu = mx.array(_gather(x, _deq(raw, t, K, mx.float32), ids))
    with mx.stream(mx.cpu):
        return np.array(activations.gated_activation_reference(gu, None, act)).astype(np.float64)


def _down_ref(h, raw, ids, wts, t, K) -> np.ndarray:
    """fp32 weighted sum of the down projections (float64 numpy)."""
    y = _gather(h, _deq(raw, t, K, mx.float32), ids).astype(np.float64)
    return (y * np.array(wts)[..., None]).sum(axis=-2)


def _half_gather_mm(real):
    """MLX's CPU gather_mm is fp32-only: this stands in for the GPU's fp16 / bf16 one (inputs
    exact in fp32, fp32 sums, one rounding to the inputs' dtype)."""

    def gather_mm(a, b, *args, **kwargs):
        dt = a.dtype
        return real(a.astype(mx.float32), b.astype(mx.float32), *args, **kwargs).astype(dt)

    return gather_mm


@pytest.fixture
def fake_gpu(monkeypatch):
    """The dispatchers see a CUDA back end; every kernel they launch runs on the emulator."""
    if not kernel_emulator.available():
        pytest.skip("g++ is not installed")
    for mod in (EXM, G, D, EM):
        monkeypatch.setattr(mod, "backend", lambda: "cuda")
    monkeypatch.setattr(Kernel, "launcher", kernel_emulator.kernel_launcher)
    monkeypatch.setattr(Kernel, "__call__", kernel_emulator.kernel_call)
    for mod, name in ((EXM, "_CALLS"), (G, "_CALLS"), (D, "_CALLS"), (EM, "_GLU_CALLS"),
                      (EM, "_DOWN_CALLS"), (DQ, "_PLANS")):  # fmt: skip
        monkeypatch.setattr(mod, name, {})
    monkeypatch.setattr(mx, "gather_mm", _half_gather_mm(mx.gather_mm))


def _count_dequant(monkeypatch) -> list:
    """Records the dtype of each GPU dequantization expert_matmul launches."""
    calls, real = [], EXM.ggml_dequantize_kernel

    def counted(w, t, k, dtype):
        calls.append(dtype)
        return real(w, t, k, dtype)

    monkeypatch.setattr(EXM, "ggml_dequantize_kernel", counted)
    return calls


# --------------------------------------------------------------------------------------------
# The switch


def test_prefill_mode_parses_and_rejects(monkeypatch):
    """Each mode as named (case and spaces ignored), "auto" as PREFILL_AUTO; any other value an
    InvalidArgumentError naming the variable."""
    for mode in ("dequant32", "dequant", "grouped", "grouped-wide"):
        monkeypatch.setattr(EXM, "PREFILL", mode)
        assert EXM.prefill_mode() == mode
    monkeypatch.setattr(EXM, "PREFILL", " Grouped ")
    assert EXM.prefill_mode() == "grouped"
    monkeypatch.setattr(EXM, "PREFILL", "GROUPED-WIDE")
    assert EXM.prefill_mode() == "grouped-wide"
    monkeypatch.setattr(EXM, "PREFILL", "auto")
    assert EXM.prefill_mode() == EXM.PREFILL_AUTO == "grouped-wide"
    for bad in ("fp8", "", "dequant16", "grouped-view"):
        monkeypatch.setattr(EXM, "PREFILL", bad)
        with pytest.raises(InvalidArgumentError, match="HF2Q_EXPERT_PREFILL"):
            EXM.prefill_mode()


def _printed_at_import(code: str, var: str, value: str | None) -> str:
    """What ``code`` prints in a fresh interpreter with ``var`` set to ``value`` (None: unset);
    the switches below are read once, at import."""
    env = {k: v for k, v in os.environ.items() if k != var}
    if value is not None:
        env[var] = value
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_env_var_sets_the_default():
    """HF2Q_EXPERT_PREFILL is read at import; unset: "auto"."""
    code = (
        "from hf2q_mlx.custom_kernels import expert_matmul as m; print(m.PREFILL, m.prefill_mode())"
    )
    for value, want in (("dequant", "dequant dequant"), (None, "auto grouped-wide")):
        assert _printed_at_import(code, "HF2Q_EXPERT_PREFILL", value) == want


def test_slice_copy_env_var():
    """HF2Q_GROUPED_SLICE_COPY is read at import: "0" off, unset or "1" on."""
    code = "from hf2q_mlx.custom_kernels import expert_matmul as m; print(m.GROUPED_SLICE_COPY)"
    for value, want in (("0", "False"), ("1", "True"), (None, "True")):
        assert _printed_at_import(code, "HF2Q_GROUPED_SLICE_COPY", value) == want


def _ptr(a: mx.array) -> int:
    """The address of a's first element (its buffer's start plus its offset)."""
    mx.eval(a)
    return np.frombuffer(memoryview(a), dtype=np.uint8).ctypes.data


def _inside(a: mx.array, parent: mx.array) -> bool:
    """Whether ``a`` is a view into ``parent``'s buffer at a nonzero offset."""
    p, q = _ptr(parent), _ptr(a)
    return p < q < p + parent.nbytes


@pytest.mark.parametrize("copy", [True, False])
@pytest.mark.parametrize("dtype", [mx.float32, mx.uint32, mx.bfloat16])
def test_owned_rows(monkeypatch, copy, dtype):
    """owned_rows(a, i, j) equals a[i:j] (2-D and 3-D, a short last slice, bits); with the copy
    on, a buffer of its own (not inside a's), off, the view at its offset into a's."""
    monkeypatch.setattr(EXM, "GROUPED_SLICE_COPY", copy)
    for shape in ((70, 5), (70, 3, 4)):
        a = (100 * mx.random.uniform(shape=shape, key=mx.random.key(7))).astype(dtype)
        for i, j in ((0, 32), (32, 64), (64, 70)):
            got = EXM.owned_rows(a, i, j)
            assert got.shape == (j - i, *shape[1:]) and got.dtype == dtype
            assert np.array_equal(_bits(got), _bits(a[i:j]))
            if i > 0:
                assert _inside(got, a) is not copy


# --------------------------------------------------------------------------------------------
# "dequant": CPU, the dequantizer emulated

# (type, x dtype, tokens, per-slot x, batch dims, rows per dequantized slice): K of two
# super-blocks / eleven 32-blocks; slices of 7 rows over 2F = 40 (6 slices, the last of 5)
_DEQ_CASES = [
    (T.Q4_K, mx.bfloat16, 33, False, False, 7),
    (T.Q5_0, mx.float16, 40, True, False, None),
    (T.Q8_0, mx.bfloat16, 34, False, True, 16),
]


@pytest.mark.usefixtures("fake_gpu")
@pytest.mark.parametrize("case", range(len(_DEQ_CASES)))
def test_dequant_path_matches_fp32(monkeypatch, case):
    """The GLU's gate_up projection through expert_matmul with PREFILL "dequant": experts
    dequantized in x.dtype (one launch per row slice), within the bound; flipped to
    "dequant32" in the same process, the fp32 dequantization again."""
    t, dt, m, per_slot, batched, rows = _DEQ_CASES[case]
    K = 256 * 2 if t == T.Q4_K else 32 * 11
    raw = _experts(t, E_EMU, 2 * F_EMU, K, seed=case)
    ids = _ids(m, K_SLOTS, E_EMU, seed=200 + case)
    x = _x((m, K_SLOTS, K) if per_slot else (m, K), dt, 300 + case, raw, t)
    calls = _count_dequant(monkeypatch)
    if rows is not None:  # PREFILL_DEQ_CHUNK // (E * K) rows per slice
        monkeypatch.setattr(EXM, "PREFILL_DEQ_CHUNK", rows * E_EMU * K + E_EMU * K // 2)
    monkeypatch.setattr(EXM, "PREFILL", "dequant")
    xs, ii = x, ids
    if batched:  # ids (2, m / 2, k): the output in the ids' shape
        xs, ii = x.reshape(2, m // 2, K), ids.reshape(2, m // 2, K_SLOTS)
    y = G.expert_glu(xs, mx.array(raw), ii, t, K, "gelu_tanh")
    assert y.shape == (*ii.shape, F_EMU) and y.dtype == dt
    y = y.reshape(m, K_SLOTS, F_EMU)
    slices = -(-2 * F_EMU // rows) if rows is not None else 1
    assert calls == [dt] * slices
    ref = _glu_ref(x, raw, ids, t, K, "gelu_tanh")
    _assert_within(y, ref, _glu_same_dtype(x, raw, ids, t, K, "gelu_tanh"))
    calls.clear()
    monkeypatch.setattr(EXM, "PREFILL", "dequant32")
    y32 = G.expert_glu(x, mx.array(raw), ids, t, K, "gelu_tanh")
    assert calls == [mx.float32]
    _assert_within(y32, ref, _glu_same_dtype(x, raw, ids, t, K, "gelu_tanh"))


@pytest.mark.usefixtures("fake_gpu")
def test_dequant_path_down(monkeypatch):
    """The down projections' weighted sum with PREFILL "dequant" (26B's down type, Q5_0),
    within the bound."""
    t, K, m = T.Q5_0, 32 * 11, 37
    raw = _experts(t, E_EMU, F_EMU, K, seed=9)
    ids, wts = TD._route(m, K_SLOTS, E_EMU, seed=10)
    h = TD._h((m, K_SLOTS, K), mx.bfloat16, 11)
    calls = _count_dequant(monkeypatch)
    monkeypatch.setattr(EXM, "PREFILL", "dequant")
    y = D.expert_down(h, mx.array(raw), ids, wts, t, K)
    assert calls == [mx.bfloat16] and y.shape == (m, F_EMU) and y.dtype == mx.bfloat16
    ref = _down_ref(h, raw, ids, wts, t, K)
    _assert_within(y, ref, _down_same_dtype(h, raw, ids, wts, t, K))


@pytest.mark.usefixtures("fake_gpu")
def test_fp32_x_keeps_its_fp32_path(monkeypatch):
    """fp32 x under every mode: the fp32 kernel over slices (_fp32_by_slices), no dequant."""
    seen = []
    monkeypatch.setattr(EXM, "_fp32_by_slices", lambda x, w, ids, t, K: seen.append(x.dtype)
                        or mx.zeros((*ids.shape, w.shape[1]), x.dtype))  # fmt: skip
    calls = _count_dequant(monkeypatch)
    t, K = T.Q4_K, 512
    raw = mx.array(_experts(t, E_EMU, 2 * F_EMU, K, seed=0))
    x, ids = mx.random.normal((40, K)), _ids(40, K_SLOTS, E_EMU, seed=1)
    for mode in ("dequant32", "dequant", "grouped", "grouped-wide"):
        monkeypatch.setattr(EXM, "PREFILL", mode)
        G.expert_glu(x, raw, ids, t, K)
    assert seen == [mx.float32] * 4 and not calls


# --------------------------------------------------------------------------------------------
# "grouped": CPU, every kernel emulated


def _grouped_case(t, m: int, seed: int):
    K = 512
    raw = _experts(t, E_EMU, 2 * F_EMU, K, seed=seed)
    ids = _ids(m, K_SLOTS, E_EMU, seed=seed + 1)
    return raw, _x((m, K), mx.bfloat16, seed + 2, raw, t), ids, K


def _recording(monkeypatch) -> list:
    """Records (kernel name, inputs) of every emulated launch."""
    launched, real = [], kernel_emulator.kernel_launcher

    def launcher(self, input_dtypes, **launch):
        run = real(self, input_dtypes, **launch)

        def recorded(inputs):
            launched.append((self.name, list(inputs)))
            return run(inputs)

        return recorded

    monkeypatch.setattr(Kernel, "launcher", launcher)
    return launched


def _check_inputs(launched: list, parents: list, copy: bool) -> None:
    """With the copy on no kernel input is a view into ``parents`` at an offset; off, some are
    (the slices past the first: what this test would miss if it could not tell)."""
    views = sum(_inside(a, p) for _, inputs in launched for a in inputs for p in parents)
    assert (views == 0) if copy else (views > 0), f"{views} inputs are views at an offset"


def _fresh(a: mx.array) -> mx.array:
    """A copy of ``a`` made on the host: a buffer of its own whatever MLX does with views."""
    if a.dtype == mx.bfloat16:
        return mx.array(np.array(a.view(mx.uint16))).view(mx.bfloat16)
    return mx.array(np.array(a))


def _slices(m: int, k: int = K_SLOTS) -> list[tuple[int, int]]:
    """The first two slices of a grouped prefill and its last (a view read from its parent's
    start would first differ in the second)."""
    step = G.grouped_slice_tokens(k)
    every = [(i, min(i + step, m)) for i in range(0, m, step)]
    return every[:2] + every[2:][-1:]


# slice copies on at every size, off (views) at one: both right on the H200 (session 13)
SLICE_CASES = [(33, True), (96, True), (100, True), (100, False)]


@pytest.mark.usefixtures("fake_gpu")
@pytest.mark.parametrize("m,copy", SLICE_CASES)
def test_grouped_glu_slices(monkeypatch, m, copy):
    """PREFILL "grouped": slices of 32 tokens through the grouped kernel (each slice's bits
    those of grouped_expert_glu on it alone: the first two and the last), a short tail through
    the kernel its size takes (its bits those of the dispatcher on it alone); within the bf16
    bound of fp32 math per (token, slot). The slices' inputs copied or views as
    GROUPED_SLICE_COPY says."""
    t = T.Q4_K
    raw, x, ids, K = _grouped_case(t, m, seed=40 + m)
    w = mx.array(raw)
    monkeypatch.setattr(EXM, "GROUPED_SLICE_COPY", copy)
    monkeypatch.setattr(EXM, "PREFILL", "grouped")
    calls = _count_dequant(monkeypatch)
    launched = _recording(monkeypatch)
    y = G.expert_glu(x, w, ids, t, K, "silu")
    assert not calls and y.shape == (m, K_SLOTS, F_EMU)
    assert [n for n, _ in launched].count(EM._GLU_KERNELS[t].name) == m // 32
    _check_inputs(launched, [x, ids], copy)
    _check(y, x, raw[:, :F_EMU], raw[:, F_EMU:], ids, t, K, "silu")
    for i, j in _slices(m):
        xi, ii = _fresh(x[i:j]), _fresh(ids[i:j])
        if j - i == 32:
            want = EM.grouped_expert_glu(xi, w, ii, t, K, "silu")
        else:
            want = G.expert_glu(xi, w, ii, t, K, "silu")
        assert np.array_equal(_bits(y[i:j]), _bits(want)), f"tokens {i}:{j}"


@pytest.mark.usefixtures("fake_gpu")
@pytest.mark.parametrize("m,copy", SLICE_CASES)
def test_grouped_down_slices(monkeypatch, m, copy):
    """The down with PREFILL "grouped": within the bf16 bound per token, the 32-token slices'
    bits (the first two, the last) those of grouped_expert_down on each alone, a tail's those of
    the dispatcher."""
    t, K = T.Q4_K, 512
    raw = _experts(t, E_EMU, F_EMU, K, seed=3)
    ids, wts = TD._route(m, K_SLOTS, E_EMU, seed=4 + m)
    h = TD._h((m, K_SLOTS, K), mx.bfloat16, 5 + m)
    w = mx.array(raw)
    monkeypatch.setattr(EXM, "GROUPED_SLICE_COPY", copy)
    monkeypatch.setattr(EXM, "PREFILL", "grouped")
    calls = _count_dequant(monkeypatch)
    launched = _recording(monkeypatch)
    y = D.expert_down(h, w, ids, wts, t, K)
    assert not calls
    assert [n for n, _ in launched].count(EM._DOWN_KERNELS[t].name) == m // 32
    _check_inputs(launched, [h, ids, wts], copy)
    TD._check(y, h, raw, ids, wts, t, K)
    for i, j in _slices(m):
        hi, ii, wi = (_fresh(a[i:j]) for a in (h, ids, wts))
        if j - i == 32:
            want = EM.grouped_expert_down(hi, w, ii, wi, t, K)
        else:
            want = D.expert_down(hi, w, ii, wi, t, K)
        assert np.array_equal(_bits(y[i:j]), _bits(want)), f"tokens {i}:{j}"


def _by_32(m: int) -> list[tuple[int, int]]:
    return [(i, min(i + 32, m)) for i in range(0, m, 32)]


@pytest.mark.usefixtures("fake_gpu")
@pytest.mark.parametrize("m,nt", [(33, 1), (33, 4), (100, 2)])
def test_grouped_wide_glu(monkeypatch, m, nt):
    """PREFILL "grouped-wide": slices of WIDE_PAIRS // k tokens (lowered here to 40), each one
    launch of the wide kernel, the last one too; no 32-token kernel, no dequantization. Every
    32 tokens' bits are those of the 32-token grouped kernel on them alone (a pair's bits do
    not depend on which pairs share its expert, nor on the n-tiles per column group: the wide
    kernels run WIDE_NT of them, the 32-token ones 1); within the bf16 bound of fp32 math."""
    t = T.Q4_K
    raw, x, ids, K = _grouped_case(t, m, seed=140 + m)
    w = mx.array(raw)
    monkeypatch.setattr(EM, "WIDE_NT", nt)
    monkeypatch.setenv("HF2Q_GROUPED_SORTED", "0")  # the scanning kernels (sorted: below)
    monkeypatch.setattr(EXM, "PREFILL", "grouped-wide")
    monkeypatch.setattr(EM, "WIDE_PAIRS", 40 * K_SLOTS)
    calls = _count_dequant(monkeypatch)
    launched = _recording(monkeypatch)
    y = G.expert_glu(x, w, ids, t, K, "silu")
    names = [n for n, _ in launched]
    assert not calls and y.shape == (m, K_SLOTS, F_EMU)
    assert names == [EM._GLU_WIDE[t].name] * -(-m // 40), names
    _check(y, x, raw[:, :F_EMU], raw[:, F_EMU:], ids, t, K, "silu")
    for i, j in _by_32(m):
        want = EM.grouped_expert_glu(_fresh(x[i:j]), w, _fresh(ids[i:j]), t, K, "silu")
        assert np.array_equal(_bits(y[i:j]), _bits(want)), f"tokens {i}:{j}"


@pytest.mark.usefixtures("fake_gpu")
@pytest.mark.parametrize("m", [33, 100])
def test_grouped_wide_down(monkeypatch, m):
    """The down with PREFILL "grouped-wide": one wide projection launch (and its slot sum) per
    slice of 40 tokens here; every 32 tokens' bits those of the 32-token grouped kernels on
    them alone; within the bf16 bound."""
    t, K = T.Q4_K, 512
    raw = _experts(t, E_EMU, F_EMU, K, seed=13)
    ids, wts = TD._route(m, K_SLOTS, E_EMU, seed=14 + m)
    h = TD._h((m, K_SLOTS, K), mx.bfloat16, 15 + m)
    w = mx.array(raw)
    monkeypatch.setenv("HF2Q_GROUPED_SORTED", "0")
    monkeypatch.setattr(EXM, "PREFILL", "grouped-wide")
    monkeypatch.setattr(EM, "WIDE_PAIRS", 40 * K_SLOTS)
    calls = _count_dequant(monkeypatch)
    launched = _recording(monkeypatch)
    y = D.expert_down(h, w, ids, wts, t, K)
    names = [n for n, _ in launched]
    assert not calls and y.shape == (m, F_EMU)
    assert names.count(EM._DOWN_WIDE[t].name) == -(-m // 40)
    assert EM._DOWN_KERNELS[t].name not in names
    TD._check(y, h, raw, ids, wts, t, K)
    for i, j in _by_32(m):
        hi, ii, wi = (_fresh(a[i:j]) for a in (h, ids, wts))
        want = EM.grouped_expert_down(hi, w, ii, wi, t, K)
        assert np.array_equal(_bits(y[i:j]), _bits(want)), f"tokens {i}:{j}"


def test_expert_order_lists_each_experts_pairs():
    """expert_order: every pair once; expert e's pairs at order[offs[e]:offs[e + 1]], ids past
    the last expert (and negative ones, as uint32) in bucket E; an expert nobody chose empty."""
    E = 5
    ids = mx.array([[3, 0], [7, 3], [0, 4294967295], [4, 3]], dtype=mx.uint32)
    order, offs = EM.expert_order(ids, E)
    order, offs, flat = np.array(order), np.array(offs), np.array(ids).reshape(-1)
    assert sorted(order.tolist()) == list(range(flat.size)) and offs.shape == (E + 2,)
    assert offs[0] == 0 and offs[-1] == flat.size
    for e in range(E + 1):
        got = sorted(order[offs[e] : offs[e + 1]].tolist())
        want = [p for p in range(flat.size) if min(int(flat[p]), E) == e]
        assert got == want, e
    assert offs[2] == offs[1]  # expert 1: no pair


def _with_bad_ids(ids: mx.array) -> mx.array:
    """A few ids past the last expert (NaN rows from both kernels)."""
    a = np.array(ids).copy()
    a[1, 0], a[-1, -1] = E_EMU + 2, 4294967295
    return mx.array(a)


@pytest.mark.usefixtures("fake_gpu")
@pytest.mark.parametrize("m", [33, 100])
def test_grouped_sorted_glu_gives_the_scans_bits(monkeypatch, m):
    """HF2Q_GROUPED_SORTED=1: the wide GLU's sorted kernel (one launch per slice of 40 tokens
    here) gives the scanning kernel's bits everywhere, NaN rows of bad ids included (outputs
    poisoned before each launch by the emulator)."""
    t = T.Q4_K
    raw, x, ids, K = _grouped_case(t, m, seed=240 + m)
    ids, w = _with_bad_ids(ids), mx.array(raw)
    monkeypatch.setattr(EXM, "PREFILL", "grouped-wide")
    monkeypatch.setattr(EM, "WIDE_PAIRS", 40 * K_SLOTS)
    monkeypatch.setenv("HF2Q_GROUPED_SORTED", "0")
    want = G.expert_glu(x, w, ids, t, K, "silu")
    monkeypatch.setenv("HF2Q_GROUPED_SORTED", "1")
    launched = _recording(monkeypatch)
    got = G.expert_glu(x, w, ids, t, K, "silu")
    assert [n for n, _ in launched] == [EM._GLU_SORTED[t].name] * -(-m // 40)
    assert np.isnan(np.array(got[1, 0].astype(mx.float32))).all()
    assert np.array_equal(_bits(got), _bits(want))


@pytest.mark.usefixtures("fake_gpu")
@pytest.mark.parametrize("m", [33, 100])
def test_grouped_sorted_down_gives_the_scans_bits(monkeypatch, m):
    """The down's sorted kernel: the scanning kernel's bits (a bad id's token NaN in both)."""
    t, K = T.Q4_K, 512
    raw = _experts(t, E_EMU, F_EMU, K, seed=23)
    ids, wts = TD._route(m, K_SLOTS, E_EMU, seed=24 + m)
    ids = _with_bad_ids(ids)
    h = TD._h((m, K_SLOTS, K), mx.bfloat16, 25 + m)
    w = mx.array(raw)
    monkeypatch.setattr(EXM, "PREFILL", "grouped-wide")
    monkeypatch.setattr(EM, "WIDE_PAIRS", 40 * K_SLOTS)
    monkeypatch.setenv("HF2Q_GROUPED_SORTED", "0")
    want = D.expert_down(h, w, ids, wts, t, K)
    monkeypatch.setenv("HF2Q_GROUPED_SORTED", "1")
    launched = _recording(monkeypatch)
    got = D.expert_down(h, w, ids, wts, t, K)
    assert [n for n, _ in launched].count(EM._DOWN_SORTED[t].name) == -(-m // 40)
    assert EM._DOWN_WIDE[t].name not in [n for n, _ in launched]
    assert np.isnan(np.array(got[1].astype(mx.float32))).all()
    assert np.array_equal(_bits(got), _bits(want))


@pytest.mark.usefixtures("fake_gpu")
def test_grouped_wide_x_groups_give_the_same_bits(monkeypatch):
    """HF2Q_MMA_XG (read at each wide call): the sorted wide GLU and down with a block's x
    fragments loaded 4 and 16 scale groups at a time give XG = 1's bits (Q4_K: 8 groups a
    block), bad ids' NaN rows included; the launches' templates carry the value."""
    t, m = T.Q4_K, 40
    raw, x, ids, K = _grouped_case(t, m, seed=260)
    ids, w = _with_bad_ids(ids), mx.array(raw)
    down_raw = mx.array(_experts(t, E_EMU, F_EMU, K, seed=261))
    h = TD._h((m, K_SLOTS, K), mx.bfloat16, 262)
    wts = mx.softmax(mx.array(np.random.default_rng(263).normal(size=ids.shape), mx.float32), -1)
    monkeypatch.setattr(EXM, "PREFILL", "grouped-wide")
    monkeypatch.setattr(EM, "WIDE_PAIRS", 40 * K_SLOTS)
    monkeypatch.setenv("HF2Q_GROUPED_SORTED", "1")
    outs = {}
    for xg in ("1", "4", "16"):
        monkeypatch.setenv("HF2Q_MMA_XG", xg)
        launched = _recording(monkeypatch)
        outs[xg] = (
            G.expert_glu(x, w, ids, t, K, "silu"),
            D.expert_down(h, down_raw, ids, wts, t, K),
        )
        assert EM._GLU_SORTED[t].name in [n for n, _ in launched]
        assert EM.wide_config(t, K)["XG"] == int(xg)
    for xg in ("4", "16"):
        assert np.array_equal(_bits(outs[xg][0]), _bits(outs["1"][0])), xg
        assert np.array_equal(_bits(outs[xg][1]), _bits(outs["1"][1])), xg
    assert np.isnan(np.array(outs["16"][0][1, 0].astype(mx.float32))).all()
    wide = [p for k, p in EM._GLU_CALLS.items() if p is not None and k[3]]
    assert {dict(p.template)["XG"] for p in wide} >= {1, 4, 16}


def test_wide_nt_must_be_1_2_or_4(monkeypatch):
    """HF2Q_GROUPED_WIDE_NT: 2 unset; 1, 2, 4 taken (spaces ignored); anything else an
    InvalidArgumentError naming the variable at the first wide launch, never at import."""
    monkeypatch.delenv("HF2Q_GROUPED_WIDE_NT", raising=False)
    assert EM.wide_config(T.Q4_K, 512)["NT"] == 2 and EM.WIDE_NT == "2"  # the default
    monkeypatch.setattr(EM, "WIDE_NT", " 4 ")
    assert EM.wide_config(T.Q4_K, 512)["NT"] == 4
    for bad in ("3", "x", "", "2.0"):
        monkeypatch.setattr(EM, "WIDE_NT", bad)
        with pytest.raises(InvalidArgumentError, match="HF2Q_GROUPED_WIDE_NT"):
            EM.wide_config(T.Q4_K, 512)
    code = "from hf2q_mlx.custom_kernels import expert_mma as m; print(m.WIDE_NT)"
    assert _printed_at_import(code, "HF2Q_GROUPED_WIDE_NT", "x") == "x"
    # set at call time, the environment wins over the import's value (in-process A/B runs)
    monkeypatch.setattr(EM, "WIDE_NT", "2")
    monkeypatch.setenv("HF2Q_GROUPED_WIDE_NT", "1")
    assert EM.wide_config(T.Q4_K, 512)["NT"] == 1
    monkeypatch.setenv("HF2Q_GROUPED_WIDE_NT", "8")
    with pytest.raises(InvalidArgumentError, match="HF2Q_GROUPED_WIDE_NT='8'"):
        EM.wide_config(T.Q4_K, 512)


def test_wide_kernel_capacity():
    """One wide launch takes WIDE_LIST pairs (512 tokens at top-8), not one more; the 32-token
    kernels MAX_PAIRS; the slice length follows WIDE_PAIRS."""
    assert G.grouped_slice_tokens(8, wide=True) == EM.WIDE_LIST // 8 == 512
    assert G.grouped_slice_tokens(8) == 32
    x = mx.zeros((EM.WIDE_LIST // 8 + 1, 256), mx.bfloat16)
    ids = mx.zeros((x.shape[0], 8), mx.uint32)
    with pytest.raises(ValueError, match="at most 4096"):
        EM._check_kernel_args(x, T.Q4_K, 256, ids, wide=True)
    EM._check_kernel_args(x[:-1], T.Q4_K, 256, ids[:-1], wide=True)
    with pytest.raises(ValueError, match="at most 256"):
        EM._check_kernel_args(x[:33], T.Q4_K, 256, ids[:33], wide=False)


@pytest.mark.usefixtures("fake_gpu")
def test_grouped_falls_back_where_not_covered(monkeypatch):
    """Grouped kernels switched off (HF2Q_GROUPED_EXPERTS=0): the dequant path in x.dtype."""
    monkeypatch.setattr(EM, "ENABLED", False)
    monkeypatch.setattr(EXM, "PREFILL", "grouped")
    calls = _count_dequant(monkeypatch)
    t = T.Q4_K
    raw, x, ids, K = _grouped_case(t, 33, seed=80)
    y = G.expert_glu(x, mx.array(raw), ids, t, K, "silu")
    assert calls == [mx.bfloat16]
    _assert_within(y, _glu_ref(x, raw, ids, t, K, "silu"),
                   _glu_same_dtype(x, raw, ids, t, K, "silu"))  # fmt: skip


@pytest.mark.usefixtures("fake_gpu")
def test_sorted_lists_made_once_for_a_layers_glu_and_down(monkeypatch):
    """A layer's GLU and down given the same ids array (as the models pass it): each slice's
    expert_order is made once and read by both; a down given another array with the same
    values makes its own, with the same bits out."""
    t, K, m = T.Q4_K, 512, 100
    raw, x, ids, _ = _grouped_case(t, m, seed=260)
    w = mx.array(raw)
    down_raw = _experts(t, E_EMU, F_EMU, K, seed=261)
    wd = mx.array(down_raw)
    _, wts = TD._route(m, K_SLOTS, E_EMU, seed=262)
    monkeypatch.setattr(EXM, "PREFILL", "grouped-wide")
    monkeypatch.setattr(EM, "WIDE_PAIRS", 40 * K_SLOTS)  # 3 slices: 40, 40, 20 tokens
    monkeypatch.setenv("HF2Q_GROUPED_SORTED", "1")
    made, real = [], EM.expert_order
    monkeypatch.setattr(EM, "expert_order", lambda i, e: made.append(i.shape) or real(i, e))
    G.expert_glu(x, w, ids, t, K, "silu")
    assert len(made) == 3
    h = TD._h((m, K_SLOTS, K), mx.bfloat16, 263)  # the down's input (its own K here)
    y_shared = D.expert_down(h, wd, ids, wts, t, K)
    assert len(made) == 3  # the GLU's lists
    y_own = D.expert_down(h, wd, mx.array(np.array(ids)), wts, t, K)
    assert len(made) == 6 and made[3:] == made[:3]
    assert np.array_equal(_bits(y_shared), _bits(y_own))


@pytest.mark.usefixtures("fake_gpu")
@pytest.mark.parametrize("mode", ["grouped", "grouped-wide"])
def test_models_ops_reach_the_grouped_prefill(monkeypatch, mode):
    """models/ops.expert_glu and expert_down on ExpertLinear modules (the models' call) take the
    grouped slices at 40 tokens: the dispatchers' bits, a grouped kernel (the mode's) launched."""
    import hf2q_mlx.custom_kernels as ck
    from hf2q_mlx.models import ops
    from hf2q_mlx.models.experts import ExpertLinear

    monkeypatch.setattr(ck, "backend", lambda: "cuda")  # ops.use_kernels()
    launched = _recording(monkeypatch)
    monkeypatch.setattr(EXM, "PREFILL", mode)
    t_gu, t_dn, H, F, m = T.Q4_K, T.Q8_0, 512, 32, 40  # down rows of K = F: Q8_0 (32-blocks)
    gate_up, down = ExpertLinear(E_EMU, H, 2 * F, t_gu), ExpertLinear(E_EMU, F, H, t_dn)
    gate_up.weight = mx.array(_experts(t_gu, E_EMU, 2 * F, H, seed=90))
    down.weight = mx.array(_experts(t_dn, E_EMU, H, F, seed=91))
    x = _x((m, H), mx.bfloat16, 92, np.array(gate_up.weight), t_gu)
    ids, wts = TD._route(m, K_SLOTS, E_EMU, seed=93)
    h = ops.expert_glu(x, ids, gate_up, None, "silu")
    names = [n for n, _ in launched]
    wide = mode == "grouped-wide"
    # wide: the sorted kernels, HF2Q_GROUPED_SORTED's default
    glu_k, down_k = (
        (EM._GLU_SORTED, EM._DOWN_SORTED) if wide else (EM._GLU_KERNELS, EM._DOWN_KERNELS)
    )
    assert glu_k[t_gu].name in names
    assert np.array_equal(_bits(h), _bits(G.expert_glu(x, gate_up.weight, ids, t_gu, H)))
    y = ops.expert_down(h, ids, wts, down)
    names = [n for n, _ in launched]
    assert down_k[t_dn].name in names
    assert np.array_equal(_bits(y), _bits(D.expert_down(h, down.weight, ids, wts, t_dn, F)))


# --------------------------------------------------------------------------------------------
# GPU: Gemma-4-26B-A4B's expert widths (gate_up 2 x 704 rows of K 2816, Q4_K; down 2816 rows of
# K 704, Q5_0), 32 experts (not 128: the fp32 references run on the CPU), top-8

_E, _K8, _F, _H = 32, 8, 704, 2816
# Qwen3.5-35B-A3B's (gate_up 2 x 512 rows of K 2048, Q4_K; down 2048 rows of K 512, Q4_K; SiLU)
_QWEN = (2048, 512, T.Q4_K, "silu")
_GEMMA = (_H, _F, T.Q5_0, "gelu_tanh")
_GPU_REFS: dict = {}


def _gpu_case(m: int, shape: tuple = _GEMMA):
    H, F, t_dn, act = shape
    if (m, shape) not in _GPU_REFS:
        gu = _experts(T.Q4_K, _E, 2 * F, H, seed=1)
        dn = _experts(t_dn, _E, H, F, seed=2)
        x = _x((m, H), mx.bfloat16, 3, gu, T.Q4_K)
        ids, wts = TD._route(m, _K8, _E, seed=4 + m)
        h = TD._h((m, _K8, F), mx.bfloat16, 5)
        refs = (
            _glu_ref(x, gu, ids, T.Q4_K, H, act),
            _glu_same_dtype(x, gu, ids, T.Q4_K, H, act),
            _down_ref(h, dn, ids, wts, t_dn, F),
            _down_same_dtype(h, dn, ids, wts, t_dn, F),
        )
        _GPU_REFS[m, shape] = (gu, dn, x, ids, wts, h, refs)
    return _GPU_REFS[m, shape]


def _by_mode(monkeypatch, modes: tuple, m: int, shape: tuple) -> dict:
    """mode -> (GLU, down) of the GPU case at each HF2Q_EXPERT_PREFILL mode, evaluated."""
    H, F, t_dn, act = shape
    gu, dn, x, ids, wts, h, _ = _gpu_case(m, shape)
    wg, wd = mx.array(gu), mx.array(dn)
    outs = {}
    for mode in modes:
        monkeypatch.setattr(EXM, "PREFILL", mode)
        outs[mode] = (G.expert_glu(x, wg, ids, T.Q4_K, H, act),
                      D.expert_down(h, wd, ids, wts, t_dn, F))  # fmt: skip
        mx.eval(*outs[mode])
    return outs


@requires_gpu
@pytest.mark.parametrize("m", [33, 100, 512])
def test_gpu_prefill_paths_match_fp32(monkeypatch, m):
    """Each path (dequant32, dequant) at T tokens: the GLU (GELU) and the down within the
    bound against fp32 math."""
    gu, dn, x, ids, wts, h, (g_ref, g_same, d_ref, d_same) = _gpu_case(m)
    wg, wd = mx.array(gu), mx.array(dn)
    for mode in ("dequant32", "dequant"):
        monkeypatch.setattr(EXM, "PREFILL", mode)
        y = G.expert_glu(x, wg, ids, T.Q4_K, _H, "gelu_tanh")
        yd = D.expert_down(h, wd, ids, wts, T.Q5_0, _F)
        mx.eval(y, yd)
        _assert_within(y, g_ref, g_same)
        _assert_within(yd, d_ref, d_same)


@requires_gpu
@pytest.mark.skipif(backend() != "cuda", reason="the grouped kernels are CUDA only")
@pytest.mark.parametrize("shape", [_GEMMA, _QWEN], ids=["26b-q5_0-down", "35b-q4_k-down"])
@pytest.mark.parametrize("m", [33, 100, 512])
def test_gpu_grouped_matches_dequant32(monkeypatch, m, shape):
    """ "grouped" (slice copies on) at T tokens, Q4_K gate/up and Q5_0 / Q4_K down: the GLU and
    the down within the bound against fp32 math; their difference from dequant32's output at
    most the bound plus dequant32's own error; the slices' bits (first two, last) those of the
    grouped kernels on each slice alone (a slice read at the wrong offset differs first there)."""
    H, F, t_dn, act = shape
    gu, dn, x, ids, wts, h, (g_ref, g_same, d_ref, d_same) = _gpu_case(m, shape)
    wg, wd = mx.array(gu), mx.array(dn)
    monkeypatch.setattr(EXM, "GROUPED_SLICE_COPY", True)
    monkeypatch.setenv("HF2Q_AVOID_MLX_JIT", "0")  # else the slices are views (its own test)
    outs = _by_mode(monkeypatch, ("dequant32", "grouped"), m, shape)
    (y, yd), (y32, yd32) = outs["grouped"], outs["dequant32"]
    for got, d32, ref, same in ((y, y32, g_ref, g_same), (yd, yd32, d_ref, d_same)):
        _assert_within(got, ref, same)
        diff = _rel(got, np.array(d32.astype(mx.float32)).astype(np.float64))
        bound = 2 * _rel(same, ref) + _rel(d32, ref)
        assert diff <= bound, f"grouped vs dequant32: {diff:.3g} > {bound:.3g}"
    for i, j in _slices(m, _K8):
        xi, ii, hi, wi = (_fresh(a[i:j]) for a in (x, ids, h, wts))
        if j - i == 32:
            want = EM.grouped_expert_glu(xi, wg, ii, T.Q4_K, H, act)
            want_d = EM.grouped_expert_down(hi, wd, ii, wi, t_dn, F)
        else:
            want = G.expert_glu(xi, wg, ii, T.Q4_K, H, act)
            want_d = D.expert_down(hi, wd, ii, wi, t_dn, F)
        assert np.array_equal(_bits(y[i:j]), _bits(want)), f"GLU tokens {i}:{j}"
        assert np.array_equal(_bits(yd[i:j]), _bits(want_d)), f"down tokens {i}:{j}"


@requires_gpu
@pytest.mark.skipif(backend() != "cuda", reason="the grouped kernels are CUDA only")
@pytest.mark.parametrize("shape", [_GEMMA, _QWEN], ids=["26b-q5_0-down", "35b-q4_k-down"])
@pytest.mark.parametrize("m", [100, 512, 1000])
def test_gpu_grouped_wide_matches_grouped(monkeypatch, m, shape):
    """ "grouped-wide" (one launch per 512 tokens) at T tokens: within the bound against fp32
    math, and every full 32 tokens' bits those of "grouped" (the 32-token kernels), since a
    pair's bits do not depend on the pairs sharing its expert (its tail of < 32 tokens takes
    another kernel there, so only the bound holds for it)."""
    *_, (g_ref, g_same, d_ref, d_same) = _gpu_case(m, shape)
    outs = _by_mode(monkeypatch, ("grouped", "grouped-wide"), m, shape)
    (y, yd), (y32, yd32) = outs["grouped-wide"], outs["grouped"]
    _assert_within(y, g_ref, g_same)
    _assert_within(yd, d_ref, d_same)
    full = m // 32 * 32
    assert np.array_equal(_bits(y[:full]), _bits(y32[:full]))
    assert np.array_equal(_bits(yd[:full]), _bits(yd32[:full]))


@requires_gpu
@pytest.mark.skipif(backend() != "cuda", reason="the grouped kernels are CUDA only")
@pytest.mark.parametrize("shape", [_GEMMA, _QWEN], ids=["26b-q5_0-down", "35b-q4_k-down"])
@pytest.mark.parametrize("m", [100, 512, 1000])
def test_gpu_grouped_sorted_matches_wide(monkeypatch, m, shape):
    """HF2Q_GROUPED_SORTED=1 on CUDA at the real widths: the GLU's and the down's bits those
    of the scanning wide kernels (the pairs of an expert are the same, only where they come
    from differs), and within the bound against fp32 math."""
    *_, (g_ref, g_same, d_ref, d_same) = _gpu_case(m, shape)
    monkeypatch.setenv("HF2Q_GROUPED_SORTED", "0")
    (y, yd) = _by_mode(monkeypatch, ("grouped-wide",), m, shape)["grouped-wide"]
    monkeypatch.setenv("HF2Q_GROUPED_SORTED", "1")
    (ys, yds) = _by_mode(monkeypatch, ("grouped-wide",), m, shape)["grouped-wide"]
    _assert_within(ys, g_ref, g_same)
    _assert_within(yds, d_ref, d_same)
    assert np.array_equal(_bits(ys), _bits(y))
    assert np.array_equal(_bits(yds), _bits(yd))
