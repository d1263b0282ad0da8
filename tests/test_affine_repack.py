"""GGML -> MLX affine repack: exact against the reference dequantizer, and the CPU matmul path."""

from __future__ import annotations

import gguf.quants
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from mlx.utils import tree_flatten

from hf2q_mlx.custom_kernels import ENV_VAR, cpu_ext, reference_only
from hf2q_mlx.custom_kernels.affine_repack import affine_repack
from hf2q_mlx.custom_kernels.dequant import GGML_BLOCK_INFO, dequantize_reference
from hf2q_mlx.errors import WeightMismatchError
from hf2q_mlx.io.random_weights import random_ggml_blocks
from hf2q_mlx.models.quantized import GGMLEmbedding, GGMLLinear

# type -> (bits, byte offsets of its fp16 scale fields in a block, zero sign kept)
MAPPED = {
    T.Q8_0: (8, (0,), False),
    T.Q4_0: (4, (0,), False),
    T.Q4_1: (4, (0, 2), True),
    T.Q5_0: (5, (0,), False),
    T.Q5_1: (5, (0, 2), True),
    T.Q3_K: (8, (108,), False),
    T.Q4_K: (4, (0, 2), True),
    T.Q5_K: (5, (0, 2), True),
}
UNMAPPED = [T.Q2_K, T.Q6_K, T.F32, T.F16, T.BF16]

pytestmark = pytest.mark.skipif(
    mx.default_device().type != mx.DeviceType.cpu, reason="the affine path is the CPU's"
)


@pytest.fixture(autouse=True)
def _repack_path(monkeypatch):
    """The few-row CPU path under test is the repack's: the compiled CPU mat-vec
    (custom_kernels/cpu_ext, tests/kernels/test_cpu_matvec.py) stays off, as where it cannot
    be built."""
    monkeypatch.setattr(cpu_ext, "_state", {"module": None})


def assert_same_floats(got: mx.array, want: np.ndarray, zero_sign_kept: bool) -> None:
    """Bit-exact, except that a -0.0 of the reference may come out +0.0 where the repack folds
    an offset into the bias (d * (q + o) + (-o * d) rounds a zero to +0.0)."""
    got_np = np.array(got)
    assert got_np.dtype == np.float32 and got_np.shape == want.shape
    g, w = got_np.view(np.uint32), want.view(np.uint32)
    if not zero_sign_kept:
        g, w = np.where(got_np == 0, 0, g), np.where(want == 0, 0, w)
    bad = np.flatnonzero(g != w)
    assert bad.size == 0, (
        f"{bad.size} differ, first {got_np.flat[bad[0]]!r} vs {want.flat[bad[0]]!r}"
    )


def with_random_scales(raw: mx.array, ggml_type: int, seed: int) -> mx.array:
    """Overwrite every fp16 scale field with random finite fp16 bits: negative, subnormal and
    zero scales included (the exponent field is drawn uniformly, 0 = subnormal / zero)."""
    _, offsets, _ = MAPPED[ggml_type]
    nbytes = GGML_BLOCK_INFO[ggml_type][1]
    rng = np.random.default_rng(seed)
    blocks = np.array(raw).reshape(raw.shape[0], -1, nbytes)
    for off in offsets:
        h = rng.integers(0, 1 << 16, blocks.shape[:2], dtype=np.uint16)
        exp = rng.integers(0, 31, blocks.shape[:2], dtype=np.uint16)  # never 31 (inf / nan)
        h = (h & 0x83FF) | (exp << 10)
        blocks[..., off : off + 2] = h.view(np.uint8).reshape(*h.shape, 2)
    return mx.array(blocks.reshape(raw.shape))


def check_repack(raw: mx.array, ggml_type: int, cols: int) -> None:
    bits, _, zero_sign_kept = MAPPED[ggml_type]
    wq, scales, biases, got_bits = affine_repack(raw, ggml_type, cols)
    rows = raw.shape[0]
    assert got_bits == bits and wq.dtype == mx.uint32 and wq.shape == (rows, cols * bits // 32)
    assert scales.dtype == biases.dtype == mx.float32 and scales.shape == (rows, cols // 32)
    got = mx.dequantize(wq, scales, biases, group_size=32, bits=bits)
    assert_same_floats(got, np.array(dequantize_reference(raw, ggml_type, cols)), zero_sign_kept)


@pytest.mark.parametrize("ggml_type", MAPPED, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,blocks", [(1, 1), (7, 3), (13, 2)])
def test_repack_dequantizes_exactly(ggml_type, rows, blocks):
    cols = blocks * GGML_BLOCK_INFO[ggml_type][0]
    raw = random_ggml_blocks(rows, cols, ggml_type, seed=100 * ggml_type + rows)
    check_repack(raw, ggml_type, cols)


@pytest.mark.parametrize("ggml_type", MAPPED, ids=lambda t: t.name)
def test_repack_exact_with_negative_and_subnormal_scales(ggml_type):
    cols = 3 * GGML_BLOCK_INFO[ggml_type][0]
    raw = random_ggml_blocks(9, cols, ggml_type, seed=7 + ggml_type)
    raw = with_random_scales(raw, ggml_type, seed=ggml_type)
    check_repack(raw, ggml_type, cols)
    # and against gguf-py itself, the reference's own oracle
    bits, _, zero_sign_kept = MAPPED[ggml_type]
    wq, scales, biases, _ = affine_repack(raw, ggml_type, cols)
    want = gguf.quants.dequantize(np.array(raw), ggml_type).astype(np.float32)
    got = mx.dequantize(wq, scales, biases, group_size=32, bits=bits)
    assert_same_floats(got, want, zero_sign_kept)


def test_repack_real_gemma3_tensors(gemma3_gguf_path):
    from hf2q_mlx.io.gguf import GGUFFile

    f = GGUFFile(gemma3_gguf_path)
    seen = set()
    for name in ["blk.0.attn_q.weight", "blk.0.attn_v.weight", "blk.5.attn_output.weight",
                 "blk.0.ffn_down.weight", "token_embd.weight"]:  # fmt: skip
        t = f.tensors[name]
        raw = f.to_mx(name)
        if name == "token_embd.weight":
            raw = raw[-3001:]  # 262144 rows: a slice keeps the test light
        seen.add(t.ggml_type)
        if t.ggml_type in MAPPED:
            check_repack(raw, t.ggml_type, t.shape[-1])
        else:
            assert affine_repack(raw, t.ggml_type, t.shape[-1]) is None
    assert {T.Q5_0, T.Q8_0, T.Q4_K, T.Q6_K} <= seen


@pytest.mark.parametrize("ggml_type", UNMAPPED, ids=lambda t: t.name)
def test_unmapped_types_return_none(ggml_type):
    raw = mx.zeros((2, 10), mx.uint8)  # never looked at
    assert affine_repack(raw, ggml_type, 256) is None


def test_repack_rejects_wrong_rows():
    with pytest.raises(WeightMismatchError, match="144"):
        affine_repack(mx.zeros((2, 143), mx.uint8), T.Q4_K, 256)
    with pytest.raises(WeightMismatchError):
        affine_repack(mx.zeros((2, 144), mx.int8), T.Q4_K, 256)


def assert_close(got: mx.array, want: mx.array, rtol: float) -> None:
    got, want = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * np.abs(want).max())


def cpu_and_reference(layer, x, call=None):
    """(CPU affine path, forced reference path) outputs of one call."""
    call = call or layer
    got = call(x)
    with reference_only():
        want = call(x)
    mx.eval(got, want)
    return got, want


@pytest.mark.parametrize("ggml_type", [*MAPPED, T.Q2_K, T.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("x_shape", [(1, 1), (2, 2)])  # rows <= CPU_QMM_MAX_ROWS: the repack
def test_linear_cpu_path_matches_reference(ggml_type, x_shape):
    block = GGML_BLOCK_INFO[ggml_type][0]
    in_features, out_features = 3 * block if block == 256 else 21 * block, 11
    layer = GGMLLinear(in_features, out_features, ggml_type, bias=True)
    layer.weight = random_ggml_blocks(out_features, in_features, ggml_type, seed=ggml_type)
    layer.bias = mx.random.normal((out_features,), key=mx.random.key(3))
    x = mx.random.normal((*x_shape, in_features), key=mx.random.key(ggml_type))
    got, want = cpu_and_reference(layer, x)
    assert got.dtype == mx.float32
    assert_close(got, want, rtol=1e-5)
    cached = vars(layer)["_affine"][1]
    assert (cached is None) == (ggml_type not in MAPPED)  # Q2_K / Q6_K: per-call dequant
    assert [k for k, _ in tree_flatten(layer.parameters())] == ["weight", "bias"]
    got16, want16 = cpu_and_reference(layer, x.astype(mx.float16))
    assert got16.dtype == want16.dtype == mx.float16
    assert_close(got16, want16, rtol=2e-3)  # both are fp32 math rounded to fp16 once


def test_forced_reference_builds_no_repack(monkeypatch):
    layer = GGMLLinear(256, 5, T.Q4_K)
    layer.weight = random_ggml_blocks(5, 256, T.Q4_K, seed=1)
    x = mx.random.normal((2, 256), key=mx.random.key(5))
    with reference_only():
        mx.eval(layer(x))
    monkeypatch.setenv(ENV_VAR, "reference")
    mx.eval(layer(x))
    assert "_affine" not in vars(layer)
    monkeypatch.delenv(ENV_VAR)
    mx.eval(layer(x))
    assert vars(layer)["_affine"][1] is not None


def test_repack_rebuilt_when_weight_changes():
    layer = GGMLLinear(256, 6, T.Q5_K)
    w1, w2 = (random_ggml_blocks(6, 256, T.Q5_K, seed=s) for s in (11, 12))
    x = mx.random.normal((1, 256), key=mx.random.key(6))
    layer.weight = w1
    first = layer(x)
    assert vars(layer)["_affine"][0] is w1
    layer.weight = w2  # attribute assignment drops the repack at once
    assert "_affine" not in vars(layer)
    got, want = cpu_and_reference(layer, x)
    assert_close(got, want, rtol=1e-5)
    assert not np.allclose(np.array(got), np.array(first))
    layer.load_weights([("weight", w1)])  # the loader's path
    got, want = cpu_and_reference(layer, x)
    assert_close(got, first, rtol=1e-6)
    assert_close(got, want, rtol=1e-5)
    dict.__setitem__(layer, "weight", w2)  # bypassing the hook: the identity check catches it
    assert_close(layer(x), cpu_and_reference(layer, x)[1], rtol=1e-5)
    assert vars(layer)["_affine"][0] is w2


@pytest.mark.parametrize("ggml_type", [T.Q8_0, T.Q5_0, T.Q6_K], ids=lambda t: t.name)
def test_embedding_cpu_path(ggml_type):
    vocab, dims = 37, 256
    emb = GGMLEmbedding(vocab, dims, ggml_type)
    raw = random_ggml_blocks(vocab, dims, ggml_type, seed=21)
    emb.weight = with_random_scales(raw, ggml_type, seed=22) if ggml_type in MAPPED else raw
    x = mx.random.normal((2, 3, dims), key=mx.random.key(23))
    got, want = cpu_and_reference(emb, x, emb.as_linear)
    assert got.shape == (2, 3, vocab)
    assert_close(got, want, rtol=1e-5)
    ids = mx.array([[0, 36, 5], [5, 5, 17]])
    rows, ref_rows = cpu_and_reference(emb, ids)
    # gathered from the raw rows: the reference's bits, signed zeros included
    assert np.array_equal(np.array(rows).view(np.uint32), np.array(ref_rows).view(np.uint32))
    assert [k for k, _ in tree_flatten(emb.parameters())] == ["weight"]
