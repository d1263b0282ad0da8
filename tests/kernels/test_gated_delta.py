"""Gated delta-net core: references against a float64 oracle, the chunked and mx.fast prefill
forms, the fused step kernel on the GPU, and the kernel body itself run on the CPU."""

from __future__ import annotations

import kernel_emulator
import mlx.core as mx
import numpy as np
import pytest
from conftest import requires_gpu

from hf2q_mlx.custom_kernels import gated_delta as gd
from hf2q_mlx.custom_kernels import reference_only
from hf2q_mlx.errors import InvalidArgumentError

# (B, T, Hk, Hv, Dk, Dv): Hv = Hk, Hv = 3 Hk, odd Dv, several batches
SHAPES = [
    (1, 1, 1, 1, 32, 8),
    (2, 5, 2, 6, 32, 12),
    (1, 9, 2, 4, 64, 7),
    (3, 3, 1, 2, 32, 16),
]
KC = 4  # conv taps


def make_inputs(B, T, hk, hv, dk, dv, seed, dtype=mx.float32):
    """Fresh random inputs: every parameter random, conv state and recurrent state non-zero."""
    C = 2 * hk * dk + hv * dv
    keys = mx.random.split(mx.random.key(seed), 9)
    return dict(
        qkv=mx.random.normal((B, T, C), key=keys[0]).astype(dtype),
        conv_state=mx.random.normal((B, KC - 1, C), key=keys[1]).astype(dtype),
        conv_weight=(0.5 * mx.random.normal((C, KC), key=keys[2])).astype(dtype),
        a=mx.random.normal((B, T, hv), key=keys[3]).astype(dtype),
        b=mx.random.normal((B, T, hv), key=keys[4]).astype(dtype),
        A_log=mx.random.uniform(-2.0, 1.5, (hv,), key=keys[5]),
        dt_bias=mx.random.normal((hv,), key=keys[6]),
        state=0.3 * mx.random.normal((B, hv, dv, dk), key=keys[7]),
        num_k_heads=hk,
        head_k_dim=dk,
    )


def oracle(inp: dict, tiled: bool):
    """float64 numpy, token by token and head by head: the definition in the module docstring."""
    f = {k: np.array(v, dtype=np.float64) if isinstance(v, mx.array) else v for k, v in inp.items()}
    qkv, w, st = f["qkv"], f["conv_weight"], f["state"].copy()
    B, T, C = qkv.shape
    hk, dk = f["num_k_heads"], f["head_k_dim"]
    hv = f["a"].shape[-1]
    dv = (C - 2 * hk * dk) // hv
    x = np.concatenate([f["conv_state"], qkv], axis=1)
    conv = np.stack([(x[:, t : t + KC] * w.T[None]).sum(1) for t in range(T)], axis=1)
    conv = conv / (1 + np.exp(-conv))
    y = np.zeros((B, T, hv, dv))
    for bi in range(B):
        for t in range(T):
            row = conv[bi, t]
            for h in range(hv):
                g = h % hk if tiled else h // (hv // hk)
                q = row[g * dk : (g + 1) * dk]
                k = row[hk * dk + g * dk : hk * dk + (g + 1) * dk]
                v = row[2 * hk * dk + h * dv : 2 * hk * dk + (h + 1) * dv]
                q = q / np.sqrt((q * q).sum() + 1e-6) / np.sqrt(dk)
                k = k / np.sqrt((k * k).sum() + 1e-6)
                sp = np.log1p(np.exp(f["a"][bi, t, h] + f["dt_bias"][h]))
                decay = np.exp(-np.exp(f["A_log"][h]) * sp)
                beta = 1 / (1 + np.exp(-f["b"][bi, t, h]))
                s = st[bi, h] * decay
                s = s + np.outer(beta * (v - s @ k), k)
                st[bi, h] = s
                y[bi, t, h] = s @ q
    return y, x[:, T:], st


def check(got, want, rtol, what):
    got = np.array(got.astype(mx.float32))
    assert got.shape == want.shape, what
    err = np.abs(got - want).max()
    assert err <= rtol * np.abs(want).max(), f"{what}: max err {err:.3g}"


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tiled", [False, True], ids=["grouped", "tiled"])
@pytest.mark.parametrize("mode", ["reference", "chunked", "fast"])
def test_reference_paths_match_oracle(shape, tiled, mode, monkeypatch):
    if mode == "fast" and not hasattr(mx.fast, "gated_delta_update"):
        pytest.skip("this MLX has no mx.fast.gated_delta_update")
    monkeypatch.setenv("HF2Q_GDN_PREFILL", mode)
    inp = make_inputs(*shape, seed=sum(shape))
    want = oracle(inp, tiled)
    with reference_only():
        if shape[1] == 1:  # decode goes to the reference; run the prefill form directly
            got = gd.gated_delta_update_reference(
                **inp, tiled=tiled, recurrence=gd._RECURRENCES[mode]
            )
        else:
            got = gd.gated_delta_update(**inp, tiled=tiled)
    # fp32 against float64 over a few dozen dependent steps: ~1e-6; 1e-5 relative leaves room
    for g, w, what in zip(got, want, ("y", "conv_state", "state")):
        check(g, w, 1e-5, f"{mode} {what}")
    # the conv state is data movement: exact
    np.testing.assert_array_equal(np.array(got[1]), np.array(want[1], dtype=np.float32))


@pytest.mark.parametrize("T,chunk", [(37, 16), (64, 16), (5, 8), (130, 64)])
def test_chunked_matches_sequential(T, chunk):
    """Lengths not divisible by the chunk (padding) and several chunks carrying the state."""
    inp = make_inputs(2, T, 2, 4, 32, 16, seed=T)
    x, _ = gd.causal_conv_reference(inp["qkv"], inp["conv_state"], inp["conv_weight"])
    q, k, v = gd.split_qkv(x, 2, 32, 4)
    args = (q, k, v, inp["a"], inp["b"], inp["A_log"], inp["dt_bias"], inp["state"])
    y_ref, s_ref = gd.gated_delta_reference(*args)
    y, s = gd.gated_delta_chunked(*args, chunk_size=chunk)
    # fp32, two summation orders of the same recurrence: ~1e-6 relative; allow 2e-5
    check(y, np.array(y_ref), 2e-5, "y")
    check(s, np.array(s_ref), 2e-5, "state")


@pytest.mark.parametrize("C", [2, 8, 64])
def test_unit_lower_inverse_without_a_scatter(C):
    """(I + a)^-1 by doubling against numpy's inverse (fp32, strictly lower a of random
    entries: ~1e-6 relative; allow 1e-5), and no Scatter in its graph: MLX's CUDA back end
    JIT-compiles a scatter at first use (mx.eye is one; 4.6-5.2 s of a fresh machine's first
    Qwen 3.5 prefill, session 39)."""
    import tempfile

    a = mx.tril(0.3 * mx.random.normal((3, C, C), key=mx.random.key(C)), k=-1)
    inv = gd._unit_lower_inverse(a)
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, inv)
        assert "Scatter" not in f.read()
    want = np.linalg.inv(np.eye(C) + np.array(a, dtype=np.float64))
    check(inv, want, 1e-5, "inverse")


@pytest.mark.parametrize("cuda", [False, True], ids=["no-cuda", "cuda"])
@pytest.mark.parametrize("value", ["", "auto", "chunked", "reference", " Reference "])
def test_prefill_switch_picks_the_recurrence(value, cuda, monkeypatch):
    """HF2Q_GDN_PREFILL (docs/kernels.md): unset or auto = the chunked form on CUDA, elsewhere
    MLX's fast op where it exists, else the chunked form; a named form is taken as asked,
    whatever its case and spaces."""
    monkeypatch.setenv("HF2Q_GDN_PREFILL", value)
    monkeypatch.setattr(gd, "on_cuda_device", lambda: cuda)
    taken = []
    for name in gd._RECURRENCES:
        real = gd._RECURRENCES[name]
        fake = lambda *a, _n=name, _r=real: taken.append(_n) or _r(*a)  # noqa: E731
        monkeypatch.setitem(gd._RECURRENCES, name, fake)
    with reference_only():
        gd.gated_delta_update(**make_inputs(1, 3, 2, 4, 32, 8, seed=1))
    auto = "fast" if hasattr(mx.fast, "gated_delta_update") and not cuda else "chunked"
    assert gd.auto_prefill_mode() == auto
    assert taken == [value.strip().lower() if value.strip() not in ("", "auto") else auto]


@requires_gpu
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["fp32", "bf16"])
def test_gpu_chunked_prefill_matches_oracle(dtype, monkeypatch):
    """The chunked form (the CUDA default prefill) on the GPU, a prompt of several chunks at
    Qwen 3.5's head dims: fp32 within 1e-5 of the float64 oracle as on the CPU; bf16 inputs
    within twice MLX's fast op's own error on the same inputs (plus 1e-3 of the largest)."""
    inp = make_inputs(1, 300, 2, 4, 128, 128, seed=31, dtype=dtype)
    want = oracle({k: v.astype(mx.float32) if isinstance(v, mx.array) else v
                   for k, v in inp.items()}, False)  # fmt: skip

    def run(mode):
        monkeypatch.setenv("HF2Q_GDN_PREFILL", mode)
        with mx.stream(mx.gpu):
            out = gd.gated_delta_update(**inp)
            mx.eval(out)
        return out

    def err(got, w):
        return np.abs(np.array(got.astype(mx.float32)) - w).max() / np.abs(w).max()

    got = run("chunked")
    if dtype == mx.float32:
        for g, w, what in zip(got, want, ("y", "conv_state", "state")):
            check(g, w, 1e-5, f"chunked {what}")
        return
    if not hasattr(mx.fast, "gated_delta_update"):
        pytest.skip("this MLX has no mx.fast.gated_delta_update")
    fast = run("fast")
    for i, what in ((0, "y"), (2, "state")):
        e, e_fast = err(got[i], want[i]), err(fast[i], want[i])
        assert e <= 2 * e_fast + 1e-3, f"bf16 chunked {what}: {e:.3g} against fast {e_fast:.3g}"


def test_prefill_switch_rejects_unknown_values(monkeypatch):
    monkeypatch.setenv("HF2Q_GDN_PREFILL", "fastest")
    with pytest.raises(InvalidArgumentError, match="HF2Q_GDN_PREFILL"):
        gd.gated_delta_update(**make_inputs(1, 3, 2, 4, 32, 8, seed=1))


def test_dispatcher_validates_shapes():
    inp = make_inputs(1, 2, 2, 4, 32, 8, seed=0)
    inp["num_k_heads"] = 3  # 2 * 3 * 32 + 4 * dv != C
    with pytest.raises(ValueError, match="does not split"):
        gd.gated_delta_update(**inp)


# ---- the fused step kernel on a GPU (the lead runs these on the H200) ----

GPU_SHAPES = [
    (1, 1, 16, 32, 128, 128),  # Qwen 3.5 9B / 35B-A3B delta-net layer, decode
    (2, 1, 2, 6, 32, 24),
    (1, 7, 2, 4, 64, 33),  # several steps in one launch, odd Dv (partial threadgroup)
    (3, 4, 4, 4, 96, 16),
]


def cpu_reference(inp: dict, tiled: bool):
    """The reference in MLX ops on the CPU (no TF32 matmuls or GPU conv algorithms)."""
    with mx.stream(mx.cpu), reference_only():
        out = gd.gated_delta_update_reference(**inp, tiled=tiled)
        mx.eval(out)
    return out


@requires_gpu
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("tiled", [False, True], ids=["grouped", "tiled"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16], ids=str)
def test_step_kernel_matches_reference(shape, tiled, dtype):
    inp = make_inputs(*shape, seed=7 * sum(shape), dtype=dtype)
    with mx.stream(mx.gpu):
        got = gd.gated_delta_step(**inp, tiled=tiled, init_value=float("nan"))  # poisoned
        mx.eval(got)
    ref = cpu_reference(inp, tiled)
    # conv state: exact (bf16 -> fp32 is exact; numpy cannot read bf16 buffers directly)
    np.testing.assert_array_equal(
        np.array(got[1].astype(mx.float32)), np.array(ref[1].astype(mx.float32))
    )
    if dtype == mx.float32:
        # fp32 both: same math, different reduction order (simd_sum vs sum): ~1e-6 relative
        check(got[0], np.array(ref[0]), 2e-5, "y")
        check(got[2], np.array(ref[2]), 2e-5, "state")
        return
    # half inputs: the kernel keeps the conv output in fp32 and the reference rounds it; the
    # kernel's error against the fp32 oracle must stay within 2x the reference's own error
    f32 = {k: v.astype(mx.float32) if isinstance(v, mx.array) else v for k, v in inp.items()}
    exact = cpu_reference(f32, tiled)
    for i, what in ((0, "y"), (2, "state")):
        e = np.array(exact[i])
        k_err = np.abs(np.array(got[i].astype(mx.float32)) - e).max()
        r_err = np.abs(np.array(ref[i].astype(mx.float32)) - e).max()
        assert k_err <= 2 * r_err + 1e-6 * np.abs(e).max(), f"{what}: {k_err} vs {r_err}"


@requires_gpu
@pytest.mark.parametrize("T", [1, 6])
def test_dispatcher_uses_kernel(T, monkeypatch):
    """Decode (and a 'step' prefill) through the dispatcher on the GPU == the CPU reference."""
    monkeypatch.setenv("HF2Q_GDN_PREFILL", "step")
    inp = make_inputs(1, T, 2, 4, 32, 16, seed=3)
    calls = []
    real = gd.gated_delta_step
    monkeypatch.setattr(gd, "gated_delta_step", lambda *a, **k: calls.append(1) or real(*a, **k))
    with mx.stream(mx.gpu):
        got = gd.gated_delta_update(**inp)
        mx.eval(got)
    assert calls, "the dispatcher did not take the kernel"
    ref = cpu_reference(inp, False)
    check(got[0], np.array(ref[0]), 2e-5, "y")
    check(got[2], np.array(ref[2]), 2e-5, "state")


# ---- the kernel's CUDA rendering executed on the CPU through the real dispatcher ----


@pytest.mark.skipif(not kernel_emulator.available(), reason="g++ is not installed")
@pytest.mark.parametrize("tiled", [False, True], ids=["grouped", "tiled"])
@pytest.mark.parametrize("T", [1, 3])
def test_step_kernel_body_emulated(tiled, T, monkeypatch):
    """``_STEP_BODY`` compiled as C++ and launched by the real dispatcher (decode, and a
    3-token 'step' prefill) against the float64 oracle."""
    emu = kernel_emulator.Emulated(gd._step_kernel)  # outputs start poisoned
    monkeypatch.setattr(gd, "_step_kernel", emu)
    monkeypatch.setattr(gd, "backend", lambda: "cuda")
    monkeypatch.setenv("HF2Q_GDN_PREFILL", "step")
    inp = make_inputs(2, T, 2, 6, 64, 7, seed=11 + T)  # Dv = 7: a partial threadgroup of rows
    y, conv, state = gd.gated_delta_update(**inp, tiled=tiled)
    assert emu.launches == 1
    want_y, want_conv, want_state = oracle(inp, tiled)
    # fp32 vs float64 over a few steps: ~1e-6 relative
    check(y, want_y, 1e-5, "y")
    check(state, want_state, 1e-5, "state")
    np.testing.assert_array_equal(np.array(conv), want_conv.astype(np.float32))


# ---- the prefill's causal conv + SiLU kernel ----------------------------------------------------


def conv_oracle(qkv, conv_state, weight):
    """float64 numpy: (silu(conv) (B, T, C), new conv state (B, K-1, C))."""
    q, s, w = (np.array(x.astype(mx.float32), np.float64) for x in (qkv, conv_state, weight))
    x = np.concatenate([s, q], axis=1)
    K, T = w.shape[-1], q.shape[1]
    conv = np.stack([(x[:, t : t + K] * w.T[None]).sum(1) for t in range(T)], axis=1)
    return conv / (1 + np.exp(-conv)), x[:, T:]


def conv_inputs(B, T, C, seed, dtype=mx.float32):
    keys = mx.random.split(mx.random.key(seed), 3)
    return (mx.random.normal((B, T, C), key=keys[0]).astype(dtype),
            mx.random.normal((B, KC - 1, C), key=keys[1]).astype(dtype),
            (0.5 * mx.random.normal((C, KC), key=keys[2])).astype(dtype))  # fmt: skip


def test_causal_conv_reference_matches_oracle():
    """The reference (MLX's conv1d + SiLU, the CPU path) against float64 numpy; the conv state
    is data movement: exact."""
    qkv, st, w = conv_inputs(2, 6, 40, seed=3)
    y, conv = gd.causal_conv_reference(qkv, st, w)
    want_y, want_conv = conv_oracle(qkv, st, w)
    check(y, want_y, 1e-5, "y")
    np.testing.assert_array_equal(np.array(conv), want_conv.astype(np.float32))


@pytest.mark.skipif(not kernel_emulator.available(), reason="g++ is not installed")
@pytest.mark.parametrize("T", [1, 2, 5])
def test_causal_conv_body_emulated(T, monkeypatch):
    """``_CONV_BODY`` compiled as C++ and launched by ``causal_conv`` (outputs poisoned first):
    fp32 within 1e-5 of float64 (4 products and a SiLU); the new conv state bit-exact, also for
    T < K - 1 (part of it still from the old state). C = 300: a partial threadgroup."""
    emu = kernel_emulator.Emulated(gd._conv_kernel)
    monkeypatch.setattr(gd, "_conv_kernel", emu)
    monkeypatch.setattr(gd, "backend", lambda: "cuda")
    qkv, st, w = conv_inputs(2, T, 300, seed=5 + T)
    y, conv = gd.causal_conv(qkv, st, w)
    assert emu.launches == 1
    want_y, want_conv = conv_oracle(qkv, st, w)
    check(y, want_y, 1e-5, "y")
    np.testing.assert_array_equal(np.array(conv), want_conv.astype(np.float32))


def test_causal_conv_without_a_kernel_is_the_reference():
    qkv, st, w = conv_inputs(1, 4, 64, seed=9)
    with reference_only():
        got = gd.causal_conv(qkv, st, w)
    for g, r in zip(got, gd.causal_conv_reference(qkv, st, w)):
        assert mx.array_equal(g, r)


@requires_gpu
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", [2, 300])
def test_gpu_causal_conv_matches_oracle(dtype, T):
    """The kernel on the GPU at Qwen3.5-35B-A3B's conv width (8,192), outputs poisoned with NaN:
    fp32 within 1e-5 of float64; bf16 within one rounding of the float64 value (the kernel sums
    in fp32 and rounds once) and within twice the reference's own bf16 error; the new conv
    state bit-exact."""
    qkv, st, w = conv_inputs(2, T, 8192, seed=T, dtype=dtype)
    with mx.stream(mx.gpu):
        y, conv = gd.causal_conv(qkv, st, w, init_value=float("nan"))
        ref_y, _ = gd.causal_conv_reference(qkv, st, w)
        mx.eval(y, conv, ref_y)
    want_y, want_conv = conv_oracle(qkv, st, w)
    np.testing.assert_array_equal(np.array(conv.astype(mx.float32)), want_conv.astype(np.float32))
    if dtype == mx.float32:
        check(y, want_y, 1e-5, "y")
        return
    from test_norm_rope import assert_one_rounding

    assert_one_rounding(y, mx.array(want_y.astype(np.float32)), dtype, noise=1e-5)
    err = np.abs(np.array(y.astype(mx.float32)) - want_y).max()
    err_ref = np.abs(np.array(ref_y.astype(mx.float32)) - want_y).max()
    assert err <= 2 * err_ref + 1e-6, (err, err_ref)
