"""A compiled decode token's graph stays small. MLX pays host time for every node of a step's
graph, kernel or view (about 7 us each on the H200 machine), so a new reshape on a decode path is
a speed regression. bench/graph_nodes.py counts the nodes of one DecodeStep token as the GPU
builds it, on the CPU, with stub kernel launches; here per layer, as the difference between
the first 2L and the first L layers (the embedding and the head cancel out)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
VIEWS = ("Reshape", "Transpose", "Split", "Squeeze", "Slice", "Flatten", "Unflatten")


def _count(model: str, fmt: str, layers: int, tmp_path) -> dict[str, int]:
    """bench/graph_nodes.py in a process of its own: its stub launchers stay in the kernel
    dispatchers' plan caches, which must not leak into the other tests."""
    out = tmp_path / f"{layers}.json"
    cmd = [sys.executable, str(BENCH / "graph_nodes.py"), model, fmt, "--layers", str(layers),
           "--json", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    return json.loads(out.read_text())["nodes"]


def _per_layer(model: str, fmt: str, layers: int, tmp_path) -> dict[str, float]:
    a, b = (_count(model, fmt, n, tmp_path) for n in (layers, 2 * layers))
    return {k: (b.get(k, 0) - a.get(k, 0)) / layers for k in set(a) | set(b)}


# (model, format, layers per half: each half has both layer kinds, view nodes and kernel
# launches allowed per layer). Qwen 3.5's attention reads q (its [query | gate] heads), k and v
# in place from one fused q/k/v mat-vec (session 21: 3 launches and 2 views fewer an attention
# layer); its MoE layers' custom kernels include the two gate kernels (sigmoid_gate.py), which
# replaced 3.5 MLX nodes a layer (the shared gate's Matmul, sigmoid-multiply and Add, a Slice).
CASES = [
    ("gemma4:tiny-moe", "q4_k", 3, 0, 13),
    ("gemma4:tiny-moe", "mlx4", 3, 0, 13),
    ("qwen3_5:tiny-moe", "q4_k", 2, 0, 12.5),
    ("qwen3_5:tiny", "q4_k", 2, 0, 8.5),
]


def test_rope_frequencies_are_no_step_nodes(tmp_path):
    """RoPE's inverse frequencies are evaluated when the module is made: a lazy array would put
    its Arange / Log / Exp / Multiply / Divide into every compiled decode step (session 21)."""
    per = _per_layer("qwen3_5:tiny-moe", "q4_k", 2, tmp_path)
    assert not any(per.get(k, 0) for k in ("Arange", "Log", "Exp", "Divide")), per


@pytest.mark.parametrize("model, fmt, layers, views, kernels", CASES)
def test_decode_layer_nodes(model, fmt, layers, views, kernels, tmp_path):
    """At most ``views`` reshape / transpose / split / squeeze / slice nodes per decode layer
    (kernels read and write flat memory in the layout their neighbours use) and at most
    ``kernels`` launches."""
    per = _per_layer(model, fmt, layers, tmp_path)
    seen = {k: per[k] for k in VIEWS if per.get(k, 0)}
    assert sum(seen.values()) <= views, f"view nodes per layer: {seen}"
    assert per.get("CustomKernel", 0) <= kernels, per


def _graph_count(model: str, fmt: str, layers: int, tmp_path) -> dict[str, int]:
    out = tmp_path / f"graph{layers}.json"
    cmd = [sys.executable, str(BENCH / "graph_nodes.py"), model, fmt, "--layers", str(layers),
           "--graph", "--json", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    return json.loads(out.read_text())["graph_launches"]


# Qwen 3.5 tiny MoE alternates a delta-net layer and an attention layer (one q/k/v mat-vec,
# its KV rows written by the norm + RoPE kernel)
# MLX 4-bit as many as Q4_K since session 40: its dense MLP's gate / up and activation are one
# launch (KernelQuantizedLinear.glu), as GGML's dense_glu
@pytest.mark.parametrize("model, fmt, layers, kernels", [
    ("gemma4:tiny-moe", "q4_k", 3, 11), ("gemma4:tiny-moe", "mlx4", 3, 11),
    ("qwen3_5:tiny-moe", "q4_k", 2, 12), ("qwen3_5:tiny-moe", "mlx4", 2, 12),
])  # fmt: skip
def test_graph_step_launches_per_layer(model, fmt, layers, kernels, tmp_path):
    """The CUDA graph step (recorded on the CPU, KV writes fused where the norm + RoPE kernel
    makes keys and values): at most ``kernels`` launches per layer, counted as the difference
    between 2L and L layers; no KV row is written by a launch of its own."""
    a, b = (_graph_count(model, fmt, n, tmp_path) for n in (layers, 2 * layers))
    per = (sum(b.values()) - sum(a.values())) / layers
    assert per <= kernels, (a, b)
    assert "kv_write" not in b
