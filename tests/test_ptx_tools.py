"""ptx_gen.inspect: PTX text, ptxas resource reports over the whole catalog, SASS, diffs; shape text
parsing and the CUDA tool lookup (ptx_gen.toolchain)."""

from __future__ import annotations

import pytest

from ptx_gen import catalog, toolchain
from ptx_gen import inspect as ptx_tools


def _first_shape(name: str) -> dict:
    return dict(catalog.spec(name).grid[0])


def test_list_kernels_matches_catalog():
    infos = ptx_tools.list_kernels()
    assert [k.name for k in infos] == catalog.names()
    for k in infos:
        assert k.signature().startswith(k.name + "(")
        for p in k.shape_params:
            assert p in k.signature()


@pytest.mark.parametrize("name", catalog.names())
def test_ptx_text_is_a_module_for_the_target(name):
    shape = _first_shape(name)
    for target in catalog.targets(catalog.spec(name), ("sm_80", "sm_90")):
        text = ptx_tools.ptx_text(name, target, **shape)
        assert f".target {target}" in text
        assert ".entry" in text
        assert text == catalog.emit(name, target, **shape).ptx


@pytest.mark.full
def test_check_all_covers_every_catalog_kernel_and_grid_shape():
    calls = []
    results = ptx_tools.check_all(progress=lambda done, total, label: calls.append((done, total, label)))
    assert [c[0] for c in calls] == list(range(1, len(results) + 1))
    assert {c[1] for c in calls} == {len(results)}
    failed = [r.summary() for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    seen = {(r.name, r.target, tuple(sorted(r.shape.items()))) for r in results}
    for name in catalog.names():
        spec = catalog.spec(name)
        for shape in spec.grid:
            full = spec.full_shape(dict(shape))
            for target in catalog.targets(spec, ptx_tools.CHECK_TARGETS):
                assert (name, target, tuple(sorted(full.items()))) in seen
    for r in results:
        assert r.registers > 0
        assert r.entry
        assert r.stack_bytes >= 0 and r.shared_bytes >= 0
        assert r.report is not None and r.report.cubin
        d = r.as_dict()
        assert d["name"] == r.name and "cubin" not in d


@pytest.mark.parametrize("name", catalog.names())
def test_check_one_kernel(name):
    r = ptx_tools.check(name, "sm_90", **_first_shape(name))
    assert r.ok and r.target == catalog.target_for(catalog.spec(name), "sm_90")  # (sm_90a for gemm_wg)
    assert r.entry == catalog.emit(name, "sm_90", **_first_shape(name)).entry
    assert set(r.shape) == set(catalog.spec(name).shape_params)
    assert name in r.summary()


def test_check_all_reports_a_broken_kernel_without_raising(monkeypatch):
    from ptx_gen.ptxas import PtxasError

    def broken(ptx, target, opt_level=3):
        raise PtxasError("ptxas failed", "ptxas fatal   : k.ptx, line 3; error   : syntax error", ptx)

    monkeypatch.setattr(ptx_tools, "assemble", broken)
    name = catalog.names()[0]
    results = ptx_tools.check_all(names=[name])
    assert results and all(not r.ok for r in results)
    assert "syntax error" in results[0].error
    assert "FAILED" in results[0].summary()


def test_unknown_kernel_shape_and_target_raise():
    with pytest.raises(KeyError, match="no kernel"):
        ptx_tools.ptx_text("no_such_kernel")
    name = catalog.names()[0]
    with pytest.raises(ValueError, match="no shape parameter"):
        ptx_tools.ptx_text(name, "sm_90", no_such_param=1)
    with pytest.raises(ValueError, match="unsupported target"):
        ptx_tools.ptx_text(name, "sm_75")
    with pytest.raises(KeyError):
        ptx_tools.check_all(names=["no_such_kernel"])


def test_parse_shape():
    assert ptx_tools.parse_shape(None) == {}
    assert ptx_tools.parse_shape("") == {}
    assert ptx_tools.parse_shape("vec=4") == {"vec": 4}
    assert ptx_tools.parse_shape(["a=1,b=0x10", "c=true", "d=1.5", "e=f16", "g=none"]) == {
        "a": 1, "b": 16, "c": True, "d": 1.5, "e": "f16", "g": None,
    }
    assert ptx_tools.parse_shape({"vec": 2}) == {"vec": 2}
    for bad in ("vec", "=4", "1x=2", "vec=1,vec=2"):
        with pytest.raises(ValueError):
            ptx_tools.parse_shape(bad)


def test_diff_of_two_shapes():
    name = "axpy" if "axpy" in catalog.names() else catalog.names()[0]
    spec = catalog.spec(name)
    if len(spec.grid) < 2:
        pytest.skip("needs a kernel with two grid shapes")
    a, b = dict(spec.grid[0]), dict(spec.grid[1])
    out = ptx_tools.diff(name, a, b)
    assert out.startswith("--- ")
    assert "\n+++ " in out and "\n@@ " in out
    assert ptx_tools.diff(name, a, a) == ""
    # the string form and a target change
    s = ",".join(f"{k}={v}" for k, v in a.items())
    assert ptx_tools.diff(name, s, s, target="sm_80", target_b="sm_90").count(".target") == 2


def test_sass_or_a_clear_error():
    name = catalog.names()[0]
    shape = _first_shape(name)
    try:
        ptx_tools.find_sass_tool()
    except ptx_tools.SassToolNotFound as e:
        assert "nvdisasm" in str(e)
        with pytest.raises(ptx_tools.SassToolNotFound):
            ptx_tools.sass(name, "sm_90", **shape)
        return
    text = ptx_tools.sass(name, "sm_90", **shape)
    entry = catalog.emit(name, "sm_90", **shape).entry
    assert entry in text
    assert "EXIT" in text  # every kernel ends with an EXIT instruction


def test_sass_tool_missing_message(monkeypatch, tmp_path):
    monkeypatch.setattr(toolchain, "tool_candidates", lambda tool: [tmp_path / tool])
    with pytest.raises(ptx_tools.SassToolNotFound, match="pip install nvidia-cuda-nvdisasm"):
        ptx_tools.find_sass_tool()


def test_toolchain_finds_a_tool_from_its_environment_variable(monkeypatch, tmp_path):
    exe = tmp_path / "nvdisasm"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    monkeypatch.setenv("NVDISASM", str(exe))
    assert toolchain.tool_candidates("nvdisasm")[0] == exe
    assert toolchain.find_tool("nvdisasm") == str(exe)
    assert ptx_tools.find_sass_tool() == ("nvdisasm", str(exe))
    monkeypatch.setattr(toolchain, "tool_candidates", lambda tool: [tmp_path / "absent"])
    with pytest.raises(toolchain.ToolNotFound, match="no_such_tool not found: try this"):
        toolchain.find_tool("no_such_tool", "try this")


def test_check_all_progress_bar(monkeypatch, capsys):
    monkeypatch.setattr(ptx_tools, "check", lambda name, target, **shape: ptx_tools.CheckResult(name, target, shape))
    name = "axpy"
    results = ptx_tools.check_all(names=[name], progress=True)
    assert len(results) == len(catalog.spec(name).grid) * len(ptx_tools.CHECK_TARGETS)
    assert "ptx check" in capsys.readouterr().err


def test_parse_shape_arg_converts_to_the_default_types():
    assert ptx_tools.parse_shape_arg("gemv", "in_dim=0x100,wtype=Q4_K") == {"in_dim": 256, "wtype": "Q4_K"}
    assert ptx_tools.parse_shape_arg("gemv", ["rows=4", "in_dim=512", "glu=true"]) == {"rows": 4, "in_dim": 512, "glu": True}
    assert ptx_tools.parse_shape_arg("gemv", None) == {}
    assert ptx_tools.parse_shape_arg("gemv", {"in_dim": "512"}) == {"in_dim": 512}
    bools = [p for p, d in catalog.spec("rmsnorm").defaults.items() if isinstance(d, bool)]
    for p in bools:
        assert ptx_tools.parse_shape_arg("rmsnorm", f"{p}=true") == {p: True}
        assert ptx_tools.parse_shape_arg("rmsnorm", f"{p}=0") == {p: False}


@pytest.mark.parametrize(
    "kernel, text, match",
    [
        ("gemv", "in_dim=abc", "kernel gemv: shape parameter 'in_dim' must be an int \\(default 4096\\), got 'abc'"),
        ("gemv", "in_dim=1.5", "'in_dim' must be an int"),
        ("gemv", "no_such=1", "no shape parameter 'no_such'"),
        ("gemv", "in_dim", "expected NAME=VALUE"),
        ("gemv", "in_dim=1,in_dim=2", "given twice"),
    ],
)
def test_parse_shape_arg_errors_name_the_parameter(kernel, text, match):
    with pytest.raises(ValueError, match=match):
        ptx_tools.parse_shape_arg(kernel, text)


def test_text_for_a_numeric_parameter_is_a_clean_error_at_emit():
    with pytest.raises(ValueError, match="shape parameter 'in_dim' must be an int"):
        catalog.emit("gemv", "sm_90", in_dim="abc")
    with pytest.raises(ValueError, match="'in_dim' must be an int"):
        ptx_tools.check("gemv", "sm_90", in_dim="4096")
