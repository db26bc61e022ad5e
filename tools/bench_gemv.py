"""GEMV benchmark: every weight type at the decode shapes that matter, against the device's copy
bandwidth and torch's f16 matmul of the same shape.

    python tools/bench_gemv.py --out docs/results/bench_gemv_h200.md [--quick] [--types Q4_K,Q8_0] [--sweep]

``--sweep`` times every launch configuration (rows per warp 1/2/4, warps 4/8, split-K 1/2/4/8 where
the shared memory allows) next to the dispatcher's pick, checks each one's result, and appends a
table of all of them per type and shape (to tune ``realizar.gpu.gemv.gemv_config``).

Shapes (out x in): 4096x4096, 14336x4096 (FFN up/gate), 4096x14336 (FFN down), and SmolLM2's
576x576, 1536x576, 576x1536, 49152x576 (the tied output projection), and Llama-3-8B's output projection
128256x4096 (Q6_K in its Q4_K_M file).

Method: each measurement replays a CUDA graph of N launches (falling back to back-to-back launches
when graphs are unavailable, which then include the host's launch cost) timed with CUDA events,
after a warm-up; the median of several replays is reported per launch. The launches rotate over
enough copies of the weights (>= 3x the L2 size in total) that L2 cannot serve them: every launch
reads its weights from HBM, as a decode step does. Bandwidth counts the weight bytes (x and y are
negligible); "% copy" divides by the device-to-device copy bandwidth measured in the same run with
cuMemcpyDtoD of 1 GiB (bytes read + written). "read µs" is the yardstick of the launch size: a plain
streaming read of the same number of bytes (the ``stream_read`` kernel: 16-byte loads, 4 in flight a
thread, 4 CTAs of 256 threads an SM) in the same harness and rotation, the fastest a single launch
of that size reads memory here; "% read" is its time over the GEMV's. The torch peer is
``W16 @ x16`` with the same rotation. A spot check compares 64 rows of each result with the float64
oracle.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import statistics
import time
from pathlib import Path

import numpy as np

from ptx_gen.kernels.gemv.gemv import KSPLITS, MAX_STATIC_SMEM, shared_bytes
from ptx_gen.kernels.gemv.quant_layout import K_QUANTS, WEIGHT_TYPES, type_info
from realizar import cuda
from ptx_gen.kernels.gemv.gemv_mma import MMA_TYPES
from ptx_gen.kernels.gemv.gemv_mma import layout as mma_layout
from realizar.gpu.ops import GemvConfig, GpuWeight, LayerOps, MmaConfig, gemv_config
from realizar.models.random import dequant, random_weight
from realizar.cuda.bench import copy_bandwidth, graph_median_us

SHAPES = [  # (label, out_dim, in_dim)
    ("4096x4096", 4096, 4096),
    ("14336x4096 (up)", 14336, 4096),
    ("4096x14336 (down)", 4096, 14336),
    ("576x576", 576, 576),
    ("1536x576", 1536, 576),
    ("576x1536", 576, 1536),
    ("49152x576 (lm head)", 49152, 576),
    ("128256x4096 (8B lm head)", 128256, 4096),
]
L2_BYTES = 60 << 20


class _Pdl:
    """Whether our launches use programmatic dependent launch (on by default, as in GpuModel's graph)."""

    on = False

    def enable(self) -> None:
        self.on = True

    def context(self):
        return cuda.programmatic_dependent_launch(self.on)


_pdl = _Pdl()


def time_launches(fn_list, stream: cuda.Stream, use_graph: bool, reps: int = 7) -> tuple[float, str]:
    """Median microseconds per launch of the callables in fn_list (each issues one launch)."""
    with _pdl.context():
        return graph_median_us(fn_list, stream, use_graph, reps)


def bench_read(ops, stream, nbytes: int, use_graph: bool, unroll: int = 4, block: int = 256,
               ctas_per_sm: int = 4) -> float:
    """Microseconds per launch of the ``stream_read`` kernel over ``nbytes`` (rounded down to 16), in
    the GEMV harness: rotating buffers totalling >= 3x L2, graph replay, the same PDL setting."""
    n16 = nbytes // 16
    bufs = [cuda.GpuBuffer(n16 * 16, np.uint8) for _ in range(n_copies(n16 * 16))]
    kern = ops.kernel("stream_read", unroll=unroll, block=block)
    grid = ctas_per_sm * ops.sm_count
    out = cuda.GpuBuffer(grid * kern.meta["block"], np.uint32)
    try:
        for b in bufs:
            b.fill_bytes(1)
        fns = [(lambda b=bufs[i % len(bufs)]:
                ops.launch(kern, grid, {"src": b.ptr, "n16": n16, "out": out.ptr}, stream))
               for i in range(max(len(bufs), 20))]
        return time_launches(fns, stream, use_graph)[0]
    finally:
        for b in bufs:
            b.free()
        out.free()


def n_copies(nbytes: int, cap: int = 1024) -> int:
    return int(min(cap, max(2, -(-3 * L2_BYTES // max(nbytes, 1)))))


def sweep_configs(wtype: str, in_dim: int, bulk_ok: bool = False) -> list[GemvConfig | MmaConfig]:
    """Every launch configuration of the sweep whose shared memory fits (tensor-core shapes too, for
    the types that have them)."""
    cfgs: list = [GemvConfig(r, w, s) for r in (1, 2, 4) for w in (4, 8) for s in KSPLITS
                  if s <= w and shared_bytes(wtype, in_dim, r, w, s) <= MAX_STATIC_SMEM]
    if wtype in MMA_TYPES and in_dim % 256 == 0:
        for tl, mt, kp in ((1, 1, 4), (1, 1, 8), (1, 2, 4), (1, 4, 2), (1, 8, 1),
                           (2, 1, 4), (2, 1, 8), (2, 2, 2), (2, 2, 4), (2, 4, 2), (2, 8, 1)):
            for st, bulk in itertools.product((2, 4), (False, True) if bulk_ok and wtype != "Q6_K" else (False,)):
                try:
                    mma_layout(wtype, in_dim, mt, kp, st, tl)
                    cfgs.append(MmaConfig(mt, kp, st, tl, bulk))
                except ValueError:
                    pass
    return cfgs


def mma_sweep_configs(wtype: str, out_dim: int, in_dim: int, ops, stages: tuple[int, ...] = (2,),
                      variants: bool = False, ahead: tuple[int, ...] = ()) -> list[MmaConfig]:
    """The tensor-core launch shapes of ``--mma-sweep``, timed on the tile-major weight: 16- and 32-row
    warps over CTAs of 4 to 16 warps, rings of ``stages`` (each depth that fits) of cp.async or (sm_90)
    bulk copies; ``solo`` as the dispatcher sets it (``variants``: each shape with and without ``solo`` and
    the late trigger; ``ahead``: each shape also with only that many ring stages requested before the grid
    wait, where fewer than its stages)."""
    bulk_ok = ops.device.target.compute_capability >= (9, 0)
    out = []
    for tl, mt, kp in ((1, 1, 8), (1, 2, 4), (1, 4, 2), (1, 1, 4), (2, 1, 8), (2, 2, 4), (2, 4, 2), (2, 1, 4),
                       (2, 4, 4), (2, 1, 16), (2, 1, 12), (2, 1, 10), (1, 7, 2), (1, 7, 1), (1, 8, 2),
                       # (small CTAs, so that more of them fit an SM's shared memory: every CTA of 14336 rows
                       # resident at once)
                       (2, 1, 3), (2, 1, 2), (2, 2, 2), (1, 1, 3), (1, 2, 2)):
        for st, bulk in itertools.product(stages, (False, True) if bulk_ok else (False,)):
            try:
                mma_layout(wtype, in_dim, mt, kp, st, tl, tiled=True)
            except ValueError:
                continue
            ctas = -(-out_dim // (16 * tl * mt))
            # (16-warp CTAs: with the late trigger, as the dispatcher runs them)
            base = MmaConfig(mt, kp, st, tl, bulk, solo=ctas <= ops.sm_count, late=mt * kp > 8)
            shapes = [base] if not variants else [dataclasses.replace(base, solo=so, late=la)
                                                  for so in (False, True) for la in (False, True)]
            out += shapes + [dataclasses.replace(c, ahead=a) for a in ahead if 0 < a < st for c in shapes]
    return out


def cfg_text(cfg: GemvConfig | MmaConfig) -> str:
    if isinstance(cfg, MmaConfig):
        return (f"mma m{cfg.mtiles} p{cfg.kparts} s{cfg.stages} t{cfg.tiles}" + (" bulk" if cfg.bulk else "")
                + (" solo" if cfg.solo else "") + (" late" if cfg.late else "")
                + (f" pf{cfg.l2pre}" if cfg.l2pre else "") + (f" a{cfg.ahead}" if cfg.ahead else ""))
    return f"r{cfg.rows} w{cfg.warps} s{cfg.ksplit}"


def _copies(base: GpuWeight, n: int) -> list[GpuWeight]:
    """``base`` and n - 1 copies of its bytes (a rotation over them keeps the L2 from serving them)."""
    out = [base]
    for _ in range(n - 1):
        w = GpuWeight.__new__(GpuWeight)
        w.__dict__.update(base.__dict__)
        w.buffer = cuda.GpuBuffer(base.buffer.count, np.uint8)
        w.buffer.copy_from(base.buffer)
        out.append(w)
    return out


def bench_type_shape(ops, stream, wtype, out_dim, in_dim, rng, sweep: bool, use_graph: bool, mma_sweep: bool = False,
                     mma_stages: tuple[int, ...] = (2,), variants: bool = False, l2pre: tuple[int, ...] = (),
                     ahead: tuple[int, ...] = ()):
    """Each configuration timed on the layout it reads: the dispatcher's pick on the weight as
    ``LayerOps.upload`` stores it (tile-major for the tensor-core GEMV), the rest on GGUF rows."""
    raw = random_weight(rng, wtype, out_dim, in_dim)
    base = GpuWeight(data=raw, ggml_type=wtype, shape=(out_dim, in_dim))
    nbytes = base.nbytes
    layout = ops.weight_layout(out_dim, in_dim, wtype) if wtype in MMA_TYPES and in_dim % 256 == 0 else "rows"
    copies = {"rows": _copies(base, n_copies(nbytes))}
    x = rng.standard_normal(in_dim).astype(np.float32)
    dx = cuda.GpuBuffer.from_numpy(x)
    dy = cuda.GpuBuffer(out_dim)
    # spot check of the first and last 32 rows against the float64 oracle (each configuration)
    pick = np.unique(np.r_[np.arange(min(32, out_dim)), np.arange(max(0, out_dim - 32), out_dim)])
    wd = dequant(raw.reshape(out_dim, base.row_bytes)[pick].reshape(-1), wtype, pick.size, in_dim).astype(np.float64)
    ref = wd @ x

    def check(cfg: GemvConfig, w: GpuWeight) -> bool:
        dy.poison(stream)
        ops.gemv(w, dx, dy, config=cfg, stream=stream)
        stream.synchronize()
        got = dy.to_numpy()[pick]
        return bool(np.isfinite(got).all() and np.abs(got - ref).max() <= 1e-4 * max(np.abs(ref).max(), 1e-30))

    simt = gemv_config(out_dim, ops.sm_count, in_dim, wtype)
    default = ops.mma_config(out_dim, in_dim, wtype, layout=layout) or simt
    if layout != "rows":
        tiled = GpuWeight(data=raw, ggml_type=wtype, shape=(out_dim, in_dim), layout=layout)
        copies[layout] = _copies(tiled, n_copies(nbytes))
    configs = [default] + ([simt] if simt != default else [])
    bulk_ok = ops.device.target.compute_capability >= (9, 0)
    configs += [c for c in sweep_configs(wtype, in_dim, bulk_ok) if c not in configs] if sweep else []
    tiled_cfgs = (mma_sweep_configs(wtype, out_dim, in_dim, ops, mma_stages, variants, ahead)
                  if mma_sweep and layout != "rows" else [])
    if l2pre and isinstance(default, MmaConfig) and layout != "rows" and bulk_ok:  # (the pick with L2 prefetches)
        tiled_cfgs += [dataclasses.replace(default, l2pre=v) for v in l2pre]
    configs += [c for c in tiled_cfgs if c not in configs]
    results = []
    n_launch = max(n_copies(nbytes), 20)  # (every copy in the rotation: fewer could sit in the L2)
    for cfg in configs:
        ws = copies[layout if cfg is default or cfg in tiled_cfgs else "rows"]
        try:
            ok = check(cfg, ws[0])
            fns = [(lambda w=ws[i % len(ws)], c=cfg: ops.gemv(w, dx, dy, stream=stream, config=c))
                   for i in range(n_launch)]
            us, mode = time_launches(fns, stream, use_graph)
        except Exception as exc:  # noqa: BLE001 - report and go on with the other configurations
            print(f"  {wtype} {out_dim}x{in_dim} {cfg_text(cfg)}: {exc}")
            continue
        results.append((us, cfg, mode, cfg is default, ok))
    for ws in copies.values():
        for w in ws:
            w.free()
    dx.free()
    dy.free()
    return nbytes, results


def bench_torch(out_dim, in_dim, stream_unused, use_graph: bool):
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    nbytes = out_dim * in_dim * 2
    n = n_copies(nbytes, cap=256)
    ws = [torch.randn(out_dim, in_dim, device="cuda", dtype=torch.float16) for _ in range(n)]
    x = torch.randn(in_dim, device="cuda", dtype=torch.float16)
    n_launch = max(n, 20)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for i in range(8):
            torch.matmul(ws[i % n], x)
    torch.cuda.synchronize()
    graph = None
    if use_graph:
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=s):
                for i in range(n_launch):
                    torch.matmul(ws[i % n], x)
        except Exception:  # noqa: BLE001
            graph = None
    times = []
    for i in range(8):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(s):
            e0.record()
            if graph is not None:
                graph.replay()
            else:
                for j in range(n_launch):
                    torch.matmul(ws[j % n], x)
            e1.record()
        e1.synchronize()
        if i:
            times.append(e0.elapsed_time(e1) * 1e3 / n_launch)
    del ws
    torch.cuda.empty_cache()
    return statistics.median(times), nbytes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--types", default=",".join(WEIGHT_TYPES))
    ap.add_argument("--shapes", default="", help="comma-separated labels' first words, e.g. 4096x4096,576x576")
    ap.add_argument("--quick", action="store_true", help="only the 4096/14336 shapes")
    ap.add_argument("--sweep", action="store_true", help="also time rows/warps alternatives to the default")
    ap.add_argument("--mma-sweep", action="store_true",
                    help="also time the tensor-core launch shapes on the tile-major weight (mma_sweep_configs)")
    ap.add_argument("--stages", default="2", help="ring depths of the --mma-sweep shapes, comma-separated")
    ap.add_argument("--ahead", default="", help="--mma-sweep: each shape also with only N of its ring stages requested "
                    "before the grid wait (the rest after x's first loads), for each N of this comma-separated list")
    ap.add_argument("--variants", action="store_true",
                    help="--mma-sweep: each shape with and without solo shared memory and the late trigger")
    ap.add_argument("--read-sweep", action="store_true",
                    help="also time the stream_read yardstick's launch shapes (unroll x block x CTAs an SM) at "
                         "each shape's byte count")
    ap.add_argument("--l2pre", default="", help="also time each tile-major pick with its warps' next N units past the "
                    "ring asked of the L2 before the grid wait (sm_90), for each N of this comma-separated list")
    ap.add_argument("--no-graph", action="store_true")
    ap.add_argument("--no-glu", action="store_true", help="skip the fused gate/up comparison")
    ap.add_argument("--no-pdl", action="store_true",
                    help="launch without programmatic dependent launch (each GEMV then starts only after the "
                         "previous one ended; with it, as in a decode step, a GEMV's first weight loads overlap "
                         "the end of the kernel before it)")
    a = ap.parse_args()
    if not a.no_pdl:
        _pdl.enable()
    if not cuda.is_available():
        print(f"no GPU: {cuda.unavailable_reason()}")
        return 1
    dev = cuda.current_device()
    ops = LayerOps(dev)
    stream = cuda.Stream()
    rng = np.random.default_rng(0)
    bw = copy_bandwidth(stream)
    types = [t for t in a.types.split(",") if t]
    shapes = SHAPES[:3] if a.quick else SHAPES
    if a.shapes:
        want = set(a.shapes.split(","))
        shapes = [s for s in shapes if s[0].split()[0] in want]
    lines = [
        f"# GEMV benchmark — {dev.name}, {dev.sm_count} SMs",
        "",
        f"Device-to-device copy bandwidth (cuMemcpyDtoD 1 GiB, read + write): **{bw / 1e12:.2f} TB/s**. "
        f"Times are per launch (median of graph replays of >= 20 launches rotating over weight copies "
        f"totalling >= 3x L2), weight bytes only. Programmatic dependent launch: "
        f"{'off' if a.no_pdl else 'on (as in the decode graph)'}.",
        "",
        "| type | shape (out x in) | MB | µs | GB/s | % copy BW | read µs | % read | config | check | torch f16 µs "
        "| torch GB/s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---|---:|---:|",
    ]
    print("\n".join(lines))
    torch_cache = {}
    read_cache: dict[int, float] = {}
    sweep_rows: list[str] = []
    t_start = time.time()
    for label, out_dim, in_dim in shapes:
        if (out_dim, in_dim) not in torch_cache:
            torch_cache[(out_dim, in_dim)] = bench_torch(out_dim, in_dim, stream, not a.no_graph)
        tres = torch_cache[(out_dim, in_dim)]
        for wt in types:
            if wt not in WEIGHT_TYPES:
                continue
            bs = type_info(wt).block_values
            if in_dim % bs or (wt in K_QUANTS and in_dim % 256):
                lines.append(f"| {wt} | {label} | — | — | — | — | — | — | rows of {in_dim} not possible "
                             f"| | | |")
                print(lines[-1])
                continue
            nbytes, results = bench_type_shape(ops, stream, wt, out_dim, in_dim, rng, a.sweep, not a.no_graph,
                                               a.mma_sweep, tuple(int(v) for v in a.stages.split(",")), a.variants,
                                               tuple(int(v) for v in a.l2pre.split(",") if v),
                                               tuple(int(v) for v in a.ahead.split(",") if v))
            if not results:
                continue
            default = next((r for r in results if r[3]), None)
            if default is None:
                continue
            best = min(results, key=lambda r: r[0])
            us, cfg, mode, _, _ = default
            gbs = nbytes / us / 1e3
            pct = lambda t: nbytes / t / 1e3 / (bw / 1e9) * 100  # noqa: E731
            cfg_txt = cfg_text(cfg) + (f" ({mode})" if mode != "graph" else "")
            if best is not default:
                cfg_txt += f"; best {cfg_text(best[1])}: {best[0]:.1f} µs ({pct(best[0]):.0f}%)"
            simt_cfg = gemv_config(out_dim, ops.sm_count, in_dim, wt)
            simt = next((r for r in results if r[1] == simt_cfg and r[1] != cfg), None)
            if simt is not None:
                cfg_txt += f"; SIMT {cfg_text(simt_cfg)}: {simt[0]:.1f} µs ({pct(simt[0]):.0f}%)"
            tcol = f"{tres[0]:.1f} | {tres[1] / tres[0] / 1e3:.0f}" if tres else "— | —"
            if nbytes not in read_cache:
                read_cache[nbytes] = bench_read(ops, stream, nbytes, not a.no_graph)
                if a.read_sweep:
                    reads = sorted((bench_read(ops, stream, nbytes, not a.no_graph, u, b, c), u, b, c)
                                   for u in (2, 4, 8, 16) for b in (256, 512) for c in (1, 2, 4, 8) if b * c <= 2048)
                    sweep_rows.append(f"| read {nbytes / 1e6:.1f} MB | {label} | " + ", ".join(
                        f"u{u} b{b} c{c} {t:.1f} ({pct(t):.0f}%)" for t, u, b, c in reads) + " |")
                    print(sweep_rows[-1], flush=True)
            rd = read_cache[nbytes]
            all_ok = all(r[4] for r in results)
            lines.append(f"| {wt} | {label} | {nbytes / 1e6:.1f} | {us:.1f} | {gbs:.0f} | {gbs / (bw / 1e9) * 100:.0f}% | "
                         f"{rd:.1f} | {rd / us * 100:.0f}% | {cfg_txt} | {'ok' if all_ok else '**FAIL**'} | {tcol} |")
            print(lines[-1], flush=True)
            if a.sweep or a.mma_sweep or a.l2pre:
                sweep_rows.append(f"| {wt} | {label} | " + ", ".join(
                    f"{cfg_text(c)}{'*' if d else ''} {t:.1f} ({pct(t):.0f}%){'' if k else ' **FAIL**'}"
                    for t, c, _, d, k in sorted(results, key=lambda r: r[0])) + " |")
                print(sweep_rows[-1], flush=True)
            write(a.out, lines + _sweep_section(sweep_rows))  # progressively: a timeout keeps what was measured
    if not a.no_glu:
        lines += ["", "## Fused gate/up GEMV with SwiGLU epilogue vs two GEMVs + swiglu (ffn 14336, hidden 4096)", "",
                  "| type | two GEMVs + swiglu µs | fused µs | speed-up |", "|---|---:|---:|---:|"]
        for wt in [t for t in ("Q4_K", "Q6_K", "Q8_0", "F16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q5_K") if t in types]:
            r = bench_glu(ops, stream, wt, 14336, 4096, rng, not a.no_graph)
            lines.append(f"| {wt} | {r[0]:.1f} | {r[1]:.1f} | {r[0] / r[1]:.2f}x |")
            print(lines[-1], flush=True)
            write(a.out, lines + _sweep_section(sweep_rows))
    lines += _sweep_section(sweep_rows)
    lines += ["", f"({time.time() - t_start:.0f} s)"]
    write(a.out, lines)
    return 0


def _sweep_section(rows: list[str]) -> list[str]:
    if not rows:
        return []
    return ["", "## Sweep: every configuration, fastest first (µs per launch, % of copy bandwidth; * = dispatcher's "
            "pick; rN wN sN = rows per warp, warps per CTA, K slices)", "", "| type | shape | configurations |",
            "|---|---|---|", *rows]


def write(path: Path | None, lines: list[str]) -> None:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n")


def bench_glu(ops, stream, wtype, ffn, hidden, rng, use_graph: bool) -> tuple[float, float]:
    """(µs of gate GEMV + up GEMV + swiglu, µs of the fused GLU GEMV), rotating weight copies."""
    raw = random_weight(rng, wtype, 2 * ffn, hidden)
    glu_layout, layout = ops.weight_layout(ffn, hidden, wtype, glu=True), ops.weight_layout(ffn, hidden, wtype)
    fused = GpuWeight(data=raw, ggml_type=wtype, shape=(2 * ffn, hidden), layout=glu_layout)
    half = fused.row_bytes * ffn
    gate = GpuWeight(data=raw[:half], ggml_type=wtype, shape=(ffn, hidden), layout=layout)
    up = GpuWeight(data=raw[half:], ggml_type=wtype, shape=(ffn, hidden), layout=layout)
    n = n_copies(fused.nbytes, cap=16)
    sets = [(fused, gate, up)]
    for _ in range(n - 1):
        copies = []
        for w in (fused, gate, up):
            c = GpuWeight.__new__(GpuWeight)
            c.__dict__.update(w.__dict__)
            c.buffer = cuda.GpuBuffer(w.buffer.count, np.uint8)
            c.buffer.copy_from(w.buffer)
            copies.append(c)
        sets.append(tuple(copies))
    x = cuda.GpuBuffer.from_numpy(rng.standard_normal(hidden).astype(np.float32))
    g, u, y = cuda.GpuBuffer(ffn), cuda.GpuBuffer(ffn), cuda.GpuBuffer(ffn)
    n_launch = max(len(sets), 20)

    def separate(i):
        _, wg, wu = sets[i % len(sets)]
        ops.gemv(wg, x, g, stream=stream)
        ops.gemv(wu, x, u, stream=stream)
        ops.swiglu(g, u, y, ffn, stream=stream)

    t_sep, _ = time_launches([lambda i=i: separate(i) for i in range(n_launch)], stream, use_graph)
    t_fused, _ = time_launches([lambda i=i: ops.gemv_glu(sets[i % len(sets)][0], x, y, stream=stream)
                                for i in range(n_launch)], stream, use_graph)
    for st_ in sets:
        for w in st_:
            w.free()
    return t_sep, t_fused


if __name__ == "__main__":
    raise SystemExit(main())
