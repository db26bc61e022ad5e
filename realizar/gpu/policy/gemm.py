"""The GEMMs' launch tables: the f16 GEMM's CTA tiles, the quantized small-M GEMM's thresholds and the int8
batch GEMM's tiles.

Read by :mod:`realizar.gpu.gemm` (``gemm_config``, ``gemm_q_config``). Tuned with ``tools/bench_gemm.py``
and ``tools/bench_gemm_q.py``; the figures are in docs/performance.md and docs/results/.
"""

from __future__ import annotations

from realizar.gpu.policy.shapes import GemmConfig, X8Config

# ---- the f16 GEMM (gemm_config) -----------------------------------------------------------------------------

# the tiles the f16 GEMM chooses among, largest first (the largest that still gives every SM a CTA)
GEMM_TILES = (GemmConfig(128, 128, 2, 2, 3), GemmConfig(64, 128, 1, 4, 4), GemmConfig(64, 64, 2, 2, 4))
# up to this many tokens (a batched decode step) the f16 GEMM chooses among the small-M tiles instead
GEMM_SMALL_M = 64
# the small-M tiles: no 128-token tiles, and 32-token tiles with a deeper ring for weights too narrow to fill the SMs
GEMM_SMALL_M_TILES = (GemmConfig(64, 128, 1, 4, 4), GemmConfig(64, 64, 2, 2, 6), GemmConfig(32, 64, 1, 2, 6))
# the tile taken where none of those fits the device's shared memory
GEMM_FALLBACK_TILE = GemmConfig(64, 64, 2, 2, 2)

# ---- the quantized small-M GEMM (gemm_q_config) ---------------------------------------------------------------

# K is split until a launch has this many warps per SM (a warp keeps stages - 1 chunks in flight)
GEMM_Q_WARPS_PER_SM = 8
# K parts at most by token tile: the first (tokens a launch at least, parts) that applies (accumulators take registers)
GEMM_Q_MAX_KPARTS = ((128, 1), (64, 2), (0, 4))
# warps of a CTA, shared among its K parts
GEMM_Q_CTA_WARPS = 4
# ring depths tried, deepest first (the first whose CTA fits twice in the shared memory, else once)
GEMM_Q_STAGES = (4, 3, 2)

# ---- the int8 batch GEMM over x8 activations (x8_config) ---------------------------------------------------

# (most tokens, CTA shape): the first entry whose token count covers m (None: any m)
X8_TILES = ((None, X8Config(4, 1, 4, 3)),)
# ring depths tried where the chosen one does not fit the device's shared memory, deepest first; then fewer
# weight tiles a CTA (wn halved)
X8_STAGES = (3, 2)

# ---- the warpgroup-MMA GEMM over quantized weights (wg_config, sm_90a) --------------------------------------

# token tiles tried, largest first (none of twice m or more): the first whose launch has WG_MIN_WAVE x sm_count
# CTAs, else the smallest
WG_MTS = (256, 128, 64, 32)
WG_MIN_WAVE = 0.7
# "wide" launches (at least this many 64-row warpgroups of 128-token tiles per SM: gate/up, or any weight at
# enough tokens) put two row groups in a CTA, which then reads the tokens' X once for both; narrower ones split K
# in two instead (H200, docs/results/bench_gemm_wg_h200.md)
WG_WIDE = 1.4
# weight ring depths tried, shallowest first (the first that fits the shared memory)
WG_STAGES = (2, 3)
# 32-value blocks decoded per MMA group (two independent decode chains per warp)
WG_UNROLL = 2
# above this many rows the Linear takes the warpgroup GEMM even where an f16 copy of the weight is kept
# (H200, 8B / 1B batched decode: f16 copy ahead at 64 rows, the quantized weights ahead at 128)
WG_OVER_F16_ROWS = 64

# ---- the warp-specialized GEMM over quantized weights (ws_config, sm_90a) -------------------------------------

# token tiles tried, largest first (none above m): the first whose launch has WS_MIN_WAVE x sm_count CTAs, else the
# smallest (H200, docs/results/bench_gemm_ws_h200.md: narrow weights at 128 tokens are faster on 64-token tiles)
WS_MTS = (256, 128, 64)
# a token tile is tried where m fills more than this share of it: at m = 192 one 256-token tile instead of a 128-token
# tile and a half-empty one (the same MMA columns, each weight decoded once instead of twice)
WS_TILE_FILL = 0.5
WS_MIN_WAVE = 0.5
# two consumer warpgroups a CTA (128 rows sharing the tokens' B tiles) on 128-token tiles where the launch still has
# this many CTAs per SM (the fused gate/up at 128 tokens)
WS_WIDE = 1.5
# two consumer warpgroups on 256-token tiles (128 weight rows, the tokens' X read once for both; one producer warpgroup)
# where the launch still has this many CTAs per SM
WS_WIDE_256 = 0.7
# A / B ring depths tried, deepest first (the first that fits the shared memory). H200, 6 first: 8B Q4_K batched decode
# 1.008x / 1.003x the step at B = 128 / 256, but 1B at 256 rows 0.93x (session 32), so not taken
WS_STAGES = (4, 3, 2)
# ring depths tried instead of WS_STAGES on some launch shapes: ((token tile, consumer warpgroups, K parts), depths)
# pairs. H200, 6 stages on one-warpgroup 128-token tiles with K whole (8B qkv at 96-128 rows, 1B qkv at 192-256 and
# gate/up at 96-128): 8B 1.009x / 1.005x the step at B = 96 / 128, 1B 1.017x / 1.004x / 1.009x / 1.003x at 96 / 128 /
# 192 / 256 (docs/results/bench_serving_ws_ab_h200.md, session 34)
WS_STAGES_BY_TILE: tuple = (((128, 1, 1), (6, 4, 3, 2)),)
# producer warpgroups a strip tried, in order (each fills every psplit-th stage: the decode's latency shared among more
# warps), the first whose CTA keeps a consumer's registers and fits the shared memory with a ring of WS_STAGES. H200, 8B
# Q4_K batched decode: 2 and 4 slower everywhere (the step 0.987x / 0.955x at B = 128; session 31)
WS_PSPLIT = (1,)
# stages a producer warp stores before it fences them (fence.proxy.async waits for its stores) and announces them at once
# (below the ring's depth). H200, 8B Q4_K batched decode: 2 is 1.030x the step at B = 128, 1.015x at 256; 4 with
# 5-stage rings 1.019x / 1.010x (docs/results/bench_serving_ws_ab_h200.md, session 31)
WS_PFENCE = 2
# CTAs of a cluster that share each token tile's X (with WS_XTMA): each copies its part of a stage's box into all of
# them (TMA multicast), so a token tile's X leaves L2 once for that many weight tiles. H200, 8B Q4_K batched decode:
# 2 is 0.68x / 0.75x the step at B = 128 / 256 (session 32), so 1
WS_XCAST = 1
# the types of qstream.F16DEC_TYPES decoded in f16x2 arithmetic (each weight within about two f16 roundings of its
# exact value; H200, 8B Q4_K as the step runs it: 2-7% faster at every shape, docs/results/bench_gemm_ws_step_h200.md)
WS_F16DEC = True
# the tokens' X by a tensor map (one bulk copy a stage, off the load/store unit the producers' weight loads share;
# H200, 8B Q4_K as the step runs it: 1.0-1.4x at every shape, docs/results/bench_gemm_ws_step_h200.md)
WS_XTMA = True
# X's tensor map spans the rows the X buffer holds up to whole token tiles, so that no box reaches past it (rows past m
# are read as they are; their outputs are never written): the hardware fills a box's rows past the tensor with zeros
# far slower than it reads them (H200, 8B batched decode at 160 rows: 1.18x the step, 192 rows 1.03x)
XTMA_WHOLE_TILES = True
# K split over CTAs of two consumer warpgroups each (128 weight rows: each token tile's X read half as often as with one)
# where a launch of one consumer warpgroup a CTA would be chosen: the largest tile of WS_SPLIT_K_TILES that m fills
# (WS_TILE_FILL) and the first part count of WS_SPLIT_K_PARTS whose launch has at least WS_SPLIT_K CTAs per SM and whose
# parts each keep WS_SPLIT_MIN_CHUNKS chunks of K; 0: never. H200, 8B Q4_K batched decode, down on 128 rows of 128
# tokens in four parts and on 128 rows of 256 in two: 1.015x the step at B = 128, 1.025x at 256; on 256-token tiles too
# (WS_SPLIT_K_TILES (256, 128)) 0.98x at 256, for o too (WS_SPLIT_MIN_CHUNKS 4) 0.90x
# (docs/results/bench_serving_ws_ab_h200.md, session 31)
WS_SPLIT_K = 0.9
WS_SPLIT_K_TILES = (128,)
WS_SPLIT_K_PARTS = (2, 4)
WS_SPLIT_MIN_CHUNKS = 12
# where the largest token tile not above m is one of these and has too few CTAs (WS_MIN_WAVE), split K over two CTAs of
# that tile instead of taking a smaller tile (each weight decoded once a step instead of once a token tile). H200, 8B
# Q4_K batched decode: at 128 rows (o and down on a 128-token tile) 1.05x the step (session 30); with the epilogue
# through shared memory also at 256 rows (o and down on a 256-token tile) and for o at 128 (8 chunks a part): 1.012x
# the step at B = 128, 1.039x at 256 against (128,) with 12 chunks (docs/results/bench_serving_ws_ab_h200.md,
# session 32)
WS_SPLIT_FIRST = (256, 128)
# ... where each of the two parts keeps at least this many chunks of K (else, 1B's o at 128 rows:)
WS_SPLIT_FIRST_MIN_CHUNKS = 8
# a launch on the smallest token tile with fewer than this many CTAs per SM splits K in two (its CTAs small enough that
# two share an SM); 0: never. H200, both with WS_SPLIT_FIRST_MIN_CHUNKS, A/B'd on the batched decode step: 8B 1.008x /
# 1.035x at 96 / 128 rows, 1B 1.154x / 1.140x (docs/results/bench_serving_ws_ab_h200.md, session 31 call 8)
WS_SPLIT_SMALL = 2.0
# a launch of at most one CTA per SM takes at least half an SM's shared memory, so that no two of its CTAs share an SM:
# under programmatic dependent launch its CTAs are placed while the kernels before it still run, and CTAs small enough
# to pair up were packed onto few SMs (H200, 8B Q4_K 128-row step on gemm_ws: 11.6 ms, 9.6 ms with this;
# docs/results/profile_batch_128_h200.md)
WS_SOLE_CTA = True
# Stream-K: a launch of K whole (no split, no multicast, one CTA filling an SM's shared memory) of at least
# WS_STREAMK_MIN_ROWS tokens with more tiles than SMs whose last wave would leave more than this share of the SMs idle
# takes its tiles' chunks of K shared out evenly over one CTA an SM instead (a tile split between two CTAs summed by the
# later); 0: never. H200, 8B Q4_K (only gate/up qualifies there up to 512 rows): prefill pp512 1.035x / 1.023x / 1.025x
# in three alternations (gate/up at 512 tokens, 448 tiles), but the batched decode step 0.984-0.992x at B = 128-256
# (perhaps because the last wave's idle SMs start the down projection's CTAs early there, under programmatic dependent
# launch), 1B 1.002-1.009x (docs/results/bench_prefill_h200.md, session 34)
WS_STREAMK = 0.1
WS_STREAMK_MIN_ROWS = 512
# above this many rows the Linear takes the warp-specialized GEMM instead of gemm_wg (H200, 8B Q4_K batched decode with
# WS_SPLIT_FIRST and WS_TILE_FILL: gemm_ws 1.25x the step at 80 and 96 rows, even at 64, behind at 33 and 48;
# docs/results/bench_serving_ws_ab_h200.md, session 30)
WS_OVER_WG_ROWS = 64


def ws_shared_bytes(dyn_smem: int, ctas: int, sm_count: int, smem_per_sm: int) -> int:
    """The dynamic shared memory a gemm_ws launch of ``ctas`` CTAs asks for: its own need, or with
    :data:`WS_SOLE_CTA` and at most ``sm_count`` CTAs at least half of ``smem_per_sm`` (two CTAs, each with the 1 KB
    the system keeps a CTA, no longer fit an SM)."""
    if WS_SOLE_CTA and ctas <= sm_count:
        return max(dyn_smem, smem_per_sm // 2)
    return dyn_smem
