"""Decode speed of the compiled step (``hf2q_mlx.decode_step.DecodeStep``) against our eager
per-sequence decode and mlx-lm, at real shapes with random weights, in interleaved rounds.

Per shape: ours with GGML Q4_K weights and with MLX 4-bit weights, each decoded eagerly (a new
graph per token, as ``stream_generate`` does) and through the compiled step at B = 1 and at
B = ``--batch`` rows (aggregate tokens/s); mlx-lm 0.32.2 on the same MLX 4-bit arrays. One
prompt prefill per variant, then ``--rounds`` rounds in which every variant decodes ``--tokens``
greedy tokens in turn. Prints median and min-max tok/s, the ratio to mlx-lm round by round, and
whether compiled and eager pick the same greedy tokens; writes JSON. ``--mma-ab`` adds the
compiled GGML variants with the tensor-core kernels off (``qmatmul_mma.ENABLED`` False while
they trace and run: the scalar mat-vec and dense GLU), the A/B of those kernels in one process;
``--router-split-ab`` the compiled B = 1 variants with the MoE router split off and on
(``moe_router.SPLIT``), ``--down-slots-ab`` with the experts' slot-parallel down kernel off and
on (``expert_down.SLOT_TEAMS`` 0 and 8). ``--patch module.ATTR=VALUE`` (repeatable) adds the
batched compiled variant with ``hf2q_mlx.custom_kernels.<module>.ATTR`` set while it traces and
runs (e.g. ``expert_down.SLOT_ROWS=8``): kernel switches A/B'd at B rows in one process.

    python3 bench/decode_step.py OUT.json --shapes gemma4:26b-a4b,qwen3_5:35b-a3b
    python3 bench/decode_step.py OUT.json --tiny          # CPU smoke run
    python3 bench/decode_step.py OUT.json --shapes qwen3_5:9b --formats q4_k --mma-ab --no-mlx-lm
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).parent))

import gemma4 as g4bench  # noqa: E402  (bench/gemma4.py)
import qwen3_5 as q35bench  # noqa: E402  (bench/qwen3_5.py)

from hf2q_mlx.custom_kernels import expert_down, moe_router, qmatmul_mma  # noqa: E402
from hf2q_mlx.decode_step import DecodeStep  # noqa: E402
from hf2q_mlx.models import gemma4  # noqa: E402


def model_dtype() -> mx.Dtype:
    return mx.bfloat16 if mx.default_device().type == mx.DeviceType.gpu else mx.float32


def configs(tiny: bool) -> dict:
    g = g4bench.TINY if tiny else g4bench.SHAPES
    q = q35bench.TINY_SHAPES if tiny else q35bench.SHAPES
    return {**{f"gemma4:{k}": v for k, v in g.items()}, **{f"qwen3_5:{k}": v for k, v in q.items()}}


def build(name: str, config: dict, fmt: str):
    dt = model_dtype()
    if name.startswith("gemma4"):
        args = gemma4.ModelArgs.from_dict(config)
        return g4bench.build_ggml(args, dt) if fmt == "q4_k" else g4bench.build_mlx4(args, dt)
    model = q35bench.build_ours(config, dt)
    if fmt == "q4_k":
        q35bench.randomize_q4k(model, dt)
    else:
        q35bench.randomize_mlx_quantized(model, dt)
        q35bench.cast_floats(model, dt)
    return model


def mlx_lm_twin(name: str, config: dict, ours):
    if not name.startswith("gemma4"):
        return q35bench.mlx_lm_twin(ours, config)
    if q35bench.import_mlx_lm("cache") is None:  # one way of importing mlx-lm's model files
        return None
    lm = (q35bench.import_mlx_lm("gemma4_text"), q35bench.import_mlx_lm("cache"))
    return g4bench.build_mlx_lm(lm, config, ours)


def cache_arrays(cache: list) -> list:
    return q35bench.cache_arrays(cache)


class Eager:
    """A new graph per token through per-sequence caches, pipelined with async_eval."""

    def __init__(self, model, prompt: mx.array):
        self.model, self.cache = model, model.make_cache()
        self.y = mx.argmax(model(prompt, self.cache)[:, -1, :], axis=-1)
        mx.eval(self.y, cache_arrays(self.cache))
        self.rows = 1

    def run(self, n: int) -> list[int]:
        out, y = [], self.y
        for _ in range(n):
            y = mx.argmax(self.model(y[:, None], self.cache)[:, -1, :], axis=-1)
            mx.async_eval(y)
            out.append(y)
        mx.eval(out)
        self.y = y
        return [int(t.item()) for t in out]


MMA_OFF = {(qmatmul_mma, "ENABLED"): False}  # the scalar mat-vec and dense GLU kernels


class Compiled:
    """``DecodeStep`` with ``rows`` rows, row r prefilled with the prompt rolled by r tokens (rows
    of one prompt would all route to the same experts, a MoE step cheaper than serving's); ``patch``
    {(module, attribute): value} set whenever this variant traces or runs (a switch such as
    ``qmatmul_mma.ENABLED`` False: the tensor-core kernels off)."""

    def __init__(self, model, prompt: mx.array, rows: int, max_len: int, patch=None):
        self.patch = patch or {}
        self.step = DecodeStep(model, max_batch=rows, max_len=max_len)
        first = []
        for r in range(rows):
            cache = model.make_cache()
            y = mx.argmax(model(mx.roll(prompt, r, axis=-1), cache)[:, -1, :], axis=-1)
            mx.eval(y, cache_arrays(cache))
            self.step.adopt(r, cache)
            first.append(y)
        self.y = mx.concatenate(first).astype(mx.int32)  # (rows,)
        self.rows = rows

    def run(self, n: int) -> list[int]:
        out, y = [], self.y
        # a trace (the first call, a new span bucket) picks its kernels by the switches
        saved = {(m, k): getattr(m, k) for m, k in self.patch}
        for (m, k), v in self.patch.items():
            setattr(m, k, v)
        try:
            for _ in range(n):
                y = self.step.decode(y, greedy=True)
                mx.async_eval(y)
                out.append(y)
            mx.eval(out)
        finally:
            for (m, k), v in saved.items():
                setattr(m, k, v)
        self.y = y
        return [int(t[0].item()) for t in out]


def parse_patch(text: str) -> dict:
    """ "module.ATTR=VALUE" -> {(hf2q_mlx.custom_kernels.module, ATTR): VALUE} (an int where
    VALUE is one, else the string); the attribute must exist."""
    target, sep, value = text.partition("=")
    mod_name, dot, attr = target.strip().rpartition(".")
    if not sep or not dot:
        raise ValueError(f"--patch {text!r}: expected module.ATTR=VALUE")
    try:
        module = importlib.import_module(f"hf2q_mlx.custom_kernels.{mod_name}")
    except ImportError:
        raise ValueError(
            f"--patch {text!r}: no module hf2q_mlx.custom_kernels.{mod_name}"
        ) from None
    if not hasattr(module, attr):
        raise ValueError(f"--patch {text!r}: {mod_name} has no attribute {attr}")
    v = value.strip()
    return {(module, attr): int(v) if v.lstrip("-").isdigit() else v}


def run_shape(name: str, config: dict, a) -> dict:
    vocab = config["vocab_size"]
    prompt = mx.random.randint(0, vocab, (1, a.prompt), key=mx.random.key(0))
    max_len = a.prompt + (a.rounds + 1) * a.tokens + 8
    variants, models, twin = {}, {}, None
    for fmt in a.formats:
        tic = time.perf_counter()
        model = models[fmt] = build(name, config, fmt)
        if fmt == "mlx4" and not a.no_mlx_lm:
            twin = mlx_lm_twin(name, config, model)  # from the unfused parameter names
        model.fuse_projections()  # as the loader does (a no-op where the builder fused)
        print(f"{name} {fmt}: built in {time.perf_counter() - tic:.1f} s", flush=True)
        made = {  # each prefills the prompt when made: only the selected variants are
            f"{fmt} eager": lambda m=model: Eager(m, prompt),
            f"{fmt} compiled B=1": lambda m=model: Compiled(m, prompt, 1, max_len),
        }
        if a.batch > 1 and fmt == a.formats[0]:
            made[f"{fmt} compiled B={a.batch}"] = lambda m=model: Compiled(
                m, prompt, a.batch, max_len
            )
        if a.batch > 1 and fmt == a.formats[0]:
            for text, patch in a.patch:
                made[f"{fmt} compiled B={a.batch} {text}"] = lambda m=model, p=patch: Compiled(
                    m, prompt, a.batch, max_len, patch=p
                )
        if a.mma_ab and fmt == "q4_k":
            made[f"{fmt} compiled B=1 scalar"] = lambda m=model: Compiled(
                m, prompt, 1, max_len, patch=MMA_OFF
            )
            if a.batch > 1:
                made[f"{fmt} compiled B={a.batch} scalar"] = lambda m=model: Compiled(
                    m, prompt, a.batch, max_len, patch=MMA_OFF
                )
        if a.router_split_ab:  # the MoE router over G threadgroups per row, off and on
            for on in (False, True):
                made[f"{fmt} compiled B=1 split={int(on)}"] = lambda m=model, on=on: Compiled(
                    m, prompt, 1, max_len, patch={(moe_router, "SPLIT"): on}
                )
        if a.down_slots_ab and fmt == "q4_k":  # the GGML experts' down: slots over SIMD groups
            for teams in (0, 8):
                made[f"{fmt} compiled B=1 slots={teams}"] = lambda m=model, t=teams: Compiled(
                    m, prompt, 1, max_len, patch={(expert_down, "SLOT_TEAMS"): t}
                )
        for k, make in made.items():
            if not a.variants or any(w in k for w in a.variants):
                variants[k] = make()
    if twin is not None:
        variants["mlx-lm mlx4"] = Eager(twin, prompt)
    for v in variants.values():  # warm-up: kernels compiled, graphs traced
        v.run(3)
    rates = {k: [] for k in variants}
    tokens = {k: [] for k in variants}
    for r in range(a.rounds):
        for k, v in variants.items():
            tic = time.perf_counter()
            tokens[k] += v.run(a.tokens)
            rates[k].append(v.rows * a.tokens / (time.perf_counter() - tic))
        print(f"{name} round {r}: " + ", ".join(f"{k} {rates[k][-1]:.1f}" for k in rates),
              flush=True)  # fmt: skip
    out = {"shape": name, "prompt": a.prompt, "tokens_per_round": a.tokens, "variants": {}}
    ref = rates.get("mlx-lm mlx4")
    for k, rs in rates.items():
        row = {"tok_s": rs, "median": statistics.median(rs), "min": min(rs), "max": max(rs)}
        if ref:
            ratios = [x / y for x, y in zip(rs, ref)]
            row["ratio_to_mlx_lm_median"] = statistics.median(ratios)
        out["variants"][k] = row
    for fmt in a.formats:
        e, c = tokens.get(f"{fmt} eager"), tokens.get(f"{fmt} compiled B=1")
        if e and c:  # bf16: fused elementwise rounds differently, near-ties may flip
            out[f"{fmt}_compiled_equals_eager_tokens"] = e == c
    del variants, models
    gc.collect()
    mx.clear_cache()
    return out


def report(res: dict) -> None:
    rounds = len(next(iter(res["variants"].values()))["tok_s"])
    print(f"\n{res['shape']}: decode tok/s over {rounds} interleaved rounds (B rows: aggregate)")
    for k, r in res["variants"].items():
        ratio = r.get("ratio_to_mlx_lm_median")
        ratio = f"  x{ratio:.2f} mlx-lm" if ratio is not None else ""
        print(f"  {k:<28} {r['median']:8.1f}  [{r['min']:.1f}-{r['max']:.1f}]{ratio}")
    for k, v in res.items():
        if k.endswith("_equals_eager_tokens"):
            print(f"  {k}: {v}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="JSON file to write")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
    p.add_argument("--shapes", default=None, help="comma list of family:shape")
    p.add_argument("--formats", default="q4_k,mlx4")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--tokens", type=int, default=32, help="tokens per variant per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch", type=int, default=8, help="rows of the batched compiled variant")
    p.add_argument("--no-mlx-lm", action="store_true")
    p.add_argument("--mma-ab", action="store_true", help="also the GGML compiled variants with "
                   "the tensor-core kernels off")  # fmt: skip
    p.add_argument(
        "--router-split-ab",
        action="store_true",
        help="also the compiled B=1 "
        "variants with moe_router.SPLIT off and on while they trace and run",
    )
    p.add_argument("--down-slots-ab", action="store_true", help="also the compiled B=1 Q4_K "
                   "variants with expert_down.SLOT_TEAMS 0 and 8")  # fmt: skip
    p.add_argument("--variants", default=None, help='only variants containing one of these '
                   'comma-separated strings, e.g. "compiled B=1"')  # fmt: skip
    p.add_argument("--patch", action="append", default=[], help="module.ATTR=VALUE of "
                   "hf2q_mlx.custom_kernels: one more batched variant with it set")  # fmt: skip
    a = p.parse_args(argv)
    try:
        a.patch = [(t, parse_patch(t)) for t in a.patch]
    except ValueError as err:
        p.error(str(err))
    a.variants = a.variants.split(",") if a.variants else None
    a.formats = a.formats.split(",")
    table = configs(a.tiny)
    names = a.shapes.split(",") if a.shapes else list(table)
    results = []
    for name in names:
        results.append(run_shape(name, table[name], a))
        report(results[-1])
        Path(a.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
