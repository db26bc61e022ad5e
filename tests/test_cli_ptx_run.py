"""``realizar ptx run KERNEL --emulate``: a catalog kernel on random inputs on the CPU emulator."""

from __future__ import annotations

import numpy as np

from ptx_gen.emulator import examples
from realizar.cli import main


def test_ptx_run_prints_one_line_per_output(capsys):
    assert main(["ptx", "run", "rope_kv_append", "-s", "head_dim=32,n_q=2", "--emulate"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("rope_kv_append {'head_dim': 32")
    assert [line.split(":")[0] for line in out[1:]] == ["qkv", "k_cache", "v_cache"]
    assert all("0 non-finite" in line for line in out[1:])


def test_ptx_run_reports_emulator_errors_with_exit_code_1(capsys, monkeypatch):
    good = examples.EXAMPLES["vector_add"]

    def short_output(kernel, sizes, rng):
        ex = good(kernel, sizes, rng)
        ex.params["out"] = np.zeros(ex.params["n"] // 2, np.float32)  # the kernel writes past it
        return ex

    monkeypatch.setitem(examples.EXAMPLES, "vector_add", short_output)
    assert main(["ptx", "run", "vector_add", "-s", "n=64", "--emulate"]) == 1
    err = capsys.readouterr().err
    assert "emulator error:" in err and "out-of-bounds global access" in err


def test_ptx_run_rejects_unknown_kernels_and_bad_shapes(capsys):
    assert main(["ptx", "run", "no_such_kernel", "--emulate"]) == 2
    assert "no example launch" in capsys.readouterr().err
    assert main(["ptx", "run", "vector_add", "-s", "vec", "--emulate"]) == 2
    assert "NAME=VALUE" in capsys.readouterr().err


def test_emulate_is_not_needed():
    """The emulator is the only mode: ``ptx run`` works without ``--emulate`` too."""
    assert main(["ptx", "run", "vector_add", "-s", "n=64"]) == 0
