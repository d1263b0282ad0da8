"""The rendering scheme on the CPU: source text for both back ends, the call helper's launch
arithmetic, the reference switches, and the CUDA vocabulary run through the CPU emulator."""

from __future__ import annotations

import kernel_emulator
import mlx.core as mx
import numpy as np
import pytest

from hf2q_mlx.custom_kernels import _render, backend, reference_only
from hf2q_mlx.custom_kernels._render import Example, Kernel

_BODY = """
  // one SIMD group per row
  const uint row = gid_x * n_simd + simd_id;
  SHARED float part[8];
  float acc = 0.0f;
  if (row < uint(n[0])) acc = to_float(x[row * D + lane]);
  acc = simd_sum(acc);
  if (lane == 0) part[simd_id] = acc;
  BARRIER();
  if (row < uint(n[0]) && lane == 0) out[row] = from_float<T>(part[simd_id]);
"""


def _kernel(name="render_demo", body=_BODY, register=False) -> Kernel:
    ex = Example(
        {"x": mx.float16, "n": (mx.int32, 1)}, {"out": mx.float16}, {"T": mx.float16, "D": 32}
    )
    return Kernel(name, ["x", "n"], ["out"], body, examples=[ex], register=register)


def test_metal_rendering_matches_mlx_conventions():
    src = _kernel().render("metal")
    # template parameters, then the signature MLX writes: device buffers, small inputs in the
    # constant address space, outputs, then only the attributes the source mentions
    assert "template <typename T, int D>\n[[kernel]] void custom_kernel_render_demo(" in src
    assert "  const device float16_t* x [[buffer(0)]]," in src
    assert "  const constant int32_t* n [[buffer(1)]]," in src
    assert "  device float16_t* out [[buffer(2)]]," in src
    assert "uint thread_index_in_simdgroup [[thread_index_in_simdgroup]]" in src
    assert "grid_size" not in src  # not mentioned, so not injected
    assert 'template [[host_name("custom_kernel_render_demo")]] [[kernel]] decltype(' in src
    assert "custom_kernel_render_demo<float16_t, 32>" in src
    # the vocabulary maps onto Metal built-ins
    assert "#define BARRIER() threadgroup_barrier(mem_flags::mem_threadgroup)" in src
    assert "#define SHARED threadgroup" in src
    assert "const uint lane = thread_index_in_simdgroup;" in src
    assert src.index("#define BARRIER()") < src.index("[[kernel]]")  # header before the kernel


def test_cuda_rendering_matches_mlx_conventions():
    src = _kernel().render("cuda")
    assert src.startswith(_render.CUDA_MLX_PRELUDE)
    assert "namespace mlx::core::cu {" in src
    assert "__global__ void custom_kernel_render_demo(\n    const __half* x,\n" in src
    assert "    const int32_t* n,\n    __half* out) {" in src
    assert "  using T = __half;\n  constexpr int D = 32;" in src
    assert "#define BARRIER() __syncthreads()" in src
    assert "const uint lane = tid & 31u;" in src
    # the body comes after the preamble and the template constants
    assert src.index("constexpr int D") < src.index("const uint tid_x") < src.index("part[8]")


def test_shape_arguments_follow_the_source():
    body = "  out[0] = x[x_shape[0] - 1];\n"
    k = Kernel(
        "shape_demo",
        ["x"],
        ["out"],
        body,
        examples=[Example({"x": mx.float32}, {"out": mx.float32})],
        register=False,
    )
    assert "const __grid_constant__ Shape x_shape" in k.render("cuda")
    assert "const constant int* x_shape [[buffer(1)]]" in k.render("metal")
    assert "x_strides" not in k.render("cuda")


def test_kernel_validation_and_registry():
    k = _kernel("registry_demo", register=True)
    try:
        assert _render.REGISTRY["registry_demo"] is k
        with pytest.raises(ValueError):
            _kernel("registry_demo", register=True)
    finally:
        _render.REGISTRY.pop("registry_demo")
    with pytest.raises(ValueError):
        _kernel("bad name")
    with pytest.raises(ValueError):
        Kernel("no_examples", ["x"], ["out"], "", examples=[], register=False)
    with pytest.raises(ValueError):  # example names must match the parameters
        Kernel(
            "wrong_example",
            ["x"],
            ["out"],
            "",
            examples=[Example({"y": mx.float32}, {"out": mx.float32})],
            register=False,
        )


def test_call_rounds_grid_and_keys_builds_by_dtype(monkeypatch):
    calls, built = [], []
    k = _kernel()

    def fake_build(backend, signature):
        built.append((backend, signature))
        return lambda **kw: calls.append(kw) or [None]

    monkeypatch.setattr(k, "_kernel_for", fake_build)
    n = mx.array([3], dtype=mx.int32)
    for dt in (mx.float16, mx.float16, mx.bfloat16):
        k(
            [mx.zeros((3, 32), dt), n],
            grid=(100, 3),
            threadgroup=(64,),
            output_shapes=[(3,)],
            output_dtypes=[dt],
            template={"T": dt, "D": 32, "FLAG": True},
            backend="cuda",
        )
    assert calls[0]["grid"] == (128, 3, 1) and calls[0]["threadgroup"] == (64, 1, 1)
    assert calls[0]["template"] == [("T", mx.float16), ("D", 32), ("FLAG", 1)]
    assert len(calls) == 3
    # one build key per dtype signature; the second f16 call reuses the first one's launch plan
    assert built == [("cuda", "f16_i32__f16"), ("cuda", "bf16_i32__bf16")]
    # a launcher resolves everything but the arrays once (on CUDA its builds at the first
    # launch, cuda_cache's or MLX's); 0-d inputs get their own signature
    launch = k.launcher([mx.float32, mx.int32], grid=5, threadgroup=32, output_shapes=[(5,)],
                        output_dtypes=[mx.float32], backend="cuda", scalar_inputs=[1])  # fmt: skip
    launch(inputs=[mx.zeros((5,)), mx.array(3)])
    assert built[-1] == ("cuda", "f32_i32s__f32")
    assert calls[-1]["grid"] == (32, 1, 1) and calls[-1]["template"] is None
    with pytest.raises(ValueError):
        k(
            [n],
            grid=1,
            threadgroup=32,
            output_shapes=[(1,)],
            output_dtypes=[mx.float32],
            backend="cuda",
        )


def test_reference_switches(monkeypatch):
    monkeypatch.delenv("HF2Q_KERNELS", raising=False)
    gpu = _render.gpu_backend()
    assert backend() == gpu  # default device is the GPU where one exists, else None
    with reference_only():
        assert backend() is None
        with reference_only():
            assert backend() is None
        assert backend() is None
    assert backend() == gpu
    monkeypatch.setenv("HF2Q_KERNELS", "reference")
    assert backend() is None
    monkeypatch.delenv("HF2Q_KERNELS")
    old = mx.default_device()  # a CPU default device also means references
    mx.set_default_device(mx.cpu)
    try:
        assert backend() is None
    finally:
        mx.set_default_device(old)


_VOCAB_BODY = """
  // One threadgroup of 64 threads (2 SIMD groups); each lane writes its results to row tid.
  SHARED float buf[64];
  const float v = to_float(x[tid]);
  buf[tid] = v;
  BARRIER();
  DEVICE_PTR(float) o = out + tid * 16;
  o[0] = simd_sum(v);
  o[1] = simd_max(v);
  o[2] = simd_min(v);
  o[3] = simd_prefix_inclusive_sum(v);
  o[4] = simd_prefix_exclusive_sum(v);
  o[5] = simd_shuffle(v, (lane * 7u) & 31u);
  o[6] = simd_shuffle_xor(v, 5u);
  o[7] = simd_shuffle_down(v, 3u);
  o[8] = simd_shuffle_up(v, 3u);
  o[9] = simd_broadcast(v, 9u);
  o[10] = float(simd_any(v > 2.5f)) + 2.0f * float(simd_all(v > -100.0f));
  o[11] = buf[63 - tid];                      // written by another SIMD group before BARRIER()
  o[12] = f16_bits_to_float(ushort(bits[tid] & 0xFFFFu));
  o[13] = bf16_bits_to_float(ushort(bits[tid] >> 16));
  o[14] = bitcast<float>(bits[tid]);
  o[15] = float(tid) + 100.0f * float(lane) + 10000.0f * float(simd_id) + 1e6f * float(n_simd);
  rt[tid] = from_float<half_t>(v * 1.0009765625f);    // exercises round-to-nearest-even
  rb[tid] = from_float<bfloat_t>(v * 1.0009765625f);
"""


@pytest.mark.skipif(not kernel_emulator.available(), reason="g++ is not installed")
def test_cuda_vocabulary_on_the_emulator():
    """The CUDA header's implementations of the vocabulary against numpy, lane by lane."""
    k = Kernel(
        "vocab_demo",
        ["x", "bits"],
        ["out", "rt", "rb"],
        _VOCAB_BODY,
        examples=[
            Example(
                {"x": mx.float32, "bits": mx.uint32},
                {"out": mx.float32, "rt": mx.float16, "rb": mx.bfloat16},
            )
        ],
        register=False,
    )
    rng = np.random.default_rng(0)
    x = rng.normal(size=64).astype(np.float32) * 3
    bits = rng.integers(0, 2**32, size=64, dtype=np.uint64).astype(np.uint32)
    bits[:] = (bits & 0x3FFF3FFF) | 0x00003C00  # finite f16 in the low half, finite bf16 above
    out, rt, rb = kernel_emulator.emulate(
        k,
        [mx.array(x), mx.array(bits)],
        grid=(64,),
        threadgroup=(64,),
        output_shapes=[(64, 16), (64,), (64,)],
        output_dtypes=[mx.float32, mx.float16, mx.bfloat16],
    )
    out = np.array(out)
    for w in range(2):  # expected values per SIMD group, exact in float32 where it matters
        v = x[32 * w : 32 * w + 32]
        o = out[32 * w : 32 * w + 32]
        lanes = np.arange(32)
        np.testing.assert_allclose(o[:, 0], v.sum(dtype=np.float32), rtol=1e-6)
        assert (o[:, 1] == v.max()).all() and (o[:, 2] == v.min()).all()
        np.testing.assert_allclose(o[:, 3], np.cumsum(v), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(o[:, 4], np.cumsum(v) - v, rtol=1e-5, atol=1e-5)
        assert (o[:, 5] == v[(lanes * 7) & 31]).all()
        assert (o[:, 6] == v[lanes ^ 5]).all()
        assert (o[:, 7] == v[np.where(lanes + 3 < 32, lanes + 3, lanes)]).all()
        assert (o[:, 8] == v[np.where(lanes >= 3, lanes - 3, lanes)]).all()
        assert (o[:, 9] == v[9]).all()
        assert (o[:, 10] == float((v > 2.5).any()) + 2.0).all()
        assert (o[:, 15] == 32 * w + lanes + 100 * lanes + 10000 * w + 2e6).all()
    assert (out[:, 11] == x[::-1]).all()
    assert (out[:, 12] == (bits & 0xFFFF).astype(np.uint16).view(np.float16)).all()
    bf = ((bits >> 16).astype(np.uint32) << 16).view(np.float32)
    assert (out[:, 13] == bf).all()
    assert (out[:, 14] == bits.view(np.float32)).all()
    y = x * np.float32(1.0009765625)
    assert (np.array(rt) == y.astype(np.float16)).all()  # numpy rounds to nearest even too
    assert (
        np.array(rb.astype(mx.float32))
        == np.array(mx.array(y).astype(mx.bfloat16).astype(mx.float32))
    ).all()


@pytest.mark.skipif(not kernel_emulator.available(), reason="g++ is not installed")
def test_emulator_fiber_switches_and_deadlock_report():
    """Both fiber switches (_setjmp / _longjmp, the one taken where it works, and swapcontext
    under HQ_EMU_UCONTEXT) run the probe's barriers and shuffles to the right sum; a barrier one
    thread skips ends the run as a reported deadlock, not a hang or a wrong output."""
    assert kernel_emulator.probe([]) and kernel_emulator.probe(["-DHQ_EMU_UCONTEXT"])
    assert kernel_emulator.switch_flags() in ([], ["-DHQ_EMU_UCONTEXT"])
    k = Kernel(
        "deadlock_demo",
        ["x"],
        ["out"],
        "  if (tid != 5) BARRIER();\n  out[tid] = x[tid];\n",
        examples=[Example({"x": mx.float32}, {"out": mx.float32})],
        register=False,
    )
    x = mx.array(np.random.default_rng(1).normal(size=64).astype(np.float32))
    launch = dict(grid=(64,), threadgroup=(64,), output_shapes=[(64,)], output_dtypes=[mx.float32])
    with pytest.raises(RuntimeError, match="deadlock"):
        kernel_emulator.emulate(k, [x], **launch)
