"""No kernel compiles anew for a new prompt length once past the dispatchers' switch points.

MLX's CUDA back end compiles each (kernel, template values) once, ~1.5 s on the H200: a template
value that follows the token count would put that into the time to first token of every new
prompt length (session 30: Qwen 3.5's ``head_gate`` did). ``bench/jit_lengths.py`` fakes the
CUDA back end on the CPU and records what each prefill length asks for; it runs in a process of
its own (the fake stays in the dispatchers' plan caches).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def new_per_length(tmp_path, model: str, lengths: str, *extra: str) -> dict[int, list]:
    out = tmp_path / "jit.json"
    cmd = [sys.executable, str(ROOT / "bench" / "jit_lengths.py"), model, "--lengths", lengths,
           "--json", str(out), *extra]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=600, cwd=ROOT)
    return {int(n): v for n, v in json.loads(out.read_text()).items()}


@pytest.mark.parametrize(
    "model, extra",
    [
        ("gemma4:tiny-moe", ()),
        ("qwen3_5:tiny-moe", ()),
        ("qwen3_5:tiny", ("--format", "mlx4")),
        ("gemma4:tiny-moe", ("--kv-bits", "8")),
    ],
    ids=["gemma4-moe-q4k", "qwen35-moe-q4k", "qwen35-mlx4", "gemma4-moe-tq8"],
)
def test_long_prompt_lengths_compile_nothing_new(tmp_path, model, extra):
    new = new_per_length(tmp_path, model, "31,127,300,517,1000", *extra)
    # the probe saw kernels at all (the step's build and the first lengths ask for some)
    assert sum(len(new[n]) for n in (0, 31, 127)) >= 5, new
    for n in (300, 517, 1000):
        assert new[n] == [], f"{model}: {n} tokens compile {[k for k, _ in new[n]]} again"


def _instantiations(per_length: dict[int, list]) -> set[str]:
    return {json.dumps(k) for v in per_length.values() for k in v}


@pytest.mark.parametrize(
    "model, extra",
    [("gemma4:tiny-moe", ()), ("qwen3_5:tiny-moe", ()), ("qwen3_5:tiny", ("--format", "mlx4"))],
    ids=["gemma4-moe-q4k", "qwen35-moe-q4k", "qwen35-mlx4"],
)
def test_the_warm_up_lengths_meet_every_prefill_kernel(tmp_path, model, extra):
    """The serving engine's warm-up prefills ``PREFILL_SWITCH_TOKENS``: together they ask for
    every kernel that any chunk of 1..140 tokens (and longer ones) asks for."""
    from hf2q_mlx.serving.engine import PREFILL_SWITCH_TOKENS

    # MLX 4-bit runs its matmuls for real on the CPU: a shorter sweep (its switches end at 33)
    top = 41 if "mlx4" in extra else 141
    every = ",".join(str(n) for n in [*range(1, top), 200, 333, 700])
    seen_all = _instantiations(new_per_length(tmp_path, model, every, *extra))
    warm = ",".join(str(n) for n in PREFILL_SWITCH_TOKENS)
    seen_warm = _instantiations(new_per_length(tmp_path, model, warm, *extra))
    assert seen_all - seen_warm == set()
    assert len(seen_warm) > 5  # the probe saw kernels (the step's own and the prefills')


@pytest.mark.parametrize(
    "model, extra",
    [
        ("gemma4:tiny-moe", ("--kv-bits", "8", "--batch-prefill")),
        ("qwen3_5:tiny-moe", ("--kv-bits", "8", "--batch-prefill")),
        ("qwen3_5:tiny-moe", ()),
        ("gemma4:tiny-dense", ("--kv-bits", "4")),
    ],
    ids=["gemma4-moe-tq8-packed", "qwen35-moe-tq8-packed", "qwen35-moe", "gemma4-dense-tq4"],
)
def test_after_the_engine_warm_up_a_varied_load_compiles_nothing(tmp_path, model, extra):
    """The serving engine's warm-up, then prompts of 1..140 tokens and longer ones in several
    chunks (prefix reuse on: short continuation chunks), four streams at a time, greedy and
    sampled with every top-k from 1 to 64, penalties, log-probs, a logit bias: the load asks
    for no kernel instantiation the warm-up did not (session 30 found three that it did:
    TurboQuant's flash-decode per chunk length, the delta-net step on a packed row's own
    inputs, and MLX 4-bit embedding rows per prompt length up to 32, which the length sweep
    above checks: on the CPU the MLX 4-bit load takes 25 s)."""
    out = tmp_path / "engine.json"
    cmd = [sys.executable, str(ROOT / "bench" / "jit_lengths.py"), model, "--engine",
           "--json", str(out), *extra]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=600, cwd=ROOT)
    seen = json.loads(out.read_text())
    assert len(seen["warm-up"]) > 10
    assert seen["load"] == [], sorted({k for k, _ in seen["load"]})
