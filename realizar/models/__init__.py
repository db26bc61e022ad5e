"""Model formats (GGUF, safetensors), configuration and the NumPy reference model."""
