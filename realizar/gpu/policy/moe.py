"""The mixture-of-experts launch policy: when a batch's experts run as one grouped GEMM over the pairs sorted by
expert (``moe_group`` + ``gemm_q_experts``) instead of one expert GEMV per (token, slot) pair, and the token tile
of that GEMM.

Read by :mod:`realizar.gpu.decoder` and :mod:`realizar.gpu.moe`. Measured with ``tools/bench_moe.py --grouped-min``
(the threshold) and ``tools/bench_moe.py`` at the Mixtral-8x7B shape (the largest tile); the figures are in
docs/performance.md.
"""

from __future__ import annotations

# batches of at least this many rows group their pairs by expert (fewer: the GEMV reads an expert per pair)
MOE_GROUPED_MIN_ROWS = 2
# the grouped GEMM's token tile: the pairs an expert gets on average, rounded up to a tile size, within these
MOE_TILE_MIN, MOE_TILE_MAX = 8, 64
