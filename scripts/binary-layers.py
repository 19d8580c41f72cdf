#!/usr/bin/env python3
"""Checks the layers of the binary crate (src/): `tools` (the image tools) and `daemon` (the
server) are siblings that never import each other, and `common` (what both need) imports
neither. A file imports a module when its code (comments and strings aside) names it by path:
`crate::daemon`, `crate::tools`, or `super::` paths climbing out of its own tree.

Prints every offending line and exits 1 if there is any; exits 0 with one summary line
otherwise. Standard library only, so CI needs nothing installed.

    scripts/binary-layers.py [SRC_DIR]   (default: src)
"""
import os
import re
import sys

# What each top-level module of src/ must not name.
FORBIDDEN = {
    "tools": ["daemon"],
    "daemon": ["tools"],
    "common": ["tools", "daemon"],
}
COMMENT_RE = re.compile(r"//[^\n]*")
STRING_RE = re.compile(r'"(?:\\.|[^"\\])*"')


def offending(src):
    found = []
    for top, banned in FORBIDDEN.items():
        base = os.path.join(src, top)
        files = [base + ".rs"] if os.path.isfile(base + ".rs") else []
        for root, _, names in os.walk(base):
            files += [os.path.join(root, n) for n in names if n.endswith(".rs")]
        for path in sorted(files):
            with open(path, encoding="utf-8") as f:
                lines = f.read().split("\n")
            for n, line in enumerate(lines, 1):
                code = STRING_RE.sub('""', COMMENT_RE.sub("", line))
                for other in banned:
                    if re.search(r"\bcrate\s*::\s*" + other + r"\b", code) or re.search(
                        r"\bsuper\s*::\s*(?:super\s*::\s*)*" + other + r"\b", code
                    ) and path.startswith(os.path.join(src, top) + os.sep):
                        found.append(f"{path}:{n}: {top} imports {other}: {line.strip()}")
    return found


def main():
    src = sys.argv[1] if len(sys.argv) > 1 else "src"
    found = offending(src)
    for line in found:
        print(line)
    if found:
        print(f"{len(found)} imports across the binary's layers (tools, daemon, common)")
        return 1
    print("binary layers: tools and daemon never import each other; common imports neither")
    return 0


if __name__ == "__main__":
    sys.exit(main())
