"""NVRTC compile times of our cubin units (``cuda_cache``'s path), on any machine with an NVRTC
library: no GPU needed, so a first run's compile cost can be measured on the CPU host alone.

Renders one unit per kernel (its first example's template) from the custom_kernels modules,
then compiles them all: one after another, with ``--pch`` (NVRTC's automatic precompiled
headers), and on ``--threads`` threads (as ``cuda_cache.cubins`` spreads a capture's units).
Prints the total, the first compile (the process's first also pays NVRTC's start-up) and the
median of the rest; writes JSON.

    python3 bench/nvrtc_compile.py OUT.json --nvrtc /path/libnvrtc.so.13 \\
        --include /path/mlx/include/cccl --include /usr/local/cuda/include --arch sm_90
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hf2q_mlx  # noqa: E402, F401  (before mlx: the CPU BLAS routing)
from hf2q_mlx.custom_kernels import _render, cuda_cache  # noqa: E402

MODULES = ["tq_flash_decode", "tq_quantize", "dequant", "post_norm_residual", "rms_norm_rope",
           "activations", "moe_router", "expert_mma", "softcap", "qmatmul_mma",
           "decode_attention", "sampling"]  # fmt: skip


def units() -> list[tuple[str, str]]:
    """(symbol, translation unit) of each kernel's first example in MODULES."""
    out, seen = [], set()
    for mod_name in MODULES:
        mod = importlib.import_module(f"hf2q_mlx.custom_kernels.{mod_name}")
        for attr in vars(mod).values():
            for k in attr.values() if isinstance(attr, dict) else [attr]:
                if not isinstance(k, _render.Kernel) or id(k) in seen or not k.examples:
                    continue
                seen.add(id(k))
                ex = k.examples[0]
                ins = [v[0] if isinstance(v, tuple) else v for v in ex.inputs.values()]
                outs = list(ex.outputs.values())
                sig = "_".join(_render._SHORT[d] for d in ins) + "__"
                sig += "_".join(_render._SHORT[d] for d in outs)
                out.append(k.precompiled_unit(ins, (), outs, ex.template, sig))
    return out


def run(lib, todo, options, threads: int) -> dict:
    def one(unit):
        tic = time.perf_counter()
        cuda_cache._nvrtc_compile(lib, unit[1], unit[0], options)
        return time.perf_counter() - tic

    tic = time.perf_counter()
    if threads > 1:
        with ThreadPoolExecutor(threads) as pool:
            each = list(pool.map(one, todo))
    else:
        each = [one(u) for u in todo]
    return {"total_s": time.perf_counter() - tic, "first_s": each[0],
            "median_s": statistics.median(each[1:]), "max_s": max(each[1:])}  # fmt: skip


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="JSON file to write")
    p.add_argument("--nvrtc", default=None,
                   help="the NVRTC library to load (default: cuda_cache's own, with its "
                        "include paths and the GPU's architecture)")  # fmt: skip
    p.add_argument("--include", action="append", default=[], help="an include path (repeat)")
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--limit", type=int, default=0, help="the first N units only")
    p.add_argument("--thread-counts", default="",
                   help="e.g. 1,4,16: only these thread counts (no serial / pch rows): how the "
                        "compiles scale with the CPUs this machine really gives")  # fmt: skip
    a = p.parse_args(argv)
    if a.nvrtc:
        lib = ctypes.CDLL(a.nvrtc)
        options = [f"--gpu-architecture={a.arch}", "--std=c++17"]
        options += [f"--include-path={i}" for i in a.include]
    else:
        cuda_cache._setup(force=True)
        lib, options = cuda_cache._state.get("nvrtc"), cuda_cache._state.get("options")
        if lib is None:
            p.error(f"cuda_cache found no NVRTC ({cuda_cache._state.get('why')}): pass --nvrtc")
        a.arch = cuda_cache._state["arch"]
    todo = units()[: a.limit or None]
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    print(f"{len(todo)} units, {a.arch}, {os.cpu_count()} CPUs ({usable} in this process's set)")
    res = {"units": len(todo), "arch": a.arch, "cpus": os.cpu_count(), "affinity": usable}
    variants = [("serial", options, 1), ("pch", options + ["--pch"], 1),
                (f"threads {a.threads}", options, a.threads)]  # fmt: skip
    if a.thread_counts:
        variants = [(f"threads {n}", options, int(n)) for n in a.thread_counts.split(",")]
    # the same units in the same order each time; each variant's first compile is "first_s"
    for label, opts, threads in variants:
        res[label] = r = run(lib, todo, opts, threads)
        print(f"  {label:12s} total {r['total_s']:6.2f} s  first {r['first_s']:.2f} s  "
              f"median {r['median_s'] * 1e3:.0f} ms  max {r['max_s']:.2f} s")  # fmt: skip
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
