"""TurboQuant KV-cache quality on a real model: perplexity, KL, logit cosine, top-1 flips.

A text (default tests/data/us_constitution.txt; `--text`, e.g. bench/data/inspect_py311.txt for
the code models) is cut to its first `--tokens` tokens (+1 for the last target) and fed through the
model in chunks, teacher-forced, once with full-precision caches and once per TurboQuant setting,
in lockstep: every chunk's queries attend the cache as it was written (quantized for TQ; the
chunk's own keys too), so the numbers measure the quantized cache, not a fresh prefill. Prints a
table, then the same as JSON (also written to `--json` after every chunk, with `tokens_done`, so an
interrupted run leaves its partial sums). Also: bytes per token per layer and the total at 32K
context for a Gemma-4-26B-A4B-shaped model (computed, no weights needed).

    python bench/turboquant_quality.py [--model gemma3-270m | qwen2.5-coder-0.5b | PATH]
        [--text FILE] [--tokens 4096] [--chunk 512] [--json out.json]
        [--settings TQ4,TQ8] [--seed 0] [--center 32768 | 0] [--no-balance]

The GGUF's quantized weights are dequantized to fp32 once here (the reference matmuls would
otherwise dequantize every weight on every call, which is far too slow on a CPU); the baseline and
every setting run these same fp32 weights, so only the cache differs. On Linux CPUs MLX's wheel
links the reference BLAS: run with
LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 (~30x faster fp32 matmuls).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

# isort: off
import hf2q_mlx  # before mlx.core: it routes MLX's CPU matmuls to a fast BLAS
# isort: on

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from hf2q_mlx.custom_kernels.dequant import dequantize_reference
from hf2q_mlx.models.quantized import GGMLEmbedding, GGMLLinear
from hf2q_mlx.models.turboquant.cache import make_tq_cache
from hf2q_mlx.models.turboquant.codec import CENTER_CONTEXT, TQCodec, lloyd_max_distortion

TEXT = Path(__file__).resolve().parents[1] / "tests" / "data" / "us_constitution.txt"
# (label, k_bits, v_bits); None = the full-precision baseline
SETTINGS = [("TQ8", 8, 8), ("TQ6", 6, 6), ("TQ5", 5, 5), ("TQ4", 4, 4), ("TQ3", 3, 3),
            ("K8V4", 8, 4), ("K4V4", 4, 4), ("K6V5", 6, 5), ("K6V4", 6, 4), ("K8V5", 8, 5),
            ("K5V4", 5, 4)]  # fmt: skip


def densify(module: nn.Module) -> None:
    """Replace every GGML layer by an fp32 nn layer holding the dequantized weight, in place."""
    for key, child in module.children().items():
        items = list(enumerate(child)) if isinstance(child, list) else [(key, child)]
        for k, c in items:
            if isinstance(c, GGMLLinear):
                new = nn.Linear(c.in_features, c.out_features, bias="bias" in c)
                new.weight = dequantize_reference(c.weight, c.ggml_type, c.in_features)
                if "bias" in c:
                    new.bias = c.bias
            elif isinstance(c, GGMLEmbedding):
                new = nn.Embedding(c.num_embeddings, c.dims)
                new.weight = dequantize_reference(c.weight, c.ggml_type, c.dims)
            else:
                if isinstance(c, nn.Module):
                    densify(c)
                continue
            mx.eval(new.parameters())
            if isinstance(child, list):
                child[k] = new
            else:
                setattr(module, k, new)


def chunk_stats(base: mx.array, logits: mx.array, targets: mx.array) -> dict[str, float]:
    """Sums over a chunk: NLL of the targets, cosine to the baseline logits, top-1 flips, and
    KL(baseline || this) of the next-token distributions (less noisy than the NLL's change)."""
    logp = logits - mx.logsumexp(logits, -1, keepdims=True)
    logp_base = base - mx.logsumexp(base, -1, keepdims=True)
    nll = -mx.take_along_axis(logp, targets[:, None], -1)[:, 0]
    kl = mx.sum(mx.exp(logp_base) * (logp_base - logp), -1)
    cos = mx.sum(base * logits, -1) / (
        mx.linalg.norm(base, axis=-1) * mx.linalg.norm(logits, axis=-1)
    )
    flips = mx.argmax(base, -1) != mx.argmax(logits, -1)
    return {
        "nll": nll.sum().item(), "kl": kl.sum().item(), "cos": cos.sum().item(),
        "flips": flips.sum().item(),
    }  # fmt: skip


def summarize(sums: dict, caches: dict, n: int) -> dict:
    """Per-cache rows from the running sums over the first ``n`` predicted tokens."""
    ppl_full = float(mx.exp(mx.array(sums["full"]["nll"] / n)).item())
    rows = {}
    for name, s in sums.items():
        ppl = float(mx.exp(mx.array(s["nll"] / n)).item())
        rows[name] = {
            "ppl": ppl,
            "ppl_delta": ppl - ppl_full,
            "ppl_delta_pct": 100 * (ppl / ppl_full - 1),
            "kl": s["kl"] / n,
            "logit_cosine": s["cos"] / n,
            "top1_flip_rate": s["flips"] / n,
            "cache_bytes": sum(c.nbytes for c in caches[name]),
        }
    return rows


def quality(model, ids: list[int], chunk: int, settings=SETTINGS, on_chunk=None, **tq_options):
    """``tq_options`` go to every ``make_tq_cache`` (seed, balance, center); ``on_chunk(rows,
    done)`` gets the partial rows after every chunk."""
    caches = {"full": model.make_cache()}
    for label, kb, vb in settings:
        caches[label] = make_tq_cache(model, kb, vb, **tq_options)
    sums = {name: {"nll": 0.0, "kl": 0.0, "cos": 0.0, "flips": 0.0} for name in caches}
    n = len(ids) - 1
    for start in range(0, n, chunk):
        t0 = time.perf_counter()
        x = mx.array([ids[start : min(start + chunk, n)]], mx.int32)
        targets = mx.array(ids[start + 1 : min(start + chunk, n) + 1], mx.int32)
        base = model(x, cache=caches["full"])[0].astype(mx.float32)
        mx.eval(base)
        for name, cache in caches.items():
            logits = base if name == "full" else model(x, cache=cache)[0].astype(mx.float32)
            for k, v in chunk_stats(base, logits, targets).items():
                sums[name][k] += v
        done = start + x.shape[1]
        print(f"  {done}/{n} tokens ({time.perf_counter() - t0:.0f} s)", flush=True)
        if on_chunk is not None:
            on_chunk(summarize(sums, caches, done), done)
    return summarize(sums, caches, n)


FIT_MIN_KEY_BITS = 5  # 4-bit keys leave the small-error regime on Qwen2.5-Coder 0.5B (docs)


def rate_distortion(rows: dict) -> dict:
    """Where the codec sits against the Gaussian rate-distortion bound.

    Fits KL ~ a_K D(k_bits) + a_V D(v_bits) (D = the Lloyd-Max distortion per coordinate,
    ``lloyd_max_distortion``) to the measured settings with keys of FIT_MIN_KEY_BITS or more,
    least squares on the relative error (``kl_over_fit``: every setting's measured KL over the
    fit's, > 1 where the small-error law breaks down, as for 4-bit keys on Qwen2.5-Coder 0.5B); a
    quantizer at the bound has D = 2^-2R at R bits, so at R bits on average it would reach
    (a_K + a_V) 2^-2R with K = V and 2 sqrt(a_K a_V) 2^-2R with the best K/V split.
    ``bits_at_bound_for[label]``: the average bits per coordinate the bound needs (best split)
    for that setting's measured KL.
    """
    labels = {s[0]: (s[1], s[2]) for s in SETTINGS}
    fit = [
        (labels[n], r["kl"])
        for n, r in rows.items()
        if n in labels and r["kl"] > 0 and labels[n][0] >= FIT_MIN_KEY_BITS
    ]
    if len(fit) < 2:
        return {}
    d = {b: lloyd_max_distortion(b) for b in {b for n in rows if n in labels for b in labels[n]}}
    a = np.array([[d[kb] / kl, d[vb] / kl] for (kb, vb), kl in fit])
    (a_k, a_v), *_ = np.linalg.lstsq(a, np.ones(len(fit)), rcond=None)
    a_k, a_v = max(a_k, 1e-9), max(a_v, 1e-9)
    pred = {n: a_k * d[labels[n][0]] + a_v * d[labels[n][1]] for n in rows if n in labels}
    split = 2 * np.sqrt(a_k * a_v)
    return {
        "a_k": float(a_k), "a_v": float(a_v), "key_share": float(a_k / (a_k + a_v)),
        "fit_on": sorted(n for n in pred if labels[n][0] >= FIT_MIN_KEY_BITS),
        "kl_fit": {n: float(v) for n, v in pred.items()},
        "kl_over_fit": {n: float(rows[n]["kl"] / v) for n, v in pred.items()},
        "kl_bound": {f"{r} bits": float((a_k + a_v) * 2.0 ** (-2 * r)) for r in (4, 5, 6)},
        "kl_bound_best_split": {f"{r} bits": float(split * 2.0 ** (-2 * r)) for r in (4, 5, 6)},
        "bits_at_bound_for": {
            n: float(0.5 * np.log2(split / rows[n]["kl"])) for n in pred if rows[n]["kl"] > 0
        },
    }  # fmt: skip


def print_rate_distortion(rd: dict) -> None:
    if not rd:
        return
    print(f"\nKL ~ a_K D(k) + a_V D(v): a_K {rd['a_k']:.2f}, a_V {rd['a_v']:.2f} "
          f"(keys carry {100 * rd['key_share']:.0f} % at equal bits)")  # fmt: skip
    print(f"fitted on {', '.join(rd['fit_on'])}; measured KL / fit: " + ", ".join(
        f"{n} {r:.2f}" for n, r in rd["kl_over_fit"].items()
    ))  # fmt: skip
    print("KL at the Gaussian rate-distortion bound (K = V / best split): " + ", ".join(
        f"{k} {v:.5f} / {rd['kl_bound_best_split'][k]:.5f}" for k, v in rd["kl_bound"].items()
    ))  # fmt: skip
    print("bits per coordinate the bound needs for each setting's KL: " + ", ".join(
        f"{n} {b:.2f}" for n, b in rd["bits_at_bound_for"].items()
    ))  # fmt: skip


def memory_table(context: int = 32768) -> dict:
    """Bytes per token per layer and the total at ``context`` tokens, Gemma-4-26B-A4B shape.

    30 layers: 25 sliding (window 1024, 8 KV heads, head_dim 256) and 5 global (2 KV heads,
    head_dim 512, K = V in the checkpoint but both cached after their norms/RoPE).
    """
    sliding = dict(layers=25, heads=8, dim=256, window=1024)
    glob = dict(layers=5, heads=2, dim=512, window=None)
    out = {}
    for label, kb, vb in [("bf16", None, None)] + SETTINGS:  # bf16 = fp16 = 2 bytes
        per_layer, total = {}, 0
        for name, g in (("sliding", sliding), ("global", glob)):
            if kb is None:
                per_tok = 2 * g["heads"] * g["dim"] * 2
            else:
                k, v = TQCodec(g["dim"], kb), TQCodec(g["dim"], vb)
                per_tok = g["heads"] * (k.bytes_per_vector() + v.bytes_per_vector())
            per_layer[name] = per_tok
            tokens = context if g["window"] is None else min(context, g["window"])
            total += g["layers"] * tokens * per_tok
        out[label] = {"bytes_per_token_per_layer": per_layer, f"total_bytes_{context}": total}
    return out


def print_rows(rows: dict) -> None:
    head = f"{'cache':6} {'ppl':>8} {'d ppl':>8} {'d %':>7} {'KL':>8} {'cos':>9} {'top1 flip':>9}"
    print(head + f" {'KV MB':>7}")
    for name, r in rows.items():
        print(
            f"{name:6} {r['ppl']:8.3f} {r['ppl_delta']:+8.3f} {r['ppl_delta_pct']:+7.2f} "
            f"{r['kl']:8.5f} {r['logit_cosine']:9.6f} {r['top1_flip_rate']:9.4f} "
            f"{r['cache_bytes'] / 1e6:7.2f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model", default=None,
        help="a name from `hf2q-mlx models` or a GGUF path (default: the Gemma 3 270M package)",
    )  # fmt: skip
    ap.add_argument("--text", default=str(TEXT), help=f"text file (default {TEXT.name})")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--settings", default=None, help="comma list of labels (default: all)")
    ap.add_argument("--json", default=None, help="also write the results here (after each chunk)")
    ap.add_argument(
        "--no-balance", action="store_true", help="without the per-channel balancing (TQBalance)"
    )
    ap.add_argument("--seed", type=int, default=0, help="rotation seed (layer i gets seed + i)")
    ap.add_argument(
        "--center", type=int, default=CENTER_CONTEXT,
        help=f"key offset's context in positions, 0 = no offset (default {CENTER_CONTEXT})",
    )  # fmt: skip
    ap.add_argument(
        "--analyze", default=None, metavar="JSON",
        help="print the table and rate-distortion fit of a saved result, run nothing",
    )  # fmt: skip
    args = ap.parse_args()
    if args.analyze:
        saved = json.loads(Path(args.analyze).read_text())
        print({k: v for k, v in saved.items() if k not in ("quality", "memory_gemma4_26b_a4b")})
        print_rows(saved["quality"])
        print_rate_distortion(rate_distortion(saved["quality"]))
        return

    t0 = time.perf_counter()
    model, tokenizer = hf2q_mlx.load(args.model, dtype="float32")
    densify(model)
    ids = tokenizer.encode(Path(args.text).read_text())[: args.tokens + 1]
    if len(ids) < args.tokens + 1:
        raise SystemExit(f"the text has only {len(ids)} tokens")
    picked = args.settings.split(",") if args.settings else [s[0] for s in SETTINGS]
    unknown = set(picked) - {s[0] for s in SETTINGS}
    if unknown:
        raise SystemExit(f"unknown settings {sorted(unknown)}; known: {[s[0] for s in SETTINGS]}")
    picked = [s for s in SETTINGS if s[0] in picked]
    opts = dict(seed=args.seed, balance=not args.no_balance, center=args.center)
    model_name = args.model or "gemma3-270m"
    meta = {"model": model_name, "text": Path(args.text).name, "tokens": args.tokens,
            "chunk": args.chunk, **opts}  # fmt: skip

    def save(rows: dict, done: int) -> None:
        if args.json:
            out = {
                **meta,
                "tokens_done": done,
                "seconds": time.perf_counter() - t0,
                "quality": rows,
            }
            Path(args.json).write_text(json.dumps(out, indent=1))

    rows = quality(model, ids, args.chunk, picked, on_chunk=save, **opts)
    mem = memory_table()
    elapsed = time.perf_counter() - t0

    print(f"\n{model_name}, {meta['text']}, {args.tokens} tokens, chunks of {args.chunk} "
          f"({elapsed:.0f} s)")  # fmt: skip
    print(f"options: {opts}")
    print_rows(rows)
    rd = rate_distortion(rows)
    print_rate_distortion(rd)
    print("\nGemma-4-26B-A4B-shaped KV cache (bytes/token/layer; total at 32K context)")
    for label, m in mem.items():
        pl = m["bytes_per_token_per_layer"]
        print(f"{label:6} sliding {pl['sliding']:6d}  global {pl['global']:6d}  "
              f"total {m['total_bytes_32768'] / 2**20:8.1f} MiB")  # fmt: skip
    result = {**meta, "tokens_done": args.tokens, "seconds": elapsed, "quality": rows,
              "rate_distortion": rd, "memory_gemma4_26b_a4b": mem}  # fmt: skip
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
