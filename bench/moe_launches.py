"""Launches of one MoE layer's routed experts (router, gate/up + activation, down + weighted sum)
with the fused kernels (custom_kernels/moe_router.py, expert_glu.py, expert_glu_affine.py,
expert_down.py, expert_down_affine.py) and without them.

Builds one decoder layer's MoE modules at the real shape with random weights (Q4_K experts and
a float router as bench/gemma4.py build_ggml and bench/qwen3_5.py randomize_q4k; MLX 4-bit
experts and an 8-bit router as their MLX 4-bit builders), then for B token rows counts the
primitives of the graph (export_to_dot: one rectangle each; views that launch nothing listed
apart) and times the block (median of evaluations). Prints a table and writes JSON.

    python3 bench/moe_launches.py            # H200: both shapes and formats, B = 1 and 8
    python3 bench/moe_launches.py --batch 1 32 --json bench/results/moe_launches.json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import re
import tempfile
import time
from unittest import mock

import mlx.core as mx
import mlx.nn as nn
from gguf import GGMLQuantizationType as T

from hf2q_mlx.custom_kernels import (
    expert_down,
    expert_down_affine,
    expert_glu,
    expert_glu_affine,
    moe_router,
)
from hf2q_mlx.io.random_weights import random_ggml_blocks
from hf2q_mlx.models import gemma4_moe, ops, qwen3_5_moe
from hf2q_mlx.models.experts import ExpertLinear, QuantizedExpertLinear

# primitives that are views or metadata on MLX's GPU back ends: no kernel
NO_LAUNCH = {"Reshape", "Transpose", "Slice", "Broadcast", "ExpandDims", "Squeeze",
             "StopGradient", "Split"}  # fmt: skip
SHAPES = {  # hidden, experts, top-k, expert intermediate, activation
    "gemma4:26b-a4b": (2816, 128, 8, 704, "gelu_tanh"),
    "qwen3_5:35b-a3b": (2048, 256, 8, 512, "silu"),
}


def primitives(*outs: mx.array) -> collections.Counter:
    with tempfile.NamedTemporaryFile("w+", suffix=".dot") as f:
        mx.export_to_dot(f.name, *outs)
        return collections.Counter(re.findall(r'label ="([^"]+)"', open(f.name).read()))


def ggml_experts(E: int, rows: int, cols: int, seed: int) -> ExpertLinear:
    t = T.Q4_K if cols % 256 == 0 else T.Q5_0  # llama.cpp's fallback, as bench/gemma4.py
    m = ExpertLinear(E, cols, rows, t)
    m.weight = random_ggml_blocks(E * rows, cols, t, seed=seed).reshape(m.weight.shape)
    return m


def build(shape: str, fmt: str, dtype: mx.Dtype):
    """-> block(x) returning the layer's routed-expert output (before its post-norm), and the
    input width.
    ``fmt`` q4_k: Q4_K experts, a float router; mlx4: MLX 4-bit experts, an 8-bit router (the
    bench/gemma4.py and bench/qwen3_5.py recipes)."""
    H, E, k, F, act = SHAPES[shape]
    if fmt == "q4_k":
        gate_up, down = ggml_experts(E, 2 * F, H, seed=1), ggml_experts(E, H, F, seed=2)
    else:
        w = (mx.random.normal((E, 2 * F, H)) * H**-0.5).astype(dtype)
        gate_up = QuantizedExpertLinear.from_weight(w, 64, 4)
        w = (mx.random.normal((E, H, F)) * F**-0.5).astype(dtype)
        down = QuantizedExpertLinear.from_weight(w, 64, 4)
    router_w = (mx.random.normal((E, H)) * H**-0.5).astype(dtype)

    def quantized(linear: nn.Linear) -> nn.Module:
        return linear if fmt == "q4_k" else nn.QuantizedLinear.from_linear(linear, 64, 8)

    if shape.startswith("gemma4"):
        router = gemma4_moe.Router(H, E, k, eps=1e-6)
        router.proj.weight = router_w
        router.proj = quantized(router.proj)
        router.scale = mx.ones((H,), dtype=dtype)
        router.per_expert_scale = mx.ones((E,), dtype=dtype)
        norm = ops.RMSNorm(H, eps=1e-6)
        norm.weight = norm.weight.astype(dtype)

        def block(x):
            ids, w, xn = router(x, norm)
            return ops.expert_down(ops.expert_glu(xn, ids, gate_up, None, act), ids, w, down)

    else:
        args = qwen3_5_moe.ModelArgs(hidden_size=H, num_experts=E, num_experts_per_tok=k)
        moe = qwen3_5_moe.SparseMoeBlock(args)  # its float experts stay unevaluated zeros
        moe.gate.weight = router_w
        moe.gate = quantized(moe.gate)

        def block(x):
            ids, w = moe.route(x)
            return ops.expert_down(ops.expert_glu(x, ids, gate_up, None, act), ids, w, down)

    mx.eval(gate_up.parameters(), down.parameters())
    return block, H


def measure(block, x: mx.array, reps: int) -> tuple[collections.Counter, float]:
    mx.eval(block(x))  # plans and builds
    counts = primitives(block(x))
    times = []
    for _ in range(reps):
        tic = time.perf_counter()
        mx.eval(block(x))
        times.append(time.perf_counter() - tic)
    return counts, sorted(times)[len(times) // 2] * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--formats", nargs="+", default=["q4_k", "mlx4"], choices=["q4_k", "mlx4"])
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not ops.use_kernels():
        print("no GPU kernels here (CPU or HF2Q_KERNELS=reference): counting the reference only")
    rows = []
    for shape, fmt in [(s, f) for s in args.shapes for f in args.formats]:
        block, H = build(shape, fmt, mx.bfloat16)
        for B in args.batch:
            x = mx.random.normal((B, H)).astype(mx.bfloat16)
            for mode in ("before", "fused"):
                with fused_kernels(mode == "fused"):
                    counts, us = measure(block, x, args.reps)
                launching = sum(n for p, n in counts.items() if p not in NO_LAUNCH)
                row = {"shape": shape, "format": fmt, "B": B, "path": mode, "launches": launching,
                       "primitives": dict(counts), "median_us": round(us, 1)}  # fmt: skip
                rows.append(row)
                top = ", ".join(f"{p} {n}" for p, n in counts.most_common())
                print(f"{shape:16s} {fmt:5s} B={B:<3d} {mode:6s} {launching:3d} launches "
                      f"{us:8.1f} us   [{top}]")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


@contextlib.contextmanager
def fused_kernels(on: bool):
    """``on`` False: the path before, both fused kernels reported as not covering (the models
    then build their own routing graph and the expert_matmul + activation pair)."""
    with contextlib.ExitStack() as stack:
        if not on:
            stack.enter_context(
                mock.patch.object(moe_router, "kernel_covers", lambda *a, **k: False)
            )
            stack.enter_context(
                mock.patch.object(expert_glu, "_kernel_covers", lambda *a, **k: False)
            )
            stack.enter_context(mock.patch.object(expert_glu, "_CALLS", {}))
            stack.enter_context(
                mock.patch.object(expert_down, "kernel_covers", lambda *a, **k: False)
            )
            stack.enter_context(mock.patch.object(expert_down, "_CALLS", {}))
            stack.enter_context(
                mock.patch.object(expert_down_affine, "kernel_covers", lambda *a, **k: False)
            )
            stack.enter_context(
                mock.patch.object(expert_glu_affine, "kernel_covers", lambda *a, **k: False)
            )
        yield


if __name__ == "__main__":
    main()
