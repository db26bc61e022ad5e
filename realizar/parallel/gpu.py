"""The tensor-parallel GPU model: one model over N ranks, rank ``r`` a :class:`~realizar.gpu.model.GpuModel`
over its shard (:meth:`ShardingPlan.shard`) on ``reducer.devices[r]``, the hidden state summed over
the ranks after every O and down projection.

Per decode step and rank (the layer program of :mod:`realizar.gpu.decoder` at the rank's shapes, paused
at its all-reduce points)::

    embedding (whole table on every rank)
    per layer:  RMSNorm, QKV GEMV (its heads), RoPE + KV append (its KV heads), paged decode attention,
                O GEMV (its columns; rank 0 adds the residual) -> all-reduce(x)
                RMSNorm, gate/up GEMV + SwiGLU (its FFN columns),
                down GEMV (its columns; rank 0 adds the residual) -> all-reduce(x)
    final RMSNorm, LM head (its vocabulary rows) into its slot of a gathered logits buffer,
    its greedy candidate (the packed (value, global index) of its best logit) into its slot of a
    candidates buffer -> all-gather(candidates) -> rank 0: argmax over the N candidates

Only rank 0 adds the residual in the O and down GEMVs: the others write their partial sums, and the
all-reduce adds them to rank 0's ``x + partial``, so every rank ends with ``x + sum of partials``.
The greedy token is a distributed argmax: 8 bytes per rank are gathered, not the logits; the
candidates are packed so that their u64 maximum is the largest value with the lowest global index
(``argmax_pack``), exactly ``np.argmax`` of the whole vocabulary. The logits themselves are gathered
only when asked for (sampling, logprobs: :meth:`TensorParallelModel.read_logits`).

The collectives go through a :class:`Reducer`:

* :class:`NcclReducer` — one NCCL communicator per GPU (:mod:`realizar.parallel.nccl`), the N ranks'
  collectives issued in one NCCL group from this thread; each rank has its own stream and its own
  CUDA graph, the NCCL kernels captured in it.
* :class:`LocalReducer` — the N ranks on ONE device, sharing one stream and one graph; the all-reduce
  is ``residual_add`` kernels (sum into rank 0's buffer, then rank 0's sum added to zeros into every
  other rank's), and the all-gathers need no work: every rank writes its slot of one shared buffer.
  It runs N > 1 on a single GPU (NCCL refuses two ranks on one GPU) and on the CPU emulator, to check
  the sharded model; it is not a way to speed anything up.

Prompts go token by token through the decode step (the batched prefill has no all-reduce points
yet); each step is one graph launch per rank (local: one in all).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping, Sequence

import numpy as np

from realizar import cuda
from realizar.errors import ShapeError
from realizar.gpu.batch import GpuBatchBackend
from realizar.gpu.decoder import Decoder
from realizar.gpu.elementwise import ElementwiseOps
from realizar.gpu.model import DEFAULT_MAX_LEN, DeviceLogits, GpuModel, StepDecoder
from realizar.models.config import ModelConfig
from realizar.models.tensor import QuantTensor
from realizar.parallel.sharding import ShardingPlan, make_plan

__all__ = ["Reducer", "LocalReducer", "NcclReducer", "RankBackend", "RankModel", "TensorParallelModel", "LOGIT_SLOT_ALIGN"]

LOGIT_SLOT_ALIGN = 64  # elements: each rank's slot of the gathered logits starts 256-byte aligned
_DONE = object()


# ----------------------------------------------------------------------------------------------
# Reducers
# ----------------------------------------------------------------------------------------------


class Reducer:
    """The collectives of N ranks. ``devices[r]`` is rank ``r``'s device; ``shared_device`` says that
    all ranks sit on one device and must then share one stream (:class:`LocalReducer`).

    * :meth:`all_reduce`: in place, float32 sum: ``bufs[r][:count]`` of every rank becomes the sum;
    * :meth:`gather_buffers`: per rank, a buffer of ``world_size * count`` elements whose slot
      ``[r*count, (r+1)*count)`` rank ``r`` fills;
    * :meth:`all_gather`: in place over those buffers: every rank gets every slot.

    Each is issued on the ranks' streams (``streams[r]``) without synchronising, so it can be captured
    into a CUDA graph."""

    world_size: int
    devices: list
    shared_device: bool = False

    def _check(self, bufs: Sequence[Any], streams: Sequence[Any], what: str) -> None:
        if len(bufs) != self.world_size or len(streams) != self.world_size:
            raise ShapeError(f"{what} over {self.world_size} ranks got {len(bufs)} buffers and {len(streams)} streams")

    def all_reduce(self, bufs: Sequence[cuda.GpuBuffer], count: int, streams: Sequence[cuda.Stream]) -> None:
        raise NotImplementedError

    def gather_buffers(self, count: int, dtype: Any) -> list[cuda.GpuBuffer]:
        raise NotImplementedError

    def all_gather(self, bufs: Sequence[cuda.GpuBuffer], count: int, dtype: Any,
                   streams: Sequence[cuda.Stream]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the reducer holds (communicators)."""


class LocalReducer(Reducer):
    """``world_size`` ranks on one device (a GPU or an :class:`~realizar.cuda.EmulatedDevice`), for
    testing the sharded model where NCCL cannot run it. All ranks must issue on one stream."""

    shared_device = True

    def __init__(self, world_size: int, device: Any = None):
        if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)) or world_size < 1:
            raise ShapeError(f"a reducer needs a whole number of ranks >= 1, got {world_size!r}")
        self.world_size = int(world_size)
        self.device = device or cuda.current_device()
        self.devices = [self.device] * self.world_size
        self.ops = ElementwiseOps(self.device)
        self._zeros: cuda.GpuBuffer | None = None

    def _zero_buffer(self, count: int) -> cuda.GpuBuffer:
        if self._zeros is None or self._zeros.count < count:
            self._zeros = self.ops.buffer(count, zero=True)
        return self._zeros

    def _one_stream(self, streams: Sequence[cuda.Stream], what: str) -> cuda.Stream:
        if any(s is not streams[0] for s in streams):
            raise ShapeError(f"the local {what} needs every rank on one stream (ranks share the device)")
        return streams[0]

    def all_reduce(self, bufs, count, streams) -> None:
        self._check(bufs, streams, "an all-reduce")
        s = self._one_stream(streams, "all-reduce")
        if self.world_size == 1:
            return
        zeros = self._zero_buffer(count)  # allocated at the first (eager) step, before any capture
        for b in bufs[1:]:
            self.ops.residual_add(bufs[0], b, bufs[0], count, stream=s)
        for b in bufs[1:]:  # x + 0.0 is x: rank 0's sum, copied by the same kernel
            self.ops.residual_add(bufs[0], zeros, b, count, stream=s)

    def gather_buffers(self, count, dtype) -> list[cuda.GpuBuffer]:
        buf = cuda.GpuBuffer(self.world_size * int(count), dtype, device=self.device)
        return [buf] * self.world_size

    def all_gather(self, bufs, count, dtype, streams) -> None:
        self._check(bufs, streams, "an all-gather")
        self._one_stream(streams, "all-gather")
        if any(b is not bufs[0] for b in bufs):
            raise ShapeError("the local all-gather works over the one shared buffer of gather_buffers()")
        # every rank wrote its slot of the shared buffer: nothing to move


class NcclReducer(Reducer):
    """One NCCL communicator per GPU ordinal in ``devices`` (``ncclCommInitAll``), rank ``r`` on
    ``devices[r]``; the N ranks' collectives are issued in one NCCL group (one thread drives all GPUs,
    see :mod:`realizar.parallel.nccl`). ``lib``: an :class:`~realizar.parallel.nccl.Nccl` (default:
    :func:`~realizar.parallel.nccl.load`). One device is a one-rank communicator: the collectives
    are NCCL's own, with nothing to add up."""

    def __init__(self, devices: Sequence[Any], lib: Any = None):
        from realizar.parallel import nccl

        devs = [d if hasattr(d, "ordinal") else cuda.Device(int(d)) for d in devices]  # ordinals or Devices
        if not devs:
            raise ShapeError("an NCCL reducer needs at least one GPU")
        self.lib = lib if lib is not None else nccl.load()
        self.world_size = len(devs)
        self.devices = devs
        self.comms = self.lib.comm_init_all([d.ordinal for d in devs])

    def all_reduce(self, bufs, count, streams) -> None:
        self._check(bufs, streams, "an all-reduce")
        with self.lib.group():
            for b, comm, s in zip(bufs, self.comms, streams):
                self.lib.all_reduce(b, b, count, np.float32, comm, s)

    def gather_buffers(self, count, dtype) -> list[cuda.GpuBuffer]:
        out = []
        for d in self.devices:
            d.make_current()
            out.append(cuda.GpuBuffer(self.world_size * int(count), dtype, device=d))
        return out

    def all_gather(self, bufs, count, dtype, streams) -> None:
        self._check(bufs, streams, "an all-gather")
        size = np.dtype(dtype).itemsize
        with self.lib.group():
            for r, (b, comm, s) in enumerate(zip(bufs, self.comms, streams)):
                # in place: rank r's piece already sits at its slot of its own buffer
                self.lib.all_gather(b.ptr + r * count * size, b, count, dtype, comm, s)

    def close(self) -> None:
        """Destroy the communicators, after every graph that captured their collectives is destroyed (NCCL
        waits for those: :meth:`TensorParallelModel.close` closes its graphs first)."""
        self.lib.destroy_all(self.comms)


# ----------------------------------------------------------------------------------------------
# One rank
# ----------------------------------------------------------------------------------------------


class RankModel(GpuModel):
    """Rank ``rank`` of a :class:`TensorParallelModel`: a :class:`GpuModel` over its shard whose single
    sequence runs the layer program with the residual added only on rank 0 (:class:`RankBackend`) and
    whose head writes its logit rows and its greedy candidate into slots of the gathered buffers (set by
    the owner before the first step)."""

    def __init__(self, config: ModelConfig, tensors: Mapping[str, QuantTensor], rank: int,
                 vocab: tuple[int, int], **kw):
        super().__init__(config, dict(tensors), prefill_chunk=None, kv_cache=False, use_graph=False, **kw)
        self.rank = rank
        self.vocab_start, self.vocab_stop = vocab
        if self.lm_head.out_dim != self.vocab_stop - self.vocab_start:
            raise ShapeError(f"rank {rank}'s LM head has {self.lm_head.out_dim} rows for the vocabulary rows "
                             f"[{self.vocab_start}, {self.vocab_stop})")
        self.logit_slot: tuple[cuda.GpuBuffer, int] | None = None
        self.candidate_slot: tuple[cuda.GpuBuffer, int] | None = None

    def _backend(self, **options) -> "RankBackend":
        return RankBackend(self, decoder=Decoder(self.weights, self.ops, add_residual=self.rank == 0), **options)


class RankBackend(GpuBatchBackend):
    """A rank's single sequence: its head writes the rank's logit rows and greedy candidate into the
    owner's gathered buffers instead of the local logits and argmax."""

    def issue_head(self, b: int, argmax: bool) -> None:
        m = self.model
        self.decoder.head(self.acts, b, self.linear, self.stream, logits=m.logit_slot)
        self.ops.argmax_candidate(m.logit_slot, m.candidate_slot, m.vocab_start, m.vocab_stop - m.vocab_start,
                                  stream=self.stream)


# ----------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------


class TensorParallelModel(StepDecoder):
    """A model split over ``reducer.world_size`` ranks; the Generator interface of :class:`GpuModel`
    (``prefill``, ``decode``, ``reset``, ``context_length``, :class:`DeviceLogits` with
    ``greedy_token()``) and :meth:`forward_gpu_resident_to_token_id`.

    ``plan`` defaults to :func:`make_plan` over the reducer's rank count. ``use_graph=False`` issues
    every step eagerly; otherwise the first step runs eagerly and is then captured (one graph per
    stream: one per rank over NCCL, one in all on a :class:`LocalReducer`). ``capture_mode`` is the
    driver's stream-capture mode."""

    def __init__(self, config: ModelConfig, tensors: Mapping[str, QuantTensor], reducer: Reducer,
                 max_len: int | None = None, use_graph: bool = True, pdl: bool = True,
                 plan: ShardingPlan | None = None, capture_mode: str = "global"):
        n = reducer.world_size
        self.plan = plan if plan is not None else make_plan(config, tensors, n)
        if self.plan.world_size != n:
            raise ShapeError(f"a plan for {self.plan.world_size} ranks given to a reducer of {n}")
        self.config = config
        self.reducer = reducer
        self.world_size = n
        self.max_len = int(min(config.context_length, max_len or DEFAULT_MAX_LEN))
        if self.max_len < 1:
            raise ShapeError(f"max_len must be positive, got {self.max_len}")
        self.ranks: list[RankModel] = []
        for r in range(n):
            dev = reducer.devices[r]
            dev.make_current()
            rc = replace(self.plan.rank_config(r), tied_embeddings=False)  # the LM head is its own slice
            self.ranks.append(RankModel(rc, self.plan.shard(tensors, r), r, self.plan.vocab[r],
                                        max_len=self.max_len, device=dev, pdl=pdl))
        if reducer.shared_device:  # one stream for all ranks: one graph
            for rank in self.ranks[1:]:
                rank._stream = self.ranks[0].sequence.stream
        self.seqs = [r.sequence for r in self.ranks]
        self.streams = [s.stream for s in self.seqs]
        lanes = self.seqs[:1] if reducer.shared_device else self.seqs  # one per stream
        self.graphs = cuda.GraphCache([(s.device, s.stream) for s in lanes], mode="capture" if use_graph else "eager",
                                      capacity=1, pdl=pdl, capture_mode=capture_mode)
        self.logit_stride = -(-self.plan.vocab_per_rank // LOGIT_SLOT_ALIGN) * LOGIT_SLOT_ALIGN
        self.logit_bufs = reducer.gather_buffers(self.logit_stride, np.float32)
        self.candidate_bufs = reducer.gather_buffers(1, np.uint64)
        for r, rank in enumerate(self.ranks):
            rank.logit_slot = (self.logit_bufs[r], r * self.logit_stride)
            rank.candidate_slot = (self.candidate_bufs[r], r)
        self.position = 0
        self.steps = 0

    @classmethod
    def from_loaded(cls, loaded, reducer: Reducer, max_len: int | None = None, **kw) -> "TensorParallelModel":
        return cls(loaded.config, loaded.tensors, reducer, max_len=max_len, **kw)

    @property
    def context_length(self) -> int:
        return self.max_len

    @property
    def devices(self) -> list:
        return [r.device for r in self.ranks]

    # ---- one decode step over all ranks --------------------------------------------------------------
    def _issue_step(self) -> None:
        """Every rank's launches up to its next all-reduce point, the all-reduce, and so on; then the
        candidates' all-gather and rank 0's argmax over them."""
        seqs = self.seqs
        phases = [s.step_phases(1, False) for s in seqs]
        while True:
            paused = 0
            for seq, phase in zip(seqs, phases):
                seq.device.make_current()
                paused += next(phase, _DONE) is not _DONE
            if paused == 0:
                break
            if paused != len(seqs):
                raise RuntimeError(f"{paused} of {len(seqs)} ranks reached an all-reduce point")
            self.reducer.all_reduce([s.acts.x for s in seqs], self.config.hidden_size, self.streams)
        self.reducer.all_gather(self.candidate_bufs, 1, np.uint64, self.streams)
        r0 = seqs[0]
        r0.device.make_current()
        r0.ops.argmax_packed(self.candidate_bufs[0], r0.tokens, self.world_size, stream=r0.stream)

    def _run_step(self, token: int, position: int) -> None:
        self._check_step(token, position)
        for seq in self.seqs:
            seq.device.make_current()
            seq.stage_one(token, position)
        self.graphs.run("step", self._issue_step)
        self.steps += 1

    # ---- Generator interface (with StepDecoder's) -------------------------------------------------------
    def prefill(self, ids) -> DeviceLogits:
        """The prompt token by token through the decode step."""
        self._prefill_steps(self._check_prompt(ids))
        return DeviceLogits(self)

    def read_token(self) -> int:
        """The greedy token of the last step (4 bytes from rank 0)."""
        return int(self.seqs[0].read_tokens(1)[0])

    def read_logits(self) -> np.ndarray:
        """The whole vocabulary's logits of the last step: the ranks' pieces all-gathered (issued now,
        after the step, on the ranks' streams), read from rank 0."""
        self.reducer.all_gather(self.logit_bufs, self.logit_stride, np.float32, self.streams)
        r0 = self.seqs[0]
        r0.device.make_current()
        r0.stream.synchronize()
        host = self.logit_bufs[0].copy_to_host()
        return np.concatenate([host[r * self.logit_stride : r * self.logit_stride + (b - a)]
                               for r, (a, b) in enumerate(self.plan.vocab)])

    def synchronize(self) -> None:
        for seq in self.seqs:
            seq.device.make_current()
            seq.stream.synchronize()

    def close(self) -> None:
        """Wait for the ranks' work and release the reducer's communicators."""
        self.synchronize()
        self.graphs.close()
        self.reducer.close()
