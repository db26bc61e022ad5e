"""Per-element and per-row layer kernels: maps, reductions, RMSNorm, RoPE, embedding lookup, streaming read."""
