"""Prefill speed at real shapes with random weights: ours (GGML Q4_K and MLX 4-bit) against mlx-lm
0.32.2 on the same MLX 4-bit arrays, in interleaved rounds in one process.

Each round, every variant prefills a fresh random prompt of each ``--prompts`` length into a new
cache (one forward per ``--chunk`` tokens, as ``stream_generate`` does) and is timed to the
evaluated logits of the last token. Environment switches read at call time make extra variants
of ours, e.g. ``--env HF2Q_GDN_PREFILL=chunked`` (Qwen 3.5's delta-net prefill form) or
``--env HF2Q_EXPERT_PREFILL=grouped`` (the routed experts' many-token path). The first call of
each variant is timed separately; the first variant of each model pays the kernel compilation
(issue 15: "the first 512-token prefill under 2 s including compilation"). Prints medians,
min-max and the ratio to mlx-lm round by round; writes JSON.

    python3 bench/prefill.py OUT.json --shapes gemma4:26b-a4b,qwen3_5:35b-a3b,qwen3_5:9b
    python3 bench/prefill.py OUT.json --shapes qwen3_5:9b --env HF2Q_GDN_PREFILL=chunked
    python3 bench/prefill.py OUT.json --tiny --rounds 1          # CPU smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import decode_step as ds  # noqa: E402  (bench/decode_step.py: builders, the mlx-lm twin)

from hf2q_mlx import compile_ahead  # noqa: E402
from hf2q_mlx.custom_kernels import cuda_cache  # noqa: E402
from hf2q_mlx.custom_kernels import expert_matmul as EXM  # noqa: E402
from hf2q_mlx.models import kernel_linears  # noqa: E402

# switches a module reads from the environment once, at import: a variant sets the module's
# attribute too (session 13's `--env HF2Q_EXPERT_PREFILL=dequant32` set only the environment,
# so its "dequant32" rows ran the default path)
IMPORT_TIME = {
    "HF2Q_EXPERT_PREFILL": (EXM, "PREFILL", str),
    "HF2Q_GROUPED_SLICE_COPY": (EXM, "GROUPED_SLICE_COPY", lambda v: v.strip() != "0"),
}


class Variant:
    """A model prefilling prompts into new caches, ``env`` set while it runs (in the environment,
    and in the module attribute of a switch read at import)."""

    def __init__(self, model, env: dict[str, str], chunk: int):
        self.model, self.env, self.chunk = model, env, chunk
        self.ahead = None  # compile_ahead.once's report of the last prefill (its first: a dict)

    def prefill(self, prompt: mx.array) -> float:
        old = {k: os.environ.get(k) for k in self.env}
        attrs = {k: IMPORT_TIME[k] for k in self.env if k in IMPORT_TIME}
        saved = {k: getattr(m, a) for k, (m, a, _) in attrs.items()}
        os.environ.update(self.env)
        for k, (m, a, parse) in attrs.items():
            setattr(m, a, parse(self.env[k]))
        try:
            tic = time.perf_counter()
            self.ahead = compile_ahead_for(self.model, prompt, self.chunk)
            mx.eval(chunked_forward(self.model, prompt, self.chunk, self.model.make_cache()))
            return time.perf_counter() - tic
        finally:
            for k, (m, a, _) in attrs.items():
                setattr(m, a, saved[k])
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def chunked_forward(model, prompt: mx.array, chunk: int, cache, evaluate: bool = True):
    """The last position's logits (1, V) of ``prompt`` (1, n) through chunks into ``cache``;
    ``evaluate``: the caches evaluated per chunk (as stream_generate), else a graph built and
    never run (compile_ahead's dry pass)."""
    n = prompt.shape[1]
    for i in range(0, n, chunk):
        logits = model(prompt[:, i : i + chunk], cache)
        if evaluate and i + chunk < n:
            mx.eval(ds.cache_arrays(cache))
    return logits[:, -1, :]


def compile_ahead_for(model, prompt: mx.array, chunk: int) -> dict | None:
    """``compile_ahead.once`` for a chunked prefill of ``prompt`` (what generation.prefill does
    for its own chunks, so a first prefill here costs what a user's does); mlx-lm's models
    skipped (nothing of ours to compile)."""
    if type(model).__module__.startswith("mlx_lm"):
        return None
    n = prompt.shape[1]
    sizes = tuple(sorted({min(chunk, n - i) for i in range(0, n, chunk)}))
    dry = lambda: chunked_forward(model, prompt, chunk, model.make_cache(), False)  # noqa: E731
    return compile_ahead.once(model, dry, sizes)


def run_shape(name: str, config: dict, a) -> dict:
    vocab = config["vocab_size"]
    variants: dict[str, Variant] = {}
    twin = None
    for fmt in a.formats:
        tic = time.perf_counter()
        model = ds.build(name, config, fmt)
        if fmt == "mlx4" and not a.no_mlx_lm:
            twin = ds.mlx_lm_twin(name, config, model)
        model.fuse_projections()
        kernel_linears.use_kernels(model)  # as generation.prefill with HF2Q_AFFINE_PREFILL=1
        print(f"{name} {fmt}: built in {time.perf_counter() - tic:.1f} s", flush=True)
        variants[f"{fmt}"] = Variant(model, {}, a.chunk)
        for e in a.env:  # NAME=VALUE[,NAME=VALUE...]: one variant with all of them set
            env = dict(kv.partition("=")[::2] for kv in e.split(","))
            variants[f"{fmt} {e}"] = Variant(model, env, a.chunk)
    if twin is not None:
        variants["mlx-lm mlx4"] = Variant(twin, {}, a.chunk)
    key = mx.random.key(1)
    first = {}
    for k, v in variants.items():  # the first prefill: kernels compiled
        key, sub = mx.random.split(key)
        first[k] = v.prefill(mx.random.randint(0, vocab, (1, a.prompts[0]), key=sub))
        print(f"  first {a.prompts[0]}-token prefill, {k}: {first[k]:.2f} s", flush=True)
    rates = {(k, n): [] for k in variants for n in a.prompts}
    for r in range(a.rounds):
        for n in a.prompts:
            key, sub = mx.random.split(key)
            prompt = mx.random.randint(0, vocab, (1, n), key=sub)
            for k, v in variants.items():
                rates[(k, n)].append(n / v.prefill(prompt))
        print(f"{name} round {r}: " + ", ".join(
            f"{k}@{n} {rs[-1]:.0f}" for (k, n), rs in rates.items()), flush=True)  # fmt: skip
    out = {"shape": name, "chunk": a.chunk, "first_prefill_s": first, "rows": []}
    for (k, n), rs in rates.items():
        row = {"variant": k, "prompt": n, "tok_s": rs, "median": statistics.median(rs),
               "min": min(rs), "max": max(rs)}  # fmt: skip
        ref = rates.get(("mlx-lm mlx4", n))
        if ref:
            row["ratio_to_mlx_lm_median"] = statistics.median(x / y for x, y in zip(rs, ref))
        out["rows"].append(row)
    del variants, twin
    gc.collect()
    mx.clear_cache()
    return out


def report(res: dict) -> None:
    print(f"\n{res['shape']}: prefill tok/s (chunks of {res['chunk']}), interleaved rounds")
    for r in res["rows"]:
        ratio = r.get("ratio_to_mlx_lm_median")
        ratio = f"  x{ratio:.2f} mlx-lm" if ratio is not None else ""
        print(f"  {r['variant']:<40} @{r['prompt']:<5} {r['median']:9.0f}  "
              f"[{r['min']:.0f}-{r['max']:.0f}]{ratio}")  # fmt: skip
    for k, s in res["first_prefill_s"].items():
        print(f"  first prefill (compiles) {k}: {s:.2f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="JSON file to write")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
    p.add_argument("--shapes", default=None, help="comma list of family:shape")
    p.add_argument("--formats", default="q4_k,mlx4")
    p.add_argument("--prompts", default="512,2048", help="comma list of prompt lengths")
    p.add_argument("--chunk", type=int, default=2048, help="tokens per forward")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--env", action="append", default=[], help="NAME=VALUE[,NAME=VALUE...]: one "
                   "more variant of each format with these environment switches set")  # fmt: skip
    p.add_argument("--no-mlx-lm", action="store_true")
    a = p.parse_args()
    a.formats = a.formats.split(",")
    a.prompts = [int(x) for x in a.prompts.split(",")]
    for e in a.env:
        if any("=" not in kv for kv in e.split(",")):
            p.error(f"--env {e!r}: expected NAME=VALUE[,NAME=VALUE...]")
    table = ds.configs(a.tiny)
    names = a.shapes.split(",") if a.shapes else list(table)
    results = []
    for name in names:
        if name not in table:
            p.error(f"unknown shape {name!r}: one of {', '.join(table)}")
        results.append(run_shape(name, table[name], a))
        report(results[-1])
        Path(a.out).write_text(json.dumps({"device": str(mx.default_device()),
                                           "results": results}, indent=1))  # fmt: skip
    print(f"cuda_cache: {cuda_cache.status()}")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
