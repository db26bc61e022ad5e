"""RoPE frequencies: the one computation shared by the NumPy reference model and the GPU model.

Both formats' scaling settings are read here into :class:`~realizar.models.config.RopeScaling`
(:func:`rope_scaling_from_hf`, :func:`rope_scaling_from_gguf`), and :func:`rope_inv_freq` turns a
:class:`~realizar.models.config.ModelConfig` into the per-pair inverse frequencies every RoPE
implementation multiplies by the position.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from realizar.errors import ModelFormatError, UnsupportedError
from realizar.models.config import ModelConfig, RopeScaling

__all__ = ["inv_freq", "rope_inv_freq", "rope_scaling_from_gguf", "rope_scaling_from_hf"]

SUPPORTED_SCALING = ("linear", "llama3")
_NO_SCALING = (None, "", "default", "none")


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ModelFormatError(f"RoPE scaling {what} = {value!r} is not a finite number")
    return float(value)


def _scaling(kind: Any, params: Mapping[str, Any], names: Mapping[str, str]) -> RopeScaling | None:
    """A :class:`RopeScaling` of ``kind`` from ``params``, whose keys for the fields of RopeScaling
    are given by ``names`` (field -> key); absent keys keep the field's default."""
    if kind in _NO_SCALING:
        return None
    if not isinstance(kind, str):
        raise ModelFormatError(f"RoPE scaling type {kind!r} is not a string")
    fields: dict[str, Any] = {}
    for field, key in names.items():
        if params.get(key) is not None:
            fields[field] = _number(params[key], key)
    if "original_context" in fields:
        fields["original_context"] = int(fields["original_context"])
    if kind in SUPPORTED_SCALING and fields.get("factor", 0.0) <= 0:
        raise ModelFormatError(f"RoPE scaling of type {kind!r} needs a positive factor, got {params!r}")
    return RopeScaling(kind=kind, **fields)


def rope_scaling_from_hf(params: Mapping[str, Any] | None) -> RopeScaling | None:
    """The scaling described by an HF ``rope_scaling`` (transformers 4) or ``rope_parameters``
    (transformers 5) dict; ``None`` when absent or of type ``default``."""
    if not isinstance(params, Mapping):
        return None
    kind = params.get("rope_type", params.get("type"))
    return _scaling(kind, params, {
        "factor": "factor",
        "low_freq_factor": "low_freq_factor",
        "high_freq_factor": "high_freq_factor",
        "original_context": "original_max_position_embeddings",
    })


def rope_scaling_from_gguf(metadata: Mapping[str, Any], arch: str) -> RopeScaling | None:
    """The scaling described by the ``{arch}.rope.scaling.*`` keys of GGUF metadata."""
    prefix = f"{arch}.rope.scaling."
    params = {k[len(prefix):]: v for k, v in metadata.items() if k.startswith(prefix)}
    return _scaling(params.get("type"), params, {
        "factor": "factor",
        "original_context": "original_context_length",
    })


def inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None,
             freq_factors: np.ndarray | None = None) -> np.ndarray:
    """Inverse frequencies ``theta ** (-2i / head_dim)`` for ``i < head_dim / 2`` (float64).

    ``freq_factors`` (a GGUF ``rope_freqs.weight``) divide the frequencies one by one and take the
    place of ``scaling``. ``linear`` scaling divides every frequency by its factor; ``llama3``
    divides the low frequencies (wavelength above ``original_context / low_freq_factor``) by the
    factor, keeps the high ones (wavelength below ``original_context / high_freq_factor``) and
    blends linearly in between. Any other kind raises :class:`UnsupportedError`.
    """
    inv = 1.0 / (float(theta) ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if freq_factors is not None:
        ff = np.asarray(freq_factors, dtype=np.float64).reshape(-1)
        if ff.shape[0] != inv.shape[0]:
            raise ModelFormatError(f"rope_freqs has {ff.shape[0]} entries, expected {inv.shape[0]}")
        return inv / ff
    if scaling is None:
        return inv
    if scaling.kind == "linear":
        return inv / scaling.factor
    if scaling.kind == "llama3":
        low, high, ctx = scaling.low_freq_factor, scaling.high_freq_factor, float(scaling.original_context)
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > ctx / low, inv / scaling.factor, inv)
        smooth = (ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv / scaling.factor + smooth * inv
        medium = (wavelen >= ctx / high) & (wavelen <= ctx / low)
        return np.where(medium, blended, scaled)
    raise UnsupportedError(
        f"RoPE scaling of type {scaling.kind!r} (supported: {', '.join(SUPPORTED_SCALING)})"
    )


def rope_inv_freq(config: ModelConfig, freq_factors: np.ndarray | None = None) -> np.ndarray:
    """:func:`inv_freq` of a model: ``config.head_dim``, ``config.rope_theta``,
    ``config.rope_scaling``, and the model's ``rope_freqs.weight`` values if it has that tensor."""
    return inv_freq(config.head_dim, config.rope_theta, config.rope_scaling, freq_factors)
