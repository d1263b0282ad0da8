"""llama.cpp as the peer on the very same GGUF: llama-bench's prefill (pp) and decode (tg)
tokens/s next to ours, in interleaved rounds, with the ratios.

The GGUF is a random-weight file at a benchmark shape (bench/random_gguf.py, ``--shape``) or
any file (``--gguf``). Per round: one ``llama-bench -o json`` call (``--reps`` repetitions of
pp and tg, after its own warm-up), then ours on the same file, loaded once with
``hf2q_mlx.load``: prefill of a ``--prompt``-token random prompt in one forward (timed to the
evaluated last logits and caches) and ``--gen`` greedy tokens through the decode step
generation uses (the CUDA graph on CUDA, else the compiled ``DecodeStep``) after a one-token
prompt, as llama-bench's tg starts from an empty context. Prints medians, the ratio ours /
llama.cpp and writes JSON.

    # CPU (bundle unpacked: tar -xJf /work/shared/peers/llama-cpu-x86_64.tar.xz -C /tmp/llama-cpu)
    python3 bench/llama_peer.py OUT.json --shape qwen3_5:tiny --llama /tmp/llama-cpu/bin \\
        --prompt 32 --gen 8 --threads 2
    # H200 (CUDA bundle unpacked into /tmp/peer)
    python3 bench/llama_peer.py OUT.json --shape gemma4:26b-a4b --llama /tmp/peer/cuda/run.sh
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import random_gguf  # noqa: E402  (bench/random_gguf.py)

from hf2q_mlx.errors import Hf2qError  # noqa: E402


class LlamaPeerError(Hf2qError):
    """llama-bench could not be found or did not report what was asked."""


def llama_bench_command(llama: str) -> tuple[list[str], dict[str, str]]:
    """(command prefix, extra environment): a bin folder holding llama-bench (the CPU bundle)
    or a wrapper script run as ``wrapper llama-bench ...`` (the CUDA bundle's run.sh)."""
    p = Path(llama)
    if p.is_dir():
        exe = p / "llama-bench"
        if not exe.is_file():
            raise LlamaPeerError(f"{p}: no llama-bench in this folder")
        ld = os.pathsep.join(filter(None, [str(p), os.environ.get("LD_LIBRARY_PATH")]))
        return [str(exe)], {"LD_LIBRARY_PATH": ld}
    if p.is_file():
        return [str(p), "llama-bench"], {}
    raise LlamaPeerError(f"{llama}: neither a llama.cpp bin folder nor a wrapper script")


def run_llama_bench(
    llama: str, gguf: str | Path, prompt: int, gen: int, reps: int = 3, extra: list[str] = ()
) -> dict:
    """``llama-bench -o json`` on ``gguf``: {"pp_tok_s", "tg_tok_s", samples, the records}."""
    prefix, env = llama_bench_command(llama)
    cmd = [*prefix, "-m", str(gguf), "-p", str(prompt), "-n", str(gen), "-r", str(reps),
           "-o", "json", *extra]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env})
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise LlamaPeerError(f"llama-bench failed ({proc.returncode}): {' | '.join(tail)}")
    try:
        records = json.loads(proc.stdout)
    except json.JSONDecodeError:
        raise LlamaPeerError(f"llama-bench printed no JSON: {proc.stdout[:200]!r}") from None
    out = {"command": cmd, "records": records}
    for r in records:
        kind = "pp" if r["n_gen"] == 0 else "tg"
        out[f"{kind}_tok_s"] = r["avg_ts"]
        out[f"{kind}_samples"] = r["samples_ts"]
    if "pp_tok_s" not in out or "tg_tok_s" not in out:
        raise LlamaPeerError(f"llama-bench reported no pp/tg rows: {records}")
    return out


class Ours:
    """hf2q_mlx on the same GGUF: eager one-forward prefill, greedy decode as generation runs
    it: through the CUDA graph step on CUDA (``generation.graph_step``; ``HF2Q_DECODE=compiled``
    opts out), else the compiled step."""

    def __init__(self, path: str | Path, prompt: int, gen: int):
        import hf2q_mlx
        from hf2q_mlx.decode_step import DecodeStep
        from hf2q_mlx.generation import graph_step

        self.model, _ = hf2q_mlx.load(path)
        self.vocab = self.model.args.vocab_size
        self.prompt, self.gen = prompt, gen
        self.step = DecodeStep(self.model, max_batch=1, max_len=gen + 8)
        self.graph = graph_step(self.step)
        print(f"ours: decode through the {'CUDA graph' if self.graph else 'compiled'} step")
        self.round = 0
        self.decode_s()  # traces the compiled step at every span the timed runs reach
        self.prefill_s()  # first prefill builds the kernels: kept out of the timing

    def _cache_arrays(self, cache: list) -> list:
        import qwen3_5 as q35bench  # bench/qwen3_5.py: the K/V and recurrent state arrays

        return q35bench.cache_arrays(cache)

    def prefill_s(self) -> float:
        self.round += 1
        ids = mx.random.randint(0, self.vocab, (1, self.prompt), key=mx.random.key(self.round))
        mx.eval(ids)
        cache = self.model.make_cache()
        tic = time.perf_counter()
        logits = self.model(ids, cache)
        mx.eval(logits[:, -1, :], self._cache_arrays(cache))
        return time.perf_counter() - tic

    def decode_s(self) -> float:
        cache = self.model.make_cache()
        y = mx.argmax(self.model(mx.array([[1]], mx.int32), cache)[:, -1, :], axis=-1)
        mx.eval(y, self._cache_arrays(cache))
        self.step.adopt(0, cache)
        if self.graph is not None:  # one replay per token, the host reads each token id
            t = int(y.item())
            tic = time.perf_counter()
            for _ in range(self.gen):
                t = self.graph.decode([t])[0]
            return time.perf_counter() - tic
        y = y.astype(mx.int32)
        out = []
        tic = time.perf_counter()
        for _ in range(self.gen):
            y = self.step.decode(y, greedy=True)
            mx.async_eval(y)  # the next step's graph is built while this one runs
            out.append(y)
        mx.eval(out)
        return time.perf_counter() - tic


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def run(gguf: Path, a) -> dict:
    extra = list(a.llama_args.split()) if a.llama_args else []
    if a.threads:
        extra += ["-t", str(a.threads)]
    if a.ngl is not None:
        extra += ["-ngl", str(a.ngl)]
    tic = time.perf_counter()
    ours = Ours(gguf, a.prompt, a.gen)
    load_s = time.perf_counter() - tic
    rounds = []
    for r in range(a.rounds):
        mx.clear_cache()  # our freed buffers back to the device before llama.cpp allocates
        peer = run_llama_bench(a.llama, gguf, a.prompt, a.gen, a.reps, extra)
        pre = [ours.prefill_s() for _ in range(a.reps)]
        dec = [ours.decode_s() for _ in range(a.reps)]
        row = {
            "llama_pp_tok_s": peer["pp_tok_s"],
            "llama_tg_tok_s": peer["tg_tok_s"],
            "llama_pp_samples": peer["pp_samples"],
            "llama_tg_samples": peer["tg_samples"],
            "ours_pp_tok_s": a.prompt / median(pre),
            "ours_tg_tok_s": a.gen / median(dec),
            "ours_pp_samples": [a.prompt / s for s in pre],
            "ours_tg_samples": [a.gen / s for s in dec],
        }
        row["pp_ratio"] = row["ours_pp_tok_s"] / row["llama_pp_tok_s"]
        row["tg_ratio"] = row["ours_tg_tok_s"] / row["llama_tg_tok_s"]
        rounds.append(row)
        print(f"round {r + 1}: prefill pp{a.prompt} ours {row['ours_pp_tok_s']:.1f} / llama.cpp "
              f"{row['llama_pp_tok_s']:.1f} tok/s = {row['pp_ratio']:.3f}x; decode tg{a.gen} "
              f"ours {row['ours_tg_tok_s']:.2f} / llama.cpp {row['llama_tg_tok_s']:.2f} tok/s "
              f"= {row['tg_ratio']:.3f}x", flush=True)  # fmt: skip
    summary = {k: median([r[k] for r in rounds]) for k in (
        "ours_pp_tok_s", "llama_pp_tok_s", "pp_ratio", "ours_tg_tok_s", "llama_tg_tok_s",
        "tg_ratio")}  # fmt: skip
    return {"gguf": str(gguf), "ours_load_s": load_s, "llama_command": peer["command"],
            "llama_records": peer["records"], "rounds": rounds, "median": summary}  # fmt: skip


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", help="output JSON path")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--shape", help="write a random GGUF of family:shape (random_gguf.py)")
    src.add_argument("--gguf", help="an existing GGUF file")
    p.add_argument(
        "--llama",
        required=True,
        help="llama.cpp bin folder (CPU bundle) or wrapper script (cuda/run.sh)",
    )
    p.add_argument("--prompt", type=int, default=512, help="prefill tokens (llama-bench -p)")
    p.add_argument("--gen", type=int, default=128, help="decode tokens (llama-bench -n)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=3, help="repetitions per round, both engines")
    p.add_argument("--threads", type=int, default=None, help="llama-bench -t (CPU)")
    p.add_argument("--ngl", type=int, default=None, help="llama-bench -ngl (99 on a GPU)")
    p.add_argument("--llama-args", default="", help="more llama-bench arguments, e.g. '-fa on'")
    p.add_argument("--out-dir", default=None, help="where --shape writes its GGUF (default tmp)")
    p.add_argument("--keep", action="store_true", help="keep the written GGUF")
    a = p.parse_args(argv)
    print(f"mlx {mx.__version__} on {mx.default_device()}")
    written = None
    if a.shape:
        d = a.out_dir or tempfile.gettempdir()
        written = Path(d) / f"random_{a.shape.replace(':', '_')}.gguf"
        tic = time.perf_counter()
        info = random_gguf.write_random_gguf(a.shape, written)
        print(f"wrote {written} ({info['bytes'] / 1e9:.2f} GB) in "
              f"{time.perf_counter() - tic:.0f} s", flush=True)  # fmt: skip
        gc.collect()
        mx.clear_cache()
    gguf = written or Path(a.gguf)
    try:
        res = run(gguf, a)
    finally:
        if written is not None and not a.keep:
            written.unlink(missing_ok=True)
    res.update(shape=a.shape, prompt=a.prompt, gen=a.gen, device=str(mx.default_device()),
               mlx=mx.__version__)  # fmt: skip
    m = res["median"]
    print(f"\nmedian over {a.rounds} rounds ({a.shape or gguf}):")
    print(f"  prefill pp{a.prompt}: ours {m['ours_pp_tok_s']:.1f}  llama.cpp "
          f"{m['llama_pp_tok_s']:.1f} tok/s  ratio {m['pp_ratio']:.3f}")  # fmt: skip
    print(f"  decode  tg{a.gen}: ours {m['ours_tg_tok_s']:.2f}  llama.cpp "
          f"{m['llama_tg_tok_s']:.2f} tok/s  ratio {m['tg_ratio']:.3f}")  # fmt: skip
    Path(a.json).write_text(json.dumps(res, indent=1))
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
