"""Gated delta-net core (Qwen 3.5 linear attention): causal conv + delta-rule recurrence.

Layouts: ``qkv`` (B, T, C) the in_proj_qkv output with C = 2 Hk Dk + Hv Dv ([q | k | v] channels),
``conv_state`` (B, K-1, C) the previous K-1 rows of qkv, ``conv_weight`` (C, K) depthwise taps,
a, b (B, T, Hv) raw projections, A_log, dt_bias (Hv,), ``state`` (B, Hv, Dv, Dk) fp32 (the layout
of ``mx.fast.gated_delta_update``). Value head h reads key head ``h // (Hv // Hk)`` (Hugging
Face's grouped order) or ``h % Hk`` with ``tiled=True`` (llama.cpp's GGUF order).

Per token: x = silu(causal depthwise conv(qkv)) split into q, k, v; q, k are l2-normalized
(eps 1e-6 on the sum of squares), q scaled by Dk**-0.5; beta = sigmoid(b),
decay = exp(-exp(A_log) * softplus(a + dt_bias)); S = decay * S; S += outer(beta (v - S k), k);
y = S q.
"""

from __future__ import annotations

import os

import mlx.core as mx
import mlx.nn as nn

from hf2q_mlx.custom_kernels import avoid_mlx_jit, backend, device_array, on_cuda_device
from hf2q_mlx.custom_kernels._render import Example, Kernel, is_collecting, note_warm_up
from hf2q_mlx.custom_kernels.gated_delta_scan import gated_delta_scan
from hf2q_mlx.errors import InvalidArgumentError

L2_EPS = 1e-6
SIMD_WIDTH = 32
CHUNK_SIZE = 64  # tokens per step of the chunked prefill


def silu(x: mx.array) -> mx.array:
    """``nn.silu``; with ``avoid_mlx_jit()`` its two ops unfused (MLX's CUDA back end compiles
    the ``mx.compile`` fusion with NVRTC at its first use on a machine)."""
    return x * mx.sigmoid(x) if avoid_mlx_jit() else nn.silu(x)


def softplus(x: mx.array) -> mx.array:
    """``nn.softplus`` (``logaddexp(x, 0)``), unfused with ``avoid_mlx_jit()`` as ``silu``."""
    return mx.logaddexp(x, 0) if avoid_mlx_jit() else nn.softplus(x)


def causal_conv_reference(
    qkv: mx.array, conv_state: mx.array, weight: mx.array
) -> tuple[mx.array, mx.array]:
    """silu(depthwise causal conv) (B, T, C) in qkv.dtype, and the new conv state (B, K-1, C)."""
    K = weight.shape[-1]
    x = mx.concatenate([conv_state.astype(qkv.dtype), qkv], axis=1)  # (B, K-1+T, C)
    out = mx.conv1d(x, weight.astype(qkv.dtype)[..., None], groups=qkv.shape[-1])
    return silu(out), x[:, x.shape[1] - (K - 1) :]


_CONV_BODY = """
  // One thread per (channel c, row t, batch b) = (pos_x, pos_y, pos_z): the KC-tap causal conv
  // of channel c over [conv_state (KC-1 rows); qkv (L rows)] summed in fp32, SiLU, one rounding.
  // Threads of rows t < KC-1 also copy sequence row L + t into the new conv state.
  const uint c = pos_x;
  const uint t = pos_y;
  const uint64_t bi = pos_z;
  const uint L = uint(n_rows[0]);
  if (c >= uint(C)) return;
  if (t < L) {
    float acc = 0.0f;
    UNROLL for (int j = 0; j < KC; ++j) {
      const uint p = t + uint(j);  // sequence row: the conv state's KC-1 rows come first
      const float x = p < uint(KC - 1) ? to_float(conv_state[(bi * (KC - 1) + p) * C + c])
                                       : to_float(qkv[(bi * L + p - (KC - 1)) * C + c]);
      acc += to_float(conv_w[c * KC + j]) * x;
    }
    y[(bi * L + t) * C + c] = from_float<T>(acc / (1.0f + exp_f(-acc)));
  }
  if (t < uint(KC - 1)) {
    const uint p = L + t;
    conv_out[(bi * (KC - 1) + t) * C + c] = p < uint(KC - 1)
        ? conv_state[(bi * (KC - 1) + p) * C + c] : qkv[(bi * L + p - (KC - 1)) * C + c];
  }
"""

_conv_kernel = Kernel(
    "causal_conv_silu",
    inputs=["qkv", "conv_state", "conv_w", "n_rows"],
    outputs=["y", "conv_out"],
    body=_CONV_BODY,
    examples=[
        Example({"qkv": t, "conv_state": t, "conv_w": t, "n_rows": (mx.int32, 1)},
                {"y": t, "conv_out": t}, {"T": t, "C": 8192, "KC": 4})
        for t in (mx.bfloat16, mx.float32)
    ],
)  # fmt: skip
_CONV_GROUP = 256  # threads per threadgroup, along the channels
_GRID_ROWS_MAX = 65535  # CUDA's grid y: longer chunks take the reference


def causal_conv(
    qkv: mx.array, conv_state: mx.array, weight: mx.array, init_value: float | None = None
) -> tuple[mx.array, mx.array]:
    """``causal_conv_reference``'s contract: (silu(conv) (B, T, C), new conv state (B, K-1, C)),
    both in qkv.dtype. With a GPU kernel back end one launch (the conv summed in fp32 and
    rounded once, where the reference rounds the conv and then its SiLU: within one rounding of
    it); MLX's conv1d on CUDA is a cuDNN convolution whose first use in a process loads cuDNN
    and compiles a kernel (0.71 s of a fresh H100's first Qwen 3.5 prefill, session 41).
    ``init_value`` fills the outputs before the launch (tests poison them with NaN)."""
    B, T, C = qkv.shape
    K = weight.shape[-1]
    if (
        backend() is None
        or qkv.dtype not in (mx.float32, mx.float16, mx.bfloat16)
        or not 0 < T <= _GRID_ROWS_MAX
        or B > _GRID_ROWS_MAX
    ):
        return causal_conv_reference(qkv, conv_state, weight)
    conv_state, weight = (x if x.dtype == qkv.dtype else x.astype(qkv.dtype)
                          for x in (conv_state, weight.reshape(C, K)))  # fmt: skip
    y, conv = _conv_kernel(
        [qkv, conv_state, weight, _steps(T)],
        grid=(C, max(T, K - 1), B),
        threadgroup=(min(_CONV_GROUP, C), 1, 1),
        output_shapes=[(B, T, C), (B, K - 1, C)],
        output_dtypes=[qkv.dtype, qkv.dtype],
        template={"T": qkv.dtype, "C": C, "KC": K},
        init_value=init_value,
    )
    return y, conv


def split_qkv(x: mx.array, num_k_heads: int, head_k_dim: int, num_v_heads: int):
    """(B, T, C) -> q, k (B, T, Hk, Dk), v (B, T, Hv, Dv)."""
    B, T, C = x.shape
    kd = num_k_heads * head_k_dim
    q, k, v = mx.split(x, [kd, 2 * kd], axis=-1)
    return (
        q.reshape(B, T, num_k_heads, head_k_dim),
        k.reshape(B, T, num_k_heads, head_k_dim),
        v.reshape(B, T, num_v_heads, (C - 2 * kd) // num_v_heads),
    )


def l2norm_qk(q: mx.array, k: mx.array) -> tuple[mx.array, mx.array]:
    """fp32 l2-normalized q (times Dk**-0.5) and k, as x * rsqrt(sum(x^2) + 1e-6)."""
    dk = q.shape[-1]
    # rms_norm divides by mean(x^2) + eps', so eps' = eps / Dk gives sqrt(Dk) * l2norm(x)
    q = mx.fast.rms_norm(q.astype(mx.float32), None, L2_EPS / dk) * (1.0 / dk)
    k = mx.fast.rms_norm(k.astype(mx.float32), None, L2_EPS / dk) * (dk**-0.5)
    return q, k


def gates(
    a: mx.array, b: mx.array, A_log: mx.array, dt_bias: mx.array
) -> tuple[mx.array, mx.array]:
    """(log decay, beta), both fp32 (B, T, Hv): log decay = -exp(A_log) * softplus(a + dt_bias)."""
    a = a.astype(mx.float32) + dt_bias.astype(mx.float32)
    log_decay = -mx.exp(A_log.astype(mx.float32)) * softplus(a)
    return log_decay, mx.sigmoid(b.astype(mx.float32))


def _expand_heads(x: mx.array, hv: int, tiled: bool) -> mx.array:
    """(B, T, Hk, D) -> (B, T, Hv, D) in grouped (repeat) or tiled order."""
    r = hv // x.shape[2]
    if r == 1:
        return x
    return mx.tile(x, (1, 1, r, 1)) if tiled else mx.repeat(x, r, axis=2)


def gated_delta_reference(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    a: mx.array,
    b: mx.array,
    A_log: mx.array,
    dt_bias: mx.array,
    state: mx.array,
    tiled: bool = False,
) -> tuple[mx.array, mx.array]:
    """Sequential fp32 recurrence in MLX ops (the oracle) -> (y (B, T, Hv, Dv), new state)."""
    hv = v.shape[2]
    qn, kn = l2norm_qk(q, k)
    qn, kn = _expand_heads(qn, hv, tiled), _expand_heads(kn, hv, tiled)
    log_decay, beta = gates(a, b, A_log, dt_bias)
    decay = mx.exp(log_decay)
    vf = v.astype(mx.float32)
    s = state.astype(mx.float32)
    ys = []
    for t in range(v.shape[1]):
        s = s * decay[:, t, :, None, None]
        kt = kn[:, t, :, None, :]  # (B, Hv, 1, Dk)
        delta = (vf[:, t] - (s * kt).sum(-1)) * beta[:, t, :, None]  # (B, Hv, Dv)
        s = s + delta[..., None] * kt
        ys.append((s * qn[:, t, :, None, :]).sum(-1))
    return mx.stack(ys, axis=1).astype(v.dtype), s


def _unit_lower_inverse(a: mx.array) -> mx.array:
    """(I + a)^-1 for strictly lower-triangular a (..., C, C), C a power of two, by doubling.

    (I + a)^-1 = sum_n (-a)^n = prod_i (I + (-a)^(2^i)): log2(C) steps of two matmuls each, which
    run on every device (``mx.linalg.solve_triangular`` is CPU-only).
    """
    C = a.shape[-1]
    # the identity as a comparison: mx.eye is a scatter, which MLX's CUDA back end JIT-compiles
    # at first use (4.6-5.2 s of a fresh H100's first Qwen 3.5 prefill, session 39)
    eye = (mx.arange(C)[:, None] == mx.arange(C)[None, :]).astype(a.dtype)
    n = -a
    inv = eye + n
    steps = a.shape[-1].bit_length() - 1
    for _ in range(steps - 1):
        n = n @ n
        inv = inv + inv @ n
    return inv


def gated_delta_chunked(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    a: mx.array,
    b: mx.array,
    A_log: mx.array,
    dt_bias: mx.array,
    state: mx.array,
    tiled: bool = False,
    chunk_size: int | None = None,
) -> tuple[mx.array, mx.array]:
    """The same recurrence, ``chunk_size`` tokens per step through the WY (UT-transform) form.

    Inside a chunk with cumulative log decay G_i: A[i, j] = beta_i (k_i . k_j) exp(G_i - G_j)
    (j < i); with T = (I + A)^-1, U = T (beta v) and W = T (beta exp(G) k), the corrected values
    are u = U - W S^T; outputs y = exp(G) q S^T + (q k^T * exp(G_i - G_j), j <= i) u, and the
    state moves to exp(G_C) S + u^T (exp(G_C - G) k).
    """
    C = chunk_size or CHUNK_SIZE
    if C & (C - 1):
        raise ValueError(f"chunk_size must be a power of two, got {C}")
    B, T, _, dk = q.shape
    hv, dv = v.shape[2:]
    qn, kn = l2norm_qk(q, k)
    qn, kn = _expand_heads(qn, hv, tiled), _expand_heads(kn, hv, tiled)
    log_decay, beta = gates(a, b, A_log, dt_bias)
    vf = v.astype(mx.float32)
    pad = (-T) % C
    if pad:
        # padded steps: zero key and beta, no decay, so they leave the state untouched
        qn, kn, vf = (mx.pad(x, [(0, 0), (0, pad), (0, 0), (0, 0)]) for x in (qn, kn, vf))
        log_decay, beta = (mx.pad(x, [(0, 0), (0, pad), (0, 0)]) for x in (log_decay, beta))
    n = (T + pad) // C

    def chunks(x):  # (B, n*C, Hv, D) -> (B, Hv, n, C, D)
        return x.reshape(B, n, C, hv, -1).transpose(0, 3, 1, 2, 4)

    qc, kc, vc = chunks(qn), chunks(kn), chunks(vf)
    bc = chunks(beta[..., None])  # (B, Hv, n, C, 1)
    g = mx.cumsum(chunks(log_decay[..., None])[..., 0], axis=-1)  # (B, Hv, n, C)
    causal = mx.tril(mx.ones((C, C), dtype=mx.bool_))
    pair = mx.exp(mx.where(causal, g[..., :, None] - g[..., None, :], -mx.inf))  # (.., C, C)
    strict = mx.tril(mx.ones((C, C), dtype=mx.bool_), k=-1)
    kk = kc @ kc.swapaxes(-1, -2)
    t_inv = _unit_lower_inverse(mx.where(strict, bc * kk * pair, 0.0))
    u_all = t_inv @ (bc * vc)  # (B, Hv, n, C, Dv)
    w_all = t_inv @ (bc * mx.exp(g)[..., None] * kc)  # (B, Hv, n, C, Dk)
    attn = (qc @ kc.swapaxes(-1, -2)) * pair
    q_dec = qc * mx.exp(g)[..., None]
    k_dec = kc * mx.exp(g[..., -1:] - g)[..., None]
    chunk_decay = mx.exp(g[..., -1])  # (B, Hv, n)
    # the walk over the chunks: MLX ops, or one launch (gated_delta_scan, HF2Q_GDN_SCAN)
    s = state.astype(mx.float32)  # (B, Hv, Dv, Dk)
    ys, s = gated_delta_scan(u_all, w_all, q_dec, attn, k_dec, chunk_decay, s)
    y = ys.reshape(B, hv, n * C, dv)[:, :, :T]
    return y.transpose(0, 2, 1, 3).astype(v.dtype), s


def gated_delta_fast(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    a: mx.array,
    b: mx.array,
    A_log: mx.array,
    dt_bias: mx.array,
    state: mx.array,
    tiled: bool = False,
) -> tuple[mx.array, mx.array]:
    """Through ``mx.fast.gated_delta_update`` (grouped heads only, so tiled q/k are expanded)."""
    hv = v.shape[2]
    qn, kn = l2norm_qk(q, k)
    if tiled:
        qn, kn = _expand_heads(qn, hv, True), _expand_heads(kn, hv, True)
    log_decay, beta = gates(a, b, A_log, dt_bias)
    y, s = mx.fast.gated_delta_update(
        qn, kn, v.astype(mx.float32), mx.exp(log_decay), beta, state.astype(mx.float32)
    )
    return y.astype(v.dtype), s


_STEP_BODY = """
  // One SIMD group per (batch, value head h, value row dv): lane owns state[dv][lane*NK, +NK)
  // (Dk = 32 * NK), so a state row is one coalesced sweep and every reduction over Dk is one
  // simd_sum. The conv runs in-kernel on the channels a lane needs (q and k of key head hk:
  // NK each; v channel dv), so the projection output is read once per row with no copies.
  constexpr int NK = Dk / SIMD_SIZE;
  constexpr int KD = Hk * Dk;
  constexpr int C = 2 * KD + Hv * Dv;
  const uint dv = pos_y;
  if (dv >= uint(Dv)) return;  // the whole SIMD group leaves together (x spans its lanes)
  const uint n = pos_z;        // b * Hv + h
  const uint bi = n / Hv;
  const uint h = n % Hv;
  const uint hk = TILED ? h % Hk : h / (Hv / Hk);
  const int T = n_steps[0];

  float s[NK];
  const uint row = (n * Dv + dv) * Dk + lane * NK;
  UNROLL for (int i = 0; i < NK; ++i) s[i] = state_in[row + i];
  const float a_coef = exp_f(to_float(A_log[h]));
  const float dtb = to_float(dt_bias[h]);
  const uint cq = hk * Dk + lane * NK;  // first q channel of this lane; k is KD further
  const uint cv = 2 * KD + h * Dv + dv;

  for (int t = 0; t < T; ++t) {
    // conv window: rows t-K+1 .. t of [conv_state; qkv] for this batch
    float qv[NK], kv[NK];
    float vv = 0.0f;
    UNROLL for (int i = 0; i < NK; ++i) { qv[i] = 0.0f; kv[i] = 0.0f; }
    for (int j = 0; j < KC; ++j) {
      const int r = t - (KC - 1) + j;
      float xq[NK], xk[NK], xv;
      if (r >= 0) {
        const uint o = (bi * uint(T) + uint(r)) * C;
        UNROLL for (int i = 0; i < NK; ++i) {
          xq[i] = to_float(qkv[o + cq + i]);
          xk[i] = to_float(qkv[o + KD + cq + i]);
        }
        xv = to_float(qkv[o + cv]);
      } else {
        const uint o = (bi * (KC - 1) + uint(r + KC - 1)) * C;
        UNROLL for (int i = 0; i < NK; ++i) {
          xq[i] = to_float(conv_state[o + cq + i]);
          xk[i] = to_float(conv_state[o + KD + cq + i]);
        }
        xv = to_float(conv_state[o + cv]);
      }
      UNROLL for (int i = 0; i < NK; ++i) {
        qv[i] += to_float(conv_w[(cq + i) * KC + j]) * xq[i];
        kv[i] += to_float(conv_w[(KD + cq + i) * KC + j]) * xk[i];
      }
      vv += to_float(conv_w[cv * KC + j]) * xv;
    }
    float qq = 0.0f, kk = 0.0f;
    UNROLL for (int i = 0; i < NK; ++i) {
      qv[i] = qv[i] / (1.0f + exp_f(-qv[i]));  // silu
      kv[i] = kv[i] / (1.0f + exp_f(-kv[i]));
      qq += qv[i] * qv[i];
      kk += kv[i] * kv[i];
    }
    vv = vv / (1.0f + exp_f(-vv));
    // l2norm with eps 1e-6 on the sum of squares; q also carries the Dk^-1/2 readout scale
    const float qs = rsqrt_f(simd_sum(qq) + 1e-6f) * rsqrt_f(float(Dk));
    const float ks = rsqrt_f(simd_sum(kk) + 1e-6f);

    const uint g_off = (bi * uint(T) + uint(t)) * Hv + h;
    const float x = to_float(a[g_off]) + dtb;
    const float softplus = x > 20.0f ? x : log_f(1.0f + exp_f(x));
    const float decay = exp_f(-a_coef * softplus);
    const float beta = 1.0f / (1.0f + exp_f(-to_float(b[g_off])));

    float mem = 0.0f;
    UNROLL for (int i = 0; i < NK; ++i) {
      kv[i] *= ks;
      s[i] *= decay;
      mem += s[i] * kv[i];
    }
    const float delta = (vv - simd_sum(mem)) * beta;
    float out = 0.0f;
    UNROLL for (int i = 0; i < NK; ++i) {
      s[i] += kv[i] * delta;
      out += s[i] * qv[i];
    }
    out = simd_sum(out) * qs;
    if (lane == 0) y[g_off * Dv + dv] = from_float<OutT>(out);
  }
  UNROLL for (int i = 0; i < NK; ++i) state_out[row + i] = s[i];

  // new conv state = last K-1 rows of [conv_state; qkv]: the first value head of each key
  // head writes the q and k channels (row dv 0), every row writes its own v channel
  const bool qk_writer = dv == 0 && (TILED ? h < uint(Hk) : h % (Hv / Hk) == 0);
  for (int j = 0; j < KC - 1; ++j) {
    const int r = T + j - (KC - 1);  // source row in qkv, negative = still in conv_state
    const uint dst = (bi * (KC - 1) + uint(j)) * C;
    if (qk_writer) {
      UNROLL for (int i = 0; i < NK; ++i) {
        const uint c0 = cq + i, c1 = KD + cq + i;
        conv_out[dst + c0] = r >= 0 ? qkv[(bi * uint(T) + uint(r)) * C + c0]
                                    : conv_state[(bi * (KC - 1) + uint(r + KC - 1)) * C + c0];
        conv_out[dst + c1] = r >= 0 ? qkv[(bi * uint(T) + uint(r)) * C + c1]
                                    : conv_state[(bi * (KC - 1) + uint(r + KC - 1)) * C + c1];
      }
    }
    if (lane == 0) {
      conv_out[dst + cv] = r >= 0 ? qkv[(bi * uint(T) + uint(r)) * C + cv]
                                  : conv_state[(bi * (KC - 1) + uint(r + KC - 1)) * C + cv];
    }
  }
"""

_STEP_INPUTS = [
    "qkv", "conv_state", "conv_w", "a", "b", "A_log", "dt_bias", "state_in", "n_steps"
]  # fmt: skip
_STEP_OUTPUTS = ["y", "state_out", "conv_out"]


def _example(dtype: mx.Dtype, tiled: bool) -> Example:
    return Example(
        inputs={
            "qkv": dtype, "conv_state": dtype, "conv_w": dtype, "a": dtype, "b": dtype,
            "A_log": mx.float32, "dt_bias": mx.float32, "state_in": mx.float32,
            "n_steps": (mx.int32, 1),
        },
        outputs={"y": dtype, "state_out": mx.float32, "conv_out": dtype},
        template={
            "Dk": 128, "Dv": 128, "Hk": 16, "Hv": 32, "KC": 4, "TILED": tiled, "OutT": dtype
        },
    )  # fmt: skip


_step_kernel = Kernel(
    "gated_delta_step",
    inputs=_STEP_INPUTS,
    outputs=_STEP_OUTPUTS,
    body=_STEP_BODY,
    examples=[_example(mx.bfloat16, False), _example(mx.float32, True)],
)

ROWS_PER_GROUP = 4  # SIMD groups (value rows) per threadgroup
_STEPS: dict[int, mx.array] = {}


def _steps(T: int) -> mx.array:
    """The run-time step count as a 1-element array, made once per T (no per-call upload)."""
    if T not in _STEPS:
        _STEPS[T] = device_array([T], mx.int32)
    return _STEPS[T]


def gated_delta_step(
    qkv: mx.array,
    conv_state: mx.array,
    conv_weight: mx.array,
    a: mx.array,
    b: mx.array,
    A_log: mx.array,
    dt_bias: mx.array,
    state: mx.array,
    num_k_heads: int,
    head_k_dim: int,
    tiled: bool = False,
    init_value: float | None = None,
) -> tuple[mx.array, mx.array, mx.array]:
    """The fused kernel over all T tokens in order (contract of ``gated_delta_update``); GPU.

    ``init_value`` fills the outputs before the launch (tests poison them with NaN)."""
    B, T, C = qkv.shape
    hv = a.shape[-1]
    dv = (C - 2 * num_k_heads * head_k_dim) // hv
    K = conv_weight.shape[-1]
    dtype = qkv.dtype
    conv_state, conv_weight, a, b = (
        x if x.dtype == dtype else x.astype(dtype) for x in (conv_state, conv_weight, a, b)
    )
    if state.dtype != mx.float32:
        state = state.astype(mx.float32)
    inputs = [qkv, conv_state, conv_weight, a, b, A_log, dt_bias, state, _steps(T)]
    y, s, conv = _step_kernel(
        inputs,
        grid=(SIMD_WIDTH, dv, B * hv),
        threadgroup=(SIMD_WIDTH, ROWS_PER_GROUP, 1),
        output_shapes=[(B, T, hv, dv), state.shape, (B, K - 1, C)],
        output_dtypes=[dtype, mx.float32, dtype],
        template={
            "Dk": head_k_dim, "Dv": dv, "Hk": num_k_heads, "Hv": hv, "KC": K,
            "TILED": tiled, "OutT": dtype,
        },
        init_value=init_value,
    )  # fmt: skip
    return y, conv, s


def gated_delta_update_reference(
    qkv: mx.array,
    conv_state: mx.array,
    conv_weight: mx.array,
    a: mx.array,
    b: mx.array,
    A_log: mx.array,
    dt_bias: mx.array,
    state: mx.array,
    num_k_heads: int,
    head_k_dim: int,
    tiled: bool = False,
    recurrence=gated_delta_reference,
) -> tuple[mx.array, mx.array, mx.array]:
    """Conv (``causal_conv``: one kernel with a GPU back end) then ``recurrence`` in MLX ops ->
    (y (B, T, Hv, Dv), conv state, state)."""
    x, new_conv = causal_conv(qkv, conv_state, conv_weight)
    q, k, v = split_qkv(x, num_k_heads, head_k_dim, a.shape[-1])
    args = (q, k, v, a, b, A_log, dt_bias, state)
    if is_collecting():  # a dry pass (compile_ahead): the recurrence's first MLX matmuls
        sig = tuple((t.shape, t.dtype) for t in args)  # shapes only, never the dry arrays
        warm = lambda: recurrence(*(mx.full(sh, 0.01, dt) for sh, dt in sig), tiled)  # noqa: E731
        note_warm_up(("gated_delta", recurrence.__name__, sig, tiled), warm)
    y, s = recurrence(*args, tiled)
    return y, new_conv, s


_RECURRENCES = {
    "fast": gated_delta_fast,
    "chunked": gated_delta_chunked,
    "reference": gated_delta_reference,
}
PREFILL_ENV_VAR = "HF2Q_GDN_PREFILL"  # docs/kernels.md ("Environment switches")
PREFILL_MODES = ("auto", "step", *_RECURRENCES)


def auto_prefill_mode() -> str:
    """``HF2Q_GDN_PREFILL=auto``: the chunked form on CUDA (on the H200 10-30x MLX's fast op,
    which runs the recurrence token by token: Qwen3.5-9B 4,178 against 296 tok/s at 512 tokens,
    8,848 against 229 at 2,048; docs/kernel_notes.md, session 25), elsewhere MLX's fast op where
    this MLX has it (not measured against chunked on Metal or the CPU), else chunked."""
    if on_cuda_device() or not hasattr(mx.fast, "gated_delta_update"):
        return "chunked"
    return "fast"


def _prefill_mode() -> str:
    """The prefill form ``HF2Q_GDN_PREFILL`` asks for (``auto_prefill_mode`` when unset)."""
    mode = os.environ.get(PREFILL_ENV_VAR, "auto").strip().lower() or "auto"
    if mode not in PREFILL_MODES:
        raise InvalidArgumentError(
            f"{PREFILL_ENV_VAR}={mode!r}: expected one of {', '.join(PREFILL_MODES)}"
        )
    return auto_prefill_mode() if mode == "auto" else mode


def gated_delta_update(
    qkv: mx.array,
    conv_state: mx.array | None,
    conv_weight: mx.array,
    a: mx.array,
    b: mx.array,
    A_log: mx.array,
    dt_bias: mx.array,
    state: mx.array | None,
    num_k_heads: int,
    head_k_dim: int,
    tiled: bool = False,
) -> tuple[mx.array, mx.array, mx.array]:
    """Dispatcher -> (y (B, T, Hv, Dv) in qkv.dtype, new conv state, new state fp32).

    Decode (T == 1): the fused kernel where one applies, else the reference. Prefill: the conv
    (``causal_conv``), then the chunked form on CUDA, elsewhere ``mx.fast.gated_delta_update``
    when MLX has it, else the chunked form (``auto_prefill_mode``);
    ``HF2Q_GDN_PREFILL=fast|chunked|reference|step`` forces one (step = the fused decode kernel
    token by token; docs/kernels.md).
    """
    B, T, C = qkv.shape
    hv = a.shape[-1]
    dv, rem = divmod(C - 2 * num_k_heads * head_k_dim, hv)
    if rem or dv <= 0 or hv % num_k_heads:
        raise ValueError(
            f"qkv width {C} does not split into 2 x {num_k_heads} key heads of {head_k_dim} and "
            f"{hv} value heads (a multiple of the key heads)"
        )
    K = conv_weight.shape[-1]
    if conv_state is None:
        conv_state = mx.zeros((B, K - 1, C), dtype=qkv.dtype)
    if state is None:
        state = mx.zeros((B, hv, dv, head_k_dim), dtype=mx.float32)
    args = (qkv, conv_state, conv_weight, a, b, A_log, dt_bias, state, num_k_heads, head_k_dim)
    kernel_ok = (
        backend() is not None
        and head_k_dim % SIMD_WIDTH == 0
        and qkv.dtype in (mx.float32, mx.float16, mx.bfloat16)
    )
    mode = "step" if T == 1 else _prefill_mode()
    if mode == "step":
        if kernel_ok:
            return gated_delta_step(*args, tiled)
        mode = "reference"
    return gated_delta_update_reference(*args, tiled, recurrence=_RECURRENCES[mode])
