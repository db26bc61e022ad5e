"""The engine facade: one object holding a loaded model, its tokenizer and a generator.

    from realizar.engine import load_engine
    from realizar.generation import SamplingParams

    engine = load_engine()                     # the default model (SmolLM2-135M-Instruct Q4_1)
    print(engine.generate("The capital of France is", SamplingParams(max_tokens=8)).text)
    print(engine.chat([{"role": "user", "content": "Hi!"}]).text)

``device="cpu"`` runs the NumPy :class:`~realizar.models.reference.ReferenceModel`; ``"cuda"`` asks for
the GPU model and ``"auto"`` takes it when it exists and a GPU is present, else the CPU; ``"emulate"``
runs the GPU model's real kernels on the CPU PTX emulator (:class:`realizar.cuda.EmulatedDevice`:
slow, for tiny models and for checking kernels without a GPU). This module is the one place that picks
a backend: the single-sequence model (:func:`_load_gpu_model`, or the NumPy reference) and, for serving,
the batch backend over the same weights (:meth:`Engine.batch_backend`).
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from realizar.errors import InvalidRequestError, RealizarError
from realizar.generation import GenerationResult, GenerationStream, Generator, SamplingParams, TokenChunk
from realizar.models.config import ModelConfig

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np

__all__ = ["Engine", "load_engine", "load_tokenizer", "DEVICES"]

DEVICES = ("auto", "cpu", "cuda", "emulate")


class GpuUnavailableError(RealizarError, RuntimeError):
    """``device="cuda"`` was asked for but no GPU model can run here (why is in the message)."""


@dataclass
class Engine:
    """A ready-to-run model. ``device`` is where it actually runs ("cpu", "cuda" or "emulate").

    One generation at a time: the model holds a single KV cache, so callers that share an engine
    between threads (a server) must serialize generate/stream/chat calls."""

    config: ModelConfig
    tokenizer: Any
    generator: Generator
    model: Any
    device: str
    name: str
    path: Path | None = None
    _embed_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    @property
    def context_length(self) -> int:
        return int(self.model.context_length)

    @property
    def where(self) -> str:
        """Where the model runs, for people: the device, and on GPUs each one's name and PCI bus id (the
        physical GPU, whatever ``CUDA_VISIBLE_DEVICES`` numbers it)."""
        if self.device != "cuda" or self.model is None:
            return self.device
        reducer = getattr(self.model, "reducer", None)
        gpus = list(dict.fromkeys(reducer.devices)) if reducer is not None else [self.model.device]
        return "cuda: " + ", ".join(f"{d.name} at PCI {d.pci_bus_id}" for d in gpus)

    def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        on_chunk: Callable[[TokenChunk], None] | None = None,
    ) -> GenerationResult:
        return self.generator.generate(prompt, params, on_chunk)

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> GenerationStream:
        return self.generator.stream(prompt, params)

    def chat_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of ``messages`` rendered with the model's chat template (special tokens written
        by the template are parsed; no BOS/EOS added beyond what the template writes); ``tools``
        (OpenAI function definitions) are handed to the template as ``tools``."""
        if not messages:
            raise InvalidRequestError("chat needs at least one message")
        extra = {"tools": list(tools)} if tools else {}
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt, tokenize=True, **extra))

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        params: SamplingParams | None = None,
        on_chunk: Callable[[TokenChunk], None] | None = None,
    ) -> GenerationResult:
        return self.generator.generate(self.chat_prompt(messages), params, on_chunk)

    def chat_stream(
        self, messages: Sequence[Mapping[str, Any]], params: SamplingParams | None = None
    ) -> GenerationStream:
        return self.generator.stream(self.chat_prompt(messages), params)

    def embedding_unavailable(self) -> str | None:
        """Why this engine cannot :meth:`embed` (None: it can)."""
        if self.model is None or not hasattr(self.model, "hidden_states"):
            where = "in another process" if self.model is None else f"on {self.device}"
            return (f"the engine embeds with the CPU reference model only (this model runs {where}); a server embeds "
                    "through its serving engine (ServingEngine.embed)")
        return None

    def embed(self, inputs: Sequence[Sequence[int]], dimensions: int | None = None) -> "np.ndarray":
        """Unit-norm embeddings ``[len(inputs), dimensions or hidden]`` of token-id sequences, each pooled from
        its own final-norm hidden rows as ``config.pooling`` says (:mod:`realizar.embeddings`). Runs on the CPU
        reference model beside any generation (no KV cache is touched); one call at a time per engine."""
        from realizar.embeddings import pool, unit_vectors
        from realizar.errors import UnsupportedError

        why = self.embedding_unavailable()
        if why is not None:
            raise UnsupportedError(why)
        with self._embed_lock:  # (calls in parallel would only share the same cores)
            rows = [pool(self.model.hidden_states(ids), self.config.pooling) for ids in inputs]
        return unit_vectors(rows, self.config.hidden_size, dimensions)

    def batch_backend(self, config: Any = None) -> Any:
        """The backend that runs many sequences of this model at once (the
        :class:`~realizar.serving.backend.BatchBackend` of :class:`realizar.serving.ServingEngine`), per
        ``config`` (a :class:`~realizar.config.ServingConfig`): the NumPy
        :class:`~realizar.serving.cpu_backend.ReferenceBatchBackend` on the CPU (KV f32 by default),
        :class:`~realizar.gpu.batch.GpuBatchBackend` over the GPU model's weights otherwise (KV f16 by
        default; the single-sequence cache is released, remade only if the engine is used directly)."""
        return _batch_backend(self, config)


def _batch_backend(engine: Engine, config: Any = None) -> Any:
    """See :meth:`Engine.batch_backend`: the one place that picks the serving backend."""
    from realizar.config import ServingConfig
    from realizar.errors import UnsupportedError
    from realizar.models.kv_formats import block_bytes

    cfg = config or ServingConfig()
    context = min(cfg.max_context or engine.context_length, engine.context_length)
    world = getattr(engine.model, "world_size", 1)
    if world > 1:
        raise UnsupportedError(
            f"continuous batching over a model split across {world} GPUs is not built "
            "yet: serve it on one GPU, or generate with the split model one sequence at a time"
        )
    if engine.device == "cpu":
        from realizar.serving.cpu_backend import KV_DTYPES, ReferenceBatchBackend

        kv_dtype = cfg.kv_dtype or "f32"
        if kv_dtype not in KV_DTYPES:
            raise UnsupportedError(f"the CPU backend stores KV as one of {tuple(KV_DTYPES)}, got {kv_dtype!r}")
        if isinstance(cfg.kv_memory, float) and cfg.kv_memory <= 1:
            raise InvalidRequestError("a KV pool as a share of the free memory needs a GPU; give a size in bytes")
        per_block = block_bytes(engine.config, cfg.block_size, kv_dtype)
        num_blocks = cfg.num_blocks
        if num_blocks is None:
            if cfg.kv_memory is not None:
                num_blocks = int(cfg.kv_memory // per_block) + 1
            else:
                num_blocks = min(cfg.max_batch, 8) * (-(-context // cfg.block_size)) + 1
            if num_blocks < 2:
                raise InvalidRequestError(f"kv_memory {cfg.kv_memory} holds no block of {per_block} bytes")
        return ReferenceBatchBackend(engine.model, num_blocks, cfg.block_size, kv_dtype=kv_dtype,
                                     max_batch=cfg.max_batch, context_length=context)
    try:
        from realizar.gpu.batch import GpuBatchBackend
    except ImportError as e:
        raise UnsupportedError(f"continuous batching on the {engine.device} device needs "
                               f"realizar.gpu.batch.GpuBatchBackend, which cannot be imported here: {e}") from e
    backend = GpuBatchBackend(engine.model, num_blocks=cfg.num_blocks, kv_memory=cfg.kv_memory,
                              block_size=cfg.block_size, kv_dtype=cfg.kv_dtype or "f16", max_batch=cfg.max_batch,
                              max_context=context, prefill_chunk=cfg.prefill_chunk,
                              f16_weights=cfg.f16_weights, prefill_min_batch=cfg.prefill_min_batch,
                              gemv_cols_rows=cfg.gemv_cols_rows)
    engine.model.release_kv()
    return backend


def model_id(name: str) -> str:
    """``name`` as a model id clients can type: each run of whitespace becomes one ``-``."""
    slug = re.sub(r"\s+", "-", name.strip()).strip("-")
    return slug or "model"


def load_tokenizer(loaded) -> Any:
    """The tokenizer of a :class:`~realizar.models.loader.LoadedModel`: from the GGUF metadata, or
    from ``tokenizer.json`` (+ ``tokenizer_config.json``) of a safetensors directory."""
    from realizar.text.tokenizer import Tokenizer

    if loaded.format == "gguf":
        return Tokenizer.from_gguf_metadata(loaded.metadata)
    if loaded.tokenizer_json is None:
        raise RealizarError(f"{loaded.path} has no tokenizer.json")
    directory = Path(loaded.tokenizer_json).parent
    tok_cfg = None
    cfg_path = directory / "tokenizer_config.json"
    if cfg_path.exists():
        try:
            tok_cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise RealizarError(f"cannot read {cfg_path}: {e}") from e
    return Tokenizer.from_tokenizer_json(
        loaded.tokenizer_json, tok_cfg, eos_token_ids=list(loaded.config.eos_token_ids) or None
    )


def _load_gpu_model(loaded, max_context: int | None, emulate: bool = False):
    """THE hook for the GPU model: return a model object with ``prefill``/``decode``/``reset``/
    ``context_length``, or raise :class:`GpuUnavailableError` saying why there is none. ``emulate``
    runs it on a new :class:`~realizar.cuda.EmulatedDevice` instead of the GPU."""
    from realizar import cuda

    gpu = cuda.EmulatedDevice() if emulate else None
    reason = None if emulate else cuda.unavailable_reason()
    if reason is not None:
        raise GpuUnavailableError(f"no usable GPU: {reason}")
    from realizar.errors import ShapeError, UnsupportedError
    from realizar.gpu.model import GpuModel

    try:
        return GpuModel.from_loaded(loaded, max_len=max_context, device=gpu)
    except (UnsupportedError, ShapeError) as e:
        raise GpuUnavailableError(f"this model cannot run on the GPU: {e}") from e


def _tensor_parallel_model(loaded, n: int, device: str, max_context: int | None = None):
    """The model split over ``n`` GPUs (:class:`~realizar.parallel.gpu.TensorParallelModel` over NCCL,
    ranks on GPUs 0..n-1), after the checks, which fail first when they fail: a GPU device, a model
    that shards over ``n``, ``n`` visible GPUs, then NCCL's library. Each failure is one
    :class:`TensorParallelError` line."""
    from realizar.cuda import CudaError
    from realizar.errors import ShapeError, TensorParallelError, UnsupportedError
    from realizar.parallel import check_tensor_parallel, nccl

    plan = check_tensor_parallel(loaded, n, device)
    try:
        lib = nccl.load()
    except nccl.NcclUnavailableError as e:
        raise TensorParallelError(f"tensor parallelism over {n} GPUs: {e}") from e
    from realizar.parallel.gpu import NcclReducer, TensorParallelModel

    try:
        reducer = NcclReducer(range(n), lib=lib)
    except (nccl.NcclError, CudaError) as e:
        raise TensorParallelError(f"tensor parallelism over {n} GPUs: NCCL could not connect them: {e}") from e
    try:
        return TensorParallelModel.from_loaded(loaded, reducer, max_len=max_context, plan=plan)
    except (UnsupportedError, ShapeError) as e:
        reducer.close()
        raise TensorParallelError(f"tensor parallelism over {n} GPUs: this model cannot run sharded: {e}") from e


def load_engine(
    model_path: str | os.PathLike | None = None,
    device: str = "auto",
    *,
    max_context: int | None = None,
    tensor_parallel: int = 1,
) -> Engine:
    """Load a model file (GGUF) or directory (safetensors), or a Hugging Face Hub id (``org/name[:QUANT]``,
    :func:`realizar.models.hub.resolve_model`) — the default model when ``None`` — and build its tokenizer and
    generator. ``max_context`` caps the KV cache below the model's context.

    ``tensor_parallel=N`` splits the model over GPUs 0..N-1 of this host (Megatron-style sharding,
    NCCL all-reduces captured in each GPU's decode graph: :mod:`realizar.parallel.gpu`). N = 1 (the
    default) is one device, as always. For N > 1, in this order, a GPU device, a model that shards
    over N (:func:`realizar.parallel.make_plan`: heads, whole GQA groups, FFN width, whole quantized
    blocks), N visible GPUs and NCCL's library (``pip install "realizar[multigpu]"``) are needed; a
    missing one is a :class:`~realizar.errors.TensorParallelError` saying which."""
    if device not in DEVICES:
        raise InvalidRequestError(f"device must be one of {DEVICES}, got {device!r}")
    if max_context is not None and max_context <= 0:
        raise InvalidRequestError(f"max_context must be positive, got {max_context}")
    if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int) or tensor_parallel < 1:
        raise InvalidRequestError(f"tensor_parallel must be an integer >= 1, got {tensor_parallel!r}")
    path, loaded, tokenizer, eos, name = _describe(model_path)
    model = None
    if tensor_parallel > 1:
        model = _tensor_parallel_model(loaded, tensor_parallel, device, max_context)
        device = "cuda"
    elif device == "emulate":
        model = _load_gpu_model(loaded, max_context, emulate=True)
    elif device in ("cuda", "auto"):
        try:
            model = _load_gpu_model(loaded, max_context)
            device = "cuda"
        except GpuUnavailableError as e:
            if device == "cuda":
                raise
            from realizar import cuda

            if os.environ.get("REALIZAR_VERBOSE") or cuda.unavailable_reason() is None:  # (a GPU that cannot run it)
                print(f"realizar: running on the CPU ({e})", file=sys.stderr)
    if model is None:
        from realizar.models.reference import ReferenceModel

        ctx = loaded.config.context_length
        model = ReferenceModel.from_loaded(loaded, max_len=min(ctx, max_context) if max_context else ctx)
        device = "cpu"

    return Engine(
        config=loaded.config,
        tokenizer=tokenizer,
        generator=Generator(model, tokenizer, eos_token_ids=eos),
        model=model,
        device=device,
        name=name,
        path=path,
    )


def _describe(model_path: str | os.PathLike | None) -> tuple[Path, Any, Any, tuple[int, ...], str]:
    """(path, the loaded file, tokenizer, end-of-sequence ids, served name) of a model file or directory (the
    default model when None); no weights are read."""
    from realizar.models.hub import resolve_model, served_name
    from realizar.models.loader import load_model

    path = resolve_model(model_path)
    loaded = load_model(path)
    tokenizer = load_tokenizer(loaded)
    eos = tuple(dict.fromkeys([*getattr(tokenizer, "eos_token_ids", ()), *loaded.config.eos_token_ids]))
    # the name clients see and type: the file's (or directory's), as the user named it; a GGUF's general.name
    # is often a training run's label that matches nothing the user has seen
    return path, loaded, tokenizer, eos, model_id(served_name(path))


def load_front(model_path: str | os.PathLike | None = None, device: str = "engine process") -> Engine:
    """What serving a model needs besides the model — its config, tokenizer, end-of-sequence ids and name — for a
    server whose engine runs in another process (:class:`realizar.serving.remote.EngineProcess`): the file's
    metadata and tokenizer are read, no weights. The Engine has no model (``model`` None): it cannot generate."""
    path, loaded, tokenizer, eos, name = _describe(model_path)
    return Engine(config=loaded.config, tokenizer=tokenizer, generator=Generator(None, tokenizer, eos_token_ids=eos),
                  model=None, device=device, name=name, path=path)

