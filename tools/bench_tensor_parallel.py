"""Decode tokens/s of the tensor-parallel model (realizar.parallel.gpu) at N = 1, 2, 4 GPUs, random
weights at Llama-3-8B and Llama-3-70B shapes (Q4_K), against the single-GPU GpuModel.

    python tools/bench_tensor_parallel.py                              # every N that the visible GPUs allow
    python tools/bench_tensor_parallel.py --shapes llama-3-8b --n 1,2 --tokens 256
    python tools/bench_tensor_parallel.py --shapes llama-3-8b --n 1,2 --local   # one GPU: a smoke check

Each row: 8 prompt tokens, then ``--tokens`` greedy decode steps through
``forward_gpu_resident_to_token_id`` (every rank's graph replayed, the distributed argmax read back
from rank 0), wall-clock from the host; then the same steps replayed back to back without read-back,
timed with CUDA events on rank 0's stream (GPU time per token, the ranks synchronised by NCCL).

``--local`` runs an N larger than the visible GPU count on GPU 0 with the LocalReducer (one stream,
all ranks' kernels in one graph, the all-reduce done by add kernels): a check that the split model
runs at real shapes, NOT a tensor-parallel speed. Its rows say so. N up to the visible GPU count runs
over NCCL (N = 1: a one-rank communicator).

Shapes: ``llama-3-8b`` is :data:`realizar.models.random.BENCH_SHAPES`' (Q4_K layers, Q6_K LM head);
``llama-3-70b`` is 80 layers, hidden 8192, 64 / 8 heads of 128, FFN 28672, vocabulary 128256, Q4_K
layers and embedding, Q6_K LM head (about 40 GB of weights: drawing them takes host time and memory).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_nccl import report  # noqa: E402  (tools/ is on the path when run as a script)
from realizar import cuda  # noqa: E402
from realizar.gpu.model import GpuModel  # noqa: E402
from realizar.models.random import BENCH_SHAPES, BenchShape, bench_model  # noqa: E402
from realizar.parallel import nccl, visible_gpu_count  # noqa: E402
from realizar.parallel.gpu import LocalReducer, NcclReducer, TensorParallelModel  # noqa: E402

SHAPES = {
    "llama-3-8b": BENCH_SHAPES["llama-3-8b"],
    "llama-3-70b": BenchShape(dict(architecture="llama", rope_type="normal", rms_norm_eps=1e-5, context_length=8192,
                                   vocab_size=128256, hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                                   head_dim=128, intermediate_size=28672, rope_theta=5e5, tied_embeddings=False),
                              "Q4_K", "Q4_K", "Q6_K"),
}  # fmt: skip
MAX_LEN = 1024
PROMPT = 8


def bench(model, tokens: int) -> tuple[float, float]:
    """(host tokens/s, GPU µs per token) of ``model`` (a GpuModel or a TensorParallelModel)."""
    tok = 1
    for pos in range(PROMPT):
        tok = model.forward_gpu_resident_to_token_id(tok, pos)
    t0 = time.perf_counter()
    for pos in range(PROMPT, PROMPT + tokens):
        tok = model.forward_gpu_resident_to_token_id(tok, pos)
    wall = time.perf_counter() - t0
    lanes = [model.sequence] if isinstance(model, GpuModel) else model.seqs
    first = lanes[0]
    first.device.make_current()
    e0, e1 = cuda.Event(device=first.device), cuda.Event(device=first.device)
    for lane in lanes:
        lane.device.make_current()
        lane.stream.synchronize()
    first.device.make_current()
    e0.record(first.stream)
    for pos in range(PROMPT, PROMPT + tokens):  # replays back to back, no read-back between them
        model._run_step(tok, pos)
    first.device.make_current()
    e1.record(first.stream)
    e1.synchronize()
    for lane in lanes:
        lane.device.make_current()
        lane.stream.synchronize()
    return tokens / wall, e0.elapsed_ms(e1) * 1e3 / tokens


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--n", default="1,2,4", help="rank counts (default: 1,2,4, those the GPUs allow)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--local", action="store_true",
                    help="run N > visible GPUs on GPU 0 with the LocalReducer (a smoke check, not TP speed)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the single-GPU GpuModel row")
    ap.add_argument("--out", type=Path, help="also write the report lines to this file (as they come)")
    a = ap.parse_args()
    say = report(a.out)
    visible = visible_gpu_count()
    if visible < 1:
        print("bench_tensor_parallel: needs a GPU", file=sys.stderr)
        return 1
    counts = [int(x) for x in a.n.split(",")]
    try:
        lib = nccl.load()
    except nccl.NcclUnavailableError as e:
        print(f"bench_tensor_parallel: {e}", file=sys.stderr)
        return 1
    dev0 = cuda.Device(0)
    how = f"NCCL {'.'.join(map(str, lib.version()))} ({lib.origin})"
    if a.local:
        how += f"; N > {visible}: LocalReducer on GPU 0, every rank on one GPU, NOT tensor-parallel speed"
    say(f"{visible} visible GPUs ({dev0.name}); {how}; {a.tokens} decode tokens after {PROMPT}, max_len {MAX_LEN}")
    say("| shape | model | N | reducer | host tok/s | GPU us/token |")
    say("|---|---|---:|---|---:|---:|")
    for name in a.shapes.split(","):
        t0 = time.perf_counter()
        config, tensors, read_bytes = bench_model(SHAPES[name])
        say(f"<!-- {name}: random weights drawn in {time.perf_counter() - t0:.0f} s, "
            f"{read_bytes / 1e9:.2f} GB read per token -->")
        if not a.no_baseline:
            dev0.make_current()
            model = GpuModel(config, tensors, max_len=MAX_LEN, device=dev0)
            tps, us = bench(model, a.tokens)
            say(f"| {name} | GpuModel | 1 | - | {tps:.1f} | {us:.1f} |")
            del model
            gc.collect()
        for n in counts:
            local = n > visible
            if local and not a.local:
                say(f"| {name} | split | {n} | NCCL | needs {n} GPUs, {visible} visible | |")
                continue
            reducer = LocalReducer(n, dev0) if local else NcclReducer(list(range(n)), lib=lib)
            try:
                model = TensorParallelModel(config, tensors, reducer, max_len=MAX_LEN)
                tps, us = bench(model, a.tokens)
                label = "local (one GPU, not TP speed)" if local else "NCCL"
                say(f"| {name} | split | {n} | {label} | {tps:.1f} | {us:.1f} |")
                model.synchronize()
                del model
                gc.collect()
            finally:
                reducer.close()
        del tensors
        gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
