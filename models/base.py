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


def fused_layer_stack(layers, h: mx.array, caches, final_norm_weight: mx.array, *args) -> mx.array:
    """The kernel path's layer loop -> the final norm's output. Each layer's
    ``fused(h, n, cache, next_weight, *args)`` takes its residual ``h`` and its normed input
    ``n`` and returns both for the next layer: its last residual add shares one kernel with the
    next layer's input norm (the final norm after the last layer)."""
    n = layers[0].input_layernorm(h)
    nexts = [layer.input_layernorm.weight for layer in layers[1:]] + [final_norm_weight]
    for layer, c, w in zip(layers, caches, nexts):
        h, n = layer.fused(h, n, c, w, *args)
    return n


def position_array(offset: int) -> mx.array:
    """The first position of this call as a (1,) int32 array: the kernels read positions from an
    array, so every decode step builds the same graph."""
    return mx.array([offset], dtype=mx.int32)
