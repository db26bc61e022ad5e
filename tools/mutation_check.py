"""Mutation check: does the fast test suite catch deliberate bugs in the product code?

Each mutation below names one file of the product code (``realizar/``, ``ptx_gen/``), an exact source
snippet that must occur exactly once in it, and the snippet's replacement: a small, plausible bug (a
flipped sign in a block decoder, a dropped causal mask, an off-by-one in a block table, a skipped
stop check, a leaked KV block). For each mutation the script exports a fresh copy of the tree into a
temporary directory (``git archive HEAD``; ``--worktree``: the tracked files as they are in the working
tree), applies the mutation there and runs the fast suite in that copy::

    python -m pytest -q -x -p no:cacheprovider [TESTS]

with the copy as the working directory and first on ``PYTHONPATH`` (checked: ``realizar`` and
``ptx_gen`` must import from the copy, not from an installed package); the repository's pytest
``addopts`` (``-n auto``) apply. A mutation is *caught* when pytest exits non-zero; the first
failing test id comes from the ``FAILED`` lines of the short summary. Before the mutations, the same
command runs once on an unmutated copy (the baseline; ``--skip-baseline`` skips it): when that
already fails, every mutation would look caught, so the script stops there.

Guards against testing nothing: a snippet that does not occur exactly once (the code moved or
changed) is an error, reported before any test runs; a mutation of a PTX emitter lists catalog
kernels (``probe``) whose emitted PTX it must change, and the script checks that it does.

Every change to emitted PTX also fails ``tests/test_ptx_hashes.py`` (the PTX of every catalog case is
pinned by hash), so with the whole fast suite the PTX mutations are caught by that pin at the least. To
see whether the behavioural tests catch them too, leave it out::

    python tools/mutation_check.py --tests "tests --ignore=tests/test_ptx_hashes.py"

Run it (the whole fast suite per mutation, a Markdown log)::

    python tools/mutation_check.py --out docs/results/mutation_check.md

Quick checks: ``--only NAME[,NAME]`` picks mutations, ``--tests "tests/a.py tests/b.py"`` runs those
test paths (any pytest arguments) instead of the whole fast suite, ``--check`` only exports, applies
and probes (no pytest), ``--list`` lists the mutations, ``--save-output DIR`` keeps each run's pytest
output. Exit status: 0 when every mutation is caught, 1 when one is missed, 2 on an error (a snippet
not found once, a probe unchanged, a failing baseline, imports not from the copy).
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTEST = ["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"]


@dataclass(frozen=True)
class Mutation:
    """One deliberate bug: replace ``old`` (exactly one occurrence in ``path``, relative to the repository
    root) by ``new``. ``probe``: catalog kernels ``(name, shape)`` whose PTX (``ptx_gen.catalog.emit``)
    the mutation must change."""

    name: str
    description: str
    path: str
    old: str
    new: str
    probe: tuple[tuple[str, dict], ...] = field(default=())


MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        name="gemv-q4_0-sign",
        description="Q4_0 codes decode as d * (8 - q) instead of d * (q - 8) in the PTX block decoder "
                    "(quant_layout._small_codes: SIMT GEMV, quantized GEMM and dequant kernels)",
        path="ptx_gen/kernels/gemv/quant_layout.py",
        old=(
            "    if wtype in (\"Q4_0\", \"Q5_0\"):\n"
            "        # the code offset is half / 2 (8 or 16): d (n - half/2) = d (2 half f - 1.5 half)\n"
            "        return Decoded(fs, d, 2 * half, -1.5 * half)\n"
        ),
        new=(
            "    if wtype == \"Q4_0\":\n"
            "        return Decoded(fs, d, -2 * half, 1.5 * half)\n"
            "    if wtype == \"Q5_0\":\n"
            "        return Decoded(fs, d, 2 * half, -1.5 * half)\n"
        ),
        probe=(("gemv", {"wtype": "Q4_0", "in_dim": 4096}),
               ("dequant_f16", {"wtype": "Q4_0", "in_dim": 4096})),
    ),
    Mutation(
        name="paged-causal-mask",
        description="the tensor-core prefill attention no longer masks keys past the query position "
                    "inside a key tile (flash_attention_mma._softmax_update)",
        path="ptx_gen/kernels/attention/flash_attention_mma.py",
        old=(
            "                if causal:\n"
            "                    bad = k.or_(bad, k.setp(\"gt\", key, pos[h]))\n"
        ),
        new=(
            "                if False:\n"
            "                    bad = k.or_(bad, k.setp(\"gt\", key, pos[h]))\n"
        ),
        probe=(("paged_prefill_attention",
                {"head_dim": 128, "group": 4, "causal": True, "block_size": 32, "kv_dtype": "f16"}),
               ("flash_attention_mma", {"head_dim": 64, "group": 3, "causal": True})),
    ),
    Mutation(
        name="paged-block-table-off-by-one",
        description="paged decode attention reads the block id of position p + 1 instead of p "
                    "(paged_decode._pass: the wrong block for the last row of every block)",
        path="ptx_gen/kernels/attention/paged_decode.py",
        old="page = k.load(\"global\", \"u32\", k.add(table, k.mul_wide(k.shr(rc, log2(block_size)), 4)))\n",
        new="page = k.load(\"global\", \"u32\", k.add(table, k.mul_wide(k.shr(k.add(rc, 1, \"u32\"), "
            "log2(block_size)), 4)))\n",
        probe=(("paged_decode_attention", {"head_dim": 128, "group": 4, "block_size": 32, "kv_dtype": "f16",
                                           "out_f16": False, "unroll": 2}),),
    ),
    Mutation(
        name="stop-check-skipped",
        description="SequenceState.accept ignores EOS / stop token ids (generation runs on past them)",
        path="realizar/generation.py",
        old=(
            "        if tok in self.stop_ids:\n"
            "            self.finish_reason, self.finished = \"stop\", True\n"
        ),
        new=(
            "        if False:\n"
            "            self.finish_reason, self.finished = \"stop\", True\n"
        ),
    ),
    Mutation(
        name="block-pool-leak",
        description="BlockPool.free does not return an uncached block to the free list when its last "
                    "holder lets go (the KV pool leaks blocks)",
        path="realizar/serving/blocks.py",
        old=(
            "                if b in self._key:\n"
            "                    self._evictable[b] = None\n"
            "                else:\n"
            "                    self._free.append(b)\n"
        ),
        new=(
            "                if b in self._key:\n"
            "                    self._evictable[b] = None\n"
        ),
    ),
)


class CheckError(Exception):
    """A mutation that cannot be tested as written (snippet not found once, probe unchanged, ...)."""


@dataclass
class Outcome:
    name: str
    description: str
    caught: bool
    seconds: float
    first_failure: str
    timed_out: bool = False
    output: str = ""


# -------------------------------------------------------------------------------------------------
# the copy of the tree


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout


def export_tree(dest: Path, worktree: bool) -> None:
    """The committed tree (``git archive HEAD``) or, with ``worktree``, the tracked files as they are in
    the working tree, into ``dest`` (an empty directory)."""
    if not worktree:
        archive = subprocess.run(["git", "archive", "--format=tar", "HEAD"], cwd=ROOT, check=True,
                                 capture_output=True).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(dest, filter="data")
        return
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True).stdout
    for rel in filter(None, listed.decode().split("\0")):
        src = ROOT / rel
        if not src.exists() and not src.is_symlink():  # deleted in the working tree
            continue
        if src.is_dir():  # a submodule
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target, follow_symlinks=False)


def apply_mutation(m: Mutation, tree: Path) -> None:
    """Replace the mutation's snippet in ``tree``; :class:`CheckError` unless it occurs exactly once."""
    f = tree / m.path
    if not f.is_file():
        raise CheckError(f"{m.name}: {m.path} does not exist in the tree")
    text = f.read_text()
    count = text.count(m.old)
    if count != 1:
        first = m.old.strip().splitlines()[0]
        raise CheckError(f"{m.name}: the snippet starting {first!r} occurs {count} times in {m.path} "
                         f"(it must occur exactly once; update the mutation to follow the code)")
    f.write_text(text.replace(m.old, m.new))


def copy_env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    old = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(tree) + (os.pathsep + old if old else "")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def run_python(tree: Path, code: str) -> str:
    """Run ``python -c code`` in ``tree`` (first on the path); its stdout, :class:`CheckError` on failure."""
    p = subprocess.run([sys.executable, "-c", code], cwd=tree, env=copy_env(tree), capture_output=True, text=True)
    if p.returncode != 0:
        raise CheckError(f"python -c in {tree} failed:\n{p.stdout}{p.stderr}")
    return p.stdout


def check_imports(tree: Path) -> None:
    """``realizar`` and ``ptx_gen`` must import from ``tree``, not from an installed copy."""
    out = run_python(tree, "import ptx_gen, realizar; print(ptx_gen.__file__); print(realizar.__file__)")
    for line in out.split():
        if not Path(line).resolve().is_relative_to(tree.resolve()):
            raise CheckError(f"the copy imports {line}, outside {tree}: the mutated code would not be tested")


PROBE_CODE = """
import hashlib, json, sys
from ptx_gen import catalog
for name, shape in json.loads(sys.argv[1]):
    print(name, hashlib.sha256(catalog.emit(name, **shape).ptx.encode()).hexdigest())
"""


def probe_hashes(tree: Path, m: Mutation) -> list[str]:
    p = subprocess.run([sys.executable, "-c", PROBE_CODE, json.dumps([list(x) for x in m.probe])], cwd=tree,
                       env=copy_env(tree), capture_output=True, text=True)
    if p.returncode != 0:
        raise CheckError(f"{m.name}: emitting the probe kernels failed:\n{p.stdout}{p.stderr}")
    return p.stdout.splitlines()


def prepare(m: Mutation | None, tree: Path, worktree: bool) -> None:
    """A fresh copy in ``tree`` with ``m`` applied (None: unmutated), its imports and probes checked."""
    export_tree(tree, worktree)
    check_imports(tree)
    if m is None:
        return
    before = probe_hashes(tree, m) if m.probe else []
    apply_mutation(m, tree)
    if m.probe:
        after = probe_hashes(tree, m)
        unchanged = [a.split()[0] for a, b in zip(after, before) if a == b]
        if unchanged:
            raise CheckError(f"{m.name}: the PTX of {', '.join(unchanged)} is unchanged by the mutation "
                             f"(it would test nothing there)")


# -------------------------------------------------------------------------------------------------
# running the suite


SUMMARY_LINE = re.compile(r"^(FAILED|ERROR) (.+?)(?: - .*)?$")


def first_failure(output: str) -> str:
    """The first test id of the short summary's FAILED lines (else its ERROR lines), else ''."""
    found = {"FAILED": "", "ERROR": ""}
    for line in output.splitlines():
        hit = SUMMARY_LINE.match(line.strip())
        if hit and not found[hit.group(1)]:
            found[hit.group(1)] = hit.group(2).strip()
    return found["FAILED"] or found["ERROR"]


def pytest_command(tests: list[str]) -> list[str]:
    return [sys.executable, *PYTEST, *tests]


def run_suite(tree: Path, tests: list[str], timeout: float) -> tuple[int | None, str, float]:
    """(pytest's exit code, None on timeout; its output; seconds) of the suite in ``tree``."""
    t0 = time.monotonic()
    p = subprocess.Popen(pytest_command(tests), cwd=tree, env=copy_env(tree), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
        code: int | None = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)  # pytest and its xdist workers (their own session)
        out, _ = p.communicate()
        code = None
    except BaseException:  # interrupted (Ctrl-C, SIGTERM): leave no pytest running in the copy
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        raise
    return code, out, time.monotonic() - t0


def run_one(m: Mutation | None, tests: list[str], worktree: bool, timeout: float, keep: bool) -> Outcome:
    """Prepare a fresh mutated copy and run the suite there."""
    tree = Path(tempfile.mkdtemp(prefix=f"mutation-{m.name if m else 'baseline'}-"))
    try:
        prepare(m, tree, worktree)
        code, out, seconds = run_suite(tree, tests, timeout)
    finally:
        if keep:
            print(f"  (copy kept at {tree})")
        else:
            shutil.rmtree(tree, ignore_errors=True)
    name, desc = (m.name, m.description) if m else ("(baseline)", "nothing: the unmutated tree")
    if code is None:
        return Outcome(name, desc, True, seconds, f"(timed out after {timeout:.0f} s)", True, out)
    fail = first_failure(out) if code else ""
    if code and not fail:
        fail = f"(exit {code}, no FAILED line)"
    return Outcome(name, desc, code != 0, seconds, fail, False, out)


# -------------------------------------------------------------------------------------------------
# report


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(outcomes: list[Outcome], baseline: Outcome | None, tests: list[str], worktree: bool) -> str:
    commit = git("rev-parse", "--short", "HEAD").strip()
    source = "the tracked files of the working tree" if worktree else "`git archive HEAD`"
    command = shlex.join(["python", *PYTEST, *tests])
    missed = [o for o in outcomes if not o.caught]
    lines = [
        "# Mutation check",
        "",
        "Generated by `tools/mutation_check.py`: each mutation is applied to a fresh copy of the tree "
        f"({source}) and the tests run there (the copy as working directory and first on `PYTHONPATH`, "
        "the repository's pytest `addopts` apply). Caught: pytest exits non-zero.",
        "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- commit: `{commit}`" + (" (working tree)" if worktree else ""),
        f"- command: `{command}`",
    ]
    if baseline is not None:
        lines.append(f"- baseline (unmutated copy): {'failed' if baseline.caught else 'passed'} "
                     f"in {baseline.seconds:.0f} s")
    else:
        lines.append("- baseline: skipped")
    lines += ["", "| name | what it breaks | caught | first failing test | seconds |", "|---|---|---|---|---|"]
    for o in outcomes:
        caught = ("yes (timeout)" if o.timed_out else "yes") if o.caught else "**MISSED**"
        lines.append(f"| `{o.name}` | {cell(o.description)} | {caught} | "
                     f"{('`' + cell(o.first_failure) + '`') if o.first_failure else '-'} | {o.seconds:.0f} |")
    if missed:
        lines += ["", "Missed: " + ", ".join(f"`{o.name}`" for o in missed) + "."]
    lines += ["", summary(outcomes), ""]
    return "\n".join(lines)


def summary(outcomes: list[Outcome]) -> str:
    caught = sum(o.caught for o in outcomes)
    return (f"Summary: {caught} of {len(outcomes)} mutations caught"
            + ("." if caught == len(outcomes) else f", {len(outcomes) - caught} MISSED."))


# -------------------------------------------------------------------------------------------------
# command line


def save_output(folder: Path | None, o: Outcome) -> None:
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{o.name.strip('()')}.txt").write_text(o.output)


def select(only: str | None) -> list[Mutation]:
    if not only:
        return list(MUTATIONS)
    by_name = {m.name: m for m in MUTATIONS}
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise CheckError(f"unknown mutation(s) {', '.join(unknown)}; known: {', '.join(by_name)}")
    return [by_name[n] for n in names]


def check_snippets(chosen: list[Mutation], worktree: bool) -> None:
    """Every chosen snippet occurs exactly once in one export of the tree (before any test runs)."""
    tree = Path(tempfile.mkdtemp(prefix="mutation-snippets-"))
    try:
        export_tree(tree, worktree)
        pristine = {m.path: (tree / m.path).read_text() for m in chosen if (tree / m.path).is_file()}
        for m in chosen:
            apply_mutation(m, tree)
            (tree / m.path).write_text(pristine[m.path])
    finally:
        shutil.rmtree(tree, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", metavar="NAME[,NAME]", help="run only these mutations")
    ap.add_argument("--tests", metavar="PATHS", default="",
                    help="space-separated test paths (or other pytest arguments) instead of the whole fast suite")
    ap.add_argument("--out", metavar="FILE", type=Path, help="write a Markdown log here")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    ap.add_argument("--worktree", action="store_true",
                    help="copy the tracked files of the working tree instead of exporting HEAD")
    ap.add_argument("--check", action="store_true",
                    help="only export, apply and probe each mutation (no tests)")
    ap.add_argument("--skip-baseline", action="store_true", help="do not run the tests on an unmutated copy first")
    ap.add_argument("--timeout", type=float, default=3600.0, metavar="S",
                    help="seconds per pytest run; a run past it counts as caught and is marked (default 3600)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary copies (their paths are printed)")
    ap.add_argument("--save-output", metavar="DIR", type=Path, help="write each run's pytest output to DIR/NAME.txt")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: kill the running suite, remove the copy

    if args.list:
        for m in MUTATIONS:
            print(f"{m.name:32s} {m.path}\n{'':32s} {m.description}")
        return 0
    tests = shlex.split(args.tests)
    try:
        chosen = select(args.only)
        check_snippets(chosen, args.worktree)
        if args.check:
            for m in chosen:
                tree = Path(tempfile.mkdtemp(prefix=f"mutation-{m.name}-"))
                try:
                    prepare(m, tree, args.worktree)
                finally:
                    shutil.rmtree(tree, ignore_errors=True)
                print(f"{m.name}: applies" + (f", changes the PTX of {len(m.probe)} probe kernel(s)"
                                               if m.probe else ""))
            return 0
        print(f"command: {shlex.join(pytest_command(tests))}", flush=True)
        baseline = None
        if not args.skip_baseline:
            baseline = run_one(None, tests, args.worktree, args.timeout, args.keep)
            print(f"(baseline): {'FAILED' if baseline.caught else 'passed'} in {baseline.seconds:.0f} s", flush=True)
            save_output(args.save_output, baseline)
            if baseline.caught:
                print(baseline.output[-6000:], file=sys.stderr)
                raise CheckError("the tests fail on the unmutated tree: every mutation would look caught "
                                 f"(first failure: {baseline.first_failure})")
        outcomes = []
        for m in chosen:
            o = run_one(m, tests, args.worktree, args.timeout, args.keep)
            outcomes.append(o)
            save_output(args.save_output, o)
            state = ("caught (timeout)" if o.timed_out else "caught") if o.caught else "MISSED"
            print(f"{m.name}: {state} in {o.seconds:.0f} s" + (f" by {o.first_failure}" if o.first_failure else ""),
                  flush=True)
    except CheckError as e:
        print(f"mutation_check: error: {e}", file=sys.stderr)
        return 2
    print(summary(outcomes))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(markdown(outcomes, baseline, tests, args.worktree))
        print(f"log written to {args.out}")
    return 0 if all(o.caught for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
