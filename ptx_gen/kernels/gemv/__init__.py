"""Decode GEMV on GGUF weights (SIMT and tensor cores), its plans, and the quantized weight layouts it decodes."""
