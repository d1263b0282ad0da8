"""Can our kernels run from a CUDA graph of our own, next to MLX? (H200 probe, prints and saves.)

1. An evaluated MLX array's buffer-protocol address is a managed pointer the GPU reads.
2. A cubin from ``cuda_cache`` launched through the driver (``cuda_driver``) on our stream
   writes an MLX array that MLX then reads correctly.
3. A chain of N dependent launches captured once into a graph and replayed: host us per
   replay and GPU us per kernel, against the same chain as N MLX ``cuda_kernel`` launches
   evaluated together, in interleaved rounds.

    python3 bench/cuda_graph_probe.py [--json OUT] [--chain 400] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx
import numpy as np

from hf2q_mlx.custom_kernels import cuda_cache, cuda_driver, device_array
from hf2q_mlx.custom_kernels._render import Example, Kernel

_BODY = """
  // One thread per element: out = x + 1.
  const uint e = gid_x * tg_size + tid;
  if (e >= n[0]) return;
  out[e] = x[e] + 1.0f;
"""
KERNEL = Kernel(
    "graph_probe_add_one",
    inputs=["x", "n"],
    outputs=["out"],
    body=_BODY,
    examples=[Example({"x": mx.float32, "n": (mx.uint32, 1)}, {"out": mx.float32})],
    register=False,
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--chain", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--size", type=int, default=4096)
    args = ap.parse_args()
    out: dict = {"chain": args.chain, "size": args.size}
    N = args.size

    a = mx.random.normal((N,))
    b = mx.zeros((N,))
    n = device_array([N], mx.uint32)
    mx.eval(a, b, n)
    drv = cuda_driver.Driver()
    pa, pb, pn = (cuda_driver.data_ptr(x) for x in (a, b, n))
    out["managed"] = [drv.is_managed(p) for p in (pa, pb, pn)]
    print("managed pointers:", out["managed"])

    name = "hq_graph_probe_add_one"
    unit = KERNEL._render_cuda(
        name, KERNEL.source("cuda"), [("x", mx.float32, 1 << 20), ("n", mx.uint32, 1)],
        [("out", mx.float32)], [], True,
    )  # fmt: skip
    blob = cuda_cache.cubin(name, unit, force=True)
    if blob is None:
        raise SystemExit(f"no cubin: {cuda_cache.status()}")
    fn = drv.function(name, blob)
    grid, block = (-(-N // 256), 1, 1), (256, 1, 1)

    # 2: one launch, read back by MLX
    drv.launch(fn, grid, block, [pa, pn, pb])
    drv.synchronize()
    got = np.array(b + 0)
    out["one_launch_exact"] = bool(np.array_equal(got, np.array(a) + 1))
    print("one launch, MLX reads it:", out["one_launch_exact"])

    # 3: chain a -> b -> a ... captured
    ptrs = [pa, pb]
    drv.begin_capture()
    for i in range(args.chain):
        drv.launch(fn, grid, block, [ptrs[i % 2], pn, ptrs[(i + 1) % 2]])
    exe = drv.end_capture()
    start = np.array(a)
    drv.replay(exe)
    drv.synchronize()
    final = ptrs[args.chain % 2]
    got = np.array((a if final == pa else b) + 0)
    out["graph_exact"] = bool(np.allclose(got, start + args.chain, rtol=0, atol=1e-3))
    print("graph chain value right:", out["graph_exact"])

    mlx_kernel = KERNEL.launcher(
        [mx.float32, mx.uint32], grid=(N,), threadgroup=(256,), output_shapes=[(N,)],
        output_dtypes=[mx.float32], backend="cuda",
    )  # fmt: skip

    def mlx_chain():
        x = a
        for _ in range(args.chain):
            x = mlx_kernel(inputs=[x, n])[0]
        t0 = time.perf_counter()
        mx.eval(x)
        return time.perf_counter() - t0

    rows = {"graph_host_us": [], "graph_wall_us": [], "mlx_wall_us": [], "direct_wall_us": []}
    mlx_chain()
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        drv.replay(exe)
        t1 = time.perf_counter()
        drv.synchronize()
        t2 = time.perf_counter()
        rows["graph_host_us"].append((t1 - t0) * 1e6)
        rows["graph_wall_us"].append((t2 - t0) * 1e6)
        t0 = time.perf_counter()
        for i in range(args.chain):
            drv.launch(fn, grid, block, [ptrs[i % 2], pn, ptrs[(i + 1) % 2]])
        drv.synchronize()
        rows["direct_wall_us"].append((time.perf_counter() - t0) * 1e6)
        rows["mlx_wall_us"].append(mlx_chain() * 1e6)
    for key, vals in rows.items():
        med = statistics.median(vals)
        out[key] = {"median": round(med, 1), "min": round(min(vals), 1), "max": round(max(vals), 1)}
        print(f"{key}: median {med:.1f} us ({med / args.chain:.2f} us per kernel)")
    drv.destroy(exe)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
