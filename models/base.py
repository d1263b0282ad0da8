"""Small pieces shared by every architecture: the argument dataclass base, the kernel switch."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import mlx.core as mx

from .. import custom_kernels


@dataclass
class BaseModelArgs:
    @classmethod
    def from_dict(cls, params: dict):
        """Build from a config dict, ignoring keys this architecture does not use."""
        names = inspect.signature(cls).parameters
        return cls(**{k: v for k, v in params.items() if k in names})


def use_kernels() -> bool:
    """True when the fused GPU kernels may run (a GPU default device, no reference override).

    False on the CPU, under ``HF2Q_KERNELS=reference`` and inside ``reference_only()``: the
    models then build exactly their plain-MLX graphs, so the reference path stays bit for bit
    what it was. With kernels, a dispatcher still falls back to its own reference for a shape
    it does not cover.
    """
    return custom_kernels.backend() is not None


def position_array(offset: int) -> mx.array:
    """The first position of this call as a (1,) int32 array: the kernels read positions from an
    array, so every decode step builds the same graph."""
    return mx.array([offset], dtype=mx.int32)
