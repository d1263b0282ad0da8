"""Where a decode step's time goes on the GPU: kernel time against wall time, by kernel.

Builds one random-weight model at a real shape with the builders of bench/gemma4.py and
bench/qwen3_5.py, prefills a prompt, then times greedy decode steps (pipelined as in
``stream_generate``: the next graph is built while the GPU runs the last one) under CUPTI
(through torch.profiler). Reports per token: wall time, the number of GPU kernels, their summed
duration and the GPU-busy share (summed kernel time / wall), the host time split into building
the step's graph in Python and MLX's ``async_eval`` (encoding and launching it), and the kernels
that take the most time (``--by-launch``: also by launch grid, so one kernel's shapes, such as
the mat-vec's lm_head call, show apart). Busy well under 100 % means host time, not kernels, sets
the speed.

    python3 bench/decode_profile.py gemma4:26b-a4b q4_k [--prompt 512] [--steps 16] [--json F]
    python3 bench/decode_profile.py qwen3_5:9b mlx4
    python3 bench/decode_profile.py gemma4:26b-a4b q4_k --step compiled [--batch 8]
    python3 bench/decode_profile.py qwen3_5:35b-a3b q4_k --step compiled --batch 32 --by-launch
    python3 bench/decode_profile.py qwen3_5:35b-a3b q4_k --step prefill --prompt 512 --steps 3
    python3 bench/decode_profile.py gemma4:tiny-moe q4_k        # CPU smoke run (no CUPTI)

Needs torch with CUDA for the kernel columns; without it only wall times are printed.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import re
import sys
import time

import mlx.core as mx


def _bench_module(name: str):
    """bench/<name>.py as a module (bench/ is a folder of scripts, not a package)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def build(family: str, shape: str, fmt: str, dtype: mx.Dtype, layers: int | None = None):
    """-> (model, vocab size) with random weights in ``fmt`` (q4_k or mlx4); ``layers``: keep
    only the first layers of the shape (quicker runs that compare settings)."""
    if family == "gemma4":
        g = _bench_module("gemma4")
        config = {**g.SHAPES, **g.TINY}[shape]
        if layers:
            config = dict(
                config, num_hidden_layers=layers, layer_types=config["layer_types"][:layers]
            )
        args = g.gemma4.ModelArgs.from_dict(config)
        model = g.build_ggml(args, dtype) if fmt == "q4_k" else g.build_mlx4(args, dtype)
        model.fuse_projections()  # as the loader does (build_ggml fused already: a no-op)
        return model, args.vocab_size
    if family == "qwen3_5":
        q = _bench_module("qwen3_5")
        config = {**q.SHAPES, **q.TINY_SHAPES}[shape]
        if layers:
            config = dict(config, num_hidden_layers=layers)
        model = q.build_ours(config, dtype)
        if fmt == "q4_k":
            q.randomize_q4k(model, dtype)
        else:
            q.randomize_mlx_quantized(model, dtype)
            q.cast_floats(model, dtype)
            model.fuse_projections()  # as the loader does (randomize_q4k fuses too)
        return model, config["vocab_size"]
    raise SystemExit(f"unknown model family {family!r}: gemma4 or qwen3_5")


def cupti_available() -> bool:
    """Whether torch.profiler can give CUDA kernel times here (a GPU, torch with CUDA)."""
    if mx.default_device().type != mx.DeviceType.gpu or importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


def by_kernel(kernels: list) -> list[tuple[str, int, float]]:
    """(name, calls, total us) of each kernel name in ``kernels`` ((name, us) records), the
    most GPU time first."""
    totals: dict = collections.defaultdict(lambda: [0, 0.0])
    for name, us in kernels:
        totals[name][0] += 1
        totals[name][1] += us
    return sorted(((n, c, t) for n, (c, t) in totals.items()), key=lambda r: -r[2])


def by_launch(trace: dict, n: int, top: int = 40) -> list[dict]:
    """Kernel records of a Chrome trace (torch.profiler's export: each kernel event's args carry
    its grid, block and registers) grouped by (name, grid, block), so one kernel at several
    shapes (a mat-vec's N, a split, the lm_head) shows apart; per unit of ``n``, most time
    first."""
    records, regs = [], {}
    for e in trace.get("traceEvents", []):
        if str(e.get("cat", "")).lower() != "kernel" or e.get("ph") != "X":
            continue
        args = e.get("args", {})
        key = (e.get("name", "?"), tuple(args.get("grid", ())), tuple(args.get("block", ())))
        records.append((key, float(e.get("dur", 0.0))))
        regs[key] = args.get("registers per thread", regs.get(key))
    return [{"kernel": key[0][:120], "grid": list(key[1]), "block": list(key[2]),
             "registers": regs[key], "per_token": c / n, "us_per_token": t / n, "avg_us": t / c}
            for key, c, t in by_kernel(records)[:top]]  # fmt: skip


def _launches(prof, n: int) -> list[dict]:
    """``by_launch`` of a stopped profiler's records (written to a temporary trace file)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return by_launch(json.load(f), n)


def _is_copy(name: str) -> bool:
    """A CUPTI record of a memcpy or memset (a graph's copy nodes, uploads), not a kernel."""
    return name.startswith(("Memcpy", "Memset"))


def _cuda_kernels(prof) -> list[tuple[str, float]]:
    """(name, us) of every CUDA activity record: kernels, memcpys and memsets."""
    from torch.autograd import DeviceType

    return [
        (e.name, e.time_range.elapsed_us())
        for e in prof.events()
        if e.device_type == DeviceType.CUDA
    ]


def eager_step(model, vocab: int, prompt: int, steps: int):
    """-> (first token (1,), step function): the per-sequence graph built anew each token."""
    cache = model.make_cache()
    ids = mx.random.randint(0, vocab, (1, prompt), key=mx.random.key(0))
    y = mx.argmax(model(ids, cache)[:, -1, :], axis=-1)

    def step(y):
        return mx.argmax(model(y[:, None], cache)[:, -1, :], axis=-1)

    return y, step


def compiled_step(model, vocab: int, prompt: int, steps: int, batch: int = 1):
    """-> (first tokens (B,), step function): hf2q_mlx.decode_step.DecodeStep, B rows."""
    from hf2q_mlx.decode_step import DecodeStep

    st = DecodeStep(model, batch, prompt + steps + 16)
    # a different prompt per row: rows that route to the same experts (a MoE) would make the
    # batched step look cheaper than serving's mixed streams
    ids = [
        mx.random.randint(0, vocab, (prompt,), key=mx.random.key(r)).tolist() for r in range(batch)
    ]
    y = mx.stack([mx.argmax(st.prefill(r, ids[r])).astype(mx.int32) for r in range(batch)])
    return y, lambda y: st.decode(y, greedy=True)


def count_nodes(y: mx.array, path: str) -> dict[str, int]:
    """One unevaluated step's graph written as DOT to ``path`` -> primitive name: count (every
    node costs MLX host time at eval, kernel or not)."""
    mx.export_to_dot(path, y)
    with open(path) as f:
        names = re.findall(r'label ="([^"]+)"', f.read())
    return dict(collections.Counter(names).most_common())


def _profiler(use_cuda: bool):
    """A started torch.profiler recording CUDA activity, or None without CUPTI."""
    if not use_cuda:
        return None
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CUDA])
    prof.__enter__()
    return prof


def _kernel_summary(prof, n: int, wall_ms: float, launches: bool = False) -> dict:
    """Stop ``prof`` -> kernels, copies and kernel ms per unit (``n`` units: tokens or prefills),
    GPU busy against ``wall_ms`` a unit, and the kernels by GPU time (``launches``: also by
    launch shape, ``by_launch``)."""
    prof.__exit__(None, None, None)
    kernels = _cuda_kernels(prof)
    gpu_ms = sum(us for _, us in kernels) / 1e3 / n
    copies = sum(_is_copy(name) for name, _ in kernels)
    extra = {"by_launch": _launches(prof, n)} if launches else {}
    return {**extra,
        "kernels_per_token": (len(kernels) - copies) / n,
        "copies_per_token": copies / n,
        "kernel_ms_per_token": gpu_ms,
        "gpu_busy": gpu_ms / wall_ms,
        "top": [{"kernel": k[:120], "per_token": c / n, "us_per_token": t / n, "avg_us": t / c}
                for k, c, t in by_kernel(kernels)[:40]],
    }  # fmt: skip


def profile_prefill(
    model, vocab: int, prompt: int, runs: int, use_cuda: bool, launches: bool = False
) -> dict:
    """``runs`` prefills of a fresh ``prompt``-token prompt into a new cache each (one forward,
    evaluated to the last position's logits, as a 512-token prompt's first chunk is) under
    CUPTI, after two unprofiled ones (kernel builds): per prefill the wall time and, with
    CUPTI, the kernels by GPU time. The same keys as ``profile_decode``, per prefill."""
    prompts = [
        mx.random.randint(0, vocab, (1, prompt), key=mx.random.key(100 + i))
        for i in range(runs + 2)
    ]
    mx.eval(prompts)

    def one(ids):
        mx.eval(model(ids, model.make_cache())[:, -1, :])

    for ids in prompts[:2]:
        one(ids)
    mx.synchronize()
    prof = _profiler(use_cuda)
    tic = time.perf_counter()
    for ids in prompts[2:]:
        one(ids)
    mx.synchronize()
    wall_ms = (time.perf_counter() - tic) * 1e3 / runs
    out = {"prompt": prompt, "steps": runs, "wall_ms_per_token": wall_ms,
           "graph_build_ms_per_token": 0.0, "eval_submit_ms_per_token": 0.0}  # fmt: skip
    if prof is not None:
        out.update(_kernel_summary(prof, runs, wall_ms, launches))
    return out


def profile_decode(
    model,
    vocab: int,
    prompt: int,
    steps: int,
    use_cuda: bool,
    mode: str = "eager",
    batch: int = 1,
    nodes: str | None = None,
    launches: bool = False,
) -> dict:
    if mode == "eager":
        y, step = eager_step(model, vocab, prompt, steps)
    else:
        y, step = compiled_step(model, vocab, prompt, steps, batch)
    mx.eval(y)

    for _ in range(4):  # warm-up: kernel builds, graph caches
        y = step(y)
        mx.eval(y)
    prof = _profiler(use_cuda)
    build = submit = 0.0
    tic = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        y = step(y)  # Python: the step's graph
        t1 = time.perf_counter()
        mx.async_eval(y)  # MLX: encode and launch it (the GPU runs behind)
        build, submit = build + t1 - t0, submit + time.perf_counter() - t1
    mx.eval(y)
    mx.synchronize()
    wall_ms = (time.perf_counter() - tic) * 1e3 / steps
    out = {
        "prompt": prompt,
        "steps": steps,
        "wall_ms_per_token": wall_ms,
        "graph_build_ms_per_token": build * 1e3 / steps,
        "eval_submit_ms_per_token": submit * 1e3 / steps,
    }
    if nodes:
        out["graph_nodes"] = count_nodes(step(y), nodes)
    if prof is not None:
        out.update(_kernel_summary(prof, steps, wall_ms, launches))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="family:shape, e.g. gemma4:26b-a4b, qwen3_5:9b")
    ap.add_argument("format", choices=["q4_k", "mlx4"])
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument(
        "--step", choices=["eager", "compiled", "prefill"], default="eager",
        help="prefill: --steps prefills of --prompt tokens, figures per prefill, not per token",
    )  # fmt: skip
    ap.add_argument("--batch", type=int, default=1, help="rows of the compiled step")
    ap.add_argument("--layers", type=int, default=None, help="first N layers only")
    ap.add_argument("--no-cupti", action="store_true", help="wall times only (no profiler)")
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--by-launch", action="store_true",
        help="also the kernels by (name, grid, block): one kernel's shapes apart (CUPTI)",
    )  # fmt: skip
    ap.add_argument("--nodes", default=None, help="write one step's graph (DOT) here, count nodes")
    a = ap.parse_args()
    family, _, shape = a.model.partition(":")
    gpu = mx.default_device().type == mx.DeviceType.gpu
    use_cuda = gpu and not a.no_cupti and importlib.util.find_spec("torch") is not None
    if use_cuda:
        import torch

        use_cuda = torch.cuda.is_available()
    dtype = mx.bfloat16 if gpu else mx.float32
    model, vocab = build(family, shape, a.format, dtype, a.layers)
    if a.step == "prefill":
        r = profile_prefill(model, vocab, a.prompt, a.steps, use_cuda, a.by_launch)
    else:
        r = profile_decode(
            model, vocab, a.prompt, a.steps, use_cuda, a.step, a.batch, a.nodes, a.by_launch
        )
    unit = "prefill" if a.step == "prefill" else "token"
    r["layers"] = len(model.layers)
    r.update(model=a.model, format=a.format, step=a.step, batch=a.batch)
    r["env"] = {k: v for k, v in os.environ.items() if k.startswith("MLX_")}
    r["device"] = str(mx.default_device())
    if mx.cuda.is_available():
        from hf2q_mlx.custom_kernels import cuda_cache

        r["cuda_cache"] = cuda_cache.status()
        print(f"cuda_cache: {r['cuda_cache']}")
    b_ms, s_ms = r["graph_build_ms_per_token"], r["eval_submit_ms_per_token"]
    print(f"{a.model} {a.format}: {r['wall_ms_per_token']:.2f} ms/{unit} wall", end="")
    if unit == "token":
        print(f" (Python graph build {b_ms:.2f}, MLX eval submit {s_ms:.2f})", end="")
    else:
        print(f" ({a.prompt} tokens: {a.prompt / r['wall_ms_per_token'] * 1e3:,.0f} tok/s)", end="")
    if "kernel_ms_per_token" in r:
        per_layer = r["kernels_per_token"] / r["layers"]
        print(f", {r['kernels_per_token']:.0f} kernels/{unit} ({per_layer:.1f} per layer), "
              f"{r['kernel_ms_per_token']:.2f} ms "
              f"kernel time/{unit}, GPU busy {100 * r['gpu_busy']:.0f} %")  # fmt: skip
        print(f"{'kernel':<80} {'/' + unit:>7} {'us/' + unit:>9} {'avg us':>8}")
        for t in r["top"]:
            print(f"{t['kernel'][:80]:<80} {t['per_token']:>7.1f} {t['us_per_token']:>9.1f} "
                  f"{t['avg_us']:>8.2f}")  # fmt: skip
    else:
        print(" (no CUPTI: kernel columns need torch with CUDA)")
    if r.get("by_launch"):
        print(f"{'kernel by launch':<64} {'grid x':>8} {'block x':>7} {'regs':>5} "
              f"{'/' + unit:>7} {'us/' + unit:>9} {'avg us':>8}")  # fmt: skip
        for t in r["by_launch"]:
            gx = t["grid"][0] if t["grid"] else "-"
            bx = t["block"][0] if t["block"] else "-"
            print(
                f"{t['kernel'][:64]:<64} {gx:>8} {bx:>7} {t['registers'] or '-':>5} "
                f"{t['per_token']:>7.1f} {t['us_per_token']:>9.1f} {t['avg_us']:>8.2f}"
            )
    if "graph_nodes" in r:
        g, n = r["graph_nodes"], sum(r["graph_nodes"].values())
        print(f"graph nodes / step: {n} ({n / r['layers']:.1f} per layer):")
        print("  " + ", ".join(f"{k} {v}" for k, v in g.items()))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
