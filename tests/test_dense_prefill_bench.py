"""bench/dense_prefill.py (where a dense GGML linear's prefill time goes): a CPU smoke run
writes every case it promises, each with its times."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import dense_prefill as dp  # noqa: E402


def test_tiny_run_writes_every_case(tmp_path):
    out = tmp_path / "dense.json"
    dp.main([str(out), "--tiny", "--rounds", "2", "--tokens", "70"])
    res = json.loads(out.read_text())
    assert res["timing"] == "wall time" and res["copy_GBps"] > 0
    assert [r["shape"] for r in res["rows"]] == [s[0] for s in dp.TINY]
    for r in res["rows"]:
        assert r["T"] == 70 and set(r["us"]) == {"ours", "dequant", "matmul", "mlx q4"}
        for t in r["us"].values():
            assert 0 < t["min"] <= t["median"] <= t["max"]


def test_grouped_cases_set_their_switches(tmp_path, monkeypatch):
    """Where the grouped kernels take the shape (faked here: CUDA, the one-expert path an
    fp32 product), the "grouped" and "grouped nt4" cases run with their switches set, each
    restored after; their error to ours is reported."""
    import mlx.core as mx

    seen = []

    def fake(x, w, t, k):
        seen.append((os.environ.get("HF2Q_DENSE_PREFILL"), os.environ.get("HF2Q_GROUPED_WIDE_NT")))
        return (x.astype(mx.float32) @ dp.dequantize_reference(w, t, k).T).astype(x.dtype)

    monkeypatch.setattr(dp, "backend", lambda: "cuda")
    monkeypatch.setattr(dp, "dequantize", lambda w, k: dp.dequantize_reference(w, dp.GT.Q4_K, k))
    monkeypatch.setattr(dp.EM, "dense_grouped_matmul", fake)
    monkeypatch.delenv("HF2Q_DENSE_PREFILL", raising=False)
    monkeypatch.delenv("HF2Q_GROUPED_WIDE_NT", raising=False)
    out = tmp_path / "dense.json"
    dp.main([str(out), "--tiny", "--rounds", "1", "--tokens", "70", "--no-cupti"])
    row = json.loads(out.read_text())["rows"][0]
    assert {"grouped", "grouped nt4"} <= set(row["us"])
    assert row["max_err_vs_ours"]["grouped"] < 0.05  # bf16 outputs of the same product
    assert set(seen) == {("grouped", None), ("grouped", "4")}
    assert "HF2Q_DENSE_PREFILL" not in os.environ and "HF2Q_GROUPED_WIDE_NT" not in os.environ
