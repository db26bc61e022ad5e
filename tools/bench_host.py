"""The served path's host side alone: the serving engine and the HTTP server over a backend that only waits
for as long as the GPU's decode step and prefill take (``time.sleep``: the interpreter lock is free, as while
the host waits for a real step), so what limits throughput is the host's own work. No GPU needed.

    python tools/bench_host.py                          # SmolLM2-135M's H200 step times, C = 64 and 256
    python tools/bench_host.py --step-ms 1.3,0.0063 --prefill-ms 1.0,0.005 --concurrency 64,128,256

The step takes ``a + b x rows`` ms and a prompt chunk ``c + d x tokens`` ms (``--step-ms a,b``,
``--prefill-ms c,d``; the defaults fit the H200's SmolLM2 figures of 2026-11-29: 1.75 / 2.16 / 2.93 ms a step
at 64 / 128 / 256 rows, about 1.9 ms for a 128-token prompt). "bound" is the same work without any serving:
C x gen / (C prompts' prefill + gen steps), the ratio ``tools/bench_serving.py`` reports against its batched part.
Rows: the engine (tokens to one sink, overlapped steps on and off) and HTTP (client processes; the engine in
this process, then in a process of its own).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import shlex
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from bench_serving import bench_http, bench_tokenizer, run_load  # tools/ is on the path when run as a script

from realizar.serving.backend import PendingTokens


class _Ready(PendingTokens):
    def __init__(self, at: float, tokens: np.ndarray):
        self._at, self._tokens = at, tokens

    def wait(self) -> np.ndarray:
        left = self._at - time.perf_counter()
        if left > 0:
            time.sleep(left)
        return self._tokens


class _Output:
    def __init__(self, backend: "SleepBackend", seconds: float):
        self._backend, self._seconds = backend, seconds

    def launch(self, specs) -> PendingTokens:
        b = self._backend
        start = max(time.perf_counter(), b.busy_until)  # the "GPU" runs one thing at a time, in order
        b.busy_until = start + self._seconds
        return _Ready(b.busy_until, b.rng.integers(300, b.config.vocab_size, len(specs)))

    def sample(self, specs) -> np.ndarray:
        return self.launch(specs).wait()

    def logits(self, i: int) -> np.ndarray:
        return np.zeros(self._backend.config.vocab_size, np.float32)


class SleepBackend:
    """A :class:`~realizar.serving.backend.BatchBackend` whose calls take the given times and draw random tokens."""

    feeds_tokens = True

    def __init__(self, step_ms: tuple[float, float], prefill_ms: tuple[float, float], max_batch: int = 256,
                 vocab_size: int = 49152):
        self.config = SimpleNamespace(vocab_size=vocab_size, num_layers=1)
        self.block_size, self.num_blocks, self.max_batch, self.context_length = 32, 40000, max_batch, 4096
        self.step_ms, self.prefill_ms = step_ms, prefill_ms
        self.rng = np.random.default_rng(0)
        self.busy_until = 0.0

    def prefill(self, tokens, start, table) -> _Output:
        return _Output(self, (self.prefill_ms[0] + self.prefill_ms[1] * len(tokens)) / 1e3)

    def decode(self, tokens, positions, tables) -> _Output:
        return _Output(self, (self.step_ms[0] + self.step_ms[1] * len(tokens)) / 1e3)


def sleep_serving(step_ms: tuple[float, float], prefill_ms: tuple[float, float]):
    """(In an engine process) a ServingEngine over a SleepBackend."""
    from realizar.serving.engine import ServingEngine

    return ServingEngine(SleepBackend(step_ms, prefill_ms), bench_tokenizer(49152), eos_token_ids=())


def _pair(text: str) -> tuple[float, float]:
    a, b = (float(v) for v in text.split(","))
    return a, b


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--step-ms", type=_pair, default=(1.3, 0.0063))
    ap.add_argument("--prefill-ms", type=_pair, default=(1.0, 0.005))
    ap.add_argument("--concurrency", default="64,256")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--clients", type=int, default=4, help="HTTP client processes")
    ap.add_argument("--api-servers", type=int, default=4, help="server processes of the last column")
    ap.add_argument("--out", type=Path, help="also write the table here (Markdown)")
    a = ap.parse_args(argv)
    from realizar.serving.engine import ServingEngine
    from realizar.serving.remote import EngineProcess

    rng = np.random.default_rng(0)
    draw = lambda n: [int(t) for t in rng.integers(300, 49000, n)]  # noqa: E731
    lines = [f"# bench_host — {os.cpu_count()} CPUs, {datetime.date.today()}", "",
             f"Command: `python tools/bench_host.py {' '.join(shlex.quote(x) for x in (sys.argv[1:] if argv is None else argv))}`",
             "", f"Step {a.step_ms[0]} + {a.step_ms[1]} x rows ms, prefill {a.prefill_ms[0]} + {a.prefill_ms[1]} x tokens ms; "
             f"{a.prompt} prompt tokens, {a.gen} generated; tok/s (x bound).", "",
             "| C | bound tok/s | engine, in step | engine, overlapped | HTTP, engine in the server's process | "
             f"HTTP, engine process | HTTP, engine process, {a.api_servers} server processes |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    print("\n".join(lines), flush=True)
    for c in (int(v) for v in a.concurrency.split(",")):
        step = (a.step_ms[0] + a.step_ms[1] * c) / 1e3
        bound = c * a.gen / (c * (a.prefill_ms[0] + a.prefill_ms[1] * a.prompt) / 1e3 + a.gen * step)
        cells = []
        for overlap in (False, True):
            serving = ServingEngine(SleepBackend(a.step_ms, a.prefill_ms), bench_tokenizer(49152), eos_token_ids=(),
                                    async_scheduling=overlap)
            r = run_load(serving, [(draw(a.prompt), a.gen) for _ in range(c)])
            serving.close()
            cells.append(r["tok_s"])
        for remote, servers in ((False, 1), (True, 1), (True, a.api_servers)):
            serving = (EngineProcess(functools.partial(sleep_serving, a.step_ms, a.prefill_ms), listen=servers > 1)
                       if remote else None)
            r = bench_http(SleepBackend(a.step_ms, a.prefill_ms), "sleep", [c], a.prompt, a.gen, rng, clients=a.clients,
                           serving=serving, api_servers=servers)
            cells.append(next(iter(r.values()))["tok_s"])
        lines.append(f"| {c} | {bound:.0f} | " + " | ".join(f"{v:.0f} ({v / bound:.2f})" for v in cells) + " |")
        print(lines[-1], flush=True)
    if a.out:
        a.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
