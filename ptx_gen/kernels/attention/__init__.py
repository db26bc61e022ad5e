"""Attention: prefill (SIMT, tensor cores, paged) and decode (flash decoding, incremental, paged) kernels."""
