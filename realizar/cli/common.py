"""Helpers shared by the ``realizar`` subcommands: the user-facing error, stderr messages, argument
types, the options every model command takes, and engine loading."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

PROG = "realizar"


class CliError(Exception):
    """A user-facing error: printed as one line, exit status ``code``."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


# ----------------------------------------------------------------------------------------------
# Small helpers
# ----------------------------------------------------------------------------------------------


def tty(stream: Any = None) -> bool:
    stream = stream if stream is not None else sys.stderr
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def status(message: str) -> None:
    """A progress/status line on stderr, on a terminal only."""
    if tty():
        print(f"{PROG}: {message}", file=sys.stderr, flush=True)


def note(message: str) -> None:
    """An informational line on stderr, always."""
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected an integer > 0, got {v}")
    return v


def positive_seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text}")
    return v


def nonneg_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {v}")
    return v


def port(text: str) -> int:
    v = nonneg_int(text)
    if v > 65535:
        raise argparse.ArgumentTypeError(f"a port is 0..65535, got {v}")
    return v


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def human_count(n: float) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))


def rate(tokens: int, seconds: float) -> str:
    return f"{tokens / seconds:.1f} tok/s" if tokens > 0 and seconds > 0 else "n/a"


def load_engine(args: argparse.Namespace):
    """Load the engine for ``--model``/``--device`` (the default model when no ``--model``)."""
    from realizar.engine import load_engine

    what = args.model if args.model else "the default model (SmolLM2-135M-Instruct)"
    status(f"loading {what} ...")
    t0 = time.perf_counter()
    engine = load_engine(args.model, device=args.device, max_context=getattr(args, "max_context", None),
                         tensor_parallel=getattr(args, "tensor_parallel", 1))
    status(f"loaded {engine.name} on {engine.where} in {time.perf_counter() - t0:.1f} s")
    return engine


def add_aliases(p: argparse.ArgumentParser, action: argparse.Action, *names: str) -> None:
    """Other tools' names for ``action``'s option (hidden in --help, named in error messages as typed): the
    same destination, type and choices."""
    kind = type(action)
    extra = {} if kind in (argparse._StoreTrueAction, argparse._StoreFalseAction) else {
        "type": action.type, "choices": action.choices, "metavar": action.metavar, "nargs": action.nargs}
    p.add_argument(*names, dest=action.dest, action=kind, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **extra)


class IgnoredOption(argparse.Action):
    """An option other tools take that means nothing here: its value is accepted and a note says so."""

    def __call__(self, parser, namespace, values, option_string=None):
        note(f"{option_string} {values} is accepted and ignored: realizar runs every layer on the device")
        setattr(namespace, self.dest, values)


def check_sampling(args: argparse.Namespace) -> None:
    """The sampling options' values, checked before a model loads (a bad one costs no load)."""
    from realizar.errors import InvalidRequestError

    try:
        sampling_params(args, 1).validate()
    except InvalidRequestError as e:
        raise CliError(str(e)) from None


def env_defaults(p: argparse.ArgumentParser) -> None:
    """Each long option ``--some-flag`` of ``p`` takes its default from ``REALIZAR_SOME_FLAG`` when that is set
    (its first long name; a switch: 1/true/yes or 0/false/no); the command line still wins."""
    import os

    for a in p._actions:
        longs = [o for o in a.option_strings if o.startswith("--")]
        if not longs or a.dest in ("help", argparse.SUPPRESS) or a.help is argparse.SUPPRESS:
            continue  # (an alias: the option it stands for takes the variable)
        var = "REALIZAR_" + longs[0][2:].upper().replace("-", "_")
        raw = os.environ.get(var)
        if raw is None:
            continue
        if isinstance(a, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse.BooleanOptionalAction)):
            word = raw.strip().lower()
            if word in ("1", "true", "yes", "0", "false", "no"):  # (anything else: the switch keeps its default)
                value = word in ("1", "true", "yes")
                a.default = not value if isinstance(a, argparse._StoreFalseAction) else value
            continue
        a.default = raw  # (argparse converts a string default with the option's type at parse time)
        a.type = _naming_env(a.type, var, raw, a.choices)


def _naming_env(convert, var: str, raw: str, choices):
    """``convert`` (an option's type; None: str) that names ``var`` when the environment's value is bad."""

    def typed(text: str):
        if text != raw:
            return text if convert is None else convert(text)
        try:
            value = text if convert is None else convert(text)
        except (argparse.ArgumentTypeError, ValueError) as e:
            raise argparse.ArgumentTypeError(f"{var}={raw!r}: {e}") from None
        if choices is not None and value not in choices:
            raise argparse.ArgumentTypeError(f"{var}={raw!r}: expected one of {', '.join(map(str, choices))}")
        return value

    typed.__name__ = getattr(convert, "__name__", "str")
    return typed


def sampling_params(args: argparse.Namespace, max_tokens: int):
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


def summary(result: Any, device: str) -> str:
    return (
        f"[{result.prompt_tokens} prompt tokens, {result.completion_tokens} generated | "
        f"prefill {rate(result.prompt_tokens, result.prefill_seconds)}, "
        f"decode {rate(result.completion_tokens - 1, result.decode_seconds)} | "
        f"{device} | finish: {result.finish_reason}]"
    )


def write(text: str) -> None:
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()


class MaxTokensAction(argparse.Action):
    """Records whether ``--max-tokens`` was given (a default is clipped to the context; an explicit
    value that does not fit is an error)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.max_tokens_given = True


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                   help="show tracebacks and debug output")


def add_model_args(p: argparse.ArgumentParser) -> None:
    from realizar.engine import DEVICES

    p.add_argument("-m", "--model", metavar="PATH",
                   help="GGUF file, HF safetensors directory, or Hugging Face Hub id org/name[:QUANT] "
                        "(downloaded into HF_HOME's cache; HF_HUB_OFFLINE=1: the cache only) (default: "
                        "SmolLM2-135M-Instruct, downloaded once and cached)")
    p.add_argument("-d", "--device", choices=DEVICES, default="auto",
                   help="where to run: the GPU when available (auto), or force cuda / cpu; emulate: the GPU model on the "
                        "CPU PTX emulator (slow: for tiny models) (default: auto)")
    add_aliases(p, p.add_argument("--max-context", type=positive_int, metavar="N",
                                  help="cap the KV cache below the model's context length (also -c, --ctx-size, "
                                       "--max-model-len)"), "-c", "--ctx-size", "--max-model-len")
    p.add_argument("-ngl", "--n-gpu-layers", "--gpu-layers", dest="n_gpu_layers", action=IgnoredOption,
                   metavar="N",
                   help="accepted for llama.cpp's command lines and ignored: every layer runs on the device")


def add_tensor_parallel_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensor-parallel", dest="tensor_parallel", type=positive_int, default=1, metavar="N",
                   help="split the model over N GPUs of this host (default: 1), NCCL between them "
                        "(pip install 'realizar[multigpu]')")


def add_sampling_args(p: argparse.ArgumentParser, temperature: float, top_p: float, max_tokens: int) -> None:
    p.add_argument("-n", "--max-tokens", type=positive_int, default=max_tokens, action=MaxTokensAction,
                   metavar="N", help=f"tokens to generate at most (default: {max_tokens})")
    add_aliases(p, p.add_argument("-t", "--temperature", type=float, default=temperature,
                                  help=f"sampling temperature, 0 = greedy (also --temp) (default: {temperature:g})"),
                "--temp")
    p.add_argument("--top-k", type=nonneg_int, default=0, metavar="K",
                   help="keep the K most likely tokens, 0 = off (default: 0)")
    p.add_argument("--top-p", type=float, default=top_p, metavar="P",
                   help=f"nucleus sampling threshold, 1 = off (default: {top_p:g})")
    p.add_argument("--repetition-penalty", type=float, default=1.0, metavar="R",
                   help="penalise tokens already seen, 1 = off (default: 1)")
    p.add_argument("--seed", type=nonneg_int, help="random seed for reproducible sampling (an integer >= 0)")
    p.add_argument("--stop", action="append", metavar="TEXT",
                   help="stop before this text (repeatable); it is not printed")
    p.set_defaults(max_tokens_given=False)

