"""A small mixture-of-experts model through every MoE kernel, run under compute-sanitizer: the router's top-k,
the expert GEMV over (token, slot) pairs (batch-1 decode and small batches), the grouping by expert and the
grouped expert GEMM (prefill chunks), the weighted sum.

    compute-sanitizer --tool memcheck python tools/sanitize_moe.py
    compute-sanitizer --tool racecheck python tools/sanitize_moe.py --small

Each run checks its logits against the NumPy reference model (within 1%; batched decode steps, whose f16
inputs can flip a router near-tie of these random weights, within 5%), so a kernel that misbehaves only under
the sanitizer is noticed too. 8 experts of which 2 a token, 12 of them in the second case (not a multiple of 8:
one row at a time), rows of 256 (K-quants), prompts of 5 and 21 tokens (chunks of 8: grouped; the rest: GEMV).
"""

from __future__ import annotations

import argparse

import numpy as np

from realizar import cuda
from realizar.gpu.batch import GpuBatchBackend
from realizar.gpu.model import GpuModel
from realizar.models.config import ModelConfig
from realizar.models.random import random_model
from realizar.models.reference import ReferenceModel
from realizar.sampling import RowSampling


def rel_err(got, want) -> float:
    return float(np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max())


def config(experts: int) -> ModelConfig:
    return ModelConfig(architecture="qwen3moe", vocab_size=300, hidden_size=256, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=64, intermediate_size=512, rope_theta=1e4, rope_type="neox",
                       rms_norm_eps=1e-6, context_length=128, qk_norm=True, num_experts=experts, num_experts_used=2,
                       expert_ffn_size=256)


def check(dev, experts: int, wtype: str, small: bool) -> None:
    cfg = config(experts)
    tensors = random_model(cfg, wtype, "Q8_0", "Q8_0", seed=experts)
    rng = np.random.default_rng(experts)
    prompts = [[int(t) for t in rng.integers(0, cfg.vocab_size, n)] for n in ((5, 21) if not small else (21,))]
    model = GpuModel(cfg, tensors, max_len=64, device=dev)
    for prompt in prompts:  # batch 1: the decode graph, token by token
        ref = ReferenceModel(cfg, tensors, max_len=64)
        model.reset()
        got, want = np.asarray(model.prefill(prompt)), ref.prefill(prompt)
        assert rel_err(got, want) < 1e-2, ("decode", experts, wtype, len(prompt))
    model.release_kv()
    if experts % 8:
        return
    be = GpuBatchBackend(model, num_blocks=16, block_size=16, kv_dtype="f32", max_batch=4, max_context=64,
                         prefill_chunk=8)
    tables = [[1, 2, 3], [4, 5, 6]]
    refs, tokens = [], []
    for prompt, table in zip(prompts, tables):
        ref = ReferenceModel(cfg, tensors, max_len=64)
        want = ref.prefill(prompt)
        got = be.prefill(prompt, 0, table).logits(0)
        assert rel_err(got, want) < 1e-2, ("prefill", wtype, len(prompt))
        refs.append(ref)
        tokens.append(int(np.argmax(want)))
    positions = [len(p) for p in prompts]
    out = be.decode(tokens, positions, tables[: len(prompts)])
    out.sample([RowSampling()] * len(prompts))
    for r, ref in enumerate(refs):
        err = rel_err(out.logits(r), ref.decode(tokens[r]))  # (f16 inputs: a router near-tie may pick another
        assert err < 5e-2, ("batched decode", wtype, r, err)  # expert for a token; random weights, small logits)
    be.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="fewer cases (racecheck is slow)")
    a = ap.parse_args()
    dev = cuda.current_device()
    for experts, wtype in ((8, "Q4_K"), (8, "Q8_0"), (12, "Q6_K"))[: 2 if a.small else 3]:
        check(dev, experts, wtype, a.small)
        print(f"moe: {experts} experts, {wtype}: ok", flush=True)


if __name__ == "__main__":
    main()
