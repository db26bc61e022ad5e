"""Small launches of every kernel family, run under compute-sanitizer (memcheck, racecheck).

    compute-sanitizer --tool memcheck python tools/sanitize_cases.py
    compute-sanitizer --tool racecheck python tools/sanitize_cases.py --small

Each case checks its own result against NumPy, so a kernel that misbehaves only under the sanitizer
is noticed too. Awkward sizes (not multiples of the block or vector width) are chosen on purpose.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from realizar import cuda  # noqa: E402

CASES = []


def case(fn):
    CASES.append(fn)
    return fn


@case
def basic_kernels(cache, rng, small):
    for n in (1, 7, 1023, 4099):
        a, b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
        for vec in (1, 4):
            k = cache.get("vector_add", vec=vec)
            with cuda.GpuBuffer.from_numpy(a) as da, cuda.GpuBuffer.from_numpy(b) as db, cuda.GpuBuffer(n) as o:
                cuda.launch(k, -(-n // (256 * vec)), 256, k.args(da, db, o, n))
                assert np.array_equal(o.to_numpy(), a + b)
    for rows, cols, block in ((3, 1, 32), (5, 1000, 128), (2, 4097, 1024)):
        x = rng.standard_normal((rows, cols)).astype(np.float32)
        k = cache.get("row_sum", block=block)
        with cuda.GpuBuffer.from_numpy(x) as dx, cuda.GpuBuffer(rows) as o:
            cuda.launch(k, rows, block, k.args(dx, o, cols))
            np.testing.assert_allclose(o.to_numpy(), x.sum(1), rtol=1e-4, atol=1e-4)


def _optional(module: str, fn: str):
    """Cases contributed by kernel families that provide ``sanitize_cases(cache, rng, small)``."""
    try:
        mod = __import__(module, fromlist=[fn])
    except ImportError:
        return None
    return getattr(mod, fn, None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="fewer, smaller cases (racecheck is slow)")
    a = ap.parse_args()
    cache = cuda.module_cache()
    rng = np.random.default_rng(0)
    extra = [f for f in (_optional("tools.sanitize_attention", "cases"), _optional("tools.sanitize_layers", "cases")) if f]
    for fn in CASES + extra:
        fn(cache, rng, a.small)
        cuda.current_device().synchronize()
        print(f"ok {fn.__module__}.{fn.__name__}")


if __name__ == "__main__":
    main()
