"""models/kernel_linears.py: MLX float and affine linears / embeddings turned into subclasses that
take our kernels on CUDA at decode sizes; the same parameters and, off CUDA, the same bits."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from hf2q_mlx.custom_kernels import dense_matvec
from hf2q_mlx.models import kernel_linears as KL
from hf2q_mlx.models.quantized import linear_fusion_key


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 64)
        self.q_embed = nn.QuantizedEmbedding(50, 64, group_size=32, bits=4)
        self.proj = nn.Linear(64, 40, bias=True)
        self.q_proj = nn.QuantizedLinear(64, 40, bias=False, group_size=64, bits=8)


def _bits(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32)).view(np.uint32)


def test_use_kernels_swaps_classes_in_place_and_changes_nothing_off_cuda():
    m = Tiny()
    mx.eval(m.parameters())
    x = mx.random.normal((3, 64), key=mx.random.key(1))
    ids = mx.array([4, 49, 0], dtype=mx.int32)

    def calls():
        return [m.embed(ids), m.embed.as_linear(x), m.q_embed(ids), m.q_embed.as_linear(x),
                m.proj(x), m.q_proj(x)]  # fmt: skip

    before = calls()
    keys = [linear_fusion_key(m.proj), linear_fusion_key(m.q_proj)]
    params = dict(tree for tree in m.parameters().items())
    assert KL.use_kernels(m) == 4 and KL.use_kernels(m) == 0  # idempotent
    assert type(m.proj) is KL.KernelLinear and type(m.q_proj) is KL.KernelQuantizedLinear
    assert type(m.embed) is KL.KernelEmbedding
    assert type(m.q_embed) is KL.KernelQuantizedEmbedding
    assert m.parameters().keys() == params.keys() and m.embed.weight is params["embed"]["weight"]
    # they fuse as their bases (models/quantized.py) ...
    assert [linear_fusion_key(m.proj), linear_fusion_key(m.q_proj)] == keys
    # ... and on the CPU compute what MLX's modules do, bit for bit
    with mx.stream(mx.cpu):
        for a, b in zip(before, calls()):
            np.testing.assert_array_equal(_bits(a), _bits(b))


@pytest.fixture
def fake_cuda(monkeypatch):
    """The modules see a CUDA back end; the mat-vec dispatchers are stood in for by counters
    that return the reference (the kernels' own checks: tests/kernels/test_dense_matvec.py)."""
    calls = []

    def stand_in(name, ref):
        def f(*args, **kwargs):
            calls.append((name, args[0].shape))
            return ref(*args, **kwargs)

        return f

    monkeypatch.setattr(KL, "backend", lambda: "cuda")
    monkeypatch.setattr(dense_matvec, "backend", lambda: "cuda")
    monkeypatch.setattr(dense_matvec, "float_matvec",
                        stand_in("float", dense_matvec.float_matvec_reference))  # fmt: skip
    monkeypatch.setattr(dense_matvec, "affine_matvec",
                        stand_in("affine", dense_matvec.affine_matvec_reference))  # fmt: skip
    return calls


def test_decode_sized_rows_take_the_kernels_on_cuda_and_prefill_keeps_mlx(fake_cuda):
    m = Tiny()
    mx.eval(m.parameters())
    KL.use_kernels(m)
    for rows, taken in ((1, True), (KL.MAX_ROWS, True), (KL.MAX_ROWS + 1, False)):
        fake_cuda.clear()
        x = mx.random.normal((rows, 1, 64), key=mx.random.key(rows))
        y = m.proj(x)
        want = x @ m.proj.weight.T + m.proj.bias
        # fp32: the same products summed in another order
        np.testing.assert_allclose(np.array(y), np.array(want), rtol=1e-5, atol=1e-5)
        m.q_proj(x)
        m.embed.as_linear(x)
        m.q_embed.as_linear(x)
        kinds = [name for name, _ in fake_cuda]
        assert kinds == (["float", "affine", "float", "affine"] if taken else []), rows
