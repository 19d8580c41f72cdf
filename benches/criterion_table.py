#!/usr/bin/env python3
"""Turns the criterion results of one `cargo bench` run into a markdown table.

    criterion_table.py CRITERION_DIR SINCE_EPOCH [--results RESULTS.md --stamp TEXT]

Reads every `*/new/benchmark.json` under CRITERION_DIR written at or after SINCE_EPOCH (the
benches of this run, not older ones criterion keeps), with its `estimates.json`: the median
time per iteration and, from the throughput, the rate (IOPS for element counts, GiB/s for
bytes). Prints the table; with --results, also replaces the text between the two marker
lines of RESULTS.md with STAMP and the table. Standard library only.
"""
import json
import os
import sys

BEGIN = "<!-- criterion table: written by benches/seeds.sh, do not edit by hand -->"
END = "<!-- end of criterion table -->"


def fmt_time(ns):
    for unit, scale in (("s", 1e9), ("ms", 1e6), ("µs", 1e3)):
        if ns >= scale:
            return f"{ns / scale:.3g} {unit}"
    return f"{ns:.3g} ns"


def fmt_rate(throughput, ns):
    if not throughput or ns <= 0:
        return "-"
    if "Elements" in throughput:
        rate = throughput["Elements"] * 1e9 / ns
        return f"{rate / 1e3:.2f} k IOPS" if rate >= 1e3 else f"{rate:.0f} IOPS"
    if "Bytes" in throughput:
        return f"{throughput['Bytes'] * 1e9 / ns / (1 << 30):.2f} GiB/s"
    return "-"


def rows(root, since):
    found = []
    for dirpath, _, files in os.walk(root):
        if os.path.basename(dirpath) != "new" or "benchmark.json" not in files:
            continue
        bench = os.path.join(dirpath, "benchmark.json")
        if os.path.getmtime(bench) < since:
            continue
        with open(bench) as f:
            meta = json.load(f)
        with open(os.path.join(dirpath, "estimates.json")) as f:
            median = json.load(f)["median"]["point_estimate"]
        found.append((meta["full_id"], fmt_time(median), fmt_rate(meta.get("throughput"), median)))
    return sorted(found)


def table(found):
    out = ["| bench | median time per request or pass | rate |", "|---|---:|---:|"]
    out += [f"| {name} | {t} | {r} |" for name, t, r in found]
    return "\n".join(out) + "\n"


def main():
    args = sys.argv[1:]
    if len(args) < 2:
        sys.exit(__doc__)
    found = rows(args[0], float(args[1]))
    if not found:
        sys.exit("criterion_table.py: no criterion results written by this run")
    text = table(found)
    sys.stdout.write(text)
    if "--results" in args:
        path = args[args.index("--results") + 1]
        stamp = args[args.index("--stamp") + 1] if "--stamp" in args else ""
        with open(path) as f:
            doc = f.read()
        if BEGIN not in doc or END not in doc:
            sys.exit(f"criterion_table.py: {path} lacks the marker lines")
        head, rest = doc.split(BEGIN, 1)
        tail = rest.split(END, 1)[1]
        with open(path, "w") as f:
            f.write(f"{head}{BEGIN}\n{stamp}\n\n{text}{END}{tail}")


if __name__ == "__main__":
    main()
