"""Write a benchmark shape's random-weight model to a GGUF file that llama.cpp and realizar both load, so the two
engines can be timed on the very same file.

    python tools/write_gguf.py SHAPE OUT.gguf [--seed N]
    python tools/write_gguf.py llama-3-8b /tmp/llama-3-8b-q4_k.gguf
    llama-bench -m /tmp/llama-3-8b-q4_k.gguf -p 512 -n 128      # then, on the same file:
    realizar bench -m /tmp/llama-3-8b-q4_k.gguf

SHAPE is a key of ``DECODE_SHAPES`` or ``MOE_SHAPES`` (realizar.models.random); the tensors are
``bench_model(SHAPE, seed)``'s, written byte for byte (a llama file's Q/K rows are random, so they need no
permutation). :func:`write_gguf` writes any ``(config, tensors)`` pair.

What the file carries:

* ``{arch}.*`` hyper-parameters llama.cpp requires (``context_length``, ``embedding_length``, ``block_count``,
  ``attention.head_count``, ``attention.layer_norm_rms_epsilon``) plus ``feed_forward_length``,
  ``attention.head_count_kv``, ``attention.key_length`` / ``value_length`` (head_dim need not be
  hidden/heads: Qwen3-30B-A3B's is not), ``rope.dimension_count``, ``rope.freq_base``, ``vocab_size`` and,
  for a mixture of experts, ``expert_count``, ``expert_used_count`` and ``expert_feed_forward_length``;
  ``general.file_type`` names the layers' main type.
* a byte-level BPE tokenizer (``tokenizer.ggml.model = "gpt2"``) of ``vocab_size`` unique tokens: the 256
  GPT-2 byte symbols, ``Ġt`` with its one merge ``Ġ t`` (llama.cpp requires the merges key), ``<pad_N>``
  fillers and ``<|endoftext|>`` (control; BOS and EOS) last. Pre-tokenizer ``qwen2`` for Qwen
  architectures, ``llama-bpe`` otherwise (both known to llama.cpp and realizar).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter

import gguf
import numpy as np

from realizar.models.config import ModelConfig
from realizar.models.gguf_loader import ROPE_TYPE_BY_ARCH
from realizar.models.random import DECODE_SHAPES, MOE_SHAPES, bench_model
from realizar.models.tensor import QuantTensor

T = gguf.GGMLQuantizationType
_GGUF_ARCH = {"mistral": "llama", "mixtral": "llama"}  # (llama.cpp writes these as llama)
_FILE_TYPES = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16", "Q8_0": "MOSTLY_Q8_0",
               "Q4_0": "MOSTLY_Q4_0", "Q4_1": "MOSTLY_Q4_1", "Q5_0": "MOSTLY_Q5_0", "Q5_1": "MOSTLY_Q5_1",
               "Q6_K": "MOSTLY_Q6_K"}  # fmt: skip
EOS_TEXT = "<|endoftext|>"


def byte_symbols() -> list[str]:
    """GPT-2's 256 byte-level symbols (``bytes_to_unicode``), in its order: printable bytes stand for
    themselves, the others for ``chr(256 + n)``."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in keep]
    return [chr(b) for b in keep] + [chr(256 + n) for n in range(len(rest))]


def vocabulary(vocab_size: int) -> tuple[list[str], list[int], list[str], int]:
    """``(tokens, token types, merges, eos id)`` of the stand-in tokenizer described above."""
    syms = byte_symbols()
    merged = "\u0120t"  # "Ġt": a space then "t"
    head = [*syms, merged]
    if vocab_size < len(head) + 1:
        raise ValueError(f"vocab_size {vocab_size} is below the {len(head) + 1} tokens the stand-in tokenizer needs")
    pads = [f"<pad_{i}>" for i in range(len(head), vocab_size - 1)]
    tokens = [*head, *pads, EOS_TEXT]
    types = [1] * (vocab_size - 1) + [3]  # NORMAL..., CONTROL
    return tokens, types, ["\u0120 t"], vocab_size - 1


def file_type(tensors: dict[str, QuantTensor]) -> int:
    """``general.file_type``: the type holding most bytes of the layer matrices; a K-quant is ``_M`` when
    some layer matrices are Q6_K (the quantizer's mixed recipe), else ``_S``."""
    by_type: Counter[str] = Counter()
    for n, t in tensors.items():
        if n.startswith("blk.") and len(t.shape) >= 2:
            by_type[T(t.ggml_type).name] += t.nbytes
    main = by_type.most_common(1)[0][0]
    if main in ("Q4_K", "Q5_K"):
        name = f"MOSTLY_{main}_{'M' if 'Q6_K' in by_type else 'S'}"
    else:
        name = _FILE_TYPES.get(main, "GUESSED")
    return int(gguf.LlamaFileType[name])


def _add_hparams(w: gguf.GGUFWriter, c: ModelConfig) -> None:
    w.add_context_length(c.context_length)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(float(c.rope_theta))
    w.add_layer_norm_rms_eps(float(c.rms_norm_eps))
    w.add_vocab_size(c.vocab_size)
    if c.is_moe:
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_used)
        w.add_expert_feed_forward_length(c.expert_ffn_size)
        if not c.expert_weights_norm:  # (llama.cpp's qwen3moe graph renormalises regardless)
            w.add_expert_weights_norm(False)


def _add_tokenizer(w: gguf.GGUFWriter, c: ModelConfig, arch: str) -> None:
    tokens, types, merges, eos = vocabulary(c.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch.startswith("qwen") else "llama-bpe")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(eos)
    w.add_eos_token_id(eos)
    w.add_add_bos_token(False)


def write_gguf(config: ModelConfig, tensors: dict[str, QuantTensor], path: str | os.PathLike,
               name: str | None = None, progress: bool = False) -> int:
    """Write ``config`` and ``tensors`` (canonical GGUF names, raw GGUF bytes) as a GGUF file at ``path``
    with the metadata and tokenizer llama.cpp needs; returns the file size in bytes."""
    c = config
    if c.rope_scaling is not None:
        raise ValueError("RoPE scaling is not written by this tool")
    arch = _GGUF_ARCH.get(c.architecture, c.architecture)
    if ROPE_TYPE_BY_ARCH.get(arch) != c.rope_type:
        raise ValueError(f"a {arch!r} GGUF implies {ROPE_TYPE_BY_ARCH.get(arch)} RoPE; the config has {c.rope_type}")
    w = gguf.GGUFWriter(os.fspath(path), arch=arch)
    w.add_name(name or f"random {arch}")
    w.add_file_type(file_type(tensors))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_hparams(w, c)
    _add_tokenizer(w, c, arch)
    # raw bytes shaped (..., row bytes): GGUFWriter turns the byte shape into the element shape (reversed on disk)
    rows = {n: t.data.reshape(*t.shape[:-1], -1) for n, t in tensors.items()}
    for n, t in tensors.items():
        w.add_tensor_info(n, rows[n].shape, np.dtype(np.uint8), rows[n].nbytes, raw_dtype=T(t.ggml_type))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    total, done, shown = sum(r.nbytes for r in rows.values()), 0, 0
    for r in rows.values():  # (in add_tensor_info's order, as write_tensor_data expects)
        w.write_tensor_data(r)
        done += r.nbytes
        if progress and done * 10 // total > shown:
            shown = done * 10 // total
            print(f"  {shown * 10}% ({done / 2**30:.2f} of {total / 2**30:.2f} GiB)", flush=True)
    w.close()
    return os.path.getsize(path)


def main(argv: list[str] | None = None) -> int:
    known = {**DECODE_SHAPES, **MOE_SHAPES}
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shape", help="one of: " + ", ".join(known))
    ap.add_argument("out", help="the GGUF file to write")
    ap.add_argument("--seed", type=int, default=0, help="random seed of the weights (default 0)")
    args = ap.parse_args(argv)
    if args.shape not in known:
        print(f"write_gguf: unknown shape {args.shape!r}; known: {', '.join(known)}", file=sys.stderr)
        return 2
    config, tensors, _ = bench_model(args.shape, args.seed)
    print(f"{args.shape}: {len(tensors)} tensors -> {args.out}", flush=True)
    size = write_gguf(config, tensors, args.out, name=f"random {args.shape}", progress=True)
    print(f"wrote {args.out}: {size:,} bytes ({size / 2**30:.2f} GiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
