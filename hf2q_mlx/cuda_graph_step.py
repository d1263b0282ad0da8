"""A DecodeStep's token as one CUDA graph: recorded once, replayed every token.

MLX submits each kernel of a step again on every token: on the H200 that costs ~14 us of host
time per launch, so the 26B-A4B step (438 launches, 4.8 ms of kernels) took 7-9 ms of wall time
(docs/kernel_notes.md, session 18). Here the step's launches are recorded once per attention-span
bucket (``custom_kernels/launch_recorder.py``), compiled to cubins (``cuda_cache``), captured into
a CUDA graph on a stream of our own (``cuda_driver``) and replayed with one ``cuGraphLaunch``
per token; the host uploads the tokens and positions and reads back the greedy token ids (a
sampler may read the logits the graph leaves instead).

What the graph holds: every kernel of the step, reading the step's input buffers (tokens,
positions, active flags), the weights, the caches (KV rows written in place by the norm + RoPE
kernel's cache mode or by ``kv_write``), and scratch arrays the recording made for each kernel's
outputs. A cache array the step returns new is written over the old one by its kernel where the
kernel allows it (a delta-net's recurrent and conv states: ``fuse_state_writes``), else copied
back over it at the graph's end.

The caches belong to the graph while it runs: after MLX changes them (``DecodeStep.adopt``,
``prefill``, the compiled step) the next ``decode`` copies the new contents into the graph's
arrays first (``_bind``). No lazy positions, no token trees or verifies (one token a row), no
TurboQuant caches under ``HF2Q_TQ_GRAPH=0``, no step that still does MLX ops on a token's values
(heads under 32 wide, whose RoPE stays an MLX op; MoE experts with float weights):
``GraphCaptureError`` says which, and the caller keeps the compiled step. MLX float and 4-/8-bit
affine linears and embeddings take kernels since session 26 (``models/kernel_linears.py``).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import struct
import sys
from collections.abc import Sequence
from functools import lru_cache

import mlx.core as mx
import numpy as np

from hf2q_mlx.custom_kernels import cuda_cache, env_int, launch_recorder
from hf2q_mlx.custom_kernels import rms_norm_rope as norm_rope
from hf2q_mlx.custom_kernels.cuda_driver import Driver, data_ptr
from hf2q_mlx.custom_kernels.launch_recorder import GraphCaptureError, Launch, Recorder
from hf2q_mlx.decode_step import DecodeStep
from hf2q_mlx.errors import ContextLengthError, InvalidArgumentError


class Recording:
    """One span's launches (recorded outputs kept alive here), the token ids output, and the
    state copies (destination, source) the graph ends with."""

    def __init__(self, span: int, launches: list, out: mx.array, copies: list, logits=None):
        self.span, self.launches, self.out, self.copies = span, launches, out, copies
        self.logits = logits  # (B, V): the step's last logits, as the graph leaves them
        self.exe = None
        self.lanes = 1  # streams the capture spread the launches over (graph_lanes)
        self.plan: list = []  # what the graph holds: (fills, function, blocks, threads, pointers)
        self.copy_plan: list = []  # (destination, source, bytes)


def _fill_bits(value: float, dtype: mx.Dtype) -> tuple[int, int]:
    """(bit pattern, width) of ``value`` in ``dtype`` for a memset."""
    if dtype == mx.float32:
        return struct.unpack("<I", struct.pack("<f", value))[0], 4
    if dtype == mx.bfloat16:
        return struct.unpack("<I", struct.pack("<f", value))[0] >> 16, 2
    if dtype == mx.float16:
        return int(np.array(value, np.float16).view(np.uint16)), 2
    if dtype.size in (1, 2, 4) and float(value).is_integer():
        return int(value) & ((1 << (8 * dtype.size)) - 1), dtype.size
    raise GraphCaptureError(f"no memset for init value {value} of {dtype}")


def _enqueue(drv: Driver, entry: tuple, stream=None) -> None:
    """One entry of a recording's plan on the driver's stream (or ``stream``): its memsets, then
    its launch (``pdl``: a programmatic dependent launch, graph_pdl)."""
    fills, function, blocks, threads, ptrs, pdl = entry
    for fill in fills:
        drv.fill(*fill, stream=stream)
    drv.launch(function, blocks, threads, ptrs, stream=stream, pdl=pdl)


def graph_pdl(driver=None) -> int:
    """HF2Q_GRAPH_PDL: the graph's kernels as programmatic dependent launches (sm_90 on), each
    kernel's blocks scheduled while the kernel ahead of it finishes and waiting for it in their
    first instruction (``_render.PDL_PROLOGUES``). 1: each kernel lets the next one in as soon
    as its own wait ends; 2: it waits only (the next one comes in as its blocks exit); 0: plain
    launches. Unset: 2 on a GPU of compute capability 9.0 or later whose driver has
    cuLaunchKernelEx (``driver``: the capture's), else 0. Mode 1 decodes 0.85x the plain graph
    (session 34, H200, 26B-A4B Q4_K); mode 2 1.01-1.02x on 26B-A4B and 1.014x on 35B-A3B
    (sessions 35 and 43), its graph parity tests passing (docs/kernel_notes.md)."""
    mode = env_int("HF2Q_GRAPH_PDL", 0, 2)
    if mode is not None:
        return mode
    if driver is not None and getattr(driver, "_launch_ex", None) is None:
        return 0
    cc = _compute_capability()
    return 2 if cc is not None and cc[0] >= 9 else 0


@lru_cache(maxsize=1)
def _compute_capability() -> tuple[int, int] | None:
    """The GPU's compute capability, looked up once (None without CUDA)."""
    return cuda_cache._compute_capability() if mx.cuda.is_available() else None


def graph_prefetch() -> bool:
    """HF2Q_GRAPH_PREFETCH=1: after a capture, every managed buffer the graph reads or writes is
    migrated to the GPU (``cuMemPrefetchAsync``) instead of page by page at the first replays.
    Off by default: built in session 38 for a card where the managed weights sat in host memory
    (docs/decode_step.md, "Memory"), not yet run on a GPU."""
    return env_int("HF2Q_GRAPH_PREFETCH", 0, 1) == 1


def graph_lanes() -> int:
    """HF2Q_GRAPH_LANES: streams a graph's capture spreads independent launches over (a Gemma 4
    26B-A4B layer's dense MLP beside its router and experts, Qwen 3.5's shared expert beside
    the routed ones), so the graph runs them side by side. 1 (the default until measured on a
    GPU): the recorded order, one launch after another."""
    return env_int("HF2Q_GRAPH_LANES", 1, 8) or 1


def _reader_counts(launches: list) -> dict[int, int]:
    """Buffer address -> how many launch inputs read it."""
    readers: dict[int, int] = {}
    for launch in launches:
        for x in launch.inputs:
            readers[data_ptr(x)] = readers.get(data_ptr(x), 0) + 1
    return readers


def fuse_kv_writes(launches: list) -> list:
    """Where ``kv_write`` copies the keys and values an ``rms_norm_rope`` launch just made, that
    launch writes them into the caches itself (its cache mode) and the copy goes: one launch
    fewer per attention layer. Only when nothing else reads those outputs and both launches
    read the same positions."""
    readers = _reader_counts(launches)
    producers = {}  # (keys ptr, values ptr) -> index of the rms_norm_rope launch
    for i, launch in enumerate(launches):
        if launch.spec.kernel.name == "rms_norm_rope" and len(launch.outputs) == 3:
            producers[(data_ptr(launch.outputs[1]), data_ptr(launch.outputs[2]))] = i
    out = list(launches)
    for i, kw in enumerate(launches):
        if kw.spec.kernel.name != "kv_write":
            continue
        k_src, v_src, pos = kw.inputs
        j = producers.get((data_ptr(k_src), data_ptr(v_src)))
        if j is None or j > i or readers[data_ptr(k_src)] != 1 or readers[data_ptr(v_src)] != 1:
            continue
        nr = launches[j]
        params = [int(v) for v in nr.inputs[8].tolist()]
        if data_ptr(nr.inputs[7]) != data_ptr(pos) or params[12] != 1 or params[20] != 0:
            continue  # other positions, or outputs not (B, H, L, D)
        t = dict(kw.spec.template)
        spec = dataclasses.replace(
            nr.spec, output_shapes=(nr.spec.output_shapes[0], *kw.spec.output_shapes)
        )
        inputs = [*nr.inputs[:8], norm_rope.cache_mode_params(nr.inputs[8], t["C"], t["RING"])]
        out[j] = Launch(spec, inputs + nr.inputs[9:], [nr.outputs[0], *kw.outputs], in_place=True)
        out[i] = None
    return [launch for launch in out if launch is not None]


def fuse_state_writes(launches: list, copies: list) -> tuple[list, list]:
    """Where the graph would end by copying a kernel's new state over the state that kernel read
    (a delta-net's recurrent and conv states), the kernel writes over the old one itself when it
    allows that (``Kernel.in_place``, with its template flag from ``in_place_flags``) and no
    other launch reads either array: a copy node fewer, and its traffic (the recurrent state is
    2 MB a layer on Qwen3.5-35B-A3B). -> (launches, the copies left)."""
    readers = _reader_counts(launches)
    producers = {}  # output pointer -> (launch index, output index)
    for i, launch in enumerate(launches):
        if not launch.in_place:
            for j, o in enumerate(launch.outputs):
                producers[data_ptr(o)] = (i, j)
    out, left = list(launches), []
    for dst, src in copies:
        i, j = producers.get(data_ptr(src), (None, None))
        if i is not None:
            launch = out[i]
            kernel = launch.spec.kernel
            over = kernel.in_place.get(kernel.outputs[j])
            k = kernel.inputs.index(over) if over is not None else None
            if (
                k is not None
                and data_ptr(launch.inputs[k]) == data_ptr(dst)
                and launch.inputs[k].nbytes == dst.nbytes == src.nbytes
                and readers.get(data_ptr(dst)) == 1
                and data_ptr(src) not in readers
            ):
                outputs = list(launch.outputs)
                outputs[j] = dst
                spec = launch.spec
                flag = kernel.in_place_flags.get(kernel.outputs[j])
                if flag is not None:  # the body must know (another kernel build)
                    template = tuple((n, 1 if n == flag else v) for n, v in spec.template)
                    spec = dataclasses.replace(spec, template=template)
                out[i] = Launch(spec, launch.inputs, outputs, in_place=True)
                continue
        left.append((dst, src))
    return out, left


def launch_dependencies(launches: list) -> list[set[int]] | None:
    """For each launch, the earlier launches it must follow: the last writer of every buffer it
    reads or writes, and, where it writes, every reader since that write. A kernel's outputs are
    written; an input named ``counter`` too (the "last threadgroup" tickets: moe_router,
    decode_attention, gated_delta_decode), and every input of a kernel taking tickets without
    one. None when two buffers overlap without being the same (views into one buffer): the
    caller keeps the recorded order then."""
    accesses = []  # per launch: (pointer, end, written)
    spans = set()
    for launch in launches:
        k = launch.spec.kernel
        atomics = "ATOMIC_ADD_U32" in k.body and "counter" not in k.inputs
        acc = []
        for name, x in zip(k.inputs, launch.inputs):
            p = data_ptr(x)
            acc.append((p, p + x.nbytes, atomics or name == "counter"))
        for o in launch.outputs:
            p = data_ptr(o)
            acc.append((p, p + o.nbytes, True))
        accesses.append(acc)
        spans.update((p, e) for p, e, _ in acc if e > p)
    end = -1
    for p, e in sorted(spans):  # distinct spans must not overlap
        if p < end:
            return None
        end = max(end, e)
    writer: dict[int, int] = {}  # buffer -> its last writer
    readers: dict[int, list[int]] = {}  # buffer -> its readers since that write
    deps: list[set[int]] = []
    for i, acc in enumerate(accesses):
        d = set()
        for p, _, written in acc:
            if p in writer:
                d.add(writer[p])
            if written:
                d.update(readers.get(p, ()))
        for p, _, written in acc:
            if written:
                writer[p], readers[p] = i, []
            else:
                readers.setdefault(p, []).append(i)
        d.discard(i)
        deps.append(d)
    return deps


def schedule_lanes(deps: list[set[int]], lanes: int) -> list[tuple[int, list[int]]]:
    """(lane, launches to wait for) for each launch, in the recorded order, over ``lanes``
    streams: a launch continues the lane of a dependency that lane ended with, else takes the
    lane idle longest; it waits for each dependency on another lane that the waits so far (and
    what those imply) do not cover. Lane 0 is the capture's own stream."""
    if lanes <= 1:
        return [(0, []) for _ in deps]
    lane_of: list[int] = []
    tail = [-1] * lanes
    seen = [
        [-1] * lanes for _ in range(lanes)
    ]  # seen[a][b]: lane b's launches up to here precede a's next
    implied: list[list[int]] = []  # per launch: what its completion implies
    out = []
    for i, d in enumerate(deps):
        lane = next((lane_of[j] for j in sorted(d, reverse=True) if tail[lane_of[j]] == j), None)
        if lane is None:
            lane = min(range(lanes), key=lambda n: tail[n])
        cur = list(seen[lane])
        cur[lane] = tail[lane]
        waits = []
        for j in sorted(d, reverse=True):
            if cur[lane_of[j]] >= j:
                continue
            waits.append(j)
            cur = [max(a, b) for a, b in zip(cur, implied[j])]
        cur[lane] = i
        lane_of.append(lane)
        tail[lane] = i
        seen[lane] = cur
        implied.append(list(cur))
        out.append((lane, waits))
    return out


def _refuse_host_memory(driver: Driver, probe: mx.array) -> None:
    """GraphCaptureError unless asking MLX for an array's address gives managed memory. On a
    GPU without concurrent managed access MLX 0.32.4 moves such a buffer to pinned host memory
    instead (``CudaAllocator::move_to_unified_memory``): the graph would then move every weight
    there and read it over the host bus. Asked once, on a small input buffer, before any
    weight's address is."""
    if not driver.is_managed(data_ptr(probe)):
        raise GraphCaptureError(
            "MLX hands this GPU's arrays to the host as pinned host memory, not managed memory "
            "(no concurrent managed access): the graph would read every weight over the host bus"
        )


def _alias(a: mx.array) -> mx.array:
    """Another array object over ``a``'s buffer (no copy once evaluated)."""
    return mx.stop_gradient(a)


def _scratch_view(a: mx.array, scratch: dict) -> mx.array | None:
    """``a`` when it lies in one of the recording's output buffers."""
    p = data_ptr(a)
    for base, o in scratch.items():
        if base <= p and p + a.nbytes <= base + o.nbytes:
            return a
    return None


class CudaGraphStep:
    """One token for each of ``step``'s rows through recorded CUDA graphs: ``decode`` returns
    the greedy ids, ``last.logits`` holds the logits. ``driver`` None: record and check only
    (the CPU tests replay the recording through the kernel emulator)."""

    def __init__(self, step: DecodeStep, driver: Driver | None = None):
        if step.lazy_positions is not None:
            raise InvalidArgumentError("CudaGraphStep needs a DecodeStep without lazy positions")
        self.step, self.driver = step, driver
        B, rows = step.max_batch, step._rows
        # the step's inputs, each padded past MLX's small pool and kept at one address
        self._tokens = mx.zeros((max(B, 4),), mx.int32)
        self._pos = mx.zeros((rows,), mx.int32)
        self._active = mx.zeros((max(rows, 16),), mx.bool_)
        mx.eval(self._tokens, self._pos, self._active)
        if driver is not None:
            _refuse_host_memory(driver, self._tokens)
        # The arrays the graphs write, objects of our own over the step's cache buffers. The step
        # gets other objects over the same buffers (``_hand_over``): whatever it does with those
        # (an in-place ``a[row] = v`` rebinds an object to a new buffer) cannot free a buffer
        # the graph writes; a step array that is not the one handed over is copied in (``_bind``).
        self._caches = [[_alias(a) for a in s.arrays] for s in step.caches]
        mx.eval(self._caches)
        self._hand_over(step.caches)
        self.recordings: dict[int, Recording] = {}
        step.row_writer = self._write_row  # prefills and row resets write the graph's buffers

    def _hand_over(self, caches) -> None:
        """The step's caches become fresh objects over the graph's buffers; remember them."""
        for s, mine in zip(caches, self._caches):
            s.arrays = [_alias(m) for m in mine]
        mx.eval([s.arrays for s in caches])
        self._handed = [list(s.arrays) for s in self.step.caches]

    def _write_row(self, buf: mx.array, row: int, value: mx.array, n: int | None = None):
        """``value`` into row ``row`` of ``buf`` (its first ``n`` slots on axis 2 when given), in
        place, when ``buf`` is an array the graph handed to the step -> ``buf``; None for any
        other array (the step makes a new one then). A prefill, a reused prefix or a reset row
        then moves one row's bytes: a new cache array would be copied back whole at the next
        ``decode`` (``_bind``), and asking MLX for its address moves the whole buffer to
        managed memory first (gigabytes a prefill on 26B-A4B at 32 rows: session 22 found the
        serving engine's 600 ms inter-token gaps there)."""
        if not any(buf is h for handed in self._handed for h in handed):
            return None
        if n is not None and not 0 <= n <= buf.shape[2]:
            return None  # not a row's slots: MLX's write says what is wrong
        if n == 0:
            return buf
        shape = buf.shape[1:] if n is None else (buf.shape[1], n, *buf.shape[3:])
        v = mx.contiguous(mx.broadcast_to(value.astype(buf.dtype), shape))
        mx.eval(v)
        mx.synchronize()  # MLX work still queued may read the row
        row_bytes = buf.nbytes // buf.shape[0]
        dst, src = data_ptr(buf) + row * row_bytes, data_ptr(v)
        if n is None:
            pieces = [(dst, src, v.nbytes)]
        else:  # (H, n, D) into (H, C, D): one piece per head
            H = buf.shape[1]
            pieces = [(dst + h * (row_bytes // H), src + h * (v.nbytes // H), v.nbytes // H)
                      for h in range(H)]  # fmt: skip
        for d, s, nbytes in pieces:
            if self.driver is not None:
                self.driver.copy(d, s, nbytes)
            else:  # host memory (the CPU back end)
                ctypes.memmove(d, s, nbytes)
        if self.driver is not None:
            self.driver.synchronize()  # v may be freed once this returns
        return buf

    # ---- recording ---------------------------------------------------------------------------

    def _write(self, a: mx.array, values: np.ndarray) -> None:
        values = np.ascontiguousarray(values)
        if self.driver is not None:
            self.driver.upload(data_ptr(a), values)
        else:  # host memory (the CPU back end)
            ctypes.memmove(data_ptr(a), values.ctypes.data, values.nbytes)

    def _set_inputs(self, tokens: Sequence[int], positions: Sequence[int], active) -> None:
        B = self.step.max_batch
        t = np.zeros(self._tokens.size, np.int32)
        t[:B] = tokens
        p = np.zeros(self._pos.size, np.int32)
        p[:B] = positions
        f = np.zeros(self._active.size, np.bool_)
        f[:B] = active
        self._write(self._tokens, t)
        self._write(self._pos, p)
        self._write(self._active, f)

    def _record_once(self, span: int, seed: int) -> tuple[Recorder, mx.array, list]:
        st, B = self.step, self.step.max_batch
        tokens = self._tokens[:B].reshape(B, 1)
        rec = Recorder(seed)
        with launch_recorder.recording(rec):
            out, arrays, _, _ = st._step(
                tokens, self._pos, self._active[: self._pos.size], self._caches, span, True
            )
            mx.eval(out)
        self._hand_over(st.caches)  # _step leaves the caches pointing at the graph's objects
        return rec, out, arrays

    def record(self, span: int) -> Recording:
        """Record the step at ``span`` twice (other inputs, other fills), check that a replay
        repeats it (``check_replayable``), and keep the first recording."""
        B = self.step.max_batch
        self._bind()
        first = self._recording_inputs(span, [1] * B, seed=1)
        second = self._recording_inputs(span, [0] * B, seed=2)
        rec1, out, arrays = first
        rec2 = second[0]
        state = [self._tokens, self._pos, self._active] + [a for c in self._caches for a in c]
        launch_recorder.check_replayable(rec1, rec2, state)
        scratch = {data_ptr(o): o for launch in rec1.launches if not launch.in_place
                   for o in launch.outputs}  # fmt: skip
        copies = []
        for old, new in zip(self._caches, arrays):
            for o, n in zip(old, new):
                if n is o or data_ptr(n) == data_ptr(o):
                    continue
                if data_ptr(n) not in scratch or n.nbytes != o.nbytes or n.dtype != o.dtype:
                    raise GraphCaptureError("a cache comes back from an MLX op, not a kernel")
                copies.append((o, n))
        if out.dtype != mx.uint32 or out.size != B:
            raise GraphCaptureError(f"the step's greedy ids are {out.dtype} {out.shape}")
        del second, rec2
        logits = rec1.marks.get("logits")
        if logits is not None and _scratch_view(logits, scratch) is None:
            logits = None  # not a kernel's output: nothing the graph writes
        launches, copies = fuse_state_writes(fuse_kv_writes(rec1.launches), copies)
        rec = Recording(span, launches, out, copies, logits)
        self.recordings[span] = rec
        return rec

    def prepare(self, span: int) -> Recording:
        """The graph of ``span`` (a bucket of ``DecodeStep.spans()``), recorded and captured
        now if it is not yet. Recording runs the step on the rows' caches at their positions:
        call it where no row holds a request, or where those slots are written next anyway
        (as ``decode`` does)."""
        rec = self.recordings.get(span)
        if rec is None:
            rec = self.record(span)
        if rec.exe is None:
            self._capture(rec)
        return rec

    def _recording_inputs(self, span, tokens, seed):
        st = self.step
        positions = [min(p + seed - 1, span - 1) for p in st.positions]
        self._set_inputs(tokens, positions, [True] * st.max_batch)
        if self.driver is not None:
            self.driver.synchronize()
        return self._record_once(span, seed)

    # ---- the graph ---------------------------------------------------------------------------

    def _capture(self, rec: Recording) -> None:
        drv = self.driver
        pdl = graph_pdl(drv)
        functions, names, units = {}, [], {}
        for launch in rec.launches:
            name, unit = launch.spec.unit(pdl)
            names.append(name)
            units.setdefault(name, (unit, launch.spec.kernel.name))
        # every cubin before the first function: a fresh machine compiles them at once
        blobs = cuda_cache.cubins([(n, u) for n, (u, _) in units.items()], force=True)
        for (name, (_, kernel_name)), blob in zip(units.items(), blobs):
            if blob is None:
                why = cuda_cache.status()["last_error"]
                raise GraphCaptureError(f"no cubin for {kernel_name}: {why}")
            functions[name] = drv.function(name, blob)
        # Every address is resolved before the capture: data_ptr evaluates a lazy array, and an
        # MLX allocation inside a capture is refused (cudaMallocManaged while capturing).
        plan, spans = [], {}  # spans: address -> bytes from it the graph touches
        for launch in rec.launches:
            spec = launch.spec
            fills = []
            if spec.init_value is not None and not launch.in_place:
                for o in launch.outputs:
                    bits, width = _fill_bits(spec.init_value, o.dtype)
                    fills.append((data_ptr(o), bits, o.nbytes // width, width))
            arrays = launch.inputs + launch.outputs
            ptrs = [data_ptr(x) for x in arrays]
            for p, a in zip(ptrs, arrays):
                spans[p] = max(spans.get(p, 0), a.nbytes)
            plan.append((fills, functions[names[len(plan)]], spec.blocks, spec.threadgroup, ptrs,
                         pdl > 0))  # fmt: skip
        copies = [(data_ptr(dst), data_ptr(src), dst.nbytes) for dst, src in rec.copies]
        rec.plan, rec.copy_plan = plan, copies
        lanes = graph_lanes()
        deps = launch_dependencies(rec.launches) if lanes > 1 else None
        sched = schedule_lanes(deps, lanes) if deps is not None else [(0, [])] * len(plan)
        rec.lanes = max((lane for lane, _ in sched), default=0) + 1
        streams = drv.streams(rec.lanes)
        waited = sorted({j for _, waits in sched for j in waits})
        # one event per waited launch, one per lane (none in one lane: the recorded order)
        events = drv.events(len(waited) + rec.lanes) if rec.lanes > 1 else []
        event_of = dict(zip(waited, events))
        mx.synchronize()
        drv.synchronize()
        drv.begin_capture()
        captured = False
        try:
            if rec.lanes > 1:  # the other lanes join the capture from its start
                drv.record(events[len(waited)], streams[0])
                for st in streams[1:]:
                    drv.wait(st, events[len(waited)])
            for i, (entry, (lane, waits)) in enumerate(zip(plan, sched)):
                for j in waits:
                    drv.wait(streams[lane], event_of[j])
                _enqueue(drv, entry, streams[lane])
                if i in event_of:
                    drv.record(event_of[i], streams[lane])
            for st, ev in zip(streams[1:], events[len(waited) + 1 :]):  # and join it again
                drv.record(ev, st)
                drv.wait(streams[0], ev)
            for copy in copies:
                drv.copy(*copy)
            captured = True
        finally:
            exe = drv.end_capture()  # ends the capture whatever happened in it
            if captured:
                rec.exe = exe
            else:  # a partial graph is never replayed
                drv.destroy(exe)
        # Resolving the addresses moved every device buffer the graph reads (the weights, on a
        # model made on the GPU) to managed memory; their device copies went back to the pool.
        # Hand that memory back now: kept, it may crowd the managed weights off the GPU
        # (docs/decode_step.md, "Memory": an 80 GB H100 decoding 31B at 0.5 tok/s).
        mx.synchronize()
        mx.clear_cache()
        if graph_prefetch():
            for p, nbytes in spans.items():
                if nbytes and drv.is_managed(p):
                    drv.prefetch(p, nbytes)
            drv.synchronize()

    def _bind(self) -> None:
        """Make the graph's cache arrays hold what the step's caches hold now."""
        moved = []
        for s, mine, handed in zip(self.step.caches, self._caches, self._handed):
            if any(a is not h for a, h in zip(s.arrays, handed)):
                moved.append((s, mine))
        if not moved:
            return
        mx.eval([s.arrays for s, _ in moved])
        mx.synchronize()
        for s, mine in moved:
            for a, m in zip(s.arrays, mine):
                dst, src = data_ptr(m), data_ptr(a)
                if dst == src:
                    continue
                if self.driver is not None:
                    self.driver.copy(dst, src, m.nbytes)
                else:
                    ctypes.memmove(dst, src, m.nbytes)
        if self.driver is not None:
            self.driver.synchronize()  # the sources may be freed once the step lets them go
        self._hand_over(self.step.caches)

    def decode(self, tokens: Sequence[int], active: Sequence[bool] | None = None) -> list[int]:
        """One greedy token for every row (``tokens``, one per row) -> the next token ids."""
        if self.driver is None:
            raise InvalidArgumentError("CudaGraphStep.decode needs a CUDA driver")
        st, B = self.step, self.step.max_batch
        active = [True] * B if active is None else [bool(a) for a in active]
        if len(tokens) != B or len(active) != B:
            raise InvalidArgumentError(f"decode needs {B} tokens and {B} active flags")
        vocab = getattr(getattr(st.model, "args", None), "vocab_size", None)
        if vocab is not None and any(not 0 <= int(t) < vocab for t in tokens):
            # the graph's embedding gather would read past its table
            raise InvalidArgumentError(f"token ids must be in [0, {vocab})")
        longest = max((p for p, a in zip(st.positions, active) if a), default=0) + 1
        if longest > st.max_len:
            raise ContextLengthError(f"a row would pass max_len {st.max_len}")
        rec = self.prepare(st._span(longest))
        self._bind()
        self._set_inputs(tokens, st.positions, active)
        if os.environ.get("HF2Q_GRAPH_DEBUG") == "1":
            self._launch_one_by_one(rec)
        else:
            self.driver.replay(rec.exe)
        ids = np.empty(B, np.uint32)
        self.driver.download(data_ptr(rec.out), ids)
        self.driver.synchronize()
        st.positions = [p + int(a) for p, a in zip(st.positions, active)]
        st._device_pos = None  # the compiled step uploads its positions again
        st._verified = [0] * B  # no rollback into graph-decoded tokens
        self.last = rec
        return ids.tolist()

    def _launch_one_by_one(self, rec: Recording) -> None:
        """The graph's work launched directly, each launch waited for (HF2Q_GRAPH_DEBUG=1): a
        fault names its launch, kernel and grid instead of failing the whole replay; the first
        launch that writes a NaN is said once on stderr (a NaN hidden state sends the MoE
        router's expert ids out of range). Infinities are legitimate: an attention part with no
        visible slot keeps a running max of -inf."""
        drv, said = self.driver, False
        for i, (entry, launch) in enumerate(zip(rec.plan, rec.launches)):
            name = launch.spec.kernel.name
            try:
                _enqueue(drv, entry)
                drv.synchronize()
            except Exception as err:
                shapes = [tuple(x.shape) for x in launch.inputs]
                raise GraphCaptureError(
                    f"launch {i} of {len(rec.plan)} ({name}, grid {launch.spec.blocks}, "
                    f"inputs {shapes}) failed: {err}"
                ) from err
            floats = [o for o in launch.outputs if mx.issubdtype(o.dtype, mx.floating)]
            if not said and floats and any(mx.isnan(o).any().item() for o in floats):
                print(f"hf2q-mlx graph debug: launch {i} ({name}) wrote a NaN", file=sys.stderr)
                said = True
        for copy in rec.copy_plan:
            drv.copy(*copy)

    def logprob(self, row: int, token: int) -> float:
        """log-softmax of ``token`` in ``row``'s logits of the last ``decode`` (nan when the
        recording has no logits to read)."""
        logits = getattr(self, "last", None) and self.last.logits
        if logits is None:
            return float("nan")
        x = logits[row].astype(mx.float32)
        return (x[token] - mx.logsumexp(x)).item()

    def close(self) -> None:
        if self.driver is not None:
            for rec in self.recordings.values():
                if rec.exe is not None:
                    self.driver.destroy(rec.exe)
                    rec.exe = None
