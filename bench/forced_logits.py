"""A real GGUF's logits along fixed token sequences, on this device, against a saved run's.

    python3 bench/forced_logits.py MODEL.gguf --tokens-from CPU_TOKENS.json [--dtype float32]
                                   [--top 8] [--json OUT.json] [--against OTHER.json]

Greedy continuations part where two paths disagree on a near tie, and after that nothing can
be compared. Here every path reads the same tokens (the greedy ones of ``--tokens-from``, a
``bench/kernels_vs_reference.py`` JSON) and keeps each position's top ``--top`` logits:
"kernels" through the decode step as generation runs it (the CUDA graph on CUDA, the compiled
step elsewhere; the prompt through the model's prefill), and "reference" through the reference
ops (``reference_only``) on per-sequence caches. ``--against`` (this script's JSON from another
device or dtype) prints, per path and prompt, the largest logit difference on the other run's
top ids, the first position whose argmax differs and the other run's top-2 margin there: an
argmax flip inside the logit error is a near tie, one outside it is a bug.
"""

from __future__ import annotations

import argparse
import json
import sys

# isort: off
import hf2q_mlx  # before mlx.core: it routes MLX's CPU matmuls to a fast BLAS
# isort: on

import mlx.core as mx
import numpy as np

from hf2q_mlx.custom_kernels import backend, reference_only
from hf2q_mlx.decode_step import DecodeStep
from hf2q_mlx.generation import encode_prompt, graph_step, make_prompt_cache


def _top(logits: mx.array, k: int) -> dict:
    x = np.array(logits.astype(mx.float32)).reshape(-1)
    ids = np.argsort(-x, kind="stable")[:k]
    return dict(ids=ids.tolist(), logits=[float(v) for v in x[ids]])


def kernel_path(model, ids: list[int], tokens: list[int], k: int) -> list[dict]:
    """Prefill, then one decode per token of ``tokens`` but the last: len(tokens) positions."""
    step = DecodeStep(model, 1, len(ids) + len(tokens) + 8)
    graph = graph_step(step)
    out = [_top(step.prefill(0, ids), k)]
    for t in tokens[:-1]:
        if graph is not None:
            graph.decode([t])
            out.append(_top(graph.last.logits[0], k))
        else:
            out.append(_top(step.decode([t])[0], k))
    return out


def reference_path(model, ids: list[int], tokens: list[int], k: int) -> list[dict]:
    with reference_only():
        cache = make_prompt_cache(model)
        out = [_top(model(mx.array([ids]), cache=cache)[0, -1], k)]
        for t in tokens[:-1]:
            out.append(_top(model(mx.array([[t]]), cache=cache)[0, -1], k))
    return out


def compare(mine: list[dict], other: list[dict]) -> dict:
    """Largest |logit difference| over the other run's top ids (where this run has them too),
    and the first position whose argmax differs with both runs' top-2 margins there."""
    err, first = 0.0, None
    for i, (a, b) in enumerate(zip(mine, other)):
        here = dict(zip(a["ids"], a["logits"]))
        err = max([err] + [abs(here[t] - v) for t, v in zip(b["ids"], b["logits"]) if t in here])
        if first is None and a["ids"][0] != b["ids"][0]:
            first = dict(position=i, ids=(a["ids"][0], b["ids"][0]),
                         margin=a["logits"][0] - a["logits"][1],
                         other_margin=b["logits"][0] - b["logits"][1])  # fmt: skip
    return dict(max_abs_diff=err, first_argmax_difference=first)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--tokens-from", required=True, help="a kernels_vs_reference.py JSON")
    ap.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: load's)")
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--json", default=None)
    ap.add_argument("--against", default=None, help="this script's JSON from another run")
    args = ap.parse_args()
    with open(args.tokens_from) as f:
        rows = json.load(f)["rows"]
    other = None
    if args.against:
        with open(args.against) as f:
            other = json.load(f)
    model, tokenizer = hf2q_mlx.load(args.model, dtype=args.dtype)
    result = dict(model=args.model, backend=backend(), device=str(mx.default_device()),
                  dtype=args.dtype or "default", top=args.top, prompts=[])  # fmt: skip
    for row in rows:
        ids = encode_prompt(tokenizer, row["prompt"])
        tokens = row["kernel_tokens"]
        paths = dict(kernels=kernel_path(model, ids, tokens, args.top),
                     reference=reference_path(model, ids, tokens, args.top))  # fmt: skip
        entry = dict(prompt=row["prompt"], paths=paths, compared={})
        for name, mine in paths.items():
            flips = sum(p["ids"][0] != t for p, t in zip(mine, tokens))
            line = f"{name:9s} {flips:2d} argmax != the forced token | {row['prompt'][:28]!r}"
            if other is not None:
                theirs = next(p for p in other["prompts"] if p["prompt"] == row["prompt"])
                for side in ("kernels", "reference"):
                    c = compare(mine, theirs["paths"][side])
                    entry["compared"][f"{name}_vs_other_{side}"] = c
                    f1 = c["first_argmax_difference"]
                    at = (
                        "none"
                        if f1 is None
                        else (
                            f"pos {f1['position']} margin {f1['margin']:.4f} / other "
                            f"{f1['other_margin']:.4f}"
                        )
                    )
                    line += f" | vs {side}: max diff {c['max_abs_diff']:.4f}, first flip {at}"
            print(line)
        result["prompts"].append(entry)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
