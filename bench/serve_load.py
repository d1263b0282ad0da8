"""Load run of `hf2q-mlx serve`: N concurrent client streams for a fixed time, random prompts,
sampling options and cancellations, a few malformed requests; reports errors, lost requests and
the server's memory (RSS) at its baseline, peak and end.

The server runs as a subprocess (`python -m hf2q_mlx serve`) on a free loopback port, so its RSS
is measured alone. Outcomes per request: ok (finish_reason and, for streams, `[DONE]`),
cancelled (the client closed the stream on purpose), rejected (429 queue full, 400 for the
deliberately bad requests: both intended), error (anything else), lost (no outcome at all).

    nice -n 10 python bench/serve_load.py --duration 600 --streams 32     # the issue's run
    python bench/serve_load.py --duration 60 --streams 8                  # a short smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
TEXT = (ROOT / "tests" / "data" / "us_constitution.txt").read_text().split()
MODEL_ID = "load-test"
SYSTEMS = [" ".join(TEXT[i : i + 60]) for i in (0, 500, 1000)]  # shared chat system prompts


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(a: argparse.Namespace, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "hf2q_mlx", "serve", "--model", a.model, "--port", str(port),
           "--max-batch", str(a.max_batch), "--max-queue", str(a.max_queue),
           "--model-id", MODEL_ID, "--max-len", str(a.max_len),
           "--prefix-cache-mb", str(a.prefix_cache_mb),
           "--prefill-chunk", str(a.prefill_chunk)]  # fmt: skip
    # a file, not a pipe: uvicorn logs every request and a full pipe would block the server
    log = open(a.server_log, "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited: {Path(a.server_log).read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("server did not start within 300 s")


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def random_body(rng: random.Random, a: argparse.Namespace) -> dict:
    start = rng.randrange(len(TEXT) - 400)
    words = " ".join(TEXT[start : start + rng.choice(a.prompt_words)])
    body: dict = {"model": MODEL_ID, "max_tokens": rng.randint(1, a.max_tokens),
                  "temperature": rng.choice([0.0, 0.7, 1.0]),
                  "stream": rng.random() < 0.7}  # fmt: skip
    if rng.random() < 0.5:
        body["top_p"] = rng.choice([0.8, 0.95])
        body["seed"] = rng.randrange(1 << 30)
    if rng.random() < 0.3:
        body["top_k"] = rng.choice([5, 40])
    if rng.random() < 0.1:  # several choices: the later ones wait for the first one's prompt
        body["n"] = rng.choice([2, 3])
    if rng.random() < 0.1:
        body["logit_bias"] = {str(rng.randrange(1000)): rng.choice([-100, 5, 100])}
    if rng.random() < a.chat_rate:
        body["messages"] = [{"role": "user", "content": words}]
        if rng.random() < 0.5:  # a shared system prompt: reused from the pool, cut back
            system = SYSTEMS[rng.randrange(len(SYSTEMS))]
            body["messages"].insert(0, {"role": "system", "content": system})
    else:
        body["prompt"] = words
    return body


def client(idx: int, url: str, a: argparse.Namespace, stop_at: float, tally: Counter, lock) -> None:
    rng = random.Random(a.seed * 1000 + idx)
    with httpx.Client(timeout=a.request_timeout) as h:
        while time.monotonic() < stop_at:
            outcome = "lost"
            try:
                if rng.random() < a.bad_rate:  # intended 400s: malformed JSON, unknown model
                    if rng.random() < 0.5:
                        r = h.post(url + "/v1/completions", content=b"{not json",
                                   headers={"content-type": "application/json"})  # fmt: skip
                    else:
                        r = h.post(url + "/v1/completions", json={"model": "nope", "prompt": "x"})
                    outcome = "rejected_400" if r.status_code == 400 else f"error_{r.status_code}"
                    continue
                body = random_body(rng, a)
                path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
                cancel_after = rng.randint(1, 8) if rng.random() < a.cancel_rate else None
                if not body["stream"]:
                    r = h.post(url + path, json=body)
                    ok = r.status_code == 200 and r.json()["choices"][0]["finish_reason"]
                    outcome = "ok" if ok else "rejected_429" if r.status_code == 429 else (
                        f"error_{r.status_code}")  # fmt: skip
                    continue
                with h.stream("POST", url + path, json=body) as r:
                    if r.status_code == 429:
                        outcome = "rejected_429"
                        continue
                    if r.status_code != 200:
                        outcome = f"error_{r.status_code}"
                        continue
                    n, done = 0, False
                    for line in r.iter_lines():
                        if not line.startswith("data: "):
                            continue
                        n += 1
                        if line == "data: [DONE]":
                            done = True
                            break
                        if '"error"' in line:
                            break
                        if cancel_after is not None and n >= cancel_after:
                            break
                    if done:
                        outcome = "ok"
                    elif cancel_after is not None and n >= cancel_after:
                        outcome = "cancelled"
                    else:
                        outcome = "error_stream"
            except Exception as err:  # noqa: BLE001 - every failure is counted
                outcome = f"error_{type(err).__name__}"
            finally:
                with lock:
                    tally[outcome] += 1
                    tally["sent"] += 1
                if outcome == "rejected_429":  # as a client honouring Retry-After would
                    time.sleep(rng.uniform(0.5, 1.5))


def load_phase(url, a, seconds, tally, seed_offset, server=None) -> tuple[int, list]:
    """``a.streams`` clients for ``seconds``; the server's peak RSS and samples while it runs."""
    lock = threading.Lock()
    stop_at = time.monotonic() + seconds
    threads = [
        threading.Thread(target=client, args=(seed_offset + i, url, a, stop_at, tally, lock))
        for i in range(a.streams)
    ]
    for t in threads:
        t.start()
    tic, peak, samples = time.monotonic(), 0, []
    while any(t.is_alive() for t in threads):
        time.sleep(5)
        if server is not None:
            rss = server.memory_info().rss
            peak = max(peak, rss)
            samples.append((round(time.monotonic() - tic, 1), rss))
    return peak, samples


def wait_idle(url: str, timeout: float = 120.0) -> dict:
    """/health once nothing runs (or after ``timeout``), then a pause for the idle step."""
    deadline = time.monotonic() + timeout
    health = httpx.get(url + "/health").json()
    while (health["running"] or health["outstanding"]) and time.monotonic() < deadline:
        time.sleep(1)
        health = httpx.get(url + "/health").json()
    time.sleep(3)
    return health


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load (600)")
    p.add_argument("--streams", type=int, default=32, help="concurrent clients (32)")
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--max-queue", type=int, default=8)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=24, help="upper bound per request (24)")
    p.add_argument("--prefix-cache-mb", type=int, default=64)
    p.add_argument("--cancel-rate", type=float, default=0.2, help="streams closed early (0.2)")
    p.add_argument("--bad-rate", type=float, default=0.02, help="malformed requests (0.02)")
    p.add_argument("--request-timeout", type=float, default=900.0)
    p.add_argument("--warmup", type=float, default=60.0, help="load before the baseline (60 s)")
    p.add_argument("--prompt-words", default="4,16,64,200", help="prompt lengths in words")
    p.add_argument("--chat-rate", type=float, default=0.5, help="chat requests (0.5)")
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--server-log",
        default=os.path.join(tempfile.gettempdir(), "serve_load_server.log"),
        help="the server's output (in the temp folder)",
    )
    p.add_argument("--json", default=None, help="output file (bench/results/serve_load_*.json)")
    a = p.parse_args()
    a.prompt_words = [int(w) for w in a.prompt_words.split(",")]

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(a, port)
    server = psutil.Process(proc.pid)
    try:
        # warm-up: the same load for a while (every buffer size, the prefix pool), then idle
        warm = Counter()
        load_phase(url, a, a.warmup, warm, seed_offset=10_000)
        wait_idle(url)
        rss0 = server.memory_info().rss
        m0 = metrics(url)
        tally: Counter = Counter()
        tic = time.monotonic()
        peak, samples = load_phase(url, a, a.duration, tally, 0, server)
        wall = time.monotonic() - tic
        health = wait_idle(url)
        rss1 = server.memory_info().rss
        m1 = metrics(url)
    finally:
        proc.terminate()
        proc.wait(30)

    intended = {"ok", "cancelled", "rejected_429", "rejected_400", "sent"}
    errors = {k: v for k, v in tally.items() if k not in intended}
    accounted = sum(v for k, v in tally.items() if k != "sent")
    pool_growth = m1.get("hf2q_prefix_pool_bytes", 0) - m0.get("hf2q_prefix_pool_bytes", 0)
    result = {
        "model": a.model, "duration_s": round(wall, 1), "streams": a.streams,
        "max_batch": a.max_batch, "max_queue": a.max_queue, "cancel_rate": a.cancel_rate,
        "outcomes": dict(tally), "errors": errors, "lost": tally["sent"] - accounted,
        "server_outstanding_after": health["outstanding"],
        "server_running_after": health["running"],
        "generated_tokens": m1.get("hf2q_generation_tokens_total", 0)
        - m0.get("hf2q_generation_tokens_total", 0),
        "warmup_outcomes": dict(warm), "rss_baseline_mb": rss0 / 1e6,
        "rss_peak_mb": peak / 1e6, "rss_end_mb": rss1 / 1e6,
        "prefix_pool_growth_mb": pool_growth / 1e6,
        "rss_samples": samples,
    }  # fmt: skip
    result["generation_tok_s"] = result["generated_tokens"] / max(wall, 1e-9)
    # the prefix pool may fill up to its budget: that much growth is intended
    growth = (rss1 - rss0 - max(pool_growth, 0)) / 1e6
    result["rss_growth_beyond_pool_mb"] = growth
    result["pass"] = (
        not errors and result["lost"] == 0 and health["outstanding"] == 0 and growth < 100
    )
    for k, v in result.items():
        if k != "rss_samples":
            print(f"{k}: {v}")
    out = a.json or str(
        ROOT / "bench" / "results" / f"serve_load_{time.strftime('%Y-%m-%d_%H%M')}.json"
    )
    Path(out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    sys.exit(0 if result["pass"] else 1)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
