"""The CUDA graph step: its recording replays the MLX step exactly (CPU, kernel emulator), the
recorder refuses what a replay cannot repeat, the graph ops equal their references bit for
bit, and on a GPU the replayed graph gives the compiled step's greedy tokens."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import requires_gpu

from hf2q_mlx.custom_kernels import _render, graph_ops, launch_recorder
from hf2q_mlx.custom_kernels._render import Example, Kernel
from hf2q_mlx.custom_kernels.launch_recorder import GraphCaptureError, Recorder

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "kernels"))
import kernel_emulator  # noqa: E402

needs_gxx = pytest.mark.skipif(not kernel_emulator.available(), reason="needs g++")


def _bits(a: mx.array) -> np.ndarray:
    raw = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32}[a.dtype.size]
    return np.array(a.view(raw))


# ---- the whole step, emulated -----------------------------------------------------------------


@needs_gxx
@pytest.mark.parametrize(
    "model, steps, kinds, fmt",
    [("gemma4:tiny-moe", 3, {"gather_rows", "scale_cast", "topk_select", "rms_norm_rope"}, "q4_k"),
     # Qwen 3.5's MoE end with the residual add and next norm (HF2Q_SHARED_GATE_NORM's default)
     ("qwen3_5:tiny-moe", 2, {"gated_delta_decode", "head_gate", "shared_gate_residual_norm",
                              "rms_norm_rope"}, "q4_k"),
     # MLX affine 4-bit (8-bit gates) and plain bf16 weights: models/kernel_linears.py's
     # mat-vecs and row gathers stand for MLX's quantized_matmul, matmul, gather and dequantize
     ("gemma4:tiny-moe", 2, {"gather_affine_rows", "dense_affine_matvec", "scale_cast",
                             "affine_expert_glu"}, "mlx4"),
     ("qwen3_5:tiny-moe", 2, {"gather_affine_rows", "dense_affine_matvec",
                              "shared_gate_residual_norm", "gated_delta_decode"}, "mlx4"),
     ("qwen3_5:tiny-moe", 2, {"gather_rows", "dense_float_matvec",
                              "shared_gate_residual_norm"}, "bf16"),
     # MLX 4-bit with the routed experts as Q4_1 blocks (HF2Q_AFFINE_EXPERTS=q4_1)
     ("gemma4:tiny-moe", 2, {"ggml_expert_glu_q4_1", "ggml_expert_down_slots_q4_1",
                             "dense_affine_matvec"}, "mlx4-q4_1"),
     ("qwen3_5:tiny-moe", 2, {"ggml_expert_glu_q4_1", "ggml_expert_down_slots_q4_1",
                              "gated_delta_decode"}, "mlx4-q4_1"),
     # Qwen 2 (Llama's attention with q / k / v biases): RoPE without head norms and the GGML
     # linears' biases as kernels, the keys and values written by the RoPE kernel
     ("qwen2:tiny", 3, {"add_bias", "rms_norm_rope", "gather_rows"}, "q4_k")],
    ids=["gemma4-q4_k", "qwen3_5-q4_k", "gemma4-mlx4", "qwen3_5-mlx4", "qwen3_5-bf16",
         "gemma4-mlx4-q4_1", "qwen3_5-mlx4-q4_1", "qwen2"],
)  # fmt: skip
def test_recorded_step_replays_the_mlx_step_bit_for_bit(model, steps, kinds, fmt):
    """Tiny Gemma 4 MoE (a 2-token window crossed) and Qwen 3.5 MoE (delta-net, then gated
    attention), GGML, MLX 4-bit or bf16 weights: the recording replayed launch by launch through
    the emulator gives
    the MLX step's tokens, last logits and every cache byte (KV rows written in place by the
    norm + RoPE kernel's cache mode or kv_write where the MLX step scatters; the delta-net's
    states written in place by its kernel), launches replayed in a shuffled order that keeps
    their dependencies (``launch_dependencies``). In a process of its own:
    the fake CUDA back end stays in the dispatchers' plan caches."""
    script = HERE / "graph_step_emulated.py"
    cmd = [sys.executable, str(script), model, "--steps", str(steps), "--format", fmt]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["got"] == out["want"] and len(out["want"]) == steps and len(out["want"][0]) == 1
    assert out["logits_equal"] and out["caches_equal"]
    # MLX's scatter, gather, cast, argmax and gates are kernels in the graph; the norm + RoPE
    # kernel writes the keys and values into the caches itself (fuse_kv_writes: Qwen 3.5's
    # values pass through it unnormed), so no kv_write is left
    assert kinds <= set(out["kernels"]) and "kv_write" not in out["kernels"]
    # a dense MLP's fused gate / up and its activation are one launch in GGML and MLX affine
    # weights (expert_glu.dense_glu, KernelQuantizedLinear.glu); bf16 keeps the two
    assert ("gated_activation" in out["kernels"]) == (fmt == "bf16")
    # the delta-net kernel writes its recurrent and conv states over the old ones
    # (fuse_state_writes): nothing is copied back at the graph's end
    assert out["copies"] == 0
    assert ("gated_delta_decode" in out["in_place"]) == model.startswith("qwen3_5")
    # replayed in a shuffled order that keeps launch_dependencies' edges: still bit for bit;
    # the MoE layers hold launches a graph's lanes can run side by side (a dense model's
    # launches form one chain)
    assert out["dependencies"] and (out["reordered"] and out["lanes"] > 1) == ("moe" in model)


@needs_gxx
@pytest.mark.parametrize("fused", [False, True], ids=["two-launches", "fused-sum"])
def test_recorded_step_with_split_mat_vecs_replays_bit_for_bit(fused):
    """HF2Q_MMA_SPLIT_K=2 (the GGML mat-vec split over K, then the kernel adding the splits;
    ``fused``: HF2Q_MMA_SPLIT_FUSED=1, the sum in each tile's last threadgroup, its counters in
    the recording): the tiny Gemma 4 MoE's Q5_0 down (10 blocks) splits, and the recording
    replayed through the emulator in a shuffled order gives the MLX step's tokens, logits and
    caches bit for bit (the splits' fp32 sums are an intermediate the graph's launches order)."""
    script = HERE / "graph_step_emulated.py"
    cmd = [sys.executable, str(script), "gemma4:tiny-moe", "--steps", "2", "--split-k", "2"]
    res = subprocess.run(
        cmd + (["--split-fused"] if fused else []), capture_output=True, text=True, timeout=900
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["got"] == out["want"] and out["logits_equal"] and out["caches_equal"]
    kernels = set(out["kernels"])
    if fused:
        assert "ggml_qmv_mma_ksf_q5_0" in kernels and "ggml_qmv_mma_split_sum" not in kernels
    else:
        assert {"ggml_qmv_mma_ks_q5_0", "ggml_qmv_mma_split_sum"} <= kernels


@needs_gxx
@pytest.mark.parametrize(
    "model, switch",
    [("gemma4:tiny-moe", "HF2Q_ROUTER_JOIN"), ("qwen3_5:tiny-moe", "HF2Q_ROUTER_JOIN"),
     ("qwen3_5:tiny-moe", "HF2Q_SHARED_GATE_NORM")],
)  # fmt: skip
def test_router_join_keeps_the_step_bits_one_launch_fewer(model, switch):
    """A MoE layer's join after attention made by its router kernel (HF2Q_ROUTER_JOIN=1; the
    default for Qwen 3.5) and by the joining kernel of its own (0: Gemma 4's
    post_norm_residual, Qwen 3.5's residual_rms_norm), and Qwen 3.5's MoE end with the residual
    add and norm after it in one kernel (HF2Q_SHARED_GATE_NORM=1) or two (0), give the step the
    same logits bit for bit, one launch fewer per MoE layer (two here)."""
    script = HERE / "graph_step_emulated.py"
    outs = []
    for join in ("1", "0"):
        env = dict(os.environ, **{switch: join})
        cmd = [sys.executable, str(script), model, "--steps", "2"]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
        assert res.returncode == 0, res.stderr[-3000:]
        outs.append(json.loads(res.stdout.strip().splitlines()[-1]))
    joined, separate = outs
    assert joined["logits_equal"] and separate["logits_equal"]
    assert joined["logits_sha"] == separate["logits_sha"] and joined["want"] == separate["want"]
    assert separate["launches"] - joined["launches"] == 2


# ---- the recorder -------------------------------------------------------------------------------

_BODY = """
  // One thread per element: out = x * 2.
  const uint e = gid_x * tg_size + tid;
  if (e >= uint(n[0])) return;
  out[e] = x[e] * 2.0f;
"""


@pytest.fixture
def doubler(monkeypatch):
    """A kernel whose launches only a recorder sees (MLX's build stubbed: none runs here)."""
    ex = Example({"x": mx.float32, "n": (mx.int32, 1)}, {"out": mx.float32})
    k = Kernel("graph_test_double", ["x", "n"], ["out"], _BODY, register=False, examples=[ex])
    monkeypatch.setattr(k, "_kernel_for", lambda be, sig: print)
    n = mx.array([8, 0, 0, 0], dtype=mx.int32)[:1]
    mx.eval(n)
    launch = k.launcher([mx.float32, mx.int32], grid=8, threadgroup=8, output_shapes=[(8,)],
                        output_dtypes=[mx.float32], backend="cuda")  # fmt: skip
    return launch, n


def _record(launch, n, x, seed, between):
    rec = Recorder(seed)
    with launch_recorder.recording(rec):
        assert launch_recorder.active()
        y = launch(inputs=[x, n])[0]
        launch(inputs=[between(y), n])
    assert not launch_recorder.active() and len(rec.launches) == 2
    return rec


def test_recorder_accepts_outputs_state_and_constants(doubler):
    launch, n = doubler
    x = mx.random.normal((8,))
    mx.eval(x)
    const = mx.ones((8,))
    # the second launch reads the first's output (a view of it), then a constant's op
    for between in (lambda y: y.reshape(2, 4).reshape(8), lambda y: const * 3):
        r1, r2 = (_record(launch, n, x, s, between) for s in (1, 2))
        launch_recorder.check_replayable(r1, r2, [x])
        assert r1.launches[0].outputs[0] is not r2.launches[0].outputs[0]


def test_recorder_refuses_mlx_ops_on_per_token_values(doubler):
    launch, n = doubler
    x = mx.random.normal((8,))
    mx.eval(x)
    r1, r2 = (_record(launch, n, x, s, lambda y: y + 1) for s in (1, 2))
    with pytest.raises(GraphCaptureError, match="MLX op on per-token values"):
        launch_recorder.check_replayable(r1, r2, [x])
    # a step input not declared as state is per-token too (different values per recording)
    xs = [mx.random.normal((8,), key=mx.random.key(s)) for s in (1, 2)]
    r1, r2 = (_record(launch, n, xi, s, lambda y: y) for s, xi in zip((1, 2), xs))
    with pytest.raises(GraphCaptureError):
        launch_recorder.check_replayable(r1, r2, [])
    launch_recorder.check_replayable(r1, r2, xs[:1])  # declared: fine


def test_recorder_refuses_strided_inputs_and_in_place_outside(doubler):
    launch, n = doubler
    x = mx.random.normal((8, 2))[:, 0]
    with launch_recorder.recording(Recorder()), pytest.raises(GraphCaptureError, match="strided"):
        launch(inputs=[x, n])
    with pytest.raises(GraphCaptureError, match="inside a recording"):
        launch_recorder.launch_into(launch, [x, n], [mx.zeros((8,))])
    assert not _render._recorder


# ---- the graph ops against their references (emulator) ---------------------------------------


@pytest.fixture
def graph_kernels(monkeypatch):
    """The graph ops' launchers resolve on the CPU (MLX's build stubbed: nothing runs)."""
    monkeypatch.setattr(_render, "gpu_backend", lambda: "cuda")
    kernels = (graph_ops._kv_kernel, graph_ops._words_kernel, graph_ops._rows_kernel,
               graph_ops._scale_kernel, graph_ops._affine_rows_kernel,
               graph_ops._bias_kernel)  # fmt: skip
    for k in kernels:
        monkeypatch.setattr(k, "_kernel_for", lambda be, sig: print)


@needs_gxx
@pytest.mark.parametrize("ring", [False, True])
@pytest.mark.parametrize("L", [1, 3])
def test_kv_write_writes_the_scatter_slots(ring, L, graph_kernels):
    """Keys and values (other head dims) written in one launch over the caches' contents (the
    emulator starts the outputs from them): every byte equals the reference scatters', wrapped
    slots included."""
    B, H, C, DK, DV = 2, 3, 8, 32, 16
    ks = mx.random.split(mx.random.key(L + 2 * ring), 4)
    k_cache = mx.random.normal((B, H, C, DK), key=ks[0]).astype(mx.bfloat16)
    v_cache = mx.random.normal((B, H, C, DV), key=ks[1]).astype(mx.bfloat16)
    k_src = mx.random.normal((B, H, L, DK), key=ks[2]).astype(mx.bfloat16)
    v_src = mx.random.normal((B, H, L, DV), key=ks[3])  # fp32: cast as the scatter casts
    pos = mx.array([6, 1] if ring else [2, 5], dtype=mx.int32)
    _check_kv_write(k_cache, v_cache, k_src, v_src, pos, ring)


def _check_kv_write(k_cache, v_cache, k_src, v_src, pos, ring):
    """The launch over the caches' contents (the emulator starts the outputs from them) against
    the reference scatters, byte for byte."""
    s = graph_ops.kv_write_launch(k_cache, v_cache, k_src, v_src, ring).spec
    got = kernel_emulator.emulate(
        s.kernel, [k_src, v_src, pos], grid=s.grid, threadgroup=s.threadgroup,
        output_shapes=s.output_shapes, output_dtypes=s.output_dtypes,
        template=dict(s.template), initial=[k_cache, v_cache],
    )  # fmt: skip
    for out, cache, src in zip(got, (k_cache, v_cache), (k_src, v_src)):
        want = graph_ops.kv_write_reference(cache, src, pos, ring)
        np.testing.assert_array_equal(_bits(out), _bits(want))
        assert not np.array_equal(_bits(out), _bits(cache))  # something was written
    return s


@needs_gxx
@pytest.mark.parametrize("ring", [False, True])
def test_kv_write_words_writes_packed_rows_at_the_scatter_slots(ring, graph_kernels):
    """A TurboQuant cache's packed rows (uint32 words, K and V rows of other lengths), L = 2:
    every word equals the reference scatters', wrapped slots included."""
    B, H, C, WK, WV, L = 2, 3, 8, 33, 17, 2
    rng = np.random.default_rng(5 + ring)

    def words(*shape):
        return mx.array(rng.integers(0, 2**32, shape, dtype=np.uint64).astype(np.uint32))

    k_cache, v_cache = words(B, H, C, WK), words(B, H, C, WV)
    k_src, v_src = words(B, H, L, WK), words(B, H, L, WV)
    pos = mx.array([7, 2] if ring else [3, 6], dtype=mx.int32)
    s = _check_kv_write(k_cache, v_cache, k_src, v_src, pos, ring)
    assert s.kernel.name == "kv_write_words"


@needs_gxx
def test_gather_rows_and_scale_cast_kernels_match_references(graph_kernels):
    """Recorded kernels run through the emulator: rows bit-equal to ``table[ids]``; the cast
    and scale bit-equal to ``x.astype(T) * T(scale)`` for bf16, fp16 and fp32 (from fp32 and
    from bf16 x); a linear's bias add bit-equal to ``y + bias.astype(T)``."""
    rng = np.random.default_rng(0)
    table = mx.array(rng.integers(0, 256, (50, 144), dtype=np.uint8))
    ids = mx.array([[3, 49, 0]], dtype=mx.int32)
    rec = Recorder()
    x = mx.random.normal((2, 48), key=mx.random.key(1)) * 7
    with launch_recorder.recording(rec):
        graph_ops.gather_rows(table, ids)
        for dt in (mx.bfloat16, mx.float16, mx.float32):
            graph_ops.scale_cast(x, 2816**0.5, dt)
        graph_ops.scale_cast(x.astype(mx.bfloat16), 2816**0.5, mx.bfloat16)
        y = (x * 3).astype(mx.bfloat16)
        bias = mx.random.normal((48,), key=mx.random.key(2))
        graph_ops.add_bias(y, bias)
    names = [launch.spec.kernel.name for launch in rec.launches]
    assert names == ["gather_rows"] + ["scale_cast"] * 4 + ["add_bias"]
    outs = []
    for launch in rec.launches:
        s = launch.spec
        outs.append(kernel_emulator.emulate(
            s.kernel, launch.inputs, grid=s.grid, threadgroup=s.threadgroup,
            output_shapes=s.output_shapes, output_dtypes=s.output_dtypes, template=dict(s.template),
        )[0])  # fmt: skip
    np.testing.assert_array_equal(
        np.array(outs[0].view(mx.uint8)), np.array(table[ids.reshape(-1)])
    )
    for got, dt in zip(outs[1:4], (mx.bfloat16, mx.float16, mx.float32)):
        want = graph_ops.scale_cast_reference(x, 2816**0.5, dt)
        np.testing.assert_array_equal(_bits(got), _bits(want))
    want = graph_ops.scale_cast_reference(x.astype(mx.bfloat16), 2816**0.5, mx.bfloat16)
    np.testing.assert_array_equal(_bits(outs[4]), _bits(want))
    np.testing.assert_array_equal(_bits(outs[5]), _bits(graph_ops.add_bias_reference(y, bias)))


@needs_gxx
@pytest.mark.parametrize("dtype, gs, bits", [(mx.bfloat16, 64, 4), (mx.float16, 32, 8),
                                             (mx.float32, 128, 4)])  # fmt: skip
def test_gather_affine_rows_kernel_equals_mlx_dequantize(dtype, gs, bits, graph_kernels):
    """An MLX 4-/8-bit embedding's rows, gathered and dequantized by one recorded kernel
    (emulated; it poisons outputs first): bit-equal to ``nn.QuantizedEmbedding``'s
    ``mx.dequantize`` of the rows (data movement and MLX's own T arithmetic: no tolerance)."""
    table = mx.random.normal((40, 256), key=mx.random.key(4)).astype(dtype)
    wq, scales, biases = mx.quantize(table, group_size=gs, bits=bits)
    ids = mx.array([[5, 39], [0, 17]], dtype=mx.int32)
    rec = Recorder()
    with launch_recorder.recording(rec):
        graph_ops.gather_affine_rows(wq, scales, biases, ids, gs, bits)
    (launch,) = rec.launches
    s = launch.spec
    got = kernel_emulator.emulate(
        s.kernel, launch.inputs, grid=s.grid, threadgroup=s.threadgroup,
        output_shapes=s.output_shapes, output_dtypes=s.output_dtypes, template=dict(s.template),
    )[0]  # fmt: skip
    want = graph_ops.gather_affine_rows_reference(wq, scales, biases, ids, gs, bits)
    assert got.dtype == want.dtype == dtype
    np.testing.assert_array_equal(_bits(got.reshape(want.shape)), _bits(want))


# ---- on a GPU -----------------------------------------------------------------------------------


def _max_ulps(a: mx.array, b: mx.array) -> float:
    """Largest |a - b| in bf16 units in the last place at the largest |b| (2**-7 relative)."""
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.abs(a - b).max() / (mx.abs(b).max() * 2.0**-7)).item()


@needs_gxx
@pytest.mark.parametrize("fold", ["0", "1"])
def test_recorded_turboquant_step_replays_the_mlx_step_bit_for_bit(fold):
    """TurboQuant caches (``kv_bits``, ``HF2Q_TQ_GRAPH`` on) in the recorded step, two rows
    each calibrated on its own 2-token prompt, one idling a step: the replay gives the MLX step's
    tokens, last logits and every cache byte (packed rows written in place, the balance tables
    unchanged), with the TurboQuant kernels inside the graph: by kv_write_words after the
    quantize kernel, or with ``HF2Q_TQ_FOLD=1`` by the K + V quantize launch itself (and the
    fused flash-decode)."""
    script = HERE / "graph_step_emulated.py"
    cmd = [sys.executable, str(script), "gemma4:tiny-moe", "--steps", "2", "--batch", "2",
           "--prefill", "2", "--kv-bits", "8"]  # fmt: skip
    env = {**os.environ, "HF2Q_TQ_FOLD": fold}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["got"] == out["want"] and len(out["want"]) == 2 and len(out["want"][0]) == 2
    assert out["logits_equal"] and out["caches_equal"]
    if fold == "1":
        tq, writer = {"tq_quantize_kv_into", "tq_flash_decode_fused"}, "tq_quantize_kv_into"
    else:
        tq = {"tq_quantize", "tq_flash_decode_partial", "tq_flash_decode_reduce"}
        writer = "kv_write_words"
    assert tq | {writer} <= set(out["kernels"]) and out["in_place"] == [writer]
    other = {"tq_quantize", "tq_flash_decode_partial", "tq_flash_decode_reduce", "kv_write_words",
             "tq_quantize_kv_into", "tq_flash_decode_fused"} - tq - {writer}  # fmt: skip
    assert not other & set(out["kernels"])


@requires_gpu
@pytest.mark.parametrize(
    "family, fmt, kv_bits",
    [(f, fmt, kv) for f in ("gemma4", "qwen3_5")
     for fmt, kv in (("q4_k", None), ("q4_k", 8), ("mlx4", None), ("mlx4-q4_1", None))]
    + [("qwen2", "q4_k", None)],
    ids=[f"{f}-{v}" for f in ("gemma4", "qwen3_5") for v in ("bf16", "tq8", "mlx4", "mlx4-q4_1")]
    + ["qwen2"],
)  # fmt: skip
def test_gpu_graph_step_gives_the_compiled_steps_tokens(family, fmt, kv_bits, monkeypatch):
    """Tiny Gemma 4 MoE (split attention rows merged by their last part, the 16-token window
    crossed) and tiny Qwen 3.5 MoE (the recurrent state written in place) with GGML or MLX 4-bit
    weights, tiny Qwen 2 (RoPE without head norms, GGML biases) on CUDA: 40 greedy tokens after
    a prompt from the replayed graph and from the compiled step: the same ids; the graph's
    logits at every step within 2 bf16 ulps of the compiled step's, teacher-forced (the same
    kernels; where MLX ops of the compiled step became kernels, e.g. the embedding's scale and
    cast, the roundings may differ: one ulp per rounding, two for slack)."""
    if not mx.cuda.is_available():
        pytest.skip("the CUDA graph step needs MLX's CUDA back end")
    sys.path.insert(0, str(HERE.parent / "bench"))
    from decode_profile import build

    from hf2q_mlx.cuda_graph_step import CudaGraphStep
    from hf2q_mlx.custom_kernels.cuda_driver import Driver
    from hf2q_mlx.decode_step import DecodeStep

    monkeypatch.delenv("HF2Q_TQ_GRAPH", raising=False)  # TurboQuant caches in the graph
    if family == "qwen2":
        from graph_step_emulated import build_llama

        model, vocab = build_llama("qwen2", 2)
    else:
        model, vocab = build(family, "tiny-moe", fmt.removesuffix("-q4_1"), mx.bfloat16)
        if fmt.endswith("-q4_1"):  # HF2Q_AFFINE_EXPERTS=q4_1: the experts as Q4_1 blocks
            from hf2q_mlx.models.experts import affine_experts_to_q4_1

            assert affine_experts_to_q4_1(model)[0] > 0
    prompt = np.random.default_rng(3).integers(0, vocab, 12).tolist()
    compiled = DecodeStep(model, 1, 64, kv_bits=kv_bits)
    replayed = DecodeStep(model, 1, 64, kv_bits=kv_bits)
    t = int(mx.argmax(compiled.prefill(0, prompt)).item())
    replayed.prefill(0, prompt)
    g = CudaGraphStep(replayed, Driver())
    want, got, ulps = [], [], []
    try:
        for _ in range(40):
            logits = compiled.decode([t])  # (1, V)
            got.append(g.decode([t])[0])
            want.append(int(mx.argmax(logits, axis=-1).item()))
            ulps.append(_max_ulps(g.last.logits.reshape(logits.shape), logits))
            t = want[-1]
    finally:
        g.close()
    print(f"graph vs compiled logits: max {max(ulps):.2f} bf16 ulps at the largest logit")
    assert got == want
    assert max(ulps) <= 2.0, ulps


# ---- stream_generate's graph mode -----------------------------------------------------------


def _tiny_generation_model():
    from test_decode_step import tiny_model

    return tiny_model("gemma4-moe")


def test_stream_generate_takes_the_graph_step_when_asked(monkeypatch):
    """HF2Q_DECODE=graph on CUDA: tokens 2.. come from the graph step (a stand-in here that runs
    the compiled step and keeps its logits, as the graph keeps its recorded ones): greedy ids
    and logprobs from the graph, sampled tokens drawn by MLX from the graph's logits (the same
    tokens as HF2Q_DECODE=compiled with the same seed); a model whose step cannot be recorded
    is said on stderr once and decodes through the compiled step."""
    from types import SimpleNamespace

    from conftest import IdsTokenizer

    from hf2q_mlx import cuda_graph_step, generation
    from hf2q_mlx.custom_kernels import cuda_driver

    calls = []

    class StandIn:
        def __init__(self, step, driver):
            self.step, self.last = step, None

        def record(self, span):
            if fail:
                raise GraphCaptureError("launch 3 (k): input x comes from an MLX op")
            return SimpleNamespace(logits=mx.zeros((1, 4)))

        def decode(self, tokens):
            calls.append(tokens)
            logits = self.step.decode(tokens)  # (1, V)
            self.last = SimpleNamespace(logits=logits)
            return [int(mx.argmax(logits[0]).item())]

        def logprob(self, row, token):
            return -1.5

    def run(**kw):
        model = _tiny_generation_model()  # a fresh model: no step or graph kept from before
        rs = generation.stream_generate(model, IdsTokenizer(), [5, 9, 2, 7], max_tokens=6,
                                        ignore_eos=True, **kw)  # fmt: skip
        return [(r.token, r.logprob) for r in rs]

    with mx.stream(mx.cpu):
        monkeypatch.setenv("HF2Q_DECODE", "compiled")
        want = run()
        want_sampled = run(temperature=0.8, seed=1)
        monkeypatch.setattr(cuda_graph_step, "CudaGraphStep", StandIn)
        monkeypatch.setattr(cuda_driver, "Driver", lambda: None)
        monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
        monkeypatch.setenv("HF2Q_DECODE", "graph")
        assert generation.decode_mode() == "graph"
        fail = False
        got = run()
        assert [t for t, _ in got] == [t for t, _ in want] and len(calls) == 5
        assert got[0][1] == want[0][1] and all(lp == -1.5 for _, lp in got[1:])
        calls.clear()
        got = run(temperature=0.8, seed=1)
        assert len(calls) == 5 and [t for t, _ in got] == [t for t, _ in want_sampled]
        np.testing.assert_allclose([lp for _, lp in got], [lp for _, lp in want_sampled],
                                   rtol=1e-6)  # fmt: skip
        calls.clear()
        fail = True
        got = run()
        assert [t for t, _ in got] == [t for t, _ in want] and calls == []


@requires_gpu
def test_gpu_stream_generate_graph_equals_compiled(monkeypatch):
    """On CUDA, tiny Gemma 4 MoE with GGML weights (one build: the bench builder's router
    weights come from MLX's global generator, so two builds differ): stream_generate through
    HF2Q_DECODE=graph gives HF2Q_DECODE=compiled's tokens and logprobs, greedy and sampled with
    one seed (the graph's logits are within 2 bf16 units of the compiled step's, checked above;
    0 measured on the H200)."""
    if not mx.cuda.is_available():
        pytest.skip("the CUDA graph step needs MLX's CUDA back end")
    sys.path.insert(0, str(HERE.parent / "bench"))
    from conftest import IdsTokenizer
    from decode_profile import build

    from hf2q_mlx import generation
    from hf2q_mlx.decode_step import _STEPS

    model, _ = build("gemma4", "tiny-moe", "q4_k", mx.bfloat16)

    def run(mode, **kw):
        monkeypatch.setenv("HF2Q_DECODE", mode)
        rs = generation.stream_generate(model, IdsTokenizer(), [5, 9, 2, 7, 11], max_tokens=24,
                                        ignore_eos=True, **kw)  # fmt: skip
        return [(r.token, r.logprob) for r in rs]

    for kw in ({}, {"temperature": 0.7, "seed": 3}):
        want, got = run("compiled", **kw), run("graph", **kw)
        step = next(iter(model.__dict__[_STEPS].values()))
        assert step.__dict__.get("_graph"), "no graph step was made"
        assert [t for t, _ in got] == [t for t, _ in want], kw
        np.testing.assert_allclose([lp for _, lp in got], [lp for _, lp in want], rtol=1e-5)
        assert len(got) == 24 and all(np.isfinite(lp) for _, lp in got)


@requires_gpu
def test_gpu_engine_graph_equals_compiled(monkeypatch):
    """On CUDA, the serving engine decoding through the graph step (HF2Q_DECODE=graph): three
    greedy requests of different prompt lengths batched at B = 4 give the compiled engine's
    tokens, and every one of them equals the request run alone."""
    if not mx.cuda.is_available():
        pytest.skip("the CUDA graph step needs MLX's CUDA back end")
    sys.path.insert(0, str(HERE.parent / "bench"))
    from conftest import IdsTokenizer
    from decode_profile import build

    import hf2q_mlx
    from hf2q_mlx.cuda_graph_step import CudaGraphStep

    prompts = [[5, 9, 2, 7], [3, 1], list(range(20, 37))]

    model, _ = build("gemma4", "tiny-moe", "q4_k", mx.bfloat16)  # one build: random router

    def run(mode, batch):
        monkeypatch.setenv("HF2Q_DECODE", mode)
        with hf2q_mlx.BatchGenerator(model, IdsTokenizer(), max_batch=4, max_len=96,
                                     compiled=True) as gen:  # fmt: skip
            uids = [gen.submit(p, max_tokens=30, ignore_eos=True) for p in batch]
            out = {u: [] for u in uids}
            for r in gen.results(uids):
                if r.token is not None:
                    out[r.uid].append(r.token)
            return [out[u] for u in uids], gen.engine.graph

    got, graph = run("graph", prompts)
    assert isinstance(graph, CudaGraphStep)
    assert got == run("compiled", prompts)[0]
    assert got == [run("graph", [p])[0][0] for p in prompts]


class _StandInGraph:
    """A CudaGraphStep stand-in for the CPU: runs the compiled step, keeps its logits, returns
    their argmax; ``calls`` collects the tokens of every decode."""

    calls: list = []

    def __init__(self, step, driver):
        from types import SimpleNamespace

        self.step, self.last, self._ns = step, None, SimpleNamespace

    def record(self, span):
        return self._ns(logits=mx.zeros((1, 4)))

    def decode(self, tokens, active=None):
        self.calls.append(list(tokens))
        logits = self.step.decode(tokens, active)  # (B, V)
        self.last = self._ns(logits=logits)
        return [int(t) for t in mx.argmax(logits, axis=-1).tolist()]

    def close(self):
        self.closed = True


def _use_stand_in_graph(monkeypatch):
    from hf2q_mlx import cuda_graph_step
    from hf2q_mlx.custom_kernels import cuda_driver

    monkeypatch.setattr(cuda_graph_step, "CudaGraphStep", _StandInGraph)
    monkeypatch.setattr(cuda_driver, "Driver", lambda: None)
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    monkeypatch.setenv("HF2Q_DECODE", "graph")


def test_engine_takes_the_graphs_ids_for_plain_greedy_rows(monkeypatch):
    """Rows that are greedy with nothing else asked (no penalties, no log-probs) stream the
    graph's own argmax ids: no sampling launch on the device for such a step; the same tokens
    as the compiled engine's. One row asking for log-probs brings the sampler back."""
    from conftest import IdsTokenizer

    import hf2q_mlx
    from hf2q_mlx.serving import batch_sampler

    launches = []
    real_launch = batch_sampler.BatchSampler.launch

    def counting_launch(self, logits, active):
        launches.append(list(active))
        return real_launch(self, logits, active)

    monkeypatch.setattr(batch_sampler.BatchSampler, "launch", counting_launch)

    def run(logprobs: bool):
        model = _tiny_generation_model()
        with hf2q_mlx.BatchGenerator(model, IdsTokenizer(), max_batch=2, max_len=64,
                                     compiled=True) as gen:  # fmt: skip
            uids = [
                gen.submit([5, 9, 2, 7], max_tokens=6, ignore_eos=True),
                gen.submit([3, 1], max_tokens=5, ignore_eos=True, logprobs=logprobs),
            ]
            out = {u: [] for u in uids}
            for r in gen.results(uids):
                if r.token is not None:
                    out[r.uid].append(r.token)
            return [out[u] for u in uids]

    with mx.stream(mx.cpu):
        monkeypatch.setenv("HF2Q_DECODE", "compiled")
        want = run(False)
        assert len(launches) >= 6 and [len(w) for w in want] == [6, 5]
        launches.clear()
        _use_stand_in_graph(monkeypatch)
        assert run(False) == want and launches == []
        assert run(True) == want and len(launches) >= 5


def test_engine_decodes_through_the_graph_step_when_asked(monkeypatch):
    """The serving engine with HF2Q_DECODE=graph on CUDA (a stand-in graph running the compiled
    step, keeping its logits): two rows, one greedy with logprobs, one sampled with a seed,
    give HF2Q_DECODE=compiled's tokens and logprobs, every token through the graph; the same
    with both prompts prefilled in one packed pass (``batch_prefill``)."""
    from conftest import IdsTokenizer

    import hf2q_mlx

    calls = _StandInGraph.calls = []
    StandIn = _StandInGraph

    def run(batch_prefill=False):
        model = _tiny_generation_model()
        opts = dict(max_batch=2, max_len=64, compiled=True, batch_prefill=batch_prefill)
        with hf2q_mlx.BatchGenerator(model, IdsTokenizer(), **opts) as gen:
            uids = [
                gen.submit([5, 9, 2, 7], max_tokens=6, ignore_eos=True, logprobs=True),
                gen.submit([3, 1], max_tokens=5, ignore_eos=True, temperature=0.9, seed=4),
            ]
            out = {u: [] for u in uids}
            for r in gen.results(uids):
                if r.token is not None:
                    out[r.uid].append((r.token, r.logprob))
            return [out[u] for u in uids], gen.engine.graph

    with mx.stream(mx.cpu):
        monkeypatch.setenv("HF2Q_DECODE", "compiled")
        want, graph = run()
        assert graph is None and [len(w) for w in want] == [6, 5]
        _use_stand_in_graph(monkeypatch)
        got, graph = run()
        packed, _ = run(batch_prefill=True)
    assert isinstance(graph, StandIn) and graph.closed  # the engine's end closed its graph
    assert [[t for t, _ in g] for g in packed] == [[t for t, _ in w] for w in want]
    assert [[t for t, _ in g] for g in got] == [[t for t, _ in w] for w in want]
    np.testing.assert_allclose([lp for lp in (x[1] for x in got[0])],
                               [lp for lp in (x[1] for x in want[0])], rtol=1e-5)  # fmt: skip
    # every generated token went through the graph: at most 6 steps with a row active, per run
    assert 12 <= len(calls) <= 22


def test_graph_step_refuses_bad_arguments_before_any_launch():
    """Wrong row counts, token ids outside the vocabulary (the graph's embedding gather would
    read past its table), a step past max_len and a missing driver: InvalidArgumentError /
    ContextLengthError, raised before the graph is touched."""
    from hf2q_mlx.cuda_graph_step import CudaGraphStep
    from hf2q_mlx.decode_step import DecodeStep
    from hf2q_mlx.errors import ContextLengthError, InvalidArgumentError

    with mx.stream(mx.cpu):
        step = DecodeStep(_tiny_generation_model(), 2, 8)
        with pytest.raises(InvalidArgumentError, match="CUDA driver"):
            CudaGraphStep(step).decode([1, 2])
        graph = CudaGraphStep(step, driver=_FakeDriver())  # never reached below
        V = step.model.args.vocab_size
        for tokens, active in (([1], None), ([1, 2], [True]), ([1, V], None), ([-1, 0], None)):
            with pytest.raises(InvalidArgumentError):
                graph.decode(tokens, active)
        step.positions = [8, 0]
        with pytest.raises(ContextLengthError):
            graph.decode([1, 2])
        assert step.positions == [8, 0]  # nothing moved


class _FakeDriver:
    """The Driver's calls, logged; ``fail_at``: the launch (0-based) that raises; ``managed``:
    what ``is_managed`` says of every address."""

    def __init__(self, fail_at=None, managed=True):
        self.calls, self.capturing, self.fail_at, self.launches = [], False, fail_at, 0
        self.lanes = []  # the stream of each launch
        self.managed, self.asked = managed, []

    def is_managed(self, ptr):
        self.asked.append(ptr)
        return self.managed

    def prefetch(self, ptr, nbytes):
        self.calls.append(("prefetch", ptr, nbytes))

    def function(self, name, image):
        return name

    def synchronize(self):
        self.calls.append(("sync",))

    def begin_capture(self):
        self.capturing = True

    def end_capture(self):
        self.capturing = False
        return "exe"

    def destroy(self, exe):
        pass

    def fill(self, *args, stream=None):
        self.calls.append(("fill", *args))

    def launch(self, fn, blocks, threads, ptrs, stream=None, pdl=False):
        if self.launches == self.fail_at:
            raise RuntimeError("an illegal memory access was encountered")
        self.launches += 1
        self.calls.append(("launch", fn, tuple(ptrs)))
        self.lanes.append(stream)
        self.pdl = getattr(self, "pdl", []) + [pdl]

    def streams(self, n):
        return [f"s{i}" for i in range(n)]

    def events(self, n):
        return [f"e{i}" for i in range(n)]

    def record(self, event, stream):
        self.calls.append(("record", event, stream))

    def wait(self, stream, event):
        self.calls.append(("wait", stream, event))

    def copy(self, *args):
        self.calls.append(("copy", *args))

    def upload(self, ptr, data):
        pass

    def download(self, ptr, out):
        out[:] = 0

    def replay(self, exe):
        self.calls.append(("replay", exe))


def _two_launch_graph(doubler):
    """(graph over a tiny model's step, a Recording of two chained doubler launches, the
    recorder's launches): the recording kept as the graph's one span."""
    from hf2q_mlx import cuda_graph_step
    from hf2q_mlx.decode_step import DecodeStep

    launch, n = doubler
    x = mx.random.normal((8,))
    mx.eval(x)
    recorded = _record(launch, n, x, 1, lambda y: y)
    with mx.stream(mx.cpu):
        step = DecodeStep(_tiny_generation_model(), 1, 16)
    graph = cuda_graph_step.CudaGraphStep(step)
    span = step._span(1)
    rec = cuda_graph_step.Recording(span, recorded.launches, mx.zeros((4,), mx.uint32), [])
    graph.recordings[span] = rec
    return graph, rec, recorded.launches


@pytest.mark.parametrize("pdl", ["0", "1", "2"])
def test_capture_with_programmatic_dependent_launches(doubler, monkeypatch, pdl):
    """HF2Q_GRAPH_PDL=1 / 2: the graph's kernels are compiled from units whose body begins with
    the grid-dependency wait (1: then the trigger; 2: the wait alone), under another symbol than
    the plain unit's, and launched with programmatic stream serialization; unset or 0: the
    plain units, plain launches."""
    from hf2q_mlx.custom_kernels import _render, cuda_cache

    monkeypatch.setenv("HF2Q_GRAPH_PDL", pdl)
    graph, rec, launches = _two_launch_graph(doubler)
    units = {}
    monkeypatch.setattr(
        cuda_cache, "cubin", lambda name, unit, force=False: units.setdefault(name, unit).encode()
    )
    graph.driver = drv = _FakeDriver()
    graph._capture(rec)
    plain = launches[0].spec.unit()
    assert len(units) == 1 and drv.pdl == [pdl != "0"] * 2
    ((name, unit),) = units.items()
    if pdl == "0":
        assert (name, unit) == plain and "griddepcontrol" not in unit
    else:
        assert name == plain[0] + {"1": "_pdl", "2": "_pdlw"}[pdl] and unit != plain[1]
        assert _render.PDL_PROLOGUES[int(pdl)] in unit
        # the wait comes before the body's first statement; the trigger only in mode 1
        assert unit.index("griddepcontrol.wait") < unit.index("const uint e")
        assert ("launch_dependents" in unit) == (pdl == "1")
    assert [c[1] for c in drv.calls if c[0] == "launch"] == [name, name]


def test_graph_pdl_switch(monkeypatch):
    """Unset: wait-only launches (2) on compute capability 9.0 and later with a driver that has
    cuLaunchKernelEx, else plain (0); set: its value; out of range: InvalidArgumentError."""
    from types import SimpleNamespace

    from hf2q_mlx import cuda_graph_step
    from hf2q_mlx.cuda_graph_step import graph_pdl
    from hf2q_mlx.errors import InvalidArgumentError

    monkeypatch.delenv("HF2Q_GRAPH_PDL", raising=False)
    for cc, want in ((None, 0), ((8, 0), 0), ((9, 0), 2), ((10, 0), 2)):
        monkeypatch.setattr(cuda_graph_step, "_compute_capability", lambda cc=cc: cc)
        assert graph_pdl() == want, cc
    assert graph_pdl(SimpleNamespace(_launch_ex=None)) == 0  # an old driver: plain launches
    assert graph_pdl(SimpleNamespace(_launch_ex=print)) == 2
    monkeypatch.setenv("HF2Q_GRAPH_PDL", "0")
    assert graph_pdl(SimpleNamespace(_launch_ex=print)) == 0
    for v in ("0", "1", "2"):
        monkeypatch.setenv("HF2Q_GRAPH_PDL", v)
        assert graph_pdl() == int(v)
    monkeypatch.setenv("HF2Q_GRAPH_PDL", "3")
    with pytest.raises(InvalidArgumentError, match="HF2Q_GRAPH_PDL"):
        graph_pdl()


def test_driver_launch_with_and_without_pdl():
    """Driver.launch: a plain launch through cuLaunchKernel; ``pdl`` through cuLaunchKernelEx
    with the grid, block, stream and the one PDL attribute in its config (a driver without
    cuLaunchKernelEx: CudaDriverError, plain launches unaffected). libcuda faked."""
    from hf2q_mlx.custom_kernels import cuda_driver as cd

    seen = []

    class Lib:
        def cuLaunchKernel(self, fn, *args):
            seen.append(("plain", fn, args[:6], args[7]))
            return 0

    def launch_ex(config_ref, fn, params, extra):
        c = config_ref._obj
        attr = c.attrs[0]
        seen.append(("ex", fn, tuple(c.grid), tuple(c.block), c.stream, c.num_attrs, attr.id,
                     attr.value.flag))  # fmt: skip
        return 0

    drv = cd.Driver.__new__(cd.Driver)
    drv.lib, drv.stream, drv._pdl, drv._launch_ex = Lib(), 77, cd._pdl_attrs(), launch_ex
    drv.launch("f", (3, 2, 1), (128, 1, 1), [16, 32])
    drv.launch("g", (5, 1, 1), (64, 1, 1), [48], stream=9, pdl=True)
    assert seen[0] == ("plain", "f", (3, 2, 1, 128, 1, 1), 77)
    assert seen[1] == ("ex", "g", (5, 1, 1), (64, 1, 1), 9, 1, 6, 1)
    drv._launch_ex = None
    with pytest.raises(cd.CudaDriverError, match="cuLaunchKernelEx"):
        drv.launch("g", (5, 1, 1), (64, 1, 1), [48], pdl=True)
    drv.launch("f", (1, 1, 1), (32, 1, 1), [8])
    assert seen[-1][0] == "plain"


def test_launch_config_matches_the_driver_abi():
    """The ctypes mirrors of CUlaunchAttribute / CUlaunchConfig (cuda.h, CUDA 12-13; x86-64 and
    aarch64 alike): sizes and offsets the driver reads, and the PDL attribute's id and value."""
    from hf2q_mlx.custom_kernels import cuda_driver as cd

    assert ctypes.sizeof(cd.LaunchAttr) == 72 and cd.LaunchAttr.value.offset == 8
    assert ctypes.sizeof(cd.LaunchConfig) == 56
    assert (cd.LaunchConfig.stream.offset, cd.LaunchConfig.attrs.offset) == (32, 40)
    assert cd.LaunchConfig.num_attrs.offset == 48
    attrs = cd._pdl_attrs()
    raw = bytes(attrs)
    assert len(raw) == 72 and raw[:4] == (6).to_bytes(4, "little") and raw[8:12] == b"\1\0\0\0"


def test_capture_resolves_every_address_first_and_debug_mode_names_a_failing_launch(
    doubler, monkeypatch, capsys
):
    """The capture calls nothing of MLX's (an MLX allocation inside a capture aborts the
    process: cudaMallocManaged while capturing, seen on the H200): every address is resolved
    before the capture begins, in the recording's launch order. HF2Q_GRAPH_DEBUG=1 launches the
    same work one launch at a time, each waited for, and names the launch that fails."""
    from hf2q_mlx import cuda_graph_step
    from hf2q_mlx.custom_kernels import cuda_cache, cuda_driver

    graph, rec, _ = _two_launch_graph(doubler)
    monkeypatch.setattr(cuda_cache, "cubin", lambda name, unit, force=False: b"cubin")
    drv = _FakeDriver()
    real_ptr = cuda_driver.data_ptr

    def checked_ptr(a):
        assert not drv.capturing, "data_ptr called inside the capture"
        return real_ptr(a)

    monkeypatch.setattr(cuda_graph_step, "data_ptr", checked_ptr)
    graph.driver = drv
    mx.eval(mx.random.normal((1 << 16,)) + 1)  # freed: MLX keeps its buffer in the cache
    assert mx.get_cache_memory() > 0
    graph._capture(rec)
    assert rec.exe == "exe" and len(rec.plan) == len(rec.launches) == 2
    # the device copies the address lookups freed go back (they would crowd managed weights)
    assert mx.get_cache_memory() == 0
    launched = [c for c in drv.calls if c[0] == "launch"]
    assert len(launched) == 2
    for (_, fn, ptrs), rl in zip(launched, rec.launches):
        assert fn == rl.spec.unit()[0]
        assert list(ptrs) == [real_ptr(a) for a in rl.inputs + rl.outputs]
    assert launched[1][2][0] == real_ptr(rec.launches[0].outputs[0])  # chained through memory

    monkeypatch.setenv("HF2Q_GRAPH_DEBUG", "1")
    graph.driver = _FakeDriver(fail_at=1)
    with pytest.raises(GraphCaptureError) as info:
        graph.decode([3])
    assert "launch 1 of 2 (graph_test_double, grid" in str(info.value)
    assert "illegal memory access" in str(info.value)
    # a launch that leaves a NaN (here: the fake launch leaves a poisoned output as it was)
    poisoned = rec.launches[1].outputs[0]
    nan = np.full(poisoned.size, np.nan, np.float32)
    ctypes.memmove(real_ptr(poisoned), nan.ctypes.data, nan.nbytes)
    graph.driver = _FakeDriver()
    assert graph.decode([3]) == [0]  # the fake download's ids
    err = capsys.readouterr().err
    assert "launch 1 (graph_test_double) wrote a NaN" in err and "launch 0" not in err
    calls = [c[0] for c in graph.driver.calls]
    assert "replay" not in calls and calls.count("launch") == 2 and calls.count("sync") >= 2
    monkeypatch.delenv("HF2Q_GRAPH_DEBUG")
    graph.driver = _FakeDriver()
    graph.decode([3])
    assert [c[0] for c in graph.driver.calls].count("replay") == 1


def test_decode_mode_defaults_to_the_graph_on_cuda(monkeypatch):
    """HF2Q_DECODE unset: the graph on CUDA, the compiled step on another GPU, eager on the
    CPU; an explicit mode wins; a bad one is a one-line error."""
    from hf2q_mlx import generation
    from hf2q_mlx.errors import InvalidArgumentError

    monkeypatch.delenv("HF2Q_DECODE", raising=False)
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    assert generation.decode_mode() == "graph"
    monkeypatch.setattr(mx.cuda, "is_available", lambda: False)
    assert generation.decode_mode() == "compiled"
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.cpu))
    assert generation.decode_mode() == "eager"
    monkeypatch.setenv("HF2Q_DECODE", "compiled")
    assert generation.decode_mode() == "compiled"
    monkeypatch.setenv("HF2Q_DECODE", "fast")
    with pytest.raises(InvalidArgumentError):
        generation.decode_mode()


def test_step_cache_changes_reach_the_graphs_buffers():
    """The serving engine records its graph before any prompt, then prefills, reuses prefixes
    and resets rows through the step (session 21: on the H200 the first replays read stale
    caches, then faulted). Every such change must land in the buffers whose addresses the graph
    holds: after ``_bind`` the step reads the graph's own buffers, holding what a step without
    a graph holds; and an in-place write into an array the step was handed cannot move the
    graph's buffers."""
    from hf2q_mlx.cuda_graph_step import CudaGraphStep
    from hf2q_mlx.custom_kernels.cuda_driver import data_ptr
    from hf2q_mlx.decode_step import DecodeStep

    model = _tiny_generation_model()
    with mx.stream(mx.cpu):
        step = DecodeStep(model, 2, 32)
    graph = CudaGraphStep(step)  # no driver: copies go through host memory on the CPU
    mine = [a for c in graph._caches for a in c]
    ptrs = [data_ptr(a) for a in mine]
    ids = [int(t) for t in np.random.default_rng(5).integers(1, 200, 11)]

    def check():
        computed = [_bits(a) for s in step.caches for a in s.arrays]  # what MLX made
        graph._bind()
        held = [a for s in step.caches for a in s.arrays]
        assert [data_ptr(a) for a in held] == ptrs  # the step reads the graph's buffers
        assert [data_ptr(a) for a in mine] == ptrs  # which never moved
        assert all(np.array_equal(_bits(a), b) for a, b in zip(mine, computed))

    step.prefill(0, ids)
    check()
    saved = step.save_row(0)
    step.load_row(1, saved)  # a prefix reused
    step.prefill(1, ids[:3])
    check()
    step.reset_row(0)
    check()
    assert step.positions == [0, 14]
    # rows were written into the graph's buffers in place: the step holds what it was handed
    assert all(a is h for s, hs in zip(step.caches, graph._handed) for a, h in zip(s.arrays, hs))
    spans = [(p, p + a.nbytes) for p, a in zip(ptrs, mine)]  # a saved row owns its memory
    assert not any(lo <= data_ptr(a) < hi for arrs in saved.arrays for a in arrs
                   for lo, hi in spans)  # fmt: skip
    handed = step.caches[0].arrays[0]
    handed[0] = mx.zeros(handed.shape[1:], handed.dtype)  # rebinds that object only
    assert data_ptr(graph._caches[0][0]) == ptrs[0]


def test_state_writes_fold_into_their_kernel_only_when_safe():
    """``fuse_state_writes`` drops a graph's end copy (new state over old) only where the kernel
    that made the new state read the old one as the input it declares it may overwrite
    (``Kernel.in_place``), and no other launch reads either array."""
    from types import SimpleNamespace

    from hf2q_mlx.cuda_graph_step import fuse_state_writes
    from hf2q_mlx.custom_kernels.launch_recorder import Launch

    ex = Example({"x": mx.float32, "s": mx.float32}, {"y": mx.float32, "s_new": mx.float32})
    step = Kernel("graph_test_state", ["x", "s"], ["y", "s_new"], _BODY, register=False,
                  examples=[ex], in_place={"s_new": "s"})  # fmt: skip
    plain = Kernel("graph_test_state_copy", ["x", "s"], ["y", "s_new"], _BODY, register=False,
                   examples=[ex])  # fmt: skip
    with pytest.raises(ValueError, match="in_place"):
        one = [Example({"x": mx.float32}, {"y": mx.float32})]
        Kernel("graph_test_bad", ["x"], ["y"], _BODY, register=False, examples=one,
               in_place={"y": "s"})  # fmt: skip
    x, s, y, s_new, other = (mx.random.normal((4,), key=mx.random.key(i)) for i in range(5))
    mx.eval(x, s, y, s_new, other)

    def launch(kernel, inputs):
        return Launch(SimpleNamespace(kernel=kernel), inputs, [y, s_new])

    launches, left = fuse_state_writes([launch(step, [x, s])], [(s, s_new)])
    assert left == [] and launches[0].in_place and launches[0].outputs[1] is s
    assert launches[0].outputs[0] is y  # the other output stays the recording's scratch
    for case in (
        [launch(plain, [x, s])],  # the kernel does not allow it
        [launch(step, [x, other])],  # it read another array
        [launch(step, [x, s]), Launch(SimpleNamespace(kernel=plain), [s, x], [other, other])],
        [launch(step, [x, s]), Launch(SimpleNamespace(kernel=plain), [s_new, x], [other, other])],
    ):  # ... or another launch reads the old state, or the new one
        launches, left = fuse_state_writes(case, [(s, s_new)])
        assert left == [(s, s_new)] and not launches[0].in_place


def test_graph_writes_a_step_row_in_place_as_set_row_would():
    """``CudaGraphStep._write_row`` (the step's ``row_writer``): a whole row, the first n slots
    of a row, a broadcast zero row: the graph's buffer gets the bytes ``_set_row`` would give a
    new array, in place (the same object and address); an array the graph did not hand over is
    left to ``_set_row``."""
    from hf2q_mlx.cuda_graph_step import CudaGraphStep
    from hf2q_mlx.custom_kernels.cuda_driver import data_ptr
    from hf2q_mlx.decode_step import DecodeStep, _set_row

    model = _tiny_generation_model()
    with mx.stream(mx.cpu):
        step = DecodeStep(model, 3, 32)
    graph = CudaGraphStep(step)
    # the longest KV cache (B, H, C, D): a full-attention layer's
    kv = max((a for s in step.caches for a in s.arrays if a.ndim == 4), key=lambda a: a.shape[2])
    B, H, C, D = kv.shape
    rng = np.random.default_rng(9)
    for row, n, value in (
        (1, None, rng.standard_normal((H, C, D))),
        (2, 5, rng.standard_normal((H, 5, D))),
        (0, None, np.zeros((1,))),
    ):
        value = mx.array(value.astype(np.float32))
        before = mx.array(np.array(kv.astype(mx.float32))).astype(kv.dtype)  # a copy
        ptr = data_ptr(kv)
        out = step._write_row(kv, row, value, n)
        assert out is kv and data_ptr(kv) == ptr
        want = _set_row(before, row, value.astype(kv.dtype), n)
        assert np.array_equal(_bits(kv), _bits(want))
    with pytest.raises(ValueError):  # more slots than the row has: refused, nothing written
        step._write_row(kv, 0, mx.ones((H, C + 1, D)), C + 1)
    other = mx.zeros_like(kv)
    assert graph._write_row(other, 0, mx.ones((H, C, D)), None) is None
    assert step._write_row(other, 0, mx.ones((H, C, D))) is not other


@pytest.mark.parametrize("lanes", [1, 2, 3, 4])
def test_lanes_order_every_dependency(lanes):
    """``schedule_lanes``: on random dependency graphs, each launch starts after all its
    dependencies (stream order on its lane, its waits, and what those imply), and a launch whose
    dependencies were all met by others' lanes may run on another lane (lanes get used)."""
    from hf2q_mlx.cuda_graph_step import schedule_lanes

    rng = np.random.default_rng(lanes)
    used = set()
    for _ in range(50):
        n = int(rng.integers(1, 40))
        deps = [set(int(j) for j in rng.choice(i, size=min(i, int(rng.integers(0, 4))),
                                                replace=False)) if i else set()
                for i in range(n)]  # fmt: skip
        sched = schedule_lanes(deps, lanes)
        assert len(sched) == n and all(0 <= lane < lanes for lane, _ in sched)
        done: list[set[int]] = []  # per launch: the launches known finished when it starts
        last_on: dict[int, int] = {}
        for i, (lane, waits) in enumerate(sched):
            known = set()
            if lane in last_on:
                j = last_on[lane]
                known |= done[j] | {j}
            for j in waits:
                known |= done[j] | {j}
            assert deps[i] <= known, (i, deps[i], known)
            done.append(known)
            last_on[lane] = i
            used.add(lane)
    assert used == set(range(lanes))


def test_graph_lanes_reads_its_switch(monkeypatch):
    from hf2q_mlx.cuda_graph_step import graph_lanes
    from hf2q_mlx.errors import InvalidArgumentError

    monkeypatch.delenv("HF2Q_GRAPH_LANES", raising=False)
    assert graph_lanes() == 1
    monkeypatch.setenv("HF2Q_GRAPH_LANES", " 4 ")
    assert graph_lanes() == 4
    for bad in ("0", "9", "two", "-1"):
        monkeypatch.setenv("HF2Q_GRAPH_LANES", bad)
        with pytest.raises(InvalidArgumentError, match="HF2Q_GRAPH_LANES"):
            graph_lanes()


def test_capture_over_lanes_orders_every_dependency(doubler, monkeypatch):
    """HF2Q_GRAPH_LANES=2 on a diamond of launches (A; B and C read A's output; D reads B's, E
    reads C's): C goes to the second lane, which joins the capture from its start and rejoins
    it at the end; replaying the driver's calls (stream order, event records and waits) runs
    every launch after the launches it depends on, with both lanes used."""
    from types import SimpleNamespace

    from hf2q_mlx import cuda_graph_step
    from hf2q_mlx.custom_kernels import cuda_cache
    from hf2q_mlx.custom_kernels.cuda_driver import data_ptr
    from hf2q_mlx.custom_kernels.launch_recorder import Launch
    from hf2q_mlx.decode_step import DecodeStep

    launch, n = doubler
    spec = _record(launch, n, mx.ones((8,)), 1, lambda y: y).launches[0].spec
    a, b, c, d, e, x = (mx.random.normal((8,), key=mx.random.key(i)) for i in range(6))
    mx.eval(a, b, c, d, e, x)
    launches = [Launch(spec, [src, n], [dst]) for src, dst in
                ((x, a), (a, b), (a, c), (b, d), (c, e))]  # fmt: skip
    deps = cuda_graph_step.launch_dependencies(launches)
    assert deps == [set(), {0}, {0}, {1}, {2}]
    with mx.stream(mx.cpu):
        step = DecodeStep(_tiny_generation_model(), 1, 16)
    graph = cuda_graph_step.CudaGraphStep(step)
    rec = cuda_graph_step.Recording(16, launches, mx.zeros((4,), mx.uint32), [])
    monkeypatch.setattr(cuda_cache, "cubin", lambda name, unit, force=False: b"cubin")
    monkeypatch.setenv("HF2Q_GRAPH_LANES", "2")
    graph.driver = drv = _FakeDriver()
    graph._capture(rec)
    assert rec.lanes == 2 and set(drv.lanes) == {"s0", "s1"}
    out_of = {data_ptr(launch.outputs[0]): i for i, launch in enumerate(launches)}
    done = {"s0": set(), "s1": set()}  # what each stream has finished, as its work is queued
    events, joined = {}, SimpleNamespace(s1=False)
    k = 0
    for call in drv.calls:
        if call[0] == "record":
            events[call[1]] = set(done[call[2]])
        elif call[0] == "wait":
            done[call[1]] |= events[call[2]]
            joined.s1 |= call[1] == "s0" and events[call[2]] >= done["s1"]
        elif call[0] == "launch":
            i, lane = out_of[call[2][-1]], drv.lanes[k]
            k += 1
            assert deps[i] <= done[lane], (i, lane, done)
            done[lane].add(i)
    assert done["s0"] == set(range(5)) and joined.s1  # the second lane rejoined the first


def test_graph_step_refuses_a_gpu_whose_arrays_reach_the_host_as_pinned_memory(monkeypatch, capsys):
    """Where MLX hands an array's address to the host as pinned host memory (a GPU without
    concurrent managed access), the graph would move every weight there (an H100 in session 38
    decoded 31B at 0.5 tok/s): CudaGraphStep refuses after asking about one small input buffer,
    before any weight's address, and stream_generate decodes through the compiled step with the
    same tokens (the reason said on stderr when HF2Q_DECODE=graph was asked for)."""
    from conftest import IdsTokenizer

    from hf2q_mlx import cuda_graph_step, generation
    from hf2q_mlx.custom_kernels import cuda_driver
    from hf2q_mlx.decode_step import DecodeStep

    asked = []
    real_ptr = cuda_driver.data_ptr
    monkeypatch.setattr(cuda_graph_step, "data_ptr", lambda a: asked.append(a) or real_ptr(a))
    with mx.stream(mx.cpu):
        step = DecodeStep(_tiny_generation_model(), 1, 16)
        drv = _FakeDriver(managed=False)
        with pytest.raises(GraphCaptureError, match="pinned host memory"):
            cuda_graph_step.CudaGraphStep(step, drv)
        assert len(asked) == 1 and asked[0].size <= 16 and len(drv.asked) == 1
        cuda_graph_step.CudaGraphStep(step, _FakeDriver(managed=True))  # managed: accepted

        def run():
            model = _tiny_generation_model()
            rs = generation.stream_generate(model, IdsTokenizer(), [5, 9, 2, 7], max_tokens=5,
                                            ignore_eos=True)  # fmt: skip
            return [r.token for r in rs]

        monkeypatch.setenv("HF2Q_DECODE", "compiled")
        want = run()
        monkeypatch.setattr(cuda_driver, "Driver", lambda: _FakeDriver(managed=False))
        monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
        monkeypatch.setenv("HF2Q_DECODE", "graph")
        capsys.readouterr()
        assert run() == want
        assert "pinned host memory" in capsys.readouterr().err


@pytest.mark.parametrize("on", ["", "1"])
def test_capture_prefetches_the_graphs_buffers_when_asked(doubler, monkeypatch, on):
    """HF2Q_GRAPH_PREFETCH=1: after the capture, each distinct buffer the graph's launches read
    or write is prefetched to the device once, with its size, then the stream synchronized;
    unset: nothing prefetched."""
    from hf2q_mlx.custom_kernels import cuda_cache, cuda_driver

    monkeypatch.setenv("HF2Q_GRAPH_PREFETCH", on)
    graph, rec, _ = _two_launch_graph(doubler)
    monkeypatch.setattr(cuda_cache, "cubin", lambda name, unit, force=False: b"cubin")
    graph.driver = drv = _FakeDriver()
    graph._capture(rec)
    got = [c[1:] for c in drv.calls if c[0] == "prefetch"]
    if not on:
        assert got == []
        return
    arrays = [a for launch in rec.launches for a in launch.inputs + launch.outputs]
    want = {}
    for a in arrays:
        p = cuda_driver.data_ptr(a)
        want[p] = max(want.get(p, 0), a.nbytes)
    assert sorted(got) == sorted(want.items()) and len(want) == 4  # x, n, the middle, the output
    last = max(i for i, c in enumerate(drv.calls) if c[0] == "prefetch")
    assert ("sync",) in drv.calls[last:]
