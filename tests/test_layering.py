"""The house's arrows point one way: custom_kernels (0) <- models (1) <- hf2q_mlx (2).

Every import of every module is read with ``ast`` (module level, inside functions, under
``if TYPE_CHECKING``; absolute and relative), so the check sees what a run might import. Rules:
(a) no import from a lower layer into a higher one; (b) custom_kernels imports only mlx, numpy,
gguf, the standard library, itself and ``hf2q_mlx.errors``; ``hf2q_mlx/errors.py`` imports
nothing of the project; (c) no circle between files. Importing a package means importing its
``__init__.py``; importing ``a.b.c`` counts as an arrow to ``c`` only (not to ``a`` and ``b``,
whose ``__init__`` files run too, but are kept free of imports that could close a circle).
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Folder on disk -> (package it installs as, layer).
FOLDERS = {
    "custom_kernels": ("hf2q_mlx.custom_kernels", 0),
    "models": ("hf2q_mlx.models", 1),
    "hf2q_mlx": ("hf2q_mlx", 2),
}
ERRORS = "hf2q_mlx.errors"  # the exceptions module: importable from every layer
KERNEL_THIRD_PARTY = {"mlx", "numpy", "gguf"}
LAYER_NAMES = {0: "custom_kernels", 1: "models", 2: "hf2q_mlx"}


@dataclass(frozen=True)
class Module:
    name: str  # dotted, as installed: hf2q_mlx.models.cache
    path: Path  # relative to the root: models/cache.py
    is_package: bool


@dataclass(frozen=True)
class Edge:
    source: Module
    line: int
    imported: str  # the dotted name as written (resolved if relative)
    target: Module | None  # the project file it lands on, None for a third-party import

    def __str__(self) -> str:
        where = f" ({self.target.path})" if self.target else ""
        return f"{self.source.path}:{self.line} -> {self.imported}{where}"


def project_modules(root: Path) -> dict[str, Module]:
    """Every .py under the three folders, keyed by the dotted name it is imported as."""
    modules = {}
    for folder, (package, _) in FOLDERS.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            name = ".".join([package, *parts])
            if name.startswith("hf2q_mlx.custom_kernels") and folder == "hf2q_mlx":
                continue  # a stray copy inside the package (built wheel): the folder rules
            modules[name] = Module(name, path.relative_to(root), is_package)
    return modules


def layer_of(name: str) -> int | None:
    """0, 1, 2 for the project's layers, None for the exceptions module."""
    if name == ERRORS:
        return None
    for package, layer in sorted(FOLDERS.values(), key=lambda pl: -len(pl[0])):
        if name == package or name.startswith(package + "."):
            return layer
    raise ValueError(name)


def _resolve(name: str, modules: dict[str, Module]) -> Module | None:
    """The project file a dotted name lands on: the longest prefix that is a module."""
    parts = name.split(".")
    while parts:
        found = modules.get(".".join(parts))
        if found is not None:
            return found
        parts.pop()
    return None


def imports_of(module: Module, root: Path, modules: dict[str, Module]) -> list[Edge]:
    tree = ast.parse((root / module.path).read_text(), filename=str(module.path))
    package = module.name if module.is_package else module.name.rpartition(".")[0]
    edges = []

    def add(node: ast.AST, name: str) -> None:
        edge = Edge(module, node.lineno, name, _resolve(name, modules))
        if edge not in edges:  # `from x import a, b` is one arrow
            edges.append(edge)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(node, alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from ..x import y
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            if stem == "__future__":
                continue
            for alias in node.names:
                # `from pkg import sub` imports the submodule when there is one
                full = f"{stem}.{alias.name}"
                add(node, full if full in modules else stem)
        elif (  # importlib.import_module("a.b") with a literal name
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            add(node, node.args[0].value)
    return edges


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one file (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def layering_problems(root: Path) -> list[str]:
    """Every broken rule in the tree at ``root``, one line per offending import."""
    modules = project_modules(root)
    problems = []
    graph: dict[str, set[str]] = {name: set() for name in modules}
    project_edges = []
    for module in modules.values():
        src_layer = layer_of(module.name)
        for edge in imports_of(module, root, modules):
            top = edge.imported.split(".")[0]
            if edge.target is None:
                if top == "hf2q_mlx":
                    problems.append(f"import of a module that does not exist: {edge}")
                elif src_layer == 0 and not (
                    top in KERNEL_THIRD_PARTY or top in sys.stdlib_module_names
                ):
                    problems.append(f"custom_kernels imports beyond mlx/numpy/gguf: {edge}")
                continue
            if edge.target == module:
                continue
            dst_layer = layer_of(edge.target.name)
            if module.name == ERRORS:
                problems.append(f"hf2q_mlx/errors.py must import nothing of the project: {edge}")
            elif dst_layer is not None and src_layer is not None and dst_layer > src_layer:
                problems.append(
                    f"upward arrow {LAYER_NAMES[src_layer]} -> {LAYER_NAMES[dst_layer]}: {edge}"
                )
            graph[module.name].add(edge.target.name)
            project_edges.append(edge)
    for component in _circles(graph):
        members = set(component)
        inside = [
            str(e) for e in project_edges if e.source.name in members and e.target.name in members
        ]
        files = ", ".join(str(modules[m].path) for m in component)
        problems.append(f"circle between {files}:\n    " + "\n    ".join(inside))
    return problems


def test_arrows_point_one_way_and_no_circles() -> None:
    problems = layering_problems(ROOT)
    assert not problems, f"{len(problems)} layering problem(s):\n" + "\n".join(problems)


def test_every_folder_is_read() -> None:
    modules = project_modules(ROOT)
    for folder, (package, _) in FOLDERS.items():
        assert package in modules, f"{folder}/__init__.py not found"
    assert ERRORS in modules


def _plant(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


CLEAN_TREE = {
    "custom_kernels/__init__.py": "",
    "custom_kernels/op.py": (
        "import mlx.core as mx\nimport numpy as np\nimport os\n"
        "from hf2q_mlx.errors import Hf2qError\nfrom . import _util\n"
    ),
    "custom_kernels/_util.py": "import gguf\n",
    "models/__init__.py": "",
    "models/block.py": "from hf2q_mlx.custom_kernels.op import x\nfrom .cache import C\n",
    "models/cache.py": "def f():\n    from hf2q_mlx.errors import Hf2qError\n",
    "hf2q_mlx/__init__.py": "",
    "hf2q_mlx/errors.py": "class Hf2qError(Exception):\n    pass\n",
    "hf2q_mlx/io/__init__.py": "",
    "hf2q_mlx/io/loader.py": (
        "import importlib\nfrom hf2q_mlx.models import block\n"
        "def load():\n    importlib.import_module('hf2q_mlx.models.cache')\n"
    ),
}


def test_checker_passes_a_clean_tree(tmp_path: Path) -> None:
    _plant(tmp_path, CLEAN_TREE)
    assert layering_problems(tmp_path) == []


def test_checker_reports_upward_arrows_and_foreign_imports(tmp_path: Path) -> None:
    _plant(tmp_path, CLEAN_TREE)
    _plant(
        tmp_path,
        {
            # inside a function and under TYPE_CHECKING still count
            "custom_kernels/op.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                "    from hf2q_mlx.models.cache import C\n"
                "def g():\n    import torch\n    from ..models import block\n"
            ),
            "models/cache.py": "from hf2q_mlx.io.loader import load\n",
            "hf2q_mlx/errors.py": "from hf2q_mlx.custom_kernels import _util\n",
        },
    )
    text = "\n".join(layering_problems(tmp_path))
    assert "upward arrow custom_kernels -> models: custom_kernels/op.py:3" in text
    assert "upward arrow custom_kernels -> models: custom_kernels/op.py:6" in text
    assert "custom_kernels imports beyond mlx/numpy/gguf: custom_kernels/op.py:5 -> torch" in text
    assert "upward arrow models -> hf2q_mlx: models/cache.py:1 -> hf2q_mlx.io.loader" in text
    assert "errors.py must import nothing of the project" in text


def test_checker_reports_circles(tmp_path: Path) -> None:
    _plant(tmp_path, CLEAN_TREE)
    # models/block.py -> models/cache.py already; close the loop inside a function
    _plant(tmp_path, {"models/cache.py": "def f():\n    from hf2q_mlx.models import block\n"})
    problems = layering_problems(tmp_path)
    assert len(problems) == 1
    assert "circle between models/block.py, models/cache.py" in problems[0]
    assert "models/cache.py:2 -> hf2q_mlx.models.block" in problems[0]
    assert "models/block.py:2 -> hf2q_mlx.models.cache" in problems[0]


def test_checker_counts_a_package_import_as_its_init(tmp_path: Path) -> None:
    _plant(tmp_path, CLEAN_TREE)
    # custom_kernels/__init__.py imports op, op imports the package: a circle through __init__
    _plant(
        tmp_path,
        {
            "custom_kernels/__init__.py": "from hf2q_mlx.custom_kernels.op import y\n",
            "custom_kernels/op.py": "import hf2q_mlx.custom_kernels\n",
        },
    )
    problems = layering_problems(tmp_path)
    assert len(problems) == 1 and "custom_kernels/__init__.py, custom_kernels/op.py" in problems[0]


def test_internals_doc_names_files_that_exist() -> None:
    """docs/internals.md draws this layering; every file it names must exist."""
    import re

    text = (ROOT / "docs" / "internals.md").read_text()
    files = {p.relative_to(ROOT).as_posix() for f in FOLDERS for p in (ROOT / f).rglob("*.py")}
    basenames = {Path(f).name for f in files} | {Path(f).parent.name + "/" for f in files}
    picture = text.split("```", 2)[1]
    missing = [n for n in re.findall(r"[\w/]+\.py|\b\w+/(?=\s)", picture) if n not in basenames]
    paths = re.findall(r"`((?:custom_kernels|models|hf2q_mlx)/[\w/.]*\.py)`", text)
    missing += [p for p in paths if p not in files]
    assert not missing, f"docs/internals.md names files that do not exist: {missing}"
