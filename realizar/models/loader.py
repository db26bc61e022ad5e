"""``load_model(path)``: one entry point for GGUF files and HF safetensors directories."""

from __future__ import annotations

import os
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
    a safetensors model's is the file ``tokenizer_json``. ``config.rope_type`` says how Q/K are laid
    out: llama/mistral GGUF weights are kept as stored (permuted for interleaved "normal" RoPE).
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
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelFormatError(f"{self.path.name}: no tensor {name!r}") from None


def load_model(path: str | os.PathLike) -> LoadedModel:
    """Load a ``.gguf`` file, or a directory (or a ``.safetensors`` file inside one) in HF layout."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"no model at {p}")
    if p.is_dir():
        ggufs = sorted(p.glob("*.gguf"))
        if not (p / "config.json").exists() and len(ggufs) == 1:
            p = ggufs[0]
        elif not (p / "config.json").exists() and ggufs:
            listed = ", ".join(g.name for g in ggufs[:5])
            raise ModelFormatError(f"{p} holds {len(ggufs)} GGUF files ({listed}); pass one of them")
        else:
            from realizar.models.safetensors_loader import load_safetensors

            return load_safetensors(p)
    if p.suffix == ".safetensors" or p.name == "model.safetensors.index.json":
        from realizar.models.safetensors_loader import load_safetensors

        return load_safetensors(p.parent)
    from realizar.models.gguf_loader import load_gguf

    return load_gguf(p)
