"""The CPU path of GGML linears: repack exactness against gguf-py, the few-row (repack / fp32
copy) and many-row (dequantize + GEMM) dispatch against a float64 reference, and the BLAS that
custom_kernels/cpu_blas.py routes MLX's CPU matmuls to.

Random blocks are fresh on every run (the seed is in each failure message). Tolerances: the
repack's dequantized values are compared bit for bit (data movement: the repack must be
lossless); matmul outputs to 1e-4 of the largest |output| (fp32 math over a few hundred terms
against a float64 sum of the same fp32 weights: ~1e-6 typical, 1e-4 leaves room for the BLAS's
summation order and no room for a wrong block, scale or sub-block).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import gguf.quants
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from hf2q_mlx.custom_kernels import cpu_blas, cpu_ext
from hf2q_mlx.custom_kernels.affine_repack import affine_repack
from hf2q_mlx.custom_kernels.dequant import GGML_BLOCK_INFO
from hf2q_mlx.errors import InvalidArgumentError
from hf2q_mlx.io.random_weights import random_ggml_blocks
from hf2q_mlx.models import quantized
from hf2q_mlx.models.quantized import CPU_QMM_MAX_ROWS, GGMLEmbedding, GGMLLinear

REPACKED = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q3_K, T.Q4_K, T.Q5_K]
ALL_TYPES = [*REPACKED, T.Q2_K, T.Q6_K]
RTOL = 1e-4  # of the largest |output|: see the module docstring

pytestmark = pytest.mark.skipif(
    mx.default_device().type != mx.DeviceType.cpu, reason="the CPU path is the CPU's"
)


@pytest.fixture(autouse=True)
def _mlx_paths(monkeypatch):
    """These tests cover the MLX paths: with the compiled CPU mat-vec off (custom_kernels/cpu_ext,
    tested in tests/kernels/test_cpu_matvec.py), as where it cannot be built."""
    monkeypatch.setattr(cpu_ext, "_state", {"module": None})


@pytest.fixture
def seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def fresh_layer(ggml_type: int, seed: int, out_features: int = 13, bias: bool = False):
    block = GGML_BLOCK_INFO[ggml_type][0]
    in_features = 2 * block if block == 256 else 9 * block
    layer = GGMLLinear(in_features, out_features, ggml_type, bias=bias)
    layer.weight = random_ggml_blocks(out_features, in_features, ggml_type, seed=seed)
    return layer


def gguf_weight(raw: mx.array, ggml_type: int) -> np.ndarray:
    """gguf-py's dequantization (the llama.cpp reference), float64."""
    return gguf.quants.dequantize(np.array(raw), ggml_type).astype(np.float64)


def assert_matches(got: mx.array, x: mx.array, w64: np.ndarray, msg: str) -> None:
    want = np.array(x.astype(mx.float32)).astype(np.float64) @ w64.T
    got = np.array(got.astype(mx.float32))
    assert got.shape == want.shape, msg
    err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)
    assert err <= RTOL, f"{msg}: max error {err:.2e} of the largest output"


@pytest.mark.parametrize("ggml_type", REPACKED, ids=lambda t: t.name)
def test_repack_bit_exact_against_gguf_py(ggml_type, seed):
    raw = fresh_layer(ggml_type, seed).weight
    wq, scales, biases, bits = affine_repack(raw, ggml_type, _cols(raw, ggml_type))
    got = np.array(mx.dequantize(wq, scales, biases, group_size=32, bits=bits))
    want = gguf.quants.dequantize(np.array(raw), ggml_type).astype(np.float32)
    # bit-exact, with +0.0 for -0.0 where the repack folds an offset into the bias
    g = np.where(got == 0, 0, got.view(np.uint32))
    w = np.where(want == 0, 0, want.view(np.uint32))
    bad = np.flatnonzero(g != w)
    assert bad.size == 0, f"seed {seed}: {bad.size} values differ"


def _cols(raw: mx.array, ggml_type: int) -> int:
    block, nbytes = GGML_BLOCK_INFO[ggml_type]
    return raw.shape[1] // nbytes * block


@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=lambda t: t.name)
def test_linear_every_row_count_matches_gguf_py(ggml_type, seed):
    layer = fresh_layer(ggml_type, seed, bias=True)
    w64 = gguf_weight(layer.weight, ggml_type)
    b64 = np.array(layer.bias).astype(np.float64)
    for rows in (1, CPU_QMM_MAX_ROWS, CPU_QMM_MAX_ROWS + 1, 37):  # both sides of the switch
        x = mx.random.normal((rows, layer.in_features), key=mx.random.key(seed + rows))
        got = layer(x)
        assert got.dtype == mx.float32
        assert_matches(got - mx.array(b64.astype(np.float32)), x, w64, f"seed {seed} M {rows}")
    few = vars(layer).get("_affine" if ggml_type in REPACKED else "_dense")
    assert few is not None and few[0] is layer.weight  # the few-row path built its form
    x16 = mx.random.normal((2, 3, layer.in_features), key=mx.random.key(seed)).astype(mx.float16)
    assert layer(x16).dtype == mx.float16  # fp32 math, the caller's dtype out


@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_many_rows_dequantize_in_chunks(ggml_type, seed, monkeypatch):
    layer = fresh_layer(ggml_type, seed, out_features=29)
    x = mx.random.normal((3, 7, layer.in_features), key=mx.random.key(seed))
    monkeypatch.setattr(quantized, "_CPU_DEQ_CHUNK", 5 * layer.in_features)  # 6 chunks of rows
    got = layer(x)
    assert got.shape == (3, 7, 29)
    assert_matches(got.reshape(21, 29), x.reshape(21, -1), gguf_weight(layer.weight, ggml_type),
                   f"seed {seed}")  # fmt: skip
    assert "_affine" not in vars(layer) and "_dense" not in vars(layer)  # nothing kept


def test_dense_copy_follows_the_weight(seed):
    layer = fresh_layer(T.Q6_K, seed)
    x = mx.random.normal((1, layer.in_features), key=mx.random.key(seed))
    first = layer(x)
    layer.weight = random_ggml_blocks(13, layer.in_features, T.Q6_K, seed=seed + 1)
    assert "_dense" not in vars(layer)  # dropped with the old weight
    got = layer(x)
    assert_matches(got, x, gguf_weight(layer.weight, T.Q6_K), f"seed {seed}")
    assert not np.allclose(np.array(got), np.array(first))


def test_tied_head_rows(seed):
    emb = GGMLEmbedding(41, 256, T.Q8_0)
    emb.weight = random_ggml_blocks(41, 256, T.Q8_0, seed=seed)
    w64 = gguf_weight(emb.weight, T.Q8_0)
    for rows in (1, 9):
        x = mx.random.normal((rows, 256), key=mx.random.key(seed + rows))
        assert_matches(emb.as_linear(x), x, w64, f"seed {seed} M {rows}")


# ---- cpu_blas ---------------------------------------------------------------------------------

needs_shim = pytest.mark.skipif(
    not sys.platform.startswith("linux") or shutil.which("cc") is None,
    reason="the BLAS routing is for Linux and compiles its shim with cc",
)


def run_fresh(code: str, **env: str) -> str:
    """Run ``code`` in a fresh interpreter (routing happens once, before mlx.core loads)."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF2Q_CPU_BLAS": "", **env},  # conftest turns it off for the suite
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip()


@needs_shim
def test_blas_routed_and_correct(tmp_path):
    out = run_fresh(
        """
        import numpy as np
        import hf2q_mlx
        import mlx.core as mx
        from hf2q_mlx.custom_kernels import cpu_blas, cpu_ext
        assert cpu_blas.enable() is not None and cpu_blas.routed() is True
        rng = np.random.default_rng()
        a, b = rng.standard_normal((67, 129)), rng.standard_normal((45, 129))
        before = cpu_blas.sgemm_calls()
        got = np.array(mx.matmul(mx.array(a, mx.float32), mx.array(b, mx.float32).T,
                                 stream=mx.cpu))
        assert cpu_blas.sgemm_calls() > before
        want = a.astype(np.float32).astype(np.float64) @ b.astype(np.float32).astype(np.float64).T
        print(np.abs(got - want).max() / np.abs(want).max())
        """,
        HF2Q_MLX_CACHE=str(tmp_path),
    )
    assert float(out) <= 1e-5  # fp32 GEMM over 129 terms
    assert list((tmp_path / "cpu_blas").glob("*.so"))  # the shim went to the cache asked for


@needs_shim
def test_blas_off_and_too_late(tmp_path):
    code = """
        {first}
        import hf2q_mlx
        from hf2q_mlx.custom_kernels import cpu_blas, cpu_ext
        print(cpu_blas.enable(), cpu_blas.routed())
        """
    off = run_fresh(code.format(first=""), HF2Q_CPU_BLAS="off", HF2Q_MLX_CACHE=str(tmp_path))
    assert off == "None None"
    late = run_fresh(code.format(first="import mlx.core"), HF2Q_MLX_CACHE=str(tmp_path))
    desc, routed = late.rsplit(" ", 1)
    assert desc != "None" and routed == "False"  # loaded, but MLX had bound its BLAS already


@needs_shim
def test_importing_mlx_first_warns_that_the_cpu_blas_stays_slow(tmp_path):
    """mlx.core imported before hf2q_mlx on a CPU: a warning says the routing missed and how to
    avoid it; hf2q_mlx first, or the routing turned off, says nothing."""

    def stderr(code: str, **env: str) -> str:
        proc = subprocess.run(
            [sys.executable, "-W", "always", "-c", code], capture_output=True, text=True,
            timeout=300, env={**os.environ, "HF2Q_CPU_BLAS": "", "HF2Q_MLX_CACHE": str(tmp_path),
                              **env},
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stderr

    late = stderr("import mlx.core; import hf2q_mlx")
    assert "mlx.core was imported before hf2q_mlx" in late and "import hf2q_mlx first" in late
    assert "imported before" not in stderr("import hf2q_mlx; import mlx.core")
    assert "imported before" not in stderr("import mlx.core; import hf2q_mlx", HF2Q_CPU_BLAS="off")


def test_blas_caller_errors(monkeypatch, tmp_path):
    with pytest.raises(InvalidArgumentError, match="integer >= 1"):
        cpu_blas.set_threads(0)
    monkeypatch.setenv(cpu_blas.ENV_VAR, str(tmp_path / "missing.so"))
    with pytest.raises(InvalidArgumentError, match="cannot load"):
        cpu_blas._enable(tmp_path)
