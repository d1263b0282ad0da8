"""Speculative decoding speed: tokens/s and acceptance against plain decoding.

``real``: Qwen2.5-Coder-1.5B-Instruct with Qwen2.5-Coder-0.5B-Instruct drafting (K = 2, 4, 6)
on code-completion prompts, and prompt lookup on an edit-this-file prompt (both GGUFs from
``hf2q-mlx fetch``); as ``stream_generate`` runs by default, the draft length adaptive (it
falls back to plain decoding where drafting does not pay); ``--fixed`` adds K drafts every
round. Each configuration runs once untimed first (its compiled traces).

``replay``: Qwen 3.5 at the 9B and 35B-A3B shapes with random Q4_K weights (``bench/qwen3_5.py``),
verified against a drafter that replays the target's own greedy output
with each draft token wrong with probability 1 - a (a = 0.5 / 0.7 / 0.9), so the numbers are the
verify cost alone (the draft is free). Plain decoding is the compiled step (B = 1, as
``stream_generate`` runs it); the verify runs on the same compiled step (``--eager`` adds the
eager verify for comparison), with K drafts every round (``replay a=.. K=..``) and with the
cost-aware draft length (``adaptive a=.. K<=..``: ``hf2q_mlx.draft_length.DraftLength`` picks
k in 0..K each round from the acceptance and verify times it measured), and both again as
pipelined rounds (``pipelined a=.. K=..``, ``pipelined adaptive a=.. K<=..``:
``hf2q_mlx.pipelined_rounds``, round r + 1 launched before round r is read; their verify time
is the steady-state period between two rounds' reads). Every configuration
runs in interleaved rounds in one process; the tables give medians. Prints a table and writes
JSON.

    python3 bench/speculative.py real --json bench/results/speculative_real.json
    python3 bench/speculative.py replay --json bench/results/speculative_replay.json
    python3 bench/speculative.py replay --tiny --rounds 1 --tokens 24   # CPU smoke test
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from hf2q_mlx.decode_step import shared_step
from hf2q_mlx.draft_length import DraftLength, RoundCosts
from hf2q_mlx.generation import make_prompt_cache, prefill, stream_generate
from hf2q_mlx.pipelined_rounds import ReplayDrafter, pipelined_rounds
from hf2q_mlx.speculative import (
    PLAIN_RUN,
    PLAIN_RUN_MAX,
    Warp,
    plain_run,
    verify_rows,
    verify_step_rows,
)

CODE_PROMPTS = [
    "def is_prime(n: int) -> bool:\n    ",
    "import numpy as np\n\n\ndef softmax(x):\n    ",
    "# Return the index of target in the sorted list items, or -1.\ndef binary_search(",
]
FILE = '''def merge_sorted(a: list[int], b: list[int]) -> list[int]:
    """Merge two sorted lists into one sorted list."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    out.extend(a[i:])
    out.extend(b[j:])
    return out
'''
EDIT_PROMPT = [
    {
        "role": "user",
        "content": "Rename the variable `out` to `merged` in this file and reply with the whole "
        f"file, nothing else:\n\n```python\n{FILE}```",
    }
]


def run(model, tok, prompt, tokens: int, **kw) -> dict:
    t0 = time.perf_counter()
    rs = list(stream_generate(model, tok, prompt, max_tokens=tokens, **kw))
    last = rs[-1]
    return {
        "tokens": [r.token for r in rs],
        "tps": last.generation_tps,
        "wall_s": time.perf_counter() - t0,
        "drafted": last.drafted_tokens,
        "accepted": last.accepted_tokens,
    }


def summarize(runs: list[dict], plain: list[dict] | None) -> dict:
    out = {
        "tps": statistics.median(r["tps"] for r in runs),
        "drafted": runs[-1]["drafted"],
        "accepted": runs[-1]["accepted"],
        "acceptance": runs[-1]["accepted"] / max(runs[-1]["drafted"], 1),
    }
    if plain is not None:
        out["speedup"] = out["tps"] / statistics.median(r["tps"] for r in plain)
        out["identical"] = all(r["tokens"] == plain[0]["tokens"] for r in runs)
    return out


def bench_real(args) -> list[dict]:
    from hf2q_mlx.io.default_model import cache_dir
    from hf2q_mlx.io.fetch import SPLIT_MODELS, cached_path
    from hf2q_mlx.io.loader import load

    names = ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")
    paths = {n: cached_path(SPLIT_MODELS[n], cache_dir()) for n in names}
    missing = [n for n, p in paths.items() if p is None]
    if missing:
        sys.exit("missing: " + ", ".join(f"hf2q-mlx fetch {n}" for n in missing))
    target, tok = load(paths["qwen2.5-coder-1.5b"])
    draft, _ = load(paths["qwen2.5-coder-0.5b"])
    configs = {"plain": {}}
    for k in args.k:
        configs[f"draft K={k}"] = dict(draft_model=draft, num_draft_tokens=k)
        if args.fixed:  # K drafts every round: the draft's acceptance and its cost
            configs[f"draft K={k} fixed"] = dict(
                draft_model=draft, num_draft_tokens=k, adaptive_drafts=False
            )
    cases = [(f"code {i}", p, configs) for i, p in enumerate(CODE_PROMPTS[: args.prompts])]
    lk = args.lookup_k
    lookup = {"plain": {}, f"lookup n=3 K={lk}": dict(prompt_lookup=3, num_draft_tokens=lk)}
    cases.append(("edit file", EDIT_PROMPT, lookup))
    rows = []
    for case, prompt, confs in cases:
        runs = {name: [] for name in confs}
        for kw in confs.values():  # untimed: compiles each configuration's traces
            run(target, tok, prompt, 8, **kw)
        for _ in range(args.rounds):  # interleaved: each round runs every configuration
            for name, kw in confs.items():
                runs[name].append(run(target, tok, prompt, args.tokens, **kw))
        for name in confs:
            row = {"case": case, "config": name, **summarize(runs[name], runs["plain"])}
            rows.append(row)
            print(row_text(row), flush=True)
    return rows


class IdsTokenizer:
    """Token ids in, nothing decoded (random weights make no text)."""

    eos_token_ids: set = set()
    bos_token_id = None
    vocab_size = None

    def detokenizer(self):
        class Detok:
            last_segment = ""

            def add_token(self, t):
                pass

            def finalize(self):
                pass

        return Detok()


def load_qwen_bench():
    path = Path(__file__).with_name("qwen3_5.py")
    spec = importlib.util.spec_from_file_location("bench_qwen3_5", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def replay_run(
    model,
    prompt: list[int],
    ref: list[int],
    k: int,
    acc: float,
    seed: int,
    kind: str = "fixed",
    memory: RoundCosts | None = None,
) -> dict:
    """Decode ``len(ref)`` tokens with drafts copied from ``ref`` (the target's greedy output),
    each wrong with probability 1 - acc, verified on the compiled step (``kind`` "fixed": K
    drafts a round; "adaptive": ``DraftLength`` picks k <= K, the verify takes k + 1 tokens, and
    k = 0 decodes a run of plain tokens (PLAIN_RUN, doubling while k = 0 wins), pipelined, as
    ``stream_generate`` does; "eager": K drafts through per-sequence caches). ``memory``: round
    costs shared across the adaptive runs of one model, as ``stream_generate`` keeps them on its
    step. Stops where the target leaves ``ref``. "pipelined" / "pipelined-adaptive": the same
    rounds pipelined (``hf2q_mlx.pipelined_rounds``, the replayed drafts drawn on the device)."""
    if kind.startswith("pipelined"):
        return replay_pipelined(model, prompt, ref, k, acc, seed, kind == "pipelined-adaptive",
                                memory)  # fmt: skip
    eager, adaptive = kind == "eager", kind == "adaptive"
    control = DraftLength(k, adaptive, memory=memory)
    rng = np.random.default_rng(seed)
    V = model.args.vocab_size
    if eager:
        cache = make_prompt_cache(model, reserve=k + 1)
        logits = prefill(model, mx.array(prompt, dtype=mx.int32), cache)

        def verify(todo, drafts):
            return verify_rows(model, cache, [todo], [drafts])[0]
    else:
        step = shared_step(model, 1, len(prompt) + len(ref) + k, reserve=k)
        step.reset_row(0)
        logits = step.prefill(0, prompt)
        if adaptive:  # as stream_generate: every verify length traced before the first round
            step.warm_verify(0, range(2, k + 2))

        def verify(todo, drafts):
            length = len(drafts) + 1 if adaptive else k + 1
            return verify_step_rows(step, [0], [todo], [drafts], length=length)[0]

    out = [int(mx.argmax(logits, axis=-1).item())]
    todo, drafted, accepted, diverged = [out[0]], 0, 0, None
    rounds, runs = [], 0  # verify times; plain runs (adaptive k = 0)
    run_length = PLAIN_RUN  # doubles while k = 0 keeps winning, as in _rounds
    t0 = time.perf_counter()
    while len(out) < len(ref):
        n = min(control.choose(), len(ref) - len(out) - 1)
        if adaptive and n == 0:  # no drafts: a run of pipelined plain decoding (as _rounds)
            m = min(run_length, len(ref) - len(out))
            run_length = min(2 * run_length, PLAIN_RUN_MAX)
            t_run, got = time.perf_counter(), []
            for tok, _ in plain_run(step, todo[0], m, Warp(), None, None):
                got.append(tok)
                if len(got) == 1:
                    t1 = time.perf_counter()
            # as _rounds: timed from the run's first token, which waited for no pipeline (a
            # one-token run: the whole run)
            t2 = time.perf_counter()
            control.observe(0, 0, (t2 - t1) / (m - 1) if m > 1 else t2 - t_run)
            if got != ref[len(out) : len(out) + m]:
                diverged = len(out)
                break
            out += got
            todo, runs = [got[-1]], runs + 1
            continue
        run_length = PLAIN_RUN
        want = ref[len(out) : len(out) + n]
        drafts = [t if rng.random() < acc else int((t + rng.integers(1, V)) % V) for t in want]
        t1 = time.perf_counter()
        res = verify(todo, drafts)
        rounds.append(time.perf_counter() - t1)
        control.observe(n, res.accepted, rounds[-1])
        drafted, accepted = drafted + n, accepted + res.accepted
        if res.tokens != ref[len(out) : len(out) + len(res.tokens)]:
            diverged = len(out)
            break
        out += res.tokens
        todo = res.todo
    elapsed = time.perf_counter() - t0
    return {
        "tps": (len(out) - 1) / elapsed,
        "drafted": drafted,
        "accepted": accepted,
        "tokens_per_round": (len(out) - 1) / max(len(rounds) + runs, 1),
        "plain_runs": runs,
        "verify_ms": 1e3 * statistics.median(rounds) if rounds else 0.0,
        "drafts_per_round": drafted / max(len(rounds) + runs, 1),
        "diverged_at": diverged,
    }


def replay_pipelined(
    model, prompt: list[int], ref: list[int], k: int, acc: float, seed: int, adaptive: bool,
    memory: RoundCosts | None,
) -> dict:  # fmt: skip
    """``replay_run`` with pipelined rounds: round r + 1 is launched before round r is read. A
    round's time is the steady-state period between two reads (the first round: from its own
    launch)."""
    control = DraftLength(k, adaptive, memory=memory)
    # as speculative_tokens: room for a round launched before the previous one's rollback
    step = shared_step(model, 1, len(prompt) + len(ref) + 2 * k, reserve=k)
    step.reset_row(0)
    logits = step.prefill(0, prompt)
    if adaptive:
        step.warm_verify(0, range(2, k + 2))
    out = [int(mx.argmax(logits, axis=-1).item())]
    drafter = ReplayDrafter(ref, len(prompt), k, acc, model.args.vocab_size, seed)
    drafted = accepted = 0
    diverged, rounds = None, []
    t0 = time.perf_counter()
    gen = pipelined_rounds(step, prompt + out, len(ref) - 1, drafter, control)
    try:
        for rnd in gen:
            rounds.append(rnd.seconds)
            drafted, accepted = drafted + rnd.drafted, accepted + rnd.accepted
            if rnd.tokens != ref[len(out) : len(out) + len(rnd.tokens)]:
                diverged = len(out)
                break
            out += rnd.tokens
    finally:
        gen.close()  # the step leaves its lazy positions (the last round in flight finishes)
    elapsed = time.perf_counter() - t0
    return {
        "tps": (len(out) - 1) / elapsed,
        "drafted": drafted,
        "accepted": accepted,
        "tokens_per_round": (len(out) - 1) / max(len(rounds), 1),
        "plain_runs": 0,
        "verify_ms": 1e3 * statistics.median(rounds) if rounds else 0.0,
        "drafts_per_round": drafted / max(len(rounds), 1),
        "diverged_at": diverged,
    }


def bench_replay(args) -> list[dict]:
    qb = load_qwen_bench()
    shapes = qb.TINY_SHAPES if args.tiny else qb.SHAPES
    names = [s for s in args.shapes.split(",") if s in shapes] if args.shapes else list(shapes)
    dtype = mx.bfloat16
    rows = []
    for name in names:
        config = shapes[name]
        model = qb.build_ours(config, dtype)
        qb.randomize_q4k(model, dtype)
        rng = np.random.default_rng(0)
        prompt = rng.integers(0, config["vocab_size"], args.prompt_tokens).tolist()
        kinds = args.kinds.split(",")
        known = ("fixed", "adaptive", "pipelined", "pipelined-adaptive")
        if any(k not in known for k in kinds):
            raise SystemExit(f"--kinds {args.kinds!r}: a comma list of {', '.join(known)}")
        kinds += ["eager"] if args.eager else []
        modes = [(a, kind) for kind in kinds for a in args.acceptance]
        plain, spec = [], {m: [] for m in modes}
        # warm-up: the compiled traces (decode, verify of K + 1, rollback), kernels
        replay_run(model, prompt, [0] * (args.k + 3), args.k, 0.5, seed=99)
        warm = run(model, IdsTokenizer(), prompt, args.tokens, ignore_eos=True)
        # the adaptive runs' round times, learned once per model (pipelined rounds apart)
        costs = {"adaptive": RoundCosts(), "pipelined-adaptive": RoundCosts()}
        for a, kind in modes:  # the adaptive runs compile the verify lengths they pick
            replay_run(model, prompt, warm["tokens"], args.k, a, seed=99, kind=kind,
                       memory=costs.get(kind))  # fmt: skip
        for r in range(args.rounds):
            p = run(model, IdsTokenizer(), prompt, args.tokens, ignore_eos=True)
            plain.append(p)
            for a, kind in modes:
                spec[a, kind].append(
                    replay_run(
                        model,
                        prompt,
                        p["tokens"],
                        args.k,
                        a,
                        seed=r,
                        kind=kind,
                        memory=costs.get(kind),
                    )  # fmt: skip
                )
        base = statistics.median(p["tps"] for p in plain)
        rows.append({"shape": name, "config": "plain compiled", "tps": base, "step_ms": 1e3 / base})
        print(row_text(rows[-1]), flush=True)
        label = {
            "fixed": "replay", "adaptive": "adaptive", "eager": "eager replay",
            "pipelined": "pipelined", "pipelined-adaptive": "pipelined adaptive",
        }  # fmt: skip
        for (a, kind), runs in spec.items():
            drafted = max(sum(x["drafted"] for x in runs), 1)
            K = f"K<={args.k}" if kind.endswith("adaptive") else f"K={args.k}"
            row = {
                "shape": name,
                "config": f"{label[kind]} a={a} {K}",
                "tps": statistics.median(x["tps"] for x in runs),
                "speedup": statistics.median(x["tps"] for x in runs) / base,
                "acceptance": sum(x["accepted"] for x in runs) / drafted,
                "tokens_per_round": statistics.median(x["tokens_per_round"] for x in runs),
                "verify_ms": statistics.median(x["verify_ms"] for x in runs),
                "drafts_per_round": statistics.median(x["drafts_per_round"] for x in runs),
                "diverged_at": [x["diverged_at"] for x in runs],
            }  # fmt: skip
            rows.append(row)
            print(row_text(row), flush=True)
        del model
        mx.clear_cache()
    return rows


def row_text(r: dict) -> str:
    head = f"{r.get('case', r.get('shape')):>10}  {r['config']:<30} {r['tps']:8.1f} tok/s"
    if "speedup" in r:
        head += f"  x{r['speedup']:.2f}"
    if "acceptance" in r:
        head += f"  acceptance {r['acceptance']:.2f}"
    if "verify_ms" in r:
        head += f"  verify {r['verify_ms']:.1f} ms, {r['tokens_per_round']:.2f} tok/round"
    if "drafts_per_round" in r:
        head += f", {r['drafts_per_round']:.2f} drafts/round"
    if r.get("identical") is False or any(d is not None for d in r.get("diverged_at", [])):
        head += "  (output differs from plain decoding)"
    return head


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("real", help="Qwen2.5-Coder 0.5B drafting for 1.5B; prompt lookup")
    p.add_argument("--k", type=int, nargs="+", default=[2, 4, 6])
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompts", type=int, default=3, help="code prompts to run (3)")
    p.add_argument("--lookup-k", type=int, default=8, help="drafts per prompt-lookup round")
    p.add_argument("--fixed", action="store_true", help="also each K with adaptive_drafts off")
    p.add_argument("--json")
    p = sub.add_parser("replay", help="Qwen 3.5 9B / 35B-A3B shapes, replayed drafts")
    p.add_argument("--shapes", default=None, help="comma list (9b,35b-a3b; tiny,tiny-moe)")
    p.add_argument("--tiny", action="store_true", help="small shapes (CPU smoke test)")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--acceptance", type=float, nargs="+", default=[0.5, 0.7, 0.9])
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--eager", action="store_true", help="also the eager verify")
    p.add_argument("--kinds", default="fixed,adaptive,pipelined,pipelined-adaptive",
                   help="comma list of the round kinds to run")  # fmt: skip
    p.add_argument("--json")
    args = parser.parse_args(argv)
    rows = bench_real(args) if args.mode == "real" else bench_replay(args)
    if args.json:
        meta = {"device": str(mx.default_device()), "mlx": mx.__version__, "args": vars(args)}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
