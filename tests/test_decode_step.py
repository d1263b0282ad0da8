"""The compiled B-row decode step against the eager per-sequence path, on every family.

Rows sit at different positions (prompts of different lengths), cross the sliding windows many
times, pause (inactive rows), move between rows (save/load) and restart (reset). fp32 on both
sides; the two paths attend over different key layouts (padded static buffers vs exact-length
ones), so sums differ in order: 1e-4 of the largest logit.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import IdsTokenizer, requires_gpu
from mlx.utils import tree_flatten, tree_unflatten

from hf2q_mlx import decode_step as decode_step_module
from hf2q_mlx import generation
from hf2q_mlx.decode_step import DecodeStep, shared_step
from hf2q_mlx.errors import ContextLengthError, InvalidArgumentError
from hf2q_mlx.models import gemma3, gemma4, llama, qwen2, qwen3_5, qwen3_5_moe
from hf2q_mlx.models.cache import trim_cache
from hf2q_mlx.models.static_cache import StaticKVCache, StaticTQCache
from hf2q_mlx.models.turboquant.cache import make_tq_cache

RTOL = 1e-4
VOCAB = 96

S, F = "sliding_attention", "full_attention"
QWEN35 = dict(
    vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=6, rms_norm_eps=1e-5, num_hidden_layers=4,
    rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.25},
)  # fmt: skip
GEMMA4 = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, global_head_dim=64,
    sliding_window=4, hidden_size_per_layer_input=0, final_logit_softcapping=15.0,
    layer_types=[S, S, F, S, S, F], rms_norm_eps=1e-6,
)  # fmt: skip
CONFIGS = {
    "gemma3": (gemma3, dict(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=5,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=5,
        layer_types=[S, S, F, S, F], query_pre_attn_scalar=20, final_logit_softcapping=30.0,
    )),
    "llama": (llama, dict(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
        num_attention_heads=6, num_key_value_heads=2, rope_theta=1000.0,
        tie_word_embeddings=True,
    )),
    "qwen2": (qwen2, dict(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rope_theta=1000.0,
        tie_word_embeddings=False,
    )),
    "gemma4-dense": (gemma4, dict(GEMMA4, attention_k_eq_v=True, num_global_key_value_heads=1)),
    "gemma4-moe": (gemma4, dict(
        GEMMA4, attention_k_eq_v=True, num_global_key_value_heads=1, enable_moe_block=True,
        num_experts=8, top_k_experts=3, moe_intermediate_size=32,
    )),
    "gemma4-eseries": (gemma4, dict(
        GEMMA4, hidden_size_per_layer_input=32, vocab_size_per_layer_input=80,
        num_kv_shared_layers=3, use_double_wide_mlp=True, attention_bias=True,
    )),
    "qwen3_5-dense": (qwen3_5, dict(
        QWEN35, intermediate_size=96, full_attention_interval=3, tie_word_embeddings=False,
    )),
    "qwen3_5-moe": (qwen3_5_moe, dict(
        QWEN35, full_attention_interval=2, num_experts=8, num_experts_per_tok=3,
        moe_intermediate_size=32, shared_expert_intermediate_size=64, tie_word_embeddings=True,
    )),
}  # fmt: skip


@pytest.fixture(autouse=True)
def on_cpu(request):
    if "gpu" in request.node.name:
        yield
        return
    with mx.stream(mx.cpu):
        yield


def tiny_model(name: str, seed: int = 0) -> nn.Module:
    """Our model of the tiny config with every float parameter random (norms included). Norm
    weights and Gemma 4's layer / expert scalars go around their 1 (as test_gemma4's and
    test_kernel_wiring's models): as plain noise (|s| ~ 0.1) the scalars shrank the residual
    stream layer by layer and made tiny Gemma 4 amplify fp32 roundings 6-60x more (session 44,
    bench/conditioning_probe.py)."""
    module, cfg = CONFIGS[name]
    model = module.Model(module.ModelArgs.from_dict(dict(cfg)))
    keys = mx.random.split(mx.random.key(seed), len(tree_flatten(model.parameters())))
    params = []
    for i, (k, p) in enumerate(tree_flatten(model.parameters())):
        near_one = "norm" in k or k.endswith(("layer_scalar", "per_expert_scale"))
        noise = mx.random.normal(p.shape, key=keys[i]) * (0.3 if near_one else 0.1)
        params.append((k, (p + noise) if near_one else noise))
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())
    return model


def prompts(lengths, seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    vocab = 80  # below Gemma 4 E-series' per-layer vocabulary
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def eager_logits(
    model, prompt: list[int], continuation: list[int], kv_bits=None
) -> list[np.ndarray]:
    """Per-sequence caches (TurboQuant ones with ``kv_bits``): prefill, then one token at a
    time; logits after each input."""
    if kv_bits is not None:
        cache = make_tq_cache(model, *kv_bits)
    else:
        cache = model.make_cache() if hasattr(model, "make_cache") else None
    out = [np.array(model(mx.array([prompt]), cache=cache)[0, -1])]
    for t in continuation:
        out.append(np.array(model(mx.array([[t]]), cache=cache)[0, -1]))
    return out


def assert_close(got, want, what: str) -> None:
    got, want = np.asarray(got), np.asarray(want)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err <= RTOL, f"{what}: relative error {err:.2e}"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_rows_at_own_positions_match_eager(name):
    model = tiny_model(name)
    lengths, steps = [3, 9, 1], 18  # 27 tokens: the 4- and 5-wide windows wrap several times
    ps = prompts(lengths)
    rng = np.random.default_rng(7)
    conts = [rng.integers(0, 80, steps).tolist() for _ in ps]
    step = DecodeStep(model, max_batch=len(ps), max_len=40)
    first = [step.prefill(r, p) for r, p in enumerate(ps)]
    got = [[np.array(f)] for f in first]
    for i in range(steps):
        logits = step.decode([c[i] for c in conts])
        for r in range(len(ps)):
            got[r].append(np.array(logits[r]))
    for r, (p, c) in enumerate(zip(ps, conts)):
        want = eager_logits(model, p, c)
        for i, (g, w) in enumerate(zip(got[r], want)):
            assert_close(g, w, f"{name} row {r} step {i}")
    assert step.positions == [n + steps for n in lengths]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_turboquant_rows_match_eager(name):
    """``kv_bits``: every attention cache static TurboQuant, each row quantized with the
    balance its own prompt calibrated. Rows at their own positions give the per-sequence
    TurboQuant cache's logits (1e-4 of the largest, fp32: the same reference ops on the packed
    rows, the step's masked slots adding exact zeros), and not the full-precision cache's
    (K4/V3 codes move logits by far more than that)."""
    model, kv = tiny_model(name), (4, 3)
    lengths, steps = [3, 9, 1], 14
    ps = prompts(lengths, seed=4)
    rng = np.random.default_rng(8)
    conts = [rng.integers(0, 80, steps).tolist() for _ in ps]
    step = DecodeStep(model, max_batch=len(ps), max_len=32, kv_bits=kv)
    assert any(isinstance(s, StaticTQCache) for s in step.caches)
    got = [[np.array(step.prefill(r, p))] for r, p in enumerate(ps)]
    for i in range(steps):
        logits = step.decode([c[i] for c in conts])
        for r in range(len(ps)):
            got[r].append(np.array(logits[r]))
    apart = 0.0
    for r, (p, c) in enumerate(zip(ps, conts)):
        plain = eager_logits(model, p, c)
        for i, (g, w) in enumerate(zip(got[r], eager_logits(model, p, c, kv))):
            assert_close(g, w, f"{name} TQ row {r} step {i}")
            apart = max(apart, np.abs(g - plain[i]).max() / np.abs(plain[i]).max())
    assert apart > 1e-2, apart


@pytest.mark.parametrize("name", ["gemma3", "gemma4-eseries", "qwen3_5-moe", "gemma4-moe@tq"])
def test_inactive_rows_pause_and_rows_move(name):
    name, _, tq = name.partition("@")
    kv = (8, 4) if tq else None
    model = tiny_model(name)
    p0, p1 = prompts([4, 6], seed=3)
    rng = np.random.default_rng(11)
    c0, c1 = rng.integers(0, 80, 12).tolist(), rng.integers(0, 80, 12).tolist()
    step = DecodeStep(model, max_batch=3, max_len=32, kv_bits=kv)
    step.prefill(0, p0)
    step.prefill(1, p1)
    got0, got1 = [], []
    i0 = i1 = 0
    for k in range(16):  # row 1 idles on odd steps, row 0 on every third; row 2 always idle
        a0, a1 = k % 3 != 2 and i0 < 12, k % 2 == 0 and i1 < 12
        out = step.decode([c0[min(i0, 11)], c1[min(i1, 11)], 0], [a0, a1, False])
        if a0:
            got0.append(np.array(out[0]))
            i0 += 1
        if a1:
            got1.append(np.array(out[1]))
            i1 += 1
    want0 = eager_logits(model, p0, c0[:i0], kv)[1:]
    want1 = eager_logits(model, p1, c1[:i1], kv)[1:]
    for i, (g, w) in enumerate(zip(got0, want0)):
        assert_close(g, w, f"{name} row 0 step {i}")
    for i, (g, w) in enumerate(zip(got1, want1)):
        assert_close(g, w, f"{name} row 1 step {i}")
    assert step.positions[2] == 0

    # row 1's state moved into row 2 continues identically; row 1 restarts from nothing
    saved = step.save_row(1)
    step.load_row(2, saved)
    step.reset_row(1)
    last = c1[i1 - 1]
    fresh = step.prefill(1, p0)
    assert_close(fresh, eager_logits(model, p0, [], kv)[0], f"{name} reset row")
    out = step.decode([0, 0, last], [False, False, True])
    want = eager_logits(model, p1, c1[:i1] + [last], kv)[-1]
    assert_close(out[2], want, f"{name} loaded row")


@pytest.mark.parametrize("kind", ["DecodeStep", "SequentialStep"])
@pytest.mark.parametrize("name", ["llama", "gemma3", "qwen3_5-dense", "gemma4-moe@tq"])
def test_load_row_cut_back_to_a_shared_prefix(name, kind):
    """A row saved after prompt a, loaded with only its first m tokens (a later prompt sharing
    them), continues as that prompt computed alone; ``resume_floor`` is the least m: 0 with full
    attention or a ring that has not wrapped, P - 1 on a wrapped ring of the window's size
    (tiny Gemma 3: window 5), P with a recurrent state. TurboQuant rows keep the balance
    calibrated on a (the serving engine reuses them only where that is the prompt's own), so
    their reference is a per-sequence cache prefilled with a and trimmed back to m."""
    from hf2q_mlx.serving.sequential_step import SequentialStep

    name, _, tq = name.partition("@")
    kv = (8, 4) if tq else None
    model = tiny_model(name)
    a, tail, short = prompts([10, 5, 4], seed=7)
    cls = DecodeStep if kind == "DecodeStep" else SequentialStep
    step = cls(model, max_batch=2, max_len=32, kv_bits=kv)
    want_floor = {"llama": 0, "gemma3": 9, "qwen3_5-dense": 10, "gemma4-moe": 0}[name]
    if name == "gemma4-moe":
        want_floor = 10 - 4 + 4 - 1  # its window is 4
    assert step.resume_floor(10) == want_floor
    assert step.resume_floor(4) == (4 if name == "qwen3_5-dense" else 0)  # a ring not wrapped
    step.prefill(0, a)
    saved = step.save_row(0)

    def trimmed(m: int, tok: int) -> list[np.ndarray]:
        cache = make_tq_cache(model, *kv)
        model(mx.array([a]), cache=cache)
        trim_cache(cache, 10 - m)
        out = [model(mx.array([tail]), cache=cache)[0, -1]]
        return [np.array(x) for x in out + [model(mx.array([[tok]]), cache=cache)[0, -1]]]

    for m in sorted({want_floor, (want_floor + 10) // 2, 10}):
        step.load_row(1, saved, m)
        assert step.position(1) == m
        got = [step.prefill(1, tail)]
        tok = int(np.argmax(np.array(got[0])))
        out = step.decode(mx.array([0, tok], dtype=mx.int32), [False, True])
        got.append(out[1])
        want = eager_logits(model, a[:m] + tail, [tok]) if kv is None else trimmed(m, tok)
        for i, (g, w) in enumerate(zip(got, want)):
            assert_close(g, w, f"{name} {kind} cut to {m}, output {i}")
    for bad in (want_floor - 1, 11, 2.0):
        if bad == -1:
            continue
        with pytest.raises(InvalidArgumentError):
            step.load_row(1, saved, bad)
    # a short prompt's ring has not wrapped: any cut of it serves
    if name != "qwen3_5-dense" and kv is None:
        step.reset_row(0)
        step.prefill(0, short)
        step.load_row(1, step.save_row(0), 2)
        assert_close(step.prefill(1, tail), eager_logits(model, short[:2] + tail, [])[0],
                     f"{name} {kind} short prompt cut to 2")  # fmt: skip


@pytest.mark.parametrize(
    "name",
    ["llama", "gemma3", "gemma4-moe", "gemma4-moe@tq", "qwen3_5-dense", "qwen3_5-moe",
     "gemma4-eseries"],
)  # fmt: skip
def test_prefill_rows_packs_chunks_into_one_pass(name, monkeypatch):
    """Three rows' chunks (one row already holding a prompt) in one forward pass: every row's
    caches and next logits as one ``prefill`` per row leaves them (fp32: the same math, the
    tokens batched otherwise; Qwen 3.5's delta-net runs each row's segment from its own state).
    Layers sharing K/V (Gemma 4 E-series): one prefill per row."""
    name, _, tq = name.partition("@")
    kv = (8, 4) if tq else None
    model = tiny_model(name)
    a, b, c, d = prompts([7, 12, 3, 9], seed=4)
    packed, alone = (DecodeStep(model, max_batch=3, max_len=40, kv_bits=kv) for _ in range(2))
    packed.prefill(1, a)
    alone.prefill(1, a)
    calls = []
    real = DecodeStep.prefill
    monkeypatch.setattr(DecodeStep, "prefill", lambda s, r, ids: calls.append(r) or real(s, r, ids))
    packed.prefill_rows([2, 1, 0], [b, d, c])
    packs = name != "gemma4-eseries"
    assert packed.packs_rows == packs and calls == ([] if packs else [2, 1, 0])
    for row, ids in ((2, b), (1, d), (0, c)):
        real(alone, row, ids)
    assert packed.positions == alone.positions == [3, 16, 12]
    for s, t in zip(packed.caches, alone.caches):
        for x, y in zip(s.arrays, t.arrays):
            if x.dtype == mx.uint32:  # TurboQuant codes: the same quantizer on the same keys
                assert np.mean(np.array(x) != np.array(y)) < 1e-3
            else:  # KV rows, balance tables (zero offsets where a layer keeps none)
                np.testing.assert_allclose(np.array(x), np.array(y), rtol=RTOL, atol=1e-6)
    got, want = packed.decode([5, 6, 7]), alone.decode([5, 6, 7])
    for r in range(3):
        assert_close(got[r], want[r], f"{name} row {r} after the packed chunks")
    with pytest.raises(InvalidArgumentError):
        packed.prefill_rows([0, 0], [c, c])
    with pytest.raises(ContextLengthError):
        packed.prefill_rows([0, 1], [c, list(range(30))])


def test_chunked_prefill_adopt_and_greedy():
    model = tiny_model("gemma3")
    (p,) = prompts([13], seed=5)
    step = DecodeStep(model, max_batch=2, max_len=64)
    step.prefill(0, p[:5])
    step.prefill(0, p[5:9])
    logits = step.prefill(0, p[9:])
    want = eager_logits(model, p, [])
    assert_close(logits, want[0], "chunked prefill")

    cache = model.make_cache()  # what stream_generate prefilled, adopted by row 1
    mx.eval(model(mx.array([p]), cache=cache))
    step.adopt(1, cache)
    tok = int(mx.argmax(logits).item())
    ids = step.decode([tok, tok], greedy=True)
    assert ids.dtype == mx.int32 and ids.shape == (2,)
    full = eager_logits(model, p, [tok])[-1]
    assert ids.tolist() == [int(np.argmax(full))] * 2


def test_caller_errors():
    model = tiny_model("llama")
    step = DecodeStep(model, max_batch=2, max_len=8)
    with pytest.raises(InvalidArgumentError):
        step.prefill(2, [1])
    with pytest.raises(InvalidArgumentError):
        step.prefill(0, [])
    with pytest.raises(ContextLengthError):
        step.prefill(0, list(range(9)))
    step.prefill(0, list(range(8)))
    with pytest.raises(ContextLengthError):
        step.decode([1, 1])
    with pytest.raises(InvalidArgumentError):
        step.decode([1, 1, 1])
    with pytest.raises(InvalidArgumentError):
        DecodeStep(model, max_batch=0)
    assert DecodeStep.supports(model, kv_bits=8)
    # TurboQuant rows take TurboQuant caches of their own codecs only, and the other way round
    with pytest.raises(InvalidArgumentError, match="kv_bits"):
        DecodeStep(model, max_batch=1, max_len=8, kv_bits="8")
    tq = DecodeStep(model, max_batch=1, max_len=8, kv_bits=8)
    plain = model.make_cache()
    mx.eval(model(mx.array([[1, 2]]), cache=plain))
    with pytest.raises(InvalidArgumentError, match="kind"):
        tq.adopt(0, plain)
    other = make_tq_cache(model, 4)
    model(mx.array([[1, 2]]), cache=other)
    with pytest.raises(InvalidArgumentError, match="bits"):
        tq.adopt(0, other)
    with pytest.raises(InvalidArgumentError, match="kv_bits"):
        DecodeStep(model, max_batch=1, max_len=8, like=other)


# Gemma 4's fp32 kernel path differed from its references by up to 4.9e-4 of the largest logit
# (H200, 2026-12-01): the tiny Gemma 4 models were ill-conditioned, no kernel below fp32
# (session 44, bench/conditioning_probe.py: tiny_model drew the layer and expert scalars as
# noise). With them around 1 both Gemma 4 rows pass on the H200 (session 45); the dense one's
# one-ulp sensitivity over these 12 steps is 1.3e-4 on the CPU, so a failure of that row alone
# near the bound is the model's conditioning before it is a kernel's. Most of it comes with
# attention_k_eq_v (the same config without it: 3.7e-6; session 45, three noise draws).


@requires_gpu
@pytest.mark.parametrize(
    "name",
    ["gemma3", "llama", "qwen3_5-dense", "qwen3_5-moe", "gemma4-dense", "gemma4-moe"],
)
def test_gpu_compiled_matches_eager(name):
    """On the GPU, kernels in both paths: the compiled step (one graph with the kernels inside)
    gives the eager path's logits, fp32, 1e-4 of the largest logit."""
    with mx.stream(mx.gpu):
        model = tiny_model(name)
        lengths, steps = [2, 7], 12
        ps = prompts(lengths, seed=9)
        conts = [np.random.default_rng(r).integers(0, 80, steps).tolist() for r in range(2)]
        step = DecodeStep(model, max_batch=2, max_len=32)
        got = [[np.array(step.prefill(r, p))] for r, p in enumerate(ps)]
        for i in range(steps):
            logits = step.decode([c[i] for c in conts])
            for r in range(2):
                got[r].append(np.array(logits[r]))
        for r, (p, c) in enumerate(zip(ps, conts)):
            for i, (g, w) in enumerate(zip(got[r], eager_logits(model, p, c))):
                assert_close(g, w, f"{name} GPU row {r} step {i}")


# K8/V8 on the GPU: the step's projections run at B = 2, the eager path's at B = 1 (other matmul
# kernels, other roundings), and a key coordinate that lands on the other side of an 8-bit
# Lloyd-Max boundary moves by one code step (~1/256 of its range): 1e-3 of the largest logit.
# The attention kernels alone agree to 2e-5 (test_flash_decode_rows_gpu).
TQ_GPU_RTOL = 1e-3


@requires_gpu
@pytest.mark.parametrize("name", ["gemma3", "llama", "qwen3_5-moe", "gemma4-eseries"])
def test_gpu_turboquant_compiled_matches_eager(name):
    """On the GPU, kernels in both paths: the step's quantize with per-row tables and its
    flash-decode with per-row offsets give the per-sequence TurboQuant cache's logits."""
    with mx.stream(mx.gpu):
        model, kv = tiny_model(name), (8, 8)
        lengths, steps = [2, 7], 12
        ps = prompts(lengths, seed=9)
        conts = [np.random.default_rng(r).integers(0, 80, steps).tolist() for r in range(2)]
        step = DecodeStep(model, max_batch=2, max_len=32, kv_bits=kv)
        got = [[np.array(step.prefill(r, p))] for r, p in enumerate(ps)]
        for i in range(steps):
            logits = step.decode([c[i] for c in conts])
            for r in range(2):
                got[r].append(np.array(logits[r]))
        worst = 0.0
        for r, (p, c) in enumerate(zip(ps, conts)):
            for g, w in zip(got[r], eager_logits(model, p, c, kv)):
                worst = max(worst, float(np.abs(g - w).max() / np.abs(w).max()))
        assert worst <= TQ_GPU_RTOL, f"{name}: relative error {worst:.2e}"


@requires_gpu
def test_gpu_stream_generate_turboquant_takes_the_step(monkeypatch):
    """``kv_bits`` through stream_generate with the GPU's default decode: the TurboQuant step
    (replayed as a CUDA graph on CUDA, the compiled step elsewhere) gives the eager path's
    greedy tokens."""
    with mx.stream(mx.gpu):
        # a model whose float step the graph holds (tiny Gemma 3's 16-wide heads are under the
        # norm + RoPE kernel's 32: its step keeps MLX's RoPE)
        model, (prompt,) = tiny_model("gemma4-dense"), prompts([9], seed=2)

        def tokens() -> list[int]:
            rs = generation.stream_generate(model, IdsTokenizer(), prompt, max_tokens=24,
                                            ignore_eos=True, kv_bits=8)  # fmt: skip
            return [r.token for r in rs]

        monkeypatch.setenv("HF2Q_DECODE", "eager")
        eager = tokens()
        monkeypatch.delenv("HF2Q_DECODE")
        assert tokens() == eager
        (step,) = model.__dict__[decode_step_module._STEPS].values()
        assert any(isinstance(s, StaticTQCache) for s in step.caches)
        assert bool(step.__dict__.get("_graph")) == mx.cuda.is_available()


def test_shared_step_is_reused_and_replaced_by_a_longer_one():
    model = tiny_model("llama")
    a = shared_step(model, 1, 100)
    assert a is not None and a.max_len == 1024 and shared_step(model, 1, 900) is a
    a.busy = True
    assert shared_step(model, 1, 50) is None  # in use: the caller decodes eagerly
    a.busy = False
    b = shared_step(model, 1, 1500)
    assert b.max_len == 2048 and b is not a
    assert shared_step(model, 1, 10) is b  # the longer step serves short requests too
    assert shared_step(nn.Linear(2, 2), 1, 10) is None  # not one of our model files


@pytest.mark.parametrize("name", ["gemma3", "qwen3_5-dense"])
def test_decode_mode_eager_on_the_cpu_compiled_on_request(name, monkeypatch):
    """HF2Q_DECODE unset ("auto") decodes eagerly on the CPU (no DecodeStep), "compiled" through
    the shared step; both give the same greedy tokens across the sliding window; a bad value
    raises InvalidArgumentError."""
    from hf2q_mlx import generation

    model, (prompt,) = tiny_model(name), prompts([7])
    steps = []

    def counting(*args, **kwargs):
        steps.append(shared_step(*args, **kwargs))
        return steps[-1]

    monkeypatch.setattr(generation, "shared_step", counting)

    def tokens(**opts) -> list[int]:
        rs = generation.stream_generate(
            model, IdsTokenizer(), prompt, max_tokens=24, ignore_eos=True,
            repetition_penalty=3.0, **opts,
        )  # fmt: skip
        return [r.token for r in rs]

    monkeypatch.delenv("HF2Q_DECODE", raising=False)
    assert generation.decode_mode() == "eager"
    auto = tokens()
    assert steps == []
    monkeypatch.setenv("HF2Q_DECODE", "compiled")
    assert tokens() == auto
    assert len(steps) == 1 and isinstance(steps[0], DecodeStep)
    # a TurboQuant cache decodes on a step of its own kind, with the eager path's tokens
    monkeypatch.delenv("HF2Q_DECODE")
    tq_eager = tokens(kv_bits=8)
    assert len(steps) == 1
    monkeypatch.setenv("HF2Q_DECODE", "compiled")
    assert tokens(kv_bits=8) == tq_eager
    assert len(steps) == 2 and steps[1] is not steps[0]
    assert any(isinstance(s, StaticTQCache) for s in steps[1].caches)
    monkeypatch.setenv("HF2Q_DECODE", "fast")
    with pytest.raises(InvalidArgumentError, match="HF2Q_DECODE"):
        tokens()


def test_write_slots_are_computed_once_per_step():
    """The step's graph holds one modulo for the sliding layers' ring slots (one ring size) and
    one arange for the new tokens, whatever the number of layers: the layers share them."""
    import io
    import re

    model = tiny_model("gemma3")  # 5 layers: 3 sliding, 2 full
    step = DecodeStep(model, 2, 64)
    for row, ids in enumerate(prompts([3, 7])):
        step.prefill(row, ids)
    pos = mx.array(step.positions, dtype=mx.int32)
    arrays = [s.arrays for s in step.caches]
    out, new, _, _ = step._step(mx.array([[1], [2]]), pos, mx.array([True, True]), arrays, 64, True)
    buf = io.StringIO()
    mx.export_to_dot(buf, out, *[a for arrs in new for a in arrs])
    labels = re.findall(r'label ="([^"]+)"', buf.getvalue())
    # on the CPU the reference attention builds each sliding layer's mask (one modulo each);
    # the write slots add one modulo for all of them, not one per layer
    sliding = [c for c in step.caches if isinstance(c, StaticKVCache) and c.window is not None]
    assert len(sliding) == 3 and labels.count("Remainder") == len(sliding) + 1, labels
    shared = {id(c.shared) for c in step.caches}
    assert len(shared) == 1 and len(step.caches[0].shared) == 2  # (L, full) and (L, ring)


def test_steady_decode_uploads_no_positions(monkeypatch):
    """The step reads positions and active flags from padded arrays (16 bytes or more: MLX's
    CUDA small pool stalls kernels that read it) and a steady decode reuses the positions the
    previous step returned: the host uploads positions only after it changed them itself (a
    prefill, a rollback), active flags only when they change; the tokens stay those of a
    DecodeStep that uploads every step."""
    model = tiny_model("gemma3")
    uploads = []
    padded = DecodeStep._padded

    def counting(self, values, dtype):
        out = padded(self, values, dtype)
        uploads.append((list(values), dtype, out.nbytes))
        return out

    def run(step, counted):
        for row, ids in enumerate(prompts([3, 7])):
            step.prefill(row, ids)
        toks, seen = [], []
        y = mx.array([1, 2], dtype=mx.int32)
        for t in range(6):
            if t == 3:
                step.decode(y, greedy=True)  # one more token, then forget it
                step.rollback_rows([1, 1])
            y = step.decode(y, active=[True, t != 4], greedy=True)
            toks.append(np.array(y).tolist())
            seen.append(len(counted))
        return toks, seen

    monkeypatch.setattr(DecodeStep, "_padded", counting)
    step = DecodeStep(model, 2, 64)
    assert step._rows == 4  # 4 int32 rows: 16 bytes
    toks, seen = run(step, uploads)
    pos_uploads = [v for v, dt, _ in uploads if dt == mx.int32]
    flag_uploads = [v for v, dt, _ in uploads if dt == mx.bool_]
    assert all(n == 16 for _, _, n in uploads), uploads  # 4 int32 positions, 16 bool flags
    # positions: the first decode after the prefills, and the one after the rollback (t = 3)
    assert pos_uploads == [[3, 7], [6, 10]], pos_uploads
    # flags: all active, then row 1 idle at t = 4, then all active again
    assert flag_uploads == [[True, True], [True, False], [True, True]], flag_uploads
    assert seen[1] == seen[0] and seen[2] == seen[1]  # t = 1, 2: nothing uploaded

    # the same tokens when every step uploads its positions
    monkeypatch.setattr(DecodeStep, "_padded", padded)
    fresh = DecodeStep(model, 2, 64)
    fresh_toks = []
    for row, ids in enumerate(prompts([3, 7])):
        fresh.prefill(row, ids)
    y = mx.array([1, 2], dtype=mx.int32)
    for t in range(6):
        fresh._device_pos = None  # forces an upload
        if t == 3:
            fresh.decode(y, greedy=True)
            fresh.rollback_rows([1, 1])
        y = fresh.decode(y, active=[True, t != 4], greedy=True)
        fresh_toks.append(np.array(y).tolist())
    assert toks == fresh_toks and step.positions == fresh.positions == [9, 12]


# ---- speculative verify: L tokens per row, then an exact rollback -------------------------------

# Gemma 4's tiny random models amplify rounding: their own eager L-token forward differs from
# the one-token path by up to 2e-4 of the largest logit (measured on these sequences, MoE 1.1e-4
# here); a wrong rollback or mask is off by O(1). The dense one too: the CPU's one-op RMS norm
# and RoPE (~1e-7 from MLX's fallbacks) move its eager logits by 2.5e-5, and its verify error
# 0.9e-4 -> 1.5e-4 (session 39)
VERIFY_RTOL = {"gemma4-moe": 5e-4, "gemma4-dense": 5e-4}


def test_recurrent_rollback_gathers_history_entries_exactly():
    """``StaticRecurrentCache.rollback`` on a verify's history (entry j = the state after j of
    its L tokens; all L kept = the cache's state): rolled-back rows take entry ``kept`` bit for
    bit, the others (kept = L, out of the history's range) keep their state."""
    from hf2q_mlx.models.static_cache import StaticRecurrentCache

    B, L = 4, 5
    key = iter(mx.random.split(mx.random.key(31), 4))
    conv = mx.random.normal((B, 3, 10), key=next(key))  # (B, K-1, C)
    state = mx.random.normal((B, 2, 3, 4), key=next(key))  # (B, Hv, Dv, Dk)
    history = [
        mx.random.normal((B, L, 3, 10), key=next(key)),
        mx.random.normal((B, L, 2, 3, 4), key=next(key)),
    ]
    kept, rows = [2, 5, 0, 4], [True, False, True, True]
    cache = StaticRecurrentCache(conv, state)
    cache.rollback(history, mx.array(kept, dtype=mx.int32), mx.array(rows))
    for got, cur, hist in zip(cache.arrays, (conv, state), history):
        want = [np.array(hist[b, k] if r else cur[b]) for b, (k, r) in enumerate(zip(kept, rows))]
        np.testing.assert_array_equal(np.array(got), np.stack(want))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_verify_and_rollback_match_eager(name):
    """Three rows (prompts of 3, 9, 1) verify 4 tokens per round for 6 rounds, one row idle
    every third round, and keep a random prefix each round (1 to 4 tokens): every verify
    position's logits equal those of the eager path fed only the kept tokens so far, and a
    decode after the last rollback does too (rings of 4-5 wrap several times)."""
    model, K = tiny_model(name), 3
    rtol = VERIFY_RTOL.get(name, RTOL)
    ps = prompts([3, 9, 1])
    step = DecodeStep(model, max_batch=3, max_len=48, reserve=K)
    for r, p in enumerate(ps):
        step.prefill(r, p)
    rng = np.random.default_rng(2)
    fed = [list(p) for p in ps]
    for k in range(6):
        toks = rng.integers(0, 80, (3, K + 1)).tolist()
        active = [True, k % 3 != 1, k % 3 != 2]
        logits = step.verify(toks, active)
        assert logits.shape == (3, K + 1, VOCAB)
        kept = rng.integers(1, K + 2, 3).tolist()
        for r in range(3):
            if active[r]:
                want = eager_logits(model, fed[r], toks[r])[1:]
                for i, w in enumerate(want):
                    err = np.abs(np.array(logits[r, i]) - w).max() / np.abs(w).max()
                    assert err <= rtol, f"{name} round {k} row {r} position {i}: {err:.2e}"
                fed[r] += toks[r][: kept[r]]
        step.rollback_rows([K + 1 - n if a else 0 for n, a in zip(kept, active)])
        assert step.positions == [len(f) for f in fed]
    nxt = rng.integers(0, 80, 3).tolist()
    out = step.decode(nxt)
    for r in range(3):
        want = eager_logits(model, fed[r], [nxt[r]])[-1]
        err = np.abs(np.array(out[r]) - want).max() / np.abs(want).max()
        assert err <= rtol, f"{name} decode after rollback, row {r}: {err:.2e}"


def test_verify_greedy_rollback_per_row_and_errors():
    model = tiny_model("qwen3_5-moe")
    (p,) = prompts([5], seed=4)
    step = DecodeStep(model, max_batch=2, max_len=12, reserve=2)
    step.prefill(0, p)
    step.prefill(1, p)
    ids = step.verify([[3, 4, 5], [3, 4, 6]], greedy=True)
    assert ids.dtype == mx.int32 and ids.shape == (2, 3)
    want = [int(np.argmax(x)) for x in eager_logits(model, p, [3, 4, 5])[1:]]
    assert ids[0].tolist() == want
    step.rollback(0, 1)  # one at a time: 3 - 1 - 1 = 1 token kept
    step.rollback(0, 1)
    assert step.positions == [6, 8]
    out = step.decode([7, 9], [True, False])
    assert_close(out[0], eager_logits(model, p, [3, 7])[-1], "after two rollbacks")
    with pytest.raises(InvalidArgumentError):
        step.rollback(1, 1)  # a decode since: nothing to roll back
    step.verify([[1, 2, 3], [1, 2, 3]], [True, False])
    with pytest.raises(InvalidArgumentError):
        step.rollback(0, 4)
    with pytest.raises(InvalidArgumentError):
        step.rollback(1, 1)  # idle in that verify
    with pytest.raises(InvalidArgumentError):
        step.verify([[1, 2, 3, 4]] * 2)  # L - 1 > reserve
    with pytest.raises(ContextLengthError):
        step.verify([[1, 2, 3]] * 2, [True, False])  # row 0: 10 + 3 tokens > max_len 12


@requires_gpu
@pytest.mark.parametrize("name", ["gemma3", "llama", "qwen3_5-dense", "qwen3_5-moe"])
def test_gpu_verify_and_rollback_match_eager(name):
    """The verify test above with the kernels inside the compiled graph (fp32, 1e-4)."""
    with mx.stream(mx.gpu):
        test_verify_and_rollback_match_eager(name)


@pytest.mark.parametrize("name", ["gemma3", "qwen3_5-dense"])
def test_warm_verify_traces_lengths_and_leaves_the_row_as_it_was(name, monkeypatch):
    """warm_verify traces each verify length once (the step's Python body runs only while
    tracing) and rolls its writes back: a later verify, rollback and decode give the same
    bits as on a step that was never warmed (a sliding ring of 5 and a recurrent state)."""
    traces = []
    body = DecodeStep._step

    def counting(self, *args):
        traces.append(args[0].shape[1])  # L of the traced call
        return body(self, *args)

    monkeypatch.setattr(DecodeStep, "_step", counting)
    model, K = tiny_model(name), 3
    (p,) = prompts([7], seed=5)
    warm, cold = (DecodeStep(model, max_batch=2, max_len=32, reserve=K) for _ in range(2))
    for step in (warm, cold):
        step.prefill(0, p)
        step.prefill(1, p[:4])
    assert warm.warm_verify(0, [2, 3, 4]) == 3 and sorted(traces) == [2, 3, 4]
    assert warm.positions == cold.positions == [7, 4]
    assert warm.warm_verify(0, [2, 3, 4]) == 0 and len(traces) == 3  # traced already
    toks = [[5, 6, 7], [8, 9, 10]]
    traces.clear()
    a, b = warm.verify(toks), cold.verify(toks)
    assert traces == [3]  # the cold step traces L = 3; the warm one had it
    assert np.array_equal(np.array(a), np.array(b))
    for step in (warm, cold):
        step.rollback_rows([2, 1])
    a, b = warm.decode([11, 12]), cold.decode([11, 12])
    assert np.array_equal(np.array(a), np.array(b))
    with pytest.raises(InvalidArgumentError):
        warm.warm_verify(0, [K + 2])  # past the reserve
    with pytest.raises(InvalidArgumentError):
        warm.warm_verify(2, [2])


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_decode_and_verify_passes_run_per_token(mode, monkeypatch):
    """On CUDA our kernels take their cached cubins in a prompt's forward passes and MLX's own
    builds in every decode and verify pass (MLX 0.32.4 hashes a cubin's image at each launch):
    the passes a decode makes (plain, and prompt-lookup drafts with their verifies) run inside
    ``cuda_cache.per_token()``, the prompt's outside. Checked here through the context itself,
    which is all the launch routing reads (tests/kernels/test_cuda_cache.py)."""
    from hf2q_mlx.custom_kernels import cuda_cache

    monkeypatch.setattr(cuda_cache, "MODE", "auto")
    monkeypatch.setattr(cuda_cache, "ENABLED", True)
    monkeypatch.setenv("HF2Q_DECODE", mode)
    model = tiny_model("llama")
    seen, probing = [], []
    real_call, real_alloc = type(model).__call__, DecodeStep._allocate

    def call(self, inputs, *args, **kw):
        if not probing:  # DecodeStep's one shape probe while it allocates its caches
            seen.append((inputs.shape[-1], cuda_cache.wants_cubin()))
        return real_call(self, inputs, *args, **kw)

    def allocate(self, *args, **kw):
        probing.append(1)
        try:
            return real_alloc(self, *args, **kw)
        finally:
            probing.pop()

    monkeypatch.setattr(type(model), "__call__", call)
    monkeypatch.setattr(DecodeStep, "_allocate", allocate)
    prompt = [int(t) for t in np.random.default_rng(5).integers(3, VOCAB, 17)]
    for extra in ({}, {"prompt_lookup": 2, "num_draft_tokens": 3}):
        seen.clear()
        ids = prompt * 2 if extra else prompt  # a repeated prompt gives the lookup drafts
        out = list(generation.stream_generate(model, IdsTokenizer(), ids, max_tokens=8,
                                              ignore_eos=True, **extra))  # fmt: skip
        assert len(out) == 8
        # the prompt but its last token, then the last token: outside; every later pass inside
        assert seen[:2] == [(len(ids) - 1, True), (1, True)], seen
        assert len(seen) > 2 and not any(w for _, w in seen[2:]), seen
        if extra:
            assert any(n > 1 for n, _ in seen[2:]), seen  # a verify of drafted tokens ran
    assert cuda_cache.wants_cubin()  # nothing left inside
