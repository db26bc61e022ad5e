"""``realizar serve``: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import os

from realizar.cli.common import CliError, add_model_args, load_engine, note, port, positive_int


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise CliError(f"serving needs fastapi and uvicorn ({e}): pip install fastapi uvicorn") from None
    from realizar.server import serve

    api_key = args.api_key if args.api_key is not None else os.environ.get("REALIZAR_API_KEY") or None
    if api_key is not None and (not api_key.strip() or any(c.isspace() for c in api_key)):
        raise CliError("--api-key (or REALIZAR_API_KEY) must be a non-empty key without spaces")
    engine = load_engine(args)
    if args.host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        note(f"warning: listening on {args.host}, reachable beyond this machine, without an API key (--api-key)")

    def ready(host: str, port: int) -> None:
        shown = f"[{host}]" if ":" in host else host
        note(f"serving {engine.name!r} ({engine.device}) at http://{shown}:{port}/v1 - Ctrl-C to stop")

    try:
        serve(
            engine,
            args.host,
            args.port,
            model_name=args.model_name,
            max_queue=args.max_queue,
            default_max_tokens=args.default_max_tokens,
            log_level="debug" if args.verbose else args.log_level,
            api_key=api_key,
            on_ready=ready,
        )
    except KeyboardInterrupt:  # Ctrl-C is how a server is stopped: uvicorn has shut down cleanly
        pass
    except OSError as e:
        raise CliError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    note("stopped")
    return 0


def register(command) -> None:
    """Add the subcommand's parser; ``command(name, help, description)`` makes one."""
    p = command("serve", "OpenAI-compatible HTTP server",
                "Serve the model over HTTP: POST /v1/completions, /v1/chat/completions (with streaming), "
                "GET /v1/models, POST /tokenize, /detokenize, GET /health, /metrics. Binds to 127.0.0.1 unless told otherwise.")
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=port, default=8000, help="TCP port, 0 = any free port (default: 8000)")
    p.add_argument("--model-id", "--model-name", dest="model_name", metavar="ID",
                   help="the model id clients use (default: the model's name, without spaces)")
    p.add_argument("--api-key", metavar="KEY",
                   help="answer 401 to /v1 and tokenize requests without 'Authorization: Bearer KEY' "
                        "(default: the REALIZAR_API_KEY environment variable; none: no key needed)")
    p.add_argument("--max-queue", type=positive_int, default=256, metavar="N",
                   help="requests allowed to wait for the model before answering 429 (default: 256)")
    p.add_argument("--default-max-tokens", type=positive_int, metavar="N",
                   help="max_tokens of chat requests that give none (default: the rest of the context)")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn log level (default: info)")
    p.set_defaults(func=cmd_serve)
