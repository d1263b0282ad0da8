"""Per-op profile of one decode step: every module call and hot op evaluated and synchronized on
its own, wall time summed per (op, layer), the way hf2q's kernel profile reports a step.

Nothing in the models or dispatchers changes: ``profiling(model)`` wraps, for the duration of the
block, the ``__call__`` of the model's modules and the hot functions (``HOT_FUNCTIONS``, wherever
an hf2q_mlx module or ``mx.fast`` holds them). Each wrapped call first evaluates its inputs (that
pending work is charged to the enclosing op, e.g. a layer's own glue: residual adds, reshapes,
cache writes), then runs, then evaluates its outputs; the time goes to the innermost op running.
Times include Python graph building and one synchronization per op, so the profiled step is
slower than a real one (which evaluates once); the shares are what it is for.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

# Functions timed as ops: (module, attribute, op label). Missing ones are skipped.
HOT_FUNCTIONS: list[tuple[str, str, str]] = [
    ("hf2q_mlx.models.sdpa", "sdpa", "sdpa"),  # every model's attention (mx.fast's inside)
    ("mlx.core.fast", "rope", "rope"),
    ("mlx.core.fast", "rms_norm", "rms_norm"),
    ("mlx.core.fast", "layer_norm", "layer_norm"),
    ("mlx.core.fast", "gated_delta_update", "gated_delta"),
    ("hf2q_mlx.custom_kernels.qmatmul", "ggml_matmul", "ggml_matmul"),
    ("hf2q_mlx.custom_kernels.expert_matmul", "expert_matmul", "expert_matmul"),
    ("hf2q_mlx.custom_kernels.gated_delta", "gated_delta_update", "gated_delta"),
    ("hf2q_mlx.custom_kernels.gated_delta_decode", "gated_delta_decode", "gated_delta"),
    ("hf2q_mlx.models.turboquant.kernels", "tq_flash_decode", "tq_flash_decode"),
    ("hf2q_mlx.models.turboquant.kernels", "tq_quantize", "tq_quantize"),
    ("hf2q_mlx.custom_kernels.rms_norm_rope", "rms_norm_rope", "norm_rope"),
    ("hf2q_mlx.custom_kernels.rms_norm_rope", "qk_norm_rope", "norm_rope"),
    ("hf2q_mlx.custom_kernels.residual_rms_norm", "residual_rms_norm", "residual_norm"),
    ("hf2q_mlx.custom_kernels.activations", "gated_activation", "gated_act"),
    ("hf2q_mlx.custom_kernels.softcap", "softcap", "softcap"),
    ("hf2q_mlx.custom_kernels.sampling", "topk", "topk"),
    ("hf2q_mlx.custom_kernels.sampling", "argmax", "argmax"),
    ("hf2q_mlx.custom_kernels.lm_head_topk", "lm_head_topk", "lm_head_topk"),
]

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.(.*))?$")


@dataclass
class OpProfile:
    """Seconds and calls per (op, layer); layer None = outside the decoder layers."""

    seconds: dict[tuple[str, int | None], float] = field(default_factory=dict)
    calls: dict[tuple[str, int | None], int] = field(default_factory=dict)

    def add(self, op: str, layer: int | None, seconds: float, call: bool = False) -> None:
        key = (op, layer)
        self.seconds[key] = self.seconds.get(key, 0.0) + seconds
        if call:
            self.calls[key] = self.calls.get(key, 0) + 1

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    def by_op(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for (op, _), s in self.seconds.items():
            out[op] = out.get(op, 0.0) + s
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def by_layer(self) -> dict[int | None, float]:
        out: dict[int | None, float] = {}
        for (_, layer), s in self.seconds.items():
            out[layer] = out.get(layer, 0.0) + s
        return out

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: milliseconds by op, by layer ("-" = outside the layers) and per record."""
        ms = lambda s: round(s * 1e3, 4)  # noqa: E731
        return {
            "total_ms": ms(self.total),
            "by_op_ms": {op: ms(s) for op, s in self.by_op().items()},
            "by_layer_ms": {
                ("-" if k is None else str(k)): ms(s) for k, s in self.by_layer().items()
            },
            "records": [
                {"op": op, "layer": layer, "ms": ms(s), "calls": self.calls.get((op, layer), 0)}
                for (op, layer), s in sorted(self.seconds.items(), key=lambda kv: -kv[1])
            ],
        }


def _arrays(obj: Any, depth: int = 0, out: list | None = None) -> list[mx.array]:
    """The mx.arrays in obj (nested tuples, lists, dicts, plain objects such as caches)."""
    out = [] if out is None else out
    if isinstance(obj, mx.array):
        out.append(obj)
    elif depth < 4 and isinstance(obj, (list, tuple)):
        for v in obj:
            _arrays(v, depth + 1, out)
    elif depth < 4 and isinstance(obj, dict):
        for v in obj.values():
            _arrays(v, depth + 1, out)
    elif depth < 2 and hasattr(obj, "__dict__") and not callable(obj):
        for v in vars(obj).values():
            _arrays(v, depth + 1, out)
    return out


class _Session:
    def __init__(self, profile: OpProfile):
        self.profile = profile
        self.stack: list[tuple[str, int | None, int]] = [("(other)", None, 0)]  # op, layer, id
        self.mark = time.perf_counter()

    def settle(self, arrays: list[mx.array]) -> None:
        """Finish the pending work that ``arrays`` need; charge the time to the running op."""
        if arrays:
            mx.eval(arrays)
        mx.synchronize()
        now = time.perf_counter()
        op, layer, _ = self.stack[-1]
        self.profile.add(op, layer, now - self.mark)
        self.mark = now

    def layer(self) -> int | None:
        return next((layer for _, layer, _ in reversed(self.stack) if layer is not None), None)

    def call(self, op: str, layer: int | None, ident: int, fn, args, kwargs):
        if self.stack[-1][2] == ident and ident:  # a subclass calling super().__call__
            return fn(*args, **kwargs)
        self.settle(_arrays((args, kwargs)))
        self.stack.append((op, layer, ident))
        self.profile.add(op, layer, 0.0, call=True)
        try:
            out = fn(*args, **kwargs)
            self.settle(_arrays(out))
        finally:
            self.stack.pop()
        return out


_active: contextvars.ContextVar[_Session | None] = contextvars.ContextVar(
    "hf2q_profile", default=None
)


def _module_label(path: str) -> tuple[str, int | None]:
    """'model.layers.3.self_attn.q_proj' -> ('self_attn.q_proj', 3); 'model.norm' -> ('norm',
    None)."""
    m = _LAYER.search(path)
    if m:
        return m.group(2) or "layer", int(m.group(1))
    return (path.removeprefix("model.") or "(model)"), None


def _patch_modules(model: Any, session: _Session, undo: list) -> None:
    labels = {id(m): _module_label(p) for p, m in model.named_modules()}
    done: set[type] = set()
    for _, m in model.named_modules():
        owner = next((c for c in type(m).__mro__ if "__call__" in c.__dict__), None)
        if owner is None or owner in done:
            continue
        done.add(owner)
        orig = owner.__dict__["__call__"]

        def wrapped(self, *args, __orig=orig, **kwargs):
            label = labels.get(id(self))
            if label is None:
                return __orig(self, *args, **kwargs)
            bound = functools.partial(__orig, self)
            return session.call(label[0], label[1], id(self), bound, args, kwargs)

        owner.__call__ = wrapped
        undo.append((owner, "__call__", orig))


def _patch_functions(session: _Session, undo: list) -> None:
    holders = [m for n, m in list(sys.modules.items()) if n.startswith("hf2q_mlx") and m]
    for modname, attr, label in HOT_FUNCTIONS:
        try:
            mod = importlib.import_module(modname)
        except ImportError:
            continue
        orig = getattr(mod, attr, None)
        if orig is None:
            continue

        @functools.wraps(orig)
        def wrapped(*args, __orig=orig, __label=label, **kwargs):
            return session.call(__label, session.layer(), 0, __orig, args, kwargs)

        for holder in {id(h): h for h in [mod, *holders]}.values():
            for name, value in list(vars(holder).items()):
                if value is orig:
                    setattr(holder, name, wrapped)
                    undo.append((holder, name, orig))


@contextlib.contextmanager
def profiling(model: Any = None) -> Iterator[OpProfile]:
    """Record a per-op profile of everything run in the block (the model's modules when given,
    and ``HOT_FUNCTIONS``); hooks are removed on exit."""
    profile = OpProfile()
    session = _Session(profile)
    undo: list = []
    token = _active.set(session)
    # compiled glue would trace through the hooks, which evaluate: run it uncompiled here
    mx.disable_compile()
    try:
        if model is not None:
            _patch_modules(model, session, undo)
        _patch_functions(session, undo)
        session.mark = time.perf_counter()
        yield profile
        session.settle([])
    finally:
        for holder, name, orig in reversed(undo):
            setattr(holder, name, orig)
        _active.reset(token)
        mx.enable_compile()


def _step(model: Any, tokens: mx.array, cache: list) -> mx.array:
    return model(tokens, cache=cache)


def profile_decode_step(model: Any, cache: list, token: int | mx.array, *,
                        warmup: bool = True) -> dict[str, Any]:  # fmt: skip
    """Profile one decode step of ``model`` on ``token`` (batch 1) with ``cache`` (already
    holding the prompt). Runs a warm-up step (builds kernels), one plain timed step, then the
    profiled one: the cache advances by up to three tokens. Returns ``OpProfile.as_dict()``
    plus ``step_ms`` (plain, one evaluation) and ``profiled_ms`` (one sync per op)."""
    tokens = (
        token.reshape(1, 1).astype(mx.int32)
        if isinstance(token, mx.array)
        else mx.array([[int(token)]], dtype=mx.int32)
    )
    if warmup:
        mx.eval(_step(model, tokens, cache), _arrays(cache))
    mx.synchronize()
    start = time.perf_counter()
    mx.eval(_step(model, tokens, cache), _arrays(cache))
    mx.synchronize()
    plain = time.perf_counter() - start
    start = time.perf_counter()
    with profiling(model) as prof:
        logits = _step(model, tokens, cache)
        session = _active.get()
        session.settle(_arrays(logits) + _arrays(cache))
    profiled = time.perf_counter() - start
    return {"step_ms": round(plain * 1e3, 4), "profiled_ms": round(profiled * 1e3, 4),
            "device": str(mx.default_device()), **prof.as_dict()}  # fmt: skip


def format_profile(result: dict[str, Any], top: int = 25) -> str:
    """Text tables of ``profile_decode_step``'s result: ops summed over layers, the heaviest
    (op, layer) records, time per layer."""
    total = result["total_ms"] or 1.0
    lines = [
        f"decode step: {result.get('step_ms', float('nan')):.3f} ms plain, "
        f"{result['total_ms']:.3f} ms profiled (one sync per op) on {result.get('device', '?')}",
        "",
        f"{'op (all layers)':<36} {'ms':>10} {'share':>7}",
    ]
    for op, ms in result["by_op_ms"].items():
        lines.append(f"{op:<36} {ms:>10.3f} {100 * ms / total:>6.1f}%")
    lines += ["", f"{'op':<36} {'layer':>5} {'calls':>5} {'ms':>10}"]
    for r in result["records"][:top]:
        layer = "-" if r["layer"] is None else r["layer"]
        lines.append(f"{r['op']:<36} {layer:>5} {r['calls']:>5} {r['ms']:>10.3f}")
    lines += ["", f"{'layer':>5} {'ms':>10}"]
    for layer, ms in result["by_layer_ms"].items():
        lines.append(f"{layer:>5} {ms:>10.3f}")
    return "\n".join(lines)
