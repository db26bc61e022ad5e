"""A mixture-of-experts model on the GPU beside llama.cpp on the same GGUF file, in the same run: batch-1 decode
(tg), prefill (pp) and batched decode at several batch sizes.

    python tools/write_gguf.py qwen3-30b-a3b /tmp/moe.gguf
    python tools/bench_moe.py --gguf /tmp/moe.gguf --llama-cpp /tmp/llama.cpp/build/bin --out bench_moe_h200.md
    python tools/bench_moe.py --shape qwen3-30b-a3b --batches 1,8 --prompt 128   # random weights, no peer
    python tools/bench_moe.py --shape tiny --device emulate --batches 2 --prompt 8 --gen 2 --runs 1   # CPU smoke
    python tools/bench_moe.py --shape qwen3-30b-a3b --grouped-min 2,4,8,16,1000000   # the policy's row threshold

realizar, on the file's weights:

* decode: ``--gen`` greedy tokens after 8 through the decode graph (host wall clock, as llama-bench's tg), GPU
  time per token from CUDA events, and the bandwidth roofline of the bytes one token reads (attention, routers,
  the chosen experts' share of the stacked matrices, the LM head) at the device's measured copy bandwidth;
* prefill: ``--prompt`` random tokens on a fresh cache, median of ``--runs`` by CUDA events (as llama-bench's pp);
* batched decode: ``GpuBatchBackend``, B sequences of 128 prompt tokens decoding 128 together, aggregate
  tok/s (as ``llama-batched-bench -npp 128 -ntg 128``'s S_TG).

llama.cpp (``--llama-cpp`` the folder of its binaries; skipped without it): ``llama-bench -ngl 99 -fa 1 -p PROMPT
-n GEN`` (its JSON) and ``llama-batched-bench -ngl 99 -fa on -npp 128 -ntg 128 -npl BATCHES`` (the S_TG column
of its table), run first, each in its own process, so the two engines never share the GPU's memory.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from bench_decode import bench as decode_rate  # tools/ is on the path when run as a script
from bench_prefill import time_prefill
from bench_serving import bench_batched

from realizar import cuda
from realizar.cuda.bench import copy_bandwidth
from realizar.gpu.batch import GpuBatchBackend
from realizar.gpu.model import GpuModel
from realizar.models.random import MOE_SHAPES, BenchShape, bench_model, token_read_bytes

BATCH_PROMPT = BATCH_GEN = 128
TINY = BenchShape(dict(architecture="qwen3moe", vocab_size=256, hidden_size=256, num_layers=2, num_heads=8,
                       num_kv_heads=2, head_dim=32, intermediate_size=256, rope_theta=1e4, rope_type="neox",
                       rms_norm_eps=1e-6, context_length=512, tied_embeddings=False, qk_norm=True, num_experts=8,
                       num_experts_used=2, expert_ffn_size=256), "Q4_K", "Q8_0", "Q8_0")


def llama_cpp(folder: Path, gguf: Path, prompt: int, gen: int, batches: list[int]) -> tuple[dict, dict, list[str]]:
    """({"pp": tok/s, "tg": tok/s}, {B: S_TG tok/s}, the commands) of llama.cpp's binaries in ``folder``."""
    bench = [str(folder / "llama-bench"), "-m", str(gguf), "-ngl", "99", "-fa", "1", "-p", str(prompt), "-n", str(gen),
             "-o", "json"]
    runs = json.loads(subprocess.run(bench, capture_output=True, text=True, check=True).stdout)
    single = {("pp" if r["n_prompt"] else "tg"): float(r["avg_ts"]) for r in runs}
    ctx = max(batches) * (BATCH_PROMPT + BATCH_GEN) + 256
    batched_cmd = [str(folder / "llama-batched-bench"), "-m", str(gguf), "-ngl", "99", "-fa", "on", "-c", str(ctx),
                   "-npp", str(BATCH_PROMPT), "-ntg", str(BATCH_GEN), "-npl", ",".join(map(str, batches))]
    text = subprocess.run(batched_cmd, capture_output=True, text=True, check=True).stdout
    batched, header = {}, None
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if "S_TG t/s" in cells:
            header = cells
        elif header and len(cells) == len(header) and re.fullmatch(r"\d+", cells[header.index("B")]):
            batched[int(cells[header.index("B")])] = float(cells[header.index("S_TG t/s")])
    return single, batched, [" ".join(bench), " ".join(batched_cmd)]


def grouped_sweep(model, values: list[int], batches: list[int], rng) -> dict[int, dict[int, float]]:
    """{MIN: {B: tok/s}}: batched decode (128 + 32) with the grouped expert GEMM from MIN rows on (the policy's
    ``MOE_GROUPED_MIN_ROWS``), a fresh backend for each (captured graphs keep their launches)."""
    import realizar.gpu.decoder as decoder

    kept, out = decoder.MOE_GROUPED_MIN_ROWS, {}
    ctx = BATCH_PROMPT + 32
    try:
        for v in values:
            decoder.MOE_GROUPED_MIN_ROWS = v
            backend = GpuBatchBackend(model, num_blocks=max(batches) * -(-ctx // 32) + 1, block_size=32,
                                      kv_dtype="f16", max_batch=max(batches), max_context=ctx)
            out[v] = {b: r["tok_s"] for b, r in bench_batched(backend, batches, BATCH_PROMPT, 32, rng).items()}
            backend.close()
            del backend
            gc.collect()
    finally:
        decoder.MOE_GROUPED_MIN_ROWS = kept
    return out


def realizar_rates(cfg, tensors, a, batches: list[int], rng, dev) -> tuple[dict, dict]:
    """({"tg", "gpu_us", "pp"[, "sweep"]}, {B: tok/s}) of realizar on ``tensors``; the model is freed on return."""
    model = GpuModel(cfg, tensors, max_len=max(a.prompt, 8 + a.gen) + 16, device=dev)
    tg, gpu_us = decode_rate(model, a.gen)
    ids = [int(t) for t in rng.integers(0, cfg.vocab_size, a.prompt)]
    pp_s, _ = time_prefill(model, dev, ids, 2, a.runs)
    single = {"tg": tg, "gpu_us": gpu_us, "pp": a.prompt / pp_s}
    print(f"realizar: tg{a.gen} {tg:.0f} tok/s ({gpu_us:.0f} µs GPU/token), pp{a.prompt} {single['pp']:.0f} tok/s",
          flush=True)
    model.release_kv()
    ctx = BATCH_PROMPT + BATCH_GEN
    blocks = max(batches) * -(-ctx // 32) + 1
    backend = GpuBatchBackend(model, num_blocks=blocks, block_size=32, kv_dtype="f16", max_batch=max(batches),
                              max_context=ctx)
    try:
        batched = {b: r["tok_s"] for b, r in bench_batched(backend, batches, BATCH_PROMPT, BATCH_GEN, rng).items()}
    finally:
        backend.close()
        del backend
        gc.collect()
    if a.grouped_min:
        single["sweep"] = grouped_sweep(model, [int(v) for v in a.grouped_min.split(",")], a.sweep_batches, rng)
    del model
    gc.collect()
    return single, batched


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a and b else "-"


def render(a, cfg, read_bytes: int, bw: float, ours: dict, ours_b: dict, peer: dict, peer_b: dict,
           cmds: list[str], dev) -> list[str]:
    roof = bw / read_bytes
    f = lambda v: "-" if v is None else f"{v:,.0f}"  # noqa: E731
    src = f"`{a.gguf}`" if a.gguf else f"random weights at the {a.shape} shape"
    lines = [f"# bench_moe — {src}, {dev.name}, {datetime.date.today()}", "",
             f"Command: `python {' '.join(sys.argv)}`", "",
             f"{cfg.architecture}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_experts} experts of "
             f"{cfg.expert_ffn_size}, {cfg.num_experts_used} a token. One token reads {read_bytes / 1e6:,.0f} MB "
             f"(bandwidth roofline {roof:,.0f} tok/s at {bw / 1e12:.2f} TB/s, the device's copy rate).", ""]
    lines += [*(f"llama.cpp: `{c}`" for c in cmds), ""] if cmds else ["llama.cpp: not run (no --llama-cpp)", ""]
    lines += ["| | realizar tok/s | llama.cpp tok/s | × llama.cpp |", "|---|---:|---:|---:|",
              f"| decode tg{a.gen} (batch 1) | {f(ours['tg'])} ({ours['gpu_us']:.0f} µs GPU/token, "
              f"{100 * ours['tg'] / roof:.0f}% of roofline) | {f(peer.get('tg'))} | {ratio(ours['tg'], peer.get('tg'))} |",
              f"| prefill pp{a.prompt} | {f(ours['pp'])} | {f(peer.get('pp'))} | {ratio(ours['pp'], peer.get('pp'))} |"]
    for b in sorted(ours_b):
        lines.append(f"| batched decode B={b} (S_TG, {BATCH_PROMPT} + {BATCH_GEN}) | {f(ours_b[b])} | "
                     f"{f(peer_b.get(b))} | {ratio(ours_b[b], peer_b.get(b))} |")
    if "sweep" in ours:
        bs = sorted({b for r in ours["sweep"].values() for b in r})
        lines += ["", f"Batched decode tok/s ({BATCH_PROMPT} + 32) with the grouped expert GEMM from MIN rows on "
                  "(fewer: the expert GEMV per pair):", "",
                  "| MIN | " + " | ".join(f"B={b}" for b in bs) + " |", "|---:|" + "---:|" * len(bs)]
        lines += [f"| {v} | " + " | ".join(f(r.get(b)) for b in bs) + " |" for v, r in ours["sweep"].items()]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--gguf", type=Path, help="a mixture-of-experts GGUF file (both engines load it)")
    src.add_argument("--shape", choices=[*sorted(MOE_SHAPES), "tiny"], help="random weights in memory instead (no peer)")
    ap.add_argument("--llama-cpp", type=Path, help="the folder of llama-bench and llama-batched-bench")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--grouped-min", help="also sweep the grouped GEMM's row threshold over these values, e.g. 2,4,8")
    ap.add_argument("--sweep-batches", default="1,2,4,8,16,32,64", type=lambda v: [int(b) for b in v.split(",")])
    ap.add_argument("--device", choices=("cuda", "emulate"), default="cuda")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    batches = [int(b) for b in a.batches.split(",")]
    peer, peer_b, cmds = {}, {}, []
    if a.llama_cpp and a.gguf:
        peer, peer_b, cmds = llama_cpp(a.llama_cpp, a.gguf, a.prompt, a.gen, batches)
        print(f"llama.cpp: {peer}, batched {peer_b}", flush=True)
    if a.gguf:
        from realizar.models.loader import load_model

        loaded = load_model(a.gguf)
        cfg, tensors = loaded.config, loaded.tensors
        read_bytes = token_read_bytes(cfg, tensors)
    else:
        cfg, tensors, read_bytes = bench_model(TINY if a.shape == "tiny" else a.shape)
    if not cfg.is_moe:
        print(f"bench_moe: {a.gguf or a.shape} is not a mixture-of-experts model", file=sys.stderr)
        return 2
    if a.device == "emulate":
        dev, bw = cuda.EmulatedDevice(sm_count=4, racecheck=False), 4.0e12  # (a nominal bandwidth: a smoke run)
    else:
        dev = cuda.current_device()
        bw = copy_bandwidth(cuda.Stream(dev))
    ours, ours_b = realizar_rates(cfg, tensors, a, batches, np.random.default_rng(1), dev)
    lines = render(a, cfg, read_bytes, bw, ours, ours_b, peer, peer_b, cmds, dev)
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        a.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
