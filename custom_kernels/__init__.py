"""GPU kernels: one body per op rendered for Metal and CUDA, with a plain-MLX reference each.

``backend()`` says which GPU back end the dispatchers may use right now ("cuda", "metal") or
None, meaning every dispatcher takes its reference path. The reference is forced by the
environment variable ``HF2Q_KERNELS=reference`` or, for a block of code, by::

    with hf2q_mlx.custom_kernels.reference_only():
        y = ggml_matmul(x, w, ggml_type, in_features)   # reference path

Kept light: importing this package imports no kernel module.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator

__all__ = ["backend", "reference_only", "reference_forced", "ENV_VAR"]

ENV_VAR = "HF2Q_KERNELS"

# Depth of nested reference_only() blocks in this context (thread / task local).
_forced_reference: contextvars.ContextVar[int] = contextvars.ContextVar(
    "hf2q_forced_reference", default=0
)


@contextlib.contextmanager
def reference_only() -> Iterator[None]:
    """Force every dispatcher onto its reference path inside the block (nests, thread-local)."""
    token = _forced_reference.set(_forced_reference.get() + 1)
    try:
        yield
    finally:
        _forced_reference.reset(token)


def reference_forced() -> bool:
    """True inside ``reference_only()`` or with ``HF2Q_KERNELS=reference``."""
    return _forced_reference.get() > 0 or (
        os.environ.get(ENV_VAR, "").strip().lower() == "reference"
    )


def backend() -> str | None:
    """'cuda' or 'metal' when a GPU kernel may run now, None to use the references.

    None when ``HF2Q_KERNELS=reference``, inside ``reference_only()``, when MLX has no GPU back
    end, or when the default device is the CPU (custom kernels only run on the GPU).
    """
    if reference_forced():
        return None
    import mlx.core as mx

    if mx.default_device().type != mx.DeviceType.gpu:
        return None
    if mx.cuda.is_available():
        return "cuda"
    if mx.metal.is_available():
        return "metal"
    return None
