"""Per-head RMSNorm + RoPE and residual + RMSNorm: references against numpy and mx.fast, the
kernels' CUDA renderings on the CPU emulator (kernel_emulator.py; ``emulate`` here is shared with
test_activations.py and test_sampling_kernels.py), and the kernels on a GPU."""

from __future__ import annotations

import kernel_emulator
import mlx.core as mx
import numpy as np
import pytest
from conftest import requires_gpu

from hf2q_mlx.custom_kernels import reference_only
from hf2q_mlx.custom_kernels import residual_rms_norm as rrn
from hf2q_mlx.custom_kernels import rms_norm_rope as nr
from hf2q_mlx.errors import InvalidArgumentError

# ---- CPU emulation --------------------------------------------------------------------------


Emulated = kernel_emulator.Emulated  # a Kernel stand-in running the CUDA rendering here


needs_gxx = pytest.mark.skipif(not kernel_emulator.available(), reason="g++ not found")


def emulate(monkeypatch, module, *names: str) -> dict[str, Emulated]:
    """Route ``module``'s dispatcher to the emulated kernels ``names`` (module attributes)."""
    out = {}
    for name in names:
        out[name] = Emulated(getattr(module, name))
        monkeypatch.setattr(module, name, out[name])
    monkeypatch.setattr(module, "backend", lambda: "cuda")
    return out


def assert_one_rounding(out: mx.array, want: mx.array, dtype, noise: float = 4e-6) -> None:
    """out and want are the same fp32 value rounded to ``dtype`` up to fp32 noise: at most one
    unit of the dtype's spacing apart (plus the noise, which may straddle a rounding boundary)."""
    a = np.array(out.astype(mx.float32), np.float64)
    b = np.array(want.astype(mx.float32), np.float64)
    eps = {mx.float32: 2.0**-23, mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7}[dtype]
    mag = np.maximum(np.maximum(np.abs(a), np.abs(b)), 2.0**-14)
    spacing = eps * np.exp2(np.floor(np.log2(mag)))
    bad = np.abs(a - b) > spacing + noise
    assert not bad.any(), (a[bad][:5], b[bad][:5])


# ---- references on the CPU ----------------------------------------------------------------------


def numpy_norm_rope(x, w, woff, inv_freq, pos, scale, eps, D):
    """float64 numpy: x (B, L, H, P) -> (B, H, L, D); pos (B or 1, L)."""
    x = np.asarray(x, np.float64)[..., :D]
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    if w is not None:
        y = y * (np.asarray(w, np.float64) + woff)
    if inv_freq is not None:
        half = len(inv_freq)
        th = (np.asarray(pos, np.float64) * np.float32(scale))[..., None] * np.asarray(
            inv_freq, np.float64
        )
        c, s = np.cos(th)[:, :, None], np.sin(th)[:, :, None]
        a, b = y[..., :half].copy(), y[..., half : 2 * half].copy()
        y[..., :half], y[..., half : 2 * half] = a * c - b * s, a * s + b * c
    return y.transpose(0, 2, 1, 3)


@pytest.mark.parametrize(
    "D,R,base,scale",
    [(128, 128, 1e4, 1.0), (256, 64, 1e7, 1.0), (64, 64, 1e6, 0.125), (512, 512, 1e6, 1.0)],
)
def test_reference_equals_mx_fast(D, R, base, scale):
    """The reference is mx.fast.rms_norm followed by mx.fast.rope (traditional=False) in fp32."""
    x = mx.random.normal((2, 5, 3, D), key=mx.random.key(D + R))
    w = mx.random.normal((D,), key=mx.random.key(1))
    inv = nr.rope_inv_freq(R, base)
    for offset in (0, 37, mx.array(1000), mx.array([5, 3000])):
        ref = nr.rms_norm_rope_reference(x, w, inv, eps=1e-6, offset=offset, scale=scale)
        normed = mx.fast.rms_norm(x, w, 1e-6).transpose(0, 2, 1, 3)
        want = mx.fast.rope(normed, R, traditional=False, base=base, scale=scale, offset=offset)
        # identical fp32 formulas; only the rms and the weight product may round apart
        np.testing.assert_allclose(np.array(ref), np.array(want), rtol=0, atol=2e-6)


def test_reference_against_numpy_positions_weights():
    rng = np.random.default_rng(0)
    B, L, H, P, D = 2, 4, 3, 96, 64  # wider heads: only the first D values are used
    x = rng.standard_normal((B, L, H, P)).astype(np.float32) * 3
    w = rng.standard_normal(D).astype(np.float32) * 0.3
    R, inv = nr.rope_config({"rope_type": "linear", "factor": 4.0, "rope_theta": 5e5,
                             "partial_rotary_factor": 0.5}, D)  # fmt: skip
    assert R == 32 and inv.shape == (16,)
    pos = rng.integers(0, 5000, (B, L)).astype(np.int32)
    got = nr.rms_norm_rope_reference(
        mx.array(x), mx.array(w), inv, eps=1e-5, positions=mx.array(pos), weight_offset=1.0, dims=D
    )
    want = numpy_norm_rope(x, w, 1.0, np.array(inv), pos, 1.0, 1e-5, D)
    # fp32 angles up to 5000 * 0.25 rad: cos / sin of an fp32-rounded angle
    np.testing.assert_allclose(np.array(got), want, rtol=0, atol=2e-4 * 5)
    # (L,) positions and per-batch offsets agree with the (B, L) form
    same = nr.rms_norm_rope_reference(mx.array(x), None, inv, eps=1e-5, offset=mx.array([7, 9]))
    pos2 = np.array([[7, 8, 9, 10], [9, 10, 11, 12]])
    np.testing.assert_allclose(
        np.array(same),
        numpy_norm_rope(x, None, 0, np.array(inv), pos2, 1.0, 1e-5, P),
        atol=1e-5,
    )


def test_rope_config_matches_transformers():
    torch = pytest.importorskip("torch")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    class Cfg:  # the fields the rope init functions read
        def __init__(self, params, head_dim):
            self.rope_parameters, self.head_dim = params, head_dim
            self.hidden_size, self.num_attention_heads = head_dim * 4, 4

        def standardize_rope_params(self):
            pass

    cases = [
        ({"rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": 0.25}, 512),
        ({"rope_type": "proportional", "rope_theta": 1e6, "factor": 8.0}, 256),
        ({"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}, 256),
        ({"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}, 256),
    ]
    for params, hd in cases:
        R, inv = nr.rope_config(params, hd)
        fn = ROPE_INIT_FUNCTIONS.get(params["rope_type"])
        if params["rope_type"] == "default":
            want = 1.0 / params["rope_theta"] ** (torch.arange(0, R, 2).float() / R)
        else:
            want = fn(Cfg(params, hd), "cpu")[0]
        assert R == 2 * want.shape[0]
        np.testing.assert_allclose(np.array(inv), want.numpy(), rtol=1e-6)


def test_residual_reference_against_numpy():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 7, 640)).astype(np.float32)
    r = rng.standard_normal((3, 7, 640)).astype(np.float32)
    w = rng.standard_normal(640).astype(np.float32)
    h, y = rrn.residual_rms_norm_reference(mx.array(x), mx.array(r), mx.array(w), 1e-6, 1.0)
    h64 = x.astype(np.float64) + r
    want = h64 / np.sqrt((h64 * h64).mean(-1, keepdims=True) + 1e-6) * (w + 1.0)
    np.testing.assert_array_equal(np.array(h), x + r)  # fp32 add: exact
    np.testing.assert_allclose(np.array(y), want, rtol=2e-5, atol=2e-6)


def test_dispatchers_fall_back_on_cpu():
    x = mx.random.normal((1, 2, 3, 64), key=mx.random.key(3))
    inv = nr.rope_inv_freq(64, 1e4)
    assert mx.array_equal(
        nr.rms_norm_rope(x, None, inv, eps=1e-6, offset=3),
        nr.rms_norm_rope_reference(x, None, inv, eps=1e-6, offset=3),
    )
    with pytest.raises(ValueError):
        nr.rms_norm_rope(x, mx.ones((32,)), inv, eps=1e-6)
    with pytest.raises(ValueError):
        nr.rms_norm_rope(x, None, inv, eps=1e-6, offset=mx.array([1, 2, 3]))
    with pytest.raises(ValueError):
        rrn.residual_rms_norm(x, x[..., :32], None, 1e-6)


def test_kernel_path_plans_once_and_still_checks_callers(monkeypatch):
    """On the kernel path the launch plan is built once per call shape (the launcher is asked
    once), and caller errors raise there as on the reference path."""
    asked = []

    class Stub:
        def launcher(self, input_dtypes, **launch):
            asked.append(launch["output_shapes"])
            shapes, dtypes = launch["output_shapes"], launch["output_dtypes"]
            return lambda inputs: [mx.zeros(s, d) for s, d in zip(shapes, dtypes)]

    monkeypatch.setattr(nr, "backend", lambda: "cuda")
    monkeypatch.setattr(nr, "_kernel", Stub())
    q, k = mx.zeros((1, 1, 4, 64)), mx.zeros((1, 1, 2, 64))
    inv = nr.rope_inv_freq(64, 1e4)
    for step in range(3):
        out = nr.qk_norm_rope(q, k, None, None, inv, eps=1e-6, offset=mx.array([step]))
        assert [o.shape for o in out] == [(1, 4, 1, 64), (1, 2, 1, 64)]
    assert len(asked) == 1
    with pytest.raises(ValueError):
        nr.qk_norm_rope(q, k, mx.ones((32,)), None, inv, eps=1e-6)
    with pytest.raises(ValueError):
        nr.qk_norm_rope(q, k[:, :, :, :32], None, None, inv, eps=1e-6)
    with pytest.raises(ValueError):
        nr.rms_norm_rope(q, None, inv, eps=1e-6, offset=mx.array([1, 2, 3]))
    monkeypatch.setattr(rrn, "backend", lambda: "cuda")
    with pytest.raises(ValueError):
        rrn.residual_rms_norm(q, k, None, 1e-6)


# ---- the kernel bodies, emulated on the CPU ----------------------------------------------------

EMU_CASES = [
    # (B, L, heads (q, k[, v]), P, D, R, pos kind, weights)
    (1, 1, (3, 1), 64, 64, 64, "int", "plain"),
    (2, 3, (2, 1, 1), 128, 128, 128, "batch", "gemma"),  # q, k, weightless v
    (1, 2, (3, 2), 96, 64, 32, "tokens", "plain"),  # partial rotary, wide heads, R/2 = 16
    (2, 1, (1,), 32, 32, 0, "int", "none"),  # norm only
]


def _case_inputs(B, L, heads, P, D, R, pos_kind, weights, seed, dtype=mx.float32):
    rng = np.random.default_rng(seed)
    xs = [mx.array(rng.standard_normal((B, L, h, P)).astype(np.float32) * 2).astype(dtype)
          for h in heads]  # fmt: skip
    ws = [None if weights == "none" else mx.array(rng.standard_normal(D).astype(np.float32))
          for _ in heads]  # fmt: skip
    if len(heads) == 3:
        ws[2] = None
    inv = nr.rope_inv_freq(R, 1e4) if R else None
    pos = {
        "int": dict(offset=int(rng.integers(0, 9000))),
        "batch": dict(offset=mx.array(rng.integers(0, 9000, (B,)).astype(np.int32))),
        "tokens": dict(positions=mx.array(rng.integers(0, 9000, (B, L)).astype(np.int32))),
    }[pos_kind]
    woff = 1.0 if weights == "gemma" else 0.0
    return xs, ws, inv, pos, woff


def _run_and_check(xs, ws, inv, pos, woff, D, dtype, transpose=True):
    kw = dict(eps=1e-6, weight_offset=woff, dims=D, transpose=transpose, **pos)
    if len(xs) == 1:
        outs = [nr.rms_norm_rope(xs[0], ws[0], inv, **kw)]
    else:
        outs = nr.qk_norm_rope(xs[0], xs[1], ws[0], ws[1], inv, v=xs[2] if len(xs) == 3 else None,
                               v_weight=ws[2] if len(xs) == 3 else None, **kw)  # fmt: skip
    for i, (out, x, w) in enumerate(zip(outs, xs, ws)):
        rope = inv if i < 2 else None
        with reference_only():
            want = nr.rms_norm_rope_reference(x, w, rope, **kw)
        assert out.shape == want.shape and out.dtype == x.dtype
        if dtype == mx.float32:
            # same fp32 formulas; the sum of squares and the range-reduced sin / cos round apart
            np.testing.assert_allclose(np.array(out), np.array(want), rtol=0, atol=3e-5)
        else:
            # one rounding of the same fp32 value: at most a unit apart, where fp32 noise
            # straddles a rounding boundary
            assert_one_rounding(out, want, dtype)


@needs_gxx
@pytest.mark.parametrize("case", EMU_CASES, ids=lambda c: f"H{c[2]}-D{c[4]}-R{c[5]}-{c[6]}")
def test_norm_rope_body_emulated(monkeypatch, case):
    emu = emulate(monkeypatch, nr, "_kernel")
    B, L, heads, P, D, R, pos_kind, weights = case
    xs, ws, inv, pos, woff = _case_inputs(*case, seed=sum(heads) + D)
    _run_and_check(xs, ws, inv, pos, woff, D, mx.float32, transpose=B != 2 or L != 1)
    assert emu["_kernel"].launches == 1


@needs_gxx
def test_norm_rope_body_emulated_fp16(monkeypatch):
    emulate(monkeypatch, nr, "_kernel")
    xs, ws, inv, pos, woff = _case_inputs(2, 2, (2, 1), 64, 64, 64, "batch", "plain", 5,
                                          mx.float16)  # fmt: skip
    _run_and_check(xs, ws, inv, pos, woff, 64, mx.float16)


# ---- q/k/v read in place from fused projection outputs (``Heads``) -----------------------------

PACKED_CASES = [
    # (B, L, heads per projection output (q, k, v in order), D, R, pos kind, transpose, v normed)
    (1, 1, ((4, 2, 2),), 64, 64, "int", False, True),  # Gemma 4 sliding decode: one qkv matmul
    (2, 3, ((2, 1), (1,)), 32, 32, "batch", True, True),  # q+k fused, v apart (mixed GGML types)
    (1, 2, ((3, 1, 1),), 128, 64, "tokens", False, True),  # prefill, partial rotary
    (2, 1, ((4, 1, 1),), 64, 64, "batch", True, False),  # Gemma 3 decode: v only laid out
]
PACKED_IDS = ["decode-qkv", "qk+v", "prefill-partial", "gemma3-v-copy"]


def _packed_inputs(case, dtype, seed):
    """Fresh random fused outputs (B, L, heads * D) as q, k, v ``Heads``, weights, rope args."""
    B, L, groups, D, R, pos_kind = case[:6]
    rng = np.random.default_rng(seed)
    heads = []
    for counts in groups:
        y = rng.standard_normal((B, L, sum(counts) * D)).astype(np.float32) * 2
        data = mx.array(y).astype(dtype)
        starts = np.cumsum((0, *counts))
        heads += [nr.Heads(data, int(a), int(b - a), D) for a, b in zip(starts, starts[1:])]
    ws = [mx.array(rng.standard_normal(D).astype(np.float32)) for _ in range(2)] + [None]
    pos = {
        "int": dict(offset=mx.array([int(rng.integers(0, 9000))], dtype=mx.int32)),
        "batch": dict(offset=mx.array(rng.integers(0, 9000, (B,)).astype(np.int32))),
        "tokens": dict(positions=mx.array(rng.integers(0, 9000, (B, L)).astype(np.int32))),
    }[pos_kind]
    return heads, ws, nr.rope_inv_freq(R, 1e4), pos


def _check_packed(case, dtype, seed):
    """The Heads form against the separate-input form (the same kernel arithmetic on the same
    values, only the addressing differs: bit-exact) and against the reference."""
    heads, ws, inv, pos = _packed_inputs(case, dtype, seed)
    transpose, v_norm = case[6:]
    kw = dict(eps=1e-6, weight_offset=1.0, transpose=transpose, **pos)
    v_kw = dict(v_weight=ws[2], v_norm=v_norm)
    packed = nr.qk_norm_rope(*heads[:2], *ws[:2], inv, v=heads[2], **v_kw, **kw)
    xs = nr.split_heads(heads)  # reshape + split: what the decoders passed before
    separate = nr.qk_norm_rope(*xs[:2], *ws[:2], inv, v=xs[2], **v_kw, **kw)
    for i, (got, want, x, w) in enumerate(zip(packed, separate, xs, ws)):
        assert got.shape == want.shape and got.dtype == dtype
        assert mx.array_equal(got, want).item(), i
        if i == 2 and not v_norm:  # a copy into the output layout: exact
            assert mx.array_equal(got, x.transpose(0, 2, 1, 3) if transpose else x).item()
            continue
        with reference_only():
            ref = nr.rms_norm_rope_reference(x, w, inv if i < 2 else None, **kw)
        if dtype == mx.float32:
            np.testing.assert_allclose(np.array(got), np.array(ref), rtol=0, atol=3e-5)
        else:
            assert_one_rounding(got, ref, dtype)


@needs_gxx
@pytest.mark.parametrize("case", PACKED_CASES, ids=PACKED_IDS)
def test_norm_rope_packed_emulated(monkeypatch, case):
    emu = emulate(monkeypatch, nr, "_kernel")
    _check_packed(case, mx.float32, seed=len(case[2]) + case[3])
    assert emu["_kernel"].launches == 2


@needs_gxx
def test_norm_rope_packed_emulated_bf16(monkeypatch):
    emulate(monkeypatch, nr, "_kernel")
    _check_packed(PACKED_CASES[0], mx.bfloat16, seed=11)


def test_packed_reference_path_and_launch_inputs(monkeypatch):
    """Without kernels, Heads give the separate form's result bit for bit; with kernels, the
    launch reads each fused output itself (no reshape or split of it in the graph)."""
    heads, ws, inv, pos = _packed_inputs(PACKED_CASES[1], mx.float32, seed=4)
    kw = dict(eps=1e-6, **pos)
    xs = nr.split_heads(heads)
    got = nr.qk_norm_rope(*heads[:2], *ws[:2], inv, v=heads[2], **kw)
    want = nr.qk_norm_rope(*xs[:2], *ws[:2], inv, v=xs[2], **kw)
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, want))
    seen = []

    class Stub:
        def launcher(self, input_dtypes, **launch):
            shapes, dtypes = launch["output_shapes"], launch["output_dtypes"]
            seen.append(shapes)
            return lambda inputs: (
                seen.append(inputs) or [mx.zeros(s, d) for s, d in zip(shapes, dtypes)]
            )

    monkeypatch.setattr(nr, "backend", lambda: "cuda")
    monkeypatch.setattr(nr, "_kernel", Stub())
    out = nr.qk_norm_rope(*heads[:2], *ws[:2], inv, v=heads[2], **kw)
    assert [o.shape for o in out] == [(2, 2, 3, 32), (2, 1, 3, 32), (2, 1, 3, 32)]
    inputs = seen[-1]
    assert inputs[0] is heads[0].data and inputs[1] is heads[0].data
    assert inputs[2] is heads[2].data


def test_split_heads_and_heads_errors():
    data = mx.random.normal((2, 3, 7 * 16), key=mx.random.key(2))
    y = data.reshape(2, 3, 7, 16)
    q, k, v = nr.Heads(data, 0, 4, 16), nr.Heads(data, 4, 2, 16), nr.Heads(data, 6, 1, 16)
    assert q.shape == (2, 3, 4, 16) and q.dtype == mx.float32
    other = mx.zeros((1,))
    out = nr.split_heads([v, other, q, k])  # any order; other values pass through
    assert out[1] is other
    for got, (a, b) in zip([out[2], out[3], out[0]], [(0, 4), (4, 6), (6, 7)]):
        assert mx.array_equal(got, y[:, :, a:b]).item()
    (alone,) = nr.split_heads([k])  # not a tiling of the output: a slice
    assert mx.array_equal(alone, y[:, :, 4:6]).item()
    # heads of two widths in one output (Qwen 3.5's [query | gate] heads beside k and v)
    qg, k2, v2 = nr.Heads(data, 0, 2, 32), nr.Heads(data, 4, 2, 16), nr.Heads(data, 6, 1, 16)
    got = nr.split_heads([qg, k2, v2])
    assert mx.array_equal(got[0], data[..., :64].reshape(2, 3, 2, 32)).item()
    assert (
        mx.array_equal(got[1], y[:, :, 4:6]).item() and mx.array_equal(got[2], y[:, :, 6:]).item()
    )
    odd = nr.Heads(data, 1, 1, 48)  # 48 does not divide 112: values 48..95
    assert mx.array_equal(nr.split_heads([odd])[0], data[..., 48:96].reshape(2, 3, 1, 48)).item()
    for bad in [(data, 6, 2, 16), (data, 0, 0, 16), (data, -1, 2, 16), (data, 4, 1, 24),
                (y, 0, 1, 16)]:  # fmt: skip
        with pytest.raises(InvalidArgumentError):
            nr.Heads(*bad)


@needs_gxx
@pytest.mark.parametrize("H,dtype", [(640, mx.float32), (96, mx.float16), (2816, mx.float32)])
def test_residual_body_emulated(monkeypatch, H, dtype):
    emu = emulate(monkeypatch, rrn, "_kernel")
    rng = np.random.default_rng(H)
    x = mx.array(rng.standard_normal((2, 3, H)).astype(np.float32)).astype(dtype)
    r = mx.array(rng.standard_normal((2, 3, H)).astype(np.float32)).astype(dtype)
    w = mx.array(rng.standard_normal(H).astype(np.float32))
    h, y = rrn.residual_rms_norm(x, r, w, 1e-6, weight_offset=1.0)
    hr, yr = rrn.residual_rms_norm_reference(x, r, w, 1e-6, weight_offset=1.0)
    assert emu["_kernel"].launches == 1
    assert mx.array_equal(h, hr)  # one rounding of an exact sum: bit-exact
    if dtype == mx.float32:
        np.testing.assert_allclose(np.array(y), np.array(yr), rtol=1e-5, atol=1e-6)
    else:
        assert_one_rounding(y, yr, dtype)


# ---- GPU (CUDA on the H200; Metal on Apple) ----------------------------------------------------

GPU_SHAPES = [
    # (B, L, heads, P, D, R)
    (1, 1, (8, 1), 256, 256, 256),  # Gemma 3 decode
    (2, 5, (8, 2, 2), 512, 512, 512),  # Gemma 4 global: q, k, v
    (1, 5, (3, 1), 512, 256, 64),  # Qwen 3.5 [q | gate] heads, partial rotary
    (2, 1, (3, 3), 64, 64, 64),
    (1, 5, (1,), 128, 128, 32),
    (2, 5, (3,), 128, 128, 0),
]


@requires_gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=str)
@pytest.mark.parametrize("pos_kind", ["int", "batch", "tokens"])
def test_norm_rope_gpu(shape, dtype, pos_kind):
    B, L, heads, P, D, R = shape
    weights = "gemma" if len(heads) == 3 else "plain"
    xs, ws, inv, pos, woff = _case_inputs(B, L, heads, P, D, R, pos_kind, weights,
                                          seed=D + B + L, dtype=dtype)  # fmt: skip
    _run_and_check(xs, ws, inv, pos, woff, D, dtype, transpose=pos_kind != "batch")


@requires_gpu
@pytest.mark.parametrize("case", PACKED_CASES, ids=PACKED_IDS)
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=str)
def test_norm_rope_packed_gpu(case, dtype):
    """q/k/v read in place from fused outputs: bit-exact with the separate inputs on the GPU."""
    _check_packed(case, dtype, seed=7)


@requires_gpu
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=str)
def test_norm_rope_gpu_error_bound(dtype):
    """Kernel error vs fp32 at most 2x the unfused mx.fast sequence's own error in that dtype."""
    xs, ws, inv, pos, _ = _case_inputs(2, 5, (8, 2), 256, 256, 256, "int", "plain", 9)
    exact = nr.rms_norm_rope_reference(xs[0], ws[0], inv, eps=1e-6, **pos)
    xl, wl = xs[0].astype(dtype), ws[0].astype(dtype)
    got = nr.rms_norm_rope(xl, wl, inv, eps=1e-6, **pos)
    unfused = mx.fast.rope(mx.fast.rms_norm(xl, wl, 1e-6).transpose(0, 2, 1, 3), 256,
                           traditional=False, base=1e4, scale=1.0, **pos)  # fmt: skip
    err = mx.abs(got.astype(mx.float32) - exact).max().item()
    err_ref = mx.abs(unfused.astype(mx.float32) - exact).max().item()
    assert err <= 2 * err_ref, (err, err_ref)


@requires_gpu
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=str)
@pytest.mark.parametrize("H,B,L", [(640, 1, 1), (2816, 2, 5), (1000, 1, 5), (5376, 2, 1)])
def test_residual_rms_norm_gpu(dtype, H, B, L):
    rng = np.random.default_rng(H + B)
    x = mx.array(rng.standard_normal((B, L, H)).astype(np.float32) * 4).astype(dtype)
    r = mx.array(rng.standard_normal((B, L, H)).astype(np.float32)).astype(dtype)
    w = mx.array(rng.standard_normal(H).astype(np.float32)).astype(dtype)
    for woff in (0.0, 1.0):
        h, y = rrn.residual_rms_norm(x, r, w, 1e-6, weight_offset=woff)
        hr, yr = rrn.residual_rms_norm_reference(x, r, w, 1e-6, weight_offset=woff)
        assert mx.array_equal(h, hr)
        if dtype == mx.float32:
            np.testing.assert_allclose(np.array(y), np.array(yr), rtol=1e-5, atol=1e-6)
        else:
            assert_one_rounding(y, yr, dtype)
