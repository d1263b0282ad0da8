"""Random but valid GGML blocks: finite fp16 scales, random quant bits (tests and benchmarks)."""

from __future__ import annotations

import mlx.core as mx

from hf2q_mlx.custom_kernels.ggml_formats import BLOCK_FORMATS


def random_ggml_blocks(
    rows: int, cols: int, ggml_type: int, seed: int = 0, scale: float = 0.02
) -> mx.array:
    """uint8 (rows, cols // block * block_bytes) of valid blocks; scales in [scale/4, scale].

    Built with MLX ops, so on a GPU device a multi-GB weight is generated on the device.
    """
    if ggml_type not in BLOCK_FORMATS:
        raise ValueError(f"no random generator for GGML type {ggml_type}")
    f = BLOCK_FORMATS[ggml_type]
    qk, nbytes, scale_offsets = f.block_size, f.block_bytes, f.scale_offsets
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


def fill_ggml_modules(model, base_seed: int = 0, evaluate: bool = False) -> None:
    """Random blocks (``random_ggml_blocks``) for every module of ``model`` holding uint8 GGML
    blocks, in place: the i-th module of ``named_modules()`` gets seed ``base_seed + i``.
    ``evaluate``: each weight evaluated as it is made (multi-GB models: one weight's temporaries
    alive at a time)."""
    for i, (_, m) in enumerate(model.named_modules()):
        t = getattr(m, "ggml_type", None)
        if t is None or "weight" not in m or m.weight.dtype != mx.uint8:
            continue
        cols = getattr(m, "in_features", None) or m.dims  # linears and experts; embeddings
        rows = m.weight.size // m.weight.shape[-1]
        m.weight = random_ggml_blocks(rows, cols, t, seed=base_seed + i).reshape(m.weight.shape)
        if evaluate:
            mx.eval(m.weight)
