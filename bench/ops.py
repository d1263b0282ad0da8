"""Per-op latency of the fused hot-op kernels against the unfused MLX sequences they replace.

Each case is timed two ways, median of several trials after a warm-up: "call" = build the op's
graph and evaluate it (one op per evaluation: launch and sync costs included), "chained" = 32
independent applications evaluated together (per application: closer to an op's share of a
decode step, which is one evaluation of the whole graph). Prints a table, then writes JSON.

    python bench/ops.py [--json ops.json] [--quick]
    python bench/ops.py --overhead     # CUDA only: where a custom kernel's launch cost goes
    python bench/ops.py --host         # any machine: host (Python) time of each dispatcher
    python bench/ops.py --decode-ops   # graph nodes of one decode step, kernels vs reference

On a machine without a GPU back end every dispatcher takes its reference path, so the plain
mode only shows that the script runs. ``--host`` stubs MLX's CUDA side (``mx.cuda.is_available``,
the default device, ``mx.fast.cuda_kernel`` returning ready-made outputs) so the dispatchers'
GPU-path Python runs anywhere: it measures graph-building time, not kernels.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
from gguf import GGMLQuantizationType as GT

from hf2q_mlx.custom_kernels import backend
from hf2q_mlx.custom_kernels.activations import gated_activation
from hf2q_mlx.custom_kernels.lm_head_topk import lm_head_topk
from hf2q_mlx.custom_kernels.qmatmul import ggml_matmul
from hf2q_mlx.custom_kernels.residual_rms_norm import residual_rms_norm
from hf2q_mlx.custom_kernels.rms_norm_rope import qk_norm_rope, rms_norm_rope, rope_inv_freq
from hf2q_mlx.custom_kernels.sampling import topk
from hf2q_mlx.custom_kernels.softcap import softcap
from hf2q_mlx.io.random_weights import random_ggml_blocks

CHAIN = 32


def _time(fn: Callable[[], object], reps: int, chain: int) -> float:
    """Median microseconds per application over ``reps`` trials of ``chain`` applications."""
    mx.eval(fn())  # warm-up: kernel builds
    trials = []
    for _ in range(reps):
        mx.synchronize()
        start = time.perf_counter()
        mx.eval([fn() for _ in range(chain)])
        mx.synchronize()
        trials.append((time.perf_counter() - start) * 1e6 / chain)
    return statistics.median(trials)


def _build_time(fn: Callable[[], object], reps: int, chain: int) -> float:
    """Median microseconds to build (not evaluate) one application's graph: the host-side share."""
    trials = []
    for _ in range(reps):
        start = time.perf_counter()
        outs = [fn() for _ in range(chain)]
        trials.append((time.perf_counter() - start) * 1e6 / chain)
        mx.eval(outs)
    return statistics.median(trials)


# MLX's CUDA back end records ops into CUDA graphs of at most MLX_MAX_OPS_PER_BUFFER nodes.
GRAPH_VARIABLES = ("MLX_MAX_OPS_PER_BUFFER", "MLX_USE_CUDA_GRAPHS", "MLX_CUDA_GRAPH_CACHE_SIZE")


def _normal(shape, dtype=mx.bfloat16, seed=0, scale=1.0):
    return (mx.random.normal(shape, key=mx.random.key(seed)) * scale).astype(dtype)


def cases(quick: bool) -> list[tuple[str, str, Callable, Callable]]:
    """(op, shape, fused, unfused) closures over fresh bf16 inputs."""
    out = []
    dt = mx.bfloat16
    norm_rope = [
        ("Gemma 3 270M", 4, 1, 256, 256, 256, False),
        ("Gemma 4 global (q, k, v)", 16, 4, 512, 512, 512, True),
        ("Qwen 3.5 [q | gate]", 16, 4, 256, 64, 512, False),
    ]
    for name, hq, hk, D, R, P, with_v in norm_rope[:1] if quick else norm_rope:
        q, k = _normal((1, 1, hq, P), dt, 1), _normal((1, 1, hk, D), dt, 2)
        v = _normal((1, 1, hk, D), dt, 3) if with_v else None
        wq, wk = _normal((D,), dt, 4), _normal((D,), dt, 5)
        inv, off = rope_inv_freq(R, 1e6), mx.array(4000)

        def fused(q=q, k=k, v=v, wq=wq, wk=wk, inv=inv, off=off, D=D):
            return qk_norm_rope(q, k, wq, wk, inv, eps=1e-6, offset=off, dims=D, v=v)

        def unfused(q=q, k=k, v=v, wq=wq, wk=wk, off=off, D=D, R=R):
            qn = mx.fast.rms_norm(q[..., :D], wq, 1e-6).transpose(0, 2, 1, 3)
            kn = mx.fast.rms_norm(k, wk, 1e-6).transpose(0, 2, 1, 3)
            rope = dict(traditional=False, base=1e6, scale=1.0, offset=off)
            outs = [mx.fast.rope(qn, R, **rope), mx.fast.rope(kn, R, **rope)]
            if v is not None:
                outs.append(mx.fast.rms_norm(v, None, 1e-6).transpose(0, 2, 1, 3))
            return outs

        out.append(("qk_norm_rope", name, fused, unfused))
    for H in (640,) if quick else (640, 2816, 5376):
        x, r, w = _normal((1, 1, H), dt, 6), _normal((1, 1, H), dt, 7), _normal((H,), dt, 8)

        def unfused_res(x=x, r=r, w=w):
            h = x + r
            return h, mx.fast.rms_norm(h, w, 1e-6)

        out.append(
            (
                "residual_rms_norm",
                f"H={H}",
                lambda x=x, r=r, w=w: residual_rms_norm(x, r, w, 1e-6),
                unfused_res,
            )
        )
    glu = mx.compile(lambda g, u: nn.gelu_approx(g) * u, shapeless=True)
    for I in (2048,) if quick else (2048, 6144, 21504):
        gu = _normal((1, 1, 2 * I), dt, 9)
        g, u = gu[..., :I], gu[..., I:]
        out.append(("gelu_tanh_mul fused gate_up", f"I={I}",
                    lambda gu=gu: gated_activation(gu, None, "gelu_tanh"),
                    lambda g=g, u=u: nn.gelu_approx(g) * u))  # fmt: skip
        out.append(("gelu_tanh_mul vs mx.compile", f"I={I}",
                    lambda gu=gu: gated_activation(gu, None, "gelu_tanh"),
                    lambda g=g, u=u: glu(g, u)))  # fmt: skip
    V = 262144
    logits = _normal((1, V), mx.float32, 10, 8.0)
    out.append(("softcap", f"V={V}", lambda: softcap(logits, 30.0),
                lambda: mx.tanh(logits / 30.0) * 30.0))  # fmt: skip
    for B, k in ((1, 1), (1, 40), (16, 1), (16, 64)):
        lg = _normal((B, V), mx.float32, 11 + B, 8.0)
        if k == 1:
            out.append(("top-1 (topk kernel, k=1)", f"B={B} V={V}", lambda lg=lg: topk(lg, 1),
                        lambda lg=lg: mx.argmax(lg, axis=-1)))  # fmt: skip
        else:
            out.append(("topk", f"B={B} V={V} k={k}", lambda lg=lg, k=k: topk(lg, k),
                        lambda lg=lg, k=k: mx.topk(lg, k, axis=-1)))  # fmt: skip
        if quick:
            break
    H, V = 640, 32000 if quick else V
    xh = _normal((1, H), dt, 12)
    wq8 = random_ggml_blocks(V, H, GT.Q8_0, seed=1)
    wbf = _normal((V, H), dt, 13, 0.05)
    for name, w, gtype in (("Q8_0", wq8, GT.Q8_0), ("bf16", wbf, None)):

        def head(x=xh, w=w, gtype=gtype, rerank=True):
            return lm_head_topk(x, w, 1, softcap=30.0, ggml_type=gtype, rerank=rerank)

        def plain(x=xh, w=w, gtype=gtype):
            lg = ggml_matmul(x, w, gtype, H) if gtype is not None else x @ w.T
            return mx.argmax(mx.tanh(lg.astype(mx.float32) / 30.0) * 30.0, axis=-1)

        out.append((f"lm_head greedy {name} (exact rerank)", f"V={V} H={H}", head, plain))
        out.append((f"lm_head greedy {name} (no rerank)", f"V={V} H={H}",
                    lambda head=head: head(rerank=False), plain))  # fmt: skip
    return out


def overhead_cases() -> list[tuple[str, Callable]]:
    """Where a custom kernel's per-launch cost goes: a built-in op, a bare ``cuda_kernel`` copy,
    the same with the shared vocabulary header and a template, through ``_render.Kernel``, and a
    full dispatcher (CUDA only)."""
    from hf2q_mlx.custom_kernels import _render

    x = _normal((1, 640), mx.bfloat16, 20)
    src = "const unsigned i = threadIdx.x + blockIdx.x * blockDim.x; if (i < 640) out[i] = inp[i];"
    common = dict(input_names=["inp"], output_names=["out"], source=src)
    bare = mx.fast.cuda_kernel(name="hq_bench_copy", **common)
    vocab = mx.fast.cuda_kernel(name="hq_bench_copy_vocab", header=_render.CUDA_HEADER, **common)
    body = "const uint i = pos_x; if (i < 640u) out[i] = inp[i];"
    example = _render.Example({"inp": mx.bfloat16}, {"out": mx.bfloat16})
    wrapped = _render.Kernel("bench_copy", ["inp"], ["out"], body, register=False,
                             examples=[example])  # fmt: skip
    launch = dict(grid=(640, 1, 1), threadgroup=(128, 1, 1), output_shapes=[x.shape],
                  output_dtypes=[x.dtype])  # fmt: skip
    w = _normal((640,), mx.bfloat16, 21)
    q, k = _normal((1, 1, 4, 256), mx.bfloat16, 22), _normal((1, 1, 1, 256), mx.bfloat16, 23)
    wd, inv, off = _normal((256,), mx.bfloat16, 24), rope_inv_freq(256, 1e6), mx.array([9])
    gu = _normal((1, 1, 4096), mx.bfloat16, 25)
    return [
        ("built-in x + 1", lambda: x + 1),
        ("built-in mx.fast.rms_norm", lambda: mx.fast.rms_norm(x, w, 1e-6)),
        ("bare cuda_kernel copy", lambda: bare(inputs=[x], **launch)[0]),
        ("cuda_kernel + vocabulary header", lambda: vocab(inputs=[x], **launch)[0]),
        ("cuda_kernel + header + template",
         lambda: vocab(inputs=[x], template=[("T", mx.bfloat16)], **launch)[0]),
        ("_render.Kernel copy", lambda: wrapped([x], **launch, template={"T": mx.bfloat16})[0]),
        ("residual_rms_norm dispatcher", lambda: residual_rms_norm(x, x, w, 1e-6)[1]),
        ("qk_norm_rope dispatcher (Gemma 3 270M)",
         lambda: qk_norm_rope(q, k, wd, wd, inv, eps=1e-6, offset=off, dims=256)[0]),
        ("gated_activation dispatcher (fused gate_up)",
         lambda: gated_activation(gu, None, "gelu_tanh")),
        ("softcap dispatcher", lambda: softcap(x, 30.0)),
        # 32 dependent applications (a decode step is a serial chain); the time is for all 32
        ("serial x32 built-in x + 1", lambda: _serial(lambda y: y + 1, x)),
        ("serial x32 bare cuda_kernel copy",
         lambda: _serial(lambda y: bare(inputs=[y], **launch)[0], x)),
    ]  # fmt: skip


def _serial(f: Callable[[mx.array], mx.array], x: mx.array, n: int = 32) -> mx.array:
    for _ in range(n):
        x = f(x)
    return x


class _StubKernel:
    """Stands in for an ``mx.fast.cuda_kernel`` object: returns cached zero outputs; ``link``:
    through one ``mx.depends`` node on the inputs (a graph node per launch, for op counts)."""

    def __init__(self, link: bool = False, **_):
        self._outs: dict = {}
        self._link = link

    def __call__(self, *, inputs, output_shapes, output_dtypes, **_):
        key = (tuple(map(tuple, output_shapes)), tuple(output_dtypes))
        outs = self._outs.get(key)
        if outs is None:
            outs = self._outs[key] = [mx.zeros(s, d) for s, d in zip(*key)]
            mx.eval(outs)
        return mx.depends(outs, list(inputs)) if self._link else outs


def install_host_stubs(link: bool = False) -> Callable[[], None]:
    """Make this process look like MLX's CUDA back end to our Python (ops still run on the
    CPU): returns a function that undoes it."""
    import hf2q_mlx.custom_kernels as ck

    gpu = mx.Device(mx.DeviceType.gpu)
    saved = [(mx.cuda, "is_available"), (mx, "default_device"), (mx.fast, "cuda_kernel")]
    saved = [(obj, name, getattr(obj, name)) for obj, name in saved]
    mx.cuda.is_available = lambda: True
    mx.default_device = lambda: gpu
    mx.fast.cuda_kernel = lambda **kw: _StubKernel(link, **kw)
    refresh = getattr(ck, "refresh", lambda: None)
    refresh()

    def undo() -> None:
        for obj, name, value in saved:
            setattr(obj, name, value)
        refresh()

    return undo


def host_cases() -> list[tuple[str, Callable]]:
    """Graph-building cost of each dispatcher at decode shapes (bf16), next to built-ins."""
    from hf2q_mlx.custom_kernels import _render

    dt = mx.bfloat16
    x = _normal((1, 1, 640), dt, 20)
    w = _normal((640,), dt, 21)
    body = "const uint i = pos_x; if (i < 640u) out[i] = inp[i];"
    example = _render.Example({"inp": dt}, {"out": dt})
    copy = _render.Kernel("bench_host_copy", ["inp"], ["out"], body, register=False,
                          examples=[example])  # fmt: skip
    stub = _StubKernel()
    launch = dict(grid=(640, 1, 1), threadgroup=(128, 1, 1), output_shapes=[x.shape],
                  output_dtypes=[dt])  # fmt: skip
    off = mx.array([4000], dtype=mx.int32)
    cases = [
        ("built-in x + 1", lambda: x + 1),
        ("built-in mx.fast.rms_norm", lambda: mx.fast.rms_norm(x, w, 1e-6)),
        ("stub kernel object (floor)", lambda: stub(inputs=[x], template=[("T", dt)], **launch)),
        ("backend()", backend),
        ("_render.Kernel copy", lambda: copy([x], **launch, template={"T": dt})[0]),
    ]
    for name, hq, hk, D, R, P, with_v in (
        ("Gemma 3 270M", 4, 1, 256, 256, 256, False),
        ("Gemma 4 global (q, k, v)", 16, 4, 512, 512, 512, True),
        ("Qwen 3.5 [q | gate]", 16, 4, 256, 64, 512, False),
    ):
        q, k = _normal((1, 1, hq, P), dt, 1), _normal((1, 1, hk, D), dt, 2)
        v = _normal((1, 1, hk, D), dt, 3) if with_v else None
        wq, wk = _normal((D,), dt, 4), _normal((D,), dt, 5)
        inv = rope_inv_freq(R, 1e6)
        cases.append((f"qk_norm_rope {name}",
                      lambda q=q, k=k, v=v, wq=wq, wk=wk, inv=inv, D=D: qk_norm_rope(
                          q, k, wq, wk, inv, eps=1e-6, offset=off, dims=D, v=v)))  # fmt: skip
    cases.append(("rms_norm_rope (q only)",
                  lambda: rms_norm_rope(q, wq, inv, eps=1e-6, offset=off, dims=256)))  # fmt: skip
    cases.append(("residual_rms_norm H=640", lambda: residual_rms_norm(x, x, w, 1e-6)))
    gu = _normal((1, 1, 2 * 2048), dt, 9)
    g, u = _normal((1, 1, 2048), dt, 10), _normal((1, 1, 2048), dt, 11)
    cases.append(
        ("gated_activation fused gate_up", lambda: gated_activation(gu, None, "gelu_tanh"))
    )
    cases.append(("gated_activation gate, up", lambda: gated_activation(g, u, "silu")))
    logits = _normal((1, 1, 262144), mx.float32, 12)
    cases.append(("softcap V=262144", lambda: softcap(logits, 30.0)))
    return cases


def run_host(path: str) -> None:
    undo = install_host_stubs()
    try:
        print(f"host time per call (graph building, stubbed CUDA kernels), microseconds; "
              f"backend() = {backend()!r}")  # fmt: skip
        rows = []
        for name, fn in host_cases():
            for _ in range(200):  # warm-up: builds, caches
                fn()
            trials = []
            for _ in range(15):
                start = time.perf_counter()
                for _ in range(200):
                    fn()
                trials.append((time.perf_counter() - start) * 1e6 / 200)
            t = statistics.median(trials)
            rows.append({"case": name, "host_us": round(t, 3)})
            print(f"{name:<44} {t:8.2f} us", flush=True)
    finally:
        undo()
    with open(path, "w") as f:
        out = {"mode": "host", "platform": platform.platform(), "mlx_version": mx.__version__,
               "python": platform.python_version(), "rows": rows}  # fmt: skip
        json.dump(out, f, indent=1)
    print(f"wrote {path}")


S, F = "sliding_attention", "full_attention"
# scaled-down layer stacks with real head geometry (head dims the kernels cover)
DECODE_MODELS = {
    "gemma3": ("gemma3", dict(
        vocab_size=2048, hidden_size=640, intermediate_size=2048, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
        query_pre_attn_scalar=256,
    )),
    "llama": ("llama", dict(
        vocab_size=2048, hidden_size=576, intermediate_size=1536, num_hidden_layers=6,
        num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
    )),
    "gemma4": ("gemma4", dict(
        vocab_size=2048, hidden_size=512, intermediate_size=1024, num_hidden_layers=6,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, global_head_dim=512,
        attention_k_eq_v=True, num_global_key_value_heads=1, hidden_size_per_layer_input=0,
        final_logit_softcapping=30.0,
    )),
    "gemma4_moe": ("gemma4", dict(
        vocab_size=2048, hidden_size=512, intermediate_size=1024, num_hidden_layers=6,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, global_head_dim=512,
        attention_k_eq_v=True, num_global_key_value_heads=1, hidden_size_per_layer_input=0,
        final_logit_softcapping=30.0, enable_moe_block=True, num_experts=16, top_k_experts=4,
        moe_intermediate_size=256,
    )),
    "qwen3_5": ("qwen3_5", dict(
        vocab_size=2048, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=4,
        linear_num_value_heads=8, tie_word_embeddings=True,
    )),
    "qwen3_5_moe": ("qwen3_5_moe", dict(
        vocab_size=2048, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, head_dim=256, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=4, linear_num_value_heads=8, num_experts=16,
        num_experts_per_tok=4, moe_intermediate_size=256, shared_expert_intermediate_size=512,
    )),
}  # fmt: skip


def fast_ops_as_one_node() -> Callable[[], None]:
    """On the CPU mx.fast.rms_norm / rope / scaled_dot_product_attention expand into many
    primitives; on a GPU each is one. Replace them by one node of the right shape (wrong
    values: for counting only). Returns the undo."""
    zeros: dict = {}

    def one_node(shape, dtype, *deps):
        z = zeros.get((shape, dtype))
        if z is None:
            z = zeros[(shape, dtype)] = mx.zeros(shape, dtype)
            mx.eval(z)
        return mx.depends([z], [d for d in deps if isinstance(d, mx.array)])[0]

    saved = {n: getattr(mx.fast, n) for n in ("rms_norm", "rope", "scaled_dot_product_attention")}
    # one elementwise node where shapeless mx.compile traces them (Depends cannot)
    mx.fast.rms_norm = lambda x, w, eps, **_: x * w if w is not None else x * 1.0
    mx.fast.rope = lambda x, *a, **k: x * 1.0
    mx.fast.scaled_dot_product_attention = lambda q, k, v, **kw: one_node(
        (*q.shape[:-1], v.shape[-1]), q.dtype, q, k, v, kw.get("mask")
    )

    def undo() -> None:
        for n, f in saved.items():
            setattr(mx.fast, n, f)

    return undo


# graph nodes that are views (no kernel when their input is contiguous)
VIEW_PRIMITIVES = {"Transpose", "Reshape", "Flatten", "Unflatten", "ExpandDims", "Squeeze",
                   "Broadcast", "Slice", "AsStrided", "Split"}  # fmt: skip


def decode_step_nodes(model, prompt: list[int]) -> list[str]:
    """Primitive names in the graph of one decode step after prefilling ``prompt`` (what
    hf2q_mlx.cli.bench.decode_step_ops counts, with the names)."""
    import io
    import re

    from hf2q_mlx.generation import make_prompt_cache, prefill

    cache = make_prompt_cache(model)
    mx.eval(prefill(model, mx.array(prompt, mx.int32), cache))
    logits = model(mx.array([[prompt[-1]]], mx.int32), cache=cache)
    dot = io.StringIO()
    mx.export_to_dot(dot, mx.argmax(logits[:, -1, :], axis=-1))
    return re.findall(r'label ="([^"]+)", shape=rectangle', dot.getvalue())


def run_decode_ops(path: str) -> None:
    """Graph nodes of one decode step (hf2q_mlx.cli.bench.decode_step_ops) per tiny model, with
    kernels and under reference_only(). Without a GPU the kernel path runs on stubs (each
    launch one ``Depends`` node) and mx.fast ops count one node each as on a GPU
    (``fast_ops_as_one_node``): node counts, an upper bound on launches (a compiled function
    is one node but may launch several kernels)."""
    import importlib

    from hf2q_mlx.custom_kernels import reference_only

    stub = backend() is None
    rows = []
    print(f"decode-step graph nodes, reference_only() -> kernels "
          f"({'stubbed kernels, CPU' if stub else backend()})")  # fmt: skip
    undo_fast = fast_ops_as_one_node() if stub else (lambda: None)
    for name, (module, cfg) in DECODE_MODELS.items():
        mod = importlib.import_module(f"hf2q_mlx.models.{module}")
        model = mod.Model(mod.ModelArgs.from_dict(cfg))
        mx.eval(model.parameters())
        if hasattr(model, "fuse_projections"):  # as the loader does
            model.fuse_projections()
        row = {"model": name, "layers": len(model.layers)}
        for compiled in (True, False):
            if not compiled:  # compiled functions count one node but may launch several
                mx.disable_compile()
            with reference_only():
                ref = decode_step_nodes(model, [1, 2, 3, 4])
            undo = install_host_stubs(link=True) if stub else (lambda: None)
            try:
                ker = decode_step_nodes(model, [1, 2, 3, 4])
            finally:
                undo()
                mx.enable_compile()
            sfx = "" if compiled else "_uncompiled"
            for kind, labels in (("reference", ref), ("kernels", ker)):
                row[f"{kind}_nodes{sfx}"] = len(labels)
                row[f"{kind}_compute{sfx}"] = sum(lb not in VIEW_PRIMITIVES for lb in labels)
        rows.append(row)
        print(f"{name:<12} {row['layers']:2d} layers | all nodes {row['reference_nodes']:4d} -> "
              f"{row['kernels_nodes']:4d} | compute {row['reference_compute']:4d} -> "
              f"{row['kernels_compute']:4d} | compute, mx.compile off "
              f"{row['reference_compute_uncompiled']:4d} -> {row['kernels_compute_uncompiled']:4d}",
              flush=True)  # fmt: skip
    undo_fast()
    with open(path, "w") as f:
        json.dump({"mode": "decode-ops", "stubbed": stub, "device": str(mx.default_device()),
                   "rows": rows}, f, indent=1)  # fmt: skip
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="ops.json", help="where to write the results")
    ap.add_argument("--quick", action="store_true", help="a few cases, few trials (smoke test)")
    ap.add_argument("--overhead", action="store_true", help="only the per-launch cost breakdown")
    ap.add_argument("--host", action="store_true", help="host time of the dispatchers (stubbed)")
    ap.add_argument("--decode-ops", action="store_true", help="graph nodes of one decode step")
    args = ap.parse_args()
    if args.host:
        run_host(args.json)
        return
    if args.decode_ops:
        run_decode_ops(args.json)
        return
    if args.overhead:
        if backend() != "cuda":
            raise SystemExit("--overhead needs MLX's CUDA back end")
        rows = []
        env = {k: os.environ.get(k) for k in GRAPH_VARIABLES}
        print(f"graph settings: {env}")
        for name, fn in overhead_cases():
            t = {
                "call_us": _time(fn, 9, 1),
                "chained_us": _time(fn, 9, CHAIN),
                "build_us": _build_time(fn, 9, CHAIN),
            }
            rows.append({"case": name, **{k: round(v, 2) for k, v in t.items()}})
            print(f"{name:<36} call {t['call_us']:8.1f} us   chained {t['chained_us']:8.1f} us"
                  f"   graph build only {t['build_us']:6.1f} us", flush=True)  # fmt: skip
        with open(args.json, "w") as f:
            out = {"device": str(mx.default_device()), "env": env, "overhead": rows}
            json.dump(out, f, indent=1)
        return
    reps = 3 if args.quick else 9
    rows = []
    header = (f"{'op':<38} {'shape':<26} {'fused call':>10} {'unfused':>9} "
              f"{'fused ch.':>9} {'unfused':>9} {'x (ch.)':>7}")  # fmt: skip
    print(f"device {mx.default_device()}, kernels: {backend() or 'reference'}; microseconds")
    print(header)
    for op, shape, fused, unfused in cases(args.quick):
        t = {
            "fused_call_us": _time(fused, reps, 1),
            "unfused_call_us": _time(unfused, reps, 1),
            "fused_chained_us": _time(fused, reps, 2 if args.quick else CHAIN),
            "unfused_chained_us": _time(unfused, reps, 2 if args.quick else CHAIN),
        }
        speedup = (
            t["unfused_chained_us"] / t["fused_chained_us"] if t["fused_chained_us"] else math.nan
        )
        rows.append({"op": op, "shape": shape, **{k: round(v, 2) for k, v in t.items()},
                     "speedup_chained": round(speedup, 2)})  # fmt: skip
        print(f"{op:<38} {shape:<26} {t['fused_call_us']:>10.1f} {t['unfused_call_us']:>9.1f} "
              f"{t['fused_chained_us']:>9.1f} {t['unfused_chained_us']:>9.1f} {speedup:>7.2f}",
              flush=True)  # fmt: skip
    result = {
        "device": str(mx.default_device()),
        "kernels": backend() or "reference",
        "mlx_version": mx.__version__,
        "platform": platform.platform(),
        "rows": rows,
    }
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
