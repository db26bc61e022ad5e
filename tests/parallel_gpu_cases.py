"""Shared cases and runners for the tensor-parallel GPU model (realizar.parallel.gpu), used on the CPU
emulator (tests/test_parallel_gpu_emulated.py) and on GPUs (tests/gpu/test_parallel_gpu.py).

Each run feeds the model the oracle's greedy tokens (so a divergence shows up as a wrong token at the
step where it happens, not as a cascade) and keeps, per step, the model's greedy token (the
distributed argmax) and its logits (all-gathered from the ranks)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from realizar.models.reference import ReferenceModel
from realizar.parallel.reference import ShardedReferenceModel

RTOL = 2e-4  # max |gpu - ref| / max |ref| per step: the GPU model tests' tolerance

# 8 query / 4 KV heads: splits over 1, 2, 4 (O and down columns of 128/N and 256/N values: whole
# 32-value blocks at N = 4); vocabulary 322 = 81 + 81 + 81 + 79 at N = 4 (the last piece padded).
DIMS = dict(vocab_size=322, hidden_size=128, intermediate_size=256, num_heads=8, num_kv_heads=4, head_dim=32)
# SmolLM2-135M's head layout (9 query / 3 KV heads): splits over 3 only (q_dim 288 / 3 = 96, FFN 192 / 3 = 64).
SMOL = dict(vocab_size=322, hidden_size=96, intermediate_size=192, num_heads=9, num_kv_heads=3, head_dim=32)
# K-quants: every split along K whole 256-value super-blocks at N = 2 and 4 (q_dim 1024, FFN 1024).
KDIMS = dict(vocab_size=320, hidden_size=256, intermediate_size=1024, num_heads=8, num_kv_heads=4, head_dim=128)

# (id, architecture, weight type, dims, layers, rank counts)
CASES = [
    ("llama-Q8_0", "llama", "Q8_0", DIMS, 2, (1, 2, 4)),
    ("qwen2-Q4_0-bias", "qwen2", "Q4_0", DIMS, 1, (2, 4)),
    ("qwen3-Q4_1-qknorm", "qwen3", "Q4_1", DIMS, 1, (2,)),
    ("mistral-F16", "mistral", "F16", DIMS, 1, (4,)),
    ("llama-Q5_0-tied", "llama", "Q5_0", dict(DIMS, tie_word_embeddings=True), 1, (2, 4)),
    ("smol-Q4_1-9x3heads", "llama", "Q4_1", dict(SMOL, tie_word_embeddings=True), 2, (3,)),
    ("llama-Q4_K", "llama", "Q4_K", KDIMS, 1, (2, 4)),
    ("qwen2-Q6_K", "qwen2", "Q6_K", KDIMS, 1, (2,)),
]
PROMPT = [5, 17, 42, 99]
STEPS = 3


@dataclass
class Run:
    tokens: list[int] = field(default_factory=list)  # greedy token after the prompt and each decode
    logits: list[np.ndarray] = field(default_factory=list)


def reference_run(model, prompt, steps: int) -> Run:
    """A NumPy model (ReferenceModel or ShardedReferenceModel) decoding its own greedy tokens."""
    run = Run()
    logits = np.asarray(model.prefill(prompt))
    for step in range(steps + 1):
        run.logits.append(logits)
        run.tokens.append(int(np.argmax(logits)))
        if step < steps:
            logits = np.asarray(model.decode(run.tokens[-1]))
    return run


def device_run(model, prompt, feed: list[int]) -> Run:
    """A GPU-side model (GpuModel or TensorParallelModel) fed ``feed`` after ``prompt``."""
    run = Run()
    out = model.prefill(prompt)
    for tok in [None, *feed]:
        if tok is not None:
            out = model.decode(tok)
        run.tokens.append(out.greedy_token())
        run.logits.append(np.array(np.asarray(out), copy=True))
    return run


def oracles(loaded, n: int, max_len: int, prompt=PROMPT, steps: int = STEPS) -> tuple[Run, Run]:
    """The unsharded reference and the N-rank sharded reference, each decoding greedily."""
    return (reference_run(ReferenceModel.from_loaded(loaded, max_len=max_len), prompt, steps),
            reference_run(ShardedReferenceModel.from_loaded(loaded, n, max_len=max_len), prompt, steps))


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.isfinite(got).all(), "non-finite logits"
    return float(np.abs(got - want).max() / np.abs(want).max())


def assert_matches(got: Run, want: Run, what: str) -> None:
    """The same greedy tokens at every step, logits within RTOL, and the distributed argmax equal to the
    argmax of the gathered logits."""
    assert got.tokens == want.tokens, f"{what}: tokens {got.tokens}, oracle {want.tokens}"
    for step, (g, w) in enumerate(zip(got.logits, want.logits)):
        assert g.shape == w.shape, f"{what} step {step}: logits shaped {g.shape}, oracle {w.shape}"
        err = rel_err(g, w)
        assert err < RTOL, f"{what} step {step}: max |got - oracle| / max |oracle| = {err:.2e}"
        assert got.tokens[step] == int(np.argmax(g)), f"{what} step {step}: distributed argmax != argmax of logits"
