"""The chunked delta-net prefill's walk over chunks in one launch (custom_kernels/gated_delta_scan):
its CUDA rendering run on the CPU emulator against float64, through the chunked prefill against
the token-by-token reference, and on a GPU against the MLX loop."""

from __future__ import annotations

import kernel_emulator
import mlx.core as mx
import numpy as np
import pytest
from conftest import requires_gpu
from test_gated_delta import check, make_inputs

from hf2q_mlx.custom_kernels import backend
from hf2q_mlx.custom_kernels import gated_delta as gd
from hf2q_mlx.custom_kernels import gated_delta_scan as gs
from hf2q_mlx.errors import InvalidArgumentError

needs_gxx = pytest.mark.skipif(not kernel_emulator.available(), reason="g++ is not installed")


def walk_inputs(B, H, n, C, dk, dv, seed):
    """Fresh random factors of a walk (attn zero above its diagonal, as the chunked form's is;
    decays in (0.3, 1)): u_all, w_all, q_dec, attn, k_dec, decay, state, all fp32."""
    keys = mx.random.split(mx.random.key(seed), 7)
    causal = mx.tril(mx.ones((C, C)))
    return (
        mx.random.normal((B, H, n, C, dv), key=keys[0]),
        0.2 * mx.random.normal((B, H, n, C, dk), key=keys[1]),
        0.2 * mx.random.normal((B, H, n, C, dk), key=keys[2]),
        0.2 * mx.random.normal((B, H, n, C, C), key=keys[3]) * causal,
        0.2 * mx.random.normal((B, H, n, C, dk), key=keys[4]),
        mx.random.uniform(0.3, 1.0, (B, H, n), key=keys[5]),
        0.3 * mx.random.normal((B, H, dv, dk), key=keys[6]),
    )


def walk_oracle(args):
    """The walk in float64 numpy, chunk by chunk."""
    u, w, q, at, k, dcy, s = (np.array(a, np.float64) for a in args)
    ys = []
    for i in range(u.shape[2]):
        ui = u[:, :, i] - w[:, :, i] @ s.swapaxes(-1, -2)
        ys.append(q[:, :, i] @ s.swapaxes(-1, -2) + at[:, :, i] @ ui)
        s = s * dcy[:, :, i, None, None] + ui.swapaxes(-1, -2) @ k[:, :, i]
    return np.stack(ys, axis=2), s


def emulated(monkeypatch) -> kernel_emulator.Emulated:
    """The scan's dispatcher on a faked CUDA back end, its kernel on the emulator (outputs
    poisoned first), the switch on."""
    emu = kernel_emulator.Emulated(gs._kernel)
    monkeypatch.setattr(gs, "_kernel", emu)
    monkeypatch.setattr(gs, "backend", lambda: "cuda")
    monkeypatch.setenv(gs.SCAN_ENV, "1")
    gs._plan.cache_clear()
    return emu


# (B, H, n chunks, C, Dk, Dv): the real head (C 64, Dk = Dv = 128) over 3 chunks; small heads
# with several value-row blocks, one chunk, short chunks
WALKS = [(1, 1, 3, 64, 128, 128), (2, 3, 4, 16, 32, 48), (1, 2, 1, 8, 64, 16)]


@needs_gxx
@pytest.mark.parametrize("shape", WALKS, ids=lambda s: "x".join(map(str, s)))
def test_scan_kernel_emulated(shape, monkeypatch):
    """The kernel (emulated, every output poisoned first) and the MLX loop it replaces, both
    fp32, against float64: each within 1e-5 of the largest value (a few hundred fp32 products
    a sum per chunk, summed in other orders: ~1e-6)."""
    args = walk_inputs(*shape, seed=sum(shape))
    emu = emulated(monkeypatch)
    y, s = gs.gated_delta_scan(*args)
    assert emu.launches == 1
    want_y, want_s = walk_oracle(args)
    check(y, want_y, 1e-5, "y")
    check(s, want_s, 1e-5, "state")
    ref_y, ref_s = gs.scan_reference(*args)
    check(ref_y, want_y, 1e-5, "reference y")
    check(ref_s, want_s, 1e-5, "reference state")


@needs_gxx
@pytest.mark.parametrize("T,chunk", [(37, 16), (130, 64)])
def test_chunked_prefill_with_the_scan_matches_sequential(T, chunk, monkeypatch):
    """gated_delta_chunked with the walk in one launch (emulated) against the token-by-token
    reference: lengths not divisible by the chunk (padding), several chunks carrying the state
    (fp32 in two summation orders: ~1e-6 relative; allow 2e-5, as the MLX loop's test does)."""
    inp = make_inputs(2, T, 2, 4, 32, 16, seed=T + 1)
    x, _ = gd.causal_conv_reference(inp["qkv"], inp["conv_state"], inp["conv_weight"])
    q, k, v = gd.split_qkv(x, 2, 32, 4)
    args = (q, k, v, inp["a"], inp["b"], inp["A_log"], inp["dt_bias"], inp["state"])
    y_ref, s_ref = gd.gated_delta_reference(*args)
    emu = emulated(monkeypatch)
    y, s = gd.gated_delta_chunked(*args, chunk_size=chunk)
    assert emu.launches == 1
    check(y, np.array(y_ref), 2e-5, "y")
    check(s, np.array(s_ref), 2e-5, "state")


def test_switch_and_coverage(monkeypatch):
    """HF2Q_GDN_SCAN: 0 keeps the MLX loop (no launch), 1 takes the kernel, unset takes it on
    CUDA only; anything else is a one-line caller error. Shapes past the kernel's shared memory
    or mapping fall back to the loop."""
    for text, on in (("0", False), ("1", True), (" 1 ", True)):
        monkeypatch.setenv(gs.SCAN_ENV, text)
        assert gs.scan_on("cuda") is on and gs.scan_on("metal") is on
    monkeypatch.setenv(gs.SCAN_ENV, "")
    assert gs.scan_on("cuda") and not gs.scan_on("metal")
    monkeypatch.setenv(gs.SCAN_ENV, "yes")
    with pytest.raises(InvalidArgumentError, match="HF2Q_GDN_SCAN"):
        gs.scan_on("cuda")
    assert gs.covers(64, 128, 128) and gs.covers(16, 32, 48)
    assert not gs.covers(64, 128, 24)  # Dv not a multiple of the threadgroup's 16 rows
    assert not gs.covers(128, 128, 128)  # 128-token chunks: past THREADS / 4 rows
    assert not gs.covers(64, 256, 128)  # a 256-wide tile of 64 rows: past 48 KB
    emu = kernel_emulator.Emulated(gs._kernel)
    monkeypatch.setattr(gs, "_kernel", emu)
    monkeypatch.setattr(gs, "backend", lambda: "cuda")
    monkeypatch.setenv(gs.SCAN_ENV, "0")
    gs._plan.cache_clear()
    args = walk_inputs(1, 1, 2, 8, 32, 16, seed=3)
    y, s = gs.gated_delta_scan(*args)
    assert emu.launches == 0
    np.testing.assert_array_equal(np.array(y), np.array(gs.scan_reference(*args)[0]))


@requires_gpu
@pytest.mark.parametrize("shape", [(1, 32, 8, 64, 128, 128), (2, 3, 4, 16, 32, 48)],
                         ids=["35b-512", "small"])  # fmt: skip
def test_gpu_scan_matches_the_loop(shape, monkeypatch):
    """On a GPU: the kernel against float64 within 1e-5 of the largest value, as the MLX loop
    on the same device (Qwen3.5-35B-A3B's 32 heads over a 512-token prompt, and small heads)."""
    if backend() is None:
        pytest.skip("no GPU back end")
    monkeypatch.setenv(gs.SCAN_ENV, "1")
    args = walk_inputs(*shape, seed=7)
    y, s = gs.gated_delta_scan(*args)
    want_y, want_s = walk_oracle(args)
    check(y, want_y, 1e-5, "y")
    check(s, want_s, 1e-5, "state")
    ref_y, _ = gs.scan_reference(*args)
    check(ref_y, want_y, 1e-5, "loop y")
