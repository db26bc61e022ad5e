"""Launch-policy variants A/B'd in one process: the batched decode step of one model under each variant, the variants
interleaved round by round (A B C A B C ...) so that drift in clocks or temperature falls on all of them alike.

    python tools/policy_ab.py --shape llama-3-8b --batches 128,256 \\
        --variant none --variant "WS_SPLIT_FIRST=()" --variant "XTMA_WHOLE_TILES=False; WS_TILE_FILL=1.0" [--out ab.md]

A variant is ``none`` or ``NAME=VALUE`` settings separated by ``;``, VALUE a Python literal. A setting replaces the
module-level name in every loaded ``realizar`` module that defines it (the policy modules and the modules that import
the name from them), and is undone after the variant's run. Each variant's run builds its own GpuBatchBackend (its
graphs captured under that policy) on the model built once, then times ``tools/bench_serving.py``'s batched part
(pipelined steps, f16 weight copies off unless ``--f16-weights``). The table gives each variant's median over the
rounds and its ratio to the first variant.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import gc
import shlex
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_prefill import TINY  # noqa: E402
from bench_serving import bench_batched  # noqa: E402

from realizar import cuda  # noqa: E402
from realizar.gpu.batch import GpuBatchBackend  # noqa: E402
from realizar.gpu.model import GpuModel  # noqa: E402
from realizar.models.random import bench_model  # noqa: E402


def parse_variant(text: str) -> dict[str, object]:
    """``none`` -> {}; ``A=1; B=(128,)`` -> {"A": 1, "B": (128,)} (SystemExit naming a setting that is not NAME=literal)."""
    if text.strip() == "none":
        return {}
    out = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, sep, value = part.partition("=")
        try:
            if not sep or not name.strip().isidentifier():
                raise ValueError(part)
            out[name.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            raise SystemExit(f"--variant {text!r}: expected none or NAME=VALUE settings (VALUE a Python literal) "
                             f"separated by ';', got {part!r}") from None
    return out


def apply(settings: dict[str, object]) -> list[tuple[object, str, object]]:
    """Set each name in every loaded realizar module that defines it; returns the (module, name, old value) to undo.
    SystemExit for a name no realizar module defines."""
    undo = []
    for name, value in settings.items():
        mods = [m for key, m in list(sys.modules.items())
                if m is not None and key.startswith("realizar") and name in vars(m)]
        if not mods:
            raise SystemExit(f"--variant: no loaded realizar module defines {name}")
        for m in mods:
            undo.append((m, name, getattr(m, name)))
            setattr(m, name, value)
    return undo


def undo(saved: list[tuple[object, str, object]]) -> None:
    for m, name, old in reversed(saved):
        setattr(m, name, old)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--tiny", action="store_true", help="the 2-layer toy shape instead (CPU smoke test)")
    ap.add_argument("--device", choices=("cuda", "emulate"), default="cuda")
    ap.add_argument("--batches", default="128,256")
    ap.add_argument("--variant", action="append", default=[], help="none or NAME=VALUE[; NAME=VALUE]; repeatable")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--f16-weights", action="store_true", help="keep f16 copies where they fit (default: off)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    variants = a.variant or ["none"]
    parsed = [parse_variant(v) for v in variants]
    if a.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, got {a.rounds}")
    batches = [int(b) for b in a.batches.split(",")]
    dev = cuda.EmulatedDevice(sm_count=4, racecheck=False) if a.device == "emulate" else cuda.current_device()
    cfg, tensors, _ = bench_model(TINY if a.tiny else a.shape)
    model = GpuModel(cfg, tensors, max_len=a.prompt + a.gen, device=dev)
    model.release_kv()
    block = 32
    need = max(batches) * -(-(a.prompt + a.gen) // block) + 1
    rng = np.random.default_rng(0)
    runs: dict[tuple[int, int], list[dict]] = {}
    for rnd in range(a.rounds):
        for i, settings in enumerate(parsed):
            saved = apply(settings)
            try:
                backend = GpuBatchBackend(model, num_blocks=need, block_size=block, kv_dtype="f16",
                                          max_batch=max(batches), max_context=a.prompt + a.gen,
                                          f16_weights=True if a.f16_weights else False)
                print(f"round {rnd + 1}, variant {variants[i]}", flush=True)
                for b, res in bench_batched(backend, batches, a.prompt, a.gen, rng).items():
                    runs.setdefault((i, b), []).append(res)
                backend.close()
                del backend
                gc.collect()
            finally:
                undo(saved)
    name = "tiny" if a.tiny else a.shape
    lines = [f"# policy_ab — {dev.name}, {datetime.date.today()}", "",
             f"Command: `python tools/policy_ab.py {' '.join(shlex.quote(x) for x in (sys.argv[1:] if argv is None else argv))}`",
             "", f"{name}: batched decode, prompt {a.prompt}, {a.gen} generated per sequence, f16 weight copies "
             f"{'where they fit' if a.f16_weights else 'off'}; {a.rounds} round(s), the variants interleaved; "
             "tok/s of each round, then the median and its ratio to the first variant.", "",
             "| B | variant | tok/s (each round) | median tok/s | ms / step | x first |", "|---:|---|---|---:|---:|---:|"]
    for b in batches:
        base = None
        for i, v in enumerate(variants):
            got = runs.get((i, b))
            if not got:
                continue
            med = statistics.median(r["tok_s"] for r in got)
            base = base or med
            each = ", ".join(f"{r['tok_s']:.0f}" for r in got)
            step = statistics.median(r["step_ms"] for r in got)
            lines.append(f"| {b} | {v} | {each} | {med:.0f} | {step:.2f} | {med / base:.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        a.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
