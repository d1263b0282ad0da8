"""Fused input projections of a gated delta-net block (Qwen 3.5): in_proj_qkv / z / b / a
stacked into one matmul per weight kind, their outputs handed on unsplit."""

from __future__ import annotations

import mlx.core as mx

from hf2q_mlx.custom_kernels.gated_delta_decode import Channels
from hf2q_mlx.models.quantized import fuse_linear_groups

# the input projections, in the order a fused layer stacks them (mlx-lm's Qwen3-Next names its
# fused layers in_proj_qkvz and in_proj_ba, as these do)
IN_PROJ = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
OUTPUTS = ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b")  # as ops.gated_delta_net takes


class FusedInProj:
    """Mixin for a delta-net module with the four ``IN_PROJ`` layers, ``conv_dim``,
    ``num_v_heads`` and ``head_v_dim``: projects through whichever layers hold them after
    ``fuse_projections``."""

    def _set_in_plan(self, groups=tuple((name, (name,)) for name in IN_PROJ)) -> None:
        """((attribute, ((member, first channel, channels), ...)), ...) for ``unpack``."""
        width = {
            "in_proj_qkv": self.conv_dim,
            "in_proj_z": self.num_v_heads * self.head_v_dim,
            "in_proj_b": self.num_v_heads,
            "in_proj_a": self.num_v_heads,
        }
        plan = []
        for attr, members in groups:
            firsts = [0]
            for m in members:
                firsts.append(firsts[-1] + width[m])
            plan.append((attr, tuple((m, f, width[m]) for m, f in zip(members, firsts))))
        # a plain attribute (object.__setattr__), outside the parameter tree
        object.__setattr__(self, "_in_plan", tuple(plan))

    def fuse_projections(self) -> None:
        """in_proj_qkv / z / b / a as one matmul per weight kind (``fuse_linear_groups``), lossless:
        all four -> in_proj_qkvzba; Q4_K qkv, z and dense b, a -> in_proj_qkvz and in_proj_ba."""
        if not all(name in self for name in IN_PROJ):  # fused already
            return
        groups = []
        for attr, members in fuse_linear_groups(self, IN_PROJ):
            if len(members) > 1:  # fused_name's "in_proj_qkv_in_proj_z_proj" -> "in_proj_qkvz"
                name = "in_proj_" + "".join(m.removeprefix("in_proj_") for m in members)
                layer = self[attr]
                delattr(self, attr)
                setattr(self, name, layer)
                attr = name
            groups.append((attr, members))
        self._set_in_plan(groups)

    def project(self, x: mx.array) -> list:
        """qkv, z, a, b (B, L, .) from x (B, L, D): one matmul per (fused) layer."""
        return self.unpack([self[attr](x) for attr, _ in self._in_plan])

    def unpack(self, ys: list[mx.array]) -> list:
        """The (fused) in_proj layers' outputs, in ``_in_plan``'s order -> qkv, z, a, b; a fused
        layer's members as ``Channels`` of its output, unsplit: the decode kernel reads them in
        place (no slice node), ``ops.gated_delta_net`` slices them on its other paths."""
        outs = {}
        for y, (_, members) in zip(ys, self._in_plan):
            for name, first, count in members:
                outs[name] = y if len(members) == 1 else Channels(y, first, count)
        return [outs[name] for name in OUTPUTS]
