"""NCCL all-reduce latency on the GPUs of this host, one process driving them (realizar.parallel.nccl):
the cost tensor parallelism adds per decode step (two all-reduces of one hidden vector per layer).

    python tools/bench_nccl.py                   # every power of 2 up to the visible GPUs
    python tools/bench_nccl.py --gpus 4 --iters 2000

For each GPU count N and message (f16 hidden vectors of Llama-3-8B and -70B, and 1 MiB), ``--iters``
in-place all-reduces are issued back to back (each one group over the N communicators) and timed from
the first issue to the end of all streams: microseconds per all-reduce, eager (not yet captured in a
graph). Needs 2+ GPUs and libnccl.so.2 (pip install "realizar[multigpu]"). Latest run:
docs/results/bench_tensor_parallel_h100x2.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from realizar import cuda  # noqa: E402
from realizar.parallel import nccl, visible_gpu_count  # noqa: E402

MESSAGES = (("8B hidden (4096 x f16)", 4096), ("70B hidden (8192 x f16)", 8192), ("1 MiB (524288 x f16)", 524288))


def report(path: Path | None):
    """A ``say(line)`` that prints a report line and, with ``path``, appends it to that file at once (a
    run stopped by a time limit keeps the lines it reached)."""
    out = open(path, "w") if path is not None else None

    def say(line: str) -> None:
        print(line, flush=True)
        if out is not None:
            out.write(line + "\n")
            out.flush()
    return say


def bench(lib, n: int, count: int, iters: int) -> float:
    """Microseconds per all-reduce of ``count`` f16 values over GPUs 0..n-1."""
    devices = [cuda.Device(i) for i in range(n)]
    streams, bufs = [], []
    for d in devices:
        d.make_current()
        streams.append(cuda.Stream(d))
        bufs.append(cuda.GpuBuffer.from_numpy(np.ones(count, np.float16), device=d))
    comms = lib.comm_init_all(list(range(n)))
    try:
        def run(k: int) -> None:
            for _ in range(k):
                with lib.group():
                    for r in range(n):
                        lib.all_reduce(bufs[r], bufs[r], count, np.float16, comms[r], streams[r])
            for d, s in zip(devices, streams):
                d.make_current()
                s.synchronize()

        run(20)  # connection setup and warm-up
        t0 = time.perf_counter()
        run(iters)
        return (time.perf_counter() - t0) / iters * 1e6
    finally:
        for c in comms:
            c.destroy()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, help="largest GPU count to measure (default: all visible)")
    ap.add_argument("--iters", type=int, default=1000)
    ap.add_argument("--out", type=Path, help="also write the report lines to this file (as they come)")
    args = ap.parse_args()
    say = report(args.out)
    lib = nccl.load()
    visible = visible_gpu_count()
    top = min(args.gpus or visible, visible)
    if top < 2:
        print(f"bench_nccl: needs 2 visible GPUs, {visible} here", file=sys.stderr)
        return 1
    counts = [n for n in (2, 4, 8) if n <= top] + ([top] if top not in (2, 4, 8) else [])
    say(f"NCCL {'.'.join(map(str, lib.version()))} ({lib.origin}), {visible} visible GPUs, "
        f"{cuda.Device(0).name}, {args.iters} all-reduces per cell, eager")
    say("| message | " + " | ".join(f"N={n} us" for n in counts) + " |")
    say("|---|" + "---:|" * len(counts))
    for label, count in MESSAGES:
        say(f"| {label} | " + " | ".join(f"{bench(lib, n, count, args.iters):.1f}" for n in counts) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
