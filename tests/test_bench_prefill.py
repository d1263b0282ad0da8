"""bench/prefill.py's ``--env`` variants reach switches that a module reads once, at import
(HF2Q_EXPERT_PREFILL, HF2Q_GROUPED_SLICE_COPY): session 13's ``--env
HF2Q_EXPERT_PREFILL=dequant32`` set only the environment, so its "dequant32" rows ran the
default path and read as "even"."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import prefill as pf  # noqa: E402

from hf2q_mlx.custom_kernels import expert_matmul as EXM  # noqa: E402


class _Probe:
    """A 'model' that records the expert prefill switches each forward sees."""

    def __init__(self):
        self.seen = []

    def make_cache(self):
        return []

    def __call__(self, x, cache):
        self.seen.append((EXM.prefill_mode(), EXM.GROUPED_SLICE_COPY, os.environ.get("X_PROBE")))
        return mx.zeros((1, x.shape[1], 4))


def test_env_variant_sets_import_time_switches_and_restores_them():
    before = (EXM.prefill_mode(), EXM.GROUPED_SLICE_COPY, os.environ.get("X_PROBE"))
    probe = _Probe()
    env = {"HF2Q_EXPERT_PREFILL": "dequant32", "HF2Q_GROUPED_SLICE_COPY": "0", "X_PROBE": "on"}
    pf.Variant(probe, env, chunk=4).prefill(mx.zeros((1, 10), mx.int32))
    assert probe.seen == [("dequant32", False, "on")] * 3  # chunks of 4: 4 + 4 + 2 tokens
    assert (EXM.prefill_mode(), EXM.GROUPED_SLICE_COPY, os.environ.get("X_PROBE")) == before
