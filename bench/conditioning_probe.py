"""How far fp32 rounding alone moves a tiny test model's logits, next to how far the GPU kernel
path (run on the CPU kernel emulator) is from the reference path: tells a kernel that computes
below fp32 from a model that amplifies every rounding (session 44: tiny Gemma 4).

    python bench/conditioning_probe.py llama gemma4-dense gemma4-moe [--emulate]

Per model (tests/test_decode_step.py's tiny configs, fp32, reference path): the logits of two
prompts and three decode steps, then again with every weight times (1 + 2^-23 n), n standard
normal (one-ulp noise); prints the largest change relative to the largest logit. ``--emulate``
also runs the eager path with the CUDA kernels on the emulator (slow: g++ builds each kernel)
and prints its distance from the reference, whole and with each kernel module of ``--modules``
swapped back to its reference in turn.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "tests"), str(HERE.parent / "tests" / "kernels"), str(HERE)]

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten, tree_unflatten  # noqa: E402

import hf2q_mlx  # noqa: E402,F401
import hf2q_mlx.custom_kernels as ck  # noqa: E402

MODULES = "softcap,post_norm_residual,rms_norm_rope,residual_rms_norm,moe_router,expert_glu"


def _case(name: str):
    from test_decode_step import prompts, tiny_model

    model = tiny_model(name)
    ps = prompts([2, 7], seed=9)
    conts = [np.random.default_rng(r).integers(0, 80, 3).tolist() for r in range(2)]
    return model, ps, conts


def _logits(model, ps, conts) -> list[list[np.ndarray]]:
    from test_decode_step import eager_logits

    return [eager_logits(model, p, c) for p, c in zip(ps, conts)]


def _rel(got, want) -> float:
    """Largest |got - want| over the largest |want|, worst step of any sequence."""
    return max(
        float(np.abs(g - w).max() / np.abs(w).max())
        for a, b in zip(got, want)
        for g, w in zip(a, b)
    )


def one_ulp_sensitivity(name: str) -> float:
    model, ps, conts = _case(name)
    with ck.reference_only():
        want = _logits(model, ps, conts)
        noisy = [
            (k, v * (1 + 2.0**-23 * mx.random.normal(v.shape, key=mx.random.key(i))))
            for i, (k, v) in enumerate(tree_flatten(model.parameters()))
        ]
        model.update(tree_unflatten(noisy))
        mx.eval(model.parameters())
        return _rel(_logits(model, ps, conts), want)


def emulated_kernel_error(name: str, modules: list[str]) -> dict[str, float]:
    """The kernel path's distance from the reference, whole and per module swapped back."""
    from graph_step_emulated import fake_cuda

    model, ps, conts = _case(name)
    with ck.reference_only():
        want = _logits(model, ps, conts)
    fake_cuda()
    out = {"all kernels": _rel(_logits(model, ps, conts), want)}
    for m in modules:
        mod = importlib.import_module(f"hf2q_mlx.custom_kernels.{m}")
        if not hasattr(mod, "backend"):
            continue
        old, mod.backend = mod.backend, lambda: None
        try:
            out[f"{m} on its reference"] = _rel(_logits(model, ps, conts), want)
        finally:
            mod.backend = old
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="+", help="tiny config names of tests/test_decode_step.py")
    p.add_argument("--emulate", action="store_true", help="also the emulated kernel path")
    p.add_argument("--modules", default=MODULES, help="kernel modules to swap back, comma list")
    a = p.parse_args()
    for name in a.models:
        print(f"{name}: one-ulp weight noise moves the logits {one_ulp_sensitivity(name):.2e}")
    if a.emulate:  # after the sensitivities: the fake CUDA back end stays for the process
        for name in a.models:
            for what, err in emulated_kernel_error(name, a.modules.split(",")).items():
                print(f"{name}: kernel path vs reference, {what}: {err:.2e}")


if __name__ == "__main__":
    main()
