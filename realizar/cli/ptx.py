"""``realizar ptx``: list, emit, check (ptxas -v), disassemble and diff the kernel catalog, and run a kernel
on the CPU PTX emulator."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

from realizar.cli.common import CliError, add_common, nonneg_int, note


def _shape_arg(items: Sequence[str] | None, kernel: str | None = None) -> dict:
    """``-s NAME=VALUE`` items as a shape. With ``kernel``, each value is converted to the type of that
    kernel's parameter, and an unknown parameter or a value that does not parse (``in_dim=abc``) is a
    one-line usage error naming the parameter."""
    from ptx_gen import catalog

    try:
        if kernel is None:
            return catalog.parse_shape(items or [])
        return catalog.parse_shape_arg(kernel, items or [])
    except KeyError as e:  # no such kernel
        raise CliError(str(e).strip("'\""), 1) from None
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

    text = ptx_text(args.kernel, args.target, **_shape_arg(args.shape, args.kernel))
    if args.output:
        Path(args.output).write_text(text)
        note(f"wrote {args.output} ({len(text):,} bytes)")
    else:
        sys.stdout.write(text)
    return 0


def cmd_ptx_check(args: argparse.Namespace) -> int:
    from ptx_gen import inspect as ptx_tools

    targets = args.target or list(ptx_tools.CHECK_TARGETS)
    if args.kernel and not args.grid:
        shape = _shape_arg(args.shape, args.kernel)
        results = [ptx_tools.check(args.kernel, t, **shape) for t in targets]
    else:
        if args.shape:
            raise CliError("--shape needs a KERNEL (and not --grid)", 2)
        results = ptx_tools.check_all(targets, [args.kernel] if args.kernel else None,
                                       progress=sys.stderr.isatty())
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

    sys.stdout.write(sass(args.kernel, args.target, **_shape_arg(args.shape, args.kernel)))
    return 0


def cmd_ptx_diff(args: argparse.Namespace) -> int:
    from ptx_gen.inspect import diff

    a, b = _shape_arg([args.shape_a], args.kernel), _shape_arg([args.shape_b], args.kernel)
    out = diff(args.kernel, a, b, target=args.target, target_b=args.target_b, context=args.context)
    if out:
        sys.stdout.write(out)
    else:
        note("the two variants generate identical PTX")
    return 0


def cmd_ptx_run(args: argparse.Namespace) -> int:
    from ptx_gen.emulator import run_example

    try:
        report = run_example(args.kernel, _shape_arg(args.shape), target=args.target, seed=args.seed)
    except KeyError as e:  # no such kernel
        raise CliError(str(e).strip("'\""), 1) from None
    except (ValueError, TypeError) as e:
        raise CliError(str(e), 2) from None
    print(f"{report.kernel} {report.shape} grid {report.grid} block {report.block} shared {report.shared_bytes}")
    for line in report.summary():
        print(line, file=sys.stdout if report.ok else sys.stderr)
    return 0 if report.ok else 1


def register(command) -> None:
    """Add the subcommand's parser; ``command(name, help, description)`` makes one."""
    from ptx_gen.target import DEFAULT_TARGET, SUPPORTED_TARGETS

    p = command("ptx", "inspect the PTX kernel catalog",
                "List, emit, assemble (ptxas -v), disassemble and diff the generated PTX kernels.")
    psub = p.add_subparsers(dest="ptx_command", metavar="ACTION", required=True)

    def ptx_action(name: str, help: str, description: str | None = None) -> argparse.ArgumentParser:
        q = psub.add_parser(name, help=help, description=description or help)
        add_common(q)
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
    q.add_argument("-U", "--context", type=nonneg_int, default=3, metavar="N", help="context lines (default: 3)")
    q.set_defaults(func=cmd_ptx_diff)

    q = ptx_action("run", "run one kernel on random inputs on the CPU PTX emulator (no GPU needed)")
    q.add_argument("kernel", metavar="KERNEL")
    q.add_argument("-s", "--shape", action="append", metavar="NAME=VALUE",
                   help=shape_help + "; also problem sizes of the example (n, tokens, seq_len, ...)")
    q.add_argument("--target", default=DEFAULT_TARGET, help=target_help)
    q.add_argument("--emulate", action="store_true", default=True,
                   help="run on the CPU PTX emulator (the only mode: accepted, not needed)")
    q.add_argument("--seed", type=nonneg_int, default=0, help="random seed of the inputs (default: 0)")
    q.set_defaults(func=cmd_ptx_run)
