"""LoadedModel: what a format reader hands back — config, tensors in file form, tokenizer sources."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from realizar.errors import ModelFormatError
from realizar.models.config import ModelConfig
from realizar.models.tensor import QuantTensor


@dataclass
class LoadedModel:
    """A model as read from disk: its config, its tensors in file form, and what the tokenizer needs.

    ``tensors`` is keyed by canonical (GGUF) names — ``token_embd.weight``, ``blk.N.attn_q.weight``,
    ... (see :mod:`realizar.models.names`); it also holds any extra tensors of the file (e.g.
    ``rope_freqs.weight``). ``metadata`` is the GGUF key/value metadata (plain Python values) or, for
    safetensors, ``config.json`` as read. The GGUF tokenizer lives in ``metadata["tokenizer.ggml.*"]``;
    a safetensors model's is the file ``tokenizer_json``. ``chat_template`` is what
    :mod:`realizar.models.chat_template` found for the model. ``config.rope_type`` says how Q/K are
    laid out: llama/mistral GGUF weights are kept as stored (permuted for interleaved "normal" RoPE).
    """

    config: ModelConfig
    tensors: dict[str, QuantTensor]
    metadata: dict[str, Any]
    format: Literal["gguf", "safetensors"]
    path: Path
    tokenizer_json: Path | None = None
    chat_template: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def tensor(self, name: str) -> QuantTensor:
        """The tensor of canonical name ``name``; :class:`ModelFormatError` naming it when absent."""
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelFormatError(f"{self.path.name}: no tensor {name!r}") from None
