"""GGUF files: a bounds-checked header parse, memory-mapped tensor data, plain-Python metadata."""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, LlamaFileType
from gguf.constants import GGUF_DEFAULT_ALIGNMENT

from hf2q_mlx.errors import (
    GGUFFormatError,
    ModelNotFoundError,
    UnsupportedQuantTypeError,
    WeightMismatchError,
)

# The header is parsed here rather than by gguf.GGUFReader: the reader has no bounds checks (a
# huge array count over a truncated file loops without end) and builds one numpy array per
# array element, so opening the Gemma 3 270M GGUF (262144-token vocabulary) takes about 11 s.

_VERSIONS = (2, 3)
_MAX_DIMS = 4  # GGML_MAX_DIMS
_HEADER_BYTES = 24  # magic, version, tensor count, KV count
# Smallest possible encodings, to reject counts the file could not hold before looping over them.
_MIN_KV_BYTES = 8 + 4 + 1  # empty key, value type, one-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # empty name, n_dims = 0, type, offset
_MAX_ARRAY_NESTING = 8

_SCALARS: dict[int, np.dtype] = {
    GGUFValueType.UINT8: np.dtype("<u1"),
    GGUFValueType.INT8: np.dtype("<i1"),
    GGUFValueType.UINT16: np.dtype("<u2"),
    GGUFValueType.INT16: np.dtype("<i2"),
    GGUFValueType.UINT32: np.dtype("<u4"),
    GGUFValueType.INT32: np.dtype("<i4"),
    GGUFValueType.FLOAT32: np.dtype("<f4"),
    GGUFValueType.BOOL: np.dtype("<u1"),
    GGUFValueType.UINT64: np.dtype("<u8"),
    GGUFValueType.INT64: np.dtype("<i8"),
    GGUFValueType.FLOAT64: np.dtype("<f8"),
}

# Types whose data is a plain numpy array (BF16 as its uint16 bits); the rest are raw blocks.
_PLAIN_DTYPES: dict[int, np.dtype] = {
    GGMLQuantizationType.F32: np.dtype("<f4"),
    GGMLQuantizationType.F16: np.dtype("<f2"),
    GGMLQuantizationType.BF16: np.dtype("<u2"),
    GGMLQuantizationType.F64: np.dtype("<f8"),
    GGMLQuantizationType.I8: np.dtype("<i1"),
    GGMLQuantizationType.I16: np.dtype("<i2"),
    GGMLQuantizationType.I32: np.dtype("<i4"),
    GGMLQuantizationType.I64: np.dtype("<i8"),
}


@dataclass(frozen=True, eq=False)
class GGUFTensor:
    """One tensor: ``shape`` is row-major (the reverse of GGUF's ``ne``), ``data`` a memmap view:
    ``shape`` in the natural dtype for plain types, ``(*shape[:-1], row_bytes)`` uint8 for blocks.
    """

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray
    offset: int  # absolute byte offset of the data in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return self.ggml_type.name

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


class _Header:
    """Sequential little-endian reads over the mapped file; every read is bounds-checked."""

    def __init__(self, buf: memoryview, path: Path):
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

    def fail(self, msg: str) -> GGUFFormatError:
        return GGUFFormatError(f"{self.path}: {msg}")

    def need(self, n: int, what: str) -> int:
        start = self.pos
        if n > self.size - start:
            raise self.fail(
                f"truncated or corrupt: {what} at byte {start} needs {n} bytes, the file ends at "
                f"{self.size}"
            )
        self.pos = start + n
        return start

    def unpack(self, fmt: str, n: int, what: str) -> int:
        return struct.unpack_from(fmt, self.buf, self.need(n, what))[0]

    def u32(self, what: str) -> int:
        return self.unpack("<I", 4, what)

    def u64(self, what: str) -> int:
        return self.unpack("<Q", 8, what)

    def string(self, what: str) -> str:
        # strict, as gguf-py reads them: surrogates for bad bytes would fail later, far from here
        n = self.u64(f"{what} length")
        start = self.need(n, what)
        try:
            return str(self.buf[start : start + n], "utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} at byte {start} is not valid UTF-8") from e

    def name(self, what: str) -> str:
        """A key or tensor name: printable, so that every message naming it stays one line."""
        start = self.pos + 8
        text = self.string(what)
        if not text.isprintable():
            raise self.fail(f"{what} at byte {start} has control characters: {text!r}")
        return text

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        """A metadata value as plain Python."""
        if vtype == GGUFValueType.STRING:
            return self.string(what)
        if vtype in _SCALARS:
            return self.array(vtype, 1, what)[0]
        if vtype != GGUFValueType.ARRAY:
            raise self.fail(f"{what} has unknown value type {vtype}")
        if depth >= _MAX_ARRAY_NESTING:
            raise self.fail(f"{what} nests arrays more than {_MAX_ARRAY_NESTING} deep")
        item_type = self.u32(f"{what} item type")
        count = self.u64(f"{what} length")
        return self.array(item_type, count, what, depth + 1)

    def array(self, item_type: int, count: int, what: str, depth: int = 0) -> list:
        dtype = _SCALARS.get(item_type)
        if dtype is not None:
            start = self.need(count * dtype.itemsize, what)
            values = np.frombuffer(self.buf, dtype, count, start)
            return (values != 0).tolist() if item_type == GGUFValueType.BOOL else values.tolist()
        # strings (8-byte length) and arrays (type + length) take at least 8 bytes each
        if count * 8 > self.size - self.pos:
            raise self.fail(f"{what} claims {count} items, more than the file could hold")
        if item_type == GGUFValueType.STRING:
            return [self.string(f"{what} item {i}") for i in range(count)]
        return [self.value(item_type, what, depth) for _ in range(count)]


def _parse(buf: memoryview, path: Path):
    """-> (version, metadata, alignment, tensor infos [(name, type id, ne, offset)], data start)."""
    h = _Header(buf, path)
    if h.size < _HEADER_BYTES:
        raise h.fail(f"too short for a GGUF file ({h.size} bytes)")
    magic = bytes(buf[0:4])
    if magic != b"GGUF":
        raise h.fail(f"not a GGUF file (magic {magic!r}, expected b'GGUF')")
    h.pos = 4
    version = h.u32("version")
    if version not in _VERSIONS:
        if int.from_bytes(version.to_bytes(4, "little"), "big") in _VERSIONS:
            raise h.fail("big-endian GGUF files are not supported")
        raise h.fail(f"unsupported GGUF version {version} (supported: 2, 3)")
    n_tensors, n_kv = h.u64("tensor count"), h.u64("metadata count")
    if n_tensors * _MIN_TENSOR_INFO_BYTES + n_kv * _MIN_KV_BYTES > h.size - h.pos:
        raise h.fail(
            f"header claims {n_tensors} tensors and {n_kv} metadata entries, "
            f"more than a {h.size}-byte file can hold"
        )

    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        key = h.name(f"metadata key {i}")
        if key in metadata:
            raise h.fail(f"duplicate metadata key {key!r}")
        metadata[key] = h.value(h.u32(f"type of {key!r}"), f"value of {key!r}")

    infos = []
    for i in range(n_tensors):
        name = h.name(f"tensor name {i}")
        n_dims = h.u32(f"dimension count of {name!r}")
        if n_dims > _MAX_DIMS:
            raise h.fail(f"tensor {name!r} has {n_dims} dimensions (at most {_MAX_DIMS})")
        ne = [h.u64(f"dimensions of {name!r}") for _ in range(n_dims)]
        if math.prod(ne) >= 2**63 or any(d >= 2**63 for d in ne):
            raise h.fail(f"tensor {name!r} has impossible dimensions {ne}")
        type_id = h.u32(f"type of {name!r}")
        offset = h.u64(f"data offset of {name!r}")
        infos.append((name, type_id, ne, offset))

    alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
        raise h.fail(f"general.alignment must be a power of two, got {alignment!r}")
    data_start = -(-h.pos // alignment) * alignment
    return version, metadata, alignment, infos, data_start


def _ggml_type(type_id: int, name: str, path: Path) -> GGMLQuantizationType:
    try:
        ggml_type = GGMLQuantizationType(type_id)
    except ValueError:
        ggml_type = None
    if ggml_type not in GGML_QUANT_SIZES:
        raise UnsupportedQuantTypeError(
            f"{path}: tensor {name!r} has GGML type id {type_id}, which gguf-py does not know"
        )
    return ggml_type


def type_mix(tensors: Iterable[tuple[str, int, int]]) -> dict[str, dict[str, int]]:
    """(type name, elements, bytes) per tensor -> per type {tensors, elements, bytes}, largest
    first."""
    types: dict[str, dict[str, int]] = {}
    for name, elements, nbytes in tensors:
        row = types.setdefault(name, {"tensors": 0, "elements": 0, "bytes": 0})
        row["tensors"] += 1
        row["elements"] += elements
        row["bytes"] += nbytes
    return dict(sorted(types.items(), key=lambda kv: -kv[1]["bytes"]))


class GGUFFile:
    """A GGUF file, validated at open; tensor data stays memory-mapped until ``to_mx``."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            what = "is a directory" if self.path.is_dir() else "no such file"
            raise ModelNotFoundError(f"{self.path}: {what}, expected a GGUF file")
        self.file_size = self.path.stat().st_size
        if self.file_size < _HEADER_BYTES:  # also keeps np.memmap off empty files
            raise GGUFFormatError(
                f"{self.path}: too short for a GGUF file ({self.file_size} bytes)"
            )
        try:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        except OSError as e:
            raise ModelNotFoundError(f"{self.path}: cannot read: {e}") from e
        self.version, self.metadata, self.alignment, infos, self.data_offset = _parse(
            memoryview(self._map), self.path
        )
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str) or not arch:
            raise GGUFFormatError(f"{self.path}: no general.architecture in the metadata")
        self.architecture: str = arch
        self.tensors: dict[str, GGUFTensor] = {}
        for info in infos:
            tensor = self._tensor(*info)
            if tensor.name in self.tensors:
                raise GGUFFormatError(f"{self.path}: duplicate tensor {tensor.name!r}")
            self.tensors[tensor.name] = tensor
        self._check_overlaps()

    def _tensor(self, name: str, type_id: int, ne: list[int], offset: int) -> GGUFTensor:
        ggml_type = _ggml_type(type_id, name, self.path)
        block, block_bytes = GGML_QUANT_SIZES[ggml_type]
        shape = tuple(reversed(ne))
        cols = shape[-1] if shape else 1
        if cols % block:
            raise GGUFFormatError(
                f"{self.path}: tensor {name!r} rows of {cols} are not whole {ggml_type.name} "
                f"blocks of {block}"
            )
        nbytes = math.prod(shape[:-1]) * (cols // block) * block_bytes
        start = self.data_offset + offset
        if offset % self.alignment:
            raise GGUFFormatError(
                f"{self.path}: tensor {name!r} data offset {offset} is not a multiple of the "
                f"alignment {self.alignment}"
            )
        if nbytes > self.file_size - start:
            raise GGUFFormatError(
                f"{self.path}: tensor {name!r} data (bytes {start}..{start + nbytes}) runs past "
                f"the end of the file ({self.file_size} bytes)"
            )
        raw = self._map[start : start + nbytes]
        if ggml_type in _PLAIN_DTYPES:
            data = raw.view(_PLAIN_DTYPES[ggml_type]).reshape(shape)
        else:
            data = raw.reshape(*shape[:-1], cols // block * block_bytes)
        return GGUFTensor(name, ggml_type, shape, data, start, nbytes)

    def _check_overlaps(self) -> None:
        spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in self.tensors.values())
        for (_, end, prev), (start, _, name) in zip(spans, spans[1:]):
            if start < end:
                raise GGUFFormatError(f"{self.path}: data of tensors {prev!r} and {name!r} overlap")

    def to_mx(self, name: str) -> mx.array:
        """F32/F16/BF16 (and integer types) in their dtype with ``shape``; blocks as raw uint8."""
        tensor = self.tensors.get(name)
        if tensor is None:
            raise WeightMismatchError(f"{self.path}: no tensor named {name!r}")
        if tensor.ggml_type == GGMLQuantizationType.BF16:
            return mx.array(tensor.data).view(mx.bfloat16)
        return mx.array(tensor.data)

    def summary(self) -> dict[str, Any]:
        """Header facts for ``hf2q-mlx info``; reads no tensor data."""
        md, arch = self.metadata, self.architecture
        headline = {  # summary key -> GGUF key after "<arch>."
            "context_length": "context_length",
            "layers": "block_count",
            "embedding_length": "embedding_length",
            "heads": "attention.head_count",
            "kv_heads": "attention.head_count_kv",
        }
        tokens = md.get("tokenizer.ggml.tokens")
        file_type = md.get("general.file_type")
        try:
            file_type_name = LlamaFileType(file_type).name.removeprefix("MOSTLY_")
        except ValueError:
            file_type_name = None
        types = type_mix((t.type_name, t.n_elements, t.nbytes) for t in self.tensors.values())
        return {
            "path": str(self.path),
            "file_size": self.file_size,
            "version": self.version,
            "architecture": arch,
            "name": md.get("general.name"),
            "file_type": file_type_name or file_type,
            **{key: md.get(f"{arch}.{gguf_key}") for key, gguf_key in headline.items()},
            "vocab_size": len(tokens) if isinstance(tokens, list) else md.get(f"{arch}.vocab_size"),
            # the other hyperparameters of the architecture (rope base, windows, ...)
            "hparams": {
                key.removeprefix(f"{arch}."): value
                for key, value in md.items()
                if key.startswith(f"{arch}.")
                and key.removeprefix(f"{arch}.") not in headline.values()
                and not (isinstance(value, list) and len(value) > 64)
            },
            "parameters": sum(row["elements"] for row in types.values()),
            "types": types,
            "tensors": [(t.name, t.type_name, t.shape, t.nbytes) for t in self.tensors.values()],
        }
