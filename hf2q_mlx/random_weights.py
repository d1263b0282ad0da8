"""Random but valid GGML blocks: finite fp16 scales, random quant bits (tests and benchmarks)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as T

# (elements per block, bytes per block, byte offsets of the fp16 scale fields inside a block)
_LAYOUT: dict[int, tuple[int, int, tuple[int, ...]]] = {
    T.Q4_0: (32, 18, (0,)),
    T.Q4_1: (32, 20, (0, 2)),
    T.Q5_0: (32, 22, (0,)),
    T.Q5_1: (32, 24, (0, 2)),
    T.Q8_0: (32, 34, (0,)),
    T.Q2_K: (256, 84, (80, 82)),
    T.Q3_K: (256, 110, (108,)),
    T.Q4_K: (256, 144, (0, 2)),
    T.Q5_K: (256, 176, (0, 2)),
    T.Q6_K: (256, 210, (208,)),
}


def random_ggml_blocks(
    rows: int, cols: int, ggml_type: int, seed: int = 0, scale: float = 0.02
) -> mx.array:
    """uint8 (rows, cols // block * block_bytes) of valid blocks; scales in [scale/4, scale].

    Built with MLX ops, so on a GPU device a multi-GB weight is generated on the device.
    """
    if ggml_type not in _LAYOUT:
        raise ValueError(f"no random generator for GGML type {ggml_type}")
    qk, nbytes, scale_offsets = _LAYOUT[ggml_type]
    if cols % qk:
        raise ValueError(f"cols={cols} is not a multiple of the block size {qk}")
    nblocks = cols // qk
    key = mx.random.key(seed)
    k_bits, k_scale = mx.random.split(key)
    blocks = mx.random.randint(0, 256, (rows, nblocks, nbytes), key=k_bits).astype(mx.uint8)
    n_scales = len(scale_offsets)
    s = mx.random.uniform(scale / 4, scale, (rows, nblocks, n_scales), key=k_scale)
    s_bytes = s.astype(mx.float16).view(mx.uint8).reshape(rows, nblocks, n_scales, 2)
    parts, pos = [], 0
    for j, off in enumerate(scale_offsets):
        parts += [blocks[..., pos:off], s_bytes[:, :, j, :]]
        pos = off + 2
    parts.append(blocks[..., pos:])
    return mx.concatenate(parts, axis=-1).reshape(rows, nblocks * nbytes)


def random_ggml_blocks_np(rows: int, cols: int, ggml_type: int, seed: int = 0) -> np.ndarray:
    """The same as a numpy array (for gguf-py comparisons)."""
    return np.array(random_ggml_blocks(rows, cols, ggml_type, seed))
