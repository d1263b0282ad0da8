"""bench/dense_prefill.py (where a dense GGML linear's prefill time goes): a CPU smoke run
writes every case it promises, each with its times."""

from __future__ import annotations

import json
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
