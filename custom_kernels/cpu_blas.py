"""A fast ``cblas_sgemm`` under MLX's CPU back end (Linux mlx-cpu wheels bundle the reference one).

Every fp32 matmul MLX runs on the CPU (``x @ w.T``, the CPU ``scaled_dot_product_attention``,
``addmm``) calls ``cblas_sgemm`` from ``libmlx.so``, which the Linux wheel resolves to the
netlib reference BLAS it bundles: single-threaded, unblocked. ``enable()`` puts an optimized
one in front of it for the whole process, through the dynamic linker's global scope: a
library loaded with ``RTLD_GLOBAL`` before ``libmlx.so`` is loaded (CPython loads extension
modules with ``RTLD_NOW``, so MLX binds its BLAS when ``mlx.core`` is first imported) provides
the ``cblas_sgemm`` it binds. ``import hf2q_mlx`` calls ``enable()`` first thing for that
reason. Where from, in order:

1. ``$HF2Q_CPU_BLAS`` naming a library file that exports ``cblas_sgemm``;
2. the OpenBLAS numpy ships (numpy.libs, in every Linux numpy wheel), whose symbols are renamed
   (``scipy_cblas_sgemm64_``, 64-bit integers);
3. else the system's OpenBLAS, BLIS or MKL (``ctypes.util.find_library``).

A 20-line C shim exporting ``cblas_sgemm`` forwards to the chosen function; it is compiled once
with the system C compiler (the one ``mx.compile`` needs on the CPU too) into ``cache_dir``.

The shim counts its calls, so ``routed()`` can prove the routing took effect (it does not when
``mlx.core`` was imported before ``hf2q_mlx``: the reference binding is then final). Nothing
changes on macOS (MLX uses Accelerate) or with ``HF2Q_CPU_BLAS=off``. Results are the fp32 GEMM
of another implementation: equal up to summation order (~1e-6 relative), not bit-identical.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from hf2q_mlx.errors import InvalidArgumentError

ENV_VAR = "HF2Q_CPU_BLAS"
SYSTEM_LIBRARIES = ("openblas", "blis", "mkl_rt")

# The shim: cblas_sgemm with MLX's 32-bit integer ABI, forwarding to a target set at run time
# (ILP64 targets take 64-bit integers: the cast here is what a direct binding cannot do).
_SHIM_SOURCE = r"""
#include <stdint.h>
typedef void (*sgemm32_t)(int, int, int, int32_t, int32_t, int32_t, float, const float*, int32_t,
                          const float*, int32_t, float, float*, int32_t);
typedef void (*sgemm64_t)(int, int, int, int64_t, int64_t, int64_t, float, const float*, int64_t,
                          const float*, int64_t, float, float*, int64_t);
static void* target = 0;
static int ilp64 = 0;
volatile long long hf2q_sgemm_calls = 0;

void hf2q_set_target(void* fn, int is_ilp64) { target = fn; ilp64 = is_ilp64; }

void cblas_sgemm(int order, int ta, int tb, int32_t m, int32_t n, int32_t k, float alpha,
                 const float* a, int32_t lda, const float* b, int32_t ldb, float beta, float* c,
                 int32_t ldc) {
  hf2q_sgemm_calls++;
  if (ilp64)
    ((sgemm64_t)target)(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  else
    ((sgemm32_t)target)(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
"""

# numpy's OpenBLAS builds over the years: (symbol, 64-bit integers)
_NUMPY_SYMBOLS = (
    ("scipy_cblas_sgemm64_", True),
    ("scipy_cblas_sgemm", False),
    ("cblas_sgemm64_", True),
    ("cblas_sgemm", False),
)

_state: dict[str, object] = {}  # "result": what enable() settled on; "keep": loaded libraries


def _numpy_openblas() -> tuple[ctypes.CDLL, str, bool] | None:
    """(library, symbol, ilp64) of the OpenBLAS numpy ships in ``numpy.libs``, or None.

    Found without importing numpy (``import hf2q_mlx`` runs this); the file is the one numpy
    loads itself, so the process still has one OpenBLAS and one thread pool.
    """
    spec = importlib.util.find_spec("numpy")
    if spec is None or spec.origin is None:
        return None
    libs = Path(spec.origin).resolve().parent.parent / "numpy.libs"
    for path in sorted(libs.glob("lib*openblas*.so*")) if libs.is_dir() else ():
        try:
            lib = ctypes.CDLL(str(path))
        except OSError:
            continue
        for symbol, ilp64 in _NUMPY_SYMBOLS:
            if hasattr(lib, symbol):
                return lib, symbol, ilp64
    return None


def default_cache_dir() -> Path:
    """Where the shim is kept: $HF2Q_MLX_CACHE, $XDG_CACHE_HOME/hf2q_mlx or ~/.cache/hf2q_mlx
    (the model cache, io/default_model.py), sub-folder cpu_blas."""
    root = os.environ.get("HF2Q_MLX_CACHE")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = os.path.join(xdg, "hf2q_mlx") if xdg else "~/.cache/hf2q_mlx"
    return Path(root).expanduser() / "cpu_blas"


def _build_shim(cache_dir: Path) -> Path | None:
    """The compiled shim in ``cache_dir`` (built on first use), or None without a C compiler."""
    tag = hashlib.sha256((_SHIM_SOURCE + sys.platform).encode()).hexdigest()[:12]
    out = cache_dir / f"hf2q_sgemm_shim_{tag}.so"
    if out.is_file():
        return out
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        src, lib = Path(tmp) / "shim.c", Path(tmp) / "shim.so"
        src.write_text(_SHIM_SOURCE)
        cmd = [cc, "-O2", "-shared", "-fPIC", "-o", str(lib), str(src)]
        if subprocess.run(cmd, capture_output=True, timeout=120).returncode != 0:
            return None
        os.replace(lib, out)  # atomic: concurrent processes see the old or the whole file
    return out


def enable(cache_dir: str | Path | None = None) -> str | None:
    """Route MLX's CPU ``cblas_sgemm`` to an optimized BLAS; returns what is used, or None.

    Idempotent (the first call decides). ``cache_dir`` holds the compiled shim (default:
    ``default_cache_dir()``). Returns a short description ("system openblas: libopenblas.so.0
    via shim", "numpy openblas: libscipy_openblas64_...so via shim"), or None where nothing was
    loaded: not Linux, ``HF2Q_CPU_BLAS=off``, no better BLAS, or no compiler for the shim a
    renamed symbol needs. Whether MLX took it: ``routed()``.
    """
    if "result" in _state:
        return _state["result"]  # type: ignore[return-value]
    _state["result"] = result = _enable(cache_dir)
    return result


def wanted() -> bool:
    """Whether the routing applies here: Linux, and ``HF2Q_CPU_BLAS`` does not turn it off."""
    choice = os.environ.get(ENV_VAR, "").strip().lower()
    return sys.platform.startswith("linux") and choice not in ("off", "0", "none", "no")


def _enable(cache_dir: str | Path | None) -> str | None:
    if not wanted():
        return None
    choice = os.environ.get(ENV_VAR, "").strip()
    target = None  # (library, symbol, ilp64, description)
    if choice:
        try:
            lib = ctypes.CDLL(choice)
        except OSError as err:
            raise InvalidArgumentError(f"{ENV_VAR}={choice}: cannot load it ({err})") from None
        if not hasattr(lib, "cblas_sgemm"):
            raise InvalidArgumentError(f"{ENV_VAR}={choice} exports no cblas_sgemm")
        target = (lib, "cblas_sgemm", False, f"{ENV_VAR}: {choice}")
    if target is None:
        found = _numpy_openblas()
        if found is not None:
            lib, symbol, ilp64 = found
            target = (lib, symbol, ilp64, f"numpy openblas: {Path(lib._name).name}")
    for name in () if target else SYSTEM_LIBRARIES:
        found = ctypes.util.find_library(name)  # runs ldconfig: only where numpy has none
        if found:
            try:
                lib = ctypes.CDLL(found)
            except OSError:
                continue
            if hasattr(lib, "cblas_sgemm"):
                target = (lib, "cblas_sgemm", False, f"system {name}: {found}")
                break
    if target is None:
        return None
    lib, symbol, ilp64, desc = target
    try:
        shim_path = _build_shim(Path(cache_dir) if cache_dir else default_cache_dir())
    except (OSError, subprocess.SubprocessError):
        shim_path = None  # no writable cache or a failing compiler: as without a compiler
    if shim_path is None:
        if symbol != "cblas_sgemm":
            return None  # a renamed symbol needs the shim
        ctypes.CDLL(lib._name, mode=ctypes.RTLD_GLOBAL)  # unverified: no counter without it
        _state["keep"] = lib
        return desc + " (direct)"
    shim = ctypes.CDLL(str(shim_path), mode=ctypes.RTLD_GLOBAL)
    shim.hf2q_set_target(ctypes.cast(getattr(lib, symbol), ctypes.c_void_p), int(ilp64))
    _state["keep"] = (lib, shim)  # both stay loaded for the life of the process
    return f"{desc} via shim"


def sgemm_calls() -> int | None:
    """Calls MLX made through the shim so far (None when the shim is not loaded)."""
    keep = _state.get("keep")
    if not isinstance(keep, tuple):
        return None
    return ctypes.c_longlong.in_dll(keep[1], "hf2q_sgemm_calls").value


def set_threads(n: int) -> bool:
    """Threads the routed OpenBLAS may use (its default: one per core). False where the
    library has no such setting (BLIS, MKL, or nothing routed). On a machine whose cores are
    busy with other work, one thread can be several times faster than spinning workers
    (docs/cli.md, CPU figures)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidArgumentError(f"BLAS threads must be an integer >= 1, got {n!r}")
    keep = _state.get("keep")
    lib = keep[0] if isinstance(keep, tuple) else keep
    for name in ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads"):
        fn = getattr(lib, name, None) if lib is not None else None
        if fn is not None:
            fn.argtypes = [ctypes.c_int]  # int in both builds
            fn(n)
            return True
    return False


def routed() -> bool | None:
    """Whether MLX's CPU matmul goes through ``enable()``'s BLAS: one tiny CPU matmul, watched
    through the shim's call counter. None when that cannot be seen (no shim loaded)."""
    before = sgemm_calls()
    if before is None:
        return None
    import mlx.core as mx

    a = mx.ones((4, 4), dtype=mx.float32)
    mx.eval(mx.matmul(a, a, stream=mx.cpu))
    return sgemm_calls() > before
