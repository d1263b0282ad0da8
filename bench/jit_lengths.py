"""Which of our kernels compile anew for a new prompt length, found without a GPU.

MLX's CUDA back end compiles a kernel once per (name, template values), about 1.5 s each on the
H200 (``custom_kernels/cuda_cache.py``). A template value that follows the token count makes
every new prompt length, and every new packed total of a batched prefill, pay that again inside
a request's time to first token. This fakes the CUDA back end on the CPU (the dispatchers take
their GPU branch; each launch records its kernel and template values and returns zeros, so no
kernel runs), builds a model with random weights, prefills one row at each length through a
``DecodeStep`` and prints the instantiations each length adds. Past the lengths where a
dispatcher switches kernels (wide MMA tiles, dequantize + GEMM) a length should add none.

    python3 bench/jit_lengths.py qwen3_5:35b-a3b --layers 4 --lengths 31,127,511,1023,3384
    python3 bench/jit_lengths.py gemma4:tiny-moe --json OUT.json     # tiny shapes: seconds

With ``--engine`` it checks the serving engine's warm-up instead: an ``Engine(warmup=True)``
on the model, then a varied load (prompts of 1..140 tokens and some several chunks long, four
streams at a time, greedy and sampled with every top-k class, penalties, log-probs, a logit
bias), and prints what the load asked for that the warm-up had not (nothing, if it is whole).

    python3 bench/jit_lengths.py gemma4:tiny-moe --engine --kv-bits 8 --batch-prefill

With ``--mlx-ops`` it lists the MLX primitives one prefill (of the first length) runs with the
CUDA branch taken, and which of them MLX's CUDA back end JIT-compiles at first use on a machine
(``MLX_JIT``: the seconds of a fresh machine's first prefill that our cubin cache cannot save):

    python3 bench/jit_lengths.py qwen3_5:tiny-moe --format mlx4 --mlx-ops --lengths 300

Session 30 found Qwen 3.5's ``head_gate`` carrying the element count: a compile for every
prompt length (and every packed total) on Qwen 3.5, none on Gemma 4.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import hf2q_mlx.custom_kernels as ck  # noqa: E402
from hf2q_mlx.custom_kernels import _render, sigmoid_gate  # noqa: E402
from hf2q_mlx.models import quantized  # noqa: E402

DEFAULT_LENGTHS = "31,127,511,700,1023,1692"


def install_fake_cuda(kernel_for) -> None:
    """Dispatchers take their CUDA branch on the CPU, and MLX's kernel objects are what
    ``kernel_for(kernel, backend, signature)`` returns (tests/graph_step_emulated.py: the
    kernel emulator)."""
    ck._gpu = ("cuda", mx.default_device(), mx.default_device)
    # the gate kernels as a recorded step takes them (their numerics: their own tests)
    sigmoid_gate.GPU_VERIFIED = True
    _render.Kernel._kernel_for = kernel_for
    _render.gpu_backend = lambda: "cuda"
    quantized._cpu_affine_path = lambda: False


def fake_cuda(seen: dict, current: list) -> None:
    """``install_fake_cuda`` where a launch records (kernel, dtype signature, template values)
    into ``seen`` (the first length, ``current[0]``, to ask for it) and returns zeros of its
    output shapes."""

    def kernel_for(self, backend, sig):
        def launch(*, inputs, template=None, grid, threadgroup, output_shapes, output_dtypes,
                   init_value=None, verbose=False):  # fmt: skip
            key = (self.name, sig, tuple(_render._norm_template(template)))
            seen.setdefault(key, current[0])
            return [mx.zeros(s, dtype=d) for s, d in zip(output_shapes, output_dtypes)]

        return launch

    install_fake_cuda(kernel_for)


def probe(
    spec: str, fmt: str, layers: int | None, lengths: list[int], kv_bits: int | None = None
) -> dict:
    """-> {length: [(kernel, template values) first asked for at that length]}; length 0: those
    the step asked for when it was built."""
    from decode_profile import build

    from hf2q_mlx.decode_step import DecodeStep

    seen: dict = {}
    current: list = [0]
    fake_cuda(seen, current)
    family, shape = spec.split(":")
    model, vocab = build(family, shape, fmt, mx.bfloat16, layers)
    step = DecodeStep(model, max_batch=1, max_len=max(lengths) + 8, kv_bits=kv_bits)
    out = {0: [(k[0], [list(v) for v in k[2]]) for k in seen]}
    for n in lengths:
        before = set(seen)
        current[0] = n
        step.reset_row(0)
        step.prefill(0, [(7 * i + 3) % vocab for i in range(n)])
        mx.eval([c.arrays for c in step.caches])
        out[n] = [(k[0], [list(v) for v in k[2]]) for k in seen if k not in before]
    return out


# MLX primitives that MLX 0.32.4's CUDA back end JIT-compiles with NVRTC at first use on a machine
# (seconds each): its gathers and scatters and its quantized GEMMs. Its fusions ("Compiled") do
# too, but on the CPU the fast ops' fallbacks (rms_norm, rope) trace as fusions that CUDA runs as
# one shipped primitive: printed, not counted.
MLX_JIT = ("Gather", "GatherAxis", "Scatter", "ScatterAxis", "QuantizedMatmul", "GatherQMM",
           "GatherMM")  # fmt: skip


def mlx_ops(
    spec: str, fmt: str, layers: int | None, length: int, kv_bits: int | None = None
) -> dict[str, int]:
    """-> {MLX primitive: nodes} of one ``length``-token prefill with the CUDA branch taken on the
    CPU, as ``generation.prefill`` runs the model (its MLX linears turned into kernel linears
    where ``affine_prefill`` is on): each kernel launch keeps its inputs and returns zeros, and
    the graphs of those inputs and of the logits are read (nothing is evaluated)."""
    import re
    import tempfile
    from collections import Counter

    from decode_profile import build

    from hf2q_mlx.custom_kernels import affine_prefill, expert_matmul, gated_delta
    from hf2q_mlx.generation import make_prompt_cache
    from hf2q_mlx.models import kernel_linears

    kept: list = []

    def kernel_for(self, backend, sig):
        def launch(*, inputs, template=None, grid, threadgroup, output_shapes, output_dtypes,
                   init_value=None, verbose=False):  # fmt: skip
            kept.extend(inputs)
            return [mx.zeros(s, dtype=d) for s, d in zip(output_shapes, output_dtypes)]

        return launch

    # on the CPU even where a GPU is present: a real device evaluates parts of the graph as it is
    # built (session 40: Gemma 4's graphs came back empty on an H100), and nothing runs here
    mx.set_default_device(mx.cpu)
    install_fake_cuda(kernel_for)
    _render.cuda_cache.wants_cubin = lambda: False  # the fake launches, never real cubins
    # choices between MLX ops as on a CUDA device too (the chunked delta rule, the gathers' flags)
    for mod in (ck, gated_delta, expert_matmul):
        mod.on_cuda_device = lambda: True
    family, shape = spec.split(":")
    model, vocab = build(family, shape, fmt, mx.bfloat16, layers)
    if affine_prefill.enabled():
        kernel_linears.use_kernels(model)
    ids = mx.array([[(7 * i + 3) % vocab for i in range(length)]], dtype=mx.int32)
    logits = model(ids, cache=make_prompt_cache(model, kv_bits))  # kv_bits: TurboQuant
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, logits, *kept)
        dot = f.read()
    return dict(Counter(re.findall(r'label\s*=\s*"([A-Za-z]+)', dot)))


def load_params(i: int, vocab: int):
    """The i-th load request's sampling options: greedy, or sampled with a top-k from 1 to 64
    (every class of the sampling kernels), some with penalties, log-probs and a logit bias."""
    from hf2q_mlx.serving.batch_sampler import SamplingParams

    k = 1 + (i * 7) % 64
    if i % 3 == 0:
        return SamplingParams(max_tokens=3, ignore_eos=True)
    extra = dict(presence_penalty=0.2, logprobs=True, top_logprobs=1 + i % 5,
                 logit_bias={i % vocab: 1.0}) if i % 5 == 0 else {}  # fmt: skip
    return SamplingParams(max_tokens=3, temperature=0.7, top_k=k, top_p=0.95, seed=i,
                          ignore_eos=True, **extra)  # fmt: skip


def probe_engine(spec: str, fmt: str, layers: int | None, kv_bits: int | None,
                 batch_prefill: bool) -> dict:  # fmt: skip
    """-> {"warm-up": [...], "load": [...]}: the instantiations the engine's warm-up asked for,
    and those a varied load asked for after it."""
    import threading

    from decode_profile import build
    from serve_throughput import StubTokenizer

    from hf2q_mlx.serving.engine import Engine

    seen: dict = {}
    current: list = ["warm-up"]
    fake_cuda(seen, current)
    family, shape = spec.split(":")
    model, vocab = build(family, shape, fmt, mx.bfloat16, layers)
    engine = Engine(model, StubTokenizer(), max_batch=4, max_queue=1 << 20, max_len=600,
                    kv_bits=kv_bits, prefill_chunk=64, prefix_cache_bytes=64 << 20,
                    compiled=True, batch_prefill=batch_prefill, warmup=True).start()  # fmt: skip
    lengths = [*range(1, 141), 150, 211, 300, 333]
    current[0] = "load"
    try:
        for wave in range(0, len(lengths), 4):
            done = threading.Semaphore(0)

            def sink(e, done=done) -> None:
                if e.finish_reason is not None:
                    done.release()

            batch = lengths[wave : wave + 4]
            for j, n in enumerate(batch):
                prompt = [(11 * t + wave + j) % vocab for t in range(n)]
                engine.submit(prompt, load_params(wave + j, vocab), sink)
            for _ in batch:
                done.acquire()
    finally:
        engine.shutdown()
    out: dict = {"warm-up": [], "load": []}
    for k, when in seen.items():
        out[when].append((k[0], [list(v) for v in k[2]]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="family:shape of bench/decode_profile.py, e.g. qwen3_5:9b")
    ap.add_argument("--format", default="q4_k", choices=["q4_k", "mlx4"])
    ap.add_argument("--layers", type=int, default=None, help="keep only the first layers")
    ap.add_argument("--lengths", default=DEFAULT_LENGTHS, help="prompt lengths, in order")
    ap.add_argument("--kv-bits", type=int, default=None, help="a TurboQuant cache of 4 or 8 bits")
    ap.add_argument("--engine", action="store_true", help="the engine's warm-up, then a load")
    ap.add_argument("--batch-prefill", action="store_true", help="with --engine: packed prefill")
    ap.add_argument("--mlx-ops", action="store_true",
                    help="the MLX primitives one prefill of the first length runs (MLX_JIT: "
                         "those CUDA compiles at first use)")  # fmt: skip
    ap.add_argument("--json", help="write {length: [[kernel, template], ...]} here")
    a = ap.parse_args()
    if a.mlx_ops:
        n = int(a.lengths.split(",")[0])
        ops = mlx_ops(a.model, a.format, a.layers, n, a.kv_bits)
        jit = {k: v for k, v in sorted(ops.items()) if k in MLX_JIT}
        fused = {k: v for k, v in sorted(ops.items()) if k.startswith("Compiled")}
        print(f"{a.model} {a.format}, {n} tokens: MLX ops CUDA JIT-compiles {jit or 'none'}")
        print(f"  fusions (CPU fallbacks of fast ops among them): {fused or 'none'}")
        if a.json:
            Path(a.json).write_text(json.dumps({"jit": jit, "ops": ops}))
        return
    if a.engine:
        out = probe_engine(a.model, a.format, a.layers, a.kv_bits, a.batch_prefill)
        for when, new in out.items():
            print(f"{when}: {len(new)} instantiations {sorted({k for k, _ in new})}")
        if a.json:
            Path(a.json).write_text(json.dumps(out, default=str))
        return
    lengths = [int(n) for n in a.lengths.split(",")]
    out = probe(a.model, a.format, a.layers, lengths, a.kv_bits)
    for n, new in out.items():
        print(f"{n:6d} tokens: {len(new):3d} new  {sorted({k for k, _ in new})}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({str(n): v for n, v in out.items()}, default=str))


if __name__ == "__main__":
    main()
