"""The real SmolLM2-135M-Instruct Q4_1 on the GPU: greedy text vs the CPU reference, then tok/s.

    python tools/gpu_real_model.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf --out smollm2_gpu.md

(On the lent GPU machine the 98 MB file arrives in two carried halves that the caller joins; the
sha256 is checked here.)
"""

from __future__ import annotations

import argparse
import hashlib
import time
from pathlib import Path

from realizar.default_model import DEFAULT_MODEL_SHA256
from realizar.engine import load_engine
from realizar.generation import SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at", "The three primary colors are"]
# long prompts take the batched prefill (16 tokens or more): a paragraph, and one past a 512-token chunk
PARAGRAPH = ("The river rose slowly through the night, and by morning the low fields east of the town were "
             "under water. Farmers moved their animals to the hills, the school closed, and the mayor asked "
             "volunteers to fill sandbags along the old stone bridge. ")
LONG_PROMPTS = [PARAGRAPH + "What happened to the school?", PARAGRAPH * 14 + "Summarize the story in one sentence:"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    digest = hashlib.sha256(a.gguf.read_bytes()).hexdigest()
    assert digest == DEFAULT_MODEL_SHA256, f"sha256 mismatch: {digest}"
    gpu = load_engine(a.gguf, device="cuda", max_context=4096)
    cpu = load_engine(a.gguf, device="cpu", max_context=4096)
    lines = ["| prompt | GPU greedy (32 tokens) | same tokens as CPU reference |", "|---|---|---|"]
    for p in PROMPTS + LONG_PROMPTS:
        params = SamplingParams(max_tokens=32, temperature=0.0)
        g, c = gpu.generate(p, params), cpu.generate(p, params)
        same = g.token_ids == c.token_ids
        first_diff = next((i for i, (x, y) in enumerate(zip(g.token_ids, c.token_ids)) if x != y), None)
        shown = p if len(p) < 60 else f"{p[:40]}... ({g.prompt_tokens} tokens)"
        lines.append(f"| {shown!r} | {g.text!r} | {'yes' if same else f'no (first difference at token {first_diff})'} |")
    france = gpu.generate(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0.0)).text
    assert "Paris" in france, france
    params = SamplingParams(max_tokens=256, temperature=0.0)
    gpu.generate("Once upon a time", params)  # warm-up
    t0 = time.perf_counter()
    r = gpu.generate("Once upon a time", SamplingParams(max_tokens=256, temperature=0.0, stop_token_ids=()))
    wall = time.perf_counter() - t0
    lines += ["", f"Generation through the engine (tokenizer, streaming decoder, sampler included): "
              f"{r.completion_tokens} tokens, prefill {r.prompt_tokens} tokens in {r.prefill_seconds * 1e3:.1f} ms, "
              f"decode {r.completion_tokens / max(r.decode_seconds, 1e-9):.0f} tok/s; wall {wall:.3f} s."]
    table = "\n".join(lines)
    print(table)
    if a.out:
        a.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
