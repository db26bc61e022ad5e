"""The ``realizar`` command line, run as a subprocess (``python -m realizar``) for every command,
including the error exits: one clear line on stderr, a non-zero status, no traceback unless
``--verbose``."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from realizar.engine import load_engine
from realizar.generation import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "The capital of France is"


def run(*args: str, input: str | None = None, timeout: float = 180, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    full_env.pop("REALIZAR_VERBOSE", None)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "realizar", *args],
        input=input if input is not None else "",
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=full_env,
    )


def assert_clean_error(p: subprocess.CompletedProcess, code: int = 1, match: str | None = None) -> str:
    """Non-zero exit, exactly one line on stderr starting 'realizar: error:', no traceback."""
    assert p.returncode == code, (p.returncode, p.stdout, p.stderr)
    assert "Traceback" not in p.stderr, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("realizar: error: "), p.stderr
    if match is not None:
        assert re.search(match, lines[0]), lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from tests.gguf_factory import shared_tiny_gguf

    return shared_tiny_gguf(tmp_path_factory)


@pytest.fixture(scope="module")
def oracle(tiny):
    return load_engine(str(tiny), device="cpu")


# ----------------------------------------------------------------------------------------------
# help and usage
# ----------------------------------------------------------------------------------------------

COMMANDS = [
    [], ["generate"], ["chat"], ["serve"], ["info"], ["bench"],
    ["ptx"], ["ptx", "list"], ["ptx", "emit"], ["ptx", "check"], ["ptx", "sass"], ["ptx", "diff"],
]


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: " ".join(c) or "realizar")
def test_help_everywhere(cmd):
    p = run(*cmd, "--help")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("usage: realizar")
    assert p.stderr == ""


def test_version():
    from realizar import __version__

    p = run("--version")
    assert p.returncode == 0 and p.stdout.strip() == f"realizar {__version__}"


def test_usage_errors_exit_2():
    p = run()
    assert p.returncode == 2 and "usage:" in p.stderr and "Traceback" not in p.stderr
    p = run("frobnicate")
    assert p.returncode == 2 and "invalid choice" in p.stderr
    p = run("generate", "x", "--max-tokens", "lots")
    assert p.returncode == 2 and "--max-tokens" in p.stderr
    p = run("generate", "x", "--device", "tpu")
    assert p.returncode == 2 and "--device" in p.stderr


# ----------------------------------------------------------------------------------------------
# generate
# ----------------------------------------------------------------------------------------------


def test_generate_streams_the_greedy_text_and_a_summary(tiny, oracle):
    expected = oracle.generate(PROMPT, SamplingParams(max_tokens=10, temperature=0.0))
    p = run("generate", PROMPT, "--model", str(tiny), "--device", "cpu", "--max-tokens", "10")
    assert p.returncode == 0, p.stderr
    assert p.stdout == expected.text + ("" if expected.text.endswith("\n") else "\n")
    summary = p.stderr.strip().splitlines()
    assert len(summary) == 1, p.stderr
    line = summary[0]
    assert f"{expected.prompt_tokens} prompt tokens" in line
    assert f"{expected.completion_tokens} generated" in line
    assert "prefill" in line and "decode" in line and "tok/s" in line
    assert "| cpu |" in line


def test_generate_reads_stdin_and_can_skip_the_summary(tiny, oracle):
    expected = oracle.generate(PROMPT, SamplingParams(max_tokens=5, temperature=0.0))
    p = run("generate", "-m", str(tiny), "-n", "5", "--no-stats", input=PROMPT)
    assert p.returncode == 0, p.stderr
    assert p.stdout.rstrip("\n") == expected.text.rstrip("\n")
    assert p.stderr == ""


def test_generate_chat_and_echo(tiny, oracle):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    expected = oracle.chat(msgs, SamplingParams(max_tokens=6, temperature=0.0))
    p = run("generate", "Hello", "-m", str(tiny), "-n", "6", "--chat", "--system", "Be brief.", "--no-stats")
    assert p.returncode == 0, p.stderr
    assert p.stdout.rstrip("\n") == expected.text.rstrip("\n")
    p = run("generate", PROMPT, "-m", str(tiny), "-n", "3", "--echo", "--no-stats")
    assert p.returncode == 0 and p.stdout.startswith(PROMPT)


def test_generate_sampling_options_and_seed(tiny):
    args = ["generate", PROMPT, "-m", str(tiny), "-n", "8", "-t", "0.9", "--top-k", "40", "--top-p", "0.95",
            "--repetition-penalty", "1.1", "--seed", "7", "--no-stats"]
    a, b = run(*args), run(*args)
    assert a.returncode == 0 and a.stdout == b.stdout


def test_generate_errors(tiny, oracle):
    assert_clean_error(run("generate", PROMPT, "--model", "/no/such/model.gguf"), match="no model at")
    assert_clean_error(run("generate", PROMPT, "-m", str(tiny), "-n", str(oracle.context_length + 1)),
                       match="exceeds the context")
    assert_clean_error(run("generate", PROMPT, "-m", str(tiny), "--temperature", "-1"), match="temperature")
    assert_clean_error(run("generate", "   ", "-m", str(tiny)), code=2, match="empty")


def test_generate_on_a_corrupt_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(64))
    assert_clean_error(run("generate", PROMPT, "-m", str(bad)))
    p = run("generate", PROMPT, "-m", str(bad), "--verbose")
    assert p.returncode == 1 and "Traceback" in p.stderr


def test_generate_cuda_without_a_gpu_is_a_clear_error(tiny):
    from realizar import cuda

    if cuda.is_available():
        pytest.skip("a GPU is present")
    assert_clean_error(run("generate", PROMPT, "-m", str(tiny), "--device", "cuda"), match="GPU")


# ----------------------------------------------------------------------------------------------
# chat
# ----------------------------------------------------------------------------------------------


def test_chat_multi_turn_from_stdin(tiny, oracle):
    params = SamplingParams(max_tokens=5, temperature=0.0)
    first = oracle.chat([{"role": "user", "content": "Hello"}], params).text
    second = oracle.chat(
        [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": first},
         {"role": "user", "content": "And then?"}], params).text
    after_reset = oracle.chat([{"role": "user", "content": "Again"}], params).text
    p = run("chat", "-m", str(tiny), "-n", "5", "-t", "0", input="Hello\n\nAnd then?\n/reset\nAgain\n")
    assert p.returncode == 0, p.stderr
    assert p.stdout == "".join(t + "\n" for t in (first, second, after_reset))


def test_chat_keeps_earlier_turns_cached(tiny, oracle):
    """Turn 2's prompt starts with turn 1 (prompt and reply): only the positions past the cached full
    blocks of that shared prefix are prefilled — counted by --stats, checked against the token ids."""
    from realizar.cli.generate import CHAT_BLOCK_SIZE as BS

    system = "You answer in one short sentence and never use lists or long words."
    params = SamplingParams(max_tokens=8, temperature=0.0)
    turn1 = [{"role": "system", "content": system}, {"role": "user", "content": "Hello there"}]
    ids1 = oracle.chat_prompt(turn1)
    first = oracle.generate(ids1, params)
    ids2 = oracle.chat_prompt([*turn1, {"role": "assistant", "content": first.text},
                               {"role": "user", "content": "And then?"}])  # fmt: skip
    seen = ids1 + first.token_ids[:-1]  # the last sampled token was never run through the model
    common = next((i for i, (a, b) in enumerate(zip(seen, ids2)) if a != b), min(len(seen), len(ids2)))
    cached = min(common, len(ids2) - 1) // BS * BS
    assert cached >= BS, "the test needs a shared prefix of at least one block"

    p = run("chat", "-m", str(tiny), "-n", "8", "-t", "0", "--stats", "--system", system,
            input="Hello there\nAnd then?\n")  # fmt: skip
    assert p.returncode == 0, p.stderr
    counts = [tuple(map(int, m)) for m in re.findall(r"prompt: (\d+) prefilled, (\d+) from the cache", p.stderr)]
    assert counts == [(len(ids1), 0), (len(ids2) - cached, cached)], (counts, len(ids1), len(ids2), common)
    assert len(ids2) - cached < len(ids2) - common + BS  # at most a block's worth beyond the new tokens


def test_chat_exit_command_and_errors(tiny):
    p = run("chat", "-m", str(tiny), "-n", "2", "-t", "0", input="/exit\nnever answered\n")
    assert p.returncode == 0 and p.stdout == ""
    assert_clean_error(run("chat", "-m", "/no/such/dir"), match="no model at")


# ----------------------------------------------------------------------------------------------
# info and bench
# ----------------------------------------------------------------------------------------------


def test_info(tiny, oracle):
    p = run("info", str(tiny))
    assert p.returncode == 0, p.stderr
    out = p.stdout
    c = oracle.config
    for pattern in (r"architecture\s+llama", rf"context length\s+{c.context_length}", rf"layers\s+{c.num_layers}",
                    rf"{c.num_heads} heads, {c.num_kv_heads} KV heads, head_dim {c.head_dim}",
                    r"tensors\s+\d+", r"Q8_0", r"F32", r"tokenizer\s+gpt2", r"chat template\s+yes"):
        assert re.search(pattern, out), (pattern, out)

    p = run("info", str(tiny), "--json", "--tensors")
    info = json.loads(p.stdout)
    assert info["architecture"] == "llama" and info["hidden_size"] == c.hidden_size
    names = {t["name"] for t in info["tensors"]}
    assert "token_embd.weight" in names
    assert info["tensor_count"] == len(info["tensors"])
    assert sum(e["bytes"] for e in info["tensor_types"].values()) == info["tensor_bytes"]

    p = run("info", str(tiny), "--tensors")
    assert re.search(r"token_embd\.weight\s+Q8_0", p.stdout)


def test_info_and_generate_on_a_safetensors_directory(tiny):
    hf_dirs = [d for d in tiny.parent.iterdir() if (d / "config.json").is_file()]
    if not hf_dirs:
        pytest.skip("the model factory left no HF directory")
    p = run("info", str(hf_dirs[0]))
    assert p.returncode == 0, p.stderr
    assert "safetensors" in p.stdout and re.search(r"rope\s+neox", p.stdout)
    p = run("generate", PROMPT, "-m", str(hf_dirs[0]), "-n", "3")
    assert p.returncode == 0, p.stderr
    assert "3 generated" in p.stderr


def test_info_errors(tmp_path):
    assert_clean_error(run("info", str(tmp_path / "missing.gguf")), match="no model at")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"this is not a gguf file at all")
    assert_clean_error(run("info", str(junk)))


def test_bench(tiny):
    p = run("bench", "-m", str(tiny), "-p", "8", "-g", "4", "-r", "2", "--warmup", "0", "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["device"] == "cpu" and r["prompt_tokens"] == 8 and r["gen_tokens"] == 4
    assert r["prefill_tokens_per_second"] > 0 and r["decode_tokens_per_second"] > 0
    assert r["time_to_first_token_seconds"] > 0
    p = run("bench", "-m", str(tiny), "-p", "8", "-g", "2", "-r", "1")
    assert p.returncode == 0, p.stderr
    header = p.stdout.splitlines()[0]
    assert "| time to first token ms |" in header and "| prefill tok/s |" in header and "| decode tok/s |" in header
    assert_clean_error(run("bench", "-m", str(tiny), "-p", "100000"), match="exceeds the context")


class _DeviceLogits:
    """Logits left on the device: the greedy path reads only the argmax; copying them is an error."""

    def __init__(self, token: int):
        self.token = token

    def greedy_token(self) -> int:
        return self.token

    def __array__(self, dtype=None, copy=None):
        raise AssertionError("bench copied the whole logits vector")


class _CountingModel:
    """Returns token (previous + 1); records the calls."""

    context_length = 64

    def __init__(self):
        self.calls: list[tuple] = []

    def reset(self):
        self.calls.append(("reset",))

    def prefill(self, ids):
        self.calls.append(("prefill", len(ids)))
        return _DeviceLogits(ids[-1] + 1)

    def decode(self, token):
        self.calls.append(("decode", token))
        return _DeviceLogits(token + 1)


def test_bench_takes_the_greedy_read_back_path():
    """run_bench picks tokens like generate does: through greedy_token, never the logits vector."""
    from types import SimpleNamespace

    from realizar.cli.bench import run_bench

    class Tok:
        def encode(self, text, add_special_tokens=True):
            return list(range(10))

    model = _CountingModel()
    engine = SimpleNamespace(model=model, tokenizer=Tok(), context_length=64, name="stub", device="cuda")
    r = run_bench(engine, prompt_tokens=5, gen_tokens=3, repeats=2, warmup=1)
    one_run = [("reset",), ("prefill", 5), ("decode", 5), ("decode", 6), ("decode", 7)]
    assert model.calls == one_run * 3
    assert r["gen_tokens"] == 3 and r["repeats"] == 2 and r["device"] == "cuda"


# ----------------------------------------------------------------------------------------------
# serve
# ----------------------------------------------------------------------------------------------


def _start_server(*args: str) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "realizar", "serve", "--port", "0", "--log-level", "warning", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env,
    )
    deadline = time.monotonic() + 120
    seen = []
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        seen.append(line)
        m = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", line)
        if m:
            return proc, m.group(1)
    proc.kill()
    raise AssertionError("server did not start: " + "".join(seen))


def test_serve_binds_loopback_and_answers(tiny):
    httpx = pytest.importorskip("httpx")
    proc, url = _start_server("-m", str(tiny), "--model-name", "tiny")
    try:
        assert httpx.get(url + "/health", timeout=10).json()["status"] == "ok"
        assert [m["id"] for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]] == ["tiny"]
        # greedy: the API's default temperature 1 with no seed may draw the end-of-sequence token early
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 3,
                                                      "temperature": 0}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        err = _stop_server(proc)
    assert "Traceback" not in err


def test_serve_port_in_use(tiny):
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    try:
        port = s.getsockname()[1]
        assert_clean_error(run("serve", "-m", str(tiny), "--port", str(port)), match="cannot listen")
    finally:
        s.close()
    p = run("serve", "--port", "70000")
    assert p.returncode == 2


def test_serve_batching_flags_reach_the_server(tiny, oracle):
    """--kv-memory / --kv-dtype / --block-size / --max-batch size the KV pool as asked (read back from
    /metrics), and --max-body refuses a larger body with 413."""
    httpx = pytest.importorskip("httpx")
    from prometheus_client.parser import text_string_to_metric_families

    c = oracle.config
    per_block = 2 * c.num_layers * c.num_kv_heads * 16 * c.head_dim * 2  # f16, 16 positions
    gib = 40 * per_block / (1 << 30)
    proc, url = _start_server("-m", str(tiny), "--model-name", "tiny", "--kv-memory", f"{gib!r}GiB",
                              "--kv-dtype", "f16", "--block-size", "16", "--max-batch", "4", "--max-body", "1K")
    try:
        # greedy: the API's default temperature 1 with no seed may draw the end-of-sequence token early
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 3,
                                                      "temperature": 0}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        m = {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text)}
        total = m["realizar_kv_blocks_total"].samples[0].value
        assert total in (40, 41), total  # kv_memory // bytes per block (+ the reserved null block, not counted)
        r = httpx.post(url + "/v1/completions", content=b" " * 1025, headers={"content-type": "application/json"},
                       timeout=30)  # fmt: skip
        assert r.status_code == 413
    finally:
        _stop_server(proc)


@pytest.mark.parametrize("args, code, match", [
    (["--kv-memory", "50%"], 1, "fraction of free GPU memory needs a GPU"),
    (["--kv-memory", "lots"], 2, "--kv-memory: expected GiB"),
    (["--kv-memory", "0"], 2, "--kv-memory: expected a size > 0"),
    (["--kv-memory", "150%"], 2, "at most 100%"),
    (["--kv-dtype", "f8"], 2, "--kv-dtype: invalid choice"),
    (["--block-size", "24"], 2, "--block-size: invalid choice"),
    (["--max-batch", "0"], 2, "--max-batch: expected an integer > 0"),
    (["--max-body", "-5"], 2, "--max-body: expected a number of bytes"),
    (["--max-body", "4X"], 2, "--max-body: expected a number of bytes"),
])
def test_serve_bad_batching_values_are_one_line_errors(tiny, args, code, match):
    p = run("serve", "-m", str(tiny), "-d", "cpu", "--port", "0", *args)
    assert p.returncode == code, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert re.search(re.escape(match), lines[-1]), lines
    if code == 1:
        assert_clean_error(p, match=re.escape(match))


# ----------------------------------------------------------------------------------------------
# ptx
# ----------------------------------------------------------------------------------------------


def test_ptx_list_and_emit():
    from ptx_gen import catalog

    p = run("ptx", "list")
    assert p.returncode == 0
    listed = [ln.split("(")[0] for ln in p.stdout.splitlines()]
    assert listed == catalog.names()
    data = json.loads(run("ptx", "list", "--json").stdout)
    assert [k["name"] for k in data] == catalog.names()

    name = catalog.names()[0]
    shape = catalog.spec(name).grid[0]
    shape_args = [a for k, v in shape.items() for a in ("--shape", f"{k}={v}")]
    p = run("ptx", "emit", name, *shape_args, "--target", "sm_80")
    assert p.returncode == 0
    assert p.stdout == catalog.emit(name, "sm_80", **shape).ptx


def test_ptx_emit_to_file(tmp_path):
    out = tmp_path / "k.ptx"
    p = run("ptx", "emit", "vector_add", "-s", "vec=2", "-o", str(out))
    assert p.returncode == 0 and ".entry" in out.read_text()


@pytest.mark.full
def test_ptx_check_every_catalog_kernel():
    from ptx_gen import catalog

    p = run("ptx", "check", "--json", timeout=600)
    assert p.returncode == 0, p.stderr
    results = json.loads(p.stdout)
    assert {r["name"] for r in results} == set(catalog.names())
    assert all(r["ok"] and r["registers"] > 0 for r in results)
    # sm_80 and sm_90 for each, or its own target alone for an architecture-specific kernel (gemm_wg: sm_90a)
    expected = sum(len(catalog.spec(n).grid) * len(catalog.targets(catalog.spec(n), ("sm_80", "sm_90")))
                   for n in catalog.names())
    assert len(results) == expected

    p = run("ptx", "check", "vector_add", "--grid")
    assert p.returncode == 0
    assert p.stdout.splitlines()[0].split()[:4] == ["kernel", "shape", "target", "regs"]
    assert re.search(r"\d+ checked, 0 failed", p.stderr)


def test_ptx_check_one_kernel_and_shape():
    p = run("ptx", "check", "vector_add", "-s", "vec=4", "--target", "sm_90", "--json")
    assert p.returncode == 0, p.stderr
    [r] = json.loads(p.stdout)
    assert r["name"] == "vector_add" and r["shape"] == {"vec": 4} and r["target"] == "sm_90"
    p = run("ptx", "check", "vector_add", "--grid", "--json")
    assert p.returncode == 0 and len(json.loads(p.stdout)) >= 2


def test_ptx_sass():
    from ptx_gen.inspect import SassToolNotFound, find_sass_tool

    p = run("ptx", "sass", "vector_add", "-s", "vec=4")
    try:
        find_sass_tool()
    except SassToolNotFound:
        assert_clean_error(p, match="nvdisasm")
        return
    assert p.returncode == 0, p.stderr
    assert "vector_add_v4" in p.stdout and "EXIT" in p.stdout


def test_ptx_diff():
    p = run("ptx", "diff", "vector_add", "vec=1", "vec=4")
    assert p.returncode == 0
    assert p.stdout.startswith("--- vector_add [vec=1] sm_90\n+++ vector_add [vec=4] sm_90\n")
    p = run("ptx", "diff", "vector_add", "vec=2", "vec=2")
    assert p.returncode == 0 and p.stdout == "" and "identical" in p.stderr


def test_ptx_errors():
    assert_clean_error(run("ptx", "emit", "no_such_kernel"), match="no kernel 'no_such_kernel'")
    assert_clean_error(run("ptx", "emit", "vector_add", "-s", "bogus=1"), code=2, match="no shape parameter")
    assert_clean_error(run("ptx", "emit", "vector_add", "-s", "vec"), code=2, match="NAME=VALUE")
    assert_clean_error(run("ptx", "emit", "gemv", "-s", "in_dim=abc"), code=2, match="shape parameter .in_dim. must be an int")
    assert_clean_error(run("ptx", "check", "gemv", "-s", "in_dim=abc"), code=2, match="shape parameter .in_dim. must be an int")
    assert_clean_error(run("ptx", "emit", "vector_add", "--target", "sm_70"), match="unsupported target")
    assert_clean_error(run("ptx", "diff", "no_such_kernel", "a=1", "a=2"), match="no kernel")
    assert run("ptx", "check", "--target", "sm_70").returncode == 2
    assert run("ptx").returncode == 2


# ----------------------------------------------------------------------------------------------
# the real default model
# ----------------------------------------------------------------------------------------------


def _smollm2_args() -> list[str]:
    """No --model: the default model path (download, sha256 check, cache) is exercised as users see it.
    The download runs once, here in the test process, so the subprocess only reads the cache."""
    from realizar.default_model import default_model_path

    default_model_path()
    return []


@pytest.mark.full
def test_smollm2_capital_of_france():
    p = run("generate", PROMPT, "--max-tokens", "2", *_smollm2_args(), timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith(" Paris")
    assert "5 prompt tokens, 2 generated" in p.stderr


@pytest.mark.full
def test_smollm2_info():
    args = _smollm2_args()
    if not args:
        from realizar.default_model import default_model_path

        args = ["--model", str(default_model_path())]
    p = run("info", args[1])
    assert p.returncode == 0, p.stderr
    assert re.search(r"parameters\s+134\.52M", p.stdout)
    assert re.search(r"Q4_1\s+210 tensors", p.stdout)
    assert re.search(r"pre-tokenizer smollm", p.stdout)


def _stop_server(proc) -> str:
    """SIGINT a `realizar serve` process, wait for it, check it exited cleanly; its stderr."""
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 0, err
    return err
