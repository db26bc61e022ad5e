"""Embedding lookup: dequantized rows of a GGUF table for token ids held on the device."""

from __future__ import annotations

from typing import Any

import numpy as np

from realizar.gpu.dispatch import Dispatcher
from realizar.gpu.weights import GpuWeight

__all__ = ["EmbeddingOps"]


class EmbeddingOps(Dispatcher):
    def embedding(self, table: GpuWeight, tokens: Any, out: Any, n_tokens: int = 1, stream: Any = None) -> None:
        """out[t] = dequantized row tokens[t] of ``table`` (u32 ids in a device buffer; ids past the
        vocabulary are clamped to the last row)."""
        table.require_rows("the embedding")
        n_tokens = self.check_int("n_tokens", n_tokens)
        warps = 4 if table.in_dim >= 1024 else 2
        kern = self.kernel("embedding", wtype=table.wtype, hidden=table.in_dim, warps=warps)
        values = {"table": table.ptr, "tokens": self.addr(tokens, n_tokens, "tokens", np.uint32, align=4),
                  "out": self.addr(out, n_tokens * table.in_dim, "out"), "vocab": table.out_dim}
        self.launch(kern, n_tokens, values, stream)
