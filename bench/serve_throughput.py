"""Continuous-batching throughput at 1/2/4/8/16/32 concurrent streams, random weights at the
Gemma-4-26B-A4B and Qwen3.5-35B-A3B shapes, next to mlx-lm's BatchGenerator (the batching
engine behind `mlx_lm.server`) on the very same MLX 4-bit arrays.

Per stream count n: n requests submitted at once, prompts of mixed lengths (32..1024 tokens),
EOS ignored, ``--gen`` tokens each, after the engine's warm-up (``Engine(warmup=True)``) and
one wave of the same lengths (mlx-lm gets that wave too). Reports aggregate decode tok/s
(tokens after the first / time from the first first-token to the last token, so other
streams' prefill counts against it), the steady rate (tokens per second while all n streams
decode: from the last first-token to the first last-token), p50/p99 time to first token and
p50/p99 inter-token latency, and the ratios to the single-stream rates. The engine is driven
directly (no HTTP), with the batched compiled DecodeStep on a GPU. A prefill step delays the
running streams once, so p99 inter-token latency depends on ``--prefill-chunk`` (the prefill
tokens of all rows per step: a larger one means fewer, longer stalls). Ours and mlx-lm
alternate per stream count (a time cap then cuts both columns at the same row). Prints a table
and writes JSON after every row (a run cut short keeps what it measured).

    python bench/serve_throughput.py                          # both shapes, H200
    python bench/serve_throughput.py --shapes gemma4-26b-a4b --streams 1,8,32
    python bench/serve_throughput.py --tiny --streams 1,2,4 --gen 8   # CPU smoke run
    # H200, the batching targets (docs/serving.md):
    python bench/serve_throughput.py --shapes gemma4-26b-a4b --formats mlx4,q4_k \
        --streams 1,8,32 --gen 256 --prefill-chunk 4096 --time-cap 360
    pip install --no-deps mlx-lm==0.32.2                      # for the mlx-lm column
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gemma4 as g4bench  # noqa: E402  (bench/gemma4.py: model builders at the real shapes)
import qwen3_5 as q35bench  # noqa: E402

from hf2q_mlx.custom_kernels import cuda_cache  # noqa: E402
from hf2q_mlx.models import gemma4  # noqa: E402
from hf2q_mlx.models.experts import (  # noqa: E402
    affine_experts_to_q4_1,
    apply_affine_expert_format,
)
from hf2q_mlx.serving.batch_sampler import SamplingParams  # noqa: E402
from hf2q_mlx.serving.engine import Engine  # noqa: E402

PROMPT_LENGTHS = (32, 128, 512, 1024)


class _Detok:
    last_segment = ""

    def add_token(self, t: int) -> None:
        pass

    def finalize(self) -> None:
        pass


class StubTokenizer:
    """Random weights have no tokenizer: no EOS, no text."""

    eos_token_ids: list[int] = []
    bos_token_id = None

    def detokenizer(self) -> _Detok:
        return _Detok()


def build(shape: str, fmt: str, dtype) -> tuple:
    """(our model, config dict, family) at ``shape`` in ``fmt`` (mlx4 or q4_k)."""
    if shape.startswith("gemma4") or shape.startswith("tiny-gemma"):
        table = {
            "gemma4-26b-a4b": g4bench.SHAPES["26b-a4b"],
            "tiny-gemma4": g4bench.TINY["tiny-moe"],
        }
        config = table[shape]
        args = gemma4.ModelArgs.from_dict(config)
        model = (
            g4bench.build_ggml(args, dtype) if fmt == "q4_k" else g4bench.build_mlx4(args, dtype)
        )
        return model, config, "gemma4"
    table = {
        "qwen3.5-35b-a3b": q35bench.SHAPES["35b-a3b"],
        "tiny-qwen3.5": q35bench.TINY_SHAPES["tiny-moe"],
    }
    config = table[shape]
    model = q35bench.build_ours(config, dtype)
    if fmt == "q4_k":
        q35bench.randomize_q4k(model, dtype)
    else:
        q35bench.randomize_mlx_quantized(model, dtype)
    q35bench.cast_floats(model, dtype)
    mx.eval(model.parameters())
    return model, config, "qwen3_5"


def mlx_lm_twin(family: str, config: dict, ours):
    if family == "gemma4":
        mods = g4bench.import_mlx_lm()
        return None if mods is None else g4bench.build_mlx_lm(mods, config, ours)
    return q35bench.mlx_lm_twin(ours, config)


def summarize(name: str, n: int, starts: dict, stamps: dict) -> dict:
    ttft = [stamps[r][0] - starts[r] for r in stamps if stamps[r]]
    itl = [b - a for r in stamps for a, b in zip(stamps[r], stamps[r][1:])]
    first = min(s[0] for s in stamps.values() if s)
    last = max(s[-1] for s in stamps.values() if s)
    decoded = sum(max(len(s) - 1, 0) for s in stamps.values())
    # the window where every stream decodes: after the last first token, up to the first end
    lo = max(s[0] for s in stamps.values() if s)
    hi = min(s[-1] for s in stamps.values() if s)
    steady = [t for s in stamps.values() for t in s if lo < t <= hi]
    steady_itl = [b - a for s in stamps.values() for a, b in zip(s, s[1:]) if lo < b <= hi]

    def pct(xs: list[float], q: float) -> float:
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3 if xs else float("nan")

    return {"impl": name, "streams": n, "tokens": sum(len(s) for s in stamps.values()),
            "decode_tok_s": decoded / max(last - first, 1e-9),
            "steady_tok_s": len(steady) / (hi - lo) if hi > lo else float("nan"),
            "steady_itl_p99_ms": pct(steady_itl, 0.99),
            "ttft_p50_ms": pct(ttft, 0.5), "ttft_p99_ms": pct(ttft, 0.99),
            "itl_p50_ms": pct(itl, 0.5), "itl_p99_ms": pct(itl, 0.99),
            "itl_mean_ms": statistics.fmean(itl) * 1e3 if itl else float("nan")}  # fmt: skip


def prompts_for(n: int, vocab: int, seed: int, length: int | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [length or PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)] for i in range(n)]
    return [[rng.randrange(vocab) for _ in range(m)] for m in lengths]


def run_ours(
    model, n, gen, vocab, max_len, compiled=None, prefill_chunk=512, batch_prefill=False
) -> dict:
    # the engine's warm-up builds every prefill kernel, the step or CUDA graph at every attention
    # span and the sampling before start() returns (on the H200 a first call's JIT had put
    # ~50 s into the first wave's TTFT)
    engine = Engine(model, StubTokenizer(), max_batch=n, max_queue=0, max_len=max_len,
                    prefix_cache_bytes=0, compiled=compiled, prefill_chunk=prefill_chunk,
                    batch_prefill=batch_prefill, warmup=True).start()  # fmt: skip
    # and one wave of the measured lengths, as mlx-lm gets (MLX's own first calls at a shape)
    _wave(engine, prompts_for(n, vocab, 7), 2)
    steps0, t0 = engine.steps, time.perf_counter()
    starts, stamps = _wave(engine, prompts_for(n, vocab, 0), gen)
    steps, wall = engine.steps - steps0, time.perf_counter() - t0
    step = type(engine.step).__name__ + ("+pack" if batch_prefill else "")
    engine.shutdown()
    # engine steps of the wave and their mean wall time (prefill steps included)
    return {**summarize(f"hf2q_mlx ({step})", n, starts, stamps), "engine_steps": steps,
            "step_ms": wall / max(steps, 1) * 1e3, "warmup_s": engine.warmup_s}  # fmt: skip


def _wave(engine: Engine, prompts: list[list[int]], gen: int) -> tuple[dict, dict]:
    starts, stamps, done = {}, {}, threading.Semaphore(0)

    def sink_for(key: int):
        def sink(e) -> None:
            if e.token is not None:
                stamps[key].append(time.perf_counter())
            if e.finish_reason is not None:
                done.release()

        return sink

    for i, p in enumerate(prompts):
        stamps[i] = []
        starts[i] = time.perf_counter()
        engine.submit(p, SamplingParams(max_tokens=gen, ignore_eos=True), sink_for(i))
    for _ in prompts:
        done.acquire()
    return starts, stamps


MLX_LM_PROMPT_CONCURRENCY = 8  # mlx_lm.server --prompt-concurrency's default (mlx-lm 0.32.2)


def run_mlx_lm(model, n: int, gen: int, vocab: int) -> dict:
    from mlx_lm.generate import BatchGenerator  # mlx_lm.server batches through this class

    def wave(prompts):
        # mlx_lm.server's defaults: --prompt-concurrency 8 (prompts prefilled together; 32 at
        # once failed inside MLX 0.32.4's CUDA graph on 26B-A4B, session 44), decode all n
        bg = BatchGenerator(model, max_tokens=gen, stop_tokens=set(), completion_batch_size=n,
                            prefill_batch_size=min(n, MLX_LM_PROMPT_CONCURRENCY))  # fmt: skip
        t0 = time.perf_counter()
        uids = bg.insert(prompts, [gen] * len(prompts))
        starts = {u: t0 for u in uids}
        stamps = {u: [] for u in uids}
        finished = 0
        while finished < len(uids):
            # mlx-lm 0.32: next() -> (prompt, generation) responses; next_generated() the latter
            responses = bg.next_generated() if hasattr(bg, "next_generated") else bg.next()
            now = time.perf_counter()
            for r in responses:
                stamps[r.uid].append(now)
                if r.finish_reason is not None:
                    finished += 1
        if hasattr(bg, "close"):
            bg.close()
        return starts, stamps

    wave(prompts_for(n, vocab, 99))
    starts, stamps = wave(prompts_for(n, vocab, 0))
    return summarize("mlx-lm BatchGenerator", n, starts, stamps)


HEADER = (f"{'shape':<16} {'fmt':<5} {'impl':<28} {'n':>3} {'decode tok/s':>12} {'x n=1':>6} "
          f"{'steady':>8} {'x n=1':>6} {'TTFT p50':>9} {'p99':>8} {'ITL p50':>8} {'p99':>8} "
          f"{'x n=1':>6} {'steady p99':>10}")  # fmt: skip


def row_text(r: dict) -> str:
    nan = float("nan")
    return (f"{r['shape']:<16} {r['format']:<5} {r['impl']:<28} {r['streams']:>3} "
            f"{r['decode_tok_s']:>12.1f} {r.get('speedup', nan):>6.2f} "
            f"{r['steady_tok_s']:>8.1f} {r.get('steady_speedup', nan):>6.2f} "
            f"{r['ttft_p50_ms']:>9.1f} {r['ttft_p99_ms']:>8.1f} {r['itl_p50_ms']:>8.2f} "
            f"{r['itl_p99_ms']:>8.2f} {r.get('itl_p99_ratio', nan):>6.2f} "
            f"{r['steady_itl_p99_ms']:>10.2f}")  # fmt: skip


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="gemma4-26b-a4b,qwen3.5-35b-a3b")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
    p.add_argument("--formats", default="mlx4,q4_k", help="mlx4 (shared with mlx-lm), q4_k")
    p.add_argument("--streams", default="1,2,4,8,16,32")
    p.add_argument("--gen", type=int, default=128, help="tokens per stream (128)")
    p.add_argument("--no-mlx-lm", action="store_true")
    p.add_argument(
        "--mlx-lm-only",
        action="store_true",
        help="with mlx4: the mlx-lm column alone (ours skipped)",
    )
    p.add_argument("--prefill-chunk", type=int, default=512, help="engine prefill chunk (512)")
    p.add_argument(
        "--batch-prefill-ab",
        action="store_true",
        help="also ours with batch_prefill (the rows' chunks in one pass): 'ours-bp'",
    )
    p.add_argument(
        "--affine-experts-ab",
        action="store_true",
        help="with mlx4: also ours on a second build with its experts as Q4_1: 'ours-q4_1'",
    )
    p.add_argument("--step", choices=["auto", "compiled", "sequential"], default="auto",
                   help="decode step: auto = DecodeStep on a GPU")  # fmt: skip
    p.add_argument("--time-cap", type=float, default=None,
                   help="seconds: start no new row past this (what ran is kept)")  # fmt: skip
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    t_start = time.perf_counter()
    out = a.json or f"bench/results/serve_throughput_{time.strftime('%Y-%m-%d_%H%M')}.json"
    shapes = ["tiny-gemma4", "tiny-qwen3.5"] if a.tiny else a.shapes.split(",")
    counts = [int(x) for x in a.streams.split(",")]
    dtype = mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
    max_len = max(PROMPT_LENGTHS) + a.gen + 8
    print(f"mlx {mx.__version__} on {mx.default_device()}, {a.gen} tokens per stream")
    print(HEADER, flush=True)
    rows = []

    def out_of_time() -> bool:
        return a.time_cap is not None and time.perf_counter() - t_start > a.time_cap

    for shape in shapes:
        for fmt in a.formats.split(","):
            if out_of_time():
                print(f"time cap: {shape} {fmt} not run")
                continue
            model, config, family = build(shape, fmt, dtype)
            vocab = config["vocab_size"]
            impls = [] if a.mlx_lm_only and fmt == "mlx4" else [("ours", model)]
            if impls and a.batch_prefill_ab:
                impls.append(("ours-bp", model))
            if fmt == "mlx4" and not a.no_mlx_lm:
                try:
                    twin = mlx_lm_twin(family, config, model)
                    if twin is not None:
                        impls.append(("mlx-lm", twin))
                    else:
                        print("mlx-lm is not installed: no mlx-lm column")
                except Exception as err:  # noqa: BLE001 - the column is optional
                    print(f"mlx-lm column skipped: {type(err).__name__}: {err}")
            # after the twin took the separate q/k/v and gate/up: ours as the loader makes it
            model.fuse_projections()
            if fmt == "mlx4":  # HF2Q_AFFINE_EXPERTS=q4_1: ours on Q4_1 copies (mlx-lm keeps these)
                swapped = apply_affine_expert_format(model)
                if any(swapped):
                    print(f"ours: MLX 4-bit experts as Q4_1 (modules replaced, kept): {swapped}")
            if fmt == "mlx4" and impls and a.affine_experts_ab:  # a second build, its own arrays
                other = build(shape, fmt, dtype)[0]
                other.fuse_projections()
                swapped = affine_experts_to_q4_1(other)
                print(f"ours-q4_1: MLX 4-bit experts as Q4_1 (modules replaced, kept): {swapped}")
                impls.insert(1, ("ours-q4_1", other))
            single: dict = {}  # per implementation, its 1-stream row
            for n in counts:  # both implementations at each stream count before the next
                for kind, m in impls:
                    if out_of_time():
                        print(f"time cap: {shape} {fmt} {kind} n={n} not run")
                        continue
                    try:
                        if kind.startswith("ours"):
                            compiled = {"auto": None, "compiled": True}.get(a.step, False)
                            r = run_ours(m, n, a.gen, vocab, max_len, compiled, a.prefill_chunk,
                                         kind == "ours-bp")  # fmt: skip
                        else:
                            r = run_mlx_lm(m, n, a.gen, vocab)
                    except Exception as err:  # noqa: BLE001 - report and go on
                        print(f"{shape} {fmt} {kind} n={n}: {type(err).__name__}: {err}")
                        continue
                    r.update(shape=shape, format=fmt)
                    if kind == "ours-q4_1":
                        r["impl"] += " Q4_1 exp"
                    if n == 1:
                        single[kind] = r
                    one = single.get(kind)
                    for key, ratio in (("decode_tok_s", "speedup"),
                                       ("steady_tok_s", "steady_speedup"),
                                       ("itl_p99_ms", "itl_p99_ratio")):  # fmt: skip
                        r[ratio] = r[key] / one[key] if one else float("nan")
                    rows.append(r)
                    print(row_text(r), flush=True)
                    save(out, a.gen, rows)
            del model, impls
            gc.collect()
            mx.clear_cache()
    print("\n" + HEADER + "\n" + "\n".join(row_text(r) for r in rows))
    save(out, a.gen, rows)
    print(f"wrote {out}")
    if mx.cuda.is_available():
        print(f"cuda_cache: {cuda_cache.status()}")


def save(path: str, gen: int, rows: list[dict]) -> None:
    Path(path).write_text(json.dumps({"mlx": mx.__version__, "device": str(mx.default_device()),
                                      "gen": gen, "rows": rows}, indent=1) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
