"""Does a custom kernel see a sliced input at its offset? (MLX CUDA back end probe.)

Copies x[i:j] through a one-line custom kernel and compares with the slice itself; then
the same for an input sliced along the last axis and one sliced inside a compiled function.
Prints one line per case; exit status 1 when any case reads the wrong elements.
"""

from __future__ import annotations

import sys

import mlx.core as mx


def copy_kernel():
    src = "unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n[0]) out[i] = x[i];"
    return mx.fast.cuda_kernel(name="offset_probe_copy", input_names=["x", "n"],
                               output_names=["out"], source=src)  # fmt: skip


def run(kernel, x: mx.array) -> mx.array:
    n = x.size
    return kernel(inputs=[x, mx.array([n], dtype=mx.uint32)], grid=(-(-n // 256) * 256, 1, 1),
                  threadgroup=(256, 1, 1), output_shapes=[x.shape],
                  output_dtypes=[x.dtype])[0]  # fmt: skip


def main() -> int:
    if not mx.cuda.is_available():
        print("no CUDA device: nothing to probe")
        return 0
    k = copy_kernel()
    base = mx.arange(64 * 8, dtype=mx.float32).reshape(64, 8)
    mx.eval(base)
    cases = {
        "rows 0:16": base[0:16],
        "rows 16:32": base[16:32],
        "rows 40:64": base[40:64],
        "row slices in one eval": None,
        "compiled slice 8:24": None,
    }
    bad = 0
    for name, view in cases.items():
        if name == "row slices in one eval":
            outs = [run(k, base[i : i + 16]) for i in range(0, 64, 16)]
            got, want = mx.concatenate(outs), base
        elif name == "compiled slice 8:24":
            got, want = mx.compile(lambda b: run(k, b[8:24]))(base), base[8:24]
        else:
            got, want = run(k, view), view
        ok = bool(mx.array_equal(got, want).item())
        first = got.reshape(-1)[0].item()
        print(
            f"{name:>24}: {'ok' if ok else 'WRONG'} (first element {first:g}, "
            f"expected {want.reshape(-1)[0].item():g})"
        )
        bad += not ok
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
