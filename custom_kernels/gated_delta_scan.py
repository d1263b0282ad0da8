"""The chunked delta-net prefill's recurrence across chunks in one launch (fp32).

``gated_delta.gated_delta_chunked`` computes each chunk's WY factors for all chunks at once,
then walks the chunks in order: u = U - W S^T, y = q_dec S^T + attn u, S = decay S + u^T k_dec.
As MLX ops that walk is four small fp32 GEMMs a chunk (32 launches a layer at 512 tokens,
chunks of 64; most of the ~1,350 fp32 GEMM launches of a Qwen3.5-35B-A3B 512-token prefill,
~20 ms of its 114 on an H100, session 47). A value row j of the state only ever meets row j:
u[:, j] = U[:, j] - W S[j]^T, y[:, j] = q_dec S[j]^T + attn u[:, j], S[j] = decay S[j] +
u[:, j]^T k_dec. So one threadgroup takes DB value rows of one (row, head) through every chunk
with its slice of S in shared memory: the whole walk is one launch of B Hv Dv / DB threadgroups.

The reference is ``scan_reference`` (the MLX loop it replaces); fp32 sums in another order, so
the two agree to ~1e-6 relative, not bit for bit.
"""

from __future__ import annotations

import os
from functools import lru_cache

import mlx.core as mx

from hf2q_mlx.custom_kernels import backend, device_array, int_setting
from hf2q_mlx.custom_kernels._render import Example, Kernel

DB = 16  # value rows a threadgroup
THREADS = 256
SHARED_BYTES = 48 * 1024  # the static shared memory one threadgroup may declare
# HF2Q_GDN_SCAN: "1" takes this kernel for the chunked prefill's walk on a GPU, "0" keeps the
# MLX loop; unset: the kernel on CUDA (session 49, H100: its GPU tests pass; Qwen3.5-35B-A3B's
# 512-token prefill 1.41x, 9B's 2048-token 1.35x, one process, interleaved), the loop on Metal
# (never run on an Apple GPU). Read at each call.
SCAN_ENV = "HF2Q_GDN_SCAN"


def scan_on(be: str | None) -> bool:
    """Whether the walk takes the kernel on back end ``be`` (HF2Q_GDN_SCAN, read at each call;
    unset: on CUDA only)."""
    v = int_setting(SCAN_ENV, os.environ.get(SCAN_ENV, ""), 0, 1)
    return be == "cuda" if v is None else bool(v)


def scan_reference(u_all, w_all, q_dec, attn, k_dec, decay, state):
    """The walk as MLX ops: u_all (B, H, n, C, Dv), w_all / q_dec / k_dec (B, H, n, C, Dk),
    attn (B, H, n, C, C), decay (B, H, n), state (B, H, Dv, Dk) fp32 -> (y (B, H, n, C, Dv),
    the state after the last chunk)."""
    s, ys = state, []
    for i in range(u_all.shape[2]):
        u = u_all[:, :, i] - w_all[:, :, i] @ s.swapaxes(-1, -2)  # (B, H, C, Dv)
        ys.append(q_dec[:, :, i] @ s.swapaxes(-1, -2) + attn[:, :, i] @ u)
        s = s * decay[:, :, i, None, None] + u.swapaxes(-1, -2) @ k_dec[:, :, i]
    return mx.stack(ys, axis=2), s


_BODY = """
  // Thread mapping: threadgroup gid_x = (row-head bh, block jb of DB value rows); its S rows
  // live in shared memory through all NCH chunks. Per chunk, one C x Dk operand at a time is
  // staged in `tile` (W, then q_dec, then k_dec): thread tid computes u and y at chunk row
  // c = tid / 4 for value rows j = tid % 4 + 4 m (m < DB / 4), then S[j][k] at k = tid % Dk,
  // j = (tid / Dk) * (DB / (THREADS / Dk)) + m.
  constexpr int TP = Dk + 1;  // padded rows: a column walk of the tile meets no bank twice
  constexpr int JQ = DB / 4;  // value rows per thread in the u and y steps
  constexpr int KR = THREADS / Dk;  // thread rows in the state step
  constexpr int JS = DB / KR;  // value rows per thread in the state step
  SHARED float tile[C * TP];
  SHARED float sv[DB * TP];
  SHARED float uv[C * (DB + 1)];
  const int NCH = dims[0];  // chunks: a value, not a template constant (one build per head shape)
  const uint nb = uint(Dv / DB);
  const uint bh = gid_x / nb, j0 = (gid_x % nb) * DB;
  for (uint e = tid; e < uint(DB * Dk); e += THREADS)
    sv[(e / Dk) * TP + e % Dk] = s_in[(size_t(bh) * Dv + j0 + e / Dk) * Dk + e % Dk];
  const uint c = tid / 4, jq = tid % 4;
  // chunk ch's C x Dk block of `src` into `tile`, then a barrier
#define GDS_STAGE(src)                                          \
  for (uint e = tid; e < uint(C * Dk); e += THREADS)            \
    tile[(e / Dk) * TP + e % Dk] = src[ch * C * Dk + e];        \
  BARRIER()
  // acc[m] = tile row c . S row jq + 4 m
#define GDS_ROW_DOTS(acc)                                                     \
  UNROLL for (int m = 0; m < JQ; ++m) acc[m] = 0.0f;                          \
  for (int k = 0; k < Dk; ++k) {                                              \
    const float tv = tile[c * TP + k];                                        \
    UNROLL for (int m = 0; m < JQ; ++m)                                       \
      acc[m] = fma_f(tv, sv[(jq + 4 * m) * TP + k], acc[m]);                  \
  }
  const uint ks = tid % Dk, kr = tid / Dk;
  for (int i = 0; i < NCH; ++i) {
    const size_t ch = size_t(bh) * NCH + i;  // chunk i of row-head bh
    // u = U - W S^T: W staged
    GDS_STAGE(w_all);
    if (c < uint(C)) {
      float acc[JQ];
      GDS_ROW_DOTS(acc);
      UNROLL for (int m = 0; m < JQ; ++m) {
        const uint j = jq + 4 * uint(m);
        uv[c * (DB + 1) + j] = u_all[(ch * C + c) * Dv + j0 + j] - acc[m];
      }
    }
    BARRIER();
    // y = q_dec S^T + attn u (attn is zero above the diagonal): q_dec staged
    GDS_STAGE(q_dec);
    if (c < uint(C)) {
      float acc[JQ];
      GDS_ROW_DOTS(acc);
      for (uint c2 = 0; c2 <= c; ++c2) {
        const float av = attn[(ch * C + c) * C + c2];
        UNROLL for (int m = 0; m < JQ; ++m)
          acc[m] = fma_f(av, uv[c2 * (DB + 1) + jq + 4 * m], acc[m]);
      }
      UNROLL for (int m = 0; m < JQ; ++m)
        y[(ch * C + c) * Dv + j0 + jq + 4 * m] = acc[m];
    }
    BARRIER();
    // S = decay S + u^T k_dec: k_dec staged
    GDS_STAGE(k_dec);
    const float dcy = decay[ch];
    float acc[JS];
    UNROLL for (int m = 0; m < JS; ++m) acc[m] = 0.0f;
    for (int cc = 0; cc < C; ++cc) {
      const float kv = tile[cc * TP + ks];
      UNROLL for (int m = 0; m < JS; ++m)
        acc[m] = fma_f(uv[cc * (DB + 1) + kr * JS + m], kv, acc[m]);
    }
    UNROLL for (int m = 0; m < JS; ++m) {
      const uint j = kr * JS + uint(m);
      sv[j * TP + ks] = fma_f(sv[j * TP + ks], dcy, acc[m]);
    }
    BARRIER();  // the next chunk's W overwrites `tile`; its u step reads every S row
  }
#undef GDS_STAGE
#undef GDS_ROW_DOTS
  for (uint e = tid; e < uint(DB * Dk); e += THREADS)
    s_out[(size_t(bh) * Dv + j0 + e / Dk) * Dk + e % Dk] = sv[(e / Dk) * TP + e % Dk];
"""

_INPUTS = ["u_all", "w_all", "q_dec", "attn", "k_dec", "decay", "s_in", "dims"]


def _example(C: int, dk: int, dv: int) -> Example:
    f = mx.float32
    return Example(
        {**dict.fromkeys(_INPUTS[:-1], f), "dims": (mx.int32, 1)},
        {"y": f, "s_out": f},
        {"C": C, "Dk": dk, "Dv": dv, "DB": DB, "THREADS": THREADS},
    )


_kernel = Kernel(
    "gated_delta_scan",
    inputs=_INPUTS,
    outputs=["y", "s_out"],
    body=_BODY,
    examples=[_example(64, 128, 128), _example(16, 32, 48)],
)


def covers(C: int, dk: int, dv: int) -> bool:
    """Shapes the kernel takes: Dv a multiple of DB, Dk dividing THREADS' rows evenly (the state
    step's mapping), C at most THREADS / 4 rows, and its shared memory within SHARED_BYTES."""
    smem = 4 * ((C + DB) * (dk + 1) + C * (DB + 1))
    return (
        dv % DB == 0
        and dk <= THREADS
        and THREADS % dk == 0
        and DB % (THREADS // dk) == 0
        and 1 <= C <= THREADS // 4
        and smem <= SHARED_BYTES
    )


@lru_cache(maxsize=32)
def _plan(be: str, B: int, H: int, n: int, C: int, dk: int, dv: int):
    """(launcher, dims array) for one call shape: one build per (C, Dk, Dv), whatever n."""
    launch = _kernel.launcher(
        [mx.float32] * (len(_INPUTS) - 1) + [mx.int32],
        grid=(B * H * (dv // DB) * THREADS,),
        threadgroup=(THREADS,),
        output_shapes=[(B, H, n, C, dv), (B, H, dv, dk)],
        output_dtypes=[mx.float32, mx.float32],
        template={"C": C, "Dk": dk, "Dv": dv, "DB": DB, "THREADS": THREADS},
        backend=be,
    )
    return launch, device_array([n], mx.int32)


def gated_delta_scan(u_all, w_all, q_dec, attn, k_dec, decay, state):
    """Dispatcher -> (y (B, H, n, C, Dv), new state (B, H, Dv, Dk)), fp32: the kernel on a GPU
    back end where ``scan_on`` and the shape is covered, else ``scan_reference``."""
    B, H, n, C, dv = u_all.shape
    dk = w_all.shape[-1]
    be = backend()
    if be is None or not scan_on(be) or not covers(C, dk, dv):
        return scan_reference(u_all, w_all, q_dec, attn, k_dec, decay, state)
    launch, dims = _plan(be, B, H, n, C, dk, dv)
    args = (u_all, w_all, q_dec, attn, k_dec, decay, state)
    y, s = launch(inputs=[*(a.astype(mx.float32) for a in args), dims])
    return y, s
