"""hf2q_mlx: GGUF (K-quants included) and Hugging Face LLMs on MLX with custom GPU kernels.

Public API: ``load(path=None) -> (model, tokenizer)``, ``stream_generate(...)`` yielding
``GenerationResponse`` objects, and ``generate(...) -> str``.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["load", "generate", "stream_generate", "GenerationResponse", "__version__"]

# Resolved on first use so `import hf2q_mlx` (and the CLI's --help) stays fast.
_LAZY = {
    "load": "hf2q_mlx.loader",
    "generate": "hf2q_mlx.generate",
    "stream_generate": "hf2q_mlx.generate",
    "GenerationResponse": "hf2q_mlx.generate",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hf2q_mlx' has no attribute {name!r}")
