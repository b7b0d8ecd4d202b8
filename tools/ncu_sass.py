"""Where a kernel's warps stall, per SASS instruction, from an ncu report (development tool).

    ncu --clock-control none --section WarpStateStats --section SourceCounters -k regex:NAME \
        -c 1 -o REP python ...
    ncu -i REP.ncu-rep --page source --csv --print-source sass > REP.csv
    python -m tools.ncu_sass REP.csv [TOP] [--chunks N]

Prints the stall samples by reason over the whole kernel (all samples; the "Not Issued"
columns, a subset of them, are left out), then the TOP (default 60) instructions with the most
samples: address, samples, % of all, the leading reasons, the instruction.

--chunks N: instead of the top list, the kernel's SASS in runs of N instructions (in address
order), each with its samples (% of all), its warp-level instructions executed, its leading
reasons and a count of marker opcodes (HGMMA, F2FP, LDG, STS, SYNCS, BAR, MUFU). Warp-specialised
kernels keep each warpgroup's code together, so the runs show which warpgroup spends what:
samples are in proportion to warp time, every resident warp being sampled alike (session 30
told the split kernel's and FlashMLA's producer, WG0 and WG1 apart this way).
"""

from __future__ import annotations

import csv
import sys
from collections import Counter

MARKERS = ("HGMMA", "F2FP", "LDG", "STS", "SYNCS", "BAR", "MUFU")


def _num(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def read_rows(path: str) -> list[dict]:
    """The per-instruction rows of an ncu source-page CSV (ncu writes the kernel's name and
    messages before the table's header row)."""
    with open(path, newline="") as f:
        lines = list(f)
    lines = lines[next(i for i, ln in enumerate(lines) if ln.startswith('"Address"')):]
    rows = list(csv.DictReader(lines))
    if not rows:
        raise SystemExit(f"{path}: no rows")
    return rows


def reasons(rows: list[dict]) -> list[str]:
    """The stall-reason columns over all samples (not the "(Not Issued)" subset)."""
    return [c for c in rows[0] if (c.startswith("stall_") or c.startswith("Stall "))
            and "Not Issued" not in c]


def leading(row_or_counter, cols, n: int = 3) -> str:
    """The n largest reasons, "name count" each."""
    if isinstance(row_or_counter, Counter):
        pairs = [(v, c) for c, v in row_or_counter.items()]
    else:
        pairs = [(_num(row_or_counter[c]), c) for c in cols]
    top = sorted(pairs, reverse=True)[:n]
    return ", ".join(f"{c.replace('stall_', '')} {v:.0f}" for v, c in top if v)


def chunks(rows: list[dict], size: int, total_col: str, cols: list[str], total: float) -> None:
    """The --chunks table (module docstring)."""
    print(f"{'from':>6} {'samples':>8} {'%':>6} {'executed':>12}  leading reasons  |  markers")
    for start in range(0, len(rows), size):
        part = rows[start:start + size]
        samples = sum(_num(r[total_col]) for r in part)
        executed = sum(_num(r.get("Instructions Executed", "0")) for r in part)
        why = Counter()
        for r in part:
            for c in cols:
                why[c] += _num(r[c])
        marks = {m: sum(m in r.get("Source", "") for r in part) for m in MARKERS}
        print(f"{start:6d} {samples:8.0f} {100 * samples / total:5.1f}% {executed:12.0f}  "
              f"{leading(why, cols)}  |  "
              + " ".join(f"{m} {v}" for m, v in marks.items() if v))


def main(argv: list[str]) -> None:
    size = 0
    if "--chunks" in argv:
        i = argv.index("--chunks")
        size = int(argv[i + 1])
        argv = argv[:i] + argv[i + 2:]
    path, top = argv[0], int(argv[1]) if len(argv) > 1 else 60
    rows = read_rows(path)
    total_col = next(c for c in rows[0] if c.startswith("Warp Stall Sampling (All"))
    cols = reasons(rows)
    total = sum(_num(r[total_col]) for r in rows) or 1.0
    by_reason = Counter({c: sum(_num(r[c]) for r in rows) for c in cols})
    print(f"{len(rows)} instructions, {total:.0f} samples")
    for c, v in by_reason.most_common(12):
        print(f"  {c:40s} {v:8.0f} {100 * v / total:5.1f}%")
    print()
    if size:
        chunks(rows, size, total_col, cols, total)
        return
    for r in sorted(rows, key=lambda r: -_num(r[total_col]))[:top]:
        print(f"{r.get('Address', '?'):>8} {_num(r[total_col]):7.0f} "
              f"{100 * _num(r[total_col]) / total:5.1f}%  {r.get('Source', '')[:70]:70s}  "
              f"{leading(r, cols)}")


if __name__ == "__main__":
    main(sys.argv[1:])
