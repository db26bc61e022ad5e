"""The interface between the scheduler and a model that runs many sequences over a paged KV pool.

Both backends implement :class:`BatchBackend`: the NumPy one
(:class:`~realizar.serving.cpu_backend.ReferenceBatchBackend`) and the GPU one
(``realizar.gpu.batch.GpuBatchBackend``). A backend owns the KV pool (``num_blocks`` blocks of
``block_size`` positions per layer, block 0 the null block); the scheduler owns the allocation
(:class:`~realizar.serving.blocks.BlockPool`) and hands each call the block tables to use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import numpy as np

from realizar.models.config import ModelConfig

__all__ = ["BatchBackend", "BatchOutput", "RowSampling", "HostBatchOutput"]


@dataclass(frozen=True)
class RowSampling:
    """How to choose one row's token on the device: temperature 0 is argmax (lowest index on ties);
    otherwise top-k (0: all), then top-p, then a Gumbel-max draw whose randomness depends only on
    ``(seed, step, token)`` (``step`` = index of the token being sampled in its sequence), so a
    request gets the same tokens alone or in any batch (:func:`realizar.sampling.sample_rows`)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    step: int = 0


@runtime_checkable
class BatchOutput(Protocol):
    """The logits of one forward call, where the backend keeps them (host or device memory)."""

    def sample(self, specs: Sequence[RowSampling]) -> np.ndarray:
        """One token per row (int64 ``[B]``), row ``i`` chosen by ``specs[i]``."""
        ...

    def logits(self, i: int) -> np.ndarray:
        """float32 ``[vocab]``: a host copy of row ``i``'s logits."""
        ...


@runtime_checkable
class BatchBackend(Protocol):
    config: ModelConfig
    block_size: int
    num_blocks: int
    max_batch: int
    context_length: int

    def prefill(self, tokens: Sequence[int], start: int, block_table: Sequence[int]) -> BatchOutput:
        """Write K/V of positions ``start .. start + len(tokens) - 1`` through ``block_table`` and
        attend causally over ``[0, start + len(tokens))``; a 1-row output: the last token's logits."""
        ...

    def decode(
        self, tokens: Sequence[int], positions: Sequence[int], block_tables: Sequence[Sequence[int]]
    ) -> BatchOutput:
        """Advance B sequences by one token each: row ``i`` feeds ``tokens[i]`` at ``positions[i]``
        through ``block_tables[i]``; B rows of logits."""
        ...


class HostBatchOutput:
    """A :class:`BatchOutput` over logits already on the host (``[B, vocab]`` float32)."""

    def __init__(self, logits: np.ndarray):
        self._logits = np.asarray(logits, dtype=np.float32)
        if self._logits.ndim != 2:
            raise ValueError(f"batch logits must be [B, vocab], got shape {self._logits.shape}")

    def __len__(self) -> int:
        return self._logits.shape[0]

    def logits(self, i: int) -> np.ndarray:
        return self._logits[i].copy()

    def sample(self, specs: Sequence[RowSampling]) -> np.ndarray:
        from realizar.errors import ShapeError

        if len(specs) != self._logits.shape[0]:
            raise ShapeError(f"sample needs one spec per row: {self._logits.shape[0]} rows, got {len(specs)}")
        if all(s.temperature == 0.0 for s in specs):
            # every row greedy: the argmax is the whole rule (np.argmax takes the lowest index on ties)
            return np.argmax(self._logits, axis=1).astype(np.int64)
        from realizar.sampling import sample_rows

        return np.asarray(sample_rows(self._logits, specs), dtype=np.int64)
