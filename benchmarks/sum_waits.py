"""Where a ring's batch norm sums wait, from the timings its workers wrote with
``HETCONV_SUM_LOG=DIR`` set (hetconv/worker/sumlog.py; every process on one host's clock).

For every sum that all ranks of a step took, split each rank's wait:
- ``late``: until the last rank began the sum (the ranks' compute before it, unequal);
- ``last own``: the last rank's own sum (its parts out, the others' in, its software);
- ``part way``: from a sender beginning the sum to its part's filing at a receiver (the
  sender's software, the link, the receiver's reading thread getting a core).

Rows for the first and second half of each step's sums (with batch norm: forward, backward),
means in ms (the part's way: median and 90th percentile), steps after ``--skip``.

    HETCONV_SUM_LOG=/tmp/sums python benchmarks/testbed.py --network resnet20 --batch 64 \\
        --workers 4 --link switched --modes images_ring_unchecked --steps 6 --warmup 2
    python benchmarks/sum_waits.py /tmp/sums [--skip 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def read(folder: Path):
    """({(session, step, offset, rank): (began, ended, pid)}, {(session, step, round, pid):
    filed})."""
    sums, parts = {}, {}
    for path in sorted(folder.glob("*.txt")):
        pid = path.stem
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            fields = line.split()
            try:
                if fields[0] == "S":
                    session, step, offset, rank = map(int, fields[1:5])
                    sums[(session, step, offset, rank)] = (float(fields[5]), float(fields[6]), pid)
                elif fields[0] == "F":
                    session, step, round_ = map(int, fields[1:4])
                    parts[(session, step, round_, pid)] = float(fields[4])
                else:
                    raise ValueError(fields[0])
            except (IndexError, ValueError):
                raise SystemExit(f"{path}:{number}: not a sum log line: {line!r}") from None
    return sums, parts


def rows(sums: dict, parts: dict, skip: int) -> list[dict]:
    by_sum: dict[tuple, dict] = {}
    for (session, step, offset, rank), value in sums.items():
        by_sum.setdefault((session, step, offset), {})[rank] = value
    ranks = max((len(v) for v in by_sum.values()), default=0)
    whole = {k: v for k, v in by_sum.items() if len(v) == ranks and ranks > 1}
    steps = sorted({(session, step) for session, step, _ in whole})[skip:]
    out = []
    for half in ("first", "second"):
        late, last_own, way, waits = [], [], [], []
        for session, step in steps:
            offsets = sorted(o for s, t, o in whole if (s, t) == (session, step))
            middle = len(offsets) // 2
            for offset in offsets[:middle] if half == "first" else offsets[middle:]:
                taken = whole[(session, step, offset)]
                last = max(began for began, _, _ in taken.values())
                for rank, (began, ended, pid) in taken.items():
                    late.append(last - began)
                    waits.append(ended - began)
                    for sender, (sent, _, _) in taken.items():
                        when = parts.get((session, step, offset + sender, pid))
                        if sender != rank and when is not None:
                            way.append(when - sent)
                began, ended, _ = max(taken.values())
                last_own.append(ended - began)
        if not waits:
            continue
        way.sort()
        out.append({
            "half": half, "ranks": ranks, "steps": len(steps), "sums": len(last_own),
            "wait_ms": 1e3 * statistics.mean(waits), "late_ms": 1e3 * statistics.mean(late),
            "last_own_ms": 1e3 * statistics.mean(last_own),
            "part_way_median_ms": 1e3 * statistics.median(way) if way else None,
            "part_way_p90_ms": 1e3 * way[int(0.9 * (len(way) - 1))] if way else None,
        })  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path, help="the folder HETCONV_SUM_LOG named")
    p.add_argument("--skip", type=int, default=2, help="first steps left out (default 2)")
    p.add_argument("--json", metavar="PATH", help="also write the rows here")
    args = p.parse_args(argv)
    if not args.folder.is_dir():
        sys.exit(f"sum_waits.py: {args.folder} is not a folder")
    if args.skip < 0:
        sys.exit(f"sum_waits.py: --skip must be >= 0, got {args.skip}")
    found = rows(*read(args.folder), args.skip)
    if not found:
        sys.exit(f"sum_waits.py: no sum that every rank took in {args.folder} (after --skip "
                 f"{args.skip} steps): was HETCONV_SUM_LOG set for the workers?")  # fmt: skip
    print("half    ranks steps  sums | wait ms  late ms  last own ms | part way ms median  p90")
    for r in found:
        way = r["part_way_median_ms"], r["part_way_p90_ms"]
        way_text = "-" if way[0] is None else f"{way[0]:.2f}  {way[1]:.2f}"
        print(f"{r['half']:<7} {r['ranks']:>5} {r['steps']:>5} {r['sums']:>5} | "
              f"{r['wait_ms']:7.2f}  {r['late_ms']:7.2f}  {r['last_own_ms']:11.2f} | "
              f"{way_text:>19}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(found, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
