"""Example launches of the sampling kernels for the emulator (see :mod:`ptx_gen.emulator.examples`)."""

from __future__ import annotations

import numpy as np

from ptx_gen.emulator.examples import Example, _f32, example


@example("sample_rows")
def _sample_rows(k, sizes, rng) -> Example:
    from ptx_gen.kernels.sampling.sample_rows import SPEC_WORDS

    vocab = sizes.get("vocab", 300)
    ld = sizes.get("ld", vocab + 4)
    # rows as realizar.gpu.sampling.pack_specs packs them: (temperature, top_k, top_p, seed, step)
    rows = [(0.0, 0, 1.0, 0, 0), (0.8, 20, 1.0, 1234, 7), (1.0, 0, 0.9, 2**40 + 5, 3), (0.7, 50, 0.8, 99, 1)]
    specs = np.zeros((len(rows), SPEC_WORDS), np.uint32)
    f = specs.view(np.float32)
    for i, (temp, top_k, top_p, seed, step) in enumerate(rows):
        f[i, 0], specs[i, 1], f[i, 2] = temp, top_k, top_p
        specs[i, 3], specs[i, 4], specs[i, 5] = seed & 0xFFFFFFFF, seed >> 32, step
    params = {"logits": _f32(rng, len(rows) * ld, scale=3.0), "ld": ld, "specs": specs.reshape(-1),
              "out": np.full(len(rows), 0xFFFFFFFF, np.uint32), "vocab": vocab}
    return Example(params, (len(rows),), (k.meta["block"],), ("out",))


@example("feed_tokens")
def _feed_tokens(k, sizes, rng) -> Example:
    from ptx_gen.kernels.sampling.feed import NO_SOURCE

    n, n_tok = sizes.get("n", 77), sizes.get("n_tokens", 64)
    src = np.where(rng.random(n) < 0.7, rng.integers(0, n_tok, n), NO_SOURCE).astype(np.uint32)
    params = {"ids": rng.integers(0, 1 << 20, n).astype(np.uint32), "src": src,
              "tokens": rng.integers(0, 1 << 20, n_tok).astype(np.uint32), "n": n}
    return Example(params, (-(-n // k.meta["block"]),), (k.meta["block"],), ("ids",))
