"""``hf2q-mlx embed``: sentence embeddings of texts (arguments, a file or stdin), printed as JSON
or as a short summary with the texts' cosine similarities."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hf2q_mlx.errors import InvalidArgumentError

DEFAULT_EMBEDDING_MODEL = "embeddinggemma-300m"
MAX_SIMILARITY_TABLE = 10  # texts beyond this get no similarity table in the summary


def add_embed_parser(sub: Any) -> None:
    p = sub.add_parser("embed", help="sentence embeddings of texts (EmbeddingGemma)")
    p.add_argument("texts", nargs="*", metavar="TEXT", help="texts to embed ('-' reads stdin)")
    p.add_argument(
        "--model",
        metavar="PATH",
        default=DEFAULT_EMBEDDING_MODEL,
        help=f"sentence-transformers folder or a name from `hf2q-mlx models` "
        f"(default: {DEFAULT_EMBEDDING_MODEL})",
    )
    p.add_argument("--file", metavar="FILE", help="UTF-8 file with one text per line")
    p.add_argument("--prompt-name", metavar="NAME", help="task prompt, e.g. query or document")
    p.add_argument("--prompt", metavar="TEXT", help="text prepended to every input")
    p.add_argument("--dimensions", type=int, help="keep the first D values (Matryoshka)")
    p.add_argument("--batch-size", type=int, default=32, help="texts per forward pass (32)")
    p.add_argument("--no-normalize", action="store_true", help="skip the L2 normalization")
    p.add_argument("--json", action="store_true", help="print one JSON object with the vectors")
    p.add_argument("--quiet", action="store_true", help="no fetch progress on stderr")


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def read_texts(args: argparse.Namespace) -> list[str]:
    """The TEXT arguments, else the --file lines, else stdin's lines ('-' reads stdin too)."""
    if args.texts and args.file:
        raise InvalidArgumentError("give texts as arguments or with --file, not both")
    if args.file:
        try:
            texts = _lines(Path(args.file).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as err:
            raise InvalidArgumentError(f"cannot read text file {args.file}: {err}") from None
    elif args.texts and args.texts != ["-"]:
        texts = list(args.texts)
    else:
        texts = _lines(sys.stdin.read())
    if not texts:
        raise InvalidArgumentError("no text to embed: give TEXT arguments, --file or stdin lines")
    return texts


def cmd_embed(args: argparse.Namespace, load: Callable[[str, bool], tuple]) -> int:
    """``load(path, quiet) -> (model, tokenizer)`` is the CLI's loader (names fetch on use)."""
    import numpy as np

    from hf2q_mlx.embedding import embed, embedding_spec

    texts = read_texts(args)
    model, tokenizer = load(args.model, args.quiet)
    embedding_spec(model)  # "not an embedding model" before any other complaint
    vectors = embed(
        model,
        tokenizer,
        texts,
        prompt_name=args.prompt_name,
        prompt=args.prompt,
        batch_size=args.batch_size,
        normalize=not args.no_normalize,
        dimensions=args.dimensions,
    )
    v = np.array(vectors)
    if args.json:
        out = {
            "model": args.model,
            "prompt_name": args.prompt_name,
            "dimensions": v.shape[1],
            "embeddings": v.tolist(),
        }
        print(json.dumps(out))
        return 0
    prompt = f", prompt {args.prompt_name!r}" if args.prompt_name else ""
    print(f"{len(texts)} text(s) -> {v.shape[1]} dims ({args.model}{prompt})")
    for i, (text, row) in enumerate(zip(texts, v)):
        head = " ".join(f"{x:+.4f}" for x in row[:4])
        short = text if len(text) <= 50 else text[:47] + "..."
        print(f"[{i}] {head} ... |v|={np.linalg.norm(row):.4f}  {short!r}")
    if 1 < len(texts) <= MAX_SIMILARITY_TABLE:
        unit = v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)
        sims = unit @ unit.T
        print("cosine similarity:")
        print("     " + "".join(f"{f'[{j}]':>8}" for j in range(len(texts))))
        for i, row in enumerate(sims):
            print(f"{f'[{i}]':>5}" + "".join(f"{x:8.4f}" for x in row))
    return 0
