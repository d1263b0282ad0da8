"""A fresh clone works however it is installed (docs/internals.md, "Source tree and wheel").

The wheel maps the top-level folders custom_kernels/ and models/ into the package
(pyproject's package-dir) and ships custom_kernels/metal_check.h; in a checkout,
``hf2q_mlx/__init__.py`` finds the same two subpackages in the top-level folders.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Folder in the checkout -> where it lands in the installed package.
SHIPPED = {
    "hf2q_mlx": "hf2q_mlx",
    "custom_kernels": "hf2q_mlx/custom_kernels",
    "models": "hf2q_mlx/models",
}
DATA_FILES = ["hf2q_mlx/custom_kernels/metal_check.h"]


def _source_files() -> set[str]:
    """Every file the wheel must hold, as its path inside the installed tree."""
    files = set(DATA_FILES)
    for folder, target in SHIPPED.items():
        for path in (ROOT / folder).rglob("*.py"):
            files.add(f"{target}/{path.relative_to(ROOT / folder).as_posix()}")
    return files


def _can_build_without_isolation() -> bool:
    """pyproject asks for setuptools >= 68; a fresh venv may hold an older one without wheel."""
    try:
        version = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        return False
    return int(version.split(".")[0]) >= 70  # 70.1+ builds wheels without the wheel package


@pytest.fixture(scope="module")
def wheel_tree(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """Build the wheel from a copy of the checkout and unpack it as site-packages would."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"  # a copy, so the build's build/ and *.egg-info stay out of the checkout
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in SHIPPED:
        shutil.copytree(ROOT / folder, src / folder, ignore=ignore)
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp / "dist")]
    if _can_build_without_isolation():
        cmd.append("--no-build-isolation")
    res = subprocess.run([*cmd, str(src)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    (wheel,) = (tmp / "dist").glob("hf2q_mlx-*.whl")
    site = tmp / "site"
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        zf.extractall(site)
    return site, names


def _run(args: list[str], cwd: Path, pythonpath: Path | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    res = subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    return res.stdout


def test_wheel_holds_every_module_and_the_metal_header(wheel_tree) -> None:
    _, names = wheel_tree
    missing = sorted(_source_files() - set(names))
    assert not missing, f"not in the wheel: {missing}"
    # nothing generic like `models` lands at the top of site-packages
    tops = {n.split("/")[0] for n in names}
    assert all(t == "hf2q_mlx" or t.startswith("hf2q_mlx-") for t in tops), tops


# Imports what the installed package is made of, with the same expression the metal syntax test
# (tests/kernels/test_metal_syntax.py) uses to find metal_check.h.
PROBE = """
from pathlib import Path
import hf2q_mlx, hf2q_mlx.custom_kernels as ck, hf2q_mlx.models as models
import hf2q_mlx.models.turboquant
hf2q_mlx.load
print(hf2q_mlx.__file__)
print(ck.__file__)
print(models.__file__)
print((Path(ck.__file__).resolve().parent / "metal_check.h").is_file())
"""


def test_installed_wheel_imports_from_elsewhere(wheel_tree, tmp_path: Path) -> None:
    site, _ = wheel_tree
    package, kernels, models, header = _run(["-c", PROBE], tmp_path, site).split()
    for path in (package, kernels, models):
        assert Path(path).is_relative_to(site), path
    assert header == "True"
    assert "usage: hf2q-mlx" in _run(["-m", "hf2q_mlx", "--help"], tmp_path, site)


def test_checkout_imports_from_the_repo_root() -> None:
    package, kernels, models, header = _run(["-c", PROBE], ROOT).split()
    assert Path(package) == ROOT / "hf2q_mlx" / "__init__.py"
    assert Path(kernels) == ROOT / "custom_kernels" / "__init__.py"
    assert Path(models) == ROOT / "models" / "__init__.py"
    assert header == "True"
    assert "usage: hf2q-mlx" in _run(["-m", "hf2q_mlx", "--help"], ROOT)


def _readme_setup_commands() -> list[str]:
    """The command lines of the README's "Set up" code block."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Set up", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_ci_runs_the_readme_setup_commands_as_written() -> None:
    commands = _readme_setup_commands()
    assert any("python3 -m pytest -q" in c for c in commands), commands
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    missing = [c for c in commands if c not in ci_lines]
    assert not missing, f".ci/run does not run these README lines as written: {missing}"
    assert not [line for line in ci_lines if " -e " in line], ".ci/run installs editable"
    # a worker-process count needs pytest-xdist in the extra the same line installs
    if any(" -n " in c.split("pytest", 1)[-1] for c in commands if "pytest" in c):
        extras = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1]
        test_extra = extras.split("\ntest = [", 1)[1].split("]", 1)[0]
        assert '"pytest-xdist' in test_extra, "the README's -n needs pytest-xdist in [test]"
