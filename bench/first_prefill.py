"""Where a fresh process's first prefill spends its time (issue 15: "the first 512-token prefill
under 2 s including compilation"; session 15 measured 48 s cold, 17.7 s warm on the H200).

Every model class of ours gets its ``__call__`` wrapped, and so does every function of
``models/ops.py`` (attention, the fused norms, the experts' kernels): the call's outputs are
evaluated at its end, and its time is split into graph building (Python) and evaluation, each
exclusive of the wrapped calls inside it. The same prompt length is prefilled three times in one
process: the first two instrumented, the third plain. First minus second is the one-time cost
(kernel compilation or module loading, cuDNN / cuBLAS plans, Python set-up), per class and per
module.
Evaluating each module's output breaks up MLX's fusion, so the instrumented totals run above the
plain ones; the split is what this is for. Prints the table, writes JSON.

    python3 bench/first_prefill.py OUT.json --shape gemma4:26b-a4b --format q4_k
    python3 bench/first_prefill.py OUT.json --tiny                 # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import decode_step as ds  # noqa: E402  (bench/decode_step.py: builders)
import prefill as pf  # noqa: E402  (bench/prefill.py: one timed prefill into a new cache)

from hf2q_mlx.custom_kernels import _render, affine_prefill, cuda_cache  # noqa: E402
from hf2q_mlx.models import kernel_linears, ops  # noqa: E402


def arrays_in(tree) -> list[mx.array]:
    """The mx.arrays in a nest of tuples, lists and dicts (caches and None skipped)."""
    if isinstance(tree, mx.array):
        return [tree]
    if isinstance(tree, (tuple, list)):
        return [a for t in tree for a in arrays_in(t)]
    if isinstance(tree, dict):
        return [a for t in tree.values() for a in arrays_in(t)]
    return []


class CallTimer:
    """Wraps ``__call__`` of the given classes; while ``on``, each call evaluates its outputs and
    adds (build, eval) seconds, exclusive of the wrapped calls inside it, under its module path."""

    def __init__(self, model: nn.Module):
        self.names = {id(m): name or "model" for name, m in model.named_modules()}
        self.on = False
        self.records: list[tuple[str, str, float, float]] = []  # (path, class, build_s, eval_s)
        self._child = [0.0]  # inner wrapped calls' time, per open call
        self._patched = []
        self._funcs = []
        self._stack = ["model"]  # module paths of the open calls, for the ops' records
        mods = [m for _, m in model.named_modules()]
        owners = {c for m in mods for c in type(m).__mro__ if "__call__" in vars(c)}
        for cls in owners:
            if cls.__module__.startswith(("hf2q_mlx", "models")) or cls is type(model):
                self._patch(cls)
        for fname, f in list(vars(ops).items()):
            public = not fname.startswith("_") and not isinstance(f, type)
            if public and callable(f) and getattr(f, "__module__", None) == ops.__name__:
                self._funcs.append((fname, f))
                setattr(ops, fname, self._wrap(f, f"ops.{fname}"))

    def _wrap(self, orig, label: str | None):
        """``orig`` timed; ``label`` None: a method, labelled by its object's class and path."""
        timer = self

        def timed(*args, **kwargs):
            if not timer.on or _render._collector:  # compile_ahead's dry pass: never evaluated
                return orig(*args, **kwargs)
            if label is None:
                path, kind = timer.names.get(id(args[0]), "?"), type(args[0]).__name__
            else:
                path, kind = f"{timer._stack[-1]}.{label}", label
            timer._child.append(0.0)
            timer._stack.append(path)
            t0 = time.perf_counter()
            try:
                out = orig(*args, **kwargs)
            finally:
                timer._stack.pop()
            t1 = time.perf_counter()
            mx.eval(arrays_in(out))
            t2 = time.perf_counter()
            inner = timer._child.pop()
            # the inner calls evaluated inside orig: their time was counted there
            timer.records.append((path, kind, t1 - t0 - inner, t2 - t1))
            timer._child[-1] += t2 - t0
            return out

        return timed

    def _patch(self, cls) -> None:
        orig = vars(cls)["__call__"]
        self._patched.append((cls, orig))
        cls.__call__ = self._wrap(orig, None)

    def restore(self) -> None:
        for cls, orig in self._patched:
            cls.__call__ = orig
        for fname, f in self._funcs:
            setattr(ops, fname, f)


def mlx_jit_modules(since: float) -> list[dict]:
    """MLX's own JIT-compiled modules (gathers, scatters, ``mx.compile`` fusions: NVRTC in its
    eval) written to its PTX cache after ``since``, in order, each with the seconds since the
    previous file (about its compile time). The folder: ``MLX_PTX_CACHE_DIR``, else MLX's
    default (``<tmp>/mlx/<version>/ptx``)."""
    folder = os.environ.get("MLX_PTX_CACHE_DIR") or os.path.join(
        tempfile.gettempdir(), "mlx", mx.__version__, "ptx"
    )
    try:
        files = [(f.stat().st_mtime, f) for f in Path(folder).glob("*.txt")]
    except OSError:
        return []
    out, last = [], since
    for t, f in sorted(files):
        if t >= since:
            out.append({"module": f.stem, "after_s": round(t - last, 3)})
            last = t
    return out


def summarize(first: list, second: list, top: int) -> dict:
    """Per class and per module path: build and eval seconds in the first and second prefill."""
    by_class: dict = defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0.0])  # calls, b1, e1, b2, e2
    by_path: dict = defaultdict(lambda: [0.0, 0.0])  # first, second (build + eval)
    for run, recs in ((0, first), (1, second)):
        for path, cls, b, e in recs:
            row = by_class[cls]
            row[0] += run == 0
            row[1 + 2 * run] += b
            row[2 + 2 * run] += e
            by_path[path][run] += b + e
    classes = [
        {
            "class": c,
            "calls": r[0],
            "build_1": r[1],
            "eval_1": r[2],
            "build_2": r[3],
            "eval_2": r[4],
            "one_time": r[1] + r[2] - r[3] - r[4],
        }  # fmt: skip
        for c, r in by_class.items()
    ]
    classes.sort(key=lambda r: -r["one_time"])
    paths = [
        {"path": p, "first": f, "second": s, "one_time": f - s} for p, (f, s) in by_path.items()
    ]
    paths.sort(key=lambda r: -r["one_time"])
    return {"classes": classes, "paths": paths[:top]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="JSON file to write")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
    p.add_argument("--shape", default=None, help="family:shape (default: the first)")
    p.add_argument("--format", default="q4_k", choices=("q4_k", "mlx4"))
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    p.add_argument("--chunk", type=int, default=2048, help="tokens per forward")
    p.add_argument("--top", type=int, default=15, help="module paths to print")
    a = p.parse_args()
    table = ds.configs(a.tiny)
    name = a.shape or next(iter(table))
    if name not in table:
        p.error(f"unknown shape {name!r}: one of {', '.join(table)}")
    config = table[name]
    started = time.time()  # wall clock: compared with the PTX cache files' times
    tic = time.perf_counter()
    model = ds.build(name, config, a.format)
    model.fuse_projections()  # as the loader does (a no-op where the builder fused)
    if affine_prefill.enabled():  # as generation.prefill does (the MLX linears' prompt rows)
        kernel_linears.use_kernels(model)
    build_s = time.perf_counter() - tic
    timer = CallTimer(model)
    prompts = [
        mx.random.randint(0, config["vocab_size"], (1, a.prompt), key=mx.random.key(i))
        for i in range(3)
    ]
    mx.eval(prompts)
    runs, recs, ahead = [], [], None
    for i, prompt in enumerate(prompts):
        timer.on, timer.records = i < 2, []
        variant = pf.Variant(model, {}, a.chunk)
        runs.append(variant.prefill(prompt))
        ahead = ahead or variant.ahead
        recs.append(timer.records)
    timer.restore()
    res = {"device": str(mx.default_device()), "shape": name, "format": a.format,
           "prompt": a.prompt, "build_s": build_s, "prefill_s": runs, "compile_ahead": ahead,
           **summarize(recs[0], recs[1], a.top)}  # fmt: skip
    print(f"{name} {a.format}: built in {build_s:.1f} s; {a.prompt}-token prefills: first "
          f"{runs[0]:.2f} s, second {runs[1]:.2f} s (both instrumented), third {runs[2]:.3f} s "
          f"(plain)")  # fmt: skip
    print(f"compile_ahead (HF2Q_COMPILE_AHEAD, within the first): {ahead}")
    print(f"\n{'class':<28}{'calls':>6}{'build 1st':>11}{'eval 1st':>10}{'build 2nd':>11}"
          f"{'eval 2nd':>10}{'one-time':>10}  (s, exclusive)")  # fmt: skip
    for r in res["classes"]:
        print(f"{r['class']:<28}{r['calls']:>6}{r['build_1']:>11.3f}{r['eval_1']:>10.3f}"
              f"{r['build_2']:>11.3f}{r['eval_2']:>10.3f}{r['one_time']:>10.3f}")  # fmt: skip
    print("\nmodules with the largest one-time cost (s, first - second, exclusive)")
    for r in res["paths"]:
        print(f"  {r['path']:<50}{r['first']:>9.3f}{r['second']:>9.3f}{r['one_time']:>9.3f}")
    res["cuda_cache"] = cuda_cache.status()
    print(f"cuda_cache: {res['cuda_cache']}")
    res["mlx_jit"] = mlx_jit_modules(started)
    print(f"MLX's own JIT modules compiled by this process: {len(res['mlx_jit'])} (seconds since "
          "the one before: about each compile)")  # fmt: skip
    for m in res["mlx_jit"]:
        print(f"  {m['after_s']:>7.3f}  {m['module'][:100]}")
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
