"""Attention kernels on the GPU: µs per call, KV bandwidth, % of the measured copy bandwidth, vs torch.

    python tools/bench_attention.py --out docs/results/bench_attention_h200.md
    python tools/bench_attention.py --quick              # fewer repetitions
    REALIZAR_DEVICE=emulate python tools/bench_attention.py --smoke   # control flow only, tiny shapes

Decode rows, for (heads, kv_heads, head_dim) in {(14,2,64), (28,4,128), (32,8,128)} x L in {512, 4096,
32768} on the same random f32 data:

* flash decoding (:class:`~realizar.gpu.executor.CudaExecutor` over the paged f32 cache: the paged
  decode kernel, one launch with the in-kernel combine, seq_len read on the device) timed as a
  captured CUDA graph of many back-to-back calls (GPU time per call, launch gaps included) and as
  eager launches;
* the one-pass form (the same kernel with one chunk per KV head; graph);
* KV append of one token through the block table (graph);
* torch ``scaled_dot_product_attention(q, k, v, enable_gqa=True)`` with batch 1 and one query, f32
  and f16, eager and (when torch can capture it) as a torch CUDA graph.

Bandwidth counts the K and V bytes a call must read (2 * kv_heads * L * head_dim * 4). The copy
bandwidth is measured in the same run with cuMemcpyDtoD of a 1 GiB buffer (bytes read + written).
Times are medians of repeated CUDA-event measurements after warm-up. A sweep of the paged cache's
flash-decoding knobs (block size, chunk count, unroll, lanes per K/V row, min chunk) at L in {512,
1024, 8192, 32768} and a prefill table (causal flash attention from the paged cache, S in {512, 2048})
follow.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
from pathlib import Path

import numpy as np

from realizar import cuda
from realizar.cuda.driver import call
from realizar.gpu.executor import CudaExecutor
from realizar.cuda.bench import copy_bandwidth, median_us
from realizar.config import ServingConfig
from realizar.errors import ShapeError
from realizar.gpu.paged_kv import MMA_HEAD_DIMS
from ptx_gen.kernels.kv.paged_kv import BLOCK_SIZES

SHAPES = [(14, 2, 64), (28, 4, 128), (32, 8, 128)]
LENGTHS = [512, 4096, 32768]
PREFILL = [512, 2048]


def _graph_of(fn, stream, calls: int, pdl: bool = False):
    """A captured graph of ``calls`` calls of ``fn(stream)`` (with programmatic dependent launch between
    them when ``pdl``, as the GPU model captures its decode step), or None when capture is unavailable."""
    capture = getattr(cuda, "capture", None)
    if capture is None:
        return None
    fn(stream)  # loads the kernels first: no module load inside the capture
    stream.synchronize()
    with cuda.programmatic_dependent_launch(pdl), capture(stream) as cap:
        for _ in range(calls):
            fn(stream)
    return cap.graph.instantiate()


class TorchSdpa:
    """torch's scaled_dot_product_attention on the same data (None fields when torch is missing)."""

    def __init__(self, enabled: bool = True):
        self.torch = None
        if not enabled:
            return
        try:
            import torch
            import torch.nn.functional as F
        except ImportError:  # pragma: no cover - torch is a test dependency
            self.torch = None
            return
        self.torch, self.F = torch, F

    def median_us(self, run, calls: int, reps: int) -> float:
        """Median over ``reps`` of (CUDA-event time of ``run()`` / ``calls``) in µs, after a warm-up run."""
        torch = self.torch
        run()
        torch.cuda.synchronize()
        samples = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run()
            b.record()
            b.synchronize()
            samples.append(a.elapsed_time(b) * 1e3 / calls)
        return statistics.median(samples)

    def time(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, dtype: str, reps: int, graph: bool) -> float | None:
        if self.torch is None:
            return None
        torch, F = self.torch, self.F
        dt = {"f32": torch.float32, "f16": torch.float16}[dtype]
        tq = torch.from_numpy(np.ascontiguousarray(q)).to("cuda", dt)[None, :, None, :]  # [1, H, 1, D]
        tk = torch.from_numpy(np.ascontiguousarray(k)).to("cuda", dt)[None]  # [1, KVH, L, D]
        tv = torch.from_numpy(np.ascontiguousarray(v)).to("cuda", dt)[None]
        calls = 20

        def once():
            return F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)

        try:
            once()
            torch.cuda.synchronize()
            if graph:
                g = torch.cuda.CUDAGraph()
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    once()  # warm-up on the capture stream
                    torch.cuda.synchronize()
                    with torch.cuda.graph(g, stream=s):
                        for _ in range(calls):
                            once()
                torch.cuda.synchronize()

                def run():
                    g.replay()
            else:
                def run():
                    for _ in range(calls):
                        once()
            return self.median_us(run, calls, reps)
        except Exception as exc:  # graph capture of some sdpa paths is unsupported
            print(f"  torch {dtype} {'graph' if graph else 'eager'}: {type(exc).__name__}: {str(exc)[:120]}")
            return None
        finally:
            torch.cuda.empty_cache()


def _fill(ex: CudaExecutor, k: np.ndarray, v: np.ndarray) -> None:
    """Store ``k``, ``v`` ``[KVH, L, D]`` f32 at positions ``0 .. L-1`` of layer 0 (the executor's block
    table is ``1 .. n``: position p in pool block ``1 + p // block_size``) and record the length."""
    kvh, n, d = k.shape
    bs, nb = ex.block_size, -(-n // ex.block_size)
    pools = []
    for x in (k, v):
        pool = np.zeros(ex.cache.pool_shape, np.float32)
        seq = np.zeros((kvh, nb * bs, d), np.float32)
        seq[:, :n] = x
        pool[1:nb + 1] = seq.reshape(kvh, nb, bs, d).transpose(1, 0, 2, 3)
        pools.append(pool)
    ex.cache.pools_from_numpy(0, pools[0], pools[1])
    ex.set_length(0, n)


def _fmt(x: float | None, spec: str = ".1f", suffix: str = "") -> str:
    return "—" if x is None else format(x, spec) + suffix


def bench_decode(dev, stream, copy_bw: float, reps: int, torch_sdpa: TorchSdpa, lengths, shapes,
                 calls: int | None = None) -> list[str]:
    rows = []
    header = ("| heads/kv/dim | L | KV MiB | flash decoding µs (graph) | flash decoding µs (graph, PDL) | KV GB/s | "
              "% of copy | flash decoding µs (eager) | incremental µs (graph) | append µs (graph) | torch f32 µs | "
              "torch f16 µs | vs torch f32 |")
    rows += [header, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    rng = np.random.default_rng(0)
    max_len = max(lengths)
    for h, kvh, d in shapes:
        ex = CudaExecutor(1, h, kvh, d, max_len, dev)
        k = rng.standard_normal((kvh, max_len, d), dtype=np.float32)
        v = rng.standard_normal((kvh, max_len, d), dtype=np.float32)
        _fill(ex, k, v)
        q = rng.standard_normal((h, d), dtype=np.float32)
        qb, ob = cuda.GpuBuffer.from_numpy(q), cuda.GpuBuffer(h * d)
        kn, vn = cuda.GpuBuffer.from_numpy(k[:, 0]), cuda.GpuBuffer.from_numpy(v[:, 0])
        step = cuda.GpuBuffer.from_numpy(np.array([0, 0], np.uint32))
        for length in lengths:
            step.copy_from_host(np.array([length - 1, length], np.uint32))  # append rewrites row L-1 in place
            kv_bytes = 2 * kvh * length * d * 4
            n_calls = calls or (50 if length <= 4096 else 20)

            def fd(s):
                ex.flash_decoding(0, qb, ob, seq_len=(step, 1), stream=s)

            def inc(s):
                ex.incremental_attention_gpu(0, qb, ob, seq_len=(step, 1), stream=s)

            def app(s):
                ex.append_kv(0, kn, vn, position=(step, 0), stream=s)

            g_fd, g_inc, g_app = (_graph_of(f, stream, n_calls) for f in (fd, inc, app))
            g_pdl = _graph_of(fd, stream, n_calls, pdl=True)
            t_fd = median_us(lambda: g_fd.launch(stream), stream, n_calls, reps) if g_fd else None
            t_pdl = median_us(lambda: g_pdl.launch(stream), stream, n_calls, reps) if g_pdl else None

            def eager():
                for _ in range(n_calls):
                    fd(stream)

            t_eager = median_us(eager, stream, n_calls, reps)
            t_inc = median_us(lambda: g_inc.launch(stream), stream, n_calls, reps) if g_inc else None
            t_app = median_us(lambda: g_app.launch(stream), stream, n_calls, reps) if g_app else None
            best = min(t for t in (t_fd, t_pdl, t_eager) if t is not None)
            gbs = kv_bytes / best / 1e3
            pct = 100 * kv_bytes / best / copy_bw
            kk, vv = k[:, :length], v[:, :length]
            t32 = torch_sdpa.time(q, kk, vv, "f32", reps, graph=True) or torch_sdpa.time(q, kk, vv, "f32", reps, False)
            t16 = torch_sdpa.time(q, kk, vv, "f16", reps, graph=True) or torch_sdpa.time(q, kk, vv, "f16", reps, False)
            speed = None if t32 is None else t32 / best
            row = (f"| {h}/{kvh}/{d} | {length} | {kv_bytes / 2**20:.1f} | {_fmt(t_fd)} | {_fmt(t_pdl)} | {gbs:.0f} | "
                   f"{pct:.0f}% | "
                   f"{t_eager:.1f} | {_fmt(t_inc)} | {_fmt(t_app)} | {_fmt(t32)} | {_fmt(t16)} | "
                   f"{_fmt(speed, '.1f', 'x')} |")
            print(row, flush=True)
            rows.append(row)
            for g in (g_fd, g_pdl, g_inc, g_app):
                if g is not None:
                    g.close()
        for b in (qb, ob, kn, vn, step):
            b.free()
        ex.close()
    return rows


def bench_prefill(dev, stream, reps: int, torch_sdpa: TorchSdpa, shapes, seqs) -> list[str]:
    rows = ["| heads/kv/dim | S (causal) | flash attention µs | TFLOP/s | torch f32 µs | vs torch f32 "
            "| tensor cores (f16 in, token-major f16 out) µs | TFLOP/s | torch f16 µs | vs torch f16 |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    rng = np.random.default_rng(1)
    for h, kvh, d in shapes:
        for s in seqs:
            ex = CudaExecutor(1, h, kvh, d, s, dev)
            q = rng.standard_normal((h, s, d), dtype=np.float32)
            k = rng.standard_normal((kvh, s, d), dtype=np.float32)
            v = rng.standard_normal((kvh, s, d), dtype=np.float32)
            _fill(ex, k, v)
            with cuda.GpuBuffer.from_numpy(q) as qb, cuda.GpuBuffer(q.size) as ob:
                def run():
                    for _ in range(3):
                        ex.prefill_device(0, qb, ob, s, 0, s, True, stream=stream)

                t = median_us(run, stream, 3, max(3, reps // 4))
                t16 = None
                if d in MMA_HEAD_DIMS and dev.target.compute_capability >= (8, 0):
                    with cuda.GpuBuffer(q.size, np.float16) as o16:
                        def run16():
                            for _ in range(3):
                                ex.prefill_device(0, qb, o16, s, 0, s, True, out_layout="tokens-f16",
                                                  stream=stream)

                        t16 = median_us(run16, stream, 3, max(3, reps // 4))
            flops = 4 * h * d * s * (s + 1) / 2  # QK^T and PV over the causal half
            t32 = tf16 = None
            if torch_sdpa.torch is not None:
                torch, F = torch_sdpa.torch, torch_sdpa.F
                try:
                    tq = torch.from_numpy(q).cuda()[None]
                    tk, tv = torch.from_numpy(k).cuda()[None], torch.from_numpy(v).cuda()[None]

                    def sdpa(a, b, c):
                        return lambda: F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True)

                    t32 = torch_sdpa.median_us(sdpa(tq, tk, tv), 1, max(3, reps // 4))
                    tq, tk, tv = tq.half(), tk.half(), tv.half()
                    tf16 = torch_sdpa.median_us(sdpa(tq, tk, tv), 1, max(3, reps // 4))
                    del tq, tk, tv
                    torch.cuda.empty_cache()
                except Exception as exc:
                    print(f"  torch prefill: {type(exc).__name__}: {str(exc)[:120]}")
            row = (f"| {h}/{kvh}/{d} | {s} | {t:.0f} | {flops / t / 1e6:.1f} | {_fmt(t32, '.0f')} | "
                   f"{_fmt(None if t32 is None else t32 / t, '.2f', 'x')} | {_fmt(t16, '.0f')} | "
                   f"{_fmt(None if t16 is None else flops / t16 / 1e6, '.1f')} | {_fmt(tf16, '.0f')} | "
                   f"{_fmt(None if tf16 is None or t16 is None else tf16 / t16, '.2f', 'x')} |")
            print(row, flush=True)
            rows.append(row)
            ex.close()
    return rows


TUNE_VARIANTS = [  # (label, CudaExecutor options); the first is the default
    ("default", {}),
    *[(f"block {bs}", {"block_size": bs}) for bs in BLOCK_SIZES if bs != ServingConfig().block_size],
    ("chunks x0.5", {"chunks": 0.5}),
    ("chunks x2 (at most 1024)", {"chunks": 2.0}),
    ("unroll 1", {"decode_unroll": 1}),
    ("unroll 2", {"decode_unroll": 2}),
    ("unroll 4", {"decode_unroll": 4}),
    ("lanes 0 (the kernel's own)", {"decode_lanes": 0}),
    ("lanes 8", {"decode_lanes": 8}),
    ("lanes 16", {"decode_lanes": 16}),
    ("lanes 32", {"decode_lanes": 32}),
    ("block 16, min chunk 16", {"block_size": 16, "min_chunk": 16}),
    ("min chunk 64", {"min_chunk": 64}),
    ("min chunk 128", {"min_chunk": 128}),
]
TUNE_LENGTHS = [512, 1024, 8192, 32768]


def _default_label(ex: CudaExecutor) -> str:
    c = ex.cache
    return (f"default (block {ex.block_size}, unroll {c.decode_unroll}, lanes {c.decode_lanes}, "
            f"min chunk {ex.min_chunk})")


def bench_tuning(dev, stream, copy_bw: float, reps: int, shapes, lengths, calls: int | None = None) -> list[str]:
    """Flash-decoding variants of the paged cache on the same data (graph timing), to pick the defaults
    from one run.

    Each variant is a CudaExecutor with those options holding the same K/V, so it gets the chunk count
    and tiling its own settings give (``chunks xF`` scales the default's chunk count). A variant the
    shape cannot take (lanes not dividing head_dim / 4) gets a row that says why instead of a time."""
    rows = ["| heads/kv/dim | L | variant | chunks | regs | µs (graph) | % of copy |",
            "|---|---:|---|---:|---:|---:|---:|"]
    rng = np.random.default_rng(2)
    max_len = max(lengths)
    for h, kvh, d in shapes:
        k = rng.standard_normal((kvh, max_len, d), dtype=np.float32)
        v = rng.standard_normal((kvh, max_len, d), dtype=np.float32)
        qb, ob = cuda.GpuBuffer.from_numpy(rng.standard_normal(h * d, dtype=np.float32)), cuda.GpuBuffer(h * d)
        step = cuda.GpuBuffer.from_numpy(np.array([0], np.uint32))
        results: dict[int, list] = {length: [] for length in lengths}
        default_chunks = 1
        for label, opts in TUNE_VARIANTS:
            opts = dict(opts)
            factor = opts.pop("chunks", None)
            if factor is not None:
                opts["num_chunks"] = max(1, min(1024, round(default_chunks * factor)))
            try:
                ex = CudaExecutor(1, h, kvh, d, max_len, dev, **opts)
            except ShapeError as exc:
                for length in lengths:
                    results[length].append((f"{label} (skipped: {exc})", None, None, None))
                continue
            if not opts:
                label, default_chunks = _default_label(ex), ex.num_chunks
            try:
                _fill(ex, k, v)
                for length in lengths:
                    step.copy_from_host(np.array([length], np.uint32))
                    n_calls = calls or (50 if length <= 4096 else 20)

                    def fd(s, ex=ex):
                        ex.flash_decoding(0, qb, ob, seq_len=step, stream=s)

                    g = _graph_of(fd, stream, n_calls)
                    if g is not None:
                        t = median_us(lambda: g.launch(stream), stream, n_calls, reps)
                        g.close()
                    else:
                        def eager():
                            for _ in range(n_calls):
                                fd(stream)
                        t = median_us(eager, stream, n_calls, reps)
                    results[length].append((label, ex.num_chunks, _registers(ex), t))
            finally:
                stream.synchronize()
                ex.close()
        for length in lengths:
            kv_bytes = 2 * kvh * length * d * 4
            best = min((r[3] for r in results[length] if r[3] is not None), default=None)
            for label, nch, regs, t in results[length]:
                mark = " **best**" if t is not None and t == best else ""
                pct = None if t is None else 100 * kv_bytes / t / copy_bw
                row = (f"| {h}/{kvh}/{d} | {length} | {label}{mark} | {_fmt(nch, 'd')} | {_fmt(regs, 's')} | "
                       f"{_fmt(t)} | {_fmt(pct, '.0f', '%')} |")
                print(row, flush=True)
                rows.append(row)
        for b in (qb, ob, step):
            b.free()
    return rows


def _registers(ex: CudaExecutor) -> str:
    """Registers per thread of the executor's flash-decoding kernel (the driver's count), or ?."""
    try:
        from realizar.cuda.driver import drv

        attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NUM_REGS
        return str(int(call("cuFuncGetAttribute", attr, ex.decode_kernel.function)))
    except Exception:  # no driver function (emulated runtime)
        return "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes, one repetition, no torch, no copy-bandwidth run: checks the control flow "
                         "(argument packing, graph capture, table rows), e.g. on the emulated device; the "
                         "numbers mean nothing")
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--no-tune", action="store_true", help="skip the flash-decoding variant sweep")
    a = ap.parse_args()
    dev = cuda.current_device()
    stream = cuda.Stream()
    reps = 1 if a.smoke else 5 if a.quick else 15
    shapes, lengths, tune_lengths, prefill, calls = SHAPES, LENGTHS, TUNE_LENGTHS, PREFILL, None
    if a.smoke:
        shapes, lengths, tune_lengths, prefill, calls = [(4, 2, 64)], [40], [33], [20], 2
        copy_bw, torch_sdpa = float("nan"), TorchSdpa(enabled=False)
    else:
        copy_bw, torch_sdpa = copy_bandwidth(stream) / 1e6, TorchSdpa()  # bytes per µs
    lines = [
        f"# Attention kernels — {dev.name}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        "",
        f"Device-to-device copy bandwidth measured in this run: **{copy_bw / 1e3:.0f} GB/s** "
        "(cuMemcpyDtoD of 1 GiB, bytes read + written). `python tools/bench_attention.py`",
        "",
        f"Decode (batch 1, one query per head, paged f32 KV cache, block size {ServingConfig().block_size}). "
        "Graph columns: GPU time per call inside a captured "
        "CUDA graph of back-to-back calls (PDL: with programmatic dependent launch between them, as the GPU "
        "model runs). KV GB/s and % of copy use the best of the three.",
        "",
    ]
    print("\n".join(lines), flush=True)
    lines += bench_decode(dev, stream, copy_bw, reps, torch_sdpa, lengths, shapes, calls)
    if not a.no_tune:
        lines += ["", "Flash-decoding variants of the paged cache's knobs (same data; graph timing; the defaults "
                  "are the first row; regs: registers per thread of the decode kernel):", ""]
        print("\n".join(lines[-3:]), flush=True)
        lines += bench_tuning(dev, stream, copy_bw, reps, shapes, tune_lengths, calls)
    if not a.no_prefill:
        lines += ["", "Prefill (causal flash attention, f32, from the paged KV cache through its block table):", ""]
        print("\n".join(lines[-3:]), flush=True)
        lines += bench_prefill(dev, stream, reps, torch_sdpa, shapes, prefill)
    table = "\n".join(lines) + "\n"
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(table)
    print("\n" + table)


if __name__ == "__main__":
    main()
