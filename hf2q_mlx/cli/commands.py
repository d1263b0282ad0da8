"""The ``hf2q-mlx`` command line: generate, chat, info, models, fetch, perplexity, bench, serve,
embed.

Every caller error (an ``Hf2qError``) prints ``error: <message>`` on one line of stderr and
exits with status 2; Ctrl-C exits with status 130 without a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

from hf2q_mlx.errors import Hf2qError, ModelNotFoundError

EXIT_ERROR = 2
EXIT_INTERRUPT = 130


def _common_parents() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    model = argparse.ArgumentParser(add_help=False)
    model.add_argument(
        "--model",
        metavar="PATH",
        help="GGUF file, model directory or a name from `hf2q-mlx models` (default: the demo "
        "model; for chat the instruction-tuned chat model)",
    )
    model.add_argument(
        "--kv-bits",
        metavar="B[,BV]",
        default=None,
        help="TurboQuant KV cache bits (2,3,4,5,6,8), e.g. 8 or 8,4 for K8/V4 (default: fp). "
        "Measured (docs/turboquant.md): 8 is lossless; recommended 4 for Qwen2.5-Coder 1.5B "
        "(+0.8 %% perplexity), 8,4 for the 0.5B (+0.3 %%; 4 costs it +7 %%), 6,5 for Gemma 3 "
        "270M (+0.6 %%)",
    )
    sampling = argparse.ArgumentParser(add_help=False)
    g = sampling.add_argument_group("generation")
    g.add_argument("--max-tokens", type=int, default=256, help="tokens to generate (256)")
    g.add_argument("--temperature", "--temp", type=float, default=0.0, help="0 = greedy (0)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1] (1 = off)")
    g.add_argument("--min-p", type=float, default=0.0, help="min prob. relative to the top (0)")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages (1)")
    g.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--system", default=None, help="system prompt for the chat template")
    g = sampling.add_argument_group("speculative decoding (docs/speculative.md)")
    g.add_argument("--draft-model", metavar="PATH", help="draft model sharing the tokenizer")
    g.add_argument("--num-draft", type=int, default=4, help="most tokens drafted per verify (4)")
    g.add_argument("--prompt-lookup", type=int, metavar="N", help="draft from n-gram lookup")
    g.add_argument(
        "--fixed-draft", action="store_true", help="always draft --num-draft tokens (no adapting)"
    )
    return model, sampling


def build_parser() -> argparse.ArgumentParser:
    model, sampling = _common_parents()
    parser = argparse.ArgumentParser(
        prog="hf2q-mlx", description="Run GGUF and Hugging Face LLMs on MLX."
    )
    from hf2q_mlx import __version__

    parser.add_argument("--version", action="version", version=f"hf2q-mlx {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("generate", parents=[model, sampling], help="complete one prompt")
    p.add_argument("prompt", help="prompt text ('-' reads stdin)")
    p.add_argument(
        "--raw", action="store_true", help="send the text as is, without the chat template"
    )
    p.add_argument("--quiet", action="store_true", help="no speed statistics on stderr")

    p = sub.add_parser("chat", parents=[model, sampling], help="interactive chat (/reset, /exit)")
    p.add_argument("--quiet", action="store_true", help="no speed statistics on stderr")

    p = sub.add_parser("info", help="describe a GGUF file or HF directory (headers only)")
    p.add_argument("file", help="GGUF file or Hugging Face model directory")

    p = sub.add_parser("models", help="real models known to work, their size and fetch command")

    p = sub.add_parser("fetch", help="download a model `hf2q-mlx models` lists into the cache")
    p.add_argument("name", help="a name from `hf2q-mlx models`, e.g. qwen2.5-coder-0.5b")
    p.add_argument("--quiet", action="store_true", help="no progress bar on stderr")

    p = sub.add_parser("perplexity", parents=[model], help="perplexity of a text file")
    p.add_argument("--file", required=True, help="UTF-8 text file")
    p.add_argument("--context", type=int, default=1024, help="window length in tokens (1024)")
    p.add_argument("--batch-size", type=int, default=1, help="windows per forward pass (1)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--quiet", action="store_true", help="no progress bar on stderr")

    p = sub.add_parser("bench", parents=[model], help="prompt and decode speed")
    p.add_argument("--prompt-tokens", type=int, default=512, help="prompt length (512)")
    p.add_argument("--gen-tokens", type=int, default=128, help="tokens to decode (128)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--output", metavar="FILE", help="also write the JSON result to FILE")
    p.add_argument(
        "--profile", action="store_true", help="also time one decode step per op and layer"
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar on stderr")

    from hf2q_mlx.serving.serve import add_serve_parser

    add_serve_parser(sub, model)
    from hf2q_mlx.cli.embed import add_embed_parser

    add_embed_parser(sub)
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse ``argv``; an unknown option is reported with its subcommand's usage line."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        sub.choices[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def _load(path: str | None, quiet: bool = False, chat: bool = False):
    """(model, tokenizer): PATH, a name from `hf2q-mlx models`, or the default for the command
    (the instruction-tuned chat model for ``chat``, the base demo model otherwise)."""
    from hf2q_mlx.custom_kernels import cuda_cache
    from hf2q_mlx.io import default_model
    from hf2q_mlx.io.loader import load

    if not quiet:  # a new machine's first run compiles the GPU kernels: say why it waits
        cuda_cache.set_notifier(lambda msg: print(msg, file=sys.stderr, flush=True))
    if path is None:
        name = default_model.DEFAULT_CHAT_MODEL if chat else default_model.DEMO_MODEL
        return load(default_model.known_model_path(name, progress=not quiet))
    if not Path(path).exists():
        if path in {m.name for m in default_model.KNOWN_MODELS}:
            return load(default_model.known_model_path(path, progress=not quiet))
        raise ModelNotFoundError(f"model not found: {path}{default_model.missing_model_hint(path)}")
    return load(path)


def _generation_options(args: argparse.Namespace) -> dict[str, Any]:
    from hf2q_mlx.generation import check_generation_arguments
    from hf2q_mlx.sampling import validate_sampling_options

    opts = dict(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
    )
    # before the model loads, so bad flags fail fast
    validate_sampling_options(**opts)
    extra = dict(max_tokens=args.max_tokens, seed=args.seed, stop=args.stop)
    check_generation_arguments(**extra, kv_bits=args.kv_bits)
    spec = dict(
        num_draft_tokens=args.num_draft,
        prompt_lookup=args.prompt_lookup,
        adaptive_drafts=not args.fixed_draft,
    )
    if args.draft_model is not None or args.prompt_lookup is not None:
        from hf2q_mlx.speculative import check_speculative_arguments

        check_speculative_arguments(args.draft_model, **spec)
    return {**opts, **extra, **spec, "kv_bits": _kv_bits(args)}


def _draft(args: argparse.Namespace, opts: dict[str, Any]) -> dict[str, Any]:
    """``opts`` with the loaded --draft-model (after the target, so path errors come first)."""
    if args.draft_model is None:
        return opts
    return {**opts, "draft_model": _load(args.draft_model, args.quiet)[0]}


def _kv_bits(args: argparse.Namespace):
    from hf2q_mlx.generation import parse_kv_bits

    return parse_kv_bits(args.kv_bits)


def _messages(system: str | None) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}] if system else []


def _stream(model, tokenizer, prompt, opts: dict[str, Any], quiet: bool) -> str:
    from hf2q_mlx.generation import format_stats, stream_generate

    parts = []
    last = None
    for last in stream_generate(model, tokenizer, prompt, **opts):
        print(last.text, end="", flush=True)
        parts.append(last.text)
    print(flush=True)
    if last is not None and not quiet:
        print(format_stats(last), file=sys.stderr, flush=True)
    return "".join(parts)


def cmd_generate(args: argparse.Namespace) -> int:
    opts = _generation_options(args)
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    model, tokenizer = _load(args.model, args.quiet)
    opts = _draft(args, opts)
    # a model whose files carry no chat template (a base model) gets the text as it is
    templated = getattr(tokenizer, "chat_template", None) and not getattr(
        tokenizer, "chat_template_is_builtin", False
    )
    if args.raw or not templated:
        prompt: Any = text if args.system is None else f"{args.system}\n\n{text}"
    else:
        prompt = _messages(args.system) + [{"role": "user", "content": text}]
    _stream(model, tokenizer, prompt, opts, args.quiet)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from hf2q_mlx.errors import ContextLengthError, TokenizerError

    opts = _generation_options(args)
    model, tokenizer = _load(args.model, args.quiet, chat=True)
    opts = _draft(args, opts)
    if not getattr(tokenizer, "chat_template", None):
        raise TokenizerError("this model has no chat template; use `hf2q-mlx generate --raw`")
    if getattr(tokenizer, "chat_template_is_builtin", False):
        # said once here, not as the API's warning on every turn
        warnings.filterwarnings("ignore", message="this model's files carry no chat template")
        print(
            "warning: this model's files carry no chat template (a base model?): using a generic "
            "one, replies may be poor; `hf2q-mlx chat` without --model uses an instruction-tuned "
            "model",
            file=sys.stderr,
        )
    messages = _messages(args.system)
    print("chat: /reset clears the conversation, /exit or Ctrl-D quits", file=sys.stderr)
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            print()
            return 0
        command = line.strip()
        if not command:
            continue
        if command in ("/exit", "/quit"):
            return 0
        if command == "/reset":
            messages = _messages(args.system)
            print("(conversation cleared)", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": line})
        try:
            reply = _stream(model, tokenizer, messages, opts, args.quiet)
        except ContextLengthError as err:
            messages.pop()
            print(f"error: {err}; /reset to start over", file=sys.stderr)
            continue
        messages.append({"role": "assistant", "content": reply})


def cmd_info(args: argparse.Namespace) -> int:
    from hf2q_mlx.cli.info import describe

    if not Path(args.file).exists():
        raise ModelNotFoundError(f"file not found: {args.file}")
    print(describe(args.file))
    return 0


def cmd_perplexity(args: argparse.Namespace) -> int:
    from hf2q_mlx.cli.perplexity import check_perplexity_options, perplexity

    try:
        text = Path(args.file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise Hf2qError(f"cannot read text file {args.file}: {err}") from None
    kv_bits = _kv_bits(args)
    check_perplexity_options(args.context, args.batch_size)  # before the model loads
    model, tokenizer = _load(args.model, args.quiet)
    tokens = tokenizer.encode(text, add_special_tokens=False)
    # a tokenizer that starts every text with BOS gets one at the start of every window
    bos = tokenizer.bos_token_id
    adds_bos = bos is not None and tokenizer.encode("a", add_special_tokens=True)[:1] == [bos]
    result = perplexity(
        model,
        tokens,
        args.context,
        args.batch_size,
        bos_token_id=bos if adds_bos else None,
        kv_bits=kv_bits,
        progress=not args.quiet,
    )
    if args.json:
        out = {
            "ppl": result.ppl,
            "nll": result.nll,
            "n_tokens": result.n_tokens,
            "context": args.context,
            "kv_bits": list(kv_bits) if kv_bits else None,
            "file": args.file,
        }
        print(json.dumps(out))
    else:
        print(f"ppl: {result.ppl:.4f}")
        print(f"nll: {result.nll:.4f} nats/token over {result.n_tokens} tokens")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from hf2q_mlx.cli.bench import check_bench_options, run_bench

    kv_bits = _kv_bits(args)
    check_bench_options(args.prompt_tokens, args.gen_tokens)  # before the model loads
    model, tokenizer = _load(args.model, args.quiet)
    result = run_bench(
        model,
        tokenizer,
        args.prompt_tokens,
        args.gen_tokens,
        kv_bits=kv_bits,
        progress=not args.quiet,
    )
    result["model_path"] = args.model or "default demo model"
    if args.profile:
        import mlx.core as mx

        from hf2q_mlx.cli.bench import random_prompt
        from hf2q_mlx.cli.profile import format_profile, profile_decode_step
        from hf2q_mlx.generation import make_prompt_cache, prefill

        prompt = random_prompt(tokenizer, min(args.prompt_tokens, 64))
        cache = make_prompt_cache(model, kv_bits)
        prefill(model, mx.array(prompt, mx.int32), cache)
        result["profile"] = profile_decode_step(model, cache, prompt[-1])
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result))
        return 0
    for key in ("prompt_tps", "decode_tps", "ttft_s", "peak_memory_gb", "decode_step_ops"):
        print(f"{key}: {result[key]}")
    print(f"prompt/gen tokens: {result['prompt_tokens']}/{result['gen_tokens']}")
    print(f"device: {result['device']}, mlx {result['mlx_version']}")
    if args.profile:
        print(format_profile(result["profile"]))
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from hf2q_mlx.io.default_model import format_known_models

    print(format_known_models())
    return 0


def cmd_fetch(args: argparse.Namespace) -> int:
    from hf2q_mlx.io.default_model import cache_dir, known_model_path
    from hf2q_mlx.io.fetch import SPLIT_MODELS, cached_path

    split = SPLIT_MODELS.get(args.name)
    # checked before the fetch: a cached file returns at once (size + hash marker, no download)
    was_cached = split is not None and cached_path(split, cache_dir()) is not None
    path = known_model_path(args.name, progress=not args.quiet)
    if was_cached and not args.quiet:
        print(f"{args.name} is already in the cache, nothing to fetch", file=sys.stderr)
    print(path)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from hf2q_mlx.serving.serve import cmd_serve as serve

    return serve(args, lambda path: _load(path, chat=True))


def cmd_embed(args: argparse.Namespace) -> int:
    from hf2q_mlx.cli.embed import cmd_embed as embed

    return embed(args, _load)


COMMANDS = {
    "generate": cmd_generate,
    "models": cmd_models,
    "fetch": cmd_fetch,
    "chat": cmd_chat,
    "info": cmd_info,
    "perplexity": cmd_perplexity,
    "bench": cmd_bench,
    "serve": cmd_serve,
    "embed": cmd_embed,
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``hf2q-mlx`` and ``python -m hf2q_mlx``; returns the exit status."""
    args = parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except Hf2qError as err:
        print("error: " + " ".join(str(err).split()), file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return EXIT_INTERRUPT
    except BrokenPipeError:
        # the reader (e.g. `| head`) went away: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
