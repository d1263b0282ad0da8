"""The few CUDA driver calls a replayed decode graph needs, through ctypes on libcuda.

MLX's CUDA back end allocates every array in managed memory (``cudaMallocManaged``), so the
address Python's buffer protocol gives for an evaluated array is also its device address:
``data_ptr``. With it, kernels compiled by ``cuda_cache`` can be launched on our own stream,
captured once into a CUDA graph and replayed with one ``cuGraphLaunch`` per token
(``hf2q_mlx/cuda_graph_step.py``), instead of MLX submitting each kernel again every token.

Everything here runs in MLX's process on MLX's device (the primary context MLX's runtime
calls use). ``available()`` says whether the driver library loads; ``Driver()`` raises
``CudaDriverError`` with the driver's message on any failed call.
"""

from __future__ import annotations

import ctypes

import numpy as np

from hf2q_mlx.errors import Hf2qError

# CUstreamCaptureMode: GLOBAL 0, THREAD_LOCAL 1, RELAXED 2
_CAPTURE_THREAD_LOCAL = 1
_STREAM_NON_BLOCKING = 1
_EVENT_DISABLE_TIMING = 0x2  # CU_EVENT_DISABLE_TIMING
# CUpointer_attribute
_ATTR_IS_MANAGED = 8
# CUlaunchAttributeID
_LAUNCH_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _LaunchAttrValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("flag", ctypes.c_int)]


class LaunchAttr(ctypes.Structure):
    """CUlaunchAttribute (cuda.h): an id, padding to 8 bytes, a 64-byte value union."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _LaunchAttrValue)]


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig (cuda.h): grid, block, dynamic shared bytes, stream, attributes."""

    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared_bytes", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(LaunchAttr)),
        ("num_attrs", ctypes.c_uint),
    ]


def _pdl_attrs() -> ctypes.Array:
    """One attribute: programmatic stream serialization allowed (PDL)."""
    attrs = (LaunchAttr * 1)()
    attrs[0].id = _LAUNCH_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION
    attrs[0].value.flag = 1
    return attrs


class CudaDriverError(Hf2qError):
    """A CUDA driver call failed (its name and the driver's message)."""


def available() -> bool:
    """Whether libcuda.so.1 loads (a driver is installed); says nothing about MLX."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


class _PyBuffer(ctypes.Structure):
    _fields_ = [
        ("buf", ctypes.c_void_p), ("obj", ctypes.py_object), ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p),
    ]  # fmt: skip


_PYBUF_STRIDES_FORMAT = 0x18 | 0x04


def data_ptr(a) -> int:
    """Device (= managed host) address of an evaluated MLX array's first element, view offset
    included (numpy cannot read a bfloat16 buffer, so the buffer protocol is called directly).
    Evaluates ``a`` first, as the buffer protocol does. MLX 0.32.4 puts a GPU op's output in
    device memory (``cudaMallocAsync``) and moves the buffer to managed memory the first time
    the host asks for its address (``Buffer::raw_ptr``): the first call on such an array copies
    it once; the address it returns stays the array's."""
    buf = _PyBuffer()
    if ctypes.pythonapi.PyObject_GetBuffer(
        ctypes.py_object(a), ctypes.byref(buf), _PYBUF_STRIDES_FORMAT
    ):
        raise CudaDriverError(f"no buffer for {type(a).__name__}")
    try:
        return int(buf.buf or 0)
    finally:
        ctypes.pythonapi.PyBuffer_Release(ctypes.byref(buf))


def is_row_contiguous(a) -> bool:
    return memoryview(a).c_contiguous


class Driver:
    """libcuda bound once: modules, one non-blocking stream, capture into a graph, replay."""

    def __init__(self) -> None:
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as err:
            raise CudaDriverError(f"no CUDA driver library: {err}") from None
        self._check("cuInit", self.lib.cuInit(0))
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        self._check("cuDeviceGet", self.lib.cuDeviceGet(ctypes.byref(dev), 0))
        self._check(
            "cuDevicePrimaryCtxRetain", self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
        )
        self._check("cuCtxSetCurrent", self.lib.cuCtxSetCurrent(ctx))
        self.ctx, self.device = ctx, dev.value
        self.stream = ctypes.c_void_p()
        self._check(
            "cuStreamCreate",
            self.lib.cuStreamCreate(ctypes.byref(self.stream), _STREAM_NON_BLOCKING),
        )
        self._modules: dict[str, ctypes.c_void_p] = {}  # loaded once, kept for the process
        self._functions: dict[str, ctypes.c_void_p] = {}
        self.lib.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p
        ]  # fmt: skip
        # programmatic dependent launches only (HF2Q_GRAPH_PDL 1 or 2): a driver without it still
        # launches everything else
        self._launch_ex = getattr(self.lib, "cuLaunchKernelEx", None)
        if self._launch_ex is not None:
            self._launch_ex.argtypes = [
                ctypes.POINTER(LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p
            ]  # fmt: skip
        self._pdl = _pdl_attrs()
        for name in ("cuMemcpyHtoDAsync_v2", "cuMemcpyDtoHAsync_v2", "cuMemcpyDtoDAsync_v2"):
            getattr(self.lib, name).argtypes = [
                ctypes.c_uint64 if "toD" in name else ctypes.c_void_p,
                ctypes.c_void_p if "HtoD" in name else ctypes.c_uint64,
                ctypes.c_size_t,
                ctypes.c_void_p,
            ]
        for name, vt in (("cuMemsetD8Async", ctypes.c_ubyte), ("cuMemsetD16Async", ctypes.c_ushort),
                         ("cuMemsetD32Async", ctypes.c_uint)):  # fmt: skip
            getattr(self.lib, name).argtypes = [
                ctypes.c_uint64,
                vt,
                ctypes.c_size_t,
                ctypes.c_void_p,
            ]

    def _check(self, what: str, err: int) -> None:
        if err != 0:
            msg = ctypes.c_char_p()
            self.lib.cuGetErrorString(err, ctypes.byref(msg))
            text = msg.value.decode() if msg.value else "unknown error"
            raise CudaDriverError(f"{what} failed: {text} ({err})")

    # -- memory --------------------------------------------------------------------------------
    def memory(self) -> tuple[int, int]:
        """(free, total) bytes of the device, as the driver counts them (other processes'
        allocations, MLX's pools and evictable managed pages all included)."""
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self._check(
            "cuMemGetInfo", self.lib.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
        )
        return free.value, total.value

    def prefetch(self, ptr: int, nbytes: int) -> None:
        """Migrate ``nbytes`` of managed memory at ``ptr`` to the device, on the stream
        (``cuMemPrefetchAsync``, the pre-13 symbol libcuda keeps: device ordinal, no location
        struct)."""
        fn = getattr(self.lib, "cuMemPrefetchAsync", None)
        if fn is None:
            raise CudaDriverError(
                "this CUDA driver has no cuMemPrefetchAsync (HF2Q_GRAPH_PREFETCH)"
            )
        fn.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        self._check("cuMemPrefetchAsync", fn(ptr, nbytes, self.device, self.stream))

    def is_managed(self, ptr: int) -> bool:
        flag = ctypes.c_uint()
        err = self.lib.cuPointerGetAttribute(
            ctypes.byref(flag), _ATTR_IS_MANAGED, ctypes.c_uint64(ptr)
        )
        self._check("cuPointerGetAttribute", err)
        return bool(flag.value)

    def upload(self, ptr: int, data: np.ndarray) -> None:
        """Copy host ``data`` to device address ``ptr`` on the stream (ordered with launches)."""
        data = np.ascontiguousarray(data)
        self._check(
            "cuMemcpyHtoDAsync",
            self.lib.cuMemcpyHtoDAsync_v2(ptr, data.ctypes.data, data.nbytes, self.stream),
        )

    def download(self, ptr: int, out: np.ndarray) -> None:
        """Copy ``out.nbytes`` from device address ``ptr`` into ``out`` (stream order; call
        ``synchronize`` before reading ``out``)."""
        self._check(
            "cuMemcpyDtoHAsync",
            self.lib.cuMemcpyDtoHAsync_v2(out.ctypes.data, ptr, out.nbytes, self.stream),
        )

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        self._check(
            "cuMemcpyDtoDAsync", self.lib.cuMemcpyDtoDAsync_v2(dst, src, nbytes, self.stream)
        )

    def fill(self, ptr: int, value: int, count: int, width: int, stream=None) -> None:
        """``count`` elements of ``width`` bytes (1, 2, 4) at ``ptr`` set to the bit pattern
        ``value`` (on ``stream``, else the stream)."""
        fn = {1: "cuMemsetD8Async", 2: "cuMemsetD16Async", 4: "cuMemsetD32Async"}[width]
        self._check(fn, getattr(self.lib, fn)(ptr, value, count, stream or self.stream))

    # -- kernels -------------------------------------------------------------------------------
    def function(self, name: str, image: bytes) -> ctypes.c_void_p:
        """Kernel ``name`` (extern "C") of the cubin ``image``, loaded once."""
        fn = self._functions.get(name)
        if fn is None:
            mod = ctypes.c_void_p()
            self._check("cuModuleLoadData", self.lib.cuModuleLoadData(ctypes.byref(mod), image))
            fn = ctypes.c_void_p()
            self._check(
                "cuModuleGetFunction",
                self.lib.cuModuleGetFunction(ctypes.byref(fn), mod, name.encode()),
            )
            self._modules[name], self._functions[name] = mod, fn
        return fn

    def launch(
        self, fn, grid: tuple, block: tuple, pointers: list[int], stream=None, pdl: bool = False
    ) -> None:
        """One launch on the stream (or ``stream``); every parameter is a device pointer.
        ``pdl``: with programmatic stream serialization allowed (the kernel's body must begin
        with one of ``_render.PDL_PROLOGUES``: it may start before the kernel ahead has ended)."""
        values = [ctypes.c_uint64(p) for p in pointers]
        params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        if not pdl:
            err = self.lib.cuLaunchKernel(fn, *grid, *block, 0, stream or self.stream, params, None)
            self._check("cuLaunchKernel", err)
            return
        if self._launch_ex is None:
            raise CudaDriverError("this CUDA driver has no cuLaunchKernelEx (HF2Q_GRAPH_PDL set)")
        config = LaunchConfig(
            (ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), 0, stream or self.stream,
            self._pdl, 1,
        )  # fmt: skip
        self._check("cuLaunchKernelEx", self._launch_ex(ctypes.byref(config), fn, params, None))

    # -- more streams, events (a capture that forks into lanes and joins them) -----------------
    def streams(self, n: int) -> list:
        """The stream and n - 1 more (non-blocking, made once, kept for the process)."""
        side = self.__dict__.setdefault("_side", [])
        while len(side) < n - 1:
            st = ctypes.c_void_p()
            self._check(
                "cuStreamCreate", self.lib.cuStreamCreate(ctypes.byref(st), _STREAM_NON_BLOCKING)
            )
            side.append(st)
        return [self.stream, *side[: n - 1]]

    def events(self, n: int) -> list:
        """n events without timing (made once, kept, reused by later captures)."""
        pool = self.__dict__.setdefault("_events", [])
        while len(pool) < n:
            ev = ctypes.c_void_p()
            self._check(
                "cuEventCreate", self.lib.cuEventCreate(ctypes.byref(ev), _EVENT_DISABLE_TIMING)
            )
            pool.append(ev)
        return pool[:n]

    def record(self, event, stream) -> None:
        self._check("cuEventRecord", self.lib.cuEventRecord(event, stream))

    def wait(self, stream, event) -> None:
        self._check("cuStreamWaitEvent", self.lib.cuStreamWaitEvent(stream, event, 0))

    # -- graphs --------------------------------------------------------------------------------
    def begin_capture(self) -> None:
        self._check(
            "cuStreamBeginCapture",
            self.lib.cuStreamBeginCapture_v2(self.stream, _CAPTURE_THREAD_LOCAL),
        )

    def end_capture(self) -> ctypes.c_void_p:
        """-> an instantiated graph (CUgraphExec) of what the stream recorded."""
        graph, exe = ctypes.c_void_p(), ctypes.c_void_p()
        self._check(
            "cuStreamEndCapture", self.lib.cuStreamEndCapture(self.stream, ctypes.byref(graph))
        )
        try:
            self._check(
                "cuGraphInstantiate",
                self.lib.cuGraphInstantiateWithFlags(
                    ctypes.byref(exe), graph, ctypes.c_ulonglong(0)
                ),
            )
        finally:
            self.lib.cuGraphDestroy(graph)
        return exe

    def replay(self, exe) -> None:
        self._check("cuGraphLaunch", self.lib.cuGraphLaunch(exe, self.stream))

    def destroy(self, exe) -> None:
        self.lib.cuGraphExecDestroy(exe)

    def synchronize(self) -> None:
        self._check("cuStreamSynchronize", self.lib.cuStreamSynchronize(self.stream))
