"""A process's first prefill compiles its CUDA kernels together, not one by one as it meets them.

Our kernels' cubins come from ``cuda_cache`` at their first launch: on a fresh machine each is
an NVRTC compile (0.1-0.5 s) made while the forward's graph is being built, one after the
other (Gemma-4-31B's first prefill: 8 of them, ~1.6 s of its 5.06 s on the H200, session 34).
Before a model's first prefill in a process, ``once`` builds that prefill's forward on a
throwaway cache inside ``_render.collecting`` (nothing runs: the graph is never evaluated),
then compiles the cubins it lacks on one thread per CPU (``cuda_cache.cubins``). The real
forward then reads them from disk. Shapes, not values, pick a launch's kernel, so the dry
graph meets the same ones; anything it misses compiles as before. ``HF2Q_COMPILE_AHEAD=0``
(read per call) turns it off.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from hf2q_mlx.custom_kernels import _render, cuda_cache

_ATTR = "_hf2q_compiled_ahead"  # set on a model once its dry pass ran (nn.Module is unhashable)


def missing_units(specs: list) -> list[tuple[str, str]]:
    """(name, unit) of each distinct launch in ``specs`` whose cubin this process lacks."""
    units: dict[str, str] = {}
    for spec in specs:
        got = spec.pending_unit()
        if got is not None:
            units.setdefault(*got)
    return list(units.items())


def once(model, dry_forward: Callable[[], object]) -> dict | None:
    """Before ``model``'s first prefill on CUDA: ``dry_forward()`` (the prefill's graph on a
    throwaway cache, not evaluated) is built with its launches collected, and their missing
    cubins compiled at once. Later calls, other back ends, and ``HF2Q_CUDA_KERNEL_CACHE=0`` do
    nothing. A dry pass that raises compiles what it met; the prefill goes on (and raises its
    own error if it has one). Returns {"launches", "compiled", "seconds", "error"} when it ran,
    else None."""
    if getattr(model, _ATTR, False) or _render.gpu_backend() != "cuda":
        return None
    if not cuda_cache.wants_cubin() or os.environ.get("HF2Q_COMPILE_AHEAD", "").strip() == "0":
        return None
    object.__setattr__(model, _ATTR, True)
    tic = time.perf_counter()
    error = None
    with _render.collecting() as specs:
        try:
            dry_forward()
        except Exception as err:  # noqa: BLE001  (best effort: the real forward reports its own)
            error = f"{type(err).__name__}: {err}"
    units = missing_units(specs)
    cuda_cache.cubins(units)
    return {"launches": len(specs), "compiled": len(units),
            "seconds": time.perf_counter() - tic, "error": error}  # fmt: skip
