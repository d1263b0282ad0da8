"""Why do small decode kernels take 20-35 us each inside the compiled 26B-A4B step (issue 15)?

The step's CUPTI profile (`bench/decode_profile.py`) gives the decode attention ~30 us a call
whatever its split (16 parts x 16 SIMD groups, i.e. two slots per group, and 4 x 8, seventeen
slots per group, both ~30 us) and the router ~22 us for a 720 KB weight. This probe times the
same kernels alone, at the 26B-A4B shapes, under CUPTI: a chain of ``--chain`` calls, each
fed the previous one's output (so no two kernels run side by side), built first and evaluated
at once. Per variant: the kernels' median CUPTI duration and the wall time per call. Variants
move one thing at a time: the attention span (slots actually read), its (parts, groups)
mapping and head size; the router and its split mappings; a one-line copy kernel and an MLX
add as the floor of any launch.

Also: the attention body with one section removed or changed (``BODY_VARIANTS``: no slot loop,
no shared-memory merge, 16-byte loads, no softmax, its one-element inputs as constants), MLX's
own attention over the same cache, head strides, and host writes between calls. The answer
(session 17, docs/kernel_notes.md): the one-element inputs. MLX's CUDA allocator keeps arrays
of 8 bytes or less in a small pool of managed memory whose reads stall kernels; the dispatchers
now pad them (``custom_kernels.device_array``), and the attention takes ~6 us here.

    python3 bench/kernel_floor.py --json /tmp/out/kernel_floor.json     # H200 (needs torch+CUDA)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import decode_profile as dp  # noqa: E402  (bench/decode_profile.py: CUPTI kernel list)
import offset_probe  # noqa: E402  (bench/offset_probe.py: a one-line CUDA copy kernel)

from hf2q_mlx.custom_kernels import decode_attention as DA  # noqa: E402
from hf2q_mlx.custom_kernels import device_array  # noqa: E402
from hf2q_mlx.custom_kernels import moe_router as MR  # noqa: E402
from hf2q_mlx.custom_kernels._render import Kernel  # noqa: E402

DEFAULT_ATTENTION = DA._kernel


# Body variants of the decode attention, each removing one section (the split case's cost):
# no slot loop (prologue + epilogue only); no shared-memory merge (SIMD group 0 writes its own
# state, the other groups still walk their slots).
_LOOP = "for (int s = part * CHUNK + int(simd_id); s < last; s += W) {"
_MERGE_FROM = "  if (lane == 0) {\n    wm[simd_id] = m;"
_OWN_STATE = """  const uint64_t prow = uint64_t(row) * P + part;
  if (simd_id == 0) {
    if (lane == 0) { pm[prow] = m; pl[prow] = den; }
    UNROLL for (int e = 0; e < EV; ++e) {
      const int i = int(lane) + 32 * e;
      if (i < DV) {
        if (P == 1) out[uint64_t(row) * DV + i] = from_float<T>(o[e]);
        else po[prow * DV + i] = o[e];
      }
    }
  }
"""
# CUDA only, D = DV = 256: lane j loads elements 8j..8j+7 of a slot's key and value as one
# 16-byte load each (8 two-byte loads each in the kernel); SIMD group 0 writes its own state.
_VEC_LOOP = (
    DA._BODY[DA._BODY.index("  const int Hq") : DA._BODY.index("  float qv[EK];")]
    + """
  float qv[8];
  float o[8];
  UNROLL for (int j = 0; j < 8; ++j) {
    qv[j] = to_float(q[uint64_t(row) * D + 8 * lane + j]) * sc;
    o[j] = 0.0f;
  }
"""
    + DA._BODY[DA._BODY.index("  float m = -INF_F;") : DA._BODY.index("    const uint64_t ko")]
    + """
    const uint4 kw = reinterpret_cast<const uint4*>(keys + (kbase + uint64_t(s)) * D)[lane];
    const uint4 vw = reinterpret_cast<const uint4*>(values + (kbase + uint64_t(s)) * DV)[lane];
    const unsigned kk[4] = {kw.x, kw.y, kw.z, kw.w};
    const unsigned vk[4] = {vw.x, vw.y, vw.z, vw.w};
    float vv[8];
    float part_dot = 0.0f;
    UNROLL for (int j = 0; j < 4; ++j) {
      part_dot += qv[2 * j] * __uint_as_float(kk[j] << 16);
      part_dot += qv[2 * j + 1] * __uint_as_float(kk[j] & 0xffff0000u);
      vv[2 * j] = __uint_as_float(vk[j] << 16);
      vv[2 * j + 1] = __uint_as_float(vk[j] & 0xffff0000u);
    }
    const float score = simd_sum(part_dot);
    const float m2 = max_f(m, score);
    const float fix = exp_f(m - m2);
    const float p = exp_f(score - m2);
    den = den * fix + p;
    UNROLL for (int j = 0; j < 8; ++j) o[j] = o[j] * fix + p * vv[j];
    m = m2;
  }
  const uint64_t prow = uint64_t(row) * P + part;
  if (simd_id == 0) {
    if (lane == 0 && P > 1) { pm[prow] = m; pl[prow] = den; }
    UNROLL for (int j = 0; j < 8; ++j) {
      if (P == 1) out[uint64_t(row) * DV + 8 * lane + j] = from_float<T>(o[j]);
      else po[prow * DV + 8 * lane + j] = o[j];
    }
  }
"""
)


def _no_scalars(b: str) -> str:
    """The 26B-A4B probe's pos (512), scale (1/16) and head count (16) as constants: no read of
    MLX's one-element arrays (a small pool of managed memory)."""
    for a, c in (("int(dims[0])", "16"), ("scale[0]", "0.0625f"), ("int(pos[b])", "512")):
        assert a in b, a
        b = b.replace(a, c)
    return b


def _no_softmax(b: str) -> str:
    """Scores summed into the output without the running max and exponentials."""
    a = """    const float m2 = max_f(m, score);
    const float fix = exp_f(m - m2);
    const float p = exp_f(score - m2);
    den = den * fix + p;
    UNROLL for (int e = 0; e < EV; ++e) o[e] = o[e] * fix + p * vv[e];
    m = m2;"""
    assert a in b
    return b.replace(
        a,
        """    den += score;
    m = 0.0f;
    UNROLL for (int e = 0; e < EV; ++e) o[e] += score * vv[e];""",
    )


BODY_VARIANTS = {
    "no_scalars": _no_scalars,
    "no_softmax": _no_softmax,
    "vec16": lambda b: _VEC_LOOP,
    "no_loop": lambda b: b.replace(_LOOP, "for (int s = last; s < last; s += W) {"),
    "no_merge": lambda b: b[: b.index(_MERGE_FROM)] + _OWN_STATE,
}
_variant_kernels = {}


def _attention_kernel(variant):
    """The dispatcher's kernel, or a copy of it with one section removed (its own name: MLX
    keys JIT modules by name)."""
    if variant is None:
        return DEFAULT_ATTENTION
    if variant not in _variant_kernels:
        base = DEFAULT_ATTENTION
        body = BODY_VARIANTS[variant](base.body)
        assert body != base.body, variant
        _variant_kernels[variant] = Kernel(f"decode_attention_{variant}", base.inputs,
                                           base.outputs, body, examples=base.examples,
                                           register=False)  # fmt: skip
    return _variant_kernels[variant]


_applied = []  # the (split, body) the dispatcher's plan cache was last cleared for


def attention_case(
    Hq, Hk, D, cap, window, pos, span, split=None, variant=None, host=None, pos_padded=False
):
    """(first q, step): one decode attention call whose output is the next call's q. Before
    session 17 every call cleared the dispatcher's plan cache, so each call's constants (scale,
    head count) were new one-element arrays, written by the host into MLX's small pool; now the
    plan is made once per case. ``host``: a host write per call first, into the small pool
    ("small": a new (1,) int32), or outside it ("padded": 16 bytes), or the old plan clearing
    ("replan"); or the position itself, a new 16-byte array per call ("pos_each"), read through
    a GPU-written copy ("pos_each_copied"). ``pos_padded``: the position array outside the
    small pool."""
    k = mx.random.normal((1, Hk, cap, D)).astype(mx.bfloat16)
    v = mx.random.normal((1, Hk, cap, D)).astype(mx.bfloat16)
    p = device_array([pos], mx.int32) if pos_padded else mx.array([pos], dtype=mx.int32)
    q0 = mx.random.normal((1, Hq, 1, D)).astype(mx.bfloat16)
    mx.eval(k, v, p, q0)
    junk = []

    def step(q):
        want = ("" if split is None else f"{split[0]},{split[1]}", _attention_kernel(variant))
        if _applied != [want] or host == "replan":
            DA.SPLIT_OVERRIDE, DA._kernel = want
            DA._plan.cache_clear()
            _applied[:] = [want]
        if host in ("small", "padded"):
            junk.append(mx.array([len(junk)] * (1 if host == "small" else 4), dtype=mx.int32))
        pp = p
        if host in ("pos_each", "pos_each_copied"):  # the position written by the host per call
            pp = device_array([pos], mx.int32)
            pp = pp + 0 if host == "pos_each_copied" else pp  # a GPU-written copy (small pool)
        out = DA.decode_attention(q, k, v, pp, D**-0.5, span, window, True)  # (1, 1, Hq * D)
        return out.reshape(1, Hq, 1, D)

    return q0, step


def mlx_attention_case(Hq, Hk, D, slots, fast=True):
    """(first q, step): MLX's own attention over the same cache shape (no mask, every slot
    visible): mx.fast.scaled_dot_product_attention, or two matmuls and a softmax."""
    k = mx.random.normal((1, Hk, slots, D)).astype(mx.bfloat16)
    v = mx.random.normal((1, Hk, slots, D)).astype(mx.bfloat16)
    q0 = mx.random.normal((1, Hq, 1, D)).astype(mx.bfloat16)
    mx.eval(k, v, q0)
    rep = Hq // Hk

    def step(q):
        if fast:
            return mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5)
        qg = q.reshape(1, Hk, rep, D) * D**-0.5  # (B, Hk, REP, D): a KV head's query heads
        p = mx.softmax((qg @ k.transpose(0, 1, 3, 2)).astype(mx.float32), axis=-1)
        return (p.astype(v.dtype) @ v).reshape(1, Hq, 1, D)

    return q0, step


def router_case(D=2816, E=128, k=8, split=None):
    """(first x, step): one router call whose normalized x is the next call's x."""
    w = (mx.random.normal((E, D)) * D**-0.5).astype(mx.bfloat16)
    scale = mx.random.uniform(shape=(D,)).astype(mx.bfloat16)
    escale = mx.random.uniform(shape=(E,)).astype(mx.bfloat16)
    norm = mx.random.uniform(shape=(D,)).astype(mx.bfloat16)
    x0 = mx.random.normal((1, 1, D)).astype(mx.bfloat16)
    mx.eval(w, scale, escale, norm, x0)
    opts = dict(pre_scale=scale, pre_mult=D**-0.5, expert_scale=escale, post_norm=norm)

    def step(x):
        if split is None:
            return MR.moe_router(x, w, k, **opts)[2]
        # HF2Q_ROUTER_SPLIT's mapping: G threadgroups per row, SIMD groups each
        return MR.moe_router_kernel(x, w, k, split=split, **opts)[2]

    return x0, step


def copy_case(n=2816):
    kern = []  # built at the first call (MLX has no cuda_kernel without CUDA)

    def step(x):
        kern[:] = kern or [offset_probe.copy_kernel()]
        return offset_probe.run(kern[0], x)

    return mx.random.normal((n,)).astype(mx.bfloat16), step


def add_case(n=2816):
    return mx.random.normal((n,)).astype(mx.bfloat16), lambda x: x + 1


def cases() -> dict:
    """name -> (first input, step, evaluate after each call)."""
    s = (16, 8, 256, 544, 1024)  # 26B-A4B sliding layer, 512-token prompt + 32 (the profile)
    g = (16, 2, 512, 544, None)  # its global layer
    chained = {
        "copy kernel (floor)": copy_case(),
        "copy 1 MiB": copy_case(1 << 19),
        "copy 8 MiB": copy_case(1 << 22),
        "copy 64 MiB": copy_case(1 << 25),
        "mlx add (floor)": add_case(),
        "router 2816->128 top-8": router_case(),
        "router split 32x4": router_case(split=(32, 4)),
        "router split 16x8": router_case(split=(16, 8)),
        "router split 64x2": router_case(split=(64, 2)),
        "attn sliding span 544 default": attention_case(*s, 512, 544),
        "attn sliding span 544 split 1,1": attention_case(*s, 512, 544, (1, 1)),
        "attn sliding span 544 split 1,16": attention_case(*s, 512, 544, (1, 16)),
        "attn sliding span 544 split 4,8": attention_case(*s, 512, 544, (4, 8)),
        "attn sliding span 544 split 16,16": attention_case(*s, 512, 544, (16, 16)),
        "attn sliding span 544 split 32,16": attention_case(*s, 512, 544, (32, 16)),
        "attn sliding span 544 split 32,4": attention_case(*s, 512, 544, (32, 4)),
        "attn sliding default no_loop": attention_case(*s, 512, 544, None, "no_loop"),
        "attn sliding default no_merge": attention_case(*s, 512, 544, None, "no_merge"),
        "attn sliding 1,16 no_loop": attention_case(*s, 512, 544, (1, 16), "no_loop"),
        "attn sliding default vec16": attention_case(*s, 512, 544, None, "vec16"),
        "attn host replan": attention_case(*s, 512, 544, host="replan"),
        "attn host small": attention_case(*s, 512, 544, host="small"),
        "attn host padded": attention_case(*s, 512, 544, host="padded"),
        "attn host small pos padded": attention_case(*s, 512, 544, host="small", pos_padded=True),
        "attn host none": attention_case(*s, 512, 544, host="none"),
        "attn host pos_each": attention_case(*s, 512, 544, host="pos_each"),
        "attn host pos_each_copied": attention_case(*s, 512, 544, host="pos_each_copied"),
        "attn sliding default no_scalars": attention_case(*s, 512, 544, None, "no_scalars"),
        "attn sliding default no_softmax": attention_case(*s, 512, 544, None, "no_softmax"),
        "attn sliding 1,16 no_scalars": attention_case(*s, 512, 544, (1, 16), "no_scalars"),
        "attn sliding 1,16 no_softmax": attention_case(*s, 512, 544, (1, 16), "no_softmax"),
        "attn sliding 1,16 vec16": attention_case(*s, 512, 544, (1, 16), "vec16"),
        "attn sliding 1,16 no_merge": attention_case(*s, 512, 544, (1, 16), "no_merge"),
        "attn full span 16 vec16": attention_case(16, 8, 256, 544, None, 8, 16, None, "vec16"),
        "attn full span 16 default": attention_case(16, 8, 256, 544, None, 8, 16),
        "attn full span 16 split 1,1": attention_case(16, 8, 256, 544, None, 8, 16, (1, 1)),
        "attn full span 128 default": attention_case(16, 8, 256, 544, None, 100, 128),
        "attn global span 544 default": attention_case(*g, 512, 544),
        "attn D=64 span 544 default": attention_case(16, 8, 64, 544, None, 512, 544),
        "attn mlx sdpa 544 slots": mlx_attention_case(16, 8, 256, 544),
        "attn mlx sdpa 16 slots": mlx_attention_case(16, 8, 256, 16),
        "attn mlx matmuls 544 slots": mlx_attention_case(16, 8, 256, 544, fast=False),
        # the cache's head stride: C slots x D x 2 bytes (512 KiB at 1024 slots)
        "attn stride sliding cap 1040": attention_case(16, 8, 256, 1040, 1024, 512, 544),
        "attn stride sliding cap 1024": attention_case(16, 8, 256, 1024, 1024, 512, 544),
        "attn stride full cap 544": attention_case(16, 8, 256, 544, None, 512, 544),
        "attn stride full cap 1024": attention_case(16, 8, 256, 1024, None, 512, 544),
        "attn stride full cap 2048": attention_case(16, 8, 256, 2048, None, 512, 544),
        "attn stride full cap 2056": attention_case(16, 8, 256, 2056, None, 512, 544),
    }
    out = {name: (*case, False) for name, case in chained.items()}
    # evaluated call by call: outputs come from MLX's buffer cache instead of new allocations
    for name in ("copy 8 MiB", "attn sliding span 544 default", "attn sliding span 544 split 1,16"):
        out[name + " (eval each)"] = (*chained[name], True)
    return out


def measure(case, chain: int, use_cupti: bool) -> dict:
    x, step, eval_each = case
    for _ in range(3):  # builds, first loads
        x = step(x)
        mx.eval(x)
    mx.synchronize()
    prof = None
    if use_cupti:
        from torch.profiler import ProfilerActivity, profile

        prof = profile(activities=[ProfilerActivity.CUDA])
        prof.__enter__()
    tic = time.perf_counter()
    for _ in range(chain):  # a dependent chain, built first: the GPU runs it kernel by kernel
        x = step(x)
        if eval_each:
            mx.eval(x)
    if not eval_each:
        tic = time.perf_counter()  # the chain's evaluation only, not its graph building
    mx.eval(x)
    mx.synchronize()
    wall = (time.perf_counter() - tic) / chain * 1e6
    out = {"wall_us_per_call": wall}
    if prof is not None:
        prof.__exit__(None, None, None)
        by = {}
        for name, us in dp._cuda_kernels(prof):
            by.setdefault(name[:90], []).append(us)
        out["kernels"] = {
            n: {"per_call": len(v) / chain, "median_us": statistics.median(v),
                "min_us": min(v), "max_us": max(v), "p10_us": _pct(v, 0.1), "p90_us": _pct(v, 0.9)}
            for n, v in sorted(by.items(), key=lambda kv: -sum(kv[1]))
        }  # fmt: skip
    return out


def _pct(v, q):
    v = sorted(v)
    return v[min(len(v) - 1, int(q * len(v)))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chain", type=int, default=64)
    ap.add_argument("--only", default="", help="comma list of case-name substrings")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if not mx.cuda.is_available():
        print("no CUDA device: nothing to probe")
        return 0
    use_cupti = dp.cupti_available()
    print(f"MLX {mx.__version__}, chain {a.chain}, CUPTI {'on' if use_cupti else 'off'}")
    results = {}
    for name, case in cases().items():
        if a.only and not any(s in name for s in a.only.split(",")):
            continue
        r = results[name] = measure(case, a.chain, use_cupti)
        print(f"{name:38s} wall {r['wall_us_per_call']:7.1f} us/call", flush=True)
        for kname, s in r.get("kernels", {}).items():
            print(f"    x{s['per_call']:.2f} {s['median_us']:6.1f} us [{s['min_us']:.1f}-"
                  f"{s['max_us']:.1f}, p10-p90 {s['p10_us']:.1f}-{s['p90_us']:.1f}]  {kname}",
                  flush=True)  # fmt: skip
    if a.json:
        Path(a.json).write_text(json.dumps({"mlx": mx.__version__, "chain": a.chain,
                                            "results": results}, indent=1))  # fmt: skip
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
