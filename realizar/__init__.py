"""realizar: an LLM inference engine driving raw PTX through the CUDA driver API."""

__version__ = "0.1.0"
