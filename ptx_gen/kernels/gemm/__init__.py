"""GEMM on tensor cores: f16 weights for prefill (gemm_mma), quantized weights for batched decode (gemm_q)."""
