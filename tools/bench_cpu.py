#!/usr/bin/env python3
"""CPU decode speed of the NumPy reference model (default: SmolLM2-135M-Instruct Q4_1).

    python tools/bench_cpu.py [--model PATH] [--prompt TEXT] [--prompt-tokens N] [--tokens 128] [--repeats 3]

Loads the model (weights dequantized once to float32), prefills the prompt, then decodes
``--tokens`` tokens greedily, feeding back the argmax and never stopping at EOS, so every run decodes
the same number of tokens. Prints the load time, the prefill time and the per-token decode latency
(median of all steps of all repeats) and tokens/s. The first repeat is preceded by an unmeasured
warm-up run. BLAS threads: set OPENBLAS_NUM_THREADS / OMP_NUM_THREADS before running.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file or safetensors directory (default: SmolLM2)")
    ap.add_argument("--prompt", default="The capital of France is")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-context", type=int, default=2048)
    ap.add_argument("--prompt-tokens", type=int, default=0,
                    help="repeat the prompt's tokens to this length (decode at a deeper position)")  # fmt: skip
    args = ap.parse_args(argv)

    from realizar.engine import load_tokenizer
    from realizar.models.loader import load_model
    from realizar.models.reference import ReferenceModel

    if args.model is None:
        from realizar.default_model import default_model_path

        path = default_model_path()
    else:
        path = Path(args.model)

    t0 = time.perf_counter()
    loaded = load_model(path)
    model = ReferenceModel.from_loaded(loaded, max_len=min(args.max_context, loaded.config.context_length))
    load_s = time.perf_counter() - t0
    tok = load_tokenizer(loaded)
    ids = tok.encode(args.prompt)
    if args.prompt_tokens > len(ids):
        ids = (ids * (args.prompt_tokens // len(ids) + 1))[: args.prompt_tokens]
    if len(ids) + args.tokens > model.context_length:
        ap.error(f"prompt ({len(ids)}) + tokens ({args.tokens}) exceed --max-context {model.context_length}")

    def run() -> tuple[float, list[float], list[int]]:
        model.reset()
        t = time.perf_counter()
        logits = model.prefill(ids)
        prefill = time.perf_counter() - t
        steps, out = [], []
        for _ in range(args.tokens):
            nxt = int(np.argmax(logits))
            out.append(nxt)
            t = time.perf_counter()
            logits = model.decode(nxt)
            steps.append(time.perf_counter() - t)
        return prefill, steps, out

    run()  # warm-up: page faults, BLAS thread start
    prefills, steps = [], []
    for _ in range(args.repeats):
        p, s, out = run()
        prefills.append(p)
        steps.extend(s)

    med = statistics.median(steps)
    mean = statistics.fmean(steps)
    c = loaded.config
    weights_mb = (
        sum(a.nbytes for L in model.layers for a in vars_of(L)) + model.embedding.nbytes
        + (0 if model.lm_head is model.embedding else model.lm_head.nbytes)
    ) / 1e6  # fmt: skip
    blas = _blas_name()
    print(f"model:      {path.name} ({c.architecture}, {c.num_layers} layers, hidden {c.hidden_size}, "
          f"vocab {c.vocab_size})")  # fmt: skip
    print(f"machine:    {platform.machine()}, {os.cpu_count()} CPUs, {_cpu_model()}; numpy {np.__version__} ({blas})")
    print(f"threads:    OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', '-')} "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '-')}")  # fmt: skip
    print(f"load:       {load_s:.2f} s (parse + dequantize to float32: {weights_mb:.0f} MB of weights)")
    print(f"prompt:     {len(ids)} tokens, prefill median {statistics.median(prefills) * 1e3:.1f} ms")
    print(f"decode:     {args.tokens} tokens x {args.repeats} runs, positions {len(ids)}..{len(ids) + args.tokens - 1}")
    print(f"  median    {med * 1e3:.2f} ms/token = {1 / med:.1f} tokens/s")
    print(f"  mean      {mean * 1e3:.2f} ms/token = {1 / mean:.1f} tokens/s")
    q = statistics.quantiles(steps, n=10)
    print(f"  p10 / p90 {q[0] * 1e3:.2f} / {q[-1] * 1e3:.2f} ms/token (a mean far above the median means "
          f"other processes took the CPUs)")  # fmt: skip
    print(f"  weights read per token at the median: {weights_mb / 1e3 / med:.1f} GB/s")
    print(f"first tokens: {tok.decode(out[:12])!r}")
    return 0


def vars_of(layer) -> list[np.ndarray]:
    return [getattr(layer, n) for n in layer.__slots__ if isinstance(getattr(layer, n), np.ndarray)]


def _blas_name() -> str:
    try:
        cfg = np.show_config(mode="dicts")
        b = cfg["Build Dependencies"]["blas"]
        return f"{b.get('name')} {b.get('version', '')}".strip()
    except Exception:
        return "BLAS unknown"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


if __name__ == "__main__":
    sys.exit(main())
