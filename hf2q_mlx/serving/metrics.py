"""Server counters, gauges and the time-to-first-token histogram, rendered as Prometheus text."""

from __future__ import annotations

import threading
import time
from collections import deque

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RATE_WINDOW_S = 10.0


class Metrics:
    """Thread-safe: the engine thread and the HTTP handlers both update it."""

    def __init__(self, max_batch: int) -> None:
        self.max_batch = max_batch
        self.lock = threading.Lock()
        self.counters: dict[str, float] = {}
        self.labelled: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self.gauges: dict[str, float] = {"queue_depth": 0, "running": 0, "prefix_pool_bytes": 0}
        self.ttft_counts = [0] * (len(TTFT_BUCKETS) + 1)
        self.ttft_sum = 0.0
        self.recent: deque[tuple[float, int]] = deque()  # (time, tokens) of recent steps

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        with self.lock:
            if labels:
                key = (name, tuple(sorted(labels.items())))
                self.labelled[key] = self.labelled.get(key, 0.0) + value
            else:
                self.counters[name] = self.counters.get(name, 0.0) + value

    def set(self, name: str, value: float) -> None:
        with self.lock:
            self.gauges[name] = value

    def observe_ttft(self, seconds: float) -> None:
        with self.lock:
            i = next((i for i, b in enumerate(TTFT_BUCKETS) if seconds <= b), len(TTFT_BUCKETS))
            self.ttft_counts[i] += 1
            self.ttft_sum += seconds

    def tokens_generated(self, n: int) -> None:
        now = time.monotonic()
        with self.lock:
            self.counters["generation_tokens_total"] = (
                self.counters.get("generation_tokens_total", 0.0) + n
            )
            self.recent.append((now, n))
            while self.recent and now - self.recent[0][0] > RATE_WINDOW_S:
                self.recent.popleft()

    def tokens_per_second(self) -> float:
        now = time.monotonic()
        with self.lock:
            while self.recent and now - self.recent[0][0] > RATE_WINDOW_S:
                self.recent.popleft()
            if not self.recent:
                return 0.0
            span = max(now - self.recent[0][0], 1.0)
            return sum(n for _, n in self.recent) / span

    def value(self, name: str, **labels: str) -> float:
        with self.lock:
            if labels:
                return self.labelled.get((name, tuple(sorted(labels.items()))), 0.0)
            return self.counters.get(name, self.gauges.get(name, 0.0))

    def render(self) -> str:
        """The Prometheus text exposition format (version 0.0.4)."""
        tps = self.tokens_per_second()
        p = "hf2q_"
        with self.lock:
            lines: list[str] = []
            for name, v in sorted(self.counters.items()):
                lines += [f"# TYPE {p}{name} counter", f"{p}{name} {v:g}"]
            seen: set[str] = set()
            for (name, labels), v in sorted(self.labelled.items()):
                if name not in seen:
                    lines.append(f"# TYPE {p}{name} counter")
                    seen.add(name)
                text = ",".join(f'{k}="{val}"' for k, val in labels)
                lines.append(f"{p}{name}{{{text}}} {v:g}")
            for name, v in sorted(self.gauges.items()):
                lines += [f"# TYPE {p}{name} gauge", f"{p}{name} {v:g}"]
            occupancy = self.gauges.get("running", 0) / self.max_batch
            lines += [f"# TYPE {p}batch_occupancy gauge", f"{p}batch_occupancy {occupancy:g}"]
            lines += [f"# TYPE {p}max_batch gauge", f"{p}max_batch {self.max_batch}"]
            lines += [
                f"# TYPE {p}generation_tokens_per_second gauge",
                f"{p}generation_tokens_per_second {tps:g}",
            ]
            lines.append(f"# TYPE {p}time_to_first_token_seconds histogram")
            total = 0
            for b, c in zip(TTFT_BUCKETS, self.ttft_counts):
                total += c
                lines.append(f'{p}time_to_first_token_seconds_bucket{{le="{b:g}"}} {total}')
            total += self.ttft_counts[-1]
            lines.append(f'{p}time_to_first_token_seconds_bucket{{le="+Inf"}} {total}')
            lines.append(f"{p}time_to_first_token_seconds_sum {self.ttft_sum:g}")
            lines.append(f"{p}time_to_first_token_seconds_count {total}")
        return "\n".join(lines) + "\n"
