"""Gated activations act(gate) * up (SiLU, GELU-tanh), from separate or fused gate_up arrays."""

from __future__ import annotations

import math
from functools import lru_cache

import mlx.core as mx

from hf2q_mlx.custom_kernels import backend, device_array
from hf2q_mlx.custom_kernels._render import Example, Kernel

ACTIVATIONS = ("silu", "gelu_tanh")

# Kernel text for the expert and dense GLU epilogues: a = act(g) on the fp32 sum g, with the
# template's ACT the index in ACTIVATIONS (0 SiLU, 1 GELU tanh).
ACTIVATE_EPILOGUE = r"""    float a;
    if (ACT == 0) {
      a = g / (1.0f + exp_f(-g));
    } else {
      a = 0.5f * g * (1.0f + tanh_f(0.7978845608028654f * (g + 0.044715f * g * g * g)));
    }
"""


def _act(g: mx.array, kind: str) -> mx.array:
    if kind == "silu":
        return g * mx.sigmoid(g)
    c = math.sqrt(2.0 / math.pi)
    return 0.5 * g * (1.0 + mx.tanh(c * (g + 0.044715 * g * g * g)))


def _split(gate: mx.array, up: mx.array | None) -> tuple[mx.array, mx.array]:
    if up is None:
        if gate.shape[-1] % 2:
            raise ValueError(f"a fused gate_up needs an even last axis, got {gate.shape}")
        return mx.split(gate, 2, axis=-1)
    if gate.shape != up.shape:
        raise ValueError(f"gate {gate.shape} and up {up.shape} differ")
    return gate, up


def gated_activation_reference(gate: mx.array, up: mx.array | None = None, kind: str = "silu"):
    """act(gate) * up in fp32, returned in gate's dtype. ``up`` None: ``gate`` is the fused
    (..., 2 I) gate_up projection, gate first. silu(g) = g * sigmoid(g); gelu_tanh(g) =
    0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))) (PyTorch's approximate="tanh")."""
    if kind not in ACTIVATIONS:
        raise ValueError(f"activation {kind!r} is not one of {ACTIVATIONS}")
    g, u = _split(gate, up)
    return (_act(g.astype(mx.float32), kind) * u.astype(mx.float32)).astype(gate.dtype)


# Template: T, ACT (0 silu, 1 gelu_tanh), FUSED (gate_up rows of 2 I). params: n outputs, I.
_BODY = """
  // One thread per output element (row, i): gate and up from their own arrays, or from one
  // fused row [gate (I) | up (I)].
  const uint64_t e = uint64_t(gid_x) * tg_size + tid;
  if (e >= uint64_t(params[0])) return;
  const uint I = params[1];
  const uint64_t row = e / I;
  const uint64_t gi = FUSED ? row * I + e : e;  // fused: row r starts at 2 I r
  const float g = to_float(gate[gi]);
  const float u = to_float(FUSED ? gate[gi + I] : up[e]);
  float a;
  if (ACT == 0) {
    a = g / (1.0f + exp_f(-g));
  } else {
    a = 0.5f * g * (1.0f + tanh_f(0.7978845608028654f * (g + 0.044715f * g * g * g)));
  }
  out[e] = from_float<T>(a * u);
"""

_kernel = Kernel(
    "gated_activation",
    inputs=["gate", "up", "params"],
    outputs=["out"],
    body=_BODY,
    examples=[
        Example({"gate": t, "up": t, "params": (mx.uint32, 2)}, {"out": t},
                {"T": t, "ACT": act, "FUSED": fused})
        for t, act, fused in ((mx.bfloat16, 1, 0), (mx.float16, 0, 1), (mx.float32, 1, 1))
    ],
)  # fmt: skip

_FLOATS = (mx.float32, mx.float16, mx.bfloat16)


def gated_activation(gate: mx.array, up: mx.array | None = None, kind: str = "silu") -> mx.array:
    """Dispatcher: one kernel (no split copy for a fused gate_up), else the reference."""
    be = backend()
    if be is not None:
        usig = None if up is None else (up.shape, up.dtype)
        plan = _plan(_kernel, be, gate.shape, gate.dtype, usig, kind)
        if plan is not None:
            launch, params = plan
            return launch(inputs=[gate, gate if up is None else up, params])[0]
    return gated_activation_reference(gate, up, kind)


@lru_cache(maxsize=256)
def _plan(kernel, be, shape, dtype, usig, kind):
    """(launcher, params) for one call shape, or None for the reference; raises for caller
    errors (unknown activation, mismatched shapes)."""
    if kind not in ACTIVATIONS:
        raise ValueError(f"activation {kind!r} is not one of {ACTIVATIONS}")
    fused = usig is None
    if fused and shape[-1] % 2:
        raise ValueError(f"a fused gate_up needs an even last axis, got {shape}")
    if not fused and usig[0] != shape:
        raise ValueError(f"gate {shape} and up {usig[0]} differ")
    I = shape[-1] // 2 if fused else shape[-1]
    n = math.prod(shape) // (2 if fused else 1)
    if dtype not in _FLOATS or (not fused and usig[1] != dtype) or not 0 < n < 2**32:
        return None
    launch = kernel.launcher(
        [dtype, dtype, mx.uint32],
        grid=(n,),
        threadgroup=(256,),
        output_shapes=[(*shape[:-1], I)],
        output_dtypes=[dtype],
        template={"T": dtype, "ACT": ACTIVATIONS.index(kind), "FUSED": fused},
        backend=be,
    )
    return launch, device_array([n, I], mx.uint32)


def silu_mul(gate: mx.array, up: mx.array | None = None) -> mx.array:
    """silu(gate) * up (``up`` None: fused gate_up)."""
    return gated_activation(gate, up, "silu")


def gelu_tanh_mul(gate: mx.array, up: mx.array | None = None) -> mx.array:
    """gelu_tanh(gate) * up (``up`` None: fused gate_up)."""
    return gated_activation(gate, up, "gelu_tanh")
