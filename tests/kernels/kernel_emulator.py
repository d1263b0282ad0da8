"""Run a Kernel's CUDA rendering on the CPU (g++ + tests/kernels/cuda_emu.h): tests without a GPU.

`emulate(kernel, inputs, grid=, threadgroup=, output_shapes=, output_dtypes=, template=)` mirrors
`Kernel.__call__` and returns MLX arrays. Each threadgroup runs as fibers, so this checks the
kernel's logic (indexing, decoding, reductions, barrier discipline), not its speed. Binaries
are cached by source hash; outputs are poisoned (0xFF bytes, NaN for floats) before the run.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np

from hf2q_mlx.custom_kernels import _render
from hf2q_mlx.custom_kernels._render import Example, Kernel

HERE = Path(__file__).resolve().parent
EMU_HEADER = HERE / "cuda_emu.h"
_CACHE = Path(os.environ.get("HF2Q_EMU_CACHE", Path(tempfile.gettempdir()) / "hf2q_emu_cache"))
_RAW = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}


def available() -> bool:
    return shutil.which("g++") is not None


def stub_include_dir() -> Path:
    """Empty stand-ins for the headers MLX's CUDA prelude includes."""
    d = _CACHE / "include"
    for rel in ("mlx/backend/cuda/device/utils.cuh", "cooperative_groups.h"):
        f = d / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.touch()
    return d


def _harness(kernel: Kernel, in_types: list[str], out_types: list[str]) -> str:
    lines = [
        "#include <fstream>",
        "#include <string>",
        "static std::vector<char> hq_read(const std::string& p) {",
        "  std::ifstream f(p, std::ios::binary); return {std::istreambuf_iterator<char>(f), {}}; }",
        "int main(int argc, char** argv) {",
        "  const std::string dir = argv[1];",
        "  dim3 g, b; g.x = atoi(argv[2]); g.y = atoi(argv[3]); g.z = atoi(argv[4]);",
        "  b.x = atoi(argv[5]); b.y = atoi(argv[6]); b.z = atoi(argv[7]);",
    ]
    args = []
    for i, t in enumerate(in_types):
        lines.append(f'  std::vector<char> r{i} = hq_read(dir + "/in{i}.bin");')
        lines.append(f"  char* in{i} = (char*)aligned_alloc(256, r{i}.size() + 256);")
        lines.append(f"  memcpy(in{i}, r{i}.data(), r{i}.size());")
        args.append(f"(const {t}*)in{i}")
    for i, t in enumerate(out_types):
        lines.append(f"  const size_t n{i} = strtoull(argv[{8 + i}], nullptr, 10);")
        lines.append(f"  char* out{i} = (char*)aligned_alloc(256, n{i} + 256);")
        lines.append(f'  std::vector<char> z{i} = hq_read(dir + "/init{i}.bin");')
        lines.append(f"  if (z{i}.size() == n{i}) memcpy(out{i}, z{i}.data(), n{i});")
        lines.append(f"  else memset(out{i}, 0xFF, n{i});")
        args.append(f"({t}*)out{i}")
    call = f"mlx::core::cu::custom_kernel_{kernel.name}({', '.join(args)});"
    lines.append(f"  hq_emu::launch(g, b, [&] {{ {call} }});")
    for i in range(len(out_types)):
        lines.append(f'  {{ std::ofstream f(dir + "/out{i}.bin", std::ios::binary);')
        lines.append(f"    f.write(out{i}, n{i}); }}")
    lines += ["  return 0;", "}"]
    return "\n".join(lines) + "\n"


# A fiber program of the emulator's switches: 3 groups of 64 threads, each thread a shared
# write, a barrier, a read of its neighbour's value and a warp shuffle; prints the sum.
_PROBE = r"""
#include <cstdio>
int main() {
  long long total = 0;
  dim3 g, b;
  g.x = 3;
  b.x = 64;
  hq_emu::launch(g, b, [&] {
    static int vals[64];
    const unsigned t = threadIdx.x;
    vals[t] = int(t * 3 + blockIdx.x);
    __syncthreads();
    const int v = vals[(t + 1) % 64] + __shfl_xor_sync(0xffffffffu, int(t), 1);
    __syncthreads();
    total += v;
  });
  std::printf("%lld\n", total);
  return 0;
}
"""
# sum over groups b and threads t of 3 ((t + 1) mod 64) + b + (t xor 1)
PROBE_SUM = sum(3 * ((t + 1) % 64) + b + (t ^ 1) for b in range(3) for t in range(64))
_SWITCH_FLAGS: list[list[str]] = []


def _options(flags: list[str]) -> list[str]:
    # no _FORTIFY_SOURCE: its longjmp check refuses a jump onto another fiber's stack
    return ["-std=c++17", "-O1", "-U_FORTIFY_SOURCE", "-w", *flags, "-I", str(stub_include_dir())]


def _compile_cmd(cpp: Path, exe: Path | str, flags: list[str], header: Path = EMU_HEADER):
    return ["g++", *_options(flags), "-include", str(header), str(cpp), "-o", str(exe)]


def _precompiled_header(flags: list[str]) -> Path:
    """The header for ``-include``: a copy in the cache with its precompiled form (.gch) beside
    it, which g++ reads instead of parsing the header and its STL includes again for every
    binary (~0.2 of 0.7 s a build); the plain header where the .gch cannot be built (g++ also
    falls back to the text by itself when the options differ)."""
    text = EMU_HEADER.read_text()
    key = hashlib.sha256((text + str(_options(flags))).encode()).hexdigest()[:16]
    header = _CACHE / "pch" / f"cuda_emu_{key}.h"
    gch = header.with_name(header.name + ".gch")
    if gch.exists():
        return header
    header.parent.mkdir(parents=True, exist_ok=True)
    tag = f".{os.getpid()}.{threading.get_ident()}"
    tmp = header.with_name(header.name + tag)
    tmp.write_text(text)
    os.replace(tmp, header)
    cmd = ["g++", *_options(flags), "-x", "c++-header", str(header), "-o", str(gch) + tag]
    if subprocess.run(cmd, capture_output=True).returncode != 0:
        return EMU_HEADER
    os.replace(str(gch) + tag, gch)
    return header


def probe(flags: list[str]) -> bool:
    """Does the emulator's fiber switch work here with ``flags`` (compiled and run once)?"""
    with tempfile.TemporaryDirectory() as tmp:
        cpp, exe = Path(tmp) / "probe.cpp", Path(tmp) / "probe"
        cpp.write_text(_PROBE)
        if subprocess.run(_compile_cmd(cpp, exe, flags), capture_output=True).returncode != 0:
            return False
        try:
            res = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
        except subprocess.TimeoutExpired:
            return False
        return res.returncode == 0 and res.stdout.strip() == str(PROBE_SUM)


def switch_flags() -> list[str]:
    """[] for the fast fiber switch (_setjmp / _longjmp), or ["-DHQ_EMU_UCONTEXT"] where a probe
    finds it broken (a libc whose longjmp refuses another stack, shadow stacks). The probe's
    answer is kept in the cache beside the binaries, per header text: a process whose binaries
    are all built compiles nothing (the whole-step tests start several)."""
    if not _SWITCH_FLAGS:
        key = hashlib.sha256(EMU_HEADER.read_text().encode()).hexdigest()[:16]
        record = _CACHE / f"switch_{key}"
        try:
            known = record.read_text().split()
        except OSError:
            known = None
        if known is None:
            known = [] if probe([]) else ["-DHQ_EMU_UCONTEXT"]
            _CACHE.mkdir(parents=True, exist_ok=True)
            tmp = record.with_name(f"{record.name}.{os.getpid()}.{threading.get_ident()}")
            tmp.write_text(" ".join(known))
            os.replace(tmp, record)
        _SWITCH_FLAGS.append(known)
    return _SWITCH_FLAGS[0]


def build(kernel: Kernel, example: Example) -> Path:
    """Compile (or reuse) the emulator binary for one instantiation."""
    src = kernel.render("cuda", example)
    for name in kernel.inputs:
        if any(f"{name}_{s}" in src for s in ("shape", "strides", "ndim")):
            raise NotImplementedError("the emulator does not pass shape/stride arguments")
    in_types = [
        _render._CUDA_TYPES[v[0] if isinstance(v, tuple) else v] for v in example.inputs.values()
    ]
    out_types = [_render._CUDA_TYPES[v] for v in example.outputs.values()]
    text = src + "\n" + _harness(kernel, in_types, out_types)
    flags = switch_flags()
    key = hashlib.sha256((text + EMU_HEADER.read_text() + str(flags)).encode()).hexdigest()[:20]
    exe = _CACHE / f"{kernel.name}_{key}"
    if exe.exists():
        return exe
    _CACHE.mkdir(parents=True, exist_ok=True)
    # private file names: two threads may build the same binary at once (the last rename wins)
    tag = f".{os.getpid()}.{threading.get_ident()}"
    cpp = exe.with_name(exe.name + tag + ".cpp")
    cpp.write_text(text)
    cmd = _compile_cmd(cpp, str(exe) + tag, flags, _precompiled_header(flags))
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"emulator build failed for {kernel.name}:\n{res.stderr[-6000:]}")
    os.replace(str(exe) + tag, exe)
    cpp.unlink(missing_ok=True)
    return exe


def emulate(
    kernel: Kernel,
    inputs: list[mx.array],
    *,
    grid,
    threadgroup,
    output_shapes,
    output_dtypes,
    template=None,
    init_value=None,
    initial=None,
) -> list[mx.array]:
    """Run `kernel` like `Kernel.__call__`, on the CPU, and return its outputs. ``initial``:
    arrays the outputs start from (an in-place launch) instead of the poison."""
    ex = Example(
        inputs={n: (a.dtype, a.size if a.ndim else 0) for n, a in zip(kernel.inputs, inputs)},
        outputs=dict(zip(kernel.outputs, output_dtypes)),
        template=dict(_render._norm_template(template)),
    )
    exe = build(kernel, ex)
    tg = _render._dims3(threadgroup, "threadgroup")
    groups = [-(-g // t) for g, t in zip(_render._dims3(grid, "grid"), tg)]
    sizes = [int(np.prod(s)) * d.size for s, d in zip(output_shapes, output_dtypes)]
    with tempfile.TemporaryDirectory() as tmp:
        for i, a in enumerate(inputs):
            raw = a.view(_RAW[a.dtype.size]) if a.dtype.size in _RAW else a
            np.ascontiguousarray(np.array(raw)).tofile(Path(tmp) / f"in{i}.bin")
        for i, a in enumerate(initial or []):
            raw = a.view(_RAW[a.dtype.size]) if a.dtype.size in _RAW else a
            np.ascontiguousarray(np.array(raw)).tofile(Path(tmp) / f"init{i}.bin")
        argv = [str(exe), tmp, *map(str, groups), *map(str, tg), *map(str, sizes)]
        res = subprocess.run(argv, capture_output=True, text=True, timeout=600)
        if res.returncode != 0:
            raise RuntimeError(f"emulated {kernel.name} failed ({res.returncode}): {res.stderr}")
        outs = []
        for i, (shape, dt) in enumerate(zip(output_shapes, output_dtypes)):
            raw = np.fromfile(Path(tmp) / f"out{i}.bin", dtype=np.uint8)
            if init_value is not None:
                raise NotImplementedError("init_value: the emulator always poisons instead")
            outs.append(mx.array(raw).view(dt).reshape(tuple(shape)))
    return outs


class Emulated:
    """Stands in for a ``_render.Kernel`` object (swap it into a dispatcher's module): the same
    call and ``launcher``, running the kernel's CUDA rendering here; counts launches."""

    def __init__(self, kernel: Kernel):
        self.kernel = kernel
        self.name, self.inputs, self.outputs = kernel.name, kernel.inputs, kernel.outputs
        self.launches = 0

    def __call__(self, inputs, **launch):
        self.launches += 1
        return emulate(self.kernel, list(inputs), **launch)

    def launcher(self, input_dtypes, *, backend=None, scalar_inputs=(), verbose=False, **launch):
        """``Kernel.launcher``'s stand-in: the dispatchers cache what it returns per call shape
        (keyed by this object, so each test's stand-in gets its own)."""
        return lambda inputs: self(inputs, **launch)


def kernel_call(kernel: Kernel, inputs, *, init_value=None, backend=None, verbose=False, **launch):
    """A ``Kernel.__call__`` replacement (monkeypatch it onto the class) running the emulator;
    ``init_value`` is not needed: the emulator poisons every output first."""
    return emulate(kernel, inputs, **launch)


def kernel_launcher(kernel: Kernel, input_dtypes, *, backend=None, scalar_inputs=(), verbose=False,
                    **launch):  # fmt: skip
    """A ``Kernel.launcher`` replacement, likewise: what a dispatcher caches per call shape."""
    return lambda inputs: kernel_call(kernel, inputs, **launch)
