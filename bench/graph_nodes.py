"""Graph nodes of one compiled-step token as the GPU would build it, counted on the CPU.

MLX spends host time on every node of a step's graph, kernel or view (about 7 us per node on the
H200 machine, measured with ``decode_profile.py --nodes``), so the node count, not only the
kernel count, sets a host-bound decode's speed. This script builds a model at a real or tiny
shape (layers cut to ``--layers``), makes every custom-kernel dispatcher take its GPU branch on
the CPU with stub launches (each returns zero-filled leaf arrays: one node, no graph behind
it), runs one ``DecodeStep`` token and counts the nodes MLX's graph holds:
kernel launches plus everything else (views, scatters, MLX ops), by primitive.

    python3 bench/graph_nodes.py gemma4:26b-a4b q4_k [--layers 2] [--batch 1] [--json F]
    python3 bench/graph_nodes.py qwen3_5:35b-a3b mlx4 --layers 4

The stub launches return zeros, so values are meaningless; only the graph's shape counts. The
same command with ``--nodes`` of ``decode_profile.py`` on a GPU gives the real graph.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import sys
import tempfile

import mlx.core as mx

import hf2q_mlx.custom_kernels as ck
from hf2q_mlx.custom_kernels import _render
from hf2q_mlx.models import quantized

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_profile import build  # noqa: E402

KERNEL = "CustomKernel"


LAUNCHES: list = []  # each stub launch's inputs (module-wide: dispatchers cache launchers)


@contextlib.contextmanager
def stub_kernels():
    """Dispatchers see a 'cuda' back end on the CPU; every launch appends its inputs to
    ``LAUNCHES`` and returns zero leaves of the asked shapes. The dispatchers keep the stub
    launchers in their plan caches: use it in a process of its own (this script's)."""

    def fake_kernel_for(self, backend, sig):
        def launch(inputs, *, output_shapes, output_dtypes, **_):
            LAUNCHES.append(list(inputs))
            outs = [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]
            mx.eval(outs)  # evaluated: leaves with no graph behind them
            return outs

        return launch

    saved = ck._gpu, _render.Kernel._kernel_for, _render.gpu_backend, quantized._cpu_affine_path
    ck._gpu = ("cuda", mx.default_device(), mx.default_device)
    _render.Kernel._kernel_for = fake_kernel_for
    _render.gpu_backend = lambda: "cuda"
    quantized._cpu_affine_path = lambda: False  # GGML layers: the GPU's dispatch
    try:
        yield
    finally:
        ck._gpu, _render.Kernel._kernel_for, _render.gpu_backend, quantized._cpu_affine_path = saved


def _labels(arrays: list[mx.array], dot: str | None = None) -> list[str]:
    with tempfile.TemporaryDirectory() as d:
        path = dot or os.path.join(d, "g.dot")
        mx.export_to_dot(path, *arrays)
        with open(path) as f:
            return re.findall(r'label ="([^"]+)"', f.read())


def count(model, batch: int = 1, max_len: int = 64, dot: str | None = None) -> dict[str, int]:
    """-> primitive: nodes in one decode token of ``model``'s DecodeStep (kernels as
    CustomKernel). The step's function runs uncompiled (a compiled replay would not call the
    stubs): elementwise chains that mx.compile fuses into one node count here one per op."""
    from hf2q_mlx.decode_step import MIN_SPAN, DecodeStep

    with stub_kernels():
        st = DecodeStep(model, batch, max_len)
        LAUNCHES.clear()
        tokens = mx.zeros((batch, 1), mx.int32)
        pos, active = mx.array(st.positions, dtype=mx.int32), mx.array([True] * batch)
        arrays = [s.arrays for s in st.caches]
        out, arrays, _, _ = st._step(tokens, pos, active, arrays, min(MIN_SPAN, max_len), True)
        inputs = [a for c in LAUNCHES for a in c]
        # the stubs' outputs are leaves: the graph behind each kernel is reached through its
        # inputs
        nodes = collections.Counter(_labels([out, *[a for x in arrays for a in x], *inputs], dot))
    nodes[KERNEL] = len(LAUNCHES)
    return dict(nodes.most_common())


def graph_launches(model, batch: int = 1, max_len: int = 64) -> collections.Counter:
    """Kernel launches of one token of ``model``'s CUDA graph step (recorded on the CPU with
    stub launches, checked, KV writes fused), by kernel."""
    from hf2q_mlx.cuda_graph_step import CudaGraphStep
    from hf2q_mlx.decode_step import DecodeStep

    with stub_kernels():
        step = DecodeStep(model, batch, max_len)
        rec = CudaGraphStep(step).record(step._span(1))
    return collections.Counter(launch.spec.kernel.name for launch in rec.launches)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="family:shape, e.g. gemma4:26b-a4b, qwen3_5:tiny-moe")
    ap.add_argument("format", choices=["q4_k", "mlx4"])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--json", default=None)
    ap.add_argument("--dot", default=None, help="also write the graph (DOT) here")
    ap.add_argument(
        "--graph",
        action="store_true",
        help="count the CUDA graph step's launches instead (recorded, KV writes fused)",
    )
    a = ap.parse_args()
    family, _, shape = a.model.partition(":")
    mx.set_default_device(mx.cpu)
    model, _ = build(family, shape, a.format, mx.bfloat16, a.layers)
    n_layers = len(model.layers)
    if a.graph:
        counts = dict(graph_launches(model, a.batch).most_common())
        total, key = sum(counts.values()), "graph_launches"
        what = (f"the CUDA graph step launches {total} kernels ({total / n_layers:.2f} per layer, "
                "head and embedding included)")  # fmt: skip
    else:
        counts = count(model, a.batch, dot=a.dot)
        total, kernels, key = sum(counts.values()), counts.get(KERNEL, 0), "nodes"
        per = f"{total / n_layers:.1f} nodes and {kernels / n_layers:.1f} kernels per layer"
        what = f"{total} nodes ({kernels} kernels), {per} (head and embedding included)"
    print(f"{a.model} {a.format}, {n_layers} layers, B={a.batch}: {what}")
    print("  " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "format": a.format, "layers": n_layers,
                       "batch": a.batch, key: counts}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
