"""The benches' mlx-lm columns (mlx-lm 0.32.2, a test dependency) run on tiny random models, so
a change of mlx-lm's API fails here on the CPU instead of costing an H200 call: the decode and
prefill twin of bench/speed_table.py and the BatchGenerator of bench/serve_throughput.py (mlx-lm
0.32's ``next()`` returns a (prompt, generation) pair, which once left that column empty)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
import pytest

pytest.importorskip("mlx_lm")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import serve_throughput as sv  # noqa: E402
import speed_table as st  # noqa: E402


@pytest.mark.parametrize("shape", ["gemma4:tiny-moe", "qwen3_5:tiny-moe"])
def test_speed_table_mlx_lm_column(tmp_path, shape):
    out = tmp_path / "table.json"
    args = "--tiny --formats mlx4 --rounds 2 --tokens 3 --profile-steps 2 --prompt 20 --chunk 8"
    st.main([str(out), "--shapes", shape, *args.split()])
    rows = json.loads(out.read_text())["shapes"][0]["variants"]
    assert set(rows) == {"ours mlx4", "mlx-lm mlx4"}
    ratio = rows["ours mlx4"]["decode_ratio"]
    assert len(ratio["values"]) == 2 and ratio["min"] > 0
    assert rows["mlx-lm mlx4"]["decode_ratio"]["values"] == [1.0, 1.0]


@pytest.mark.parametrize("shape", ["tiny-gemma4", "tiny-qwen3.5"])
def test_serve_throughput_mlx_lm_batch_generator(shape):
    model, config, family = sv.build(shape, "mlx4", mx.float32)
    twin = sv.mlx_lm_twin(family, config, model)
    r = sv.run_mlx_lm(twin, 2, 3, config["vocab_size"])
    # each of the 2 streams stamps its 3 tokens; the rates and latencies come from them
    assert r["streams"] == 2 and r["tokens"] == 6
    assert r["decode_tok_s"] > 0 and r["ttft_p50_ms"] > 0 and r["itl_p50_ms"] > 0
