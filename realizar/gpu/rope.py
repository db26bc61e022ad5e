"""RoPE on Q and K in place (any number of tokens). The inference paths fuse RoPE with the KV-cache
append instead: :meth:`realizar.gpu.paged_kv.PagedKVCache.append_decode` and ``append_rows``."""

from __future__ import annotations

from typing import Any

import numpy as np

from ptx_gen.kernels.elementwise.rope import inv_freq_table
from realizar.gpu.dispatch import Dispatcher, is_buffer_arg

__all__ = ["RopeOps", "inv_freq_table"]


class RopeOps(Dispatcher):
    def rope(self, q: Any, k: Any, inv_freq: Any, pos: Any, n_q: int, n_kv: int, head_dim: int,
             rot_dim: int | None = None, neox: bool = False, n_tokens: int = 1, stream: Any = None) -> None:
        """Rotate Q [n_tokens, n_q, head_dim] and K [n_tokens, n_kv, head_dim] in place; ``pos`` is the
        first token's position (int: token t at pos + t) or a u32 buffer of one position per token."""
        n_q, n_kv = self.check_int("n_q", n_q), self.check_int("n_kv", n_kv)
        head_dim, n_tokens = self.check_int("head_dim", head_dim), self.check_int("n_tokens", n_tokens)
        rot_dim = head_dim if rot_dim is None else self.check_int("rot_dim", rot_dim)
        from_buf = is_buffer_arg(pos)
        kern = self.kernel("rope", head_dim=head_dim, rot_dim=rot_dim, neox=bool(neox), pos_from_buffer=from_buf)
        values = {"q": self.addr(q, n_tokens * n_q * head_dim, "q", align=8),
                  "k": self.addr(k, n_tokens * n_kv * head_dim, "k", align=8),
                  "inv_freq": self.addr(inv_freq, rot_dim // 2, "inv_freq", align=4)}
        if from_buf:
            values["positions"] = self.addr(pos, n_tokens, "pos", np.uint32, align=4)
        else:
            values["pos"] = self.check_int("pos", pos, lo=0)
        values["n_q"], values["n_kv"] = n_q, n_kv
        grid = (-(-(n_q + n_kv) * (rot_dim // 2) // kern.meta["block"]), n_tokens)
        self.launch(kern, grid, values, stream)
