"""The emitted PTX of every catalog kernel, grid shape and target, pinned by hash.

``tests/data/ptx_hashes.json`` maps ``"kernel|shape|target"`` (the grid shape as sorted JSON) to the
sha256 of the PTX text :func:`ptx_gen.catalog.emit` gives for it. The test emits every case again
(no ptxas) and compares the whole mapping: every key present, none extra, every hash equal. A
refactoring (moving modules, renaming helpers, reflowing comments) must leave it passing untouched.

A deliberate kernel change (or a grid change) regenerates the file with::

    python tests/test_ptx_hashes.py --write

and commits it together with the change, saying in the commit message why the PTX changed.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from ptx_gen import catalog  # noqa: E402

TARGETS = ("sm_80", "sm_89", "sm_90")  # the targets of tests/test_ptx_catalog.py
HASHES = Path(__file__).resolve().parent / "data" / "ptx_hashes.json"


def case_key(name: str, shape: dict, target: str) -> str:
    return f"{name}|{json.dumps(shape, sort_keys=True)}|{target}"


def current_hashes() -> dict[str, str]:
    """sha256 of the PTX of every (kernel, grid shape, target) of the catalog, by :func:`case_key`."""
    out: dict[str, str] = {}
    for name in catalog.names():
        for shape in catalog.spec(name).grid:
            for target in catalog.targets(catalog.spec(name), TARGETS):
                key = case_key(name, dict(shape), target)
                assert key not in out, f"grid case {key} appears twice"
                ptx = catalog.emit(name, target=target, **shape).ptx
                out[key] = hashlib.sha256(ptx.encode()).hexdigest()
    return out


def test_ptx_of_every_catalog_case_is_unchanged():
    pinned = json.loads(HASHES.read_text())
    now = current_hashes()
    missing = sorted(set(pinned) - set(now))
    extra = sorted(set(now) - set(pinned))
    changed = sorted(k for k in set(pinned) & set(now) if pinned[k] != now[k])

    def kernels(keys):
        return sorted({k.split("|", 1)[0] for k in keys})

    problems = []
    if changed:
        problems.append(f"PTX changed for kernels {kernels(changed)} ({len(changed)} cases), e.g. {changed[:5]}")
    if missing:
        problems.append(f"pinned cases no longer in the grid for kernels {kernels(missing)}: {missing[:5]}")
    if extra:
        problems.append(f"grid cases not pinned for kernels {kernels(extra)}: {extra[:5]}")
    assert not problems, (
        "; ".join(problems)
        + ". If the change is deliberate, run `python tests/test_ptx_hashes.py --write` and say why in the commit."
    )


def write() -> int:
    hashes = current_hashes()
    HASHES.parent.mkdir(parents=True, exist_ok=True)
    HASHES.write_text(json.dumps(hashes, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(hashes)} hashes to {HASHES}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        print(f"usage: python {sys.argv[0]} --write   (regenerate {HASHES.name})", file=sys.stderr)
        sys.exit(2)
    sys.exit(write())
