"""GGUFFile: round trips through gguf.GGUFWriter, the real GGUFs, and corrupt files that must fail
fast with an Hf2qError."""

from __future__ import annotations

import json
import struct
import time
import tracemalloc
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V

from hf2q_mlx.cli.info import describe
from hf2q_mlx.errors import (
    GGUFFormatError,
    Hf2qError,
    ModelNotFoundError,
    UnsupportedQuantTypeError,
    WeightMismatchError,
)
from hf2q_mlx.io.gguf import GGUFFile, _Header

RNG = np.random.default_rng(0)
FLOATS = {
    "f32_matrix": RNG.standard_normal((3, 5)).astype(np.float32),
    "f32_vector": RNG.standard_normal(7).astype(np.float32),
    "f32_cube": RNG.standard_normal((2, 3, 4)).astype(np.float32),
    "f16_matrix": RNG.standard_normal((2, 64)).astype(np.float16),
}
QUANTIZED = {  # name -> (type, source values)
    "blk.0.q8": (T.Q8_0, RNG.standard_normal((4, 64)).astype(np.float32)),
    "blk.0.q4": (T.Q4_0, RNG.standard_normal((3, 96)).astype(np.float32)),
    "blk.1.bf16": (T.BF16, RNG.standard_normal((2, 8)).astype(np.float32)),
}
METADATA = {  # key -> (value type, value) written with the matching GGUFWriter.add_*
    "test.u8": (V.UINT8, 200),
    "test.i8": (V.INT8, -100),
    "test.u16": (V.UINT16, 60000),
    "test.i16": (V.INT16, -30000),
    "test.u32": (V.UINT32, 4_000_000_000),
    "test.i32": (V.INT32, -2_000_000_000),
    "test.f32": (V.FLOAT32, -1.25),
    "test.u64": (V.UINT64, 2**63 + 5),
    "test.i64": (V.INT64, -(2**62)),
    "test.f64": (V.FLOAT64, 0.1),
    "test.bool": (V.BOOL, True),
    "test.string": (V.STRING, "héllo, wörld ✓"),
    "test.ints": (V.ARRAY, [1, -2, 3]),
    "test.floats": (V.ARRAY, [0.5, -0.25]),
    "test.strings": (V.ARRAY, ["<pad>", "", "▁the", "日本"]),
    "test.bools": (V.ARRAY, [True, False, True]),
    "test.nested": (V.ARRAY, [[1, 2], [3]]),
}


def write_gguf(path: Path, alignment: int | None = None) -> Path:
    w = gguf.GGUFWriter(path, "llama")
    if alignment:
        w.add_custom_alignment(alignment)
    for key, (vtype, value) in METADATA.items():
        w.add_key_value(key, value, vtype)
    for name, array in FLOATS.items():
        w.add_tensor(name, array)
    for name, (qtype, values) in QUANTIZED.items():
        w.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "small.gguf")


@pytest.mark.parametrize("alignment", [None, 64])
def test_round_trip(tmp_path, alignment):
    f = GGUFFile(write_gguf(tmp_path / "t.gguf", alignment))
    assert f.architecture == "llama" and f.version == 3
    assert f.alignment == (alignment or 32)
    for key, (_, value) in METADATA.items():
        got = f.metadata[key]
        assert got == value and type(got) is type(value), key
    assert set(f.tensors) == set(FLOATS) | set(QUANTIZED)
    for name, array in FLOATS.items():
        t = f.tensors[name]
        assert t.shape == array.shape and t.ggml_type == (
            T.F16 if array.dtype == np.float16 else T.F32
        )
        assert t.offset % f.alignment == 0
        np.testing.assert_array_equal(np.asarray(t.data), array)
        got = f.to_mx(name)
        assert got.dtype == (mx.float16 if array.dtype == np.float16 else mx.float32)
        np.testing.assert_array_equal(np.array(got), array)
    for name, (qtype, values) in QUANTIZED.items():
        t, raw = f.tensors[name], gguf.quants.quantize(values, qtype)
        assert t.ggml_type == qtype and t.shape == values.shape and t.nbytes == raw.nbytes
        if qtype == T.BF16:  # plain type: its uint16 bits, and mx.bfloat16 from to_mx
            np.testing.assert_array_equal(np.asarray(t.data), raw.view(np.uint16))
            got = f.to_mx(name)
            assert got.dtype == mx.bfloat16 and got.shape == values.shape
            np.testing.assert_array_equal(np.array(got.view(mx.uint16)), raw.view(np.uint16))
        else:
            assert t.data.dtype == np.uint8 and t.data.shape == raw.shape
            np.testing.assert_array_equal(np.asarray(t.data), raw)
            np.testing.assert_array_equal(np.array(f.to_mx(name)), raw)
    with pytest.raises(WeightMismatchError, match="no tensor named"):
        f.to_mx("missing.weight")


def test_missing_file(tmp_path):
    with pytest.raises(ModelNotFoundError):
        GGUFFile(tmp_path / "nope.gguf")
    with pytest.raises(ModelNotFoundError):
        describe(tmp_path / "nope.gguf")


def test_describe_hf_directory(tmp_path):
    from safetensors.numpy import save_file

    config = {
        "model_type": "gemma3",
        "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": {"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 100},
        "quantization": {"group_size": 64, "bits": 4},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    weights = {
        "model.embed_tokens.weight": np.zeros((100, 8), np.uint32),  # 4-bit, packed
        "model.embed_tokens.scales": np.zeros((100, 1), np.float16),
        "model.norm.weight": np.ones(64, np.float32),
    }
    save_file(weights, str(tmp_path / "model.safetensors"))
    text = describe(tmp_path)
    for expected in ["gemma3", "layers:          2", "vocab size:      100", "100x8", "U32"]:
        assert expected in text
    assert f"{100 * 64 + 100 + 64:,}" in text  # parameters: packed words count 8 elements
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(Hf2qError, match="safetensors"):
        describe(tmp_path)


@pytest.mark.real_model
def test_gemma3_gguf(gemma3_gguf_path):
    f = GGUFFile(gemma3_gguf_path)
    assert f.architecture == "gemma3" and len(f.tensors) == 236
    assert f.metadata["gemma3.block_count"] == 18
    assert len(f.metadata["tokenizer.ggml.tokens"]) == 262144
    t = f.tensors["token_embd.weight"]
    assert t.ggml_type == T.Q8_0 and t.shape == (262144, 640) and t.data.shape == (262144, 680)
    assert {t.type_name for t in f.tensors.values()} == {"F32", "Q5_0", "Q4_K", "Q6_K", "Q8_0"}
    s = f.summary()
    assert s["vocab_size"] == 262144 and s["layers"] == 18 and s["file_type"] == "Q4_K_M"
    assert sum(r["bytes"] for r in s["types"].values()) <= s["file_size"]
    text = describe(gemma3_gguf_path)
    assert "gemma3" in text and "Q4_K" in text and "blk.17.ffn_down.weight" in text


@pytest.mark.real_model
def test_smollm2_gguf_matches_gguf_reader(smollm2_gguf_path):
    f = GGUFFile(smollm2_gguf_path)
    assert f.architecture == "llama" and len(f.tensors) == 272
    assert f.summary()["vocab_size"] == 49152
    reader = gguf.GGUFReader(smollm2_gguf_path)
    expected = {k: v.contents() for k, v in reader.fields.items() if not k.startswith("GGUF.")}
    assert f.metadata == expected
    for rt in reader.tensors:
        t = f.tensors[rt.name]
        assert (t.ggml_type, t.offset, t.nbytes) == (rt.tensor_type, rt.data_offset, rt.n_bytes)
        assert t.data.shape == rt.data.shape and t.data.dtype == rt.data.dtype


@pytest.mark.real_model
def test_truncated_real_gguf(smollm2_gguf_path, tmp_path):
    """Cuts inside the 49152-token vocabulary, the merges, the tensor infos and the data."""
    f = GGUFFile(smollm2_gguf_path)
    with open(smollm2_gguf_path, "rb") as fh:
        head = fh.read(f.data_offset + 4096)
    for cut in [100, 5_000, 300_000, 1_000_000, f.data_offset - 1, f.data_offset + 4096]:
        assert_fails_fast(tmp_path, head[:cut], GGUFFormatError)


# ---- corrupt files ------------------------------------------------------------------------


def open_timed(path: Path) -> float:
    start = time.perf_counter()
    try:
        GGUFFile(path)
    finally:
        elapsed = time.perf_counter() - start
        assert elapsed < 1.0, f"{path} took {elapsed:.2f} s"
    return elapsed


def assert_fails_fast(tmp_path: Path, data: bytes, error: type = Hf2qError) -> Hf2qError:
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(data)
    with pytest.raises(error) as info:
        open_timed(path)
    assert str(path) in str(info.value)
    return info.value


def layout(data: bytes) -> dict[str, int]:
    """Byte offsets of a few fields of the small test file, found by walking its header."""
    pos, found = 24, {}
    for _ in range(struct.unpack_from("<Q", data, 16)[0]):  # metadata
        klen = struct.unpack_from("<Q", data, pos)[0]
        key = data[pos + 8 : pos + 8 + klen].decode()
        found[f"key:{key}"] = pos
        pos += 8 + klen
        found[f"type:{key}"] = pos
        vtype = struct.unpack_from("<I", data, pos)[0]
        pos += 4
        if vtype == V.ARRAY:
            found[f"count:{key}"] = pos + 4
        h = _Header(memoryview(data), Path("x"))  # skip the value with the reader's parser
        h.pos = pos
        h.value(vtype, key)
        pos = h.pos
    for _ in range(struct.unpack_from("<Q", data, 8)[0]):  # tensor infos
        nlen = struct.unpack_from("<Q", data, pos)[0]
        name = data[pos + 8 : pos + 8 + nlen].decode()
        pos += 8 + nlen
        n_dims = struct.unpack_from("<I", data, pos)[0]
        pos += 4 + 8 * n_dims
        found[f"ggml_type:{name}"], found[f"offset:{name}"] = pos, pos + 4
        pos += 12
    found["infos_end"] = pos
    return found


def patched(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


def test_truncated_everywhere(small_gguf, tmp_path):
    data = small_gguf.read_bytes()
    f = GGUFFile(small_gguf)
    data_end = max(t.offset + t.nbytes for t in f.tensors.values())
    cuts = list(range(0, f.data_offset + 1)) + list(range(f.data_offset, data_end, 7))
    for cut in cuts:
        assert_fails_fast(tmp_path, data[:cut])


def test_bad_magic_and_version(small_gguf, tmp_path):
    data = small_gguf.read_bytes()
    assert "magic" in str(assert_fails_fast(tmp_path, b"GGML" + data[4:], GGUFFormatError))
    assert "magic" in str(assert_fails_fast(tmp_path, b"\0" * 64, GGUFFormatError))
    for version in (0, 1, 4, 2**31):
        err = assert_fails_fast(tmp_path, patched(data, 4, "<I", version), GGUFFormatError)
        assert "version" in str(err)
    err = assert_fails_fast(tmp_path, patched(data, 4, ">I", 3), GGUFFormatError)
    assert "big-endian" in str(err)


def assert_fails_small(tmp_path: Path, data: bytes) -> None:
    """Fails fast with GGUFFormatError, allocating little on the way (no huge counts trusted)."""
    tracemalloc.start()
    try:
        assert_fails_fast(tmp_path, data, GGUFFormatError)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20


@pytest.mark.parametrize("field", ["tensor count", "metadata count"])
@pytest.mark.parametrize("count", [2**64 - 1, 2**40, 10**6])
def test_huge_counts(small_gguf, tmp_path, field, count):
    offset = 8 if field == "tensor count" else 16
    assert_fails_small(tmp_path, patched(small_gguf.read_bytes(), offset, "<Q", count))


def test_huge_lengths(small_gguf, tmp_path):
    data = small_gguf.read_bytes()
    at = layout(data)
    for offset, value in [
        (at["key:general.architecture"], 2**63),  # key length
        (at["count:test.strings"], 2**62),  # string array length
        (at["count:test.ints"], 2**61),  # int32 array length
        (at["count:test.nested"], 10**9),  # array of arrays
    ]:
        assert_fails_small(tmp_path, patched(data, offset, "<Q", value))


def test_bad_types_and_offsets(small_gguf, tmp_path):
    data = small_gguf.read_bytes()
    at = layout(data)
    f = GGUFFile(small_gguf)
    q4 = f.tensors["blk.0.q4"]
    cases = [
        (at["type:test.u8"], "<I", 99, GGUFFormatError, "unknown value type"),
        (at["ggml_type:blk.0.q8"], "<I", 9999, UnsupportedQuantTypeError, "9999"),
        (at["ggml_type:blk.0.q8"], "<I", 4, UnsupportedQuantTypeError, "type id 4"),  # Q4_2
        (at["ggml_type:blk.0.q8"], "<I", T.Q4_K, GGUFFormatError, "blocks of 256"),
        (at["offset:blk.0.q4"], "<Q", q4.offset - f.data_offset + 1, GGUFFormatError, "align"),
        (at["offset:blk.0.q4"], "<Q", 0, GGUFFormatError, "overlap"),
        (at["offset:blk.0.q4"], "<Q", 2**40, GGUFFormatError, "past the end"),
        (at["offset:blk.0.q4"], "<Q", 2**64 - 32, GGUFFormatError, "past the end"),
    ]
    for offset, fmt, value, error, message in cases:
        err = assert_fails_fast(tmp_path, patched(data, offset, fmt, value), error)
        assert message in str(err)


def test_bad_alignment(tmp_path):
    w = gguf.GGUFWriter(tmp_path / "a.gguf", "llama")
    w.add_uint32("general.alignment", 48)
    w.add_tensor("x", np.ones(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_fails_fast(tmp_path, (tmp_path / "a.gguf").read_bytes(), GGUFFormatError)


def test_random_header_byte_flips(small_gguf, tmp_path):
    """Flipped header bytes either still parse or raise an Hf2qError, never anything else."""
    data = small_gguf.read_bytes()
    header_end = GGUFFile(small_gguf).data_offset
    rng = np.random.default_rng(1234)
    path, failures = tmp_path / "flipped.gguf", 0
    for _ in range(400):
        out = bytearray(data)
        for pos in rng.integers(0, header_end, size=rng.integers(1, 5)):
            out[pos] ^= int(rng.integers(1, 256))
        path.write_bytes(bytes(out))
        try:
            open_timed(path)
        except Hf2qError:
            failures += 1
    assert failures > 100  # most flips must be noticed


def test_invalid_utf8_in_a_token_is_a_format_error(tmp_path):
    # a flipped bit inside a token string once came out as a surrogate and raised
    # UnicodeEncodeError in the tokenizer instead of the project's error
    w = gguf.GGUFWriter(tmp_path / "v.gguf", "llama")
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b", "é", "ab"])
    w.add_token_merges(["a b"])
    w.add_tensor("x", np.ones(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = (tmp_path / "v.gguf").read_bytes()
    at = data.index("é".encode())
    bad = bytearray(data)
    bad[at + 1] ^= 0x40  # 0xA9 -> 0xE9: no longer a continuation byte
    err = assert_fails_fast(tmp_path, bytes(bad), GGUFFormatError)
    assert "tokenizer.ggml.tokens" in str(err) and "UTF-8" in str(err)


@pytest.mark.parametrize("alignment", [32, 64])
def test_tensor_table_ending_on_an_alignment_boundary(tmp_path, alignment):
    # with no padding needed, the data must start right after the table: a reader that always
    # pads (or pads by the wrong amount) reads every tensor from the wrong bytes
    values = np.arange(8, dtype=np.float32)
    for pad in range(alignment):
        path = tmp_path / f"a{pad}.gguf"
        w = gguf.GGUFWriter(path, "llama")
        if alignment != 32:
            w.add_custom_alignment(alignment)
        w.add_string("test.pad", "x" * pad)
        w.add_tensor("t", values)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        data = path.read_bytes()
        if layout(data)["infos_end"] % alignment == 0:
            break
    else:
        pytest.fail("no padding length put the table end on the boundary")
    f = GGUFFile(path)
    assert f.data_offset == layout(data)["infos_end"]
    np.testing.assert_array_equal(np.asarray(f.tensors["t"].data), values)
