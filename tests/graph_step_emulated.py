"""A CudaGraphStep recording replayed on the CPU through the kernel emulator, next to the MLX
step with the same kernels emulated: prints JSON (tokens, caches equal). Run in a process of its
own by tests/test_cuda_graph_step.py: the fake CUDA back end it installs stays in the kernel
dispatchers' plan caches.

    python3 tests/graph_step_emulated.py gemma4:tiny-moe [--layers 2] [--window 2] [--steps 3]
        [--batch 1] [--prefill 0] [--kv-bits 8] [--format q4_k|mlx4|mlx4-q4_1|bf16] [--split-k 2]
        [--split-fused]
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import random
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "kernels"))
sys.path.insert(0, str(HERE.parent / "bench"))

import kernel_emulator  # noqa: E402
from decode_profile import _bench_module  # noqa: E402
from jit_lengths import install_fake_cuda  # noqa: E402

from hf2q_mlx.cuda_graph_step import (  # noqa: E402
    CudaGraphStep,
    launch_dependencies,
    schedule_lanes,
)
from hf2q_mlx.custom_kernels.cuda_driver import data_ptr  # noqa: E402
from hf2q_mlx.decode_step import DecodeStep  # noqa: E402


def fake_cuda() -> None:
    """Dispatchers take their CUDA branch on the CPU; MLX's kernel objects run the emulator."""

    def fake_kernel_for(self, backend, sig):
        def launch(*, inputs, template=None, grid, threadgroup, output_shapes, output_dtypes,
                   init_value=None, verbose=False):  # fmt: skip
            return kernel_emulator.emulate(
                self, list(inputs), grid=grid, threadgroup=threadgroup,
                output_shapes=output_shapes, output_dtypes=output_dtypes,
                template=dict(template or []), init_value=init_value,
            )  # fmt: skip

        return launch

    install_fake_cuda(fake_kernel_for)


def replay(rec, order=None) -> None:
    """Every recorded launch through the emulator (in ``order``, else as recorded), its outputs
    written where the graph's are."""
    for i in order or range(len(rec.launches)):
        launch = rec.launches[i]
        s = launch.spec
        outs = kernel_emulator.emulate(
            s.kernel, list(launch.inputs), grid=s.grid, threadgroup=s.threadgroup,
            output_shapes=s.output_shapes, output_dtypes=s.output_dtypes,
            template=dict(s.template), init_value=s.init_value,
            initial=launch.outputs if launch.in_place else None,
        )  # fmt: skip
        for o, new in zip(launch.outputs, outs):
            mx.eval(new)
            ctypes.memmove(data_ptr(o), data_ptr(new), o.nbytes)
    for dst, src in rec.copies:
        ctypes.memmove(data_ptr(dst), data_ptr(src), dst.nbytes)


def _shuffled_order(deps: list[set[int]], seed: int) -> list[int]:
    """A random topological order of the launches: each launch after all its dependencies."""
    rng = random.Random(seed)
    left = [len(d) for d in deps]
    users: list[list[int]] = [[] for _ in deps]
    for i, d in enumerate(deps):
        for j in d:
            users[j].append(i)
    ready, order = [i for i, n in enumerate(left) if n == 0], []
    while ready:
        i = ready.pop(rng.randrange(len(ready)))
        order.append(i)
        for u in users[i]:
            left[u] -= 1
            if left[u] == 0:
                ready.append(u)
    assert len(order) == len(deps), "the dependencies have a cycle"
    return order


def build_llama(family: str, layers: int):
    """Tiny Llama or Qwen 2 (q / k / v biases) with GGML Q8_0 / Q4_K weights and random biases:
    heads of 32 (the norm + RoPE kernel's smallest) and 128-wide rows."""
    from hf2q_mlx.io.random_weights import fill_ggml_modules
    from hf2q_mlx.models import llama, qwen2
    from hf2q_mlx.models.quantized import ggml_quantize_modules

    module = qwen2 if family == "qwen2" else llama
    cfg = dict(vocab_size=160, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
               num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=1000.0,
               tie_word_embeddings=family == "llama")  # fmt: skip
    model = module.Model(module.ModelArgs.from_dict(cfg))
    model.set_dtype(mx.bfloat16)
    types = {p: (8 if m.weight.shape[1] % 256 else 12) for p, m in model.named_modules()
             if isinstance(m, (nn.Linear, nn.Embedding))}  # Q8_0 / Q4_K by row width  # fmt: skip
    ggml_quantize_modules(model, types)
    fill_ggml_modules(model)
    for i, (_, m) in enumerate(model.named_modules()):
        if "bias" in m:
            m.bias = mx.random.normal(m.bias.shape, key=mx.random.key(i)).astype(mx.bfloat16)
    model.fuse_projections()
    return model, cfg["vocab_size"]


def build(family: str, shape: str, layers: int, window: int, fmt: str = "q4_k"):
    """GGML Q4_K, MLX affine 4-bit or plain bf16 weights (``fmt``); ``mlx4-q4_1``: MLX 4-bit
    with the routed experts kept as GGML Q4_1 blocks (HF2Q_AFFINE_EXPERTS=q4_1)."""
    if fmt == "mlx4-q4_1":
        from hf2q_mlx.models.experts import affine_experts_to_q4_1

        model, vocab = build(family, shape, layers, window, "mlx4")
        replaced, kept = affine_experts_to_q4_1(model)
        assert replaced and not kept, (replaced, kept)
        return model, vocab
    if family in ("llama", "qwen2"):
        return build_llama(family, layers)
    if family == "qwen3_5":  # layers: delta-net, then full attention
        from decode_profile import build as build_shape

        if fmt != "bf16":
            return build_shape("qwen3_5", shape, fmt, mx.bfloat16, layers)
        q = _bench_module("qwen3_5")
        config = dict(q.TINY_SHAPES[shape], num_hidden_layers=layers)
        model = q.build_ours(config, mx.bfloat16)
        q.cast_floats(model, mx.bfloat16)
        model.fuse_projections()
        return model, config["vocab_size"]
    g = _bench_module("gemma4")
    # layers [S, F, ...] and a short window: a few tokens cross it; a wide softcap keeps the
    # random model's logits apart (at the cap they tie, and every greedy token is 0)
    cfg = dict(g.TINY[shape], num_hidden_layers=layers, sliding_window=window,
               final_logit_softcapping=1e4)  # fmt: skip
    cfg["layer_types"] = (["sliding_attention", "full_attention"] * layers)[:layers]
    args = g.gemma4.ModelArgs.from_dict(cfg)
    if fmt == "q4_k":
        model = g.build_ggml(args, mx.bfloat16)
    elif fmt == "mlx4":
        model = g.build_mlx4(args, mx.bfloat16)
    else:
        model = g.gemma4.Model(args)
        model.set_dtype(mx.bfloat16)
    model.fuse_projections()
    return model, args.vocab_size


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--window", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1, help="rows (B > 1: one idles a step)")
    ap.add_argument("--seed", type=int, default=0, help="of the shuffled replay order")
    ap.add_argument("--prefill", type=int, default=0,
                    help="prompt tokens per row before decoding; the graph is made and recorded "
                         "before them, as the serving engine does")  # fmt: skip
    ap.add_argument("--kv-bits", type=int, default=None, help="TurboQuant caches of these bits")
    ap.add_argument("--format", default="q4_k", choices=["q4_k", "mlx4", "mlx4-q4_1", "bf16"])
    ap.add_argument("--split-k", type=int, default=None,
                    help="GGML mat-vecs split over K in this many (HF2Q_MMA_SPLIT_K), down to "
                         "one block a split (the tiny rows have a few)")  # fmt: skip
    ap.add_argument("--split-fused", action="store_true",
                    help="with --split-k: each split's sum in its last threadgroup "
                         "(HF2Q_MMA_SPLIT_FUSED=1)")  # fmt: skip
    a = ap.parse_args()
    if a.split_k:
        from hf2q_mlx.custom_kernels import qmatmul_mma

        qmatmul_mma.SPLIT_K_RAW, qmatmul_mma.SPLIT_MIN_BLOCKS = str(a.split_k), 1
        qmatmul_mma.SPLIT_FUSED_RAW = "1" if a.split_fused else ""
    mx.set_default_device(mx.cpu)
    mx.random.seed(0)  # the same random model in every process
    np.random.seed(0)
    fake_cuda()
    family, _, shape = a.model.partition(":")
    model, vocab = build(family, shape, a.layers, a.window, a.format)
    max_len = 32 + a.prefill
    B = a.batch
    # row b starts from token 7 + b; with B > 1 the last row idles on the second step, so the
    # rows sit at different positions from then on
    firsts = [(7 + b) % vocab for b in range(B)]

    def active_at(i: int) -> list[bool]:
        return [not (B > 1 and b == B - 1 and i == 1) for b in range(B)]

    # the MLX step, uncompiled (the emulator cannot run inside a compile trace)
    if a.kv_bits:
        os.environ.pop("HF2Q_TQ_GRAPH", None)  # TurboQuant rows in the graph (the default)
    ref = DecodeStep(model, B, max_len, kv_bits=a.kv_bits)
    prompts = [[(3 * b + 5 * i + 1) % vocab for i in range(a.prefill)] for b in range(B)]
    for b, p in enumerate(prompts):
        if p:
            mx.eval(ref.prefill(b, p))
    span = ref._span(max(ref.positions) + a.steps)
    tokens, want = list(firsts), []
    for i in range(a.steps):
        act = active_at(i)
        logits, arrays, _, _ = ref._step(
            mx.array([[t] for t in tokens], dtype=mx.int32), ref._padded(ref.positions, mx.int32),
            ref._padded(act, mx.bool_), [s.arrays for s in ref.caches], span, False,
        )  # fmt: skip
        mx.eval(logits, arrays)
        for s, arr in zip(ref.caches, arrays):
            s.arrays = arr
        ref.positions = [p + int(f) for p, f in zip(ref.positions, act)]
        ids = [int(t) for t in mx.argmax(logits, axis=-1).tolist()]
        tokens = [n if f else t for n, t, f in zip(ids, tokens, act)]
        want.append(ids)

    # the recorded graph, replayed
    st = DecodeStep(model, B, max_len, kv_bits=a.kv_bits)
    graph = CudaGraphStep(st)
    if a.prefill:  # made and recorded at the first span before any prompt, as the engine does
        graph.record(st._span(1))
        for b, p in enumerate(prompts):
            mx.eval(st.prefill(b, p))
        graph._bind()  # what decode() does first
    # the recording of this span if there is one (recorded at positions 0 and 1), as decode()
    rec = graph.recordings.get(span) or graph.record(span)
    # replayed in another order that keeps every dependency (a shuffled topological order): a
    # dependency launch_dependencies missed shows as other bits, as lanes of a graph would
    deps = launch_dependencies(rec.launches)
    order = None if deps is None else _shuffled_order(deps, a.seed)
    tokens, got = list(firsts), []
    for i in range(a.steps):
        act = active_at(i)
        graph._set_inputs(tokens, st.positions, act)
        replay(rec, order)
        ids = [int(t) for t in mx.array(rec.out).tolist()]  # the replayed output's memory
        st.positions = [p + int(f) for p, f in zip(st.positions, act)]
        tokens = [n if f else t for n, t, f in zip(ids, tokens, act)]
        got.append(ids)

    logits_equal = bool(mx.array_equal(rec.logits.reshape(-1), logits.reshape(-1)))
    caches_equal = all(
        bool(mx.array_equal(x.view(mx.uint16) if x.dtype == mx.bfloat16 else x,
                            y.view(mx.uint16) if y.dtype == mx.bfloat16 else y))
        for s, t in zip(ref.caches, st.caches) for x, y in zip(s.arrays, t.arrays)
    )  # fmt: skip
    kinds = sorted({launch.spec.kernel.name for launch in rec.launches})
    lanes = 1 + max((lane for lane, _ in schedule_lanes(deps or [], 4)), default=0)
    logits_sha = hashlib.sha256(np.array(logits.astype(mx.float32)).tobytes()).hexdigest()
    print(json.dumps(dict(want=want, got=got, caches_equal=caches_equal, logits_equal=logits_equal,
                          logits_sha=logits_sha,
                          copies=len(rec.copies), dependencies=deps is not None,
                          lanes=lanes, reordered=order is not None and order != sorted(order),
                          in_place=sorted({launch.spec.kernel.name for launch in rec.launches
                                           if launch.in_place}),
                          launches=len(rec.launches), kernels=kinds)))  # fmt: skip


if __name__ == "__main__":
    main()
