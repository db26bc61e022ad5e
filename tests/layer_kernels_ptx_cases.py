"""Helpers shared by the CPU tests of the transformer-layer kernels (tests/test_layer_kernels_ptx.py
and tests/test_gemv_ptx.py): the ptxas targets, drawn row lengths, assembling a kernel for every
target without spills, and padding raw weight bytes for the emulator."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from ptx_gen import catalog
from ptx_gen.kernels.gemv.quant_layout import DENSE, K_QUANTS
from ptx_gen.ptxas import assemble

TARGETS = ("sm_80", "sm_90")


def _in_dims(wtype: str):
    bs = 256 if wtype in K_QUANTS else (8 if wtype in DENSE else 32)
    return st.integers(1, 64).map(lambda n: n * bs)


def _assemble_all(name: str, **shape) -> None:
    for tgt in TARGETS:
        k = catalog.emit(name, target=tgt, **shape)
        (rep,) = assemble(k.ptx, tgt)
        assert rep.entry == k.entry
        assert not rep.spills, f"{name} {shape} spills on {tgt}: {rep.log}"


def _pad16(raw: np.ndarray) -> np.ndarray:
    return np.concatenate([raw, np.zeros((-raw.size) % 16, np.uint8)])
