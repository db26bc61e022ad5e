"""Prefill tokens/s and time to first token of the GPU model at real model shapes (random weights),
against llama.cpp's pp512, the f16 tensor-core roofline and the same layer stack in torch f16.

    python tools/bench_prefill.py --out docs/results/bench_prefill_h200.md
    python tools/bench_prefill.py --shapes llama-3-8b --lengths 512 --prefill-chunk 256
    python tools/bench_prefill.py --device emulate --tiny --lengths 4,8 --runs 2 --warmup 1   # CPU smoke

Each shape (``realizar.models.random.BENCH_SHAPES``; ``--tiny``: a 2-layer toy) and prompt length S:
``model.reset()`` then ``model.prefill(S random token ids)`` on the fresh KV cache, ``--warmup``
untimed runs, then the median of ``--runs`` timed ones:

* prefill tok/s: S / the CUDA-event time around ``model.prefill`` on the model's stream;
* time to first token (TTFT): host wall clock from the call of ``prefill`` until the first greedy
  token id has been read back, as a user of ``generate`` waits for it.

``--prefill-chunk`` is passed to ``GpuModel`` only when its constructor takes ``prefill_chunk``;
the log names the prefill path that ran. The roofline counts 2 x (layer matrix parameters) x S FLOP
(QKV, O, gate, up and down of every layer; the LM head runs on one position and attention's S^2
terms are left out) at the GPU's dense f16 tensor-core rate, looked up from the device name or given
by ``--peak-tflops``. llama.cpp's pp512 figures were measured by us (``llama-bench -ngl 99 -p 512``,
flash attention on, H200, random weights, 2026-11-21; ../shared/GUIDE.md); they are not re-run here.

The torch peer (``--torch auto``: CUDA when torch has it) runs the same layer stack eagerly in f16:
embedding, per layer RMSNorm, one QKV ``F.linear``, rotate-half RoPE from precomputed tables,
``F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)``, O projection + residual,
RMSNorm, one gate/up ``F.linear``, SiLU x up, down projection + residual; final norm, LM head and
argmax on the last position. It is timed like realizar (CUDA events; host clock on the CPU) and
skipped, with the reason in the log, when torch or its device is missing or the f16 weights would
not fit in free memory. The realizar model and the torch weights are freed between shapes.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from realizar import cuda
from realizar.gpu.model import GpuModel
from realizar.models.config import ModelConfig
from realizar.models.random import BENCH_SHAPES, BenchShape, bench_model

LLAMA_CPP_PP512 = {"smollm2-135m": 57054, "llama-3.2-1b": 33636, "llama-3-8b": 9822}
LLAMA_CPP_ORIGIN = ("llama.cpp pp512: `llama-bench -ngl 99 -p 512` (flash attention on) on an H200, random "
                    "weights at the same shapes, 2026-11-21 (../shared/GUIDE.md); not re-run here")

# dense f16 tensor-core TFLOP/s (f32 accumulate) by a substring of the device name, first match wins
PEAK_F16_TFLOPS = (("H200", 989.0), ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0),
                   ("GH200", 989.0), ("A100", 312.0))

TINY = BenchShape(dict(architecture="llama", vocab_size=256, hidden_size=128, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=32, intermediate_size=256, rope_theta=1e4, rope_type="normal",
                       rms_norm_eps=1e-5, context_length=512, tied_embeddings=True), "Q4_1", "Q8_0", None)


def _tps(v: float) -> str:
    """A rate in whole tokens a second, three significant figures below 100 (the emulator's toy runs)."""
    return f"{v:.0f}" if v >= 100 else f"{v:.3g}"


def peak_tflops(device_name: str) -> float | None:
    """The dense f16 tensor-core rate of a known GPU, or None."""
    return next((tf for key, tf in PEAK_F16_TFLOPS if key in device_name), None)


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters of the layer matrices (QKV, O, gate, up, down) over all layers."""
    h, q, kv, f = cfg.hidden_size, cfg.q_dim, cfg.kv_dim, cfg.intermediate_size
    return cfg.num_layers * (h * (q + 2 * kv) + q * h + 3 * h * f)


# ---- realizar ---------------------------------------------------------------------------------------
def make_model(cfg: ModelConfig, tensors: dict, max_len: int, device, prefill_chunk: int | None):
    """(GpuModel, description of its prefill path); ``prefill_chunk`` None keeps the model's default."""
    kw = {} if prefill_chunk is None else {"prefill_chunk": prefill_chunk}
    model = GpuModel(cfg, tensors, max_len=max_len, device=device, **kw)
    if model.batched_prefill_off:
        return model, f"token by token through the decode graph ({model.batched_prefill_off})"
    return model, f"batched, prefill_chunk={model.prefill_chunk} (prompts of {model.prefill_min_batch} tokens or more)"


def first_token(logits) -> int:
    """The greedy token of a prefill's logits (the 4-byte device argmax where the model has one)."""
    if hasattr(logits, "greedy_token"):
        return int(logits.greedy_token())
    return int(np.argmax(np.asarray(logits)))


def time_prefill(model, device, ids: list[int], warmup: int, runs: int) -> tuple[float, float]:
    """(median seconds of ``model.prefill(ids)`` by CUDA events, median TTFT seconds by the host clock)."""
    e0, e1 = cuda.Event(device=device), cuda.Event(device=device)
    gpu, ttft = [], []
    for i in range(warmup + runs):
        model.reset()
        model.device.synchronize()
        t0 = time.perf_counter()
        e0.record(model.sequence.stream)
        logits = model.prefill(ids)
        e1.record(model.sequence.stream)
        first_token(logits)
        t1 = time.perf_counter()
        e1.synchronize()
        if i >= warmup:
            gpu.append(e0.elapsed_ms(e1) / 1e3)
            ttft.append(t1 - t0)
    return statistics.median(gpu), statistics.median(ttft)


def bench_realizar(cfg, tensors, device, lengths: list[int], a) -> tuple[dict[int, tuple[float, float]], str]:
    """{S: (prefill seconds, TTFT seconds)} and the prefill path; the model is freed on return."""
    model, path = make_model(cfg, tensors, max(lengths) + 16, device, a.prefill_chunk)
    rng = np.random.default_rng(1)
    out = {}
    try:
        for s in lengths:
            ids = [int(t) for t in rng.integers(0, cfg.vocab_size, s)]
            out[s] = time_prefill(model, device, ids, a.warmup, a.runs)
    finally:
        del model
        gc.collect()
    return out, path


# ---- torch f16 peer ---------------------------------------------------------------------------------
class TorchPeer:
    """The layer stack in torch f16 (see the module docstring); ``reason`` says why it cannot run."""

    def __init__(self, where: str):
        self.torch = self.F = self.device = None
        self.reason = None
        if where == "none":
            self.reason = "disabled (--torch none)"
            return
        try:
            import torch
            import torch.nn.functional as F
        except ImportError:
            self.reason = "torch is not installed"
            return
        if where in ("auto", "cuda") and not torch.cuda.is_available():
            self.reason = f"torch {torch.__version__} has no CUDA device"
            return
        self.torch, self.F, self.device = torch, F, ("cpu" if where == "cpu" else "cuda")

    @property
    def label(self) -> str:
        if self.torch is None:
            return f"skipped: {self.reason}"
        return f"torch {self.torch.__version__} on {self.device}, eager, f16"

    def _free_bytes(self) -> int:
        if self.device == "cuda":
            return int(self.torch.cuda.mem_get_info()[0])
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

    def fit_reason(self, cfg: ModelConfig, max_s: int) -> str | None:
        """Why the weights and activations of ``cfg`` at ``max_s`` tokens would not fit, or None."""
        h, f = cfg.hidden_size, cfg.intermediate_size
        weights = 2 * (matmul_params(cfg) + cfg.vocab_size * h + (2 * cfg.num_layers + 1) * h)
        acts = 2 * max_s * (6 * h + cfg.q_dim + 2 * cfg.kv_dim + 3 * f) * 2
        need, free = weights + acts, self._free_bytes()
        if 1.2 * need > free:
            return f"needs ~{need / 2**30:.1f} GiB of f16 weights and activations, {free / 2**30:.1f} GiB free"
        return None

    def build(self, cfg: ModelConfig) -> None:
        """Random f16 weights of every layer on the peer's device."""
        torch, dev, dt = self.torch, self.device, self.torch.float16
        gen = torch.Generator(device=dev).manual_seed(0)

        def rand(*shape):
            return torch.randn(*shape, generator=gen, device=dev, dtype=dt) * 0.02

        h, f = cfg.hidden_size, cfg.intermediate_size
        ones = torch.ones(h, device=dev, dtype=dt)
        self.cfg = cfg
        self.table = rand(cfg.vocab_size, h)  # embedding and LM head (one table: the same speed)
        self.out_norm = ones
        self.layers = [dict(attn_norm=ones, ffn_norm=ones, qkv=rand(cfg.q_dim + 2 * cfg.kv_dim, h),
                            o=rand(h, cfg.q_dim), gu=rand(2 * f, h), down=rand(h, f)) for _ in range(cfg.num_layers)]

    def free(self) -> None:
        self.table = self.out_norm = self.layers = None
        gc.collect()
        if self.device == "cuda":
            self.torch.cuda.empty_cache()

    def _rope_tables(self, s: int):
        torch, cfg = self.torch, self.cfg
        inv = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=self.device) / cfg.head_dim)
        ang = torch.outer(torch.arange(s, device=self.device), inv)
        ang = torch.cat([ang, ang], -1)
        return ang.cos().to(torch.float16), ang.sin().to(torch.float16)

    def forward(self, ids, cos, sin):
        """The greedy next token after ``ids`` (a device tensor), left on the device."""
        torch, F, cfg = self.torch, self.F, self.cfg
        s, h, hd, eps = ids.shape[0], cfg.hidden_size, cfg.head_dim, cfg.rms_norm_eps
        half = hd // 2

        def rope(t):
            return t * cos + torch.cat([-t[..., half:], t[..., :half]], -1) * sin

        x = F.embedding(ids, self.table)
        for w in self.layers:
            y = F.rms_norm(x, (h,), w["attn_norm"], eps)
            q, k, v = F.linear(y, w["qkv"]).split([cfg.q_dim, cfg.kv_dim, cfg.kv_dim], -1)
            q = rope(q.view(s, cfg.num_heads, hd).transpose(0, 1))
            k = rope(k.view(s, cfg.num_kv_heads, hd).transpose(0, 1))
            v = v.view(s, cfg.num_kv_heads, hd).transpose(0, 1)
            att = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, enable_gqa=True)[0]
            x = x + F.linear(att.transpose(0, 1).reshape(s, cfg.q_dim), w["o"])
            g, u = F.linear(F.rms_norm(x, (h,), w["ffn_norm"], eps), w["gu"]).chunk(2, -1)
            x = x + F.linear(F.silu(g) * u, w["down"])
        y = F.rms_norm(x[-1:], (h,), self.out_norm, eps)
        return torch.argmax(F.linear(y, self.table), -1)

    def time(self, s: int, warmup: int, runs: int) -> float:
        """Median seconds of one forward of ``s`` tokens (CUDA events, or the host clock on the CPU)."""
        torch = self.torch
        ids = torch.randint(0, self.cfg.vocab_size, (s,), device=self.device)
        cos, sin = self._rope_tables(s)
        times = []
        with torch.inference_mode():
            for i in range(warmup + runs):
                if self.device == "cuda":
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    self.forward(ids, cos, sin)
                    e1.record()
                    e1.synchronize()
                    dt = e0.elapsed_time(e1) / 1e3
                else:
                    t0 = time.perf_counter()
                    self.forward(ids, cos, sin)
                    dt = time.perf_counter() - t0
                if i >= warmup:
                    times.append(dt)
        return statistics.median(times)


def bench_torch(peer: TorchPeer, cfg: ModelConfig, lengths: list[int], a) -> tuple[dict[int, float], str | None]:
    """{S: seconds} of the torch peer, or ({}, why it was skipped)."""
    if peer.torch is None:
        return {}, peer.reason
    why = peer.fit_reason(cfg, max(lengths))
    if why:
        return {}, why
    try:
        peer.build(cfg)
        return {s: peer.time(s, a.warmup, a.runs) for s in lengths}, None
    except peer.torch.cuda.OutOfMemoryError as exc:  # a fit estimate is only an estimate
        return {}, f"out of memory: {str(exc).splitlines()[0]}"
    finally:
        peer.free()


# ---- report -----------------------------------------------------------------------------------------
def _f(v: float | None, spec: str = ".0f") -> str:
    return "-" if v is None else format(v, spec)


def _x(v: float | None) -> str:
    """A ratio: two decimals, or three significant digits below 0.1."""
    return "-" if v is None else format(v, ".2f" if v >= 0.1 else ".3g")


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def row_values(r: dict, s: int, peak: float | None) -> dict:
    """The figures of shape result ``r`` at prompt length ``s`` (None where there is no figure)."""
    gpu_s, ttft_s = r["realizar"][s]
    tps = s / gpu_s
    roof = peak * 1e12 / (2 * matmul_params(r["cfg"])) if peak else None
    llama = r["llama"] if s == 512 else None
    torch_s = r["torch"].get(s)
    torch_tps = s / torch_s if torch_s else None
    return dict(tps=tps, gpu_ms=1e3 * gpu_s, ttft_ms=1e3 * ttft_s, roof=roof, frac=_ratio(tps, roof), llama=llama,
                x_llama=_ratio(tps, llama), torch_tps=torch_tps, x_torch=_ratio(tps, torch_tps))


def tables(results: list[dict], lengths: list[int], peak: float | None) -> list[str]:
    """The per-length table and the per-shape summary (the form of docs/performance.md's Prefill table)."""
    lines = ["| model shape | S | prefill tok/s | GPU ms | TTFT ms | roofline tok/s | % of roofline | "
             "llama.cpp pp512 tok/s | × llama.cpp | torch f16 tok/s | realizar / torch f16 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        for s in lengths:
            v = row_values(r, s, peak)
            lines.append(f"| {r['name']} | {s} | {_tps(v['tps'])} | {v['gpu_ms']:.2f} | {v['ttft_ms']:.2f} | "
                         f"{_f(v['roof'])} | {_pct(v['frac'])} | {_f(v['llama'])} | {_x(v['x_llama'])} | "
                         f"{_f(v['torch_tps'])} | {_x(v['x_torch'])} |")
    s0 = 512 if 512 in lengths else lengths[0]
    lines += ["", f"Summary (S = {s0} for TTFT, roofline and torch; llama.cpp at pp512 only):", "",
              "| shape | " + " | ".join(f"pp{s} tok/s" for s in lengths) + f" | TTFT ms (S={s0}) | llama.cpp pp512 | "
              f"× llama.cpp | % of roofline | realizar / torch f16 |",
              "|---|" + "---:|" * (len(lengths) + 5)]
    for r in results:
        v = row_values(r, s0, peak)
        pps = " | ".join(_tps(row_values(r, s, peak)['tps']) for s in lengths)
        lines.append(f"| {r['name']} | {pps} | {v['ttft_ms']:.2f} | {_f(v['llama'])} | {_x(v['x_llama'])} | "
                     f"{_pct(v['frac'])} | {_x(v['x_torch'])} |")
    return lines


def render(results: list[dict], lengths: list[int], device, peak: float | None, peak_given: bool,
           peer: TorchPeer, command: str, a) -> str:
    """The Markdown log: date, GPU, command, method, both tables and the torch skips."""
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    mem = getattr(device, "total_memory", 0) >> 30
    peak_text = (f"{peak:.0f} TFLOP/s dense f16 ({'--peak-tflops' if peak_given else 'from the device name'})"
                 if peak else "a peak unknown for this device (pass --peak-tflops): roofline columns left empty")
    paths = sorted({r["path"] for r in results})
    params = "/".join(f"{matmul_params(r['cfg']) / 1e6:.4g}M" for r in results)
    lines = [
        "# Prefill benchmark", "",
        f"- date: {when}",
        f"- GPU: {device.name} ({device.target.sm}, {device.sm_count} SMs, {mem} GiB)",
        f"- command: `{command}`",
        *([f"- launch policy changed: {a.policy}"] if a.policy != "none" else []),
        f"- prefill path: {'; '.join(paths)}",
        f"- method: random weights at the real shapes; per prompt length S, `model.reset()` then "
        f"`model.prefill(S random ids)` on a fresh KV cache, {a.warmup} warm-up run(s), median of {a.runs}. "
        "prefill tok/s = S / CUDA-event time around `prefill`; TTFT = host wall clock from the call of "
        "`prefill` to the first greedy token id read back",
        f"- roofline: 2 x {params} layer-matrix "
        f"parameters x S FLOP (LM head and attention's S^2 terms left out) at {peak_text}",
        f"- {LLAMA_CPP_ORIGIN}",
        f"- torch peer: {peer.label}" + ("" if peer.torch is None else
                                          "; the same layer stack (QKV/O/gate-up/down F.linear, causal SDPA with "
                                          "enable_gqa, RMSNorm, RoPE, SiLU; LM head + argmax on the last position), "
                                          "timed like realizar"),
    ]
    lines += [f"- torch skipped for {r['name']}: {r['torch_reason']}" for r in results
              if r["torch_reason"] and peer.torch is not None]
    return "\n".join(lines + [""] + tables(results, lengths, peak)) + "\n"


# ---- main -------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(BENCH_SHAPES), help="comma-separated BENCH_SHAPES names")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer toy shape instead (CPU smoke test)")
    ap.add_argument("--lengths", default="512,2048", help="prompt lengths, comma-separated")
    ap.add_argument("--runs", type=int, default=5, help="timed runs per length; the median is reported")
    ap.add_argument("--warmup", type=int, default=2, help="untimed runs first")
    ap.add_argument("--prefill-chunk", type=int, help="GpuModel(prefill_chunk=...) when it takes one")
    ap.add_argument("--peak-tflops", type=float, help="dense f16 tensor-core TFLOP/s (default: by GPU name)")
    ap.add_argument("--torch", choices=("auto", "cuda", "cpu", "none"), default="auto",
                    help="where the torch f16 peer runs (auto: CUDA if torch has it, else skipped)")
    ap.add_argument("--device", choices=("cuda", "emulate"),
                    help="realizar's device (default: cuda.current_device(), REALIZAR_DEVICE honoured)")
    ap.add_argument("--out", type=Path, help="write the Markdown log here")
    ap.add_argument("--policy", default="none",
                    help="launch-policy settings for this run, as tools/policy_ab.py's --variant (NAME=VALUE; ...)")
    a = ap.parse_args(argv)
    a.lengths = [int(s) for s in a.lengths.split(",") if s]
    if not a.lengths or min(a.lengths) < 1 or a.runs < 1 or a.warmup < 0:
        ap.error("--lengths must be positive, --runs >= 1, --warmup >= 0")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    command = shlex.join(["python", "tools/bench_prefill.py", *(sys.argv[1:] if argv is None else argv)])
    if a.device == "emulate":
        device = cuda.EmulatedDevice(sm_count=4, racecheck=False)  # few SMs: small emulated grids
    elif os.environ.get("REALIZAR_DEVICE") != "emulate" and cuda.unavailable_reason() is not None:
        print(f"no GPU: {cuda.unavailable_reason()}", file=sys.stderr)
        return 2
    else:
        device = cuda.current_device()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import policy_ab  # (lazily: it imports this module)

    import realizar.gpu.gemm_wg  # noqa: F401  (loaded, so that the policy names it reads are set there too)

    saved = policy_ab.apply(policy_ab.parse_variant(a.policy))
    try:
        return _run(a, device, command)
    finally:
        policy_ab.undo(saved)


def _run(a: argparse.Namespace, device, command: str) -> int:
    peak = a.peak_tflops or peak_tflops(device.name)
    peer = TorchPeer(a.torch)
    names = ["tiny"] if a.tiny else a.shapes.split(",")
    results = []
    for name in names:
        cfg, tensors, _ = bench_model(TINY if name == "tiny" else name)
        real, path = bench_realizar(cfg, tensors, device, a.lengths, a)
        del tensors
        gc.collect()
        tq, why = bench_torch(peer, cfg, a.lengths, a)
        results.append(dict(name=name, cfg=cfg, realizar=real, path=path, torch=tq, torch_reason=why,
                            llama=LLAMA_CPP_PP512.get(name)))
        for s in a.lengths:
            v = row_values(results[-1], s, peak)
            print(f"{name} S={s}: {_tps(v['tps'])} tok/s prefill, TTFT {v['ttft_ms']:.2f} ms, "
                  f"torch f16 {_f(v['torch_tps'])} tok/s{'' if not why else f' ({why})'}", flush=True)
    text = render(results, a.lengths, device, peak, a.peak_tflops is not None, peer, command, a)
    print(text)
    if a.out:
        a.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
