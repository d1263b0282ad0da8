"""bench/speed_table.py (issue 15's table command): a CPU smoke run writes every column it
promises, and the bar checks flag what misses them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import speed_table as st  # noqa: E402


def test_tiny_run_writes_every_column(tmp_path):
    out = tmp_path / "table.json"
    st.main([str(out), "--tiny", "--shapes", "qwen3_5:tiny", "--rounds", "2", "--tokens", "2",
             "--profile-steps", "2", "--prompt", "24", "--chunk", "16", "--no-mlx-lm"])  # fmt: skip
    res = json.loads(out.read_text())["shapes"][0]
    assert res["shape"] == "qwen3_5:tiny" and res["decode_path"] == "eager"  # the CPU's path
    assert set(res["variants"]) == {"ours q4_k", "ours mlx4"}
    for row in res["variants"].values():
        for what in ("decode", "prefill"):
            s = row[what]
            assert len(s["values"]) == 2 and 0 < s["min"] <= s["median"] <= s["max"]
        assert row["profile"]["python_ms"] > 0 and row["profile"]["wall_ms"] > 0
        assert "weight_gb_s" in row and "decode_ratio" not in row  # dense; no mlx-lm column
    # MLX's memory after each variant's first prefill and after the rounds (no driver figures
    # on the CPU)
    mem = res["memory_after_first"]
    assert set(mem) == {"ours q4_k", "ours mlx4", "after_rounds"}
    assert all(m["active_gb"] > 0 and "device_free_gb" not in m for m in mem.values())


def test_skipped_variants_are_built_but_not_timed(tmp_path):
    """--skip leaves a variant out of the rounds (the mlx4 model is still built: an mlx-lm twin
    would need it)."""
    out = tmp_path / "table.json"
    st.main([str(out), "--tiny", "--shapes", "qwen3_5:tiny", "--rounds", "1", "--tokens", "2",
             "--profile-steps", "2", "--prompt", "24", "--chunk", "16", "--no-mlx-lm",
             "--skip", "ours mlx4, nothing"])  # fmt: skip
    res = json.loads(out.read_text())["shapes"][0]
    assert set(res["variants"]) == {"ours q4_k"}


def _row(decode_ratio: float, spread_values: list[float]) -> dict:
    return {"decode": st.stats(spread_values), "prefill": st.stats([100.0]),
            "decode_ratio": st.stats([decode_ratio]), "prefill_ratio": st.stats([1.2]),
            "profile": {"python_ms": 0.5, "kernels": 240.0, "kernels_per_layer": 8.0,
                        "gpu_busy": 0.9}}  # fmt: skip


def test_report_flags_missed_bars():
    res = {
        "shape": "s",
        "layers": 30,
        "moe": True,
        "prompt": 8,
        "tokens": 2,
        "decode_path": "compiled",
        "first_prefill_s": {},
        "variants": {
            "ours q4_k": _row(2.4, [100.0, 100.0]),  # below 2.5x on a MoE shape
            "ours mlx4": _row(3.0, [100.0, 100.0, 120.0]),  # 20 % spread
            "mlx-lm mlx4": _row(1.0, [10.0, 30.0]),
        },
    }  # not ours: never flagged
    missed = st.report(res, None)
    assert missed == [
        "s ours q4_k: decode x mlx-lm 2.4 (bar 2.5)",
        "s ours mlx4: spread 0.2 (bar 0.15)",
    ]
    res["moe"] = False  # dense: 1.5x is the bar
    assert st.report(res, None) == ["s ours mlx4: spread 0.2 (bar 0.15)"]
    # a format with a graph row is judged on that row alone
    res["moe"] = True
    res["variants"]["ours q4_k graph"] = _row(2.2, [100.0, 100.0])
    assert st.report(res, None) == [
        "s ours mlx4: spread 0.2 (bar 0.15)",
        "s ours q4_k graph: decode x mlx-lm 2.2 (bar 2.5)",
    ]


def test_graph_rows_follow_the_default_decode_path(monkeypatch):
    """--graph auto runs every format as the CUDA graph where that is what stream_generate
    decodes through, and none elsewhere; 'none' and a written list are taken as said."""
    formats = ["q4_k", "mlx4"]
    assert st.graph_formats("auto", formats, graph_default=True) == formats
    assert st.graph_formats("auto", formats, graph_default=False) == []
    assert st.graph_formats("none", formats, graph_default=True) == []
    assert st.graph_formats("q4_k", formats, graph_default=False) == ["q4_k"]
    # on this machine: graph only with MLX on CUDA and HF2Q_DECODE auto or graph
    monkeypatch.setenv("HF2Q_DECODE", "compiled")
    assert st.graph_formats("auto", formats) == []
    monkeypatch.setenv("HF2Q_DECODE", "graph")
    assert st.graph_formats("auto", formats) == (formats if mx.cuda.is_available() else [])


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(10, 4)
        self.proj = nn.Linear(4, 4, bias=False)


class _Untied(_Tied):
    def __init__(self):
        super().__init__()
        self.lm_head = nn.Linear(4, 10, bias=False)


def test_weight_bytes_counts_a_tied_table_once_as_the_head():
    tied, untied = _Tied(), _Untied()
    mx.eval(tied.parameters(), untied.parameters())
    assert st.weight_bytes(tied) == (40 + 16) * 4  # the table is read whole as the head
    assert st.weight_bytes(untied) == (16 + 40) * 4  # the head, not the gathered table


PEERS = Path(__file__).resolve().parents[2] / "shared" / "peers" / "llama-cpu-x86_64.tar.xz"


def test_llama_cpp_column_on_the_same_gguf(tmp_path):
    """--llama: the shape written as a GGUF, ours Q4_K loaded from it, llama-bench once per
    round on it; the peer's row and ours / llama.cpp per round; the file removed after."""
    if not PEERS.is_file():
        pytest.skip(f"no llama.cpp CPU bundle at {PEERS}")
    subprocess.run(["tar", "-xJf", str(PEERS), "-C", str(tmp_path)], check=True)
    out, gguf_dir = tmp_path / "table.json", tmp_path / "gguf"
    gguf_dir.mkdir()
    args = "--tiny --shapes qwen3_5:tiny --formats q4_k --rounds 2 --tokens 3 --prompt 16"
    llama = ["--llama", str(tmp_path / "bin"), "--llama-args", "-t 2", "--gguf-dir", str(gguf_dir)]
    st.main([str(out), *args.split(), "--profile-steps", "2", "--no-mlx-lm", *llama])
    res = json.loads(out.read_text())["shapes"][0]
    peer, ours = res["llama.cpp"], res["variants"]["ours q4_k"]
    assert len(peer["decode"]["values"]) == 2 and peer["decode"]["min"] > 0
    assert peer["prefill"]["min"] > 0
    ratio = ours["decode_ratio_llama"]["values"]
    assert ratio == [x / y for x, y in zip(ours["decode"]["values"], peer["decode"]["values"])]
    assert res["gguf"].startswith(str(gguf_dir)) and not list(gguf_dir.iterdir())


def test_env_ab_gives_each_setting_its_own_worker(tmp_path):
    """bench/mlx_env_ab.py: every setting reaches its own worker process's environment (MLX
    reads them once per process), and each gets a rate per round and a ratio to the first."""
    out = tmp_path / "env.json"
    cmd = [sys.executable, str(Path(st.__file__).with_name("mlx_env_ab.py")), str(out), "--tiny",
           "--env", "", "--env", "MLX_MAX_OPS_PER_BUFFER=7,MLX_BFS_MAX_WIDTH=3",
           "--tokens", "2", "--rounds", "2", "--prompt", "16"]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    res = json.loads(out.read_text())
    label = "MLX_MAX_OPS_PER_BUFFER=7,MLX_BFS_MAX_WIDTH=3"
    assert list(res["settings"]) == ["default", label] and res["step"] == "compiled"
    assert "'MLX_MAX_OPS_PER_BUFFER': '7'" in res["workers"][label]
    assert "'MLX_BFS_MAX_WIDTH': '3'" in res["workers"][label]
    for row in res["settings"].values():
        assert len(row["tok_s"]) == 2 and all(r > 0 for r in row["tok_s"])
    assert res["settings"]["default"]["ratios"] == [1.0, 1.0]
    bad = subprocess.run(cmd[:3] + ["--env", "NOVALUE"], capture_output=True, text=True)
    assert bad.returncode == 2 and "expected NAME=VALUE" in bad.stderr


def test_env_setting_values_may_hold_commas():
    """A comma starts a new setting only before NAME=: HF2Q_EXPERT_RUN's "R,U,W" stays one
    value (session 45: the step that A/Bs it stopped at the parser)."""
    from mlx_env_ab import parse_env

    assert parse_env("HF2Q_EXPERT_RUN=2,1,1") == {"HF2Q_EXPERT_RUN": "2,1,1"}
    assert parse_env("A=1, B_2=x,y") == {"A": "1", "B_2": "x,y"}
    assert parse_env("") == {}
    with pytest.raises(ValueError, match="expected NAME=VALUE"):
        parse_env("2,1,1")


def test_profile_counts_kernels_apart_from_copies(monkeypatch):
    """CUPTI's records of a graph step include its copy nodes and the uploads (Memcpy / Memset):
    kernels per token count kernels only; GPU busy counts every record's time."""
    import decode_profile as dp
    import speed_table as st

    records = [("ggml_qmv", 30.0), ("Memcpy HtoD (Pageable -> Device)", 2.0),
               ("Memcpy DtoD (Device -> Device)", 4.0), ("topk", 4.0),
               ("Memset (Device)", 1.0), ("moe_router", 9.0)]  # fmt: skip
    monkeypatch.setattr(dp, "_cuda_kernels", lambda prof: records * 2)

    class Prof:
        def __exit__(self, *a):
            pass

    out = st._cupti_stop(Prof(), {"wall_ms": 0.1}, 2)
    assert out["kernels"] == 3 and out["copies"] == 3
    assert abs(out["kernel_ms"] - 0.05) < 1e-12 and abs(out["gpu_busy"] - 0.5) < 1e-9


def test_profile_by_launch_keeps_one_kernels_shapes_apart():
    """``decode_profile.by_launch`` groups a trace's kernel records by (name, grid, block): the
    same mat-vec at two grids gives two rows (calls and us per token each), CPU-side records
    and non-kernel events are left out, and the most GPU time comes first."""
    import decode_profile as dp

    def kernel(name, grid, dur, regs=96):
        return {"ph": "X", "cat": "kernel", "name": name, "dur": dur,
                "args": {"grid": [grid, 1, 1], "block": [256, 1, 1],
                         "registers per thread": regs}}  # fmt: skip

    events = [kernel("qmv", 336, 20.0), kernel("qmv", 15520, 300.0), kernel("qmv", 336, 22.0),
              kernel("norm", 1, 3.0, 32), {"ph": "X", "cat": "cpu_op", "name": "qmv", "dur": 9e3},
              {"ph": "i", "cat": "kernel", "name": "qmv", "dur": 5e3}]  # fmt: skip
    rows = dp.by_launch({"traceEvents": events}, n=2)
    assert [(r["kernel"], r["grid"][0]) for r in rows] == [("qmv", 15520), ("qmv", 336),
                                                           ("norm", 1)]  # fmt: skip
    assert rows[1]["per_token"] == 1.0 and rows[1]["us_per_token"] == 21.0
    assert rows[1]["avg_us"] == 21.0 and rows[0]["registers"] == 96 and rows[2]["registers"] == 32
    assert dp.by_launch({"traceEvents": events}, n=2, top=1) == rows[:1]
