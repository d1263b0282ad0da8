"""``generation.prefill`` with compile_ahead on the fake CUDA back end (kernels through the CPU
emulator): prints JSON of what the dry pass compiled, what the real forward then asked
``cuda_cache`` for, and the logits with and without the dry pass. Run in a process of its own
by tests/test_compile_ahead.py (the fake stays in the dispatchers' plan caches).

    python3 tests/compile_ahead_emulated.py gemma4:tiny-moe [--tokens 23] [--step 16]
    python3 tests/compile_ahead_emulated.py gemma4:tiny-moe --engine   # the serving warm-up

``--engine`` (launches return zeros, nothing emulated: only what is asked for matters): an
``Engine`` warm-up's dry pass, what it compiled, and what the warm-up then asked for.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from graph_step_emulated import build, fake_cuda  # noqa: E402

from hf2q_mlx import compile_ahead  # noqa: E402
from hf2q_mlx.custom_kernels import cuda_cache  # noqa: E402
from hf2q_mlx.generation import make_prompt_cache, prefill  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=23)
    ap.add_argument("--step", type=int, default=16)
    ap.add_argument("--format", default="q4_k")
    ap.add_argument("--engine", action="store_true")
    a = ap.parse_args()
    if a.engine:
        return engine_warmup(a.model, a.format)
    fake_cuda()
    family, shape = a.model.split(":")
    compiled, asked = [], []
    # no NVRTC here: the ahead compile is recorded, each launch's own ask answered None (MLX's
    # build, i.e. the emulator, serves it)
    cuda_cache.cubins = lambda units, force=False: compiled.extend(n for n, _ in units) or []
    cuda_cache.cubin = lambda name, source, force=False: asked.append(name)
    compile_ahead._can_mark = lambda: True  # as where NVRTC is found

    def run(ahead: bool) -> tuple[np.ndarray, dict | None]:
        model, vocab = build(family, shape, 2, 4, a.format)
        ids = mx.array([(5 * i + 2) % vocab for i in range(a.tokens)], mx.int32)
        if not ahead:
            object.__setattr__(model, compile_ahead._ATTR, True)
        logits = prefill(model, ids, make_prompt_cache(model), step=a.step)
        again = compile_ahead.once(model, lambda: None)  # a second prefill: nothing
        return np.array(logits.astype(mx.float32)), again

    reports = []
    real_once = compile_ahead.once

    def once(*args, **kwargs):
        reports.append(real_once(*args, **kwargs))
        return reports[-1]

    compile_ahead.once = once
    # ahead first: the kernels' cubin lookups are per process (a later run finds them made)
    mx.random.seed(0)
    ahead, again = run(True)
    first_report = reports[0]
    asked_after = list(asked)
    mx.random.seed(0)
    plain, _ = run(False)
    # a later process on this machine (a new model object, the same signature): the marker
    # skips the dry pass
    reports.clear()
    mx.random.seed(0)
    run(True)
    marker_skipped = bool(reports and reports[0] and reports[0].get("marker"))
    print(json.dumps({
        "compiled_ahead": compiled,
        "asked_after": asked_after,
        "second_call": again,
        "warm_ups": first_report.get("warm_ups"),
        "marker_skipped": marker_skipped,
        "equal": bool(np.array_equal(plain, ahead)),
        "finite": bool(np.isfinite(ahead).all()),
    }))  # fmt: skip


def engine_warmup(spec: str, fmt: str) -> None:
    import time

    sys.path.insert(0, str(HERE.parent / "bench"))
    from jit_lengths import fake_cuda as zeros_cuda
    from serve_throughput import StubTokenizer

    from hf2q_mlx.serving.engine import Engine

    zeros_cuda({}, [0])
    compiled, asked = [], []
    cuda_cache.cubins = lambda units, force=False: compiled.extend(n for n, _ in units) or []
    cuda_cache.cubin = lambda name, source, force=False: asked.append(name)
    compile_ahead._can_mark = lambda: True
    family, shape = spec.split(":")
    model, _ = build(family, shape, 2, 4, fmt)
    engine = Engine(model, StubTokenizer(), max_batch=2, max_len=200, prefill_chunk=64,
                    warmup=True).start()  # fmt: skip
    try:
        t0 = time.time()
        while engine.warmup_s is None and time.time() - t0 < 500:
            time.sleep(0.05)
    finally:
        engine.shutdown()
    print(json.dumps({"compiled_ahead": compiled, "asked_after": asked,
                      "warmed": engine.warmup_s is not None}))  # fmt: skip


if __name__ == "__main__":
    main()
