"""MLX's own settings in our decode: one worker process per environment, interleaved rounds.

MLX reads ``MLX_MAX_OPS_PER_BUFFER``, ``MLX_MAX_MB_PER_BUFFER``, ``MLX_USE_CUDA_GRAPHS``,
``MLX_CUDA_GRAPH_CACHE_SIZE`` and ``MLX_BFS_MAX_WIDTH`` once per process, so each setting gets a
worker of its own: it builds the shape's random weights (bench/decode_step.py's builders), fuses
the projections, prefills a random prompt into a one-row ``DecodeStep`` (compiled on a GPU;
``--step graph``: replayed as one CUDA graph a token, CUDA's default decode) and waits. The
parent then asks every worker in turn, round after round, for ``--tokens`` greedy tokens (each
launched before the last is read, as speed_table.py times them), so a slow minute of the shared
host hits every setting alike. Only one worker runs at a time; all of them hold
their weights at once (26B-A4B Q4_K: ~16 GB each).

Prints per setting the median [min-max] tok/s, the spread and the ratio to the first setting
taken round by round; writes JSON.

    python3 bench/mlx_env_ab.py OUT.json --shape gemma4:26b-a4b \
        --env "" --env MLX_MAX_OPS_PER_BUFFER=250 --env MLX_USE_CUDA_GRAPHS=0
    python3 bench/mlx_env_ab.py OUT.json --tiny --env "" --env MLX_BFS_MAX_WIDTH=1   # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import statistics
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent


def parse_env(text: str) -> dict[str, str]:
    """ "A=1,B=2" -> {"A": "1", "B": "2"}; "" -> {} (MLX's defaults). A comma starts a new
    setting only before NAME=, so a value may hold commas ("HF2Q_EXPERT_RUN=2,1,1")."""
    out = {}
    parts = re.split(r",(?=\s*[A-Za-z_][A-Za-z0-9_]*=)", text)
    for part in filter(None, (p.strip() for p in parts)):
        name, eq, value = part.partition("=")
        if not eq or not name:
            raise ValueError(f"--env {text!r}: expected NAME=VALUE[,NAME=VALUE]")
        out[name] = value
    return out


def worker(
    conn, env: dict[str, str], shape: str, fmt: str, tiny: bool, prompt: int, step: str
) -> None:
    """Build, prefill, then serve ("decode", n) -> seconds until ("quit",)."""
    os.environ.update(env)  # before MLX is imported: spawn gives this process a fresh one
    sys.path.insert(0, str(BENCH))
    sys.path.insert(0, str(BENCH.parent))
    try:
        import decode_step as ds
        import mlx.core as mx

        from hf2q_mlx.generation import decode_mode

        config = ds.configs(tiny)[shape]
        model = ds.build(shape, config, fmt)
        model.fuse_projections()
        import speed_table as st

        if step == "graph":  # the CUDA default: the step replayed as one CUDA graph a token
            variant = st.GraphVariant(model, 2048, prompt + 4096)
        else:
            variant = st.Variant(model, decode_mode() in ("compiled", "graph"), 2048, prompt + 4096)
        ids = mx.random.randint(0, config["vocab_size"], (1, prompt), key=mx.random.key(3))
        variant.prefill(ids.astype(mx.int32))
        variant.decode(4)  # traces and kernel builds before the first timed round
        seen = {k: os.environ.get(k) for k in env}
        conn.send(("ready", f"{mx.default_device()}, {seen}"))
        while True:
            msg = conn.recv()
            if msg[0] != "decode":
                break
            conn.send(("ok", variant.decode(msg[1])))
    except Exception as e:  # the parent reports it and goes on without this setting
        conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        conn.close()


def run(a) -> dict:
    ctx = mp.get_context("spawn")
    settings = [(text or "default", parse_env(text)) for text in a.env]
    workers, ready = [], {}
    for label, env in settings:
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=worker, args=(child, env, a.shape, a.format, a.tiny, a.prompt, a.step)
        )
        proc.start()
        tic = time.perf_counter()
        kind, info = parent.recv()
        print(f"{label}: {kind} in {time.perf_counter() - tic:.1f} s ({info})", flush=True)
        ready[label] = info
        if kind == "ready":
            workers.append((label, parent, proc))
        else:
            proc.join()
    rates: dict[str, list[float]] = {label: [] for label, _, _ in workers}
    start = time.perf_counter()
    for r in range(a.rounds):
        if a.time_cap and time.perf_counter() - start > a.time_cap:
            print(f"time cap: stopped after {r} rounds", flush=True)
            break
        for label, conn, _ in workers:
            conn.send(("decode", a.tokens))
            kind, seconds = conn.recv()
            rates[label].append(a.tokens / seconds)
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in rates.items()), flush=True)
    for _, conn, proc in workers:
        conn.send(("quit",))
        proc.join(timeout=60)
    rows = {}
    base = rates[workers[0][0]] if workers else []
    for label, xs in rates.items():
        if not xs:
            continue
        med = statistics.median(xs)
        ratios = [x / b for x, b in zip(xs, base)]
        rows[label] = {"tok_s": xs, "median": med, "min": min(xs), "max": max(xs),
                       "spread": (max(xs) - min(xs)) / med,
                       "ratio_median": statistics.median(ratios), "ratios": ratios}  # fmt: skip
    return {"shape": a.shape, "format": a.format, "tokens": a.tokens, "prompt": a.prompt,
            "step": a.step, "workers": ready, "settings": rows}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="JSON file to write")
    p.add_argument("--shape", default="gemma4:26b-a4b")
    p.add_argument("--format", default="q4_k", choices=["q4_k", "mlx4"])
    p.add_argument(
        "--env",
        action="append",
        default=None,
        help='a setting: "NAME=VALUE[,NAME=VALUE]"; "" = the environment as is',
    )
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--time-cap", type=float, default=None, help="start no round past this (s)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
    p.add_argument(
        "--step",
        choices=["compiled", "graph"],
        default="compiled",
        help="decode through the compiled DecodeStep (on a GPU; eager on the CPU) or the CUDA "
        "graph over it (CUDA only; the default decode there)",
    )
    a = p.parse_args()
    a.env = a.env or [""]
    try:
        for text in a.env:
            parse_env(text)
    except ValueError as e:
        p.error(str(e))
    if a.tiny and a.shape == "gemma4:26b-a4b":
        a.shape = "gemma4:tiny-moe"
    res = run(a)
    print(f"\n{a.shape} {a.format}, {a.step} step: decode tok/s, {a.tokens} tokens a round")
    for label, s in res["settings"].items():
        print(f"  {label:40} {s['median']:8.1f} [{s['min']:.1f}-{s['max']:.1f}]  spread "
              f"{s['spread']:.0%}  x first {s['ratio_median']:.2f} "
              f"[{min(s['ratios']):.2f}-{max(s['ratios']):.2f}]")  # fmt: skip
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
