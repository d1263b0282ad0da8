"""TurboQuant decode speed: TQ-8 / TQ-4 caches against full-precision ones, at 4K, 16K, 32K.

Two parts (both on the default device; meant for the H200):
- attention: one decode step's attention for all 30 layers of a Gemma-4-26B-A4B shape (25 sliding
  layers: 16 query / 8 KV heads, head_dim 256, window 1024; 5 global: 16 / 2 heads, head_dim
  512), caches pre-filled with random K/V. Each step = cache write + ``attend`` per layer, one
  evaluation; reports ms per step and the KV bytes each step reads.
- model (``--model``): batch-1 greedy decode tokens/s of a random-weight Gemma-4-26B-A4B (MLX
  4-bit or, with ``--format q4_k``, GGML Q4_K weights, built by bench/gemma4.py) whose caches are
  pre-filled with random K/V to each context (a 32K prefill of a 26B model would dominate the
  run and measures nothing here). ``--step static`` (the default) decodes each cache kind the
  way ``stream_generate`` does: a one-row ``DecodeStep`` that adopts the filled cache, replayed
  as a CUDA graph where ``generation.graph_step`` gives one (every cache kind on CUDA; TurboQuant
  on the compiled step with ``HF2Q_TQ_GRAPH=0``) and compiled otherwise; ``--step eager`` runs
  the model on the per-sequence caches, a new graph per token. The ``path`` column says which.

    python bench/turboquant_speed.py                 # attention part
    python bench/turboquant_speed.py --model         # + whole-model decode
    python bench/turboquant_speed.py --tiny          # CPU smoke run, small shapes

With torch and CUDA present the attention part also reports CUPTI kernel time per step (the
GPU time alone, launches excluded) and the bandwidth it implies.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

from hf2q_mlx.decode_step import DecodeStep
from hf2q_mlx.generation import graph_step
from hf2q_mlx.models.attention import attend
from hf2q_mlx.models.cache import KVCache, RotatingKVCache
from hf2q_mlx.models.turboquant.cache import TQKVCache, TQRotatingKVCache, to_tq_cache

# (name, layers, query heads, KV heads, head_dim, window)
LAYERS_26B = [("sliding", 25, 16, 8, 256, 1024), ("global", 5, 16, 2, 512, None)]
LAYERS_TINY = [("sliding", 2, 4, 2, 64, 64), ("global", 1, 4, 1, 128, None)]
CACHES = [("full", None), ("TQ8", 8), ("TQ4", 4)]  # full: the model dtype (bf16 on a GPU)


def make_layer_cache(window: int | None, bits: int | None, seed: int):
    if bits is None:
        return KVCache() if window is None else RotatingKVCache(window)
    if window is None:
        return TQKVCache(bits, bits, seed=seed)
    return TQRotatingKVCache(window, bits, bits, seed=seed)


def fill(cache, heads: int, dim: int, n: int, dtype: mx.Dtype, chunk: int = 4096) -> None:
    """Write n random (unit-variance) K/V tokens, a chunk at a time (keeps transients small)."""
    key = mx.random.key(n + heads * dim)
    for start in range(0, n, chunk):
        L = min(chunk, n - start)
        k1, k2, key = mx.random.split(key, 3)
        k = mx.random.normal((1, heads, L, dim), key=k1).astype(dtype)
        v = mx.random.normal((1, heads, L, dim), key=k2).astype(dtype)
        cache.update_and_fetch(k, v)
        if getattr(cache, "needs_calibration", False):
            # what attend() does after the first write: key scales (TQBalance) from queries
            cache.calibrate(mx.random.normal((1, heads, L, dim), key=key).astype(dtype))
        mx.eval(cache.keys, cache.values)


def timed_steps(step, n: int) -> list[float]:
    """Seconds per call of ``step`` (which builds and evaluates one step), after two warm-ups."""
    for _ in range(2):
        step()
    times = []
    for _ in range(n):
        tic = time.perf_counter()
        step()
        times.append(time.perf_counter() - tic)
    return times


def attention_bench(layers, ctx: int, bits: int | None, dtype: mx.Dtype, steps: int) -> dict:
    """All layers' attention for one decode token at context ``ctx``."""
    caches, shapes = [], []
    for _, n, hq, hkv, d, window in layers:
        for _ in range(n):
            c = make_layer_cache(window, bits, seed=len(caches))
            fill(c, hkv, d, ctx, dtype)
            caches.append(c)
            shapes.append((hq, hkv, d, window))
    key = mx.random.key(1)
    qkv = []
    for hq, hkv, d, _ in shapes:
        ks = mx.random.split(key, 4)
        key = ks[3]
        qkv.append(tuple(mx.random.normal((1, h, 1, d), key=k).astype(dtype)
                         for h, k in zip((hq, hkv, hkv), ks[:3])))  # fmt: skip
    mx.eval(qkv)

    def step():
        outs = []
        for c, (q, k, v), (_, _, d, _) in zip(caches, qkv, shapes):
            kk, vv, mask = c.update_and_fetch(k, v)
            outs.append(attend(q, kk, vv, c, d**-0.5, mask))
            c.trim(1)  # the context stays at ctx; the cache still writes every step
        mx.eval(outs)

    prof = cupti_profiler()
    if prof is not None:
        prof.__enter__()
    times = timed_steps(step, steps)
    kernel_ms = None
    if prof is not None:
        prof.__exit__(None, None, None)
        from torch.autograd import DeviceType

        n_prof = steps + 2  # timed_steps runs two warm-ups inside the profile
        by_name: dict[str, list] = {}
        for e in prof.events():
            if e.device_type == DeviceType.CUDA:
                row = by_name.setdefault(e.name[:80], [0, 0.0])
                row[0] += 1
                row[1] += e.time_range.elapsed_us()
        kernel_ms = sum(t for _, t in by_name.values()) / 1e3 / n_prof
        top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:6]
        kernels = [{"kernel": n, "per_step": c / n_prof, "us_per_step": t / n_prof}
                   for n, (c, t) in top]  # fmt: skip
    ms = 1e3 * statistics.median(times)
    kv_bytes = 0
    for c, (_, _, _, window) in zip(caches, shapes):
        slots = min(ctx + 1, window or ctx + 1)
        kv_bytes += c.nbytes * slots // c.keys.shape[2]  # the part a step reads
    out = {"ms_per_step": ms, "kv_mb_read": kv_bytes / 1e6, "gb_s": kv_bytes / (ms * 1e-3) / 1e9}
    if kernel_ms is not None:  # GPU time alone: what the cache format changes, minus launches
        out.update(kernel_ms_per_step=kernel_ms, kernel_gb_s=kv_bytes / (kernel_ms * 1e-3) / 1e9,
                   kernels=kernels)  # fmt: skip
    return out


def cupti_profiler():
    """A torch.profiler recording CUDA kernel durations, or None (no torch / no CUDA / not a GPU
    run): the wall time of a step at these sizes is mostly launches, the kernel time is not."""
    if mx.default_device().type != mx.DeviceType.gpu or importlib.util.find_spec("torch") is None:
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CUDA])


def kernel_time(fn, prof_on: bool, kind_of) -> tuple[float, dict[str, float]]:
    """us of one evaluated ``fn()``: CUPTI kernel time, summed by ``kind_of(kernel name)``,
    where ``prof_on`` and a profiler exists; else wall time (and no split)."""
    prof = cupti_profiler() if prof_on else None
    if prof is None:
        tic = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        return (time.perf_counter() - tic) * 1e6, {}
    from torch.autograd import DeviceType

    with prof:
        mx.eval(fn())
        mx.synchronize()
    by_kind: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            kind = kind_of(e.name)
            by_kind[kind] = by_kind.get(kind, 0.0) + e.time_range.elapsed_us()
    return sum(by_kind.values()), by_kind


def load_gemma4_bench():
    """bench/gemma4.py as a module (its shapes and random-weight builders)."""
    path = Path(__file__).with_name("gemma4.py")
    spec = importlib.util.spec_from_file_location("bench_gemma4", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_gemma4"] = mod
    spec.loader.exec_module(mod)
    return mod


def decode_step(model, y: mx.array, cache: list) -> mx.array:
    return mx.argmax(model(y, cache=cache)[:, -1, :], axis=-1)[:, None]


class Decoder:
    """Greedy tokens from a filled per-sequence cache: eagerly on it, or (``static``) through a
    one-row DecodeStep that adopted it, replayed as a CUDA graph where ``graph_step`` gives one
    (``path`` says which)."""

    def __init__(self, model, cache: list, bits: int | None, static: bool, max_len: int):
        self.model, self.cache, self.step, self.graph = model, cache, None, None
        self.path = "eager"
        if static:
            self.step = DecodeStep(model, 1, max_len, kv_bits=bits, like=cache)
            self.step.adopt(0, cache)
            self.cache = None
            self.graph = graph_step(self.step)
            self.path = "graph" if self.graph is not None else "compiled"
        self.tokens(2)  # builds kernels, traces, records

    def tokens(self, n: int) -> None:
        if self.graph is not None:
            t = 1
            for _ in range(n):
                t = self.graph.decode([t])[0]  # each id read back before the next replay
            return
        y = mx.array([1], mx.int32)
        for _ in range(n):
            if self.step is not None:
                y = self.step.decode(y, greedy=True)
            else:
                y = decode_step(self.model, y[:, None], self.cache)[:, 0]
            mx.async_eval(y)
        mx.eval(y)


def model_bench(
    tiny: bool, contexts: list[int], n_decode: int, rounds: int = 5, static: bool = True,
    fmt: str = "mlx4", fold_ab: bool = False, tq_env: dict[str, str] | None = None,
) -> list[dict]:  # fmt: skip
    """Decode tokens/s per context and cache kind. The three caches of a context are filled
    first, then decoded in turns (full, TQ8, TQ4, full, ...) for ``rounds`` rounds of ``n_decode``
    tokens with the garbage collector off: host jitter lands on every kind alike, and the median
    round is reported (each round grows the context by ``n_decode``). ``fold_ab``: TQ8 and TQ4
    once more with HF2Q_TQ_FOLD=1 while their step is built (recorded: TurboQuant's fused
    launches), the other kinds with it off, in the same rounds. ``tq_env``: likewise TQ8e /
    TQ4e, built with these environment variables set (e.g. HF2Q_TQ_W=8)."""
    g4b = load_gemma4_bench()
    from hf2q_mlx.models import gemma4

    config = g4b.TINY["tiny-moe"] if tiny else g4b.SHAPES["26b-a4b"]
    args = gemma4.ModelArgs.from_dict(config)
    dtype = mx.bfloat16 if mx.default_device().type == mx.DeviceType.gpu else mx.float32
    model = (g4b.build_ggml if fmt == "q4_k" else g4b.build_mlx4)(args, dtype)
    rows = []
    for ctx in contexts:
        caches = {}
        kinds = [(label, bits, {}) for label, bits in CACHES]
        if fold_ab:
            fold_env = {"HF2Q_TQ_FOLD": "1"}
            kinds += [(label + "f", bits, fold_env) for label, bits in CACHES if bits is not None]
        if tq_env:
            kinds += [(label + "e", bits, tq_env) for label, bits in CACHES if bits is not None]
        for label, bits, env in kinds:
            cache = model.make_cache()
            if bits is not None:
                cache = to_tq_cache(cache, bits)
            for i, c in enumerate(cache):
                d, kv, _ = args.layer_geometry(i)
                fill(c, kv, d, ctx, dtype)
            max_len = ctx + (rounds + 1) * n_decode + 8
            os.environ.update(env)  # read while the step is traced and recorded
            try:
                caches[label] = Decoder(model, cache, bits, static, max_len)
            finally:
                for name in env:
                    os.environ.pop(name)
        rates = {label: [] for label in caches}
        gc.collect()
        gc.disable()
        try:
            for _ in range(rounds):
                for label, dec in caches.items():
                    tic = time.perf_counter()
                    dec.tokens(n_decode)
                    rates[label].append(n_decode / (time.perf_counter() - tic))
        finally:
            gc.enable()
        base = statistics.median(rates["full"])
        for label, r in rates.items():
            rate = statistics.median(r)
            path = caches[label].path
            rows.append({"context": ctx, "cache": label, "decode_tok_s": rate, "rounds": r,
                         "vs_full": rate / base, "path": path, "format": fmt})  # fmt: skip
            print(f"model  ctx {ctx:6d} {label:5} {rate:8.2f} tok/s  {rate / base:5.2f}x full  "
                  f"{path:8} (rounds " + " ".join(f"{x:.1f}" for x in r) + ")",
                  flush=True)  # fmt: skip
        del caches
        mx.clear_cache()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="small shapes and contexts (CPU smoke)")
    p.add_argument("--model", action="store_true", help="also the whole-model decode")
    p.add_argument("--model-only", action="store_true", help="the whole-model decode alone")
    p.add_argument("--contexts", default=None, help="comma list (default 4096,16384,32768)")
    p.add_argument("--steps", type=int, default=None, help="timed attention steps (default 20)")
    p.add_argument("--decode", type=int, default=None, help="model tokens per round (default 32)")
    p.add_argument("--rounds", type=int, default=5, help="model rounds per cache kind (default 5)")
    p.add_argument(
        "--step",
        choices=["static", "eager"],
        default="static",
        help="model decode path (default static: as stream_generate decodes)",
    )
    p.add_argument("--format", choices=["mlx4", "q4_k"], default="mlx4", help="model weights")
    p.add_argument(
        "--fold-ab",
        action="store_true",
        help="also TQ8f / TQ4f: TurboQuant's fused launches (HF2Q_TQ_FOLD=1)",
    )
    p.add_argument(
        "--tq-env",
        default="",
        help="also TQ8e / TQ4e built with these variables, e.g. HF2Q_TQ_W=8 (comma list)",
    )
    p.add_argument("--json", default="bench_turboquant_speed.json")
    a = p.parse_args()
    default_ctx = "256,1024" if a.tiny else "4096,16384,32768"
    contexts = [int(c) for c in (a.contexts or default_ctx).split(",")]
    layers = LAYERS_TINY if a.tiny else LAYERS_26B
    steps = a.steps or (3 if a.tiny else 20)
    dtype = mx.bfloat16 if mx.default_device().type == mx.DeviceType.gpu else mx.float32
    print(f"mlx {mx.__version__} on {mx.default_device()}, activations {dtype}")
    print(f"{'part':6} {'context':>7} {'cache':5} {'ms/step':>8} {'KV MB':>8} {'GB/s':>7}")
    rows = []
    for ctx in [] if a.model_only else contexts:
        for label, bits in CACHES:
            r = attention_bench(layers, ctx, bits, dtype, steps)
            rows.append({"part": "attention", "context": ctx, "cache": label, **r})
            kern = ""
            if "kernel_ms_per_step" in r:
                kern = f"   kernels {r['kernel_ms_per_step']:7.3f} ms, {r['kernel_gb_s']:7.1f} GB/s"
            print(f"{'attn':6} {ctx:7d} {label:5} {r['ms_per_step']:8.3f} "
                  f"{r['kv_mb_read']:8.1f} {r['gb_s']:7.1f}{kern}", flush=True)  # fmt: skip
            for k in r.get("kernels", []):
                print(f"{'':22}{k['us_per_step']:9.1f} us {k['per_step']:5.0f}x  {k['kernel']}")
            mx.clear_cache()
    if a.model or a.model_only:
        n = a.decode or (4 if a.tiny else 32)
        env = dict(kv.split("=", 1) for kv in a.tq_env.split(",") if kv)
        rows += model_bench(
            a.tiny, contexts, n, a.rounds, a.step == "static", a.format, a.fold_ab, env
        )
    with open(a.json, "w") as f:
        json.dump({"mlx": mx.__version__, "device": str(mx.default_device()), "rows": rows}, f,
                  indent=1)  # fmt: skip
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
