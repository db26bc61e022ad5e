"""``realizar bench``: prefill and decode throughput on the path ``generate`` takes.

Each run resets the model, prefills the prompt and takes the first token (time to first token),
then decodes ``--gen-tokens`` more tokens, each picked by the same greedy sampler ``generate``
uses: on the GPU model it reads back only the 4-byte argmax computed on the device, never the
logits vector. EOS does not stop a run. Medians over the timed runs are reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from realizar.cli.common import CliError, add_model_args, load_engine, nonneg_int, positive_int, tty


def _bench_prompt(engine: Any, n: int) -> list[int]:
    """``n`` ordinary token ids (English text repeated), whatever the tokenizer."""
    text = (
        "The quick brown fox jumps over the lazy dog while the committee reviews the annual report "
        "on renewable energy, transport, and the history of mathematics in seven countries. "
    )
    ids: list[int] = []
    while len(ids) < n:
        ids.extend(engine.tokenizer.encode(text, add_special_tokens=False))
    return ids[:n]


def _one_run(model: Any, ids: list[int], gen_tokens: int) -> tuple[float, float]:
    """(seconds to the first token, seconds for ``gen_tokens`` decode steps) of one greedy run."""
    from realizar.sampling import Sampler

    greedy = Sampler(temperature=0.0)
    model.reset()
    t0 = time.perf_counter()
    tok = greedy(model.prefill(ids), ids)
    t1 = time.perf_counter()
    for _ in range(gen_tokens):
        tok = greedy(model.decode(tok), ())
    return t1 - t0, time.perf_counter() - t1


def run_bench(engine: Any, prompt_tokens: int, gen_tokens: int, repeats: int, warmup: int = 1,
              progress: bool = False) -> dict:
    """Time ``repeats`` greedy runs (after ``warmup`` untimed ones) of a ``prompt_tokens`` prompt
    and ``gen_tokens`` decode steps on the engine's model; medians in the result."""
    if prompt_tokens + gen_tokens > engine.context_length:
        raise CliError(
            f"--prompt-tokens {prompt_tokens} + --gen-tokens {gen_tokens} exceeds the context of "
            f"{engine.context_length} tokens"
        )
    ids = _bench_prompt(engine, prompt_tokens)
    ttft_s: list[float] = []
    decode_s: list[float] = []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=warmup + repeats, desc="bench", unit="run", file=sys.stderr, leave=False)
    for i in range(warmup + repeats):
        first, rest = _one_run(engine.model, ids, gen_tokens)
        if i >= warmup:
            ttft_s.append(first)
            decode_s.append(rest)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    p, d = statistics.median(ttft_s), statistics.median(decode_s)
    return {
        "model": engine.name,
        "device": engine.device,
        "prompt_tokens": prompt_tokens,
        "gen_tokens": gen_tokens,
        "repeats": repeats,
        "time_to_first_token_seconds": p,
        "decode_seconds": d,
        "prefill_tokens_per_second": prompt_tokens / p if p > 0 else None,
        "decode_tokens_per_second": gen_tokens / d if d > 0 and gen_tokens else None,
        "decode_ms_per_token": 1e3 * d / gen_tokens if gen_tokens else None,
    }


def cmd_bench(args: argparse.Namespace) -> int:
    engine = load_engine(args)
    r = run_bench(engine, args.prompt_tokens, args.gen_tokens, args.repeats, args.warmup, progress=tty())
    if args.json:
        print(json.dumps(r, indent=2))
        return 0

    def fmt(v: float | None, spec: str) -> str:
        return format(v, spec) if v is not None else "n/a"

    print("| model | device | prompt | time to first token ms | prefill tok/s | generated | decode tok/s "
          "| ms/token |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    print(
        f"| {r['model']} | {r['device']} | {r['prompt_tokens']} | {1e3 * r['time_to_first_token_seconds']:.1f} | "
        f"{fmt(r['prefill_tokens_per_second'], '.1f')} | {r['gen_tokens']} | "
        f"{fmt(r['decode_tokens_per_second'], '.1f')} | {fmt(r['decode_ms_per_token'], '.2f')} |"
    )
    print(f"(median of {r['repeats']} runs after {args.warmup} warm-up; greedy through the sampler generate "
          "uses; EOS ignored; prefill includes picking the first token)", file=sys.stderr)
    return 0


def register(command) -> None:
    """Add the subcommand's parser; ``command(name, help, description)`` makes one."""
    p = command("bench", "measure prefill and decode throughput",
                "Time the prefill of a prompt up to its first token, then greedy decode steps, on the "
                "chosen device and through the same sampler as 'generate' (EOS is ignored); report "
                "medians as a Markdown table: time to first token, prefill and decode tok/s.")
    add_model_args(p)
    p.add_argument("-p", "--prompt-tokens", type=positive_int, default=128, metavar="N",
                   help="prompt length (default: 128)")
    p.add_argument("-g", "--gen-tokens", type=nonneg_int, default=32, metavar="N",
                   help="decode steps (default: 32)")
    p.add_argument("-r", "--repeats", type=positive_int, default=3, metavar="N",
                   help="timed runs; the median is reported (default: 3)")
    p.add_argument("--warmup", type=nonneg_int, default=1, metavar="N", help="untimed runs first (default: 1)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_bench)
