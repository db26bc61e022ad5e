"""The ``realizar`` command line.

    realizar generate "The capital of France is"        # the default model (SmolLM2-135M-Instruct)
    realizar chat                                       # interactive, multi-turn
    realizar serve --port 8000                          # OpenAI-compatible server on 127.0.0.1
    realizar info model.gguf                            # architecture, shapes, tensors, tokenizer
    realizar bench --device cuda                        # prefill / decode throughput
    realizar ptx list | emit | check | sass | diff      # the kernel catalog

Errors print one line (``realizar: error: ...``) and exit non-zero; ``--verbose`` adds the traceback.
Progress and status messages go to stderr, and only when stderr is a terminal; generated text goes
to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Sequence

__all__ = ["main", "build_parser"]

PROG = "realizar"


class CliError(Exception):
    """A user-facing error: printed as one line, exit status ``code``."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


# ----------------------------------------------------------------------------------------------
# Small helpers
# ----------------------------------------------------------------------------------------------


def _tty(stream: Any = None) -> bool:
    stream = stream if stream is not None else sys.stderr
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _status(message: str) -> None:
    """A progress/status line on stderr, on a terminal only."""
    if _tty():
        print(f"{PROG}: {message}", file=sys.stderr, flush=True)


def _note(message: str) -> None:
    """An informational line on stderr, always."""
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected an integer > 0, got {v}")
    return v


def _nonneg_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {v}")
    return v


def _port(text: str) -> int:
    v = _nonneg_int(text)
    if v > 65535:
        raise argparse.ArgumentTypeError(f"a port is 0..65535, got {v}")
    return v


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _human_count(n: float) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))


def _rate(tokens: int, seconds: float) -> str:
    return f"{tokens / seconds:.1f} tok/s" if tokens > 0 and seconds > 0 else "n/a"


def _load_engine(args: argparse.Namespace):
    """Load the engine for ``--model``/``--device`` (the default model when no ``--model``)."""
    from realizar.engine import load_engine

    what = args.model if args.model else "the default model (SmolLM2-135M-Instruct)"
    _status(f"loading {what} ...")
    t0 = time.perf_counter()
    engine = load_engine(args.model, device=args.device, max_context=getattr(args, "max_context", None))
    _status(f"loaded {engine.name} on {engine.device} in {time.perf_counter() - t0:.1f} s")
    return engine


def _sampling(args: argparse.Namespace, max_tokens: int):
    from realizar.generation import SamplingParams

    return SamplingParams(
        max_tokens=max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=tuple(args.stop or ()),
    )


def _summary(result: Any, device: str) -> str:
    return (
        f"[{result.prompt_tokens} prompt tokens, {result.completion_tokens} generated | "
        f"prefill {_rate(result.prompt_tokens, result.prefill_seconds)}, "
        f"decode {_rate(result.completion_tokens - 1, result.decode_seconds)} | "
        f"{device} | finish: {result.finish_reason}]"
    )


def _write(text: str) -> None:
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()


# ----------------------------------------------------------------------------------------------
# generate / chat
# ----------------------------------------------------------------------------------------------


def cmd_generate(args: argparse.Namespace) -> int:
    prompt = args.prompt
    if prompt is None:
        if _tty(sys.stdin):
            raise CliError("no prompt: give it as an argument or on standard input", 2)
        prompt = sys.stdin.read()
    if not prompt.strip() and not args.chat:
        raise CliError("the prompt is empty", 2)
    engine = _load_engine(args)
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": prompt}
        ]
        ids = engine.chat_prompt(messages)
    else:
        ids = engine.tokenizer.encode(prompt)
    max_tokens = args.max_tokens
    room = engine.context_length - len(ids)
    if room <= 0:
        raise CliError(f"the prompt has {len(ids)} tokens; the context holds {engine.context_length}")
    if max_tokens > room:
        if args.max_tokens_given:
            raise CliError(
                f"prompt of {len(ids)} tokens + --max-tokens {max_tokens} exceeds the context of "
                f"{engine.context_length} tokens"
            )
        max_tokens = room
    params = _sampling(args, max_tokens)
    stream = engine.generator.stream(ids, params)
    try:
        if args.echo and not args.chat:
            _write(prompt)
        for chunk in stream:
            _write(chunk.text)
    finally:
        stream.close()
    result = stream.result
    if result is None or not result.text.endswith("\n"):
        _write("\n")
    if result is not None and not args.no_stats:
        print(_summary(result, engine.device), file=sys.stderr, flush=True)
    return 0


CHAT_HELP = "commands: /reset (forget the conversation), /exit or Ctrl-D (quit), /help"


def cmd_chat(args: argparse.Namespace) -> int:
    from realizar.errors import ContextOverflowError

    engine = _load_engine(args)
    interactive = _tty(sys.stdin)
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict] = []
    if interactive:
        try:
            import readline  # noqa: F401 - line editing for input()
        except ImportError:
            pass
        print(f"{engine.name} on {engine.device} - {CHAT_HELP}", file=sys.stderr, flush=True)
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            if interactive:
                print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:
            if not interactive:
                raise
            print("\n(/exit or Ctrl-D to quit)", file=sys.stderr, flush=True)
            continue
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            history.clear()
            if interactive:
                print("(conversation cleared)", file=sys.stderr, flush=True)
            continue
        if text == "/help":
            print(CHAT_HELP, file=sys.stderr, flush=True)
            continue
        history.append({"role": "user", "content": line})
        # Drop the oldest turns until the conversation and a reply fit in the context.
        while True:
            ids = engine.chat_prompt(system + history)
            room = engine.context_length - len(ids)
            if room >= min(args.max_tokens, 16) or len(history) <= 1:
                break
            history = history[2:] if len(history) > 2 else history[-1:]
        if room <= 0:
            history.pop()
            print(f"{PROG}: that message is too long for the context ({len(ids)} tokens)", file=sys.stderr)
            continue
        params = _sampling(args, min(args.max_tokens, room))
        pieces: list[str] = []
        stream = engine.generator.stream(ids, params)
        try:
            for chunk in stream:
                pieces.append(chunk.text)
                _write(chunk.text)
        except KeyboardInterrupt:
            _write("\n")
        except ContextOverflowError as e:  # pragma: no cover - guarded above
            print(f"{PROG}: {e}", file=sys.stderr)
        finally:
            stream.close()
        reply = "".join(pieces)
        _write("\n")
        history.append({"role": "assistant", "content": reply})
        if args.stats and stream.result is not None:
            print(_summary(stream.result, engine.device), file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# serve
# ----------------------------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise CliError(f"serving needs fastapi and uvicorn ({e}): pip install fastapi uvicorn") from None
    from realizar.server import serve

    engine = _load_engine(args)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        _note(f"warning: listening on {args.host}, reachable beyond this machine; there is no authentication")

    def ready(host: str, port: int) -> None:
        shown = f"[{host}]" if ":" in host else host
        _note(f"serving {engine.name!r} ({engine.device}) at http://{shown}:{port}/v1 - Ctrl-C to stop")

    try:
        serve(
            engine,
            args.host,
            args.port,
            model_name=args.model_name,
            max_queue=args.max_queue,
            default_max_tokens=args.default_max_tokens,
            log_level="debug" if args.verbose else args.log_level,
            on_ready=ready,
        )
    except KeyboardInterrupt:  # Ctrl-C is how a server is stopped: uvicorn has shut down cleanly
        pass
    except OSError as e:
        raise CliError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    _note("stopped")
    return 0


# ----------------------------------------------------------------------------------------------
# info
# ----------------------------------------------------------------------------------------------


def _type_name(ggml_type: int) -> str:
    try:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(int(ggml_type)).name
    except (ImportError, ValueError):
        return f"type{ggml_type}"


def model_info(path: str) -> dict:
    """Everything ``realizar info`` reports, as plain data."""
    from realizar.engine import load_tokenizer
    from realizar.models.loader import load_model

    loaded = load_model(path)
    c = loaded.config
    by_type: dict[str, dict] = {}
    params = 0
    total = 0
    tensors = []
    for name, t in loaded.tensors.items():
        n = 1
        for d in t.shape:
            n *= int(d)
        params += n
        total += t.nbytes
        tname = _type_name(t.ggml_type)
        entry = by_type.setdefault(tname, {"count": 0, "bytes": 0, "parameters": 0})
        entry["count"] += 1
        entry["bytes"] += t.nbytes
        entry["parameters"] += n
        tensors.append({"name": name, "type": tname, "shape": list(t.shape), "bytes": t.nbytes})
    tok_info: dict[str, Any] = {}
    try:
        tok = load_tokenizer(loaded)
        tok_info = {
            "kind": getattr(tok, "kind", None),
            "vocab_size": getattr(tok, "vocab_size", None),
            "bos_token_id": getattr(tok, "bos_token_id", None),
            "eos_token_ids": list(getattr(tok, "eos_token_ids", ()) or ()),
            "add_bos": getattr(tok, "add_bos", None),
            "chat_template": bool(getattr(tok, "chat_template", None)),
        }
    except Exception as e:  # noqa: BLE001 - info still shows the rest
        tok_info = {"error": f"{type(e).__name__}: {e}"}
    md = loaded.metadata if loaded.format == "gguf" else {}
    if loaded.format == "gguf":
        tok_info["model"] = md.get("tokenizer.ggml.model")
        tok_info["pre"] = md.get("tokenizer.ggml.pre")
    file_bytes = (
        loaded.path.stat().st_size
        if loaded.path.is_file()
        else sum(p.stat().st_size for p in loaded.path.glob("*.safetensors"))
    )
    return {
        "path": str(loaded.path),
        "format": loaded.format,
        "name": md.get("general.name") if md else None,
        "file_bytes": file_bytes,
        "architecture": c.architecture,
        "context_length": c.context_length,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "num_layers": c.num_layers,
        "num_heads": c.num_heads,
        "num_kv_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "intermediate_size": c.intermediate_size,
        "rope_type": c.rope_type,
        "rope_theta": c.rope_theta,
        "rms_norm_eps": c.rms_norm_eps,
        "tied_embeddings": c.tied_embeddings,
        "qkv_bias": c.qkv_bias,
        "qk_norm": c.qk_norm,
        "parameters": params,
        "tensor_bytes": total,
        "tensor_count": len(tensors),
        "tensor_types": by_type,
        "tokenizer": tok_info,
        "tensors": tensors,
    }


def cmd_info(args: argparse.Namespace) -> int:
    path = Path(args.model).expanduser()
    if not path.exists():
        raise CliError(f"no model at {path}")
    info = model_info(str(path))
    if args.json:
        if not args.tensors:
            info.pop("tensors")
        print(json.dumps(info, indent=2))
        return 0
    c = info
    rows = [
        ("file", f"{c['path']} ({_human_bytes(c['file_bytes'])}, {c['format']})"),
        ("name", c["name"] or "-"),
        ("architecture", c["architecture"]),
        ("parameters", f"{_human_count(c['parameters'])} ({c['parameters']:,})"),
        ("context length", f"{c['context_length']:,}"),
        ("layers", c["num_layers"]),
        ("hidden size", c["hidden_size"]),
        ("attention", f"{c['num_heads']} heads, {c['num_kv_heads']} KV heads, head_dim {c['head_dim']}"
                      + (", qkv bias" if c["qkv_bias"] else "") + (", q/k norm" if c["qk_norm"] else "")),
        ("feed-forward", f"{c['intermediate_size']} (SwiGLU)"),
        ("vocabulary", f"{c['vocab_size']:,}"),
        ("rope", f"{c['rope_type']}, theta {c['rope_theta']:g}"),
        ("rms norm eps", f"{c['rms_norm_eps']:.3g}"),
        ("tied embeddings", "yes" if c["tied_embeddings"] else "no"),
        ("tensors", f"{c['tensor_count']} ({_human_bytes(c['tensor_bytes'])})"),
    ]
    for tname, e in sorted(c["tensor_types"].items(), key=lambda kv: -kv[1]["bytes"]):
        n = e["count"]
        rows.append((f"  {tname}", f"{n} tensor{'' if n == 1 else 's'}, {_human_count(e['parameters'])} params, "
                                   f"{_human_bytes(e['bytes'])}"))
    t = c["tokenizer"]
    if "error" in t:
        rows.append(("tokenizer", f"unavailable: {t['error']}"))
    else:
        kind = t.get("model") or t.get("kind")
        desc = f"{kind}" + (f" (pre-tokenizer {t['pre']})" if t.get("pre") else "")
        desc += f", {t.get('vocab_size'):,} tokens" if t.get("vocab_size") else ""
        rows.append(("tokenizer", desc))
        rows.append(("  special", f"bos {t.get('bos_token_id')}, eos {t.get('eos_token_ids')}, "
                                  f"adds bos: {'yes' if t.get('add_bos') else 'no'}"))
        rows.append(("  chat template", "yes" if t.get("chat_template") else "no"))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    if args.tensors:
        print()
        nw = max((len(x["name"]) for x in c["tensors"]), default=4)
        print(f"{'tensor':<{nw}}  {'type':<6}  {'shape':<16}  bytes")
        for x in c["tensors"]:
            shape = "x".join(str(d) for d in x["shape"])
            print(f"{x['name']:<{nw}}  {x['type']:<6}  {shape:<16}  {x['bytes']:,}")
    return 0


# ----------------------------------------------------------------------------------------------
# bench
# ----------------------------------------------------------------------------------------------


def _bench_prompt(engine: Any, n: int) -> list[int]:
    """``n`` ordinary token ids (English text repeated), whatever the tokenizer."""
    text = (
        "The quick brown fox jumps over the lazy dog while the committee reviews the annual report "
        "on renewable energy, transport, and the history of mathematics in seven countries. "
    )
    ids: list[int] = []
    while len(ids) < n:
        ids.extend(engine.tokenizer.encode(text, add_special_tokens=False))
    return ids[:n]


def run_bench(engine: Any, prompt_tokens: int, gen_tokens: int, repeats: int, warmup: int = 1,
              progress: bool = False) -> dict:
    """Time prefill of ``prompt_tokens`` and ``gen_tokens`` greedy decode steps on the raw model
    (EOS does not stop it), ``repeats`` times after ``warmup`` runs; medians in the result."""
    import numpy as np

    model = engine.model
    if prompt_tokens + gen_tokens > engine.context_length:
        raise CliError(
            f"--prompt-tokens {prompt_tokens} + --gen-tokens {gen_tokens} exceeds the context of "
            f"{engine.context_length} tokens"
        )
    ids = _bench_prompt(engine, prompt_tokens)
    prefill_s: list[float] = []
    decode_s: list[float] = []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=warmup + repeats, desc="bench", unit="run", file=sys.stderr, leave=False)
    for i in range(warmup + repeats):
        model.reset()
        t0 = time.perf_counter()
        logits = model.prefill(ids)
        tok = int(np.argmax(np.asarray(logits)))
        t1 = time.perf_counter()
        for _ in range(gen_tokens):
            logits = model.decode(tok)
            tok = int(np.argmax(np.asarray(logits)))
        t2 = time.perf_counter()
        if i >= warmup:
            prefill_s.append(t1 - t0)
            decode_s.append(t2 - t1)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    p, d = statistics.median(prefill_s), statistics.median(decode_s)
    return {
        "model": engine.name,
        "device": engine.device,
        "prompt_tokens": prompt_tokens,
        "gen_tokens": gen_tokens,
        "repeats": repeats,
        "prefill_seconds": p,
        "decode_seconds": d,
        "prefill_tokens_per_second": prompt_tokens / p if p > 0 else None,
        "decode_tokens_per_second": gen_tokens / d if d > 0 and gen_tokens else None,
        "decode_ms_per_token": 1e3 * d / gen_tokens if gen_tokens else None,
    }


def cmd_bench(args: argparse.Namespace) -> int:
    engine = _load_engine(args)
    r = run_bench(engine, args.prompt_tokens, args.gen_tokens, args.repeats, args.warmup, progress=_tty())
    if args.json:
        print(json.dumps(r, indent=2))
        return 0

    def fmt(v: float | None, spec: str) -> str:
        return format(v, spec) if v is not None else "n/a"

    print("| model | device | prompt | prefill tok/s | generated | decode tok/s | ms/token |")
    print("|---|---|---:|---:|---:|---:|---:|")
    print(
        f"| {r['model']} | {r['device']} | {r['prompt_tokens']} | {fmt(r['prefill_tokens_per_second'], '.1f')} | "
        f"{r['gen_tokens']} | {fmt(r['decode_tokens_per_second'], '.1f')} | {fmt(r['decode_ms_per_token'], '.2f')} |"
    )
    print(f"(median of {r['repeats']} runs after {args.warmup} warm-up; greedy, EOS ignored)", file=sys.stderr)
    return 0


# ----------------------------------------------------------------------------------------------
# ptx
# ----------------------------------------------------------------------------------------------


def _shape_arg(items: Sequence[str] | None) -> dict:
    from ptx_gen.inspect import parse_shape

    try:
        return parse_shape(items or [])
    except ValueError as e:
        raise CliError(str(e), 2) from None


def cmd_ptx_list(args: argparse.Namespace) -> int:
    from ptx_gen.inspect import list_kernels

    kernels = list_kernels()
    if args.json:
        print(json.dumps([{"name": k.name, "shape_params": list(k.shape_params), "defaults": k.defaults,
                           "grid": list(k.grid), "doc": k.doc} for k in kernels], indent=2, default=str))
        return 0
    width = max((len(k.signature()) for k in kernels), default=0)
    for k in kernels:
        print(f"{k.signature():<{width}}  {k.summary}")
    return 0


def cmd_ptx_emit(args: argparse.Namespace) -> int:
    from ptx_gen.inspect import ptx_text

    text = ptx_text(args.kernel, args.target, **_shape_arg(args.shape))
    if args.output:
        Path(args.output).write_text(text)
        _note(f"wrote {args.output} ({len(text):,} bytes)")
    else:
        sys.stdout.write(text)
    return 0


def cmd_ptx_check(args: argparse.Namespace) -> int:
    from ptx_gen import inspect as ptx_tools

    targets = args.target or list(ptx_tools.CHECK_TARGETS)
    if args.kernel and not args.grid:
        shape = _shape_arg(args.shape)
        results = [ptx_tools.check(args.kernel, t, **shape) for t in targets]
    else:
        if args.shape:
            raise CliError("--shape needs a KERNEL (and not --grid)", 2)
        names = [args.kernel] if args.kernel else None
        results = ptx_tools.check_all(targets, names)
    failed = [r for r in results if not r.ok]
    spilled = [r for r in results if r.ok and r.spills]
    if args.json:
        print(json.dumps([r.as_dict() for r in results], indent=2, default=str))
    else:
        rows = [("kernel", "shape", "target", "regs", "shared", "stack", "spill st/ld", "status")]
        for r in results:
            shape = ",".join(f"{k}={v}" for k, v in r.shape.items()) or "-"
            if r.ok:
                rows.append((r.name, shape, r.target, str(r.registers), str(r.shared_bytes), str(r.stack_bytes),
                             f"{r.spill_stores}/{r.spill_loads}", "SPILLS" if r.spills else "ok"))
            else:
                rows.append((r.name, shape, r.target, "-", "-", "-", "-", f"FAILED: {r.error}"))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
        for row in rows:
            print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1])
        print(f"{len(results)} checked, {len(failed)} failed, {len(spilled)} with spills", file=sys.stderr)
    if failed:
        return 1
    if spilled and args.fail_on_spill:
        return 1
    return 0


def cmd_ptx_sass(args: argparse.Namespace) -> int:
    from ptx_gen.inspect import sass

    sys.stdout.write(sass(args.kernel, args.target, **_shape_arg(args.shape)))
    return 0


def cmd_ptx_diff(args: argparse.Namespace) -> int:
    from ptx_gen.inspect import diff

    a, b = _shape_arg([args.shape_a]), _shape_arg([args.shape_b])
    out = diff(args.kernel, a, b, target=args.target, target_b=args.target_b, context=args.context)
    if out:
        sys.stdout.write(out)
    else:
        _note("the two variants generate identical PTX")
    return 0


# ----------------------------------------------------------------------------------------------
# The parser
# ----------------------------------------------------------------------------------------------


class _MaxTokensAction(argparse.Action):
    """Records whether ``--max-tokens`` was given (a default is clipped to the context; an explicit
    value that does not fit is an error)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.max_tokens_given = True


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                   help="show tracebacks and debug output")


def _add_model(p: argparse.ArgumentParser) -> None:
    from realizar.engine import DEVICES

    p.add_argument("-m", "--model", metavar="PATH",
                   help="GGUF file or HF safetensors directory (default: SmolLM2-135M-Instruct, "
                        "downloaded once and cached)")
    p.add_argument("-d", "--device", choices=DEVICES, default="auto",
                   help="where to run: the GPU when available (auto), or force cuda / cpu (default: auto)")
    p.add_argument("--max-context", type=_positive_int, metavar="N",
                   help="cap the KV cache below the model's context length")


def _add_sampling(p: argparse.ArgumentParser, temperature: float, top_p: float, max_tokens: int) -> None:
    p.add_argument("-n", "--max-tokens", type=_positive_int, default=max_tokens, action=_MaxTokensAction,
                   metavar="N", help=f"tokens to generate at most (default: {max_tokens})")
    p.add_argument("-t", "--temperature", type=float, default=temperature,
                   help=f"sampling temperature, 0 = greedy (default: {temperature:g})")
    p.add_argument("--top-k", type=_nonneg_int, default=0, metavar="K",
                   help="keep the K most likely tokens, 0 = off (default: 0)")
    p.add_argument("--top-p", type=float, default=top_p, metavar="P",
                   help=f"nucleus sampling threshold, 1 = off (default: {top_p:g})")
    p.add_argument("--repetition-penalty", type=float, default=1.0, metavar="R",
                   help="penalise tokens already seen, 1 = off (default: 1)")
    p.add_argument("--seed", type=int, help="random seed for reproducible sampling")
    p.add_argument("--stop", action="append", metavar="TEXT",
                   help="stop before this text (repeatable); it is not printed")
    p.set_defaults(max_tokens_given=False)


def build_parser() -> argparse.ArgumentParser:
    from realizar import __version__
    from ptx_gen.target import DEFAULT_TARGET, SUPPORTED_TARGETS

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="realizar: LLM inference driving PTX kernels through the CUDA driver API.",
        epilog="Run 'realizar COMMAND --help' for the options of a command.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="show tracebacks and debug output")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(name: str, help: str, description: str | None = None) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=description or help)
        _add_common(p)
        return p

    # generate
    p = command("generate", "generate text from a prompt, streamed as it is produced",
                "Generate text from PROMPT (or standard input), streaming it to stdout, then print a "
                "one-line summary (tokens, prefill and decode speed, device) to stderr.")
    p.add_argument("prompt", nargs="?", metavar="PROMPT", help="the prompt (default: read standard input)")
    _add_model(p)
    _add_sampling(p, temperature=0.0, top_p=1.0, max_tokens=64)
    p.add_argument("--chat", action="store_true",
                   help="wrap PROMPT as a user message in the model's chat template")
    p.add_argument("--system", metavar="TEXT", help="system message (with --chat)")
    p.add_argument("--echo", action="store_true", help="print the prompt before the generated text")
    p.add_argument("--no-stats", action="store_true", help="do not print the summary line")
    p.set_defaults(func=cmd_generate)

    # chat
    p = command("chat", "interactive multi-turn chat",
                "Chat with the model using its chat template. Type a message and press Enter; "
                "/reset forgets the conversation, /exit or Ctrl-D quits. Reads lines from standard "
                "input when it is not a terminal.")
    _add_model(p)
    _add_sampling(p, temperature=0.7, top_p=0.9, max_tokens=512)
    p.add_argument("--system", metavar="TEXT", help="system message")
    p.add_argument("--stats", action="store_true", help="print a summary line after each reply")
    p.set_defaults(func=cmd_chat)

    # serve
    p = command("serve", "OpenAI-compatible HTTP server",
                "Serve the model over HTTP: POST /v1/completions, /v1/chat/completions (with streaming), "
                "GET /v1/models, /health, /metrics. Binds to 127.0.0.1 unless told otherwise.")
    _add_model(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=_port, default=8000, help="TCP port, 0 = any free port (default: 8000)")
    p.add_argument("--model-name", metavar="NAME",
                   help="the model id clients use (default: the model's own name)")
    p.add_argument("--max-queue", type=_positive_int, default=256, metavar="N",
                   help="requests allowed to wait for the model before answering 429 (default: 256)")
    p.add_argument("--default-max-tokens", type=_positive_int, metavar="N",
                   help="max_tokens of chat requests that give none (default: the rest of the context)")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn log level (default: info)")
    p.set_defaults(func=cmd_serve)

    # info
    p = command("info", "describe a model file: architecture, shapes, tensors, tokenizer",
                "Describe MODEL (a GGUF file or a safetensors directory) without loading its weights.")
    p.add_argument("model", metavar="MODEL", help="GGUF file or HF safetensors directory")
    p.add_argument("--tensors", action="store_true", help="also list every tensor (name, type, shape, bytes)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_info)

    # bench
    p = command("bench", "measure prefill and decode throughput",
                "Time the prefill of a prompt and greedy decode steps on the chosen device (EOS is "
                "ignored); report medians as a Markdown table.")
    _add_model(p)
    p.add_argument("-p", "--prompt-tokens", type=_positive_int, default=128, metavar="N",
                   help="prompt length (default: 128)")
    p.add_argument("-g", "--gen-tokens", type=_nonneg_int, default=32, metavar="N",
                   help="decode steps (default: 32)")
    p.add_argument("-r", "--repeats", type=_positive_int, default=3, metavar="N",
                   help="timed runs; the median is reported (default: 3)")
    p.add_argument("--warmup", type=_nonneg_int, default=1, metavar="N", help="untimed runs first (default: 1)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_bench)

    # ptx
    p = command("ptx", "inspect the PTX kernel catalog",
                "List, emit, assemble (ptxas -v), disassemble and diff the generated PTX kernels.")
    psub = p.add_subparsers(dest="ptx_command", metavar="ACTION", required=True)

    def ptx_action(name: str, help: str, description: str | None = None) -> argparse.ArgumentParser:
        q = psub.add_parser(name, help=help, description=description or help)
        _add_common(q)
        return q

    target_help = f"GPU target, one of {', '.join(SUPPORTED_TARGETS)} (default: {DEFAULT_TARGET})"
    shape_help = "shape parameter NAME=VALUE (repeatable or comma-separated; see 'ptx list')"

    q = ptx_action("list", "list the kernels with their shape parameters and defaults")
    q.add_argument("--json", action="store_true", help="print JSON (with docs and validation grids)")
    q.set_defaults(func=cmd_ptx_list)

    q = ptx_action("emit", "print the PTX of one kernel for one shape")
    q.add_argument("kernel", metavar="KERNEL")
    q.add_argument("-s", "--shape", action="append", metavar="NAME=VALUE", help=shape_help)
    q.add_argument("--target", default=DEFAULT_TARGET, help=target_help)
    q.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of stdout")
    q.set_defaults(func=cmd_ptx_emit)

    q = ptx_action("check", "assemble with ptxas and report registers, spills, shared memory, stack",
                   "Assemble with ptxas -v and report registers, shared memory, stack and spills. "
                   "With no KERNEL: every kernel over its validation grid. Exits 1 if any fails.")
    q.add_argument("kernel", nargs="?", metavar="KERNEL", help="one kernel (default: all)")
    q.add_argument("-s", "--shape", action="append", metavar="NAME=VALUE", help=shape_help)
    q.add_argument("--target", action="append", choices=SUPPORTED_TARGETS,
                   help="target (repeatable; default: sm_80 and sm_90)")
    q.add_argument("--grid", action="store_true", help="with KERNEL: check its whole validation grid")
    q.add_argument("--fail-on-spill", action="store_true", help="exit 1 if any variant spills registers")
    q.add_argument("--json", action="store_true", help="print JSON")
    q.set_defaults(func=cmd_ptx_check)

    q = ptx_action("sass", "print the SASS (machine code) of one kernel (needs nvdisasm or cuobjdump)")
    q.add_argument("kernel", metavar="KERNEL")
    q.add_argument("-s", "--shape", action="append", metavar="NAME=VALUE", help=shape_help)
    q.add_argument("--target", default=DEFAULT_TARGET, help=target_help)
    q.set_defaults(func=cmd_ptx_sass)

    q = ptx_action("diff", "unified diff of the PTX of one kernel at two shapes",
                   "Unified diff of KERNEL's PTX at SHAPE_A and SHAPE_B (e.g. 'vec=1' 'vec=4'; '' for "
                   "the defaults), optionally for two targets.")
    q.add_argument("kernel", metavar="KERNEL")
    q.add_argument("shape_a", metavar="SHAPE_A", help="NAME=VALUE[,NAME=VALUE...]")
    q.add_argument("shape_b", metavar="SHAPE_B", help="NAME=VALUE[,NAME=VALUE...]")
    q.add_argument("--target", default=DEFAULT_TARGET, help=target_help)
    q.add_argument("--target-b", metavar="TARGET", help="target of SHAPE_B (default: --target)")
    q.add_argument("-U", "--context", type=_nonneg_int, default=3, metavar="N", help="context lines (default: 3)")
    q.set_defaults(func=cmd_ptx_diff)

    return parser


# ----------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------


def _error_message(e: BaseException) -> str:
    from ptx_gen.ptxas import PtxasError

    if isinstance(e, PtxasError):
        first = next((ln.strip() for ln in e.log.splitlines() if "error" in ln.lower()), "")
        return f"{str(e).splitlines()[0]}{': ' + first if first else ''}"
    if isinstance(e, KeyError) and e.args:
        return str(e.args[0])
    if isinstance(e, FileNotFoundError) and e.filename is None and e.args:
        return str(e.args[0])
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}: {e.filename}" if e.filename else e.strerror
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0] if "\n" in text and not isinstance(e, CliError) else text


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    verbose = bool(getattr(args, "verbose", False))
    if verbose:
        os.environ.setdefault("REALIZAR_VERBOSE", "1")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        # stdout closed early (e.g. piped into head): not an error; silence the flush at exit
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except OSError:
            pass
        return 0
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - the one place errors become exit codes
        if verbose:
            traceback.print_exc()
        code = e.code if isinstance(e, CliError) else 1
        msg = _error_message(e)
        if verbose or isinstance(e, CliError) or _is_expected(e):
            print(f"{PROG}: error: {msg}", file=sys.stderr)
        else:
            print(f"{PROG}: error: {type(e).__name__}: {msg} (run with --verbose for the traceback)",
                  file=sys.stderr)
        return code


def _is_expected(e: BaseException) -> bool:
    """Errors a user can cause (bad file, bad argument, missing tool): no 'internal' hint."""
    from realizar.errors import RealizarError

    names = {"PtxasError", "PtxasNotFound", "SassToolNotFound", "CudaUnavailableError", "DownloadError"}
    return isinstance(e, (RealizarError, OSError, KeyError, ValueError)) or type(e).__name__ in names


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
