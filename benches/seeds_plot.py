#!/usr/bin/env python3
"""Grouped bar charts as SVG for benches/seeds.sh, with python3's standard library only.

Usage: seeds_plot.py DATA.tsv OUTDIR

DATA.tsv has one value a line: PLOT <tab> X <tab> SERIES <tab> VALUE. Each PLOT becomes
OUTDIR/PLOT.svg: the X categories along the axis in the order they first appear, one bar per
SERIES in each, titles and axes from PLOTS below (a plot not listed there gets a plain one).
"""

import math
import sys
from collections import OrderedDict
from xml.sax.saxutils import escape

# name: (title, y axis label, logarithmic y axis)
PLOTS = {
    "alloc": ("4 KiB allocating writes over a fully written backing file", "IOPS", True),
    "noback-disk": ("4 KiB allocating writes, no backing file, disk", "IOPS", True),
    "noback-tmpfs": ("4 KiB allocating writes, no backing file, tmpfs", "IOPS", True),
    "slices-64k": ("4 KiB random reads, 64 KiB clusters: L2 cache / slice", "IOPS", True),
    "slices-256k": ("4 KiB random reads, 256 KiB clusters: L2 cache / slice", "IOPS", True),
    "chain-time": ("Chain: warm full re-read and convert time", "ms", True),
    "chain-rss": ("Chain: peak RSS", "MiB", False),
}

COLORS = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1",
          "#ff9da7", "#9c755f", "#bab0ac"]


def read(path):
    plots = OrderedDict()
    with open(path, encoding="utf-8") as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if len(parts) != 4:
                continue
            name, x, series, value = parts
            try:
                v = float(value)
            except ValueError:
                continue
            p = plots.setdefault(name, {"xs": [], "series": [], "v": {}})
            if x not in p["xs"]:
                p["xs"].append(x)
            if series not in p["series"]:
                p["series"].append(series)
            p["v"][(x, series)] = v
    return plots


def ticks(lo, hi, log):
    if log:
        return [10 ** e for e in range(int(math.floor(math.log10(lo))), int(math.ceil(math.log10(hi))) + 1)]
    step = 10 ** math.floor(math.log10(hi / 5)) if hi > 0 else 1
    for m in (1, 2, 5, 10):
        if hi / (step * m) <= 6:
            step *= m
            break
    return [i * step for i in range(int(hi / step) + 2)]


def fmt(v):
    if v >= 1e6:
        return "%gM" % (v / 1e6)
    if v >= 1e3:
        return "%gk" % (v / 1e3)
    return "%g" % v


def svg(name, p):
    title, ylabel, log = PLOTS.get(name, (name, "", False))
    xs, series, vals = p["xs"], p["series"], p["v"]
    positive = [v for v in vals.values() if v > 0]
    if not positive:
        return None
    log = log and max(positive) / min(positive) > 20
    hi = max(positive)
    lo = min(positive) if log else 0
    tk = ticks(lo, hi, log)
    top, bottom = tk[-1], tk[0]
    width = max(640, 90 + len(xs) * (len(series) * 12 + 18))
    height, left, right, ptop, pbottom = 420, 70, 20, 40, 70
    legend_h = 18 * ((len(series) + 2) // 3)
    height += legend_h
    ph = height - ptop - pbottom - legend_h
    pw = width - left - right

    def y(v):
        if log:
            v = max(v, bottom)
            f = (math.log10(v) - math.log10(bottom)) / (math.log10(top) - math.log10(bottom))
        else:
            f = (v - bottom) / (top - bottom) if top > bottom else 0
        return ptop + ph * (1 - f)

    out = ['<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="11">' % (width, height),
           '<rect width="100%" height="100%" fill="white"/>',
           '<text x="%d" y="20" font-size="14" text-anchor="middle">%s</text>' % (width // 2, escape(title))]
    for t in tk:
        yy = y(t)
        out.append('<line x1="%d" x2="%d" y1="%.1f" y2="%.1f" stroke="#ddd"/>' % (left, width - right, yy, yy))
        out.append('<text x="%d" y="%.1f" text-anchor="end">%s</text>' % (left - 4, yy + 4, fmt(t)))
    out.append('<text transform="translate(16,%d) rotate(-90)" text-anchor="middle">%s%s</text>'
               % (ptop + ph // 2, escape(ylabel), " (log scale)" if log else ""))
    group = pw / len(xs)
    bar = min(14.0, (group - 8) / len(series))
    for i, x in enumerate(xs):
        gx = left + i * group + (group - bar * len(series)) / 2
        for j, s in enumerate(series):
            v = vals.get((x, s))
            if v is None or v <= 0:
                continue
            yy = y(v)
            out.append('<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="%s"><title>%s, %s: %g</title></rect>'
                       % (gx + j * bar, yy, bar - 1, ptop + ph - yy, COLORS[j % len(COLORS)], escape(x), escape(s), v))
        out.append('<text x="%.1f" y="%d" text-anchor="middle">%s</text>' % (left + (i + 0.5) * group, ptop + ph + 16, escape(x)))
    out.append('<line x1="%d" x2="%d" y1="%d" y2="%d" stroke="black"/>' % (left, width - right, ptop + ph, ptop + ph))
    for j, s in enumerate(series):
        lx = left + (j % 3) * (pw / 3)
        ly = ptop + ph + 40 + 18 * (j // 3)
        out.append('<rect x="%.1f" y="%d" width="10" height="10" fill="%s"/>' % (lx, ly - 9, COLORS[j % len(COLORS)]))
        out.append('<text x="%.1f" y="%d">%s</text>' % (lx + 14, ly, escape(s)))
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    for name, p in read(sys.argv[1]).items():
        text = svg(name, p)
        if text is not None:
            with open("%s/%s.svg" % (sys.argv[2], name), "w", encoding="utf-8") as f:
                f.write(text)


if __name__ == "__main__":
    main()
