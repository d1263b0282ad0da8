"""GPU kernels: one body per op rendered for Metal and CUDA, with a plain-MLX reference each.

``backend()`` says which GPU back end the dispatchers may use right now ("cuda", "metal") or
None, meaning every dispatcher takes its reference path. The reference is forced by the
environment variable ``HF2Q_KERNELS=reference`` or, for a block of code, by::

    with hf2q_mlx.custom_kernels.reference_only():
        y = ggml_matmul(x, w, ggml_type, in_features)   # reference path

Kept light: importing this package imports no kernel module. ``backend()`` runs many times per
decode step, so it costs a few attribute reads: the GPU kind is looked up once, and the
environment variable is re-parsed only when its value changes (``refresh()`` forgets both).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator
from functools import lru_cache
from typing import TYPE_CHECKING

from hf2q_mlx.errors import InvalidArgumentError

if TYPE_CHECKING:
    import mlx.core as mx

__all__ = [
    "avoid_mlx_jit",
    "backend",
    "env_int",
    "reference_only",
    "reference_forced",
    "refresh",
    "ENV_VAR",
]

ENV_VAR = "HF2Q_KERNELS"

# Depth of nested reference_only() blocks in this context (thread / task local).
_forced_reference: contextvars.ContextVar[int] = contextvars.ContextVar(
    "hf2q_forced_reference", default=0
)

# os.environ keeps the encoded values in ``_data`` (POSIX): reading the raw bytes object and
# comparing it by identity skips os.environ.get's key encoding and value decoding (~0.7 us).
# Any assignment, even of an equal value, stores a new bytes object, so a change is never missed.
_ENV_DATA = getattr(os.environ, "_data", None)
_ENV_KEY = os.environ.encodekey(ENV_VAR) if hasattr(os.environ, "encodekey") else ENV_VAR
_UNSET = object()
_env_raw: object = _UNSET  # the raw value last parsed
_env_forced = False
# (kind, the GPU Device, mx.default_device), looked up once
_gpu: tuple[str | None, object, object] | None = None


# env_int's parsed values, per (name, lo, hi): (the raw value they came from, the value)
_env_ints: dict[tuple[str, int, int], tuple[object, int | None]] = {}


def env_int(name: str, lo: int, hi: int) -> int | None:
    """Environment switch ``name`` as an integer in lo..hi; None when unset or blank.
    ``InvalidArgumentError`` (one line, naming it) for anything else. Parsed again only when
    the raw value changes (by identity, as ``_env_says_reference``): decode steps read the CPU
    switches ~180 times a token."""
    if _ENV_DATA is None:
        return int_setting(name, os.environ.get(name, ""), lo, hi)
    raw = _ENV_DATA.get(os.environ.encodekey(name))
    hit = _env_ints.get((name, lo, hi))
    if hit is not None and hit[0] is raw:
        return hit[1]
    value = int_setting(name, os.environ.get(name, ""), lo, hi)  # raises before caching
    _env_ints[(name, lo, hi)] = (raw, value)
    return value


def int_tuple_setting(
    name: str, text: str, bounds: tuple[tuple[int, int], ...], example: str
) -> tuple[int, ...] | None:
    """``text`` (switch ``name``'s value) as comma-separated integers, the i-th in
    ``bounds[i]``; None when blank. ``InvalidArgumentError`` (one line, naming the switch and
    ``example``) for anything else."""
    text = text.strip()
    if not text:
        return None
    parts = [p.strip() for p in text.split(",")]
    ok = len(parts) == len(bounds) and all(p.isascii() and p.isdigit() for p in parts)
    if not ok or not all(lo <= int(p) <= hi for p, (lo, hi) in zip(parts, bounds)):
        raise InvalidArgumentError(f"{name}={text!r}: expected {example}")
    return tuple(int(p) for p in parts)


def int_setting(name: str, text: str, lo: int, hi: int) -> int | None:
    """``text`` (switch ``name``'s value, e.g. read at import) as ``env_int`` reads it."""
    text = text.strip()
    if not text:
        return None
    if not (text.isascii() and text.isdigit()) or not lo <= int(text) <= hi:
        raise InvalidArgumentError(f"{name}={text!r}: expected an integer in {lo}..{hi}")
    return int(text)


def avoid_mlx_jit() -> bool:
    """``HF2Q_AVOID_MLX_JIT`` (read per call; 1 on, 0 off, unset: on with MLX's CUDA back end,
    off elsewhere): a prefill's gathers go through ops MLX ships compiled or kernels of ours.
    MLX 0.32.4's CUDA back end compiles each gather variant (and each ``mx.compile`` fusion)
    with NVRTC at its first use on a machine, inside a fresh machine's first prefill: the
    router's picks by a one-hot select (``models.ops.pick``), an embedding's rows by a kernel
    (``graph_ops.gather_rows``), the grouped prefill's token slices as views
    (``expert_matmul.owned_rows``), and the delta-net's silu / softplus and the gated silu
    unfused (``gated_delta.silu``, ``softplus``). Values are unchanged. Session 37 (H200,
    26B-A4B Q4_K, fresh caches): the first 512-token prefill 2.06 s with it, 23.7-25.3 s
    without."""
    on = env_int("HF2Q_AVOID_MLX_JIT", 0, 1)
    return backend() == "cuda" if on is None else on == 1


def refresh() -> None:
    """Forget the cached GPU kind and environment setting (tests that patch MLX call this)."""
    global _env_raw, _gpu
    _env_raw, _gpu = _UNSET, None


def _env_says_reference() -> bool:
    global _env_raw, _env_forced
    raw = _ENV_DATA.get(_ENV_KEY) if _ENV_DATA is not None else os.environ.get(ENV_VAR)
    if raw is not _env_raw:
        value = os.environ.get(ENV_VAR, "")
        _env_raw, _env_forced = raw, value.strip().lower() == "reference"
    return _env_forced


def reference_forced() -> bool:
    """True inside ``reference_only()`` or with ``HF2Q_KERNELS=reference``."""
    return _forced_reference.get() > 0 or _env_says_reference()


@contextlib.contextmanager
def reference_only() -> Iterator[None]:
    """Force every dispatcher onto its reference path inside the block (nests, thread-local)."""
    token = _forced_reference.set(_forced_reference.get() + 1)
    try:
        yield
    finally:
        _forced_reference.reset(token)


def _gpu_kind() -> tuple[str | None, object, object]:
    global _gpu
    import mlx.core as mx

    kind = "cuda" if mx.cuda.is_available() else ("metal" if mx.metal.is_available() else None)
    _gpu = (kind, mx.Device(mx.DeviceType.gpu) if kind else None, mx.default_device)
    return _gpu


def on_cuda_device() -> bool:
    """Whether MLX ops run on a CUDA GPU now (the default device is the GPU and MLX's back end
    is CUDA). Asked of the device itself, not of ``backend()``, which also says None when the
    references are forced on a CUDA GPU: for choices between MLX ops, not kernels."""
    import mlx.core as mx

    return mx.default_device().type == mx.DeviceType.gpu and mx.cuda.is_available()


def backend() -> str | None:
    """'cuda' or 'metal' when a GPU kernel may run now, None to use the references.

    None when ``HF2Q_KERNELS=reference``, inside ``reference_only()``, when MLX has no GPU back
    end, or when the default device is the CPU (custom kernels only run on the GPU).
    """
    if _forced_reference.get() or _env_says_reference():
        return None
    kind, device, default_device = _gpu or _gpu_kind()
    if kind is None or default_device() != device:
        return None
    return kind


# MLX's CUDA allocator serves every allocation of 8 bytes or less from one small pool of
# managed memory advised read-mostly, and a kernel that reads an array there stalls once the
# host has touched the pool (H200, bench/kernel_floor.py: the 26B-A4B decode attention 27.5 us
# with its scale, head count and position in that pool, 5.7 us without; docs/kernel_notes.md,
# session 17; why the driver makes those reads slow was not measured). So the small arrays
# kernels read are made 16 bytes or more.
MIN_DEVICE_BYTES = 16


def device_array(values, dtype) -> mx.array:
    """``values`` (a list) as a 1-D array of ``len(values)`` elements; with MLX's CUDA back end
    its buffer holds at least ``MIN_DEVICE_BYTES`` (zeros after them: a view of a longer array).
    Elsewhere a plain array (Metal puts inputs of under 8 elements in its constant space)."""
    import mlx.core as mx

    n = len(values)
    pad = max(0, -(-MIN_DEVICE_BYTES // dtype.size) - n) if mx.cuda.is_available() else 0
    a = mx.array(list(values) + [0] * pad, dtype=dtype)
    if not pad:
        return a
    # the view evaluated now, on the CPU stream (no wait on queued GPU work): a Slice node left
    # in a compiled graph would run on every call
    with mx.stream(mx.cpu):
        view = a[:n]
        mx.eval(view)
    return view


@lru_cache(maxsize=320)
def device_constant(values: tuple, dtype) -> mx.array:
    """``device_array`` of ``values``, made once per distinct (values, dtype): a kernel's small
    parameter arrays, shared by every call that passes the same ones (no upload per step)."""
    return device_array(list(values), dtype)


def row_threads(width: int) -> int:
    """Threads a group for a one-thread-per-element kernel over rows of ``width`` elements: the
    largest of 256, 128, 64, 32 dividing it (0: none). The grid is then exactly the elements,
    with no bounds check, so the row count stays out of the kernel's template: one JIT compile
    for every prompt length."""
    return next((t for t in (256, 128, 64, 32) if width % t == 0), 0)
