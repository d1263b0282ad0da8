"""Launch configurations of the GGML mat-vec kernels at M = 1: (V, R, U, W max) per shape.

V: kernel variant (0 fp32 decode, 1 packed fp16 on fp16 x, 2 packed fp16 on bf16 x); R: rows
per threadgroup; U: steps per run; W: SIMD groups (cut to the runs a row has). Keys: (block
family "32" / "256" or type name, long rows = K >= 8192). Data only, one line per entry so that
the sweep's printed lines (bench/qmatmul.py --sweep) replace them; measurements and how each
entry was found: docs/kernel_notes.md ("Tuning tables").
"""

from __future__ import annotations

LaunchLine = tuple[int, int, int, int]  # (V, R, U, W max)

# fp16 x, per block family: V = 1 won every 4-bit shape of the H200 sweep.
DEFAULTS: dict[tuple[str, bool], LaunchLine] = {
    ("32", False): (1, 8, 1, 4),  # Q4_0, Q4_1, Q5_0, Q5_1, Q8_0
    ("32", True): (1, 4, 1, 8),
    ("256", False): (1, 4, 1, 4),  # K-quants
    ("256", True): (1, 2, 1, 8),
}

# fp16 x, per type: replace DEFAULTS. Q3_K: the packed decode of 4-weight groups costs more
# instructions; Q8_0: its fp16 group sums overflow once |x| reaches ~128, so it stays on V = 0.
TYPE_DEFAULTS: dict[tuple[str, bool], LaunchLine] = {
    ("Q4_0", True): (1, 2, 4, 8),
    ("Q4_K", False): (1, 4, 2, 1),  # measured on the lm_head shape 262144x2816
    ("Q8_0", False): (0, 4, 2, 4),
    ("Q8_0", True): (0, 2, 4, 8),
    ("Q3_K", False): (0, 4, 1, 4),
    ("Q3_K", True): (0, 2, 1, 8),
    ("Q6_K", False): (0, 4, 1, 4),  # V = 1 won at 14336x4096, the lm_head shape is unswept
    ("Q6_K", True): (1, 2, 1, 8),
}

# fp32 and bf16 x, per block family: the fp32 decode (V = 0) and its own measured bests.
V0_DEFAULTS: dict[tuple[str, bool], LaunchLine] = {
    ("32", False): (0, 4, 2, 4),
    ("32", True): (0, 2, 4, 8),
    ("256", False): (0, 4, 1, 4),
    ("256", True): (0, 2, 1, 8),
}

# bf16 x (what the models run on a GPU), per type or block family: replace V0_DEFAULTS. Only
# swept types are listed (V = 2 won three of the four 4-bit shapes); others keep V = 0.
BF16_DEFAULTS: dict[tuple[str, bool], LaunchLine] = {
    ("Q4_0", False): (2, 4, 2, 4),
    ("Q4_0", True): (2, 2, 4, 8),
    ("Q4_K", False): (2, 4, 1, 2),
    ("Q4_K", True): (2, 4, 1, 7),
}
