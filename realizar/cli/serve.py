"""``realizar serve``: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import os
import re
import signal
from typing import Any

from realizar.cli.common import (
    CliError, add_aliases, add_model_args, add_tensor_parallel_arg, env_defaults, load_engine, note, port,
    positive_int, positive_seconds,
)
from realizar.config import ServingConfig
from realizar.errors import InvalidRequestError
from realizar.models.kv_formats import KV_FORMATS

_DEFAULTS = ServingConfig()

BLOCK_SIZES = (16, 32, 64)
_UNITS = {"": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}  # fmt: skip


def byte_count(text: str) -> int:
    """``--max-body``: bytes, with an optional K/M/G (KiB/MiB/GiB) suffix."""
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    unit = _UNITS.get(m.group(2).lower()) if m else None
    if m is None or unit is None:
        raise argparse.ArgumentTypeError(f"expected a number of bytes such as 4194304 or 4M, got {text!r}")
    v = int(m.group(1)) * unit
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a number of bytes > 0, got {text!r}")
    return v


def kv_memory(text: str) -> tuple[str, float]:
    """``--kv-memory``: ``("gib", x)`` for a size in GiB (``4``, ``4GiB``, ``0.5G``), or
    ``("fraction", x)`` for a share of the free GPU memory (``0.9f``, ``90%``)."""
    t = text.strip().lower()
    kind, number = "gib", t
    if t.endswith("%"):
        kind, number = "fraction", t[:-1]
    elif t.endswith("f"):
        kind, number = "fraction", t[:-1]
    else:
        for suffix in ("gib", "gb", "g"):
            if t.endswith(suffix):
                number = t[: -len(suffix)]
                break
    try:
        v = float(number)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected GiB (e.g. 4 or 4GiB) or a fraction of free GPU memory (e.g. 90% or 0.9f), got {text!r}"
        ) from None
    if kind == "fraction" and t.endswith("%"):
        v /= 100.0
    if not v > 0 or v != v or v == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a size > 0, got {text!r}")
    if kind == "fraction" and v > 1:
        raise argparse.ArgumentTypeError(f"a fraction of free GPU memory is at most 100%, got {text!r}")
    return kind, v


def memory_share(text: str) -> float:
    """``--gpu-memory-utilization``: a fraction in (0, 1]."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction of the GPU's memory in (0, 1], got {text!r}") from None
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction of the GPU's memory in (0, 1], got {text!r}")
    return v


def utilization_bytes(share: float, device: str) -> int:
    """The KV pool's bytes under ``--gpu-memory-utilization share`` (:func:`realizar.serving.remote.kv_share_bytes`),
    as a one-line error when it leaves no room."""
    from realizar.serving.remote import kv_share_bytes

    try:
        return kv_share_bytes(share, device)
    except InvalidRequestError as e:
        raise CliError(str(e)) from None


def kv_bytes(spec: tuple[str, float] | None, device: str) -> int | None:
    """The KV pool's bytes for ``--kv-memory`` on ``device`` (None: the engine's default)."""
    if spec is None:
        return None
    kind, v = spec
    if kind == "gib":
        return max(1, int(v * (1 << 30)))
    if not device.startswith("cuda"):
        raise CliError(f"--kv-memory as a fraction of free GPU memory needs a GPU (running on {device}); "
                       "give a size in GiB instead")  # fmt: skip
    from realizar import cuda

    free, _ = cuda.current_device().memory_info()
    return max(1, int(free * v))


def serving_options(args: argparse.Namespace, device: str) -> dict:
    """create_app's continuous-batching keywords from the command line, checked against ``device``."""
    memory = kv_bytes(args.kv_memory, device)
    if args.gpu_memory_utilization is not None:
        memory = utilization_bytes(args.gpu_memory_utilization, device)
    return {**_engine_options(args), "kv_memory": memory, "max_body": args.max_body}


def engine_process_options(args: argparse.Namespace) -> dict:
    """``build_serving``'s options (:mod:`realizar.serving.remote`) from the command line: a ``--kv-memory``
    share stays a share, sized in the engine process."""
    memory = None
    if args.gpu_memory_utilization is not None:
        if args.device in ("cpu", "emulate"):
            utilization_bytes(args.gpu_memory_utilization, args.device)  # (its one-line error)
        return {**_engine_options(args), "kv_memory": None, "gpu_memory_utilization": args.gpu_memory_utilization}
    if args.kv_memory is not None:
        kind, v = args.kv_memory
        if kind != "gib" and args.device in ("cpu", "emulate"):
            kv_bytes(args.kv_memory, args.device)  # (its one-line error)
        memory = max(1, int(v * (1 << 30))) if kind == "gib" else float(v)
    return {**_engine_options(args), "kv_memory": memory}


def _engine_options(args: argparse.Namespace) -> dict:
    return {"max_batch": args.max_batch, "block_size": args.block_size, "kv_dtype": args.kv_dtype,
            "max_batched_tokens": args.max_num_batched_tokens, "prefill_chunk": args.prefill_chunk,
            "f16_weights": {"auto": None, "on": True, "off": False}[args.f16_weights],
            "kv_events": args.kv_events, "kv_events_topic": args.kv_events_topic}  # fmt: skip


def connection_limits(args: argparse.Namespace):
    """The HTTP server's :class:`~realizar.server.connections.ConnectionLimits` from the command line."""
    from realizar.server.connections import ConnectionLimits

    return ConnectionLimits(max_connections=args.max_connections, header_timeout=args.header_timeout,
                            body_timeout=args.body_timeout)


def _refuse_tensor_parallel(args: argparse.Namespace) -> None:
    """``serve --tensor-parallel N`` (N > 1): the checks ``generate`` makes (a GPU device, a model that
    shards over N, N visible GPUs), then a refusal: the server's continuous batching
    (:class:`realizar.serving.ServingEngine`) runs on one GPU; the sharded model serves one sequence
    at a time (``generate``, :func:`realizar.engine.load_engine`), not a batch."""
    from realizar.errors import TensorParallelError
    from realizar.models.loader import load_model
    from realizar.parallel import check_tensor_parallel

    from realizar.models.hub import resolve_model

    n = args.tensor_parallel
    check_tensor_parallel(load_model(resolve_model(args.model)), n, args.device)
    raise TensorParallelError(
        f"serve --tensor-parallel {n}: continuous batching over a model split across GPUs is not built yet "
        f"(the server batches on one GPU); generate --tensor-parallel {n} and "
        f"load_engine(tensor_parallel={n}) run the split model"
    )


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise CliError(f"serving needs fastapi and uvicorn ({e}): pip install fastapi uvicorn") from None
    api_key = args.api_key if args.api_key is not None else os.environ.get("REALIZAR_API_KEY") or None
    if api_key is not None and (not api_key.strip() or any(c.isspace() for c in api_key)):
        raise CliError("--api-key (or REALIZAR_API_KEY) must be a non-empty key without spaces")
    if args.kv_memory is not None and args.gpu_memory_utilization is not None:
        raise CliError("give --kv-memory or --gpu-memory-utilization, not both", 2)
    if args.model is not None:  # a Hub id is downloaded (or found in the cache) before anything starts
        from realizar.models.hub import resolve_model

        resolve_model(args.model)
    if getattr(args, "tensor_parallel", 1) > 1:
        _refuse_tensor_parallel(args)
    if args.data_parallel > 1:
        from realizar.cli.data_parallel import serve_data_parallel

        return serve_data_parallel(args)
    if args.api_servers is None:
        from realizar.server.fronts import default_api_servers

        args.api_servers = default_api_servers() if args.engine_process else 1
    fronts = max(0, args.api_servers - 1)
    if fronts and not args.engine_process:
        raise CliError("--api-servers above 1 runs the server processes over one engine process: drop "
                       "--no-engine-process", 2)
    metrics_dir = None
    if fronts:
        import tempfile

        from realizar.server.metrics import share_between_processes

        metrics_dir = tempfile.mkdtemp(prefix="realizar-metrics-")
        share_between_processes(metrics_dir)
    try:
        return _serve(args, api_key, fronts)
    finally:
        if metrics_dir is not None:
            import shutil

            shutil.rmtree(metrics_dir, ignore_errors=True)


def _serve(args: argparse.Namespace, api_key: str | None, fronts: int) -> int:
    from realizar.server import serve

    if args.engine_process:
        engine, options = _start_engine_process(args, listen=bool(fronts))
        where = options["serving"].where
    else:
        engine = load_engine(args)
        options = serving_options(args, engine.device)
        where = engine.where
    engine.tokenizer.special_tokens_in_content = bool(args.allow_special_tokens_in_content)
    if args.host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        note(f"warning: listening on {args.host}, reachable beyond this machine, without an API key (--api-key)")

    def ready(host: str, port: int) -> None:
        shown = f"[{host}]" if ":" in host else host
        more = f", {fronts + 1} server processes" if fronts else ""
        page = f", chat page at http://{shown}:{port}/" if args.chat_page else ""
        note(f"serving {engine.name!r} ({where}{more}) at http://{shown}:{port}/v1{page} - Ctrl-C to stop")

    shared = {"model_name": args.model_name, "max_queue": args.max_queue,
              "default_max_tokens": args.default_max_tokens,
              "log_level": "debug" if args.verbose else args.log_level, "api_key": api_key,
              "limits": connection_limits(args), "drain_seconds": args.shutdown_grace,
              "allowed_origins": args.allowed_origins, "max_body": args.max_body, "chat_page": args.chat_page}
    from realizar.server import bind_socket
    from realizar.server.fronts import FrontSpec, join_fronts, signal_fronts, start_fronts

    procs: list = []
    wait = args.shutdown_grace + 10  # (the other server processes' drain, then their uvicorn's)

    def stopped(*_: Any) -> None:
        raise KeyboardInterrupt  # (uvicorn raises the SIGTERM it caught again once it has shut down)

    previous = signal.signal(signal.SIGTERM, stopped)
    try:
        sock = None
        if fronts:
            sock = bind_socket(args.host, args.port)
            serving = options["serving"]
            serving.warm_up()  # before any of them answers (their own warm-up is then a no-op)
            spec = FrontSpec(str(engine.path), engine.device, bool(args.allow_special_tokens_in_content))
            procs = start_fronts(fronts, sock, serving.address, spec, shared)
        # the others drain before this process's shutdown closes the engine they use
        serve(engine, args.host, args.port, on_ready=ready, sock=sock, on_shutdown=lambda: signal_fronts(procs),
              after_drain=(lambda: join_fronts(procs, wait)) if procs else None, **{**shared, **options})
    except KeyboardInterrupt:  # Ctrl-C (or SIGTERM) is how a server is stopped: uvicorn has shut down cleanly
        pass
    except OSError as e:
        raise CliError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal_fronts(procs)
        join_fronts(procs, wait)
    note("stopped")
    return 0


def _start_engine_process(args: argparse.Namespace, listen: bool = False) -> tuple:
    """``serve --engine-process``: this process reads the model's tokenizer and metadata; a child process loads
    the model and runs the engine (:class:`realizar.serving.remote.EngineProcess`). (front engine, serve's
    keywords)."""
    import functools
    import time

    from realizar.cli.common import status
    from realizar.engine import load_front
    from realizar.serving.remote import EngineProcess, build_serving

    options = engine_process_options(args)
    front = load_front(args.model)
    status(f"loading {front.name} in the engine process ...")
    t0 = time.perf_counter()
    serving = EngineProcess(functools.partial(build_serving, str(front.path), args.device,
                                              getattr(args, "max_context", None), options), listen=listen)
    front.device = serving.device
    status(f"loaded {front.name} on {serving.where} in {time.perf_counter() - t0:.1f} s (engine process)")
    return front, {"serving": serving, "max_body": args.max_body}


def register(command) -> None:
    """Add the subcommand's parser; ``command(name, help, description)`` makes one."""
    p = command("serve", "OpenAI-compatible HTTP server",
                "Serve the model over HTTP: POST /v1/completions, /v1/chat/completions (with streaming), /v1/messages (Anthropic), "
                "GET /v1/models, POST /tokenize, /detokenize, GET /health, /metrics, and a chat page at /. "
                "Binds to 127.0.0.1 unless told otherwise.")
    add_model_args(p)
    add_tensor_parallel_arg(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=port, default=8000, help="TCP port, 0 = any free port (default: 8000)")
    add_aliases(p, p.add_argument("--model-id", "--model-name", dest="model_name", metavar="ID", nargs="+",
                                  help="the model id clients use, then any aliases they may use too (default: the "
                                       "model file's or directory's name, without spaces; also --served-model-name)"),
                "--served-model-name")
    p.add_argument("--api-key", metavar="KEY",
                   help="answer 401 to /v1 and tokenize requests without 'Authorization: Bearer KEY' "
                        "(default: the REALIZAR_API_KEY environment variable; none: no key needed)")
    p.add_argument("--data-parallel", type=positive_int, default=1, metavar="N",
                   help="N replicas, one per GPU, behind sglang-router's cache-aware policy at --host/--port "
                        "(pip install 'realizar[cluster]'; with --device cpu, N replicas on the CPU) (default: 1)")
    p.add_argument("--max-connections", type=positive_int, default=1024, metavar="N",
                   help="HTTP connections held at most: at the limit a new one closes the oldest idle one (no request "
                        "in progress), or is answered 503 when all are busy (default: 1024)")
    p.add_argument("--header-timeout", type=positive_seconds, default=10.0, metavar="SECONDS",
                   help="a request's headers must arrive within this after the connection opens or the previous "
                        "response ends, else the connection is closed (default: 10)")
    p.add_argument("--body-timeout", type=positive_seconds, default=60.0, metavar="SECONDS",
                   help="a request's body must arrive within this after its headers, else the connection is closed "
                        "(default: 60)")
    p.add_argument("--allow-special-tokens-in-content", action="store_true",
                   help="let control-token text in chat messages (<|im_start|>system ...) become control tokens; by "
                        "default it is encoded as plain text, so a message cannot open or close turns")
    p.add_argument("--allowed-origins", nargs="+", default=[], metavar="ORIGIN",
                   help="browser origins (https://app.example) allowed to call the API cross-site, with CORS; '*' "
                        "for any (default: none: requests from other sites' pages are refused)")
    p.add_argument("--chat-page", action=argparse.BooleanOptionalAction, default=True,
                   help="serve a chat page at / (streaming, multi-turn, system prompt, sampling settings) that "
                        "talks to this server's API (default; --no-chat-page: / answers 404)")
    p.add_argument("--shutdown-grace", type=positive_seconds, default=4.0, metavar="SECONDS",
                   help="at SIGTERM or Ctrl-C, how long requests in flight may take to finish; the rest then end "
                        "with a 503 error (a stream: its error event and [DONE]) (default: 4)")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine (model, scheduler, sampling) in a process of its own, so the HTTP server's "
                        "work does not wait on the engine's and the engine's steps do not wait on the server "
                        "(default; --no-engine-process: one process)")
    p.add_argument("--api-servers", type=positive_int, metavar="N",
                   help="HTTP server processes sharing the port over the one engine process (each parses requests "
                        "and streams answers on its own event loop; /metrics from any reports all; --max-queue is "
                        "each one's) (default: one per 4 CPU cores, at most 4; 1 with --no-engine-process)")
    p.add_argument("--max-queue", type=positive_int, default=256, metavar="N",
                   help="requests allowed to wait beyond the running batch before answering 429 (default: 256)")
    add_aliases(p, p.add_argument("--max-batch", type=positive_int, default=_DEFAULTS.max_batch, metavar="N",
                                  help="sequences advanced together per decode step at most (also --max-num-seqs, "
                                       f"-np) (default: {_DEFAULTS.max_batch})"), "--max-num-seqs", "-np")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=_DEFAULTS.max_batched_tokens, metavar="N",
                   help="tokens one scheduler step processes at most: the decode rows plus the prompt tokens "
                        "prefilled meanwhile, so a burst of long prompts delays running streams by at most this "
                        f"much work a token (default: {_DEFAULTS.max_batched_tokens})")
    p.add_argument("--prefill-chunk", type=positive_int, default=_DEFAULTS.prefill_chunk, metavar="N",
                   help=f"prompt tokens through the layers at once at most (default: {_DEFAULTS.prefill_chunk})")
    p.add_argument("--f16-weights", choices=("auto", "on", "off"), default="auto",
                   help="f16 copies of the weights for decode steps of 33-64 rows (3.5x a Q4_K file's bytes): kept "
                        "when they fit in 40%% of free GPU memory (auto), always, or never (off: that memory goes to "
                        "the KV pool; on sm_90 steps above 64 rows read the quantized weights either way) "
                        "(default: auto)")
    p.add_argument("--kv-events", metavar="ENDPOINT",
                   help="publish the prefix cache's changes over ZeroMQ in vLLM's KV-event format (tcp://*:5557 "
                        "binds; pip install 'realizar[cluster]')")
    p.add_argument("--kv-events-topic", default="", metavar="TOPIC", help="the KV events' topic (default: none)")
    p.add_argument("--kv-memory", type=kv_memory, metavar="SIZE",
                   help="KV cache pool: GiB (4, 4GiB) or a fraction of free GPU memory (90%%, 0.9f) "
                        "(default: room for 8 full contexts on the CPU, the backend's choice on the GPU)")
    add_aliases(p, p.add_argument("--kv-dtype", choices=KV_FORMATS, metavar="{" + ",".join(KV_FORMATS) + "}",
                                  help="KV cache precision (also --kv-cache-dtype) (default: f16 on the GPU, f32 on "
                                       "the CPU; the CPU takes f32 or f16)"), "--kv-cache-dtype")
    p.add_argument("--block-size", type=int, choices=BLOCK_SIZES, default=_DEFAULTS.block_size, metavar="{16,32,64}",
                   help=f"positions per KV cache block (default: {_DEFAULTS.block_size})")
    p.add_argument("--max-body", type=byte_count, default=4 << 20, metavar="BYTES",
                   help="refuse request bodies over this size with 413, before reading them (default: 4M)")
    p.add_argument("--default-max-tokens", type=positive_int, metavar="N",
                   help="max_tokens of chat requests that give none (default: the rest of the context)")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn log level (default: info)")
    p.add_argument("--gpu-memory-utilization", type=memory_share, metavar="F",
                   help="vLLM's setting: the share of the GPU's total memory realizar may fill, model and KV cache "
                        "together; the KV pool gets what the loaded model leaves of it (instead of --kv-memory)")
    p.set_defaults(func=cmd_serve)
    env_defaults(p)  # REALIZAR_<FLAG> for every flag above
