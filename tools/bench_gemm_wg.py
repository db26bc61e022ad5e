"""The warpgroup-MMA batch GEMM over quantized weights (``GemmWgOps.gemm_wg``, sm_90a) against the f16 path it
replaces (the weight's f16 copy through ``gemm_f16``), ``gemm_q`` (up to 128 tokens) and torch's f16 matmul
(cuBLAS) on the same shapes, in one run, timed as GPU time (calls replayed from a CUDA graph).

    python tools/bench_gemm_wg.py [--types Q4_K,Q6_K] [--models 8b,1b] [--ms 64,128,256,512] [--sweep]

Each row: ``Y[M, N] = X[M, K] W^T`` for one linear layer of the model (fused gate/up: the SwiGLU GEMM over 2
FFN rows), 20 calls captured in a graph, event-timed replays, median of 7. "TFLOP/s" counts 2 M N K over the
wg time; "f16 / wg", "q / wg" and "torch / wg" are the others' times over ours (above 1: ours is faster).
"GB/s" is the quantized weight's bytes over the wg time (a token tile reads them once from DRAM, again from
L2). A spot check compares the result with float64 over the dequantized weights (relative to sum |w||x|).
``--sweep`` times every launch shape that fits and reports the best beside the policy's. ``--as-step`` runs each
weight as the batched decode step does: in the layout the model stores it (``weight_layout``: GGUF rows where the
batch-1 GEMV takes them), with the step's epilogue (the residual added in place for o and down), and from DRAM
(the 20 calls cycle through copies of the weight that together exceed twice the L2) instead of from L2.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gemm_x8 import SHAPES, _torch_us, _us, relative_error  # noqa: E402

from ptx_gen.kernels.gemm.qstream import F16DEC_TYPES  # noqa: E402
from realizar.cuda.bench import graph_median_us  # noqa: E402

from realizar import cuda  # noqa: E402
from realizar.gpu.gemm_wg import WgConfig, WsConfig, split_room, wg_config, ws_config  # noqa: E402
from realizar.gpu.ops import LayerOps  # noqa: E402
from realizar.gpu.weights import GpuWeight  # noqa: E402
from realizar.models.random import dequant, random_weight  # noqa: E402


def _sweep(wtype: str, k: int, layout: str, m: int, max_smem: int) -> list[WgConfig]:
    from ptx_gen.kernels.gemm.gemm_wg import smem_bytes

    out = []
    for mt in (64, 128, 256):
        if mt > 2 * max(m, 32):
            continue
        for rg, kp in ((1, 1), (2, 1), (1, 2), (1, 4)):
            if (mt == 256 and rg * kp > 2) or k // 256 < kp:
                continue
            for st in (2, 3):
                if smem_bytes(wtype, k, layout, mt, rg, kp, st) <= max_smem:
                    out += [WgConfig(mt, rg, kp, st, u) for u in (1, 2)]
    return out


def _sweep_ws(wtype: str, k: int, layout: str, m: int, max_smem: int, policy: WsConfig,
              wstages: tuple[int, ...] = (2,), stages: tuple[int, ...] = (4, 3, 2),
              psplits: tuple[int, ...] = (1,), pfences: tuple[int, ...] = (1,),
              xcasts: tuple[int, ...] = (1,)) -> list[WsConfig]:
    """Every token tile, consumer warpgroup count, A/B ring depth of ``stages``, weight ring depth of ``wstages``, K
    split, producer split of ``psplits``, producer fence grouping of ``pfences`` and X multicast of ``xcasts`` that fits,
    with the policy's X copies and decoder."""
    from ptx_gen.kernels.gemm.gemm_ws import check_shape, smem_bytes

    def takes(c: WsConfig) -> bool:
        try:
            check_shape(wtype, k, layout, c.mt, c.rgroups, c.stages, c.wstages, c.kparts, c.psplit, c.pfence, c.xcast,
                        c.xtma)
        except ValueError:
            return False
        return smem_bytes(wtype, k, layout, c.mt, c.rgroups, c.stages, c.wstages, c.psplit, c.xcast) <= max_smem

    return [c for c in (WsConfig(mt, rg, st, w, policy.xtma, policy.f16dec, kp, ps, pf, xc) for mt in (64, 128, 256)
                        if mt <= 2 * max(m, 32) for rg in (1, 2) for st in stages for w in wstages for kp in (1, 2, 4)
                        for ps in psplits for pf in pfences for xc in xcasts)
            if takes(c)]


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def _label(c) -> str:
    if isinstance(c, WsConfig):
        return (f"ws t{c.mt} r{c.rgroups} s{c.stages} w{c.wstages}{' tma' if c.xtma else ''}{' hd' if c.f16dec else ''}"
                f"{f' k{c.kparts}' if c.kparts > 1 else ''}{f' p{c.psplit}' if c.psplit > 1 else ''}"
                f"{f' f{c.pfence}' if c.pfence > 1 else ''}{f' c{c.xcast}' if c.xcast > 1 else ''}"
                f"{' sk' if c.streamk else ''}")
    return f"t{c.mt} r{c.rgroups} k{c.kparts} s{c.stages} u{c.unroll}"


def _check(raw, wtype, n, k, glu, x16, out, m) -> float:
    """The error against float64 over the weight rounded to f16, as the kernel decodes it, and the f16 X."""
    w = dequant(raw, wtype, n, k).astype(np.float16).astype(np.float64)
    return relative_error(x16[:min(m, 16)].astype(np.float64), w, glu, out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--types", default="Q4_K")
    ap.add_argument("--models", default="8b,1b")
    ap.add_argument("--ms", default="64,128,256,512")
    ap.add_argument("--shapes", help="only these shape labels (comma-separated: qkv, o, gate/up, down)")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--wstages", default="2",
                    help="gemm_ws --sweep: the weight ring depths tried (chunks a producer warp has in its ring)")
    ap.add_argument("--stages", default="4,3,2", help="gemm_ws --sweep: the A/B ring depths tried (2-8)")
    ap.add_argument("--psplit", default="1",
                    help="gemm_ws --sweep: the producer warpgroups a strip tried (1, 2, 4: each fills every psplit-th "
                         "stage)")
    ap.add_argument("--pfence", default="1",
                    help="gemm_ws --sweep: the stages a producer fences and announces together tried (1, 2, 4)")
    ap.add_argument("--xcast", default="1",
                    help="gemm_ws --sweep: the CTAs of a cluster sharing X by multicast tried (1, 2)")
    ap.add_argument("--top", type=int, default=5,
                    help="--sweep: the fastest candidates kept per shape and M, in a table of their own (0: none)")
    ap.add_argument("--ablate", default="",
                    help="gemm_ws: also time the policy's launch with these parts of the work left out (comma-separated "
                         "among wload, decode, mma, xload, fence, xwait, epilogue, each '+'-joinable: decode+mma), in a table of "
                         "their own")
    ap.add_argument("--xtma", action=argparse.BooleanOptionalAction,
                    help="gemm_ws: the policy's launch shapes with X by a tensor map (--no-xtma: by 16-byte copies; "
                         "default: as the policy has it)")
    ap.add_argument("--kparts", type=int, choices=(1, 2),
                    help="gemm_ws: the policy's launch shapes with K split over this many CTAs (default: the policy's)")
    ap.add_argument("--streamk", action=argparse.BooleanOptionalAction,
                    help="gemm_ws: the policy's launch shapes with Stream-K where it takes them (K whole, X by a tensor "
                         "map, no multicast; --no-streamk: none; default: as the policy has it)")
    ap.add_argument("--f16dec", action=argparse.BooleanOptionalAction,
                    help="gemm_ws: the policy's launch shapes decoding Q4_K in f16x2 (--no-f16dec: in f32; default: as "
                         "the policy has it)")
    ap.add_argument("--as-step", action="store_true",
                    help="the model's weight layouts and epilogues, weights read from DRAM (copies cycled)")
    ap.add_argument("--kernel", choices=("wg", "ws"), default="wg",
                    help="wg: one role per warp (gemm_wg); ws: warp-specialized producers and consumers (gemm_ws)")
    a = ap.parse_args()
    dev = cuda.current_device()
    ops, stream = LayerOps(dev), cuda.Stream(dev)
    smem = dev.max_shared_per_block_optin
    rng = np.random.default_rng(0)
    ms = [int(v) for v in a.ms.split(",")]
    lines = [f"# warpgroup-MMA GEMM over quantized weights (gemm_{a.kernel}), {dev.name}, {datetime.date.today()}", "",
             f"Command: `python tools/bench_gemm_wg.py {' '.join(sys.argv[1:])}`", "",
             "| type | shape | M | N x K | launch | wg µs | TFLOP/s | GB/s | f16 µs | f16 / wg | q µs | q / wg | torch µs "
             "| torch / wg | best swept | max error |",
             "|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    models = a.models.split(",")
    ablations = [x for x in a.ablate.split(",") if x] if a.kernel == "ws" else []
    cut_rows = []  # (the ablations' table)
    top_rows = []  # (the sweep's fastest candidates)
    for wtype in a.types.split(","):
        for model, label, n, k, glu in [s for s in SHAPES if s[0] in models and (not a.shapes or s[1] in a.shapes.split(","))]:
            layout = "glu-tiles" if glu else "tiles"
            if a.as_step:
                layout = ops.weight_layout(n // 2 if glu else n, k, wtype, glu=glu)
            raw = random_weight(rng, wtype, n, k)
            w = GpuWeight(data=raw, ggml_type=wtype, shape=(n, k), layout=layout, device=dev)
            copies = [w]
            if a.as_step:  # (enough copies that a graph's 20 calls read them from DRAM)
                need = -(-2 * dev.attribute("L2_CACHE_SIZE") // w.nbytes)
                copies += [GpuWeight(data=raw, ggml_type=wtype, shape=(n, k), layout=layout, device=dev)
                           for _ in range(min(need, 20) - 1)]
            residual = a.as_step and label in ("o", "down")
            w16 = ops.buffer(n * k, np.float16)
            ops.dequantize_f16(w, w16, interleave=glu, stream=stream)
            cols = n // 2 if glu else n
            for m in ms:
                x16h = ((rng.standard_normal((m, k)) + 0.1) / (64 if glu else 1)).astype(np.float16)
                x16 = ops.to_device(x16h)
                y = ops.buffer(m * cols, np.float16 if glu else np.float32)
                pick = ws_config if a.kernel == "ws" else wg_config
                cfg = pick(wtype, k, layout, cols, m, ops.sm_count, smem, glu=glu)
                if a.kernel == "ws" and a.xtma is not None:
                    cfg = dataclasses.replace(cfg, xtma=a.xtma)
                if a.kernel == "ws" and a.f16dec is not None:
                    cfg = dataclasses.replace(cfg, f16dec=a.f16dec and wtype in F16DEC_TYPES)
                if a.kernel == "ws" and a.kparts is not None:
                    cfg = dataclasses.replace(cfg, kparts=a.kparts)
                if a.kernel == "ws" and a.streamk is not None:
                    cfg = dataclasses.replace(cfg, streamk=a.streamk and cfg.kparts == cfg.psplit == cfg.xcast == 1
                                              and cfg.xtma)
                spaces = []  # (the K split's room of each timed launch shape, freed after the row)

                def gemm(*args, config, **kw):
                    if a.kernel == "wg":
                        return ops.gemm_wg(*args, config=config, **kw)
                    room = split_room(config, cols, m, glu)
                    if room[0] and not (spaces and spaces[-1].fits(*room)):
                        spaces.append(ops.split_space(*room))
                    return ops.gemm_ws(*args, config=config, split=spaces[-1] if room[0] else None, **kw)

                def run(c):
                    calls = [lambda wi=copies[i % len(copies)]: gemm(
                        x16, wi, y, m, glu=glu, out_f16=glu, residual=y if residual else None, config=c, stream=stream)
                        for i in range(20)]
                    return graph_median_us(calls, stream)[0]

                us = run(cfg)
                best = (us, cfg)
                timed = [(us, cfg)]
                if a.sweep:
                    for c in (_sweep_ws(wtype, k, layout, m, smem, cfg, _ints(a.wstages), _ints(a.stages),
                                        _ints(a.psplit), _ints(a.pfence), _ints(a.xcast)) if a.kernel == "ws"
                              else _sweep(wtype, k, layout, m, smem)):
                        if c == cfg:
                            continue
                        try:
                            t = run(c)
                        except Exception as exc:  # (a shape the device refuses)
                            print(f"  {c}: {type(exc).__name__}: {exc}", flush=True)
                            continue
                        print(f"  {wtype} {model} {label} M={m} {c}: {t:.1f} us", flush=True)
                        timed.append((t, c))
                        if t < best[0]:
                            best = (t, c)
                gemm(x16, w, y, m, glu=glu, out_f16=glu, config=cfg, stream=stream)  # (the check: no residual)
                stream.synchronize()
                got = y.copy_to_host(np.empty(m * cols, np.float16 if glu else np.float32)).reshape(m, cols)
                err = _check(raw, wtype, n, k, glu, x16h, got, m)
                fus = _us(lambda: ops.gemm_f16(x16, w16, y, m, n, k, glu=glu, out_f16=glu, stream=stream), stream)
                qus = (_us(lambda: ops.gemm_q(x16, w, y, m, glu=glu, out_f16=glu, stream=stream), stream)
                       if m <= 128 else None)
                tus = _torch_us(m, n, k)
                bc = best[1]
                row = (f"| {wtype} | {model} {label} | {m} | {n} x {k} | {_label(cfg)} | {us:.1f} | {2 * m * n * k / us / 1e6:.0f} | {w.nbytes / us / 1e3:.0f} | "
                       f"{fus:.1f} | {fus / us:.2f} | {'-' if qus is None else f'{qus:.1f}'} | "
                       f"{'-' if qus is None else f'{qus / us:.2f}'} | {'-' if tus is None else f'{tus:.1f}'} | "
                       f"{'-' if tus is None else f'{tus / us:.2f}'} | "
                       f"{best[0]:.1f} ({_label(bc)}) | {err:.1e} |")
                print(row, flush=True)
                lines.append(row)
                for rank, (t, c) in enumerate(sorted(timed, key=lambda tc: tc[0])[:a.top] if a.sweep else [], 1):
                    top_rows.append(f"| {wtype} | {model} {label} | {m} | {rank} | {_label(c)}"
                                    f"{' (the policy)' if c == cfg else ''} | {t:.1f} | {us / t:.2f} |")
                if ablations:  # (the same launch with parts of its work left out: what each costs)
                    cuts = [run(dataclasses.replace(cfg, ablate=x)) for x in ablations]
                    cut_rows.append(f"| {model} {label} | {m} | {_label(cfg)} | {us:.1f} | "
                                    + " | ".join(f"{t:.1f} ({t / us:.2f})" for t in cuts) + " |")
                    print(cut_rows[-1], flush=True)
                for b in (x16, y, *spaces):
                    b.free()
            w16.free()
            for c in copies:
                c.buffer.free()
    if top_rows:
        lines += ["", f"The {a.top} fastest launch shapes swept per shape and M (x policy: the policy's time over theirs).",
                  "", "| type | shape | M | rank | launch | µs | x policy |", "|---|---|---:|---:|---|---:|---:|", *top_rows]
    if cut_rows:
        lines += ["", "Ablations: the policy's launch timed with parts of its work left out (its results then meaningless: "
                  "wload the producers copy no weights, decode they store zeros, mma no MMAs, xload no X copies, fence "
                  "the producers skip fence.proxy.async, xwait the X copy skips its wait for the slot, epilogue no outputs "
                  "written); "
                  "µs and the ratio to the whole launch.", "",
                  "| shape | M | launch | whole µs | " + " | ".join(f"no {x} µs" for x in ablations) + " |",
                  "|---|---:|---|---:|" + "---:|" * len(ablations), *cut_rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        a.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
