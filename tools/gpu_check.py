"""One device call: every GPU test, the sanitizers and the benchmarks, logs written to $OUT.

What comes back from $OUT is limited to a few files: gpu_check.log (every stage's output), the JUnit
XML of the tests, and one Markdown table per benchmark (bench_graphs, bench_attention, bench_gemv,
bench_decode, bench_gemm, bench_prefill, bench_serving, bench_serving_one_process (its HTTP part with the
engine in the server's process), bench_serving_api_servers (four server processes), bench_host (the served
path's host side over a sleeping backend), bench_warm_start (four files), profile_step (one served stream
against GpuModel), bench_gemm_decode (the f16 GEMM at decode batch sizes), bench_moe (Qwen3-30B-A3B's shape
beside llama.cpp's binaries in $LLAMA_CPP_BIN, on the GGUF file $MOE_GGUF, written first where missing); not
default stages: real_model
(smollm2_gpu.md), bench_gemm_ws / bench_gemm_wg (the quantized batch GEMMs at 8B shapes), bench_gemm_ws_step /
bench_gemm_ws_xcopy / bench_gemm_ws_f32dec (gemm_ws as the step runs it, the policy's; its X by 16-byte copies
instead of a tensor map; Q4_K decoded in f32 instead of f16x2), bench_gemm_ws_sweep (every launch shape of the 8B
layers at 128, 256 and 512 tokens, K split over two CTAs among them), bench_gemm_ws_rings (o, down and gate/up at 128
and 256 tokens with A/B rings of 4-8 stages, K split over up to four CTAs), bench_attention_batched / _sweep (the batched decode
attention alone beside torch; every decode tiling at 256 rows of 192 positions), bench_attention_ring / ab_ring /
ab_ring_small (the decode kernel's ring of bulk copies at several depths, alone; A/B'd against the register pass on the
8B step, and at head_dim 64, where it is off by default, on the 1B and SmolLM2 steps), ab_ws_stages /
ab_ws_stages_small (gemm_ws's 6-stage rings on one-warpgroup 128-token tiles against WS_STAGES, A/B'd on the steps),
ab_streamk (gemm_ws Stream-K on and off at 8B pp512 and 1B pp2048, alternating),
ncu_gemm_ws (its gate/up and o launches at
256 tokens and down at 128 and 256 under ncu: ncu_gemm_ws_*.txt, and their stall reasons and most-sampled SASS instructions:
ncu_gemm_ws_*_stalls.md), profile_batch (the 8B
batched decode step of 256 rows, its kernels under ncu summed by family: profile_batch.md), and on 2+ GPUs bench_tensor_parallel and bench_nccl). The whole of tests/gpu takes longer
than the tests stage's 420 s: give --tests a part of it per call.

    python tools/gpu_check.py --out "$OUT"                      # everything
    python tools/gpu_check.py --out "$OUT" --stages tests,bench_graphs

Each stage runs as its own subprocess with its own time limit, so one failure or hang does not cost
the others. A summary table is printed last (the device tool returns the tail of the output).
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


SANITIZED = ["tools/sanitize_cases.py", "tools/sanitize_attention.py", "tools/sanitize_layers.py",
             "tools/sanitize_moe.py", "tools/sanitize_gemm_wg.py"]


def stages(out: Path, tests: list[str], pytest_args: list[str]) -> dict[str, tuple[list[list[str]], int]]:
    """name -> (commands run in turn, timeout seconds for all of them)."""
    san = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    memcheck = [[san, "--tool", "memcheck", "--error-exitcode", "3", PY, script] for script in SANITIZED]
    racecheck = [[san, "--tool", "racecheck", "--error-exitcode", "3", PY, script, "--small"] for script in SANITIZED]
    single = {
        "env": ([PY, "-c", (
            "import platform, numpy, cuda.bindings; from realizar import cuda as c; d = c.current_device(); "
            "print('python', platform.python_version(), 'numpy', numpy.__version__, 'cuda-bindings', "
            "cuda.bindings.__version__); print(d, 'target', d.target, 'mem', d.total_memory >> 20, 'MiB')"
        )], 60),
        "tests": ([PY, "-m", "pytest", "-n", "0", "-m", "gpu", *tests, "-q", "-rs", "-p", "no:cacheprovider",
                   f"--junitxml={out}/gpu_tests.xml", *pytest_args], 420),
        "bench_graphs": ([PY, "tools/bench_graphs.py", "--out", str(out / "bench_graphs.md")], 120),
        "bench_attention": ([PY, "tools/bench_attention.py", "--out", str(out / "bench_attention.md")], 300),
        "bench_gemv": ([PY, "tools/bench_gemv.py", "--out", str(out / "bench_gemv.md")], 300),
        "bench_decode": ([PY, "tools/bench_decode.py", "--out", str(out / "bench_decode.md")], 480),
        "bench_gemm": ([PY, "tools/bench_gemm.py", "--out", str(out / "bench_gemm.md")], 240),
        "bench_prefill": ([PY, "tools/bench_prefill.py", "--out", str(out / "bench_prefill.md")], 420),
        "bench_serving": ([PY, "tools/bench_serving.py", "--shapes", "smollm2-135m,llama-3-8b", "--batches", "1,64,128,256",
                           "--out", str(out / "bench_serving.md")], 540),
        "bench_serving_one_process": ([PY, "tools/bench_serving.py", "--shapes", "smollm2-135m,llama-3-8b", "--batches",
                                       "64,128,256", "--parts", "batched,http", "--no-engine-process",
                                       "--out", str(out / "bench_serving_one_process.md")], 480),
        "bench_serving_api_servers": ([PY, "tools/bench_serving.py", "--shapes", "smollm2-135m,llama-3-8b", "--batches",
                                       "64,128,256", "--parts", "batched,http", "--api-servers", "4",
                                       "--out", str(out / "bench_serving_api_servers.md")], 480),
        "bench_host": ([PY, "tools/bench_host.py", "--concurrency", "64,128,256", "--out",
                        str(out / "bench_host.md")], 240),
        "profile_step": ([PY, "tools/profile_step.py", "--out", str(out / "profile_step.md")], 240),
        "bench_gemm_decode": ([PY, "tools/bench_gemm.py", "--tokens", "32,64", "--sweep", "--out",
                               str(out / "bench_gemm_decode.md")], 240),
        # the quantized batch GEMMs beside cuBLAS (not default stages)
        "bench_gemm_ws": ([PY, "tools/bench_gemm_wg.py", "--kernel", "ws", "--types", "Q4_K", "--models", "8b", "--ms",
                           "128,256,512", "--out", str(out / "bench_gemm_ws.md")], 240),
        "bench_gemm_wg": ([PY, "tools/bench_gemm_wg.py", "--kernel", "wg", "--types", "Q4_K", "--models", "8b", "--ms",
                           "128,256,512", "--out", str(out / "bench_gemm_wg.md")], 240),
        # gemm_ws as the step runs it (the model's layouts and epilogues, weights from DRAM), then without the policy's
        # X by a tensor map, and without its f16x2 decoding
        "bench_gemm_ws_step": ([PY, "tools/bench_gemm_wg.py", "--kernel", "ws", "--types", "Q4_K", "--models", "8b",
                                "--ms", "128,256,512", "--as-step", "--out", str(out / "bench_gemm_ws_step.md")], 240),
        "bench_gemm_ws_xcopy": ([PY, "tools/bench_gemm_wg.py", "--kernel", "ws", "--types", "Q4_K", "--models", "8b",
                                 "--ms", "128,256,512", "--as-step", "--no-xtma",
                                 "--out", str(out / "bench_gemm_ws_xcopy.md")], 240),
        "bench_gemm_ws_f32dec": ([PY, "tools/bench_gemm_wg.py", "--kernel", "ws", "--types", "Q4_K", "--models", "8b",
                                  "--ms", "128,256,512", "--as-step", "--no-f16dec",
                                  "--out", str(out / "bench_gemm_ws_f32dec.md")], 240),
        # every launch shape of the 8B layers as the step runs them (K split over two CTAs among them)
        "bench_gemm_ws_sweep": ([PY, "tools/bench_gemm_wg.py", "--kernel", "ws", "--types", "Q4_K", "--models", "8b",
                                 "--ms", "128,256,512", "--as-step", "--sweep",
                                 "--out", str(out / "bench_gemm_ws_sweep.md")], 420),
        # the A/B rings deeper than a chunk (5-8 stages) at o, down and gate/up of the 128- and 256-row steps
        "bench_gemm_ws_rings": ([PY, "tools/bench_gemm_wg.py", "--kernel", "ws", "--types", "Q4_K", "--models", "8b",
                                 "--ms", "128,256", "--as-step", "--sweep", "--shapes", "o,down,gate/up", "--stages",
                                 "8,7,6,5,4", "--out", str(out / "bench_gemm_ws_rings.md")], 420),
        # the batched decode step's attention alone, beside torch's SDPA; every decode tiling at the 256-row step
        "bench_attention_batched": ([PY, "tools/bench_attention_batched.py", "--batches", "64,128,256", "--lengths",
                                     "128,256,512", "--out", str(out / "bench_attention_batched.md")], 300),
        "bench_attention_batched_sweep": ([PY, "tools/bench_attention_batched.py", "--batches", "256", "--lengths",
                                           "192", "--sweep", "--out", str(out / "bench_attention_batched_sweep.md")],
                                          240),
        # the decode kernel's ring of bulk copies at several depths beside the register pass (each checked against the
        # oracle), then the 8B batched decode step at the default ring A/B'd against the register pass, 3 stages and
        # unroll 4
        "bench_attention_ring": ([PY, "tools/bench_attention_batched.py", "--batches", "128,256", "--lengths",
                                  "128,192,256", "--rings", "2,3,4", "--out", str(out / "bench_attention_ring.md")],
                                 300),
        "ab_ring": ([PY, "tools/policy_ab.py", "--shape", "llama-3-8b", "--batches", "128,256", "--variant", "none",
                     *[a for v in ("DECODE_RING_STAGES=0", "DECODE_RING_STAGES=3", "DECODE_RING_UNROLL=4")
                       for a in ("--variant", v)],
                     "--out", str(out / "ab_ring.md")], 540),
        # 6-stage A/B rings on one-warpgroup 128-token tiles with K whole (WS_STAGES_BY_TILE) against WS_STAGES there,
        # A/B'd on the 8B and 1B steps
        "ab_ws_stages": ([PY, "tools/policy_ab.py", "--shape", "llama-3-8b", "--batches", "96,128", "--variant", "none",
                          "--variant", "WS_STAGES_BY_TILE=()", "--out", str(out / "ab_ws_stages.md")], 300),
        "ab_ws_stages_small": ([PY, "tools/policy_ab.py", "--shape", "llama-3.2-1b", "--batches", "96,128,192,256",
                                "--variant", "none", "--variant", "WS_STAGES_BY_TILE=()",
                                "--out", str(out / "ab_ws_stages_1b.md")], 300),
        # several GPUs (not default stages: they need 2 or more)
        "bench_tensor_parallel": ([PY, "tools/bench_tensor_parallel.py", "--out", str(out / "bench_tensor_parallel.md")],
                                  540),
        "bench_nccl": ([PY, "tools/bench_nccl.py", "--out", str(out / "bench_nccl.md")], 120),
        "bench_data_parallel": ([PY, "tools/bench_data_parallel.py", "--shape", "llama-3-8b", "--replicas", "1,2",
                                 "--concurrency", "64,256", "--out", str(out / "bench_data_parallel.md")], 540),
        "real_model": ([PY, "tools/gpu_real_model.py", "--gguf", os.environ.get("SMOLLM2_GGUF", "/tmp/smollm2.gguf"),
                        "--out", str(out / "smollm2_gpu.md")], 300),
    }
    # the batched decode step's kernels at 256 rows (8B) under Nsight Compute, summed by family (not a default stage)
    ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    csv = str(out / "profile_batch_ncu.csv")
    profile_batch = [[ncu, "--clock-control", "none", "--profile-from-start", "off", "--metrics", "gpu__time_duration.sum",
                      "--csv", "--log-file", csv, PY, "tools/profile_step.py", "--shapes", "llama-3-8b", "--batch", "256",
                      "--ncu"],
                     [PY, "tools/ncu_summary.py", csv, "--out", str(out / "profile_batch.md")],
                     [PY, "tools/profile_step.py", "--shapes", "llama-3-8b", "--batch", "256"]]
    # the first prompt after start, each in a fresh process (nothing loaded before): with and without warm_up
    warm = [[PY, "tools/bench_serving.py", "--shapes", shape, "--parts", "warmstart", "--batches", "256", *flag,
             "--out", str(out / f"bench_warm_start_{shape}{'_off' if flag else ''}.md")]
            for shape in ("smollm2-135m", "llama-3-8b") for flag in ([], ["--no-warm-up"])]
    # Qwen3-30B-A3B's shape in Q4_K (a file written once, about 17 GB) beside llama.cpp's binaries where given
    moe_gguf, llama = os.environ.get("MOE_GGUF", "/tmp/qwen3-30b-a3b.gguf"), os.environ.get("LLAMA_CPP_BIN")
    moe = [[PY, "tools/bench_moe.py", "--gguf", moe_gguf, *(["--llama-cpp", llama] if llama else []),
            "--out", str(out / "bench_moe.md")]]
    if not Path(moe_gguf).exists():
        moe.insert(0, [PY, "tools/write_gguf.py", "qwen3-30b-a3b", moe_gguf])
    # gemm_ws under ncu with source-level stall sampling, the policy's launches: the 8B gate/up at 256 tokens (near
    # gate/up's best rate), o at 256 and down at 128 and 256 (half of gate/up's rate per weight)
    sections = [a for s in ("SpeedOfLight", "WarpStateStats", "ComputeWorkloadAnalysis", "MemoryWorkloadAnalysis",
                            "SchedulerStats", "SourceCounters") for a in ("--section", s)]
    ncu_ws = []
    for shape, m in (("gate/up", 256), ("o", 256), ("down", 128), ("down", 256)):  # (one report: its text, stalls)
        tag = f"ncu_gemm_ws_{shape.replace('/', '')}_{m}"
        rep = Path(tempfile.gettempdir()) / f"{tag}.ncu-rep"
        ncu_ws += [[ncu, "--kernel-name", "regex:gemm_ws", "--launch-skip", "2", "--launch-count", "1", *sections,
                    "-f", "-o", str(rep.with_suffix("")), PY, "tools/ncu_gemm_ws.py", "--shape", shape, "--m", str(m)],
                   [ncu, "--import", str(rep), "--page", "details", "--log-file", str(out / f"{tag}.txt")],
                   [PY, "tools/ncu_stalls.py", str(rep), "--out", str(out / f"{tag}_stalls.md")]]
    # gemm_ws Stream-K (on from WS_STREAMK_MIN_ROWS rows) against the same launches without it: 8B pp512 and 1B pp2048
    # (gate/up at 512 tokens, 1B qkv at 2048), alternating twice
    ab_streamk = [[PY, "tools/bench_prefill.py", "--shapes", shape, "--lengths", length, "--torch", "none",
                   *(["--policy", "WS_STREAMK=0.0"] if off else []),
                   "--out", str(out / f"ab_streamk_{shape}_{'off' if off else 'on'}_{r}.md")]
                  for shape, length in (("llama-3-8b", "512"), ("llama-3.2-1b", "2048")) for r in (1, 2)
                  for off in (False, True)]
    # the decode kernel's ring (off by default at their head_dim 64, groups 4 and 3) A/B'd on the 1B and SmolLM2 steps
    ab_ring_small = [[PY, "tools/policy_ab.py", "--shape", shape, "--batches", "64,128,256", "--variant", "none",
                      "--variant", "DECODE_RING_MIN_HEAD_DIM=64",
                      "--variant", "DECODE_RING_MIN_HEAD_DIM=64; DECODE_RING_STAGES=3",
                      "--out", str(out / f"ab_ring_{shape}.md")] for shape in ("llama-3.2-1b", "smollm2-135m")]
    return {**{name: ([cmd], limit) for name, (cmd, limit) in single.items()}, "bench_warm_start": (warm, 480),
            "ab_ring_small": (ab_ring_small, 480), "ab_streamk": (ab_streamk, 420),
            "ncu_gemm_ws": (ncu_ws, 420),
            "bench_moe": (moe, 600), "profile_batch": (profile_batch, 480),
            "sanitize": (memcheck, 300), "racecheck": (racecheck, 300)}


def run_stage(cmds: list[list[str]], limit: float, env: dict, log) -> str:
    """Run ``cmds`` in turn (stopping at the first failure) within ``limit`` seconds in all; their
    output goes to ``log`` and stdout. Returns the status: ok, exit N or timeout."""
    deadline = time.time() + limit
    for cmd in cmds:
        header = f"\n===== {' '.join(cmd)}\n"
        print(header, flush=True)
        log.write(header)
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=max(1.0, deadline - time.time()))
            text, status = proc.stdout + proc.stderr, ("ok" if proc.returncode == 0 else f"exit {proc.returncode}")
        except subprocess.TimeoutExpired as exc:
            text = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            status = f"timeout {limit:.0f}s"
        log.write(text)
        log.flush()
        print(text[-3000:], flush=True)
        if status != "ok":
            return status
    return "ok"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_out")))
    ap.add_argument("--stages", default="env,tests,sanitize,racecheck,bench_graphs,bench_attention,bench_gemv,bench_decode,"
                                        "bench_gemm,bench_prefill,bench_serving,bench_serving_one_process,bench_serving_api_servers,bench_host,bench_warm_start,profile_step,"
                                        "bench_gemm_decode,bench_moe")
    ap.add_argument("--tests", default="tests/gpu", help="test paths, space separated")
    ap.add_argument("--pytest-args", default="", help="extra pytest arguments, space separated")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    # the package from this checkout, whether or not it is installed
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}",
           "HYPOTHESIS_PROFILE": os.environ.get("HYPOTHESIS_PROFILE", "ci")}  # the example counts as written
    all_stages = stages(a.out, a.tests.split(), a.pytest_args.split())
    summary = []
    log = open(a.out / "gpu_check.log", "w")
    log.write(f"# gpu_check {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}\n")
    for name in a.stages.split(","):
        if name not in all_stages:
            print(f"unknown stage {name}; known: {list(all_stages)}")
            return 2
        cmds, limit = all_stages[name]
        if not Path(cmds[0][0]).exists() and shutil.which(cmds[0][0]) is None:
            summary.append((name, "missing tool", 0.0))
            continue
        scripts = [c for cmd in cmds for c in cmd if c.endswith(".py") and c.startswith("tools/")]
        if any(not (ROOT / c).exists() for c in scripts):
            summary.append((name, "no script", 0.0))
            continue
        t0 = time.time()
        log.write(f"\n##### stage {name}\n")
        status = run_stage(cmds, limit, env, log)
        elapsed = time.time() - t0
        summary.append((name, status, elapsed))
    table = "\n| stage | status | seconds |\n|---|---|---:|\n" + "\n".join(
        f"| {name} | {status} | {elapsed:.0f} |" for name, status, elapsed in summary)
    print(table)
    log.write(table + "\n")
    log.close()
    return 0 if all(s == "ok" for _, s, _ in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
