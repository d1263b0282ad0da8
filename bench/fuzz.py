"""Run the fuzz properties of tests/test_fuzz.py with many cases (off CI) and print the outcomes.

    python3 bench/fuzz.py                        # 11,200 cases per property, 100,800 in all
    python3 bench/fuzz.py --cases 500 --seed 7   # a quick run with other random cases

Every case must load or raise an Hf2qError subclass; a crash, hang or other exception fails the
run (pytest prints the smallest failing input). The properties run one pytest process each, so
a line per input kind (case count and outcomes) appears as each one finishes; --report also
writes the counts as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROPERTIES = [  # pytest node ids under tests/test_fuzz.py
    "test_fuzz_gguf_header[header]",
    "test_fuzz_gguf_header[metadata]",
    "test_fuzz_gguf_header[tensor table]",
    "test_fuzz_gguf_data",
    "test_fuzz_safetensors_header",
    "test_fuzz_config_json",
    "test_fuzz_tokenizer_json",
    "test_fuzz_api_arguments",
    "test_fuzz_openai_request_bodies",
    "test_fuzz_load_arguments",
]


def run_property(node: str, cases: int, seed: int, timeout: int) -> tuple[dict, int, float]:
    """(outcome counts per kind, pytest exit status, seconds) of one property."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "fuzz.json"
        env = {**os.environ, "HF2Q_FUZZ_EXAMPLES": str(cases), "HF2Q_FUZZ_REPORT": str(report)}
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        command += [f"--hypothesis-seed={seed}", f"tests/test_fuzz.py::{node}"]
        start = time.perf_counter()
        try:
            rc = subprocess.run(command, cwd=ROOT, env=env, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124  # a hang counts as a failure
        elapsed = time.perf_counter() - start
        counts = json.loads(report.read_text()) if report.is_file() else {}
    return counts, rc, elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=11_200, help="cases per property (11200)")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed (0)")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per property (3600)")
    parser.add_argument("--report", type=Path, help="also write the outcome counts as JSON here")
    parser.add_argument("--only", nargs="*", help="only properties whose id holds one of these")
    args = parser.parse_args()
    nodes = [n for n in PROPERTIES if not args.only or any(o in n for o in args.only)]

    results: dict[str, dict] = {}
    total, failed = 0, 0
    print(f"{'input kind':20} {'cases':>7} {'time':>6}  outcomes", flush=True)
    for node in nodes:
        counts, rc, elapsed = run_property(node, args.cases, args.seed, args.timeout)
        failed += rc != 0
        for kind, tally in counts.items():
            n = sum(tally.values())
            total += n
            results[kind] = {**tally, "pytest_exit": rc, "seconds": round(elapsed, 1)}
            shown = ", ".join(f"{k} {v}" for k, v in sorted(tally.items(), key=lambda kv: -kv[1]))
            print(f"{kind:20} {n:>7} {elapsed:>5.0f}s  {shown}  (exit {rc})", flush=True)
        if args.report:
            args.report.write_text(json.dumps(results, indent=1) + "\n")
    print(f"{'total':20} {total:>7}  properties failed: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
