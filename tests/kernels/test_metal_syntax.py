"""Every registered kernel, rendered for Metal and for CUDA, parses as C++ (g++ -fsyntax-only).

Metal: with custom_kernels/metal_check.h standing in for the Metal built-ins, as C++14 (MSL is
C++14-based). CUDA: with tests/kernels/cuda_emu.h standing in for the CUDA built-ins. What this
does not prove is listed in docs/kernels.md. Kernels register themselves when their module is
imported, so this imports every module of hf2q_mlx.custom_kernels first.
"""

from __future__ import annotations

import importlib
import pkgutil
import shutil
import subprocess
from pathlib import Path

import pytest

import hf2q_mlx.custom_kernels as ck
from hf2q_mlx.custom_kernels import _render

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed")

HERE = Path(__file__).resolve().parent
METAL_CHECK = Path(ck.__file__).resolve().parent / "metal_check.h"
CUDA_EMU = HERE / "cuda_emu.h"


def _all_kernels() -> list[_render.Kernel]:
    for mod in pkgutil.iter_modules(ck.__path__):
        importlib.import_module(f"hf2q_mlx.custom_kernels.{mod.name}")
    return sorted(_render.registered_kernels(), key=lambda k: k.name)


def _translation_unit(
    backend: str, kernels: list[_render.Kernel], precompiled: bool = False
) -> str:
    """Every example of every kernel, each in its own namespace: one g++ run per back end;
    ``precompiled``: the CUDA units custom_kernels/cuda_cache compiles."""
    parts = []
    for k in kernels:
        for i, ex in enumerate(k.examples):
            ns = f"case_{k.name}_{i}"
            shim = ""
            if backend == "cuda":  # the emulator's Shape/Strides, visible from the nested copy
                shim = (
                    "namespace mlx { namespace core { namespace cu { "
                    "using ::mlx::core::cu::Shape; using ::mlx::core::cu::Strides; } } }\n"
                )
            src = k.render(backend, ex, precompiled) if precompiled else k.render(backend, ex)
            parts.append(f"namespace {ns} {{\n{shim}{src}\n}}  // {ns}\n")
    return "\n".join(parts)


def _syntax_check(source: str, include: Path, std: str, tmp_path: Path) -> None:
    inc = tmp_path / "inc"
    for rel in ("metal_stdlib", "mlx/backend/cuda/device/utils.cuh", "cooperative_groups.h",
                "cuda_fp16.h", "cuda_bf16.h"):  # fmt: skip
        (inc / rel).parent.mkdir(parents=True, exist_ok=True)
        (inc / rel).touch()
    # cuda_cache's prelude takes the fixed-width integers from CCCL (no include guard: each
    # case's namespace gets its own copy)
    (inc / "cuda/std").mkdir(parents=True, exist_ok=True)
    (inc / "cuda/std/cstdint").write_text(
        "namespace cuda { namespace std { using ::int8_t; using ::int16_t; using ::int32_t; "
        "using ::int64_t; using ::uint8_t; using ::uint16_t; using ::uint32_t; "
        "using ::uint64_t; } }\n"
    )
    src = tmp_path / "kernel.cpp"
    src.write_text(source)
    cmd = [
        "g++",
        "-fsyntax-only",
        f"-std={std}",
        "-Wno-attributes",
        "-Wno-unknown-pragmas",
        "-I",
        str(inc),
        "-include",
        str(include),
        "-x",
        "c++",
        str(src),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-4000:]


def test_registry_is_not_empty():
    names = {k.name for k in _all_kernels()}
    assert "ggml_qmv_q4_k" in names and "ggml_qmv_q6_k" in names, names


@pytest.mark.parametrize(
    "backend,include,std", [("metal", METAL_CHECK, "c++14"), ("cuda", CUDA_EMU, "c++17")]
)
def test_every_kernel_parses(backend, include, std, tmp_path):
    """Errors name the failing kernel through its namespace, case_<kernel name>_<example>."""
    _syntax_check(_translation_unit(backend, _all_kernels()), include, std, tmp_path)


def test_every_precompiled_cuda_unit_parses(tmp_path):
    """The units custom_kernels/cuda_cache compiles (its prelude, no MLX header): the kernels
    that read no input's shape (those keep MLX's cuda_kernel)."""

    kernels = [k for k in _all_kernels() if not k.reads_input_shape()]
    assert len(kernels) > 20
    src = _translation_unit("cuda", kernels, precompiled=True)
    assert "cooperative_groups" not in src and "mlx/backend/cuda" not in src
    assert src.count('extern "C" __global__ void') == sum(len(k.examples) for k in kernels)
    _syntax_check(src, CUDA_EMU, "c++17", tmp_path)


def test_syntax_check_catches_errors(tmp_path):
    """The check must fail on a broken body: an undeclared name and a missing semicolon."""
    import mlx.core as mx

    bad = _render.Kernel(
        "broken_demo",
        ["x"],
        ["out"],
        "  out[0] = undeclared_name + x[0]\n",
        examples=[_render.Example({"x": mx.float32}, {"out": mx.float32})],
        register=False,
    )
    for backend, inc, std in (("metal", METAL_CHECK, "c++14"), ("cuda", CUDA_EMU, "c++17")):
        with pytest.raises(AssertionError):
            _syntax_check(bad.render(backend), inc, std, tmp_path)
