"""Every kernel in the catalog, over its validation grid of shapes, assembles with ptxas for each target."""

from __future__ import annotations

import pytest

from ptx_gen import catalog
from ptx_gen.ptxas import assemble

TARGETS = ("sm_80", "sm_89", "sm_90")
CASES = [(name, shape) for name in catalog.names() for shape in catalog.spec(name).grid]


def _id(case) -> str:
    name, shape = case
    return name + ("[" + ",".join(f"{k}={v}" for k, v in shape.items()) + "]" if shape else "")


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_catalog_kernel_assembles(case, target):
    name, shape = case
    kernel = catalog.emit(name, target=target, **shape)
    reports = assemble(kernel.ptx, target)
    assert [r.entry for r in reports] == [kernel.entry]
    report = reports[0]
    assert report.target == target
    assert not report.spills, f"{_id(case)} spills on {target}: {report.log}"


def test_catalog_lists_specs_with_docs_and_grids():
    assert len(CASES) >= len(catalog.names()) >= 3
    for name in catalog.names():
        s = catalog.spec(name)
        assert s.doc, f"{name} has no docstring"
        for shape in s.grid:
            s.full_shape(shape)


def test_unknown_kernel_and_shape_errors():
    with pytest.raises(KeyError, match="no kernel"):
        catalog.spec("no_such_kernel")
    with pytest.raises(ValueError, match="no shape parameter"):
        catalog.emit("row_sum", target="sm_90", colz=3)
