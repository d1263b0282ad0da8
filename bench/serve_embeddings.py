"""`/v1/embeddings` under concurrency: N clients at once, one text each, through the real
`openai` client against a live server, with the worker's batch at 1 (each request its own
forward pass) and at N (waiting requests share passes); interleaved rounds in one process,
requests per second as median [min-max] and the ratio round by round. Prints and writes JSON.

    python3 bench/serve_embeddings.py OUT.json --model embeddinggemma-300m --clients 32 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

# isort: off
import hf2q_mlx  # before mlx.core: it routes MLX's CPU matmuls to a fast BLAS (cpu_blas.py)

# isort: on
import mlx.core as mx
import openai

from hf2q_mlx.serving.embedding_worker import EmbeddingWorker
from hf2q_mlx.serving.serve import ServerThread


def one_round(url: str, model_id: str, texts: list[str]) -> float:
    """Seconds for every text sent at once, one request each (all answered)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    done: list[int] = []

    def ask(text: str) -> None:
        r = client.embeddings.create(model=model_id, input=text)
        done.append(len(r.data[0].embedding))

    threads = [threading.Thread(target=ask, args=(t,)) for t in texts]
    tic = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - tic
    if len(done) != len(texts):
        raise SystemExit(f"{len(texts) - len(done)} requests failed")
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("out", help="JSON file for the results")
    p.add_argument("--model", default="embeddinggemma-300m")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    model, tokenizer = hf2q_mlx.load(a.model)
    texts = [
        f"Note {i}: the planet Mars looks red because of iron oxide dust." for i in range(a.clients)
    ]
    servers = {}
    for batch in (1, a.clients):
        worker = EmbeddingWorker(model, tokenizer, max_queue=a.clients, batch_size=batch)
        servers[batch] = ServerThread(worker, "m").start()
    rates: dict[int, list[float]] = {b: [] for b in servers}
    try:
        for srv in servers.values():  # warm-up: shapes built once
            one_round(srv.url, "m", texts[:4])
        for r in range(a.rounds):
            for b, srv in servers.items():
                rates[b].append(a.clients / one_round(srv.url, "m", texts))
            print(f"round {r}: " + ", ".join(f"batch {b} {rates[b][-1]:.1f} req/s" for b in rates))
    finally:
        for srv in servers.values():
            srv.stop()
    ratio = [x / y for x, y in zip(rates[a.clients], rates[1])]
    rows = {}
    for b, v in rates.items():
        rows[b] = {"median": statistics.median(v), "min": min(v), "max": max(v), "rounds": v}
        print(f"batch {b:3d}: {rows[b]['median']:.1f} req/s [{min(v):.1f}-{max(v):.1f}]")
    print(f"batched / one at a time, round by round: median {statistics.median(ratio):.2f}x "
          f"[{min(ratio):.2f}-{max(ratio):.2f}]")  # fmt: skip
    result = {"model": a.model, "clients": a.clients, "rounds": a.rounds, "rates": rows,
              "ratio": ratio, "device": str(mx.default_device())}  # fmt: skip
    Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
