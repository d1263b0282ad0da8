"""Issue 15's table in one command: decode and prefill of ours (GGML Q4_K and MLX 4-bit) and
mlx-lm 0.32.2 on the same MLX 4-bit arrays, per real shape with random weights, in interleaved
rounds in one process, with what a decode token costs the host and the GPU.

Per shape, every round: a fresh random prompt of ``--prompt`` tokens, which each variant
prefills into a new cache (one forward per ``--chunk`` tokens, as ``stream_generate`` does;
timed to the evaluated last logits), then ``--tokens`` greedy tokens decoded from that cache
(ours through the compiled ``DecodeStep`` on a GPU, the eager per-sequence graph on the CPU;
mlx-lm eagerly, as its ``generate`` does). Where ``stream_generate`` decodes through the CUDA
graph step (``HF2Q_DECODE`` auto or graph on CUDA), each format also runs as that graph
(``--graph auto``, the default; its rows are what a user gets there).
The variants take turns within a round, so a slow minute of the shared host hits all of them.
Then, once per variant, ``--profile-steps`` more decode tokens: host time per token in the
step's Python call (graph building, or the compiled call) and in MLX's ``async_eval``, and
under CUPTI (torch.profiler, where torch with CUDA is installed) the GPU kernels per token
(and per layer), their summed time and the GPU-busy share (kernel time / wall time).

Prints per shape: median [min-max] decode and prefill tok/s, the ratio to mlx-lm taken round
by round (median [min-max]), the round-to-round spread ((max - min) / median), kernels per
token and per layer, host ms per token in the step's call and in MLX's submit, kernel ms, GPU
busy; for dense shapes the weight-read rate (parameter bytes a token reads x tok/s) against
this device's copy bandwidth (``--copy-gib`` read and written by one elementwise op). Writes
JSON after every shape.

``--llama PATH`` (a llama.cpp bin folder or the CUDA bundle's run.sh, ../shared/peers) adds
llama.cpp as the second peer on the same GGUF: the shape's random weights are written as a
GGUF (bench/random_gguf.py), ours Q4_K is loaded from that file (``hf2q_mlx.load``) instead of
built in memory, and every round ends with one ``llama-bench -p PROMPT -n TOKENS -r 1`` on it;
the table then carries llama.cpp's row and ours / llama.cpp round by round.

    python3 bench/speed_table.py OUT.json     # all four real shapes: 26B-A4B, 31B, 35B-A3B, 9B
    python3 bench/speed_table.py OUT.json --shapes qwen3_5:9b --rounds 5 --time-cap 400
    python3 bench/speed_table.py OUT.json --tiny --rounds 2 --tokens 4   # CPU smoke run
    python3 bench/speed_table.py OUT.json --shapes gemma4:26b-a4b --llama /tmp/peer/cuda/run.sh \
        --llama-args "-ngl 99"                        # H200, with llama.cpp on the same GGUF
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import decode_profile as dp  # noqa: E402  (bench/decode_profile.py: CUPTI kernel list)
import decode_step as ds  # noqa: E402  (bench/decode_step.py: builders, the mlx-lm twin)
import llama_peer  # noqa: E402  (bench/llama_peer.py: llama-bench's JSON)
import prefill as pf  # noqa: E402  (bench/prefill.py: the chunked prefill, compile_ahead)
import random_gguf  # noqa: E402  (bench/random_gguf.py: the shapes as GGUF files)

import hf2q_mlx  # noqa: E402
from hf2q_mlx.custom_kernels.launch_recorder import GraphCaptureError  # noqa: E402
from hf2q_mlx.decode_step import DecodeStep  # noqa: E402
from hf2q_mlx.generation import decode_mode  # noqa: E402

# issue 15's bars: decode x mlx-lm (MoE / dense), spread, kernels per layer, GPU busy, weight
# read against copy bandwidth (dense)
TARGETS = {"moe_ratio": 2.5, "dense_ratio": 1.5, "spread": 0.15, "kernels_per_layer": 12,
           "gpu_busy": 0.85, "copy_share": 0.5}  # fmt: skip


def _cupti_stop(prof, out: dict, n: int) -> dict:
    """``out`` with kernels per token, their ms per token and the GPU-busy share of
    ``out["wall_ms"]`` from ``prof`` (``n`` tokens profiled)."""
    if prof is not None:
        prof.__exit__(None, None, None)
        kernels = dp._cuda_kernels(prof)
        gpu_ms = sum(us for _, us in kernels) / 1e3 / n  # busy: copies included
        copies = sum(dp._is_copy(name) for name, _ in kernels)
        out.update(kernels=(len(kernels) - copies) / n, copies=copies / n, kernel_ms=gpu_ms,
                   gpu_busy=gpu_ms / out["wall_ms"],
                   top_kernels=_top_kernels(kernels, n))  # fmt: skip
    return out


def _top_kernels(kernels: list, n: int, top: int = 12) -> list[dict]:
    """The kernels taking the most GPU time: name (cut to 70 characters), calls and us per
    token, us per call (where a step's kernel time goes, for the next kernel to work on)."""
    ranked = dp.by_kernel(kernels)[:top]
    return [{"name": name[:70], "calls": round(c / n, 2), "us": round(t / n, 1),
             "us_per_call": round(t / c, 2)} for name, c, t in ranked]  # fmt: skip


class Variant:
    """One model: prefill a prompt into a new cache, then decode greedily from it; ``compiled``
    decodes through a one-row DecodeStep (made once, the prefilled cache adopted each round)."""

    def __init__(self, model, compiled: bool, chunk: int, max_len: int):
        self.model, self.chunk = model, chunk
        self.step = DecodeStep(model, 1, max_len) if compiled else None
        self.cache, self.y = None, None

    def prefill(self, prompt: mx.array) -> float:
        """-> seconds to the evaluated logits of the prompt's last token (a new cache)."""
        self.cache = self.model.make_cache()
        tic = time.perf_counter()
        pf.compile_ahead_for(self.model, prompt, self.chunk)  # a process's first: as a user's
        logits = pf.chunked_forward(self.model, prompt, self.chunk, self.cache)
        self.y = mx.argmax(logits, axis=-1).astype(mx.int32)
        mx.eval(self.y)
        seconds = time.perf_counter() - tic
        if self.step is not None:
            self.step.adopt(0, self.cache)
        return seconds

    def one(self, y: mx.array) -> mx.array:
        """The next greedy token (1,) after ``y`` (1,), lazy."""
        if self.step is not None:
            return self.step.decode(y, greedy=True)
        return mx.argmax(self.model(y[:, None], self.cache)[:, -1, :], axis=-1).astype(mx.int32)

    def decode(self, n: int) -> float:
        """-> seconds for ``n`` tokens, each launched before the last is read (async_eval)."""
        y, out = self.y, []
        tic = time.perf_counter()
        for _ in range(n):
            y = self.one(y)
            mx.async_eval(y)
            out.append(y)
        mx.eval(out)
        self.y = y
        return time.perf_counter() - tic

    def profile(self, n: int, use_cuda: bool) -> dict:
        """``n`` more tokens: host ms per token in the step's call and in async_eval; under CUPTI
        the kernels per token, their ms per token and the GPU-busy share."""
        self.decode(2)  # anything traced or compiled for this length runs before the window
        prof = dp._profiler(use_cuda)
        y, build, submit = self.y, 0.0, 0.0
        tic = time.perf_counter()
        for _ in range(n):
            t0 = time.perf_counter()
            y = self.one(y)
            t1 = time.perf_counter()
            mx.async_eval(y)
            build, submit = build + t1 - t0, submit + time.perf_counter() - t1
        mx.eval(y)
        mx.synchronize()
        wall = (time.perf_counter() - tic) * 1e3 / n
        self.y = y
        out = {"wall_ms": wall, "python_ms": build * 1e3 / n, "submit_ms": submit * 1e3 / n}
        return _cupti_stop(prof, out, n)


class GraphVariant(Variant):
    """Ours through a CudaGraphStep (the step recorded once and replayed as one CUDA graph per
    token) over a one-row DecodeStep; CUDA only. The host reads each token id."""

    def __init__(self, model, chunk: int, max_len: int):
        from hf2q_mlx.cuda_graph_step import CudaGraphStep
        from hf2q_mlx.custom_kernels.cuda_driver import Driver

        super().__init__(model, True, chunk, max_len)
        self.graph = CudaGraphStep(self.step, Driver())
        self.token = 0

    def prefill(self, prompt: mx.array) -> float:
        seconds = super().prefill(prompt)
        self.token = int(self.y[0].item())
        return seconds

    def decode(self, n: int) -> float:
        tic = time.perf_counter()
        self.tokens(n)
        return time.perf_counter() - tic

    def tokens(self, n: int) -> list[int]:
        """The next ``n`` greedy tokens, each read back before the next replay."""
        out, t = [], self.token
        for _ in range(n):
            t = self.graph.decode([t])[0]
            out.append(t)
        self.token, self.y = t, mx.array([t], dtype=mx.int32)
        return out

    def profile(self, n: int, use_cuda: bool) -> dict:
        self.decode(2)
        prof = dp._profiler(use_cuda)
        wall = self.decode(n) * 1e3 / n
        out = {"wall_ms": wall, "python_ms": wall, "submit_ms": 0.0}
        return _cupti_stop(prof, out, n)


def memory_now() -> dict:
    """GB MLX holds (active, cache, peak) and, on CUDA, the driver's free / total: session 38's
    31B graph decoded at 0.5 tok/s on an 80 GB H100 (docs/decode_step.md, "Memory")."""
    gb = 1e-9
    out = {"active_gb": mx.get_active_memory() * gb, "cache_gb": mx.get_cache_memory() * gb,
           "peak_gb": mx.get_peak_memory() * gb}  # fmt: skip
    if mx.default_device().type == mx.DeviceType.gpu and mx.cuda.is_available():
        from hf2q_mlx.custom_kernels.cuda_driver import Driver

        if not hasattr(memory_now, "driver"):  # one driver (its stream) for the run
            memory_now.driver = Driver()
        free, total = memory_now.driver.memory()
        out.update(device_free_gb=free * gb, device_total_gb=total * gb)
    return out


def graph_parity(model, prompt: mx.array, n: int, chunk: int, max_len: int) -> dict:
    """Greedy tokens of the compiled step and of the CUDA graph step from the same prefill."""
    compiled = Variant(model, True, chunk, max_len)
    compiled.prefill(prompt)
    y, want = compiled.y, []
    for _ in range(n):
        y = compiled.one(y)
        want.append(int(y[0].item()))
    graph = GraphVariant(model, chunk, max_len)
    graph.prefill(prompt)
    got = graph.tokens(n)
    graph.graph.close()
    same = sum(a == b for a, b in zip(want, got))
    first = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
    return {"tokens": n, "same": same, "first_difference": first, "compiled": want, "graph": got}


def copy_bandwidth(gib: float) -> float | None:
    """GB/s of one elementwise op reading and writing ``gib`` GiB (median of 7), GPU only."""
    if mx.default_device().type != mx.DeviceType.gpu or gib <= 0:
        return None
    a = mx.random.uniform(shape=(int(gib * (1 << 30)) // 4,))
    mx.eval(a)
    times = []
    for _ in range(8):
        tic = time.perf_counter()
        mx.eval(a + 1)
        times.append(time.perf_counter() - tic)
    del a
    mx.clear_cache()
    return 2 * gib * (1 << 30) / statistics.median(times[1:]) / 1e9


def weight_bytes(model) -> int:
    """Bytes of parameters a dense model reads per decode token: all of them, less the embedding
    table when an lm_head of its own is there (a tied table is read whole as the head)."""
    params = dict(tree_flatten(model.parameters()))
    total = sum(v.nbytes for v in params.values())
    if any(k.startswith("lm_head") for k in params):
        total -= sum(v.nbytes for k, v in params.items() if "embed_tokens" in k)
    return total


def stats(xs: list[float]) -> dict:
    med = statistics.median(xs)
    return {"values": xs, "median": med, "min": min(xs), "max": max(xs),
            "spread": (max(xs) - min(xs)) / med if med else float("nan")}  # fmt: skip


def run_shape(name: str, config: dict, a, use_cuda: bool) -> dict:
    vocab, layers = config["vocab_size"], config["num_hidden_layers"]
    moe = bool(config.get("enable_moe_block") or config.get("num_experts"))
    compiled = decode_mode() in ("compiled", "graph")
    max_len = a.prompt + a.tokens + a.profile_steps + 16
    variants: dict[str, Variant] = {}
    wbytes = {}
    gguf = None
    if a.llama:
        gguf = Path(a.gguf_dir or tempfile.mkdtemp()) / f"{name.replace(':', '_')}.gguf"
        tic = time.perf_counter()
        random_gguf.write_random_gguf(name, gguf)
        print(f"{name}: wrote {gguf} in {time.perf_counter() - tic:.1f} s", flush=True)
    for fmt in a.formats:
        tic = time.perf_counter()
        if gguf is not None and fmt == "q4_k":  # llama.cpp's file, through our loader
            model = hf2q_mlx.load(gguf)[0]
        else:
            model = ds.build(name, config, fmt)
        twin = ds.mlx_lm_twin(name, config, model) if fmt == "mlx4" and not a.no_mlx_lm else None
        model.fuse_projections()  # as the loader does
        print(f"{name} {fmt}: built in {time.perf_counter() - tic:.1f} s", flush=True)
        variants[f"ours {fmt}"] = Variant(model, compiled, a.chunk, max_len)
        wbytes[f"ours {fmt}"] = weight_bytes(model)
        if a.graph and fmt in a.graph:
            try:
                variants[f"ours {fmt} graph"] = GraphVariant(model, a.chunk, max_len)
                wbytes[f"ours {fmt} graph"] = wbytes[f"ours {fmt}"]
            except GraphCaptureError as err:  # e.g. no managed memory on this GPU: said, skipped
                print(f"  ours {fmt} graph: no CUDA graph: {err}", flush=True)
        if twin is not None:
            variants["mlx-lm mlx4"] = Variant(twin, False, a.chunk, max_len)
            wbytes["mlx-lm mlx4"] = wbytes[f"ours {fmt}"]
    for k in a.skip:  # built (an mlx-lm twin needs its format's model), never timed
        variants.pop(k, None)
    key = mx.random.key(7)
    first = {}
    parity = {}
    memory = {}
    for k, v in list(variants.items()):  # the first prefill compiles kernels: timed on its own
        key, sub = mx.random.split(key)
        first[k] = v.prefill(mx.random.randint(0, vocab, (1, a.prompt), key=sub))
        tic = time.perf_counter()
        try:
            v.decode(3)
        except GraphCaptureError as err:  # a step the graph cannot replay: said, then skipped
            print(f"  {k}: no CUDA graph: {err}", flush=True)
            del variants[k]
            continue
        print(f"  first {a.prompt}-token prefill, {k}: {first[k]:.2f} s; first 3 tokens "
              f"{time.perf_counter() - tic:.2f} s", flush=True)  # fmt: skip
        memory[k] = m = memory_now()
        print(
            "    memory (GB): " + ", ".join(f"{n[:-3]} {v:.1f}" for n, v in m.items()), flush=True
        )
        if isinstance(v, GraphVariant) and a.parity:
            key, sub = mx.random.split(key)
            prompt = mx.random.randint(0, vocab, (1, a.prompt), key=sub)
            parity[k] = graph_parity(v.model, prompt, a.parity, a.chunk, max_len)
            print(
                f"  {k}: {parity[k]['same']} of {a.parity} greedy tokens equal to the compiled "
                f"step's (first difference at {parity[k]['first_difference']})",
                flush=True,
            )
    dec = {k: [] for k in variants}
    pre = {k: [] for k in variants}
    if gguf is not None:
        dec["llama.cpp"], pre["llama.cpp"] = [], []
    for r in range(a.rounds):
        key, sub = mx.random.split(key)
        prompt = mx.random.randint(0, vocab, (1, a.prompt), key=sub)
        for k, v in variants.items():
            pre[k].append(a.prompt / v.prefill(prompt))
            dec[k].append(a.tokens / v.decode(a.tokens))
        if gguf is not None:
            mx.clear_cache()  # our freed buffers back to the device before llama.cpp allocates
            peer = llama_peer.run_llama_bench(a.llama, gguf, a.prompt, a.tokens, 1,
                                              a.llama_args.split())  # fmt: skip
            pre["llama.cpp"].append(peer["pp_tok_s"])
            dec["llama.cpp"].append(peer["tg_tok_s"])
        print(f"{name} round {r}: " + ", ".join(
            f"{k} decode {dec[k][-1]:.1f} prefill {pre[k][-1]:.0f}" for k in dec),
            flush=True)  # fmt: skip
    out = {"shape": name, "layers": layers, "moe": moe, "prompt": a.prompt, "tokens": a.tokens,
           "decode_path": "compiled" if compiled else "eager", "first_prefill_s": first,
           "gguf": None if gguf is None else str(gguf), "variants": {},
           "graph_parity": parity, "memory_after_first": memory}  # fmt: skip
    memory["after_rounds"] = memory_now()
    ref = "mlx-lm mlx4" if "mlx-lm mlx4" in variants else None
    for k, v in variants.items():
        row = {"decode": stats(dec[k]), "prefill": stats(pre[k])}
        if ref:
            row["decode_ratio"] = stats([x / y for x, y in zip(dec[k], dec[ref])])
            row["prefill_ratio"] = stats([x / y for x, y in zip(pre[k], pre[ref])])
        if gguf is not None:
            row["decode_ratio_llama"] = stats([x / y for x, y in zip(dec[k], dec["llama.cpp"])])
            row["prefill_ratio_llama"] = stats([x / y for x, y in zip(pre[k], pre["llama.cpp"])])
        row["profile"] = p = v.profile(a.profile_steps, use_cuda)
        if "kernels" in p:
            p["kernels_per_layer"] = p["kernels"] / layers
        if not moe:
            row["weight_gb_s"] = wbytes[k] * row["decode"]["median"] / 1e9
        out["variants"][k] = row
    if gguf is not None:
        out["llama.cpp"] = {"decode": stats(dec["llama.cpp"]), "prefill": stats(pre["llama.cpp"])}
        if not a.keep_gguf:
            gguf.unlink(missing_ok=True)
    del variants
    gc.collect()
    mx.clear_cache()
    return out


def _fmt(s: dict | None, f: str) -> str:
    if not s:
        return "-"
    return f"{s['median']:{f}} [{s['min']:{f}}-{s['max']:{f}}]"


def report(res: dict, copy_gb_s: float | None) -> list[str]:
    """Prints the shape's table -> the issue's bars it misses (ours Q4_K and MLX 4-bit; where a
    format also ran as the CUDA graph, its graph row: what ``stream_generate`` decodes through
    on CUDA)."""
    print(f"\n{res['shape']} ({res['layers']} layers, decode path {res['decode_path']}): "
          f"{res['prompt']}-token prompt, {res['tokens']} decode tokens per round")  # fmt: skip
    cols = ("variant", "decode tok/s", "x mlx-lm", "spread", "prefill tok/s", "x mlx-lm",
            "kern/tok", "/layer", "py ms", "submit ms", "GPU ms", "busy")  # fmt: skip
    print("  " + " | ".join(cols))
    missed = []
    bar = TARGETS["moe_ratio"] if res["moe"] else TARGETS["dense_ratio"]
    for k, r in res["variants"].items():
        p = r["profile"]
        cells = [k, _fmt(r["decode"], ".1f"), _fmt(r.get("decode_ratio"), ".2f"),
                 f"{100 * r['decode']['spread']:.0f} %", _fmt(r["prefill"], ".0f"),
                 _fmt(r.get("prefill_ratio"), ".2f"),
                 f"{p['kernels']:.0f}" if "kernels" in p else "-",
                 f"{p['kernels_per_layer']:.1f}" if "kernels" in p else "-",
                 f"{p['python_ms']:.2f}",
                 f"{p['submit_ms']:.2f}" if "submit_ms" in p else "-",
                 f"{p['kernel_ms']:.2f}" if "kernel_ms" in p else "-",
                 f"{100 * p['gpu_busy']:.0f} %" if "gpu_busy" in p else "-"]  # fmt: skip
        print("  " + " | ".join(cells))
        if not k.startswith("ours") or f"{k} graph" in res["variants"]:
            continue  # bars are ours; a format with a graph row is judged on that row
        checks = [("decode x mlx-lm", r.get("decode_ratio", {}).get("median"), bar, 1),
                  ("prefill x mlx-lm", r.get("prefill_ratio", {}).get("median"), 1.0, 1),
                  ("spread", r["decode"]["spread"], TARGETS["spread"], -1),
                  ("kernels per layer", p.get("kernels_per_layer"), TARGETS["kernels_per_layer"],
                   -1),
                  ("GPU busy", p.get("gpu_busy"), TARGETS["gpu_busy"], 1)]  # fmt: skip
        if "weight_gb_s" in r and copy_gb_s:
            share = r["weight_gb_s"] / copy_gb_s
            print(f"    {k}: weights read at {r['weight_gb_s']:.0f} GB/s, {100 * share:.0f} % "
                  f"of the copy bandwidth ({copy_gb_s:.0f} GB/s)")  # fmt: skip
            checks.append(("weight read / copy bandwidth", share, TARGETS["copy_share"], 1))
        for what, got, want, sign in checks:
            if got is not None and (got - want) * sign < 0:
                missed.append(f"{res['shape']} {k}: {what} {got:.3g} (bar {want})")
    peer = res.get("llama.cpp")
    if peer:
        print(f"  llama.cpp, same GGUF: decode {_fmt(peer['decode'], '.1f')}, prefill "
              f"{_fmt(peer['prefill'], '.0f')} tok/s")  # fmt: skip
        for k, r in res["variants"].items():
            if "decode_ratio_llama" in r:
                print(f"    {k} / llama.cpp: decode {_fmt(r['decode_ratio_llama'], '.2f')}, "
                      f"prefill {_fmt(r['prefill_ratio_llama'], '.2f')}")  # fmt: skip
    for k, s in res["first_prefill_s"].items():
        print(f"  first prefill (kernels compiled) {k}: {s:.2f} s")
    for k, r in res["variants"].items():
        top = r["profile"].get("top_kernels")
        if k.startswith("ours") and top:
            print(f"  {k}, GPU time per token by kernel (us; calls; us a call):")
            for t in top[:8]:
                print(
                    f"    {t['us']:8.1f}  {t['calls']:6.1f}  {t['us_per_call']:7.2f}  {t['name']}"
                )
    return missed


def graph_formats(value: str, formats: list[str], graph_default: bool | None = None) -> list[str]:
    """The formats ``--graph`` runs as a CUDA graph step: ``auto`` -> all of ``formats`` where
    the graph is the default decode (``graph_default``; None: ``decode_mode()`` is graph and
    MLX runs on CUDA), else none; ``none`` -> none; else the comma list as written."""
    value = value.strip()
    if value == "none":
        return []
    if value == "auto":
        if graph_default is None:
            graph_default = decode_mode() == "graph" and mx.cuda.is_available()
        return list(formats) if graph_default else []
    return [f for f in value.split(",") if f]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="JSON file to write")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
    p.add_argument("--shapes", default=None, help="comma list of family:shape")
    p.add_argument("--formats", default="q4_k,mlx4")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--chunk", type=int, default=2048, help="prefill tokens per forward")
    p.add_argument("--tokens", type=int, default=32, help="decode tokens per variant per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--profile-steps", type=int, default=16)
    p.add_argument("--copy-gib", type=float, default=4.0, help="GiB of the copy-bandwidth probe")
    p.add_argument("--no-mlx-lm", action="store_true")
    p.add_argument(
        "--graph",
        default="auto",
        help="formats also run as a CUDA graph step: a comma list, 'none', or 'auto' (every "
        "format where stream_generate decodes through the graph: HF2Q_DECODE auto / graph, CUDA)",
    )
    p.add_argument(
        "--skip",
        default="",
        help="variants left out, comma list ('ours mlx4,ours q4_k': the graph against mlx-lm)",
    )
    p.add_argument(
        "--parity",
        type=int,
        default=64,
        help="greedy tokens compared, graph step against compiled step",
    )
    p.add_argument("--time-cap", type=float, default=None, help="start no shape past this (s)")
    p.add_argument("--llama", default=None, help="llama.cpp bin folder or run.sh: the peer column")
    p.add_argument("--llama-args", default="", help="more llama-bench arguments ('-ngl 99 -t 2')")
    p.add_argument("--gguf-dir", default=None, help="where --llama's GGUFs go (default: a tmp dir)")
    p.add_argument("--keep-gguf", action="store_true", help="keep --llama's GGUF files")
    a = p.parse_args(argv)
    a.formats = a.formats.split(",")
    a.graph = graph_formats(a.graph, a.formats)
    a.skip = [v.strip() for v in a.skip.split(",") if v.strip()]
    if a.rounds < 1 or a.tokens < 1 or a.prompt < 1 or a.profile_steps < 1 or a.chunk < 1:
        p.error("--rounds, --tokens, --prompt, --profile-steps and --chunk must be >= 1")
    shapes = ds.configs(a.tiny)
    names = a.shapes.split(",") if a.shapes else list(shapes)
    unknown = [n for n in names if n not in shapes]
    if unknown:
        p.error(f"unknown shapes {unknown}; known: {', '.join(shapes)}")
    use_cuda = dp.cupti_available()
    copy_gb_s = copy_bandwidth(a.copy_gib)
    print(
        f"mlx {mx.__version__} on {mx.default_device()}, CUPTI {'on' if use_cuda else 'off'}"
        + (f", copy bandwidth {copy_gb_s:.0f} GB/s" if copy_gb_s else ""),
        flush=True,
    )
    t0, results, missed = time.perf_counter(), [], []
    for name in names:
        if a.time_cap is not None and time.perf_counter() - t0 > a.time_cap:
            print(f"time cap: {name} not run")
            continue
        results.append(run_shape(name, shapes[name], a, use_cuda))
        missed += report(results[-1], copy_gb_s)
        with open(a.out, "w") as f:
            json.dump(
                {
                    "mlx": mx.__version__,
                    "device": str(mx.default_device()),
                    "copy_gb_s": copy_gb_s,
                    "targets": TARGETS,
                    "shapes": results,
                },
                f,
                indent=1,
            )
    print("\nbars missed:" if missed else "\nbars missed: none", *missed, sep="\n  ")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
