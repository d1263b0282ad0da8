"""Property-based fuzzing of every input the package reads or accepts: corrupted GGUF files
(header, metadata, tensor table, data), safetensors headers, config.json, tokenizer.json and
public API arguments. The property: a load or a call either works or raises an Hf2qError
subclass; never another exception, a crash or a hang. ``bench/fuzz.py`` runs the same
properties with 100,000+ cases (HF2Q_FUZZ_EXAMPLES sets the count per property).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf2q_mlx.errors import Hf2qError

EXAMPLES = int(os.environ.get("HF2Q_FUZZ_EXAMPLES", "150"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    derandomize="HF2Q_FUZZ_EXAMPLES" not in os.environ,  # CI: the same cases every run
    suppress_health_check=list(HealthCheck),
)
OUTCOMES: dict[str, Counter] = {}  # kind -> {"ok" | error class name: count}


def outcome(kind: str, run) -> None:
    """Run ``run()``; record its outcome; any exception that is not an Hf2qError fails."""
    tally = OUTCOMES.setdefault(kind, Counter())
    try:
        run()
    except Hf2qError as err:
        assert "\n" not in str(err).strip(), f"multi-line message: {err}"
        tally[type(err).__name__] += 1
    else:
        tally["ok"] += 1


@pytest.fixture(scope="module", autouse=True)
def report_outcomes():
    yield
    path = os.environ.get("HF2Q_FUZZ_REPORT")
    if path:
        Path(path).write_text(json.dumps({k: dict(v) for k, v in OUTCOMES.items()}, indent=1))


# ---------------------------------------------------------------- tiny valid inputs

VOCAB = 300  # 256 byte tokens, a few merges, BOS/EOS
HIDDEN, FFN, HEADS, KV_HEADS = 32, 64, 4, 2


def _tokenizer_parts() -> tuple[list[str], list[str]]:
    from hf2q_mlx.tokenizer.bpe import bytes_to_unicode

    alphabet = list(bytes_to_unicode().values())
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a")]
    tokens = alphabet + ["".join(m) for m in merges]
    tokens += [f"<extra{i}>" for i in range(VOCAB - 2 - len(tokens))] + ["<s>", "</s>"]
    return tokens, [" ".join(m) for m in merges]


def tokenizer_json() -> dict:
    tokens, merges = _tokenizer_parts()
    return {
        "version": "1.0",
        "added_tokens": [
            {"id": VOCAB - 2, "content": "<s>", "special": True},
            {"id": VOCAB - 1, "content": "</s>", "special": True},
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel"},
        "model": {
            "type": "BPE",
            "vocab": {t: i for i, t in enumerate(tokens)},
            "merges": merges,
        },
    }


def llama_config() -> dict:
    return {
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "num_hidden_layers": 1,
        "intermediate_size": FFN,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "vocab_size": VOCAB,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "bos_token_id": VOCAB - 2,
        "eos_token_id": VOCAB - 1,
    }


def _weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    head_dim = HIDDEN // HEADS
    shapes = {
        "model.embed_tokens.weight": (VOCAB, HIDDEN),
        "model.norm.weight": (HIDDEN,),
        "model.layers.0.input_layernorm.weight": (HIDDEN,),
        "model.layers.0.post_attention_layernorm.weight": (HIDDEN,),
        "model.layers.0.self_attn.q_proj.weight": (HEADS * head_dim, HIDDEN),
        "model.layers.0.self_attn.k_proj.weight": (KV_HEADS * head_dim, HIDDEN),
        "model.layers.0.self_attn.v_proj.weight": (KV_HEADS * head_dim, HIDDEN),
        "model.layers.0.self_attn.o_proj.weight": (HIDDEN, HEADS * head_dim),
        "model.layers.0.mlp.gate_proj.weight": (FFN, HIDDEN),
        "model.layers.0.mlp.up_proj.weight": (FFN, HIDDEN),
        "model.layers.0.mlp.down_proj.weight": (HIDDEN, FFN),
    }
    return {k: (0.2 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}


def write_hf_dir(folder: Path) -> Path:
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(llama_config()))
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer_json()))
    save_file(_weights(), str(folder / "model.safetensors"))
    return folder


GGUF_NAMES = {  # HF name -> (GGUF name, GGML type)
    "model.embed_tokens.weight": ("token_embd.weight", "Q8_0"),
    "model.norm.weight": ("output_norm.weight", "F32"),
    "model.layers.0.input_layernorm.weight": ("blk.0.attn_norm.weight", "F32"),
    "model.layers.0.post_attention_layernorm.weight": ("blk.0.ffn_norm.weight", "F32"),
    "model.layers.0.self_attn.q_proj.weight": ("blk.0.attn_q.weight", "Q4_0"),
    "model.layers.0.self_attn.k_proj.weight": ("blk.0.attn_k.weight", "Q8_0"),
    "model.layers.0.self_attn.v_proj.weight": ("blk.0.attn_v.weight", "F16"),
    "model.layers.0.self_attn.o_proj.weight": ("blk.0.attn_output.weight", "Q4_1"),
    "model.layers.0.mlp.gate_proj.weight": ("blk.0.ffn_gate.weight", "Q5_0"),
    "model.layers.0.mlp.up_proj.weight": ("blk.0.ffn_up.weight", "Q8_0"),
    "model.layers.0.mlp.down_proj.weight": ("blk.0.ffn_down.weight", "Q4_0"),
}


def write_gguf(path: Path) -> Path:
    import gguf

    w = gguf.GGUFWriter(path, "llama")
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(1)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    tokens, merges = _tokenizer_parts()
    w.add_token_list(tokens)
    w.add_token_types([1] * (VOCAB - 2) + [3, 3])
    w.add_token_merges(merges)
    w.add_bos_token_id(VOCAB - 2)
    w.add_eos_token_id(VOCAB - 1)
    for name, array in _weights().items():
        gguf_name, type_name = GGUF_NAMES[name]
        qtype = gguf.GGMLQuantizationType[type_name]
        if qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(gguf_name, array)
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(gguf_name, array.astype(np.float16))
        else:
            w.add_tensor(gguf_name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def use_model(path: Path) -> None:
    """Load (model and tokenizer), tokenize, run a few decode steps, decode the text."""
    import hf2q_mlx

    model, tok = hf2q_mlx.load(path)
    ids = tok.encode("the hat in a tin", add_special_tokens=True)
    text = hf2q_mlx.generate(model, tok, ids[:8] or [0], max_tokens=2)
    text.encode("utf-8")


def gguf_regions(data: bytes) -> dict[str, tuple[int, int]]:
    """[start, end) of the header, metadata, tensor table and data of a GGUF file."""
    from hf2q_mlx.io.gguf import _Header

    h = _Header(memoryview(data), Path("x"))
    h.pos = 24
    for _ in range(struct.unpack_from("<Q", data, 16)[0]):
        key = h.string("key")
        h.value(h.u32("type"), key)
    meta_end = h.pos
    for _ in range(struct.unpack_from("<Q", data, 8)[0]):
        h.string("name")
        n_dims = h.u32("dims")
        h.pos += 8 * n_dims + 12  # dimensions, type, offset
    table_end = h.pos
    return {
        "header": (0, 24),
        "metadata": (24, meta_end),
        "tensor table": (meta_end, table_end),
        "data": (table_end, len(data)),
    }


@pytest.fixture(scope="module")
def valid_inputs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("fuzz")
    gguf_file = write_gguf(root / "tiny.gguf")
    hf = write_hf_dir(root / "hf")
    return {
        "root": root,
        "gguf": gguf_file.read_bytes(),
        "hf": hf,
        "safetensors": (hf / "model.safetensors").read_bytes(),
    }


def test_valid_inputs_load(valid_inputs):
    """The fuzzed files are real: unmodified, they load and generate."""
    root = valid_inputs["root"]
    use_model(root / "tiny.gguf")
    use_model(valid_inputs["hf"])


# ---------------------------------------------------------------- mutations

INTERESTING = [0, 1, 2, 3, 7, 8, 31, 32, 255, 2**15, 2**16 - 1, 2**31 - 1, 2**31, 2**32 - 1]
INTERESTING += [2**32, 2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 1]


@st.composite
def mutated(draw, data: bytes, start: int, end: int) -> bytes:
    """``data`` with one to three edits inside [start, end): bit flips, byte sets, integer
    fields overwritten with boundary values, truncation, insertion or deletion."""
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 3))):
        end_now = min(end, len(out))
        if end_now <= start:
            break
        pos = draw(st.integers(start, end_now - 1))
        op = draw(st.sampled_from(["flip", "byte", "u32", "u64", "truncate", "insert", "delete"]))
        if op == "flip":
            out[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "byte":
            out[pos] = draw(st.integers(0, 255))
        elif op in ("u32", "u64"):
            fmt, bits = ("<I", 32) if op == "u32" else ("<Q", 64)
            value = draw(st.sampled_from(INTERESTING) | st.integers(0, 2**bits - 1))
            chunk = struct.pack(fmt, value % 2**bits)
            out[pos : pos + len(chunk)] = chunk
        elif op == "truncate":
            del out[pos:]
        elif op == "insert":
            out[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        else:
            del out[pos : pos + draw(st.integers(1, 16))]
    return bytes(out)


def _fuzz_gguf(valid_inputs, region: str, data_fn) -> None:
    data = valid_inputs["gguf"]
    start, end = gguf_regions(data)[region]
    path = valid_inputs["root"] / f"case-{region.replace(' ', '_')}.gguf"

    @FUZZ
    @given(case=mutated(data, start, end))
    def run(case: bytes) -> None:
        path.write_bytes(case)
        outcome(f"gguf {region}", lambda: data_fn(path))

    run()


@pytest.mark.parametrize("region", ["header", "metadata", "tensor table"])
def test_fuzz_gguf_header(valid_inputs, region):
    from hf2q_mlx.cli.info import describe

    def use(path: Path) -> None:
        describe(path).encode("utf-8")
        use_model(path)

    _fuzz_gguf(valid_inputs, region, use)


def test_fuzz_gguf_data(valid_inputs):
    _fuzz_gguf(valid_inputs, "data", use_model)


def test_fuzz_safetensors_header(valid_inputs):
    data = valid_inputs["safetensors"]
    header_end = 8 + struct.unpack_from("<Q", data)[0]
    hf = valid_inputs["root"] / "hf_safetensors"
    write_hf_dir(hf)

    @FUZZ
    @given(case=mutated(data, 0, header_end))
    def run(case: bytes) -> None:
        (hf / "model.safetensors").write_bytes(case)
        outcome("safetensors header", lambda: use_model(hf))

    run()


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=8,
)
SMALL_INTS = st.integers(-3, 300) | st.sampled_from([0, 1, 2**31, 2**63, 2**64])


@st.composite
def mutated_json(draw, base: dict) -> str:
    """``base`` with some values replaced, keys removed or added, or its text cut or flipped."""
    doc = json.loads(json.dumps(base))
    for _ in range(draw(st.integers(1, 3))):
        # walk down to a random container
        node = doc
        for _ in range(draw(st.integers(0, 3))):
            children = list(node.items()) if isinstance(node, dict) else list(enumerate(node))
            children = [(k, v) for k, v in children if isinstance(v, (dict, list)) and v]
            if not children:
                break
            node = draw(st.sampled_from(children))[1]
        keys = list(node.keys()) if isinstance(node, dict) else list(range(len(node)))
        if not keys:
            continue
        key = draw(st.sampled_from(keys))
        op = draw(st.sampled_from(["value", "int", "delete", "add"]))
        if op == "value":
            node[key] = draw(JSON_VALUES)
        elif op == "int":
            node[key] = draw(SMALL_INTS)
        elif op == "delete":
            del node[key]
        elif isinstance(node, dict):
            node[draw(st.text(max_size=8))] = draw(JSON_VALUES)
    text = json.dumps(doc, allow_nan=True)
    if draw(st.integers(0, 9)) == 0:  # sometimes not even JSON
        raw = bytearray(text.encode())
        pos = draw(st.integers(0, max(0, len(raw) - 1)))
        raw[pos : pos + 1] = draw(st.binary(min_size=0, max_size=3))
        text = raw.decode("utf-8", errors="replace")
    return text


def test_fuzz_config_json(valid_inputs):
    hf = valid_inputs["root"] / "hf_config"
    write_hf_dir(hf)

    @FUZZ
    @given(case=mutated_json(llama_config()))
    def run(case: str) -> None:
        (hf / "config.json").write_text(case)
        outcome("config.json", lambda: use_model(hf))

    run()


def test_fuzz_tokenizer_json(valid_inputs):
    from hf2q_mlx.io.malformed_input import read_tokenizer
    from hf2q_mlx.tokenizer.tokenizer import Tokenizer

    folder = valid_inputs["root"] / "tokenizer"
    folder.mkdir(exist_ok=True)

    def use() -> None:
        tok = read_tokenizer(lambda: Tokenizer.from_hf_dir(folder), folder)  # as load() does
        ids = tok.encode("the hat in a tin é ✓", add_special_tokens=True)
        tok.decode(ids).encode("utf-8")
        detok = tok.detokenizer()
        for t in ids:
            detok.add_token(t)
        detok.finalize()

    @FUZZ
    @given(case=mutated_json(tokenizer_json()))
    def run(case: str) -> None:
        (folder / "tokenizer.json").write_text(case)
        outcome("tokenizer.json", use)

    run()


# ---------------------------------------------------------------- API arguments

ANY_VALUE = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=6)
    | st.binary(max_size=4)
    | st.lists(st.integers(-5, 400) | st.text(max_size=3), max_size=4)
    | st.tuples(st.integers(0, 9), st.integers(0, 9))
)
PROMPTS = (
    ANY_VALUE
    | st.lists(st.integers(-(2**65), 2**65), min_size=0, max_size=6)
    | st.lists(st.integers(0, VOCAB + 2), min_size=1, max_size=6)
    | st.lists(
        st.fixed_dictionaries({"role": ANY_VALUE | st.sampled_from(["user", "assistant"])})
        | st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system"]), "content": ANY_VALUE | st.text()}
        ),
        min_size=1,
        max_size=3,
    )
)
OPTIONS = st.fixed_dictionaries(
    {},
    optional={
        "max_tokens": ANY_VALUE | st.integers(-2, 4),
        "temperature": ANY_VALUE | st.floats(0, 2),
        "top_k": ANY_VALUE | st.integers(-1, 400),
        "top_p": ANY_VALUE | st.floats(0, 1),
        "min_p": ANY_VALUE | st.floats(0, 1),
        "repetition_penalty": ANY_VALUE | st.floats(0, 3),
        "repetition_context_size": ANY_VALUE | st.integers(0, 30),
        "seed": ANY_VALUE | st.integers(-1, 2**64),
        "stop": ANY_VALUE | st.lists(st.text(max_size=3), max_size=3),
        "prefill_step_size": ANY_VALUE | st.integers(0, 4),
        "kv_bits": ANY_VALUE | st.sampled_from([8, 4, "8,4", (8, 4), 7, "x", (8,)]),
        "ignore_eos": ANY_VALUE,
    },
)


@pytest.fixture(scope="module")
def loaded_tiny(valid_inputs):
    import hf2q_mlx

    return hf2q_mlx.load(valid_inputs["root"] / "tiny.gguf")


def test_fuzz_api_arguments(loaded_tiny):
    from hf2q_mlx.generation import stream_generate

    model, tok = loaded_tiny

    @FUZZ
    @given(prompt=PROMPTS, options=OPTIONS)
    def run(prompt, options) -> None:
        def call() -> None:
            for r in stream_generate(model, tok, prompt, **{"max_tokens": 2, **options}):
                if r.generation_tokens >= 3:
                    break

        outcome("API arguments", call)

    run()


def _mostly(valid, odd=ANY_VALUE):
    """``valid`` about nine times in ten, else any value: most bodies reach the later checks.
    (A drawn digit picks the side: one_of would weigh every branch of either side alike.)"""
    return st.tuples(st.integers(0, 9), valid, odd).map(lambda t: t[2] if t[0] == 9 else t[1])


TEXT_OR_IDS = st.text(min_size=1, max_size=12) | st.lists(st.integers(0, VOCAB - 1), min_size=1)
MESSAGES = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": st.text()}),
    min_size=1, max_size=3,
)  # fmt: skip
BODIES = st.fixed_dictionaries(
    {"model": _mostly(st.just("m")), "messages": _mostly(MESSAGES, PROMPTS),
     "prompt": _mostly(TEXT_OR_IDS, PROMPTS)},
    optional={
        "max_tokens": _mostly(st.integers(1, 4)),
        "max_completion_tokens": _mostly(st.integers(1, 4)),
        "temperature": _mostly(st.floats(0, 2)),
        "top_p": _mostly(st.floats(0.01, 1)),
        "top_k": _mostly(st.integers(0, 50)),
        "min_p": _mostly(st.floats(0, 1)),
        "n": _mostly(st.integers(1, 3)),
        "seed": _mostly(st.integers(0, 2**40)),
        "stop": _mostly(st.lists(st.text(min_size=1, max_size=3), max_size=3)),
        "logprobs": _mostly(st.booleans() | st.integers(0, 5)),
        "top_logprobs": _mostly(st.integers(0, 5)),
        "presence_penalty": _mostly(st.floats(-2, 2)),
        "frequency_penalty": _mostly(st.floats(-2, 2)),
        "logit_bias": _mostly(
            st.dictionaries(st.integers(0, VOCAB + 2).map(str), st.floats(-100, 100), max_size=3),
            st.dictionaries(st.text(max_size=4), ANY_VALUE, max_size=3) | ANY_VALUE,
        ),
        "response_format": _mostly(st.just({"type": "text"})),
        "repetition_penalty": _mostly(st.just(1.0)),
        "stream": _mostly(st.booleans()),
        "stream_options": _mostly(st.just({"include_usage": True})),
        "echo": _mostly(st.just(False)),
        "best_of": _mostly(st.just(1)),
        "tools": _mostly(st.none()),
    },
)  # fmt: skip


def test_fuzz_openai_request_bodies(loaded_tiny):
    """Request bodies of the OpenAI endpoints: parsed, submitted to an engine (not started: the
    submit's checks only) and each choice's options sampled once by the batch sampler; a 400-
    class Hf2qError or success, never another exception."""
    from hf2q_mlx.serving import openai_api as oa
    from hf2q_mlx.serving.batch_sampler import BatchSampler
    from hf2q_mlx.serving.engine import Engine

    model, tok = loaded_tiny
    engine = Engine(model, tok, max_batch=2, max_queue=1 << 30, max_len=64)
    sampler = BatchSampler(2, model.args.vocab_size)
    logits = mx.random.normal((2, model.args.vocab_size), key=mx.random.key(0))

    @FUZZ
    @given(body=BODIES, chat=st.booleans())
    def run(body, chat) -> None:
        def call() -> None:
            parse = oa.parse_chat if chat else oa.parse_completion
            parsed = parse(body, tok, {"m"}, engine.max_len)
            for params in parsed.choice_params():
                engine.submit(parsed.prompt, params, lambda event: None)
                sampler.set_row(0, params)
                sampler.sample(logits, [True, False])

        outcome("OpenAI bodies", call)

    run()


@given(path=ANY_VALUE, dtype=ANY_VALUE | st.sampled_from(["float32", "bfloat16", "f8", mx.int8]))
@FUZZ
def test_fuzz_load_arguments(path, dtype, tmp_path_factory):
    from hf2q_mlx.io.loader import load

    def call() -> None:
        if isinstance(path, str) and (path in ("", ".") or path.startswith(("/", "~"))):
            load(f"/nonexistent/{path}", dtype)  # never load whatever lies in the cwd or $HOME
        elif path is not None:
            load(path, dtype)

    outcome("load arguments", call)


# ---------------------------------------------------------------- memory bound

HUGE_CASES = {
    "tensor count 2**40": ("gguf", 8, "<Q", 2**40),
    "metadata count 2**63": ("gguf", 16, "<Q", 2**63),
    "first key length 2**62": ("gguf", 24, "<Q", 2**62),
    "safetensors header 2**40 bytes": ("safetensors", 0, "<Q", 2**40),
    "safetensors header 5 GB": ("safetensors", 0, "<Q", 5 * 10**9),
}


def test_huge_counts_stay_under_a_6gb_address_space(valid_inputs, tmp_path):
    """Files claiming huge counts or lengths fail with an Hf2qError in a process whose address
    space is capped at 6 GB (resource.RLIMIT_AS): nothing trusts a count before checking it."""
    cases = {}
    for name, (kind, offset, fmt, value) in HUGE_CASES.items():
        data = bytearray(valid_inputs[kind])
        struct.pack_into(fmt, data, offset, value)
        folder = tmp_path / name.replace(" ", "_").replace("*", "")
        if kind == "gguf":
            folder.mkdir()
            (folder / "m.gguf").write_bytes(data)
            cases[name] = str(folder / "m.gguf")
        else:
            write_hf_dir(folder)
            (folder / "model.safetensors").write_bytes(data)
            cases[name] = str(folder)
    # token ids that would size the tokenizer's tables at 2**31 or 2**40 entries
    for where, value in (("vocab", 2**31), ("added", 2**40)):
        spec = tokenizer_json()
        if where == "vocab":
            spec["model"]["vocab"]["he"] = value
        else:
            spec["added_tokens"][0]["id"] = value
        folder = write_hf_dir(tmp_path / f"token_id_{where}")
        (folder / "tokenizer.json").write_text(json.dumps(spec))
        cases[f"{where} token id {value}"] = str(folder)
    # a tensor whose dimensions claim 2**40 elements while the data section is tiny
    data = bytearray(valid_inputs["gguf"])
    at = data.index(b"token_embd.weight") + len(b"token_embd.weight") + 4
    struct.pack_into("<Q", data, at, 2**40)
    (tmp_path / "dims.gguf").write_bytes(data)
    cases["tensor dims 2**40"] = str(tmp_path / "dims.gguf")

    code = textwrap.dedent(
        """
        import json, resource, sys
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))
        import hf2q_mlx
        from hf2q_mlx.errors import Hf2qError
        results = {}
        for name, path in json.loads(sys.argv[1]).items():
            try:
                hf2q_mlx.load(path)
                results[name] = "loaded"
            except Hf2qError as err:
                results[name] = "Hf2qError"
            except BaseException as err:
                results[name] = f"{type(err).__name__}: {err}"[:300]
        print(json.dumps(results))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(cases)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert results == {name: "Hf2qError" for name in cases}, results
