"""Our CUDA kernels compiled once per machine, not once per process.

MLX 0.32.4 compiles every ``mx.fast.cuda_kernel`` with NVRTC in each new process and keeps no
disk copy: ~1.5 s a kernel on the H200 (most of it MLX's own prelude headers), so a fresh
process's first 26B-A4B prefill took 17.7 s with every other cache warm (session 15,
``bench/jit_probe.py``, ``bench/first_prefill.py``). Here the translation unit is ours (the
kernel text MLX would build, with a two-header prelude instead of MLX's), NVRTC is called
through ctypes, the cubin lands in ``<cache>/cuda_kernels/`` keyed by a hash of source, options,
NVRTC version and GPU, and ``mx.fast.precompiled_cuda_kernel`` launches it. Anything missing
(no NVRTC library, no CUDA headers, a compile error) returns None and the caller keeps MLX's
``cuda_kernel``: the same kernel text, compiled MLX's way.

``HF2Q_CUDA_KERNEL_CACHE`` (read at import): ``auto`` (unset) takes the cubins everywhere but
inside a per-token step (``per_token()``: the compiled DecodeStep, eager decode, speculative
drafts and verifies, a decoded token's sampling, the serving engine's steps), ``1`` everywhere,
``0`` nowhere (the CUDA graph step compiles its own through ``cubin(force=True)`` in every
mode). Why not inside a per-token step: MLX 0.32.4 keys a precompiled kernel's loaded module by
its name and a hash of the whole cubin, computed on every evaluation of every launch
(``_render._Cubin``; its ``cuda_kernel`` path keys by name only), which cost ~1.7 ms of host a
26B-A4B token in the compiled step (docs/kernel_notes.md, session 16); a prefill makes a few
launches per layer, not per token. ``status()`` says what happened.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import glob
import hashlib
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx

# "auto" (unset or empty), "1" or "0" (another value: auto, said once on stderr); ENABLED: the
# cubins are used somewhere
MODE = os.environ.get("HF2Q_CUDA_KERNEL_CACHE", "auto").strip().lower() or "auto"
if MODE not in ("auto", "0", "1"):
    print(f"hf2q-mlx: HF2Q_CUDA_KERNEL_CACHE={MODE!r} is not auto, 0 or 1: auto", file=sys.stderr)
    MODE = "auto"
ENABLED = MODE != "0"
_local = threading.local()  # depth of per_token() on this thread


@contextlib.contextmanager
def per_token():
    """Launches made inside take MLX's cuda_kernel in ``auto`` mode (a per-token step: MLX
    hashes a cubin's image at each of its launches, ~0.15 us per KiB)."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def wants_cubin() -> bool:
    """Whether a launch made now should take its cubin (``MODE`` and ``per_token()``)."""
    return ENABLED and (MODE == "1" or not getattr(_local, "depth", 0))


# Before the kernel text: the half types, fixed-width integers from CCCL (which MLX ships), and
# MLX's ``inf``. The bodies use nothing else of MLX's prelude (the CPU emulator's header,
# tests/kernels/cuda_emu.h, lists what they use).
PRELUDE = """
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda/std/cstdint>
using cuda::std::int8_t; using cuda::std::int16_t; using cuda::std::int32_t;
using cuda::std::int64_t; using cuda::std::uint8_t; using cuda::std::uint16_t;
using cuda::std::uint32_t; using cuda::std::uint64_t;
#define inf __int_as_float(0x7f800000)
"""

_lock = threading.Lock()
_paths: dict[str, Path] = {}  # kernel name -> its cubin's file, for record_failure
_sizes: dict[str, int] = {}  # kernel name -> its cubin's bytes (each launch hashes them)
_notifier: list = []  # set_notifier's callable: told once per process, at its first compile
_state: dict = {"checked": False, "nvrtc": None, "arch": None, "options": None, "why": None}
_counts = {"compiled": 0, "from_disk": 0, "failed": 0}
_told: list = []  # set once the notifier has been told (one message a process)
_last_error: list[str] = []
# seconds: finding NVRTC and the GPU, NVRTC compiles summed over threads, the slowest (name, s)
_times: dict = {"setup_s": 0.0, "compile_s": 0.0, "slowest": None}
_compile_times: dict[str, float] = {}  # name -> seconds of each compile this process made


def _cuda_home() -> str | None:
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            return os.environ[var]
    return "/usr/local/cuda" if os.path.isdir("/usr/local/cuda") else None


def _cccl_dir() -> str | None:
    """MLX's CCCL headers: <site>/mlx/include/cccl next to libmlx, as MLX finds them."""
    here = Path(mx.__file__).resolve().parent / "include" / "cccl"
    if here.is_dir():
        return str(here)
    env = os.environ.get("MLX_CCCL_DIR")
    return env if env and os.path.isdir(env) else None


def _loaded_libs(stem: str) -> list[str]:
    """Paths of already-loaded shared libraries whose name starts with ``stem``."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if f"/{stem}" in line}
    except OSError:
        return []
    return sorted(p for p in paths if os.path.basename(p).startswith(stem))


def _cuda_major() -> str | None:
    """The CUDA major version MLX runs on, from its loaded runtime libraries (None: unknown)."""
    for stem in ("libcudart.so.", "libcublas.so.", "libnvrtc.so."):
        for path in _loaded_libs(stem):
            major = os.path.basename(path)[len(stem) :].split(".")[0]
            if major.isdigit():
                return major
    return None


def _prefer_major(paths: list[str], major: str | None) -> list[str]:
    """``paths`` with the libnvrtc.so.<major>* ones first (MLX's own compiler version)."""
    if major is None:
        return paths
    return sorted(paths, key=lambda p: not os.path.basename(p).startswith(f"libnvrtc.so.{major}"))


def _nvrtc_candidates() -> list[str]:
    found = _loaded_libs("libnvrtc.so")
    for base in sys.path:  # the nvidia-* wheels
        found += sorted(glob.glob(os.path.join(base, "nvidia", "*", "lib", "libnvrtc.so*")))
        found += sorted(glob.glob(os.path.join(base, "nvidia", "*", "*", "lib", "libnvrtc.so*")))
    home = _cuda_home()
    if home:
        found += sorted(glob.glob(os.path.join(home, "lib64", "libnvrtc.so*")))
    name = ctypes.util.find_library("nvrtc")
    if name:
        found.append(name)
    found = [p for p in dict.fromkeys(found) if "builtins" not in os.path.basename(p)]
    return _prefer_major(found, _cuda_major())


def _compute_capability() -> tuple[int, int] | None:
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    dev, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGet(ctypes.byref(dev), 0) != 0:
        return None
    # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75, _MINOR = 76
    if cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, dev) != 0:
        return None
    if cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev) != 0:
        return None
    return major.value, minor.value


def _setup(force: bool = False) -> None:
    """Find NVRTC, the GPU's architecture and the include paths once; ``why`` when not.
    ``force``: also when the cache is switched off (the CUDA graph step compiles its own)."""
    _state["checked"] = True
    t0 = time.perf_counter()
    try:
        _find(force)
    finally:
        _times["setup_s"] += time.perf_counter() - t0


def _find(force: bool) -> None:
    if not ENABLED and not force:
        _state["why"] = "HF2Q_CUDA_KERNEL_CACHE=0"
        return
    _state["why"] = None
    # found for the graph step only: cuda_kernel launches keep MLX's build
    _state["forced_only"] = not ENABLED
    if not mx.cuda.is_available():
        _state["why"] = "no CUDA back end"
        return
    cc = _compute_capability()
    if cc is None:
        _state["why"] = "no compute capability from libcuda"
        return
    lib = None
    for path in _nvrtc_candidates():
        try:
            lib = ctypes.CDLL(path)
            lib.nvrtcVersion  # noqa: B018  (raises AttributeError when not NVRTC)
            break
        except (OSError, AttributeError):
            lib = None
    if lib is None:
        _state["why"] = "no NVRTC library found"
        return
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    home = _cuda_home()
    includes = [p for p in (_cccl_dir(), home and os.path.join(home, "include"))
                if p and os.path.isdir(p)]  # fmt: skip
    _state.update(
        nvrtc=lib,
        nvrtc_path=path,
        arch=f"sm_{cc[0]}{cc[1]}",
        version=f"{major.value}.{minor.value}",
        options=[f"--gpu-architecture=sm_{cc[0]}{cc[1]}", "--std=c++17"]
        + [f"--include-path={p}" for p in includes],
    )


def cache_dir() -> Path:
    """$HF2Q_MLX_CACHE, else $XDG_CACHE_HOME/hf2q_mlx, else ~/.cache/hf2q_mlx (as the model
    cache), then cuda_kernels/."""
    if os.environ.get("HF2Q_MLX_CACHE"):
        root = Path(os.environ["HF2Q_MLX_CACHE"]).expanduser()
    elif os.environ.get("XDG_CACHE_HOME"):
        root = Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "hf2q_mlx"
    else:
        root = Path.home() / ".cache" / "hf2q_mlx"
    return root / "cuda_kernels"


def _nvrtc_compile(lib, source: str, name: str, options: list[str]) -> bytes:
    """NVRTC source -> cubin; RuntimeError with the compile log on failure."""
    prog = ctypes.c_void_p()
    err = lib.nvrtcCreateProgram(
        ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None, None
    )
    if err != 0:
        raise RuntimeError(f"nvrtcCreateProgram failed ({err})")
    try:
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        if lib.nvrtcCompileProgram(prog, len(options), opts) != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value + 1)
            lib.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(log.value.decode(errors="replace")[:2000])
        size = ctypes.c_size_t()
        if lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)) != 0 or size.value == 0:
            raise RuntimeError("no cubin from NVRTC")
        buf = ctypes.create_string_buffer(size.value)
        if lib.nvrtcGetCUBIN(prog, buf) != 0:
            raise RuntimeError("nvrtcGetCUBIN failed")
        return buf.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def cubin(name: str, source: str, force: bool = False) -> bytes | None:
    """The cubin of ``source`` (a translation unit defining ``extern "C"`` kernel ``name``):
    from the disk cache, else compiled and stored. None when this path is unavailable or the
    compile fails (the caller falls back to MLX's cuda_kernel). ``force``: even with
    ``HF2Q_CUDA_KERNEL_CACHE`` off (the CUDA graph step launches cubins itself). Thread-safe;
    the compile itself runs outside the lock, so ``cubins`` compiles several at once."""
    with _lock:
        if not _state["checked"] or (force and _state["nvrtc"] is None and not ENABLED):
            _setup(force)
        if _state.get("forced_only") and not force:
            return None
        lib = _state["nvrtc"]
        if lib is None:
            return None
        options = _state["options"]
        key = hashlib.sha256(
            "\0".join([source, *options, _state["version"], mx.__version__]).encode()
        ).hexdigest()[:32]
        path = cache_dir() / _state["arch"] / f"{name[:80]}_{key}.cubin"
        _paths[name] = path
    try:
        data = path.read_bytes()
    except OSError:
        data = b""
    if data:
        with _lock:
            _counts["from_disk"] += 1
            _sizes[name] = len(data)
        return data
    with _lock:
        if _notifier and not _told:
            _told.append(True)
            _notifier[0](
                f"compiling CUDA kernels for {_state['arch']} into {cache_dir()} "
                "(once per machine; later runs read them)"
            )
    t0 = time.perf_counter()
    try:
        data = _nvrtc_compile(lib, source, name, options)
    except RuntimeError as err:
        with _lock:
            _counts["failed"] += 1
            _last_error[:] = [f"{name}: {err}"]
        return None
    with _lock:
        took = time.perf_counter() - t0
        _times["compile_s"] += took
        _compile_times[name] = round(took, 3)
        if _times["slowest"] is None or took > _times["slowest"][1]:
            _times["slowest"] = (name, round(took, 3))
        _counts["compiled"] += 1
        _sizes[name] = len(data)
    try:  # written whole or not at all: another process may read it now
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        pass  # an unwritable cache costs the next process a compile, nothing else
    return data


def cubins(units: list[tuple[str, str]], force: bool = False) -> list[bytes | None]:
    """``cubin`` of each (name, source), in order, the compiles spread over up to one thread
    per CPU (NVRTC compiles independent programs at once and ctypes releases the GIL around
    each call): a CUDA graph's first capture needs them all before it can start."""
    if len(units) <= 1:
        return [cubin(name, src, force=force) for name, src in units]
    workers = min(len(units), os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda u: cubin(u[0], u[1], force=force), units))


def set_notifier(fn) -> None:
    """``fn(message)`` is called once per process, before its first kernel compile (the
    command line prints it, so a first run's wait is explained); None: silent."""
    _notifier[:] = [fn] if fn is not None else []


def record_failure(name: str, error: str) -> None:
    """A cubin MLX could not load: counted as failed, its file deleted (the next process
    compiles it again); MLX's own build serves that kernel in this one."""
    with _lock:
        _counts["failed"] += 1
        _last_error[:] = [f"{name}: {error[:2000]}"]
        try:
            _paths.pop(name).unlink()
        except (KeyError, OSError):
            pass


def status() -> dict:
    """What this process did: kernels compiled, read from disk, failed (the last error), and
    why the path is off when it is."""
    return {
        **_counts,
        "enabled": _state["nvrtc"] is not None and not _state.get("forced_only"),
        "mode": MODE,
        "why_off": _state["why"],
        "arch": _state["arch"],
        "nvrtc": _state.get("nvrtc_path"),
        "cache": str(cache_dir()),
        "last_error": _last_error[0] if _last_error else None,
        "setup_s": round(_times["setup_s"], 3),
        "compile_s": round(_times["compile_s"], 3),
        "slowest_compile": _times["slowest"],
        "compiles": dict(sorted(_compile_times.items(), key=lambda kv: -kv[1])),
        # what each launch of these kernels hashes on the host (MLX 0.32.4, _render._Cubin)
        "cubin_kib_mean": round(sum(_sizes.values()) / len(_sizes) / 1024, 1) if _sizes else 0,
        "cubin_kib_max": round(max(_sizes.values()) / 1024, 1) if _sizes else 0,
    }
