"""bench/random_gguf.py: the random benchmark models written as llama.cpp-style GGUF files load
back into hf2q_mlx unchanged (raw GGML blocks bit-exact, same logits) and carry the metadata
and vocabulary llama.cpp's gemma4 / qwen35 / qwen35moe loaders read."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import llama_peer  # noqa: E402
import random_gguf as rg  # noqa: E402

from hf2q_mlx.io.gguf import GGUFFile  # noqa: E402
from hf2q_mlx.io.loader import load, load_model  # noqa: E402


@pytest.mark.parametrize("shape", rg.TINY)
def test_written_gguf_loads_as_the_in_memory_model(shape, tmp_path):
    seed = int.from_bytes(shape.encode(), "little") % 1000  # a different model per shape
    model, family, config = rg.build_random(shape, mx.float32, seed=seed)
    mx.eval(model.parameters())
    path = tmp_path / "m.gguf"
    summary = rg.write_gguf(rg.gguf_tensors(model, family, config), family, config, path)
    assert summary["architecture"] == rg.gguf_architecture(family, config)

    loaded, info = load_model(path, dtype="float32")
    model.fuse_projections()  # the loader fuses q/k/v and gate/up
    model.eval()
    ours, theirs = dict(tree_flatten(model.parameters())), dict(tree_flatten(loaded.parameters()))
    assert ours.keys() == theirs.keys()
    n_ggml = 0
    for k, a in ours.items():
        b = theirs[k]
        assert (a.shape, a.dtype) == (b.shape, b.dtype), k
        if k.endswith("A_log"):
            # the file holds -exp(A_log) (llama.cpp's ssm_a); exp then log in fp32 is ~1 ulp
            assert mx.allclose(a, b, rtol=1e-6, atol=0).item(), k
            continue
        n_ggml += a.dtype == mx.uint8
        assert mx.array_equal(a, b).item(), k  # raw blocks and float leaves bit-exact
    assert n_ggml > 0
    assert set(info.quantization.values()) <= {"Q4_K", "Q5_0"}
    assert "Q4_K" in info.quantization.values()

    # same parameters (A_log taken from the file) -> the very same logits on the CPU
    model.update(loaded.parameters())
    ids = mx.random.randint(0, config["vocab_size"], (1, 9), key=mx.random.key(seed))
    la, lb = model(ids), loaded(ids)
    assert mx.array_equal(la, lb).item()
    assert mx.all(mx.isfinite(la)).item()


@pytest.mark.parametrize("shape", rg.TINY)
def test_llama_cpp_metadata_and_vocab(shape, tmp_path):
    path = tmp_path / "m.gguf"
    info = rg.write_random_gguf(shape, path, seed=1)
    family, _, config = rg.parse_shape(shape)
    f = GGUFFile(path)
    arch = f.architecture
    assert arch == info["architecture"] == rg.gguf_architecture(family, config)
    moe = config.get("num_experts", 0) > 0 or bool(config.get("enable_moe_block"))
    if family == "gemma4":
        keys = rg.GEMMA4_KEYS + (rg.GEMMA4_MOE_KEYS if moe else [])
        assert "rope_freqs.weight" in f.tensors  # the full layers' proportional RoPE
    else:
        keys = rg.QWEN35_KEYS + (rg.QWEN35_MOE_KEYS if moe else [])
    missing = [k for k in keys if f"{arch}.{k}" not in f.metadata]
    missing += [k for k in rg.TOKENIZER_KEYS if k not in f.metadata]
    assert not missing
    # llama.cpp sizes the vocabulary by the token list: it must match the embedding rows
    assert len(f.metadata["tokenizer.ggml.tokens"]) == config["vocab_size"]
    assert f.tensors["token_embd.weight"].shape[0] == config["vocab_size"]
    # every tensor llama.cpp reads by name is in the file (no fused / HF names)
    assert all(n.startswith(("blk.", "token_embd", "output", "rope_freqs")) for n in f.tensors)
    # hf2q_mlx.load reads the dummy vocabulary too (llama_peer.py uses it)
    _, tok = load(path, dtype="float32")
    assert tok.bos_token_id == 1


PEERS = Path(__file__).resolve().parents[2] / "shared" / "peers" / "llama-cpu-x86_64.tar.xz"


@pytest.fixture(scope="module")
def llama_cpu(tmp_path_factory) -> Path:
    """The llama.cpp CPU bundle (../shared/peers), unpacked once; skips where it is absent."""
    if not PEERS.is_file():
        pytest.skip(f"no llama.cpp CPU bundle at {PEERS}")
    d = tmp_path_factory.mktemp("llama-cpu")
    subprocess.run(["tar", "-xJf", str(PEERS), "-C", str(d)], check=True)
    return d / "bin"


@pytest.mark.parametrize("shape", rg.TINY)
def test_llama_cpp_runs_the_written_gguf(shape, tmp_path, llama_cpu):
    """llama.cpp 0c1e570 loads every tensor of the file (it refuses unused or misshapen ones)
    and runs prefill and decode on it."""
    path = tmp_path / "m.gguf"
    rg.write_random_gguf(shape, path, seed=2)
    res = llama_peer.run_llama_bench(str(llama_cpu), path, 8, 2, reps=1, extra=["-t", "2"])
    assert res["pp_tok_s"] > 0 and res["tg_tok_s"] > 0
    assert res["records"][0]["model_n_params"] > 0


def test_unknown_shape_is_a_caller_error():
    with pytest.raises(rg.RandomGGUFError):
        rg.parse_shape("gemma4:7b")
