"""The project's exception hierarchy. Every error a user can provoke is one of these."""


class RealizarError(Exception):
    """Base class of every error raised on purpose by realizar."""


class ShapeError(RealizarError, ValueError):
    """A tensor, buffer or argument had the wrong dimensions or size."""


class ModelFormatError(RealizarError, ValueError):
    """A model file is malformed, truncated, or inconsistent with its own metadata."""


class UnsupportedError(RealizarError, NotImplementedError):
    """An architecture, quantization type or feature that realizar does not support."""


class ContextOverflowError(RealizarError, ValueError):
    """A sequence would grow past the model's context length or the KV cache's max_len."""


class TokenizerError(RealizarError, ValueError):
    """The tokenizer could not be built or could not encode/decode its input."""


class InvalidRequestError(RealizarError, ValueError):
    """A request argument is out of range: sampling parameters, token ids, an empty prompt."""


class CacheStateError(RealizarError, ValueError):
    """A KV-cache layer was read before it held the positions asked for (e.g. an uninitialised layer)."""


class KVPoolExhaustedError(RealizarError, RuntimeError):
    """The paged KV pool has fewer free blocks than were asked for."""


class ModelOutputError(RealizarError, RuntimeError):
    """The model computed logits that cannot be sampled (NaN): its weights or its arithmetic are broken, not
    the request. Reported naming the model file (the CLI, the server's 500 ``model_error``)."""


class TensorParallelError(RealizarError, RuntimeError):
    """Tensor parallelism over N GPUs cannot run: the model does not split over N, fewer than N GPUs are
    visible, or (for now) the multi-GPU model itself is not built. The message says which."""


class ModelNotFoundError(RealizarError, FileNotFoundError):
    """A ``--model`` that is no local path and no model to be had from the Hugging Face Hub: the repo is not on
    the endpoint, has no file matching the quant asked for (the message lists its GGUF files), or, offline
    (``HF_HUB_OFFLINE=1``, or the endpoint unreachable), is not in the Hugging Face cache."""
