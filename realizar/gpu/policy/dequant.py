"""The f16 dequantization's launch constants, read by :mod:`realizar.gpu.dequant` (``dequant_warps``).

Tuned with ``tools/bench_dequant.py --sweep``; the figures are in docs/results/ (bench_dequant_*).
"""

# warps per CTA for the dense types (F32, F16, BF16)
DEQUANT_WARPS_DENSE = 4
# warps per CTA for the block types
DEQUANT_WARPS_BLOCKS = 1
