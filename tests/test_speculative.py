"""Speculative decoding: greedy output identical to plain decoding on every family (draft model,
the target as its own draft, prompt lookup, token tree, TurboQuant caches), exact rollback of
each cache kind, speculative sampling's distribution (chi-square), B-row verify, validation."""

from __future__ import annotations

from functools import lru_cache, partial

import mlx.core as mx
import numpy as np
import pytest
from conftest import IdsTokenizer
from mlx.utils import tree_map
from scipy import stats

from hf2q_mlx import decode_step
from hf2q_mlx import speculative as spec
from hf2q_mlx.decode_step import DecodeStep
from hf2q_mlx.errors import DraftModelError, SamplingOptionsError
from hf2q_mlx.generation import make_prompt_cache, stream_generate
from hf2q_mlx.models.cache import KVCache, RotatingKVCache, TokenTree
from hf2q_mlx.models.recurrent_cache import restore_cache, snapshot_cache
from hf2q_mlx.models.static_cache import StaticTQCache
from hf2q_mlx.models.turboquant.cache import make_tq_cache

pytest.importorskip("torch")
pytest.importorskip("transformers")

PROMPT = [5, 17, 33, 2, 41, 9, 17, 33]


@pytest.fixture(autouse=True)
def compiled_decode(monkeypatch):
    """These tests drive the compiled step's speculative path, which a GPU takes by default and
    the CPU with HF2Q_DECODE=compiled (eager there by default: generation.decode_mode)."""
    monkeypatch.setenv("HF2Q_DECODE", "compiled")


PENALTY = 3.0
N_TOKENS = 40  # Gemma 3's window is 5 and Gemma 4's 4: a run crosses them many times


Tok = partial(IdsTokenizer, vocab_size=96)  # token ids only: generation reads ids


@lru_cache(maxsize=None)
def target(name: str):
    """Tiny random models of every family, built by the families' own parity tests."""
    if name in ("gemma3", "llama"):
        import test_models

        return test_models.mlx_from_hf(name, test_models.tiny_hf_model(name))
    if name == "qwen2":
        import test_qwen2

        return test_qwen2.ours_from_hf(next(iter(test_qwen2.CONFIGS)))
    if name.startswith("gemma4-"):
        import test_gemma4

        variant = name.split("-")[1]
        if variant == "eseries":  # per-layer embeddings for every generated id
            variant = "eseries-full-vocab"
            test_gemma4.VARIANTS[variant] = {
                **test_gemma4.VARIANTS["eseries"],
                "vocab_size_per_layer_input": test_gemma4.BASE["vocab_size"],
            }
        return test_gemma4.ours(variant)
    import test_qwen3_5

    return test_qwen3_5.ours(name.split("-")[1])


@lru_cache(maxsize=None)
def noisy_draft(name: str, scale: float | None = None):
    """A different model of the same shape: the target's weights plus noise, so it agrees with
    the target often but not always (partial acceptance; the recurrent state is sensitive)."""
    scale = scale if scale is not None else 0.04 if name.startswith("qwen3_5") else 0.6
    t = target(name)
    draft = type(t)(t.args)
    key = iter(mx.random.split(mx.random.key(7), 4096))

    def perturb(p: mx.array) -> mx.array:
        if not mx.issubdtype(p.dtype, mx.floating):
            return p
        noise = mx.random.normal(p.shape, key=next(key))
        return p + scale * mx.std(p) * noise

    draft.update(tree_map(perturb, t.parameters()))
    mx.eval(draft.parameters())
    return draft


FAMILIES = [
    "gemma3", "llama", "qwen2", "gemma4-dense", "gemma4-moe", "gemma4-eseries",
    "qwen3_5-dense", "qwen3_5-moe",
]  # fmt: skip


def tokens_of(model, **kwargs) -> tuple[list[int], object]:
    # random models repeat one token greedily; a repetition penalty keeps the output varied
    # (and runs the logits processors through the verify)
    # fixed K (today's rounds, checked by their verify lengths); adaptive: test_draft_length.py
    kwargs = {"repetition_penalty": PENALTY, "adaptive_drafts": False, **kwargs}
    rs = list(stream_generate(model, Tok(), PROMPT, max_tokens=N_TOKENS, ignore_eos=True, **kwargs))
    LAST_LOGPROBS[:] = [r.logprob for r in rs]
    return [r.token for r in rs], rs[-1]


LAST_LOGPROBS: list[float] = []  # of the latest tokens_of run


@lru_cache(maxsize=None)
def plain(name: str, kv_bits=None) -> list[int]:
    tokens = tokens_of(target(name), kv_bits=kv_bits)[0]
    PLAIN_LOGPROBS[name, kv_bits] = list(LAST_LOGPROBS)
    return tokens


PLAIN_LOGPROBS: dict = {}


def plain_logprobs(name: str) -> list[float]:
    plain(name)
    return PLAIN_LOGPROBS[name, None]


@pytest.fixture
def verify_lengths(monkeypatch) -> list[tuple]:
    """(model, L) of every compiled call while the test runs: DecodeStep.verify (L tokens per
    row) and DecodeStep.decode (L = 0)."""
    lengths: list[tuple] = []
    verify, decode = DecodeStep.verify, DecodeStep.decode

    def counted_verify(self, tokens, *args, **kwargs):
        lengths.append((self.model, tokens.shape[1]))
        return verify(self, tokens, *args, **kwargs)

    def counted_decode(self, tokens, *args, **kwargs):
        lengths.append((self.model, 0))
        return decode(self, tokens, *args, **kwargs)

    monkeypatch.setattr(DecodeStep, "verify", counted_verify)
    monkeypatch.setattr(DecodeStep, "decode", counted_decode)
    return lengths


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_identical_on_every_family(name, verify_lengths):
    want = plain(name)
    assert len(set(want)) > 3, "a degenerate reference would prove little"
    m = target(name)

    def target_lengths(draft=None) -> list[int]:
        """The target's verify lengths since the last call; a ``draft`` without recurrent
        layers drafts on its own compiled step."""
        out = [n for model, n in verify_lengths if model is m and n > 0]
        if draft is not None:
            compiled_draft = any(model is draft for model, _ in verify_lengths)
            assert compiled_draft == (not name.startswith("qwen3_5"))
        verify_lengths.clear()
        return out

    # the target as its own draft: every draft is accepted
    got, last = tokens_of(m, draft_model=m, num_draft_tokens=4)
    assert got == want
    # chain verifies run on the compiled step, drafts padded to K: one shape (L = 1 for a
    # round without drafts: the last token)
    lengths = target_lengths()
    assert 5 in lengths and set(lengths) <= {1, 5}
    # the same log-probabilities (fp32; the verify's shapes differ: rounding only)
    got_logprobs = list(LAST_LOGPROBS)
    np.testing.assert_allclose(got_logprobs, plain_logprobs(name), atol=1e-3)
    assert last.drafted_tokens > 0 and last.accepted_tokens == last.drafted_tokens
    # a different draft: some drafts rejected, output unchanged
    got, last = tokens_of(m, draft_model=noisy_draft(name), num_draft_tokens=3)
    assert got == want
    assert 0 < last.accepted_tokens < last.drafted_tokens
    lengths = target_lengths(draft=noisy_draft(name))
    assert 4 in lengths and set(lengths) <= {1, 4}
    # prompt lookup (rounds without a match verify the one token: L = 1)
    got, last = tokens_of(m, prompt_lookup=2, num_draft_tokens=3)
    assert got == want
    assert last.drafted_tokens > 0
    lengths = target_lengths()
    assert 4 in lengths and set(lengths) <= {1, 4}
    # token tree: several candidates per depth, eager (models with recurrent layers verify the
    # chain, on the compiled step)
    got, last = tokens_of(m, draft_model=noisy_draft(name), num_draft_tokens=3, tree_width=3)
    assert got == want
    assert last.accepted_tokens < last.drafted_tokens
    assert bool(target_lengths()) == name.startswith("qwen3_5")


@pytest.mark.parametrize("name", ["gemma3", "gemma4-eseries", "qwen3_5-dense"])
def test_greedy_identical_on_turboquant_caches(name, verify_lengths, monkeypatch):
    """TurboQuant caches: chain verifies on the compiled step's TurboQuant rows give plain
    decoding's greedy tokens, which are the eager path's; a token tree (eager) too."""
    want = plain(name, kv_bits=8)
    m = target(name)
    got, last = tokens_of(m, kv_bits=8, draft_model=noisy_draft(name), num_draft_tokens=4)
    assert got == want
    assert 0 < last.accepted_tokens < last.drafted_tokens
    assert any(model is m and L > 1 for model, L in verify_lengths)  # verified on the step
    steps = [s for s in m.__dict__[decode_step._STEPS].values() if s.kv_bits == (8, 8)]
    assert any(s.reserve == 4 for s in steps)
    assert all(any(isinstance(c, StaticTQCache) for c in s.caches) for s in steps)
    if name != "qwen3_5-dense":
        got, _ = tokens_of(m, kv_bits=8, draft_model=noisy_draft(name), tree_width=2)
        assert got == want
    # prompt lookup: pipelined rounds on the step (rollbacks by device counts)
    assert tokens_of(m, kv_bits=8, prompt_lookup=2, num_draft_tokens=3)[0] == want
    monkeypatch.setenv("HF2Q_DECODE", "eager")
    assert tokens_of(m, kv_bits=8)[0] == want


def test_draft_of_another_family_still_gives_the_targets_output():
    # Llama drafting for Gemma 3 (same vocabulary size, unrelated weights): mostly rejections
    want = plain("gemma3")
    got, last = tokens_of(target("gemma3"), draft_model=target("llama"), num_draft_tokens=4)
    assert got == want
    assert last.accepted_tokens < last.drafted_tokens


# ---- rollback: the cache after a rollback equals one that never saw the rejected tokens ------


def feed(model, cache, tokens: list[int]) -> mx.array:
    return model(mx.array(tokens, dtype=mx.int32)[None], cache=cache)


def cache_kinds(model):
    yield "plain", lambda: model.make_cache(reserve=4)
    yield "turboquant", lambda: make_tq_cache(model, 8, reserve=4)


def assert_same_state(a: list, b: list) -> None:
    for ca, cb in zip(a, b):
        assert ca.offset == cb.offset
        if hasattr(ca, "state"):  # recurrent: bit-exact (restored references)
            np.testing.assert_array_equal(np.array(ca.state), np.array(cb.state))
            np.testing.assert_array_equal(np.array(ca.conv_state), np.array(cb.conv_state))
            continue
        n = min(ca.offset, ca.keys.shape[2])
        slots = np.array(ca.slot_positions()) if hasattr(ca, "slot_positions") else None
        live = np.arange(n) if slots is None else np.nonzero(slots >= ca.offset - ca.window)[0]
        for x, y in ((ca.keys, cb.keys), (ca.values, cb.values)):
            # same inputs at the same positions through the same shapes: bit-exact data
            np.testing.assert_array_equal(np.array(x)[:, :, live], np.array(y)[:, :, live])


@pytest.mark.parametrize("name", ["gemma3", "gemma4-eseries", "qwen3_5-moe"])
def test_rollback_is_exact_for_every_cache_kind(name):
    m = target(name)
    rng = np.random.default_rng(3)
    prefix = rng.integers(0, 80, 13).tolist()  # past every sliding window: rings have wrapped
    rejected = rng.integers(0, 80, 4).tolist()
    after = rng.integers(0, 80, 3).tolist()
    for kind, make in cache_kinds(m):
        a, b = make(), make()
        feed(m, a, prefix)
        feed(m, b, prefix)
        snap = snapshot_cache(a)
        feed(m, a, rejected)
        if spec.has_recurrent(a):
            restore_cache(a, snap)
        else:
            for c in a:
                c.trim(len(rejected))
        la, lb = feed(m, a, after), feed(m, b, after)
        mx.eval(la, lb)
        assert_same_state(a, b)
        np.testing.assert_array_equal(np.array(la), np.array(lb), err_msg=kind)


@pytest.mark.parametrize("ring", [False, True])
def test_tree_keep_gives_the_cache_of_the_accepted_path(ring):
    # a token tree written and cut to one path == that path fed as a chain (rounding only:
    # the tree forward's shapes differ, fp32 ~1e-5)
    m = target("gemma3")
    prefix = [3, 9, 27, 1, 44, 60, 12, 7, 70, 31, 15]  # window 5: rings wrapped
    todo, chain, alts = [8], [21, 22, 23], [[31, 41], [32, 42], [33, 43]]
    parents, depths = spec.tree_layout(1, 3, 3)
    tokens = todo + chain + sum(alts, [])
    path = [0, 1, 6]  # the todo token, chain depth 1, then the second alternative at depth 2
    a = m.make_cache(reserve=len(tokens)) if ring else [KVCache() for _ in m.layers]
    b = m.make_cache(reserve=len(tokens)) if ring else [KVCache() for _ in m.layers]
    assert any(isinstance(c, RotatingKVCache) for c in a) == ring
    feed(m, a, prefix)
    feed(m, b, prefix)
    o = a[0].offset
    tree = TokenTree(
        mx.array([[o + d for d in depths]], dtype=mx.int32), mx.array(spec.tree_mask(parents))
    )
    for c in a:
        c.tree = tree
    tree_logits = feed(m, a, tokens)
    for c in a:
        c.tree = None
        c.keep(o, path)
    chain_logits = feed(m, b, [tokens[i] for i in path])
    # each tree node's logits equal those of its root-to-node chain
    np.testing.assert_allclose(
        np.array(tree_logits[0, path]), np.array(chain_logits[0]), rtol=1e-4, atol=1e-4
    )
    la, lb = feed(m, a, [50, 51]), feed(m, b, [50, 51])
    np.testing.assert_allclose(np.array(la), np.array(lb), rtol=1e-4, atol=1e-4)
    assert [c.offset for c in a] == [c.offset for c in b]


# ---- speculative sampling ----------------------------------------------------------------------

# Direct test of the accept / resample rule: many independent positions in one call, each with
# the same target p and draft q, drafts drawn from q. The emitted token at every position must be
# distributed as p. N = 40000: moving 2 % of the probability mass between two tokens of p = 0.2
# gives a chi-square noncentrality of N * 2 * 0.02^2 / 0.2 = 160, detected at alpha = 1e-3
# (7 degrees of freedom) with power > 0.999; the test itself rejects at alpha = 1e-4.
N_SAMPLES = 40_000


def _dists(v: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.ones(v))
    q = rng.dirichlet(np.ones(v) * 0.5)  # deliberately unlike p
    return p, q


def _chi2_pvalue(counts: np.ndarray, p: np.ndarray) -> float:
    return float(stats.chisquare(counts, counts.sum() * p).pvalue)


@pytest.mark.parametrize("point_mass", [False, True])
def test_accept_resample_rule_keeps_the_target_distribution(point_mass):
    V = 8
    p, q = _dists(V, seed=11)
    key_d, key_a = mx.random.split(mx.random.key(5))
    K = N_SAMPLES
    q_rows = mx.broadcast_to(mx.array(q, dtype=mx.float32), (K, V))
    drafts = mx.random.categorical(mx.log(q_rows), key=key_d).astype(mx.int32)
    logits = mx.broadcast_to(mx.log(mx.array(p, dtype=mx.float32)), (K + 1, V))
    warp = spec.Warp(temperature=1.0)
    ok, cand, _, _ = spec.accept_candidates(
        logits, drafts, warp, None if point_mass else q_rows, key_a
    )
    emitted = np.where(np.array(ok), np.array(drafts), np.array(cand[:K]))
    counts = np.bincount(emitted, minlength=V)
    assert _chi2_pvalue(counts, p) > 1e-4
    # the check has teeth: the drafts alone (q) are rejected by the same test
    assert _chi2_pvalue(np.bincount(np.array(drafts), minlength=V), p) < 1e-4
    # acceptance rate is sum(min(p, q)) (or p(d) summed under q for point masses)
    rate = np.array(ok).mean()
    want = np.minimum(p, q).sum() if not point_mass else (p * q).sum()
    assert abs(rate - want) < 0.02


class Bigram:
    """Tiny-vocabulary model whose next-token distribution depends on the last token only:
    logits = table[last token]. A KV cache of token ids keeps the offset and rolls back."""

    def __init__(self, table: np.ndarray):
        self.table = mx.array(table, dtype=mx.float32)
        self.args = type("A", (), {"vocab_size": table.shape[0]})()
        self.layers = [None]

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        if cache is not None:
            x = inputs[:, None, :, None].astype(mx.float32)
            cache[0].update_and_fetch(x, x)
        return self.table[inputs]

    def make_cache(self, reserve: int = 0) -> list:
        return [KVCache()]


def test_speculative_sampling_end_to_end_matches_the_target_transitions():
    # every generated transition a -> b must follow the target's p(b | a): chi-square per row
    V = 6
    rng = np.random.default_rng(4)
    target_table = np.log(rng.dirichlet(np.ones(V), size=V))
    draft_table = np.log(rng.dirichlet(np.ones(V), size=V))
    tok = Tok()
    tok.vocab_size = V
    rs = list(
        stream_generate(
            Bigram(target_table), tok, [0], max_tokens=6000, temperature=1.0, seed=3,
            ignore_eos=True, draft_model=Bigram(draft_table), num_draft_tokens=3,
        )
    )  # fmt: skip
    seq = [0] + [r.token for r in rs]
    assert 0 < rs[-1].accepted_tokens < rs[-1].drafted_tokens
    counts = np.zeros((V, V))
    for a, b in zip(seq, seq[1:]):
        counts[a, b] += 1
    p = np.exp(target_table)
    pvalues = [_chi2_pvalue(counts[a], p[a]) for a in range(V)]
    assert min(pvalues) > 1e-4 / V, pvalues  # Bonferroni over the rows
    # teeth: the draft's transitions are rejected
    q = np.exp(draft_table)
    assert min(_chi2_pvalue(counts[a], q[a]) for a in range(V)) < 1e-4


# ---- B rows, prompt lookup, validation ---------------------------------------------------------


def test_verify_rows_each_with_its_own_drafts_match_single_rows():
    m = target("llama")
    prompts = [[4, 8, 15, 16, 23, 42], [1, 2, 3, 5, 8, 13]]
    want = [tokens_of_prompt(m, p) for p in prompts]
    cache = m.make_cache()
    logits = m(mx.array(prompts, dtype=mx.int32), cache=cache)
    todo = [[int(t)] for t in mx.argmax(logits[:, -1], axis=-1).tolist()]
    got = [[t[0]] for t in todo]
    rng = np.random.default_rng(0)
    draft_k = [3, 1]
    while min(len(g) for g in got) < 16:
        # drafts: the true continuation with random corruptions, different per row
        drafts = []
        for b in range(2):
            d = want[b][len(got[b]) : len(got[b]) + draft_k[b]]
            drafts.append([t if rng.random() < 0.7 else (t + 1) % 80 for t in d])
        res = spec.verify_rows(m, cache, todo, drafts)
        for b in range(2):
            got[b] += res[b].tokens
            todo[b] = res[b].todo
    for b in range(2):
        assert got[b][:16] == want[b][:16]


@pytest.mark.parametrize("name", ["llama", "qwen3_5-dense"])
def test_verify_step_rows_at_their_own_positions_match_single_rows(name):
    # the compiled step: rows at different positions (prompts of 6 and 3 tokens), each with its
    # own corrupted drafts and its own rollback; a third row idles throughout
    m = target(name)
    prompts = [[4, 8, 15, 16, 23, 42], [1, 2, 3]]
    want = [tokens_of_prompt(m, p) for p in prompts]
    step = DecodeStep(m, max_batch=3, max_len=64, reserve=3)
    todo = [[int(mx.argmax(step.prefill(b, p)).item())] for b, p in enumerate(prompts)]
    got = [[t[0]] for t in todo]
    rng = np.random.default_rng(1)
    while min(len(g) for g in got) < 16:
        drafts = []
        for b in range(2):
            d = want[b][len(got[b]) : len(got[b]) + 3]
            drafts.append([t if rng.random() < 0.7 else (t + 1) % 80 for t in d])
        res = spec.verify_step_rows(step, [0, 1], todo, drafts, length=4)
        for b in range(2):
            got[b] += res[b].tokens
            todo[b] = res[b].todo
            assert todo[b] == [got[b][-1]]  # exact rollback: nothing to re-feed
    for b in range(2):
        assert got[b][:16] == want[b][:16]
        assert step.positions[b] == len(prompts[b]) + len(got[b]) - 1
    assert step.positions[2] == 0


def tokens_of_prompt(m, prompt: list[int]) -> list[int]:
    rs = stream_generate(m, Tok(), prompt, max_tokens=24, ignore_eos=True)
    return [r.token for r in rs]


def test_prompt_lookup_proposes_what_followed_the_last_ngram():
    pl = spec.PromptLookup(3)
    toks = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert pl.propose(toks, 4) == [7, 8, 1, 2]  # the latest earlier [1, 2, 3]
    assert pl.propose([9, 2, 3, 4, 1, 2, 3], 2) == [4, 1]  # no [1, 2, 3] before: [2, 3]
    assert spec.PromptLookup(2).propose([5, 6, 7, 5, 6], 2) == [7, 5]
    assert pl.propose([1, 2, 3], 2) == []


def test_arguments_are_checked():
    m = target("llama")
    with pytest.raises(SamplingOptionsError, match="not both"):
        tokens_of(m, draft_model=m, prompt_lookup=2)
    for k in (0, spec.MAX_DRAFT_TOKENS + 1, 2.0):
        with pytest.raises(SamplingOptionsError, match="num_draft_tokens"):
            tokens_of(m, prompt_lookup=2, num_draft_tokens=k)
    with pytest.raises(SamplingOptionsError, match="prompt_lookup"):
        tokens_of(m, prompt_lookup=0)
    other = type(m)(type(m.args).from_dict({**vars(m.args), "vocab_size": 64}))
    with pytest.raises(DraftModelError, match="vocabulary"):
        tokens_of(m, draft_model=other)
    with pytest.raises(DraftModelError):
        tokens_of(m, draft_model="small.gguf")
    with pytest.raises(SamplingOptionsError, match="greedy"):
        tokens_of(m, draft_model=m, tree_width=2, temperature=0.7)
    g = target("gemma3")
    with pytest.raises(SamplingOptionsError, match="reserve"):
        tokens_of(g, draft_model=g, cache=make_prompt_cache(g))


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--prompt-lookup", "0"], "prompt_lookup"),
        (["--prompt-lookup", "2", "--num-draft", "0"], "num_draft_tokens"),
        (["--prompt-lookup", "2", "--draft-model", "d.gguf"], "not both"),
    ],
)
def test_cli_speculative_flags_fail_before_loading(flags, fragment, capsys):
    from hf2q_mlx.cli import commands as cli

    rc = cli.main(["generate", "hi", "--model", "/does/not/exist", *flags])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and fragment in err and "not found" not in err


def test_cli_generate_with_a_draft_model_reports_acceptance(monkeypatch, capsys):
    from hf2q_mlx.cli import commands as cli

    m, draft = target("llama"), noisy_draft("llama")
    tok = Tok()
    tok.encode = lambda text, add_special_tokens=True: list(PROMPT)
    loaded = []

    def fake_load(path, quiet=False, chat=False):
        loaded.append(path)
        return (draft if path == "draft.gguf" else m), tok

    monkeypatch.setattr(cli, "_load", fake_load)
    argv = ["generate", "hi", "--raw", "--max-tokens", "12", "--model", "t.gguf"]
    # fixed K: drafts every round (adaptive, the step's learned costs may say k = 0 on a CPU)
    assert (
        cli.main([*argv, "--draft-model", "draft.gguf", "--num-draft", "3", "--fixed-draft"]) == 0
    )
    assert loaded == ["t.gguf", "draft.gguf"]
    assert "drafts accepted" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["llama", "qwen3_5-dense"])
def test_adaptive_run_traces_every_verify_length_first(name, verify_lengths):
    """An adaptive run on the compiled step verifies L = 2 .. K + 1 before its first round
    (DecodeStep.warm_verify: no trace mid-stream whatever k the controller picks), and its
    greedy output is still plain decoding's; the next run on that step, and a fixed-K run,
    do not warm again."""
    m = target(name)
    m.__dict__.pop(decode_step._STEPS, None)  # a new step: nothing traced yet
    got, _ = tokens_of(m, prompt_lookup=2, num_draft_tokens=3, adaptive_drafts=True)
    assert got == plain(name)
    assert [n for model, n in verify_lengths if model is m][:3] == [2, 3, 4]
    (step,) = [s for s in m.__dict__[decode_step._STEPS].values() if s.reserve == 3]
    assert {2, 3, 4} <= {L for L, _, _ in step._traced}
    for adaptive in (True, False):
        verify_lengths.clear()
        tokens_of(m, prompt_lookup=2, num_draft_tokens=3, adaptive_drafts=adaptive)
        assert [n for model, n in verify_lengths if model is m][:3] != [2, 3, 4]


def test_a_failing_set_up_releases_the_step(monkeypatch):
    """An error while the compiled step is set up for a speculative run (here the verify
    warm-up) propagates and leaves the step free for the next request."""
    m = target("llama")

    def fail(self, *args, **kwargs):
        raise RuntimeError("warm-up failed")

    monkeypatch.setattr(DecodeStep, "warm_verify", fail)
    with pytest.raises(RuntimeError, match="warm-up failed"):
        tokens_of(m, prompt_lookup=2, num_draft_tokens=3, adaptive_drafts=True)
    steps = m.__dict__.get(decode_step._STEPS, {}).values()
    assert steps and not any(s.busy for s in steps)
    monkeypatch.undo()
    assert tokens_of(m, prompt_lookup=2, num_draft_tokens=3, adaptive_drafts=True)[0] == plain(
        "llama"
    )
