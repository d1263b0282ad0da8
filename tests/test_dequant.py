"""dequantize_reference == gguf.quants.dequantize, bit for bit, on random and real GGML blocks."""

from __future__ import annotations

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from hf2q_mlx.custom_kernels.dequant import GGML_BLOCK_INFO, dequantize_reference, row_bytes
from hf2q_mlx.custom_kernels.ggml_formats import BLOCK_FORMATS
from hf2q_mlx.errors import UnsupportedQuantTypeError, WeightMismatchError
from hf2q_mlx.io.gguf import GGUFFile

# byte offsets of the fp16 fields (scales, mins) inside one block
FP16_FIELDS = {
    T.Q4_0: (0,),
    T.Q4_1: (0, 2),
    T.Q5_0: (0,),
    T.Q5_1: (0, 2),
    T.Q8_0: (0,),
    T.Q2_K: (80, 82),
    T.Q3_K: (108,),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
}
FLOAT_BITS = {T.F32: np.uint32, T.F16: np.uint16, T.BF16: np.uint16}
EXPONENT = {T.F32: 0x7F800000, T.F16: 0x7C00, T.BF16: 0x7F80}


def _finite_bits(rng: np.random.Generator, shape, exponent_mask: int, dtype) -> np.ndarray:
    """Random bit patterns of a float format with the all-ones exponent (Inf/NaN) cleared."""
    bits = rng.integers(0, np.iinfo(dtype).max, size=shape, dtype=dtype, endpoint=True)
    inf_or_nan = (bits & exponent_mask) == exponent_mask
    return np.where(inf_or_nan, bits ^ (exponent_mask & (exponent_mask >> 1)), bits).astype(dtype)


def random_rows(ggml_type: int, rows: int, cols: int, seed: int) -> np.ndarray:
    """(rows, row_bytes) uint8: random quant bits, every fp16 scale a random finite value
    (negative, zero and subnormal included)."""
    rng = np.random.default_rng(seed)
    block, nbytes = GGML_BLOCK_INFO[ggml_type]
    if ggml_type in FLOAT_BITS:
        dtype = FLOAT_BITS[ggml_type]
        return _finite_bits(rng, (rows, cols), EXPONENT[ggml_type], dtype).view(np.uint8)
    blocks = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
    for off in FP16_FIELDS[ggml_type]:
        scales = _finite_bits(rng, (rows, cols // block), EXPONENT[T.F16], np.uint16)
        blocks[..., off : off + 2] = scales.view(np.uint8).reshape(rows, cols // block, 2)
    return blocks.reshape(rows, -1)


def assert_bit_exact(raw: np.ndarray, ggml_type: int, cols: int) -> None:
    expected = gguf.quants.dequantize(raw, ggml_type)
    got = np.array(dequantize_reference(mx.array(raw), ggml_type, cols))
    assert got.dtype == np.float32 and got.shape == expected.shape
    assert np.isfinite(expected).all(), "test data must not produce NaN/Inf"
    mismatch = got.view(np.uint32) != expected.view(np.uint32)
    assert not mismatch.any(), (
        f"{T(ggml_type).name}: {mismatch.sum()} of {mismatch.size} values differ, first at "
        f"{np.argwhere(mismatch)[0]}: got {got[mismatch][0]!r}, gguf-py {expected[mismatch][0]!r}"
    )


def test_block_info_matches_gguf():
    for t, info in GGML_BLOCK_INFO.items():
        assert info == gguf.GGML_QUANT_SIZES[t]
    assert row_bytes(T.Q4_K, 512) == 288
    assert row_bytes(T.F16, 7) == 14
    assert row_bytes(T.Q8_0, 96) == 102


def test_block_formats_table():
    """The one table the kernels, dequant and the random weights read: sizes as gguf-py's, the
    fp16 fields where ggml puts them, and the kernels' lane split covering each block exactly."""
    assert list(BLOCK_FORMATS) == list(FP16_FIELDS)
    for t, f in BLOCK_FORMATS.items():
        assert (f.block_size, f.block_bytes) == gguf.GGML_QUANT_SIZES[t] == GGML_BLOCK_INFO[t]
        assert f.scale_offsets == FP16_FIELDS[t]
        assert f.lanes * f.groups * f.group_size == f.block_size, T(t).name
        assert f"dq_{T(t).name.lower()}" in f.decoder


@pytest.mark.parametrize("ggml_type", list(GGML_BLOCK_INFO), ids=lambda t: T(t).name)
@pytest.mark.parametrize("rows", [1, 3, 7])
@pytest.mark.parametrize("blocks", [1, 3])
def test_random_blocks_bit_exact(ggml_type, rows, blocks):
    block = GGML_BLOCK_INFO[ggml_type][0]
    cols = block * blocks if block > 1 else 37 * blocks
    raw = random_rows(ggml_type, rows, cols, seed=1000 * ggml_type + 10 * rows + blocks)
    assert_bit_exact(raw, ggml_type, cols)


@pytest.mark.parametrize("ggml_type", list(GGML_BLOCK_INFO), ids=lambda t: T(t).name)
def test_many_blocks_bit_exact(ggml_type):
    """Enough blocks that every value of every quant field and many scales occur."""
    block = GGML_BLOCK_INFO[ggml_type][0]
    cols = block * (16 if block > 1 else 4096)
    assert_bit_exact(random_rows(ggml_type, 33, cols, seed=ggml_type), ggml_type, cols)


def test_leading_dimensions_and_dense_dtypes():
    raw = random_rows(T.Q6_K, 6, 512, seed=3)
    flat = dequantize_reference(mx.array(raw), T.Q6_K, 512)
    nested = dequantize_reference(mx.array(raw.reshape(2, 3, -1)), T.Q6_K, 512)
    assert nested.shape == (2, 3, 512)
    assert mx.array_equal(nested.reshape(6, 512), flat).item()
    # F16/BF16 rows may come in their own dtype, as GGUFFile.to_mx returns them
    for t, dtype in [(T.F16, mx.float16), (T.BF16, mx.bfloat16)]:
        raw = random_rows(t, 4, 40, seed=t)
        as_bytes = dequantize_reference(mx.array(raw), t, 40)
        natural = dequantize_reference(mx.array(raw).view(dtype), t, 40)
        assert mx.array_equal(as_bytes, natural).item()


def test_errors():
    raw = mx.zeros((2, 18), dtype=mx.uint8)
    with pytest.raises(UnsupportedQuantTypeError, match="IQ4_NL"):
        dequantize_reference(raw, T.IQ4_NL, 32)
    with pytest.raises(UnsupportedQuantTypeError, match="9999"):
        dequantize_reference(raw, 9999, 32)
    with pytest.raises(WeightMismatchError):
        dequantize_reference(raw, T.Q4_0, 64)  # rows of 64 need 36 bytes
    with pytest.raises(WeightMismatchError):
        dequantize_reference(raw.astype(mx.int32), T.Q4_0, 32)
    with pytest.raises(WeightMismatchError):
        row_bytes(T.Q4_K, 100)


@pytest.mark.real_model
@pytest.mark.parametrize(
    "fixture, expected_types",
    [
        ("gemma3_gguf_path", {T.Q4_K, T.Q6_K, T.Q5_0, T.Q8_0, T.F32}),
        ("smollm2_gguf_path", {T.Q4_1, T.Q8_0, T.F32}),
    ],
)
def test_real_tensors_bit_exact(request, fixture, expected_types):
    """Up to three tensors of each type in the real GGUFs, at most 2048 rows of each."""
    f = GGUFFile(request.getfixturevalue(fixture))
    done: dict[int, int] = {}
    for t in f.tensors.values():
        if t.ggml_type in GGML_BLOCK_INFO and done.get(t.ggml_type, 0) < 3:
            done[t.ggml_type] = done.get(t.ggml_type, 0) + 1
            raw = t.data.view(np.uint8)  # (rows, row_bytes) for every type
            assert_bit_exact(
                np.array(raw.reshape(-1, raw.shape[-1])[:2048]), t.ggml_type, t.shape[-1]
            )
    assert expected_types <= done.keys()
