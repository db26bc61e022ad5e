"""Dequantization of GGUF weights (rows or tile-major) into the f16 matrix the prefill GEMM reads."""
