"""HF2Q_DENSE_PREFILL=grouped (expert_mma.dense_grouped_matmul, taken by models' GGMLLinear): a
dense GGML linear's prefill (bf16 x past qmatmul.ROW_SLICE_MAX rows, CUDA) through the MoE
prefill's grouped tensor-core down kernel as one expert every token chose at weight 1. On the
CPU emulator: the output against fp32 math within the bf16 bound, the slices of
expert_mma.WIDE_PAIRS tokens, the routing and the switch; on a GPU the same."""

from __future__ import annotations

import kernel_emulator
import mlx.core as mx
import numpy as np
import pytest
from conftest import requires_gpu
from gguf import GGMLQuantizationType as T

from hf2q_mlx.custom_kernels import expert_mma as EM
from hf2q_mlx.custom_kernels import qmatmul as Q
from hf2q_mlx.custom_kernels._render import Kernel
from hf2q_mlx.errors import InvalidArgumentError
from hf2q_mlx.io.random_weights import random_ggml_blocks
from hf2q_mlx.models import quantized


def _case(n: int, k: int, m: int, seed: int):
    """(Q4_K blocks (n, row_bytes), bf16 x (m, k) scaled so the outputs are O(1))."""
    w = random_ggml_blocks(n, k, T.Q4_K, seed=seed)
    x = mx.random.normal((m, k), key=mx.random.key(seed + 1))
    wd = Q.ggml_matmul_reference(mx.eye(k, dtype=mx.float32), w, T.Q4_K, k)  # (K, N): W.T
    scale = 1.0 / (mx.abs(wd).mean().item() * k**0.5)
    return w, (scale * x).astype(mx.bfloat16)


def _check(y: mx.array, x: mx.array, w: mx.array, k: int) -> None:
    """Relative 2-norm error to fp32 math at most twice that of the fp32 result rounded to bf16
    (the kernel's sums are fp32, its one rounding the output's)."""
    want = Q.ggml_matmul_reference(x.astype(mx.float32), w, T.Q4_K, k)
    got, ref = np.array(y.astype(mx.float32), np.float64), np.array(want, np.float64)
    rounded = np.array(want.astype(mx.bfloat16).astype(mx.float32), np.float64)
    bound = np.linalg.norm(rounded - ref) / np.linalg.norm(ref)
    assert y.shape == want.shape and y.dtype == mx.bfloat16
    assert np.isfinite(got).all()
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) <= 2 * bound


@pytest.fixture
def emulated_cuda(monkeypatch):
    """qmatmul and expert_mma see CUDA; every launch runs on the emulator (outputs poisoned
    first); the names of the kernels launched are kept."""
    if not kernel_emulator.available():
        pytest.skip("g++ is not installed")
    launched = []

    def launcher(self, input_dtypes, **launch):
        launched.append(self.name)
        return kernel_emulator.kernel_launcher(self, input_dtypes, **launch)

    for mod in (Q, EM):
        monkeypatch.setattr(mod, "backend", lambda: "cuda")
    monkeypatch.setattr(quantized, "_cpu_affine_path", lambda: False)  # GGMLLinear's GPU path
    monkeypatch.setattr(Kernel, "launcher", launcher)
    monkeypatch.setattr(EM, "_DOWN_CALLS", {})
    monkeypatch.setattr(Q, "_CALLS", {})
    return launched


@pytest.mark.parametrize("wide_pairs,nt", [(4096, "2"), (32, "2"), (4096, "4"), (32, "1")])
def test_grouped_prefill_matches_fp32_math(emulated_cuda, monkeypatch, wide_pairs, nt):
    """70 tokens (past ROW_SLICE_MAX): one slice, or three of at most 32 tokens (32, 32, 6)
    concatenated in order; 20 output rows (two threadgroups of 16, the second partly past N);
    8, 16 or 32 tokens a column group (HF2Q_GROUPED_WIDE_NT)."""
    monkeypatch.setenv("HF2Q_DENSE_PREFILL", "grouped")
    monkeypatch.setenv("HF2Q_GROUPED_WIDE_NT", nt)
    monkeypatch.setattr(EM, "WIDE_PAIRS", wide_pairs)
    n, k, m = 20, 512, 70
    w, x = _case(n, k, m, seed=3)
    y = EM.dense_grouped_matmul(x, w, T.Q4_K, k)
    _check(y, x, w, k)
    # the wide down kernel (sorted pairs: HF2Q_GROUPED_SORTED's default) and the slot sum,
    # planned once per slice length
    slices = 1 if wide_pairs >= m else 2
    down = "ggml_grouped_down_wide_sorted_mma_q4_k"
    assert emulated_cuda == [down, "grouped_expert_slot_sum"] * slices
    assert not any("dequant" in name for name in emulated_cuda)


def _linear(w: mx.array, n: int, k: int) -> quantized.GGMLLinear:
    lin = quantized.GGMLLinear(k, n, T.Q4_K)
    lin.weight = w
    return lin


@pytest.mark.parametrize("mode", ["grouped", ""])
def test_ggml_linear_routes_many_rows(emulated_cuda, monkeypatch, mode):
    """GGMLLinear: with the switch, many rows take the one-expert grouped prefill (no
    dequantizer launched), a decode's 1..64 rows the mat-vec kernels as before; unset: the
    dequantize-then-matmul path."""
    monkeypatch.setenv("HF2Q_DENSE_PREFILL", mode)
    n, k = 20, 512
    w, x = _case(n, k, 70, seed=5)
    lin = _linear(w, n, k)
    _check(lin(x[None]), x[None], w, k)  # (1, 70, K): a batch dim kept
    grouped = any("grouped" in name for name in emulated_cuda)
    assert grouped == (mode == "grouped")
    assert any("dequant" in name for name in emulated_cuda) == (mode != "grouped")
    emulated_cuda.clear()
    lin(x[:8])
    assert emulated_cuda and not any(
        "grouped" in name or "dequant" in name for name in emulated_cuda
    )


def test_dense_prefill_switch(monkeypatch):
    for v, want in (("grouped", "grouped"), (" Dequant ", "dequant"), ("", "dequant")):
        monkeypatch.setenv("HF2Q_DENSE_PREFILL", v)
        assert EM.dense_prefill_mode() == want
    monkeypatch.setenv("HF2Q_DENSE_PREFILL", "fast")
    with pytest.raises(InvalidArgumentError, match="HF2Q_DENSE_PREFILL"):
        EM.dense_prefill_mode()


@requires_gpu
@pytest.mark.parametrize("m", [65, 512, 1000])
def test_gpu_grouped_prefill(monkeypatch, m):
    """On the GPU at a Gemma-4-31B width (K 5376), against fp32 math."""
    if Q.backend() != "cuda":
        pytest.skip("the grouped kernels run on CUDA")
    monkeypatch.setenv("HF2Q_DENSE_PREFILL", "grouped")
    n, k = 272, 5376
    w, x = _case(n, k, m, seed=m)
    _check(_linear(w, n, k)(x), x, w, k)
    assert EM.dense_grouped_matmul(x, w, T.Q4_K, k) is not None  # the grouped path took it
