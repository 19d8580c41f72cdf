#!/usr/bin/env python3
"""Counts geometry parameters in function signatures under a folder: raw `u64` ones whose
name says they are an offset, cluster or table index, against typed ones (GuestOffset,
HostOffset, GuestCluster, HostCluster, L1Index...). Also counts the lines outside crates/format
that name one of format's bit-mask constants."""
import re, sys, pathlib
root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "crates/qcow2/src/engine")
GEOM = re.compile(r"^(_?)(offset|off|guest|host|cluster|clusters?_?index|host_off|guest_off|"
                  r"l1i|l2i|l1_index|l2_index|l1_idx|l2_idx|table|table_offset|block|block_offset|"
                  r"l2_offset|l1_offset|refblock|reftable_offset|start|end|pos|at|from|to|"
                  r"first|last|new_offset|old_offset|data_offset|src|dst|key|l2|l1|slot|index|idx|"
                  r"\w*_offset|\w*_off|\w*_cluster|\w*_host|\w*_guest|\w*_table|\w*_block)$")
TYPED = re.compile(r"\b(GuestOffset|HostOffset|GuestCluster|HostCluster|L1Index|L2Key)\b")
raw = typed = 0
rows = []
for p in sorted(root.rglob("*.rs")):
    text = p.read_text()
    for m in re.finditer(r"\bfn\s+\w+\s*(<[^>{]*>)?\s*\(", text):
        # take the parameter list up to the matching ')'
        i, depth = m.end(), 1
        while i < len(text) and depth:
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        params = text[m.end():i - 1]
        depth, cur, parts = 0, "", []
        for ch in params:
            if ch in "(<[": depth += 1
            if ch in ")>]": depth -= 1
            if ch == "," and depth == 0:
                parts.append(cur); cur = ""
            else:
                cur += ch
        parts.append(cur)
        for part in parts:
            if ":" not in part: continue
            name, ty = part.split(":", 1)
            name = name.strip().removeprefix("mut ").strip(); ty = ty.strip()
            if TYPED.search(ty):
                typed += 1
            elif re.fullmatch(r"&?(Option<)?(std::ops::)?(Range<)?u64>?>?", ty) and GEOM.match(name):
                raw += 1
                line = text.count("\n", 0, m.start()) + 1
                rows.append(f"{p}:{line}: {name}: {ty}")
if "-v" in sys.argv: print("\n".join(rows))
print(f"{root}: raw u64 geometry params {raw}, typed {typed}")

# Lines outside crates/format naming one of its bit-mask constants.
MASKS = re.compile(r"\b(L1_OFFSET_MASK|L1_COPIED|L1_RESERVED_MASK|L2_COPIED|L2_COMPRESSED|L2_ZERO|"
                   r"L2_OFFSET_MASK|L2_STANDARD_RESERVED_MASK|REFTABLE_RESERVED_MASK|"
                   r"REFTABLE_OFFSET_MASK|BITMAP_TABLE_OFFSET_MASK|BITMAP_TABLE_RESERVED_MASK)\b")
hits, files = 0, set()
for top in ("crates", "src", "tests", "fuzz/fuzz_targets", "benches"):
    for p in pathlib.Path(top).rglob("*.rs"):
        if p.parts[:2] == ("crates", "format"):
            continue
        for line in p.read_text().splitlines():
            if MASKS.search(line) and not line.lstrip().startswith("use "):
                hits += 1; files.add(p)
print(f"mask-constant lines outside crates/format (imports not counted): {hits} in {len(files)} files")
