"""``realizar generate`` (one prompt, streamed) and ``realizar chat`` (interactive, multi-turn)."""

from __future__ import annotations

import argparse
import sys

from realizar.cli.common import (
    PROG, CliError, add_model_args, add_sampling_args, add_tensor_parallel_arg, check_sampling, load_engine,
    sampling_params, summary, tty, write,
)


def cmd_generate(args: argparse.Namespace) -> int:
    prompt = args.prompt
    if prompt is None:
        if tty(sys.stdin):
            raise CliError("no prompt: give it as an argument or on standard input", 2)
        prompt = sys.stdin.read()
    if not prompt.strip() and not args.chat:
        raise CliError("the prompt is empty", 2)
    check_sampling(args)
    engine = load_engine(args)
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
    params = sampling_params(args, max_tokens)
    stream = engine.generator.stream(ids, params)
    try:
        if args.echo and not args.chat:
            write(prompt)
        for chunk in stream:
            write(chunk.text)
    finally:
        stream.close()
    result = stream.result
    if result is None or not result.text.endswith("\n"):
        write("\n")
    if result is not None and not args.no_stats:
        print(summary(result, engine.device), file=sys.stderr, flush=True)
    return 0


CHAT_HELP = "commands: /reset (forget the conversation), /exit or Ctrl-D (quit), /help"
CHAT_BLOCK_SIZE = 16  # KV block of the chat's serving engine: a turn recomputes < 16 cached positions


def _chat_serving(engine):
    """A one-sequence serving engine for ``engine`` whose prefix cache keeps the KV of earlier turns
    (each turn's prompt starts with the previous ones); None where the device has no batch backend
    (then every turn is prefilled whole by the plain generator)."""
    from realizar.errors import UnsupportedError
    from realizar.serving import ServingEngine

    try:
        return ServingEngine.from_engine(engine, max_batch=1, block_size=CHAT_BLOCK_SIZE)
    except UnsupportedError:
        return None


def _chat_turn(engine, serving, ids, params):
    """Generate one reply, streaming it to stdout: (its text, its GenerationResult or None, the
    prompt tokens prefilled and taken from the cache, or None without a serving engine)."""
    pieces: list[str] = []
    if serving is None:
        stream = engine.generator.stream(ids, params)
        try:
            for chunk in stream:
                pieces.append(chunk.text)
                write(chunk.text)
        except KeyboardInterrupt:
            write("\n")
        finally:
            stream.close()
        return "".join(pieces), stream.result, None
    before = serving.stats()
    handle = serving.submit(ids, params)
    try:
        for chunk in handle:
            pieces.append(chunk.text)
            write(chunk.text)
    except KeyboardInterrupt:
        handle.cancel()
        write("\n")
    after = serving.stats()
    result = handle.result if handle.finish_reason != "cancelled" else None
    counts = (after.prefilled_tokens - before.prefilled_tokens, after.cached_tokens - before.cached_tokens)
    return "".join(pieces), result, counts


def cmd_chat(args: argparse.Namespace) -> int:
    check_sampling(args)
    engine = load_engine(args)
    serving = _chat_serving(engine)
    try:
        return _chat_loop(args, engine, serving)
    finally:
        if serving is not None:
            serving.close()


def _chat_loop(args: argparse.Namespace, engine, serving) -> int:
    interactive = tty(sys.stdin)
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
        params = sampling_params(args, min(args.max_tokens, room))
        reply, result, counts = _chat_turn(engine, serving, ids, params)
        write("\n")
        history.append({"role": "assistant", "content": reply})
        if args.stats and result is not None:
            line = summary(result, engine.device)
            if counts is not None:
                line += f" [prompt: {counts[0]} prefilled, {counts[1]} from the cache]"
            print(line, file=sys.stderr, flush=True)


def register(command) -> None:
    """Add the subcommand's parser; ``command(name, help, description)`` makes one."""
    p = command("generate", "generate text from a prompt, streamed as it is produced",
                "Generate text from PROMPT (or standard input), streaming it to stdout, then print a "
                "one-line summary (tokens, prefill and decode speed, device) to stderr.")
    p.add_argument("prompt", nargs="?", metavar="PROMPT", help="the prompt (default: read standard input)")
    add_model_args(p)
    add_tensor_parallel_arg(p)
    add_sampling_args(p, temperature=0.0, top_p=1.0, max_tokens=64)
    p.add_argument("--chat", action="store_true",
                   help="wrap PROMPT as a user message in the model's chat template")
    p.add_argument("--system", metavar="TEXT", help="system message (with --chat)")
    p.add_argument("--echo", action="store_true", help="print the prompt before the generated text")
    p.add_argument("--no-stats", action="store_true", help="do not print the summary line")
    p.set_defaults(func=cmd_generate)

    p = command("chat", "interactive multi-turn chat",
                "Chat with the model using its chat template. Type a message and press Enter; "
                "/reset forgets the conversation, /exit or Ctrl-D quits. Reads lines from standard "
                "input when it is not a terminal.")
    add_model_args(p)
    add_sampling_args(p, temperature=0.7, top_p=0.9, max_tokens=512)
    p.add_argument("--system", metavar="TEXT", help="system message")
    p.add_argument("--stats", action="store_true", help="print a summary line after each reply")
    p.set_defaults(func=cmd_chat)
