"""Small launches of the basic kernels (vector add, row sum), run under compute-sanitizer.

    compute-sanitizer --tool memcheck python tools/sanitize_cases.py
    compute-sanitizer --tool racecheck python tools/sanitize_cases.py --small

The attention and transformer-layer kernels have their own scripts (tools/sanitize_attention.py,
tools/sanitize_layers.py); tools/gpu_check.py runs all three under both sanitizers.

Each case checks its own result against NumPy, so a kernel that misbehaves only under the sanitizer
is noticed too. Awkward sizes (not multiples of the block or vector width) are chosen on purpose.
"""

from __future__ import annotations

import argparse

import numpy as np

from realizar import cuda

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="fewer, smaller cases (racecheck is slow)")
    a = ap.parse_args()
    cache = cuda.module_cache()
    rng = np.random.default_rng(0)
    for fn in CASES:
        fn(cache, rng, a.small)
        cuda.current_device().synchronize()
        print(f"ok {fn.__module__}.{fn.__name__}")


if __name__ == "__main__":
    main()
