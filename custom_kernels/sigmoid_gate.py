"""Qwen 3.5's sigmoid output gates, one kernel each.

- ``head_gate``: gated attention's output times sigmoid of each head's gate half, read in place
  from the [query | gate] projection (B, L, H, 2 D), or from a fused q/k/v output (``Heads``):
  MLX copies the strided half first, then multiplies (two launches).
- ``shared_gate_add``: the MoE block's end, ``y + s * sigmoid(x . w)`` (routed experts y,
  shared expert s, the shared-expert gate's dot product with the block input x): MLX's GEMV,
  sigmoid-multiply and add (three launches).

Both round as MLX's ops do in the array dtype T: sigmoid rounded to T, the product rounded to
T (and the dot product, accumulated in fp32, rounded to T). A recorded CUDA graph step always
takes them (MLX's ops cannot be replayed); the compiled step once ``GPU_VERIFIED``: their GPU
tests (tests/kernels/test_sigmoid_gate.py, one in 4 cases) passed on the H200 in session 20,
and the Qwen3.5-35B-A3B graph, which takes them, gave the compiled step's 64 greedy tokens.
"""

from __future__ import annotations

import os
from functools import lru_cache

import mlx.core as mx

from hf2q_mlx.custom_kernels import backend, device_array, int_setting, row_threads
from hf2q_mlx.custom_kernels._render import Example, Kernel
from hf2q_mlx.custom_kernels.residual_rms_norm import residual_rms_norm_reference
from hf2q_mlx.custom_kernels.residual_rms_norm import threads_for as residual_threads
from hf2q_mlx.custom_kernels.rms_norm_rope import Heads, split_heads

_F = (mx.float32, mx.float16, mx.bfloat16)
GPU_VERIFIED = True  # the GPU tests passed on CUDA (session 20): the compiled step takes them


def head_gate_reference(x: mx.array, qg: mx.array | Heads) -> mx.array:
    """x (B, L, H D), qg (B, L, H, 2 D) (or ``Heads`` of a projection's output standing for
    it) -> x * sigmoid(qg[..., D:]) (B, L, H D)."""
    (qg,) = split_heads([qg])
    B, L, H, D2 = qg.shape
    return x * mx.sigmoid(qg[..., D2 // 2 :].reshape(B, L, H * (D2 // 2)))


_HEAD_BODY = """
  // One thread per output element e of (rows, H D); TG divides H D, so the grid is exactly the
  // elements and the token count stays out of the template (one compile for every length). Its
  // gate is channel d of its head's gate half in the [query | gate] heads, which start OFF
  // values into each RS-value row of qg.
  const uint e = gid_x * uint(TG) + tid;
  const uint d = e % D;
  const uint h = (e / D) % H;
  const uint row = e / (D * H);
  const float g = to_float(qg[uint64_t(row) * RS + OFF + uint64_t(h) * (2 * D) + D + d]);
  const T s = from_float<T>(1.0f / (1.0f + exp_f(-g)));
  out[e] = from_float<T>(to_float(x[e]) * to_float(s));
"""


_head_kernel = Kernel(
    "head_gate",
    inputs=["x", "qg"],
    outputs=["out"],
    body=_HEAD_BODY,
    examples=[
        Example({"x": t, "qg": t}, {"out": t},
                {"T": t, "TG": 128, "D": 32, "H": 4, "RS": rs, "OFF": off})
        for t, rs, off in ((mx.float32, 256, 0), (mx.bfloat16, 320, 0), (mx.float16, 384, 64))
    ],
)  # fmt: skip


def head_gate(x: mx.array, qg: mx.array | Heads) -> mx.array:
    """Dispatcher: one kernel for float arrays of matching shapes with H D a multiple of 32,
    reading ``Heads`` of a fused q/k/v output in place; the reference otherwise."""
    be = backend()
    if be is not None and x.dtype in _F and qg.dtype == x.dtype and x.size < 2**31:
        B, L, H, D2 = qg.shape
        data, rs, off = qg, H * D2, 0
        if isinstance(qg, Heads):
            data, rs, off = qg.data, qg.data.shape[-1], qg.first * qg.width
        tg = row_threads(H * (D2 // 2))
        if x.shape == (B, L, H * (D2 // 2)) and D2 % 2 == 0 and tg and x.size and data.size < 2**31:
            plan = _head_plan(be, x.size, tg, D2 // 2, H, rs, off, x.shape, x.dtype)
            return plan(inputs=[x, data])[0]
    return head_gate_reference(x, qg)


@lru_cache(maxsize=64)
def _head_plan(be, n, tg, D, H, rs, off, shape, dtype):
    return _head_kernel.launcher(
        [dtype, dtype], grid=(n,), threadgroup=(tg,), output_shapes=[shape],
        output_dtypes=[dtype], template={"T": dtype, "TG": tg, "D": D, "H": H, "RS": rs,
                                         "OFF": off},
        backend=be,
    )  # fmt: skip


def shared_gate_add_reference(y: mx.array, s: mx.array, x: mx.array, w: mx.array) -> mx.array:
    """y, s, x (..., D), w (1, D) -> y + s * sigmoid(x @ w.T) in y's dtype (as the MoE block)."""
    return y + s * mx.sigmoid(x @ w.T)


# The gate's dot product and sigmoid, both kernels' start: one threadgroup per row of D, fp32 SIMD
# sums then one shared slot per SIMD group.
_GATE_DOT = """
  SHARED float part[TG / 32];
  const uint64_t base = uint64_t(gid_x) * uint(D);
  float acc = 0.0f;
  for (uint i = tid; i < uint(D); i += TG) acc = fma_f(to_float(x[base + i]), to_float(w[i]), acc);
  acc = simd_sum(acc);
  if (lane == 0) part[simd_id] = acc;
  BARRIER();
  float dot = 0.0f;
  UNROLL for (int k = 0; k < TG / 32; ++k) dot += part[k];
  const float g = to_float(from_float<T>(dot));
  const float sg = to_float(from_float<T>(1.0f / (1.0f + exp_f(-g))));
"""

_SHARED_BODY = (
    """
  // One threadgroup per row of D: the gate's dot product (fp32, SIMD sums then one shared slot
  // per SIMD group), then thread t writes elements t, t + TG, ..."""
    + _GATE_DOT
    + """  for (uint i = tid; i < uint(D); i += TG) {
    const float prod = to_float(from_float<T>(to_float(s[base + i]) * sg));
    out[base + i] = from_float<T>(to_float(y[base + i]) + prod);
  }
"""
)

_SHARED_NORM_BODY = (
    """
  // One threadgroup per row of D: shared_gate_add's dot and output (its TG threads), which
  // goes on into residual_rms_norm(res, out, nw) -> (h, n) in that kernel's own layout and
  // order: virtual thread vt = t + TG q of its TGR owns elements vt + TGR j. EARLY: every
  // element a thread reads after a barrier is loaded before the first one (one round of memory
  // latency, not three; the same values)."""
    + """
  constexpr uint RQ = (TGR + TG - 1) / TG;
  constexpr uint NE = EARLY ? RQ * NPTR : 1;
  const uint64_t row = uint64_t(gid_x) * uint(D);  // _GATE_DOT's base, needed before it
  float se[NE], ye[NE], re[NE], we[NE];
  UNROLL for (uint q = 0; EARLY && q < RQ; ++q) {
    UNROLL for (uint j = 0; j < NPTR; ++j) {
      const uint vt = tid + TG * q;
      const uint i = vt + TGR * j;
      const bool ok = vt < TGR && i < uint(D);
      se[q * NPTR + j] = ok ? to_float(s[row + i]) : 0.0f;
      ye[q * NPTR + j] = ok ? to_float(y[row + i]) : 0.0f;
      re[q * NPTR + j] = ok ? to_float(res[row + i]) : 0.0f;
      we[q * NPTR + j] = ok ? to_float(nw[i]) : 0.0f;
    }
  }
"""
    + _GATE_DOT
    + """  SHARED float part2[32];
  float v[RQ][NPTR];
  UNROLL for (uint q = 0; q < RQ; ++q) {
    const uint vt = tid + TG * q;
    float ss = 0.0f;
    UNROLL for (uint j = 0; j < NPTR; ++j) {
      const uint i = vt + TGR * j;
      v[q][j] = 0.0f;
      if (vt < TGR && i < uint(D)) {
        const float sv = EARLY ? se[q * NPTR + j] : to_float(s[base + i]);
        const float yv = EARLY ? ye[q * NPTR + j] : to_float(y[base + i]);
        const float rv = EARLY ? re[q * NPTR + j] : to_float(res[base + i]);
        const float prod = to_float(from_float<T>(sv * sg));
        const T o = from_float<T>(yv + prod);
        const T hv = from_float<T>(rv + to_float(o));
        h[base + i] = hv;
        v[q][j] = to_float(hv);
        ss = fma_f(v[q][j], v[q][j], ss);
      }
    }
    if (vt - lane < TGR) {  // vt's virtual SIMD group exists: the whole SIMD group alike
      ss = simd_sum(ss);
      if (lane == 0) part2[vt / 32] = ss;
    }
  }
  BARRIER();
  float total = 0.0f;
  UNROLL for (uint k = 0; k < TGR / 32; ++k) total += part2[k];
  const float inv = rsqrt_f(total / float(D) + fparams[0]);
  UNROLL for (uint q = 0; q < RQ; ++q) {
    UNROLL for (uint j = 0; j < NPTR; ++j) {
      const uint vt = tid + TG * q;
      const uint i = vt + TGR * j;
      if (vt < TGR && i < uint(D)) {
        float o = v[q][j] * inv;
        o *= (EARLY ? we[q * NPTR + j] : to_float(nw[i])) + fparams[1];
        n[base + i] = from_float<T>(o);
      }
    }
  }
"""
)

_shared_kernel = Kernel(
    "shared_gate_add",
    inputs=["y", "s", "x", "w"],
    outputs=["out"],
    body=_SHARED_BODY,
    examples=[
        Example({"y": t, "s": t, "x": t, "w": wt}, {"out": t}, {"T": t, "D": 640, "TG": 256})
        for t, wt in (
            (mx.bfloat16, mx.bfloat16),
            (mx.float16, mx.float32),
            (mx.float32, mx.float32),
        )
    ],
)


def norm_template(dtype: mx.Dtype, D: int) -> dict:
    """``shared_gate_residual_norm``'s template: shared_gate_add's 256 threads a row, and
    residual_rms_norm's threads (threads_for(D)) and elements a thread for the norm."""
    tgr = residual_threads(D)
    return {"T": dtype, "D": D, "TG": 256, "TGR": tgr, "NPTR": -(-D // tgr), "EARLY": True}


_shared_norm_kernel = Kernel(
    "shared_gate_residual_norm",
    inputs=["y", "s", "x", "w", "res", "nw", "fparams"],
    outputs=["h", "n"],
    body=_SHARED_NORM_BODY,
    examples=[
        Example({"y": t, "s": t, "x": t, "w": t, "res": t, "nw": wt, "fparams": (mx.float32, 2)},
                {"h": t, "n": t}, norm_template(t, d))
        for t, wt, d in ((mx.bfloat16, mx.bfloat16, 2048), (mx.float32, mx.float32, 5000),
                         (mx.float16, mx.float32, 700))
    ],
)  # fmt: skip

# HF2Q_SHARED_GATE_NORM (read at import; unset or 1 on, 0 off): the MoE block's end also makes
# the residual add and the next norm (``shared_gate_residual_norm``). On since session 43: the
# same bits as the two kernels on an H100, Qwen3.5-35B-A3B's graph decode 1.03x.
GATE_NORM: str = os.environ.get("HF2Q_SHARED_GATE_NORM", "")


# HF2Q_GATE_NORM_EARLY (read at import; 1 on, 0 off, unset: on with the CUDA back end):
# shared_gate_residual_norm loads every element before its first barrier (template EARLY; the
# same bits): one round of memory latency, not three. Session 47 (H100, Qwen3.5-35B-A3B Q4_K
# graph decode, interleaved rounds): 313.1 against 303.3 tok/s, 1.03x in every round of two
# runs. Metal untimed. In the plan key.
EARLY: str = os.environ.get("HF2Q_GATE_NORM_EARLY", "")


def early_on() -> bool:
    """``HF2Q_GATE_NORM_EARLY`` as read at import (benches and tests may set ``EARLY``)."""
    value = int_setting("HF2Q_GATE_NORM_EARLY", EARLY, 0, 1)
    return backend() == "cuda" if value is None else bool(value)


def gate_norm_enabled() -> bool:
    """``HF2Q_SHARED_GATE_NORM`` as read at import (tests may set ``GATE_NORM``)."""
    return int_setting("HF2Q_SHARED_GATE_NORM", GATE_NORM, 0, 1) != 0


def _covered(y: mx.array, s: mx.array, x: mx.array, w: mx.array) -> bool:
    D = y.shape[-1]
    return (
        backend() is not None and y.dtype in _F and s.dtype == x.dtype == y.dtype == w.dtype
        and y.shape == s.shape == x.shape and w.shape == (1, D) and y.size < 2**31
    )  # fmt: skip


def shared_gate_add(y: mx.array, s: mx.array, x: mx.array, w: mx.array) -> mx.array:
    """Dispatcher: one kernel for float rows of equal shapes and a (1, D) weight of their dtype
    (a wider weight promotes MLX's result); else the reference."""
    if _covered(y, s, x, w):
        D = y.shape[-1]
        launch = _shared_plan(backend(), y.size // D, D, y.shape, y.dtype, w.dtype)
        return launch(inputs=[y, s, x, w])[0]
    return shared_gate_add_reference(y, s, x, w)


def shared_gate_residual_norm_reference(y, s, x, w, res, nw, eps: float, offset: float = 0.0):
    """-> ``residual_rms_norm_reference(res, shared_gate_add_reference(y, s, x, w), nw, eps,
    offset)``: (h, n)."""
    return residual_rms_norm_reference(res, shared_gate_add_reference(y, s, x, w), nw, eps, offset)


def shared_gate_residual_norm(
    y: mx.array,
    s: mx.array,
    x: mx.array,
    w: mx.array,
    res: mx.array,
    nw: mx.array,
    eps: float,
    offset: float = 0.0,
) -> tuple[mx.array, mx.array]:
    """The MoE block's end and the residual add + norm after it in one kernel: (h, n) with the
    two kernels' bits (shared_gate_add's, then residual_rms_norm's layout and order); else the
    reference."""
    D = y.shape[-1]
    if (
        _covered(y, s, x, w) and res.shape == y.shape and res.dtype == y.dtype
        and nw.shape == (D,) and nw.dtype in _F and D <= 16384
    ):  # fmt: skip
        launch = _norm_plan(backend(), y.size // D, D, y.shape, y.dtype, nw.dtype, early_on())
        return tuple(launch(inputs=[y, s, x, w, res, nw, _norm_params(eps, offset)]))
    return shared_gate_residual_norm_reference(y, s, x, w, res, nw, eps, offset)


@lru_cache(maxsize=64)
def _shared_plan(be, rows, D, shape, dtype, wdtype):
    return _shared_kernel.launcher(
        [dtype, dtype, dtype, wdtype], grid=(rows * 256,), threadgroup=(256,),
        output_shapes=[shape], output_dtypes=[dtype], template={"T": dtype, "D": D, "TG": 256},
        backend=be,
    )  # fmt: skip


@lru_cache(maxsize=64)
def _norm_plan(be, rows, D, shape, dtype, nwdtype, early):
    return _shared_norm_kernel.launcher(
        [dtype] * 5 + [nwdtype, mx.float32], grid=(rows * 256,), threadgroup=(256,),
        output_shapes=[shape, shape], output_dtypes=[dtype, dtype],
        template={**norm_template(dtype, D), "EARLY": early}, backend=be,
    )  # fmt: skip


@lru_cache(maxsize=16)
def _norm_params(eps: float, offset: float) -> mx.array:
    """(eps, weight offset) as a kernel input, made once (no op in a compiled step)."""
    return device_array([eps, offset], mx.float32)
