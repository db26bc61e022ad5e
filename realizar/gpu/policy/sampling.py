"""The token-selection kernels' launch constants, read by :mod:`realizar.gpu.argmax` and
:mod:`realizar.gpu.sampling`."""

# threads per CTA of the argmax's first pass (each CTA takes at least this many values)
ARGMAX_BLOCK = 256
# threads of the argmax's final CTA, which reduces the partials
ARGMAX_FINAL_BLOCK = 1024
# CTAs of the argmax's first pass per SM (at most ARGMAX_SCRATCH in all)
ARGMAX_CTAS_PER_SM = 2
# threads per CTA of the per-row sampling kernel (one CTA a row)
SAMPLE_BLOCK = 1024
