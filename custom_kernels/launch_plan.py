"""A kernel launch worked out once per call shape: the mat-vec kernels' and the dense GLU's."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx

from hf2q_mlx.custom_kernels import device_array
from hf2q_mlx.custom_kernels._render import Kernel, TemplateValue


class LaunchPlan:
    """Everything one launch of ``kernel`` needs but its arrays, built once: the launch values
    (named as ``Kernel.launcher`` takes them) and ``dims``, the int32 sizes the kernel reads,
    always its last input.

    The kernel functions ``call`` it (through ``Kernel.__call__``, which takes ``init_value``);
    the dispatchers ``resolve`` it once (``Kernel.launcher``) into their call caches and ``run``
    it per call, so a repeat call (every decode step) is a lookup and the launch.
    """

    __slots__ = ("kernel", "grid", "threadgroup", "output_shapes", "output_dtypes", "template",
                 "dims", "launch")  # fmt: skip

    def __init__(
        self,
        kernel: Kernel,
        dims: Sequence[int],
        *,
        grid: tuple[int, ...],
        threadgroup: tuple[int, ...],
        output_shapes: list[tuple[int, ...]],
        output_dtypes: list[mx.Dtype],
        template: dict[str, TemplateValue],
    ) -> None:
        self.kernel = kernel
        self.grid = grid
        self.threadgroup = threadgroup
        self.output_shapes = output_shapes
        self.output_dtypes = output_dtypes
        self.template = template
        self.dims = device_array(list(dims), mx.int32)
        self.launch: Callable[..., list[mx.array]] | None = None  # set by resolve()

    def _values(self) -> dict:
        return {"grid": self.grid, "threadgroup": self.threadgroup,
                "output_shapes": self.output_shapes, "output_dtypes": self.output_dtypes,
                "template": self.template}  # fmt: skip

    def call(self, *arrays: mx.array, init_value: float | None = None) -> mx.array:
        """The first output of one launch on ``arrays`` and dims, through ``Kernel.__call__``
        (``init_value`` pre-fills the outputs: tests poison them with NaN)."""
        return self.kernel([*arrays, self.dims], init_value=init_value, **self._values())[0]

    def resolve(self, *dtypes: mx.Dtype) -> LaunchPlan:
        """Resolve the launch once for arrays of ``dtypes`` (then dims): ``run`` skips the
        checks and the cache key that ``Kernel.__call__`` pays on every call. Returns self."""
        self.launch = self.kernel.launcher([*dtypes, self.dims.dtype], **self._values())
        return self

    def run(self, *arrays: mx.array) -> mx.array:
        """The first output of the resolved launch on ``arrays`` and dims."""
        return self.launch(inputs=[*arrays, self.dims])[0]
