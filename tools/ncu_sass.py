"""Where a kernel's warps stall, per SASS instruction, from an ncu report (development tool).

    ncu --clock-control none --section WarpStateStats --section SourceCounters -k regex:NAME \
        -c 1 -o REP python ...
    ncu -i REP.ncu-rep --page source --csv --print-source sass > REP.csv
    python -m tools.ncu_sass REP.csv [TOP]

Prints the stall samples by reason over the whole kernel, then the TOP (default 60) instructions
with the most samples: address, samples, % of all, the leading reasons, the instruction.
"""

from __future__ import annotations

import csv
import sys
from collections import Counter


def _num(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main(argv: list[str]) -> None:
    path, top = argv[0], int(argv[1]) if len(argv) > 1 else 60
    with open(path, newline="") as f:
        lines = list(f)
    # (the table starts at its header row: ncu writes the kernel's name and messages before it)
    lines = lines[next(i for i, ln in enumerate(lines) if ln.startswith('"Address"')):]
    rows = list(csv.DictReader(lines))
    if not rows:
        raise SystemExit(f"{path}: no rows")
    cols = list(rows[0])
    total_col = next(c for c in cols if c.startswith("Warp Stall Sampling (All"))
    reason_cols = [c for c in cols if c.startswith("stall_") or c.startswith("Stall ")]
    total = sum(_num(r[total_col]) for r in rows) or 1.0
    by_reason = Counter({c: sum(_num(r[c]) for r in rows) for c in reason_cols})
    print(f"{len(rows)} instructions, {total:.0f} samples")
    for c, v in by_reason.most_common(12):
        print(f"  {c:40s} {v:8.0f} {100 * v / total:5.1f}%")
    print()
    for r in sorted(rows, key=lambda r: -_num(r[total_col]))[:top]:
        lead = sorted(((_num(r[c]), c) for c in reason_cols), reverse=True)[:3]
        why = ", ".join(f"{c.replace('stall_', '')} {v:.0f}" for v, c in lead if v)
        print(f"{r.get('Address', '?'):>8} {_num(r[total_col]):7.0f} "
              f"{100 * _num(r[total_col]) / total:5.1f}%  {r.get('Source', '')[:70]:70s}  {why}")


if __name__ == "__main__":
    main(sys.argv[1:])
