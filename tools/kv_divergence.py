"""What each KV cache format does to a model's logits, on the CPU: the NumPy serving backend stores K/V
as f32, f16, bf16 or q8_0 (the values the GPU's paged pools read back,
:func:`realizar.models.kv_formats.round_kv`) and each is compared with the reference model (f32 cache)
over every position of a prompt decoded token by token.

    python tools/kv_divergence.py --out docs/results/kv_divergence_cpu.md     # the default model
    python tools/kv_divergence.py --gguf model.gguf --tokens 300
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

import numpy as np

from realizar.engine import load_tokenizer
from realizar.models.kv_formats import KV_FORMATS
from realizar.models.loader import load_model
from realizar.models.reference import ReferenceModel
from realizar.serving.cpu_backend import ReferenceBatchBackend

TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
        "movable metal type, oil-based ink and a wooden press adapted from those used for wine. ")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, help="a model file (default: the embedded default model)")
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if a.gguf is None:
        from realizar.default_model import default_model_path

        a.gguf = default_model_path()
    loaded = load_model(a.gguf)
    ids = load_tokenizer(loaded).encode(TEXT * 8)[: a.tokens]
    n, first, bs = len(ids), 16, 16
    ref = ReferenceModel.from_loaded(loaded, max_len=n + 1).prefill(ids, all_logits=True)[first - 1:]
    lines = [f"# KV cache formats against f32 — {a.gguf.name}, CPU (NumPy), {datetime.date.today()}", "",
             f"Command: `python tools/kv_divergence.py --tokens {a.tokens}`", "",
             f"{n} prompt tokens of English text: the first {first} prefilled, then one decode step per token; "
             f"every position's logits against the reference model's (f32 cache).", "",
             "| KV format | max abs logit diff | max diff / max abs logit | greedy agreement |", "|---|---:|---:|---:|"]
    for fmt in KV_FORMATS:
        if fmt == "q8_0" and loaded.config.head_dim % 32:
            lines.append(f"| {fmt} | - | - | head_dim {loaded.config.head_dim} is not a multiple of 32 |")
            continue
        be = ReferenceBatchBackend(loaded, num_blocks=2 + -(-n // bs), block_size=bs, kv_dtype=fmt,
                                   context_length=n + 1)
        table = list(range(1, 1 + -(-n // bs)))
        got = [be.prefill(ids[:first], 0, table).logits(0)]
        got += [be.decode([ids[p]], [p], [table]).logits(0) for p in range(first, n)]
        got = np.stack(got)
        diff = np.abs(got - ref)
        agree = int((got.argmax(1) == ref.argmax(1)).sum())
        lines.append(f"| {fmt} | {diff.max():.4f} | {diff.max() / np.abs(ref).max():.2e} | {agree}/{len(ref)} |")
        print(lines[-1], flush=True)
    text = "\n".join(lines)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
