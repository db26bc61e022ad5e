"""The ``realizar`` command line.

    realizar generate "The capital of France is"        # the default model (SmolLM2-135M-Instruct)
    realizar chat                                       # interactive, multi-turn
    realizar serve --port 8000                          # OpenAI-compatible server on 127.0.0.1
    realizar info model.gguf                            # architecture, shapes, tensors, tokenizer
    realizar bench --device cuda                        # prefill / decode throughput
    realizar ptx list | emit | check | sass | diff      # the kernel catalog

One module per command (generate.py holds generate and chat), each with its ``register`` adding
its parser and its ``cmd_*`` functions; common.py has what they share.

Errors print one line (``realizar: error: ...``) and exit non-zero; ``--verbose`` adds the traceback.
Progress and status messages go to stderr, and only when stderr is a terminal; generated text goes
to stdout.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import Sequence

from realizar.cli import bench, generate, info, ptx, serve
from realizar.cli.common import PROG, CliError, add_common

__all__ = ["main", "build_parser", "CliError"]


def build_parser() -> argparse.ArgumentParser:
    from realizar import __version__

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
        add_common(p)
        return p

    for module in (generate, serve, info, bench, ptx):
        module.register(command)
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
    args.argv = list(sys.argv[1:] if argv is None else argv)  # (what a command re-runs in child processes)
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
        if type(e).__name__ == "ModelOutputError":  # (the model failed, not the request: name its file)
            msg = f"the model {getattr(args, 'model', None) or '(the default model)'} failed: {msg}"
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
