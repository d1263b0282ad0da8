"""bench/nvrtc_compile.py renders one cubin unit per kernel of its modules (the compile needs
an NVRTC library, which CI does not have: the rendering is what can break here)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import nvrtc_compile as nc  # noqa: E402


def test_units_render_one_extern_kernel_each():
    units = nc.units()
    names = [n for n, _ in units]
    assert len(units) >= 40 and len(set(names)) == len(names)
    for name, unit in units:
        assert f'extern "C" __global__ void {name}(' in unit
        assert unit.lstrip().startswith("#include <cuda_fp16.h>")
