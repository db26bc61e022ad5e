"""Aggregate serving throughput of ``realizar serve`` against ``realizar serve --data-parallel N`` (N replicas, one
per GPU, behind sglang-router's cache-aware policy), the same streaming HTTP load through each, in one run.

    python tools/bench_data_parallel.py --gguf model.gguf --replicas 1,2 --concurrency 64,256
    python tools/bench_data_parallel.py --shape llama-3-8b --replicas 1,2          # writes the shape's GGUF first
    python tools/bench_data_parallel.py --gguf tiny.gguf --device cpu --concurrency 2 --prompt 8 --gen 4  # smoke

For each N: the server is started as a user starts it (a child ``python -m realizar serve``, N = 1 without
``--data-parallel``), every request is a streaming completion of a distinct random text prompt of about
``--prompt`` tokens (counted with the first server's ``/tokenize``) and ``--gen`` output tokens (greedy, no stop),
sent at once from four client processes (tools/bench_serving.py's client); output tok/s from the streams'
usage chunks over the wall time from the start to the last event, TTFT p50 / p99. The ratio column divides by
N = 1 at the same C: N on N GPUs ideally gives N.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import multiprocessing
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_serving import client_load, pct  # noqa: E402  (tools/ is on the path when run as a script)
from realizar.cli.data_parallel import free_port  # noqa: E402

NAME = "bench"
LETTERS = np.array(list("abcdefghijklmnopqrstuvwxyz"))
CLIENTS = 4


def start_server(gguf: str, n: int, device: str, max_batch: int, log) -> tuple[subprocess.Popen, str]:
    """A ``realizar serve`` child on a free loopback port (``--data-parallel n`` for n > 1), once it answers."""
    port = free_port()
    argv = [sys.executable, "-m", "realizar", "serve", "-m", gguf, "--port", str(port), "--device", device,
            "--model-name", NAME, "--max-batch", str(max_batch)] + (["--data-parallel", str(n)] if n > 1 else [])
    log(f"$ {shlex.join(argv[1:])}")
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    ready = re.compile(f"serving {n} replicas" if n > 1 else r"serving .* at http")
    for line in p.stdout:
        line = line.rstrip()
        if re.search(r"loaded |serving |error", line):
            log(f"    {line}")
        if ready.search(line):
            break
    else:
        raise RuntimeError(f"the server stopped (exit {p.wait()}) before it was ready")
    import threading

    threading.Thread(target=lambda: [None for _ in p.stdout], daemon=True).start()  # (keep its pipe drained)
    url = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.monotonic() + 120
    while True:  # (a router takes its replicas once their first health checks pass)
        try:
            body = {"model": NAME, "prompt": "warm up", "max_tokens": 1}
            if httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200:
                return p, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("the server did not answer within 120 s")
        time.sleep(0.2)


def stop_server(p: subprocess.Popen) -> None:
    import os

    if p.poll() is None:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)


def prompts(rng, count: int, chars: int) -> list[str]:
    """``count`` distinct texts of random lowercase words, ``chars`` characters each."""
    out = []
    for _ in range(count):
        text = "".join(rng.choice(LETTERS, chars))
        cuts = np.sort(rng.choice(np.arange(3, chars - 1), chars // 6, replace=False))
        out.append(" ".join(text[a:b] for a, b in zip([0, *cuts], [*cuts, chars])))
    return out


def tokens_of(url: str, text: str) -> int:
    import httpx

    r = httpx.post(url + "/tokenize", json={"model": NAME, "prompt": text}, timeout=30)
    r.raise_for_status()
    return int(r.json()["count"])


def load(pool, url: str, reqs: list[tuple[str, int]]) -> dict:
    return client_load(pool, url + "/v1/completions", NAME, reqs, CLIENTS)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--gguf", help="the model file every server loads")
    src.add_argument("--shape", help="write this random-weight shape (tools/write_gguf.py) to a temporary GGUF")
    ap.add_argument("--replicas", default="1,2", help="N values, comma-separated (N = 1: plain serve)")
    ap.add_argument("--concurrency", default="64,128,256")
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens per request (about)")
    ap.add_argument("--gen", type=int, default=128, help="output tokens per request")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    ns = [int(x) for x in args.replicas.split(",")]
    cs = [int(x) for x in args.concurrency.split(",")]
    lines: list[str] = []

    def log(s: str) -> None:
        print(s, flush=True)
        lines.append(s)

    tmp = tempfile.TemporaryDirectory(prefix="bench-dp-")
    gguf = args.gguf
    if gguf is None:
        from write_gguf import write_gguf

        from realizar.models.random import bench_model

        config, tensors, _ = bench_model(args.shape, 0)
        gguf = str(Path(tmp.name) / f"{args.shape}.gguf")
        write_gguf(config, tensors, gguf, name=f"random {args.shape}")
        del tensors
    rng = np.random.default_rng(0)
    res: dict[int, dict[int, dict]] = {}
    chars = None
    pool = concurrent.futures.ProcessPoolExecutor(CLIENTS, mp_context=multiprocessing.get_context("spawn"))
    try:
        for n in ns:
            p, url = start_server(gguf, n, args.device, max(cs), log)
            try:
                if chars is None:  # (characters per prompt for --prompt tokens, from this model's tokenizer)
                    probe = prompts(rng, 1, 4 * args.prompt)[0]
                    chars = max(8, round(len(probe) * args.prompt / tokens_of(url, probe)))
                load(pool, url, [(t, 4) for t in prompts(rng, CLIENTS, chars)])  # clients and kernels warm
                res[n] = {}
                for c in cs:
                    load(pool, url, [(t, 4) for t in prompts(rng, c, chars)])  # this batch size's graphs
                    res[n][c] = r = load(pool, url, [(t, args.gen) for t in prompts(np.random.default_rng(c), c,
                                                                                      chars)])
                    log(f"  N={n} C={c}: {r['tok_s']:.0f} tok/s, TTFT p50 {1e3 * pct(r['ttft'], 50):.0f} ms")
            finally:
                stop_server(p)
    finally:
        pool.shutdown()
        tmp.cleanup()
    report = [f"# Data-parallel serving ({args.device}), {datetime.date.today()}", "",
              f"Command: `python {shlex.join(['tools/bench_data_parallel.py', *(argv or sys.argv[1:])])}`", "",
              f"Model: {args.shape or Path(gguf).name}; {len(cs)} loads per N, each C streaming completions at once "
              f"(distinct random prompts of about {args.prompt} tokens, {args.gen} out, greedy) from {CLIENTS} "
              "client processes; N = 1: `realizar serve`, N > 1: `realizar serve --data-parallel N` (sglang-router, "
              "cache-aware, in front).", "",
              "| N | C | output tok/s | x N = 1 | TTFT p50 ms | TTFT p99 ms |", "|---:|---:|---:|---:|---:|---:|"]
    for n, by_c in res.items():
        for c, r in by_c.items():
            base = res.get(1, {}).get(c)
            ratio = f"{r['tok_s'] / base['tok_s']:.2f}" if base else "-"
            report.append(f"| {n} | {c} | {r['tok_s']:,.0f} | {ratio} | {1e3 * pct(r['ttft'], 50):,.0f} | "
                          f"{1e3 * pct(r['ttft'], 99):,.0f} |")
    report += ["", "Log:", "", "```", *lines, "```", ""]
    text = "\n".join(report)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
