"""expert_matmul's GGML kernel: the CUDA rendering on the CPU emulator for every type, the
dispatcher's routing, and GPU cases; always against fp32 reference math, with the weights of
every unselected expert poisoned (all bytes 0xFF: NaN scales) so that reading one shows."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import kernel_emulator
import mlx.core as mx
import numpy as np
import pytest
from conftest import requires_gpu
from gguf import GGMLQuantizationType as T

from hf2q_mlx.custom_kernels import expert_matmul as X
from hf2q_mlx.custom_kernels._render import Example, Kernel
from hf2q_mlx.custom_kernels.dequant import dequantize_reference, row_bytes
from hf2q_mlx.errors import WeightMismatchError
from hf2q_mlx.io.random_weights import random_ggml_blocks

TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
DTYPES = [mx.float32, mx.float16, mx.bfloat16]
# fp32: kernel and reference sum the same exact products in different orders; over K <= 2816
# terms that moves a row by ~sqrt(K) ulps (~3e-6 relative), under 1e-5 of its norm.
FP32_TOL = 1e-5


def _qk(t: int) -> int:
    return 256 if "_K" in T(t).name else 32


_W_CACHE: dict = {}


def _experts(t: int, e: int, n: int, k: int) -> tuple[np.ndarray, mx.array]:
    """Random valid blocks (E, N, row_bytes) as numpy, and their fp32 dequantization (E, N, K)
    by dequantize_reference on the CPU; fixed seed per shape, cached."""
    key = (t, e, n, k)
    if key not in _W_CACHE:
        with mx.stream(mx.cpu):
            raw = random_ggml_blocks(e * n, k, t, seed=e * 1009 + n * 31 + k + int(t), scale=0.5)
            wf = dequantize_reference(raw, t, k).reshape(e, n, k)
            mx.eval(raw, wf)
        _W_CACHE[key] = (np.array(raw).reshape(e, n, -1), wf)
    return _W_CACHE[key]


def _poisoned(raw: np.ndarray, ids: mx.array) -> mx.array:
    """The weights with every expert that ``ids`` does not select overwritten by 0xFF bytes:
    NaN fp16 (super-)scales in every block, so any read of them turns a result into NaN."""
    out = raw.copy()
    keep = np.zeros(raw.shape[0], dtype=bool)
    ids_np = np.array(ids).reshape(-1).astype(np.int64)
    keep[ids_np[ids_np < raw.shape[0]]] = True
    out[~keep] = 0xFF
    return mx.array(out)


def _ids(m: int, k: int, e: int, seed: int) -> mx.array:
    """Distinct experts per token (top-k routing), uint32 (m, k) as argpartition returns."""
    rng = np.random.default_rng(seed)
    return mx.array(np.stack([rng.permutation(e)[:k] for _ in range(m)]).astype(np.uint32))


def _x(m: int, k: int, kk: int, per_slot: bool, dtype: mx.Dtype, seed: int) -> mx.array:
    shape = (m, k, kk) if per_slot else (m, kk)
    # fp16: x / 32 (exact) keeps the largest outputs (Q6_K, K = 2816: ~1.1e5 at scale 1) inside
    # fp16's range; an overflowed output would make the relative check vacuous
    scale = 2.0**-5 if dtype == mx.float16 else 1.0
    return (scale * mx.random.normal(shape, key=mx.random.key(seed))).astype(dtype)


def _reference(x: mx.array, wf: mx.array, ids: mx.array) -> mx.array:
    """expert_matmul_reference's math (fp32 x, dequantize_reference weights, fp32 products) with
    the dequantization done once per weight: gather_mm over the clean dense experts, CPU."""
    with mx.stream(mx.cpu):
        xs = x.astype(mx.float32)
        if xs.ndim == ids.ndim:  # shared x: one row per token for each of its k slots
            xs = mx.broadcast_to(xs[..., None, :], (*ids.shape, xs.shape[-1]))
        out = mx.gather_mm(xs[..., None, :], wf.swapaxes(-1, -2), rhs_indices=ids)
        mx.eval(out)
    return out.squeeze(-2)  # (M, k, N)


def _check(out: mx.array, x: mx.array, wf: mx.array, ids: mx.array) -> None:
    """Per (token, slot) row: relative error (2-norm) against the fp32 reference at most
    FP32_TOL; for fp16/bf16 x at most twice the reference's own error when its fp32 result is
    rounded to that dtype (floored at FP32_TOL)."""
    assert out.dtype == x.dtype and out.shape == (*ids.shape, wf.shape[1])
    ref = np.array(_reference(x, wf, ids)).astype(np.float64)
    got = np.array(out.astype(mx.float32)).astype(np.float64)
    assert np.isfinite(ref).all()
    assert not np.isnan(got).any(), "unwritten (poisoned) outputs or a read of an unselected expert"
    norm = np.maximum(np.linalg.norm(ref, axis=-1), 1e-30)
    err = np.linalg.norm(got - ref, axis=-1) / norm
    tol = np.full(err.shape, FP32_TOL)
    if x.dtype != mx.float32:
        rounded = np.array(mx.array(ref.astype(np.float32)).astype(x.dtype).astype(mx.float32))
        # an output past the dtype's range would make err and tol inf and the check vacuous
        assert np.isfinite(rounded).all(), "test data overflows the dtype"
        tol = np.maximum(2 * np.linalg.norm(rounded - ref, axis=-1) / norm, FP32_TOL)
    worst = np.unravel_index(np.argmax(err / tol), err.shape)
    assert (err <= tol).all(), f"pair {worst}: relative error {err[worst]:.3g} > {tol[worst]:.3g}"


# ---------------------------------------------------------------------------------------------
# CPU: the poison is effective, caller errors


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_poison_makes_every_weight_nan(t):
    """0xFF blocks dequantize to NaN everywhere, so a kernel that reads one weight of an
    unselected expert (with any x) produces NaN."""
    k = _qk(t) * 2
    raw = np.full((3, row_bytes(t, k)), 0xFF, dtype=np.uint8)
    with mx.stream(mx.cpu):
        assert bool(mx.isnan(dequantize_reference(mx.array(raw), t, k)).all())


def test_caller_errors():
    raw, _ = _experts(T.Q4_0, 5, 7, 64)
    w, ids = mx.array(raw), _ids(1, 2, 5, 0)
    with pytest.raises(WeightMismatchError):  # x has the wrong number of features
        X.expert_matmul(mx.zeros((1, 32)), w, ids, T.Q4_0, 64)
    with pytest.raises(WeightMismatchError):  # row bytes do not match in_features
        X.expert_matmul(mx.zeros((1, 96)), w, ids, T.Q4_0, 96)
    with pytest.raises(WeightMismatchError):  # experts not stacked (E, N, row_bytes)
        X.expert_matmul(mx.zeros((1, 64)), w.reshape(35, -1), ids, T.Q4_0, 64)
    with pytest.raises(ValueError):  # x rank fits neither (..., K) nor (..., k, K)
        X.expert_matmul(mx.zeros((1, 2, 2, 64)), w, ids, T.Q4_0, 64)


# ---------------------------------------------------------------------------------------------
# CPU emulator: the CUDA rendering's logic for every type


_emu_call = kernel_emulator.kernel_call


# (type, dtype, M tokens, top-k, per-slot x, E, N, K, config or None)
_EMU_CASES = []
for _i, _t in enumerate(TYPES):
    _K = 768 if _qk(_t) == 256 else 352  # 3 super-blocks / 11 blocks: partial steps
    _EMU_CASES += [
        (_t, mx.float32, 1, 8, False, 16, 7, _K, None),
        (_t, mx.float32, 3, 2, True, 5, 9, _K, None),
        (_t, mx.float32, 3, 1, False, 6 + _i, 5, _K, None),
    ]
_EMU_CASES += [
    (T.Q4_0, mx.float16, 3, 8, True, 16, 9, 256, None),
    (T.Q5_1, mx.bfloat16, 1, 2, False, 7, 5, 512, None),
    (T.Q8_0, mx.float16, 3, 2, False, 5, 7, 224, None),
    (T.Q2_K, mx.bfloat16, 3, 8, False, 9, 3, 512, None),
    (T.Q3_K, mx.float16, 1, 8, True, 8, 5, 256, None),
    (T.Q4_K, mx.bfloat16, 3, 2, True, 5, 11, 1024, None),
    (T.Q5_K, mx.float16, 1, 1, False, 5, 3, 512, None),
    (T.Q6_K, mx.bfloat16, 3, 8, False, 12, 5, 768, None),
    # several runs per SIMD group, rows past N, more SIMD groups than some rows have steps
    (T.Q4_1, mx.float32, 3, 2, True, 5, 7, 1792, {"R": 3, "U": 1, "W": 2}),
    (T.Q4_K, mx.float16, 1, 8, False, 9, 5, 2304, {"R": 2, "U": 2, "W": 3}),
]


def _case_inputs(i: int):
    t, dt, m, k, per_slot, e, n, kk, _ = _EMU_CASES[i]
    raw, wf = _experts(t, e, n, kk)
    ids = _ids(m, k, e, seed=100 + i)
    return _x(m, k, kk, per_slot, dt, seed=i), _poisoned(raw, ids), ids, wf


def _emu_example(case) -> tuple[Kernel, Example]:
    """The instantiation expert_matmul_kernel asks for, so it can be built ahead."""
    t, dt, m, k, per_slot, e, n, kk, cfg = case
    cfg = cfg or X.Q.launch_config(t, 1, n, kk, mx.float32)
    ex = Example(
        {"xs": (dt, 64), "wq": (mx.uint8, 64), "ids": (mx.uint32, 8), "edims": (mx.int32, 5)},
        {"ys": dt},
        {"T": dt, "MT": 1, "R": cfg["R"], "U": cfg["U"]},
    )
    return X._KERNELS[t], ex


@pytest.fixture(scope="module")
def emulated():
    """Build the emulator binaries two at a time (g++ dominates), then run every case."""
    if not kernel_emulator.available():
        pytest.skip("g++ is not installed")
    # one build per distinct instantiation (two threads building the same one would race)
    todo = {(kern.name, repr(ex)): (kern, ex) for kern, ex in map(_emu_example, _EMU_CASES)}
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda ke: kernel_emulator.build(*ke), todo.values()))
    outs = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Kernel, "__call__", _emu_call)
        for i, case in enumerate(_EMU_CASES):
            x, w, ids, _ = _case_inputs(i)
            outs[i] = X.expert_matmul_kernel(x, w, ids, case[0], case[7], config=case[8])
    return outs


@pytest.mark.parametrize(
    "i",
    range(len(_EMU_CASES)),
    ids=[f"{c[0].name}-{c[1]}-M{c[2]}k{c[3]}{'s' if c[4] else ''}-E{c[5]}" for c in _EMU_CASES],
)
def test_kernel_logic_on_the_emulator(emulated, i):
    x, _, ids, wf = _case_inputs(i)
    _check(emulated[i], x, wf, ids)


@pytest.mark.skipif(not kernel_emulator.available(), reason="g++ is not installed")
@pytest.mark.parametrize("t", [T.Q5_0, T.Q6_K], ids=lambda t: t.name)
def test_bad_and_poisoned_ids_give_nan_rows_on_the_emulator(t):
    """Pair (0, 1) names a poisoned (unselected-looking) expert: its row must be NaN, which
    proves the poison reaches the output through the kernel. Pairs (1, 0) and (2, 0) have ids
    E and past E: NaN rows, nothing read (reading expert E would read past the buffer). The
    other pairs stay exact. (The emulator pre-fills outputs with NaN, so whether the NaN rows
    are written is checked on the GPU, test_gpu_dispatcher_and_bad_ids.)"""
    e, n, kk = 6, 5, 512
    raw, wf = _experts(t, e, n, kk)
    ids = mx.array([[2, 3], [e, 0], [e + 7, 2]], dtype=mx.uint32)
    w = _poisoned(raw, mx.array([2, 0]))  # expert 3 poisoned although pair (0, 1) selects it
    x = _x(3, 2, kk, False, mx.float32, seed=9)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Kernel, "__call__", _emu_call)
        out = np.array(X.expert_matmul_kernel(x, w, ids, t, kk))
    assert np.isnan(out[:, 0]).sum() == 2 * n and np.isnan(out[0, 1]).all()
    good = mx.array([[2], [0], [2]], dtype=mx.uint32)
    _check(mx.array(out[[0, 1, 2], [0, 1, 1]][:, None]), x, wf, good)


@pytest.mark.skipif(not kernel_emulator.available(), reason="g++ is not installed")
def test_dispatcher_routing_on_the_emulator(monkeypatch):
    """With a GPU back end (faked) the dispatcher takes the kernel for 1..16 tokens, keeps the
    batch dims and accepts int32 ids; past 16 tokens or with broadcast x, fp16/bf16 x take the
    dequantizing paths (from as many pairs as experts on, prefill: every expert through the
    GPU dequantizer in x.dtype, then gather_mm) and fp32 x the kernel 16 tokens at a time
    (gather_mm would run fp32 as TF32 on CUDA unless MLX_ENABLE_TF32=0; the suite sets 0, so
    the routing shows it here)."""
    t, e, n, kk = T.Q4_K, 10, 7, 512
    raw, wf = _experts(t, e, n, kk)
    w = mx.array(raw)
    calls = []

    def counting(self, *args, **kwargs):
        calls.append(self.name)
        return _emu_call(self, *args, **kwargs)

    def counting_launcher(self, input_dtypes, **launch):
        return lambda inputs: counting(self, inputs, **launch)

    monkeypatch.setattr(X, "backend", lambda: "cuda")
    monkeypatch.setattr(Kernel, "__call__", counting)
    monkeypatch.setattr(Kernel, "launcher", counting_launcher)
    monkeypatch.setattr(X, "_CALLS", {})

    ids = _ids(16, 3, e, seed=1).reshape(2, 8, 3).astype(mx.int32)  # 16 tokens: the limit
    x = _x(16, 3, kk, False, mx.float16, seed=2).reshape(2, 8, kk)
    y = X.expert_matmul(x, w, ids, t, kk)
    assert calls == ["ggml_expert_qmv_q4_k"] and y.shape == (2, 8, 3, n)
    _check(y.reshape(16, 3, n), x.reshape(16, kk), wf, ids.reshape(16, 3))
    # a repeat call takes the cached plan: same launch, same result, no new plan
    assert bool(mx.array_equal(X.expert_matmul(x, w, ids, t, kk), y)) and len(X._CALLS) == 1
    assert calls == ["ggml_expert_qmv_q4_k"] * 2

    calls.clear()
    # dequant32: the bf16 "dequant" / "grouped" fallbacks end in a bf16 gather_mm, which MLX's CPU
    # runs only over sorted pairs (unsorted: fp32 only); tests/kernels/test_expert_prefill.py
    # checks them on the GPU
    monkeypatch.setattr(X, "PREFILL", "dequant32")
    ids17 = _ids(17, 2, e, seed=3)
    x17 = _x(17, 2, kk, True, mx.bfloat16, seed=4)
    _check(X.expert_matmul(x17, w, ids17, t, kk), x17, wf, ids17)
    xb = _x(1, 2, kk, False, mx.float16, seed=5)  # one x row broadcast over 3 tokens
    ids3 = _ids(3, 2, e, seed=6)
    _check(X.expert_matmul(xb, w, ids3, t, kk), mx.broadcast_to(xb, (3, kk)), wf, ids3)
    assert calls == ["ggml_dequant_q4_k"]  # 34 pairs >= 10 experts; the 6 pairs: reference
    calls.clear()
    # fp32 x: 17 tokens in two launches (16 + 1), broadcast x in one; fp32 accuracy either way
    x17 = x17.astype(mx.float32)
    _check(X.expert_matmul(x17, w, ids17, t, kk), x17, wf, ids17)
    xb = xb.astype(mx.float32)
    _check(X.expert_matmul(xb, w, ids3, t, kk), mx.broadcast_to(xb, (3, kk)), wf, ids3)
    assert calls == ["ggml_expert_qmv_q4_k"] * 3


# ---------------------------------------------------------------------------------------------
# GPU: every type x dtype x (M, k) x shape, output poisoned with NaN, unselected experts too

# (E, N, K): odd tiny, Gemma 4 26B-A4B-like gate/up rows and (32-weight blocks only) down rows
SHAPES = [(5, 7, 256), (16, 704, 2816), (9, 2816, 704)]
ROUTES = [(1, 1, False), (1, 8, False), (3, 2, True), (16, 8, False), (16, 4, True)]


@requires_gpu
@pytest.mark.parametrize("e,n,kk", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("m,k,per_slot", ROUTES)
def test_gpu_kernel_matches_reference(m, k, per_slot, dtype, t, e, n, kk):
    if kk % _qk(t) or k > e:
        pytest.skip("K not a multiple of the block / more slots than experts")
    raw, wf = _experts(t, e, n, kk)
    ids = _ids(m, k, e, seed=m * 7 + k + n)
    x = _x(m, k, kk, per_slot, dtype, seed=m + n)
    out = X.expert_matmul_kernel(x, _poisoned(raw, ids), ids, t, kk, init_value=float("nan"))
    mx.eval(out)
    _check(out, x, wf, ids)


@requires_gpu
@pytest.mark.parametrize("t", [T.Q4_0, T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize(
    "cfg",
    [{"R": 1, "U": 1, "W": 1}, {"R": 3, "U": 4, "W": 3}, {"R": 2, "U": 2, "W": 8}],
    ids=["r1u1w1", "r3u4w3", "r2u2w8"],
)
def test_gpu_launch_configs(t, cfg):
    e, n, kk = 9, 257, 2816
    raw, wf = _experts(t, e, n, kk)
    ids = _ids(3, 4, e, seed=5)
    x = _x(3, 4, kk, True, mx.float32, seed=6)
    out = X.expert_matmul_kernel(
        x, _poisoned(raw, ids), ids, t, kk, config=cfg, init_value=float("nan")
    )
    _check(out, x, wf, ids)


@requires_gpu
def test_gpu_dispatcher_and_bad_ids():
    t, e, n, kk = T.Q4_K, 16, 257, 512
    raw, wf = _experts(t, e, n, kk)
    ids = _ids(2, 8, e, seed=7)
    x = _x(2, 8, kk, False, mx.bfloat16, seed=8).reshape(1, 2, kk)
    w = _poisoned(raw, ids)
    y = X.expert_matmul(x, w, ids.reshape(1, 2, 8), t, kk)
    direct = X.expert_matmul_kernel(x.reshape(2, kk), w, ids, t, kk)
    assert y.shape == (1, 2, 8, n) and bool(mx.array_equal(y.reshape(2, 8, n), direct))
    _check(direct, x.reshape(2, kk), wf, ids)
    # 17 tokens: the dequantizing path, same function
    ids17 = _ids(17, 2, e, seed=9)
    x17 = _x(17, 2, kk, True, mx.float16, seed=10)
    _check(X.expert_matmul(x17, mx.array(raw), ids17, t, kk), x17, wf, ids17)
    # an id past E: NaN rows (written: the output starts at 0), the other slots exact
    bad = mx.array([[3, e], [e + 100, 5]], dtype=mx.uint32)
    x32 = x.reshape(2, kk).astype(mx.float32)
    out = np.array(X.expert_matmul_kernel(x32, mx.array(raw), bad, t, kk, init_value=0.0))
    assert np.isnan(out[0, 1]).all() and np.isnan(out[1, 0]).all()
    good = mx.array([[3], [5]], dtype=mx.uint32)
    _check(mx.array(out[[0, 1], [0, 1]][:, None]), x32, wf, good)
