"""Serving throughput and latency on the GPU: batched decode at the backend, and many concurrent requests
through the serving engine and the HTTP server, beside llama.cpp's batched figures.

    python tools/bench_serving.py --out docs/results/bench_serving_h200.md
    python tools/bench_serving.py --shapes smollm2-135m --batches 1,8,64 --parts batched
    python tools/bench_serving.py --device emulate --tiny --batches 1,2 --prompt 4 --gen 3   # CPU smoke

Parts (``--parts``):

* ``batched`` — what ``llama-batched-bench -npp 128 -ntg 128`` measures: B sequences each prefilled with
  ``--prompt`` random tokens, then ``--gen`` decode steps of all B at once through
  :class:`realizar.gpu.batch.GpuBatchBackend` (one graph replay per step, greedy sampling on the GPU,
  4 bytes a sequence read back), pipelined as the serving engine runs them: step N + 1 takes step N's tokens on
  the device (``fed`` rows) and is staged and launched before the host reads step N's tokens (``--sync``: each step
  sampled and read before the next is staged, as before 2026-11-30). Aggregate decode tok/s = B x gen / wall time of
  the decode steps;
  the ratio to the single-stream rate of :class:`GpuModel` (its own cache and graph, measured first in
  the same run) and to llama.cpp's figure at the same B.
* ``engine`` — C concurrent requests (prompt ``--prompt`` tokens, ``--gen`` output tokens; and a mixed
  load of prompts 32..1024 / outputs 16..256) submitted at once to :class:`realizar.serving.ServingEngine`,
  their tokens taken by one sink as the HTTP server takes them: aggregate output tok/s, time to first
  token and inter-token latency p50/p99.
* ``http`` — the same requests as streaming completions through the OpenAI-compatible server
  (uvicorn in this process with the protocol ``realizar serve`` runs, the engine in a process of its own as
  ``serve`` runs it unless ``--no-engine-process``; ``httpx`` streaming clients in four client processes; output
  tokens from the streams' usage chunks); beside each load, its ratio to the ``batched`` part's bound for the same work,
  B x gen / (its prefill time + its decode time).
* ``warmstart`` — in this fresh process: :meth:`ServingEngine.warm_up` (skipped with ``--no-warm-up``), then
  four distinct prompts of ``--warm-prompt`` tokens (one output token each) in turn: the first one's time
  against the median of the others. Run it alone, so nothing else has loaded a kernel before.

Random weights at the real shapes (``realizar.models.random.BENCH_SHAPES``). llama.cpp's figures:
``llama-batched-bench -npp 128 -ntg 128`` (flash attention on) on an H200 with random weights,
2026-11-25 (../shared/GUIDE.md); not re-run here.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import shlex
import sys
import time
from pathlib import Path

import numpy as np

from bench_decode import bench as decode_rate  # tools/ is on the path when run as a script
from bench_prefill import TINY

from realizar import cuda
from realizar.gpu.batch import GpuBatchBackend
from realizar.gpu.linear import GEMV_COLS_DEFAULT_ROWS
from realizar.gpu.model import GpuModel
from realizar.models.random import BENCH_SHAPES, bench_model

# llama-batched-bench -npp 128 -ntg 128, aggregate tok/s at B = 1 / 8 / 32 / 64 / 128 (../shared/GUIDE.md)
LLAMA_CPP_BATCHED = {
    "smollm2-135m": {1: 819, 8: 4618, 32: 8256, 64: 11598, 128: 13599},
    "llama-3.2-1b": {1: 814, 8: 3634, 32: 8964, 64: 12691, 128: 14198},
    "llama-3-8b": {1: 281, 8: 984, 32: 3379, 64: 4765, 128: 5507},
}
LLAMA_CPP_ORIGIN = ("llama.cpp: `llama-batched-bench -npp 128 -ntg 128` (flash attention on), H200, random weights "
                    "at the same shapes, 2026-11-25 (../shared/GUIDE.md); not re-run here")


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def bench_batched(backend: GpuBatchBackend, batches: list[int], prompt: int, gen: int, rng,
                  sync: bool = False) -> dict[int, dict]:
    """{B: {"tok_s", "step_ms", "prefill_s"}}: B sequences prefilled then decoded together, each step launched before
    the previous step's tokens are read (``sync``: read before the next step is staged)."""
    from realizar.sampling import RowSampling
    from realizar.serving.backend import fed

    if gen < (2 if sync else 3):
        raise SystemExit(f"--gen {gen}: the batched part times steps after {'one' if sync else 'two'} warm-up "
                         f"step(s); give at least {2 if sync else 3}")

    bs = backend.block_size
    per_seq = -(-(prompt + gen) // bs)
    out = {}
    for b in batches:
        if b > backend.max_batch or 1 + b * per_seq > backend.num_blocks:
            print(f"  B={b}: skipped (max_batch {backend.max_batch}, {backend.num_blocks} blocks)", flush=True)
            continue
        tables = [list(range(1 + r * per_seq, 1 + (r + 1) * per_seq)) for r in range(b)]
        tokens = []
        # warm-up: this prompt length's kernels loaded and graphs captured before the timed prefills
        backend.prefill([int(t) for t in rng.integers(0, backend.config.vocab_size, prompt)], 0,
                        tables[0]).sample([RowSampling()])
        t0 = time.perf_counter()
        for r in range(b):
            ids = [int(t) for t in rng.integers(0, backend.config.vocab_size, prompt)]
            tokens.append(int(backend.prefill(ids, 0, tables[r]).sample([RowSampling()])[0]))
        prefill_s = time.perf_counter() - t0
        specs = [RowSampling()] * b
        # warm-up: the bucket's first step captures its graph, and the first step of fed rows its own
        tokens = backend.decode(tokens, [prompt] * b, tables).sample(specs).tolist()
        feeds = [fed(r) for r in range(b)]
        if not sync:
            pending = backend.decode(feeds, [prompt + 1] * b, tables).launch(specs)
            pending.wait()
        first = 1 if sync else 2
        t0 = time.perf_counter()
        for step in range(first, gen):
            if sync:
                tokens = backend.decode(tokens, [prompt + step] * b, tables).sample(specs).tolist()
            else:  # (step N + 1 staged and queued before step N's tokens are read)
                launched = backend.decode(feeds, [prompt + step] * b, tables).launch(specs)
                pending.wait()
                pending = launched
        if not sync:
            pending.wait()
        wall = time.perf_counter() - t0
        steps = gen - first
        out[b] = {"tok_s": b * steps / wall, "step_ms": 1e3 * wall / steps, "prefill_s": prefill_s}
        print(f"  B={b}: {out[b]['tok_s']:.0f} tok/s aggregate, {out[b]['step_ms']:.2f} ms/step "
              f"(prefill of {b}x{prompt} tokens {prefill_s:.2f} s)", flush=True)
    return out


def bench_tokenizer(vocab_size: int):
    """A byte-level tokenizer of ``vocab_size`` ids for random-weight models: the 256 byte symbols,
    then ids spelled ``w<id>``; no end-of-sequence id, so every request runs to ``max_tokens``."""
    from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers

    from realizar.text.tokenizer import Tokenizer

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({f"w{i}": i for i in range(len(vocab), vocab_size)})
    backend = Backend(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return Tokenizer(backend, kind="bpe", vocab_size=vocab_size)


def run_load(serving, requests: list[tuple[list[int], int]]) -> dict:
    """Submit every (prompt ids, max_tokens) at once, each streamed to one sink (the way the HTTP server
    takes them: no thread per request): aggregate output tok/s, TTFT and inter-token latency percentiles
    (seconds) from the times the tokens reach the sink."""
    import threading

    from realizar.generation import SamplingParams

    times: dict[int, list[float]] = {i: [] for i in range(len(requests))}
    left = [len(requests)]
    done = threading.Event()

    def sink(i, _handle, chunk):
        if chunk is not None:
            times[i].append(time.perf_counter())
        else:
            left[0] -= 1  # (only the engine's thread calls: no lock)
            if left[0] == 0:
                done.set()

    t0 = time.perf_counter()
    starts = []
    for i, (ids, n) in enumerate(requests):
        starts.append(time.perf_counter())
        serving.submit(ids, SamplingParams(max_tokens=n, temperature=0.0),
                       sink=lambda h, c, i=i: sink(i, h, c))
    done.wait()
    wall = time.perf_counter() - t0
    ttft = [ts[0] - starts[i] for i, ts in times.items() if ts]
    itl = [d for ts in times.values() for d in np.diff(ts).tolist()]
    count = sum(len(ts) for ts in times.values())
    return {"tok_s": count / wall, "ttft": ttft, "itl": itl, "wall": wall, "tokens": count}


def bench_engine(backend, concurrency: list[int], prompt: int, gen: int, rng) -> dict[str, dict]:
    """{label: run_load result} through a ServingEngine over ``backend``."""
    from realizar.serving.engine import ServingEngine

    vocab = backend.config.vocab_size
    serving = ServingEngine(backend, bench_tokenizer(vocab), eos_token_ids=())
    draw = lambda n: [int(t) for t in rng.integers(0, vocab, n)]  # noqa: E731
    out = {}
    try:
        serving.warm_up()  # as the server does before it answers: kernels loaded, every step graph captured
        run_load(serving, [(draw(prompt), 8)])
        for c in concurrency:
            if c > backend.max_batch:
                continue
            run_load(serving, [(draw(prompt), 4) for _ in range(c)])  # capture this bucket's graph
            out[f"{c} x ({prompt} in, {gen} out)"] = r = run_load(serving, [(draw(prompt), gen) for _ in range(c)])
            print(f"  engine C={c}: {r['tok_s']:.0f} tok/s, TTFT p50 {1e3 * pct(r['ttft'], 50):.1f} ms, "
                  f"ITL p50 {1e3 * pct(r['itl'], 50):.2f} ms", flush=True)
        c = min(64, backend.max_batch)
        lens = [(int(rng.integers(32, 1025)), int(rng.integers(16, 257))) for _ in range(c)]
        fits = [(p, g) for p, g in lens if p + g <= backend.context_length]
        out[f"{c} mixed (32-1024 in, 16-256 out)"] = r = run_load(serving, [(draw(p), g) for p, g in fits])
        print(f"  engine mixed: {r['tok_s']:.0f} tok/s", flush=True)
    finally:
        serving.close()
    return out


async def _stream_load(url: str, name: str, reqs: list[tuple[list[int], int]], start_at: float) -> list:
    """Stream every (prompt ids, max_tokens) as a completion at once from ``start_at`` (perf_counter, the same
    clock in every process): per request (its start, the arrival time of each event with text, its completion
    tokens from the usage chunk)."""
    import asyncio
    import json

    import httpx

    async def one(client, ids, n):
        body = {"model": name, "prompt": ids, "max_tokens": n, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        t0 = time.perf_counter()
        times, tokens = [], 0
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}")
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if event["choices"] and event["choices"][0].get("text"):
                    times.append(time.perf_counter())  # (an event carries the tokens that came since the last)
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
        return t0, times, tokens

    limits = httpx.Limits(max_connections=len(reqs) + 8, max_keepalive_connections=len(reqs) + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
        return await asyncio.gather(*(one(client, ids, n) for ids, n in reqs))


def _client_process(url: str, name: str, reqs: list, start_at: float) -> list:
    import asyncio

    return asyncio.run(_stream_load(url, name, reqs, start_at))


def client_load(pool, url: str, name: str, reqs: list, clients: int) -> dict:
    """``reqs`` (prompt, max_tokens) streamed from ``clients`` processes of ``pool`` at once (from 0.3 s on): output
    tok/s over the wall time to the last event, TTFTs, the gaps between events, the wall time and the tokens."""
    start_at = time.perf_counter() + 0.3
    futures = [pool.submit(_client_process, url, name, reqs[i::clients], start_at)
               for i in range(clients) if reqs[i::clients]]
    runs = [r for f in futures for r in f.result()]
    wall = max(ts[-1] for _, ts, _ in runs if ts) - start_at
    ttft = [ts[0] - s for s, ts, _ in runs if ts]
    itl = [d for _, ts, _ in runs for d in np.diff(ts).tolist()]
    count = sum(n for _, _, n in runs)
    return {"tok_s": count / wall, "ttft": ttft, "itl": itl, "wall": wall, "tokens": count}


def bench_front(name: str, config, context_length: int):
    """(In a further server process) the bench's front engine: the model's name, config and byte tokenizer."""
    from types import SimpleNamespace

    return SimpleNamespace(name=name, device="cuda", config=config, tokenizer=bench_tokenizer(config.vocab_size),
                           context_length=context_length, generator=None)


def bench_http(backend, name: str, concurrency: list[int], prompt: int, gen: int, rng,
               clients: int = 4, serving=None, api_servers: int = 1) -> dict[str, dict]:
    """{label: result}: C concurrent streaming completions through the OpenAI-compatible server (uvicorn in
    this process on a loopback port, and ``api_servers - 1`` more server processes on the same socket over
    ``serving``, an engine process that listens) from ``clients`` client processes (httpx, C / clients streams
    each); output tok/s from the streams' usage chunks, TTFT and the gaps between events from their arrival."""
    import concurrent.futures
    import multiprocessing
    import socket
    import threading

    import uvicorn

    from realizar.server import uvicorn_config
    from realizar.server.app import create_app
    from realizar.serving.engine import ServingEngine

    vocab = backend.config.vocab_size
    engine = bench_front(name, backend.config, backend.context_length)
    tok = engine.tokenizer
    serving = serving or ServingEngine(backend, tok, eos_token_ids=())
    app = create_app(engine, serving=serving, max_queue=1024)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1/completions"
    server = uvicorn.Server(uvicorn_config(app, log_level="warning"))  # the protocol `realizar serve` runs
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server did not start (its log above says why)")
        time.sleep(0.02)
    fronts = []
    if api_servers > 1:
        from realizar.server.fronts import start_fronts

        fronts = start_fronts(api_servers - 1, sock, serving.address,
                              functools.partial(bench_front, name, backend.config, backend.context_length),
                              {"max_queue": 1024, "log_level": "warning"})
    pool = concurrent.futures.ProcessPoolExecutor(clients, mp_context=multiprocessing.get_context("spawn"))

    load = functools.partial(client_load, pool, url, name, clients=clients)

    draw = lambda n: [int(t) for t in rng.integers(0, vocab, n)]  # noqa: E731
    out = {}
    try:
        load([(draw(prompt), 8) for _ in range(clients)])  # warm-up: client processes started, kernels loaded
        for c in concurrency:
            if c > backend.max_batch:
                continue
            load([(draw(prompt), 4) for _ in range(c)])  # this bucket's graph captured
            out[f"{c} x ({prompt} in, {gen} out)"] = r = load([(draw(prompt), gen) for _ in range(c)])
            print(f"  http C={c}: {r['tok_s']:.0f} tok/s, TTFT p50 {1e3 * pct(r['ttft'], 50):.1f} ms, "
                  f"event gap p50 {1e3 * pct(r['itl'], 50):.2f} ms", flush=True)
    finally:
        pool.shutdown()
        if fronts:
            from realizar.server.fronts import join_fronts, signal_fronts

            signal_fronts(fronts)
            join_fronts(fronts, 30)
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
    return out


def engine_process_build(name: str, device: str, max_len: int, backend_kwargs: dict):
    """(In the engine process) the bench's ServingEngine: the shape's random weights (the same seed as this
    process's) on a GpuBatchBackend of ``backend_kwargs``."""
    from realizar.serving.engine import ServingEngine

    dev = cuda.EmulatedDevice(sm_count=4, racecheck=False) if device == "emulate" else cuda.current_device()
    cfg, tensors, _ = bench_model(TINY if name == "tiny" else name)
    model = GpuModel(cfg, tensors, max_len=max_len, device=dev)
    model.release_kv()
    return ServingEngine(GpuBatchBackend(model, **backend_kwargs), bench_tokenizer(cfg.vocab_size), eos_token_ids=())


def bench_warm_start(backend, prompt: int, warm: bool, rng) -> list[str]:
    """The first prompt after start against warm ones of the same length (see ``warmstart``)."""
    from realizar.generation import SamplingParams
    from realizar.serving.engine import ServingEngine

    vocab = backend.config.vocab_size
    serving = ServingEngine(backend, bench_tokenizer(vocab), eos_token_ids=())
    try:
        warm_s = serving.warm_up() if warm else 0.0
        times = []
        for _ in range(4):
            ids = [int(t) for t in rng.integers(0, vocab, prompt)]
            t0 = time.perf_counter()
            serving.submit(ids, SamplingParams(max_tokens=1, temperature=0.0)).wait()
            times.append(1e3 * (time.perf_counter() - t0))
    finally:
        serving.close()
    later = float(np.median(times[1:]))
    print(f"  warm start: warm_up {warm_s:.2f} s, first {times[0]:.1f} ms, later {later:.1f} ms", flush=True)
    return [f"| {'on' if warm else 'off'} | {warm_s:.2f} | {prompt} | {times[0]:.1f} | "
            f"{', '.join(f'{t:.1f}' for t in times[1:])} | {times[0] / later:.2f} |"]


def latency_table(name: str, part: str, res: dict[str, dict], bound: dict[int, float] | None = None) -> list[str]:
    gap = "event gap" if "HTTP" in part else "ITL"
    lines = [f"### {name}: {part}", "",
             f"| load | output tok/s | x batched bound | TTFT p50 ms | TTFT p99 ms | {gap} p50 ms | {gap} p99 ms | wall s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for label, r in res.items():
        c = int(label.split()[0])
        ratio = f"{r['tok_s'] / bound[c]:.2f}" if bound and c in bound and "mixed" not in label else "-"
        lines.append(f"| {label} | {r['tok_s']:.0f} | {ratio} | {1e3 * pct(r['ttft'], 50):.1f} | "
                     f"{1e3 * pct(r['ttft'], 99):.1f} | {1e3 * pct(r['itl'], 50):.2f} | {1e3 * pct(r['itl'], 99):.2f} | "
                     f"{r['wall']:.2f} |")
    return lines + [""]


def batched_table(name: str, res: dict[int, dict], single: float, prompt: int, gen: int) -> list[str]:
    peer = LLAMA_CPP_BATCHED.get(name, {})
    lines = [f"### {name}: batched decode (prompt {prompt}, {gen} generated per sequence)", "",
             f"Single stream (GpuModel, same run, same prompt and output lengths): {single:.0f} tok/s.", "",
             "| B | aggregate tok/s | ms / step | x single stream | llama.cpp tok/s | x llama.cpp |",
             "|---:|---:|---:|---:|---:|---:|"]
    for b, r in sorted(res.items()):
        p = peer.get(b)
        vs_peer = f"{r['tok_s'] / p:.2f}" if p else "-"
        vs_one = f"{r['tok_s'] / single:.2f}" if b == 1 else f"{r['tok_s'] / single:.1f}"
        lines.append(f"| {b} | {r['tok_s']:.0f} | {r['step_ms']:.2f} | {vs_one} | {p or '-'} | {vs_peer} |")
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(BENCH_SHAPES))
    ap.add_argument("--tiny", action="store_true", help="a 2-layer toy shape instead (CPU smoke test)")
    ap.add_argument("--device", choices=("cuda", "emulate"), default="cuda",
                    help="emulate: the PTX emulator on the CPU (with --tiny: a smoke test of every part)")
    ap.add_argument("--batches", default="1,8,32,64,128")
    ap.add_argument("--parts", default="batched,engine,http")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--sync", action="store_true", help="batched: read each step's tokens before staging the next")
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--warm-prompt", type=int, default=512, help="the warmstart part's prompt length")
    ap.add_argument("--no-warm-up", action="store_true", help="the warmstart part without ServingEngine.warm_up")
    ap.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                    help="the http part with the engine in a process of its own (realizar.serving.remote), as "
                         "`realizar serve` runs it (default; --no-engine-process: in the server's process)")
    ap.add_argument("--api-servers", type=int,
                    help="the http part's server processes over the engine process (default: serve's, one per 4 CPU "
                         "cores, at most 4; 1 with --no-engine-process)")
    ap.add_argument("--kv-dtype", default="f16")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--gemv-cols-rows", default=str(GEMV_COLS_DEFAULT_ROWS),
                    help="GpuBatchBackend's gemv_cols_rows; several (comma-separated): the batched part once each, "
                         "on a backend of its own (0: gemm_q for every batch)")
    ap.add_argument("--f16-weights", choices=("auto", "on", "off"), default="auto",
                    help="GpuBatchBackend's f16_weights: f16 copies of the weights for more than 32 rows when they "
                         "fit (auto), always, or never (the batch GEMMs then read the quantized weights)")
    a = ap.parse_args(argv)
    if a.api_servers is None:
        from realizar.server.fronts import default_api_servers

        a.api_servers = default_api_servers() if a.engine_process else 1
    if a.api_servers > 1 and not a.engine_process:
        ap.error("--api-servers above 1 needs the engine process (drop --no-engine-process)")
    f16w = {"auto": None, "on": True, "off": False}[a.f16_weights]
    dev = cuda.EmulatedDevice(sm_count=4, racecheck=False) if a.device == "emulate" else cuda.current_device()
    batches = [int(b) for b in a.batches.split(",")]
    parts = a.parts.split(",")
    lines = [f"# bench_serving — {dev.name}, {datetime.date.today()}", "",
             f"Command: `python tools/bench_serving.py {' '.join(shlex.quote(x) for x in (sys.argv[1:] if argv is None else argv))}`",
             "", LLAMA_CPP_ORIGIN, ""]
    rng = np.random.default_rng(0)
    for name in ["tiny"] if a.tiny else a.shapes.split(","):
        cfg, tensors, _ = bench_model(TINY if name == "tiny" else name)
        model = GpuModel(cfg, tensors, max_len=a.prompt + a.gen, device=dev)
        # GpuModel's single-stream rate (its own cache and decode graph), the ratio's denominator
        single = decode_rate(model, a.gen, a.prompt)[0] if "batched" in parts else 0.0
        model.release_kv()  # the backend keeps its own paged cache
        # (warm-up loads ask for 8 tokens; the mixed load: prompts up to 1024 + 256)
        ctx = max(a.prompt + max(a.gen, 8), 1280 if "engine" in parts else 0,
                  a.warm_prompt + 1 if "warmstart" in parts else 0)
        need = max(batches) * -(-ctx // a.block_size) + 1
        settings = [int(v) for v in a.gemv_cols_rows.split(",")]
        for extra in settings[1:] if "batched" in parts else ():
            backend = GpuBatchBackend(model, num_blocks=need, block_size=a.block_size, kv_dtype=a.kv_dtype,
                                      max_batch=max(batches), max_context=ctx, gemv_cols_rows=extra,
                                      f16_weights=f16w)
            table = batched_table(name, bench_batched(backend, batches, a.prompt, a.gen, rng, a.sync), single, a.prompt,
                                  a.gen)
            table[0] += f" (gemv_cols_rows={extra})"
            lines += table
            print("\n".join(table), flush=True)
            backend.close()
            del backend
            gc.collect()
        backend = GpuBatchBackend(model, num_blocks=need, block_size=a.block_size, kv_dtype=a.kv_dtype,
                                  max_batch=max(batches), max_context=ctx, gemv_cols_rows=settings[0],
                                  f16_weights=f16w)
        print(f"{name}: {backend.num_blocks} blocks of {a.block_size}, kv {a.kv_dtype}", flush=True)
        bound = None  # the batched part's B x gen / (prefill + decode time), the served parts' reference
        if "warmstart" in parts:
            lines += [f"### {name}: the first prompt after start (warm_up {'off' if a.no_warm_up else 'on'})", "",
                      "| warm_up | warm_up s | prompt | first ms | later ms | first / later median |",
                      "|---|---:|---:|---:|---|---:|",
                      *bench_warm_start(backend, a.warm_prompt, not a.no_warm_up, rng), ""]
        if "batched" in parts:
            res = bench_batched(backend, batches, a.prompt, a.gen, rng, a.sync)
            bound = {b: b * a.gen / (r["prefill_s"] + a.gen * r["step_ms"] / 1e3) for b, r in res.items()}
            table = batched_table(name, res, single, a.prompt, a.gen)
            if len(settings) > 1:
                table[0] += f" (gemv_cols_rows={settings[0]})"
            lines += table
            print("\n".join(table), flush=True)
        if "engine" in parts:
            lines += latency_table(name, "ServingEngine, concurrent requests (greedy)",
                                   bench_engine(backend, batches, a.prompt, a.gen, rng), bound)
        if "http" in parts:
            remote, where = None, ", the engine in the server's process"
            if a.engine_process:  # the same model and backend, built again in a process of its own
                from realizar.serving.remote import EngineProcess

                kwargs = dict(num_blocks=need, block_size=a.block_size, kv_dtype=a.kv_dtype, max_batch=max(batches),
                              max_context=ctx, gemv_cols_rows=settings[0], f16_weights=f16w)
                remote = EngineProcess(functools.partial(engine_process_build, name, a.device, ctx, kwargs),
                                       listen=a.api_servers > 1)
                where = ", the engine in a process of its own"
                if a.api_servers > 1:
                    where += f", {a.api_servers} server processes"
            lines += latency_table(name, f"HTTP server, concurrent streaming completions (greedy{where})",
                                   bench_http(backend, name, batches, a.prompt, a.gen, rng, serving=remote,
                                              api_servers=a.api_servers), bound)
        backend.close()
        del backend, model, tensors
        gc.collect()
    text = "\n".join(lines)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
