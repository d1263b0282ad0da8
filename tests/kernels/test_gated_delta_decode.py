"""The one-launch gated delta-net decode (conv, gates, delta rule, gated output norm, row mask):
reference and kernel body (CPU emulator) against a float64 oracle, the dispatcher's choices, the
Qwen 3.5 decode step through it, and the kernel on a GPU."""

from __future__ import annotations

import importlib
import pkgutil

import kernel_emulator
import mlx.core as mx
import numpy as np
import pytest
import test_gated_delta as tgd
from conftest import requires_gpu
from mlx.utils import tree_flatten, tree_unflatten

import hf2q_mlx.custom_kernels as ck
from hf2q_mlx.custom_kernels import gated_delta_decode as gdd
from hf2q_mlx.custom_kernels import reference_only
from hf2q_mlx.errors import InvalidArgumentError

needs_gxx = pytest.mark.skipif(not kernel_emulator.available(), reason="g++ is not installed")
EPS = 1e-5

# (B, Hk, Hv, Dk, Dv): one head; Dv below the 16 SIMD groups; Dv = 40 (3 rows per SIMD group,
# the last round partial); 3 value heads per key head; the Qwen 3.5 9B / 35B-A3B delta-net heads
SHAPES = [
    (1, 1, 1, 32, 8),
    (2, 2, 6, 64, 7),
    (3, 1, 3, 32, 40),
    (1, 16, 32, 128, 128),
]


def make_inputs(B, hk, hv, dk, dv, seed, dtype=mx.float32, masked=False, module_conv=False, L=1):
    """Fresh random inputs for L tokens per row; ``masked``: a random mix of active rows (>= 1
    off when B > 1); ``module_conv``: the conv weight (C, K, 1), as the model's Conv1d keeps it."""
    inp = tgd.make_inputs(B, L, hk, hv, dk, dv, seed, dtype)
    if module_conv:
        inp["conv_weight"] = inp["conv_weight"][..., None]
    k = mx.random.split(mx.random.key(seed + 10_000), 2)
    inp["z"] = mx.random.normal((B, L, hv * dv), key=k[0]).astype(dtype)
    inp["norm_weight"] = (0.75 + 0.5 * mx.random.uniform(shape=(dv,), key=k[1])).astype(dtype)
    inp["norm_eps"] = EPS
    if masked:
        on = np.random.default_rng(seed).random(B) < 0.5
        on[0], on[-1] = True, B == 1  # both kinds when B > 1
        inp["active"] = mx.array(on)
    return inp


def oracle(inp: dict, tiled: bool):
    """float64: the step of test_gated_delta's oracle, the gated RMSNorm, the row mask."""
    inp = {k: v.astype(mx.float32) if isinstance(v, mx.array) and k != "active" else v
           for k, v in inp.items()}  # fmt: skip
    inp["conv_weight"] = inp["conv_weight"].reshape(inp["conv_weight"].shape[:2])  # (C, K)
    y, conv, st = tgd.oracle(inp, tiled)  # y (B, 1, Hv, Dv)
    f = lambda name: np.array(inp[name].astype(mx.float32), dtype=np.float64)  # noqa: E731
    B = y.shape[0]
    z = f("z").reshape(y.shape)
    out = y / np.sqrt((y * y).mean(-1, keepdims=True) + EPS) * f("norm_weight")
    out = (out * z / (1 + np.exp(-z))).reshape(B, 1, -1)
    if "active" in inp:
        on = np.array(inp["active"])
        conv[~on], st[~on] = f("conv_state")[~on], f("state")[~on]
    return out, conv, st


def check(got, want, rtol, what):
    got = np.array(got.astype(mx.float32))
    assert got.shape == want.shape, what
    err = np.abs(got - want).max()
    assert err <= rtol * np.abs(want).max(), f"{what}: max err {err:.3g}"


def exact_states(got, inp, want_conv):
    """Data movement: the conv state exactly; inactive rows' recurrent states bit for bit."""
    np.testing.assert_array_equal(np.array(got[1].astype(mx.float32)), want_conv)
    if "active" in inp:
        off = ~np.array(inp["active"])
        np.testing.assert_array_equal(np.array(got[2])[off], np.array(inp["state"])[off])


@pytest.mark.parametrize("shape", SHAPES[:3])
@pytest.mark.parametrize("tiled", [False, True], ids=["grouped", "tiled"])
def test_reference_matches_oracle(shape, tiled):
    inp = make_inputs(*shape, seed=sum(shape), masked=True, module_conv=tiled)
    want = oracle(inp, tiled)
    with reference_only():
        got = gdd.gated_delta_decode(**inp, tiled=tiled)
    # fp32 against float64 over one step and a norm: ~1e-6 relative
    for g, w, what in zip(got, want, ("out", "conv_state", "state")):
        check(g, w, 1e-5, what)
    exact_states(got, inp, want[1].astype(np.float32))


@needs_gxx
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("tiled", [False, True], ids=["grouped", "tiled"])
def test_kernel_body_emulated(shape, tiled, monkeypatch):
    """``_BODY`` compiled as C++ and launched by the dispatcher: fp32 against the oracle, rows
    masked when B > 1, outputs poisoned by the emulator; the tiled runs take the conv weight
    (C, K, 1) as the model passes it (read flat, no reshape)."""
    emu = kernel_emulator.Emulated(gdd._kernel)
    monkeypatch.setattr(gdd, "_kernel", emu)
    monkeypatch.setattr(gdd, "backend", lambda: "cuda")
    inp = make_inputs(*shape, seed=3 * sum(shape) + tiled, masked=shape[0] > 1, module_conv=tiled)
    got = gdd.gated_delta_decode(**inp, tiled=tiled)
    assert emu.launches == 1
    want = oracle(inp, tiled)
    # fp32 vs float64: ~1e-6 relative (different reduction orders); 1e-5 leaves room
    for g, w, what in zip(got, want, ("out", "conv_state", "state")):
        check(g, w, 1e-5, what)
    exact_states(got, inp, want[1].astype(np.float32))


def bits(x: mx.array) -> np.ndarray:
    """x's raw bits (uint16 for 2-byte dtypes, else uint32): bit-for-bit comparisons."""
    return np.array(x.view(mx.uint16 if x.dtype.size == 2 else mx.uint32))


def recorded_launch(monkeypatch, inp: dict, **kw):
    """The dispatcher's one launch for ``inp`` recorded (nothing built), as a function running
    it on the emulator with template values changed (``run(changes, poison=True)``: outputs
    NaN-poisoned first); ``run.template`` is the recorded template."""
    from hf2q_mlx.custom_kernels import launch_recorder

    monkeypatch.setattr(gdd, "backend", lambda: "cuda")
    monkeypatch.setattr(gdd._kernel, "_kernel_for", lambda be, sig: print)  # nothing built
    gdd._plan.cache_clear()
    rec = launch_recorder.Recorder(1)
    try:
        with launch_recorder.recording(rec):
            gdd.gated_delta_decode(**inp, **kw)
    finally:
        gdd._plan.cache_clear()
    (launch,) = rec.launches
    s = launch.spec

    def run(changes: dict, poison: bool = True):
        initial = [mx.full(sh, float("nan"), dt) for sh, dt in
                   zip(s.output_shapes, s.output_dtypes)] if poison else None  # fmt: skip
        return kernel_emulator.emulate(
            s.kernel, list(launch.inputs), grid=s.grid, threadgroup=s.threadgroup,
            output_shapes=s.output_shapes, output_dtypes=s.output_dtypes,
            template={**dict(s.template), **changes}, initial=initial,
        )  # fmt: skip

    run.template = dict(s.template)
    return run


@needs_gxx
@pytest.mark.parametrize("shape", SHAPES[1:], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize(
    "tiled, stream", [(False, "0"), (True, "0"), (False, "1")], ids=["grouped", "tiled", "stream"]
)
def test_conv_in_place_variant_writes_what_the_plain_launch_writes_emulated(
    shape, tiled, stream, monkeypatch
):
    """CONV_INPLACE, the variant a recorded graph runs to write the conv state over its input
    (cuda_graph_step.fuse_state_writes): the last value head of each key head to count in
    writes that key head's q / k channels, each head its v channels. Started from poison, its
    outputs equal the plain launch's bit for bit: every conv channel is written, once per key
    head. (The emulator runs threadgroups one after another: the ordering it relies on on a GPU
    is checked by the graph's GPU tests.)"""
    monkeypatch.setattr(gdd, "STREAM", stream)  # "1": the streamed path (a graph's many rows)
    inp = make_inputs(*shape, seed=7 * sum(shape) + tiled, masked=shape[0] > 1)
    run = recorded_launch(monkeypatch, inp, tiled=tiled)
    assert run.template["STREAM"] == (stream == "1")
    plain, in_place = run({"CONV_INPLACE": False}, poison=False), run({"CONV_INPLACE": True})
    for i in range(3):  # out, state, conv state
        np.testing.assert_array_equal(bits(plain[i]), bits(in_place[i]))


@needs_gxx
@pytest.mark.parametrize("shape", SHAPES[1:], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("in_place", [False, True], ids=["plain", "conv_in_place"])
def test_preloaded_conv_state_writes_the_same_bits_emulated(shape, in_place, monkeypatch):
    """PRELOAD (the new conv state's inputs loaded with the recurrent state, then stored at the
    end) writes what the load-after-store loop writes, bit for bit, from poisoned outputs; its
    conv state equals the oracle's exactly (data movement)."""
    monkeypatch.setattr(gdd, "PRELOAD", "1")
    inp = make_inputs(*shape, seed=11 * sum(shape) + in_place, masked=shape[0] > 1)
    run = recorded_launch(monkeypatch, inp)
    assert run.template["PRELOAD"]  # the switch reaches the plan
    loop = run({"CONV_INPLACE": in_place, "PRELOAD": False})
    pre = run({"CONV_INPLACE": in_place, "PRELOAD": True})
    for i in range(3):  # out, state, conv state
        np.testing.assert_array_equal(bits(loop[i]), bits(pre[i]))
    want_conv = oracle(inp, False)[1].astype(np.float32)
    np.testing.assert_array_equal(np.array(pre[2].astype(mx.float32)), want_conv)


def test_min_blocks_puts_launch_bounds_on_the_cubin(monkeypatch):
    """HF2Q_GDN_MIN_BLOCKS: unset, no bounds; 2, the launch's template asks nvcc for two
    threadgroups of its own size an SM (512 threads at one token, 256 in a verify), which our
    CUDA unit turns into ``__launch_bounds__``; a bad value is a one-line caller error."""
    inp = make_inputs(2, 2, 4, 32, 16, seed=5, masked=True)
    monkeypatch.setattr(gdd, "MIN_BLOCKS", "")
    assert "LB_MIN_BLOCKS" not in recorded_launch(monkeypatch, inp).template
    monkeypatch.setattr(gdd, "MIN_BLOCKS", " 2 ")
    tmpl = recorded_launch(monkeypatch, inp).template
    threads = gdd.SIMD_WIDTH * gdd._warps(16, 1)
    assert tmpl["LB_MIN_BLOCKS"] == 2 and tmpl["LB_THREADS"] == threads
    ex = gdd._kernel.examples[0]
    dts = [v if isinstance(v, mx.Dtype) else v[0] for v in ex.inputs.values()]
    bounded = {**ex.template, "LB_THREADS": 512, "LB_MIN_BLOCKS": 2}
    _, unit = gdd._kernel.precompiled_unit(dts, (), list(ex.outputs.values()), bounded, "s", 0)
    assert "__launch_bounds__(512, 2)" in unit
    for bad in ("0", "5", "two"):
        monkeypatch.setattr(gdd, "MIN_BLOCKS", bad)
        with pytest.raises(InvalidArgumentError, match="HF2Q_GDN_MIN_BLOCKS"):
            gdd.min_blocks()


def test_preload_switch_is_checked(monkeypatch):
    """HF2Q_GDN_PRELOAD takes 0 or 1 (blank: off); anything else is a one-line caller error."""
    for text, on in (("", False), ("1", True), ("0", False), (" 1 ", True)):
        monkeypatch.setattr(gdd, "PRELOAD", text)
        assert gdd.preload_on() is on
    monkeypatch.setattr(gdd, "PRELOAD", "yes")
    with pytest.raises(InvalidArgumentError, match="HF2Q_GDN_PRELOAD"):
        gdd.preload_on()


@needs_gxx
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=str)
def test_kernel_body_emulated_half(dtype, monkeypatch):
    """Half inputs: the kernel keeps y in fp32 through the norm where the reference rounds; its
    error against the fp32 oracle stays within 2x the same-dtype reference's."""
    emu = kernel_emulator.Emulated(gdd._kernel)
    monkeypatch.setattr(gdd, "_kernel", emu)
    inp = make_inputs(2, 2, 4, 64, 24, seed=5, dtype=dtype, masked=True)
    with reference_only():
        ref = gdd.gated_delta_decode(**inp)
    monkeypatch.setattr(gdd, "backend", lambda: "cuda")
    got = gdd.gated_delta_decode(**inp)
    assert emu.launches == 1
    want = oracle(inp, False)
    for i, what in ((0, "out"), (2, "state")):
        k_err = np.abs(np.array(got[i].astype(mx.float32)) - want[i]).max()
        r_err = np.abs(np.array(ref[i].astype(mx.float32)) - want[i]).max()
        assert k_err <= 2 * r_err + 1e-6 * np.abs(want[i]).max(), f"{what}: {k_err} vs {r_err}"
    exact_states(got, inp, np.array(ref[1].astype(mx.float32)))


def test_dispatcher_falls_back_and_validates(monkeypatch):
    """Dk not a multiple of 32: the reference even with a GPU back end; caller errors raise."""
    monkeypatch.setattr(gdd, "backend", lambda: "cuda")
    monkeypatch.setattr(gdd, "_kernel", None)  # any launch attempt would fail
    inp = make_inputs(2, 1, 2, 48, 8, seed=2, masked=True)
    got = gdd.gated_delta_decode(**inp)
    for g, w, what in zip(got, oracle(inp, False), ("out", "conv_state", "state")):
        check(g, w, 1e-5, what)
    bad = dict(inp, num_k_heads=3)  # 2 * 3 * 48 + 2 * dv != C
    with pytest.raises(InvalidArgumentError, match="gated_delta_decode"):
        gdd.gated_delta_decode(**bad)
    two = dict(inp, qkv=mx.concatenate([inp["qkv"]] * 2, axis=1))  # 2 tokens of qkv, 1 of z
    with pytest.raises(InvalidArgumentError, match="gated_delta_decode"):
        gdd.gated_delta_decode(**two)
    w = inp["conv_weight"]  # (C, K): (C, K, 2) and (C - 1, K) are no conv weight of this qkv
    for bad_w in (mx.stack([w, w], axis=-1), w[1:]):
        with pytest.raises(InvalidArgumentError, match="conv weight"):
            gdd.gated_delta_decode(**dict(inp, conv_weight=bad_w))


# ---- fused in_proj outputs read in place (Channels) ----

# (qkv, z, b, a) stacked into fused projection outputs, as GatedDeltaNet.fuse_projections makes
# them (all four; Q4_K qkv + z with dense b + a) and orders it never makes; "pad" channels before
# and after each fused group put every input at an offset of its own
GROUPINGS = {
    "qkvzba": (("qkv", "z", "b", "a"),),
    "qkvz+ba": (("qkv", "z"), ("b", "a")),
    "zqkv+a+b": (("z", "qkv"), ("a",), ("b",)),
    "qkv+azb": (("qkv",), ("a", "z", "b")),
}


def fuse_inputs(inp: dict, grouping, seed: int) -> dict:
    """``inp`` with each fused group's members as ``Channels`` of one (B, L, N) array: random
    pad channels, the members side by side, more pad."""
    out = dict(inp)
    for i, group in enumerate(grouping):
        if len(group) == 1:
            continue
        (B, L, _), dtype = inp["qkv"].shape, inp["qkv"].dtype
        k = mx.random.split(mx.random.key(seed + i), 2)
        pads = [mx.random.normal((B, L, n), key=key).astype(dtype) for n, key in zip((3, 5), k)]
        data = mx.concatenate([pads[0], *(inp[name] for name in group), pads[1]], axis=-1)
        first = 3
        for name in group:
            out[name] = gdd.Channels(data, first, inp[name].shape[-1])
            first += inp[name].shape[-1]
    return out


def assert_same(got, want) -> None:
    for g, w, what in zip(got, want, ("out", "conv_state", "state")):
        g, w = np.array(g.astype(mx.float32)), np.array(w.astype(mx.float32))
        assert np.array_equal(g, w, equal_nan=False), f"{what}: max diff {np.abs(g - w).max()}"


@needs_gxx
@pytest.mark.parametrize("grouping", GROUPINGS, ids=str)
@pytest.mark.parametrize("shape", SHAPES[1:3], ids=lambda s: "x".join(map(str, s)))
def test_kernel_body_fused_inputs_emulated(shape, grouping, monkeypatch):
    """qkv, z, a, b as Channels of fused outputs (read in place at their offsets) give the bits
    of the separate arrays, one launch each, on the emulated kernel; rows masked."""
    emu = kernel_emulator.Emulated(gdd._kernel)
    monkeypatch.setattr(gdd, "_kernel", emu)
    monkeypatch.setattr(gdd, "backend", lambda: "cuda")
    seed = 11 * sum(shape) + len(grouping)
    inp = make_inputs(*shape, seed=seed, masked=True, module_conv=True)
    fused = fuse_inputs(inp, GROUPINGS[grouping], seed)
    want = gdd.gated_delta_decode(**inp, tiled=True)
    got = gdd.gated_delta_decode(**fused, tiled=True)
    assert emu.launches == 2
    assert_same(got, want)
    check(got[0], oracle(inp, True)[0], 1e-5, "out")  # and the right bits (fp32 vs float64)


def test_fused_inputs_reference_and_validation(monkeypatch):
    """The reference path slices Channels (bit-exact); Channels outside their array, or of the
    wrong width for the block, are caller errors."""
    inp = make_inputs(2, 2, 6, 64, 7, seed=4, masked=True)
    fused = fuse_inputs(inp, GROUPINGS["qkvz+ba"], 4)
    with reference_only():
        assert_same(gdd.gated_delta_decode(**fused), gdd.gated_delta_decode(**inp))
    data = fused["a"].data  # (2, 1, 3 + 12 + 5)
    for first, count in ((-1, 6), (0, 0), (16, 6)):
        with pytest.raises(InvalidArgumentError, match="channels"):
            gdd.Channels(data, first, count)
    monkeypatch.setattr(gdd, "backend", lambda: "cuda")
    monkeypatch.setattr(gdd, "_kernel", None)  # validation comes before any launch
    for name in ("a", "b", "z"):
        x = fused[name]  # one channel short
        bad = dict(fused, **{name: gdd.Channels(x.data, x.first, x.count - 1)})
        with pytest.raises(InvalidArgumentError, match="gated_delta_decode"):
            gdd.gated_delta_decode(**bad)


# ---- L > 1 tokens per row (a speculative verify): one launch, the per-token history ----

HIST = ("out", "conv_state", "state", "conv_history", "state_history")


def oracle_tokens(inp: dict, tiled: bool):
    """The one-token oracle token after token (fp32 states between tokens) -> (out, conv,
    state, conv history, state history), entry j of a history = the states before token j."""
    cur = dict(inp)
    outs, convs, states = [], [], []
    for t in range(inp["qkv"].shape[1]):
        for name in ("qkv", "z", "a", "b"):
            cur[name] = inp[name][:, t : t + 1]
        convs.append(np.array(cur["conv_state"].astype(mx.float32), dtype=np.float64))
        states.append(np.array(cur["state"], dtype=np.float64))
        out, conv, st = oracle(cur, tiled)
        outs.append(out)
        cur["conv_state"] = mx.array(conv.astype(np.float32)).astype(inp["conv_state"].dtype)
        cur["state"] = mx.array(st.astype(np.float32))
    return (
        np.concatenate(outs, axis=1),
        conv,
        st,
        np.stack(convs, axis=1),
        np.stack(states, axis=1),
    )


@pytest.mark.parametrize("L", [2, 3, 5])
@pytest.mark.parametrize("shape", SHAPES[1:3], ids=lambda s: "x".join(map(str, s)))
def test_reference_tokens_are_single_token_calls(shape, L):
    """The CPU path of an L-token call: the bits of L one-token calls (the contract a verify
    and its rollback rest on), histories = the states before each call, rows masked; and the
    float64 oracle (fp32 over L steps and norms: 1e-5 relative)."""
    tiled = L == 3
    inp = make_inputs(*shape, seed=17 * sum(shape) + L, masked=True, module_conv=True, L=L)
    with reference_only():
        got = gdd.gated_delta_decode(**inp, tiled=tiled, history=True)
        cur, outs, convs, states = dict(inp), [], [], []
        for t in range(L):
            one = {n: inp[n][:, t : t + 1] for n in ("qkv", "z", "a", "b")}
            convs.append(cur["conv_state"])
            states.append(cur["state"])
            out, cur["conv_state"], cur["state"] = gdd.gated_delta_decode(
                **dict(cur, **one), tiled=tiled
            )
            outs.append(out)
    want = (mx.concatenate(outs, 1), cur["conv_state"], cur["state"])
    want += (mx.stack(convs, 1), mx.stack(states, 1))
    assert len(got) == 5
    for g, w, what in zip(got, want, HIST):
        np.testing.assert_array_equal(np.array(g), np.array(w), err_msg=what)
    for g, w, what in zip(got, oracle_tokens(inp, tiled), HIST):
        check(g, w, 1e-5, what)
    off = ~np.array(inp["active"])  # paused rows: every history entry is their old state
    np.testing.assert_array_equal(np.array(got[4])[off][:, -1], np.array(inp["state"])[off])


@needs_gxx
@pytest.mark.parametrize(
    "shape,L,fused,history",
    [
        (SHAPES[1], 1, None, True),
        (SHAPES[1], 2, None, True),
        (SHAPES[1], 3, "qkvz+ba", True),
        (SHAPES[2], 4, None, False),
        (SHAPES[2], 5, "qkvzba", True),
        (SHAPES[0], 6, None, True),
    ],
    ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v),
)
def test_kernel_body_tokens_emulated(shape, L, fused, history, monkeypatch):
    """L tokens per row in ONE launch (emulated, outputs poisoned): out, states and histories
    against the token-by-token oracle (fp32 vs float64: 1e-5), conv states and conv history
    exact (copies of inputs), paused rows untouched; ``fused``: Channels read in place."""
    emu = kernel_emulator.Emulated(gdd._kernel)
    monkeypatch.setattr(gdd, "_kernel", emu)
    monkeypatch.setattr(gdd, "backend", lambda: "cuda")
    tiled = L % 2 == 0
    seed = 19 * sum(shape) + L
    inp = make_inputs(*shape, seed=seed, masked=shape[0] > 1, module_conv=tiled, L=L)
    args = fuse_inputs(inp, GROUPINGS[fused], seed) if fused else inp
    got = gdd.gated_delta_decode(**args, tiled=tiled, history=history)
    assert emu.launches == 1 and len(got) == (5 if history else 3)
    want = oracle_tokens(inp, tiled)
    on = np.array(inp["active"]) if "active" in inp else np.ones(shape[0], bool)
    check(mx.array(np.array(got[0])[on]), want[0][on], 1e-5, "out")  # paused rows: meaningless
    for g, w, what in zip(got[1:], want[1:], HIST[1:]):
        check(g, w, 1e-5, what)
    exact_states(got, inp, want[1].astype(np.float32))
    if history:
        np.testing.assert_array_equal(np.array(got[3]), want[3].astype(np.float32))
        assert np.array(got[3].astype(mx.float32)).shape[1] == L
    if "active" in inp:  # paused rows: their state in every entry
        off = ~np.array(inp["active"])
        if history:
            for j in range(L):
                np.testing.assert_array_equal(np.array(got[4])[off, j], np.array(inp["state"])[off])


# ---- the Qwen 3.5 decode step (static caches, a paused row) through the emulated kernel ----

QWEN = dict(
    vocab_size=64, hidden_size=64, intermediate_size=96, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=32,
    linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=6,
    rms_norm_eps=1e-5, num_hidden_layers=4, full_attention_interval=4,
)  # fmt: skip


def tiny_qwen():
    from hf2q_mlx.models import qwen3_5

    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(QWEN))
    params = []
    for i, (name, p) in enumerate(tree_flatten(model.parameters())):
        key = mx.random.key(500 + i)
        if p.ndim == 1:
            v = 0.75 + 0.5 * mx.random.uniform(shape=p.shape, key=key)
        else:
            v = mx.random.normal(p.shape, key=key) / p.shape[-1] ** 0.5
        params.append((name, v))
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())
    return model


@needs_gxx
@pytest.mark.parametrize("L", [1, 3], ids=["decode", "verify3"])
@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
def test_decode_step_takes_one_launch_per_delta_net_layer(fused, L, monkeypatch):
    """DecodeStep's step (run eagerly: the emulator is not traceable) over 3 rows, one paused,
    L tokens each (L = 3: a verify): one launch per delta-net layer, logits of the active rows,
    every cache and the verify's histories as the CPU reference path gives them, the paused
    row's states untouched. ``fused``: the in_proj layers as one (``fuse_projections``, as the
    loader does), read in place by the kernel."""
    from hf2q_mlx.decode_step import DecodeStep
    from hf2q_mlx.models.static_cache import StaticRecurrentCache

    with mx.stream(mx.cpu):
        model = tiny_qwen()
        if fused:
            model.fuse_projections()
            assert "in_proj_qkvzba" in model.layers[0].linear_attn
        step = DecodeStep(model, max_batch=3, max_len=16, reserve=L - 1)
        for row, n in enumerate([3, 5, 2]):
            step.prefill(row, list(range(1, n + 1)))
        before = [list(s.arrays) for s in step.caches]
        tokens = mx.array([[7 + r + 5 * t for t in range(L)] for r in range(3)])
        call = (
            tokens, mx.array(step.positions), mx.array([True, False, True]),
            before, step.max_len, False,
        )  # fmt: skip
        want, want_arrays, want_hist, _ = step._step(*call)  # the CPU: the reference path
        mx.eval(want, want_arrays, want_hist)
        # kernels on: this CPU plays the GPU; only the decode kernel runs (on the emulator)
        monkeypatch.setattr(ck, "_gpu", ("cuda", mx.default_device(), mx.default_device))
        emu = kernel_emulator.Emulated(gdd._kernel)
        monkeypatch.setattr(gdd, "_kernel", emu)
        monkeypatch.setattr(gdd, "backend", lambda: "cuda")
        with monkeypatch.context() as m:
            for info in pkgutil.iter_modules(ck.__path__):  # every other kernel: its reference
                mod = importlib.import_module(f"{ck.__name__}.{info.name}")
                if mod is not gdd and hasattr(mod, "backend"):
                    m.setattr(mod, "backend", lambda: None)
            got, got_arrays, got_hist, _ = step._step(*call)
            mx.eval(got, got_arrays, got_hist)
    linear = [isinstance(s, StaticRecurrentCache) for s in step.caches]
    assert emu.launches == sum(linear) == 3
    assert len(got_hist) == len(want_hist) == (3 if L > 1 else 0)
    for g, w in zip(got_hist, want_hist):  # [conv (B, L, K-1, C), state (B, L, Hv, Dv, Dk)]
        # later layers' inputs went through kernels and references: fp32, two summation orders
        for gi, wi in zip(g, w):
            assert gi.shape[1] == L
            wi = np.array(wi)
            assert np.abs(np.array(gi) - wi).max() <= 1e-4 * np.abs(wi).max()
    on = np.array([True, False, True])
    g, w = np.array(got)[on], np.array(want)[on]
    assert np.abs(g - w).max() <= 1e-4 * np.abs(w).max()  # fp32, two summation orders
    for is_linear, old, new, ref in zip(linear, before, got_arrays, want_arrays):
        for o, n, r in zip(old, new, ref):
            # the paused row's KV slots past its end: written, meaningless (L > 1)
            n, r = np.array(n), np.array(r)
            assert np.abs(n[on] - r[on]).max() <= 1e-4 * max(np.abs(r).max(), 1e-30)
            if is_linear:
                np.testing.assert_array_equal(n[1], np.array(o)[1])  # the paused row


# ---- the kernel on a GPU (the lead runs these on the H200) ----

GPU_SHAPES = SHAPES + [(32, 16, 32, 128, 128), (5, 4, 4, 96, 33), (2, 2, 4, 256, 64)]


def cpu_references(inp: dict, **kw) -> tuple:
    """The reference on the CPU in the inputs' dtype, and in fp32 (the oracle of the GPU tests)."""
    with mx.stream(mx.cpu), reference_only():
        ref = gdd.gated_delta_decode(**inp, **kw)
        f32 = {k: v.astype(mx.float32) if isinstance(v, mx.array) and k != "active" else v
               for k, v in inp.items()}  # fmt: skip
        exact = gdd.gated_delta_decode(**f32, **kw)
        mx.eval(ref, exact)
    return ref, exact


def assert_near_exact(got, ref, exact, checks, dtype, rows=slice(None)) -> None:
    """Outputs ``checks`` ((index, name), ...) of a GPU call against the fp32 reference, over
    ``rows`` (a row mask: active rows only)."""
    for i, what in checks:
        e = np.array(exact[i])[rows]
        k_err = np.abs(np.array(got[i].astype(mx.float32))[rows] - e).max()
        if dtype == mx.float32:
            # same math, other reduction orders (~1e-6); the per-head norm scales a small head's
            # error up to the largest output's: 1e-4
            assert k_err <= 1e-4 * np.abs(e).max(), f"{what}: {k_err}"
        else:  # within 2x the bf16 reference's own error against fp32
            r_err = np.abs(np.array(ref[i].astype(mx.float32))[rows] - e).max()
            assert k_err <= 2 * r_err + 1e-6 * np.abs(e).max(), f"{what}: {k_err} vs {r_err}"


@requires_gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("tiled", [False, True], ids=["grouped", "tiled"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=str)
def test_gpu_kernel_matches_reference(shape, tiled, dtype):
    inp = make_inputs(*shape, seed=7 * sum(shape), dtype=dtype, masked=shape[0] > 1)
    with mx.stream(mx.gpu):
        _, hk, hv, dk, dv = shape
        assert gdd._covered(dtype, hk, dk, hv, dv, 4), "the kernel would not run"
        got = gdd.gated_delta_decode(**inp, tiled=tiled, init_value=float("nan"))  # poisoned
        mx.eval(got)
    ref, exact = cpu_references(inp, tiled=tiled)
    exact_states(got, inp, np.array(ref[1].astype(mx.float32)))
    assert_near_exact(got, ref, exact, ((0, "out"), (2, "state")), dtype)


@requires_gpu
@pytest.mark.parametrize("grouping", GROUPINGS, ids=str)
@pytest.mark.parametrize("shape", GPU_SHAPES[3:5], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=str)
def test_gpu_kernel_fused_inputs_bit_exact(shape, grouping, dtype):
    """On the GPU: Channels of fused outputs, read in place, give the bits of the separate
    arrays (same kernel, same math; only the addressing differs); outputs poisoned."""
    seed = 13 * sum(shape) + len(grouping)
    inp = make_inputs(*shape, seed=seed, dtype=dtype, masked=shape[0] > 1, module_conv=True)
    fused = fuse_inputs(inp, GROUPINGS[grouping], seed)
    with mx.stream(mx.gpu):
        _, hk, hv, dk, dv = shape
        assert gdd._covered(dtype, hk, dk, hv, dv, 4), "the kernel would not run"
        want = gdd.gated_delta_decode(**inp, init_value=float("nan"))
        got = gdd.gated_delta_decode(**fused, init_value=float("nan"))
        mx.eval(want, got)
    assert_same(got, want)
    assert not np.isnan(np.array(want[0].astype(mx.float32))).any()  # every output written


@requires_gpu
@pytest.mark.parametrize("L", [2, 5])
@pytest.mark.parametrize("shape", GPU_SHAPES[2:6], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=str)
def test_gpu_kernel_tokens_match_reference(shape, L, dtype):
    """A verify of L tokens per row in one launch on the GPU (fused qkvz + ba inputs, rows
    masked, outputs poisoned) against the CPU's token-by-token reference: conv state and conv
    history exact (copies), out (active rows), state and state history as the L = 1 test."""
    seed = 23 * sum(shape) + L
    inp = make_inputs(*shape, seed=seed, dtype=dtype, masked=shape[0] > 1, module_conv=True, L=L)
    fused = fuse_inputs(inp, GROUPINGS["qkvz+ba"], seed)
    with mx.stream(mx.gpu):
        _, hk, hv, dk, dv = shape
        assert gdd._covered(dtype, hk, dk, hv, dv, 4, L), "the kernel would not run"
        got = gdd.gated_delta_decode(**fused, init_value=float("nan"), history=True)
        mx.eval(got)
    ref, exact = cpu_references(inp, history=True)
    for i in (1, 3):  # conv state, conv history: data movement
        g, r = (np.array(x[i].astype(mx.float32)) for x in (got, ref))
        np.testing.assert_array_equal(g, r)
    on = np.array(inp["active"]) if "active" in inp else np.ones(shape[0], bool)
    checks = ((0, "out"), (2, "state"), (4, "state history"))
    assert_near_exact(got, ref, exact, checks, dtype, rows=on)


VIEWS = {"Reshape", "Broadcast", "Squeeze", "ExpandDims"}  # primitives that launch nothing here


@requires_gpu
@pytest.mark.parametrize("L", [1, 5], ids=["decode", "verify5"])
@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
@pytest.mark.parametrize("B", [1, 4])
def test_gpu_block_decode_is_one_launch(B, fused, L):
    """The compiled delta-net decode between in_proj and out_proj (a 9B-shaped block, bf16,
    a static cache with a paused row) holds one launching primitive: the kernel. Before it:
    the step kernel, two mx.where of the static cache, the RMSNorm and silu(z) * norm = 5.
    ``fused``: one in_proj_qkvzba output, read in place (no Slice node before the kernel).
    L = 5: a verify, its rollback history included (before: L step kernels, slices, stacks)."""
    import io
    import re

    from hf2q_mlx.models import ops, qwen3_5
    from hf2q_mlx.models.static_cache import StaticRecurrentCache

    with mx.stream(mx.gpu):
        args = qwen3_5.ModelArgs.from_dict(dict(QWEN, hidden_size=256, **{
            "linear_num_key_heads": 16, "linear_num_value_heads": 32,
            "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        }))  # fmt: skip
        net = qwen3_5.GatedDeltaNet(args)
        net.update(tree_unflatten([
            (k, v if k in ("A_log", "dt_bias") else v.astype(mx.bfloat16))
            for k, v in tree_flatten(net.parameters())
        ]))  # fmt: skip
        cache = StaticRecurrentCache(
            mx.zeros((B, 3, net.conv_dim), mx.bfloat16), mx.zeros((B, 32, 128, 128))
        )
        if fused:
            net.fuse_projections()
            assert len(net._in_plan) == 1
        x = mx.random.normal((B, L, 256)).astype(mx.bfloat16)
        ins = [net[attr](x) for attr, _ in net._in_plan]  # the in_proj matmul outputs
        # the zero states too: unevaluated, their two Full ops showed in the graph on the H200
        mx.eval(ins, net.parameters(), cache.arrays)

        def block(*args):
            *ys, conv, state, active = args
            cache.conv_state, cache.state, cache.active = conv, state, active
            out = ops.gated_delta_net(net, *net.unpack(ys), cache)
            return out, cache.conv_state, cache.state, *(cache.history or [])

        active = mx.array([i % 2 == 0 for i in range(B)])
        outs = mx.compile(block)(*ins, cache.conv_state, cache.state, active)
        assert len(outs) == (3 if L == 1 else 5)
        buf = io.StringIO()
        mx.export_to_dot(buf, *outs)
        mx.eval(outs)
    prims = [p for p in re.findall(r'label ="([^"]+)"', buf.getvalue()) if p not in VIEWS]
    print(f"B={B}: {len(prims)} launching primitive(s): {prims}")
    assert len(prims) == 1, prims


@pytest.mark.parametrize("L", [2, 5])
@pytest.mark.parametrize(
    "shape", [SHAPES[2], (2, 1, 2, 64, 20)], ids=lambda s: "x".join(map(str, s))
)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=str)
def test_kernel_tokens_are_single_token_launches_emulated(shape, L, dtype, monkeypatch):
    """Row parity of a verify: one L-token launch (fewer SIMD groups) gives the bits of L
    one-token launches, states threaded through (the gated RMSNorm's sum of squares runs in an
    order fixed by Dv, not by the SIMD group count). Paused rows' out is meaningless."""
    emu = kernel_emulator.Emulated(gdd._kernel)
    monkeypatch.setattr(gdd, "_kernel", emu)
    monkeypatch.setattr(gdd, "backend", lambda: "cuda")
    assert gdd._warps(shape[-1], L) != gdd._warps(shape[-1], 1)  # the case this guards
    tiled = L == 2
    seed = 29 * sum(shape) + L
    inp = make_inputs(*shape, seed=seed, masked=True, module_conv=True, L=L, dtype=dtype)
    got = gdd.gated_delta_decode(**inp, tiled=tiled)
    cur, outs = dict(inp), []
    for t in range(L):
        one = {n: inp[n][:, t : t + 1] for n in ("qkv", "z", "a", "b")}
        out, cur["conv_state"], cur["state"] = gdd.gated_delta_decode(
            **dict(cur, **one), tiled=tiled
        )
        outs.append(out)
    want = (mx.concatenate(outs, 1), cur["conv_state"], cur["state"])
    on = np.array(inp["active"])
    for i, (g, w, what) in enumerate(zip(got, want, HIST)):
        g, w = (np.array(a.astype(mx.float32)) for a in (g, w))
        if i == 0:
            g, w = g[on], w[on]
        np.testing.assert_array_equal(g, w, err_msg=what)


def test_stream_rule(monkeypatch):
    """The streamed path takes one-token calls of at least STREAM_MIN_GROUPS threadgroups;
    HF2Q_GDN_STREAM 1 / 0 force it on / off at one token; a verify never takes it."""
    monkeypatch.setattr(gdd, "STREAM", "")
    on = (gdd.STREAM_WARPS, gdd.STREAM_ROWS)
    assert gdd.stream_plan(1, 1, 32, False) is None  # one row of 35B-A3B: 32 threadgroups
    assert gdd.stream_plan(8, 1, 32, False) == (2 * gdd.STREAM_WARPS, gdd.STREAM_ROWS)
    assert gdd.stream_plan(32, 1, 32, False) == on  # 1,024 threadgroups
    assert gdd.stream_plan(32, 2, 32, False) is gdd.stream_plan(32, 1, 32, True) is None
    monkeypatch.setattr(gdd, "STREAM", "1")
    assert gdd.stream_plan(64, 1, 32, False) == on
    assert gdd.stream_plan(1, 5, 32, False) is None
    monkeypatch.setattr(gdd, "STREAM", "0")
    assert gdd.stream_plan(32, 1, 32, False) is None
    monkeypatch.setattr(gdd, "STREAM", "2")
    with pytest.raises(InvalidArgumentError):
        gdd.stream_plan(32, 1, 32, False)


def _stream_matches_registers(monkeypatch, shapes, dtype, settings, tiled=False, poison=True):
    """Each shape through the register path, then the streamed one under each (warps, rows at
    a time) setting, from poisoned outputs (the emulator poisons every launch itself): the
    same bits (out, state, conv state)."""
    init = float("nan") if poison else None
    for shape in shapes:
        inp = make_inputs(*shape, seed=31 * sum(shape), dtype=dtype, masked=shape[0] > 1)
        monkeypatch.setattr(gdd, "STREAM", "0")
        gdd._plan.cache_clear()
        want = gdd.gated_delta_decode(**inp, tiled=tiled, init_value=init)
        mx.eval(want)
        monkeypatch.setattr(gdd, "STREAM", "1")
        monkeypatch.setattr(gdd, "STREAM_WIDE_GROUPS", 0)  # STREAM_WARPS as set, any rows
        for warps, rows in settings:
            monkeypatch.setattr(gdd, "STREAM_WARPS", warps)
            monkeypatch.setattr(gdd, "STREAM_ROWS", rows)
            gdd._plan.cache_clear()
            got = gdd.gated_delta_decode(**inp, tiled=tiled, init_value=init)
            mx.eval(got)
            for g, w, what in zip(got, want, ("out", "conv_state", "state")):
                np.testing.assert_array_equal(bits(g), bits(w), err_msg=f"{shape} {what}")
            assert not np.isnan(np.array(got[0].astype(mx.float32))).any()
    gdd._plan.cache_clear()


@needs_gxx
@pytest.mark.parametrize("shape", SHAPES[1:], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("tiled", [False, True], ids=["grouped", "tiled"])
def test_streamed_state_gives_the_register_paths_bits_emulated(shape, tiled, monkeypatch):
    """STREAM: the state streamed RU rows at a time by fewer SIMD groups (rows past Dv and a
    last partial round included: Dv 7 and 40) writes the register path's bits; its out is
    within fp32 of the oracle too (a wrong row map fails both)."""
    emu = kernel_emulator.Emulated(gdd._kernel)
    monkeypatch.setattr(gdd, "_kernel", emu)
    monkeypatch.setattr(gdd, "backend", lambda: "cuda")
    _stream_matches_registers(monkeypatch, [shape], mx.float32, [(4, 4), (2, 3)], tiled, False)
    assert emu.launches == 3
    inp = make_inputs(*shape, seed=31 * sum(shape), masked=shape[0] > 1)
    got = gdd.gated_delta_decode(**inp, tiled=tiled)  # STREAM still "1"
    want = oracle(inp, tiled)
    for g, w, what in zip(got, want, ("out", "conv_state", "state")):
        check(g, w, 1e-5, what)


@requires_gpu
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=str)
def test_gpu_streamed_state_gives_the_register_paths_bits(monkeypatch, dtype):
    """On the GPU at Qwen 3.5's delta-net head, 8 and 32 rows (some paused): the same bits."""
    with mx.stream(mx.gpu):
        _stream_matches_registers(
            monkeypatch, [(8, 16, 32, 128, 128), (32, 16, 32, 128, 128)], dtype,
            [(4, 4), (8, 4), (4, 2)],
        )  # fmt: skip
