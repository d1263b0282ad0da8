"""compile_ahead: a first prefill's dry pass compiles exactly the cubins its forward then asks
for, and leaves the prefill's logits as they were (fake CUDA back end, the kernel emulator)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from hf2q_mlx import compile_ahead

HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize(
    "model, tokens", [("gemma4:tiny-moe", 23), ("qwen3_5:tiny-moe", 40)], ids=["gemma4", "qwen35"]
)
def test_dry_pass_compiles_what_the_prefill_asks_for(model, tokens, tmp_path):
    cmd = [sys.executable, str(HERE / "compile_ahead_emulated.py"), model,
           "--tokens", str(tokens), "--step", "16"]  # fmt: skip
    env = {**os.environ, "HF2Q_MLX_CACHE": str(tmp_path)}  # the markers land there
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600, env=env)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    ahead = res["compiled_ahead"]
    assert len(ahead) >= 8 and len(set(ahead)) == len(ahead), ahead  # distinct units, many
    # the real forward asked cuda_cache for those units and no other, each once
    assert sorted(res["asked_after"]) == sorted(ahead)
    assert res["second_call"] is None  # once a model
    assert res["marker_skipped"]  # a later model of the same signature: no dry pass
    assert len(list((tmp_path / "cuda_kernels" / "ahead").iterdir())) == 1
    assert res["equal"] and res["finite"]  # bit for bit the prefill without the dry pass
    # the dry graph's library warm-ups ran while the cubins compiled: each attention shape
    # (Gemma 4: sliding and global heads), and the delta-net recurrence (Qwen 3.5)
    assert res["warm_ups"]["failed"] == 0
    assert res["warm_ups"]["count"] >= 2, res["warm_ups"]


def test_off_the_gpu_and_when_switched_off(monkeypatch):
    """No CUDA back end, or HF2Q_COMPILE_AHEAD=0: the dry forward is never built."""
    built = []

    class Model:
        pass

    if mx.cuda.is_available():
        monkeypatch.setenv("HF2Q_COMPILE_AHEAD", "0")
    assert compile_ahead.once(Model(), lambda: built.append(1)) is None
    assert built == []


def test_missing_units_skips_resolved_and_repeats():
    class Spec:
        def __init__(self, unit):
            self.unit = unit

        def pending_unit(self):
            return self.unit

    specs = [Spec(("a", "src a")), Spec(None), Spec(("b", "src b")), Spec(("a", "src a"))]
    assert compile_ahead.missing_units(specs) == [("a", "src a"), ("b", "src b")]


def test_a_failing_dry_pass_is_not_the_callers_error(monkeypatch, tmp_path):
    """The dry pass is an optimization: an exception in it is reported, not raised, and what
    it collected before still compiles."""
    from hf2q_mlx.custom_kernels import _render, cuda_cache

    compiled = []

    class Spec:
        def pending_unit(self):
            return ("k", "src")

    def dry():
        _render._collected_here().append(Spec())
        raise ValueError("shapes do not match")

    class Model:
        pass

    monkeypatch.setattr(_render, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(cuda_cache, "wants_cubin", lambda: True)
    monkeypatch.setattr(cuda_cache, "cubins", lambda units, force=False: compiled.extend(units))
    monkeypatch.setattr(compile_ahead, "_can_mark", lambda: True)
    monkeypatch.delenv("HF2Q_COMPILE_AHEAD", raising=False)
    monkeypatch.setenv("HF2Q_MLX_CACHE", str(tmp_path))
    got = compile_ahead.once(Model(), dry)
    assert got["error"] == "ValueError: shapes do not match" and got["compiled"] == 1
    assert compiled == [("k", "src")] and _render._collector == []
    assert not (tmp_path / "cuda_kernels" / "ahead").exists()  # no marker: the next one retries


def test_signature_follows_what_picks_the_kernels():
    """The marker's key changes with the chunk lengths, a parameter's dtype or shape, and the
    model's arguments; not with the parameters' values."""
    import mlx.nn as nn

    def model(dims=8, dtype=mx.float32, scale=1.0):
        m = nn.Linear(dims, 4)
        m.set_dtype(dtype)
        m.weight = m.weight * scale
        m.args = ("tiny", dims)
        return m

    base = compile_ahead.signature(model(), (1, 16))
    assert compile_ahead.signature(model(scale=3.0), (1, 16)) == base
    for other in (compile_ahead.signature(model(), (1, 15)),
                  compile_ahead.signature(model(dtype=mx.bfloat16), (1, 16)),
                  compile_ahead.signature(model(dims=16), (1, 16))):  # fmt: skip
        assert other != base


@pytest.mark.parametrize("model", ["gemma4:tiny-moe", "qwen3_5:tiny-moe"], ids=["gemma4", "qwen35"])
def test_engine_warmup_compiles_its_cubins_ahead(model, tmp_path):
    """The serving engine's warm-up (fake CUDA back end, launches return zeros): its dry pass
    compiles the cubins the warm-up's prefills then ask for."""
    cmd = [sys.executable, str(HERE / "compile_ahead_emulated.py"), model, "--engine"]
    env = {**os.environ, "HF2Q_MLX_CACHE": str(tmp_path)}
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600, env=env)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["warmed"]
    ahead, asked = set(res["compiled_ahead"]), res["asked_after"]
    assert len(ahead) >= 8 and len(asked) == len(set(asked))
    assert set(asked) <= ahead, sorted(set(asked) - ahead)


def test_collecting_takes_the_calling_threads_launches_only():
    """A launch made on another thread while one thread collects (a server's other worker)
    runs as usual and is not noted."""
    import threading

    from hf2q_mlx.custom_kernels import _render

    plan = _render._CudaPlan(lambda: None, lambda: lambda inputs: ["mlx build"], {})
    launch = _render._Launch("the spec", plan)
    seen = []
    with _render.collecting() as specs:
        assert launch([]) == ["mlx build"]
        worker = threading.Thread(target=lambda: seen.append(launch([])))
        worker.start()
        worker.join()
    assert specs == ["the spec"] and seen == [["mlx build"]]
    assert _render._collector == []


def test_warm_ups_run_while_the_cubins_compile(monkeypatch):
    """The warm-ups run on the calling thread while ``cuda_cache.cubins`` works on another
    (the compile waits for the warm-up's signal: run one after the other, it would time out);
    one that raises is counted and skipped; ``HF2Q_COMPILE_AHEAD_WARM=0`` runs none."""
    import threading

    from hf2q_mlx.custom_kernels import cuda_cache

    warmed, saw = threading.Event(), []
    monkeypatch.setattr(cuda_cache, "cubins", lambda units, force=False: saw.append(warmed.wait(5)))

    def bad():
        raise RuntimeError("no such op")

    got = compile_ahead._compile_while_warming(
        [("k", "src")], [lambda: warmed.set() or mx.ones(2), bad]
    )
    assert saw == [True] and got["count"] == 2 and got["failed"] == 1
    monkeypatch.setenv("HF2Q_COMPILE_AHEAD_WARM", "0")
    warmed.clear()
    saw.clear()
    monkeypatch.setattr(
        cuda_cache, "cubins", lambda units, force=False: saw.append(warmed.is_set())
    )
    assert compile_ahead._compile_while_warming([("k", "src")], [lambda: warmed.set()]) is None
    assert saw == [False] and not warmed.is_set()


def test_attention_and_delta_net_note_shape_only_warm_ups():
    """Inside a dry pass, attention and the delta-net prefill note warm-ups of their shapes and
    dtypes; evaluated, those give arrays of the real outputs' shapes, with no dry array in
    them. Outside a dry pass nothing is noted."""
    from hf2q_mlx.custom_kernels import _render
    from hf2q_mlx.custom_kernels import gated_delta as gd
    from hf2q_mlx.models.sdpa import sdpa

    q, k = mx.random.normal((1, 4, 6, 32)), mx.random.normal((1, 2, 6, 32))
    mask = mx.random.uniform(shape=(6, 6)) > 0.3
    qkv = mx.random.normal((1, 5, 2 * 2 * 32 + 4 * 16))
    a, b = mx.random.normal((1, 5, 4)), mx.random.normal((1, 5, 4))
    conv_w, A_log, dt_bias = mx.random.normal((192, 4)), mx.zeros((4,)), mx.zeros((4,))
    with _render.collecting() as specs:
        out = sdpa(q, k, k, 0.5, mask)
        y, _, _ = gd.gated_delta_update(qkv, None, conv_w, a, b, A_log, dt_bias, None, 2, 32)
    keys = [key[0] for key in specs.warm_ups]
    assert sorted(keys) == ["gated_delta", "sdpa"], keys
    built = {key[0]: fn() for key, fn in specs.warm_ups.items()}
    assert built["sdpa"].shape == out.shape
    assert built["gated_delta"][0].shape == y.shape
    mx.eval(built)
    with _render.collecting() as again:
        pass
    sdpa(q, k, k, 0.5, mask)
    assert again.warm_ups == {}
