"""Sum Nsight Compute's per-kernel CSV (``--metrics gpu__time_duration.sum --csv``) by kernel family: the kernel
name up to its shape suffix (``gemm_ws_q4_k_k4096_...`` -> ``gemm_ws``), with the launches and the µs of each.

    python tools/ncu_summary.py kernels.csv [--out summary.md]
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from collections import defaultdict
from pathlib import Path

# a family ends where the shape starts: a weight type, a dimension or a flag group of the catalog's names
_SHAPE = re.compile(r"_(?:q\d_[01k]|q\d_k|f16|bf16|f32|iq\w+|k\d+|d\d+|h\d+|n\d+|m\d+|b\d+|g\d+|t\d+|v\d+)(?:_|$)")


def family(name: str) -> str:
    base = name.split("(")[0].strip()
    m = _SHAPE.search(base)
    return base[:m.start()] if m else base


def _us(row: dict) -> float:
    value = float(row["Metric Value"].replace(",", ""))
    unit = row.get("Metric Unit", "nsecond")
    return value / 1e3 if unit.startswith("n") else value if unit.startswith("u") else value * 1e3


def times_table(times: list[tuple[str, float]], top: int | None = None) -> list[str]:
    """The family table (launches, µs, share of all) and the kernel table (the ``top`` longest, else every kernel) of
    (kernel name, µs) pairs, one a launch."""
    per: dict[str, list[float]] = defaultdict(list)
    by_name: dict[str, list[float]] = defaultdict(list)
    for name, us in times:
        per[family(name)].append(us)
        by_name[name].append(us)
    total = sum(sum(v) for v in per.values())
    out = ["| kernel family | launches | µs | share |", "|---|---:|---:|---:|"]
    for fam, v in sorted(per.items(), key=lambda kv: -sum(kv[1])):
        out.append(f"| {fam} | {len(v)} | {sum(v):.1f} | {100 * sum(v) / total:.1f}% |")
    out.append(f"| all | {len(times)} | {total:.1f} | 100% |")
    out += ["", f"| kernel{f' (the {top} longest in all)' if top else ''} | launches | µs |", "|---|---:|---:|"]
    for name, v in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]:
        out.append(f"| `{name}` | {len(v)} | {sum(v):.1f} |")
    return out


def summarize(rows: list[dict]) -> list[str]:
    return times_table([(r["Kernel Name"].split("(")[0].strip(), _us(r)) for r in rows
                        if r.get("Metric Name") == "gpu__time_duration.sum"], top=20)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", type=Path)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    text = a.csv.read_text()
    start = text.find('"ID"')  # (ncu prints its own lines and the program's before the CSV)
    rows = list(csv.DictReader(text[start:].splitlines())) if start >= 0 else []
    if not rows:
        print(f"no ncu CSV rows in {a.csv}", file=sys.stderr)
        return 2
    lines = summarize(rows)
    print("\n".join(lines))
    if a.out:
        a.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
