"""At what clock do our short kernels run? (H200, issue 15)

Every small decode kernel takes 10-35 us alone on the H200 (`bench/kernel_floor.py`), several
times what its bytes and dependent round trips predict. One explanation needs no kernel at
all: the SMs running below their boost clock during short bursts of work. This probe runs a
one-warp kernel of 65,536 dependent FMAs (4 cycles each on sm_90) that times itself with
``clock64()``, in bursts of 1, 8 and 64 dependent calls after an idle second, then after a
busy half-second; per burst it prints the kernel's cycles, its CUPTI time and the clock they
imply (cycles / time), with nvidia-smi's SM clock read before and after.

    python3 bench/clock_probe.py --json /tmp/out/clock_probe.json      # H200 (torch for CUPTI)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import decode_profile as dp  # noqa: E402  (bench/decode_profile.py: CUPTI kernel list)

FMAS = 65536
_SRC = """
  // one warp; lane 0's result and cycle count are kept
  float a = x[threadIdx.x];
  long long t0 = clock64();
  for (int i = 0; i < FMAS; ++i) a = fmaf(a, 0.9999f, 1e-4f);
  long long t1 = clock64();
  out[threadIdx.x] = a;
  if (threadIdx.x == 0) cycles[0] = float(t1 - t0);
"""


def smi_clock() -> str:
    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,power.draw,pstate",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=10,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError) as e:
        return f"nvidia-smi: {e}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if not mx.cuda.is_available():
        print("no CUDA device: nothing to probe")
        return 0
    use_cupti = dp.cupti_available()
    kern = mx.fast.cuda_kernel(name="clock_probe_fma", input_names=["x"],
                               output_names=["out", "cycles"], source=_SRC)  # fmt: skip

    def call(x):
        return kern(inputs=[x], grid=(32, 1, 1), threadgroup=(32, 1, 1),
                    output_shapes=[(32,), (1,)], output_dtypes=[mx.float32, mx.float32],
                    template=[("FMAS", FMAS)])  # fmt: skip

    x = mx.random.uniform(shape=(32,))
    out, cyc = call(x)
    mx.eval(out, cyc)
    results = []
    for phase in ("after idle", "after busy"):
        for burst in (1, 8, 64):
            if phase == "after idle":
                time.sleep(1.0)
            else:  # half a second of back-to-back bursts first
                end = time.perf_counter() + 0.5
                while time.perf_counter() < end:
                    y = x
                    for _ in range(16):
                        y = call(y)[0]
                    mx.eval(y)
            before = smi_clock()
            prof = None
            if use_cupti:
                from torch.profiler import ProfilerActivity, profile

                prof = profile(activities=[ProfilerActivity.CUDA])
                prof.__enter__()
            y, cycles = x, []
            for _ in range(burst):
                y, c = call(y)
                cycles.append(c)
            tic = time.perf_counter()
            mx.eval(y, cycles)
            wall = (time.perf_counter() - tic) * 1e6 / burst
            kus = []
            if prof is not None:
                prof.__exit__(None, None, None)
                kus = [us for name, us in dp._cuda_kernels(prof) if "clock_probe" in name]
            cyc_med = statistics.median(float(c.item()) for c in cycles)
            r = {"phase": phase, "burst": burst, "cycles": cyc_med, "wall_us": wall,
                 "kernel_us": statistics.median(kus) if kus else None,
                 "kernel_us_first": kus[0] if kus else None, "smi_before": before,
                 "smi_after": smi_clock()}  # fmt: skip
            mhz = cyc_med / r["kernel_us"] if kus else None
            r["implied_mhz"] = mhz
            results.append(r)
            print(f"{phase:10s} burst {burst:2d}: {cyc_med:9.0f} cycles, kernel "
                  f"{r['kernel_us'] or 0:7.1f} us (first {r['kernel_us_first'] or 0:.1f}), "
                  f"{mhz or 0:6.0f} MHz implied; smi {before} -> {r['smi_after']}",
                  flush=True)  # fmt: skip
    if a.json:
        Path(a.json).write_text(json.dumps({"mlx": mx.__version__, "fmas": FMAS,
                                            "results": results}, indent=1))  # fmt: skip
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
