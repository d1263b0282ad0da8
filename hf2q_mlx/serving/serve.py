"""``hf2q-mlx serve``: load a model, start the engine thread and run uvicorn; ``ServerThread``
runs the same server inside a thread (tests, benchmarks, notebooks)."""

from __future__ import annotations

import argparse
import socket
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hf2q_mlx.errors import Hf2qError, InvalidArgumentError

if TYPE_CHECKING:  # the CLI imports this module for its parser: no MLX import at module level
    from hf2q_mlx.serving.embedding_worker import EmbeddingWorker
    from hf2q_mlx.serving.engine import Engine


def _require_serve_extra() -> None:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise Hf2qError(
            'hf2q-mlx serve needs FastAPI and uvicorn: pip install "hf2q-mlx[serve]" '
            "(or pip install fastapi uvicorn)"
        ) from None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerThread:
    """The HTTP server for ``engine`` on ``host:port`` in a daemon thread; ``stop()`` ends both."""

    def __init__(
        self,
        engine: Engine | EmbeddingWorker,
        model_id: str,
        host: str = "127.0.0.1",
        port: int = 0,
    ):
        _require_serve_extra()
        import uvicorn

        from hf2q_mlx.serving.app import create_app

        self.engine = engine.start()
        self.host, self.port = host, port or free_port(host)
        config = uvicorn.Config(
            create_app(engine, model_id), host=self.host, port=self.port, log_level="warning"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="hf2q-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise Hf2qError(f"the server did not start on {self.url}")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.engine.shutdown()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def add_serve_parser(sub: Any, model_parent: argparse.ArgumentParser) -> None:
    """The ``serve`` subcommand's options (``--model`` and ``--kv-bits`` come from the parent)."""
    p = sub.add_parser("serve", parents=[model_parent], help="OpenAI-compatible HTTP server")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="TCP port (8080)")
    p.add_argument("--max-batch", type=int, default=8, help="streams decoded together (8)")
    p.add_argument("--max-queue", type=int, default=64, help="waiting requests before 429 (64)")
    p.add_argument("--max-len", type=int, default=None, help="tokens per stream (model context)")
    p.add_argument("--prefill-chunk", type=int, default=512, help="prompt tokens per step (512)")
    p.add_argument(
        "--prefix-cache-mb", type=int, default=256, help="prefix reuse memory (256 MB; 0 = off)"
    )
    p.add_argument("--model-id", default=None, help="model name clients send (the --model value)")
    p.add_argument(
        "--step",
        choices=STEPS,
        default="auto",
        help="decode step: auto (batched on a GPU, per row on the CPU), batched (one compiled "
        "step for all rows: faster on the CPU when most rows are busy), sequential (per row)",
    )
    p.add_argument(
        "--batch-prefill",
        action="store_true",
        help="prompt chunks of several streams in one forward pass (the batched GPU step)",
    )
    p.add_argument(
        "--no-warmup",
        action="store_true",
        help="listen at once; by default a GPU server first builds the kernels, traces and "
        "CUDA graphs of each prompt-length bucket, sampling class and attention span",
    )


# --step -> Engine(compiled=...): None lets make_step pick (the batched step on a GPU only)
STEPS = {"auto": None, "batched": True, "sequential": False}


def _embedding_worker(args: argparse.Namespace, model: Any, tokenizer: Any) -> EmbeddingWorker:
    """The worker of an embedding model; refuses the options that only text generation has."""
    from hf2q_mlx.serving.embedding_worker import EmbeddingWorker

    given = [flag for flag, on in (("--kv-bits", args.kv_bits is not None),
                                   ("--batch-prefill", args.batch_prefill),
                                   ("--max-len", args.max_len is not None),
                                   ("--step", args.step != "auto"),
                                   ("--no-warmup", args.no_warmup)) if on]  # fmt: skip
    if given:
        raise InvalidArgumentError(
            f"{', '.join(given)}: options of text generation; this is an embedding model"
        )
    return EmbeddingWorker(
        model, tokenizer, max_queue=args.max_queue, batch_size=args.max_batch
    ).start()


def cmd_serve(args: argparse.Namespace, load: Any) -> int:
    """Run the server until Ctrl-C; ``load(path) -> (model, tokenizer)`` is the CLI's loader."""
    _require_serve_extra()
    import uvicorn

    from hf2q_mlx.embedding import is_embedding_model
    from hf2q_mlx.generation import parse_kv_bits
    from hf2q_mlx.serving.app import create_app
    from hf2q_mlx.serving.embedding_worker import EmbeddingWorker
    from hf2q_mlx.serving.engine import Engine

    kv_bits = parse_kv_bits(args.kv_bits)
    # before the model loads, so bad flags fail fast
    checks = [
        (0 < args.port < 65536, f"--port must be in 1..65535, got {args.port}"),
        (args.max_batch >= 1, f"--max-batch must be >= 1, got {args.max_batch}"),
        (args.max_queue >= 0, f"--max-queue must be >= 0, got {args.max_queue}"),
        (args.prefill_chunk >= 1, f"--prefill-chunk must be >= 1, got {args.prefill_chunk}"),
        (args.prefix_cache_mb >= 0, f"--prefix-cache-mb must be >= 0, got {args.prefix_cache_mb}"),
        (args.max_len is None or args.max_len >= 2, f"--max-len must be >= 2, got {args.max_len}"),
    ]
    for ok, message in checks:
        if not ok:
            raise InvalidArgumentError(message)
    model, tokenizer = load(args.model)
    if is_embedding_model(model):
        engine = _embedding_worker(args, model, tokenizer)
    else:
        engine = Engine(
            model,
            tokenizer,
            max_batch=args.max_batch,
            max_queue=args.max_queue,
            max_len=args.max_len,
            kv_bits=kv_bits,
            prefill_chunk=args.prefill_chunk,
            prefix_cache_bytes=args.prefix_cache_mb << 20,
            batch_prefill=args.batch_prefill,
            compiled=STEPS[args.step],
            warmup=False if args.no_warmup else None,
        )
        if engine.warmup:  # the engine's own decision (on where kernels run)
            print(
                "warming up: the kernels, traces and CUDA graphs of every prompt-length bucket "
                "and attention span (--no-warmup skips)",
                file=sys.stderr,
                flush=True,
            )
        engine.start()
    from hf2q_mlx.io.default_model import DEFAULT_CHAT_MODEL

    model_id = args.model_id or (Path(args.model).name if args.model else DEFAULT_CHAT_MODEL)
    if isinstance(engine, EmbeddingWorker):
        what = f"/v1/embeddings, {engine.dims} dimensions, batch {engine.batch_size}"
    else:
        what = (
            f"{type(engine.step).__name__}, max_batch {engine.max_batch}, max_len {engine.max_len}"
        )
        if engine.warmup_s is not None:
            what += f", warmed up in {engine.warmup_s:.1f} s"
    print(
        f"serving {model_id} on http://{args.host}:{args.port}/v1 ({what})",
        file=sys.stderr,
        flush=True,
    )
    try:
        uvicorn.run(create_app(engine, model_id), host=args.host, port=args.port, log_level="info")
    finally:
        engine.shutdown()
    return 0
