"""The GEMV's launch tables: the SIMT kernel's thresholds and fixed shapes, the tensor-core kernel's balanced
pick's candidates and scoring, and per type the shapes that replace that pick on given devices and grids.

Read by :mod:`realizar.gpu.gemv` (``gemv_config``, ``mma_config``, ``GemvOps.mma_config`` /
``mma_cols_config`` / ``weight_layout``). Tuned with ``tools/bench_gemv.py --sweep`` / ``--mma-sweep``;
the figures behind each entry are in docs/performance.md (GEMV: "Why each pick").
"""

from __future__ import annotations

from realizar.gpu.policy.shapes import GemvConfig, MmaConfig

# ---- the SIMT GEMV (gemv_config) ----------------------------------------------------------------------------

# output rows per warp by output rows per SM: the first (rows per SM at least, rows per warp) that applies
SIMT_ROWS_PER_WARP = ((48, 4), (16, 2), (0, 1))
# warps per CTA of the SIMT GEMV (more where more warps split K)
SIMT_WARPS = 4
# K is split until the grid has this many warps per SM: about one wave of the warps a split kernel keeps resident
TARGET_WARPS_PER_SM = 24
# quantized GEMVs of at least this many output rows per SM take the fixed shapes below (the large decode shapes)
SIMT_LARGE_ROWS_PER_SM = 16
# those fixed shapes per type: the first (rounds of 256 values a row at least, shape) that applies (none: the rule)
SIMT_LARGE = {"Q6_K": ((32, GemvConfig(2, 8, 8)), (16, GemvConfig(4, 4, 4)))}
# likewise for the quantized types SIMT_LARGE does not name
SIMT_LARGE_DEFAULT = ((32, GemvConfig(4, 4, 2)), (0, GemvConfig(4, 4, 1)))
# Q6_K GEMVs of at least this many rows per SM stay on the SIMT kernel (its tensor-core warps convert x per row tile)
Q6K_MANY_ROWS_PER_SM = 256
# and there take these shapes instead of SIMT_LARGE's (fewer K slices)
SIMT_LARGE_MANY_ROWS = {"Q6_K": ((32, GemvConfig(2, 8, 8)), (16, GemvConfig(4, 4, 2)))}

# ---- the tensor-core GEMV's balanced pick (mma_config) ------------------------------------------------------

# (warps along the rows, K parts) of the 8-warp CTAs the balanced pick chooses among
MMA_CTA_SPLITS = ((1, 8), (2, 4), (4, 2), (8, 1))
# ring depth of the balanced pick
MMA_STAGES = 2
# the balanced pick's cost of each further CTA on an SM (one CTA streaming many units a warp beats several short ones)
MMA_EXTRA_CTA = 0.1
# scores this close to the best tie; among ties: 32-row warps, then fewer CTAs per SM
MMA_SCORE_SLACK = 0.02
# types the tensor-core kernel handles but the dispatcher leaves on the SIMT kernel (a forced MmaConfig still runs)
MMA_SLOWER: tuple[str, ...] = ()
# a grid whose mean SM load is below this share of the busiest SM's counts as unbalanced
B32_BALANCE = 0.9
# where the balanced pick is unbalanced, the 32-value block types' smaller CTAs (several an SM)
B32_UNBALANCED = {"Q4_0": MmaConfig(2, 4, 2, 2), "Q5_0": MmaConfig(1, 4, 2, 1), "Q5_1": MmaConfig(1, 4, 2, 1)}

# ---- GemvOps.mma_config: tile-major weights on the device ----------------------------------------------------

# sm_90, tile-major, unbalanced grid: smaller CTAs (Q4_1 since its tile-major rows are swizzled)
TILED_UNBALANCED = {"Q4_K": MmaConfig(1, 4, 2, 2), "Q4_1": MmaConfig(2, 4, 2, 2)}
# sm_90, tile-major, one CTA of one 32-row tile per SM: 16-warp CTAs with bulk copies and the late trigger
WIDE_BALANCED = {"Q4_K": MmaConfig(1, 16, 2, 2, bulk=True, solo=True, late=True)}
# the wide and fast-DRAM picks apply only where each warp streams at least this many units
WIDE_MIN_UNITS = 2
# tile-major, one 32-row tile a CTA, DRAM not fast for the SMs: types that take 16-row warps there
B32_ONE_TILE = ("Q4_0", "Q5_0")
# and only where each warp streams at least this many units
B32_ONE_TILE_UNITS = 4
# sm_90 tile-major: types whose warps always fill their rings with bulk copies
BULK_ALWAYS = ("Q6_K",)
# sm_90 tile-major: types whose warps use bulk copies in CTAs of one row tile
BULK_ROW_TILE = ("Q4_K", "Q5_K")
# sm_90: warps streaming at most this many units fill their rings with bulk copies (on GGUF rows: not Q6_K)
BULK_MAX_UNITS = 2
# sm_90 tile-major: the types whose warps do so
BULK_FEW_UNITS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
# types kept in GGUF rows where their pick uses bulk copies (one bulk copy per row and unit streams faster)
ROWS_WHEN_BULK = ("Q4_K", "Q5_K")

# ---- where the DRAM is fast for the SMs (GemvOps.fast_dram, sm_90) -------------------------------------------

# DRAM bytes per SM clock at or above which a device counts as fast_dram (more instructions per byte matter)
FAST_DRAM_BYTES_PER_SM_CLOCK = 16.0
# there, the 32-value block types whose CTAs of one 32-row tile fill their rings with bulk copies
FAST_DRAM_BULK = ("Q4_0", "Q5_0", "Q4_1", "Q5_1")
# there, unbalanced grids: shapes whose whole grid fits the SMs' shared memory at once (the columns kernel's base)
FAST_DRAM_UNBALANCED = {"Q5_K": MmaConfig(1, 4, 2, 2), "Q5_0": MmaConfig(2, 2, 3, 2), "Q5_1": MmaConfig(1, 3, 2, 2),
                        "Q6_K": MmaConfig(4, 2, 2, 1)}
# there, one CTA of one 32-row tile per SM: wider CTAs, or for Q6_K a deeper ring (the columns kernel's base)
FAST_DRAM_WIDE = {"Q5_K": MmaConfig(1, 12, 2, 2, bulk=True, solo=True, late=True),
                  "Q6_K": MmaConfig(1, 8, 3, 2, bulk=True, solo=True),
                  "Q4_0": MmaConfig(1, 16, 2, 2, bulk=True, solo=True, late=True),
                  "Q4_1": MmaConfig(1, 16, 2, 2, bulk=True, solo=True, late=True)}
# the one-column GEMV's picks for unbalanced grids there: one ring stage before the grid wait (first over the above)
FAST_DRAM_AHEAD_UNBALANCED = {"Q4_K": MmaConfig(1, 4, 2, 2, bulk=True, ahead=1),
                              "Q4_0": MmaConfig(2, 4, 2, 2, bulk=True, ahead=1),
                              "Q5_K": MmaConfig(2, 4, 2, 2, bulk=True, ahead=1),
                              "Q5_0": MmaConfig(1, 4, 2, 2, bulk=True, ahead=1),
                              "Q6_K": MmaConfig(1, 4, 2, 1, ahead=1),
                              "Q8_0": MmaConfig(1, 3, 2, 1, bulk=True, ahead=1)}
# the one-column GEMV's picks for one tile a CTA and an SM there: one ring stage before the grid wait
FAST_DRAM_AHEAD_WIDE = {"Q4_K": MmaConfig(1, 16, 2, 2, bulk=True, solo=True, late=True, ahead=1),
                        "Q4_0": MmaConfig(1, 16, 2, 2, bulk=True, solo=True, late=True, ahead=1),
                        "Q4_1": MmaConfig(1, 16, 2, 2, bulk=True, solo=True, late=True, ahead=1),
                        "Q5_K": MmaConfig(1, 12, 2, 2, bulk=True, solo=True, late=True, ahead=1),
                        "Q5_0": MmaConfig(1, 12, 2, 2, bulk=True, solo=True, late=True, ahead=1),
                        "Q5_1": MmaConfig(1, 12, 2, 2, bulk=True, solo=True, late=True, ahead=1),
                        "Q8_0": MmaConfig(1, 8, 2, 2, bulk=True, solo=True, ahead=1)}
# (no pick asks for L2 prefetches past the ring, MmaConfig.l2pre: faster GEMV after GEMV, slower in the decode step)

# ---- the columns kernel (GemvOps.mma_cols_config, gemv_cols) --------------------------------------------------

# warps per CTA at most for several columns of x (each column's accumulators take registers)
COLS_MAX_WARPS = 8
# 32-row warps up to this many columns, per type (more would spill); 16-row warps beyond
COLS_WIDE_TILES = {"Q4_K": 4, "Q5_K": 4, "Q6_K": 4, "Q4_0": 4, "Q4_1": 4, "Q5_0": 4, "Q5_1": 4, "Q8_0": 2}
# likewise before sm_90 (cp.async rings) on tile-major weights, where it is fewer
COLS_WIDE_TILES_CP_ASYNC = {"Q6_K": 2}
# the most columns one launch takes, per type (more spill); gemv_cols runs more in several launches
COLS_PER_LAUNCH = {"Q6_K": 4}
