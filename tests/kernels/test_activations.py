"""Gated activations and the logit softcap: references against numpy / PyTorch, the kernel
bodies on the CPU emulation (test_norm_rope.Emulated), the kernels on a GPU."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from conftest import requires_gpu
from test_norm_rope import assert_one_rounding, emulate, needs_gxx

from hf2q_mlx.custom_kernels import activations as act
from hf2q_mlx.custom_kernels import softcap as sc


def _np_act(g, kind):
    g = np.asarray(g, np.float64)
    if kind == "silu":
        return g / (1 + np.exp(-g))
    return 0.5 * g * (1 + np.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)))


def _inputs(shape, seed, dtype=mx.float32):
    rng = np.random.default_rng(seed)
    gate = (rng.standard_normal(shape) * 3).astype(np.float32)
    up = rng.standard_normal(shape).astype(np.float32)
    return mx.array(gate).astype(dtype), mx.array(up).astype(dtype)


@pytest.mark.parametrize("kind", act.ACTIVATIONS)
def test_reference_against_numpy_and_torch(kind):
    gate, up = _inputs((3, 5, 77), 1)
    got = act.gated_activation_reference(gate, up, kind)
    want = _np_act(gate, kind) * np.array(up, np.float64)
    np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=1e-6)
    torch = pytest.importorskip("torch")
    tg = torch.tensor(np.array(gate))
    tf = torch.nn.functional
    t_act = tf.silu(tg) if kind == "silu" else tf.gelu(tg, approximate="tanh")
    np.testing.assert_allclose(np.array(got), (t_act * torch.tensor(np.array(up))).numpy(),
                               rtol=1e-5, atol=1e-6)  # fmt: skip
    # fused gate_up: gate is the first half of the last axis
    fused = mx.concatenate([gate, up], axis=-1)
    assert mx.array_equal(act.gated_activation_reference(fused, None, kind), got)


def test_softcap_reference_and_errors():
    x = mx.array(np.random.default_rng(2).standard_normal((2, 1000)).astype(np.float32) * 60)
    want = 30 * np.tanh(np.array(x, np.float64) / 30)
    np.testing.assert_allclose(np.array(sc.softcap_reference(x, 30.0)), want, rtol=2e-6, atol=1e-6)
    with pytest.raises(ValueError):
        sc.softcap(x, 0.0)
    with pytest.raises(ValueError):
        act.gated_activation(x, x[:, :10])
    with pytest.raises(ValueError):
        act.gated_activation(x[:, :999], None)
    with pytest.raises(ValueError):
        act.gated_activation(x, x, "relu")


@needs_gxx
@pytest.mark.parametrize("kind", act.ACTIVATIONS)
@pytest.mark.parametrize("fused", [False, True])
def test_activation_body_emulated(monkeypatch, kind, fused):
    emu = emulate(monkeypatch, act, "_kernel")
    gate, up = _inputs((2, 3, 45), 3)
    args = (mx.concatenate([gate, up], -1), None) if fused else (gate, up)
    got = act.gated_activation(*args, kind=kind)
    assert emu["_kernel"].launches == 1
    want = act.gated_activation_reference(gate, up, kind)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=2e-6, atol=1e-7)


@needs_gxx
def test_softcap_body_emulated(monkeypatch):
    emu = emulate(monkeypatch, sc, "_kernel")
    x = mx.array(np.random.default_rng(4).standard_normal((3, 333)).astype(np.float32) * 50)
    got = sc.softcap(x, 30.0)
    assert emu["_kernel"].launches == 1
    np.testing.assert_allclose(np.array(got), np.array(sc.softcap_reference(x, 30.0)),
                               rtol=1e-6, atol=1e-6)  # fmt: skip


# ---- GPU ----------------------------------------------------------------------------------------

DTYPES = [mx.float32, mx.float16, mx.bfloat16]


@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", act.ACTIVATIONS)
@pytest.mark.parametrize("shape", [(1, 1, 2816), (2, 5, 2112), (1, 5, 13), (3, 1, 6144)], ids=str)
@pytest.mark.parametrize("fused", [False, True])
def test_activation_gpu(dtype, kind, shape, fused):
    gate, up = _inputs(shape, sum(shape), dtype)
    args = (mx.concatenate([gate, up], -1), None) if fused else (gate, up)
    got = act.gated_activation(*args, kind=kind)
    want = act.gated_activation_reference(gate, up, kind)
    assert got.shape == want.shape and got.dtype == dtype
    if dtype == mx.float32:
        # same formula; exp / tanh of the GPU's libm within a few ulps
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-6)
    else:
        assert_one_rounding(got, want, dtype)
    if dtype == mx.float32:
        return
    # the unfused low-precision sequence: the kernel's error is at most twice its error
    exact = act.gated_activation_reference(gate.astype(mx.float32), up.astype(mx.float32), kind)
    fn = {
        "silu": lambda g: g * mx.sigmoid(g),
        "gelu_tanh": lambda g: (
            0.5 * g * (1 + mx.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)))
        ),
    }[kind]
    unfused = fn(gate) * up
    err = mx.abs(got.astype(mx.float32) - exact).max().item()
    err_ref = mx.abs(unfused.astype(mx.float32) - exact).max().item()
    assert err <= 2 * err_ref + 1e-6


@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 262144), (2, 32003), (16, 1000)], ids=str)
def test_softcap_gpu(dtype, shape):
    x = mx.array(np.random.default_rng(shape[1]).standard_normal(shape).astype(np.float32) * 40)
    x = x.astype(dtype)
    got = sc.softcap(x, 30.0)
    want = sc.softcap_reference(x, 30.0)
    assert got.dtype == dtype
    if dtype == mx.float32:
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=2e-6, atol=2e-6)
    else:
        assert_one_rounding(got, want, dtype)
