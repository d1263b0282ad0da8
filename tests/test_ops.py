"""The ops layer (models/ops.py) on its reference path: what it hands to MLX.

Which kernels the models reach is tests/test_kernel_wiring.py's job; the models' numbers are the
parity tests'.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from hf2q_mlx.models import ops


@pytest.fixture
def eager():
    """The ops' compiled helpers traced afresh (no cached trace skips a spy) on the CPU."""
    mx.disable_compile()
    try:
        with mx.stream(mx.cpu):
            yield
    finally:
        mx.enable_compile()


def test_rope_gets_one_offset_for_every_row(eager, monkeypatch):
    """mx.fast.rope reads an offset array of shape (B,) per batch row; its GPU kernel indexes a
    (1,) array that way too, so for B > 1 the ops must pass the position as a scalar (the CPU
    fallback broadcasts either, which is why only this spy sees it). The CPU's own one-op RoPE
    (HF2Q_CPU_FUSED) off, so that the ops call mx.fast.rope here."""
    monkeypatch.setenv("HF2Q_CPU_FUSED", "0")
    offsets, rope_fn = [], mx.fast.rope

    def spy(x, *args, offset, **kwargs):
        offsets.append(offset.shape if isinstance(offset, mx.array) else ())
        return rope_fn(x, *args, offset=offset, **kwargs)

    monkeypatch.setattr(mx.fast, "rope", spy)
    B, L, H, D = 2, 3, 4, 32
    x = mx.random.normal((B, L, H, D), key=mx.random.key(0))
    pos = ops.positions(None)
    assert pos.shape == (1,)  # the form the kernels read
    rope, norm = ops.RoPE(D, 10_000.0), ops.RMSNorm(D)
    mx.eval(rope(x.transpose(0, 2, 1, 3), pos))
    mx.eval(ops.norm_rope(x, norm, rope, pos))
    mx.eval(ops.qk_norm_rope(x, x, norm, norm, rope, pos, v=x))
    assert offsets == [()] * 4
