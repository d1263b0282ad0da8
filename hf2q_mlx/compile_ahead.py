"""A process's first prefill compiles its CUDA kernels together, not one by one as it meets them.

Our kernels' cubins come from ``cuda_cache`` at their first launch: on a fresh machine each is
an NVRTC compile (0.1-0.5 s) made while the forward's graph is being built, one after the
other (Gemma-4-31B's first prefill: 8 of them, ~1.6 s of its 5.06 s on the H200, session 34).
Before a model's first prefill in a process, ``once`` builds that prefill's forward on a
throwaway cache inside ``_render.collecting`` (nothing runs: the graph is never evaluated),
then compiles the cubins it lacks on one thread per CPU (``cuda_cache.cubins``). The real
forward then reads them from disk. Shapes, not values, pick a launch's kernel, so the dry
graph meets the same ones; anything it misses compiles as before.

The dry pass costs a graph build (tens of ms on a large model). A marker file per model
signature (class, arguments, parameters' names, dtypes and shapes, the prefill's chunk lengths)
in the cubin cache says a process already did it on this machine, so later processes skip it;
a cubin deleted since is compiled by the forward as before. ``HF2Q_COMPILE_AHEAD=0`` (read per
call) turns all this off.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable

import mlx.core as mx
from mlx.utils import tree_flatten

from hf2q_mlx.custom_kernels import _render, cuda_cache

_ATTR = "_hf2q_compiled_ahead"  # set on a model once asked (nn.Module is unhashable)


def missing_units(specs: list) -> list[tuple[str, str]]:
    """(name, unit) of each distinct launch in ``specs`` whose cubin this process lacks."""
    units: dict[str, str] = {}
    for spec in specs:
        got = spec.pending_unit()
        if got is not None:
            units.setdefault(*got)
    return list(units.items())


def _compile_while_warming(units: list, warm_ups: list) -> dict | None:
    """Compiles ``units`` (``cuda_cache.cubins``, on worker threads) while this thread evaluates
    the dry graph's ``warm_ups`` (library first uses: cuDNN's load and plans for attention,
    cuBLAS's modules for the delta-net's matmuls), which the forward would otherwise pay after
    the compiles. Only with something to compile and ``HF2Q_COMPILE_AHEAD_WARM`` not 0;
    returns {"count", "seconds", "failed", "first_error"} when they ran. A warm-up that raises
    is skipped (the forward meets the same op and reports its own error)."""
    off = os.environ.get("HF2Q_COMPILE_AHEAD_WARM", "").strip() == "0"
    if not units or not warm_ups or off:
        cuda_cache.cubins(units)
        return None
    worker = threading.Thread(target=cuda_cache.cubins, args=(units,), daemon=True)
    worker.start()
    tic, failed = time.perf_counter(), []
    for build in warm_ups:
        try:
            mx.eval(build())
        except Exception as err:  # noqa: BLE001  (best effort)
            failed.append(f"{type(err).__name__}: {str(err)[:200]}")
    took = time.perf_counter() - tic
    worker.join()
    return {"count": len(warm_ups), "seconds": round(took, 3), "failed": len(failed),
            "first_error": failed[0] if failed else None}  # fmt: skip


def signature(model, shapes: tuple) -> str:
    """A hash of what picks a prefill's kernels: the model's class and arguments, its
    parameters' names, dtypes and shapes, ``shapes`` (the chunk lengths), MLX's version and
    the GPU's architecture."""
    parts = [type(model).__module__, type(model).__qualname__, repr(getattr(model, "args", None)),
             repr(shapes), mx.__version__, str(cuda_cache.status()["arch"])]  # fmt: skip
    params = model.parameters() if hasattr(model, "parameters") else {}
    parts += [f"{k}:{v.dtype}:{v.shape}" for k, v in tree_flatten(params)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def _marker(key: str):
    return cuda_cache.cache_dir() / "ahead" / key


def _can_mark() -> bool:
    """Whether cubins are being compiled here (NVRTC found): only then does a marker say so."""
    return bool(cuda_cache.status()["enabled"])


def once(model, dry_forward: Callable[[], object], shapes: tuple = ()) -> dict | None:
    """Before ``model``'s first prefill on CUDA: ``dry_forward()`` (the prefill's graph on a
    throwaway cache, not evaluated) is built with its launches collected, and their missing
    cubins compiled at once, unless this machine's marker for (model, ``shapes``) says a
    process did so already. Later calls, other back ends, and ``HF2Q_COMPILE_AHEAD=0`` do
    nothing. A dry pass that raises compiles what it met; the prefill goes on (and raises its
    own error if it has one). Returns {"launches", "compiled", "seconds", "error"} when the dry
    pass ran, {"marker": True} when the marker skipped it, else None."""
    if getattr(model, _ATTR, False) or _render.gpu_backend() != "cuda":
        return None
    if not cuda_cache.wants_cubin() or os.environ.get("HF2Q_COMPILE_AHEAD", "").strip() == "0":
        return None
    object.__setattr__(model, _ATTR, True)
    tic = time.perf_counter()
    marker = _marker(signature(model, shapes))
    if marker.exists():
        return {"marker": True, "seconds": time.perf_counter() - tic}
    error = None
    with _render.collecting() as specs:
        try:
            dry_forward()
        except Exception as err:  # noqa: BLE001  (best effort: the real forward reports its own)
            error = f"{type(err).__name__}: {err}"
    units = missing_units(specs)
    warmed = _compile_while_warming(units, list(specs.warm_ups.values()))
    if error is None and _can_mark():
        try:
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
        except OSError:
            pass  # an unwritable cache: the next process's dry pass again, nothing else
    return {"launches": len(specs), "compiled": len(units), "warm_ups": warmed,
            "seconds": time.perf_counter() - tic, "error": error}  # fmt: skip
