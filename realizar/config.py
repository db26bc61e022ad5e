"""ServingConfig: the runtime and serving settings, each with its one default.

    cfg = ServingConfig(max_batch=32, kv_dtype="q8_0")
    serving = ServingEngine.from_engine(engine, config=cfg)

Every layer that takes one of these settings (the CLI, the server, :class:`realizar.serving.ServingEngine`,
the backends) reads its default from here instead of restating it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from realizar.errors import InvalidRequestError

__all__ = ["DEFAULT_MAX_CONTEXT", "KV_MEMORY_SHARE", "ServingConfig"]

KV_MEMORY_SHARE = 0.5  # the GPU KV pool's share of the free device memory when no size is given
DEFAULT_MAX_CONTEXT = 8192  # positions a sequence may reach when no max_context is given (and the model allows)


@dataclass(frozen=True)
class ServingConfig:
    """``block_size``: positions per KV block; ``max_batch``: most sequences per decode step;
    ``kv_dtype``: the KV cache's element type (None: f16 on a GPU, f32 on the CPU, whose NumPy backend
    is the oracle); ``kv_memory``: the KV pool's size, bytes or (a float in (0, 1]) a share of the free
    device memory (None: :data:`KV_MEMORY_SHARE` of the free GPU memory; on the CPU, room for
    ``min(max_batch, 8)`` full contexts); ``num_blocks``: the pool's size in blocks instead; ``max_context``: most positions per sequence (capped at the model's
    context length); ``prefill_chunk``: most prompt tokens through the layers at once;
    ``max_batched_tokens``: the per-step token budget of the scheduler (decode rows plus one prefill
    chunk); ``prefill_min_batch``: shorter prompts go token by token through the decode step;
    ``gemv_cols_rows``: batches of up to this many rows use the tensor-core GEMV's columns kernel;
    ``f16_weights``: keep f16 copies of the weights for batches of 33-64 rows (None: when they fit; on sm_90
    larger batches read the quantized weights through ``gemm_wg`` either way, and so do all where none is kept);
    ``async_scheduling``: launch each decode step before reading the previous one's tokens, so the host's work
    on them overlaps the GPU's (:mod:`realizar.serving.scheduler`)."""

    block_size: int = 32
    max_batch: int = 256
    kv_dtype: str | None = None
    kv_memory: float | int | None = None
    num_blocks: int | None = None
    max_context: int | None = None
    prefill_chunk: int = 2048
    max_batched_tokens: int = 2048
    prefill_min_batch: int = 16
    gemv_cols_rows: int = 4
    f16_weights: bool | None = None
    async_scheduling: bool = True

    def __post_init__(self) -> None:
        for name in ("block_size", "max_batch", "max_context", "prefill_chunk", "max_batched_tokens",
                     "prefill_min_batch"):
            v = getattr(self, name)
            if v is None and name == "max_context":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidRequestError(f"{name} must be a positive integer, got {v!r}")
        if not isinstance(self.async_scheduling, bool):
            raise InvalidRequestError(f"async_scheduling must be True or False, got {self.async_scheduling!r}")
        if self.num_blocks is not None and self.kv_memory is not None:
            raise InvalidRequestError("give num_blocks or kv_memory, not both")
        if self.kv_memory is not None and (isinstance(self.kv_memory, bool) or self.kv_memory <= 0):
            raise InvalidRequestError(f"kv_memory must be a positive number of bytes or a share of the free "
                                      f"memory, got {self.kv_memory!r}")

    def with_(self, **changes: Any) -> "ServingConfig":
        """A copy with ``changes`` (keys that are None keep this config's value)."""
        unknown = set(changes) - {f.name for f in fields(self)}
        if unknown:
            raise InvalidRequestError(f"unknown serving setting(s) {sorted(unknown)}")
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
