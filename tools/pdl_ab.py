"""Programmatic dependent launch, A/B inside one process: GpuBatchBackend's decode step of B rows (8B shape, random
weights, 128-token contexts) is recorded once, then replayed eagerly and as CUDA graphs captured under different rules
of which launches are programmatic; GPU µs per step from graph replays (median of 5 runs of 16), for the whole step and
for its GEMM launches alone.

    python tools/pdl_ab.py --batch 128 [--shape llama-3-8b]

Rules: ``none``, ``all`` (what the backend's graphs do), ``not into gemm_ws`` (its launches are ordinary) and ``not out
of gemm_ws`` (the launch after one is ordinary). docs/results/profile_batch_128_h200.md has what it found.
"""

from __future__ import annotations

import argparse
import sys

from profile_step import PROMPT  # tools/ is on the path when run as a script

from realizar import cuda
from realizar.cuda.bench import median_us
from realizar.cuda.graph import capture
from realizar.cuda.launch import programmatic_dependent_launch, recording
from realizar.gpu.batch import GpuBatchBackend
from realizar.gpu.model import GpuModel
from realizar.models.random import bench_model
from realizar.sampling import RowSampling


def _ws(r) -> bool:
    return r.kernel.name == "gemm_ws"


RULES = {  # is this launch programmatic, given it and the launch before (None for the first)
    "none": lambda r, prev: False,
    "all": lambda r, prev: True,
    "not into gemm_ws": lambda r, prev: not _ws(r),
    "not out of gemm_ws": lambda r, prev: prev is None or not _ws(prev),
}


def replay(records, rule=None) -> None:
    prev = None
    for r in records:
        with programmatic_dependent_launch(bool(rule and rule(r, prev))):
            r.relaunch()
        prev = r


def ab(records, stream, calls: int = 16, reps: int = 5) -> dict[str, float]:
    """GPU µs per replay of ``records``: eagerly, then as a graph captured under each of :data:`RULES`."""
    out = {"eager": median_us(lambda: [replay(records) for _ in range(calls)], stream, calls, reps)}
    for name, rule in RULES.items():
        with capture(stream) as cap:
            replay(records, rule)
        exe = cap.graph.instantiate()
        out[name] = median_us(lambda: [exe.launch(stream) for _ in range(calls)], stream, calls, reps)
        exe.close()
    return out


def record_step(backend: GpuBatchBackend, b: int) -> list:
    """The launches of one decode step of ``b`` rows after ``b`` prefilled 128-token contexts."""
    per = -(-(PROMPT + 4) // backend.block_size)
    tables = [list(range(1 + r * per, 1 + (r + 1) * per)) for r in range(b)]
    spec = [RowSampling()]
    ids = [int(backend.prefill([1 + (r + i) % 1000 for i in range(PROMPT)], 0, tables[r]).sample(spec)[0])
           for r in range(b)]
    ids = backend.decode(ids, [PROMPT] * b, tables).sample(spec * b).tolist()  # (loads every kernel)
    with recording() as records:
        backend.decode(ids, [PROMPT + 1] * b, tables).sample(spec * b)
    return records


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--shape", default="llama-3-8b")
    a = ap.parse_args(argv)
    cfg, tensors, _ = bench_model(a.shape)
    model = GpuModel(cfg, tensors, max_len=PROMPT + 8, device=cuda.current_device(), use_graph=False)
    per = -(-(PROMPT + 4) // 32)
    backend = GpuBatchBackend(model, num_blocks=1 + a.batch * per, block_size=32, kv_dtype="f16", max_batch=a.batch,
                              max_context=per * 32, use_graph=False, f16_weights=False)
    records = record_step(backend, a.batch)
    for tag, part in (("step", records), ("its GEMMs", [r for r in records if r.kernel.name.startswith("gemm")])):
        t = ab(part, backend.stream)
        print(f"- {a.shape}, {a.batch} rows, {tag} ({len(part)} launches): " +
              " | ".join(f"{k} {v:.1f}" for k, v in t.items()) + " µs", flush=True)
    backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
