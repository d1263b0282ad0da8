"""Row parity of the batched lm_head: each row's logits at B = 1..32 are bit-identical to that
row computed alone (B = 1), through the very op a model's head calls (``models.ops.lm_head``
over ``GGMLLinear``, ``GGMLEmbedding`` for a tied head, ``nn.Linear`` / ``nn.Embedding`` for the
dense types), for every GGML type the GGML layers take. The serving engine's one batched head
per step rests on this: a stream's tokens must not depend on what else shares the batch.

The CPU variant runs the CPU path (affine repack up to ``CPU_QMM_MAX_ROWS`` rows, dequantize +
GEMM past it); the GPU variant the kernels (mat-vec up to 16 rows, 16-row mat-vec slices up to
``qmatmul.ROW_SLICE_MAX``), and for the dense types MLX's matmul in 16-row slices past 16 rows
(``ops.HEAD_SLICE_ROWS``: MLX changes kernels there and row 17 moved, H200 2026-12-02).
Bit-exact, no tolerance: any difference is a broken property, whatever its size.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import requires_gpu
from gguf import GGMLQuantizationType as T

from hf2q_mlx.custom_kernels.ggml_formats import BLOCK_FORMATS
from hf2q_mlx.io.random_weights import random_ggml_blocks
from hf2q_mlx.models.ops import lm_head
from hf2q_mlx.models.quantized import GGMLEmbedding, GGMLLinear

V, H, MAX_B = 1000, 256, 32  # a small head, every batch size the engine runs
DENSE = {T.F32: mx.float32, T.F16: mx.float16, T.BF16: mx.bfloat16}
TYPES = [*DENSE, *BLOCK_FORMATS]


def make_head(ggml_type: int, tied: bool, seed: int):
    """The head callable x (..., H) -> logits (..., V) a model builds for this weight type."""
    if ggml_type in DENSE:
        w = mx.random.normal((V, H), key=mx.random.key(seed)).astype(DENSE[ggml_type]) * 0.05
        layer = nn.Embedding(V, H) if tied else nn.Linear(H, V, bias=False)
        layer.weight = w
    else:
        layer = GGMLEmbedding(V, H, ggml_type) if tied else GGMLLinear(H, V, ggml_type)
        layer.weight = random_ggml_blocks(V, H, ggml_type, seed=seed)
    return lambda x: lm_head(layer, x, tied)


def check_rows(ggml_type: int, tied: bool, dtype: mx.Dtype) -> None:
    seed = int(np.random.SeedSequence().entropy % 2**31)  # fresh inputs every run
    rng = np.random.default_rng(seed)
    head = make_head(ggml_type, tied, seed)
    x = mx.array(rng.normal(size=(MAX_B, 1, H)).astype(np.float32)).astype(dtype)  # (B, 1, H)
    alone = [head(x[i : i + 1]) for i in range(MAX_B)]  # each (1, 1, V)
    mx.eval(alone)
    alone_np = np.stack([np.asarray(a.astype(mx.float32))[0, 0] for a in alone])  # (B, V)
    assert np.isfinite(alone_np).all() and np.ptp(alone_np) > 0
    failed = []
    for b in range(1, MAX_B + 1):
        y = np.asarray(head(x[:b]).astype(mx.float32))[:, 0]  # (b, V)
        rows = [i for i in range(b) if not np.array_equal(y[i], alone_np[i])]
        if rows:
            failed.append((b, rows[:4], float(np.abs(y[rows] - alone_np[rows]).max())))
    name = T(ggml_type).name + (" tied" if tied else "")
    assert not failed, f"{name} {dtype} (seed {seed}): (B, rows, max diff) {failed[:6]}"


@pytest.mark.parametrize("tied", [False, True], ids=["linear", "tied"])
@pytest.mark.parametrize("ggml_type", TYPES, ids=[T(t).name for t in TYPES])
def test_cpu_head_rows_are_bit_identical_at_any_batch(ggml_type, tied):
    with mx.stream(mx.cpu):  # the CPU path, also on a machine with a GPU
        check_rows(ggml_type, tied, mx.float32)


@pytest.mark.parametrize("tied", [False, True], ids=["linear", "tied"])
def test_dense_head_runs_in_16_row_slices_on_a_gpu(tied, monkeypatch):
    """The GPU branch of ``lm_head`` for a dense head, taken here on the CPU: 17..64 rows go in
    slices of at most 16 (what keeps each row's bits on the GPU), the logits those of one call
    (the CPU matmul is row-stable: bit-exact); 16 rows and a prefill's 65 stay one call."""
    from hf2q_mlx.models import ops

    monkeypatch.setattr(ops, "_gpu_default", lambda: True)
    layer = nn.Embedding(V, H) if tied else nn.Linear(H, V, bias=False)
    calls = []
    real = nn.Embedding.as_linear if tied else nn.Linear.__call__

    def counted(self, x):
        calls.append(x.shape[0] if x.ndim == 2 else -1)
        return real(self, x)

    monkeypatch.setattr(type(layer), "as_linear" if tied else "__call__", counted)
    with mx.stream(mx.cpu):
        for rows, want in ((16, [-1]), (40, [16, 16, 8]), (65, [-1])):
            calls.clear()
            x = mx.random.normal((rows, 1, H), key=mx.random.key(rows))
            got = lm_head(layer, x, tied)
            assert calls == want, (rows, calls)
            whole = real(layer, x)
            assert got.shape == whole.shape == (rows, 1, V)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(whole))


@requires_gpu
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32], ids=str)
@pytest.mark.parametrize("tied", [False, True], ids=["linear", "tied"])
@pytest.mark.parametrize("ggml_type", TYPES, ids=[T(t).name for t in TYPES])
def test_gpu_head_rows_are_bit_identical_at_any_batch(ggml_type, tied, dtype):
    with mx.stream(mx.gpu):
        check_rows(ggml_type, tied, dtype)
