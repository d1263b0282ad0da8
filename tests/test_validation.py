"""Every public API argument is checked at the boundary: a caller mistake raises an Hf2qError
subclass whose one-line message names the argument, before any model work."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
from test_generate import TOK, TinyModel

from hf2q_mlx.errors import Hf2qError, InvalidArgumentError, SamplingOptionsError, TokenizerError
from hf2q_mlx.generation import parse_kv_bits, stream_generate

MODEL = TinyModel(seed=3)  # vocab_size 64


@pytest.mark.parametrize(
    "prompt, fragment",
    [
        (123, "prompt"),
        (None, "prompt"),
        ({"role": "user"}, "prompt"),
        (b"bytes", "prompt"),
        ([0, "a"], "prompt"),
        ([0, True], "prompt"),
        ([[0, 1]], "prompt"),
        ([{"role": 3, "content": "hi"}], "'role'"),
        ([{"role": "user", "content": None}], "'content'"),
        ([{"content": "hi"}], "'role'"),
        ([999999999], "token id 999999999"),
        ([-1], "token id -1"),
        ([64], "token id 64"),  # == vocab_size
        ([2**40], "token id"),
        ([0, 5, 2**63], "token id"),
    ],
)
def test_bad_prompts(prompt, fragment):
    with pytest.raises(InvalidArgumentError, match=fragment) as err:
        stream_generate(MODEL, TOK, prompt, max_tokens=2)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": None}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_p": "1"}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": [0.1]}, "min_p"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_k": -1}, "top_k"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": "1"}, "repetition_penalty"),
        ({"repetition_context_size": 0}, "repetition context"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.0}, "max_tokens"),
        ({"max_tokens": "5"}, "max_tokens"),
        ({"seed": -1, "temperature": 0.5}, "seed"),
        ({"seed": 2**64, "temperature": 0.5}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"seed": "1"}, "seed"),
        ({"stop": 123}, "stop"),
        ({"stop": [1]}, "stop"),
        ({"stop": ""}, "stop"),
        ({"kv_bits": 3.5}, "kv_bits"),
        ({"kv_bits": "abc"}, "kv_bits"),
        ({"kv_bits": [8, 8, 8]}, "kv_bits"),
        ({"kv_bits": object()}, "kv_bits"),
        ({"prefill_step_size": 0}, "prefill_step_size"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"cache": "no"}, "cache"),
    ],
)
def test_bad_options(kwargs, fragment):
    with pytest.raises(InvalidArgumentError, match=fragment) as err:
        stream_generate(MODEL, TOK, [0, 3, 4], **kwargs)
    assert "\n" not in str(err.value)


def test_kv_bits_message_shows_the_value():
    with pytest.raises(SamplingOptionsError, match="got 'abc'"):
        parse_kv_bits("abc")


def test_extreme_seeds_accepted():
    for seed in (0, 2**64 - 1):
        out = list(stream_generate(MODEL, TOK, [0, 3], max_tokens=2, temperature=0.5, seed=seed))
        assert len(out) >= 1


def test_load_bad_path_and_dtype(tmp_path):
    from hf2q_mlx.io.loader import load, resolve_dtype

    for bad in (123, ["a.gguf"]):
        with pytest.raises(Hf2qError, match="path"):
            load(bad)
    with pytest.raises(Hf2qError, match="dtype"):
        resolve_dtype("float8")
    with pytest.raises(Hf2qError, match="dtype"):
        resolve_dtype(3)


def test_tokenizer_decode_rejects_out_of_range_ids(smollm2_gguf_path):
    from hf2q_mlx.io.gguf import GGUFFile
    from hf2q_mlx.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(GGUFFile(smollm2_gguf_path).metadata)
    assert tok.decode([tok.vocab_size - 1]) is not None
    for bad in (-1, tok.vocab_size, 999999999, 2**40):
        with pytest.raises(TokenizerError, match=str(bad)):
            tok.decode([1, bad])


@pytest.mark.parametrize(
    "tokens, bos, fragment",
    [([1, 2, 999999999], None, "token id 999999999"), ([1, 2, 3], 64, "token id 64"),
     ([1, 2, -1], None, "token id -1"), ("abc", None, "list of integer"),
     ([1, 2.5, 3], None, "list of integer")],
)  # fmt: skip
def test_perplexity_rejects_bad_token_ids(tokens, bos, fragment):
    from hf2q_mlx.cli.perplexity import perplexity

    with pytest.raises(InvalidArgumentError, match=fragment):
        perplexity(MODEL, tokens, context=8, bos_token_id=bos)


def test_out_of_range_ids_on_a_real_model_do_not_crash(smollm2_gguf_path):
    # before the check, a gather at 999999999 read outside the embedding and segfaulted
    code = textwrap.dedent(
        f"""
        import hf2q_mlx
        from hf2q_mlx.errors import InvalidArgumentError
        model, tok = hf2q_mlx.load({str(smollm2_gguf_path)!r})
        for ids in ([999999999], [-1], [model.args.vocab_size], [2**40]):
            try:
                list(hf2q_mlx.stream_generate(model, tok, ids, max_tokens=1))
            except InvalidArgumentError as err:
                print("ok", err)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("ok ") == 4


def test_generate_twice_in_one_process():
    # the lazy attribute `generate` was shadowed by the submodule of the same name on first use
    code = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import hf2q_mlx
        from test_generate import TOK, TinyModel
        model = TinyModel(seed=1)
        a = hf2q_mlx.generate(model, TOK, [0, 3, 4], max_tokens=3)
        b = hf2q_mlx.generate(model, TOK, [0, 3, 4], max_tokens=3)
        assert a == b, (a, b)
        print("twice ok")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "twice ok" in proc.stdout, proc.stderr[-2000:]


def test_chat_messages_to_a_model_without_its_own_template_warn():
    class BaseModelTokenizer(type(TOK)):
        chat_template_is_builtin = True

    messages = [{"role": "user", "content": "hello"}]
    with pytest.warns(UserWarning, match="no chat template"):
        stream_generate(MODEL, BaseModelTokenizer(), messages, max_tokens=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stream_generate(MODEL, TOK, messages, max_tokens=1)


@pytest.mark.parametrize("text", ["²", "x", "-1", "1.5", "3"])
def test_environment_switches_take_ascii_digits_in_range(text, monkeypatch):
    """``env_int``: '²' is a digit to Python's str.isdigit but not to int(); it, and anything
    else outside 0..2, raises InvalidArgumentError naming the variable, never a ValueError."""
    from hf2q_mlx.custom_kernels import env_int

    monkeypatch.setenv("HF2Q_TEST_SWITCH", text)
    with pytest.raises(InvalidArgumentError, match="HF2Q_TEST_SWITCH"):
        env_int("HF2Q_TEST_SWITCH", 0, 2)
    monkeypatch.setenv("HF2Q_TEST_SWITCH", " 2 ")
    assert env_int("HF2Q_TEST_SWITCH", 0, 2) == 2


def test_environment_switches_follow_every_change(monkeypatch):
    """``env_int`` keeps its parsed value per raw value: each change (the same text set again
    included), a bad value (raised every time, never kept) and unsetting are seen."""
    from hf2q_mlx.custom_kernels import env_int

    monkeypatch.delenv("HF2Q_TEST_SWITCH", raising=False)
    assert env_int("HF2Q_TEST_SWITCH", 0, 9) is None
    for text, want in (("3", 3), ("3", 3), ("7", 7), ("", None), ("0", 0)):
        monkeypatch.setenv("HF2Q_TEST_SWITCH", text)
        assert env_int("HF2Q_TEST_SWITCH", 0, 9) == want, text
        assert env_int("HF2Q_TEST_SWITCH", 0, 9) == want, text  # the cached read
    monkeypatch.setenv("HF2Q_TEST_SWITCH", "10")
    for _ in range(2):
        with pytest.raises(InvalidArgumentError, match="HF2Q_TEST_SWITCH"):
            env_int("HF2Q_TEST_SWITCH", 0, 9)
    assert env_int("HF2Q_TEST_SWITCH", 0, 10) == 10  # its own range: parsed on its own
    monkeypatch.delenv("HF2Q_TEST_SWITCH")
    assert env_int("HF2Q_TEST_SWITCH", 0, 9) is None
