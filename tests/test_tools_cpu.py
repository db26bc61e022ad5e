"""The benchmark tools' control flow on the CPU: tools/bench_prefill.py end to end on the emulated
device with its tiny shape, and the shared random benchmark shapes of realizar.models.random."""

from __future__ import annotations

import dataclasses
import importlib.util
from types import SimpleNamespace

import pytest

import tools.bench_prefill as bench_prefill
from realizar import cuda
from realizar.models import names
from realizar.models.random import BENCH_SHAPES, BenchShape, bench_model, token_read_bytes
from tests.helpers import tiered


def _rows(text: str, first_cell: str) -> list[list[str]]:
    """The cells of the Markdown table rows of ``text`` whose first cell is ``first_cell``."""
    rows = [line.strip("|").split("|") for line in text.splitlines() if line.startswith("|")]
    return [[c.strip() for c in r] for r in rows if r[0].strip() == first_cell]


@pytest.mark.parametrize("peer", tiered(["none", "cpu"], {0}))
def test_bench_prefill_tiny_on_the_emulator(tmp_path, capsys, peer):
    if peer == "cpu" and importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    out = tmp_path / "prefill.md"
    import realizar.gpu.gemm_wg as host

    before = host.WS_STREAMK
    argv = ["--device", "emulate", "--tiny", "--lengths", "2,3", "--runs", "1", "--warmup", "1",
            "--torch", peer, "--peak-tflops", "1", "--policy", "WS_STREAMK=0.5", "--out", str(out)]
    assert bench_prefill.main(argv) == 0
    assert host.WS_STREAMK == before  # (the policy setting undone after the run)
    text = out.read_text()
    assert "- launch policy changed: WS_STREAMK=0.5" in text
    assert text in capsys.readouterr().out  # the log is printed too
    assert "- GPU: emulated sm_90" in text and "- date: " in text
    assert f"- command: `python tools/bench_prefill.py {' '.join(argv)}`" in text
    assert "llama-bench -ngl 99 -p 512" in text and "2026-11-21" in text
    rows = _rows(text, "tiny")
    assert len(rows) == 3  # two lengths, then the summary row
    detail, summary = rows[:2], rows[2]
    for row, s in zip(detail, (2, 3)):
        assert row[1] == str(s) and float(row[2]) > 0 and float(row[4]) > 0  # tok/s, TTFT
        assert row[6].endswith("%")  # --peak-tflops gives a roofline
        assert row[7] == row[8] == "-"  # no llama.cpp figure for the toy shape
        assert (row[9] == "-") == (peer == "none")
    assert len(summary) == 8 and summary[1] == detail[0][2]
    if peer == "none":
        assert "torch peer: skipped: disabled (--torch none)" in text
    else:
        assert "on cpu, eager, f16" in text and float(summary[7]) > 0


def test_bench_prefill_figures():
    assert bench_prefill.peak_tflops("NVIDIA H200") == 989.0
    assert bench_prefill.peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert bench_prefill.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert bench_prefill.peak_tflops("emulated sm_90") is None
    cfg, _, _ = bench_model(bench_prefill.TINY)
    h, f = cfg.hidden_size, cfg.intermediate_size
    per_layer = h * cfg.q_dim + 2 * h * cfg.kv_dim + cfg.q_dim * h + 3 * h * f
    assert bench_prefill.matmul_params(cfg) == cfg.num_layers * per_layer
    r = dict(cfg=cfg, realizar={512: (0.5, 0.6)}, llama=1024, torch={512: 0.25})
    v = bench_prefill.row_values(r, 512, peak=1.0)
    assert v["tps"] == 1024 and v["x_llama"] == 1.0 and v["x_torch"] == 0.5
    assert v["frac"] == pytest.approx(1024 * 2 * bench_prefill.matmul_params(cfg) / 1e12)


def test_bench_prefill_skips_torch_with_a_reason(monkeypatch):
    peer = bench_prefill.TorchPeer("none")
    assert peer.torch is None and "disabled" in peer.label
    if importlib.util.find_spec("torch") is None:
        return
    peer = bench_prefill.TorchPeer("cpu")
    monkeypatch.setattr(peer, "_free_bytes", lambda: 1 << 20)
    cfg, _, _ = bench_model(bench_prefill.TINY)
    times, why = bench_prefill.bench_torch(peer, cfg, [512], None)
    assert times == {} and "GiB free" in why


def test_bench_shapes_are_the_documented_models():
    assert list(BENCH_SHAPES) == ["smollm2-135m", "llama-3.2-1b", "llama-3-8b"]
    assert [s.weight_type for s in BENCH_SHAPES.values()] == ["Q4_1", "Q4_K", "Q4_K"]
    with pytest.raises(ValueError, match="unknown benchmark shape"):
        bench_model("no-such-shape")


def test_decode_shapes_add_q5_k_m_and_q4_0_at_8b():
    from realizar.models.config import ModelConfig
    from realizar.models.quants import type_name
    from realizar.models.random import DECODE_SHAPES, random_model

    assert list(DECODE_SHAPES)[:3] == list(BENCH_SHAPES)
    assert DECODE_SHAPES["llama-3-8b-q5_k_m"].config == DECODE_SHAPES["llama-3-8b-q4_0"].config == \
        BENCH_SHAPES["llama-3-8b"].config
    # the K_M mix on 16 layers: attn_v / ffn_down Q6_K in layers 0, 1, 4, 7, 10, 13, 14, 15, the rest Q5_K
    cfg = ModelConfig(**dict(bench_prefill.TINY.config, num_layers=16, hidden_size=256, intermediate_size=256,
                             num_heads=4, num_kv_heads=2, head_dim=64))
    tensors = random_model(cfg, "Q5_K", "Q5_K", "Q6_K", mix="K_M")
    wide = [i for i in range(16) if type_name(tensors[names.layer_name(i, "ffn_down")].ggml_type) == "Q6_K"]
    assert wide == [0, 1, 4, 7, 10, 13, 14, 15]
    for i in range(16):
        assert type_name(tensors[names.layer_name(i, "attn_v")].ggml_type) == ("Q6_K" if i in wide else "Q5_K")
        assert type_name(tensors[names.layer_name(i, "attn_q")].ggml_type) == "Q5_K"
    with pytest.raises(ValueError, match="unknown type mix"):
        random_model(cfg, "Q5_K", mix="S")


@pytest.mark.parametrize("tied", [True, False])
def test_bench_model_and_token_read_bytes(tied):
    shape = BenchShape(dict(bench_prefill.TINY.config, tied_embeddings=tied), "Q4_1", "Q8_0", None if tied else "Q8_0")
    cfg, tensors, nbytes = bench_model(shape, seed=3)
    assert set(tensors) == set(names.expected_shapes(cfg))
    embd = tensors[names.TOKEN_EMBD].nbytes
    rest = sum(t.nbytes for n, t in tensors.items() if n != names.TOKEN_EMBD)
    assert nbytes == token_read_bytes(cfg, tensors) == rest + (embd if tied else 0)


def test_realizar_bench_takes_a_pp512_prompt_length():
    """``realizar bench --prompt-tokens 512`` (the pp512 prompt) parses; run_bench times that many."""

    from realizar.cli import build_parser
    from realizar.cli.bench import run_bench

    args = build_parser().parse_args(["bench", "--prompt-tokens", "512", "--gen-tokens", "0"])
    assert args.prompt_tokens == 512 and args.gen_tokens == 0

    class Model:
        context_length = 1024

        def reset(self):
            self.seen = []

        def prefill(self, ids):
            self.seen.append(len(ids))
            return SimpleNamespace(greedy_token=lambda: 7)

    class Tok:
        def encode(self, text, add_special_tokens=True):
            return list(range(50))

    model = Model()
    engine = SimpleNamespace(model=model, tokenizer=Tok(), context_length=1024, name="stub", device="cuda")
    r = run_bench(engine, args.prompt_tokens, args.gen_tokens, repeats=1, warmup=0)
    assert model.seen == [512] and r["prompt_tokens"] == 512
    assert r["prefill_tokens_per_second"] > 0 and r["time_to_first_token_seconds"] > 0


def test_bench_prefill_names_the_prefill_path():

    cfg, tensors, _ = bench_model(bench_prefill.TINY)
    dev = cuda.EmulatedDevice(sm_count=4, racecheck=False)
    model, path = bench_prefill.make_model(cfg, tensors, 16, dev, prefill_chunk=8)
    assert model.prefill_chunk == 8 and path.startswith("batched, prefill_chunk=8")
    model, path = bench_prefill.make_model(cfg, tensors, 64, dev, prefill_chunk=None)
    assert path.startswith(f"batched, prefill_chunk={model.prefill_chunk}")


@pytest.mark.full
def test_bench_serving_every_part_on_the_emulator(tmp_path):
    """tools/bench_serving.py as the GPU check runs it, on the PTX emulator with the toy shape: the batched
    bound, the HTTP load (client processes, tokens from the usage chunks; the engine in the server's process, then
    in one of its own as by default) and the warm start."""
    import subprocess
    import sys

    out = tmp_path / "serving.md"
    for parts, extra in (("batched,http", ["--batches", "2", "--no-engine-process"]),
                         ("warmstart", ["--batches", "1", "--warm-prompt", "20"]), ("http", ["--batches", "2"])):
        subprocess.run([sys.executable, "tools/bench_serving.py", "--device", "emulate", "--tiny", "--prompt", "4",
                        "--gen", "3", "--parts", parts, *extra, "--out", str(out)], check=True, timeout=900,
                       capture_output=True)
        text = out.read_text()
        if parts == "warmstart":
            (row,) = _rows(text, "on")
            assert float(row[1]) > 0 and row[2] == "20" and float(row[3]) > 0 and float(row[5]) > 0
            continue
        if parts == "batched,http":
            (batched,) = _rows(text, "2")
            assert float(batched[1]) > 0
            assert "the engine in the server's process" in text
        else:
            assert "the engine in a process of its own" in text
        (http,) = _rows(text, "2 x (4 in, 3 out)")
        assert float(http[1]) > 0 and (http[2] == "-" or float(http[2]) > 0)  # tok/s (usage chunks), x bound


@pytest.mark.full
def test_bench_host_runs_every_row():
    """tools/bench_host.py (the served path's host side over a backend that only sleeps): one line of six
    figures a concurrency (the last through two server processes), each with its ratio to the bound."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "tools/bench_host.py", "--concurrency", "4", "--prompt", "8", "--gen", "4",
                        "--clients", "1", "--api-servers", "2"], check=True, timeout=300, capture_output=True, text=True)
    (row,) = [line.strip("|").split("|") for line in r.stdout.splitlines() if line.startswith("| 4 |")]
    assert len(row) == 7 and float(row[1]) > 0
    for cell in row[2:]:
        rate, ratio = cell.split()
        assert float(rate) > 0 and 0 < float(ratio.strip("()")) < 1.5


def test_ncu_summary_sums_kernel_families(tmp_path):
    """tools/ncu_summary.py: kernel names to families, the per-family sums and shares, the units ncu prints."""
    from tools import ncu_summary

    assert ncu_summary.family("gemm_ws_q4_k_k4096_tiles_m128_r1_s4_w2_res") == "gemm_ws"
    assert ncu_summary.family("paged_decode_d128_g4_b32_f16") == "paged_decode"
    assert ncu_summary.family("feed_tokens") == "feed_tokens"
    head = '"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"\n'
    rows = ['"0","gemm_ws_q4_k_k4096_tiles_m128_r1_s4_w2","gpu__time_duration.sum","usecond","30.00"',
            '"1","gemm_ws_q6_k_k14336_tiles_m64_r1_s4_w2","gpu__time_duration.sum","usecond","10.00"',
            '"2","paged_decode_d128_g4_b32_f16","gpu__time_duration.sum","nsecond","10,000"']
    csv = tmp_path / "k.csv"
    csv.write_text("==PROF== Connected to process 1\n" + head + "\n".join(rows) + "\n")
    out = tmp_path / "k.md"
    assert ncu_summary.main([str(csv), "--out", str(out)]) == 0
    (tmp_path / "empty.csv").write_text("==PROF== No kernels were profiled.\n")
    assert ncu_summary.main([str(tmp_path / "empty.csv")]) == 2  # (said on stderr, no table)
    cells = _rows(out.read_text(), "gemm_ws")[0]
    assert cells[1:] == ["2", "40.0", "80.0%"]
    assert _rows(out.read_text(), "paged_decode")[0][1:] == ["1", "10.0", "20.0%"]
    assert _rows(out.read_text(), "all")[0][1:] == ["3", "50.0", "100%"]


def test_ncu_stalls_reads_reasons_and_instructions(tmp_path, monkeypatch):
    """tools/ncu_stalls.py: the stall reasons summed over kernels (the not-issued variant folded in, the units row
    skipped), the instructions with the most samples first (the header found below ncu's kernel-name row), and the CSV's
    column names where a column is missing."""
    from tools import ncu_stalls

    raw = ('==PROF== Disconnected from process 1\n"ID","Kernel Name","smsp__pcsamp_warps_issue_stalled_barrier","smsp__pcsamp_warps_issue_stalled_long_scoreboard",'
           '"smsp__pcsamp_warps_issue_stalled_barrier_not_issued","gpu__time_duration.sum"\n'
           '"","","","","","nsecond"\n'
           '"0","gemm_ws","1,000","300","200","5,000"\n"1","gemm_ws","500","0","0","4,000"\n')
    assert ncu_stalls.stall_reasons(raw) == [("barrier", 1700.0), ("long_scoreboard", 300.0)]
    source = ('"Kernel Name","gemm_ws_q4_k_k14336_tiles_m128_r1_s4_w2_tma_hd",""\n'  # (ncu's row before the header)
              '"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)"\n'
              '"0x10","HGMMA.64x128x16.F32","40","30"\n"0x20","SYNCS.PHASECHK.TRANS64","900","880"\n'
              '"0x30","LDS.128 R4, [R2]","120","60"\n')
    cols, rows = ncu_stalls.top_instructions(source, 2)
    assert cols[:3] == ["Address", "Source", "Warp Stall Sampling (All Samples)"]
    assert [r[1] for r in rows] == ["SYNCS.PHASECHK.TRANS64", "LDS.128 R4, [R2]"]
    monkeypatch.setattr(ncu_stalls, "_ncu", lambda *a: raw if "raw" in a else source)
    out = tmp_path / "s.md"
    assert ncu_stalls.main([str(tmp_path / "k.ncu-rep"), "--top", "2", "--out", str(out)]) == 0
    text = out.read_text()
    assert _rows(text, "barrier")[0][1:] == ["1,700", "85.0%"] and "| 0x20 | SYNCS.PHASECHK.TRANS64 | 900 | 880 |" in text
    missing = "\n".join(ncu_stalls.report("", '"Address","Opcode"\n"0x10","HGMMA"\n', 5))
    assert "no smsp__pcsamp" in missing and "the CSV's columns: Address, Opcode" in missing


def _tiny_backend(tmp_path, seed: int, vocab_size: int, max_context: int, num_blocks: int):
    """GpuBatchBackend of two rows over a one-layer Q8_0 llama on the emulated device, graphs off (the tools record and
    replay its launches)."""
    from realizar.gpu.batch import GpuBatchBackend
    from realizar.gpu.model import GpuModel
    from realizar.models.loader import load_model
    from tests.gguf_factory import make_gguf_model

    path, _, _ = make_gguf_model("llama", tmp_path, "Q8_0", seed=seed, num_layers=1, vocab_size=vocab_size,
                                 hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2)
    model = GpuModel.from_loaded(load_model(path), max_len=max_context + 16, device=cuda.EmulatedDevice(sm_count=4),
                                 kv_cache=False)
    return GpuBatchBackend(model, num_blocks=num_blocks, block_size=16, kv_dtype="f32", max_batch=2,
                           max_context=max_context, use_graph=False)


def test_profile_step_times_every_launch_in_sequence(tmp_path, monkeypatch):
    """tools/profile_step.py --events: one recorded step of a tiny batched model replays on the emulator, every launch
    timed in order, and the family table sums them."""
    monkeypatch.syspath_prepend("tools")
    import profile_step
    from ncu_summary import family

    from realizar.sampling import RowSampling

    backend = _tiny_backend(tmp_path, seed=3, vocab_size=320, max_context=32, num_blocks=8)
    ids = [int(backend.prefill([1, 2, 3], 0, [1 + r]).sample([RowSampling()])[0]) for r in range(2)]
    with cuda.recording() as records:
        backend.decode(ids, [3, 3], [[1], [2]]).sample([RowSampling()] * 2)
    times = profile_step.in_sequence_us(records, backend.stream, reps=2)
    assert [n for n, _ in times] == [r.kernel.source.entry for r in records] and len(times) > 5
    assert any(family(n) != n for n, _ in times)  # (PTX entries: names with their shapes)
    assert all(us > 0 for _, us in times)
    table = profile_step.times_table(times)
    assert _rows("\n".join(table), "all")[0][1] == str(len(times))
    with pytest.raises(RuntimeError, match="more than one stream"):
        profile_step.in_sequence_us([dataclasses.replace(records[0], stream=None)], backend.stream)
    backend.close()


def test_pdl_ab_records_a_step_and_replays_it_under_every_rule(tmp_path, monkeypatch):
    """tools/pdl_ab.py on the emulator: the launches of one decode step of two rows after 128-token prefills, replayed
    eagerly and as a graph captured under each rule; the rules pick launches as their names say."""
    monkeypatch.syspath_prepend("tools")
    import pdl_ab

    backend = _tiny_backend(tmp_path, seed=4, vocab_size=1100, max_context=144, num_blocks=24)
    records = pdl_ab.record_step(backend, 2)
    assert len(records) > 5 and all(r.stream is backend.stream for r in records)
    times = pdl_ab.ab(records, backend.stream, calls=1, reps=1)
    assert list(times) == ["eager", *pdl_ab.RULES] and all(t > 0 for t in times.values())
    ws, other = SimpleNamespace(kernel=SimpleNamespace(name="gemm_ws")), SimpleNamespace(kernel=SimpleNamespace(name="x"))
    into, out = pdl_ab.RULES["not into gemm_ws"], pdl_ab.RULES["not out of gemm_ws"]
    assert (into(ws, other), into(other, ws), out(other, ws), out(ws, other), out(ws, None)) == (
        False, True, False, True, True)
    backend.close()


@pytest.fixture
def emulated_sm90(monkeypatch):
    """The emulated sm_90 device as the current device, the warpgroup GEMMs allowed on it (the Linear never hands it
    gemm_wg / gemm_ws; the tools call them directly), tools/ on the import path."""
    import realizar.gpu.gemm_wg as host

    monkeypatch.syspath_prepend("tools")
    dev = cuda.EmulatedDevice(target="sm_90")
    monkeypatch.setattr(cuda, "current_device", lambda: dev)
    monkeypatch.setattr(host, "wg_applies", lambda *a: True)
    return dev


def test_bench_gemm_wg_options_on_the_emulated_device(tmp_path, monkeypatch, emulated_sm90):
    """tools/bench_gemm_wg.py's control flow with every gemm_ws option (--as-step: the model's layouts, the residual
    in place, weight copies cycled; --xtma; --f16dec; --sweep) on the emulated device with toy shapes, each timed call
    run once instead of timed (the emulated device has no clock worth reading): what the next device call runs
    does not fail in Python."""
    import sys

    import tools.bench_gemm_wg as bench

    calls = []

    def once(fns, stream, **kw):
        for fn in fns[:2]:
            fn()
        calls.append(len(fns))
        return 1.0, "eager"

    monkeypatch.setattr(bench, "SHAPES", [("8b", "o", 64, 512, False), ("8b", "gate/up", 128, 256, True)])
    monkeypatch.setattr(bench, "graph_median_us", once)
    monkeypatch.setattr(bench, "_us", lambda fn, stream: (fn(), 1.0)[1])
    monkeypatch.setattr(bench, "_torch_us", lambda *a: None)
    swept = bench.WsConfig(64, 2, 3, 2, True, True, 2)  # (K split over two CTAs: the o shape's 2 chunks)
    deep = bench._sweep_ws("Q4_K", 4096, "rows", 128, 227 * 1024, swept, (2, 3), (8, 6), (1, 2, 4))
    assert deep and {c.stages for c in deep} == {8, 6} and {c.wstages for c in deep} == {2, 3}
    assert {c.psplit for c in deep} == {1, 2, 4} and all(c.mt == 64 for c in deep if c.psplit == 4)  # (shared memory)
    asked = []
    monkeypatch.setattr(bench, "_sweep_ws", lambda *a: (asked.append(a[-5:]), [swept])[1])
    out = tmp_path / "ws.md"
    monkeypatch.setattr(sys, "argv", ["bench_gemm_wg.py", "--kernel", "ws", "--models", "8b", "--ms", "70", "--as-step",
                                      "--xtma", "--f16dec", "--sweep", "--stages", "6,4", "--wstages", "3",
                                      "--psplit", "1,2", "--ablate", "mma,decode+wload", "--out", str(out)])
    assert bench.main() == 0
    assert asked and all(a == ((3,), (6, 4), (1, 2), (1,), (1,)) for a in asked), asked
    rows = [line for line in out.read_text().splitlines() if line.startswith("| Q4_K") and " x " in line]
    assert len(rows) == 2 and all(" tma hd " in r for r in rows), rows
    # each row's policy launch, the swept K split on the o shape (gate/up's one chunk refuses it), two ablations a row
    assert len(calls) == 3 + 2 * 2 and all(n == 20 for n in calls), calls
    cut = _rows(out.read_text(), "8b o")
    assert cut and cut[-1][-2:] == ["1.0 (1.00)", "1.0 (1.00)"], cut
    ranked = [r for r in _rows(out.read_text(), "Q4_K") if len(r) == 7]  # (the sweep's fastest: policy and swept)
    assert [r[1:4] for r in ranked] == [["8b o", "70", "1"], ["8b o", "70", "2"], ["8b gate/up", "70", "1"]], ranked


@pytest.mark.parametrize("split", [False, True])
def test_ncu_gemm_ws_launches_on_the_emulated_device(monkeypatch, capsys, emulated_sm90, split):
    """tools/ncu_gemm_ws.py (the launch the gpu_check stage ncu_gemm_ws profiles) with a toy shape, X by TMA; a
    policy launch that splits K gets its partial sums' room (the stage's down at 128 tokens)."""
    import dataclasses
    import sys

    import tools.ncu_gemm_ws as tool

    shape, k = ("down", 512) if split else ("gate/up", 256)
    monkeypatch.setattr(tool, "SHAPES", [("8b", shape, 128, k, not split)])
    if split:
        base = tool.ws_config
        monkeypatch.setattr(tool, "ws_config", lambda *a, **kw: dataclasses.replace(base(*a, **kw), kparts=2))
    monkeypatch.setattr(sys, "argv", ["ncu_gemm_ws.py", "--shape", shape, "--m", "40", "--xtma"])
    assert tool.main() == 0
    out = capsys.readouterr().out
    assert "xtma=True" in out and f"kparts={2 if split else 1}" in out


def test_sanitize_gemm_wg_cases_on_the_emulated_device(monkeypatch, emulated_sm90):
    """tools/sanitize_gemm_wg.py (what compute-sanitizer runs): the --small cases on the emulated sm_90 device,
    shrunk to toy token counts, each against its oracle; a case whose output is off fails."""
    import numpy as np

    import tools.sanitize_gemm_wg as tool

    from ptx_gen.kernels.gemm.gemm_ws import check_shape

    for k, wt, lay, out, kd, m, cfg in tool.CASES:  # (every case a launch shape the kernel takes)
        if k == "gemm_ws":
            check_shape(wt, kd, lay, cfg.mt, cfg.rgroups, cfg.stages, cfg.wstages, cfg.kparts, cfg.psplit, cfg.pfence,
                        cfg.xcast, cfg.xtma)
    small = [(k, wt, lay, min(out, 128), min(kd, 512), min(m, 67), cfg) for k, wt, lay, out, kd, m, cfg in tool.CASES_SMALL]
    assert tool.cases(np.random.default_rng(0), small) == len(tool.CASES_SMALL)  # (every second X padded with NaN)
    wrong = tool.dequant
    monkeypatch.setattr(tool, "dequant", lambda *a: wrong(*a) * 1.01)
    with pytest.raises(AssertionError, match="max relative error"):
        tool.case(tool.LayerOps(), np.random.default_rng(1), *small[2])


def test_bench_attention_batched_on_the_emulated_device(tmp_path, monkeypatch, capsys):
    """tools/bench_attention_batched.py with its sweep of decode tilings and rings at a toy size on the emulated device
    (each timed call run once): the row's error against the float64 oracle is small and names the best tiling, and
    no swept variant is called wrong (each reads the data the oracle was computed from)."""
    import sys

    sys.path.insert(0, "tools")
    import tools.bench_attention_batched as bench

    dev = cuda.EmulatedDevice(sm_count=4, racecheck=False)
    monkeypatch.setattr(cuda, "current_device", lambda: dev)
    monkeypatch.setattr(bench, "graph_median_us", lambda fns, stream: (fns[0](), (1.0, "eager"))[1])
    out = tmp_path / "att.md"
    assert bench.main(["--batches", "2", "--lengths", "40", "--sweep", "--rings", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "ring 2 u2 t16:" in printed and "WRONG" not in printed, printed
    row = [line for line in out.read_text().splitlines() if line.startswith("| 2 | 40 |")]
    assert len(row) == 1 and float(row[0].split("|")[8]) < 2e-3 and row[0].rstrip().endswith("(default) |"), row


@pytest.mark.full
def test_policy_ab_interleaves_variants_and_restores_the_policy(tmp_path, capsys):
    """tools/policy_ab.py on the emulator with the toy shape: two variants, two rounds interleaved, a row per variant
    with each round's rate and the ratio to the first; every setting undone afterwards; a malformed variant or a name
    no realizar module defines is refused by name."""
    import realizar.gpu.gemm_wg as host
    import realizar.gpu.policy.gemm as policy
    import tools.policy_ab as tool

    assert tool.parse_variant("none") == {} and tool.parse_variant("A=1; B=(128,)") == {"A": 1, "B": (128,)}
    with pytest.raises(SystemExit, match="NAME=VALUE"):
        tool.parse_variant("WS_TILE_FILL")
    with pytest.raises(SystemExit, match="no loaded realizar module defines NO_SUCH_SETTING"):
        tool.apply({"NO_SUCH_SETTING": 1})
    before = (host.WS_TILE_FILL, policy.WS_TILE_FILL, host.WS_SPLIT_FIRST)
    out = tmp_path / "ab.md"
    assert tool.main(["--tiny", "--device", "emulate", "--batches", "2", "--prompt", "4", "--gen", "3", "--rounds", "2",
                      "--variant", "none", "--variant", "WS_TILE_FILL=1.0; WS_SPLIT_FIRST=()", "--out", str(out)]) == 0
    assert (host.WS_TILE_FILL, policy.WS_TILE_FILL, host.WS_SPLIT_FIRST) == before
    rows = [r for r in _rows(out.read_text(), "2")]
    assert [r[1] for r in rows] == ["none", "WS_TILE_FILL=1.0; WS_SPLIT_FIRST=()"]
    assert all(len(r[2].split(",")) == 2 and float(r[3]) > 0 for r in rows) and rows[0][5] == "1.000"
    saved = tool.apply({"WS_TILE_FILL": 0.25})
    assert host.WS_TILE_FILL == policy.WS_TILE_FILL == 0.25
    tool.undo(saved)
    assert host.WS_TILE_FILL == policy.WS_TILE_FILL == before[0]
