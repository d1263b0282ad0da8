"""The CPU mat-vec for GGML weights (``ggml_matvec.cpp``): an MLX C++ extension built on first use.

MLX has no fast CPU kernel for GGML block formats (its CPU ``quantized_matmul`` on the affine
repack runs ~1.5 GMAC/s in fp32); this extension computes y (M, N) = x (M, K) @ dequant(W).T
for a few rows of x in fp32 (x as given: no 8-bit requantization) with AVX2 + FMA, the N rows
split over the cores. ``load()`` compiles it once per (source, mlx, nanobind, Python) with
cmake into ``cache_dir()``, under a file lock so that two processes do not build at once, and
imports it. On any failure (no cmake or compiler, nanobind missing, an ABI mismatch with the
installed mlx) it prints one line to stderr and returns None: callers keep their MLX path.
``HF2Q_CPU_EXT=0`` turns it off; ``HF2Q_CPU_EXT_THREADS=n`` sets its threads (default: one
per core). The module also holds the models' CPU RMS norm and RoPE as one-op primitives
(``fused_ops.cpp``; ``HF2Q_CPU_FUSED=0`` keeps MLX's fallbacks of mx.fast's ops).

The module must be built against the nanobind mlx.core was built with (the ``mx.array`` type
crosses between the two only when their nanobind internals match: nanobind 3.1's, domain
"mlx", for mlx 0.32.4); the import is followed by one tiny product checked against the
reference dequantizer, so a module that loads but cannot take ``mx.array`` counts as a failure.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

import mlx.core as mx
from gguf import GGMLQuantizationType as T

from hf2q_mlx.custom_kernels import env_int

ENV_VAR = "HF2Q_CPU_EXT"
MODULE_NAME = "_hf2q_cpu_matvec"  # NB_MODULE's name in ggml_matvec.cpp
SOURCES = ("ggml_matvec.cpp", "fused_ops.cpp", "CMakeLists.txt")
TYPES = frozenset({T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K})
# Rows of x the callers send here (more: their dequantize + GEMM path). Up to 64, as the GPU's
# mat-vec slices (qmatmul.ROW_SLICE_MAX): each row's output is the same bits in a batch as alone
# (the kernel runs every row of x through the same operations), which the batched lm_head of
# the serving engine rests on (tests/test_lm_head_rows.py); past 4 rows it re-reads the weight
# once per 4 rows, still faster than dequantizing it in MLX on a decode batch.
MAX_ROWS = 64

_HERE = Path(__file__).resolve().parent
_state: dict[str, object] = {}  # "module": what load() settled on (a module or None)


def cache_dir() -> Path:
    """$HF2Q_MLX_CACHE, $XDG_CACHE_HOME/hf2q_mlx or ~/.cache/hf2q_mlx (the model cache), /ext."""
    root = os.environ.get("HF2Q_MLX_CACHE")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = os.path.join(xdg, "hf2q_mlx") if xdg else "~/.cache/hf2q_mlx"
    return Path(root).expanduser() / "ext"


def disabled() -> bool:
    return os.environ.get(ENV_VAR, "").strip().lower() in ("0", "off", "no", "false", "none")


def fused_ops() -> bool:
    """``HF2Q_CPU_FUSED`` (read per call; ``0`` off, ``1`` or unset on): the models' CPU RMS
    norms and RoPE as this extension's one-op primitives (``fused_ops.cpp``) where it loads."""
    return env_int("HF2Q_CPU_FUSED", 0, 1) != 0


def fused_module(*arrays: mx.array) -> ModuleType | None:
    """The loaded module for a one-op CPU primitive (``fused_ops.cpp``) where the default device
    is the CPU, ``HF2Q_CPU_FUSED`` is on and every array is float32 with at least one axis;
    else None (the caller's MLX ops)."""
    if mx.default_device().type != mx.DeviceType.cpu or not fused_ops():
        return None
    if any(a.dtype != mx.float32 or a.ndim == 0 for a in arrays):
        return None
    return load()


def _nanobind() -> tuple[str, str]:
    """(version, cmake dir) of the installed nanobind, found without importing it (a build
    tool, not a dependency of this package's code); ImportError without it."""
    spec = importlib.util.find_spec("nanobind")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("nanobind is not installed")
    cmake_dir = Path(list(spec.submodule_search_locations)[0]) / "cmake"
    if not cmake_dir.is_dir():
        raise ImportError(f"nanobind has no cmake folder at {cmake_dir}")
    return importlib.metadata.version("nanobind"), str(cmake_dir)


def build_key() -> str:
    """What the compiled module depends on: sources, mlx, nanobind, Python, machine."""
    h = hashlib.sha256()
    for name in SOURCES:
        h.update((_HERE / name).read_bytes())
    try:
        nb_version = _nanobind()[0]
    except ImportError:
        nb_version = "none"
    tag = sysconfig.get_config_var("EXT_SUFFIX") or ""
    h.update(f"{mx.__version__}|{nb_version}|{tag}|{platform.machine()}|{_cpu_flags()}".encode())
    return h.hexdigest()[:16]


def _cpu_flags() -> str:
    """The CPU's feature flags (Linux), else its name: the module is built with -march=native,
    so a cache shared with a machine lacking, say, AVX-512 must not hand it this build."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def load() -> ModuleType | None:
    """The extension module (built on the first call of any process, then cached), or None.

    Idempotent: the first call decides for the process.
    """
    if "module" not in _state:
        _state["module"] = None if disabled() else _load()
    return _state["module"]  # type: ignore[return-value]


def _say(msg: str) -> None:
    print(f"hf2q_mlx: {msg}", file=sys.stderr, flush=True)


def _load() -> ModuleType | None:
    try:
        key = build_key()
        out_dir = cache_dir()
        lib = (
            out_dir / f"cpu_matvec-{key}" / f"{MODULE_NAME}{sysconfig.get_config_var('EXT_SUFFIX')}"
        )
        failed = out_dir / f"cpu_matvec-{key}.failed"
        if not lib.is_file():
            if failed.is_file():
                return None  # reported when it failed; delete the file to try again
            out_dir.mkdir(parents=True, exist_ok=True)
            with _FileLock(out_dir / f"cpu_matvec-{key}.lock"):
                if not lib.is_file():  # another process may have built it meanwhile
                    reason = _build(lib)
                    if reason is not None:
                        failed.write_text(reason)
                        _say(
                            f"CPU mat-vec extension not built ({reason.splitlines()[0]}); "
                            f"using the MLX path (log: {failed}; delete it to retry)"
                        )
                        return None
        module = _import(lib)
        _self_check(module)
        return module
    except Exception as err:  # any failure: the callers' MLX path
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        _say(f"CPU mat-vec extension unavailable ({type(err).__name__}: {first}); MLX path")
        return None


def _build(lib: Path) -> str | None:
    """Compile the module into ``lib`` (atomically); None when done, else why not (+ log)."""
    cmake = shutil.which("cmake")
    if cmake is None:
        return "no cmake on PATH"
    try:
        nb_dir = _nanobind()[1]
    except ImportError:
        return "nanobind is not installed (pip install nanobind)"
    _say("building the CPU mat-vec extension (once)...")
    core = Path(mx.__file__).resolve()  # mlx/core.*.so (or mlx/core/__init__.py)
    found = [p / "share/cmake/MLX" for p in core.parents[:2] if (p / "share/cmake/MLX").is_dir()]
    if not found:
        return "the mlx wheel ships no share/cmake/MLX"
    mlx_cmake = found[0]
    with tempfile.TemporaryDirectory(dir=lib.parent.parent) as tmp:
        build = Path(tmp) / "build"
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        steps = [
            [cmake, "-S", str(_HERE), "-B", str(build), *gen, "-DCMAKE_BUILD_TYPE=Release",
             f"-DMLX_DIR={mlx_cmake}", f"-Dnanobind_DIR={nb_dir}",
             f"-DPython_EXECUTABLE={sys.executable}"],
            [cmake, "--build", str(build), "-j", str(os.cpu_count() or 2)],
        ]  # fmt: skip
        for cmd in steps:
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            except (OSError, subprocess.SubprocessError) as err:
                return f"{Path(cmd[0]).name} failed: {err}"
            if r.returncode != 0:
                log = (r.stdout + r.stderr)[-4000:]
                errors = [ln for ln in log.splitlines() if "error" in ln.lower()]
                return f"cmake step failed: {(errors or ['see log'])[0].strip()}\n{log}"
        built = next(build.glob(f"{MODULE_NAME}*.so"), None) or next(
            build.glob(f"{MODULE_NAME}*.pyd"), None
        )
        if built is None:
            return "the build produced no module"
        lib.parent.mkdir(parents=True, exist_ok=True)
        staged = lib.with_suffix(".tmp")
        shutil.copy2(built, staged)
        os.replace(staged, lib)  # atomic: other processes see no module or the whole one
    return None


def _import(lib: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(MODULE_NAME, lib)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {lib}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _self_check(module: ModuleType) -> None:
    """One Q8_0 block through the module against the reference: proves mx.array crosses."""
    from hf2q_mlx.custom_kernels.dequant import dequantize_reference

    w = mx.array([[0, 0x3C] + list(range(-16, 16))], dtype=mx.int8).view(mx.uint8)  # d = 1.0
    x = mx.arange(32, dtype=mx.float32).reshape(1, 32) / 8
    got = module.ggml_matvec(x, w, int(T.Q8_0), 32)
    want = x @ dequantize_reference(w, T.Q8_0, 32).T
    if not mx.allclose(got, want).item():
        raise RuntimeError(f"self-check gave {got.tolist()}, expected {want.tolist()}")


class _FileLock:
    """An exclusive lock on a file (fcntl; no lock where fcntl is missing)."""

    def __init__(self, path: Path):
        self.path, self.fd = path, None

    def __enter__(self) -> _FileLock:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            import fcntl

            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except ImportError:
            pass
        return self

    def __exit__(self, *exc) -> None:
        os.close(self.fd)  # closing releases the lock


def ggml_matvec(x: mx.array, w_raw: mx.array, ggml_type: int, in_features: int) -> mx.array | None:
    """x (..., K) float @ dequant(w_raw (N, row_bytes)).T -> (..., N) in x.dtype on the CPU, or
    None where the extension cannot take it (not loaded, a type it lacks, more than
    ``MAX_ROWS`` rows): the caller's path then. fp32 math; the output is lazy like any op."""
    rows = 1
    for d in x.shape[:-1]:
        rows *= d
    if ggml_type not in TYPES or not 1 <= rows <= MAX_ROWS or x.dtype not in _X_DTYPES:
        return None
    module = load()
    if module is None:
        return None
    # (..., K) -> (..., N) in one op: the extension reads x's rows at their strides
    return module.ggml_matvec(x, w_raw, int(ggml_type), in_features)


_X_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
