"""Row parity of the compiled decode step on a GPU: a row's logits have the same bits whether it
decodes alone, in a batch, or as one position of a speculative verify.

Greedy speculation and batched serving promise the tokens of plain one-row decoding. In bf16 a
near tie between two logits is common, so "close" is not enough: every kernel on the step's
path must give a row the bits it has alone (GGML mat-vecs at any M, attention whatever the
batch or tokens per row, the delta-net over L tokens). Random GGML weights (Q4_K and friends,
as the benches build them; Q5_0 / Q8_0 on tiny Llama and Gemma 3), bf16, prompts that cross
Gemma's sliding window. The CPU runs the references, whose row parity the CPU tests check
elsewhere (tests/test_lm_head_rows.py, tests/kernels/*rows*); this file is GPU-only.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import requires_gpu

from hf2q_mlx.decode_step import DecodeStep

BENCH = Path(__file__).resolve().parents[1] / "bench"
STEPS = 6  # tokens per row: one verify of 6, or 6 one-token decodes
LENGTHS = (5, 23, 12)  # prompt per row; Gemma 4 tiny's window is 16


def _build(name: str):
    """bench/decode_profile.build(family, shape, "q4_k", bf16): random GGML weights; "llama" /
    "gemma3": the tiny models of tests/test_fused_projections.py with Q5_0 / Q8_0 projections
    (64 features: 32-blocks), cast to bf16."""
    family, shape = name.split(":")
    if family in ("llama", "gemma3"):
        import test_fused_projections as tfp
        from gguf import GGMLQuantizationType as T

        types = {p: (T.Q5_0 if i % 2 else T.Q8_0) for i, p in enumerate(tfp.PROJ)}
        model = tfp.tiny_model(family, types)
        model.set_dtype(mx.bfloat16)
        model.fuse_projections()
        return model, 80
    spec = importlib.util.spec_from_file_location("_parity_profile", BENCH / "decode_profile.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    model, vocab = module.build(family, shape, "q4_k", mx.bfloat16)
    return model, vocab


def _rows(step: DecodeStep, prompts, conts) -> np.ndarray:
    """Prefill each row, then STEPS one-token decodes of every row -> (B, STEPS, V) fp32."""
    for r, p in enumerate(prompts):
        step.prefill(r, p)
    out = [step.decode([c[i] for c in conts]).astype(mx.float32) for i in range(STEPS)]
    return np.stack([np.array(o) for o in out], axis=1)


@requires_gpu
@pytest.mark.parametrize("name", ["gemma4:tiny-moe", "gemma4:tiny-dense", "qwen3_5:tiny",
                                  "qwen3_5:tiny-moe", "llama:tiny", "gemma3:tiny"])  # fmt: skip
def test_gpu_rows_bit_identical_alone_batched_and_verified(name):
    with mx.stream(mx.gpu):
        model, vocab = _build(name)
        rng = np.random.default_rng(3)
        prompts = [rng.integers(0, vocab, n).tolist() for n in LENGTHS]
        conts = [rng.integers(0, vocab, STEPS).tolist() for _ in LENGTHS]
        B = len(LENGTHS)
        batched = _rows(DecodeStep(model, B, 64, reserve=STEPS - 1), prompts, conts)
        for r in range(B):
            alone = _rows(DecodeStep(model, 1, 64, reserve=STEPS - 1), [prompts[r]], [conts[r]])
            same = (alone[0] == batched[r]).all(axis=-1)
            assert same.all(), f"{name}: row {r} in a batch of {B} differs alone at {~same}"
        step = DecodeStep(model, B, 64, reserve=STEPS - 1)
        for r, p in enumerate(prompts):
            step.prefill(r, p)
        # verify position i predicts the token after conts[r][i], as decode step i does
        verified = np.array(step.verify(conts).astype(mx.float32))
        same = (verified == batched).all(axis=-1)
        assert same.all(), f"{name}: verify positions differ from one-token decodes: {~same}"
