"""hf2q_mlx: GGUF (K-quants included) and Hugging Face LLMs on MLX with custom GPU kernels.

Public API: ``load(path=None) -> (model, tokenizer)``, ``stream_generate(...)`` yielding
``GenerationResponse`` objects, ``generate(...) -> str`` and ``BatchGenerator`` (many prompts
decoded together, hf2q_mlx.serving), and ``embed(model, tokenizer, texts) -> (N, D)`` for
embedding models.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# An fp32 request gets fp32 accuracy: MLX's CUDA back end runs fp32 matmuls as TF32 (fp16-level
# error) unless told not to; the bf16/fp16 paths are unaffected. Read by MLX at its first matmul.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

__version__ = "0.1.0"

__all__ = [
    "load",
    "generate",
    "stream_generate",
    "GenerationResponse",
    "BatchGenerator",
    "embed",
    "__version__",
]

# Resolved on first use so `import hf2q_mlx` (and the CLI's --help) stays fast.
_LAZY = {
    "load": "hf2q_mlx.io.loader",
    "generate": "hf2q_mlx.generation",
    "stream_generate": "hf2q_mlx.generation",
    "GenerationResponse": "hf2q_mlx.generation",
    "BatchGenerator": "hf2q_mlx.serving.batch_generator",
    "embed": "hf2q_mlx.embedding",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hf2q_mlx' has no attribute {name!r}")


class _SourceTreeFinder:
    """Finds ``hf2q_mlx.custom_kernels`` and ``hf2q_mlx.models`` in a checkout's top-level
    folders, where an installed wheel has them inside the package (docs/internals.md)."""

    def __init__(self, folders: dict[str, Path]) -> None:
        self.folders = folders

    def find_spec(self, name: str, path=None, target=None):
        folder = self.folders.get(name)
        if folder is None:
            return None
        from importlib.util import spec_from_file_location

        init = folder / "__init__.py"
        return spec_from_file_location(name, init, submodule_search_locations=[str(folder)])


def _mount_source_tree() -> None:
    here = Path(__file__).parent
    names = ("custom_kernels", "models")
    if any((here / n).is_dir() for n in names):
        return  # installed: setuptools copied them into the package
    folders = {f"{__name__}.{n}": here.parent / n for n in names}
    if all((f / "__init__.py").is_file() for f in folders.values()):
        if not any(isinstance(f, _SourceTreeFinder) for f in sys.meta_path):
            sys.meta_path.append(_SourceTreeFinder(folders))


_mount_source_tree()


def _fast_cpu_blas() -> None:
    # before anything imports mlx: libmlx binds its BLAS on load (custom_kernels/cpu_blas.py)
    import warnings

    if "mlx.core" not in sys.modules:
        from hf2q_mlx.custom_kernels import cpu_blas
        from hf2q_mlx.errors import Hf2qError

        try:
            cpu_blas.enable()
        except Hf2qError as err:  # a bad $HF2Q_CPU_BLAS: say so, keep the reference BLAS
            warnings.warn(str(err), stacklevel=2)
    elif _cpu_blas_missed():
        warnings.warn(
            "mlx.core was imported before hf2q_mlx, so MLX's CPU matmuls keep the Linux mlx "
            "wheel's reference BLAS (several times slower on the CPU): import hf2q_mlx first "
            "(HF2Q_CPU_BLAS=off silences this)",
            stacklevel=3,
        )


def _cpu_blas_missed() -> bool:
    """mlx.core came first on Linux, computing on the CPU, with the routing not turned off."""
    from hf2q_mlx.custom_kernels import cpu_blas

    if not cpu_blas.wanted():
        return False
    mx = sys.modules["mlx.core"]
    try:
        return mx.default_device() == mx.cpu
    except Exception:  # an MLX without these names: nothing to say
        return False


_fast_cpu_blas()
