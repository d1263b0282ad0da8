"""HF2Q_AVOID_MLX_JIT=1: a prefill's gathers through ops MLX's CUDA back end ships compiled or a
kernel of ours (its own gathers compile with NVRTC at first use on a machine), the values
unchanged: picks by a one-hot select, an embedding's rows by ``gather_rows_any`` (CPU
emulator, poisoned outputs), the grouped prefill's slices as views."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "kernels"))

import kernel_emulator  # noqa: E402

from hf2q_mlx.custom_kernels import expert_matmul, graph_ops  # noqa: E402
from hf2q_mlx.models import gemma4_moe, ops  # noqa: E402

needs_gxx = pytest.mark.skipif(not kernel_emulator.available(), reason="needs g++")


def _prims(*arrays) -> str:
    import tempfile

    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *arrays)
        return f.read()


def _bits(a: mx.array) -> np.ndarray:
    return np.array(a.view({2: mx.uint16, 4: mx.uint32}[a.dtype.size]))


@pytest.fixture
def avoid(monkeypatch):
    monkeypatch.setenv("HF2Q_AVOID_MLX_JIT", "1")


def test_pick_is_take_along_axis_without_a_gather(avoid):
    E, k = 40, 6
    logits = mx.random.normal((3, 5, E), key=mx.random.key(0)) * 4
    logits = logits.at[0, 0, 7].add(-mx.inf).at[1, 2, 9].add(mx.nan)  # not picked below
    ids = mx.argpartition(-mx.where(mx.isnan(logits), -1e9, logits), kth=k - 1, axis=-1)[..., :k]
    ids = ids.astype(mx.uint32)
    got = ops.pick(logits, ids)
    assert "Gather" not in _prims(got)
    np.testing.assert_array_equal(_bits(got), _bits(mx.take_along_axis(logits, ids, axis=-1)))
    scale = (mx.random.normal((E,), key=mx.random.key(1)) + 1).astype(mx.bfloat16)
    np.testing.assert_array_equal(_bits(ops.pick(scale, ids)), _bits(scale[ids]))


def test_pick_keeps_a_picked_inf(avoid):
    a = mx.array([[1.0, -mx.inf, 3.0]])
    assert ops.pick(a, mx.array([[1, 2]], dtype=mx.uint32)).tolist() == [[-np.inf, 3.0]]


def test_pick_is_a_gather_with_the_switch_off(monkeypatch):
    monkeypatch.setenv("HF2Q_AVOID_MLX_JIT", "0")
    ids = mx.array([[2, 0]], dtype=mx.uint32)
    assert "Gather" in _prims(ops.pick(mx.array([[1.0, 2.0, 3.0]]), ids))


def test_router_outputs_unchanged(monkeypatch):
    """Gemma 4's router off its kernel (a prefill's rows): the same ids and weights, bit for
    bit, with and without the switch."""
    D, E, k = 64, 16, 4
    router = gemma4_moe.Router(D, E, k, 1e-6)
    router.proj.weight = mx.random.normal((E, D), key=mx.random.key(2)) * 0.3
    router.scale = mx.random.normal((D,), key=mx.random.key(3)) + 1
    router.per_expert_scale = mx.random.normal((E,), key=mx.random.key(4)) + 1
    x = mx.random.normal((1, 70, D), key=mx.random.key(5))
    monkeypatch.setenv("HF2Q_AVOID_MLX_JIT", "0")
    ids0, w0, _ = router(x)
    monkeypatch.setenv("HF2Q_AVOID_MLX_JIT", "1")
    ids1, w1, _ = router(x)
    np.testing.assert_array_equal(np.array(ids0), np.array(ids1))
    np.testing.assert_array_equal(_bits(w0), _bits(w1))


def _emulating(kernel):
    """``kernel`` called as ``Kernel.__call__``, run by the emulator, its launch values kept."""

    class Emulated:
        def __call__(self, inputs, **kw):
            self.kw = kw
            return kernel_emulator.emulate(kernel, list(inputs), **kw)

    return Emulated()


@needs_gxx
@pytest.mark.parametrize("row_bytes", [144, 1584])
def test_gather_rows_any_kernel_matches_take(avoid, monkeypatch, row_bytes):
    """Rows through the kernel (the emulator; outputs poisoned before it runs) byte-equal to
    ``table[ids]``, at two row widths (under and over one threadgroup of words), a repeated id;
    an id past the table reads its last row (MLX's gather would read out of bounds)."""
    rng = np.random.default_rng(0)
    V = 50
    table = mx.array(rng.integers(0, 256, (V, row_bytes), dtype=np.uint8))
    ids = mx.array([[3, 49, 0], [17, 3, 21]], dtype=mx.int32)
    fake = _emulating(graph_ops._rows_any_kernel)
    monkeypatch.setattr(graph_ops, "_rows_any_kernel", fake)
    monkeypatch.setattr(graph_ops, "backend", lambda: "cuda")
    got = graph_ops.gather_rows(table, ids)
    assert fake.kw["template"] == {"W": row_bytes // 4, "V": V}
    assert fake.kw["grid"][1] == ids.size  # the rows: grid, not template
    np.testing.assert_array_equal(np.array(got), np.array(table[ids]))
    past = graph_ops.gather_rows(table, mx.array([V + 3, 1], dtype=mx.int32))
    np.testing.assert_array_equal(np.array(past), np.array(table[mx.array([V - 1, 1])]))


@needs_gxx
def test_table_lookup_kernel_matches_take(avoid, monkeypatch):
    """A TurboQuant codebook (fp32, 256 entries) at 1,000 random uint32 codes (not a whole
    number of threadgroups) through the lookup kernel (the emulator, outputs poisoned first):
    ``mx.take``'s bits, the count as data (one build per table size); a code past the table
    reads its last entry; a TQ8 codec's quantize and dequantize give the same bits with the
    switch on and off (its unpacking has no gather either way)."""
    from hf2q_mlx.custom_kernels._render import Kernel
    from hf2q_mlx.models.turboquant.codec import TQCodec

    launches = []

    def launcher(self, dtypes, **kw):
        launches.append(kw["template"])
        return kernel_emulator.kernel_launcher(self, dtypes, **kw)

    monkeypatch.setattr(Kernel, "launcher", launcher)
    monkeypatch.setattr(graph_ops, "backend", lambda: "cuda")
    codec = TQCodec(128, 8, seed=3)
    codes = mx.array(np.random.default_rng(1).integers(0, 256, 1000, dtype=np.uint32))
    got = graph_ops.table_lookup(codec.codebook, codes)
    assert launches == [{"V": 256}]
    np.testing.assert_array_equal(_bits(got), _bits(mx.take(codec.codebook, codes)))
    past = graph_ops.table_lookup(codec.codebook, mx.array([300, 2], dtype=mx.uint32))
    np.testing.assert_array_equal(np.array(past), np.array(codec.codebook[mx.array([255, 2])]))
    x = mx.random.normal((3, 5, 128), key=mx.random.key(4))
    rows = codec.quantize(x)
    back = codec.dequantize(rows)
    monkeypatch.setenv("HF2Q_AVOID_MLX_JIT", "0")
    rows0 = codec.quantize(x)
    np.testing.assert_array_equal(np.array(rows), np.array(rows0))
    np.testing.assert_array_equal(_bits(back), _bits(codec.dequantize(rows0)))
    assert "Gather" in _prims(codec.dequantize(rows0))  # off: MLX's take


@pytest.mark.parametrize("bits", [2, 3, 5, 6, 8])
def test_unpack_bits_without_a_gather(bits):
    """The packed codes' unpacking reads each code's words by broadcast slices, no gather:
    every code back, at widths that straddle words (3, 5, 6) and that do not."""
    from hf2q_mlx.models.turboquant.codec import pack_bits, unpack_bits

    codes = mx.array(np.random.default_rng(bits).integers(0, 2**bits, (4, 70), dtype=np.uint32))
    got = unpack_bits(pack_bits(codes, bits), bits, 70)
    assert "Gather" not in _prims(got)
    np.testing.assert_array_equal(np.array(got), np.array(codes))


def test_gather_rows_takes_mlx_with_the_switch_off(monkeypatch):
    monkeypatch.setenv("HF2Q_AVOID_MLX_JIT", "0")
    monkeypatch.setattr(graph_ops, "backend", lambda: "cuda")
    table = mx.zeros((4, 8), dtype=mx.uint8) + 1
    assert "Gather" in _prims(graph_ops.gather_rows(table, mx.array([2], dtype=mx.int32)))


def test_owned_rows_are_views(avoid, monkeypatch):
    monkeypatch.setattr(expert_matmul, "GROUPED_SLICE_COPY", True)
    a = mx.random.normal((9, 5), key=mx.random.key(6))
    got = expert_matmul.owned_rows(a, 2, 7)
    assert "Gather" not in _prims(got)
    np.testing.assert_array_equal(np.array(got), np.array(a[2:7]))
    monkeypatch.setenv("HF2Q_AVOID_MLX_JIT", "0")
    assert "Gather" in _prims(expert_matmul.owned_rows(a, 2, 7))


# --------------------------------------------------------------------------------------------
# On CUDA


def _needs_cuda():
    if not mx.cuda.is_available():
        pytest.skip("the kernels these take need MLX's CUDA back end")


@pytest.mark.parametrize("row_bytes", [144, 1584])
def test_gpu_gather_rows_any_equals_mlx_gather(monkeypatch, row_bytes):
    """The rows kernel on CUDA against MLX's gather, byte for byte (bit-exact: data movement)."""
    _needs_cuda()
    rng = np.random.default_rng(1)
    table = mx.array(rng.integers(0, 256, (300, row_bytes), dtype=np.uint8))
    ids = mx.array(rng.integers(0, 300, (2, 257)).astype(np.int32))
    want = np.array(table[ids])
    monkeypatch.setenv("HF2Q_AVOID_MLX_JIT", "1")
    got = graph_ops.gather_rows(table, ids)
    assert "Gather" not in _prims(got)
    np.testing.assert_array_equal(np.array(got), want)


@pytest.mark.parametrize("family,kv_bits", [("gemma4", None), ("qwen3_5", None), ("gemma4", 8)])
def test_gpu_prefill_logits_unchanged(monkeypatch, family, kv_bits):
    """A tiny MoE model's 300-token prefill (the grouped expert kernels, the router off its
    decode kernel) on CUDA: logits bit for bit the same with the switch (it moves data only).
    The wide slices cut to 256 pairs, so most slices are views at an offset into their
    parent with the switch (copies without it): a kernel reading a view from its parent's
    start would differ. With a TurboQuant cache (kv_bits) the prefill's dequantized cache
    comes through the table-lookup kernel and gather-free unpacking with the switch."""
    _needs_cuda()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from decode_profile import build

    from hf2q_mlx.custom_kernels import expert_mma
    from hf2q_mlx.generation import make_prompt_cache

    monkeypatch.setattr(expert_mma, "WIDE_PAIRS", 256)
    monkeypatch.setattr(expert_matmul, "GROUPED_SLICE_COPY", True)

    model, vocab = build(family, "tiny-moe", "q4_k", mx.bfloat16, None)
    ids = mx.array([[(7 * i + 3) % vocab for i in range(300)]], dtype=mx.int32)
    out = {}
    for v in ("0", "1"):
        monkeypatch.setenv("HF2Q_AVOID_MLX_JIT", v)
        out[v] = model(ids, cache=make_prompt_cache(model, kv_bits))
        mx.eval(out[v])
    np.testing.assert_array_equal(_bits(out["0"]), _bits(out["1"]))
    assert np.isfinite(np.array(out["1"].astype(mx.float32))).all()


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_unfused_activations_match_the_compiled_ones(monkeypatch, dtype):
    """silu, softplus and the gated silu unfused (no ``mx.compile`` fusion for MLX to JIT)
    give the fused forms' bits: MLX's fusion keeps each intermediate in its array's dtype."""
    from hf2q_mlx.custom_kernels import gated_delta

    x = (mx.random.normal((7, 300), key=mx.random.key(7)) * 6).astype(dtype)
    up = mx.random.normal((7, 300), key=mx.random.key(8)).astype(dtype)
    monkeypatch.setenv("HF2Q_AVOID_MLX_JIT", "0")
    want = [gated_delta.silu(x), gated_delta.softplus(x), ops.gated_activation(x, up, kernel=False)]
    monkeypatch.setenv("HF2Q_AVOID_MLX_JIT", "1")
    got = [gated_delta.silu(x), gated_delta.softplus(x), ops.gated_activation(x, up, kernel=False)]
    for g, w in zip(got, want):
        assert "Compiled" not in _prims(g)
        np.testing.assert_array_equal(_bits(g), _bits(w))


def test_switch_defaults(monkeypatch):
    """HF2Q_AVOID_MLX_JIT unset: on with MLX's CUDA back end, off elsewhere (Metal's and the
    CPU's ops do not compile at first use); HF2Q_GROUPED_SORTED unset: on. 0 / 1 force either;
    anything else is a one-line caller error."""
    import hf2q_mlx.custom_kernels as ck
    from hf2q_mlx.custom_kernels import expert_mma
    from hf2q_mlx.errors import InvalidArgumentError

    for name in ("HF2Q_AVOID_MLX_JIT", "HF2Q_GROUPED_SORTED"):
        monkeypatch.delenv(name, raising=False)
    assert expert_mma.sorted_lists()
    for gpu, want in (("cuda", True), ("metal", False), (None, False)):
        monkeypatch.setattr(ck, "backend", lambda g=gpu: g)
        assert ck.avoid_mlx_jit() is want, gpu
    monkeypatch.setenv("HF2Q_AVOID_MLX_JIT", "0")
    monkeypatch.setattr(ck, "backend", lambda: "cuda")
    assert not ck.avoid_mlx_jit()
    monkeypatch.setenv("HF2Q_AVOID_MLX_JIT", "1")
    monkeypatch.setattr(ck, "backend", lambda: None)
    assert ck.avoid_mlx_jit()
    monkeypatch.setenv("HF2Q_GROUPED_SORTED", "0")
    assert not expert_mma.sorted_lists()
    for name in ("HF2Q_AVOID_MLX_JIT", "HF2Q_GROUPED_SORTED"):
        monkeypatch.setenv(name, "yes")
        with pytest.raises(InvalidArgumentError, match=name):
            ck.avoid_mlx_jit() if name == "HF2Q_AVOID_MLX_JIT" else expert_mma.sorted_lists()


@pytest.mark.parametrize(
    "spec,fmt,env",
    [
        ("gemma4:tiny-moe", "q4_k", {}),
        ("qwen3_5:tiny-moe", "q4_k", {}),
        ("qwen3_5:tiny", "q4_k", {}),
        ("gemma4:tiny-dense", "mlx4", {}),
        ("gemma4:tiny-moe", "mlx4", {}),
        ("qwen3_5:tiny-moe", "mlx4", {}),
        ("gemma4:tiny-moe", "q4_k", {"kv_bits": "8"}),
        ("qwen3_5:tiny", "q4_k", {"kv_bits": "4"}),
    ],
)
def test_cuda_prefill_asks_mlx_for_no_jit_op(spec, fmt, env, tmp_path):
    """A 300-token prefill with the CUDA branch taken on the CPU (``bench/jit_lengths.py
    --mlx-ops``, its own process: the fake back end is global) runs none of the MLX ops that
    MLX's CUDA back end JIT-compiles at a machine's first use (gathers, scatters, quantized
    GEMMs: seconds each of a first prefill, which issue 15 wants under 2 s). Session 39 found
    mx.eye in the chunked delta rule (a scatter: 4.6-5.2 s of Qwen 3.5's first prefill on an
    H100) and MLX 4-bit embeddings past 32 rows (three gathers) this way. MLX 4-bit MoE
    prompts rely on HF2Q_AFFINE_EXPERT_PREFILL, on by default with CUDA (their experts
    otherwise run gather_qmm). A
    TurboQuant cache (kv_bits) too: its prefill dequantizes the cache (codebook lookups)."""
    import json
    import os
    import subprocess

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "ops.json"
    env = dict(env)
    kv = ["--kv-bits", env.pop("kv_bits")] if "kv_bits" in env else []
    cmd = [sys.executable, str(root / "bench" / "jit_lengths.py"), spec, "--format", fmt,
           "--mlx-ops", "--lengths", "300", "--json", str(out), *kv]  # fmt: skip
    run_env = {**os.environ, **env, "HF2Q_AVOID_MLX_JIT": "1"}
    res = subprocess.run(cmd, env=run_env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    found = json.loads(out.read_text())
    assert found["ops"].get("Matmul", 0) > 0  # the probe saw the model's own ops
    assert found["jit"] == {}, found["jit"]
