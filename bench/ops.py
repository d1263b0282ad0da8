"""Per-op latency of the fused hot-op kernels against the unfused MLX sequences they replace.

Each case is timed two ways, median of several trials after a warm-up: "call" = build the op's
graph and evaluate it (one op per evaluation: launch and sync costs included), "chained" = 32
independent applications evaluated together (per application: closer to an op's share of a
decode step, which is one evaluation of the whole graph). Prints a table, then writes JSON.

    python bench/ops.py [--json ops.json] [--quick]

On a machine without a GPU back end every dispatcher takes its reference path, so the numbers
only show that the script runs.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
from gguf import GGMLQuantizationType as GT

from hf2q_mlx.custom_kernels import backend
from hf2q_mlx.custom_kernels.activations import gated_activation
from hf2q_mlx.custom_kernels.lm_head_topk import lm_head_topk
from hf2q_mlx.custom_kernels.qmatmul import ggml_matmul
from hf2q_mlx.custom_kernels.residual_rms_norm import residual_rms_norm
from hf2q_mlx.custom_kernels.rms_norm_rope import qk_norm_rope, rope_inv_freq
from hf2q_mlx.custom_kernels.sampling import topk
from hf2q_mlx.custom_kernels.softcap import softcap
from hf2q_mlx.random_weights import random_ggml_blocks

CHAIN = 32


def _time(fn: Callable[[], object], reps: int, chain: int) -> float:
    """Median microseconds per application over ``reps`` trials of ``chain`` applications."""
    mx.eval(fn())  # warm-up: kernel builds
    trials = []
    for _ in range(reps):
        mx.synchronize()
        start = time.perf_counter()
        mx.eval([fn() for _ in range(chain)])
        mx.synchronize()
        trials.append((time.perf_counter() - start) * 1e6 / chain)
    return statistics.median(trials)


def _normal(shape, dtype=mx.bfloat16, seed=0, scale=1.0):
    return (mx.random.normal(shape, key=mx.random.key(seed)) * scale).astype(dtype)


def cases(quick: bool) -> list[tuple[str, str, Callable, Callable]]:
    """(op, shape, fused, unfused) closures over fresh bf16 inputs."""
    out = []
    dt = mx.bfloat16
    norm_rope = [
        ("Gemma 3 270M", 4, 1, 256, 256, 256, False),
        ("Gemma 4 global (q, k, v)", 16, 4, 512, 512, 512, True),
        ("Qwen 3.5 [q | gate]", 16, 4, 256, 64, 512, False),
    ]
    for name, hq, hk, D, R, P, with_v in norm_rope[:1] if quick else norm_rope:
        q, k = _normal((1, 1, hq, P), dt, 1), _normal((1, 1, hk, D), dt, 2)
        v = _normal((1, 1, hk, D), dt, 3) if with_v else None
        wq, wk = _normal((D,), dt, 4), _normal((D,), dt, 5)
        inv, off = rope_inv_freq(R, 1e6), mx.array(4000)

        def fused(q=q, k=k, v=v, wq=wq, wk=wk, inv=inv, off=off, D=D):
            return qk_norm_rope(q, k, wq, wk, inv, eps=1e-6, offset=off, dims=D, v=v)

        def unfused(q=q, k=k, v=v, wq=wq, wk=wk, off=off, D=D, R=R):
            qn = mx.fast.rms_norm(q[..., :D], wq, 1e-6).transpose(0, 2, 1, 3)
            kn = mx.fast.rms_norm(k, wk, 1e-6).transpose(0, 2, 1, 3)
            rope = dict(traditional=False, base=1e6, scale=1.0, offset=off)
            outs = [mx.fast.rope(qn, R, **rope), mx.fast.rope(kn, R, **rope)]
            if v is not None:
                outs.append(mx.fast.rms_norm(v, None, 1e-6).transpose(0, 2, 1, 3))
            return outs

        out.append(("qk_norm_rope", name, fused, unfused))
    for H in (640,) if quick else (640, 2816, 5376):
        x, r, w = _normal((1, 1, H), dt, 6), _normal((1, 1, H), dt, 7), _normal((H,), dt, 8)

        def unfused_res(x=x, r=r, w=w):
            h = x + r
            return h, mx.fast.rms_norm(h, w, 1e-6)

        out.append(
            (
                "residual_rms_norm",
                f"H={H}",
                lambda x=x, r=r, w=w: residual_rms_norm(x, r, w, 1e-6),
                unfused_res,
            )
        )
    glu = mx.compile(lambda g, u: nn.gelu_approx(g) * u, shapeless=True)
    for I in (2048,) if quick else (2048, 6144, 21504):
        gu = _normal((1, 1, 2 * I), dt, 9)
        g, u = gu[..., :I], gu[..., I:]
        out.append(("gelu_tanh_mul fused gate_up", f"I={I}",
                    lambda gu=gu: gated_activation(gu, None, "gelu_tanh"),
                    lambda g=g, u=u: nn.gelu_approx(g) * u))  # fmt: skip
        out.append(("gelu_tanh_mul vs mx.compile", f"I={I}",
                    lambda gu=gu: gated_activation(gu, None, "gelu_tanh"),
                    lambda g=g, u=u: glu(g, u)))  # fmt: skip
    V = 262144
    logits = _normal((1, V), mx.float32, 10, 8.0)
    out.append(("softcap", f"V={V}", lambda: softcap(logits, 30.0),
                lambda: mx.tanh(logits / 30.0) * 30.0))  # fmt: skip
    for B, k in ((1, 1), (1, 40), (16, 1), (16, 64)):
        lg = _normal((B, V), mx.float32, 11 + B, 8.0)
        if k == 1:
            out.append(("top-1 (topk kernel, k=1)", f"B={B} V={V}", lambda lg=lg: topk(lg, 1),
                        lambda lg=lg: mx.argmax(lg, axis=-1)))  # fmt: skip
        else:
            out.append(("topk", f"B={B} V={V} k={k}", lambda lg=lg, k=k: topk(lg, k),
                        lambda lg=lg, k=k: mx.topk(lg, k, axis=-1)))  # fmt: skip
        if quick:
            break
    H, V = 640, 32000 if quick else V
    xh = _normal((1, H), dt, 12)
    wq8 = random_ggml_blocks(V, H, GT.Q8_0, seed=1)
    wbf = _normal((V, H), dt, 13, 0.05)
    for name, w, gtype in (("Q8_0", wq8, GT.Q8_0), ("bf16", wbf, None)):

        def head(x=xh, w=w, gtype=gtype, rerank=True):
            return lm_head_topk(x, w, 1, softcap=30.0, ggml_type=gtype, rerank=rerank)

        def plain(x=xh, w=w, gtype=gtype):
            lg = ggml_matmul(x, w, gtype, H) if gtype is not None else x @ w.T
            return mx.argmax(mx.tanh(lg.astype(mx.float32) / 30.0) * 30.0, axis=-1)

        out.append((f"lm_head greedy {name} (exact rerank)", f"V={V} H={H}", head, plain))
        out.append((f"lm_head greedy {name} (no rerank)", f"V={V} H={H}",
                    lambda head=head: head(rerank=False), plain))  # fmt: skip
    return out


def overhead_cases() -> list[tuple[str, Callable]]:
    """Where a custom kernel's per-launch cost goes: a built-in op, a bare ``cuda_kernel`` copy,
    the same with the shared vocabulary header and a template, through ``_render.Kernel``, and a
    full dispatcher (CUDA only)."""
    from hf2q_mlx.custom_kernels import _render

    x = _normal((1, 640), mx.bfloat16, 20)
    src = "const unsigned i = threadIdx.x + blockIdx.x * blockDim.x; if (i < 640) out[i] = inp[i];"
    common = dict(input_names=["inp"], output_names=["out"], source=src)
    bare = mx.fast.cuda_kernel(name="hq_bench_copy", **common)
    vocab = mx.fast.cuda_kernel(name="hq_bench_copy_vocab", header=_render.CUDA_HEADER, **common)
    body = "const uint i = pos_x; if (i < 640u) out[i] = inp[i];"
    example = _render.Example({"inp": mx.bfloat16}, {"out": mx.bfloat16})
    wrapped = _render.Kernel("bench_copy", ["inp"], ["out"], body, register=False,
                             examples=[example])  # fmt: skip
    launch = dict(grid=(640, 1, 1), threadgroup=(128, 1, 1), output_shapes=[x.shape],
                  output_dtypes=[x.dtype])  # fmt: skip
    w = _normal((640,), mx.bfloat16, 21)
    return [
        ("built-in x + 1", lambda: x + 1),
        ("built-in mx.fast.rms_norm", lambda: mx.fast.rms_norm(x, w, 1e-6)),
        ("bare cuda_kernel copy", lambda: bare(inputs=[x], **launch)[0]),
        ("cuda_kernel + vocabulary header", lambda: vocab(inputs=[x], **launch)[0]),
        ("cuda_kernel + header + template",
         lambda: vocab(inputs=[x], template=[("T", mx.bfloat16)], **launch)[0]),
        ("_render.Kernel copy", lambda: wrapped([x], **launch, template={"T": mx.bfloat16})[0]),
        ("residual_rms_norm dispatcher", lambda: residual_rms_norm(x, x, w, 1e-6)[1]),
    ]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="ops.json", help="where to write the results")
    ap.add_argument("--quick", action="store_true", help="a few cases, few trials (smoke test)")
    ap.add_argument("--overhead", action="store_true", help="only the per-launch cost breakdown")
    args = ap.parse_args()
    if args.overhead:
        if backend() != "cuda":
            raise SystemExit("--overhead needs MLX's CUDA back end")
        rows = []
        for name, fn in overhead_cases():
            t = {"call_us": _time(fn, 9, 1), "chained_us": _time(fn, 9, CHAIN)}
            rows.append({"case": name, **{k: round(v, 2) for k, v in t.items()}})
            print(f"{name:<36} call {t['call_us']:8.1f} us   chained {t['chained_us']:8.1f} us",
                  flush=True)  # fmt: skip
        with open(args.json, "w") as f:
            json.dump({"device": str(mx.default_device()), "overhead": rows}, f, indent=1)
        return
    reps = 3 if args.quick else 9
    rows = []
    header = (f"{'op':<38} {'shape':<26} {'fused call':>10} {'unfused':>9} "
              f"{'fused ch.':>9} {'unfused':>9} {'x (ch.)':>7}")  # fmt: skip
    print(f"device {mx.default_device()}, kernels: {backend() or 'reference'}; microseconds")
    print(header)
    for op, shape, fused, unfused in cases(args.quick):
        t = {
            "fused_call_us": _time(fused, reps, 1),
            "unfused_call_us": _time(unfused, reps, 1),
            "fused_chained_us": _time(fused, reps, 2 if args.quick else CHAIN),
            "unfused_chained_us": _time(unfused, reps, 2 if args.quick else CHAIN),
        }
        speedup = (
            t["unfused_chained_us"] / t["fused_chained_us"] if t["fused_chained_us"] else math.nan
        )
        rows.append({"op": op, "shape": shape, **{k: round(v, 2) for k, v in t.items()},
                     "speedup_chained": round(speedup, 2)})  # fmt: skip
        print(f"{op:<38} {shape:<26} {t['fused_call_us']:>10.1f} {t['unfused_call_us']:>9.1f} "
              f"{t['fused_chained_us']:>9.1f} {t['unfused_chained_us']:>9.1f} {speedup:>7.2f}",
              flush=True)  # fmt: skip
    result = {
        "device": str(mx.default_device()),
        "kernels": backend() or "reference",
        "mlx_version": mx.__version__,
        "platform": platform.platform(),
        "rows": rows,
    }
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
