"""Where a kernel's warps wait, from an Nsight Compute report with PC sampling (sections WarpStateStats and
SourceCounters): the stall reasons summed over the kernel, and the SASS instructions with the most samples.

    ncu --section WarpStateStats --section SourceCounters -o rep python ...   # then
    python tools/ncu_stalls.py rep.ncu-rep [--top 30] [--out stalls.md]

It reads ``ncu --import rep --page raw --csv`` (the metrics ``smsp__pcsamp_warps_issue_stalled_*``: samples a
reason) and ``ncu --import rep --page source --csv --print-source sass`` (a row an instruction). A column it does not
find is reported by the names the CSV has, so a changed format shows instead of failing.
"""

from __future__ import annotations

import argparse
import csv
import io
import re
import shutil
import subprocess
import sys
from pathlib import Path

_STALL = re.compile(r"^smsp__pcsamp_warps_issue_stalled_(\w+?)(?:_not_issued)?$")


def _csv_lines(text: str) -> str:
    """The CSV of ncu's output without its own ``==PROF==`` lines."""
    return "\n".join(ln for ln in text.splitlines() if ln.strip() and not ln.startswith("=="))


def _value(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def stall_reasons(raw_csv: str) -> list[tuple[str, float]]:
    """(reason, samples) from ``--page raw --csv`` (a header row, a units row, a row a kernel: all kernels summed),
    most first; the ``_not_issued`` variants folded into their reason."""
    rows = list(csv.reader(io.StringIO(_csv_lines(raw_csv))))
    if not rows:
        return []
    header, totals = rows[0], {}
    for row in rows[1:]:
        for name, cell in zip(header, row):
            m = _STALL.match(name)
            if m and re.match(r"^[\d.,]+$", cell.strip()):
                totals[m.group(1)] = totals.get(m.group(1), 0.0) + _value(cell)
    return sorted(totals.items(), key=lambda kv: -kv[1])


def _column(header: list[str], *words: str) -> int | None:
    for i, name in enumerate(header):
        if all(w.lower() in name.lower() for w in words):
            return i
    return None


def top_instructions(source_csv: str, top: int) -> tuple[list[str], list[list[str]]]:
    """(column names kept, rows) of the ``top`` SASS instructions by all warp-stall samples, from ``--page source
    --csv --print-source sass``; the rows are address, source text, samples and the sampled-not-issued count when
    the CSV has them."""
    rows = list(csv.reader(io.StringIO(_csv_lines(source_csv))))
    # (the header is the first row naming a source column: ncu prints a "Kernel Name" row before it)
    start = next((i for i, row in enumerate(rows) if _column(row, "source") is not None), 0)
    rows = rows[start:]
    if not rows:
        return [], []
    header = rows[0]
    keep = [_column(header, "address"), _column(header, "source"),
            _column(header, "sampling", "all"), _column(header, "sampling", "not", "issued")]
    if keep[1] is None or keep[2] is None:
        return header, []
    body = sorted(rows[1:], key=lambda r: -_value(r[keep[2]]) if len(r) > keep[2] else 0)
    idx = [i for i in keep if i is not None]
    return [header[i] for i in idx], [[r[i] if i < len(r) else "" for i in idx] for r in body[:top]]


def report(raw_csv: str, source_csv: str, top: int) -> list[str]:
    lines = ["### Stall reasons (PC samples, all warps)", ""]
    reasons = stall_reasons(raw_csv)
    if reasons:
        total = sum(v for _, v in reasons) or 1.0
        lines += ["| reason | samples | share |", "|---|---:|---:|"]
        lines += [f"| {name} | {v:,.0f} | {100 * v / total:.1f}% |" for name, v in reasons if v]
    else:
        lines.append("(no smsp__pcsamp_warps_issue_stalled_* metrics in the raw page)")
    lines += ["", f"### The {top} instructions with the most samples", ""]
    cols, rows = top_instructions(source_csv, top)
    if rows:
        lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in rows]
    else:
        lines.append(f"(no source and sampling columns; the CSV's columns: {', '.join(cols) or 'none'})")
    return lines


def _ncu(*args: str) -> str:
    ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    return subprocess.run([ncu, *args], capture_output=True, text=True, check=False).stdout


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report", type=Path, help="an .ncu-rep file")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    raw = _ncu("--import", str(a.report), "--page", "raw", "--csv")
    source = _ncu("--import", str(a.report), "--page", "source", "--csv", "--print-source", "sass")
    text = "\n".join([f"## {a.report.stem}", "", *report(raw, source, a.top)]) + "\n"
    print(text)
    if a.out:
        a.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
