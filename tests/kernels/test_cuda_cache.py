"""custom_kernels/cuda_cache: our CUDA kernels compiled once per machine and launched through
``mx.fast.precompiled_cuda_kernel``; MLX's ``cuda_kernel`` wherever that path is off or fails.

On the CPU: the disk cache (NVRTC faked), the fallbacks, and the launcher's routing with MLX's
launch recorded. On a CUDA GPU: a kernel built both ways gives the same bits."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import mlx.core as mx
import pytest

from hf2q_mlx.custom_kernels import _render, cuda_cache

BODY = """
  // One thread per element: out = x * scale + D
  const uint i = pos_x;
  if (i >= uint(n[0])) return;
  out[i] = from_float<T>(to_float(x[i]) * 3.0f + float(D));
"""


def _kernel(body: str = BODY) -> _render.Kernel:
    ex = _render.Example(
        {"x": mx.float32, "n": (mx.int32, 0)}, {"out": mx.float32}, {"T": mx.float32, "D": 2}
    )
    return _render.Kernel("cache_demo", ["x", "n"], ["out"], body, examples=[ex], register=False)


@pytest.fixture
def fresh_state(monkeypatch, tmp_path):
    """cuda_cache as in a new process, its cache under tmp_path."""
    monkeypatch.setattr(cuda_cache, "_state", {"checked": False, "nvrtc": None, "arch": None,
                                               "options": None, "why": None})  # fmt: skip
    monkeypatch.setattr(cuda_cache, "_counts", {"compiled": 0, "from_disk": 0, "failed": 0})
    monkeypatch.setattr(cuda_cache, "_last_error", [])
    monkeypatch.setattr(cuda_cache, "_times", {"setup_s": 0.0, "compile_s": 0.0, "slowest": None})
    monkeypatch.setattr(cuda_cache, "_sizes", {})
    monkeypatch.setattr(cuda_cache, "_told", [])
    monkeypatch.setenv("HF2Q_MLX_CACHE", str(tmp_path))
    monkeypatch.setattr(cuda_cache, "MODE", "auto")
    monkeypatch.setattr(cuda_cache, "ENABLED", True)


@pytest.fixture
def fake_nvrtc(fresh_state, monkeypatch):
    """A found NVRTC whose compiles are recorded: the cubin is the source's bytes."""
    cuda_cache._state.update(checked=True, nvrtc=object(), arch="sm_90", version="13.0",
                             options=["--gpu-architecture=sm_90"])  # fmt: skip
    compiles = []

    def compile_(lib, source, name, options):
        compiles.append(name)
        if "BROKEN" in source:
            raise RuntimeError("error: identifier BROKEN is undefined")
        return source.encode()

    monkeypatch.setattr(cuda_cache, "_nvrtc_compile", compile_)
    return compiles


# --------------------------------------------------------------------------------------------
# When the path is off


@pytest.mark.skipif(mx.cuda.is_available(), reason="checks the CPU's answer")
def test_off_without_cuda(fresh_state, monkeypatch):
    monkeypatch.setattr(cuda_cache, "ENABLED", True)
    assert cuda_cache.cubin("k", "src") is None
    st = cuda_cache.status()
    assert st["why_off"] == "no CUDA back end" and not st["enabled"]
    assert st["compiled"] == st["from_disk"] == 0


def test_switch_read_at_import():
    """Unset (or any value but 0 and 1): auto, the cubins outside per-token steps."""
    code = "from hf2q_mlx.custom_kernels import cuda_cache as c; print(c.ENABLED, c.MODE)"
    for value, want in (("0", "False 0"), ("1", "True 1"), (None, "True auto"),
                        (" AUTO ", "True auto"), ("yes", "True auto")):  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k != "HF2Q_CUDA_KERNEL_CACHE"}
        if value is not None:
            env["HF2Q_CUDA_KERNEL_CACHE"] = value
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == want
        # a value that is not a mode is said once on stderr
        assert ("is not auto, 0 or 1" in out.stderr) == (value == "yes"), out.stderr


def test_switch_off_says_so(fresh_state, monkeypatch):
    monkeypatch.setattr(cuda_cache, "ENABLED", False)
    assert cuda_cache.cubin("k", "src") is None
    assert cuda_cache.status()["why_off"] == "HF2Q_CUDA_KERNEL_CACHE=0"


def test_nvrtc_of_mlx_cuda_version_first(monkeypatch):
    """Of the NVRTC libraries found, the one of the CUDA major version MLX has loaded first (a
    torch wheel's CUDA 12 NVRTC may sit on sys.path beside MLX's CUDA 13)."""
    maps = {"libcudart.so.": ["/x/nvidia/cu13/lib/libcudart.so.13"], "libcublas.so.": [],
            "libnvrtc.so.": [], "libnvrtc.so": []}  # fmt: skip
    monkeypatch.setattr(cuda_cache, "_loaded_libs", lambda stem: maps.get(stem, []))
    assert cuda_cache._cuda_major() == "13"
    paths = ["/a/libnvrtc.so.12", "/b/libnvrtc.so.13.0.48", "/c/libnvrtc.so"]
    assert cuda_cache._prefer_major(paths, "13") == [paths[1], paths[0], paths[2]]
    assert cuda_cache._prefer_major(paths, None) == paths
    maps["libcudart.so."] = []
    assert cuda_cache._cuda_major() is None


# --------------------------------------------------------------------------------------------
# The disk cache


def test_compiled_once_then_read_from_disk(fake_nvrtc, tmp_path):
    a = cuda_cache.cubin("k", "source A")
    assert a == b"source A" and fake_nvrtc == ["k"]
    files = list((tmp_path / "cuda_kernels" / "sm_90").iterdir())
    assert len(files) == 1 and files[0].name.startswith("k_") and files[0].suffix == ".cubin"
    # a later process: nothing compiled, the same bytes
    cuda_cache._counts.update(compiled=0, from_disk=0)
    assert cuda_cache.cubin("k", "source A") == a and fake_nvrtc == ["k"]
    assert cuda_cache.status()["from_disk"] == 1
    # other source, other options: compiled again, each in a file of its own
    assert cuda_cache.cubin("k", "source B") == b"source B"
    cuda_cache._state["options"] = ["--gpu-architecture=sm_90", "-lineinfo"]
    cuda_cache.cubin("k", "source A")
    assert fake_nvrtc == ["k", "k", "k"]
    names = sorted(p.name for p in (tmp_path / "cuda_kernels" / "sm_90").iterdir())
    assert len(names) == 3 and not any(n.endswith(".tmp") for n in names)


def test_status_reports_cubin_sizes(fake_nvrtc):
    """What each launch hashes on the host (MLX 0.32.4): the cubins' mean and largest size."""
    assert cuda_cache.status()["cubin_kib_mean"] == 0
    cuda_cache.cubin("a", "x" * 1024)
    cuda_cache.cubin("b", "y" * 3072)
    cuda_cache.cubin("a", "x" * 1024)  # from disk: still one kernel
    st = cuda_cache.status()
    assert st["cubin_kib_mean"] == 2.0 and st["cubin_kib_max"] == 3.0


def test_notifier_told_once_at_the_first_compile(fake_nvrtc, monkeypatch):
    told = []
    monkeypatch.setattr(cuda_cache, "_notifier", [])
    cuda_cache.set_notifier(told.append)
    cuda_cache.cubin("a", "source A")
    cuda_cache.cubin("b", "source B")
    cuda_cache.cubin("a", "source A")  # from disk
    assert len(told) == 1 and "sm_90" in told[0] and "once per machine" in told[0]
    cuda_cache.set_notifier(None)
    assert cuda_cache._notifier == []


def test_cubins_compile_at_once_in_order(fresh_state, monkeypatch, tmp_path):
    """``cubins``: each unit's cubin in the order given, the compiles overlapping on a machine
    with more than one CPU (a compile that waits for a second one to start proves it: alone it
    would time out), a failed one None, every compiled one on disk; a second call reads them."""
    cuda_cache._state.update(checked=True, nvrtc=object(), arch="sm_90", version="13.0",
                             options=["--gpu-architecture=sm_90"])  # fmt: skip
    both = threading.Barrier(2, timeout=5)
    running, peak = [0], [0]
    lock = threading.Lock()

    def compile_(lib, source, name, options):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        try:
            if name in ("a", "b"):  # the first two meet: both compiling at the same time
                both.wait()
            if "BROKEN" in source:
                raise RuntimeError("error: BROKEN")
            return source.encode()
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(cuda_cache, "_nvrtc_compile", compile_)
    monkeypatch.setattr(cuda_cache.os, "cpu_count", lambda: 4)
    units = [("a", "src a"), ("b", "src b"), ("c", "BROKEN c"), ("d", "src d")]
    assert cuda_cache.cubins(units) == [b"src a", b"src b", None, b"src d"]
    assert peak[0] >= 2
    st = cuda_cache.status()
    assert st["compiled"] == 3 and st["failed"] == 1
    assert len(list((tmp_path / "cuda_kernels" / "sm_90").glob("*.cubin"))) == 3
    monkeypatch.setattr(cuda_cache, "_nvrtc_compile", None)  # nothing compiles now
    assert cuda_cache.cubins(units[:2] + units[3:]) == [b"src a", b"src b", b"src d"]
    assert cuda_cache.status()["from_disk"] == 3


def test_compile_times_reported(fresh_state, monkeypatch):
    """status() sums the NVRTC seconds and names the slowest unit (a first prefill's profile
    tells our compiles from MLX's own by them); a disk read adds nothing."""
    cuda_cache._state.update(checked=True, nvrtc=object(), arch="sm_90", version="13.0",
                             options=["--gpu-architecture=sm_90"])  # fmt: skip
    clock = iter([0.0, 0.25, 1.0, 1.75, 5.0, 5.0])  # a: 0.25 s, b: 0.75 s

    monkeypatch.setattr(cuda_cache.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(cuda_cache, "_nvrtc_compile", lambda lib, src, name, opts: src.encode())
    cuda_cache.cubin("a", "src a")
    cuda_cache.cubin("b", "src b")
    cuda_cache.cubin("a", "src a")  # from disk: no clock read
    st = cuda_cache.status()
    assert st["compile_s"] == 1.0 and st["slowest_compile"] == ("b", 0.75)
    assert st["compiled"] == 2 and st["from_disk"] == 1


def test_compile_error_returns_none_and_says_why(fake_nvrtc):
    assert cuda_cache.cubin("bad", "BROKEN") is None
    st = cuda_cache.status()
    assert st["failed"] == 1 and "BROKEN is undefined" in st["last_error"]
    assert st["last_error"].startswith("bad:")


def test_unwritable_cache_still_gives_the_cubin(fake_nvrtc, tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("HF2Q_MLX_CACHE", str(blocker))
    assert cuda_cache.cubin("k", "source") == b"source"
    assert cuda_cache.cubin("k", "source") == b"source"  # compiled again: nothing was stored
    assert fake_nvrtc == ["k", "k"]


# --------------------------------------------------------------------------------------------
# The launcher's routing


def test_launcher_launches_the_cubin(fake_nvrtc, monkeypatch):
    launches = []

    def precompiled(**kw):
        launches.append(kw)
        return ["out"]

    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", precompiled)
    k = _kernel()
    units = []
    real = cuda_cache.cubin
    monkeypatch.setattr(cuda_cache, "cubin", lambda n, s: units.append((n, s)) or real(n, s))
    args = dict(grid=(100, 3), threadgroup=(64,), output_shapes=[(100,)],
                output_dtypes=[mx.float16], template={"T": mx.float16, "D": 2, "F": True},
                backend="cuda", scalar_inputs=[1])  # fmt: skip
    launch = k.launcher([mx.float32, mx.int32], **args)
    x, n = mx.ones((100,)), mx.array(100, dtype=mx.int32)
    assert launch(inputs=[x, n]) == ["out"]
    (name, unit), kw = units[0], launches[0]
    assert name.startswith("hq_cache_demo_f32_i32s__f16_") and kw["name"] == name
    assert kw["compiled_source"] == unit.encode()  # the fake cubin: the unit's text
    # every launch carries the same bytes (MLX keys the loaded module by name + their hash)
    launch(inputs=[x, n])
    assert launches[1]["compiled_source"] == unit.encode() and launches[1]["name"] == name
    assert kw["grid"] == (128, 3, 1) and kw["threadgroup"] == (64, 1, 1)
    assert kw["scalars"] == [] and kw["ensure_row_contiguous"] is True
    assert kw["output_shapes"] == [(100,)] and kw["output_dtypes"] == [mx.float16]
    assert kw["inputs"][0] is x and kw["inputs"][1] is n
    assert unit.startswith(cuda_cache.PRELUDE)
    assert f'extern "C" __global__ void {name}(' in unit
    assert "const float* x" in unit and "const int32_t* n" in unit and "__half* out" in unit
    assert "using T = __half;" in unit and "constexpr int D = 2;" in unit
    assert "constexpr int F = 1;" in unit and "cooperative_groups" not in unit
    # the same build again: no second unit; another template value: another kernel name
    k.launcher([mx.float32, mx.int32], **args)(inputs=[x, n])
    assert len(units) == 1
    other = k.launcher([mx.float32, mx.int32], **{**args, "template": {"T": mx.float16, "D": 3}})
    assert len(units) == 1  # a cubin is compiled at its first launch, not before
    other(inputs=[x, n])
    assert len(units) == 2 and units[1][0] != name


def test_per_token_steps_take_mlx_builds(fake_nvrtc, monkeypatch):
    """``auto``: a launch inside ``per_token()`` takes MLX's build (MLX hashes a cubin's image at
    each launch), outside it the cubin, the same plan switching per call; the depth is this
    thread's and comes back after an error. ``1``: the cubin everywhere; ``0``: nowhere."""
    used = []
    monkeypatch.setattr(
        mx.fast, "precompiled_cuda_kernel", lambda **kw: used.append("cubin") or ["c"]
    )
    k = _kernel()
    monkeypatch.setattr(k, "_kernel_for", lambda be, sig: lambda **kw: used.append("mlx") or ["m"])
    launch = k.launcher([mx.float32, mx.int32], grid=4, threadgroup=4, output_shapes=[(4,)],
                        output_dtypes=[mx.float32], backend="cuda")  # fmt: skip
    args = [mx.ones((4,)), mx.array(4, dtype=mx.int32)]
    launch(inputs=args)
    with cuda_cache.per_token():
        launch(inputs=args)
        with cuda_cache.per_token():
            launch(inputs=args)
        launch(inputs=args)
        seen = []
        t = threading.Thread(target=lambda: seen.append(cuda_cache.wants_cubin()))
        t.start()
        t.join()
        assert seen == [True]  # another thread is not in this one's step
    launch(inputs=args)
    assert used == ["cubin", "mlx", "mlx", "mlx", "cubin"]
    with pytest.raises(KeyError), cuda_cache.per_token():
        raise KeyError("x")
    assert cuda_cache.wants_cubin()
    monkeypatch.setattr(cuda_cache, "MODE", "1")
    with cuda_cache.per_token():
        assert cuda_cache.wants_cubin()
        launch(inputs=args)
    assert used[-1] == "cubin"
    monkeypatch.setattr(cuda_cache, "MODE", "0")
    monkeypatch.setattr(cuda_cache, "ENABLED", False)
    launch(inputs=args)
    assert not cuda_cache.wants_cubin() and used[-1] == "mlx"


def test_mlx_build_where_the_cubin_is_missing(fresh_state, monkeypatch):
    """No cubin (path off, compile failed) or a body reading an input's shape: MLX's build."""
    built = []

    def mlx_kernel(**kw):
        return ["mlx"]

    monkeypatch.setattr(cuda_cache, "cubin", lambda n, s: None)
    for body in (BODY, BODY.replace("uint(n[0])", "uint(x_shape[0])")):
        k = _kernel(body)
        monkeypatch.setattr(k, "_kernel_for", lambda be, sig: built.append(sig) or mlx_kernel)
        launch = k.launcher([mx.float32, mx.int32], grid=4, threadgroup=4, output_shapes=[(4,)],
                            output_dtypes=[mx.float32], backend="cuda")  # fmt: skip
        assert launch(inputs=[mx.ones((4,)), mx.array(4, dtype=mx.int32)]) == ["mlx"]
        assert launch.plan.cubin() is None and launch.plan.mlx().func is mlx_kernel
    assert built == ["f32_i32__f32", "f32_i32__f32"]
    calls = []
    monkeypatch.setattr(cuda_cache, "cubin", lambda n, s: calls.append(n) or b"x")
    k = _kernel(BODY.replace("uint(n[0])", "uint(x_shape[0])"))
    monkeypatch.setattr(k, "_kernel_for", lambda be, sig: mlx_kernel)
    launch = k.launcher([mx.float32, mx.int32], grid=4, threadgroup=4, output_shapes=[(4,)],
                        output_dtypes=[mx.float32], backend="cuda")  # fmt: skip
    assert launch(inputs=[mx.ones((4,)), mx.array(4, dtype=mx.int32)]) == ["mlx"]
    assert calls == []  # a shape-reading body never asks for a cubin


# --------------------------------------------------------------------------------------------
# On a CUDA GPU


@pytest.mark.skipif(not mx.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_precompiled_matches_mlx_build(fresh_state, monkeypatch):
    """Bit-equal outputs from our cubin and from MLX's build of the same kernel text; the
    precompiled launch's output poisoned with NaN first (an unwritten element fails). The
    cache is turned on here (``HF2Q_CUDA_KERNEL_CACHE=0`` may have set it off); it skips only
    where NVRTC is missing."""
    monkeypatch.setattr(cuda_cache, "ENABLED", True)
    x = mx.random.normal((1000,), key=mx.random.key(3)).astype(mx.bfloat16)
    n = mx.array(1000, dtype=mx.int32)
    args = dict(grid=1000, threadgroup=128, output_shapes=[(1000,)], output_dtypes=[mx.bfloat16],
                template={"T": mx.bfloat16, "D": 5}, backend="cuda", scalar_inputs=[1])  # fmt: skip
    ours = _kernel().launcher([mx.bfloat16, mx.int32], init_value=float("nan"), **args)
    cubin = ours.plan.cubin()
    st = cuda_cache.status()
    if not st["enabled"]:
        pytest.skip(f"cuda_cache off here: {st['why_off']}")
    assert st["last_error"] is None, st["last_error"]
    assert cubin is not None
    monkeypatch.setattr(cuda_cache, "cubin", lambda n, s: None)
    mlx_build = _kernel().launcher([mx.bfloat16, mx.int32], **args)
    assert mlx_build.plan.cubin() is None
    a, b = ours(inputs=[x, n])[0], mlx_build(inputs=[x, n])[0]
    # the first launch ran at once (MLX loaded the module); a later one finds it again
    assert cubin.loaded
    again = ours(inputs=[x * 2, n])[0]
    want = (x.astype(mx.float32) * 3 + 5).astype(mx.bfloat16)
    want2 = ((x * 2).astype(mx.float32) * 3 + 5).astype(mx.bfloat16)
    assert mx.array_equal(a, b).item() and mx.array_equal(a, want).item()
    assert mx.array_equal(again, want2).item()


def test_unloadable_cubin_falls_back_to_mlx_build(fake_nvrtc, monkeypatch, tmp_path):
    """A cubin MLX cannot load: counted as failed, and MLX's build serves that kernel from then
    on; any other error of the launch reaches the caller."""
    tried, mlx_calls = [], []
    error = ["Failed to load compiled hq_cache_demo kernel: device kernel image is invalid."]

    def precompiled(**kw):
        tried.append(kw["name"])
        raise RuntimeError(error[0])

    def mlx_kernel(**kw):
        mlx_calls.append(kw)
        return ["mlx"]

    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", precompiled)
    k = _kernel()
    monkeypatch.setattr(k, "_kernel_for", lambda be, sig: mlx_kernel)
    launch = k.launcher([mx.float32, mx.int32], grid=4, threadgroup=4, output_shapes=[(4,)],
                        output_dtypes=[mx.float32], backend="cuda",
                        template={"T": mx.float32, "D": 1})  # fmt: skip
    x, n = mx.ones((4,)), mx.array([4], dtype=mx.int32)
    assert launch(inputs=[x, n]) == ["mlx"] and launch(inputs=[x, n]) == ["mlx"]
    assert len(tried) == 1 and len(mlx_calls) == 2
    assert mlx_calls[0]["template"] == [("T", mx.float32), ("D", 1)]
    st = cuda_cache.status()
    assert st["failed"] == 1 and "device kernel image is invalid" in st["last_error"]
    # the unloadable file is gone: the next process compiles it again
    assert not list((tmp_path / "cuda_kernels" / "sm_90").glob("hq_cache_demo_*"))
    error[0] = "[malloc] out of memory"
    other = k.launcher([mx.float32, mx.int32], grid=8, threadgroup=4, output_shapes=[(8,)],
                       output_dtypes=[mx.float32], backend="cuda",
                       template={"T": mx.float32, "D": 2})  # fmt: skip
    with pytest.raises(RuntimeError, match="out of memory"):
        other(inputs=[x, n])
