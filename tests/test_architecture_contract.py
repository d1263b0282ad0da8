"""The architecture contract: model modules declare themselves; the loader, the tokenizer and
TurboQuant find them by what they declare, so a new architecture is one new file."""

from __future__ import annotations

import json
import sys
import textwrap

import gguf
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import hf2q_mlx.models
from hf2q_mlx.errors import UnsupportedArchitectureError
from hf2q_mlx.io.loader import load, load_model
from hf2q_mlx.models import llama
from hf2q_mlx.models.contract import (
    Architecture,
    architecture_of,
    architectures,
    find_architecture,
)
from hf2q_mlx.models.llama_cpp_names import LLAMA_CPP_TENSOR_NAMES
from hf2q_mlx.models.turboquant.cache import model_rope_dims, model_rope_freqs
from hf2q_mlx.tokenizer.tokenizer import BUILTIN_CHAT_TEMPLATES

# A throwaway architecture: Llama's classes under a new model type and GGUF name, with its own
# tokenizer quirks and RoPE description. Nothing else in the tree mentions "tinyfam".
TINYFAM = """
from dataclasses import dataclass

import mlx.core as mx

from hf2q_mlx.models import llama
from hf2q_mlx.models.contract import Architecture, LayerRoPE, TokenizerQuirks


@dataclass
class ModelArgs(llama.ModelArgs):
    model_type: str = "tinyfam"


class Model(llama.Model):
    pass


def args_from_gguf(metadata, tensors):
    renamed = {k.replace("tinyfam.", "llama.", 1): v for k, v in metadata.items()}
    args = vars(llama.args_from_gguf(renamed, tensors))
    return ModelArgs.from_dict({**args, "model_type": "tinyfam"})


def rope_layers(args):
    return [LayerRoPE(dims=4, freqs=mx.full((2,), 0.5)) for _ in range(args.num_hidden_layers)]


ARCHITECTURE = Architecture(
    model_types=("tinyfam",),
    args=ModelArgs,
    model=Model,
    gguf_architectures=("tinyfam",),
    gguf_tensor_map=llama.GGUF_TENSOR_MAP,
    args_from_gguf=args_from_gguf,
    gguf_transform=llama.gguf_transform,
    tokenizer=TokenizerQuirks(gemma_sentencepiece=True, chat_template="gemma"),
    rope=rope_layers,
)
"""

CONFIG = dict(
    hidden_size=32, num_hidden_layers=2, intermediate_size=48, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=64, rms_norm_eps=1e-5, rope_theta=10_000.0,
)  # fmt: skip
VOCAB = ["<unk>", "<s>", "</s>", "\u2581", "a", "b", "\u2581a", "ab"]


@pytest.fixture
def tinyfam(tmp_path, monkeypatch):
    """The throwaway module, dropped into the hf2q_mlx.models package path."""
    folder = tmp_path / "extra_models"
    folder.mkdir()
    (folder / "tinyfam.py").write_text(textwrap.dedent(TINYFAM))
    monkeypatch.setattr(hf2q_mlx.models, "__path__", [*hf2q_mlx.models.__path__, str(folder)])
    yield
    sys.modules.pop("hf2q_mlx.models.tinyfam", None)


def _llama_weights() -> dict[str, mx.array]:
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs(**CONFIG))
    return {k: mx.random.normal(v.shape) * 0.2 for k, v in tree_flatten(model.parameters())}


def _write_hf(path, model_type: str) -> None:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": model_type, **CONFIG}))
    mx.save_safetensors(str(path / "model.safetensors"), _llama_weights())


def _write_gguf(path, arch: str) -> None:
    """The same Llama weights and a tiny SentencePiece vocabulary, under GGUF name ``arch``."""
    n = CONFIG["num_hidden_layers"]
    to_gguf = {
        target.format(i=i): name.format(i=i)
        for name, target in llama.GGUF_TENSOR_MAP.items()
        for i in range(n)
    }
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n)
    w.add_embedding_length(CONFIG["hidden_size"])
    w.add_feed_forward_length(CONFIG["intermediate_size"])
    w.add_head_count(CONFIG["num_attention_heads"])
    w.add_head_count_kv(CONFIG["num_key_value_heads"])
    w.add_layer_norm_rms_eps(CONFIG["rms_norm_eps"])
    w.add_rope_freq_base(CONFIG["rope_theta"])
    w.add_context_length(128)
    w.add_tokenizer_model("llama")
    w.add_token_list(VOCAB)
    w.add_token_scores([0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -4.0, -5.0])
    w.add_token_types([2, 3, 3, 1, 1, 1, 1, 1])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, value in _llama_weights().items():
        w.add_tensor(to_gguf[name], np.array(value))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_new_architecture_is_one_file(tmp_path, tinyfam):
    """The loader (HF and GGUF), the tokenizer and TurboQuant serve an architecture that only
    its own module declares."""
    tokens = mx.array([[1, 5, 9, 33, 2, 60]])
    _write_hf(tmp_path / "tiny", "tinyfam")
    _write_hf(tmp_path / "ref", "llama")
    model, info = load_model(tmp_path / "tiny")
    ref, _ = load_model(tmp_path / "ref")
    assert type(model).__module__ == "hf2q_mlx.models.tinyfam"
    assert info.model_type == "tinyfam"
    np.testing.assert_array_equal(np.array(model(tokens)), np.array(ref(tokens)))

    _write_gguf(tmp_path / "tiny.gguf", "tinyfam")
    _write_gguf(tmp_path / "ref.gguf", "llama")
    model, tokenizer = load(tmp_path / "tiny.gguf")
    ref, ref_tokenizer = load(tmp_path / "ref.gguf")
    assert type(model).__module__ == "hf2q_mlx.models.tinyfam"
    np.testing.assert_array_equal(np.array(model(tokens)), np.array(ref(tokens)))
    # the tokenizer quirks come from the module: Gemma's template fallback, no dummy prefix
    assert tokenizer.chat_template == BUILTIN_CHAT_TEMPLATES["gemma"]
    assert tokenizer.chat_template_is_builtin and ref_tokenizer.chat_template is None
    assert tokenizer.encode("ab", add_special_tokens=False) == [7]
    assert ref_tokenizer.encode("ab", add_special_tokens=False) == [6, 5]  # "▁a" "b"

    # TurboQuant reads the RoPE the module describes
    assert architecture_of(model) is find_architecture(model_type="tinyfam")
    assert model_rope_dims(model) == [4, 4]
    assert [float(f[0]) for f in model_rope_freqs(model)] == [0.5, 0.5]
    assert model_rope_dims(ref) == [None, None]  # llama describes no RoPE


def test_unknown_names_list_the_declared_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "tinyfam", **CONFIG}))
    with pytest.raises(UnsupportedArchitectureError, match=r"'tinyfam'.*gemma3_text.*llama"):
        load_model(tmp_path)
    assert find_architecture(gguf_architecture="tinyfam") is None


def test_declared_names_are_unique_and_every_family_is_found():
    found = architectures()
    for names in ("model_types", "gguf_architectures"):
        declared = [n for a in found for n in getattr(a, names)]
        assert len(declared) == len(set(declared)), names
    modules = {a.model.__module__.rsplit(".", 1)[1] for a in found}
    assert {"gemma3", "gemma4", "llama", "qwen3_5", "qwen3_5_moe"} <= modules
    for arch in found:  # declared by the module that defines its Model
        assert sys.modules[arch.model.__module__].ARCHITECTURE is arch
        assert find_architecture(model_type=arch.model_types[0]) is arch


@pytest.mark.parametrize("name", ["gemma3", "gemma4", "llama", "qwen3_5"])
def test_families_share_the_llama_cpp_names(name):
    table = find_architecture(model_type=name).gguf_tensor_map
    assert LLAMA_CPP_TENSOR_NAMES.items() <= table.items()


def test_gguf_names_need_a_metadata_reader():
    with pytest.raises(TypeError, match="args_from_gguf"):
        Architecture(("x",), args=llama.ModelArgs, model=llama.Model, gguf_architectures=("x",))
