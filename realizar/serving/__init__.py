"""Continuous batching: many sequences share one paged KV pool and advance together.

* :mod:`~realizar.serving.blocks` — :class:`BlockPool`, the block allocator and prefix cache;
* :mod:`~realizar.serving.backend` — the :class:`BatchBackend` protocol (prefill and batched decode
  over block tables), :class:`BatchOutput`, :class:`RowSampling`;
* :mod:`~realizar.serving.cpu_backend` — :class:`ReferenceBatchBackend`, the NumPy backend;
* :mod:`~realizar.serving.scheduler` — :class:`Scheduler`, the iteration-level loop;
* :mod:`~realizar.serving.engine` — :class:`ServingEngine`, a thread running the scheduler behind
  ``submit`` / ``generate_batch``.
"""

from realizar.serving.backend import BatchBackend, BatchOutput, RowSampling
from realizar.serving.blocks import BlockPool, PoolStats
from realizar.serving.engine import EngineStats, RequestHandle, ServingEngine, StepStats
from realizar.serving.scheduler import Scheduler

__all__ = ["BatchBackend", "BatchOutput", "BlockPool", "EngineStats", "PoolStats", "RequestHandle", "RowSampling",
           "Scheduler", "ServingEngine", "StepStats"]
