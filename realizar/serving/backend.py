"""The interface between the scheduler and a model that runs many sequences over a paged KV pool.

Both backends implement :class:`BatchBackend`: the NumPy one
(:class:`~realizar.serving.cpu_backend.ReferenceBatchBackend`) and the GPU one
(``realizar.gpu.batch.GpuBatchBackend``). A backend owns the KV pool (``num_blocks`` blocks of
``block_size`` positions per layer, block 0 the null block); the scheduler owns the allocation
(:class:`~realizar.serving.blocks.BlockPool`) and hands each call the block tables to use.

A decode step can start before the host has read the previous one's tokens: a ``tokens`` entry
:func:`fed` ``(r)`` means "the token the previous decode call sampled in its row r", which the backend
takes where it already is (the GPU's feeds it to the next step on the device), and
:meth:`BatchOutput.launch` starts the sampling without waiting for it (:class:`PendingTokens`). So the
host prepares step N + 1 and launches it, then handles step N's tokens while N + 1 runs. A fed entry is
valid only right after a decode call whose output was sampled.

:class:`RowSampling` (how the device samples one row: temperature, top-k, top-p, seed, step) is
:class:`realizar.sampling.RowSampling`, re-exported here.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence, runtime_checkable

import numpy as np

from realizar.errors import ShapeError
from realizar.models.config import ModelConfig
from realizar.sampling import RowSampling, sample_rows, unpack_specs  # one RowSampling for both backends

__all__ = ["BatchBackend", "BatchOutput", "HostBatchOutput", "PendingTokens", "RowSampling", "fed"]


def fed(row: int) -> int:
    """The ``tokens`` entry of :meth:`BatchBackend.decode` for the token the previous decode call sampled in
    its row ``row`` (not yet read by the host): ``-1 - row``."""
    return -1 - int(row)


class PendingTokens:
    """Tokens being drawn: :meth:`wait` returns them (int64 ``[B]``) once they are there."""

    def __init__(self, tokens: np.ndarray):
        self._tokens = tokens

    def wait(self) -> np.ndarray:
        return self._tokens


@runtime_checkable
class BatchOutput(Protocol):
    """The logits of one forward call, where the backend keeps them (host or device memory)."""

    def sample(self, specs: Sequence[RowSampling]) -> np.ndarray:
        """One token per row (int64 ``[B]``), row ``i`` chosen by ``specs[i]`` (RowSampling, or rows packed by
        :func:`realizar.sampling.pack_specs`)."""
        ...

    def launch(self, specs: Sequence[RowSampling]) -> PendingTokens:
        """:meth:`sample` without waiting for the tokens (a GPU step runs on while the host goes on)."""
        ...

    def logits(self, i: int) -> np.ndarray:
        """float32 ``[vocab]``: a host copy of row ``i``'s logits."""
        ...


@runtime_checkable
class BatchBackend(Protocol):
    config: ModelConfig
    feeds_tokens: bool  # decode takes fed() entries
    block_size: int
    num_blocks: int
    max_batch: int
    context_length: int

    def prefill(self, tokens: Sequence[int], start: int, block_table: Sequence[int]) -> BatchOutput:
        """Write K/V of positions ``start .. start + len(tokens) - 1`` through ``block_table`` and
        attend causally over ``[0, start + len(tokens))``; a 1-row output: the last token's logits."""
        ...

    def hidden_rows(self, tokens: Sequence[int], block_table: Sequence[int]) -> np.ndarray:
        """Prefill ``tokens`` at positions ``0 ..`` through ``block_table``; float32 ``[len(tokens), hidden]``: the
        final-norm hidden rows (what the LM head would read; embeddings pool them). Touches no sampled token."""
        ...

    def decode(
        self, tokens: Sequence[int], positions: Sequence[int], block_tables: Sequence[Sequence[int]]
    ) -> BatchOutput:
        """Advance B sequences by one token each: row ``i`` feeds ``tokens[i]`` (an id, or :func:`fed`
        ``(r)``) at ``positions[i]`` through ``block_tables[i]``; B rows of logits."""
        ...


class HostBatchOutput:
    """A :class:`BatchOutput` over logits already on the host (``[B, vocab]`` float32); ``on_sample(tokens)``
    is told the tokens drawn (a backend that takes :func:`fed` entries keeps them)."""

    def __init__(self, logits: np.ndarray, on_sample: Callable[[np.ndarray], None] | None = None):
        self._logits = np.asarray(logits, dtype=np.float32)
        if self._logits.ndim != 2:
            raise ShapeError(f"batch logits must be [B, vocab], got shape {self._logits.shape}")
        self._on_sample = on_sample

    def __len__(self) -> int:
        return self._logits.shape[0]

    def logits(self, i: int) -> np.ndarray:
        return self._logits[i].copy()

    def sample(self, specs: Sequence[RowSampling]) -> np.ndarray:
        if len(specs) != self._logits.shape[0]:
            raise ShapeError(f"sample needs one spec per row: {self._logits.shape[0]} rows, got {len(specs)}")
        if isinstance(specs, np.ndarray):  # (packed rows: pack_specs)
            specs = unpack_specs(specs)
        tokens = np.asarray(sample_rows(self._logits, specs), dtype=np.int64)
        if self._on_sample is not None:
            self._on_sample(tokens)
        return tokens

    def launch(self, specs: Sequence[RowSampling]) -> PendingTokens:
        return PendingTokens(self.sample(specs))
