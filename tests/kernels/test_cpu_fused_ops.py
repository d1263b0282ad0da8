"""The CPU extension's one-op RMS norm and RoPE (custom_kernels/cpu_ext/fused_ops.cpp) against a
float64 numpy oracle and MLX's fallbacks of mx.fast.rms_norm / mx.fast.rope, its SiLU gate,
softmax and attention against MLX's own CPU values bit for bit, and the models' ops taking them
on the CPU (``HF2Q_CPU_FUSED``, on by default).

Tolerance: 1e-6 of the largest |output| (fp32 math: the norm sums squares in double, so its
error is the output's rounding, ~1e-7; RoPE against an oracle that forms each angle in fp32 as
the kernel does, position * scale * inv_freq, then cos / sin in float64). Against MLX's RoPE
the angles themselves may round differently: up to an ulp of the largest angle, so 4 x
max|angle| x 2^-24 more (positions to 3,000 here). A wrong pair, position, stride or row is off
by O(1). Fresh random inputs each run.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from hf2q_mlx.custom_kernels import cpu_ext
from hf2q_mlx.models import ops

RTOL = 1e-6


@pytest.fixture(scope="module")
def ext():
    module = cpu_ext.load()
    if module is None:
        pytest.skip("the CPU extension cannot be built or is disabled (stderr says why)")
    return module


def _check(got: mx.array, want: np.ndarray, what: str, rtol: float = RTOL) -> None:
    g = np.array(got, dtype=np.float64)
    assert g.shape == want.shape, what
    err = np.abs(g - want).max() / np.abs(want).max()
    assert err <= rtol, f"{what}: {err:.3g}"


def _norm_oracle(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    x = x.astype(np.float64)
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    return y if w is None else y * w


def _rope_oracle(x: np.ndarray, positions: np.ndarray, inv: np.ndarray, dims: int, scale):
    """x (B, H, L, D), positions (B, L) -> rotated, float64."""
    x = x.astype(np.float64)
    half = dims // 2
    p = positions.astype(np.float32) * np.float32(scale)  # fp32 angles, as the kernel forms them
    th = (p[:, None, :, None] * inv.astype(np.float32)).astype(np.float64)
    c, s = np.cos(th), np.sin(th)  # (B, 1, L, half)
    x1, x2 = x[..., :half], x[..., half:dims]
    return np.concatenate([x1 * c - x2 * s, x1 * s + x2 * c, x[..., dims:]], axis=-1)


@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm_against_float64(ext, weighted):
    """(2, 5, 3, 96) rows, contiguous and as a transposed view, with and without a weight."""
    x = mx.random.normal((2, 5, 3, 96)) * 3 + 0.5
    w = mx.random.normal((96,)) if weighted else None
    wn = None if w is None else np.array(w)
    for view in (x, x.transpose(0, 2, 1, 3)):
        got = ext.rms_norm_cpu(view, w, 1e-5)
        _check(got, _norm_oracle(np.array(view), wn, 1e-5), f"view {view.shape}")
        assert got.shape == view.shape and got.dtype == mx.float32


@pytest.mark.parametrize("form", ["one", "per-row", "per-token", "per-row-token"])
def test_rope_against_float64_and_mlx(ext, form):
    """x (3, 4, 6, 80) as a transposed view of (B, L, H, D), the first 64 channels rotated
    (partial), scale 0.5, positions as a first position for every row, one per row, one per
    token, or one per row and token; against float64 and mx.fast.rope (its row-per-token form
    for the per-token positions)."""
    B, H, L, D, dims = 3, 4, 6, 80, 64
    x = mx.random.normal((B, L, H, D)).transpose(0, 2, 1, 3)
    inv = ops.rope_inv_freq(dims, 5000.0)
    first = np.random.default_rng().integers(0, 3000, B).astype(np.int32)
    pos = {
        "one": mx.array(first[:1]),
        "per-row": mx.array(first),
        "per-token": mx.array((first[:1, None] + np.arange(L)[None] * 7).astype(np.int32)),
        "per-row-token": mx.array((first[:, None] + np.arange(L)[None] * 3).astype(np.int32)),
    }[form]
    p2 = np.array(pos)
    p2 = np.broadcast_to(p2[:, None] + np.arange(L)[None], (B, L)) if p2.ndim == 1 else p2
    p2 = np.broadcast_to(p2, (B, L))
    got = ext.rope_cpu(x, pos, inv, dims, 0.5)
    _check(got, _rope_oracle(np.array(x), p2, np.array(inv), dims, 0.5), form)
    rows = x.transpose(0, 2, 1, 3).reshape(B * L, H, 1, D)
    offs = mx.array(np.ascontiguousarray(p2).reshape(-1))
    mlx = mx.fast.rope(rows, dims, traditional=False, base=5000.0, scale=0.5, offset=offs)
    mlx = mlx.reshape(B, L, H, D).transpose(0, 2, 1, 3)
    angle = float(np.abs(p2).max()) * 0.5 * float(np.array(inv).max())
    _check(got, np.array(mlx, dtype=np.float64), f"{form} against mx.fast.rope",
           RTOL + 4 * angle * 2.0**-24)  # fmt: skip


def test_models_ops_take_the_extension_on_the_cpu(ext, monkeypatch):
    """``ops.rms_norm``, ``RoPE`` and ``qk_norm_rope`` (q wider than D, v normed without a
    weight) run as RMSNormCPU / RopeCPU nodes on the CPU and give HF2Q_CPU_FUSED=0's values
    (MLX's fallbacks); a bf16 x keeps MLX's ops."""
    import tempfile

    def prims(*arrays) -> str:
        with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
            mx.export_to_dot(f.name, *arrays)
            return f.read()

    B, L, H, D = 2, 5, 3, 32
    q = mx.random.normal((B, L, H, 2 * D))  # Qwen 3.5's [query | gate] heads
    k = mx.random.normal((B, L, H, D))
    v = mx.random.normal((B, L, H, D))
    pos = mx.array([11], dtype=mx.int32)
    rope, qn, kn = ops.RoPE(16, 10_000.0), ops.RMSNorm(D), ops.RMSNorm(D)
    qn.weight, kn.weight = mx.random.normal((D,)), mx.random.normal((D,))
    outs = {}
    for v_ in ("1", "0"):
        monkeypatch.setenv("HF2Q_CPU_FUSED", v_)
        outs[v_] = [ops.rms_norm(k, kn.weight, 1e-6), rope(k.transpose(0, 2, 1, 3), pos),
                    *ops.qk_norm_rope(q, k, qn, kn, rope, pos, v=v)]  # fmt: skip
    dot = prims(*outs["1"])
    assert "RMSNormCPU" in dot and "RopeCPU" in dot and "Compiled" not in dot
    assert "RMSNormCPU" not in prims(*outs["0"])
    for i, (a, b) in enumerate(zip(outs["1"], outs["0"])):
        _check(a, np.array(b, dtype=np.float64), f"output {i}")
    monkeypatch.setenv("HF2Q_CPU_FUSED", "1")
    bf = ops.rms_norm(k.astype(mx.bfloat16), kn.weight.astype(mx.bfloat16), 1e-6)
    assert "RMSNormCPU" not in prims(bf)


# ---- the SiLU gate, the softmax and the attention around it (session 40): MLX's exact values,
# its exp vectorized. Checked bit for bit: they repeat MLX 0.32.4's CPU exp, sigmoid and
# softmax op for op (an exp that differs by one ulp anywhere fails these).

EDGES = [
    0.0,
    -0.0,
    1e-30,
    -1e-30,
    1e-8,
    0.5,
    -0.5,
    20.0,
    -20.0,
    87.9,
    88.0,
    88.1,
    -87.9,
    -88.0,
    -88.1,
    100.0,
    -100.0,
    3.4e38,
    -3.4e38,
    float("inf"),
    float("-inf"),
    float("nan"),
]


def _bits(a: mx.array) -> np.ndarray:
    return np.array(a).view(np.uint32)


def _dot(*arrays) -> str:
    import tempfile

    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *arrays)
        return f.read()


def test_silu_glu_bits_equal_mlx(ext, monkeypatch):
    """silu(gate) * up: the extension's op against ops.gated_activation's compiled MLX graph, bit
    for bit, over random values at several scales and the exp's edges (its +-88 cut-offs, inf,
    NaN, extremes), contiguous and as the strided halves of a fused [gate | up] projection;
    ``ops.gated_activation`` takes it on the CPU (one SiluGluCPU node), HF2Q_CPU_FUSED=0 not."""
    g = mx.concatenate([mx.random.normal((3, 1000)).reshape(-1) * s for s in (0.1, 4.0, 40.0)])
    g = mx.concatenate([g, mx.array(EDGES)])
    u = mx.concatenate([mx.random.normal((g.size - len(EDGES),)), mx.ones((len(EDGES),))])
    want = ops._GATED["silu"](g, u)
    np.testing.assert_array_equal(_bits(ext.silu_glu_cpu(g, u)), _bits(want))
    gu = mx.random.normal((2, 7, 2 * 96)) * 6  # fused rows: the halves are strided views
    gate, up = mx.split(gu, 2, axis=-1)
    np.testing.assert_array_equal(_bits(ext.silu_glu_cpu(gate, up)),
                                  _bits(ops._GATED["silu"](gate, up)))  # fmt: skip
    outs = {}
    for v in ("1", "0"):
        monkeypatch.setenv("HF2Q_CPU_FUSED", v)
        outs[v] = ops.gated_activation(gu, None, "silu")
    assert "SiluGluCPU" in _dot(outs["1"]) and "SiluGluCPU" not in _dot(outs["0"])
    np.testing.assert_array_equal(_bits(outs["1"]), _bits(outs["0"]))
    with pytest.raises(ValueError, match="one shape"):
        ext.silu_glu_cpu(gate, up[..., :5])


def test_softmax_bits_equal_mlx(ext):
    """Softmax over the last axis against mx.softmax (precise, float32) bit for bit: rows of
    several lengths and scales, rows holding -inf entries (a masked score), a NaN row, and a
    transposed (strided) input."""
    x = mx.random.normal((4, 3, 257)) * 12
    x = mx.where(mx.random.uniform(shape=x.shape) < 0.2, -float("inf"), x)
    for a in (x, x * 0.01, mx.random.normal((5, 1)), mx.array([EDGES[:-3]]),
              mx.array([[1.0, float("nan"), 2.0]]), x.transpose(0, 2, 1)):  # fmt: skip
        np.testing.assert_array_equal(_bits(ext.softmax_cpu(a)),
                                      _bits(mx.softmax(a, axis=-1, precise=True)))  # fmt: skip


@pytest.mark.parametrize(
    "B,Hq,Hkv,L,K,D",
    [(1, 9, 3, 64, 64, 64), (2, 4, 4, 7, 19, 32), (1, 8, 1, 1, 40, 256), (3, 6, 2, 5, 5, 48)],
)
@pytest.mark.parametrize("mask", ["none", "causal", "bool", "bool-per-row", "additive"])
def test_sdpa_bits_equal_mlx(ext, monkeypatch, B, Hq, Hkv, L, K, D, mask):
    """models/sdpa.sdpa on the CPU against mx.fast.scaled_dot_product_attention bit for bit,
    grouped (Hq a multiple of Hkv) and not, one query and many, every mask kind the models pass;
    its graph holds the SoftmaxCPU node, and HF2Q_CPU_FUSED=0 hands the call to MLX."""
    from hf2q_mlx.models.sdpa import sdpa

    if mask == "causal" and L > K:
        pytest.skip("causal needs L <= K")
    q = mx.random.normal((B, Hq, L, D)) * 2
    k, v = mx.random.normal((B, Hkv, K, D)) * 2, mx.random.normal((B, Hkv, K, D))
    m = {"none": None, "causal": "causal",
         "bool": mx.random.uniform(shape=(L, K)) > 0.3,
         "bool-per-row": mx.random.uniform(shape=(B, 1, L, K)) > 0.3,
         "additive": mx.random.normal((L, K))}[mask]  # fmt: skip
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask=m)
    got = sdpa(q, k, v, D**-0.5, m)
    assert "SoftmaxCPU" in _dot(got)
    np.testing.assert_array_equal(_bits(got), _bits(want))
    monkeypatch.setenv("HF2Q_CPU_FUSED", "0")
    assert "SoftmaxCPU" not in _dot(sdpa(q, k, v, D**-0.5, m))


def test_logsumexp_bits_equal_mlx(ext, monkeypatch):
    """logsumexp over the last axis against mx.logsumexp (keepdims) bit for bit: a Gemma-sized
    vocabulary row (262,144, the chunked exps' many chunks and a short last one), rows of several
    lengths and scales, rows holding -inf / +inf / NaN and the exp's edges, an all -inf row, a
    transposed (strided) input; the samplers' ``log_softmax`` and ``logsumexp`` take it on the
    CPU (one LogSumExpCPU node) with MLX's values, HF2Q_CPU_FUSED=0 not."""
    from hf2q_mlx.custom_kernels import sampling as S

    x = mx.random.normal((4, 3, 257)) * 12
    x = mx.where(mx.random.uniform(shape=x.shape) < 0.2, -float("inf"), x)
    cases = (mx.random.normal((1, 262_144)) * 9, x, x * 0.01, mx.random.normal((5, 1)),
             mx.array([EDGES]), mx.array([[1.0, float("inf"), 2.0]]),
             mx.full((2, 9), -float("inf")), x.transpose(0, 2, 1))  # fmt: skip
    for a in cases:
        got = ext.logsumexp_cpu(a)
        assert got.shape == (*a.shape[:-1], 1)
        np.testing.assert_array_equal(_bits(got), _bits(mx.logsumexp(a, axis=-1, keepdims=True)))
    logits = cases[0]
    outs = {}
    for v in ("1", "0"):
        monkeypatch.setenv("HF2Q_CPU_FUSED", v)
        outs[v] = (S.log_softmax(logits), S.logsumexp(logits))
    assert "LogSumExpCPU" in _dot(*outs["1"]) and "LogSumExpCPU" not in _dot(*outs["0"])
    for a, b in zip(outs["1"], outs["0"]):
        np.testing.assert_array_equal(_bits(a), _bits(b))
    with pytest.raises(ValueError, match="float32"):
        ext.logsumexp_cpu(logits.astype(mx.float16))
    with pytest.raises(ValueError, match="non-empty"):
        ext.logsumexp_cpu(mx.zeros((2, 0)))


def test_residual_norm_with_a_branch_norm_takes_the_extension(ext, monkeypatch):
    """``ops.residual_norm`` with a branch output norm (Gemma's post-attention / post-feedforward
    joins) on the CPU: two RMSNormCPU nodes and an add, no MLX fallback (Square / Sum) left;
    h is ``x + norm(y)`` and n ``norm(h)`` against the float64 oracle, and HF2Q_CPU_FUSED=0's
    MLX graph within the same tolerance (the extension sums squares in double, MLX in float)."""
    D = 96
    x, y = mx.random.normal((2, 3, D)), mx.random.normal((2, 3, D)) * 5
    norm, post = ops.RMSNorm(D, 1e-6), ops.RMSNorm(D, 1e-6)
    norm.weight, post.weight = mx.random.normal((D,)), mx.random.normal((D,))
    outs = {}
    for v in ("1", "0"):
        monkeypatch.setenv("HF2Q_CPU_FUSED", v)
        outs[v] = ops.residual_norm(x, y, norm, post_norm=post)
    dot = _dot(*outs["1"])
    assert dot.count("RMSNormCPU") == 2 and "Square" not in dot and "Sum" not in dot
    assert "RMSNormCPU" not in _dot(*outs["0"])
    h = np.array(x, np.float64) + _norm_oracle(np.array(y), np.array(post.weight), 1e-6)
    _check(outs["1"][0], h, "h")
    _check(outs["1"][1], _norm_oracle(np.array(outs["1"][0]), np.array(norm.weight), 1e-6), "n")
    for i, (a, b) in enumerate(zip(outs["1"], outs["0"])):
        _check(a, np.array(b, dtype=np.float64), f"output {i} against MLX's graph")
