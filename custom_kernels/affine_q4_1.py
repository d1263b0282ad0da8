"""MLX affine 4-bit experts as GGML Q4_1 blocks, so that a prompt's routed experts run the
grouped tensor-core kernels (expert_mma) instead of MLX's ``gather_qmm``.

Why: MLX 0.32.4's CUDA ``gather_qmm`` compiles its GEMM variants at first use on a machine (a
fresh H100's first 512-token prefill of Gemma-4-26B-A4B in MLX 4-bit: 46.6 s, Qwen3.5-35B-A3B
50.2 s, session 39), and in Q4_K the grouped kernels prefill those shapes at 2.4-4.4x our
MLX 4-bit rate (docs/kernels.md). Both formats are ``scale * q + bias`` per group: an affine
group of 32, 64 or 128 codes is one, two or four Q4_1 blocks (fp16 d = scale, fp16 m = bias,
16 bytes of nibbles: value j low, value j + 16 high). Scales and biases pass through fp16:
exact for bf16 values from 2^-17 to 65504 in magnitude and zero (bf16's 8 significant bits
fit fp16's subnormals down to 2^-17), rounded below (|error| < 2^-25), infinite above. A
layer's experts are transcoded per call (one read of the codes, a 5-bit-per-value write:
~11 % more bytes than the codes), never kept: decode keeps the affine kernels and no memory
is added.

``HF2Q_AFFINE_EXPERT_PREFILL`` (read per call): ``1`` on, ``0`` off, unset on with MLX's CUDA
back end. Session 40, H100, MLX 4-bit at 512 / 2,048 tokens: Gemma-4-26B-A4B 5,025 / 8,206 tok/s
against 1,524 / 1,670 through gather_qmm, Qwen3.5-35B-A3B 3,743 / 6,329 against 1,720 / 2,019
(``bench/h200_steps.sh affine-experts``).
"""

from __future__ import annotations

import math

import mlx.core as mx
from gguf import GGMLQuantizationType

from hf2q_mlx.custom_kernels import backend, device_constant, env_int
from hf2q_mlx.custom_kernels._render import Example, Kernel
from hf2q_mlx.custom_kernels.expert_glu import MAX_TOKENS
from hf2q_mlx.custom_kernels.graph_ops import per_element

Q4_1 = int(GGMLQuantizationType.Q4_1)
BLOCK = 32  # values per Q4_1 block
BLOCK_BYTES = 20  # fp16 d, fp16 m, 16 bytes of nibbles


def enabled() -> bool:
    """The switch: ``1`` on, ``0`` off, unset on with MLX's CUDA back end (the only back end
    ``covers`` takes: Metal's gather_qmm is not compiled at first use)."""
    on = env_int("HF2Q_AFFINE_EXPERT_PREFILL", 0, 1)
    return backend() == "cuda" if on is None else on == 1


def to_q4_1_reference(wq: mx.array, scales: mx.array, biases: mx.array, group_size: int):
    """Codes (..., N, K / 8) uint32 with scales and biases (..., N, K / group_size) -> Q4_1
    blocks (..., N, K / 32 * 20) uint8, in MLX ops (the kernel's oracle; CPU)."""
    lead, n_words = wq.shape[:-1], wq.shape[-1]
    nb = n_words // 4  # blocks per row
    shifts = mx.arange(0, 32, 4, dtype=mx.uint32)
    words = wq.reshape(*lead, nb, 4, 1)
    nib = ((words >> shifts) & 15).reshape(*lead, nb, 32)  # (..., nb, 32) codes in value order
    qs = (nib[..., :16] | (nib[..., 16:] << 4)).astype(mx.uint8)  # byte j: value j, j + 16
    per = group_size // BLOCK  # blocks per affine group

    def halves(a: mx.array) -> mx.array:  # (..., K / gs) -> (..., nb, 2) bytes of fp16
        h = mx.repeat(a.astype(mx.float16), per, axis=-1) if per > 1 else a.astype(mx.float16)
        return h.reshape(*lead, nb, 1).view(mx.uint8)

    blocks = mx.concatenate([halves(scales), halves(biases), qs], axis=-1)  # (..., nb, 20)
    return blocks.reshape(*lead, nb * BLOCK_BYTES)


_BODY = """
  // Thread mapping: one thread per Q4_1 block b (values 32 b .. 32 b + 31 of the flat weight,
  // rows of a whole number of blocks): its four code words in, its five output words out:
  // fp16 d | fp16 m << 16, then the 16 nibble bytes (byte j: value j low, value j + 16 high).
  if (pos_x >= uint(dims[0])) return;
  const uint64_t b = uint64_t(pos_x);
  const uint w0 = wq[4 * b], w1 = wq[4 * b + 1], w2 = wq[4 * b + 2], w3 = wq[4 * b + 3];
  const uint64_t g = b * 32 / uint64_t(GS);  // the affine group (rows hold whole groups)
  const uint d = uint(bitcast<ushort>(from_float<half_t>(to_float(sc[g]))));
  const uint m = uint(bitcast<ushort>(from_float<half_t>(to_float(bi[g]))));
  out[5 * b] = d | (m << 16);
  UNROLL for (int o = 0; o < 4; ++o) {
    // bytes 4 o .. 4 o + 3: values 4 o + i from w0 / w1 (low), 4 o + i + 16 from w2 / w3 (high)
    const uint lo = o < 2 ? w0 : w1;
    const uint hi = o < 2 ? w2 : w3;
    const uint s = 16u * uint(o % 2);
    uint v = 0u;
    UNROLL for (int i = 0; i < 4; ++i) {
      const uint sh = s + 4u * uint(i);
      v |= (((lo >> sh) & 15u) | (((hi >> sh) & 15u) << 4)) << (8 * i);
    }
    out[5 * b + 1 + uint64_t(o)] = v;
  }
"""

_KERNEL = Kernel(
    "affine_to_q4_1",
    inputs=["wq", "sc", "bi", "dims"],
    outputs=["out"],
    body=_BODY,
    examples=[
        Example(
            {"wq": mx.uint32, "sc": t, "bi": t, "dims": (mx.int32, 1)},
            {"out": mx.uint32},
            {"GS": gs},
        )
        for t, gs in ((mx.bfloat16, 64), (mx.float16, 32), (mx.float32, 128))
    ],
)


def to_q4_1_kernel(wq: mx.array, scales: mx.array, biases: mx.array, group_size: int):
    """The kernel of :func:`to_q4_1_reference` (contiguous arrays; the caller checks shapes)."""
    lead, n_words = wq.shape[:-1], wq.shape[-1]
    n_blocks = math.prod(lead) * (n_words // 4)
    dims = device_constant((n_blocks,), mx.int32)  # the count as data: no build per shape
    inputs = [wq, scales, biases, dims]
    words = per_element(_KERNEL, inputs, n_blocks, (n_blocks * 5,), mx.uint32, {"GS": group_size})
    return words.view(mx.uint8).reshape(*lead, (n_words // 4) * BLOCK_BYTES)


def transcodes(w, group_size: int, bits: int) -> bool:
    """Whether affine arrays ``w`` = (codes, scales, biases) have Q4_1's shape: 4-bit codes in
    groups of 32, 64 or 128, float scales and biases of one dtype, whole blocks per row."""
    wq, scales, biases = w
    return (
        bits == 4
        and group_size in (32, 64, 128)
        and biases is not None
        and wq.dtype == mx.uint32
        and wq.ndim >= 2
        and wq.shape[-1] % 4 == 0
        and scales.dtype in (mx.bfloat16, mx.float16, mx.float32)
        and biases.dtype == scales.dtype
        and scales.shape == biases.shape == (*wq.shape[:-1], wq.shape[-1] * 8 // group_size)
        and wq.shape[-1] * 8 % group_size == 0
    )


def fp16_holds(scales: mx.array, biases: mx.array) -> bool:
    """Whether the blocks' fp16 d and m hold every scale and bias: unchanged from fp16's normal
    range (2^-14) to 65504, which bf16 and fp16 checkpoints' values are but for the epsilon
    scale of an all-zero group (~1e-7); below 2^-14 rounded by at most 2^-25, so each weight
    of such a group moves by less than 15 * 2^-25 (5e-7); past 65504 never (inf). A prompt's
    per-call transcode (``covers``) does not ask: its bf16 x rounds more than that."""
    for a in (scales, biases):
        f = a.astype(mx.float32)
        back = a.astype(mx.float16).astype(mx.float32)
        ok = (back == f) | (mx.abs(f) < 2.0**-14)
        if not bool(mx.all(ok & (mx.abs(f) <= 65504)).item()):
            return False
    return True


def covers(x: mx.array, expert_ids: mx.array, arrays, group_size: int, bits: int) -> bool:
    """Whether a prompt's affine experts take this path: the switch on, MLX's CUDA back end, bf16
    x (the grouped kernels' input), more tokens than the affine expert kernels take, arrays
    that transcode."""
    return (
        enabled()
        and backend() == "cuda"
        and x.dtype == mx.bfloat16
        and expert_ids.ndim >= 2
        and math.prod(expert_ids.shape[:-1]) > MAX_TOKENS  # past the affine expert kernels
        and all(a is None or transcodes(a, group_size, bits) for a in arrays)
    )


def to_q4_1(wq: mx.array, scales: mx.array, biases: mx.array, group_size: int) -> mx.array:
    """:func:`to_q4_1_reference` as one kernel on a GPU, the reference elsewhere."""
    if backend() is None:
        return to_q4_1_reference(wq, scales, biases, group_size)
    return to_q4_1_kernel(wq, scales, biases, group_size)
