"""Elementwise kernels: SwiGLU, residual add, bias add."""

from __future__ import annotations

from typing import Any

import numpy as np

from realizar.gpu.dispatch import Dispatcher

__all__ = ["ElementwiseOps"]


class ElementwiseOps(Dispatcher):
    def _elementwise(self, name: str, values: dict, n: int, stream) -> None:
        # float4 accesses where every address is 16-byte aligned
        vec = 4 if all(v % 16 == 0 for k_, v in values.items() if k_ != "n") else 1
        kern = self.kernel(name, vec=vec)
        self.launch(kern, max(1, -(-n // (kern.meta["block"] * vec))), values, stream)

    def swiglu(self, gate: Any, up: Any, out: Any, n: int, stream: Any = None, out_f16: bool = False) -> None:
        """out = silu(gate) * up over n elements (out may alias gate or up); ``out_f16``: out is f16."""
        n = self.check_int("n", n)
        values = {"gate": self.addr(gate, n, "gate", align=4), "up": self.addr(up, n, "up", align=4),
                  "out": self.addr(out, n, "out", np.float16 if out_f16 else np.float32, align=2 if out_f16 else 4),
                  "n": n}
        if not out_f16:
            self._elementwise("swiglu", values, n, stream)
            return
        # four values a thread where the f32 inputs allow 16-byte loads and the f16 output 8-byte stores
        vec = 4 if values["gate"] % 16 == 0 and values["up"] % 16 == 0 and values["out"] % 8 == 0 else 1
        kern = self.kernel("swiglu_f16", vec=vec)
        self.launch(kern, max(1, -(-n // (kern.meta["block"] * vec))), values, stream)

    def residual_add(self, a: Any, b: Any, out: Any, n: int, stream: Any = None) -> None:
        """out = a + b over n elements (out may alias a or b)."""
        n = self.check_int("n", n)
        self._elementwise("residual_add", {"a": self.addr(a, n, "a", align=4), "b": self.addr(b, n, "b", align=4),
                                           "out": self.addr(out, n, "out", align=4), "n": n}, n, stream)

    def bias_add(self, y: Any, bias: Any, n_cols: int, n_tokens: int = 1, stream: Any = None) -> None:
        """y[t, :] += bias for t < n_tokens."""
        n_cols, n_tokens = self.check_int("n_cols", n_cols), self.check_int("n_tokens", n_tokens)
        kern = self.kernel("bias_add")
        values = {"y": self.addr(y, n_cols * n_tokens, "y", align=4), "bias": self.addr(bias, n_cols, "bias", align=4),
                  "n_cols": n_cols}
        self.launch(kern, (-(-n_cols // kern.meta["block"]), n_tokens), values, stream)
