"""bench/first_prefill.py (where a fresh process's first prefill spends its time) on a tiny
model on the CPU: every wrapped call is recorded and unwrapped afterwards, the exclusive times
add up to no more than the prefill they came from, and the JSON names the classes and ops."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import first_prefill as fp  # noqa: E402

from hf2q_mlx.models import ops  # noqa: E402


def test_tiny_run_attributes_the_prefill(tmp_path):
    out = tmp_path / "fp.json"
    res = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "first_prefill.py"), str(out), "--tiny",
         "--prompt", "64", "--top", "5"],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads(out.read_text())
    assert len(data["prefill_s"]) == 3 and all(s > 0 for s in data["prefill_s"])
    classes = {r["class"]: r for r in data["classes"]}
    for name in ("DecoderLayer", "Attention", "ops.attention", "ops.qk_norm_rope"):
        assert classes[name]["calls"] > 0, name
    for run, total in ((1, data["prefill_s"][0]), (2, data["prefill_s"][1])):
        spent = sum(r[f"build_{run}"] + r[f"eval_{run}"] for r in data["classes"])
        assert 0 < spent <= total * 1.01, (run, spent, total)  # exclusive: no time counted twice
    assert len(data["paths"]) == 5 and "cuda_cache" in data


def test_timer_restores_what_it_wrapped():
    import mlx.core as mx
    import mlx.nn as nn

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def __call__(self, x):
            return ops.rms_norm(self.proj(x), None, 1e-6)

    Tiny.__module__ = "models.tiny_probe"  # counted as one of ours
    before = {k: v for k, v in vars(ops).items() if callable(v)}
    model = Tiny()
    timer = fp.CallTimer(model)
    timer.on = True
    try:  # restored even when an assertion fails: a wrapped ops would break later tests
        mx.eval(model(mx.ones((2, 4))))
        assert [r[1] for r in timer.records] == ["ops.rms_norm", "Tiny"]
    finally:
        timer.restore()
    assert "timed" not in Tiny.__call__.__qualname__
    assert all(getattr(ops, k) is v for k, v in before.items())


def test_mlx_jit_modules_in_write_order(tmp_path, monkeypatch):
    """MLX's PTX cache files written after the start, oldest first, each with the gap since
    the one before (the first's from the start); older files are not this process's."""
    import os

    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    for name, t in (("old_gather", 50.0), ("scatter_b", 103.5), ("gather_a", 101.0)):
        for ext in ("ptx", "txt"):
            f = tmp_path / f"{name}.{ext}"
            f.write_text("x")
            os.utime(f, (t, t))
    got = fp.mlx_jit_modules(since=100.0)
    assert got == [{"module": "gather_a", "after_s": 1.0}, {"module": "scatter_b", "after_s": 2.5}]
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "absent"))
    assert fp.mlx_jit_modules(since=0.0) == []
