"""Launch configurations of the GGML mat-vec kernels: (V, R, U, W max) per shape at M = 1, and
the rows per threadgroup R at MT = 2..16 rows of x (MT_ROWS).

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

# MT > 1 rows of x (decode batches, speculative verifies; M rounded up to MT = 2, 4, 8, 16):
# R, rows per threadgroup, by (MT, type name or block family, K >= 8192). V, U and W stay the
# M = 1 line's: they fix each column's order of operations, so a row's output bits stay those it
# has alone (row parity). Each column's x work (load, convert, V = 2's per-group scale) is paid
# once per threadgroup and shared by its R rows, so R grows with MT, up to qmatmul.MAX_ACC // MT
# accumulators per lane. Unswept guesses from register counts (docs/kernel_notes.md, "Rows of x
# at MT > 1"); `bench/qmatmul.py --rows M --sweep` prints lines to replace them.
MT_ROWS: dict[tuple[int, str, bool], int] = {
    (2, "32", False): 8,  # Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: 2-3 words of raw block per row
    (2, "32", True): 8,
    (4, "32", False): 8,
    (4, "32", True): 8,
    (8, "32", False): 8,
    (8, "32", True): 8,
    (16, "32", False): 4,
    (16, "32", True): 4,
    (2, "256", False): 8,  # Q2_K, Q3_K, Q6_K: up to 8 words of raw block per row
    (2, "256", True): 8,
    (4, "256", False): 8,
    (4, "256", True): 8,
    (8, "256", False): 4,
    (8, "256", True): 4,
    (16, "256", False): 4,
    (16, "256", True): 4,
    (2, "Q4_K", False): 4,  # Q4_K, Q5_K: 12-14 words of raw block per row and step
    (2, "Q4_K", True): 4,
    (4, "Q4_K", False): 4,
    (4, "Q4_K", True): 4,
    (8, "Q4_K", False): 4,
    (8, "Q4_K", True): 4,
    (16, "Q4_K", False): 4,
    (16, "Q4_K", True): 4,
    (2, "Q5_K", False): 4,
    (2, "Q5_K", True): 4,
    (4, "Q5_K", False): 4,
    (4, "Q5_K", True): 4,
    (8, "Q5_K", False): 4,
    (8, "Q5_K", True): 4,
    (16, "Q5_K", False): 4,
    (16, "Q5_K", True): 4,
}
