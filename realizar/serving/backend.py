"""The interface between the scheduler and a model that runs many sequences over a paged KV pool.

Both backends implement :class:`BatchBackend`: the NumPy one
(:class:`~realizar.serving.cpu_backend.ReferenceBatchBackend`) and the GPU one
(``realizar.gpu.batch.GpuBatchBackend``). A backend owns the KV pool (``num_blocks`` blocks of
``block_size`` positions per layer, block 0 the null block); the scheduler owns the allocation
(:class:`~realizar.serving.blocks.BlockPool`) and hands each call the block tables to use.

:class:`RowSampling` (how the device samples one row: temperature, top-k, top-p, seed, step) is
:class:`realizar.sampling.RowSampling`, re-exported here.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import numpy as np

from realizar.errors import ShapeError
from realizar.models.config import ModelConfig
from realizar.sampling import RowSampling, sample_rows  # one RowSampling for both backends

__all__ = ["BatchBackend", "BatchOutput", "RowSampling", "HostBatchOutput"]


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
            raise ShapeError(f"batch logits must be [B, vocab], got shape {self._logits.shape}")

    def __len__(self) -> int:
        return self._logits.shape[0]

    def logits(self, i: int) -> np.ndarray:
        return self._logits[i].copy()

    def sample(self, specs: Sequence[RowSampling]) -> np.ndarray:
        if len(specs) != self._logits.shape[0]:
            raise ShapeError(f"sample needs one spec per row: {self._logits.shape[0]} rows, got {len(specs)}")
        return np.asarray(sample_rows(self._logits, specs), dtype=np.int64)
