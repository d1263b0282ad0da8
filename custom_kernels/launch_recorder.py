"""A decode step's kernel launches, recorded instead of run, for replay as one CUDA graph.

Inside ``recording(rec)`` every ``Kernel`` launch goes to ``rec``: it keeps the launch (its
``LaunchSpec``, input arrays, output arrays) and hands back fresh evaluated outputs filled with
random values, running nothing. MLX ops the step still does between kernels run for real on
those values; a replay cannot repeat them, so ``check_replayable`` finds them: it compares two
recordings made with different step inputs and different random fills, and every kernel input
that is neither a recorded output, a step input or state (caches), nor equal in both
recordings, is an op whose result changes per token. ``GraphCaptureError`` names it.

Ops that write in place (a KV cache row) have no MLX form: ``launch_into`` records a launch
whose outputs are existing arrays. ``active()`` tells model code that it is being recorded, so
it takes those kernels instead of MLX's scatter, gather or argmax.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from hf2q_mlx.custom_kernels import _render
from hf2q_mlx.custom_kernels.cuda_driver import data_ptr, is_row_contiguous
from hf2q_mlx.errors import Hf2qError


class GraphCaptureError(Hf2qError):
    """The step does something a recorded graph cannot replay (an MLX op on per-token values,
    a strided kernel input, a kernel reading its inputs' shapes)."""


@dataclass
class Launch:
    spec: _render.LaunchSpec
    inputs: list[mx.array]
    outputs: list[mx.array]
    in_place: bool = False


def active() -> bool:
    """Whether launches are being recorded now."""
    return bool(_render._recorder)


@contextlib.contextmanager
def recording(rec: Recorder) -> Iterator[Recorder]:
    _render._recorder.append(rec)
    try:
        yield rec
    finally:
        _render._recorder.remove(rec)


def _fill(shape, dtype, key) -> mx.array:
    """Random values of ``dtype``: small non-negative integers for integer types (they may be
    indices), normals for floats."""
    if dtype == mx.bool_:
        return mx.random.bernoulli(0.5, shape, key=key)
    if mx.issubdtype(dtype, mx.integer):
        return mx.random.randint(0, 4, shape, key=key).astype(dtype)
    return mx.random.normal(shape, key=key).astype(dtype)


class Recorder:
    """Collects launches; ``seed`` sets the random fill of recorded outputs."""

    def __init__(self, seed: int = 0):
        self.launches: list[Launch] = []
        self.marks: dict[str, mx.array] = {}  # arrays the recorded code names (mark())
        self._key = mx.random.key(seed)

    def _next_key(self):
        self._key, key = mx.random.split(self._key)
        return key

    def _check_inputs(self, spec, inputs) -> None:
        if spec.kernel.reads_input_shape():
            raise GraphCaptureError(f"kernel {spec.kernel.name} reads its inputs' shapes")
        mx.eval(inputs)
        for i, x in enumerate(inputs):
            if spec.kernel.ensure_row_contiguous and not is_row_contiguous(x):
                raise GraphCaptureError(
                    f"kernel {spec.kernel.name}: input {spec.kernel.inputs[i]} is strided "
                    f"(shape {x.shape}); MLX would copy it first"
                )

    def launch(self, spec, inputs: list[mx.array]) -> list[mx.array]:
        self._check_inputs(spec, inputs)
        shapes, dtypes = spec.output_shapes, spec.output_dtypes
        outs = [_fill(s, d, self._next_key()) for s, d in zip(shapes, dtypes)]
        mx.eval(outs)
        self.launches.append(Launch(spec, inputs, outs))
        return outs

    def launch_into(self, spec, inputs: list[mx.array], targets: list[mx.array]) -> list[mx.array]:
        """A launch writing into ``targets`` (evaluated, row-contiguous, of the spec's shapes)."""
        self._check_inputs(spec, inputs)
        mx.eval(targets)
        for t, s, d in zip(targets, spec.output_shapes, spec.output_dtypes):
            if tuple(t.shape) != tuple(s) or t.dtype != d or not is_row_contiguous(t):
                raise GraphCaptureError(f"kernel {spec.kernel.name}: bad in-place target")
        self.launches.append(Launch(spec, inputs, list(targets), in_place=True))
        return list(targets)


def _owner(ptr: int, spans: list[tuple[int, int, str]]) -> str | None:
    for lo, hi, role in spans:
        if lo <= ptr < hi:
            return role
    return None


def _spans(arrays, role: str) -> list[tuple[int, int, str]]:
    out = []
    for a in arrays:
        p = data_ptr(a)
        out.append((p, p + a.nbytes, role))
    return out


def check_replayable(first: Recorder, second: Recorder, state: list[mx.array]) -> None:
    """Raise ``GraphCaptureError`` unless ``second`` repeats ``first`` launch for launch and
    every input of ``first`` is a recorded output, one of ``state`` (step inputs, caches: arrays
    the replay keeps at their addresses), or a value the same in both recordings (weights,
    constants). ``first`` and ``second`` must differ in their step inputs and fills."""
    if len(first.launches) != len(second.launches):
        raise GraphCaptureError(
            f"the step launched {len(first.launches)} then {len(second.launches)} kernels"
        )
    known = _spans(state, "state")
    for a, b in zip(first.launches, second.launches):
        if a.spec is not b.spec and (
            a.spec.kernel is not b.spec.kernel or a.spec.grid != b.spec.grid
            or a.spec.template != b.spec.template
        ):  # fmt: skip
            raise GraphCaptureError(f"launch {a.spec.kernel.name} differs between recordings")
    for n, (a, b) in enumerate(zip(first.launches, second.launches)):
        for i, (x, y) in enumerate(zip(a.inputs, b.inputs)):
            if _owner(data_ptr(x), known) is not None:
                continue
            if x.shape != y.shape or x.dtype != y.dtype or not _equal(x, y):
                raise GraphCaptureError(
                    f"launch {n} ({a.spec.kernel.name}): input {a.spec.kernel.inputs[i]} "
                    f"{tuple(x.shape)} comes from an MLX op on per-token values"
                )
        if not a.in_place:
            known += _spans(a.outputs, "scratch")


def _equal(x: mx.array, y: mx.array) -> bool:
    if data_ptr(x) == data_ptr(y):
        return True
    raw = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.size]
    xs = np.frombuffer(bytes(memoryview(x.reshape(-1))), raw) if x.size else np.zeros(0)
    ys = np.frombuffer(bytes(memoryview(y.reshape(-1))), raw) if y.size else np.zeros(0)
    return np.array_equal(xs, ys)


def mark(name: str, a: mx.array) -> None:
    """Name an array of the recording (the step's logits), for the graph's user to read."""
    if _render._recorder:
        _render._recorder[-1].marks[name] = a


def launch_into(launch, inputs: list[mx.array], targets: list[mx.array]) -> list[mx.array]:
    """Record ``launch`` (a ``Kernel.launcher`` result) writing into ``targets`` in place."""
    if not _render._recorder:
        raise GraphCaptureError("an in-place launch exists only inside a recording")
    return _render._recorder[-1].launch_into(launch.spec, list(inputs), list(targets))
