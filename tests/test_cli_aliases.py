"""The flags llama.cpp and vLLM users type, as aliases of ours (each parses to the same settings), ``-ngl``
accepted and ignored with a note, sampling values refused before a model loads, and ``REALIZAR_<FLAG>``
environment defaults for every serve flag (the command line wins; a bad value is refused naming the
variable)."""

from __future__ import annotations

import pytest

from realizar.cli import build_parser, main

SERVE_ALIASES = [
    (["--max-context", "64"], [["-c", "64"], ["--ctx-size", "64"], ["--max-model-len", "64"]], "max_context", 64),
    (["--model-id", "m"], [["--served-model-name", "m"], ["--model-name", "m"]], "model_name", ["m"]),
    (["--max-batch", "8"], [["--max-num-seqs", "8"], ["-np", "8"]], "max_batch", 8),
    (["--kv-dtype", "q8_0"], [["--kv-cache-dtype", "q8_0"]], "kv_dtype", "q8_0"),
]


@pytest.mark.parametrize("ours,theirs,dest,value", SERVE_ALIASES, ids=[a[2] for a in SERVE_ALIASES])
def test_serve_aliases_parse_to_our_settings(ours, theirs, dest, value):
    want = build_parser().parse_args(["serve", *ours])
    assert getattr(want, dest) == value
    for alias in theirs:
        got = build_parser().parse_args(["serve", *alias])
        assert vars(got) == vars(want), alias


def test_generate_aliases():
    want = build_parser().parse_args(["generate", "--temperature", "0.5", "--max-context", "32", "hi"])
    for alias in (["--temp", "0.5", "-c", "32"], ["-t", "0.5", "--ctx-size", "32"]):
        assert vars(build_parser().parse_args(["generate", *alias, "hi"])) == vars(want)


def test_ngl_is_accepted_and_ignored(capsys):
    args = build_parser().parse_args(["generate", "-ngl", "99", "hi"])
    assert "-ngl 99 is accepted and ignored" in capsys.readouterr().err
    without = vars(build_parser().parse_args(["generate", "hi"]))
    assert {k: v for k, v in vars(args).items() if k != "n_gpu_layers"} == {
        k: v for k, v in without.items() if k != "n_gpu_layers"}


def test_sampling_values_are_refused_before_the_model_loads(capsys, tmp_path):
    missing = str(tmp_path / "no-such-model.gguf")
    code = main(["generate", "-m", missing, "--top-p", "1.5", "hi"])
    err = capsys.readouterr().err
    assert code == 1 and "top_p" in err and "no-such-model" not in err


def test_serve_flags_take_environment_defaults(monkeypatch, capsys):
    monkeypatch.setenv("REALIZAR_MAX_BATCH", "7")
    monkeypatch.setenv("REALIZAR_KV_DTYPE", "f16")
    monkeypatch.setenv("REALIZAR_MAX_NUM_BATCHED_TOKENS", "300")
    monkeypatch.setenv("REALIZAR_HOST", "0.0.0.0")
    args = build_parser().parse_args(["serve"])
    assert (args.max_batch, args.kv_dtype, args.max_num_batched_tokens, args.host) == (7, "f16", 300, "0.0.0.0")
    assert build_parser().parse_args(["serve", "--max-num-seqs", "9"]).max_batch == 9  # the command line wins
    monkeypatch.setenv("REALIZAR_MAX_BATCH", "lots")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve"])
    assert "REALIZAR_MAX_BATCH='lots'" in capsys.readouterr().err
    monkeypatch.setenv("REALIZAR_MAX_BATCH", "4")
    monkeypatch.setenv("REALIZAR_KV_DTYPE", "f8")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve"])
    assert "REALIZAR_KV_DTYPE='f8'" in capsys.readouterr().err


def test_gpu_memory_utilization(capsys, tmp_path_factory):
    from tests.gguf_factory import shared_tiny_gguf

    assert build_parser().parse_args(["serve", "--gpu-memory-utilization", "0.9"]).gpu_memory_utilization == 0.9
    for bad in ("0", "1.5", "x"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--gpu-memory-utilization", bad])
    capsys.readouterr()
    assert main(["serve", "--gpu-memory-utilization", "0.9", "--kv-memory", "4"]) == 2
    assert "not both" in capsys.readouterr().err
    path = str(shared_tiny_gguf(tmp_path_factory))
    assert main(["serve", "-m", path, "--device", "cpu", "--gpu-memory-utilization", "0.9"]) != 0
    assert "--gpu-memory-utilization applies to a GPU" in capsys.readouterr().err
    # the device chosen by the engine process (auto; no GPU in CI): the same refusal, from the child, in one line
    if not _has_gpu():
        assert main(["serve", "-m", path, "--gpu-memory-utilization", "0.9"]) != 0
        err = capsys.readouterr().err
        assert "--gpu-memory-utilization applies to a GPU (running on cpu)" in err and "Traceback" not in err


def _has_gpu() -> bool:
    from realizar import cuda

    try:
        cuda.current_device()
        return True
    except Exception:  # noqa: BLE001 - no driver, no device
        return False


def test_the_engine_process_switch_and_its_variable(monkeypatch):
    """``serve`` runs the engine in a process of its own unless ``--no-engine-process`` or
    ``REALIZAR_ENGINE_PROCESS=0``; the command line wins over the variable."""
    assert build_parser().parse_args(["serve"]).engine_process is True
    assert build_parser().parse_args(["serve", "--no-engine-process"]).engine_process is False
    monkeypatch.setenv("REALIZAR_ENGINE_PROCESS", "0")
    assert build_parser().parse_args(["serve"]).engine_process is False
    assert build_parser().parse_args(["serve", "--engine-process"]).engine_process is True
    monkeypatch.setenv("REALIZAR_ENGINE_PROCESS", "yes")
    assert build_parser().parse_args(["serve"]).engine_process is True


def test_api_servers_default_and_refusal(capsys, monkeypatch):
    """``--api-servers``: by default one per 4 CPU cores, at most 4; more than one needs the engine process."""
    import os

    from realizar.server.fronts import default_api_servers

    for cores, want in ((1, 1), (2, 1), (7, 1), (8, 2), (16, 4), (128, 4)):
        monkeypatch.setattr(os, "cpu_count", lambda c=cores: c)
        assert default_api_servers() == want
    assert main(["serve", "--no-engine-process", "--api-servers", "2"]) == 2
    assert "--api-servers above 1" in capsys.readouterr().err
