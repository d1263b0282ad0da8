"""The routed experts past the expert kernels' tokens (prefill), HF2Q_EXPERT_PREFILL: the switch,
the "dequant" path (experts dequantized to x.dtype in row slices, gather_mm in x.dtype) against
fp32 math: on the CPU with the dequantizer emulated, on a GPU at Gemma-4-26B-A4B's expert widths.

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
from test_expert_glu import _experts, _ids, _x

from hf2q_mlx.custom_kernels import activations
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
    for mode in ("dequant32", "dequant"):
        monkeypatch.setattr(EXM, "PREFILL", mode)
        assert EXM.prefill_mode() == mode
    monkeypatch.setattr(EXM, "PREFILL", " Dequant ")
    assert EXM.prefill_mode() == "dequant"
    monkeypatch.setattr(EXM, "PREFILL", "auto")
    assert EXM.prefill_mode() == EXM.PREFILL_AUTO == "dequant32"
    for bad in ("fp8", "", "dequant16", "grouped"):
        monkeypatch.setattr(EXM, "PREFILL", bad)
        with pytest.raises(InvalidArgumentError, match="HF2Q_EXPERT_PREFILL"):
            EXM.prefill_mode()


def test_env_var_sets_the_default():
    """HF2Q_EXPERT_PREFILL is read at import; unset: "auto"."""
    code = (
        "from hf2q_mlx.custom_kernels import expert_matmul as m; print(m.PREFILL, m.prefill_mode())"
    )
    for value, want in (("dequant", "dequant dequant"), (None, "auto dequant32")):
        env = {k: v for k, v in os.environ.items() if k != "HF2Q_EXPERT_PREFILL"}
        if value is not None:
            env["HF2Q_EXPERT_PREFILL"] = value
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == want


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
    for mode in ("dequant32", "dequant"):
        monkeypatch.setattr(EXM, "PREFILL", mode)
        G.expert_glu(x, raw, ids, t, K)
    assert seen == [mx.float32] * 2 and not calls


# --------------------------------------------------------------------------------------------
# GPU: Gemma-4-26B-A4B's expert widths (gate_up 2 x 704 rows of K 2816, Q4_K; down 2816 rows of
# K 704, Q5_0), 32 experts (not 128: the fp32 references run on the CPU), top-8

_E, _K8, _F, _H = 32, 8, 704, 2816
_GPU_REFS: dict = {}


def _gpu_case(m: int):
    if m not in _GPU_REFS:
        gu = _experts(T.Q4_K, _E, 2 * _F, _H, seed=1)
        dn = _experts(T.Q5_0, _E, _H, _F, seed=2)
        x = _x((m, _H), mx.bfloat16, 3, gu, T.Q4_K)
        ids, wts = TD._route(m, _K8, _E, seed=4 + m)
        h = TD._h((m, _K8, _F), mx.bfloat16, 5)
        refs = (
            _glu_ref(x, gu, ids, T.Q4_K, _H, "gelu_tanh"),
            _glu_same_dtype(x, gu, ids, T.Q4_K, _H, "gelu_tanh"),
            _down_ref(h, dn, ids, wts, T.Q5_0, _F),
            _down_same_dtype(h, dn, ids, wts, T.Q5_0, _F),
        )
        _GPU_REFS[m] = (gu, dn, x, ids, wts, h, refs)
    return _GPU_REFS[m]


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
