"""Where a row's compiled-step logits differ alone and in a batch (tests/test_step_row_parity.py
asserts they never do): per row and step, whether two alone runs agree with each other, the max
|difference| to the batched row, NaN counts and whether the argmax moves. GPU diagnostic."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import test_step_row_parity as parity  # noqa: E402

from hf2q_mlx.decode_step import DecodeStep  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("names", nargs="+", help="e.g. llama:tiny gemma3:tiny")
    args = parser.parse_args()
    for name in args.names:
        with mx.stream(mx.default_device()):
            model, vocab = parity._build(name)
            rng = np.random.default_rng(3)
            prompts = [rng.integers(0, vocab, n).tolist() for n in parity.LENGTHS]
            conts = [rng.integers(0, vocab, parity.STEPS).tolist() for _ in parity.LENGTHS]
            B = len(prompts)
            reserve = parity.STEPS - 1
            batched = parity._rows(DecodeStep(model, B, 64, reserve=reserve), prompts, conts)
            again = parity._rows(DecodeStep(model, B, 64, reserve=reserve), prompts, conts)
            print(f"{name}: batched run twice bit-identical: {bool((batched == again).all())}")
            head = getattr(model, "lm_head", None)
            if head is None:  # a tied head
                head = model.model.embed_tokens.as_linear
            D = model.args.hidden_size
            h = mx.random.normal((B, 1, D), key=mx.random.key(7)).astype(mx.bfloat16)
            together = np.array(head(h).astype(mx.float32))
            for r in range(B):
                alone = np.array(head(h[r : r + 1]).astype(mx.float32))[0]
                print(
                    f"  head alone==batched, row {r}: {bool((alone == together[r]).all())} "
                    f"({type(head).__name__}, {int((alone != together[r]).sum())} differing)"
                )
            for r in range(B):
                runs = [
                    parity._rows(
                        DecodeStep(model, 1, 64, reserve=reserve), [prompts[r]], [conts[r]]
                    )[0]
                    for _ in range(2)
                ]
                for s in range(parity.STEPS):
                    a, b, x = runs[0][s], runs[1][s], batched[r][s]
                    diff = np.abs(a - x)
                    print(
                        f"  row {r} step {s}: alone==alone {bool((a == b).all())}, "
                        f"alone==batched {bool((a == x).all())}, max|diff| {np.nanmax(diff):.3g}, "
                        f"differing {int((a != x).sum())}/{a.size}, NaN alone/batched "
                        f"{int(np.isnan(a).sum())}/{int(np.isnan(x).sum())}, "
                        f"argmax {int(np.argmax(a))}/{int(np.argmax(x))}"
                    )


if __name__ == "__main__":
    main()
