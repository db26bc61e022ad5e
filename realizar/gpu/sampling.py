"""Per-row sampling on the device (``sample_rows`` kernel): one launch for B rows, each with its own
temperature / top-k / top-p / seed / step read from a device buffer, so a captured graph serves any mix
of requests; the host reads back 4 bytes a row. ``pack_specs`` builds that buffer's contents."""

from __future__ import annotations

from typing import Any

import numpy as np

from ptx_gen.kernels.sampling.feed import NO_SOURCE
from ptx_gen.kernels.sampling.sample_rows import SPEC_WORDS
from realizar.errors import ShapeError
from realizar.gpu.dispatch import Dispatcher
from realizar.gpu.policy.sampling import SAMPLE_BLOCK
from realizar.sampling import SPEC_WORDS as _HOST_WORDS, pack_specs

assert _HOST_WORDS == SPEC_WORDS  # (realizar.sampling packs the rows the kernel reads)

__all__ = ["NO_SOURCE", "SampleOps", "pack_specs", "SPEC_WORDS", "SAMPLE_BLOCK"]

class SampleOps(Dispatcher):
    def sample_rows(self, logits: Any, specs: Any, out: Any, rows: int, vocab: int, ld: int | None = None,
                    stream: Any = None) -> None:
        """out[r] (u32) = the token drawn for row r of ``logits`` (f32 rows ``ld`` apart, default
        ``vocab``) under the packed spec r of ``specs`` (see :func:`pack_specs`), r < ``rows``.
        Same draw as :func:`realizar.sampling.sample_rows` (top-p cuts within rounding aside)."""
        rows, vocab = self.check_int("rows", rows), self.check_int("vocab", vocab)
        ld = vocab if ld is None else self.check_int("ld", ld)
        if rows < 1 or vocab < 1:
            raise ShapeError(f"expected rows >= 1 and vocab >= 1, got rows={rows}, vocab={vocab}")
        if vocab >= 1 << 31 or ld < vocab or ld * (rows - 1) + vocab >= 1 << 32:
            raise ShapeError(f"expected vocab < 2**31, ld >= vocab and rows*ld < 2**32, got vocab={vocab}, "
                             f"ld={ld}, rows={rows}")
        kern = self.kernel("sample_rows", block=SAMPLE_BLOCK)
        self.launch(kern, rows, {
            "logits": self.addr(logits, ld * (rows - 1) + vocab, "logits", np.float32, align=4),
            "ld": ld,
            "specs": self.addr(specs, rows * SPEC_WORDS, "specs", np.uint32, align=4),
            "out": self.addr(out, rows, "out", np.uint32, align=4),
            "vocab": vocab,
        }, stream)

    def feed_tokens(self, ids: Any, src: Any, tokens: Any, n: int, n_tokens: int, stream: Any = None) -> None:
        """ids[r] = tokens[src[r]] for r < ``n`` where src[r] is not ``NO_SOURCE`` (u32 arrays; ``tokens``
        holds ``n_tokens``: every src[r] other than NO_SOURCE must be below it, which the caller checks)."""
        n, n_tokens = self.check_int("n", n), self.check_int("n_tokens", n_tokens)
        if n < 1 or n_tokens < 1:
            raise ShapeError(f"expected n >= 1 and n_tokens >= 1, got n={n}, n_tokens={n_tokens}")
        kern = self.kernel("feed_tokens", block=256 if n > 64 else 64)
        self.launch(kern, -(-n // kern.meta["block"]), {
            "ids": self.addr(ids, n, "ids", np.uint32, align=4), "src": self.addr(src, n, "src", np.uint32, align=4),
            "tokens": self.addr(tokens, n_tokens, "tokens", np.uint32, align=4), "n": n,
        }, stream)
