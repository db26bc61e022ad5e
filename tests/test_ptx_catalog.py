"""Every kernel in the catalog, over its validation grid of shapes, assembles with ptxas for each target."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ptx_gen import catalog
from ptx_gen.ptxas import assemble

TARGETS = ("sm_80", "sm_89", "sm_90")
CASES = [(name, shape) for name in catalog.names() for shape in catalog.spec(name).grid]


def _id(case) -> str:
    name, shape = case
    return name + ("[" + ",".join(f"{k}={v}" for k, v in shape.items()) + "]" if shape else "")


FIRST = [(name, catalog.spec(name).grid[0]) for name in catalog.names()]


def _assembles_clean(case, target: str) -> None:
    name, shape = case
    kernel = catalog.emit(name, target=target, **shape)
    assert kernel.target == catalog.target_for(catalog.spec(name), target)
    reports = assemble(kernel.ptx, kernel.target)
    assert [r.entry for r in reports] == [kernel.entry]
    report = reports[0]
    assert report.target == kernel.target
    assert not report.spills, f"{_id(case)} spills on {kernel.target}: {report.log}"


@pytest.mark.parametrize("case", FIRST, ids=[_id(c) for c in FIRST])
def test_each_catalog_kernel_assembles(case):
    """The fast tier: every kernel's first grid shape, for sm_90."""
    _assembles_clean(case, "sm_90")


# every target for portable kernels; an architecture-specific one (gemm_wg: sm_90a) for its own target alone
TARGETED = [(c, t) for c in CASES for t in catalog.targets(catalog.spec(c[0]), TARGETS)]


@pytest.mark.full
@pytest.mark.parametrize("case,target", TARGETED, ids=[f"{_id(c)}-{t}" for c, t in TARGETED])
def test_catalog_kernel_assembles(case, target):
    """Every kernel, every grid shape, every target it has."""
    _assembles_clean(case, target)


def test_architecture_specific_kernel_refuses_other_targets():
    with pytest.raises(ValueError, match="needs sm_90a"):
        catalog.emit("gemm_wg", target="sm_80")
    assert catalog.emit("gemm_wg", target="sm_90").target == "sm_90a"


# Tuning parameters the validation grids keep at their defaults (each is exercised by the kernel's own
# tests). Any other shape parameter must take at least two values over its kernel's grid.
FIXED_IN_GRID = {
    "flash_attention": {"rows_per_thread", "keys_per_thread", "row_groups"},
    "flash_attention_tokens_f16": {"rows_per_thread", "keys_per_thread", "row_groups"},
    "flash_decoding": {"indirect", "heads_per_block", "warps", "l2_prefetch"},
    "flash_decoding_chunk": {"indirect", "heads_per_block", "warps", "unroll", "l2_prefetch"},
    "flash_decoding_reduce": {"indirect"},
    "gemm": {"warps", "bias", "residual"},
    "gemm_wg": {"unroll"},
    "gemv_mma": {"bulk", "l2pre"},  # (sm_90 only: the grid assembles for sm_80 too)
    "incremental_attention": {"heads_per_block", "warps", "unroll", "prefetch", "l2_prefetch"},
    # (the ring and its scattered scores are sm_90 only, the grid assembles for sm_80 too: tests/test_paged_decode_ring.py)
    "paged_decode_attention": {"ring", "scatter"},
}


@pytest.mark.parametrize("name", catalog.names())
def test_catalog_spec_docs_grid_and_launch_hints(name):
    """A docstring; a grid whose shapes all emit, each to different PTX (no wasted assembly above),
    with launch hints; and a grid that varies every shape parameter not listed in FIXED_IN_GRID."""
    s = catalog.spec(name)
    assert s.doc, f"{name} has no docstring"
    assert s.grid, f"{name} has an empty grid"
    ptx = set()
    for shape in s.grid:
        k = catalog.emit(name, target="sm_90", **shape)
        assert k.shape_dict == s.full_shape(dict(shape))
        block = k.launch.block if isinstance(k.launch.block, tuple) else (k.launch.block,)
        assert all(1 <= b <= 1024 for b in block) and k.launch.dyn_smem >= 0
        ptx.add(k.ptx)
    assert len(ptx) == len(s.grid), f"{name}: two grid shapes give the same PTX"
    values = {p: {repr(s.full_shape(dict(g))[p]) for g in s.grid} for p in s.shape_params}
    fixed = {p for p, v in values.items() if len(v) < 2}
    assert fixed == FIXED_IN_GRID.get(name, set()), f"{name}: the grid never varies {sorted(fixed)}"
    assert set(FIXED_IN_GRID.get(name, ())) <= set(s.shape_params)


def test_launch_hints_come_from_the_generator():
    k = catalog.emit("flash_attention", target="sm_90", **catalog.spec("flash_attention").grid[0])
    assert k.launch.dyn_smem > 0 and k.launch.block == k.meta["block"]
    assert "shared_bytes" not in k.meta  # the one dynamic-shared-memory key is dyn_smem
    g = catalog.emit("gemv", target="sm_90")
    assert g.launch == catalog.LaunchHints(block=g.meta["block"], l1_bytes=g.meta.get("l1_bytes", 0),
                                           smem=g.meta.get("smem", 0))
    assert g.launch.dyn_smem == 0
    with pytest.raises(RuntimeError, match="must set meta"):
        catalog.LaunchHints.from_meta("x", {"rows_per_cta": 4})


def test_ptx_gen_imports_nothing_from_realizar():
    """Importing ptx_gen and emitting one kernel of every family (every kernel module, and the tools
    of ptx_gen) leaves no realizar module loaded."""
    code = (
        "import sys, ptx_gen, ptx_gen.catalog as c, ptx_gen.inspect, ptx_gen.ggml, ptx_gen.toolchain\n"
        "for n in c.names():\n"
        "    c.emit(n, 'sm_90', **c.spec(n).grid[0])\n"
        "bad = sorted(m for m in sys.modules if m == 'realizar' or m.startswith('realizar.'))\n"
        "assert not bad, bad\n"
        "print(len(c.names()))\n"
    )
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == len(catalog.names())
    imports = re.compile(r"^\s*(from\s+realizar\b|import\s+realizar\b)", re.M)
    offenders = [str(p) for p in (root / "ptx_gen").rglob("*.py") if imports.search(p.read_text())]
    assert not offenders, offenders


def test_unknown_kernel_and_shape_errors():
    with pytest.raises(KeyError, match="no kernel"):
        catalog.spec("no_such_kernel")
    with pytest.raises(ValueError, match="no shape parameter"):
        catalog.emit("row_sum", target="sm_90", colz=3)
